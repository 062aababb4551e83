//! A job's life on an lcore: what it is told ([`JobInstall`],
//! [`InstallKind`], its tables' [`TableInstall`]s), what it costs ([`memory_model`],
//! [`Shard::job_memory_bytes`]), installing it whole or not at all, and
//! removing, evicting and shutting down.

use phub_proto::layout::SlotChunk;
use phub_proto::memory::{MemoryModel, ResultStore, PARTIAL_RECORD_BYTES, PEER_LCORE_BYTES};
use phub_proto::spec::{Consistency, Optimizer, MAX_WORKERS};
use phub_proto::wire::{DropReason, MsgType, Repr, MAX_PAYLOAD};
use phub_proto::Dtype;

use crate::shm::{JobRegions, RegionsOf, ShmSetup};
use crate::slotmem::{SlotAllocator, SlotBlock, LINE_BYTES};

use super::clock::RankClock;
use super::error::EngineError;
use super::hier::HierInstall;
use super::outbox::Pending;
use super::replica::ReplicaInstall;
use super::slot::{RankSet, Slot};
use super::stats::JobCounters;
use super::table::{Table, TableInstall, TABLE_RANK_BYTES, TABLE_RECORD_BYTES};
use super::table_checkpoint::RestoredTable;
use super::{Job, Shard};

/// What a job looks like to one lcore.
#[derive(Debug, Clone, PartialEq)]
pub struct JobInstall {
    /// Job id (carried in every packet).
    pub id: u16,
    /// The job's secret token (carried in every packet).
    pub token: u64,
    /// Worker count W, 1..=[`MAX_WORKERS`].
    pub workers: u16,
    /// Element type on the wire.
    pub dtype: Dtype,
    /// Per-chunk update.
    pub optimizer: Optimizer,
    /// BSP, async or bounded delay (PROTOCOL.md §5.8).
    pub consistency: Consistency,
    /// Elements in a full chunk of the job (the layout's `chunk_elems`):
    /// no slot is longer, and slots are packed into blocks by it.
    pub chunk_elems: u32,
    /// The job's slots on this lcore, in slot order.
    pub slots: Vec<SlotChunk>,
}

/// What a job gets on an lcore beside its slots ([`Shard::install`]): one
/// of these, so a job cannot be given shared-memory regions and a
/// hierarchy at once.
#[derive(Debug, Clone, PartialEq)]
pub enum InstallKind {
    /// Its slots alone.
    Plain,
    /// Its shared-memory regions too (PROTOCOL.md §3.4): a staging region
    /// per rank and a result region, files in `/dev/shm`, removed with the
    /// job. BSP jobs only.
    Shared(ShmSetup),
    /// A hierarchical job's part (PROTOCOL.md §9): the slots are its rack
    /// slots, and this says where the homes and the other racks are and
    /// which home slots this lcore keeps.
    Hierarchical(Box<HierInstall>),
    /// A replicated job's part (PROTOCOL.md §11): the slots are the
    /// primary slots of their chunks, and this says where their backups
    /// are and which backup slots this lcore keeps. BSP jobs only.
    Replicated(Box<ReplicaInstall>),
}

/// Most bytes of slot buffers in one block of slot memory (a 2 MiB huge
/// page); a slot longer than that gets a block of its own.
pub const BLOCK_BYTES: u64 = 2 << 20;

/// What this engine allocates per rank of a job on an lcore (its endpoint
/// and when it was last heard from), at most: checked for each address
/// type when a shard is made.
pub(super) const RANK_BYTES: u32 = 64;

/// What an lcore's engine allocates for a job, as admission charges it:
/// slot buffers padded to [`LINE_BYTES`], a slot record each, blocks of
/// [`BLOCK_BYTES`] with `mem`'s overhead each, a job record and per-rank
/// entries on every lcore, and a handle per shared-memory region. The
/// registry's figures (`job_bytes`, `key_bytes`) are the management
/// side's, which fills them in.
pub fn memory_model(mem: &dyn SlotAllocator) -> MemoryModel {
    // Cast (each): sizes of small structs, far below 2^32.
    #[allow(clippy::cast_possible_truncation)]
    MemoryModel {
        line_bytes: LINE_BYTES as u32,
        slot_bytes: std::mem::size_of::<Slot>() as u32,
        block_bytes: BLOCK_BYTES,
        block_overhead_bytes: (mem.block_overhead() + std::mem::size_of::<Box<dyn SlotBlock>>() as u64)
            as u32,
        lcore_job_bytes: JOB_RECORD_BYTES as u32,
        rank_bytes: RANK_BYTES,
        region_bytes: REGION_BYTES as u32,
        clock_bytes: std::mem::size_of::<RankClock>() as u32,
        table_record_bytes: TABLE_RECORD_BYTES,
        table_rank_bytes: TABLE_RANK_BYTES,
        ..MemoryModel::default()
    }
}

