//! The same-run peer of `phub-bench run --baseline tcp-ps`: a plain TCP
//! parameter server written for the benchmark, run as its own process, the
//! way ps-lite's summing server works: each tensor is cut into keys of at
//! most [`MAX_KEY_BYTES`], every worker pushes every key as one message over
//! its TCP connection, the server sums each key as pushes arrive and, once
//! all W have pushed it, sends the sum back to every worker (one buffer,
//! written to each connection). Workers here are threads of the benchmark,
//! one connection each, a writer and a reader per worker, every key's push
//! sent at once (as many messages in flight as keys).
//!
//! Message: a 16-byte header of four little-endian u32 (`kind`, `key`,
//! `round`, payload bytes) and the payload. A worker opens with `HELLO`
//! (key = its rank, payload = the keys' element counts as u32), then sends
//! `PUSH`es (payload = f32 values); the server answers `RESULT`s.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;

use crate::profiles::Profile;
use crate::stats::summarize;

/// Largest key, bytes (ps-lite's usual cut of large tensors).
pub const MAX_KEY_BYTES: u64 = 4 << 20;

const HELLO: u32 = 1;
const PUSH: u32 = 2;
const RESULT: u32 = 3;
const HEADER: usize = 16;

/// What the baseline measured.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    /// `tcp-ps`.
    pub name: String,
    /// Keys the model was cut into.
    pub keys: usize,
    /// Median round, ms (all workers' timed rounds).
    pub round_ms_median: f64,
    /// 99th percentile round, ms.
    pub round_ms_p99: f64,
    /// Every timed round of every worker, ms (`[rank][round]`).
    pub round_ms: Vec<Vec<f64>>,
    /// CPU seconds of the server process over all rounds, warm-up included.
    pub server_cpu_s: Option<f64>,
    /// Server CPU seconds per GB (1e9 bytes) it received.
    pub server_cpu_s_per_gb: Option<f64>,
    /// Every result of every round equalled the expected sum.
    pub verified: bool,
}

/// Element counts of the keys `profile` is cut into.
pub fn keys_of(profile: &Profile) -> Vec<u32> {
    let max = MAX_KEY_BYTES / 4;
    let mut keys = Vec::new();
    for t in &profile.tensors {
        let mut left = t.elements;
        while left > 0 {
            let n = left.min(max);
            keys.push(u32::try_from(n).expect("a key is at most 1M elements"));
            left -= n;
        }
    }
    keys
}

fn header(kind: u32, key: u32, round: u32, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    for (i, v) in [kind, key, round, u32::try_from(len).expect("message under 4 GiB")]
        .into_iter()
        .enumerate()
    {
        h[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    h
}

fn read_header(r: &mut impl Read) -> std::io::Result<[u32; 4]> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h)?;
    let f = |i: usize| u32::from_le_bytes([h[i * 4], h[i * 4 + 1], h[i * 4 + 2], h[i * 4 + 3]]);
    Ok([f(0), f(1), f(2), f(3)])
}

// Payloads are read straight into f32 buffers and sent from them (native
// byte order: little-endian on every machine phub runs on).
fn as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

/// One key's sum in progress.
struct Acc {
    sum: Vec<f32>,
    pushed: usize,
    round: u32,
}

