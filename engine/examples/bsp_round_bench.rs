//! Nanoseconds per pushed row of one lcore's BSP table rounds (issue 32):
//! the engine's whole path for a round (parse, placement check, the
//! round's accumulator, the store's update of each distinct row, every
//! rank's ROW_RESULTs built), in one thread, no sockets. It isolates the
//! lcore's share of `phub-bench sparse --local --consistency bsp`, whose
//! end-to-end figures on a 2-vCPU host move by 10-20% from run to run.
//!
//! `cargo run --release -p phub-engine --example bsp_round_bench [-- ROUNDS [FILL]]`
//!
//! The workload is `phub-bench sparse --local`'s: W = 4 ranks, each
//! drawing 4096 ids a step from a Zipf law of exponent 1.05 over 10^6 rows
//! (ids hashed from the ranks as that bench hashes them), D = 16, `f32`,
//! element-wise Adagrad, chunk_bytes 8192 (R = 113). This lcore is entry 0
//! of 2: each rank's ids placed on it, distinct and sorted, cut into
//! ROW_PUSHes of R rows, then its ROW_END, as phub-worker plans them; the
//! ranks' messages interleaved (one message of each rank in turn). The
//! store is first filled with every row the rounds draw (rounds of FILL
//! rows per rank, default 8 ROW_PUSHes' worth, untimed), then ROUNDS rounds (default 200) are
//! timed, five times over (new draws each time), each round's datagrams
//! built just before it is handled (warm in the caches, as a socket's
//! receive copy leaves them) and only its handling timed; the figure is
//! the median of the five, in ns of the thread's CPU time per pushed row
//! (the wall-clock figure beside it), with the spread.

use std::time::{Duration, Instant};

use phub_engine::engine::TableInstall;
use phub_engine::kernels::Kernels;
use phub_engine::{InstallKind, JobInstall, Shard};
use phub_proto::placement::RowPlacement;
use phub_proto::rows::{self, KeyCache, RowMsgType, RowRepr};
use phub_proto::spec::{rows_per_datagram, Consistency, Optimizer, RowInitSpec, RowOptimizerSpec, TableSpec};
use phub_proto::wire::HEADER_LEN;
use phub_proto::Dtype;

const W: u16 = 4;
const DIM: u32 = 16;
const ROWS: u64 = 1_000_000;
const BATCH: usize = 4096;
const ZIPF: f64 = 1.05;
const CHUNK_BYTES: u32 = 8192;
const REPS: usize = 5;

mod common;
use common::cpu_time;

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `phub-bench sparse`'s id of a rank.
fn id_of(rank: u64) -> u64 {
    splitmix(rank ^ 0x5EED_0F1D_5EED_0F1D)
}

/// A Zipf(s) rank in `0..n` from the uniform `u` (as `phub-bench sparse`).
fn zipf_rank(u: f64, n: u64, s: f64) -> u64 {
    let top = ((n + 1) as f64).powf(1.0 - s);
    let x = (1.0 + u * (top - 1.0)).powf(1.0 / (1.0 - s)) - 1.0;
    (x as u64).min(n - 1)
}

struct Draws(u64);

