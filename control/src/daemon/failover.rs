//! Failover (PROTOCOL.md §11.6): what an appliance declared down
//! ([`heartbeat`](super::heartbeat)) does to the jobs on it.
//!
//! A replicated job (flat, `[placement] replicas` ≥ 2) whose epoch does
//! not have the appliance down yet moves to the next epoch with it down
//! ([`EpochView::with_down`]), recorded with the job in the state file
//! ([`Shared::commit`]) before anyone is told; then every live appliance
//! of the job is sent it (`PUT /v1/jobs/{id}/epoch`), each in a thread
//! of its own that retries until the appliance answers, is itself
//! declared down, or the job moves on; and `GET /v1/jobs/{id}/epoch`
//! serves it to the workers. If every member of some part's replica set
//! is then down ([`ReplicaLayout::lost_part`]), the job **stalls** when
//! it can go back to its checkpoints ([`Shared::can_go_back`]): the epoch
//! is recorded and put on nobody, and reconciliation takes the whole job
//! back to its checkpoints once every appliance of it answers again
//! (PROTOCOL.md §11.7, "Stalled jobs"); otherwise it fails, naming the
//! part, its appliances and why it cannot go back. A job that is not replicated is
//! left as it is: it waits for the appliance, as before failover existed.
//!
//! An appliance down in a job's epoch is **fenced** from that job:
//! reconciliation never installs the job on it and removes it from it if
//! it still holds it (`reconcile.rs`), so it serves none of the job's
//! workers; until it answers heartbeats again. Then the job
//! **re-replicates** (PROTOCOL.md §11.7, [`Shared::rereplicate`]): it
//! moves to the next epoch with the appliance joined (at the end of its
//! parts' sets), recorded with the job before anyone is told; the job is
//! installed on the appliance, empty, at that epoch; the epoch is put on
//! the job's other live appliances; their primaries copy every chunk's
//! state to it; and control polls the appliances' stats until no copy is
//! awaited or owed, when the job is back to **full strength** (the time
//! and bytes recorded with the job, `phubctl job show`). If the install
//! cannot be done (refused, the appliance down again), the appliance is
//! taken out of the job again ([`Shared::fail_over`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use phub_proto::api::{ReplicaStrength, Rereplication, Strength};
use phub_proto::failover::{EpochView, ReplicaLayout};

use super::http::{failed, not_admitted, RequestError};
use super::registry::{Entry, Inner, Shared};
use crate::dataplane::DataplaneError;
use crate::state::StoredJob;

/// What declaring an appliance down does to one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Decision {
    /// The job goes on in this epoch.
    Next(EpochView),
    /// Every member of a part's replica set is down in this epoch (or
    /// the job is stalled already): the job stalls, for this reason, if
    /// it can go back to its checkpoints ([`Shared::can_go_back`]), and
    /// fails otherwise.
    PartDown(EpochView, String),
    /// The job fails for this reason (in this epoch): its layout cannot
    /// fail over.
    Lost(EpochView, String),
}

impl StoredJob {
    /// Whether it is replicated (`replicas` ≥ 2; flat, or hierarchical
    /// until its first epoch change, PROTOCOL.md §11.11): the jobs that
    /// have epochs beyond 0 and fail over.
    pub(super) fn is_replicated(&self) -> bool {
        self.spec.replicas() > 1
    }

    /// Its layout as failover sees it, each appliance's rack label as
    /// `rack` gives it; an error says what disagrees (a state file edited
    /// by hand).
    pub(super) fn replica_layout(
        &self,
        rack: impl Fn(&str) -> String,
    ) -> Result<ReplicaLayout<String>, String> {
        let lcores: Vec<usize> = self.parts.iter().map(|p| p.lcores as usize).collect();
        let racks = self.parts.iter().map(|p| rack(&p.appliance)).collect();
        ReplicaLayout::new(self.layout.lcores.clone(), &lcores, racks, self.spec.replicas())
    }

    /// Whether appliance `name` holds a part of it that is down in its
    /// epoch: it must not serve the job again.
    pub(super) fn is_down_on(&self, name: &str) -> bool {
        self.part_index(name).is_some_and(|i| self.epoch.is_down(i))
    }

    /// What declaring appliance `name` down does to it; `None` when
    /// nothing (not replicated, failed, not on `name`, or `name` already
    /// down in its epoch).
    pub(super) fn decide(&self, name: &str, rack: impl Fn(&str) -> String) -> Option<Decision> {
        if !self.is_replicated() || self.failed.is_some() {
            return None;
        }
        let index = u16::try_from(self.part_index(name)?).ok()?;
        let next = self.epoch.with_down(index)?;
        let layout = match self.replica_layout(rack) {
            Ok(l) => l,
            Err(e) => {
                let why = format!("its layout cannot fail over ({e})");
                return Some(Decision::Lost(next, why));
            }
        };
        if let Some(why) = &self.stalled {
            return Some(Decision::PartDown(next, why.clone()));
        }
        // A job with a table loses rows with any part, chunks or not.
        let lost = match self.spec.tables().next() {
            Some(_) => layout.lost_part_with_tables(&next),
            None => layout.lost_part(&next),
        };
        let Some(p) = lost else {
            return Some(Decision::Next(next));
        };
        let names = |set: &[usize]| self.names_of(set);
        let chunks = layout.part(p).range();
        let why = format!(
            "part {p} (chunks {}..{}, home appliance {}) is lost: every appliance of its replica set ({}) is \
             down in epoch {} (down: {})",
            chunks.start,
            chunks.end,
            names(&[p]),
            names(&layout.set(p)),
            next.epoch,
            names(&next.down.iter().map(|&d| usize::from(d)).collect::<Vec<_>>())
        );
        Some(Decision::PartDown(next, why))
    }

