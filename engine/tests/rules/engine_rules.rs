//! The engine's round rules and drop reasons, one packet at a time.

use phub_engine::kernels::{self, Kernels};
use phub_engine::{InstallKind, JobInstall, Shard, Verdict};
use phub_proto::layout::SlotChunk;
use phub_proto::memory::ResultStore;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, DropReason, MsgType, Repr, APPLIANCE_RANK, HEADER_LEN};
use phub_proto::Dtype;

const TOKEN: u64 = 0xabcdef;

fn shard(workers: u16, dtype: Dtype, optimizer: Optimizer) -> Shard<u32> {
    let mut s = Shard::new(0, Kernels::best());
    s.install(
        JobInstall {
            id: 1,
            token: TOKEN,
            workers,
            dtype,
            optimizer,
            consistency: Default::default(),
            chunk_elems: 4,
            slots: vec![
                SlotChunk {
                    key: 0,
                    chunk: 0,
                    elems: 4,
                },
                SlotChunk {
                    key: 0,
                    chunk: 1,
                    elems: 2,
                },
            ],
        },
        InstallKind::Plain,
    )
    .unwrap();
    s
}

fn msg(kind: MsgType, rank: u16, round: u32, slot: u32, values: &[f32]) -> Vec<u8> {
    let repr = Repr::request(kind, 1, TOKEN, rank, round, slot)
        .with_payload(Dtype::F32, values.len() as u16)
        .with_chunk(0, slot);
    repr.to_datagram(values)
}

/// Everything queued to send, as (destination, header, payload as f32).
fn drain(s: &mut Shard<u32>) -> Vec<(u32, Repr, Vec<f32>)> {
    let mut out = Vec::new();
    for t in s.transmits() {
        let mut b = t.header.to_vec();
        b.extend_from_slice(t.payload);
        let (repr, payload) = wire::parse(&b).unwrap();
        let mut v = vec![0f32; payload.len() / 4];
        kernels::decode(Dtype::F32, payload, &mut v);
        for to in t.to {
            out.push((to, repr, v.clone()));
        }
    }
    s.clear_transmits();
    out
}

#[test]
fn a_round_completes_once_and_reaches_every_rank() {
    let mut s = shard(2, Dtype::F32, Optimizer::Sum);
    assert_eq!(
        s.handle(10, &msg(MsgType::Init, 0, 0, 0, &[1., 2., 3., 4.]), 1),
        Verdict::Aggregated
    );
    assert_eq!(
        s.handle(10, &msg(MsgType::Init, 0, 0, 0, &[1., 2., 3., 4.]), 1),
        Verdict::Dropped(DropReason::Duplicate)
    );
    assert!(drain(&mut s).is_empty());
    assert_eq!(
        s.handle(11, &msg(MsgType::Init, 1, 0, 0, &[]), 2),
        Verdict::Completed
    );
    let out = drain(&mut s);
    assert_eq!(out.len(), 2);
    for (i, (to, repr, v)) in out.iter().enumerate() {
        assert_eq!(*to, 10 + i as u32);
        assert_eq!(
            (repr.kind, repr.round, repr.rank, repr.token),
            (MsgType::Result, 0, APPLIANCE_RANK, TOKEN)
        );
        assert_eq!(v, &[1., 2., 3., 4.]);
    }
    // Round 1: a sum; rank 1's retransmitted INIT re-obtains round 0's result.
    assert_eq!(
        s.handle(10, &msg(MsgType::Push, 0, 1, 0, &[1., 1., 1., 1.]), 3),
        Verdict::Aggregated
    );
    assert_eq!(
        s.handle(11, &msg(MsgType::Init, 1, 0, 0, &[]), 3),
        Verdict::Resent
    );
    let out = drain(&mut s);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0, out[0].1.round), (11, 0));
    assert_eq!(
        s.handle(11, &msg(MsgType::Push, 1, 1, 0, &[2., 2., 2., 5.]), 4),
        Verdict::Completed
    );
    let out = drain(&mut s);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].2, vec![3., 3., 3., 6.]);
    assert_eq!(s.result(1, 0).unwrap().0, 1);
    // A PULL gets the stored result and its round, to the asker alone.
    assert_eq!(
        s.handle(12, &msg(MsgType::Pull, 1, 0, 0, &[]), 5),
        Verdict::Pulled
    );
    let out = drain(&mut s);
    assert_eq!((out.len(), out[0].0, out[0].1.round), (1, 12, 1));
    assert_eq!(out[0].2, vec![3., 3., 3., 6.]);
    let c = s.counters();
    assert_eq!(c.rounds_completed.get(), 2);
    // One result resent (rank 1's INIT), one PULL answered: each counted
    // under its own counter.
    assert_eq!(c.results_resent.get(), 1);
    assert_eq!(c.pulls_answered.get(), 1);
    assert_eq!(c.results_sent.get(), 2 + 2 + 1 + 1);
    assert_eq!(c.drops_of(DropReason::Duplicate), 1);
}

