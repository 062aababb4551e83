//! phub-worker against a fake appliance: the dataplane's engine behind
//! kernel UDP sockets on 127.0.0.1, with seeded packet loss, and a fake
//! control answering the join route. With shared memory, the fake creates
//! the job's regions (PROTOCOL.md §3.4) and moves payloads between them and
//! the engine itself, so the worker's side is tested on its own.

use std::collections::HashSet;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use phub_engine::{InstallKind, JobInstall, Kernels, Shard};
use phub_net::shm::ShmRegion;
use phub_proto::api::{DataAddr, JoinRequest, JoinResponse};
use phub_proto::layout::{layout, Layout, Placement};
use phub_proto::routes::ControlRoute;
use phub_proto::shm::{region_len, region_path, slot_offset, Part};
use phub_proto::spec::{Consistency, JobSpec, Optimizer};
use phub_proto::wire::{self, flags, Header, MsgType, HEADER_LEN};
use phub_proto::Dtype;
use phub_worker::{ShmMode, Worker, WorkerConfig, WorkerError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const JOB: u16 = 7;
const TOKEN: u64 = 0x5eed_cafe_f00d_0001;

/// The appliance side: one thread per lcore, each a [`Shard`] behind a UDP
/// socket on `127.0.0.1:base + i`, dropping each received and each sent
/// packet with the given probabilities.
struct FakeAppliance {
    base_port: u16,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// With shared memory: the job's regions (per lcore), which the test
    /// may remove and create again as a restarted dataplane would.
    shm: Option<FakeShm>,
}

/// One lcore's regions: a staging region per rank, the result region.
struct LcoreShm {
    staging: Vec<ShmRegion>,
    results: ShmRegion,
}

/// The regions of the fake appliance's one job.
#[derive(Clone)]
struct FakeShm {
    regions: Arc<Mutex<Vec<Option<LcoreShm>>>>,
    /// Chunks read from staging regions so far.
    staged_reads: Arc<AtomicU64>,
    base_port: u16,
    workers: u16,
    slots: Vec<usize>,
    chunk_elems: u32,
    dtype: Dtype,
}

impl FakeShm {
    fn path(&self, lcore: usize, part: Part) -> std::path::PathBuf {
        region_path(self.base_port, JOB, TOKEN, lcore as u16, part)
    }

    /// Creates the regions of every lcore that holds slots (none may exist).
    fn create(&self) {
        let made = self
            .slots
            .iter()
            .enumerate()
            .map(|(l, &n)| {
                let len = region_len(n, self.chunk_elems, self.dtype);
                (n > 0).then(|| LcoreShm {
                    staging: (0..self.workers)
                        .map(|r| ShmRegion::create(&self.path(l, Part::Staging(r)), len).unwrap())
                        .collect(),
                    results: ShmRegion::create(&self.path(l, Part::Results), len).unwrap(),
                })
            })
            .collect();
        *self.regions.lock().unwrap() = made;
    }

    /// Removes every region (the files go).
    fn remove(&self) {
        self.regions.lock().unwrap().clear();
    }

    /// A PUSH/INIT with SHM as the engine takes it: the header without the
    /// flag, followed by the payload read from the sender's staging region.
    /// `None` for datagrams without the flag (and ones the engine refuses
    /// on its own).
    fn inline(&self, lcore: usize, d: &[u8]) -> Option<Vec<u8>> {
        let (repr, _) = wire::parse(d).ok()?;
        if !repr.shm() {
            return None;
        }
        let mut out = d[..HEADER_LEN].to_vec();
        Header::new_unchecked(&mut out[..]).set_flags(repr.flags & !flags::SHM);
        let regions = self.regions.lock().unwrap();
        let r = regions.get(lcore)?.as_ref()?;
        let staging = r.staging.get(usize::from(repr.rank))?;
        let mut payload = vec![0u8; repr.payload_len()];
        if !staging.read(slot_offset(repr.slot, self.chunk_elems, self.dtype), &mut payload) {
            return None;
        }
        self.staged_reads.fetch_add(1, Ordering::Relaxed);
        out.extend_from_slice(&payload);
        Some(out)
    }

    /// Writes a RESULT's payload into the result region at its slot.
    fn write_result(&self, lcore: usize, header: &[u8], payload: &[u8]) -> bool {
        let slot = Header::new_unchecked(header).slot();
        let regions = self.regions.lock().unwrap();
        let Some(Some(r)) = regions.get(lcore) else {
            return false;
        };
        r.results
            .write(slot_offset(slot, self.chunk_elems, self.dtype), payload)
    }
}

impl FakeAppliance {
    fn start(spec: &JobSpec, layout: &Layout, loss: f64, seed: u64) -> FakeAppliance {
        FakeAppliance::start_with(spec, layout, loss, seed, false)
    }

    /// With `shm`, the job's regions exist, and the fake answers every rank
    /// whose last message came through shared memory the same way.
    fn start_with(spec: &JobSpec, layout: &Layout, loss: f64, seed: u64, shm: bool) -> FakeAppliance {
        let sockets = bind_consecutive(layout.lcore_count());
        let base_port = sockets[0].local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let fake_shm = shm.then(|| {
            let f = FakeShm {
                regions: Arc::new(Mutex::new(Vec::new())),
                staged_reads: Arc::new(AtomicU64::new(0)),
                base_port,
                workers: spec.workers as u16,
                slots: layout.lcores.iter().map(|r| r.count as usize).collect(),
                chunk_elems: layout.chunk_elems,
                dtype: spec.dtype,
            };
            f.create();
            f
        });
        let placement = Placement::new(spec, layout.clone()).unwrap();
        let threads = sockets
            .into_iter()
            .enumerate()
            .map(|(i, sock)| {
                let mut shard: Shard<SocketAddr> = Shard::new(i as u16, Kernels::best());
                shard
                    .install(
                        JobInstall {
                            id: JOB,
                            token: TOKEN,
                            workers: spec.workers as u16,
                            dtype: spec.dtype,
                            optimizer: spec.optimizer,
                            consistency: spec.consistency,
                            chunk_elems: layout.chunk_elems,
                            slots: placement.slots(i).collect(),
                        },
                        InstallKind::Plain,
                    )
                    .unwrap();
                let stop = Arc::clone(&stop);
                let mut rng = StdRng::seed_from_u64(seed.wrapping_add(i as u64));
                let fake_shm = fake_shm.clone();
                std::thread::spawn(move || {
                    sock.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
                    let mut buf = vec![0u8; 65536];
                    let mut pkt = Vec::with_capacity(9000);
                    // Peers whose last message came through shared memory.
                    let mut shm_peers: HashSet<SocketAddr> = HashSet::new();
                    while !stop.load(Ordering::Relaxed) {
                        let Ok((n, from)) = sock.recv_from(&mut buf) else {
                            continue;
                        };
                        if loss > 0.0 && rng.gen_bool(loss) {
                            continue;
                        }
                        let now = start.elapsed().as_nanos() as u64;
                        match fake_shm.as_ref().and_then(|f| f.inline(i, &buf[..n])) {
                            Some(d) => {
                                shm_peers.insert(from);
                                shard.handle(from, &d, now);
                            }
                            None => {
                                shm_peers.remove(&from);
                                shard.handle(from, &buf[..n], now);
                            }
                        }
                        for t in shard.transmits() {
                            pkt.clear();
                            pkt.extend_from_slice(&t.header);
                            pkt.extend_from_slice(t.payload);
                            let result =
                                Header::new_unchecked(&t.header[..]).type_code() == MsgType::Result.code();
                            let mut in_shm = None;
                            for to in t.to {
                                if loss > 0.0 && rng.gen_bool(loss) {
                                    continue;
                                }
                                let shm = result && shm_peers.contains(&to);
                                let shm = shm
                                    && *in_shm.get_or_insert_with(|| {
                                        fake_shm
                                            .as_ref()
                                            .is_some_and(|f| f.write_result(i, &t.header, t.payload))
                                    });
                                if shm {
                                    let mut h = t.header;
                                    let f = Header::new_unchecked(&h[..]).flags();
                                    Header::new_unchecked(&mut h[..]).set_flags(f | flags::SHM);
                                    let _ = sock.send_to(&h, to);
                                } else {
                                    let _ = sock.send_to(&pkt, to);
                                }
                            }
                        }
                        shard.clear_transmits();
                    }
                })
            })
            .collect();
        FakeAppliance {
            base_port,
            stop,
            threads,
            shm: fake_shm,
        }
    }
}

impl Drop for FakeAppliance {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// `n` UDP sockets on consecutive ports of 127.0.0.1.
fn bind_consecutive(n: usize) -> Vec<UdpSocket> {
    let mut rng = StdRng::from_entropy();
    'retry: for _ in 0..200 {
        let base: u16 = rng.gen_range(20_000..60_000);
        let mut socks = Vec::with_capacity(n);
        for i in 0..n {
            match UdpSocket::bind(("127.0.0.1", base + i as u16)) {
                Ok(s) => socks.push(s),
                Err(_) => continue 'retry,
            }
        }
        return socks;
    }
    panic!("no {n} consecutive free UDP ports on 127.0.0.1");
}

fn spec(workers: u32, keys: &[u64], dtype: Dtype, optimizer: Optimizer) -> JobSpec {
    JobSpec::new("worker-test", workers, keys)
        .with_dtype(dtype)
        .with_chunk_bytes(8192)
        .with_optimizer(optimizer)
}

fn join_response(spec: &JobSpec, layout: &Layout, rank: u16, base_port: u16) -> JoinResponse {
    JoinResponse {
        job: JOB,
        rank,
        spec: spec.clone(),
        layout: layout.clone(),
        dataplane: DataAddr {
            host: "127.0.0.1".into(),
            base_port,
        },
        appliances: Vec::new(),
        replication: None,
    }
}

fn quick() -> WorkerConfig {
    WorkerConfig {
        timeout: Duration::from_secs(10),
        ..WorkerConfig::default()
    }
}

/// What a value looks like after a trip through the wire dtype.
fn wire(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::F32 => x,
        Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
    }
}

