//! Failover of a replicated job (PROTOCOL.md §11.6), end to end: three
//! phub-dataplane processes under one phub-control, a job with two
//! replicas of every chunk, workers on the phub-worker library training
//! it; one appliance is killed (SIGKILL) between two rounds while a rank
//! is already pushing the next. Control declares it down, installs the
//! next epoch on the two others, the workers follow it, and every element
//! of every result of every round stays exact (each is checked by
//! `train_rank` against the formula) — nothing answered is lost or
//! applied twice.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::{all_trained, at_full_strength, replicated_spec, train_ranks, Appliances, Operator};
use phub::proto::failover::EpochView;
use phub::proto::routes::control;

#[test]
fn a_primary_killed_mid_training_fails_over_and_every_round_stays_exact() {
    kill_b_mid_training(2);
}

/// Three replicas over the three appliances: c backs up a's part and b's
/// (in that order), so when b dies c serves b's part at extended slot
/// numbers past a's backup slots, which stay backup slots (vacant slots
/// stand for them, PROTOCOL.md §11.6 rule 4). Before vacant slots c
/// refused the epoch (a gap before the adopted part's slots) and the job
/// hung; found by the simulator.
#[test]
fn with_three_replicas_a_part_adopted_past_one_still_backed_up_fails_over_exactly() {
    kill_b_mid_training(3);
}

/// Appliance b killed between two rounds of a job of `replicas` copies
/// over a, b and c (module head).
fn kill_b_mid_training(replicas: u32) {
    let mut rack = Appliances::start(&[1, 1, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let workers = 2u16;
    let job = rack
        .admit(&replicated_spec(
            "failover",
            workers,
            &keys,
            &["a", "b", "c"],
            replicas,
        ))
        .unwrap();
    assert_eq!(job.appliances, ["a", "b", "c"]);
    let (rounds, kill_after) = (10u32, 4u32);
    let url = rack.control_url.clone();
    // Rank 0 stops before round kill_after + 1 until b is dead; rank 1
    // goes on, so b dies with pushes of that round in flight.
    let reached = AtomicU32::new(0);
    let killed = AtomicBool::new(false);
    // When rank 0 completed the first round after the kill.
    let first_after: Mutex<Option<Instant>> = Mutex::new(None);
    let more = |rank: u16, r: u32| {
        if rank == 0 {
            reached.store(r, Ordering::SeqCst);
            if r == kill_after + 1 {
                while !killed.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            if r == kill_after + 2 {
                *first_after.lock().unwrap() = Some(Instant::now());
            }
        }
        r <= rounds
    };
    let (kill_time, before) = std::thread::scope(|s| {
        let ranks = train_ranks(s, &url, &job, workers, &keys, &more);
        while reached.load(Ordering::SeqCst) < kill_after + 1 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let before = at_full_strength(&url, Some(&rack.operator_token()), job.id);
        rack.kill_dataplane(1);
        let at = Instant::now();
        killed.store(true, Ordering::SeqCst);
        all_trained(ranks, rounds);
        (at, before)
    });
    let resumed_at = first_after.into_inner().unwrap();
    let failover = resumed_at.expect("rank 0 completed a round after the kill") - kill_time;
    eprintln!("failover: the kill to the first round completed after it: {failover:?}");
    // Control moved the job to the next epoch (1, unless a loaded host
    // had an appliance declared down and given the job back before the
    // kill) with b down, and both survivors hold it.
    let epoch: EpochView = rack.send(&control::epoch(job.id));
    assert_eq!(
        epoch,
        EpochView {
            epoch: before.epoch + 1,
            down: vec![1],
            ..before
        }
    );
    for i in [0, 2] {
        assert_eq!(rack.last_round(i, job.id), Some(rounds), "{}", rack.names[i]);
    }
}

/// A replicated job with a table (PROTOCOL.md §11.9), end to end: two
/// ranks `push_pull_rows` the same ids (placed over the three
/// appliances' entries) each round; b is killed while rank 1's round is
/// in flight and rank 0 waits. Control moves the job to the next epoch
/// with b down, c serves b's entry from the backup table it kept, the
/// ranks' row transports follow the epoch, and every row of every answer
/// of every round is exact (SGD of sums of multiples of 0.25: the same
/// bits in any order of arrival) — no round answered is lost or applied
/// twice.
#[test]
fn a_table_s_entry_fails_over_and_every_row_stays_exact() {
    let mut rack = Appliances::start(&[1, 1, 1], "256MiB");
    let spec = "name = \"table-failover\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n\
                [[keys]]\nname = \"w\"\nelements = 64\n\
                [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 4\nrows = 1000\nseed = 3\n\
                optimizer = { kind = \"sgd\", lr = 0.5 }\n\
                [placement]\nappliances = [\"a\", \"b\", \"c\"]\nreplicas = 2\n";
    let job = rack.admit(spec).unwrap();
    let ids: Vec<u64> = (0..60).map(|i| i * 7 + 3).collect();
    let d = 4usize;
    let g = |rank: u16, round: u32, id: u64, e: usize| -> f32 {
        f32::from(rank + 1) * 0.25 + (round as f32) - (id % 3) as f32 + e as f32 * 0.5
    };
    let want = |t: u32| -> Vec<f32> {
        ids.iter()
            .flat_map(|&id| {
                (0..d).map(move |e| {
                    let mut w = 0f32;
                    for r in 1..=t {
                        w -= 0.5 * (g(0, r, id, e) + g(1, r, id, e));
                    }
                    w
                })
            })
            .collect()
    };
    let (rounds, kill_after) = (8u32, 3u32);
    let reached = AtomicU32::new(0);
    let killed = AtomicBool::new(false);
    let url = rack.control_url.clone();
    let before = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u16)
            .map(|rank| {
                let (url, ids, reached, killed) = (&url, &ids, &reached, &killed);
                s.spawn(move || {
                    let w = phub_worker::Worker::join(url, job.id, job.token, rank).unwrap();
                    for round in 1..=rounds {
                        if rank == 0 {
                            reached.store(round, Ordering::SeqCst);
                            while round == kill_after + 1 && !killed.load(Ordering::SeqCst) {
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        }
                        let grads: Vec<f32> = ids
                            .iter()
                            .flat_map(|&id| (0..d).map(move |e| g(rank, round, id, e)))
                            .collect();
                        let mut out = vec![0f32; ids.len() * d];
                        let r = w
                            .push_pull_rows("emb", ids, &grads, &mut out)
                            .unwrap_or_else(|e| panic!("rank {rank} round {round}: {e}"));
                        assert_eq!(r, round, "rank {rank}");
                        assert_eq!(out, want(round), "rank {rank} round {round}");
                    }
                })
            })
            .collect();
        while reached.load(Ordering::SeqCst) < kill_after + 1 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let before = at_full_strength(&url, Some(&rack.operator_token()), job.id);
        // Rank 1's round kill_after + 1 is out (or on its way) when b dies.
        std::thread::sleep(Duration::from_millis(50));
        rack.kill_dataplane(1);
        killed.store(true, Ordering::SeqCst);
        for h in hs {
            h.join().unwrap();
        }
        before
    });
    let epoch: EpochView = rack.send(&control::epoch(job.id));
    assert_eq!(
        epoch,
        EpochView {
            epoch: before.epoch + 1,
            down: vec![1],
            ..before
        }
    );
}
