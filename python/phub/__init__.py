"""phub: the Python client of the phub parameter-server appliance.

A training process joins a job admitted on phub-control and exchanges the
job's keys (tensors) with the appliance::

    import numpy as np
    import phub

    w = phub.Worker.join("http://127.0.0.1:7700", job, token, rank)
    params = np.zeros(w.key_len(0), dtype=np.float32)
    w.init(0, params).wait()              # round 0: everyone gets rank 0's values
    h = w.push_pull(0, grad, params)      # non-blocking; several keys can be in flight
    h.wait()                              # params now holds the appliance's result

On the appliance's own machine, with phub-dataplane started with ``--shm``,
workers pass chunks and results through shared memory and send headers
only (``Worker.join(..., shm="auto")``, the default; ``"on"`` insists,
``"off"`` sticks to datagrams; ``worker.shm`` says which).

Modules:

- :mod:`phub.admin`: admit, list and evict jobs through phub-control's HTTP API.
- :mod:`phub.local`: start a local appliance (phub-dataplane + phub-control)
  for examples and tests.
- :mod:`phub.torch`: a DistributedDataParallel communication hook, a
  DistributedOptimizer for optimizers running on the appliance,
  broadcast_parameters (CPU or CUDA tensors), and init(), which joins a
  rank torchrun started from the environment (needs torch).

Errors are :class:`PhubError` (a ``RuntimeError``) or one of its subclasses,
with the library's message.
"""

from ._native import (
    ClosedError,
    Handle,
    JoinError,
    PendingExchange,
    PhubError,
    PhubTimeoutError,
    RefusedError,
    Results,
    RowsPull,
    RowsPush,
    Staged,
    StagingBuffer,
    UsageError,
    Worker,
    __version__,
)

from . import admin, local  # standard library only; phub.torch is imported on demand

__all__ = [
    "ClosedError",
    "Handle",
    "JoinError",
    "PendingExchange",
    "PhubError",
    "PhubTimeoutError",
    "RefusedError",
    "Results",
    "RowsPull",
    "RowsPush",
    "Staged",
    "StagingBuffer",
    "UsageError",
    "Worker",
    "__version__",
    "admin",
    "local",
]