fn init_value(k: usize, i: usize) -> f32 {
    ((i * 7 + k) % 13) as f32 - 6.0
}

fn grad(rank: u16, round: u32, k: usize, i: usize) -> f32 {
    (((i + k) % 5) as f32) * f32::from(rank + 1) - round as f32
}

/// The expected result of every round, computed the way the appliance does.
fn reference(spec: &JobSpec, key: usize, rounds: u32) -> Vec<Vec<f32>> {
    let n = spec.keys[key].elements as usize;
    let d = spec.dtype;
    let inv_w = 1.0f32 / spec.workers as f32;
    let mut w: Vec<f32> = (0..n).map(|i| wire(d, init_value(key, i))).collect();
    let mut out = vec![w.clone()];
    for r in 1..=rounds {
        let sum: Vec<f32> = (0..n)
            .map(|i| {
                (0..spec.workers as u16)
                    .map(|rk| wire(d, grad(rk, r, key, i)))
                    .sum()
            })
            .collect();
        let res: Vec<f32> = match spec.optimizer {
            Optimizer::Sum => sum,
            Optimizer::Mean => sum.iter().map(|s| s * inv_w).collect(),
            Optimizer::Sgd { lr, weight_decay } => {
                for (w, a) in w.iter_mut().zip(&sum) {
                    let g = *a * inv_w + weight_decay * *w;
                    *w -= lr * g;
                }
                w.clone()
            }
            o => panic!("no reference for {}", o.name()),
        };
        out.push(res.iter().map(|&x| wire(d, x)).collect());
    }
    out
}

/// W workers (threads) run `rounds` rounds on every key at once and check
/// every result; returns the workers' summed stats.
fn run_job(spec: &JobSpec, lcores: usize, rounds: u32, loss: f64) -> phub_worker::WorkerStats {
    run_job_with(spec, lcores, rounds, loss, false)
}

/// As [`run_job`]; with `exchange`, every round goes through
/// `Worker::exchange` (buffers lent, not copied) instead of handles.
fn run_job_with(
    spec: &JobSpec,
    lcores: usize,
    rounds: u32,
    loss: f64,
    exchange: bool,
) -> phub_worker::WorkerStats {
    run_job_config(spec, lcores, rounds, loss, exchange, quick())
}

/// As [`run_job_with`], every worker with `config`.
fn run_job_config(
    spec: &JobSpec,
    lcores: usize,
    rounds: u32,
    loss: f64,
    exchange: bool,
    config: WorkerConfig,
) -> phub_worker::WorkerStats {
    run_job_as::<f32>(spec, lcores, rounds, loss, exchange, config, false)
}

/// An element type the workers of [`run_job_as`] hold their values in.
trait TestElem: phub_worker::Element + PartialEq + std::fmt::Debug {
    fn of(x: f32) -> Self;
    fn f32(self) -> f32;
}

impl TestElem for f32 {
    fn of(x: f32) -> f32 {
        x
    }
    fn f32(self) -> f32 {
        self
    }
}

