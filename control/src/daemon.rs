//! The phub-control daemon: the HTTP API of `phub_proto::api`, admission,
//! rendezvous, the state file and the reconcile loop.
//!
//! Threads: the HTTP listener (phub-http: bounded connections, header and
//! body limits, timeouts, TLS) with its handler pool, and one reconcile
//! thread.
//! The jobs live behind one mutex that is never held across an HTTP call to
//! the dataplane. Calls that change the dataplane's set of jobs (admission,
//! eviction, reconcile) take a second lock for their whole duration, so
//! they never interleave: an evicted job cannot be reinstalled behind the
//! eviction's back, and a job is recorded only after the dataplane installed
//! it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use phub_proto::api::{
    AdmitResponse, CheckpointInfo, DataplaneInfo, DataplaneStats, InstallJob, JobDetail, JobMap, JobSummary,
    JoinRequest, JoinResponse, KeyMap, KeyRun, LcoreShare, RankStatus, Stats, DETAIL_KEYS,
};
use phub_proto::checkpoint::Checkpoint;
use phub_proto::layout::Placement;
use phub_proto::memory::MemoryModel;
use phub_proto::spec::{JobSpec, SpecError};
use serde::Serialize;

use crate::admission::{self, AdmitError};
use crate::dataplane::{Client, DataplaneError};
use crate::metrics;
use crate::refit::{self, Refit};
use crate::state::{self, StateError, StoredJob};

/// Largest job spec accepted by `POST /v1/jobs`, in bytes (a spec lists
/// every key: a 10^6-key spec is about 15 MB of TOML).
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// Largest body of any other request (a join), in bytes.
pub const MAX_SMALL_BODY_BYTES: usize = 64 << 10;

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
    /// The dataplane's management token file (default: the dataplane's
    /// default for the port of `dataplane`; see
    /// [`phub_http::secret::mgmt_token_path`]).
    pub dataplane_token: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain and private key.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Listen beyond loopback in clear text (refused without it).
    pub insecure_listen: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 7700)),
            dataplane: "http://127.0.0.1:7800".into(),
            state: PathBuf::from("phub-control.state.json"),
            reconcile_interval: Duration::from_secs(2),
            operator_token: None,
            dataplane_token: None,
            tls: None,
            insecure_listen: false,
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

    /// Where the dataplane's management token lives.
    pub fn dataplane_token_path(&self) -> PathBuf {
        self.dataplane_token.clone().unwrap_or_else(|| {
            // The port of the URL: what follows the host's last colon.
            let authority = self.dataplane.split("://").nth(1).unwrap_or(&self.dataplane);
            let authority = authority.split('/').next().unwrap_or(authority);
            let port = authority
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or(80);
            phub_http::secret::mgmt_token_path(port)
        })
    }
}

/// The operator token file that goes with a state file.
pub fn default_token_path(state: &std::path::Path) -> PathBuf {
    state::sibling(state, ".operator-token")
}

