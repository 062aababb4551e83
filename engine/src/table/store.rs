//! One lcore's store of one table: [`RowStore`].
//!
//! Rows are created on their first push (values from the table's
//! [`RowInit`], state from its [`RowUpdate::init_state`]), then updated in
//! place by [`RowUpdate::apply`]; an id not stored reads as its initial
//! values and costs no memory. Parts, one concept per file:
//!
//! - [`super::index`]: the id index (open addressing, its own keyed hash);
//! - [`super::blocks`]: the row slots, in 2 MiB blocks allocated as the
//!   table grows;
//! - [`super::evict`]: CLOCK at the cap, the idle sweep;
//! - [`super::admit`]: admission counting (`admit_after`);
//! - [`super::checkpoint`]: streamed save and restore;
//! - [`super::snapshot`]: a checkpoint streamed while the store serves.
//!
//! Invariants: rows stored + free slots = slots handed out <= the cap; a
//! row is in the index exactly when its slot is in use; the store's
//! allocations never exceed, and at the cap equal,
//! [`phub_proto::memory::table_bytes`] of its shape (the index and the
//! block table are allocated at creation, a row block when the first row
//! of it is handed out). A push or a read never allocates except for that
//! block; a failed block allocation drops the push and counts it.
//!
//! Batched forms ([`RowStore::update_batch`], [`RowStore::read_batch`]) do
//! exactly what the one-id forms would do id by id, in order, but run a
//! pipeline ahead of them: hash and prefetch the index entry of the id
//! `2 * AHEAD` ahead, look up the id `AHEAD` ahead and prefetch its row,
//! so that the batch's memory misses overlap. The look-ahead only
//! prefetches; each id's own step looks it up again, in cache.

use std::num::NonZeroU32;

use phub_proto::memory::{table_bytes, TableShape, TABLE_MAX_ROWS};
use phub_proto::row_ops::copy_row;

use super::admit::AdmitCounts;
use super::blocks::Blocks;
use super::evict::{Clock, IdleSweep, RoundTimes};
use super::index::{touch_word, Index, Probe};
use super::{RowInit, RowUpdate};

/// Ids between the index prefetch and the row prefetch, and between the
/// row prefetch and the update, in the batched forms.
const AHEAD: usize = 8;
/// Hashes kept for the pipeline (a power of two above `2 * AHEAD`).
const RING: usize = 32;

/// One id's place in the batched forms' pipeline: its hash, and where
/// the row prefetch's probe found it with the index's removal count then
/// (still its position while that count holds: [`Index::removals`]).
#[derive(Debug, Clone, Copy, Default)]
struct Staged {
    hash: u64,
    found: Option<(usize, u64)>,
}

impl Staged {
    /// The probe's result if it still holds in `index`.
    #[inline]
    fn probe(&self, index: &Index, id: u64) -> Probe {
        match self.found {
            Some((pos, removals)) if removals == index.removals() => Probe::Found(pos),
            _ => index.probe(id, self.hash),
        }
    }
}

/// Panics unless a batch of `ids` of `dim` values each comes `with` (or
/// goes `into`) `values` values.
fn check_batch(ids: &[u64], dim: usize, with: &str, values: usize) {
    assert_eq!(
        values,
        ids.len() * dim,
        "{} ids of dim {dim} {with} {values} values",
        ids.len()
    );
}

/// Rounds are kept modulo 2^31 (the touch word's round bits).
const ROUND_MASK: u32 = u32::MAX >> 1;

/// When a row is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// On its first push.
    Always,
    /// On the N-th push of its id (N >= 2); the earlier ones are dropped
    /// and counted (`admit_after = N`, [`super::admit`]).
    AfterPushes(u16),
}

/// How a store is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// f32 values per row.
    pub dim: u32,
    /// Most rows stored at once; at the cap a new row evicts one (CLOCK).
    pub rows_cap: u64,
    /// When a row is stored.
    pub admission: Admission,
    /// Evict rows not updated for this many rounds (`evict = { idle_rounds
    /// = N }`); `None`: only at the cap.
    pub idle_rounds: Option<NonZeroU32>,
    /// Evict rows not updated for this many seconds (`evict = { idle_s = S
    /// }`, by the clock [`RowStore::advance_round_at`] is given); `None`:
    /// not by time. At most one of `idle_rounds` and `idle_seconds`.
    pub idle_seconds: Option<NonZeroU32>,
    /// The index's hash key (e.g. from the job seed, table and lcore).
    pub hash_key: u64,
}

