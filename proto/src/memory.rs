//! What a job costs the appliance, byte by byte.
//!
//! The dataplane reports a [`MemoryModel`] of what it allocates (in
//! `DataplaneInfo`): per slot its buffers, padded to cache lines, and its
//! bookkeeping record; the blocks slot buffers are packed into and what each
//! block costs beyond its buffers; per job and lcore its record and one
//! entry per rank; per job its registry entry with the spec's keys; with
//! shared memory, the region files. [`MemoryModel::job_cost`] turns that and
//! a job's layout into bytes, O(keys + lcores). Admission (phub-control)
//! charges exactly that figure against the dataplane's budget, the
//! dataplane refuses an install over it, and the dataplane's `used` is the
//! sum of what its lcores report having allocated, which its tests hold equal
//! to this figure.
//!
//! A sparse table's store on an lcore ([`table_bytes`]) is charged by its
//! `rows` cap, whatever it holds: its id index is allocated whole at
//! creation and its row blocks are allocated as it grows, up to the cap.

use serde::{Deserialize, Serialize};

use crate::layout::{ChunkRange, Chunks, Layout, Weights};
use crate::shm::region_len;
use crate::spec::{Consistency, JobSpec, KeySpec, Optimizer, TableSpec};
use crate::Dtype;

/// What the dataplane allocates for a job, as the dataplane reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryModel {
    /// Every buffer of a slot starts on a line of this many bytes and
    /// takes whole lines.
    pub line_bytes: u32,
    /// Bookkeeping per slot: the engine's slot record.
    pub slot_bytes: u32,
    /// Most bytes of slot buffers one block of slot memory holds. A job's
    /// slots on an lcore are packed, in slot order, [`MemoryModel::slots_per_block`]
    /// to a block; each block is allocated with exactly its slots' buffers.
    pub block_bytes: u64,
    /// Bookkeeping per block beyond its buffers: its handle, the
    /// allocator's header, alignment and rounding to pages.
    pub block_overhead_bytes: u32,
    /// Bookkeeping per job on every lcore of the dataplane (whether or not
    /// it holds chunks of the job there).
    pub lcore_job_bytes: u32,
    /// Per rank of a job on every lcore (where its results go, when it was
    /// last heard from).
    pub rank_bytes: u32,
    /// Per job, the registry entry of the management side (its
    /// description, beside its keys and its layout's runs).
    pub job_bytes: u32,
    /// Per key of the job's spec, which the registry keeps (names are
    /// counted apart, [`name_bytes`]).
    pub key_bytes: u32,
    /// Per shared-memory region of a job on an lcore: its handle and path
    /// (the file's bytes are counted apart).
    pub region_bytes: u32,
    /// Page size: every shared-memory region file takes whole pages.
    pub page_bytes: u32,
    /// Per slot and rank of a job that is not BSP (async, bounded delay):
    /// the rank's last applied clock on the chunk and, while its answer is
    /// held, since when. 0 from a dataplane that does not say.
    #[serde(default)]
    pub clock_bytes: u32,
    /// Per table key of a job on every lcore: the engine's record of the
    /// table there (its store's record and its round's buffers' headers),
    /// beside [`table_bytes`] of its store. 0 from a dataplane that does
    /// not say.
    #[serde(default)]
    pub table_record_bytes: u32,
    /// Per table key, lcore and rank: the rank's round state there (the
    /// bitmap of its ROW_PUSH sequence numbers, its ROW_END count, its
    /// clock). 0 from a dataplane that does not say.
    #[serde(default)]
    pub table_rank_bytes: u32,
}

impl Default for MemoryModel {
    /// Figures for a dataplane that does not report its own: generous
    /// upper bounds of this version's kernel-UDP dataplane.
    // Cast: the size of a small struct, far below 2^32.
    #[allow(clippy::cast_possible_truncation)]
    fn default() -> MemoryModel {
        MemoryModel {
            line_bytes: 64,
            slot_bytes: 256,
            block_bytes: 2 << 20,
            block_overhead_bytes: 8192,
            lcore_job_bytes: 1024,
            rank_bytes: 64,
            job_bytes: 4096,
            key_bytes: std::mem::size_of::<KeySpec>() as u32,
            region_bytes: 512,
            page_bytes: 4096,
            clock_bytes: 16,
            table_record_bytes: 2048,
            table_rank_bytes: 192,
        }
    }
}

/// Bytes a key or job name of `len` bytes takes on the heap: none when
/// empty, else its bytes rounded up to 16 plus an allocator header of 16
/// (an upper bound of glibc's chunk for that request).
pub fn name_bytes(len: usize) -> u64 {
    if len == 0 {
        0
    } else {
        len.next_multiple_of(16) as u64 + 16
    }
}

