//! Draining an appliance (`POST /v1/appliances/{name}/drain`, PROTOCOL.md
//! §11.8): every job on it moves to another appliance while it runs, so
//! that it can be removed.
//!
//! A job moves only if it is replicated and at full strength, or down
//! only on the drained appliance (a drain of an appliance that died is
//! its replacement by a spare): its part on the drained appliance (index
//! `i` in layout order) has a live backup holding its state, which serves
//! it while the new appliance is filled.
//! For each such job control picks a spare: an appliance that is not one
//! of the job's, not declared down, not an alias, not being drained, with
//! at least the part's lcores, whose rack label gives every part the same
//! replica set (so the layout every worker and appliance holds still
//! holds). The job moves to its next epoch with index `i` **moved** to
//! the spare ([`EpochView::with_moved`]: joined at that epoch, at the
//! spare's data address), recorded with the job (its part now the
//! spare's) before anyone is told; then it re-replicates as an appliance
//! that came back does (§11.7, [`Shared::rejoin`]): the spare is
//! installed empty at that epoch, the other appliances take the epoch
//! (they send index `i`'s traffic to the spare from then on, and drop the
//! drained appliance's replication messages), the primaries copy the
//! state, and control watches until full strength. The drained appliance
//! is out of the job at once: reconciliation removes the job there (it
//! holds a job not admitted there), and until then it completes no round
//! (its backups no longer acknowledge it), so workers asking it find
//! silence and ask control for the epoch.
//!
//! A rebalance (`POST /v1/jobs/{id}/rebalance`, [`Shared::rebalance`])
//! moves one part of one job the same way, from its most loaded
//! appliance to the least loaded spare, when that evens the load.
//!
//! All or nothing: if any job cannot move (not replicated, down on
//! another appliance or re-replicating, failed, or no spare fits), the
//! drain is refused
//! naming each such job and why, and nothing changes.

use phub_proto::api::{Drain, DrainMove, PartMove, Rebalance, Rereplication, Strength};
use phub_proto::failover::EpochView;

use super::failover::unix_ms;
use super::http::{not_admitted, RequestError};
use std::sync::{Arc, MutexGuard};

use super::registry::{Entry, Inner, Shared};

/// One job's move: the job, the drained appliance's index in it, the
/// spare and the epoch with it moved.
struct Move {
    id: u16,
    index: usize,
    to: String,
    view: EpochView,
}

impl Shared {
    /// `POST /v1/appliances/{name}/drain`: moves every job off appliance
    /// `name` (module head) and marks it drained; refused, nothing
    /// changed, naming every job that cannot move.
    pub(super) fn drain(&self, name: &str) -> Result<Drain, RequestError> {
        let this = self
            .this
            .upgrade()
            .ok_or_else(|| RequestError::State("control is stopping; nothing was drained".into()))?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        if !inner.appliances.contains_key(name) {
            return Err(RequestError::NotFound(format!(
                "no appliance {name:?}; see phubctl appliance list"
            )));
        }
        let (moves, refused) = plan(&inner, name);
        if !refused.is_empty() {
            return Err(RequestError::Conflict(format!(
                "appliance {name:?} cannot be drained; nothing was changed: {}",
                refused.join("; ")
            )));
        }
        if !inner.appliances[name].spec.draining {
            let recorded = self.commit(&mut inner, Entry::Appliance(name), |inner| {
                if let Some(a) = inner.appliances.get_mut(name) {
                    a.spec.draining = true;
                }
            });
            if let Err(e) = recorded {
                return Err(RequestError::State(format!(
                    "{e}; appliance {name:?} was not drained (nothing was changed)"
                )));
            }
        }
        let (moved, failed) = self.apply_moves(&this, inner, name, moves, "drained");
        if let Some(e) = failed {
            let done: Vec<String> = moved.iter().map(|d| d.job.to_string()).collect();
            return Err(RequestError::State(format!(
                "{e} (jobs moved before it: [{}]); drain again",
                done.join(", ")
            )));
        }
        let report = Drain {
            appliance: name.to_string(),
            moved,
        };
        log::info!(
            "appliance {name:?} drained: {} jobs moved; it takes no new job",
            report.moved.len()
        );
        Ok(report)
    }
}

