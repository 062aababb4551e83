//! `phub.Worker` and `phub.Handle`: phub-worker's `Worker` and `Handle` for
//! Python.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use phub_proto::Dtype;
use phub_worker::WorkerConfig;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::buffer::{row_ids, Array, Native, Owned, Scratch, Slice, SliceMut};
use crate::errors::{to_py, usage};

/// One rank of a phub job: joins through phub-control, then exchanges the
/// job's keys (tensors) with the appliance over UDP.
///
/// Create it with :meth:`Worker.join`. Every method may be called from any
/// thread. Arrays are NumPy arrays or any object with the buffer protocol:
/// C-contiguous ``float32`` for every job; ``float16`` (or its bits as
/// ``int16``/``uint16``) for ``f16`` jobs; bfloat16 bits as
/// ``int16``/``uint16`` for ``bf16`` jobs. Arrays are read and written in
/// place, 16-bit ones as the wire's bits (no ``float32`` conversion);
/// only a 16-bit output with a ``float32`` gradient (or the reverse) goes
/// through one ``float32`` scratch buffer.
#[pyclass(module = "phub", name = "Worker", frozen)]
pub(crate) struct Worker {
    inner: Arc<phub_worker::Worker>,
    inflight: Inflight,
}

/// The byte ranges of the output arrays of this worker's requests in flight,
/// with their keys. A new request's output (and gradient) may not overlap
/// them: two pending results writing the same memory, or a gradient read
/// from memory a result is pending for, is a caller's mistake, refused
/// (it would also alias a `&mut` in Rust).
type Inflight = Arc<Mutex<Vec<InflightOutput>>>;

/// The output array of a request in flight: its bytes `start..end` in
/// memory, and the request's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct InflightOutput {
    start: usize,
    end: usize,
    key: u32,
}

impl InflightOutput {
    /// Whether the bytes `start..end` overlap this output's.
    fn overlaps(&self, (start, end): (usize, usize)) -> bool {
        self.start < end && start < self.end
    }
}

/// One entry of [`Inflight`], removed when dropped.
struct Claim {
    inflight: Inflight,
    output: InflightOutput,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut v = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = v.iter().position(|o| *o == self.output) {
            v.swap_remove(i);
        }
    }
}

/// A table call's `float32` input: read in place where `a` is aligned
/// `float32` (its export keeps it there for the call), else copied.
fn f32_in(a: &Array) -> std::borrow::Cow<'_, [f32]> {
    // SAFETY: the export `a` keeps the array in place while the borrow
    // lives (tied to `a`); callers pass no output overlapping it.
    match unsafe { a.slice() } {
        Some(Slice::F32(v)) => std::borrow::Cow::Borrowed(v),
        _ => std::borrow::Cow::Owned(a.to_f32_vec()),
    }
}

/// Runs `f`, with the GIL released, writing a table call's `float32`
/// output: straight into `o` where it is aligned `float32`, else into a
/// buffer copied into `o` when `f` succeeds.
fn f32_out<R: Send, E: Send>(
    py: Python<'_>,
    o: &Array,
    f: impl FnOnce(&mut [f32]) -> Result<R, E> + Send,
) -> Result<R, E> {
    // SAFETY: `o` was exported writable and keeps the array in place for
    // this call; callers read no input overlapping it in place (`f32_in`
    // of an array that does not overlap `o`, or a copy).
    if let Some(SliceMut::F32(dst)) = unsafe { o.slice_mut() } {
        return py.detach(|| f(dst));
    }
    let mut buf = vec![0f32; o.len()];
    let r = py.detach(|| f(&mut buf))?;
    o.write_from(&buf);
    Ok(r)
}

/// Calls `$f` with the slice inside a [`SliceMut`] (the library's methods
/// are generic over the element type).
macro_rules! on_mut {
    ($s:expr, $v:ident => $f:expr) => {
        match $s {
            SliceMut::F32($v) => $f,
            SliceMut::Bf16($v) => $f,
            SliceMut::F16($v) => $f,
        }
    };
}

/// An array lent to [`Worker::exchange`]: one buffer for the gradient and
/// the result, or a gradient and an output.
enum Lent<'a> {
    InPlace(SliceMut<'a>),
    Pair(Slice<'a>, SliceMut<'a>),
}

impl<'a> Lent<'a> {
    /// Starts `key`'s round on exchange `x` with these buffers lent;
    /// returns the round (clock) it completes.
    fn start(self, x: &phub_worker::Exchange<'_, 'a>, key: u32) -> Result<u32, phub_worker::WorkerError> {
        match self {
            Lent::InPlace(b) => on_mut!(b, b => x.push_pull_in_place(key, b)),
            Lent::Pair(Slice::F32(g), SliceMut::F32(o)) => x.push_pull(key, g, o),
            Lent::Pair(Slice::Bf16(g), SliceMut::Bf16(o)) => x.push_pull(key, g, o),
            Lent::Pair(Slice::F16(g), SliceMut::F16(o)) => x.push_pull(key, g, o),
            Lent::Pair(..) => unreachable!("`grad` and `out` hold one element type (checked)"),
        }
    }
}

/// What a pending request writes its result into.
enum Sink {
    /// The caller's array, in place (aligned `float32`, or aligned 16-bit
    /// elements of the job's wire type).
    Direct,
    /// `scratch`, converted into the caller's array by `wait`.
    Convert(Scratch),
}

/// A request in flight and everything its `phub_worker::Handle` borrows.
struct Pending {
    // Field order is drop order: `handle` borrows from `output` and from
    // `worker`, so it is dropped first.
    handle: phub_worker::Handle<'static>,
    /// `None` for a push without an output (waited only in place).
    output: Option<Output>,
    worker: Arc<phub_worker::Worker>,
}

/// A pending request's output array and what keeps it.
struct Output {
    // `handle` borrows from `sink` (its scratch) and from `out` (the
    // caller's memory, kept in place by the export).
    sink: Sink,
    out: Array,
    out_obj: Py<PyAny>,
    claim: Claim,
}

/// A `push_pull` whose output is lent to the I/O thread
/// ([`Worker::push_pull_lent`]), and what it borrows.
struct LentRequest {
    // Field order is drop order: `detached` waits for the I/O thread to
    // be done with the buffers before they are released.
    detached: phub_worker::Detached,
    /// The gradient's copy, read by the I/O thread (`None` in place).
    _copy: Option<Owned>,
    /// The output's export (the gradient's, in place).
    _out: Array,
    out_obj: Py<PyAny>,
    claim: Claim,
    _worker: Arc<phub_worker::Worker>,
}

/// A request in flight, one way or the other.
enum Flight {
    /// The result kept by the worker, copied out by `wait`.
    Owned(Pending),
    /// The result written into the output by the I/O thread.
    Lent(LentRequest),
}

/// A request in flight (``init`` or ``push_pull``).
///
/// :meth:`wait` blocks, with the GIL released, until the result is in,
/// makes sure it is in the output array and returns that array. The handle
/// keeps the output array alive (and unresizable) until then: do not read
/// or write it before ``wait`` returns. Dropping a handle without waiting
/// abandons the result: the output array is left as it was and the round
/// completes in the background, the key then free; for a request whose
/// output was lent (:attr:`lent`), dropping it blocks until the round has
/// ended, and the output holds what arrived.
#[pyclass(module = "phub", name = "Handle", frozen)]
pub(crate) struct Handle {
    key: u32,
    round: u32,
    lent: bool,
    pending: Mutex<Option<Flight>>,
}

fn seconds(name: &str, v: Option<f64>) -> PyResult<Option<Duration>> {
    v.map(|s| {
        Duration::try_from_secs_f64(s)
            .map_err(|_| usage(format!("`{name}` = {s}: a finite number of seconds >= 0")))
    })
    .transpose()
}

fn parse_token(token: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(s) = token.cast::<PyString>() {
        let s = s.to_string();
        let t = s.trim().trim_start_matches("0x");
        if t.is_empty() || t.len() > 16 {
            return Err(usage(format!("token {s:?}: expected 1 to 16 hex digits")));
        }
        return u64::from_str_radix(t, 16)
            .map_err(|_| usage(format!("token {s:?}: expected 1 to 16 hex digits")));
    }
    token
        .extract::<u64>()
        .map_err(|_| usage("token: expected a hex string (as admission returns it) or an int in 0..2**64"))
}

