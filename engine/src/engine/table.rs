//! A job's table keys on one lcore (PROTOCOL.md §10): what the lcore is
//! told of each ([`TableInstall`]), its record ([`Table`]: the row store,
//! the placement check, each rank's round state) and what it costs.
//!
//! Every (table, lcore) keeps its own rounds (BSP, `rows.rs`) or each
//! rank's clock (async and bounded delay, `row_clock.rs`). The state per
//! rank is a [`RowRank`]: the bitmap `got[r]` of the sequence numbers of
//! its ROW_PUSH messages of the round (clock) in progress, the count
//! `n[r]` its ROW_END stated, and, not BSP, its applied clock and whether
//! its ROW_DONE is held. A BSP round's accumulator ([`BspRound`]) holds one
//! `f32` row per id pushed in the round, in the order the ids first
//! arrived, and each ROW_PUSH's ids until the round completes; its buffers
//! keep their capacity from round to round, so a steady load allocates
//! nothing (a round far smaller than the largest recent one gives the
//! excess back, [`BspRound::clear`]).
//!
//! Invariants:
//! - every stored or answered row is one this lcore's entry holds under
//!   the placement (PROTOCOL.md §10.1): a message with one id placed
//!   elsewhere is dropped whole before any id is used;
//! - BSP: `got[r]` holds no sequence number at or above `n[r]`, and a
//!   round completes exactly when every rank's `got[r]` is `0 .. n[r]`;
//! - not BSP: a rank's ROW_DONE is held only in bounded delay, for its
//!   applied clock, and then its `got[r]` and `n[r]` are empty.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::num::NonZeroU32;

use phub_proto::memory::{lcore_rows_cap, table_bytes};
use phub_proto::placement::{mix64, reduce, row_hash, table_key};
use phub_proto::rows::{ids_signature, CacheRef, Ids, MAX_ROW_MESSAGES};
use phub_proto::spec::ROW_ID_BYTES;
use phub_proto::spec::{rows_per_datagram, Consistency, Evict, RowInitSpec, RowOptimizerSpec, TableSpec};
use phub_proto::wire::DropReason;
use phub_proto::Dtype;

use crate::table::{Admission, Init, RowOptimizer, RowStore, StoreConfig, TableInit};

use super::error::EngineError;

/// What an lcore is told of one table key of a job at install.
#[derive(Debug, Clone, PartialEq)]
pub struct TableInstall {
    /// The table's key index k in the spec's keys (dense and table keys
    /// counted alike): what its messages carry in `key`.
    pub key: u32,
    /// The table as the spec declares it.
    pub spec: TableSpec,
    /// The job's `chunk_bytes`: a datagram carries at most
    /// `rows_per_datagram(chunk_bytes, dim, dtype)` rows (R).
    pub chunk_bytes: u32,
    /// L, the job's lcores over all its appliances (PROTOCOL.md §10.1).
    pub lcores: u32,
    /// This lcore's entry e among them: appliance i's lcore j is the sum
    /// of the earlier appliances' lcores plus j.
    pub entry: u32,
}

/// The bitmap of the sequence numbers 0 .. [`MAX_ROW_MESSAGES`] of one
/// rank's ROW_PUSH messages of a round: 128 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct SeqSet([u64; MAX_ROW_MESSAGES as usize / 64]);