impl Shared {
    /// `POST /v1/jobs/{id}/rebalance` (PROTOCOL.md §11.8): moves one part
    /// of replicated job `id`, at full strength, from the most loaded of
    /// its appliances (the most jobs with parts there) to the least loaded
    /// spare (the drain's rules, module head), when that leaves the two
    /// more even (the spare holds at least two jobs fewer); the move is a
    /// drain's, of that part alone. Nothing moved when no move evens the
    /// load; refused, nothing changed, for a job that is not replicated,
    /// failed or not at full strength. One part per call: the next once
    /// the job is back to full strength.
    pub(super) fn rebalance(&self, id: u16) -> Result<Rebalance, RequestError> {
        let this = self
            .this
            .upgrade()
            .ok_or_else(|| RequestError::State("control is stopping; nothing was moved".into()))?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        let what = format!("job {id} ({:?})", job.spec.name);
        if let Some(why) = &job.failed {
            return Err(RequestError::Conflict(format!(
                "{what} failed ({why}); nothing was moved"
            )));
        }
        if !job.is_replicated() {
            return Err(RequestError::Conflict(format!(
                "{what} is not replicated ([placement] replicas = 1): its parts cannot move \
                 while it runs; nothing was moved"
            )));
        }
        let rack = |n: &str| inner.rack_of(n);
        match job.strength(rack).map(|s| (s.state, s.live, s.wanted)) {
            Some((Strength::FullStrength, _, _)) => {}
            Some((state, live, wanted)) => {
                return Err(RequestError::Conflict(format!(
                    "{what} is not at full strength ({state:?}, {live} of {wanted} replicas live): a part moves \
                     only while another live appliance holds its state; rebalance once `phubctl job show {id}` \
                     says full strength"
                )))
            }
            None => {
                return Err(RequestError::Conflict(format!(
                    "{what}: its replica strength cannot be read; nothing was moved"
                )))
            }
        }
        let layout = job
            .replica_layout(rack)
            .map_err(|e| RequestError::State(format!("{what}: its layout cannot be read ({e})")))?;
        let load = |n: &str| inner.jobs_on(n).len();
        // The move that narrows the widest gap: from the most loaded part
        // to its least loaded spare, ties by index and then name.
        let mut best: Option<(usize, usize, &str, phub_proto::api::DataAddr)> = None;
        for (index, part) in job.parts.iter().enumerate() {
            let from = load(&part.appliance);
            let mut found = spares(&inner, job, &part.appliance, part.lcores as usize, &layout);
            found.sort_by_cached_key(|(n, _)| (load(n), n.to_string()));
            let Some((to, data)) = found.into_iter().next() else {
                continue;
            };
            let gap = from.saturating_sub(load(to));
            if gap >= 2 && best.as_ref().is_none_or(|b| gap > b.1) {
                best = Some((index, gap, to, data));
            }
        }
        let loads = |inner: &Inner, job: &crate::state::StoredJob| -> Vec<(String, usize)> {
            job.parts
                .iter()
                .map(|p| (p.appliance.clone(), inner.jobs_on(&p.appliance).len()))
                .collect()
        };
        let Some((index, _, to, data)) = best else {
            log::info!("{what}: rebalance: no move makes its appliances' load more even");
            return Ok(Rebalance {
                job: id,
                moved: None,
                load: loads(&inner, job),
            });
        };
        let from = job.parts[index].appliance.clone();
        let index16 = u16::try_from(index).expect("a job's appliances are numbered in u16");
        let m = Move {
            id,
            index,
            to: to.to_string(),
            view: job.epoch.with_moved(index16, to, data),
        };
        let (moved, failed) = self.apply_moves(&this, inner, &from, vec![m], "rebalanced");
        if let Some(e) = failed {
            return Err(RequestError::State(e));
        }
        let moved = moved.into_iter().next().map(|m| PartMove {
            index: index16,
            from,
            to: m.to,
            epoch: m.epoch,
        });
        let inner = self.lock();
        let load = inner.jobs.get(&id).map(|j| loads(&inner, j)).unwrap_or_default();
        Ok(Rebalance { job: id, moved, load })
    }
}

