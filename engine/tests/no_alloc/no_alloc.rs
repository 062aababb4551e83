//! The data path does not allocate: rounds of pushes, completions, resends
//! and drops, handled and drained, leave the allocation count where it was;
//! also with shared-memory regions, half the ranks pushing through them.

use phub_engine::kernels::Kernels;
use phub_engine::testing::allocations;
use phub_engine::{InstallKind, JobInstall, Shard, ShmSetup};
use phub_proto::layout::SlotChunk;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, flags, MsgType, Repr};
use phub_proto::Dtype;

#[test]
fn handling_and_draining_allocates_nothing() {
    const W: u16 = 4;
    const N: usize = 2048;
    for (dtype, shm) in Dtype::ALL.into_iter().flat_map(|d| [(d, false), (d, true)]) {
        let mut shard: Shard<u16> = Shard::new(0, Kernels::best());
        let job = JobInstall {
            id: 3,
            token: 5,
            workers: W,
            dtype,
            optimizer: Optimizer::Adam {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            consistency: Default::default(),
            chunk_elems: N as u32,
            slots: vec![SlotChunk {
                key: 0,
                chunk: 0,
                elems: N as u32,
            }],
        };
        if shm {
            // Regions named after this process: no other test shares them.
            let setup = ShmSetup {
                base_port: (20_000 + std::process::id() % 40_000) as u16,
                chunk_elems: N as u32,
            };
            shard.install(job, InstallKind::Shared(setup)).unwrap();
        } else {
            shard.install(job, InstallKind::Plain).unwrap();
        }
        // Every packet of 20 rounds, built before counting starts.
        let n = N.min(wire::MAX_PAYLOAD / dtype.size());
        assert_eq!(n, N);
        let values = vec![0.25f32; N];
        let mut packets = Vec::new();
        for round in 0..20u32 {
            for rank in 0..W {
                let carries = round > 0 || rank == 0;
                let count = if carries { N } else { 0 };
                let rank_shm = shm && rank % 2 == 0;
                let repr = Repr::request(
                    if round == 0 { MsgType::Init } else { MsgType::Push },
                    3,
                    5,
                    rank,
                    round,
                    0,
                )
                .with_payload(dtype, count as u16)
                .with_flags(if rank_shm { flags::SHM } else { 0 });
                let b = repr.to_datagram(if rank_shm { &[] } else { &values[..count] });
                packets.push((rank, b.clone()));
                packets.push((rank, b)); // a duplicate of each, resent or dropped
            }
            packets.push((0, vec![0u8; 10])); // truncated garbage
        }
        let before = allocations();
        let mut sent = 0u64;
        for (rank, p) in &packets {
            shard.handle(*rank, p, 0);
            for t in shard.transmits() {
                sent += t.to.count() as u64 + t.payload.len() as u64 + u64::from(t.header[0]);
            }
            shard.clear_transmits();
        }
        let after = allocations();
        assert!(sent > 0);
        assert_eq!(shard.counters().rounds_completed.get(), 20);
        assert_eq!(shard.counters().shm_rx.get() > 0, shm);
        assert_eq!(
            after,
            before,
            "{dtype} (shm: {shm}): the data path allocated {} times",
            after - before
        );
    }
}