impl SeqSet {
    /// Whether `s` is in the set (false for `s` >= [`MAX_ROW_MESSAGES`]).
    pub(super) fn contains(&self, s: u32) -> bool {
        s < MAX_ROW_MESSAGES && self.0[(s / 64) as usize] & (1 << (s % 64)) != 0
    }
    pub(super) fn insert(&mut self, s: u32) {
        debug_assert!(s < MAX_ROW_MESSAGES, "sequence number {s} checked before");
        self.0[(s / 64) as usize % self.0.len()] |= 1 << (s % 64);
    }
    pub(super) fn len(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
    /// Whether some member is `n` or more.
    pub(super) fn any_at_or_above(&self, n: u32) -> bool {
        (n..MAX_ROW_MESSAGES).any(|s| self.contains(s))
    }
    /// The bitmap's words (bit s of word s / 64), as a checkpoint keeps them.
    pub(super) fn words(&self) -> [u64; MAX_ROW_MESSAGES as usize / 64] {
        self.0
    }
    pub(super) fn from_words(words: [u64; MAX_ROW_MESSAGES as usize / 64]) -> SeqSet {
        SeqSet(words)
    }
    /// Whether the set is exactly 0 .. n.
    pub(super) fn is_first(&self, n: u32) -> bool {
        self.len() == n && (n == 0 || self.contains(n - 1)) && !self.any_at_or_above(n)
    }
}

/// One rank's round state on one (table, lcore).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RowRank {
    /// `got[r]`: the sequence numbers of its ROW_PUSH messages of the
    /// round (clock) in progress.
    pub(super) got: SeqSet,
    /// `n[r]`: the count its ROW_END of that round stated.
    pub(super) n: Option<u16>,
    /// Not BSP: its applied clock a[r] (0 at install).
    pub(super) applied: u32,
    /// Bounded delay: the count of its applied clock's ROW_END while its
    /// ROW_DONE is held.
    pub(super) held: Option<u16>,
    /// Its part of the round in progress was closed by an empty round
    /// (a ROW_END with n = 0) over copies of its own messages the lcore
    /// had already taken (PROTOCOL.md §10.6): complete with what was
    /// taken; later messages of the round are duplicates (BSP). Not BSP,
    /// the clock then completes at once.
    pub(super) closed: bool,
}

impl RowRank {
    /// Whether the rank has sent all its rows of the round: `n[r]` is set
    /// and `got[r]` is 0 .. `n[r]`.
    pub(super) fn complete(&self) -> bool {
        self.closed || self.n.is_some_and(|n| self.got.is_first(u32::from(n)))
    }
    /// Whether the lcore holds part of the rank's round in progress that
    /// an empty round (n = 0) contradicts: a push, or a count other than 0.
    pub(super) fn holds_part(&self) -> bool {
        self.n.is_some_and(|n| n != 0) || self.got.len() > 0
    }
    pub(super) fn clear_round(&mut self) {
        self.got = SeqSet::default();
        self.n = None;
        self.closed = false;
    }
}

/// The hasher of the accumulator's id map: ids are mixed once
/// ([`mix64`]), as the placement mixes them.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = mix64(id ^ 0x9e37_79b9_7f4a_7c15);
    }
}

/// One ROW_PUSH of a BSP round in progress: whose, which, and where its
/// rows' places in the accumulator are in [`BspRound::push_slots`].
#[derive(Debug, Clone, Copy)]
pub(super) struct PushIds {
    pub(super) rank: u16,
    pub(super) seq: u16,
    pub(super) start: u32,
    pub(super) len: u16,
    /// Its key-cache prefix, which its answer carries instead of its ids
    /// (PROTOCOL.md §10.7).
    pub(super) cache: Option<CacheRef>,
}

/// One message's ids with rows read (an answer's, from the store's
/// batched read) or gradients decoded (an async ROW_PUSH's, for the
/// store's batched update; a BSP one's, for the round's accumulator): at
/// most R of each, the capacity taken at install.
#[derive(Debug, Default)]
pub(super) struct RowBatch {
    pub(super) ids: Vec<u64>,
    pub(super) rows: Vec<f32>,
    /// A push's gradients, decoded
    /// ([`super::rows::Answers::rows_after_push`], `rows::accumulate`).
    pub(super) grads: Vec<f32>,
}

impl RowBatch {
    /// `rows`' gradients, `dim` values each, decoded into `grads` in one
    /// call (their length was checked when the message was parsed).
    pub(super) fn decode_grads(&mut self, rows: &phub_proto::rows::Rows<'_>, dim: usize) {
        self.grads.clear();
        rows.decode_extend(&mut self.grads);
        debug_assert_eq!(
            self.grads.len(),
            rows.len() * dim,
            "parse() checked the rows' length"
        );
    }
}