impl Worker {
    fn dtype(&self) -> Dtype {
        self.inner.spec().dtype
    }

    /// Checks that `key` exists and `a` has its element count.
    fn check(&self, key: u32, a: &Array, what: &str) -> PyResult<()> {
        let keys = self.inner.spec().keys.len();
        let expected = self.inner.key_len(key).ok_or_else(|| {
            usage(format!(
                "key {key} does not exist: the job has {keys} keys (0..{keys})"
            ))
        })?;
        if expected != a.len() as u64 {
            return Err(usage(format!(
                "key {key} has {expected} elements but `{what}` has {}",
                a.len()
            )));
        }
        Ok(())
    }

    /// Registers `out` as the output of a request of `key` in flight, if
    /// neither it nor `grad` overlaps the output of one already in flight.
    fn claim(&self, key: u32, out: &Array, grad: Option<&Array>) -> PyResult<Claim> {
        let range = out.byte_range();
        let mut v = self.inflight.lock().unwrap_or_else(PoisonError::into_inner);
        let hit = |r: (usize, usize)| v.iter().find(|o| o.overlaps(r)).map(|o| o.key);
        for (what, r) in [("out", Some(range)), ("grad", grad.map(Array::byte_range))] {
            if let Some(k) = r.and_then(hit) {
                return Err(usage(format!(
                    "key {key}: `{what}` overlaps the output array of key {k}'s request, still in \
                     flight; wait for that handle first, or use separate arrays"
                )));
            }
        }
        let output = InflightOutput {
            start: range.0,
            end: range.1,
            key,
        };
        v.push(output);
        Ok(Claim {
            inflight: Arc::clone(&self.inflight),
            output,
        })
    }

    /// Where the result for `out` goes: in place, when it is native and
    /// `grad` (if any) holds the same element type (one request exchanges
    /// one type), or a `float32` scratch buffer (holding `initial`, or
    /// zeros).
    fn sink(out: &Array, grad: Option<&Array>, initial: impl FnOnce() -> Vec<f32>) -> Sink {
        match out.native() {
            Some(_) if grad.is_none_or(|g| g.elem() == out.elem()) => Sink::Direct,
            _ => Sink::Convert(Scratch::new(initial())),
        }
    }

    /// The slice the result is written into.
    ///
    /// # Safety
    /// The slice must be dropped before `sink` and `out`, and nothing else may
    /// hold a reference into that memory while it is in use.
    unsafe fn out_slice(sink: &Sink, out: &Array) -> SliceMut<'static> {
        match sink {
            Sink::Direct => {
                // SAFETY: the export keeps the array in place while `out`
                // lives (and it was exported writable); exclusivity is the
                // caller's contract.
                let s = unsafe { out.slice_mut() };
                s.expect("Sink::Direct is chosen only for a native array")
            }
            // SAFETY: lifetime and exclusivity are the caller's contract.
            Sink::Convert(s) => SliceMut::F32(unsafe { s.slice_mut() }),
        }
    }

    /// A `'static` view of the worker for a handle that also holds an `Arc`
    /// of it.
    ///
    /// # Safety
    /// The returned reference must be dropped before the `Arc` clone that
    /// the caller keeps beside it.
    unsafe fn static_worker(&self) -> &'static phub_worker::Worker {
        // SAFETY: the pointee lives as long as any Arc; the caller keeps one
        // for longer than the reference.
        unsafe { &*Arc::as_ptr(&self.inner) }
    }

    /// [`Worker::push_pull`]'s lent way: `o` (which is `g` in place)
    /// lent to the I/O thread, with a copy of `g` when it is another
    /// array. The caller checked that both are native, of one element
    /// type, and the same memory or apart, and claimed `o`.
    fn push_pull_lent(
        &self,
        py: Python<'_>,
        key: u32,
        g: Array,
        o: Array,
        out_obj: &Bound<'_, PyAny>,
        claim: Claim,
    ) -> PyResult<Handle> {
        let in_place = g.byte_range() == o.byte_range();
        // The caller may reuse a separate gradient at once: lend a copy.
        let copy = (!in_place).then(|| g.to_native_vec());
        drop(g);
        // SAFETY: `o` is exported writable and claimed (no other request
        // of this worker reads or writes it), the copy is this request's
        // own; both are kept in the `LentRequest` beside the `Detached`,
        // which is dropped (waiting for the I/O thread) before them.
        let out_slice = unsafe { o.slice_mut() }.expect("checked native");
        let w = &*self.inner;
        let started = py.detach(|| {
            w.exchange(
                |x| -> Result<(u32, phub_worker::Detached), phub_worker::WorkerError> {
                    let lent = match &copy {
                        None => Lent::InPlace(out_slice),
                        Some(c) => Lent::Pair(c.as_slice(), out_slice),
                    };
                    let round = lent.start(x, key)?;
                    // SAFETY: see above: the buffers outlive the detached
                    // request.
                    Ok((round, unsafe { x.detach() }))
                },
            )
        });
        let (round, detached) = started.map_err(to_py)?.map_err(to_py)?;
        Ok(Handle {
            key,
            round,
            lent: true,
            pending: Mutex::new(Some(Flight::Lent(LentRequest {
                detached,
                _copy: copy,
                _out: o,
                out_obj: out_obj.clone().unbind(),
                claim,
                _worker: Arc::clone(&self.inner),
            }))),
        })
    }

    /// Checks that `staged` was staged by this worker and is not pushed or
    /// released yet.
    fn own_staged(&self, staged: &Staged) -> PyResult<()> {
        if !Arc::ptr_eq(&staged.worker, &self.inner) {
            return Err(usage(format!(
                "key {}: staged by another worker; push it with that worker",
                staged.key
            )));
        }
        staged.with(|_| ())
    }
}

#[pymethods]
impl Worker {
    /// Joins job ``job`` as ``rank`` through phub-control at ``control_url``
    /// (e.g. ``"http://127.0.0.1:7700"``, or several controls on one etcd
    /// prefix separated by commas, tried in turn while one does not take
    /// the join or answers 503, for 10 s at most), with the ``token``
    /// admission returned (16 hex digits, or an int).
    ///
    /// Keyword arguments tune the worker: ``window`` (chunks outstanding
    /// across all keys; by default picked from the job: its workers, lcores
    /// and chunks, the socket's receive buffer and the appliances' stated
    /// ones, as phub-worker's ``auto_window`` does),
    /// ``timeout`` (seconds without any result before a request fails,
    /// default 30), ``min_rto``, ``max_rto``, ``initial_rto``
    /// (retransmission timeout bounds and start, seconds), ``shm``
    /// (``"auto"``, the default: pass chunks through shared memory when the
    /// appliance's phub-dataplane runs on this host with ``--shm``,
    /// datagrams otherwise; ``"on"``: shared memory or the join fails,
    /// naming the region and why; ``"off"``: datagrams only; with
    /// ``"auto"``, ``PHUB_WORKER_SHM=off|auto|on`` in the environment
    /// decides instead).
    ///
    /// For tests, ``PHUB_WORKER_INJECT=loss=0.05,dup=0.01,reorder=0.01,seed=3``
    /// in the environment makes the worker lose, duplicate and reorder its
    /// datagrams (see :meth:`stats`, ``injected_*``).
    ///
    /// Raises :class:`JoinError` with phub-control's message when refused.
    #[staticmethod]
    #[pyo3(signature = (control_url, job, token, rank, *, window=None, timeout=None, min_rto=None, max_rto=None, initial_rto=None, shm="auto"))]
    #[allow(clippy::too_many_arguments)] // the Python signature: keyword arguments
    fn join(
        py: Python<'_>,
        control_url: &str,
        job: u16,
        token: &Bound<'_, PyAny>,
        rank: u16,
        window: Option<usize>,
        timeout: Option<f64>,
        min_rto: Option<f64>,
        max_rto: Option<f64>,
        initial_rto: Option<f64>,
        shm: &str,
    ) -> PyResult<Worker> {
        let token = parse_token(token)?;
        let mut config = WorkerConfig::default();
        if let Some(w) = window {
            if w == 0 {
                return Err(usage("`window` = 0: at least 1 chunk"));
            }
            config.window = w;
        }
        config.timeout = seconds("timeout", timeout)?.unwrap_or(config.timeout);
        config.min_rto = seconds("min_rto", min_rto)?.unwrap_or(config.min_rto);
        config.max_rto = seconds("max_rto", max_rto)?.unwrap_or(config.max_rto);
        config.initial_rto = seconds("initial_rto", initial_rto)?.unwrap_or(config.initial_rto);
        config.shm = shm.parse().map_err(|e: String| usage(format!("`shm` = {e}")))?;
        let w = py
            .detach(|| phub_worker::Worker::join_with(control_url, job, token, rank, config))
            .map_err(to_py)?;
        Ok(Worker {
            inner: Arc::new(w),
            inflight: Inflight::default(),
        })
    }

