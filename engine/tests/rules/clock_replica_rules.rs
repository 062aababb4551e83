//! Replicas of async and bounded-delay jobs (PROTOCOL.md §11.10) on
//! hand-wired appliances ([`crate::replica_world`]): every push a primary
//! applies goes to the chunk's backup as an update, applied there in the
//! same order with the same operations, and the answer it earns leaves
//! only once the backup acknowledged it (checked at every RESULT the
//! world sees leave: the backup has applied the rank's clock). After
//! every clock each backup equals its primary bit for bit, clocks and held
//! flags too; a failover loses and repeats no update.

use crate::replica_world::*;
use phub_engine::engine::ReplicaStats;

/// Every backup of every chunk holds its primary's bits: update count,
/// stored result, parameters and optimizer state, and the ranks' clocks.
fn assert_clocked_replicas_equal(w: &World) {
    for g in 0..w.total() {
        let s = w.layout.serve(g, &w.epoch).unwrap();
        let p = w.shards[s.appliance][s.lcore]
            .primary_state(JOB, s.slot as u32)
            .unwrap();
        assert_eq!(
            p.clocks.len(),
            w.spec.workers as usize,
            "chunk {g}: the primary's clocks"
        );
        let home = w.layout.home(g).unwrap();
        for &b in &w.layout.set_in(home, &w.epoch)[1..] {
            let q = w.shards[b].iter().find_map(|x| x.backup_state(JOB, g)).unwrap();
            assert_eq!(q.round, p.round, "chunk {g}, backup {b}: updates applied");
            assert_eq!(q.clocks, p.clocks, "chunk {g}, backup {b}: clocks");
            assert_eq!(q.result, p.result, "chunk {g}, backup {b}: stored result");
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for (k, (a, c)) in p.state.iter().zip(&q.state).enumerate() {
                assert_eq!(bits(a), bits(c), "chunk {g}, backup {b}: state buffer {k}");
            }
        }
    }
}

fn stats(w: &World) -> Vec<ReplicaStats> {
    w.shards
        .iter()
        .flatten()
        .map(|s| s.replica_stats(JOB).unwrap())
        .collect()
}

fn clocked(opt: Optimizer, dtype: Dtype, consistency: Consistency, appliances: u32) -> JobSpec {
    let mut s = spec(opt, dtype, 2, appliances);
    s.consistency = consistency;
    s.validate().unwrap();
    s
}

#[test]
fn backups_apply_every_update_in_order_under_loss_duplication_and_reordering() {
    let cases = [
        (
            Optimizer::Sgd {
                lr: 0.1,
                weight_decay: 0.01,
            },
            Dtype::F32,
            Consistency::Async,
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
            Consistency::Bounded { delay: 1 },
        ),
        (
            Optimizer::Momentum {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            Dtype::Bf16,
            Consistency::Async,
        ),
        (Optimizer::Sum, Dtype::F16, Consistency::Bounded { delay: 0 }),
    ];
    let clocks = 6;
    for (seed, (opt, dtype, consistency)) in cases.into_iter().enumerate() {
        let mut w = World::new(
            clocked(opt, dtype, consistency, 3),
            &[2, 1, 3],
            &["r1", "r2", "r1"],
            seed as u64,
            LOSSY,
        );
        for c in 0..=clocks {
            let v = round_values(&w, seed as u64 * 100, c);
            round(&mut w, c, &v);
            assert_clocked_replicas_equal(&w);
        }
        assert!(w.errors.is_empty(), "{opt:?}: ERRORs {:?}", w.errors);
        let st = stats(&w);
        let sum = |f: fn(&ReplicaStats) -> u64| st.iter().map(f).sum::<u64>();
        assert!(sum(|s| s.replicates_resent) > 0, "{opt:?}: no update resent");
        assert!(sum(|s| s.acks_resent) > 0, "{opt:?}: no ACK sent again");
        // Round 0 once per chunk, then each rank's every clock: each
        // applied once on the backup, whatever was lost or duplicated.
        let updates = w.total() * (1 + u64::from(clocks) * u64::from(w.spec.workers));
        assert_eq!(sum(|s| s.rounds_applied), updates, "{opt:?}");
        assert_eq!(sum(|s| s.rounds_replicated), updates, "{opt:?}");
    }
}

/// A rank's answer waits for the backup: with every replication message
/// lost, an applied push is not answered, the rank's copies of it are
/// `duplicate`, its next clock `ahead`, and a PULL reports the clock
/// before; once the network heals the timer's resend brings the answer.
#[test]
fn an_answer_waits_until_the_backup_applied_the_update() {
    let sp = clocked(
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        },
        Dtype::F32,
        Consistency::Async,
        2,
    );
    let mut w = World::new(sp, &[1, 1], &["", ""], 3, CLEAN);
    let v0 = round_values(&w, 1, 0);
    round(&mut w, 0, &v0);
    let g = 0;
    let (i, j, slot) = w.primary(g);
    let v1 = round_values(&w, 1, 1);
    w.faults.replica_loss = 1.0;
    send_round(&mut w, 1, &v1, &[(0, g)], false);
    w.run();
    assert_eq!(w.got[&(0, g)].0, 0, "answered before the backup holds the update");
    let primary = w.shards[i][j].primary_state(JOB, slot).unwrap();
    assert_eq!(primary.round, Some(1), "applied at once");
    assert_eq!(primary.clocks[0], 1);
    // The copy of the push: dropped, nothing sent.
    let before = w.shards[i][j].counters().drops_of(DropReason::Duplicate);
    send_round(&mut w, 1, &v1, &[(0, g)], true);
    w.run();
    assert_eq!(
        w.shards[i][j].counters().drops_of(DropReason::Duplicate),
        before + 1
    );
    assert_eq!(w.got[&(0, g)].0, 0);
    // The next clock: `ahead`, with an ERROR.
    let v2 = round_values(&w, 1, 2);
    send_round(&mut w, 2, &v2, &[(0, g)], false);
    w.run();
    assert!(
        w.errors
            .iter()
            .any(|(_, r, _)| r.error == DropReason::Ahead.code()),
        "{:?}",
        w.errors
    );
    w.errors.clear();
    // A PULL reports clock 0, the last answered.
    let c = w.chunk(g);
    let pull = Repr::request(MsgType::Pull, JOB, TOKEN, 0, 0, slot)
        .with_payload(w.spec.dtype, 0)
        .with_chunk(c.key, c.chunk);
    let mut d = pull.to_datagram(&[]);
    wire::Header::new_unchecked(&mut d[..]).set_epoch(0);
    let to = w.at(i, j);
    w.send(worker_addr(0), to, d);
    w.run();
    assert_eq!(w.got[&(0, g)].0, 0, "a PULL while the answer waits");
    // The network heals: the resent update is acknowledged, the answer goes.
    w.faults.replica_loss = 0.0;
    w.now += 300 * MS;
    w.poll();
    w.run();
    assert_eq!(w.got[&(0, g)].0, 1, "answered once the backup acknowledged");
    assert_clocked_replicas_equal(&w);
}