/// A BSP (table, lcore)'s rounds: the last completed one and the
/// accumulator of the one in progress.
#[derive(Debug, Default)]
pub(super) struct BspRound {
    /// The last completed round c (0 at install: a table has no round 0).
    pub(super) completed: u32,
    /// Each id of the round to its row in `acc_rows`.
    pub(super) index: HashMap<u64, u32, BuildHasherDefault<IdHasher>>,
    /// The round's ids in the order they first arrived.
    pub(super) ids: Vec<u64>,
    /// Their accumulated rows, `dim` values each, in that order.
    pub(super) rows: Vec<f32>,
    /// The round's ROW_PUSH messages as they arrived.
    pub(super) pushes: Vec<PushIds>,
    /// Their rows' places in `ids` (and rows in `rows`), message after
    /// message.
    pub(super) push_slots: Vec<u32>,
    /// At completion: the rows after the round's update, in the order of
    /// `ids`, from which each rank's answers are copied. Its length is the
    /// most a round of it held: kept from round to round (each round's
    /// update writes its part whole), not zeroed again each round.
    pub(super) after: Vec<f32>,
}

/// Rows' worth of room a BSP round's buffers always keep ([`BspRound::clear`]).
const ROUND_KEEP_ROWS: usize = 4096;
/// A round that held fewer than 1/`ROUND_SHRINK_BELOW` of the rows its
/// buffers have room for shrinks them ([`BspRound::clear`]).
const ROUND_SHRINK_BELOW: usize = 8;

impl BspRound {
    /// Forgets the round (the one just completed, or the one in progress
    /// when a table's state is loaded). Its buffers keep their capacity
    /// (a steady load allocates nothing), unless the round held fewer
    /// than 1/[`ROUND_SHRINK_BELOW`] of the rows they have room for (and
    /// that room is above [`ROUND_KEEP_ROWS`] rows): then they shrink to
    /// twice what it held. A round far larger than the others (a first
    /// one creating a table's rows, say) would otherwise leave its id map
    /// that large for good, and every later round would clear all of it
    /// and miss the cache on each id (`bsp_round_bench -- 300 115712`:
    /// 141-148 ns per pushed row after rounds of 115,712 rows per rank,
    /// 76-85 with the shrink; BENCHMARKS.md), and its buffers would hold
    /// that memory.
    pub(super) fn clear(&mut self, dim: usize) {
        let (held, pushed) = (self.ids.len(), self.push_slots.len());
        let shrink = self.ids.capacity() > ROUND_KEEP_ROWS.max(ROUND_SHRINK_BELOW * held);
        self.index.clear();
        self.ids.clear();
        self.rows.clear();
        self.pushes.clear();
        self.push_slots.clear();
        if shrink {
            let keep = ROUND_KEEP_ROWS.max(2 * held);
            self.index.shrink_to(keep);
            self.ids.shrink_to(keep);
            self.rows.shrink_to(keep * dim);
            self.after.truncate(keep * dim);
            self.after.shrink_to(keep * dim);
            self.push_slots.shrink_to(ROUND_KEEP_ROWS.max(2 * pushed));
        }
    }
}

/// How a table's rounds go, by the job's consistency mode.
#[derive(Debug)]
pub(super) enum TableRounds {
    /// BSP: rounds complete when every rank has sent its rows.
    Bsp(Box<BspRound>),
    /// Async (`delay` none) or bounded delay τ: each push applied at once,
    /// clocks per rank.
    Clocked {
        /// τ, in bounded delay.
        delay: Option<u32>,
    },
}

/// One lcore's key cache of a table (PROTOCOL.md §10.7): per rank,
/// `slots` id lists of up to R ids, each kept as its wire bytes with its
/// signature and count (0: empty). Allocated whole at install, so storing
/// and naming lists allocates nothing; [`phub_proto::memory::key_cache_bytes`] is its size.
#[derive(Debug, Default)]
pub(super) struct IdCache {
    slots: u32,
    /// R: the most ids one list holds.
    per: usize,
    /// Rank r's slot i holds its ids at `(r * slots + i) * per * 8`.
    ids: Vec<u8>,
    sigs: Vec<u64>,
    lens: Vec<u16>,
}

