//! Replicas (PROTOCOL.md §11) on hand-wired appliances: every lcore of
//! every appliance is a [`Shard`], datagrams between them and the workers
//! go through one seeded network that loses, duplicates and reorders
//! them, and the workers run BSP rounds with retransmission. After every
//! round each backup's state (round, stored result, parameters and
//! optimizer state) must equal its primary's bit for bit, and no RESULT of
//! a round may leave a primary before every backup of the chunk completed
//! that round.

use crate::replica_world::*;

#[test]
fn backups_stay_bit_identical_under_loss_duplication_and_reordering() {
    let cases = [
        (
            Optimizer::Sgd {
                lr: 0.1,
                weight_decay: 0.01,
            },
            Dtype::F32,
            2,
        ),
        (
            Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            Dtype::F32,
            3,
        ),
        (
            Optimizer::Momentum {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            Dtype::Bf16,
            2,
        ),
        (Optimizer::Mean, Dtype::F32, 3),
        (Optimizer::Sum, Dtype::F16, 2),
    ];
    for (seed, (opt, dtype, replicas)) in cases.into_iter().enumerate() {
        let w = train(
            spec(opt, dtype, replicas, 3),
            &[2, 1, 3],
            &["r1", "r2", "r1"],
            seed as u64,
            LOSSY,
            6,
        );
        // The faults happened and were survived.
        let stats: Vec<_> = w
            .shards
            .iter()
            .flatten()
            .map(|s| s.replica_stats(JOB).unwrap())
            .collect();
        let sum = |f: fn(&phub_engine::engine::ReplicaStats) -> u64| stats.iter().map(f).sum::<u64>();
        assert!(
            sum(|s| s.replicates_resent) > 0,
            "{opt:?}: no REPLICATE was resent"
        );
        assert!(sum(|s| s.acks_resent) > 0, "{opt:?}: no ACK was sent again");
        // Each (chunk, round) applied once on each backup.
        let chunks = w.total();
        assert_eq!(
            sum(|s| s.rounds_applied),
            chunks * 7 * (u64::from(replicas) - 1),
            "{opt:?}"
        );
        assert_eq!(sum(|s| s.rounds_replicated), chunks * 7, "{opt:?}");
        assert!(w.results > 0);
    }
}

/// An lcore that takes several REPLICATEs from one primary lcore in one
/// burst answers them in one REPLICATE_ACK (PROTOCOL.md §11.3): fewer ACK
/// datagrams than acknowledgements, every one of them taken by the
/// primary (no REPLICATE resent on a clean network), backups identical.
#[test]
fn a_burst_of_replicates_is_acknowledged_in_one_datagram() {
    let opt = Optimizer::Momentum {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let mut w = World::new(
        spec(opt, Dtype::F32, 2, 3),
        &[2, 1, 3],
        &["r1", "r2", "r1"],
        9,
        CLEAN,
    );
    w.bursts = true;
    let w = train_world(w, 5);
    let (datagrams, acks) = w.acks_sent;
    assert!(
        datagrams > 0 && datagrams < acks,
        "{datagrams} ACK datagrams for {acks} acknowledgements"
    );
    let resent: u64 = w
        .shards
        .iter()
        .flatten()
        .map(|s| s.replica_stats(JOB).unwrap().replicates_resent)
        .sum();
    assert_eq!(resent, 0, "an acknowledgement was not taken");
    assert_eq!(w.total() * 6, acks, "one acknowledgement per chunk and round");
}

/// With one replica nothing is replicated: the round completes at the
/// last push, as on an appliance without replicas.
#[test]
fn one_replica_completes_at_the_last_push() {
    let mut w = train(
        spec(
            Optimizer::Sgd {
                lr: 0.1,
                weight_decay: 0.0,
            },
            Dtype::F32,
            1,
            2,
        ),
        &[1, 2],
        &["", ""],
        9,
        Faults {
            replica_loss: 0.0,
            loss: 0.0,
            dup: 0.0,
        },
        3,
    );
    for s in w.shards.iter().flatten() {
        assert_eq!(s.replica_stats(JOB).unwrap(), Default::default());
    }
    // Nor is a replication message taken.
    let c = w.chunk(0);
    let ack = replica::ReplicaRepr {
        kind: ReplicaMsgType::ReplicateAck,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        from: 1,
        count: 0,
        round: 4,
        slot: 0,
        key: c.key,
        chunk: c.chunk,
        epoch: 0,
        fragment: 0,
        fragments: 0,
    };
    let s = &mut w.shards[0][0];
    assert_eq!(
        s.handle(lcore_addr(1, 0), &ack.to_bytes(), w.now),
        Verdict::Dropped(DropReason::WrongPeer)
    );
}

/// A primary whose REPLICATEs are all lost answers nobody: the round is
/// held (a PULL gets the previous round, a resent push nothing) until the
/// resends get through; then every backup has it before any RESULT.
#[test]
fn a_round_is_held_until_every_backup_acknowledged() {
    let sp = spec(
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
        Dtype::F32,
        3,
        3,
    );
    let mut w = World::new(
        sp,
        &[1, 1, 1],
        &["", "", ""],
        3,
        Faults {
            replica_loss: 0.0,
            loss: 0.0,
            dup: 0.0,
        },
    );
    let total = w.total();
    let init: HashMap<(u16, u64), Vec<f32>> = (0..total)
        .map(|g| ((0, g), (0..w.chunk(g).elems).map(|e| e as f32).collect()))
        .collect();
    round(&mut w, 0, &init);
    // Round 1 of chunk 0 (primary appliance 0, lcore 0, slot 0), the
    // network now losing every replication message.
    w.faults.replica_loss = 1.0;
    let c = w.chunk(0);
    let pushes: Vec<Vec<u8>> = (0..3u16)
        .map(|rank| {
            Repr::request(MsgType::Push, JOB, TOKEN, rank, 1, 0)
                .with_payload(Dtype::F32, c.elems as u16)
                .with_chunk(c.key, c.chunk)
                .to_datagram(&vec![1.0; c.elems as usize])
        })
        .collect();
    let s = &mut w.shards[0][0];
    assert_eq!(s.handle(worker_addr(0), &pushes[0], 10), Verdict::Aggregated);
    assert_eq!(s.handle(worker_addr(1), &pushes[1], 11), Verdict::Aggregated);
    assert_eq!(s.handle(worker_addr(2), &pushes[2], 12), Verdict::Forwarded);
    let sent: Vec<u8> = s.transmits().map(|t| t.header[wire::field::TYPE]).collect();
    assert_eq!(
        sent,
        [ReplicaMsgType::Replicate.code(); 2],
        "one REPLICATE per backup, no RESULT"
    );
    s.clear_transmits();
    // Held: a copy of a push is a duplicate, a PULL gets round 0.
    assert_eq!(
        s.handle(worker_addr(1), &pushes[1], 13),
        Verdict::Dropped(DropReason::Duplicate)
    );
    let pull = Repr::request(MsgType::Pull, JOB, TOKEN, 1, 0, 0)
        .with_chunk(c.key, c.chunk)
        .to_datagram(&[]);
    assert_eq!(s.handle(worker_addr(1), &pull, 14), Verdict::Pulled);
    let answers: Vec<Repr> = s
        .transmits()
        .map(|t| wire::parse(&[&t.header[..], t.payload].concat()).unwrap().0)
        .collect();
    assert_eq!(answers.len(), 1);
    assert_eq!((answers[0].kind, answers[0].round), (MsgType::Result, 0));
    s.clear_transmits();
    assert_eq!(s.primary_state(JOB, 0).unwrap().round, Some(0));
    // Timers resend to both backups, which get nothing yet.
    for t in 1..=3 {
        w.now = 10 + t * 500 * MS;
        w.poll();
        w.run();
    }
    assert_eq!(w.shards[0][0].primary_state(JOB, 0).unwrap().round, Some(0));
    assert!(w.shards[0][0].replica_stats(JOB).unwrap().replicates_resent >= 6);
    assert!(w.got.get(&(0, 0)).is_some_and(|e| e.0 == 0));
    // The network heals: the next resend completes the round, RESULTs
    // checked against both backups as they leave.
    w.faults.replica_loss = 0.0;
    w.now += 500 * MS;
    w.poll();
    w.run();
    assert_eq!(w.shards[0][0].primary_state(JOB, 0).unwrap().round, Some(1));
    assert!(w.got.get(&(0, 0)).is_some_and(|e| e.0 == 1));
    let p = w.shards[0][0].primary_state(JOB, 0).unwrap();
    assert_ne!(p.state[0], &init[&(0, 0)][..], "round 1 moved the parameters");
    for b in [1, 2] {
        assert_eq!(w.shards[b][0].backup_state(JOB, 0).unwrap(), p);
    }
}

/// Replication messages of another epoch, from a worker's address, or
/// for a part an lcore does not keep are dropped and counted; a copy of
/// a REPLICATE already applied is acknowledged again and changes nothing.
#[test]
fn replication_messages_are_checked_and_idempotent() {
    let sp = spec(
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
        Dtype::F32,
        2,
        2,
    );
    let mut w = World::new(
        sp,
        &[1, 1],
        &["", ""],
        4,
        Faults {
            replica_loss: 0.0,
            loss: 0.0,
            dup: 0.0,
        },
    );
    let total = w.total();
    let init: HashMap<(u16, u64), Vec<f32>> = (0..total)
        .map(|g| ((0, g), vec![2.0; w.chunk(g).elems as usize]))
        .collect();
    round(&mut w, 0, &init);
    // Appliance 1 backs up appliance 0's chunk 0 in its backup slot 0.
    let c = w.chunk(0);
    let rep = |epoch, round| {
        let r = replica::ReplicaRepr {
            kind: ReplicaMsgType::Replicate,
            dtype: Dtype::F32,
            flags: 0,
            token: TOKEN,
            job: JOB,
            from: 0,
            count: c.elems as u16,
            round,
            slot: 0,
            key: c.key,
            chunk: c.chunk,
            epoch,
            fragment: 0,
            fragments: 0,
        };
        let mut d = r.to_bytes().to_vec();
        for _ in 0..c.elems {
            d.extend_from_slice(&3.0f32.to_le_bytes());
        }
        d
    };
    let primary = lcore_addr(0, 0);
    let b = &mut w.shards[1][0];
    let before = b.backup_state(JOB, 0).unwrap().state[0].to_vec();
    assert_eq!(
        b.handle(primary, &rep(1, 1), 1),
        Verdict::Dropped(DropReason::WrongEpoch)
    );
    assert_eq!(b.replica_stats(JOB).unwrap().wrong_epoch, 1);
    assert_eq!(
        b.handle(worker_addr(0), &rep(0, 1), 2),
        Verdict::Dropped(DropReason::WrongPeer),
        "the token alone does not speak for a primary"
    );
    assert_eq!(
        b.handle(primary, &rep(0, 2), 3),
        Verdict::Dropped(DropReason::Ahead)
    );
    assert!(!b.has_transmits());
    assert_eq!(b.backup_state(JOB, 0).unwrap().state[0], &before[..]);
    // Round 1 applied once, its copy acknowledged again.
    let st0 = b.replica_stats(JOB).unwrap();
    for t in 0..2 {
        assert_eq!(b.handle(primary, &rep(0, 1), 4 + t), Verdict::Replicated);
        let acks: Vec<_> = b
            .transmits()
            .map(|t| (t.header, t.to.collect::<Vec<_>>()))
            .collect();
        assert_eq!(acks.len(), 1);
        let (a, _) = replica::parse(&acks[0].0).unwrap();
        assert_eq!(
            (a.kind, a.round, a.from, a.slot),
            (ReplicaMsgType::ReplicateAck, 1, 1, 0)
        );
        assert_eq!(acks[0].1, [primary]);
        b.clear_transmits();
    }
    let st = b.replica_stats(JOB).unwrap();
    assert_eq!(
        (st.acks_sent, st.acks_resent, st.rounds_applied),
        (st0.acks_sent + 1, st0.acks_resent + 1, st0.rounds_applied + 1)
    );
    let after = b.backup_state(JOB, 0).unwrap().state[0].to_vec();
    assert_ne!(after, before, "round 1 was applied");
    assert_eq!(b.handle(primary, &rep(0, 1), 6), Verdict::Replicated);
    b.clear_transmits();
    assert_eq!(
        b.backup_state(JOB, 0).unwrap().state[0],
        &after[..],
        "and only once"
    );
    assert_eq!(
        b.handle(primary, &rep(0, 0), 7),
        Verdict::Dropped(DropReason::Stale)
    );
    // The primary takes no ACK it did not wait for.
    let ack = replica::ReplicaRepr {
        kind: ReplicaMsgType::ReplicateAck,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        from: 1,
        count: 0,
        round: 1,
        slot: 0,
        key: c.key,
        chunk: c.chunk,
        epoch: 0,
        fragment: 0,
        fragments: 0,
    };
    let p = &mut w.shards[0][0];
    assert_eq!(
        p.handle(lcore_addr(1, 0), &ack.to_bytes(), 7),
        Verdict::Dropped(DropReason::Ahead)
    );
    let from_self = replica::ReplicaRepr { from: 0, ..ack };
    assert_eq!(
        p.handle(lcore_addr(0, 0), &from_self.to_bytes(), 8),
        Verdict::Dropped(DropReason::RankOutOfRange)
    );
    assert_eq!(p.primary_state(JOB, 0).unwrap().round, Some(0));
}

/// An async job is installed with replicas too (PROTOCOL.md §11.10).
#[test]
fn async_jobs_are_replicated_too() {
    let sp = spec(Optimizer::Sum, Dtype::F32, 2, 2);
    let appliances = [
        (Ipv4Addr::new(10, 0, 0, 1), 9000, 1),
        (Ipv4Addr::new(10, 0, 1, 1), 9000, 1),
    ];
    let runs = backup_runs(
        ChunkRange {
            first: 0,
            count: Chunks::new(&sp).total(),
        },
        2,
    );
    let racks = vec![String::new(), String::new()];
    let mut plan: Vec<(Vec<SlotChunk>, ReplicaInstall)> =
        replica_plan(&sp, &runs, &appliances, &racks, 0, 0).unwrap();
    let (slots, rep) = plan.remove(0);
    let mut s: Shard<SocketAddrV4> = Shard::new(0, Kernels::best());
    s.set_peer_resolver(Arc::new(Some));
    let mut j = job(&sp, slots);
    j.consistency = Consistency::Async;
    s.install(j, InstallKind::Replicated(Box::new(rep))).unwrap();
    assert!(s.replica_stats(JOB).is_some());
}

/// A primary restored from its checkpoint while an aggregate was pending
/// waits for no acknowledgement: the restored round is a completed one,
/// an ACK of the lost round is `ahead`, its state goes to its backup as a
/// copy, and the workers' resent pushes
/// (after each pulled, PROTOCOL.md §5.4 rule 0) make the round again,
/// replicated as any other.
#[test]
fn a_restore_forgets_pending_aggregates() {
    let mut w = sgd_pair(&[1, 1], 5);
    let total = w.total();
    let values: HashMap<(u16, u64), Vec<f32>> = (0..3u16)
        .flat_map(|r| (0..total).map(move |g| (r, g)))
        .map(|(r, g)| ((r, g), vec![0.5 + f32::from(r); w.chunk(g).elems as usize]))
        .collect();
    round(&mut w, 0, &values);
    let c = w.chunk(0);
    let s = &mut w.shards[0][0];
    for rank in 0..3u16 {
        let d = Repr::request(MsgType::Push, JOB, TOKEN, rank, 1, 0)
            .with_payload(Dtype::F32, c.elems as u16)
            .with_chunk(c.key, c.chunk)
            .to_datagram(&values[&(rank, 0)]);
        s.handle(worker_addr(rank), &d, 10);
    }
    s.clear_transmits();
    let saved = s.snapshot(JOB).unwrap();
    s.restore(JOB, &saved).unwrap();
    let ack = replica::ReplicaRepr {
        kind: ReplicaMsgType::ReplicateAck,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        from: 1,
        count: 0,
        round: 1,
        slot: 0,
        key: c.key,
        chunk: c.chunk,
        epoch: 0,
        fragment: 0,
        fragments: 0,
    };
    assert_eq!(
        s.handle(lcore_addr(1, 0), &ack.to_bytes(), 11),
        Verdict::Dropped(DropReason::Ahead)
    );
    // What leaves it now is its slots' state copies to the backup (a
    // restored part's backups hold no state of its: §11.7's copy), no
    // aggregate; the backup, which holds the round, acknowledges them.
    let kinds: Vec<_> = s
        .transmits()
        .map(|t| {
            let mut d = t.header.to_vec();
            d.extend_from_slice(t.payload);
            replica::parse(&d).map(|(r, _)| r.kind)
        })
        .collect();
    assert!(
        !kinds.is_empty() && kinds.iter().all(|k| *k == Ok(ReplicaMsgType::ReplicateState)),
        "{kinds:?}"
    );
    w.drain(0, 0);
    w.run();
    let s = &mut w.shards[0][0];
    // The restored lcore refuses each rank's pushes (`ahead`) until it
    // pulled (PROTOCOL.md §5.4 rule 0): each pulls, as phub-worker does
    // when told `ahead`.
    for rank in 0..3u16 {
        let pull = Repr::request(MsgType::Pull, JOB, TOKEN, rank, 0, 0)
            .with_payload(Dtype::F32, 0)
            .with_chunk(c.key, c.chunk)
            .to_datagram(&[]);
        assert_eq!(s.handle(worker_addr(rank), &pull, 11), Verdict::Pulled);
    }
    s.clear_transmits();
    w.now += 1_000 * MS;
    w.poll();
    assert!(w.net.is_empty(), "no aggregate is resent after the restore");
    round(&mut w, 1, &values);
    assert_replicas_equal(&w, 1);
}

/// Every appliance of a replicated job restarts (a power cut: every
/// replica of every part lost its state) and is installed again at the
/// job's epoch from its own checkpoint, as control reinstalls such a job:
/// its primary slots restored, its backup slots in no checkpoint. Each
/// restored primary slot copies its state to its backups (PROTOCOL.md
/// §11.7's copy), so the backups hold the restored rounds, and the next
/// round completes on every chunk with the backups equal to their
/// primaries. Before, the backup slots came back empty: the restored
/// round was answered with no backup holding it, and the next round's
/// aggregates were refused `ahead` for ever (the job hung).
#[test]
fn a_job_whose_every_appliance_restarted_from_its_checkpoint_goes_on() {
    let mut w = sgd_pair(&[1, 2], 7);
    for r in 0..=2 {
        seeded_round(&mut w, 7, r);
    }
    assert_replicas_equal(&w, 2);
    w.restore_all_from_checkpoints();
    // The copies go out at the lcores' next poll.
    w.poll();
    w.run();
    assert_replicas_equal(&w, 2);
    // Each rank pulls every chunk first (PROTOCOL.md §5.4 rule 0), as
    // phub-worker does when a restored lcore says `ahead`.
    w.pull_all();
    seeded_round(&mut w, 7, 3);
    assert_replicas_equal(&w, 3);
}

/// Every appliance restored from its checkpoint: until its primaries'
/// copies come, a restored appliance's backup slots hold nothing, and say
/// so (`copies.awaiting`); an epoch that would have it adopt such a part
/// (its primary's appliance down again before the copy) is refused as
/// lost, never served from nothing. Once the copies are in, the same
/// adoption is taken.
#[test]
fn a_restored_backup_awaits_its_copy_and_is_not_adopted_before_it() {
    let mut w = sgd_pair(&[1, 1], 11);
    for r in 0..=2 {
        seeded_round(&mut w, 11, r);
    }
    w.restore_all_from_checkpoints();
    let view = w.epoch.clone();
    let awaiting = |w: &World, i: usize| -> u64 {
        w.shards[i][0]
            .job_stats()
            .iter()
            .find(|s| s.id == JOB)
            .and_then(|s| s.copies)
            .map_or(0, |c| c.awaiting)
    };
    assert!(awaiting(&w, 1) > 0, "a restored backup awaits its copy");
    // Appliance 0 down before its copies went out: 1 would serve 0's part.
    let down = view.with_down(0).unwrap();
    match w.shards[1][0].change_epoch(JOB, &down) {
        Err(phub_engine::EngineError::PartLost { part: 0, .. }) => {}
        other => panic!("an adoption of a part whose copy is not here: {other:?}"),
    }
    // The copies go out and are taken: then 1 may adopt 0's part.
    w.poll();
    w.run();
    assert_eq!(awaiting(&w, 1), 0);
    assert!(w.shards[1][0].change_epoch(JOB, &down).unwrap());
}

/// An SGD job with two replicas over two appliances of `lcores`, on a
/// network without faults.
fn sgd_pair(lcores: &[usize], seed: u64) -> World {
    let sp = spec(
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
        Dtype::F32,
        2,
        2,
    );
    let none = Faults {
        replica_loss: 0.0,
        loss: 0.0,
        dup: 0.0,
    };
    World::new(sp, lcores, &["", ""], seed, none)
}
