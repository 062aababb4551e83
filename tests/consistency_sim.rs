//! Seeded deterministic simulation of the async and bounded-delay modes
//! (PROTOCOL.md §5.8): many ranks of unequal speed push every chunk clock
//! after clock through lcore shards over a network that loses, duplicates,
//! delays and reorders datagrams both ways; workers retransmit on a timer.
//!
//! What the engine does is judged from outside it: a push counts as applied
//! when `handle` says so for that datagram (its rank, chunk and clock), and
//! every RESULT that leaves is checked against that record as it leaves:
//! - no (rank, chunk, clock) is applied twice, and a rank's clocks are
//!   applied in order, one by one;
//! - bounded delay τ: no answer for clock c leaves while some rank's applied
//!   clock on the chunk is below c − τ, so no rank is ever more than τ + 1
//!   clocks ahead of the slowest (the largest lead seen is asserted);
//! - every RESULT carries exactly the values of the pushes applied so far
//!   (`sum`: initial + the pushed integers; SGD: initial − lr × them, all
//!   dyadic, so exact in any order), in the job's dtype;
//! - τ = 0 with SGD: every rank's answer for clock c (but the answer to a
//!   duplicate, which carries the values current then) is BSP `sum` of
//!   clock c's gradients followed by `w -= lr * sum`, bit for bit.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use phub::dataplane::kernels::{self, Kernels};
use phub::dataplane::{JobInstall, Shard, Verdict};
use phub::proto::layout::{layout, Placement};
use phub::proto::spec::{Consistency, JobSpec, Optimizer};
use phub::proto::wire::{self, flags, MsgType, Repr, HEADER_LEN};
use phub::proto::Dtype;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const JOB: u16 = 9;
const TOKEN: u64 = 0xc10c_5eed;

#[derive(Clone, Copy)]
struct Faults {
    loss: f64,
    dup: f64,
    /// Extra random delay (ticks) on top of one tick: reorders packets.
    jitter: u64,
}

#[derive(Clone)]
struct Case {
    seed: u64,
    workers: u16,
    lcores: usize,
    chunks: u32,
    elems: u32,
    dtype: Dtype,
    optimizer: Optimizer,
    consistency: Consistency,
    clocks: u32,
    faults: Faults,
}

/// (delivery tick, sequence, to an lcore (Some) or a rank (None), the
/// sending rank or, for a RESULT, the rank it goes to, datagram).
type InFlight = (u64, u64, Option<usize>, u16, Vec<u8>);

struct Net {
    rng: ChaCha8Rng,
    faults: Faults,
    seq: u64,
    queue: BinaryHeap<Reverse<InFlight>>,
}

