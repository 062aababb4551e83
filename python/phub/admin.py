"""Admit, list and evict jobs through phub-control's HTTP API (standard library only).

The API is documented in ``proto/src/api.rs``: ``POST /v1/jobs`` takes a job
spec as TOML or JSON and answers ``{"id", "token", "chunks", "memory_bytes",
"lcores"}``; every error answer is ``{"error": message}``. Admission and
eviction send the operator token (``Authorization: Bearer``) when one is
given: the ``operator_token`` argument, else ``$PHUB_OPERATOR_TOKEN``
(phub-control keeps it in the file ``<state file>.operator-token``).
An ``https://`` control URL is verified against the CA file that
``$PHUB_CA_FILE`` names, else the system's roots, as the worker library does.

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


def _request(method: str, url: str, body: Optional[bytes] = None, content_type: Optional[str] = None,
             timeout: float = 10.0, operator_token: Optional[str] = None) -> Any:
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
        raise AdminError(f"{method} {url} failed (HTTP {e.code}): {message}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise AdminError(f"{method} {url} failed: {reason}") from None
    return json.loads(text) if text.strip() else None


def _base(control_url: str) -> str:
    return control_url.rstrip("/")


def _call(control_url: str, route: Tuple[str, str], body: Optional[bytes] = None,
          content_type: Optional[str] = None, timeout: float = 10.0,
          operator_token: Optional[str] = None) -> Any:
    """One call of a control route, ``(method, path)`` from the route table
    phub-control's router parses (``phub._native._control_route``)."""
    method, path = route
    return _request(method, f"{_base(control_url)}{path}", body, content_type, timeout, operator_token)


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
