//! Running phub's daemons as child processes, for every harness that starts
//! a local appliance (the workspace's tests, the virtual and lab racks,
//! phub-demo, phub-bench): free ports, waiting for a daemon's HTTP API,
//! stopping a child, and [`Daemon`], a logged child stopped when dropped.

use std::io;
use std::net::{TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use phub_proto::routes::{ControlRoute, MgmtRoute, Route};

/// Ports this process has handed out (TCP and UDP alike): a port is free
/// once its probe socket closes, so two threads starting daemons at once
/// (the tests of one binary) could otherwise both be given it, and one
/// daemon's readiness check would then be answered by the other's.
static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// Records `ports` as handed out; false (nothing recorded) if any already
/// was.
fn claim(ports: std::ops::Range<u32>) -> bool {
    let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // Cast: the range is within u16 (callers check).
    #[allow(clippy::cast_possible_truncation)]
    let ports: Vec<u16> = ports.map(|p| p as u16).collect();
    if ports.iter().any(|p| given.contains(p)) {
        return false;
    }
    given.extend(ports);
    true
}

/// A free TCP port on 127.0.0.1 (for a daemon's HTTP API), never one this
/// process handed out before.
pub fn free_port() -> io::Result<u16> {
    for _ in 0..200 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if claim(u32::from(port)..u32::from(port) + 1) {
            return Ok(port);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        "no free TCP port on 127.0.0.1 that this process has not handed out",
    ))
}

/// A base port with `n` consecutive free UDP ports on 127.0.0.1 (for a
/// dataplane's queues), none of them handed out by this process before.
pub fn free_udp_ports(n: u16) -> io::Result<u16> {
    for _ in 0..200 {
        let base = UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
        if base > u16::MAX - n {
            continue;
        }
        if (0..n).all(|i| UdpSocket::bind(("127.0.0.1", base + i)).is_ok())
            && claim(u32::from(base)..u32::from(base) + u32::from(n))
        {
            return Ok(base);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!("no {n} consecutive free UDP ports on 127.0.0.1"),
    ))
}

/// Why a daemon's API did not come up.
#[derive(Debug)]
pub enum NotUp {
    /// The process exited first.
    Exited(ExitStatus),
    /// It did not answer within the limit.
    TimedOut(Duration),
    /// The caller gave up (`cancelled` said so).
    Cancelled,
}

impl std::fmt::Display for NotUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotUp::Exited(s) => write!(f, "exited ({s}) before it answered"),
            NotUp::TimedOut(d) => write!(f, "did not answer within {} s", d.as_secs()),
            NotUp::Cancelled => f.write_str("was given up on"),
        }
    }
}

/// The URL that a dataplane's management API at `base` answers once it is
/// up (`GET /v1/info`), for [`wait_http`] and [`Daemon::wait_up`].
pub fn dataplane_ready(base: &str) -> String {
    format!("{}{}", base.trim_end_matches('/'), MgmtRoute::Info.path())
}

/// The URL that phub-control at `base` answers once it is up (`GET
/// /v1/jobs`).
pub fn control_ready(base: &str) -> String {
    format!("{}{}", base.trim_end_matches('/'), ControlRoute::Jobs.path())
}

/// Waits until `url` answers a GET (any status), polling, while `child`
/// runs, for at most `limit`, or until `cancelled()` says to stop.
pub fn wait_http(
    url: &str,
    child: &mut Child,
    limit: Duration,
    cancelled: impl Fn() -> bool,
) -> Result<(), NotUp> {
    let t = Instant::now();
    loop {
        match ureq::get(url).timeout(Duration::from_millis(300)).call() {
            Ok(_) | Err(ureq::Error::Status(..)) => return Ok(()),
            Err(ureq::Error::Transport(_)) => {}
        }
        if let Ok(Some(s)) = child.try_wait() {
            return Err(NotUp::Exited(s));
        }
        if cancelled() {
            return Err(NotUp::Cancelled);
        }
        if t.elapsed() > limit {
            return Err(NotUp::TimedOut(limit));
        }
        std::thread::sleep(Duration::from_millis(30));
    }
}