impl Shared {
    /// Records each of `moves` off appliance `name` (the job's epoch, its
    /// part's appliance, the start of its re-replication), durably, and
    /// starts each recorded one's re-replication ([`Shared::rejoin_in_thread`]);
    /// stops at the first that cannot be recorded, saying so. `why` is
    /// logged (drained, down).
    fn apply_moves(
        &self,
        this: &Arc<Shared>,
        mut inner: MutexGuard<'_, Inner>,
        name: &str,
        moves: Vec<Move>,
        why: &str,
    ) -> (Vec<DrainMove>, Option<String>) {
        let mut moved = Vec::new();
        let mut started = Vec::new();
        let mut failed = None;
        for m in moves {
            let record = Rereplication {
                appliance: m.to.clone(),
                epoch: m.view.epoch,
                started_unix_ms: unix_ms(),
                ended_unix_ms: None,
                bytes_copied: None,
                abandoned: None,
                replaced: Some(name.to_string()),
            };
            let recorded = self.commit(&mut inner, Entry::Job(m.id), |inner| {
                let job = inner.jobs.get_mut(&m.id).expect("looked up under the same lock");
                job.set_epoch(m.view.clone());
                job.parts[m.index].appliance.clone_from(&m.to);
                job.rereplication = Some(record);
            });
            let job = &inner.jobs[&m.id];
            if let Err(e) = recorded {
                failed = Some(format!(
                    "{e}; job {} ({:?}) was not moved off appliance {name:?}",
                    m.id, job.spec.name
                ));
                break;
            }
            log::warn!(
                "job {} ({:?}) moves off appliance {name:?} ({why}) to appliance {:?} at epoch {}; \
                 installing it there",
                m.id,
                job.spec.name,
                m.to,
                m.view.epoch
            );
            moved.push(DrainMove {
                job: m.id,
                name: job.spec.name.clone(),
                to: m.to.clone(),
                epoch: m.view.epoch,
            });
            inner.rejoining.insert((m.id, m.to.clone()));
            started.push((m.id, m.view, m.to));
        }
        drop(inner);
        for (id, view, to) in started {
            this.rejoin_in_thread(id, view, to, self.beat);
        }
        (moved, failed)
    }

    /// Appliance `name` has stayed declared down for `--spare-after-ms`:
    /// each replicated job on it that can move (the drain's rules, module
    /// head) moves to a spare, the others are logged and wait for it. It
    /// is not marked drained: back, it takes jobs again.
    pub(super) fn move_to_spares(&self, name: &str) {
        let Some(this) = self.this.upgrade() else {
            return;
        };
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let inner = self.lock();
        if !inner.appliances.contains_key(name) {
            return;
        }
        let (moves, refused) = plan(&inner, name);
        for why in &refused {
            log::warn!("appliance {name:?} is still down, but {why}: it waits for the appliance");
        }
        if moves.is_empty() {
            return;
        }
        let (moved, failed) = self.apply_moves(&this, inner, name, moves, "down, a spare takes its place");
        if let Some(e) = failed {
            log::error!("{e}");
        }
        log::info!(
            "appliance {name:?} is still down: {} jobs moved to spares",
            moved.len()
        );
    }
}