impl Net {
    fn send(&mut self, now: u64, from: u16, to: Option<usize>, bytes: Vec<u8>) {
        if self.rng.gen_bool(self.faults.loss) {
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
fn grad(rank: u16, chunk: u32, elem: u32, clock: u32) -> f32 {
    let mut h =
        (u64::from(rank) << 48) ^ (u64::from(chunk) << 32) ^ (u64::from(elem) << 20) ^ u64::from(clock);
    h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^= h >> 29;
    ((h % 17) as i64 - 8) as f32
}

fn initial(chunk: u32, elem: u32) -> f32 {
    ((chunk * 7 + elem * 3) % 11) as f32 - 5.0
}

fn through_wire(dtype: Dtype, v: &[f32]) -> Vec<f32> {
    let mut bytes = vec![0u8; v.len() * dtype.size()];
    kernels::encode(dtype, v, &mut bytes);
    let mut out = vec![0f32; v.len()];
    kernels::decode(dtype, &bytes, &mut out);
    out
}

/// One rank's view of one chunk.
#[derive(Clone, Copy)]
struct Lane {
    /// Last clock answered (None before round 0's answer).
    answered: Option<u32>,
    /// The clock in flight: (clock, last sent, tries).
    out: Option<(u32, u64, u32)>,
    /// When the next clock's gradient is ready (emulated compute).
    ready_at: u64,
}

/// What the observer knows of one chunk.
struct Model {
    /// Per rank, its last applied clock (0 after round 0).
    applied: Vec<u32>,
    /// The chunk's values as the applied pushes make them (exact).
    values: Vec<f32>,
    initialized: bool,
}

struct Outcome {
    operations: u64,
    max_lead: u32,
    held: u64,
    duplicates_answered: u64,
}

fn run(case: &Case) -> Outcome {
    let tau = match case.consistency {
        Consistency::Bounded { delay } => Some(delay),
        _ => None,
    };
    let spec = JobSpec::from_toml(&format!(
        "name = \"sim\"\nworkers = {}\ndtype = \"{}\"\nchunk_bytes = {}\n\
         [optimizer]\nkind = \"sum\"\n[[keys]]\nelements = {}\n",
        case.workers,
        case.dtype,
        case.elems as usize * case.dtype.size(),
        u64::from(case.chunks) * u64::from(case.elems),
    ))
    .unwrap();
    let spec = JobSpec {
        optimizer: case.optimizer,
        consistency: case.consistency,
        ..spec
    };
    spec.validate().unwrap();
    let mut load = vec![0; case.lcores];
    let lay = layout(&spec, &mut load, u64::from);
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
                consistency: case.consistency,
                chunk_elems: lay.chunk_elems,
                slots: placement.slots(i).collect(),
            })
            .unwrap();
            s
        })
        .collect();
    let lr = match case.optimizer {
        Optimizer::Sgd { lr, weight_decay } => {
            assert_eq!(weight_decay, 0.0);
            Some(lr)
        }
        Optimizer::Sum => None,
        o => panic!("the model covers sum and sgd, not {}", o.name()),
    };
    let w = usize::from(case.workers);
    let n = case.elems as usize;
    let mut models: Vec<Model> = (0..case.chunks)
        .map(|c| Model {
            applied: vec![0; w],
            values: (0..case.elems).map(|e| initial(c, e)).collect(),
            initialized: false,
        })
        .collect();
    // τ = 0 with SGD: BSP sum then SGD, clock by clock.
    let bsp: Option<Vec<Vec<Vec<f32>>>> = (tau == Some(0)).then(|| {
        let lr = lr.expect("τ = 0 is checked against SGD");
        (0..case.chunks)
            .map(|c| {
                let mut wts: Vec<f32> = (0..case.elems).map(|e| initial(c, e)).collect();
                let mut per = vec![wts.clone()];
                for k in 1..=case.clocks {
                    for (e, x) in wts.iter_mut().enumerate() {
                        let sum: f32 = (0..case.workers).map(|r| grad(r, c, e as u32, k)).sum();
                        *x -= lr * sum;
                    }
                    per.push(wts.clone());
                }
                per
            })
            .collect()
    });

    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    // Unequal ranks: rank 0 is three times slower than the rest.
    let base: Vec<u64> = (0..case.workers).map(|r| if r == 0 { 9 } else { 3 }).collect();
    let mut lanes = vec![
        vec![
            Lane {
                answered: None,
                out: None,
                ready_at: 0,
            };
            case.chunks as usize
        ];
        w
    ];
    let mut net = Net {
        rng: ChaCha8Rng::seed_from_u64(case.seed ^ 0xfa17),
        faults: case.faults,
        seq: 0,
        queue: BinaryHeap::new(),
    };
    let rto = 6 + 2 * case.faults.jitter;
    let mut out = Outcome {
        operations: 0,
        max_lead: 0,
        held: 0,
        duplicates_answered: 0,
    };
    let datagram = |rank: u16, chunk: u32, clock: u32, retransmit: bool| -> (usize, Vec<u8>) {
        let place = placement.place(0, chunk).unwrap();
        let values: Vec<f32> = if clock == 0 {
            if rank == 0 {
                (0..case.elems).map(|e| initial(chunk, e)).collect()
            } else {
                Vec::new()
            }
        } else {
            (0..case.elems).map(|e| grad(rank, chunk, e, clock)).collect()
        };
        let kind = if clock == 0 { MsgType::Init } else { MsgType::Push };
        let repr = Repr::request(kind, JOB, TOKEN, rank, clock, place.slot)
            .with_payload(case.dtype, values.len() as u16)
            .with_chunk(0, chunk)
            .with_flags(if retransmit { flags::RETRANSMIT } else { 0 });
        let mut b = vec![0u8; HEADER_LEN + values.len() * case.dtype.size()];
        repr.emit(&mut wire::Header::new_unchecked(&mut b[..]));
        kernels::encode(case.dtype, &values, &mut b[HEADER_LEN..]);
        (usize::from(place.lcore), b)
    };
    let mut now = 0u64;
    let deadline = 2_000_000;
    let total = u64::from(case.chunks) * w as u64;
    let mut finished = 0u64;
    while finished < total {
        assert!(now < deadline, "not finished by tick {deadline}: a hang");
        while let Some(Reverse((at, ..))) = net.queue.peek() {
            if *at > now {
                break;
            }
            let Reverse((_, _, to, from, bytes)) = net.queue.pop().unwrap();
            if let Some(l) = to {
                out.operations += 1;
                let verdict = shards[l].handle(from, &bytes, now);
                let (repr, _) = wire::parse(&bytes).unwrap();
                let m = &mut models[repr.chunk as usize];
                match verdict {
                    Verdict::Applied | Verdict::Held => {
                        let r = usize::from(repr.rank);
                        assert_eq!(
                            repr.round,
                            m.applied[r] + 1,
                            "rank {r} chunk {}: clock {} applied after clock {} (twice, or out of order)",
                            repr.chunk,
                            repr.round,
                            m.applied[r]
                        );
                        m.applied[r] = repr.round;
                        let mut g = vec![0f32; n];
                        kernels::decode(case.dtype, &bytes[HEADER_LEN..], &mut g);
                        for (v, g) in m.values.iter_mut().zip(&g) {
                            match lr {
                                Some(lr) => *v -= lr * g,
                                None => *v += g,
                            }
                        }
                        if let Some(tau) = tau {
                            let lo = *m.applied.iter().min().unwrap();
                            let hi = *m.applied.iter().max().unwrap();
                            assert!(
                                hi - lo <= tau + 1,
                                "chunk {}: applied clocks {lo}..{hi}, more than τ + 1 = {} apart",
                                repr.chunk,
                                tau + 1
                            );
                        }
                        if verdict == Verdict::Held {
                            out.held += 1;
                        }
                    }
                    Verdict::Completed => m.initialized = true,
                    Verdict::Resent if repr.round > 0 => out.duplicates_answered += 1,
                    _ => {}
                }
                let sent: Vec<(u16, Vec<u8>)> = shards[l]
                    .transmits()
                    .flat_map(|t| {
                        let mut b = t.header.to_vec();
                        b.extend_from_slice(t.payload);
                        t.to.map(move |rank| (rank, b.clone()))
                    })
                    .collect();
                shards[l].clear_transmits();
                for (rank, b) in sent {
                    let (repr, payload) = wire::parse(&b).unwrap();
                    assert_eq!(repr.kind, MsgType::Result, "{repr:?}");
                    let m = &models[repr.chunk as usize];
                    let c = repr.round;
                    if c > 0 {
                        let lo = *m.applied.iter().min().unwrap();
                        let lead = (c + 1).saturating_sub(lo);
                        out.max_lead = out.max_lead.max(lead);
                        if let Some(tau) = tau {
                            assert!(
                                c <= lo + tau,
                                "rank {rank} chunk {}: the answer to clock {c} left with the slowest at {lo} (τ = {tau})",
                                repr.chunk
                            );
                        }
                    }
                    let mut v = vec![0f32; n];
                    kernels::decode(case.dtype, payload, &mut v);
                    assert_eq!(
                        v,
                        through_wire(case.dtype, &m.values),
                        "rank {rank} chunk {} clock {c}: the values are not those of the pushes applied",
                        repr.chunk
                    );
                    // A duplicate's answer carries the values current
                    // now, which may hold later clocks' pushes (§5.8).
                    if let (Some(bsp), true) = (&bsp, c > 0 && verdict != Verdict::Resent) {
                        assert_eq!(
                            v,
                            through_wire(case.dtype, &bsp[repr.chunk as usize][c as usize]),
                            "τ = 0: clock {c} differs from BSP sum then SGD"
                        );
                    }
                    net.send(now, rank, None, b);
                }
            } else {
                // A rank takes a RESULT for the clock it waits for.
                let rank = from;
                let (repr, _) = wire::parse(&bytes).unwrap();
                let lane = &mut lanes[usize::from(rank)][repr.chunk as usize];
                let Some((c, ..)) = lane.out else { continue };
                if repr.round != c {
                    continue;
                }
                lane.out = None;
                lane.answered = Some(c);
                if c == case.clocks {
                    finished += 1;
                } else {
                    lane.ready_at = now + base[usize::from(rank)] + rng.gen_range(0..4);
                }
            }
        }
        // Workers: retransmit what timed out, push what is ready.
        for r in 0..case.workers {
            for ch in 0..case.chunks {
                let lane = &mut lanes[usize::from(r)][ch as usize];
                match (lane.out, lane.answered) {
                    (Some((c, at, tries)), _) => {
                        if now >= at + (rto << tries.min(6)) {
                            let (l, b) = datagram(r, ch, c, true);
                            net.send(now, r, Some(l), b);
                            lane.out = Some((c, now, tries + 1));
                        }
                    }
                    (None, Some(c)) if c == case.clocks => {}
                    (None, answered) => {
                        if now >= lane.ready_at {
                            let c = answered.map_or(0, |c| c + 1);
                            let (l, b) = datagram(r, ch, c, false);
                            net.send(now, r, Some(l), b);
                            lane.out = Some((c, now, 0));
                        }
                    }
                }
            }
        }
        now += 1;
    }
    // The engine's stored values are the model's.
    for (ch, m) in models.iter().enumerate() {
        assert!(m.initialized);
        assert!(m.applied.iter().all(|&a| a == case.clocks));
        let p = placement.place(0, ch as u32).unwrap();
        let (_, bytes) = shards[usize::from(p.lcore)].result(JOB, p.slot).unwrap();
        let mut v = vec![0f32; n];
        kernels::decode(case.dtype, bytes, &mut v);
        assert_eq!(v, through_wire(case.dtype, &m.values), "chunk {ch} at the end");
    }
    out
}

