//! A traffic generator in its own process, attached as memif client to a
//! memif server: `phub-dataplane --backend dpdk` (the real binary, one data
//! lcore) or `dpdk-testpmd` (the packet I/O ceiling over the same device).
//! With `--ring NAME` it attaches instead, as a DPDK secondary process, to
//! the rings of `phub-dataplane --ring-port NAME` (pointers pass, nothing is
//! copied; both need hugepages and the same `--file-prefix`).
//!
//! It sends W = 8 workers' PUSHes for S slots, round after round, as fast
//! as the memif ring takes them, each push an indirect mbuf over a
//! per-(slot, rank) template frame (no gradient copy in the generator; the
//! memif PMD itself copies frames into its shared-memory buffers), and
//! drains and frees whatever comes back (the dataplane's results, or
//! testpmd's forwarded frames). With the dataplane it first installs the
//! job through the management API and sends round 0 (INIT).
//!
//! Figures over a timed window after a warm-up:
//! - dataplane: pushes aggregated, rx packets and busy/idle polls from the
//!   dataplane's own counters (`GET /v1/stats` at both ends of the window),
//!   and the generator's count of results received (each completed round
//!   of a slot sends one result to each of the W workers);
//! - testpmd: frames sent and frames that came back, counted here.
//!
//! And the engine's kernel-only figure (the same pushes handed to a Shard
//! from memory, no packet I/O), in this process, on --kernel-cpu, before
//! and after each timed window (`--pairs` windows; each window's ratio is
//! to the mean of the kernel-only runs beside it, and the median ratio is
//! reported), over the generator's own template frames (the memory the
//! dataplane reads the pushes from) with slot memory from DPDK's heap, as
//! the dataplane's. The last line starts with `RESULT` and is what
//! `tools/bench-dpdk-memif.sh` reads.
//!
//! `dpdk_memif_gen --peer dataplane|testpmd [--chunk 8192] [--seconds 3] [--slots 512] [--cpu 1] ...`

mod common;

use std::cell::Cell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use common::{Generator, JOB, TOKEN, W};
use phub_dataplane::backend::dpdk::DpdkSlotMemory;
use phub_engine::kernels::Kernels;
use phub_engine::Shard;
use phub_ffi::{Mbuf, Mempool, Port, PortBuilder, Ring, RxQueue, TxQueue};
use phub_http::Client;
use phub_proto::api::{DataplaneStats, InstallJob, LcoreStats};
use phub_proto::layout;
use phub_proto::routes::mgmt;
use phub_proto::spec::{Consistency, JobSpec, KeySpec, Optimizer};
use phub_proto::Dtype;

/// What serves the memif socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Peer {
    /// phub-dataplane --backend dpdk (job installed through --mgmt).
    Dataplane,
    /// dpdk-testpmd forwarding every frame back (io mode).
    Testpmd,
}