/// A job's record on an lcore and the headers of its four vectors' heap
/// allocations (slots, blocks, endpoints, last seen).
pub(super) const JOB_RECORD_BYTES: usize = std::mem::size_of::<Job<()>>() + 4 * 16;

/// A shared-memory region's handle in a job's record and its path.
pub(super) const REGION_BYTES: usize = std::mem::size_of::<phub_net::shm::ShmRegion>() + 256;

/// How long an evicted job's messages are answered with an ERROR
/// (`evicted`) rather than dropped as an unknown job: a minute.
pub const EVICTED_FOR_NS: u64 = 60_000_000_000;
/// The most evicted jobs one lcore remembers (the oldest is forgotten).
pub(super) const MAX_EVICTED: usize = 64;

/// A job evicted lately ([`Shard::evict`]), whose ranks' messages are
/// answered with an ERROR `evicted` until `until`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Evicted {
    pub(super) id: u16,
    pub(super) token: u64,
    /// Caller's clock.
    pub(super) until: u64,
}

impl<A: Copy + Eq> Shard<A> {
    /// Installs a job's slots on this lcore, and what `kind` gives it beside
    /// them, or nothing of it:
    /// - when the slot memory allocator runs out, what was allocated is
    ///   freed and the job is refused ([`EngineError::SlotMemory`]);
    /// - [`InstallKind::Shared`] also creates the job's shared-memory
    ///   regions on this lcore (named after `base_port` and this shard's
    ///   lcore index); when they cannot be created nothing of the job is
    ///   installed and no file is left ([`EngineError::SharedMemory`]);
    /// - [`InstallKind::Hierarchical`] installs the slots as a hierarchical
    ///   job's rack slots, with its home slots (PROTOCOL.md §9).
    ///
    /// Allocates (and creates files); call between bursts.
    pub fn install(&mut self, job: JobInstall, kind: InstallKind) -> Result<(), EngineError> {
        self.install_with_tables(job, kind, Vec::new())
    }

    /// Installs a job as [`Shard::install`] does, with its table keys on
    /// this lcore (PROTOCOL.md §10): a row store per table, sized by its
    /// share of the `rows` cap, and each rank's round state. A table that
    /// cannot be served here ([`EngineError::Table`]: no `rows` cap,
    /// `evict = { idle_s }`, a store the heap refuses, an entry beyond L)
    /// refuses the whole job; a hierarchical job has no tables.
    pub fn install_with_tables(
        &mut self,
        job: JobInstall,
        kind: InstallKind,
        tables: Vec<TableInstall>,
    ) -> Result<(), EngineError> {
        self.check_tables(&job, &kind, tables.iter().map(|t| t.key))?;
        let made = tables
            .iter()
            .map(|t| Table::new(job.id, t, job.workers, job.dtype, job.consistency))
            .collect::<Result<_, _>>()?;
        let id = job.id;
        let replicated = matches!(kind, InstallKind::Replicated(_));
        self.install_made(job, kind, made)?;
        if replicated {
            // Its entry's backups and the backup tables it keeps
            // (PROTOCOL.md §11.9); refused whole.
            if let Err(e) = self.install_table_backups(id, &tables) {
                self.remove(id);
                return Err(e);
            }
        }
        Ok(())
    }

    /// [`Shard::install_with_tables`] with tables made and restored away
    /// from the lcore ([`RestoredTable::read`], one per table key of the
    /// job on this lcore): the lcore only takes them in.
    pub fn install_restored(
        &mut self,
        job: JobInstall,
        kind: InstallKind,
        tables: Vec<RestoredTable>,
    ) -> Result<(), EngineError> {
        self.check_tables(&job, &kind, tables.iter().map(RestoredTable::key))?;
        let installs: Vec<TableInstall> = tables.iter().map(|t| t.install().clone()).collect();
        let made = tables
            .into_iter()
            .map(|t| t.into_table(job.id, job.workers))
            .collect::<Result<_, _>>()?;
        let id = job.id;
        let replicated = matches!(kind, InstallKind::Replicated(_));
        self.install_made(job, kind, made)?;
        if replicated && !installs.is_empty() {
            // Its entry's backups and the backup tables it keeps, which
            // await the restored entry's copies (PROTOCOL.md §11.9).
            if let Err(e) = self.install_table_backups(id, &installs) {
                self.remove(id);
                return Err(e);
            }
            if let Some(i) = self.jobs.iter().position(|j| j.id == id) {
                self.start_restored_copies(i);
            }
        }
        Ok(())
    }