/// Whether a job has shared-memory regions (PROTOCOL.md §3.4), and so where
/// a slot keeps the result of an f32 sum/mean job (the other jobs' results
/// are their parameters or a bf16/f16 buffer, in slot memory either way).
/// A job's store is [`JobSpec::result_store`] of what its dataplane offers:
/// the one place that decides it, for the engine and for admission alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultStore {
    /// No regions; in slot memory: a second `f32` buffer that trades places
    /// with the accumulator at each round's end.
    Slot,
    /// The job has shared-memory regions; in the slot's chunk of the job's
    /// result region: no second buffer.
    SharedRegion,
}

impl ResultStore {
    /// The store of a job with shared-memory regions (`shm`) or without.
    pub fn of(shm: bool) -> ResultStore {
        if shm {
            ResultStore::SharedRegion
        } else {
            ResultStore::Slot
        }
    }
}

/// Elements (`f32`) of each buffer of one slot of `elems` elements, in the
/// engine's block order: the accumulator; the second `f32` buffer that
/// trades places with it (f32 sum/mean stored in slot memory); the
/// parameters (server-side optimizer); the optimizer's two states; and the
/// bf16/f16 result (as pairs of `u16` per `f32`). Absent buffers are 0.
pub fn slot_buffers(dtype: Dtype, optimizer: &Optimizer, elems: u32, store: ResultStore) -> [usize; 6] {
    let n = elems as usize;
    let keeps = optimizer.keeps_params();
    let states = optimizer.state_buffers();
    [
        n,
        if dtype == Dtype::F32 && !keeps && store == ResultStore::Slot {
            n
        } else {
            0
        },
        if keeps { n } else { 0 },
        if states >= 1 { n } else { 0 },
        if states >= 2 { n } else { 0 },
        if dtype == Dtype::F32 { 0 } else { n.div_ceil(2) },
    ]
}

/// Bytes of the job's chunk data without padding or bookkeeping: per
/// element its accumulator, stored result, parameters and optimizer state,
/// as [`slot_buffers`] lists them (what admission charged before it
/// counted every byte).
pub fn data_bytes(spec: &JobSpec, store: ResultStore) -> u64 {
    let per = |elems: u32| -> u64 {
        let b = slot_buffers(spec.dtype, &spec.optimizer, elems, store);
        let f32s: usize = b[..5].iter().sum();
        4 * f32s as u64 + if b[5] > 0 { 2 * u64::from(elems) } else { 0 }
    };
    let elements: u64 = spec.keys.iter().map(|k| k.elements).sum();
    elements * per(1)
}

/// Bytes an lcore keeps per rack slot of a hierarchical job for the partial
/// waiting for its home's answer (round, send time, deadline, resends): at
/// least the engine's record (checked there).
pub const PARTIAL_RECORD_BYTES: u64 = 32;
/// Bytes an lcore keeps per peer lcore of a hierarchical job (its run of
/// chunks and its address), counted twice: as a rack and as a home; at
/// least what the engine keeps (checked there).
pub const PEER_LCORE_BYTES: u64 = 64;
/// Bytes an lcore keeps per primary slot of a replicated job for the
/// aggregate waiting for its backups' acknowledgements (round, acked set,
/// send time, deadline, resends; PROTOCOL.md §11.4): at least the engine's
/// record (checked there).
pub const REPLICA_RECORD_BYTES: u64 = 32;
/// Bytes an lcore keeps per backup slot while the slot awaits a state
/// copy (what has come of it, PROTOCOL.md §11.7): charged for every backup
/// slot, an appliance back or restored awaiting its copies (the engine's
/// record's size, checked there).
pub const BACKUP_FILL_BYTES: u64 = 12;
/// Log buffers an lcore keeps at most for a replicated async or
/// bounded-delay job's updates on their way to the backups (PROTOCOL.md
/// §11.10), each of the job's chunk length in `f32`: a push that finds
/// none free is dropped `backlog` and resent by its worker.
pub const UPDATE_LOG_BUFFERS: usize = 1024;
/// Bytes an lcore keeps per primary slot of a replicated async or
/// bounded-delay job for its update log's record (the log's ring and each
/// backup's acknowledged update), beside a `u32` per rank for the update
/// its answer waits for: at least the engine's record (checked there).
pub const UPDATE_RECORD_BYTES: u64 = 48;

/// What one job costs, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobCost {
    /// Heap bytes on each lcore of the dataplane: slot buffers and blocks,
    /// slot records, the job's record and its ranks' entries.
    pub lcores: Vec<u64>,
    /// Heap bytes of the job's registry entry: its description, the
    /// spec's keys and names, the layout's runs.
    pub registry: u64,
    /// Bytes of the job's shared-memory region files (0 without shared
    /// memory), which live in `/dev/shm` and count against its free space.
    pub shm: u64,
}