/// Feeds pre-built PUSH frames into a memif server.
#[derive(Debug, Parser)]
#[command(name = "dpdk_memif_gen")]
struct Args {
    /// What serves the memif socket.
    #[arg(long, value_enum)]
    peer: Peer,
    /// Gradient bytes per chunk (one frame).
    #[arg(long, default_value_t = 8192)]
    chunk: usize,
    /// Timed windows, each followed by a kernel-only run (one also runs
    /// before the first): each window's ratio is to the kernel-only runs
    /// beside it, and the median is reported.
    #[arg(long, default_value_t = 1)]
    pairs: usize,
    /// Length of each timed window, seconds.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Warm-up before the window, seconds.
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// Length of the kernel-only run, seconds (0: skip it).
    #[arg(long, default_value_t = 3.0)]
    kernel_seconds: f64,
    /// Slots (chunks) of the job: W pushes per slot per round.
    #[arg(long, default_value_t = 512)]
    slots: usize,
    /// The memif server's socket.
    #[arg(long, default_value = "/run/phub-bench-memif.sock")]
    socket: String,
    /// memif buffer size in bytes (0: the next power of two that holds a whole frame).
    #[arg(long, default_value_t = 0)]
    bsize: u32,
    /// log2 of the memif ring size.
    #[arg(long, default_value_t = 10)]
    rsize: u32,
    /// The dataplane's management API.
    #[arg(long, default_value = "127.0.0.1:7800")]
    mgmt: SocketAddr,
    /// The CPU this process runs on (EAL main lcore).
    #[arg(long, default_value_t = 1)]
    cpu: usize,
    /// The CPU the kernel-only runs on (default: --cpu). The data lcore's,
    /// with the dataplane started with --idle-backoff, so that both sides
    /// of the ratio run on the same CPU.
    #[arg(long)]
    kernel_cpu: Option<usize>,
    /// Once frames flow, make this thread SCHED_FIFO at this priority (0: stay as started).
    /// Started whole under `chrt -f`, EAL start-up can stall for minutes on 2 CPUs.
    #[arg(long, default_value_t = 0)]
    rt_priority: i32,
    /// EAL --file-prefix of this process (with --ring: the dataplane's).
    #[arg(long, default_value = "phub-memif-gen")]
    file_prefix: String,
    /// Attach to `phub-dataplane --ring-port NAME` (as a DPDK secondary
    /// process with the dataplane's --file-prefix) instead of memif.
    #[arg(long, value_name = "NAME")]
    ring: Option<String>,
    /// EAL lcore id of this process with --ring: one the dataplane does not use
    /// (processes of one runtime share the mempools' per-lcore caches).
    #[arg(long, default_value_t = 8)]
    ring_lcore: u32,
    /// With --ring: hand the results back on the port's completion ring, so
    /// the dataplane's lcore frees them (as a NIC's TX completions would),
    /// instead of freeing them here.
    #[arg(long)]
    ring_completions: bool,
    /// Pushes carry UDP checksums (kept right as rounds are rewritten),
    /// for a dataplane that verifies them in software (a ring port or
    /// memif: devices that do not): what that costs. Without it pushes
    /// carry none (0), as with a NIC that checks them.
    #[arg(long)]
    udp_checksums: bool,
    /// With --ring: send each template mbuf itself (references reserved in
    /// advance) instead of an indirect mbuf per push, pacing by results: no
    /// mbuf cache line written per push, as with a NIC.
    #[arg(long)]
    ring_direct: bool,
}

/// memif buffer size for frames of a `chunk`-byte gradient: the next power
/// of two holding the whole frame (Ethernet + IPv4 + UDP + phub header), so
/// every frame is one memif descriptor and one mbuf on the far side.
fn memif_bsize(chunk: usize) -> u32 {
    ((phub_dataplane::backend::dpdk::FRAME_HEADER + chunk) as u32)
        .next_power_of_two()
        .max(2048)
}

/// Moves the calling thread to CPU `cpu`.
fn pin(cpu: usize) -> Result<()> {
    if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
        bail!("CPU {cpu}: out of range");
    }
    // SAFETY: cpu_set_t is plain data and all zeroes is the empty set;
    // CPU_SET writes inside it (cpu checked against its size above); the
    // system call reads the set, which outlives it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        bail!("moving to CPU {cpu}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the calling thread SCHED_FIFO at `prio`.
