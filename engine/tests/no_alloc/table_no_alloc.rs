//! Table messages do not allocate in steady state: once a first round has
//! grown the round's buffers, the row outbox and the store's blocks,
//! rounds of the same shape (pushes with repeated ids, duplicates, resends
//! of lost answers, pulls, drops), handled and drained, leave the
//! allocation count where it was. In BSP and in bounded delay.

use phub_engine::engine::TableInstall;
use phub_engine::kernels::Kernels;
use phub_engine::testing::allocations;
use phub_engine::{InstallKind, JobInstall, Shard};
use phub_proto::placement::RowPlacement;
use phub_proto::rows::{self, RowMsgType, RowRepr};
use phub_proto::spec::{Consistency, Optimizer, RowInitSpec, RowOptimizerSpec, TableSpec};
use phub_proto::wire::HEADER_LEN;
use phub_proto::Dtype;

const W: u16 = 4;
const DIM: u32 = 16;

fn msg(kind: RowMsgType, rank: u16, round: u32, seq: u32, ids: &[u64]) -> Vec<u8> {
    let repr = RowRepr {
        kind,
        dtype: Dtype::Bf16,
        flags: 0,
        token: 5,
        job: 3,
        rank,
        count: ids.len() as u16,
        round,
        dim: DIM,
        key: 0,
        seq,
        cache: phub_proto::rows::KeyCache::Off,
    };
    let rows = if kind == RowMsgType::RowPush {
        vec![0.125f32; ids.len() * DIM as usize]
    } else {
        Vec::new()
    };
    let mut b = vec![0u8; HEADER_LEN + 9000];
    let n = rows::write(&repr, ids, &rows, &mut b);
    b.truncate(n);
    b
}

#[test]
fn table_rounds_allocate_nothing_in_steady_state() {
    for consistency in [Consistency::Sync, Consistency::Bounded { delay: 1 }] {
        let mut shard: Shard<u16> = Shard::new(0, Kernels::best());
        let job = JobInstall {
            id: 3,
            token: 5,
            workers: W,
            dtype: Dtype::Bf16,
            optimizer: Optimizer::Sum,
            consistency,
            chunk_elems: 4096,
            slots: Vec::new(),
        };
        let table = TableInstall {
            key: 0,
            spec: TableSpec {
                dim: DIM,
                rows: Some(100_000),
                seed: 1,
                init: RowInitSpec::Normal { std: 0.1 },
                optimizer: RowOptimizerSpec::Adam {
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                },
                evict: None,
                admit_after: None,
                key_cache: 0,
            },
            chunk_bytes: 8192,
            lcores: 2,
            entry: 1,
        };
        shard
            .install_with_tables(job, InstallKind::Plain, vec![table])
            .unwrap();
        let place = RowPlacement::new(1, 0, &[2]).unwrap();
        let ids: Vec<u64> = (0u64..).filter(|&id| place.entry(id) == 1).take(600).collect();
        // Every packet of 12 rounds, built before counting starts: each
        // rank pushes 3 messages of 200 ids (overlapping the others'),
        // one twice, then its ROW_END; after the round, a resend of its
        // first push, a pull and a misplaced pull.
        let misplaced: Vec<u64> = (0u64..).filter(|&id| place.entry(id) == 0).take(4).collect();
        let mut rounds = Vec::new();
        for round in 1..=12u32 {
            let mut packets = Vec::new();
            for rank in 0..W {
                for s in 0..3u32 {
                    let at = (s as usize * 200 + usize::from(rank) * 50) % 400;
                    let p = msg(RowMsgType::RowPush, rank, round, s, &ids[at..at + 200]);
                    if s == 1 {
                        packets.push((rank, p.clone()));
                    }
                    packets.push((rank, p));
                }
                packets.push((rank, msg(RowMsgType::RowEnd, rank, round, 3, &[])));
            }
            for rank in 0..W {
                packets.push((rank, msg(RowMsgType::RowPush, rank, round, 0, &ids[..200])));
                packets.push((rank, msg(RowMsgType::RowPull, rank, 0, 7, &ids[100..300])));
                packets.push((rank, msg(RowMsgType::RowPull, rank, 0, 8, &misplaced)));
            }
            rounds.push(packets);
        }
        let run = |shard: &mut Shard<u16>, packets: &[(u16, Vec<u8>)]| {
            let mut sent = 0u64;
            for (rank, p) in packets {
                shard.handle(*rank, p, 0);
                for t in shard.transmits() {
                    sent += t.to.count() as u64 + t.payload.len() as u64;
                }
                shard.clear_transmits();
            }
            sent
        };
        // The first rounds grow every buffer to its size.
        for packets in &rounds[..2] {
            assert!(run(&mut shard, packets) > 0);
        }
        let before = allocations();
        let mut sent = 0;
        for packets in &rounds[2..] {
            sent += run(&mut shard, packets);
        }
        let after = allocations();
        assert!(sent > 0);
        assert_eq!(
            shard.counters().rounds_completed.get(),
            12 * completions_per_round(consistency)
        );
        assert_eq!(
            after,
            before,
            "{consistency:?}: table messages allocated {} times",
            after - before
        );
    }
}

/// Rounds completed per round of the test: one per BSP round, one per
/// rank's clock otherwise.
fn completions_per_round(c: Consistency) -> u64 {
    if c == Consistency::Sync {
        1
    } else {
        u64::from(W)
    }
}
