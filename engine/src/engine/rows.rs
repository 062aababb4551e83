//! Table messages (PROTOCOL.md §10.2, §10.3): their checks, in §10.3's
//! order, and the BSP round rules; the answers (ROW_RESULT, ROW_DONE,
//! ROW_PULL_RESULT) built whole into the shard's row outbox.
//!
//! Checks, dropping at the first failure: the header checks of §7 step 1
//! with §10.2's lengths ([`phub_proto::rows::parse`]); `not_for_appliance`;
//! `evicted`, `unknown_job`, `bad_token`, `shutting_down`, then the SHM
//! flag (`no_shared_memory`: table messages always carry their payload);
//! `rank_out_of_range`, `dtype_mismatch`, `unknown_table`, `dim_mismatch`,
//! `bad_row_count` (more than R rows or ids), `row_out_of_place` (every id
//! checked before any is used); then the round rules, here for BSP and in
//! `row_clock.rs` for async and bounded delay.
//!
//! BSP, per (table, lcore), a ROW_PUSH of round t, sequence s from rank r:
//! t = 0 is `wrong_type_for_round`; t = the round in progress adds each
//! pair into its id's accumulator row unless r is complete there or s is
//! already in `got[r]` (`duplicate`) or s is beyond 1024 or `n[r]`
//! (`bad_row_count`); t = the last completed round or an older one is
//! answered again (the message's own ids with their current rows),
//! beyond is `ahead`. A ROW_END sets
//! `n[r]` (a second, other count is `bad_row_count`, the same count
//! `duplicate`), but an empty one (n = 0) from a rank the lcore already
//! holds part of the round of closes that rank's part with what it took
//! (a worker catching a restored lcore up, PROTOCOL.md §10.6; later
//! messages of its round are `duplicate`). When every rank is complete, each accumulated row goes
//! through the table's optimizer once, in the order its id first arrived,
//! and every rank gets its ROW_RESULTs and its ROW_DONE.
//!
//! The answers' bytes (header and payload) are written into
//! `Shard::answers_out` as they are queued (written over without zeroing,
//! [`AnswerBytes`]) and sent from there; it keeps its capacity between
//! bursts, as the pending list does.

use phub_proto::row_ops::{add_row, copy_row, extend_row};
use phub_proto::rows::{
    self, CacheRef, Ids, KeyCache, RowMsgType, RowPayload, RowPayloadKind, RowRepr, Rows, KEY_CACHE_PREFIX,
    MAX_ROW_MESSAGES,
};
use phub_proto::spec::ROW_ID_BYTES;
use phub_proto::wire::{flags, DropReason, Header, MsgType, Repr, APPLIANCE_RANK, HEADER_LEN};

use crate::counters::ShardCounters;

use super::outbox::{AnswerBytes, Pending};
use super::replica::Replica;
use super::row_replica;
use super::table::{IdCache, PushIds, RowBatch, Table, TableRounds, TableStore};
use super::{Job, Shard, Verdict};

/// Where row answers go while one message is handled: the row outbox,
/// the pending list, the job's endpoints and the header fields every
/// answer of the table shares.
pub(super) struct Answers<'a, A> {
    /// The row outbox, where a replicated round's messages to its backups
    /// are written (`row_replica::begin`).
    pub(super) out: &'a mut Vec<u8>,
    /// Where the answers are written.
    pub(super) answers: &'a mut AnswerBytes,
    pub(super) pending: &'a mut Vec<Pending<A>>,
    pub(super) counters: &'a ShardCounters,
    pub(super) endpoints: &'a [Option<A>],
    /// The job's dtype, token and id, the table's dim and key.
    pub(super) head: RowRepr,
    /// The receive-buffer share the answers state.
    pub(super) share: u32,
    /// The clock `handle` got (a completed round's time, for `idle_s`).
    pub(super) now: u64,
    /// A replicated job's: the entry the answers are for and the
    /// appliance's epoch, in their headers (PROTOCOL.md §11.9); 0 and 0
    /// otherwise.
    pub(super) entry: u32,
    pub(super) epoch: u32,
}

