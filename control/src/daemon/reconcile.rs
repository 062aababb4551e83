//! Reconciliation: every interval, each appliance's jobs are compared
//! with those admitted on it; a part it lost is fitted to its lcores now
//! ([`crate::refit`]) and installed again, from its checkpoint when it
//! has one; a job it holds that control did not admit there is removed,
//! and so is a replicated job it is down in (out of that job's replica
//! sets until it re-replicates: `failover`); a replicated job past epoch
//! 0 is sent its epoch until the appliance has answered it. An appliance
//! that came back at a job's epoch is installed at that epoch, empty,
//! never from a checkpoint (PROTOCOL.md §11.7), and not while the
//! re-replication installs it itself.
//!
//! An appliance that lost a replicated job it serves in the job's epoch
//! (it restarted within the heartbeat deadline, so it was never declared
//! down) is not given the job again at that epoch: it would serve its
//! parts empty, or from a checkpoint older than its backups' state. The
//! job fails over without it and re-replicates to it, as if it had been
//! declared down and had come back ([`Shared::fail_over`],
//! [`Shared::rereplicate`]), when every part keeps a member that holds
//! the job. When some part keeps none (every replica of it lost its
//! state: both appliances of a two-appliance job restarted, say), the
//! whole job goes back to its checkpoints ([`Shared::settle_lost_parts`]):
//! it is removed from the appliances that still hold it, and every part
//! is restored from its checkpoint, so that no part stands at a round the
//! others went back from (a live backup ahead of its restored primary
//! would refuse every next aggregate `stale`, a restored backup of a
//! live primary every one `ahead`: the job would hang). That needs every
//! appliance of the job to answer, those down in its epoch too (the pass
//! waits for a live one that does not; one down that does not, or is
//! still declared down, **stalls** the job: no re-replication, PROTOCOL.md
//! §11.7 "Stalled jobs"), a checkpoint of every part, and no part moved
//! (each appliance restores its own part, never one it adopted);
//! otherwise the job fails, naming the part that was lost. The job goes
//! back at a new epoch naming nobody, so that what its appliances' former
//! selves sent before they died, still on its way, is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use phub_proto::api::{DataplaneInfo, InstallJob};
use phub_proto::failover::EpochView;
use phub_proto::layout::Layout;
use phub_proto::spec::JobSpec;

use super::checkpoints::{checkpoint_path, rounds_text, Held, RestoreBody};
use super::failover;
use super::registry::{Entry, Inner, Shared};
use crate::dataplane::{Client, DataplaneError};
use crate::refit::{self, Refit};
use crate::state::StoredJob;
use crate::watch;

/// What the reconcile thread remembers to log each problem once (one per
/// appliance).
#[derive(Debug, Default)]
pub(super) struct ReconcileLog {
    /// Jobs the appliance holds that control admitted on other appliances.
    pub(super) foreign: BTreeSet<u16>,
    /// Appliances that did not answer last time.
    pub(super) down: BTreeSet<String>,
    /// Job parts whose reinstall failed, by job and appliance.
    pub(super) failed: BTreeSet<(u16, String)>,
    /// Replicated jobs whose epoch the appliance answered (installed, or
    /// refused for good): by job, that epoch.
    pub(super) epochs: BTreeMap<u16, u32>,
    /// Replicated jobs that lost a part and wait, this pass, for every
    /// appliance of theirs to answer: not installed here meanwhile.
    pub(super) waiting: BTreeSet<u16>,
}
/// How an appliance's jobs differ from those admitted on it.
struct Differences {
    /// Jobs it holds that control did not admit anywhere: removed.
    unknown: Vec<u16>,
    /// Jobs admitted on it, in service and not held, that it lacks:
    /// installed again.
    missing: Vec<u16>,
    /// Replicated jobs it serves in their epoch and lacks (it lost their
    /// state without being declared down), each of whose parts keeps a
    /// member that holds the job: failed over without it, then
    /// re-replicated to it.
    lost: Vec<u16>,
    /// Replicated jobs it holds that it was declared down from: removed.
    fenced: Vec<u16>,
}