    /// The names of its parts' appliances at indices `set`, quoted and
    /// comma-separated, for a reason ("?" for an index it lacks).
    pub(super) fn names_of(&self, set: &[usize]) -> String {
        let n: Vec<String> = set
            .iter()
            .map(|&a| format!("{:?}", self.parts.get(a).map_or("?", |p| p.appliance.as_str())))
            .collect();
        n.join(", ")
    }

    /// Whether losing appliance `name`'s state leaves it whole: it is
    /// replicated, in service, `name` serves it in its epoch, and in the
    /// next epoch without `name` every part's replica set keeps a member
    /// that holds the job (`held`: the jobs each appliance holds), not one
    /// a state copy is still filling.
    pub(super) fn survives_without(
        &self,
        name: &str,
        held: &BTreeMap<String, BTreeSet<u16>>,
        rack: impl Fn(&str) -> String,
    ) -> bool {
        let Some(Decision::Next(next)) = self.decide(name, &rack) else {
            return false;
        };
        self.parts_unheld(&next, held, rack).is_empty()
    }

    /// Its parts (by home index) of which no member of the part's set in
    /// epoch `view` holds the job (`held`: the jobs each appliance holds),
    /// not counting the appliance a state copy is still filling: every
    /// replica of such a part lost its state. Every part when its layout
    /// cannot be read.
    pub(super) fn parts_unheld(
        &self,
        view: &EpochView,
        held: &BTreeMap<String, BTreeSet<u16>>,
        rack: impl Fn(&str) -> String,
    ) -> Vec<usize> {
        let Ok(layout) = self.replica_layout(rack) else {
            return (0..self.parts.len()).collect();
        };
        let copying = self.copying_to();
        (0..layout.appliances())
            .filter(|&p| {
                !layout.set_in(p, view).into_iter().any(|a| {
                    self.parts.get(a).is_some_and(|part| {
                        Some(part.appliance.as_str()) != copying
                            && held
                                .get(&part.appliance)
                                .is_some_and(|ids| ids.contains(&self.id))
                    })
                })
            })
            .collect()
    }

    /// Whether its appliance `me` (index in layout order) came back at its
    /// epoch: installed empty, joined, at that epoch (PROTOCOL.md §11.7).
    pub(crate) fn is_returning(&self, me: usize) -> bool {
        self.epoch.epoch > 0 && !self.epoch.is_down(me) && self.epoch.joined_at(me) == Some(self.epoch.epoch)
    }

    /// What appliance `name`, down in its epoch, answering heartbeats again
    /// does to it: the next epoch, with `name` joined; `None` when nothing
    /// (not replicated, failed, not on `name`, or `name` not down in its
    /// epoch) or when it is stalled (it goes back to its checkpoints once
    /// every appliance of it answers: reconciliation).
    pub(super) fn decide_return(&self, name: &str) -> Option<EpochView> {
        if !self.is_replicated() || self.failed.is_some() || self.stalled.is_some() {
            return None;
        }
        let index = u16::try_from(self.part_index(name)?).ok()?;
        self.epoch.with_joined(index)
    }

    /// The appliance its re-replication is copying to, while one is under
    /// way.
    pub(super) fn copying_to(&self) -> Option<&str> {
        let r = self.rereplication.as_ref()?;
        (r.ended_unix_ms.is_none() && r.abandoned.is_none() && self.failed.is_none())
            .then_some(r.appliance.as_str())
    }

    /// A replicated job's strength in its epoch: replicas wanted, and
    /// live (the fewest over its parts' sets, an appliance whose copy is
    /// under way not counted); `None` for a job that is not replicated.
    pub(super) fn strength(&self, rack: impl Fn(&str) -> String) -> Option<ReplicaStrength> {
        if !self.is_replicated() {
            return None;
        }
        let wanted = u32::try_from(self.spec.replicas()).unwrap_or(u32::MAX);
        let copying = self.copying_to().and_then(|n| self.part_index(n));
        let live = self.replica_layout(rack).ok().map_or(0, |l| {
            (0..l.appliances())
                .map(|p| {
                    l.set_in(p, &self.epoch)
                        .into_iter()
                        .filter(|&a| Some(a) != copying)
                        .count()
                })
                .min()
                .unwrap_or(0)
        });
        let live = u32::try_from(live).unwrap_or(u32::MAX);
        let state = if self.stalled.is_some() {
            Strength::Stalled
        } else if copying.is_some() {
            Strength::Rereplicating
        } else if live >= wanted {
            Strength::FullStrength
        } else {
            Strength::Degraded
        };
        Some(ReplicaStrength {
            wanted,
            live,
            state,
            rereplication: self.rereplication.clone(),
            stalled: self.stalled.clone(),
        })
    }

