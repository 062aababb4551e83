//! Same-run loopback ceilings: what moving the same bytes through the same
//! kind of sockets costs on this machine, right now, with no parameter
//! server in the way. `phub-bench run` states its efficiency against the
//! UDP one.
//!
//! - **UDP echo**: L echo threads (as the dataplane has L lcores), each on
//!   one socket, and W client threads (as W workers), each on one socket set
//!   up exactly as the worker library sets its own (`phub_worker::net`:
//!   the same GSO trains, GRO receives, buffer sizes, and the same window
//!   rule, `phub_worker::auto_window`, or the run's `--window`). Each round
//!   every client sends the model's bytes in chunk-sized datagrams (an
//!   86-byte header plus the chunk payload, chunk i to echo thread i mod
//!   L) from a buffer filled once; each echo thread sends every message
//!   straight back from its receive buffer (a GRO train as a GSO train,
//!   `BatchSocket::reflect`); the client only checks each datagram's round
//!   and index. A round ends when a client has every datagram back; lost
//!   datagrams are resent after 20 ms without progress. No user-space
//!   copy at all: only the kernel's work, so nothing built on the same
//!   sockets can beat it, and phub's efficiency is its time over phub's.
//! - **TCP echo**: W clients, each with one TCP connection (TCP_NODELAY) to
//!   an echo thread, write the model's bytes and read them back
//!   concurrently: the transport ps-lite uses (ZMQ over TCP), without its
//!   framing.
//! - **veth into DPDK** (`--backend dpdk`, [`veth_testpmd`]): the virtual
//!   rack's path itself, kernel UDP senders over a veth pair into
//!   `dpdk-testpmd` on the same af_packet port the dataplane used, with the
//!   same senders (threads, sockets, datagrams), in two forms
//!   ([`Forward`]): `rxonly` (testpmd only receives) and `5tswap` (testpmd
//!   swaps MACs, IPs and UDP ports and sends every frame back, and the
//!   senders receive and count it: the same work per frame as phub's push
//!   in, result out). phub's efficiency there is its gradient ingress over
//!   the 5tswap ceiling, and over the rxonly one as a second figure.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use phub_proto::wire::HEADER_LEN;
use phub_worker::net::{BatchSocket, Datagram, SocketOptions};
use phub_worker::WorkerConfig;
use serde::Serialize;

use crate::stats::median;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Clients (the run's W).
    pub workers: usize,
    /// Echo sockets and threads (the run's L).
    pub lcores: usize,
    /// Bytes each client moves each way per round (the model's f32 bytes).
    pub profile_bytes: u64,
    /// Payload bytes per datagram.
    pub chunk_bytes: usize,
    /// Rounds; the median is reported.
    pub rounds: u32,
    /// Window override (chunks), as given to the workers.
    pub window: Option<usize>,
    /// Chunks per round of the real job (for the window rule).
    pub chunks: u64,
    /// UDP GSO sends, as the run's workers and dataplane.
    pub gso: bool,
    /// UDP GRO receives, likewise.
    pub gro: bool,
}

/// The measured ceilings.
#[derive(Debug, Clone, Serialize)]
pub struct Ceilings {
    /// Median round of the UDP echo (all clients' rounds), ms.
    pub udp_echo_round_ms: f64,
    /// Every UDP echo round of every client, ms.
    pub udp_echo_rounds_ms: Vec<f64>,
    /// How the UDP sockets were set up.
    pub udp_setup: String,
    /// Datagrams resent by the UDP echo clients (loss).
    pub udp_echo_resent: u64,
    /// Median round of the TCP echo, ms.
    pub tcp_echo_round_ms: f64,
    /// Every TCP echo round of every client, ms.
    pub tcp_echo_rounds_ms: Vec<f64>,
}

impl Ceilings {
    /// The bound as the JSON's `efficiency_bound` states it.
    pub fn describe_bound(&self) -> String {
        format!(
            "same-run loopback UDP echo of the same bytes per worker per round ({}): {:.2} ms per round",
            self.udp_setup, self.udp_echo_round_ms
        )
    }
}

/// Measures both ceilings.
pub fn measure(s: &Setup) -> Result<Ceilings> {
    let (udp, setup, resent) = udp_echo(s).context("measuring the UDP echo ceiling")?;
    let tcp = tcp_echo(s).context("measuring the TCP echo ceiling")?;
    Ok(Ceilings {
        udp_echo_round_ms: median(&udp),
        udp_echo_rounds_ms: udp,
        udp_setup: setup,
        udp_echo_resent: resent,
        tcp_echo_round_ms: median(&tcp),
        tcp_echo_rounds_ms: tcp,
    })
}

fn worker_options(s: &Setup) -> SocketOptions {
    let c = WorkerConfig::default();
    SocketOptions {
        gso: s.gso,
        gro: s.gro,
        buffer_bytes: c.socket_buffer,
    }
}

/// The dataplane side's set-up: its default 32 MiB buffers, GSO and GRO.
fn echo_options(s: &Setup) -> SocketOptions {
    SocketOptions {
        gso: s.gso,
        gro: s.gro,
        buffer_bytes: 32 << 20,
    }
}

