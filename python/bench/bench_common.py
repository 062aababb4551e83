"""Helpers the benchmarks in python/bench share (no torch needed): model
profiles and a free port."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
from typing import Any, Callable

from phub.local import run_rank


def resnet50_sizes() -> list[tuple[str, int]]:
    """torchvision resnet50's trainable tensors, in parameters() order."""
    t: list[tuple[str, int]] = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    inplanes = 64
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            t += [(f"{p}.conv1.weight", planes * inplanes), (f"{p}.bn1.weight", planes), (f"{p}.bn1.bias", planes),
                  (f"{p}.conv2.weight", planes * planes * 9), (f"{p}.bn2.weight", planes), (f"{p}.bn2.bias", planes),
                  (f"{p}.conv3.weight", planes * 4 * planes), (f"{p}.bn3.weight", planes * 4),
                  (f"{p}.bn3.bias", planes * 4)]
            if b == 0:
                t += [(f"{p}.downsample.0.weight", planes * 4 * inplanes), (f"{p}.downsample.1.weight", planes * 4),
                      (f"{p}.downsample.1.bias", planes * 4)]
            inplanes = planes * 4
    t += [("fc.weight", 1000 * 2048), ("fc.bias", 1000)]
    return t


def bert_sizes(hidden: int, inter: int, layers: int) -> list[tuple[str, int]]:
    """Hugging Face BertModel's trainable tensors, in parameters() order (as
    phub-bench's profiles, tools/src/profiles.rs)."""
    t: list[tuple[str, int]] = [("embeddings.word_embeddings.weight", 30522 * hidden),
                                ("embeddings.position_embeddings.weight", 512 * hidden),
                                ("embeddings.token_type_embeddings.weight", 2 * hidden),
                                ("embeddings.LayerNorm.weight", hidden), ("embeddings.LayerNorm.bias", hidden)]

    def linear(name: str, n_in: int, n_out: int) -> None:
        t.extend([(f"{name}.weight", n_in * n_out), (f"{name}.bias", n_out)])

    for layer in range(layers):
        p = f"encoder.layer.{layer}"
        for m in ("query", "key", "value"):
            linear(f"{p}.attention.self.{m}", hidden, hidden)
        linear(f"{p}.attention.output.dense", hidden, hidden)
        t.extend([(f"{p}.attention.output.LayerNorm.weight", hidden), (f"{p}.attention.output.LayerNorm.bias", hidden)])
        linear(f"{p}.intermediate.dense", hidden, inter)
        linear(f"{p}.output.dense", inter, hidden)
        t.extend([(f"{p}.output.LayerNorm.weight", hidden), (f"{p}.output.LayerNorm.bias", hidden)])
    linear("pooler.dense", hidden, hidden)
    return t


def profile_sizes(name: str) -> list[tuple[str, int]]:
    if name in ("resnet50", "resnet-50"):
        sizes = resnet50_sizes()
        assert len(sizes) == 161 and sum(n for _, n in sizes) == 25_557_032
        return sizes
    if name == "bert-base":
        sizes = bert_sizes(768, 3072, 12)
        assert len(sizes) == 199 and sum(n for _, n in sizes) == 109_482_240
        return sizes
    if name.startswith("uniform:"):
        _, k, n = name.split(":")
        return [(f"t{i}", int(float(n))) for i in range(int(k))]
    raise SystemExit(f"--profile {name!r}: resnet50, bert-base or uniform:K:N")


def run_ranks(target: Callable[..., None], workers: int, *args: Any) -> None:
    """Runs `target(rank, *args)` in `workers` spawned processes, waits for
    all, and stops the benchmark naming the exit codes if one failed."""
    ctx = mp.get_context("spawn")
    # Ends each rank through phub.local.exit_rank (torch's gloo threads can
    # abort a finalizing interpreter).
    procs = [ctx.Process(target=run_rank, args=(target, r, *args)) for r in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_rank_args(ap: argparse.ArgumentParser, lcores: int) -> None:
    """The options the one-host benchmarks share."""
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--profile", default="resnet50", help="resnet50 (default), bert-base or uniform:K:N")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lcores", type=int, default=lcores, help=f"dataplane queues (default {lcores})")
    ap.add_argument("--window", type=int, default=None,
                    help="phub worker window, chunks in flight (default: the library picks it from the job)")


def memory_budget(floats: int) -> str:
    """The dataplane's memory budget for a job of ``floats`` f32 values: its
    slots and what the dataplane keeps beside them, 2 GiB or three times the
    model when that is more."""
    return f"{max(2048, 3 * 4 * floats // 2**20)}MiB"
