//! The engine's unit tests: allocation failures, memory accounting,
//! checkpoints of every result kind, eviction, receive-buffer shares and
//! hierarchical peers.
// Tests cast small, literal sizes.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicUsize, Ordering};

use phub_proto::layout::{ChunkRange, SlotChunk};
use phub_proto::memory::ResultStore;
use phub_proto::wire::MAX_PAYLOAD;

use super::slot::SlotMem;
use super::*;
use crate::slotmem::{RustHeap, SlotAllocator, SlotBlock};

/// Rust-heap blocks, at most `left` of them, counting the live ones.
#[derive(Debug)]
struct Limited {
    left: AtomicUsize,
    live: Arc<AtomicUsize>,
}

#[derive(Debug)]
struct Counted(Box<dyn SlotBlock>, Arc<AtomicUsize>);

impl SlotBlock for Counted {
    fn as_slice(&self) -> &[f32] {
        self.0.as_slice()
    }
    fn as_mut_slice(&mut self) -> &mut [f32] {
        self.0.as_mut_slice()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.1.fetch_sub(1, Ordering::Relaxed);
    }
}

impl SlotAllocator for Limited {
    fn zeroed(&self, len: usize) -> Result<Box<dyn SlotBlock>, String> {
        if self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(1))
            .is_err()
        {
            return Err(format!("no room for {} bytes", 4 * len));
        }
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(Counted(RustHeap.zeroed(len)?, Arc::clone(&self.live))))
    }
    fn describe(&self) -> String {
        "test heap".into()
    }
}

fn job(id: u16, dtype: Dtype, optimizer: Optimizer, slots: u32, elems: u32) -> JobInstall {
    JobInstall {
        id,
        token: 7,
        workers: 2,
        dtype,
        optimizer,
        consistency: Default::default(),
        chunk_elems: elems,
        slots: (0..slots)
            .map(|chunk| SlotChunk { key: 0, chunk, elems })
            .collect(),
    }
}

/// The lcores at `addrs`, holding `runs`.
fn peers(addrs: Vec<SocketAddrV4>, runs: &[ChunkRange]) -> Peers<SocketAddrV4> {
    Peers {
        addrs,
        runs: runs.to_vec(),
    }
}

#[test]
fn an_install_the_allocator_cannot_hold_is_refused_whole() {
    let live = Arc::new(AtomicUsize::new(0));
    let mem = Arc::new(Limited {
        left: AtomicUsize::new(0),
        live: Arc::clone(&live),
    });
    let mut s: Shard<u32> = Shard::with_slot_memory(0, Kernels::best(), mem.clone());
    let opt = Optimizer::Adam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    // Full bf16 chunks: acc, params, s1, s2 of 4416 f32 and the result's
    // 4416 bf16 (2208 f32), each a whole number of lines.
    let elems = (MAX_PAYLOAD / 2) as u32;
    let per_slot = 4 * (4 * 4416 + 2208);
    assert_eq!(
        4 * Slot::block_len(elems, Dtype::Bf16, &opt, ResultStore::Slot),
        per_slot
    );
    let per_block = BLOCK_BYTES as usize / per_slot;
    assert_eq!(per_block, 26);
    // 100 slots: three blocks of 26 and one of 22.
    mem.left.store(3, Ordering::Relaxed);
    let e = s
        .install(job(4, Dtype::Bf16, opt, 100, elems), InstallKind::Plain)
        .unwrap_err();
    assert_eq!(
        e,
        EngineError::SlotMemory {
            id: 4,
            bytes: 100 * per_slot as u64,
            slots: 100,
            from: "test heap".into(),
            reason: format!("no room for {} bytes", 22 * per_slot),
        }
    );
    assert!(
        e.to_string().contains(&format!(
            "{} bytes of slot memory for 100 slots do not fit (test heap)",
            100 * per_slot
        )),
        "{e}"
    );
    assert_eq!(
        live.load(Ordering::Relaxed),
        0,
        "the three blocks given were freed"
    );
    assert_eq!(s.job_ids().count(), 0, "nothing of the job is installed");
    mem.left.store(4, Ordering::Relaxed);
    s.install(job(4, Dtype::Bf16, opt, 100, elems), InstallKind::Plain)
        .unwrap();
    assert_eq!(live.load(Ordering::Relaxed), 4, "26 slots to a block");
    assert_eq!(s.slot_memory().describe(), "test heap");
    assert!(s.remove(4));
    assert_eq!(live.load(Ordering::Relaxed), 0);
}

