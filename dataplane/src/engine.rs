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
//! The round rules are written out normatively in PROTOCOL.md §5.
//!
//! Shared memory (PROTOCOL.md §3.4): a job installed with
//! [`Shard::install_shared`] gets its [`JobRegions`] on this lcore (a
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

use std::net::SocketAddrV4;
use std::sync::Arc;

use phub_proto::checkpoint::{SlotState, CLOCK_HELD};
use phub_proto::layout::SlotChunk;
use phub_proto::memory::{MemoryModel, PARTIAL_RECORD_BYTES, PEER_LCORE_BYTES};
use phub_proto::spec::{Consistency, Optimizer, MAX_WORKERS};
use phub_proto::wire::{self, flags, DropReason, MsgType, Repr, APPLIANCE_RANK, MAX_PAYLOAD};
use phub_proto::Dtype;

use crate::counters::ShardCounters;
use crate::kernels::{self, Kernels};
use crate::optim::{self, ChunkBufs};
use crate::shm::{JobRegions, RegionsOf, ShmSetup, Staging};
use crate::slotmem::{RustHeap, SlotAllocator, SlotBlock, LINE_BYTES, LINE_F32};
use crate::transmit::{Destinations, Transmit};

pub use crate::transmit::MAX_BURST;

mod hier;
pub use hier::HierInstall;
use hier::{Hier, Home, Partial, Peers};

pub use crate::transmit::PeerResolver;

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

/// Most bytes of slot buffers in one block of slot memory (a 2 MiB huge
/// page); a slot longer than that gets a block of its own.
pub const BLOCK_BYTES: u64 = 2 << 20;

/// What this engine allocates per rank of a job on an lcore (its endpoint
/// and when it was last heard from), at most: checked for each address
/// type when a shard is made.
const RANK_BYTES: u32 = 64;

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
        ..MemoryModel::default()
    }
}

/// A job's record on an lcore and the headers of its four vectors' heap
/// allocations (slots, blocks, endpoints, last seen).
const JOB_RECORD_BYTES: usize = std::mem::size_of::<Job<()>>() + 4 * 16;

/// A shared-memory region's handle in a job's record and its path.
const REGION_BYTES: usize = std::mem::size_of::<phub_net::shm::ShmRegion>() + 256;

/// Why a job could not be installed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// A job with this id is already installed.
    #[error("job {0} is already installed on this lcore")]
    JobExists(u16),
    /// The worker count is outside 1..=[`MAX_WORKERS`].
    #[error("job {id}: worker count {workers} is outside 1..={max}", max = MAX_WORKERS)]
    BadWorkers {
        /// Job id.
        id: u16,
        /// Worker count given.
        workers: u16,
    },
    /// A checkpoint could not be restored into the job.
    #[error("job {id}: cannot restore the checkpoint: {reason}")]
    Restore {
        /// Job id.
        id: u16,
        /// What did not fit.
        reason: String,
    },
    /// The slot memory allocator had no room for the job's slots; nothing
    /// of the job is installed on this lcore.
    #[error("job {id}: {bytes} bytes of slot memory for {slots} slots do not fit ({from}): {reason}")]
    SlotMemory {
        /// Job id.
        id: u16,
        /// Bytes the job's slots need on this lcore (line padding included).
        bytes: u64,
        /// The job's slots on this lcore.
        slots: usize,
        /// Where slot memory comes from ([`SlotAllocator::describe`]).
        from: String,
        /// What the allocator said.
        reason: String,
    },
    /// The job's shared-memory regions could not be created; nothing of the
    /// job is installed on this lcore and no region file is left.
    #[error("job {id}: shared-memory regions not created: {reason}")]
    SharedMemory {
        /// Job id.
        id: u16,
        /// What failed (the file and the system's answer).
        reason: String,
    },
    /// The consistency mode does not go with the rest of the install.
    #[error("job {id}: consistency {mode}: {reason}")]
    Consistency {
        /// Job id.
        id: u16,
        /// The job's consistency mode.
        mode: Consistency,
        /// What does not go with it.
        reason: &'static str,
    },
    /// A slot's element count is zero or does not fit a packet.
    #[error("job {id}: slot {slot} has {elems} elements; accepted: 1..={max} for {dtype}")]
    BadSlot {
        /// Job id.
        id: u16,
        /// Slot index.
        slot: u32,
        /// Elements given.
        elems: u32,
        /// Most elements a packet carries for this dtype.
        max: u32,
        /// The job's dtype.
        dtype: Dtype,
    },
    /// A hierarchical job's install does not fit this shard.
    #[error("job {id}: hierarchical install refused: {reason}")]
    Hierarchy {
        /// Job id.
        id: u16,
        /// What is wrong.
        reason: String,
    },
    /// More slots than a `u32` slot index can name.
    #[error("job {id}: {slots} slots on one lcore; a slot index is a u32")]
    TooManySlots {
        /// Job id.
        id: u16,
        /// Slots given.
        slots: usize,
    },
}

/// Where a contribution's elements are: for a message with SHM, in the
/// sender's staging chunk (`staging`: the job's regions), else in the
/// datagram's payload. A staged slice must go before the round's result
/// can be sent (Staging::staged); it is always inside the region:
/// install checked that every slot fits the regions' chunk stride, and
/// the message's count its slot.
fn contribution<'a>(
    staging: Option<Staging<'a>>,
    repr: &Repr,
    payload: &'a [u8],
) -> Result<&'a [u8], DropReason> {
    match staging {
        Some(s) if repr.shm() => s
            .staged(repr.rank, repr.slot, repr.payload_len())
            .ok_or(DropReason::CountMismatch),
        _ => Ok(payload),
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
    /// partial sum is queued for the chunk's home.
    Forwarded,
    /// The packet was dropped and counted under this reason.
    Dropped(DropReason),
}

const NO_ROUND: u32 = u32::MAX;

/// A rank's clock on one slot of a job that is not BSP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankClock {
    /// The last clock applied (0: only INIT), [`CLOCK_HELD`] set while the
    /// answer to it is held.
    pub clock: u32,
    /// When its answer was held (caller's clock / 1000, wrapping), or
    /// [`SINCE_UNKNOWN`] (restored from a checkpoint).
    pub since: u32,
}

/// [`RankClock::since`] of an answer held before a restart: its wait is
/// not counted.
const SINCE_UNKNOWN: u32 = u32::MAX;

/// Largest clock a rank may push (bit 31 is [`CLOCK_HELD`]).
pub const MAX_CLOCK: u32 = CLOCK_HELD - 1;

impl RankClock {
    fn applied(self) -> u32 {
        self.clock & !CLOCK_HELD
    }
    fn held(self) -> bool {
        self.clock & CLOCK_HELD != 0
    }
    /// The last clock whose answer was let go (or will be, for the
    /// duplicate of one): what a PULL reports.
    fn answered(self) -> u32 {
        if self.held() {
            self.applied().saturating_sub(1)
        } else {
            self.applied()
        }
    }
}

/// The lowest applied clock of a slot's ranks.
fn slowest(clocks: &[RankClock]) -> u32 {
    clocks.iter().map(|c| c.applied()).min().unwrap_or(0)
}

/// Which ranks contributed to the round in progress.
#[derive(Debug, Clone, Copy, Default)]
struct RankSet([u64; (MAX_WORKERS as usize).div_ceil(64)]);

impl RankSet {
    fn of(ranks: std::ops::Range<u16>) -> RankSet {
        let mut s = RankSet::default();
        for r in ranks {
            s.insert(r);
        }
        s
    }
    fn contains(&self, r: u16) -> bool {
        self.0[usize::from(r >> 6) & 3] & (1 << (r & 63)) != 0
    }
    fn insert(&mut self, r: u16) {
        self.0[usize::from(r >> 6) & 3] |= 1 << (r & 63);
    }
    fn remove(&mut self, r: u16) {
        self.0[usize::from(r >> 6) & 3] &= !(1 << (r & 63));
    }
    fn len(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

/// Where the stored result lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResultKind {
    /// f32 on the wire with a server-side optimizer: the parameters are it.
    Params,
    /// f32 sum/mean: trades places with the accumulator at completion.
    F32,
    /// f32 sum/mean of a job with shared-memory regions: the slot's chunk of
    /// the result region is the stored result, written once per round by
    /// the completing contribution (`Shard::apply_region`); no second buffer.
    Region,
    /// bf16/f16: the result encoded for the wire.
    Half,
}

/// Regions of a slot's block, in block order.
const A: usize = 0;
const B: usize = 1;
const PARAMS: usize = 2;
const S1: usize = 3;
const S2: usize = 4;
const HALF: usize = 5;

fn padded(len: usize) -> usize {
    len.next_multiple_of(LINE_F32)
}

/// Takes the next `pad` elements off `rest` and returns the first `used`.
fn cut<'a>(rest: &mut &'a mut [f32], used: usize, pad: usize) -> &'a mut [f32] {
    let (head, tail) = std::mem::take(rest).split_at_mut(pad);
    *rest = tail;
    &mut head[..used]
}

/// A slot's buffers, carved from one block of slot memory. Regions in block
/// order, each starting on a 64-byte line: A and B (the accumulator and,
/// for f32 sum/mean without shared-memory regions, the stored result, which
/// trade places at completion),
/// the parameters, the two optimizer states, and the bf16/f16 result (as
/// `u16`s). Absent regions are empty.
#[derive(Debug)]
struct SlotMem {
    /// Its block, in the job's blocks on this lcore.
    block: usize,
    /// Where its first region starts in the block, in `f32`s (a whole
    /// number of lines).
    off: usize,
    /// Elements per buffer.
    n: usize,
    /// Elements used in each region (0: absent).
    used: [usize; 6],
    /// Whether the accumulator is region A (else B; always A for
    /// [`ResultKind::Region`], which has no B).
    acc_in_a: bool,
}

/// Mutable views of a slot's buffers.
struct Bufs<'a> {
    acc: &'a mut [f32],
    params: &'a mut [f32],
    s1: &'a mut [f32],
    s2: &'a mut [f32],
    half: &'a mut [u16],
}

/// A job's blocks of slot memory on one lcore.
type Blocks = [Box<dyn SlotBlock>];

impl SlotMem {
    /// Elements of each region for a chunk of `n` elements (what
    /// [`slot_buffers`] tells admission).
    fn regions(n: usize, result: ResultKind, opt: &Optimizer) -> [usize; 6] {
        let keeps = opt.keeps_params();
        let states = opt.state_buffers();
        [
            n,
            if result == ResultKind::F32 { n } else { 0 },
            if keeps { n } else { 0 },
            if states >= 1 { n } else { 0 },
            if states >= 2 { n } else { 0 },
            if result == ResultKind::Half {
                n.div_ceil(2)
            } else {
                0
            },
        ]
    }

    /// Elements of the slot's share of its block.
    fn block_len(used: &[usize; 6]) -> usize {
        used.iter().map(|&u| padded(u)).sum()
    }

