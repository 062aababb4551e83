//! Replicas of async and bounded-delay jobs (PROTOCOL.md §11.10): a
//! primary slot applies each push at once (§5.8) and sends the
//! **update** (the push's values in `f32`, its rank and clock, and its
//! number t, the slot's update count after it) to every backup of the
//! chunk, which applies the chunk's updates one by one in t order with the
//! same operations; the answer a push (or a bounded-delay release) earns
//! leaves only once every backup acknowledged the update that earned it.
//!
//! Invariants (on top of [`super::replica`]'s and [`super::clock`]'s):
//! - A primary slot keeps every update not yet acknowledged by all its
//!   backups in its log, oldest first, and resends them on its timer; a
//!   backup acknowledges the last update it applied (cumulative: it
//!   applies t only after t − 1), so the log is a run of consecutive t.
//! - A backup slot applies update t only as the next after its last
//!   (`ahead` otherwise, `stale` when older), answers a copy of its last
//!   with the ACK again, and keeps its primary's clocks and held flags
//!   bit for bit: the same rank, clock and values in the same order.
//! - A rank whose answer waits for the backups is treated as held: its
//!   copies of the push are `duplicate`, its next push `ahead`, a PULL
//!   reports the clock before. So each rank has at most one update in a
//!   slot's log, and no rank is answered for an update a live backup
//!   lacks.
//! - The log's buffers come from the lcore's pool of
//!   [`UPDATE_LOG_BUFFERS`]; a push that finds it empty is dropped
//!   `backlog` before it is applied.
//! - A state copy to a new backup ([`super::copy`], which carries the
//!   ranks' clocks too) is of one update count: while a backup of the slot
//!   is copying, no push is applied (`backlog`); its ACK counts as the
//!   new backup's acknowledgement of every update up to the copy's.

use std::collections::VecDeque;

use phub_proto::memory::UPDATE_LOG_BUFFERS;
use phub_proto::replica::{ReplicaRepr, MAX_REPLICAS};
use phub_proto::wire::{DropReason, Header};
use phub_proto::Dtype;

use crate::counters::ShardCounters;
use crate::kernels::Kernels;
use crate::transmit::Transmit;

use super::clock::{clear_released, update_clocked};
use super::outbox::{Attempt, Pending, Ranks, To};
use super::replica::{replicate_repr, Pushed, Replica};
use super::{Job, Shard};

// What MemoryModel::replica_lcore_bytes charges per primary slot.
const _: () = assert!(std::mem::size_of::<Updates>() as u64 <= phub_proto::memory::UPDATE_RECORD_BYTES);

/// Backups a chunk has at most.
pub(super) const MAX_BACKUPS: usize = MAX_REPLICAS as usize - 1;

/// One applied update of a primary slot that some backup has not
/// acknowledged.
#[derive(Debug)]
pub(super) struct Update {
    t: u32,
    rank: u16,
    clock: u32,
    /// When it was first sent (caller's clock).
    sent: u64,
    /// The pushed values in `f32` (the chunk's length first; a buffer of
    /// the job's largest chunk).
    values: Box<[f32]>,
}

/// A primary slot's updates on their way to its backups.
#[derive(Debug, Default)]
pub(super) struct Updates {
    pub(super) log: VecDeque<Update>,
    /// Per backup (its index in the chunk's backups): the last update it
    /// acknowledged.
    pub(super) acked: [u32; MAX_BACKUPS],
}

impl Updates {
    /// Renumbers the acknowledgements over the chunk's new backups
    /// (`from_old[k]`: new backup k's old index, if it was one).
    pub(super) fn renumber(&mut self, from_old: &[Option<usize>]) {
        let old = self.acked;
        self.acked = [0; MAX_BACKUPS];
        for (k, o) in from_old.iter().enumerate().take(MAX_BACKUPS) {
            self.acked[k] = o.and_then(|o| old.get(o).copied()).unwrap_or(0);
        }
    }
}

