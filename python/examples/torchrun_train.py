#!/usr/bin/env python3
"""Train the digits CNN with torchrun through a phub appliance: ``phub.torch.init()`` joins every rank.

    export PHUB_CONTROL_URL=http://127.0.0.1:7700     # phub-control
    torchrun --nproc-per-node=2 python/examples/torchrun_train.py --mode ddp

``phub.torch.init()`` reads torchrun's RANK, WORLD_SIZE and LOCAL_RANK and
phub's environment: ``PHUB_JOB`` + ``PHUB_TOKEN`` to join a job admitted
beforehand, or ``PHUB_JOB_SPEC`` (a spec file, e.g. written by
``--write-spec``) for rank 0 to admit one. With neither, this script hands
``init`` the spec of its own model (``phub.torch.job_spec``), which rank 0
admits. ``PHUB_CA_FILE`` names the CA for an ``https://`` control, and
``PHUB_OPERATOR_TOKEN`` the operator token admission may need, as for phubctl.

Modes:

- ``ddp``: DistributedDataParallel (gloo process group for DDP's own
  set-up), gradients averaged by phub's comm hook (a ``mean`` job),
  momentum SGD locally.
- ``server``: momentum SGD on the appliance (phub.torch.DistributedOptimizer).

``--device cuda`` puts each rank's model on GPU ``LOCAL_RANK`` (the comm
hook and the optimizer then stage through pinned host memory; see
phub.torch). Rank 0 prints the loss per epoch and a last line ``result
{json}`` (first and last loss, seconds, and the largest difference between
the ranks' final parameters, which must be 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_digits as td  # noqa: E402  # the data, the model and the batches

import phub.torch  # noqa: E402
from phub.local import exit_rank  # noqa: E402


def job_optimizer(mode: str, cfg: td.Config, model: nn.Module):  # type: ignore[no-untyped-def]
    return "mean" if mode == "ddp" else td.make_optimizer(cfg, model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["ddp", "server"], default="ddp")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (each rank on GPU LOCAL_RANK)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="per rank per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--write-spec", metavar="PATH",
                    help="write the job spec for --workers ranks (JSON, for PHUB_JOB_SPEC) and exit")
    ap.add_argument("--workers", type=int, default=2, help="with --write-spec: the job's ranks")
    a = ap.parse_args()
    cfg = td.Config(epochs=a.epochs, batch=a.batch, lr=a.lr, steps=a.steps)

    if a.write_spec:
        spec = phub.torch.job_spec(td.make_model(cfg.seed), a.workers,
                                   optimizer=job_optimizer(a.mode, cfg, td.make_model(0)), name=f"digits-{a.mode}")
        Path(a.write_spec).write_text(json.dumps(spec, indent=1) + "\n")
        print(f"wrote {a.write_spec}: {len(spec['keys'])} keys, {a.workers} workers, optimizer {spec['optimizer']}")
        return

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's env://; DDP needs it, and the check at the end uses it
    rank, world = dist.get_rank(), dist.get_world_size()
    model: nn.Module = td.make_model(cfg.seed)
    # Joins this rank: PHUB_JOB/PHUB_TOKEN, else PHUB_JOB_SPEC, else this spec (rank 0 admits it).
    session = phub.torch.init(spec=phub.torch.job_spec(model, world, optimizer=job_optimizer(a.mode, cfg, model),
                                                       name=f"digits-{a.mode}"))
    device = torch.device(f"cuda:{session.local_rank}" if a.device == "cuda" else a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = model.to(device)
    if a.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        phub.torch.register_comm_hook(model, session.worker)
        opt = td.make_optimizer(cfg, model.parameters())
    else:
        opt = phub.torch.DistributedOptimizer(td.make_optimizer(cfg, model.parameters()), session.worker)
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    x, y, xt, yt, what = td.load_data()
    x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    per_epoch = td.steps_per_epoch(len(y), world, cfg.batch)
    steps = td.total_steps(cfg, len(y), world)
    if rank == 0:
        print(f"torchrun: {world} ranks, job {session.job} ({'admitted by rank 0' if session.admitted else 'given'}), "
              f"{a.mode}, {device}, {what}, {steps} steps", flush=True)
    first = td.evaluate(plain, x, y)[0]
    started = time.perf_counter()
    for step in range(steps):
        idx = torch.from_numpy(td.rank_indices(len(y), world, cfg.batch, step, rank)).to(device)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if rank == 0 and ((step + 1) % per_epoch == 0 or step + 1 == steps):
            loss, acc = td.evaluate(plain, x, y)
            _, test_acc = td.evaluate(plain, xt, yt)
            print(f"  epoch {(step + 1) / per_epoch:4.1f}: loss {loss:.4f}, accuracy {100 * acc:5.1f}% "
                  f"(test {100 * test_acc:5.1f}%)", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    last = td.evaluate(plain, x, y)[0]
    # Every rank must end with the same parameters.
    flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).cpu()
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    diff = max(float((g - gathered[0]).abs().max()) for g in gathered)
    session.finish()  # rank 0 evicts a job it admitted once every rank is done
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} in {seconds:.1f} s ({1000 * seconds / max(steps, 1):.1f} ms/step); "
              f"ranks' parameters: max |difference| {diff:g}", flush=True)
        print("result " + json.dumps({"first_loss": first, "last_loss": last, "seconds": seconds, "steps": steps,
                                      "max_param_diff": diff, "job": session.job, "world": world}), flush=True)
    dist.destroy_process_group()
    # Ends the process without the interpreter's finalization, where
    # torch's gloo threads can abort it (phub.local.exit_rank).
    exit_rank(0)


if __name__ == "__main__":
    main()