fn udp_echo(s: &Setup) -> Result<(Vec<f64>, String, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut echo_addrs = Vec::new();
    let mut echoes = Vec::new();
    for _ in 0..s.lcores.max(1) {
        let mut sock = BatchSocket::new(UdpSocket::bind("127.0.0.1:0")?, echo_options(s))?;
        echo_addrs.push(sock.socket().local_addr()?);
        let stop = Arc::clone(&stop);
        echoes.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = sock.reflect(Some(Duration::from_millis(5)));
            }
        }));
    }
    let datagram = HEADER_LEN + s.chunk_bytes;
    let n = (s.profile_bytes as usize).div_ceil(s.chunk_bytes).max(1);
    let opts = worker_options(s);
    let barrier = Arc::new(Barrier::new(s.workers));
    let mut clients = Vec::new();
    let mut setup = String::new();
    for c in 0..s.workers {
        let sock = BatchSocket::new(UdpSocket::bind("127.0.0.1:0")?, opts)?;
        let info = sock.info();
        let window = s.window.filter(|&w| w > 0).unwrap_or_else(|| {
            phub_worker::auto_window(
                s.workers as u32,
                s.lcores,
                s.chunks as usize,
                datagram,
                info.rcvbuf,
                phub_worker::ASSUMED_LCORE_RCVBUF,
            )
        });
        if c == 0 {
            setup = format!(
                "{} client socket(s) -> {} echo socket(s), {datagram}-byte datagrams, GSO {}, GRO {}, \
                 client rcvbuf {} B, window {window} datagrams, no user-space copies",
                s.workers,
                s.lcores.max(1),
                if info.gso { "on" } else { "off" },
                if info.gro { "on" } else { "off" },
                info.rcvbuf
            );
        }
        let (barrier, echo_addrs, rounds) = (Arc::clone(&barrier), echo_addrs.clone(), s.rounds);
        let bytes = s.profile_bytes as usize;
        let chunk = s.chunk_bytes;
        clients.push(std::thread::spawn(move || {
            udp_client(sock, &echo_addrs, bytes, chunk, n, window, rounds, &barrier)
        }));
    }
    let mut all = Vec::new();
    let mut resent = 0;
    let mut failure = None;
    for c in clients {
        match c.join() {
            Ok(Ok((ms, r))) => {
                all.extend(ms);
                resent += r;
            }
            Ok(Err(e)) => failure = Some(e),
            Err(_) => failure = Some(anyhow::anyhow!("a UDP echo client panicked")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    for e in echoes {
        let _ = e.join();
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok((all, setup, resent))
}

#[allow(clippy::too_many_arguments)]
fn udp_client(
    mut sock: BatchSocket,
    echo: &[SocketAddr],
    bytes: usize,
    chunk: usize,
    n: usize,
    window: usize,
    rounds: u32,
    barrier: &Barrier,
) -> Result<(Vec<f64>, u64)> {
    let datagram = HEADER_LEN + chunk;
    let len_of = |i: usize| HEADER_LEN + (bytes - i * chunk).min(chunk);
    let mut tx: Vec<u8> = (0..n * datagram).map(|i| i as u8).collect();
    let mut got = vec![false; n];
    let mut times = Vec::new();
    let mut resent_total = 0;
    for round in 0..rounds + 1 {
        for i in 0..n {
            let d = &mut tx[i * datagram..i * datagram + 8];
            d[..4].copy_from_slice(&round.to_le_bytes());
            d[4..].copy_from_slice(&(i as u32).to_le_bytes());
        }
        got.iter_mut().for_each(|g| *g = false);
        barrier.wait();
        let t = Instant::now();
        let (mut next, mut done) = (0usize, 0usize);
        let mut last_progress = Instant::now();
        let mut batch: Vec<usize> = Vec::new();
        while done < n {
            batch.clear();
            while next < n && next - done < window {
                batch.push(next);
                next += 1;
            }
            if last_progress.elapsed() > Duration::from_millis(20) {
                let missing = (0..next).filter(|&i| !got[i]).take(window);
                let before = batch.len();
                batch.extend(missing);
                resent_total += (batch.len() - before) as u64;
                last_progress = Instant::now();
            }
            if !batch.is_empty() {
                let dg: Vec<Datagram<'_>> = batch
                    .iter()
                    .map(|&i| Datagram {
                        to: echo[i % echo.len()],
                        head: &tx[i * datagram..i * datagram + len_of(i)],
                        body: &[],
                    })
                    .collect();
                sock.send(&dg)?;
            }
            sock.recv(Some(Duration::from_millis(1)), &mut |_, d| {
                if d.len() < 8 {
                    return;
                }
                let r = u32::from_le_bytes([d[0], d[1], d[2], d[3]]);
                let i = u32::from_le_bytes([d[4], d[5], d[6], d[7]]) as usize;
                if r != round || i >= n || got[i] {
                    return;
                }
                got[i] = true;
                done += 1;
                last_progress = Instant::now();
            })?;
            if t.elapsed() > Duration::from_secs(120) {
                anyhow::bail!("the UDP echo round did not finish in 120 s ({done} of {n} datagrams back)");
            }
        }
        // Round 0 warms up (page faults, buffers).
        if round > 0 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok((times, resent_total))
}

fn tcp_echo(s: &Setup) -> Result<Vec<f64>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let w = s.workers;
    let server = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for _ in 0..w {
            let Ok((mut c, _)) = listener.accept() else { break };
            let _ = c.set_nodelay(true);
            conns.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if c.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
            }));
        }
        for c in conns {
            let _ = c.join();
        }
    });
    let barrier = Arc::new(Barrier::new(w));
    let bytes = s.profile_bytes as usize;
    let rounds = s.rounds;
    let clients: Vec<_> = (0..w)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || -> Result<Vec<f64>> {
                let c = TcpStream::connect(addr)?;
                c.set_nodelay(true)?;
                let mut reader = c.try_clone()?;
                let model: Arc<Vec<u8>> = Arc::new((0..bytes).map(|i| i as u8).collect());
                let mut back = vec![0u8; bytes];
                let mut times = Vec::new();
                for round in 0..rounds + 1 {
                    barrier.wait();
                    let t = Instant::now();
                    let (mut wr, m) = (c.try_clone()?, Arc::clone(&model));
                    let writer = std::thread::spawn(move || wr.write_all(&m));
                    reader.read_exact(&mut back)?;
                    writer
                        .join()
                        .map_err(|_| anyhow::anyhow!("TCP writer panicked"))??;
                    if round > 0 {
                        times.push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
                Ok(times)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut failure = None;
    for c in clients {
        match c.join() {
            Ok(Ok(t)) => all.extend(t),
            Ok(Err(e)) => failure = Some(e),
            Err(_) => failure = Some(anyhow::anyhow!("a TCP echo client panicked")),
        }
    }
    let _ = server.join();
    match failure {
        Some(e) => Err(e),
        None => Ok(all),
    }
}

/// What the veth ceiling sends: the run's senders and the model's datagrams.
#[derive(Debug, Clone)]
pub struct VethSetup {
    /// Sender threads (the run's W), one socket each, set up as a worker's.
    pub workers: usize,
    /// testpmd's queues and forwarding lcores (the run's L).
    pub lcores: usize,
    /// UDP payload bytes of each datagram of one pass over the model (a
    /// header plus each chunk's payload, in the workers' order).
    pub datagrams: Vec<usize>,
    /// Seconds of sending.
    pub secs: f64,
    /// UDP GSO sends, as the run's workers.
    pub gso: bool,
    /// UDP GRO receives, as the run's workers (the 5tswap ceiling's senders
    /// receive).
    pub gro: bool,
    /// Window override (datagrams in flight per sender), as given to the
    /// workers; `None`: the workers' rule, [`phub_worker::auto_window`].
    pub window: Option<usize>,
    /// Chunks per worker per round of the real job (for the window rule).
    pub chunks: u64,
    /// testpmd's lcores are pinned as the dataplane's are (`false`: floating).
    pub pin: bool,
    /// The namespace the caller's thread is in (names testpmd's EAL files).
    pub ns: String,
}

/// testpmd's forwarding mode for the veth ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Forward {
    /// `--forward-mode=rxonly`: testpmd receives and frees every frame.
    #[serde(rename = "rxonly")]
    RxOnly,
    /// `--forward-mode=5tswap`: testpmd swaps the frame's MACs, IPv4
    /// addresses and UDP ports and sends it back out of the same port.
    #[serde(rename = "5tswap")]
    FiveTupleSwap,
}

impl Forward {
    /// testpmd's name for the mode.
    fn mode(self) -> &'static str {
        match self {
            Forward::RxOnly => "rxonly",
            Forward::FiveTupleSwap => "5tswap",
        }
    }

    /// The ceiling's name, as the JSON's `efficiency_bound` gives it.
    pub fn bound_name(self) -> &'static str {
        match self {
            Forward::RxOnly => "testpmd-rxonly",
            Forward::FiveTupleSwap => "testpmd-5tswap",
        }
    }
}

