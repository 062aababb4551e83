//! phub-sim: the whole-system simulator (quinn-proto's `Pair`,
//! TigerBeetle's simulator, at the scale of a job).
//!
//! Layer: test support. W *real* worker transports
//! (`phub_worker::sim::SimTransport`, the state machine the worker's I/O
//! thread drives) exchange datagrams with *real* engine shards
//! (`phub_dataplane::Shard`, one per lcore) over one seeded simulated
//! network ([`net`]: per-link delay and jitter, loss, duplication,
//! reordering) on a virtual clock: an event queue whose instants are a
//! base `Instant` plus virtual microseconds. Nothing sleeps, nothing reads
//! the wall clock, no socket is opened; a run is a function of its
//! [`Case`], and a case of its seed ([`Case::draw`]).
//!
//! After every step the run checks the invariants stated at the heads of
//! `dataplane/src/engine.rs` and `worker/src/transport/mod.rs`, and panics
//! naming the one broken:
//! - every RESULT that leaves an lcore, and every result a worker
//!   accepts, is bit-identical to [`reference`]'s;
//! - no (slot, round, rank) contribution is applied twice;
//! - every datagram an lcore gets is handled or counted under its drop
//!   reason (its counters move by exactly what `handle` said), and every
//!   datagram a worker gets is accepted, ignored or dropped, counted;
//! - no worker is stuck: every request ends with its result, before the
//!   transport's timeout and before the run's virtual deadline.
//!
//! New features add their faults and checks here, not a harness of their
//! own.

pub mod net;
pub mod reference;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use phub_dataplane::kernels::Kernels;
use phub_dataplane::{JobInstall, Shard, Verdict};
use phub_proto::dtype::decode;
use phub_proto::layout::{layout, Layout, Placement};
use phub_proto::spec::{Consistency, JobSpec, KeySpec, Optimizer};
use phub_proto::wire::{self, DropReason, MsgType};
use phub_proto::Dtype;
use phub_worker::sim::{SimChunk, SimKind, SimTransport};
use phub_worker::WorkerConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use net::{Faults, Net, Node};

/// The job id every case installs.
pub const JOB: u16 = 7;
/// The job's token.
pub const TOKEN: u64 = 0x5eed_0f7e_57a1;
/// A run that has not finished after this much virtual time is stuck.
pub const DEADLINE_US: u64 = 120_000_000;

/// One simulated job: its shape, its faults and the seed of its draws.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// Seeds the network and the workers' compute times.
    pub seed: u64,
    /// Ranks.
    pub workers: u16,
    /// Lcores of the appliance.
    pub lcores: u16,
    /// Elements per key.
    pub keys: Vec<u64>,
    /// Wire type.
    pub dtype: Dtype,
    /// Bytes per chunk.
    pub chunk_bytes: u32,
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Rounds after round 0.
    pub rounds: u32,
    /// Each worker's window (chunks outstanding at most).
    pub window: usize,
    /// The network's faults.
    pub faults: Faults,
    /// A rank computes for up to this long between rounds, µs.
    pub compute_us: u64,
}

impl Case {
    /// The case of seed `seed`: every field drawn from it.
    pub fn draw(seed: u64) -> Case {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let opts = reference::optimizers();
        let lossy = rng.gen_bool(0.8);
        Case {
            seed,
            workers: rng.gen_range(1..=8),
            lcores: rng.gen_range(1..=4),
            keys: (0..rng.gen_range(1..=4))
                .map(|_| rng.gen_range(1..=300))
                .collect(),
            dtype: Dtype::ALL[rng.gen_range(0..Dtype::ALL.len())],
            chunk_bytes: 64 * rng.gen_range(1..=4),
            optimizer: opts[rng.gen_range(0..opts.len())],
            rounds: rng.gen_range(1..=5),
            window: rng.gen_range(1..=32),
            faults: if lossy {
                Faults {
                    loss: rng.gen_range(0.0..0.2),
                    dup: rng.gen_range(0.0..0.1),
                    reorder: rng.gen_range(0.0..0.1),
                    delay_us: (rng.gen_range(5..50), rng.gen_range(50..500)),
                    jitter_us: rng.gen_range(0..200),
                }
            } else {
                Faults::NONE
            },
            compute_us: rng.gen_range(0..2000),
        }
    }
}