    /// This worker's rank.
    #[getter]
    fn rank(&self) -> u16 {
        self.inner.rank()
    }

    /// The job's id.
    #[getter]
    fn job(&self) -> u16 {
        self.inner.job()
    }

    /// The job's worker count W.
    #[getter]
    fn workers(&self) -> u32 {
        self.inner.workers()
    }

    /// The number of keys of the job (keys are ``0 .. keys``).
    #[getter]
    fn keys(&self) -> usize {
        self.inner.spec().keys.len()
    }

    /// The job's element type on the wire: ``"f32"``, ``"bf16"`` or ``"f16"``.
    #[getter]
    fn dtype_name(&self) -> String {
        self.dtype().to_string()
    }

    /// The optimizer the appliance runs: ``"sum"``, ``"mean"``, ``"sgd"``,
    /// ``"momentum"``, ``"nesterov"``, ``"adam"`` or ``"adamw"``.
    #[getter]
    fn optimizer(&self) -> &'static str {
        self.inner.spec().optimizer.name()
    }

    /// Whether chunks and results go through shared memory with the
    /// dataplane (see ``shm`` of :meth:`join`).
    #[getter]
    fn shm(&self) -> bool {
        self.inner.shm()
    }

    /// The local address of the worker's UDP socket, ``"host:port"``.
    #[getter]
    fn local_addr(&self) -> String {
        self.inner.local_addr().to_string()
    }

    /// The job's spec as admitted, as a dict (the JSON form of the spec).
    fn spec<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let text = serde_json::to_string(self.inner.spec())
            .map_err(|e| crate::errors::PhubError::new_err(format!("serialising the spec: {e}")))?;
        py.import("json")?.call_method1("loads", (text,))
    }

    /// Elements of ``key``, or ``None`` if the job has no such key.
    fn key_len(&self, key: u32) -> Option<u64> {
        self.inner.key_len(key)
    }

    /// The last round whose result this worker holds for ``key`` (``None``
    /// before ``init`` or ``pull`` completed, or for an unknown key). In an
    /// async or bounded-delay job, this rank's clock on the key.
    fn key_round(&self, key: u32) -> Option<u32> {
        self.inner.key_round(key)
    }

    /// This rank's clock: the lowest :meth:`key_round` over the job's keys,
    /// i.e. the steps (a ``push_pull`` of every key) whose answers it holds;
    /// 0 after ``init``, ``None`` while a key is not initialised. In a BSP
    /// job, the last round completed on every key; in an async or
    /// bounded-delay job each rank has its own (PROTOCOL.md §5.8).
    fn clock(&self) -> Option<u32> {
        self.inner.clock()
    }

    /// The job's consistency mode: ``"sync"`` (BSP, the default),
    /// ``"async"`` or ``"bounded_delay"`` (see :attr:`bounded_delay`). The
    /// same calls work in every mode.
    #[getter]
    fn consistency(&self) -> &'static str {
        self.inner.consistency().mode()
    }

    /// τ of a bounded-delay job (no rank gets an answer while it is more
    /// than τ clocks ahead of the slowest); ``None`` in the other modes.
    #[getter]
    fn bounded_delay(&self) -> Option<u32> {
        self.inner.consistency().delay()
    }

    /// A snapshot of the worker's counters, as a dict: ``chunks_sent``,
    /// ``retransmits``, ``results_accepted``, ``results_ignored``,
    /// ``foreign_dropped``, ``errors``, ``timeouts``, ``srtt_us``,
    /// ``rto_us``, ``window`` (chunks outstanding at most, now),
    /// ``bytes_sent``, ``bytes_received``, and the datagrams
    /// fault injection lost, duplicated, reordered and delayed
    /// (``injected_drops``, ``injected_dups``, ``injected_reorders``,
    /// ``injected_delays``; 0 unless
    /// ``PHUB_WORKER_INJECT`` is set), ``shm_results`` (results read from
    /// shared memory), the tables' ``row_messages_sent``,
    /// ``row_retransmits`` and key caching's ``key_cache_id_bytes_saved``,
    /// ``key_cache_prefix_bytes``, ``key_cache_misses`` (PROTOCOL.md §10.7),
    /// ``spare_bytes`` (buffers kept for the keys' next requests: after
    /// ``init`` or ``push_pull`` a key's datagrams and result, up to twice
    /// the model; a key exchanged with :meth:`exchange` keeps its headers
    /// only), and ``shm`` (a bool: shared memory in use).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("chunks_sent", s.chunks_sent),
            ("retransmits", s.retransmits),
            ("results_accepted", s.results_accepted),
            ("results_ignored", s.results_ignored),
            ("foreign_dropped", s.foreign_dropped),
            ("errors", s.errors),
            ("timeouts", s.timeouts),
            ("srtt_us", s.srtt_us),
            ("rto_us", s.rto_us),
            ("window", s.window),
            ("bytes_sent", s.bytes_sent),
            ("bytes_received", s.bytes_received),
            ("injected_drops", s.injected_drops),
            ("injected_dups", s.injected_dups),
            ("injected_reorders", s.injected_reorders),
            ("injected_delays", s.injected_delays),
            ("shm_results", s.shm_results),
            ("row_messages_sent", s.row_messages_sent),
            ("row_retransmits", s.row_retransmits),
            ("key_cache_id_bytes_saved", s.key_cache_id_bytes_saved),
            ("key_cache_prefix_bytes", s.key_cache_prefix_bytes),
            ("key_cache_misses", s.key_cache_misses),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("spare_bytes", self.inner.spare_bytes())?;
        d.set_item("shm", s.shm)?;
        Ok(d)
    }

    /// Round 0 of ``key``: rank 0's ``array`` becomes everyone's initial
    /// value. Every rank calls it; after :meth:`Handle.wait`, ``array`` holds
    /// rank 0's values on every rank. Non-blocking: returns a :class:`Handle`.
    fn init(&self, py: Python<'_>, key: u32, array: &Bound<'_, PyAny>) -> PyResult<Handle> {
        let out = Array::get(array, self.dtype(), "array", true)?;
        self.check(key, &out, "array")?;
        let claim = self.claim(key, &out, None)?;
        // Rank 0's values are sent from the slice itself, so a scratch starts
        // with them.
        let sink = Worker::sink(&out, None, || out.to_f32_vec());
        // SAFETY: the slice goes into `Pending::handle`, dropped before
        // `sink` and `out` (field order); nothing else references the memory
        // from Rust, and the Python side is told not to touch it until wait.
        let params = unsafe { Worker::out_slice(&sink, &out) };
        // SAFETY: `Pending` keeps `self.inner` cloned and drops it after
        // `handle` (field order).
        let w = unsafe { self.static_worker() };
        let handle = py
            .detach(|| on_mut!(params, p => w.init(key, p)))
            .map_err(to_py)?;
        Ok(Handle::new(handle, sink, out, array, claim, &self.inner))
    }

    /// The next round of ``key``: pushes ``grad`` (read at once, so it may be
    /// reused as soon as this returns) and returns a :class:`Handle`; after
    /// its ``wait``, ``out`` holds the round's result: the new parameters,
    /// or the sum or mean of the workers' pushes for a ``sum``/``mean`` job.
    /// ``out`` defaults to ``grad`` (in place). All ranks must start their
    /// keys in the same order.
    ///
    /// Over datagrams, an output array the worker can write in place
    /// (``float32`` or the job's 16-bit type, aligned, as ``grad``) is lent
    /// to its I/O thread, as :meth:`exchange` lends it: the result is
    /// written into it chunk by chunk as it arrives, with no copy on the
    /// caller's thread at ``wait``; in place (``out`` is ``grad``) the
    /// datagrams go out from the array itself (a separate ``grad`` is
    /// copied once, as without lending). :attr:`Handle.lent` says which
    /// way a request went. Then a failed round leaves the array holding
    /// the results of the chunks answered (and, in place, the gradient in
    /// the others), and dropping the handle unwaited blocks until the
    /// round has ended. ``lend=False`` keeps the result in the worker
    /// until ``wait`` copies it (``Handle.wait_in_place`` reads it there).
    #[pyo3(signature = (key, grad, out=None, *, lend=true))]
    fn push_pull(
        &self,
        py: Python<'_>,
        key: u32,
        grad: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        lend: bool,
    ) -> PyResult<Handle> {
        let dtype = self.dtype();
        let out_obj = out.unwrap_or(grad);
        let g = Array::get(grad, dtype, "grad", false)?;
        self.check(key, &g, "grad")?;
        let o = Array::get(out_obj, dtype, "out", true)?;
        self.check(key, &o, "out")?;
        let claim = self.claim(key, &o, Some(&g))?;
        let same = g.byte_range() == o.byte_range();
        let lendable = g.native().is_some() && o.native().is_some() && g.elem() == o.elem();
        if lend && !self.inner.shm() && lendable && (same || !g.overlaps(&o)) {
            return self.push_pull_lent(py, key, g, o, out_obj, claim);
        }
        let sink = Worker::sink(&o, Some(&g), || vec![0.0; o.len()]);
        // The gradient is read in place unless it must be converted, or it
        // shares memory with an in-place output (a `&[T]` and a `&mut [T]`
        // over the same memory may not coexist): then it is copied.
        let in_place = matches!(sink, Sink::Direct) && g.overlaps(&o);
        // SAFETY: as in `init`.
        let w = unsafe { self.static_worker() };
        if in_place && g.native().is_some() && g.byte_range() == o.byte_range() {
            // The same memory in and out (the default, `out` = `grad`): the
            // library reads the gradient once, no copy here.
            drop(g);
            // SAFETY: as in `init`.
            let out_slice = unsafe { Worker::out_slice(&sink, &o) };
            let handle = py
                .detach(|| on_mut!(out_slice, b => w.push_pull_in_place(key, b)))
                .map_err(to_py)?;
            return Ok(Handle::new(handle, sink, o, out_obj, claim, &self.inner));
        }
        // A copy of the gradient, where it cannot be read in place: in the
        // output's element type (its own, then: `sink` chose in place only
        // for one type), or as `float32` for a scratch output.
        let copied = match (&sink, g.native()) {
            (Sink::Direct, Some(_)) if !in_place => None,
            (Sink::Direct, _) => Some(g.to_native_vec()),
            (Sink::Convert(_), Some(Native::F32)) => None,
            (Sink::Convert(_), _) => Some(Owned::F32(g.to_f32_vec())),
        };
        let grad_slice: Slice<'_> = match &copied {
            Some(v) => v.as_slice(),
            // SAFETY: the export `g` keeps the array in place for this call,
            // and it does not overlap the output slice (`in_place` is false
            // for a direct output; a scratch output is separate memory).
            None => unsafe { g.slice() }.expect("read in place only when native"),
        };
        // SAFETY: as in `init`.
        let out_slice = unsafe { Worker::out_slice(&sink, &o) };
        let handle = py
            .detach(|| match (grad_slice, out_slice) {
                (Slice::F32(g), SliceMut::F32(o)) => w.push_pull(key, g, o),
                (Slice::Bf16(g), SliceMut::Bf16(o)) => w.push_pull(key, g, o),
                (Slice::F16(g), SliceMut::F16(o)) => w.push_pull(key, g, o),
                _ => unreachable!("the gradient is copied into the output's element type"),
            })
            .map_err(to_py)?;
        drop(copied);
        drop(g);
        Ok(Handle::new(handle, sink, o, out_obj, claim, &self.inner))
    }

    /// Claims ``key`` for its next push, for values written in place into
    /// this rank's shared-memory staging regions: returns a
    /// :class:`Staged` (write the key's values into its ``spans``, then
    /// :meth:`push_pull_staged`), or ``None`` when this worker sends
    /// datagrams (no shared memory: use :meth:`push_pull`). Saves the copy
    /// ``push_pull`` makes into the regions, e.g. when a GPU copies a
    /// gradient straight into them.
    fn stage(&self, py: Python<'_>, key: u32) -> PyResult<Option<Staged>> {
        // SAFETY: `Staged` keeps `self.inner` cloned and drops it after the
        // staged key (field order).
        let w = unsafe { self.static_worker() };
        let staged = py.detach(|| w.stage(key)).map_err(to_py)?;
        Ok(staged.map(|s| Staged {
            key: s.key(),
            round: s.round(),
            staged: Mutex::new(Some(s)),
            worker: Arc::clone(&self.inner),
        }))
    }

    /// Pushes a key whose values ``staged`` holds (see :meth:`stage`) and
    /// returns a :class:`Handle`; after its ``wait``, ``out`` holds the
    /// round's result, as with :meth:`push_pull`.
    fn push_pull_staged(&self, py: Python<'_>, staged: &Staged, out: &Bound<'_, PyAny>) -> PyResult<Handle> {
        let key = staged.key;
        // Not pushed or released yet (checked before anything else is).
        self.own_staged(staged)?;
        let o = Array::get(out, self.dtype(), "out", true)?;
        self.check(key, &o, "out")?;
        let claim = self.claim(key, &o, None)?;
        let sink = Worker::sink(&o, None, || vec![0.0; o.len()]);
        let s = staged.take()?;
        // SAFETY: as in `init`.
        let w = unsafe { self.static_worker() };
        // SAFETY: as in `init`.
        let out_slice = unsafe { Worker::out_slice(&sink, &o) };
        let handle = py
            .detach(|| on_mut!(out_slice, p => w.push_pull_staged(s, p)))
            .map_err(to_py)?;
        Ok(Handle::new(handle, sink, o, out, claim, &self.inner))
    }

    /// Pushes a key whose values ``staged`` holds (see :meth:`stage`)
    /// without an output: the returned :class:`Handle` can only be waited
    /// with :meth:`Handle.wait_in_place` (``wait`` raises
    /// :class:`UsageError` and lets the results go). For a caller that
    /// copies the results out of the regions itself, so no host array of
    /// the key's length is needed.
    fn push_staged(&self, py: Python<'_>, staged: &Staged) -> PyResult<Handle> {
        self.own_staged(staged)?;
        let s = staged.take()?;
        // SAFETY: as in `init` (nothing else is borrowed).
        let w = unsafe { self.static_worker() };
        let handle = py.detach(|| w.push_staged(s)).map_err(to_py)?;
        Ok(Handle::in_flight(handle, None, &self.inner))
    }

    /// Waits for ``handle`` (same as ``handle.wait()``) and returns its
    /// output array.
    fn wait(&self, py: Python<'_>, handle: &Handle) -> PyResult<Py<PyAny>> {
        handle.wait(py)
    }

    /// The next round of several keys at once, with the arrays lent to the
    /// worker's I/O thread instead of copied: ``requests`` is a list of
    /// ``(key, grad)`` (the result replaces the gradient in ``grad``) or
    /// ``(key, grad, out)`` (the result goes to ``out``, which must not
    /// overlap ``grad``). Every array is ``float32`` or the job's 16-bit
    /// wire type (``grad`` and ``out`` of one type), C-contiguous and
    /// aligned; a result array writable. Each result is written into its
    /// array chunk by chunk as it arrives, by the I/O thread: no copy on
    /// the caller's thread, and one release of the GIL for the whole call.
    /// Blocks until every key's round is in; raises the first failure
    /// (then an array lent in place holds results for some chunks and the
    /// gradient for the others).
    fn exchange(&self, py: Python<'_>, requests: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let lent = self.lend(&requests)?;
        py.detach(|| lent.start(&self.inner, false)).map(drop)
    }

    /// :meth:`exchange` without waiting: starts every request and returns
    /// a :class:`PendingExchange` at once, whose ``wait`` blocks until
    /// every key's round is in. The arrays stay lent to the I/O thread
    /// until then (the pending exchange keeps them alive; do not read or
    /// write them meanwhile), and their outputs are claimed as
    /// :meth:`push_pull`'s are, so a later request whose arrays overlap
    /// them is refused. Several may be in flight at once: the DDP comm
    /// hook starts each bucket's exchange as DDP hands it over, while the
    /// buckets before it are still on the wire. Dropping a pending
    /// exchange without waiting blocks until its requests have ended.
    /// Errors in the requests themselves (an unknown key, a wrong length,
    /// an array that cannot be lent) are raised here, after the requests
    /// before the bad one have ended.
    fn exchange_start(&self, py: Python<'_>, requests: Vec<Bound<'_, PyAny>>) -> PyResult<PendingExchange> {
        let lent = self.lend(&requests)?;
        let keys = lent.arrays.iter().map(|&(k, ..)| k).collect();
        let detached = py.detach(|| lent.start(&self.inner, true))?;
        Ok(PendingExchange {
            keys,
            in_flight: Mutex::new(Some(InFlight {
                detached,
                lent,
                _worker: Arc::clone(&self.inner),
            })),
        })
    }

    /// Fetches the last completed result of every chunk of ``key`` into
    /// ``out`` and returns its round (for a worker that rejoins a running
    /// job). Blocks, with the GIL released.
    fn pull(&self, py: Python<'_>, key: u32, out: &Bound<'_, PyAny>) -> PyResult<u32> {
        let o = Array::get(out, self.dtype(), "out", true)?;
        self.check(key, &o, "out")?;
        let _claim = self.claim(key, &o, None)?;
        let sink = Worker::sink(&o, None, || vec![0.0; o.len()]);
        // SAFETY: the slice lives only for the blocking call below, while
        // `sink` and `o` are alive; nothing else references the memory.
        let out_slice = unsafe { Worker::out_slice(&sink, &o) };
        let w = &*self.inner;
        let round = py
            .detach(|| on_mut!(out_slice, p => w.pull(key, p)))
            .map_err(to_py)?;
        if let Sink::Convert(s) = &sink {
            // SAFETY: `out_slice` is no longer used.
            o.write_from(unsafe { s.values() });
        }
        Ok(round)
    }

    /// Values per row (``dim``) of the sparse table named ``table``.
    fn table_dim(&self, table: &str) -> PyResult<u32> {
        self.inner.table_dim(table).map_err(to_py)
    }

    /// The last round (BSP) or this rank's clock (async, bounded delay) of
    /// the table named ``table`` whose push this worker completed; 0
    /// before its first.
    fn table_round(&self, table: &str) -> PyResult<u32> {
        self.inner.table_round(table).map_err(to_py)
    }

    /// One round (clock) of the table named ``table``: pushes ``grads``
    /// (``float32``, ``len(ids) * dim`` values: row i is id ``ids[i]``'s
    /// gradient; a repeated id's rows are summed) and writes into ``out``
    /// (``float32``, as long) each id's row after the round's update, in
    /// ``ids``' order. ``ids``: ``uint64`` or non-negative ``int64``.
    /// Every rank pushes every round of a table, with no ids if it has
    /// none. Returns the round. Blocks, with the GIL released.
    fn push_pull_rows(
        &self,
        py: Python<'_>,
        table: &str,
        ids: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        let ids = row_ids(ids, "ids")?;
        let ga = Array::get(grads, Dtype::F32, "grads", false)?;
        let o = Array::get(out, Dtype::F32, "out", true)?;
        // Gradients read in place unless they share memory with `out`.
        let g = if ga.overlaps(&o) {
            std::borrow::Cow::Owned(ga.to_f32_vec())
        } else {
            f32_in(&ga)
        };
        let w = &*self.inner;
        f32_out(py, &o, |rows| w.push_pull_rows(table, &ids, &g, rows)).map_err(to_py)
    }

    /// :meth:`push_pull_rows` without the rows after the update: one round
    /// (clock) of pushes. Returns the round. Blocks, with the GIL released.
    fn push_rows(
        &self,
        py: Python<'_>,
        table: &str,
        ids: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        self.push_rows_start(py, table, ids, grads)?.wait(py)
    }

    /// :meth:`push_rows` without waiting: the ids and gradients are copied
    /// into the round's messages, which go out at once; returns a
    /// :class:`RowsPush` whose ``wait()`` blocks until every lcore has
    /// answered and returns the round. Pushes of several tables may be in
    /// flight together (``phub.torch.Embedding``'s backward). The table
    /// stays busy until then (its other requests are refused); dropping it
    /// unwaited waits for it and lets the outcome go.
    fn push_rows_start(
        &self,
        py: Python<'_>,
        table: &str,
        ids: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<RowsPush> {
        let ids = row_ids(ids, "ids")?;
        let ga = Array::get(grads, Dtype::F32, "grads", false)?;
        // Read in place: the push copies the rows into its messages before
        // it returns.
        let g = f32_in(&ga);
        // SAFETY: `RowsPush` keeps `self.inner` cloned and drops it after
        // the push (field order).
        let w = unsafe { self.static_worker() };
        let push = py.detach(|| w.start_push_rows(table, &ids, &g)).map_err(to_py)?;
        Ok(RowsPush {
            table: table.to_string(),
            round: push.round(),
            push: Mutex::new(Some(push)),
            _worker: Arc::clone(&self.inner),
        })
    }

    /// The current rows of ``ids`` of the table named ``table`` into
    /// ``out`` (``float32``, ``len(ids) * dim`` values, in ``ids``' order;
    /// a row never pushed reads as its initial value). Any time; changes
    /// nothing. Returns the lowest round the answering lcores stated.
    /// Blocks, with the GIL released.
    fn pull_rows(
        &self,
        py: Python<'_>,
        table: &str,
        ids: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        let ids = row_ids(ids, "ids")?;
        let o = Array::get(out, Dtype::F32, "out", true)?;
        let w = &*self.inner;
        f32_out(py, &o, |rows| w.pull_rows(table, &ids, rows)).map_err(to_py)
    }

    /// :meth:`pull_rows` without waiting: the pull goes out at once;
    /// returns a :class:`RowsPull` whose ``wait()`` blocks until every lcore
    /// asked has answered, writes the rows into ``out`` and returns the
    /// round. Pulls of several tables may be in flight together (a model's
    /// forward, ``phub.torch.Embedding.prefetch``). ``out`` is written only
    /// by ``wait()``; the table stays busy until then (its other requests
    /// are refused); dropping it unwaited waits for it and lets the rows go.
    fn pull_rows_start(
        &self,
        py: Python<'_>,
        table: &str,
        ids: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<RowsPull> {
        let ids = row_ids(ids, "ids")?;
        let o = Array::get(out, Dtype::F32, "out", true)?;
        let dim = self.inner.table_dim(table).map_err(to_py)? as usize;
        if ids.len().checked_mul(dim) != Some(o.len()) {
            return Err(usage(format!(
                "table {table:?}: out has {} values; expected len(ids) * dim = {} * {dim}",
                o.len(),
                ids.len()
            )));
        }
        // SAFETY: `RowsPull` keeps `self.inner` cloned and drops it after
        // the pull (field order).
        let w = unsafe { self.static_worker() };
        let pull = py.detach(|| w.start_pull_rows(table, &ids)).map_err(to_py)?;
        Ok(RowsPull {
            table: table.to_string(),
            out: out.clone().unbind(),
            pull: Mutex::new(Some(pull)),
            _worker: Arc::clone(&self.inner),
        })
    }

    /// Key caching (PROTOCOL.md §10.7): registers ``ids`` (``uint64`` or
    /// non-negative ``int64``) of the table named ``table``, so that later
    /// pushes and pulls of the same ids (any order, any repeats) send each
    /// message's ids once and then name them by signature. Takes one of
    /// the table's ``key_cache`` slots per message on its lcore. Returns
    /// ``(signature, lists)``. Raises when the table has ``key_cache = 0``
    /// or too few slots are free.
    fn cache_ids(&self, table: &str, ids: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
        let ids = row_ids(ids, "ids")?;
        let c = self.inner.cache_ids(table, &ids).map_err(to_py)?;
        Ok((c.signature, c.lists))
    }

    /// Forgets a :meth:`cache_ids` registration of the same ``ids``.
    fn uncache_ids(&self, table: &str, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = row_ids(ids, "ids")?;
        self.inner.uncache_ids(table, &ids).map_err(to_py)
    }

    /// For a rank that rejoined a running job: asks every lcore where the
    /// table named ``table`` stands, makes the lowest round its round here
    /// and returns it (the next push carries the round after it). Blocks,
    /// with the GIL released.
    fn catch_up_rows(&self, py: Python<'_>, table: &str) -> PyResult<u32> {
        let w = &*self.inner;
        py.detach(|| w.catch_up_rows(table)).map_err(to_py)
    }

    /// For a rank that rejoined a running job with several tables: catches
    /// every table up together (a training step pushes each, and a rank
    /// that left mid-step left one a round ahead) and returns the lowest
    /// round. Blocks, with the GIL released.
    fn catch_up_tables(&self, py: Python<'_>) -> PyResult<u32> {
        let w = &*self.inner;
        py.detach(|| w.catch_up_tables()).map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "phub.Worker(job={}, rank={}, workers={}, keys={}, dtype='{}', optimizer='{}')",
            self.inner.job(),
            self.inner.rank(),
            self.inner.workers(),
            self.inner.spec().keys.len(),
            self.dtype(),
            self.inner.spec().optimizer.name()
        )
    }
}

