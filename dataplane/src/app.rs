//! The `phub-dataplane` program: parses the command line, starts one pinned
//! thread per queue (lcore) with its engine shard and backend queue, starts
//! the management thread, and runs until SIGINT or SIGTERM.
//!
//! With `--shm` (udp backend only) every job installed gets shared-memory
//! regions on every lcore that has slots of it ([`crate::shm`]); they are
//! removed with the job and when the lcores stop at shutdown.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, ValueEnum};
use crossbeam_channel::bounded;
use phub_proto::api::{DataAddr, DataplaneInfo, LcoreInfo};

use crate::backend::udp::UdpQueue;
use crate::engine::Shard;
use crate::kernels::Kernels;
use crate::lcore::{self, Clock, LoopOptions};
use crate::mgmt::{self, LcoreHandle, Manager};
use crate::slotmem::{RustHeap, SlotAllocator};
use crate::topology::Topology;

/// Packet I/O backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Kernel UDP sockets: runs anywhere.
    Udp,
    /// DPDK poll-mode driver: the port and lcores given by `--eal` and
    /// `--port` (needs the build's `dpdk` feature, on by default).
    Dpdk,
}

/// phub-dataplane: aggregates gradient chunks and runs the optimizer.
#[derive(Debug, Clone, Parser)]
#[command(name = "phub-dataplane", version)]
pub struct Config {
    /// Packet I/O backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Udp)]
    pub backend: BackendKind,
    /// IPv4 address the data queues listen on (what workers send to).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: Ipv4Addr,
    /// UDP port of queue 0; queue i listens on base + i (0: any free ports).
    #[arg(long, default_value_t = 7900)]
    pub base_port: u16,
    /// Number of queues, each with its own lcore thread (default: one per CPU).
    #[arg(long)]
    pub lcores: Option<usize>,
    /// Address of the management API (for phub-control).
    #[arg(long, default_value = "127.0.0.1:7800")]
    pub mgmt: SocketAddr,
    /// Slot memory the dataplane may hold, e.g. 1GiB, 512MiB or bytes.
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub memory_budget: u64,
    /// Spin on empty queues instead of waiting in the kernel.
    #[arg(long)]
    pub busy_poll: bool,
    /// Inject faults on every queue, both directions (tests and soaks), e.g.
    /// `loss=0.05,dup=0.01,reorder=0.01,seed=7`. Off by default.
    #[arg(long, value_name = "FAULTS")]
    pub inject: Option<phub_proto::fault::FaultSpec>,
    /// Do not pin lcore threads to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// Socket buffer size per queue, bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub socket_buffer: usize,
    /// Shared memory for workers on this host: every job gets, per lcore, a
    /// staging region per rank and a result region in /dev/shm (mode 0600,
    /// removed with the job), so such workers send headers only
    /// (PROTOCOL.md §3.4). Workers elsewhere are unaffected. Needs the udp
    /// backend.
    #[arg(long)]
    pub shm: bool,
    /// Build stamp reported by the management API (set by the binary).
    #[arg(skip = String::from("phub"))]
    pub build: String,
    /// DPDK backend options.
    #[command(flatten)]
    pub dpdk: DpdkOptions,
}

/// Options of the DPDK backend (`--backend dpdk`).
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct DpdkOptions {
    /// EAL arguments, split on whitespace, e.g. "--no-pci --vdev=net_af_packet0,iface=veth1 --no-huge -m 512".
    /// Without -l/--lcores, phub maps lcore 0 (management) and one data lcore per queue;
    /// without --no-huge/--in-memory/--huge-unlink it adds --in-memory.
    #[arg(long, allow_hyphen_values = true, value_name = "ARGS")]
    pub eal: Option<String>,
    /// One more EAL argument, kept whole (repeatable).
    #[arg(long, allow_hyphen_values = true, value_name = "ARG")]
    pub eal_arg: Vec<String>,
    /// The DPDK port: an id or a device name (e.g. net_af_packet0).
    #[arg(long, default_value = "0")]
    pub port: String,
    /// Instead of --port, a port made of rings named NAME-rx<i> (frames in for
    /// lcore i) and NAME-tx<i> (frames out of it; the peer may hand them back on
    /// NAME-done<i> to be freed by lcore i), which another DPDK process
    /// of this runtime attaches to as a secondary (same --file-prefix;
    /// needs hugepages): a co-located packet generator, zero copies between
    /// them. NAME: 1 to 19 bytes. phub does not add --in-memory then.
    #[arg(long, value_name = "NAME", conflicts_with = "port")]
    pub ring_port: Option<String>,
    /// MAC address to answer ARP with and send from (default: the port's).
    #[arg(long)]
    pub mac: Option<String>,
    /// MTU to configure (clamped to what the device takes).
    #[arg(long, default_value_t = 9000)]
    pub mtu: u16,
    /// RX descriptors per queue (clamped to the device).
    #[arg(long, default_value_t = 1024)]
    pub rx_desc: u16,
    /// TX descriptors per queue (clamped to the device).
    #[arg(long, default_value_t = 1024)]
    pub tx_desc: u16,
    /// RX mbufs (0: enough for every queue's descriptors and hand-off ring).
    #[arg(long, default_value_t = 0)]
    pub mbufs: u32,
    /// Buffer bytes per RX mbuf, 128 of headroom included (af_packet needs its framesz + 96).
    #[arg(long, default_value_t = 16384 + 128)]
    pub mbuf_size: u16,
    /// Header mbufs for results, one per destination (payload mbufs, one per
    /// result: a quarter).
    #[arg(long, default_value_t = 16384)]
    pub tx_mbufs: u32,
    /// Idle backoff: pause, then sleep briefly after a run of empty polls
    /// (for tests and small machines; an appliance's lcores spin).
    #[arg(long)]
    pub idle_backoff: bool,
}

