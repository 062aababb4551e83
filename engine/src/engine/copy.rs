//! Re-replication's state copy (PROTOCOL.md §11.7): a primary slot sends a
//! new backup its chunk's full state (last completed round, parameters,
//! optimizer state, stored result) in REPLICATE_STATE fragments, one per
//! buffer; the backup writes them into its slot and, once all are in,
//! takes the round as its last completed and acknowledges
//! (REPLICATE_STATE_ACK), after which the primary sends it the chunk's
//! aggregates as to any backup.
//!
//! Invariants:
//! - A backup slot awaiting a copy ([`Fill::Awaiting`]) holds no round: it
//!   applies no REPLICATE (`ahead`) and reports no round.
//! - A copy is idempotent: a slot that holds its state answers any
//!   fragment of this epoch with its ACK again and changes nothing, so a
//!   late or duplicated fragment never rolls back a round applied after it;
//!   only a slot that completed no round (nothing to roll back) takes a
//!   copy it was not awaiting (a restored primary's, §11.7).
//! - While a backup of a primary slot is copying, no round of the slot
//!   completes (it is counted at once), and in an async or bounded-delay
//!   job no push is applied (`backlog`, PROTOCOL.md §11.10), so the state
//!   the primary sends, taken when each fragment leaves, is of one round
//!   (update count) the whole time; such a job's copy carries the ranks'
//!   clocks too.

use phub_proto::failover::ReplicaLayout;
use phub_proto::layout::ChunkRange;
use phub_proto::replica::{backup_runs, ReplicaMsgType, ReplicaRepr};
use phub_proto::wire::DropReason;
use phub_proto::Dtype;

use crate::kernels::Kernels;
use crate::transmit::Transmit;

use super::clock::{RankClock, SINCE_UNKNOWN};
use super::outbox::{Attempt, Pending, Ranks};
use super::replica::Replica;
use super::slot::{RankSet, ResultKind, Round, Slot, PARAMS, S1, S2};
use super::{Job, Shard};

/// Where one appliance's lcores hold a part's chunks: per lcore its
/// address, the run of the part's chunks it holds and the slot number of
/// the run's first chunk there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Where<A> {
    pub(super) addrs: Vec<A>,
    runs: Vec<ChunkRange>,
    base: Vec<u32>,
}

impl<A: Copy> Where<A> {
    /// The address of the lcore holding chunk `seq`, and its slot there.
    pub(super) fn place(&self, seq: u64) -> Option<(A, u32)> {
        let l = self.runs.partition_point(|r| r.first + r.count <= seq);
        let r = self.runs.get(l)?;
        if !r.range().contains(&seq) {
            return None;
        }
        let index = u32::try_from(seq - r.first).ok()?;
        Some((*self.addrs.get(l)?, self.base.get(l)?.checked_add(index)?))
    }

    /// Where backup `b` keeps part `p`'s chunks, in the numbering of
    /// replication messages (§11.3): its backup slots of §11.2, or its own
    /// slots where it is the part's home (it came back, §11.7).
    pub(super) fn of_backup<R: Eq>(
        layout: &ReplicaLayout<R>,
        addrs: &[Vec<A>],
        p: usize,
        b: usize,
    ) -> Where<A> {
        let runs = if b == p {
            layout.runs_of(p).to_vec()
        } else {
            backup_runs(layout.part(p), addrs[b].len())
        };
        Where {
            addrs: addrs[b].clone(),
            base: vec![0; runs.len()],
            runs,
        }
    }

    /// Where primary `q` serves part `p`'s chunks, by extended slot
    /// number (§11.6): its own slots if it is the home, else its backup
    /// slots of the part, numbered after its own and those of the parts
    /// of lower homes.
    pub(super) fn of_primary<R: Eq>(
        layout: &ReplicaLayout<R>,
        addrs: &[Vec<A>],
        p: usize,
        q: usize,
    ) -> Where<A> {
        if q == p {
            return Where::of_backup(layout, addrs, p, p);
        }
        let lcores = addrs[q].len();
        let runs = backup_runs(layout.part(p), lcores);
        let base = (0..lcores)
            .map(|l| {
                layout
                    .backup_base(q, l, p)
                    .and_then(|(b, _)| u32::try_from(b).ok())
                    .unwrap_or(u32::MAX)
            })
            .collect();
        Where {
            addrs: addrs[q].clone(),
            runs,
            base,
        }
    }
}

// What MemoryModel::replica_lcore_bytes charges per backup slot.
const _: () = assert!(std::mem::size_of::<Fill>() as u64 <= phub_proto::memory::BACKUP_FILL_BYTES);