/// Arrays lent to an exchange ([`Worker::exchange`],
/// [`Worker::exchange_start`]), checked, with the claims that keep this
/// worker's other requests off their outputs.
struct LentArrays {
    /// Per request: its key, its gradient, and its output when that is
    /// not the gradient (lent in place otherwise).
    arrays: Vec<(u32, Array, Option<Array>)>,
    /// Held, not read: dropped with the arrays.
    _claims: Vec<Claim>,
}

impl Worker {
    /// Checks `requests` (see [`Worker::exchange`]) and claims their
    /// outputs; nothing is sent.
    fn lend(&self, requests: &[Bound<'_, PyAny>]) -> PyResult<LentArrays> {
        let dtype = self.dtype();
        let mut arrays = Vec::with_capacity(requests.len());
        let mut claims = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            let (key, grad, out): (u32, Bound<'_, PyAny>, Option<Bound<'_, PyAny>>) = match r.len() {
                Ok(2) => {
                    let (k, g): (u32, Bound<'_, PyAny>) = r.extract()?;
                    (k, g, None)
                }
                Ok(3) => {
                    let (k, g, o): (u32, Bound<'_, PyAny>, Bound<'_, PyAny>) = r.extract()?;
                    (k, g, Some(o))
                }
                _ => {
                    return Err(usage(format!(
                        "requests[{i}]: a (key, grad) or (key, grad, out) tuple"
                    )))
                }
            };
            let g = Array::get(&grad, dtype, "grad", out.is_none())?;
            self.check(key, &g, "grad")?;
            let lent = |a: &Array, what: &str| {
                a.native().map(|_| ()).ok_or_else(|| {
                    usage(format!(
                        "requests[{i}] (key {key}): `{what}` is lent in place, so it must be float32 or the \
                         job's {dtype} elements, aligned (use push_pull for other arrays)"
                    ))
                })
            };
            lent(&g, "grad")?;
            let o = match out {
                None => None,
                Some(out) => {
                    let o = Array::get(&out, dtype, "out", true)?;
                    self.check(key, &o, "out")?;
                    lent(&o, "out")?;
                    if o.elem() != g.elem() {
                        return Err(usage(format!(
                            "requests[{i}] (key {key}): `grad` and `out` hold different element types"
                        )));
                    }
                    if o.overlaps(&g) && o.byte_range() != g.byte_range() {
                        return Err(usage(format!(
                            "requests[{i}] (key {key}): `out` overlaps `grad` without being it: pass \
                             (key, grad) to exchange in place"
                        )));
                    }
                    (o.byte_range() != g.byte_range()).then_some(o)
                }
            };
            claims.push(self.claim(key, o.as_ref().unwrap_or(&g), o.is_some().then_some(&g))?);
            arrays.push((key, g, o));
        }
        Ok(LentArrays {
            arrays,
            _claims: claims,
        })
    }
}

impl LentArrays {
    /// Starts every request with its arrays lent to `w`'s I/O thread; with
    /// `detach`, returns at once with what waits for them, otherwise once
    /// they have ended. On an error the requests already started have
    /// ended.
    fn start(&self, w: &phub_worker::Worker, detach: bool) -> PyResult<phub_worker::Detached> {
        // SAFETY: every array's export lives in `self.arrays` until the
        // exchange has ended: `exchange` returns only once the I/O thread is
        // done with every lent buffer, and a detached one is kept beside
        // these arrays until it has been waited (`PendingExchange`, whose
        // in-flight state drops the `Detached` before the arrays). The
        // claims keep this worker's other requests off the outputs, and an
        // output overlaps no other request's gradient (the claims) nor its
        // own (checked in `lend`).
        let lent: Vec<(u32, Lent<'_>)> = self
            .arrays
            .iter()
            .map(|(k, g, o)| {
                let l = match o {
                    // SAFETY: as above: `g` is exported writable, and only
                    // this request uses it until the exchange has ended.
                    None => Lent::InPlace(unsafe { g.slice_mut() }.expect("checked native")),
                    Some(o) => Lent::Pair(
                        // SAFETY: as above; nothing writes `g` meanwhile.
                        unsafe { g.slice() }.expect("checked native"),
                        // SAFETY: as above: `o` is exported writable and
                        // overlaps no gradient.
                        unsafe { o.slice_mut() }.expect("checked native"),
                    ),
                };
                (*k, l)
            })
            .collect();
        let done = w.exchange(
            |x| -> Result<Option<phub_worker::Detached>, phub_worker::WorkerError> {
                for (k, l) in lent {
                    l.start(x, k)?;
                }
                // SAFETY: see the head of this function: the arrays outlive
                // the detached requests.
                Ok(detach.then(|| unsafe { x.detach() }))
            },
        );
        // Not detached: ended already, nothing left to wait for.
        Ok(done.map_err(to_py)?.map_err(to_py)?.unwrap_or_default())
    }
}

/// A table's push started by :meth:`Worker.push_rows_start`, in flight.
///
/// :meth:`wait` blocks, with the GIL released, until every lcore of the
/// table has answered, and returns the round. Dropping it unwaited blocks
/// until it has ended and lets the outcome go.
#[pyclass(module = "phub", name = "RowsPush", frozen)]
pub(crate) struct RowsPush {
    table: String,
    round: u32,
    // Field order is drop order: `push` borrows `_worker`.
    push: Mutex<Option<phub_worker::RowsPush<'static>>>,
    _worker: Arc<phub_worker::Worker>,
}

#[pymethods]
impl RowsPush {
    /// Blocks, with the GIL released, until the push has ended; returns its
    /// round. Raises its failure, :class:`UsageError` if already waited.
    fn wait(&self, py: Python<'_>) -> PyResult<u32> {
        let taken = self.push.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(push) = taken else {
            return Err(usage(format!(
                "the push of table {:?} round {} was already waited",
                self.table, self.round
            )));
        };
        py.detach(|| push.wait()).map_err(to_py)
    }