/// What a run did, for the caller to print or check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The network's counts.
    pub net: net::NetStats,
    /// Datagrams the lcores dropped (counted under a reason).
    pub dropped: u64,
    /// Stored results the lcores sent again (for a lost one).
    pub results_resent: u64,
    /// Chunks the workers sent again.
    pub retransmits: u64,
    /// Virtual time the run took, µs.
    pub virtual_us: u64,
}

/// One rank: its transport and where its training loop stands.
struct Rank {
    t: SimTransport,
    /// The round in flight, or the last completed.
    round: u32,
    /// Keys of `round` without their result.
    waiting: usize,
    /// When the next round is submitted (its gradient computed).
    ready_at: Option<u64>,
    finished: bool,
    /// Datagrams handed to the transport.
    received: u64,
}

/// One lcore: its shard and what the run saw it do.
struct Lcore {
    shard: Shard<std::net::SocketAddr>,
    node: Node,
    delivered: u64,
    /// Drops by reason code, as `handle` returned them.
    drops: Vec<u64>,
}

/// The whole system of a case.
struct World<'c> {
    case: &'c Case,
    lay: Layout,
    placement: Placement,
    lcores: Vec<Lcore>,
    ranks: Vec<Rank>,
    net: Net,
    rng: ChaCha8Rng,
    init: Vec<Vec<f32>>,
    /// Per key, per round, the values every rank must get.
    expect: Vec<Vec<Vec<f32>>>,
    /// (key, chunk, round, rank) contributions applied so far.
    applied: HashSet<(u32, u32, u32, u16)>,
    base: Instant,
    now: u64,
}

/// Runs `case` to its end, checking every invariant after every step;
/// panics naming the first one broken.
pub fn run(case: &Case) -> Outcome {
    let mut w = World::new(case);
    w.start();
    loop {
        w.step();
        if w.ranks.iter().all(|r| r.finished) {
            break;
        }
        let next = w.next_event();
        let Some(next) = next else {
            panic!(
                "no worker can make progress at {} µs: nothing in flight and no timer, while ranks {:?} are not finished",
                w.now,
                w.unfinished()
            );
        };
        w.now = next.max(w.now + 1);
        assert!(
            w.now < DEADLINE_US,
            "not finished after {DEADLINE_US} µs of virtual time: ranks {:?} are stuck",
            w.unfinished()
        );
    }
    w.finish()
}

impl<'c> World<'c> {
    fn new(case: &'c Case) -> World<'c> {
        let spec = JobSpec {
            checkpoint_interval_s: None,
            placement: None,
            name: "sim".into(),
            workers: u32::from(case.workers),
            dtype: case.dtype,
            chunk_bytes: case.chunk_bytes,
            optimizer: case.optimizer,
            consistency: Consistency::Sync,
            keys: case
                .keys
                .iter()
                .map(|&elements| KeySpec {
                    name: String::new(),
                    elements,
                })
                .collect(),
        };
        if let Err(e) = spec.validate() {
            panic!("case {case:?} is not a valid job: {e}");
        }
        let mut load = vec![0; usize::from(case.lcores)];
        let lay = layout(&spec, &mut load, u64::from);
        let placement = Placement::new(&spec, lay.clone()).expect("a layout of the spec places it");
        let lcores = (0..case.lcores)
            .map(|l| {
                let kernels = Kernels::available()[usize::from(l) % Kernels::available().len()];
                let mut shard = Shard::new(l, kernels);
                shard
                    .install(JobInstall {
                        id: JOB,
                        token: TOKEN,
                        workers: case.workers,
                        dtype: case.dtype,
                        optimizer: case.optimizer,
                        consistency: Consistency::Sync,
                        chunk_elems: lay.chunk_elems,
                        slots: placement.slots(usize::from(l)).collect(),
                    })
                    .expect("the job installs");
                Lcore {
                    shard,
                    node: Node::Lcore(0, l),
                    delivered: 0,
                    drops: vec![0; DropReason::COUNT + 1],
                }
            })
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0x1_0000);
        let init: Vec<Vec<f32>> = case
            .keys
            .iter()
            .map(|&n| (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect())
            .collect();
        let expect = reference::bsp(case.dtype, &case.optimizer, case.workers, &init, case.rounds);
        let base = Instant::now();
        let config = WorkerConfig {
            timeout: Duration::from_secs(10),
            ..WorkerConfig::default()
        };
        let ranks = (0..case.workers)
            .map(|rank| Rank {
                t: SimTransport::new(JOB, TOKEN, rank, case.dtype, true, case.window, &config, base),
                round: 0,
                waiting: 0,
                ready_at: Some(rng.gen_range(0..=case.compute_us)),
                finished: false,
                received: 0,
            })
            .collect();
        World {
            case,
            lay,
            placement,
            lcores,
            ranks,
            net: Net::new(case.seed ^ 0xfa17, case.faults),
            rng,
            init,
            expect,
            applied: HashSet::new(),
            base,
            now: 0,
        }
    }

    fn at(&self, us: u64) -> Instant {
        self.base + Duration::from_micros(us)
    }

    /// `t` as virtual µs, rounded up (a timer is run once it is due).
    fn us(&self, t: Instant) -> u64 {
        let d = t.saturating_duration_since(self.base);
        u64::try_from(d.as_nanos().div_ceil(1000)).unwrap_or(u64::MAX)
    }

    fn unfinished(&self) -> Vec<(usize, u32)> {
        self.ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.finished)
            .map(|(i, r)| (i, r.round))
            .collect()
    }

