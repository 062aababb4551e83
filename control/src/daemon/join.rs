//! Rendezvous (`POST /v1/jobs/{id}/join`): a worker's rank, checked, gets
//! the job's spec, layout and appliances, with its share of each lcore's
//! receive buffer, and for a replicated job its replicas, racks and
//! epoch.

use std::collections::BTreeMap;

use phub_proto::api::{ApplianceAddr, JoinRack, JoinReplication, JoinRequest, JoinResponse};

use super::http::{not_admitted, RequestError};
use super::registry::{Entry, Inner, Shared};
use crate::state::StoredJob;

/// Job `job`'s share of appliance `name`'s receive buffers (`rx`: per
/// lcore, as the appliance states them), which its workers' windows must
/// fit (phub-worker's `auto_window`): on each lcore the job's workers send
/// to there (its part of the layout; a hierarchical job's rack layout),
/// the buffer times those workers (W; the rack's ranks) over everyone who
/// sends to that lcore ([`StoredJob::senders_to`] of every admitted job, this one
/// included), and the smallest of those. Each job's workers keeping
/// within their share, all of them together fit the buffer. This is the
/// share at join; jobs admitted or removed later are counted in the share
/// each lcore states in its RESULTs (PROTOCOL.md §6.1). None when the
/// appliance states no buffer for those lcores.
pub(super) fn rx_share(inner: &Inner, job: &StoredJob, name: &str, rx: &[Option<u64>]) -> Option<u64> {
    let (mine, w) = job.workers_to(name)?;
    let mut senders = vec![0u64; rx.len()];
    for j in inner.jobs.values().filter(|j| j.failed.is_none()) {
        for (layout, n) in j.senders_to(name) {
            for (s, r) in senders.iter_mut().zip(&layout.lcores) {
                if r.count > 0 {
                    *s += n;
                }
            }
        }
    }
    mine.lcores
        .iter()
        .zip(rx.iter().zip(&senders))
        .filter(|(r, _)| r.count > 0)
        .filter_map(|(_, (b, &s))| Some(b.as_ref()? * w / s.max(w)))
        .min()
}

/// What a worker of `job` needs to follow its epochs (PROTOCOL.md §11.6):
/// for a replicated job, the replica count, every appliance's rack label
/// in the job's appliance order, and the epoch now; `None` for any other.
fn replication_of(inner: &Inner, job: &StoredJob) -> Option<JoinReplication> {
    if !job.is_replicated() {
        return None;
    }
    Some(JoinReplication {
        replicas: u8::try_from(job.spec.replicas()).ok()?,
        racks: job.parts.iter().map(|p| inner.rack_of(&p.appliance)).collect(),
        epoch: job.epoch.clone(),
        rack: None,
    })
}

impl Shared {
    pub(super) fn check_join(inner: &Inner, id: u16, req: &JoinRequest) -> Result<(), RequestError> {
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        if job.token != req.token {
            return Err(RequestError::Forbidden(format!("wrong token for job {id}")));
        }
        inner.standing(job).check(id)?;
        let w = job.spec.workers;
        if u32::from(req.rank) >= w {
            return Err(RequestError::BadRequest(format!(
                "rank {} is outside 0..={} for job {id} (workers = {w})",
                req.rank,
                w - 1
            )));
        }
        if let (Some(said), Some(rack)) = (&req.rack, job.rack_of_rank(req.rank)) {
            let (r, part) = (rack.index, rack.appliance);
            let label = inner
                .appliances
                .get(part)
                .map(|a| a.spec.rack.as_str())
                .unwrap_or_default();
            if said != label {
                return Err(RequestError::BadRequest(format!(
                    "rank {} of job {id} belongs to rack {r} (appliance {part:?}, rack label {label:?}), not \
                     rack {said:?}: a hierarchical job's ranks are assigned to racks in order ({})",
                    req.rank,
                    job.rack_assignment()
                )));
            }
        }
        if job.joined.contains(&req.rank) && !req.rejoin {
            return Err(RequestError::Conflict(format!(
                "rank {} has already joined job {id} (a restarted worker rejoins with \"rejoin\": true)",
                req.rank
            )));
        }
        Ok(())
    }

