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
    JobSummary, JoinRequest, JoinResponse, KeyMap, KeyRun, LcoreShare, RackPeer, RankStatus,
    RetriedCheckpoint, RetriedInstall, RetriedPart, RetryRequest, RetryResponse, Stats, DETAIL_KEYS,
};
use phub_proto::checkpoint::Checkpoint;
use phub_proto::layout::{Layout, Placement};
use phub_proto::memory::MemoryModel;
use phub_proto::spec::{appliance_name_ok, Appliances, JobSpec, SpecError, APPLIANCE_NAME_RULE};
use serde::Serialize;

use crate::admission::{self, AdmitError};
use crate::ckpt_file::{self, KeepError, Owner, PartShape};
use crate::dataplane::{Client, DataplaneError};
use crate::metrics;
use crate::refit::{self, Refit};
use crate::state::{self, StateError, StoredJob, StoredPart, DEFAULT_APPLIANCE};
use crate::watch::{self, View, Watch, READ_WAIT};

/// Largest job spec accepted by `POST /v1/jobs`, in bytes (a spec lists
/// every key: a 10^6-key spec is about 15 MB of TOML).
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// Largest body of any other request (a join), in bytes.
pub const MAX_SMALL_BODY_BYTES: usize = 64 << 10;
/// Longest an admission waits for an appliance's description before it
/// takes it as down.
const ADMIT_WAIT: Duration = Duration::from_secs(2);

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
                    let mut logs = BTreeMap::new();
                    loop {
                        rs.reconcile(&mut logs);
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
    /// The requests of the read routes to it ([`watch`]).
    watch: Arc<Watch>,
    /// Set when reconciliation found it to be another appliance's
    /// dataplane under a second name: which, and why; it is then neither
    /// reconciled nor chosen for a job ([`watch::alias_of`]).
    alias: Option<String>,
}

impl Appliance {
    fn new(spec: ApplianceSpec) -> Appliance {
        let client = Client::new(&spec.name, &spec.url, token_path_of(&spec));
        Appliance {
            spec,
            client,
            info: None,
            watch: Arc::default(),
            alias: None,
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
    /// Each job part's last checkpoint, and the parts held for an
    /// unusable one.
    checkpoints: Checkpoints,
}

/// What control knows of its job parts' checkpoint files (beside the
/// state file), by job and appliance.
#[derive(Debug, Default)]
struct Checkpoints {
    /// Each part's last usable checkpoint.
    taken: BTreeMap<(u16, String), CheckpointInfo>,
    /// Parts whose checkpoint file exists but cannot be restored: they are
    /// not installed (their job is held) until `POST /v1/jobs/{id}/retry`.
    held: BTreeMap<(u16, String), Held>,
}

/// Why a job part is held: its checkpoint file is there, but it cannot be
/// read or decoded, is not the part's, cannot be moved onto the part's
/// layout, or the appliance refuses it. Installing the part without it
/// would lose the state the file may hold, and the next checkpoint would
/// write over it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    /// The file.
    file: PathBuf,
    /// Why it cannot be used.
    why: String,
}

impl Checkpoints {
    /// Why job `id` is held ("part on appliance ...: checkpoint FILE
    /// unusable: WHY", "; " between parts), if one of its parts is.
    fn held_reason(&self, id: u16) -> Option<String> {
        let parts: Vec<String> = self
            .held
            .range((id, String::new())..)
            .take_while(|((j, _), _)| *j == id)
            .map(|((_, name), h)| held_text(name, h))
            .collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }
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

