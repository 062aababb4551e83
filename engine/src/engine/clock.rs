//! The async and bounded-delay modes (PROTOCOL.md §5.8): each rank's clock
//! per slot ([`RankClock`]), applying a push by its clock
//! ([`Shard::apply_clocked`]) and letting held answers go once the slowest
//! rank catches up ([`Shard::release`]).

use phub_proto::checkpoint::CLOCK_HELD;
use phub_proto::spec::{Consistency, Optimizer};
use phub_proto::wire::{DropReason, Repr};
use phub_proto::Dtype;

use crate::counters::ShardCounters;
use crate::kernels;
use crate::kernels::Kernels;
use crate::optim;
use crate::optim::ChunkBufs;

use super::outbox::{Pending, To};
use super::region::contribution;
use super::slot::{Blocks, RankSet, ResultKind, Round, Slot};
use super::{Job, Shard, Step};

/// A rank's clock on one slot of a job that is not BSP (two `u32`s, as
/// a state copy carries them, PROTOCOL.md §11.10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RankClock {
    /// The last clock applied (0: only INIT), [`CLOCK_HELD`] set while the
    /// answer to it is held.
    pub clock: u32,
    /// When its answer was held (caller's clock / 1000, wrapping), or
    /// `SINCE_UNKNOWN` (`u32::MAX`: restored from a checkpoint).
    pub since: u32,
}

/// [`RankClock::since`] of an answer held before a restart: its wait is
/// not counted.
pub(super) const SINCE_UNKNOWN: u32 = u32::MAX;

/// Largest clock a rank may push (bit 31 is [`CLOCK_HELD`]).
pub const MAX_CLOCK: u32 = CLOCK_HELD - 1;

impl RankClock {
    pub(super) fn applied(self) -> u32 {
        self.clock & !CLOCK_HELD
    }
    pub(super) fn held(self) -> bool {
        self.clock & CLOCK_HELD != 0
    }
    /// The last clock whose answer was let go (or will be, for the
    /// duplicate of one): what a PULL reports.
    pub(super) fn answered(self) -> u32 {
        if self.held() {
            self.applied().saturating_sub(1)
        } else {
            self.applied()
        }
    }
}

/// The lowest applied clock of a slot's ranks.
pub(super) fn slowest(clocks: &[RankClock]) -> u32 {
    clocks.iter().map(|c| c.applied()).min().unwrap_or(0)
}

/// Applies rank `rank`'s push of clock `c` (the next after its applied
/// one, its answer not held: the caller checked) to a slot past round 0:
/// the slot's update count is the optimizer's step t, then the rank's
/// clock, its held flag and whether the slowest clock rose (PROTOCOL.md
/// §5.8 rule 2). `dtypes`: the job's (the result's encoding) and the
/// payload's (the job's at a primary; `f32` at a backup, §11.10), the same
/// `f32` operations either way. Returns (held, slowest rose).
#[allow(clippy::too_many_arguments)]
pub(super) fn update_clocked(
    k: &Kernels,
    (slot, blocks): (&mut Slot, &mut Blocks),
    clocks: &mut [RankClock],
    consistency: Consistency,
    opt: &Optimizer,
    (dtype, from): (Dtype, Dtype),
    (rank, c): (u16, u32),
    payload: &[u8],
    now: u64,
) -> (bool, bool) {
    let before = slowest(clocks);
    debug_assert!(
        !slot.completed.is_none(),
        "a clocked push before round 0 completed"
    );
    let t = slot.completed.next_saturating();
    slot.completed = Round::new(t);
    if opt.keeps_params() {
        let b = slot.mem.bufs(blocks);
        k.copy(from, b.acc, payload);
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
                k.add(from, if slot.mem.acc_in_a { b } else { a }, payload);
            }
            _ => {
                // Half: the current values in f32 are the accumulator
                // (round 0 left them there); the result is them encoded.
                let b = slot.mem.bufs(blocks);
                k.add(from, b.acc, payload);
                kernels::encode(dtype, b.acc, bytemuck::cast_slice_mut(b.half));
            }
        }
    }
    let r = usize::from(rank);
    clocks[r].clock = c;
    let after = slowest(clocks);
    let held = match consistency {
        Consistency::Bounded { delay } => u64::from(c) > u64::from(after) + u64::from(delay),
        _ => false,
    };
    if held {
        // Cast: microseconds of the caller's clock, kept modulo 2^32.
        #[allow(clippy::cast_possible_truncation)]
        let since = ((now / 1000) as u32).min(SINCE_UNKNOWN - 1);
        clocks[r] = RankClock {
            clock: c | CLOCK_HELD,
            since,
        };
    }
    (
        held,
        after > before && matches!(consistency, Consistency::Bounded { .. }),
    )
}

