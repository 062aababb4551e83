//! Replication does not allocate either (PROTOCOL.md §11; the dense data
//! path's test is no_alloc.rs): its own binary, since the allocation count
//! is global and libtest's threads allocate while another test runs.

use phub_engine::kernels::Kernels;
use phub_engine::testing::allocations;
use phub_engine::{InstallKind, JobInstall, Shard};
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, MsgType, Repr};
use phub_proto::Dtype;

/// Nor does replication (PROTOCOL.md §11): a primary's aggregates, their
/// resends on the timer, a backup's applying and acknowledging, and the
/// RESULTs once acknowledged.
#[test]
fn replicating_allocates_nothing() {
    use phub_engine::engine::replica_plan;
    use phub_proto::layout::{ChunkRange, Chunks};
    use phub_proto::spec::{Appliances, JobSpec};
    use std::net::{Ipv4Addr, SocketAddrV4};
    use std::sync::Arc;

    const W: u16 = 2;
    const N: u64 = 2048;
    let spec = JobSpec::new("r", u32::from(W), &[2 * N])
        .with_optimizer(Optimizer::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        })
        .with_chunk_bytes(4 * N as u32)
        .sharded_over(Appliances::Count(2))
        .with_replicas(2);
    spec.validate().unwrap();
    let ip = |i: u8| Ipv4Addr::new(10, 0, i, 1);
    let appliances = [(ip(0), 9000, 1), (ip(1), 9000, 1)];
    let runs = [
        ChunkRange { first: 0, count: 1 },
        ChunkRange { first: 1, count: 1 },
    ];
    let racks = [String::new(), String::new()];
    let mut shards: Vec<Shard<SocketAddrV4>> = (0..2u16)
        .map(|i| {
            let (slots, rep) = replica_plan(&spec, &runs, &appliances, &racks, i, 0)
                .unwrap()
                .remove(0);
            let mut s = Shard::new(0, Kernels::best());
            s.set_peer_resolver(Arc::new(Some));
            let job = JobInstall {
                id: 3,
                token: 5,
                workers: W,
                dtype: Dtype::F32,
                optimizer: spec.optimizer,
                consistency: Default::default(),
                chunk_elems: N as u32,
                slots,
            };
            s.install(job, InstallKind::Replicated(Box::new(rep))).unwrap();
            s
        })
        .collect();
    let addr = |i: usize| SocketAddrV4::new(ip(i as u8), 9000);
    let worker = |r: u16| SocketAddrV4::new(Ipv4Addr::new(10, 9, 0, r as u8 + 1), 5000);
    // Every push of 20 rounds, and room for what the shards send, made
    // before counting starts.
    let chunks: Vec<_> = Chunks::new(&spec).iter(0..2).collect();
    let values = vec![0.25f32; N as usize];
    let mut packets = Vec::new();
    for round in 0..20u32 {
        for (g, c) in chunks.iter().enumerate() {
            for rank in 0..W {
                let carries = round > 0 || rank == 0;
                let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
                let count = if carries { N as usize } else { 0 };
                let repr = Repr::request(kind, 3, 5, rank, round, 0)
                    .with_payload(Dtype::F32, count as u16)
                    .with_chunk(c.key, c.chunk);
                packets.push((g, rank, repr.to_datagram(&values[..count])));
            }
        }
    }
    let mut staged: Vec<(usize, usize, usize, Vec<u8>)> =
        (0..16).map(|_| (0, 0, 0, vec![0u8; 9000])).collect();
    // One exchange: every shard's transmits to another shard delivered
    // (the first REPLICATE of each round lost when `lose`), the rest
    // (RESULTs to workers) dropped. Returns how many were delivered.
    let mut exchange = |shards: &mut Vec<Shard<SocketAddrV4>>, now: u64, lose: bool| {
        let mut n = 0;
        for (i, s) in shards.iter().enumerate() {
            for t in s.transmits() {
                let ty = t.header[wire::field::TYPE];
                for to in t.to {
                    let Some(dst) = (0..2).find(|&d| addr(d) == to) else {
                        continue;
                    };
                    if lose && ty == 14 {
                        continue;
                    }
                    let e = &mut staged[n];
                    e.0 = i;
                    e.1 = dst;
                    e.2 = wire::HEADER_LEN + t.payload.len();
                    e.3[..wire::HEADER_LEN].copy_from_slice(&t.header);
                    e.3[wire::HEADER_LEN..e.2].copy_from_slice(t.payload);
                    n += 1;
                }
            }
        }
        for s in shards.iter_mut() {
            s.clear_transmits();
        }
        for e in &staged[..n] {
            shards[e.1].handle(addr(e.0), &e.3[..e.2], now);
        }
        n
    };
    let before = allocations();
    let mut now = 1;
    for round in packets.chunks(2 * W as usize) {
        for (g, rank, d) in round {
            shards[*g].handle(worker(*rank), d, now);
            now += 1;
        }
        // The aggregates go out and are lost; the timers resend them.
        exchange(&mut shards, now, true);
        now += 1_000_000_000;
        for s in shards.iter_mut() {
            s.poll_timers(now);
        }
        while exchange(&mut shards, now, false) > 0 {}
    }
    let after = allocations();
    for (g, s) in shards.iter().enumerate() {
        assert_eq!(s.result(3, 0).unwrap().0, 19, "chunk {g} completed every round");
    }
    assert!(shards[0].replica_stats(3).unwrap().replicates_resent >= 20);
    assert_eq!(after, before, "handling, replicating and draining allocated");
}