/// A primary killed while updates it applied are on their way (every
/// replication message lost at that moment): its backup adopts the part
/// with the clocks it applied, the ranks resend what was not answered,
/// and each push is applied exactly once: with `sum` and whole-number
/// values the chunks end at their initial values plus every push,
/// exactly. Async and bounded delay.
#[test]
fn a_failover_loses_and_repeats_no_update() {
    for (seed, consistency) in [Consistency::Async, Consistency::Bounded { delay: 1 }]
        .into_iter()
        .enumerate()
    {
        let sp = clocked(Optimizer::Sum, Dtype::F32, consistency, 3);
        let mut w = World::new(sp, &[1, 2, 1], &["a", "b", "c"], seed as u64, LOSSY);
        let mut want: HashMap<u64, Vec<f64>> = HashMap::new();
        let clocks = 5;
        for c in 0..=clocks {
            let v = whole_round(&w, c, &mut want);
            if c == 3 {
                // Clock 3 applied on the primaries, its updates lost; then
                // appliance 0 dies and its backup takes over.
                w.faults.replica_loss = 1.0;
                let all: Vec<(u16, u64)> = (0..w.spec.workers as u16)
                    .flat_map(|r| (0..w.total()).map(move |g| (r, g)))
                    .collect();
                send_round(&mut w, c, &v, &all, false);
                w.run();
                w.dead[0] = true;
                w.faults.replica_loss = LOSSY.replica_loss;
                let down = w.epoch.with_down(0).unwrap();
                change_epoch(&mut w, &down);
            }
            round(&mut w, c, &v);
            assert_clocked_replicas_equal(&w);
        }
        let adopted: u64 = stats(&w).iter().map(|s| s.slots_adopted).sum();
        assert!(adopted > 0, "nothing adopted");
        // Every chunk at its initial values plus every push, each clock
        // of every rank applied once.
        assert_sums(&w, &want, clocks);
        w.errors.retain(|(_, r, _)| {
            r.error != DropReason::WrongEpoch.code() && r.error != DropReason::Ahead.code()
        });
        assert!(w.errors.is_empty(), "ERRORs: {:?}", w.errors);
    }
}