impl<A: Copy> Replica<A> {
    /// Whether this is an async or bounded-delay job's replication.
    pub(super) fn clocked(&self) -> bool {
        self.clocked
    }

    /// Rank `r`'s answer on primary slot `slot` waits for update `t`.
    pub(super) fn wait(&mut self, slot: u32, workers: u16, r: u16, t: u32) {
        let w = usize::from(workers);
        if let Some(x) = self.waits.get_mut(slot as usize * w + usize::from(r)) {
            *x = t;
        }
    }

    /// Whether rank `r`'s answer on primary slot `slot` waits for the
    /// backups.
    pub(super) fn waiting(&self, slot: u32, workers: u16, r: u16) -> bool {
        let w = usize::from(workers);
        self.waits
            .get(slot as usize * w + usize::from(r))
            .is_some_and(|&t| t != 0)
    }

    /// Whether a push to primary slot `slot` is not to be applied now
    /// (`backlog`): a new backup takes the slot's state copy, which must
    /// stay of one update count while it runs, or the update would find no
    /// buffer for its log.
    pub(super) fn backlogged(&self, slot: u32) -> bool {
        self.clocked()
            && (self.pushed.get(slot as usize).is_some_and(|p| p.copying != 0)
                || (self.group_of(slot).is_some_and(|g| !g.backups.is_empty())
                    && self.spare.is_empty()
                    && self.buffers >= UPDATE_LOG_BUFFERS))
    }

    /// Forgets every logged update and waiting answer (a restore: the
    /// restored slots hold none of them).
    pub(super) fn clear_updates(&mut self) {
        for u in &mut self.updates {
            self.spare.extend(u.log.drain(..).map(|e| e.values));
            u.acked = [0; MAX_BACKUPS];
        }
        self.waits.fill(0);
    }

    /// Bytes of the update log: its buffers (each of `elems` `f32`s; those
    /// admission reserved until more are made), the per-slot records and
    /// the waiting answers.
    pub(super) fn updates_bytes(&self, elems: u32) -> u64 {
        (self.buffers.max(self.reserved_buffers) * elems as usize * 4 + self.waits.len() * 4) as u64
            // The record admission charges per slot (the engine's fits in
            // it: checked above).
            + self.updates.len() as u64 * phub_proto::memory::UPDATE_RECORD_BYTES
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// Primary slot `slot` of `job` applied rank `rank`'s push of `clock`
    /// (`payload`, in the job's dtype): the update goes into the slot's
    /// log and to every backup. `Some(t)` when it did (the answers it
    /// earns wait for t); `None` when the slot has no backup (answered at
    /// once).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn log_update(
        k: &Kernels,
        pending: &mut Vec<Pending<A>>,
        counters: &ShardCounters,
        job: &mut Job<A>,
        slot: u32,
        (rank, clock): (u16, u32),
        payload: &[u8],
        now: u64,
    ) -> Option<u32> {
        let (dtype, id) = (job.dtype, job.id);
        let rep = job.replica.as_deref_mut()?;
        if !rep.clocked() {
            return None;
        }
        let nb = rep.group_of(slot).map_or(0, |g| g.backups.len());
        if nb == 0 {
            return None;
        }
        let s = job.slots.get(slot as usize)?;
        let t = s.completed.get()?;
        let mut values = rep.spare.pop().unwrap_or_else(|| {
            rep.buffers += 1;
            vec![0.0; rep.update_elems as usize].into_boxed_slice()
        });
        k.copy(dtype, &mut values[..s.elems as usize], payload);
        let u = &mut rep.updates[slot as usize];
        debug_assert!(
            u.log.back().is_none_or(|b| b.t + 1 == t),
            "a slot's log is a run of consecutive updates"
        );
        u.log.push_back(Update {
            t,
            rank,
            clock,
            sent: now,
            values,
        });
        let p = &mut rep.pushed[slot as usize];
        if u.log.len() == 1 {
            *p = Pushed {
                round: super::slot::Round::new(t),
                copying: p.copying,
                sent: now,
                deadline: now.saturating_add(rep.rtt.rto(0)),
                ..Pushed::default()
            };
            rep.next_deadline = rep.next_deadline.min(p.deadline);
        }
        for b in 0..nb {
            rep.stats.replicates_sent += 1;
            counters.replicates_sent.inc();
            // Cast: at most MAX_BACKUPS backups.
            #[allow(clippy::cast_possible_truncation)]
            pending.push(Pending::Update {
                job: id,
                slot,
                backup: b as u8,
                t,
                attempt: Attempt::First,
            });
        }
        Some(t)
    }