    /// The round (clock) it pushes.
    #[getter]
    fn round(&self) -> u32 {
        self.round
    }

    /// Whether it is still to be waited.
    #[getter]
    fn pending(&self) -> bool {
        self.push.lock().unwrap_or_else(PoisonError::into_inner).is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "RowsPush(table={:?}, round={}, pending={})",
            self.table,
            self.round,
            self.pending()
        )
    }
}

impl Drop for RowsPush {
    fn drop(&mut self) {
        if let Some(push) = self.push.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            // Its drop waits for the I/O thread: with the GIL released.
            Python::attach(|py| py.detach(|| drop(push)));
        }
    }
}

/// A table's pull started by :meth:`Worker.pull_rows_start`, in flight.
///
/// :meth:`wait` blocks, with the GIL released, until every lcore asked has
/// answered, writes the rows into the ``out`` given at the start and
/// returns the round. Dropping it unwaited blocks until it has ended and
/// lets the rows go.
#[pyclass(module = "phub", name = "RowsPull", frozen)]
pub(crate) struct RowsPull {
    table: String,
    out: Py<PyAny>,
    // Field order is drop order: `pull` borrows `_worker`.
    pull: Mutex<Option<phub_worker::RowsPull<'static>>>,
    _worker: Arc<phub_worker::Worker>,
}

