"""Type stubs of the extension module ``phub._native`` (re-exported by ``phub``)."""

from typing import Any, Literal, Optional, Union

import numpy as np
from typing_extensions import Buffer  # PEP 688; collections.abc.Buffer on 3.12+

# What array arguments take: a NumPy array or any object with the buffer
# protocol (C-contiguous float32; float16 / 16-bit bfloat16 bits for 16-bit jobs).
_Array = Union[np.ndarray[Any, Any], Buffer]

__version__: str

class PhubError(RuntimeError):
    """Base class of every error phub raises; the message is phub-worker's own."""

class JoinError(PhubError):
    """Joining failed: refused by phub-control, unreachable, an unusable answer, or
    ``shm="on"`` and the appliance's shared memory cannot be used."""

class UsageError(PhubError):
    """A call that does not fit: unknown key, wrong length or dtype, key busy, out of order."""

class RefusedError(PhubError):
    """The appliance refused a chunk with an ERROR message."""

class PhubTimeoutError(PhubError):
    """No result for the worker's timeout: the appliance or another worker stopped."""

class ClosedError(PhubError):
    """The worker's I/O thread has stopped."""

class Handle:
    """A request in flight; ``wait()`` writes the result into the output array."""

    @property
    def key(self) -> int: ...
    @property
    def round(self) -> int: ...
    @property
    def pending(self) -> bool: ...
    def wait(self) -> Any:
        """Blocks (GIL released) until the result is in; returns the output array."""

class StagingBuffer:
    """Writable bytes of a shared-memory staging region (buffer protocol)."""

    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def same_mapping(self, other: "StagingBuffer") -> bool: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class Staged:
    """A key claimed for a push written in place (``Worker.stage``)."""

    @property
    def key(self) -> int: ...
    @property
    def round(self) -> int: ...
    @property
    def spans(self) -> list[tuple[StagingBuffer, int, int]]: ...
    @property
    def regions(self) -> list[StagingBuffer]: ...
    def release(self) -> None: ...

class Worker:
    """One rank of a phub job."""

    @staticmethod
    def join(
        control_url: str,
        job: int,
        token: Union[str, int],
        rank: int,
        *,
        window: Optional[int] = None,
        timeout: Optional[float] = None,
        min_rto: Optional[float] = None,
        max_rto: Optional[float] = None,
        initial_rto: Optional[float] = None,
        shm: Literal["auto", "on", "off"] = "auto",
    ) -> "Worker": ...
    @property
    def rank(self) -> int: ...
    @property
    def job(self) -> int: ...
    @property
    def workers(self) -> int: ...
    @property
    def keys(self) -> int: ...
    @property
    def dtype_name(self) -> str: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def shm(self) -> bool: ...
    @property
    def local_addr(self) -> str: ...
    @property
    def consistency(self) -> Literal["sync", "async", "bounded_delay"]: ...
    @property
    def bounded_delay(self) -> Optional[int]: ...
    def spec(self) -> dict[str, Any]: ...
    def key_len(self, key: int) -> Optional[int]: ...
    def key_round(self, key: int) -> Optional[int]: ...
    def clock(self) -> Optional[int]: ...
    def stats(self) -> dict[str, int]: ...
    def init(self, key: int, array: _Array) -> Handle: ...
    def push_pull(self, key: int, grad: _Array, out: Optional[_Array] = None) -> Handle: ...
    def stage(self, key: int) -> Optional[Staged]: ...
    def push_pull_staged(self, staged: Staged, out: _Array) -> Handle: ...
    def wait(self, handle: Handle) -> Any: ...
    def pull(self, key: int, out: _Array) -> int: ...
