//! The per-lcore aggregation engine, sans I/O.
//!
//! A [`Shard`] owns the chunk slots one lcore serves, for every job installed
//! on it. Packets go in through [`Shard::handle`] with the sender's address
//! (any `Copy + Eq` type: a socket address, a MAC/IP/port triple) and the
//! caller's clock; what must be sent comes out of [`Shard::transmits`] as
//! headers with borrowed payloads and destination lists, which the backend
//! sends and then clears with [`Shard::clear_transmits`].
//!
//! Slot memory comes from a [`SlotAllocator`] the backend chooses (Rust's
//! heap by default, DPDK's heap on the port's NUMA socket for the DPDK
//! backend): zeroed, 64-byte aligned blocks allocated at install and never
//! per packet. A job's slots on an lcore are packed into blocks in slot
//! order, as many to a block as [`BLOCK_BYTES`] holds of full chunks'
//! buffers ([`phub_proto::memory::MemoryModel::slots_per_block`]), so a
//! million small chunks take a few hundred allocations, not a million.
//! What a job holds is counted as [`memory_model`] describes it to
//! admission ([`Shard::job_memory_bytes`]).
//!
//! Invariants:
//! - An install is whole or refused: when the allocator runs out, every
//!   block it gave is freed and no part of the job is installed.
//! - `handle` never panics, never blocks, and does not allocate as long as the
//!   backend drains transmits at least every [`MAX_BURST`] packets.
//! - A contribution is added at most once per (slot, round, rank): the
//!   contributor bitmap makes pushes idempotent.
//! - A slot's stored result is the result of its last completed round; it
//!   changes only when the next round completes, which needs a push from
//!   every rank, which no correct rank sends before it holds that result.
//!
//! - A BSP job's rules above are its only rules; the two other consistency
//!   modes (PROTOCOL.md §5.8) keep, per slot, each rank's last applied
//!   clock ([`RankClock`], W per slot, allocated at install) and share
//!   round 0: INIT is a barrier in every mode, completed as BSP completes it.
//! - async, after round 0: a PUSH of clock c from rank r is applied iff c is
//!   r's applied clock + 1 (the optimizer on that one gradient, with W = 1
//!   and t = the slot's updates so far + 1; `sum` adds the values into the
//!   stored ones) and answered to r alone with the chunk's values when the
//!   answer is sent. A clock <= the applied one is a duplicate: answered
//!   with the current values, never applied again. A clock beyond applied
//!   + 1 is `ahead`. So a (slot, rank, clock) is applied at most once.
//! - bounded delay τ: applied as in async; the answer to clock c leaves
//!   only once every rank's applied clock on the slot is >= c - τ, else it
//!   is held: a flag on the rank's clock and since when, never a copy of
//!   values. A held rank's duplicates are dropped (`duplicate`), its next
//!   clock is `ahead`. A held answer is released by the push that raises the
//!   slot's lowest clock (the slowest rank's); all ranks released by it
//!   hold the same clock and get one RESULT with the values current when it
//!   is sent. So no answer leaves a rank more than τ clocks ahead of the
//!   slowest, and no rank's applied clock is more than τ + 1 ahead.
//! - PULL, in those modes, answers the current values with the rank's last
//!   answered clock (its applied clock, minus one while held).
//!
//! - A replicated job's primary slot (PROTOCOL.md §11) completes a round
//!   only once every backup of the chunk acknowledged its aggregate, so no
//!   RESULT of a round leaves before every backup holds it; a backup slot
//!   applies each round once, with the primary's completion code.
//!
//! The round rules are written out normatively in PROTOCOL.md §5.
//!
//! Shared memory (PROTOCOL.md §3.4): a job installed with
//! [`InstallKind::Shared`] gets its [`JobRegions`] on this lcore (a
//! staging region per rank and a result region, files in `/dev/shm`,
//! removed with the job). A PUSH or INIT with the SHM flag is then summed
//! straight from the sender's staging region at the slot's offset, exactly
//! as a datagram payload would be (no copy); each completed round's result
//! is written once into the result region; and a rank whose last
//! authenticated message had the flag gets its RESULTs (completion, resend,
//! PULL answer) as headers with the flag and no payload, the others as
//! usual. A message with the flag for a job installed without regions is
//! dropped (`no_shared_memory`). Creating the regions is I/O at install
//! time; handling a packet only reads and writes mapped memory.
//!
//! For f32 sum/mean jobs with regions the result region is the stored
//! result (no second buffer in slot memory): the round's last PUSH writes
//! `accumulator + its values` (scaled for the mean) straight into it, and a
//! round's first PUSH by shared memory is not read until the second arrives,
//! which sums both in one pass (`Shard::apply_region`). Sums keep arrival
//! order and rounding, so results are bit-identical to the datagram path's.
//!
//! Where each part lives (each file adds its own `impl` block of [`Shard`],
//! which stays one type):
//! - `mod.rs`: [`Shard`], the job record, [`Shard::handle`] and the mapping
//!   of what a packet did to its [`Verdict`];
//! - `slot.rs`: a slot's buffers in slot memory and its round
//!   (`Round`), and the BSP round rules;
//! - `clock.rs`: async and bounded delay: rank clocks ([`RankClock`]),
//!   applying a push by its clock, releasing held answers;
//! - `region.rs`: contributions read from shared memory, and the one-pass
//!   path of a slot whose result is its chunk of the result region;
//! - `install.rs`: installing a job ([`Shard::install`], [`InstallKind`]),
//!   what it costs ([`memory_model`]), removing, evicting, shutting down;
//! - `checkpoint.rs`: [`Shard::snapshot`] and [`Shard::restore`] (dense
//!   slots); `table_checkpoint.rs`: [`Shard::snapshot_tables`] and
//!   [`Shard::restore_tables`] (each table's rows and round state);
//! - `table.rs`: a job's table keys on this lcore ([`TableInstall`], the
//!   row store and each rank's round state); `rows.rs`: table messages,
//!   their checks and the BSP round rules (PROTOCOL.md §10.3);
//!   `row_clock.rs`: table messages in async and bounded delay;
//! - `hier.rs`: hierarchical jobs (PROTOCOL.md §9): their plan
//!   ([`hierarchy_plan`]), their install, partials
//!   and their timers; replicated, their home slots are the primary
//!   slots of §11 (§11.11);
//! - `replica.rs`: replicated jobs (PROTOCOL.md §11): their plan
//!   ([`replica_plan`]), primary slots that complete a round once every
//!   backup acknowledged it, backup slots, and the REPLICATE timers;
//!   `clock_replica.rs`: an async or bounded-delay job's updates, each
//!   replicated before the answer it earns (§11.10); `copy.rs`: state
//!   copies to new backups (§11.7);
//! - `epoch.rs`: a replicated job's epoch changes (PROTOCOL.md §11.6):
//!   down backups leave the replica sets, the parts of down homes are
//!   adopted ([`Shard::change_epoch`]); a hierarchical part goes flat
//!   (§11.11);
//! - `outbox.rs`: queued messages and the [`Transmit`](crate::Transmit)s made
//!   from them;
//! - `stats.rs`: a job's counters (`JobCounters`) and [`JobShardStats`];
//! - `error.rs`: [`EngineError`]; `tests.rs`: unit tests.