fn realtime(prio: i32) -> Result<()> {
    let p = libc::sched_param { sched_priority: prio };
    // SAFETY: a plain system call on the calling thread (id 0) with a valid
    // parameter block that outlives it.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) };
    if rc != 0 {
        bail!(
            "sched_setscheduler(SCHED_FIFO, {prio}): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// The management API's client, with the management token (changes need
/// it).
fn mgmt_client(addr: SocketAddr) -> Result<Client> {
    // The token from the dataplane's default file.
    let token = phub_http::secret::read(&phub_http::secret::mgmt_token_path(addr.port()))
        .context("the dataplane's management token")?;
    let builder = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    Ok(Client::new(&format!("http://{addr}"), None, builder)?.with_token(Some(token)))
}

fn stats(mgmt: SocketAddr) -> Result<LcoreStats> {
    let s: DataplaneStats = Client::plain(&format!("http://{mgmt}"))?.send(&mgmt::stats())?;
    if s.lcores.len() != 1 {
        bail!(
            "the dataplane has {} lcores; this benchmark drives one (--lcores 1)",
            s.lcores.len()
        );
    }
    Ok(s.lcores[0].clone())
}

/// The job through the management API: one f32 key of `slots` chunks,
/// `sum`, W workers; on one lcore chunk s is slot s (checked).
fn install(mgmt: SocketAddr, chunk: usize, slots: usize) -> Result<()> {
    let spec = JobSpec {
        name: "memif-bench".into(),
        workers: u32::from(W),
        dtype: Dtype::F32,
        chunk_bytes: chunk as u32,
        optimizer: Optimizer::Sum,
        consistency: Consistency::Sync,
        keys: vec![KeySpec::dense("g", (slots * chunk / 4) as u64)],
        checkpoint_interval_s: None,
        placement: None,
    };
    spec.validate().context("the benchmark's job spec")?;
    let layout = layout::layout(&spec, &mut [0], u64::from);
    let want = common::job((chunk / 4) as u32, slots).slots;
    let placed = layout::Placement::new(&spec, layout.clone()).context("the benchmark's layout")?;
    if placed.slots(0).collect::<Vec<_>>() != want {
        bail!("the layout does not put chunk s in slot s; the frames would address the wrong slots");
    }
    let req = InstallJob {
        id: JOB,
        token: TOKEN,
        spec,
        layout,
        hierarchy: None,
        replication: None,
        entries: None,
    };
    mgmt_client(mgmt)?
        .send(&mgmt::install(&req))
        .with_context(|| format!("installing job {JOB}"))
}

/// Where frames go and come back from.
enum Link {
    /// A memif port's queues.
    Port(RxQueue, TxQueue),
    /// The dataplane's ring port: frames to it, frames from it, and (with
    /// --ring-completions) the ring that hands them back to be freed there.
    Rings(Ring, Ring, Option<Ring>, Vec<Mbuf>),
}

impl Link {
    fn rx_burst(&mut self, buf: &mut [Option<Mbuf>]) -> usize {
        match self {
            Link::Port(rx, _) => rx.rx_burst(buf),
            Link::Rings(_, from, done, back) => {
                let n = from.dequeue_burst(buf);
                if let Some(done) = done {
                    back.extend(buf[..n].iter_mut().filter_map(Option::take));
                    done.enqueue_burst(back);
                    back.clear();
                }
                n
            }
        }
    }

    fn tx_burst(&mut self, batch: &mut Vec<Mbuf>) -> usize {
        match self {
            Link::Port(_, tx) => tx.tx_burst(batch),
            Link::Rings(to, ..) => to.enqueue_burst(batch),
        }
    }
}

/// The link and what went through it.
struct Io {
    link: Link,
    buf: Vec<Option<Mbuf>>,
    sent: u64,
    /// Frames that came back (shared: results pace --ring-direct).
    received: Rc<Cell<u64>>,
    /// Bursts the ring took none of.
    full: u64,
}

impl Io {
    /// Frees what came back.
    fn drain(&mut self) {
        loop {
            let n = self.link.rx_burst(&mut self.buf);
            self.received.set(self.received.get() + n as u64);
            if n < self.buf.len() {
                break;
            }
        }
    }

    /// Sends the whole batch, draining what comes back meanwhile. Panics
    /// if the peer takes nothing for 5 s (it is gone).
    fn send(&mut self, batch: &mut Vec<Mbuf>) {
        let mut stalled: Option<Instant> = None;
        loop {
            let n = self.link.tx_burst(batch);
            self.sent += n as u64;
            self.drain();
            if batch.is_empty() {
                return;
            }
            if n == 0 {
                self.full += 1;
                let t = *stalled.get_or_insert_with(Instant::now);
                assert!(
                    t.elapsed() < Duration::from_secs(5),
                    "the peer took no frame for 5 s (gone, or not connected)"
                );
                // Under `chrt -f` this thread would otherwise starve the
                // threads that share its CPU at the same priority: EAL's
                // interrupt thread, which runs the memif handshake (here
                // and in the server), and the dataplane's management
                // thread. Before the link is up, wait for it.
                if self.sent == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                } else {
                    std::thread::yield_now();
                }
            } else {
                stalled = None;
            }
        }
    }
}

/// Counts at one end of the timed window.
struct Mark {
    at: Instant,
    sent: u64,
    received: u64,
    dp: Option<LcoreStats>,
}

fn mark(io: &Io, peer: Peer, mgmt: SocketAddr) -> Result<Mark> {
    let (sent, received) = (io.sent, io.received.get());
    let before = Instant::now();
    let dp = match peer {
        Peer::Dataplane => Some(stats(mgmt)?),
        Peer::Testpmd => None,
    };
    // The counters were read somewhere inside the request.
    let at = before + before.elapsed() / 2;
    Ok(Mark {
        at,
        sent,
        received,
        dp,
    })
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let a = Args::parse();
    if a.chunk % 64 != 0 || a.chunk < 64 || a.chunk > 8192 {
        bail!("--chunk {}: expected a multiple of 64 from 64 to 8192", a.chunk);
    }
    let elems = a.chunk / 4;
    let bsize = if a.bsize == 0 {
        memif_bsize(a.chunk)
    } else {
        a.bsize
    };
    let lcores = format!("0@{}", a.cpu);
    let ring_lcores = format!("{}@{}", a.ring_lcore, a.cpu);
    let vdev = format!(
        "--vdev=net_memif0,role=client,socket={},socket-abstract=no,bsize={bsize},rsize={}",
        a.socket, a.rsize
    );
    let eal_args: Vec<String> = if a.ring.is_some() {
        if a.peer != Peer::Dataplane {
            bail!("--ring: the ring port is phub-dataplane's (--peer dataplane)");
        }
        [
            "--proc-type=secondary",
            "--no-pci",
            "--no-telemetry",
            "--file-prefix",
            &a.file_prefix,
            "--lcores",
            &ring_lcores,
            "--log-level",
            "warning",
        ]
        .map(String::from)
        .to_vec()
    } else {
        common::eal_no_huge(&a.file_prefix, &lcores, &[&vdev])
    };
    let eal = phub_ffi::eal::init(&eal_args).context("starting the generator's EAL")?;
    let frame_room = (phub_dataplane::backend::dpdk::FRAME_HEADER + a.chunk) as u16 + 128;
    let templates_n = a.slots as u32 * u32::from(W);
    let frames = Mempool::pktmbuf(
        eal,
        "gfr",
        templates_n + 1024,
        0,
        frame_room.max(2048 + 128),
        None,
    )
    .context("the template pool")?;
    let indirect = Mempool::pktmbuf(eal, "gind", 8192, 256, 0, None).context("the indirect pool")?;
    let (port, link): (Option<Port>, Link) = match &a.ring {
        Some(name) => {
            let to = Ring::lookup(eal, &format!("{name}-rx0"))?;
            let from = Ring::lookup(eal, &format!("{name}-tx0"))?;
            let done = if a.ring_completions {
                Some(Ring::lookup(eal, &format!("{name}-done0"))?)
            } else {
                None
            };
            (None, Link::Rings(to, from, done, Vec::with_capacity(64)))
        }
        None => {
            let port_id = eal
                .port_by_name("net_memif0")
                .context("no net_memif0 port (the --vdev did not make one)")?;
            let rx_pool = Mempool::pktmbuf(eal, "grx", 4096, 256, 9216 + 128, None)
                .context("the pool for frames coming back")?;
            let (port, mut rxq, mut txq) = PortBuilder::new(eal, port_id)
                .rx_pool(rx_pool)
                .descriptors(1024, 1024)
                .mtu(9000)
                .build()
                .context("starting the memif client port (is the server up on the socket?)")?;
            (Some(port), Link::Port(rxq.remove(0), txq.remove(0)))
        }
    };
    let device = match &a.ring {
        Some(name) => format!(
            "ring port {name} (pointers, no copies; pushes are {}; results freed {})",
            if a.ring_direct {
                "the template mbufs"
            } else {
                "indirect mbufs"
            },
            if a.ring_completions {
                "by the dataplane (completion ring)"
            } else {
                "here"
            }
        ),
        None => format!("memif bsize {bsize} rsize {}", a.rsize),
    };
    let mut io = Io {
        link,
        buf: (0..64).map(|_| None).collect(),
        sent: 0,
        received: Rc::new(Cell::new(0)),
        full: 0,
    };
    let vals = common::values(elems);

    if a.peer == Peer::Dataplane {
        install(a.mgmt, a.chunk, a.slots)?;
        // Round 0 (INIT) by copy; the first burst also waits for the link.
        let mut batch = Vec::with_capacity(common::BURST);
        for f in common::init_frames(a.slots, &vals) {
            let mut m = frames.alloc().context("an mbuf for an INIT frame")?;
            assert!(m.extend_from_slice(&f), "an INIT frame fits its mbuf");
            batch.push(m);
            if batch.len() == common::BURST {
                io.send(&mut batch);
            }
        }
        io.send(&mut batch);
        let t = Instant::now();
        loop {
            io.drain();
            let s = stats(a.mgmt)?;
            if s.rounds_completed >= a.slots as u64 {
                break;
            }
            if t.elapsed() > Duration::from_secs(10) {
                bail!(
                    "round 0 did not complete on every slot within 10 s: {} of {} slots; dataplane counters {s:?}",
                    s.rounds_completed,
                    a.slots
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // What an empty poll of the lcore costs, with nothing arriving: turns
    // the window's count of empty polls into time.
    let idle_ns = if a.peer == Peer::Dataplane {
        let (t0, s0) = (Instant::now(), stats(a.mgmt)?);
        std::thread::sleep(Duration::from_millis(300));
        let (t1, s1) = (Instant::now(), stats(a.mgmt)?);
        let polls = (s1.idle_loops - s0.idle_loops).max(1);
        t1.duration_since(t0).as_nanos() as f64 / polls as f64
    } else {
        f64::NAN
    };

    let mut generator = Generator::new(&frames, indirect, a.slots, &vals, a.udp_checksums);
    if a.ring_direct && a.ring.is_none() {
        bail!("--ring-direct needs --ring");
    }
    // Slot-rounds completed since the generator's first round (W results
    // each, in order), past round 0's (whose last results may still be on
    // their way).
    let (got, base) = (Rc::clone(&io.received), a.slots as u64 * u64::from(W));
    let done = move || got.get().saturating_sub(base) / u64::from(W);
    let direct = a.ring_direct;
    // Kernel-only over the same template frames and slot memory from the
    // same DPDK heap as the dataplane's, just before and just after the I/O
    // phase, on --kernel-cpu (the data lcore's, whose idle lcore then
    // sleeps, with --idle-backoff): what the engine alone does on this
    // memory and this CPU now.
    let slot_mem = Arc::new(DpdkSlotMemory::new(eal, None));
    let kernel_cpu = a.kernel_cpu.unwrap_or(a.cpu);
    let kernel_only = |g: &mut Generator| -> Result<f64> {
        if a.kernel_seconds <= 0.0 {
            return Ok(0.0);
        }
        pin(kernel_cpu)?;
        let k = Shard::with_slot_memory(0, Kernels::best(), slot_mem.clone());
        let (p, secs) = g.kernel_only(a.chunk, a.kernel_seconds, k);
        pin(a.cpu)?;
        Ok(p as f64 / secs)
    };
    // Kernel-only, then windows of I/O each followed by kernel-only again:
    // every window's ratio is to the mean of the kernel-only runs on
    // either side of it, so slow drifts of the machine cancel.
    let mut k_pps = vec![kernel_only(&mut generator)?];
    let t = Instant::now();
    let mut rt = a.rt_priority == 0;
    let round = |g: &mut Generator, io: &mut Io| {
        if direct {
            g.round_direct(&mut |b| io.send(b), &done);
        } else {
            g.round(&mut |b| io.send(b));
        }
    };
    while t.elapsed().as_secs_f64() < a.warmup || !rt {
        round(&mut generator, &mut io);
        if !rt {
            // The first round has gone out: the link is up.
            realtime(a.rt_priority)?;
            rt = true;
        }
    }
    let mut windows = Vec::with_capacity(a.pairs);
    for _ in 0..a.pairs.max(1) {
        let m0 = mark(&io, a.peer, a.mgmt)?;
        while m0.at.elapsed().as_secs_f64() < a.seconds {
            round(&mut generator, &mut io);
        }
        let m1 = mark(&io, a.peer, a.mgmt)?;
        generator.flush(&mut |b| io.send(b));
        // Let what is in flight come back.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(100) {
            io.drain();
        }
        windows.push((m0, m1));
        k_pps.push(kernel_only(&mut generator)?);
    }
    let chunk = a.chunk as f64;
    let dt: f64 = windows
        .iter()
        .map(|(m0, m1)| m1.at.duration_since(m0.at).as_secs_f64())
        .sum();
    let sum = |f: &dyn Fn(&Mark, &Mark) -> u64| windows.iter().map(|(m0, m1)| f(m0, m1)).sum::<u64>();
    let sent_pps = sum(&|m0, m1| m1.sent - m0.sent) as f64 / dt;
    let received = sum(&|m0, m1| m1.received - m0.received);
    let back_pps = received as f64 / dt;
    let ps = port.as_ref().and_then(|p| p.stats().ok()).unwrap_or_default();
    let k_mean = k_pps.iter().sum::<f64>() / k_pps.len() as f64;
    let k_gbs = k_mean * chunk / 1e9;
    // Each window's rate over the kernel-only runs beside it, and their median.
    let ratios = |rate: &dyn Fn(&Mark, &Mark) -> f64| -> (f64, f64, f64) {
        let mut r: Vec<f64> = windows
            .iter()
            .enumerate()
            .map(|(i, (m0, m1))| {
                let k = (k_pps[i] + k_pps[i + 1]) / 2.0;
                if k > 0.0 {
                    rate(m0, m1) / k
                } else {
                    f64::NAN
                }
            })
            .collect();
        r.sort_by(f64::total_cmp);
        (r[r.len() / 2], r[0], r[r.len() - 1])
    };

    println!(
        "chunk {} B, W {W}, {} slots ({} pushes a round), {device}, kernels {}",
        a.chunk,
        a.slots,
        generator.per_round(),
        Kernels::best().kind().name()
    );
    println!(
        "generator: {:.3} Mpps sent, {:.3} Mpps came back, over {} window(s) of {:.2} s in all; tx bursts refused whole {}, template waits {}; memif client port (zeros over a ring): ipackets {} opackets {} ierrors {} oerrors {} rx_nombuf {}",
        sent_pps / 1e6,
        back_pps / 1e6,
        windows.len(),
        dt,
        io.full,
        generator.waits,
        ps.ipackets,
        ps.opackets,
        ps.ierrors,
        ps.oerrors,
        ps.rx_nombuf
    );
    println!(
        "kernel-only (engine alone over the template frames, DPDK-heap slot memory, this process, CPU {kernel_cpu}): {} GB/s; mean {:.3} Mpps, {k_gbs:.2} GB/s",
        k_pps
            .iter()
            .map(|k| format!("{:.2}", k * chunk / 1e9))
            .collect::<Vec<_>>()
            .join(", "),
        k_mean / 1e6,
    );
    let (m0, m1) = (&windows[0].0, &windows[windows.len() - 1].1);
    match (a.peer, &m0.dp, &m1.dp) {
        (Peer::Dataplane, Some(_), Some(last)) => {
            let dp = |f: fn(&LcoreStats) -> u64| {
                sum(&|m0, m1| match (&m0.dp, &m1.dp) {
                    (Some(d0), Some(d1)) => f(d1) - f(d0),
                    _ => 0,
                })
            };
            let pushes = dp(|d| d.pushes_aggregated);
            let pps = pushes as f64 / dt;
            let gbs = pps * chunk / 1e9;
            let rounds = received as f64 / f64::from(W) / a.slots as f64;
            let (busy, idle) = (dp(|d| d.busy_loops), dp(|d| d.idle_loops));
            // Share of the windows' time the lcore spent on non-empty polls.
            let busy_time = (1.0 - idle as f64 * idle_ns / 1e9 / dt).max(0.0);
            let drops: u64 = last.drops.values().sum();
            let (ratio, lo, hi) = ratios(&|m0, m1| match (&m0.dp, &m1.dp) {
                (Some(d0), Some(d1)) => {
                    (d1.pushes_aggregated - d0.pushes_aggregated) as f64
                        / m1.at.duration_since(m0.at).as_secs_f64()
                }
                _ => f64::NAN,
            });
            println!(
                "dataplane (its /v1/stats): {:.3} Mpps, {gbs:.2} GB/s gradient input ({pushes} pushes, rx {} packets, rounds completed {}), lcore polls busy {busy} idle {idle} (an empty poll costs {idle_ns:.0} ns with no traffic: about {:.0}% of the time on non-empty polls), drops since start {drops} {:?}",
                pps / 1e6,
                dp(|d| d.rx_packets),
                dp(|d| d.rounds_completed),
                100.0 * busy_time,
                last.drops
            );
            println!(
                "generator's count: {rounds:.1} full rounds of {} slots completed ({:.3} Mpps of results)",
                a.slots,
                back_pps / 1e6
            );
            println!(
                "ratio dataplane / kernel-only = {ratio:.2} (median of {} windows, each over the kernel-only runs beside it; {lo:.2} to {hi:.2})",
                windows.len()
            );
            println!(
                "RESULT peer=dataplane chunk={} mpps={:.3} gbs={gbs:.2} gen_mpps={:.3} kernel_gbs={k_gbs:.2} ratio={ratio:.2} ratio_min={lo:.2} ratio_max={hi:.2} busy={busy_time:.2} drops={drops}",
                a.chunk,
                pps / 1e6,
                back_pps / 1e6,
            );
            if let Err(e) = mgmt_client(a.mgmt)?.send(&mgmt::remove(JOB)) {
                log::warn!("removing job {JOB}: {e}");
            }
        }
        (Peer::Testpmd, _, _) => {
            let gbs = back_pps * chunk / 1e9;
            let (ratio, _, _) = ratios(&|m0, m1| {
                (m1.received - m0.received) as f64 / m1.at.duration_since(m0.at).as_secs_f64()
            });
            println!(
                "testpmd io-forwarding ceiling: {:.3} Mpps forwarded back, {gbs:.2} GB/s of chunk payload",
                back_pps / 1e6
            );
            println!(
                "RESULT peer=testpmd chunk={} mpps={:.3} gbs={gbs:.2} sent_mpps={:.3} kernel_gbs={k_gbs:.2} ratio={ratio:.2}",
                a.chunk,
                back_pps / 1e6,
                sent_pps / 1e6,
            );
        }
        _ => unreachable!("the dataplane marks carry its counters"),
    }
    drop(generator);
    drop(io);
    drop(port);
    drop(frames);
    Ok(())
}
