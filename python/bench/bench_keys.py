#!/usr/bin/env python3
"""The Python worker's exchange of a whole model's keys, three ways, in the
same rank processes and the same minutes (no torch needed):

- ``wait``: ``push_pull`` of every key, then ``Handle.wait`` of each (the
  result copied into the array on the caller's thread);
- ``in_place``: the same with ``Handle.wait_in_place`` (no copy: the
  results are read where they arrived; the figure of what the copy costs);
- ``exchange``: one ``Worker.exchange`` call with every array lent in
  place (each result written into its array by the I/O thread as it
  arrives, the GIL released once).

Usage: python bench_keys.py [--workers 2] [--lcores 2] [--profile resnet50]
[--rounds 10] [--warmup 2] [--json FILE]. Prints each way's median, min and
max round over the rounds, rank 0's view, the ways interleaved round by
round so the machine's noise falls on all three alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import phub
import phub.admin
from bench_common import profile_sizes, run_ranks
from phub.local import LocalAppliance

WAYS = ["wait", "in_place", "exchange"]


def rank_main(rank: int, a: argparse.Namespace, url: str, job: int, token: str, out: str) -> None:
    sizes = [n for _, n in profile_sizes(a.profile)]
    w = phub.Worker.join(url, job, token, rank)
    arrays = [np.zeros(n, np.float32) for n in sizes]
    for k, arr in enumerate(arrays):
        w.init(k, arr).wait()
    grads = [np.full(n, float(rank + 1), np.float32) for n in sizes]
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for rnd in range(a.warmup + a.rounds):
        for way in WAYS:
            for g, arr in zip(grads, arrays):
                np.copyto(arr, g)
            t = time.perf_counter()
            if way == "exchange":
                w.exchange([(k, arr) for k, arr in enumerate(arrays)])
            else:
                hs = [w.push_pull(k, arr) for k, arr in enumerate(arrays)]
                for h in hs:
                    if way == "wait":
                        h.wait()
                    else:
                        h.wait_in_place().release()
            dt = time.perf_counter() - t
            if rnd >= a.warmup:
                times[way].append(dt)
            if way != "in_place":
                # mean of the ranks' gradients: (1 + ... + W) / W
                want = (a.workers + 1) / 2
                assert arrays[0][0] == want and arrays[-1][-1] == want, (way, arrays[0][0], want)
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--lcores", type=int, default=2)
    ap.add_argument("--profile", default="resnet50")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sizes = profile_sizes(a.profile)
    with LocalAppliance(lcores=a.lcores, memory_budget="2GiB") as app:
        job, token = app.admit(phub.admin.job_spec("keys", a.workers, sizes, optimizer="mean"))
        with tempfile.TemporaryDirectory(prefix="phub-bench-") as tmp:
            out = str(Path(tmp) / "times.json")
            run_ranks(rank_main, a.workers, a, app.control_url, job, token, out)
            times = json.loads(Path(out).read_text())
    total = sum(n for _, n in sizes)
    print(f"{a.profile}: {len(sizes)} keys, {total:,} floats; W={a.workers} processes, {a.lcores} lcores, "
          f"{a.rounds} rounds after {a.warmup} ({os.cpu_count()} CPUs)")
    report = {}
    for way in WAYS:
        ms = [t * 1000 for t in times[way]]
        report[way] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
        print(f"  {way:10} median {report[way]['median_ms']:7.1f} ms  min {min(ms):7.1f}  max {max(ms):7.1f}")
    print(f"  exchange / wait = {report['exchange']['median_ms'] / report['wait']['median_ms']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
