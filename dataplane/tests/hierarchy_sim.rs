//! Hierarchical aggregation in the sans-IO engine (PROTOCOL.md §9), as a
//! seeded simulation: R rack appliances of two lcores each, the workers
//! spread over them, loss, duplicates and reordering on every hop (worker
//! to rack appliance, rack appliance to home and back), retransmission
//! timers on workers and rack slots. Every round's result every worker
//! receives is compared bit for bit with what one appliance computes from
//! the same contributions, and each rack appliance must have sent exactly
//! one first partial per chunk and round.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use phub_dataplane::kernels::{self, Kernels};
use phub_dataplane::mgmt::hierarchy_plan;
use phub_dataplane::{JobInstall, Shard};
use phub_proto::api::{DataAddr, Hierarchy, InstallJob, RackPeer};
use phub_proto::layout::{layout, Layout, Placement};
use phub_proto::spec::{JobSpec, Optimizer};
use phub_proto::wire::{self, DropReason, MsgType, Repr, HEADER_LEN};
use phub_proto::Dtype;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const TOKEN: u64 = 0x5eed;
const LCORES: usize = 2;
/// Simulated time step: 1 ms.
const TICK: u64 = 1_000_000;
/// A worker resends a chunk unanswered for this long.
const WORKER_RTO: u64 = 30 * TICK;

type Addr = SocketAddrV4;

fn appliance(rack: usize, lcore: usize) -> Addr {
    SocketAddrV4::new(Ipv4Addr::new(10, 0, rack as u8, 1), 9000 + lcore as u16)
}

fn worker_addr(rank: u16) -> Addr {
    SocketAddrV4::new(Ipv4Addr::new(10, 1, 0, rank as u8), 5000)
}

fn spec(workers: u32, racks: usize, dtype: &str, optimizer: &str) -> JobSpec {
    JobSpec::from_toml(&format!(
        r#"
name = "hier"
workers = {workers}
dtype = "{dtype}"
chunk_bytes = 64
[optimizer]
{optimizer}
[[keys]]
elements = 37
[[keys]]
elements = 100
[[keys]]
elements = 5
[placement]
appliances = {racks}
hierarchical = true
"#
    ))
    .unwrap()
}

/// A gradient element: small integers, so that every sum is exact in f32
/// (and bf16) whatever the order.
fn grad(rank: u16, round: u32, seq: u64, i: usize) -> f32 {
    ((u64::from(rank) * 7 + u64::from(round) * 3 + seq * 5 + i as u64) % 11) as f32 - 5.0
}

fn init(seq: u64, i: usize) -> f32 {
    ((seq * 13 + i as u64) % 17) as f32 * 0.25
}

/// The datagram rank `rank` sends for chunk `seq` (key, chunk, elems) in
/// `round`, to slot `slot`.
fn contribution(dtype: Dtype, rank: u16, round: u32, seq: u64, c: (u32, u32, u32), slot: u32) -> Vec<u8> {
    let (key, chunk, elems) = c;
    let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
    let values: Vec<f32> = match (round, rank) {
        (0, 0) => (0..elems as usize).map(|i| init(seq, i)).collect(),
        (0, _) => Vec::new(),
        _ => (0..elems as usize).map(|i| grad(rank, round, seq, i)).collect(),
    };
    let repr = Repr::request(kind, 1, TOKEN, rank, round, slot)
        .with_payload(dtype, values.len() as u16)
        .with_chunk(key, chunk);
    let mut b = vec![0u8; HEADER_LEN + dtype.size() * values.len()];
    repr.emit(&mut wire::Header::new_unchecked(&mut b[..]));
    kernels::encode(dtype, &values, &mut b[HEADER_LEN..]);
    b
}

