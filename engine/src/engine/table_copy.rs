//! A table's state copy to a new backup of its entry (PROTOCOL.md §11.9,
//! item 4): the entry's primary sends the table's whole state (the copy
//! stream: the idle-eviction clock, then the row store's checkpoint) in
//! REPLICATE_TABLE_STATE fragments, a window at a time; the backup writes
//! them into place, acknowledges how many it holds from the first without
//! a gap, and once all are in replaces its table with the copy and
//! acknowledges all of them.
//!
//! The entry's rounds go on meanwhile (a pre-copy): each round the table
//! completes while the copy runs is logged for the new backup, and once
//! the copy is installed the primary sends it the logged rounds one at a
//! time (REPLICATE_ROWS with CATCH_UP), then a confirmation (a
//! REPLICATE_ROWS of the last round it holds, no rows, without CATCH_UP);
//! from that confirmation on the backup is counted, and at its ACK it
//! joins the entry's chain (the round pending, if any, goes to it).
//!
//! Invariants:
//! - A new backup is not counted while it copies and catches up, but
//!   every round the table completes meanwhile is in its log, in order,
//!   until it acknowledged it; from the confirmation on no round
//!   completes without it. When the log outgrows the copy stream's size
//!   (or [`LOG_MIN_BYTES`]), the backup is counted at once: the rounds
//!   wait for it (its copy and catch-up), as a stall bounds the log.
//! - A backup table awaiting a copy applies no round (`ahead`); one that
//!   installed it is `behind` until it applies a round without CATCH_UP
//!   (the confirmation, or a round its primary waited for). Neither is
//!   ever served: an epoch that would have its lcore adopt the entry
//!   before then is refused as the part lost.
//! - A copy is idempotent: a backup table not awaiting one answers any
//!   fragment with its ACK of the whole and changes nothing, so a late or
//!   duplicated fragment never rolls back a round applied after it.
//! - At most [`WINDOW`] fragments past the last acknowledged are out at a
//!   time; the primary resends those on the replicas' timer.

use std::collections::VecDeque;
use std::sync::Arc;

use phub_proto::replica_rows::{
    read_copy_head, state_fragments, write_copy_head, write_state_fragment, CopyHead, RowReplicaRepr,
    RowReplicaType, StateFragment, STATE_BYTES,
};
use phub_proto::wire::{flags, DropReason};

use super::outbox::Pending;
use super::row_replica::{backup_table, queue_ack, queue_fragments, RoundRows, ServedEntry};
use super::table::{Table, TableRounds, TableStore};
use super::{Job, Shard, Verdict};
use crate::table::checkpoint::RowLoad;
use crate::table::snapshot::StreamError;

/// Fragments of a copy sent past the last one acknowledged, at most.
pub(super) const WINDOW: u32 = 32;

/// A copy's log of rounds may hold at least this many bytes of rows (and
/// at most the copy stream's size beyond it) before its backup is
/// counted at once.
pub(super) const LOG_MIN_BYTES: usize = 4 << 20;

/// A round the table completed while a copy ran, for its backup's
/// catch-up: its accumulated rows as its REPLICATE_ROWS carry them.
#[derive(Debug)]
pub(super) struct Logged {
    round: u32,
    at_ns: u64,
    ids: Vec<u64>,
    rows: Vec<f32>,
}

impl Logged {
    /// Its rows, of `dim` values each.
    fn rows(&self, dim: u32) -> RoundRows<'_> {
        RoundRows {
            dim,
            ids: &self.ids,
            rows: &self.rows,
            at_ns: self.at_ns,
        }
    }
}

/// Where a copy's stream comes from.
#[derive(Debug)]
pub(super) enum Source {
    /// Made whole at once: shared by a table's copies to several new
    /// backups, or made while the store streamed a checkpoint.
    Whole(Arc<[u8]>),
    /// Made a window at a time from the store's copy-on-write checkpoint
    /// stream (`RowStore::stream_begin`), begun with
    /// the copy: `buf` holds the copy stream's bytes from `base` (the first
    /// fragment not acknowledged) to the last made; `done` once the store's
    /// stream ended.
    Streamed { buf: Vec<u8>, base: u64, done: bool },
}