impl IdCache {
    fn new(workers: u16, slots: u32, per: u32) -> IdCache {
        let lists = usize::from(workers) * slots as usize;
        IdCache {
            slots,
            per: per as usize,
            ids: vec![0; lists * per as usize * ROW_ID_BYTES],
            sigs: vec![0; lists],
            lens: vec![0; lists],
        }
    }

    /// The index of `rank`'s slot `slot`: `bad_signature` beyond the
    /// table's `key_cache`.
    fn index(&self, rank: u16, slot: u32) -> Result<usize, DropReason> {
        if slot >= self.slots {
            return Err(DropReason::BadSignature);
        }
        Ok(usize::from(rank) * self.slots as usize + slot as usize)
    }

    /// Keeps a KEYS_STORE message's `ids` in `rank`'s slot, replacing what
    /// it held: `bad_signature` when the slot is beyond the cache, there
    /// are no ids, or the signature is not theirs.
    pub(super) fn store(&mut self, rank: u16, r: CacheRef, ids: Ids<'_>) -> Result<(), DropReason> {
        let i = self.index(rank, r.slot)?;
        let n = u16::try_from(ids.len()).map_err(|_| DropReason::BadRowCount)?;
        if n == 0 || ids.len() > self.per || ids_signature(ids.iter()) != r.sig {
            return Err(DropReason::BadSignature);
        }
        let bytes = ids.as_bytes();
        let at = i * self.per * ROW_ID_BYTES;
        self.ids[at..at + bytes.len()].copy_from_slice(bytes);
        self.sigs[i] = r.sig;
        self.lens[i] = n;
        Ok(())
    }

    /// The `count` ids `rank`'s slot holds under signature `r.sig`:
    /// `unknown_signature` when it holds another list (or none).
    pub(super) fn get(&self, rank: u16, r: CacheRef, count: u16) -> Result<Ids<'_>, DropReason> {
        let i = self.index(rank, r.slot)?;
        if self.lens[i] == 0 || self.lens[i] != count || self.sigs[i] != r.sig {
            return Err(DropReason::UnknownSignature);
        }
        let at = i * self.per * ROW_ID_BYTES;
        let ids = Ids::from_bytes(&self.ids[at..at + usize::from(count) * ROW_ID_BYTES]);
        // A whole number of ids: count * 8 bytes.
        ids.ok_or(DropReason::UnknownSignature)
    }

    /// Bytes it holds: ids, signatures and counts.
    fn bytes(&self) -> u64 {
        (self.ids.len() + self.sigs.len() * 8 + self.lens.len() * 2) as u64
    }
}

/// One lcore's store of one table.
pub(super) type TableStore = RowStore<TableInit, RowOptimizer>;

/// One table of a job on one lcore (module head).
#[derive(Debug)]
pub(super) struct Table {
    /// Its key index k.
    pub(super) key: u32,
    /// D.
    pub(super) dim: u32,
    /// R: the most rows (or ROW_PULL ids) one message carries.
    pub(super) per: u32,
    /// Placement: the table's key `tk`, L and this lcore's entry.
    tk: u64,
    lcores: u32,
    entry: u32,
    /// The rows.
    pub(super) store: TableStore,
    /// Each rank's round state, W of them.
    pub(super) ranks: Vec<RowRank>,
    pub(super) rounds: TableRounds,
    /// A message's pairs: a ROW_PUSH's decoded, an answer's read.
    pub(super) batch: RowBatch,
    /// Each rank's cached id lists (PROTOCOL.md §10.7).
    pub(super) id_cache: IdCache,
    /// A replicated job's BSP round waiting for the entry's backups
    /// (PROTOCOL.md §11.9).
    pub(super) pending: Option<super::row_replica::RowPending>,
}

