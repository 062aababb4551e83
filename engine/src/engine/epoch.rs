//! A replicated job's epoch changes on one lcore (PROTOCOL.md §11.6,
//! §11.7).
//!
//! An epoch change is control's [`EpochView`]: the layout's new epoch,
//! every appliance down and every appliance that came back. Applying it:
//! - the install's epoch becomes the view's: replication messages of any
//!   other are dropped `wrong_epoch`, worker messages of any other are
//!   refused with an ERROR `wrong_epoch` carrying the new one (fencing);
//! - an appliance index the view newly names `moved` (a drain, §11.8) is
//!   addressed at its new appliance's lcores from now on: replication
//!   messages from the old one are dropped as from a stranger; the index
//!   is joined at the same epoch, so it is a new backup as below;
//! - each part served here gets its backups of the new epoch (its set in
//!   the epoch after this appliance, [`phub_proto::failover::ReplicaLayout::set_in`]): down ones
//!   leave, and a pending aggregate that waited only for them completes
//!   now, its RESULTs queued; backups that were not backups of the part
//!   here before (they came back, or the part is adopted now) are **new**:
//!   each gets a state copy of every chunk and is counted at once
//!   ([`super::copy`]);
//! - the backup slots of each part whose first member in the new epoch is
//!   this appliance are **adopted**: they become primary slots with the
//!   state they hold, at their extended slot numbers
//!   ([`phub_proto::failover`]); their round in progress has no
//!   contributors, so workers resend their pushes of it;
//! - the backup slots of each part whose primary changed await a copy
//!   from the new one.
//!
//! Invariants: epochs only grow; an appliance leaves the down list only
//! by coming back (joined at a newer epoch than the installed one); an
//! epoch is applied whole or not at all; the same view again changes
//! nothing. An adopted slot's index in the job's slots is its extended
//! slot number: where a part backed up before it is not adopted, vacant
//! slots stand for that part's ([`Slot::vacant`]: no chunk, no memory,
//! every message refused), and are taken by it if it is adopted later.
//! An adoption of a part whose state copy is not all here is refused (the
//! part is lost), and so is one from an epoch older than the one before
//! when two or more members before this appliance went down since: in a
//! skipped epoch another of them may have served the part (and answered
//! rounds this copy lacks).

use phub_proto::failover::EpochView;

use super::clock::RankClock;
use super::copy::{Fill, Where};
use super::error::EngineError;
use super::hier::Hier;
use super::replica::{Group, Pushed, Replica};
use super::slot::{RankSet, Round, Slot};
use super::{round_done, Job, Shard};