/// Which answer an [`Answers`] call queues: its kind, the rank it goes
/// to, its round (or clock) and sequence number, the key-cache prefix it
/// carries instead of its ids (PROTOCOL.md §10.7) and its flags (0, or
/// FIRST_COPY on an answer sent at once to a first copy,
/// [`rows::answer_flags`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct AnswerTo {
    pub(super) kind: RowMsgType,
    pub(super) rank: u16,
    pub(super) round: u32,
    pub(super) seq: u32,
    pub(super) cache: Option<CacheRef>,
    pub(super) flags: u8,
}

impl AnswerTo {
    /// The answer of `kind` to the message `repr`, stating `round`: to
    /// its rank, with its sequence number, key-cache prefix and flags.
    pub(super) fn reply(repr: &RowRepr, kind: RowMsgType, round: u32) -> AnswerTo {
        AnswerTo {
            kind,
            rank: repr.rank,
            round,
            seq: repr.seq,
            cache: repr.cache.reference(),
            flags: rows::answer_flags(repr),
        }
    }
}

impl<A: Copy> Answers<'_, A> {
    /// Queues answer `to` with `ids` and their rows as `table` holds them
    /// now (a row not stored reads as its initial value).
    pub(super) fn rows<I>(&mut self, store: &mut TableStore, batch: &mut RowBatch, to: AnswerTo, ids: I)
    where
        I: Iterator<Item = u64>,
    {
        batch.ids.clear();
        batch.ids.extend(ids);
        let fill = |s: &mut TableStore, ids: &[u64], _: &[f32], out: &mut [f32]| s.read_batch(ids, out);
        self.rows_of_batch(store, batch, to, fill);
    }

    /// An async push of `batch.ids` with the gradients `batch.grads`
    /// (`dim` each, in order): applied to `store`, answered as
    /// [`Answers::rows`] answers (ROW_RESULT with the rows after it),
    /// where an f32 table's rows are copied into the answer by the update
    /// pass itself ([`TableStore::update_batch_into`]). Applied whatever
    /// happens to the answer.
    pub(super) fn rows_after_push(&mut self, store: &mut TableStore, batch: &mut RowBatch, to: AnswerTo) {
        if !self.rows_of_batch(store, batch, to, TableStore::update_batch_into) {
            // Not answered (no endpoint, or no room): applied all the same.
            store.update_batch(&batch.ids, &batch.grads);
        }
    }

    /// Answer `to` with `batch.ids`, their rows written into the answer by
    /// `fill(store, ids, grads, out)` (`grads`: `batch.grads`); false when
    /// there is no answer to write (`fill` not run).
    fn rows_of_batch(
        &mut self,
        store: &mut TableStore,
        batch: &mut RowBatch,
        to: AnswerTo,
        fill: impl FnOnce(&mut TableStore, &[u64], &[f32], &mut [f32]),
    ) -> bool {
        let Some(addr) = self.endpoints.get(usize::from(to.rank)).copied().flatten() else {
            return false;
        };
        let d = store.dim();
        let count = batch.ids.len();
        // Cast: at most R rows, R < 2^16 (a datagram's payload).
        #[allow(clippy::cast_possible_truncation)]
        let repr = RowRepr {
            kind: to.kind,
            count: count as u16,
            round: to.round,
            seq: to.seq,
            flags: to.flags,
            cache: to.cache.map_or(KeyCache::Off, KeyCache::Cached),
            ..self.head
        };
        let dtype = repr.dtype;
        let len = repr.payload_len();
        debug_assert!(len.is_some(), "an answer as long as its request fits a datagram");
        let Some(len) = len else { return false };
        // Each answer starts where its payload's rows (past a header of
        // HEADER_LEN bytes, then ids or a prefix, 4-byte multiples) fall on
        // a 4-byte boundary of the outbox, so that f32 rows are read
        // straight into it (the bytes between answers are never sent).
        let at = (self.answers.len() + HEADER_LEN).next_multiple_of(4) - HEADER_LEN;
        let msg = self.answers.room(at, HEADER_LEN + len);
        let (head, mut payload) = msg.split_at_mut(HEADER_LEN);
        // The room holds an earlier burst's bytes: `emit` writes every
        // byte of the header (its preamble zeroes the fields a table
        // answer leaves), and the payload is written whole below.
        let mut h = Header::new_unchecked(head);
        repr.emit(&mut h);
        h.set_rx_share(self.share);
        h.set_entry(self.entry);
        h.set_epoch(self.epoch);
        let mut written_ids = count;
        if let Some(r) = to.cache {
            let (prefix, rest) = payload.split_at_mut(KEY_CACHE_PREFIX);
            rows::write_prefix(r, prefix);
            payload = rest;
            written_ids = 0;
        }
        let (id_bytes, row_bytes) = payload.split_at_mut(written_ids * ROW_ID_BYTES);
        for (id, dst) in batch.ids.iter().zip(id_bytes.chunks_exact_mut(ROW_ID_BYTES)) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        // The rows by `fill` (the store's pipeline, their index entries
        // and rows fetched ahead, or a copy): straight into the payload
        // where the wire holds them as this machine's f32 and the bytes
        // are aligned for it, else into `batch.rows` and encoded from there.
        let RowBatch { ids, rows, grads } = batch;
        match bytemuck::try_cast_slice_mut::<u8, f32>(row_bytes) {
            Ok(values) if dtype == phub_proto::Dtype::F32 && cfg!(target_endian = "little") => {
                fill(store, ids, grads, values);
            }
            _ => {
                rows.clear();
                rows.resize(count * d, 0.0);
                fill(store, ids, grads, rows);
                phub_proto::dtype::encode(dtype, rows, row_bytes);
            }
        }
        self.queue(at, HEADER_LEN + len, addr);
        true
    }

    /// Queues a ROW_DONE of `round` with count `n` to `rank`.
    pub(super) fn done(&mut self, rank: u16, round: u32, n: u16) {
        let Some(to) = self.endpoints.get(usize::from(rank)).copied().flatten() else {
            return;
        };
        let repr = RowRepr {
            kind: RowMsgType::RowDone,
            count: 0,
            round,
            seq: u32::from(n),
            ..self.head
        };
        let at = self.answers.len();
        // `emit` writes every byte of the header (as for the answers with
        // rows: the room holds an earlier burst's bytes).
        let mut h = Header::new_unchecked(self.answers.room(at, HEADER_LEN));
        repr.emit(&mut h);
        h.set_rx_share(self.share);
        h.set_entry(self.entry);
        h.set_epoch(self.epoch);
        self.queue(at, HEADER_LEN, to);
    }

    /// Queues the answer written at bytes `at .. at + len` of the answer
    /// outbox, to `to`.
    fn queue(&mut self, at: usize, len: usize, to: A) {
        self.counters.results_sent.inc();
        // Cast: the outbox holds a burst's answers, far below 4 GiB.
        #[allow(clippy::cast_possible_truncation)]
        self.pending.push(Pending::Answer {
            at: at as u32,
            len: len as u32,
            to,
        });
    }
}

