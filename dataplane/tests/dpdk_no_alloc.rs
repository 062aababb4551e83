//! The DPDK backend's data path does not allocate: rounds of pushes
//! received from a port made of rings, handed to the engine in place, and
//! results sent as header + shared-payload chains leave the allocation
//! count where it was. The queue is driven on the test thread (no lcore
//! launch), so every Rust allocation on the path is seen.

#![cfg(feature = "dpdk")]

mod common;

use std::net::Ipv4Addr;
use std::sync::Arc;

use phub_dataplane::backend::dpdk::frame::{self, PeerAddr};
use phub_dataplane::backend::dpdk::{
    handoff_rings, DpdkQueue, DpdkSlotMemory, Identity, QueueOptions, TxPools,
};
use phub_dataplane::backend::PacketIo;
use phub_engine::kernels::{self, Kernels};
use phub_engine::{InstallKind, JobInstall, Shard};
use phub_ffi::{Mbuf, Mempool, PortBuilder, Ring};
use phub_proto::layout::SlotChunk;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{MsgType, Repr};
use phub_proto::Dtype;

#[global_allocator]
static GLOBAL: common::Counting = common::Counting;

const US: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 1);
const W: u16 = 4;
const N: usize = 2048;

#[test]
fn dpdk_receive_aggregate_and_send_allocates_nothing() {
    let Some(eal) = common::test_eal("phub-dpdk-noalloc-test", 256, "0@(0-1)") else {
        return;
    };
    let rx = Ring::create(eal, "narx", 256, None).unwrap();
    let tx = Ring::create(eal, "natx", 256, None).unwrap();
    let id = eal
        .port_from_rings(
            "net_ring_noalloc",
            std::slice::from_ref(&rx),
            std::slice::from_ref(&tx),
            0,
        )
        .unwrap();
    let pool = Mempool::pktmbuf(eal, "narxp", 1024, 0, 9216 + 128, None).unwrap();
    let pools = TxPools::create(eal, 1024, None).unwrap();
    let (_port, mut rxq, mut txq) = PortBuilder::new(eal, id)
        .rx_pool(pool.clone())
        .descriptors(128, 128)
        .build()
        .unwrap();
    // Slot memory from DPDK's heap, as the DPDK backend has it.
    let mem = Arc::new(DpdkSlotMemory::new(eal, None));
    let mut shard: Shard<PeerAddr> = Shard::with_slot_memory(0, Kernels::best(), mem);
    shard
        .install(
            JobInstall {
                id: 3,
                token: 5,
                workers: W,
                dtype: Dtype::F32,
                optimizer: Optimizer::Sum,
                consistency: Default::default(),
                chunk_elems: N as u32,
                slots: vec![SlotChunk {
                    key: 0,
                    chunk: 0,
                    elems: N as u32,
                }],
            },
            InstallKind::Plain,
        )
        .unwrap();
    let counters = Arc::clone(shard.counters());
    let mut q = DpdkQueue::new(
        0,
        rxq.remove(0),
        txq.remove(0),
        Identity {
            ip: US,
            mac: [2, 0, 0, 0, 0, 1],
            base_port: 7900,
        },
        handoff_rings(eal, 1, None).unwrap().into(),
        pools,
        Arc::clone(&counters),
        QueueOptions {
            check_ip_checksum: true,
            check_udp_checksum: true,
            nic_checksums: false,
            chains: true,
            tx_checksums: false,
            idle_backoff: false,
        },
    );
    let vals = vec![1.5f32; N];
    // Frames for rounds 0..=20 from every rank, built before measuring.
    let frames: Vec<Vec<Vec<u8>>> = (0..=20u32)
        .map(|round| {
            (0..W)
                .map(|rank| {
                    let carries = round > 0 || rank == 0;
                    let n = if carries { N } else { 0 };
                    let repr = Repr::request(
                        if round == 0 { MsgType::Init } else { MsgType::Push },
                        3,
                        5,
                        rank,
                        round,
                        0,
                    )
                    .with_payload(Dtype::F32, n as u16);
                    let b = repr.to_datagram(&vals[..n]);
                    let from = PeerAddr {
                        mac: [2, 0, 0, 0, 9, rank as u8],
                        ip: Ipv4Addr::new(10, 78, 0, 10 + rank as u8),
                        port: 40000,
                    };
                    frame::udp_frame(&from, [2, 0, 0, 0, 0, 1], US, 7900, &b)
                })
                .collect()
        })
        .collect();
    let mut out: Vec<Option<Mbuf>> = (0..64).map(|_| None).collect();
    let mut sent_total = 0;
    let mut round_trip = |round: usize, q: &mut DpdkQueue, shard: &mut Shard<PeerAddr>| {
        for f in &frames[round] {
            let mut m = pool.alloc().unwrap();
            assert!(m.extend_from_slice(f));
            rx.enqueue(m).unwrap();
        }
        q.rx_burst(None, &mut |from, d| {
            shard.handle(from, d, 1);
        })
        .unwrap();
        q.tx_burst(shard.transmits(), &counters).unwrap();
        shard.clear_transmits();
        let n = tx.dequeue_burst(&mut out);
        for m in out.iter_mut().take(n) {
            *m = None;
        }
        n
    };
    sent_total += round_trip(0, &mut q, &mut shard);
    let before = common::allocations();
    for round in 1..=20 {
        sent_total += round_trip(round, &mut q, &mut shard);
    }
    let after = common::allocations();
    assert_eq!(
        sent_total,
        21 * usize::from(W),
        "a result to every rank every round"
    );
    assert_eq!(counters.rounds_completed.get(), 21);
    assert_eq!(after - before, 0, "allocations on the DPDK data path");
    let (_, r) = shard.result(3, 0).unwrap();
    let mut got = vec![0f32; N];
    kernels::decode(Dtype::F32, r, &mut got);
    assert!(got.iter().all(|v| *v == 1.5 * f32::from(W)));
}