/// Whether a backup slot holds its chunk's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fill {
    /// It does.
    Held,
    /// It awaits its state copy: the round of the fragments gathered so
    /// far (as the header carries it; none before the first) and which
    /// fragments are in.
    Awaiting { round: Option<u32>, got: u8 },
}

impl Fill {
    /// Nothing gathered yet.
    pub(super) fn awaiting() -> Fill {
        Fill::Awaiting { round: None, got: 0 }
    }
}

/// What one fragment of a state copy carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fragment {
    /// The parameters (`f32`).
    Params,
    /// Optimizer state 1 (`f32`).
    S1,
    /// Optimizer state 2 (`f32`).
    S2,
    /// The stored result, wire bytes of the job's dtype.
    Result,
    /// An async or bounded-delay `sum` job's with a 2-byte result: the
    /// current values in `f32`, which its accumulator keeps between
    /// updates (the result is them encoded, PROTOCOL.md §5.8).
    Values,
    /// An async or bounded-delay job's: each rank's clock (PROTOCOL.md
    /// §11.10), two `u32`s per rank (the clock with its held flag, and a
    /// word the backup ignores).
    Clocks,
    /// No completed round: nothing (`count` 0, round 0xffffffff).
    Nothing,
}

/// The header round of a copy of a slot with no completed round.
const NO_ROUND: u32 = u32::MAX;

/// The fragments of slot `s`'s state at round `round` (the header's), in
/// order, and how many; `clocked`: the job is async or bounded delay.
fn fragments_at(s: &Slot, round: u32, clocked: bool) -> ([Fragment; 6], u8) {
    let mut out = [Fragment::Nothing; 6];
    if round == NO_ROUND {
        return (out, 1);
    }
    let mut n = 0;
    let used = &s.mem.used;
    for (present, f) in [
        (used[PARAMS] > 0, Fragment::Params),
        (used[S1] > 0, Fragment::S1),
        (used[S2] > 0, Fragment::S2),
        (s.result != ResultKind::Params, Fragment::Result),
        (
            clocked && used[PARAMS] == 0 && s.result == ResultKind::Half,
            Fragment::Values,
        ),
        (clocked, Fragment::Clocks),
    ] {
        if present {
            out[n] = f;
            n += 1;
        }
    }
    // Cast: at most 6.
    #[allow(clippy::cast_possible_truncation)]
    (out, n as u8)
}

/// The round a copy of slot `s` carries in its header.
fn copy_round(s: &Slot) -> u32 {
    s.completed.get().unwrap_or(NO_ROUND)
}

/// How many fragments a copy of primary slot `s` has now.
pub(super) fn fragments(s: &Slot, clocked: bool) -> u8 {
    fragments_at(s, copy_round(s), clocked).1
}

impl<A: Copy + Eq> Shard<A> {
    /// Queues the whole state copy of each of `slots` (the job's slot
    /// indices) to the backups in `new` (bits over their part's backups),
    /// marking them copying; the timer is armed at the next poll (an epoch
    /// change has no clock).
    pub(super) fn queue_copies(
        pending: &mut Vec<Pending<A>>,
        j: &mut Job<A>,
        slots: std::ops::Range<u32>,
        new: u8,
    ) {
        let Some(rep) = j.replica.as_deref_mut() else {
            return;
        };
        if new == 0 {
            return;
        }
        let clocked = rep.clocked();
        for i in slots {
            let p = &mut rep.pushed[i as usize];
            p.copying |= new;
            p.deadline = 0;
            let n = fragments(&j.slots[i as usize], clocked);
            for k in (0..8u8).filter(|&k| new & (1 << k) != 0) {
                for f in 0..n {
                    rep.stats.states_sent += 1;
                    pending.push(Pending::State {
                        job: j.id,
                        slot: i,
                        backup: k,
                        fragment: f,
                        attempt: Attempt::First,
                    });
                }
            }
        }
        rep.next_deadline = 0;
    }