    /// The slot's share of its block.
    fn share<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        let len = Self::block_len(&self.used);
        &blocks[self.block].as_slice()[self.off..self.off + len]
    }

    /// The slot's share of its block, mutably.
    fn share_mut<'a>(&self, blocks: &'a mut Blocks) -> &'a mut [f32] {
        let len = Self::block_len(&self.used);
        &mut blocks[self.block].as_mut_slice()[self.off..self.off + len]
    }

    /// Every region, read-only.
    fn all<'a>(&self, blocks: &'a Blocks) -> [&'a [f32]; 6] {
        let mut rest = self.share(blocks);
        self.used.map(|u| {
            let (head, tail) = rest.split_at(padded(u));
            rest = tail;
            &head[..u]
        })
    }

    /// Every region, mutably.
    fn all_mut<'a>(&self, blocks: &'a mut Blocks) -> [&'a mut [f32]; 6] {
        let used = self.used;
        let mut rest = self.share_mut(blocks);
        used.map(|u| cut(&mut rest, u, padded(u)))
    }

    fn bufs<'a>(&self, blocks: &'a mut Blocks) -> Bufs<'a> {
        let n = self.n;
        let acc_in_a = self.acc_in_a;
        let half_len = if self.used[HALF] == 0 { 0 } else { n };
        let [a, b, params, s1, s2, half] = self.all_mut(blocks);
        Bufs {
            acc: if acc_in_a { a } else { b },
            params,
            s1,
            s2,
            half: &mut bytemuck::cast_slice_mut(half)[..half_len],
        }
    }

    fn acc<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        let off = if self.acc_in_a { 0 } else { padded(self.used[A]) };
        &self.share(blocks)[off..off + self.n]
    }

    fn acc_mut<'a>(&self, blocks: &'a mut Blocks) -> &'a mut [f32] {
        let off = if self.acc_in_a { 0 } else { padded(self.used[A]) };
        let n = self.n;
        &mut self.share_mut(blocks)[off..off + n]
    }

    fn params<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        self.all(blocks)[PARAMS]
    }

    /// The f32 result (sum/mean): whichever of A and B is not the
    /// accumulator.
    fn f32_result<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        self.all(blocks)[if self.acc_in_a { B } else { A }]
    }

    fn half_bytes<'a>(&self, blocks: &'a Blocks) -> &'a [u8] {
        &bytemuck::cast_slice(self.all(blocks)[HALF])[..2 * self.n]
    }
}

#[derive(Debug)]
struct Slot {
    key: u32,
    chunk: u32,
    elems: u32,
    /// Last completed round, `NO_ROUND` before round 0 completes.
    completed: u32,
    contributed: RankSet,
    ncontrib: u16,
    /// [`ResultKind::Region`] only: the rank whose shared-memory PUSH was
    /// the round's first contribution and is not summed yet; its staging
    /// chunk stands for the accumulator until the second contribution.
    deferred: Option<u16>,
    result: ResultKind,
    mem: SlotMem,
}

impl Slot {
    /// Where the result of a slot of a job with this dtype and optimizer,
    /// with shared-memory regions or not, is stored.
    fn result_kind(dtype: Dtype, opt: &Optimizer, shm: bool) -> ResultKind {
        match (dtype, opt.keeps_params()) {
            (Dtype::F32, true) => ResultKind::Params,
            (Dtype::F32, false) if shm => ResultKind::Region,
            (Dtype::F32, false) => ResultKind::F32,
            _ => ResultKind::Half,
        }
    }

    /// `f32`s of its block a slot of this chunk takes (padding included).
    fn block_len(elems: u32, dtype: Dtype, opt: &Optimizer, shm: bool) -> usize {
        SlotMem::block_len(&SlotMem::regions(
            elems as usize,
            Self::result_kind(dtype, opt, shm),
            opt,
        ))
    }

    /// A slot for chunk `c`, its buffers at `off` in block `block`.
    fn new(c: SlotChunk, dtype: Dtype, opt: &Optimizer, shm: bool, block: usize, off: usize) -> Slot {
        let n = c.elems as usize;
        let result = Self::result_kind(dtype, opt, shm);
        Slot {
            key: c.key,
            chunk: c.chunk,
            elems: c.elems,
            completed: NO_ROUND,
            contributed: RankSet::default(),
            ncontrib: 0,
            deferred: None,
            result,
            mem: SlotMem {
                block,
                off,
                n,
                used: SlotMem::regions(n, result, opt),
                acc_in_a: true,
            },
        }
    }

    fn in_progress(&self) -> u32 {
        self.completed.wrapping_add(1)
    }

    /// Where a contribution of `rank` to `round` falls in the slot's
    /// window: `true` for the last completed round (its result is to be
    /// sent again), `false` for the round in progress, which `rank` has not
    /// contributed to yet; anything else is refused (`stale`, `ahead`,
    /// `duplicate`).
    fn in_window(&self, round: u32, rank: u16) -> Result<bool, DropReason> {
        if self.completed != NO_ROUND && round == self.completed {
            return Ok(true);
        }
        if round != self.in_progress() {
            return Err(if self.completed != NO_ROUND && round < self.completed {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        }
        if self.contributed.contains(rank) {
            return Err(DropReason::Duplicate);
        }
        Ok(false)
    }

    /// The stored result (wire bytes) of this slot, slot `index` of a job
    /// whose regions are `shm`. For [`ResultKind::Region`] it is read from
    /// the result region, which install made for every slot of such a job;
    /// were it missing, the result would read as empty.
    fn result_bytes<'a>(&self, index: u32, shm: Option<&'a JobRegions>, blocks: &'a Blocks) -> &'a [u8] {
        match self.result {
            ResultKind::Params => bytemuck::cast_slice(self.mem.params(blocks)),
            ResultKind::F32 => bytemuck::cast_slice(self.mem.f32_result(blocks)),
            ResultKind::Region => shm
                .and_then(|r| r.result(index, 4 * self.mem.n))
                .unwrap_or_default(),
            ResultKind::Half => self.mem.half_bytes(blocks),
        }
    }

    /// Length in bytes of the stored result that a checkpoint keeps (none
    /// for parameters, which it keeps apart).
    fn saved_result_len(&self) -> usize {
        match self.result {
            ResultKind::Params => 0,
            ResultKind::F32 | ResultKind::Region => 4 * self.mem.n,
            ResultKind::Half => 2 * self.mem.n,
        }
    }

    /// This slot's state for a checkpoint (slot `index` of a job whose
    /// regions are `shm`), with the ranks' `clocks`.
    fn save(&self, index: u32, shm: Option<&JobRegions>, blocks: &Blocks, clocks: Vec<u32>) -> SlotState {
        let r = self.mem.all(blocks);
        SlotState {
            clocks,
            completed: (self.completed != NO_ROUND).then_some(self.completed),
            params: r[PARAMS].to_vec(),
            s1: r[S1].to_vec(),
            s2: r[S2].to_vec(),
            result: match self.result {
                ResultKind::Params => Vec::new(),
                _ => self.result_bytes(index, shm, blocks).to_vec(),
            },
        }
    }

    /// Whether saved state `st` fits this slot (with `clocks` rank clocks).
    fn fits(&self, st: &SlotState, clocks: usize) -> bool {
        let used = &self.mem.used;
        st.params.len() == used[PARAMS]
            && st.s1.len() == used[S1]
            && st.s2.len() == used[S2]
            && st.result.len() == self.saved_result_len()
            && st.completed != Some(NO_ROUND)
            && st.clocks.len() == clocks
    }

    /// Puts saved state `st` (which [`Slot::fits`]) back, no round in
    /// progress; with `acc_is_values` a bf16/f16 result is also decoded
    /// into the accumulator (a non-BSP `sum` job's current values). A
    /// [`ResultKind::Region`] result is the caller's to publish.
    fn load(&mut self, blocks: &mut Blocks, st: &SlotState, dtype: Dtype, acc_is_values: bool) {
        self.completed = st.completed.unwrap_or(NO_ROUND);
        self.contributed = RankSet::default();
        self.ncontrib = 0;
        self.deferred = None;
        let acc_in_a = self.mem.acc_in_a;
        let b = self.mem.bufs(blocks);
        b.params.copy_from_slice(&st.params);
        b.s1.copy_from_slice(&st.s1);
        b.s2.copy_from_slice(&st.s2);
        match self.result {
            ResultKind::Params | ResultKind::Region => {}
            ResultKind::Half => {
                bytemuck::cast_slice_mut(b.half).copy_from_slice(&st.result);
                if acc_is_values {
                    kernels::decode(dtype, &st.result, b.acc);
                }
            }
            ResultKind::F32 => {
                let [a, b, ..] = self.mem.all_mut(blocks);
                let r = if acc_in_a { b } else { a };
                bytemuck::cast_slice_mut(r).copy_from_slice(&st.result);
            }
        }
    }

    /// Closes the round in progress: runs the optimizer (or, for round 0,
    /// takes rank 0's payload as the initial value) and stores the result;
    /// for [`ResultKind::Region`] the result is left in the accumulator, for
    /// the caller to publish.
    fn complete(&mut self, dtype: Dtype, opt: &Optimizer, workers: u16, blocks: &mut Blocks) {
        let round = self.in_progress();
        let b = self.mem.bufs(blocks);
        if opt.keeps_params() {
            if round == 0 {
                b.params.copy_from_slice(b.acc);
                b.s1.fill(0.0);
                b.s2.fill(0.0);
            } else {
                optim::step(
                    opt,
                    u32::from(workers),
                    round,
                    ChunkBufs {
                        acc: b.acc,
                        params: b.params,
                        s1: b.s1,
                        s2: b.s2,
                    },
                );
            }
        } else if round != 0 {
            optim::step(
                opt,
                u32::from(workers),
                round,
                ChunkBufs {
                    acc: b.acc,
                    params: &mut [],
                    s1: &mut [],
                    s2: &mut [],
                },
            );
        }
        match self.result {
            ResultKind::Params => {}
            ResultKind::Half => {
                let src = if opt.keeps_params() { &*b.params } else { &*b.acc };
                kernels::encode(dtype, src, bytemuck::cast_slice_mut(b.half));
            }
            // The accumulator becomes the result; the old result's buffer
            // is overwritten by the next round's first contribution.
            ResultKind::F32 => self.mem.acc_in_a = !self.mem.acc_in_a,
            ResultKind::Region => {}
        }
        self.close();
    }

    /// Marks the round in progress completed, its result stored.
    fn close(&mut self) {
        self.completed = self.in_progress();
        self.contributed = RankSet::default();
        self.ncontrib = 0;
        self.deferred = None;
    }
}

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
    /// Not BSP: the largest lead an answer allowed (clock answered + 1 -
    /// the slot's slowest clock then), 0 before any.
    max_lead: u32,
    /// Bounded delay: answers held now.
    held: u64,
    /// Bounded delay: answers ever held, how long the released ones were
    /// held in total and at most (µs of the caller's clock).
    held_total: u64,
    held_wait_us: u64,
    held_wait_max_us: u64,
    /// Contributions aggregated on this lcore.
    pushes: u64,
    /// Rounds completed on this lcore, over all slots.
    rounds: u64,
    /// Contributions that complete a round: W, or for a hierarchical job's
    /// rack slots the rack's ranks.
    quorum: u16,
    /// Ranks that may send to this lcore: all W, or a rack's.
    members: RankSet,
    /// A hierarchical job's rack and home state (PROTOCOL.md §9).
    hier: Option<Box<Hier<A>>>,
}

impl<A> Job<A> {
    /// Who sends this job's chunks to this lcore, for the receive buffer's
    /// shares: its ranks here ([`Job::quorum`]: W, or a hierarchical job's
    /// rack ranks) if it has slots here, and its racks' appliances if this
    /// lcore is home to some of its chunks.
    fn rx_senders(&self) -> u64 {
        let ranks = if self.slots.is_empty() {
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
}

/// One job as one lcore sees it (for stats; computed on request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobShardStats {
    /// Job id.
    pub id: u16,
    /// Contributions aggregated.
    pub pushes: u64,
    /// Rounds completed over all slots.
    pub rounds_completed: u64,
    /// Lowest and highest last-completed round over the slots that have one.
    pub round_range: Option<(u32, u32)>,
    /// When each rank was last heard from (caller's clock; 0 if never).
    pub last_seen: Vec<u64>,
    /// Not BSP: per rank, its lowest and highest applied clock over the
    /// job's slots here (empty for BSP, or without slots).
    pub clocks: Vec<(u32, u32)>,
    /// Not BSP: the largest lead an answer allowed here (None before any).
    pub max_lead: Option<u32>,
    /// Bounded delay: answers held now.
    pub held: u64,
    /// Bounded delay: answers held since the job was installed here.
    pub held_total: u64,
    /// Bounded delay: microseconds the released answers were held, summed.
    pub held_wait_us: u64,
    /// Bounded delay: the longest any released answer was held, µs.
    pub held_wait_max_us: u64,
}

/// Who gets a queued result.
#[derive(Debug, Clone, Copy)]
enum To {
    /// Every rank (a completed BSP round).
    All,
    /// One rank.
    One(u16),
    /// These ranks (released bounded-delay answers).
    Set(RankSet),
}

#[derive(Debug, Clone, Copy)]
enum Pending<A> {
    /// The stored result (current values) of a slot, with the round field
    /// `round` (BSP: the slot's last completed round when sent).
    Result {
        job: u16,
        slot: u32,
        to: To,
        round: Option<u32>,
    },
    /// A refusal notice to a token-authenticated sender.
    Error { repr: Repr, to: A },
    /// A rack slot's partial sum, to the chunk's home (sent again when
    /// `resend`).
    Partial { job: u16, slot: u32, resend: bool },
    /// A home slot's stored result, to rack `rack`'s slot of the chunk.
    PartialResult { job: u16, slot: u32, rack: u16 },
}

/// The destinations of a queued message: every known rank's endpoint (or
/// those of the ranks that do, or do not, use shared memory), or one. A
/// round's result to ranks of both kinds is two transmits: the header with
/// the SHM flag and no payload to the ranks using shared memory, the header
/// and payload to the others.
#[derive(Debug, Clone)]
pub struct Ranks<'a, A> {
    all: std::iter::Enumerate<std::slice::Iter<'a, Option<A>>>,
    /// Only the ranks whose membership in the set is the flag.
    only: Option<(RankSet, bool)>,
    one: Option<A>,
}

impl<'a, A: Copy> Ranks<'a, A> {
    fn new(all: &'a [Option<A>], only: Option<(RankSet, bool)>, one: Option<A>) -> Ranks<'a, A> {
        Ranks {
            all: all.iter().enumerate(),
            only,
            one,
        }
    }
}

impl<A: Copy> Iterator for Ranks<'_, A> {
    type Item = A;
    // Cast: r indexes a job's endpoints, one per rank, fewer than
    // MAX_WORKERS (256, checked in Shard::install_with).
    #[allow(clippy::cast_possible_truncation)]
    fn next(&mut self) -> Option<A> {
        if let Some(a) = self.one.take() {
            return Some(a);
        }
        let only = self.only;
        self.all
            .by_ref()
            .filter(|(r, _)| only.is_none_or(|(set, member)| set.contains(*r as u16) == member))
            .find_map(|(_, e)| *e)
    }
}

impl<A: Copy> Destinations for Ranks<'_, A> {
    fn planned(&self) -> usize {
        self.clone().count()
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
    /// Jobs evicted lately: (id, token, until when the clock says so).
    evicted: Vec<(u16, u64, u64)>,
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
}

/// How long an evicted job's messages are answered with an ERROR
/// (`evicted`) rather than dropped as an unknown job: a minute.
pub const EVICTED_FOR_NS: u64 = 60_000_000_000;
/// The most evicted jobs one lcore remembers (the oldest is forgotten).
const MAX_EVICTED: usize = 64;

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

