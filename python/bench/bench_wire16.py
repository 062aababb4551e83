#!/usr/bin/env python3
"""A 16-bit job's exchange from Python: 16-bit arrays against float32 arrays,
W worker processes on this machine, in the same run (NumPy only, no torch).

A bf16 (or f16) ``mean`` job with ResNet-50's 161 tensors (25,557,032
elements, 51.1 MB per worker per step on the wire). Each trial every worker
starts ``push_pull`` on every key, then waits for every handle (the bare
exchange a mixed-precision training step makes), once with arrays holding
the job's 16-bit type (bfloat16 bits as ``uint16``, or ``float16``) and once
with ``float32`` arrays of the same values; the two alternate, a barrier
before each. A 16-bit array goes out as the wire's bits and its result comes
back the same way; a ``float32`` array is converted to the wire type on the
way out and back on the way in (what a mixed-precision caller pays when it
hands phub float32 copies of its gradients).

    python python/bench/bench_wire16.py --workers 2 --trials 10 [--shm] [--dtype f16] [--f32-job]

``--f32-job`` adds a third exchange, alternating with the two: a float32 job
of the same keys (twice the bytes) with float32 arrays, the like-for-like
reference for the 16-bit job (does halving the bytes halve the time?).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

import phub
from bench_common import profile_sizes
from phub.local import LocalAppliance

MODES = ("16-bit arrays", "float32 arrays")
F32_JOB = "float32 job"


def arrays(sizes: list[int], dtype: str, rank: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every key's gradient as the job's 16-bit type and as float32 (the same values)."""
    f32 = [((np.arange(n, dtype=np.float32) + rank) % 64) * 0.25 for n in sizes]
    if dtype == "bf16":
        wire = [(a.view(np.uint32) >> 16).astype(np.uint16) for a in f32]  # exact: small multiples of 1/4
    else:
        wire = [a.astype(np.float16) for a in f32]
    return wire, f32


def worker(rank: int, a: argparse.Namespace, url: str, jobs: list[tuple[int, str]], sizes: list[int],
           barrier: Any, results: Any) -> None:
    w = phub.Worker.join(url, jobs[0][0], jobs[0][1], rank)
    wire, f32 = arrays(sizes, a.dtype, rank)
    for k, g in enumerate(wire):
        w.init(k, g.copy()).wait()
    modes = MODES
    w32 = None
    if len(jobs) > 1:
        w32 = phub.Worker.join(url, jobs[1][0], jobs[1][1], rank)
        for k, g in enumerate(f32):
            w32.init(k, g.copy()).wait()
        modes = (*MODES, F32_JOB)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for t in range(a.warmup + a.trials):
        for mode in modes if t % 2 == 0 else reversed(modes):
            grads = wire if mode == MODES[0] else f32
            into = w32 if mode == F32_JOB else w
            outs = [np.empty_like(g) for g in grads]
            barrier.wait()
            t0 = time.perf_counter()
            hs = [into.push_pull(k, g, o) for k, (g, o) in enumerate(zip(grads, outs))]
            for h in hs:
                h.wait()
            dt = time.perf_counter() - t0
            if t >= a.warmup:
                times[mode].append(dt)
    if rank == 0:
        retx = w.stats()["retransmits"] + (w32.stats()["retransmits"] if w32 is not None else 0)
        results.put((times, retx, w.shm))


def main() -> None:
    ap = argparse.ArgumentParser(description="a 16-bit job's exchange: 16-bit arrays against float32 arrays")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--profile", default="resnet50", help="resnet50 (default) or uniform:K:N")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lcores", type=int, default=1)
    ap.add_argument("--shm", action="store_true", help="phub-dataplane with --shm (workers on this machine)")
    ap.add_argument("--f32-job", action="store_true",
                    help="also a float32 job of the same keys with float32 arrays (the like-for-like reference)")
    a = ap.parse_args()
    sizes = [n for _, n in profile_sizes(a.profile)]
    total = sum(sizes)
    print(f"{a.dtype} job, {a.profile} ({len(sizes)} keys, {total:,} elements, {2 * total / 1e6:.1f} MB on the "
          f"wire per worker), W={a.workers} processes ({os.cpu_count()} CPUs), {a.lcores} lcores, "
          f"{'shared memory' if a.shm else 'datagrams'}, phub {phub.__version__}", flush=True)
    ctx = mp.get_context("spawn")
    with LocalAppliance(lcores=a.lcores, memory_budget="2GiB", shm=a.shm) as app:
        spec = phub.admin.job_spec("wire16", a.workers, [(f"t{i}", n) for i, n in enumerate(sizes)],
                                   optimizer="mean", dtype=a.dtype)
        jobs = [app.admit(spec)]
        if a.f32_job:
            jobs.append(app.admit(phub.admin.job_spec("wire16-f32", a.workers, [(f"t{i}", n) for i, n in enumerate(sizes)],
                                                      optimizer="mean", dtype="f32")))
        barrier, results = ctx.Barrier(a.workers), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, a, app.control_url, jobs, sizes, barrier, results))
                 for r in range(a.workers)]
        for p in procs:
            p.start()
        times, retx, shm = results.get(timeout=600)
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    med = {m: statistics.median(times[m]) * 1000 for m in times}
    print(f"{'':18}{'median ms':>10}{'min ms':>9}{'max ms':>9}   (rank 0, {a.trials} trials)")
    for m in times:
        print(f"  {m:16}{med[m]:10.1f}{min(times[m]) * 1000:9.1f}{max(times[m]) * 1000:9.1f}")
    print(f"16-bit / float32 = {med[MODES[0]] / med[MODES[1]]:.2f}; rank 0: {retx} retransmits, shm={shm}")
    if F32_JOB in med:
        print(f"16-bit job / float32 job = {med[MODES[0]] / med[F32_JOB]:.2f} (half the bytes)")


if __name__ == "__main__":
    main()