/// The virtual rack's ceiling: the same senders into `dpdk-testpmd` on the
/// same af_packet port, same run.
#[derive(Debug, Clone, Serialize)]
pub struct VethCeiling {
    /// testpmd's forwarding mode.
    pub mode: Forward,
    /// The ceiling, GB/s of UDP payload: with `rxonly` what testpmd
    /// received per second while the senders ran; with `5tswap` what came
    /// back to the senders' sockets per second (`returned_gbps`).
    pub payload_gbps: f64,
    /// UDP payload bytes testpmd received per second while the senders ran, GB/s.
    pub testpmd_rx_gbps: f64,
    /// Frames testpmd received.
    pub rx_packets: u64,
    /// Frame bytes testpmd received (Ethernet, IPv4 and UDP headers included).
    pub rx_bytes: u64,
    /// Frames testpmd sent (0 with `rxonly`).
    pub tx_packets: u64,
    /// Datagrams the senders handed to the kernel.
    pub sent_datagrams: u64,
    /// `5tswap`: datagrams the senders received back (null with `rxonly`).
    pub returned_datagrams: Option<u64>,
    /// `5tswap`: UDP payload bytes received back per second, GB/s.
    pub returned_gbps: Option<f64>,
    /// `5tswap`: times a sender, its window full and nothing received for
    /// 20 ms, counted its window lost and went on.
    pub window_resets: Option<u64>,
    /// Seconds the senders ran.
    pub secs: f64,
    /// How the senders were set up.
    pub senders: String,
    /// testpmd's command line.
    pub testpmd: String,
}

/// Ethernet + IPv4 + UDP header bytes of each frame testpmd counts.
const FRAME_OVERHEAD: u64 = 14 + 20 + 8;

/// `dpdk-testpmd` on `PATH`.
fn find_testpmd() -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("dpdk-testpmd"))
            .find(|p| p.is_file())
    })
}

/// What the reader of testpmd's output has seen.
#[derive(Debug, Default)]
struct TestpmdSeen {
    /// Its port's MAC (`Port 0: XX:...`).
    mac: Option<String>,
    /// Forwarding started.
    forwarding: bool,
    /// NIC statistics blocks seen (counted at each block's TX line), and
    /// the last complete one's counters.
    blocks: u64,
    last: PortCounters,
    /// The RX figures of the block being read.
    rx: (u64, u64),
    /// The output's tail, for errors.
    tail: std::collections::VecDeque<String>,
    /// Its stdout closed.
    ended: bool,
}

