//! The phub-control daemon: the HTTP API of `phub_proto::api`, admission,
//! rendezvous, the state file and the reconcile loop.
//!
//! Threads: a few HTTP handler threads (tiny_http) and one reconcile thread.
//! The jobs live behind one mutex that is never held across an HTTP call to
//! the dataplane. Calls that change the dataplane's set of jobs (admission,
//! eviction, reconcile) take a second lock for their whole duration, so
//! they never interleave: an evicted job cannot be reinstalled behind the
//! eviction's back, and a job is recorded only after the dataplane installed
//! it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use phub_proto::api::{
    AdmitResponse, ApiError, CheckpointInfo, DataplaneInfo, DataplaneStats, InstallJob, JobDetail, JobMap,
    JobSummary, JoinRequest, JoinResponse, KeyMap, LcoreShare, RankStatus, Stats,
};
use phub_proto::checkpoint::Checkpoint;
use phub_proto::layout::job_bytes;
use phub_proto::spec::{JobSpec, SpecError};
use serde::Serialize;

use crate::admission::{self, bytes_per_lcore, AdmitError};
use crate::dataplane::{Client, DataplaneError};
use crate::metrics;
use crate::state::{self, StateError, StoredJob};

/// Largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 16 << 20;
/// HTTP handler threads.
const HANDLERS: usize = 4;
/// How often idle handler threads look at the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// How the daemon runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Address the HTTP API listens on; port 0 picks a free one.
    pub listen: SocketAddr,
    /// Base URL of the dataplane's management API.
    pub dataplane: String,
    /// The state file.
    pub state: PathBuf,
    /// How often the dataplane's jobs are compared with the admitted ones.
    pub reconcile_interval: Duration,
    /// The operator token file (default: the state file's path with
    /// `.operator-token` appended). Created with a random token, readable by
    /// its owner only, when missing.
    pub operator_token: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 7700)),
            dataplane: "http://127.0.0.1:7800".into(),
            state: PathBuf::from("phub-control.state.json"),
            reconcile_interval: Duration::from_secs(2),
            operator_token: None,
        }
    }
}

impl Config {
    /// Where the operator token lives.
    pub fn operator_token_path(&self) -> PathBuf {
        self.operator_token
            .clone()
            .unwrap_or_else(|| default_token_path(&self.state))
    }
}

/// The operator token file that goes with a state file.
pub fn default_token_path(state: &std::path::Path) -> PathBuf {
    state::sibling(state, ".operator-token")
}

/// Reads the operator token, or creates the file with a new random one
/// (mode 0600, created exclusively so a racing start cannot clobber it).
fn load_or_create_token(path: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    match std::fs::read_to_string(path) {
        Ok(t) => {
            let t = t.trim().to_string();
            anyhow::ensure!(
                t.len() >= 16 && t.chars().all(|c| c.is_ascii_graphic()),
                "the operator token in {} must be at least 16 printable characters",
                path.display()
            );
            Ok(t)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let token: String = (0..4).map(|_| format!("{:08x}", rand::random::<u32>())).collect();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("creating the operator token file {}", path.display()))?;
            f.write_all(token.as_bytes())
                .and_then(|()| f.write_all(b"\n"))
                .and_then(|()| f.sync_all())
                .with_context(|| format!("writing {}", path.display()))?;
            log::info!("generated the operator token in {} (owner-only)", path.display());
            Ok(token)
        }
        Err(e) => Err(e).with_context(|| format!("reading the operator token file {}", path.display())),
    }
}

/// phub-control: admits jobs, maps chunks to lcores, answers workers.
#[derive(Debug, Parser)]
#[command(name = "phub-control", version)]
struct Args {
    /// Address the HTTP API listens on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// Base URL of the dataplane's management API.
    #[arg(long, default_value = "http://127.0.0.1:7800")]
    dataplane: String,
    /// The state file (admitted jobs), written atomically after every change.
    #[arg(long, default_value = "phub-control.state.json")]
    state: PathBuf,
    /// Milliseconds between reconciliations with the dataplane.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    reconcile_ms: u64,
    /// Operator token file (admission, eviction and checkpoints need the
    /// token); default: the state file's path + `.operator-token`.
    #[arg(long)]
    operator_token_file: Option<PathBuf>,
}