/// `phub-bench serve-tcp-ps`: accepts `workers` connections on `listen`,
/// prints `listening on ADDR`, and serves until every worker hangs up.
pub fn serve(listen: SocketAddr, workers: usize) -> Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?;
    println!("listening on {}", l.local_addr()?);
    std::io::stdout().flush()?;
    let mut conns = Vec::new();
    let mut keys: Option<Vec<u32>> = None;
    for _ in 0..workers {
        let (mut s, _) = l.accept().context("accepting a worker")?;
        s.set_nodelay(true)?;
        let [kind, rank, _, len] = read_header(&mut s)?;
        ensure!(kind == HELLO, "expected HELLO, got message kind {kind}");
        let mut body = vec![0u8; len as usize];
        s.read_exact(&mut body)?;
        let k: Vec<u32> = body
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        match &keys {
            None => keys = Some(k),
            Some(known) => ensure!(*known == k, "rank {rank} has other keys than the first worker"),
        }
        conns.push(s);
    }
    let keys = keys.unwrap_or_default();
    let accs: Arc<Vec<Mutex<Acc>>> = Arc::new(
        keys.iter()
            .map(|&n| {
                Mutex::new(Acc {
                    sum: vec![0.0; n as usize],
                    pushed: 0,
                    round: 0,
                })
            })
            .collect(),
    );
    // One writer per connection; a result is one shared buffer.
    let mut writers = Vec::new();
    let mut txs = Vec::new();
    for s in &conns {
        let (tx, rx) = mpsc::channel::<Arc<Vec<u8>>>();
        let mut w = s.try_clone()?;
        writers.push(std::thread::spawn(move || {
            for msg in rx {
                if w.write_all(&msg).is_err() {
                    break;
                }
            }
        }));
        txs.push(tx);
    }
    let txs = Arc::new(txs);
    let readers: Vec<_> = conns
        .into_iter()
        .map(|s| {
            let (accs, txs) = (accs.clone(), txs.clone());
            std::thread::spawn(move || -> Result<()> {
                let mut s = BufReader::with_capacity(1 << 20, s);
                let mut buf: Vec<f32> = Vec::new();
                loop {
                    let [kind, key, round, len] = match read_header(&mut s) {
                        Ok(h) => h,
                        Err(_) => return Ok(()), // the worker hung up
                    };
                    ensure!(kind == PUSH, "expected PUSH, got message kind {kind}");
                    ensure!(len % 4 == 0, "push of key {key}: {len} bytes is not whole f32s");
                    buf.resize(len as usize / 4, 0.0);
                    s.read_exact(as_bytes_mut(&mut buf))?;
                    let acc = accs.get(key as usize).context("push of an unknown key")?;
                    let mut a = acc.lock().expect("no panics while summing");
                    ensure!(buf.len() == a.sum.len(), "push of key {key} has the wrong length");
                    if a.pushed == 0 {
                        a.round = round;
                        a.sum.copy_from_slice(&buf);
                    } else {
                        ensure!(
                            a.round == round,
                            "key {key}: push of round {round} during {}",
                            a.round
                        );
                        for (d, v) in a.sum.iter_mut().zip(&buf) {
                            *d += v;
                        }
                    }
                    a.pushed += 1;
                    if a.pushed == workers {
                        a.pushed = 0;
                        let mut msg = Vec::with_capacity(HEADER + a.sum.len() * 4);
                        msg.extend_from_slice(&header(RESULT, key, round, a.sum.len() * 4));
                        msg.extend_from_slice(bytemuck::cast_slice(&a.sum));
                        drop(a);
                        let msg = Arc::new(msg);
                        for tx in txs.iter() {
                            let _ = tx.send(msg.clone());
                        }
                    }
                }
            })
        })
        .collect();
    let mut first_error = None;
    for r in readers {
        if let Err(e) = r
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("a reader panicked")))
        {
            first_error.get_or_insert(e);
        }
    }
    drop(txs);
    for w in writers {
        let _ = w.join();
    }
    first_error.map_or(Ok(()), Err)
}

/// The server process, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(workers: usize) -> Result<Server> {
    let exe = std::env::current_exe().context("finding phub-bench's own program")?;
    let mut child = Command::new(exe)
        .args([
            "serve-tcp-ps",
            "--listen",
            "127.0.0.1:0",
            "--workers",
            &workers.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the TCP parameter server")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("server stdout")?).read_line(&mut line)?;
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("the TCP parameter server said {line:?}"))?;
    Ok(Server { child, addr })
}

