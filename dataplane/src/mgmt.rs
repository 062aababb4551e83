//! The management side of a running dataplane: the lcore threads' command
//! queues, the installed-job registry, and the HTTP/JSON management API that
//! phub-control talks to (routes in `phub_proto::api`).
//!
//! Runs on its own thread, never on a data core. It reaches lcores only
//! through their bounded command queues and waits for each to acknowledge.

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Sender};
use phub_proto::api::{
    ApiError, DataplaneInfo, DataplaneStats, InstallJob, InstalledJob, JobLive, PortStats,
};
use phub_proto::checkpoint::{Checkpoint, SlotState, MAGIC as CKPT_MAGIC};
use phub_proto::layout::slot_bytes;

use crate::counters::ShardCounters;
use crate::engine::{EngineError, JobInstall};
use crate::lcore::{Clock, Command};
use crate::shm::ShmSetup;

/// How long the management thread waits for an lcore to acknowledge.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest management request body.
const MAX_BODY: u64 = 256 << 20;

/// One running lcore, as the management side sees it.
#[derive(Debug)]
pub struct LcoreHandle {
    /// Its command queue.
    pub commands: Sender<Command>,
    /// Its counters.
    pub counters: Arc<ShardCounters>,
    /// Its thread.
    pub thread: Option<JoinHandle<std::io::Result<()>>>,
}

/// A management request's failure: an HTTP status and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MgmtError {
    /// HTTP status.
    pub status: u16,
    /// What went wrong.
    pub message: String,
}

fn err(status: u16, message: impl Into<String>) -> MgmtError {
    MgmtError {
        status,
        message: message.into(),
    }
}

/// The management state of a running dataplane.
#[derive(Debug)]
pub struct Manager {
    info: DataplaneInfo,
    lcores: Vec<LcoreHandle>,
    jobs: Mutex<BTreeMap<u16, (InstalledJob, InstallJob)>>,
    clock: Clock,
    port_stats: Option<PortStatsReader>,
}

/// Reads a DPDK port's own counters for `/v1/stats` (DPDK backend).
pub struct PortStatsReader(pub Box<dyn Fn() -> Option<PortStats> + Send + Sync>);

impl std::fmt::Debug for PortStatsReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PortStatsReader")
    }
}

impl Manager {
    /// Wraps running lcores. `info.memory_used_bytes` is kept up to date.
    pub fn new(info: DataplaneInfo, lcores: Vec<LcoreHandle>, clock: Clock) -> Manager {
        Manager {
            info,
            lcores,
            jobs: Mutex::new(BTreeMap::new()),
            clock,
            port_stats: None,
        }
    }