impl JobCost {
    /// Heap bytes in all.
    pub fn heap(&self) -> u64 {
        self.lcores.iter().sum::<u64>() + self.registry
    }

    /// Every byte: heap and shared memory.
    pub fn total(&self) -> u64 {
        self.heap() + self.shm
    }
}

impl MemoryModel {
    /// `f32`s per line.
    fn line_f32(&self) -> usize {
        (self.line_bytes as usize / 4).max(1)
    }

    /// Bytes of the buffers of one slot of `elems` elements, each padded to
    /// whole lines.
    pub fn slot_data_bytes(
        &self,
        dtype: Dtype,
        optimizer: &Optimizer,
        elems: u32,
        store: ResultStore,
    ) -> u64 {
        let line = self.line_f32();
        let f32s: usize = slot_buffers(dtype, optimizer, elems, store)
            .iter()
            .map(|&u| u.next_multiple_of(line))
            .sum();
        4 * f32s as u64
    }

    /// What a chunk of `elems` elements of `spec` puts on its lcore (its
    /// buffers and its slot record): the cost [`crate::layout::layout`]
    /// balances.
    pub fn chunk_cost<'a>(
        &'a self,
        spec: &'a JobSpec,
        store: ResultStore,
    ) -> impl Fn(u32) -> u64 + Copy + 'a {
        move |elems| {
            self.slot_data_bytes(spec.dtype, &spec.optimizer, elems, store) + u64::from(self.slot_bytes)
        }
    }

    /// Slots packed into one block: as many full chunks' buffers as
    /// [`MemoryModel::block_bytes`] holds, at least one.
    pub fn slots_per_block(&self, spec: &JobSpec, store: ResultStore) -> u64 {
        let full = self.slot_data_bytes(spec.dtype, &spec.optimizer, spec.chunk_elems(), store);
        (self.block_bytes / full.max(1)).max(1)
    }

    /// Heap bytes of a job on one lcore holding `slots` slots whose buffers
    /// take `data` bytes (and, for a job that is not BSP, a clock per slot
    /// and rank).
    pub fn lcore_bytes(&self, spec: &JobSpec, store: ResultStore, slots: u64, data: u64) -> u64 {
        let blocks = slots.div_ceil(self.slots_per_block(spec, store));
        let ranks = u64::from(spec.workers) * u64::from(self.rank_bytes);
        let regions = if store == ResultStore::SharedRegion && slots > 0 {
            (u64::from(spec.workers) + 1) * u64::from(self.region_bytes)
        } else {
            0
        };
        let clocks = if spec.consistency == Consistency::Sync {
            0
        } else {
            slots * u64::from(spec.workers) * u64::from(self.clock_bytes)
        };
        data + slots * u64::from(self.slot_bytes)
            + clocks
            + blocks * u64::from(self.block_overhead_bytes)
            + u64::from(self.lcore_job_bytes)
            + ranks
            + regions
    }

    /// Bytes of `spec`'s table keys on each of its `lcores` lcores (the
    /// job's L, PROTOCOL.md §10.1): per table, [`table_bytes`] of its
    /// store at its share of the `rows` cap ([`table_shape`]), its record
    /// its ranks' round state and its key cache ([`key_cache_bytes`]). A
    /// table without a `rows` cap is charged
    /// no store (admission refuses it before it gets here).
    pub fn tables_lcore_bytes(&self, spec: &JobSpec, lcores: usize) -> u64 {
        let lcores = u32::try_from(lcores).unwrap_or(u32::MAX);
        spec.tables()
            .map(|t| {
                table_shape(t.spec, lcores).map_or(0, |s| table_bytes(&s))
                    + u64::from(self.table_record_bytes)
                    + u64::from(spec.workers) * u64::from(self.table_rank_bytes)
                    + key_cache_bytes(t.spec, spec.workers, spec.chunk_bytes, spec.dtype)
            })
            .sum()
    }

    /// Bytes of the region files of a job on one lcore holding `slots`
    /// slots: a staging region per rank and a result region, whole pages.
    pub fn shm_lcore_bytes(&self, spec: &JobSpec, slots: u64) -> u64 {
        if slots == 0 {
            return 0;
        }
        let len = region_len(
            usize::try_from(slots).unwrap_or(usize::MAX),
            spec.chunk_elems(),
            spec.dtype,
        ) as u64;
        (u64::from(spec.workers) + 1) * len.next_multiple_of(u64::from(self.page_bytes.max(1)))
    }

    /// Heap bytes of the job's registry entry.
    pub fn registry_bytes(&self, spec: &JobSpec, lcores: usize) -> u64 {
        let names: u64 = spec.keys.iter().map(|k| name_bytes(k.name.len())).sum();
        u64::from(self.job_bytes)
            + name_bytes(spec.name.len())
            + spec.keys.len() as u64 * u64::from(self.key_bytes)
            + names
            + (lcores * std::mem::size_of::<ChunkRange>()) as u64
    }

    /// Prefix sums of the slot buffers' bytes over the job's chunk sequence.
    pub fn data_weights(&self, spec: &JobSpec, chunks: &Chunks, store: ResultStore) -> Weights {
        chunks.weigh(|e| self.slot_data_bytes(spec.dtype, &spec.optimizer, e, store))
    }

    /// What a replicated job (PROTOCOL.md §11) holds on one lcore beyond
    /// its primary slots ([`MemoryModel::job_cost`]): its backup slots
    /// (`backups`, one run per primary appliance it backs up, §11.2),
    /// charged as primary slots of the job's optimizer (buffers, records,
    /// blocks); a pending-aggregate record per primary slot
    /// (`primary_slots`); and `peer_lcores` peer lcores' runs and
    /// addresses (the lcores of the appliances it backs up and of its own
    /// chunks' backups). O(keys + backups).
    pub fn replica_lcore_bytes(
        &self,
        spec: &JobSpec,
        primary_slots: u64,
        backups: &[ChunkRange],
        peer_lcores: u64,
    ) -> u64 {
        let chunks = Chunks::new(spec);
        let data = self.data_weights(spec, &chunks, ResultStore::Slot);
        let per_block = self.slots_per_block(spec, ResultStore::Slot);
        let slots: u64 = backups
            .iter()
            .map(|b| {
                data.of(b.range())
                    + b.count * (u64::from(self.slot_bytes) + BACKUP_FILL_BYTES)
                    + b.count.div_ceil(per_block) * u64::from(self.block_overhead_bytes)
            })
            .sum();
        // An async or bounded-delay job (PROTOCOL.md §11.10): each backup
        // slot keeps the ranks' clocks; each primary slot an update log's
        // record and a wait per rank; the lcore at most
        // UPDATE_LOG_BUFFERS log buffers, one per update in flight (no
        // more than W per slot).
        let updates = if spec.consistency == Consistency::Sync {
            0
        } else {
            let w = u64::from(spec.workers);
            let backup_slots: u64 = backups.iter().map(|b| b.count).sum();
            let buffers = (w * (primary_slots + backup_slots)).min(UPDATE_LOG_BUFFERS as u64);
            backup_slots * w * u64::from(self.clock_bytes)
                + primary_slots * (UPDATE_RECORD_BYTES + 4 * w)
                + buffers * 4 * u64::from(spec.chunk_elems())
        };
        slots + updates + primary_slots * REPLICA_RECORD_BYTES + peer_lcores * PEER_LCORE_BYTES
    }

    /// What appliance `me` of a replicated job holds on each of its lcores
    /// beyond its primary slots ([`MemoryModel::replica_lcore_bytes`]),
    /// `parts[i]` being appliance i's part of the layout (one run per
    /// lcore) and `racks[i]` its rack label: the backup slots of every
    /// appliance whose replica set (§11.1) it is in, cut as §11.2 cuts
    /// them, and the backup tables of those appliances' entries (§11.9).
    /// Empty if `me` names no part.
    pub fn replica_cost<R: Eq>(&self, spec: &JobSpec, parts: &[&Layout], racks: &[R], me: usize) -> Vec<u64> {
        self.replica_cost_as(spec, parts, racks, me, false)
    }

    /// What appliance `me` holds on each of its lcores when it is installed
    /// again after being declared down (PROTOCOL.md §11.7: `joined` at the
    /// install's epoch): no primary slots, its own part kept as backup
    /// slots (each lcore its own run, first), then the backup slots and
    /// tables [`MemoryModel::replica_cost`] counts. Its primary part costs
    /// [`MemoryModel::part_cost`] of its layout with no chunks
    /// ([`Layout::without_chunks`]).
    pub fn replica_cost_back<R: Eq>(
        &self,
        spec: &JobSpec,
        parts: &[&Layout],
        racks: &[R],
        me: usize,
    ) -> Vec<u64> {
        self.replica_cost_as(spec, parts, racks, me, true)
    }

    fn replica_cost_as<R: Eq>(
        &self,
        spec: &JobSpec,
        parts: &[&Layout],
        racks: &[R],
        me: usize,
        back: bool,
    ) -> Vec<u64> {
        let r = spec.replicas();
        let Some(mine) = parts.get(me) else {
            return Vec::new();
        };
        let whole = |l: &Layout| ChunkRange {
            first: l.lcores.first().map_or(0, |r| r.first),
            count: l.lcores.iter().map(|r| r.count).sum(),
        };
        let lcores = mine.lcores.len();
        if lcores == 0 {
            return Vec::new();
        }
        let backed: Vec<usize> = (0..parts.len())
            .filter(|&p| p != me && crate::replica::replica_set(racks, p, r).contains(&me))
            .collect();
        let cut: Vec<Vec<ChunkRange>> = backed
            .iter()
            .map(|&p| crate::replica::backup_runs(whole(parts[p]), lcores))
            .collect();
        let peers: usize = crate::replica::replica_set(racks, me, r)
            .iter()
            .skip(1)
            .chain(&backed)
            .map(|&p| parts[p].lcores.len())
            .sum();
        // Backup tables (PROTOCOL.md §11.9): each entry (lcore) of a part
        // backed up here is kept, per table, on the lcore whose run of the
        // part's entries holds it, charged as the entry's primary tables.
        let counts: Vec<usize> = parts.iter().map(|l| l.lcores.len()).collect();
        let per_entry = self.tables_lcore_bytes(spec, counts.iter().sum());
        let mut entries = vec![0u64; lcores];
        if per_entry > 0 {
            let entries_of = crate::replica_rows::entry_parts(&counts);
            for &p in &backed {
                let part = entries_of[p];
                for e in part.range() {
                    if let Some(j) = crate::replica_rows::entry_backup(part, lcores, e) {
                        entries[j] += 1;
                    }
                }
            }
        }
        mine.lcores
            .iter()
            .enumerate()
            .map(|(j, run)| {
                let own = back.then_some(*run);
                let backups: Vec<ChunkRange> = own.into_iter().chain(cut.iter().map(|c| c[j])).collect();
                let primary = if back { 0 } else { run.count };
                self.replica_lcore_bytes(spec, primary, &backups, peers as u64) + entries[j] * per_entry
            })
            .collect()
    }

    /// What a hierarchical job's part on one appliance costs (PROTOCOL.md
    /// §9.1): its rack slots (the whole layout `rack`, as a `sum` job: they
    /// only add and relay) with a pending-partial record each, and its home
    /// slots (`home`, its part of the home layout, with the job's
    /// optimizer), each lcore's records counted for both; the peers' runs
    /// and addresses in the registry. O(keys + lcores).
    pub fn hierarchical_cost(
        &self,
        spec: &JobSpec,
        rack: &Layout,
        home: &Layout,
        peer_lcores: usize,
    ) -> JobCost {
        let relay = JobSpec {
            optimizer: Optimizer::Sum,
            ..spec.clone()
        };
        let mut cost = self.job_cost(&relay, rack, ResultStore::Slot);
        let chunks = Chunks::new(spec);
        let data = self.data_weights(spec, &chunks, ResultStore::Slot);
        let per_block = self.slots_per_block(spec, ResultStore::Slot);
        for ((c, h), r) in cost.lcores.iter_mut().zip(&home.lcores).zip(&rack.lcores) {
            // Home slots: their buffers, records and blocks (the job's
            // record and ranks are the rack slots'); a pending-partial
            // record per rack slot; every peer lcore's run and address,
            // as a rack and as a home.
            *c += data.of(h.range())
                + h.count * u64::from(self.slot_bytes)
                + h.count.div_ceil(per_block) * u64::from(self.block_overhead_bytes)
                + r.count * PARTIAL_RECORD_BYTES
                + (2 * peer_lcores as u64) * PEER_LCORE_BYTES;
        }
        cost
    }

    /// What `spec` placed by `layout` costs, with shared-memory regions or
    /// not: O(keys + lcores). Its tables are spread over the layout's
    /// lcores.
    pub fn job_cost(&self, spec: &JobSpec, layout: &Layout, store: ResultStore) -> JobCost {
        self.part_cost(spec, layout, store, layout.lcores.len())
    }

    /// What the part `layout` of a job sharded over several appliances
    /// costs on its appliance: as [`MemoryModel::job_cost`], but its
    /// tables' rows are spread over the job's `job_lcores` lcores on every
    /// appliance (PROTOCOL.md §10.1), so each lcore holds its share of
    /// them, not the part's.
    pub fn part_cost(
        &self,
        spec: &JobSpec,
        layout: &Layout,
        store: ResultStore,
        job_lcores: usize,
    ) -> JobCost {
        let chunks = Chunks::new(spec);
        let data = self.data_weights(spec, &chunks, store);
        let lcores = layout
            .lcores
            .iter()
            .map(|r| self.lcore_bytes(spec, store, r.count, data.of(r.range())))
            .map(|b| b + self.tables_lcore_bytes(spec, job_lcores))
            .collect();
        let shm = if store == ResultStore::SharedRegion {
            layout
                .lcores
                .iter()
                .map(|r| self.shm_lcore_bytes(spec, r.count))
                .sum()
        } else {
            0
        };
        JobCost {
            lcores,
            registry: self.registry_bytes(spec, layout.lcores.len()),
            shm,
        }
    }
}

