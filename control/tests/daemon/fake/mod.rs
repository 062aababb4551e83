//! A fake dataplane management API for tests: tiny_http on 127.0.0.1:0 in a
//! thread, jobs in memory, configurable lcores, NUMA nodes and memory budget.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use phub_proto::api::{
    ApiError, ClockStats, DataAddr, DataplaneInfo, DataplaneStats, InstallJob, InstalledJob, JobLive,
    LcoreInfo, LcoreStats,
};
use phub_proto::checkpoint::{Checkpoint, SlotState, MAGIC};
use phub_proto::failover::EpochView;
use phub_proto::memory::{MemoryModel, ResultStore};
use phub_proto::spec::Consistency;
use serde::Serialize;

/// What a job costs on the fake: what admission charges, by the model the
/// fake reports.
fn job_bytes(job: &InstallJob) -> u64 {
    MemoryModel::default()
        .job_cost(&job.spec, &job.layout, ResultStore::Slot)
        .total()
}

/// What the fake looks like.
#[derive(Debug, Clone)]
pub(crate) struct FakeConfig {
    /// NUMA node of each lcore.
    pub(crate) numa: Vec<Option<u32>>,
    /// NUMA node of the NIC.
    pub(crate) nic: Option<u32>,
    /// Slot memory budget.
    pub(crate) budget: u64,
    /// Base port of its data address ([`BASE_PORT`] unless a test gives
    /// several fakes, which control tells apart by it).
    pub(crate) base_port: u16,
}

impl FakeConfig {
    /// `n` lcores, no NUMA information, 1 GiB.
    pub(crate) fn lcores(n: usize) -> FakeConfig {
        FakeConfig {
            numa: vec![None; n],
            nic: None,
            budget: 1 << 30,
            base_port: BASE_PORT,
        }
    }

    /// The same with its data address at `base_port` (a second fake beside
    /// another: control refuses two appliances with one data address).
    #[allow(dead_code)] // Not every test file runs several fakes.
    pub(crate) fn at(self, base_port: u16) -> FakeConfig {
        FakeConfig { base_port, ..self }
    }
}

/// The fake's state, open to the test.
#[derive(Debug, Default)]
pub(crate) struct FakeState {
    /// Installed jobs.
    pub(crate) jobs: BTreeMap<u16, InstallJob>,
    /// When set, every PUT is refused with this message (HTTP 500).
    pub(crate) refuse: Option<String>,
    /// When set, every PUT is refused as invalid with this message (HTTP 400).
    pub(crate) refuse_invalid: Option<String>,
    /// When set, every DELETE is refused with this message (HTTP 503).
    pub(crate) refuse_delete: Option<String>,
    /// Requests seen, as `METHOD PATH`.
    pub(crate) log: Vec<String>,
    /// Checkpoints jobs were restored from (`PUT` with a checkpoint body).
    pub(crate) restored: BTreeMap<u16, Checkpoint>,
    /// The management token every change and checkpoint read needs, as on
    /// a real dataplane; kept in the dataplane's default token file for
    /// the fake's port, where control looks by default.
    pub(crate) token: String,
    /// Requests refused for a missing or wrong token.
    pub(crate) unauthorized: u32,
    /// Its id in `/v1/info`: random, as a dataplane's (new at a restart).
    pub(crate) id: String,
    /// Epochs installed (`PUT /v1/jobs/{id}/epoch`), by job, in order.
    pub(crate) epochs: BTreeMap<u16, Vec<EpochView>>,
    /// Every install it accepted, in order: the job and the epoch it was
    /// installed at (0 for a job that is not replicated).
    pub(crate) installs: Vec<(u16, u32)>,
    /// When set, every epoch PUT is answered 410 with this message, as a
    /// dataplane that would serve a part whose state copy is not all
    /// there (PROTOCOL.md §11.7).
    pub(crate) part_lost: Option<String>,
    /// What a replicated job's stats say of its state copies (PROTOCOL.md
    /// §11.7): backup slots awaiting one (0 unless a test sets it).
    pub(crate) copies_awaiting: u64,
    /// When set, `GET /v1/info` is answered this late (from a thread of
    /// its own, the fake answering the rest meanwhile): past control's
    /// heartbeat deadline, within its admission's wait.
    pub(crate) info_delay: Option<Duration>,
    /// When set, `GET /v1/jobs` is answered this late with the jobs held
    /// when it was asked: a slow answer that is stale by the time it
    /// comes, as on a loaded host.
    pub(crate) jobs_delay: Option<Duration>,
}

