//! A slot: one chunk's buffers, carved from a block of slot memory, and its
//! round (the last completed one, which ranks contributed to the one in
//! progress); the BSP round rules ([`Shard::apply`]) that advance it.

use phub_proto::layout::SlotChunk;
use phub_proto::memory::ResultStore;
use phub_proto::spec::{Optimizer, MAX_WORKERS};
use phub_proto::wire::{flags, DropReason, MsgType, Repr};
use phub_proto::Dtype;

use crate::kernels;
use crate::kernels::Kernels;
use crate::optim;
use crate::optim::ChunkBufs;
use crate::shm::JobRegions;
use crate::slotmem::{SlotBlock, LINE_F32};

use super::clock::slowest;
use super::hier::Partial;
use super::region::contribution;
use super::{Job, Shard, Step};

/// A slot's last completed round, or none before round 0 completes (also
/// the round a rack slot's partial waits for, or none). One `u32` whose
/// `u32::MAX` means none, rather than an `Option<u32>` (8 bytes): a
/// [`Slot`]'s size is what admission charges per chunk. The comparisons
/// with "none" live here, not at every caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(super) struct Round(u32);

const _: () = assert!(std::mem::size_of::<Round>() == std::mem::size_of::<u32>());

impl Round {
    /// No round.
    pub(super) const NONE: Round = Round(u32::MAX);
    /// The largest round a slot can complete (the one after it would read
    /// as none).
    pub(super) const LAST: u32 = u32::MAX - 1;

    /// Round `r`, which is at most [`Round::LAST`] (callers refuse larger
    /// rounds off the wire first, [`Round::completable`]).
    pub(super) fn new(r: u32) -> Round {
        debug_assert!(r <= Round::LAST, "round {r} is the sentinel for none");
        Round(r)
    }

    /// Whether round `r` can ever be completed (and so be stored).
    pub(super) fn completable(r: u32) -> bool {
        r <= Round::LAST
    }

    /// The round, if there is one.
    pub(super) fn get(self) -> Option<u32> {
        (self != Round::NONE).then_some(self.0)
    }

    /// Whether there is no round.
    pub(super) fn is_none(self) -> bool {
        self == Round::NONE
    }

    /// Whether this is round `r` (never, for none).
    pub(super) fn is(self, r: u32) -> bool {
        self != Round::NONE && self.0 == r
    }

    /// Whether round `r` comes before this one (never, for none).
    pub(super) fn is_after(self, r: u32) -> bool {
        self.get().is_some_and(|c| r < c)
    }

    /// The round after this one: 0 after none.
    pub(super) fn next(self) -> u32 {
        self.0.wrapping_add(1)
    }

    /// The round after this one, at most [`Round::LAST`] (a non-BSP slot's
    /// update count, which stops there).
    pub(super) fn next_saturating(self) -> u32 {
        self.0.saturating_add(1).min(Round::LAST)
    }
}

/// Which ranks contributed to the round in progress.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RankSet([u64; (MAX_WORKERS as usize).div_ceil(64)]);

impl RankSet {
    pub(super) fn of(ranks: std::ops::Range<u16>) -> RankSet {
        let mut s = RankSet::default();
        for r in ranks {
            s.insert(r);
        }
        s
    }
    pub(super) fn contains(&self, r: u16) -> bool {
        self.0[usize::from(r >> 6) & 3] & (1 << (r & 63)) != 0
    }
    pub(super) fn insert(&mut self, r: u16) {
        self.0[usize::from(r >> 6) & 3] |= 1 << (r & 63);
    }
    pub(super) fn remove(&mut self, r: u16) {
        self.0[usize::from(r >> 6) & 3] &= !(1 << (r & 63));
    }
    pub(super) fn len(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

/// Where the stored result lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ResultKind {
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
pub(super) const A: usize = 0;
pub(super) const B: usize = 1;
pub(super) const PARAMS: usize = 2;
pub(super) const S1: usize = 3;
pub(super) const S2: usize = 4;
pub(super) const HALF: usize = 5;

pub(super) fn padded(len: usize) -> usize {
    len.next_multiple_of(LINE_F32)
}

/// Takes the next `pad` elements off `rest` and returns the first `used`.
pub(super) fn cut<'a>(rest: &mut &'a mut [f32], used: usize, pad: usize) -> &'a mut [f32] {
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
pub(super) struct SlotMem {
    /// Its block, in the job's blocks on this lcore.
    pub(super) block: usize,
    /// Where its first region starts in the block, in `f32`s (a whole
    /// number of lines).
    pub(super) off: usize,
    /// Elements per buffer.
    pub(super) n: usize,
    /// Elements used in each region (0: absent).
    pub(super) used: [usize; 6],
    /// Whether the accumulator is region A (else B; always A for
    /// [`ResultKind::Region`], which has no B).
    pub(super) acc_in_a: bool,
}

/// Mutable views of a slot's buffers.
pub(super) struct Bufs<'a> {
    pub(super) acc: &'a mut [f32],
    pub(super) params: &'a mut [f32],
    pub(super) s1: &'a mut [f32],
    pub(super) s2: &'a mut [f32],
    pub(super) half: &'a mut [u16],
}