// Sparse tables (issue 32): what one lcore's row store of a table costs.

/// Bytes of one block of a table's rows (at most; a table whose cap needs
/// less gets one smaller block). Rows are packed whole into blocks, never
/// split across two; a row of more than this gets a block of its own.
pub const TABLE_BLOCK_BYTES: u64 = 2 << 20;

/// Every row block is a whole number of lines of this many bytes.
pub const TABLE_LINE_BYTES: u64 = 64;

/// Bytes of one entry of a row store's id index: the id (8), the row's
/// slot plus one (4; 0 marks an empty entry) and its touch word (4: the
/// round it was last updated and its CLOCK bit).
pub const TABLE_INDEX_ENTRY_BYTES: u64 = 16;

/// Bytes of one block's handle in the store's block table (a pointer and
/// a length); the table is reserved at creation for the blocks of the cap.
pub const TABLE_BLOCK_HANDLE_BYTES: u64 = 16;

/// Bytes of one admission counter (a saturating u16).
pub const TABLE_ADMIT_COUNTER_BYTES: u64 = 2;

/// Most rows one lcore's store of a table may hold: a row's slot plus one
/// is a u32.
pub const TABLE_MAX_ROWS: u64 = u32::MAX as u64;

/// The shape of one lcore's store of a table, as admission charges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableShape {
    /// Most rows stored at once (the `rows` cap on this lcore).
    pub rows_cap: u64,
    /// f32 values per row.
    pub dim: u32,
    /// f32 words of optimizer state per row.
    pub state_len: u32,
    /// Whether admission counting (`admit_after`) is on: one counter per
    /// row of the cap.
    pub admission: bool,
}