/// Entry point of the `phub-control` binary: parses flags, runs until
/// SIGINT or SIGTERM, then shuts down cleanly.
pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args = Args::parse();
    let config = Config {
        listen: args.listen,
        dataplane: args.dataplane,
        state: args.state,
        reconcile_interval: Duration::from_millis(args.reconcile_ms),
        operator_token: args.operator_token_file,
    };
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("phub-control: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: Config) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("cannot install the SIGINT/SIGTERM handler")?;
    let daemon = Daemon::start(config)?;
    let _ = rx.recv();
    log::info!("signal received; shutting down");
    daemon.shutdown();
    log::info!("phub-control stopped");
    Ok(())
}

/// A running daemon: HTTP threads and the reconcile thread.
pub struct Daemon {
    // Held for the daemon's life: no second phub-control on this state file.
    _state_lock: state::StateLock,
    operator_token: String,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    // Dropping the sender wakes the reconcile thread, which then exits.
    reconcile_wake: Option<mpsc::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the operator token.
        f.debug_struct("Daemon")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Daemon {
    /// Loads the state file (an error if it exists but cannot be read or
    /// parsed), binds the API and starts the threads. The first
    /// reconciliation with the dataplane runs at once, in the background.
    pub fn start(config: Config) -> anyhow::Result<Daemon> {
        let state_lock = state::lock(&config.state)?;
        let loaded = state::load(&config.state)?.unwrap_or_default();
        let token_path = config.operator_token_path();
        let operator_token = load_or_create_token(&token_path)?;
        let jobs: BTreeMap<u16, StoredJob> = loaded.jobs.into_iter().map(|j| (j.id, j)).collect();
        let server = tiny_http::Server::http(config.listen)
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.listen))?;
        let addr = server
            .server_addr()
            .to_ip()
            .context("the HTTP server is not bound to an IP address")?;
        let server = Arc::new(server);
        log::info!(
            "phub-control listening on http://{addr}; dataplane {}; state {} ({} jobs)",
            config.dataplane,
            config.state.display(),
            jobs.len()
        );
        let shared = Arc::new(Shared {
            dp: Client::new(&config.dataplane),
            state_path: config.state.clone(),
            interval: config.reconcile_interval,
            operator_token,
            token_path: token_path.clone(),
            inner: Mutex::new(Inner {
                checkpoints: load_checkpoints(&config.state, &jobs),
                jobs,
                info: None,
            }),
            ops: Mutex::new(()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for i in 0..HANDLERS {
            let (server, shared, stop) = (server.clone(), shared.clone(), stop.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("control-http-{i}"))
                    .spawn(move || serve(&server, &shared, &stop))
                    .context("cannot start an HTTP thread")?,
            );
        }
        let (wake, sleep) = mpsc::channel::<()>();
        let rs = shared.clone();
        threads.push(
            std::thread::Builder::new()
                .name("control-reconcile".into())
                .spawn(move || {
                    let mut log = ReconcileLog::default();
                    loop {
                        rs.reconcile(&mut log);
                        rs.periodic_checkpoints();
                        match sleep.recv_timeout(rs.interval) {
                            Err(mpsc::RecvTimeoutError::Timeout) => {}
                            _ => break,
                        }
                    }
                })
                .context("cannot start the reconcile thread")?,
        );
        Ok(Daemon {
            _state_lock: state_lock,
            operator_token: shared.operator_token.clone(),
            addr,
            stop,
            reconcile_wake: Some(wake),
            threads,
        })
    }

    /// The address the API is bound to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The operator token (for in-process users such as tests and tools).
    pub fn operator_token(&self) -> &str {
        &self.operator_token
    }

    /// Stops the threads and waits for them; requests in progress finish.
    pub fn shutdown(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.reconcile_wake.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

fn serve(server: &tiny_http::Server, shared: &Shared, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        match server.recv_timeout(POLL) {
            Ok(Some(req)) => shared.handle(req),
            Ok(None) => {}
            Err(e) => {
                log::warn!("HTTP server: {e}");
                std::thread::sleep(POLL);
            }
        }
    }
}

/// Why a request failed; each variant has its HTTP status.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    /// Malformed body, bad id, invalid spec: 400.
    #[error("{0}")]
    BadRequest(String),
    /// No operator token: 401.
    #[error("{0}")]
    Unauthorized(String),
    /// Wrong token: 403.
    #[error("{0}")]
    Forbidden(String),
    /// Unknown job or route: 404.
    #[error("{0}")]
    NotFound(String),
    /// Known path, wrong method: 405.
    #[error("method {method} is not allowed on {path}; allowed: {allowed}")]
    Method {
        /// The method used.
        method: String,
        /// The path.
        path: String,
        /// The methods the path takes.
        allowed: &'static str,
    },
    /// Duplicate rank: 409.
    #[error("{0}")]
    Conflict(String),
    /// Body over [`MAX_BODY_BYTES`]: 413.
    #[error("request body is larger than the limit of {} bytes", MAX_BODY_BYTES)]
    TooLarge,
    /// The job does not fit: 507.
    #[error(transparent)]
    Capacity(#[from] AdmitError),
    /// The dataplane is unreachable or refused: 502.
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    /// The state file could not be written: 500.
    #[error("{0}")]
    State(String),
}

impl RequestError {
    fn status(&self) -> u16 {
        match self {
            RequestError::BadRequest(_) => 400,
            RequestError::Unauthorized(_) => 401,
            RequestError::Forbidden(_) => 403,
            RequestError::NotFound(_) => 404,
            RequestError::Method { .. } => 405,
            RequestError::Conflict(_) => 409,
            RequestError::TooLarge => 413,
            RequestError::Capacity(_) => 507,
            RequestError::Dataplane(_) => 502,
            RequestError::State(_) => 500,
        }
    }
}

impl From<SpecError> for RequestError {
    fn from(e: SpecError) -> RequestError {
        RequestError::BadRequest(e.to_string())
    }
}

/// An answer ready to send.
struct Reply {
    status: u16,
    content_type: &'static str,
    body: Vec<u8>,
}

impl Reply {
    fn json<T: Serialize>(status: u16, body: &T) -> Reply {
        let mut body = serde_json::to_vec(body).expect("API types serialise");
        body.push(b'\n');
        Reply {
            status,
            content_type: "application/json",
            body,
        }
    }
}

/// What the lock guards.
#[derive(Debug)]
struct Inner {
    /// Admitted jobs by id.
    jobs: BTreeMap<u16, StoredJob>,
    /// The dataplane's last answer to `GET /v1/info`.
    info: Option<DataplaneInfo>,
    /// Each job's last checkpoint (its file is beside the state file).
    checkpoints: BTreeMap<u16, CheckpointInfo>,
}

/// What the reconcile thread remembers to log each problem once.
#[derive(Debug, Default)]
struct ReconcileLog {
    down: bool,
    failed: BTreeSet<u16>,
}

struct Shared {
    dp: Client,
    /// Admission, eviction and checkpoints need it (`Authorization: Bearer`).
    operator_token: String,
    token_path: PathBuf,
    state_path: PathBuf,
    interval: Duration,
    inner: Mutex<Inner>,
    /// Held across every call that changes the dataplane's set of jobs.
    ops: Mutex<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the operator token.
        f.debug_struct("Shared")
            .field("dp", &self.dp)
            .field("state_path", &self.state_path)
            .finish_non_exhaustive()
    }
}

fn summary(job: &StoredJob, installed: bool) -> JobSummary {
    JobSummary {
        id: job.id,
        name: job.spec.name.clone(),
        workers: job.spec.workers,
        joined: job.joined.iter().copied().collect(),
        keys: job.spec.keys.len(),
        chunks: job.layout.chunk_count() as u64,
        dtype: job.spec.dtype.name().to_string(),
        optimizer: job.spec.optimizer.name().to_string(),
        memory_bytes: job_bytes(&job.spec),
        installed,
    }
}

/// A job id as control writes them: decimal digits, no sign, no leading
/// zero ("+1" and "01" name no job).
fn parse_id(s: &str) -> Result<u16, RequestError> {
    let canonical = !s.starts_with('0') && s.bytes().all(|b| b.is_ascii_digit());
    match s.parse::<u16>() {
        Ok(id) if id > 0 && canonical => Ok(id),
        _ => Err(RequestError::BadRequest(format!(
            "job id {s:?} is not an integer from 1 to 65535"
        ))),
    }
}

fn not_admitted(id: u16) -> RequestError {
    RequestError::NotFound(format!("job {id} is not admitted"))
}

fn read_body(req: &mut tiny_http::Request) -> Result<String, RequestError> {
    if req.body_length().is_some_and(|n| n > MAX_BODY_BYTES) {
        return Err(RequestError::TooLarge);
    }
    let mut buf = Vec::new();
    req.as_reader()
        .take(MAX_BODY_BYTES as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| RequestError::BadRequest(format!("cannot read the request body: {e}")))?;
    if buf.len() > MAX_BODY_BYTES {
        return Err(RequestError::TooLarge);
    }
    String::from_utf8(buf).map_err(|e| RequestError::BadRequest(format!("request body is not UTF-8: {e}")))
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A handler that panicked cannot have left the map half-changed:
        // every change is one insert or remove.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn persist(&self, inner: &Inner) -> Result<(), StateError> {
        let jobs: Vec<&StoredJob> = inner.jobs.values().collect();
        state::save(&self.state_path, &jobs)
    }

