//! How long a kernel-UDP lcore polls on after traffic before it sleeps
//! (`--spin-us`), and the governor that turns that off where it costs.
//!
//! Polling on for 200 us past the last burst made ResNet-50 rounds about
//! 15% faster on a 2-vCPU VM (a sleeping lcore is a halted vCPU to wake for
//! every burst), but where the dataplane runs under a CPU quota it spins
//! the quota away: rounds 1.5x slower, with drops (BENCHMARKS.md, "Spinning
//! before sleeping"). So the default, `auto`, spins only while the
//! dataplane's cgroups leave room for it: no CPU quota (cgroup v1
//! `cpu.cfs_quota_us`, v2 `cpu.max`) on its cgroup or any ancestor below
//! one CPU per lcore and one more, no throttling seen lately (a quota
//! that throttled it turns the spin off for a while, doubling each time),
//! and no crowd of other threads waiting for the CPUs the lcores leave
//! (spinning beside 4 or 8 busy workers on 2 vCPUs made rounds 5-10%
//! slower): counted from `/proc/loadavg` with the spin off (a spinning
//! lcore itself keeps others waiting), less the lcores running then (by
//! their threads' state: [`SpinGate::lcores_running`]): for [`PROBE_SPAN`] after
//! [`PROBE_FIRST`] and then every [`PROBE_EVERY`] seconds of traffic, and
//! all the time it is off. The governor decides every [`CHECK_EVERY`]
//! (and at the end of each probe), and at once when the process moved
//! to other cgroups (looked at every [`MOVE_CHECK`]), so a dataplane moved
//! into a limited cgroup after it started stops spinning within a tenth of
//! a second. Every lcore reads the spin it may use from one
//! [`SpinGate`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The spin `auto` uses where nothing limits the dataplane, microseconds.
pub const AUTO_SPIN_US: u64 = 200;
/// How often the governor reads the cgroups.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long throttling first turns the spin off; doubled each time the
/// spin is throttled again after coming back, up to [`MAX_HOLD_OFF`].
pub const FIRST_HOLD_OFF: Duration = Duration::from_secs(10);
/// The longest hold-off.
pub const MAX_HOLD_OFF: Duration = Duration::from_secs(600);
/// `auto` stops spinning when, with the spin off for a reading (a probe),
/// more threads than the CPUs the lcores leave, plus this many, were ready
/// to run on average...
pub const CROWD_ENTER: f64 = 1.25;
/// ... and spins again once under this many more. Counted on a 2-vCPU VM,
/// one lcore, ResNet-50, the spin off (BENCHMARKS.md, "The spin by
/// default"): 1.6-1.8 other threads with 2 workers (where spinning makes
/// rounds 17% faster), 2.8-3.6 with 4 and 3.3-4.9 with 8 (5-10% slower),
/// every lcore taken off as if it ran; taking off only the lcores that
/// run adds what an lcore sleeps: 1.93 against 1.76 with 2 workers, 3.03
/// against 2.86 with 4 (the lcore runs 83% of the time), but 2.00
/// against 1.59 for table pulls on two lcores and 2 vCPUs, where a spin
/// made dense pulls 2x slower (BENCHMARKS.md, "One lcore's BSP rounds
/// alone").
pub const CROWD_LEAVE: f64 = 1.0;
/// Readings with traffic between `auto`'s probes (seconds of traffic).
pub const PROBE_EVERY: u32 = 30;
/// Readings with traffic before the first probe, and after the spin comes
/// back on.
pub const PROBE_FIRST: u32 = 2;

/// `--spin-us`: a fixed spin, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpinSetting {
    /// [`AUTO_SPIN_US`] while the dataplane's cgroups leave room for it,
    /// none otherwise.
    Auto,
    /// Always this many microseconds (0: sleep at once).
    Fixed(u64),
}

impl std::fmt::Display for SpinSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpinSetting::Auto => f.write_str("auto"),
            SpinSetting::Fixed(us) => write!(f, "{us}"),
        }
    }
}

impl std::str::FromStr for SpinSetting {
    type Err = String;

    fn from_str(s: &str) -> Result<SpinSetting, String> {
        let t = s.trim();
        if t == "auto" {
            return Ok(SpinSetting::Auto);
        }
        t.parse::<u64>()
            .ok()
            .filter(|&us| us <= 1_000_000)
            .map(SpinSetting::Fixed)
            .ok_or_else(|| format!("{s:?}: expected `auto` or microseconds from 0 to 1000000"))
    }
}

/// The spin every lcore may use now, in nanoseconds: set once for a fixed
/// setting, by the governor for `auto`; and the lcores' thread ids, which
/// the governor reads to tell lcores that run from lcores asleep.
#[derive(Debug, Default)]
pub struct SpinGate {
    spin: AtomicU64,
    lcores: Mutex<Vec<u32>>,
}

