#!/usr/bin/env python3
"""One training step's gradient exchange for a ResNet-50-sized model, W workers:
phub (DDP comm hook) against gloo all-reduce, on this machine, in the same run.

Every worker process holds three copies of a model whose parameters have
ResNet-50's tensor sizes (torchvision's resnet50: 161 tensors, 25,557,032
floats, computed below from the architecture as tools/src/profiles.rs does),
each wrapped in DistributedDataParallel (25 MB buckets, gloo process group):

- ``no exchange``: a comm hook that returns the bucket at once (what the
  backward pass costs without any communication: the baseline);
- ``gloo``: DDP's default hook, all-reduce over gloo;
- ``phub``: phub.torch's comm hook through a local appliance (a ``mean`` job
  with one key per tensor);
- ``phub one by one``: the same hook with ``pipeline=False`` (over
  datagrams: each bucket's exchange starts once the one before has ended,
  where the default starts it as DDP hands the bucket over).

The model's forward is ``sum(p.sum())``, so backward only fills the gradients
and the step is dominated by the exchange. Each trial runs the three
back to back (a barrier before each); the figures are medians over trials.
``exchange`` is the step minus the no-exchange baseline. It also times the
bare exchange without DDP: ``dist.all_reduce`` over the same 25 MB buckets
against ``push_pull`` of every key then ``wait``, and against one
``Worker.exchange`` of every key (the arrays lent in place).

    python python/bench/bench_exchange.py --workers 2 --trials 10 [--shm]

With ``--shm`` the appliance's dataplane starts with ``--shm`` and phub's
workers (on this machine, ``shm="auto"``) pass chunks and results through
shared memory, sending headers only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import phub
import phub.torch
from bench_common import add_rank_args, free_port, memory_budget, profile_sizes, run_ranks
from phub.local import LocalAppliance


class Bag(nn.Module):
    """Parameters of the given sizes; forward = x * sum of every element."""

    def __init__(self, sizes: list[tuple[str, int]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(n)) for _, n in sizes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.stack([p.sum() for p in self.ps]).sum()


def no_exchange_hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def join_rank(rank: int, a: argparse.Namespace, control_url: str, job: int, token: str,
              port: int) -> tuple[list[tuple[str, int]], phub.Worker]:
    """A rank process's start: one torch thread, gloo's process group, the
    profile's sizes and the phub worker."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=a.workers)
    return profile_sizes(a.profile), phub.Worker.join(control_url, job, token, rank, window=a.window)