    /// Before a job's tables are made: the job is not installed here, a
    /// job installed as `kind` may have tables, and no key is twice.
    fn check_tables(
        &self,
        job: &JobInstall,
        kind: &InstallKind,
        keys: impl Iterator<Item = u32> + Clone,
    ) -> Result<(), EngineError> {
        if self.jobs.iter().any(|j| j.id == job.id) {
            return Err(EngineError::JobExists(job.id));
        }
        let refuse = |key: u32, reason: &str| EngineError::Table {
            id: job.id,
            key,
            reason: reason.into(),
        };
        if let Some(key) = keys.clone().next() {
            match kind {
                InstallKind::Hierarchical(_) => {
                    return Err(refuse(
                        key,
                        "a hierarchical job may not have a table key (PROTOCOL.md §10.1)",
                    ))
                }
                InstallKind::Replicated(_) if job.consistency != Consistency::Sync => {
                    return Err(refuse(
                        key,
                        "a replicated job's tables are replicated in BSP only (PROTOCOL.md §11.9)",
                    ))
                }
                InstallKind::Replicated(_) => {}
                InstallKind::Plain | InstallKind::Shared(_) => {}
            }
        }
        for (i, key) in keys.clone().enumerate() {
            if keys.clone().take(i).any(|k| k == key) {
                return Err(refuse(
                    key,
                    "key = the key of another table of the install: one table per key",
                ));
            }
        }
        Ok(())
    }

    /// Installs `job` with its tables made.
    fn install_made(
        &mut self,
        job: JobInstall,
        kind: InstallKind,
        mut made: Vec<Table>,
    ) -> Result<(), EngineError> {
        let id = job.id;
        match kind {
            InstallKind::Plain => self.install_with(job, None)?,
            InstallKind::Shared(setup) => self.install_with(job, Some(setup))?,
            InstallKind::Hierarchical(hier) => self.install_hierarchical(job, *hier)?,
            InstallKind::Replicated(rep) => self.install_replicated(job, *rep)?,
        }
        if !made.is_empty() {
            made.sort_unstable_by_key(|t| t.key);
            if let Some(j) = self.jobs.iter_mut().find(|j| j.id == id) {
                j.tables = made;
            }
            self.count_rx_workers();
        }
        Ok(())
    }

