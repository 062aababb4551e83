//! The `phub-dataplane` program: parses the command line, starts one pinned
//! thread per queue (lcore) with its engine shard and backend queue, starts
//! the management thread, and runs until SIGINT or SIGTERM.
//!
//! With `--shm` (udp backend only) every job installed gets shared-memory
//! regions on every lcore that has slots of it ([`phub_engine::shm`]); they are
//! removed with the job and when the lcores stop at shutdown.

use std::net::{SocketAddr, SocketAddrV4};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use crossbeam_channel::bounded;
use phub_proto::api::{DataAddr, DataplaneInfo};
use phub_proto::fault::FaultSpec;

pub use crate::config::{parse_bytes, BackendKind, Config, DpdkOptions};

use crate::backend::{self, LcoreJob, LcoreStart, PacketIo, Started};
use crate::inject;
use crate::lcore::{Clock, LoopOptions};
use crate::mgmt::{self, LcoreHandle, Manager};
use crate::spin::SpinSetting;
use crate::topology::Topology;
use phub_engine::engine::Shard;
use phub_engine::kernels::Kernels;

/// A running dataplane.
pub struct Appliance {
    manager: Arc<Manager>,
    server: Option<phub_http::Server>,
    /// The management token file, when this dataplane made it (removed at
    /// a clean stop).
    made_token: Option<std::path::PathBuf>,
    mgmt_token: String,
    stop: Arc<AtomicBool>,
    mgmt_addr: SocketAddr,
    data: SocketAddrV4,
    /// What releases the backend after the lcores were told to stop.
    release: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for Appliance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Appliance")
            .field("mgmt_addr", &self.mgmt_addr)
            .field("data", &self.data)
            .finish_non_exhaustive()
    }
}

