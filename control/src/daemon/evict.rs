//! Eviction (`DELETE /v1/jobs/{id}`): durable first, then the appliances
//! and the checkpoint files.

use phub_proto::api::JobSummary;

use super::checkpoints::checkpoint_path;
use super::http::{not_admitted, RequestError};
use super::registry::{Entry, Shared};
use super::views::summary;
use crate::ckpt_file;
use crate::dataplane::Client;

impl Shared {
    /// Evicts a job: durable first (the state file without it is written,
    /// or nothing changes and the error says why), then its appliances are
    /// told. An appliance that cannot be told now (down, refusing) keeps
    /// its part until reconciliation removes it, as it removes every job
    /// control has not admitted.
    pub(super) fn evict(&self, id: u16) -> Result<JobSummary, RequestError> {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        if !inner.jobs.contains_key(&id) {
            return Err(not_admitted(id));
        }
        let job = match self.commit(&mut inner, Entry::Job(id), |inner| inner.jobs.remove(&id)) {
            Ok(job) => job.expect("admitted, checked under the same lock"),
            Err(e) => {
                log::error!("job {id} not evicted: {e}");
                return Err(RequestError::State(format!("job {id} not evicted: {e}")));
            }
        };
        // Every part's checkpoint goes, usable or not, with any previous
        // version a write left.
        let mut files = Vec::new();
        for p in &job.parts {
            let key = (id, p.appliance.clone());
            inner.checkpoints.taken.remove(&key);
            inner.checkpoints.held.remove(&key);
            let f = checkpoint_path(&self.state_path, &job, &p.appliance);
            files.push(ckpt_file::prev_path(&f));
            files.push(f);
        }
        let clients: Vec<(String, Option<Client>)> = job
            .parts
            .iter()
            .map(|p| (p.appliance.clone(), inner.client(&p.appliance).ok()))
            .collect();
        let summary = summary(&job, false, &inner);
        drop(inner);
        for f in files {
            match std::fs::remove_file(&f) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => log::warn!("job {id} evicted, but its checkpoint {} stays: {e}", f.display()),
            }
        }
        for (name, c) in clients {
            if let Some(Err(e)) = c.map(|c| c.remove(id)) {
                log::warn!(
                    "job {id} evicted; appliance {name:?} could not be told ({e}): reconciliation removes it there"
                );
            }
        }
        log::info!("evicted job {id} ({:?})", job.spec.name);
        Ok(summary)
    }
}