    pub(super) fn join(&self, id: u16, body: &str) -> Result<JoinResponse, RequestError> {
        let req: JoinRequest = serde_json::from_str(body).map_err(|e| {
            RequestError::BadRequest(format!(
                "invalid join request: {e}; expected {{\"token\": \"<16 hex digits>\", \"rank\": <rank>}}"
            ))
        })?;
        let names: Vec<String> = {
            let inner = self.lock();
            Self::check_join(&inner, id, &req)?;
            inner.jobs[&id]
                .parts
                .iter()
                .map(|p| p.appliance.clone())
                .collect()
        };
        let mut datas = BTreeMap::new();
        for n in &names {
            let info = self.info_of(n)?;
            let rx: Vec<Option<u64>> = info.lcores.iter().map(|l| l.rx_buffer_bytes).collect();
            datas.insert(n.clone(), (info.data, rx));
        }
        let mut inner = self.lock();
        // Checked again: the job may have gone or the rank joined meanwhile.
        Self::check_join(&inner, id, &req)?;
        let shares: BTreeMap<String, Option<u64>> = {
            let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
            datas
                .iter()
                .map(|(n, (_, rx))| (n.clone(), rx_share(&inner, job, n, rx)))
                .collect()
        };
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        let appliances = job
            .parts
            .iter()
            .map(|p| {
                let (data, _) = datas.get(&p.appliance).ok_or_else(|| {
                    RequestError::Conflict(format!(
                        "job {id} moved while rank {} joined; join again",
                        req.rank
                    ))
                })?;
                Ok(ApplianceAddr {
                    name: p.appliance.clone(),
                    host: data.host.clone(),
                    base_port: data.base_port,
                    lcores: p.lcores,
                    rx_buffer_bytes: shares.get(&p.appliance).copied().flatten(),
                })
            })
            .collect::<Result<Vec<_>, RequestError>>()?;
        // A hierarchical job's worker talks to its rack's appliance alone,
        // in the single-appliance form (PROTOCOL.md §9.1); a replicated
        // one's gets the flat form and its rack: it sends to its rack's
        // appliance at epoch 0, as a flat job's worker from the job's
        // first epoch change on (§11.11).
        let rack = job.rack_of_rank(req.rank);
        let answer = match rack.filter(|_| !job.is_replicated()) {
            Some(rack) => JoinResponse {
                job: id,
                rank: req.rank,
                spec: job.spec.clone(),
                layout: rack.layout.clone(),
                dataplane: datas[rack.appliance].0.clone(),
                appliances: vec![ApplianceAddr {
                    lcores: u32::try_from(rack.layout.lcores.len()).unwrap_or(u32::MAX),
                    ..appliances[rack.index].clone()
                }],
                replication: None,
            },
            None => JoinResponse {
                job: id,
                rank: req.rank,
                spec: job.spec.clone(),
                layout: job.layout.clone(),
                dataplane: datas[&job.parts[0].appliance].0.clone(),
                appliances,
                replication: replication_of(&inner, job).map(|r| JoinReplication {
                    rack: rack.map(|rack| JoinRack {
                        appliance: u16::try_from(rack.index).unwrap_or(u16::MAX),
                        layout: rack.layout.clone(),
                    }),
                    ..r
                }),
            },
        };
        let joined = self.commit(&mut inner, Entry::Job(id), |inner| {
            if let Some(job) = inner.jobs.get_mut(&id) {
                job.joined.insert(req.rank);
            }
        });
        if let Err(e) = joined {
            log::error!("rank {} could not join job {id}: {e}", req.rank);
            return Err(RequestError::State(format!("{e}; the rank has not joined")));
        }
        let how = if req.rejoin { "rejoined" } else { "joined" };
        log::info!("rank {} {how} job {id} ({:?})", req.rank, answer.spec.name);
        Ok(answer)
    }
}