    /// The appliances of its parts that are not down in its epoch.
    pub(super) fn live_appliances(&self) -> Vec<String> {
        self.parts
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.epoch.is_down(*i))
            .map(|(_, p)| p.appliance.clone())
            .collect()
    }

    /// The names of the appliances down in its epoch.
    pub(super) fn down_appliances(&self) -> Vec<String> {
        self.epoch
            .down
            .iter()
            .filter_map(|&d| self.parts.get(usize::from(d)))
            .map(|p| p.appliance.clone())
            .collect()
    }
}

/// Why a job stalls (PROTOCOL.md §11.7, "Stalled jobs"): `why`, the part
/// lost, and what it waits for.
pub(super) fn stall_reason(why: &str, job: &StoredJob) -> String {
    let all: Vec<usize> = (0..job.parts.len()).collect();
    format!(
        "{why}; the job waits until every appliance of it ({}) answers, then goes back to its checkpoints (rounds \
         since are repeated)",
        job.names_of(&all)
    )
}

impl Inner {
    /// The jobs appliance `name` is fenced from: down in their epoch.
    pub(super) fn fenced_jobs_on(&self, name: &str) -> Vec<u16> {
        self.jobs
            .values()
            .filter(|j| j.is_down_on(name))
            .map(|j| j.id)
            .collect()
    }
}

impl Shared {
    /// `GET /v1/jobs/{id}/epoch`: the job's epoch (epoch 0, nobody down,
    /// for a job that is not replicated); 409 with its reason for a job
    /// that failed (its workers, asking, stop with the reason).
    pub(super) fn epoch(&self, id: u16) -> Result<EpochView, RequestError> {
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        if let Some(why) = &job.failed {
            return Err(failed(id, why));
        }
        Ok(job.epoch.clone())
    }

    /// Appliance `name` was declared down: each replicated job on it
    /// moves to its next epoch, durably, and the epoch is sent to its
    /// live appliances (retried every `retry`), or fails when a part is
    /// lost. Jobs whose change cannot be written are logged and left as
    /// they were.
    pub(super) fn fail_over(self: &Arc<Self>, name: &str, retry: Duration) {
        self.fail_over_jobs(name, None, retry);
    }

    /// [`Shared::fail_over`] for every job on `name`, or job `only`.
    pub(super) fn fail_over_jobs(self: &Arc<Self>, name: &str, only: Option<u16>, retry: Duration) {
        let mut installs: Vec<(u16, EpochView, Vec<String>)> = Vec::new();
        {
            let mut inner = self.lock();
            for id in inner
                .jobs_on(name)
                .into_iter()
                .filter(|&id| only.is_none_or(|o| o == id))
            {
                let Some(job) = inner.jobs.get(&id) else {
                    continue;
                };
                let Some(decision) = job.decide(name, |n| inner.rack_of(n)) else {
                    continue;
                };
                let (view, failed, stalled) = match &decision {
                    Decision::Next(v) => (v.clone(), None, None),
                    Decision::Lost(v, why) => (v.clone(), Some(why.clone()), None),
                    Decision::PartDown(v, why) if job.stalled.is_some() => {
                        (v.clone(), None, Some(why.clone()))
                    }
                    Decision::PartDown(v, why) => match self.can_go_back(&inner, job) {
                        Ok(()) => (v.clone(), None, Some(stall_reason(why, job))),
                        Err(not) => (v.clone(), Some(format!("{why}, and {not}")), None),
                    },
                };
                let recorded = self.commit(&mut inner, Entry::Job(id), |inner| {
                    let job = inner.jobs.get_mut(&id).expect("looked up under the same lock");
                    job.set_epoch(view.clone());
                    job.failed.clone_from(&failed);
                    job.stalled.clone_from(&stalled);
                });
                let job = &inner.jobs[&id];
                let down = job.down_appliances().join(", ");
                match (recorded, failed) {
                    (Err(e), _) => log::error!(
                        "job {id} ({:?}): appliance {name:?} is down, but its epoch {} cannot be recorded ({e}): \
                         it does not fail over",
                        job.spec.name,
                        view.epoch
                    ),
                    (Ok(()), Some(why)) => {
                        log::error!("job {id} ({:?}) failed: {why}", job.spec.name);
                        self.end_rereplication(&mut inner, id, Some(why));
                    }
                    // Stalled: its epoch is recorded (the appliances down
                    // in it are fenced, `job show` names them) but put on
                    // nobody, since a live appliance would refuse it (a
                    // part lost, 410) and the job is going back anyway.
                    (Ok(()), None) if stalled.is_some() => {
                        log::error!(
                            "job {id} ({:?}) stalls at epoch {} (down: {down}): {}",
                            job.spec.name,
                            view.epoch,
                            stalled.as_deref().unwrap_or_default()
                        );
                        let why = format!("appliance {name:?} was declared down and the job stalled");
                        self.end_rereplication(&mut inner, id, Some(why));
                    }
                    (Ok(()), None) => {
                        log::warn!(
                            "job {id} ({:?}) fails over to epoch {} without appliance {name:?} (down: {down})",
                            job.spec.name,
                            view.epoch
                        );
                        installs.push((id, view, job.live_appliances()));
                        if job.copying_to() == Some(name) {
                            let why = format!("appliance {name:?} was declared down again");
                            self.end_rereplication(&mut inner, id, Some(why));
                        }
                    }
                }
            }
        }
        for (id, view, names) in installs {
            self.put_epoch(id, &view, names, retry);
        }
    }