    /// Installs a job's slots on this lcore, or nothing of it: when the slot
    /// memory allocator runs out, what was allocated is freed and the job is
    /// refused ([`EngineError::SlotMemory`]). The job has no shared-memory
    /// regions. Allocates; call between bursts.
    pub fn install(&mut self, job: JobInstall) -> Result<(), EngineError> {
        self.install_with(job, None)
    }

    /// Installs a job as [`Shard::install`] does and, with `shm`, creates
    /// its shared-memory regions on this lcore (named after `shm.base_port`
    /// and this shard's lcore index); when they cannot be created nothing of
    /// the job is installed and no file is left
    /// ([`EngineError::SharedMemory`]). Allocates and creates files; call
    /// between bursts.
    pub fn install_shared(&mut self, job: JobInstall, shm: ShmSetup) -> Result<(), EngineError> {
        self.install_with(job, Some(shm))
    }

    fn install_with(&mut self, job: JobInstall, shm: Option<ShmSetup>) -> Result<(), EngineError> {
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
        let with_shm = shm.is_some();
        let (slots, blocks) = self
            .alloc_slots(&job.slots, job.dtype, &job.optimizer, job.chunk_elems, with_shm)
            .map_err(|reason| self.slot_memory_error(&job, with_shm, reason))?;
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
            max_lead: 0,
            held: 0,
            held_total: 0,
            held_wait_us: 0,
            held_wait_max_us: 0,
            pushes: 0,
            rounds: 0,
            quorum: job.workers,
            members: RankSet::of(0..job.workers),
            hier: None,
        });
        self.count_rx_workers();
        Ok(())
    }

    /// Installs a hierarchical job's part on this lcore (PROTOCOL.md §9):
    /// `job`'s slots are its rack slots (a `sum` job of W workers, of which
    /// `hier.ranks` send here) and `hier` says where homes and the other
    /// racks are and which home slots this lcore keeps. Whole or refused,
    /// as [`Shard::install`].
    pub fn install_hierarchical(&mut self, job: JobInstall, hier: HierInstall) -> Result<(), EngineError> {
        let id = job.id;
        let refuse = |reason: String| EngineError::Hierarchy { id, reason };
        let Some(resolve) = self.peers.0.clone() else {
            return Err(refuse(
                "this backend does not send to other appliances (kernel UDP does)".into(),
            ));
        };
        if job.consistency != Consistency::Sync || job.optimizer != Optimizer::Sum {
            return Err(refuse(
                "rack slots are BSP and only add (the sum optimizer)".into(),
            ));
        }
        let racks = hier.racks.len();
        if racks < 2 || racks > usize::from(u16::MAX) || usize::from(hier.rack) >= racks {
            return Err(refuse(format!("rack {} of {racks}", hier.rack)));
        }
        if hier.ranks.is_empty()
            || hier.ranks.end > job.workers
            || (hier.rack == 0) != (hier.ranks.start == 0)
        {
            return Err(refuse(format!(
                "ranks {:?} of {} workers (rack 0, and only it, holds rank 0)",
                hier.ranks, job.workers
            )));
        }
        let peers = |(addrs, runs): &(Vec<SocketAddrV4>, Vec<phub_proto::layout::ChunkRange>)| {
            if addrs.len() != runs.len() {
                return Err(format!("{} addresses for {} lcores", addrs.len(), runs.len()));
            }
            let addrs = addrs
                .iter()
                .map(|&a| {
                    resolve(a).ok_or_else(|| {
                        format!(
                            "this backend cannot address appliance {a} (DPDK: give its Ethernet address \
                             with --neighbor IP=MAC, or the next hop's with --gateway-mac)"
                        )
                    })
                })
                .collect::<Result<Vec<A>, String>>()?;
            Ok(Peers {
                addrs,
                runs: runs.clone(),
            })
        };
        let rack_peers = hier
            .racks
            .iter()
            .map(peers)
            .collect::<Result<Vec<_>, _>>()
            .map_err(refuse)?;
        let homes = peers(&hier.homes).map_err(refuse)?;
        // Cast: MAX_PAYLOAD is below 9000 (asserted in phub_proto::wire).
        #[allow(clippy::cast_possible_truncation)]
        let max = ((MAX_PAYLOAD / 4) as u32).min(job.chunk_elems);
        if let Some(c) = job
            .slots
            .iter()
            .chain(&hier.home_slots)
            .find(|c| c.elems == 0 || c.elems > max)
        {
            return Err(refuse(format!(
                "a home slot of {} elements; a partial carries 1..={max} f32s",
                c.elems
            )));
        }
        let home = if hier.home_slots.is_empty() {
            None
        } else {
            let (slots, blocks) = self
                .alloc_slots(
                    &hier.home_slots,
                    job.dtype,
                    &hier.optimizer,
                    job.chunk_elems,
                    false,
                )
                .map_err(|reason| EngineError::SlotMemory {
                    id,
                    bytes: hier
                        .home_slots
                        .iter()
                        .map(|c| 4 * Slot::block_len(c.elems, job.dtype, &hier.optimizer, false) as u64)
                        .sum(),
                    slots: hier.home_slots.len(),
                    from: self.mem.describe(),
                    reason,
                })?;
            Some(Home {
                first: hier.home_first,
                slots,
                blocks,
            })
        };
        let nslots = job.slots.len();
        let workers = job.workers;
        self.install_with(job, None)?;
        // Cast: racks <= u16::MAX (checked above); the ranks are below W.
        #[allow(clippy::cast_possible_truncation)]
        let (racks, quorum) = (racks as u16, hier.ranks.len() as u16);
        // A completed home round queues one message per rack.
        self.pending.reserve(usize::from(racks) * MAX_BURST);
        let j = self.jobs.last_mut().expect("installed just now");
        j.quorum = quorum;
        j.members = RankSet::of(hier.ranks.clone());
        j.hier = Some(Box::new(Hier {
            rack: hier.rack,
            racks,
            workers,
            optimizer: hier.optimizer,
            first: hier.first,
            rack_peers,
            homes,
            partials: vec![Partial::default(); nslots],
            next_deadline: u64::MAX,
            rtt: hier::Rtt::default(),
            home,
        }));
        // Its senders here are its rack's ranks and, to home slots, the racks.
        self.count_rx_workers();
        Ok(())
    }

    /// Slots for `chunks` and their blocks of slot memory: in slot order,
    /// as many to a block as [`BLOCK_BYTES`] holds of full chunks' buffers,
    /// each block exactly as long as its slots' buffers. When the allocator
    /// fails, what it gave is freed and its answer returned.
    #[allow(clippy::type_complexity)]
    fn alloc_slots(
        &self,
        chunks: &[SlotChunk],
        dtype: Dtype,
        opt: &Optimizer,
        chunk_elems: u32,
        with_shm: bool,
    ) -> Result<(Vec<Slot>, Vec<Box<dyn SlotBlock>>), String> {
        let full = 4 * Slot::block_len(chunk_elems, dtype, opt, with_shm) as u64;
        // Cast: at most BLOCK_BYTES (2 MiB) slots.
        #[allow(clippy::cast_possible_truncation)]
        let per_block = (BLOCK_BYTES / full.max(1)).max(1) as usize;
        let mut slots = Vec::with_capacity(chunks.len());
        let mut blocks: Vec<Box<dyn SlotBlock>> = Vec::with_capacity(chunks.len().div_ceil(per_block));
        for group in chunks.chunks(per_block) {
            let len: usize = group
                .iter()
                .map(|c| Slot::block_len(c.elems, dtype, opt, with_shm))
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
                slots.push(Slot::new(c, dtype, opt, with_shm, blocks.len(), off));
                off += Slot::block_len(c.elems, dtype, opt, with_shm);
            }
            blocks.push(block);
        }
        Ok((slots, blocks))
    }

    /// The refusal of `job` when slot memory runs out: what all its slots
    /// needed, and what the allocator said.
    fn slot_memory_error(&self, job: &JobInstall, shm: bool, reason: String) -> EngineError {
        EngineError::SlotMemory {
            id: job.id,
            bytes: job
                .slots
                .iter()
                .map(|c| 4 * Slot::block_len(c.elems, job.dtype, &job.optimizer, shm) as u64)
                .sum(),
            slots: job.slots.len(),
            from: self.mem.describe(),
            reason,
        }
    }

    /// Removes a job, frees its slots and removes its shared-memory regions;
    /// returns whether it was installed. Pending transmits for it are
    /// discarded.
    /// Evicts a job at `now`: removes it ([`Shard::remove`]) and, for
    /// [`EVICTED_FOR_NS`], answers its ranks' messages (with its token)
    /// with an ERROR `evicted` instead of dropping them as an unknown job.
    /// Returns whether it was installed.
    pub fn evict(&mut self, id: u16, now: u64) -> bool {
        let Some(token) = self.job(id).map(|j| j.token) else {
            return false;
        };
        self.evicted.retain(|e| e.0 != id && e.2 > now);
        if self.evicted.len() == MAX_EVICTED {
            self.evicted.remove(0);
        }
        self.evicted.push((id, token, now.saturating_add(EVICTED_FOR_NS)));
        self.remove(id)
    }

    /// Whether job `id` with `token` was evicted lately (at `now`).
    fn was_evicted(&self, id: u16, token: u64, now: u64) -> bool {
        self.evicted
            .iter()
            .any(|&(j, t, until)| j == id && t == token && now < until)
    }

    /// Refuses `repr`'s message from `from` for `reason`: an ERROR (the
    /// message's header, type ERROR, no payload, the reason's code) goes
    /// back where the reason tells the sender ([`DropReason::notifies_sender`]).
    fn refuse(&mut self, from: A, repr: Repr, reason: DropReason) -> Verdict {
        if reason.notifies_sender() {
            self.counters.errors_sent.inc();
            let e = Repr {
                kind: MsgType::Error,
                count: 0,
                error: reason.code(),
                flags: 0,
                ..repr
            };
            self.pending.push(Pending::Error { repr: e, to: from });
        }
        Verdict::Dropped(reason)
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
                self.pending.push(Pending::Error { repr, to });
                queued += 1;
            }
        }
        self.counters.errors_sent.add(queued as u64);
        queued
    }

    /// Removes a job (nothing is remembered of it; see [`Shard::evict`]).
    pub fn remove(&mut self, id: u16) -> bool {
        self.pending
            .retain(|p| !matches!(p, Pending::Result { job, .. } if *job == id));
        let before = self.jobs.len();
        self.jobs.retain(|j| j.id != id);
        self.count_rx_workers();
        before != self.jobs.len()
    }

    /// Ids of the installed jobs.
    pub fn job_ids(&self) -> impl Iterator<Item = u16> + '_ {
        self.jobs.iter().map(|j| j.id)
    }

    /// Bytes a job holds on this lcore, counted from what was allocated
    /// as [`memory_model`] tells admission: its blocks' buffers and each
    /// block's overhead, its slot records, its record and its ranks'
    /// entries, its regions' handles (the region files apart).
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
                + hier,
        )
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
        (s.completed != NO_ROUND).then(|| (s.completed, s.result_bytes(slot, j.shm.as_ref(), &j.blocks)))
    }

    /// A slot's parameters (`f32`), for jobs with a server-side optimizer.
    pub fn params(&self, id: u16, slot: u32) -> Option<&[f32]> {
        let j = self.job(id)?;
        let s = j.slots.get(slot as usize)?;
        j.optimizer.keeps_params().then(|| s.mem.params(&j.blocks))
    }

    /// The durable state of every slot of a job (completed round,
    /// parameters, optimizer state, stored result), for a checkpoint. The
    /// round in progress is not saved: its contributors never got a result
    /// and will push again. Allocates; call between bursts.
    pub fn snapshot(&self, id: u16) -> Option<Vec<SlotState>> {
        let j = self.job(id)?;
        let w = usize::from(j.workers);
        let racks = j.slots.iter().zip(0..).map(|(s, i)| {
            let at = i as usize * w;
            let clocks = j
                .clocks
                .get(at..at + w)
                .map_or_else(Vec::new, |c| c.iter().map(|c| c.clock).collect());
            s.save(i, j.shm.as_ref(), &j.blocks, clocks)
        });
        // A hierarchical job's home slots follow its rack slots.
        let homes = j
            .hier
            .as_ref()
            .and_then(|h| h.home.as_ref())
            .into_iter()
            .flat_map(|h| {
                h.slots
                    .iter()
                    .zip(0..)
                    .map(|(s, i)| s.save(i, None, &h.blocks, Vec::new()))
            });
        Some(racks.chain(homes).collect())
    }

    /// Puts slots back in the state a [`Shard::snapshot`] saved. Every
    /// length is checked before anything changes. A job with shared-memory
    /// regions gets every restored result written into its result region.
    pub fn restore(&mut self, id: u16, state: &[SlotState]) -> Result<(), EngineError> {
        let j = self
            .jobs
            .iter_mut()
            .find(|j| j.id == id)
            .ok_or(EngineError::Restore {
                id,
                reason: "the job is not installed".into(),
            })?;
        let mut home = j.hier.as_mut().and_then(|h| h.home.as_mut());
        let homes = home.as_ref().map_or(0, |h| h.slots.len());
        if state.len() != j.slots.len() + homes {
            return Err(EngineError::Restore {
                id,
                reason: format!(
                    "{} slots saved, {} installed ({homes} of them home slots)",
                    state.len(),
                    j.slots.len() + homes
                ),
            });
        }
        let (state, home_state) = state.split_at(j.slots.len());
        let nclocks = j.clocks.len() / j.slots.len().max(1);
        let home_slots = home.as_ref().map_or(&[][..], |h| &h.slots[..]);
        let all = j
            .slots
            .iter()
            .map(|s| (s, nclocks))
            .chain(home_slots.iter().map(|s| (s, 0)));
        if let Some(i) = all
            .zip(state.iter().chain(home_state))
            .position(|((s, n), st)| !s.fits(st, n))
        {
            return Err(EngineError::Restore {
                id,
                reason: format!("slot {i}: saved buffers do not fit the installed chunk"),
            });
        }
        if let Some(h) = &mut home {
            for (slot, st) in h.slots.iter_mut().zip(home_state) {
                slot.load(&mut h.blocks, st, j.dtype, false);
            }
        }
        if let Some(h) = &mut j.hier {
            // Nothing is on its way to a home after a restore.
            h.partials.fill(Partial::default());
            h.next_deadline = u64::MAX;
        }
        // Cast (here and in the loop below): i < j.slots.len(), which fits
        // a u32 (checked in install_with).
        #[allow(clippy::cast_possible_truncation)]
        for (i, (slot, st)) in j.slots.iter_mut().zip(state).enumerate() {
            let w = st.clocks.len();
            for (c, &saved) in j.clocks[i * w..(i + 1) * w].iter_mut().zip(&st.clocks) {
                *c = RankClock {
                    clock: saved,
                    since: SINCE_UNKNOWN,
                };
            }
            // Not BSP, sum: the current values in f32 live in the
            // accumulator, which the checkpoint keeps as the result.
            let acc_is_values = w > 0 && !j.optimizer.keeps_params();
            slot.load(&mut j.blocks, st, j.dtype, acc_is_values);
            // The result region is where the result is stored: every
            // slot's saved bytes go there, so that a snapshot reads them
            // back. Between bursts: no worker holds a RESULT of this job
            // from this lcore that it has not copied out yet.
            if let (ResultKind::Region, Some(shm)) = (slot.result, &mut j.shm) {
                shm.publish(i as u32, &st.result);
            }
        }
        j.held = j.clocks.iter().filter(|c| c.held()).count() as u64;
        if let Some(shm) = &mut j.shm {
            #[allow(clippy::cast_possible_truncation)]
            for (i, slot) in j.slots.iter().enumerate() {
                if slot.completed != NO_ROUND && slot.result != ResultKind::Region {
                    shm.publish(i as u32, slot.result_bytes(i as u32, None, &j.blocks));
                }
            }
        }
        Ok(())
    }

    /// Stats of every installed job. Allocates; call between bursts.
    pub fn job_stats(&self) -> Vec<JobShardStats> {
        self.jobs
            .iter()
            .map(|j| {
                let done = j.slots.iter().map(|s| s.completed).filter(|&r| r != NO_ROUND);
                let round_range = done.fold(None, |acc: Option<(u32, u32)>, r| {
                    Some(acc.map_or((r, r), |(lo, hi)| (lo.min(r), hi.max(r))))
                });
                let w = usize::from(j.workers);
                let clocks = if j.clocks.is_empty() {
                    Vec::new()
                } else {
                    (0..w)
                        .map(|r| {
                            let mine = j.clocks.iter().skip(r).step_by(w).map(|c| c.applied());
                            mine.fold((u32::MAX, 0), |(lo, hi), c| (lo.min(c), hi.max(c)))
                        })
                        .collect()
                };
                JobShardStats {
                    id: j.id,
                    pushes: j.pushes,
                    rounds_completed: j.rounds,
                    round_range,
                    last_seen: j.last_seen.clone(),
                    clocks,
                    max_lead: (j.max_lead > 0).then_some(j.max_lead),
                    held: j.held,
                    held_total: j.held_total,
                    held_wait_us: j.held_wait_us,
                    held_wait_max_us: j.held_wait_max_us,
                }
            })
            .collect()
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
                job.pushes += 1;
                self.counters.pushes_aggregated.inc();
                Verdict::Aggregated
            }
            Ok(Step::Closed) => {
                job.pushes += 1;
                self.counters.pushes_aggregated.inc();
                self.counters.rounds_completed.inc();
                round_done(&mut self.pending, &self.counters, job, repr.slot)
            }
            Ok(Step::Forward) => {
                job.pushes += 1;
                self.counters.pushes_aggregated.inc();
                self.counters.partials_sent.inc();
                self.pending.push(Pending::Partial {
                    job: job.id,
                    slot: repr.slot,
                    resend: false,
                });
                Verdict::Forwarded
            }
            Ok(Step::Applied { held, slowest_rose }) => {
                job.pushes += 1;
                job.rounds += 1;
                self.counters.pushes_aggregated.inc();
                self.counters.rounds_completed.inc();
                if held {
                    job.held += 1;
                    job.held_total += 1;
                    self.counters.answers_held.inc();
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
                    Self::release(job, repr.slot, now, &mut self.pending, &self.counters);
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
                // each counted
                // under its own counter.
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

    /// A PARTIAL or PARTIAL_RESULT of installed job `i` with its token
    /// (PROTOCOL.md §9.3, §9.4). Refusals are counted, never answered: the
    /// sender is an appliance.
    fn peer_message(&mut self, i: usize, from: A, repr: &Repr, payload: &[u8], now: u64) -> Verdict {
        if self.closing {
            return Verdict::Dropped(DropReason::ShuttingDown);
        }
        let (job, c) = (&mut self.jobs[i], &self.counters);
        if repr.kind == MsgType::PartialResult {
            return match Self::on_partial_result(job, from, repr, payload, now) {
                Ok(()) => round_done(&mut self.pending, c, job, repr.slot),
                Err(r) => Verdict::Dropped(r),
            };
        }
        match Self::on_partial(&self.kernels, job, from, repr, payload) {
            Ok(Step::Open) => {
                c.pushes_aggregated.inc();
                Verdict::Aggregated
            }
            Ok(Step::Closed) => {
                c.pushes_aggregated.inc();
                c.rounds_completed.inc();
                let racks = job.hier.as_ref().map_or(0, |h| h.racks);
                c.partial_results_sent.add(u64::from(racks));
                self.pending.extend((0..racks).map(|rack| Pending::PartialResult {
                    job: job.id,
                    slot: repr.slot,
                    rack,
                }));
                Verdict::Completed
            }
            Ok(_) => {
                c.partial_results_resent.inc();
                self.pending.push(Pending::PartialResult {
                    job: job.id,
                    slot: repr.slot,
                    rack: repr.rank,
                });
                Verdict::Resent
            }
            Err(r) => Verdict::Dropped(r),
        }
    }

    /// A rack's PARTIAL at a home slot: the slot rules of §5 with the racks
    /// as ranks (§9.4). `Step::Resend` asks for the stored result to go to
    /// the sending rack again. Only the lcore of rack `repr.rank`'s
    /// appliance that holds the chunk's rack slot (the one that sends its
    /// partials, from its own port) may speak for that rack: a partial from
    /// any other address is `wrong_peer`, whatever token it carries, so a
    /// worker cannot stand in for a whole rack.
    fn on_partial(
        k: &Kernels,
        job: &mut Job<A>,
        from: A,
        repr: &Repr,
        payload: &[u8],
    ) -> Result<Step, DropReason> {
        let dtype = job.dtype;
        let h = job.hier.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        if repr.rank >= h.racks {
            return Err(DropReason::RankOutOfRange);
        }
        // Where the rack's slot of this chunk is: its sender (None for a
        // slot that is no home slot here; slot_for refuses that first).
        let sender = h.rack_slot_of(repr.rank, repr.slot).map(|(at, _)| at);
        let home = h.home.as_mut().ok_or(DropReason::SlotOutOfRange)?;
        let slot = slot_for(&mut home.slots, repr, Dtype::F32)?;
        let carries = repr.round != 0 || repr.rank == 0;
        if u32::from(repr.count) != if carries { slot.elems } else { 0 } {
            return Err(DropReason::CountMismatch);
        }
        if sender != Some(from) {
            return Err(DropReason::WrongPeer);
        }
        if repr.round == NO_ROUND {
            return Err(DropReason::Ahead);
        }
        if slot.in_window(repr.round, repr.rank)? {
            return Ok(Step::Resend(None));
        }
        if carries {
            if slot.ncontrib == 0 || repr.round == 0 {
                k.copy(Dtype::F32, slot.mem.acc_mut(&mut home.blocks), payload);
            } else {
                k.add(Dtype::F32, slot.mem.acc_mut(&mut home.blocks), payload);
            }
        }
        slot.contributed.insert(repr.rank);
        slot.ncontrib += 1;
        if slot.ncontrib < h.racks {
            return Ok(Step::Open);
        }
        slot.complete(dtype, &h.optimizer, h.workers, &mut home.blocks);
        Ok(Step::Closed)
    }

    /// The home's PARTIAL_RESULT at a rack slot whose partial waits for it:
    /// it becomes the stored result and the round completes (§9.3).
    fn on_partial_result(
        job: &mut Job<A>,
        from: A,
        repr: &Repr,
        payload: &[u8],
        now: u64,
    ) -> Result<(), DropReason> {
        let h = job.hier.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        if repr.rank != APPLIANCE_RANK {
            return Err(DropReason::RankOutOfRange);
        }
        let slot = slot_for(&mut job.slots, repr, job.dtype)?;
        if u32::from(repr.count) != slot.elems {
            return Err(DropReason::CountMismatch);
        }
        if h.home_of(repr.slot).is_none_or(|(home, _)| home != from) {
            return Err(DropReason::WrongPeer);
        }
        let p = &mut h.partials[repr.slot as usize];
        if p.round == NO_ROUND || repr.round != p.round {
            let done = slot.completed != NO_ROUND && repr.round <= slot.completed;
            return Err(if done || (p.round != NO_ROUND && repr.round < p.round) {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        }
        if p.resends == 0 {
            h.rtt.sample(now.saturating_sub(p.sent));
        }
        *p = Partial::default();
        let n = 2 * slot.mem.n;
        let [a, b, .., half] = slot.mem.all_mut(&mut job.blocks);
        match slot.result {
            ResultKind::F32 => {
                let r = if slot.mem.acc_in_a { b } else { a };
                bytemuck::cast_slice_mut(r).copy_from_slice(payload);
            }
            ResultKind::Half => bytemuck::cast_slice_mut::<f32, u8>(half)[..n].copy_from_slice(payload),
            // Rack slots are installed as sum jobs without shared memory.
            ResultKind::Params | ResultKind::Region => return Err(DropReason::DtypeMismatch),
        }
        slot.close();
        Ok(())
    }

    /// Resends the partial sums whose home has not answered in time
    /// (PROTOCOL.md §9.3 rule 4), at most [`MAX_BURST`] per call (the rest
    /// at the next); cheap when none is due. Call between bursts with the
    /// clock `handle` gets.
    pub fn poll_timers(&mut self, now: u64) {
        let mut budget = MAX_BURST;
        for j in &mut self.jobs {
            let Some(h) = j.hier.as_deref_mut() else {
                continue;
            };
            if now < h.next_deadline {
                continue;
            }
            let mut rtt = h.rtt;
            let mut timed_out = false;
            let mut next = u64::MAX;
            // Cast: i indexes the job's slots, which fit a u32 (install).
            #[allow(clippy::cast_possible_truncation)]
            for (i, p) in h.partials.iter_mut().enumerate() {
                if p.round == NO_ROUND {
                    continue;
                }
                if p.deadline <= now && budget > 0 {
                    budget -= 1;
                    if !timed_out {
                        // Once per call, however many partials were due.
                        rtt.back_off();
                        timed_out = true;
                    }
                    p.resends = p.resends.saturating_add(1);
                    p.deadline = now.saturating_add(rtt.rto(p.resends));
                    self.pending.push(Pending::Partial {
                        job: j.id,
                        slot: i as u32,
                        resend: true,
                    });
                    self.counters.partials_resent.inc();
                }
                next = next.min(p.deadline);
            }
            h.next_deadline = next;
            h.rtt = rtt;
        }
    }

    /// The slot and round rules for an authenticated packet.
    fn apply(
        k: &Kernels,
        job: &mut Job<A>,
        repr: &Repr,
        payload: &[u8],
        now: u64,
    ) -> Result<Step, DropReason> {
        let slot = slot_for(&mut job.slots, repr, job.dtype)?;
        let carries = match repr.kind {
            MsgType::Pull => false,
            MsgType::Init => repr.rank == 0,
            _ => true,
        };
        let expect = if carries { slot.elems } else { 0 };
        if u32::from(repr.count) != expect {
            return Err(DropReason::CountMismatch);
        }
        // Not BSP: this slot's rank clocks.
        let w = usize::from(job.workers);
        let at = repr.slot as usize * w;
        let clocks = job.clocks.get_mut(at..at + w);
        if repr.kind == MsgType::Pull {
            return if slot.completed == NO_ROUND {
                Err(DropReason::NothingToPull)
            } else {
                Ok(Step::Resend(clocks.map(|c| c[usize::from(repr.rank)].answered())))
            };
        }
        if (repr.kind == MsgType::Init) != (repr.round == 0) {
            return Err(DropReason::WrongTypeForRound);
        }
        if repr.round == NO_ROUND {
            // The largest round a slot can complete is NO_ROUND - 1.
            return Err(DropReason::Ahead);
        }
        if let Some(clocks) = clocks {
            if slot.completed != NO_ROUND {
                // Past round 0, the INIT barrier every mode shares.
                let (consistency, opt, dtype) = (job.consistency, &job.optimizer, job.dtype);
                let step = Self::apply_clocked(
                    k,
                    (slot, &mut job.blocks),
                    clocks,
                    consistency,
                    opt,
                    dtype,
                    repr,
                    payload,
                    now,
                )?;
                if let Step::Applied { held: false, .. } = step {
                    let lead = repr
                        .round
                        .saturating_add(1)
                        .saturating_sub(slowest(&job.clocks[at..at + w]));
                    job.max_lead = job.max_lead.max(lead);
                }
                return Ok(step);
            }
        }
        // PROTOCOL.md §5.4 rule 5: a round older than the last completed
        // one comes from a rank repeating rounds (after a pull); every
        // round since completed with its contribution, so the stored result
        // (with its own round) answers it, as it does a lost result.
        if slot.completed != NO_ROUND && repr.round < slot.completed {
            return Ok(Step::Resend(None));
        }
        if slot.in_window(repr.round, repr.rank)? {
            return Ok(Step::Resend(None));
        }
        let last = slot.ncontrib + 1 == job.quorum;
        if let (ResultKind::Region, MsgType::Push, Some(shm)) = (slot.result, repr.kind, &mut job.shm) {
            return Self::apply_region(
                k,
                job.workers,
                &job.optimizer,
                shm,
                (slot, &mut job.blocks),
                repr,
                payload,
            );
        }
        if carries {
            let payload = contribution(job.shm.as_ref().map(JobRegions::staging), repr, payload)?;
            if slot.ncontrib == 0 || repr.kind == MsgType::Init {
                k.copy(job.dtype, slot.mem.acc_mut(&mut job.blocks), payload);
            } else {
                k.add(job.dtype, slot.mem.acc_mut(&mut job.blocks), payload);
            }
        }
        slot.contributed.insert(repr.rank);
        slot.ncontrib += 1;
        if let (true, Some(h)) = (last, &mut job.hier) {
            // A rack slot: the rack's sum goes to the chunk's home, and the
            // round completes when its result comes back (PROTOCOL.md §9.3).
            let p = &mut h.partials[repr.slot as usize];
            *p = Partial {
                round: slot.in_progress(),
                sent: now,
                deadline: now.saturating_add(h.rtt.rto(0)),
                resends: 0,
            };
            h.next_deadline = h.next_deadline.min(p.deadline);
            return Ok(Step::Forward);
        }
        if last {
            slot.complete(job.dtype, &job.optimizer, job.workers, &mut job.blocks);
            if let Some(shm) = &mut job.shm {
                // Once per round, before any RESULT header leaves. A
                // Region slot gets here only for round 0 (INIT): its
                // result, rank 0's initial value, is in the accumulator.
                let bytes = match slot.result {
                    ResultKind::Region => bytemuck::cast_slice(slot.mem.acc_mut(&mut job.blocks)),
                    _ => slot.result_bytes(repr.slot, None, &job.blocks),
                };
                shm.publish(repr.slot, bytes);
            }
            Ok(Step::Closed)
        } else {
            Ok(Step::Open)
        }
    }

    /// A PUSH (or a late INIT) of a job that is not BSP, to a slot past
    /// round 0: the clock rules of the invariants above. `clocks` are the
    /// slot's ranks'.
    #[allow(clippy::too_many_arguments)]
    fn apply_clocked(
        k: &Kernels,
        (slot, blocks): (&mut Slot, &mut Blocks),
        clocks: &mut [RankClock],
        consistency: Consistency,
        opt: &Optimizer,
        dtype: Dtype,
        repr: &Repr,
        payload: &[u8],
        now: u64,
    ) -> Result<Step, DropReason> {
        let mine = clocks[usize::from(repr.rank)];
        let c = repr.round;
        if c <= mine.applied() {
            // A duplicate (or a late INIT): never applied again. Answered
            // with the current values unless this rank's answer is held,
            // which the release will send.
            return if mine.held() {
                Err(DropReason::Duplicate)
            } else {
                Ok(Step::Resend(Some(c)))
            };
        }
        if mine.held() || c != mine.applied() + 1 || c > MAX_CLOCK {
            return Err(DropReason::Ahead);
        }
        let before = slowest(clocks);
        let payload = contribution(None, repr, payload)?;
        // The slot's update count is the optimizer's step t.
        slot.completed = slot.completed.saturating_add(1).min(NO_ROUND - 1);
        let t = slot.completed;
        if opt.keeps_params() {
            let b = slot.mem.bufs(blocks);
            k.copy(dtype, b.acc, payload);
            optim::step(
                opt,
                1,
                t,
                ChunkBufs {
                    acc: b.acc,
                    params: b.params,
                    s1: b.s1,
                    s2: b.s2,
                },
            );
            if slot.result == ResultKind::Half {
                kernels::encode(dtype, b.params, bytemuck::cast_slice_mut(b.half));
            }
        } else {
            // Sum: the values pushed are added to the stored ones.
            match slot.result {
                ResultKind::F32 => {
                    let [a, b, ..] = slot.mem.all_mut(blocks);
                    k.add(dtype, if slot.mem.acc_in_a { b } else { a }, payload);
                }
                _ => {
                    // Half: the current values in f32 are the accumulator
                    // (round 0 left them there); the result is them encoded.
                    let b = slot.mem.bufs(blocks);
                    k.add(dtype, b.acc, payload);
                    kernels::encode(dtype, b.acc, bytemuck::cast_slice_mut(b.half));
                }
            }
        }
        clocks[usize::from(repr.rank)].clock = c;
        let after = slowest(clocks);
        let held = match consistency {
            Consistency::Bounded { delay } => u64::from(c) > u64::from(after) + u64::from(delay),
            _ => false,
        };
        if held {
            // Cast: microseconds of the caller's clock, kept modulo 2^32.
            #[allow(clippy::cast_possible_truncation)]
            let since = ((now / 1000) as u32).min(SINCE_UNKNOWN - 1);
            clocks[usize::from(repr.rank)] = RankClock {
                clock: c | CLOCK_HELD,
                since,
            };
        }
        Ok(Step::Applied {
            held,
            slowest_rose: after > before && matches!(consistency, Consistency::Bounded { .. }),
        })
    }

    /// Bounded delay: after slot `slot`'s lowest clock rose, releases every
    /// held answer whose clock is now within τ of it, one RESULT per clock
    /// (all of them share one clock in every state the engine reaches: the
    /// lowest clock rises by one at a time).
    fn release(
        job: &mut Job<A>,
        slot: u32,
        now: u64,
        pending: &mut Vec<Pending<A>>,
        counters: &ShardCounters,
    ) {
        let Consistency::Bounded { delay } = job.consistency else {
            return;
        };
        let w = usize::from(job.workers);
        let at = slot as usize * w;
        let Some(clocks) = job.clocks.get_mut(at..at + w) else {
            return;
        };
        let low = slowest(clocks);
        let limit = u64::from(low) + u64::from(delay);
        // Cast: microseconds of the caller's clock, kept modulo 2^32.
        #[allow(clippy::cast_possible_truncation)]
        let now_us = (now / 1000) as u32;
        loop {
            let mut ranks = RankSet::default();
            let mut clock = None;
            let mut n = 0u64;
            // Cast: r < workers, a u16.
            #[allow(clippy::cast_possible_truncation)]
            for (r, c) in clocks.iter_mut().enumerate() {
                if !c.held() || u64::from(c.applied()) > limit || clock.is_some_and(|k| k != c.applied()) {
                    continue;
                }
                clock = Some(c.applied());
                ranks.insert(r as u16);
                n += 1;
                if c.since != SINCE_UNKNOWN {
                    let waited = u64::from(now_us.wrapping_sub(c.since));
                    counters.held_wait_us.add(waited);
                    job.held_wait_us += waited;
                    job.held_wait_max_us = job.held_wait_max_us.max(waited);
                }
                *c = RankClock {
                    clock: c.applied(),
                    since: 0,
                };
            }
            let Some(clock) = clock else { return };
            job.held = job.held.saturating_sub(n);
            job.max_lead = job.max_lead.max(clock.saturating_add(1).saturating_sub(low));
            counters.answers_released.add(n);
            counters.results_sent.add(n);
            pending.push(Pending::Result {
                job: job.id,
                slot,
                to: To::Set(ranks),
                round: Some(clock),
            });
        }
    }

    /// A PUSH to a [`ResultKind::Region`] slot (f32 sum/mean of a job with
    /// regions), with at most one pass over memory per contribution:
    /// - a first contribution by shared memory, unless it is the last, is
    ///   not read yet (`Slot::deferred`): the rank does not write that
    ///   staging chunk again before it holds this round's result (§3.4),
    ///   which needs the second contribution, where it is read;
    /// - the second sums the deferred chunk and its own values into the
    ///   accumulator in one pass;
    /// - the last writes `(accumulator + its values)`, scaled for the mean,
    ///   with streaming stores ([`Kernels::sum_f32_stream`]: no read for
    ///   ownership, the lines not kept in this core's cache)
    ///   straight into the slot's chunk of the result region, which is the
    ///   slot's stored result. The lcore alone writes that region; this
    ///   chunk of it was last written when the previous round completed,
    ///   and every rank has since pushed this round, which a rank does only
    ///   after copying that result out (the worker's wait), so no one reads
    ///   it now. The RESULT headers leave after this returns.
    ///
    /// Sums are taken in arrival order, each rounded as the plain path's
    /// copy, adds and mean pass round them: results are bit-identical.
    fn apply_region(
        k: &Kernels,
        workers: u16,
        opt: &Optimizer,
        shm: &mut JobRegions,
        (slot, blocks): (&mut Slot, &mut Blocks),
        repr: &Repr,
        payload: &[u8],
    ) -> Result<Step, DropReason> {
        let last = slot.ncontrib + 1 == workers;
        let len = repr.payload_len();
        if slot.ncontrib == 0 && repr.shm() && !last {
            slot.deferred = Some(repr.rank);
            slot.contributed.insert(repr.rank);
            slot.ncontrib = 1;
            return Ok(Step::Open);
        }
        // The deferred first contribution's chunk, as `contribution` reads
        // a chunk (same lifetime and bounds).
        fn first_chunk(staging: Staging<'_>, rank: u16, slot: u32, len: usize) -> Result<&[u8], DropReason> {
            staging.staged(rank, slot, len).ok_or(DropReason::CountMismatch)
        }
        let staged = |staging, rank| first_chunk(staging, rank, repr.slot, len);
        let n = slot.elems as usize;
        if last {
            let (staging, out) = shm.result_mut(repr.slot, n).ok_or(DropReason::CountMismatch)?;
            let src = contribution(Some(staging), repr, payload)?;
            // What optim::step's mean pass multiplies by, rounded apart from
            // the addition as it is there.
            let scale = match opt {
                Optimizer::Mean => optim::inv_workers(u32::from(workers)),
                _ => 1.0,
            };
            match (slot.ncontrib, slot.deferred) {
                (0, _) => {
                    // W = 1: the contribution alone, then the mean's pass.
                    k.copy(Dtype::F32, out, src);
                    let bufs = ChunkBufs {
                        acc: out,
                        params: &mut [],
                        s1: &mut [],
                        s2: &mut [],
                    };
                    optim::step(opt, u32::from(workers), repr.round, bufs);
                }
                // Streaming stores: the result region is read next by the
                // ranks' processes, not by this lcore, and a round's
                // results outgrow the cache for models of any size.
                (_, Some(first)) => k.sum_f32_stream(out, staged(staging, first)?, src, scale),
                (_, None) => {
                    k.sum_f32_stream(out, bytemuck::cast_slice(slot.mem.acc_mut(blocks)), src, scale)
                }
            }
            slot.close();
            return Ok(Step::Closed);
        }
        let staging = shm.staging();
        let src = contribution(Some(staging), repr, payload)?;
        match (slot.ncontrib, slot.deferred) {
            (0, _) => k.copy(Dtype::F32, slot.mem.acc_mut(blocks), src),
            (_, Some(first)) => k.sum_f32(slot.mem.acc_mut(blocks), staged(staging, first)?, src, 1.0),
            (_, None) => k.add(Dtype::F32, slot.mem.acc_mut(blocks), src),
        }
        slot.deferred = None;
        slot.contributed.insert(repr.rank);
        slot.ncontrib += 1;
        Ok(Step::Open)
    }

    /// What must be sent now, in the order it was queued.
    pub fn transmits(&self) -> impl Iterator<Item = Transmit<'_, Ranks<'_, A>>> + '_ {
        self.pending.iter().flat_map(move |p| {
            let [a, b] = self.transmits_of(p);
            a.into_iter().chain(b)
        })
    }

    /// The one or two transmits of a queued message: a result to ranks of
    /// both kinds (shared memory or not) is two.
    fn transmits_of(&self, p: &Pending<A>) -> [Option<Transmit<'_, Ranks<'_, A>>>; 2] {
        let (job, slot, to, round) = match *p {
            Pending::Result { job, slot, to, round } => (job, slot, to, round),
            Pending::Error { repr, to } => {
                let t = Transmit {
                    header: repr.to_bytes(),
                    payload: &[],
                    to: Ranks::new(&[], None, Some(to)),
                };
                return [Some(t), None];
            }
            Pending::Partial { job, slot, resend } => {
                return [self.partial_transmit(job, slot, resend), None]
            }
            Pending::PartialResult { job, slot, rack } => {
                return [self.partial_result_transmit(job, slot, rack), None];
            }
        };
        let Some((j, s)) = self.job(job).and_then(|j| Some((j, j.slots.get(slot as usize)?))) else {
            return [None, None];
        };
        let repr = answer(MsgType::Result, j, s, round.unwrap_or(s.completed), slot);
        let share = self.rx_share(j);
        let stamped = |r: Repr| {
            let mut h = r.to_bytes();
            wire::Header::new_unchecked(&mut h[..]).set_rx_share(share);
            h
        };
        let plain = |to| Transmit {
            header: stamped(repr),
            payload: s.result_bytes(slot, j.shm.as_ref(), &j.blocks),
            to,
        };
        // The result is in the result region: the header says so, alone.
        let shm = |to| Transmit {
            header: stamped(Repr {
                flags: flags::SHM,
                ..repr
            }),
            payload: &[],
            to,
        };
        let ranks = |only| Ranks::new(&j.endpoints, only, None);
        match to {
            // Non-BSP jobs have no shared-memory regions: datagrams alone.
            To::Set(set) => [Some(plain(ranks(Some((set, true))))), None],
            To::One(r) => {
                let one = Ranks::new(&[], None, j.endpoints.get(usize::from(r)).copied().flatten());
                if j.shm_ranks.contains(r) {
                    [Some(shm(one)), None]
                } else {
                    [Some(plain(one)), None]
                }
            }
            To::All => match j.shm_ranks.len() {
                0 => [Some(plain(ranks(None))), None],
                n if n == u32::from(j.workers) => [Some(shm(ranks(None))), None],
                _ => [
                    Some(plain(ranks(Some((j.shm_ranks, false))))),
                    Some(shm(ranks(Some((j.shm_ranks, true))))),
                ],
            },
        }
    }

    /// Rack slot `slot`'s partial sum, to its home (None once answered).
    fn partial_transmit(&self, job: u16, slot: u32, resend: bool) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let j = self.job(job)?;
        let h = j.hier.as_deref()?;
        let s = j.slots.get(slot as usize)?;
        let p = h.partials.get(slot as usize)?;
        if p.round == NO_ROUND {
            return None;
        }
        let (to, home_slot) = h.home_of(slot)?;
        // Round 0: rank 0's rack carries its initial values, the others
        // only say they are in (PROTOCOL.md §9.3).
        let carries = p.round != 0 || h.rack == 0;
        // Cast: s.elems <= MAX_PAYLOAD / 4 (checked in install_hierarchical).
        #[allow(clippy::cast_possible_truncation)]
        let repr = Repr {
            kind: MsgType::Partial,
            dtype: Dtype::F32,
            flags: if resend { flags::RETRANSMIT } else { 0 },
            token: j.token,
            job: j.id,
            rank: h.rack,
            count: if carries { s.elems as u16 } else { 0 },
            error: 0,
            round: p.round,
            slot: home_slot,
            key: s.key,
            chunk: s.chunk,
        };
        Some(Transmit {
            header: repr.to_bytes(),
            payload: if carries {
                bytemuck::cast_slice(s.mem.acc(&j.blocks))
            } else {
                &[]
            },
            to: Ranks::new(&[], None, Some(to)),
        })
    }

    /// Home slot `slot`'s stored result, to rack `rack`'s slot of it.
    fn partial_result_transmit(&self, job: u16, slot: u32, rack: u16) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let j = self.job(job)?;
        let h = j.hier.as_deref()?;
        let home = h.home.as_ref()?;
        let s = home.slots.get(slot as usize)?;
        let (to, rack_slot) = h.rack_slot_of(rack, slot)?;
        let repr = answer(MsgType::PartialResult, j, s, s.completed, rack_slot);
        Some(Transmit {
            header: repr.to_bytes(),
            payload: s.result_bytes(slot, None, &home.blocks),
            to: Ranks::new(&[], None, Some(to)),
        })
    }

    /// Whether anything is waiting to be sent.
    pub fn has_transmits(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Forgets what [`Shard::transmits`] returned, once it has been sent.
    pub fn clear_transmits(&mut self) {
        self.pending.clear();
    }
}

/// The header of the appliance's answer of `kind` (RESULT, PARTIAL_RESULT)
/// carrying slot `s`'s stored result of `round` of job `j`, addressed to
/// `slot` at the receiving end.
fn answer<A>(kind: MsgType, j: &Job<A>, s: &Slot, round: u32, slot: u32) -> Repr {
    // Cast: s.elems <= MAX_PAYLOAD / dtype size (checked at install; a
    // home slot's, MAX_PAYLOAD / 4).
    #[allow(clippy::cast_possible_truncation)]
    let count = s.elems as u16;
    Repr {
        kind,
        dtype: j.dtype,
        flags: 0,
        token: j.token,
        job: j.id,
        rank: APPLIANCE_RANK,
        count,
        error: 0,
        round,
        slot,
        key: s.key,
        chunk: s.chunk,
    }
}

/// Slot `slot` of `job` completed a round here: its result is queued for
/// every rank (of the rack, for a hierarchical job).
fn round_done<A>(pending: &mut Vec<Pending<A>>, c: &ShardCounters, job: &mut Job<A>, slot: u32) -> Verdict {
    job.rounds += 1;
    c.results_sent.add(u64::from(job.quorum));
    pending.push(Pending::Result {
        job: job.id,
        slot,
        to: To::All,
        round: None,
    });
    Verdict::Completed
}

/// The slot `repr` names among `slots`, if the message's dtype is `dtype`
/// and its key and chunk are the slot's (PROTOCOL.md §7's order).
fn slot_for<'s>(slots: &'s mut [Slot], repr: &Repr, dtype: Dtype) -> Result<&'s mut Slot, DropReason> {
    if repr.dtype != dtype {
        return Err(DropReason::DtypeMismatch);
    }
    let slot = slots
        .get_mut(repr.slot as usize)
        .ok_or(DropReason::SlotOutOfRange)?;
    if repr.key != slot.key || repr.chunk != slot.chunk {
        return Err(DropReason::ChunkMismatch);
    }
    Ok(slot)
}