/// What an lcore counts a job as holding is what admission charges it
/// (`MemoryModel::job_cost`), slot by slot as the engine carves them,
/// for every dtype, optimizer, with and without shared memory's result
/// region, over lcores of a real layout.
#[test]
fn a_job_holds_what_the_memory_model_charges() {
    use phub_proto::layout::{layout, Placement};
    use phub_proto::memory::slot_buffers;
    use phub_proto::spec::JobSpec;
    let opts = [
        "kind = \"sum\"",
        "kind = \"mean\"",
        "kind = \"sgd\"\nlr = 0.1",
        "kind = \"momentum\"\nlr = 0.1",
        "kind = \"adam\"\nlr = 0.1",
    ];
    let mem: Arc<dyn SlotAllocator> = Arc::new(RustHeap);
    let model = memory_model(&*mem);
    for opt in opts {
        for dtype in Dtype::ALL {
            for store in [ResultStore::Slot, ResultStore::SharedRegion] {
                for elems in [1u32, 15, 16, 17, 1000] {
                    let o: Optimizer = JobSpec::from_toml(&format!(
                        "name = \"m\"\nworkers = 3\n[optimizer]\n{opt}\n[[keys]]\nelements = 1\n"
                    ))
                    .unwrap()
                    .optimizer;
                    let r = Slot::result_kind(dtype, &o, store);
                    assert_eq!(
                        SlotMem::regions(elems as usize, r, &o),
                        slot_buffers(dtype, &o, elems, store),
                        "{dtype} {opt} {store:?}"
                    );
                }
            }
            // Keys of one short chunk, many full ones, and in between.
            let spec = JobSpec::from_toml(&format!(
                "name = \"m\"\nworkers = 3\nchunk_bytes = 128\ndtype = \"{dtype}\"\n[optimizer]\n{opt}\n\
                 [[keys]]\nelements = 5\n[[keys]]\nelements = 300000\n[[keys]]\nelements = 77\n"
            ))
            .unwrap();
            let o = spec.optimizer;
            let l = layout(&spec, &mut [0, 0, 0], model.chunk_cost(&spec, ResultStore::Slot));
            let cost = model.job_cost(&spec, &l, ResultStore::Slot);
            let p = Placement::new(&spec, l.clone()).unwrap();
            for (lcore, want) in cost.lcores.iter().enumerate() {
                let mut s: Shard<u32> = Shard::with_slot_memory(lcore as u16, Kernels::best(), mem.clone());
                s.install(
                    JobInstall {
                        id: 1,
                        token: 7,
                        workers: 3,
                        dtype,
                        optimizer: o,
                        consistency: Default::default(),
                        chunk_elems: l.chunk_elems,
                        slots: p.slots(lcore).collect(),
                    },
                    InstallKind::Plain,
                )
                .unwrap();
                assert_eq!(s.job_memory_bytes(1), Some(*want), "{dtype} {opt} lcore {lcore}");
            }
        }
    }
}

fn push(dtype: Dtype, rank: u16, round: u32, slot: u32, vals: &[f32]) -> Vec<u8> {
    let carries = round > 0 || rank == 0;
    let n = if carries { vals.len() } else { 0 };
    let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
    let repr = Repr::request(kind, 1, 7, rank, round, slot)
        .with_payload(dtype, n as u16)
        .with_chunk(0, slot);
    repr.to_datagram(&vals[..n])
}

/// A PULL as a worker sends it after a refusal `ahead` (RESYNC, PROTOCOL.md
/// §5.4 rule 0; a first copy lifts the rule without it too).
fn pull(dtype: Dtype, rank: u16, slot: u32) -> Vec<u8> {
    Repr::request(MsgType::Pull, 1, 7, rank, 0, slot)
        .with_payload(dtype, 0)
        .with_chunk(0, slot)
        .with_flags(wire::flags::RESYNC)
        .to_datagram(&[])
}

