"""PyTorch integration: train through phub with DistributedDataParallel, or the PHub way.

Keys and tensors
----------------
A job for a model has **one key per parameter tensor** that requires a
gradient, in ``model.parameters()`` order (key ``i`` = the ``i``-th
parameter, named as in ``named_parameters()``); :func:`job_spec` writes that
spec. Both paths below use this layout, so one admitted job serves either,
and it does not depend on how DDP groups gradients into buckets (DDP
re-buckets after its first iteration).

DistributedDataParallel (sum or mean on the appliance)
-------------------------------------------------------
Admit a ``"mean"`` (or ``"sum"``) job, then change an existing DDP script by
two lines::

    model = DDP(model)                                           # as before
    worker = phub.Worker.join(control_url, job, token, rank)     # + 1
    phub.torch.register_comm_hook(model, worker)                 # + 2

For each gradient bucket DDP hands the hook, :func:`comm_hook` pushes the
slice of every parameter the bucket holds as that parameter's key (in the
bucket's buffer, in place, no copy), and returns a ``torch.futures.Future``
at once. Over datagrams a background thread starts the bucket's keys in
one :meth:`Worker.exchange_start` as soon as DDP hands the bucket over
(the bucket lent to the worker's I/O thread, which sends the gradients
from it and writes each result into it as it arrives; the GIL released),
while the buckets before it may still be on the wire; another waits for
each bucket in turn and completes its future with the averaged bucket
(with a ``"sum"`` job it divides by W). With
shared memory (and for a bucket whose gradients cannot be lent) one
background thread pushes the bucket's keys with ``push_pull`` (copying
them into the appliance's staging region) and another completes the
future once all its keys are back. DDP launches buckets
in the same order on every rank, which phub requires. The process group
(gloo) is still needed by DDP itself (it broadcasts the initial module state
and checks the ranks' parameter shapes); gradients no longer go through it.
The local optimizer (``torch.optim``) runs as before.

The PHub way (the optimizer on the appliance)
---------------------------------------------
Admit a job whose optimizer is ``sgd``, ``momentum``, ``nesterov``,
``adam`` or ``adamw`` (``job_spec(model, W, optimizer=torch_optimizer)``
translates a ``torch.optim`` optimizer), and use
:class:`DistributedOptimizer`::

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    worker = phub.Worker.join(control_url, job, token, rank)
    opt = phub.torch.DistributedOptimizer(opt, worker)   # broadcasts rank 0's parameters
    ...
    loss.backward(); opt.step(); opt.zero_grad()

``step()`` pushes every parameter's gradient and receives the new
parameters in place; no optimizer runs locally.

torchrun
--------
:func:`init` joins the rank torchrun started (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``) to the job ``PHUB_JOB``/``PHUB_TOKEN`` names, or to the job
rank 0 admits from ``PHUB_JOB_SPEC``, at ``PHUB_CONTROL_URL``::

    dist.init_process_group("gloo")          # as before (DDP needs it)
    session = phub.torch.init()              # + 1: session.worker, .rank, .world_size, .local_rank
    model = DDP(model)
    phub.torch.register_comm_hook(model, session.worker)   # + 2

Tensors and devices
-------------------
Tensors must be contiguous. ``float32`` works with every job; ``float16``
and ``bfloat16`` tensors with jobs of that wire dtype, exchanged as the
wire's bits (no ``float32`` copy or conversion anywhere, see ``phub.Worker``).

CUDA tensors (the comm hook, :class:`DistributedOptimizer`,
:func:`broadcast_parameters`): each bucket (each parameter, for the
optimizer) is copied device-to-host into a pinned buffer kept for it, on a
side stream, and pushed once that copy's event has fired; results go back
host-to-device on another side stream, and the default stream waits only
for that copy (the hook's future is CUDA-aware), never for the network. A
bucket's copies overlap the previous bucket's exchange. 16-bit gradients
cross PCIe as 16 bits and go out as 16 bits (no ``float32`` copy on the GPU
or on the host). With shared memory and ``in_place=True`` (the
optimizer's default; the hook's is ``False``, see :class:`CommHookState`)
the device-to-host copy goes straight into the appliance's staging regions
(:meth:`phub.Worker.stage`), the keys go out as headers only
(:meth:`phub.Worker.push_staged`), and the host-to-device copy reads the
results straight from the result regions (:meth:`phub.Handle.wait_in_place`;
both kinds of region are ``cudaHostRegister``-ed once per mapping): one
copy each way, not two, and no pinned buffer of the rank's own.
These paths have run on an H200 (python/tests/torch/test_cuda.py, which
skips without a GPU, and python/bench/bench_cuda_ddp.py; BENCHMARKS.md);
CPU tensors take the code path they always did.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed

from . import admin
from ._native import Handle, Results, Staged, UsageError, Worker

__all__ = [
    "CommHookState",
    "DistributedOptimizer",
    "Embedding",
    "EmbeddingBag",
    "Session",
    "broadcast_parameters",
    "comm_hook",
    "init",
    "job_spec",
    "key_parameters",
    "optimizer_spec",
    "register_comm_hook",
    "to_numpy",
]

ParamsLike = Union[torch.nn.Module, Iterable[torch.Tensor]]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory, no copy, in a form phub takes
    (bfloat16 as its bits in ``int16``)."""
    if t.device.type != "cpu":
        raise UsageError(
            f"phub.Worker takes host memory; this tensor is on {t.device} (copy it with .cpu(); the comm hook, "
            "DistributedOptimizer and broadcast_parameters take CUDA tensors and stage them themselves)"
        )
    if not t.is_contiguous():
        raise UsageError("phub.torch needs contiguous tensors (tensor.contiguous())")
    t = t.detach()
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    raise UsageError(f"phub takes float32, float16 or bfloat16 tensors, not {t.dtype}")


def key_parameters(params: ParamsLike) -> list[torch.Tensor]:
    """The tensors that are the job's keys, in key order: a module's
    parameters that require a gradient (``model.parameters()`` order), or the
    given tensors as they are."""
    if isinstance(params, torch.nn.parallel.DistributedDataParallel):
        params = params.module
    if isinstance(params, torch.nn.Module):
        return [p for p in params.parameters() if p.requires_grad]
    return list(params)


def _key_names(model: ParamsLike) -> Optional[list[str]]:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    if isinstance(model, torch.nn.Module):
        return [n for n, p in model.named_parameters() if p.requires_grad]
    return None


