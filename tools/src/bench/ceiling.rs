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

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
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