/// One table's state copy from this lcore (the entry's primary) to one new
/// backup.
#[derive(Debug)]
pub(super) struct CopyOut<A> {
    /// The backup appliance and its lcore keeping the entry.
    pub(super) backup: u16,
    pub(super) to: A,
    /// The table's key index.
    pub(super) key: u32,
    /// c: the table's last completed round, whose state the copy is.
    pub(super) round: u32,
    /// The copy stream, and its bytes B.
    stream: Source,
    total: u64,
    /// n, its fragments.
    pub(super) fragments: u32,
    /// Fragments the backup acknowledged holding from the first.
    pub(super) acked: u32,
    /// Fragments sent so far (first sends): `acked` ..= `fragments`.
    pub(super) sent: u32,
    /// When to resend the window, or once the copy is installed the
    /// catch-up round or confirmation out (0: at the next poll, which
    /// starts the timer).
    pub(super) deadline: u64,
    pub(super) resends: u8,
    /// The table's `dim`.
    dim: u32,
    /// The entry's rounds wait for this backup: from its confirmation on,
    /// or at once when its log outgrew its cap.
    pub(super) counted: bool,
    /// Rounds completed since `round` that the backup has not
    /// acknowledged, oldest first, and their rows' bytes.
    log: VecDeque<Logged>,
    log_bytes: usize,
    /// The last round the backup holds, as its ACKs said (`round` until
    /// it acknowledged a logged one).
    caught: u32,
}

impl<A: Copy> CopyOut<A> {
    /// Whether the backup installed the copy (it catches up, or is
    /// confirmed).
    fn installed(&self) -> bool {
        self.acked == self.fragments
    }

    /// Makes the stream's bytes up to fragment `upto` (exclusive) from
    /// `table`'s store, if they are not made yet.
    fn make(&mut self, table: &mut Table, upto: u32) -> Result<(), StreamError> {
        let need = (u64::from(upto) * STATE_BYTES as u64).min(self.total);
        let Source::Streamed { buf, base, done } = &mut self.stream else {
            return Ok(());
        };
        while *base + (buf.len() as u64) < need && !*done {
            // Cast: what is missing of a window, well below 4 GiB.
            #[allow(clippy::cast_possible_truncation)]
            let missing = (need - *base - buf.len() as u64) as usize;
            *done = table.store.stream_fill(buf, missing)?;
        }
        Ok(())
    }

    /// Fragment `f`'s bytes (made).
    fn fragment(&self, f: u32) -> &[u8] {
        let from = u64::from(f) * STATE_BYTES as u64;
        let to = (from + STATE_BYTES as u64).min(self.total);
        // Casts: within the stream's bytes, which are in memory.
        #[allow(clippy::cast_possible_truncation)]
        match &self.stream {
            Source::Whole(s) => &s[from as usize..to as usize],
            Source::Streamed { buf, base, .. } => &buf[(from - base) as usize..(to - base) as usize],
        }
    }

    /// The backup acknowledged `k` fragments: the bytes before them are
    /// not sent again.
    fn forget_before(&mut self, k: u32) {
        if let Source::Streamed { buf, base, .. } = &mut self.stream {
            let cut = (u64::from(k) * STATE_BYTES as u64)
                .min(self.total)
                .saturating_sub(*base);
            // Cast: at most the bytes held.
            #[allow(clippy::cast_possible_truncation)]
            let cut = (cut as usize).min(buf.len());
            buf.drain(..cut);
            *base += cut as u64;
        }
    }

    /// Whether the store's stream is still this copy's (begun, not ended).
    fn holds_store_stream(&self) -> bool {
        matches!(self.stream, Source::Streamed { done: false, .. })
    }

    /// The store's stream failed (a bug or no memory): the copy starts
    /// over, whole, at `table`'s state now.
    fn restart_whole(&mut self, table: &mut Table) {
        if self.holds_store_stream() {
            table.store.stream_abort();
        }
        let stream = copy_stream(table);
        let total = stream.len() as u64;
        *self = copy_out(self.backup, self.to, table, Source::Whole(stream), total);
        self.log_pending(table);
    }

    /// A round of `table` waiting for its other backups is not in a copy
    /// of its last completed round: it completes with the rows it holds,
    /// so it is the first logged.
    fn log_pending(&mut self, table: &Table) {
        if let Some((t, r)) = table
            .pending
            .and_then(|p| RoundRows::of(table, p.at_ns).map(|r| (p.round, r)))
        {
            let _ = self.log_round(t, r);
        }
    }
}

