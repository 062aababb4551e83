//! The same-run peer of `phub-bench sparse --local --baseline tcp-ps`: a
//! plain TCP server of table rows written for the benchmark, the way
//! ps-lite's example server keeps sparse keys: one hash map per key range
//! (`SHARDS` of them, an id's range by its hash), rows created at zero on
//! first touch, each push applied at once (the benchmark's `--optimizer`,
//! the optimizer phub's table runs, by the engine's [`RowOptimizer`]) and
//! answered with the rows after it. It
//! runs in the benchmark's process, a thread per connection; each worker
//! thread has one connection.
//!
//! Request: a little-endian u32 count n, n u64 ids, n x D f32 gradients.
//! Answer: n x D f32 rows.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use phub_engine::table::{RowOptimizer, RowUpdate};

/// Key ranges, each its own map and lock.
const SHARDS: usize = 16;

/// The rows: per key range, id to `[w (D) | optimizer state]`.
struct Rows {
    dim: usize,
    opt: RowOptimizer,
    shards: Vec<Mutex<HashMap<u64, Vec<f32>>>>,
}

impl Rows {
    fn push(&self, ids: &[u64], grads: &[f32], out: &mut [f32]) {
        let d = self.dim;
        for (i, &id) in ids.iter().enumerate() {
            // Cast: the range of a hashed id, below SHARDS.
            #[allow(clippy::cast_possible_truncation)]
            let shard = (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % SHARDS;
            let mut map = self.shards[shard].lock().unwrap_or_else(|p| p.into_inner());
            let row = map.entry(id).or_insert_with(|| {
                let mut row = vec![0f32; d + self.opt.state_len(d)];
                self.opt.init_state(&mut row[d..]);
                row
            });
            let (w, state) = row.split_at_mut(d);
            self.opt.apply(w, state, &grads[i * d..(i + 1) * d]);
            out[i * d..(i + 1) * d].copy_from_slice(w);
        }
    }
}

fn serve_one(mut s: TcpStream, rows: &Rows) -> std::io::Result<()> {
    let d = rows.dim;
    let (mut ids, mut grads, mut out, mut buf) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    loop {
        let mut n = [0u8; 4];
        if s.read_exact(&mut n).is_err() {
            return Ok(()); // the worker closed
        }
        let n = u32::from_le_bytes(n) as usize;
        buf.resize(n * (8 + 4 * d), 0);
        s.read_exact(&mut buf)?;
        ids.clear();
        ids.extend(
            buf[..8 * n]
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap())),
        );
        grads.clear();
        grads.extend(
            buf[8 * n..]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap())),
        );
        out.resize(n * d, 0f32);
        rows.push(&ids, &grads, &mut out);
        let bytes: Vec<u8> = out.iter().flat_map(|v| v.to_le_bytes()).collect();
        s.write_all(&bytes)?;
    }
}

/// A worker's connection to the server.
pub struct Client {
    s: TcpStream,
    dim: usize,
    req: Vec<u8>,
    ans: Vec<u8>,
}

impl Client {
    /// One push of `ids` with `grads`; the rows after it into `out`.
    pub fn push_pull(&mut self, ids: &[u64], grads: &[f32], out: &mut [f32]) -> Result<()> {
        self.req.clear();
        // Cast: a batch of ids, far below 2^32.
        #[allow(clippy::cast_possible_truncation)]
        self.req.extend_from_slice(&(ids.len() as u32).to_le_bytes());
        for id in ids {
            self.req.extend_from_slice(&id.to_le_bytes());
        }
        for g in &grads[..ids.len() * self.dim] {
            self.req.extend_from_slice(&g.to_le_bytes());
        }
        self.s
            .write_all(&self.req)
            .context("sending to the TCP row server")?;
        self.ans.resize(4 * ids.len() * self.dim, 0);
        self.s
            .read_exact(&mut self.ans)
            .context("reading the TCP row server's answer")?;
        for (o, b) in out.iter_mut().zip(self.ans.chunks_exact(4)) {
            *o = f32::from_le_bytes(b.try_into().unwrap());
        }
        Ok(())
    }
}

/// The server, listening on loopback; its connection threads end when
/// their connection closes, its listener (and so the rows it shares with
/// them) with the process: one server per benchmark run.
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    dim: usize,
}

impl Server {
    /// Starts a server of rows of `dim` values updated by `opt`.
    pub fn start(dim: usize, opt: RowOptimizer) -> Result<Server> {
        let l = TcpListener::bind("127.0.0.1:0").context("binding the TCP row server")?;
        let addr = l.local_addr()?;
        let rows = Arc::new(Rows {
            dim,
            opt,
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        });
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let _ = s.set_nodelay(true);
                let rows = Arc::clone(&rows);
                std::thread::spawn(move || serve_one(s, &rows));
            }
        });
        Ok(Server { addr, dim })
    }

    /// A connection for one worker.
    pub fn connect(&self) -> Result<Client> {
        let s = TcpStream::connect(self.addr).context("connecting to the TCP row server")?;
        s.set_nodelay(true)?;
        Ok(Client {
            s,
            dim: self.dim,
            req: Vec::new(),
            ans: Vec::new(),
        })
    }
}