def optimizer_spec(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The appliance optimizer equivalent to a ``torch.optim`` optimizer
    (``SGD`` with or without momentum or Nesterov, ``Adam``, ``AdamW``),
    as the ``[optimizer]`` table of a spec. Raises :class:`phub.UsageError`
    for what the appliance does not run (other optimizers, dampening,
    amsgrad, maximize, per-group hyperparameters)."""
    groups = opt.param_groups
    g = groups[0]

    def same(*names: str) -> None:
        for other in groups[1:]:
            for n in names:
                if other.get(n) != g.get(n):
                    raise UsageError(
                        f"param groups differ in {n!r} ({g.get(n)} vs {other.get(n)}); "
                        "the appliance runs one optimizer per job"
                    )

    if g.get("maximize"):
        raise UsageError("maximize=True: the appliance minimises")
    lr = float(g["lr"])
    wd = float(g.get("weight_decay", 0.0))
    if isinstance(opt, torch.optim.SGD):
        same("lr", "momentum", "dampening", "nesterov", "weight_decay")
        mu = float(g.get("momentum", 0.0))
        if mu == 0.0:
            return {"kind": "sgd", "lr": lr, "weight_decay": wd}
        if float(g.get("dampening", 0.0)) != 0.0:
            raise UsageError("SGD dampening != 0: the appliance's momentum has no dampening")
        kind = "nesterov" if g.get("nesterov") else "momentum"
        return {"kind": kind, "lr": lr, "momentum": mu, "weight_decay": wd}
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        same("lr", "betas", "eps", "weight_decay", "amsgrad")
        if g.get("amsgrad"):
            raise UsageError("amsgrad=True: the appliance runs plain Adam")
        b1, b2 = g["betas"]
        # AdamW subclasses Adam in recent torch: check it first.
        kind = "adamw" if isinstance(opt, torch.optim.AdamW) else "adam"
        return {"kind": kind, "lr": lr, "beta1": float(b1), "beta2": float(b2), "eps": float(g["eps"]),
                "weight_decay": wd}
    raise UsageError(
        f"{type(opt).__name__}: the appliance runs SGD (momentum, Nesterov), Adam and AdamW"
    )


def job_spec(
    model: ParamsLike,
    workers: int,
    *,
    optimizer: Union[str, Mapping[str, Any], torch.optim.Optimizer] = "mean",
    dtype: str = "f32",
    name: str = "torch",
    chunk_bytes: Optional[int] = None,
) -> dict[str, Any]:
    """A job spec (dict, for :func:`phub.admin.admit`) with one key per
    parameter of ``model`` (see :func:`key_parameters`), for ``workers``
    ranks. ``optimizer``: ``"mean"``/``"sum"`` for the DDP hook, or a
    ``torch.optim`` optimizer or an ``[optimizer]`` dict for
    :class:`DistributedOptimizer`."""
    params = key_parameters(model)
    if not params:
        raise UsageError("the model has no parameters that require a gradient")
    names = _key_names(model) or [f"param{i}" for i in range(len(params))]
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer_spec(optimizer)
    keys = [(n, p.numel()) for n, p in zip(names, params)]
    return admin.job_spec(name, workers, keys, optimizer=optimizer, dtype=dtype, chunk_bytes=chunk_bytes)


def _check_layout(worker: Worker, params: Sequence[torch.Tensor]) -> None:
    if len(params) != worker.keys:
        raise UsageError(
            f"{len(params)} parameter tensors but the job has {worker.keys} keys; "
            "admit the job with phub.torch.job_spec(model, ...)"
        )
    for k, p in enumerate(params):
        if worker.key_len(k) != p.numel():
            raise UsageError(
                f"key {k} has {worker.key_len(k)} elements but parameter {k} has {p.numel()} "
                f"(shape {tuple(p.shape)}); admit the job with phub.torch.job_spec(model, ...)"
            )


def broadcast_parameters(worker: Worker, params: ParamsLike) -> None:
    """Round 0 of every key: rank 0's parameter values become every rank's,
    in place. Every rank calls it once, before training."""
    ps = key_parameters(params)
    _check_layout(worker, ps)
    with torch.no_grad():
        pending: list[tuple[Handle, torch.Tensor, torch.Tensor]] = []
        for k, p in enumerate(ps):
            t = p.data if p.data.is_contiguous() else p.data.contiguous()
            if t.device.type != "cpu":
                t = t.cpu()  # round 0 runs once: a plain copy, no staging
            pending.append((worker.init(k, to_numpy(t)), p, t))
        for h, p, t in pending:
            h.wait()
            if t.data_ptr() != p.data.data_ptr():
                p.data.copy_(t)  # host to device for a CUDA parameter


class _CudaStaging:
    """One GPU's side of the exchange: pinned host buffers (one per bucket
    or key, allocated once and reused while the size stays), a stream for
    device-to-host copies and one for host-to-device copies.

    The worker library reads and writes host memory only (the extension has
    no CUDA dependency); this is torch's side. A device-to-host copy waits
    for the current stream (the gradients are computed there) and records an
    event that the push thread waits for (``Event.synchronize`` releases the
    GIL); results go back on the host-to-device stream, and the current
    stream only waits for that copy's event, never for the network."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._host: dict[Any, torch.Tensor] = {}
        # The shared-memory staging regions (written by d2h copies) and
        # result regions (read by h2d copies) registered with CUDA.
        self._staging_regions = _HostRegistry(self.d2h, "staging")
        self._result_regions = _HostRegistry(self.h2d, "result")

    @property
    def register_failures(self) -> int:
        """Regions CUDA refused to register (copies into or out of them
        then go through the driver's own staging: slower, still right)."""
        return self._staging_regions.failures + self._result_regions.failures

    def host(self, slot: Any, like: torch.Tensor) -> torch.Tensor:
        """The pinned flat buffer of ``slot`` (a bucket index, a key), for
        a tensor like ``like``."""
        h = self._host.get(slot)
        if h is None or h.numel() != like.numel() or h.dtype != like.dtype:
            h = torch.empty(like.numel(), dtype=like.dtype, pin_memory=True)
            self._host[slot] = h
        return h

    def to_host(self, slot: Any, t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event"]:
        """Starts copying ``t`` (on this device) into slot's pinned buffer,
        after the current stream's work; returns the buffer and the copy's
        event."""
        host = self.host(slot, t)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            host.copy_(t.reshape(-1), non_blocking=True)
            t.record_stream(self.d2h)  # the caching allocator keeps t's memory until the copy ends
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        return host, ev

    def to_staging(self, staged: Sequence[tuple[Staged, torch.Tensor]]) -> "torch.cuda.Event":
        """Starts copying each gradient (on this device) straight into its
        staged key's spans of the shared-memory staging regions, after the
        current stream's work; returns the copies' event. One copy, where
        :meth:`to_host` and ``push_pull`` make two."""
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            for s, g in staged:
                self._staging_regions.register(s.regions)
                flat = g.reshape(-1)
                for buf, first, n in s.spans:
                    torch.frombuffer(buf, dtype=g.dtype, count=n).copy_(flat[first:first + n], non_blocking=True)
                g.record_stream(self.d2h)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        return ev

    def from_results(self, results: Results, t: torch.Tensor) -> None:
        """Copies a key's results, left where they arrived (the result
        regions, registered with CUDA), host-to-device into ``t`` (on this
        device, flat in the key's order) on the current stream, then lets
        them go: the lcore writes those results again only after this
        rank's next push of the key, which follows this copy on the GPU (its
        gradients are computed after the streams that wait for it)."""
        self._result_regions.register(results.regions)
        # A parameter that is not contiguous gets its values through a flat copy.
        flat = t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        with warnings.catch_warnings():
            # The result regions are read-only (every rank on the host reads them).
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for buf, first, n in results.spans:
                flat[first:first + n].copy_(torch.frombuffer(buf, dtype=t.dtype, count=n), non_blocking=True)
        results.release()
        if not t.is_contiguous():
            t.copy_(flat.view_as(t))


class _HostRegistry:
    """Shared-memory regions of one mapping page-locked for CUDA
    (``cudaHostRegister``), once per mapping, so that device copies go
    straight into or out of them. A new mapping (the dataplane recreated its
    regions) replaces the old one, whose regions are unregistered once
    ``stream`` (the copies that use them) has finished."""

    def __init__(self, stream: Any, what: str) -> None:
        self.stream = stream
        self.what = what
        # address: the region's buffer, which keeps its mapping mapped while registered.
        self.registered: dict[int, Any] = {}
        # Regions of that mapping CUDA refused (kept, so that their
        # addresses stay this mapping's: not tried again).
        self.refused: dict[int, Any] = {}
        self.failures = 0

    def register(self, regions: Sequence[Any]) -> None:
        if not regions or regions[0].address in self.registered or regions[0].address in self.refused:
            return
        if self.registered or self.refused:
            self.stream.synchronize()
            for r in self.registered.values():
                torch.cuda.cudart().cudaHostUnregister(r.address)
            self.registered.clear()
            self.refused.clear()
        for r in regions:
            rc = torch.cuda.cudart().cudaHostRegister(r.address, r.nbytes, 0)
            if int(rc) != 0:
                if self.failures == 0:
                    warnings.warn(
                        f"phub.torch: cudaHostRegister of a shared-memory {self.what} region ({r.nbytes} bytes) "
                        f"failed (CUDA error {int(rc)}): copies with it go through the driver's own staging, "
                        "slower; pass in_place=False to use pinned buffers instead",
                        RuntimeWarning, stacklevel=3)
                self.failures += 1
                self.refused[r.address] = r
                continue
            self.registered[r.address] = r


#: The torch dtype of each wire type: values staged in place are the wire's bytes.
_WIRE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _stage_keys(worker: Worker, keys: Sequence[tuple[int, torch.Tensor]]
                ) -> Optional[list[tuple[Staged, torch.Tensor]]]:
    """Claims every key of ``keys`` for a push written in place into the
    worker's shared-memory staging regions (:meth:`phub.Worker.stage`), or
    none (``None``): without shared memory, or when the gradients are not
    in the job's wire type."""
    if not worker.shm or any(g.dtype != _WIRE_DTYPES.get(worker.dtype_name) for _, g in keys):
        return None
    staged: list[tuple[Staged, torch.Tensor]] = []
    try:
        for k, g in keys:
            s = worker.stage(k)
            if s is None:  # the mapping went (the dataplane is restarting)
                break
            staged.append((s, g))
        else:
            return staged
    except BaseException:
        for s, _ in staged:
            _release(s)
        raise
    for s, _ in staged:
        _release(s)
    return None


def _release(s: Staged) -> None:
    """Gives a staged key back, if it was neither pushed nor released."""
    try:
        s.release()
    except UsageError:
        pass


class _Completer:
    """A thread that waits for handles (the GIL is released while it waits)
    and then completes futures, in submission order.

    Every one still running when the interpreter exits is closed first
    (:func:`_close_completers`, an ``atexit`` handler): completing a
    future runs DDP's callbacks in C++ on this thread after the training
    loop has seen the future done, and a daemon thread still in there when
    the interpreter finalizes is ended by ``pthread_exit``, whose unwinding
    through C++ frames that may not throw aborts the process ("terminate
    called without an active exception": ``make demo-torch`` and the DDP
    tests lost a rank that way, 2 runs in 5 here, always the rank that
    exits first)."""

    def __init__(self, name: str) -> None:
        self._q: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._t.start()
        _live_completers.add(self)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._q.put(job)

    def close(self, timeout: Optional[float] = None) -> None:
        """Stops the thread after the jobs already submitted (waits at most
        ``timeout`` seconds for them); closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._t.join(timeout)


#: Completer threads not closed yet (:class:`_Completer`).
_live_completers: "weakref.WeakSet[_Completer]" = weakref.WeakSet()

#: How long the exit handler waits for a completer's jobs, in seconds.
_EXIT_WAIT = 30.0


def _close_completers() -> None:
    for c in list(_live_completers):
        c.close(_EXIT_WAIT)


atexit.register(_close_completers)


class CommHookState:
    """State of :func:`comm_hook`: the worker, and which key each parameter is.

    ``model``: the DDP model (or the module it wraps); its parameters in
    ``model.parameters()`` order are the job's keys. ``init_keys``: run
    round 0 of every key now (with copies of the parameters: the module is
    not modified); every rank constructs the state at the same point. The
    job's optimizer must be ``sum`` or ``mean``, and its consistency BSP
    (``sync``, the default): an async or bounded-delay job is refused.
    ``in_place``: with shared memory, copy CUDA gradients straight into the
    staging regions (one copy); the default, ``False``, keeps the pinned
    buffer and the worker's copy (two copies). On an H200 with two ranks
    the two copies made the DDP step faster (f32 0.80x gloo's against 0.86x,
    bf16 1.06-1.10x against 1.21-1.26x; BENCHMARKS.md, "Third lease"): the
    one-copy path issues a copy per span of each key while backward runs,
    and backward hid half as much of the exchange.
    ``pipeline`` (CPU tensors over datagrams): start each bucket's exchange
    as DDP hands the bucket over, while the buckets before it are still on
    the wire (:meth:`phub.Worker.exchange_start`); ``False`` exchanges the
    buckets one after the other, each started once the one before has
    ended (the earlier way, kept for comparison: BENCHMARKS.md).
    """

    def __init__(self, worker: Worker, model: ParamsLike, *, init_keys: bool = True, in_place: bool = False,
                 pipeline: bool = True) -> None:
        if worker.consistency != "sync":
            mode = worker.consistency
            if worker.bounded_delay is not None:
                mode += f" (τ = {worker.bounded_delay})"
            raise UsageError(
                f"the comm hook is for BSP jobs (consistency sync): DDP needs every rank to get the same "
                f"averaged gradients each step, and job {worker.job} is {mode}; admit the job with "
                "consistency sync, or use phub.torch.DistributedOptimizer, which takes any mode"
            )
        if worker.optimizer not in ("sum", "mean"):
            raise UsageError(
                f"the comm hook needs a sum or mean job; this job runs {worker.optimizer!r} on the appliance: "
                "use phub.torch.DistributedOptimizer for that"
            )
        self.worker = worker
        self.in_place = in_place
        self.pipeline = pipeline
        self.params = key_parameters(model)
        _check_layout(worker, self.params)
        self.scale = 1.0 / worker.workers if worker.optimizer == "sum" else 1.0
        self._key_of = {id(p): k for k, p in enumerate(self.params)}
        self._key_of_ptr = {(p.data_ptr(), p.numel()): k for k, p in enumerate(self.params)}
        # Buckets are pushed on one thread and waited for on another, each
        # in submission order: the hook returns at once, and a bucket's
        # pushes do not wait for the previous bucket's results.
        self._pusher = _Completer(f"phub-comm-hook-push-{worker.rank}")
        self._completer = _Completer(f"phub-comm-hook-{worker.rank}")
        #: Buckets exchanged so far.
        self.buckets = 0
        self._staging: dict[torch.device, _CudaStaging] = {}
        if init_keys:
            copies = [p.detach().cpu() if p.is_cuda else p.detach().clone() for p in self.params]
            handles = [worker.init(k, to_numpy(c.contiguous())) for k, c in enumerate(copies)]
            for h in handles:
                h.wait()

    def key_of(self, p: torch.Tensor) -> int:
        """The key of parameter ``p``."""
        k = self._key_of.get(id(p))
        if k is None:
            k = self._key_of_ptr.get((p.data_ptr(), p.numel()))
        if k is None:
            raise UsageError(f"a bucket holds a parameter (shape {tuple(p.shape)}) that is not one of the job's keys")
        return k

    def staging(self, device: torch.device) -> _CudaStaging:
        """Pinned buffers and streams for buckets on ``device`` (a GPU)."""
        st = self._staging.get(device)
        if st is None:
            st = self._staging[device] = _CudaStaging(device)
        return st

    def close(self) -> None:
        """Stops the push and completion threads (after the buckets already submitted)."""
        self._pusher.close()
        self._completer.close()


def comm_hook(state: CommHookState, bucket: Any) -> "torch.futures.Future[torch.Tensor]":
    """A DDP communication hook (``model.register_comm_hook(state, comm_hook)``)
    that sends the bucket through phub and returns a future of the averaged
    bucket. See the module's documentation."""
    fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
    buf = bucket.buffer()
    try:
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        keys = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if not lo <= g.data_ptr() < hi:
                raise UsageError("a bucket's gradient is not a view of its buffer; phub's hook needs DDP's layout")
            keys.append((state.key_of(p), g))
    except BaseException as e:
        fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the result
        return fut
    scale = state.scale
    state.buckets += 1
    if buf.is_cuda:
        return _cuda_bucket(state, bucket, buf, keys, scale)

    def push() -> None:
        # On the pusher thread: each push_pull copies its gradient into
        # the appliance's shared memory (or hands it to the I/O thread)
        # with the GIL released, while autograd goes on with the next
        # bucket.
        handles = []
        try:
            for k, g in keys:
                handles.append(state.worker.push_pull(k, to_numpy(g)))
        except BaseException as e:
            state._completer.submit(lambda: _fail(handles, fut, e))
            return
        state._completer.submit(lambda: _complete(handles, buf, scale, fut))

    def exchange() -> None:
        # The bucket's gradients lent to the worker's I/O thread in one
        # call, each result written into the bucket as it arrives (no copy
        # on a Python thread; 1.42x gloo's step against 1.63-1.78x per key,
        # BENCHMARKS.md). A gradient that cannot be lent (unaligned) takes
        # the per-key calls; exchange refuses before it sends.
        reqs = [(k, to_numpy(g)) for k, g in keys]
        try:
            if state.pipeline:
                # On the pusher thread, as DDP hands the bucket over: started
                # while the buckets before it are still on the wire, waited
                # for on the completer thread.
                pending = state.worker.exchange_start(reqs)
                state._completer.submit(lambda: _complete_exchange(pending, buf, scale, fut))
                return
            # On the completer thread, bucket after bucket.
            state.worker.exchange(reqs)
        except UsageError as e:
            if "lent in place" not in str(e):
                fut.set_exception(e)  # type: ignore[arg-type]
                return
            if state.pipeline:
                push()  # on the pusher thread already
            else:
                state._pusher.submit(push)
            return
        except BaseException as e:
            fut.set_exception(e)  # type: ignore[arg-type]
            return
        _complete([], buf, scale, fut)

    if state.worker.shm:
        # With shared memory the per-key calls are the faster (0.93-0.97x
        # gloo's step against 1.08-1.14x, same runs, BENCHMARKS.md): the
        # pusher thread copies the gradients into the staging regions
        # while the I/O thread takes the results; an exchange leaves both
        # copies to the I/O thread.
        state._pusher.submit(push)
    elif state.pipeline:
        state._pusher.submit(exchange)
    else:
        state._completer.submit(exchange)
    return fut


def _complete_exchange(pending: Any, buf: torch.Tensor, scale: float,
                       fut: "torch.futures.Future[torch.Tensor]") -> None:
    try:
        pending.wait()
    except BaseException as e:
        fut.set_exception(e)  # type: ignore[arg-type]
        return
    _complete([], buf, scale, fut)


def _complete(handles: list, buf: torch.Tensor, scale: float, fut: "torch.futures.Future[torch.Tensor]") -> None:
    try:
        for h in handles:
            h.wait()
        if scale != 1.0:
            buf.mul_(scale)
        fut.set_result(buf)
    except BaseException as e:
        fut.set_exception(e)  # type: ignore[arg-type]


def _cuda_bucket(state: CommHookState, bucket: Any, buf: torch.Tensor, keys: list, scale: float
                 ) -> "torch.futures.Future[torch.Tensor]":
    """The hook for a bucket on a GPU: device-to-host copy into the bucket's
    pinned buffer on the side stream, push once the copy's event has
    fired, results back host-to-device on the other side stream; the
    future is CUDA-aware (``devices=``): DDP's ``wait()`` makes its
    current stream wait for the host-to-device copy's event, so the default
    stream never waits for the network, and the next bucket's copy runs
    while this one is exchanged."""
    fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future(devices=[buf.device])
    st = state.staging(buf.device)
    try:
        staged = _stage_keys(state.worker, keys) if state.in_place else None
        if staged is not None:
            return _cuda_bucket_staged(state, buf, staged, scale, st, fut)
        host, copied = st.to_host(bucket.index(), buf)
    except BaseException as e:
        fut.set_exception(e)  # type: ignore[arg-type]
        return fut
    views = [(k, _place_of(g, buf, host)) for k, g in keys]

    def push() -> None:
        handles = []
        try:
            copied.synchronize()  # GIL released while the copy finishes
            for k, h in views:
                handles.append(state.worker.push_pull(k, to_numpy(h)))
        except BaseException as e:
            state._completer.submit(lambda: _fail(handles, fut, e))
            return
        state._completer.submit(lambda: _complete_cuda(handles, host, buf, scale, fut, st))

    state._pusher.submit(push)
    return fut


def _place_of(g: torch.Tensor, buf: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """The slice of ``host`` (flat, like ``buf``) where gradient ``g``, a
    view of the bucket ``buf``, lies in it."""
    at = (g.data_ptr() - buf.data_ptr()) // buf.element_size()
    return host[at:at + g.numel()]


def _cuda_bucket_staged(state: CommHookState, buf: torch.Tensor,
                        staged: list[tuple[Staged, torch.Tensor]], scale: float, st: _CudaStaging,
                        fut: "torch.futures.Future[torch.Tensor]") -> "torch.futures.Future[torch.Tensor]":
    """:func:`_cuda_bucket` with shared memory: each gradient is copied
    device-to-host straight into its key's staging spans (registered with
    CUDA), then pushed as headers only (:meth:`phub.Worker.push_staged`);
    each key's results are copied host-to-device straight from where they
    arrived (the result regions, registered too) into its gradient's place
    in the bucket (:meth:`phub.Handle.wait_in_place`), and scaled there."""
    try:
        copied = st.to_staging(staged)
    except BaseException:
        for s, _ in staged:
            _release(s)
        raise

    def push() -> None:
        handles = []
        try:
            copied.synchronize()  # GIL released while the copies finish
            for s, _ in staged:
                handles.append(state.worker.push_staged(s))
        except BaseException as e:
            for s, _ in staged[len(handles):]:
                _release(s)
            state._completer.submit(lambda: _fail(handles, fut, e))
            return
        grads = [g for _, g in staged]
        state._completer.submit(lambda: _complete_cuda_in_place(handles, grads, buf, scale, fut, st))

    state._pusher.submit(push)
    return fut


def _complete_cuda_in_place(handles: list, grads: list, buf: torch.Tensor, scale: float,
                            fut: "torch.futures.Future[torch.Tensor]", st: _CudaStaging) -> None:
    try:
        results = [h.wait_in_place() for h in handles]
        with torch.cuda.device(st.device), torch.cuda.stream(st.h2d):
            for res, g in zip(results, grads):
                st.from_results(res, g)
            if scale != 1.0:
                buf.mul_(scale)  # on the device, after the copies
            fut.set_result(buf)
    except BaseException as e:
        fut.set_exception(e)  # type: ignore[arg-type]


def _complete_cuda(handles: list, host: torch.Tensor, buf: torch.Tensor, scale: float,
                   fut: "torch.futures.Future[torch.Tensor]", st: _CudaStaging) -> None:
    try:
        for h in handles:
            h.wait()
        if scale != 1.0:
            host.mul_(scale)  # on the host, before the copy back
        with torch.cuda.device(st.device), torch.cuda.stream(st.h2d):
            buf.copy_(host.view_as(buf), non_blocking=True)
            # Records an event on the current stream (h2d) of buf's device;
            # whoever waits on the future orders its stream after it.
            fut.set_result(buf)
    except BaseException as e:
        fut.set_exception(e)  # type: ignore[arg-type]


def _fail(handles: list, fut: "torch.futures.Future[torch.Tensor]", e: BaseException) -> None:
    for h in handles:  # the pushes that did start end before the bucket is given back
        try:
            h.wait()
        except BaseException:
            pass
    fut.set_exception(e)  # type: ignore[arg-type]


# DDP checks a hook's annotations against the real types; this module's are
# strings (postponed evaluation), so give it the objects.
comm_hook.__annotations__ = {
    "state": CommHookState,
    "bucket": getattr(torch.distributed, "GradBucket", Any),
    "return": torch.futures.Future[torch.Tensor],
}


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, worker: Worker, **kwargs: Any
                       ) -> CommHookState:
    """Registers :func:`comm_hook` on ``ddp_model`` with a new
    :class:`CommHookState` (keyword arguments go to it) and returns the state."""
    state = CommHookState(worker, ddp_model.module, **kwargs)
    ddp_model.register_comm_hook(state, comm_hook)
    return state


class DistributedOptimizer(torch.optim.Optimizer):
    """The PHub way: the appliance runs the optimizer.

    ``params``: a ``torch.optim`` optimizer (its parameters, in
    ``param_groups`` order, are the keys; its hyperparameters are checked
    against the job's), or a module or tensors. ``step()`` pushes every
    parameter's gradient (zeros for one without a gradient: every rank
    pushes every key each round) and writes the appliance's new parameters
    into the parameters in place. ``broadcast``: start with
    :func:`broadcast_parameters` (rank 0's values everywhere).
    ``in_place``: as :class:`CommHookState`'s, for CUDA parameters, but
    one copy by default here (``step`` stages after backward, so it takes
    nothing from backward's overlap; not measured against two copies yet).
    ``overlap`` (CPU parameters): push each parameter's gradient as soon as
    backward has accumulated it (a post-accumulate-grad hook), while
    backward goes on with the layers before it, and have ``step()`` wait
    for the new parameters; off by default because it changes what a
    training loop may do between ``backward()`` and ``step()``: the
    gradients are already on their way (clipping or scaling them there
    changes nothing; do it in the job's spec or the loss), a parameter may
    hold its new value before ``step()`` returns, and each step takes
    exactly one backward (a second accumulation into a gradient before
    ``step()`` raises :class:`UsageError` from backward).

    Learning rate, momentum and so on are the job's: changing
    ``param_groups`` here changes nothing on the appliance, and there is no
    local optimizer state.

    Any consistency mode works; the job's spec decides (PROTOCOL.md §5.8).
    In an async or bounded-delay job each ``step()`` is this rank's next
    clock (``worker.clock()``): the appliance applies its gradients alone
    and sends back the parameters as they are then, with bounded delay τ
    once no rank is more than τ steps behind.
    """

    def __init__(self, params: Union[torch.optim.Optimizer, ParamsLike], worker: Worker, *,
                 broadcast: bool = True, in_place: bool = True, overlap: bool = False) -> None:
        if worker.optimizer in ("sum", "mean"):
            raise UsageError(
                f"this job's optimizer is {worker.optimizer!r}: the appliance returns aggregated gradients, "
                "not parameters; admit a job with an optimizer (e.g. job_spec(model, W, optimizer=torch_opt)) "
                "or use the DDP comm hook"
            )
        if isinstance(params, torch.optim.Optimizer):
            want = optimizer_spec(params)
            have = worker.spec()["optimizer"]
            for k, v in want.items():
                hv = have.get(k)
                if isinstance(v, float) and isinstance(hv, (int, float)):
                    # The spec travels as f32.
                    if abs(float(hv) - v) > 1e-6 * max(1.0, abs(v)):
                        raise UsageError(f"the torch optimizer has {k}={v} but the job runs {k}={hv}")
                elif hv != v:
                    raise UsageError(f"the torch optimizer has {k}={v!r} but the job runs {k}={hv!r}")
            ps = [p for g in params.param_groups for p in g["params"]]
        else:
            ps = key_parameters(params)
        _check_layout(worker, ps)
        for p in ps:
            if not p.data.is_contiguous():
                raise UsageError("DistributedOptimizer needs contiguous parameters")
        devices = {p.device for p in ps}
        if len(devices) > 1:
            raise UsageError(f"DistributedOptimizer: parameters on {sorted(map(str, devices))}; one device per rank")
        super().__init__(ps, {})
        self.worker = worker
        self.in_place = in_place
        self._params = ps
        dev = next(iter(devices))
        self._staging = _CudaStaging(dev) if dev.type == "cuda" else None
        if overlap and self._staging is not None:
            raise UsageError("DistributedOptimizer(overlap=True) is for CPU parameters; CUDA parameters are "
                             "staged in step() (use overlap=False)")
        if broadcast:
            broadcast_parameters(worker, ps)
        #: overlap: the requests started by backward this step, by key.
        self._started: dict[int, Any] = {}
        self._overlap = overlap
        if overlap:
            for k, p in enumerate(ps):
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, k))

    def _start(self, k: int, p: torch.Tensor) -> Any:
        """Starts key ``k``'s round: lent over datagrams (the result lands
        in the parameter), else (shared memory, or a tensor that cannot be
        lent) ``push_pull`` with a copy."""
        g, out = to_numpy(self._grad(p)), to_numpy(p.data)
        if not self.worker.shm:
            try:
                return self.worker.exchange_start([(k, g, out)])
            except UsageError as e:
                if "lent in place" not in str(e):
                    raise
        return self.worker.push_pull(k, g, out)

    @torch.no_grad()
    def _grad_ready(self, k: int, p: torch.Tensor) -> None:
        # On autograd's thread, as soon as backward has accumulated p.grad.
        if k in self._started:
            raise UsageError(
                f"DistributedOptimizer(overlap=True): key {k}'s gradient was accumulated twice before step(): "
                "with overlap each step takes exactly one backward (gradients are pushed as backward makes "
                "them); use overlap=False to accumulate over several backward passes"
            )
        self._started[k] = self._start(k, p)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Pushes the gradients, waits for the new parameters (in place)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._staging is not None:
            self._step_cuda(self._staging)
            return loss
        if self._overlap:
            started, self._started = self._started, {}
            # Parameters backward gave no gradient push zeros now, as below.
            for k, p in enumerate(self._params):
                if k not in started:
                    started[k] = self._start(k, p)
            for k in sorted(started):
                started[k].wait()
            return loss
        grads = [(k, to_numpy(self._grad(p)), to_numpy(p.data)) for k, p in enumerate(self._params)]
        if not self.worker.shm:
            try:
                # Every parameter's round in one call, the tensors lent to
                # the worker's I/O thread: each result lands in its
                # parameter as it arrives, no copy on this thread, the GIL
                # released once (over datagrams; with shared memory the
                # per-key calls below are the faster, as for the hook).
                self.worker.exchange(grads)
                return loss
            except UsageError as e:
                # A tensor that cannot be lent (unaligned): the per-key
                # calls, which copy. exchange refuses before it sends.
                if "lent in place" not in str(e):
                    raise
        handles = [self.worker.push_pull(k, g, out) for k, g, out in grads]
        for h in handles:
            h.wait()
        return loss

    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g is None:
            return torch.zeros_like(p.data)
        if not g.is_contiguous() or g.dtype != p.dtype:
            return g.contiguous().to(p.dtype)
        return g

    def _step_cuda(self, st: _CudaStaging) -> None:
        # Each gradient is copied to its pinned buffer on the side stream
        # (after the current stream's backward) and pushed as soon as its own
        # copy is done; each new parameter goes back on the other side stream
        # as soon as it is in, and the current stream waits for the last of
        # those copies (an event), not for the network.
        # With shared memory each gradient is copied straight into its
        # key's staging spans instead, and pushed as headers only.
        grads = [(k, self._grad(p)) for k, p in enumerate(self._params)]
        staged = _stage_keys(self.worker, grads) if self.in_place else None
        handles = []
        if staged is not None:
            try:
                events = [st.to_staging([sg]) for sg in staged]
                for p, (s, _), copied in zip(self._params, staged, events):
                    copied.synchronize()  # GIL released
                    handles.append((self.worker.push_staged(s), p))
            except BaseException:
                # The keys not pushed are given back; those pushed complete
                # in the background (their handles are dropped).
                for s, _ in staged[len(handles):]:
                    _release(s)
                raise
            # The new parameters straight from where they arrived.
            with torch.cuda.stream(st.h2d):
                for h, p in handles:
                    st.from_results(h.wait_in_place(), p.data)
                done = torch.cuda.Event()
                done.record(st.h2d)
            torch.cuda.current_stream(st.device).wait_event(done)
            return
        else:
            copies = [st.to_host(("grad", k), g) for k, g in grads]
            for k, (p, (g, copied)) in enumerate(zip(self._params, copies)):
                out = st.host(("param", k), p.data)
                copied.synchronize()  # GIL released
                handles.append((self.worker.push_pull(k, to_numpy(g), to_numpy(out)), p, out))
        with torch.cuda.stream(st.h2d):
            for h, p, out in handles:
                h.wait()
                p.data.copy_(out.view_as(p.data), non_blocking=True)
            done = torch.cuda.Event()
            done.record(st.h2d)
        torch.cuda.current_stream(st.device).wait_event(done)