/// The header fields every answer about `table` of job `job` (its
/// `dtype` and `token`) shares (PROTOCOL.md §10.2); each answer sets its
/// kind, count, round and sequence number.
pub(super) fn answer_head(dtype: phub_proto::Dtype, token: u64, job: u16, table: &Table) -> RowRepr {
    RowRepr {
        kind: RowMsgType::RowDone,
        dtype,
        flags: 0,
        token,
        job,
        rank: APPLIANCE_RANK,
        count: 0,
        round: 0,
        dim: table.dim,
        key: table.key,
        seq: 0,
        cache: KeyCache::Off,
    }
}

/// The ERROR answering a refused table message: its header, type ERROR,
/// no payload, the reason's code (PROTOCOL.md §5.7, §10.2).
pub(super) fn row_error(repr: &RowRepr, reason: DropReason) -> Repr {
    Repr {
        kind: MsgType::Error,
        dtype: repr.dtype,
        flags: 0,
        token: repr.token,
        job: repr.job,
        rank: repr.rank,
        count: 0,
        error: reason.code(),
        round: repr.round,
        slot: repr.dim,
        key: repr.key,
        chunk: repr.seq,
    }
}

/// The ids of a message's payload (none for ROW_END).
fn ids_of<'a>(payload: &RowPayload<'a>) -> Option<Ids<'a>> {
    match payload {
        RowPayload::Rows(r) => Some(r.ids()),
        RowPayload::Ids(i) => Some(*i),
        RowPayload::Empty | RowPayload::Cached(_) => None,
    }
}