fn faults() -> Faults {
    Faults {
        loss: 0.05,
        dup: 0.05,
        jitter: 8,
    }
}

fn case(seed: u64, consistency: Consistency, optimizer: Optimizer, dtype: Dtype) -> Case {
    Case {
        seed,
        workers: 16,
        lcores: 3,
        chunks: 48,
        elems: 32,
        dtype,
        optimizer,
        consistency,
        clocks: 150,
        faults: faults(),
    }
}

const SGD: Optimizer = Optimizer::Sgd {
    lr: 0.25,
    weight_decay: 0.0,
};

/// Runs the cases, returning the operations (datagrams handled) in all.
fn run_all(cases: &[Case]) -> u64 {
    let mut ops = 0;
    for c in cases {
        let o = run(c);
        if let Some(tau) = c.consistency.delay() {
            assert!(o.max_lead <= tau + 1, "lead {} with τ = {tau}", o.max_lead);
            assert!(o.held > 0, "τ = {tau}: no answer was ever held");
        }
        assert!(o.duplicates_answered > 0, "no duplicate was ever answered");
        eprintln!(
            "{} {} {}: {} operations, largest lead {}, {} held",
            c.consistency,
            c.optimizer.name(),
            c.dtype,
            o.operations,
            o.max_lead,
            o.held
        );
        ops += o.operations;
    }
    ops
}