    /// A REPLICATE_STATE fragment at a backup slot (PROTOCOL.md §11.7):
    /// `Ok(true)` when a REPLICATE_STATE_ACK is to go (the copy is whole
    /// now, or was before), `Ok(false)` when the fragment was taken (or
    /// was a copy of one taken) and more are awaited.
    pub(super) fn on_state(
        k: &Kernels,
        job: &mut Job<A>,
        from: A,
        repr: &ReplicaRepr,
        payload: &[u8],
    ) -> Result<bool, DropReason> {
        let (dtype, w) = (job.dtype, usize::from(job.workers));
        let rep = job.replica.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        if !rep.parts.iter().any(|p| p.home == repr.from) {
            return Err(DropReason::WrongPeer);
        }
        let at = Self::backup_slot_of(rep, from, repr)?;
        let Replica {
            parts,
            stats,
            clocked,
            ..
        } = rep;
        let part = &mut parts[at];
        let index = repr.slot as usize;
        let (kinds, n) = fragments_at(&part.slots[index], repr.round, *clocked);
        if repr.fragments != n || repr.fragment >= n {
            return Err(DropReason::CountMismatch);
        }
        let kind = kinds[usize::from(repr.fragment)];
        let (want_dtype, want_count) = match kind {
            Fragment::Result => (dtype, part.slots[index].elems),
            Fragment::Nothing => (Dtype::F32, 0),
            // Cast: at most MAX_WORKERS ranks, two words each.
            #[allow(clippy::cast_possible_truncation)]
            Fragment::Clocks => (Dtype::F32, 2 * w as u32),
            _ => (Dtype::F32, part.slots[index].elems),
        };
        if repr.dtype != want_dtype {
            return Err(DropReason::DtypeMismatch);
        }
        if u32::from(repr.count) != want_count {
            return Err(DropReason::CountMismatch);
        }
        let (round, got) = match part.fill.get(index) {
            Some(&Fill::Awaiting { round, got }) => (round, got),
            // A slot that completed no round takes a copy: its primary was
            // restored from a checkpoint and copies the restored state to
            // backups that hold none of it (§11.7, "Restored parts").
            _ if part.slots[index].completed.is_none() => {
                if part.fill.is_empty() {
                    part.fill = vec![Fill::Held; part.slots.len()];
                }
                (None, 0)
            }
            // It holds its state: the primary lost the ACK (§11.7 rule 2).
            _ => return Ok(true),
        };
        let got = if round == Some(repr.round) { got } else { 0 };
        let bit = 1u8 << repr.fragment;
        if got & bit != 0 {
            part.fill[index] = Fill::Awaiting {
                round: Some(repr.round),
                got,
            };
            return Ok(false);
        }
        stats.states_received += 1;
        stats.state_bytes_received += payload.len() as u64;
        let slot = &mut part.slots[index];
        match kind {
            Fragment::Params => k.copy(Dtype::F32, slot.mem.bufs(&mut part.blocks).params, payload),
            Fragment::S1 => k.copy(Dtype::F32, slot.mem.bufs(&mut part.blocks).s1, payload),
            Fragment::S2 => k.copy(Dtype::F32, slot.mem.bufs(&mut part.blocks).s2, payload),
            Fragment::Result => match slot.result {
                ResultKind::Half => {
                    bytemuck::cast_slice_mut::<u16, u8>(slot.mem.bufs(&mut part.blocks).half)
                        .copy_from_slice(payload);
                }
                _ => {
                    let acc_in_a = slot.mem.acc_in_a;
                    let [a, b, ..] = slot.mem.all_mut(&mut part.blocks);
                    k.copy(Dtype::F32, if acc_in_a { b } else { a }, payload);
                }
            },
            Fragment::Values => k.copy(Dtype::F32, slot.mem.acc_mut(&mut part.blocks), payload),
            Fragment::Clocks => {
                // The clocks and held flags the primary has: whether an
                // answer was held before the copy is not counted here.
                if let Some(c) = part.clocks.get_mut(index * w..(index + 1) * w) {
                    for (c, s) in c.iter_mut().zip(payload.chunks_exact(8)) {
                        *c = RankClock {
                            clock: u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
                            since: SINCE_UNKNOWN,
                        };
                    }
                }
            }
            Fragment::Nothing => {}
        }
        let got = got | bit;
        // Cast: a slot has at most 6 fragments (fragments_at), so the mask fits a u8.
        #[allow(clippy::cast_possible_truncation)]
        let all = (1u16 << n).wrapping_sub(1) as u8;
        if got != all {
            part.fill[index] = Fill::Awaiting {
                round: Some(repr.round),
                got,
            };
            return Ok(false);
        }
        // Whole: the copied round is the slot's last completed one.
        slot.completed = if repr.round == NO_ROUND {
            Round::NONE
        } else {
            Round::new(repr.round)
        };
        slot.contributed = RankSet::default();
        slot.ncontrib = 0;
        slot.deferred = None;
        part.fill[index] = Fill::Held;
        stats.states_installed += 1;
        if part.fill.iter().all(|f| *f == Fill::Held) {
            part.fill.clear();
        }
        Ok(true)
    }

