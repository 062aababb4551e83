//! Virtual racks for `phub-bench run --local --racks R`: on one machine, a
//! network namespace per rack (the rack's switch and its emulated workers),
//! one per rack appliance (a phub-dataplane on kernel UDP behind a link of
//! its own, or with `--backend dpdk` on DPDK's af_packet driver over that
//! link: [`dpdk_port`]), and a spine namespace that routes between the
//! racks' uplinks and runs phub-control. Links are veth pairs; `--spine-gbps` and
//! `--appliance-gbps` put a tbf qdisc on both ends of every uplink and
//! every appliance link. The bytes that cross the spine are read from the
//! spine's interfaces' counters before and after the timed rounds, never
//! computed from the model.
//!
//! Addresses are private and exist only inside these namespaces (rack r is
//! 1-based):
//!
//! ```text
//!                  spine: phub-control on 10.77.0.1 (its lo), forwarding
//!          rk1 10.77.101.1 |                  | rk2 10.77.102.1
//!      uplink 10.77.101.2  |                  | uplink 10.77.102.2
//!   rack1: its workers, forwarding        rack2: ...
//!          appl 10.77.1.1  |
//!           nic 10.77.1.2  appl1: phub-dataplane (data 7900+, management 7800)
//! ```
//!
//! With `--backend dpdk` DPDK holds 10.77.r.2 and the kernel 10.77.r.3,
//! where the management API listens.
//!
//! Every namespace (with its interfaces and their qdiscs) is deleted when
//! [`RackNet`] is dropped, on an error too, and on SIGINT, SIGTERM or SIGHUP
//! ([`phub_hwtests::process::stop_on_signal`] deletes the namespaces
//! [`Netns`] registered).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use phub_hwtests::dataplane_args::{Backend as DataplaneBackend, DataplaneArgs};
use phub_hwtests::process::{self, Daemon};
use phub_hwtests::virt::{self, Netns};
use serde::Serialize;

use super::failover::{self, Act, Kill};
use super::local;
use super::run::{self, Backend, RunArgs, RunResult};
use crate::profiles::Profile;

/// Most racks `--racks` builds.
pub const MAX_RACKS: usize = 16;
/// phub-control's address, on the spine namespace's loopback device.
pub const CONTROL_IP: &str = "10.77.0.1";
/// phub-control's port.
pub const CONTROL_PORT: u16 = 7700;
/// Each appliance's management port (on its own address).
pub const MGMT_PORT: u16 = 7800;
/// UDP port of each appliance's lcore 0.
pub const BASE_PORT: u16 = 7900;
/// MTU of every link (an 8 KiB chunk and its headers fit in one frame).
const MTU: &str = "9000";

/// Rack `r`'s appliance (1-based), on its appliance link.
pub fn appliance_ip(r: usize) -> String {
    format!("10.77.{r}.2")
}

/// Rack `r`'s appliance's management address with `--backend dpdk`: the
/// kernel's on the appliance link, where DPDK holds [`appliance_ip`].
pub fn appliance_mgmt_ip(r: usize) -> String {
    format!("10.77.{r}.3")
}

/// Rack `r`'s switch end of its appliance link.
fn tor_ip(r: usize) -> String {
    format!("10.77.{r}.1")
}

/// Rack `r`'s uplink: the spine's end (`spine` true) or the rack's.
fn uplink_ip(r: usize, spine: bool) -> String {
    format!("10.77.{}.{}", 100 + r, if spine { 1 } else { 2 })
}

/// The spine's interface towards rack `r`.
fn spine_if(r: usize) -> String {
    format!("rk{r}")
}

/// Rack `r`'s label (control's `--appliance ...,rack=`, and what its
/// workers say at join).
pub fn rack_label(r: usize) -> String {
    format!("r{r}")
}

/// The appliance named for rack `r` in control.
pub fn appliance_name(r: usize) -> String {
    format!("rack{r}")
}

/// Most ranks [`RackNet::add_workers`] gives links of their own.
pub const MAX_WORKER_LINKS: usize = 250;

/// Rank `rank`'s address (0-based) on its own link ([`RackNet::add_workers`]).
pub fn worker_ip(rank: usize) -> String {
    format!("10.78.{rank}.2")
}

/// The rack switch's end of rank `rank`'s link.
fn worker_gw(rank: usize) -> String {
    format!("10.78.{rank}.1")
}

/// `phub-bench run --local --racks R ...`'s options.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct RackArgs {
    /// Virtual racks (as root, with --local): a network namespace per rack
    /// holding its W/R workers, an appliance behind its own link in each,
    /// and a spine namespace routing between the racks' uplinks.
    #[arg(long, value_name = "R")]
    pub racks: Option<usize>,
    /// Appliances the job is sharded over: the first N racks' (default: R;
    /// 1: rack 1's alone, mode "single").
    #[arg(long, value_name = "N", requires = "racks")]
    pub appliances: Option<usize>,
    /// Flat sharding (the default): every worker sends each chunk straight
    /// to its home appliance, across the spine when it is in another rack.
    #[arg(long, requires = "racks", conflicts_with = "hierarchical")]
    pub flat: bool,
    /// Hierarchical aggregation (`[placement] hierarchical = true` over
    /// every rack's appliance): each worker sends every chunk to its own
    /// rack's appliance, which exchanges one partial sum per chunk with the
    /// chunk's home across the spine.
    #[arg(long, requires = "racks")]
    pub hierarchical: bool,
    /// Limit each rack's uplink to G Gbit/s, both ways (tbf).
    #[arg(long, value_name = "G", requires = "racks")]
    pub spine_gbps: Option<f64>,
    /// Limit each appliance's link to G Gbit/s, both ways (tbf).
    #[arg(long, value_name = "G", requires = "racks")]
    pub appliance_gbps: Option<f64>,
    /// Give every worker a namespace of its own behind a link of its own to
    /// its rack's switch, limited to G Gbit/s both ways (tbf), as a rack's
    /// hosts have (without it the rack's workers share the rack's namespace).
    #[arg(long, value_name = "G", requires = "racks")]
    pub worker_gbps: Option<f64>,
    /// Drop PCT percent of the UDP datagrams the spine forwards between
    /// racks, at random (nftables `numgen random` in the spine namespace;
    /// the management API's TCP is spared): loss on the cross-rack hop only.
    #[arg(long, value_name = "PCT", requires = "racks", value_parser = clap::value_parser!(u32).range(1..100))]
    pub spine_loss: Option<u32>,
    /// Queue of each limited link's tbf, in ms at its rate (at least 1 MiB).
    #[arg(long, value_name = "MS", default_value_t = 50.0, requires = "racks")]
    pub link_queue_ms: f64,
    /// Right after the job's rounds, run the same job on rack 1's appliance
    /// alone (same network, limits, workers and rounds) and report the
    /// speed-up of the sharded job over it.
    #[arg(long, requires = "racks")]
    pub compare_single: bool,
    /// With --hierarchical: right after its rounds, run the same job flat
    /// over the same appliances (same network, limits, workers and rounds)
    /// and report the hierarchical round's share of the flat round.
    #[arg(long, requires = "hierarchical")]
    pub compare_flat: bool,
}