/// Each job on `name` and where it moves, and why each job that cannot
/// move cannot (module head).
fn plan(inner: &Inner, name: &str) -> (Vec<Move>, Vec<String>) {
    let (mut moves, mut refused) = (Vec::new(), Vec::new());
    // Spares already given a job by this drain come after the others.
    let mut given: Vec<String> = Vec::new();
    for id in inner.jobs_on(name) {
        let job = &inner.jobs[&id];
        let what = format!("job {id} ({:?})", job.spec.name);
        if let Some(why) = &job.failed {
            refused.push(format!("{what} failed ({why}); evict it"));
            continue;
        }
        if !job.is_replicated() {
            refused.push(format!(
                "{what} is not replicated ([placement] replicas = 1): its part cannot move \
                 while it runs; evict it when it ends"
            ));
            continue;
        }
        let rack = |n: &str| inner.rack_of(n);
        let index = job
            .part_index(name)
            .expect("jobs_on lists the jobs with a part on it");
        // Down itself, every other appliance up: its replacement.
        let only_it_down = job.epoch.down.iter().map(|&d| usize::from(d)).eq([index]);
        match job.strength(rack).map(|s| (s.state, s.live, s.wanted)) {
            Some((Strength::FullStrength, _, _)) => {}
            Some((Strength::Degraded, _, _)) if only_it_down => {}
            Some((state, live, wanted)) => {
                refused.push(format!(
                    "{what} is not at full strength ({state:?}, {live} of {wanted} replicas live): a drain \
                     needs every part's state on another live appliance (every appliance of the job up but \
                     the one drained, no re-replication under way); drain once `phubctl job show {id}` says \
                     full strength"
                ));
                continue;
            }
            None => continue,
        }
        let Ok(layout) = job.replica_layout(rack) else {
            refused.push(format!("{what}: its layout cannot be read"));
            continue;
        };
        let lcores = job.parts[index].lcores as usize;
        let mut spares = spares(inner, job, name, lcores, &layout);
        // The least loaded first, then by name.
        spares.sort_by_cached_key(|(n, _)| {
            (
                given.iter().filter(|g| g == n).count(),
                inner.jobs_on(n).len(),
                n.to_string(),
            )
        });
        let Some((to, data)) = spares.into_iter().next() else {
            refused.push(format!(
                "{what}: no spare appliance fits (one not of the job, not declared down or drained, with at \
                 least {lcores} lcores, whose rack keeps every part's replica set); add one (phubctl \
                 appliance add)"
            ));
            continue;
        };
        given.push(to.to_string());
        let index16 = u16::try_from(index).expect("a job's appliances are numbered in u16");
        moves.push(Move {
            id,
            index,
            to: to.to_string(),
            view: job.epoch.with_moved(index16, to, data),
        });
    }
    (moves, refused)
}

/// The appliances that can take job `job`'s part on appliance `name` (of
/// `lcores` lcores; `layout` the job's replica layout): not one of the
/// job's, not declared down, not an alias, not being drained, with at
/// least `lcores` lcores, whose rack label keeps every part's replica set
/// (module head); each with its data address.
fn spares<'i>(
    inner: &'i Inner,
    job: &crate::state::StoredJob,
    name: &str,
    lcores: usize,
    layout: &phub_proto::failover::ReplicaLayout<String>,
) -> Vec<(&'i str, phub_proto::api::DataAddr)> {
    inner
        .appliances
        .values()
        .filter(|a| {
            a.spec.name != name
                && !a.spec.draining
                && a.alias.is_none()
                && a.liveness.down.is_none()
                && job.part_index(&a.spec.name).is_none()
        })
        .filter_map(|a| {
            let info = a.info.as_ref()?;
            (info.lcores.len() >= lcores).then(|| (a.spec.name.as_str(), info.data.clone()))
        })
        .filter(|(spare, _)| {
            let swapped = |n: &str| {
                if n == name {
                    inner.rack_of(spare)
                } else {
                    inner.rack_of(n)
                }
            };
            job.replica_layout(swapped)
                .is_ok_and(|l| (0..l.appliances()).all(|p| l.set(p) == layout.set(p)))
        })
        .collect()
}