/// A job's blocks of slot memory on one lcore.
pub(super) type Blocks = [Box<dyn SlotBlock>];

impl SlotMem {
    /// Elements of each region for a chunk of `n` elements (what
    /// [`slot_buffers`] tells admission).
    pub(super) fn regions(n: usize, result: ResultKind, opt: &Optimizer) -> [usize; 6] {
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
    pub(super) fn block_len(used: &[usize; 6]) -> usize {
        used.iter().map(|&u| padded(u)).sum()
    }

    /// The slot's share of its block (none for a vacant slot, which has
    /// no block: [`Slot::vacant`]).
    pub(super) fn share<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        let len = Self::block_len(&self.used);
        if len == 0 {
            return &[];
        }
        &blocks[self.block].as_slice()[self.off..self.off + len]
    }

    /// The slot's share of its block, mutably.
    pub(super) fn share_mut<'a>(&self, blocks: &'a mut Blocks) -> &'a mut [f32] {
        let len = Self::block_len(&self.used);
        if len == 0 {
            return &mut [];
        }
        &mut blocks[self.block].as_mut_slice()[self.off..self.off + len]
    }

    /// Every region, read-only.
    pub(super) fn all<'a>(&self, blocks: &'a Blocks) -> [&'a [f32]; 6] {
        let mut rest = self.share(blocks);
        self.used.map(|u| {
            let (head, tail) = rest.split_at(padded(u));
            rest = tail;
            &head[..u]
        })
    }

    /// Every region, mutably.
    pub(super) fn all_mut<'a>(&self, blocks: &'a mut Blocks) -> [&'a mut [f32]; 6] {
        let used = self.used;
        let mut rest = self.share_mut(blocks);
        used.map(|u| cut(&mut rest, u, padded(u)))
    }

    pub(super) fn bufs<'a>(&self, blocks: &'a mut Blocks) -> Bufs<'a> {
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

    pub(super) fn acc<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        let off = if self.acc_in_a { 0 } else { padded(self.used[A]) };
        &self.share(blocks)[off..off + self.n]
    }

    pub(super) fn acc_mut<'a>(&self, blocks: &'a mut Blocks) -> &'a mut [f32] {
        let off = if self.acc_in_a { 0 } else { padded(self.used[A]) };
        let n = self.n;
        &mut self.share_mut(blocks)[off..off + n]
    }

    pub(super) fn params<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        self.all(blocks)[PARAMS]
    }

    /// The f32 result (sum/mean): whichever of A and B is not the
    /// accumulator.
    pub(super) fn f32_result<'a>(&self, blocks: &'a Blocks) -> &'a [f32] {
        self.all(blocks)[if self.acc_in_a { B } else { A }]
    }

    pub(super) fn half_bytes<'a>(&self, blocks: &'a Blocks) -> &'a [u8] {
        &bytemuck::cast_slice(self.all(blocks)[HALF])[..2 * self.n]
    }
}

/// One chunk's slot on this lcore: which chunk, its round, and where its
/// buffers are.
#[derive(Debug)]
pub(super) struct Slot {
    pub(super) key: u32,
    pub(super) chunk: u32,
    pub(super) elems: u32,
    /// Last completed round (none before round 0 completes). For a non-BSP
    /// slot past round 0: its update count.
    pub(super) completed: Round,
    /// Which ranks contributed to the round in progress.
    pub(super) contributed: RankSet,
    /// How many: `contributed.len()`, below the job's quorum between
    /// packets, except for a rack slot whose partial waits for its home.
    pub(super) ncontrib: u16,
    /// [`ResultKind::Region`] only: the rank whose shared-memory PUSH was
    /// the round's first contribution and is not summed yet; its staging
    /// chunk stands for the accumulator until the second contribution.
    pub(super) deferred: Option<u16>,
    pub(super) result: ResultKind,
    pub(super) mem: SlotMem,
}

// What admission charges a slot's record (`memory_model`'s `slot_bytes`,
// per chunk): a change here changes every job's admitted size, so it is
// made on purpose. `Round` keeps the sentinel in the `u32` it replaced.
const _: () = assert!(std::mem::size_of::<Slot>() == 136);

