//! The phub-control daemon: the HTTP API of `phub_proto::api`, admission,
//! rendezvous, the appliances, the state file and the reconcile loop.
//!
//! Threads: the HTTP listener (phub-http: bounded connections, header and
//! body limits, timeouts, TLS) with its handler pool, and one reconcile
//! thread.
//! Control manages a set of appliances (dataplanes), each with a name, a
//! rack label, a management client and its last description. A job lives on
//! one or several of them: its layout spans their lcores in order, and each
//! holds its part ([`parts`]). The appliances and jobs live behind one mutex
//! that is never held across an HTTP call to a dataplane. Calls that change
//! the dataplanes' sets of jobs or control's set of appliances (admission,
//! eviction, reconcile, appliance add and remove) take a second lock for
//! their whole duration, so they never interleave: an evicted job cannot be
//! reinstalled behind the eviction's back, and a job is recorded only after
//! every appliance of it installed its part.

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
    AdmitResponse, ApplianceAddr, ApplianceSpec, ApplianceStats, ApplianceStatus, CheckpointInfo, ClockStats,
    DataAddr, DataplaneInfo, DataplaneStats, Hierarchy, InstallJob, JobDetail, JobLive, JobMap, JobPart,
    JobSummary, JoinRequest, JoinResponse, KeyMap, KeyRun, LcoreShare, RackPeer, RankStatus, Stats,
    DETAIL_KEYS,
};
use phub_proto::checkpoint::Checkpoint;
use phub_proto::layout::{Layout, Placement};
use phub_proto::memory::MemoryModel;
use phub_proto::spec::{appliance_name_ok, Appliances, JobSpec, SpecError, APPLIANCE_NAME_RULE};
use serde::Serialize;

use crate::admission::{self, AdmitError};
use crate::dataplane::{Client, DataplaneError};
use crate::metrics;
use crate::refit::{self, Refit};
use crate::state::{self, StateError, StoredJob, StoredPart, DEFAULT_APPLIANCE};

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
    /// Base URL of the management API of the appliance "default", used
    /// when neither `appliances` nor the state file names any appliance.
    pub dataplane: String,
    /// Appliances given at start (`--appliance`, and `--dataplane` as the
    /// one named "default"). They join those the state file records; one
    /// of the same name replaces the recorded one.
    pub appliances: Vec<ApplianceSpec>,
    /// The state file.
    pub state: PathBuf,
    /// How often the dataplanes' jobs are compared with the admitted ones.
    pub reconcile_interval: Duration,
    /// The operator token file (default: the state file's path with
    /// `.operator-token` appended). Created with a random token, readable by
    /// its owner only, when missing.
    pub operator_token: Option<PathBuf>,
    /// The management token file of `dataplane` (default: the dataplane's
    /// default for its port; see [`phub_http::secret::mgmt_token_path`]).
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
            appliances: Vec::new(),
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

    /// Where the management token of `dataplane` lives.
    pub fn dataplane_token_path(&self) -> PathBuf {
        self.dataplane_token
            .clone()
            .unwrap_or_else(|| default_mgmt_token_path(&self.dataplane))
    }

    /// The appliance "default" that `dataplane` names.
    fn default_appliance(&self) -> ApplianceSpec {
        ApplianceSpec {
            name: DEFAULT_APPLIANCE.into(),
            url: self.dataplane.clone(),
            rack: String::new(),
            token_file: self.dataplane_token.as_ref().map(|p| p.display().to_string()),
        }
    }
}

/// The management token file a dataplane at `url` keeps by default: the
/// dataplane's default for the URL's port.
pub fn default_mgmt_token_path(url: &str) -> PathBuf {
    // The port of the URL: what follows the host's last colon.
    let authority = url.split("://").nth(1).unwrap_or(url);
    let authority = authority.split('/').next().unwrap_or(authority);
    let port = authority
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(80);
    phub_http::secret::mgmt_token_path(port)
}

/// The management token file control reads for `a`.
fn token_path_of(a: &ApplianceSpec) -> PathBuf {
    a.token_file
        .as_ref()
        .map_or_else(|| default_mgmt_token_path(&a.url), PathBuf::from)
}

/// Checks an appliance as the operator gives it: its name and URL.
pub fn check_appliance(a: &ApplianceSpec) -> Result<(), String> {
    if !appliance_name_ok(&a.name) {
        return Err(format!(
            "appliance name {:?}: expected {APPLIANCE_NAME_RULE}",
            a.name
        ));
    }
    if !(a.url.starts_with("http://") || a.url.starts_with("https://")) || a.url.len() > 2048 {
        return Err(format!(
            "appliance {:?}: url {:?} is not an http:// or https:// URL of its management API",
            a.name, a.url
        ));
    }
    if a.rack.chars().count() > 128 || a.rack.chars().any(char::is_control) {
        return Err(format!(
            "appliance {:?}: rack {:?}: expected at most 128 characters, none of them a control character",
            a.name, a.rack
        ));
    }
    Ok(())
}