/// PROTOCOL.md §5.4 rule 5: a PUSH for a round older than the last
/// completed one (a rank repeating rounds after a pull, whose later
/// contributions are in) gets the stored result, with its own round, to
/// that rank alone; nothing else changes. It was dropped `stale`, with
/// nothing sent, and the rank waited for ever (the simulator's finding:
/// a restore from a checkpoint older than the crash).
#[test]
fn a_round_older_than_the_last_completed_gets_the_stored_result() {
    let mut s = shard(2, Dtype::F32, Optimizer::Sum);
    s.handle(10, &msg(MsgType::Init, 0, 0, 0, &[1., 2., 3., 4.]), 1);
    s.handle(11, &msg(MsgType::Init, 1, 0, 0, &[]), 1);
    for round in 1..=2 {
        s.handle(10, &msg(MsgType::Push, 0, round, 0, &[1.; 4]), 2);
        s.handle(11, &msg(MsgType::Push, 1, round, 0, &[1.; 4]), 2);
    }
    drain(&mut s);
    assert_eq!(
        s.handle(10, &msg(MsgType::Push, 0, 1, 0, &[9.; 4]), 3),
        Verdict::Resent
    );
    let out = drain(&mut s);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(
        (out[0].0, out[0].1.kind, out[0].1.round),
        (10, MsgType::Result, 2)
    );
    assert_eq!(out[0].2, vec![2.; 4], "round 2's sum");
    assert_eq!(s.result(1, 0).unwrap().0, 2, "nothing else changes");
    let c = s.counters();
    assert_eq!((c.results_resent.get(), c.drops_total()), (1, 0));
}

