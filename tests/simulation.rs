//! Seeded deterministic simulation of W workers training through the engine.
//!
//! Workers and lcore shards exchange real datagrams over a simulated network
//! that loses, duplicates and reorders both pushes and results. Workers keep
//! a bounded window of outstanding chunks and retransmit on a timeout. Every
//! result a worker accepts must equal, bit for bit, what a loss-free single
//! process computes with the same gradients; so must the final parameters.
//!
//! Gradients are small integers, so their f32 sums are exact in any order and
//! the comparison can be exact whatever order packets arrive in.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use phub::dataplane::kernels::{self, Kernels};
use phub::dataplane::optim::{self, ChunkBufs};
use phub::dataplane::{JobInstall, Shard};
use phub::proto::layout::{layout, Layout, Placement};
use phub::proto::spec::{Consistency, JobSpec, KeySpec, Optimizer};
use phub::proto::wire::{self, flags, MsgType, Repr, HEADER_LEN};
use phub::proto::Dtype;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const JOB: u16 = 7;
const TOKEN: u64 = 0x5eed_0f7e_57a1;

#[derive(Clone, Copy)]
struct Faults {
    loss: f64,
    dup: f64,
    /// Extra random delay (ticks) on top of one tick: reorders packets.
    jitter: u64,
}

struct Case {
    seed: u64,
    workers: u16,
    lcores: usize,
    keys: Vec<u64>,
    dtype: Dtype,
    chunk_bytes: u32,
    optimizer: Optimizer,
    rounds: u32,
    window: usize,
    faults: Faults,
    /// Randomly drawn case: too small to be sure every fault happens.
    random: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    Lcore(usize),
    Worker(u16),
}

/// (delivery tick, sequence, destination, sender rank, datagram).
type InFlight = (u64, u64, Node, u16, Vec<u8>);

struct Net {
    rng: ChaCha8Rng,
    faults: Faults,
    seq: u64,
    queue: BinaryHeap<Reverse<InFlight>>,
    sent: u64,
    lost: u64,
}

impl Net {
    fn send(&mut self, now: u64, from: u16, to: Node, bytes: Vec<u8>) {
        self.sent += 1;
        if self.rng.gen_bool(self.faults.loss) {
            self.lost += 1;
            return;
        }
        let copies = if self.rng.gen_bool(self.faults.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let at = now + 1 + self.rng.gen_range(0..=self.faults.jitter);
            self.seq += 1;
            self.queue.push(Reverse((at, self.seq, to, from, bytes.clone())));
        }
    }
}

/// Deterministic integer gradient in [-8, 8].
fn grad(rank: u16, key: usize, elem: u64, round: u32) -> f32 {
    let mut h = (u64::from(rank) << 48) ^ ((key as u64) << 32) ^ (elem << 8) ^ u64::from(round);
    h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^= h >> 29;
    ((h % 17) as i64 - 8) as f32
}

/// Rounds `v` through the wire type, as the appliance sees what is sent.
fn through_wire(dtype: Dtype, v: &[f32]) -> Vec<f32> {
    let mut bytes = vec![0u8; v.len() * dtype.size()];
    kernels::encode(dtype, v, &mut bytes);
    let mut out = vec![0f32; v.len()];
    kernels::decode(dtype, &bytes, &mut out);
    out
}

/// What one loss-free process computes: the result of every round of every
/// key, as the workers must receive it (decoded from the wire type).
fn reference(case: &Case, init: &[Vec<f32>]) -> Vec<Vec<Vec<f32>>> {
    let opt = &case.optimizer;
    let mut out = Vec::new();
    for (k, &n) in case.keys.iter().enumerate() {
        let n = n as usize;
        let mut params = through_wire(case.dtype, &init[k]);
        let (mut s1, mut s2) = (vec![0f32; n], vec![0f32; n]);
        let mut rounds = vec![params.clone()];
        for r in 1..=case.rounds {
            let mut acc = vec![0f32; n];
            for rank in 0..case.workers {
                let g: Vec<f32> = (0..n).map(|e| grad(rank, k, e as u64, r)).collect();
                for (a, x) in acc.iter_mut().zip(through_wire(case.dtype, &g)) {
                    *a += x;
                }
            }
            // The engine steps chunk by chunk; the passes are element-wise,
            // so one step over the whole key is the same arithmetic.
            let keeps = opt.keeps_params();
            let (ns1, ns2) = match opt.state_buffers() {
                0 => (0, 0),
                1 => (n, 0),
                _ => (n, n),
            };
            let mut empty: Vec<f32> = Vec::new();
            optim::step(
                opt,
                u32::from(case.workers),
                r,
                ChunkBufs {
                    acc: &mut acc,
                    params: if keeps { &mut params } else { &mut empty },
                    s1: &mut s1[..ns1],
                    s2: &mut s2[..ns2],
                },
            );
            let res = if keeps { params.clone() } else { acc };
            rounds.push(through_wire(case.dtype, &res));
        }
        out.push(rounds);
    }
    out
}