impl TestElem for half::bf16 {
    fn of(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

impl TestElem for half::f16 {
    fn of(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

/// As [`run_job_config`], with the job's shared-memory regions on the
/// fake appliance when `shm`, the workers holding every value as `E`
/// (`f32`, or the job's own 16-bit type: exchanged without conversion);
/// the summed stats' `shm` says whether every worker used them.
fn run_job_as<E: TestElem>(
    spec: &JobSpec,
    lcores: usize,
    rounds: u32,
    loss: f64,
    exchange: bool,
    config: WorkerConfig,
    shm: bool,
) -> phub_worker::WorkerStats {
    let layout = layout(spec, &mut vec![0; lcores], u64::from);
    let app = FakeAppliance::start_with(spec, &layout, loss, 42, shm);
    let refs: Vec<Vec<Vec<f32>>> = (0..spec.keys.len()).map(|k| reference(spec, k, rounds)).collect();
    let refs = Arc::new(refs);
    let threads: Vec<_> = (0..spec.workers as u16)
        .map(|rank| {
            let join = join_response(spec, &layout, rank, app.base_port);
            let (refs, config) = (Arc::clone(&refs), config.clone());
            std::thread::spawn(move || {
                let w = Worker::from_join(join, TOKEN, config).unwrap();
                let nkeys = w.spec().keys.len();
                let lens: Vec<usize> = (0..nkeys as u32)
                    .map(|k| w.key_len(k).unwrap() as usize)
                    .collect();
                // Round 0: only rank 0's values count.
                let mut params: Vec<Vec<E>> = lens
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| {
                        (0..n)
                            .map(|i| E::of(if rank == 0 { init_value(k, i) } else { -99.0 }))
                            .collect()
                    })
                    .collect();
                let f32s = |v: &[E]| v.iter().map(|&x| x.f32()).collect::<Vec<f32>>();
                let handles: Vec<_> = params
                    .iter_mut()
                    .enumerate()
                    .map(|(k, p)| w.init(k as u32, p).unwrap())
                    .collect();
                for h in handles {
                    w.wait(h).unwrap();
                }
                for (k, p) in params.iter().enumerate() {
                    assert!(
                        f32s(p) == refs[k][0],
                        "rank {rank} key {k}: init broadcast differs"
                    );
                }
                let mut outs: Vec<Vec<E>> = lens.iter().map(|&n| vec![E::of(0.0); n]).collect();
                for r in 1..=rounds {
                    let grads: Vec<Vec<E>> = lens
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| (0..n).map(|i| E::of(grad(rank, r, k, i))).collect())
                        .collect();
                    if exchange {
                        // Odd ranks lend one buffer for the gradient and
                        // the result (`push_pull_in_place`).
                        w.exchange(|x| {
                            for (k, o) in outs.iter_mut().enumerate() {
                                if rank % 2 == 1 {
                                    o.copy_from_slice(&grads[k]);
                                    x.push_pull_in_place(k as u32, o).unwrap();
                                } else {
                                    x.push_pull(k as u32, &grads[k], o).unwrap();
                                }
                            }
                        })
                        .unwrap();
                    } else {
                        // All keys in flight at once, waited for in reverse
                        // order; odd ranks push in place (the gradient in the
                        // buffer the result lands in).
                        let mut handles: Vec<_> = outs
                            .iter_mut()
                            .enumerate()
                            .map(|(k, o)| {
                                if rank % 2 == 1 {
                                    o.copy_from_slice(&grads[k]);
                                    w.push_pull_in_place(k as u32, o).unwrap()
                                } else {
                                    w.push_pull(k as u32, &grads[k], o).unwrap()
                                }
                            })
                            .collect();
                        while let Some(h) = handles.pop() {
                            assert_eq!(h.round(), r);
                            w.wait(h).unwrap();
                        }
                    }
                    for (k, o) in outs.iter().enumerate() {
                        let o = f32s(o);
                        if o != refs[k][r as usize] {
                            let i = (0..o.len()).find(|&i| o[i] != refs[k][r as usize][i]).unwrap();
                            panic!(
                                "rank {rank} key {k} round {r}: element {i} is {} but should be {}",
                                o[i], refs[k][r as usize][i]
                            );
                        }
                    }
                    assert_eq!(w.key_round(0), Some(r));
                }
                w.stats()
            })
        })
        .collect();
    let mut total = phub_worker::WorkerStats {
        shm: true,
        ..Default::default()
    };
    for t in threads {
        let s = t.join().unwrap();
        total.shm &= s.shm;
        total.add_counters(&s);
    }
    drop(app);
    total
}

const KEYS: [u64; 3] = [1, 5000, 100_000];

fn sgd() -> Optimizer {
    Optimizer::Sgd {
        lr: 0.25,
        weight_decay: 0.125,
    }
}

#[test]
fn sum_three_workers_ten_rounds() {
    let s = run_job(&spec(3, &KEYS, Dtype::F32, Optimizer::Sum), 3, 10, 0.0);
    // 3 workers x 11 rounds x (1 + 3 + 49) chunks.
    assert_eq!(s.results_accepted, 3 * 11 * 53);
    assert_eq!(s.errors, 0);
    assert!(s.bytes_sent > 3 * 10 * 105_001 * 4 && s.bytes_received > 3 * 11 * 105_001 * 4);
}

#[test]
fn sgd_three_workers_ten_rounds() {
    let s = run_job(&spec(3, &KEYS, Dtype::F32, sgd()), 2, 10, 0.0);
    assert_eq!(s.results_accepted, 3 * 11 * 53);
}

#[test]
fn sum_and_sgd_exact_under_ten_percent_loss() {
    for opt in [Optimizer::Sum, sgd()] {
        let s = run_job(&spec(3, &KEYS, Dtype::F32, opt), 3, 10, 0.10);
        eprintln!("{}: {s:?}", opt.name());
        assert!(s.retransmits > 0, "{}: {s:?}", opt.name());
        assert_eq!(s.timeouts, 0);
    }
}

/// Injection in the workers alone (the fake appliance loses nothing):
/// every datagram of every worker is lost, duplicated or held back at the
/// spec's rates, with GSO and GRO on, and the results stay exact.
#[test]
fn worker_side_injection_leaves_results_exact() {
    for (exchange, spec_text) in [
        (false, "loss=0.05,dup=0.02,reorder=0.02,seed=1"),
        (true, "loss=0.2,dup=0.05,reorder=0.05,seed=2"),
    ] {
        let config = WorkerConfig {
            inject: Some(spec_text.parse().unwrap()),
            ..quick()
        };
        let s = run_job_config(&spec(3, &KEYS, Dtype::F32, sgd()), 2, 4, 0.0, exchange, config);
        eprintln!("{spec_text}: {s:?}");
        assert!(
            s.injected_drops > 0 && s.injected_dups > 0 && s.injected_reorders > 0,
            "{spec_text}: {s:?}"
        );
        assert!(s.retransmits > 0 && s.timeouts == 0, "{spec_text}: {s:?}");
        // Every accepted result was waited for once; duplicates are ignored.
        assert_eq!(s.results_accepted, 3 * 5 * 53, "{spec_text}");
        assert!(s.results_ignored > 0, "{spec_text}: {s:?}");
    }
    // Off: nothing injected.
    let s = run_job(&spec(2, &[5000], Dtype::F32, Optimizer::Sum), 1, 2, 0.0);
    assert_eq!(
        (s.injected_drops, s.injected_dups, s.injected_reorders),
        (0, 0, 0)
    );
}

#[test]
fn bf16_mean_and_sgd() {
    run_job(&spec(3, &KEYS, Dtype::Bf16, Optimizer::Mean), 2, 5, 0.0);
    run_job(&spec(3, &KEYS, Dtype::Bf16, sgd()), 2, 5, 0.05);
    run_job(&spec(2, &[3000], Dtype::F16, sgd()), 1, 3, 0.0);
}

/// A worker alone in a job of two: its pushes never complete.
/// bf16 and f16 slices for jobs of that wire type: exchanged as the
/// wire's bits (no f32 in between), through handles and through lent
/// buffers, over datagrams under loss and over shared memory; the results
/// are exactly the f32 path's.
#[test]
fn sixteen_bit_slices_exchange_exactly() {
    for (dtype, opt, exchange, shm) in [
        (Dtype::Bf16, Optimizer::Mean, false, false),
        (Dtype::F16, sgd(), true, false),
        (Dtype::Bf16, sgd(), true, true),
        (Dtype::F16, Optimizer::Sum, false, true),
    ] {
        let sp = spec(3, &KEYS, dtype, opt);
        let (loss, config) = if shm { (0.0, shm_on()) } else { (0.05, quick()) };
        let s = match dtype {
            Dtype::Bf16 => run_job_as::<half::bf16>(&sp, 2, 4, loss, exchange, config, shm),
            Dtype::F16 => run_job_as::<half::f16>(&sp, 2, 4, loss, exchange, config, shm),
            Dtype::F32 => unreachable!(),
        };
        let what = format!("{dtype} {} exchange={exchange} shm={shm}: {s:?}", opt.name());
        assert_eq!(s.shm, shm, "{what}");
        assert!(shm || s.retransmits > 0, "{what}");
    }
}

/// A 16-bit slice works only with a job of its own wire type.
#[test]
fn a_sixteen_bit_slice_of_another_type_is_refused() {
    let (_app, w) = lonely_worker(Duration::from_millis(300));
    let mut p = vec![half::bf16::ZERO; 10];
    match w.init(0, &mut p) {
        Err(
            e @ WorkerError::ElementType {
                elem: "bf16",
                dtype: Dtype::F32,
            },
        ) => {
            assert!(
                e.to_string().starts_with(
                    "bf16 slices do not fit this job: its wire type is f32, which takes f32 slices only"
                ),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
    let g = vec![half::f16::ZERO; 10];
    let mut o = vec![half::f16::ZERO; 10];
    assert!(matches!(
        w.push_pull(0, &g, &mut o),
        Err(WorkerError::ElementType { elem: "f16", .. })
    ));
    assert!(matches!(
        w.exchange(|x| x.push_pull(0, &g, &mut o)).unwrap(),
        Err(WorkerError::ElementType { elem: "f16", .. })
    ));
    assert!(matches!(w.pull(0, &mut o), Err(WorkerError::ElementType { .. })));
    // Nothing was claimed: the key is free for f32.
    let mut f = vec![0f32; 10];
    drop(w.init(0, &mut f).unwrap());
}

#[test]
fn exchange_lends_buffers_exactly_under_loss() {
    // f32: payloads sent from the caller's gradient, results written in place.
    let s = run_job_with(&spec(3, &KEYS, Dtype::F32, Optimizer::Sum), 3, 6, 0.0, true);
    assert_eq!(s.results_accepted, 3 * 7 * 53);
    let s = run_job_with(&spec(3, &KEYS, Dtype::F32, sgd()), 2, 6, 0.10, true);
    assert!(s.retransmits > 0 && s.timeouts == 0, "{s:?}");
    // bf16: encoded, results still written in place.
    run_job_with(&spec(2, &KEYS, Dtype::Bf16, Optimizer::Mean), 2, 4, 0.05, true);
}

#[test]
fn exchange_reports_errors_and_waits_on_panic() {
    let spec = spec(1, &[5000, 10], Dtype::F32, Optimizer::Sum);
    let layout = layout(&spec, &mut [0], u64::from);
    let app = FakeAppliance::start(&spec, &layout, 0.0, 7);
    let w = Worker::from_join(join_response(&spec, &layout, 0, app.base_port), TOKEN, quick()).unwrap();
    let mut p0 = vec![1.0f32; 5000];
    let mut p1 = vec![2.0f32; 10];
    w.wait(w.init(0, &mut p0).unwrap()).unwrap();
    w.wait(w.init(1, &mut p1).unwrap()).unwrap();
    let g0 = vec![3.0f32; 5000];
    let short = vec![0.0f32; 9];
    // A bad request fails at once; the good one still completes before
    // exchange returns.
    let r = w.exchange(|x| {
        x.push_pull(0, &g0, &mut p0)?;
        x.push_pull(1, &short, &mut p1)
    });
    assert!(matches!(r, Ok(Err(WorkerError::Length { key: 1, .. }))), "{r:?}");
    assert!(p0.iter().all(|&v| v == 3.0));
    assert_eq!(w.key_round(0), Some(1));
    // A panic inside the closure: exchange waits for the lent buffers
    // before unwinding further, and the worker stays usable.
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        w.exchange(|x| {
            x.push_pull(0, &g0, &mut p0).unwrap();
            panic!("training step failed");
        })
    }));
    assert!(caught.is_err());
    assert_eq!(w.key_round(0), Some(2));
    assert!(p0.iter().all(|&v| v == 3.0));
    let g1 = vec![0.5f32; 10];
    w.exchange(|x| x.push_pull(1, &g1, &mut p1)).unwrap().unwrap();
    assert!(p1.iter().all(|&v| v == 0.5));
}

/// Exchanges detached from their call (the DDP hook's bucket after
/// bucket): the next starts before the last has ended, each is waited on
/// its own, in any order, and dropping one waits for its requests.
#[test]
fn detached_exchanges_overlap_and_are_waited_or_dropped() {
    let spec = spec(1, &[5000, 3000, 10], Dtype::F32, Optimizer::Sum);
    let layout = layout(&spec, &mut [0], u64::from);
    let app = FakeAppliance::start(&spec, &layout, 0.05, 11);
    let w = Worker::from_join(join_response(&spec, &layout, 0, app.base_port), TOKEN, quick()).unwrap();
    let mut bufs = [vec![0f32; 5000], vec![0f32; 3000], vec![0f32; 10]];
    for (k, b) in bufs.iter_mut().enumerate() {
        w.wait(w.init(k as u32, b).unwrap()).unwrap();
    }
    // init copied: each key keeps its datagrams and a result buffer.
    assert!(w.spare_bytes() >= 2 * 4 * 8010, "{}", w.spare_bytes());
    for round in 1..=3u32 {
        let value = |k: usize| (round * 10 + k as u32) as f32;
        for (k, b) in bufs.iter_mut().enumerate() {
            b.fill(value(k));
        }
        let [b0, b1, b2] = &mut bufs;
        let first = w.exchange(|x| -> Result<_, WorkerError> {
            x.push_pull_in_place(0, &mut b0[..])?;
            // SAFETY: b0 is not touched until `first` is waited or dropped.
            Ok(unsafe { x.detach() })
        });
        let first = first.unwrap().unwrap();
        let second = w.exchange(|x| -> Result<_, WorkerError> {
            x.push_pull_in_place(1, &mut b1[..])?;
            x.push_pull_in_place(2, &mut b2[..])?;
            // SAFETY: b1 and b2 are not touched until `second` is waited
            // or dropped.
            Ok(unsafe { x.detach() })
        });
        let second = second.unwrap().unwrap();
        assert_eq!(first.keys().collect::<Vec<_>>(), [0]);
        assert_eq!(second.keys().collect::<Vec<_>>(), [1, 2]);
        if round == 2 {
            // Dropped unwaited: the drop waits, the results are in.
            drop(second);
            drop(first);
        } else {
            second.wait().unwrap();
            first.wait().unwrap();
        }
        // One worker's sum is its own gradient.
        for (k, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&v| v == value(k)), "round {round} key {k}");
            assert_eq!(w.key_round(k as u32), Some(round));
        }
    }
    // Lent: only the headers' buffers stay (one header per chunk).
    assert!(w.spare_bytes() < 4 * 8010 / 10, "{}", w.spare_bytes());
    let s = w.stats();
    assert_eq!(s.timeouts, 0, "{s:?}");
}

