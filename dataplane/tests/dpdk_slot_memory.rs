//! The DPDK backend's slot memory comes from DPDK's heap: DPDK's heap
//! counters grow by a job's slot buffers (in blocks of several slots) when
//! it is installed and shrink back
//! when it is removed; an install the heap cannot hold is refused whole
//! (nothing of the job stays on any lcore, every block is freed), and the
//! memory budget the dataplane reports does not exceed what a fixed
//! (`--no-huge`) heap has.
//!
//! One EAL for this test binary (`--no-huge -m 128`) and one test, so no
//! other test allocates from the heap while it is measured. Skips with a
//! printed reason where the EAL cannot start.

#![cfg(feature = "dpdk")]

mod common;

use std::net::Ipv4Addr;
use std::sync::Arc;

use phub_dataplane::app::{Appliance, BackendKind, Config, DpdkOptions};
use phub_dataplane::backend::dpdk::frame::PeerAddr;
use phub_dataplane::backend::dpdk::DpdkSlotMemory;
use phub_engine::{EngineError, InstallKind, JobInstall, Kernels, Shard, SlotAllocator};
use phub_ffi::malloc::{heap_stats, HeapStats};
use phub_ffi::{Eal, HeapSlice, Ring};
use phub_proto::api::InstallJob;
use phub_proto::layout::{layout, Chunks, SlotChunk};
use phub_proto::memory::ResultStore;
use phub_proto::spec::{JobSpec, Optimizer};
use phub_proto::Dtype;

/// Most allocator overhead per block: the heap element header and its
/// alignment.
const OVERHEAD_PER_BLOCK: u64 = 512;

fn eal() -> Option<Eal> {
    common::test_eal("phub-dpdk-slotmem-test", 128, "(0-2)@(0-1)")
}

fn heap(eal: Eal) -> HeapStats {
    heap_stats(eal, 0).unwrap()
}

/// Asserts the heap grew by `bytes` of slot buffers in `blocks` blocks.
fn assert_grew(before: &HeapStats, after: &HeapStats, bytes: u64, blocks: u64, what: &str) {
    let grew = after.allocated_bytes - before.allocated_bytes;
    println!(
        "{what}: the DPDK heap grew by {grew} bytes for {bytes} bytes of slot buffers in {blocks} blocks"
    );
    assert!(
        grew >= bytes && grew <= bytes + blocks * OVERHEAD_PER_BLOCK,
        "{what}: the heap grew by {grew} bytes for {bytes} bytes of slot buffers in {blocks} blocks"
    );
    assert_eq!(
        u64::from(after.alloc_count - before.alloc_count),
        blocks,
        "{what}: one allocation per block"
    );
}

fn sum_spec(elements: &[u64], chunk_bytes: u32) -> JobSpec {
    let mut t =
        format!("name = \"m\"\nworkers = 2\nchunk_bytes = {chunk_bytes}\n[optimizer]\nkind = \"sum\"\n");
    for e in elements {
        t += &format!("[[keys]]\nelements = {e}\n");
    }
    JobSpec::from_toml(&t).unwrap()
}