/// Whole-number `values` of clock `salt` (`sum` of them is exact in any
/// order), and each chunk's expected sum after it, added to `want`.
fn whole_round(w: &World, salt: u32, want: &mut HashMap<u64, Vec<f64>>) -> HashMap<(u16, u64), Vec<f32>> {
    let mut v = round_values(w, 7, salt);
    for x in v.values_mut().flatten() {
        *x = (*x * 8.0).round();
    }
    for g in 0..w.total() {
        let e = want
            .entry(g)
            .or_insert_with(|| vec![0.0; w.chunk(g).elems as usize]);
        let ranks: Vec<u16> = if salt == 0 {
            vec![0]
        } else {
            (0..w.spec.workers as u16).collect()
        };
        for r in ranks {
            for (a, b) in e.iter_mut().zip(&v[&(r, g)]) {
                *a += f64::from(*b);
            }
        }
    }
    v
}

/// Every chunk's served values are `want`'s, and every rank's clock is
/// `clocks` there.
fn assert_sums(w: &World, want: &HashMap<u64, Vec<f64>>, clocks: u32) {
    for g in 0..w.total() {
        let s = w.layout.serve(g, &w.epoch).unwrap();
        let p = w.shards[s.appliance][s.lcore]
            .primary_state(JOB, s.slot as u32)
            .unwrap();
        let got: Vec<f64> = bytemuck::cast_slice::<u8, f32>(p.result)
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        assert_eq!(got, want[&g], "chunk {g}");
        assert_eq!(p.clocks, vec![clocks; w.spec.workers as usize], "chunk {g}");
    }
}

/// An appliance killed, then back empty (PROTOCOL.md §11.7, §11.10): each
/// primary of a part it is in copies it the chunk's state with the ranks'
/// clocks (no push applied meanwhile: `backlog`), it joins at the copy's
/// update, and the job goes on at full strength: every backup equal to its
/// primary bit for bit, clocks too, every push applied once; then the
/// other appliance is killed and the one back serves its parts exactly.
/// Two and three replicas; and `sum` with a 2-byte result, whose current
/// values in `f32` (its accumulator) the copy carries too (sums compared
/// bit for bit between replicas only: f16 rounds them).
#[test]
fn an_appliance_back_is_copied_the_clocks_and_joins() {
    for (seed, replicas, dtype) in [(8u64, 2u32, Dtype::F32), (9, 3, Dtype::F32), (11, 2, Dtype::F16)] {
        let exact = dtype == Dtype::F32;
        let mut sp = spec(Optimizer::Sum, dtype, replicas, 3);
        sp.consistency = Consistency::Bounded { delay: 1 };
        sp.validate().unwrap();
        let mut w = World::new(sp, &[1, 2, 1], &["a", "b", "c"], seed, LOSSY);
        let mut want = HashMap::new();
        for c in 0..=2 {
            let v = whole_round(&w, c, &mut want);
            round(&mut w, c, &v);
        }
        w.dead[1] = true;
        let down = w.epoch.with_down(1).unwrap();
        change_epoch(&mut w, &down);
        let v = whole_round(&w, 3, &mut want);
        round(&mut w, 3, &v);
        // Back, empty: the others take the epoch that has it joined.
        let back = w.epoch.with_joined(1).unwrap();
        w.reinstall(1, &back);
        w.epoch = back.clone();
        for a in [0, 2] {
            for j in 0..w.shards[a].len() {
                assert_eq!(w.shards[a][j].change_epoch(JOB, &back), Ok(true));
                w.drain(a, j);
            }
        }
        for c in 4..=5 {
            let v = whole_round(&w, c, &mut want);
            round(&mut w, c, &v);
        }
        let st = stats(&w);
        assert!(
            st.iter().map(|s| s.states_installed).sum::<u64>() > 0,
            "replicas {replicas}: no copy installed"
        );
        assert_clocked_replicas_equal(&w);
        if exact {
            assert_sums(&w, &want, 5);
        }
        // The other appliance dies: the one back serves what it backs up.
        w.dead[0] = true;
        let down = w.epoch.with_down(0).unwrap();
        change_epoch(&mut w, &down);
        for c in 6..=7 {
            let v = whole_round(&w, c, &mut want);
            round(&mut w, c, &v);
        }
        assert_clocked_replicas_equal(&w);
        if exact {
            assert_sums(&w, &want, 7);
        }
    }
}