/// Bytes of state copies the fake reports for a replicated job installed
/// above epoch 0 (an appliance that came back).
pub(crate) const FAKE_COPY_BYTES: u64 = 4096;

/// A running fake.
pub(crate) struct Fake {
    /// Its address.
    pub(crate) addr: SocketAddr,
    /// Its state.
    pub(crate) state: Arc<Mutex<FakeState>>,
    /// What it looks like (a restart may change it).
    config: Arc<Mutex<FakeConfig>>,
    /// While set, the fake answers nothing (requests wait), as a hung
    /// dataplane or one behind a partition.
    silent: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Base port of the fake's data address.
pub(crate) const BASE_PORT: u16 = 9100;
/// Lcore 0's receive buffer in the fake's `/v1/info` (lcore i's is this
/// shifted right by i).
pub(crate) const FAKE_RX_BUFFER: u64 = 8 << 20;

impl Fake {
    /// Starts a fake.
    pub(crate) fn start(config: FakeConfig) -> Fake {
        let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let addr = server.server_addr().to_ip().unwrap();
        let token_path = phub_http::secret::mgmt_token_path(addr.port());
        let _ = std::fs::remove_file(&token_path);
        let (token, _) = phub_http::secret::load_or_create(&token_path).unwrap();
        let state = Arc::new(Mutex::new(FakeState {
            token,
            id: phub_http::secret::random_token().unwrap(),
            ..FakeState::default()
        }));
        let config = Arc::new(Mutex::new(config));
        let stop = Arc::new(AtomicBool::new(false));
        let silent = Arc::new(AtomicBool::new(false));
        let (st, cf, sp, si) = (state.clone(), config.clone(), stop.clone(), silent.clone());
        let thread = std::thread::spawn(move || {
            while !sp.load(Ordering::Relaxed) {
                if si.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                if let Ok(Some(req)) = server.recv_timeout(Duration::from_millis(20)) {
                    let config = cf.lock().unwrap().clone();
                    handle(&config, &st, req);
                }
            }
        });
        Fake {
            addr,
            state,
            config,
            silent,
            stop,
            thread: Some(thread),
        }
    }

    /// Stops answering (`true`) or answers again (`false`).
    #[allow(dead_code)] // Only the failover tests hang a fake.
    pub(crate) fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::Relaxed);
    }

    /// Base URL for `--dataplane`.
    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Installed jobs, cloned.
    pub(crate) fn jobs(&self) -> BTreeMap<u16, InstallJob> {
        self.state.lock().unwrap().jobs.clone()
    }

    /// Forgets every job, as a restarted dataplane would.
    pub(crate) fn forget_all(&self) {
        self.state.lock().unwrap().jobs.clear();
    }

    /// Restarts as a dataplane does: every job forgotten, a new identity
    /// in `/v1/info`.
    #[allow(dead_code)] // Not every test file restarts a fake.
    pub(crate) fn restart(&self) {
        let mut st = self.state.lock().unwrap();
        st.jobs.clear();
        st.id = phub_http::secret::random_token().unwrap();
    }

    /// Restarts as `config` says (another lcore count, another budget):
    /// every job is forgotten.
    pub(crate) fn restart_as(&self, config: FakeConfig) {
        let mut st = self.state.lock().unwrap();
        *self.config.lock().unwrap() = config;
        st.jobs.clear();
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(phub_http::secret::mgmt_token_path(self.addr.port()));
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn json<T: Serialize>(req: tiny_http::Request, status: u16, body: &T) {
    let resp = tiny_http::Response::from_string(serde_json::to_string(body).unwrap())
        .with_status_code(status)
        .with_header(tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap());
    let _ = req.respond(resp);
}

fn error(req: tiny_http::Request, status: u16, msg: &str) {
    json(req, status, &ApiError { error: msg.into() });
}

/// [`json`] 200 with `body`, `delay` later when given (from a thread of
/// its own).
fn answer_after<T: Serialize + Send + 'static>(req: tiny_http::Request, delay: Option<Duration>, body: T) {
    match delay {
        None => json(req, 200, &body),
        Some(d) => {
            std::thread::spawn(move || {
                std::thread::sleep(d);
                json(req, 200, &body);
            });
        }
    }
}