    /// Round 0 is submitted by each rank when its `ready_at` comes.
    fn start(&mut self) {
        for r in &mut self.ranks {
            r.round = 0;
        }
    }

    /// The chunks of key `k` as the join answer places them.
    fn chunks(&self, k: usize) -> Vec<SimChunk> {
        // Cast: keys are numbered by u32 on the wire.
        #[allow(clippy::cast_possible_truncation)]
        let key = k as u32;
        self.placement
            .places(key)
            .enumerate()
            .map(|(c, p)| {
                // Cast: a key's chunks are numbered by u32 on the wire.
                #[allow(clippy::cast_possible_truncation)]
                let c = c as u32;
                SimChunk {
                    chunk: c,
                    slot: p.slot,
                    offset: c as usize * self.lay.chunk_elems as usize,
                    len: self.lay.chunk_len(self.case.keys[k], c),
                    lcore: p.lcore,
                    to: self.lcores[usize::from(p.lcore)].node.addr(),
                }
            })
            .collect()
    }

    /// Rank `i` submits its round `ranks[i].round` for every key, in key order.
    fn submit_round(&mut self, i: usize) {
        let now = self.at(self.now);
        let round = self.ranks[i].round;
        // Cast: ranks are u16.
        #[allow(clippy::cast_possible_truncation)]
        let rank = i as u16;
        for k in 0..self.case.keys.len() {
            let chunks = self.chunks(k);
            let n = self.case.keys[k] as usize;
            #[allow(clippy::cast_possible_truncation)]
            let key = k as u32;
            let (kind, values) = if round == 0 {
                (SimKind::Init, (rank == 0).then(|| self.init[k].clone()))
            } else {
                (SimKind::Push, Some(reference::grads(rank, key, n, round)))
            };
            self.ranks[i].t.submit(
                now,
                u64::from(key),
                key,
                n,
                round,
                kind,
                &chunks,
                values.as_deref(),
            );
        }
        self.ranks[i].waiting = self.case.keys.len();
        self.ranks[i].ready_at = None;
    }

    /// One instant: the datagrams due are delivered, then every rank runs
    /// its timers, takes its ended requests, submits what is ready and
    /// sends.
    fn step(&mut self) {
        while let Some(d) = self.net.pop_due(self.now) {
            match d.to {
                Node::Lcore(_, _) => self.deliver_to_lcore(d.from, d.to, &d.bytes),
                Node::Worker(r) => self.deliver_to_worker(usize::from(r), &d.bytes),
            }
        }
        for l in 0..self.lcores.len() {
            self.lcores[l].shard.poll_timers(self.now);
            self.drain(l);
        }
        let now = self.at(self.now);
        let mut out = Vec::new();
        for i in 0..self.ranks.len() {
            if self.ranks[i]
                .t
                .poll_timeout()
                .is_some_and(|t| self.us(t) <= self.now)
            {
                self.ranks[i].t.handle_timeout(now);
            }
            while let Some(done) = self.ranks[i].t.poll_done() {
                self.on_done(i, done);
            }
            if self.ranks[i].ready_at.is_some_and(|t| t <= self.now) {
                self.submit_round(i);
            }
            out.clear();
            self.ranks[i].t.poll_transmit(now, &mut out);
            // Cast: ranks are u16.
            #[allow(clippy::cast_possible_truncation)]
            let from = Node::Worker(i as u16);
            for (to, bytes) in out.drain(..) {
                let Some(to) = Node::of(to) else {
                    panic!("rank {i} sent to {to}, which is no node of this network");
                };
                self.net.send(self.now, from, to, bytes);
            }
        }
    }

