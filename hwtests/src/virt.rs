//! The virtual rack: a private network namespace holding a veth
//! pair; phub-dataplane (`--backend dpdk`, net_af_packet on one end), and
//! phub-control run inside it, and the test's workers (threads that entered
//! the namespace) use the kernel's UDP on the other end. Everything lives in
//! the namespace, which is removed when the rack is dropped (even when the
//! test fails). Needs root; [`VirtualRack::start`] says why it cannot run.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use phub_proto::routes::mgmt::{self, MgmtCall};

use crate::dataplane_args::{Backend, DataplaneArgs};
use crate::process::{self, control_ready, dataplane_ready};

/// The appliance's address on the veth link (exists only in the namespace).
pub const APPLIANCE_IP: &str = "10.77.0.1";
/// The workers' address on the other end.
pub const WORKER_IP: &str = "10.77.0.2";
/// UDP port of lcore 0.
pub const BASE_PORT: u16 = 7900;
/// The dataplane's management API (inside the namespace).
pub const MGMT: &str = "127.0.0.1:7800";
/// phub-control's API (inside the namespace).
pub const CONTROL: &str = "127.0.0.1:7700";

/// A network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    /// Its name (`ip netns list`).
    pub name: String,
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// Creates `phub-TAG-PID`, replacing a stale one of that name.
    pub fn create(tag: &str) -> Result<Netns, String> {
        let name = format!("phub-{tag}-{}", std::process::id());
        let _ = run(Command::new("ip").args(["netns", "del", &name]));
        run(Command::new("ip").args(["netns", "add", &name]))?;
        process::track_netns(&name);
        Ok(Netns { name })
    }

    /// Runs `ip -n NS args...`.
    pub fn ip(&self, args: &[&str]) -> Result<(), String> {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// A command run inside the namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// Moves the calling thread into the namespace (threads it starts
    /// afterwards are in it too).
    pub fn enter(&self) {
        enter_netns(&self.name);
    }
}

/// Moves the calling thread into the network namespace `name` (threads and
/// processes it starts afterwards are in it too). For code that cannot
/// borrow the [`Netns`] (a closure beside a `&mut` [`VirtualRack`]).
pub fn enter_netns(name: &str) {
    let f = std::fs::File::open(format!("/var/run/netns/{name}")).expect("the namespace's file");
    // SAFETY: a valid namespace fd; setns(CLONE_NEWNET) changes only the
    // calling thread's network namespace.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(Command::new("ip").args(["netns", "del", &self.name]));
        process::untrack_netns(&self.name);
    }
}

/// Why DPDK whole-system tests cannot run here, if they cannot.
pub fn unavailable() -> Option<String> {
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (network namespaces, AF_PACKET)".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("needs iproute2's `ip`".into());
    }
    None
}

/// Waits up to 30 s for `what`'s API at `url`; panics saying why it did not
/// come up.
pub(crate) fn wait_http(url: &str, child: &mut Child, what: &str) {
    if let Err(e) = process::wait_http(url, child, Duration::from_secs(30), || false) {
        panic!("{what} at {url} {e}");
    }
}

/// [`terminate`] with the rack's grace period (10 s).
pub(crate) fn term(child: &mut Child) -> Option<std::process::ExitStatus> {
    process::terminate(child, Duration::from_secs(10))
}

/// What links the workers to the dataplane's DPDK port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// A veth pair, net_af_packet on the appliance's end ([`APPLIANCE_IF`]);
    /// with `tx_qdisc` it sends through that end's qdisc.
    AfPacket {
        /// net_af_packet's `qdisc_bypass=0`.
        tx_qdisc: bool,
    },
    /// net_tap: the dataplane's port is a tap interface ([`TAP_IF`]) whose
    /// kernel side the workers use. It takes IPv4 and UDP TX checksum
    /// offloads (computed by the driver), where af_packet has none, and
    /// frames of MTU 1504 at most. The interface goes with the dataplane:
    /// [`VirtualRack::start_dataplane`] does not set it up again.
    Tap,
}

/// The kernel side of a [`Link::Tap`] rack's port.
pub const TAP_IF: &str = "dpt0";