/// One of testpmd's periodic NIC statistics blocks.
#[derive(Debug, Default, Clone, Copy)]
struct PortCounters {
    rx_packets: u64,
    rx_bytes: u64,
    tx_packets: u64,
}

type Shared = Arc<(std::sync::Mutex<TestpmdSeen>, std::sync::Condvar)>;

/// Reads testpmd's stdout line by line (it runs under `stdbuf -oL`, so
/// lines come as printed).
fn read_testpmd(out: impl Read, seen: Shared) {
    use std::io::BufRead;
    let num_after = |line: &str, key: &str| -> Option<u64> {
        let rest = &line[line.find(key)? + key.len()..];
        rest.split_whitespace().next()?.parse().ok()
    };
    for line in std::io::BufReader::new(out).lines() {
        let Ok(line) = line else { break };
        let (m, c) = &*seen;
        let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
        let t = line.trim();
        if let Some(mac) = t.strip_prefix("Port 0: ") {
            if mac.len() == 17 && mac.bytes().filter(|&b| b == b':').count() == 5 {
                s.mac = Some(mac.to_ascii_lowercase());
            }
        }
        if t.contains("start packet forwarding") {
            s.forwarding = true;
        }
        // The periodic NIC statistics: "RX-packets: N RX-missed: N
        // RX-bytes: N", two lines later "TX-packets: N TX-errors: N
        // TX-bytes: N", which ends the block.
        if t.starts_with("RX-packets:") && t.contains("RX-bytes:") {
            if let (Some(p), Some(b)) = (num_after(t, "RX-packets:"), num_after(t, "RX-bytes:")) {
                s.rx = (p, b);
            }
        }
        if t.starts_with("TX-packets:") && t.contains("TX-bytes:") {
            if let Some(p) = num_after(t, "TX-packets:") {
                s.last = PortCounters {
                    rx_packets: s.rx.0,
                    rx_bytes: s.rx.1,
                    tx_packets: p,
                };
                s.blocks += 1;
            }
        }
        s.tail.push_back(line);
        if s.tail.len() > 40 {
            s.tail.pop_front();
        }
        c.notify_all();
    }
    let (m, c) = &*seen;
    m.lock().unwrap_or_else(|e| e.into_inner()).ended = true;
    c.notify_all();
}

/// testpmd, stopped (SIGINT, then SIGKILL) when dropped; its EAL runtime
/// directory (left behind, empty, even with --no-shconf) is removed then.
struct Testpmd {
    child: std::process::Child,
    seen: Shared,
    stderr: std::path::PathBuf,
    runtime_dir: std::path::PathBuf,
}

