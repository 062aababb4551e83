//! phub-worker: the library a training process links to exchange tensors
//! with a phub appliance.
//!
//! Layer: client library, with I/O. A [`Worker`] joins a job through
//! phub-control's HTTP API ([`Worker::join`]), learns where every chunk of
//! every key lives, and then exchanges keys (tensors) with the dataplane
//! over UDP: [`Worker::init`] for the initial broadcast (round 0),
//! [`Worker::push_pull`] for each later round, [`Worker::pull`] to catch up
//! after a rejoin. Calls return a [`Handle`] at once; [`Worker::wait`] blocks
//! until the key's result is in, so several keys can be in flight together.
//! [`Worker::exchange`] runs a whole step's `push_pull`s with the caller's
//! buffers lent to the library instead of copied (the fast path).
//!
//! Values are `f32` slices for any job (encoded into the job's wire type
//! and decoded back), or, for a bf16 or f16 job, slices of that type
//! ([`half::bf16`], [`half::f16`]: see [`Element`]), whose bits are the
//! wire's: a mixed-precision caller's gradients go out and its results come
//! back without a conversion or a `float32` copy.
//!
//! I/O: one thread per worker, batched system calls with UDP GSO/GRO
//! ([`net`]), a window sized from the job ([`auto_window`]). For tests and
//! soaks, a seeded fault injector can lose, duplicate and reorder the
//! worker's datagrams in both directions ([`WorkerConfig::inject`]; off by
//! default).
//!
//! On the appliance's host, with a dataplane started with `--shm`, chunks
//! and results can go through shared memory (`/dev/shm` regions the
//! dataplane creates per job) while only headers cross the socket:
//! [`WorkerConfig::shm`], [`ShmMode`] (automatic by default).
//!
//! The same calls serve every consistency mode ([`Worker::consistency`],
//! PROTOCOL.md §5.8): in an async or bounded-delay job a key's round is
//! this rank's clock on it ([`Worker::key_round`], [`Worker::clock`]), each
//! `push_pull` carries the next one, and its result is the key's values
//! when the appliance answered. Shared memory is for BSP jobs only.
//!
//! Invariants (the worker's side of PROTOCOL.md §6):
//! - At most one request per key is in flight, and a key's round r+1 is sent
//!   only once this worker holds the result of round r (in async and
//!   bounded-delay jobs, r is the rank's clock; a retransmission carries
//!   the same clock, and only a RESULT of clock r completes it).
//! - At most [`WorkerConfig::window`] chunks are outstanding (sent without a
//!   result) across all keys; a late chunk is retransmitted unchanged but for
//!   the RETRANSMIT flag: at once when results of chunks sent after it to
//!   the same lcore are in (fast retransmission), or after a loss timer
//!   adapted to the measured round trip once no result comes in at all.
//! - Every request ends: with its result, with the appliance's refusal, or
//!   with [`WorkerError::Timeout`] once no result at all has come back for
//!   [`WorkerConfig::timeout`]. Nothing hangs.
//! - Only RESULTs carrying this job's id and token, for the round and chunk
//!   waited for, are accepted.
//!
//! ```no_run
//! use phub_worker::Worker;
//!
//! # fn main() -> Result<(), phub_worker::WorkerError> {
//! let w = Worker::join("http://127.0.0.1:7700", 1, 0x0123_4567_89ab_cdef, 0)?;
//! let n = w.key_len(0).unwrap() as usize;
//! let mut params = vec![0.5f32; n];
//! w.wait(w.init(0, &mut params)?)?; // every rank now holds rank 0's values
//! let grad = vec![0.1f32; n];
//! let h = w.push_pull(0, &grad, &mut params)?; // round 1; other keys may go too
//! w.wait(h)?; // params = the new parameters
//! # Ok(())
//! # }
//! ```
//!
//! All ranks must start requests for their keys in the same order (as a
//! training loop does): with a bounded window, two ranks that each fill their
//! window with a different key would wait on each other until the timeout.
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod codec;
mod elem;
mod error;
mod inject;
mod io;
pub mod net;
mod shm;
#[cfg(feature = "sim")]
pub mod sim;
mod staged;
mod stats;
mod transport;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use phub_proto::api::{ApiError, ApplianceAddr, JoinRequest};
use phub_proto::layout::{Layout, Place, Placement};
use phub_proto::spec::JobSpec;
use phub_proto::wire::{Header, MsgType, Repr, HEADER_LEN, MAX_PAYLOAD};
use shm::Regions;

pub use elem::Element;
pub use error::WorkerError;
/// The 16-bit element types ([`half::bf16`], [`half::f16`]) of the
/// version this library is built with.
pub use half;
pub use inject::INJECT_ENV;
pub use phub_proto::api::JoinResponse;
pub use phub_proto::fault::FaultSpec;
pub use phub_proto::spec::Consistency;
pub use shm::{ShmMode, SHM_ENV};
pub use staged::{Results, Staged, StagingMemory, StagingSpan};
pub use stats::WorkerStats;

use elem::{Dst, Src, Values};
use io::{Command, Completion, CurrentRegions, DirectDone, Done, KeyState, Keys, Request};
use transport::{AutoWindow, ChunkMsg, JobInfo, Kind, RawBytes, RawDst, Sink, Transport, Tx};

/// Tuning of a [`Worker`].
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Most chunks outstanding (sent, no result yet) across all keys; 0
    /// (the default) picks it from the job, see [`auto_window`]. Keep W
    /// workers' windows within an lcore's receive buffer.
    pub window: usize,
    /// A request fails with [`WorkerError::Timeout`] once no result at all
    /// has arrived for this long while requests are outstanding. Default 30 s.
    pub timeout: Duration,
    /// Lower bound of the retransmission timeout. Default 2 ms.
    pub min_rto: Duration,
    /// Upper bound of the retransmission timeout, also after doubling.
    /// Default 1 s.
    pub max_rto: Duration,
    /// Retransmission timeout before the first round-trip sample. Default 50 ms.
    pub initial_rto: Duration,
    /// Send same-size datagrams to one lcore as UDP GSO trains
    /// (`UDP_SEGMENT`). Default on; falls back by itself where the kernel
    /// refuses.
    pub gso: bool,
    /// Receive GRO trains (`UDP_GRO`). Default on.
    pub gro: bool,
    /// Receive and send buffer asked for the socket, bytes (forced beyond
    /// `net.core.rmem_max` where the process may). Default 32 MiB.
    pub socket_buffer: usize,
    /// Fault injection for tests and soaks: every datagram this worker
    /// sends and every one it receives is lost, duplicated or held back
    /// behind later ones at the spec's rates, drawn per datagram (GSO
    /// trains are formed after, GRO trains split before) from generators
    /// seeded with the spec's seed, the job and the rank. Counted in
    /// [`WorkerStats`]' `injected_*`. Default `None` (off: one branch on
    /// the `Option` per batch sent and per datagram received); when
    /// `None`, the environment variable [`INJECT_ENV`]
    /// (`PHUB_WORKER_INJECT=loss=0.05,dup=0.01,reorder=0.01,seed=3`) turns
    /// it on.
    pub inject: Option<FaultSpec>,
    /// Shared memory with a dataplane on this host (PROTOCOL.md §3.4):
    /// chunks and results go through `/dev/shm` regions the dataplane
    /// (started with `--shm`) created for the job, and only headers cross
    /// the socket. [`ShmMode::Auto`] (the default) uses them when every
    /// dataplane address is a loopback address and every region this rank
    /// needs opens with the expected length, datagrams otherwise;
    /// [`ShmMode::On`] fails the join when they cannot be used, naming the
    /// region and the reason; [`ShmMode::Off`] never tries. With `Auto`, the
    /// environment variable [`SHM_ENV`] (`PHUB_WORKER_SHM=off|auto|on`)
    /// decides instead when set. [`Worker::shm`] and [`WorkerStats`]' `shm`
    /// say whether the regions are in use. If the dataplane restarts and
    /// makes new regions, the worker maps them (datagrams while there are
    /// none). Only processes of the dataplane's user can open the regions
    /// (mode 0600), and their names need the job's token.
    pub shm: ShmMode,
    /// Congestion control: a loss found by fast retransmission halves the
    /// number of chunks let out at once, once per loss episode, and results
    /// of chunks sent once grow it back to the window, so that a worker
    /// whose pushes overflow a busy appliance's receive buffer sends less
    /// instead of retransmitting into the same overflow. **Off by
    /// default**: against a CPU-throttled dataplane with small receive
    /// buffers it sent 3x fewer retransmissions but made the slowest rounds
    /// slower (BENCHMARKS.md, "Loss response"). The environment variable
    /// [`CONGESTION_ENV`] (`PHUB_WORKER_CONGESTION=on|off`) overrides it.
    pub congestion: bool,
    /// The rack this worker's host is in, said at join: a hierarchical
    /// job's control checks it against the rack the rank belongs to.
    /// [`RACK_ENV`] (`PHUB_WORKER_RACK`) gives it when this is None.
    pub rack: Option<String>,
    /// While a request is in flight, the I/O thread polls its socket
    /// again without sleeping for this long after the last datagram came
    /// in, so that the next result is taken at once rather than after the
    /// thread is woken (on a VM, a halted vCPU: tens of microseconds).
    /// It costs CPU only while results are coming. **Off by default**
    /// (`Duration::ZERO`: sleep at once): on the 2-vCPU development VM,
    /// where the workers share their cores with the appliance, 200 us made
    /// ResNet-50 rounds 1.4x slower (BENCHMARKS.md, "Spinning before
    /// sleeping"); worth trying where the I/O thread has a core to itself.
    /// [`SPIN_ENV`] (`PHUB_WORKER_SPIN_US`) overrides it.
    pub spin: Duration,
}