/// The rack: namespace, veth pair, phub-dataplane on DPDK, phub-control.
#[derive(Debug)]
pub struct VirtualRack {
    // Field order is drop order: processes stop before the namespace goes.
    /// phub-dataplane.
    pub dataplane: Option<Child>,
    /// phub-control.
    pub control: Option<Child>,
    /// Scratch directory (state file, logs).
    pub dir: PathBuf,
    /// phub-dataplane's stderr.
    pub log: PathBuf,
    /// Data lcores (queues).
    pub lcores: usize,
    /// phub-dataplane's whole command line, for [`VirtualRack::start_dataplane`].
    dataplane_args: Vec<String>,
    control_args: Vec<String>,
    /// Whether net_af_packet sends through dpv1's qdisc (`qdisc_bypass=0`).
    tx_qdisc: bool,
    /// The namespace everything lives in.
    pub ns: Netns,
}

impl VirtualRack {
    /// Sets the rack up and starts the processes, with `lcores` queues and
    /// extra arguments for each. `Err` says why it cannot run here (no
    /// root, no `ip`, no namespaces, binaries not built); a rack that could
    /// be set up but does not come up is a failure (panics with the
    /// dataplane's log).
    pub fn start(tag: &str, lcores: usize, dataplane: &str, control: &str) -> Result<VirtualRack, String> {
        VirtualRack::start_with(tag, lcores, false, dataplane, control)
    }

    /// [`VirtualRack::start`], and with `tx_qdisc` the dataplane's port sends
    /// through dpv1's qdisc (net_af_packet's `qdisc_bypass=0`; DPDK's
    /// default bypasses it, whatever its guide says), so that a qdisc there
    /// ([`VirtualRack::netem`]) sees the appliance's packets too.
    pub fn start_with(
        tag: &str,
        lcores: usize,
        tx_qdisc: bool,
        dataplane: &str,
        control: &str,
    ) -> Result<VirtualRack, String> {
        VirtualRack::start_on(tag, lcores, Link::AfPacket { tx_qdisc }, dataplane, control)
    }

