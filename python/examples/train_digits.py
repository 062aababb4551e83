#!/usr/bin/env python3
"""Train a small CNN on scikit-learn's digits through a local phub appliance.

Starts phub-dataplane and phub-control (phub.local), admits a job with one
key per parameter tensor, and trains with W worker processes, rank 0
printing the loss and accuracy per epoch. Modes:

- ``ddp``: an ordinary DistributedDataParallel script (gloo process group,
  torch.optim.SGD with momentum locally) whose gradient buckets go through
  phub (a ``mean`` job) instead of gloo: two added lines, marked below.
- ``ddp-sum``: the same with a ``sum`` job (the hook divides by W).
- ``server``: the PHub way: the appliance runs the optimizer (momentum SGD by
  default, ``--optimizer`` for sgd, nesterov, adam, adamw); workers push
  gradients and receive parameters through phub.torch.DistributedOptimizer.
- ``gloo``: plain DDP over gloo, no phub (the reference the tests compare with).

The data: scikit-learn's digits (1797 8x8 images of 10 digits, shipped with
the package); without scikit-learn, a deterministic generated set of the same
shape. Run ``make demo-torch`` or
``python python/examples/train_digits.py --workers 2 --mode ddp``.

The training functions are importable (the tests in python/tests/torch use
them to compare phub with gloo and with one process).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import phub
import phub.torch
from phub.local import LocalAppliance, run_rank

MODES = ("ddp", "ddp-sum", "server", "gloo")


@dataclasses.dataclass
class Config:
    """The training set-up, the same in every process."""

    epochs: int = 6
    batch: int = 32  # per worker per step
    lr: float = 0.05
    momentum: float = 0.9
    optimizer: str = "momentum"  # sgd | momentum | nesterov | adam | adamw (local for ddp, on the appliance for server)
    seed: int = 1
    steps: Optional[int] = None  # stop after this many steps (tests)
    quiet: bool = False
    device: str = "cpu"  # cpu, or cuda (rank r on GPU r mod the GPU count)
    bucket_mb: Optional[float] = None  # DDP's bucket_cap_mb (None: DDP's default)
    pipeline: bool = True  # phub's hook: a bucket's exchange starts while earlier ones are on the wire
    overlap: bool = False  # server: push each gradient as backward makes it (DistributedOptimizer(overlap=True))


# -- data and model ----------------------------------------------------------

def generated_digits(n: int = 1797, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """8x8 'images' of 10 classes: a fixed random template per class plus
    noise; deterministic. Used when scikit-learn is missing."""
    rng = np.random.default_rng(seed)
    templates = rng.random((10, 8, 8)).astype(np.float32)
    y = np.arange(n) % 10
    x = templates[y] + 0.35 * rng.standard_normal((n, 8, 8)).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int64)


def load_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(x_train, y_train, x_test, y_test, description): 80/20 split, fixed."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)
        what = f"scikit-learn digits ({len(y)} 8x8 images)"
    except ImportError:
        x, y = generated_digits(seed=seed)
        what = f"generated digits ({len(y)} 8x8 images; scikit-learn not installed)"
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = len(y) // 5
    test, train = perm[:n_test], perm[n_test:]
    xt = torch.from_numpy(x).unsqueeze(1)
    yt = torch.from_numpy(y)
    return xt[train], yt[train], xt[test], yt[test], what


class Net(nn.Module):
    """A small CNN: two 3x3 convolutions, max-pooling, two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_model(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.optimizer in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.optimizer == "nesterov")
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr)
    raise SystemExit(f"--optimizer {cfg.optimizer!r}: one of sgd, momentum, nesterov, adam, adamw")


def steps_per_epoch(n_train: int, workers: int, batch: int) -> int:
    return n_train // (workers * batch)


def step_indices(n_train: int, workers: int, batch: int, step: int) -> np.ndarray:
    """The samples of one step for all workers together, rank 0's first:
    each epoch is a fresh fixed permutation."""
    per_epoch = steps_per_epoch(n_train, workers, batch)
    epoch, s = divmod(step, per_epoch)
    perm = np.random.default_rng(1000 + epoch).permutation(n_train)
    return perm[s * workers * batch:(s + 1) * workers * batch]