/// Stops `child`: SIGTERM, up to `grace` for it to exit, then SIGKILL.
/// Returns its exit status, or `None` when it had to be killed (or could
/// not be reaped).
pub fn terminate(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    if let Ok(Some(s)) = child.try_wait() {
        return Some(s);
    }
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        let _ = child.kill();
        let _ = child.wait();
        return None;
    };
    // SAFETY: kill(2) on our own child, not yet reaped; no memory is involved.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t = Instant::now();
    while t.elapsed() < grace {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A daemon started as a child process, its output in a log file; stopped
/// with SIGTERM (then SIGKILL) when dropped.
#[derive(Debug)]
pub struct Daemon {
    name: String,
    child: Child,
    log: PathBuf,
}

/// The log file at `path`, created anew.
fn create_log(path: &Path) -> io::Result<std::fs::File> {
    std::fs::File::create(path)
        .map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", path.display())))
}

impl Daemon {
    /// Starts `program` with `args` and `env`, stdin closed, stdout and
    /// stderr into `log` (created anew).
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: &Path,
    ) -> io::Result<Daemon> {
        let out = create_log(log)?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out.try_clone()?);
        Daemon::launch(name, cmd, out, log)
    }

    /// Starts `cmd` as built (its stdin and stdout as it set them: piped
    /// ones are taken with [`Daemon::take_stdio`]), stderr into `log`
    /// (created anew).
    pub fn spawn_command(name: &str, cmd: Command, log: &Path) -> io::Result<Daemon> {
        let err = create_log(log)?;
        Daemon::launch(name, cmd, err, log)
    }

    /// Starts `cmd` with its stderr into `err` (the file at `log`), and
    /// registers it to be stopped on a signal ([`stop_on_signal`]).
    fn launch(name: &str, mut cmd: Command, err: std::fs::File, log: &Path) -> io::Result<Daemon> {
        let child = cmd.stderr(err).spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("starting {name} ({:?}): {e}", cmd.get_program()),
            )
        })?;
        live().pids.push(child.id());
        Ok(Daemon {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
        })
    }

    /// Its piped stdin and stdout, once ([`Daemon::spawn_command`]).
    pub fn take_stdio(&mut self) -> (Option<ChildStdin>, Option<ChildStdout>) {
        (self.child.stdin.take(), self.child.stdout.take())
    }

    /// How it exited, if it has.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Its name, as given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The log's text so far (empty when it cannot be read).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `Err` saying so, with its log, when it has exited.
    pub fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(format!(
                "{} exited ({status}); its log:\n{}",
                self.name,
                self.log_text()
            )),
            _ => Ok(()),
        }
    }

    /// Waits up to `limit` for its API at `url` ([`wait_http`]); the error
    /// says why it did not come up (with its log when it exited).
    pub fn wait_up(
        &mut self,
        url: &str,
        limit: Duration,
        cancelled: impl Fn() -> bool,
    ) -> Result<(), String> {
        match wait_http(url, &mut self.child, limit, cancelled) {
            Ok(()) => Ok(()),
            Err(NotUp::Cancelled) => Err(format!("interrupted while waiting for {}", self.name)),
            Err(e @ NotUp::Exited(_)) => Err(format!("{} {e}; its log:\n{}", self.name, self.log_text())),
            Err(e) => Err(format!(
                "{} at {url} {e} (log: {})",
                self.name,
                self.log.display()
            )),
        }
    }

    /// Kills it outright (SIGKILL), as a crash would, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        untrack(self.child.id());
    }

    /// Stops it: SIGTERM, up to `grace` for it to exit, then SIGKILL;
    /// returns whether it exited on SIGTERM.
    pub fn stop(&mut self, grace: Duration) -> bool {
        let exited = terminate(&mut self.child, grace).is_some();
        untrack(self.child.id());
        exited
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// What a signal must clean up: every running [`Daemon`], the scratch
/// directories registered with [`track_dir`] and the network namespaces
/// registered with [`track_netns`].
#[derive(Default)]
struct Live {
    pids: Vec<u32>,
    dirs: Vec<PathBuf>,
    netns: Vec<String>,
}

static LIVE: Mutex<Live> = Mutex::new(Live {
    pids: Vec::new(),
    dirs: Vec::new(),
    netns: Vec::new(),
});

fn live() -> std::sync::MutexGuard<'static, Live> {
    LIVE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn untrack(pid: u32) {
    live().pids.retain(|&p| p != pid);
}

/// Registers a scratch directory for removal if a signal stops this
/// program ([`stop_on_signal`]).
pub fn track_dir(dir: &Path) {
    live().dirs.push(dir.to_path_buf());
}

/// Forgets a directory [`track_dir`] registered (it was removed).
pub fn untrack_dir(dir: &Path) {
    live().dirs.retain(|d| d != dir);
}

/// Registers a network namespace for deletion (`ip netns del`, which takes
/// its interfaces and their qdiscs with it) if a signal stops this program
/// ([`stop_on_signal`]); [`crate::virt::Netns`] does it for every namespace
/// it creates.
pub fn track_netns(name: &str) {
    live().netns.push(name.to_string());
}

/// Forgets a namespace [`track_netns`] registered (it was deleted).
pub fn untrack_netns(name: &str) {
    live().netns.retain(|n| n != name);
}

/// Whether process `pid` has exited (gone, or a zombie awaiting its parent).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name's closing parenthesis.
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// Makes SIGINT, SIGTERM and SIGHUP stop this program cleanly: every
/// running [`Daemon`] gets SIGTERM (SIGKILL after 5 s), the directories
/// [`track_dir`] registered are removed, the namespaces [`track_netns`]
/// registered are deleted, and the program exits with status 130. `program` names it in the message printed.
pub fn stop_on_signal(program: &'static str) -> Result<(), String> {
    ctrlc::set_handler(move || {
        let (pids, dirs, netns) = {
            let l = live();
            (l.pids.clone(), l.dirs.clone(), l.netns.clone())
        };
        eprintln!(
            "{program}: stopping on a signal: {} daemon(s) to stop",
            pids.len()
        );
        let signal = |pid: u32, sig: libc::c_int| {
            if let Ok(p) = libc::pid_t::try_from(pid) {
                // SAFETY: kill(2) on a child of this process that was not
                // reaped (it is still listed); no memory is involved.
                unsafe { libc::kill(p, sig) };
            }
        };
        for &p in &pids {
            signal(p, libc::SIGTERM);
        }
        let t = Instant::now();
        while !pids.iter().all(|&p| exited(p)) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        for &p in pids.iter().filter(|&&p| !exited(p)) {
            signal(p, libc::SIGKILL);
        }
        for d in &dirs {
            let _ = std::fs::remove_dir_all(d);
        }
        for n in &netns {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
        std::process::exit(130);
    })
    .map_err(|e| format!("installing the SIGINT/SIGTERM/SIGHUP handler: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads asking at once never get a port twice, TCP or UDP.
    #[test]
    fn no_port_is_handed_out_twice_in_a_process() {
        let ports: Vec<u16> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = Vec::new();
                        for _ in 0..50 {
                            mine.push(free_port().unwrap());
                            let base = free_udp_ports(3).unwrap();
                            mine.extend([base, base + 1, base + 2]);
                        }
                        mine
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ports.len(), "a port handed out twice");
    }
}