/// Each of `ranks` pulls each of the two slots, answered.
fn pull_every_slot(s: &mut Shard<u32>, dtype: Dtype, ranks: u16) {
    for rank in 0..ranks {
        for slot in 0..2 {
            assert_eq!(
                s.handle(u32::from(rank), &pull(dtype, rank, slot), 1),
                Verdict::Pulled
            );
        }
    }
    s.clear_transmits();
}

fn rounds(s: &mut Shard<u32>, dtype: Dtype, from: u32, to: u32) {
    for round in from..to {
        for slot in 0..2 {
            for rank in 0..2u16 {
                let vals: Vec<f32> = (0..37)
                    .map(|e| (e as f32 * 0.25 - 3.0) * f32::from(rank + 1) + round as f32)
                    .collect();
                let v = s.handle(u32::from(rank), &push(dtype, rank, round, slot, &vals), 1);
                assert!(!matches!(v, Verdict::Dropped(_)), "{v:?}");
            }
        }
        s.clear_transmits();
    }
}

#[test]
fn a_snapshot_restores_every_result_kind_exactly() {
    let adam = Optimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let cases = [
        (Dtype::F32, Optimizer::Sum),
        (Dtype::F32, adam),
        (Dtype::Bf16, Optimizer::Mean),
        (Dtype::F16, adam),
    ];
    for (dtype, opt) in cases {
        // Odd and even round counts: the f32 result and accumulator
        // have traded places an odd or even number of times.
        for done in [3, 4] {
            let mut a: Shard<u32> = Shard::new(0, Kernels::best());
            a.install(job(1, dtype, opt, 2, 37), InstallKind::Plain).unwrap();
            rounds(&mut a, dtype, 0, done);
            let saved = a.snapshot(1).unwrap();
            let mut b: Shard<u32> = Shard::new(0, Kernels::best());
            b.install(job(1, dtype, opt, 2, 37), InstallKind::Plain).unwrap();
            b.restore(1, &saved).unwrap();
            for slot in 0..2 {
                assert_eq!(
                    a.result(1, slot),
                    b.result(1, slot),
                    "{dtype:?} {opt:?} slot {slot}"
                );
                assert_eq!(a.params(1, slot), b.params(1, slot));
            }
            assert_eq!(b.snapshot(1).unwrap(), saved);
            // The restored shard goes on exactly as the original does, once
            // each rank pulled (PROTOCOL.md §5.4 rule 0).
            pull_every_slot(&mut b, dtype, 2);
            rounds(&mut a, dtype, done, done + 2);
            rounds(&mut b, dtype, done, done + 2);
            for slot in 0..2 {
                let (r, bytes) = b.result(1, slot).unwrap();
                assert_eq!(r, done + 1);
                assert_eq!(bytes.len(), 37 * dtype.size());
                assert_eq!(
                    a.result(1, slot),
                    b.result(1, slot),
                    "{dtype:?} {opt:?} slot {slot}"
                );
            }
            // Two slots of 37 elements in one block, as admission counts them.
            let model = memory_model(&RustHeap);
            let want = 2 * model.slot_data_bytes(dtype, &opt, 37, ResultStore::Slot)
                + 2 * u64::from(model.slot_bytes)
                + u64::from(model.block_overhead_bytes)
                + u64::from(model.lcore_job_bytes)
                + 2 * u64::from(model.rank_bytes);
            assert_eq!(a.job_memory_bytes(1), Some(want));
        }
    }
}