#[test]
fn async_applies_each_rank_clock_once_and_sums_exactly() {
    let ops = run_all(&[
        case(1, Consistency::Async, Optimizer::Sum, Dtype::F32),
        case(2, Consistency::Async, Optimizer::Sum, Dtype::Bf16),
        case(3, Consistency::Async, SGD, Dtype::F32),
    ]);
    eprintln!("async: {ops} operations");
    // Over a million datagrams handled by the three tests together.
    assert!(ops >= 330_000, "{ops} operations");
}

#[test]
fn bounded_delay_never_lets_a_rank_more_than_tau_plus_one_ahead() {
    let ops = run_all(&[
        case(11, Consistency::Bounded { delay: 1 }, Optimizer::Sum, Dtype::F32),
        case(12, Consistency::Bounded { delay: 2 }, Optimizer::Sum, Dtype::F16),
        case(13, Consistency::Bounded { delay: 4 }, SGD, Dtype::F32),
        case(14, Consistency::Bounded { delay: 8 }, Optimizer::Sum, Dtype::F32),
    ]);
    eprintln!("bounded delay: {ops} operations");
    // Over a million datagrams handled by the three tests together.
    assert!(ops >= 440_000, "{ops} operations");
}

#[test]
fn tau_zero_sgd_is_bsp_sum_then_sgd() {
    let ops = run_all(&[
        case(21, Consistency::Bounded { delay: 0 }, SGD, Dtype::F32),
        case(22, Consistency::Bounded { delay: 0 }, SGD, Dtype::Bf16),
    ]);
    eprintln!("τ = 0: {ops} operations");
    // Over a million datagrams handled by the three tests together.
    assert!(ops >= 220_000, "{ops} operations");
}