/// Parses `--appliance name=a,url=http://127.0.0.1:7800[,rack=r1][,token-file=PATH]`.
pub fn parse_appliance(text: &str) -> Result<ApplianceSpec, String> {
    let (mut name, mut url, mut rack, mut token_file) = (None, None, String::new(), None);
    for field in text.split(',') {
        let (k, v) = field
            .split_once('=')
            .ok_or_else(|| format!("{field:?} in {text:?}: expected key=value"))?;
        match k.trim() {
            "name" => name = Some(v.trim().to_string()),
            "url" => url = Some(v.trim().to_string()),
            "rack" => rack = v.trim().to_string(),
            "token-file" => token_file = Some(v.trim().to_string()),
            other => {
                return Err(format!(
                    "{other:?} in {text:?}: expected name=, url=, rack= or token-file="
                ))
            }
        }
    }
    let a = ApplianceSpec {
        name: name.ok_or_else(|| format!("{text:?}: name= is missing"))?,
        url: url.ok_or_else(|| format!("{text:?}: url= is missing"))?,
        rack,
        token_file,
    };
    check_appliance(&a)?;
    Ok(a)
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

/// The configuration file read when `--config` is not given, if it exists
/// (see `phub_appliance::config`).
pub const CONFIG_FILE: &str = "/etc/phub/control.toml";

/// phub-control: admits jobs, maps chunks to lcores, answers workers.
#[derive(Debug, Parser)]
#[command(name = "phub-control", version)]
struct Args {
    /// Address the HTTP API listens on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// Base URL of the management API of the appliance named "default"
    /// [default: http://127.0.0.1:7800 when neither --appliance nor the
    /// state file names an appliance].
    #[arg(long)]
    dataplane: Option<String>,
    /// An appliance: `name=a,url=http://127.0.0.1:7800[,rack=r1][,token-file=PATH]`
    /// (repeat for several). Appliances given here join those the state
    /// file records; `phubctl appliance add|remove` changes them at run time.
    #[arg(long, value_name = "SPEC", value_parser = parse_appliance)]
    appliance: Vec<ApplianceSpec>,
    /// The state file (appliances and admitted jobs), written atomically
    /// after every change.
    #[arg(long, default_value = "phub-control.state.json")]
    state: PathBuf,
    /// Milliseconds between reconciliations with the dataplanes.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    reconcile_ms: u64,
    /// Operator token file (admission, eviction, checkpoints and appliance
    /// changes need the token); default: the state file's path +
    /// `.operator-token`.
    #[arg(long)]
    operator_token_file: Option<PathBuf>,
    /// The management token file of --dataplane (its --mgmt-token-file);
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
    let (args, file) = phub_appliance::config::parse_or_exit::<Args>(std::path::Path::new(CONFIG_FILE));
    if let Some(f) = file {
        log::info!("configuration file {}", f.display());
    }
    let explicit = args.dataplane.is_some() || args.dataplane_token_file.is_some();
    let mut config = Config {
        listen: args.listen,
        appliances: args.appliance,
        state: args.state,
        reconcile_interval: Duration::from_millis(args.reconcile_ms),
        operator_token: args.operator_token_file,
        dataplane_token: args.dataplane_token_file,
        tls: args.tls_cert.zip(args.tls_key),
        insecure_listen: args.insecure_listen,
        ..Config::default()
    };
    if let Some(url) = args.dataplane {
        config.dataplane = url;
    }
    // A --dataplane given (or its token file) names the appliance
    // "default", whatever the state file recorded for it.
    if explicit {
        let default = config.default_appliance();
        config.appliances.retain(|a| a.name != DEFAULT_APPLIANCE);
        config.appliances.insert(0, default);
    }
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
    /// parsed), settles the appliances (the state file's, those of
    /// `config`), binds the API and starts the threads. The first
    /// reconciliation with the dataplanes runs at once, in the background.
    pub fn start(config: Config) -> anyhow::Result<Daemon> {
        let state_lock = state::lock(&config.state)?;
        let loaded = state::load(&config.state)?.unwrap_or_default();
        let token_path = config.operator_token_path();
        let operator_token = load_or_create_token(&token_path)?;
        let recorded = loaded.appliances.clone().unwrap_or_default();
        let mut specs: BTreeMap<String, ApplianceSpec> =
            recorded.iter().map(|a| (a.name.clone(), a.clone())).collect();
        for a in &config.appliances {
            check_appliance(a).map_err(anyhow::Error::msg)?;
            if let Some(old) = specs.get(&a.name).filter(|old| *old != a) {
                log::warn!(
                    "appliance {:?}: the state file has it at {} (rack {:?}); now at {} (rack {:?})",
                    a.name,
                    old.url,
                    old.rack,
                    a.url,
                    a.rack
                );
            }
            specs.insert(a.name.clone(), a.clone());
        }
        if specs.is_empty() {
            let a = config.default_appliance();
            specs.insert(a.name.clone(), a);
        }
        let jobs: BTreeMap<u16, StoredJob> = loaded.jobs.into_iter().map(|j| (j.id, j)).collect();
        for job in jobs.values() {
            if let Some(p) = job.parts.iter().find(|p| !specs.contains_key(&p.appliance)) {
                anyhow::bail!(
                    "state file {}: job {} is on appliance {:?}, which neither the state file nor the \
                     command line names; give it with --appliance name={},url=<its management URL>",
                    config.state.display(),
                    job.id,
                    p.appliance,
                    p.appliance
                );
            }
        }
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
        let changed = loaded.appliances.is_none() || recorded != specs.values().cloned().collect::<Vec<_>>();
        let appliances = specs
            .into_values()
            .map(|spec| (spec.name.clone(), Appliance::new(spec)))
            .collect();
        let shared = Arc::new(Shared {
            state_path: config.state.clone(),
            interval: config.reconcile_interval,
            operator_token,
            token_path: token_path.clone(),
            inner: Mutex::new(Inner {
                checkpoints: load_checkpoints(&config.state, &jobs),
                appliances,
                jobs,
            }),
            ops: Mutex::new(()),
        });
        if changed && !shared.lock().jobs.is_empty() {
            // The appliances given at start are recorded (with the jobs on
            // them), so a restart without them still knows where the jobs
            // are; without jobs, the first change records them.
            shared.persist(&shared.lock())?;
        }
        let limits = phub_http::Limits {
            body_bytes: MAX_BODY_BYTES,
            inflight_body_bytes: 4 * MAX_BODY_BYTES,
            ..phub_http::Limits::default()
        };
        let server = phub_http::Server::bind("control-http", config.listen, limits, tls, shared.clone())
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = server.local_addr();
        {
            let inner = shared.lock();
            let names: Vec<String> = inner
                .appliances
                .values()
                .map(|a| format!("{} at {}", a.spec.name, a.spec.url))
                .collect();
            log::info!(
                "phub-control listening on {scheme}://{addr}; appliances: {}; state {} ({} jobs)",
                names.join(", "),
                config.state.display(),
                inner.jobs.len()
            );
        }
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

/// One appliance control manages.
#[derive(Debug)]
struct Appliance {
    /// As given and recorded.
    spec: ApplianceSpec,
    /// Its management client.
    client: Client,
    /// Its last answer to `GET /v1/info`.
    info: Option<DataplaneInfo>,
}

impl Appliance {
    fn new(spec: ApplianceSpec) -> Appliance {
        let client = Client::new(&spec.name, &spec.url, token_path_of(&spec));
        Appliance {
            spec,
            client,
            info: None,
        }
    }
}

/// What the lock guards.
#[derive(Debug)]
struct Inner {
    /// The appliances by name.
    appliances: BTreeMap<String, Appliance>,
    /// Admitted jobs by id.
    jobs: BTreeMap<u16, StoredJob>,
    /// Each job part's last checkpoint, by job and appliance (its file is
    /// beside the state file).
    checkpoints: BTreeMap<(u16, String), CheckpointInfo>,
}

impl Inner {
    /// The client of appliance `name`.
    fn client(&self, name: &str) -> Result<Client, RequestError> {
        self.appliances
            .get(name)
            .map(|a| a.client.clone())
            .ok_or_else(|| {
                RequestError::NotFound(format!("no appliance {name:?}; see phubctl appliance list"))
            })
    }

    /// Every appliance's name and client.
    fn clients(&self) -> Vec<(String, Client)> {
        self.appliances
            .values()
            .map(|a| (a.spec.name.clone(), a.client.clone()))
            .collect()
    }

    /// Bytes on each lcore of appliance `name` (described by `info`) from
    /// the parts of admitted jobs in service there, but job `except`.
    fn load_on(&self, name: &str, info: &DataplaneInfo, except: Option<u16>) -> Vec<u64> {
        let held: Vec<(&JobSpec, Layout)> = self
            .jobs
            .values()
            .filter(|j| j.failed.is_none() && Some(j.id) != except)
            .flat_map(|j| {
                // A hierarchical job's rack slots weigh on the appliance too.
                let rack = rack_of(j, name).map(|r| (&j.spec, r.clone()));
                part_of(j, name).map(|p| (&j.spec, p)).into_iter().chain(rack)
            })
            .collect();
        admission::loads(info, held.iter().map(|(s, l)| (*s, l)))
    }

    /// Appliance `name`'s data address, as control last heard it.
    fn data_of(&self, name: &str) -> Option<DataAddr> {
        Some(self.appliances.get(name)?.info.as_ref()?.data.clone())
    }

    /// The admitted jobs with a part on appliance `name`.
    fn jobs_on(&self, name: &str) -> Vec<u16> {
        self.jobs
            .values()
            .filter(|j| j.parts.iter().any(|p| p.appliance == name))
            .map(|j| j.id)
            .collect()
    }
}

/// What the reconcile thread remembers to log each problem once.
#[derive(Debug, Default)]
struct ReconcileLog {
    /// Appliances that did not answer last time.
    down: BTreeSet<String>,
    /// Job parts whose reinstall failed, by job and appliance.
    failed: BTreeSet<(u16, String)>,
}

struct Shared {
    /// Admission, eviction, checkpoints and appliance changes need it
    /// (`Authorization: Bearer`).
    operator_token: String,
    token_path: PathBuf,
    state_path: PathBuf,
    interval: Duration,
    inner: Mutex<Inner>,
    /// Held across every call that changes the dataplanes' sets of jobs
    /// or control's set of appliances.
    ops: Mutex<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the operator token.
        f.debug_struct("Shared")
            .field("state_path", &self.state_path)
            .finish_non_exhaustive()
    }
}

/// A job's parts: each appliance's name and its part of the layout, in
/// layout order. O(lcores).
fn parts(job: &StoredJob) -> Vec<(&str, Layout)> {
    let counts: Vec<usize> = job.parts.iter().map(|p| p.lcores as usize).collect();
    job.parts
        .iter()
        .map(|p| p.appliance.as_str())
        .zip(job.layout.split(&counts))
        .collect()
}

/// Job `job`'s part on appliance `name`, if it has one there.
fn part_of(job: &StoredJob, name: &str) -> Option<Layout> {
    parts(job).into_iter().find(|(n, _)| *n == name).map(|(_, l)| l)
}

/// Who sends job `job`'s chunks to appliance `name`: each layout of the
/// job there with how many send to its lcores: a flat job's part, from
/// its W ranks; a hierarchical job's rack layout, from its rack's ranks,
/// and its part of the home layout, from every rack's appliance.
fn senders(job: &StoredJob, name: &str) -> Vec<(Layout, u64)> {
    let part = part_of(job, name);
    if job.racks.is_empty() {
        return part
            .map(|l| (l, u64::from(job.spec.workers)))
            .into_iter()
            .collect();
    }
    let home = part.map(|l| (l, job.parts.len() as u64));
    home.into_iter().chain(rack_senders(job, name)).collect()
}

/// A hierarchical job's rack layout on appliance `name` and its rack's
/// ranks, who send to it.
fn rack_senders(job: &StoredJob, name: &str) -> Option<(Layout, u64)> {
    let i = led_rack(job, name)?;
    let ranks = job.spec.rack_ranks()?.get(i)?.len() as u64;
    Some((job.racks.get(i)?.clone(), ranks))
}

/// Job `job`'s share of appliance `name`'s receive buffers (`rx`: per
/// lcore, as the appliance states them), which its workers' windows must
/// fit (phub-worker's `auto_window`): on each lcore the job's workers send
/// to there (its part of the layout; a hierarchical job's rack layout),
/// the buffer times those workers (W; the rack's ranks) over everyone who
/// sends to that lcore ([`senders`] of every admitted job, this one
/// included), and the smallest of those. Each job's workers keeping
/// within their share, all of them together fit the buffer. This is the
/// share at join; jobs admitted or removed later are counted in the share
/// each lcore states in its RESULTs (PROTOCOL.md §6.1). None when the
/// appliance states no buffer for those lcores.
fn rx_share(inner: &Inner, job: &StoredJob, name: &str, rx: &[Option<u64>]) -> Option<u64> {
    let (mine, w) = if job.racks.is_empty() {
        (part_of(job, name)?, u64::from(job.spec.workers))
    } else {
        rack_senders(job, name)?
    };
    let mut senders_to = vec![0u64; rx.len()];
    for j in inner.jobs.values().filter(|j| j.failed.is_none()) {
        for (layout, n) in senders(j, name) {
            for (s, r) in senders_to.iter_mut().zip(&layout.lcores) {
                if r.count > 0 {
                    *s += n;
                }
            }
        }
    }
    mine.lcores
        .iter()
        .zip(rx.iter().zip(&senders_to))
        .filter(|(r, _)| r.count > 0)
        .filter_map(|(_, (b, &s))| Some(b.as_ref()? * w / s.max(w)))
        .min()
}

/// What appliance `name` installs of `job`; for a hierarchical job, its
/// rack layout and the hierarchy, with each appliance's data address as
/// `data` gives it (None if it has none).
fn install_of(job: &StoredJob, name: &str, data: impl Fn(&str) -> Option<DataAddr>) -> Option<InstallJob> {
    if job.racks.is_empty() {
        return Some(InstallJob {
            id: job.id,
            token: job.token,
            spec: job.spec.clone(),
            layout: part_of(job, name)?,
            hierarchy: None,
        });
    }
    let rack = job.parts.iter().position(|p| p.appliance == name)?;
    let racks = job
        .parts
        .iter()
        .zip(&job.racks)
        .map(|(p, layout)| {
            Some(RackPeer {
                name: p.appliance.clone(),
                data: data(&p.appliance)?,
                layout: layout.clone(),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(InstallJob {
        id: job.id,
        token: job.token,
        spec: job.spec.clone(),
        layout: job.racks[rack].clone(),
        hierarchy: Some(Hierarchy {
            rack: u16::try_from(rack).ok()?,
            racks,
            homes: job.layout.clone(),
        }),
    })
}

/// What `part` of `job` (on its appliance `name`) costs on the appliance
/// `info` describes (the last one control heard from), or by
/// [`MemoryModel::default`]'s upper bounds before it heard from one; a
/// hierarchical job's part with its rack slots. O(keys + lcores).
fn part_bytes(job: &StoredJob, name: &str, part: &Layout, info: Option<&DataplaneInfo>) -> u64 {
    let default = MemoryModel::default();
    let model = info.map_or(&default, |i| &i.memory_model);
    if let Some(rack) = rack_of(job, name) {
        return model
            .hierarchical_cost(&job.spec, rack, part, job.layout.lcores.len())
            .total();
    }
    match info {
        Some(info) => admission::cost(&job.spec, part, info).total(),
        None => model.job_cost(&job.spec, part, false).total(),
    }
}

/// The rack (part index) of a hierarchical job's rank.
fn rack_index(job: &StoredJob, rank: u16) -> Option<usize> {
    if job.racks.is_empty() {
        return None;
    }
    job.spec.rack_ranks()?.iter().position(|r| r.contains(&rank))
}

/// "ranks 0..2 on a, ranks 2..4 on b": a hierarchical job's racks.
fn rack_assignment(job: &StoredJob) -> String {
    let ranks = job.spec.rack_ranks().unwrap_or_default();
    job.parts
        .iter()
        .zip(ranks)
        .map(|(p, r)| format!("ranks {}..{} on {}", r.start, r.end, p.appliance))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A hierarchical job's appliances must each be a different rack's.
fn check_racks(inner: &Inner, chosen: &[(String, DataplaneInfo)]) -> Result<(), RequestError> {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, _) in chosen {
        let rack = inner.appliances.get(name).map_or("", |a| a.spec.rack.as_str());
        if let Some(other) = seen.insert(rack, name) {
            return Err(RequestError::BadRequest(format!(
                "placement.hierarchical: appliances {other:?} and {name:?} are both in rack {rack:?}; a \
                 hierarchical job takes one appliance per rack"
            )));
        }
    }
    Ok(())
}

/// A hierarchical job's rack layout on appliance `name`.
fn rack_of<'a>(job: &'a StoredJob, name: &str) -> Option<&'a Layout> {
    job.racks.get(led_rack(job, name)?)
}

/// Which of a hierarchical job's racks appliance `name` leads (its part's
/// place: rack i's layout is `racks[i]`, its ranks `rack_ranks()[i]`).
fn led_rack(job: &StoredJob, name: &str) -> Option<usize> {
    job.parts.iter().position(|p| p.appliance == name)
}

/// What `job` costs over all its appliances.
fn memory_bytes(job: &StoredJob, inner: &Inner) -> u64 {
    parts(job)
        .iter()
        .map(|(name, part)| {
            let info = inner.appliances.get(*name).and_then(|a| a.info.as_ref());
            part_bytes(job, name, part, info)
        })
        .sum()
}

/// Which appliances hold which jobs now: per appliance its installed job
/// ids, or why it did not answer.
type Survey = BTreeMap<String, Result<BTreeSet<u16>, String>>;

/// Whether every part of `job` is installed, by `survey`.
fn installed(job: &StoredJob, survey: &Survey) -> bool {
    job.parts.iter().all(|p| {
        survey
            .get(&p.appliance)
            .is_some_and(|r| r.as_ref().is_ok_and(|ids| ids.contains(&job.id)))
    })
}

fn summary(job: &StoredJob, installed: bool, inner: &Inner) -> JobSummary {
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
    }
}

/// Several appliances' views of a job, merged: pushes, rounds and held
/// answers added up, the round range and each rank's clocks spanned, the
/// largest lead, each rank's silence the shortest.
fn merge_live(lives: &[&JobLive]) -> Option<JobLive> {
    let first = lives.first()?;
    let mut m = JobLive {
        id: first.id,
        pushes: 0,
        rounds_completed: 0,
        round_range: None,
        silent_ms: vec![None; first.silent_ms.len()],
        clock: ClockStats::default(),
    };
    for l in lives {
        m.pushes += l.pushes;
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
        ("POST", ["v1", "jobs"])
            | ("DELETE", ["v1", "jobs", _])
            | ("POST", ["v1", "jobs", _, "checkpoint"])
            | ("POST", ["v1", "appliances"])
            | ("DELETE", ["v1", "appliances", _])
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

/// Joins and the operator's routes run in handlers of their own, which
/// reads (anyone may make them, and a hung appliance may slow them) cannot
/// take; everything else is a read.
fn class_of(method: &str, segs: &[&str]) -> phub_http::Class {
    if needs_operator(method, segs) || matches!((method, segs), ("POST", ["v1", "jobs", _, "join"])) {
        phub_http::Class::Write
    } else {
        phub_http::Class::Read
    }
}

impl phub_http::Handler for Shared {
    fn class(&self, head: &phub_http::Request) -> phub_http::Class {
        class_of(&head.method, &segments(&head.path))
    }

    /// The operator token; failed checks are logged and limited per source
    /// by the listener.
    fn needs_credential(&self, head: &phub_http::Request) -> bool {
        needs_operator(&head.method, &segments(&head.path))
    }

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
        // A handler that panicked cannot have left the maps half-changed:
        // every change is one insert or remove.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn persist(&self, inner: &Inner) -> Result<(), StateError> {
        let appliances: Vec<&ApplianceSpec> = inner.appliances.values().map(|a| &a.spec).collect();
        let jobs: Vec<&StoredJob> = inner.jobs.values().collect();
        state::save(&self.state_path, &appliances, &jobs)
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
            ["v1", "appliances"] => match method {
                "GET" => Ok(Reply::json(200, &self.appliances())),
                "POST" => {
                    let a: ApplianceSpec = serde_json::from_str(body_text(req)?).map_err(|e| {
                        RequestError::BadRequest(format!(
                            "invalid appliance: {e}; expected {{\"name\": ..., \"url\": ..., \"rack\": ..., \
                             \"token_file\": ...}}"
                        ))
                    })?;
                    Ok(Reply::json(201, &self.add_appliance(a)?))
                }
                _ => Err(wrong("GET, POST")),
            },
            ["v1", "appliances", name] => match method {
                "DELETE" => Ok(Reply::json(200, &self.remove_appliance(name)?)),
                _ => Err(wrong("DELETE")),
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

    /// Appliance `name`'s cached description, or a fresh one.
    fn info_of(&self, name: &str) -> Result<DataplaneInfo, RequestError> {
        let client = {
            let inner = self.lock();
            if let Some(i) = inner.appliances.get(name).and_then(|a| a.info.clone()) {
                return Ok(i);
            }
            inner.client(name)?
        };
        let info = client.info()?;
        if let Some(a) = self.lock().appliances.get_mut(name) {
            a.info = Some(info.clone());
        }
        Ok(info)
    }

    /// Which appliances hold which jobs now (one call to each).
    fn survey(&self) -> Survey {
        let clients = self.lock().clients();
        clients
            .into_iter()
            .map(|(name, c)| {
                let r = c
                    .jobs()
                    .map(|j| j.into_iter().map(|j| j.id).collect())
                    .map_err(|e| e.to_string());
                (name, r)
            })
            .collect()
    }

    /// The appliances `spec` goes on, with their fresh descriptions, in
    /// layout order: those it names, or the number it asks for (one by
    /// default) with the most free memory among those that answer.
    fn choose(&self, spec: &JobSpec) -> Result<Vec<(String, DataplaneInfo)>, RequestError> {
        let clients = self.lock().clients();
        let asked = spec.placement.as_ref().map(|p| &p.appliances);
        let chosen = match asked {
            Some(Appliances::Names(names)) => {
                let mut out = Vec::new();
                for n in names {
                    let Some((_, c)) = clients.iter().find(|(name, _)| name == n) else {
                        let known: Vec<&str> = clients.iter().map(|(n, _)| n.as_str()).collect();
                        return Err(RequestError::BadRequest(format!(
                            "placement.appliances names {n:?}, which control does not manage; its \
                             appliances: {}",
                            known.join(", ")
                        )));
                    };
                    out.push((n.clone(), c.info()?));
                }
                out
            }
            _ => {
                let count = spec.placement.as_ref().map_or(1, |p| p.count());
                let mut answer = Vec::new();
                let mut down = None;
                for (name, c) in &clients {
                    match c.info() {
                        Ok(info) => answer.push((name.clone(), info)),
                        Err(e) => down = down.or(Some(e)),
                    }
                }
                let free: Vec<(String, u64)> = answer
                    .iter()
                    .map(|(n, i)| {
                        (
                            n.clone(),
                            i.memory_budget_bytes.saturating_sub(i.memory_used_bytes),
                        )
                    })
                    .collect();
                let names = match admission::choose_appliances(count, &free) {
                    Ok(n) => n,
                    // Too few answer: say why one does not.
                    Err(e) => return Err(down.map_or(RequestError::Capacity(e), RequestError::from)),
                };
                names
                    .into_iter()
                    .filter_map(|n| answer.iter().find(|(a, _)| *a == n).cloned())
                    .collect()
            }
        };
        let mut inner = self.lock();
        for (name, info) in &chosen {
            if let Some(a) = inner.appliances.get_mut(name) {
                a.info = Some(info.clone());
            }
        }
        Ok(chosen)
    }

    fn admit(&self, body: &str, content_type: Option<&str>) -> Result<AdmitResponse, RequestError> {
        let spec = JobSpec::parse(body, content_type)?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut chosen = self.choose(&spec)?;
        if spec.hierarchical()
            && matches!(
                spec.placement.as_ref().map(|p| &p.appliances),
                Some(Appliances::Count(_))
            )
        {
            // Racks are numbered in the order of their appliances' names.
            chosen.sort_by(|a, b| a.0.cmp(&b.0));
        }
        // Ids the appliances hold without control knowing them (a lost
        // state file) are skipped rather than clashed with.
        let mut foreign = BTreeSet::new();
        let mut clients = Vec::new();
        for (name, _) in &chosen {
            let c = self.lock().client(name)?;
            foreign.extend(c.jobs()?.into_iter().map(|j| j.id));
            clients.push(c);
        }
        let (id, plan, racks) = {
            let inner = self.lock();
            if spec.hierarchical() {
                check_racks(&inner, &chosen)?;
            }
            let targets: Vec<admission::Target<'_>> = chosen
                .iter()
                .map(|(name, info)| admission::Target {
                    name,
                    info,
                    load: inner.load_on(name, info, None),
                })
                .collect();
            let (plan, racks) = if spec.hierarchical() {
                let h = admission::plan_hierarchical(&spec, &targets)?;
                (h.homes, h.racks)
            } else {
                (admission::plan_over(&spec, &targets)?, Vec::new())
            };
            let id = admission::free_id(|id| inner.jobs.contains_key(&id) || foreign.contains(&id))?;
            (id, plan, racks)
        };
        let token = loop {
            let t: u64 = rand::random();
            if t != 0 {
                break t;
            }
        };
        let name = spec.name.clone();
        let chunks = plan.layout.chunk_count();
        let lcores = plan.layout.used_lcores();
        let memory: u64 = plan.parts.iter().map(|p| p.memory_bytes).sum();
        let shm: u64 = plan.parts.iter().map(|p| p.cost.shm).sum();
        let names: Vec<String> = chosen.iter().map(|(n, _)| n.clone()).collect();
        let job = StoredJob {
            id,
            token,
            spec,
            layout: plan.layout,
            joined: BTreeSet::new(),
            parts: chosen
                .iter()
                .map(|(n, info)| StoredPart {
                    appliance: n.clone(),
                    lcores: u32::try_from(info.lcores.len()).unwrap_or(u32::MAX),
                })
                .collect(),
            failed: None,
            racks,
        };
        let data = |n: &str| chosen.iter().find(|(c, _)| c == n).map(|(_, i)| i.data.clone());
        // Each appliance installs its part; one that fails undoes the
        // others.
        for (i, (c, appliance)) in clients.iter().zip(&names).enumerate() {
            let install =
                install_of(&job, appliance, data).expect("the job's parts are the chosen appliances");
            if let Err(e) = c.install(&install) {
                let undo = if e.is_unreachable() { i + 1 } else { i };
                // The PUT may have landed before the connection broke.
                for c in &clients[..undo] {
                    let _ = c.remove(id);
                }
                log::warn!("job {name:?} not admitted: {e}");
                return Err(e.into());
            }
        }
        let mut inner = self.lock();
        inner.jobs.insert(id, job);
        if let Err(e) = self.persist(&inner) {
            inner.jobs.remove(&id);
            drop(inner);
            for c in &clients {
                let _ = c.remove(id);
            }
            log::error!("job {name:?} not admitted: {e}");
            return Err(RequestError::State(format!("{e}; the job was not admitted")));
        }
        drop(inner);
        log::info!(
            "admitted job {id} ({name:?}): {chunks} chunks, {memory} bytes ({shm} in shared memory) on {} \
             over lcores {lcores:?} of their union",
            names.join(", ")
        );
        Ok(AdmitResponse {
            id,
            token,
            chunks,
            memory_bytes: memory,
            shm_bytes: shm,
            lcores,
            appliances: names,
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
        if let (Some(said), Some(r)) = (&req.rack, rack_index(job, req.rank)) {
            let part = &job.parts[r].appliance;
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
                    rack_assignment(job)
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

    fn join(&self, id: u16, body: &str) -> Result<JoinResponse, RequestError> {
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
        let job = inner.jobs.get_mut(&id).ok_or_else(|| not_admitted(id))?;
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
        job.joined.insert(req.rank);
        let answer = match rack_index(job, req.rank) {
            // A hierarchical job's worker talks to its rack's appliance
            // alone, in the single-appliance form (PROTOCOL.md §9.1).
            Some(r) => JoinResponse {
                job: id,
                rank: req.rank,
                spec: job.spec.clone(),
                layout: job.racks[r].clone(),
                dataplane: datas[&job.parts[r].appliance].0.clone(),
                appliances: vec![ApplianceAddr {
                    lcores: u32::try_from(job.racks[r].lcores.len()).unwrap_or(u32::MAX),
                    ..appliances[r].clone()
                }],
            },
            None => JoinResponse {
                job: id,
                rank: req.rank,
                spec: job.spec.clone(),
                layout: job.layout.clone(),
                dataplane: datas[&job.parts[0].appliance].0.clone(),
                appliances,
            },
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
        let survey = self.survey();
        let inner = self.lock();
        inner
            .jobs
            .values()
            .map(|j| summary(j, installed(j, &survey), &inner))
            .collect()
    }

    fn show(&self, id: u16) -> Result<JobDetail, RequestError> {
        let clients: Vec<(String, Client)> = {
            let inner = self.lock();
            let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
            job.parts
                .iter()
                .filter_map(|p| Some((p.appliance.clone(), inner.client(&p.appliance).ok()?)))
                .collect()
        };
        // Per appliance of the job: its view of the job, or why it is down.
        let views: BTreeMap<String, Result<Option<JobLive>, String>> = clients
            .into_iter()
            .map(|(n, c)| {
                let v = c
                    .stats()
                    .map(|s| s.jobs.into_iter().find(|j| j.id == id))
                    .map_err(|e| e.to_string());
                (n, v)
            })
            .collect();
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        let lives: Vec<&JobLive> = views.values().filter_map(|v| v.as_ref().ok()?.as_ref()).collect();
        let live = merge_live(&lives);
        let all_installed = job
            .parts
            .iter()
            .all(|p| matches!(views.get(&p.appliance), Some(Ok(Some(_)))));
        let rack_ranks = (!job.racks.is_empty()).then(|| job.spec.rack_ranks()).flatten();
        let parts_detail = parts(job)
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
                    memory_bytes: part_bytes(job, name, &part, a.and_then(|a| a.info.as_ref())),
                    installed: l.is_some(),
                    down: match view {
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
        })
    }

    /// Evicts a job: durable first (the state file without it is written,
    /// or nothing changes and the error says why), then its appliances are
    /// told. An appliance that cannot be told now (down, refusing) keeps
    /// its part until reconciliation removes it, as it removes every job
    /// control has not admitted.
    fn evict(&self, id: u16) -> Result<JobSummary, RequestError> {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        let job = inner.jobs.remove(&id).ok_or_else(|| not_admitted(id))?;
        if let Err(e) = self.persist(&inner) {
            inner.jobs.insert(id, job);
            log::error!("job {id} not evicted: {e}");
            return Err(RequestError::State(format!("job {id} not evicted: {e}")));
        }
        let files: Vec<String> = job
            .parts
            .iter()
            .filter_map(|p| inner.checkpoints.remove(&(id, p.appliance.clone())))
            .map(|c| c.file)
            .collect();
        let clients: Vec<(String, Option<Client>)> = job
            .parts
            .iter()
            .map(|p| (p.appliance.clone(), inner.client(&p.appliance).ok()))
            .collect();
        let summary = summary(&job, false, &inner);
        drop(inner);
        for f in files {
            if let Err(e) = std::fs::remove_file(&f) {
                log::warn!("job {id} evicted, but its checkpoint {f} stays: {e}");
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

    /// `GET /v1/jobs/{id}/map`, and with `key` `/map/keys/{key}`: per lcore
    /// (of each appliance of the job) its run and bytes, O(lcores); one
    /// key's chunks as runs, O(lcores).
    fn map(&self, id: u16, key: Option<u32>) -> Result<JobMap, RequestError> {
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
        for (name, part) in parts(job) {
            let info = infos.get(name).ok_or_else(|| not_admitted(id))?;
            let cost = admission::cost(&job.spec, &part, info);
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

    fn stats(&self) -> Stats {
        let clients = self.lock().clients();
        let mut appliances = Vec::new();
        let mut survey = Survey::new();
        for (name, c) in clients {
            let (dataplane, error) = match c.stats() {
                Ok(s) => (Some(s), None),
                Err(e) => (None, Some(e.to_string())),
            };
            survey.insert(
                name.clone(),
                dataplane
                    .as_ref()
                    .map(|s| s.jobs.iter().map(|j| j.id).collect())
                    .ok_or_else(|| error.clone().unwrap_or_default()),
            );
            appliances.push(ApplianceStats {
                name,
                rack: String::new(),
                dataplane,
                error,
            });
        }
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

    fn metrics(&self) -> String {
        let s = self.stats();
        let appliances: Vec<(&str, Option<&DataplaneStats>)> = s
            .appliances
            .iter()
            .map(|a| (a.name.as_str(), a.dataplane.as_ref()))
            .collect();
        metrics::render_all(&appliances, &s.jobs)
    }

    /// Takes a checkpoint of every part of job `id` from its appliances and
    /// keeps each (atomically replacing the previous one) beside the state
    /// file. A part whose appliance fails keeps its previous checkpoint,
    /// and the error names the appliance; the other parts are saved.
    fn checkpoint(&self, id: u16) -> Result<CheckpointInfo, RequestError> {
        let clients: Vec<(String, Client)> = {
            let inner = self.lock();
            match inner.jobs.get(&id) {
                None => return Err(not_admitted(id)),
                Some(StoredJob {
                    failed: Some(why), ..
                }) => return Err(failed(id, why)),
                Some(job) => job
                    .parts
                    .iter()
                    .map(|p| Ok((p.appliance.clone(), inner.client(&p.appliance)?)))
                    .collect::<Result<_, RequestError>>()?,
            }
        };
        let sharded = clients.len() > 1;
        let mut first_error = None;
        for (name, c) in clients {
            match self.checkpoint_part(id, &name, &c, sharded) {
                Ok(info) => log::info!(
                    "checkpoint of job {id} on appliance {name:?}: rounds {:?}, {} bytes",
                    info.round_range,
                    info.bytes
                ),
                Err(e) => {
                    log::warn!("checkpoint of job {id} on appliance {name:?}: {e}");
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        combined_checkpoint(&inner, job).ok_or_else(|| not_admitted(id))
    }

    fn checkpoint_part(
        &self,
        id: u16,
        name: &str,
        client: &Client,
        sharded: bool,
    ) -> Result<CheckpointInfo, RequestError> {
        let bytes = client.checkpoint(id)?;
        let ckpt = Checkpoint::decode(&bytes).map_err(|e| {
            RequestError::State(format!(
                "appliance {name:?}'s checkpoint of job {id} is unreadable: {e}"
            ))
        })?;
        let path = checkpoint_path(&self.state_path, id, name, sharded);
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
            inner.checkpoints.insert((id, name.to_string()), info.clone());
            Ok(info)
        } else {
            // Evicted meanwhile: the file must not outlive the job.
            let _ = std::fs::remove_file(&path);
            Err(not_admitted(id))
        }
    }

    /// Checkpoints every job whose spec asks for it and one of whose parts'
    /// last checkpoint is older than its interval (or missing).
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
                            let last = j
                                .parts
                                .iter()
                                .map(|p| {
                                    inner
                                        .checkpoints
                                        .get(&(j.id, p.appliance.clone()))
                                        .map_or(0, |c| c.taken_unix_ms)
                                })
                                .min()
                                .unwrap_or(0);
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

    /// Reconciles every appliance ([`Shared::reconcile_one`]).
    fn reconcile(&self, log: &mut ReconcileLog) {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let clients = self.lock().clients();
        log.down.retain(|n| clients.iter().any(|(c, _)| c == n));
        for (name, client) in clients {
            self.reconcile_one(&name, &client, log);
        }
    }

    /// Reinstalls on appliance `name` every part of an admitted job it
    /// lacks, fitted to the lcores it has now ([`Shared::refit`]), from the
    /// part's checkpoint when it has one; a job that cannot be placed on
    /// them, or whose install the appliance refuses as invalid (HTTP 400),
    /// is marked failed instead of being retried for ever. Jobs it holds
    /// that control has not admitted there are removed.
    fn reconcile_one(&self, name: &str, client: &Client, log: &mut ReconcileLog) {
        let installed: BTreeSet<u16> = match client.jobs() {
            Ok(j) => {
                if log.down.remove(name) {
                    log::info!("appliance {name:?} at {} answers again", client.base());
                }
                j.into_iter().map(|j| j.id).collect()
            }
            Err(e) => {
                if log.down.insert(name.to_string()) {
                    log::warn!("{e}; retrying every {:?}", self.interval);
                }
                return;
            }
        };
        // Jobs the appliance holds that control has not admitted there
        // (evicted while it was down, or installed by someone else) are
        // removed.
        let (unknown, missing): (Vec<u16>, Vec<u16>) = {
            let inner = self.lock();
            let here: BTreeSet<u16> = inner.jobs_on(name).into_iter().collect();
            let unknown = installed
                .iter()
                .copied()
                .filter(|id| !here.contains(id))
                .collect();
            let missing = here
                .iter()
                .copied()
                .filter(|id| !installed.contains(id) && inner.jobs[id].failed.is_none())
                .collect();
            (unknown, missing)
        };
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
        if missing.is_empty() {
            return;
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
                return;
            }
        };
        for id in missing {
            let Some((job, sharded)) = self.refit(id, name, &info) else {
                continue;
            };
            let saved = self.lock().checkpoints.get(&(id, name.to_string())).cloned();
            let restored = saved
                .as_ref()
                .and_then(|_| self.checkpoint_for(&job, name, sharded));
            let result = match &restored {
                Some(bytes) => client.restore(id, bytes),
                None => client.install(&job),
            };
            match result {
                Ok(()) => {
                    match saved.filter(|_| restored.is_some()) {
                        Some(c) => log::info!(
                            "reinstalled job {id} ({:?}) on appliance {name:?}, which had lost it, from its \
                             checkpoint (rounds {:?})",
                            job.spec.name,
                            c.round_range
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
                // retrying, unless the appliance restarted again meanwhile.
                Err(DataplaneError::Refused {
                    status: 400, message, ..
                }) if client
                    .info()
                    .is_ok_and(|now| now.lcores.len() == info.lcores.len()) =>
                {
                    self.fail(
                        id,
                        &format!("the dataplane refuses to install it (appliance {name:?}): {message}"),
                    );
                }
                Err(e) => {
                    if log.failed.insert((id, name.to_string())) {
                        log::warn!("cannot reinstall job {id} on appliance {name:?}: {e}; retrying");
                    }
                }
            }
        }
    }

    /// Fits job `id`'s part on appliance `name` to the appliance `info`
    /// describes before it is installed again ([`refit::refit`]): a new
    /// layout, or the job's failure, is made durable first. Returns what to
    /// install and whether the job is sharded; `None` when the job failed,
    /// is gone, or its change could not be written (then nothing changed
    /// and the next reconciliation tries again).
    fn refit(&self, id: u16, name: &str, info: &DataplaneInfo) -> Option<(InstallJob, bool)> {
        let mut inner = self.lock();
        let job = inner.jobs.get(&id).filter(|j| j.failed.is_none())?;
        let index = job.parts.iter().position(|p| p.appliance == name)?;
        if !job.racks.is_empty() && job.racks[index].lcores.len() != info.lcores.len() {
            let why = format!(
                "appliance {name:?} came back with {} lcores, not the {} its rack layout has; a hierarchical \
                 job is not refitted (admit it again)",
                info.lcores.len(),
                job.racks[index].lcores.len()
            );
            let before = job.clone();
            if let Some(j) = inner.jobs.get_mut(&id) {
                j.failed = Some(why.clone());
            }
            if let Err(e) = self.persist(&inner) {
                inner.jobs.insert(id, before);
                log::error!("job {id}: {why}; but that cannot be recorded ({e}): retrying");
            } else {
                log::error!("job {id} failed: {why}");
            }
            return None;
        }
        let part = part_of(job, name)?;
        let others: Vec<(&JobSpec, Layout)> = inner
            .jobs
            .values()
            .filter(|j| j.id != id && j.failed.is_none())
            .filter_map(|j| part_of(j, name).map(|p| (&j.spec, p)))
            .collect();
        let decision = refit::refit(&job.spec, &part, info, others.iter().map(|(s, l)| (*s, l)));
        drop(others);
        let before = job.clone();
        let n = info.lcores.len();
        let job = inner.jobs.get_mut(&id)?;
        let replace = |job: &mut StoredJob, new: Layout| {
            // The part's lcores in the job's layout give way to the new ones.
            let at: usize = job.parts[..index].iter().map(|p| p.lcores as usize).sum();
            let len = job.parts[index].lcores as usize;
            job.parts[index].lcores = u32::try_from(new.lcores.len()).unwrap_or(u32::MAX);
            job.layout.lcores.splice(at..at + len, new.lcores);
        };
        let what = match decision {
            Refit::AsIs => None,
            Refit::Resized(layout) => {
                replace(job, layout);
                Some(format!(
                    "its layout on appliance {name:?} is sized for its {n} lcores (its chunks stay where they were)"
                ))
            }
            Refit::Replaced(layout) => {
                replace(job, layout);
                job.joined.clear();
                Some(format!(
                    "appliance {name:?} has {n} lcores, fewer than its layout used there: its chunks there \
                     are placed anew over them; its ranks must join again (with a stale layout they get an \
                     ERROR slot_out_of_range or chunk_mismatch, or time out on an lcore that is gone)"
                ))
            }
            Refit::Failed(why) => {
                let why = format!("appliance {name:?}: {why}");
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
        if !job.racks.is_empty() {
            // Reinstalled as it was: its rack and home layouts stay.
            return Some((install_of(&job, name, |n| inner.data_of(n))?, true));
        }
        Some((install_of(&job, name, |n| inner.data_of(n))?, job.parts.len() > 1))
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

    /// The checkpoint to restore `job`'s part on appliance `name` from,
    /// moved onto the part's layout when it was taken on another (the part
    /// was placed anew since): `None`, logged, when it cannot be read,
    /// decoded or moved (the part is then installed without it, as when it
    /// has none).
    fn checkpoint_for(&self, job: &InstallJob, name: &str, sharded: bool) -> Option<Vec<u8>> {
        let path = checkpoint_path(&self.state_path, job.id, name, sharded);
        let unusable = |e: &dyn std::fmt::Display| {
            log::error!(
                "job {} on appliance {name:?}: cannot restore its checkpoint {}: {e}; installing it without",
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
            "job {} on appliance {name:?}: its checkpoint is moved onto its new layout, chunk by chunk",
            job.id
        );
        Some(moved)
    }

    /// `GET /v1/appliances`: every appliance, asked for its description now.
    fn appliances(&self) -> Vec<ApplianceStatus> {
        let clients = self.lock().clients();
        let infos: BTreeMap<String, Result<DataplaneInfo, String>> = clients
            .into_iter()
            .map(|(n, c)| (n, c.info().map_err(|e| e.to_string())))
            .collect();
        let mut inner = self.lock();
        for (n, i) in &infos {
            if let (Some(a), Ok(info)) = (inner.appliances.get_mut(n), i) {
                a.info = Some(info.clone());
            }
        }
        inner
            .appliances
            .values()
            .map(|a| {
                let info = infos.get(&a.spec.name).and_then(|r| r.as_ref().ok());
                ApplianceStatus {
                    name: a.spec.name.clone(),
                    url: a.spec.url.clone(),
                    rack: a.spec.rack.clone(),
                    token_file: a.client.token_path().display().to_string(),
                    down: infos.get(&a.spec.name).and_then(|r| r.as_ref().err().cloned()),
                    data: info.map(|i| i.data.clone()),
                    lcores: info.map(|i| u32::try_from(i.lcores.len()).unwrap_or(u32::MAX)),
                    memory_budget_bytes: info.map(|i| i.memory_budget_bytes),
                    memory_used_bytes: info.map(|i| i.memory_used_bytes),
                    jobs: inner.jobs_on(&a.spec.name),
                }
            })
            .collect()
    }

    /// `POST /v1/appliances`: manages one more appliance, durably. It need
    /// not answer yet; reconciliation finds it when it does.
    fn add_appliance(&self, a: ApplianceSpec) -> Result<ApplianceStatus, RequestError> {
        check_appliance(&a).map_err(RequestError::BadRequest)?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        if let Some(old) = inner.appliances.get(&a.name) {
            return Err(RequestError::Conflict(format!(
                "appliance {:?} already exists (at {}); remove it first",
                a.name, old.spec.url
            )));
        }
        let name = a.name.clone();
        inner.appliances.insert(name.clone(), Appliance::new(a));
        if let Err(e) = self.persist(&inner) {
            inner.appliances.remove(&name);
            return Err(RequestError::State(format!(
                "{e}; appliance {name:?} was not added"
            )));
        }
        let added = &inner.appliances[&name];
        log::info!(
            "added appliance {name:?} at {} (rack {:?})",
            added.spec.url,
            added.spec.rack
        );
        let status = ApplianceStatus {
            name: name.clone(),
            url: added.spec.url.clone(),
            rack: added.spec.rack.clone(),
            token_file: added.client.token_path().display().to_string(),
            down: None,
            data: None,
            lcores: None,
            memory_budget_bytes: None,
            memory_used_bytes: None,
            jobs: Vec::new(),
        };
        drop(inner);
        Ok(self
            .appliances()
            .into_iter()
            .find(|s| s.name == name)
            .unwrap_or(status))
    }

    /// `DELETE /v1/appliances/{name}`: stops managing an appliance no job
    /// uses (refused, naming the jobs, while one does), durably.
    fn remove_appliance(&self, name: &str) -> Result<ApplianceStatus, RequestError> {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        if !inner.appliances.contains_key(name) {
            return Err(RequestError::NotFound(format!(
                "no appliance {name:?}; see phubctl appliance list"
            )));
        }
        let users = inner.jobs_on(name);
        if !users.is_empty() {
            let ids: Vec<String> = users
                .iter()
                .map(|id| format!("{id} ({:?})", inner.jobs[id].spec.name))
                .collect();
            return Err(RequestError::Conflict(format!(
                "appliance {name:?} holds jobs {}; evict them first",
                ids.join(", ")
            )));
        }
        let gone = inner.appliances.remove(name).expect("checked above");
        if let Err(e) = self.persist(&inner) {
            inner.appliances.insert(name.to_string(), gone);
            return Err(RequestError::State(format!(
                "{e}; appliance {name:?} was not removed"
            )));
        }
        log::info!("removed appliance {name:?} at {}", gone.spec.url);
        Ok(ApplianceStatus {
            name: gone.spec.name.clone(),
            url: gone.spec.url.clone(),
            rack: gone.spec.rack.clone(),
            token_file: gone.client.token_path().display().to_string(),
            down: None,
            data: gone.info.as_ref().map(|i| i.data.clone()),
            lcores: gone
                .info
                .as_ref()
                .map(|i| u32::try_from(i.lcores.len()).unwrap_or(u32::MAX)),
            memory_budget_bytes: gone.info.as_ref().map(|i| i.memory_budget_bytes),
            memory_used_bytes: gone.info.as_ref().map(|i| i.memory_used_bytes),
            jobs: Vec::new(),
        })
    }
}

/// Where control keeps job `id`'s checkpoint of its part on appliance
/// `name`: beside the state file; one file for a job on one appliance (as
/// before sharding), one per appliance for a sharded job.
fn checkpoint_path(state: &std::path::Path, id: u16, name: &str, sharded: bool) -> PathBuf {
    if sharded {
        state::sibling(state, &format!(".job-{id}.{name}.ckpt"))
    } else {
        state::sibling(state, &format!(".job-{id}.ckpt"))
    }
}

/// A job's last checkpoint over all its parts: rounds spanned, bytes
/// added up, the oldest part's time, the files listed (", "); `None`
/// until every part has one.
fn combined_checkpoint(inner: &Inner, job: &StoredJob) -> Option<CheckpointInfo> {
    let mut all: Option<CheckpointInfo> = None;
    for p in &job.parts {
        let c = inner.checkpoints.get(&(job.id, p.appliance.clone()))?;
        all = Some(match all {
            None => c.clone(),
            Some(a) => CheckpointInfo {
                id: a.id,
                round_range: match (a.round_range, c.round_range) {
                    (Some((x, y)), Some((u, v))) => Some((x.min(u), y.max(v))),
                    (x, y) => x.or(y),
                },
                bytes: a.bytes + c.bytes,
                taken_unix_ms: a.taken_unix_ms.min(c.taken_unix_ms),
                file: format!("{}, {}", a.file, c.file),
            },
        });
    }
    all
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The checkpoints found beside the state file for the admitted jobs'
/// parts.
fn load_checkpoints(
    state: &std::path::Path,
    jobs: &BTreeMap<u16, StoredJob>,
) -> BTreeMap<(u16, String), CheckpointInfo> {
    let mut out = BTreeMap::new();
    for job in jobs.values() {
        let id = job.id;
        for p in &job.parts {
            let path = checkpoint_path(state, id, &p.appliance, job.parts.len() > 1);
            let Ok(bytes) = std::fs::read(&path) else { continue };
            match Checkpoint::decode(&bytes) {
                Ok(c) => {
                    let taken = std::fs::metadata(&path)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                    out.insert(
                        (id, p.appliance.clone()),
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
    }
    out
}
