#!/usr/bin/env python3
"""ResNet-50 DDP training steps on CUDA tensors: phub's comm hook against gloo, W processes, same run.

Every worker process (rank r on GPU r mod the GPU count: with one GPU the W
processes share it) holds three copies of ResNet-50 (torchvision's layout,
defined here so torchvision is not needed; 161 tensors, 25,557,032
parameters) on the GPU, each in DistributedDataParallel (25 MB buckets,
gloo process group):

- ``no exchange``: a comm hook that returns the bucket at once (forward +
  backward without communication: the baseline);
- ``gloo``: DDP's default all-reduce over gloo (which stages CUDA tensors
  through the host itself);
- ``phub``: phub.torch's comm hook (pinned staging buffers, side streams)
  through a local appliance (a ``mean`` job, one key per tensor; ``--shm``:
  shared memory, ``--lcores``: dataplane queues);
- ``nccl`` (with ``--nccl``): DDP's all-reduce over an NCCL process group.
  NCCL refuses two ranks on one GPU, so on a one-GPU machine this run
  reports NCCL's error and measures the three others; a separate run
  because a failed NCCL communicator can take its process down.

A step is forward + backward on a random batch, between
``torch.cuda.synchronize()`` calls, after a barrier; medians over
``--steps`` steps after ``--warmup``. It also times the exchange alone,
without backward: gloo all-reduce of the same buckets (CUDA tensors), and
phub's hook on the same buckets (device-to-host, push, pull,
host-to-device), and reports how much of each exchange backward hides:
``overlap = 1 - (step - baseline) / exchange alone``.

    python python/bench/bench_cuda_ddp.py --workers 2 --shm --lcores 4

Needs a CUDA device; tools/gpu-bench.sh runs it on the device machine.
``--device cpu`` runs the same script on the CPU, as a smoke test where
there is no GPU (its figures mean nothing: ResNet-50 on a few cores).
``--dtype bf16`` trains the models in bfloat16 (parameters, activations and
gradients): phub's job is then a bf16 job whose gradients go out and come
back as bf16, never float32; gloo all-reduces the bf16 buckets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import phub
import phub.torch
from bench_common import free_port, run_ranks
from phub.local import LocalAppliance


class Bottleneck(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int, downsample: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(planes * 4)) if downsample else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet50(nn.Module):
    """torchvision.models.resnet50's modules and parameter order."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for i, (planes, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], start=1):
            layer = [Bottleneck(inplanes, planes, stride, True)]
            inplanes = planes * 4
            layer += [Bottleneck(inplanes, planes, 1, False) for _ in range(blocks - 1)]
            setattr(self, f"layer{i}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def no_exchange_hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class FakeBucket:
    """A DDP bucket for the bare exchange: parameters and gradient views of one flat buffer."""

    def __init__(self, i: int, params: list[torch.Tensor], buf: torch.Tensor) -> None:
        self.i, self.params, self.buf = i, params, buf
        offs = np.cumsum([0] + [p.numel() for p in params])
        self.grads = [buf[a:b] for a, b in zip(offs, offs[1:])]

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return self.grads

    def index(self) -> Any:  # phub's staging slot: apart from DDP's buckets' (their sizes differ)
        return ("bare", self.i)


def buckets_of(params: list[torch.Tensor], cap_bytes: int, device: torch.device,
               dtype: torch.dtype) -> list[FakeBucket]:
    """DDP's layout, roughly: parameters in reverse order, ~cap_bytes per bucket."""
    out: list[FakeBucket] = []
    cur: list[torch.Tensor] = []
    size = torch.finfo(dtype).bits // 8
    for p in reversed(params):
        cur.append(p)
        if sum(q.numel() for q in cur) * size >= cap_bytes:
            out.append(FakeBucket(len(out), cur, torch.ones(sum(q.numel() for q in cur), device=device, dtype=dtype)))
            cur = []
    if cur:
        out.append(FakeBucket(len(out), cur, torch.ones(sum(q.numel() for q in cur), device=device, dtype=dtype)))
    return out


NAMES = ["no exchange", "gloo", "phub", "bare gloo", "bare phub", "nccl", "bare nccl"]


def worker(rank: int, a: argparse.Namespace, control_url: str, job: int, token: str, port: int, out: str) -> None:
    torch.set_num_threads(2)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=a.workers)
    nccl_pg, nccl_error = None, ""
    if a.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        sync = torch.cuda.synchronize
    else:  # a smoke test of this script without a GPU
        device, sync = torch.device("cpu"), (lambda: None)
    if a.nccl:
        try:
            nccl_pg = dist.new_group(backend="nccl")
            probe = torch.ones(1, device=device)
            dist.all_reduce(probe, group=nccl_pg)
            sync()
            assert probe.item() == a.workers, f"NCCL all-reduce of ones gave {probe.item()}"
        except Exception as e:  # noqa: BLE001 -- reported, then the run goes on without NCCL
            nccl_pg, nccl_error = None, " ".join(f"{type(e).__name__}: {e}".split())[:400]
            print(f"rank {rank}: NCCL: {nccl_error}", flush=True)
    w = phub.Worker.join(control_url, job, token, rank)
    if a.shm and not w.shm:
        raise SystemExit(f"--shm: phub rank {rank} did not get shared memory (see phub-dataplane's log)")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    models = {}
    for name in ("no exchange", "gloo", "phub"):
        torch.manual_seed(0)
        models[name] = nn.parallel.DistributedDataParallel(ResNet50().to(device, dtype), bucket_cap_mb=a.bucket_mb)
    if nccl_pg is not None:
        torch.manual_seed(0)
        models["nccl"] = nn.parallel.DistributedDataParallel(ResNet50().to(device, dtype), bucket_cap_mb=a.bucket_mb,
                                                             process_group=nccl_pg)
    models["no exchange"].register_comm_hook(None, no_exchange_hook)
    state = phub.torch.register_comm_hook(models["phub"], w, in_place=a.one_copy)
    x = torch.randn(a.batch, 3, a.image, a.image, device=device, dtype=dtype)
    y = torch.randint(0, 1000, (a.batch,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    params = phub.torch.key_parameters(models["phub"])
    buckets = buckets_of(params, int(a.bucket_mb * 2**20), device, dtype)
    for step in range(a.warmup + a.steps):
        for name, m in models.items():
            m.zero_grad(set_to_none=False)
            sync()
            dist.barrier()
            t = time.perf_counter()
            loss_fn(m(x), y).backward()
            sync()
            if step >= a.warmup:
                times[name].append(time.perf_counter() - t)
        sync()
        dist.barrier()
        t = time.perf_counter()
        works = [dist.all_reduce(b.buf, async_op=True) for b in buckets]
        for wk in works:
            wk.wait()
        sync()
        if step >= a.warmup:
            times["bare gloo"].append(time.perf_counter() - t)
        if nccl_pg is not None:
            sync()
            dist.barrier()
            t = time.perf_counter()
            works = [dist.all_reduce(b.buf, group=nccl_pg, async_op=True) for b in buckets]
            for wk in works:
                wk.wait()
            sync()
            if step >= a.warmup:
                times["bare nccl"].append(time.perf_counter() - t)
        for b in buckets:
            b.buf.fill_(1.0)
        sync()
        dist.barrier()
        t = time.perf_counter()
        futs = [phub.torch.comm_hook(state, b) for b in buckets]
        for f in futs:
            f.wait()
        sync()
        if step >= a.warmup:
            times["bare phub"].append(time.perf_counter() - t)
        for b in buckets:  # every rank pushed ones: the mean is one
            assert torch.all(b.buf == 1.0), "phub: wrong averaged gradient"
    # DDP's gradients after phub and after gloo are both the ranks' mean of
    # the same batches (bf16: each rounds its sum to bf16 its own way).
    tol = {"rtol": 2e-2, "atol": 1e-2} if a.dtype == "bf16" else {"rtol": 1e-4, "atol": 1e-5}
    for pg, pp in zip(models["gloo"].parameters(), models["phub"].parameters()):
        assert pp.grad.dtype == dtype, f"phub left a {pp.grad.dtype} gradient in a {dtype} model"
        torch.testing.assert_close(pg.grad, pp.grad, **tol)
    if nccl_pg is not None:
        for pg, pn in zip(models["gloo"].parameters(), models["nccl"].parameters()):
            torch.testing.assert_close(pg.grad, pn.grad, **tol)
    if rank == 0:
        s = w.stats()
        steps = len(times["gloo"])
        np.save(out, np.array([times[k] or [float("nan")] * steps for k in NAMES], dtype=np.float64))
        st = state._staging.get(device)
        staged = int(bool(st and st._staging_regions.registered))
        failures = st.register_failures if st else 0
        with open(out + ".txt", "w") as f:
            f.write(f"{s['retransmits']} {s['chunks_sent']} {int(w.shm)} {staged} {failures}\n{nccl_error}\n")
    state.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description="ResNet-50 DDP on CUDA tensors: phub's comm hook against gloo")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="images per rank per step")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--lcores", type=int, default=4, help="dataplane queues")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--shm", action="store_true", help="phub-dataplane with --shm (workers on this machine)")
    ap.add_argument("--busy-poll", action="store_true")
    copies = ap.add_mutually_exclusive_group()
    copies.add_argument("--one-copy", action="store_true",
                        help="with --shm: CUDA gradients straight into the staging regions (the hook's in_place=True)")
    copies.add_argument("--two-copies", action="store_true",
                        help="with --shm: through the pinned buffer and the worker's copy (the hook's default)")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                    help="the models' and phub's job's element type (bf16: mixed precision's gradients)")
    ap.add_argument("--nccl", action="store_true",
                    help="also DDP over NCCL (one GPU per rank: NCCL refuses two ranks on one GPU, and says so)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke test of the script where there is no GPU (figures meaningless)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (torch.cuda.is_available() is False): this benchmark needs a GPU "
                         "(--device cpu runs it as a smoke test)")
    sizes = [(n, p.numel()) for n, p in ResNet50().named_parameters()]
    total = sum(n for _, n in sizes)
    gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if a.device == "cuda" else "the CPU"
    size = 2 if a.dtype == "bf16" else 4
    print(f"ResNet-50 DDP on CUDA tensors, {a.dtype} ({len(sizes)} tensors, {total:,} parameters, "
          f"{size * total / 1e6:.1f} MB), "
          f"W={a.workers} processes on {gpu}, batch {a.batch} x {a.image}^2 "
          f"per rank, buckets {a.bucket_mb:g} MB; phub: {a.lcores} lcores, "
          f"{'shared memory' if a.shm else 'datagrams'}; torch {torch.__version__}, {os.cpu_count()} CPUs",
          flush=True)
    with LocalAppliance(lcores=a.lcores, memory_budget="2GiB", busy_poll=a.busy_poll, shm=a.shm) as app:
        job, token = app.admit(phub.admin.job_spec("resnet50-cuda", a.workers, sizes, optimizer="mean",
                                                   dtype=a.dtype))
        with tempfile.TemporaryDirectory(prefix="phub-gpu-bench-") as tmp:
            out = str(Path(tmp) / "times.npy")
            run_ranks(worker, a.workers, a, app.control_url, job, token, free_port(), out)
            times = np.load(out)
            first, nccl_error = (Path(out + ".txt").read_text().split("\n") + [""])[:2]
            retx, sent, shm, staged, failures = first.split()
    names = [n for i, n in enumerate(NAMES) if not np.isnan(times[i]).any()]
    med = {n: statistics.median(times[NAMES.index(n)]) * 1000 for n in names}
    lo = {n: min(times[NAMES.index(n)]) * 1000 for n in names}
    print(f"{'':32}{'median ms':>10}{'min ms':>10}")
    labels = {"no exchange": "step, no exchange (baseline)", "gloo": "step, DDP + gloo", "phub": "step, DDP + phub hook",
              "bare gloo": "exchange alone, gloo", "bare phub": "exchange alone, phub", "nccl": "step, DDP + nccl",
              "bare nccl": "exchange alone, nccl"}
    for n in names:
        print(f"  {labels[n]:30}{med[n]:10.1f}{lo[n]:10.1f}")
    base = med["no exchange"]
    print(f"step: phub {med['phub']:.1f} ms, gloo {med['gloo']:.1f} ms: phub/gloo = {med['phub'] / med['gloo']:.2f}")
    if "nccl" in med:
        print(f"step: phub {med['phub']:.1f} ms, nccl {med['nccl']:.1f} ms: phub/nccl = {med['phub'] / med['nccl']:.2f}")
    elif a.nccl:
        print(f"nccl: not measured: {nccl_error or 'no error reported'}")
    for n in [n for n in ("gloo", "phub", "nccl") if n in med]:
        exposed = max(med[n] - base, 0.0)
        bare = med[f"bare {n}"]
        print(f"{n}: exchange alone {bare:.1f} ms, exposed in the step {exposed:.1f} ms: "
              f"overlap with backward {100 * (1 - exposed / bare):.0f}%")
    print(f"phub rank 0: shared memory {'yes' if shm == '1' else 'no'}, {retx} retransmits of {sent} chunks sent")
    if shm == "1" and a.device == "cuda":
        print("phub rank 0: gradients copied " + ("straight into the staging regions (one copy)" if staged == "1" else
                                                 "through the pinned buffer (two copies)")
              + (f", {failures} regions CUDA would not register" if failures != "0" else ""))


if __name__ == "__main__":
    main()
