//! `POST /v1/jobs/{id}/retry`: a held job's parts tried again, with their
//! checkpoint files read again or set aside.

use std::collections::BTreeMap;

use phub_proto::api::{CheckpointInfo, RetriedCheckpoint, RetriedInstall, RetriedPart, RetryResponse};

use super::checkpoints::{held_text, modified_ms, owner, rounds_text, unix_ms, Held, CHECKPOINT_FILES};
use super::http::{failed, held, not_admitted, RequestError};
use super::reconcile::ReconcileLog;
use super::registry::Shared;
use crate::ckpt_file;
use crate::dataplane::Client;
use crate::state;

impl Shared {
    /// `POST /v1/jobs/{id}/retry`: each held part of job `id` is tried
    /// again. Its checkpoint file is read again and, if it is usable now,
    /// becomes the part's checkpoint and the part is restored from it at
    /// once (as reconciliation would: fitted to the appliance, the
    /// checkpoint moved onto the part's layout); if not, the job stays
    /// held and the error says why. With `discard`, the file is renamed
    /// aside instead and the part starts over without it. A part its
    /// appliance still has installed keeps its state there.
    pub(super) fn retry(&self, id: u16, discard: bool) -> Result<RetryResponse, RequestError> {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let _files = CHECKPOINT_FILES.lock().unwrap_or_else(|p| p.into_inner());
        let (job, held_parts) = {
            let inner = self.lock();
            let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
            if let Some(why) = &job.failed {
                return Err(failed(id, why));
            }
            let held_parts: Vec<(String, Held)> = job
                .parts
                .iter()
                .filter_map(|p| {
                    let h = inner.checkpoints.held.get(&(id, p.appliance.clone()))?;
                    Some((p.appliance.clone(), h.clone()))
                })
                .collect();
            if held_parts.is_empty() {
                return Err(RequestError::Conflict(format!(
                    "job {id} is not held: nothing to retry (see phubctl job show {id})"
                )));
            }
            (job.clone(), held_parts)
        };
        let mut files = Vec::new();
        for (name, h) in &held_parts {
            let key = (id, name.clone());
            let checkpoint = if discard {
                let aside = state::sibling(&h.file, &format!(".discarded-{}", unix_ms()));
                let moved_to = match std::fs::rename(&h.file, &aside) {
                    Ok(()) => Some(aside.display().to_string()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => {
                        return Err(RequestError::State(format!(
                            "job {id}: cannot set the checkpoint {} aside as {}: {e}; the job stays held",
                            h.file.display(),
                            aside.display()
                        )))
                    }
                };
                let mut inner = self.lock();
                inner.checkpoints.held.remove(&key);
                inner.checkpoints.taken.remove(&key);
                log::warn!(
                    "job {id}: the operator gave up the checkpoint {} of its part on appliance {name:?} ({}): \
                     the part starts over without it",
                    h.file.display(),
                    moved_to.as_deref().unwrap_or("the file was gone")
                );
                RetriedCheckpoint::SetAside { moved_to }
            } else {
                let part = job.part_on(name).ok_or_else(|| not_admitted(id))?;
                let usable = match ckpt_file::read(&h.file, &owner(&job, name, &part)) {
                    Ok(Some(found)) => Ok(found),
                    Ok(None) => {
                        Err("the file is gone (restore it, or retry with --discard-checkpoint)".into())
                    }
                    Err(why) => Err(why),
                };
                let (bytes, ckpt) = match usable {
                    Ok(found) => found,
                    Err(why) => {
                        let h = Held {
                            file: h.file.clone(),
                            why,
                        };
                        let text = held_text(name, &h);
                        self.hold(id, name, h);
                        return Err(held(id, &text));
                    }
                };
                let info = CheckpointInfo {
                    id,
                    round_range: ckpt.round_range(),
                    bytes: bytes.len() as u64,
                    taken_unix_ms: modified_ms(&h.file),
                    file: h.file.display().to_string(),
                };
                let mut inner = self.lock();
                inner.checkpoints.held.remove(&key);
                inner.checkpoints.taken.insert(key, info);
                log::info!(
                    "job {id}: the checkpoint {} of its part on appliance {name:?} is usable again ({})",
                    h.file.display(),
                    rounds_text(ckpt.round_range())
                );
                RetriedCheckpoint::Usable {
                    round_range: ckpt.round_range(),
                }
            };
            files.push((name.clone(), h.file.display().to_string(), checkpoint));
        }
        // Each part is installed now, as reconciliation would install it.
        let mut parts = Vec::new();
        for (name, file, checkpoint) in files {
            let client = self.lock().client(&name)?;
            let has = |c: &Client| c.jobs().map(|j| j.iter().any(|j| j.id == id));
            let install = match has(&client) {
                Ok(true) => RetriedInstall::StillInstalled,
                Ok(false) => {
                    // No other appliance's jobs known: a replicated job is
                    // installed, not failed over (reconciliation does that).
                    self.reconcile_one(&name, &client, &BTreeMap::new(), &mut ReconcileLog::default());
                    if let Some(h) = self.lock().checkpoints.held.get(&(id, name.clone())) {
                        return Err(held(id, &held_text(&name, h)));
                    }
                    match has(&client) {
                        Ok(true) => RetriedInstall::Installed,
                        Ok(false) => RetriedInstall::Pending {
                            why: format!(
                                "appliance {name:?} did not install it (see phub-control's log); reconciliation \
                                 retries every {:?}",
                                self.interval
                            ),
                        },
                        Err(e) => RetriedInstall::Pending { why: e.to_string() },
                    }
                }
                Err(e) => RetriedInstall::Pending { why: e.to_string() },
            };
            parts.push(RetriedPart {
                appliance: name,
                file,
                checkpoint,
                install,
            });
        }
        Ok(RetryResponse { id, parts })
    }
}
