//! Re-replication (PROTOCOL.md §11.7) on hand-wired appliances, BSP,
//! W = 2, momentum (so the optimizer state must travel too): an appliance
//! declared down comes back empty, gets every chunk's state from the
//! chunks' primaries while rounds go on, joins the replication chain, and
//! can take over when the appliance that adopted its part dies in turn.
//! Every element of every round any worker holds must equal a run without
//! failure, and no RESULT may leave before every backup of the epoch (new
//! ones included) holds its round ([`World::drain`]'s check).

use crate::replica_world::*;

/// One rack; lcores 2, 1, 2; sets 0 → 1, 1 → 2, 2 → 0.
const LCORES: [usize; 3] = [2, 1, 2];
const RACKS: [&str; 3] = ["", "", ""];
/// Rounds 0 ..= ROUNDS.
const ROUNDS: u32 = 7;
/// Appliance 1 dies before this round (adopted by 2, epoch 1).
const KILL: u32 = 2;
/// Appliance 1 comes back before this round (epoch 2).
const BACK: u32 = 3;
/// Appliance 2, the adopter, dies before this round (epoch 3).
const KILL_ADOPTER: u32 = 5;

fn spec_r(replicas: u32) -> JobSpec {
    let s = JobSpec::new("rerep", 2, &[40, 24, 8, 33])
        .with_optimizer(Optimizer::Momentum {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
        })
        .with_chunk_bytes(64)
        .sharded_over(Appliances::Count(3))
        .with_replicas(replicas);
    s.validate().unwrap();
    s
}

/// Loss and duplication of every datagram, state fragments included.
const LOSSY: Faults = Faults {
    replica_loss: 0.25,
    loss: 0.05,
    dup: 0.25,
};

/// Every rank's values of every chunk in `round`: the same in every run.
fn values(w: &World, round: u32) -> HashMap<(u16, u64), Vec<f32>> {
    round_values(w, 0x7e7e, round)
}

/// Every (rank, chunk)'s result after each round, without failure.
fn reference(replicas: u32) -> Vec<Got> {
    results_without_failure(spec_r(replicas), &LCORES, &RACKS, ROUNDS, 0x7e7e)
}

/// Appliance `i` back in the next epoch: installed anew (empty), then the
/// others take the epoch, as control would do it (§11.7).
fn bring_back(w: &mut World, i: usize) -> EpochView {
    let view = w.epoch.with_joined(i as u16).unwrap();
    install_joined(w, i, &view);
    view
}

/// Appliance index `i` installed anew (empty) at `view`, which names it
/// joined (back, or moved to another appliance by a drain), then the
/// others take `view` (each once: again changes nothing), as control
/// would do it (§11.7, §11.8).
fn install_joined(w: &mut World, i: usize, view: &EpochView) {
    w.reinstall(i, view);
    // Installed empty: every backup slot awaits its copy, none taken.
    let c = copies(w, i);
    assert!(c.awaiting > 0 && c.owed == 0 && c.bytes_received == 0, "{c:?}");
    assert_eq!(c.epoch, view.epoch);
    w.epoch = view.clone();
    for a in 0..w.shards.len() {
        if w.dead[a] || a == i {
            continue;
        }
        for j in 0..w.shards[a].len() {
            assert_eq!(w.shards[a][j].change_epoch(JOB, view), Ok(true));
            assert_eq!(w.shards[a][j].change_epoch(JOB, view), Ok(false));
            w.drain(a, j);
        }
    }
}

/// Appliance `i`'s state copies of the job as its stats report them
/// (what control watches, PROTOCOL.md §11.7), over its lcores.
fn copies(w: &World, i: usize) -> phub_proto::api::CopyProgress {
    copies_of(&w.shards[i])
}

fn stat(w: &World, i: usize, f: fn(&phub_engine::engine::ReplicaStats) -> u64) -> u64 {
    w.shards[i]
        .iter()
        .map(|s| f(&s.replica_stats(JOB).unwrap()))
        .sum()
}