impl<A: Copy + Eq> Shard<A> {
    /// Applies `view` to job `id`'s part on this lcore (PROTOCOL.md
    /// §11.6, §11.7): `Ok(true)` when it changed something, `Ok(false)`
    /// when it is the installed view; refused, nothing changed, when the
    /// job is not a replicated one installed here, the view is malformed,
    /// older than the installed epoch, takes an appliance out of the down
    /// list without it joining after the installed epoch, names this
    /// appliance down or come back, would have it serve a part whose state
    /// copy is not here, or needs what is not built (module head). RESULTs
    /// of rounds it completes and state copies to new backups are queued
    /// ([`Shard::transmits`]).
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
        let n = rep.layout.appliances();
        view.check(n).map_err(|reason| refuse(false, reason))?;
        let old = rep.view.clone();
        if view.epoch < old.epoch {
            return Err(refuse(
                true,
                format!("epoch {} is installed; epochs only grow", old.epoch),
            ));
        }
        if view.epoch == old.epoch {
            return if *view == old {
                Ok(false)
            } else {
                Err(refuse(
                    true,
                    format!(
                        "epoch {} is installed with down {:?} and joined {:?}, not {:?} and {:?}",
                        old.epoch, old.down, old.joined, view.down, view.joined
                    ),
                ))
            };
        }
        if let Some(d) = old.down.iter().find(|&&d| {
            !view.is_down(usize::from(d)) && view.joined_at(usize::from(d)).is_none_or(|e| e <= old.epoch)
        }) {
            return Err(refuse(
                true,
                format!(
                    "appliance {d} is down in epoch {} and not in this one, but not joined after it; \
                     an appliance comes back only joined (PROTOCOL.md §11.7)",
                    old.epoch
                ),
            ));
        }
        if let Some(j) = old
            .joined
            .iter()
            .find(|j| view.joined_at(usize::from(j.appliance)) < Some(j.epoch))
        {
            return Err(refuse(
                true,
                format!(
                    "appliance {} joined at epoch {} is not joined then or later in this one",
                    j.appliance, j.epoch
                ),
            ));
        }
        let me = usize::from(rep.me);
        if view.is_down(me) {
            return Err(refuse(true, format!("it names this appliance ({me}) down")));
        }
        if view.joined_at(me) > old.joined_at(me) {
            return Err(refuse(
                true,
                format!(
                    "it names this appliance ({me}) come back at epoch {:?}: one that comes back is installed anew",
                    view.joined_at(me)
                ),
            ));
        }
        // Indices served by another appliance from this epoch on (a
        // drain, PROTOCOL.md §11.8): their lcores' new addresses.
        let mut readdressed: Vec<(usize, Vec<A>)> = Vec::new();
        for m in view.moves_since(&old) {
            let a = usize::from(m.appliance);
            let lcores = rep.addrs[a].len();
            let resolved = (0..lcores)
                .map(|l| {
                    m.lcore_addr(l)
                        .and_then(|at| self.peers.0.as_ref().and_then(|r| r(at)))
                })
                .collect::<Option<Vec<A>>>()
                .ok_or_else(|| {
                    refuse(
                        false,
                        format!(
                            "appliance {a} moved to {:?} at {}:{}, which this backend cannot address",
                            m.name, m.data.host, m.data.base_port
                        ),
                    )
                })?;
            readdressed.push((a, resolved));
        }
        // The parts to adopt: any of the backed-up parts (module head).
        let mut adopt = Vec::new();
        for (k, part) in rep.parts.iter().enumerate() {
            let p = usize::from(part.home);
            if rep.layout.primary(p, view) != Some(me) {
                continue;
            }
            // Its state must be all here, and be the part's latest: an
            // lcore that skipped epochs (it takes this one from an older
            // than the one before) while two or more members before it
            // went down may have missed one in which another of them
            // served the part and answered rounds this copy lacks (taken
            // in order, that epoch would have had it await that member's
            // copy, and this one would find the part lost too).
            let skipped = view.epoch > old.epoch + 1;
            let gone_before = rep
                .layout
                .set_in(p, &old)
                .into_iter()
                .take_while(|&a| a != me)
                .filter(|&a| view.is_down(a))
                .count();
            let why = match (part.fill.is_empty(), skipped && gone_before >= 2) {
                (false, _) => Some("whose state copy is not all here"),
                (true, true) => Some(
                    "whose copy here may be behind: this lcore skipped an epoch in which another member may \
                     have served it",
                ),
                (true, false) => None,
            };
            if let Some(why) = why {
                return Err(EngineError::PartLost {
                    id,
                    epoch: view.epoch,
                    part: p,
                    why,
                });
            }
            adopt.push(k);
        }
        // Every part served here stays served here: its members before
        // this appliance were down, and come back only at the end.
        for g in &rep.groups {
            let p = usize::from(g.home);
            assert_eq!(
                rep.layout.primary(p, view),
                Some(me),
                "appliance {me} serves part {p} in epoch {} and not in {}",
                old.epoch,
                view.epoch
            );
        }