/// The message's payload with its ids where they are (PROTOCOL.md
/// §10.7): a KEYS_STORE message's ids kept in the sender's slot first
/// (`bad_signature` if the prefix is wrong), a KEYS_CACHED message's
/// taken from its slot (`unknown_signature` if the slot holds another
/// list).
fn resolve<'a>(
    cache: &'a mut IdCache,
    repr: &RowRepr,
    payload: RowPayload<'a>,
) -> Result<RowPayload<'a>, DropReason> {
    match (repr.cache, payload) {
        (KeyCache::Off, p) => Ok(p),
        (KeyCache::Store(r), p) => {
            let ids = ids_of(&p).ok_or(DropReason::BadSignature)?;
            cache.store(repr.rank, r, ids)?;
            Ok(p)
        }
        (KeyCache::Cached(r), RowPayload::Cached(values)) => {
            let ids = cache.get(repr.rank, r, repr.count)?;
            match repr.kind.payload() {
                RowPayloadKind::Rows => Rows::with_ids(ids, values, repr.dim, repr.dtype)
                    .map(RowPayload::Rows)
                    .ok_or(DropReason::LengthMismatch),
                RowPayloadKind::Ids => Ok(RowPayload::Ids(ids)),
                RowPayloadKind::Empty => Err(DropReason::BadSignature),
            }
        }
        (KeyCache::Cached(_), _) => Err(DropReason::LengthMismatch),
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// Handles one table message (module head): the checks, then the
    /// round rules of the job's consistency mode.
    pub(super) fn classify_row(&mut self, from: A, datagram: &[u8], now: u64) -> Verdict {
        let (repr, payload) = match rows::parse(datagram) {
            Ok(p) => p,
            Err(r) => return Verdict::Dropped(r),
        };
        if !repr.kind.from_worker() {
            return Verdict::Dropped(DropReason::NotForAppliance);
        }
        let known = self.jobs.iter().position(|j| j.id == repr.job);
        let token_ok = known.is_some_and(|i| self.jobs[i].token == repr.token);
        if !token_ok && !self.evicted.is_empty() && self.was_evicted(repr.job, repr.token, now) {
            return self.refuse_row(from, &repr, DropReason::Evicted);
        }
        let Some(i) = known else {
            return Verdict::Dropped(DropReason::UnknownJob);
        };
        if !token_ok {
            return Verdict::Dropped(DropReason::BadToken);
        }
        if self.closing {
            return self.refuse_row(from, &repr, DropReason::ShuttingDown);
        }
        if repr.flags & flags::SHM != 0 {
            return Verdict::Dropped(DropReason::NoSharedMemory);
        }
        let share = self.rx_share(&self.jobs[i]);
        let job = &mut self.jobs[i];
        if repr.rank >= job.workers || !job.members.contains(repr.rank) {
            return Verdict::Dropped(DropReason::RankOutOfRange);
        }
        // A replicated job's table message names its entry and the epoch
        // it was routed by (PROTOCOL.md §11.9): another epoch is refused
        // with this one (fencing, §11.6).
        let (entry, epoch) = {
            let h = Header::new_unchecked(datagram);
            (h.entry(), h.epoch())
        };
        let replicated = job.replica.as_deref().map(|r| r.view.epoch);
        if let Some(installed) = replicated {
            if epoch != installed {
                if let Some(r) = job.replica.as_deref_mut() {
                    r.count_worker_wrong_epoch();
                }
                return self.refuse_row_at(from, &repr, DropReason::WrongEpoch, entry, installed);
            }
        }
        // Authenticated from here on: remember where this rank lives.
        let rank = usize::from(repr.rank);
        job.endpoints[rank] = Some(from);
        job.last_seen[rank] = now;
        match Self::check_row(job, &repr, &payload, replicated.map(|_| entry)) {
            Ok(t) => {
                let Shard {
                    jobs,
                    pending,
                    rows_out,
                    answers_out,
                    counters,
                    ..
                } = self;
                let job = &mut jobs[i];
                let Job {
                    tables,
                    endpoints,
                    replica,
                    counters: job_counters,
                    dtype,
                    token,
                    id,
                    ..
                } = job;
                let table = &mut tables[t];
                // Taken out while the message is handled, so that its ids
                // may be read from it beside the table's other state.
                let mut cache = std::mem::take(&mut table.id_cache);
                let resolved = resolve(&mut cache, &repr, payload);
                let mut answers = Answers {
                    out: rows_out,
                    answers: answers_out,
                    pending,
                    counters,
                    endpoints,
                    head: answer_head(*dtype, *token, *id, table),
                    share,
                    now,
                    entry: if replicated.is_some() { entry } else { 0 },
                    epoch: replicated.unwrap_or(0),
                };
                let done = resolved.and_then(|payload| match (repr.kind, &table.rounds) {
                    (RowMsgType::RowPull, _) => Ok(pull(table, &repr, &payload, &mut answers)),
                    (_, TableRounds::Bsp(_)) => {
                        bsp(table, &repr, &payload, &mut answers, replica.as_deref_mut())
                    }
                    (_, TableRounds::Clocked { .. }) => table.clocked(&repr, &payload, &mut answers),
                });
                table.id_cache = cache;
                match done {
                    Ok(v) => {
                        let push = repr.kind == RowMsgType::RowPush;
                        match v {
                            Verdict::Aggregated | Verdict::Applied | Verdict::Forwarded if push => {
                                job_counters.pushes += 1;
                                counters.pushes_aggregated.inc();
                            }
                            Verdict::Completed | Verdict::Held => {
                                job_counters.rounds += 1;
                                counters.rounds_completed.inc();
                                if push {
                                    job_counters.pushes += 1;
                                    counters.pushes_aggregated.inc();
                                }
                                if v == Verdict::Held {
                                    counters.answers_held.inc();
                                }
                            }
                            Verdict::Resent => counters.results_resent.inc(),
                            Verdict::Pulled => counters.pulls_answered.inc(),
                            _ => {}
                        }
                        v
                    }
                    Err(r) => self.refuse_row_at(from, &repr, r, entry, replicated.unwrap_or(0)),
                }
            }
            Err(r) => self.refuse_row_at(from, &repr, r, entry, replicated.unwrap_or(0)),
        }
    }

    /// Step (4) of §10.3's checks past the rank: the table this message
    /// is for (its index in the job's tables), or why it is dropped.
    /// `entry`: a replicated job's message's, which must be an entry
    /// served here (`wrong_peer`).
    fn check_row(
        job: &Job<A>,
        repr: &RowRepr,
        payload: &RowPayload<'_>,
        entry: Option<u32>,
    ) -> Result<usize, DropReason> {
        if repr.dtype != job.dtype {
            return Err(DropReason::DtypeMismatch);
        }
        let t = job
            .tables
            .iter()
            .position(|t| t.key == repr.key)
            .ok_or(DropReason::UnknownTable)?;
        let t = match entry {
            None => t,
            Some(e) => job
                .tables
                .iter()
                .position(|t| t.key == repr.key && t.entry() == e)
                .ok_or(DropReason::WrongPeer)?,
        };
        let table = &job.tables[t];
        if repr.dim != table.dim {
            return Err(DropReason::DimMismatch);
        }
        if u32::from(repr.count) > table.per {
            return Err(DropReason::BadRowCount);
        }
        if let Some(ids) = ids_of(payload) {
            if !ids.iter().all(|id| table.holds(id)) {
                return Err(DropReason::RowOutOfPlace);
            }
        }
        Ok(t)
    }

    /// Refuses a table message: an ERROR back where the reason tells the
    /// sender ([`DropReason::notifies_sender`]).
    fn refuse_row(&mut self, from: A, repr: &RowRepr, reason: DropReason) -> Verdict {
        self.refuse_row_at(from, repr, reason, 0, 0)
    }

    /// [`Shard::refuse_row`] for a replicated job: the ERROR names the
    /// message's entry and the appliance's epoch (PROTOCOL.md §11.9).
    fn refuse_row_at(
        &mut self,
        from: A,
        repr: &RowRepr,
        reason: DropReason,
        entry: u32,
        epoch: u32,
    ) -> Verdict {
        if reason.notifies_sender() {
            self.counters.errors_sent.inc();
            self.pending.push(Pending::Error {
                repr: row_error(repr, reason),
                epoch,
                entry,
                to: from,
            });
        }
        Verdict::Dropped(reason)
    }
}

