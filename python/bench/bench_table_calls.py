#!/usr/bin/env python3
"""The Python worker's per-table calls, timed alone: one rank, 26 tables
(dims 64 x 8, 32 x 9, 16 x 9, as a DLRM-style model's), 190 distinct ids
each, SGD. Each step starts every table's pull, waits for them, starts
every table's push and waits for them (``pull_rows_start``, ``wait``,
``push_rows_start``, ``wait``).

Usage: python bench_table_calls.py [--steps 300] [--warmup 50]. Prints
each phase's median and 10th/90th percentiles over the steps after the
warm-up (binaries from $PHUB_BIN_DIR or target/release, as phub.local
finds them).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import phub
import phub.admin
from phub.local import LocalAppliance

DIMS = [64] * 8 + [32] * 9 + [16] * 9
IDS_PER_TABLE = 190
ROWS = 100_000
PHASES = ["pull_start", "pull_wait", "push_start", "push_wait"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(1)
    with LocalAppliance(lcores=2, memory_budget="1GiB") as app:
        keys = [{"name": f"t{i}", "kind": "table", "dim": d, "rows": ROWS, "optimizer": {"kind": "sgd", "lr": 0.1}}
                for i, d in enumerate(DIMS)]
        job, token = app.admit(phub.admin.job_spec("table-calls", 1, keys, optimizer="sum"))
        w = phub.Worker.join(app.control_url, job, token, 0)
        tables = [f"t{i}" for i in range(len(DIMS))]
        ids = [np.sort(rng.choice(ROWS, IDS_PER_TABLE, replace=False)).astype(np.int64) for _ in DIMS]
        outs = [np.empty(IDS_PER_TABLE * d, np.float32) for d in DIMS]
        grads = [np.full(IDS_PER_TABLE * d, 1e-3, np.float32) for d in DIMS]
        times: dict[str, list[float]] = {p: [] for p in PHASES}
        for step in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            pulls = [w.pull_rows_start(t, i, o) for t, i, o in zip(tables, ids, outs)]
            t1 = time.perf_counter()
            for p in pulls:
                p.wait()
            t2 = time.perf_counter()
            pushes = [w.push_rows_start(t, i, g) for t, i, g in zip(tables, ids, grads)]
            t3 = time.perf_counter()
            for p in pushes:
                p.wait()
            t4 = time.perf_counter()
            if step >= a.warmup:
                for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    times[phase].append(dt * 1e3)
    print(f"{len(DIMS)} tables, {IDS_PER_TABLE} ids each, one rank, {a.steps} steps after {a.warmup}")
    for phase, ms in times.items():
        print(f"  {phase:10} median {np.median(ms):.3f} ms  p10 {np.percentile(ms, 10):.3f}  "
              f"p90 {np.percentile(ms, 90):.3f}")


if __name__ == "__main__":
    main()