#[pymethods]
impl RowsPull {
    /// Blocks, with the GIL released, until the pull has ended; writes its
    /// rows into ``out`` and returns the round. Raises its failure,
    /// :class:`UsageError` if already waited.
    fn wait(&self, py: Python<'_>) -> PyResult<u32> {
        let taken = self.pull.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(pull) = taken else {
            return Err(usage(format!(
                "the pull of table {:?} was already waited",
                self.table
            )));
        };
        let values = pull.values();
        let o = match Array::get(self.out.bind(py), Dtype::F32, "out", true) {
            Ok(o) if o.len() == values => o,
            other => {
                // Ended first, as a wait would (its drop waits).
                py.detach(|| drop(pull));
                let o = other?;
                return Err(usage(format!(
                    "table {:?}: out has {} values now, the pull's rows {} (resized since the start?)",
                    self.table,
                    o.len(),
                    values
                )));
            }
        };
        f32_out(py, &o, |rows| pull.wait_into(rows)).map_err(to_py)
    }

    /// Whether it is still to be waited.
    #[getter]
    fn pending(&self) -> bool {
        self.pull.lock().unwrap_or_else(PoisonError::into_inner).is_some()
    }

    fn __repr__(&self) -> String {
        format!("RowsPull(table={:?}, pending={})", self.table, self.pending())
    }
}