    fn handle(&self, mut req: tiny_http::Request) {
        let method = req.method().as_str().to_ascii_uppercase();
        let url = req.url().to_string();
        let path = url.split('?').next().unwrap_or("");
        let reply = match self.route(&method, path, &mut req) {
            Ok(r) => r,
            Err(e) => Reply::json(e.status(), &ApiError { error: e.to_string() }),
        };
        let header = tiny_http::Header::from_bytes("Content-Type", reply.content_type)
            .expect("static header is valid");
        let resp = tiny_http::Response::from_data(reply.body)
            .with_status_code(reply.status)
            .with_header(header);
        if let Err(e) = req.respond(resp) {
            log::debug!("answering {method} {path}: {e}");
        }
    }

    fn route(&self, method: &str, path: &str, req: &mut tiny_http::Request) -> Result<Reply, RequestError> {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let wrong = |allowed| RequestError::Method {
            method: method.to_string(),
            path: path.to_string(),
            allowed,
        };
        let needs_operator = matches!(
            (method, segs.as_slice()),
            ("POST", ["v1", "jobs"])
                | ("DELETE", ["v1", "jobs", _])
                | ("POST", ["v1", "jobs", _, "checkpoint"])
        );
        if needs_operator {
            self.check_operator(req)?;
        }
        match segs.as_slice() {
            ["v1", "jobs"] => match method {
                "GET" => Ok(Reply::json(200, &self.list())),
                "POST" => {
                    let content_type = req
                        .headers()
                        .iter()
                        .find(|h| h.field.equiv("Content-Type"))
                        .map(|h| h.value.as_str().to_string());
                    let body = read_body(req)?;
                    Ok(Reply::json(201, &self.admit(&body, content_type.as_deref())?))
                }
                _ => Err(wrong("GET, POST")),
            },
            ["v1", "jobs", id] => match method {
                "GET" => Ok(Reply::json(200, &self.show(parse_id(id)?)?)),
                "DELETE" => Ok(Reply::json(200, &self.evict(parse_id(id)?)?)),
                _ => Err(wrong("GET, DELETE")),
            },
            ["v1", "jobs", id, "checkpoint"] => match method {
                "POST" => Ok(Reply::json(200, &self.checkpoint(parse_id(id)?)?)),
                _ => Err(wrong("POST")),
            },
            ["v1", "jobs", id, "map"] => match method {
                "GET" => Ok(Reply::json(200, &self.map(parse_id(id)?)?)),
                _ => Err(wrong("GET")),
            },
            ["v1", "jobs", id, "join"] => match method {
                "POST" => {
                    let id = parse_id(id)?;
                    let body = read_body(req)?;
                    Ok(Reply::json(200, &self.join(id, &body)?))
                }
                _ => Err(wrong("POST")),
            },
            ["v1", "stats"] => match method {
                "GET" => Ok(Reply::json(200, &self.stats())),
                _ => Err(wrong("GET")),
            },
            ["metrics"] => match method {
                "GET" => Ok(Reply {
                    status: 200,
                    content_type: metrics::CONTENT_TYPE,
                    body: self.metrics().into_bytes(),
                }),
                _ => Err(wrong("GET")),
            },
            _ => Err(RequestError::NotFound(format!(
                "no route for {method} {path}; see the route table in phub_proto::api"
            ))),
        }
    }