use std::sync::Arc;

use phub_proto::memory::{PARTIAL_RECORD_BYTES, PEER_LCORE_BYTES};
use phub_proto::spec::{Consistency, Optimizer};
use phub_proto::wire::{self, DropReason, MsgType, Repr};
use phub_proto::Dtype;

use crate::counters::ShardCounters;
use crate::kernels::Kernels;
use crate::shm::JobRegions;
use crate::slotmem::{RustHeap, SlotAllocator, SlotBlock};

mod checkpoint;
mod clock;
mod clock_replica;
mod copy;
mod epoch;
mod error;
mod hier;
mod install;
mod outbox;
mod region;
mod replica;
mod row_clock;
mod row_replica;
mod rows;
mod slot;
mod stats;
mod table;
mod table_checkpoint;
mod table_copy;
#[cfg(test)]
mod tests;

pub use crate::transmit::{PeerResolver, MAX_BURST};
pub use clock::{RankClock, MAX_CLOCK};
pub use error::EngineError;
pub use hier::{hierarchy_plan, HierInstall, Peers};
pub use install::{memory_model, InstallKind, JobInstall, BLOCK_BYTES, EVICTED_FOR_NS};
pub use outbox::Ranks;
pub use replica::{replica_plan, replica_plan_at, BackupInstall, BackupState, ReplicaInstall, ReplicaStats};
pub use stats::JobShardStats;
pub use table::{row_init, row_optimizer, TableInstall};
pub use table_checkpoint::{RestoredTable, StreamKept, TablesStreamError};