/// What one appliance of one lcore answers, round by round, chunk by
/// chunk, to the same contributions: results[round][seq].
fn reference(spec: &JobSpec, rounds: u32) -> Vec<Vec<Vec<u8>>> {
    let whole = Placement::new(spec, layout(spec, &mut [0], |_| 1)).unwrap();
    let mut s: Shard<Addr> = Shard::new(0, Kernels::best());
    s.install(JobInstall {
        id: 1,
        token: TOKEN,
        workers: spec.workers as u16,
        dtype: spec.dtype,
        optimizer: spec.optimizer,
        consistency: Default::default(),
        chunk_elems: spec.chunk_elems(),
        slots: whole.slots(0).collect(),
    })
    .unwrap();
    let chunks: Vec<_> = whole.slots(0).collect();
    (0..=rounds)
        .map(|round| {
            let mut out = vec![Vec::new(); chunks.len()];
            for (seq, c) in chunks.iter().enumerate() {
                for rank in 0..spec.workers as u16 {
                    let d = contribution(
                        spec.dtype,
                        rank,
                        round,
                        seq as u64,
                        (c.key, c.chunk, c.elems),
                        seq as u32,
                    );
                    s.handle(worker_addr(rank), &d, 1);
                }
                for t in s.transmits() {
                    out[seq] = t.payload.to_vec();
                }
                s.clear_transmits();
            }
            out
        })
        .collect()
}

struct Net {
    rng: ChaCha8Rng,
    loss: f64,
    dup: f64,
    /// (deliver at, tie-break, to, from, datagram)
    queue: Vec<(u64, u64, Addr, Addr, Vec<u8>)>,
    spine_bytes: u64,
}

impl Net {
    fn send(&mut self, now: u64, from: Addr, to: Addr, d: &[u8]) {
        // Appliance-to-appliance traffic between racks crosses the spine.
        if from.port() >= 9000 && to.port() >= 9000 && from.ip() != to.ip() {
            self.spine_bytes += d.len() as u64;
        }
        if self.rng.gen_bool(self.loss) {
            return;
        }
        let copies = if self.rng.gen_bool(self.dup) { 2 } else { 1 };
        for _ in 0..copies {
            let at = now + TICK * self.rng.gen_range(1..=4);
            let tie = self.rng.gen();
            self.queue.push((at, tie, to, from, d.to_vec()));
        }
    }
}

struct Worker {
    rank: u16,
    rack: usize,
    round: u32,
    /// Per chunk: the result of the round in progress, when in.
    got: Vec<Option<Vec<u8>>>,
    sent_at: Vec<u64>,
    /// results[round][seq]
    results: Vec<Vec<Vec<u8>>>,
}