/// Every chunk's primary in the workers' epoch and each of its backups
/// there hold the same round and bits.
fn assert_replicas_level(w: &World, round: u32) {
    for g in 0..w.total() {
        let s = w.layout.serve(g, &w.epoch).unwrap();
        let p = w.shards[s.appliance][s.lcore]
            .primary_state(JOB, s.slot as u32)
            .unwrap();
        assert_eq!(p.round, Some(round), "chunk {g}'s primary {}", s.appliance);
        let home = w.layout.home(g).unwrap();
        for &b in &w.layout.set_in(home, &w.epoch)[1..] {
            let held = w.shards[b]
                .iter()
                .find_map(|x| x.backup_state(JOB, g))
                .unwrap_or_else(|| panic!("appliance {b} keeps no backup of chunk {g}"));
            assert_eq!(held.round, p.round, "chunk {g}, backup {b}: round");
            assert_eq!(held.result, p.result, "chunk {g}, backup {b}: stored result");
            for (k, (a, c)) in p.state.iter().zip(&held.state).enumerate() {
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(c), "chunk {g}, backup {b}: state buffer {k}");
            }
        }
    }
}

/// Rounds `from ..= to`, each checked against the reference.
fn rounds(w: &mut World, want: &[Got], from: u32, to: u32, what: &str) {
    for r in from..=to {
        let v = values(w, r);
        round(w, r, &v);
        assert_eq!(w.got, want[r as usize], "round {r}, {what}");
    }
}

/// Rounds up to `BACK`, appliance 1 down from `KILL` on; returns the
/// world in epoch 1.
fn failed_over(faults: Faults, seed: u64, want: &[Got]) -> World {
    let mut w = World::new(spec_r(2), &LCORES, &RACKS, seed, faults);
    rounds(&mut w, want, 0, KILL - 1, "before the kill");
    w.dead[1] = true;
    let e1 = EpochView::default().with_down(1).unwrap();
    change_epoch(&mut w, &e1);
    rounds(&mut w, want, KILL, BACK - 1, "appliance 1 down");
    w
}

#[test]
fn an_appliance_back_empty_is_filled_while_rounds_go_on_and_takes_over_exactly() {
    let want = reference(2);
    for (seed, faults) in [(1, CLEAN), (2, LOSSY), (3, LOSSY)] {
        let mut w = failed_over(faults, seed, &want);
        let e2 = bring_back(&mut w, 1);
        assert_eq!(e2.joined_at(1), Some(2));
        // Rounds go on while the copies are on their way.
        rounds(&mut w, &want, BACK, KILL_ADOPTER - 1, "appliance 1 back");
        assert_replicas_level(&w, KILL_ADOPTER - 1);
        // Appliance 1 took a copy of every chunk of its own part (served
        // by 2) and of appliance 0's, whole.
        let copied = w.layout.part(0).count + w.layout.part(1).count;
        assert_eq!(stat(&w, 1, |s| s.states_installed), copied, "seed {seed}");
        assert_eq!(
            stat(&w, 0, |s| s.backups_joined) + stat(&w, 2, |s| s.backups_joined),
            copied
        );
        assert!(stat(&w, 0, |s| s.states_sent) + stat(&w, 2, |s| s.states_sent) >= copied);
        // Their stats say so: nothing awaited or owed anywhere, and the
        // bytes appliance 1 took.
        for a in 0..3 {
            let c = copies(&w, a);
            assert_eq!((c.epoch, c.awaiting, c.owed), (2, 0, 0), "appliance {a}: {c:?}");
        }
        assert!(copies(&w, 1).bytes_received > 0);
        // The adopter dies: appliance 1 serves its own part again, from
        // the state it was copied and the rounds since; 0 adopts 2's part.
        w.dead[2] = true;
        let e3 = e2.with_down(2).unwrap();
        change_epoch(&mut w, &e3);
        assert_eq!(w.layout.primary(1, &e3), Some(1));
        rounds(&mut w, &want, KILL_ADOPTER, ROUNDS, "the adopter killed");
        assert_replicas_level(&w, ROUNDS);
        assert!(w.errors.is_empty(), "{:?}", w.errors);
    }
}

