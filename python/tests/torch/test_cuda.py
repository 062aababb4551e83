"""phub.torch on CUDA tensors (`make test-torch` runs it where torch.cuda.is_available()).

Skipped, with the reason, on a machine without a GPU. On one (W=2 worker
processes may share it):

- The DDP comm hook on CUDA tensors (mean and sum jobs) ends with the same
  parameters as the hook on CPU tensors and as one process on the
  concatenated batches.
- The optimizer on the appliance (DistributedOptimizer) with CUDA
  parameters, for each optimizer: the same as torch.optim on one process
  (CPU) with the averaged gradients.
- A bf16 job takes bf16 CUDA gradients.

GPU and CPU convolutions round differently, so CUDA runs are compared to
the CPU ones within a fraction of how far training moved the parameters,
as the CPU tests compare phub with one process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import phub
import phub.torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_digits as td  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False): the CUDA path of phub.torch is not exercised here",
)

W = 2
STEPS = 30


def close(a: np.ndarray, b: np.ndarray, moved: float, rel: float) -> None:
    diff = float(np.max(np.abs(a - b)))
    assert diff <= rel * moved, f"max |difference| {diff:.3g} > {rel} x {moved:.3g} (parameter movement)"


@pytest.fixture(scope="module")
def initial() -> np.ndarray:
    return td.flat_params(td.make_model(td.Config().seed))


@pytest.mark.parametrize("mode", ["ddp", "ddp-sum"])
def test_comm_hook_on_cuda_matches_cpu_and_one_process(appliance: Any, mode: str, initial: np.ndarray) -> None:
    gpu = td.run(mode, W, td.Config(steps=STEPS, quiet=True, device="cuda"), appliance)
    cpu = td.run(mode, W, td.Config(steps=STEPS, quiet=True), appliance)
    single = td.train_single(td.Config(steps=STEPS, quiet=True), W)
    moved = float(np.max(np.abs(cpu - initial)))
    assert moved > 0.05, "training did not move the parameters"
    close(gpu, cpu, moved, 1e-3)
    close(gpu, single, moved, 1e-3)


@pytest.mark.parametrize("opt", ["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_optimizer_on_the_appliance_with_cuda_parameters(appliance: Any, opt: str, initial: np.ndarray) -> None:
    adam = opt.startswith("adam")
    steps = 10 if adam else STEPS  # see test_torch.py: Adam's ulp-level differences grow
    c = td.Config(steps=steps, quiet=True, optimizer=opt, lr=0.005 if adam else 0.05, device="cuda")
    gpu = td.run("server", W, c, appliance)
    want = td.train_single(td.Config(steps=steps, quiet=True, optimizer=opt, lr=c.lr), W, averaged=True)
    moved = float(np.max(np.abs(want - initial)))
    assert moved > 0.01, "training did not move the parameters"
    close(gpu, want, moved, 1e-3)


def test_bf16_cuda_gradients_through_the_hook(workers: Any) -> None:
    """The hook's CUDA path on a hand-made bucket, bf16, two ranks in this process."""
    ws = workers([1000], W, dtype="bf16", optimizer="mean")
    states = []
    for w in ws:
        p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16, device="cuda"))
        states.append((phub.torch.CommHookState(w, [p]), p))
    grads = [torch.arange(1000, device="cuda").remainder(64).to(torch.bfloat16),
             torch.full((1000,), 0.5, device="cuda").bfloat16()]
    futs = [phub.torch.comm_hook(s, _Bucket(p, g)) for (s, p), g in zip(states, grads)]
    outs = [f.wait() for f in futs]
    torch.cuda.synchronize()
    want = (torch.arange(1000, dtype=torch.float32).remainder(64) + 0.5) / 2
    for o in outs:
        assert o.device.type == "cuda" and o.dtype == torch.bfloat16
        assert torch.equal(o.float().cpu(), want.bfloat16().float())
    for s, _ in states:
        s.close()


class _Bucket:
    """What DDP hands a comm hook, for one parameter whose gradient is the whole buffer."""

    def __init__(self, p: torch.Tensor, g: torch.Tensor) -> None:
        self._p, self._g = p, g

    def buffer(self) -> torch.Tensor:
        return self._g

    def parameters(self) -> list[torch.Tensor]:
        return [self._p]

    def gradients(self) -> list[torch.Tensor]:
        return [self._g]

    def index(self) -> int:
        return 0
