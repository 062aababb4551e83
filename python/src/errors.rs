//! The exception hierarchy: `phub.PhubError` (a `RuntimeError`) and one
//! subclass per kind of failure, each carrying phub-worker's message.

use phub_worker::WorkerError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::{create_exception, PyErr};

create_exception!(
    phub,
    PhubError,
    PyRuntimeError,
    "Base class of every error phub raises; the message is phub-worker's own."
);
create_exception!(
    phub,
    JoinError,
    PhubError,
    "Joining failed: phub-control refused (unknown job, wrong token, rank taken \
     or out of range), could not be reached, or answered with an unusable job; \
     or shm=\"on\" and the appliance's shared memory cannot be used."
);
create_exception!(
    phub,
    UsageError,
    PhubError,
    "A call that does not fit: unknown key, wrong length or dtype, a key already \
     in flight, push_pull before init, or a handle waited twice."
);
create_exception!(
    phub,
    RefusedError,
    PhubError,
    "The appliance refused a chunk with an ERROR message; retrying will not help."
);
create_exception!(
    phub,
    PhubTimeoutError,
    PhubError,
    "No result came back for the worker's timeout: the appliance or another \
     worker of the job stopped answering."
);
create_exception!(
    phub,
    ClosedError,
    PhubError,
    "The worker's I/O thread has stopped."
);

/// The Python exception for a phub-worker error, with its message verbatim.
pub(crate) fn to_py(e: WorkerError) -> PyErr {
    let message = e.to_string();
    match e {
        WorkerError::Join { .. }
        | WorkerError::Http { .. }
        | WorkerError::BadJoin { .. }
        | WorkerError::SharedMemory { .. } => JoinError::new_err(message),
        WorkerError::Length { .. }
        | WorkerError::UnknownKey { .. }
        | WorkerError::Busy { .. }
        | WorkerError::Sequence { .. } => UsageError::new_err(message),
        WorkerError::Refused { .. } => RefusedError::new_err(message),
        WorkerError::Timeout { .. } => PhubTimeoutError::new_err(message),
        WorkerError::Closed => ClosedError::new_err(message),
        // Socket errors, and whatever phub-worker adds later.
        _ => PhubError::new_err(message),
    }
}

/// A [`UsageError`] with `message`.
pub(crate) fn usage(message: impl Into<String>) -> PyErr {
    UsageError::new_err(message.into())
}