def rank_indices(n_train: int, workers: int, batch: int, step: int, rank: int) -> np.ndarray:
    return step_indices(n_train, workers, batch, step)[rank * batch:(rank + 1) * batch]


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(x)
        return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def flat_params(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy().copy()


def total_steps(cfg: Config, n_train: int, workers: int) -> int:
    n = cfg.epochs * steps_per_epoch(n_train, workers, cfg.batch)
    return n if cfg.steps is None else min(n, cfg.steps)


# -- one worker process -------------------------------------------------------

def worker_main(rank: int, workers: int, mode: str, cfg: Config, control_url: str, job: int, token: str,
                gloo_port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    x, y, xt, yt, _ = load_data()
    device = torch.device(cfg.device)
    if device.type == "cuda":  # one GPU per rank where there are several, else they share it
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    model: nn.Module = make_model(cfg.seed).to(device)
    worker = None
    if mode in ("ddp", "ddp-sum", "gloo"):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(gloo_port)
        dist.init_process_group("gloo", rank=rank, world_size=workers)
        buckets = {} if cfg.bucket_mb is None else {"bucket_cap_mb": cfg.bucket_mb}
        model = nn.parallel.DistributedDataParallel(model, **buckets)
        if mode != "gloo":
            worker = phub.Worker.join(control_url, job, token, rank)  # phub: + line 1
            phub.torch.register_comm_hook(model, worker, pipeline=cfg.pipeline)  # phub: + line 2
        opt = make_optimizer(cfg, model.parameters())
    else:
        worker = phub.Worker.join(control_url, job, token, rank)
        # The appliance runs this optimizer; the torch one only declares it.
        opt = phub.torch.DistributedOptimizer(make_optimizer(cfg, model.parameters()), worker, overlap=cfg.overlap)
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    per_epoch = steps_per_epoch(len(y), workers, cfg.batch)
    steps = total_steps(cfg, len(y), workers)
    started, exchange = time.perf_counter(), 0.0
    where = "opt.step() (the exchange)" if mode == "server" else "loss.backward() (with the exchange)"
    for step in range(steps):
        idx = torch.from_numpy(rank_indices(len(y), workers, cfg.batch, step, rank)).to(device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        t = time.perf_counter()
        loss.backward()  # with DDP, the gradient exchange happens here
        if mode == "server":
            t = time.perf_counter()
        opt.step()  # with DistributedOptimizer, here
        exchange += time.perf_counter() - t
        if rank == 0 and not cfg.quiet and ((step + 1) % per_epoch == 0 or step + 1 == steps):
            train_loss, train_acc = evaluate(plain, x, y)
            test_loss, test_acc = evaluate(plain, xt, yt)
            print(f"  epoch {(step + 1) / per_epoch:4.1f}: loss {train_loss:.4f}, accuracy {100 * train_acc:5.1f}% "
                  f"(test: loss {test_loss:.4f}, accuracy {100 * test_acc:5.1f}%), "
                  f"{1000 * exchange / (step + 1):.2f} ms/step in {where}", flush=True)
    if rank == 0:
        np.save(out_path, flat_params(plain))
        if worker is not None and not cfg.quiet:
            s = worker.stats()
            print(f"  rank 0: {s['chunks_sent']} chunks sent, {s['retransmits']} retransmits, "
                  f"{(s['bytes_sent'] + s['bytes_received']) / 1e6:.1f} MB exchanged, "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(target: Any, workers: int, args_of: Any) -> None:
    """Runs ``target(*args_of(rank))`` in a spawned process per rank and
    waits for all; raises naming every rank that did not exit with 0."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    # Each rank ends through phub.local.exit_rank: torch's gloo threads can
    # abort a process whose interpreter finalizes while they still hold
    # its last collective's work.
    procs = [ctx.Process(target=run_rank, args=(target, *args_of(r))) for r in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError("; ".join(bad))


def job_optimizer(mode: str, cfg: Config, model: nn.Module) -> Any:
    if mode == "ddp":
        return "mean"
    if mode == "ddp-sum":
        return "sum"
    return make_optimizer(cfg, model.parameters())  # translated by phub.torch.job_spec


def run(mode: str, workers: int, cfg: Config, appliance: Optional[LocalAppliance] = None) -> np.ndarray:
    """Trains with ``workers`` processes; returns rank 0's final parameters (flat).
    Starts a local appliance unless one is given (not needed for ``gloo``)."""
    if mode not in MODES:
        raise SystemExit(f"--mode {mode!r}: one of {', '.join(MODES)}")
    own = appliance is None and mode != "gloo"
    app = LocalAppliance(lcores=2).start() if own else appliance
    try:
        control_url, job, token = "", 0, ""
        if mode != "gloo":
            assert app is not None
            spec = phub.torch.job_spec(make_model(cfg.seed), workers, optimizer=job_optimizer(mode, cfg, make_model(0)),
                                       name=f"digits-{mode}")
            job, token = app.admit(spec)
            control_url = app.control_url
        with tempfile.TemporaryDirectory(prefix="phub-digits-") as tmp:
            out = str(Path(tmp) / "params.npy")
            port = free_port()
            run_ranks(worker_main, workers, lambda r: (r, workers, mode, cfg, control_url, job, token, port, out))
            return np.load(out)
    finally:
        if own and app is not None:
            app.stop()


def train_single(cfg: Config, workers: int, averaged: bool = False) -> np.ndarray:
    """One process, torch.optim. By default on the concatenation of the W
    workers' batches (the mean loss over W*batch samples has the W workers'
    averaged gradient, up to rounding). ``averaged``: on the W workers'
    gradients, each computed on its own batch as the workers do, summed and
    divided by W (the same arithmetic as the appliance's mean). On
    ``cfg.device`` (cuda: the same kernels as the workers' on the GPU)."""
    torch.set_num_threads(1)
    device = torch.device(cfg.device)
    x, y, _, _, _ = load_data()
    x, y = x.to(device), y.to(device)
    model = make_model(cfg.seed).to(device)
    opt = make_optimizer(cfg, model.parameters())
    params = list(model.parameters())
    for step in range(total_steps(cfg, len(y), workers)):
        opt.zero_grad()
        if not averaged:
            idx = torch.from_numpy(step_indices(len(y), workers, cfg.batch, step)).to(device)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
        else:
            total = [torch.zeros_like(p) for p in params]
            for r in range(workers):
                idx = torch.from_numpy(rank_indices(len(y), workers, cfg.batch, step, r)).to(device)
                grads = torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), params)
                for t, g in zip(total, grads):
                    t.add_(g)
            for p, t in zip(params, total):
                p.grad = t / workers
        opt.step()
    return flat_params(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mode", choices=MODES, default="ddp")
    ap.add_argument("--epochs", type=int, default=Config.epochs)
    ap.add_argument("--batch", type=int, default=Config.batch)
    ap.add_argument("--lr", type=float, default=None, help="default 0.05 (0.005 for adam/adamw)")
    ap.add_argument("--optimizer", default=Config.optimizer, help="sgd | momentum | nesterov | adam | adamw")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the workers' models and batches on the GPU)")
    a = ap.parse_args()
    lr = a.lr if a.lr is not None else (0.005 if a.optimizer in ("adam", "adamw") else Config.lr)
    cfg = Config(epochs=a.epochs, batch=a.batch, lr=lr, optimizer=a.optimizer, device=a.device)
    _, y, _, _, what = load_data()
    n = sum(p.numel() for p in make_model(cfg.seed).parameters())
    where = {"ddp": f"DDP, gradients averaged by phub (mean), {cfg.optimizer} locally",
             "ddp-sum": f"DDP, gradients summed by phub, {cfg.optimizer} locally",
             "server": f"{cfg.optimizer} on the appliance (DistributedOptimizer)",
             "gloo": f"DDP over gloo (no phub), {cfg.optimizer} locally"}[a.mode]
    print(f"phub torch demo: a CNN ({n} parameters in 8 tensors) on {what}, {a.workers} worker processes, "
          f"{where}, {cfg.device}, lr {cfg.lr}, {cfg.epochs} epochs of {steps_per_epoch(len(y), a.workers, cfg.batch)} steps",
          flush=True)
    t = time.perf_counter()
    params = run(a.mode, a.workers, cfg)
    print(f"done in {time.perf_counter() - t:.1f} s; rank 0's parameters: {params.size} values, "
          f"norm {float(np.linalg.norm(params)):.4f}")


if __name__ == "__main__":
    main()