impl SpinGate {
    /// A gate letting `spin` through.
    pub fn new(spin: Duration) -> SpinGate {
        SpinGate {
            spin: AtomicU64::new(nanos(spin)),
            lcores: Mutex::new(Vec::new()),
        }
    }

    /// Records the calling thread as an lcore (once, as it starts), for
    /// [`SpinGate::lcores_running`]. A thread id that cannot be read
    /// (no `/proc`) is left out: the governor then counts every lcore as
    /// running, as it would with none enlisted.
    pub fn enlist(&self) {
        if let Some(tid) = thread_id() {
            self.lcores
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(tid);
        }
    }

    /// How many of `lcores` lcores are running or ready to run now, by
    /// their threads' state in `/proc`; all of them where fewer enlisted
    /// ([`SpinGate::enlist`]) or a state cannot be read.
    pub fn lcores_running(&self, lcores: usize) -> usize {
        let tids = self
            .lcores
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if tids.len() < lcores {
            return lcores;
        }
        let mut running = 0;
        for &tid in tids.iter() {
            match std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) {
                Ok(stat) => running += usize::from(parse_state(&stat) == Some('R')),
                Err(_) => return lcores,
            }
        }
        running
    }

    /// The spin now, nanoseconds.
    pub fn nanos(&self) -> u64 {
        self.spin.load(Ordering::Relaxed)
    }

    /// The spin now, microseconds.
    pub fn micros(&self) -> u64 {
        self.nanos() / 1000
    }

    /// Lets `spin` through from the lcores' next turn on (the line the
    /// lcores read is written only when the spin changes).
    pub fn set(&self, spin: Duration) {
        let ns = nanos(spin);
        if self.nanos() != ns {
            self.spin.store(ns, Ordering::Relaxed);
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// What the cgroups say about the CPU this process may use.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpuLimit {
    /// The smallest quota on the process's cgroup or an ancestor, in CPUs
    /// (None: no quota anywhere, or no cgroup CPU controller to read).
    pub cpus: Option<f64>,
    /// Times those cgroups were throttled, added up.
    pub throttled: u64,
}

/// Reads the CPU quota and throttle counts of this process's cgroups,
/// v1 and v2 ([`cpu_cgroups`]).
pub fn read_cpu_limit() -> CpuLimit {
    let mut limit = CpuLimit::default();
    for dir in cpu_cgroups("self") {
        let here = read_tree(&dir);
        limit.cpus = min_cpus(limit.cpus, here.cpus);
        limit.throttled += here.throttled;
    }
    limit
}

/// The smaller of two quotas, either maybe absent.
fn min_cpus(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A cgroup's limit and its ancestors', up to where its hierarchy is
/// mounted: the smallest quota, the throttle counts added up.
fn read_tree(dir: &CgroupDir) -> CpuLimit {
    let mut limit = CpuLimit::default();
    let mut at = dir.path.as_path();
    loop {
        let here = read_dir_limit(at);
        limit.cpus = min_cpus(limit.cpus, here.cpus);
        limit.throttled += here.throttled;
        if at == dir.mount {
            return limit;
        }
        match at.parent() {
            Some(p) if p.starts_with(&dir.mount) => at = p,
            _ => return limit,
        }
    }
}

/// A cgroup directory with the CPU controller, and where its hierarchy is
/// mounted (the walk up stops there).
#[derive(Debug, PartialEq)]
pub struct CgroupDir {
    /// Where the hierarchy is mounted.
    pub mount: PathBuf,
    /// The cgroup's directory.
    pub path: PathBuf,
    /// Whether it is the v2 hierarchy (`cpu.max`), not v1's `cpu`
    /// controller (`cpu.cfs_quota_us`).
    pub v2: bool,
}

/// The CPU cgroups of `process` (`self`, or a pid), from
/// `/proc/<process>/cgroup` and its `mountinfo`: the v1 hierarchy with the
/// `cpu` controller and the v2 one, where mounted (none when either file
/// cannot be read).
pub fn cpu_cgroups(process: &str) -> Vec<CgroupDir> {
    let read = |f: &str| std::fs::read_to_string(format!("/proc/{process}/{f}"));
    match (read("cgroup"), read("mountinfo")) {
        (Ok(cgroup), Ok(mountinfo)) => cpu_cgroup_dirs(&cgroup, &mountinfo),
        _ => Vec::new(),
    }
}

/// The directories of the process's CPU cgroups: the v1 hierarchy with the
/// `cpu` controller and the v2 one, where mounted. `cgroup` is
/// `/proc/self/cgroup`, `mountinfo` is `/proc/self/mountinfo`.
fn cpu_cgroup_dirs(cgroup: &str, mountinfo: &str) -> Vec<CgroupDir> {
    let mut dirs = Vec::new();
    for line in cgroup.lines() {
        // hierarchy-ID:controller-list:path
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let v2 = controllers.is_empty();
        if !v2 && !controllers.split(',').any(|c| c == "cpu") {
            continue;
        }
        if let Some(dir) = mountinfo
            .lines()
            .find_map(|m| mount_for(m, v2))
            .map(|(root, mount)| join_cgroup(&mount, &root, path, v2))
        {
            dirs.push(dir);
        }
    }
    dirs
}

/// (root within the hierarchy, mount point) of a mountinfo line that
/// mounts the v2 hierarchy (`v2`) or a v1 one with the `cpu` controller.
fn mount_for(line: &str, v2: bool) -> Option<(String, String)> {
    // id parent major:minor root mount-point options [optional...] - fstype source super-options
    let (before, after) = line.split_once(" - ")?;
    let fields: Vec<&str> = before.split(' ').collect();
    let (root, mount) = (*fields.get(3)?, *fields.get(4)?);
    let mut after = after.split(' ');
    let fstype = after.next()?;
    let _source = after.next();
    let opts = after.next().unwrap_or("");
    let ok = if v2 {
        fstype == "cgroup2"
    } else {
        fstype == "cgroup" && opts.split(',').any(|o| o == "cpu")
    };
    ok.then(|| (unescape(root), unescape(mount)))
}

/// mountinfo escapes spaces and a few other bytes as `\ooo` (a byte: the
/// first digit at most 3; anything else is kept as it is).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && (b'0'..=b'3').contains(&b[i + 1])
            && b[i + 2..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The directory of cgroup `path` in a hierarchy mounted at `mount` whose
/// root there is `root` (a container sees its own cgroup as `/`).
fn join_cgroup(mount: &str, root: &str, path: &str, v2: bool) -> CgroupDir {
    let rel = if root == "/" {
        path
    } else {
        path.strip_prefix(root).unwrap_or(path)
    };
    let rel = rel.trim_start_matches('/');
    let mount = PathBuf::from(mount);
    CgroupDir {
        path: if rel.is_empty() {
            mount.clone()
        } else {
            mount.join(rel)
        },
        mount,
        v2,
    }
}

/// One cgroup directory's quota (v1 `cpu.cfs_quota_us` over
/// `cpu.cfs_period_us`, v2 `cpu.max`) and `nr_throttled`.
fn read_dir_limit(dir: &Path) -> CpuLimit {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let cpus = if let Some(max) = read("cpu.max") {
        parse_cpu_max(&max)
    } else {
        match (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us")) {
            (Some(q), Some(p)) => quota_cpus(q.trim().parse().ok(), p.trim().parse().ok()),
            _ => None,
        }
    };
    let throttled = read("cpu.stat").map_or(0, |s| parse_nr_throttled(&s));
    CpuLimit { cpus, throttled }
}

/// v2 `cpu.max`: `max 100000` (none) or `50000 100000` (half a CPU).
fn parse_cpu_max(s: &str) -> Option<f64> {
    let mut it = s.split_whitespace();
    let quota = it.next()?;
    let period = it.next().and_then(|p| p.parse().ok());
    quota_cpus(quota.parse().ok(), period)
}

/// A quota over its period in CPUs; none for no quota (v1 -1, v2 `max`).
// Cast: quotas and periods are microseconds, far below 2^52.
#[allow(clippy::cast_precision_loss)]
fn quota_cpus(quota: Option<i64>, period: Option<u64>) -> Option<f64> {
    match (quota, period) {
        (Some(q), Some(p)) if q > 0 && p > 0 => Some(q as f64 / p as f64),
        _ => None,
    }
}

fn parse_nr_throttled(stat: &str) -> u64 {
    stat.lines()
        .find_map(|l| l.strip_prefix("nr_throttled "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// What `auto` decides, from one reading to the next: pure, so the rules
/// are tested without cgroups.
#[derive(Debug)]
pub struct Governor {
    lcores: usize,
    cpus: usize,
    mode: Mode,
    last_throttled: Option<u64>,
    quiet_until: Option<Instant>,
    hold_off: Duration,
}

/// Where a [`Governor`] is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Spinning, until a probe after this many more readings with traffic.
    On(u32),
    /// Not spinning for one reading, to count the other threads ready to
    /// run without the spin among them.
    Probe,
    /// Not spinning: too many other threads, a quota, or throttled.
    Off,
}

/// Why `auto` spins or not, for the log.
#[derive(Debug, Clone, PartialEq)]
pub enum Reason {
    /// Nothing limits the dataplane.
    Unlimited,
    /// A quota leaves room: this many CPUs.
    Room(f64),
    /// A quota below one CPU per lcore and one more: this many CPUs.
    Quota(f64),
    /// Throttled lately; the spin stays off this long.
    Throttled(Duration),
    /// Still in a hold-off after throttling.
    HoldingOff,
    /// Off for a reading, to count the other threads without the spin.
    Probing,
    /// Other threads ready to run, on average with the spin off, against
    /// the CPUs the lcores leave them.
    Crowded(f64, f64),
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Unlimited => f.write_str("no CPU quota on the dataplane's cgroups, CPUs to spare"),
            Reason::Room(c) => write!(
                f,
                "CPU quota {c:.2} CPUs leaves room for the lcores, CPUs to spare"
            ),
            Reason::Quota(c) => write!(f, "CPU quota {c:.2} CPUs: under one per lcore and one more"),
            Reason::Throttled(d) => write!(
                f,
                "the dataplane's cgroup was throttled; no spin for {}s",
                d.as_secs()
            ),
            Reason::HoldingOff => f.write_str("throttled lately"),
            Reason::Probing => f.write_str("counting the other threads without the spin"),
            Reason::Crowded(n, room) => write!(
                f,
                "{n:.1} other threads ready to run on average, for {room:.0} CPU(s) beside the lcores"
            ),
        }
    }
}

impl Governor {
    /// Whether the next reading is a probe (the spin off to count the
    /// others).
    pub fn probing(&self) -> bool {
        self.mode == Mode::Probe
    }

    /// A governor for `lcores` lcores on a host of `cpus` CPUs; it spins
    /// from its first reading unless that says otherwise, and probes after
    /// [`PROBE_FIRST`] seconds of traffic.
    pub fn new(lcores: usize, cpus: usize) -> Governor {
        Governor {
            lcores,
            cpus,
            mode: Mode::Off,
            last_throttled: None,
            quiet_until: None,
            hold_off: FIRST_HOLD_OFF,
        }
    }

    /// Whether to spin after reading `limit`, and `others` (threads other
    /// than the lcores ready to run, on average since the last reading,
    /// which was one with the spin as this returned then; none when
    /// unknown), with traffic since the last reading (`busy`) or not, at
    /// `now`, and why.
    // Cast: lcore and CPU counts are at most thousands.
    #[allow(clippy::cast_precision_loss)]
    pub fn decide(
        &mut self,
        limit: CpuLimit,
        others: Option<f64>,
        busy: bool,
        now: Instant,
    ) -> (bool, Reason) {
        let was = self.mode;
        let throttled = self.last_throttled.is_some_and(|t| limit.throttled > t);
        self.last_throttled = Some(limit.throttled);
        if let Some(c) = limit.cpus.filter(|&c| c < self.lcores as f64 + 1.0) {
            self.mode = Mode::Off;
            return (false, Reason::Quota(c));
        }
        if throttled {
            let hold = if matches!(was, Mode::On(_)) || self.quiet_until.is_none() {
                // Throttled while spinning (or the first time): hold off,
                // longer each time the spin came back and was throttled.
                let h = self.hold_off;
                if matches!(was, Mode::On(_)) {
                    self.hold_off = (self.hold_off * 2).min(MAX_HOLD_OFF);
                }
                h
            } else {
                // Throttled without spinning: the quota is tight anyway;
                // restart the current hold-off.
                self.hold_off
            };
            self.quiet_until = Some(now + hold);
            self.mode = Mode::Off;
            return (false, Reason::Throttled(hold));
        }
        if self.quiet_until.is_some_and(|t| now < t) {
            self.mode = Mode::Off;
            return (false, Reason::HoldingOff);
        }
        let free = limit.cpus.map_or(Reason::Unlimited, Reason::Room);
        // Beside busy processes spinning takes their CPU. A spinning lcore
        // keeps them waiting, so they are counted with the spin off: in a
        // probe every PROBE_EVERY seconds of traffic (without traffic the
        // spin costs nothing and the count says nothing), and every
        // reading while off.
        let room = self.cpus.saturating_sub(self.lcores) as f64;
        match was {
            Mode::On(left) if !busy => {
                self.mode = Mode::On(left);
                (true, free)
            }
            Mode::On(left) if left > 1 => {
                self.mode = Mode::On(left - 1);
                (true, free)
            }
            Mode::On(_) => {
                self.mode = Mode::Probe;
                (false, Reason::Probing)
            }
            // Traffic stopped: nothing to judge by; probe again at the
            // next reading with traffic (not sampling fast while idle).
            Mode::Probe if !busy => {
                self.mode = Mode::On(1);
                (true, free)
            }
            Mode::Probe | Mode::Off => {
                let most = room
                    + if was == Mode::Probe {
                        CROWD_ENTER
                    } else {
                        CROWD_LEAVE
                    };
                match others {
                    Some(n) if n > most => {
                        self.mode = Mode::Off;
                        (false, Reason::Crowded(n, room))
                    }
                    _ => {
                        self.mode = Mode::On(if was == Mode::Probe {
                            PROBE_EVERY
                        } else {
                            PROBE_FIRST
                        });
                        (true, free)
                    }
                }
            }
        }
    }
}

/// The gate the lcores read for `setting`: a fixed spin set once; for
/// `auto`, closed until [`govern`] opens it.
pub fn gate(setting: SpinSetting) -> Arc<SpinGate> {
    Arc::new(SpinGate::new(match setting {
        SpinSetting::Fixed(us) => Duration::from_micros(us),
        SpinSetting::Auto => Duration::ZERO,
    }))
}

/// `--spin-us auto` for `lcores` lcores: decides now, then starts the
/// governor's thread, which sets `gate` every [`CHECK_EVERY`] until `stop`
/// is set, logging each change. `traffic` counts what the lcores received
/// (it tells readings with traffic from idle ones).
pub fn govern(
    gate: &Arc<SpinGate>,
    lcores: usize,
    traffic: impl Fn() -> u64 + Send + 'static,
    stop: &Arc<AtomicBool>,
) {
    let cpus = online_cpus();
    let mut gov = Governor::new(lcores, cpus);
    let auto = Duration::from_micros(AUTO_SPIN_US);
    let (on, why) = gov.decide(read_cpu_limit(), None, false, Instant::now());
    gate.set(if on { auto } else { Duration::ZERO });
    log::info!("lcore spin (--spin-us auto): {} us: {why}", gate.micros());
    let g = Arc::clone(gate);
    let stop = Arc::clone(stop);
    let spawned = std::thread::Builder::new()
        .name("phub-spin-gov".into())
        .spawn(move || {
            let mut was = (on, std::mem::discriminant(&why));
            let mut seen = traffic();
            // A reading: its length and how often it samples (a probe is
            // short and samples more often, to cost the lcore little).
            let (mut span, mut every) = (CHECK_EVERY, SAMPLE_EVERY);
            let mut start = Instant::now();
            let (mut sum, mut samples) = (0u64, 0u32);
            // Which cgroups the process is in, looked at every MOVE_CHECK:
            // moved (into a limited one, say), it decides at once.
            let cgroups = || std::fs::read_to_string("/proc/self/cgroup").ok();
            let (mut member, mut looked) = (cgroups(), Instant::now());
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(every);
                if let Some(n) = read_running() {
                    // Less this thread, reading, and the lcores that run
                    // (an lcore asleep between bursts is not in the count:
                    // taking all of them off hid as many other threads).
                    sum += n.saturating_sub(1 + g.lcores_running(lcores) as u64);
                    samples += 1;
                }
                let now = Instant::now();
                let mut moved = false;
                if now >= looked + MOVE_CHECK {
                    let m = cgroups();
                    moved = m != member;
                    (member, looked) = (m, now);
                }
                if now < start + span && !moved {
                    continue;
                }
                // Cast: at most a few thousand threads, 50 samples.
                #[allow(clippy::cast_precision_loss)]
                let others = (samples > 0).then(|| sum as f64 / f64::from(samples));
                (sum, samples) = (0, 0);
                let limit = read_cpu_limit();
                let now_seen = traffic();
                let busy = now_seen != seen;
                seen = now_seen;
                log::debug!(
                    "lcore spin governor: {others:?} other threads ready to run, {limit:?}, traffic {busy}"
                );
                let (on, why) = gov.decide(limit, others, busy, now);
                g.set(if on { auto } else { Duration::ZERO });
                // Each change of the spin, or of why it is off.
                let kind = (on, std::mem::discriminant(&why));
                if kind != was {
                    log::info!("lcore spin (--spin-us auto): now {} us: {why}", g.micros());
                    was = kind;
                }
                (span, every) = if gov.probing() {
                    (PROBE_SPAN, PROBE_SAMPLE_EVERY)
                } else {
                    (CHECK_EVERY, SAMPLE_EVERY)
                };
                start = Instant::now();
            }
        });
    if let Err(e) = spawned {
        log::warn!("lcore spin: cannot start its governor ({e}); lcores sleep at once");
        gate.set(Duration::ZERO);
    }
}

/// How often the governor counts the threads ready to run.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(20);
/// How often it looks whether the process moved to other cgroups (then it
/// decides at once, not at the end of the reading).
pub const MOVE_CHECK: Duration = Duration::from_millis(100);
/// How long a probe is (the spin off, the others counted)...
pub const PROBE_SPAN: Duration = Duration::from_millis(250);
/// ... and how often it counts them.
pub const PROBE_SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// The calling thread's id, from `/proc/thread-self` (`PID/task/TID`).
fn thread_id() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// A thread's state letter in its `/proc/.../stat` line (`R`: running or
/// ready to run): the field after the name, which is in parentheses and
/// may itself hold spaces and parentheses.
fn parse_state(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// Threads ready to run on the host now (`/proc/loadavg`'s running count,
/// the reader included).
fn read_running() -> Option<u64> {
    parse_running(&std::fs::read_to_string("/proc/loadavg").ok()?)
}

/// `0.52 0.58 0.59 3/251 12345`: 3.
fn parse_running(loadavg: &str) -> Option<u64> {
    loadavg.split_whitespace().nth(3)?.split('/').next()?.parse().ok()
}

/// The host's online CPUs (the threads counted by [`read_running`] run on
/// all of them): `/proc/stat`'s `cpuN` lines, else what this process may
/// use.
fn online_cpus() -> usize {
    let counted = std::fs::read_to_string("/proc/stat").map_or(0, |s| {
        s.lines()
            .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
            .count()
    });
    if counted > 0 {
        counted
    } else {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_parses_auto_and_microseconds_and_names_bad_input() {
        assert_eq!("auto".parse(), Ok(SpinSetting::Auto));
        assert_eq!(" 200 ".parse(), Ok(SpinSetting::Fixed(200)));
        assert_eq!("0".parse(), Ok(SpinSetting::Fixed(0)));
        for bad in ["", "-1", "2e3", "fast", "1000001"] {
            let e = bad.parse::<SpinSetting>().unwrap_err();
            assert!(e.contains("auto") && e.contains(bad), "{e}");
        }
        assert_eq!(SpinSetting::Auto.to_string(), "auto");
        assert_eq!(SpinSetting::Fixed(7).to_string(), "7");
    }

    #[test]
    fn quotas_and_throttle_counts_are_read_from_both_cgroup_versions() {
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("50000 100000\n"), Some(0.5));
        assert_eq!(parse_cpu_max("250000 100000"), Some(2.5));
        assert_eq!(quota_cpus(Some(-1), Some(100_000)), None);
        assert_eq!(quota_cpus(Some(150_000), Some(100_000)), Some(1.5));
        assert_eq!(
            parse_nr_throttled("nr_periods 12\nnr_throttled 7\nthrottled_time 99\n"),
            7
        );
        assert_eq!(parse_nr_throttled("usage_usec 5\n"), 0);
        assert_eq!(parse_running("0.52 0.58 0.59 3/251 12345\n"), Some(3));
        assert_eq!(parse_running("garbage"), None);
        assert!(online_cpus() >= 1);
    }

    #[test]
    fn a_thread_state_is_read_after_its_name_whatever_the_name_holds() {
        assert_eq!(parse_state("4242 (phub-lcore-0) R 1 4240 0"), Some('R'));
        assert_eq!(parse_state("4242 (a) b (c)) S 1 4240 0"), Some('S'));
        assert_eq!(parse_state("4242 (truncated"), None);
    }

    #[test]
    fn lcores_count_as_running_only_while_they_run() {
        let gate = Arc::new(SpinGate::new(Duration::ZERO));
        // None enlisted: every lcore counts.
        assert_eq!(gate.lcores_running(2), 2);
        // This thread runs while it reads its own state.
        gate.enlist();
        assert_eq!(gate.lcores_running(1), 1);
        // A second lcore blocked on a channel is asleep.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (enlisted_tx, enlisted) = std::sync::mpsc::channel();
        let g = Arc::clone(&gate);
        let sleeper = std::thread::spawn(move || {
            g.enlist();
            enlisted_tx.send(()).unwrap();
            rx.recv().ok();
        });
        enlisted.recv().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while gate.lcores_running(2) != 1 {
            assert!(
                Instant::now() < deadline,
                "the blocked lcore still counts as running"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(tx);
        sleeper.join().unwrap();
        // An enlisted thread that is gone: its state cannot be read, and
        // every lcore counts, as without enlisting.
        assert_eq!(gate.lcores_running(2), 2);
    }

    #[test]
    fn the_cpu_cgroups_are_found_through_mountinfo() {
        // A hybrid host: v1 `cpu` (with cpuacct) and v2 both mounted.
        let cgroup = "12:memory:/a\n3:cpu,cpuacct:/phub-throttled-1\n0::/user.slice/x.scope\n";
        let mountinfo = "\
25 1 0:22 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
26 1 0:23 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
27 1 0:24 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct
28 1 0:25 / /sys/fs/cgroup/unified rw shared:9 - cgroup2 cgroup2 rw
";
        assert_eq!(
            cpu_cgroup_dirs(cgroup, mountinfo),
            vec![
                CgroupDir {
                    mount: "/sys/fs/cgroup/cpu,cpuacct".into(),
                    path: "/sys/fs/cgroup/cpu,cpuacct/phub-throttled-1".into(),
                    v2: false,
                },
                CgroupDir {
                    mount: "/sys/fs/cgroup/unified".into(),
                    path: "/sys/fs/cgroup/unified/user.slice/x.scope".into(),
                    v2: true,
                },
            ]
        );
        // A container: its cgroup namespace root is mounted at the top.
        let mountinfo = "40 30 0:26 /kubepods/pod1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cpu_cgroup_dirs("0::/kubepods/pod1/c\n", mountinfo),
            vec![CgroupDir {
                mount: "/sys/fs/cgroup".into(),
                path: "/sys/fs/cgroup/c".into(),
                v2: true,
            }]
        );
        // `cpuacct` alone is not the `cpu` controller; no mount, no dir.
        assert!(cpu_cgroup_dirs("2:cpuacct:/x\n", mountinfo).is_empty());
        assert!(cpu_cgroup_dirs("0::/x\n", "").is_empty());
        assert_eq!(unescape(r"/a\040b"), "/a b");
        for kept in [r"\777", r"\04", r"a\"] {
            assert_eq!(unescape(kept), kept);
        }
    }

    #[test]
    fn a_cgroup_tree_is_read_up_to_its_mount() {
        let root = std::env::temp_dir().join(format!("phub-spin-test-{}", std::process::id()));
        let leaf = root.join("outer/inner");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(root.join("outer/cpu.max"), "150000 100000\n").unwrap();
        std::fs::write(root.join("outer/cpu.stat"), "nr_throttled 3\n").unwrap();
        std::fs::write(leaf.join("cpu.max"), "max 100000\n").unwrap();
        std::fs::write(leaf.join("cpu.stat"), "nr_throttled 2\n").unwrap();
        // Above the mount: never read.
        std::fs::write(root.join("cpu.max"), "10000 100000\n").unwrap();
        let dir = CgroupDir {
            mount: root.join("outer"),
            path: leaf.clone(),
            v2: true,
        };
        let limit = read_tree(&dir);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            limit,
            CpuLimit {
                cpus: Some(1.5),
                throttled: 5
            }
        );
    }

    #[test]
    fn auto_spins_only_where_quotas_leave_room_and_nothing_throttles() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut g = Governor::new(1, 8);
        let free = |throttled| CpuLimit {
            cpus: None,
            throttled,
        };
        // No traffic here: no probes.
        assert_eq!(g.decide(free(0), None, false, s(0)), (true, Reason::Unlimited));
        // Two CPUs are room for one lcore; 1.5 are not.
        let quota = |cpus, throttled| CpuLimit {
            cpus: Some(cpus),
            throttled,
        };
        assert_eq!(
            g.decide(quota(2.0, 0), None, false, s(1)),
            (true, Reason::Room(2.0))
        );
        assert_eq!(
            g.decide(quota(1.5, 0), None, false, s(2)),
            (false, Reason::Quota(1.5))
        );
        assert_eq!(
            g.decide(quota(4.0, 0), None, false, s(3)),
            (true, Reason::Room(4.0))
        );
        // Throttled: off for the first hold-off, then on again.
        assert_eq!(
            g.decide(quota(4.0, 2), None, false, s(4)),
            (false, Reason::Throttled(FIRST_HOLD_OFF))
        );
        assert_eq!(
            g.decide(quota(4.0, 2), None, false, s(5)),
            (false, Reason::HoldingOff)
        );
        assert_eq!(
            g.decide(quota(4.0, 2), None, false, s(14)),
            (true, Reason::Room(4.0))
        );
        // Throttled again once spinning: twice as long.
        assert_eq!(
            g.decide(quota(4.0, 3), None, false, s(15)),
            (false, Reason::Throttled(FIRST_HOLD_OFF * 2))
        );
        assert_eq!(
            g.decide(quota(4.0, 3), None, false, s(34)),
            (false, Reason::HoldingOff)
        );
        // Throttled while not spinning: the same hold-off again, from now.
        assert_eq!(
            g.decide(quota(4.0, 4), None, false, s(34)),
            (false, Reason::Throttled(FIRST_HOLD_OFF * 4))
        );
        assert_eq!(
            g.decide(quota(4.0, 4), None, false, s(34 + 39)),
            (false, Reason::HoldingOff)
        );
        assert_eq!(
            g.decide(quota(4.0, 4), None, false, s(34 + 40)),
            (true, Reason::Room(4.0))
        );
        // The hold-off stops growing.
        let mut g = Governor::new(2, 8);
        let mut n = 0;
        let mut at = 0;
        for _ in 0..20 {
            assert!(g.decide(free(n), None, false, s(at)).0);
            n += 1;
            at += 1;
            let (on, why) = g.decide(free(n), None, false, s(at));
            assert!(!on);
            let Reason::Throttled(h) = why else {
                panic!("{why:?}")
            };
            assert!(h <= MAX_HOLD_OFF);
            at += h.as_secs();
        }
        assert_eq!(g.hold_off, MAX_HOLD_OFF);
    }

    #[test]
    fn auto_stops_spinning_beside_busy_threads_and_spins_again_once_they_thin_out() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let free = CpuLimit::default();
        // One lcore on 2 CPUs: one CPU beside it.
        let mut g = Governor::new(1, 2);
        assert_eq!(g.decide(free, None, false, s(0)), (true, Reason::Unlimited));
        // Idle readings never probe.
        for t in 1..30 {
            assert!(g.decide(free, Some(3.0), false, s(t)).0);
        }
        // While it spins the others wait on it, so their count says
        // nothing until the probe, after PROBE_FIRST seconds of traffic.
        assert_eq!(g.decide(free, Some(3.2), true, s(30)), (true, Reason::Unlimited));
        assert_eq!(g.decide(free, Some(3.2), true, s(31)), (false, Reason::Probing));
        // An idle reading in a probe: on (it costs nothing idle), and the
        // next reading with traffic probes.
        assert_eq!(g.decide(free, Some(0.1), false, s(32)), (true, Reason::Unlimited));
        assert_eq!(g.decide(free, Some(3.2), true, s(32)), (false, Reason::Probing));
        // As with 2 workers, the spin off (1.8 others): on, for
        // PROBE_EVERY seconds of traffic.
        assert_eq!(g.decide(free, Some(1.8), true, s(33)), (true, Reason::Unlimited));
        for t in 1..PROBE_EVERY {
            assert!(g.decide(free, Some(3.0), true, s(33 + u64::from(t))).0);
        }
        let p = 33 + u64::from(PROBE_EVERY);
        assert_eq!(g.decide(free, Some(3.0), true, s(p)), (false, Reason::Probing));
        assert!(g.probing());
        // As with 4 workers (2.8): off, and off while they stay above 2.
        assert_eq!(
            g.decide(free, Some(2.8), true, s(p + 1)),
            (false, Reason::Crowded(2.8, 1.0))
        );
        assert!(!g.probing());
        assert_eq!(
            g.decide(free, Some(2.1), true, s(p + 2)),
            (false, Reason::Crowded(2.1, 1.0))
        );
        // Under 2: on, and the next probe comes sooner.
        assert_eq!(
            g.decide(free, Some(1.9), true, s(p + 3)),
            (true, Reason::Unlimited)
        );
        assert!(g.decide(free, Some(3.0), true, s(p + 4)).0);
        assert_eq!(
            g.decide(free, Some(3.0), true, s(p + 5)),
            (false, Reason::Probing)
        );
        // 16 CPUs, 4 lcores: 12 beside them, off above 13.25.
        let mut g = Governor::new(4, 16);
        assert!(g.decide(free, None, false, s(0)).0);
        assert!(g.decide(free, Some(20.0), true, s(1)).0);
        assert!(!g.decide(free, Some(20.0), true, s(2)).0);
        assert!(g.decide(free, Some(13.2), true, s(3)).0);
        let p = 3 + u64::from(PROBE_EVERY);
        for t in 4..p {
            assert!(g.decide(free, Some(20.0), true, s(t)).0);
        }
        assert!(!g.decide(free, Some(20.0), true, s(p)).0);
        assert_eq!(
            g.decide(free, Some(13.3), true, s(p + 1)),
            (false, Reason::Crowded(13.3, 12.0))
        );
        // Nothing known while off: on.
        assert!(g.decide(free, None, true, s(p + 2)).0);
    }

    #[test]
    fn a_fixed_setting_sets_the_gate_and_auto_waits_for_its_governor() {
        assert_eq!(gate(SpinSetting::Fixed(250)).nanos(), 250_000);
        assert_eq!(gate(SpinSetting::Fixed(0)).nanos(), 0);
        assert_eq!(gate(SpinSetting::Auto).nanos(), 0);
    }
}