#[test]
fn an_evicted_jobs_ranks_get_an_error_for_a_minute() {
    let mut s: Shard<u32> = Shard::new(0, Kernels::best());
    s.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37), InstallKind::Plain)
        .unwrap();
    let vals = [1.0f32; 37];
    assert!(s.evict(1, 1_000));
    assert!(!s.evict(1, 1_000), "already gone");
    let p = push(Dtype::F32, 0, 0, 0, &vals);
    assert_eq!(s.handle(9, &p, 2_000), Verdict::Dropped(DropReason::Evicted));
    let t = s.transmits().next().expect("an ERROR");
    let (e, _) = wire::parse(&t.header).unwrap();
    assert_eq!(
        (e.kind, e.error, e.job, e.token),
        (MsgType::Error, DropReason::Evicted.code(), 1, 7)
    );
    assert_eq!(t.to.collect::<Vec<_>>(), [9]);
    s.clear_transmits();
    // Another token is not the evicted job's: dropped, unanswered.
    let mut other = p.clone();
    wire::Header::new_unchecked(&mut other[..]).set_token(8);
    assert_eq!(
        s.handle(9, &other, 2_000),
        Verdict::Dropped(DropReason::UnknownJob)
    );
    // A new job under the same id: the old token still hears `evicted`,
    // the new one is served.
    let mut again = job(1, Dtype::F32, Optimizer::Sum, 2, 37);
    again.token = 8;
    s.install(again, InstallKind::Plain).unwrap();
    assert_eq!(s.handle(9, &p, 3_000), Verdict::Dropped(DropReason::Evicted));
    assert!(!matches!(s.handle(9, &other, 3_000), Verdict::Dropped(_)));
    s.clear_transmits();
    // After a minute, an unknown job again.
    s.remove(1);
    let later = 1_000 + EVICTED_FOR_NS;
    assert_eq!(s.handle(9, &p, later), Verdict::Dropped(DropReason::UnknownJob));
    assert!(!s.has_transmits());
    assert_eq!(s.counters().drops_of(DropReason::Evicted), 2);
}

/// A PULL of a chunk with no completed round is refused with an ERROR
/// `nothing_to_pull` (PROTOCOL.md §5.5): a rank past round 0 that pulls
/// from an appliance restored from a checkpoint taken before round 0
/// completed learns that it must send its INIT again (unanswered, it
/// waited for ever). Once round 0 completes, the PULL is answered.
#[test]
fn a_pull_before_round_0_completed_is_refused_with_an_error() {
    let mut s: Shard<u32> = Shard::new(0, Kernels::best());
    s.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37), InstallKind::Plain)
        .unwrap();
    let pull = Repr::request(MsgType::Pull, 1, 7, 1, 3, 0)
        .with_payload(Dtype::F32, 0)
        .with_chunk(0, 0)
        .to_datagram(&[]);
    assert_eq!(s.handle(9, &pull, 1), Verdict::Dropped(DropReason::NothingToPull));
    let t = s.transmits().next().expect("an ERROR");
    let (e, _) = wire::parse(&t.header).unwrap();
    assert_eq!(
        (e.kind, e.error, e.rank, e.round, e.slot),
        (MsgType::Error, DropReason::NothingToPull.code(), 1, 3, 0)
    );
    assert_eq!(t.to.collect::<Vec<_>>(), [9]);
    s.clear_transmits();
    // The rank's INIT again completes round 0 with rank 0's; the PULL is
    // then answered.
    rounds(&mut s, Dtype::F32, 0, 1);
    assert_eq!(s.handle(9, &pull, 2), Verdict::Pulled);
    assert_eq!(s.counters().pulls_answered.get(), 1);
}