/// What a pass does to a replicated job some part of which kept no
/// replica that holds it ([`Shared::settle_lost_parts`]).
#[derive(Debug, PartialEq, Eq)]
enum Loss {
    /// An appliance of the job did not answer: nothing of it is installed
    /// this pass (the one that did not answer may hold it still).
    Wait,
    /// It goes back to its checkpoints: its parts are removed from these
    /// appliances, which still hold them, and every part is restored.
    BackToCheckpoints {
        /// The appliances that still hold it.
        holders: Vec<String>,
        /// The lost parts, for the log.
        why: String,
    },
    /// Past a failover, an appliance of the job down in its epoch did not
    /// answer the pass or is still declared down: it stalls for this
    /// reason (recorded; no re-replication starts) and waits.
    Stall(String),
    /// It cannot go back exactly: it fails for this reason.
    Fail(String),
}

impl Shared {
    /// Reconciles every appliance ([`Shared::reconcile_one`]), all at
    /// once, so that one that does not answer delays none of the others;
    /// first asks each who it is, and leaves alone every appliance that is
    /// another's dataplane under a second name ([`watch::alias_of`]).
    pub(super) fn reconcile(self: &Arc<Self>, logs: &mut BTreeMap<String, ReconcileLog>) {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let clients = self.lock().clients();
        logs.retain(|n, _| clients.iter().any(|(c, _)| c == n));
        type Asked = (String, Option<DataplaneInfo>, Option<BTreeSet<u16>>);
        let asked: Vec<Asked> = std::thread::scope(|s| {
            let asked: Vec<_> = clients
                .iter()
                .map(|(n, c)| {
                    let ask = move || {
                        let jobs = c.jobs().ok().map(|j| j.into_iter().map(|j| j.id).collect());
                        (c.info().ok(), jobs)
                    };
                    (n.clone(), s.spawn(ask))
                })
                .collect();
            asked
                .into_iter()
                .map(|(n, h)| {
                    let (info, jobs) = h.join().unwrap_or_default();
                    (n, info, jobs)
                })
                .collect()
        });
        // Who holds which jobs, as of now: whether a replicated job one
        // appliance lost still has its state elsewhere.
        let mut held: BTreeMap<String, BTreeSet<u16>> = asked
            .iter()
            .filter_map(|(n, _, j)| Some((n.clone(), j.clone()?)))
            .collect();
        let waiting = self.settle_lost_parts(&mut held);
        let infos: Vec<(String, Option<DataplaneInfo>)> = asked.into_iter().map(|(n, i, _)| (n, i)).collect();
        let aliases: BTreeSet<String> = {
            let mut inner = self.lock();
            let seen: Vec<(String, bool, DataplaneInfo)> = infos
                .iter()
                .filter_map(|(n, i)| Some((n.clone(), !inner.jobs_on(n).is_empty(), i.clone()?)))
                .collect();
            let found = watch::alias_of(&seen);
            for (n, i) in infos {
                let Some(a) = inner.appliances.get_mut(&n) else {
                    continue;
                };
                let alias = found.iter().find(|(x, ..)| *x == n).map(|(_, other, why)| {
                    format!(
                        "the dataplane of appliance {other:?} under a second name ({why}): neither \
                         reconciled nor given jobs; remove one of the two (phubctl appliance remove)"
                    )
                });
                match (&a.alias, &alias) {
                    (None, Some(why)) => log::error!("appliance {n:?} at {} is {why}", a.spec.url),
                    (Some(_), None) => log::info!("appliance {n:?} is no longer another's dataplane"),
                    _ => {}
                }
                a.alias = alias;
                if i.is_some() {
                    a.info = i;
                }
            }
            found.into_iter().map(|(n, ..)| n).collect()
        };
        for (n, _) in &clients {
            logs.entry(n.clone()).or_default();
        }
        let lost: Vec<(String, Vec<u16>)> = std::thread::scope(|s| {
            let mut asked = Vec::new();
            for (name, log) in logs.iter_mut().filter(|(n, _)| !aliases.contains(*n)) {
                let Some((_, client)) = clients.iter().find(|(c, _)| c == name) else {
                    continue;
                };
                log.waiting.clone_from(&waiting);
                let held = &held;
                asked.push((
                    name.clone(),
                    s.spawn(move || self.reconcile_one(name, client, held, log)),
                ));
            }
            asked
                .into_iter()
                .map(|(n, h)| (n, h.join().unwrap_or_default()))
                .collect()
        });
        for (name, ids) in lost.into_iter().filter(|(_, ids)| !ids.is_empty()) {
            self.restarted(&name, &ids);
        }
    }

