//! Replicas of a hierarchical job (PROTOCOL.md §11.11) on hand-wired
//! appliances: three racks, an appliance each (lcores 2, 1, 2), W = 4
//! (ranks per rack 2, 1, 1), replicas 2. While nobody is down the job is
//! hierarchical and every home slot is its chunk's primary: a round's
//! result goes to the racks only once its backup holds it. Appliance 1
//! (rack 1, home of a third of the chunks) dies at every point of a round
//! in turn; the survivors take epoch {1, [1]} and from then on serve the
//! job flat over the home layout, the workers (rack 1's too) routing by
//! `ReplicaLayout::serve`. Every round is answered once, equal bit for
//! bit to a run without the failure. The values are multiples of 1/8
//! small enough that every sum is exact in any order (a rack's partial,
//! then the home's sum, against the flat sum after the failover).

use crate::replica_world::*;

const LCORES: [usize; 3] = [2, 1, 2];
const ROUNDS: u32 = 4;
/// The round during which appliance 1 dies.
const FAIL_IN: u32 = 2;

fn hier_spec(opt: Optimizer, replicas: u32) -> JobSpec {
    JobSpec::new("hier", 4, &[40, 24, 8, 33])
        .with_optimizer(opt)
        .with_chunk_bytes(64)
        .hierarchical_over(Appliances::Count(3))
        .with_ranks_per_rack(&[2, 1, 1])
        .with_replicas(replicas)
}

fn momentum() -> Optimizer {
    Optimizer::Momentum {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.01,
    }
}

/// Every rank's values of every chunk in `round`: multiples of 1/8 in
/// [-4, 4), the same in every run.
fn values(w: &World, round: u32) -> Values {
    let mut rng = Rng(0x41e2 + u64::from(round));
    let mut v = HashMap::new();
    for rank in 0..w.spec.workers as u16 {
        for g in 0..w.total() {
            let n = w.chunk(g).elems as usize;
            v.insert(
                (rank, g),
                (0..n).map(|_| (rng.below(64) as f32 - 32.0) / 8.0).collect(),
            );
        }
    }
    v
}

/// Every (rank, chunk)'s result after each round of `spec`, hierarchical,
/// without failure or fault.
fn reference(spec: JobSpec) -> Vec<Got> {
    let mut w = World::new_hier(spec, &LCORES, 1, CLEAN);
    (0..=ROUNDS)
        .map(|r| {
            let v = values(&w, r);
            round(&mut w, r, &v);
            w.got.clone()
        })
        .collect()
}

/// Rounds 0 .. FAIL_IN, each checked against `want` where given.
fn before_failure(w: &mut World, want: Option<&[Got]>) {
    for r in 0..FAIL_IN {
        let v = values(w, r);
        round(w, r, &v);
        if let Some(want) = want {
            assert_eq!(w.got, want[r as usize], "round {r}");
        }
    }
}

/// Rounds 0 .. FAIL_IN, then no replication message gets through: round
/// FAIL_IN's values and every push of it, to send.
fn replication_cut(w: &mut World) -> (Values, Vec<(u16, u64)>) {
    before_failure(w, None);
    w.faults = Faults {
        replica_loss: 1.0,
        ..CLEAN
    };
    (values(w, FAIL_IN), every_push(w))
}

/// Hierarchical with replicas: the same results as without (the home's
/// optimizer runs once on the racks' sum either way), each home slot's
/// backup holds every round its racks were answered (checked as each
/// PARTIAL_RESULT leaves, `World::drain`) and, after each round, the
/// primary's bits, under loss, duplicates and reordering.
#[test]
fn a_home_slot_answers_its_racks_only_once_its_backup_holds_the_round() {
    for opt in [momentum(), Optimizer::Sum] {
        let want = reference(hier_spec(opt, 1));
        let mut w = World::new_hier(hier_spec(opt, 2), &LCORES, 7, LOSSY);
        for r in 0..=ROUNDS {
            let v = values(&w, r);
            round(&mut w, r, &v);
            assert_eq!(w.got, want[r as usize], "{opt:?}, round {r}");
            assert_replicas_equal(&w, r);
        }
        assert!(w.errors.is_empty(), "{:?}", w.errors);
        let total = w.total();
        assert!(replica_sum(&w.shards, |s| s.rounds_replicated) >= total * u64::from(ROUNDS + 1));
        assert!(replica_sum(&w.shards, |s| s.rounds_applied) >= total * u64::from(ROUNDS + 1));
    }
}