    /// [`VirtualRack::start`] on `link`.
    pub fn start_on(
        tag: &str,
        lcores: usize,
        link: Link,
        dataplane: &str,
        control: &str,
    ) -> Result<VirtualRack, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        let dp_bin = crate::bin("phub-dataplane")?;
        let ctl_bin = crate::bin("phub-control")?;
        let ns = Netns::create(tag)?;
        ns.ip(&["link", "set", "lo", "up"])?;
        let must = |r: Result<(), String>| r.unwrap_or_else(|e| panic!("setting up the virtual rack: {e}"));
        let tx_qdisc = matches!(link, Link::AfPacket { tx_qdisc: true });
        if let Link::AfPacket { .. } = link {
            must(ns.ip(&["link", "add", "dpv0", "type", "veth", "peer", "name", "dpv1"]));
            for d in ["dpv0", "dpv1"] {
                let _ = run(ns
                    .command("sysctl")
                    .args(["-qw", &format!("net.ipv6.conf.{d}.disable_ipv6=1")]));
                must(ns.ip(&["link", "set", d, "mtu", "9000", "up"]));
            }
            must(ns.ip(&["addr", "add", &format!("{WORKER_IP}/24"), "dev", "dpv0"]));
            // veth passes GSO super-packets whole: af_packet would cut them.
            must(ns.ip(&["link", "set", "dpv0", "gso_max_segs", "1"]));
        }
        let dir = std::env::temp_dir().join(format!("{}-dir", ns.name));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let log = dir.join("dataplane.log");
        let mut rack = VirtualRack {
            dataplane: None,
            control: None,
            dir,
            log,
            lcores,
            dataplane_args: Vec::new(),
            control_args: control.split_whitespace().map(String::from).collect(),
            tx_qdisc,
            ns,
        };
        let vdev = match link {
            Link::AfPacket { tx_qdisc } => format!(
                "net_af_packet0,iface=dpv1,blocksz=16384,framesz=16384,framecnt=4096,qpairs={lcores}{}",
                if tx_qdisc { ",qdisc_bypass=0" } else { "" },
            ),
            Link::Tap => format!("net_tap0,iface={TAP_IF}"),
        };
        let eal = format!(
            "--no-pci --vdev={vdev} --no-huge -m 512 --no-shconf --file-prefix {} --log-level=warning",
            rack.ns.name
        );
        rack.dataplane_args = DataplaneArgs {
            backend: Some(Backend::Dpdk),
            host: Some(APPLIANCE_IP.into()),
            base_port: Some(BASE_PORT),
            lcores: Some(lcores),
            no_pin: true,
            idle_backoff: true,
            mgmt: Some(MGMT.into()),
            memory_budget: Some("1GiB".into()),
            eal: Some(eal),
            // The management token in the rack's own directory: the default
            // (`/run/phub/dataplane-<port>.token`) is the same path for every
            // rack's dataplane, each on the same port in its own namespace, so
            // racks running at once took each other's token (or lost it when
            // the other stopped: control answered 502).
            mgmt_token_file: Some(rack.token_file()),
            extra: dataplane.split_whitespace().map(String::from).collect(),
            ..DataplaneArgs::default()
        }
        .to_args();
        let logf = std::fs::File::create(&rack.log).map_err(|e| e.to_string())?;
        let mut dp = rack
            .ns
            .command(&dp_bin)
            .args(&rack.dataplane_args)
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .map_err(|e| e.to_string())?;
        let mut ctl = rack.spawn_control(&ctl_bin)?;
        // HTTP checks run from a thread inside the namespace.
        let (dp, ctl) = std::thread::scope(|s| {
            let ns = &rack.ns;
            s.spawn(move || {
                ns.enter();
                wait_http(
                    &dataplane_ready(&format!("http://{MGMT}")),
                    &mut dp,
                    "phub-dataplane",
                );
                wait_http(
                    &control_ready(&format!("http://{CONTROL}")),
                    &mut ctl,
                    "phub-control",
                );
                (dp, ctl)
            })
            .join()
        })
        .unwrap_or_else(|_| {
            panic!(
                "the virtual rack did not come up; dataplane log:\n{}",
                std::fs::read_to_string(&rack.log).unwrap_or_default()
            )
        });
        rack.dataplane = Some(dp);
        rack.control = Some(ctl);
        if link == Link::Tap {
            // The dataplane made the tap interface: the workers' side.
            let _ = run(rack
                .ns
                .command("sysctl")
                .args(["-qw", &format!("net.ipv6.conf.{TAP_IF}.disable_ipv6=1")]));
            must(rack.ns.ip(&["link", "set", TAP_IF, "mtu", "9000", "up"]));
            must(
                rack.ns
                    .ip(&["addr", "add", &format!("{WORKER_IP}/24"), "dev", TAP_IF]),
            );
        }
        Ok(rack)
    }

    /// The dataplane's management token file (in the rack's directory).
    fn token_file(&self) -> std::path::PathBuf {
        self.dir.join("dataplane.token")
    }

    /// The operator token phub-control keeps beside its state file, if it
    /// made one.
    pub fn operator_token(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("state.json.operator-token"))
            .ok()
            .map(|t| t.trim().to_string())
    }

    /// phub-control's URL (reachable from inside the namespace).
    pub fn control_url(&self) -> String {
        format!("http://{CONTROL}")
    }

    /// Runs `f` on a thread inside the namespace.
    pub fn inside<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                self.ns.enter();
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// phubctl inside the namespace.
    pub fn phubctl(&self, args: &[&str]) -> (bool, String, String) {
        let mut cmd = self.ns.command(crate::bin("phubctl").unwrap_or_default());
        if let Some(t) = self.operator_token() {
            cmd.env("PHUB_OPERATOR_TOKEN", t);
        }
        let out = cmd
            .args(["--control", &self.control_url()])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The dataplane's counters (`GET /v1/stats` on its management API).
    pub fn stats(&self) -> phub_proto::api::DataplaneStats {
        self.mgmt(&mgmt::stats())
    }

    /// What the dataplane says about itself (`GET /v1/info`).
    pub fn info(&self) -> phub_proto::api::DataplaneInfo {
        self.mgmt(&mgmt::info())
    }

    /// `call` to the dataplane's management API (an open route), from
    /// inside the namespace; panics saying why it failed.
    fn mgmt<A: Send>(&self, call: &MgmtCall<'_, A>) -> A {
        let url = self.mgmt_url();
        self.inside(|| {
            crate::workload::client(&url, None)
                .send(call)
                .unwrap_or_else(|e| panic!("{} at {url}: {e}", call.what()))
        })
    }

    /// The dataplane's management URL (inside the namespace).
    pub fn mgmt_url(&self) -> String {
        format!("http://{MGMT}")
    }

    /// Stops the dataplane with SIGTERM and returns whether it exited
    /// cleanly, and its log.
    pub fn stop_dataplane(&mut self) -> (bool, String) {
        let ok = self
            .dataplane
            .as_mut()
            .and_then(term)
            .is_some_and(|s| s.success());
        self.dataplane = None;
        (ok, std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// Kills the dataplane outright (SIGKILL), as a crash would: no EAL
    /// cleanup, no port close. With `--no-huge --no-shconf` it leaves no
    /// hugepage files and no shared config behind, so
    /// [`VirtualRack::start_dataplane`] can reuse the file prefix.
    pub fn kill_dataplane(&mut self) {
        if let Some(mut d) = self.dataplane.take() {
            d.kill().expect("SIGKILL to phub-dataplane");
            d.wait().expect("reaping phub-dataplane");
        }
    }

    /// Starts phub-dataplane again with the arguments of the first start
    /// (same port, EAL file prefix, lcores and options), its log appended to
    /// [`VirtualRack::log`]; returns once its management API answers.
    /// Panics, with the log, if it does not come up.
    pub fn start_dataplane(&mut self) {
        assert!(self.dataplane.is_none(), "phub-dataplane is still running");
        let bin = crate::bin("phub-dataplane").expect("phub-dataplane was built for the first start");
        let logf = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .expect("the dataplane's log");
        let mut dp = self
            .ns
            .command(bin)
            .args(&self.dataplane_args)
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .expect("spawning phub-dataplane");
        let url = dataplane_ready(&self.mgmt_url());
        let up = std::thread::scope(|s| {
            s.spawn(|| {
                self.ns.enter();
                wait_http(&url, &mut dp, "phub-dataplane (restarted)");
            })
            .join()
        });
        if up.is_err() {
            let _ = dp.kill();
            let _ = dp.wait();
            panic!(
                "phub-dataplane did not come back; its log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        self.dataplane = Some(dp);
    }

    /// Starts phub-control inside the namespace with the rack's arguments
    /// and state file (it does not wait for its API).
    fn spawn_control(&self, bin: &std::path::Path) -> Result<Child, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.control_log())
            .map_err(|e| format!("{}: {e}", self.control_log().display()))?;
        self.ns
            .command(bin)
            .args([
                "--listen",
                CONTROL,
                "--dataplane",
                &format!("http://{MGMT}"),
                "--reconcile-ms",
                "200",
            ])
            .arg("--state")
            .arg(self.dir.join("state.json"))
            .arg("--dataplane-token-file")
            .arg(self.token_file())
            .args(&self.control_args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| e.to_string())
    }

    /// phub-control's log (each start appends to it), for a test's
    /// failure to show.
    pub fn control_log(&self) -> PathBuf {
        self.dir.join("control.log")
    }

    /// Kills phub-control outright (SIGKILL), as a crash would.
    pub fn kill_control(&mut self) {
        if let Some(mut c) = self.control.take() {
            c.kill().expect("SIGKILL to phub-control");
            c.wait().expect("reaping phub-control");
        }
    }

    /// Starts phub-control again from its state file, with the arguments of
    /// the first start; returns once its API answers.
    pub fn start_control(&mut self) {
        assert!(self.control.is_none(), "phub-control is still running");
        let bin = crate::bin("phub-control").expect("phub-control was built for the first start");
        let mut ctl = self.spawn_control(&bin).expect("spawning phub-control");
        std::thread::scope(|s| {
            s.spawn(|| {
                self.ns.enter();
                wait_http(
                    &control_ready(&format!("http://{CONTROL}")),
                    &mut ctl,
                    "phub-control (restarted)",
                );
            })
            .join()
        })
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
        self.control = Some(ctl);
    }

    /// Puts a netem qdisc with `params` (e.g. `loss 5% duplicate 1% reorder
    /// 25% delay 1ms`) on dpv0, the workers' side, so it acts on what the
    /// workers send; on a rack started with `tx_qdisc`
    /// ([`VirtualRack::start_with`]) also on dpv1, so it acts on what the
    /// appliance sends. `Err` says why it cannot: no `tc`, or a kernel
    /// without sch_netem ("Specified qdisc kind is unknown").
    pub fn netem(&self, params: &str) -> Result<(), String> {
        let devs: &[&str] = if self.tx_qdisc {
            &["dpv0", "dpv1"]
        } else {
            &["dpv0"]
        };
        for dev in devs {
            self.qdisc(dev, &format!("netem {params}"))?;
        }
        Ok(())
    }

    /// `tc qdisc replace dev DEV root QDISC...` in the namespace.
    pub fn qdisc(&self, dev: &str, qdisc: &str) -> Result<(), String> {
        run(self
            .ns
            .command("tc")
            .args(["qdisc", "replace", "dev", dev, "root"])
            .args(qdisc.split_whitespace()))
    }

    /// Packets dpv1's root qdisc has sent (`tc -s qdisc show dev dpv1`),
    /// to tell whether the appliance's transmissions pass the qdisc.
    pub fn tx_qdisc_packets(&self) -> Result<u64, String> {
        let out = self
            .ns
            .command("tc")
            .args(["-s", "qdisc", "show", "dev", "dpv1"])
            .output()
            .map_err(|e| format!("tc: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .skip_while(|w| *w != "Sent")
            .nth(3)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("no `Sent N bytes M pkt` in tc's answer: {text}"))
    }

    /// A closure that moves the calling thread into the rack's namespace,
    /// usable while the rack itself is borrowed mutably elsewhere.
    pub fn enterer(&self) -> impl Fn() + Send + Sync + 'static {
        let name = self.ns.name.clone();
        move || enter_netns(&name)
    }
}

impl Drop for VirtualRack {
    fn drop(&mut self) {
        if let Some(c) = self.control.as_mut() {
            term(c);
        }
        if let Some(d) = self.dataplane.as_mut() {
            term(d);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The workers' end of the veth pair (holds [`WORKER_IP`]).
pub const WORKER_IF: &str = "dpv0";
/// The appliance's end of the veth pair (DPDK's af_packet driver reads it).
pub const APPLIANCE_IF: &str = "dpv1";

/// Builds the virtual rack's link inside `ns`: loopback up, the veth pair
/// [`WORKER_IF`]/[`APPLIANCE_IF`] at MTU 9000 with IPv6 off, [`WORKER_IP`]
/// on the workers' end, and GSO trains cut into single datagrams on that
/// end (veth passes a GSO super-packet whole and af_packet would truncate
/// it to its frame size). Shared by the tests' rack and phub's tools
/// (phub-demo, `phub-bench run --local --backend dpdk`).
pub fn veth_link(ns: &Netns) -> Result<(), String> {
    ns.ip(&["link", "set", "lo", "up"])?;
    ns.ip(&[
        "link",
        "add",
        WORKER_IF,
        "type",
        "veth",
        "peer",
        "name",
        APPLIANCE_IF,
    ])?;
    for d in [WORKER_IF, APPLIANCE_IF] {
        let _ = run(ns
            .command("sysctl")
            .args(["-qw", &format!("net.ipv6.conf.{d}.disable_ipv6=1")]));
        ns.ip(&["link", "set", d, "mtu", "9000", "up"])?;
    }
    ns.ip(&["addr", "add", &format!("{WORKER_IP}/24"), "dev", WORKER_IF])?;
    ns.ip(&["link", "set", WORKER_IF, "gso_max_segs", "1"])
}

/// EAL arguments for DPDK's af_packet driver on [`APPLIANCE_IF`] with
/// `qpairs` queue pairs (8 KiB chunks need `framesz=16384`), without
/// hugepages, for a process inside `ns`; `prefix` keeps its runtime files
/// apart from another DPDK process's. Without hugepages DPDK's heap is the
/// `-m` area and nothing grows it, and slot memory comes from that heap:
/// `slot_bytes` (the dataplane's memory budget, 0 where there is none) is
/// added to the 512 MiB that the ports' mempools and rings take.
pub fn af_packet_eal(qpairs: usize, prefix: &str, slot_bytes: u64) -> String {
    af_packet_eal_on(APPLIANCE_IF, qpairs, prefix, slot_bytes)
}

/// [`af_packet_eal`] on interface `iface` instead of [`APPLIANCE_IF`].
pub fn af_packet_eal_on(iface: &str, qpairs: usize, prefix: &str, slot_bytes: u64) -> String {
    let mib = 512 + slot_bytes.div_ceil(1 << 20);
    format!(
        "--no-pci --vdev=net_af_packet0,iface={iface},blocksz=16384,framesz=16384,framecnt=4096,\
         qpairs={qpairs} --no-huge -m {mib} --no-shconf --file-prefix {prefix} --log-level=warning"
    )
}

impl Netns {
    /// Moves the calling thread into the namespace, as [`Netns::enter`],
    /// but says why it could not instead of panicking.
    pub fn try_enter(&self) -> Result<(), String> {
        try_enter_netns(&self.name)
    }
}

/// Moves the calling thread into the network namespace `name`, as
/// [`enter_netns`], but says why it could not instead of panicking (for a
/// thread that holds only the name, such as a worker thread of a virtual
/// rack).
pub fn try_enter_netns(name: &str) -> Result<(), String> {
    let path = format!("/var/run/netns/{name}");
    let f = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    // SAFETY: a valid namespace fd, open for the duration of the call;
    // setns(CLONE_NEWNET) changes only the calling thread's network
    // namespace.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("setns into {name}: {}", std::io::Error::last_os_error()))
    }
}