/// PROTOCOL.md §5.4 rule 0: an lcore restored from a checkpoint refuses
/// each rank's INITs and PUSHes `ahead`, with an ERROR, until that rank
/// pulls: the checkpoint may be older than the rounds the rank holds
/// results of, and a rank that holds one would never push it again (the
/// simulator's seed 2317: two ranks each waited for a round 0 that needed
/// the other's INIT). A PULL of any slot of the lcore lifts it for that
/// rank alone (a probe's does not, nor a retransmitted one without
/// RESYNC); a round then completes as before.
#[test]
fn a_restored_lcore_refuses_each_rank_until_it_pulls() {
    let mut a: Shard<u32> = Shard::new(0, Kernels::best());
    a.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37), InstallKind::Plain)
        .unwrap();
    rounds(&mut a, Dtype::F32, 0, 2);
    let saved = a.snapshot(1).unwrap();
    let mut b: Shard<u32> = Shard::new(0, Kernels::best());
    b.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37), InstallKind::Plain)
        .unwrap();
    b.restore(1, &saved).unwrap();
    let vals = [1.0f32; 37];
    // Round 2 is the round in progress; round 1 the last completed: both
    // refused before a pull, the INIT too.
    for (round, slot) in [(2, 0), (1, 1), (0, 0)] {
        let v = b.handle(5, &push(Dtype::F32, 1, round, slot, &vals), 1);
        assert_eq!(v, Verdict::Dropped(DropReason::Ahead), "round {round}");
        let t = b.transmits().next().expect("an ERROR");
        let (e, _) = wire::parse(&t.header).unwrap();
        assert_eq!(
            (e.kind, e.error, e.rank, e.round, e.slot),
            (MsgType::Error, DropReason::Ahead.code(), 1, round, slot)
        );
        assert_eq!(t.to.collect::<Vec<_>>(), [5]);
        b.clear_transmits();
    }
    // A probe (PROTOCOL.md §6.1, "A stalled rank") is answered but lifts
    // nothing: it asks a few chunks and may miss those the lcore lost. Nor
    // does a retransmitted PULL without RESYNC: its first copy may have
    // gone before the restore, asking only what the rank asked then
    // (simulator seed 1114154).
    for (round, flags) in [(9, wire::flags::PROBE), (0, wire::flags::RETRANSMIT)] {
        let p = Repr::request(MsgType::Pull, 1, 7, 1, round, 1)
            .with_payload(Dtype::F32, 0)
            .with_chunk(0, 1)
            .with_flags(flags)
            .to_datagram(&[]);
        assert_eq!(b.handle(5, &p, 1), Verdict::Pulled);
        b.clear_transmits();
        assert_eq!(
            b.handle(5, &push(Dtype::F32, 1, 2, 0, &vals), 1),
            Verdict::Dropped(DropReason::Ahead),
            "after a PULL with flags {flags:#x}"
        );
        b.clear_transmits();
    }
    // Rank 1 pulls slot 1: answered, and its pushes to either slot are
    // taken; rank 0's are still refused.
    assert_eq!(b.handle(5, &pull(Dtype::F32, 1, 1), 1), Verdict::Pulled);
    b.clear_transmits();
    assert_eq!(
        b.handle(5, &push(Dtype::F32, 1, 2, 0, &vals), 1),
        Verdict::Aggregated
    );
    assert_eq!(
        b.handle(4, &push(Dtype::F32, 0, 2, 0, &vals), 1),
        Verdict::Dropped(DropReason::Ahead)
    );
    b.clear_transmits();
    assert_eq!(b.handle(4, &pull(Dtype::F32, 0, 0), 1), Verdict::Pulled);
    assert_eq!(
        b.handle(4, &push(Dtype::F32, 0, 2, 0, &vals), 1),
        Verdict::Completed
    );
    assert_eq!(b.result(1, 0).map(|(r, _)| r), Some(2));
    // A shard that was never restored refuses nothing of the kind.
    rounds(&mut a, Dtype::F32, 2, 3);
}

/// Every RESULT states its job's share of the lcore's receive buffer,
/// as it is now: by W among the jobs with slots here.
#[test]
fn results_state_the_jobs_current_share_of_the_receive_buffer() {
    let mut s: Shard<u32> = Shard::new(0, Kernels::best());
    s.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37), InstallKind::Plain)
        .unwrap();
    let vals = [1.0f32; 37];
    // The share the next round's RESULT (slot 0, both ranks in) states.
    let share = |s: &mut Shard<u32>, round: u32| {
        for rank in 0..2 {
            s.handle(9 + u32::from(rank), &push(Dtype::F32, rank, round, 0, &vals), 1);
        }
        let t = s.transmits().next().expect("a RESULT");
        let h = wire::Header::new_unchecked(&t.header[..]);
        assert_eq!(h.type_code(), MsgType::Result.code());
        let share = h.rx_share();
        s.clear_transmits();
        share
    };
    assert_eq!(share(&mut s, 0), 0, "no buffer known: nothing stated");
    s.set_rx_buffer(Some(1 << 20));
    assert_eq!(share(&mut s, 1), 1 << 20, "alone: the whole buffer");
    // Another job of W = 6 (ids apart, workers 6) with slots here.
    let mut other = job(2, Dtype::F32, Optimizer::Sum, 1, 37);
    other.workers = 6;
    s.install(other, InstallKind::Plain).unwrap();
    assert_eq!(share(&mut s, 2), (1 << 20) * 2 / 8);
    assert!(s.remove(2));
    assert_eq!(share(&mut s, 3), 1 << 20, "the whole buffer again");
}