impl TableShape {
    /// f32 words of one row slot: its values, then its state.
    pub fn row_words(&self) -> u64 {
        u64::from(self.dim) + u64::from(self.state_len)
    }

    /// Entries of the id index: a third more than the cap, so that the
    /// index is at most three quarters full.
    pub fn index_entries(&self) -> u64 {
        self.rows_cap + self.rows_cap.div_ceil(3)
    }

    /// Rows per block: as many whole rows as fit in
    /// [`TABLE_BLOCK_BYTES`], at least one, at most the cap.
    pub fn rows_per_block(&self) -> u64 {
        (TABLE_BLOCK_BYTES / (4 * self.row_words()).max(1))
            .max(1)
            .min(self.rows_cap.max(1))
    }

    /// Bytes of one block: its rows, rounded up to whole lines.
    pub fn block_bytes(&self) -> u64 {
        (self.rows_per_block() * 4 * self.row_words()).next_multiple_of(TABLE_LINE_BYTES)
    }

    /// Blocks the store holds at its cap.
    pub fn blocks(&self) -> u64 {
        self.rows_cap.div_ceil(self.rows_per_block())
    }

    /// Admission counters: one per row of the cap when admission is on.
    pub fn admit_counters(&self) -> u64 {
        if self.admission {
            self.rows_cap
        } else {
            0
        }
    }
}