/// A store that cannot be set up.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// `dim` is 0.
    #[error("table dim = 0: a row needs at least 1 value")]
    ZeroDim,
    /// `rows` is 0 or over what one lcore can hold.
    #[error("table rows cap = {0} on one lcore: accepted 1 to {max}", max = TABLE_MAX_ROWS)]
    RowsCap(u64),
    /// `admit_after` is under 2 (use [`Admission::Always`]).
    #[error("admit_after = {0}: accepted 2 to 65535 (1 or none: store on the first push)")]
    AdmitAfter(u16),
    /// `idle_rounds` is 2^30 or more (rounds are kept modulo 2^31).
    #[error("evict idle_rounds = {0}: accepted 1 to {max}", max = 1u32 << 30)]
    IdleRounds(u32),
    /// Both `idle_rounds` and `idle_seconds`.
    #[error("evict by idle rounds and idle seconds both: accepted one of them")]
    IdleBoth,
    /// The heap refused the index, block table or counters.
    #[error("the heap refused a table store of {bytes} bytes at its cap ({what})")]
    NoMemory {
        /// What was being allocated.
        what: &'static str,
        /// What the store costs at its cap.
        bytes: u64,
    },
}

/// What a push did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Applied to a stored row.
    Applied,
    /// Created the row (evicting one at the cap), then applied.
    Created,
    /// Counted toward admission, not stored, gradient dropped.
    NotAdmitted,
    /// A new row's block could not be allocated: dropped.
    NoMemory,
}

/// A store's counters (one writer: the store).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Rows stored now.
    pub rows_stored: u64,
    /// Rows created (first push, or first after eviction).
    pub created: u64,
    /// Rows evicted to make room at the cap.
    pub evicted_cap: u64,
    /// Rows evicted after `idle_rounds` rounds (or `idle_s` seconds)
    /// without an update.
    pub evicted_idle: u64,
    /// Rows read: by [`RowStore::read`] and [`RowStore::read_batch`],
    /// given out by the `_into` forms, and counted by
    /// [`RowStore::count_lookups`].
    pub lookups: u64,
    /// Pushes applied to a row (including those that created it).
    pub updates: u64,
    /// Pushes dropped before their id was admitted.
    pub not_admitted: u64,
    /// Pushes dropped because a new row's block could not be allocated.
    pub no_memory: u64,
    /// Bytes allocated now.
    pub bytes: u64,
    /// Row blocks the store made itself, on its lcore, none being ready
    /// from the block maker (or none running): each one's pages faulted
    /// in there (`table/reserve.rs`).
    pub blocks_made_on_lcore: u64,
}

/// One lcore's store of one table (module head).
pub struct RowStore<I, U> {
    pub(super) init: I,
    pub(super) opt: U,
    pub(super) config: StoreConfig,
    pub(super) dim: usize,
    pub(super) state_len: usize,
    pub(super) index: Index,
    pub(super) blocks: Blocks,
    /// First free slot plus one (0: none); a free slot's first word holds
    /// the next one's, as f32 bits.
    free: u32,
    /// Slots handed out so far (those below are stored or free).
    fresh: u32,
    cap: u32,
    pub(super) clock: Clock,
    pub(super) idle: Option<IdleSweep>,
    /// With `idle_seconds`: when rounds completed ([`RoundTimes`]).
    times: Option<RoundTimes>,
    pub(super) admit: Option<AdmitCounts>,
    /// The current round, modulo 2^31.
    pub(super) now: u32,
    stats: StoreStats,
    /// A checkpoint being streamed ([`super::snapshot`]).
    pub(super) stream: Option<Box<super::snapshot::Stream>>,
    /// The ids evicted at the cap since the last
    /// [`RowStore::take_cap_victims`], in order (at most
    /// [`EVICTION_LOG_MAX`]).
    #[cfg(feature = "eviction-log")]
    victims: Vec<u64>,
}