#[test]
fn slots_live_in_the_dpdk_heap_and_an_install_it_cannot_hold_is_refused_whole() {
    let Some(eal) = eal() else { return };

    // The engine over DPDK's allocator, on the test thread.
    let mem = Arc::new(DpdkSlotMemory::new(eal, Some(0)));
    assert_eq!(mem.describe(), "DPDK heap, socket 0, hugepages: no");
    let mut shard: Shard<PeerAddr> = Shard::with_slot_memory(0, Kernels::best(), mem.clone());
    let adam = Optimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let job = |id, slots: u32| JobInstall {
        id,
        token: 1,
        workers: 2,
        dtype: Dtype::F32,
        optimizer: adam,
        consistency: Default::default(),
        chunk_elems: 2048,
        slots: (0..slots)
            .map(|chunk| SlotChunk {
                key: 0,
                chunk,
                elems: 2048,
            })
            .collect(),
    };
    let before = heap(eal);
    shard.install(job(1, 64), InstallKind::Plain).unwrap();
    // Acc, params and two moments per slot, 32 KiB: 64 slots to a 2 MiB block.
    let data = 64 * 4 * 4 * 2048;
    let model = phub_engine::engine::memory_model(&*mem);
    let bytes = shard.job_memory_bytes(1).unwrap();
    assert_eq!(
        bytes,
        data + 64 * u64::from(model.slot_bytes)
            + u64::from(model.block_overhead_bytes)
            + u64::from(model.lcore_job_bytes)
            + 2 * u64::from(model.rank_bytes)
    );
    assert_grew(&before, &heap(eal), data, 1, "engine install");
    assert!(shard.remove(1));
    let after = heap(eal);
    assert_eq!(
        (after.allocated_bytes, after.alloc_count),
        (before.allocated_bytes, before.alloc_count),
        "removing the job gave every block back"
    );
    // 32 KiB per slot: 4096 slots are more than the whole 128 MiB heap.
    let e = shard.install(job(2, 4096), InstallKind::Plain).unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(
            e,
            EngineError::SlotMemory {
                id: 2,
                slots: 4096,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        text.contains(&format!("{} bytes of slot memory", 4096u64 * 4 * 4 * 2048))
            && text.contains("DPDK heap, socket 0")
            && text.contains("has no room for"),
        "{text}"
    );
    assert_eq!(
        shard.job_ids().count(),
        0,
        "nothing of the refused job is installed"
    );
    let after = heap(eal);
    assert_eq!(
        (after.allocated_bytes, after.alloc_count),
        (before.allocated_bytes, before.alloc_count),
        "the blocks the refused install got were freed"
    );
    drop(shard);

    // The whole DPDK dataplane on a port made of rings, two lcores.
    let rx: Vec<Ring> = (0..2)
        .map(|_| Ring::create(eal, "mrx", 256, None).unwrap())
        .collect();
    let tx: Vec<Ring> = (0..2)
        .map(|_| Ring::create(eal, "mtx", 256, None).unwrap())
        .collect();
    let id = eal.port_from_rings("net_ring_slotmem", &rx, &tx, 0).unwrap();
    let cfg = Config {
        backend: BackendKind::Dpdk,
        host: Ipv4Addr::new(10, 79, 0, 1),
        base_port: 7900,
        lcores: Some(2),
        mgmt: "127.0.0.1:0".parse().unwrap(),
        mgmt_token_file: None,
        memory_budget: 1 << 30,
        busy_poll: false,
        spin_us: phub_dataplane::spin::SpinSetting::Fixed(0),
        inject: None,
        no_pin: true,
        socket_buffer: 0,
        shm: false,
        build: "test".into(),
        dpdk: DpdkOptions {
            port: id.to_string(),
            mbufs: 1024,
            mbuf_size: 9216 + 128,
            tx_mbufs: 1024,
            idle_backoff: true,
            ..DpdkOptions::default()
        },
    };
    let app = Appliance::start(&cfg).unwrap();
    let mgr = app.manager();
    let info = mgr.info();
    let free = heap(eal).free_bytes;
    assert_eq!(info.slot_memory, "DPDK heap, socket 0, hugepages: no");
    assert!(
        info.memory_budget_bytes <= free,
        "the budget ({} bytes) is capped to the fixed heap's {free} free bytes, not the 1 GiB asked",
        info.memory_budget_bytes
    );
    let install = |id: u16, spec: JobSpec| {
        let mut load = vec![0; 2];
        let lay = layout(
            &spec,
            &mut load,
            info.memory_model.chunk_cost(&spec, ResultStore::Slot),
        );
        mgr.install(
            id,
            InstallJob {
                id,
                token: 5,
                spec,
                layout: lay,
                hierarchy: None,
                replication: None,
                entries: None,
            },
        )
    };

    // Installed through the management API: the heap grows by the job's
    // slot bytes, and shrinks back when it is removed.
    let before = heap(eal);
    let spec = sum_spec(&[100_000, 3000], 8192);
    let lay = layout(
        &spec,
        &mut [0, 0],
        info.memory_model.chunk_cost(&spec, ResultStore::Slot),
    );
    let cost = info.memory_model.job_cost(&spec, &lay, ResultStore::Slot);
    let w = info
        .memory_model
        .data_weights(&spec, &Chunks::new(&spec), ResultStore::Slot);
    // Acc and result per element, each buffer a whole number of lines.
    let data = w.total();
    assert!((2 * 4 * 103_000..2 * 4 * 103_000 + 51 * 2 * 64).contains(&data));
    let per_block = info.memory_model.slots_per_block(&spec, ResultStore::Slot);
    let blocks: u64 = lay.lcores.iter().map(|r| r.count.div_ceil(per_block)).sum();
    let j = install(3, spec).unwrap();
    assert_eq!(j.memory_bytes, cost.total(), "what admission charges");
    assert_eq!(mgr.info().memory_used_bytes, cost.total());
    assert_grew(&before, &heap(eal), data, blocks, "management install");
    mgr.remove(3).unwrap();
    let after = heap(eal);
    assert_eq!(
        after.allocated_bytes, before.allocated_bytes,
        "removed: back to where it was"
    );

    // Beyond the budget: refused by the admission check, naming the bytes.
    let e = install(4, sum_spec(&[info.memory_budget_bytes / 4], 8192)).unwrap_err();
    assert_eq!(e.status, 507, "{e:?}");
    assert!(e.message.contains("bytes of memory"), "{}", e.message);

    // Within the budget, but the heap has shrunk since (a ballast taken
    // after start): lcore 0's half fits, lcore 1's does not. The install is
    // refused with 507, lcore 0's slots are freed, no job stays.
    let f0 = heap(eal).free_bytes;
    let per_lcore = f0 * 2 / 5;
    let ballast = HeapSlice::<u8>::zeroed(eal, (f0 - 3 * per_lcore / 2) as usize, 64, Some(0)).unwrap();
    let elements = 2 * per_lcore / 8;
    let s5 = sum_spec(&[elements], 8192);
    let l5 = layout(
        &s5,
        &mut [0, 0],
        info.memory_model.chunk_cost(&s5, ResultStore::Slot),
    );
    assert!(
        info.memory_model.job_cost(&s5, &l5, ResultStore::Slot).total() < info.memory_budget_bytes,
        "the job is within the budget"
    );
    let before = heap(eal);
    let e = install(5, sum_spec(&[elements], 8192)).unwrap_err();
    assert_eq!(e.status, 507, "{e:?}");
    assert!(
        e.message.starts_with("job 5 not installed: lcore 1: job 5: ")
            && e.message.contains("bytes of slot memory")
            && e.message.contains("DPDK heap, socket 0"),
        "{}",
        e.message
    );
    assert!(mgr.list().is_empty(), "no job stays: {:?}", mgr.list());
    assert_eq!(mgr.info().memory_used_bytes, 0);
    let after = heap(eal);
    assert_eq!(
        (after.allocated_bytes, after.alloc_count),
        (before.allocated_bytes, before.alloc_count),
        "lcore 0's slots were freed when lcore 1 could not hold its own"
    );
    // With the ballast gone the same job fits: it was the heap, not the job.
    drop(ballast);
    install(5, sum_spec(&[elements], 8192)).unwrap();
    mgr.remove(5).unwrap();
    app.shutdown();
}