# -- sparse tables: Embedding and EmbeddingBag ------------------------------


class _TableLookup(torch.nn.Module):
    """What :class:`Embedding` and :class:`EmbeddingBag` share: the table's
    rows of a batch's distinct ids, pulled, as a leaf tensor whose gradient
    is pushed as the table's next round."""

    def __init__(self, worker: Worker, table: str) -> None:
        super().__init__()
        self.worker = worker
        self.table = table
        #: Values per row (the table's ``dim``).
        self.dim = worker.table_dim(table)
        #: The push the last backward started, not waited yet.
        self._pending: Optional[Any] = None
        #: The pull :meth:`prefetch` started: (ids, their distinct ids,
        #: each id's index among them, the rows' array, the RowsPull).
        self._prefetched: Optional[tuple[torch.Tensor, np.ndarray, torch.Tensor, np.ndarray, Any]] = None

    def prefetch(self, ids: torch.Tensor) -> None:
        """Starts pulling the rows of ``ids`` (the ids the next forward will
        be given) and returns at once, so that the pulls of a model's
        tables are in flight together: call it on every table before the
        first table's forward. That forward, given equal ids, waits for the
        pull instead of pulling; given other ids it lets the prefetched rows
        go and pulls its own; a backward before that forward lets them go
        too (they would be the rows before its round). Waits first for the
        push the last backward started (the rows read are the round after
        it, as forward's). The table is busy until the pull is taken or let
        go."""
        self.wait_push()
        self._drop_prefetch()
        uniq, inverse = self._distinct(ids)
        out = np.empty((len(uniq), self.dim), dtype=np.float32)
        pull = self.worker.pull_rows_start(self.table, uniq, out)
        self._prefetched = (ids.detach().clone(), uniq, inverse, out, pull)

    def _drop_prefetch(self) -> None:
        """Waits for a prefetched pull no forward took, and lets it go."""
        p, self._prefetched = self._prefetched, None
        if p is not None and p[4].pending:
            p[4].wait()

    def wait_push(self) -> Optional[int]:
        """Waits for the push the last backward started, if it was not
        waited yet, and returns its round (its failure is raised here).
        Backward only starts the push, so that the pushes of several
        tables are in flight together; the next forward, or
        :meth:`skip_round`, waits for it first. Call it before reading the
        table another way (``worker.pull_rows``, a checkpoint): until then
        the table is busy."""
        p, self._pending = self._pending, None
        return None if p is None else p.wait()

    def _distinct(self, ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """``ids``' distinct ids (sorted, int64) and each id's index among
        them, shaped as ``ids``."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise UsageError(f"table {self.table!r}: ids are int64 or int32, got {ids.dtype}")
        uniq, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        ids_np = np.ascontiguousarray(uniq.detach().cpu().numpy().astype(np.int64, copy=False))
        return ids_np, inverse.reshape(ids.shape)

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``ids``' distinct ids and each id's index among them."""
        self.wait_push()
        p = self._prefetched
        if p is not None and p[0].shape == ids.shape and p[0].device == ids.device and torch.equal(p[0], ids):
            self._prefetched = None
            _, ids_np, inverse, out, pull = p
            pull.wait()
        else:
            self._drop_prefetch()
            ids_np, inverse = self._distinct(ids)
            out = np.empty((len(ids_np), self.dim), dtype=np.float32)
            self.worker.pull_rows(self.table, ids_np, out)
        rows = torch.from_numpy(out).to(ids.device)
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(lambda g: self._push(ids_np, g))
        return rows, inverse

    def _push(self, ids_np: np.ndarray, grad: torch.Tensor) -> torch.Tensor:
        g = np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy())
        self.wait_push()  # two backward passes over one forward's rows
        self._drop_prefetch()  # rows prefetched before this round's update: stale
        self._pending = self.worker.push_rows_start(self.table, ids_np, g)
        return grad

    def skip_round(self) -> int:
        """Pushes a round with no rows, for a rank with nothing to look up
        this step (every rank pushes every round of a table). Returns the
        round."""
        self.wait_push()
        self._drop_prefetch()
        return self.worker.push_rows(self.table, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32))

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.dim}"