/// The environment variable that gives [`WorkerConfig::rack`] when the
/// configuration does not.
pub const RACK_ENV: &str = "PHUB_WORKER_RACK";

/// The environment variable that turns [`WorkerConfig::congestion`] on
/// (`on`) or off (`off`) whatever the configuration says.
pub const CONGESTION_ENV: &str = "PHUB_WORKER_CONGESTION";

/// The environment variable that sets [`WorkerConfig::spin`], in
/// microseconds, whatever the configuration says.
pub const SPIN_ENV: &str = "PHUB_WORKER_SPIN_US";

impl Default for WorkerConfig {
    fn default() -> WorkerConfig {
        WorkerConfig {
            window: 0,
            timeout: Duration::from_secs(30),
            min_rto: Duration::from_millis(2),
            max_rto: Duration::from_secs(1),
            initial_rto: Duration::from_millis(50),
            gso: true,
            gro: true,
            socket_buffer: 32 << 20,
            inject: None,
            shm: ShmMode::Auto,
            congestion: false,
            rack: None,
            spin: Duration::ZERO,
        }
    }
}

/// Receive buffer assumed for each dataplane lcore's socket where the join
/// answer does not give it (an appliance or control that does not say, or
/// the DPDK backend): phub-dataplane's default `--socket-buffer` (32 MiB,
/// forced beyond rmem_max when it runs as root). Where the appliance says
/// ([`ApplianceAddr::rx_buffer_bytes`], what the kernel enforces), that
/// figure is used instead.
pub const ASSUMED_LCORE_RCVBUF: usize = 32 << 20;

/// The smallest window [`auto_window`] picks unless an appliance's stated
/// receive buffer allows fewer.
pub const MIN_AUTO_WINDOW: usize = 16;

/// Bytes in flight per lcore that [`auto_window`] aims at: about one
/// core's L2 cache, so that a chunk is still in cache when the lcore reads
/// it and when its result comes back. Far more than a rack's
/// bandwidth-delay product (100 Gb/s x 50 us = 625 kB).
pub const IN_FLIGHT_PER_LCORE: usize = 1 << 20;

/// The window [`WorkerConfig::window`] = 0 stands for, from the job's shape.
///
/// Two bounds, the smaller wins:
///
/// - **Incast**, a hard bound: every chunk a worker has outstanding may sit
///   in an lcore's receive buffer at the same time as the other W - 1
///   workers' chunks. The layout spreads chunks evenly over the job's L
///   lcores, so each lcore holds about `W * window / L` of them, and the
///   kernel charges each with its overhead (the skb's truesize: up to
///   twice the datagram on loopback, close to 1x for a GRO train; 2x is
///   assumed). Hence `window <= L * lcore_rcvbuf / (W * 2 * datagram)`,
///   `lcore_rcvbuf` the smallest receive buffer the appliances state
///   (else [`ASSUMED_LCORE_RCVBUF`]); past it, a slow appliance's buffer
///   overflows and the worker can only retransmit into it. Likewise the
///   results of the window come back to this worker's own socket: `window
///   <= own_rcvbuf / (2 * datagram)`.
/// - **Cache**, a soft bound: `window <= L * IN_FLIGHT_PER_LCORE / (W *
///   datagram)`. Past it, chunks fall out of cache between the copies of
///   their journey and every copy goes to DRAM: on the 2-core development
///   VM, ResNet-50 with W = 2 cost the dataplane 60 ms of CPU per round
///   with a window of 64 and 92 ms with 1024 (BENCHMARKS.md).
///
/// Never more than the job's chunks, never fewer than [`MIN_AUTO_WINDOW`]
/// (16) unless the incast bound is lower still (then that bound, at least
/// 1). For 8 KiB chunks on one lcore with 32 MiB buffers: 126 for W = 1,
/// 63 for W = 2, 16 from W = 8 on; with an appliance's 256 KiB buffer
/// (512 KiB as the kernel counts it), 14 for W = 2.
pub fn auto_window(
    workers: u32,
    lcores: usize,
    chunks: usize,
    datagram: usize,
    own_rcvbuf: usize,
    lcore_rcvbuf: usize,
) -> usize {
    let d = datagram.max(64);
    let (w, l) = (workers.max(1) as usize, lcores.max(1));
    let incast = l.saturating_mul(lcore_rcvbuf) / (w * 2 * d);
    let own = own_rcvbuf / (2 * d);
    let cache = l * IN_FLIGHT_PER_LCORE / (w * d);
    incast
        .min(own)
        .min(cache)
        .min(chunks)
        .max(MIN_AUTO_WINDOW.min(incast.max(1)))
}

/// A request in flight; give it to [`Worker::wait`] to get its result.
///
/// Dropping a handle without waiting abandons the result, not the request:
/// the exchange still completes in the background and the key becomes free
/// (when the request has ended, or at once if it had).
#[must_use = "the result is only written by Worker::wait"]
pub struct Handle<'a> {
    key: u32,
    round: u32,
    done: Receiver<Completion>,
    /// Where [`Worker::wait`] writes the result; `None` for a push without
    /// an output ([`Worker::push_staged`]), waited only in place.
    out: Option<Dst<'a>>,
}

impl std::fmt::Debug for Handle<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("key", &self.key)
            .field("round", &self.round)
            .field("elements", &self.out.as_ref().map(Dst::len))
            .finish()
    }
}

impl Handle<'_> {
    /// The key this request exchanges.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// The round this request completes (0 for `init`).
    pub fn round(&self) -> u32 {
        self.round
    }
}

/// Requests whose buffers are lent to the I/O thread rather than copied;
/// see [`Worker::exchange`].
///
/// `'b` is the lifetime of the lent buffers: it outlives the whole
/// `exchange` call, which does not return before every request started
/// here has ended, so the I/O thread never touches a buffer after it is
/// released. `'b` is invariant (as `std::thread::scope`'s `'env`), so
/// buffers with a shorter life cannot be passed in.
pub struct Exchange<'x, 'b> {
    worker: &'x Worker,
    waiting: std::cell::RefCell<Vec<(u32, Receiver<Completion>)>>,
    _lent: std::marker::PhantomData<fn(&'b ()) -> &'b ()>,
}

impl std::fmt::Debug for Exchange<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange")
            .field("requests", &self.waiting.borrow().len())
            .finish_non_exhaustive()
    }
}

