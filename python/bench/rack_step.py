#!/usr/bin/env python3
"""One rank of ``phub-bench torch``: a DDP training step on the virtual racks,
with gloo's all-reduce and with phub's comm hook, in the same process.

phub-bench builds the racks (a namespace per rank behind its own link,
tbf-limited), starts an appliance per rack and phub-control, admits the
jobs, and starts this script once per rank inside the rank's namespace; it
is not meant to be run by hand. Every rank holds one model per mode, each a
``DistributedDataParallel`` over the same gloo process group (DDP's
parameter broadcast and bucket bookkeeping need one):

- ``none``: a comm hook that hands the bucket back at once, the step
  without communication (the baseline the exchange is measured against);
- ``gloo``: DDP's own all-reduce over gloo (a ring between the ranks'
  addresses, through the racks' links);
- ``flat`` / ``hierarchical``: phub's comm hook on a job placed flat over
  the racks' appliances, or hierarchically (each rank to its own rack's
  appliance, which trades one partial sum per chunk with its home).

The model's parameters have the shapes phub-bench gives (``--sizes``, one
per key of the job, in key order); its forward is ``x * sum(p.sum())``, so
backward fills every gradient with 1 and costs little: the step is the
exchange. Every trial runs each mode once, in the order given, between
barriers. Around each timed step rank 0 tells phub-bench (a line on stdout,
``PHUB-MARK begin|end MODE TRIAL``) and waits for its answer on stdin, so
the links' byte counters are read with every rank at the same point.

Each rank writes ``{"step_s": {mode: [seconds per trial]}, ...}`` to
``--out``. After the last trial every gradient must be 1 (the mean of
ones) in every mode: a rank whose exchange was wrong exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import phub
import phub.torch
from phub.local import exit_rank
from bench_exchange import Bag, no_exchange_hook  # the same model and baseline hook


def mark(what: str, mode: str, trial: int) -> None:
    """Rank 0: tells phub-bench where every rank is, and waits for it."""
    print(f"PHUB-MARK {what} {mode} {trial}", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("phub-bench did not answer a mark")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="rank 0's ADDR:PORT for gloo's rendezvous")
    ap.add_argument("--control", required=True, help="phub-control's URL")
    ap.add_argument("--job", action="append", default=[], help="MODE:ID:TOKEN, a phub job per phub mode")
    ap.add_argument("--modes", required=True, help="comma-separated: none, gloo, flat, hierarchical")
    ap.add_argument("--sizes", required=True, help="JSON file: the keys' element counts, in key order")
    ap.add_argument("--trials", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--window", type=int, default=None, help="phub's window, chunks in flight (default: the library's)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    addr, port = a.master.rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    with open(a.sizes) as f:
        sizes = [(f"key{k}", int(n)) for k, n in enumerate(json.load(f))]
    jobs = {}
    for j in a.job:
        mode, job, token = j.split(":")
        jobs[mode] = (int(job), token)
    modes = a.modes.split(",")
    models: dict[str, Any] = {}
    workers = {}
    for mode in modes:
        # Gradients as views of the buckets: one copy of the model's bytes
        # less per mode (BERT-base's four modes on four ranks fit in 24 GiB).
        m = nn.parallel.DistributedDataParallel(Bag(sizes), bucket_cap_mb=a.bucket_mb,
                                                gradient_as_bucket_view=True)
        if mode == "none":
            m.register_comm_hook(None, no_exchange_hook)
        elif mode in ("flat", "hierarchical"):
            job, token = jobs[mode]
            workers[mode] = phub.Worker.join(a.control, job, token, a.rank, window=a.window)
            phub.torch.register_comm_hook(m, workers[mode])
        elif mode != "gloo":
            raise SystemExit(f"--modes: unknown mode {mode!r}")
        models[mode] = m
    x = torch.ones(1)
    step_s: dict[str, list[float]] = {mode: [] for mode in modes}
    for trial in range(a.warmup + a.trials):
        for mode in modes:
            m = models[mode]
            m.zero_grad()
            dist.barrier()
            if a.rank == 0:
                mark("begin", mode, trial)
            dist.barrier()
            t = time.perf_counter()
            m(x).backward()
            dt = time.perf_counter() - t
            dist.barrier()
            if a.rank == 0:
                mark("end", mode, trial)
            if trial >= a.warmup:
                step_s[mode].append(dt)
    for mode in modes:  # 1.0 is the mean of W ones, exactly
        if mode != "none":
            for p in models[mode].module.ps:
                if not torch.all(p.grad == 1.0):
                    raise SystemExit(f"rank {a.rank}: {mode}: a wrong averaged gradient")
    stats = {mode: w.stats() for mode, w in workers.items()}
    with open(a.out, "w") as f:
        json.dump({"step_s": step_s, "retransmits": {m: s["retransmits"] for m, s in stats.items()}}, f)
    dist.destroy_process_group()
    exit_rank(0)  # no interpreter finalization: torch's gloo threads can abort it


if __name__ == "__main__":
    main()