/// A primary restored from its checkpoint with backups (control takes a
/// job back to its checkpoints when some part lost every replica): each
/// restored slot copies its state and clocks to its backups before it
/// applies another push; the ranks pull (§5.4 rule 0), go on from the
/// clocks the checkpoint holds, and every backup ends equal.
#[test]
fn a_restored_primary_copies_its_clocks_to_its_backups() {
    let mut sp = spec(Optimizer::Sum, Dtype::F32, 2, 2);
    sp.consistency = Consistency::Async;
    sp.validate().unwrap();
    let mut w = World::new(sp, &[1, 1], &["a", "b"], 10, CLEAN);
    let mut want = HashMap::new();
    for c in 0..=2 {
        let v = whole_round(&w, c, &mut want);
        round(&mut w, c, &v);
    }
    // What control checkpoints (each appliance's own part) keeps the
    // ranks' clocks, as the restore below needs them (found missing by the
    // simulator: the restore refused the checkpoint).
    for a in 0..2 {
        for s in &w.shards[a] {
            let saved = s.part_snapshot(JOB).unwrap().unwrap();
            assert!(
                !saved.is_empty() && saved.iter().all(|st| st.clocks == [2, 2, 2]),
                "appliance {a}"
            );
        }
    }
    w.restore_all_from_checkpoints();
    w.pull_all();
    for c in 3..=4 {
        let v = whole_round(&w, c, &mut want);
        round(&mut w, c, &v);
    }
    assert!(stats(&w).iter().map(|s| s.states_installed).sum::<u64>() > 0);
    assert_clocked_replicas_equal(&w);
    assert_sums(&w, &want, 4);
}

/// The update log's buffers are bounded per lcore
/// ([`phub_proto::memory::UPDATE_LOG_BUFFERS`]): with the backups out of
/// reach, pushes beyond them are dropped `backlog` before they are
/// applied, and go once the workers resend them after the network healed;
/// nothing is applied twice or lost.
#[test]
fn pushes_beyond_the_update_log_are_dropped_and_resent() {
    use phub_proto::memory::UPDATE_LOG_BUFFERS;
    let mut sp = JobSpec::new("rep", 3, &[16 * 800])
        .with_optimizer(Optimizer::Sum)
        .with_chunk_bytes(64)
        .sharded_over(Appliances::Count(2))
        .with_replicas(2);
    sp.consistency = Consistency::Async;
    sp.validate().unwrap();
    let mut w = World::new(sp, &[1, 1], &["a", "b"], 5, CLEAN);
    let v = round_values(&w, 3, 0);
    round(&mut w, 0, &v);
    let v = round_values(&w, 3, 1);
    w.faults.replica_loss = 1.0;
    let all: Vec<(u16, u64)> = (0..3u16)
        .flat_map(|r| (0..w.total()).map(move |g| (r, g)))
        .collect();
    send_round(&mut w, 1, &v, &all, false);
    w.run();
    for i in 0..2 {
        let s = &w.shards[i][0];
        let slots = (0..w.total()).filter(|&g| w.primary(g).0 == i).count();
        assert_eq!(
            s.counters().drops_of(DropReason::Backlog),
            (3 * slots - UPDATE_LOG_BUFFERS) as u64,
            "appliance {i}"
        );
    }
    w.faults.replica_loss = 0.0;
    round(&mut w, 1, &v);
    assert_clocked_replicas_equal(&w);
    for g in 0..w.total() {
        let (i, j, slot) = w.primary(g);
        let p = w.shards[i][j].primary_state(JOB, slot).unwrap();
        assert_eq!(p.clocks, vec![1, 1, 1], "chunk {g}");
        assert_eq!(p.round, Some(3), "chunk {g}: three updates, once each");
    }
}

/// An lcore that serves no chunk of its own (more lcores than chunks)
/// still keeps backup slots of the other appliance's, and when it adopts
/// them it serves them by clocks, not as BSP slots (simulator seed 19637:
/// it took the job's mode from its own primary slots, of which it had
/// none, and closed a BSP round of an async chunk).
#[test]
fn an_lcore_without_chunks_of_its_own_adopts_by_clocks() {
    let mut sp = JobSpec::new("rep", 3, &[48])
        .with_optimizer(Optimizer::Sum)
        .with_chunk_bytes(64)
        .sharded_over(Appliances::Count(2))
        .with_replicas(2);
    sp.consistency = Consistency::Async;
    sp.validate().unwrap();
    let mut w = World::new(sp, &[2, 2], &["a", "b"], 6, CLEAN);
    // Appliance 0's lcore 0 serves nothing; it backs up one of
    // appliance 1's chunks.
    assert_eq!(w.runs[0].count, 0, "{:?}", w.runs);
    for c in 0..=2 {
        let v = round_values(&w, 4, c);
        round(&mut w, c, &v);
    }
    w.dead[1] = true;
    let down = w.epoch.with_down(1).unwrap();
    change_epoch(&mut w, &down);
    for c in 3..=4 {
        let v = round_values(&w, 4, c);
        round(&mut w, c, &v);
    }
    for g in 0..w.total() {
        let s = w.layout.serve(g, &w.epoch).unwrap();
        assert_eq!(s.appliance, 0, "chunk {g}");
        let p = w.shards[0][s.lcore].primary_state(JOB, s.slot as u32).unwrap();
        assert_eq!(p.clocks, vec![4, 4, 4], "chunk {g}");
        assert_eq!(p.round, Some(12), "chunk {g}: twelve updates");
    }
}