/// A ROW_PULL: its ids with their current rows, `round` the last
/// completed round (BSP) or the rank's last answered clock.
fn pull<A: Copy>(
    table: &mut Table,
    repr: &RowRepr,
    payload: &RowPayload<'_>,
    answers: &mut Answers<'_, A>,
) -> Verdict {
    let Some(ids) = ids_of(payload) else {
        return Verdict::Dropped(DropReason::LengthMismatch);
    };
    let round = match &table.rounds {
        TableRounds::Bsp(b) => b.completed,
        TableRounds::Clocked { .. } => {
            let r = table.ranks[usize::from(repr.rank)];
            if r.held.is_some() {
                r.applied.saturating_sub(1)
            } else {
                r.applied
            }
        }
    };
    let to = AnswerTo::reply(repr, RowMsgType::RowPullResult, round);
    answers.rows(&mut table.store, &mut table.batch, to, ids.iter());
    Verdict::Pulled
}

/// Where a BSP message's round stands against the table's.
enum Age {
    Zero,
    InProgress,
    LastCompleted,
    Stale,
    Ahead,
}

fn age(t: u32, completed: u32) -> Age {
    if t == 0 {
        Age::Zero
    } else if Some(t) == completed.checked_add(1) {
        Age::InProgress
    } else if t == completed {
        Age::LastCompleted
    } else if t < completed {
        Age::Stale
    } else {
        Age::Ahead
    }
}