    /// The next instant something happens: a datagram arrives, a timer
    /// is due, a rank's gradient is ready.
    fn next_event(&self) -> Option<u64> {
        let timers = self
            .ranks
            .iter()
            .filter_map(|r| r.t.poll_timeout().map(|t| self.us(t)));
        let ready = self.ranks.iter().filter_map(|r| r.ready_at);
        self.net.next_at().into_iter().chain(timers).chain(ready).min()
    }

    fn deliver_to_lcore(&mut self, from: Node, to: Node, bytes: &[u8]) {
        let Some(l) = self.lcores.iter().position(|l| l.node == to) else {
            panic!("a datagram for {to:?}, which is no lcore of this run");
        };
        let lc = &mut self.lcores[l];
        lc.delivered += 1;
        let verdict = lc.shard.handle(from.addr(), bytes, self.now);
        let c = lc.shard.counters();
        assert_eq!(
            c.rx_packets.get(),
            lc.delivered,
            "lcore {l}: {} datagrams delivered, rx_packets says {}",
            lc.delivered,
            c.rx_packets.get()
        );
        match verdict {
            Verdict::Dropped(reason) => {
                let code = usize::from(reason.code());
                lc.drops[code] += 1;
                assert_eq!(
                    c.drops[code].get(),
                    lc.drops[code],
                    "lcore {l}: handle dropped {} datagrams as `{}`, its counter says {}",
                    lc.drops[code],
                    reason.name(),
                    c.drops[code].get()
                );
            }
            Verdict::Aggregated | Verdict::Completed => {
                let (repr, _) = wire::parse(bytes).expect("a datagram the engine aggregated parses");
                let fresh = self.applied.insert((repr.key, repr.chunk, repr.round, repr.rank));
                assert!(
                    fresh,
                    "lcore {l}: rank {}'s contribution to key {} chunk {} round {} applied twice",
                    repr.rank, repr.key, repr.chunk, repr.round
                );
            }
            Verdict::Resent | Verdict::Pulled | Verdict::Applied | Verdict::Held | Verdict::Forwarded => {}
        }
        let total: u64 = lc.drops.iter().sum();
        assert_eq!(
            c.drops_total(),
            total,
            "lcore {l}: drops counted {} but handle dropped {total}",
            c.drops_total()
        );
        self.drain(l);
    }

    /// Sends what lcore `l` queued, checking every RESULT against the reference.
    fn drain(&mut self, l: usize) {
        let lc = &mut self.lcores[l];
        let out: Vec<(std::net::SocketAddr, Vec<u8>)> = lc
            .shard
            .transmits()
            .flat_map(|t| {
                let mut b = t.header.to_vec();
                b.extend_from_slice(t.payload);
                t.to.map(move |to| (to, b.clone()))
            })
            .collect();
        lc.shard.clear_transmits();
        let from = lc.node;
        for (to, bytes) in out {
            self.check_result(l, &bytes);
            let Some(node) = Node::of(to) else {
                panic!("lcore {l} sent to {to}, which is no node of this network");
            };
            self.net.send(self.now, from, node, bytes);
        }
    }

    /// A RESULT leaving lcore `l` carries the reference's values for its
    /// key, chunk and round.
    fn check_result(&self, l: usize, bytes: &[u8]) {
        let Ok((repr, payload)) = wire::parse(bytes) else {
            panic!("lcore {l} sent a datagram that does not parse");
        };
        if repr.kind != MsgType::Result {
            return;
        }
        let mut v = vec![0f32; usize::from(repr.count)];
        decode(self.case.dtype, payload, &mut v);
        let start = repr.chunk as usize * self.lay.chunk_elems as usize;
        let want = &self.expect[repr.key as usize][repr.round as usize][start..start + v.len()];
        if let Some(i) = (0..v.len()).find(|&i| v[i].to_bits() != want[i].to_bits()) {
            panic!(
                "lcore {l}: RESULT of key {} chunk {} round {} has {} at element {i}, the reference {}",
                repr.key, repr.chunk, repr.round, v[i], want[i]
            );
        }
    }

