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
//! is then down ([`ReplicaLayout::lost_part`]), the job fails instead,
//! naming the part and its appliances. A job that is not replicated is
//! left as it is: it waits for the appliance, as before failover existed.
//!
//! An appliance down in a job's epoch is **fenced** from that job for
//! good (re-replication is not built): reconciliation never installs the
//! job on it again and removes it from it if it still holds it
//! (`reconcile.rs`), so it serves none of the job's workers.

use std::sync::Arc;
use std::time::Duration;

use phub_proto::failover::{EpochView, ReplicaLayout};

use super::http::{not_admitted, RequestError};
use super::registry::{Entry, Inner, Shared};
use crate::dataplane::DataplaneError;
use crate::state::StoredJob;

/// What declaring an appliance down does to one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Decision {
    /// The job goes on in this epoch.
    Next(EpochView),
    /// A part is lost: the job fails for this reason (in this epoch).
    Lost(EpochView, String),
}

impl StoredJob {
    /// Whether it is replicated (flat, `replicas` ≥ 2): the jobs that
    /// have epochs beyond 0 and fail over.
    pub(super) fn is_replicated(&self) -> bool {
        self.shape.is_flat() && self.spec.replicas() > 1
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
        let Some(p) = layout.lost_part(&next) else {
            return Some(Decision::Next(next));
        };
        let names = |set: &[usize]| -> String {
            let n: Vec<String> = set
                .iter()
                .map(|&a| format!("{:?}", self.parts.get(a).map_or("?", |p| p.appliance.as_str())))
                .collect();
            n.join(", ")
        };
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
        Some(Decision::Lost(next, why))
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
    /// for a job that is not replicated).
    pub(super) fn epoch(&self, id: u16) -> Result<EpochView, RequestError> {
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        Ok(job.epoch.clone())
    }

    /// Appliance `name` was declared down: each replicated job on it
    /// moves to its next epoch, durably, and the epoch is sent to its
    /// live appliances (retried every `retry`), or fails when a part is
    /// lost. Jobs whose change cannot be written are logged and left as
    /// they were.
    pub(super) fn fail_over(self: &Arc<Self>, name: &str, retry: Duration) {
        let mut installs: Vec<(u16, EpochView, Vec<String>)> = Vec::new();
        {
            let mut inner = self.lock();
            for id in inner.jobs_on(name) {
                let Some(job) = inner.jobs.get(&id) else {
                    continue;
                };
                let Some(decision) = job.decide(name, |n| inner.rack_of(n)) else {
                    continue;
                };
                let (view, failed) = match &decision {
                    Decision::Next(v) => (v.clone(), None),
                    Decision::Lost(v, why) => (v.clone(), Some(why.clone())),
                };
                let recorded = self.commit(&mut inner, Entry::Job(id), |inner| {
                    let job = inner.jobs.get_mut(&id).expect("looked up under the same lock");
                    job.epoch = view.clone();
                    job.failed.clone_from(&failed);
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
                    (Ok(()), Some(why)) => log::error!("job {id} ({:?}) failed: {why}", job.spec.name),
                    (Ok(()), None) => {
                        log::warn!(
                            "job {id} ({:?}) fails over to epoch {} without appliance {name:?} (down: {down})",
                            job.spec.name,
                            view.epoch
                        );
                        installs.push((id, view, job.live_appliances()));
                    }
                }
            }
        }
        for (id, view, names) in installs {
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
                    .filter(|j| j.failed.is_none() && j.epoch == *view);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{JobShape, StoredPart};
    use phub_proto::layout::layout;
    use phub_proto::spec::{Appliances, JobSpec};
    use std::collections::BTreeSet;

    /// A sum job of 24 chunks over three one-lcore appliances a, b, c in
    /// one rack, with `replicas`.
    fn job(replicas: u32) -> StoredJob {
        let spec = JobSpec::new("r", 2, &[384])
            .with_chunk_bytes(64)
            .sharded_over(Appliances::Count(3))
            .with_replicas(replicas);
        StoredJob {
            id: 5,
            token: 1,
            layout: layout(&spec, &mut [0, 0, 0], u64::from),
            spec,
            joined: BTreeSet::new(),
            parts: ["a", "b", "c"]
                .into_iter()
                .map(|n| StoredPart {
                    appliance: n.into(),
                    lcores: 1,
                })
                .collect(),
            failed: None,
            shape: JobShape::Flat,
            epoch: EpochView::default(),
        }
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
    fn both_replicas_of_a_part_down_fail_the_job_naming_the_part_and_its_appliances() {
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
        match j.decide(name, one_rack) {
            Some(Decision::Lost(e2, why)) => {
                assert_eq!(e2.epoch, 2);
                assert!(
                    why.contains("part 0") && why.contains("\"a\"") && why.contains(&format!("{name:?}")),
                    "{why}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn jobs_that_are_not_replicated_or_failed_do_not_fail_over() {
        assert_eq!(job(1).decide("a", one_rack), None);
        let mut j = job(2);
        j.failed = Some("gone".into());
        assert_eq!(j.decide("a", one_rack), None);
    }
}