impl<A: Copy> CopyOut<A> {
    /// Makes the window's fragments up to `upto`: from the store's
    /// stream, or, where it fails, by starting over whole.
    fn make_or_restart(&mut self, table: &mut Table, upto: u32) {
        if self.make(table, upto).is_err() {
            self.restart_whole(table);
        }
    }

    /// Round `t` of the table completes (or waits for its other backups)
    /// with rows `r`: logged for this backup (`true`) unless it is
    /// counted; a round that would take the log past its cap counts it
    /// instead.
    pub(super) fn log_round(&mut self, t: u32, r: RoundRows<'_>) -> bool {
        if self.counted {
            return false;
        }
        let bytes = r.bytes();
        if self.log_bytes + bytes > LOG_MIN_BYTES.max(usize::try_from(self.total).unwrap_or(usize::MAX)) {
            self.counted = true;
            return false;
        }
        self.log_bytes += bytes;
        self.log.push_back(Logged {
            round: t,
            at_ns: r.at_ns,
            ids: r.ids.to_vec(),
            rows: r.rows.to_vec(),
        });
        true
    }
}

/// A copy arriving at a backup table awaiting it.
#[derive(Debug, Default)]
pub(super) struct CopyIn {
    round: u32,
    total: u64,
    fragments: u32,
    /// Bit f: fragment f is in.
    got: Vec<u64>,
    held: u32,
    /// Fragments held from the first without a gap.
    contiguous: u32,
    bytes: Vec<u8>,
    /// The copy read into a new store as its bytes come in order (its
    /// head parsed once fragment 0 is in), so that its install is not
    /// all done at its last fragment; `fed`: the stream's bytes taken.
    load: Option<(CopyHead, TableStore, RowLoad)>,
    fed: usize,
    /// The stream could not be read (a stream its primary wrote wrong):
    /// the copy is never installed.
    broken: bool,
}

impl CopyIn {
    fn has(&self, f: u32) -> bool {
        self.got[(f / 64) as usize] & (1 << (f % 64)) != 0
    }
}

/// `table`'s copy stream: the head (its store's idle clock), then its row
/// store's checkpoint.
pub(super) fn copy_stream(table: &Table) -> Arc<[u8]> {
    let (idle_rounds, samples) = table.store.idle_clock();
    let mut out = Vec::new();
    write_copy_head(&mut out, &CopyHead { idle_rounds, samples });
    let written = table.store.write_to(&mut out);
    debug_assert!(written.is_ok(), "writing into a Vec does not fail");
    out.into()
}

/// Who a copy's fragments are sent in the name of: job (`token`, `id`),
/// the entry's home (as REPLICATE_ROWS are) and the entry, in `epoch`.
#[derive(Debug, Clone, Copy)]
struct StateHead {
    job: (u64, u16),
    home: u16,
    entry: u32,
    epoch: u32,
}

impl StateHead {
    /// Job `job`'s (token, id) messages for served entry `s` in `epoch`.
    fn of<A>(job: (u64, u16), s: &ServedEntry<A>, epoch: u32) -> StateHead {
        StateHead {
            job,
            home: s.home,
            entry: s.entry,
            epoch,
        }
    }
}

/// Queues fragments `range` of `copy` (made) to its backup (`flags`: 0,
/// or RETRANSMIT); returns how many.
fn queue_state<A: Copy>(
    out: &mut Vec<u8>,
    pending: &mut Vec<Pending<A>>,
    head: StateHead,
    copy: &CopyOut<A>,
    range: std::ops::Range<u32>,
    flags: u8,
) -> u64 {
    let (dim, total) = (copy.dim, copy.total);
    for f in range.clone() {
        let bytes = copy.fragment(f);
        // Cast: a fragment holds at most STATE_BYTES (< 2^16) bytes.
        #[allow(clippy::cast_possible_truncation)]
        let repr = RowReplicaRepr {
            kind: RowReplicaType::TableState,
            flags,
            token: head.job.0,
            job: head.job.1,
            from: head.home,
            count: bytes.len() as u16,
            round: copy.round,
            entry: head.entry,
            key: copy.key,
            fragment: f,
            epoch: head.epoch,
        };
        let at = out.len();
        out.extend_from_slice(&repr.to_bytes());
        write_state_fragment(out, total, copy.fragments, dim, bytes);
        // Cast: the row outbox holds a burst's messages, far below 4 GiB.
        #[allow(clippy::cast_possible_truncation)]
        pending.push(Pending::Row {
            at: at as u32,
            len: (out.len() - at) as u32,
            to: copy.to,
        });
    }
    u64::from(range.end - range.start)
}