/// What a checkpoint keeps of each appliance (PROTOCOL.md §11.7,
/// "Restored parts"): its own part alone, whatever the epoch. The adopter
/// saves its own slots, not the part it adopted; the appliance that came
/// back keeps its own part as backup slots (the adopter stays its
/// primary) and saves those: refused while their state copy is not all
/// there, then bit for bit what the part's primary holds. (Before, an
/// lcore saved every primary slot it had: the adopter's part grew by the
/// adopted slots and the returned appliance's had none, and control
/// refused both files against the layout.)
#[test]
fn a_checkpoint_holds_each_appliance_s_own_part_through_a_failover_and_a_return() {
    let want = reference(2);
    let mut w = failed_over(CLEAN, 31, &want);
    let own = |w: &World, a: usize| -> Vec<u64> { w.layout.runs_of(a).iter().map(|r| r.count).collect() };
    // Epoch 1: appliance 2 serves its own part and 1's.
    let mut all = 0;
    for (j, &n) in own(&w, 2).iter().enumerate() {
        let s = &w.shards[2][j];
        let saved = s
            .part_snapshot(JOB)
            .expect("installed")
            .expect("its own part is here");
        assert_eq!(saved.len() as u64, n, "appliance 2 lcore {j}");
        all += s.snapshot(JOB).unwrap().len() as u64;
    }
    assert!(all > own(&w, 2).iter().sum::<u64>(), "appliance 2 adopted slots");
    // Appliance 1 back, empty: its own part's backup slots await a copy.
    let e2 = bring_back(&mut w, 1);
    for (j, &n) in own(&w, 1).iter().enumerate() {
        let got = w.shards[1][j].part_snapshot(JOB).expect("installed");
        if n > 0 {
            assert!(
                matches!(got, Err(phub_engine::EngineError::Checkpoint { .. })),
                "appliance 1 lcore {j} before its copy: {got:?}"
            );
        }
    }
    rounds(&mut w, &want, BACK, KILL_ADOPTER - 1, "appliance 1 back");
    assert_eq!(w.epoch, e2);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (j, run) in w.layout.runs_of(1).to_vec().into_iter().enumerate() {
        let saved = w.shards[1][j]
            .part_snapshot(JOB)
            .expect("installed")
            .expect("its copy is whole");
        assert_eq!(saved.len() as u64, run.count, "appliance 1 lcore {j}");
        for (k, st) in saved.iter().enumerate() {
            let g = run.first + k as u64;
            let at = w.layout.serve(g, &w.epoch).unwrap();
            assert_eq!(at.appliance, 2, "chunk {g}'s primary is the adopter");
            let p = w.shards[at.appliance][at.lcore]
                .primary_state(JOB, at.slot as u32)
                .unwrap();
            assert_eq!(st.completed, p.round, "chunk {g}: round");
            assert_eq!(st.completed, Some(KILL_ADOPTER - 1), "chunk {g}: round");
            assert_eq!(bits(&st.params), bits(p.state[0]), "chunk {g}: parameters");
            assert_eq!(bits(&st.s1), bits(p.state[1]), "chunk {g}: optimizer state");
            // (A result that is the parameters is not saved apart.)
            if !st.result.is_empty() {
                assert_eq!(st.result, p.result, "chunk {g}: stored result");
            }
        }
    }
    assert!(w.errors.is_empty(), "{:?}", w.errors);
}