/// The row optimizer a table's spec names.
pub fn row_optimizer(spec: &RowOptimizerSpec) -> RowOptimizer {
    match *spec {
        RowOptimizerSpec::Sum => RowOptimizer::Sum,
        RowOptimizerSpec::Sgd { lr } => RowOptimizer::Sgd { lr },
        RowOptimizerSpec::Adagrad {
            lr,
            eps,
            initial_accumulator,
            rowwise,
        } => RowOptimizer::Adagrad {
            lr,
            eps,
            initial_accumulator,
            rowwise,
        },
        RowOptimizerSpec::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => RowOptimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        },
        RowOptimizerSpec::Ftrl { alpha, beta, l1, l2 } => RowOptimizer::Ftrl { alpha, beta, l1, l2 },
    }
}

/// The initial values a table's spec names.
pub fn row_init(spec: &RowInitSpec) -> Init {
    match *spec {
        RowInitSpec::Zeros => Init::Zeros,
        RowInitSpec::Uniform { a, b } => Init::Uniform { a, b },
        RowInitSpec::Normal { std } => Init::Normal { std },
    }
}

/// What a table's record and a rank's round state cost beside the store
/// ([`phub_proto::memory::MemoryModel::table_record_bytes`] and
/// `table_rank_bytes`): checked against the types in the shard's
/// constructor.
pub(super) const TABLE_RECORD_BYTES: u32 = 2048;
pub(super) const TABLE_RANK_BYTES: u32 = 192;

impl Table {
    /// Table `t` of job `id` with `workers` ranks of `dtype` on this lcore,
    /// in `consistency`, or why it cannot be served here.
    pub(super) fn new(
        id: u16,
        t: &TableInstall,
        workers: u16,
        dtype: Dtype,
        consistency: Consistency,
    ) -> Result<Table, EngineError> {
        let refuse = |field: &str, value: String, want: &str| EngineError::Table {
            id,
            key: t.key,
            reason: format!("{field} = {value}: {want}"),
        };
        let spec = &t.spec;
        if t.lcores == 0 || t.entry >= t.lcores {
            return Err(refuse(
                "entry",
                format!("{} of {} lcores", t.entry, t.lcores),
                "an entry below the job's lcore count L >= 1",
            ));
        }
        let per = rows_per_datagram(t.chunk_bytes, spec.dim, dtype);
        if per == 0 {
            return Err(refuse(
                "dim",
                spec.dim.to_string(),
                "a row and its id that fit one datagram of chunk_bytes",
            ));
        }
        let Some(rows_cap) = lcore_rows_cap(spec, t.lcores) else {
            return Err(refuse(
                "rows",
                "none".into(),
                "a cap, 1 to 2^40: a served table's store is sized by it",
            ));
        };
        let (idle_rounds, idle_seconds) = match spec.evict {
            None => (None, None),
            Some(Evict::IdleRounds(n)) => (NonZeroU32::new(n), None),
            Some(Evict::IdleSeconds(s)) => (None, NonZeroU32::new(s)),
        };
        let admission = match spec.admit_after {
            None | Some(0 | 1) => Admission::Always,
            Some(n) => Admission::AfterPushes(
                u16::try_from(n).map_err(|_| refuse("admit_after", n.to_string(), "1 to 65535"))?,
            ),
        };
        let opt = row_optimizer(&spec.optimizer);
        opt.check()
            .map_err(|e| refuse("optimizer", spec.optimizer.name().into(), &e.to_string()))?;
        let init = TableInit::new(row_init(&spec.init), spec.seed, t.key)
            .map_err(|e| refuse("init", format!("{:?}", spec.init), &e.to_string()))?;
        let tk = table_key(spec.seed, t.key);
        let config = StoreConfig {
            dim: spec.dim,
            rows_cap,
            admission,
            idle_rounds,
            idle_seconds,
            // Keyed by the table and this lcore, so two lcores' indexes
            // (and two tables') hash the same ids differently.
            hash_key: mix64(tk ^ u64::from(t.entry)),
        };
        let store = RowStore::new(config, init, opt).map_err(|e| EngineError::Table {
            id,
            key: t.key,
            reason: e.to_string(),
        })?;
        let rounds = match consistency {
            Consistency::Sync => TableRounds::Bsp(Box::default()),
            Consistency::Async => TableRounds::Clocked { delay: None },
            Consistency::Bounded { delay } => TableRounds::Clocked { delay: Some(delay) },
        };
        Ok(Table {
            key: t.key,
            dim: spec.dim,
            per,
            tk,
            lcores: t.lcores,
            entry: t.entry,
            store,
            ranks: vec![RowRank::default(); usize::from(workers)],
            rounds,
            batch: RowBatch {
                ids: Vec::with_capacity(per as usize),
                rows: Vec::with_capacity(per as usize * spec.dim as usize),
                grads: Vec::with_capacity(per as usize * spec.dim as usize),
            },
            id_cache: IdCache::new(workers, spec.key_cache, per),
            pending: None,
        })
    }