    pub(super) fn install_with(&mut self, job: JobInstall, shm: Option<ShmSetup>) -> Result<(), EngineError> {
        if self.jobs.iter().any(|j| j.id == job.id) {
            return Err(EngineError::JobExists(job.id));
        }
        if job.workers == 0 || u32::from(job.workers) > MAX_WORKERS {
            return Err(EngineError::BadWorkers {
                id: job.id,
                workers: job.workers,
            });
        }
        if u32::try_from(job.slots.len()).is_err() {
            return Err(EngineError::TooManySlots {
                id: job.id,
                slots: job.slots.len(),
            });
        }
        // Cast: MAX_PAYLOAD is below 9000 (asserted in phub_proto::wire).
        #[allow(clippy::cast_possible_truncation)]
        let max = ((MAX_PAYLOAD / job.dtype.size()) as u32).min(job.chunk_elems);
        // Cast: i < job.slots.len(), which fits a u32 (checked above).
        #[allow(clippy::cast_possible_truncation)]
        if let Some((i, s)) = job
            .slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.elems == 0 || s.elems > max)
        {
            return Err(EngineError::BadSlot {
                id: job.id,
                slot: i as u32,
                elems: s.elems,
                max,
                dtype: job.dtype,
            });
        }
        if job.consistency != Consistency::Sync {
            let reason = if shm.is_some() {
                Some("shared-memory regions carry BSP jobs only")
            } else if job.optimizer == Optimizer::Mean {
                Some("each push is applied alone, so a mean has no meaning (use sum)")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(EngineError::Consistency {
                    id: job.id,
                    mode: job.consistency,
                    reason,
                });
            }
        }
        let store = ResultStore::of(shm.is_some());
        let (slots, blocks) = self
            .alloc_slots(&job.slots, job.dtype, &job.optimizer, job.chunk_elems, store)
            .map_err(|reason| self.slot_memory_error(&job, store, reason))?;
        let shm = match shm {
            None => None,
            Some(setup) => Some(
                JobRegions::create(
                    setup,
                    self.lcore,
                    RegionsOf {
                        id: job.id,
                        token: job.token,
                        workers: job.workers,
                        dtype: job.dtype,
                        slots: &job.slots,
                    },
                )
                .map_err(|reason| EngineError::SharedMemory { id: job.id, reason })?,
            ),
        };
        self.jobs.push(Job {
            id: job.id,
            token: job.token,
            workers: job.workers,
            dtype: job.dtype,
            optimizer: job.optimizer,
            slots,
            blocks,
            endpoints: vec![None; usize::from(job.workers)],
            shm,
            shm_ranks: RankSet::default(),
            last_seen: vec![0; usize::from(job.workers)],
            consistency: job.consistency,
            clocks: if job.consistency == Consistency::Sync {
                Vec::new()
            } else {
                vec![RankClock::default(); job.slots.len() * usize::from(job.workers)]
            },
            counters: JobCounters::default(),
            quorum: job.workers,
            members: RankSet::of(0..job.workers),
            unsynced: RankSet::default(),
            hier: None,
            tables: Vec::new(),
            replica: None,
        });
        self.count_rx_workers();
        Ok(())
    }

    /// Slots for `chunks` and their blocks of slot memory: in slot order,
    /// as many to a block as [`BLOCK_BYTES`] holds of full chunks' buffers,
    /// each block exactly as long as its slots' buffers. When the allocator
    /// fails, what it gave is freed and its answer returned.
    #[allow(clippy::type_complexity)]
    pub(super) fn alloc_slots(
        &self,
        chunks: &[SlotChunk],
        dtype: Dtype,
        opt: &Optimizer,
        chunk_elems: u32,
        store: ResultStore,
    ) -> Result<(Vec<Slot>, Vec<Box<dyn SlotBlock>>), String> {
        let full = 4 * Slot::block_len(chunk_elems, dtype, opt, store) as u64;
        // Cast: at most BLOCK_BYTES (2 MiB) slots.
        #[allow(clippy::cast_possible_truncation)]
        let per_block = (BLOCK_BYTES / full.max(1)).max(1) as usize;
        let mut slots = Vec::with_capacity(chunks.len());
        let mut blocks: Vec<Box<dyn SlotBlock>> = Vec::with_capacity(chunks.len().div_ceil(per_block));
        for group in chunks.chunks(per_block) {
            let len: usize = group
                .iter()
                .map(|c| Slot::block_len(c.elems, dtype, opt, store))
                .sum();
            // On an error `blocks` is dropped: every block allocated so far
            // goes back to the allocator.
            let block = self.mem.zeroed(len)?;
            if block.as_slice().len() != len
                || !(block.as_slice().as_ptr() as usize).is_multiple_of(LINE_BYTES)
            {
                return Err(format!(
                    "{} gave {} elements at {:p}; asked for {len} on a {LINE_BYTES}-byte boundary",
                    self.mem.describe(),
                    block.as_slice().len(),
                    block.as_slice().as_ptr()
                ));
            }
            let mut off = 0;
            for &c in group {
                slots.push(Slot::new(c, dtype, opt, store, blocks.len(), off));
                off += Slot::block_len(c.elems, dtype, opt, store);
            }
            blocks.push(block);
        }
        Ok((slots, blocks))
    }

    /// The refusal of `job` when slot memory runs out: what all its slots
    /// needed, and what the allocator said.
    pub(super) fn slot_memory_error(
        &self,
        job: &JobInstall,
        store: ResultStore,
        reason: String,
    ) -> EngineError {
        EngineError::SlotMemory {
            id: job.id,
            bytes: job
                .slots
                .iter()
                .map(|c| 4 * Slot::block_len(c.elems, job.dtype, &job.optimizer, store) as u64)
                .sum(),
            slots: job.slots.len(),
            from: self.mem.describe(),
            reason,
        }
    }

    /// Evicts a job at `now`: removes it ([`Shard::remove`]) and, for
    /// [`EVICTED_FOR_NS`], answers its ranks' messages (with its token)
    /// with an ERROR `evicted` instead of dropping them as an unknown job.
    /// Returns whether it was installed.
    pub fn evict(&mut self, id: u16, now: u64) -> bool {
        let Some(token) = self.job(id).map(|j| j.token) else {
            return false;
        };
        self.evicted.retain(|e| e.id != id && e.until > now);
        if self.evicted.len() == MAX_EVICTED {
            self.evicted.remove(0);
        }
        self.evicted.push(Evicted {
            id,
            token,
            until: now.saturating_add(EVICTED_FOR_NS),
        });
        self.remove(id)
    }

    /// Whether job `id` with `token` was evicted lately (at `now`).
    pub(super) fn was_evicted(&self, id: u16, token: u64, now: u64) -> bool {
        self.evicted
            .iter()
            .any(|e| e.id == id && e.token == token && now < e.until)
    }

    /// The appliance is shutting down: from now on every message of an
    /// installed job (with its token) is answered with an ERROR
    /// `shutting_down`, and one such ERROR is queued at once to every rank
    /// of every job that this lcore has heard from (round, slot, key and
    /// chunk 0: the worker fails all it has in flight on it). Returns the
    /// number of ERRORs queued. Not undone: the lcore is about to stop.
    pub fn shut_down(&mut self) -> usize {
        self.closing = true;
        let mut queued = 0;
        for job in &self.jobs {
            // Cast: r < workers, a u16 (one endpoint per rank).
            #[allow(clippy::cast_possible_truncation)]
            for (r, to) in job.endpoints.iter().enumerate() {
                let Some(to) = *to else { continue };
                let repr = Repr {
                    kind: MsgType::Error,
                    dtype: job.dtype,
                    flags: 0,
                    token: job.token,
                    job: job.id,
                    rank: r as u16,
                    count: 0,
                    error: DropReason::ShuttingDown.code(),
                    round: 0,
                    slot: 0,
                    key: 0,
                    chunk: 0,
                };
                let epoch = job.replica.as_deref().map_or(0, super::replica::Replica::epoch);
                self.pending.push(Pending::Error {
                    repr,
                    epoch,
                    entry: 0,
                    to,
                });
                queued += 1;
            }
        }
        self.counters.errors_sent.add(queued as u64);
        queued
    }

    /// Removes a job, frees its slots and removes its shared-memory regions
    /// (nothing is remembered of it; see [`Shard::evict`]); returns whether
    /// it was installed. Pending results for it are discarded.
    pub fn remove(&mut self, id: u16) -> bool {
        self.pending
            .retain(|p| !matches!(p, Pending::Result { job, .. } if *job == id));
        let before = self.jobs.len();
        self.jobs.retain(|j| j.id != id);
        self.count_rx_workers();
        before != self.jobs.len()
    }

    /// Bytes a job holds on this lcore, counted from what was allocated
    /// as [`memory_model`] tells admission: its blocks' buffers and each
    /// block's overhead, its slot records, its record and its ranks'
    /// entries, its regions' handles (the region files apart), and its
    /// tables as admission charges them (each store at its cap,
    /// [`phub_proto::memory::table_bytes`], its record and ranks').
    pub fn job_memory_bytes(&self, id: u16) -> Option<u64> {
        let j = self.job(id)?;
        let model = memory_model(&*self.mem);
        let data: u64 = j.blocks.iter().map(|b| 4 * b.as_slice().len() as u64).sum();
        let regions = j.shm.as_ref().map_or(0, |r| r.paths().count() as u64);
        // A hierarchical job's home slots, pending-partial records and peers
        // (what MemoryModel::hierarchical_cost charges).
        let hier = j.hier.as_ref().map_or(0, |h| {
            let home = h.home.as_ref().map_or(0, |home| {
                let data: u64 = home.blocks.iter().map(|b| 4 * b.as_slice().len() as u64).sum();
                data + home.blocks.len() as u64 * u64::from(model.block_overhead_bytes)
                    + (home.slots.len() * std::mem::size_of::<Slot>()) as u64
            });
            let peers: usize =
                h.rack_peers.iter().map(|p| p.addrs.len()).sum::<usize>() + h.homes.addrs.len();
            home + h.partials.len() as u64 * PARTIAL_RECORD_BYTES + peers as u64 * PEER_LCORE_BYTES
        });
        Some(
            data + j.blocks.len() as u64 * u64::from(model.block_overhead_bytes)
                + (j.slots.capacity() * std::mem::size_of::<Slot>()) as u64
                + (j.clocks.capacity() * std::mem::size_of::<RankClock>()) as u64
                + JOB_RECORD_BYTES as u64
                + (j.endpoints.capacity().max(j.last_seen.capacity()) as u64) * u64::from(RANK_BYTES)
                + regions * REGION_BYTES as u64
                + hier
                + j.tables.iter().map(Table::memory_bytes).sum::<u64>()
                + j.replica
                    .as_ref()
                    .map_or(0, |r| r.memory_bytes(u64::from(model.block_overhead_bytes))),
        )
    }
}
