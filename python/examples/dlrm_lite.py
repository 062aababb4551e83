#!/usr/bin/env python3
"""A DLRM-style click model with its embedding tables on a phub appliance.

The shape of Meta's DLRM: categorical features, each an embedding table
looked up by Zipf-distributed ids, 13 dense features through a bottom MLP,
the embeddings and the bottom MLP's output concatenated into a top MLP, a
click probability out. ``--size small`` (the default) scales it to a small
machine: ``--tables`` tables of ``--rows`` rows of 16 values; ``--size
full`` is the size of DLRM's click-log benchmarks: 26 tables of 10^6 to
10^7 rows (log-spaced), 64 values a row for tables under 1.3 M rows, 32
under 2.5 M, 16 above (7 GiB of f32 rows in all), with SGD on the tables
(``torch.optim.Adagrad`` keeps a dense accumulator beside every table,
which would not fit twice on a 24 GiB machine). W worker processes train
it two ways on the same data:

- ``phub``: each table is a sparse table of a phub job (``kind =
  "table"``, Adagrad on the appliance) behind ``phub.torch.EmbeddingBag``:
  forward pulls the batch's distinct rows (every table's pull started
  before the first is needed, ``prefetch``; ``--no-prefetch`` pulls each in
  its turn), backward pushes their gradients (divided by W, so that the
  appliance's sum is DDP's mean); the MLPs go through DDP with phub's comm
  hook (a ``mean`` job), SGD locally. ``--table-consistency async`` (or a
  bound τ) makes the tables' job asynchronous: a rank's push is answered
  once applied, without waiting for the other ranks' (gloo has no such
  mode).
- ``gloo``: what PyTorch users run instead: ``nn.EmbeddingBag(sparse=True)``
  in every process, DDP over gloo all-reducing the dense and the sparse
  gradients, ``torch.optim.Adagrad`` (or SGD) on the tables and SGD on
  the MLPs.

Both start from the same MLP weights (the tables start from their own
random rows: the appliance's initial values are its own), see the same
batches, and print the held-out log-loss, the time per step and the
peak memory of a rank (and of the appliance's dataplane). Run
``python python/examples/dlrm_lite.py --workers 2`` (needs torch; the
binaries from ``$PHUB_BIN_DIR`` or target/release, as phub.local finds
them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
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
    rows: tuple[int, ...] = (100_000,) * 8  # ids per table
    dims: tuple[int, ...] = (16,) * 8  # values per row
    bottom: int = 16  # the bottom MLP's output
    zipf: float = 1.05
    batch: int = 256  # per worker per step
    steps: int = 300
    lr_dense: float = 0.1
    table_optimizer: str = "adagrad"  # or "sgd"
    lr_table: float = 0.05
    examples: int = 200_000
    test: int = 20_000
    seed: int = 1
    prefetch: bool = True
    #: The tables' job: None (BSP, each rank's push waits for every rank's
    #: round), "async" or a bound τ (bounded delay).
    table_consistency: Optional[object] = None
    #: Stop the clock at this held-out log-loss: every rank evaluates
    #: ``eval_examples`` held-out examples every ``eval_every`` steps (not
    #: timed), and the first evaluation at or under it is reported.
    target_loss: Optional[float] = None
    eval_every: int = 50
    eval_examples: int = 5_000

    @property
    def tables(self) -> int:
        return len(self.rows)


def small(tables: int = 8, rows: int = 100_000) -> Config:
    return Config(rows=(rows,) * tables, dims=(16,) * tables)


def full() -> Config:
    """26 tables of 10^6 to 10^7 rows, log-spaced; wider rows on the
    smaller tables; SGD on the tables (see the module's docstring)."""
    rows = tuple(int(round(10 ** (6 + t / 25))) for t in range(26))
    dims = tuple(64 if r < 1_300_000 else 32 if r < 2_500_000 else 16 for r in rows)
    return Config(rows=rows, dims=dims, table_optimizer="sgd", lr_table=2.0)


def zipf_ids(rng: np.random.Generator, rows: int, s: float, n: int) -> np.ndarray:
    """n ids in [0, rows), id k drawn with probability proportional to
    (k + 1)^-s (inverse CDF)."""
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), rows - 1).astype(np.int64)


def hidden_weight(table: int, ids: np.ndarray) -> np.ndarray:
    """The hidden model's weight of each id of a table: 0.7 times a normal
    variate made from a hash of (table, id) (splitmix64, Box-Muller), so
    that no table of 10^7 weights is kept."""
    def mix(z: np.ndarray) -> np.ndarray:
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        base = ids.astype(np.uint64) * np.uint64(2) + np.uint64(table) * np.uint64(0x9E3779B97F4A7C15)
        u1 = (mix(base) >> np.uint64(11)).astype(np.float64) / 2.0**53
        u2 = (mix(base + np.uint64(1)) >> np.uint64(11)).astype(np.float64) / 2.0**53
    return 0.7 * np.sqrt(-2 * np.log1p(-u1)) * np.cos(2 * np.pi * u2)