/// Reads the operator token, or creates the file with a new random one
/// (mode 0600, created exclusively so a racing start cannot clobber it).
fn load_or_create_token(path: &std::path::Path) -> anyhow::Result<String> {
    let (token, made) = phub_http::secret::load_or_create(path).context("the operator token file")?;
    if made {
        log::info!("generated the operator token in {} (owner-only)", path.display());
    }
    Ok(token)
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
    /// The dataplane's management token file (its --mgmt-token-file);
    /// default: the dataplane's default for the port of --dataplane.
    #[arg(long, value_name = "FILE")]
    dataplane_token_file: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Listen beyond loopback in clear text (tokens and job specs then
    /// cross the network unprotected). Without it, a non-loopback --listen
    /// needs --tls-cert and --tls-key.
    #[arg(long)]
    insecure_listen: bool,
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
        dataplane_token: args.dataplane_token_file,
        tls: args.tls_cert.zip(args.tls_key),
        insecure_listen: args.insecure_listen,
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

/// A running daemon: the HTTP listener and the reconcile thread.
pub struct Daemon {
    // Held for the daemon's life: no second phub-control on this state file.
    _state_lock: state::StateLock,
    operator_token: String,
    addr: SocketAddr,
    server: Option<phub_http::Server>,
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
        let tls = match &config.tls {
            Some((cert, key)) => Some(phub_http::server_config(cert, key)?),
            None if !phub_http::is_loopback(&config.listen) && !config.insecure_listen => anyhow::bail!(
                "refusing to listen on {} in clear text: give --tls-cert and --tls-key, or \
                 --insecure-listen to send tokens and specs unprotected",
                config.listen
            ),
            None => None,
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let shared = Arc::new(Shared {
            dp: Client::new(&config.dataplane, config.dataplane_token_path()),
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
        let limits = phub_http::Limits {
            body_bytes: MAX_BODY_BYTES,
            inflight_body_bytes: 4 * MAX_BODY_BYTES,
            ..phub_http::Limits::default()
        };
        let server = phub_http::Server::bind("control-http", config.listen, limits, tls, shared.clone())
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = server.local_addr();
        log::info!(
            "phub-control listening on {scheme}://{addr}; dataplane {}; state {} ({} jobs)",
            config.dataplane,
            config.state.display(),
            shared.lock().jobs.len()
        );
        let mut threads = Vec::new();
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
            server: Some(server),
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

    /// Stops the listener (requests in progress get its grace period, no
    /// client is waited for) and the reconcile thread.
    pub fn shutdown(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
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

/// What `job` costs on the dataplane `info` describes (the last one
/// control heard from), or by [`MemoryModel::default`]'s upper bounds
/// before it heard from one. O(keys + lcores).
fn memory_bytes(job: &StoredJob, info: Option<&DataplaneInfo>) -> u64 {
    match info {
        Some(info) => admission::cost(&job.spec, &job.layout, info).total(),
        None => MemoryModel::default()
            .job_cost(&job.spec, &job.layout, false)
            .total(),
    }
}

fn summary(job: &StoredJob, installed: bool, info: Option<&DataplaneInfo>) -> JobSummary {
    JobSummary {
        id: job.id,
        name: job.spec.name.clone(),
        workers: job.spec.workers,
        joined: job.joined.iter().copied().collect(),
        keys: job.spec.keys.len(),
        chunks: job.layout.chunk_count(),
        dtype: job.spec.dtype.name().to_string(),
        optimizer: job.spec.optimizer.name().to_string(),
        memory_bytes: memory_bytes(job, info),
        installed,
        failed: job.failed.clone(),
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

/// The answer to a join or checkpoint of a failed job: 409 with its reason.
fn failed(id: u16, why: &str) -> RequestError {
    RequestError::Conflict(format!("job {id} failed: {why}; evict it and admit again"))
}

fn body_text(req: &phub_http::Request) -> Result<&str, RequestError> {
    std::str::from_utf8(&req.body)
        .map_err(|e| RequestError::BadRequest(format!("request body is not UTF-8: {e}")))
}

/// The routes that need the operator token.
fn needs_operator(method: &str, segs: &[&str]) -> bool {
    matches!(
        (method, segs),
        ("POST", ["v1", "jobs"]) | ("DELETE", ["v1", "jobs", _]) | ("POST", ["v1", "jobs", _, "checkpoint"])
    )
}

fn segments(path: &str) -> Vec<&str> {
    path.trim_matches('/').split('/').collect()
}

fn error_response(e: &RequestError) -> phub_http::Response {
    let mut r = phub_http::Response::error(e.status(), e.to_string());
    if e.status() == 401 {
        r = r.with_header("WWW-Authenticate", "Bearer");
    }
    r
}

impl phub_http::Handler for Shared {
    fn check_head(&self, head: &phub_http::Request) -> Result<(), phub_http::Response> {
        if needs_operator(&head.method, &segments(&head.path)) {
            self.check_operator(head).map_err(|e| error_response(&e))?;
        }
        Ok(())
    }

    fn body_limit(&self, head: &phub_http::Request) -> usize {
        // Only the operator, checked above, may send a large body.
        if head.method == "POST" && segments(&head.path) == ["v1", "jobs"] {
            MAX_BODY_BYTES
        } else {
            MAX_SMALL_BODY_BYTES
        }
    }

    fn handle(&self, req: phub_http::Request) -> phub_http::Response {
        match self.route(&req) {
            Ok(r) => phub_http::Response::new(r.status, r.content_type, r.body),
            Err(e) => error_response(&e),
        }
    }
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

    fn route(&self, req: &phub_http::Request) -> Result<Reply, RequestError> {
        let (method, path) = (req.method.as_str(), req.path.as_str());
        let segs = segments(path);
        let wrong = |allowed| RequestError::Method {
            method: method.to_string(),
            path: path.to_string(),
            allowed,
        };
        // Checked before the body was read too ([`Handler::check_head`]);
        // again here so that no route depends on the listener for it.
        if needs_operator(method, &segs) {
            self.check_operator(req)?;
        }
        match segs.as_slice() {
            ["v1", "jobs"] => match method {
                "GET" => Ok(Reply::json(200, &self.list())),
                "POST" => {
                    let body = body_text(req)?;
                    Ok(Reply::json(201, &self.admit(body, req.header("Content-Type"))?))
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
                "GET" => Ok(Reply::json(200, &self.map(parse_id(id)?, None)?)),
                _ => Err(wrong("GET")),
            },
            ["v1", "jobs", id, "map", "keys", key] => match method {
                "GET" => {
                    let key = key.parse::<u32>().map_err(|_| {
                        RequestError::BadRequest(format!("key {key:?} is not a key index (0, 1, ...)"))
                    })?;
                    Ok(Reply::json(200, &self.map(parse_id(id)?, Some(key))?))
                }
                _ => Err(wrong("GET")),
            },
            ["v1", "jobs", id, "join"] => match method {
                "POST" => {
                    let id = parse_id(id)?;
                    let body = body_text(req)?;
                    Ok(Reply::json(200, &self.join(id, body)?))
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
    fn check_operator(&self, req: &phub_http::Request) -> Result<(), RequestError> {
        let Some(given) = req.header("Authorization") else {
            return Err(RequestError::Unauthorized(format!(
                "this request needs the operator token: send `Authorization: Bearer <token>`; \
                 phub-control keeps it in {} (readable by its owner only)",
                self.token_path.display()
            )));
        };
        let token = phub_http::bearer(Some(given)).map_err(|_| {
            RequestError::Unauthorized("the Authorization header must be `Bearer <operator token>`".into())
        })?;
        if !phub_http::token_matches(token, &self.operator_token) {
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
        let chunks = layout.chunk_count();
        let mut inner = self.lock();
        inner.jobs.insert(
            id,
            StoredJob {
                id,
                token,
                spec,
                layout,
                joined: BTreeSet::new(),
                failed: None,
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
            "admitted job {id} ({name:?}): {chunks} chunks, {} bytes ({} in shared memory) over lcores {:?}",
            plan.memory_bytes,
            plan.cost.shm,
            plan.lcores
        );
        Ok(AdmitResponse {
            id,
            token,
            chunks,
            memory_bytes: plan.memory_bytes,
            shm_bytes: plan.cost.shm,
            lcores: plan.lcores,
        })
    }

    fn check_join(inner: &Inner, id: u16, req: &JoinRequest) -> Result<(), RequestError> {
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        if job.token != req.token {
            return Err(RequestError::Forbidden(format!("wrong token for job {id}")));
        }
        if let Some(why) = &job.failed {
            return Err(failed(id, why));
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
        let inner = self.lock();
        inner
            .jobs
            .values()
            .map(|j| summary(j, installed.contains(&j.id), inner.info.as_ref()))
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
        };
        Ok(JobDetail {
            summary: summary(job, live.is_some(), inner.info.as_ref()),
            keys_omitted: (s.keys.len() - spec.keys.len()) as u64,
            spec,
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
        Ok(summary(&job, false, self.lock().info.as_ref()))
    }

    /// `GET /v1/jobs/{id}/map`, and with `key` `/map/keys/{key}`: per lcore
    /// its run and bytes, O(lcores); one key's chunks as runs, O(lcores).
    fn map(&self, id: u16, key: Option<u32>) -> Result<JobMap, RequestError> {
        if !self.lock().jobs.contains_key(&id) {
            return Err(not_admitted(id));
        }
        let info = self.info()?;
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        let cost = admission::cost(&job.spec, &job.layout, &info);
        // Cast: i < the layout's lcore count, at most admission::MAX_LCORES
        // (2^16, checked by admission::plan and on loading the state file).
        #[allow(clippy::cast_possible_truncation)]
        let lcores = job
            .layout
            .lcores
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.is_empty())
            .map(|(i, r)| LcoreShare {
                lcore: i as u16,
                port: info.data.base_port.wrapping_add(i as u16),
                first: r.first,
                slots: r.count,
                bytes: cost.lcores[i],
            })
            .collect();
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
                // Cast: lcores as above; a key's chunks, and so the chunk
                // and slot numbers within a run, are numbered by u32
                // (JobSpec::validate, Placement::new).
                #[allow(clippy::cast_possible_truncation)]
                let runs = job
                    .layout
                    .lcores
                    .iter()
                    .enumerate()
                    .filter_map(|(l, r)| {
                        let (a, b) = (seqs.start.max(r.first), seqs.end.min(r.first + r.count));
                        (a < b).then(|| KeyRun {
                            lcore: l as u16,
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
            memory_bytes: cost.total(),
            lcores,
            keys,
        })
    }

    fn summaries_with(&self, stats: Option<&DataplaneStats>) -> Vec<JobSummary> {
        let installed: BTreeSet<u16> = stats
            .map(|s| s.jobs.iter().map(|j| j.id).collect())
            .unwrap_or_default();
        let inner = self.lock();
        inner
            .jobs
            .values()
            .map(|j| summary(j, installed.contains(&j.id), inner.info.as_ref()))
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
        match self.lock().jobs.get(&id) {
            None => return Err(not_admitted(id)),
            Some(StoredJob {
                failed: Some(why), ..
            }) => return Err(failed(id, why)),
            Some(_) => {}
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
                    j.failed.is_none()
                        && j.spec.checkpoint_interval_s.is_some_and(|s| {
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

    /// Reinstalls every admitted job the dataplane lacks, fitted to the
    /// lcores it has now ([`Shared::refit`]), from its checkpoint when it
    /// has one; a job that cannot be placed on them, or whose install the
    /// dataplane refuses as invalid (HTTP 400), is marked failed instead of
    /// being retried for ever.
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
        let missing: Vec<u16> = self
            .lock()
            .jobs
            .values()
            .filter(|j| !installed.contains(&j.id) && j.failed.is_none())
            .map(|j| j.id)
            .collect();
        log.failed.retain(|id| !installed.contains(id));
        if missing.is_empty() {
            return;
        }
        // The dataplane restarted: its settings may have changed, and the
        // jobs are fitted to its lcores before they are installed.
        let info = match self.dp.info() {
            Ok(info) => {
                self.lock().info = Some(info.clone());
                info
            }
            Err(e) => {
                if !log.down {
                    log::warn!("{e}; retrying every {:?}", self.interval);
                    log.down = true;
                }
                return;
            }
        };
        for id in missing {
            let Some(job) = self.refit(id, &info) else {
                continue;
            };
            let saved = self.lock().checkpoints.get(&id).cloned();
            let restored = saved.as_ref().and_then(|_| self.checkpoint_for(&job));
            let result = match &restored {
                Some(bytes) => self.dp.restore(id, bytes),
                None => self.dp.install(&job),
            };
            match result {
                Ok(()) => {
                    match saved.filter(|_| restored.is_some()) {
                        Some(c) => log::info!(
                            "reinstalled job {id} ({:?}), which the dataplane had lost, from its checkpoint \
                             (rounds {:?})",
                            job.spec.name,
                            c.round_range
                        ),
                        None => log::info!(
                            "reinstalled job {id} ({:?}), which the dataplane had lost (no checkpoint: \
                             its parameters start over)",
                            job.spec.name
                        ),
                    }
                    log.failed.remove(&id);
                }
                // A refusal of the request itself does not change by
                // retrying, unless the dataplane restarted again meanwhile.
                Err(DataplaneError::Refused {
                    status: 400, message, ..
                }) if self
                    .dp
                    .info()
                    .is_ok_and(|now| now.lcores.len() == info.lcores.len()) =>
                {
                    self.fail(id, &format!("the dataplane refuses to install it: {message}"));
                }
                Err(e) => {
                    if log.failed.insert(id) {
                        log::warn!("cannot reinstall job {id}: {e}; retrying");
                    }
                }
            }
        }
    }

    /// Fits job `id` to the dataplane `info` describes before it is
    /// installed again ([`refit::refit`]): a new layout, or the job's
    /// failure, is made durable first. Returns what to install; `None` when
    /// the job failed, is gone, or its change could not be written (then
    /// nothing changed and the next reconciliation tries again).
    fn refit(&self, id: u16, info: &DataplaneInfo) -> Option<InstallJob> {
        let mut inner = self.lock();
        let job = inner.jobs.get(&id).filter(|j| j.failed.is_none())?;
        let others = inner
            .jobs
            .values()
            .filter(|j| j.id != id && j.failed.is_none())
            .map(|j| (&j.spec, &j.layout));
        let decision = refit::refit(&job.spec, &job.layout, info, others);
        let before = job.clone();
        let n = info.lcores.len();
        let job = inner.jobs.get_mut(&id)?;
        let what = match decision {
            Refit::AsIs => None,
            Refit::Resized(layout) => {
                job.layout = layout;
                Some(format!(
                    "its layout is sized for the dataplane's {n} lcores (its chunks stay where they were)"
                ))
            }
            Refit::Replaced(layout) => {
                job.layout = layout;
                job.joined.clear();
                Some(format!(
                    "the dataplane has {n} lcores, fewer than its layout used: its chunks are placed anew \
                     over them; its ranks must join again (with a stale layout they get an ERROR \
                     slot_out_of_range or chunk_mismatch, or time out on an lcore that is gone)"
                ))
            }
            Refit::Failed(why) => {
                job.failed = Some(why.clone());
                Some(why)
            }
        };
        let job = job.clone();
        if let Some(what) = what {
            if let Err(e) = self.persist(&inner) {
                inner.jobs.insert(id, before);
                log::error!("job {id}: {what}; but that cannot be recorded ({e}): retrying");
                return None;
            }
            if job.failed.is_some() {
                log::error!("job {id} ({:?}) failed: {what}", job.spec.name);
                return None;
            }
            log::warn!("job {id} ({:?}): {what}", job.spec.name);
        }
        Some(InstallJob {
            id,
            token: job.token,
            spec: job.spec,
            layout: job.layout,
        })
    }

    /// Marks job `id` failed for `why`, durably; if that cannot be written,
    /// nothing changes (the next reconciliation tries the job again).
    fn fail(&self, id: u16, why: &str) {
        let mut inner = self.lock();
        let Some(job) = inner.jobs.get_mut(&id) else {
            return;
        };
        job.failed = Some(why.to_string());
        let name = job.spec.name.clone();
        match self.persist(&inner) {
            Ok(()) => log::error!("job {id} ({name:?}) failed: {why}"),
            Err(e) => {
                if let Some(job) = inner.jobs.get_mut(&id) {
                    job.failed = None;
                }
                log::error!("job {id}: {why}; but its failure cannot be recorded ({e}): retrying");
            }
        }
    }

    /// The checkpoint to restore `job` from, moved onto the job's layout
    /// when it was taken on another (the job was placed anew since):
    /// `None`, logged, when it cannot be read, decoded or moved (the job is
    /// then installed without it, as when it has none).
    fn checkpoint_for(&self, job: &InstallJob) -> Option<Vec<u8>> {
        let path = checkpoint_path(&self.state_path, job.id);
        let unusable = |e: &dyn std::fmt::Display| {
            log::error!(
                "job {}: cannot restore its checkpoint {}: {e}; installing it without",
                job.id,
                path.display()
            );
        };
        let bytes = std::fs::read(&path).map_err(|e| unusable(&e)).ok()?;
        let ckpt = Checkpoint::decode(&bytes).map_err(|e| unusable(&e)).ok()?;
        if ckpt.job.layout == job.layout {
            return Some(bytes);
        }
        let moved = ckpt
            .relayout(job.layout.clone())
            .and_then(|c| c.encode())
            .map_err(|e| unusable(&e))
            .ok()?;
        log::info!(
            "job {}: its checkpoint is moved onto its new layout, chunk by chunk",
            job.id
        );
        Some(moved)
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