impl Drop for RowsPull {
    fn drop(&mut self) {
        if let Some(pull) = self.pull.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            // Its drop waits for the I/O thread: with the GIL released.
            Python::attach(|py| py.detach(|| drop(pull)));
        }
    }
}

/// An exchange started by :meth:`Worker.exchange_start`, in flight.
///
/// :meth:`wait` blocks, with the GIL released, until every key's round is
/// in (each result already written into its array by then). It keeps the
/// lent arrays alive (and claimed) until then: do not read or write them
/// before ``wait`` returns. Dropping it without waiting blocks until its
/// requests have ended.
#[pyclass(module = "phub", name = "PendingExchange", frozen)]
pub(crate) struct PendingExchange {
    keys: Vec<u32>,
    in_flight: Mutex<Option<InFlight>>,
}

/// A pending exchange's requests and what they borrow.
struct InFlight {
    // Field order is drop order: `detached` waits for the I/O thread to
    // be done with the arrays before `lent` releases them.
    detached: phub_worker::Detached,
    lent: LentArrays,
    _worker: Arc<phub_worker::Worker>,
}

#[pymethods]
impl PendingExchange {
    /// Blocks, with the GIL released, until every request has ended; the
    /// arrays are the caller's again. Raises the first failure (see
    /// :meth:`Worker.exchange`), :class:`UsageError` if already waited.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let taken = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(InFlight { detached, lent, .. }) = taken else {
            return Err(usage(format!(
                "the pending exchange of keys {:?} was already waited",
                self.keys
            )));
        };
        let done = py.detach(|| detached.wait());
        drop(lent);
        done.map_err(to_py)
    }

    /// The keys it exchanges, in the order given.
    #[getter]
    fn keys(&self) -> Vec<u32> {
        self.keys.clone()
    }

    fn __repr__(&self) -> String {
        let waited = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none();
        format!(
            "PendingExchange(keys={:?}, {})",
            self.keys,
            if waited { "waited" } else { "in flight" }
        )
    }
}

impl Drop for PendingExchange {
    fn drop(&mut self) {
        let taken = self
            .in_flight
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(InFlight { detached, lent, .. }) = taken {
            // Waits for the I/O thread with the GIL released (it never needs
            // it), then releases the arrays with it held.
            Python::attach(|py| py.detach(|| drop(detached)));
            drop(lent);
        }
    }
}

impl Handle {
    fn new(
        handle: phub_worker::Handle<'static>,
        sink: Sink,
        out: Array,
        out_obj: &Bound<'_, PyAny>,
        claim: Claim,
        worker: &Arc<phub_worker::Worker>,
    ) -> Handle {
        let output = Output {
            sink,
            out,
            out_obj: out_obj.clone().unbind(),
            claim,
        };
        Handle::in_flight(handle, Some(output), worker)
    }

    fn in_flight(
        handle: phub_worker::Handle<'static>,
        output: Option<Output>,
        worker: &Arc<phub_worker::Worker>,
    ) -> Handle {
        Handle {
            key: handle.key(),
            round: handle.round(),
            lent: false,
            pending: Mutex::new(Some(Flight::Owned(Pending {
                handle,
                output,
                worker: Arc::clone(worker),
            }))),
        }
    }
}

impl Handle {
    /// The request in flight, taken out to be waited for (once).
    fn take_pending(&self) -> PyResult<Flight> {
        let mut g = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        g.take().ok_or_else(|| {
            usage(format!(
                "the handle of key {} round {} was already waited",
                self.key, self.round
            ))
        })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let taken = self
            .pending
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(Flight::Lent(LentRequest { detached, .. })) = taken {
            // The I/O thread writes the output until the round ends: wait
            // for it, with the GIL released, before the arrays (the rest of
            // the request, dropped after this) are let go.
            Python::attach(|py| py.detach(|| drop(detached)));
        }
    }
}

#[pymethods]
impl Handle {
    /// Blocks, with the GIL released, until the result is in; writes it
    /// into the output array and returns that array. Raises a
    /// :class:`PhubError` subclass on failure, :class:`UsageError` if the
    /// handle was already waited.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Pending {
            handle,
            output,
            worker,
        } = match self.take_pending()? {
            Flight::Owned(p) => p,
            Flight::Lent(LentRequest {
                detached,
                out_obj,
                claim,
                ..
            }) => {
                // The result is written into the output as it arrives.
                let done = py.detach(|| detached.wait());
                drop(claim);
                done.map_err(to_py)?;
                return Ok(out_obj);
            }
        };
        // Without an output `wait` fails (and lets the results go).
        py.detach(|| worker.wait(handle)).map_err(to_py)?;
        let Some(Output {
            sink,
            out,
            out_obj,
            claim,
        }) = output
        else {
            unreachable!("phub-worker's wait fails for a push without an output")
        };
        if let Sink::Convert(s) = &sink {
            // SAFETY: the handle, and with it the slice into `s`, is gone.
            out.write_from(unsafe { s.values() });
        }
        // The output is written: another request may use its memory now.
        drop(claim);
        Ok(out_obj)
    }

    /// Blocks, with the GIL released, until the result is in, and leaves it
    /// where it arrived (the output array is not written): returns the
    /// :class:`Results`. For a request pushed with
    /// :meth:`Worker.push_staged`, or with :meth:`Worker.push_pull_staged`
    /// into an output of the job's wire type, whose results a device copies
    /// out itself.
    fn wait_in_place(&self, py: Python<'_>) -> PyResult<Results> {
        if self.lent {
            return Err(usage(format!(
                "key {} round {}: its output was lent (push_pull over datagrams), so the result is \
                 written there, not left in place: use wait() (or push_pull(..., lend=False))",
                self.key, self.round
            )));
        }
        let Flight::Owned(Pending {
            handle,
            output,
            worker,
        }) = self.take_pending()?
        else {
            unreachable!("a handle that is not lent holds an owned request")
        };
        // SAFETY: `ResultsKeep` keeps `worker` and drops it after the
        // results (field order).
        let w: &'static phub_worker::Worker = unsafe { &*Arc::as_ptr(&worker) };
        let results = py.detach(|| w.wait_in_place(handle)).map_err(to_py)?;
        drop(output);
        Ok(Results {
            key: self.key,
            round: self.round,
            keep: Mutex::new(Some(Arc::new(ResultsKeep {
                results,
                _worker: worker,
            }))),
        })
    }

    /// The key this request exchanges.
    #[getter]
    fn key(&self) -> u32 {
        self.key
    }

    /// The round this request completes (0 for ``init``).
    #[getter]
    fn round(&self) -> u32 {
        self.round
    }

    /// Whether the output was lent to the worker's I/O thread, which writes
    /// the result into it as it arrives (:meth:`Worker.push_pull`).
    #[getter]
    fn lent(&self) -> bool {
        self.lent
    }

    /// Whether the handle still waits to be waited (``False`` after
    /// :meth:`wait`, whatever its outcome).
    #[getter]
    fn pending(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "phub.Handle(key={}, round={}, lent={}, pending={})",
            self.key,
            self.round,
            if self.lent { "True" } else { "False" },
            if self.pending() { "True" } else { "False" }
        )
    }
}

