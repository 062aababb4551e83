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
at once: one background thread pushes the bucket's keys (with shared
memory, copying them into the appliance's staging region, with the GIL
released), another completes the future with the averaged bucket once all
its keys are back (with a ``"sum"`` job it divides by W). DDP launches buckets
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

Tensors must be on the CPU and contiguous. ``float32`` works with every
job; ``float16`` and ``bfloat16`` tensors with jobs of that wire dtype (they
are converted through a ``float32`` scratch buffer, see ``phub.Worker``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed

from . import admin
from ._native import Handle, UsageError, Worker

__all__ = [
    "CommHookState",
    "DistributedOptimizer",
    "broadcast_parameters",
    "comm_hook",
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
        raise UsageError(f"phub.torch works on CPU tensors; this one is on {t.device} (copy it with .cpu())")
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
            pending.append((worker.init(k, to_numpy(t)), p, t))
        for h, p, t in pending:
            h.wait()
            if t.data_ptr() != p.data.data_ptr():
                p.data.copy_(t)


class _Completer:
    """A thread that waits for handles (the GIL is released while it waits)
    and then completes futures, in submission order."""

    def __init__(self, name: str) -> None:
        self._q: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)
        self._t.join()


class CommHookState:
    """State of :func:`comm_hook`: the worker, and which key each parameter is.

    ``model``: the DDP model (or the module it wraps); its parameters in
    ``model.parameters()`` order are the job's keys. ``init_keys``: run
    round 0 of every key now (with copies of the parameters: the module is
    not modified); every rank constructs the state at the same point. The
    job's optimizer must be ``sum`` or ``mean``, and its consistency BSP
    (``sync``, the default): an async or bounded-delay job is refused.
    """

    def __init__(self, worker: Worker, model: ParamsLike, *, init_keys: bool = True) -> None:
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
        if init_keys:
            handles = [worker.init(k, to_numpy(p.detach().contiguous().clone())) for k, p in enumerate(self.params)]
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

    state._pusher.submit(push)
    return fut


def _complete(handles: list, buf: torch.Tensor, scale: float, fut: "torch.futures.Future[torch.Tensor]") -> None:
    try:
        for h in handles:
            h.wait()
        if scale != 1.0:
            buf.mul_(scale)
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
                 broadcast: bool = True) -> None:
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
        super().__init__(ps, {})
        self.worker = worker
        self._params = ps
        if broadcast:
            broadcast_parameters(worker, ps)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Pushes the gradients, waits for the new parameters (in place)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        handles = []
        for k, p in enumerate(self._params):
            g = p.grad
            if g is None:
                g = torch.zeros_like(p.data)
            elif not g.is_contiguous() or g.dtype != p.dtype:
                g = g.contiguous().to(p.dtype)
            handles.append(self.worker.push_pull(k, to_numpy(g), to_numpy(p.data)))
        for h in handles:
            h.wait()
        return loss
