//! phub-dataplane's command line and options: clap's defaults are the
//! only defaults ([`Config::default`] is the command line without
//! arguments).

use std::net::{Ipv4Addr, SocketAddr};

use clap::{Args, Parser};

/// The UDP port of queue 0 unless `--base-port` says otherwise.
pub const DEFAULT_BASE_PORT: u16 = 7900;

/// The most lcores (queues) one dataplane runs.
pub const MAX_LCORES: usize = 256;

pub use phub_proto::api::BackendKind;

/// `--backend`'s parser: the names [`BackendKind`] has, listed in `--help`
/// (phub-bench's `--backend` takes the same).
pub fn backend_parser() -> impl clap::builder::TypedValueParser<Value = BackendKind> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(BackendKind::ALL.map(BackendKind::name))
        .try_map(|s| s.parse::<BackendKind>())
}

/// phub-dataplane: aggregates gradient chunks and runs the optimizer.
#[derive(Debug, Clone, Parser)]
#[command(name = "phub-dataplane", version)]
pub struct Config {
    /// Packet I/O backend.
    #[arg(long, value_parser = backend_parser(), default_value_t = BackendKind::Udp)]
    pub backend: BackendKind,
    /// IPv4 address the data queues listen on (what workers send to).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: Ipv4Addr,
    /// UDP port of queue 0; queue i listens on base + i. 0: the backend
    /// picks (kernel UDP: a free port for queue 0 from the kernel; DPDK,
    /// which owns every port of its address: the default).
    #[arg(long, default_value_t = DEFAULT_BASE_PORT)]
    pub base_port: u16,
    /// Number of queues, each with its own lcore thread (default: one per CPU).
    #[arg(long)]
    pub lcores: Option<usize>,
    /// Address of the management API (for phub-control).
    #[arg(long, default_value = "127.0.0.1:7800")]
    pub mgmt: SocketAddr,
    /// The management token file: control reads it to install, restore and
    /// remove jobs and to read checkpoints. Read if it exists, else created
    /// (owner-only, random token) and removed at a clean stop. Default:
    /// `<runtime dir>/dataplane-<management port>.token`, the runtime dir
    /// being $PHUB_RUNTIME_DIR, /run/phub for root, $XDG_RUNTIME_DIR/phub or
    /// /tmp/phub-<uid>.
    #[arg(long, value_name = "FILE")]
    pub mgmt_token_file: Option<std::path::PathBuf>,
    /// Memory the dataplane may give jobs, every byte admission counts:
    /// slot buffers and records, blocks, per-rank and per-key bookkeeping
    /// and, with --shm, region files; e.g. 1GiB, 512MiB or bytes.
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub memory_budget: u64,
    /// Spin on empty queues instead of waiting in the kernel.
    #[arg(long)]
    pub busy_poll: bool,
    /// Without --busy-poll (udp backend): keep polling for this many
    /// microseconds after the last datagram before waiting in the kernel (0:
    /// wait at once). A datagram that comes meanwhile is taken without
    /// waking a sleeping thread; an idle lcore still sleeps. `auto`, the
    /// default: 200 while there is room for it (no CPU quota under one CPU
    /// per lcore and one more on the dataplane's cgroups, no throttling
    /// lately, no crowd of other threads waiting for the CPUs the lcores
    /// leave), 0 otherwise, decided every second (docs/OPERATING.md).
    #[arg(long, default_value = "auto", value_name = "US|auto")]
    pub spin_us: crate::spin::SpinSetting,
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
    /// With --ring-port: the peer on the rings takes results with their IPv4
    /// and UDP checksums left for it to fill in, as a NIC with TX checksum
    /// offload does (the lcores copy results without summing them).
    #[arg(long, requires = "ring_port")]
    pub ring_port_tx_checksums: bool,
    /// MAC address to answer ARP with and send from (default: the port's).
    #[arg(long)]
    pub mac: Option<String>,
    /// Another appliance's Ethernet address on this port's segment, as
    /// IP=MAC (repeatable): where a hierarchical job's partial sums and
    /// results for it go (PROTOCOL.md §9). The DPDK backend does not ask
    /// by ARP.
    #[arg(long, value_name = "IP=MAC")]
    pub neighbor: Vec<String>,
    /// The next hop's Ethernet address for appliances not given by
    /// --neighbor (another rack's appliance, behind a router).
    #[arg(long, value_name = "MAC")]
    pub gateway_mac: Option<String>,
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
    /// Sum the IPv4 and UDP checksums of results in software even where the
    /// port would fill them in (by default a port with both TX checksum
    /// offloads fills them in, and the lcore copies results without summing).
    #[arg(long)]
    pub software_tx_checksums: bool,
}

impl Default for Config {
    /// What the command line gives with no arguments.
    fn default() -> Config {
        Config::parse_from(["phub-dataplane"])
    }
}

impl Default for DpdkOptions {
    /// What the command line gives with no DPDK arguments.
    fn default() -> DpdkOptions {
        Config::default().dpdk
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

/// The configuration file read when `--config` is not given, if it exists
/// (see `phub_appliance::config`).
pub const CONFIG_FILE: &str = "/etc/phub/dataplane.toml";

impl Config {
    /// The command line over the configuration file (`--config FILE`, else
    /// [`CONFIG_FILE`] if it exists); prints the error and exits on a
    /// mistake in either. Returns the file read, if any.
    pub fn load() -> (Config, Option<std::path::PathBuf>) {
        phub_appliance::config::parse_or_exit(std::path::Path::new(CONFIG_FILE))
    }

    /// The number of lcores to run: `--lcores`, or `available` (one per CPU,
    /// or per EAL worker lcore) without it; 1 to [`MAX_LCORES`], and no more
    /// than are available.
    pub fn lcore_count(&self, available: usize) -> anyhow::Result<usize> {
        let n = self.lcores.unwrap_or(available.clamp(1, MAX_LCORES));
        if n == 0 || n > MAX_LCORES {
            anyhow::bail!("--lcores {n}: expected 1 to {MAX_LCORES}");
        }
        Ok(n)
    }
}