impl Draws {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(1);
        (splitmix(self.0) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn msg(kind: RowMsgType, rank: u16, round: u32, seq: u32, ids: &[u64], rows: &[f32]) -> Vec<u8> {
    let repr = RowRepr {
        kind,
        dtype: Dtype::F32,
        flags: 0,
        token: 5,
        job: 3,
        rank,
        count: ids.len() as u16,
        round,
        dim: DIM,
        key: 0,
        seq,
        cache: KeyCache::Off,
    };
    let mut b = vec![0u8; HEADER_LEN + CHUNK_BYTES as usize + 64];
    let n = rows::write(&repr, ids, rows, &mut b);
    b.truncate(n);
    b
}

/// One round's datagrams in arrival order, from each rank's ids placed on
/// entry 0 (sorted, distinct), and the rows they push.
fn round_packets(per_rank: &[Vec<u64>], round: u32, per: usize) -> (Vec<(u16, Vec<u8>)>, u64) {
    let mut lanes: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut pushed = 0;
    for (rank, ids) in (0u16..).zip(per_rank) {
        let mut lane = Vec::new();
        for (s, part) in (0u32..).zip(ids.chunks(per)) {
            let grads: Vec<f32> = (0..part.len() * DIM as usize)
                .map(|i| 0.01 * (i % 7) as f32 - 0.03)
                .collect();
            lane.push(msg(RowMsgType::RowPush, rank, round, s, part, &grads));
            pushed += part.len() as u64;
        }
        let n = lane.len() as u32;
        lane.push(msg(RowMsgType::RowEnd, rank, round, n, &[], &[]));
        lanes.push(lane);
    }
    // One message of each rank in turn, moved out of the lanes.
    let mut lanes: Vec<_> = lanes.into_iter().map(Vec::into_iter).collect();
    let mut packets = Vec::new();
    loop {
        let before = packets.len();
        for (rank, lane) in (0u16..).zip(&mut lanes) {
            packets.extend(lane.next().map(|p| (rank, p)));
        }
        if packets.len() == before {
            break;
        }
    }
    (packets, pushed)
}

fn handle_all(shard: &mut Shard<u16>, packets: &[(u16, Vec<u8>)]) -> u64 {
    let mut sent = 0;
    for (rank, p) in packets {
        shard.handle(*rank, p, 0);
        for t in shard.transmits() {
            sent += t.payload.len() as u64;
        }
        shard.clear_transmits();
    }
    sent
}

fn main() {
    let rounds: u32 = std::env::args()
        .nth(1)
        .map_or(200, |a| a.parse().expect("ROUNDS: a count of rounds"));
    let fill: Option<usize> = std::env::args()
        .nth(2)
        .map(|a| a.parse().expect("FILL: rows per rank and fill round"));
    let mut shard: Shard<u16> = Shard::new(0, Kernels::best());
    let job = JobInstall {
        id: 3,
        token: 5,
        workers: W,
        dtype: Dtype::F32,
        optimizer: Optimizer::Sum,
        consistency: Consistency::Sync,
        chunk_elems: CHUNK_BYTES / 4,
        slots: Vec::new(),
    };
    let table = TableInstall {
        key: 0,
        spec: TableSpec {
            dim: DIM,
            // Room for every id placed here (about half of ROWS).
            rows: Some(ROWS + ROWS / 50),
            seed: 1,
            init: RowInitSpec::Zeros,
            optimizer: RowOptimizerSpec::Adagrad {
                lr: 0.01,
                eps: 1e-8,
                initial_accumulator: 0.0,
                rowwise: false,
            },
            evict: None,
            admit_after: None,
            key_cache: 0,
        },
        chunk_bytes: CHUNK_BYTES,
        lcores: 2,
        entry: 0,
    };
    shard
        .install_with_tables(job, InstallKind::Plain, vec![table])
        .expect("install");
    let place = RowPlacement::new(1, 0, &[2]).expect("placement");
    let per = rows_per_datagram(CHUNK_BYTES, DIM, Dtype::F32) as usize;
    let mut draws = Draws(7);
    let mut round = 0u32;
    // Fill: every id placed here, spread over the ranks, in rounds of
    // FILL rows per rank (by default about a timed round's size; larger
    // ones show what a huge round leaves for the rounds after it).
    let mine: Vec<u64> = (0..ROWS).map(id_of).filter(|&id| place.entry(id) == 0).collect();
    let cap = fill.unwrap_or(8 * per).clamp(1, 1024 * per);
    for part in mine.chunks(cap * usize::from(W)) {
        round += 1;
        let mut per_rank: Vec<Vec<u64>> = part.chunks(cap).map(<[u64]>::to_vec).collect();
        per_rank.resize(usize::from(W), Vec::new());
        for ids in &mut per_rank {
            ids.sort_unstable();
        }
        let (packets, _) = round_packets(&per_rank, round, per);
        handle_all(&mut shard, &packets);
    }
    let filled = shard.counters().rounds_completed.get();
    assert_eq!(filled, u64::from(round), "the fill rounds completed");
    println!(
        "bsp_round_bench: W = {W}, D = {DIM}, f32, Adagrad, {BATCH} ids per rank and step (zipf {ZIPF} over {ROWS}), \
         entry 0 of 2 ({} rows stored in fill rounds of {cap} rows per rank), R = {per}, {rounds} rounds timed x {REPS}",
        mine.len()
    );
    let mut cpu_ns = Vec::new();
    let mut wall_ns = Vec::new();
    for _ in 0..REPS {
        let mut pushed = 0;
        let mut distinct = 0;
        let before = shard.counters().rounds_completed.get();
        let (mut cpu, mut wall) = (Duration::ZERO, Duration::ZERO);
        let mut sent = 0;
        for _ in 0..rounds {
            round += 1;
            let mut union = Vec::new();
            let per_rank: Vec<Vec<u64>> = (0..W)
                .map(|_| {
                    let mut ids: Vec<u64> = (0..BATCH)
                        .map(|_| id_of(zipf_rank(draws.uniform(), ROWS, ZIPF)))
                        .filter(|&id| place.entry(id) == 0)
                        .collect();
                    ids.sort_unstable();
                    ids.dedup();
                    union.extend_from_slice(&ids);
                    ids
                })
                .collect();
            union.sort_unstable();
            union.dedup();
            distinct += union.len() as u64;
            let (packets, n) = round_packets(&per_rank, round, per);
            pushed += n;
            // Timed round by round: the round's datagrams were just
            // written, as a socket's receive copy leaves them.
            let (c0, w0) = (cpu_time(), Instant::now());
            sent += handle_all(&mut shard, &packets);
            cpu += cpu_time() - c0;
            wall += w0.elapsed();
        }
        assert_eq!(
            shard.counters().rounds_completed.get() - before,
            u64::from(rounds),
            "every round completed"
        );
        assert!(sent > 0);
        let c = cpu.as_nanos() as f64 / pushed as f64;
        let w = wall.as_nanos() as f64 / pushed as f64;
        println!(
            "  {:7.1} ns cpu ({:7.1} ns wall) per pushed row; {:6.1} us cpu a round; {:.0} rows pushed, {:.0} distinct a round",
            c,
            w,
            cpu.as_nanos() as f64 / 1e3 / f64::from(rounds),
            pushed as f64 / f64::from(rounds),
            distinct as f64 / f64::from(rounds)
        );
        cpu_ns.push(c);
        wall_ns.push(w);
    }
    cpu_ns.sort_by(f64::total_cmp);
    wall_ns.sort_by(f64::total_cmp);
    println!(
        "median {:.1} ns cpu per pushed row (spread {:.1}-{:.1}), {:.1} ns wall",
        cpu_ns[REPS / 2],
        cpu_ns[0],
        cpu_ns[REPS - 1],
        wall_ns[REPS / 2]
    );
}