impl<'b> Exchange<'_, 'b> {
    /// The next round for `key`, like [`Worker::push_pull`], but `grad` is
    /// read and `out` written in place by the I/O thread: neither may be
    /// touched until [`Worker::exchange`] returns (the borrows enforce it).
    /// Returns at once; the exchange waits for the result.
    ///
    /// `grad` and `out` are `f32` for any job, or the job's 16-bit wire
    /// type (see [`Element`]): then their bits go out and come back as
    /// they are, with no conversion and no copy on the caller's side.
    pub fn push_pull<E: Element>(
        &self,
        key: u32,
        grad: &'b [E],
        out: &'b mut [E],
    ) -> Result<(), WorkerError> {
        self.worker.check_elem::<E>()?;
        let rx = self.worker.push_pull_lent(key, Src::of(grad), Dst::of(out))?;
        self.waiting.borrow_mut().push((key, rx));
        Ok(())
    }

    /// Waits for every request started here; the first error, if any.
    fn wait_all(&self) -> Result<(), WorkerError> {
        let waiting = std::mem::take(&mut *self.waiting.borrow_mut());
        let mut first = Ok(());
        for (_, rx) in waiting {
            let r = match rx.recv() {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(WorkerError::Closed),
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// A joined worker: one rank of one job.
///
/// `Send + Sync`; every method takes `&self`, so threads may share it. One
/// background thread owns the UDP socket; dropping the worker stops it and
/// fails requests still in flight with [`WorkerError::Closed`].
#[derive(Debug)]
pub struct Worker {
    job: u16,
    token: u64,
    rank: u16,
    spec: JobSpec,
    /// The layout, checked against the spec.
    placement: Placement,
    /// Where each chunk of the job's chunk sequence lives, expanded from
    /// the layout once (8 bytes a chunk).
    places: Vec<Place>,
    /// Per lcore, where its chunks go.
    lcores: Vec<SocketAddr>,
    keys: Keys,
    cmds: Sender<Command>,
    /// A handle on the socket, to wake the I/O thread with an empty datagram.
    waker: UdpSocket,
    local: SocketAddr,
    /// The I/O thread waits in the kernel (see `send_request`).
    sleeping: Arc<std::sync::atomic::AtomicBool>,
    socket_info: net::SocketInfo,
    stats: Arc<stats::Counters>,
    /// The shared-memory mapping in use, when the join chose shared
    /// memory: `init` and `push_pull` stage chunks into it and `wait`
    /// reads results from it on the caller's thread.
    shm: Option<CurrentRegions>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Joins `job` as `rank` through phub-control at `control_url` (e.g.
    /// `http://127.0.0.1:7700`), with the default [`WorkerConfig`].
    pub fn join(control_url: &str, job: u16, token: u64, rank: u16) -> Result<Worker, WorkerError> {
        Worker::join_with(control_url, job, token, rank, WorkerConfig::default())
    }

    /// Joins `job` as `rank` through phub-control at `control_url`.
    ///
    /// A refusal by control (wrong token, unknown job, rank out of range...)
    /// is a [`WorkerError::Join`] carrying control's message verbatim.
    pub fn join_with(
        control_url: &str,
        job: u16,
        token: u64,
        rank: u16,
        config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        Worker::join_as(control_url, job, token, rank, false, config)
    }

    /// Takes the place of `rank` in `job` after this worker's process was
    /// restarted: control accepts a rank that already joined. Follow it with
    /// [`Worker::pull`] on every key to catch up with the job's parameters
    /// and rounds, then carry on with `push_pull`.
    pub fn rejoin(
        control_url: &str,
        job: u16,
        token: u64,
        rank: u16,
        config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        Worker::join_as(control_url, job, token, rank, true, config)
    }

    fn join_as(
        control_url: &str,
        job: u16,
        token: u64,
        rank: u16,
        rejoin: bool,
        config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        let join_path = phub_proto::routes::Route::path(&phub_proto::routes::ControlRoute::Join { job });
        let url = format!("{}{join_path}", control_url.trim_end_matches('/'));
        // https: control's certificate is checked against $PHUB_CA_FILE, or
        // the system's roots.
        let builder = ureq::AgentBuilder::new().timeout(Duration::from_secs(10));
        let agent = phub_http::agent(&url, None, builder).map_err(|e| WorkerError::Http {
            url: url.clone(),
            message: e.to_string(),
        })?;
        let rack = config
            .rack
            .clone()
            .or_else(|| std::env::var(RACK_ENV).ok().filter(|r| !r.trim().is_empty()));
        let answer = agent.post(&url).send_json(JoinRequest {
            token,
            rank,
            rejoin,
            rack,
        });
        let join: JoinResponse = match answer {
            Ok(resp) => resp.into_json().map_err(|e| WorkerError::Http {
                url: url.clone(),
                message: format!("reading the join response: {e}"),
            })?,
            Err(ureq::Error::Status(status, resp)) => {
                let body = resp.into_string().unwrap_or_default();
                let message = ApiError::message_of(&body);
                return Err(WorkerError::Join { url, status, message });
            }
            Err(e) => {
                return Err(WorkerError::Http {
                    url,
                    message: e.to_string(),
                })
            }
        };
        if join.job != job || join.rank != rank {
            return Err(WorkerError::BadJoin {
                message: format!(
                    "asked to join job {job} as rank {rank}, control answered for job {} rank {}",
                    join.job, join.rank
                ),
            });
        }
        Worker::from_join(join, token, config)
    }

    /// Builds a worker from an already obtained [`JoinResponse`] (for tests
    /// and embedding): checks it, decides on shared memory, binds a UDP
    /// socket, sizes the window and starts the I/O thread.
    pub fn from_join(
        join: JoinResponse,
        token: u64,
        mut config: WorkerConfig,
    ) -> Result<Worker, WorkerError> {
        match std::env::var(CONGESTION_ENV).as_deref().map(str::trim) {
            Ok("on") => config.congestion = true,
            Ok("off") => config.congestion = false,
            _ => {}
        }
        if let Ok(v) = std::env::var(SPIN_ENV) {
            let us: u64 = v.trim().parse().map_err(|_| WorkerError::Config {
                message: format!("{SPIN_ENV}={v:?}: not a number of microseconds (0 sleeps at once)"),
            })?;
            config.spin = Duration::from_micros(us);
        }
        let (lcores, placement) = check_join(&join)?;
        let places = (0..placement.chunks().total())
            .map(|seq| {
                placement
                    .place_of(seq)
                    .expect("a placement places every chunk of its sequence")
            })
            .collect();
        let shm = shared_memory(&join, token, &config, &lcores)?;
        // On loopback only when every appliance is there.
        let far = lcores
            .iter()
            .find(|a| !a.ip().is_loopback())
            .unwrap_or(&lcores[0]);
        let socket = Bound::new(far.ip(), &config)?;
        let (window, auto) = window_for(&join, &config, socket.info.rcvbuf);
        let stats = Arc::new(stats::Counters::default());
        let inject = fault_injector(&join, &config, &stats)?;
        let info = JobInfo {
            job: join.job,
            token,
            rank: join.rank,
            dtype: join.spec.dtype,
            in_order: join.spec.rack_ranks().is_none(),
        };
        let regions = shm.as_ref().and_then(|(watch, _)| watch.regions());
        let mut transport =
            Transport::new(info, window, &config, Arc::clone(&stats), regions, Instant::now());
        if let Some(auto) = auto {
            // Remade as the lcores state their receive-buffer shares.
            transport.set_auto_window(auto);
        }
        let keys: Keys = Arc::new(Mutex::new(vec![KeyState::default(); join.spec.keys.len()]));
        let (cmds, cmd_rx) = crossbeam_channel::unbounded();
        let sleeping = Arc::new(AtomicBool::new(false));
        let (watch, shm) = shm.unzip();
        let thread = io::IoThread::new(
            io::IoParts {
                socket: socket.socket,
                own: socket.local,
                sleeping: Arc::clone(&sleeping),
                cmds: cmd_rx,
                keys: Arc::clone(&keys),
                stats: Arc::clone(&stats),
                inject,
                regions: watch,
                spin: config.spin,
            },
            transport,
        );
        let thread = std::thread::Builder::new()
            .name(format!("phub-worker-{}-{}", join.job, join.rank))
            .spawn(move || thread.run())
            .map_err(io_err("starting the worker's I/O thread"))?;
        let (local, socket_info) = (socket.local, socket.info);
        log::info!(
            "phub-worker: job {} rank {} of {} joined; {} keys, {} chunks, dataplane {}, socket {local} \
             (window {window}, shared memory {}, gso {}, gro {}, rcvbuf {})",
            join.job,
            join.rank,
            join.spec.workers,
            join.spec.keys.len(),
            join.layout.chunk_count(),
            lcores[0],
            if shm.is_some() { "yes" } else { "no" },
            socket_info.gso,
            socket_info.gro,
            socket_info.rcvbuf,
        );
        Ok(Worker {
            job: join.job,
            token,
            rank: join.rank,
            spec: join.spec,
            placement,
            places,
            lcores,
            keys,
            cmds,
            waker: socket.waker,
            local,
            sleeping,
            socket_info,
            stats,
            shm,
            thread: Some(thread),
        })
    }

    /// This worker's rank.
    pub fn rank(&self) -> u16 {
        self.rank
    }

    /// The job's id.
    pub fn job(&self) -> u16 {
        self.job
    }

    /// The job's worker count W.
    pub fn workers(&self) -> u32 {
        self.spec.workers
    }

    /// The job's spec as admitted.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The job's chunk layout.
    pub fn layout(&self) -> &Layout {
        self.placement.layout()
    }

    /// Where each chunk of `key` lives, in chunk order (empty for no such
    /// key).
    fn places(&self, key: u32) -> &[Place] {
        let seqs = self.placement.chunks().of_key(key);
        // Cast: sequence numbers index `places`, which is in memory.
        #[allow(clippy::cast_possible_truncation)]
        let (a, b) = (seqs.start as usize, seqs.end as usize);
        &self.places[a..b]
    }

    /// Elements of `key`, or `None` if the job has no such key.
    pub fn key_len(&self, key: u32) -> Option<u64> {
        self.spec.keys.get(key as usize).map(|k| k.elements)
    }

    /// The last round whose result this worker holds for `key` (`None`
    /// before `init` or `pull` completed, or for an unknown key). In an
    /// async or bounded-delay job this is the key's **clock**: the number
    /// of `push_pull`s of the key whose answers this rank holds (every
    /// chunk of a key carries the same clock, PROTOCOL.md §5.8).
    pub fn key_round(&self, key: u32) -> Option<u32> {
        self.lock_keys().get(key as usize).and_then(|k| k.round)
    }

    /// This rank's clock: the lowest [`Worker::key_round`] over the job's
    /// keys, that is the number of steps (a `push_pull` of every key) whose
    /// answers this rank holds; 0 after `init`, `None` while a key is not
    /// initialised. In a BSP job it is the last round completed on every
    /// key; in an async or bounded-delay job each rank has its own, and
    /// with bounded delay τ a rank's clock is never more than τ + 1 ahead
    /// of the slowest rank's (PROTOCOL.md §5.8).
    pub fn clock(&self) -> Option<u32> {
        let keys = self.lock_keys();
        keys.iter().map(|k| k.round).min().flatten()
    }

    /// The job's consistency mode (its spec's `consistency`): BSP, async
    /// or bounded delay τ. The same calls work in every mode; what a
    /// `push_pull`'s result holds differs (PROTOCOL.md §5.8).
    pub fn consistency(&self) -> Consistency {
        self.spec.consistency
    }

    /// The local address of the worker's UDP socket.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The window in use: most chunks outstanding at once. A window made
    /// from the job's shape ([`WorkerConfig::window`] = 0) follows the
    /// receive-buffer share the appliance's lcores state in their results
    /// (PROTOCOL.md §6.1): it shrinks when other jobs come to them and grows
    /// back when they leave.
    pub fn window(&self) -> usize {
        usize::try_from(self.stats.window.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(usize::MAX)
    }

    /// What the UDP socket got (GSO, GRO, buffer sizes).
    pub fn socket_info(&self) -> net::SocketInfo {
        self.socket_info
    }

    /// A snapshot of the worker's counters.
    pub fn stats(&self) -> WorkerStats {
        self.stats.snapshot()
    }

    /// Whether chunks and results go through shared memory with the
    /// dataplane now (see [`WorkerConfig::shm`]).
    pub fn shm(&self) -> bool {
        self.stats.shm.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Round 0 for `key`: rank 0's `params` become everyone's initial values.
    /// Every rank must call it (other ranks' `params` are not sent); after
    /// [`Worker::wait`], `params` holds the broadcast values on every rank.
    ///
    /// Like every method that takes values, it takes `f32` slices for any
    /// job, or slices of the job's 16-bit wire type (see [`Element`]).
    pub fn init<'a, E: Element>(&'a self, key: u32, params: &'a mut [E]) -> Result<Handle<'a>, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, params.len())?;
        self.claim(key, |k| match k.round {
            Some(r) if r > 0 => Err(format!(
                "init is round 0 but this worker already holds round {r}; use push_pull (or pull to catch up)"
            )),
            _ => Ok(0),
        })?;
        let payload = (self.rank == 0).then_some(Src::of(&params[..]));
        let (chunks, tx, values) = self.prepare(key, elements, MsgType::Init, 0, payload, E::WIRE.is_some());
        self.submit(key, 0, Kind::Init, chunks, tx, values, Some(Dst::of(params)))
    }

    /// The next round for `key`: pushes `grad` (copied at once, so the caller
    /// may reuse it) and, after [`Worker::wait`], `out` holds the round's
    /// result: the new parameters, or the sum or mean with a `sum`/`mean` job.
    ///
    /// In an async or bounded-delay job ([`Worker::consistency`]) the push
    /// carries this rank's next clock on the key and is applied alone: `out`
    /// gets the key's values when the appliance answered (with `sum`,
    /// `grad` is a delta added to the stored values); with bounded delay τ
    /// the answer waits until no rank is more than τ clocks behind this
    /// one (PROTOCOL.md §5.8).
    ///
    /// With shared memory ([`WorkerConfig::shm`]), `grad` is encoded here
    /// straight into the staging region and `wait` decodes the result
    /// straight from the result regions into `out`; the key stays busy
    /// until then (or until the handle is dropped).
    pub fn push_pull<'a, E: Element>(
        &'a self,
        key: u32,
        grad: &[E],
        out: &'a mut [E],
    ) -> Result<Handle<'a>, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, grad.len())?;
        self.check_len(key, out.len())?;
        let round = self.claim_next_round(key)?;
        let (chunks, tx, values) = self.prepare(
            key,
            elements,
            MsgType::Push,
            round,
            Some(Src::of(grad)),
            E::WIRE.is_some(),
        );
        let out = Dst::of(out);
        self.submit(key, round, Kind::Push, chunks, tx, values, Some(out))
    }

    /// [`Worker::push_pull`] with the gradient and the result in one buffer:
    /// pushes `buf` (copied at once) and, after [`Worker::wait`], `buf`
    /// holds the round's result. Saves the caller a copy of the gradient
    /// when it exchanges in place (a DDP bucket, a NumPy array).
    pub fn push_pull_in_place<'a, E: Element>(
        &'a self,
        key: u32,
        buf: &'a mut [E],
    ) -> Result<Handle<'a>, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, buf.len())?;
        let round = self.claim_next_round(key)?;
        let (chunks, tx, values) = self.prepare(
            key,
            elements,
            MsgType::Push,
            round,
            Some(Src::of(&buf[..])),
            E::WIRE.is_some(),
        );
        let out = Dst::of(buf);
        self.submit(key, round, Kind::Push, chunks, tx, values, Some(out))
    }

    /// Claims `key` for its next round (after init or pull): in a BSP job
    /// the next round, in the other modes this rank's next clock.
    fn claim_next_round(&self, key: u32) -> Result<u32, WorkerError> {
        let consistency = self.spec.consistency;
        self.claim(key, |k| next_round(consistency, k.round))
    }

    /// Waits for a request's result and writes it into the slice the
    /// request was started with.
    ///
    /// With shared memory, the results are copied (decoded for 16-bit
    /// types) here, on the caller's thread, straight from the lcores'
    /// result regions into that slice.
    pub fn wait(&self, h: Handle<'_>) -> Result<(), WorkerError> {
        match h.done.recv() {
            Ok(Ok(Done {
                key,
                values,
                direct,
                round,
            })) => {
                let Some(out) = h.out else {
                    // The round completed; its results are let go.
                    self.keep_values(key, values);
                    drop(direct);
                    return Err(WorkerError::Sequence {
                        key,
                        message: format!(
                            "round {round} was pushed without an output (push_staged): \
                             its results can only be read in place (wait_in_place); they are let go"
                        ),
                    });
                };
                match &direct {
                    None => out.copy_from(values.as_src()),
                    Some(d) => self.copy_out(key, d, &values, out),
                }
                self.keep_values(key, values);
                // Frees the key (for a direct request), now that its results
                // are out of the result regions.
                drop(direct);
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(WorkerError::Closed),
        }
    }

    /// Fetches the last completed result of every chunk of `key` into `out`
    /// and returns its round (for a worker that rejoins a running job).
    /// Blocks until done.
    ///
    /// If the chunks stand at different rounds (this worker left in the
    /// middle of a round), the lowest is returned and becomes the key's
    /// round: the next `push_pull` completes the round the other ranks are
    /// waiting for. A key that never completed round 0 has nothing to pull,
    /// and the call ends in [`WorkerError::Timeout`].
    ///
    /// In an async or bounded-delay job the round returned is this rank's
    /// last answered clock on the key (PROTOCOL.md §5.8), and `out` gets
    /// the key's current values.
    pub fn pull<E: Element>(&self, key: u32, out: &mut [E]) -> Result<u32, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, out.len())?;
        self.claim(key, |_| Ok(0))?;
        let (chunks, buf) = self.messages(key, elements, MsgType::Pull, 0, None);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send_request(Request {
            key,
            round: 0,
            kind: Kind::Pull,
            chunks,
            tx: Tx::Owned(buf),
            values: Sink::Owned(self.take_values(key, elements, E::WIRE.is_some())),
            done: tx,
        })?;
        match rx.recv() {
            Ok(Ok(done)) => {
                Dst::of(out).copy_from(done.values.as_src());
                self.keep_values(done.key, done.values);
                Ok(done.round)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(WorkerError::Closed),
        }
    }

    fn lock_keys(&self) -> std::sync::MutexGuard<'_, Vec<KeyState>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The key's element count, checked against a slice length.
    fn check_len(&self, key: u32, got: usize) -> Result<usize, WorkerError> {
        let expected = self.key_len(key).ok_or(WorkerError::UnknownKey {
            key,
            keys: self.spec.keys.len(),
        })?;
        if expected != got as u64 {
            return Err(WorkerError::Length { key, expected, got });
        }
        Ok(got)
    }

    /// Whether the job takes slices of `E` (see [`Element`]).
    fn check_elem<E: Element>(&self) -> Result<(), WorkerError> {
        if elem::fits::<E>(self.spec.dtype) {
            return Ok(());
        }
        Err(WorkerError::ElementType {
            elem: E::NAME,
            dtype: self.spec.dtype,
        })
    }

    /// Marks `key` busy if it is free and `round` accepts its state.
    fn claim(
        &self,
        key: u32,
        round: impl FnOnce(&KeyState) -> Result<u32, String>,
    ) -> Result<u32, WorkerError> {
        let mut keys = self.lock_keys();
        let k = &mut keys[key as usize];
        if k.busy {
            return Err(WorkerError::Busy { key });
        }
        let r = round(k).map_err(|message| WorkerError::Sequence { key, message })?;
        k.busy = true;
        Ok(r)
    }

    fn release(&self, key: u32) {
        self.lock_keys()[key as usize].busy = false;
    }

    /// The key's spare result buffer, sized for `elements` `f32`s or
    /// 16-bit elements (`wire16`); its contents do not matter: every
    /// element is overwritten by a result.
    fn take_values(&self, key: u32, elements: usize, wire16: bool) -> Values {
        self.lock_keys()[key as usize].values_spare.take(wire16, elements)
    }

    /// Keeps a result buffer for the key's next request.
    fn keep_values(&self, key: u32, values: Values) {
        if let Some(k) = self.lock_keys().get_mut(key as usize) {
            k.values_spare.keep(values);
        }
    }

    /// A request's chunks, datagrams and result buffer: staged into the
    /// shared-memory mapping in use when there is one ([`Worker::staged`]),
    /// encoded into datagrams otherwise. `key` is claimed.
    fn prepare(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        payload: Option<Src<'_>>,
        wire16: bool,
    ) -> (Vec<ChunkMsg>, Tx, Sink) {
        if let Some(staged) = self.staged(key, elements, kind, round, payload) {
            return self.staged_request(key, elements, wire16, staged);
        }
        let (chunks, buf) = self.messages(key, elements, kind, round, payload);
        (
            chunks,
            Tx::Owned(buf),
            Sink::Owned(self.take_values(key, elements, wire16)),
        )
    }

    /// A staged request's transmit side (headers, the chunks in `regions`)
    /// and its result sink (read from the result regions by `wait`).
    fn staged_request(
        &self,
        key: u32,
        elements: usize,
        wire16: bool,
        (chunks, headers, regions): (Vec<ChunkMsg>, Vec<u8>, Arc<Regions>),
    ) -> (Vec<ChunkMsg>, Tx, Sink) {
        let in_region = vec![false; chunks.len()];
        let tx = Tx::Staged {
            headers,
            regions: Arc::clone(&regions),
            size: self.spec.dtype.size(),
            copied: Vec::new(),
        };
        let values = Sink::Direct {
            values: self.take_values(key, elements, wire16),
            regions,
            in_region,
        };
        (chunks, tx, values)
    }

    /// With shared memory mapped: writes every chunk of `payload` (in the
    /// wire type) into this rank's staging region of the mapping in use,
    /// at the chunk's slot, and emits the headers (HEADER_LEN bytes each,
    /// chunk c's at c * HEADER_LEN; the I/O thread sets [`flags::SHM`]
    /// when it sends them, or copies the chunk elsewhere if the mapping
    /// changed meanwhile). Returns the chunks, the headers and the
    /// mapping; `None` (nothing staged that matters) without a mapping.
    ///
    /// `key` must be claimed: then no request of the key is in flight, so
    /// this rank holds the result of every chunk of its previous round,
    /// and no lcore reads this rank's staged chunks of that round again
    /// (an lcore may read a chunk as late as the round's second
    /// contribution, but never after the round's result went out); only
    /// requests of this key write them. After a failed request (timeout)
    /// a round this rank never got the result of may still complete with
    /// what is written now: that changes only this rank's own
    /// contribution, which the retry sends anyway.
    ///
    /// [`flags::SHM`]: phub_proto::wire::flags::SHM
    fn staged(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        payload: Option<Src<'_>>,
    ) -> Option<(Vec<ChunkMsg>, Vec<u8>, Arc<Regions>)> {
        let regions = self.current_regions()?;
        self.staged_in(key, elements, kind, round, payload, regions, false)
    }

    /// The shared-memory mapping in use, if any.
    fn current_regions(&self) -> Option<Arc<Regions>> {
        self.shm
            .as_ref()?
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// [`Worker::staged`] into `regions`; with `in_place` the caller has
    /// already written every chunk's values there ([`Worker::stage`]), and
    /// the headers count them.
    #[allow(clippy::too_many_arguments)]
    fn staged_in(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        payload: Option<Src<'_>>,
        regions: Arc<Regions>,
        in_place: bool,
    ) -> Option<(Vec<ChunkMsg>, Vec<u8>, Arc<Regions>)> {
        let dtype = self.spec.dtype;
        let places = self.places(key);
        let mut buf = self.tx_buffer(key, places.len() * HEADER_LEN);
        let mut chunks = Vec::with_capacity(places.len());
        for (c, place) in places.iter().enumerate() {
            let (len, values) = self.chunk_values(payload, elements, c);
            if let Some(v) = values {
                if !regions.write_values(place.lcore, place.slot, v) {
                    // The regions were opened for this layout: not expected.
                    log::warn!(
                        "phub-worker: key {key} chunk {c}: slot {} of lcore {} is not in the shared-memory \
                         regions; sending datagrams",
                        place.slot,
                        place.lcore
                    );
                    return None;
                }
            }
            let count = if in_place {
                len as usize
            } else {
                values.map_or(0, Src::len)
            };
            let start = c * HEADER_LEN;
            let repr = self.chunk_repr(kind, round, key, c, place.slot, count);
            repr.emit(&mut Header::new_unchecked(&mut buf[start..start + HEADER_LEN]));
            chunks.push(self.chunk_msg(c, place, len, start, HEADER_LEN + count * dtype.size()));
        }
        Some((chunks, buf, regions))
    }

    /// Copies a direct request's results into `out`: each chunk from the
    /// result region of its lcore in `d.regions` when it is there, from
    /// `values` otherwise. The key is still claimed (`d._claim`), so this
    /// rank has not pushed the next round of any of its chunks and no lcore
    /// can have written another result into those slots.
    fn copy_out(&self, key: u32, d: &DirectDone, values: &Values, mut out: Dst<'_>) {
        let ce = self.layout().chunk_elems as usize;
        let mut scratch = Vec::new();
        for (c, place) in self.places(key).iter().enumerate() {
            let start = c * ce;
            let end = start + self.layout().chunk_len(out.len() as u64, chunk_index(c)) as usize;
            let dst = out.range(start, end);
            if d.in_region[c] {
                let read = d
                    .regions
                    .read_result(place.lcore, place.slot, dst, &mut scratch, true);
                // The I/O thread checked the slot (`Regions::holds_result`).
                assert!(read, "key {key} chunk {c}: result slot outside its region");
            } else {
                dst.copy_from(values.as_src().range(start, end - start));
            }
        }
    }

    /// Chunk `c` of a key of `elements` elements: its length, and its values
    /// in `payload` (none for a request that carries no values).
    fn chunk_values<'p>(
        &self,
        payload: Option<Src<'p>>,
        elements: usize,
        c: usize,
    ) -> (u32, Option<Src<'p>>) {
        let len = self.layout().chunk_len(elements as u64, chunk_index(c));
        let offset = c * self.layout().chunk_elems as usize;
        (len, payload.map(|p| p.range(offset, len as usize)))
    }

    /// The key's buffer from its previous request, `len` bytes long (reused
    /// when it has that length, else a new zeroed one).
    fn tx_buffer(&self, key: u32, len: usize) -> Vec<u8> {
        let buf = std::mem::take(&mut self.lock_keys()[key as usize].tx_spare);
        if buf.len() == len {
            buf
        } else {
            vec![0u8; len]
        }
    }

    /// Chunk `c` of a key, at `place`, with `len` elements; its datagram is
    /// `bytes` long at `start` in the request's buffer.
    fn chunk_msg(&self, c: usize, place: &Place, len: u32, start: usize, bytes: usize) -> ChunkMsg {
        ChunkMsg {
            chunk: chunk_index(c),
            slot: place.slot,
            offset: c * self.layout().chunk_elems as usize,
            len,
            to: self.lcores[usize::from(place.lcore)],
            lcore: place.lcore,
            start,
            bytes,
        }
    }

    /// The header of chunk `chunk` of `key` in slot `slot`, from this
    /// worker, announcing `count` elements.
    fn chunk_repr(&self, kind: MsgType, round: u32, key: u32, chunk: usize, slot: u32, count: usize) -> Repr {
        // Cast: a chunk holds at most chunk_elems <= MAX_PAYLOAD / size
        // elements (checked at join, `check_join`), under 2^16.
        #[allow(clippy::cast_possible_truncation)]
        let count = count as u16;
        Repr::request(kind, self.job, self.token, self.rank, round, slot)
            .with_payload(self.spec.dtype, count)
            .with_chunk(key, chunk_index(chunk))
    }

    /// Encodes one datagram per chunk of `key`, all into one buffer (the
    /// key's buffer from its previous request when it has the right size).
    fn messages(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        payload: Option<Src<'_>>,
    ) -> (Vec<ChunkMsg>, Vec<u8>) {
        let dtype = self.spec.dtype;
        let places = self.places(key);
        let total: usize = (0..places.len())
            .map(|c| {
                let count = self.chunk_values(payload, elements, c).1.map_or(0, Src::len);
                HEADER_LEN + count * dtype.size()
            })
            .sum();
        let mut buf = self.tx_buffer(key, total);
        let mut start = 0;
        let chunks = places
            .iter()
            .enumerate()
            .map(|(c, place)| {
                let (len, values) = self.chunk_values(payload, elements, c);
                let count = values.map_or(0, Src::len);
                let bytes = HEADER_LEN + count * dtype.size();
                let datagram = &mut buf[start..start + bytes];
                let repr = self.chunk_repr(kind, round, key, c, place.slot, count);
                let mut h = Header::new_unchecked(datagram);
                repr.emit(&mut h);
                if let Some(v) = values {
                    v.encode(dtype, h.payload_mut());
                }
                let m = self.chunk_msg(c, place, len, start, bytes);
                start += bytes;
                m
            })
            .collect();
        (chunks, buf)
    }

    /// The headers of a PUSH of every chunk of `key` (HEADER_LEN bytes each,
    /// chunk c's at c * HEADER_LEN), for payloads sent from the caller's
    /// own elements (already the wire's: see [`Src::wire_bytes`]).
    fn push_headers(&self, key: u32, elements: usize, round: u32) -> (Vec<ChunkMsg>, Vec<u8>) {
        let places = self.places(key);
        let mut buf = self.tx_buffer(key, places.len() * HEADER_LEN);
        let chunks = places
            .iter()
            .enumerate()
            .map(|(c, place)| {
                let len = self.layout().chunk_len(elements as u64, chunk_index(c));
                let start = c * HEADER_LEN;
                let repr = self.chunk_repr(MsgType::Push, round, key, c, place.slot, len as usize);
                repr.emit(&mut Header::new_unchecked(&mut buf[start..start + HEADER_LEN]));
                self.chunk_msg(
                    c,
                    place,
                    len,
                    start,
                    HEADER_LEN + len as usize * self.spec.dtype.size(),
                )
            })
            .collect();
        (chunks, buf)
    }

    /// Starts every chunk of a round for `key` with the caller's buffers
    /// lent, not copied (see [`Exchange`]): the result is written into
    /// `out` in place, and with an `f32` job the datagrams' payloads are
    /// `grad` itself (other dtypes are encoded into datagrams first; with
    /// shared memory the I/O thread copies the payloads into the staging
    /// regions).
    fn push_pull_lent(
        &self,
        key: u32,
        grad: Src<'_>,
        mut out: Dst<'_>,
    ) -> Result<Receiver<Completion>, WorkerError> {
        let elements = self.check_len(key, grad.len())?;
        self.check_len(key, out.len())?;
        let round = self.claim_next_round(key)?;
        let (chunks, tx) = if let Some(bytes) = grad.wire_bytes(self.spec.dtype) {
            let (chunks, headers) = self.push_headers(key, elements, round);
            let payload = RawBytes {
                ptr: bytes.as_ptr(),
                len: bytes.len(),
            };
            let size = self.spec.dtype.size();
            (
                chunks,
                Tx::Borrowed {
                    headers,
                    payload,
                    size,
                },
            )
        } else {
            let (chunks, buf) = self.messages(key, elements, MsgType::Push, round, Some(grad));
            (chunks, Tx::Owned(buf))
        };
        let (done, rx) = crossbeam_channel::bounded(1);
        self.send_request(Request {
            key,
            round,
            kind: Kind::Push,
            chunks,
            tx,
            values: Sink::Borrowed(RawDst::new(&mut out)),
            done,
        })?;
        Ok(rx)
    }

    /// Runs `f` with an [`Exchange`]: every `push_pull` started on it lends
    /// its gradient and output buffers to the I/O thread instead of copying
    /// them, and `exchange` returns only once every one of them has ended
    /// (also when `f` panics), with the first error if any failed.
    ///
    /// This saves the copies [`Worker::push_pull`] and [`Worker::wait`] make
    /// of every byte: results are written straight into the caller's output
    /// (not into a buffer then copied), and when the caller's elements are
    /// the job's wire type (`f32` for an `f32` job, [`half::bf16`] or
    /// [`half::f16`] for a 16-bit one) datagrams go out as a header plus
    /// the caller's gradient (not encoded into a buffer first). `f32`
    /// values for a 16-bit job are still encoded. With shared memory
    /// ([`WorkerConfig::shm`]) an `f32` gradient is copied once, from the
    /// caller's buffer into the staging region, and results are read from
    /// the result region straight into the caller's output, by the I/O
    /// thread (`push_pull` and `wait` make the same single copies, on the
    /// caller's thread).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), phub_worker::WorkerError> {
    /// # let w = phub_worker::Worker::join("http://127.0.0.1:7700", 1, 7, 0)?;
    /// # let (grads, mut params): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (vec![], vec![]);
    /// w.exchange(|x| {
    ///     for (k, (g, p)) in grads.iter().zip(params.iter_mut()).enumerate() {
    ///         x.push_pull(k as u32, g, p)?;
    ///     }
    ///     Ok::<(), phub_worker::WorkerError>(())
    /// })??;
    /// // params now hold the round's results.
    /// # Ok(())
    /// # }
    /// ```
    pub fn exchange<'b, R>(
        &self,
        f: impl for<'x> FnOnce(&'x Exchange<'x, 'b>) -> R,
    ) -> Result<R, WorkerError> {
        let x = Exchange {
            worker: self,
            waiting: std::cell::RefCell::new(Vec::new()),
            _lent: std::marker::PhantomData,
        };
        // Waits for every lent request if `f` unwinds: the buffers must not
        // be released while the I/O thread may still use them.
        struct Guard<'g, 'x, 'b>(&'g Exchange<'x, 'b>);
        impl Drop for Guard<'_, '_, '_> {
            fn drop(&mut self) {
                let _ = self.0.wait_all();
            }
        }
        let guard = Guard(&x);
        let r = f(&x);
        let ended = x.wait_all();
        drop(guard);
        ended.map(|()| r)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit<'a>(
        &'a self,
        key: u32,
        round: u32,
        kind: Kind,
        chunks: Vec<ChunkMsg>,
        tx: Tx,
        values: Sink,
        out: Option<Dst<'a>>,
    ) -> Result<Handle<'a>, WorkerError> {
        let (done, rx) = crossbeam_channel::bounded(1);
        self.send_request(Request {
            key,
            round,
            kind,
            chunks,
            tx,
            values,
            done,
        })?;
        Ok(Handle {
            key,
            round,
            done: rx,
            out,
        })
    }

    /// Hands a request to the I/O thread (the key is already claimed).
    fn send_request(&self, r: Request) -> Result<(), WorkerError> {
        let key = r.key;
        if self.cmds.send(Command::Submit(r)).is_err() {
            self.release(key);
            return Err(WorkerError::Closed);
        }
        // The I/O thread checks the channel before it waits; it only needs
        // a wake-up datagram when it may already be waiting.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.sleeping.load(std::sync::atomic::Ordering::SeqCst) {
            self.wake();
        }
        Ok(())
    }

    /// Interrupts the I/O thread's blocking receive.
    fn wake(&self) {
        if let Err(e) = self.waker.send_to(&[], self.local) {
            // The thread still notices within its read timeout.
            log::debug!("phub-worker: waking the I/O thread: {e}");
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.cmds.send(Command::Shutdown);
        self.wake();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("phub-worker: the I/O thread panicked");
            }
        }
    }
}