impl Slot {
    /// Where the result of a slot of a job with this dtype and optimizer,
    /// whose f32 sums may be stored in `store`, is stored.
    pub(super) fn result_kind(dtype: Dtype, opt: &Optimizer, store: ResultStore) -> ResultKind {
        match (dtype, opt.keeps_params()) {
            (Dtype::F32, true) => ResultKind::Params,
            (Dtype::F32, false) if store == ResultStore::SharedRegion => ResultKind::Region,
            (Dtype::F32, false) => ResultKind::F32,
            _ => ResultKind::Half,
        }
    }

    /// `f32`s of its block a slot of this chunk takes (padding included).
    pub(super) fn block_len(elems: u32, dtype: Dtype, opt: &Optimizer, store: ResultStore) -> usize {
        SlotMem::block_len(&SlotMem::regions(
            elems as usize,
            Self::result_kind(dtype, opt, store),
            opt,
        ))
    }

    /// A slot for chunk `c`, its buffers at `off` in block `block`.
    pub(super) fn new(
        c: SlotChunk,
        dtype: Dtype,
        opt: &Optimizer,
        store: ResultStore,
        block: usize,
        off: usize,
    ) -> Slot {
        let n = c.elems as usize;
        let result = Self::result_kind(dtype, opt, store);
        Slot {
            key: c.key,
            chunk: c.chunk,
            elems: c.elems,
            completed: Round::NONE,
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

    /// A vacant slot: a replicated job's slot number that no chunk has on
    /// this lcore (yet): the extended slots of a backed-up part before an
    /// adopted one, kept so that every adopted slot's index is its
    /// extended slot number (PROTOCOL.md §11.6). No chunk, no elements, no
    /// memory; every message for it is refused `slot_out_of_range`
    /// ([`slot_for`]).
    pub(super) fn vacant(dtype: Dtype, opt: &Optimizer) -> Slot {
        let none = SlotChunk {
            key: u32::MAX,
            chunk: u32::MAX,
            elems: 0,
        };
        Slot::new(none, dtype, opt, ResultStore::Slot, 0, 0)
    }

    /// Whether it is [`Slot::vacant`].
    pub(super) fn is_vacant(&self) -> bool {
        self.elems == 0
    }

    /// The round in progress: the one after the last completed.
    pub(super) fn in_progress(&self) -> u32 {
        self.completed.next()
    }

    /// Where a contribution of `rank` to `round` falls in the slot's
    /// window: `true` for the last completed round (its result is to be
    /// sent again), `false` for the round in progress, which `rank` has not
    /// contributed to yet; anything else is refused (`stale`, `ahead`,
    /// `duplicate`).
    pub(super) fn in_window(&self, round: u32, rank: u16) -> Result<bool, DropReason> {
        if self.completed.is(round) {
            return Ok(true);
        }
        if round != self.in_progress() {
            return Err(if self.completed.is_after(round) {
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
    pub(super) fn result_bytes<'a>(
        &self,
        index: u32,
        shm: Option<&'a JobRegions>,
        blocks: &'a Blocks,
    ) -> &'a [u8] {
        match self.result {
            ResultKind::Params => bytemuck::cast_slice(self.mem.params(blocks)),
            ResultKind::F32 => bytemuck::cast_slice(self.mem.f32_result(blocks)),
            ResultKind::Region => shm
                .and_then(|r| r.result(index, 4 * self.mem.n))
                .unwrap_or_default(),
            ResultKind::Half => self.mem.half_bytes(blocks),
        }
    }

    /// Closes the round in progress: runs the optimizer (or, for round 0,
    /// takes rank 0's payload as the initial value) and stores the result;
    /// for [`ResultKind::Region`] the result is left in the accumulator, for
    /// the caller to publish.
    pub(super) fn complete(
        &mut self,
        dtype: Dtype,
        opt: &Optimizer,
        workers: u16,
        quorum: u16,
        blocks: &mut Blocks,
    ) {
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
        self.close(quorum);
    }

    /// Marks the round in progress completed, its result stored: every one
    /// of the `quorum` contributions it needs was added.
    pub(super) fn close(&mut self, quorum: u16) {
        debug_assert_eq!(
            self.ncontrib, quorum,
            "a round closed without all its contributions"
        );
        debug_assert_eq!(
            self.contributed.len(),
            u32::from(quorum),
            "contributors and their count disagree"
        );
        self.completed = Round::new(self.in_progress());
        self.contributed = RankSet::default();
        self.ncontrib = 0;
        self.deferred = None;
    }
}

/// The slot `repr` names among `slots`, if the message's dtype is `dtype`
/// and its key and chunk are the slot's (PROTOCOL.md §7's order).
pub(super) fn slot_for<'s>(
    slots: &'s mut [Slot],
    repr: &Repr,
    dtype: Dtype,
) -> Result<&'s mut Slot, DropReason> {
    if repr.dtype != dtype {
        return Err(DropReason::DtypeMismatch);
    }
    let slot = slots
        .get_mut(repr.slot as usize)
        .filter(|s| !s.is_vacant())
        .ok_or(DropReason::SlotOutOfRange)?;
    if repr.key != slot.key || repr.chunk != slot.chunk {
        return Err(DropReason::ChunkMismatch);
    }
    Ok(slot)
}
impl<A: Copy + Eq> Shard<A> {
    /// The slot and round rules for an authenticated packet.
    pub(super) fn apply(
        k: &Kernels,
        job: &mut Job<A>,
        repr: &Repr,
        payload: &[u8],
        now: u64,
    ) -> Result<Step, DropReason> {
        // A replicated async or bounded-delay job (PROTOCOL.md §11.10): the
        // rank's last answer waits for the backups; no push applied now (a
        // state copy runs, or no room to log an update).
        let (waiting, full) = job.replica.as_deref().map_or((false, false), |r| {
            (
                r.waiting(repr.slot, job.workers, repr.rank),
                r.backlogged(repr.slot),
            )
        });
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
            // After a restore, a rank that pulls learns where the chunks
            // stand (PROTOCOL.md §5.4 rule 0). Not from a probe, which asks
            // a few chunks only and may miss those the lcore lost (§6.1),
            // nor from a retransmitted PULL without RESYNC, whose first
            // copy may have gone before the restore, when the rank asked
            // only what it asked then (simulator seed 1114154).
            let (probe, resync, resent) = (
                repr.flags & flags::PROBE != 0,
                repr.flags & flags::RESYNC != 0,
                repr.flags & flags::RETRANSMIT != 0,
            );
            if !probe && (resync || !resent) {
                job.unsynced.remove(repr.rank);
            }
            return if slot.completed.is_none() {
                Err(DropReason::NothingToPull)
            } else {
                // A waiting answer reports the clock before, as a held one.
                Ok(Step::Resend(clocks.map(|c| {
                    let mine = c[usize::from(repr.rank)];
                    if waiting {
                        mine.applied().saturating_sub(1)
                    } else {
                        mine.answered()
                    }
                })))
            };
        }
        // PROTOCOL.md §5.4 rule 0: restored from a checkpoint, this lcore
        // may have lost rounds the rank holds results of; it pulls first.
        if job.unsynced.contains(repr.rank) {
            return Err(DropReason::Ahead);
        }
        if (repr.kind == MsgType::Init) != (repr.round == 0) {
            return Err(DropReason::WrongTypeForRound);
        }
        if !Round::completable(repr.round) {
            return Err(DropReason::Ahead);
        }
        if let Some(clocks) = clocks {
            if slot.completed.get().is_some() {
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
                    (waiting, full),
                    now,
                )?;
                if let Step::Applied { held: false, .. } = step {
                    let lead = repr
                        .round
                        .saturating_add(1)
                        .saturating_sub(slowest(&job.clocks[at..at + w]));
                    job.counters.max_lead = job.counters.max_lead.max(lead);
                }
                return Ok(step);
            }
        }
        // PROTOCOL.md §5.4 rule 5: a round older than the last completed
        // one comes from a rank repeating rounds (after a pull); every
        // round since completed with its contribution, so the stored result
        // (with its own round) answers it, as it does a lost result.
        if slot.completed.is_after(repr.round) {
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
        // The window refused a second contribution of any rank, and a round
        // with all of them closed (or, a rack slot's, forwarded).
        debug_assert!(slot.ncontrib < job.quorum, "a contribution beyond the quorum");
        slot.contributed.insert(repr.rank);
        slot.ncontrib += 1;
        if let (true, Some(rep), None) = (last, job.replica.as_deref_mut(), &job.hier) {
            // A primary slot: the round completes once every backup holds
            // its aggregate (PROTOCOL.md §11.4). (A hierarchical job's
            // primary slots are its home slots, §11.11: not these.)
            if rep.begin(repr.slot, slot.in_progress(), now) {
                return Ok(Step::Replicate);
            }
        }
        if let (true, Some(h)) = (last, &mut job.hier) {
            // A rack slot: the rack's sum goes to the chunk's home, and the
            // round completes when its result comes back (PROTOCOL.md §9.3).
            let p = &mut h.partials[repr.slot as usize];
            *p = Partial {
                round: Round::new(slot.in_progress()),
                sent: now,
                deadline: now.saturating_add(h.rtt.rto(0)),
                resends: 0,
            };
            h.next_deadline = h.next_deadline.min(p.deadline);
            return Ok(Step::Forward);
        }
        if last {
            slot.complete(
                job.dtype,
                &job.optimizer,
                job.workers,
                job.quorum,
                &mut job.blocks,
            );
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
}
