"""Admit, list and evict jobs through phub-control's HTTP API (standard library only).

The API is documented in ``proto/src/api.rs``: ``POST /v1/jobs`` takes a job
spec as TOML or JSON and answers ``{"id", "token", "chunks", "memory_bytes",
"lcores"}``; every error answer is ``{"error": message}``. Admission and
eviction send the operator token (``Authorization: Bearer``) when one is
given: the ``operator_token`` argument, else ``$PHUB_OPERATOR_TOKEN``
(phub-control keeps it in the file ``<state file>.operator-token``).
An ``https://`` control URL is verified against the CA file that
``$PHUB_CA_FILE`` names, else the system's roots, as the worker library does.
Every ``control_url`` may name several controls on one etcd prefix,
separated by commas (``PHUB_CONTROL=URL1,URL2``): a call goes on to the
next while one does not take it or answers 503, following the leader a
follower names, for :data:`WAIT` seconds at most (see ``_call``).

Example::

    import phub.admin
    spec = phub.admin.job_spec("mlp", workers=2, keys=[("w", 1000), ("b", 10)],
                               optimizer={"kind": "sgd", "lr": 0.1})
    job, token = phub.admin.admit("http://127.0.0.1:7700", spec)
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.request
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple, Union

from ._native import PhubError
from ._native import _control_route

__all__ = ["AdminError", "admit", "admit_full", "evict", "job", "job_spec", "jobs"]

Spec = Union[Mapping[str, Any], str]


class AdminError(PhubError):
    """phub-control refused a request or could not be reached; the message is control's own."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        #: The HTTP status of the answer, or None when control was not reached.
        self.status = status


#: The header of a follower's 503 that names the leader's URL.
LEADER_HEADER = "X-Phub-Leader"
#: The pause after each round of controls that did not serve a call, in seconds.
PAUSE = 0.2
#: How long the controls given are tried, in seconds.
WAIT = 10.0