    /// Puts job `id`'s epoch `view` on each appliance of `names`, each in
    /// a thread of its own ([`Shared::install_epoch`]).
    fn put_epoch(self: &Arc<Self>, id: u16, view: &EpochView, names: Vec<String>, retry: Duration) {
        for n in names {
            let (shared, sent) = (self.clone(), view.clone());
            let started = std::thread::Builder::new()
                .name("control-epoch".into())
                .spawn(move || shared.install_epoch(id, &sent, &n, retry));
            if let Err(e) = started {
                log::error!(
                    "job {id}: cannot start a thread to install epoch {}: {e}",
                    view.epoch
                );
            }
        }
    }

    /// Appliance `name`, declared down, answers heartbeats again: each
    /// replicated job that failed over without it moves to its next
    /// epoch with it joined, durably (with the start of its
    /// [`Rereplication`]), and is given back to it in a thread of its own
    /// ([`Shared::rejoin`]). Jobs whose change cannot be written are
    /// logged and stay as they were (without it).
    pub(super) fn rereplicate(self: &Arc<Self>, name: &str, retry: Duration) {
        let mut started: Vec<(u16, EpochView)> = Vec::new();
        {
            let mut inner = self.lock();
            for id in inner.fenced_jobs_on(name) {
                let Some(view) = inner.jobs.get(&id).and_then(|j| j.decide_return(name)) else {
                    continue;
                };
                let record = Rereplication {
                    appliance: name.to_string(),
                    epoch: view.epoch,
                    started_unix_ms: unix_ms(),
                    ended_unix_ms: None,
                    bytes_copied: None,
                    abandoned: None,
                    replaced: None,
                };
                let recorded = self.commit(&mut inner, Entry::Job(id), |inner| {
                    let job = inner.jobs.get_mut(&id).expect("looked up under the same lock");
                    job.set_epoch(view.clone());
                    job.rereplication = Some(record);
                });
                let job = &inner.jobs[&id];
                match recorded {
                    Err(e) => log::error!(
                        "job {id} ({:?}): appliance {name:?} answers again, but its epoch {} with it joined \
                         cannot be recorded ({e}): it stays out of the job",
                        job.spec.name,
                        view.epoch
                    ),
                    Ok(()) => {
                        log::warn!(
                            "job {id} ({:?}) re-replicates: appliance {name:?} answers again and joins it at \
                             epoch {}; installing it there",
                            job.spec.name,
                            view.epoch
                        );
                        inner.rejoining.insert((id, name.to_string()));
                        started.push((id, view));
                    }
                }
            }
        }
        for (id, view) in started {
            self.rejoin_in_thread(id, view, name.to_string(), retry);
        }
    }

    /// [`Shared::rejoin`] in a thread of its own; if it cannot start
    /// (logged), the install is no longer marked under way (`rejoining`),
    /// and reconciliation takes it up.
    pub(super) fn rejoin_in_thread(
        self: &Arc<Self>,
        id: u16,
        view: EpochView,
        name: String,
        retry: Duration,
    ) {
        let (shared, n) = (self.clone(), name.clone());
        let spawned = std::thread::Builder::new()
            .name("control-rejoin".into())
            .spawn(move || shared.rejoin(id, &view, &n, retry));
        if let Err(e) = spawned {
            log::error!("job {id}: cannot start a thread to re-replicate it to appliance {name:?}: {e}");
            self.lock().rejoining.remove(&(id, name));
        }
    }

    /// [`Shared::rereplicate`] in a thread of its own (logged if it
    /// cannot start: the jobs then stay without the appliance).
    pub(super) fn rereplicate_in_thread(self: &Arc<Self>, name: &str, retry: Duration) {
        let shared = self.clone();
        let name = name.to_string();
        let started = std::thread::Builder::new()
            .name("control-rereplicate".into())
            .spawn(move || shared.rereplicate(&name, retry));
        if let Err(e) = started {
            log::error!("cannot start the re-replication thread: {e}; the jobs stay without the appliance");
        }
    }