impl Default for DpdkOptions {
    fn default() -> DpdkOptions {
        DpdkOptions {
            eal: None,
            eal_arg: Vec::new(),
            port: "0".into(),
            ring_port: None,
            mac: None,
            mtu: 9000,
            rx_desc: 1024,
            tx_desc: 1024,
            mbufs: 0,
            mbuf_size: 16384 + 128,
            tx_mbufs: 16384,
            idle_backoff: false,
        }
    }
}

/// Parses `123`, `64KiB`, `512MiB`, `1GiB` (also KB/MB/GB as powers of 1000).
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a number of bytes like 1GiB or 512MiB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        u => {
            return Err(format!(
                "{s:?}: unknown unit {u:?}; accepted: B, KiB, MiB, GiB, KB, MB, GB"
            ))
        }
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?}: too large"))
}

/// A running dataplane.
pub struct Appliance {
    manager: Arc<Manager>,
    server: Arc<tiny_http::Server>,
    mgmt_thread: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    mgmt_addr: SocketAddr,
    data: SocketAddrV4,
    #[cfg(feature = "dpdk")]
    dpdk: Option<crate::backend::dpdk::start::Runtime>,
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
    /// Starts the lcores and the management API.
    pub fn start(cfg: &Config) -> Result<Appliance> {
        if cfg.backend == BackendKind::Dpdk {
            if cfg.shm {
                bail!("--shm needs the udp backend (workers on this host)");
            }
            return Appliance::start_dpdk(cfg);
        }
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        let n = cfg.lcores.unwrap_or(cores.len().max(1));
        if n == 0 || n > 256 {
            bail!("--lcores {n}: expected 1 to 256");
        }
        let kernels = Kernels::best();
        let topology = Topology::detect();
        let clock = Clock::start();
        let stop = Arc::new(AtomicBool::new(false));
        // Bind every queue first, so a port clash fails before anything runs.
        let mut queues = Vec::with_capacity(n);
        let mut base = cfg.base_port;
        for i in 0..n {
            let port = if cfg.base_port == 0 && i > 0 {
                base + i as u16
            } else {
                cfg.base_port.wrapping_add(i as u16)
            };
            let addr = SocketAddrV4::new(cfg.host, if cfg.base_port == 0 && i == 0 { 0 } else { port });
            let q = UdpQueue::bind(addr, cfg.socket_buffer)
                .with_context(|| format!("binding queue {i} to {addr}"))?;
            if cfg.base_port == 0 && i == 0 {
                base = q.local_addr()?.port();
            }
            queues.push(q);
        }
        let data = SocketAddrV4::new(cfg.host, base);
        let opts = LoopOptions {
            busy_poll: cfg.busy_poll,
            faults: cfg.inject,
            ..LoopOptions::default()
        };
        if let Some(f) = cfg.inject {
            log::warn!("injecting faults on every queue, both directions: {f}");
        }
        let mut handles = Vec::with_capacity(n);
        let mut infos = Vec::with_capacity(n);
        for (i, q) in queues.into_iter().enumerate() {
            let shard = Shard::new(i as u16, kernels);
            let counters = Arc::clone(shard.counters());
            let (tx, rx) = bounded(64);
            let core = (!cfg.no_pin && !cores.is_empty()).then(|| cores[i % cores.len()]);
            let stop = Arc::clone(&stop);
            let thread = std::thread::Builder::new()
                .name(format!("phub-lcore-{i}"))
                .spawn(move || {
                    if let Some(c) = core {
                        core_affinity::set_for_current(c);
                    }
                    lcore::run(q, shard, rx, stop, clock, opts)
                })
                .context("spawning an lcore thread")?;
            handles.push(LcoreHandle {
                commands: tx,
                counters,
                thread: Some(thread),
            });
            infos.push(LcoreInfo {
                lcore: i as u16,
                cpu: core.map(|c| c.id),
                numa_node: core.and_then(|c| topology.cpu_node(c.id)),
            });
        }
        let info = DataplaneInfo {
            backend: "udp".into(),
            data: DataAddr {
                host: cfg.host.to_string(),
                base_port: base,
            },
            lcores: infos,
            nic_numa_node: topology.nic_node(cfg.host),
            memory_budget_bytes: cfg.memory_budget,
            memory_used_bytes: 0,
            slot_memory: RustHeap.describe(),
            kernels: kernels.kind().name().into(),
            shm: cfg.shm,
            version: cfg.build.clone(),
        };
        let manager = Arc::new(Manager::new(info, handles, clock));
        let app = Appliance::serve(cfg, manager, stop, data)?;
        log::info!(
            "phub-dataplane: {} udp queue(s) on {}:{}..{}, kernels {}, slot memory: {} (budget {} bytes), shared memory for local workers: {}, management API on {}",
            n,
            cfg.host,
            base,
            base as usize + n - 1,
            kernels.kind().name(),
            RustHeap.describe(),
            cfg.memory_budget,
            if cfg.shm { "on (/dev/shm)" } else { "off" },
            app.mgmt_addr
        );
        Ok(app)
    }