/// Queues copy `c`'s next catch-up message to its backup (`flags`: 0, or
/// RETRANSMIT): the oldest round of its log, with CATCH_UP, or when the
/// log is empty the confirmation (round `caught`, no rows, without
/// CATCH_UP); returns how many fragments.
fn queue_catch_up<A: Copy>(
    out: &mut Vec<u8>,
    pending: &mut Vec<Pending<A>>,
    head: StateHead,
    c: &CopyOut<A>,
    flags: u8,
) -> u64 {
    let (round, flags, rows) = match c.log.front() {
        Some(l) => (l.round, flags | flags::CATCH_UP, l.rows(c.dim)),
        None => (
            c.caught,
            flags,
            RoundRows {
                dim: c.dim,
                ids: &[],
                rows: &[],
                at_ns: 0,
            },
        ),
    };
    let repr = RowReplicaRepr {
        kind: RowReplicaType::Rows,
        flags,
        token: head.job.0,
        job: head.job.1,
        from: head.home,
        count: 0,
        round,
        entry: head.entry,
        key: c.key,
        fragment: 0,
        epoch: head.epoch,
    };
    queue_fragments(out, pending, repr, rows, std::iter::once(c.to))
}

/// New copies, none of it sent yet, of each of `tables` of entry `entry`
/// to each of `backups` (appliance, lcore address): a table copied to one
/// backup streams from its store's copy-on-write checkpoint stream as the
/// window moves (unless the store streams already: a checkpoint); one
/// copied to several, or that, is made whole at once and shared.
pub(super) fn copies_to<A: Copy>(tables: &mut [Table], entry: u32, backups: &[(u16, A)]) -> Vec<CopyOut<A>> {
    if backups.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for t in tables.iter_mut().filter(|t| t.entry() == entry) {
        let streamed = match backups {
            [_] if !t.store.streaming() => streamed_source(t),
            _ => None,
        };
        let (source, total) = streamed.unwrap_or_else(|| {
            let s = copy_stream(t);
            let total = s.len() as u64;
            (Source::Whole(s), total)
        });
        let mut sources = vec![source];
        for _ in 1..backups.len() {
            if let Source::Whole(s) = &sources[0] {
                sources.push(Source::Whole(s.clone()));
            }
        }
        for (&(b, at), source) in backups.iter().zip(sources) {
            let mut c = copy_out(b, at, t, source, total);
            c.log_pending(t);
            out.push(c);
        }
    }
    out
}

/// `table`'s copy stream begun from its store's checkpoint stream: the
/// head made, the rows to come; `None` when the store cannot stream.
fn streamed_source(table: &mut Table) -> Option<(Source, u64)> {
    let rows = table.store.stream_begin().ok()?;
    let (idle_rounds, samples) = table.store.idle_clock();
    let mut buf = Vec::new();
    write_copy_head(&mut buf, &CopyHead { idle_rounds, samples });
    let total = buf.len() as u64 + rows;
    Some((
        Source::Streamed {
            buf,
            base: 0,
            done: false,
        },
        total,
    ))
}