        // Its tables (PROTOCOL.md §11.9): what needs a table's state
        // copied is refused before anything is applied.
        let old_view = rep.view.clone();
        self.check_table_epoch(i, view)?;
        let job = &mut self.jobs[i];
        // Applied from here on, whole. A hierarchical part goes flat first.
        let flat = job.hier.take().map(|h| flatten(job, *h)).is_some();
        let rep = job.replica.as_deref_mut().expect("checked above");
        debug_assert_eq!(rep.view, old_view);
        rep.view = view.clone();
        for (a, addrs) in readdressed {
            rep.addrs[a] = addrs;
        }
        rep.stats.epoch_changes += 1;
        self.counters.epoch_changes.inc();
        // Each served part's backups in the new epoch; acknowledgements
        // renumbered over them; the new ones to copy to.
        let mut copies: Vec<(std::ops::Range<u32>, u8)> = Vec::new();
        let Replica {
            groups,
            pushed,
            updates,
            layout,
            addrs,
            ..
        } = &mut *rep;
        for g in groups.iter_mut() {
            let p = usize::from(g.home);
            let set = layout.set_in(p, view);
            let mut backups = Vec::with_capacity(set.len().saturating_sub(1));
            // Per new backup: its old index, if it is kept.
            let mut from_old = Vec::with_capacity(set.len().saturating_sub(1));
            for &b in &set[1..] {
                // Cast: b < n, whose indices the install's u16 `me` spans.
                #[allow(clippy::cast_possible_truncation)]
                let b16 = b as u16;
                let kept = g
                    .backups
                    .iter()
                    .position(|(x, _)| *x == b16)
                    .filter(|_| view.joined_at(b).is_none_or(|e| e <= old.epoch));
                from_old.push(kept);
                backups.push((b16, Where::of_backup(layout, addrs, p, b)));
            }
            let mut new = 0u8;
            for (k, o) in from_old.iter().enumerate() {
                if o.is_none() {
                    new |= 1 << k;
                }
            }
            for s in &mut pushed[g.base as usize..(g.base + g.count) as usize] {
                let (mut acked, mut copying) = (0u8, 0u8);
                for (k, o) in from_old.iter().enumerate() {
                    if let Some(o) = o {
                        acked |= ((s.acked >> o) & 1) << k;
                        copying |= ((s.copying >> o) & 1) << k;
                    }
                }
                s.acked = acked;
                s.copying = copying;
            }
            // An async or bounded-delay job's logged updates (§11.10).
            let range = g.base as usize..(g.base + g.count) as usize;
            for u in updates.get_mut(range).into_iter().flatten() {
                u.renumber(&from_old);
            }
            g.backups = backups;
            copies.push((g.base..g.base + g.count, new));
        }
        // Rounds whose aggregates no backup still owes complete now.
        let mut released = Vec::new();
        for g in groups.iter() {
            let left = g.backups.len();
            for s in g.base..g.base + g.count {
                let p = &mut pushed[s as usize];
                // (An async or bounded-delay slot's log is settled below.)
                let logged = updates.get(s as usize).is_some_and(|u| !u.log.is_empty());
                if !p.round.is_none() && !logged && p.copying == 0 && Replica::<A>::all(left, p.acked) {
                    // No new backup here: new ones have not acknowledged.
                    *p = Pushed::default();
                    released.push(s);
                }
            }
        }
        rep.stats.rounds_released += released.len() as u64;
        rep.stats.rounds_replicated += released.len() as u64;
        // Adopted parts: their backup slots become the job's slots at their
        // extended slot numbers, with the state they hold (vacant slots
        // before them where a part backed up here is not adopted, taken
        // by that part if it is adopted later); their memory blocks follow
        // the job's. Their backups are all new.
        let mut adopted = Vec::with_capacity(adopt.len());
        let mut kept = Vec::with_capacity(rep.parts.len() - adopt.len());
        for (k, part) in rep.parts.drain(..).enumerate() {
            match adopt.contains(&k) {
                true => adopted.push(part),
                false => kept.push(part),
            }
        }
        rep.parts = kept;
        for part in adopted {
            let p = usize::from(part.home);
            rep.stats.slots_adopted += part.slots.len() as u64;
            // Cast: the job's slots fit a u32 (install_with checks).
            #[allow(clippy::cast_possible_truncation)]
            let (base, count) = (part.base, part.slots.len() as u32);
            let set = rep.layout.set_in(p, view);
            // Cast: b < n, whose indices the install's u16 `me` spans.
            #[allow(clippy::cast_possible_truncation)]
            let backups: Vec<_> = set[1..]
                .iter()
                .map(|&b| (b as u16, Where::of_backup(&rep.layout, &rep.addrs, p, b)))
                .collect();
            // Cast: fewer than MAX_REPLICAS backups.
            #[allow(clippy::cast_possible_truncation)]
            let new = ((1u16 << backups.len()) - 1) as u8;
            rep.groups.push(Group {
                home: part.home,
                base,
                first: part.first,
                count,
                backups,
            });
            copies.push((base..base + count, new));
            let at = job.blocks.len();
            let (b, end) = (base as usize, (base + count) as usize);
            if job.slots.len() < end {
                let vacant = || Slot::vacant(job.dtype, &job.optimizer);
                job.slots.resize_with(end, vacant);
            }
            for (i, mut s) in (b..end).zip(part.slots) {
                debug_assert!(job.slots[i].is_vacant(), "an adopted part's slot {i} is taken");
                s.mem.block += at;
                job.slots[i] = s;
            }
            job.blocks.extend(part.blocks);
            rep.pushed.resize(job.slots.len(), Pushed::default());
            if rep.clocked() {
                // The ranks' clocks, as the primary had them (§11.10).
                let w = usize::from(job.workers);
                job.clocks.resize(job.slots.len() * w, RankClock::default());
                job.clocks[b * w..end * w].copy_from_slice(&part.clocks);
                rep.updates.resize_with(job.slots.len(), Default::default);
                rep.waits.resize(job.slots.len() * w, 0);
            }
        }
        // Parts backed up here whose primary changed: their slots await a
        // copy from the new one.
        for part in &mut rep.parts {
            let p = usize::from(part.home);
            let q = rep
                .layout
                .primary(p, view)
                .expect("a part backed up here has a live member: this appliance");
            if q == usize::from(part.from) {
                continue;
            }
            // Cast: q < n, whose indices the install's u16 `me` spans.
            #[allow(clippy::cast_possible_truncation)]
            let from = q as u16;
            part.from = from;
            part.at = Where::of_primary(&rep.layout, &rep.addrs, p, q);
            part.fill = vec![Fill::awaiting(); part.slots.len()];
            for s in &mut part.slots {
                s.completed = Round::NONE;
            }
        }
        rep.next_deadline = rep
            .pushed
            .iter()
            .filter(|p| p.waiting())
            .map(|p| p.deadline)
            .min()
            .unwrap_or(u64::MAX);
        for (slots, new) in copies {
            Self::queue_copies(&mut self.pending, job, slots, new);
        }
        // An async or bounded-delay job's updates that no backup left owes
        // leave their logs, and the answers that waited for them go.
        if job.replica.as_deref().is_some_and(Replica::clocked) {
            // Cast: the job's slots fit a u32 (install_with checks).
            #[allow(clippy::cast_possible_truncation)]
            for s in 0..job.slots.len() as u32 {
                Self::settle(&mut self.pending, &self.counters, job, s);
            }
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
        self.apply_table_epoch(i, &old_view, view);
        if flat {
            // Its senders here are now the job's W ranks.
            self.count_rx_workers();
        }
        Ok(true)
    }
}