    /// Checks the `Authorization: Bearer` header against the operator token.
    fn check_operator(&self, req: &tiny_http::Request) -> Result<(), RequestError> {
        let given = req
            .headers()
            .iter()
            .find(|h| h.field.equiv("Authorization"))
            .map(|h| h.value.as_str().trim().to_string());
        let Some(given) = given else {
            return Err(RequestError::Unauthorized(format!(
                "this request needs the operator token: send `Authorization: Bearer <token>`; \
                 phub-control keeps it in {} (readable by its owner only)",
                self.token_path.display()
            )));
        };
        let token = match given.strip_prefix("Bearer ") {
            Some(t) if !t.trim().is_empty() => t.trim(),
            _ => {
                return Err(RequestError::Unauthorized(
                    "the Authorization header must be `Bearer <operator token>`".into(),
                ))
            }
        };
        // Compare without an early exit, so timing says nothing of the token.
        let (a, b) = (token.as_bytes(), self.operator_token.as_bytes());
        let diff = a
            .iter()
            .zip(b)
            .fold(a.len() ^ b.len(), |d, (x, y)| d | usize::from(x ^ y));
        if diff != 0 {
            return Err(RequestError::Forbidden("wrong operator token".into()));
        }
        Ok(())
    }

    /// The cached dataplane info, or a fresh one.
    fn info(&self) -> Result<DataplaneInfo, DataplaneError> {
        if let Some(i) = self.lock().info.clone() {
            return Ok(i);
        }
        let info = self.dp.info()?;
        self.lock().info = Some(info.clone());
        Ok(info)
    }

