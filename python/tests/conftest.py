"""Shared fixtures: one local appliance (phub-dataplane + phub-control) per test session.

The binaries come from $PHUB_BIN_DIR or target/release (`make test-python`
builds them and sets it).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import pytest

import phub
from phub import admin
from phub.local import LocalAppliance


@pytest.fixture(scope="session")
def appliance() -> Iterator[LocalAppliance]:
    with LocalAppliance(lcores=2, memory_budget="1GiB") as app:
        yield app


_names = itertools.count()


@pytest.fixture
def job(appliance: LocalAppliance) -> Callable[..., tuple[int, str]]:
    """Admits a job: job(keys, workers=2, optimizer="sum", dtype="f32", consistency=None) -> (id, token)."""

    def admit(keys: list[Any], workers: int = 2, optimizer: Any = "sum", dtype: str = "f32",
              chunk_bytes: int | None = None, consistency: Any = None) -> tuple[int, str]:
        spec = admin.job_spec(f"pytest-{next(_names)}", workers, keys, optimizer=optimizer, dtype=dtype,
                              chunk_bytes=chunk_bytes, consistency=consistency)
        return appliance.admit(spec)

    return admit


@pytest.fixture
def workers(appliance: LocalAppliance, job: Callable[..., tuple[int, str]]) -> Callable[..., list[phub.Worker]]:
    """Admits a job and joins all its ranks in this process: workers(keys, W=2, ...) -> [Worker]."""

    def make(keys: list[Any], w: int = 2, **kw: Any) -> list[phub.Worker]:
        timeout = kw.pop("timeout", None)
        jid, token = job(keys, workers=w, **kw)
        extra = {} if timeout is None else {"timeout": timeout}
        return [phub.Worker.join(appliance.control_url, jid, token, r, **extra) for r in range(w)]

    return make


def _in_threads(fs: list[Callable[[], Any]]) -> list[Any]:
    import threading

    out: list[Any] = [None] * len(fs)
    errs: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fs[i]()
        except BaseException as e:  # noqa: BLE001  # re-raised below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errs:
        raise errs[0]
    return out


@pytest.fixture
def in_threads() -> Callable[[list[Callable[[], Any]]], list[Any]]:
    """in_threads([f, g, ...]) runs each call on its own thread, all at once
    (a round of a job needs every rank), and returns their results in order;
    the first exception any raised is raised."""
    return _in_threads