/// Appliance 1 drained while rounds go on (PROTOCOL.md §11.8): its index
/// moves to another appliance (host 10.0.1.2), installed empty at the
/// next epoch, which every other appliance takes; the old one is gone
/// (what is sent to it is lost). The others must address the new one
/// from that epoch on, or its state copies never arrive.
#[test]
fn a_drained_appliance_s_index_moves_to_a_new_one_which_is_filled_and_takes_over_exactly() {
    let want = reference(2);
    for (seed, faults) in [(21, CLEAN), (22, LOSSY), (23, LOSSY)] {
        let mut w = World::new(spec_r(2), &LCORES, &RACKS, seed, faults);
        rounds(&mut w, &want, 0, KILL - 1, "before the drain");
        let data = phub_proto::api::DataAddr {
            host: "10.0.1.2".into(),
            base_port: 9000,
        };
        let e1 = w.epoch.with_moved(1, "d", data);
        w.hosts[1] = 2;
        install_joined(&mut w, 1, &e1);
        // Part 1 is served by 2 (its backup) while the new 1 is copied.
        assert_eq!(w.layout.set_in(1, &e1), [2, 1]);
        rounds(&mut w, &want, KILL, KILL_ADOPTER - 1, "index 1 moved");
        assert_replicas_level(&w, KILL_ADOPTER - 1);
        for a in 0..3 {
            let c = copies(&w, a);
            assert_eq!((c.epoch, c.awaiting, c.owed), (1, 0, 0), "appliance {a}: {c:?}");
        }
        assert!(copies(&w, 1).bytes_received > 0);
        // The adopter dies: the new appliance serves index 1's part.
        w.dead[2] = true;
        let e2 = e1.with_down(2).unwrap();
        change_epoch(&mut w, &e2);
        assert_eq!(w.layout.primary(1, &e2), Some(1));
        rounds(&mut w, &want, KILL_ADOPTER, ROUNDS, "the adopter killed");
        assert_replicas_level(&w, ROUNDS);
        assert!(w.errors.is_empty(), "seed {seed}: {:?}", w.errors);
    }
}

/// Which appliance dies during the state copy.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Victim {
    /// The new backup (appliance 1, back).
    NewBackup,
    /// The primary copying to it (appliance 2, which adopted 1's part).
    Primary,
}

#[test]
fn a_kill_at_any_delivery_of_the_state_copy_loses_no_round_and_changes_no_bit() {
    let want = reference(2);
    for victim in [Victim::NewBackup, Victim::Primary] {
        for faults in [CLEAN, LOSSY] {
            let (mut points, mut lost) = (0, 0);
            for kill_after in 0.. {
                let mut w = failed_over(faults, 11 + kill_after as u64, &want);
                let e2 = bring_back(&mut w, 1);
                // Round BACK's pushes join the copies in flight.
                let v = values(&w, BACK);
                let all: Vec<(u16, u64)> = (0..2u16)
                    .flat_map(|r| (0..w.total()).map(move |g| (r, g)))
                    .collect();
                send_round(&mut w, BACK, &v, &all, false);
                let mut delivered = 0;
                while delivered < kill_after && w.step() {
                    delivered += 1;
                }
                if delivered < kill_after {
                    break;
                }
                points += 1;
                let dies = match victim {
                    Victim::NewBackup => 1,
                    Victim::Primary => 2,
                };
                w.dead[dies] = true;
                // Killed: what it had not sent yet is gone too.
                let of =
                    |a: &SocketAddrV4| a.ip().octets()[1] == 0 && usize::from(a.ip().octets()[2]) == dies;
                w.net.retain(|(f, t, _)| !of(f) && !of(t));
                w.run();
                let e3 = e2.with_down(dies as u16).unwrap();
                let what = format!(
                    "{victim:?} killed after {kill_after} deliveries, {:?}",
                    faults.dup
                );
                if victim == Victim::Primary {
                    // Appliance 1 must serve its own part now: only if
                    // every chunk's copy is whole on the lcore.
                    let refused: Vec<_> = w.shards[1]
                        .iter_mut()
                        .map(|s| s.change_epoch(JOB, &e3))
                        .filter_map(Result::err)
                        .collect();
                    if let Some(e) = refused.first() {
                        assert!(e.to_string().contains("state copy is not all here"), "{e}");
                        // The part is lost; nothing of it was answered
                        // beyond what appliance 1 was copied (checked at
                        // every RESULT). The job ends here.
                        lost += 1;
                        continue;
                    }
                    w.epoch = e3.clone();
                    for j in 0..w.shards[1].len() {
                        w.drain(1, j);
                    }
                    for j in 0..w.shards[0].len() {
                        assert_eq!(w.shards[0][j].change_epoch(JOB, &e3), Ok(true));
                        w.drain(0, j);
                    }
                } else {
                    change_epoch(&mut w, &e3);
                }
                w.run();
                round(&mut w, BACK, &v);
                assert_eq!(w.got, want[BACK as usize], "round {BACK}, {what}");
                rounds(&mut w, &want, BACK + 1, ROUNDS, &what);
                assert_replicas_level(&w, ROUNDS);
                assert!(w.errors.is_empty(), "{what}: {:?}", w.errors);
            }
            eprintln!(
                "{victim:?}, dup {:?}: {points} kill points, {lost} with the part lost",
                faults.dup
            );
            // One round's deliveries plus the copies: every point counted.
            assert!(points >= 40, "{victim:?}: only {points} kill points");
            if victim == Victim::Primary && faults.dup == 0.0 {
                // Early kills find the copy incomplete, late ones whole.
                assert!(lost > 0 && lost < points, "{lost} of {points} lost");
            }
        }
    }
}