class _Failure(Exception):
    """How one request failed: ``sent`` says whether it may have been
    carried out (False: it never left); ``status`` and ``leader`` come
    from an answer."""

    def __init__(self, message: str, sent: bool, status: Optional[int] = None,
                 leader: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.sent = sent
        self.status = status
        self.leader = leader


def _exchange(method: str, url: str, body: Optional[bytes], content_type: Optional[str],
              timeout: float, operator_token: Optional[str]) -> Any:
    req = urllib.request.Request(url, data=body, method=method)
    if content_type:
        req.add_header("Content-Type", content_type)
    token = operator_token if operator_token is not None else os.environ.get("PHUB_OPERATOR_TOKEN", "").strip()
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    context = None
    if url.lower().startswith("https://"):
        context = ssl.create_default_context(cafile=os.environ.get("PHUB_CA_FILE") or None)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            text = resp.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        text = e.read().decode("utf-8", "replace")
        try:
            message = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            message = text.strip() or f"HTTP {e.code}"
        leader = (e.headers.get(LEADER_HEADER) or "").strip() or None
        raise _Failure(message, True, e.code, leader) from None
    except urllib.error.URLError as e:
        # urllib wraps what fails while connecting and sending: the
        # request was not taken.
        raise _Failure(str(getattr(e, "reason", e)), False) from None
    except OSError as e:
        # Reading the answer failed (reset, timed out): the request left.
        raise _Failure(str(e) or type(e).__name__, True) from None
    return json.loads(text) if text.strip() else None


def _request(method: str, url: str, body: Optional[bytes] = None, content_type: Optional[str] = None,
             timeout: float = 10.0, operator_token: Optional[str] = None) -> Any:
    """One request to one URL; its JSON answer, or :class:`AdminError`."""
    try:
        return _exchange(method, url, body, content_type, timeout, operator_token)
    except _Failure as f:
        if f.status is not None:
            raise AdminError(f"{method} {url} failed (HTTP {f.status}): {f.message}", f.status) from None
        raise AdminError(f"{method} {url} failed: {f.message}") from None


def _bases(control_url: str) -> list[str]:
    """The controls of ``control_url`` (``URL1,URL2,...``), each once, in order."""
    bases: list[str] = []
    for b in control_url.split(","):
        b = b.strip().rstrip("/")
        if b and b not in bases:
            bases.append(b)
    if not bases:
        raise AdminError(f"control URL {control_url!r}: expected the URL of phub-control "
                         "(http://HOST:PORT), or several separated by commas")
    return bases


def _call(control_url: str, route: Tuple[str, str], body: Optional[bytes] = None,
          content_type: Optional[str] = None, timeout: float = 10.0,
          operator_token: Optional[str] = None, wait: Optional[float] = None) -> Any:
    """One call of a control route, ``(method, path)`` from the route table
    phub-control's router parses (``phub._native._control_route``).

    ``control_url`` is one URL, or several controls on one etcd prefix
    separated by commas, tried as the Rust client (``phub_http::Controls``)
    does: the call goes on to the next control while the one asked does
    not take it (connection refused or not made) or answers 503, following
    the leader a follower names in ``X-Phub-Leader``; a read (GET) also
    when the connection fails after it left. A write that left without an
    answer is not sent again (it may have been carried out). No control is
    asked after ``wait`` seconds (:data:`WAIT`); then the error names every
    control asked and its last answer. With one control, a failed
    connection is the answer at once."""
    method, path = route
    what = f"{method} {path}"
    known = _bases(control_url)
    wait = WAIT if wait is None else wait
    start = time.monotonic()
    asked: dict[str, Tuple[int, Optional[int], str]] = {}
    in_round: set[str] = set()
    cursor, detour = 0, None
    while True:
        if detour is not None:
            base, detour = detour, None
        else:
            while known[cursor] in in_round:
                cursor = (cursor + 1) % len(known)
            base = known[cursor]
        url = f"{base}{path}"
        try:
            return _exchange(method, url, body, content_type, timeout, operator_token)
        except _Failure as f:
            failure = f
        in_round.add(base)
        if failure.status is None and len(known) == 1:
            raise AdminError(f"{method} {url} failed: {failure.message}") from None
        if failure.status is None and failure.sent and method != "GET":
            raise AdminError(f"{what} was sent to {base} and no answer came ({failure.message}); it may "
                             "have been carried out: look (list the jobs, show the job) before sending "
                             "it again") from None
        if failure.status is not None and failure.status != 503:
            raise AdminError(f"{method} {url} failed (HTTP {failure.status}): {failure.message}",
                             failure.status) from None
        if failure.leader and failure.leader.lower().startswith(("http://", "https://")):
            leader = failure.leader.rstrip("/")
            if leader not in known and len(known) < 16:
                known.append(leader)
            if leader in known and leader not in in_round:
                detour = leader
        times = asked.get(base, (0, None, ""))[0] + 1
        asked[base] = (times, failure.status, failure.message)
        waited = time.monotonic() - start
        if waited >= wait:
            parts = []
            for b, (n, status, message) in asked.items():
                more = f", {n} times" if n > 1 else ""
                parts.append(f"{b} ({status if status is not None else 'no answer'}{more}: {message})")
            last = list(asked.values())[-1][1]
            raise AdminError(f"no phub-control served {what} within {waited:.1f} s; asked "
                             + "; ".join(parts), last)
        if all(b in in_round for b in known):
            in_round.clear()
            time.sleep(min(PAUSE, wait - waited))


def admit_full(control_url: str, spec: Spec, timeout: float = 10.0,
               operator_token: Optional[str] = None) -> dict[str, Any]:
    """Admits ``spec`` (a dict, or the text of a TOML or JSON spec) and
    returns control's whole answer: ``id``, ``token`` (16 hex digits),
    ``chunks``, ``memory_bytes``, ``lcores``."""
    if isinstance(spec, str):
        body, ctype = spec.encode("utf-8"), "application/toml"
        if spec.lstrip().startswith("{"):
            ctype = "application/json"
    else:
        body, ctype = json.dumps(dict(spec)).encode("utf-8"), "application/json"
    return _call(control_url, _control_route("admit"), body, ctype, timeout, operator_token)


def admit(control_url: str, spec: Spec, timeout: float = 10.0,
          operator_token: Optional[str] = None) -> Tuple[int, str]:
    """Admits ``spec`` (a dict, or the text of a TOML or JSON spec) on
    phub-control at ``control_url`` and returns ``(job_id, token)``, the
    token as control gives it (16 hex digits; :meth:`phub.Worker.join` takes
    it as is). Raises :class:`AdminError` with control's message (e.g.
    ``invalid job spec: `optimizer.lr` = -0.1: a finite number > 0``)."""
    r = admit_full(control_url, spec, timeout, operator_token)
    return int(r["id"]), str(r["token"])


def jobs(control_url: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The admitted jobs (``GET /v1/jobs``)."""
    return _call(control_url, _control_route("jobs"), timeout=timeout)


def job(control_url: str, job_id: int, timeout: float = 10.0) -> dict[str, Any]:
    """One job's details: summary, spec, ranks, rounds (``GET /v1/jobs/{id}``)."""
    return _call(control_url, _control_route("job", int(job_id)), timeout=timeout)


def evict(control_url: str, job_id: int, timeout: float = 10.0,
          operator_token: Optional[str] = None) -> dict[str, Any]:
    """Evicts a job (``DELETE /v1/jobs/{id}``) and returns its summary."""
    return _call(control_url, _control_route("evict", int(job_id)), timeout=timeout,
                 operator_token=operator_token)


def job_spec(
    name: str,
    workers: int,
    keys: Iterable[Union[int, Tuple[str, int], Mapping[str, Any]]],
    *,
    optimizer: Union[str, Mapping[str, Any]] = "mean",
    dtype: str = "f32",
    chunk_bytes: Optional[int] = None,
    consistency: Union[None, str, int, Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """Builds a spec dict: ``keys`` are element counts, ``(name, elements)``
    pairs or ``{"name", "elements"}`` dicts, in key order; ``optimizer`` is
    a kind (``"sum"``, ``"mean"``) or a dict such as ``{"kind": "sgd",
    "lr": 0.1}``; ``dtype`` is the wire type (``f32``, ``bf16``, ``f16``);
    ``consistency`` is ``None`` (BSP, the default), ``"sync"``,
    ``"async"``, an int τ for bounded delay, or the spec's own dict (e.g.
    ``{"bounded_delay": 4}``)."""
    ks: list[dict[str, Any]] = []
    for i, k in enumerate(keys):
        if isinstance(k, Mapping):
            ks.append(dict(k))
        elif isinstance(k, Sequence) and not isinstance(k, str):
            n, e = k
            ks.append({"name": str(n), "elements": int(e)})
        else:
            ks.append({"name": f"key{i}", "elements": int(k)})
    opt = {"kind": optimizer} if isinstance(optimizer, str) else dict(optimizer)
    spec: dict[str, Any] = {"name": name, "workers": int(workers), "dtype": dtype, "optimizer": opt, "keys": ks}
    if chunk_bytes is not None:
        spec["chunk_bytes"] = int(chunk_bytes)
    if isinstance(consistency, str):
        spec["consistency"] = {"mode": consistency}
    elif isinstance(consistency, int) and not isinstance(consistency, bool):
        spec["consistency"] = {"bounded_delay": consistency}
    elif isinstance(consistency, Mapping):
        spec["consistency"] = dict(consistency)
    elif consistency is not None:
        raise TypeError(f"consistency = {consistency!r}: accepted: None, \"sync\", \"async\", an int τ, or a dict")
    return spec