impl Appliance {
    /// Starts the backend `cfg` names, one lcore per queue running the
    /// shared poll loop over its engine shard, and the management API.
    pub fn start(cfg: &Config) -> Result<Appliance> {
        if cfg.backend == BackendKind::Dpdk && cfg.shm {
            bail!("--shm needs the udp backend (workers on this host)");
        }
        // Table blocks made ahead of the stores' growth, off the lcores
        // (a new block's pages faulted in on an lcore held its rounds).
        phub_engine::table::start_block_maker().context("starting the table block maker thread")?;
        let kernels = Kernels::best();
        let clock = Clock::start();
        let stop = Arc::new(AtomicBool::new(false));
        let opts = LoopOptions {
            // An appliance's DPDK lcores spin unless told to back off.
            busy_poll: match cfg.backend {
                BackendKind::Udp => cfg.busy_poll,
                BackendKind::Dpdk => !cfg.dpdk.idle_backoff,
            },
            // `--spin-us auto` is governed below, once the lcore count is
            // known; a DPDK lcore backing off (tests, small machines) does
            // not spin unless given a number.
            spin: crate::spin::gate(match (cfg.backend, cfg.spin_us) {
                (BackendKind::Dpdk, SpinSetting::Auto) => SpinSetting::Fixed(0),
                (_, s) => s,
            }),
            ..LoopOptions::default()
        };
        let spin = Arc::clone(&opts.spin);
        if let Some(f) = cfg.inject {
            log::warn!("injecting faults on every lcore, both directions: {f}");
        }
        let mut handles = Vec::new();
        let started = match cfg.backend {
            BackendKind::Udp => {
                let mut make = job_maker(kernels, clock, &stop, opts.clone(), cfg.inject, &mut handles);
                backend::udp::start(cfg, &mut make)?
            }
            #[cfg(feature = "dpdk")]
            BackendKind::Dpdk => {
                let mut make = job_maker(kernels, clock, &stop, opts.clone(), cfg.inject, &mut handles);
                backend::dpdk::start::start(cfg, &mut make, &stop)?
            }
            #[cfg(not(feature = "dpdk"))]
            BackendKind::Dpdk => bail!(
                "--backend dpdk: this build has no DPDK backend (built without the `dpdk` feature); use --backend udp"
            ),
        };
        let Started {
            backend,
            base_port,
            lcores,
            threads,
            nic_numa_node,
            slot_memory,
            memory_budget,
            port_stats,
            socket_drops,
            release,
        } = started;
        for (h, t) in handles.iter_mut().zip(threads) {
            h.thread = t;
        }
        // Only a kernel-UDP lcore that waits when idle spins before it does.
        let spins = cfg.backend == BackendKind::Udp && !opts.busy_poll;
        if spins && cfg.spin_us == SpinSetting::Auto {
            let counters: Vec<_> = handles.iter().map(|h| Arc::clone(&h.counters)).collect();
            let traffic = move || counters.iter().map(|c| c.rx_packets.get()).sum();
            crate::spin::govern(&spin, lcores.len(), traffic, &stop);
        }
        let id = phub_http::secret::random_token().context("cannot make the dataplane's id")?;
        let info = DataplaneInfo {
            id,
            backend,
            data: DataAddr {
                host: cfg.host.to_string(),
                base_port,
            },
            lcores,
            nic_numa_node: nic_numa_node.or_else(|| Topology::detect().nic_node(cfg.host)),
            memory_budget_bytes: memory_budget,
            memory_used_bytes: 0,
            memory_model: mgmt::memory_model(&*slot_memory),
            slot_memory: slot_memory.describe(),
            kernels: kernels.kind().name().into(),
            shm: cfg.shm,
            version: cfg.build.clone(),
        };
        let n = handles.len();
        let mut manager = Manager::new(info, handles, clock);
        if let Some(reader) = port_stats {
            manager = manager.with_port_stats(mgmt::PortStatsReader(reader));
        }
        if let Some(reader) = socket_drops {
            manager = manager.with_socket_drops(mgmt::SocketDropsReader(reader));
        }
        if spins {
            manager = manager.with_spin(spin);
        }
        let data = SocketAddrV4::new(cfg.host, base_port);
        match Appliance::serve(cfg, Arc::new(manager), Arc::clone(&stop), data) {
            Ok(mut app) => {
                log::info!(
                    "phub-dataplane: {n} {backend} lcore(s) on {}:{}..{}, kernels {}, slot memory: {} (budget {memory_budget} bytes), shared memory for local workers: {}, management API on {}",
                    cfg.host,
                    base_port,
                    base_port as usize + n - 1,
                    kernels.kind().name(),
                    slot_memory.describe(),
                    if cfg.shm { "on (/dev/shm)" } else { "off" },
                    app.mgmt_addr
                );
                app.release = release;
                Ok(app)
            }
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                if let Some(release) = release {
                    release();
                }
                Err(e)
            }
        }
    }

    /// Starts the management API over running lcores.
    fn serve(
        cfg: &Config,
        manager: Arc<Manager>,
        stop: Arc<AtomicBool>,
        data: SocketAddrV4,
    ) -> Result<Appliance> {
        if !phub_http::is_loopback(&cfg.mgmt) {
            log::warn!(
                "the management API listens on {} in clear text: keep it on loopback or a management network \
                 only control can reach (its token travels in every request)",
                cfg.mgmt
            );
        }
        // Bind first: the default token file is named after the bound port.
        let listener = std::net::TcpListener::bind(cfg.mgmt)
            .with_context(|| format!("binding the management API to {}", cfg.mgmt))?;
        let mgmt_addr = listener.local_addr().context("the management API's address")?;
        let token_path = cfg
            .mgmt_token_file
            .clone()
            .unwrap_or_else(|| phub_http::secret::mgmt_token_path(mgmt_addr.port()));
        let (mgmt_token, made) = phub_http::secret::load_or_create(&token_path)
            .with_context(|| "the management token file (--mgmt-token-file)".to_string())?;
        let api = mgmt::Api::new(Arc::clone(&manager), mgmt_token.clone(), token_path.clone());
        let limits = phub_http::Limits {
            body_bytes: api.body_limit(),
            inflight_body_bytes: api.body_limit(),
            ..phub_http::Limits::default()
        };
        let server = phub_http::Server::serve("phub-mgmt", listener, limits, None, Arc::new(api));
        let server = match server {
            Ok(s) => s,
            Err(e) => {
                if made {
                    let _ = std::fs::remove_file(&token_path);
                }
                return Err(e).with_context(|| format!("serving the management API on {mgmt_addr}"));
            }
        };
        log::info!("management token in {}", token_path.display());
        Ok(Appliance {
            manager,
            server: Some(server),
            made_token: made.then_some(token_path),
            mgmt_token,
            stop,
            mgmt_addr,
            data,
            release: None,
        })
    }

    /// Where the management API listens.
    pub fn mgmt_addr(&self) -> SocketAddr {
        self.mgmt_addr
    }

    /// The management token (for in-process users such as tests and tools).
    pub fn mgmt_token(&self) -> &str {
        &self.mgmt_token
    }

    /// Where queue 0 listens (queue i is on the next ports).
    pub fn data_addr(&self) -> SocketAddrV4 {
        self.data
    }

    /// The management state (for in-process use and tests).
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    /// Stops the management API and the lcores, and waits for them.
    pub fn shutdown(mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(p) = self.made_token.take() {
            let _ = std::fs::remove_file(p);
        }
        match Arc::get_mut(&mut self.manager) {
            Some(m) => m.join_lcores(&self.stop),
            None => log::warn!("management state still shared at shutdown; lcores stop on their own"),
        }
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// Makes each lcore's job as its backend starts it: an engine shard over the
/// lcore's slot memory and counters, a command queue the management side
/// keeps ([`LcoreHandle`], pushed to `handles`), and the poll loop with fault
/// injection when asked for.
fn job_maker<'h, Io: PacketIo>(
    kernels: Kernels,
    clock: Clock,
    stop: &Arc<AtomicBool>,
    opts: LoopOptions,
    faults: Option<FaultSpec>,
    handles: &'h mut Vec<LcoreHandle>,
) -> impl FnMut(LcoreStart<Io>) -> LcoreJob + 'h {
    let stop = Arc::clone(stop);
    move |l: LcoreStart<Io>| {
        let mut shard = Shard::with_parts(l.lcore, kernels, l.slot_memory, Arc::clone(&l.counters));
        if let Some(resolve) = l.io.peer_resolver() {
            shard.set_peer_resolver(resolve);
        }
        let (tx, rx) = bounded(64);
        handles.push(LcoreHandle {
            commands: tx,
            counters: l.counters,
            thread: None,
        });
        let stop = Arc::clone(&stop);
        let opts = opts.clone();
        Box::new(move || inject::run_lcore(l.io, shard, rx, stop, clock, opts, faults))
    }
}

