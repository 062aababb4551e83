//! The kernel-UDP queue under an engine shard, without the lcore loop:
//! results leave as GSO trains and arrive whole, with datagrams or through
//! shared memory.

use std::net::{SocketAddr, SocketAddrV4, UdpSocket};
use std::time::Duration;

use phub_dataplane::backend::udp::UdpQueue;
use phub_dataplane::backend::PacketIo;
use phub_engine::{InstallKind, JobInstall, Kernels, Shard};
use phub_proto::layout::SlotChunk;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, MsgType, Repr, HEADER_LEN};
use phub_proto::Dtype;

fn queue() -> (UdpQueue, SocketAddrV4) {
    let q = UdpQueue::bind(SocketAddrV4::new([127, 0, 0, 1].into(), 0), 4 << 20).unwrap();
    let SocketAddr::V4(a) = q.local_addr().unwrap() else {
        unreachable!()
    };
    (q, a)
}

#[test]
fn results_to_one_worker_go_out_as_trains_and_arrive_whole() {
    results_to_one_worker(false);
}

#[test]
fn shm_results_to_one_worker_arrive_as_headers_with_the_values_in_shared_memory() {
    results_to_one_worker(true);
}

/// A worker of a one-rank job pushes 20 chunks a round (through shared
/// memory with `shm`) and gets 20 results back in order.
fn results_to_one_worker(shm: bool) {
    use phub_engine::ShmSetup;
    use phub_net::shm::ShmRegion;
    use phub_proto::shm::{region_len, region_path, slot_offset, Part};
    let (mut q, to) = queue();
    let mut shard: Shard<SocketAddrV4> = Shard::new(0, Kernels::best());
    const CHUNKS: u32 = 20;
    const ELEMS: u32 = 64;
    let job = JobInstall {
        id: 9,
        token: 99,
        workers: 1,
        dtype: Dtype::F32,
        optimizer: Optimizer::Sum,
        consistency: Default::default(),
        chunk_elems: ELEMS,
        slots: (0..CHUNKS)
            .map(|c| SlotChunk {
                key: 0,
                chunk: c,
                elems: if c == CHUNKS - 1 { ELEMS / 2 } else { ELEMS },
            })
            .collect(),
    };
    // Named after this queue's port: no other test shares the files.
    let regions = if shm {
        shard
            .install(
                job,
                InstallKind::Shared(ShmSetup {
                    base_port: to.port(),
                    chunk_elems: ELEMS,
                }),
            )
            .unwrap();
        let len = region_len(CHUNKS as usize, ELEMS, Dtype::F32);
        let open = |part| ShmRegion::open(&region_path(to.port(), 9, 99, 0, part), len).unwrap();
        Some((open(Part::Staging(0)), open(Part::Results)))
    } else {
        shard.install(job, InstallKind::Plain).unwrap();
        None
    };
    let c = UdpSocket::bind("127.0.0.1:0").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for round in 0..2u32 {
        for slot in 0..CHUNKS {
            let n = if slot == CHUNKS - 1 { ELEMS / 2 } else { ELEMS } as usize;
            let vals: Vec<f32> = (0..n)
                .map(|e| (slot as usize * 1000 + e) as f32 + round as f32)
                .collect();
            let repr = Repr::request(
                if round == 0 { MsgType::Init } else { MsgType::Push },
                9,
                99,
                0,
                round,
                slot,
            )
            .with_payload(Dtype::F32, n as u16)
            .with_chunk(0, slot)
            .with_flags(if shm { wire::flags::SHM } else { 0 });
            let mut bytes = vec![0u8; 4 * n];
            phub_engine::kernels::encode(Dtype::F32, &vals, &mut bytes);
            let mut b = repr.to_bytes().to_vec();
            match &regions {
                Some((staging, _)) => {
                    assert!(staging.write(slot_offset(slot, ELEMS, Dtype::F32), &bytes))
                }
                None => b.extend_from_slice(&bytes),
            }
            c.send_to(&b, to).unwrap();
        }
        let mut handled = 0;
        while handled < CHUNKS as usize {
            handled += q
                .rx_burst(Some(Duration::from_millis(500)), &mut |from, d| {
                    shard.handle(from, d, 1);
                })
                .unwrap();
        }
        let counters = std::sync::Arc::clone(shard.counters());
        let before = counters.tx_packets.get();
        q.tx_burst(shard.transmits(), &counters).unwrap();
        shard.clear_transmits();
        assert_eq!(counters.tx_packets.get() - before, u64::from(CHUNKS));
        // A plain socket gets the train cut back into datagrams, in order.
        for slot in 0..CHUNKS {
            let mut buf = [0u8; 2048];
            let len = c.recv(&mut buf).unwrap();
            let (r, payload) = wire::parse(&buf[..len]).unwrap();
            assert_eq!((r.kind, r.round, r.slot), (MsgType::Result, round, slot));
            let n = if slot == CHUNKS - 1 { ELEMS / 2 } else { ELEMS } as usize;
            let mut from_shm = vec![0u8; 4 * n];
            let payload = match &regions {
                Some((_, results)) => {
                    assert_eq!((r.flags, len), (wire::flags::SHM, HEADER_LEN));
                    assert!(results.read(slot_offset(slot, ELEMS, Dtype::F32), &mut from_shm));
                    &from_shm[..]
                }
                None => payload,
            };
            assert_eq!(payload.len(), 4 * n);
            let first = f32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
            assert_eq!(first, (slot as usize * 1000) as f32 + round as f32);
        }
    }
}