struct Worker {
    rank: u16,
    round: u32,
    /// Chunks (key, chunk) still to send for `round`.
    todo: VecDeque<(usize, u32)>,
    /// Outstanding (key, chunk, last send tick, retries).
    outstanding: Vec<(usize, u32, u64, u32)>,
    /// Chunks with a result for `round`.
    done: usize,
    params: Vec<Vec<f32>>,
    finished: bool,
}

fn run(case: &Case) {
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
    spec.validate().unwrap();
    let mut load = vec![0; case.lcores];
    let lay: Layout = layout(&spec, &mut load, u64::from);
    let placement = Placement::new(&spec, lay.clone()).unwrap();
    let mut shards: Vec<Shard<u16>> = (0..case.lcores)
        .map(|i| {
            let kernels = Kernels::available()[i % Kernels::available().len()];
            let mut s = Shard::new(i as u16, kernels);
            s.install(JobInstall {
                id: JOB,
                token: TOKEN,
                workers: case.workers,
                dtype: case.dtype,
                optimizer: case.optimizer,
                consistency: Default::default(),
                chunk_elems: lay.chunk_elems,
                slots: placement.slots(i).collect(),
            })
            .unwrap();
            s
        })
        .collect();

    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let init: Vec<Vec<f32>> = case
        .keys
        .iter()
        .map(|&n| (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect())
        .collect();
    let expect = reference(case, &init);
    let all_chunks: Vec<(usize, u32)> = (0..case.keys.len())
        .flat_map(|k| (0..placement.places(k as u32).count() as u32).map(move |c| (k, c)))
        .collect();
    let mut workers: Vec<Worker> = (0..case.workers)
        .map(|rank| Worker {
            rank,
            round: 0,
            todo: all_chunks.iter().copied().collect(),
            outstanding: Vec::new(),
            done: 0,
            params: case.keys.iter().map(|&n| vec![f32::NAN; n as usize]).collect(),
            finished: false,
        })
        .collect();
    let mut net = Net {
        rng: ChaCha8Rng::seed_from_u64(case.seed ^ 0xfa17),
        faults: case.faults,
        seq: 0,
        queue: BinaryHeap::new(),
        sent: 0,
        lost: 0,
    };
    let rto = 4 + 2 * case.faults.jitter;
    let mut now = 0u64;
    let mut resends = 0u64;
    let deadline = 200_000;

    let push_bytes = |w: &Worker, k: usize, c: u32, retransmit: bool| -> (usize, Vec<u8>) {
        let place = placement.place(k as u32, c).unwrap();
        let elems = lay.chunk_len(case.keys[k], c);
        let start = u64::from(c) * u64::from(lay.chunk_elems);
        let carries = w.round > 0 || w.rank == 0;
        let count = if carries { elems } else { 0 };
        let values: Vec<f32> = if w.round == 0 {
            init[k][start as usize..(start + u64::from(count)) as usize].to_vec()
        } else {
            (0..u64::from(count))
                .map(|e| grad(w.rank, k, start + e, w.round))
                .collect()
        };
        let repr = Repr::request(
            if w.round == 0 {
                MsgType::Init
            } else {
                MsgType::Push
            },
            JOB,
            TOKEN,
            w.rank,
            w.round,
            place.slot,
        )
        .with_payload(case.dtype, count as u16)
        .with_chunk(k as u32, c)
        .with_flags(if retransmit { flags::RETRANSMIT } else { 0 });
        let mut b = vec![0u8; HEADER_LEN + values.len() * case.dtype.size()];
        repr.emit(&mut wire::Header::new_unchecked(&mut b[..]));
        kernels::encode(case.dtype, &values, &mut b[HEADER_LEN..]);
        (usize::from(place.lcore), b)
    };

    while workers.iter().any(|w| !w.finished) {
        assert!(
            now < deadline,
            "simulation did not finish by tick {deadline}: a hang"
        );
        // Deliver everything due now.
        while let Some(Reverse((at, ..))) = net.queue.peek() {
            if *at > now {
                break;
            }
            let Reverse((_, _, to, from, bytes)) = net.queue.pop().unwrap();
            match to {
                Node::Lcore(l) => {
                    shards[l].handle(from, &bytes, now);
                    let out: Vec<(u16, Vec<u8>)> = shards[l]
                        .transmits()
                        .flat_map(|t| {
                            let mut b = t.header.to_vec();
                            b.extend_from_slice(t.payload);
                            t.to.map(move |rank| (rank, b.clone()))
                        })
                        .collect();
                    shards[l].clear_transmits();
                    for (rank, b) in out {
                        net.send(now, u16::MAX, Node::Worker(rank), b);
                    }
                }
                Node::Worker(rank) => {
                    let w = &mut workers[usize::from(rank)];
                    let (repr, payload) = wire::parse(&bytes).expect("appliance sends valid datagrams");
                    assert_eq!(repr.kind, MsgType::Result, "unexpected {:?}", repr);
                    assert_eq!(repr.token, TOKEN);
                    let (k, c) = (repr.key as usize, repr.chunk);
                    let Some(pos) = w
                        .outstanding
                        .iter()
                        .position(|o| (o.0, o.1) == (k, c) && repr.round == w.round)
                    else {
                        continue; // duplicate or for another round: ignored
                    };
                    w.outstanding.swap_remove(pos);
                    let mut vals = vec![0f32; usize::from(repr.count)];
                    kernels::decode(case.dtype, payload, &mut vals);
                    let start = (u64::from(c) * u64::from(lay.chunk_elems)) as usize;
                    let want = &expect[k][w.round as usize][start..start + vals.len()];
                    for (i, (g, e)) in vals.iter().zip(want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            e.to_bits(),
                            "{}/{}: rank {rank} round {} key {k} chunk {c} elem {i}: got {g}, reference {e}",
                            case.optimizer.name(),
                            case.dtype,
                            w.round
                        );
                    }
                    w.params[k][start..start + vals.len()].copy_from_slice(&vals);
                    w.done += 1;
                    if w.done == all_chunks.len() {
                        if w.round == case.rounds {
                            w.finished = true;
                        } else {
                            w.round += 1;
                            w.done = 0;
                            w.todo = all_chunks.iter().copied().collect();
                        }
                    }
                }
            }
        }
        // Workers: retransmit what timed out, then fill the window.
        for w in workers.iter_mut().filter(|w| !w.finished) {
            for i in 0..w.outstanding.len() {
                let (k, c, at, tries) = w.outstanding[i];
                if now >= at + (rto << tries.min(4)) {
                    let (l, b) = push_bytes(w, k, c, true);
                    net.send(now, w.rank, Node::Lcore(l), b);
                    w.outstanding[i] = (k, c, now, tries + 1);
                    resends += 1;
                }
            }
            while w.outstanding.len() < case.window {
                let Some((k, c)) = w.todo.pop_front() else { break };
                let (l, b) = push_bytes(w, k, c, false);
                net.send(now, w.rank, Node::Lcore(l), b);
                w.outstanding.push((k, c, now, 0));
            }
        }
        now += 1;
    }

    for w in &workers {
        for (k, p) in w.params.iter().enumerate() {
            let want = &expect[k][case.rounds as usize];
            assert!(
                p.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {} key {k}: final parameters differ from the reference",
                w.rank
            );
        }
    }
    let drops: u64 = shards.iter().map(|s| s.counters().drops_total()).sum();
    let resent: u64 = shards.iter().map(|s| s.counters().results_resent.get()).sum();
    if net.lost > 0 {
        assert!(resends > 0, "packets were lost but nothing was retransmitted");
    }
    if case.faults.loss >= 0.05 && !case.random {
        // Fixed cases are big enough that every mechanism must have run.
        assert!(net.lost > 0, "faults were asked for but none happened");
        assert!(resent > 0, "no result was ever re-obtained");
        assert!(drops > 0, "no duplicate was ever dropped");
    }
    // The engine's own view agrees with what the workers hold.
    if case.optimizer.keeps_params() {
        for (k, rounds) in expect.iter().enumerate() {
            for (c, p) in placement.places(k as u32).enumerate() {
                let params = shards[usize::from(p.lcore)].params(JOB, p.slot).unwrap();
                let start = c * lay.chunk_elems as usize;
                let want = &rounds[case.rounds as usize][start..start + params.len()];
                if case.dtype == Dtype::F32 {
                    assert_eq!(params, want);
                }
            }
        }
    }
}

