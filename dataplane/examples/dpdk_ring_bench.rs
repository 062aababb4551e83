//! The DPDK dataplane alone, fed by a generator over a ring port: W = 8
//! workers' pushes for S slots, round after round, into one dataplane lcore
//! (the same DpdkQueue and poll loop as `phub-dataplane --backend dpdk`).
//! Prints Mpps and GB/s of gradient input per lcore, and the engine's
//! kernel-only figure (the same pushes handed to a Shard from memory, no
//! packet I/O, over the same template frames and slot memory from the same
//! DPDK heap) from the same run, and their ratio.
//!
//! The generator does not copy gradients: each (slot, rank) has one
//! template frame, and each push is an indirect mbuf attached to it; the
//! template's round number is rewritten only once no push of it is in
//! flight (its refcount is back to 1).
//!
//! `cargo run --release -p phub-dataplane --example dpdk_ring_bench -- [chunk_bytes] [seconds] [slots]`
//! Needs 2 cores (generator on lcore 0, dataplane on lcore 1).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Generator, BASE_PORT, US, W};
use phub_dataplane::backend::dpdk::frame::PeerAddr;
use phub_dataplane::backend::dpdk::{
    handoff_rings, DpdkQueue, DpdkSlotMemory, Identity, QueueOptions, TxPools,
};
use phub_dataplane::lcore::{self, Clock, LoopOptions};
use phub_engine::kernels::Kernels;
use phub_engine::{InstallKind, Shard};
use phub_ffi::{Mbuf, Mempool, PortBuilder, Ring};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let chunk: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(8192);
    let secs: f64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3.0);
    #[allow(non_snake_case)]
    let S: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(512);
    let elems = chunk / 4;
    let eal = phub_ffi::eal::init(&common::eal_no_huge("phub-ring-bench", "0@0,1@1", &[])).expect("EAL");
    let rx = Ring::create(eal, "brx", 4096, None).unwrap();
    let tx = Ring::create(eal, "btx", 4096, None).unwrap();
    let id = eal
        .port_from_rings(
            "net_ring_bench",
            std::slice::from_ref(&rx),
            std::slice::from_ref(&tx),
            0,
        )
        .unwrap();
    let frames = Mempool::pktmbuf(
        eal,
        "bfr",
        2 * S as u32 * u32::from(W) + 1024,
        0,
        9216 + 128,
        None,
    )
    .unwrap();
    let ind = Mempool::pktmbuf(eal, "bind", 8192, 256, 0, None).unwrap();
    let pools = TxPools::create(eal, 16384, None).unwrap();
    let (port, mut rxq, mut txq) = PortBuilder::new(eal, id)
        .rx_pool(frames.clone())
        .descriptors(1024, 1024)
        .build()
        .unwrap();
    let mut shard: Shard<PeerAddr> = Shard::new(0, Kernels::best());
    shard
        .install(common::job(elems as u32, S), InstallKind::Plain)
        .unwrap();
    let counters = Arc::clone(shard.counters());
    let q = DpdkQueue::new(
        0,
        rxq.remove(0),
        txq.remove(0),
        Identity {
            ip: US,
            mac: [2, 0, 0, 0, 0, 1],
            base_port: BASE_PORT,
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
    let stop = Arc::new(AtomicBool::new(false));
    let (_cmd_tx, cmd_rx) = crossbeam_channel::bounded(4);
    let clock = Clock::start();
    let stop2 = Arc::clone(&stop);
    let lc = phub_ffi::lcore::launch(eal, 1, move || {
        let opts = LoopOptions {
            busy_poll: true,
            ..LoopOptions::default()
        };
        lcore::run(q, shard, cmd_rx, stop2, clock, opts).map_or(-1, |()| 0)
    })
    .expect("launch");

    let vals = common::values(elems);
    let drain = std::cell::RefCell::new((0..256).map(|_| None).collect::<Vec<Option<Mbuf>>>());
    // Frees what the dataplane sent (the results).
    let drain_tx = |tx: &Ring| {
        let mut d = drain.borrow_mut();
        loop {
            let n = tx.dequeue_burst(&mut d);
            for m in d.iter_mut().take(n) {
                *m = None;
            }
            if n < d.len() {
                break;
            }
        }
    };
    // Round 0 (INIT) by copy.
    for f in common::init_frames(S, &vals) {
        let mut m = frames.alloc().unwrap();
        assert!(m.extend_from_slice(&f));
        let mut m = Some(m);
        while let Some(x) = m.take() {
            if let Err(x) = rx.enqueue(x) {
                m = Some(x);
                drain_tx(&tx);
            }
        }
    }
    let mut generator = Generator::new(&frames, ind, S, &vals, false);
    while counters.rounds_completed.get() < S as u64 {
        drain_tx(&tx);
    }
    let base_pushes = counters.pushes_aggregated.get();
    let t = Instant::now();
    // Hands a batch to the ring (all of it), draining results meanwhile.
    let mut send = |batch: &mut Vec<Mbuf>| {
        while !batch.is_empty() {
            if rx.enqueue_burst(batch) == 0 {
                drain_tx(&tx);
            }
        }
        drain_tx(&tx);
    };
    while t.elapsed().as_secs_f64() < secs {
        generator.round(&mut send);
    }
    generator.flush(&mut send);
    let waits = generator.waits;
    // Let the lcore finish what is queued.
    while !rx.is_empty() {
        drain_tx(&tx);
    }
    std::thread::sleep(Duration::from_millis(20));
    drain_tx(&tx);
    let el = t.elapsed().as_secs_f64();
    let pushes = counters.pushes_aggregated.get() - base_pushes;
    let drops = counters.drops_total() + counters.net_drops.iter().map(|c| c.get()).sum::<u64>();
    let (busy, idle) = (counters.busy_loops.get(), counters.idle_loops.get());
    stop.store(true, Ordering::Relaxed);
    let _ = lc.wait();
    drain_tx(&tx);
    let dp_pps = pushes as f64 / el;
    let dp_gbs = dp_pps * chunk as f64 / 1e9;

    // Kernel-only: the same pushes handed to a Shard from the same
    // template frames, slot memory from the same DPDK heap.
    let k = Shard::with_slot_memory(0, Kernels::best(), Arc::new(DpdkSlotMemory::new(eal, None)));
    let (kp, kel) = generator.kernel_only(chunk, secs, k);
    let k_gbs = kp as f64 * chunk as f64 / kel / 1e9;
    let ps = port.stats().unwrap_or_default();
    println!(
        "chunk {chunk} B, W {W}, {S} slots ({} pushes a round), 1 lcore, kernels {}",
        generator.per_round(),
        Kernels::best().kind().name()
    );
    println!(
        "dataplane over ring: {:.3} Mpps, {:.2} GB/s gradient input ({pushes} pushes in {el:.2} s, {drops} drops, generator waits {waits}, lcore polls busy {busy} idle {idle}, port ipackets {} opackets {})",
        dp_pps / 1e6,
        dp_gbs,
        ps.ipackets,
        ps.opackets
    );
    println!(
        "kernel-only (engine from memory): {:.3} Mpps, {:.2} GB/s; ratio dataplane / kernel-only = {:.2}",
        kp as f64 / kel / 1e6,
        k_gbs,
        dp_gbs / k_gbs
    );
    drop(generator);
}