/// The virtual racks' figures in `phub-bench run`'s JSON (all null without
/// `--racks`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RackFigures {
    /// R.
    pub racks: Option<usize>,
    /// Appliances the job was sharded over.
    pub appliances: Option<usize>,
    /// `flat`, `hierarchical` or `single` (one appliance).
    pub mode: Option<String>,
    /// Workers in each rack.
    pub workers_per_rack: Vec<usize>,
    /// Bytes that entered the spine per timed round: the spine's
    /// rack-facing interfaces' received bytes (Ethernet frames), after
    /// minus before the timed rounds, over the rounds.
    pub cross_rack_bytes_per_round: Option<f64>,
    /// `--spine-gbps`.
    pub spine_gbps: Option<f64>,
    /// `--appliance-gbps`.
    pub appliance_gbps: Option<f64>,
    /// `--worker-gbps`.
    pub worker_gbps: Option<f64>,
    /// `--spine-loss`, and the datagrams the spine dropped for it over the
    /// whole run (warm-up and comparisons included).
    pub spine_loss_pct: Option<u32>,
    /// Datagrams the spine's loss rule dropped.
    pub spine_dropped: Option<u64>,
    /// `--compare-single`: the median round of the same job on rack 1's
    /// appliance alone, same run, ms.
    pub single_round_ms_median: Option<f64>,
    /// Its bytes across the spine per round.
    pub single_cross_rack_bytes_per_round: Option<f64>,
    /// single_round_ms_median / round_ms_median (> 1: sharding is faster).
    pub speedup_vs_single: Option<f64>,
    /// `--compare-flat`: the median round of the same job flat over the
    /// same appliances, same run, ms.
    pub flat_round_ms_median: Option<f64>,
    /// Its bytes across the spine per round.
    pub flat_cross_rack_bytes_per_round: Option<f64>,
    /// round_ms_median / flat_round_ms_median (< 1: hierarchical is faster).
    pub round_ratio_vs_flat: Option<f64>,
}

/// Where `run`'s workers run and what counts the bytes crossing the spine
/// (the virtual racks'; the default is the caller's network, no spine).
#[derive(Default)]
pub struct Fabric<'a> {
    /// Each rank's network namespace (empty: the calling thread's).
    pub rank_ns: Vec<String>,
    /// The rack label each rank says at join (empty: none said).
    pub rank_rack: Vec<String>,
    /// Bytes that entered the spine so far.
    pub spine_bytes: Option<&'a (dyn Fn() -> Result<u64> + Sync)>,
}

impl Fabric<'_> {
    /// Rank `rank`'s namespace, if it has one.
    pub fn ns_of(&self, rank: u16) -> Option<&str> {
        self.rank_ns.get(usize::from(rank)).map(String::as_str)
    }

    /// The rack label rank `rank` says at join, if any.
    pub fn rack_of(&self, rank: u16) -> Option<String> {
        self.rank_rack.get(usize::from(rank)).cloned()
    }
}

