//! phub-python: the extension module `phub._native` behind the Python
//! package `phub` (see `python/phub/`), a PyO3 binding of phub-worker.
//!
//! Layer: a binding over the client library, no logic of its own beyond
//! moving array memory in and out. Invariants:
//! - Arrays arrive through the buffer protocol and are never copied into
//!   Python objects. A C-contiguous, aligned array of `float32` or of the
//!   job's 16-bit wire type is read and written in place (16-bit ones as
//!   the wire's bits, never converted to `f32`); unaligned arrays, and a
//!   16-bit output with a `float32` gradient (or the reverse), go through
//!   one `f32` scratch buffer, converted on the way in and out.
//! - A [`worker::Handle`] holds the output array (a strong reference and a
//!   buffer export, so it can neither be freed nor resized) until the result
//!   is written into it by `wait`, or until the handle is dropped.
//! - The GIL is released (`Python::detach`) while joining, while encoding a
//!   push and while waiting, so other Python threads run and several keys
//!   move at once.
//! - Every phub-worker error becomes an exception of the `phub.PhubError`
//!   hierarchy carrying the library's message verbatim.

mod buffer;
mod errors;
mod routes;
mod worker;

use pyo3::prelude::*;

/// The module `phub._native`. The items are re-exported by `phub`.
#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<worker::Worker>()?;
    m.add_class::<worker::Handle>()?;
    m.add_class::<worker::PendingExchange>()?;
    m.add_class::<worker::RowsPull>()?;
    m.add_class::<worker::RowsPush>()?;
    m.add_class::<worker::Staged>()?;
    m.add_class::<worker::StagingBuffer>()?;
    m.add_class::<worker::Results>()?;
    m.add("PhubError", py.get_type::<errors::PhubError>())?;
    m.add("JoinError", py.get_type::<errors::JoinError>())?;
    m.add("UsageError", py.get_type::<errors::UsageError>())?;
    m.add("RefusedError", py.get_type::<errors::RefusedError>())?;
    m.add("PhubTimeoutError", py.get_type::<errors::PhubTimeoutError>())?;
    m.add("ClosedError", py.get_type::<errors::ClosedError>())?;
    m.add_function(wrap_pyfunction!(routes::control_route, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