    /// Reinstalls on appliance `name` every part of an admitted job it
    /// lacks, fitted to the lcores it has now ([`Shared::refit`]), from the
    /// part's checkpoint when it has one; a job that cannot be placed on
    /// them, or whose install the appliance refuses as invalid (HTTP 400),
    /// is marked failed instead of being retried for ever. A part whose
    /// checkpoint file is there but unusable ([`Shared::checkpoint_for`],
    /// or refused by the appliance) is held instead, and a held part is
    /// not installed, until `POST /v1/jobs/{id}/retry`. Jobs it holds that
    /// control has not admitted there are removed. Returns the replicated
    /// jobs it lost while serving them, not installed here: the caller
    /// fails them over and re-replicates them to it ([`Shared::restarted`];
    /// `held`: the jobs each appliance held when the pass asked, this
    /// one's included, which is asked again only when missing; with none
    /// known, every lost job is reinstalled).
    pub(super) fn reconcile_one(
        &self,
        name: &str,
        client: &Client,
        held: &BTreeMap<String, BTreeSet<u16>>,
        log: &mut ReconcileLog,
    ) -> Vec<u16> {
        // The jobs it held when the pass asked (not asked twice), else ask.
        let asked = match held.get(name) {
            Some(ids) => Ok(ids.clone()),
            None => client.jobs().map(|j| j.into_iter().map(|j| j.id).collect()),
        };
        let installed: BTreeSet<u16> = match asked {
            Ok(ids) => {
                if log.down.remove(name) {
                    log::info!("appliance {name:?} at {} answers again", client.base());
                }
                ids
            }
            Err(e) => {
                if log.down.insert(name.to_string()) {
                    log::warn!("{e}; retrying every {:?}", self.interval);
                }
                return Vec::new();
            }
        };
        let Differences {
            unknown,
            missing,
            lost,
            fenced,
        } = self.differences(name, &installed, held, log);
        let lost = self.still_lost(client, lost);
        for id in fenced {
            match client.remove(id) {
                Ok(_) => log::warn!(
                    "job {id} failed over without appliance {name:?}, which still held it: removed (it is given \
                     the job again when it answers heartbeats again)"
                ),
                Err(e) => log::warn!(
                    "job {id} failed over without appliance {name:?}, which still holds it; removing it: {e}"
                ),
            }
        }
        log.epochs.retain(|id, _| installed.contains(id));
        self.send_epochs(name, client, &installed, log);
        for id in unknown {
            match client.remove(id) {
                Ok(_) => log::warn!(
                    "job {id} was installed on appliance {name:?} but is not admitted there: removed"
                ),
                Err(e) => log::warn!(
                    "job {id} is installed on appliance {name:?} but not admitted there; removing it: {e}"
                ),
            }
        }
        log.failed.retain(|(id, n)| n != name || !installed.contains(id));
        log.foreign.retain(|id| installed.contains(id));
        if missing.is_empty() {
            return lost;
        }
        // The appliance restarted: its settings may have changed, and the
        // jobs are fitted to its lcores before they are installed.
        let info = match client.info() {
            Ok(info) => {
                if let Some(a) = self.lock().appliances.get_mut(name) {
                    a.info = Some(info.clone());
                }
                info
            }
            Err(e) => {
                if log.down.insert(name.to_string()) {
                    log::warn!("{e}; retrying every {:?}", self.interval);
                }
                return lost;
            }
        };
        for &id in &missing {
            self.reinstall(name, client, &info, id, log);
        }
        // Reinstalled at epoch 0: a replicated job's epoch follows.
        self.send_epochs(name, client, &missing.into_iter().collect(), log);
        lost
    }