/// A new copy of `table` (its stream `stream`, `total` bytes) to backup
/// `backup` at `to`, none of it sent yet.
fn copy_out<A>(backup: u16, to: A, table: &Table, stream: Source, total: u64) -> CopyOut<A> {
    let round = match &table.rounds {
        TableRounds::Bsp(b) => b.completed,
        TableRounds::Clocked { .. } => 0,
    };
    CopyOut {
        backup,
        to,
        key: table.key,
        round,
        fragments: state_fragments(total).unwrap_or(1),
        stream,
        total,
        acked: 0,
        sent: 0,
        deadline: 0,
        resends: 0,
        dim: table.dim,
        counted: false,
        log: VecDeque::new(),
        log_bytes: 0,
        caught: round,
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// Job `i`'s tables were restored from its checkpoint (PROTOCOL.md
    /// §11.7 "Restored parts", §11.9): its backup tables hold none of the
    /// restored state, so they await their copies, and the entry served
    /// here copies every table to every backup, as to a new one (its
    /// rounds going on, logged for the catch-up).
    pub(super) fn start_restored_copies(&mut self, i: usize) {
        {
            let j = &mut self.jobs[i];
            let Some(rep) = j.replica.as_deref_mut().filter(|r| r.rows_replicated()) else {
                return;
            };
            for part in &mut rep.row_parts {
                for (_, inc) in &mut part.tables {
                    *inc = super::row_replica::Incoming::awaiting(true);
                }
            }
            for s in &mut rep.served {
                s.copies = copies_to(&mut j.tables, s.entry, &s.backups);
            }
            rep.next_deadline = 0;
        }
        self.send_copy_windows(i);
    }

    /// Sends each copy of job `i`'s served entries its window's fragments
    /// not sent yet (after an epoch change started them, or an ACK moved
    /// the window).
    pub(super) fn send_copy_windows(&mut self, i: usize) {
        let Shard {
            jobs,
            pending,
            rows_out,
            ..
        } = self;
        let Job {
            tables,
            replica,
            token,
            id,
            ..
        } = &mut jobs[i];
        let Some(rep) = replica.as_deref_mut() else {
            return;
        };
        let epoch = rep.view.epoch;
        for s in &mut rep.served {
            let head = StateHead::of((*token, *id), s, epoch);
            for c in &mut s.copies {
                let end = c.fragments.min(c.acked.saturating_add(WINDOW));
                if c.sent >= end {
                    continue;
                }
                let Some(t) = tables.iter_mut().find(|t| t.key == c.key && t.entry() == s.entry) else {
                    continue;
                };
                c.make_or_restart(t, end);
                let end = c.fragments.min(c.acked.saturating_add(WINDOW));
                let sent = queue_state(rows_out, pending, head, c, c.sent..end, 0);
                rep.stats.table_states_sent += sent;
                c.sent = end;
            }
        }
    }

    /// Resends the windows of job `i`'s copies whose timers ran out, within
    /// `budget` messages; returns what is left of it and the earliest
    /// deadline after.
    pub(super) fn poll_table_copies(&mut self, i: usize, now: u64, mut budget: usize) -> (usize, u64) {
        let Shard {
            jobs,
            pending,
            rows_out,
            ..
        } = self;
        let j = &mut jobs[i];
        let mut next = u64::MAX;
        let Some(rep) = j.replica.as_deref_mut() else {
            return (budget, next);
        };
        let epoch = rep.view.epoch;
        let mut timed_out = false;
        for s in &mut rep.served {
            let head = StateHead::of((j.token, j.id), s, epoch);
            for c in &mut s.copies {
                // Out: the window's fragments, or once installed the
                // catch-up round's (or the confirmation).
                let out = match c.log.front() {
                    _ if !c.installed() => (c.sent - c.acked) as usize,
                    Some(l) => {
                        phub_proto::replica_rows::fragments_of(l.ids.len(), c.dim).unwrap_or(1) as usize
                    }
                    None => 1,
                };
                if c.deadline == 0 {
                    c.deadline = now.saturating_add(rep.rtt.rto(0));
                } else if c.deadline <= now && budget >= out {
                    budget -= out;
                    c.deadline = rep.rtt.fire(&mut timed_out, &mut c.resends, now);
                    if c.installed() {
                        rep.stats.replicates_resent +=
                            queue_catch_up(rows_out, pending, head, c, flags::RETRANSMIT);
                    } else {
                        rep.stats.table_states_resent +=
                            queue_state(rows_out, pending, head, c, c.acked..c.sent, flags::RETRANSMIT);
                    }
                }
                next = next.min(c.deadline);
            }
        }
        (budget, next)
    }

    /// A fragment of a state copy at a backup table (checked by the caller
    /// up to the epoch): taken, and the copy installed once whole, an ACK
    /// of the fragments held queued; or, at a table not awaiting a copy,
    /// acknowledged whole again.
    pub(super) fn on_table_state(
        &mut self,
        i: usize,
        from: A,
        repr: &RowReplicaRepr,
        f: &StateFragment<'_>,
    ) -> Verdict {
        let Shard {
            jobs,
            pending,
            rows_out,
            ..
        } = self;
        let j = &mut jobs[i];
        let (token, id) = (j.token, j.id);
        let rep = j.replica.as_deref_mut().expect("checked by the caller");
        let (me, epoch) = (rep.me, rep.view.epoch);
        let (table, inc) = match backup_table(&mut rep.row_parts, from, repr, f.dim) {
            Ok(t) => t,
            Err(r) => return Verdict::Dropped(r),
        };
        let n = f.fragments;
        let last = repr.fragment + 1 == n;
        let expect = if last {
            f.total - u64::from(n - 1) * STATE_BYTES as u64
        } else {
            STATE_BYTES as u64
        };
        if repr.fragment >= n || f.bytes.len() as u64 != expect {
            return Verdict::Dropped(DropReason::CountMismatch);
        }
        let held = if inc.awaiting {
            match take_state(table, inc, repr, f) {
                Ok(held) => {
                    rep.stats.table_states_received += 1;
                    rep.stats.state_bytes_received += f.bytes.len() as u64;
                    if held == n {
                        rep.stats.table_states_installed += 1;
                    }
                    held
                }
                Err(r) => return Verdict::Dropped(r),
            }
        } else {
            // Installed already (the primary lost the ACK), or never
            // awaited in this epoch: the whole again, nothing changed.
            n
        };
        let ack = RowReplicaRepr {
            kind: RowReplicaType::TableStateAck,
            flags: 0,
            token,
            job: id,
            from: me,
            count: 0,
            round: repr.round,
            entry: repr.entry,
            key: repr.key,
            fragment: held,
            epoch,
        };
        rep.stats.table_state_acks_sent += 1;
        queue_ack(rows_out, pending, &ack, from);
        Verdict::Replicated
    }

    /// A new backup's ACK of a state copy at the entry's primary: the
    /// window moves on; all of it starts the backup's catch-up (the
    /// rounds logged meanwhile, then the confirmation).
    pub(super) fn on_table_state_ack(&mut self, i: usize, from: A, repr: &RowReplicaRepr) -> Verdict {
        let Shard {
            jobs,
            pending,
            rows_out,
            ..
        } = self;
        let j = &mut jobs[i];
        let rep = j.replica.as_deref_mut().expect("checked by the caller");
        let Some(s) = rep.served.iter_mut().find(|s| s.entry == repr.entry) else {
            return Verdict::Dropped(DropReason::WrongPeer);
        };
        if let Err(r) = s.backup_at(repr.from, from) {
            return Verdict::Dropped(r);
        }
        let head = StateHead::of((j.token, j.id), s, rep.view.epoch);
        let Some(c) = s
            .copies
            .iter_mut()
            .find(|c| c.backup == repr.from && c.key == repr.key)
        else {
            // Joined already: an ACK sent again.
            return Verdict::Dropped(DropReason::Duplicate);
        };
        if repr.round != c.round {
            return Verdict::Dropped(DropReason::Stale);
        }
        if repr.fragment > c.fragments {
            return Verdict::Dropped(DropReason::CountMismatch);
        }
        if repr.fragment <= c.acked {
            return Verdict::Dropped(DropReason::Duplicate);
        }
        c.acked = repr.fragment;
        c.sent = c.sent.max(c.acked);
        c.forget_before(c.acked);
        c.resends = 0;
        c.deadline = 0;
        if c.acked < c.fragments {
            self.send_copy_windows(i);
            return Verdict::Replicated;
        }
        // The backup holds the copy: it catches up on the rounds logged
        // meanwhile, or with none is confirmed, counted from now on.
        if c.log.is_empty() {
            c.counted = true;
        }
        rep.stats.replicates_sent += queue_catch_up(rows_out, pending, head, c, 0);
        rep.next_deadline = 0;
        Verdict::Replicated
    }

    /// A backup's REPLICATE_ROWS_ACK at the primary while it catches up
    /// after its copy (backup `k` of the entry, checked by the caller): of
    /// the logged round out, the next goes (or the confirmation, from
    /// which on it is counted); of the confirmation, it joins the entry's
    /// chain (the round pending, if any, goes to it).
    pub(super) fn on_catch_up_ack(&mut self, i: usize, k: usize, repr: &RowReplicaRepr) -> Verdict {
        let Shard {
            jobs,
            pending,
            rows_out,
            ..
        } = self;
        let j = &mut jobs[i];
        let rep = j.replica.as_deref_mut().expect("checked by the caller");
        let Some(t) = j
            .tables
            .iter()
            .position(|t| t.key == repr.key && t.entry() == repr.entry)
        else {
            return Verdict::Dropped(DropReason::UnknownTable);
        };
        let Some(s) = rep.served.iter_mut().find(|s| s.entry == repr.entry) else {
            return Verdict::Dropped(DropReason::WrongPeer);
        };
        let head = StateHead::of((j.token, j.id), s, rep.view.epoch);
        let Some(c) = s
            .copies
            .iter_mut()
            .find(|c| c.backup == repr.from && c.key == repr.key)
        else {
            return Verdict::Dropped(DropReason::Duplicate);
        };
        if !c.installed() {
            // No round goes to a backup before its copy is installed.
            return Verdict::Dropped(DropReason::Ahead);
        }
        let next = c.log.front().map_or(c.caught, |l| l.round);
        // A catch-up round's ACK carries CATCH_UP, the confirmation's not:
        // an ACK of the last round caught up, again, is no confirmation.
        if (repr.flags & flags::CATCH_UP != 0) == c.log.is_empty() {
            return Verdict::Dropped(DropReason::Duplicate);
        }
        if repr.round != next {
            return Verdict::Dropped(if repr.round < next {
                DropReason::Duplicate
            } else {
                DropReason::Ahead
            });
        }
        let backup = s.backups[k].1;
        let Some(l) = c.log.pop_front() else {
            // The confirmation's ACK: it joins.
            s.copies.retain(|c| !(c.backup == repr.from && c.key == repr.key));
            rep.stats.table_backups_joined += 1;
            let table = &j.tables[t];
            let release = table
                .pending
                .map(|p| (p.acked & (1 << k) != 0, s.all_acked(table.key, p.acked)));
            return match release {
                Some((false, _)) => {
                    self.send_pending_to(i, t, backup);
                    Verdict::Replicated
                }
                Some((true, true)) => {
                    self.complete_pending(i, t);
                    Verdict::Completed
                }
                _ => Verdict::Replicated,
            };
        };
        c.log_bytes -= l.rows(c.dim).bytes();
        c.caught = l.round;
        c.resends = 0;
        c.deadline = 0;
        if c.log.is_empty() {
            // Every round completed is on it: the confirmation goes, and
            // no round completes without it from now on.
            c.counted = true;
        }
        rep.stats.replicates_sent += queue_catch_up(rows_out, pending, head, c, 0);
        rep.next_deadline = 0;
        // A logged round still pending (waiting for the other backups):
        // this backup has it too.
        let table = &mut j.tables[t];
        let mut release = false;
        if let Some(p) = table.pending.as_mut().filter(|p| p.round == l.round) {
            p.acked |= 1 << k;
            release = s.all_acked(table.key, p.acked);
        }
        if release {
            self.complete_pending(i, t);
            return Verdict::Completed;
        }
        Verdict::Replicated
    }
}

/// Takes fragment `f` of a copy at backup table `table` awaiting one:
/// the fragments held from the first without a gap after it (all of them
/// once the copy is installed).
fn take_state(
    table: &mut Table,
    inc: &mut super::row_replica::Incoming,
    repr: &RowReplicaRepr,
    f: &StateFragment<'_>,
) -> Result<u32, DropReason> {
    let n = f.fragments;
    let c = inc.copy.get_or_insert_with(Box::default);
    if c.round != repr.round || c.total != f.total || c.fragments != n || c.got.is_empty() {
        // A copy of another round (or shape) than the fragments gathered
        // so far: it starts over.
        let Ok(total) = usize::try_from(f.total) else {
            return Err(DropReason::CountTooLarge);
        };
        **c = CopyIn {
            round: repr.round,
            total: f.total,
            fragments: n,
            got: vec![0; (n as usize).div_ceil(64)],
            bytes: Vec::new(),
            ..CopyIn::default()
        };
        c.bytes.resize(total, 0);
    }
    if c.has(repr.fragment) {
        return Ok(c.contiguous);
    }
    let at = repr.fragment as usize * STATE_BYTES;
    c.bytes[at..at + f.bytes.len()].copy_from_slice(f.bytes);
    c.got[(repr.fragment / 64) as usize] |= 1 << (repr.fragment % 64);
    c.held += 1;
    while c.contiguous < n && c.has(c.contiguous) {
        c.contiguous += 1;
    }
    feed_contiguous(table, c);
    if c.held < n {
        return Ok(c.contiguous);
    }
    let copy = inc.copy.take().expect("gathered above");
    install_copy(table, *copy).map_err(|_| DropReason::CountMismatch)?;
    inc.awaiting = false;
    // The rounds its primary completed meanwhile come next (CATCH_UP),
    // then the confirmation.
    inc.behind = true;
    inc.clear();
    Ok(n)
}

/// Feeds copy `c`'s bytes held from the first without a gap, and not fed
/// yet, into its new store (begun once its head is in), spreading the
/// install's work over the fragments' arrivals; a stream that cannot be
/// read marks the copy broken.
fn feed_contiguous(table: &Table, c: &mut CopyIn) {
    if c.broken {
        return;
    }
    // Cast: within the stream's bytes, which are in memory.
    #[allow(clippy::cast_possible_truncation)]
    let end = (u64::from(c.contiguous) * STATE_BYTES as u64).min(c.total) as usize;
    if c.load.is_none() {
        if end == 0 {
            return;
        }
        let (Ok((head, rows)), Ok(store)) = (read_copy_head(&c.bytes[..end]), table.store.empty_like())
        else {
            c.broken = true;
            return;
        };
        c.fed = end - rows.len();
        let load = store.load_begin();
        c.load = Some((head, store, load));
    }
    if let Some((_, store, load)) = c.load.as_mut() {
        if c.fed < end && load.feed(store, &c.bytes[c.fed..end]).is_err() {
            c.broken = true;
        }
        c.fed = end;
    }
}

/// Replaces backup table `table`'s state with copy `copy`, all of it in
/// and fed. On an error (a stream its primary wrote wrong: a bug, not a
/// network fault, which the fragments' checks catch) the table is left
/// as it was, still awaiting, and the copy never completes: the job stays
/// short of full strength, which `copies.awaiting` shows.
fn install_copy(table: &mut Table, copy: CopyIn) -> Result<(), String> {
    let round = copy.round;
    let (false, Some((head, mut store, load))) = (copy.broken, copy.load) else {
        return Err("the state copy's stream could not be read".into());
    };
    load.finish(&mut store).map_err(|e| e.to_string())?;
    store.set_idle_clock(head.idle_rounds, &head.samples)?;
    table.store = store;
    let d = table.dim as usize;
    if let TableRounds::Bsp(b) = &mut table.rounds {
        b.clear(d);
        b.completed = round;
    }
    for r in &mut table.ranks {
        r.clear_round();
    }
    Ok(())
}

impl<A: Copy> Job<A> {
    /// Makes every copy that streams from its table's store (PROTOCOL.md
    /// §11.9 item 4) whole in memory, freeing the store's one stream (a
    /// checkpoint is about to take it).
    pub(super) fn finish_copy_streams(&mut self) {
        let Job { tables, replica, .. } = self;
        let Some(rep) = replica.as_deref_mut() else {
            return;
        };
        for s in &mut rep.served {
            for c in s.copies.iter_mut().filter(|c| c.holds_store_stream()) {
                if let Some(t) = tables.iter_mut().find(|t| t.key == c.key && t.entry() == s.entry) {
                    c.make_or_restart(t, c.fragments);
                }
            }
        }
    }
}

/// Ends the store streams of `copies` (of entry `entry`'s `tables`) that
/// are about to be dropped: those `keep` refuses.
pub(super) fn end_dropped_streams<A: Copy>(
    copies: &[CopyOut<A>],
    tables: &mut [Table],
    entry: u32,
    keep: impl Fn(&CopyOut<A>) -> bool,
) {
    for c in copies.iter().filter(|c| c.holds_store_stream() && !keep(c)) {
        if let Some(t) = tables.iter_mut().find(|t| t.key == c.key && t.entry() == entry) {
            t.store.stream_abort();
        }
    }
}