/// The rule itself: while no REPLICATE or REPLICATE_ACK gets through, no
/// rack gets a round's result (and no rank its RESULT), however often the
/// partials are resent; once they do, the round completes, exact.
#[test]
fn no_result_leaves_a_home_before_its_backup_acknowledged() {
    let want = reference(hier_spec(momentum(), 1));
    let mut w = World::new_hier(hier_spec(momentum(), 2), &LCORES, 8, CLEAN);
    let (v, all) = replication_cut(&mut w);
    for t in 0..10 {
        send_and_wait(&mut w, FAIL_IN, &v, &all, t > 0);
    }
    for k in &all {
        assert_eq!(
            w.got[k].0,
            FAIL_IN - 1,
            "{k:?} answered before its home's backup held the round"
        );
    }
    assert!(replica_sum(&w.shards, |s| s.replicates_resent) > 0);
    w.faults = CLEAN;
    round(&mut w, FAIL_IN, &v);
    assert_eq!(w.got, want[FAIL_IN as usize]);
    assert_replicas_equal(&w, FAIL_IN);
}

#[test]
fn a_home_dying_at_any_point_of_a_round_loses_no_round_and_changes_no_bit() {
    let want = reference(hier_spec(momentum(), 1));
    let epoch1 = EpochView::default().with_down(1).unwrap();
    let mut kill_points = 0;
    for n in 0.. {
        let mut w = World::new_hier(hier_spec(momentum(), 2), &LCORES, 1, CLEAN);
        before_failure(&mut w, Some(&want));
        // Round FAIL_IN: every push sent, `n` datagrams delivered, then
        // appliance 1 (rack 1 and a third of the homes) is gone.
        let v = values(&w, FAIL_IN);
        if !kill_after(&mut w, FAIL_IN, &v, n, 1) {
            break;
        }
        kill_points += 1;
        // Every worker, rack 1's too, resends what is unanswered where
        // epoch 1 serves it: the job is flat from now on.
        let what = format!("appliance 1 killed after {n} deliveries");
        go_on_after_failure(&mut w, &epoch1, FAIL_IN, ROUNDS, &want, values, &what);
        // Errors are epoch 0's messages refused by epoch 1's appliances.
        for (_, e, epoch) in &w.errors {
            assert_eq!((e.error, *epoch), (DropReason::WrongEpoch.code(), 1), "{e:?}");
        }
        // Appliance 1's home part was adopted by appliance 2, its backup.
        assert_eq!(
            replica_sum(&w.shards, |s| s.slots_adopted),
            w.layout.part(1).count
        );
    }
    // Delivered datagrams of one round: 4 pushes, a partial from each of
    // the 3 racks, a REPLICATE and its ACK, 3 partial results, 4 RESULTs
    // per chunk.
    assert!(kill_points >= 15 * 9, "only {kill_points} kill points");
}

/// Split brain: appliance 1 is declared down but lives on in epoch 0 with
/// its rack's worker, every rack's partials of the round in progress in
/// (no replication message got through yet). Appliances 0 and 2 take
/// epoch 1 and go flat: they take no partial and send no partial result
/// any more; appliance 1's homes can complete nothing (their backup, 2,
/// drops their REPLICATEs as `wrong_epoch`). So rack 1's worker gets no
/// result of that round from it.
#[test]
fn a_rack_appliance_left_in_the_old_epoch_answers_no_new_round() {
    let mut w = World::new_hier(hier_spec(momentum(), 2), &LCORES, 3, CLEAN);
    let (v, all) = replication_cut(&mut w);
    send_round(&mut w, FAIL_IN, &v, &all, false);
    w.run();
    let epoch1 = EpochView::default().with_down(1).unwrap();
    for i in [0, 2] {
        for j in 0..w.shards[i].len() {
            w.shards[i][j].change_epoch(JOB, &epoch1).unwrap();
        }
    }
    w.faults = CLEAN;
    // Rank 2 (rack 1's only worker) still routes by epoch 0.
    let mine: Vec<(u16, u64)> = (0..w.total()).map(|g| (2u16, g)).collect();
    for t in 0..20 {
        send_and_wait(&mut w, FAIL_IN, &v, &mine, t > 0);
    }
    for k in &mine {
        assert_eq!(w.got[k].0, FAIL_IN - 1, "{k:?} was answered by the fenced rack");
    }
    for g in w.layout.part(1).range() {
        let (i, j, slot) = w.primary(g);
        assert_eq!(i, 1);
        let held = w.shards[i][j].primary_state(JOB, slot).unwrap();
        assert_eq!(
            held.round,
            Some(FAIL_IN - 1),
            "chunk {g} completed at the fenced home"
        );
    }
    let dropped: u64 = w.shards[2]
        .iter()
        .map(|s| s.replica_stats(JOB).unwrap().wrong_epoch)
        .sum();
    assert!(
        dropped > 0,
        "no REPLICATE of appliance 1 reached appliance 2 in epoch 1"
    );
    // The flat appliances refuse its partials: the job has no homes there.
    let refused: u64 = w.shards[0]
        .iter()
        .chain(&w.shards[2])
        .map(|s| {
            s.counters()
                .snapshot(0)
                .drops
                .get("wrong_peer")
                .copied()
                .unwrap_or(0)
        })
        .sum();
    assert!(refused > 0, "appliance 1's partials were taken in epoch 1");
}
