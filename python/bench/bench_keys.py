#!/usr/bin/env python3
"""The Python worker's exchange of a whole model's keys, four ways, in the
same rank processes and the same minutes (no torch needed):

- ``lent``: ``push_pull`` of every key (in place), then ``Handle.wait`` of
  each: over datagrams the array is lent to the I/O thread, which writes
  each result into it as it arrives (the default);
- ``copied``: the same with ``lend=False``: the gradient copied into the
  worker's datagrams, the result into its buffer, then copied into the
  array by ``wait`` on the caller's thread;
- ``in_place``: ``lend=False`` and ``Handle.wait_in_place`` (no copy of
  the result: it is read where it arrived; the figure of what the copy
  costs);
- ``exchange``: one ``Worker.exchange`` call with every array lent in
  place (each result written into its array by the I/O thread as it
  arrives, the GIL released once).

Usage: python bench_keys.py [--workers 2] [--lcores 2] [--profile resnet50]
[--rounds 10] [--warmup 2] [--ways lent,copied,in_place,exchange] [--json
FILE]. Prints each way's median, min and max round over the rounds, rank
0's view, the ways interleaved round by round so the machine's noise falls
on all of them alike. (Interleaved, a copying round after a lent one
allocates its key's buffers again, which a program keeping to one way does
not: ``--ways copied`` and ``--ways lent`` alone give each its own figure.)
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

WAYS = ["lent", "copied", "in_place", "exchange"]


def rank_main(rank: int, a: argparse.Namespace, url: str, job: int, token: str, out: str) -> None:
    sizes = [n for _, n in profile_sizes(a.profile)]
    w = phub.Worker.join(url, job, token, rank)
    arrays = [np.zeros(n, np.float32) for n in sizes]
    for k, arr in enumerate(arrays):
        w.init(k, arr).wait()
    grads = [np.full(n, float(rank + 1), np.float32) for n in sizes]
    times: dict[str, list[float]] = {way: [] for way in a.ways}
    for rnd in range(a.warmup + a.rounds):
        for way in a.ways:
            for g, arr in zip(grads, arrays):
                np.copyto(arr, g)
            t = time.perf_counter()
            if way == "exchange":
                w.exchange([(k, arr) for k, arr in enumerate(arrays)])
            else:
                hs = [w.push_pull(k, arr, lend=way == "lent") for k, arr in enumerate(arrays)]
                for h in hs:
                    if way == "in_place":
                        h.wait_in_place().release()
                    else:
                        h.wait()
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
    ap.add_argument("--ways", default=",".join(WAYS), help="a comma-separated subset of " + ",".join(WAYS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.ways = a.ways.split(",")
    if not a.ways or any(w not in WAYS for w in a.ways):
        raise SystemExit(f"--ways {','.join(a.ways)}: a comma-separated subset of {','.join(WAYS)}")
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
    for way in a.ways:
        ms = [t * 1000 for t in times[way]]
        report[way] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
        print(f"  {way:10} median {report[way]['median_ms']:7.1f} ms  min {min(ms):7.1f}  max {max(ms):7.1f}")
    for way in ("lent", "exchange"):
        if way in report and "copied" in report:
            print(f"  {way} / copied = {report[way]['median_ms'] / report['copied']['median_ms']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
