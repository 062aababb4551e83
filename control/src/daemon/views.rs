//! The read routes: job list and detail, chunk maps, stats and
//! Prometheus metrics. Each asks the appliances it needs at once and
//! waits on none longer than [`READ_WAIT`] ([`Shared::views`]).

use std::collections::BTreeMap;

use phub_proto::api::{
    ApplianceStats, ClockStats, DataplaneStats, JobDetail, JobLive, JobMap, JobPart, JobSummary, KeyMap,
    KeyRun, LcoreShare, RankStatus, Stats, TableLive, DETAIL_KEYS,
};
use phub_proto::layout::Placement;
use phub_proto::spec::JobSpec;

use super::checkpoints::combined_checkpoint;
use super::http::{not_admitted, RequestError};
use super::registry::{survey_of, Inner, Shared, Survey};
use crate::admission;
use crate::metrics;
use crate::state::{JobShape, StoredJob};
use crate::watch::READ_WAIT;

/// Whether every part of `job` is installed, by `survey`.
pub(super) fn installed(job: &StoredJob, survey: &Survey) -> bool {
    job.parts.iter().all(|p| {
        survey
            .get(&p.appliance)
            .is_some_and(|r| r.as_ref().is_ok_and(|ids| ids.contains(&job.id)))
    })
}

pub(super) fn summary(job: &StoredJob, installed: bool, inner: &Inner) -> JobSummary {
    JobSummary {
        id: job.id,
        name: job.spec.name.clone(),
        workers: job.spec.workers,
        joined: job.joined.iter().copied().collect(),
        keys: job.spec.keys.len(),
        chunks: job.layout.chunk_count(),
        dtype: job.spec.dtype.name().to_string(),
        optimizer: job.spec.optimizer.name().to_string(),
        memory_bytes: memory_bytes(job, inner),
        appliances: job.parts.iter().map(|p| p.appliance.clone()).collect(),
        installed,
        failed: job.failed.clone(),
        held: inner.checkpoints.held_reason(job.id),
    }
}

/// What `job` costs over all its appliances.
pub(super) fn memory_bytes(job: &StoredJob, inner: &Inner) -> u64 {
    job.part_layouts()
        .iter()
        .map(|(name, part)| {
            let info = inner.appliances.get(*name).and_then(|a| a.info.as_ref());
            job.part_bytes(name, part, info, |n| inner.rack_of(n))
        })
        .sum()
}