    fn admit(&self, body: &str, content_type: Option<&str>) -> Result<AdmitResponse, RequestError> {
        let spec = JobSpec::parse(body, content_type)?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let info = self.dp.info()?;
        // Ids the dataplane holds without control knowing them (a lost state
        // file) are skipped rather than clashed with.
        let foreign: BTreeSet<u16> = self.dp.jobs()?.into_iter().map(|j| j.id).collect();
        let (id, plan) = {
            let mut inner = self.lock();
            inner.info = Some(info.clone());
            let plan = admission::plan(&spec, &info, inner.jobs.values().map(|j| (&j.spec, &j.layout)))?;
            let id = admission::free_id(|id| inner.jobs.contains_key(&id) || foreign.contains(&id))?;
            (id, plan)
        };
        let token = loop {
            let t: u64 = rand::random();
            if t != 0 {
                break t;
            }
        };
        let install = InstallJob {
            id,
            token,
            spec,
            layout: plan.layout,
        };
        if let Err(e) = self.dp.install(&install) {
            if e.is_unreachable() {
                // The PUT may have landed before the connection broke.
                let _ = self.dp.remove(id);
            }
            log::warn!("job {:?} not admitted: {e}", install.spec.name);
            return Err(e.into());
        }
        let InstallJob {
            id,
            token,
            spec,
            layout,
        } = install;
        let name = spec.name.clone();
        let chunks = layout.chunk_count() as u64;
        let mut inner = self.lock();
        inner.jobs.insert(
            id,
            StoredJob {
                id,
                token,
                spec,
                layout,
                joined: BTreeSet::new(),
            },
        );
        if let Err(e) = self.persist(&inner) {
            inner.jobs.remove(&id);
            drop(inner);
            let _ = self.dp.remove(id);
            log::error!("job {name:?} not admitted: {e}");
            return Err(RequestError::State(format!("{e}; the job was not admitted")));
        }
        drop(inner);
        log::info!(
            "admitted job {id} ({name:?}): {chunks} chunks, {} bytes over lcores {:?}",
            plan.memory_bytes,
            plan.lcores
        );
        Ok(AdmitResponse {
            id,
            token,
            chunks,
            memory_bytes: plan.memory_bytes,
            lcores: plan.lcores,
        })
    }

    fn check_join(inner: &Inner, id: u16, req: &JoinRequest) -> Result<(), RequestError> {
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        if job.token != req.token {
            return Err(RequestError::Forbidden(format!("wrong token for job {id}")));
        }
        let w = job.spec.workers;
        if u32::from(req.rank) >= w {
            return Err(RequestError::BadRequest(format!(
                "rank {} is outside 0..={} for job {id} (workers = {w})",
                req.rank,
                w - 1
            )));
        }
        if job.joined.contains(&req.rank) && !req.rejoin {
            return Err(RequestError::Conflict(format!(
                "rank {} has already joined job {id} (a restarted worker rejoins with \"rejoin\": true)",
                req.rank
            )));
        }
        Ok(())
    }