use hier::{Hier, Partial};
use install::{Evicted, RANK_BYTES};
use outbox::{Attempt, Pending, To};
use replica::Replica;
use slot::{RankSet, Slot};
use stats::JobCounters;
use table::Table;

/// A [`PeerResolver`], or none (no hierarchical job can be installed).
#[derive(Clone)]
struct Resolver<A>(Option<PeerResolver<A>>);

impl<A> std::fmt::Debug for Resolver<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Resolver(set)"
        } else {
            "Resolver(none)"
        })
    }
}

/// What became of one received packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A contribution was added; the round is still open.
    Aggregated,
    /// A contribution completed the round; the result is queued for all ranks.
    Completed,
    /// The stored result is queued again for the sender, who lost it.
    Resent,
    /// A PULL was answered with the stored result.
    Pulled,
    /// Not BSP: a push was applied and its answer queued for the sender.
    Applied,
    /// Bounded delay: a push was applied; its answer is held until the
    /// slowest rank catches up.
    Held,
    /// Hierarchical job, rack slot: the rack's last contribution; its
    /// partial sum is queued for the chunk's home. Replicated job, primary
    /// slot: the round's last contribution; its aggregate is queued for
    /// the chunk's backups (PROTOCOL.md §11.4).
    Forwarded,
    /// A replication message was taken (PROTOCOL.md §11.4): a backup
    /// applied a round, or acknowledged one again; a primary counted an
    /// acknowledgement that was not the last of its round.
    Replicated,
    /// The packet was dropped and counted under this reason.
    Dropped(DropReason),
}

/// A job's record on this lcore: its slots, ranks, clocks and counters.
#[derive(Debug)]
struct Job<A> {
    id: u16,
    token: u64,
    workers: u16,
    dtype: Dtype,
    optimizer: Optimizer,
    slots: Vec<Slot>,
    /// The slots' buffers: slot memory blocks, several slots to a block.
    blocks: Vec<Box<dyn SlotBlock>>,
    /// Where each rank's results go: the source of its last valid packet.
    endpoints: Vec<Option<A>>,
    /// The job's shared-memory regions on this lcore, if it has them.
    shm: Option<JobRegions>,
    /// Ranks whose last authenticated message had the SHM flag: their
    /// results go as headers alone (empty without regions).
    shm_ranks: RankSet,
    /// When each rank was last heard from (caller's clock), 0 if never.
    last_seen: Vec<u64>,
    consistency: Consistency,
    /// Not BSP: per slot, each rank's clock (slot * workers + rank); empty
    /// for BSP.
    clocks: Vec<RankClock>,
    /// What it did on this lcore.
    counters: JobCounters,
    /// Contributions that complete a round: W, or for a hierarchical job's
    /// rack slots the rack's ranks.
    quorum: u16,
    /// Ranks that may send to this lcore: all W, or a rack's.
    members: RankSet,
    /// A flat job restored from a checkpoint: the ranks not heard pulling
    /// since, whose INITs and PUSHes are refused `ahead` (PROTOCOL.md §5.4
    /// rule 0). Empty otherwise.
    unsynced: RankSet,
    /// A hierarchical job's rack and home state (PROTOCOL.md §9).
    hier: Option<Box<Hier<A>>>,
    /// Its table keys on this lcore (PROTOCOL.md §10), in key order.
    tables: Vec<Table>,
    /// A replicated job's backups, pending aggregates and backup slots
    /// (PROTOCOL.md §11).
    replica: Option<Box<Replica<A>>>,
}