/// Runs one hierarchical job with `workers` workers over `racks` racks for
/// `rounds` rounds, and checks it against one appliance.
fn run(seed: u64, workers: u32, racks: usize, dtype: &str, optimizer: &str, rounds: u32) {
    let spec = spec(workers, racks, dtype, optimizer);
    let dtype = spec.dtype;
    let ranks = spec.rack_ranks().unwrap();
    // Each rack appliance's rack layout, and the home layout over all of
    // their lcores (byte balancing is admission's business; any valid
    // layout must do, so loads differ per rack).
    let rack_layouts: Vec<Layout> = (0..racks)
        .map(|r| {
            let mut load = vec![0; LCORES];
            load[0] = r as u64 * 40;
            layout(&spec, &mut load, |_| 1)
        })
        .collect();
    let homes = layout(&spec, &mut vec![0; racks * LCORES], |_| 1);
    let hierarchy = |rack: u16| Hierarchy {
        rack,
        racks: rack_layouts
            .iter()
            .enumerate()
            .map(|(r, l)| RackPeer {
                name: format!("a{r}"),
                data: DataAddr {
                    host: format!("10.0.{r}.1"),
                    base_port: 9000,
                },
                layout: l.clone(),
            })
            .collect(),
        homes: homes.clone(),
    };
    let resolve: phub_dataplane::engine::PeerResolver<Addr> = Arc::new(Some);
    let mut shards: Vec<Vec<Shard<Addr>>> = (0..racks)
        .map(|r| {
            let req = InstallJob {
                id: 1,
                token: TOKEN,
                spec: spec.clone(),
                layout: rack_layouts[r].clone(),
                hierarchy: Some(hierarchy(r as u16)),
            };
            let (_, per_lcore) = hierarchy_plan(&req, LCORES).unwrap();
            let placement = Placement::new(&spec, rack_layouts[r].clone()).unwrap();
            per_lcore
                .into_iter()
                .enumerate()
                .map(|(l, h)| {
                    let mut s = Shard::new(l as u16, Kernels::best());
                    s.set_peer_resolver(Arc::clone(&resolve));
                    s.install_hierarchical(
                        JobInstall {
                            id: 1,
                            token: TOKEN,
                            workers: spec.workers as u16,
                            dtype,
                            optimizer: Optimizer::Sum,
                            consistency: Default::default(),
                            chunk_elems: spec.chunk_elems(),
                            slots: placement.slots(l).collect(),
                        },
                        h,
                    )
                    .unwrap();
                    s
                })
                .collect()
        })
        .collect();
    let placements: Vec<Placement> = rack_layouts
        .iter()
        .map(|l| Placement::new(&spec, l.clone()).unwrap())
        .collect();
    let nchunks = placements[0].chunks().total() as usize;
    let chunk_of: Vec<(u32, u32, u32)> = (0..nchunks as u64)
        .map(|seq| {
            let c = placements[0].chunks().chunk(seq).unwrap();
            (c.key, c.chunk, c.elems)
        })
        .collect();
    let mut ws: Vec<Worker> = ranks
        .iter()
        .enumerate()
        .flat_map(|(r, rs)| rs.clone().map(move |rank| (r, rank)))
        .map(|(rack, rank)| Worker {
            rank,
            rack,
            round: 0,
            got: vec![None; nchunks],
            sent_at: vec![0; nchunks],
            results: Vec::new(),
        })
        .collect();
    let by_addr: HashMap<Addr, usize> = ws
        .iter()
        .enumerate()
        .map(|(i, w)| (worker_addr(w.rank), i))
        .collect();
    let mut net = Net {
        rng: ChaCha8Rng::seed_from_u64(seed),
        loss: 0.05,
        dup: 0.05,
        queue: Vec::new(),
        spine_bytes: 0,
    };
    let send_chunk = |net: &mut Net, w: &Worker, seq: usize, now: u64| {
        let place = placements[w.rack].place_of(seq as u64).unwrap();
        let d = contribution(dtype, w.rank, w.round, seq as u64, chunk_of[seq], place.slot);
        net.send(
            now,
            worker_addr(w.rank),
            appliance(w.rack, usize::from(place.lcore)),
            &d,
        );
    };
    let mut now = TICK;
    for w in &mut ws {
        for seq in 0..nchunks {
            send_chunk(&mut net, w, seq, now);
            w.sent_at[seq] = now;
        }
    }
    while ws.iter().any(|w| w.round <= rounds) {
        now += TICK;
        assert!(
            now < 100_000 * TICK,
            "seed {seed}: no progress; rounds {:?}",
            ws.iter().map(|w| w.round).collect::<Vec<_>>()
        );
        // Deliver what is due, in a random order among equals.
        net.queue.sort_by_key(|m| (m.0, m.1));
        let due = net.queue.partition_point(|m| m.0 <= now);
        let batch: Vec<_> = net.queue.drain(..due).collect();
        for (_, _, to, from, d) in batch {
            if to.port() >= 9000 {
                let rack = usize::from(to.ip().octets()[2]);
                let lcore = usize::from(to.port() - 9000);
                shards[rack][lcore].handle(from, &d, now);
            } else if let Some(&i) = by_addr.get(&to) {
                let w = &mut ws[i];
                let (repr, payload) = wire::parse(&d).unwrap();
                assert_eq!(
                    repr.kind,
                    MsgType::Result,
                    "seed {seed}: rank {} got {repr:?}",
                    w.rank
                );
                let seq = placements[w.rack].chunks().of_key(repr.key).start + u64::from(repr.chunk);
                if repr.round == w.round && w.round <= rounds {
                    w.got[seq as usize].get_or_insert_with(|| payload.to_vec());
                }
            }
        }
        for (r, rack) in shards.iter_mut().enumerate() {
            for (l, s) in rack.iter_mut().enumerate() {
                s.poll_timers(now);
                let from = appliance(r, l);
                let out: Vec<(Addr, Vec<u8>)> = s
                    .transmits()
                    .flat_map(|t| {
                        let mut d = t.header.to_vec();
                        d.extend_from_slice(t.payload);
                        t.to.map(move |to| (to, d.clone())).collect::<Vec<_>>()
                    })
                    .collect();
                s.clear_transmits();
                for (to, d) in out {
                    net.send(now, from, to, &d);
                }
            }
        }
        for w in &mut ws {
            if w.round > rounds {
                continue;
            }
            if w.got.iter().all(Option::is_some) {
                w.results
                    .push(w.got.iter_mut().map(|g| g.take().unwrap()).collect());
                w.round += 1;
                if w.round <= rounds {
                    for seq in 0..nchunks {
                        send_chunk(&mut net, w, seq, now);
                        w.sent_at[seq] = now;
                    }
                }
                continue;
            }
            for seq in 0..nchunks {
                if w.got[seq].is_none() && now - w.sent_at[seq] >= WORKER_RTO {
                    send_chunk(&mut net, w, seq, now);
                    w.sent_at[seq] = now;
                }
            }
        }
    }
    eprintln!(
        "seed {seed}: {} ms, spine {} B, {} results per worker",
        now / TICK,
        net.spine_bytes,
        ws[0].results.len()
    );
    let want = reference(&spec, rounds);
    for w in &ws {
        for (round, (got, want)) in w.results.iter().zip(&want).enumerate() {
            for (seq, (g, e)) in got.iter().zip(want).enumerate() {
                assert_eq!(
                    g, e,
                    "seed {seed}: rank {} round {round} chunk {seq}: not one appliance's result",
                    w.rank
                );
            }
        }
    }
    let total = |f: &dyn Fn(&Shard<Addr>) -> u64, r: usize| shards[r].iter().map(f).sum::<u64>();
    let first_partials = u64::from(rounds + 1) * nchunks as u64;
    let mut resent = 0;
    for r in 0..racks {
        assert_eq!(
            total(&|s| s.counters().partials_sent.get(), r),
            first_partials,
            "seed {seed}: rack {r} sends one first partial per chunk and round"
        );
        resent += total(&|s| s.counters().partials_resent.get(), r);
        assert_eq!(total(&|s| s.counters().drops_of(DropReason::WrongPeer), r), 0);
    }
    let optimizer_runs: u64 = (0..racks)
        .map(|r| total(&|s| s.counters().rounds_completed.get(), r))
        .sum();
    assert_eq!(
        optimizer_runs, first_partials,
        "seed {seed}: the optimizer runs once per chunk and round"
    );
    assert!(
        resent > 0,
        "seed {seed}: 5% loss on the spine made no partial go again"
    );
    // Up and down, each rack's chunks that are not at home: with loss and
    // retransmission, at least 2 (R - 1) / R of the chunks per round.
    let payload = nchunks as u64 * 16 * 4;
    assert!(net.spine_bytes >= u64::from(rounds) * payload * 2 * (racks as u64 - 1) / racks as u64 / 2);
}

#[test]
fn two_racks_f32_sum_under_loss_equal_one_appliance() {
    for seed in 0..3 {
        run(seed, 5, 2, "f32", "kind = \"sum\"", 12);
    }
}

#[test]
fn three_racks_optimizers_and_bf16_under_loss_equal_one_appliance() {
    run(11, 6, 3, "f32", "kind = \"sgd\"\nlr = 0.5", 10);
    run(12, 4, 3, "f32", "kind = \"adam\"\nlr = 0.01", 10);
    run(13, 7, 3, "bf16", "kind = \"sum\"", 10);
    run(14, 4, 2, "f32", "kind = \"mean\"", 10);
}
