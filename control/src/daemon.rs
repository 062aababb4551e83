//! The phub-control daemon: the HTTP API of `phub_proto::api`, admission,
//! rendezvous, the appliances, the state file and the reconcile loop.
//!
//! Threads: the HTTP listener (phub-http: bounded connections, header and
//! body limits, timeouts, TLS) with its handler pool, one reconcile
//! thread, and one heartbeat thread (with a short-lived thread per
//! heartbeat in flight and per epoch install), which nothing slow (an
//! install, a checkpoint, a reconciliation) holds up.
//! Control manages a set of appliances (dataplanes), each with a name, a
//! rack label, a management client and its last description. A job lives on
//! one or several of them: its layout spans their lcores in order, and each
//! holds its part (`crate::job`). The appliances and jobs live behind one
//! mutex that is never held across an HTTP call to a dataplane. Calls that
//! change the dataplanes' sets of jobs or control's set of appliances
//! (admission, eviction, reconcile, appliance add and remove) take a second
//! lock for their whole duration, so they never interleave: an evicted job
//! cannot be reinstalled behind the eviction's back, and a job is recorded
//! only after every appliance of it installed its part.
//!
//! This file starts and stops the daemon; the rest is one file per concept:
//!
//! - `config`: the command line, [`Config`], token paths, `--appliance`;
//! - `http`: auth, body limits, each `phub_proto::routes::ControlRoute`
//!   to its handler (one arm per route), errors as statuses;
//! - `registry`: the appliances and jobs behind the lock, the state file
//!   they are saved to (every change through `Shared::commit`: saved, or
//!   undone in memory), the appliances' last descriptions;
//! - `admit`, `join`, `evict`: the job's use cases that change it;
//! - `views`: the read routes (list, show, map, stats, metrics);
//! - `checkpoints`, `retry`: checkpoint files, held parts, their retry;
//! - `reconcile`: the loop that installs again what a dataplane lost;
//! - `heartbeat`: the thread that declares an appliance down when it
//!   stops answering, and `failover`: what that does to the replicated
//!   jobs on it (their new epoch, or their failure);
//! - `appliances`: the appliances' routes (list, add, remove).

mod admit;
mod appliances;
mod checkpoints;
mod config;
mod drain;
mod evict;
mod failover;
mod heartbeat;
mod http;
mod join;
mod leader;
mod reconcile;
mod registry;
mod retry;
mod views;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use phub_proto::api::ApplianceSpec;

pub use self::config::{
    check_appliance, default_mgmt_token_path, default_token_path, parse_appliance, Config, Heartbeat,
    CONFIG_FILE, HEARTBEAT_DEADLINE_MS, HEARTBEAT_MS, MAX_HEARTBEAT_DEADLINE_MS,
};
pub use self::http::{LEADER_HEADER, MAX_BODY_BYTES, MAX_SMALL_BODY_BYTES};
pub use crate::state::etcd::{EtcdSecurity, EtcdTarget};

use self::checkpoints::{load_checkpoints, CheckpointFiles};
use self::config::{load_or_create_token, Args, StateArg};
use self::registry::{Appliance, Entry, Inner, Shared};
use crate::state::etcd::EtcdStore;
use crate::state::store::Store;
use crate::state::{StoredJob, DEFAULT_APPLIANCE};