/// A job's primary slots and their blocks (PROTOCOL.md §11): its slots; a
/// hierarchical job's home slots (§11.11), none on an lcore home to none.
fn primaries<'a, A>(
    slots: &'a [Slot],
    blocks: &'a [Box<dyn SlotBlock>],
    hier: Option<&'a Hier<A>>,
) -> (&'a [Slot], &'a [Box<dyn SlotBlock>]) {
    match hier {
        Some(h) => h
            .home
            .as_ref()
            .map_or((&[][..], &[][..]), |home| (&home.slots[..], &home.blocks[..])),
        None => (slots, blocks),
    }
}

impl<A> Job<A> {
    /// [`primaries`] of this job.
    fn primaries(&self) -> (&[Slot], &[Box<dyn SlotBlock>]) {
        primaries(&self.slots, &self.blocks, self.hier.as_deref())
    }

    /// Who sends this job's chunks to this lcore, for the receive buffer's
    /// shares: its ranks here ([`Job::quorum`]: W, or a hierarchical job's
    /// rack ranks) if it has slots here, and its racks' appliances if this
    /// lcore is home to some of its chunks.
    fn rx_senders(&self) -> u64 {
        let ranks = if self.slots.is_empty() && self.tables.is_empty() {
            0
        } else {
            u64::from(self.quorum)
        };
        let racks = self
            .hier
            .as_ref()
            .filter(|h| h.home.is_some())
            .map_or(0, |h| u64::from(h.racks));
        ranks + racks
    }

    /// The tables a checkpoint of this lcore holds, by (key, entry) in key
    /// order: every table; in a replicated job with tables, this lcore's
    /// own entry's alone (PROTOCOL.md §11.9: served here, or kept as
    /// backup tables where its appliance came back), never an adopted
    /// entry's. Refused while its own entry's tables await their state
    /// copy.
    pub(super) fn checkpoint_tables(&self) -> Result<Vec<(u32, u32)>, String> {
        let rep = self.replica.as_deref().filter(|r| r.rows_replicated());
        let Some(rep) = rep else {
            return Ok(self.tables.iter().map(|t| (t.key, t.entry())).collect());
        };
        if let Some(own) = rep.served.iter().find(|s| s.home == rep.me) {
            return Ok(self
                .tables
                .iter()
                .filter(|t| t.entry() == own.entry)
                .map(|t| (t.key, t.entry()))
                .collect());
        }
        let Some(part) = rep.row_parts.iter().find(|p| p.home == rep.me) else {
            return Ok(Vec::new());
        };
        if part.tables.iter().any(|(_, inc)| inc.awaiting || inc.behind) {
            return Err(format!(
                "this appliance keeps its own entry {} as backup tables, whose state copy is not here yet \
                 (PROTOCOL.md §11.9)",
                part.entry
            ));
        }
        Ok(part.tables.iter().map(|(t, _)| (t.key, part.entry)).collect())
    }

    /// Table `key` of entry `entry` on this lcore: served here, or a
    /// replicated job's backup table.
    pub(super) fn table_at(&self, key: u32, entry: u32) -> Option<&Table> {
        self.tables
            .iter()
            .find(|t| t.key == key && t.entry() == entry)
            .or_else(|| {
                self.replica
                    .as_deref()?
                    .row_parts
                    .iter()
                    .find(|p| p.entry == entry)?
                    .tables
                    .iter()
                    .map(|(t, _)| t)
                    .find(|t| t.key == key)
            })
    }

    /// [`Job::table_at`], to change.
    pub(super) fn table_at_mut(&mut self, key: u32, entry: u32) -> Option<&mut Table> {
        if let Some(i) = self
            .tables
            .iter()
            .position(|t| t.key == key && t.entry() == entry)
        {
            return self.tables.get_mut(i);
        }
        self.replica
            .as_deref_mut()?
            .row_parts
            .iter_mut()
            .find(|p| p.entry == entry)?
            .tables
            .iter_mut()
            .map(|(t, _)| t)
            .find(|t| t.key == key)
    }
}