#[test]
fn every_refusal_is_counted_under_its_reason() {
    let mut s = shard(2, Dtype::F32, Optimizer::Mean);
    let ok = |s: &mut Shard<u32>, b: &[u8]| assert!(!matches!(s.handle(1, b, 0), Verdict::Dropped(_)));
    let refuse = |s: &mut Shard<u32>, b: &[u8], r: DropReason| {
        assert_eq!(s.handle(1, b, 0), Verdict::Dropped(r));
    };
    refuse(
        &mut s,
        &msg(MsgType::Pull, 0, 0, 0, &[]),
        DropReason::NothingToPull,
    );
    refuse(
        &mut s,
        &msg(MsgType::Push, 0, 0, 0, &[1.; 4]),
        DropReason::WrongTypeForRound,
    );
    refuse(
        &mut s,
        &msg(MsgType::Init, 0, 1, 0, &[1.; 4]),
        DropReason::WrongTypeForRound,
    );
    refuse(
        &mut s,
        &msg(MsgType::Init, 0, 0, 0, &[1.; 3]),
        DropReason::CountMismatch,
    );
    refuse(
        &mut s,
        &msg(MsgType::Init, 1, 0, 0, &[1.; 4]),
        DropReason::CountMismatch,
    );
    refuse(
        &mut s,
        &msg(MsgType::Init, 0, 0, 2, &[1.; 4]),
        DropReason::SlotOutOfRange,
    );
    refuse(
        &mut s,
        &msg(MsgType::Init, 2, 0, 0, &[]),
        DropReason::RankOutOfRange,
    );
    refuse(
        &mut s,
        &msg(MsgType::Result, 0, 0, 0, &[1.; 4]),
        DropReason::NotForAppliance,
    );
    refuse(
        &mut s,
        &msg(MsgType::Error, 0, 0, 0, &[]),
        DropReason::NotForAppliance,
    );
    let mut b = msg(MsgType::Init, 0, 0, 0, &[1.; 4]);
    b[wire::field::TOKEN].copy_from_slice(&1u64.to_le_bytes());
    refuse(&mut s, &b, DropReason::BadToken);
    let mut b = msg(MsgType::Init, 0, 0, 0, &[1.; 4]);
    b[wire::field::JOB].copy_from_slice(&9u16.to_le_bytes());
    refuse(&mut s, &b, DropReason::UnknownJob);
    let mut b = msg(MsgType::Init, 0, 0, 0, &[1.; 4]);
    b[wire::field::KEY].copy_from_slice(&3u32.to_le_bytes());
    refuse(&mut s, &b, DropReason::ChunkMismatch);
    let mut b = msg(MsgType::Init, 0, 0, 0, &[1.; 4]);
    b[wire::field::DTYPE] = Dtype::Bf16.code();
    b[wire::field::COUNT].copy_from_slice(&8u16.to_le_bytes());
    refuse(&mut s, &b, DropReason::DtypeMismatch);
    refuse(&mut s, &b[..HEADER_LEN - 1], DropReason::Truncated);
    // The chunk in shared memory, on a job installed without regions.
    let mut b = msg(MsgType::Init, 0, 0, 0, &[1.; 4]);
    b.truncate(HEADER_LEN);
    b[wire::field::FLAGS] = wire::flags::SHM;
    refuse(&mut s, &b, DropReason::NoSharedMemory);
    refuse(&mut s, &msg(MsgType::Push, 0, 2, 0, &[1.; 4]), DropReason::Ahead);
    ok(&mut s, &msg(MsgType::Init, 0, 0, 0, &[1.; 4]));
    ok(&mut s, &msg(MsgType::Init, 1, 0, 0, &[]));
    ok(&mut s, &msg(MsgType::Push, 0, 1, 0, &[1.; 4]));
    ok(&mut s, &msg(MsgType::Push, 1, 1, 0, &[1.; 4]));
    ok(&mut s, &msg(MsgType::Push, 0, 2, 0, &[1.; 4]));
    // A round older than the last completed one is answered (PROTOCOL.md
    // §5.4 rule 5): `stale` is a partial's (§9), not a rank's.
    ok(&mut s, &msg(MsgType::Init, 1, 0, 0, &[]));
    refuse(
        &mut s,
        &msg(MsgType::Push, 0, 2, 0, &[1.; 4]),
        DropReason::Duplicate,
    );
    // Appliance-to-appliance messages for a job that is not hierarchical.
    refuse(
        &mut s,
        &msg(MsgType::Partial, 0, 3, 0, &[1.; 4]),
        DropReason::WrongPeer,
    );
    // Evicted: the job's own messages are told so.
    assert!(s.evict(1, 1));
    refuse(
        &mut s,
        &msg(MsgType::Push, 1, 2, 0, &[1.; 4]),
        DropReason::Evicted,
    );
    // Shutting down: the messages of every job still installed are told so.
    let mut stopping = shard(2, Dtype::F32, Optimizer::Sum);
    assert_eq!(stopping.shut_down(), 0, "no rank heard from yet");
    refuse(
        &mut stopping,
        &msg(MsgType::Push, 1, 2, 0, &[1.; 4]),
        DropReason::ShuttingDown,
    );
    let (c, d) = (s.counters(), stopping.counters());
    for r in DropReason::ALL {
        let expect = match r {
            DropReason::WrongTypeForRound | DropReason::CountMismatch | DropReason::NotForAppliance => 2,
            DropReason::BadMagic
            | DropReason::BadVersion
            | DropReason::UnknownType
            | DropReason::UnknownDtype
            | DropReason::CountTooLarge
            | DropReason::LengthMismatch
            | DropReason::Stale
            | DropReason::UnknownTable
            | DropReason::DimMismatch
            | DropReason::BadRowCount
            | DropReason::RowOutOfPlace
            // Key caching's, table messages' only (table_rules.rs).
            | DropReason::UnknownSignature
            | DropReason::BadSignature
            // Replicated jobs' only (replica_rules.rs, failover_rules.rs,
            // clock_replica_rules.rs).
            | DropReason::WrongEpoch
            | DropReason::Backlog => 0,
            _ => 1,
        };
        assert_eq!(c.drops_of(*r) + d.drops_of(*r), expect, "{r}");
    }
}

#[test]
fn only_authenticated_senders_hear_about_refusals() {
    let mut s = shard(2, Dtype::F32, Optimizer::Sum);
    let mut b = msg(MsgType::Init, 0, 0, 0, &[1.; 4]);
    b[wire::field::TOKEN].copy_from_slice(&1u64.to_le_bytes());
    s.handle(66, &b, 0);
    s.handle(66, &msg(MsgType::Init, 0, 0, 0, &[1.; 3]), 0); // count mismatch: told
    s.handle(66, &msg(MsgType::Init, 0, 0, 0, &[1.; 4]), 0);
    s.handle(66, &msg(MsgType::Init, 0, 0, 0, &[1.; 4]), 0); // duplicate: not told
    let out = drain(&mut s);
    assert_eq!(out.len(), 1);
    let (to, repr, payload) = &out[0];
    assert_eq!(
        (*to, repr.kind, repr.error),
        (66, MsgType::Error, DropReason::CountMismatch.code())
    );
    assert!(payload.is_empty());
}

