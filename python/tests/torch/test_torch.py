"""phub.torch against what users would use instead (`make test-torch`).

- W=2 worker processes training the digits CNN through DDP with phub's comm
  hook (mean and sum jobs) end with the same parameters as DDP over gloo and
  as one process on the concatenated batches.
- With the optimizer on the appliance (DistributedOptimizer): the same as
  torch.optim on one process with the averaged gradients, for SGD,
  momentum, Nesterov, Adam and AdamW.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import phub
import phub.torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_digits as td  # noqa: E402

W = 2
STEPS = 40


def cfg(**kw: Any) -> td.Config:
    return td.Config(steps=STEPS, quiet=True, **kw)


@pytest.fixture(scope="module")
def initial() -> np.ndarray:
    return td.flat_params(td.make_model(td.Config().seed))


@pytest.fixture(scope="module")
def gloo() -> np.ndarray:
    return td.run("gloo", W, cfg())


@pytest.fixture(scope="module")
def single() -> np.ndarray:
    return td.train_single(cfg(), W)


def close(a: np.ndarray, b: np.ndarray, moved: float, rel: float) -> None:
    """a and b agree to `rel` of how far training moved the parameters."""
    diff = float(np.max(np.abs(a - b)))
    assert diff <= rel * moved, f"max |difference| {diff:.3g} > {rel} x {moved:.3g} (parameter movement)"


@pytest.mark.parametrize("mode,hook", [("ddp", {}), ("ddp-sum", {}),
                                       # Small buckets (several in flight at once), and one after the other.
                                       ("ddp", {"bucket_mb": 0.004}), ("ddp", {"bucket_mb": 0.004, "pipeline": False})])
def test_ddp_comm_hook_matches_gloo_and_one_process(appliance: Any, mode: str, hook: dict[str, Any],
                                                      initial: np.ndarray, gloo: np.ndarray,
                                                      single: np.ndarray) -> None:
    got = td.run(mode, W, cfg(**hook), appliance)
    moved = float(np.max(np.abs(gloo - initial)))
    assert moved > 0.05, "training did not move the parameters"
    # Against gloo all-reducing the same gradients: summing two numbers is
    # exact in either order and halving is exact, so expect float agreement.
    np.testing.assert_allclose(got, gloo, rtol=1e-5, atol=1e-6)
    # Against one process on the concatenated batches (a 64-sample mean
    # rounds differently from the mean of two 32-sample means).
    np.testing.assert_allclose(got, single, rtol=1e-3, atol=1e-4)
    close(got, single, moved, 1e-3)


@pytest.mark.parametrize("opt", ["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_optimizer_on_the_appliance_matches_torch_optim(appliance: Any, opt: str, initial: np.ndarray) -> None:
    adam = opt.startswith("adam")
    # Adam's update is scale-free: on near-zero gradients (dead ReLU units)
    # ulp-level differences in the update arithmetic (the appliance computes
    # the bias corrections in f32, torch in f64) grow chaotically, from
    # ~1e-5 after 10 steps to ~lr after 40 on a few elements; so Adam is
    # compared after 10 steps.
    c = td.Config(steps=10 if adam else STEPS, quiet=True, optimizer=opt, lr=0.005 if adam else 0.05)
    got = td.run("server", W, c, appliance)
    # torch.optim on one process with the W workers' averaged gradients.
    want = td.train_single(c, W, averaged=True)
    moved = float(np.max(np.abs(want - initial)))
    assert moved > 0.01, "training did not move the parameters"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    close(got, want, moved, 1e-3)


def test_optimizer_pushing_as_backward_goes_gives_the_same_parameters(appliance: Any, workers: Any) -> None:
    """DistributedOptimizer(overlap=True): each gradient pushed from its
    post-accumulate hook during backward, step() only waits: bit for bit
    the parameters of pushing them all in step(); a second backward before
    step() is refused, naming the key."""
    c = td.Config(steps=STEPS, quiet=True, optimizer="momentum")
    after = td.run("server", W, c, appliance)
    overlapped = td.run("server", W, dataclasses.replace(c, overlap=True), appliance)
    np.testing.assert_array_equal(overlapped, after)
    (w,) = workers([("w", 8), ("b", 2)], 1, optimizer={"kind": "sgd", "lr": 0.5})
    lin = torch.nn.Linear(4, 2, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(8.0).reshape(2, 4))
        lin.bias.zero_()
    opt = phub.torch.DistributedOptimizer(lin, w, overlap=True)
    x = torch.ones(1, 4)
    lin(x).sum().backward()
    opt.step()  # one worker: w -= 0.5 * grad, grad of sum = x for every row
    np.testing.assert_array_equal(lin.weight.detach().numpy(), np.arange(8.0).reshape(2, 4) - 0.5)
    np.testing.assert_array_equal(lin.bias.detach().numpy(), [-0.5, -0.5])
    opt.zero_grad()
    lin(x).sum().backward()
    with pytest.raises(phub.UsageError, match="accumulated twice before step"):
        lin(x).sum().backward()
    opt.step()


def test_broadcast_parameters_gives_rank0_values(workers: Any) -> None:
    models = [td.make_model(1), td.make_model(2)]
    spec_keys = [p.numel() for p in models[0].parameters()]
    ws = workers(spec_keys, W, optimizer="mean")
    ts = [threading.Thread(target=phub.torch.broadcast_parameters, args=(w, m)) for w, m in zip(ws, models)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    np.testing.assert_array_equal(td.flat_params(models[1]), td.flat_params(td.make_model(1)))


def test_bfloat16_tensors(workers: Any) -> None:
    ws = workers([1000], W, dtype="bf16")
    ts = [torch.zeros(1000, dtype=torch.bfloat16) for _ in ws]
    for h in [w.init(0, phub.torch.to_numpy(t)) for w, t in zip(ws, ts)]:
        h.wait()
    gs = [torch.arange(1000, dtype=torch.float32).remainder(64).to(torch.bfloat16), torch.full((1000,), 0.5).bfloat16()]
    for h in [w.push_pull(0, phub.torch.to_numpy(g)) for w, g in zip(ws, gs)]:
        h.wait()
    want = torch.arange(1000, dtype=torch.float32).remainder(64) + 0.5
    for g in gs:
        assert torch.equal(g.float(), want)


class _CountingPulls:
    """A worker whose ``pull_rows`` calls are counted."""

    def __init__(self, worker: Any) -> None:
        self.worker, self.pulls = worker, 0

    def pull_rows(self, *args: Any) -> int:
        self.pulls += 1
        return int(self.worker.pull_rows(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def test_embedding_tables_on_the_appliance_match_torch_embedding(workers: Any, in_threads: Any) -> None:
    """Two ranks train phub.torch.Embedding and EmbeddingBag (sum) over two
    tables whose optimizer (SGD) runs on the appliance; after every step the
    tables hold exactly what torch.nn.Embedding / EmbeddingBag with
    torch.optim.SGD hold when trained on both ranks' losses summed (integer
    targets: every value is exact), and each forward reads the rows of the
    steps before it. From step 1 on each rank prefetches both tables' rows
    before the forwards: the forward takes the prefetched rows (no message
    of its own), or, given other ids than the prefetch's, lets them go and
    pulls its own."""
    lr = 0.5
    table = {"kind": "table", "dim": 3, "rows": 1000, "optimizer": {"kind": "sgd", "lr": lr}}
    ws = workers([{"name": "emb", **table}, {"name": "bag", **table}], W)
    embs = [phub.torch.Embedding(w, "emb") for w in ws]
    bags = [phub.torch.EmbeddingBag(w, "bag", mode="sum") for w in ws]
    for m in embs + bags:
        m.worker = _CountingPulls(m.worker)
    ref_emb = torch.nn.Embedding(16, 3)
    ref_bag = torch.nn.EmbeddingBag(16, 3, mode="sum")
    for m in (ref_emb, ref_bag):
        torch.nn.init.zeros_(m.weight)
    ref_opt = torch.optim.SGD([ref_emb.weight, ref_bag.weight], lr=lr)
    gen = torch.Generator().manual_seed(7)

    def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 16, (3, 2), generator=gen)
        bag_ids = torch.randint(0, 16, (5,), generator=gen)
        offsets = torch.tensor([0, 2])
        tgt = torch.randint(-3, 4, (3, 2, 3), generator=gen).float()
        return ids, bag_ids, offsets, tgt

    for step in range(3):
        data = [batch() for _ in range(W)]

        def rank_step(r: int) -> tuple[torch.Tensor, torch.Tensor]:
            ids, bag_ids, offsets, tgt = data[r]
            if step > 0:
                # Step 2 prefetches other ids for "emb" than its forward's.
                embs[r].prefetch(ids if step == 1 else ids + 1)
                bags[r].prefetch(bag_ids.clone())
            e = embs[r](ids)
            b = bags[r](bag_ids, offsets)
            # A forward that took its prefetch pulled nothing itself.
            assert bags[r].worker.pulls == (step == 0), (step, r)
            assert embs[r].worker.pulls == (step != 1), (step, r)
            bags[r].worker.pulls = embs[r].worker.pulls = 0
            ((e * tgt).sum() + (b * tgt[0, :2]).sum()).backward()
            return e.detach().clone(), b.detach().clone()

        outs = in_threads([lambda r=r: rank_step(r) for r in range(W)])
        if step == 0:
            # Backward only started the pushes: the tables are busy until
            # they are waited (the next forward does it first).
            with pytest.raises(phub.UsageError, match="in flight"):
                ws[0].pull_rows("emb", np.arange(2, dtype=np.int64), np.zeros((2, 3), np.float32))
        assert [m.wait_push() for m in embs + bags] == [step + 1] * (2 * W)
        assert [m.wait_push() for m in embs] == [None] * W  # nothing left to wait
        ref_opt.zero_grad()
        loss = torch.zeros(())
        for r, (ids, bag_ids, offsets, tgt) in enumerate(data):
            e, b = ref_emb(ids), ref_bag(bag_ids, offsets)
            assert torch.equal(outs[r][0], e.detach()) and torch.equal(outs[r][1], b.detach()), (step, r)
            loss = loss + (e * tgt).sum() + (b * tgt[0, :2]).sum()
        loss.backward()
        ref_opt.step()
        every = np.arange(16, dtype=np.int64)
        for name, ref in (("emb", ref_emb), ("bag", ref_bag)):
            got = np.zeros((16, 3), np.float32)
            ws[step % W].pull_rows(name, every, got)
            np.testing.assert_array_equal(got, ref.weight.detach().numpy(), err_msg=f"{name} step {step}")
    assert [w.table_round("emb") for w in ws] == [3, 3]
    with torch.no_grad():
        embs[0](torch.tensor([1]))  # pulls only: no round
    assert ws[0].table_round("emb") == 3


def test_optimizer_spec_translation() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert phub.torch.optimizer_spec(torch.optim.SGD(p, lr=0.1)) == {"kind": "sgd", "lr": 0.1, "weight_decay": 0.0}
    assert phub.torch.optimizer_spec(torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))["kind"] == "nesterov"
    s = phub.torch.optimizer_spec(torch.optim.AdamW(p, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1))
    assert s == {"kind": "adamw", "lr": 1e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
    with pytest.raises(phub.UsageError, match="dampening"):
        phub.torch.optimizer_spec(torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1))
    with pytest.raises(phub.UsageError, match="amsgrad"):
        phub.torch.optimizer_spec(torch.optim.Adam(p, amsgrad=True))
    with pytest.raises(phub.UsageError, match="RMSprop"):
        phub.torch.optimizer_spec(torch.optim.RMSprop(p))
    spec = phub.torch.job_spec(td.make_model(0), 4, optimizer=torch.optim.SGD(p, lr=0.1))
    assert spec["workers"] == 4 and [k["name"] for k in spec["keys"]][:2] == ["conv1.weight", "conv1.bias"]
    assert sum(k["elements"] for k in spec["keys"]) == sum(q.numel() for q in td.make_model(0).parameters())


def test_hook_and_optimizer_refuse_the_wrong_job(workers: Any) -> None:
    model = td.make_model(0)
    keys = [p.numel() for p in model.parameters()]
    (w,) = workers(keys, 1, optimizer={"kind": "sgd", "lr": 0.1})
    with pytest.raises(phub.UsageError, match="sum or mean"):
        phub.torch.CommHookState(w, model)
    (m,) = workers(keys, 1, optimizer="mean")
    with pytest.raises(phub.UsageError, match="DDP comm hook"):
        phub.torch.DistributedOptimizer(model.parameters(), m)
    with pytest.raises(phub.UsageError, match="keys"):
        phub.torch.DistributedOptimizer(torch.nn.Linear(2, 2).parameters(), w)
    with pytest.raises(phub.UsageError, match="lr"):
        phub.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), w)


def test_hook_refuses_a_job_that_is_not_bsp_and_the_optimizer_takes_any_mode(workers: Any) -> None:
    model = td.make_model(0)
    keys = [p.numel() for p in model.parameters()]
    for consistency, named in [("async", "async"), (3, r"bounded_delay \(τ = 3\)")]:
        (w,) = workers(keys, 1, optimizer="sum", consistency=consistency)
        with pytest.raises(phub.UsageError, match=f"comm hook is for BSP jobs.* is {named}"):
            phub.torch.CommHookState(w, model)
    # The optimizer on the appliance: each step is this rank's next clock.
    (w,) = workers(keys, 1, optimizer={"kind": "sgd", "lr": 0.5}, consistency="async")
    opt = phub.torch.DistributedOptimizer(model.parameters(), w)
    before = td.flat_params(model)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    assert w.clock() == 2 and w.consistency == "async"
    np.testing.assert_allclose(td.flat_params(model), before - 1.0, rtol=0, atol=1e-6)