/// Bytes of the shared-memory regions through the buffer protocol
/// (``memoryview(b)``, ``numpy.frombuffer(b, dtype)``,
/// ``torch.frombuffer(b, dtype=...)``): writable for a span of a staged key
/// (:attr:`Staged.spans`) or a whole staging region (:attr:`Staged.regions`),
/// read-only for results left in place (:attr:`Results.spans`,
/// :attr:`Results.regions`). What it points into stays there while this
/// object, or anything made from its buffer, lives (for results: the key
/// stays busy until then).
#[pyclass(module = "phub", name = "StagingBuffer", frozen)]
pub(crate) struct StagingBuffer {
    /// The mapping, when the bytes are in one.
    memory: Option<phub_worker::StagingMemory>,
    /// Results left in place, which the bytes may be part of.
    _results: Option<Arc<ResultsKeep>>,
    address: usize,
    nbytes: usize,
    readonly: bool,
}

#[pymethods]
impl StagingBuffer {
    /// The address of the first byte (e.g. for
    /// ``torch.cuda.cudart().cudaHostRegister``).
    #[getter]
    fn address(&self) -> usize {
        self.address
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Whether ``other`` lies in the same mapping of the regions (a
    /// dataplane that recreated its regions makes a new one).
    fn same_mapping(&self, other: &StagingBuffer) -> bool {
        matches!((&self.memory, &other.memory), (Some(a), Some(b)) if a.same(b))
    }

    /// Whether the buffer is read-only (results).
    #[getter]
    fn readonly(&self) -> bool {
        self.readonly
    }

    /// # Safety
    /// Called by Python with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (address, nbytes) = (slf.get().address, slf.get().nbytes);
        let len = isize::try_from(nbytes).map_err(|_| usage("a staging buffer too large for Python"))?;
        // SAFETY: `view` is Python's to fill; the memory lies inside the
        // mapping `slf.memory` keeps mapped (or the results `slf.results`
        // keeps), and the view holds a reference to `slf` (FillInfo takes
        // one) until it is released. FillInfo refuses a writable request
        // for a read-only buffer.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                address as *mut std::ffi::c_void,
                len,
                i32::from(slf.get().readonly),
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "phub.StagingBuffer(address=0x{:x}, nbytes={})",
            self.address, self.nbytes
        )
    }
}

/// A key claimed for a push whose values the caller writes in place into
/// this rank's shared-memory staging regions (:meth:`Worker.stage`): write
/// the key's values, as the job's wire type (``float32``; the job's 16-bit
/// type as its bits), into each of :attr:`spans`, then push with
/// :meth:`Worker.push_pull_staged`. The key is busy until then, or until
/// :meth:`release` (or garbage collection) gives it back.
#[pyclass(module = "phub", name = "Staged", frozen)]
pub(crate) struct Staged {
    key: u32,
    round: u32,
    // Field order is drop order: `staged` borrows `worker`.
    staged: Mutex<Option<phub_worker::Staged<'static>>>,
    worker: Arc<phub_worker::Worker>,
}

impl Staged {
    /// The error for a staged key used after its push or release.
    fn gone(&self) -> PyErr {
        usage(format!(
            "key {} round {} was already pushed or released",
            self.key, self.round
        ))
    }

    fn take(&self) -> PyResult<phub_worker::Staged<'static>> {
        let mut g = self.staged.lock().unwrap_or_else(PoisonError::into_inner);
        g.take().ok_or_else(|| self.gone())
    }

    fn with<T>(&self, f: impl FnOnce(&phub_worker::Staged<'static>) -> T) -> PyResult<T> {
        let g = self.staged.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(f(g.as_ref().ok_or_else(|| self.gone())?))
    }
}

#[pymethods]
impl Staged {
    /// The key.
    #[getter]
    fn key(&self) -> u32 {
        self.key
    }

    /// The round (or clock) the push will carry.
    #[getter]
    fn round(&self) -> u32 {
        self.round
    }

    /// Where the key's values go, in order: ``(buffer, first, elements)``
    /// per run of elements contiguous in one region, ``buffer`` a
    /// :class:`StagingBuffer` of ``elements`` values of the wire type
    /// starting with the key's element ``first``.
    #[getter]
    fn spans(&self) -> PyResult<Vec<(StagingBuffer, usize, usize)>> {
        self.with(|s| {
            let memory = s.memory();
            s.spans()
                .iter()
                .map(|sp| {
                    (
                        StagingBuffer {
                            memory: Some(memory.clone()),
                            _results: None,
                            address: sp.address(),
                            nbytes: sp.bytes(),
                            readonly: false,
                        },
                        sp.first,
                        sp.elements,
                    )
                })
                .collect()
        })
    }

    /// This rank's whole staging regions of the mapping the spans are in
    /// (one per lcore of the job), to register once with a device driver
    /// so that device-to-host copies land in them directly.
    #[getter]
    fn regions(&self) -> PyResult<Vec<StagingBuffer>> {
        self.with(|s| {
            let memory = s.memory();
            memory
                .regions()
                .into_iter()
                .map(|(address, nbytes)| StagingBuffer {
                    memory: Some(memory.clone()),
                    _results: None,
                    address,
                    nbytes,
                    readonly: false,
                })
                .collect()
        })
    }

    /// Gives the key back without pushing (what garbage collection does).
    fn release(&self) -> PyResult<()> {
        drop(self.take()?);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("phub.Staged(key={}, round={})", self.key, self.round)
    }
}

/// Results left in place and the worker they borrow (field order is drop
/// order: the results first).
pub(crate) struct ResultsKeep {
    results: phub_worker::Results<'static>,
    _worker: Arc<phub_worker::Worker>,
}

/// A request's results left where they arrived (:meth:`Handle.wait_in_place`):
/// read them from :attr:`spans` (read-only buffers of the wire type), e.g.
/// with a device copy from the result regions (:attr:`regions`, to register
/// with the device's driver). The key stays busy while this object or any
/// buffer from it lives, or until :meth:`release` and the buffers are gone.
#[pyclass(module = "phub", name = "Results", frozen)]
pub(crate) struct Results {
    key: u32,
    round: u32,
    keep: Mutex<Option<Arc<ResultsKeep>>>,
}

impl Results {
    fn keep(&self) -> PyResult<Arc<ResultsKeep>> {
        let g = self.keep.lock().unwrap_or_else(PoisonError::into_inner);
        g.clone().ok_or_else(|| {
            usage(format!(
                "the results of key {} round {} were already released",
                self.key, self.round
            ))
        })
    }
}

#[pymethods]
impl Results {
    /// The key.
    #[getter]
    fn key(&self) -> u32 {
        self.key
    }

    /// The round they are the result of.
    #[getter]
    fn round(&self) -> u32 {
        self.round
    }

    /// Where the key's results are, in order: ``(buffer, first, elements)``
    /// per run of elements contiguous in one place, ``buffer`` a read-only
    /// :class:`StagingBuffer` of ``elements`` values of the wire type
    /// starting with the key's element ``first``.
    #[getter]
    fn spans(&self) -> PyResult<Vec<(StagingBuffer, usize, usize)>> {
        let keep = self.keep()?;
        let memory = keep.results.memory();
        Ok(keep
            .results
            .spans()
            .iter()
            .map(|sp| {
                (
                    StagingBuffer {
                        memory: memory.clone(),
                        _results: Some(Arc::clone(&keep)),
                        address: sp.address(),
                        nbytes: sp.bytes(),
                        readonly: true,
                    },
                    sp.first,
                    sp.elements,
                )
            })
            .collect())
    }

    /// The lcores' whole result regions of the mapping the spans are in
    /// (empty when every result came as a datagram), to register once with
    /// a device driver so that host-to-device copies read them directly.
    #[getter]
    fn regions(&self) -> PyResult<Vec<StagingBuffer>> {
        let keep = self.keep()?;
        let Some(memory) = keep.results.memory() else {
            return Ok(Vec::new());
        };
        Ok(memory
            .result_regions()
            .into_iter()
            .map(|(address, nbytes)| StagingBuffer {
                memory: Some(memory.clone()),
                _results: None,
                address,
                nbytes,
                readonly: true,
            })
            .collect())
    }

    /// Lets the results go (the key is free once no buffer from
    /// :attr:`spans` is left either).
    fn release(&self) {
        self.keep.lock().unwrap_or_else(PoisonError::into_inner).take();
    }

    fn __repr__(&self) -> String {
        format!("phub.Results(key={}, round={})", self.key, self.round)
    }
}