    /// A primary's update (`update`: its rank and clock) at backup slot
    /// `repr.slot` of part `at`: applied if it is the slot's next
    /// (`Ok(true)`), acknowledged again if it is its last (`Ok(false)`),
    /// else refused.
    pub(super) fn on_update(
        k: &Kernels,
        job: &mut Job<A>,
        at: usize,
        repr: &ReplicaRepr,
        (rank, clock): (u16, u32),
        payload: &[u8],
        now: u64,
    ) -> Result<bool, DropReason> {
        let (dtype, workers, consistency) = (job.dtype, job.workers, job.consistency);
        let rep = job.replica.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        let part = &mut rep.parts[at];
        let i = repr.slot as usize;
        let slot = &mut part.slots[i];
        if slot.completed.is(repr.round) {
            return Ok(false);
        }
        if repr.round != slot.in_progress() {
            return Err(if slot.completed.is_after(repr.round) {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        }
        if rank >= workers {
            return Err(DropReason::RankOutOfRange);
        }
        let w = usize::from(workers);
        let clocks = &mut part.clocks[i * w..(i + 1) * w];
        let mine = clocks[usize::from(rank)];
        if mine.held() || clock != mine.applied() + 1 {
            // Never from a primary that keeps §5.8: counted only.
            return Err(DropReason::Ahead);
        }
        update_clocked(
            k,
            (slot, &mut part.blocks),
            clocks,
            consistency,
            &job.optimizer,
            (dtype, Dtype::F32),
            (rank, clock),
            payload,
            now,
        );
        clear_released(clocks, consistency);
        debug_assert!(
            slot.completed.is(repr.round),
            "a backup applies the update it took"
        );
        Ok(true)
    }

    /// A backup's ACK of update `repr.round` at primary slot `repr.slot`
    /// (backup `k`): counted, then the slot settled ([`Shard::settle`]).
    pub(super) fn on_update_ack(
        pending: &mut Vec<Pending<A>>,
        counters: &ShardCounters,
        job: &mut Job<A>,
        k: usize,
        repr: &ReplicaRepr,
        now: u64,
    ) -> Result<(), DropReason> {
        let rep = job.replica.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        let s = &job.slots[repr.slot as usize];
        let u = &mut rep.updates[repr.slot as usize];
        let acked = u.acked.get_mut(k).ok_or(DropReason::RankOutOfRange)?;
        if repr.round == *acked {
            return Err(DropReason::Duplicate);
        }
        if repr.round < *acked {
            return Err(DropReason::Stale);
        }
        if s.completed.get().is_none_or(|c| repr.round > c) {
            return Err(DropReason::Ahead);
        }
        *acked = repr.round;
        let p = &rep.pushed[repr.slot as usize];
        if let Some(f) = u.log.front().filter(|f| f.t <= repr.round && p.resends == 0) {
            rep.rtt.sample(now.saturating_sub(f.sent));
        }
        Self::settle(pending, counters, job, repr.slot);
        Ok(())
    }

    /// Primary slot `slot`: the updates every backup acknowledged leave
    /// its log, and the answers that waited for them go (each rank's
    /// RESULT with its applied clock, PROTOCOL.md §11.10).
    pub(super) fn settle(
        pending: &mut Vec<Pending<A>>,
        counters: &ShardCounters,
        job: &mut Job<A>,
        slot: u32,
    ) {
        let (id, workers) = (job.id, job.workers);
        let Some(rep) = job.replica.as_deref_mut() else {
            return;
        };
        let Some(u) = rep.updates.get_mut(slot as usize) else {
            return;
        };
        let nb = rep
            .groups
            .iter()
            .find(|g| g.has(slot))
            .map_or(0, |g| g.backups.len());
        let m = u.acked[..nb].iter().copied().min().unwrap_or(u32::MAX);
        // Round 0's aggregate, pending as a BSP round's, is not the log's.
        let logged = !u.log.is_empty();
        while u.log.front().is_some_and(|f| f.t <= m) {
            let f = u.log.pop_front().expect("a front");
            rep.spare.push(f.values);
            rep.stats.rounds_replicated += 1;
            counters.rounds_replicated.inc();
        }
        let p = &mut rep.pushed[slot as usize];
        match u.log.front() {
            None if logged => {
                *p = Pushed {
                    copying: p.copying,
                    ..Pushed::default()
                }
            }
            None => {}
            Some(f) => p.round = super::slot::Round::new(f.t),
        }
        let w = usize::from(workers);
        let at = slot as usize * w;
        let (Some(waits), Some(clocks)) = (rep.waits.get_mut(at..at + w), job.clocks.get(at..at + w)) else {
            return;
        };
        // Cast: r < workers, a u16.
        #[allow(clippy::cast_possible_truncation)]
        for (r, t) in waits.iter_mut().enumerate() {
            if *t != 0 && *t <= m {
                *t = 0;
                counters.results_sent.inc();
                pending.push(Pending::Result {
                    job: id,
                    slot,
                    to: To::One(r as u16),
                    round: Some(clocks[r].applied()),
                });
            }
        }
    }

    /// Update `t` of primary slot `slot`, to its backup `backup` (None once
    /// that backup acknowledged it, or it left the log).
    pub(super) fn update_transmit(
        &self,
        job: u16,
        slot: u32,
        backup: u8,
        t: u32,
        attempt: Attempt,
    ) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let j = self.job(job)?;
        let rep = j.replica.as_deref()?;
        let s = j.slots.get(slot as usize)?;
        let u = rep.updates.get(slot as usize)?;
        if *u.acked.get(usize::from(backup))? >= t {
            return None;
        }
        let e = u.log.get(t.checked_sub(u.log.front()?.t)? as usize)?;
        debug_assert_eq!(e.t, t, "a slot's log is a run of consecutive updates");
        let g = rep.group_of(slot)?;
        let (to, backup_slot) = g.backup_of(usize::from(backup), slot)?;
        let repr = replicate_repr(j, g, s, (backup_slot, t), attempt);
        let mut header = repr.to_bytes();
        Header::new_unchecked(&mut header[..]).set_update(e.rank, e.clock);
        Some(Transmit {
            header,
            payload: bytemuck::cast_slice(&e.values[..s.elems as usize]),
            to: Ranks::new(&[], None, Some(to)),
        })
    }
}

/// A primary slot's logged updates that its first `nb` backups have not
/// acknowledged, those copying (bits of `copying`) left out, as (backup,
/// t): what its timer resends.
pub(super) fn unacked(u: &Updates, nb: usize, copying: u8) -> impl Iterator<Item = (u8, u32)> + '_ {
    // Cast: at most MAX_BACKUPS backups.
    #[allow(clippy::cast_possible_truncation)]
    (0..nb.min(MAX_BACKUPS))
        .filter(move |k| copying & (1 << k) == 0)
        .flat_map(move |k| {
            u.log
                .iter()
                .filter(move |e| e.t > u.acked[k])
                .map(move |e| (k as u8, e.t))
        })
}