/// A hierarchical job's rack slots hear from its rack's ranks, and its
/// home slots from every rack's appliance: those are its senders here,
/// not its W.
#[test]
fn a_hierarchical_jobs_share_counts_its_rack_ranks_and_the_racks() {
    let mut s: Shard<u32> = Shard::new(0, Kernels::best());
    s.set_peer_resolver(std::sync::Arc::new(|a: SocketAddrV4| Some(u32::from(a.port()))));
    s.set_rx_buffer(Some(1 << 20));
    let at = |port| vec![SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)];
    let runs = vec![ChunkRange { first: 0, count: 4 }];
    let mut rack = job(1, Dtype::F32, Optimizer::Sum, 4, 37);
    rack.workers = 8;
    let hier = |home_slots: Vec<SlotChunk>| HierInstall {
        rack: 1,
        ranks: 5..8,
        optimizer: Optimizer::Sum,
        first: 0,
        racks: vec![peers(at(1), &runs), peers(at(2), &runs)],
        homes: peers(at(1), &runs),
        home_first: 0,
        home_slots,
        replica: None,
    };
    s.install(
        rack.clone(),
        InstallKind::Hierarchical(Box::new(hier(Vec::new()))),
    )
    .unwrap();
    let share = |s: &Shard<u32>| s.rx_share(s.job(1).unwrap());
    assert_eq!(share(&s), 1 << 20, "its 3 ranks alone: the whole buffer");
    let mut flat = job(2, Dtype::F32, Optimizer::Sum, 1, 37);
    flat.workers = 3;
    s.install(flat, InstallKind::Plain).unwrap();
    assert_eq!(share(&s), (1 << 20) * 3 / 6, "3 rack ranks beside a W = 3 job");
    assert!(s.remove(1));
    let home = (0..4)
        .map(|chunk| SlotChunk {
            key: 0,
            chunk,
            elems: 37,
        })
        .collect();
    s.install(rack, InstallKind::Hierarchical(Box::new(hier(home))))
        .unwrap();
    assert_eq!(
        share(&s),
        (1 << 20) * 3 / 8,
        "and the 2 racks' partials to its home slots here"
    );
}

/// A home slot takes a rack's PARTIAL only from the address of that
/// rack appliance's lcore holding the chunk's rack slot (PROTOCOL.md
/// §9.4). Reproduction (issue 36, finding 3), on the code before: after
/// round 0, one PARTIAL of round 1 naming rack 1, with the job's token
/// but from another address (99, say a worker's), was added as rack
/// 1's partial; the real rack 1's partial was then `duplicate`, and the
/// round's result was 2 + 1000 instead of 2 + 3, for every rank of both
/// racks, with no counter showing it.
#[test]
fn a_partial_from_other_than_its_racks_address_is_wrong_peer() {
    // Addresses are the install's ports: rack 0's lcore at 1 (this
    // one, home of the chunk), rack 1's at 2.
    let mut s: Shard<u32> = Shard::new(0, Kernels::best());
    s.set_peer_resolver(Arc::new(|a: SocketAddrV4| Some(u32::from(a.port()))));
    let at = |port| vec![SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)];
    let runs = vec![ChunkRange { first: 0, count: 1 }];
    let mut rack = job(1, Dtype::F32, Optimizer::Sum, 1, 4);
    rack.workers = 2;
    let chunk = SlotChunk {
        key: 0,
        chunk: 0,
        elems: 4,
    };
    s.install(
        rack,
        InstallKind::Hierarchical(Box::new(HierInstall {
            rack: 0,
            ranks: 0..1,
            optimizer: Optimizer::Sum,
            first: 0,
            racks: vec![peers(at(1), &runs), peers(at(2), &runs)],
            homes: peers(at(1), &runs),
            home_first: 0,
            home_slots: vec![chunk],
            replica: None,
        })),
    )
    .unwrap();
    let partial = |rack: u16, round: u32, vals: &[f32]| {
        let repr = Repr::request(MsgType::Partial, 1, 7, rack, round, 0)
            .with_payload(Dtype::F32, vals.len() as u16)
            .with_chunk(0, 0);
        repr.to_datagram(vals)
    };
    let wrong = Verdict::Dropped(DropReason::WrongPeer);
    // Round 0: rack 0 carries the initial values, rack 1 says it is in;
    // a forged round-0 partial of rack 0 is refused first.
    assert_eq!(s.handle(99, &partial(0, 0, &[9.0; 4]), 1), wrong);
    assert_eq!(s.handle(1, &partial(0, 0, &[0.5; 4]), 2), Verdict::Aggregated);
    assert_eq!(s.handle(2, &partial(1, 0, &[]), 3), Verdict::Completed);
    s.clear_transmits();
    // Round 1: rack 1's partial forged from a worker's address, and
    // from rack 0's (an appliance speaking for another rack).
    assert_eq!(s.handle(99, &partial(1, 1, &[1000.0; 4]), 4), wrong);
    assert_eq!(s.handle(1, &partial(1, 1, &[1000.0; 4]), 5), wrong);
    assert!(!s.has_transmits());
    assert_eq!(s.handle(1, &partial(0, 1, &[2.0; 4]), 6), Verdict::Aggregated);
    assert_eq!(s.handle(2, &partial(1, 1, &[3.0; 4]), 7), Verdict::Completed);
    let mut to = Vec::new();
    for t in s.transmits() {
        let mut d = t.header.to_vec();
        d.extend_from_slice(t.payload);
        let (r, payload) = wire::parse(&d).unwrap();
        assert_eq!((r.kind, r.round), (MsgType::PartialResult, 1));
        assert_eq!(
            payload,
            bytemuck::cast_slice::<f32, u8>(&[5.0; 4]),
            "2 + 3, exact"
        );
        to.extend(t.to);
    }
    assert_eq!(to, [1, 2], "to each rack's slot, from the install");
    s.clear_transmits();
    // A forged copy of the completed round gets no resend of the result;
    // the rack's own copy does.
    assert_eq!(s.handle(99, &partial(1, 1, &[1000.0; 4]), 8), wrong);
    assert!(!s.has_transmits());
    assert_eq!(s.handle(2, &partial(1, 1, &[3.0; 4]), 9), Verdict::Resent);
    assert_eq!(s.counters().drops_of(DropReason::WrongPeer), 4);
    assert_eq!(s.counters().drops_of(DropReason::Duplicate), 0);
}

