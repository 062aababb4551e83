//! Counters the I/O thread writes and [`Worker::stats`](crate::Worker::stats)
//! reads, defined once in a table.

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

phub_proto::counter_table! {
    /// A snapshot of a worker's counters since it was created.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct WorkerStats {
        /// Whether this worker exchanges through shared memory now (not a
        /// counter).
        #[serde(default)]
        pub shm: bool,
    }
    /// The live counters.
    pub(crate) struct Live of AtomicU64;
    counters {
        chunks_sent: Count, Hidden, "Chunk messages (INIT, PUSH, PULL) sent for the first time";
        retransmits: Count, Hidden, "Chunk messages sent again: after their retransmission timeout, or at once when later chunks' results overtook them (fast)";
        fast_retransmits: Count, Hidden, "The part of `retransmits` sent by fast retransmission";
        results_accepted: Count, Hidden, "RESULTs accepted for an outstanding chunk";
        results_ignored: Count, Hidden, "RESULTs of this job ignored: duplicates, for a round or chunk not waited for, or sent before the job went back to its checkpoints";
        foreign_dropped: Count, Hidden, "Datagrams dropped because they are malformed or not this job's (wrong job id, token, rank, dtype or message type)";
        errors: Count, Hidden, "ERROR messages received for an outstanding chunk";
        timeouts: Count, Hidden, "Requests failed because the appliance stopped answering";
        srtt_us: Gauge, Hidden, "Smoothed round-trip time, in microseconds (0 before the first sample)";
        rto_us: Gauge, Hidden, "Current retransmission timeout, in microseconds";
        window: Gauge, Hidden, "Window: chunks allowed outstanding across all keys (the set window, or the one made from the job's shape, remade when an appliance states another receive-buffer share in its results)";
        cwnd: Gauge, Hidden, "Congestion window: chunks allowed outstanding now; the window until a loss halves it, then grown back as results come";
        window_cuts: Count, Hidden, "Times a loss halved the congestion window (`WorkerConfig::congestion`; at most once per loss episode)";
        bytes_sent: Bytes, Hidden, "UDP payload bytes sent";
        bytes_received: Bytes, Hidden, "UDP payload bytes received";
        injected_drops: Count, Hidden, "Datagrams the fault injector (`WorkerConfig::inject`) dropped, sent and received together; 0 with injection off";
        injected_dups: Count, Hidden, "Datagrams the fault injector duplicated, both directions";
        injected_reorders: Count, Hidden, "Datagrams the fault injector held back behind later ones, both directions";
        injected_delays: Count, Hidden, "Datagrams the fault injector held back for its `delay_ms`, both directions";
        lcores_probed: Count, Hidden, "PULLs a rank sent, after a silence, to lcores it had nothing out on, to learn whether one was restored behind rounds it had answered (PROTOCOL.md §6.1)";
        lcores_found_behind: Count, Hidden, "Times such a PULL found its lcore behind a round it had answered, and every request failed `ahead` (the caller pulls every key and repeats the rounds since)";
        row_messages_sent: Count, Hidden, "Table messages (ROW_PUSH, ROW_END, ROW_PULL) sent for the first time";
        row_retransmits: Count, Hidden, "Table messages sent again after their retransmission timeout";
        row_resends_spurious: Count, Hidden, "Table messages sent again whose first copy was answered (the answer's FIRST_COPY), each lengthening the loss timer (PROTOCOL.md §10.3, \"Loss timer\")";
        row_answers_accepted: Count, Hidden, "Table answers (ROW_RESULT, ROW_DONE, ROW_PULL_RESULT) accepted for an outstanding message";
        row_answers_ignored: Count, Hidden, "Table answers and ERRORs of this job ignored: duplicates, or for a round or message not waited for";
        row_rounds_caught_up: Count, Hidden, "Empty table rounds (a ROW_END of no rows) sent to an lcore restored from an older checkpoint, which refused a push `ahead`, to bring it up to the push's round (PROTOCOL.md §10.6)";
        row_lanes_probed: Count, Hidden, "Table lanes held behind the window that asked their lcore where the table stands after no answer came for a while, in case it was restored behind them (PROTOCOL.md §10.6)";
        row_answers_malformed: Count, Hidden, "Table answers dropped as malformed: unparsable, or with another dim, sequence number, count or ids than the message they answer";
        key_cache_id_bytes_saved: Bytes, Hidden, "Id bytes that table messages and their answers left out because a key-cache prefix named a list the lcore keeps (PROTOCOL.md §10.7); first transmissions and accepted answers";
        key_cache_prefix_bytes: Bytes, Hidden, "Key-cache prefix bytes (16 a message) that table messages storing or naming a cached id list, and their answers, carried; first transmissions and accepted answers";
        key_cache_misses: Count, Hidden, "Table messages naming a cached id list that their lcore refused `unknown_signature` (it no longer held the list: restarted, or the slot was taken again) and that went again with their ids";
        shm_results: Count, Hidden, "RESULTs whose payload was read from the dataplane's result region (shared memory, `WorkerConfig::shm`)";
    }
}

/// The live counters (the table's, reached through `Deref`) and whether the
/// shared-memory regions are mapped; the I/O thread writes them, readers
/// load them relaxed.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    live: Live,
    /// Whether the regions are mapped (the I/O thread writes it).
    pub(crate) shm: AtomicBool,
}

impl Deref for Counters {
    type Target = Live;

    fn deref(&self) -> &Live {
        &self.live
    }
}

/// Adds `n` to a counter.
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> WorkerStats {
        let mut s = WorkerStats {
            shm: self.shm.load(Ordering::Relaxed),
            ..WorkerStats::default()
        };
        self.live.fill(&mut s);
        s
    }
}