    fn deliver_to_worker(&mut self, i: usize, bytes: &[u8]) {
        let now = self.at(self.now);
        let r = &mut self.ranks[i];
        r.received += 1;
        r.t.handle_datagram(now, bytes);
        let s = r.t.stats();
        let counted = s.results_accepted + s.results_ignored + s.foreign_dropped + s.errors;
        assert_eq!(
            counted, r.received,
            "rank {i}: {} datagrams received, {counted} accepted, ignored or dropped ({s:?})",
            r.received
        );
    }

    /// Rank `i`'s request for a key ended.
    fn on_done(&mut self, i: usize, done: phub_worker::sim::SimDone) {
        let round = self.ranks[i].round;
        let key = done.key;
        let (got_round, values) = match done.result {
            Ok(v) => v,
            Err(e) => panic!("rank {i}: key {key} round {round} failed: {e}"),
        };
        assert_eq!(got_round, round, "rank {i}: key {key} answered for another round");
        let want = &self.expect[key as usize][round as usize];
        if let Some(e) = (0..want.len()).find(|&e| values[e].to_bits() != want[e].to_bits()) {
            panic!(
                "rank {i}: key {key} round {round} element {e} is {}, the reference {}",
                values[e], want[e]
            );
        }
        let r = &mut self.ranks[i];
        r.waiting -= 1;
        if r.waiting > 0 {
            return;
        }
        if round == self.case.rounds {
            r.finished = true;
        } else {
            r.round += 1;
            r.ready_at = Some(self.now + self.rng.gen_range(0..=self.case.compute_us));
        }
    }

    fn finish(self) -> Outcome {
        let mut o = Outcome {
            net: self.net.stats,
            virtual_us: self.now,
            ..Outcome::default()
        };
        for (l, lc) in self.lcores.iter().enumerate() {
            let c = lc.shard.counters();
            assert_eq!(c.rx_packets.get(), lc.delivered, "lcore {l}");
            o.dropped += c.drops_total();
            o.results_resent += c.results_resent.get();
        }
        // Every contribution of every round was applied once.
        let chunks: usize = (0..self.case.keys.len())
            .map(|k| {
                #[allow(clippy::cast_possible_truncation)]
                let key = k as u32;
                self.placement.places(key).count()
            })
            .sum();
        let rounds = self.case.rounds as usize + 1;
        // Round 0 is one INIT per rank (rank 0's values, the others' empty).
        assert_eq!(
            self.applied.len(),
            chunks * rounds * usize::from(self.case.workers),
            "contributions applied"
        );
        for r in &self.ranks {
            o.retransmits += r.t.stats().retransmits;
            assert!(!r.t.busy(), "a finished rank has requests in flight");
        }
        o
    }
}

/// How many seeds a run of the suite does: `PHUB_SIM_SEEDS`, else `default`.
pub fn seeds(default: u64) -> u64 {
    std::env::var("PHUB_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Runs `f` for every seed of the suite (`first..first + seeds(default)`),
/// or only for `PHUB_SIM_SEED` when set; a failing seed panics with the
/// line that replays it.
pub fn for_seeds(first: u64, default: u64, test: &str, f: impl Fn(u64)) {
    let only = std::env::var("PHUB_SIM_SEED").ok().map(|s| {
        s.parse::<u64>()
            .unwrap_or_else(|_| panic!("PHUB_SIM_SEED={s}: expected a seed, a whole number"))
    });
    let list: Vec<u64> = match only {
        Some(s) => vec![s],
        None => (first..first + seeds(default)).collect(),
    };
    for seed in list {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(seed))).is_err() {
            panic!(
                "seed {seed} failed (above: what broke); replay it with \
                 PHUB_SIM_SEED={seed} cargo test -p phub-sim --test {test}"
            );
        }
    }
}