#[test]
fn a_shard_shutting_down_tells_each_rank_it_knows_and_refuses_the_rest() {
    let mut s: Shard<u32> = Shard::new(0, Kernels::best());
    s.install(job(1, Dtype::F32, Optimizer::Sum, 2, 37), InstallKind::Plain)
        .unwrap();
    let vals = [1.0f32; 37];
    // Rank 0 is heard from (address 9); rank 1 is not.
    let v = s.handle(9, &push(Dtype::F32, 0, 0, 0, &vals), 1_000);
    assert!(!matches!(v, Verdict::Dropped(_)), "{v:?}");
    s.clear_transmits();
    assert_eq!(s.shut_down(), 1);
    let t = s.transmits().next().expect("an ERROR to rank 0");
    let (e, _) = wire::parse(&t.header).unwrap();
    assert_eq!(
        (e.kind, e.error, e.job, e.token, e.rank, e.dtype),
        (
            MsgType::Error,
            DropReason::ShuttingDown.code(),
            1,
            7,
            0,
            Dtype::F32
        )
    );
    assert_eq!(t.to.collect::<Vec<_>>(), [9]);
    assert_eq!(s.transmits().count(), 1);
    s.clear_transmits();
    // Whatever comes later for the job is refused, to its sender.
    let p = push(Dtype::F32, 1, 0, 1, &vals);
    assert_eq!(
        s.handle(10, &p, 2_000),
        Verdict::Dropped(DropReason::ShuttingDown)
    );
    let t = s.transmits().next().expect("an ERROR to rank 1");
    let (e, _) = wire::parse(&t.header).unwrap();
    assert_eq!((e.error, e.rank, e.slot), (DropReason::ShuttingDown.code(), 1, 1));
    assert_eq!(t.to.collect::<Vec<_>>(), [10]);
    s.clear_transmits();
    // A message without the job's token is still not answered.
    let mut other = p.clone();
    wire::Header::new_unchecked(&mut other[..]).set_token(8);
    assert_eq!(
        s.handle(10, &other, 2_000),
        Verdict::Dropped(DropReason::BadToken)
    );
    assert!(!s.has_transmits());
    assert_eq!(s.counters().drops_of(DropReason::ShuttingDown), 1);
    assert_eq!(s.counters().errors_sent.get(), 2);
}