fn optimizers() -> Vec<Optimizer> {
    vec![
        Optimizer::Sum,
        Optimizer::Mean,
        Optimizer::Sgd {
            lr: 0.01,
            weight_decay: 1e-3,
        },
        Optimizer::Momentum {
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 1e-3,
        },
        Optimizer::Nesterov {
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 1e-3,
        },
        Optimizer::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-4,
        },
        Optimizer::Adamw {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        },
    ]
}

#[test]
fn every_optimizer_and_dtype_survives_loss_duplication_and_reordering() {
    let faults = Faults {
        loss: 0.1,
        dup: 0.05,
        jitter: 6,
    };
    let mut seed = 1;
    for optimizer in optimizers() {
        for dtype in Dtype::ALL {
            seed += 1;
            run(&Case {
                seed,
                workers: 5,
                lcores: 3,
                keys: vec![1, 700, 33, 256],
                dtype,
                chunk_bytes: 128,
                optimizer,
                rounds: 6,
                window: 8,
                faults,
                random: false,
            });
        }
    }
}

#[test]
fn sixty_four_workers_with_heavy_loss() {
    for (seed, optimizer) in optimizers().into_iter().enumerate() {
        run(&Case {
            seed: 100 + seed as u64,
            workers: 64,
            lcores: 4,
            keys: vec![300, 5],
            dtype: Dtype::F32,
            chunk_bytes: 256,
            optimizer,
            rounds: 4,
            window: 4,
            faults: Faults {
                loss: 0.2,
                dup: 0.1,
                jitter: 10,
            },
            random: false,
        });
    }
}