/// The slots of one lcore, for every job installed on it.
#[derive(Debug)]
pub struct Shard<A> {
    lcore: u16,
    kernels: Kernels,
    jobs: Vec<Job<A>>,
    pending: Vec<Pending<A>>,
    counters: Arc<ShardCounters>,
    mem: Arc<dyn SlotAllocator>,
    /// Jobs evicted lately.
    evicted: Vec<Evicted>,
    /// The appliance is shutting down ([`Shard::shut_down`]): every message
    /// of an installed job is answered with an ERROR `shutting_down`.
    closing: bool,
    /// Turns other appliances' data addresses into this backend's.
    peers: Resolver<A>,
    /// The lcore's socket receive buffer as its kernel charges it, where
    /// the backend knows it ([`Shard::set_rx_buffer`]).
    rx_buffer: Option<u64>,
    /// The W of every job with slots here, summed: each job's RESULTs state
    /// `rx_buffer` x its W / this as its share (PROTOCOL.md §6.1).
    rx_workers: u64,
    /// The bytes (header and payload) of the queued table answers
    /// (`Pending::Row`), cleared with the transmits.
    rows_out: Vec<u8>,
    /// The bytes of the queued table answers with rows
    /// (`Pending::Answer`), cleared with the transmits.
    answers_out: outbox::AnswerBytes,
    /// The bytes of the queued REPLICATE_ACKs (`Pending::ReplicaAcks`),
    /// cleared with the transmits.
    acks_out: Vec<u8>,
    /// A checkpoint of a job's tables being streamed
    /// ([`Shard::stream_tables_begin`]).
    tables_stream: Option<table_checkpoint::TablesStream>,
    /// What copy on write kept, at most, for the stream in progress or the
    /// last one.
    tables_stream_kept: table_checkpoint::StreamKept,
}

impl<A: Copy + Eq> Shard<A> {
    /// An empty shard for `lcore`, aggregating with `kernels`, its slot
    /// memory from Rust's allocator.
    pub fn new(lcore: u16, kernels: Kernels) -> Shard<A> {
        Shard::with_slot_memory(lcore, kernels, Arc::new(RustHeap))
    }

    /// An empty shard whose slot memory comes from `mem` (the DPDK backend
    /// gives DPDK's heap on the port's NUMA socket).
    pub fn with_slot_memory(lcore: u16, kernels: Kernels, mem: Arc<dyn SlotAllocator>) -> Shard<A> {
        Shard::with_parts(lcore, kernels, mem, Arc::new(ShardCounters::default()))
    }

    /// An empty shard whose slot memory comes from `mem` and which counts
    /// into `counters` (shared with its lcore's packet I/O).
    pub fn with_parts(
        lcore: u16,
        kernels: Kernels,
        mem: Arc<dyn SlotAllocator>,
        counters: Arc<ShardCounters>,
    ) -> Shard<A> {
        // What MemoryModel::hierarchical_cost charges for the records of a
        // hierarchical job.
        assert!(
            std::mem::size_of::<Partial>() as u64 <= PARTIAL_RECORD_BYTES
                && (std::mem::size_of::<A>() + std::mem::size_of::<phub_proto::layout::ChunkRange>()) as u64
                    <= PEER_LCORE_BYTES,
            "a hierarchical job's records outgrow the memory model"
        );
        // What memory_model tells admission a rank costs.
        assert!(
            std::mem::size_of::<Option<A>>() + std::mem::size_of::<u64>() <= RANK_BYTES as usize,
            "a rank's entries outgrow RANK_BYTES"
        );
        // What memory_model tells admission a table and its ranks cost
        // beside the store.
        assert!(
            std::mem::size_of::<Table>() + std::mem::size_of::<table::BspRound>()
                <= table::TABLE_RECORD_BYTES as usize
                && std::mem::size_of::<table::RowRank>() <= table::TABLE_RANK_BYTES as usize,
            "a table's records outgrow the memory model"
        );
        Shard {
            lcore,
            kernels,
            jobs: Vec::new(),
            // One message per packet, two for a bounded-delay push that
            // is answered and releases others.
            pending: Vec::with_capacity(2 * MAX_BURST),
            counters,
            mem,
            evicted: Vec::new(),
            closing: false,
            peers: Resolver(None),
            rx_buffer: None,
            rx_workers: 0,
            rows_out: Vec::new(),
            answers_out: outbox::AnswerBytes::default(),
            acks_out: Vec::new(),
            tables_stream: None,
            tables_stream_kept: table_checkpoint::StreamKept::default(),
        }
    }