class Embedding(_TableLookup):
    """``torch.nn.Embedding`` whose table lives on the appliance: the sparse
    table ``table`` of ``worker``'s job (a key of ``kind = "table"``,
    PROTOCOL.md §10), ids any non-negative int64 (no ``num_embeddings``).

    ``forward(ids)`` pulls the rows of the batch's distinct ids (the rows of
    the table's last completed round) and returns ``ids.shape + (dim,)``;
    its backward pushes their gradients (a repeated id's summed) as the
    table's next round, and the table's optimizer (the spec's, e.g.
    ``{"kind": "adagrad", "lr": 0.1}``) updates those rows on the appliance,
    summed over the ranks in BSP. The module has no parameters: keep it out
    of ``torch.optim``. A dense part of the same model may use the DDP comm
    hook or :class:`DistributedOptimizer` as usual.

    Every rank does one forward and one backward per step (a round
    completes once every rank pushed it); a rank with no ids calls
    :meth:`skip_round` instead. In ``eval()`` or under ``torch.no_grad()``
    forward only pulls. Backward starts the push and returns (the tables
    of a model push together); the next forward waits for it, or
    :meth:`wait_push`. :meth:`prefetch` starts the next forward's pull
    early, so that a model's tables pull together too."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows, inverse = self._rows(ids)
        return torch.nn.functional.embedding(inverse, rows)


class EmbeddingBag(_TableLookup):
    """``torch.nn.EmbeddingBag`` over a table on the appliance (see
    :class:`Embedding`): ``forward(input, offsets=None,
    per_sample_weights=None)`` reduces each bag's rows with ``mode``
    (``"sum"``, ``"mean"`` or ``"max"``) as ``torch.nn.functional.embedding_bag``
    does, over the rows of the batch's distinct ids pulled from the table;
    backward pushes those rows' gradients as the table's next round."""

    def __init__(self, worker: Worker, table: str, mode: str = "mean") -> None:
        super().__init__(worker, table)
        if mode not in ("sum", "mean", "max"):
            raise UsageError(f"EmbeddingBag mode {mode!r}: one of 'sum', 'mean', 'max'")
        self.mode = mode

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows, inverse = self._rows(input)
        return torch.nn.functional.embedding_bag(inverse, rows, offsets, mode=self.mode,
                                                 per_sample_weights=per_sample_weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"


# -- torchrun: phub.torch.init() ---------------------------------------------

#: Environment variables :func:`init` reads (torchrun's, then phub's).
ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
ENV_CONTROL_URL = "PHUB_CONTROL_URL"
ENV_JOB, ENV_TOKEN, ENV_JOB_SPEC = "PHUB_JOB", "PHUB_TOKEN", "PHUB_JOB_SPEC"

_init_calls = 0


class Session:
    """What :func:`init` returns: this process's rank in the job and its
    :class:`phub.Worker`.

    ``rank``, ``world_size``, ``local_rank``: torchrun's; ``worker``: the
    joined worker (rank ``rank`` of job ``job``); ``admitted``: this process
    admitted the job (rank 0 with ``PHUB_JOB_SPEC``). :meth:`finish` (or the
    ``with`` block's end) evicts a job that :func:`init` admitted once every
    rank has finished."""

    def __init__(self, worker: Worker, rank: int, world_size: int, local_rank: int, control_url: str,
                 job: int, token: str, admitted: bool, store: Any = None, prefix: str = "") -> None:
        self.worker = worker
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.control_url = control_url
        self.job = job
        self.token = token
        self.admitted = admitted
        self._store = store
        self._prefix = prefix
        self._finished = False

    def finish(self, timeout: float = 300.0) -> None:
        """Marks this rank done. When :func:`init` admitted the job, rank 0
        then waits (up to ``timeout`` s) for every rank to be done and evicts
        it; other ranks return at once. Call it after the last exchange."""
        if self._finished:
            return
        self._finished = True
        if self._store is None:  # joined an admitted job ($PHUB_JOB): not ours to evict
            return
        done = self._store.add(f"{self._prefix}/done", 1)
        if not self.admitted:
            return
        import time
        deadline = time.monotonic() + timeout
        while done < self.world_size:
            if time.monotonic() > deadline:
                raise UsageError(
                    f"phub.torch: {done} of {self.world_size} ranks finished within {timeout} s; "
                    f"job {self.job} is left admitted (evict it with `phubctl job evict {self.job}`)"
                )
            time.sleep(0.05)
            done = self._store.add(f"{self._prefix}/done", 0)
        admin.evict(self.control_url, self.job)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.finish()

    def __repr__(self) -> str:
        return (f"phub.torch.Session(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"job={self.job}, admitted={self.admitted})")


def _env_int(name: str, value: Optional[int], why: str) -> int:
    if value is not None:
        return int(value)
    import os
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        raise UsageError(f"${name} is not set: {why}")
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"${name} = {raw!r}: expected an integer") from None


def _rendezvous_store(timeout: float) -> tuple[Any, str]:
    """The key-value store the ranks share, and this run's prefix in it:
    the default process group's store when torch.distributed is initialised,
    else the store torchrun's agent serves (``TORCHELASTIC_USE_AGENT_STORE``
    with ``MASTER_ADDR``/``MASTER_PORT``)."""
    import datetime
    import os
    global _init_calls
    _init_calls += 1
    n = _init_calls
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        get = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
        if get is not None:
            return get(), f"phub/init/{n}"
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and env.get("MASTER_ADDR") and \
            env.get("MASTER_PORT"):
        store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                           timeout=datetime.timedelta(seconds=timeout))
        run = env.get("TORCHELASTIC_RUN_ID", "run")
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return store, f"phub/init/{run}/{attempt}/{n}"
    raise UsageError(
        "phub.torch.init: to admit the job once ($PHUB_JOB_SPEC) and tell the other ranks its id and token, "
        "the ranks need a shared store: call torch.distributed.init_process_group() before phub.torch.init(), "
        "or run under torchrun (its agent's store), or admit the job beforehand and set $PHUB_JOB and $PHUB_TOKEN"
    )


def _read_spec(value: str) -> str:
    """$PHUB_JOB_SPEC: a path to a spec file (TOML or JSON), or the spec's text."""
    import os
    path = value.strip()
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise UsageError(f"${ENV_JOB_SPEC} = {value!r}: cannot read it: {e.strerror}") from None
    if path.startswith("{") or "=" in path:
        return value  # the spec itself
    raise UsageError(f"${ENV_JOB_SPEC} = {value!r}: no such file, and not a spec (TOML or JSON text)")