    /// Gives job `id`, moved to epoch `view` with appliance `name` joined,
    /// back to `name`: installs it there at `view`, puts `view` on its
    /// other live appliances, and watches the state copies until the job
    /// is at full strength (every `retry`). An install that cannot be
    /// done takes `name` out of the job again.
    fn rejoin(self: &Arc<Self>, id: u16, view: &EpochView, name: &str, retry: Duration) {
        let installed = self.install_returning(id, view, name, retry);
        self.lock().rejoining.remove(&(id, name.to_string()));
        if let Err(why) = installed {
            log::error!(
                "job {id}: appliance {name:?} is not given the job again at epoch {}: {why}",
                view.epoch
            );
            {
                let mut inner = self.lock();
                self.end_rereplication(&mut inner, id, Some(why));
            }
            // Out of it again, unless it already is or the job is gone.
            self.fail_over_jobs(name, Some(id), retry);
            return;
        }
        log::info!(
            "job {id}: installed on appliance {name:?} at epoch {}, joined",
            view.epoch
        );
        let others: Vec<String> = {
            let inner = self.lock();
            inner
                .jobs
                .get(&id)
                .map(|j| j.live_appliances().into_iter().filter(|n| n != name).collect())
                .unwrap_or_default()
        };
        self.put_epoch(id, view, others, retry);
        self.watch_copies(id, view, name, retry);
    }

    /// Installs job `id` on appliance `name`, which came back at epoch
    /// `view`, retrying every `retry` while it does not answer; removes
    /// the job there first (a dataplane behind a healed partition still
    /// holds it at an older epoch; a restarted one has none). An error
    /// says why it stopped: the appliance refused, is down again, or the
    /// job moved on, failed or was evicted.
    fn install_returning(
        &self,
        id: u16,
        view: &EpochView,
        name: &str,
        retry: Duration,
    ) -> Result<(), String> {
        let mut warned = false;
        loop {
            let (client, req) = {
                let inner = self.lock();
                let job = inner.jobs.get(&id).ok_or("the job was evicted")?;
                if let Some(why) = &job.failed {
                    return Err(format!("the job failed ({why})"));
                }
                if job.epoch != *view {
                    return Err(format!("the job moved on to epoch {}", job.epoch.epoch));
                }
                let a = inner.appliances.get(name).ok_or("the appliance was removed")?;
                if a.liveness.down.is_some() {
                    return Err("it is declared down again".into());
                }
                let req = job
                    .install_for(name, |n| inner.data_of(n), |n| inner.rack_of(n))
                    .ok_or("an appliance of the job has no known data address")?;
                (a.client.clone(), req)
            };
            match client.remove(id).and_then(|_| client.install(&req)) {
                Ok(()) => return Ok(()),
                Err(DataplaneError::Refused { status, message, .. }) if status != 409 => {
                    return Err(format!("it refuses the install (HTTP {status}): {message}"));
                }
                Err(e) => {
                    if !warned {
                        log::warn!("job {id}: not installed on appliance {name:?} yet: {e}; retrying");
                        warned = true;
                    }
                    std::thread::sleep(retry);
                }
            }
        }
    }

    /// Polls the stats of job `id`'s live appliances every `retry` until
    /// each has epoch `view` (or later) and no state copy awaited or owed:
    /// the job is at full strength, recorded with the bytes `name` took.
    /// Stops when `name` is out of the job again, or the job failed or
    /// was evicted, or another re-replication took over.
    fn watch_copies(&self, id: u16, view: &EpochView, name: &str, retry: Duration) {
        loop {
            std::thread::sleep(retry);
            let clients = {
                let mut inner = self.lock();
                let ours = inner.jobs.get(&id).and_then(|j| {
                    let r = j.rereplication.as_ref()?;
                    (r.epoch == view.epoch && r.appliance == name && j.copying_to().is_some()).then_some(j)
                });
                let Some(job) = ours else {
                    return;
                };
                if job.is_down_on(name) {
                    let why = format!("appliance {name:?} is down again in epoch {}", job.epoch.epoch);
                    self.end_rereplication(&mut inner, id, Some(why));
                    return;
                }
                let live = job.live_appliances();
                live.into_iter()
                    .filter_map(|n| Some((inner.appliances.get(&n)?.client.clone(), n)))
                    .collect::<Vec<_>>()
            };
            let mut done = !clients.is_empty();
            let mut bytes = None;
            for (client, n) in clients {
                let copies = client
                    .stats()
                    .ok()
                    .and_then(|s| s.jobs.into_iter().find(|j| j.id == id))
                    .and_then(|j| j.copies);
                match copies {
                    Some(c) if c.epoch >= view.epoch && c.awaiting == 0 && c.owed == 0 => {
                        if n == name {
                            bytes = Some(c.bytes_received);
                        }
                    }
                    _ => done = false,
                }
                if !done {
                    break;
                }
            }
            if done {
                let mut inner = self.lock();
                let at = unix_ms();
                let recorded = self.commit(&mut inner, Entry::Job(id), |inner| {
                    if let Some(r) = inner.jobs.get_mut(&id).and_then(|j| j.rereplication.as_mut()) {
                        r.ended_unix_ms = Some(at);
                        r.bytes_copied = bytes;
                    }
                });
                let r = inner.jobs.get(&id).and_then(|j| j.rereplication.clone());
                match (recorded, r) {
                    (Err(e), _) => {
                        log::error!(
                            "job {id}: back to full strength, but that cannot be recorded ({e}); retrying"
                        );
                        continue;
                    }
                    (Ok(()), Some(r)) => log::info!(
                        "job {id} is back to full strength: appliance {name:?} holds every state copy of \
                         epoch {} ({} ms after it answered again, {} bytes copied)",
                        view.epoch,
                        r.full_strength_ms().unwrap_or(0),
                        r.bytes_copied.unwrap_or(0)
                    ),
                    (Ok(()), None) => {}
                }
                return;
            }
        }
    }

