//! A replicated job's epoch changes on one lcore (PROTOCOL.md §11.6).
//!
//! An epoch change is control's [`EpochView`]: the layout's new epoch and
//! every appliance declared down since admission. Applying it:
//! - the install's epoch becomes the view's: replication messages of any
//!   other are dropped `wrong_epoch`, worker messages of any other are
//!   refused with an ERROR `wrong_epoch` carrying the new one (fencing);
//! - down appliances leave this appliance's replica set: a pending
//!   aggregate that waited only for them completes now and its RESULTs
//!   are queued; later rounds wait for the live backups only;
//! - the backup slots of each part whose home is down and whose first live
//!   set member is this appliance are **adopted**: they become primary
//!   slots with the state they hold, at their extended slot numbers
//!   ([`phub_proto::failover`]); their round in progress has no
//!   contributors, so workers resend their pushes of it.
//!
//! Invariants: epochs only grow and down lists only grow; an epoch is
//! applied whole or not at all; the same epoch with the same down list
//! again changes nothing. Adopted slots are appended to the job's slots in
//! the order of their parts, so an adopted slot's index is its extended
//! slot number: an adoption that would leave a gap (a backup part of a
//! lower home not adopted) or a live backup of the adopted part (replicas
//! 3: it would need REPLICATEs from the new primary) is refused, not built.

use phub_proto::failover::EpochView;

use super::error::EngineError;
use super::replica::{Pushed, Replica};
use super::{round_done, Shard};

impl<A: Copy + Eq> Shard<A> {
    /// Applies `view` to job `id`'s part on this lcore (PROTOCOL.md
    /// §11.6): `Ok(true)` when it changed something, `Ok(false)` when it
    /// is the installed epoch with the same down list; refused, nothing
    /// changed, when the job is not a replicated one installed here, the
    /// view is malformed, older than the installed epoch, takes an
    /// appliance out of the down list, names this appliance down, or needs
    /// what is not built (module head). RESULTs of rounds it completes are
    /// queued ([`Shard::transmits`]).
    pub fn change_epoch(&mut self, id: u16, view: &EpochView) -> Result<bool, EngineError> {
        let refuse = |conflict: bool, reason: String| EngineError::Epoch {
            id,
            epoch: view.epoch,
            conflict,
            reason,
        };
        let Some(i) = self.jobs.iter().position(|j| j.id == id) else {
            return Err(refuse(true, "the job is not installed on this lcore".into()));
        };
        let job = &mut self.jobs[i];
        let Some(rep) = job.replica.as_deref_mut() else {
            return Err(refuse(
                true,
                "the job is not replicated (epochs are a replicated job's, PROTOCOL.md §11.5)".into(),
            ));
        };
        let n = rep.sets.len();
        if view.down.windows(2).any(|w| w[0] >= w[1]) || view.down.iter().any(|&d| usize::from(d) >= n) {
            return Err(refuse(
                false,
                format!(
                    "down {:?}: appliance indices 0..{n}, ascending, each once",
                    view.down
                ),
            ));
        }
        if view.epoch < rep.epoch {
            return Err(refuse(
                true,
                format!("epoch {} is installed; epochs only grow", rep.epoch),
            ));
        }
        if view.epoch == rep.epoch {
            return if view.down == rep.down {
                Ok(false)
            } else {
                Err(refuse(
                    true,
                    format!(
                        "epoch {} is installed with down {:?}, not {:?}",
                        rep.epoch, rep.down, view.down
                    ),
                ))
            };
        }
        if let Some(d) = rep.down.iter().find(|d| !view.down.contains(d)) {
            return Err(refuse(
                true,
                format!(
                    "appliance {d} is down in epoch {} and not in this one; an appliance does not come back",
                    rep.epoch
                ),
            ));
        }
        if view.is_down(usize::from(rep.me)) {
            return Err(refuse(true, format!("it names this appliance ({}) down", rep.me)));
        }
        // The parts to adopt: a prefix of the backed-up parts (module head).
        let mut adopt = 0;
        for part in &rep.parts {
            let set = &rep.sets[usize::from(part.primary)];
            let first_live = set.iter().find(|&&a| !view.is_down(usize::from(a)));
            if first_live != Some(&rep.me) {
                continue;
            }
            if let Some(b) = set
                .iter()
                .skip_while(|&&a| a != rep.me)
                .skip(1)
                .find(|&&a| !view.is_down(usize::from(a)))
            {
                return Err(refuse(
                    true,
                    format!(
                        "this appliance would adopt appliance {}'s part, whose backup {b} is live: \
                         replicating an adopted part is not built (replicas 2, or 3 with both others down)",
                        part.primary
                    ),
                ));
            }
            if adopt
                != rep
                    .parts
                    .iter()
                    .position(|p| p.primary == part.primary)
                    .unwrap_or(usize::MAX)
            {
                return Err(refuse(
                    true,
                    format!(
                        "this appliance would adopt appliance {}'s part while keeping the backup slots \
                         of a part before it: extended slot numbers past a gap are not built",
                        part.primary
                    ),
                ));
            }
            adopt += 1;
        }

        // Applied from here on, whole.
        rep.epoch = view.epoch;
        rep.down.clone_from(&view.down);
        rep.stats.epoch_changes += 1;
        self.counters.epoch_changes.inc();
        // Down backups leave this appliance's set; each pending aggregate's
        // acknowledgements are renumbered over the backups left.
        let kept: Vec<bool> = rep
            .backups
            .iter()
            .map(|(b, _)| !view.is_down(usize::from(*b)))
            .collect();
        if kept.iter().any(|k| !k) {
            let mut k = 0;
            rep.backups.retain(|_| {
                k += 1;
                kept[k - 1]
            });
            for p in &mut rep.pushed {
                let mut acked = 0u8;
                let mut at = 0;
                for (old, &keep) in kept.iter().enumerate() {
                    if keep {
                        acked |= ((p.acked >> old) & 1) << at;
                        at += 1;
                    }
                }
                p.acked = acked;
            }
        }
        // Rounds whose aggregates no live backup still owes complete now.
        let left = rep.backups.len();
        let mut released = Vec::new();
        for (s, p) in rep.pushed.iter_mut().enumerate() {
            if !p.round.is_none() && Replica::<A>::all(left, p.acked) {
                *p = Pushed::default();
                // Cast: s indexes the job's slots, which fit a u32 (install).
                #[allow(clippy::cast_possible_truncation)]
                released.push(s as u32);
            }
        }
        rep.next_deadline = rep
            .pushed
            .iter()
            .filter(|p| !p.round.is_none())
            .map(|p| p.deadline)
            .min()
            .unwrap_or(u64::MAX);
        rep.stats.rounds_released += released.len() as u64;
        rep.stats.rounds_replicated += released.len() as u64;
        // Adopted parts: their backup slots follow the job's slots, with
        // the state they hold; their memory blocks follow the job's.
        let adopted: Vec<_> = rep.parts.drain(..adopt).collect();
        for part in adopted {
            rep.stats.slots_adopted += part.slots.len() as u64;
            let base = job.blocks.len();
            job.slots.extend(part.slots.into_iter().map(|mut s| {
                s.mem.block += base;
                s
            }));
            job.blocks.extend(part.blocks);
        }
        for s in released {
            let slot = &mut job.slots[s as usize];
            slot.complete(
                job.dtype,
                &job.optimizer,
                job.workers,
                job.quorum,
                &mut job.blocks,
            );
            self.counters.rounds_completed.inc();
            self.counters.rounds_replicated.inc();
            round_done(&mut self.pending, &self.counters, job, s);
        }
        Ok(true)
    }
}