#[test]
fn a_new_primary_of_an_adopted_part_replicates_it_to_the_backup_left() {
    // Replicas 3 over 3: every appliance backs up both others. Appliance 0
    // dies at any point of a round: 1 adopts its part and brings 2, its
    // remaining backup, level by a state copy (2 may be a round behind or
    // ahead of 1), then replicates every later round to it. Then 1 dies
    // too: 2 serves both parts, exactly.
    let want = reference(3);
    let e1 = EpochView::default().with_down(0).unwrap();
    let (mut points, mut uneven) = (0, 0);
    for kill_after in 0.. {
        let mut w = World::new(spec_r(3), &LCORES, &RACKS, 5, CLEAN);
        rounds(&mut w, &want, 0, KILL - 1, "before the kill");
        let v = values(&w, KILL);
        let all: Vec<(u16, u64)> = (0..2u16)
            .flat_map(|r| (0..w.total()).map(move |g| (r, g)))
            .collect();
        send_round(&mut w, KILL, &v, &all, false);
        let mut delivered = 0;
        while delivered < kill_after && w.step() {
            delivered += 1;
        }
        if delivered < kill_after {
            break;
        }
        points += 1;
        w.dead[0] = true;
        // Killed: what it had not sent yet is gone too, so 1 and 2 may
        // differ by the round it was replicating.
        w.net
            .retain(|(f, t, _)| *f.ip() != *lcore_addr(0, 0).ip() && *t.ip() != *lcore_addr(0, 0).ip());
        w.run();
        let round_at = |w: &World, a: usize, g: u64| {
            w.shards[a]
                .iter()
                .find_map(|s| s.backup_state(JOB, g))
                .unwrap()
                .round
        };
        if w.layout
            .part(0)
            .range()
            .any(|g| round_at(&w, 1, g) != round_at(&w, 2, g))
        {
            uneven += 1;
        }
        // Taken, not refused (it was 409: a live backup of the part).
        change_epoch(&mut w, &e1);
        assert_eq!(w.layout.set_in(0, &e1), [1, 2]);
        w.run();
        let what = format!("appliance 0 killed after {kill_after} deliveries");
        round(&mut w, KILL, &v);
        assert_eq!(w.got, want[KILL as usize], "round {KILL}, {what}");
        rounds(&mut w, &want, KILL + 1, 4, &what);
        assert_replicas_level(&w, 4);
        assert_eq!(
            stat(&w, 2, |s| s.states_installed),
            w.layout.part(0).count,
            "{what}"
        );
        w.dead[1] = true;
        let e2 = e1.with_down(1).unwrap();
        change_epoch(&mut w, &e2);
        rounds(&mut w, &want, 5, ROUNDS, &what);
        assert!(w.errors.is_empty(), "{what}: {:?}", w.errors);
    }
    assert!(points >= 6 * 9, "only {points} kill points");
    // Some kills left the two survivors a round apart (§11.6 rule 3).
    assert!(uneven > 0, "{uneven} of {points}");
}