    fn join(&self, id: u16, body: &str) -> Result<JoinResponse, RequestError> {
        let req: JoinRequest = serde_json::from_str(body).map_err(|e| {
            RequestError::BadRequest(format!(
                "invalid join request: {e}; expected {{\"token\": \"<16 hex digits>\", \"rank\": <rank>}}"
            ))
        })?;
        Self::check_join(&self.lock(), id, &req)?;
        let info = self.info()?;
        let mut inner = self.lock();
        // Checked again: the job may have gone or the rank joined meanwhile.
        Self::check_join(&inner, id, &req)?;
        let job = inner.jobs.get_mut(&id).ok_or_else(|| not_admitted(id))?;
        job.joined.insert(req.rank);
        let answer = JoinResponse {
            job: id,
            rank: req.rank,
            spec: job.spec.clone(),
            layout: job.layout.clone(),
            dataplane: info.data,
        };
        if let Err(e) = self.persist(&inner) {
            if let Some(job) = inner.jobs.get_mut(&id) {
                job.joined.remove(&req.rank);
            }
            log::error!("rank {} could not join job {id}: {e}", req.rank);
            return Err(RequestError::State(format!("{e}; the rank has not joined")));
        }
        let how = if req.rejoin { "rejoined" } else { "joined" };
        log::info!("rank {} {how} job {id} ({:?})", req.rank, answer.spec.name);
        Ok(answer)
    }

    fn list(&self) -> Vec<JobSummary> {
        let installed: BTreeSet<u16> = self
            .dp
            .jobs()
            .map(|j| j.into_iter().map(|j| j.id).collect())
            .unwrap_or_default();
        self.lock()
            .jobs
            .values()
            .map(|j| summary(j, installed.contains(&j.id)))
            .collect()
    }

    fn show(&self, id: u16) -> Result<JobDetail, RequestError> {
        if !self.lock().jobs.contains_key(&id) {
            return Err(not_admitted(id));
        }
        let stats = self.dp.stats().ok();
        let live = stats.as_ref().and_then(|s| s.jobs.iter().find(|j| j.id == id));
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        // Cast: r < workers <= MAX_WORKERS (256), checked by JobSpec::validate
        // on admission and on loading the state file.
        #[allow(clippy::cast_possible_truncation)]
        let ranks = (0..job.spec.workers)
            .map(|r| {
                let rank = r as u16;
                RankStatus {
                    rank,
                    joined: job.joined.contains(&rank),
                    silent_ms: live.and_then(|l| l.silent_ms.get(r as usize).copied().flatten()),
                }
            })
            .collect();
        Ok(JobDetail {
            summary: summary(job, live.is_some()),
            spec: job.spec.clone(),
            ranks,
            rounds_completed: live.map_or(0, |l| l.rounds_completed),
            round_range: live.and_then(|l| l.round_range),
            checkpoint: inner.checkpoints.get(&id).cloned(),
        })
    }

    /// Evicts a job: durable first (the state file without it is written,
    /// or nothing changes and the error says why), then the dataplane is
    /// told. A dataplane that cannot be told now (down, refusing) keeps the
    /// job until reconciliation removes it, as it removes every job control
    /// has not admitted.
    fn evict(&self, id: u16) -> Result<JobSummary, RequestError> {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        let job = inner.jobs.remove(&id).ok_or_else(|| not_admitted(id))?;
        if let Err(e) = self.persist(&inner) {
            inner.jobs.insert(id, job);
            log::error!("job {id} not evicted: {e}");
            return Err(RequestError::State(format!("job {id} not evicted: {e}")));
        }
        let checkpoint = inner.checkpoints.remove(&id).is_some();
        drop(inner);
        if checkpoint {
            let path = checkpoint_path(&self.state_path, id);
            if let Err(e) = std::fs::remove_file(&path) {
                log::warn!(
                    "job {id} evicted, but its checkpoint {} stays: {e}",
                    path.display()
                );
            }
        }
        if let Err(e) = self.dp.remove(id) {
            log::warn!(
                "job {id} evicted; the dataplane could not be told ({e}): reconciliation removes it there"
            );
        }
        log::info!("evicted job {id} ({:?})", job.spec.name);
        Ok(summary(&job, false))
    }