/// Exactly the bytes one lcore's key cache of a table holds (PROTOCOL.md
/// §10.7), allocated whole at install: per rank and slot, room for R ids
/// (8 bytes each, R = [`crate::spec::rows_per_datagram`]), the signature (8 bytes) and
/// the count (2 bytes). 0 when `key_cache` is 0.
pub fn key_cache_bytes(table: &TableSpec, workers: u32, chunk_bytes: u32, dtype: Dtype) -> u64 {
    let per = u64::from(crate::spec::rows_per_datagram(chunk_bytes, table.dim, dtype));
    u64::from(workers) * u64::from(table.key_cache) * (per * crate::spec::ROW_ID_BYTES as u64 + 10)
}

/// One lcore's share of a table's `rows` cap over the job's `lcores`
/// lcores: `ceil(rows / lcores)` (placement gives each lcore 1/L of the
/// ids, PROTOCOL.md §10.1); `None` without a cap or without lcores. It may
/// exceed [`TABLE_MAX_ROWS`], which an appliance then refuses.
pub fn lcore_rows_cap(table: &TableSpec, lcores: u32) -> Option<u64> {
    let rows = table.rows?;
    (lcores > 0).then(|| rows.div_ceil(u64::from(lcores)))
}

/// The shape of one lcore's store of `table` over the job's `lcores`
/// lcores ([`lcore_rows_cap`]); `None` without a cap.
pub fn table_shape(table: &TableSpec, lcores: u32) -> Option<TableShape> {
    Some(TableShape {
        rows_cap: lcore_rows_cap(table, lcores)?,
        dim: table.dim,
        state_len: table.optimizer.state_len(table.dim),
        admission: table.admit_after.is_some_and(|n| n >= 2),
    })
}