    /// Tells the shard its lcore's socket receive buffer, as the kernel
    /// charges it (`SO_RCVBUF`), or `None` where the backend does not know
    /// one: every RESULT then states the job's share of it
    /// ([`field::RX_SHARE`](phub_proto::wire::field::RX_SHARE)).
    pub fn set_rx_buffer(&mut self, bytes: Option<u64>) {
        self.rx_buffer = bytes;
    }

    /// Recounts [`Shard::rx_workers`] after a job came or went.
    fn count_rx_workers(&mut self) {
        self.rx_workers = self.jobs.iter().map(Job::rx_senders).sum();
    }

    /// The receive-buffer share job `j`'s RESULTs state: the buffer times
    /// the ranks that send to its slots here (W; a hierarchical job's rack
    /// ranks) over every sender to this lcore ([`Job::rx_senders`]); 0
    /// (none stated) without a buffer.
    fn rx_share(&self, j: &Job<A>) -> u32 {
        let Some(b) = self.rx_buffer else { return 0 };
        let share = u128::from(b) * u128::from(j.quorum) / u128::from(self.rx_workers.max(1));
        u32::try_from(share).unwrap_or(u32::MAX).max(1)
    }

    /// Lets this shard install hierarchical jobs, whose appliances it
    /// reaches at addresses `resolve` makes from their data addresses (the
    /// kernel-UDP backend: the address itself). Without it such an install
    /// is refused ([`EngineError::Hierarchy`]).
    pub fn set_peer_resolver(&mut self, resolve: PeerResolver<A>) {
        self.peers = Resolver(Some(resolve));
    }

    /// Where this shard's slot memory comes from.
    pub fn slot_memory(&self) -> &dyn SlotAllocator {
        &*self.mem
    }

    /// The lcore this shard serves.
    pub fn lcore(&self) -> u16 {
        self.lcore
    }

    /// This shard's counters, to share with a stats reader.
    pub fn counters(&self) -> &Arc<ShardCounters> {
        &self.counters
    }