/// The racks' network: namespaces, veth pairs, routes and qdiscs.
#[derive(Debug)]
pub struct RackNet {
    /// The spine (routes between uplinks; phub-control runs here).
    pub spine: Netns,
    /// Rack r's switch and workers (index r - 1).
    pub racks: Vec<Netns>,
    /// Rack r's appliance (index r - 1).
    pub appliances: Vec<Netns>,
    /// Each rank's own namespace behind its own link to its rack's switch
    /// ([`RackNet::add_workers`]; empty: the ranks run in their rack's).
    pub workers: Vec<Netns>,
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

fn ip(ns: &Netns, args: &[&str]) -> Result<()> {
    ns.ip(args).map_err(|e| anyhow!(e))
}

/// IPv4 forwarding on (or off) and IPv6 off in `ns` (no router
/// solicitations in the interfaces' byte counters).
fn sysctls(ns: &Netns, forward: bool) -> Result<()> {
    run_cmd(ns.command("sysctl").args([
        "-qw",
        &format!("net.ipv4.ip_forward={}", u8::from(forward)),
        "net.ipv6.conf.all.disable_ipv6=1",
        "net.ipv6.conf.default.disable_ipv6=1",
    ]))
}

/// A tbf qdisc limiting what `dev` in `ns` sends to `gbps` Gbit/s: a burst
/// of 1 ms at that rate (at least 64 KiB) and a queue of `queue_ms` (at
/// least 1 MiB).
fn tbf(ns: &Netns, dev: &str, gbps: f64, queue_ms: f64) -> Result<()> {
    let bytes_per_s = gbps * 1e9 / 8.0;
    let burst = ((bytes_per_s * 1e-3) as u64).max(64 << 10);
    let limit = ((bytes_per_s * queue_ms / 1e3) as u64).max(1 << 20);
    run_cmd(Command::new("tc").args([
        "-n",
        &ns.name,
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        &format!("{gbps}gbit"),
        "burst",
        &burst.to_string(),
        "limit",
        &limit.to_string(),
    ]))
}

/// A veth pair: `a` in `ns_a`, `b` in `ns_b`, both up at [`MTU`] with
/// their addresses (/24).
fn link(ns_a: &Netns, a: &str, ip_a: &str, ns_b: &Netns, b: &str, ip_b: &str) -> Result<()> {
    ip(
        ns_a,
        &[
            "link", "add", a, "type", "veth", "peer", "name", b, "netns", &ns_b.name,
        ],
    )?;
    for (ns, dev, addr) in [(ns_a, a, ip_a), (ns_b, b, ip_b)] {
        ip(ns, &["link", "set", dev, "mtu", MTU, "up"])?;
        ip(ns, &["addr", "add", &format!("{addr}/24"), "dev", dev])?;
    }
    Ok(())
}

/// `ip -s -j link show` in namespace `ns`: every interface and its
/// counters (those /sys/class/net shows inside the namespace).
fn links_json(ns: &str) -> Result<serde_json::Value> {
    let out = Command::new("ip")
        .args(["-n", ns, "-s", "-j", "link", "show"])
        .output()
        .context("ip -s -j link show")?;
    ensure!(
        out.status.success(),
        "ip -n {ns} -s -j link show: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    serde_json::from_slice(&out.stdout).context("ip's JSON")
}

/// Interface `name`'s byte counter `dir` (`rx` or `tx`) in `links`
/// ([`links_json`]).
fn link_counter(links: &serde_json::Value, name: &str, dir: &str) -> Result<u64> {
    links
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["ifname"] == name)
        .and_then(|l| l["stats64"][dir]["bytes"].as_u64())
        .with_context(|| format!("no {dir} byte counter for {name}"))
}

/// Interface `name` in namespace `ns`: bytes received and sent so far.
fn link_bytes(ns: &str, name: &str) -> Result<(u64, u64)> {
    let links = links_json(ns)?;
    Ok((
        link_counter(&links, name, "rx")?,
        link_counter(&links, name, "tx")?,
    ))
}

impl RackNet {
    /// Builds `racks` racks and the spine; says why it cannot (not root, no
    /// `ip` or `tc`, a link that cannot be made).
    pub fn create(
        racks: usize,
        spine_gbps: Option<f64>,
        appliance_gbps: Option<f64>,
        queue_ms: f64,
    ) -> Result<RackNet> {
        if let Some(why) = virt::unavailable() {
            bail!("--racks builds virtual racks of network namespaces, which {why}");
        }
        let spine = Netns::create("spine").map_err(|e| anyhow!("creating the spine namespace: {e}"))?;
        let mut net = RackNet {
            spine,
            racks: Vec::new(),
            appliances: Vec::new(),
            workers: Vec::new(),
        };
        // Built into `net` step by step: an error drops what exists.
        sysctls(&net.spine, true)?;
        ip(&net.spine, &["link", "set", "lo", "up"])?;
        ip(
            &net.spine,
            &["addr", "add", &format!("{CONTROL_IP}/32"), "dev", "lo"],
        )?;
        for r in 1..=racks {
            let rack = Netns::create(&format!("rack{r}")).map_err(|e| anyhow!("creating rack {r}: {e}"))?;
            net.racks.push(rack);
            let appl = Netns::create(&format!("appl{r}"))
                .map_err(|e| anyhow!("creating rack {r}'s appliance: {e}"))?;
            net.appliances.push(appl);
            let (rack, appl) = (&net.racks[r - 1], &net.appliances[r - 1]);
            sysctls(rack, true)?;
            sysctls(appl, false)?;
            ip(rack, &["link", "set", "lo", "up"])?;
            ip(appl, &["link", "set", "lo", "up"])?;
            link(
                &net.spine,
                &spine_if(r),
                &uplink_ip(r, true),
                rack,
                "uplink",
                &uplink_ip(r, false),
            )?;
            link(rack, "appl", &tor_ip(r), appl, "nic", &appliance_ip(r))?;
            ip(appl, &["route", "add", "default", "via", &tor_ip(r)])?;
            ip(rack, &["route", "add", "default", "via", &uplink_ip(r, true)])?;
            ip(
                &net.spine,
                &[
                    "route",
                    "add",
                    &format!("10.77.{r}.0/24"),
                    "via",
                    &uplink_ip(r, false),
                ],
            )?;
            if let Some(g) = spine_gbps {
                tbf(&net.spine, &spine_if(r), g, queue_ms)?;
                tbf(rack, "uplink", g, queue_ms)?;
            }
            if let Some(g) = appliance_gbps {
                tbf(rack, "appl", g, queue_ms)?;
                tbf(appl, "nic", g, queue_ms)?;
            }
        }
        Ok(net)
    }