/// Several appliances' views of a job, merged: pushes, rounds and held
/// answers added up, the round range and each rank's clocks spanned, the
/// largest lead, each rank's silence the shortest.
pub(super) fn merge_live(lives: &[&JobLive]) -> Option<JobLive> {
    let first = lives.first()?;
    let mut m = JobLive {
        id: first.id,
        pushes: 0,
        rounds_completed: 0,
        round_range: None,
        silent_ms: vec![None; first.silent_ms.len()],
        clock: ClockStats::default(),
        copies: None,
        tables: Vec::new(),
    };
    for l in lives {
        m.pushes += l.pushes;
        TableLive::merge_all(&mut m.tables, &l.tables);
        m.clock.merge(&l.clock);
        m.rounds_completed += l.rounds_completed;
        m.round_range = match (m.round_range, l.round_range) {
            (Some((a, b)), Some((c, d))) => Some((a.min(c), b.max(d))),
            (a, b) => a.or(b),
        };
        if m.silent_ms.len() < l.silent_ms.len() {
            m.silent_ms.resize(l.silent_ms.len(), None);
        }
        for (s, t) in m.silent_ms.iter_mut().zip(&l.silent_ms) {
            *s = match (*s, *t) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
    }
    Some(m)
}
impl Shared {
    pub(super) fn list(&self) -> Vec<JobSummary> {
        let survey = self.survey();
        let inner = self.lock();
        inner
            .jobs
            .values()
            .map(|j| summary(j, installed(j, &survey), &inner))
            .collect()
    }

    pub(super) fn show(&self, id: u16) -> Result<JobDetail, RequestError> {
        let names: Vec<String> = {
            let inner = self.lock();
            let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
            job.parts.iter().map(|p| p.appliance.clone()).collect()
        };
        // Per appliance of the job: its view of the job, or why it is down.
        let views: BTreeMap<String, Result<Option<JobLive>, String>> = self
            .views(Some(&names), READ_WAIT)
            .into_iter()
            .map(|(n, v)| (n, v.map(|v| v.stats.jobs.into_iter().find(|j| j.id == id))))
            .collect();
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        let lives: Vec<&JobLive> = views.values().filter_map(|v| v.as_ref().ok()?.as_ref()).collect();
        let live = merge_live(&lives);
        // A part down in a replicated job's epoch is out of it for good.
        let all_installed = job
            .parts
            .iter()
            .enumerate()
            .filter(|(i, _)| !job.epoch.is_down(*i))
            .all(|(_, p)| matches!(views.get(&p.appliance), Some(Ok(Some(_)))));
        let rack_ranks = match job.shape {
            JobShape::Flat => None,
            JobShape::Hierarchical { .. } => job.spec.rack_ranks(),
        };
        let parts_detail = job
            .part_layouts()
            .into_iter()
            .enumerate()
            .map(|(i, (name, part))| {
                let a = inner.appliances.get(name);
                let view = views.get(name);
                let l = view.and_then(|v| v.as_ref().ok()?.as_ref());
                let span = part.span();
                JobPart {
                    appliance: name.to_string(),
                    rack: a.map(|a| a.spec.rack.clone()).unwrap_or_default(),
                    lcores: u32::try_from(part.lcores.len()).unwrap_or(u32::MAX),
                    chunks: (span.start, span.end),
                    memory_bytes: job
                        .part_bytes(name, &part, a.and_then(|a| a.info.as_ref()), |n| inner.rack_of(n)),
                    installed: l.is_some(),
                    down: match view {
                        _ if job.epoch.is_down(i) => Some(format!(
                            "declared down; out of the job since epoch {} (given the job again when it answers \
                             heartbeats again)",
                            job.epoch.epoch
                        )),
                        Some(Err(e)) => Some(e.clone()),
                        None => Some(format!("appliance {name:?} is not managed")),
                        Some(Ok(_)) => None,
                    },
                    rounds_completed: l.map_or(0, |l| l.rounds_completed),
                    round_range: l.and_then(|l| l.round_range),
                    ranks: rack_ranks
                        .as_ref()
                        .and_then(|r| r.get(i))
                        .map(|r| (r.start, r.end)),
                }
            })
            .collect();
        // Cast: r < workers <= MAX_WORKERS (256), checked by JobSpec::validate
        // on admission and on loading the state file.
        #[allow(clippy::cast_possible_truncation)]
        let ranks = (0..job.spec.workers)
            .map(|r| {
                let rank = r as u16;
                RankStatus {
                    rank,
                    joined: job.joined.contains(&rank),
                    silent_ms: live
                        .as_ref()
                        .and_then(|l| l.silent_ms.get(r as usize).copied().flatten()),
                }
            })
            .collect();
        let s = &job.spec;
        let spec = JobSpec {
            name: s.name.clone(),
            workers: s.workers,
            dtype: s.dtype,
            chunk_bytes: s.chunk_bytes,
            optimizer: s.optimizer,
            consistency: s.consistency,
            keys: s.keys.iter().take(DETAIL_KEYS).cloned().collect(),
            checkpoint_interval_s: s.checkpoint_interval_s,
            placement: s.placement.clone(),
        };
        Ok(JobDetail {
            summary: summary(job, all_installed, &inner),
            keys_omitted: (s.keys.len() - spec.keys.len()) as u64,
            spec,
            ranks,
            rounds_completed: live.as_ref().map_or(0, |l| l.rounds_completed),
            round_range: live.as_ref().and_then(|l| l.round_range),
            clock: live.as_ref().map(|l| l.clock.clone()).unwrap_or_default(),
            checkpoint: combined_checkpoint(&inner, job),
            parts: parts_detail,
            epoch: job.is_replicated().then(|| job.epoch.clone()),
            replicas: job.strength(|n| inner.rack_of(n)),
            tables: live.as_ref().map(|l| l.tables.clone()).unwrap_or_default(),
        })
    }

    /// `GET /v1/jobs/{id}/map`, and with `key` `/map/keys/{key}`: per lcore
    /// (of each appliance of the job) its run and bytes, O(lcores); one
    /// key's chunks as runs, O(lcores).
    pub(super) fn map(&self, id: u16, key: Option<u32>) -> Result<JobMap, RequestError> {
        let names: Vec<String> = {
            let inner = self.lock();
            let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
            job.parts.iter().map(|p| p.appliance.clone()).collect()
        };
        let mut infos = BTreeMap::new();
        for n in names {
            let info = self.info_of(&n)?;
            infos.insert(n, info);
        }
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        // Per global lcore: its appliance, its index there and its base port.
        let mut owners: Vec<(&str, u16, u16)> = Vec::with_capacity(job.layout.lcores.len());
        let mut lcores = Vec::new();
        let mut memory = 0;
        for (name, part) in job.part_layouts() {
            let info = infos.get(name).ok_or_else(|| not_admitted(id))?;
            // A table's rows are spread over the job's lcores on every
            // appliance: each part's lcores hold their share of them.
            let cost = admission::part_cost(&job.spec, &part, info, job.layout.lcores.len());
            memory += cost.total();
            // Cast: i < the part's lcore count, at most admission::MAX_LCORES
            // (2^16, checked by admission and on loading the state file).
            #[allow(clippy::cast_possible_truncation)]
            for (i, r) in part.lcores.iter().enumerate() {
                owners.push((name, i as u16, info.data.base_port));
                if !r.is_empty() {
                    lcores.push(LcoreShare {
                        appliance: name.to_string(),
                        lcore: i as u16,
                        port: info.data.base_port.wrapping_add(i as u16),
                        first: r.first,
                        slots: r.count,
                        bytes: cost.lcores[i],
                    });
                }
            }
        }
        let keys = match key {
            None => Vec::new(),
            Some(k) => {
                let ks = job.spec.keys.get(k as usize).ok_or_else(|| {
                    RequestError::NotFound(format!(
                        "job {id} has no key {k}; its keys are 0 to {}",
                        job.spec.keys.len() - 1
                    ))
                })?;
                let placement = Placement::new(&job.spec, job.layout.clone())
                    .map_err(|e| RequestError::State(format!("job {id}'s layout: {e}")))?;
                let seqs = placement.chunks().of_key(k);
                // Cast: a key's chunks, and so the chunk and slot numbers
                // within a run, are numbered by u32 (JobSpec::validate,
                // Placement::new).
                #[allow(clippy::cast_possible_truncation)]
                let runs = job
                    .layout
                    .lcores
                    .iter()
                    .zip(&owners)
                    .filter_map(|(r, &(name, lcore, _))| {
                        let (a, b) = (seqs.start.max(r.first), seqs.end.min(r.first + r.count));
                        (a < b).then(|| KeyRun {
                            appliance: name.to_string(),
                            lcore,
                            chunk: (a - seqs.start) as u32,
                            slot: (a - r.first) as u32,
                            count: (b - a) as u32,
                        })
                    })
                    .collect();
                vec![KeyMap {
                    key: k,
                    name: ks.name.clone(),
                    elements: ks.elements,
                    first: seqs.start,
                    runs,
                }]
            }
        };
        Ok(JobMap {
            id,
            chunk_elems: job.layout.chunk_elems,
            keys_total: job.spec.keys.len() as u64,
            chunks: job.layout.chunk_count(),
            memory_bytes: memory,
            lcores,
            keys,
        })
    }

    pub(super) fn stats(&self) -> Stats {
        let views = self.views(None, READ_WAIT);
        let survey = survey_of(&views);
        let mut appliances: Vec<ApplianceStats> = views
            .into_iter()
            .map(|(name, v)| {
                let (dataplane, error) = match v {
                    Ok(v) => (Some(v.stats), None),
                    Err(e) => (None, Some(e)),
                };
                ApplianceStats {
                    name,
                    rack: String::new(),
                    dataplane,
                    error,
                }
            })
            .collect();
        let inner = self.lock();
        for a in &mut appliances {
            if let Some(x) = inner.appliances.get(&a.name) {
                a.rack = x.spec.rack.clone();
            }
        }
        let jobs = inner
            .jobs
            .values()
            .map(|j| summary(j, installed(j, &survey), &inner))
            .collect();
        drop(inner);
        let (dataplane, dataplane_error) = appliances
            .first()
            .map_or((None, Some("no appliances".into())), |a| {
                (a.dataplane.clone(), a.error.clone())
            });
        Stats {
            dataplane,
            dataplane_error,
            appliances,
            jobs,
        }
    }

    pub(super) fn metrics(&self) -> String {
        let s = self.stats();
        let appliances: Vec<(&str, Option<&DataplaneStats>)> = s
            .appliances
            .iter()
            .map(|a| (a.name.as_str(), a.dataplane.as_ref()))
            .collect();
        let liveness: Vec<(String, bool, u64)> = self
            .lock()
            .appliances
            .values()
            .map(|a| {
                (
                    a.spec.name.clone(),
                    a.liveness.down.is_some(),
                    a.liveness.declarations,
                )
            })
            .collect();
        let liveness: Vec<metrics::Liveness<'_>> = liveness
            .iter()
            .map(|(name, declared_down, declarations)| metrics::Liveness {
                name,
                declared_down: *declared_down,
                declarations: *declarations,
            })
            .collect();
        let strength: Vec<metrics::Strength> = {
            let inner = self.lock();
            inner
                .jobs
                .values()
                .filter_map(|j| {
                    let r = j.strength(|n| inner.rack_of(n))?;
                    Some(metrics::Strength {
                        job: j.id,
                        live: r.live,
                        wanted: r.wanted,
                        rereplicating: r.state == phub_proto::api::Strength::Rereplicating,
                        stalled: r.state == phub_proto::api::Strength::Stalled,
                        full_strength_ms: r.rereplication.as_ref().and_then(|x| x.full_strength_ms()),
                    })
                })
                .collect()
        };
        metrics::render_all(&appliances, &s.jobs)
            + &metrics::render_liveness(&liveness)
            + &metrics::render_strength(&strength)
    }
}
