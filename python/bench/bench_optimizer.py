#!/usr/bin/env python3
"""The PHub way's step (the optimizer on the appliance), W workers on this
machine: ``phub.torch.DistributedOptimizer`` pushing every gradient in
``step()`` against pushing each one from backward as soon as it is
accumulated (``overlap=True``), in the same trials.

Each rank holds two models whose parameters have the profile's tensor
sizes (as bench_exchange.py's: forward ``x * sum of every element``, so
backward only fills the gradients), each with its own
DistributedOptimizer over the same keys of one ``sgd`` job; a trial times
``backward(); step()`` for each (a barrier before each), and a third time
backward alone (the step without exchange). Medians over trials.

    python python/bench/bench_optimizer.py --workers 2 --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phub
import phub.torch
from bench_common import add_rank_args, free_port, memory_budget, profile_sizes, run_ranks
from bench_exchange import Bag, join_rank
from phub.local import LocalAppliance

WAYS = ("backward alone", "step() pushes all", "pushed during backward")


def worker(rank: int, a: argparse.Namespace, control_url: str, job: int, token: str, port: int, out: str) -> None:
    sizes, w = join_rank(rank, a, control_url, job, token, port)
    models = {name: Bag(sizes) for name in WAYS}
    opts = {
        WAYS[1]: phub.torch.DistributedOptimizer(models[WAYS[1]], w),
        # The same keys, whose round 0 the first optimizer ran.
        WAYS[2]: phub.torch.DistributedOptimizer(models[WAYS[2]], w, broadcast=False, overlap=True),
    }
    x = torch.ones(1)
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for trial in range(a.warmup + a.trials):
        for name, m in models.items():
            m.zero_grad()
            dist.barrier()
            t = time.perf_counter()
            m(x).backward()
            if name in opts:
                opts[name].step()
            dt = time.perf_counter() - t
            if trial >= a.warmup:
                times[name].append(dt)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description="DistributedOptimizer: gradients pushed in step() or during backward")
    add_rank_args(ap, lcores=2)
    a = ap.parse_args()
    sizes = profile_sizes(a.profile)
    total = sum(n for _, n in sizes)
    print(f"DistributedOptimizer step, {a.profile} ({len(sizes)} tensors, {4 * total / 1e6:.1f} MB), "
          f"W={a.workers} on this machine ({os.cpu_count()} CPUs), {a.lcores} lcores, datagrams, "
          f"torch {torch.__version__}", flush=True)
    with LocalAppliance(lcores=a.lcores, memory_budget=memory_budget(total)) as app:
        spec = phub.admin.job_spec("bench-opt", a.workers, sizes, optimizer={"kind": "sgd", "lr": 1e-6})
        job, token = app.admit(spec)
        with tempfile.TemporaryDirectory(prefix="phub-bench-") as tmp:
            out = str(Path(tmp) / "times.json")
            run_ranks(worker, a.workers, a, app.control_url, job, token, free_port(), out)
            times = json.loads(Path(out).read_text())
    med = {n: statistics.median(t) * 1000 for n, t in times.items()}
    print(f"{'':28}{'median ms':>10}{'min ms':>10}")
    for n, t in times.items():
        print(f"  {n:26}{med[n]:10.1f}{min(t) * 1000:10.1f}")
    base = med[WAYS[0]]
    print(f"step: pushed during backward / pushed in step() = {med[WAYS[2]] / med[WAYS[1]]:.2f}; "
          f"exchange beyond backward: {med[WAYS[1]] - base:.1f} ms against {med[WAYS[2]] - base:.1f} ms")


if __name__ == "__main__":
    main()