    /// Reports a DPDK port's counters beside the lcores' in `/v1/stats`.
    pub fn with_port_stats(mut self, reader: PortStatsReader) -> Manager {
        self.port_stats = Some(reader);
        self
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<u16, (InstalledJob, InstallJob)>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `GET /v1/info`.
    pub fn info(&self) -> DataplaneInfo {
        let mut i = self.info.clone();
        i.memory_used_bytes = self.jobs().values().map(|j| j.0.memory_bytes).sum();
        i
    }

    /// `GET /v1/jobs`.
    pub fn list(&self) -> Vec<InstalledJob> {
        self.jobs().values().map(|j| j.0.clone()).collect()
    }

    /// `PUT /v1/jobs/{id}`: installs on every lcore or on none.
    pub fn install(&self, id: u16, req: InstallJob) -> Result<InstalledJob, MgmtError> {
        self.install_with(id, req, None)
    }

    /// `PUT /v1/jobs/{id}` with a checkpoint body: installs the job it
    /// describes with every slot restored, on every lcore or on none.
    pub fn restore(&self, id: u16, ckpt: Checkpoint) -> Result<InstalledJob, MgmtError> {
        let Checkpoint { job, lcores } = ckpt;
        let r = self.install_with(id, job, Some(lcores))?;
        log::info!("job {id} restored from a checkpoint");
        Ok(r)
    }

    /// `GET /v1/jobs/{id}/checkpoint`: every lcore's saved slots.
    pub fn checkpoint(&self, id: u16) -> Result<Checkpoint, MgmtError> {
        let job = self
            .jobs()
            .get(&id)
            .map(|j| j.1.clone())
            .ok_or_else(|| err(404, format!("job {id} is not installed")))?;
        let mut lcores = Vec::with_capacity(self.lcores.len());
        for (i, l) in self.lcores.iter().enumerate() {
            let (tx, rx) = bounded(1);
            let state = l
                .commands
                .send_timeout(Command::Snapshot(id, tx), ACK_TIMEOUT)
                .ok()
                .and_then(|()| rx.recv_timeout(ACK_TIMEOUT).ok())
                .ok_or_else(|| err(500, format!("lcore {i} did not answer the checkpoint request")))?
                .ok_or_else(|| err(404, format!("job {id} is not installed on lcore {i}")))?;
            lcores.push(state);
        }
        Ok(Checkpoint { job, lcores })
    }

    fn install_with(
        &self,
        id: u16,
        req: InstallJob,
        mut restore: Option<Vec<Vec<SlotState>>>,
    ) -> Result<InstalledJob, MgmtError> {
        if req.id != id {
            return Err(err(
                400,
                format!("job id {} in the body does not match {id} in the path", req.id),
            ));
        }
        req.spec.validate().map_err(|e| err(400, e.to_string()))?;
        let n = self.lcores.len();
        if req.layout.lcores.len() != n {
            return Err(err(
                400,
                format!(
                    "layout covers {} lcores; this dataplane has {n}",
                    req.layout.lcores.len()
                ),
            ));
        }
        let need: u64 = req
            .layout
            .lcores
            .iter()
            .flatten()
            .map(|s| slot_bytes(req.spec.dtype, &req.spec.optimizer, s.elems))
            .sum();
        let mut jobs = self.jobs();
        if jobs.contains_key(&id) {
            return Err(err(409, format!("job {id} is already installed")));
        }
        let used: u64 = jobs.values().map(|j| j.0.memory_bytes).sum();
        if used + need > self.info.memory_budget_bytes {
            return Err(err(
                507,
                format!(
                    "job {id} needs {need} bytes of slot memory; {} of {} are free",
                    self.info.memory_budget_bytes.saturating_sub(used),
                    self.info.memory_budget_bytes
                ),
            ));
        }
        let workers = u16::try_from(req.spec.workers).unwrap_or(u16::MAX);
        // With --shm every lcore gives the job its shared-memory regions.
        let shm = self.info.shm.then_some(ShmSetup {
            base_port: self.info.data.base_port,
            chunk_elems: req.layout.chunk_elems,
        });
        let mut done = Vec::new();
        let mut total = 0;
        for (i, l) in self.lcores.iter().enumerate() {
            let (tx, rx) = bounded(1);
            let job = JobInstall {
                id,
                token: req.token,
                workers,
                dtype: req.spec.dtype,
                optimizer: req.spec.optimizer,
                slots: req.layout.lcores[i].clone(),
            };
            let state = restore.as_mut().map(|r| std::mem::take(&mut r[i]));
            // Slot memory that runs out is the budget's 507; anything else
            // is the dataplane's fault.
            let answer = l
                .commands
                .send_timeout(Command::Install(job, shm, state, tx), ACK_TIMEOUT)
                .map_err(|_| (500, format!("lcore {i} did not take the command")))
                .and_then(|()| {
                    rx.recv_timeout(ACK_TIMEOUT)
                        .map_err(|_| (500, format!("lcore {i} did not answer")))
                })
                .and_then(|r| {
                    r.map_err(|e| {
                        let status = if matches!(e, EngineError::SlotMemory { .. }) {
                            507
                        } else {
                            500
                        };
                        (status, format!("lcore {i}: {e}"))
                    })
                });
            match answer {
                Ok(bytes) => {
                    total += bytes;
                    done.push(i);
                }
                Err((status, message)) => {
                    for &j in &done {
                        self.remove_on(j, id);
                    }
                    return Err(err(status, format!("job {id} not installed: {message}")));
                }
            }
        }
        let job = InstalledJob {
            id,
            memory_bytes: total,
        };
        log::info!(
            "installed job {id}: {} chunks, {total} bytes of slot memory",
            req.layout.chunk_count()
        );
        jobs.insert(id, (job.clone(), req));
        Ok(job)
    }

    fn remove_on(&self, lcore: usize, id: u16) -> bool {
        let (tx, rx) = bounded(1);
        self.lcores[lcore]
            .commands
            .send_timeout(Command::Remove(id, tx), ACK_TIMEOUT)
            .is_ok()
            && rx.recv_timeout(ACK_TIMEOUT).unwrap_or(false)
    }

    /// `DELETE /v1/jobs/{id}`.
    pub fn remove(&self, id: u16) -> Result<(), MgmtError> {
        let mut jobs = self.jobs();
        if jobs.remove(&id).is_none() {
            return Err(err(404, format!("job {id} is not installed")));
        }
        for i in 0..self.lcores.len() {
            self.remove_on(i, id);
        }
        log::info!("removed job {id}");
        Ok(())
    }

    /// `GET /v1/stats`.
    pub fn stats(&self) -> DataplaneStats {
        // Cast: one handle per running lcore, at most MAX_LCORES (256,
        // checked in Config::lcore_count).
        #[allow(clippy::cast_possible_truncation)]
        let lcores = self
            .lcores
            .iter()
            .enumerate()
            .map(|(i, l)| l.counters.snapshot(i as u16))
            .collect();
        let now = self.clock.now();
        let mut jobs: BTreeMap<u16, (JobLive, Vec<u64>)> = BTreeMap::new();
        for l in &self.lcores {
            let (tx, rx) = bounded(1);
            if l.commands
                .send_timeout(Command::JobStats(tx), ACK_TIMEOUT)
                .is_err()
            {
                continue;
            }
            let Ok(list) = rx.recv_timeout(ACK_TIMEOUT) else {
                continue;
            };
            for s in list {
                let e = jobs.entry(s.id).or_insert_with(|| {
                    (
                        JobLive {
                            id: s.id,
                            pushes: 0,
                            rounds_completed: 0,
                            round_range: None,
                            silent_ms: Vec::new(),
                        },
                        vec![0; s.last_seen.len()],
                    )
                });
                e.0.pushes += s.pushes;
                e.0.rounds_completed += s.rounds_completed;
                if let Some((lo, hi)) = s.round_range {
                    e.0.round_range = Some(e.0.round_range.map_or((lo, hi), |(a, b)| (a.min(lo), b.max(hi))));
                }
                for (m, t) in e.1.iter_mut().zip(&s.last_seen) {
                    *m = (*m).max(*t);
                }
            }
        }
        DataplaneStats {
            backend: self.info.backend.clone(),
            port: self.port_stats.as_ref().and_then(|r| (r.0)()),
            lcores,
            jobs: jobs
                .into_values()
                .map(|(mut j, seen)| {
                    j.silent_ms = seen
                        .iter()
                        .map(|&t| (t != 0).then(|| now.saturating_sub(t) / 1_000_000))
                        .collect();
                    j
                })
                .collect(),
        }
    }

    /// Number of lcores.
    pub fn lcore_count(&self) -> usize {
        self.lcores.len()
    }

    /// Tells every lcore to stop (through `stop`) and joins them.
    pub fn join_lcores(&mut self, stop: &AtomicBool) {
        stop.store(true, Ordering::Relaxed);
        for (i, l) in self.lcores.iter_mut().enumerate() {
            if let Some(t) = l.thread.take() {
                match t.join() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => log::error!("lcore {i} stopped on an I/O error: {e}"),
                    Err(_) => log::error!("lcore {i} panicked"),
                }
            }
        }
    }
}