    /// The entry e whose rows this table holds (PROTOCOL.md §10.1).
    pub(super) fn entry(&self) -> u32 {
        self.entry
    }

    /// Whether the placement puts row `id` on this lcore.
    pub(super) fn holds(&self, id: u64) -> bool {
        reduce(row_hash(self.tk, id), self.lcores) == self.entry
    }

    /// Bytes this table holds on the lcore as admission charges them: its
    /// store at its cap ([`table_bytes`]), its record, its ranks' and its
    /// key cache (as [`phub_proto::memory::key_cache_bytes`] charges it).
    pub(super) fn memory_bytes(&self) -> u64 {
        table_bytes(&self.store.shape())
            + u64::from(TABLE_RECORD_BYTES)
            + self.ranks.len() as u64 * u64::from(TABLE_RANK_BYTES)
            + self.id_cache.bytes()
    }

    /// The slowest applied clock over the ranks (not BSP).
    pub(super) fn slowest(&self) -> u32 {
        self.ranks.iter().map(|r| r.applied).min().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fills `round` as a round of `n` distinct ids of `dim` values would.
    fn hold(round: &mut BspRound, n: u32, dim: usize) {
        for i in 0..n {
            let id = u64::from(i) * 7919;
            round.index.insert(id, i);
            round.ids.push(id);
            round.rows.extend(std::iter::repeat_n(1.0, dim));
            round.push_slots.push(i);
        }
        round.after.resize(round.rows.len(), 0.0);
    }

    #[test]
    fn a_round_far_smaller_than_the_largest_gives_the_room_back() {
        let dim = 4;
        let mut round = BspRound::default();
        hold(&mut round, 200_000, dim);
        round.clear(dim);
        assert!(
            round.ids.capacity() >= 200_000,
            "the round held as much: room kept"
        );
        hold(&mut round, 1000, dim);
        round.clear(dim);
        // Twice the round's rows, at least ROUND_KEEP_ROWS.
        assert!(
            round.ids.capacity() < 2 * ROUND_KEEP_ROWS,
            "{}",
            round.ids.capacity()
        );
        assert!(
            round.index.capacity() < 2 * ROUND_KEEP_ROWS,
            "{}",
            round.index.capacity()
        );
        assert!(round.rows.capacity() < 2 * ROUND_KEEP_ROWS * dim);
        assert!(round.after.capacity() < 2 * ROUND_KEEP_ROWS * dim);
        assert!(round.push_slots.capacity() < 2 * ROUND_KEEP_ROWS);
        // Rounds of the same size then keep what they have.
        let room = (
            round.ids.capacity(),
            round.index.capacity(),
            round.rows.capacity(),
        );
        for _ in 0..3 {
            hold(&mut round, 3000, dim);
            round.clear(dim);
            assert_eq!(
                (
                    round.ids.capacity(),
                    round.index.capacity(),
                    round.rows.capacity()
                ),
                room
            );
        }
        assert!(round.index.is_empty() && round.ids.is_empty() && round.rows.is_empty());
    }
}
