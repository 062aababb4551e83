#!/usr/bin/env python3
"""A DLRM-style click model with its embedding tables on a phub appliance.

The shape of Meta's DLRM, scaled to a small machine: ``--tables``
categorical features, each an embedding table of ``--rows`` rows of
``--dim`` values looked up by Zipf-distributed ids, 13 dense features
through a bottom MLP, the embeddings and the bottom MLP's output
concatenated into a top MLP, a click probability out. W worker processes
train it two ways on the same data:

- ``phub``: each table is a sparse table of a phub job (``kind =
  "table"``, Adagrad on the appliance) behind ``phub.torch.EmbeddingBag``:
  forward pulls the batch's distinct rows, backward pushes their gradients
  (divided by W, so that the appliance's sum is DDP's mean); the MLPs go
  through DDP with phub's comm hook (a ``mean`` job), SGD locally.
- ``gloo``: what PyTorch users run instead: ``nn.EmbeddingBag(sparse=True)``
  in every process, DDP over gloo all-reducing the dense and the sparse
  gradients, ``torch.optim.Adagrad`` on the tables and SGD on the MLPs.

Both start from the same MLP weights (the tables start from their own
random rows: the appliance's initial values are its own), see the same
batches, and print the held-out log-loss and the time per step. Run
``python python/examples/dlrm_lite.py --workers 2`` (needs torch; the
binaries from ``$PHUB_BIN_DIR`` or target/release, as phub.local finds
them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import phub
import phub.torch
from phub.local import LocalAppliance
from train_digits import free_port, run_ranks  # the same directory: spawning W ranks

MODES = ("phub", "gloo")
DENSE = 13


@dataclasses.dataclass
class Config:
    tables: int = 8
    rows: int = 100_000  # ids per table
    dim: int = 16
    zipf: float = 1.05
    batch: int = 256  # per worker per step
    steps: int = 300
    lr_dense: float = 0.1
    lr_table: float = 0.05
    examples: int = 200_000
    test: int = 20_000
    seed: int = 1


def make_data(cfg: Config, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n examples: dense features (n, 13), ids (n, tables) and 0/1 clicks
    from a hidden model (a weight per id and a linear term)."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, cfg.rows + 1, dtype=np.float64) ** -cfg.zipf
    p /= p.sum()
    ids = rng.choice(cfg.rows, size=(n, cfg.tables), p=p).astype(np.int64)
    dense = rng.normal(size=(n, DENSE)).astype(np.float32)
    hidden = np.random.default_rng(12345)
    w_id = hidden.normal(0, 0.7, size=(cfg.tables, cfg.rows))
    w_dense = hidden.normal(0, 0.3, size=DENSE)
    logit = w_id[np.arange(cfg.tables), ids].sum(axis=1) + dense @ w_dense - 1.0
    clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return dense, ids, clicks


class Model(nn.Module):
    def __init__(self, cfg: Config, embeddings: list[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, cfg.dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear((cfg.tables + 1) * cfg.dim, 64), nn.ReLU(), nn.Linear(64, 1))
        self.embeddings = nn.ModuleList(embeddings)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        parts = [self.bottom(dense)]
        for t, e in enumerate(self.embeddings):
            parts.append(e(ids[:, t:t + 1]))  # bags of one id
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient divided by ``w`` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: float) -> torch.Tensor:  # type: ignore[override]
        ctx.w = w
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g / ctx.w, None


class MeanBag(nn.Module):
    """phub.torch.EmbeddingBag whose pushed gradient is the rank's share of
    the mean over W ranks (the appliance sums the W pushes)."""

    def __init__(self, worker: phub.Worker, table: str, workers: int) -> None:
        super().__init__()
        self.bag = phub.torch.EmbeddingBag(worker, table, mode="sum")
        self.workers = workers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(self.bag(ids), float(self.workers))


def tables_spec(cfg: Config, workers: int) -> dict:
    keys = [{"name": f"t{i}", "kind": "table", "dim": cfg.dim, "rows": cfg.rows, "seed": cfg.seed,
             "init": {"kind": "uniform", "a": -0.05, "b": 0.05},
             "optimizer": {"kind": "adagrad", "lr": cfg.lr_table, "eps": 1e-10}} for i in range(cfg.tables)]
    return phub.admin.job_spec("dlrm-tables", workers, keys, optimizer="sum")


def log_loss(model: nn.Module, dense: np.ndarray, ids: np.ndarray, clicks: np.ndarray) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(dense), torch.from_numpy(ids))
        loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(clicks))
    model.train()
    return float(loss)


def worker_main(rank: int, workers: int, mode: str, cfg: Config, control_url: str, dense_job: tuple[int, str],
                table_job: tuple[int, str], gloo_port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    dense, ids, clicks = make_data(cfg, cfg.examples, cfg.seed)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(gloo_port)
    dist.init_process_group("gloo", rank=rank, world_size=workers)
    if mode == "phub":
        tables = phub.Worker.join(control_url, table_job[0], table_job[1], rank)
        embeddings: list[nn.Module] = [MeanBag(tables, f"t{i}", workers) for i in range(cfg.tables)]
    else:
        torch.manual_seed(cfg.seed + 1)
        embeddings = [nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum", sparse=True) for _ in range(cfg.tables)]
        for e in embeddings:
            nn.init.uniform_(e.weight, -0.05, 0.05)
    model = Model(cfg, embeddings)
    ddp = nn.parallel.DistributedDataParallel(model)
    if mode == "phub":
        worker = phub.Worker.join(control_url, dense_job[0], dense_job[1], rank)
        phub.torch.register_comm_hook(ddp, worker)
        opts = [torch.optim.SGD(model.parameters(), lr=cfg.lr_dense)]
    else:
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings")]
        table_params = [p for n, p in model.named_parameters() if n.startswith("embeddings")]
        opts = [torch.optim.SGD(dense_params, lr=cfg.lr_dense),
                torch.optim.Adagrad(table_params, lr=cfg.lr_table, eps=1e-10)]
    per_step = workers * cfg.batch
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        at = (step * per_step + rank * cfg.batch) % (cfg.examples - cfg.batch)
        sl = slice(at, at + cfg.batch)
        for o in opts:
            o.zero_grad()
        logits = ddp(torch.from_numpy(dense[sl]), torch.from_numpy(ids[sl]))
        F.binary_cross_entropy_with_logits(logits, torch.from_numpy(clicks[sl])).backward()
        for o in opts:
            o.step()
    seconds = time.perf_counter() - t0
    if rank == 0:
        test = make_data(cfg, cfg.test, cfg.seed + 100)
        np.save(out_path, np.array([log_loss(model, *test), seconds / cfg.steps]))
    dist.barrier()
    dist.destroy_process_group()


def run(mode: str, workers: int, cfg: Config, app: Optional[LocalAppliance] = None) -> tuple[float, float]:
    """Trains with ``workers`` processes; returns the held-out log-loss
    and the seconds per step."""
    own = app is None and mode == "phub"
    app = LocalAppliance(lcores=2).start() if own else app
    try:
        control_url, dense_job, table_job = "", (0, ""), (0, "")
        if mode == "phub":
            assert app is not None
            control_url = app.control_url
            dense_job = app.admit(phub.torch.job_spec(Model(cfg, []), workers, optimizer="mean", name="dlrm-mlp"))
            table_job = app.admit(tables_spec(cfg, workers))
        with tempfile.TemporaryDirectory(prefix="phub-dlrm-") as tmp:
            out = str(Path(tmp) / "out.npy")
            port = free_port()
            run_ranks(worker_main, workers,
                      lambda r: (r, workers, mode, cfg, control_url, dense_job, table_job, port, out))
            loss, per_step = np.load(out)
            return float(loss), float(per_step)
    finally:
        if own and app is not None:
            app.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--tables", type=int, default=Config.tables)
    ap.add_argument("--rows", type=int, default=Config.rows)
    ap.add_argument("--mode", choices=MODES + ("both",), default="both")
    a = ap.parse_args()
    cfg = Config(steps=a.steps, tables=a.tables, rows=a.rows)
    print(f"DLRM-style model: {cfg.tables} tables of {cfg.rows} rows x {cfg.dim}, Zipf {cfg.zipf}, "
          f"{a.workers} workers, {cfg.steps} steps of {cfg.batch} examples each")
    for mode in (MODES if a.mode == "both" else (a.mode,)):
        loss, per_step = run(mode, a.workers, cfg)
        label = "tables on phub, MLPs through the comm hook" if mode == "phub" else \
            "DDP over gloo, sparse=True embeddings, Adagrad"
        print(f"  {mode:5} ({label}): held-out log-loss {loss:.4f}, {1000 * per_step:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