/// One worker's rounds: (timed round times in ms, every result right).
fn worker(
    addr: SocketAddr,
    rank: u32,
    workers: u32,
    keys: &[u32],
    rounds: u32,
    warmup: u32,
    start: &std::sync::Barrier,
) -> Result<(Vec<f64>, bool)> {
    let s = TcpStream::connect(addr).context("connecting to the TCP parameter server")?;
    s.set_nodelay(true)?;
    let hello: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
    (&s).write_all(&header(HELLO, rank, 0, hello.len()))?;
    (&s).write_all(&hello)?;
    let largest = keys.iter().copied().max().unwrap_or(0) as usize;
    let mut r = BufReader::with_capacity(1 << 20, s.try_clone()?);
    let mut times = Vec::new();
    let mut ok = true;
    let mut payload = vec![0f32; largest];
    let mut buf: Vec<f32> = Vec::new();
    start.wait();
    for round in 0..warmup + rounds {
        // Rank r pushes r + 1 + round everywhere: every sum is an exact
        // integer, the same in every element.
        let value = (rank + 1 + round) as f32;
        let expected: f32 = (0..workers).map(|k| (k + 1 + round) as f32).sum();
        payload.fill(value);
        let t = Instant::now();
        // Every key at once, from a writer thread, while results come back.
        let right = std::thread::scope(|sc| -> Result<bool> {
            let w = sc.spawn(|| -> std::io::Result<()> {
                let mut out = &s;
                for (key, &n) in keys.iter().enumerate() {
                    let key = u32::try_from(key).expect("fewer than 2^32 keys");
                    out.write_all(&header(PUSH, key, round, n as usize * 4))?;
                    out.write_all(bytemuck::cast_slice(&payload[..n as usize]))?;
                }
                Ok(())
            });
            let mut right = true;
            for _ in 0..keys.len() {
                let [kind, key, rr, len] = read_header(&mut r)?;
                ensure!(
                    kind == RESULT && rr == round,
                    "unexpected message {kind} for round {rr}"
                );
                ensure!(len % 4 == 0, "result of key {key}: {len} bytes is not whole f32s");
                buf.resize(len as usize / 4, 0.0);
                r.read_exact(as_bytes_mut(&mut buf))?;
                right &= keys.get(key as usize).is_some_and(|&n| n as usize == buf.len());
                right &= buf.first() == Some(&expected) && buf.last() == Some(&expected);
            }
            w.join()
                .map_err(|_| anyhow::anyhow!("a baseline writer panicked"))??;
            Ok(right)
        })?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if round >= warmup {
            times.push(ms);
        }
        ok &= right;
    }
    Ok((times, ok))
}

/// Runs `workers` workers against a fresh server for `warmup + rounds`
/// rounds of `profile`.
pub fn measure(profile: &Profile, workers: usize, rounds: u32, warmup: u32) -> Result<Baseline> {
    ensure!(workers >= 1, "the baseline needs at least one worker");
    let keys = keys_of(profile);
    if keys.is_empty() {
        bail!("the model has no elements");
    }
    let server = start_server(workers)?;
    let pid = server.child.id();
    let start = Arc::new(std::sync::Barrier::new(workers + 1));
    let w = u32::try_from(workers)?;
    let handles: Vec<_> = (0..w)
        .map(|rank| {
            let (keys, start, addr) = (keys.clone(), start.clone(), server.addr);
            std::thread::spawn(move || worker(addr, rank, w, &keys, rounds, warmup, &start))
        })
        .collect();
    start.wait();
    // Server CPU over all rounds, warm-up included, as the bytes it is
    // divided by.
    let cpu0 = crate::sys::cpu_seconds(pid);
    let mut round_ms = Vec::new();
    let mut verified = true;
    for h in handles {
        let (t, ok) = h
            .join()
            .map_err(|_| anyhow::anyhow!("a baseline worker panicked"))??;
        verified &= ok;
        round_ms.push(t);
    }
    let cpu1 = crate::sys::cpu_seconds(pid);
    drop(server);
    let all: Vec<f64> = round_ms.iter().flatten().copied().collect();
    let s = summarize(&all);
    let received = profile.bytes_f32() as f64 * workers as f64 * f64::from(rounds + warmup);
    let server_cpu_s = cpu0.zip(cpu1).map(|(a, b)| b - a);
    Ok(Baseline {
        name: "tcp-ps".into(),
        keys: keys.len(),
        round_ms_median: s.median,
        round_ms_p99: s.p99,
        round_ms,
        server_cpu_s,
        server_cpu_s_per_gb: server_cpu_s.map(|c| c / (received / 1e9)),
        verified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_cut_into_keys_of_at_most_4_mb() {
        let p = crate::profiles::load("uniform:3:2500000").unwrap();
        let keys = keys_of(&p);
        // 2.5M elements = 10 MB: 4 MB, 4 MB, 2 MB, three times.
        assert_eq!(keys.len(), 9);
        assert!(keys.iter().all(|&k| u64::from(k) * 4 <= MAX_KEY_BYTES));
        assert_eq!(keys.iter().map(|&k| u64::from(k)).sum::<u64>(), p.elements());
    }

    #[test]
    fn header_round_trips() {
        let h = header(PUSH, 7, 9, 4096);
        assert_eq!(read_header(&mut &h[..]).unwrap(), [PUSH, 7, 9, 4096]);
    }
}