def make_data(cfg: Config, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n examples: dense features (n, 13), ids (n, tables) and 0/1 clicks
    from a hidden model (a weight per id and a linear term)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([zipf_ids(rng, r, cfg.zipf, n) for r in cfg.rows], axis=1)
    dense = rng.normal(size=(n, DENSE)).astype(np.float32)
    w_dense = np.random.default_rng(12345).normal(0, 0.3, size=DENSE)
    logit = sum(hidden_weight(t, ids[:, t]) for t in range(cfg.tables)) + dense @ w_dense - 1.0
    clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return dense, ids, clicks


class Model(nn.Module):
    def __init__(self, cfg: Config, embeddings: list[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, cfg.bottom), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(cfg.bottom + sum(cfg.dims), 64), nn.ReLU(), nn.Linear(64, 1))
        self.embeddings = nn.ModuleList(embeddings)
        self.prefetch = cfg.prefetch

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        bags = [ids[:, t:t + 1] for t in range(len(self.embeddings))]  # bags of one id
        if self.prefetch:
            for e, b in zip(self.embeddings, bags):
                if isinstance(e, MeanBag):
                    e.bag.prefetch(b)  # every table's pull in flight before the first is needed
        parts = [self.bottom(dense)]
        for e, b in zip(self.embeddings, bags):
            parts.append(e(b))
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
    opt = {"kind": "adagrad", "lr": cfg.lr_table, "eps": 1e-10} if cfg.table_optimizer == "adagrad" else \
        {"kind": "sgd", "lr": cfg.lr_table}
    keys = [{"name": f"t{i}", "kind": "table", "dim": d, "rows": r, "seed": cfg.seed,
             "init": {"kind": "uniform", "a": -0.05, "b": 0.05}, "optimizer": opt}
            for i, (r, d) in enumerate(zip(cfg.rows, cfg.dims))]
    return phub.admin.job_spec("dlrm-tables", workers, keys, optimizer="sum", consistency=cfg.table_consistency)


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
        embeddings = [nn.EmbeddingBag(r, d, mode="sum", sparse=True, _weight=torch.empty(r, d).uniform_(-0.05, 0.05))
                      for r, d in zip(cfg.rows, cfg.dims)]
    model = Model(cfg, embeddings)
    ddp = nn.parallel.DistributedDataParallel(model)
    if mode == "phub":
        worker = phub.Worker.join(control_url, dense_job[0], dense_job[1], rank)
        phub.torch.register_comm_hook(ddp, worker)
        opts = [torch.optim.SGD(model.parameters(), lr=cfg.lr_dense)]
    else:
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings")]
        table_params = [p for n, p in model.named_parameters() if n.startswith("embeddings")]
        table_opt = torch.optim.Adagrad(table_params, lr=cfg.lr_table, eps=1e-10) \
            if cfg.table_optimizer == "adagrad" else torch.optim.SGD(table_params, lr=cfg.lr_table)
        opts = [torch.optim.SGD(dense_params, lr=cfg.lr_dense), table_opt]
    per_step = workers * cfg.batch
    probe = make_data(cfg, cfg.eval_examples, cfg.seed + 200) if cfg.target_loss is not None else None
    seconds, reached = 0.0, (-1.0, -1.0)  # (step, training seconds) where target_loss was met
    for step in range(cfg.steps):
        t = time.perf_counter()
        at = (step * per_step + rank * cfg.batch) % (cfg.examples - cfg.batch)
        sl = slice(at, at + cfg.batch)
        for o in opts:
            o.zero_grad()
        logits = ddp(torch.from_numpy(dense[sl]), torch.from_numpy(ids[sl]))
        F.binary_cross_entropy_with_logits(logits, torch.from_numpy(clicks[sl])).backward()
        for o in opts:
            o.step()
        seconds += time.perf_counter() - t
        if probe is not None and reached[0] < 0 and (step + 1) % cfg.eval_every == 0:
            # Every rank evaluates, so that they stay in step; not timed.
            assert cfg.target_loss is not None
            if log_loss(model, *probe) <= cfg.target_loss:
                reached = (float(step + 1), seconds)
    if rank == 0:
        test = make_data(cfg, cfg.test, cfg.seed + 100)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        np.save(out_path, np.array([log_loss(model, *test), seconds / cfg.steps, peak, *reached]))
    dist.barrier()
    dist.destroy_process_group()


@dataclasses.dataclass
class Outcome:
    loss: float  # held-out log-loss
    step_s: float  # seconds a step
    rank_peak: int  # rank 0's peak RSS, bytes
    dataplane_peak: int  # the appliance's dataplane's peak RSS, bytes (0 for gloo)
    reached: Optional[tuple[int, float]] = None  # (step, training seconds) at Config.target_loss


def peak_rss(pid: int) -> int:
    """A process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(mode: str, workers: int, cfg: Config, app: Optional[LocalAppliance] = None,
        memory_budget: str = "1GiB") -> Outcome:
    """Trains with ``workers`` processes (a local appliance of
    ``memory_budget`` unless ``app`` is given)."""
    own = app is None and mode == "phub"
    app = LocalAppliance(lcores=2, memory_budget=memory_budget).start() if own else app
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
            loss, per_step, peak, at_step, at_s = np.load(out)
            dp = 0
            if mode == "phub" and own:
                assert app is not None
                dp = peak_rss(app.pid("phub-dataplane"))
            reached = (int(at_step), float(at_s)) if at_step >= 0 else None
            return Outcome(float(loss), float(per_step), int(peak), dp, reached)
    finally:
        if own and app is not None:
            app.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", choices=("small", "full"), default="small")
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--tables", type=int, default=8, help="--size small: how many tables")
    ap.add_argument("--rows", type=int, default=100_000, help="--size small: rows a table")
    ap.add_argument("--no-prefetch", action="store_true", help="pull each table in its turn in forward")
    ap.add_argument("--table-consistency", default="bsp",
                    help="the tables' job on phub: bsp, async, or a bound τ for bounded delay (gloo: always "
                         "synchronous)")
    ap.add_argument("--memory-budget", default=None,
                    help="the local appliance's (default 1GiB small, 10GiB full: admission charges a "
                         "table by its rows, stored or not)")
    ap.add_argument("--target-loss", type=float, default=None,
                    help="report the step and training time at which the held-out log-loss (5,000 examples, "
                         "every 50 steps, not timed) first reaches this")
    ap.add_argument("--mode", choices=MODES + ("both",), default="both")
    a = ap.parse_args()
    cfg = small(a.tables, a.rows) if a.size == "small" else full()
    tc = a.table_consistency
    if tc not in ("bsp", "async") and not tc.isdigit():
        ap.error(f"--table-consistency {tc!r}: bsp, async or a bound (an integer)")
    table_consistency = None if tc == "bsp" else "async" if tc == "async" else int(tc)
    cfg = dataclasses.replace(cfg, steps=a.steps, prefetch=not a.no_prefetch, table_consistency=table_consistency,
                              target_loss=a.target_loss)
    budget = a.memory_budget or ("1GiB" if a.size == "small" else "10GiB")
    shape = f"{cfg.tables} tables of {cfg.rows[0]:,}" + (f" to {max(cfg.rows):,}" if len(set(cfg.rows)) > 1 else "")
    dims = "/".join(str(d) for d in sorted(set(cfg.dims), reverse=True))
    gib = sum(r * d for r, d in zip(cfg.rows, cfg.dims)) * 4 / 2**30
    print(f"DLRM-style model: {shape} rows x {dims} ({gib:.2f} GiB of f32 rows), Zipf {cfg.zipf}, "
          f"{cfg.table_optimizer} on the tables, {a.workers} workers, {cfg.steps} steps of {cfg.batch} "
          f"examples each", flush=True)
    mib = 2**20
    for mode in (MODES if a.mode == "both" else (a.mode,)):
        o = run(mode, a.workers, cfg, memory_budget=budget)
        label = ("tables on phub" + (f", {tc}" if tc != "bsp" else "") +
                 (", pulls prefetched" if cfg.prefetch else "") +
                 ", MLPs through the comm hook") if mode == "phub" else \
            f"DDP over gloo, sparse=True embeddings, {cfg.table_optimizer}"
        dp = f", dataplane peak {o.dataplane_peak / mib:.0f} MiB" if mode == "phub" else ""
        at = ""
        if cfg.target_loss is not None:
            at = (f", log-loss {cfg.target_loss} at step {o.reached[0]} after {o.reached[1]:.2f} s of training"
                  if o.reached else f", log-loss {cfg.target_loss} not reached")
        print(f"  {mode:5} ({label}): held-out log-loss {o.loss:.4f}, {1000 * o.step_s:.1f} ms/step, "
              f"rank 0 peak {o.rank_peak / mib:.0f} MiB{dp}{at}", flush=True)


if __name__ == "__main__":
    main()