impl Testpmd {
    /// Waits until `done(seen)` holds; `Err` when testpmd ends first or
    /// `limit` passes.
    fn wait_for(&self, what: &str, limit: Duration, done: impl Fn(&TestpmdSeen) -> bool) -> Result<()> {
        let (m, c) = &*self.seen;
        let t = Instant::now();
        let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
        while !done(&s) {
            if s.ended || t.elapsed() > limit {
                let why = if s.ended { "it exited" } else { "timed out" };
                let tail: Vec<&str> = s.tail.iter().map(String::as_str).collect();
                let err = std::fs::read_to_string(&self.stderr).unwrap_or_default();
                anyhow::bail!(
                    "dpdk-testpmd: waiting for {what}: {why}; its output ends:\n{}\n{}",
                    tail.join("\n"),
                    err.trim()
                );
            }
            s = c
                .wait_timeout(s, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    fn seen<T>(&self, f: impl FnOnce(&TestpmdSeen) -> T) -> T {
        f(&self.seen.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Testpmd {
    fn drop(&mut self) {
        // With --stats-period testpmd ignores its stdin and leaves on
        // SIGINT, closing its port first.
        // SAFETY: kill(2) on our own, not yet reaped child; no memory is involved.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGINT) };
        let t = Instant::now();
        let mut ended = false;
        while !ended && t.elapsed() < Duration::from_secs(10) {
            ended = matches!(self.child.try_wait(), Ok(Some(_)));
            if !ended {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if !ended {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.stderr);
        // Only if empty: files there would be another process's.
        let _ = std::fs::remove_dir(&self.runtime_dir);
    }
}

/// testpmd's EAL arguments, as the dataplane's DPDK backend builds its own.
#[cfg(feature = "dpdk")]
fn testpmd_eal(
    d: &phub_dataplane::app::DpdkOptions,
    lcores: usize,
    no_pin: bool,
    cpus: &[usize],
) -> Result<Vec<String>> {
    Ok(phub_dataplane::backend::dpdk::start::eal_args(
        d,
        Some(lcores),
        no_pin,
        cpus,
    ))
}

#[cfg(not(feature = "dpdk"))]
fn testpmd_eal(_: &phub_dataplane::app::DpdkOptions, _: usize, _: bool, _: &[usize]) -> Result<Vec<String>> {
    anyhow::bail!("this phub-bench was built without the DPDK backend (the `dpdk` feature)")
}

/// Measures the veth path's ceiling. The caller's thread is inside the
/// namespace holding the virtual rack's link, and nothing else holds the
/// af_packet port (the dataplane is stopped).
///
/// testpmd runs `--forward-mode=` `mode` on the af_packet port the
/// dataplane used (same EAL device arguments, its lcores pinned as the
/// dataplane's), printing its port counters every second. Once it
/// forwards, the appliance address gets a static ARP entry for testpmd's
/// MAC (the port's, as the dataplane answers ARP with), then W sender
/// threads, each with a socket set up as a worker's (`phub_worker::net`,
/// GSO trains, GRO receives, the workers' buffers), send the model's
/// datagrams over and over, chunk i to queue i mod L, for `secs`:
///
/// - `rxonly` ([`blast`]): as fast as the kernel takes them. The ceiling is
///   the UDP payload bytes testpmd received (its RX bytes less 42 header
///   bytes per frame) between the counters printed before the senders
///   started and the ones printed after they stopped, over the senders' time.
/// - `5tswap` ([`echo_blast`]): each sender keeps a worker's window of
///   datagrams in flight and counts what comes back; the ceiling is the UDP
///   payload bytes received back per second (testpmd's RX figure is kept
///   beside it). testpmd echoes each frame's bytes as they came, and a
///   local sender's frames carry only the pseudo-header's share of the UDP
///   checksum (veth offloads it, and GSO needs that offload), which the
///   senders' kernel would reject; so for this ceiling a tc program on the
///   senders' veth end ([`ZeroUdpChecksum`]) sets the UDP checksum of every
///   arriving frame to 0 ("none", RFC 768), and removes itself after.
pub fn veth_testpmd(s: &VethSetup, mode: Forward) -> Result<VethCeiling> {
    use phub_hwtests::virt;
    let bin = find_testpmd().context(
        "dpdk-testpmd is not installed (Debian: apt-get install dpdk-dev; tools/setup.sh installs it)",
    )?;
    let lcores = s.lcores.max(1);
    // testpmd's EAL --file-prefix, and so its runtime directory's name.
    let prefix = format!("{}-testpmd-{}", s.ns, mode.mode());
    let cpus: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    let mut args = testpmd_eal(
        &phub_dataplane::app::DpdkOptions {
            eal: Some(virt::af_packet_eal(lcores, &prefix, 0)),
            ..Default::default()
        },
        lcores,
        !s.pin,
        &cpus,
    )?;
    args.push("--".into());
    args.extend([
        format!("--forward-mode={}", mode.mode()),
        "--stats-period=1".into(),
        format!("--rxq={lcores}"),
        format!("--txq={lcores}"),
        format!("--nb-cores={lcores}"),
        "--mbuf-size=16512".into(),
        "--total-num-mbufs=8192".into(),
    ]);
    let stderr = std::env::temp_dir().join(format!("{prefix}.err"));
    let err = std::fs::File::create(&stderr).with_context(|| format!("creating {}", stderr.display()))?;
    let mut cmd = if Command::new("stdbuf").arg("--version").output().is_ok() {
        let mut c = Command::new("stdbuf");
        c.arg("-oL").arg(&bin);
        c
    } else {
        Command::new(&bin)
    };
    let testpmd_line = format!("{} {}", bin.display(), args.join(" "));
    let spawned = cmd
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(err)
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&stderr);
            return Err(anyhow::Error::new(e).context(format!("starting {}", bin.display())));
        }
    };
    let out = child.stdout.take();
    let seen: Shared = Arc::default();
    // From here on testpmd is stopped and its files removed on every exit,
    // error or not.
    let tp = Testpmd {
        child,
        seen,
        stderr,
        runtime_dir: std::path::Path::new("/var/run/dpdk").join(&prefix),
    };
    let out = out.context("testpmd's stdout")?;
    let reader = {
        let seen = Arc::clone(&tp.seen);
        std::thread::spawn(move || read_testpmd(out, seen))
    };
    tp.wait_for("its port to forward", Duration::from_secs(60), |s| {
        s.forwarding && s.blocks > 0
    })?;
    let mac = tp
        .seen(|s| s.mac.clone())
        .context("dpdk-testpmd did not print its port's MAC")?;
    // Starting the port bounced the interface, which flushed the neighbour
    // table: the senders' kernel learns testpmd's MAC only now.
    let out = Command::new("ip")
        .args(["neigh", "replace", virt::APPLIANCE_IP, "lladdr", &mac])
        .args(["dev", virt::WORKER_IF, "nud", "permanent"])
        .output()
        .context("running ip neigh")?;
    anyhow::ensure!(
        out.status.success(),
        "ip neigh replace {} lladdr {mac}: {}",
        virt::APPLIANCE_IP,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    // Declared after `tp`, so dropped (detached) before testpmd stops.
    let zero = match mode {
        Forward::RxOnly => None,
        Forward::FiveTupleSwap => Some(
            ZeroUdpChecksum::attach(virt::WORKER_IF)
                .context("zeroing the echoed frames' UDP checksums on the senders' veth end")?,
        ),
    };
    let b0 = tp.seen(|s| s.blocks);
    tp.wait_for("its counters", Duration::from_secs(10), |s| s.blocks > b0)?;
    let c0 = tp.seen(|s| s.last);
    let sent = match mode {
        Forward::RxOnly => blast(s)?,
        Forward::FiveTupleSwap => echo_blast(s)?,
    };
    // Two more printouts: the second was surely printed after the last frame.
    let b1 = tp.seen(|s| s.blocks);
    tp.wait_for("its counters", Duration::from_secs(10), |s| s.blocks >= b1 + 2)?;
    let c1 = tp.seen(|s| s.last);
    drop(zero);
    drop(tp);
    let _ = reader.join();
    let rx_packets = c1.rx_packets.saturating_sub(c0.rx_packets);
    let rx_bytes = c1.rx_bytes.saturating_sub(c0.rx_bytes);
    let payload = rx_bytes.saturating_sub(FRAME_OVERHEAD * rx_packets);
    let secs = sent.secs.max(1e-9);
    let testpmd_rx_gbps = payload as f64 / secs / 1e9;
    let returned_gbps = sent.returned.map(|(_, bytes)| bytes as f64 / secs / 1e9);
    Ok(VethCeiling {
        mode,
        payload_gbps: returned_gbps.unwrap_or(testpmd_rx_gbps),
        testpmd_rx_gbps,
        rx_packets,
        rx_bytes,
        tx_packets: c1.tx_packets.saturating_sub(c0.tx_packets),
        sent_datagrams: sent.datagrams,
        returned_datagrams: sent.returned.map(|(n, _)| n),
        returned_gbps,
        window_resets: sent.returned.map(|_| sent.window_resets),
        secs: sent.secs,
        senders: sent.senders,
        testpmd: testpmd_line,
    })
}

/// What the senders did.
struct Sent {
    /// Seconds they ran.
    secs: f64,
    /// Datagrams handed to the kernel.
    datagrams: u64,
    /// Datagrams and UDP payload bytes received back (5tswap only).
    returned: Option<(u64, u64)>,
    /// Windows counted lost (5tswap only).
    window_resets: u64,
    /// How they were set up.
    senders: String,
}

/// The appliance's queue addresses, one per testpmd queue.
fn queue_addrs(lcores: usize) -> Result<Vec<SocketAddr>> {
    use phub_hwtests::virt;
    (0..lcores)
        .map(|i| {
            format!("{}:{}", virt::APPLIANCE_IP, virt::BASE_PORT as usize + i)
                .parse()
                .map_err(|e| anyhow::anyhow!("{e}"))
        })
        .collect()
}

/// Joins the sender threads; the first error wins.
fn join_senders<T>(threads: Vec<std::thread::JoinHandle<Result<T>>>) -> Result<Vec<T>> {
    let mut out = Vec::new();
    let mut failure = None;
    for th in threads {
        match th.join() {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => failure = failure.or(Some(e)),
            Err(_) => failure = failure.or(Some(anyhow::anyhow!("a veth ceiling sender panicked"))),
        }
    }
    match failure {
        Some(e) => Err(e.context("sending to dpdk-testpmd")),
        None => Ok(out),
    }
}

/// The `rxonly` senders: W threads, each sending the model's datagrams over
/// and over for `s.secs`, as fast as the kernel takes them.
fn blast(s: &VethSetup) -> Result<Sent> {
    let opts = SocketOptions {
        gso: s.gso,
        gro: false,
        buffer_bytes: WorkerConfig::default().socket_buffer,
    };
    let lcores = s.lcores.max(1);
    let to = queue_addrs(lcores)?;
    let largest = s.datagrams.iter().copied().max().unwrap_or(HEADER_LEN);
    anyhow::ensure!(!s.datagrams.is_empty(), "the model has no datagrams");
    let barrier = Arc::new(Barrier::new(s.workers + 1));
    let deadline = Duration::from_secs_f64(s.secs);
    let mut threads = Vec::new();
    let mut gso_on = false;
    for _ in 0..s.workers {
        let sock = BatchSocket::new(UdpSocket::bind("0.0.0.0:0")?, opts)?;
        gso_on = sock.info().gso;
        let (barrier, to, sizes) = (Arc::clone(&barrier), to.clone(), s.datagrams.clone());
        threads.push(std::thread::spawn(move || -> Result<u64> {
            let mut sock = sock;
            let buf: Vec<u8> = (0..largest).map(|i| i as u8).collect();
            let mut sent = 0u64;
            barrier.wait();
            let t = Instant::now();
            'outer: loop {
                // One pass over the model in batches of 64 datagrams, as a
                // worker's window hands them to the kernel.
                for (b, batch) in sizes.chunks(64).enumerate() {
                    let dg: Vec<Datagram<'_>> = batch
                        .iter()
                        .enumerate()
                        .map(|(i, &len)| Datagram {
                            to: to[(b * 64 + i) % to.len()],
                            head: &buf[..len],
                            body: &[],
                        })
                        .collect();
                    sent += sock.send(&dg)? as u64;
                    if t.elapsed() >= deadline {
                        break 'outer;
                    }
                }
            }
            Ok(sent)
        }));
    }
    barrier.wait();
    let t = Instant::now();
    let sent: u64 = join_senders(threads)?.into_iter().sum();
    let secs = t.elapsed().as_secs_f64();
    let senders = format!(
        "{} sender thread(s), one socket each as a worker's (GSO {}, {} B socket buffers), the model's \
         {} datagrams of up to {largest} B per pass, chunk i to queue i mod {lcores}, for {secs:.1} s",
        s.workers,
        if gso_on { "on" } else { "off" },
        opts.buffer_bytes,
        s.datagrams.len()
    );
    Ok(Sent {
        secs,
        datagrams: sent,
        returned: None,
        window_resets: 0,
        senders,
    })
}

/// The `5tswap` senders: W threads, one socket each set up as a worker's
/// (GSO sends, GRO receives, its buffers). Each thread does what a
/// worker's I/O thread does with its one socket: it sends until a window
/// of datagrams is in flight (the workers' window: `s.window` or
/// [`phub_worker::auto_window`]), receives what has come back (waiting up
/// to 1 ms only while the window is full), sends again as replies free the
/// window, and so on, over the model's datagrams again and again for
/// `s.secs`, each datagram from its own place in a model-sized buffer (as
/// a worker sends its gradients). One thread sending and receiving on one socket (rather than a
/// receive thread beside a send thread) is the worker's own design, so the
/// ceiling pays the same per-socket serialisation. A full window with
/// nothing back for 20 ms is counted lost and emptied (as a worker's
/// retransmission timer would resend it).
fn echo_blast(s: &VethSetup) -> Result<Sent> {
    let opts = SocketOptions {
        gso: s.gso,
        gro: s.gro,
        buffer_bytes: WorkerConfig::default().socket_buffer,
    };
    let lcores = s.lcores.max(1);
    let to = queue_addrs(lcores)?;
    let largest = s.datagrams.iter().copied().max().unwrap_or(HEADER_LEN);
    anyhow::ensure!(!s.datagrams.is_empty(), "the model has no datagrams");
    let barrier = Arc::new(Barrier::new(s.workers + 1));
    let deadline = Duration::from_secs_f64(s.secs);
    let mut threads = Vec::new();
    let mut info = None;
    let mut window = 0;
    for _ in 0..s.workers {
        let sock = BatchSocket::new(UdpSocket::bind("0.0.0.0:0")?, opts)?;
        let i = sock.info();
        info = Some(i);
        window = s.window.filter(|&w| w > 0).unwrap_or_else(|| {
            phub_worker::auto_window(
                s.workers as u32,
                lcores,
                s.chunks as usize,
                largest,
                i.rcvbuf,
                phub_worker::ASSUMED_LCORE_RCVBUF,
            )
        });
        let (barrier, to, sizes) = (Arc::clone(&barrier), to.clone(), s.datagrams.clone());
        threads.push(std::thread::spawn(move || -> Result<(u64, u64, u64, u64)> {
            let mut sock = sock;
            // The whole model, written once (so its pages exist), and each
            // datagram sent from its own place in it: the kernel reads as
            // much memory per pass as a worker's sends of its gradients do.
            let starts: Vec<usize> = sizes
                .iter()
                .scan(0, |at, &len| {
                    let start = *at;
                    *at += len;
                    Some(start)
                })
                .collect();
            let buf: Vec<u8> = (0..sizes.iter().sum::<usize>()).map(|i| i as u8).collect();
            let (mut sent, mut back, mut back_bytes, mut resets) = (0u64, 0u64, 0u64, 0u64);
            let mut in_flight = 0usize;
            let mut next = 0usize;
            let mut dg: Vec<Datagram<'_>> = Vec::with_capacity(64);
            barrier.wait();
            let t = Instant::now();
            let mut heard = Instant::now();
            while t.elapsed() < deadline {
                while in_flight < window {
                    dg.clear();
                    while dg.len() < 64 && in_flight + dg.len() < window {
                        dg.push(Datagram {
                            to: to[next % to.len()],
                            head: &buf[starts[next]..starts[next] + sizes[next]],
                            body: &[],
                        });
                        next = (next + 1) % sizes.len();
                    }
                    let n = sock.send(&dg)?;
                    sent += n as u64;
                    in_flight += n;
                    if n < dg.len() {
                        break; // the socket buffer is full: receive first
                    }
                }
                let wait = (in_flight >= window).then_some(Duration::from_millis(1));
                let n = sock.recv(wait, &mut |_, d| {
                    back_bytes += d.len() as u64;
                })?;
                back += n as u64;
                in_flight = in_flight.saturating_sub(n);
                if n > 0 {
                    heard = Instant::now();
                } else if heard.elapsed() > Duration::from_millis(20) {
                    in_flight = 0;
                    resets += 1;
                    heard = Instant::now();
                }
            }
            Ok((sent, back, back_bytes, resets))
        }));
    }
    barrier.wait();
    let t = Instant::now();
    let got = join_senders(threads)?;
    let secs = t.elapsed().as_secs_f64();
    let sum = |f: fn(&(u64, u64, u64, u64)) -> u64| got.iter().map(f).sum::<u64>();
    let info = info.context("no senders")?;
    let senders = format!(
        "{} sender thread(s), one socket each as a worker's (GSO {}, GRO {}, rcvbuf {} B), each \
         keeping a window of {window} datagrams in flight and receiving the echoes on the same \
         thread, the model's {} datagrams of up to {largest} B per pass from a model-sized buffer, chunk i to queue i mod \
         {lcores}, for {secs:.1} s; echoed frames' UDP checksums zeroed on arrival",
        s.workers,
        if info.gso { "on" } else { "off" },
        if info.gro { "on" } else { "off" },
        info.rcvbuf,
        s.datagrams.len()
    );
    Ok(Sent {
        secs,
        datagrams: sum(|g| g.0),
        returned: Some((sum(|g| g.1), sum(|g| g.2))),
        window_resets: sum(|g| g.3),
        senders,
    })
}

/// A tc ingress program (tcx, attached through a BPF link) on one
/// interface of the caller's namespace that sets the UDP checksum of every
/// arriving IPv4/UDP frame (no IP options) to 0, "no checksum". Detached
/// when dropped (closing the link), and with the namespace in any case.
///
/// Why: testpmd's 5tswap echoes a frame's bytes unchanged but for the
/// swapped addresses and ports, and a local sender's frames leave with the
/// UDP checksum field holding only the pseudo-header's sum (the veth pair
/// offers checksum offload, and UDP GSO requires it); the senders' kernel
/// rejects such a frame when it comes back (UdpInCsumErrors), and testpmd
/// cannot fix it (af_packet has no checksum offload). A zero checksum is
/// accepted unverified, so the ceiling's receivers skip the checksum pass
/// that phub's results (which carry a full checksum) cost the workers'
/// kernel: the bound errs high, never low.
struct ZeroUdpChecksum {
    // The link first: closing it detaches the program.
    _link: std::os::fd::OwnedFd,
    _prog: std::os::fd::OwnedFd,
}

impl ZeroUdpChecksum {
    fn attach(ifname: &str) -> Result<ZeroUdpChecksum> {
        use std::os::fd::{FromRawFd, OwnedFd};
        // struct bpf_insn: code, dst | src << 4, off (i16), imm (i32).
        const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
            (code as u64)
                | (((dst | (src << 4)) as u64) << 8)
                | ((off as u16 as u64) << 16)
                | ((imm as u32 as u64) << 32)
        }
        const LDX_W: u8 = 0x61; // BPF_LDX | BPF_MEM | BPF_W
        const LDX_H: u8 = 0x69;
        const LDX_B: u8 = 0x71;
        const MOV64_X: u8 = 0xbf;
        const ADD64_K: u8 = 0x07;
        const JGT_X: u8 = 0x2d;
        const JNE_K: u8 = 0x55;
        const ST_H: u8 = 0x6a;
        const MOV64_K: u8 = 0xb7;
        const CALL: u8 = 0x85;
        const EXIT: u8 = 0x95;
        // struct __sk_buff: data at 76, data_end at 80. Frame offsets:
        // EtherType 12, IPv4 version/IHL 14, protocol 23, UDP checksum 40.
        // A local sender's frames reach the veth with only the Ethernet
        // header in the skb's linear part (af_packet's transmit ring hands
        // the rest over as pages): pull the 42 header bytes in first.
        let prog: [u64; 17] = [
            insn(MOV64_X, 6, 1, 0, 0),    // 0: r6 = skb
            insn(MOV64_K, 2, 0, 0, 42),   // 1: r2 = 42
            insn(CALL, 0, 0, 0, 39),      // 2: bpf_skb_pull_data(skb, 42)
            insn(LDX_W, 2, 6, 76, 0),     // 3: r2 = skb->data
            insn(LDX_W, 3, 6, 80, 0),     // 4: r3 = skb->data_end
            insn(MOV64_X, 4, 2, 0, 0),    // 5: r4 = r2
            insn(ADD64_K, 4, 0, 0, 42),   // 6: r4 += 42
            insn(JGT_X, 4, 3, 7, 0),      // 7: if r4 > r3 goto 15
            insn(LDX_H, 5, 2, 12, 0),     // 8: r5 = EtherType (as read, little-endian)
            insn(JNE_K, 5, 0, 5, 0x0008), // 9: if not IPv4 goto 15
            insn(LDX_B, 5, 2, 14, 0),     // 10: r5 = version/IHL
            insn(JNE_K, 5, 0, 3, 0x45),   // 11: if not IPv4 without options goto 15
            insn(LDX_B, 5, 2, 23, 0),     // 12: r5 = protocol
            insn(JNE_K, 5, 0, 1, 17),     // 13: if not UDP goto 15
            insn(ST_H, 2, 0, 40, 0),      // 14: UDP checksum = 0
            insn(MOV64_K, 0, 0, 0, -1),   // 15: r0 = TCX_NEXT
            insn(EXIT, 0, 0, 0, 0),       // 16: return r0
        ];
        let license = b"GPL\0";
        // union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns,
        // license, log_level, log_size, log_buf; the rest zero.
        let mut attr = [0u64; 16];
        const BPF_PROG_TYPE_SCHED_CLS: u64 = 3;
        attr[0] = BPF_PROG_TYPE_SCHED_CLS | ((prog.len() as u64) << 32);
        attr[1] = prog.as_ptr() as u64;
        attr[2] = license.as_ptr() as u64;
        const BPF_PROG_LOAD: libc::c_long = 5;
        const BPF_LINK_CREATE: libc::c_long = 28;
        // SAFETY: bpf(2) reads `attr` (128 bytes, its size passed) and the
        // instructions and license it points to, all alive for the call;
        // it writes nothing of ours (no log buffer is given).
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_LOAD,
                attr.as_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("bpf(BPF_PROG_LOAD) of a tc program");
        }
        // SAFETY: a new descriptor that bpf(2) returned and nothing else owns.
        let prog_fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let name = std::ffi::CString::new(ifname).context("interface name")?;
        // SAFETY: a NUL-terminated name alive for the call.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("no interface {ifname}"));
        }
        // BPF_LINK_CREATE: prog_fd, target_ifindex, attach_type; the rest zero.
        use std::os::fd::AsRawFd;
        const BPF_TCX_INGRESS: u32 = 46;
        let mut link = [0u32; 16];
        link[0] = prog_fd.as_raw_fd() as u32;
        link[1] = ifindex;
        link[2] = BPF_TCX_INGRESS;
        // SAFETY: bpf(2) reads `link` (64 bytes, its size passed), alive for the call.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_LINK_CREATE,
                link.as_ptr(),
                std::mem::size_of_val(&link),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("bpf(BPF_LINK_CREATE) for tcx ingress on {ifname}"));
        }
        // SAFETY: as above.
        let link_fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(ZeroUdpChecksum {
            _link: link_fd,
            _prog: prog_fd,
        })
    }
}