/// The shared-memory mapping a join chooses ([`WorkerConfig::shm`],
/// [`SHM_ENV`]), if any: the I/O thread's watch over it and the mapping in
/// use as the API side sees it.
fn shared_memory(
    join: &JoinResponse,
    token: u64,
    config: &WorkerConfig,
    lcores: &[SocketAddr],
) -> Result<Option<(io::RegionWatch, CurrentRegions)>, WorkerError> {
    let mut mode = shm::effective_mode(config.shm, std::env::var(SHM_ENV).ok().as_deref())?;
    if join.spec.consistency != Consistency::Sync {
        // The appliance makes regions for BSP jobs only (PROTOCOL.md §5.8).
        let why = format!(
            "shared memory is for BSP jobs only; job {} is {} (PROTOCOL.md §5.8): its chunks and results go by datagrams",
            join.job, join.spec.consistency
        );
        if mode == shm::ShmMode::On {
            return Err(WorkerError::SharedMemory { message: why });
        }
        log::debug!("phub-worker: datagrams, not shared memory: {why}");
        return Ok(None);
    }
    if join.appliances.len() > 1 {
        // Regions are per appliance (named by its base port); a job over
        // several goes by datagrams.
        let why = format!(
            "job {} is sharded over {} appliances; shared memory serves a job on one appliance",
            join.job,
            join.appliances.len()
        );
        if mode == shm::ShmMode::On {
            return Err(WorkerError::SharedMemory { message: why });
        }
        log::debug!("phub-worker: datagrams, not shared memory: {why}");
        mode = shm::ShmMode::Off;
    }
    let spec = shm::RegionSpec::new(
        join.dataplane.base_port,
        join.job,
        token,
        join.rank,
        &join.layout,
        join.spec.dtype,
    );
    let regions = shm::decide(mode, join.job, join.rank, lcores, || spec.open())?;
    Ok(regions.map(|r| io::RegionWatch::new(spec, r, join.job, join.rank)))
}