fn lonely_worker(timeout: Duration) -> (FakeAppliance, Worker) {
    let s = spec(2, &[10, 5000], Dtype::F32, Optimizer::Sum);
    let l = layout(&s, &mut [0, 0], u64::from);
    let app = FakeAppliance::start(&s, &l, 0.0, 1);
    let cfg = WorkerConfig {
        timeout,
        ..WorkerConfig::default()
    };
    let w = Worker::from_join(join_response(&s, &l, 0, app.base_port), TOKEN, cfg).unwrap();
    (app, w)
}

#[test]
fn misuse_is_refused_locally() {
    let (_app, w) = lonely_worker(Duration::from_millis(300));
    let mut small = vec![0f32; 9];
    let mut p = vec![0f32; 10];
    match w.init(0, &mut small) {
        Err(WorkerError::Length {
            key: 0,
            expected: 10,
            got: 9,
        }) => {}
        other => panic!("{other:?}"),
    }
    match w.init(2, &mut p) {
        Err(e @ WorkerError::UnknownKey { key: 2, keys: 2 }) => {
            assert!(e.to_string().contains("key 2 does not exist"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let g = vec![1f32; 10];
    match w.push_pull(0, &g, &mut p) {
        Err(e @ WorkerError::Sequence { key: 0, .. }) => assert!(e.to_string().contains("init"), "{e}"),
        other => panic!("{other:?}"),
    }
    let mut p2 = vec![0f32; 10];
    let h = w.init(0, &mut p).unwrap();
    match w.init(0, &mut p2) {
        Err(e @ WorkerError::Busy { key: 0 }) => assert!(e.to_string().contains("in flight"), "{e}"),
        other => panic!("{other:?}"),
    }
    // Rank 1 never comes: the request times out, then the key is free again.
    let t = Instant::now();
    match w.wait(h) {
        Err(WorkerError::Timeout { key: 0, round: 0, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(w.stats().retransmits > 0);
    let h = w.init(0, &mut p2).unwrap();
    drop(h);
}

#[test]
fn silent_appliance_times_out_naming_it() {
    // Sockets that are bound but never read: nothing ever answers.
    let socks = bind_consecutive(2);
    let base = socks[0].local_addr().unwrap().port();
    let s = spec(1, &[10_000], Dtype::F32, Optimizer::Sum);
    let l = layout(&s, &mut [0, 0], u64::from);
    let cfg = WorkerConfig {
        timeout: Duration::from_millis(300),
        ..WorkerConfig::default()
    };
    let w = Worker::from_join(join_response(&s, &l, 0, base), TOKEN, cfg).unwrap();
    let mut p = vec![1f32; 10_000];
    let t = Instant::now();
    let err = w.wait(w.init(0, &mut p).unwrap()).unwrap_err();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            WorkerError::Timeout {
                missing: 5,
                chunks: 5,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(msg.contains(&format!("127.0.0.1:{base}")), "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{}", base + 1)), "{msg}");
    assert!(msg.contains(" ms"), "{msg}");
    assert_eq!(w.stats().timeouts, 1);
    drop(socks);
}

#[test]
fn appliance_errors_fail_the_request_with_the_reason() {
    // The appliance holds a key of 5000 elements; this worker believes it has
    // 4000, so its last chunk's count is wrong.
    let real = spec(1, &[5000], Dtype::F32, Optimizer::Sum);
    let l = layout(&real, &mut [0], u64::from);
    let app = FakeAppliance::start(&real, &l, 0.0, 3);
    let mut wrong = real.clone();
    wrong.keys[0].elements = 4000;
    let mut wl = l.clone();
    wl.lcores[0].count = 2;
    let w = Worker::from_join(join_response(&wrong, &wl, 0, app.base_port), TOKEN, quick()).unwrap();
    let mut p = vec![1f32; 4000];
    let err = w.wait(w.init(0, &mut p).unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("appliance refused key 0 chunk 1 round 0: count_mismatch"),
        "{msg}"
    );
    assert_eq!(w.stats().errors, 1);
}

#[test]
fn rejoined_worker_pulls_and_continues() {
    let s = spec(2, &[3000], Dtype::F32, sgd());
    let l = layout(&s, &mut [0, 0], u64::from);
    let app = FakeAppliance::start(&s, &l, 0.0, 9);
    let w0 = Worker::from_join(join_response(&s, &l, 0, app.base_port), TOKEN, quick()).unwrap();
    let w1 = Worker::from_join(join_response(&s, &l, 1, app.base_port), TOKEN, quick()).unwrap();
    let refs = reference(&s, 0, 3);
    let mut p0: Vec<f32> = (0..3000).map(|i| init_value(0, i)).collect();
    let mut p1 = vec![0f32; 3000];
    let (h0, h1) = (w0.init(0, &mut p0).unwrap(), w1.init(0, &mut p1).unwrap());
    w0.wait(h0).unwrap();
    w1.wait(h1).unwrap();
    let mut o0 = vec![0f32; 3000];
    let mut o1 = vec![0f32; 3000];
    for r in 1..=2 {
        let g0: Vec<f32> = (0..3000).map(|i| grad(0, r, 0, i)).collect();
        let g1: Vec<f32> = (0..3000).map(|i| grad(1, r, 0, i)).collect();
        let (h0, h1) = (
            w0.push_pull(0, &g0, &mut o0).unwrap(),
            w1.push_pull(0, &g1, &mut o1).unwrap(),
        );
        w0.wait(h0).unwrap();
        w1.wait(h1).unwrap();
    }
    assert_eq!(o1, refs[2]);
    // Rank 1 restarts: a new socket, no state.
    drop(w1);
    let w1 = Worker::from_join(join_response(&s, &l, 1, app.base_port), TOKEN, quick()).unwrap();
    let mut pulled = vec![0f32; 3000];
    assert_eq!(w1.pull(0, &mut pulled).unwrap(), 2);
    assert_eq!(pulled, refs[2]);
    assert_eq!(w1.key_round(0), Some(2));
    let g0: Vec<f32> = (0..3000).map(|i| grad(0, 3, 0, i)).collect();
    let g1: Vec<f32> = (0..3000).map(|i| grad(1, 3, 0, i)).collect();
    let (h0, h1) = (
        w0.push_pull(0, &g0, &mut o0).unwrap(),
        w1.push_pull(0, &g1, &mut o1).unwrap(),
    );
    w0.wait(h0).unwrap();
    w1.wait(h1).unwrap();
    assert_eq!(o0, refs[3]);
    assert_eq!(o1, refs[3]);
}

/// A fake phub-control answering job 7's joins (`POST /v1/jobs/7/join`).
fn fake_control(answer: JoinResponse) -> (String, JoinHandle<()>) {
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let url = format!("http://{}", server.server_addr().to_ip().unwrap());
    let t = std::thread::spawn(move || {
        for _ in 0..2 {
            let Ok(Some(mut req)) = server.recv_timeout(Duration::from_secs(5)) else {
                return;
            };
            let mut body = String::new();
            req.as_reader().read_to_string(&mut body).unwrap();
            let json = tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap();
            let route = ControlRoute::parse(req.method().as_str(), req.url(), None);
            let (status, text) = match route {
                Ok(ControlRoute::Join { job: 7 }) => {
                    let j: JoinRequest = serde_json::from_str(&body).unwrap();
                    if j.token == TOKEN {
                        let mut a = answer.clone();
                        a.rank = j.rank;
                        (200, serde_json::to_string(&a).unwrap())
                    } else {
                        (403, r#"{"error":"job 7: wrong token"}"#.to_string())
                    }
                }
                _ => (404, r#"{"error":"no such route"}"#.to_string()),
            };
            let resp = tiny_http::Response::from_string(text)
                .with_status_code(status)
                .with_header(json);
            req.respond(resp).unwrap();
        }
    });
    (url, t)
}

#[test]
fn join_through_control() {
    let s = spec(2, &[10, 20_000], Dtype::Bf16, Optimizer::Sum);
    let l = layout(&s, &mut [0, 0], u64::from);
    let (url, t) = fake_control(join_response(&s, &l, 0, 40_000));
    let w = Worker::join(&url, JOB, TOKEN, 1).unwrap();
    assert_eq!((w.rank(), w.workers(), w.job()), (1, 2, JOB));
    assert_eq!(w.key_len(1), Some(20_000));
    assert_eq!(w.key_len(2), None);
    assert_eq!(w.spec().dtype, Dtype::Bf16);
    match Worker::join(&format!("{url}/"), JOB, TOKEN ^ 1, 1) {
        Err(e @ WorkerError::Join { status: 403, .. }) => {
            assert!(e.to_string().ends_with("job 7: wrong token"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    t.join().unwrap();
    // Nobody listens any more.
    match Worker::join(&url, JOB, TOKEN, 1) {
        Err(WorkerError::Http { .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// A fake follower: answers one request 503 naming `leader` in
/// `X-Phub-Leader`.
fn fake_follower(leader: String) -> (String, JoinHandle<()>) {
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let url = format!("http://{}", server.server_addr().to_ip().unwrap());
    let t = std::thread::spawn(move || {
        let Ok(Some(req)) = server.recv_timeout(Duration::from_secs(5)) else {
            return;
        };
        let text = format!(r#"{{"error":"a follower; send writes to the leader at {leader}"}}"#);
        let resp = tiny_http::Response::from_string(text)
            .with_status_code(503)
            .with_header(tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap())
            .with_header(tiny_http::Header::from_bytes(phub_http::LEADER_HEADER, leader.as_bytes()).unwrap());
        req.respond(resp).unwrap();
    });
    (url, t)
}

#[test]
fn join_through_several_controls_reaches_the_leader() {
    let s = spec(2, &[10, 20_000], Dtype::Bf16, Optimizer::Sum);
    let l = layout(&s, &mut [0, 0], u64::from);
    let (leader, t) = fake_control(join_response(&s, &l, 0, 40_000));
    let (follower, f) = fake_follower(leader.clone());
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    // Refused, then a follower naming the leader, which was not given.
    let w = Worker::join(&format!("{dead},{follower}"), JOB, TOKEN, 1).unwrap();
    assert_eq!((w.rank(), w.job()), (1, JOB));
    f.join().unwrap();
    // A refusal by the leader is the join's answer, naming it.
    match Worker::join(&format!("{dead},{leader}"), JOB, TOKEN ^ 1, 1) {
        Err(e @ WorkerError::Join { status: 403, .. }) => {
            assert!(
                e.to_string()
                    .starts_with(&format!("joining at {leader}/v1/jobs/7/join")),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
    t.join().unwrap();
}

#[test]
fn bad_join_responses_are_refused() {
    let s = spec(2, &[10, 5000], Dtype::F32, Optimizer::Sum);
    let l = layout(&s, &mut [0, 0], u64::from);
    let mut j = join_response(&s, &l, 2, 40_000);
    let e = Worker::from_join(j.clone(), TOKEN, quick()).unwrap_err();
    assert!(
        e.to_string().contains("rank 2 is not below the worker count 2"),
        "{e}"
    );
    j.rank = 0;
    j.layout.lcores[1].count -= 1;
    let e = Worker::from_join(j, TOKEN, quick()).unwrap_err();
    assert!(
        e.to_string()
            .contains("the layout does not place the spec's chunks")
            && e.to_string().contains("cover"),
        "{e}"
    );
}

fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Worker>();
}

fn shm_on() -> WorkerConfig {
    WorkerConfig {
        shm: ShmMode::On,
        ..quick()
    }
}

/// Shared memory: every dtype, both APIs, results exact; only headers
/// cross the sockets and every result is read from the result region.
#[test]
fn shared_memory_carries_every_chunk_exactly() {
    for (dtype, opt, exchange) in [
        (Dtype::F32, Optimizer::Sum, false),
        (Dtype::F32, sgd(), true),
        (Dtype::F16, Optimizer::Mean, false),
        (Dtype::Bf16, sgd(), true),
    ] {
        let sp = spec(3, &KEYS, dtype, opt);
        let s = run_job_as::<f32>(&sp, 3, 4, 0.0, exchange, shm_on(), true);
        let what = format!("{dtype} {} exchange={exchange}: {s:?}", opt.name());
        assert!(s.shm, "{what}");
        let chunks: u64 = KEYS.iter().map(|e| e.div_ceil(u64::from(sp.chunk_elems()))).sum();
        assert_eq!(s.results_accepted, 3 * 5 * chunks, "{what}");
        assert_eq!(s.shm_results, s.results_accepted, "{what}");
        let datagrams = s.chunks_sent + s.retransmits;
        assert_eq!(s.bytes_sent, datagrams * HEADER_LEN as u64, "{what}");
        assert!(
            s.bytes_received >= s.results_accepted * HEADER_LEN as u64,
            "{what}"
        );
        assert!(
            s.bytes_received < 2 * s.results_accepted * HEADER_LEN as u64,
            "{what}"
        );
    }
}

/// Loss at the fake appliance and faults injected in the workers' own
/// header datagrams: retransmissions resend headers and the staging
/// regions still hold the round's chunks.
#[test]
fn shared_memory_stays_exact_under_loss_and_injection() {
    let s = run_job_as::<f32>(
        &spec(3, &KEYS, Dtype::F32, sgd()),
        2,
        5,
        0.10,
        false,
        shm_on(),
        true,
    );
    assert!(s.shm && s.retransmits > 0 && s.timeouts == 0, "{s:?}");
    let config = WorkerConfig {
        inject: Some("loss=0.05,dup=0.02,reorder=0.02,seed=4".parse().unwrap()),
        ..shm_on()
    };
    let s = run_job_as::<f32>(
        &spec(2, &KEYS, Dtype::F16, Optimizer::Sum),
        2,
        4,
        0.0,
        true,
        config,
        true,
    );
    assert!(s.shm && s.injected_drops > 0 && s.retransmits > 0, "{s:?}");
    // f16: 4096 elements a chunk, 1 + 2 + 25 chunks.
    assert_eq!(s.results_accepted, 2 * 5 * 28);
}

/// Without regions: `Auto` (the default) exchanges datagrams, `On` fails
/// the join naming the region, `Off` never looks.
#[test]
fn without_regions_auto_uses_datagrams_and_on_refuses_to_join() {
    let s = run_job(&spec(2, &[5000], Dtype::F32, Optimizer::Sum), 1, 2, 0.0);
    assert!(!s.shm && s.shm_results == 0, "{s:?}");
    assert!(s.bytes_sent > 2 * 2 * 5000 * 4, "{s:?}");
    let sp = spec(1, &[5000], Dtype::F32, Optimizer::Sum);
    let l = layout(&sp, &mut [0], u64::from);
    let app = FakeAppliance::start(&sp, &l, 0.0, 5);
    let e = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, shm_on()).unwrap_err();
    let want = region_path(app.base_port, JOB, TOKEN, 0, Part::Staging(0));
    let msg = e.to_string();
    assert!(matches!(e, WorkerError::SharedMemory { .. }), "{e:?}");
    assert!(
        msg.contains(&want.display().to_string()) && msg.contains("No such file") && msg.contains("--shm"),
        "{msg}"
    );
    // With the regions there, Off still sends datagrams.
    let app = FakeAppliance::start_with(&sp, &l, 0.0, 5, true);
    let off = WorkerConfig {
        shm: ShmMode::Off,
        ..quick()
    };
    let w = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, off).unwrap();
    assert!(!w.shm());
    let mut p = vec![1f32; 5000];
    w.wait(w.init(0, &mut p).unwrap()).unwrap();
    assert_eq!(w.stats().shm_results, 0);
    let auto = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, quick()).unwrap();
    assert!(auto.shm() && auto.stats().shm);
}

/// Values written in place into the staging regions ([`Worker::stage`]):
/// rank 0 writes its gradients into the spans (by `Staged::write`, and by
/// hand as wire bytes through `span_mut`), rank 1 pushes as usual; the
/// results are exact, only headers cross the sockets, and the spans cover
/// each key once, in order. A staged key is busy until pushed or dropped;
/// without shared memory there is nothing to stage. f32 and f16.
#[test]
fn values_written_in_place_into_the_staging_regions_are_pushed() {
    for dtype in [Dtype::F32, Dtype::F16] {
        let sp = spec(2, &[3000, 20_000], dtype, Optimizer::Sum);
        let l = layout(&sp, &mut [0, 0], u64::from);
        let app = FakeAppliance::start_with(&sp, &l, 0.0, 19, true);
        let ws: Vec<Worker> = (0..2)
            .map(|r| Worker::from_join(join_response(&sp, &l, r, app.base_port), TOKEN, shm_on()).unwrap())
            .collect();
        let lens = [3000usize, 20_000];
        let round = |r: u32| {
            std::thread::scope(|s| {
                for (rank, w) in ws.iter().enumerate() {
                    s.spawn(move || {
                        for (k, &n) in lens.iter().enumerate() {
                            let key = k as u32;
                            let mut p = vec![0f32; n];
                            if r == 0 {
                                w.wait(w.init(key, &mut p).unwrap()).unwrap();
                                continue;
                            }
                            let g: Vec<f32> = (0..n).map(|i| grad(rank as u16, r, k, i)).collect();
                            if rank == 1 {
                                w.wait(w.push_pull(key, &g, &mut p).unwrap()).unwrap();
                            } else {
                                let mut st = w.stage(key).unwrap().expect("a mapping to stage into");
                                assert_eq!(st.key(), key);
                                let mut at = 0;
                                for sp in st.spans() {
                                    assert_eq!(sp.first, at, "spans in order, without gaps");
                                    assert_eq!(sp.bytes(), sp.elements * dtype.size());
                                    at += sp.elements;
                                }
                                assert_eq!(at, n, "the spans cover the key");
                                assert!(matches!(w.stage(key), Err(WorkerError::Busy { .. })));
                                if dtype == Dtype::F32 && r.is_multiple_of(2) {
                                    // By hand: little-endian f32 wire bytes.
                                    for i in 0..st.spans().len() {
                                        let sp = st.spans()[i];
                                        let dst = st.span_mut(i).unwrap();
                                        for (j, b) in dst.chunks_exact_mut(4).enumerate() {
                                            b.copy_from_slice(&g[sp.first + j].to_le_bytes());
                                        }
                                    }
                                } else {
                                    st.write(&g).unwrap();
                                }
                                w.wait(w.push_pull_staged(st, &mut p).unwrap()).unwrap();
                            }
                            for (i, v) in p.iter().enumerate() {
                                let want = grad(0, r, k, i) + grad(1, r, k, i);
                                assert_eq!(*v, want, "{dtype:?} rank {rank} round {r} key {k} element {i}");
                            }
                        }
                    });
                }
            })
        };
        for r in 0..4 {
            round(r);
        }
        let s = ws[0].stats();
        assert!(s.shm && s.shm_results > 0, "{s:?}");
        // Every datagram was a header: 2 keys' chunks, 4 rounds, each way
        // (and a loss probe, should the machine stall the appliance for a
        // loss timeout, a header too).
        let chunks = l.chunk_count();
        assert_eq!(
            s.bytes_sent,
            (4 * chunks + s.retransmits) * HEADER_LEN as u64,
            "{dtype:?}: {s:?}"
        );
        // Dropped unpushed: the key is free again, and wrong lengths are
        // refused without writing.
        let mut st = ws[0].stage(0).unwrap().unwrap();
        let e = st.write(&[0f32; 10]).unwrap_err();
        assert!(
            matches!(
                e,
                WorkerError::Length {
                    key: 0,
                    expected: 3000,
                    got: 10
                }
            ),
            "{e}"
        );
        drop(st);
        drop(ws[0].stage(0).unwrap().unwrap());
        assert!(matches!(ws[0].stage(9), Err(WorkerError::UnknownKey { .. })));
    }
    // Without shared memory: nothing to stage.
    let sp = spec(1, &[100], Dtype::F32, Optimizer::Sum);
    let l = layout(&sp, &mut [0], u64::from);
    let app = FakeAppliance::start(&sp, &l, 0.0, 23);
    let w = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, quick()).unwrap();
    assert!(!w.shm() && w.stage(0).unwrap().is_none());
}

/// Results left where they arrived (`Worker::wait_in_place`): read from
/// the spans (in the result regions), exact; the key is busy until the
/// results are dropped; a request whose output is not the wire type is
/// told to use `wait`.
#[test]
fn results_left_in_the_result_regions_are_read_in_place() {
    let sp = spec(2, &[3000, 20_000], Dtype::F32, Optimizer::Sum);
    let l = layout(&sp, &mut [0, 0], u64::from);
    let app = FakeAppliance::start_with(&sp, &l, 0.0, 29, true);
    let ws: Vec<Worker> = (0..2)
        .map(|r| Worker::from_join(join_response(&sp, &l, r, app.base_port), TOKEN, shm_on()).unwrap())
        .collect();
    let lens = [3000usize, 20_000];
    for r in 0..3u32 {
        std::thread::scope(|s| {
            for (rank, w) in ws.iter().enumerate() {
                s.spawn(move || {
                    for (k, &n) in lens.iter().enumerate() {
                        let key = k as u32;
                        let mut p = vec![0f32; n];
                        if r == 0 {
                            w.wait(w.init(key, &mut p).unwrap()).unwrap();
                            continue;
                        }
                        let g: Vec<f32> = (0..n).map(|i| grad(rank as u16, r, k, i)).collect();
                        if rank == 1 {
                            w.wait(w.push_pull(key, &g, &mut p).unwrap()).unwrap();
                            continue;
                        }
                        let mut st = w.stage(key).unwrap().unwrap();
                        st.write(&g).unwrap();
                        // Round 2 pushes without an output.
                        let h = if r == 2 {
                            w.push_staged(st).unwrap()
                        } else {
                            w.push_pull_staged(st, &mut p).unwrap()
                        };
                        let res = w.wait_in_place(h).unwrap();
                        assert!(p.iter().all(|&v| v == 0.0), "the output is left as it was");
                        assert!(matches!(w.stage(key), Err(WorkerError::Busy { .. })));
                        assert!(res.memory().is_some());
                        let mut at = 0;
                        for i in 0..res.spans().len() {
                            let sp = res.spans()[i];
                            assert_eq!(sp.first, at);
                            for (j, b) in res.span(i).unwrap().chunks_exact(4).enumerate() {
                                let e = sp.first + j;
                                let want = grad(0, r, k, e) + grad(1, r, k, e);
                                assert_eq!(
                                    f32::from_le_bytes(b.try_into().unwrap()),
                                    want,
                                    "round {r} key {k} element {e}"
                                );
                            }
                            at += sp.elements;
                        }
                        assert_eq!(at, n);
                        drop(res);
                        drop(w.stage(key).unwrap().unwrap());
                    }
                });
            }
        });
    }
    // A 16-bit job whose output was f32: the results are not in the wire type.
    let sp = spec(1, &[100], Dtype::F16, Optimizer::Sum);
    let l = layout(&sp, &mut [0], u64::from);
    let app = FakeAppliance::start_with(&sp, &l, 0.0, 31, true);
    let w = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, shm_on()).unwrap();
    let mut p = vec![1f32; 100];
    w.wait(w.init(0, &mut p).unwrap()).unwrap();
    let mut st = w.stage(0).unwrap().unwrap();
    st.write(&p).unwrap();
    let e = w
        .wait_in_place(w.push_pull_staged(st, &mut p).unwrap())
        .unwrap_err();
    assert!(
        e.to_string().contains("not the job's wire type (f16); use wait"),
        "{e}"
    );
    drop(w.stage(0).unwrap().unwrap());
    // Pushed without an output: the results are there in the wire type
    // (one rank's ones, summed) ...
    let ones = vec![half::f16::ONE; 100];
    let mut st = w.stage(0).unwrap().unwrap();
    st.write(&ones).unwrap();
    let res = w.wait_in_place(w.push_staged(st).unwrap()).unwrap();
    let mut got = 0;
    for i in 0..res.spans().len() {
        for b in res.span(i).unwrap().chunks_exact(2) {
            assert_eq!(half::f16::from_le_bytes([b[0], b[1]]), half::f16::ONE);
            got += 1;
        }
    }
    assert_eq!(got, 100);
    drop(res);
    // ... and `wait` on such a handle says why it cannot write them, and
    // frees the key.
    let mut st = w.stage(0).unwrap().unwrap();
    st.write(&ones).unwrap();
    let e = w.wait(w.push_staged(st).unwrap()).unwrap_err();
    assert!(
        matches!(e, WorkerError::Sequence { key: 0, .. })
            && e.to_string().contains("only be read in place (wait_in_place)"),
        "{e}"
    );
    drop(w.stage(0).unwrap().unwrap());
}

/// A RESULT that says its payload is in shared memory, to a worker that
/// has none mapped, is malformed: counted and ignored.
#[test]
fn a_shared_memory_result_without_regions_is_dropped() {
    let socks = bind_consecutive(1);
    let base = socks[0].local_addr().unwrap().port();
    let sp = spec(1, &[100], Dtype::F32, Optimizer::Sum);
    let l = layout(&sp, &mut [0], u64::from);
    let cfg = WorkerConfig {
        timeout: Duration::from_millis(400),
        ..WorkerConfig::default()
    };
    let w = Worker::from_join(join_response(&sp, &l, 0, base), TOKEN, cfg).unwrap();
    assert!(!w.shm());
    let mut p = vec![1f32; 100];
    let h = w.init(0, &mut p).unwrap();
    socks[0].set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 9000];
    let (n, from) = socks[0].recv_from(&mut buf).unwrap();
    let (push, _) = wire::parse(&buf[..n]).unwrap();
    let result = wire::Repr {
        kind: MsgType::Result,
        flags: flags::SHM,
        rank: wire::APPLIANCE_RANK,
        ..push
    };
    socks[0].send_to(&result.to_bytes(), from).unwrap();
    assert!(matches!(w.wait(h), Err(WorkerError::Timeout { .. })));
    let s = w.stats();
    assert!(s.foreign_dropped >= 1 && s.results_accepted == 0, "{s:?}");
}

/// The dataplane restarts (its regions go, then come back as new files
/// under the same names): the worker sends datagrams while they are gone,
/// maps the new ones when they are back, and every result stays exact.
#[test]
fn recreated_regions_are_mapped_again() {
    let sp = spec(2, &[3000, 20_000], Dtype::F32, Optimizer::Sum);
    let l = layout(&sp, &mut [0, 0], u64::from);
    let app = FakeAppliance::start_with(&sp, &l, 0.0, 11, true);
    let fake = app.shm.clone().unwrap();
    let ws: Vec<Worker> = (0..2)
        .map(|r| Worker::from_join(join_response(&sp, &l, r, app.base_port), TOKEN, shm_on()).unwrap())
        .collect();
    let lens = [3000usize, 20_000];
    let round = |r: u32| {
        std::thread::scope(|s| {
            for (rank, w) in ws.iter().enumerate() {
                s.spawn(move || {
                    for (k, &n) in lens.iter().enumerate() {
                        let mut p = vec![0f32; n];
                        if r == 0 {
                            w.wait(w.init(k as u32, &mut p).unwrap()).unwrap();
                            continue;
                        }
                        let g: Vec<f32> = (0..n).map(|i| grad(rank as u16, r, k, i)).collect();
                        w.wait(w.push_pull(k as u32, &g, &mut p).unwrap()).unwrap();
                        for (i, v) in p.iter().enumerate() {
                            let want = grad(0, r, k, i) + grad(1, r, k, i);
                            assert_eq!(*v, want, "rank {rank} round {r} key {k} element {i}");
                        }
                    }
                });
            }
        })
    };
    round(0);
    round(1);
    let before = ws[0].stats().shm_results;
    assert!(ws.iter().all(Worker::shm) && before > 0);
    // Gone: the workers notice before their next sends (they check the
    // files every 5 ms while busy) and send datagrams.
    fake.remove();
    std::thread::sleep(Duration::from_millis(20));
    round(2);
    assert!(ws.iter().all(|w| !w.shm()));
    assert_eq!(ws[0].stats().shm_results, before);
    // Back as new files: mapped again at the next try (every 100 ms).
    fake.create();
    std::thread::sleep(Duration::from_millis(150));
    round(3);
    round(4);
    assert!(ws.iter().all(Worker::shm));
    assert!(ws[0].stats().shm_results > before);
}

/// The regions are replaced while requests are in flight: rank 0's chunks
/// were staged into the old mapping and consumed from it, rank 1 (idle
/// meanwhile, its mapping stale) stages into the old mapping and its I/O
/// thread copies the chunks into the new one, and the results (written
/// into the new result region) reach the callers' buffers exactly; the
/// next rounds run in the new mapping alone. f32 and f16.
#[test]
fn regions_replaced_mid_flight_leave_results_exact() {
    for dtype in [Dtype::F32, Dtype::F16] {
        let sp = spec(2, &[3000, 20_000], dtype, Optimizer::Sum);
        let l = layout(&sp, &mut [0, 0], u64::from);
        let app = FakeAppliance::start_with(&sp, &l, 0.0, 13, true);
        let fake = app.shm.clone().unwrap();
        let ws: Vec<Worker> = (0..2)
            .map(|r| Worker::from_join(join_response(&sp, &l, r, app.base_port), TOKEN, shm_on()).unwrap())
            .collect();
        let lens = [3000usize, 20_000];
        let grads = |rank: u16, r: u32| -> Vec<Vec<f32>> {
            lens.iter()
                .enumerate()
                .map(|(k, &n)| (0..n).map(|i| grad(rank, r, k, i)).collect())
                .collect()
        };
        let check = |outs: &[Vec<f32>], rank: usize, r: u32| {
            for (k, o) in outs.iter().enumerate() {
                for (i, v) in o.iter().enumerate() {
                    let want = wire(
                        dtype,
                        wire(dtype, grad(0, r, k, i)) + wire(dtype, grad(1, r, k, i)),
                    );
                    assert_eq!(*v, want, "{dtype} rank {rank} round {r} key {k} element {i}");
                }
            }
        };
        let mut p: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0f32; n]).collect();
        std::thread::scope(|s| {
            for w in &ws {
                s.spawn(move || {
                    let mut p: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0f32; n]).collect();
                    for (k, p) in p.iter_mut().enumerate() {
                        w.wait(w.init(k as u32, p).unwrap()).unwrap();
                    }
                });
            }
        });
        let chunks = l.chunk_count() as u64;
        let read = fake.staged_reads.load(Ordering::Relaxed);
        // Round 1: rank 0's chunks go out of the first mapping and are read
        // from it, then the regions are replaced while they wait for rank
        // 1's.
        let (g0, g1) = (grads(0, 1), grads(1, 1));
        let mut p1: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0f32; n]).collect();
        let handles: Vec<_> = p
            .iter_mut()
            .enumerate()
            .map(|(k, o)| ws[0].push_pull(k as u32, &g0[k], o).unwrap())
            .collect();
        while fake.staged_reads.load(Ordering::Relaxed) < read + chunks {
            std::thread::sleep(Duration::from_millis(1));
        }
        fake.remove();
        fake.create();
        std::thread::sleep(Duration::from_millis(20));
        let handles1: Vec<_> = p1
            .iter_mut()
            .enumerate()
            .map(|(k, o)| ws[1].push_pull(k as u32, &g1[k], o).unwrap())
            .collect();
        for h in handles.into_iter().chain(handles1) {
            ws[0].wait(h).unwrap_or_else(|e| panic!("{dtype}: {e}"));
        }
        check(&p, 0, 1);
        check(&p1, 1, 1);
        // Rounds 2 and 3 in the new mapping.
        for r in 2..=3 {
            std::thread::scope(|s| {
                for (rank, w) in ws.iter().enumerate() {
                    s.spawn(move || {
                        let g = grads(rank as u16, r);
                        let mut outs: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0f32; n]).collect();
                        let hs: Vec<_> = outs
                            .iter_mut()
                            .enumerate()
                            .map(|(k, o)| w.push_pull(k as u32, &g[k], o).unwrap())
                            .collect();
                        for h in hs {
                            w.wait(h).unwrap();
                        }
                        check(&outs, rank, r);
                    });
                }
            });
        }
        for w in &ws {
            let s = w.stats();
            assert!(w.shm() && s.timeouts == 0, "{dtype}: {s:?}");
            // Every result of rounds 0, 2 and 3 came through shared memory.
            assert!(s.shm_results >= 3 * chunks, "{dtype}: {s:?}");
        }
    }
}

/// A handle dropped without a wait frees its key (once the request has
/// ended); until then, and until a wait copied a shared-memory result out,
/// the key is busy. The next round's result is exact either way.
#[test]
fn dropped_handles_free_the_key_and_the_next_round_is_exact() {
    let sp = spec(1, &[20_000], Dtype::F32, Optimizer::Sum);
    let l = layout(&sp, &mut [0, 0], u64::from);
    let app = FakeAppliance::start_with(&sp, &l, 0.0, 17, true);
    let w = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, shm_on()).unwrap();
    let n = 20_000usize;
    let mut p = vec![0f32; n];
    w.wait(w.init(0, &mut p).unwrap()).unwrap();
    let g = |r: u32| -> Vec<f32> { (0..n).map(|i| grad(0, r, 0, i)).collect() };
    let deadline = Instant::now() + Duration::from_secs(10);
    let until_round = |r: u32| {
        while w.key_round(0) != Some(r) {
            assert!(Instant::now() < deadline, "round {r} never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // Round 1 completes while its handle is held: the result stays in the
    // result region, and the key stays claimed until the wait.
    let mut out = vec![0f32; n];
    let h = w.push_pull(0, &g(1), &mut out).unwrap();
    until_round(1);
    let mut other = vec![0f32; n];
    assert!(matches!(
        w.push_pull(0, &g(2), &mut other),
        Err(WorkerError::Busy { key: 0 })
    ));
    w.wait(h).unwrap();
    assert_eq!(out, g(1));
    // Round 2's handle is dropped after its request ended, round 3's at
    // once; each time the key comes free and the next round is exact.
    // `then` gets the handle of round `r`, started once the key is free.
    let when_free = |r: u32, then: &dyn Fn(phub_worker::Handle<'_>)| -> Vec<f32> {
        loop {
            let mut out = vec![0f32; n];
            match w.push_pull(0, &g(r), &mut out) {
                Ok(h) => {
                    then(h);
                    return out;
                }
                Err(WorkerError::Busy { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => panic!("round {r}: {e}"),
            }
        }
    };
    let out2 = when_free(2, &|h| {
        until_round(2);
        drop(h);
    });
    let out3 = when_free(3, &|h| drop(h));
    let out4 = when_free(4, &|h| w.wait(h).unwrap());
    assert_eq!(out4, g(4));
    assert!(
        out2.iter().chain(&out3).all(|&x| x == 0.0),
        "no wait, nothing written"
    );
    assert!(w.shm() && w.stats().shm_results >= 5 * 3, "{:?}", w.stats());
}

/// A real dataplane (kernel UDP, in this process) stopped cleanly, as
/// SIGTERM stops it, while a worker waits on it: the request fails at once
/// with `shutting_down`, well within the worker's 30 s timeout (which it
/// used to wait out).
#[test]
fn a_dataplane_stopping_cleanly_fails_the_request_in_flight_at_once() {
    use phub_dataplane::app::{Appliance, BackendKind, Config};
    use phub_proto::api::InstallJob;
    let app = Appliance::start(&Config {
        backend: BackendKind::Udp,
        host: "127.0.0.1".parse().unwrap(),
        base_port: 0,
        lcores: Some(2),
        mgmt: "127.0.0.1:0".parse().unwrap(),
        mgmt_token_file: None,
        memory_budget: 64 << 20,
        busy_poll: false,
        spin_us: phub_dataplane::spin::SpinSetting::Fixed(0),
        inject: None,
        no_pin: true,
        socket_buffer: 4 << 20,
        shm: false,
        build: "test".into(),
        dpdk: Default::default(),
    })
    .unwrap();
    let spec = spec(2, &[5000], Dtype::F32, Optimizer::Sum);
    let lay = layout(&spec, &mut [0, 0], u64::from);
    let job = InstallJob {
        id: JOB,
        token: TOKEN,
        spec: spec.clone(),
        layout: lay.clone(),
        hierarchy: None,
        replication: None,
        entries: None,
    };
    app.manager().install(JOB, job).unwrap();
    let config = WorkerConfig {
        timeout: Duration::from_secs(30),
        ..WorkerConfig::default()
    };
    let join = join_response(&spec, &lay, 0, app.data_addr().port());
    let w = Worker::from_join(join, TOKEN, config).unwrap();
    // Rank 1 never initialises: rank 0's round 0 stays open.
    let mut p = vec![1f32; 5000];
    let h = w.init(0, &mut p).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let stopping = std::thread::spawn(move || app.shutdown());
    let e = w.wait(h).unwrap_err();
    let took = t.elapsed();
    assert!(
        matches!(&e, WorkerError::Refused { key: 0, reason, .. } if reason == "shutting_down"),
        "{e}"
    );
    assert!(e.to_string().contains("the appliance is shutting down"), "{e}");
    assert!(took < Duration::from_secs(2), "failed after {took:?}");
    stopping.join().unwrap();
}

/// Async and bounded-delay jobs (PROTOCOL.md §5.8) take the same calls as
/// BSP: each `push_pull` carries the rank's next clock (its retransmissions
/// too, under loss at the appliance and faults injected at the worker),
/// only the answer to that clock completes it, and with `sum` (integer
/// deltas) every rank pulls the exact total once all have pushed, with its
/// own last clock as the round. With τ = 0 and no loss every answer to
/// clock c is exactly the values after every rank's clock c.
#[test]
fn async_and_bounded_delay_jobs_take_the_same_calls_and_stay_exact() {
    const ROUNDS: u32 = 6;
    let injected = WorkerConfig {
        inject: Some("loss=0.03,dup=0.02,reorder=0.02,seed=11".parse().unwrap()),
        ..quick()
    };
    for (consistency, loss, config, per_clock_exact) in [
        (Consistency::Async, 0.05, injected.clone(), false),
        (Consistency::Bounded { delay: 1 }, 0.05, injected, false),
        (Consistency::Bounded { delay: 0 }, 0.0, quick(), true),
    ] {
        let mut sp = spec(3, &KEYS, Dtype::F32, Optimizer::Sum);
        sp.consistency = consistency;
        let l = layout(&sp, &mut [0, 0], u64::from);
        let app = FakeAppliance::start(&sp, &l, loss, 9);
        let all_pushed = Arc::new(std::sync::Barrier::new(sp.workers as usize));
        // The values after every rank's clocks 1..=c, per key.
        let after = |c: u32, k: usize, n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let pushed: f32 = (0..3u16)
                        .flat_map(|rk| (1..=c).map(move |r| grad(rk, r, k, i)))
                        .sum();
                    init_value(k, i) + pushed
                })
                .collect()
        };
        let threads: Vec<_> = (0..sp.workers as u16)
            .map(|rank| {
                let join = join_response(&sp, &l, rank, app.base_port);
                let (config, all_pushed) = (config.clone(), Arc::clone(&all_pushed));
                std::thread::spawn(move || {
                    let what = format!("{consistency} rank {rank}");
                    let w = Worker::from_join(join, TOKEN, config).unwrap();
                    assert_eq!(w.consistency(), consistency, "{what}");
                    assert_eq!(w.clock(), None, "{what}: no key initialised");
                    let lens: Vec<usize> = KEYS.iter().map(|&e| e as usize).collect();
                    let mut params: Vec<Vec<f32>> = lens
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| (0..n).map(|i| init_value(k, i)).collect())
                        .collect();
                    for (k, p) in params.iter_mut().enumerate() {
                        w.wait(w.init(k as u32, p).unwrap()).unwrap();
                    }
                    assert_eq!(w.clock(), Some(0), "{what}");
                    for r in 1..=ROUNDS {
                        let grads: Vec<Vec<f32>> = lens
                            .iter()
                            .enumerate()
                            .map(|(k, &n)| (0..n).map(|i| grad(rank, r, k, i)).collect())
                            .collect();
                        let handles: Vec<_> = params
                            .iter_mut()
                            .enumerate()
                            .map(|(k, p)| w.push_pull(k as u32, &grads[k], p).unwrap())
                            .collect();
                        for h in handles {
                            assert_eq!(h.round(), r, "{what}: the push carries the rank's next clock");
                            w.wait(h).unwrap();
                        }
                        assert_eq!(w.clock(), Some(r), "{what}");
                        if per_clock_exact {
                            for (k, p) in params.iter().enumerate() {
                                assert!(*p == after(r, k, lens[k]), "{what} key {k}: clock {r}'s answer");
                            }
                        }
                    }
                    all_pushed.wait();
                    for (k, &n) in lens.iter().enumerate() {
                        let mut out = vec![0f32; n];
                        let clock = w.pull(k as u32, &mut out).unwrap();
                        assert_eq!(
                            clock, ROUNDS,
                            "{what} key {k}: a pull answers the rank's last clock"
                        );
                        assert!(out == after(ROUNDS, k, n), "{what} key {k}: final values");
                        assert_eq!(w.key_round(k as u32), Some(ROUNDS), "{what}");
                    }
                    w.stats()
                })
            })
            .collect();
        let mut retransmits = 0;
        for t in threads {
            let s = t.join().unwrap();
            assert_eq!(s.timeouts, 0, "{consistency}: {s:?}");
            retransmits += s.retransmits;
        }
        if loss > 0.0 {
            assert!(retransmits > 0, "{consistency}: the loss was not exercised");
        }
    }
}

/// Shared memory is for BSP jobs: `On` refuses an async or bounded-delay
/// job saying so (the regions exist here, so it is not about a missing
/// region) and `Auto` exchanges datagrams.
#[test]
fn shared_memory_is_refused_for_a_job_that_is_not_bsp() {
    for consistency in [Consistency::Async, Consistency::Bounded { delay: 2 }] {
        let mut sp = spec(1, &[5000], Dtype::F32, Optimizer::Sum);
        sp.consistency = consistency;
        let l = layout(&sp, &mut [0], u64::from);
        let app = FakeAppliance::start_with(&sp, &l, 0.0, 5, true);
        let e = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, shm_on()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, WorkerError::SharedMemory { .. }), "{e:?}");
        assert!(
            msg.contains("BSP jobs only") && msg.contains(&consistency.to_string()),
            "{msg}"
        );
        let w = Worker::from_join(join_response(&sp, &l, 0, app.base_port), TOKEN, quick()).unwrap();
        assert!(!w.shm(), "{consistency}");
        let mut p = vec![1f32; 5000];
        w.wait(w.init(0, &mut p).unwrap()).unwrap();
        let g = vec![2f32; 5000];
        w.wait(w.push_pull(0, &g, &mut p).unwrap()).unwrap();
        assert!(p.iter().all(|&x| x == 3.0), "{consistency}");
        assert_eq!(w.stats().shm_results, 0);
    }
}
