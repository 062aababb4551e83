//! The worker's one error type.

use std::net::SocketAddr;
use std::time::Duration;

/// Everything a [`Worker`](crate::Worker) call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// phub-control answered the join with an error (the job does not exist,
    /// the token is wrong, the rank is taken or out of range...). `message`
    /// is control's own explanation, verbatim.
    #[error("joining at {url} failed (HTTP {status}): {message}")]
    Join {
        /// The join URL.
        url: String,
        /// HTTP status code of the answer.
        status: u16,
        /// Control's error message.
        message: String,
    },
    /// phub-control could not be reached, or its answer could not be read.
    #[error("HTTP request to {url} failed: {message}")]
    Http {
        /// The URL asked.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The join response does not describe a usable job (inconsistent layout,
    /// unresolvable dataplane host, rank out of range...).
    #[error("unusable join response: {message}")]
    BadJoin {
        /// What is inconsistent.
        message: String,
    },
    /// The worker's configuration (or an environment variable standing in
    /// for it) is not usable.
    #[error("worker configuration: {message}")]
    Config {
        /// What is wrong, naming the setting and what is accepted.
        message: String,
    },
    /// [`ShmMode::On`](crate::ShmMode::On) and the shared-memory regions
    /// cannot be used: the dataplane is not on loopback, or a region (named
    /// in the message) does not open with the expected length.
    #[error("shared memory (shm = on): {message}")]
    SharedMemory {
        /// What is wrong, naming the address or the region's path.
        message: String,
    },
    /// A socket operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A slice passed for a key does not have the key's element count.
    #[error("key {key} has {expected} elements but the slice has {got}")]
    Length {
        /// The key.
        key: u32,
        /// Elements of the key.
        expected: u64,
        /// Length of the slice given.
        got: usize,
    },
    /// A slice's element type is not one the job takes: 16-bit slices
    /// work only with a job of that wire type (`f32` with every job).
    #[error(
        "{elem} slices do not fit this job: its wire type is {dtype}, which takes {} (phub converts f32 \
         to and from a 16-bit wire type, never one 16-bit type into another)",
        takes(*.dtype)
    )]
    ElementType {
        /// The slice's element type.
        elem: &'static str,
        /// The job's wire type.
        dtype: phub_proto::Dtype,
    },
    /// The key is not one of the job's keys.
    #[error("key {key} does not exist: the job has {keys} keys (0..{keys})")]
    UnknownKey {
        /// The key asked for.
        key: u32,
        /// Number of keys of the job.
        keys: usize,
    },
    /// A request for this key is still in flight: wait for it first.
    #[error("key {key} already has a request in flight; wait for it before starting another")]
    Busy {
        /// The key.
        key: u32,
    },
    /// The call does not fit where the key stands: `push_pull` before the
    /// key was initialised (with `init` or `pull`), `init` after it has
    /// advanced past round 0, or a round number that would overflow.
    #[error("key {key}: {message}")]
    Sequence {
        /// The key.
        key: u32,
        /// What is out of order and what to do instead.
        message: String,
    },
    /// The appliance refused one of the request's chunks with an ERROR
    /// message. Retrying the same request will not help.
    #[error("appliance refused key {key} chunk {chunk} round {round}: {reason}{hint}")]
    Refused {
        /// The key.
        key: u32,
        /// The chunk index within the key.
        chunk: u32,
        /// The round of the refused message.
        round: u32,
        /// The drop reason's name (`count_mismatch`, `ahead`, ...).
        reason: String,
        /// A hint on the likely cause (may be empty).
        hint: String,
    },
    /// No result at all came back for `waited` while the request was
    /// outstanding: the appliance (at `addrs`) stopped answering, or the
    /// other workers of the job stopped pushing.
    #[error(
        "key {key} round {round}: no result from the appliance at {} for {} ms \
         ({missing} of {chunks} chunks missing); the appliance or another worker of the job stopped answering",
        fmt_addrs(.addrs), .waited.as_millis()
    )]
    Timeout {
        /// The key.
        key: u32,
        /// The round waited for (for a pull, 0).
        round: u32,
        /// The appliance ports the missing chunks were sent to.
        addrs: Vec<SocketAddr>,
        /// How long no result at all had arrived.
        waited: Duration,
        /// Chunks of the request without a result.
        missing: usize,
        /// Chunks of the request.
        chunks: usize,
    },
    /// Control answered that the job failed (PROTOCOL.md §11.6: a part
    /// of a replicated job lost); nothing the worker can do brings it
    /// back.
    #[error("job {job} failed, says control at {url}: {message}")]
    JobFailed {
        /// The job.
        job: u16,
        /// Control's epoch route, as asked.
        url: String,
        /// Control's answer.
        message: String,
    },
    /// A replicated job's appliance named a newer epoch (PROTOCOL.md
    /// §11.6) than control served within the wait: the worker cannot
    /// learn where its chunks are served now.
    #[error(
        "job {job}: an appliance is in epoch {wanted}, this worker in epoch {held}; control at {url} \
         did not serve epoch {wanted} or later within {} ms: {message}",
        .waited.as_millis()
    )]
    Epoch {
        /// The job.
        job: u16,
        /// The epoch an appliance named.
        wanted: u32,
        /// The epoch this worker holds.
        held: u32,
        /// Control's epoch route, as asked.
        url: String,
        /// How long it was asked.
        waited: Duration,
        /// Control's last answer, or why there was none.
        message: String,
    },
    /// A table call's arguments cannot be sent: a slice of the wrong
    /// length, or more rows than the protocol carries in one call.
    #[error("table {table:?}: {message}")]
    Rows {
        /// The table's name.
        table: String,
        /// What is wrong, naming the argument, its value and what is
        /// accepted.
        message: String,
    },
    /// No table key of the job has this name.
    #[error("the job has no table named {name:?}; its tables: {tables}")]
    UnknownTable {
        /// The name asked for.
        name: String,
        /// The job's table names, or "none".
        tables: String,
    },
    /// The appliance refused one of a table request's messages with an
    /// ERROR (PROTOCOL.md §10.3). Retrying the same request will not help.
    #[error("the appliance refused table {table:?} (key {key}) round {round}: {message}: {reason}{hint}")]
    TableRefused {
        /// The table's name.
        table: String,
        /// The table's key index.
        key: u32,
        /// The refused message and the lcore it went to: `ROW_PUSH 3 of
        /// 12 rows to 10.0.0.1:9001`, `ROW_END (n = 4) to ...`, `ROW_PULL of
        /// 7 ids to ...`.
        message: String,
        /// Its round (clock).
        round: u32,
        /// The drop reason's name (`dim_mismatch`, `ahead`, ...).
        reason: String,
        /// A hint on the likely cause (may be empty).
        hint: &'static str,
    },
    /// No answer at all came back for a table request for `waited`.
    #[error(
        "table {table:?} round {round}: no answer from the appliance at {} for {} ms \
         ({missing} of {messages} messages unanswered); the appliance or another worker of the job stopped answering",
        fmt_addrs(.addrs), .waited.as_millis()
    )]
    TableTimeout {
        /// The table's name.
        table: String,
        /// The round (clock) waited for; 0 for a pull.
        round: u32,
        /// The lcores the unanswered messages went to.
        addrs: Vec<SocketAddr>,
        /// How long no answer at all had arrived.
        waited: Duration,
        /// Messages without an answer.
        missing: usize,
        /// Messages of the request.
        messages: usize,
    },
    /// The worker is shutting down (or its I/O thread died).
    #[error("the worker's I/O thread has stopped")]
    Closed,
}

fn fmt_addrs(addrs: &[SocketAddr]) -> String {
    let mut s = String::new();
    for (i, a) in addrs.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&a.to_string());
    }
    if s.is_empty() {
        s.push_str("(no address)");
    }
    s
}

/// The slices a job of wire type `dtype` takes, for [`WorkerError::ElementType`].
fn takes(dtype: phub_proto::Dtype) -> &'static str {
    match dtype {
        phub_proto::Dtype::F32 => "f32 slices only",
        phub_proto::Dtype::Bf16 => "f32 or bf16 slices",
        phub_proto::Dtype::F16 => "f32 or f16 slices",
    }
}