def _spec_workers(spec: Union[str, Mapping[str, Any]]) -> Optional[int]:
    if isinstance(spec, Mapping):
        w = spec.get("workers")
        return int(w) if w is not None else None
    import json
    if spec.lstrip().startswith("{"):
        try:
            return int(json.loads(spec)["workers"])
        except (ValueError, KeyError, TypeError):
            return None
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        return None
    try:
        return int(tomllib.loads(spec)["workers"])
    except (ValueError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return None


def init(spec: Union[None, str, Mapping[str, Any]] = None, *, control_url: Optional[str] = None,
         job: Optional[int] = None, token: Optional[str] = None, rank: Optional[int] = None,
         world_size: Optional[int] = None, local_rank: Optional[int] = None, timeout: float = 300.0,
         **join_kwargs: Any) -> Session:
    """Joins this process to a phub job the way torchrun starts it, with no
    further arguments::

        torchrun --nproc-per-node=2 train.py      # train.py: s = phub.torch.init()

    Reads, unless given as arguments:

    - ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``: torchrun's (``LOCAL_RANK``
      defaults to ``RANK``).
    - ``PHUB_CONTROL_URL``: phub-control's URL (else ``PHUB_CONTROL``, which
      phubctl reads). An ``https://`` URL is verified against
      ``PHUB_CA_FILE`` (else the system's roots), as :meth:`phub.Worker.join`
      and :mod:`phub.admin` do.
    - Either ``PHUB_JOB`` and ``PHUB_TOKEN``: join that admitted job;
    - or ``PHUB_JOB_SPEC``: a path to a job spec (TOML or JSON), or the
      spec's text: rank 0 admits it (with ``PHUB_OPERATOR_TOKEN`` when
      control asks for one) and every rank joins it. ``spec`` (a dict such as
      :func:`job_spec` returns, or TOML/JSON text) is used when neither is
      set.

    How the other ranks learn the job id and token rank 0 was given: through
    the default process group's store when ``torch.distributed`` is
    initialised (call ``init_process_group`` first), else through the store
    torchrun's agent serves to its workers. Rank 0 writes ``id:token`` (or
    its admission error, which every rank then raises) under a key of this
    run; the others wait for it up to ``timeout`` seconds. No name is
    guessed and control's API is not polled, so two runs never pick up each
    other's job.

    ``join_kwargs`` go to :meth:`phub.Worker.join` (``window``, ``timeout``,
    ``shm``...). Returns a :class:`Session` (``.worker``, ``.rank``,
    ``.world_size``, ``.local_rank``, ``.job``); use it as a context
    manager, or call :meth:`Session.finish`, to evict a job ``init``
    admitted when every rank is done.
    """
    import json
    import os

    why = "run under torchrun (it sets RANK, WORLD_SIZE and LOCAL_RANK), or pass rank= and world_size="
    rank = _env_int(ENV_RANK, rank, why)
    world_size = _env_int(ENV_WORLD_SIZE, world_size, why)
    if local_rank is None:
        local_rank = int(os.environ.get(ENV_LOCAL_RANK) or rank)
    if not 0 <= rank < world_size:
        raise UsageError(f"RANK = {rank} with WORLD_SIZE = {world_size}: the rank must be in 0..{world_size - 1}")
    control_url = control_url or os.environ.get(ENV_CONTROL_URL) or os.environ.get("PHUB_CONTROL")
    if not control_url:
        raise UsageError(f"${ENV_CONTROL_URL} is not set: export it as phub-control's URL "
                         "(e.g. https://appliance1.example.net:7700), or pass control_url=")
    env_job = os.environ.get(ENV_JOB, "").strip()
    if job is None and env_job:
        try:
            job = int(env_job)
        except ValueError:
            raise UsageError(f"${ENV_JOB} = {env_job!r}: expected the job id (an integer)") from None
    if job is not None:
        token = token if token is not None else os.environ.get(ENV_TOKEN, "").strip()
        if not token:
            raise UsageError(f"${ENV_TOKEN} is not set: joining job {job} (${ENV_JOB}) needs the token its "
                             "admission returned, or pass token=")
        worker = Worker.join(control_url, int(job), token, rank, **join_kwargs)
        _check_world(worker, world_size)
        return Session(worker, rank, world_size, local_rank, control_url, int(job), str(token), False)
    env_spec = os.environ.get(ENV_JOB_SPEC, "")
    if env_spec.strip():
        spec = _read_spec(env_spec)
    if spec is None:
        raise UsageError(f"no job: set ${ENV_JOB} and ${ENV_TOKEN} to join an admitted job, or ${ENV_JOB_SPEC} "
                         "(a spec file, or the spec) for rank 0 to admit one")
    w = _spec_workers(spec)
    if w is not None and w != world_size:
        raise UsageError(f"the job spec has workers = {w} but WORLD_SIZE = {world_size}: "
                         f"one phub worker per torchrun process; write workers = {world_size}")
    store, prefix = _rendezvous_store(timeout)
    key = f"{prefix}/job"
    if rank == 0:
        try:
            jid, tok = admin.admit(control_url, spec)
        except BaseException as e:
            store.set(key, json.dumps({"error": f"rank 0 could not admit the job: {e}"}))
            raise
        store.set(key, json.dumps({"id": jid, "token": tok}))
    else:
        import datetime
        try:
            store.wait([key], datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise UsageError(f"phub.torch.init: rank 0 did not admit the job within {timeout} s ({e})") from None
        answer = json.loads(store.get(key))
        if "error" in answer:
            raise UsageError(answer["error"])
        jid, tok = int(answer["id"]), str(answer["token"])
    worker = Worker.join(control_url, jid, tok, rank, **join_kwargs)
    _check_world(worker, world_size)
    return Session(worker, rank, world_size, local_rank, control_url, jid, tok, rank == 0, store, prefix)


def _check_world(worker: Worker, world_size: int) -> None:
    if worker.workers != world_size:
        raise UsageError(f"job {worker.job} has {worker.workers} workers but WORLD_SIZE = {world_size}: "
                         "admit it with workers = WORLD_SIZE")