    fn map(&self, id: u16) -> Result<JobMap, RequestError> {
        if !self.lock().jobs.contains_key(&id) {
            return Err(not_admitted(id));
        }
        let info = self.info()?;
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        let bytes = bytes_per_lcore(&job.spec, &job.layout);
        // Cast: i < the layout's lcore count, at most admission::MAX_LCORES
        // (2^16, checked by admission::plan and on loading the state file);
        // slots on one lcore stay far below 2^32 (see phub_proto::layout).
        #[allow(clippy::cast_possible_truncation)]
        let lcores = job
            .layout
            .lcores
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .map(|(i, s)| LcoreShare {
                lcore: i as u16,
                port: info.data.base_port.wrapping_add(i as u16),
                slots: s.len() as u32,
                bytes: bytes[i],
            })
            .collect();
        // Cast: k < MAX_KEYS (2^20), checked by JobSpec::validate.
        #[allow(clippy::cast_possible_truncation)]
        let keys = job
            .spec
            .keys
            .iter()
            .zip(&job.layout.keys)
            .enumerate()
            .map(|(k, (spec, places))| KeyMap {
                key: k as u32,
                name: spec.name.clone(),
                elements: spec.elements,
                chunks: places.clone(),
            })
            .collect();
        Ok(JobMap {
            id,
            chunk_elems: job.layout.chunk_elems,
            lcores,
            keys,
        })
    }

    fn summaries_with(&self, stats: Option<&DataplaneStats>) -> Vec<JobSummary> {
        let installed: BTreeSet<u16> = stats
            .map(|s| s.jobs.iter().map(|j| j.id).collect())
            .unwrap_or_default();
        self.lock()
            .jobs
            .values()
            .map(|j| summary(j, installed.contains(&j.id)))
            .collect()
    }

