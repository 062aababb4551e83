//! Running phub's daemons as child processes, for every harness that starts
//! a local appliance (the workspace's tests, the virtual and lab racks,
//! phub-demo, phub-bench): free ports, waiting for a daemon's HTTP API,
//! stopping a child.

use std::io;
use std::net::{TcpListener, UdpSocket};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (for a daemon's HTTP API).
pub fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A base port with `n` consecutive free UDP ports on 127.0.0.1 (for a
/// dataplane's queues).
pub fn free_udp_ports(n: u16) -> io::Result<u16> {
    for _ in 0..200 {
        let base = UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
        if base > u16::MAX - n {
            continue;
        }
        if (0..n).all(|i| UdpSocket::bind(("127.0.0.1", base + i)).is_ok()) {
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