#[test]
fn one_worker_no_faults_and_worker_counts_in_between() {
    for (i, workers) in [1u16, 2, 3, 17, 33].into_iter().enumerate() {
        run(&Case {
            seed: 200 + i as u64,
            workers,
            lcores: 2,
            keys: vec![1000, 1],
            dtype: Dtype::ALL[i % 3],
            chunk_bytes: 512,
            optimizer: optimizers()[i % 7],
            rounds: 5,
            window: 16,
            faults: Faults {
                loss: if workers == 1 { 0.0 } else { 0.05 },
                dup: if workers == 1 { 0.0 } else { 0.02 },
                jitter: if workers == 1 { 0 } else { 3 },
            },
            random: false,
        });
    }
}

#[test]
fn many_seeds_small_job() {
    for seed in 0..40 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let opts = optimizers();
        run(&Case {
            seed: 1000 + seed,
            workers: rng.gen_range(1..=12),
            lcores: rng.gen_range(1..=4),
            keys: (0..rng.gen_range(1..5)).map(|_| rng.gen_range(1..200)).collect(),
            dtype: Dtype::ALL[rng.gen_range(0..3)],
            chunk_bytes: 64 * rng.gen_range(1..4),
            optimizer: opts[rng.gen_range(0..opts.len())],
            rounds: rng.gen_range(1..5),
            window: rng.gen_range(1..10),
            faults: Faults {
                loss: rng.gen_range(0.0..0.3),
                dup: rng.gen_range(0.0..0.2),
                jitter: rng.gen_range(0..12),
            },
            random: true,
        });
    }
}
