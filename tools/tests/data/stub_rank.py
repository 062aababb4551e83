#!/usr/bin/env python3
"""A stand-in for python/bench/rack_step.py in tools/tests/racks.rs: no
torch. It takes the same arguments, runs the same marks (rank 0), and
instead of a DDP step sends 100 x (i + 1) datagrams of 1000 bytes from
rank 0 to the last rank (another rack) during mode i's step, and says
mode i's step took i + 1 ms. STUB_FAIL_RANK=N: rank N exits with 3 at
once."""

import argparse
import json
import os
import socket
import sys

ap = argparse.ArgumentParser()
for flag in ("--rank", "--world", "--trials", "--warmup"):
    ap.add_argument(flag, type=int, required=True)
for flag in ("--modes", "--out"):
    ap.add_argument(flag, required=True)
a, _ = ap.parse_known_args()
if a.rank == int(os.environ.get("STUB_FAIL_RANK", "-1")):
    sys.exit(3)
modes = a.modes.split(",")
step = {m: [] for m in modes}
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def mark(what: str, mode: str, trial: int) -> None:
    print(f"PHUB-MARK {what} {mode} {trial}", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit("no answer to a mark")


for trial in range(a.warmup + a.trials):
    for i, mode in enumerate(modes):
        if a.rank == 0:
            mark("begin", mode, trial)
            for _ in range(100 * (i + 1)):
                sock.sendto(b"x" * 1000, (f"10.78.{a.world - 1}.2", 9))
            mark("end", mode, trial)
        if trial >= a.warmup:
            step[mode].append((i + 1) / 1000)
with open(a.out, "w") as f:
    json.dump({"step_s": step, "retransmits": {m: 0 for m in modes if m in ("flat", "hierarchical")}}, f)