    /// Watches, each in a thread of its own, the re-replications a
    /// previous run of control left under way (recorded with their jobs):
    /// reconciliation installs a job an appliance that came back lacks.
    pub(super) fn resume_rereplications(self: &Arc<Self>, retry: Duration) {
        let under_way: Vec<(u16, EpochView, String)> = {
            let inner = self.lock();
            inner
                .jobs
                .values()
                .filter_map(|j| {
                    let name = j.copying_to()?.to_string();
                    let view = EpochView {
                        epoch: j.rereplication.as_ref()?.epoch,
                        ..EpochView::default()
                    };
                    Some((j.id, view, name))
                })
                .collect()
        };
        for (id, view, name) in under_way {
            log::info!(
                "job {id}: its re-replication to appliance {name:?} is under way; watching its copies"
            );
            let shared = self.clone();
            let spawned = std::thread::Builder::new()
                .name("control-rejoin".into())
                .spawn(move || shared.watch_copies(id, &view, &name, retry));
            if let Err(e) = spawned {
                log::error!("job {id}: cannot start a thread to watch its re-replication: {e}");
            }
        }
    }

    /// Records that job `id`'s re-replication under way, if any, stopped
    /// short for `why` (logged if it cannot be written).
    fn end_rereplication(&self, inner: &mut Inner, id: u16, why: Option<String>) {
        if inner.jobs.get(&id).and_then(StoredJob::copying_to).is_none() {
            return;
        }
        let recorded = self.commit(inner, Entry::Job(id), |inner| {
            if let Some(r) = inner.jobs.get_mut(&id).and_then(|j| j.rereplication.as_mut()) {
                r.abandoned = why.or_else(|| Some("stopped".into()));
            }
        });
        if let Err(e) = recorded {
            log::error!("job {id}: the end of its re-replication cannot be recorded ({e})");
        }
    }

    /// A part of replicated job `id` is lost (`why`): the job stalls when
    /// it can go back to its checkpoints ([`Shared::can_go_back`]; its
    /// epoch stays, reconciliation takes it back once every appliance of
    /// it answers), and fails otherwise, naming why it cannot.
    fn part_lost(&self, id: u16, why: &str) {
        let mut inner = self.lock();
        let Some(job) = inner
            .jobs
            .get(&id)
            .filter(|j| j.failed.is_none() && j.stalled.is_none())
        else {
            return;
        };
        let stalled = match self.can_go_back(&inner, job) {
            Ok(()) => stall_reason(why, job),
            Err(not) => {
                drop(inner);
                self.fail(id, &format!("{why}, and {not}"));
                return;
            }
        };
        let recorded = self.commit(&mut inner, Entry::Job(id), |inner| {
            if let Some(j) = inner.jobs.get_mut(&id) {
                j.stalled = Some(stalled.clone());
            }
        });
        match recorded {
            Ok(()) => {
                log::error!("job {id} stalls: {stalled}");
                let abandoned = "a part was lost and the job stalled".to_string();
                self.end_rereplication(&mut inner, id, Some(abandoned));
            }
            Err(e) => {
                drop(inner);
                self.fail(id, &format!("{why}, and its stall cannot be recorded ({e})"));
            }
        }
    }