def worker(rank: int, a: argparse.Namespace, control_url: str, job: int, token: str, port: int, out: str) -> None:
    sizes, w = join_rank(rank, a, control_url, job, token, port)
    if a.shm and not w.shm:  # every rank sees the same appliance: all stop here
        raise SystemExit(f"--shm: phub rank {rank} did not get shared memory (see phub-dataplane's log)")
    total = sum(n for _, n in sizes)
    cap = int(a.bucket_mb * 2**20 / 4)
    bounds = list(range(0, total, cap)) + [total]
    flat = torch.ones(total)
    buckets = [flat[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    if a.bare_only:
        # No DDP: one buffer per rank, the gloo buckets and the phub keys
        # views of it (a model of 10^9 parameters is 4 GB a copy).
        models: dict[str, nn.parallel.DistributedDataParallel] = {}
        starts = np.cumsum([0] + [n for _, n in sizes])
        view = flat.numpy()
        grads = [view[lo:hi] for lo, hi in zip(starts, starts[1:])]
        for k, g in enumerate(grads):
            # Key by key, each followed by an untimed lent round: init
            # copies (the worker keeps a datagram and a result buffer of the
            # key until its next request), a lent round lets both go.
            w.init(k, g).wait()
            w.exchange([(k, g)])
    else:
        models = {name: nn.parallel.DistributedDataParallel(Bag(sizes), bucket_cap_mb=a.bucket_mb)
                  for name in ("no exchange", "gloo", "phub", "phub one by one")}
        models["no exchange"].register_comm_hook(None, no_exchange_hook)
        phub.torch.register_comm_hook(models["phub"], w)
        # The same keys, whose round 0 the first state ran.
        phub.torch.register_comm_hook(models["phub one by one"], w, init_keys=False, pipeline=False)
        # Keys are initialised (round 0) by the hook's state; the bare
        # rounds continue them, in the same order on every rank.
        grads = [np.ones(n, np.float32) for _, n in sizes]
    x = torch.ones(1)
    times: dict[str, list[float]] = {name: [] for name in models}
    times["bare gloo"] = []
    if not a.bare_only:
        times["bare phub"] = []
    times["bare phub exchange"] = []
    for trial in range(a.warmup + a.trials):
        for name, m in models.items():
            m.zero_grad()  # as a training step does, outside the timed part
            dist.barrier()
            t = time.perf_counter()
            m(x).backward()
            dt = time.perf_counter() - t
            if trial >= a.warmup:
                times[name].append(dt)
        dist.barrier()
        t = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in buckets]
        for wk in works:
            wk.wait()
        dt = time.perf_counter() - t
        if trial >= a.warmup:
            times["bare gloo"].append(dt)
        if not a.bare_only:
            dist.barrier()
            t = time.perf_counter()
            hs = [w.push_pull(k, g) for k, g in enumerate(grads)]
            for h in hs:
                h.wait()
            dt = time.perf_counter() - t
            if trial >= a.warmup:
                times["bare phub"].append(dt)
        # The same keys in one Worker.exchange, the arrays lent in place.
        dist.barrier()
        t = time.perf_counter()
        w.exchange(list(enumerate(grads)))
        dt = time.perf_counter() - t
        if trial >= a.warmup:
            times["bare phub exchange"].append(dt)
    # The exchanges must have been right: every gradient is 1 on every rank,
    # so the mean is 1.
    for name in ("gloo", "phub", "phub one by one"):  # 1.0 is exact in bf16 and f16 too
        for p in models[name].module.ps if name in models else []:
            assert torch.all(p.grad == 1.0), f"{name}: wrong averaged gradient"
    if a.bare_only:
        # Each trial's all-reduce sums W equal values, phub's means (the
        # rounds above too) keep them.
        want = float(a.workers) ** (a.warmup + a.trials)
        assert torch.all(flat == want), "bare exchanges: wrong sums"
    if rank == 0:
        s = w.stats()
        with open(out, "w") as f:
            json.dump(times, f)
        with open(out + ".txt", "w") as f:
            f.write(f"{s['retransmits']} {s['chunks_sent']}\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description="phub comm hook against gloo all-reduce, one step's exchange")
    add_rank_args(ap, lcores=1)  # phub-bench's default
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--busy-poll", action="store_true", help="dataplane lcores spin")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"],
                    help="phub's wire type (bf16/f16 halve the bytes but round the gradients; gloo stays f32)")
    ap.add_argument("--chunk-bytes", type=int, default=None, help="phub chunk (packet payload) size, <= 8832")
    ap.add_argument("--bare-only", action="store_true",
                    help="only the bare exchanges (no DDP models), gloo's and phub's on one buffer per rank: "
                         "for models too large for four DDP copies per rank")
    ap.add_argument("--shm", action="store_true",
                    help="phub-dataplane with --shm: the workers (shm='auto') pass chunks through shared memory")
    a = ap.parse_args()
    sizes = profile_sizes(a.profile)
    total = sum(n for _, n in sizes)
    print(f"phub vs gloo: one step's gradient exchange, {a.profile} ({len(sizes)} tensors, {total:,} floats, "
          f"{4 * total / 1e6:.1f} MB), W={a.workers} processes on this machine ({os.cpu_count()} CPUs), "
          f"DDP buckets {a.bucket_mb:g} MB, phub {a.dtype} on the wire, window {a.window or 'auto'}, "
          f"{a.lcores} dataplane lcores, {'shared memory' if a.shm else 'datagrams'}, "
          f"torch {torch.__version__}", flush=True)
    with LocalAppliance(lcores=a.lcores, memory_budget=memory_budget(total), busy_poll=a.busy_poll,
                        shm=a.shm) as app:
        spec = phub.admin.job_spec("bench", a.workers, sizes, optimizer="mean", dtype=a.dtype,
                                   chunk_bytes=a.chunk_bytes)
        job, token = app.admit(spec)
        with tempfile.TemporaryDirectory(prefix="phub-bench-") as tmp:
            out = str(Path(tmp) / "times.json")
            run_ranks(worker, a.workers, a, app.control_url, job, token, free_port(), out)
            times = json.loads(Path(out).read_text())
            retx, sent = Path(out + ".txt").read_text().split()
    med = {n: statistics.median(t) * 1000 for n, t in times.items()}
    lo = {n: min(t) * 1000 for n, t in times.items()}
    print(f"{'':28}{'median ms':>10}{'min ms':>10}")
    for n in times:
        print(f"  {n:26}{med[n]:10.1f}{lo[n]:10.1f}")
    mb = 4 * total / 1e6
    if a.bare_only:
        print(f"bare exchange (no DDP): gloo all_reduce {med['bare gloo']:.1f} ms, phub exchange (one call) "
              f"{med['bare phub exchange']:.1f} ms: phub/gloo = {med['bare phub exchange'] / med['bare gloo']:.2f}; "
              f"phub {mb / med['bare phub exchange']:.2f} GB/s of model")
        print(f"phub rank 0: {retx} retransmits of {sent} chunks sent")
        return
    base = med["no exchange"]
    eg, ep = med["gloo"] - base, med["phub"] - base
    print(f"DDP step (backward + exchange): gloo {med['gloo']:.1f} ms, phub {med['phub']:.1f} ms: "
          f"phub/gloo = {med['phub'] / med['gloo']:.2f}; buckets one by one {med['phub one by one']:.1f} ms: "
          f"{med['phub one by one'] / med['gloo']:.2f}")
    print(f"exchange alone (step - {base:.1f} ms baseline): gloo {eg:.1f} ms ({mb / eg * 1000 / 1000:.2f} GB/s), "
          f"phub {ep:.1f} ms ({mb / ep * 1000 / 1000:.2f} GB/s): gloo/phub speedup = {eg / ep:.2f}x")
    print(f"bare exchange (no DDP): gloo all_reduce {med['bare gloo']:.1f} ms, phub push_pull {med['bare phub']:.1f} ms: "
          f"gloo/phub speedup = {med['bare gloo'] / med['bare phub']:.2f}x; phub exchange (one call) "
          f"{med['bare phub exchange']:.1f} ms: {med['bare gloo'] / med['bare phub exchange']:.2f}x")
    # How much of the exchange backward hides: 1 - exposed / the bare exchange.
    hid = {n: 1 - (med[n] - base) / med[bare] for n, bare in
           (("gloo", "bare gloo"), ("phub", "bare phub exchange"), ("phub one by one", "bare phub exchange"))}
    print(f"overlap with backward (1 - (step - baseline) / bare exchange): gloo {100 * hid['gloo']:.0f}%, "
          f"phub {100 * hid['phub']:.0f}%, phub one by one {100 * hid['phub one by one']:.0f}%")
    print(f"phub rank 0: {retx} retransmits of {sent} chunks sent")


if __name__ == "__main__":
    main()