/// Entry point of the `phub-control` binary: parses flags, runs until
/// SIGINT or SIGTERM, then shuts down cleanly.
pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let (args, file) = phub_appliance::config::parse_or_exit::<Args>(std::path::Path::new(CONFIG_FILE));
    if let Some(f) = file {
        log::info!("configuration file {}", f.display());
    }
    let explicit = args.dataplane.is_some() || args.dataplane_token_file.is_some();
    let security = args.etcd.security().unwrap_or_else(|e| {
        eprintln!("phub-control: {e}");
        std::process::exit(2)
    });
    let (state, etcd) = match args.state {
        StateArg::File(path) => {
            if security != EtcdSecurity::default() {
                eprintln!("phub-control: --etcd-ca, --etcd-cert, --etcd-user and their kin go with --state etcd://...");
                std::process::exit(2)
            }
            (path, None)
        }
        StateArg::Etcd(target) => (
            args.state_dir.join("phub-control"),
            Some(target.with_security(security)),
        ),
    };
    let mut config = Config {
        listen: args.listen,
        appliances: args.appliance,
        state,
        etcd,
        advertise: args.advertise_url,
        lease_ttl: Duration::from_secs(args.lease_ttl),
        reconcile_interval: Duration::from_millis(args.reconcile_ms),
        operator_token: args.operator_token_file,
        dataplane_token: args.dataplane_token_file,
        tls: args.tls_cert.zip(args.tls_key),
        insecure_listen: args.insecure_listen,
        heartbeat: Heartbeat {
            interval: Duration::from_millis(args.heartbeat_ms),
            deadline: Duration::from_millis(args.heartbeat_deadline_ms),
            spare_after: args.spare_after_ms.map(Duration::from_millis),
        },
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
    // Holds the store (a state file's lock for the daemon's life).
    shared: Arc<Shared>,
    // Dropping the sender stops the election thread.
    elect_wake: Option<mpsc::Sender<()>>,
    operator_token: String,
    addr: SocketAddr,
    server: Option<phub_http::Server>,
    // Dropping the sender wakes the reconcile thread, which then exits.
    reconcile_wake: Option<mpsc::Sender<()>>,
    // Dropping the sender stops the heartbeat thread.
    heartbeat_stop: Option<mpsc::Sender<()>>,
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
        config.heartbeat.check().map_err(anyhow::Error::msg)?;
        let store = match &config.etcd {
            None => Store::file(config.state.clone())?,
            Some(target) => Store::Etcd(Box::new(EtcdStore::new(target.clone())?)),
        };
        let loaded = store.load()?.unwrap_or_default();
        let token_path = config.operator_token_path();
        let operator_token = load_or_create_token(&token_path)?;
        let recorded = loaded.appliances.clone().unwrap_or_default();
        for a in &config.appliances {
            check_appliance(a).map_err(anyhow::Error::msg)?;
        }
        let mut specs = leader::merged(&recorded, &config.appliances);
        if specs.is_empty() {
            let a = config.default_appliance();
            specs.insert(a.name.clone(), a);
        }
        let given: Vec<ApplianceSpec> = if recorded.is_empty() {
            specs.values().cloned().collect()
        } else {
            config.appliances.clone()
        };
        let jobs: BTreeMap<u16, StoredJob> = loaded.jobs.into_iter().map(|j| (j.id, j)).collect();
        for job in jobs.values() {
            if let Some(p) = job.parts.iter().find(|p| !specs.contains_key(&p.appliance)) {
                anyhow::bail!(
                    "{}: job {} is on appliance {:?}, which neither the {} nor the command line names; \
                     give it with --appliance name={},url=<its management URL>",
                    store.describe(),
                    job.id,
                    p.appliance,
                    if store.etcd().is_some() {
                        "state in etcd"
                    } else {
                        "state file"
                    },
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
        let mut checkpoint_files = CheckpointFiles::default();
        let checkpoints = load_checkpoints(&config.state, &jobs, &mut checkpoint_files);
        let shared = Arc::new_cyclic(|this| Shared {
            this: this.clone(),
            state_path: config.state.clone(),
            store,
            lead: leader::Leadership::new(config.lease_ttl, given),
            interval: config.reconcile_interval,
            beat: config.heartbeat.interval,
            operator_token,
            token_path: token_path.clone(),
            inner: Mutex::new(Inner {
                checkpoints,
                rejoining: std::collections::BTreeSet::new(),
                appliances,
                jobs,
            }),
            ops: Mutex::new(()),
            reconcile_poke: Mutex::new(None),
            gone_back: Mutex::new(BTreeMap::new()),
            checkpoint_files: Mutex::new(checkpoint_files),
        });
        if changed && !shared.lock().jobs.is_empty() && shared.store.etcd().is_none() {
            // The appliances given at start are recorded (with the jobs on
            // them), so a restart without them still knows where the jobs
            // are; without jobs, the first change records them. In etcd,
            // the leader records them when it wins (`leader`).
            let inner = shared.lock();
            let first = inner.jobs.keys().next().copied().expect("jobs are there");
            shared.persist(&inner, Entry::Job(first))?;
        }
        let limits = phub_http::Limits {
            body_bytes: MAX_BODY_BYTES,
            inflight_body_bytes: 4 * MAX_BODY_BYTES,
            ..phub_http::Limits::default()
        };
        let server = phub_http::Server::bind("control-http", config.listen, limits, tls, shared.clone())
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let addr = server.local_addr();
        let me = config
            .advertise
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{addr}"));
        shared.lead.me.set(me).expect("set once, here");
        // The first campaign before the threads: a lone control leads at once.
        shared.elect();
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
                shared.store.place(),
                inner.jobs.len()
            );
        }
        let mut threads = Vec::new();
        let (wake, sleep) = mpsc::channel::<()>();
        *shared.reconcile_poke.lock().unwrap_or_else(|p| p.into_inner()) = Some(wake.clone());
        let rs = shared.clone();
        threads.push(
            std::thread::Builder::new()
                .name("control-reconcile".into())
                .spawn(move || {
                    let mut logs = BTreeMap::new();
                    loop {
                        // A follower neither reconciles nor checkpoints.
                        if rs.acts() {
                            rs.reconcile(&mut logs);
                            rs.periodic_checkpoints();
                        }
                        // A poke runs the next pass now; the senders
                        // gone (shutdown) end the thread.
                        match sleep.recv_timeout(rs.interval) {
                            Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                            Err(mpsc::RecvTimeoutError::Disconnected) => break,
                        }
                    }
                })
                .context("cannot start the reconcile thread")?,
        );
        let (elect_wake, elect_sleep) = mpsc::channel::<()>();
        if shared.store.etcd().is_some() {
            let es = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("control-elect".into())
                    .spawn(move || {
                        while let Err(mpsc::RecvTimeoutError::Timeout) =
                            elect_sleep.recv_timeout(es.lead.tick())
                        {
                            es.elect();
                        }
                    })
                    .context("cannot start the election thread")?,
            );
        }
        let (beat_stop, beat_sleep) = mpsc::channel::<()>();
        let hs = shared.clone();
        let timing = config.heartbeat;
        threads.push(
            std::thread::Builder::new()
                .name("control-heartbeat".into())
                .spawn(move || hs.heartbeats(timing, &beat_sleep))
                .context("cannot start the heartbeat thread")?,
        );
        Ok(Daemon {
            operator_token: shared.operator_token.clone(),
            shared,
            elect_wake: Some(elect_wake),
            addr,
            server: Some(server),
            reconcile_wake: Some(wake),
            heartbeat_stop: Some(beat_stop),
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
        self.shared
            .reconcile_poke
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.elect_wake.take();
        self.heartbeat_stop.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // A follower takes over at once rather than after the lease's TTL.
        self.shared.resign();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_threads();
    }
}