    /// Installs job `id`'s epoch `view` on appliance `name`, retrying
    /// every `retry` while the appliance does not answer, until it
    /// answers, is declared down itself, or the job leaves `view` (a
    /// newer epoch's installs carry on, eviction or failure ends it).
    fn install_epoch(&self, id: u16, view: &EpochView, name: &str, retry: Duration) {
        let mut warned = false;
        loop {
            let client = {
                let inner = self.lock();
                let current = inner
                    .jobs
                    .get(&id)
                    .filter(|j| j.failed.is_none() && j.stalled.is_none() && j.epoch == *view);
                let Some(a) = inner.appliances.get(name).filter(|_| current.is_some()) else {
                    return;
                };
                if a.liveness.down.is_some() {
                    log::warn!(
                        "job {id}: epoch {} not installed on appliance {name:?}, which is declared down",
                        view.epoch
                    );
                    return;
                }
                a.client.clone()
            };
            match client.epoch(id, view) {
                Ok(()) => {
                    log::info!("job {id}: epoch {} installed on appliance {name:?}", view.epoch);
                    return;
                }
                // Gone: the appliance would serve a part whose state copy
                // it has not all received, and no other member holds it
                // (killed during a re-replication, PROTOCOL.md §11.7).
                Err(DataplaneError::Refused {
                    status: 410, message, ..
                }) => {
                    let why = format!(
                        "appliance {name:?} cannot serve epoch {} (HTTP 410): {message}",
                        view.epoch
                    );
                    self.part_lost(id, &why);
                    return;
                }
                Err(e @ DataplaneError::Refused { .. }) => {
                    // An answer: retrying would get the same (a dataplane
                    // that does not apply epochs, a job it lost, which
                    // reconciliation reinstalls, or a newer epoch there).
                    log::warn!("job {id}: epoch {} not installed: {e}", view.epoch);
                    return;
                }
                Err(e) => {
                    if !warned {
                        log::warn!("job {id}: epoch {} not installed yet: {e}; retrying", view.epoch);
                        warned = true;
                    }
                    std::thread::sleep(retry);
                }
            }
        }
    }
}