fn respond(req: tiny_http::Request, status: u16, body: String) {
    let header = tiny_http::Header::from_bytes("Content-Type", "application/json").expect("static header");
    let _ = req.respond(
        tiny_http::Response::from_string(body)
            .with_status_code(status)
            .with_header(header),
    );
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\":\"serialising the answer: {e}\"}}"))
}

fn error_body(message: String) -> String {
    json(&ApiError { error: message })
}

/// Serves the management API on `server` until `stop` is set and the server
/// is unblocked.
pub fn serve(server: Arc<tiny_http::Server>, mgr: Arc<Manager>, stop: Arc<AtomicBool>) {
    for mut req in server.incoming_requests() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let method = req.method().clone();
        let url = req.url().split('?').next().unwrap_or("").to_string();
        let parts: Vec<&str> = url.trim_matches('/').split('/').collect();
        use tiny_http::Method::{Delete, Get, Put};
        let mut body = Vec::new();
        if let Err(e) = req.as_reader().take(MAX_BODY).read_to_end(&mut body) {
            respond(req, 400, error_body(format!("reading the request body: {e}")));
            continue;
        }
        if let (Get, ["v1", "jobs", id, "checkpoint"]) = (&method, parts.as_slice()) {
            let encoded = parse_id(id).and_then(|id| {
                let c = mgr.checkpoint(id)?;
                c.encode().map_err(|e| err(500, format!("job {id}: {e}")))
            });
            match encoded {
                Ok(bytes) => {
                    let header = tiny_http::Header::from_bytes("Content-Type", "application/octet-stream")
                        .expect("static header");
                    let _ = req.respond(tiny_http::Response::from_data(bytes).with_header(header));
                }
                Err(e) => respond(req, e.status, error_body(e.message)),
            }
            continue;
        }
        let result: Result<(u16, String), MgmtError> = match (&method, parts.as_slice()) {
            (Get, ["v1", "info"]) => Ok((200, json(&mgr.info()))),
            (Get, ["v1", "jobs"]) => Ok((200, json(&mgr.list()))),
            (Get, ["v1", "stats"]) => Ok((200, json(&mgr.stats()))),
            (Put, ["v1", "jobs", id]) if body.starts_with(CKPT_MAGIC) => parse_id(id).and_then(|id| {
                let c = Checkpoint::decode(&body).map_err(|e| err(400, format!("job {id}: {e}")))?;
                mgr.restore(id, c).map(|j| (201, json(&j)))
            }),
            (Put, ["v1", "jobs", id]) => parse_id(id).and_then(|id| {
                let r: InstallJob = serde_json::from_slice(&body)
                    .map_err(|e| err(400, format!("install request for job {id}: {e}")))?;
                mgr.install(id, r).map(|j| (201, json(&j)))
            }),
            (Delete, ["v1", "jobs", id]) => {
                parse_id(id).and_then(|id| mgr.remove(id).map(|()| (204, String::new())))
            }
            _ => Err(err(404, format!("no route for {method} {url}"))),
        };
        match result {
            Ok((status, body)) => respond(req, status, body),
            Err(e) => respond(req, e.status, error_body(e.message)),
        }
    }
}

fn parse_id(s: &str) -> Result<u16, MgmtError> {
    s.parse::<u16>()
        .ok()
        .filter(|&id| id != 0)
        .ok_or_else(|| err(400, format!("job id {s:?}: expected an integer from 1 to 65535")))
}