/// A worker's UDP socket, bound and set up.
struct Bound {
    socket: net::BatchSocket,
    /// A handle on the socket, to wake the I/O thread with.
    waker: UdpSocket,
    /// The socket's address, which wake-ups are sent to.
    local: SocketAddr,
    info: net::SocketInfo,
}

impl Bound {
    /// A socket on a port the kernel picks, on loopback when the
    /// `dataplane` is there, on every address otherwise, set up as
    /// `config` asks (GSO, GRO, buffer sizes).
    fn new(dataplane: IpAddr, config: &WorkerConfig) -> Result<Bound, WorkerError> {
        let bind: SocketAddr = match dataplane {
            IpAddr::V4(a) if a.is_loopback() => (Ipv4Addr::LOCALHOST, 0).into(),
            IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            IpAddr::V6(a) if a.is_loopback() => (Ipv6Addr::LOCALHOST, 0).into(),
            IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket = UdpSocket::bind(bind).map_err(io_err(&format!("binding a UDP socket on {bind}")))?;
        let waker = socket.try_clone().map_err(io_err("cloning the UDP socket"))?;
        let options = net::SocketOptions {
            gso: config.gso,
            gro: config.gro,
            buffer_bytes: config.socket_buffer,
        };
        let socket = net::BatchSocket::new(socket, options).map_err(io_err("setting the UDP socket up"))?;
        let mut local = socket
            .socket()
            .local_addr()
            .map_err(io_err("reading the UDP socket's address"))?;
        if local.ip().is_unspecified() {
            // Wake-ups go to ourselves through loopback.
            local.set_ip(match local.ip() {
                IpAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
                IpAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
            });
        }
        let info = socket.info();
        Ok(Bound {
            socket,
            waker,
            local,
            info,
        })
    }
}

/// Wraps a system call's error with what was being done.
fn io_err(context: &str) -> impl FnOnce(std::io::Error) -> WorkerError {
    let context = context.to_string();
    move |source| WorkerError::Io { context, source }
}

/// The window: [`WorkerConfig::window`], or, when that is 0, [`auto_window`]
/// from the job's shape, the socket's receive buffer `rcvbuf` and the
/// appliances' stated shares, with what it was made from (to remake it
/// as the shares change).
fn window_for(join: &JoinResponse, config: &WorkerConfig, rcvbuf: usize) -> (usize, Option<AutoWindow>) {
    if config.window != 0 {
        return (config.window, None);
    }
    let auto = AutoWindow {
        // All W, also for a hierarchical job, whose rack appliance hears
        // from its rack's ranks alone: their larger windows (63 chunks
        // against 31 for R = 2, W = 4) made rounds over a 1 Gbit/s spine
        // 12% slower, the deeper windows' partial sums queueing at the
        // spine and timing out (BENCHMARKS.md "Hierarchical windows").
        workers: join.spec.workers,
        lcores: join.layout.lcore_count().max(1),
        chunks: usize::try_from(join.layout.chunk_count()).unwrap_or(usize::MAX),
        datagram: HEADER_LEN + join.spec.chunk_bytes as usize,
        own_rcvbuf: rcvbuf,
        joined: lcore_rcvbuf(join),
    };
    (auto.window(auto.joined), Some(auto))
}

/// The smallest receive buffer of the job's appliances' lcores, as they
/// state it ([`ASSUMED_LCORE_RCVBUF`] for those that do not).
fn lcore_rcvbuf(join: &JoinResponse) -> usize {
    join.appliances
        .iter()
        .map(|a| {
            a.rx_buffer_bytes
                .map_or(ASSUMED_LCORE_RCVBUF, |b| usize::try_from(b).unwrap_or(usize::MAX))
        })
        .min()
        .unwrap_or(ASSUMED_LCORE_RCVBUF)
}

/// The fault injector [`WorkerConfig::inject`] (or [`INJECT_ENV`]) asks
/// for, if any, counting into `stats`.
fn fault_injector(
    join: &JoinResponse,
    config: &WorkerConfig,
    stats: &Arc<stats::Counters>,
) -> Result<Option<inject::Injector>, WorkerError> {
    let Some(spec) = config
        .inject
        .map_or_else(inject_from_env, |spec| Ok(Some(spec)))?
    else {
        return Ok(None);
    };
    log::warn!(
        "phub-worker: job {} rank {}: injecting faults on every datagram, both directions: {spec}",
        join.job,
        join.rank
    );
    Ok(Some(inject::Injector::new(
        spec,
        join.job,
        join.rank,
        Arc::clone(stats),
    )))
}

/// The fault spec in [`INJECT_ENV`], if it is set and not empty.
fn inject_from_env() -> Result<Option<FaultSpec>, WorkerError> {
    inject_from(std::env::var(INJECT_ENV).ok().as_deref())
}

/// The fault spec `value` of [`INJECT_ENV`] describes.
fn inject_from(value: Option<&str>) -> Result<Option<FaultSpec>, WorkerError> {
    match value {
        Some(v) if !v.trim().is_empty() => v.parse().map(Some).map_err(|e: String| WorkerError::Config {
            message: format!("{INJECT_ENV}={v:?}: {e}"),
        }),
        _ => Ok(None),
    }
}

/// Largest clock a rank of an async or bounded-delay job may push
/// (PROTOCOL.md §5.8: the appliance keeps a flag in the clock's top bit).
pub const MAX_CLOCK: u32 = phub_proto::checkpoint::CLOCK_HELD - 1;

/// The round (BSP) or clock (the other modes) a key's next `push_pull`
/// carries, after `held`, the last one whose result this worker holds.
fn next_round(consistency: Consistency, held: Option<u32>) -> Result<u32, String> {
    match (held, consistency) {
        (None, _) => Err("push_pull before the key was initialised: call init (or pull) first".to_string()),
        (Some(r), Consistency::Sync) if r >= u32::MAX - 1 => {
            Err(format!("round {r} is the last a job can complete"))
        }
        (Some(c), Consistency::Async | Consistency::Bounded { .. }) if c >= MAX_CLOCK => Err(format!(
            "clock {c} is the last a rank of a {} job can push (clocks end at 2^31 - 1, PROTOCOL.md §5.8)",
            consistency.mode()
        )),
        (Some(r), _) => Ok(r + 1),
    }
}

/// Chunk `c` of a key as the wire numbers it.
fn chunk_index(c: usize) -> u32 {
    // Cast: a layout numbers a key's chunks with u32 (the header's chunk
    // field), so every index it yields fits.
    #[allow(clippy::cast_possible_truncation)]
    let c = c as u32;
    c
}

/// Checks a join response (its layout places its spec's chunks) and
/// resolves each lcore's address.
fn check_join(join: &JoinResponse) -> Result<(Vec<SocketAddr>, Placement), WorkerError> {
    fn bad<T>(message: String) -> Result<T, WorkerError> {
        Err(WorkerError::BadJoin { message })
    }
    let (spec, layout) = (&join.spec, &join.layout);
    if u32::from(join.rank) >= spec.workers {
        return bad(format!(
            "rank {} is not below the worker count {}",
            join.rank, spec.workers
        ));
    }
    let ce = layout.chunk_elems;
    // Cast: MAX_PAYLOAD is a jumbo frame's payload, far below 2^32.
    #[allow(clippy::cast_possible_truncation)]
    let max = (MAX_PAYLOAD / spec.dtype.size()) as u32;
    if ce == 0 || ce > max {
        return bad(format!(
            "layout.chunk_elems = {ce}; accepted: 1..={max} for {}",
            spec.dtype
        ));
    }
    if let Some((k, ks)) = spec
        .keys
        .iter()
        .enumerate()
        .find(|(_, ks)| ks.elements == 0 || ks.elements > usize::MAX as u64)
    {
        return bad(format!("key {k} has {} elements", ks.elements));
    }
    let placement = match Placement::new(spec, layout.clone()) {
        Ok(p) => p,
        Err(e) => return bad(format!("the layout does not place the spec's chunks: {e}")),
    };
    // A control that predates sharding names one appliance, `dataplane`.
    let one = [ApplianceAddr {
        name: "default".into(),
        host: join.dataplane.host.clone(),
        base_port: join.dataplane.base_port,
        lcores: u32::try_from(layout.lcore_count()).unwrap_or(u32::MAX),
        rx_buffer_bytes: None,
    }];
    let appliances = if join.appliances.is_empty() {
        &one[..]
    } else {
        &join.appliances[..]
    };
    let named: u64 = appliances.iter().map(|a| u64::from(a.lcores)).sum();
    if named != layout.lcore_count() as u64 {
        return bad(format!(
            "the appliances name {named} lcores; the layout has {}",
            layout.lcore_count()
        ));
    }
    let mut lcores = Vec::with_capacity(layout.lcore_count());
    for a in appliances {
        let ip = resolve(&a.name, &a.host, a.base_port)?;
        for i in 0..a.lcores {
            match u16::try_from(i).ok().and_then(|i| a.base_port.checked_add(i)) {
                Some(port) if port != 0 => lcores.push(SocketAddr::new(ip, port)),
                _ => {
                    return bad(format!(
                        "appliance {:?}: base port {} + lcore {i} is not a valid UDP port",
                        a.name, a.base_port
                    ))
                }
            }
        }
    }
    Ok((lcores, placement))
}

/// The address of appliance `name`'s data `host` (an address, or a name
/// resolved, IPv4 first).
fn resolve(name: &str, host: &str, port: u16) -> Result<IpAddr, WorkerError> {
    let bad = |message: String| WorkerError::BadJoin { message };
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse() {
        return Ok(ip);
    }
    let found = (bare, port)
        .to_socket_addrs()
        .map_err(|e| {
            bad(format!(
                "appliance {name:?}: data host {host:?} does not resolve: {e}"
            ))
        })?
        .collect::<Vec<_>>();
    found
        .iter()
        .find(|a| a.is_ipv4())
        .or(found.first())
        .map(SocketAddr::ip)
        .ok_or_else(|| {
            bad(format!(
                "appliance {name:?}: data host {host:?} resolves to no address"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_clock_ends_at_the_mode_s_limit_and_says_so() {
        let bounded = Consistency::Bounded { delay: 3 };
        assert_eq!(next_round(Consistency::Sync, Some(0)), Ok(1));
        assert_eq!(next_round(Consistency::Async, Some(41)), Ok(42));
        assert_eq!(next_round(bounded, Some(MAX_CLOCK - 1)), Ok(MAX_CLOCK));
        // BSP rounds go on past 2^31.
        assert_eq!(next_round(Consistency::Sync, Some(MAX_CLOCK)), Ok(MAX_CLOCK + 1));
        for c in [Consistency::Async, bounded] {
            let e = next_round(c, Some(MAX_CLOCK)).unwrap_err();
            assert!(
                e.contains(c.mode()) && e.contains("2^31 - 1") && e.contains("2147483647"),
                "{e}"
            );
        }
        let e = next_round(Consistency::Sync, Some(u32::MAX - 1)).unwrap_err();
        assert!(e.contains("last a job can complete"), "{e}");
        assert!(next_round(bounded, None).unwrap_err().contains("init"));
    }

    #[test]
    fn auto_window_takes_the_smallest_bound() {
        let d = HEADER_LEN + 8192;
        // Cache bound: 1 MiB per lcore over W.
        let big = ASSUMED_LCORE_RCVBUF;
        assert_eq!(auto_window(1, 1, 100_000, d, 64 << 20, big), (1 << 20) / d);
        assert_eq!(auto_window(2, 1, 100_000, d, 64 << 20, big), (1 << 20) / (2 * d));
        assert_eq!(auto_window(2, 4, 100_000, d, 64 << 20, big), (4 << 20) / (2 * d));
        // Never beyond the job's chunks, never below 16.
        assert_eq!(auto_window(1, 1, 40, d, 64 << 20, big), 40);
        assert_eq!(auto_window(64, 1, 100_000, d, 64 << 20, big), 16);
        // A small own receive buffer bounds it (an unprivileged process).
        assert_eq!(
            auto_window(1, 8, 100_000, d, 416 << 10, big),
            (416 << 10) / (2 * d)
        );
        // An appliance's small buffer bounds it below 16: W windows of
        // datagrams charged twice their size fit in it.
        let small = 512 << 10;
        let w = auto_window(2, 1, 100_000, d, 64 << 20, small);
        assert_eq!(w, small / (2 * 2 * d));
        assert!(2 * w * 2 * d <= small && w < MIN_AUTO_WINDOW);
        assert_eq!(
            auto_window(2, 4, 100_000, d, 64 << 20, small),
            4 * small / (2 * 2 * d)
        );
        // A buffer too small for one datagram each still lets one out.
        assert_eq!(auto_window(64, 1, 100_000, d, 64 << 20, 4096), 1);
    }

    #[test]
    fn the_window_follows_the_smallest_buffer_an_appliance_states() {
        let spec = JobSpec {
            checkpoint_interval_s: None,
            placement: None,
            name: "w".into(),
            workers: 2,
            dtype: phub_proto::Dtype::F32,
            chunk_bytes: 8192,
            optimizer: phub_proto::spec::Optimizer::Sum,
            consistency: Consistency::Sync,
            keys: vec![phub_proto::spec::KeySpec {
                name: "k".into(),
                elements: 1 << 22,
            }],
        };
        let layout = phub_proto::layout::layout(&spec, &mut [0], |_| 1);
        let addr = |rx| ApplianceAddr {
            name: "a".into(),
            host: "127.0.0.1".into(),
            base_port: 9000,
            lcores: 1,
            rx_buffer_bytes: rx,
        };
        let join = |appliances| JoinResponse {
            job: 1,
            rank: 0,
            spec: spec.clone(),
            layout: layout.clone(),
            dataplane: phub_proto::api::DataAddr {
                host: "127.0.0.1".into(),
                base_port: 9000,
            },
            appliances,
        };
        let cfg = WorkerConfig::default();
        let d = HEADER_LEN + 8192;
        let unsaid = window_for(&join(vec![addr(None)]), &cfg, 64 << 20).0;
        assert_eq!(
            unsaid,
            window_for(&join(vec![]), &cfg, 64 << 20).0,
            "no figure: the assumed buffer"
        );
        assert_eq!(unsaid, (1 << 20) / (2 * d));
        let said = window_for(
            &join(vec![addr(Some(1 << 20)), addr(Some(256 << 10))]),
            &cfg,
            64 << 20,
        )
        .0;
        assert_eq!(
            said,
            (256 << 10) / (2 * 2 * d),
            "the smaller of the two appliances' buffers"
        );
        let fixed = WorkerConfig {
            window: 40,
            ..WorkerConfig::default()
        };
        assert_eq!(
            window_for(&join(vec![addr(Some(4096))]), &fixed, 64 << 20),
            (40, None),
            "a set window stands"
        );
        // A hierarchical job's rank divides its rack appliance's stated
        // share by all W, not by its rack's ranks (measured: see
        // `window_for`), whichever rack it is in (W = 8, racks of 2 and 6).
        let mut hier = join(vec![addr(Some(1 << 20))]);
        hier.spec.workers = 8;
        hier.spec.placement = Some(phub_proto::spec::PlacementSpec {
            appliances: phub_proto::spec::Appliances::Count(2),
            hierarchical: true,
            ranks_per_rack: Some(vec![2, 6]),
        });
        for rank in [1, 5] {
            hier.rank = rank;
            assert_eq!(window_for(&hier, &cfg, 64 << 20).0, (1 << 20) / (8 * 2 * d));
        }
    }

    #[test]
    fn the_injection_variable_is_parsed_and_named_when_wrong() {
        assert_eq!(inject_from(None).unwrap(), None);
        assert_eq!(inject_from(Some(" ")).unwrap(), None);
        let spec = inject_from(Some("loss=0.05,dup=0.01,seed=3")).unwrap().unwrap();
        assert_eq!(
            (spec.loss, spec.dup, spec.reorder, spec.seed),
            (0.05, 0.01, 0.0, 3)
        );
        let e = inject_from(Some("loss=2")).unwrap_err().to_string();
        assert!(
            e.contains("PHUB_WORKER_INJECT") && e.contains("loss=2") && e.contains("[0, 1)"),
            "{e}"
        );
    }
}