    /// Gives every rank a namespace of its own (`wk<rank>`) with a link
    /// (`nic`, [`worker_ip`]) to its rack's switch (`rack_of[rank]`,
    /// 0-based), limited to `gbps` Gbit/s both ways when given, and routes
    /// to it from the spine.
    pub fn add_workers(&mut self, rack_of: &[usize], gbps: Option<f64>, queue_ms: f64) -> Result<()> {
        ensure!(
            rack_of.len() <= MAX_WORKER_LINKS,
            "{} ranks with links of their own: at most {MAX_WORKER_LINKS}",
            rack_of.len()
        );
        for (rank, &r) in rack_of.iter().enumerate() {
            let rack = self
                .racks
                .get(r)
                .with_context(|| format!("rank {rank} in rack {}, of {}", r + 1, self.racks.len()))?;
            let ns = Netns::create(&format!("wk{rank}"))
                .map_err(|e| anyhow!("creating rank {rank}'s namespace: {e}"))?;
            self.workers.push(ns);
            let (ns, sw) = (&self.workers[rank], format!("w{rank}"));
            sysctls(ns, false)?;
            ip(ns, &["link", "set", "lo", "up"])?;
            link(rack, &sw, &worker_gw(rank), ns, "nic", &worker_ip(rank))?;
            ip(ns, &["route", "add", "default", "via", &worker_gw(rank)])?;
            ip(
                &self.spine,
                &[
                    "route",
                    "add",
                    &format!("10.78.{rank}.0/24"),
                    "via",
                    &uplink_ip(r + 1, false),
                ],
            )?;
            if let Some(g) = gbps {
                tbf(rack, &sw, g, queue_ms)?;
                tbf(ns, "nic", g, queue_ms)?;
            }
        }
        Ok(())
    }

    /// Bytes every rank's own link has carried so far, both ways (its
    /// `nic`'s received plus sent), in rank order ([`RackNet::add_workers`]).
    pub fn worker_link_bytes(&self) -> Result<Vec<u64>> {
        self.workers
            .iter()
            .map(|ns| {
                let (rx, tx) = link_bytes(&ns.name, "nic")?;
                Ok(rx + tx)
            })
            .collect()
    }

    /// Drops `pct` percent of the UDP datagrams the spine forwards, at
    /// random, with a counter ([`RackNet::spine_dropped`]).
    pub fn spine_loss(&self, pct: u32) -> Result<()> {
        let nft = |rule: &str| {
            run_cmd(Command::new("ip").args(["netns", "exec", &self.spine.name, "nft", rule]))
                .map_err(|e| anyhow!("--spine-loss needs nftables (apt-get install nftables): {e}"))
        };
        nft("add table inet phub")?;
        nft("add chain inet phub spine_loss { type filter hook forward priority 0 ; }")?;
        nft(&format!(
            "add rule inet phub spine_loss meta l4proto udp numgen random mod 100 lt {pct} counter drop"
        ))
    }