/// The BSP rules of a ROW_PUSH or ROW_END (module head).
fn bsp<A: Copy>(
    table: &mut Table,
    repr: &RowRepr,
    payload: &RowPayload<'_>,
    answers: &mut Answers<'_, A>,
    rep: Option<&mut Replica<A>>,
) -> Result<Verdict, DropReason> {
    let TableRounds::Bsp(round) = &table.rounds else {
        unreachable!("bsp() is called for BSP tables");
    };
    let r = usize::from(repr.rank);
    let (t, s) = (repr.round, repr.seq);
    let verdict = match (repr.kind, age(t, round.completed)) {
        (_, Age::Zero) => return Err(DropReason::WrongTypeForRound),
        (_, Age::Ahead) => return Err(DropReason::Ahead),
        // A round completed here: the last, its answers lost; or an older
        // one, which a rank that rejoined pushes again when the messages
        // its former incarnation left in flight completed rounds after it
        // asked where the table stood (simulator seed 365177: dropped
        // `stale`, the push waited for ever). Answered with the rows as
        // they are; nothing is added (PROTOCOL.md §10.3 rules 3 and 4).
        (RowMsgType::RowPush, Age::LastCompleted | Age::Stale) => {
            let RowPayload::Rows(rows) = payload else {
                return Err(DropReason::LengthMismatch);
            };
            let to = AnswerTo::reply(repr, RowMsgType::RowResult, t);
            answers.rows(&mut table.store, &mut table.batch, to, rows.ids().iter());
            return Ok(Verdict::Resent);
        }
        (_, Age::LastCompleted | Age::Stale) => {
            // A ROW_END of a completed round: its ROW_DONE again.
            // Cast: s <= 1024 was the count of that round.
            #[allow(clippy::cast_possible_truncation)]
            answers.done(repr.rank, t, s.min(MAX_ROW_MESSAGES) as u16);
            return Ok(Verdict::Resent);
        }
        // The rank's part is complete (or closed): anything more of it in
        // this round is a copy, answered once the round completes, even
        // with another count or sequence number: a new incarnation of the
        // rank (a rejoin) pushes again a round its former one sent, with
        // other rows, or after an empty round closed it (PROTOCOL.md
        // §10.3; simulator seed 313394).
        (_, Age::InProgress) if table.ranks[r].complete() => return Err(DropReason::Duplicate),
        (RowMsgType::RowPush, Age::InProgress) => {
            let rank = table.ranks[r];
            if s >= MAX_ROW_MESSAGES || rank.n.is_some_and(|n| s >= u32::from(n)) {
                return Err(DropReason::BadRowCount);
            }
            if rank.got.contains(s) {
                return Err(DropReason::Duplicate);
            }
            let RowPayload::Rows(rows) = payload else {
                return Err(DropReason::LengthMismatch);
            };
            accumulate(table, repr, rows);
            table.ranks[r].got.insert(s);
            Verdict::Aggregated
        }
        (_, Age::InProgress) if s == 0 && table.ranks[r].holds_part() => {
            // An empty round (a worker catching a restored lcore up,
            // PROTOCOL.md §10.6) over copies of the rank's own messages of
            // this round that the lcore took after its restore: the rank's
            // part closes with what was taken.
            table.ranks[r].closed = true;
            Verdict::Aggregated
        }
        (_, Age::InProgress) => {
            end_round(&mut table.ranks[r], s)?;
            Verdict::Aggregated
        }
    };
    if table.ranks.iter().all(|r| r.complete()) {
        // A replicated job's round waits for the entry's backups
        // (PROTOCOL.md §11.9): its fragments go to them, and it completes
        // at their last acknowledgement.
        let head = (answers.head.token, answers.head.job);
        if row_replica::begin(head, rep, table, t, answers.now, answers.out, answers.pending) {
            return Ok(Verdict::Forwarded);
        }
        complete(table, t, answers);
        return Ok(Verdict::Completed);
    }
    Ok(verdict)
}