/// Releases what the backend holds for the whole process once the
/// appliance has shut down (or failed to start): DPDK's EAL, with its
/// hugepage files and runtime directory. Nothing for the kernel-UDP backend.
pub fn release_process_resources() {
    #[cfg(feature = "dpdk")]
    if crate::backend::dpdk::start::cleanup_eal() {
        log::info!("phub-dataplane: DPDK EAL released");
    }
}

/// Runs the appliance `cfg` describes until SIGINT or SIGTERM, shuts it
/// down, and releases the process's backend resources
/// ([`release_process_resources`]) on every path, failures included.
pub fn serve(cfg: &Config) -> Result<()> {
    let run = || -> Result<()> {
        let app = Appliance::start(cfg)?;
        let (tx, rx) = bounded(1);
        let handler = ctrlc::set_handler(move || {
            let _ = tx.try_send(());
        })
        .context("installing the SIGINT/SIGTERM handler");
        if handler.is_ok() {
            let _ = rx.recv();
            log::info!("phub-dataplane: shutting down");
        }
        app.shutdown();
        handler
    };
    let r = run();
    release_process_resources();
    r
}

/// `phub-dataplane`'s entry point; `build` is the build stamp to report.
pub fn main(build: &str) -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let (mut cfg, file) = Config::load();
    if let Some(f) = file {
        log::info!("configuration file {}", f.display());
    }
    cfg.build = build.to_string();
    match serve(&cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("phub-dataplane: {e:#}");
            ExitCode::FAILURE
        }
    }
}