enum Step {
    Open,
    Closed,
    /// A rack slot's round has every contribution of its rack: the partial
    /// sum is to go to the chunk's home.
    Forward,
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

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use phub_proto::wire::HEADER_LEN;

    /// Rust-heap blocks, at most `left` of them, counting the live ones.
    #[derive(Debug)]
    struct Limited {
        left: AtomicUsize,
        live: Arc<AtomicUsize>,
    }

    #[derive(Debug)]
    struct Counted(Box<dyn SlotBlock>, Arc<AtomicUsize>);

    impl SlotBlock for Counted {
        fn as_slice(&self) -> &[f32] {
            self.0.as_slice()
        }
        fn as_mut_slice(&mut self) -> &mut [f32] {
            self.0.as_mut_slice()
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.1.fetch_sub(1, Ordering::Relaxed);
        }
    }

    impl SlotAllocator for Limited {
        fn zeroed(&self, len: usize) -> Result<Box<dyn SlotBlock>, String> {
            if self
                .left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(1))
                .is_err()
            {
                return Err(format!("no room for {} bytes", 4 * len));
            }
            self.live.fetch_add(1, Ordering::Relaxed);
            Ok(Box::new(Counted(RustHeap.zeroed(len)?, Arc::clone(&self.live))))
        }
        fn describe(&self) -> String {
            "test heap".into()
        }
    }

    fn job(id: u16, dtype: Dtype, optimizer: Optimizer, slots: u32, elems: u32) -> JobInstall {
        JobInstall {
            id,
            token: 7,
            workers: 2,
            dtype,
            optimizer,
            consistency: Default::default(),
            chunk_elems: elems,
            slots: (0..slots)
                .map(|chunk| SlotChunk { key: 0, chunk, elems })
                .collect(),
        }
    }

    #[test]
    fn an_install_the_allocator_cannot_hold_is_refused_whole() {
        let live = Arc::new(AtomicUsize::new(0));
        let mem = Arc::new(Limited {
            left: AtomicUsize::new(0),
            live: Arc::clone(&live),
        });
        let mut s: Shard<u32> = Shard::with_slot_memory(0, Kernels::best(), mem.clone());
        let opt = Optimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        // Full bf16 chunks: acc, params, s1, s2 of 4416 f32 and the result's
        // 4416 bf16 (2208 f32), each a whole number of lines.
        let elems = (MAX_PAYLOAD / 2) as u32;
        let per_slot = 4 * (4 * 4416 + 2208);
        assert_eq!(4 * Slot::block_len(elems, Dtype::Bf16, &opt, false), per_slot);
        let per_block = BLOCK_BYTES as usize / per_slot;
        assert_eq!(per_block, 26);
        // 100 slots: three blocks of 26 and one of 22.
        mem.left.store(3, Ordering::Relaxed);
        let e = s.install(job(4, Dtype::Bf16, opt, 100, elems)).unwrap_err();
        assert_eq!(
            e,
            EngineError::SlotMemory {
                id: 4,
                bytes: 100 * per_slot as u64,
                slots: 100,
                from: "test heap".into(),
                reason: format!("no room for {} bytes", 22 * per_slot),
            }
        );
        assert!(
            e.to_string().contains(&format!(
                "{} bytes of slot memory for 100 slots do not fit (test heap)",
                100 * per_slot
            )),
            "{e}"
        );
        assert_eq!(
            live.load(Ordering::Relaxed),
            0,
            "the three blocks given were freed"
        );
        assert_eq!(s.job_ids().count(), 0, "nothing of the job is installed");
        mem.left.store(4, Ordering::Relaxed);
        s.install(job(4, Dtype::Bf16, opt, 100, elems)).unwrap();
        assert_eq!(live.load(Ordering::Relaxed), 4, "26 slots to a block");
        assert_eq!(s.slot_memory().describe(), "test heap");
        assert!(s.remove(4));
        assert_eq!(live.load(Ordering::Relaxed), 0);
    }

    /// What an lcore counts a job as holding is what admission charges it
    /// (`MemoryModel::job_cost`), slot by slot as the engine carves them,
    /// for every dtype, optimizer, with and without shared memory's result
    /// region, over lcores of a real layout.
    #[test]
    fn a_job_holds_what_the_memory_model_charges() {
        use phub_proto::layout::{layout, Placement};
        use phub_proto::memory::slot_buffers;
        use phub_proto::spec::JobSpec;
        let opts = [
            "kind = \"sum\"",
            "kind = \"mean\"",
            "kind = \"sgd\"\nlr = 0.1",
            "kind = \"momentum\"\nlr = 0.1",
            "kind = \"adam\"\nlr = 0.1",
        ];
        let mem: Arc<dyn SlotAllocator> = Arc::new(RustHeap);
        let model = memory_model(&*mem);
        for opt in opts {
            for dtype in Dtype::ALL {
                for shm in [false, true] {
                    for elems in [1u32, 15, 16, 17, 1000] {
                        let o: Optimizer = JobSpec::from_toml(&format!(
                            "name = \"m\"\nworkers = 3\n[optimizer]\n{opt}\n[[keys]]\nelements = 1\n"
                        ))
                        .unwrap()
                        .optimizer;
                        let r = Slot::result_kind(dtype, &o, shm);
                        assert_eq!(
                            SlotMem::regions(elems as usize, r, &o),
                            slot_buffers(dtype, &o, elems, shm),
                            "{dtype} {opt} shm {shm}"
                        );
                    }
                }
                // Keys of one short chunk, many full ones, and in between.
                let spec = JobSpec::from_toml(&format!(
                    "name = \"m\"\nworkers = 3\nchunk_bytes = 128\ndtype = \"{dtype}\"\n[optimizer]\n{opt}\n\
                     [[keys]]\nelements = 5\n[[keys]]\nelements = 300000\n[[keys]]\nelements = 77\n"
                ))
                .unwrap();
                let o = spec.optimizer;
                let l = layout(&spec, &mut [0, 0, 0], model.chunk_cost(&spec, false));
                let cost = model.job_cost(&spec, &l, false);
                let p = Placement::new(&spec, l.clone()).unwrap();
                for (lcore, want) in cost.lcores.iter().enumerate() {
                    let mut s: Shard<u32> =
                        Shard::with_slot_memory(lcore as u16, Kernels::best(), mem.clone());
                    s.install(JobInstall {
                        id: 1,
                        token: 7,
                        workers: 3,
                        dtype,
                        optimizer: o,
                        consistency: Default::default(),
                        chunk_elems: l.chunk_elems,
                        slots: p.slots(lcore).collect(),
                    })
                    .unwrap();
                    assert_eq!(s.job_memory_bytes(1), Some(*want), "{dtype} {opt} lcore {lcore}");
                }
            }
        }
    }

    fn push(dtype: Dtype, rank: u16, round: u32, slot: u32, vals: &[f32]) -> Vec<u8> {
        let carries = round > 0 || rank == 0;
        let n = if carries { vals.len() } else { 0 };
        let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
        let repr = Repr::request(kind, 1, 7, rank, round, slot)
            .with_payload(dtype, n as u16)
            .with_chunk(0, slot);
        let mut b = vec![0u8; HEADER_LEN + n * dtype.size()];
        repr.emit(&mut wire::Header::new_unchecked(&mut b[..]));
        kernels::encode(dtype, &vals[..n], &mut b[HEADER_LEN..]);
        b
    }

    fn rounds(s: &mut Shard<u32>, dtype: Dtype, from: u32, to: u32) {
        for round in from..to {
            for slot in 0..2 {
                for rank in 0..2u16 {
                    let vals: Vec<f32> = (0..37)
                        .map(|e| (e as f32 * 0.25 - 3.0) * f32::from(rank + 1) + round as f32)
                        .collect();
                    let v = s.handle(u32::from(rank), &push(dtype, rank, round, slot, &vals), 1);
                    assert!(!matches!(v, Verdict::Dropped(_)), "{v:?}");
                }
            }
            s.clear_transmits();
        }
    }

    #[test]
    fn a_snapshot_restores_every_result_kind_exactly() {
        let adam = Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let cases = [
            (Dtype::F32, Optimizer::Sum),
            (Dtype::F32, adam),
            (Dtype::Bf16, Optimizer::Mean),
            (Dtype::F16, adam),
        ];
        for (dtype, opt) in cases {
            // Odd and even round counts: the f32 result and accumulator
            // have traded places an odd or even number of times.
            for done in [3, 4] {
                let mut a: Shard<u32> = Shard::new(0, Kernels::best());
                a.install(job(1, dtype, opt, 2, 37)).unwrap();
                rounds(&mut a, dtype, 0, done);
                let saved = a.snapshot(1).unwrap();
                let mut b: Shard<u32> = Shard::new(0, Kernels::best());
                b.install(job(1, dtype, opt, 2, 37)).unwrap();
                b.restore(1, &saved).unwrap();
                for slot in 0..2 {
                    assert_eq!(
                        a.result(1, slot),
                        b.result(1, slot),
                        "{dtype:?} {opt:?} slot {slot}"
                    );
                    assert_eq!(a.params(1, slot), b.params(1, slot));
                }
                assert_eq!(b.snapshot(1).unwrap(), saved);
                // The restored shard goes on exactly as the original does.
                rounds(&mut a, dtype, done, done + 2);
                rounds(&mut b, dtype, done, done + 2);
                for slot in 0..2 {
                    let (r, bytes) = b.result(1, slot).unwrap();
                    assert_eq!(r, done + 1);
                    assert_eq!(bytes.len(), 37 * dtype.size());
                    assert_eq!(
                        a.result(1, slot),
                        b.result(1, slot),
                        "{dtype:?} {opt:?} slot {slot}"
                    );
                }
                // Two slots of 37 elements in one block, as admission counts them.
                let model = memory_model(&RustHeap);
                let want = 2 * model.slot_data_bytes(dtype, &opt, 37, false)
                    + 2 * u64::from(model.slot_bytes)
                    + u64::from(model.block_overhead_bytes)
                    + u64::from(model.lcore_job_bytes)
                    + 2 * u64::from(model.rank_bytes);
                assert_eq!(a.job_memory_bytes(1), Some(want));
            }
        }
    }

    #[test]
    fn an_evicted_jobs_ranks_get_an_error_for_a_minute() {
        let mut s: Shard<u32> = Shard::new(0, Kernels::best());
        s.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37)).unwrap();
        let vals = [1.0f32; 37];
        assert!(s.evict(1, 1_000));
        assert!(!s.evict(1, 1_000), "already gone");
        let p = push(Dtype::F32, 0, 0, 0, &vals);
        assert_eq!(s.handle(9, &p, 2_000), Verdict::Dropped(DropReason::Evicted));
        let t = s.transmits().next().expect("an ERROR");
        let (e, _) = wire::parse(&t.header).unwrap();
        assert_eq!(
            (e.kind, e.error, e.job, e.token),
            (MsgType::Error, DropReason::Evicted.code(), 1, 7)
        );
        assert_eq!(t.to.collect::<Vec<_>>(), [9]);
        s.clear_transmits();
        // Another token is not the evicted job's: dropped, unanswered.
        let mut other = p.clone();
        wire::Header::new_unchecked(&mut other[..]).set_token(8);
        assert_eq!(
            s.handle(9, &other, 2_000),
            Verdict::Dropped(DropReason::UnknownJob)
        );
        // A new job under the same id: the old token still hears `evicted`,
        // the new one is served.
        let mut again = job(1, Dtype::F32, Optimizer::Sum, 2, 37);
        again.token = 8;
        s.install(again).unwrap();
        assert_eq!(s.handle(9, &p, 3_000), Verdict::Dropped(DropReason::Evicted));
        assert!(!matches!(s.handle(9, &other, 3_000), Verdict::Dropped(_)));
        s.clear_transmits();
        // After a minute, an unknown job again.
        s.remove(1);
        let later = 1_000 + EVICTED_FOR_NS;
        assert_eq!(s.handle(9, &p, later), Verdict::Dropped(DropReason::UnknownJob));
        assert!(!s.has_transmits());
        assert_eq!(s.counters().drops_of(DropReason::Evicted), 2);
    }

    /// Every RESULT states its job's share of the lcore's receive buffer,
    /// as it is now: by W among the jobs with slots here.
    #[test]
    fn results_state_the_jobs_current_share_of_the_receive_buffer() {
        let mut s: Shard<u32> = Shard::new(0, Kernels::best());
        s.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37)).unwrap();
        let vals = [1.0f32; 37];
        // The share the next round's RESULT (slot 0, both ranks in) states.
        let share = |s: &mut Shard<u32>, round: u32| {
            for rank in 0..2 {
                s.handle(9 + u32::from(rank), &push(Dtype::F32, rank, round, 0, &vals), 1);
            }
            let t = s.transmits().next().expect("a RESULT");
            let h = wire::Header::new_unchecked(&t.header[..]);
            assert_eq!(h.type_code(), MsgType::Result.code());
            let share = h.rx_share();
            s.clear_transmits();
            share
        };
        assert_eq!(share(&mut s, 0), 0, "no buffer known: nothing stated");
        s.set_rx_buffer(Some(1 << 20));
        assert_eq!(share(&mut s, 1), 1 << 20, "alone: the whole buffer");
        // Another job of W = 6 (ids apart, workers 6) with slots here.
        let mut other = job(2, Dtype::F32, Optimizer::Sum, 1, 37);
        other.workers = 6;
        s.install(other).unwrap();
        assert_eq!(share(&mut s, 2), (1 << 20) * 2 / 8);
        assert!(s.remove(2));
        assert_eq!(share(&mut s, 3), 1 << 20, "the whole buffer again");
    }

    /// A hierarchical job's rack slots hear from its rack's ranks, and its
    /// home slots from every rack's appliance: those are its senders here,
    /// not its W.
    #[test]
    fn a_hierarchical_jobs_share_counts_its_rack_ranks_and_the_racks() {
        use phub_proto::layout::ChunkRange;
        use std::net::{Ipv4Addr, SocketAddrV4};
        let mut s: Shard<u32> = Shard::new(0, Kernels::best());
        s.set_peer_resolver(std::sync::Arc::new(|a: SocketAddrV4| Some(u32::from(a.port()))));
        s.set_rx_buffer(Some(1 << 20));
        let at = |port| vec![SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)];
        let runs = vec![ChunkRange { first: 0, count: 4 }];
        let mut rack = job(1, Dtype::F32, Optimizer::Sum, 4, 37);
        rack.workers = 8;
        let hier = |home_slots: Vec<SlotChunk>| HierInstall {
            rack: 1,
            ranks: 5..8,
            optimizer: Optimizer::Sum,
            first: 0,
            racks: vec![(at(1), runs.clone()), (at(2), runs.clone())],
            homes: (at(1), runs.clone()),
            home_first: 0,
            home_slots,
        };
        s.install_hierarchical(rack.clone(), hier(Vec::new())).unwrap();
        let share = |s: &Shard<u32>| s.rx_share(s.job(1).unwrap());
        assert_eq!(share(&s), 1 << 20, "its 3 ranks alone: the whole buffer");
        let mut flat = job(2, Dtype::F32, Optimizer::Sum, 1, 37);
        flat.workers = 3;
        s.install(flat).unwrap();
        assert_eq!(share(&s), (1 << 20) * 3 / 6, "3 rack ranks beside a W = 3 job");
        assert!(s.remove(1));
        let home = (0..4)
            .map(|chunk| SlotChunk {
                key: 0,
                chunk,
                elems: 37,
            })
            .collect();
        s.install_hierarchical(rack, hier(home)).unwrap();
        assert_eq!(
            share(&s),
            (1 << 20) * 3 / 8,
            "and the 2 racks' partials to its home slots here"
        );
    }

    /// A home slot takes a rack's PARTIAL only from the address of that
    /// rack appliance's lcore holding the chunk's rack slot (PROTOCOL.md
    /// §9.4). Reproduction (issue 36, finding 3), on the code before: after
    /// round 0, one PARTIAL of round 1 naming rack 1, with the job's token
    /// but from another address (99, say a worker's), was added as rack
    /// 1's partial; the real rack 1's partial was then `duplicate`, and the
    /// round's result was 2 + 1000 instead of 2 + 3, for every rank of both
    /// racks, with no counter showing it.
    #[test]
    fn a_partial_from_other_than_its_racks_address_is_wrong_peer() {
        use phub_proto::layout::ChunkRange;
        use std::net::{Ipv4Addr, SocketAddrV4};
        // Addresses are the install's ports: rack 0's lcore at 1 (this
        // one, home of the chunk), rack 1's at 2.
        let mut s: Shard<u32> = Shard::new(0, Kernels::best());
        s.set_peer_resolver(Arc::new(|a: SocketAddrV4| Some(u32::from(a.port()))));
        let at = |port| vec![SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)];
        let runs = vec![ChunkRange { first: 0, count: 1 }];
        let mut rack = job(1, Dtype::F32, Optimizer::Sum, 1, 4);
        rack.workers = 2;
        let chunk = SlotChunk {
            key: 0,
            chunk: 0,
            elems: 4,
        };
        s.install_hierarchical(
            rack,
            HierInstall {
                rack: 0,
                ranks: 0..1,
                optimizer: Optimizer::Sum,
                first: 0,
                racks: vec![(at(1), runs.clone()), (at(2), runs.clone())],
                homes: (at(1), runs),
                home_first: 0,
                home_slots: vec![chunk],
            },
        )
        .unwrap();
        let partial = |rack: u16, round: u32, vals: &[f32]| {
            let repr = Repr::request(MsgType::Partial, 1, 7, rack, round, 0)
                .with_payload(Dtype::F32, vals.len() as u16)
                .with_chunk(0, 0);
            let mut b = vec![0u8; HEADER_LEN + 4 * vals.len()];
            repr.emit(&mut wire::Header::new_unchecked(&mut b[..]));
            kernels::encode(Dtype::F32, vals, &mut b[HEADER_LEN..]);
            b
        };
        let wrong = Verdict::Dropped(DropReason::WrongPeer);
        // Round 0: rack 0 carries the initial values, rack 1 says it is in;
        // a forged round-0 partial of rack 0 is refused first.
        assert_eq!(s.handle(99, &partial(0, 0, &[9.0; 4]), 1), wrong);
        assert_eq!(s.handle(1, &partial(0, 0, &[0.5; 4]), 2), Verdict::Aggregated);
        assert_eq!(s.handle(2, &partial(1, 0, &[]), 3), Verdict::Completed);
        s.clear_transmits();
        // Round 1: rack 1's partial forged from a worker's address, and
        // from rack 0's (an appliance speaking for another rack).
        assert_eq!(s.handle(99, &partial(1, 1, &[1000.0; 4]), 4), wrong);
        assert_eq!(s.handle(1, &partial(1, 1, &[1000.0; 4]), 5), wrong);
        assert!(!s.has_transmits());
        assert_eq!(s.handle(1, &partial(0, 1, &[2.0; 4]), 6), Verdict::Aggregated);
        assert_eq!(s.handle(2, &partial(1, 1, &[3.0; 4]), 7), Verdict::Completed);
        let mut to = Vec::new();
        for t in s.transmits() {
            let mut d = t.header.to_vec();
            d.extend_from_slice(t.payload);
            let (r, payload) = wire::parse(&d).unwrap();
            assert_eq!((r.kind, r.round), (MsgType::PartialResult, 1));
            assert_eq!(
                payload,
                bytemuck::cast_slice::<f32, u8>(&[5.0; 4]),
                "2 + 3, exact"
            );
            to.extend(t.to);
        }
        assert_eq!(to, [1, 2], "to each rack's slot, from the install");
        s.clear_transmits();
        // A forged copy of the completed round gets no resend of the result;
        // the rack's own copy does.
        assert_eq!(s.handle(99, &partial(1, 1, &[1000.0; 4]), 8), wrong);
        assert!(!s.has_transmits());
        assert_eq!(s.handle(2, &partial(1, 1, &[3.0; 4]), 9), Verdict::Resent);
        assert_eq!(s.counters().drops_of(DropReason::WrongPeer), 4);
        assert_eq!(s.counters().drops_of(DropReason::Duplicate), 0);
    }

    #[test]
    fn a_shard_shutting_down_tells_each_rank_it_knows_and_refuses_the_rest() {
        let mut s: Shard<u32> = Shard::new(0, Kernels::best());
        s.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37)).unwrap();
        let vals = [1.0f32; 37];
        // Rank 0 is heard from (address 9); rank 1 is not.
        let v = s.handle(9, &push(Dtype::F32, 0, 0, 0, &vals), 1_000);
        assert!(!matches!(v, Verdict::Dropped(_)), "{v:?}");
        s.clear_transmits();
        assert_eq!(s.shut_down(), 1);
        let t = s.transmits().next().expect("an ERROR to rank 0");
        let (e, _) = wire::parse(&t.header).unwrap();
        assert_eq!(
            (e.kind, e.error, e.job, e.token, e.rank, e.dtype),
            (
                MsgType::Error,
                DropReason::ShuttingDown.code(),
                1,
                7,
                0,
                Dtype::F32
            )
        );
        assert_eq!(t.to.collect::<Vec<_>>(), [9]);
        assert_eq!(s.transmits().count(), 1);
        s.clear_transmits();
        // Whatever comes later for the job is refused, to its sender.
        let p = push(Dtype::F32, 1, 0, 1, &vals);
        assert_eq!(
            s.handle(10, &p, 2_000),
            Verdict::Dropped(DropReason::ShuttingDown)
        );
        let t = s.transmits().next().expect("an ERROR to rank 1");
        let (e, _) = wire::parse(&t.header).unwrap();
        assert_eq!((e.error, e.rank, e.slot), (DropReason::ShuttingDown.code(), 1, 1));
        assert_eq!(t.to.collect::<Vec<_>>(), [10]);
        s.clear_transmits();
        // A message without the job's token is still not answered.
        let mut other = p.clone();
        wire::Header::new_unchecked(&mut other[..]).set_token(8);
        assert_eq!(
            s.handle(10, &other, 2_000),
            Verdict::Dropped(DropReason::BadToken)
        );
        assert!(!s.has_transmits());
        assert_eq!(s.counters().drops_of(DropReason::ShuttingDown), 1);
        assert_eq!(s.counters().errors_sent.get(), 2);
    }
}