fn handle(config: &FakeConfig, state: &Mutex<FakeState>, mut req: tiny_http::Request) {
    let method = req.method().as_str().to_string();
    let path = req.url().to_string();
    let mut bytes = Vec::new();
    let _ = req.as_reader().read_to_end(&mut bytes);
    let ckpt = bytes.starts_with(MAGIC).then(|| Checkpoint::decode(&bytes));
    let body = String::from_utf8(bytes).unwrap_or_default();
    let mut st = state.lock().unwrap();
    st.log.push(format!("{method} {path}"));
    let used: u64 = st.jobs.values().map(job_bytes).sum();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let open = phub_proto::routes::MgmtRoute::is_open(&method, &path);
    let bearer = format!("Bearer {}", st.token);
    let authorized = req
        .headers()
        .iter()
        .any(|h| h.field.equiv("Authorization") && h.value.as_str() == bearer);
    if !open && !authorized {
        st.unauthorized += 1;
        return error(req, 401, "the fake dataplane needs its management token");
    }
    match (method.as_str(), segs.as_slice()) {
        ("GET", ["v1", "auth"]) => {
            let _ = req.respond(tiny_http::Response::empty(204));
        }
        ("GET", ["v1", "info"]) => answer_after(
            req,
            st.info_delay,
            DataplaneInfo {
                id: st.id.clone(),
                backend: phub_proto::api::BackendKind::Udp,
                data: DataAddr {
                    host: "127.0.0.1".into(),
                    base_port: config.base_port,
                },
                lcores: config
                    .numa
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| LcoreInfo {
                        lcore: i as u16,
                        cpu: Some(i),
                        numa_node: n,
                        // Lcore i's receive buffer halves with i: a join
                        // answer carries the smallest.
                        rx_buffer_bytes: Some(FAKE_RX_BUFFER >> i),
                    })
                    .collect(),
                nic_numa_node: config.nic,
                memory_budget_bytes: config.budget,
                memory_used_bytes: used,
                memory_model: MemoryModel::default(),
                slot_memory: "Rust heap".into(),
                kernels: "scalar".into(),
                shm: false,
                version: "fake".into(),
            },
        ),
        ("GET", ["v1", "jobs"]) => {
            let list: Vec<InstalledJob> = st
                .jobs
                .values()
                .map(|j| InstalledJob {
                    id: j.id,
                    memory_bytes: job_bytes(j),
                    shm_bytes: 0,
                })
                .collect();
            answer_after(req, st.jobs_delay, list)
        }
        ("PUT", ["v1", "jobs", id]) => {
            let id: u16 = id.parse().unwrap();
            if let Some(m) = st.refuse.clone() {
                return error(req, 500, &m);
            }
            if let Some(m) = st.refuse_invalid.clone() {
                return error(req, 400, &m);
            }
            let mut restored = None;
            let job: InstallJob = match ckpt {
                Some(Ok(c)) => {
                    let job = c.job.clone();
                    restored = Some(c);
                    job
                }
                Some(Err(e)) => return error(req, 400, &format!("bad checkpoint: {e}")),
                None => match serde_json::from_str(&body) {
                    Ok(j) => j,
                    Err(e) => return error(req, 400, &format!("bad InstallJob: {e}")),
                },
            };
            if job.id != id || job.layout.lcores.len() != config.numa.len() {
                return error(req, 400, "id or lcore count mismatch");
            }
            if st.jobs.contains_key(&id) {
                return error(req, 409, &format!("job {id} is already installed"));
            }
            let need = job_bytes(&job);
            if used + need > config.budget {
                return error(req, 507, "over budget");
            }
            let epoch = job.replication.as_ref().map_or(0, |r| r.epoch);
            st.installs.push((id, epoch));
            st.jobs.insert(id, job);
            if let Some(c) = restored {
                st.restored.insert(id, c);
            }
            json(
                req,
                201,
                &InstalledJob {
                    id,
                    memory_bytes: need,
                    shm_bytes: 0,
                },
            )
        }
        ("PUT", ["v1", "jobs", id, "epoch"]) => {
            let id: u16 = id.parse().unwrap();
            let view: EpochView = match serde_json::from_str(&body) {
                Ok(v) => v,
                Err(e) => return error(req, 400, &format!("bad EpochView: {e}")),
            };
            if !st.jobs.contains_key(&id) {
                return error(req, 404, &format!("job {id} is not installed"));
            }
            if let Some(m) = st.part_lost.clone() {
                return error(req, 410, &m);
            }
            st.epochs.entry(id).or_default().push(view);
            let _ = req.respond(tiny_http::Response::empty(204));
        }
        ("DELETE", ["v1", "jobs", id]) => {
            let id: u16 = id.parse().unwrap();
            if let Some(m) = st.refuse_delete.clone() {
                return error(req, 503, &m);
            }
            if st.jobs.remove(&id).is_some() {
                let _ = req.respond(tiny_http::Response::empty(204));
            } else {
                error(req, 404, &format!("job {id} is not installed"))
            }
        }
        ("GET", ["v1", "jobs", id, "checkpoint"]) => {
            let id: u16 = id.parse().unwrap();
            let Some(job) = st.jobs.get(&id).cloned() else {
                return error(req, 404, &format!("job {id} is not installed"));
            };
            // Each slot's last completed round is its chunk's sequence
            // number, so a test sees where each chunk's state went. (A sum
            // job keeps no parameters, and its stored result may be empty.)
            let lcores: Vec<Vec<SlotState>> = job
                .layout
                .lcores
                .iter()
                .map(|run| {
                    run.range()
                        .map(|seq| SlotState {
                            completed: Some(u32::try_from(seq).unwrap()),
                            params: Vec::new(),
                            s1: Vec::new(),
                            s2: Vec::new(),
                            result: Vec::new(),
                            clocks: Vec::new(),
                        })
                        .collect()
                })
                .collect();
            let tables = vec![Vec::new(); lcores.len()];
            let bytes = Checkpoint { job, lcores, tables }.encode().unwrap();
            let _ = req.respond(tiny_http::Response::from_data(bytes));
        }
        ("GET", ["v1", "stats"]) => {
            let lcores = (0..config.numa.len())
                .map(|i| LcoreStats {
                    lcore: i as u16,
                    rx_packets: 100 + i as u64,
                    drops: if i == 0 {
                        [("bad_token".to_string(), 7)].into()
                    } else {
                        BTreeMap::new()
                    },
                    ..Default::default()
                })
                .collect();
            let jobs = st
                .jobs
                .values()
                .map(|j| JobLive {
                    // A replicated job: the epoch it was installed at or
                    // last put, and the copies the test says.
                    copies: j.replication.as_ref().map(|r| phub_proto::api::CopyProgress {
                        epoch: st
                            .epochs
                            .get(&j.id)
                            .and_then(|e| e.last())
                            .map_or(r.epoch, |e| e.epoch.max(r.epoch)),
                        awaiting: st.copies_awaiting,
                        owed: 0,
                        bytes_received: if r.epoch > 0 { FAKE_COPY_BYTES } else { 0 },
                    }),
                    tables: Vec::new(),
                    id: j.id,
                    pushes: 10,
                    rounds_completed: 42,
                    round_range: Some((3, 5)),
                    silent_ms: (0..j.spec.workers).map(|r| (r == 0).then_some(250)).collect(),
                    // Jobs that are not BSP: rank r at clocks r+3..=r+4,
                    // a lead of τ + 1 (2 in async); bounded delay: one
                    // answer held now, 4 so far, their waits 1.5 ms in
                    // all, 1 ms at most.
                    clock: match j.spec.consistency {
                        Consistency::Sync => ClockStats::default(),
                        c => {
                            let b = u64::from(c.delay().is_some());
                            ClockStats {
                                clocks: (0..j.spec.workers).map(|r| (r + 3, r + 4)).collect(),
                                max_lead: Some(c.delay().map_or(2, |d| d + 1)),
                                held: b,
                                held_total: 4 * b,
                                held_wait_us: 1500 * b,
                                held_wait_max_us: 1000 * b,
                            }
                        }
                    },
                })
                .collect();
            json(
                req,
                200,
                &DataplaneStats {
                    spin_us: None,
                    port: None,
                    backend: phub_proto::api::BackendKind::Udp,
                    lcores,
                    jobs,
                },
            )
        }
        _ => error(req, 404, "no such route"),
    }
}

/// A state file's path in a scratch directory of its own under the system
/// temp dir (`<prefix>-<tag>-<pid>`), removed with everything in it when
/// dropped (at the end of the test, passed or not). Derefs to the path.
pub(crate) struct TempState(std::path::PathBuf);

impl TempState {
    pub(crate) fn new(prefix: &str, tag: &str) -> TempState {
        let dir = std::env::temp_dir().join(format!("{prefix}-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempState(dir.join("state.json"))
    }
}

impl std::ops::Deref for TempState {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for TempState {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempState {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