/// A ROW_END of count `n` for the round (clock) in progress: `n[r]` is
/// set, or the message is refused (PROTOCOL.md §10.3).
pub(super) fn end_round(rank: &mut super::table::RowRank, n: u32) -> Result<(), DropReason> {
    if n > MAX_ROW_MESSAGES {
        return Err(DropReason::BadRowCount);
    }
    match rank.n {
        Some(m) if u32::from(m) == n => return Err(DropReason::Duplicate),
        Some(_) => return Err(DropReason::BadRowCount),
        None => {}
    }
    // A ROW_PUSH already taken with a sequence number the count leaves
    // out: the count contradicts the pushes (`bad_row_count`).
    if rank.got.any_at_or_above(n) {
        return Err(DropReason::BadRowCount);
    }
    // Cast: n <= 1024, checked above.
    #[allow(clippy::cast_possible_truncation)]
    let n = n as u16;
    rank.n = Some(n);
    Ok(())
}

/// Adds a ROW_PUSH's pairs into the round's accumulator, in order: the
/// message's rows converted in one pass, then an id's first row of the
/// round copied, later ones added element by element.
fn accumulate(table: &mut Table, repr: &RowRepr, rows: &Rows<'_>) {
    let Table {
        rounds, batch, dim, ..
    } = table;
    let TableRounds::Bsp(round) = rounds else {
        unreachable!("accumulate() is called for BSP tables");
    };
    // A table's dim is at least 1 (spec validation).
    let d = *dim as usize;
    batch.decode_grads(rows, d);
    let start = round.push_slots.len();
    for (id, row) in rows.ids().iter().zip(batch.grads.chunks_exact(d)) {
        // Cast: a round holds at most W x 1024 x R rows, far below 2^32.
        #[allow(clippy::cast_possible_truncation)]
        let next = round.ids.len() as u32;
        let at = *round.index.entry(id).or_insert(next);
        round.push_slots.push(at);
        if at == next {
            round.ids.push(id);
            extend_row(&mut round.rows, row);
        } else {
            let at = at as usize;
            add_row(&mut round.rows[at * d..(at + 1) * d], row);
        }
    }
    // Casts: s < 1024; a message has at most R < 2^16 rows; the round's
    // rows fit a u32 (above).
    #[allow(clippy::cast_possible_truncation)]
    round.pushes.push(PushIds {
        rank: repr.rank,
        seq: repr.seq as u16,
        start: start as u32,
        len: (round.push_slots.len() - start) as u16,
        cache: repr.cache.reference(),
    });
}