    /// Of the replicated jobs `lost`, which appliance `client` said it
    /// lacked when the pass asked, those it still lacks now. The answer may
    /// be stale by the time it is read (a loaded host): a job given back
    /// to the appliance since (no longer fenced there, its install no
    /// longer under way when [`Shared::differences`] looked) is installed,
    /// and asking again after that look sees it. Taking it for lost would
    /// fail the job over and re-replicate it once more. None while the
    /// appliance does not answer (the next pass asks again).
    fn still_lost(&self, client: &Client, lost: Vec<u16>) -> Vec<u16> {
        if lost.is_empty() {
            return lost;
        }
        match client.jobs() {
            Ok(now) => lost
                .into_iter()
                .filter(|id| !now.iter().any(|j| j.id == *id))
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// What appliance `name`, which holds the jobs `installed`, has that
    /// control did not admit there, and lacks of what it did; logs, once,
    /// each job it holds that control admitted on other appliances (left
    /// alone).
    fn differences(
        &self,
        name: &str,
        installed: &BTreeSet<u16>,
        held: &BTreeMap<String, BTreeSet<u16>>,
        log: &mut ReconcileLog,
    ) -> Differences {
        // Jobs the appliance holds that control has not admitted there
        // (evicted while it was down, or installed by someone else) are
        // removed.
        let inner = self.lock();
        let fenced_here: BTreeSet<u16> = inner.fenced_jobs_on(name).into_iter().collect();
        let here: BTreeSet<u16> = inner
            .jobs_on(name)
            .into_iter()
            .filter(|id| !fenced_here.contains(id))
            .collect();
        // A job admitted on other appliances is left alone: this
        // may be one of them under another name or address, which
        // must not lose the job's state. Unless this one is drained: a
        // drain moved its jobs off it (PROTOCOL.md §11.8).
        let drained = inner.appliances.get(name).is_some_and(|a| a.spec.draining);
        // Or a spare took its place in the job (§11.8).
        let replaced = |id: &u16| {
            inner.jobs.get(id).is_some_and(|j| {
                j.rereplication
                    .as_ref()
                    .is_some_and(|r| r.replaced.as_deref() == Some(name))
            })
        };
        let (foreign, unknown): (Vec<u16>, Vec<u16>) = installed
            .iter()
            .copied()
            .filter(|id| !here.contains(id))
            .filter(|id| !fenced_here.contains(id))
            .partition(|id| inner.jobs.contains_key(id) && !drained && !replaced(id));
        for id in foreign {
            if log.foreign.insert(id) {
                let on: Vec<&str> = inner.jobs[&id]
                    .parts
                    .iter()
                    .map(|p| p.appliance.as_str())
                    .collect();
                log::error!(
                    "appliance {name:?} holds job {id}, which is admitted on {} and not there: left \
                     installed (is {name:?} one of those under another name or address?)",
                    on.join(", ")
                );
            }
        }
        let (lost, missing): (Vec<u16>, Vec<u16>) = here
            .iter()
            .copied()
            .filter(|id| {
                !installed.contains(id)
                    && !log.waiting.contains(id)
                    && inner.jobs[id].failed.is_none()
                    && !inner.rejoining.contains(&(*id, name.to_string()))
                    && !inner.checkpoints.held.contains_key(&(*id, name.to_string()))
            })
            .partition(|id| inner.jobs[id].survives_without(name, held, |n| inner.rack_of(n)));
        let fenced = fenced_here.intersection(installed).copied().collect();
        Differences {
            unknown,
            missing,
            lost,
            fenced,
        }
    }

    /// Replicated jobs some part of which kept no replica that holds it
    /// (module head; `held`: the jobs each appliance that answered holds):
    /// each goes back to its checkpoints, its parts removed from the
    /// appliances that still hold them (and from `held`), so that every
    /// part is restored by the pass; or fails, naming the part. Returns
    /// the jobs that wait for an appliance that did not answer, or whose
    /// removal failed: none of their parts is installed this pass.
    fn settle_lost_parts(&self, held: &mut BTreeMap<String, BTreeSet<u16>>) -> BTreeSet<u16> {
        let losses: Vec<(u16, Loss)> = {
            let inner = self.lock();
            inner
                .jobs
                .values()
                .filter_map(|j| Some((j.id, self.loss(&inner, j, held)?)))
                .collect()
        };
        let mut waiting = BTreeSet::new();
        // Jobs whole again are no longer gone back.
        self.gone_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|id, _| losses.iter().any(|(l, _)| l == id));
        for (id, loss) in losses {
            match loss {
                Loss::Wait => {
                    waiting.insert(id);
                }
                Loss::Stall(why) => {
                    waiting.insert(id);
                    let mut inner = self.lock();
                    let Some(job) = inner.jobs.get(&id) else {
                        continue;
                    };
                    let why = failover::stall_reason(&why, job);
                    let recorded = self.commit(&mut inner, Entry::Job(id), |inner| {
                        if let Some(j) = inner.jobs.get_mut(&id) {
                            j.stalled = Some(why.clone());
                        }
                    });
                    match recorded {
                        Ok(()) => log::error!("job {id} stalls: {why}"),
                        Err(e) => {
                            log::error!("job {id}: {why}; but its stall cannot be recorded ({e}): retrying")
                        }
                    }
                }
                Loss::Fail(why) => self.fail(id, &why),
                Loss::BackToCheckpoints { holders, why } => {
                    // A new epoch naming nobody, recorded first: what the
                    // appliances' and workers' former selves still have
                    // on its way is refused (fencing), and every part is
                    // restored at it. Once per going back: a pass that
                    // finds its parts still being restored makes none.
                    let mut inner = self.lock();
                    let now = inner.jobs.get(&id).map_or(0, |j| j.epoch.epoch);
                    let mut gone = self.gone_back.lock().unwrap_or_else(|p| p.into_inner());
                    // Gone back at this epoch already: those that hold it
                    // now were restored at it (a removal that failed
                    // forgets the going back), and the others are to be.
                    let again = gone.get(&id) == Some(&now);
                    if !again {
                        let bumped = self.commit(&mut inner, Entry::Job(id), |inner| {
                            if let Some(j) = inner.jobs.get_mut(&id) {
                                j.set_epoch(j.epoch.back_to_checkpoints());
                                j.stalled = None;
                            }
                        });
                        if let Err(e) = bumped {
                            log::error!(
                                "job {id}: {why}; but its next epoch cannot be recorded ({e}): retrying"
                            );
                            waiting.insert(id);
                            continue;
                        }
                        gone.insert(id, now + 1);
                    }
                    drop(gone);
                    drop(inner);
                    let holders = if again { Vec::new() } else { holders };
                    if !holders.is_empty() {
                        log::warn!(
                            "job {id}: {why}; the job goes back to its checkpoints on every appliance (rounds \
                             since are repeated): removed from {} to be restored there too",
                            holders.join(", ")
                        );
                    }
                    for h in holders {
                        // The registry's lock is not held across the request.
                        let client = self.lock().client(&h);
                        let removed = match client {
                            Ok(c) => match c.remove(id) {
                                Ok(_) | Err(DataplaneError::Refused { status: 404, .. }) => Ok(()),
                                Err(e) => Err(e.to_string()),
                            },
                            Err(e) => Err(e.to_string()),
                        };
                        match removed {
                            Ok(()) => {
                                if let Some(ids) = held.get_mut(&h) {
                                    ids.remove(&id);
                                }
                            }
                            Err(e) => {
                                log::warn!(
                                    "job {id}: cannot remove it from appliance {h:?} to restore it there from \
                                     its checkpoint ({e}); no part of it is installed until that is done"
                                );
                                self.gone_back
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .remove(&id);
                                waiting.insert(id);
                            }
                        }
                    }
                }
            }
        }
        waiting
    }

    /// What a pass does to replicated job `j` ([`Loss`]), given the jobs
    /// each appliance that answered holds (`held`); `None` when every
    /// part keeps a replica that holds it and it is not stalled (or it is
    /// not replicated, failed, or being given back to an appliance: left
    /// to the rest of the pass).
    fn loss(&self, inner: &Inner, j: &StoredJob, held: &BTreeMap<String, BTreeSet<u16>>) -> Option<Loss> {
        if !j.is_replicated() || j.failed.is_some() {
            return None;
        }
        // Every appliance of it, down ones too: each restores its own part.
        let members: Vec<String> = j.parts.iter().map(|p| p.appliance.clone()).collect();
        let busy = |n: &String| {
            inner.rejoining.contains(&(j.id, n.clone()))
                || inner.checkpoints.held.contains_key(&(j.id, n.clone()))
        };
        if members.iter().any(busy) {
            return None;
        }
        let why = match &j.stalled {
            Some(why) => why.clone(),
            None => {
                let lost = j.parts_unheld(&j.epoch, held, |n| inner.rack_of(n));
                if lost.is_empty() {
                    return None;
                }
                format!(
                    "every replica of part{} {} (home appliance{} {}) lost its state (restarted, down, or not yet \
                     filled by a state copy)",
                    if lost.len() == 1 { "" } else { "s" },
                    lost.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    if lost.len() == 1 { "" } else { "s" },
                    j.names_of(&lost)
                )
            }
        };
        // A live appliance that did not answer may hold it still.
        if j.live_appliances().iter().any(|n| !held.contains_key(n)) {
            return Some(Loss::Wait);
        }
        if let Err(not) = self.can_go_back(inner, j) {
            return Some(Loss::Fail(format!("{why} at epoch {}, and {not}", j.epoch.epoch)));
        }
        // Each answers this pass, and its heartbeats again (one still
        // declared down would fail the job over once more).
        let up = |n: &String| {
            held.contains_key(n) && inner.appliances.get(n).is_some_and(|a| a.liveness.down.is_none())
        };
        if !members.iter().all(up) {
            // One down in its epoch may stay down long: the job stalls
            // until it answers (no re-replication meanwhile). At an epoch
            // naming nobody the heartbeats only lag the pass: it waits.
            return Some(if j.stalled.is_none() && !j.epoch.names_nobody() {
                Loss::Stall(why)
            } else {
                Loss::Wait
            });
        }
        let holders = members
            .into_iter()
            .filter(|n| held.get(n).is_some_and(|ids| ids.contains(&j.id)))
            .collect();
        Some(Loss::BackToCheckpoints { holders, why })
    }

    /// Whether replicated job `j` can go back to its checkpoints exactly,
    /// every appliance of it restoring its own part (PROTOCOL.md §11.7,
    /// "Restored parts"); `Err` says why not, to follow "and": a part moved
    /// to another appliance since admission (its checkpoint is not where
    /// the part is now), or a part without a checkpoint.
    pub(super) fn can_go_back(&self, inner: &Inner, j: &StoredJob) -> Result<(), String> {
        if let Some(m) = j.epoch.moved.first() {
            return Err(format!(
                "its part {} moved to appliance {:?} at epoch {} (its checkpoint is not where the part is now), \
                 so it cannot go back to its checkpoints exactly (PROTOCOL.md §11.7); admit it again",
                m.appliance, m.name, m.epoch
            ));
        }
        let unsaved = j.parts.iter().map(|p| &p.appliance).find(|n| {
            !inner.checkpoints.taken.contains_key(&(j.id, (*n).clone()))
                && !checkpoint_path(&self.state_path, j, n).exists()
        });
        match unsaved {
            Some(n) => Err(format!(
                "its part on appliance {n:?} has no checkpoint to go back to: it cannot go on exactly; admit it again"
            )),
            None => Ok(()),
        }
    }

    /// Appliance `name` lost the replicated jobs `ids` while serving them
    /// (module head): each fails over without it, durably, and then
    /// re-replicates to it, in threads of their own.
    fn restarted(self: &Arc<Self>, name: &str, ids: &[u16]) {
        for &id in ids {
            log::warn!(
                "appliance {name:?} lost replicated job {id} without being declared down (it restarted): the job \
                 fails over without it and re-replicates to it, rather than serve its parts there empty"
            );
            self.fail_over_jobs(name, Some(id), self.beat);
        }
        self.rereplicate_in_thread(name, self.beat);
    }

    /// Sends appliance `name`, which holds the jobs `installed`, the
    /// epoch of each replicated job there past epoch 0, not stalled (whose
    /// epoch is put on nobody), that it has not answered yet
    /// ([`ReconcileLog::epochs`]): one the failover's own sends missed, or
    /// a job it lost and got again at epoch 0.
    fn send_epochs(&self, name: &str, client: &Client, installed: &BTreeSet<u16>, log: &mut ReconcileLog) {
        let due: Vec<(u16, EpochView)> = {
            let inner = self.lock();
            installed
                .iter()
                .filter_map(|id| inner.jobs.get(id))
                .filter(|j| {
                    j.is_replicated() && j.failed.is_none() && j.stalled.is_none() && j.epoch.epoch > 0
                })
                .filter(|j| !j.is_down_on(name) && log.epochs.get(&j.id) != Some(&j.epoch.epoch))
                .map(|j| (j.id, j.epoch.clone()))
                .collect()
        };
        for (id, view) in due {
            match client.epoch(id, &view) {
                Ok(()) => {
                    log::info!("job {id}: epoch {} installed on appliance {name:?}", view.epoch);
                    log.epochs.insert(id, view.epoch);
                }
                // Not there (yet): reinstalled, then sent again.
                Err(DataplaneError::Refused { status: 404, .. }) => {}
                // Any other answer would be the same again.
                Err(e @ DataplaneError::Refused { .. }) => {
                    log::warn!("job {id}: epoch {} not installed: {e}", view.epoch);
                    log.epochs.insert(id, view.epoch);
                }
                Err(e) => log::warn!("job {id}: epoch {} not installed yet: {e}; retrying", view.epoch),
            }
        }
    }

    /// Reinstalls job `id`'s part on appliance `name` (described by `info`
    /// now), which lacks it ([`Shared::reconcile_one`]).
    fn reinstall(&self, name: &str, client: &Client, info: &DataplaneInfo, id: u16, log: &mut ReconcileLog) {
        let Some(job) = self.refit(id, name, info) else {
            return;
        };
        // An appliance that came back to a replicated job is installed
        // empty: its primaries copy it the state (PROTOCOL.md §11.7). One
        // of a job gone back to its checkpoints (at an epoch that names
        // nobody down, returned or moved) is restored.
        let returning = job
            .replication
            .as_ref()
            .is_some_and(|r| r.epoch > 0 && !r.view().names_nobody());
        let restore = match if returning {
            Ok(None)
        } else {
            self.checkpoint_for(&job, name)
        } {
            Ok(r) => r,
            Err(h) => {
                self.hold(id, name, h);
                return;
            }
        };
        let result = match &restore {
            Some(r) => match &r.body {
                RestoreBody::File { bytes } => client.restore_file(id, &r.file, *bytes),
                RestoreBody::Bytes(b) => client.restore(id, b),
            },
            None => client.install(&job),
        };
        match result {
            Ok(()) => {
                match &restore {
                    Some(r) => log::info!(
                        "reinstalled job {id} ({:?}) on appliance {name:?}, which had lost it, from its \
                         checkpoint ({})",
                        job.spec.name,
                        rounds_text(r.round_range)
                    ),
                    None => log::info!(
                        "reinstalled job {id} ({:?}) on appliance {name:?}, which had lost it (no \
                         checkpoint: its parameters there start over)",
                        job.spec.name
                    ),
                }
                log.failed.remove(&(id, name.to_string()));
            }
            // A refusal of the request itself does not change by
            // retrying, unless the appliance restarted again meanwhile:
            // a refused checkpoint holds the part (as any unusable
            // one), a refused install fails the job.
            Err(DataplaneError::Refused {
                status: 400, message, ..
            }) if client
                .info()
                .is_ok_and(|now| now.lcores.len() == info.lcores.len()) =>
            {
                match restore {
                    Some(r) => {
                        let h = Held {
                            file: r.file,
                            why: format!("appliance {name:?} refuses to restore it: {message}"),
                        };
                        self.hold(id, name, h);
                    }
                    None => self.fail(
                        id,
                        &format!("the dataplane refuses to install it (appliance {name:?}): {message}"),
                    ),
                }
            }
            Err(e) => {
                if log.failed.insert((id, name.to_string())) {
                    log::warn!("cannot reinstall job {id} on appliance {name:?}: {e}; retrying");
                }
            }
        }
    }

    /// Fits job `id`'s part on appliance `name` to the appliance `info`
    /// describes before it is installed again ([`refit::refit`]): a new
    /// layout, or the job's failure, is made durable first. Returns what to
    /// install; `None` when the job failed, is gone, or its change could
    /// not be written (then nothing changed and the next reconciliation
    /// tries again).
    pub(super) fn refit(&self, id: u16, name: &str, info: &DataplaneInfo) -> Option<InstallJob> {
        let mut inner = self.lock();
        let job = inner.jobs.get(&id).filter(|j| j.failed.is_none())?;
        let index = job.part_index(name)?;
        let n = info.lcores.len();
        // A hierarchical job's rack layout, and a replicated job's part
        // (which its other appliances' backups follow, PROTOCOL.md §11.2),
        // are not refitted.
        let kept = match job.rack_layout_on(name) {
            Some(rack) => Some((rack.lcores.len(), "its rack layout", "a hierarchical")),
            None if job.spec.replicas() > 1 => job
                .part_on(name)
                .map(|p| (p.lcores.len(), "its part of the layout", "a replicated")),
            None => None,
        };
        if let Some((had, what, kind)) = kept.filter(|k| k.0 != n) {
            let why = format!(
                "appliance {name:?} came back with {n} lcores, not the {had} {what} has; {kind} job is not \
                 refitted (admit it again)"
            );
            let others: Vec<(String, Option<Client>)> = job
                .parts
                .iter()
                .filter(|p| p.appliance != name)
                .map(|p| (p.appliance.clone(), inner.client(&p.appliance).ok()))
                .collect();
            let failed = self.commit(&mut inner, Entry::Job(id), |inner| {
                if let Some(j) = inner.jobs.get_mut(&id) {
                    j.failed = Some(why.clone());
                }
            });
            if let Err(e) = failed {
                log::error!("job {id}: {why}; but that cannot be recorded ({e}): retrying");
                return None;
            }
            log::error!("job {id} failed: {why}");
            drop(inner);
            // Its other parts would hold their memory and send partials
            // (or aggregates) to a part that is gone: removed.
            for (other, client) in others {
                match client.map(|c| c.remove(id)) {
                    Some(Ok(_)) => log::warn!("job {id} failed: its part on appliance {other:?} is removed"),
                    Some(Err(e)) => log::warn!(
                        "job {id} failed; its part on appliance {other:?} could not be removed ({e}): remove it \
                         by evicting the job"
                    ),
                    None => {}
                }
            }
            return None;
        }
        let part = job.part_on(name)?;
        let others: Vec<(&JobSpec, Layout)> = inner
            .jobs
            .values()
            .filter(|j| j.id != id && j.failed.is_none())
            .filter_map(|j| j.part_on(name).map(|p| (&j.spec, p)))
            .collect();
        let decision = refit::refit(&job.spec, &part, info, others.iter().map(|(s, l)| (*s, l)));
        drop(others);
        if let Some(what) = change_text(&decision, name, n) {
            let recorded = self.commit(&mut inner, Entry::Job(id), |inner| {
                if let Some(job) = inner.jobs.get_mut(&id) {
                    apply_refit(job, index, decision, &what);
                }
            });
            if let Err(e) = recorded {
                log::error!("job {id}: {what}; but that cannot be recorded ({e}): retrying");
                return None;
            }
            let job = inner.jobs.get(&id)?;
            if job.failed.is_some() {
                log::error!("job {id} ({:?}) failed: {what}", job.spec.name);
                return None;
            }
            log::warn!("job {id} ({:?}): {what}", job.spec.name);
        }
        // A hierarchical job is reinstalled as it was: its rack and home
        // layouts stay.
        inner
            .jobs
            .get(&id)?
            .install_for(name, |n| inner.data_of(n), |n| inner.rack_of(n))
    }

    /// Marks job `id` failed for `why`, durably; if that cannot be written,
    /// nothing changes (the next reconciliation tries the job again).
    pub(super) fn fail(&self, id: u16, why: &str) {
        let mut inner = self.lock();
        let Some(name) = inner.jobs.get(&id).map(|j| j.spec.name.clone()) else {
            return;
        };
        let failed = self.commit(&mut inner, Entry::Job(id), |inner| {
            if let Some(job) = inner.jobs.get_mut(&id) {
                job.failed = Some(why.to_string());
            }
        });
        match failed {
            Ok(()) => log::error!("job {id} ({name:?}) failed: {why}"),
            Err(e) => log::error!("job {id}: {why}; but its failure cannot be recorded ({e}): retrying"),
        }
    }
}

/// What `decision` changes of a job's part on appliance `name`, which
/// has `n` lcores now; `None` for [`Refit::AsIs`], which changes nothing.
fn change_text(decision: &Refit, name: &str, n: usize) -> Option<String> {
    Some(match decision {
        Refit::AsIs => return None,
        Refit::Resized(_) => {
            format!("its layout on appliance {name:?} is sized for its {n} lcores (its chunks stay where they were)")
        }
        Refit::Replaced(_) => format!(
            "appliance {name:?} has {n} lcores, fewer than its layout used there: its chunks there are placed \
             anew over them; its ranks must join again (with a stale layout they get an ERROR \
             slot_out_of_range or chunk_mismatch, or time out on an lcore that is gone)"
        ),
        Refit::Failed(why) => format!("appliance {name:?}: {why}"),
    })
}

/// Applies `decision` to `job`'s part `index`; `what` is its
/// [`change_text`], which a failed job keeps as its reason.
fn apply_refit(job: &mut StoredJob, index: usize, decision: Refit, what: &str) {
    let replace = |job: &mut StoredJob, new: Layout| {
        // The part's lcores in the job's layout give way to the new ones.
        let at: usize = job.parts[..index].iter().map(|p| p.lcores as usize).sum();
        let len = job.parts[index].lcores as usize;
        job.parts[index].lcores = u32::try_from(new.lcores.len()).unwrap_or(u32::MAX);
        job.layout.lcores.splice(at..at + len, new.lcores);
    };
    match decision {
        Refit::AsIs => {}
        Refit::Resized(layout) => replace(job, layout),
        Refit::Replaced(layout) => {
            replace(job, layout);
            job.joined.clear();
        }
        Refit::Failed(_) => job.failed = Some(what.to_string()),
    }
}