/// Exactly the bytes one lcore's row store of a table has allocated when
/// it holds `rows_cap` rows: the id index (allocated whole at creation),
/// the row blocks (allocated one at a time as the table grows, every one
/// allocated at the cap), the block table and the admission counters. The
/// store's own record and the heap's headers (one per allocation: at most
/// one per 2 MiB block) are not in it. Admission charges this figure per
/// lcore; phub-engine's row store reports the same sum of what it
/// allocated, and its tests hold the two equal.
pub fn table_bytes(shape: &TableShape) -> u64 {
    shape.index_entries() * TABLE_INDEX_ENTRY_BYTES
        + shape.blocks() * (shape.block_bytes() + TABLE_BLOCK_HANDLE_BYTES)
        + shape.admit_counters() * TABLE_ADMIT_COUNTER_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::layout;

    fn spec(text: &str) -> JobSpec {
        JobSpec::from_toml(text).unwrap()
    }

    /// Each lcore of a job is charged, per table, its store at its share
    /// of the cap (ceil(rows / L)), its record and its ranks' state; a
    /// table without a cap is charged no store.
    #[test]
    fn tables_are_charged_at_their_share_of_the_cap_on_every_lcore() {
        let t = |rows: &str| {
            spec(&format!(
                "name = \"t\"\nworkers = 3\n[optimizer]\nkind = \"sum\"\n[[keys]]\nname = \"w\"\nelements = 8\n\
                 [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 8\n{rows}\
                 optimizer = {{ kind = \"adam\", lr = 0.1 }}\n"
            ))
        };
        let m = MemoryModel::default();
        let capped = t("rows = 1000\n");
        let table = capped.tables().next().unwrap().spec;
        assert_eq!(lcore_rows_cap(table, 3), Some(334));
        assert_eq!(lcore_rows_cap(table, 0), None);
        let shape = table_shape(table, 3).unwrap();
        assert_eq!(
            (shape.rows_cap, shape.dim, shape.state_len, shape.admission),
            (334, 8, 17, false)
        );
        let per_table = u64::from(m.table_record_bytes) + 3 * u64::from(m.table_rank_bytes);
        assert_eq!(m.tables_lcore_bytes(&capped, 3), table_bytes(&shape) + per_table);
        let uncapped = t("");
        assert_eq!(m.tables_lcore_bytes(&uncapped, 3), per_table);
        // job_cost adds it on each of the layout's lcores.
        let lay = crate::layout::layout(&capped, &mut [0, 0, 0], m.chunk_cost(&capped, ResultStore::Slot));
        let mut dense = capped.clone();
        dense.keys.pop();
        let with = m.job_cost(&capped, &lay, ResultStore::Slot);
        let without = m.job_cost(&dense, &lay, ResultStore::Slot);
        for (a, b) in with.lcores.iter().zip(&without.lcores) {
            assert_eq!(a - b, m.tables_lcore_bytes(&capped, 3));
        }
        // A part of two of those three lcores, on an appliance of its own:
        // each lcore is charged its share of the job's three (ceil(1000 /
        // 3) rows), as in the whole layout, not ceil(1000 / 2).
        let part = Layout {
            chunk_elems: lay.chunk_elems,
            lcores: lay.lcores[..2].to_vec(),
        };
        let shared = m.part_cost(&capped, &part, ResultStore::Slot, 3);
        assert_eq!(shared.lcores, with.lcores[..2]);
        let alone = m.job_cost(&capped, &part, ResultStore::Slot);
        let more = m.tables_lcore_bytes(&capped, 2) - m.tables_lcore_bytes(&capped, 3);
        assert!(more > 0);
        assert_eq!(alone.total() - shared.total(), 2 * more);
    }

    #[test]
    fn slot_buffers_are_padded_to_lines() {
        let m = MemoryModel::default();
        let sum = Optimizer::Sum;
        let adam = Optimizer::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        // One element: accumulator and result, a line each.
        assert_eq!(m.slot_data_bytes(Dtype::F32, &sum, 1, ResultStore::Slot), 128);
        // With shared memory the result region holds the result.
        assert_eq!(
            m.slot_data_bytes(Dtype::F32, &sum, 1, ResultStore::SharedRegion),
            64
        );
        assert_eq!(
            m.slot_data_bytes(Dtype::F32, &sum, 2048, ResultStore::Slot),
            2 * 8192
        );
        assert_eq!(
            m.slot_data_bytes(Dtype::Bf16, &sum, 100, ResultStore::Slot),
            448 + 256
        );
        assert_eq!(
            m.slot_data_bytes(Dtype::F32, &adam, 100, ResultStore::Slot),
            4 * 448
        );
        assert_eq!(
            m.slot_data_bytes(Dtype::F16, &adam, 100, ResultStore::Slot),
            4 * 448 + 256
        );
    }

    #[test]
    fn a_million_one_element_keys_cost_what_each_slot_takes() {
        let mut text =
            String::from("name = \"m\"\nworkers = 2\nchunk_bytes = 64\n[optimizer]\nkind = \"sum\"\n");
        for _ in 0..1_000_000 {
            text.push_str("[[keys]]\nelements = 1\n");
        }
        let s = spec(&text);
        let m = MemoryModel::default();
        let l = layout(&s, &mut [0, 0], m.chunk_cost(&s, ResultStore::Slot));
        let c = m.job_cost(&s, &l, ResultStore::Slot);
        // Per chunk: two padded lines and a slot record; per key its entry.
        let per_chunk = 128 + u64::from(m.slot_bytes);
        let at_least = 1_000_000 * (per_chunk + u64::from(m.key_bytes));
        assert!(c.total() >= at_least, "{c:?}");
        assert!(c.total() < at_least + at_least / 50, "{c:?}");
        assert_eq!(c.shm, 0);
        // The data alone, what admission used to charge, was 8 bytes a chunk.
        assert!(c.total() > 40 * 8_000_000);
    }

    #[test]
    fn one_key_of_four_million_f32_in_64_byte_chunks() {
        let s = spec(
            "name = \"k\"\nworkers = 2\nchunk_bytes = 64\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 4000000\n",
        );
        let m = MemoryModel::default();
        let l = layout(&s, &mut [0], m.chunk_cost(&s, ResultStore::Slot));
        let c = m.job_cost(&s, &l, ResultStore::Slot);
        // 250,000 chunks of 16 elements: accumulator and result a line each.
        let chunks = 250_000u64;
        let want = chunks * (128 + u64::from(m.slot_bytes));
        assert!(c.total() >= want && c.total() < want + (1 << 20), "{c:?}");
        // Far more than the 32 MB of data alone.
        assert!(c.total() > 90_000_000, "{c:?}");
    }

    #[test]
    fn shared_memory_regions_are_whole_pages_per_rank_and_result() {
        let s = spec(
            "name = \"s\"\nworkers = 3\nchunk_bytes = 64\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 100\n",
        );
        let m = MemoryModel::default();
        let l = layout(&s, &mut [0, 0], m.chunk_cost(&s, ResultStore::SharedRegion));
        let c = m.job_cost(&s, &l, ResultStore::SharedRegion);
        // 7 chunks, 4 and 3 per lcore, each 64 bytes: one page per file,
        // four files (three ranks and the results) per lcore.
        assert_eq!(c.shm, 2 * 4 * 4096);
        assert_eq!(m.job_cost(&s, &l, ResultStore::Slot).shm, 0);
    }

    #[test]
    fn table_bytes_counts_index_blocks_handles_and_counters() {
        // D = 16 with 16 words of state: 128-byte rows, 16,384 to a block.
        let shape = TableShape {
            rows_cap: 100_000,
            dim: 16,
            state_len: 16,
            admission: false,
        };
        assert_eq!(shape.rows_per_block(), 16_384);
        assert_eq!(shape.blocks(), 7);
        assert_eq!(shape.index_entries(), 133_334);
        assert_eq!(table_bytes(&shape), 133_334 * 16 + 7 * ((2 << 20) + 16));
        let admitting = TableShape {
            admission: true,
            ..shape
        };
        assert_eq!(table_bytes(&admitting), table_bytes(&shape) + 200_000);
        // A small table gets one block of its rows, whole lines.
        let small = TableShape {
            rows_cap: 3,
            dim: 5,
            state_len: 0,
            admission: false,
        };
        assert_eq!(small.block_bytes(), 64);
        assert_eq!(table_bytes(&small), 4 * 16 + 64 + 16);
        // A row over a block gets a block of its own.
        let wide = TableShape {
            rows_cap: 2,
            dim: 1 << 20,
            state_len: 0,
            admission: false,
        };
        assert_eq!(
            (wide.rows_per_block(), wide.blocks(), wide.block_bytes()),
            (1, 2, 4 << 20)
        );
        assert_eq!(table_bytes(&TableShape { rows_cap: 0, ..shape }), 0);
    }
}