    /// Starts the management API over running lcores.
    fn serve(
        cfg: &Config,
        manager: Arc<Manager>,
        stop: Arc<AtomicBool>,
        data: SocketAddrV4,
    ) -> Result<Appliance> {
        let server = tiny_http::Server::http(cfg.mgmt)
            .map_err(|e| anyhow::anyhow!("binding the management API to {}: {e}", cfg.mgmt))?;
        let server = Arc::new(server);
        let mgmt_addr = server
            .server_addr()
            .to_ip()
            .context("the management API is not on an IP address")?;
        let mgmt_thread = {
            let (s, m, st) = (Arc::clone(&server), Arc::clone(&manager), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("phub-mgmt".into())
                .spawn(move || mgmt::serve(s, m, st))
                .context("spawning the management thread")?
        };
        Ok(Appliance {
            manager,
            server,
            mgmt_thread: Some(mgmt_thread),
            stop,
            mgmt_addr,
            data,
            #[cfg(feature = "dpdk")]
            dpdk: None,
        })
    }

    /// `--backend dpdk`: the EAL, the port, one EAL lcore per queue running
    /// the shared poll loop, and the same management API.
    #[cfg(feature = "dpdk")]
    fn start_dpdk(cfg: &Config) -> Result<Appliance> {
        use crate::backend::dpdk::start;
        let kernels = Kernels::best();
        let topology = Topology::detect();
        let clock = Clock::start();
        let stop = Arc::new(AtomicBool::new(false));
        let s = start::start(cfg, kernels, clock, &stop)?;
        let data = SocketAddrV4::new(cfg.host, s.base_port);
        let budget = start::memory_budget(cfg.memory_budget, &s.slot_memory);
        let info = DataplaneInfo {
            backend: "dpdk".into(),
            data: DataAddr {
                host: cfg.host.to_string(),
                base_port: s.base_port,
            },
            lcores: s.infos,
            nic_numa_node: s.socket.or_else(|| topology.nic_node(cfg.host)),
            memory_budget_bytes: budget,
            memory_used_bytes: 0,
            slot_memory: s.slot_memory.describe(),
            kernels: kernels.kind().name().into(),
            shm: false,
            version: cfg.build.clone(),
        };
        let reader = start::port_stats_reader(s.runtime.port());
        let manager = Manager::new(info, s.lcores, clock)
            .with_port_stats(crate::mgmt::PortStatsReader(Box::new(reader)));
        let runtime = s.runtime;
        let s_mem = s.slot_memory.describe();
        match Appliance::serve(cfg, Arc::new(manager), Arc::clone(&stop), data) {
            Ok(mut app) => {
                log::info!(
                    "phub-dataplane: slot memory: {} (budget {budget} bytes), management API on {}",
                    s_mem,
                    app.mgmt_addr
                );
                app.dpdk = Some(runtime);
                Ok(app)
            }
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                runtime.stop();
                Err(e)
            }
        }
    }

    #[cfg(not(feature = "dpdk"))]
    fn start_dpdk(_cfg: &Config) -> Result<Appliance> {
        bail!("--backend dpdk: this build has no DPDK backend (built without the `dpdk` feature); use --backend udp")
    }

    /// Where the management API listens.
    pub fn mgmt_addr(&self) -> SocketAddr {
        self.mgmt_addr
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
        self.stop.store(true, Ordering::Relaxed);
        self.server.unblock();
        if let Some(t) = self.mgmt_thread.take() {
            let _ = t.join();
        }
        match Arc::get_mut(&mut self.manager) {
            Some(m) => m.join_lcores(&self.stop),
            None => log::warn!("management state still shared at shutdown; lcores stop on their own"),
        }
        #[cfg(feature = "dpdk")]
        if let Some(rt) = self.dpdk.take() {
            rt.stop();
        }
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
    let mut cfg = Config::parse();
    cfg.build = build.to_string();
    match serve(&cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("phub-dataplane: {e:#}");
            ExitCode::FAILURE
        }
    }
}