    /// Datagrams the spine's loss rule dropped so far.
    pub fn spine_dropped(&self) -> Result<u64> {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.spine.name,
                "nft",
                "list",
                "chain",
                "inet",
                "phub",
                "spine_loss",
            ])
            .output()
            .context("running nft")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let n = text
            .split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow!("no drop counter in the spine's rules: {text}"))?;
        Ok(n)
    }

    /// Bytes the spine has received from the racks so far: the sum of its
    /// rack-facing interfaces' `rx_bytes` (`ip -s -j link show`, the
    /// counters /sys/class/net shows inside the namespace). A datagram from
    /// one rack to another enters the spine once.
    pub fn spine_rx_bytes(&self) -> Result<u64> {
        let links = links_json(&self.spine.name)?;
        let mut total = 0;
        for r in 1..=self.racks.len() {
            total += link_counter(&links, &spine_if(r), "rx")
                .with_context(|| format!("in the spine ({})", self.spine.name))?;
        }
        Ok(total)
    }

    /// Runs `f` on a thread inside namespace `ns`: the processes and
    /// threads it starts are in it too.
    fn inside<T: Send>(ns: &Netns, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        Self::inside_named(&ns.name, f)
    }

    /// [`RackNet::inside`] for the namespace named `ns`.
    pub(super) fn inside_named<T: Send>(ns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        std::thread::scope(|s| {
            s.spawn(|| {
                virt::try_enter_netns(ns).map_err(|e| anyhow!(e))?;
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

/// Rack (0-based) of each of `workers` ranks: contiguous blocks, as even
/// as the division allows.
pub fn rack_of_ranks(workers: usize, racks: usize) -> Vec<usize> {
    (0..workers).map(|w| w * racks / workers).collect()
}

/// How many of the ranks `of` ([`rack_of_ranks`]) each of `racks` racks
/// holds.
pub fn ranks_per_rack(of: &[usize], racks: usize) -> Vec<usize> {
    let mut per = vec![0; racks];
    for &r in of {
        per[r] += 1;
    }
    per
}

/// The racks' processes: a dataplane per rack and control.
pub(super) struct Appliances {
    // Control stops first, then the dataplanes (Daemon's Drop, on an error).
    control: Daemon,
    dataplanes: Vec<Daemon>,
    /// How each dataplane was started, to start it again (`--restart-after-ms`).
    launches: Vec<Launch>,
    pub(super) control_url: String,
    pub(super) token: String,
}

/// How a dataplane of the virtual racks is started: in its namespace, its
/// program, arguments, environment and log, and the management URL it
/// answers on once up.
struct Launch {
    ns: String,
    name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    url: String,
}

impl Launch {
    /// Starts it (its log at `log`) and waits for its management API.
    fn spawn(&self, log: &Path) -> Result<Daemon> {
        let mut d = RackNet::inside_named(&self.ns, || {
            Daemon::spawn(&self.name, &self.program, &self.args, &self.env, log).map_err(anyhow::Error::from)
        })?;
        d.wait_up(
            &process::dataplane_ready(&self.url),
            Duration::from_secs(20),
            || false,
        )
        .map_err(|e| anyhow!(e))?;
        Ok(d)
    }
}

impl Appliances {
    /// Starts dataplane `i` again (after it was killed), empty, on the
    /// same namespace, addresses and ports; its log is the first one's
    /// with `.restart` appended.
    fn restart(&mut self, i: usize) -> Result<()> {
        let l = &self.launches[i];
        let log = l.log.with_extension("log.restart");
        self.dataplanes[i] = l.spawn(&log)?;
        Ok(())
    }

    /// Kills (SIGKILL) dataplane `i` and waits for it to exit
    /// (`Act::Kill`, `true`), or starts it again (`Act::Restart`: whether
    /// it came up, saying why not); `false` for anything else.
    pub(super) fn kill_or_restart(&mut self, i: usize, act: Act) -> bool {
        match act {
            Act::Kill => {
                self.dataplanes[i].kill();
                true
            }
            Act::Restart => self
                .restart(i)
                .map_err(|e| eprintln!("phub-bench: cannot start {} again: {e:#}", appliance_name(i + 1)))
                .is_ok(),
            Act::Drain => false,
        }
    }

    /// Stops control, then the dataplanes, saying which did not stop on
    /// SIGTERM.
    pub(super) fn stop(mut self) {
        for d in std::iter::once(&mut self.control).chain(self.dataplanes.iter_mut()) {
            if !d.stop(Duration::from_secs(5)) {
                eprintln!("phub-bench: {} did not stop on SIGTERM; killed it", d.name());
            }
        }
    }
}

/// The program and leading arguments that run phub-dataplane and
/// phub-control: this program's `serve-*` subcommands, or the binaries in
/// `--bin-dir`.
fn programs(bin_dir: Option<&Path>) -> Result<[(PathBuf, Vec<String>); 2]> {
    match bin_dir {
        None => {
            let me = std::env::current_exe().context("finding this program")?;
            Ok([
                (me.clone(), vec!["serve-dataplane".into()]),
                (me, vec!["serve-control".into()]),
            ])
        }
        Some(d) => {
            let progs = [d.join("phub-dataplane"), d.join("phub-control")];
            for p in &progs {
                ensure!(
                    p.exists(),
                    "{} not found (build it with `cargo build --release --bins`)",
                    p.display()
                );
            }
            let [dp, ctl] = progs;
            Ok([(dp, vec![]), (ctl, vec![])])
        }
    }
}

/// How the racks' daemons are started: the programs' directory, the
/// dataplanes' options (all but their addresses, ports, tokens and
/// budget, which [`start`] fills in) and environment, and control's extra
/// arguments.
pub(super) struct Daemons<'a> {
    /// `--bin-dir` (none: this program's `serve-*` subcommands).
    pub bin_dir: Option<&'a Path>,
    /// Every dataplane's options.
    pub dataplane: DataplaneArgs,
    /// Every dataplane's environment.
    pub env: Vec<(String, String)>,
    /// Arguments appended to phub-control's.
    pub control_extra: Vec<String>,
    /// The dataplanes on DPDK ([`dpdk_port`]) instead of kernel UDP.
    pub dpdk: bool,
}

impl<'a> Daemons<'a> {
    /// `phub-bench run`'s.
    fn of_run(a: &'a RunArgs) -> Daemons<'a> {
        Daemons {
            bin_dir: a.bin_dir.as_deref(),
            dataplane: DataplaneArgs {
                lcores: Some(a.lcores),
                busy_poll: a.busy_poll,
                no_pin: a.no_pin,
                socket_buffer: a.socket_buffer,
                inject: a.inject.as_ref().map(ToString::to_string),
                extra: a.dataplane_arg.clone(),
                ..DataplaneArgs::default()
            },
            env: [("PHUB_UDP_GSO", a.no_gso), ("PHUB_UDP_GRO", a.no_gro)]
                .into_iter()
                .filter(|(_, off)| *off)
                .map(|(k, _)| (k.to_string(), "0".to_string()))
                .collect(),
            control_extra: a.failover.control_args(),
            dpdk: a.backend == Backend::Dpdk,
        }
    }
}

/// Starts each rack's phub-dataplane in its appliance namespace and
/// phub-control in the spine (the calling thread's namespace), and waits
/// for their APIs.
pub(super) fn start(d: &Daemons<'_>, net: &RackNet, dir: &Path, budget: u64) -> Result<Appliances> {
    let [(dp_prog, dp_pre), (ctl_prog, ctl_pre)] = programs(d.bin_dir)?;
    let mut dataplanes = Vec::new();
    let mut launches = Vec::new();
    let mut control_args = ctl_pre;
    control_args.extend([
        "--listen".into(),
        format!("{CONTROL_IP}:{CONTROL_PORT}"),
        "--insecure-listen".into(),
        "--state".into(),
        dir.join("state.json").display().to_string(),
    ]);
    control_args.extend(d.control_extra.iter().cloned());
    for (i, ns) in net.appliances.iter().enumerate() {
        let r = i + 1;
        let host = appliance_ip(r);
        let token = dir.join(format!("appl{r}.token"));
        let mut dp = DataplaneArgs {
            backend: Some(DataplaneBackend::Udp),
            host: Some(host.clone()),
            base_port: Some(BASE_PORT),
            mgmt: Some(format!("{host}:{MGMT_PORT}")),
            mgmt_token_file: Some(token.clone()),
            memory_budget: Some(budget.to_string()),
            ..d.dataplane.clone()
        };
        if d.dpdk {
            dpdk_port(net, r, &mut dp, budget)?;
        }
        let mgmt_host = if d.dpdk { appliance_mgmt_ip(r) } else { host };
        let url = format!("http://{mgmt_host}:{MGMT_PORT}");
        let mut args = dp_pre.clone();
        args.extend(dp.to_args());
        let launch = Launch {
            ns: ns.name.clone(),
            name: format!("phub-dataplane (rack {r})"),
            program: dp_prog.clone(),
            args,
            env: d.env.clone(),
            log: dir.join(format!("phub-dataplane-{r}.log")),
            url: url.clone(),
        };
        dataplanes.push(launch.spawn(&launch.log)?);
        launches.push(launch);
        control_args.extend([
            "--appliance".into(),
            format!(
                "name={},url={url},rack={},token-file={}",
                appliance_name(r),
                rack_label(r),
                token.display()
            ),
        ]);
    }
    let control_url = format!("http://{CONTROL_IP}:{CONTROL_PORT}");
    let mut control = Daemon::spawn(
        "phub-control",
        &ctl_prog,
        &control_args,
        &[],
        &dir.join("phub-control.log"),
    )?;
    control
        .wait_up(
            &process::control_ready(&control_url),
            Duration::from_secs(20),
            || false,
        )
        .map_err(|e| anyhow!(e))?;
    let path = dir.join("state.json.operator-token");
    let token = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_string();
    Ok(Appliances {
        control,
        dataplanes,
        launches,
        control_url,
        token,
    })
}

/// Rack `r`'s appliance link made a DPDK port, and `dp` told to use it:
/// DPDK's af_packet driver on the appliance's end (`nic`) holds the data
/// address [`appliance_ip`] (the kernel gives it up, so that it neither
/// answers ARP for it nor sends ICMP errors for the datagrams DPDK takes),
/// the kernel keeps [`appliance_mgmt_ip`] there for the management API,
/// and every frame DPDK sends goes to the rack switch's Ethernet address
/// (`--gateway-mac`: workers, control and the other appliances are all
/// behind it). The switch's end sends no GSO super-packets, which
/// af_packet would take as one frame. Its idle lcores back off.
fn dpdk_port(net: &RackNet, r: usize, dp: &mut DataplaneArgs, budget: u64) -> Result<()> {
    let (rack, appl) = (&net.racks[r - 1], &net.appliances[r - 1]);
    let mgmt = appliance_mgmt_ip(r);
    // The data address goes first (its removal would take a second
    // address of the subnet with it), then the route that went with it.
    ip(
        appl,
        &["addr", "del", &format!("{}/24", appliance_ip(r)), "dev", "nic"],
    )?;
    ip(appl, &["addr", "add", &format!("{mgmt}/24"), "dev", "nic"])?;
    ip(appl, &["route", "replace", "default", "via", &tor_ip(r)])?;
    ip(rack, &["link", "set", "appl", "gso_max_segs", "1"])?;
    let links = links_json(&rack.name)?;
    let mac = links
        .as_array()
        .and_then(|l| l.iter().find(|i| i["ifname"] == "appl"))
        .and_then(|i| i["address"].as_str())
        .ok_or_else(|| anyhow!("rack {r}'s switch has no Ethernet address on its appliance link: {links}"))?
        .to_string();
    let lcores = dp.lcores.unwrap_or(1);
    dp.backend = Some(DataplaneBackend::Dpdk);
    // Several racks' lcores share the machine's cores: an idle one sleeps
    // rather than spin (as the tests' virtual rack does).
    dp.idle_backoff = true;
    dp.mgmt = Some(format!("{mgmt}:{MGMT_PORT}"));
    dp.eal = Some(virt::af_packet_eal_on("nic", lcores, &appl.name, budget));
    dp.extra.extend(["--gateway-mac".to_string(), mac]);
    Ok(())
}

/// Why these link rates (each a flag and its value, if given) or this
/// tbf queue cannot be, if they cannot.
pub(super) fn check_links(rates: &[(&str, Option<f64>)], queue_ms: f64) -> Result<()> {
    ensure!(
        queue_ms.is_finite() && (0.0..=10_000.0).contains(&queue_ms),
        "--link-queue-ms {queue_ms}: expected 0 to 10000"
    );
    for &(flag, g) in rates {
        if let Some(g) = g {
            ensure!(
                g.is_finite() && (0.001..=400.0).contains(&g),
                "{flag} {g}: expected Gbit/s from 0.001 to 400"
            );
        }
    }
    Ok(())
}

/// Why `--racks` cannot run with these options, if it cannot.
fn check(a: &RunArgs) -> Result<(usize, usize)> {
    let ra = &a.rack;
    let racks = ra.racks.unwrap_or(1);
    ensure!(
        a.control.is_none(),
        "--racks builds its own appliances: drop --control"
    );
    ensure!(
        (1..=MAX_RACKS).contains(&racks),
        "--racks {racks}: expected 1 to {MAX_RACKS}"
    );
    ensure!(
        !a.shm,
        "--racks with --shm: the workers are in other namespaces than the appliances; drop --shm"
    );
    ensure!(
        a.baseline.is_none(),
        "--racks with --baseline: not supported; drop one of them"
    );
    ensure!(
        a.workers >= racks,
        "--workers {} with --racks {racks}: expected at least one worker per rack",
        a.workers
    );
    let n = ra.appliances.unwrap_or(racks);
    ensure!(
        (1..=racks).contains(&n),
        "--appliances {n}: expected 1 to --racks ({racks}), one appliance per rack"
    );
    ensure!(
        !ra.compare_single || n >= 2,
        "--compare-single with --appliances 1: the job is on one appliance already"
    );
    check_links(
        &[
            ("--spine-gbps", ra.spine_gbps),
            ("--appliance-gbps", ra.appliance_gbps),
            ("--worker-gbps", ra.worker_gbps),
        ],
        ra.link_queue_ms,
    )?;
    ensure!(
        ra.worker_gbps.is_none() || a.workers <= MAX_WORKER_LINKS,
        "--worker-gbps with --workers {}: at most {MAX_WORKER_LINKS} workers have links of their own",
        a.workers
    );
    ensure!(
        !ra.hierarchical || (racks >= 2 && n == racks),
        "--hierarchical with --racks {racks} --appliances {n}: every rack's appliance takes part \
         (two racks or more); drop --appliances"
    );
    ensure!(
        !ra.hierarchical || a.consistency == phub_proto::spec::Consistency::Sync,
        "--hierarchical with --consistency {}: hierarchical jobs are BSP only",
        a.consistency
    );
    Ok((racks, n))
}

/// One point of `phub-bench run --local --racks R`: builds the racks, starts
/// an appliance per rack and control, runs the job sharded over the first N
/// appliances (and with `--compare-single` the same job on rack 1's
/// appliance alone), and removes it all.
pub fn run_point(a: &RunArgs, profile: &Profile, label: &str) -> Result<RunResult> {
    let (racks, n) = check(a)?;
    let kill_index = failover::check(
        &a.failover,
        n,
        racks,
        a.rounds,
        a.rack.compare_single || a.rack.compare_flat,
    )?;
    let ra = &a.rack;
    let mut net = RackNet::create(racks, ra.spine_gbps, ra.appliance_gbps, ra.link_queue_ms)?;
    if let Some(g) = ra.worker_gbps {
        net.add_workers(&rack_of_ranks(a.workers, racks), Some(g), ra.link_queue_ms)?;
    }
    if let Some(pct) = ra.spine_loss {
        net.spine_loss(pct)?;
    }
    let dir = std::env::temp_dir().join(format!("phub-bench-racks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    process::track_dir(&dir);
    let r = RackNet::inside(&net.spine, || {
        run_in_spine(a, profile, label, &net, &dir, racks, n, kill_index)
    });
    if r.is_err() {
        eprintln!("phub-bench: the racks' logs were in {} (removed)", dir.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
    process::untrack_dir(&dir);
    drop(net);
    r
}

/// How a job is placed over the racks' appliances.
pub(super) enum Placement {
    /// Sharded over the first N racks' appliances (1: rack 1's alone).
    Flat(usize),
    /// Hierarchical over every rack's appliance, with these ranks per rack.
    Hierarchical(Vec<usize>),
}

impl Placement {
    /// `spec` with its `[placement]` (and `replicas`, when given).
    pub(super) fn spec(&self, spec: &serde_json::Value, replicas: Option<u32>) -> serde_json::Value {
        let mut placement = match self {
            Placement::Flat(n) => serde_json::json!({
                "appliances": (1..=*n).map(appliance_name).collect::<Vec<_>>(),
            }),
            Placement::Hierarchical(per_rack) => serde_json::json!({
                "appliances": (1..=per_rack.len()).map(appliance_name).collect::<Vec<_>>(),
                "hierarchical": true,
                "ranks_per_rack": per_rack,
            }),
        };
        if let (Some(r), Some(o)) = (replicas, placement.as_object_mut()) {
            o.insert("replicas".into(), r.into());
        }
        let mut s = spec.clone();
        if let Some(o) = s.as_object_mut() {
            o.insert("placement".into(), placement);
        }
        s
    }

    /// The JSON's `mode`.
    fn mode(&self) -> &'static str {
        match self {
            Placement::Flat(1) => "single",
            Placement::Flat(_) => "flat",
            Placement::Hierarchical(_) => "hierarchical",
        }
    }
}

#[allow(clippy::too_many_arguments)] // the run's parts, each owned elsewhere
fn run_in_spine(
    a: &RunArgs,
    profile: &Profile,
    label: &str,
    net: &RackNet,
    dir: &Path,
    racks: usize,
    n: usize,
    kill_index: Option<usize>,
) -> Result<RunResult> {
    let job = run::job_spec(a, profile, label)?;
    // A hierarchical rack appliance holds a slot for every chunk and its
    // part of the homes: room for the whole job twice.
    let budget = 2 * job.budget(a.lcores, false);
    let mut appl = start(&Daemons::of_run(a), net, dir, budget)?;
    let of = rack_of_ranks(a.workers, racks);
    let fabric_bytes = || net.spine_rx_bytes();
    let fabric = Fabric {
        // Each rank's own namespace where --worker-gbps gave it one, else
        // its rack's.
        rank_ns: if net.workers.is_empty() {
            of.iter().map(|&r| net.racks[r].name.clone()).collect()
        } else {
            net.workers.iter().map(|ns| ns.name.clone()).collect()
        },
        rank_rack: of.iter().map(|&r| rack_label(r + 1)).collect(),
        spine_bytes: Some(&fabric_bytes),
    };
    // Owned copies: the kill below holds the appliances mutably.
    let (control_url, token_text) = (appl.control_url.clone(), appl.token.clone());
    let token = Some(token_text.as_str());
    let workers_per_rack = ranks_per_rack(&of, racks);
    let exchange = |p: &Placement, replicas: Option<u32>, kill: Option<&mut Kill<'_>>| -> Result<RunResult> {
        let admitted = local::admit(&control_url, &p.spec(&job.json, replicas).to_string(), token)?;
        let r = run::drive(
            a,
            profile,
            &control_url,
            &admitted,
            None,
            job.chunks,
            None,
            &fabric,
            kill,
        );
        local::evict(&control_url, admitted.id, token);
        r
    };
    let placement = if a.rack.hierarchical {
        Placement::Hierarchical(workers_per_rack.clone())
    } else {
        Placement::Flat(n)
    };
    let (drain_url, drain_token) = (control_url.clone(), token_text.clone());
    let mut kill = kill_index.map(|i| {
        let appl = &mut appl;
        let k = Kill::new(
            &appliance_name(i + 1),
            a.failover
                .kill_at_round
                .or(a.failover.drain_at_round)
                .unwrap_or(1),
            a.warmup,
            a.workers,
            Some(token_text.clone()),
            a.failover.restart_after_ms.map(Duration::from_millis),
            move |act| match act {
                Act::Kill | Act::Restart => appl.kill_or_restart(i, act),
                Act::Drain => local::control_client(&drain_url, Some(&drain_token), Duration::from_secs(30))
                    .and_then(|c| {
                        c.send(&phub_proto::routes::control::drain_appliance(&appliance_name(
                            i + 1,
                        )))
                        .map_err(anyhow::Error::from)
                    })
                    .map_err(|e| eprintln!("phub-bench: cannot drain {}: {e:#}", appliance_name(i + 1)))
                    .is_ok(),
            },
        );
        if a.failover.drain_appliance.is_some() {
            k.draining()
        } else {
            k
        }
    });
    let mut r = exchange(&placement, a.failover.replicas, kill.as_mut())?;
    drop(kill);
    let flat = if a.rack.compare_flat {
        eprintln!("phub-bench: the same job flat over the same appliances (--compare-flat)");
        Some(exchange(&Placement::Flat(n), a.failover.replicas, None)?)
    } else {
        None
    };
    let single = if a.rack.compare_single {
        eprintln!("phub-bench: the same job on rack 1's appliance alone (--compare-single)");
        Some(exchange(&Placement::Flat(1), None, None)?)
    } else {
        None
    };
    r.racks = RackFigures {
        racks: Some(racks),
        appliances: Some(n),
        mode: Some(placement.mode().into()),
        workers_per_rack,
        cross_rack_bytes_per_round: r.racks.cross_rack_bytes_per_round,
        spine_gbps: a.rack.spine_gbps,
        appliance_gbps: a.rack.appliance_gbps,
        worker_gbps: a.rack.worker_gbps,
        spine_loss_pct: a.rack.spine_loss,
        spine_dropped: a.rack.spine_loss.and_then(|_| net.spine_dropped().ok()),
        single_round_ms_median: single.as_ref().map(|s| s.round_ms_median),
        single_cross_rack_bytes_per_round: single.as_ref().and_then(|s| s.racks.cross_rack_bytes_per_round),
        speedup_vs_single: single.as_ref().map(|s| s.round_ms_median / r.round_ms_median),
        flat_round_ms_median: flat.as_ref().map(|f| f.round_ms_median),
        flat_cross_rack_bytes_per_round: flat.as_ref().and_then(|f| f.racks.cross_rack_bytes_per_round),
        round_ratio_vs_flat: flat.as_ref().map(|f| r.round_ms_median / f.round_ms_median),
    };
    r.efficiency_bound = "none (virtual racks)".into();
    appl.stop();
    Ok(r)
}

/// One line on a virtual-rack run's spine bytes and speed-up, for the
/// table; `None` for a run without `--racks`.
pub fn summary(r: &RunResult) -> Option<String> {
    let f = &r.racks;
    let (racks, n, mode) = (f.racks?, f.appliances?, f.mode.as_deref()?);
    let model = r.model_bytes as f64;
    let mut s = format!(
        "virtual racks: R={racks} (workers per rack {:?}), {mode} over {n} appliance(s){}{}{}",
        f.workers_per_rack,
        f.spine_gbps
            .map_or(String::new(), |g| format!(", spine {g} Gbit/s")),
        f.appliance_gbps
            .map_or(String::new(), |g| format!(", appliance links {g} Gbit/s")),
        f.worker_gbps
            .map_or(String::new(), |g| format!(", worker links {g} Gbit/s")),
    );
    let flat = 2.0 * r.workers as f64 * (racks as f64 - 1.0) / racks as f64;
    if let Some(b) = f.cross_rack_bytes_per_round {
        s.push_str(&format!(
            "; {:.2} MB crossed the spine per round = {:.2} x model bytes (flat over every rack's \
             appliance carries 2W(R-1)/R = {flat:.2} x, hierarchical 2(R-1) = {:.2} x, plus headers)",
            b / 1e6,
            b / model,
            2.0 * (racks as f64 - 1.0)
        ));
    }
    if let (Some(fm), Some(x)) = (f.flat_round_ms_median, f.round_ratio_vs_flat) {
        s.push_str(&format!(
            "; same job flat: median {fm:.1} ms{}, hierarchical {:.1} ms is {x:.2} x its round",
            f.flat_cross_rack_bytes_per_round
                .map_or(String::new(), |b| format!(
                    ", {:.2} x model bytes across the spine",
                    b / model
                )),
            r.round_ms_median
        ));
    }
    if let (Some(single), Some(x)) = (f.single_round_ms_median, f.speedup_vs_single) {
        s.push_str(&format!(
            "; same job on rack 1's appliance alone: median {single:.1} ms, sharded {:.1} ms is {x:.2}x faster",
            r.round_ms_median
        ));
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_spread_evenly_in_blocks() {
        assert_eq!(rack_of_ranks(4, 2), [0, 0, 1, 1]);
        assert_eq!(rack_of_ranks(6, 3), [0, 0, 1, 1, 2, 2]);
        assert_eq!(rack_of_ranks(5, 2), [0, 0, 0, 1, 1]);
        assert_eq!(rack_of_ranks(2, 2), [0, 1]);
        assert_eq!(ranks_per_rack(&rack_of_ranks(5, 2), 2), [3, 2]);
    }

    #[test]
    fn worker_links_are_checked_before_the_racks_are_built() {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            run: RunArgs,
        }
        use clap::Parser;
        let check_of = |extra: &[&str]| {
            let line = ["run", "--local", "--racks", "3", "--model", "resnet50"];
            let f = Flags::try_parse_from(line.iter().chain(extra)).unwrap();
            check(&f.run).map_err(|e| e.to_string())
        };
        assert_eq!(check_of(&["--workers", "4", "--worker-gbps", "1"]), Ok((3, 3)));
        let zero = check_of(&["--workers", "4", "--worker-gbps", "0"]).unwrap_err();
        assert!(zero.contains("--worker-gbps 0"), "{zero}");
        let many = check_of(&["--workers", "251", "--worker-gbps", "1"]).unwrap_err();
        assert!(many.contains("at most 250 workers"), "{many}");
        assert!(
            check_of(&["--workers", "251"]).is_ok(),
            "without links of their own"
        );
    }

    #[test]
    fn addresses_stay_in_the_private_range_and_apart() {
        assert_eq!(appliance_ip(3), "10.77.3.2");
        assert_eq!(uplink_ip(3, true), "10.77.103.1");
        assert_eq!(uplink_ip(MAX_RACKS, false), "10.77.116.2");
        assert_ne!(tor_ip(1), uplink_ip(1, false));
    }
}