#[test]
fn a_state_fragment_is_checked_and_a_late_one_changes_nothing() {
    let want = reference(2);
    let mut w = failed_over(CLEAN, 21, &want);
    // Keep the copies to appliance 1 to look at them.
    let e2 = w.epoch.with_joined(1).unwrap();
    w.reinstall(1, &e2);
    w.epoch = e2.clone();
    for j in 0..w.shards[0].len() {
        w.shards[0][j].change_epoch(JOB, &e2).unwrap();
    }
    let frags: Vec<(SocketAddrV4, Vec<u8>)> = w.shards[0]
        .iter()
        .enumerate()
        .flat_map(|(j, s)| {
            s.transmits()
                .flat_map(|t| {
                    let mut d = t.header.to_vec();
                    d.extend_from_slice(t.payload);
                    t.to.map(move |_| d.clone())
                })
                .map(move |d| (lcore_addr(0, j), d))
                .collect::<Vec<_>>()
        })
        .collect();
    for j in 0..w.shards[0].len() {
        w.shards[0][j].clear_transmits();
    }
    // Momentum, f32: parameters and one state; the result is the
    // parameters. Two fragments per chunk of appliance 0's part.
    assert_eq!(frags.len() as u64, 2 * w.layout.part(0).count);
    let (from, first) = frags[0].clone();
    let (repr, _) = replica::parse(&first).unwrap();
    assert_eq!(
        (repr.kind, repr.fragment, repr.fragments, repr.round),
        (ReplicaMsgType::ReplicateState, 0, 2, BACK - 1)
    );
    let to = lcore_addr(1, 0);
    let b = &mut w.shards[1][0];
    // Wrong fragment count, and from another address: refused.
    let mut bad = first.clone();
    bad[wire::field::FRAGMENTS] = 3;
    assert_eq!(
        b.handle(from, &bad, 1),
        Verdict::Dropped(DropReason::CountMismatch)
    );
    assert_eq!(
        b.handle(lcore_addr(2, 0), &first, 1),
        Verdict::Dropped(DropReason::WrongPeer)
    );
    // A REPLICATE before the copy is in: ahead.
    let mut rep = first.clone();
    rep[wire::field::TYPE] = ReplicaMsgType::Replicate.code();
    rep[wire::field::ROUND].copy_from_slice(&BACK.to_le_bytes());
    assert_eq!(b.handle(from, &rep, 1), Verdict::Dropped(DropReason::Ahead));
    // Fragment 0 twice, then 1: whole, one ACK per taking of the whole.
    assert_eq!(b.handle(from, &first, 1), Verdict::Replicated);
    assert_eq!(b.handle(from, &first, 1), Verdict::Replicated);
    assert!(!b.has_transmits(), "no ACK before the copy is whole");
    let second = frags
        .iter()
        .find(|(f, d)| {
            *f == from
                && d[wire::field::FRAGMENT] == 1
                && d[wire::field::SLOT.start..wire::field::SLOT.end]
                    == first[wire::field::SLOT.start..wire::field::SLOT.end]
        })
        .unwrap()
        .1
        .clone();
    assert_eq!(b.handle(from, &second, 1), Verdict::Replicated);
    let acks: Vec<Vec<u8>> = b.transmits().map(|t| t.header.to_vec()).collect();
    b.clear_transmits();
    assert_eq!(acks.len(), 1);
    let (ack, _) = replica::parse(&acks[0]).unwrap();
    assert_eq!(
        (ack.kind, ack.round, ack.from),
        (ReplicaMsgType::StateAck, BACK - 1, 1)
    );
    let g = w.layout.part(0).first;
    let held = b.backup_state(JOB, g).unwrap();
    assert_eq!(held.round, Some(BACK - 1));
    // A late copy of a fragment: the ACK again, nothing else.
    let before = (
        held.result.to_vec(),
        held.state.iter().map(|s| s.to_vec()).collect::<Vec<_>>(),
    );
    assert_eq!(b.handle(from, &second, 1), Verdict::Replicated);
    assert_eq!(b.transmits().count(), 1);
    b.clear_transmits();
    let held = b.backup_state(JOB, g).unwrap();
    assert_eq!(
        (
            held.result.to_vec(),
            held.state.iter().map(|s| s.to_vec()).collect::<Vec<_>>()
        ),
        before
    );
    assert_eq!(b.replica_stats(JOB).unwrap().states_installed, 1);
    let _ = to;
}