    /// Ids of the installed jobs.
    pub fn job_ids(&self) -> impl Iterator<Item = u16> + '_ {
        self.jobs.iter().map(|j| j.id)
    }

    /// Sets where a rank's results go before it has sent anything (from
    /// the address it registered at join).
    pub fn set_endpoint(&mut self, id: u16, rank: u16, addr: A) -> bool {
        match self.jobs.iter_mut().find(|j| j.id == id) {
            Some(j) => match j.endpoints.get_mut(usize::from(rank)) {
                Some(e) => {
                    *e = Some(addr);
                    true
                }
                None => false,
            },
            None => false,
        }
    }

    /// When each rank of a job was last heard from on this lcore.
    pub fn last_seen(&self, id: u16) -> Option<&[u64]> {
        self.job(id).map(|j| &j.last_seen[..])
    }

    /// The files of a job's shared-memory regions on this lcore (staging
    /// regions in rank order, then the result region); `None` when the job
    /// is not installed or has no regions.
    pub fn shm_paths(&self, id: u16) -> Option<Vec<std::path::PathBuf>> {
        let shm = self.job(id)?.shm.as_ref()?;
        Some(shm.paths().map(|p| p.to_path_buf()).collect())
    }

    /// A slot's last completed round and its stored result (wire bytes).
    pub fn result(&self, id: u16, slot: u32) -> Option<(u32, &[u8])> {
        let j = self.job(id)?;
        let s = j.slots.get(slot as usize)?;
        let round = s.completed.get()?;
        Some((round, s.result_bytes(slot, j.shm.as_ref(), &j.blocks)))
    }

    /// A slot's parameters (`f32`), for jobs with a server-side optimizer.
    pub fn params(&self, id: u16, slot: u32) -> Option<&[f32]> {
        let j = self.job(id)?;
        let s = j.slots.get(slot as usize)?;
        j.optimizer.keeps_params().then(|| s.mem.params(&j.blocks))
    }

    fn job(&self, id: u16) -> Option<&Job<A>> {
        self.jobs.iter().find(|j| j.id == id)
    }

    /// Handles one received datagram from `from` at time `now` (caller's
    /// monotonic clock, any unit). Never panics; counts every drop.
    pub fn handle(&mut self, from: A, datagram: &[u8], now: u64) -> Verdict {
        let c = &self.counters;
        c.rx_packets.inc();
        c.rx_bytes.add(datagram.len() as u64);
        let v = self.classify(from, datagram, now);
        if let Verdict::Dropped(r) = v {
            self.counters.count_drop(r);
        }
        v
    }

    fn classify(&mut self, from: A, datagram: &[u8], now: u64) -> Verdict {
        if phub_proto::replica::is_replica_message(datagram) {
            return self.replica_message(from, datagram, now);
        }
        if phub_proto::rows::is_row_message(datagram) {
            return self.classify_row(from, datagram, now);
        }
        if phub_proto::replica_rows::is_row_replica_message(datagram) {
            return self.row_replica_message(from, datagram, now);
        }
        let (repr, payload) = match wire::parse(datagram) {
            Ok(p) => p,
            Err(r) => return Verdict::Dropped(r),
        };
        if matches!(repr.kind, MsgType::Result | MsgType::Error) {
            return Verdict::Dropped(DropReason::NotForAppliance);
        }
        let known = self.jobs.iter().position(|j| j.id == repr.job);
        let token_ok = known.is_some_and(|i| self.jobs[i].token == repr.token);
        if !token_ok && !self.evicted.is_empty() && self.was_evicted(repr.job, repr.token, now) {
            return self.refuse(from, repr, DropReason::Evicted);
        }
        let Some(i) = known else {
            return Verdict::Dropped(DropReason::UnknownJob);
        };
        if !token_ok {
            return Verdict::Dropped(DropReason::BadToken);
        }
        if matches!(repr.kind, MsgType::Partial | MsgType::PartialResult) {
            return self.peer_message(i, from, &repr, payload, now);
        }
        if self.closing {
            return self.refuse(from, repr, DropReason::ShuttingDown);
        }
        if let Some(rep) = self.jobs[i].replica.as_deref_mut() {
            // A replicated job's worker names the layout's epoch it routes
            // by (PROTOCOL.md §11.5, §11.6): another one gets ours back.
            let epoch = rep.epoch();
            if wire::Header::new_unchecked(datagram).epoch() != epoch {
                rep.count_worker_wrong_epoch();
                return self.refuse_in_epoch(from, repr, DropReason::WrongEpoch, epoch);
            }
        }
        let job = &mut self.jobs[i];
        if repr.shm() && job.shm.is_none() {
            return Verdict::Dropped(DropReason::NoSharedMemory);
        }
        if repr.rank >= job.workers || !job.members.contains(repr.rank) {
            return Verdict::Dropped(DropReason::RankOutOfRange);
        }
        // Authenticated from here on: remember where this rank lives and
        // how it takes its results.
        let rank = usize::from(repr.rank);
        job.endpoints[rank] = Some(from);
        job.last_seen[rank] = now;
        if repr.shm() {
            self.counters.shm_rx.inc();
            job.shm_ranks.insert(repr.rank);
        } else {
            job.shm_ranks.remove(repr.rank);
        }
        match Self::apply(&self.kernels, job, &repr, payload, now) {
            Ok(Step::Open) => {
                job.counters.pushes += 1;
                self.counters.pushes_aggregated.inc();
                Verdict::Aggregated
            }
            Ok(Step::Closed) => {
                job.counters.pushes += 1;
                self.counters.pushes_aggregated.inc();
                self.counters.rounds_completed.inc();
                round_done(&mut self.pending, &self.counters, job, repr.slot)
            }
            Ok(Step::Forward) => {
                job.counters.pushes += 1;
                self.counters.pushes_aggregated.inc();
                self.counters.partials_sent.inc();
                self.pending.push(Pending::Partial {
                    job: job.id,
                    slot: repr.slot,
                    attempt: Attempt::First,
                });
                Verdict::Forwarded
            }
            Ok(Step::Replicate) => {
                job.counters.pushes += 1;
                self.counters.pushes_aggregated.inc();
                Self::queue_replicates(&mut self.pending, &self.counters, job, repr.slot)
            }
            Ok(Step::Applied { held, slowest_rose }) => {
                job.counters.pushes += 1;
                job.counters.rounds += 1;
                self.counters.pushes_aggregated.inc();
                self.counters.rounds_completed.inc();
                // A replicated slot's update goes to its backups first, and
                // the answers it earns wait for them (PROTOCOL.md §11.10).
                let update = (repr.rank, repr.round);
                let deferred = Self::log_update(
                    &self.kernels,
                    &mut self.pending,
                    &self.counters,
                    job,
                    repr.slot,
                    update,
                    payload,
                    now,
                );
                if held {
                    job.counters.held += 1;
                    job.counters.held_total += 1;
                    self.counters.answers_held.inc();
                } else if let (Some(t), Some(rep)) = (deferred, job.replica.as_deref_mut()) {
                    rep.wait(repr.slot, job.workers, repr.rank, t);
                } else {
                    self.counters.results_sent.inc();
                    self.pending.push(Pending::Result {
                        job: job.id,
                        slot: repr.slot,
                        to: To::One(repr.rank),
                        round: Some(repr.round),
                    });
                }
                if slowest_rose {
                    Self::release(job, repr.slot, now, &mut self.pending, &self.counters, deferred);
                }
                if held {
                    Verdict::Held
                } else {
                    Verdict::Applied
                }
            }
            Ok(Step::Resend(round)) => {
                // The stored result to this rank alone: the answer to a
                // PULL, or a result resent to a rank that lost it (an INIT
                // or PUSH for the last completed round, or an older one),
                // each counted under its own counter.
                self.counters.results_sent.inc();
                self.pending.push(Pending::Result {
                    job: job.id,
                    slot: repr.slot,
                    to: To::One(repr.rank),
                    round,
                });
                if repr.kind == MsgType::Pull {
                    self.counters.pulls_answered.inc();
                    Verdict::Pulled
                } else {
                    self.counters.results_resent.inc();
                    Verdict::Resent
                }
            }
            Err(r) => self.refuse(from, repr, r),
        }
    }

    /// Refuses `repr`'s message from `from` for `reason`: an ERROR (the
    /// message's header, type ERROR, no payload, the reason's code) goes
    /// back where the reason tells the sender ([`DropReason::notifies_sender`]).
    fn refuse(&mut self, from: A, repr: Repr, reason: DropReason) -> Verdict {
        let epoch = self
            .job(repr.job)
            .and_then(|j| j.replica.as_deref())
            .map_or(0, Replica::epoch);
        self.refuse_in_epoch(from, repr, reason, epoch)
    }

    /// [`Shard::refuse`], the ERROR's `epoch` field `epoch` (a replicated
    /// job's install's, PROTOCOL.md §11.5; 0 for every other job).
    fn refuse_in_epoch(&mut self, from: A, repr: Repr, reason: DropReason, epoch: u32) -> Verdict {
        if reason.notifies_sender() {
            self.counters.errors_sent.inc();
            let e = Repr {
                kind: MsgType::Error,
                count: 0,
                error: reason.code(),
                flags: 0,
                ..repr
            };
            self.pending.push(Pending::Error {
                repr: e,
                epoch,
                entry: 0,
                to: from,
            });
        }
        Verdict::Dropped(reason)
    }
}

/// Slot `slot` of `job` completed a round here: its result is queued for
/// every rank (of the rack, for a hierarchical job).
fn round_done<A>(pending: &mut Vec<Pending<A>>, c: &ShardCounters, job: &mut Job<A>, slot: u32) -> Verdict {
    job.counters.rounds += 1;
    c.results_sent.add(u64::from(job.quorum));
    pending.push(Pending::Result {
        job: job.id,
        slot,
        to: To::All,
        round: None,
    });
    Verdict::Completed
}

enum Step {
    Open,
    Closed,
    /// A rack slot's round has every contribution of its rack: the partial
    /// sum is to go to the chunk's home.
    Forward,
    /// A replicated primary slot's round has every contribution: its
    /// aggregate is to go to the chunk's backups (PROTOCOL.md §11.4).
    Replicate,
    /// The stored result to the sender alone, with this round field (BSP:
    /// the slot's last completed round).
    Resend(Option<u32>),
    /// Not BSP: the push was applied; its answer is queued, or held; the
    /// slot's lowest clock rose (held answers may go).
    Applied {
        held: bool,
        slowest_rose: bool,
    },
}