    fn stats(&self) -> Stats {
        let (dataplane, dataplane_error) = match self.dp.stats() {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let jobs = self.summaries_with(dataplane.as_ref());
        Stats {
            dataplane,
            dataplane_error,
            jobs,
        }
    }

    fn metrics(&self) -> String {
        let stats = self.dp.stats().ok();
        let jobs = self.summaries_with(stats.as_ref());
        metrics::render(stats.as_ref(), &jobs)
    }

    /// Takes a checkpoint of `id` from the dataplane and keeps it (atomically
    /// replacing the previous one) beside the state file.
    fn checkpoint(&self, id: u16) -> Result<CheckpointInfo, RequestError> {
        if !self.lock().jobs.contains_key(&id) {
            return Err(not_admitted(id));
        }
        let bytes = self.dp.checkpoint(id)?;
        let ckpt = Checkpoint::decode(&bytes).map_err(|e| {
            RequestError::State(format!(
                "the dataplane's checkpoint of job {id} is unreadable: {e}"
            ))
        })?;
        let path = checkpoint_path(&self.state_path, id);
        state::write_atomic(&path, &bytes).map_err(|e| RequestError::State(e.to_string()))?;
        let info = CheckpointInfo {
            id,
            round_range: ckpt.round_range(),
            bytes: bytes.len() as u64,
            taken_unix_ms: unix_ms(),
            file: path.display().to_string(),
        };
        let mut inner = self.lock();
        if inner.jobs.contains_key(&id) {
            inner.checkpoints.insert(id, info.clone());
        } else {
            // Evicted meanwhile: the file must not outlive the job.
            let _ = std::fs::remove_file(&path);
            return Err(not_admitted(id));
        }
        log::info!(
            "checkpoint of job {id}: rounds {:?}, {} bytes",
            info.round_range,
            info.bytes
        );
        Ok(info)
    }

    /// Checkpoints every job whose spec asks for it and whose last
    /// checkpoint is older than its interval.
    fn periodic_checkpoints(&self) {
        let now = unix_ms();
        let due: Vec<u16> = {
            let inner = self.lock();
            inner
                .jobs
                .values()
                .filter(|j| {
                    j.spec.checkpoint_interval_s.is_some_and(|s| {
                        let last = inner.checkpoints.get(&j.id).map_or(0, |c| c.taken_unix_ms);
                        now.saturating_sub(last) >= u64::from(s) * 1000
                    })
                })
                .map(|j| j.id)
                .collect()
        };
        for id in due {
            if let Err(e) = self.checkpoint(id) {
                log::warn!("periodic checkpoint of job {id}: {e}");
            }
        }
    }

    /// Reinstalls every admitted job the dataplane lacks.
    fn reconcile(&self, log: &mut ReconcileLog) {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let installed: BTreeSet<u16> = match self.dp.jobs() {
            Ok(j) => {
                if log.down {
                    log::info!("the dataplane at {} answers again", self.dp.base());
                    log.down = false;
                }
                j.into_iter().map(|j| j.id).collect()
            }
            Err(e) => {
                if !log.down {
                    log::warn!("{e}; retrying every {:?}", self.interval);
                    log.down = true;
                }
                return;
            }
        };
        // Jobs the dataplane holds that control has not admitted (evicted
        // while it was down, or installed by someone else) are removed.
        let unknown: Vec<u16> = {
            let inner = self.lock();
            installed
                .iter()
                .copied()
                .filter(|id| !inner.jobs.contains_key(id))
                .collect()
        };
        for id in unknown {
            match self.dp.remove(id) {
                Ok(_) => {
                    log::warn!("job {id} was installed on the dataplane but is not admitted here: removed")
                }
                Err(e) => log::warn!(
                    "job {id} is installed on the dataplane but not admitted here; removing it: {e}"
                ),
            }
        }
        let missing: Vec<InstallJob> = self
            .lock()
            .jobs
            .values()
            .filter(|j| !installed.contains(&j.id))
            .map(|j| InstallJob {
                id: j.id,
                token: j.token,
                spec: j.spec.clone(),
                layout: j.layout.clone(),
            })
            .collect();
        log.failed.retain(|id| !installed.contains(id));
        if missing.is_empty() {
            return;
        }
        // The dataplane restarted: its settings may have changed.
        if let Ok(info) = self.dp.info() {
            self.lock().info = Some(info);
        }
        for job in missing {
            let path = checkpoint_path(&self.state_path, job.id);
            let saved = self.lock().checkpoints.get(&job.id).cloned();
            let result = match saved.as_ref().map(|_| std::fs::read(&path)) {
                Some(Ok(bytes)) => self.dp.restore(job.id, &bytes),
                Some(Err(e)) => {
                    log::error!(
                        "job {}: cannot read its checkpoint {}: {e}",
                        job.id,
                        path.display()
                    );
                    self.dp.install(&job)
                }
                None => self.dp.install(&job),
            };
            match result {
                Ok(()) => {
                    match saved {
                        Some(c) => log::info!(
                            "reinstalled job {} ({:?}), which the dataplane had lost, from its checkpoint \
                             (rounds {:?})",
                            job.id,
                            job.spec.name,
                            c.round_range
                        ),
                        None => log::info!(
                            "reinstalled job {} ({:?}), which the dataplane had lost (no checkpoint: \
                             its parameters start over)",
                            job.id,
                            job.spec.name
                        ),
                    }
                    log.failed.remove(&job.id);
                }
                Err(e) => {
                    if log.failed.insert(job.id) {
                        log::warn!("cannot reinstall job {}: {e}; retrying", job.id);
                    }
                }
            }
        }
    }
}

/// Where control keeps job `id`'s checkpoint: beside the state file.
fn checkpoint_path(state: &std::path::Path, id: u16) -> PathBuf {
    state::sibling(state, &format!(".job-{id}.ckpt"))
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The checkpoints found beside the state file for the admitted jobs.
fn load_checkpoints(
    state: &std::path::Path,
    jobs: &BTreeMap<u16, StoredJob>,
) -> BTreeMap<u16, CheckpointInfo> {
    let mut out = BTreeMap::new();
    for &id in jobs.keys() {
        let path = checkpoint_path(state, id);
        let Ok(bytes) = std::fs::read(&path) else { continue };
        match Checkpoint::decode(&bytes) {
            Ok(c) => {
                let taken = std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                out.insert(
                    id,
                    CheckpointInfo {
                        id,
                        round_range: c.round_range(),
                        bytes: bytes.len() as u64,
                        taken_unix_ms: taken,
                        file: path.display().to_string(),
                    },
                );
            }
            Err(e) => log::error!("ignoring the checkpoint {} of job {id}: {e}", path.display()),
        }
    }
    out
}
