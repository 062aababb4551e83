//! Per-lcore counters: one writer (the lcore), any number of readers.
//!
//! A counter is bumped with a relaxed load and store, not an atomic
//! read-modify-write: only its lcore writes it, so no update is lost and the
//! hot path pays no locked instruction. Readers take relaxed snapshots.

use std::sync::atomic::{AtomicU64, Ordering};

use phub_proto::wire::DropReason;

/// One single-writer counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`. Only the owning lcore may call this.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0
            .store(self.0.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    /// Adds one. Only the owning lcore may call this.
    #[inline]
    pub fn inc(&self) {
        self.add(1);
    }

    /// Current value.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Everything one lcore counts. Cache-line aligned so two lcores' counters
/// never share a line.
#[derive(Debug, Default)]
#[repr(align(64))]
pub struct ShardCounters {
    /// Datagrams received.
    pub rx_packets: Counter,
    /// Bytes received (UDP payload).
    pub rx_bytes: Counter,
    /// Datagrams sent (one per destination).
    pub tx_packets: Counter,
    /// Bytes sent (UDP payload, per destination).
    pub tx_bytes: Counter,
    /// Contributions added to an accumulator (INIT and PUSH).
    pub pushes_aggregated: Counter,
    /// Rounds completed (optimizer runs).
    pub rounds_completed: Counter,
    /// Results queued for sending, one per destination.
    pub results_sent: Counter,
    /// Stored results sent again to a worker that lost one.
    pub results_resent: Counter,
    /// PULL requests answered.
    pub pulls_answered: Counter,
    /// ERROR messages queued.
    pub errors_sent: Counter,
    /// Packets that reached this lcore but belong to another.
    pub misrouted: Counter,
    /// Poll-loop iterations that found work.
    pub busy_loops: Counter,
    /// Poll-loop iterations that found none.
    pub idle_loops: Counter,
    /// Drops, indexed by [`DropReason::code`].
    pub drops: [Counter; DropReason::COUNT + 1],
}

impl ShardCounters {
    /// Counts a drop under its reason.
    #[inline]
    pub fn count_drop(&self, r: DropReason) {
        // Codes are 1..=COUNT by construction (a unit test checks it).
        if let Some(c) = self.drops.get(usize::from(r.code())) {
            c.inc();
        }
    }

    /// Drops counted under `r`.
    pub fn drops_of(&self, r: DropReason) -> u64 {
        self.drops.get(usize::from(r.code())).map_or(0, Counter::get)
    }

    /// All drops.
    pub fn drops_total(&self) -> u64 {
        self.drops.iter().map(Counter::get).sum()
    }
}
