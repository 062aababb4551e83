#!/usr/bin/env python3
"""Sparse logistic regression with FTRL on a click log, weights on a phub table.

The model of click-through-rate prediction in Li et al.'s parameter server
and in McMahan et al.'s "Ad click prediction": one weight per hashed
categorical feature, a logit that sums the weights of an example's
features, and FTRL-proximal (with L1, so most weights stay exactly 0)
updating each weight from its own gradient. Here the weights are a sparse
table of the job (a key of ``kind = "table"``, ``dim = 1``, optimizer
``ftrl``): ids are any 64-bit feature hashes, rows are created on first
touch and FTRL runs on the appliance.

W worker threads (each its own ``phub.Worker``) train in BSP: each step a
rank pulls the weights of its batch's distinct features, computes the
log-loss gradient and pushes it (``pull_rows``, ``push_rows``); the
appliance sums the W gradients of a feature and runs FTRL once. That is
FTRL on the W batches together, which the script also runs in one process
(NumPy, PROTOCOL.md §10.5's formulas) on the same data for comparison: the
two models' held-out log-losses agree (the same updates, summed in
another order).

The data: a generated click log of ``--fields`` categorical fields whose
values follow a Zipf law (a few frequent, a long tail), hashed to 64-bit
ids, plus a bias feature; clicks drawn from a hidden logistic model.
Run ``python python/examples/sparse_lr.py --workers 2`` (binaries from
``$PHUB_BIN_DIR`` or target/release, as phub.local finds them).
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from typing import Any, Optional

import numpy as np

import phub
from phub.local import LocalAppliance

#: The id of the bias feature, in every example.
BIAS = 0


@dataclasses.dataclass
class Config:
    """The data and the training, the same for phub and one process."""

    fields: int = 8
    vocab: int = 20_000  # values per field
    zipf: float = 1.1
    examples: int = 40_000  # training examples, split over the workers
    test: int = 10_000
    batch: int = 256  # per worker per step
    epochs: int = 2
    alpha: float = 0.1
    beta: float = 1.0
    l1: float = 0.5
    l2: float = 1.0
    seed: int = 1


def feature_ids(field: np.ndarray, value: np.ndarray) -> np.ndarray:
    """64-bit hashes of (field, value) pairs (splitmix64), never BIAS."""
    x = (field.astype(np.uint64) << np.uint64(32)) ^ value.astype(np.uint64)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.where(x == np.uint64(BIAS), np.uint64(1), x)


def true_weights(ids: np.ndarray) -> np.ndarray:
    """The hidden model's weight of each id: uniform in [-1.6, 1.6] from
    the id's bits (the bias: -1.5, a click rate of about 0.2 alone)."""
    u = (ids >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.where(ids == np.uint64(BIAS), -1.5, 3.2 * u - 1.6)


def click_log(cfg: Config, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n examples: ids (n, fields + 1; the bias first) and 0/1 clicks."""
    ranks = np.arange(1, cfg.vocab + 1, dtype=np.float64)
    p = ranks ** -cfg.zipf
    p /= p.sum()
    values = rng.choice(cfg.vocab, size=(n, cfg.fields), p=p)
    fields = np.broadcast_to(np.arange(cfg.fields), values.shape)
    ids = np.concatenate([np.full((n, 1), BIAS, np.uint64), feature_ids(fields, values)], axis=1)
    logit = true_weights(ids).sum(axis=1)
    clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, clicks


def gradients(ids: np.ndarray, clicks: np.ndarray, w_of: np.ndarray, inverse: np.ndarray
              ) -> np.ndarray:
    """The log-loss gradient of each distinct id (summed over the batch)."""
    logit = w_of[inverse].sum(axis=1)
    p = 1 / (1 + np.exp(-logit.astype(np.float64)))
    err = (p - clicks).astype(np.float32)
    g = np.zeros(len(w_of), np.float32)
    np.add.at(g, inverse, np.repeat(err[:, None], ids.shape[1], axis=1))
    return g


def log_loss(ids: np.ndarray, clicks: np.ndarray, lookup: Any) -> float:
    """The mean log-loss of the model whose weights `lookup(distinct ids)` gives."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    w = lookup(uniq)
    logit = w[inverse.reshape(ids.shape)].sum(axis=1).astype(np.float64)
    p = np.clip(1 / (1 + np.exp(-logit)), 1e-7, 1 - 1e-7)
    return float(-np.mean(clicks * np.log(p) + (1 - clicks) * np.log(1 - p)))


class Ftrl:
    """FTRL-proximal per coordinate in one process: PROTOCOL.md §10.5's
    ``ftrl`` block in float32, vectorized over a step's ids, rows created
    at 0 on first touch."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.index: dict[int, int] = {}
        self.wzn = np.zeros((1024, 3), np.float32)  # per row: w, z, n

    def _rows(self, uniq: np.ndarray, create: bool) -> np.ndarray:
        idx = np.empty(len(uniq), np.int64)
        for i, u in enumerate(uniq.tolist()):
            j = self.index.get(u)
            if j is None:
                if not create:
                    idx[i] = -1
                    continue
                j = self.index[u] = len(self.index)
                if j == len(self.wzn):
                    self.wzn = np.concatenate([self.wzn, np.zeros_like(self.wzn)])
            idx[i] = j
        return idx

    def weights(self, uniq: np.ndarray) -> np.ndarray:
        idx = self._rows(uniq, create=False)
        return np.where(idx >= 0, self.wzn[np.maximum(idx, 0), 0], np.float32(0))

    def update(self, uniq: np.ndarray, a: np.ndarray) -> None:
        c = self.cfg
        alpha, beta, l1, l2 = (np.float32(x) for x in (c.alpha, c.beta, c.l1, c.l2))
        idx = self._rows(uniq, create=True)
        w, z, n = self.wzn[idx, 0], self.wzn[idx, 1], self.wzn[idx, 2]
        u = n + a * a
        o = (np.sqrt(u) - np.sqrt(n)) / alpha
        z = z + a - o * w
        n = u
        cz = z - np.maximum(np.minimum(z, l1), -l1)
        w = np.float32(0) - cz / ((beta + np.sqrt(n)) / alpha + l2)
        self.wzn[idx] = np.stack([w, z, n], axis=1)


def spec(cfg: Config, workers: int) -> dict[str, Any]:
    table = {"name": "w", "kind": "table", "dim": 1, "rows": 4 * cfg.fields * cfg.vocab,
             "optimizer": {"kind": "ftrl", "alpha": cfg.alpha, "beta": cfg.beta, "l1": cfg.l1, "l2": cfg.l2}}
    return phub.admin.job_spec("sparse-lr", workers, [table], optimizer="sum")


def batches(cfg: Config, ids: np.ndarray, clicks: np.ndarray, workers: int):
    """Per step, each rank's batch: the training set in order, rank r
    taking the r-th slice of each step's W x batch examples."""
    per_step = workers * cfg.batch
    for _ in range(cfg.epochs):
        for s in range(0, len(ids) - per_step + 1, per_step):
            yield [(ids[s + r * cfg.batch:s + (r + 1) * cfg.batch], clicks[s + r * cfg.batch:s + (r + 1) * cfg.batch])
                   for r in range(workers)]


def train_phub(cfg: Config, workers: int, data: tuple[np.ndarray, np.ndarray],
               app: LocalAppliance) -> tuple[phub.Worker, float, int]:
    """Trains on the appliance with W worker threads; returns rank 0's
    worker (to read the weights), the seconds and the steps."""
    jid, token = app.admit(spec(cfg, workers))
    ws = [phub.Worker.join(app.control_url, jid, token, r) for r in range(workers)]
    steps = list(batches(cfg, *data, workers))
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            w = ws[r]
            for step in steps:
                ids, clicks = step[r]
                uniq, inverse = np.unique(ids, return_inverse=True)
                inverse = inverse.reshape(ids.shape)
                rows = np.empty((len(uniq), 1), np.float32)
                w.pull_rows("w", uniq, rows)
                w.push_rows("w", uniq, gradients(ids, clicks, rows[:, 0], inverse))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = time.perf_counter()
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(workers)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if errors:
        raise errors[0]
    return ws[0], time.perf_counter() - t, len(steps)


def train_one(cfg: Config, workers: int, data: tuple[np.ndarray, np.ndarray]) -> tuple[Ftrl, float]:
    """The same updates in one process: each step's W batches together."""
    m = Ftrl(cfg)
    t = time.perf_counter()
    for step in batches(cfg, *data, workers):
        ids = np.concatenate([b[0] for b in step])
        clicks = np.concatenate([b[1] for b in step])
        uniq, inverse = np.unique(ids, return_inverse=True)
        g = gradients(ids, clicks, m.weights(uniq), inverse.reshape(ids.shape))
        m.update(uniq, g)
    return m, time.perf_counter() - t


def run(cfg: Config, workers: int, app: Optional[LocalAppliance] = None, quiet: bool = False) -> dict[str, float]:
    """Both trainings on the same data; their held-out log-losses."""
    rng = np.random.default_rng(cfg.seed)
    train = click_log(cfg, cfg.examples, rng)
    test = click_log(cfg, cfg.test, rng)
    own = app is None
    app = LocalAppliance(lcores=2).start() if own else app
    try:
        w0, phub_s, steps = train_phub(cfg, workers, train, app)

        def pulled(uniq: np.ndarray) -> np.ndarray:
            out = np.empty((len(uniq), 1), np.float32)
            w0.pull_rows("w", uniq, out)
            return out[:, 0]

        phub_loss = log_loss(*test, pulled)
        nonzero = int(np.count_nonzero(pulled(np.unique(test[0]))))
    finally:
        if own:
            app.stop()
    one, one_s = train_one(cfg, workers, train)
    one_loss = log_loss(*test, one.weights)
    base = float(test[1].mean())
    prior = -(base * np.log(base) + (1 - base) * np.log(1 - base))
    hidden = log_loss(*test, true_weights)
    out = {"workers": workers, "steps": steps, "phub_log_loss": phub_loss, "one_process_log_loss": one_loss,
           "prior_log_loss": float(prior), "hidden_model_log_loss": hidden, "phub_s": phub_s,
           "one_process_s": one_s, "test_features_nonzero": nonzero}
    if not quiet:
        print(f"sparse logistic regression, FTRL on a phub table: {workers} workers, {steps} steps of "
              f"{cfg.batch} examples each, {cfg.fields} fields of {cfg.vocab} values (Zipf {cfg.zipf})")
        print(f"  held-out log-loss: phub {phub_loss:.4f}, one process {one_loss:.4f} "
              f"(the click rate alone: {prior:.4f}; the model that drew the clicks: {hidden:.4f})")
        print(f"  time: phub {phub_s:.2f} s, one process (NumPy FTRL) {one_s:.2f} s; "
              f"{nonzero} of the test set's features have a weight other than 0")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=Config.epochs)
    ap.add_argument("--examples", type=int, default=Config.examples)
    ap.add_argument("--seed", type=int, default=Config.seed)
    a = ap.parse_args()
    run(Config(epochs=a.epochs, examples=a.examples, seed=a.seed), a.workers)


if __name__ == "__main__":
    main()