    /// A new backup's REPLICATE_STATE_ACK at a primary slot: it joins the
    /// chunk's chain. `Ok(Some(k))` when the pending aggregate is to go to
    /// it, backup `k`, now.
    pub(super) fn on_state_ack(
        job: &mut Job<A>,
        from: A,
        repr: &ReplicaRepr,
    ) -> Result<Option<u8>, DropReason> {
        let k = Self::backup_index(job, from, repr)?;
        let rep = job.replica.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        let p = &mut rep.pushed[repr.slot as usize];
        if p.copying & (1 << k) == 0 {
            return Err(DropReason::Duplicate);
        }
        if repr.round != copy_round(&job.slots[repr.slot as usize]) {
            return Err(DropReason::Stale);
        }
        p.copying &= !(1 << k);
        rep.stats.backups_joined += 1;
        if !p.waiting() {
            p.deadline = u64::MAX;
        }
        if let (true, Some(u)) = (rep.clocked, rep.updates.get_mut(repr.slot as usize)) {
            // The copy holds every update up to its round (none was applied
            // while it ran, PROTOCOL.md §11.10).
            if repr.round != NO_ROUND {
                if let Some(a) = u.acked.get_mut(k) {
                    *a = repr.round;
                }
            }
        }
        // Cast: k < MAX_REPLICAS.
        #[allow(clippy::cast_possible_truncation)]
        Ok((!p.round.is_none() && p.acked & (1 << k) == 0).then_some(k as u8))
    }

    /// Fragment `fragment` of primary slot `slot`'s state copy to its
    /// backup `backup` (None once that backup acknowledged the copy).
    pub(super) fn state_transmit(
        &self,
        job: u16,
        slot: u32,
        backup: u8,
        fragment: u8,
        attempt: Attempt,
    ) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let j = self.job(job)?;
        let rep = j.replica.as_deref()?;
        let s = j.slots.get(slot as usize)?;
        if rep.pushed.get(slot as usize)?.copying & (1 << backup) == 0 {
            return None;
        }
        let g = rep.group_of(slot)?;
        let (to, backup_slot) = g.backup_of(usize::from(backup), slot)?;
        let round = copy_round(s);
        let (kinds, n) = fragments_at(s, round, rep.clocked());
        let kind = *kinds.get(usize::from(fragment)).filter(|_| fragment < n)?;
        let r = s.mem.all(&j.blocks);
        let (dtype, payload): (Dtype, &[u8]) = match kind {
            Fragment::Params => (Dtype::F32, bytemuck::cast_slice(r[PARAMS])),
            Fragment::S1 => (Dtype::F32, bytemuck::cast_slice(r[S1])),
            Fragment::S2 => (Dtype::F32, bytemuck::cast_slice(r[S2])),
            Fragment::Result => (j.dtype, s.result_bytes(slot, None, &j.blocks)),
            Fragment::Values => (Dtype::F32, bytemuck::cast_slice(s.mem.acc(&j.blocks))),
            Fragment::Clocks => {
                let w = usize::from(j.workers);
                let at = slot as usize * w;
                (Dtype::F32, bytemuck::cast_slice(j.clocks.get(at..at + w)?))
            }
            Fragment::Nothing => (Dtype::F32, &[]),
        };
        // Cast: s.elems <= MAX_PAYLOAD / 4 (checked in install_replicated).
        #[allow(clippy::cast_possible_truncation)]
        let count = match kind {
            Fragment::Nothing => 0,
            Fragment::Clocks => 2 * j.workers,
            _ => s.elems as u16,
        };
        let repr = ReplicaRepr {
            kind: ReplicaMsgType::ReplicateState,
            dtype,
            flags: attempt.flags(),
            token: j.token,
            job: j.id,
            from: g.home,
            count,
            round,
            slot: backup_slot,
            key: s.key,
            chunk: s.chunk,
            epoch: rep.view.epoch,
            fragment,
            fragments: n,
        };
        debug_assert_eq!(
            payload.len(),
            repr.payload_len(),
            "a fragment of the wrong length"
        );
        Some(Transmit {
            header: repr.to_bytes(),
            payload,
            to: Ranks::new(&[], None, Some(to)),
        })
    }

    /// The REPLICATE_STATE_ACK of backup slot `slot` of the part of home
    /// `home`, to the part's primary's lcore holding the chunk.
    pub(super) fn state_ack_transmit(
        &self,
        job: u16,
        home: u16,
        slot: u32,
    ) -> Option<Transmit<'_, Ranks<'_, A>>> {
        self.ack_to_primary(job, home, slot, ReplicaMsgType::StateAck, |part, s| {
            part.holds(slot as usize).then(|| copy_round(s))
        })
    }
}