#[test]
fn another_jobs_packets_never_touch_a_victim() {
    let mut s = shard(
        1,
        Dtype::F32,
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
    );
    s.install(
        JobInstall {
            id: 2,
            token: 99,
            workers: 1,
            dtype: Dtype::F32,
            optimizer: Optimizer::Sum,
            consistency: Default::default(),
            chunk_elems: 4,
            slots: vec![SlotChunk {
                key: 0,
                chunk: 0,
                elems: 4,
            }],
        },
        InstallKind::Plain,
    )
    .unwrap();
    s.handle(1, &msg(MsgType::Init, 0, 0, 0, &[1., 2., 3., 4.]), 0);
    let before = s.params(1, 0).unwrap().to_vec();
    // Job 2's token with job 1's id, and job 1's token with a bad slot.
    let mut b = msg(MsgType::Push, 0, 1, 0, &[9.; 4]);
    b[wire::field::TOKEN].copy_from_slice(&99u64.to_le_bytes());
    assert_eq!(s.handle(1, &b, 0), Verdict::Dropped(DropReason::BadToken));
    assert_eq!(
        s.handle(1, &msg(MsgType::Push, 0, 1, 7, &[9.; 4]), 0),
        Verdict::Dropped(DropReason::SlotOutOfRange)
    );
    assert_eq!(s.params(1, 0).unwrap(), &before[..]);
    assert_eq!(s.result(1, 0).unwrap().0, 0);
    assert!(s.remove(2));
    assert!(!s.remove(2));
}

#[test]
fn slot_memory_is_what_admission_counts() {
    let opts = [
        Optimizer::Sum,
        Optimizer::Mean,
        Optimizer::Sgd {
            lr: 0.1,
            weight_decay: 0.0,
        },
        Optimizer::Nesterov {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        },
        Optimizer::Adamw {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    ];
    for opt in opts {
        for dtype in Dtype::ALL {
            let s = shard(3, dtype, opt);
            // Two slots (4 and 2 elements) in one block, a record each; the
            // job's record and three ranks' entries.
            let m = phub_engine::engine::memory_model(s.slot_memory());
            let want = m.slot_data_bytes(dtype, &opt, 4, ResultStore::Slot)
                + m.slot_data_bytes(dtype, &opt, 2, ResultStore::Slot)
                + 2 * u64::from(m.slot_bytes)
                + u64::from(m.block_overhead_bytes)
                + u64::from(m.lcore_job_bytes)
                + 3 * u64::from(m.rank_bytes);
            assert_eq!(s.job_memory_bytes(1), Some(want), "{} {dtype}", opt.name());
        }
    }
}

#[test]
fn bad_installs_are_refused() {
    let mut s = shard(1, Dtype::F32, Optimizer::Sum);
    let job = |id, workers, elems| JobInstall {
        id,
        token: 1,
        workers,
        dtype: Dtype::F32,
        optimizer: Optimizer::Sum,
        consistency: Default::default(),
        chunk_elems: 2208,
        slots: vec![SlotChunk {
            key: 0,
            chunk: 0,
            elems,
        }],
    };
    assert!(s
        .install(job(1, 1, 4), InstallKind::Plain)
        .unwrap_err()
        .to_string()
        .contains("already installed"));
    assert!(s
        .install(job(3, 0, 4), InstallKind::Plain)
        .unwrap_err()
        .to_string()
        .contains("worker count 0"));
    assert!(s
        .install(job(3, 1, 0), InstallKind::Plain)
        .unwrap_err()
        .to_string()
        .contains("0 elements"));
    assert!(s
        .install(job(3, 1, 5000), InstallKind::Plain)
        .unwrap_err()
        .to_string()
        .contains("1..=2208"));
    // No slot is longer than the job's full chunk.
    let mut long = job(3, 1, 5);
    long.chunk_elems = 4;
    assert!(s
        .install(long, InstallKind::Plain)
        .unwrap_err()
        .to_string()
        .contains("5 elements; accepted: 1..=4"));
}