/// Bounded delay: lets go, in `clocks` alone, every held answer within τ
/// of the slowest clock, as [`Shard::release`] does (a backup slot keeps
/// its primary's held flags this way, PROTOCOL.md §11.10; it sends
/// nothing).
pub(super) fn clear_released(clocks: &mut [RankClock], consistency: Consistency) {
    let Consistency::Bounded { delay } = consistency else {
        return;
    };
    let limit = u64::from(slowest(clocks)) + u64::from(delay);
    for c in clocks.iter_mut() {
        if c.held() && u64::from(c.applied()) <= limit {
            *c = RankClock {
                clock: c.applied(),
                since: 0,
            };
        }
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// A PUSH (or a late INIT) of a job that is not BSP, to a slot past
    /// round 0: the clock rules of the invariants at the head of the
    /// engine module. `clocks` are the slot's ranks'; `waiting`: the
    /// rank's last answer waits for the slot's backups (PROTOCOL.md
    /// §11.10), which holds it as a held answer is held; `full`: no push
    /// is applied now (`backlog`: a state copy runs, or the lcore's update
    /// log has no room).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_clocked(
        k: &Kernels,
        (slot, blocks): (&mut Slot, &mut Blocks),
        clocks: &mut [RankClock],
        consistency: Consistency,
        opt: &Optimizer,
        dtype: Dtype,
        repr: &Repr,
        payload: &[u8],
        (waiting, full): (bool, bool),
        now: u64,
    ) -> Result<Step, DropReason> {
        let mine = clocks[usize::from(repr.rank)];
        let held = mine.held() || waiting;
        let c = repr.round;
        if c <= mine.applied() {
            // A duplicate (or a late INIT): never applied again. Answered
            // with the current values unless this rank's answer is held,
            // which the release will send. An older clock than the held
            // one (a rank repeating clocks after a pull) is answered when
            // within τ of the slowest, as its release would have been:
            // held, the rank would wait for a release that may need its
            // own later clocks on other chunks (PROTOCOL.md §5.8 rule 1).
            let within = match consistency {
                Consistency::Bounded { delay } => {
                    u64::from(c) <= u64::from(slowest(clocks)) + u64::from(delay)
                }
                _ => true,
            };
            return if held && (c == mine.applied() || !within) {
                Err(DropReason::Duplicate)
            } else {
                Ok(Step::Resend(Some(c)))
            };
        }
        if held || c != mine.applied() + 1 || c > MAX_CLOCK {
            return Err(DropReason::Ahead);
        }
        if full {
            return Err(DropReason::Backlog);
        }
        let payload = contribution(None, repr, payload)?;
        let (held, slowest_rose) = update_clocked(
            k,
            (slot, blocks),
            clocks,
            consistency,
            opt,
            (dtype, dtype),
            (repr.rank, c),
            payload,
            now,
        );
        Ok(Step::Applied { held, slowest_rose })
    }

    /// Bounded delay: after slot `slot`'s lowest clock rose, releases every
    /// held answer whose clock is now within τ of it, one RESULT per clock
    /// (all of them share one clock in every state the engine reaches: the
    /// lowest clock rises by one at a time). `defer`: the update that
    /// released them is on its way to the slot's backups (PROTOCOL.md
    /// §11.10): their answers wait for it instead.
    pub(super) fn release(
        job: &mut Job<A>,
        slot: u32,
        now: u64,
        pending: &mut Vec<Pending<A>>,
        counters: &ShardCounters,
        defer: Option<u32>,
    ) {
        let Consistency::Bounded { delay } = job.consistency else {
            return;
        };
        let workers = job.workers;
        let w = usize::from(workers);
        let at = slot as usize * w;
        let Some(clocks) = job.clocks.get_mut(at..at + w) else {
            return;
        };
        let low = slowest(clocks);
        let limit = u64::from(low) + u64::from(delay);
        // Cast: microseconds of the caller's clock, kept modulo 2^32.
        #[allow(clippy::cast_possible_truncation)]
        let now_us = (now / 1000) as u32;
        // Clocks restored from a checkpoint were held before a restart; the
        // rule that one clock is released at a time holds for those the
        // engine held itself.
        let restored = clocks.iter().any(|c| c.held() && c.since == SINCE_UNKNOWN);
        let mut released = None;
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
                    job.counters.held_wait_us += waited;
                    job.counters.held_wait_max_us = job.counters.held_wait_max_us.max(waited);
                }
                *c = RankClock {
                    clock: c.applied(),
                    since: 0,
                };
            }
            let Some(clock) = clock else {
                // Every answer still held leaves its rank more than τ ahead.
                debug_assert!(
                    clocks.iter().all(|c| !c.held() || u64::from(c.applied()) > limit),
                    "a held answer within the bound stays held"
                );
                return;
            };
            debug_assert!(
                released.is_none() || restored,
                "ranks released at clocks {released:?} and {clock} at once"
            );
            released = Some(clock);
            job.counters.held = job.counters.held.saturating_sub(n);
            job.counters.max_lead = job
                .counters
                .max_lead
                .max(clock.saturating_add(1).saturating_sub(low));
            counters.answers_released.add(n);
            if let (Some(t), Some(rep)) = (defer, job.replica.as_deref_mut()) {
                for r in (0..workers).filter(|&r| ranks.contains(r)) {
                    rep.wait(slot, workers, r, t);
                }
                continue;
            }
            counters.results_sent.add(n);
            pending.push(Pending::Result {
                job: job.id,
                slot,
                to: To::Set(ranks),
                round: Some(clock),
            });
        }
    }
}
