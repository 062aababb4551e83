//! Counters the I/O thread writes and [`Worker::stats`](crate::Worker::stats) reads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// A snapshot of a worker's counters since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// Chunk messages (INIT, PUSH, PULL) sent for the first time.
    pub chunks_sent: u64,
    /// Chunk messages sent again: after their retransmission timeout, or
    /// at once when later chunks' results overtook them (fast).
    pub retransmits: u64,
    /// The part of `retransmits` sent by fast retransmission.
    pub fast_retransmits: u64,
    /// RESULTs accepted for an outstanding chunk.
    pub results_accepted: u64,
    /// RESULTs of this job ignored: duplicates, or for a round or chunk not
    /// waited for.
    pub results_ignored: u64,
    /// Datagrams dropped because they are malformed or not this job's (wrong
    /// job id, token, rank, dtype or message type).
    pub foreign_dropped: u64,
    /// ERROR messages received for an outstanding chunk.
    pub errors: u64,
    /// Requests failed because the appliance stopped answering.
    pub timeouts: u64,
    /// Smoothed round-trip time, in microseconds (0 before the first sample).
    pub srtt_us: u64,
    /// Current retransmission timeout, in microseconds.
    pub rto_us: u64,
    /// UDP payload bytes sent.
    pub bytes_sent: u64,
    /// UDP payload bytes received.
    pub bytes_received: u64,
    /// Datagrams the fault injector ([`WorkerConfig::inject`](crate::WorkerConfig::inject))
    /// dropped, sent and received together; 0 with injection off.
    #[serde(default)]
    pub injected_drops: u64,
    /// Datagrams the fault injector duplicated, both directions.
    #[serde(default)]
    pub injected_dups: u64,
    /// Datagrams the fault injector held back behind later ones, both
    /// directions.
    #[serde(default)]
    pub injected_reorders: u64,
    /// Datagrams the fault injector held back for its `delay_ms`, both
    /// directions.
    #[serde(default)]
    pub injected_delays: u64,
    /// RESULTs whose payload was read from the dataplane's result region
    /// (shared memory, [`WorkerConfig::shm`](crate::WorkerConfig::shm)).
    #[serde(default)]
    pub shm_results: u64,
    /// Whether this worker exchanges through shared memory now (not a
    /// counter).
    #[serde(default)]
    pub shm: bool,
}

/// The live counters: one writer (the I/O thread), relaxed readers.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) chunks_sent: AtomicU64,
    pub(crate) retransmits: AtomicU64,
    pub(crate) fast_retransmits: AtomicU64,
    pub(crate) results_accepted: AtomicU64,
    pub(crate) results_ignored: AtomicU64,
    pub(crate) foreign_dropped: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) srtt_us: AtomicU64,
    pub(crate) rto_us: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) injected_drops: AtomicU64,
    pub(crate) injected_dups: AtomicU64,
    pub(crate) injected_reorders: AtomicU64,
    pub(crate) injected_delays: AtomicU64,
    pub(crate) shm_results: AtomicU64,
    /// Whether the regions are mapped (the I/O thread writes it).
    pub(crate) shm: AtomicBool,
}

/// Adds `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> WorkerStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        WorkerStats {
            chunks_sent: r(&self.chunks_sent),
            retransmits: r(&self.retransmits),
            fast_retransmits: r(&self.fast_retransmits),
            results_accepted: r(&self.results_accepted),
            results_ignored: r(&self.results_ignored),
            foreign_dropped: r(&self.foreign_dropped),
            errors: r(&self.errors),
            timeouts: r(&self.timeouts),
            srtt_us: r(&self.srtt_us),
            rto_us: r(&self.rto_us),
            bytes_sent: r(&self.bytes_sent),
            bytes_received: r(&self.bytes_received),
            injected_drops: r(&self.injected_drops),
            injected_dups: r(&self.injected_dups),
            injected_reorders: r(&self.injected_reorders),
            injected_delays: r(&self.injected_delays),
            shm_results: r(&self.shm_results),
            shm: self.shm.load(Ordering::Relaxed),
        }
    }
}