/// Round `t` completes (every rank complete): each accumulated row goes
/// through the optimizer once, in first-arrival order; then each rank gets
/// its ROW_RESULTs in sequence order and its ROW_DONE; the round's state
/// is cleared.
///
/// The update pass copies each row after it into the round's `after`
/// ([`TableStore::update_distinct_into`]: the round's ids are distinct),
/// and the answers' rows are copied from there, once per message row,
/// instead of each being looked up again: the rows a read after the round
/// gives, also when the round's idle sweep evicted rows (then they are
/// read again).
pub(super) fn complete<A: Copy>(table: &mut Table, t: u32, answers: &mut Answers<'_, A>) {
    let Table {
        store,
        batch,
        rounds,
        ranks,
        dim,
        ..
    } = table;
    let TableRounds::Bsp(round) = rounds else {
        unreachable!("complete() is called for BSP tables");
    };
    let d = *dim as usize;
    let n = round.ids.len() * d;
    // Zeroed only where it grows: the update writes its first n values.
    if round.after.len() < n {
        round.after.resize(n, 0.0);
    }
    let after = &mut round.after[..n];
    // The round's rows go through the store's pipeline: their index
    // entries and rows are fetched from memory ahead of their updates.
    store.update_distinct_into(&round.ids, &round.rows[..n], after);
    if store.advance_round_at(answers.now) > 0 {
        store.read_batch(&round.ids, after);
    }
    // Each distinct row was counted read once; the answers give
    // `push_slots.len()` rows.
    store.count_lookups((round.push_slots.len() - round.ids.len()) as u64);
    round.pushes.sort_unstable_by_key(|p| (p.rank, p.seq));
    let after = &round.after[..n];
    for p in &round.pushes {
        let slots = &round.push_slots[p.start as usize..p.start as usize + usize::from(p.len)];
        batch.ids.clear();
        batch.ids.extend(slots.iter().map(|&s| round.ids[s as usize]));
        let to = AnswerTo {
            kind: RowMsgType::RowResult,
            rank: p.rank,
            round: t,
            seq: u32::from(p.seq),
            cache: p.cache,
            flags: 0,
        };
        answers.rows_of_batch(store, batch, to, |_, _, _, out| {
            for (row, &s) in out.chunks_exact_mut(d.max(1)).zip(slots) {
                copy_row(row, &after[s as usize * d..][..d]);
            }
        });
    }
    // Cast: r < W <= 256.
    #[allow(clippy::cast_possible_truncation)]
    for (r, rank) in ranks.iter_mut().enumerate() {
        answers.done(r as u16, t, rank.n.unwrap_or(0));
        rank.clear_round();
    }
    round.clear(d);
    round.completed = t;
}

#[cfg(test)]
mod tests {
    use super::super::table::SeqSet;
    use super::*;
    use phub_proto::Dtype;

    #[test]
    fn a_seq_set_is_first_n_exactly() {
        let mut s = SeqSet::default();
        assert!(s.is_first(0));
        s.insert(1);
        assert!(!s.is_first(1) && !s.is_first(2));
        s.insert(0);
        assert!(s.is_first(2));
        s.insert(1023);
        assert!(!s.is_first(3) && s.any_at_or_above(2) && !s.contains(1024));
    }

    #[test]
    fn ages_of_rounds() {
        assert!(matches!(age(0, 0), Age::Zero));
        assert!(matches!(age(1, 0), Age::InProgress));
        assert!(matches!(age(2, 0), Age::Ahead));
        assert!(matches!(age(3, 3), Age::LastCompleted));
        assert!(matches!(age(2, 3), Age::Stale));
    }

    #[test]
    fn an_error_echoes_the_table_header() {
        let repr = RowRepr {
            kind: RowMsgType::RowPush,
            dtype: Dtype::Bf16,
            flags: 1,
            token: 9,
            job: 3,
            rank: 2,
            count: 5,
            round: 7,
            dim: 16,
            key: 4,
            seq: 11,
            cache: KeyCache::Off,
        };
        let e = row_error(&repr, DropReason::DimMismatch);
        assert_eq!((e.kind, e.count, e.error, e.flags), (MsgType::Error, 0, 26, 0));
        assert_eq!((e.round, e.slot, e.key, e.chunk, e.rank), (7, 16, 4, 11, 2));
    }
}
