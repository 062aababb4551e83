//! The virtual rack: a private network namespace holding a veth
//! pair; phub-dataplane (`--backend dpdk`, net_af_packet on one end), and
//! phub-control run inside it, and the test's workers (threads that entered
//! the namespace) use the kernel's UDP on the other end. Everything lives in
//! the namespace, which is removed when the rack is dropped (even when the
//! test fails). Needs root; [`VirtualRack::start`] says why it cannot run.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
        let f = std::fs::File::open(format!("/var/run/netns/{}", self.name)).expect("the namespace's file");
        // SAFETY: a valid namespace fd; setns(CLONE_NEWNET) changes only the
        // calling thread's network namespace.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(Command::new("ip").args(["netns", "del", &self.name]));
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

fn wait_http(url: &str, child: &mut Child, what: &str) {
    let t = Instant::now();
    while ureq::get(url).timeout(Duration::from_millis(300)).call().is_err() {
        if let Ok(Some(s)) = child.try_wait() {
            panic!("{what} exited early: {s}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{what} did not come up at {url}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn term(child: &mut Child) -> Option<std::process::ExitStatus> {
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

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
        if let Some(why) = unavailable() {
            return Err(why);
        }
        let dp_bin = crate::bin("phub-dataplane")?;
        let ctl_bin = crate::bin("phub-control")?;
        let ns = Netns::create(tag)?;
        ns.ip(&["link", "set", "lo", "up"])?;
        let must = |r: Result<(), String>| r.unwrap_or_else(|e| panic!("setting up the virtual rack: {e}"));
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
        let dir = std::env::temp_dir().join(format!("{}-dir", ns.name));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let log = dir.join("dataplane.log");
        let mut rack = VirtualRack {
            dataplane: None,
            control: None,
            dir,
            log,
            lcores,
            ns,
        };
        let eal = format!(
            "--no-pci --vdev=net_af_packet0,iface=dpv1,blocksz=16384,framesz=16384,framecnt=4096,qpairs={lcores} \
             --no-huge -m 512 --no-shconf --file-prefix {} --log-level=warning",
            rack.ns.name
        );
        let logf = std::fs::File::create(&rack.log).map_err(|e| e.to_string())?;
        let mut dp = rack
            .ns
            .command(&dp_bin)
            .args([
                "--backend",
                "dpdk",
                "--host",
                APPLIANCE_IP,
                "--base-port",
                &BASE_PORT.to_string(),
            ])
            .args([
                "--lcores",
                &lcores.to_string(),
                "--no-pin",
                "--idle-backoff",
                "--mgmt",
                MGMT,
            ])
            .args(["--memory-budget", "1GiB", "--eal", &eal])
            .args(dataplane.split_whitespace())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .map_err(|e| e.to_string())?;
        let mut ctl = rack
            .ns
            .command(&ctl_bin)
            .args([
                "--listen",
                CONTROL,
                "--dataplane",
                &format!("http://{MGMT}"),
                "--reconcile-ms",
                "200",
            ])
            .arg("--state")
            .arg(rack.dir.join("state.json"))
            .args(control.split_whitespace())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        // HTTP checks run from a thread inside the namespace.
        let (dp, ctl) = std::thread::scope(|s| {
            let ns = &rack.ns;
            s.spawn(move || {
                ns.enter();
                wait_http(&format!("http://{MGMT}/v1/info"), &mut dp, "phub-dataplane");
                wait_http(&format!("http://{CONTROL}/v1/jobs"), &mut ctl, "phub-control");
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
        Ok(rack)
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
        let url = format!("{}/v1/stats", self.mgmt_url());
        self.inside(|| {
            ureq::get(&url)
                .call()
                .expect("dataplane stats")
                .into_json()
                .expect("stats JSON")
        })
    }

    /// What the dataplane says about itself (`GET /v1/info`).
    pub fn info(&self) -> phub_proto::api::DataplaneInfo {
        let url = format!("{}/v1/info", self.mgmt_url());
        self.inside(|| {
            ureq::get(&url)
                .call()
                .expect("dataplane info")
                .into_json()
                .expect("info JSON")
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