/// The most ids a store's eviction log keeps between takes (feature
/// `eviction-log`): past it, it records nothing more, so a store nobody
/// takes them from stays bounded.
#[cfg(feature = "eviction-log")]
pub const EVICTION_LOG_MAX: usize = 1 << 16;

impl<I, U> std::fmt::Debug for RowStore<I, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowStore")
            .field("config", &self.config)
            .field("state_len", &self.state_len)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<I: RowInit, U: RowUpdate> RowStore<I, U> {
    /// An empty store; allocates its index (and admission counters) now.
    pub fn new(config: StoreConfig, init: I, opt: U) -> Result<RowStore<I, U>, StoreError> {
        if config.dim == 0 {
            return Err(StoreError::ZeroDim);
        }
        if config.rows_cap == 0 || config.rows_cap > TABLE_MAX_ROWS {
            return Err(StoreError::RowsCap(config.rows_cap));
        }
        if let Admission::AfterPushes(n) = config.admission {
            if n < 2 {
                return Err(StoreError::AdmitAfter(n));
            }
        }
        if let Some(n) = config.idle_rounds {
            if n.get() >= 1 << 30 {
                return Err(StoreError::IdleRounds(n.get()));
            }
        }
        if config.idle_rounds.is_some() && config.idle_seconds.is_some() {
            return Err(StoreError::IdleBoth);
        }
        let dim = config.dim as usize;
        let state_len = opt.state_len(dim);
        let shape = Self::shape_of(&config, state_len);
        let bytes = table_bytes(&shape);
        let no_memory = |what| StoreError::NoMemory { what, bytes };
        let entries = usize::try_from(shape.index_entries()).map_err(|_| no_memory("index"))?;
        let index = Index::new(entries, config.hash_key).ok_or(no_memory("index"))?;
        let blocks = Blocks::new(&shape).ok_or(no_memory("block table"))?;
        let admit = match config.admission {
            Admission::Always => None,
            Admission::AfterPushes(n) => {
                let counters =
                    usize::try_from(shape.admit_counters()).map_err(|_| no_memory("admission counters"))?;
                Some(AdmitCounts::new(counters, n, config.hash_key).ok_or(no_memory("admission counters"))?)
            }
        };
        // By seconds, the sweep's rounds are set each round from the
        // round times (`advance_round_at`).
        let idle = config
            .idle_rounds
            .or(config.idle_seconds.map(|_| NonZeroU32::MIN))
            .map(|n| IdleSweep::new(entries, n.get()));
        let times = config.idle_seconds.map(|s| RoundTimes::new(s.get()));
        // Cast: checked against TABLE_MAX_ROWS (u32::MAX) above.
        #[allow(clippy::cast_possible_truncation)]
        let cap = config.rows_cap as u32;
        let mut store = RowStore {
            init,
            opt,
            config,
            dim,
            state_len,
            index,
            blocks,
            free: 0,
            fresh: 0,
            cap,
            clock: Clock::default(),
            idle,
            times,
            admit,
            now: 0,
            stats: StoreStats::default(),
            stream: None,
            #[cfg(feature = "eviction-log")]
            victims: Vec::new(),
        };
        store.stats.bytes = store.allocated_bytes();
        Ok(store)
    }

    fn shape_of(config: &StoreConfig, state_len: usize) -> TableShape {
        TableShape {
            rows_cap: config.rows_cap,
            dim: config.dim,
            // Cast: a row's state is a few times its dim, a u32.
            #[allow(clippy::cast_possible_truncation)]
            state_len: state_len as u32,
            admission: config.admission != Admission::Always,
        }
    }

    /// The shape admission charges for this store.
    pub fn shape(&self) -> TableShape {
        Self::shape_of(&self.config, self.state_len)
    }

    /// How the store was set up.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// An empty store set up as this one (a backup table that takes a
    /// state copy over what it held, PROTOCOL.md §11.9).
    pub fn empty_like(&self) -> Result<RowStore<I, U>, StoreError>
    where
        I: Clone,
        U: Clone,
    {
        RowStore::new(self.config, self.init.clone(), self.opt.clone())
    }

    /// The clock of eviction by idle rounds or time, which a checkpoint
    /// does not keep: the idle sweep's rounds (0 without a sweep) and, with
    /// `idle_seconds`, the sampled completion times of rounds ((round,
    /// nanoseconds), oldest first). A state copy carries it so that its
    /// backup evicts exactly as the primary does.
    pub fn idle_clock(&self) -> (u32, Vec<(u32, u64)>) {
        (
            self.idle.as_ref().map_or(0, IdleSweep::idle_rounds),
            self.times.as_ref().map(RoundTimes::samples).unwrap_or_default(),
        )
    }

    /// Sets the clock [`RowStore::idle_clock`] gave, on a store set up as
    /// the one it came from: refused (nothing changed) where the store has
    /// no idle sweep but `idle_rounds` is not 0, or samples without
    /// `idle_seconds`, or more than the ring holds.
    pub fn set_idle_clock(&mut self, idle_rounds: u32, samples: &[(u32, u64)]) -> Result<(), String> {
        match (&self.idle, idle_rounds) {
            (None, 0) => {}
            (None, n) => return Err(format!("idle rounds {n} for a store without an idle sweep")),
            (Some(_), 0) => return Err("no idle rounds for a store with an idle sweep".into()),
            (Some(_), _) => {}
        }
        match &mut self.times {
            None if !samples.is_empty() => {
                return Err(format!(
                    "{} idle-time samples for a store without idle_seconds",
                    samples.len()
                ))
            }
            None => {}
            Some(t) => t.set_samples(samples)?,
        }
        let entries = self.index.capacity();
        if let Some(sweep) = &mut self.idle {
            sweep.set_idle_rounds(entries, idle_rounds);
        }
        Ok(())
    }

    /// f32 values per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// f32 words of optimizer state per row.
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// Rows stored now.
    pub fn rows_stored(&self) -> u64 {
        self.index.len() as u64
    }

    /// The ids evicted at the cap since the last call, in order (feature
    /// `eviction-log`, for the simulator's model).
    #[cfg(feature = "eviction-log")]
    pub fn take_cap_victims(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.victims)
    }

    /// The counters.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            rows_stored: self.rows_stored(),
            blocks_made_on_lcore: self.blocks.made_here(),
            ..self.stats
        }
    }

    /// Bytes the store has allocated: index, blocks, block table and
    /// admission counters (what [`table_bytes`] models).
    pub fn allocated_bytes(&self) -> u64 {
        self.index.bytes() + self.blocks.bytes() + self.admit.as_ref().map_or(0, AdmitCounts::bytes)
    }

    /// Row blocks allocated.
    pub fn blocks_allocated(&self) -> usize {
        self.blocks.len()
    }

    /// Slots handed out so far (rows stored plus free slots).
    pub(super) fn handed_out(&self) -> u32 {
        self.fresh
    }

    /// The current round, modulo 2^31.
    pub fn round(&self) -> u32 {
        self.now
    }

    /// The values of a stored row.
    pub fn get(&self, id: u64) -> Option<&[f32]> {
        self.row_of(id).map(|r| &r[..self.dim])
    }

    /// The optimizer state of a stored row.
    pub fn state(&self, id: u64) -> Option<&[f32]> {
        self.row_of(id).map(|r| &r[self.dim..])
    }

    fn row_of(&self, id: u64) -> Option<&[f32]> {
        match self.index.probe(id, self.index.hash(id)) {
            Probe::Found(pos) => Some(self.blocks.row(self.index.entry(pos).slot())),
            Probe::Vacant(_) => None,
        }
    }

    /// Every stored row as (id, values, state), in index order.
    pub fn rows(&self) -> impl Iterator<Item = (u64, &[f32], &[f32])> + '_ {
        self.index.full().map(|(_, e)| {
            let row = self.blocks.row(e.slot());
            (e.id, &row[..self.dim], &row[self.dim..])
        })
    }

    /// Counts `n` rows read from a copy this store gave out (a BSP round's
    /// answers, copied from the rows [`RowStore::update_distinct_into`]
    /// gave once per id): [`StoreStats::lookups`] counts rows answered.
    pub fn count_lookups(&mut self, n: u64) {
        self.stats.lookups += n;
    }

    /// Read row `id` into `out` (`dim` values): its stored values, or its
    /// initial values when it is not stored (nothing is stored). True when
    /// stored.
    pub fn read(&mut self, id: u64, out: &mut [f32]) -> bool {
        let h = self.index.hash(id);
        self.read_staged(id, Staged { hash: h, found: None }, out)
    }

    #[inline]
    fn read_staged(&mut self, id: u64, staged: Staged, out: &mut [f32]) -> bool {
        assert_eq!(
            out.len(),
            self.dim,
            "read of a row of dim {} into {} values",
            self.dim,
            out.len()
        );
        self.stats.lookups += 1;
        match staged.probe(&self.index, id) {
            Probe::Found(pos) => {
                copy_row(out, &self.blocks.row(self.index.entry(pos).slot())[..self.dim]);
                true
            }
            Probe::Vacant(_) => {
                self.init.fill(id, out);
                false
            }
        }
    }

    /// Push `grad` (`dim` values) to row `id`: create it on its first
    /// (admitted) push, then apply the optimizer.
    pub fn update(&mut self, id: u64, grad: &[f32]) -> Pushed {
        let h = self.index.hash(id);
        self.update_staged(id, Staged { hash: h, found: None }, grad, None)
    }

    /// [`RowStore::update`] of a looked-up id; with `out`, the row's
    /// values after it are copied there (a row not stored after the push
    /// leaves `out` as it was).
    #[inline]
    fn update_staged(&mut self, id: u64, staged: Staged, grad: &[f32], out: Option<&mut [f32]>) -> Pushed {
        let hash = staged.hash;
        assert_eq!(
            grad.len(),
            self.dim,
            "push to a row of dim {} of {} values",
            self.dim,
            grad.len()
        );
        let touch = touch_word(self.now);
        let (pos, pushed) = match staged.probe(&self.index, id) {
            Probe::Found(pos) => (pos, Pushed::Applied),
            Probe::Vacant(pos) => {
                if let Some(admit) = &mut self.admit {
                    if !admit.push(id) {
                        self.stats.not_admitted += 1;
                        return Pushed::NotAdmitted;
                    }
                }
                let Some((slot, evicted)) = self.take_slot() else {
                    self.stats.no_memory += 1;
                    return Pushed::NoMemory;
                };
                // An eviction may have shifted entries: probe again.
                let pos = if evicted {
                    match self.index.probe(id, hash) {
                        Probe::Vacant(pos) => pos,
                        Probe::Found(_) => unreachable!("id {id} appeared while being created"),
                    }
                } else {
                    pos
                };
                self.index.insert(pos, id, slot, touch);
                let dim = self.dim;
                let row = self.blocks.row_mut(slot);
                row.fill(0.0);
                let (values, state) = row.split_at_mut(dim);
                self.init.fill(id, values);
                self.opt.init_state(state);
                self.stats.created += 1;
                (pos, Pushed::Created)
            }
        };
        let slot = self.index.entry(pos).slot();
        self.index.set_touch(pos, touch);
        let dim = self.dim;
        let (values, state) = self.blocks.row_mut(slot).split_at_mut(dim);
        self.opt.apply(values, state, grad);
        if let Some(out) = out {
            copy_row(out, values);
        }
        self.stats.updates += 1;
        pushed
    }

    /// A slot for a new row: a free one, a fresh one, or (at the cap) the
    /// CLOCK victim's (true: a row was evicted). `None`: the heap refused
    /// the fresh slot's block.
    fn take_slot(&mut self) -> Option<(u32, bool)> {
        if self.free != 0 {
            let slot = self.free - 1;
            self.free = self.blocks.row(slot)[0].to_bits();
            return Some((slot, false));
        }
        if self.fresh < self.cap {
            if !self.blocks.ensure(self.fresh) {
                return None;
            }
            self.fresh += 1;
            self.stats.bytes = self.allocated_bytes();
            return Some((self.fresh - 1, false));
        }
        debug_assert_eq!(self.index.len(), self.cap as usize, "no free slot below the cap");
        let pos = self.clock.victim(&mut self.index);
        let slot = self.index.entry(pos).slot();
        #[cfg(feature = "eviction-log")]
        if self.victims.len() < EVICTION_LOG_MAX {
            self.victims.push(self.index.entry(pos).id);
        }
        self.index.remove(pos);
        self.stats.evicted_cap += 1;
        Some((slot, true))
    }

    /// Store row `id` with `values`, `state` and touch word `touch` as
    /// they are (a restore); false when it is already stored or the store
    /// is full or out of memory.
    pub(super) fn insert_exact(&mut self, id: u64, values: &[f32], state: &[f32], touch: u32) -> bool {
        let h = self.index.hash(id);
        let Probe::Vacant(pos) = self.index.probe(id, h) else {
            return false;
        };
        if self.free == 0 && self.fresh == self.cap {
            return false;
        }
        let Some((slot, evicted)) = self.take_slot() else {
            return false;
        };
        debug_assert!(!evicted);
        self.index.insert(pos, id, slot, touch);
        let row = self.blocks.row_mut(slot);
        row[..values.len()].copy_from_slice(values);
        row[values.len()..].copy_from_slice(state);
        true
    }

    /// End the round: the next pushes belong to the next one; with
    /// `idle_rounds`, this round's share of the idle sweep (rows evicted
    /// returned). A store evicting by `idle_seconds` takes the time from
    /// [`RowStore::advance_round_at`]; here it evicts nothing.
    pub fn advance_round(&mut self) -> u64 {
        self.advance_round_at(None)
    }

    /// [`RowStore::advance_round`] at `now_ns` (nanoseconds of a monotonic
    /// clock, as the engine's `handle` gets): with `idle_seconds`, this
    /// round's share of a sweep evicting the rows whose last update was in
    /// a round that completed `idle_s` or more before `now_ns` (a lap
    /// takes about `idle_s`, so a row goes between `idle_s` and about twice
    /// that after its last update, plus `idle_s` / 16 of sampling; rounds
    /// that go faster or slower change each round's share).
    pub fn advance_round_at(&mut self, now_ns: impl Into<Option<u64>>) -> u64 {
        let completed = self.now;
        self.now = self.now.wrapping_add(1) & ROUND_MASK;
        if let Some(times) = &mut self.times {
            let rounds = now_ns
                .into()
                .and_then(|t| times.completed(completed, t, self.now));
            let (Some(rounds), Some(sweep)) = (rounds, &mut self.idle) else {
                return 0;
            };
            sweep.set_idle_rounds(self.index.capacity(), rounds);
        }
        let Some(mut sweep) = self.idle.take() else {
            return 0;
        };
        let now = self.now;
        let mut evicted = 0u64;
        let mut free = self.free;
        let blocks = &mut self.blocks;
        sweep.sweep(&mut self.index, now, |index, pos| {
            let slot = index.entry(pos).slot();
            index.remove(pos);
            // The slot joins the free list (its first word: the next).
            blocks.row_mut(slot)[0] = f32::from_bits(free);
            free = slot + 1;
            evicted += 1;
        });
        self.free = free;
        self.idle = Some(sweep);
        self.stats.evicted_idle += evicted;
        evicted
    }

    /// Read rows `ids` into `out` (`ids.len() * dim` values, row after
    /// row), as [`RowStore::read`] would id by id.
    pub fn read_batch(&mut self, ids: &[u64], out: &mut [f32]) {
        let d = self.dim;
        check_batch(ids, d, "into", out.len());
        self.pipeline(ids, |s, k, staged| {
            s.read_staged(ids[k], staged, &mut out[k * d..(k + 1) * d]);
        });
    }

    /// Push `grads` (`ids.len() * dim` values, row after row) to rows
    /// `ids`, as [`RowStore::update`] would id by id (a repeated id is
    /// updated once per occurrence, in order).
    pub fn update_batch(&mut self, ids: &[u64], grads: &[f32]) {
        let d = self.dim;
        check_batch(ids, d, "with", grads.len());
        self.pipeline(ids, |s, k, staged| {
            s.update_staged(ids[k], staged, &grads[k * d..(k + 1) * d], None);
        });
    }

    /// [`RowStore::update_batch`], then `ids`' rows into `out` as
    /// [`RowStore::read_batch`] would read them after it, in the same pass
    /// where that gives the same rows: `ids` strictly ascending (no id
    /// twice) goes [`RowStore::update_distinct_into`]'s way; otherwise the
    /// rows are read after the updates.
    pub fn update_batch_into(&mut self, ids: &[u64], grads: &[f32], out: &mut [f32]) {
        if ids.windows(2).all(|w| w[0] < w[1]) {
            self.update_distinct_into(ids, grads, out);
        } else {
            // `out` checked before anything is updated.
            let d = self.dim;
            check_batch(ids, d, "into", out.len());
            self.update_batch(ids, grads);
            self.read_batch(ids, out);
        }
    }

    /// [`RowStore::update_batch_into`] of ids the caller knows to be
    /// distinct (a BSP round's, merged as they arrived): each row's values
    /// are copied into `out` as soon as they are updated, while in cache,
    /// which is what a read after the batch gives unless a row was evicted
    /// during it (at the cap a new row may evict one the batch updated
    /// before, which reads as its initial values after it): then, and for
    /// that only, they are read after the updates. A row not stored after
    /// its push (not admitted, or no memory) reads as its initial values,
    /// as it would after. An id twice would get the row between its two
    /// updates at its first place, not the row after both: not for such
    /// batches (not checked: the caller's batches are distinct by their
    /// making, and a check would allocate on the data path).
    pub fn update_distinct_into(&mut self, ids: &[u64], grads: &[f32], out: &mut [f32]) {
        let d = self.dim;
        check_batch(ids, d, "with", grads.len());
        check_batch(ids, d, "into", out.len());
        let removals = self.index.removals();
        self.pipeline(ids, |s, k, staged| {
            let id = ids[k];
            let (grad, dst) = (&grads[k * d..(k + 1) * d], &mut out[k * d..(k + 1) * d]);
            match s.update_staged(id, staged, grad, Some(&mut *dst)) {
                Pushed::Applied | Pushed::Created => {}
                Pushed::NotAdmitted | Pushed::NoMemory => s.init.fill(id, dst),
            }
        });
        if self.index.removals() == removals {
            self.stats.lookups += ids.len() as u64;
        } else {
            // A row was evicted to make room: read them all after.
            self.read_batch(ids, out);
        }
    }

    /// Runs `step(self, k, staged)` for every id `k` of `ids` in order,
    /// each after the pipeline's prefetch stages have run
    /// [`RowStore::look_ahead`] ahead of it (module head).
    #[inline]
    fn pipeline(&mut self, ids: &[u64], mut step: impl FnMut(&mut Self, usize, Staged)) {
        let mut ring = [Staged::default(); RING];
        for t in 0..ids.len() + 2 * AHEAD {
            self.look_ahead(ids, t, &mut ring);
            if let Some(k) = t.checked_sub(2 * AHEAD).filter(|&k| k < ids.len()) {
                step(self, k, ring[k % RING]);
            }
        }
    }

    /// The pipeline's prefetch stages at step `t`: hash id `t` and
    /// prefetch its index entry; look up id `t - AHEAD`, prefetch its row
    /// and keep where it was found, which its update or read takes
    /// unless an entry was removed since.
    #[inline]
    fn look_ahead(&self, ids: &[u64], t: usize, ring: &mut [Staged; RING]) {
        if let Some(&id) = ids.get(t) {
            let h = self.index.hash(id);
            ring[t % RING] = Staged { hash: h, found: None };
            self.index.prefetch(h);
        }
        if let Some(j) = t.checked_sub(AHEAD).filter(|&j| j < ids.len()) {
            let staged = &mut ring[j % RING];
            if let Probe::Found(pos) = self.index.probe(ids[j], staged.hash) {
                staged.found = Some((pos, self.index.removals()));
                self.blocks.prefetch(self.index.entry(pos).slot());
            }
        }
    }
}