/// A replicated hierarchical job's part at its first epoch change
/// (PROTOCOL.md §11.11): from then on a flat replicated job over the home
/// layout. Its home slots become the job's slots, with their state, and
/// run the job's optimizer for its W ranks; a round in progress not all in
/// drops its racks' partials (each rank resends its push here); one all in
/// (its aggregate awaiting backups) counts every rank in, so a rank's push
/// of it is `duplicate` until it completes. The rack slots, their pending
/// partials and timers go; so do the ranks' addresses (each rank's next
/// message, routed by the new epoch, gives its own).
fn flatten<A>(job: &mut Job<A>, h: Hier<A>) {
    let Hier { home, optimizer, .. } = h;
    let (slots, blocks) = home.map_or_else(|| (Vec::new(), Vec::new()), |home| (home.slots, home.blocks));
    job.slots = slots;
    job.blocks = blocks;
    job.optimizer = optimizer;
    job.quorum = job.workers;
    job.members = RankSet::of(0..job.workers);
    for e in &mut job.endpoints {
        *e = None;
    }
    let pushed = job.replica.as_deref().map_or(&[][..], |r| &r.pushed[..]);
    for (k, s) in job.slots.iter_mut().enumerate() {
        if pushed.get(k).is_some_and(|p| !p.round.is_none()) {
            s.contributed = RankSet::of(0..job.workers);
            s.ncontrib = job.workers;
        } else {
            s.contributed = RankSet::default();
            s.ncontrib = 0;
        }
    }
}