    /// Every appliance's name, client and watch.
    fn watched(&self) -> Vec<(String, Client, Arc<Watch>)> {
        self.appliances
            .values()
            .map(|a| (a.spec.name.clone(), a.client.clone(), a.watch.clone()))
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

/// What the reconcile thread remembers to log each problem once (one per
/// appliance).
#[derive(Debug, Default)]
struct ReconcileLog {
    /// Jobs the appliance holds that control admitted on other appliances.
    foreign: BTreeSet<u16>,
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

/// The jobs each appliance holds, by its view.
fn survey_of(views: &BTreeMap<String, Result<View, String>>) -> Survey {
    views
        .iter()
        .map(|(n, v)| {
            let ids = v.as_ref().map(|v| v.stats.jobs.iter().map(|j| j.id).collect());
            (n.clone(), ids.map_err(Clone::clone))
        })
        .collect()
}

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
        held: inner.checkpoints.held_reason(job.id),
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

/// The answer to a join or checkpoint of a held job: 409 with its reason
/// and the way out.
fn held(id: u16, why: &str) -> RequestError {
    RequestError::Conflict(format!(
        "job {id} is held: {why}; repair or restore the file, then `phubctl job retry {id}` (or `phubctl job \
         retry {id} --discard-checkpoint` to set the file aside and start the part over without it)"
    ))
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
            | ("POST", ["v1", "jobs", _, "retry"])
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
            ["v1", "jobs", id, "retry"] => match method {
                "POST" => {
                    let id = parse_id(id)?;
                    let body = body_text(req)?;
                    let r: RetryRequest = if body.trim().is_empty() {
                        RetryRequest::default()
                    } else {
                        serde_json::from_str(body).map_err(|e| {
                            RequestError::BadRequest(format!(
                                "invalid retry request: {e}; expected {{\"discard_checkpoint\": false}} (or true), \
                                 or no body"
                            ))
                        })?
                    };
                    Ok(Reply::json(200, &self.retry(id, r.discard_checkpoint)?))
                }
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
                    let force = req.query.as_deref().is_some_and(|q| {
                        q.split('&')
                            .any(|kv| matches!(kv, "force" | "force=true" | "force=1"))
                    });
                    Ok(Reply::json(201, &self.add_appliance(a, force)?))
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

    /// The views of the appliances named in `only` (all when `None`),
    /// each fresh if it answers within `wait` ([`Watch::look`]: one asked
    /// while a request to it is in flight since longer is not waited for);
    /// all are asked at once. Fresh descriptions are remembered.
    fn views(&self, only: Option<&[String]>, wait: Duration) -> BTreeMap<String, Result<View, String>> {
        let watched: Vec<(String, Client, Arc<Watch>)> = self
            .lock()
            .watched()
            .into_iter()
            .filter(|(n, ..)| only.is_none_or(|o| o.contains(n)))
            .collect();
        for (_, c, w) in &watched {
            // A failure to start shows in `look`.
            let _ = w.kick(c);
        }
        let views: BTreeMap<String, Result<View, String>> = watched
            .iter()
            .map(|(n, c, w)| (n.clone(), w.look(c, wait)))
            .collect();
        let mut inner = self.lock();
        for (n, v) in &views {
            if let (Some(a), Ok(v)) = (inner.appliances.get_mut(n), v) {
                a.info = Some(v.info.clone());
            }
        }
        views
    }

    /// Which appliances hold which jobs now, by [`Shared::views`].
    fn survey(&self) -> Survey {
        survey_of(&self.views(None, READ_WAIT))
    }

    /// The appliances `spec` goes on, with their fresh descriptions, in
    /// layout order: those it names, or the number it asks for (one by
    /// default) with the most free memory among those that answer.
    fn choose(&self, spec: &JobSpec) -> Result<Vec<(String, DataplaneInfo)>, RequestError> {
        let (clients, aliases): (Vec<(String, Client)>, BTreeMap<String, String>) = {
            let inner = self.lock();
            let aliases = inner
                .appliances
                .values()
                .filter_map(|a| Some((a.spec.name.clone(), a.alias.clone()?)))
                .collect();
            (inner.clients(), aliases)
        };
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
                    if let Some(why) = aliases.get(n) {
                        return Err(RequestError::Conflict(format!(
                            "placement.appliances names {n:?}, which is {why}"
                        )));
                    }
                    out.push((n.clone(), c.info()?));
                }
                out
            }
            _ => {
                let count = spec.placement.as_ref().map_or(1, |p| p.count());
                let mut answer = Vec::new();
                let mut down = None;
                // Every appliance asked at once; one that does not answer
                // within ADMIT_WAIT is taken as down.
                for (name, v) in self.views(None, ADMIT_WAIT) {
                    match v {
                        Ok(_) if aliases.contains_key(&name) => {}
                        Ok(v) => answer.push((name, v.info)),
                        Err(e) => {
                            down = down.or(Some(RequestError::Dataplane(DataplaneError::Unreachable {
                                appliance: name.clone(),
                                base: clients
                                    .iter()
                                    .find(|(n, _)| *n == name)
                                    .map(|(_, c)| c.base().to_string())
                                    .unwrap_or_default(),
                                reason: e,
                            })));
                        }
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
                    Err(e) => return Err(down.unwrap_or(RequestError::Capacity(e))),
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
        if let Some(why) = inner.checkpoints.held_reason(id) {
            return Err(held(id, &why));
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
        // Every part's checkpoint goes, usable or not, with any previous
        // version a write left.
        let sharded = job.parts.len() > 1;
        let mut files = Vec::new();
        for p in &job.parts {
            let key = (id, p.appliance.clone());
            inner.checkpoints.taken.remove(&key);
            inner.checkpoints.held.remove(&key);
            let f = checkpoint_path(&self.state_path, id, &p.appliance, sharded);
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
    /// keeps each beside the state file ([`ckpt_file::keep`]: never over a
    /// newer or fuller one, nor over one that is unusable, which holds the
    /// job; the previous one kept as `.prev` until the new one reads back).
    /// A part whose appliance fails keeps its previous checkpoint, and the
    /// error names the appliance; the other parts are saved. A held job is
    /// refused (409).
    fn checkpoint(&self, id: u16) -> Result<CheckpointInfo, RequestError> {
        let _files = CHECKPOINT_FILES.lock().unwrap_or_else(|p| p.into_inner());
        let clients: Vec<(String, Client)> = {
            let inner = self.lock();
            match inner.jobs.get(&id) {
                None => return Err(not_admitted(id)),
                Some(StoredJob {
                    failed: Some(why), ..
                }) => return Err(failed(id, why)),
                Some(job) => {
                    if let Some(why) = inner.checkpoints.held_reason(id) {
                        return Err(held(id, &why));
                    }
                    job.parts
                        .iter()
                        .map(|p| Ok((p.appliance.clone(), inner.client(&p.appliance)?)))
                        .collect::<Result<_, RequestError>>()?
                }
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

    /// Takes job `id`'s part on appliance `name` from `client` and keeps it
    /// ([`ckpt_file::keep`]). Caller holds [`CHECKPOINT_FILES`].
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
        let job = self
            .lock()
            .jobs
            .get(&id)
            .cloned()
            .ok_or_else(|| not_admitted(id))?;
        let part = part_of(&job, name).ok_or_else(|| not_admitted(id))?;
        let owner = owner(&job, name, &part);
        owner.check(&ckpt.job).map_err(|e| {
            RequestError::State(format!(
                "appliance {name:?}'s checkpoint of job {id} is not the part's: {e}; nothing was written"
            ))
        })?;
        match ckpt_file::keep(&path, &bytes, &ckpt, &owner) {
            Ok(()) => {}
            Err(KeepError::Unusable { why, .. }) => {
                let h = Held {
                    file: path.clone(),
                    why,
                };
                let text = held_text(name, &h);
                self.hold(id, name, h);
                return Err(held(id, &text));
            }
            Err(e @ KeepError::Older { .. }) => {
                return Err(RequestError::Conflict(format!(
                    "job {id}, part on appliance {name:?}: {e}"
                )))
            }
            Err(KeepError::Write(e)) => return Err(RequestError::State(e)),
        }
        let info = CheckpointInfo {
            id,
            round_range: ckpt.round_range(),
            bytes: bytes.len() as u64,
            taken_unix_ms: unix_ms(),
            file: path.display().to_string(),
        };
        let mut inner = self.lock();
        if inner.jobs.contains_key(&id) {
            inner
                .checkpoints
                .taken
                .insert((id, name.to_string()), info.clone());
            Ok(info)
        } else {
            // Evicted meanwhile: the file must not outlive the job.
            let _ = std::fs::remove_file(&path);
            Err(not_admitted(id))
        }
    }

    /// Checkpoints every job whose spec asks for it and one of whose parts'
    /// last checkpoint is older than its interval (or missing); never a
    /// held job.
    fn periodic_checkpoints(&self) {
        let now = unix_ms();
        let due: Vec<u16> = {
            let inner = self.lock();
            inner
                .jobs
                .values()
                .filter(|j| {
                    j.failed.is_none()
                        && inner.checkpoints.held_reason(j.id).is_none()
                        && j.spec.checkpoint_interval_s.is_some_and(|s| {
                            let last = j
                                .parts
                                .iter()
                                .map(|p| {
                                    inner
                                        .checkpoints
                                        .taken
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

    /// Reconciles every appliance ([`Shared::reconcile_one`]), all at
    /// once, so that one that does not answer delays none of the others;
    /// first asks each who it is, and leaves alone every appliance that is
    /// another's dataplane under a second name ([`watch::alias_of`]).
    fn reconcile(&self, logs: &mut BTreeMap<String, ReconcileLog>) {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let clients = self.lock().clients();
        logs.retain(|n, _| clients.iter().any(|(c, _)| c == n));
        let infos: Vec<(String, Option<DataplaneInfo>)> = std::thread::scope(|s| {
            let asked: Vec<_> = clients
                .iter()
                .map(|(n, c)| (n.clone(), s.spawn(move || c.info().ok())))
                .collect();
            asked
                .into_iter()
                .map(|(n, h)| (n, h.join().ok().flatten()))
                .collect()
        });
        let aliases: BTreeSet<String> = {
            let mut inner = self.lock();
            let seen: Vec<(String, bool, DataplaneInfo)> = infos
                .iter()
                .filter_map(|(n, i)| Some((n.clone(), !inner.jobs_on(n).is_empty(), i.clone()?)))
                .collect();
            let found = watch::alias_of(&seen);
            for (n, i) in infos {
                let Some(a) = inner.appliances.get_mut(&n) else {
                    continue;
                };
                let alias = found.iter().find(|(x, ..)| *x == n).map(|(_, other, why)| {
                    format!(
                        "the dataplane of appliance {other:?} under a second name ({why}): neither \
                         reconciled nor given jobs; remove one of the two (phubctl appliance remove)"
                    )
                });
                match (&a.alias, &alias) {
                    (None, Some(why)) => log::error!("appliance {n:?} at {} is {why}", a.spec.url),
                    (Some(_), None) => log::info!("appliance {n:?} is no longer another's dataplane"),
                    _ => {}
                }
                a.alias = alias;
                if i.is_some() {
                    a.info = i;
                }
            }
            found.into_iter().map(|(n, ..)| n).collect()
        };
        for (n, _) in &clients {
            logs.entry(n.clone()).or_default();
        }
        std::thread::scope(|s| {
            for (name, log) in logs.iter_mut().filter(|(n, _)| !aliases.contains(*n)) {
                let Some((_, client)) = clients.iter().find(|(c, _)| c == name) else {
                    continue;
                };
                s.spawn(move || self.reconcile_one(name, client, log));
            }
        });
    }

    /// Reinstalls on appliance `name` every part of an admitted job it
    /// lacks, fitted to the lcores it has now ([`Shared::refit`]), from the
    /// part's checkpoint when it has one; a job that cannot be placed on
    /// them, or whose install the appliance refuses as invalid (HTTP 400),
    /// is marked failed instead of being retried for ever. A part whose
    /// checkpoint file is there but unusable ([`Shared::checkpoint_for`],
    /// or refused by the appliance) is held instead, and a held part is
    /// not installed, until `POST /v1/jobs/{id}/retry`. Jobs it holds that
    /// control has not admitted there are removed.
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
            // A job admitted on other appliances is left alone: this
            // may be one of them under another name or address, which
            // must not lose the job's state.
            let (foreign, unknown): (Vec<u16>, Vec<u16>) = installed
                .iter()
                .copied()
                .filter(|id| !here.contains(id))
                .partition(|id| inner.jobs.contains_key(id));
            for id in foreign {
                if log.foreign.insert(id) {
                    let on: Vec<&str> = inner.jobs[&id]
                        .parts
                        .iter()
                        .map(|p| p.appliance.as_str())
                        .collect();
                    log::error!(
                        "appliance {name:?} holds job {id}, which is admitted on {} and not there: left \
                         installed (is {name:?} one of those under another name or address?)",
                        on.join(", ")
                    );
                }
            }
            let missing = here
                .iter()
                .copied()
                .filter(|id| {
                    !installed.contains(id)
                        && inner.jobs[id].failed.is_none()
                        && !inner.checkpoints.held.contains_key(&(*id, name.to_string()))
                })
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
        log.foreign.retain(|id| installed.contains(id));
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
            let restore = match self.checkpoint_for(&job, name, sharded) {
                Ok(r) => r,
                Err(h) => {
                    self.hold(id, name, h);
                    continue;
                }
            };
            let result = match &restore {
                Some(r) => client.restore(id, &r.bytes),
                None => client.install(&job),
            };
            match result {
                Ok(()) => {
                    match &restore {
                        Some(r) => log::info!(
                            "reinstalled job {id} ({:?}) on appliance {name:?}, which had lost it, from its \
                             checkpoint ({})",
                            job.spec.name,
                            rounds_text(r.round_range)
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
                // retrying, unless the appliance restarted again meanwhile:
                // a refused checkpoint holds the part (as any unusable
                // one), a refused install fails the job.
                Err(DataplaneError::Refused {
                    status: 400, message, ..
                }) if client
                    .info()
                    .is_ok_and(|now| now.lcores.len() == info.lcores.len()) =>
                {
                    if restore.is_some() {
                        let h = Held {
                            file: checkpoint_path(&self.state_path, id, name, sharded),
                            why: format!("appliance {name:?} refuses to restore it: {message}"),
                        };
                        self.hold(id, name, h);
                    } else {
                        self.fail(
                            id,
                            &format!("the dataplane refuses to install it (appliance {name:?}): {message}"),
                        );
                    }
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
            let others: Vec<(String, Option<Client>)> = job
                .parts
                .iter()
                .filter(|p| p.appliance != name)
                .map(|p| (p.appliance.clone(), inner.client(&p.appliance).ok()))
                .collect();
            if let Some(j) = inner.jobs.get_mut(&id) {
                j.failed = Some(why.clone());
            }
            if let Err(e) = self.persist(&inner) {
                inner.jobs.insert(id, before);
                log::error!("job {id}: {why}; but that cannot be recorded ({e}): retrying");
                return None;
            }
            log::error!("job {id} failed: {why}");
            drop(inner);
            // Its other racks' parts would hold their memory and send
            // partials to a home that is gone: removed.
            for (other, client) in others {
                match client.map(|c| c.remove(id)) {
                    Some(Ok(_)) => log::warn!("job {id} failed: its part on appliance {other:?} is removed"),
                    Some(Err(e)) => log::warn!(
                        "job {id} failed; its part on appliance {other:?} could not be removed ({e}): remove it \
                         by evicting the job"
                    ),
                    None => {}
                }
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
    /// was placed anew since): `None` when the part has none (no file, and
    /// control took none). A file that cannot be read or decoded, is not
    /// the part's ([`Owner::check`]: another job's, another admission's,
    /// another part's), or cannot be moved, is refused, and so is a
    /// missing file control took a checkpoint into: the part must then be
    /// held, not installed without it.
    fn checkpoint_for(&self, job: &InstallJob, name: &str, sharded: bool) -> Result<Option<Restore>, Held> {
        let path = checkpoint_path(&self.state_path, job.id, name, sharded);
        let unusable = |why: String| Held {
            file: path.clone(),
            why,
        };
        // The stored job is cloned so that the file is read unlocked.
        let (stored, recorded) = {
            let inner = self.lock();
            let Some(stored) = inner.jobs.get(&job.id).cloned() else {
                return Ok(None);
            };
            let recorded = inner.checkpoints.taken.get(&(job.id, name.to_string())).cloned();
            (stored, recorded)
        };
        let Some(part) = part_of(&stored, name) else {
            return Ok(None);
        };
        let found = ckpt_file::read(&path, &owner(&stored, name, &part)).map_err(unusable)?;
        let Some((bytes, ckpt)) = found else {
            return match recorded {
                None => Ok(None),
                Some(c) => Err(unusable(format!(
                    "the file is gone (control took it: {}, {} bytes)",
                    rounds_text(c.round_range),
                    c.bytes
                ))),
            };
        };
        let round_range = ckpt.round_range();
        if ckpt.job.layout == job.layout {
            return Ok(Some(Restore { bytes, round_range }));
        }
        let moved = ckpt
            .relayout(job.layout.clone())
            .and_then(|c| c.encode())
            .map_err(|e| unusable(format!("it cannot be moved onto the part's layout: {e}")))?;
        log::info!(
            "job {} on appliance {name:?}: its checkpoint is moved onto its new layout, chunk by chunk",
            job.id
        );
        Ok(Some(Restore {
            bytes: moved,
            round_range,
        }))
    }

    /// Holds job `id`'s part on appliance `name` for `h`: it is not
    /// installed, its checkpoint is no longer listed, and the job says why
    /// (logged once per reason).
    fn hold(&self, id: u16, name: &str, h: Held) {
        let mut inner = self.lock();
        let Some(job) = inner.jobs.get(&id) else {
            return;
        };
        let job_name = job.spec.name.clone();
        let key = (id, name.to_string());
        inner.checkpoints.taken.remove(&key);
        if inner.checkpoints.held.get(&key) != Some(&h) {
            log::error!(
                "job {id} ({job_name:?}) held: part on appliance {name:?}: checkpoint {} unusable: {}; the part \
                 is not installed and the file is not written over: repair or restore it, then `phubctl job \
                 retry {id}` (or `--discard-checkpoint` to set it aside and start the part over)",
                h.file.display(),
                h.why
            );
            inner.checkpoints.held.insert(key, h);
        }
    }

    /// `POST /v1/jobs/{id}/retry`: each held part of job `id` is tried
    /// again. Its checkpoint file is read again and, if it is usable now,
    /// becomes the part's checkpoint and the part is restored from it at
    /// once (as reconciliation would: fitted to the appliance, the
    /// checkpoint moved onto the part's layout); if not, the job stays
    /// held and the error says why. With `discard`, the file is renamed
    /// aside instead and the part starts over without it. A part its
    /// appliance still has installed keeps its state there.
    fn retry(&self, id: u16, discard: bool) -> Result<RetryResponse, RequestError> {
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
                let part = part_of(&job, name).ok_or_else(|| not_admitted(id))?;
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
                    self.reconcile_one(&name, &client, &mut ReconcileLog::default());
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

    /// `GET /v1/appliances`: every appliance, asked for its description now.
    fn appliances(&self) -> Vec<ApplianceStatus> {
        let infos: BTreeMap<String, Result<DataplaneInfo, String>> = self
            .views(None, READ_WAIT)
            .into_iter()
            .map(|(n, v)| (n, v.map(|v| v.info)))
            .collect();
        let inner = self.lock();
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
                    down: a
                        .alias
                        .clone()
                        .or_else(|| infos.get(&a.spec.name).and_then(|r| r.as_ref().err().cloned())),
                    data: info.map(|i| i.data.clone()),
                    lcores: info.map(|i| u32::try_from(i.lcores.len()).unwrap_or(u32::MAX)),
                    memory_budget_bytes: info.map(|i| i.memory_budget_bytes),
                    memory_used_bytes: info.map(|i| i.memory_used_bytes),
                    jobs: inner.jobs_on(&a.spec.name),
                }
            })
            .collect()
    }

    /// `POST /v1/appliances`: manages one more appliance, durably, once it
    /// is known to be a phub dataplane that takes the management token and
    /// that control does not manage already under another name (by its URL
    /// in any spelling, its id or its data address). With `force`, one
    /// that does not answer is added unchecked (reconciliation checks it
    /// when it answers: an alias is then left alone, never reconciled).
    fn add_appliance(&self, a: ApplianceSpec, force: bool) -> Result<ApplianceStatus, RequestError> {
        check_appliance(&a).map_err(RequestError::BadRequest)?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        {
            let inner = self.lock();
            if let Some(old) = inner.appliances.get(&a.name) {
                return Err(RequestError::Conflict(format!(
                    "appliance {:?} already exists (at {}); remove it first",
                    a.name, old.spec.url
                )));
            }
            if let Some(old) = inner.appliances.values().find(|o| same_url(&o.spec.url, &a.url)) {
                return Err(RequestError::Conflict(format!(
                    "appliance {:?}: {} is the management API of appliance {:?} (at {}), which control \
                     manages already; one dataplane is managed under one name. Not added",
                    a.name, a.url, old.spec.name, old.spec.url
                )));
            }
        }
        let client = Client::new(&a.name, &a.url, token_path_of(&a));
        let info = match client.info() {
            Ok(info) => Some(info),
            Err(e) if e.is_unreachable() && force => {
                log::warn!(
                    "adding appliance {:?} at {}, which does not answer (--force): {e}",
                    a.name,
                    a.url
                );
                None
            }
            Err(e) if e.is_unreachable() => {
                return Err(RequestError::BadRequest(format!(
                    "{e}. Not added: give --force to add an appliance that is down (reconciliation checks \
                     it once it answers)"
                )))
            }
            Err(e) => {
                return Err(RequestError::BadRequest(format!(
                "appliance {:?}: {} does not answer as a phub dataplane's management API ({e}). Not added",
                a.name, a.url
            )))
            }
        };
        if let Some(info) = &info {
            if let Err(e) = client.check_token() {
                return Err(RequestError::BadRequest(format!(
                    "appliance {:?}: the management token in {} does not open the dataplane at {} ({e}); give \
                     the file its phub-dataplane wrote (token_file, phubctl --token-file). Not added",
                    a.name,
                    client.token_path().display(),
                    a.url
                )));
            }
            let views = self.views(None, READ_WAIT);
            let inner = self.lock();
            for other in inner.appliances.values() {
                let now = views
                    .get(&other.spec.name)
                    .and_then(|v| v.as_ref().ok())
                    .map(|v| &v.info);
                let theirs = now.or(other.info.as_ref());
                if let Some(why) = theirs.and_then(|t| watch::same_dataplane(info, t)) {
                    return Err(RequestError::Conflict(format!(
                        "appliance {:?} at {} is the dataplane control manages already as appliance {:?} (at \
                         {}): {why}; one dataplane is managed under one name. Not added",
                        a.name, a.url, other.spec.name, other.spec.url
                    )));
                }
            }
        }
        let mut inner = self.lock();
        if inner.appliances.contains_key(&a.name) {
            return Err(RequestError::Conflict(format!(
                "appliance {:?} was added meanwhile; remove it first",
                a.name
            )));
        }
        let name = a.name.clone();
        let mut added = Appliance::new(a);
        added.info = info;
        inner.appliances.insert(name.clone(), added);
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

/// Whether two management URLs name one API: the same scheme, path and
/// port, on hosts that resolve to a common address (`localhost` and
/// `127.0.0.1`), whatever their case or trailing `/`.
fn same_url(a: &str, b: &str) -> bool {
    use std::net::ToSocketAddrs as _;
    /// (scheme, "host:port", path) of an http(s) URL, lower-cased.
    fn split(url: &str) -> Option<(String, String, String)> {
        let url = url.trim().to_ascii_lowercase();
        let (scheme, rest) = url.split_once("://")?;
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let default = if scheme == "https" { 443 } else { 80 };
        let has_port = authority.rsplit_once(':').is_some_and(|(h, p)| {
            !h.ends_with(':') && p.bytes().all(|c| c.is_ascii_digit()) && !p.is_empty()
        });
        let hostport = if has_port {
            authority.to_string()
        } else {
            format!("{authority}:{default}")
        };
        Some((
            scheme.to_string(),
            hostport,
            path.trim_end_matches('/').to_string(),
        ))
    }
    let (Some((sa, ha, pa)), Some((sb, hb, pb))) = (split(a), split(b)) else {
        return a == b;
    };
    if sa != sb || pa != pb {
        return false;
    }
    if ha == hb {
        return true;
    }
    let resolve =
        |h: &str| -> Vec<SocketAddr> { h.to_socket_addrs().map(Iterator::collect).unwrap_or_default() };
    let ra = resolve(&ha);
    resolve(&hb).iter().any(|x| ra.contains(x))
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

/// Held while a checkpoint file is written or set aside (`job checkpoint`,
/// periodic checkpoints, `job retry`), so that two writers never race on
/// one file, its temporary or its `.prev`. Taken after `Shared::ops` when
/// both are.
static CHECKPOINT_FILES: Mutex<()> = Mutex::new(());

/// A checkpoint to restore a part from, on the part's layout.
#[derive(Debug)]
struct Restore {
    /// The file's bytes (moved onto the part's layout if need be).
    bytes: Vec<u8>,
    /// Its lowest and highest completed round.
    round_range: Option<(u32, u32)>,
}

/// What a checkpoint of job `job`'s part on appliance `name` must describe;
/// `part` is that part's layout ([`part_of`]).
fn owner<'a>(job: &'a StoredJob, name: &'a str, part: &'a Layout) -> Owner<'a> {
    let rack = led_rack(job, name).and_then(|i| u16::try_from(i).ok());
    let shape = match (rack_of(job, name), rack) {
        (Some(layout), Some(rack)) => PartShape::Rack { rack, layout },
        _ => PartShape::Flat(part),
    };
    Owner {
        id: job.id,
        token: job.token,
        spec: &job.spec,
        appliance: name,
        part: shape,
    }
}

/// "part on appliance "b": checkpoint FILE unusable: WHY".
fn held_text(name: &str, h: &Held) -> String {
    format!(
        "part on appliance {name:?}: checkpoint {} unusable: {}",
        h.file.display(),
        h.why
    )
}

/// "rounds 3..=5", "round 3", "no completed round".
fn rounds_text(r: Option<(u32, u32)>) -> String {
    match r {
        None => "no completed round".into(),
        Some((a, b)) if a == b => format!("round {a}"),
        Some((a, b)) => format!("rounds {a}..={b}"),
    }
}

/// When `path` was last written, in milliseconds since the Unix epoch (0
/// if that cannot be told).
fn modified_ms(path: &std::path::Path) -> u64 {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A job's last checkpoint over all its parts: rounds spanned, bytes
/// added up, the oldest part's time, the files listed (", "); `None`
/// until every part has one.
fn combined_checkpoint(inner: &Inner, job: &StoredJob) -> Option<CheckpointInfo> {
    let mut all: Option<CheckpointInfo> = None;
    for p in &job.parts {
        let c = inner.checkpoints.taken.get(&(job.id, p.appliance.clone()))?;
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
/// parts: those usable, and the parts held for a file that is there but
/// unusable ([`ckpt_file::read`]), so that a part held before a restart is
/// held after it.
fn load_checkpoints(state: &std::path::Path, jobs: &BTreeMap<u16, StoredJob>) -> Checkpoints {
    let mut out = Checkpoints::default();
    for job in jobs.values() {
        let id = job.id;
        for (name, part) in parts(job) {
            let path = checkpoint_path(state, id, name, job.parts.len() > 1);
            let key = (id, name.to_string());
            match ckpt_file::read(&path, &owner(job, name, &part)) {
                Ok(None) => {}
                Ok(Some((bytes, c))) => {
                    out.taken.insert(
                        key,
                        CheckpointInfo {
                            id,
                            round_range: c.round_range(),
                            bytes: bytes.len() as u64,
                            taken_unix_ms: modified_ms(&path),
                            file: path.display().to_string(),
                        },
                    );
                }
                Err(why) => {
                    let h = Held { file: path, why };
                    log::error!(
                        "job {id} ({:?}) held: {}; the part is not installed and the file is not written \
                         over: repair or restore it, then `phubctl job retry {id}` (or `--discard-checkpoint`)",
                        job.spec.name,
                        held_text(name, &h)
                    );
                    out.held.insert(key, h);
                }
            }
        }
    }
    out
}