/// Now, in ms since the Unix epoch.
pub(super) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    use phub_proto::layout::layout;
    use phub_proto::spec::{Appliances, Consistency, JobSpec};

    /// A sum job of 24 chunks over three one-lcore appliances a, b, c in
    /// one rack, with `replicas`.
    fn job(replicas: u32) -> StoredJob {
        let spec = JobSpec::new("r", 2, &[384])
            .with_chunk_bytes(64)
            .sharded_over(Appliances::Count(3))
            .with_replicas(replicas);
        crate::state::test_job(5, 1, spec, &["a", "b", "c"])
    }

    /// Gives `j` a table key `emb` (PROTOCOL.md §11.9).
    fn add_table(j: &mut StoredJob) {
        j.spec.keys.push(phub_proto::spec::KeySpec::table(
            "emb",
            phub_proto::spec::TableSpec {
                dim: 4,
                rows: Some(100),
                seed: 0,
                init: phub_proto::spec::RowInitSpec::Zeros,
                optimizer: phub_proto::spec::RowOptimizerSpec::Sum,
                evict: None,
                admit_after: None,
                key_cache: 0,
            },
        ));
    }

    fn one_rack(_: &str) -> String {
        String::new()
    }

    #[test]
    fn an_appliance_down_moves_a_replicated_job_to_the_next_epoch_once() {
        let mut j = job(2);
        assert_eq!(j.layout.lcores.len(), 3, "{:?}", j.layout);
        let next = EpochView {
            epoch: 1,
            down: vec![1],
            ..Default::default()
        };
        assert_eq!(j.decide("b", one_rack), Some(Decision::Next(next.clone())));
        j.epoch = next;
        assert_eq!(j.decide("b", one_rack), None, "already down in its epoch");
        assert_eq!(j.decide("z", one_rack), None, "not on that appliance");
        assert!(j.is_down_on("b") && !j.is_down_on("a"));
        assert_eq!(j.live_appliances(), ["a", "c"]);
        assert_eq!(j.down_appliances(), ["b"]);
    }

    #[test]
    fn both_replicas_of_a_part_down_take_the_part_down_naming_it_and_its_appliances() {
        let mut j = job(2);
        let Some(Decision::Next(e1)) = j.decide("a", one_rack) else {
            panic!("one down of three, replicas 2: the job goes on");
        };
        j.epoch = e1;
        // Part 0's set is a and its backup; whichever of b and c that is,
        // one of them takes the part down with it.
        let layout = j.replica_layout(one_rack).unwrap();
        let backup = layout.set(0)[1];
        let name = ["a", "b", "c"][backup];
        let e2 = match j.decide(name, one_rack) {
            Some(Decision::PartDown(e2, why)) => {
                assert_eq!(e2.epoch, 2);
                assert!(
                    why.contains("part 0") && why.contains("\"a\"") && why.contains(&format!("{name:?}")),
                    "{why}"
                );
                e2
            }
            other => panic!("{other:?}"),
        };
        // Stalled, it takes the third's death into its epoch, still down,
        // with the stall's reason; and gives nobody the job back.
        j.epoch = e2;
        j.stalled = Some("stalled: part 0".into());
        let third = ["a", "b", "c"]
            .into_iter()
            .find(|n| *n != "a" && *n != name)
            .unwrap();
        match j.decide(third, one_rack) {
            Some(Decision::PartDown(e3, why)) => assert_eq!((e3.epoch, why.as_str()), (3, "stalled: part 0")),
            other => panic!("{other:?}"),
        }
        assert_eq!(j.decide_return("a"), None);
        assert_eq!(
            j.strength(one_rack).map(|s| (s.state, s.stalled)),
            Some((Strength::Stalled, Some("stalled: part 0".into())))
        );
    }

    /// A replicated job with a table fails over and takes its appliance
    /// back (its tables come by state copies, PROTOCOL.md §11.9).
    /// An async job with replicas fails over and takes its appliance back
    /// (its chunks' state copies carry the ranks' clocks, PROTOCOL.md
    /// §11.10), as a BSP one does.
    #[test]
    fn an_async_job_fails_over_and_takes_its_appliance_back() {
        let mut j = job(2);
        j.spec.consistency = Consistency::Async;
        let Some(Decision::Next(e1)) = j.decide("b", one_rack) else {
            panic!("one down of three, replicas 2: the job goes on");
        };
        j.epoch = e1;
        let back = j
            .decide_return("b")
            .expect("b answers again: the job takes it back");
        assert_eq!(back.joined_at(1), Some(back.epoch));
    }

    #[test]
    fn a_job_with_a_table_fails_over_and_takes_its_appliance_back() {
        let mut j = job(2);
        add_table(&mut j);
        let Some(Decision::Next(e1)) = j.decide("b", one_rack) else {
            panic!("one down of three, replicas 2: the job goes on");
        };
        j.epoch = e1;
        let back = j
            .decide_return("b")
            .expect("b answers again: the job takes it back");
        assert_eq!(back.joined_at(1), Some(back.epoch));
    }

    /// A part without chunks holds a job's table entries (PROTOCOL.md
    /// §11.9): with a table, losing every member of its set loses rows,
    /// and the job goes down as for any lost part; without, nothing is
    /// lost. (Found by the simulator: ranks waited for ever on the entry.)
    #[test]
    fn a_part_without_chunks_is_lost_with_its_table_entries() {
        let mut j = job(2);
        j.spec.keys = vec![phub_proto::spec::KeySpec::dense("", 16)];
        j.layout = layout(&j.spec, &mut [0, 0, 0], u64::from);
        let empty = (0..3)
            .find(|&p| j.replica_layout(one_rack).unwrap().part(p).count == 0)
            .expect("16 elements of 64-byte chunks leave a part empty");
        // Down: the empty part's home and its one backup (one rack,
        // replicas 2: p + 1).
        let names = ["a", "b", "c"];
        let Some(Decision::Next(e1)) = j.decide(names[empty], one_rack) else {
            panic!("one down of three: the job goes on");
        };
        j.epoch = e1;
        let backup = names[(empty + 1) % 3];
        assert!(
            matches!(j.decide(backup, one_rack), Some(Decision::Next(_))),
            "without a table the empty part loses nothing"
        );
        add_table(&mut j);
        assert!(
            matches!(j.decide(backup, one_rack), Some(Decision::PartDown(..))),
            "with a table its entries are lost"
        );
    }

    #[test]
    fn an_appliance_back_joins_at_the_next_epoch_and_the_strength_follows() {
        let strength = |j: &StoredJob| j.strength(one_rack).map(|s| (s.live, s.wanted, s.state));
        let mut j = job(2);
        assert_eq!(j.decide_return("b"), None, "not down");
        assert_eq!(strength(&j), Some((2, 2, Strength::FullStrength)));
        let Some(Decision::Next(e1)) = j.decide("b", one_rack) else {
            panic!("one down of three, replicas 2: the job goes on");
        };
        j.epoch = e1;
        assert_eq!(strength(&j), Some((1, 2, Strength::Degraded)));
        let e2 = j.decide_return("b").expect("b is down: it comes back");
        assert_eq!(
            e2,
            EpochView {
                epoch: 2,
                down: vec![],
                joined: vec![phub_proto::failover::Joined {
                    appliance: 1,
                    epoch: 2
                }],
                moved: vec![],
                restored: 0,
            }
        );
        j.epoch = e2;
        assert!(j.is_returning(1) && !j.is_returning(0) && !j.is_down_on("b"));
        assert_eq!(j.decide_return("b"), None, "back already");
        j.rereplication = Some(Rereplication {
            appliance: "b".into(),
            epoch: 2,
            started_unix_ms: 1000,
            ended_unix_ms: None,
            bytes_copied: None,
            abandoned: None,
            replaced: None,
        });
        assert_eq!(j.copying_to(), Some("b"));
        assert_eq!(strength(&j), Some((1, 2, Strength::Rereplicating)));
        j.rereplication.as_mut().unwrap().ended_unix_ms = Some(1250);
        assert_eq!(strength(&j), Some((2, 2, Strength::FullStrength)));
        assert_eq!(j.rereplication.as_ref().unwrap().full_strength_ms(), Some(250));
        // A job without replicas has no epochs and is not touched.
        assert_eq!(job(1).decide_return("b"), None);
        assert_eq!(job(1).strength(one_rack), None);
    }

    #[test]
    fn jobs_that_are_not_replicated_or_failed_do_not_fail_over() {
        assert_eq!(job(1).decide("a", one_rack), None);
        let mut j = job(2);
        j.failed = Some("gone".into());
        assert_eq!(j.decide("a", one_rack), None);
    }
}
