//! Re-replication of a replicated job (PROTOCOL.md §11.7), end to end:
//! three phub-dataplane processes under one phub-control, a job with two
//! replicas of every chunk, workers on the phub-worker library training
//! it. Appliance b, a primary, is killed (SIGKILL) mid-training; once
//! control has failed the job over without it, b's dataplane is started
//! again on the same ports, empty; control gives it the job back at the
//! next epoch, its primaries copy it the state, and `job show` reports
//! full strength. Then c, the other member of b's part's replica set, is
//! killed: b serves its part again from the copy, and every element of
//! every result of every round stays exact (each is checked by
//! `train_rank` against the formula). The second test restarts b at once,
//! within the heartbeat deadline, so that it may never be declared down:
//! control's reconciliation finds it without the job and takes the same
//! way back (failover, then re-replication), never giving it the job at
//! the epoch it served it in, where it would serve its part empty. The
//! third kills c while b's copy may be under way: either b's copy of its
//! part was whole and every round stays exact, or the part is lost (b
//! answers the epoch without c 410) and the job fails, its workers ending
//! with control's reason; never a wrong result, never a hang.
//! The restore tests that follow take the whole job back to its
//! checkpoints: after every appliance restarted, after two of three did,
//! and after both replicas of a part were killed one after the other,
//! which stalls the job until both are back (PROTOCOL.md §11.7).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::common::{
    all_trained, hierarchical_replicated_spec, replicated_spec, replicated_table_spec, train_rank,
    train_ranks, train_table_ranks, try_until, until, Appliances, Gates, Operator,
};
use phub::proto::api::{JobDetail, Strength};
use phub::proto::failover::{EpochView, Joined};
use phub::proto::routes::{control, mgmt};
use phub_worker::WorkerConfig;

#[test]
fn a_killed_primary_restarted_is_brought_back_to_full_strength_and_survives_its_partner_s_kill() {
    kill_restart_then_kill_partner(true, false);
}

#[test]
fn a_primary_restarted_at_once_is_brought_back_the_same_way_and_survives_its_partner_s_kill() {
    kill_restart_then_kill_partner(false, false);
}

/// Kills b mid-training and starts it again (after control failed the job
/// over without it when `after_failover`, else at once), waits for full
/// strength, then kills c; checks every round exact.
/// A hierarchical job (a rack of one rank each, PROTOCOL.md §11.11) the
/// same way: b's death makes it flat over the home layout at epoch 1, and
/// b comes back to it as to a flat job's.
#[test]
fn a_hierarchical_job_s_killed_rack_appliance_restarted_is_brought_back_to_full_strength() {
    kill_restart_then_kill_partner(true, true);
}

fn kill_restart_then_kill_partner(after_failover: bool, hierarchical: bool) {
    let mut rack = Appliances::start(&[1, 1, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    // Racks r1, r2, r3: b's part is backed up on c (PROTOCOL.md §11.1).
    let (workers, spec) = if hierarchical {
        let spec = hierarchical_replicated_spec("rereplication", 3, &keys, &["a", "b", "c"], 2);
        (3u16, spec)
    } else {
        (
            2u16,
            replicated_spec("rereplication", 2, &keys, &["a", "b", "c"], 2),
        )
    };
    let job = rack.admit(&spec).unwrap();
    assert_eq!(job.appliances, ["a", "b", "c"]);
    let rounds = 16u32;
    let url = rack.control_url.clone();
    // Rank 0 stops before round 5 until b is dead, and before 11 until c
    // is: each dies with rank 1's pushes of the next round in flight.
    let gates = Gates::new(&[4, 10], rounds);
    let more = |rank: u16, r: u32| gates.more(rank, r);
    let full_ms = std::thread::scope(|s| {
        let ranks = train_ranks(s, &url, &job, workers, &keys, &more);
        gates.wait_at(0);
        rack.kill_dataplane(1);
        gates.open(0);
        if after_failover {
            // Control fails the job over without b before b answers again.
            until("epoch 1 without b", Duration::from_secs(20), || {
                rack.send(&control::epoch(job.id)).down == [1]
            });
        }
        rack.start_dataplane(1);
        let back = Instant::now();
        let detail = |rack: &Appliances| job_detail(rack, job.id);
        // Full strength after b's return: a re-replication that ended (at
        // once after the restart the job may still be at epoch 0, whole).
        let full = || {
            detail(&rack).replicas.is_some_and(|r| {
                r.state == Strength::FullStrength
                    && r.live == 2
                    && r.rereplication.is_some_and(|x| x.ended_unix_ms.is_some())
            })
        };
        if !try_until(Duration::from_secs(30), full) {
            // What control and each appliance say, for the diagnosis.
            let views = rack.copies_views(job.id);
            panic!(
                "not at full strength 30 s after b's restart: {:?}; epoch {:?}; appliances {views:?}",
                detail(&rack).replicas,
                rack.send(&control::epoch(job.id))
            );
        }
        let took = back.elapsed();
        let r = detail(&rack).replicas.unwrap();
        let x = r.rereplication.clone().expect("the re-replication is reported");
        assert_eq!((x.appliance.as_str(), x.epoch), ("b", 2), "{r:?}");
        assert!(x.bytes_copied.is_some_and(|b| b > 0), "{x:?}");
        eprintln!(
            "b back: full strength {:?} ms after control decided it ({took:?} after the restart), {:?} bytes copied",
            x.full_strength_ms(),
            x.bytes_copied
        );
        assert_eq!(
            rack.send(&control::epoch(job.id)),
            EpochView {
                epoch: 2,
                down: vec![],
                joined: vec![Joined {
                    appliance: 1,
                    epoch: 2
                }],
                moved: vec![],
                restored: 0,
            }
        );
        // Now the other member of b's part's set dies: b serves it again.
        gates.wait_at(1);
        rack.kill_dataplane(2);
        gates.open(1);
        all_trained(ranks, rounds);
        x.full_strength_ms()
    });
    assert!(full_ms.is_some());
    let epoch: EpochView = rack.send(&control::epoch(job.id));
    assert_eq!((epoch.epoch, &epoch.down), (3, &vec![2]), "{epoch:?}");
    // b completed every round of its own part again, from the copy.
    let stats: phub::proto::api::DataplaneStats = rack.dataplane(1, &mgmt::stats());
    let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
    assert_eq!(live.round_range.map(|r| r.1), Some(rounds), "b: {live:?}");
}

/// A job with a table (PROTOCOL.md §11.9): b is killed mid-training, its
/// entry served by c from the next epoch; b is started again, empty, and
/// control gives it the job back: the entries it backs up (a's, and its
/// own, which c goes on serving) come to it by state copies while the
/// ranks train, and `job show` says full strength. Then c dies: b serves
/// its own entry again from its copy and c's from its backup tables, and
/// every row of every answer of every round stays exact.
#[test]
fn a_table_s_appliance_restarted_gets_its_entries_copied_and_serves_them_after_its_partner_s_kill() {
    let mut rack = Appliances::start(&[1, 1, 1], "256MiB");
    let job = rack
        .admit(&replicated_table_spec("table-rereplication", &["a", "b", "c"]))
        .unwrap();
    let rounds = 12u32;
    let gates = Gates::new(&[3, 8], rounds);
    let url = rack.control_url.clone();
    std::thread::scope(|s| {
        let ranks = train_table_ranks(s, &url, &job, &gates, rounds);
        gates.wait_at(0);
        rack.kill_dataplane(1);
        gates.open(0);
        until("epoch 1 without b", Duration::from_secs(20), || {
            rack.send(&control::epoch(job.id)).down == [1]
        });
        rack.start_dataplane(1);
        let full = || {
            job_detail(&rack, job.id).replicas.is_some_and(|r| {
                r.state == Strength::FullStrength
                    && r.live == 2
                    && r.rereplication.is_some_and(|x| x.ended_unix_ms.is_some())
            })
        };
        if !try_until(Duration::from_secs(30), full) {
            let views = rack.copies_views(job.id);
            panic!(
                "not at full strength 30 s after b's restart: {:?}; epoch {:?}; appliances {views:?}",
                job_detail(&rack, job.id).replicas,
                rack.send(&control::epoch(job.id))
            );
        }
        let x = job_detail(&rack, job.id)
            .replicas
            .and_then(|r| r.rereplication)
            .expect("the re-replication is reported");
        assert_eq!((x.appliance.as_str(), x.epoch), ("b", 2), "{x:?}");
        assert!(x.bytes_copied.is_some_and(|b| b > 0), "{x:?}");
        gates.wait_at(1);
        rack.kill_dataplane(2);
        gates.open(1);
        for h in ranks {
            h.join().unwrap();
        }
    });
    let epoch: EpochView = rack.send(&control::epoch(job.id));
    assert_eq!((epoch.epoch, &epoch.down), (3, &vec![2]), "{epoch:?}");
}

#[test]
fn a_partner_killed_during_the_copy_leaves_every_round_exact_or_fails_the_job_saying_why() {
    let mut rack = Appliances::start(&[1, 1, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let workers = 2u16;
    let job = rack
        .admit(&replicated_spec("copy-kill", workers, &keys, &["a", "b", "c"], 2))
        .unwrap();
    let (rounds, kill_at) = (12u32, 4u32);
    let url = rack.control_url.clone();
    let reached = AtomicU32::new(0);
    let killed = AtomicBool::new(false);
    let outcomes: Mutex<Vec<Result<u32, String>>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for rank in 0..workers {
            let (url, keys, reached, killed, outcomes) = (&url, &keys, &reached, &killed, &outcomes);
            s.spawn(move || {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    train_rank(
                        url,
                        job.id,
                        job.token,
                        rank,
                        workers,
                        keys,
                        WorkerConfig::default(),
                        |r| {
                            if rank == 0 {
                                reached.store(r, Ordering::SeqCst);
                                if r == kill_at + 1 {
                                    until("the kills", Duration::from_secs(120), || {
                                        killed.load(Ordering::SeqCst)
                                    });
                                }
                            }
                            r <= rounds
                        },
                    )
                    .0
                }));
                let outcome = run.map_err(|p| {
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|m| (*m).to_string()))
                        .unwrap_or_default()
                });
                outcomes.lock().unwrap().push(outcome);
            });
        }
        until("rank 0 at the first kill", Duration::from_secs(60), || {
            reached.load(Ordering::SeqCst) > kill_at
        });
        rack.kill_dataplane(1);
        until("epoch 1 without b", Duration::from_secs(20), || {
            rack.send(&control::epoch(job.id)).down == [1]
        });
        rack.start_dataplane(1);
        // As soon as control gives b the job back, before its copies can
        // be done, c (the source of b's own part) dies.
        until("b joined at epoch 2", Duration::from_secs(20), || {
            rack.send(&control::epoch(job.id)).epoch >= 2
        });
        rack.kill_dataplane(2);
        killed.store(true, Ordering::SeqCst);
    });
    let outcomes = outcomes.into_inner().unwrap();
    let detail = job_detail(&rack, job.id);
    match &detail.summary.failed {
        None => {
            // b's copy was whole: it serves its part from it, exactly.
            assert!(outcomes.iter().all(|o| o == &Ok(rounds)), "{outcomes:?}");
            eprintln!("c killed during the copy: b's copy was whole, every round exact");
        }
        Some(why) => {
            // The part was lost: the job failed saying so, and every
            // worker stopped with control's reason (no wrong result: each
            // round a worker completed was checked exact). Whichever comes
            // first says it: b refusing the epoch that has it serve the
            // part (410), or a reconciliation pass finding no replica of
            // the part holding it (c down, b still being filled).
            let said = |why: &str| {
                (why.contains("state copy is not all here") && why.contains("410"))
                    || (why.contains("every replica of part 1") && why.contains("not yet filled"))
            };
            assert!(said(why), "{why}");
            for o in &outcomes {
                let e = o
                    .as_ref()
                    .expect_err("a worker of a failed job completed every round");
                assert!(e.contains("failed") && said(e), "{e}");
            }
            eprintln!("c killed during the copy: the part was lost and the job failed: {why}");
        }
    }
}

/// A gate the ranks of [`train_through_restores`] wait at before a round:
/// each counts itself in, then waits for the test to open it.
struct Gate {
    /// The round they wait before.
    before: u32,
    /// Ranks waiting.
    at: AtomicU32,
    open: AtomicBool,
}

impl Gate {
    fn before(round: u32) -> Gate {
        Gate {
            before: round,
            at: AtomicU32::new(0),
            open: AtomicBool::new(false),
        }
    }

    /// Waits until `ranks` ranks wait at it.
    fn reached(&self, ranks: u16) {
        until(
            &format!("every rank at round {}", self.before),
            Duration::from_secs(60),
            || self.at.load(Ordering::SeqCst) == u32::from(ranks),
        );
    }
}

/// Rank `rank` of job `id` trains rounds 1 to `rounds`, waiting at each
/// of `gates` before its round, every round checked exact; when an lcore
/// restored from a checkpoint refuses a push `ahead` (PROTOCOL.md §6.1),
/// it pulls every key and goes back to the round after the lowest it
/// pulled, repeating the rounds since with the same gradients. Returns the
/// rounds it went back to, one per `ahead`.
fn train_through_restores(
    url: &str,
    id: u16,
    token: u64,
    rank: u16,
    keys: &[u64],
    rounds: u32,
    gates: &[Gate],
) -> Vec<u32> {
    use phub_hwtests::workload;
    let w = phub_worker::Worker::join(url, id, token, rank).unwrap();
    let mut params = workload::initial_params(rank, keys);
    for (k, p) in params.iter_mut().enumerate() {
        let h = w.init(k as u32, p).unwrap();
        w.wait(h).unwrap();
    }
    let mut back_to = Vec::new();
    let mut round = 1;
    // The highest round this rank had results of.
    let mut reached = 0;
    while round <= rounds {
        if let Some(g) = gates
            .iter()
            .find(|g| g.before == round && !g.open.load(Ordering::SeqCst))
        {
            g.at.fetch_add(1, Ordering::SeqCst);
            until("the gate", Duration::from_secs(120), || {
                g.open.load(Ordering::SeqCst)
            });
        }
        let grads = workload::round_grads(rank, keys, round);
        let failed: Vec<String> = workload::push_pull_keys(&w, &mut params, &grads)
            .into_iter()
            .filter_map(|r| r.err().map(|e| e.to_string()))
            .collect();
        match failed.first() {
            None => {
                assert_round_since(&params, round, reached, &format!("rank {rank}"));
                reached = reached.max(round);
                round += 1;
            }
            Some(e) if e.contains("ahead") && back_to.len() < 20 => {
                // A restored lcore: pull every key, go back to the round
                // after the lowest (a key may stand a round further where
                // the other rank's pushes completed it since).
                std::thread::sleep(Duration::from_millis(100));
                let pulled: Result<Vec<u32>, _> = params
                    .iter_mut()
                    .enumerate()
                    .map(|(k, p)| w.pull(k as u32, p))
                    .collect();
                if let Ok(at) = pulled {
                    let lowest = at.into_iter().min().unwrap_or(0);
                    assert!(
                        lowest < round,
                        "rank {rank}: pulled round {lowest} at round {round}"
                    );
                    back_to.push(lowest + 1);
                    round = lowest + 1;
                }
            }
            Some(e) => panic!("rank {rank} round {round}: {e}"),
        }
    }
    back_to
}

/// Every element of `params`, the results of round `round`, is that
/// round's sum ([`workload::expected`]); or, for a round repeated after
/// going back to checkpoints (`round` ≤ `reached`, the highest round the
/// rank had results of), that of any round from `round` to `reached`: a
/// part restored from a newer checkpoint than others stands at a later
/// round, and answers a push of a round it completed with its stored
/// result (PROTOCOL.md §5.4 rules 4 and 5, §6).
fn assert_round_since(params: &[Vec<f32>], round: u32, reached: u32, who: &str) {
    use phub_hwtests::workload::expected;
    for (k, p) in params.iter().enumerate() {
        for (e, v) in p.iter().enumerate() {
            let k32 = k as u32;
            assert!(
                (round..=reached.max(round)).any(|r| *v == expected(WORKERS, k32, e, r)),
                "{who} round {round} (reached {reached}) key {k} elem {e}: {v}, round {round}'s is {}",
                expected(WORKERS, k32, e, round)
            );
        }
    }
}

/// Starts [`WORKERS`] ranks of `job` in scope `s`, each
/// [`train_through_restores`] of `keys` for `rounds` rounds through
/// `gates`; each returns the rounds it went back to.
fn restore_ranks<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    url: &'env str,
    job: &phub::proto::api::AdmitResponse,
    keys: &'env [u64],
    rounds: u32,
    gates: &'env [Gate],
) -> Vec<std::thread::ScopedJoinHandle<'scope, Vec<u32>>> {
    let (id, token) = (job.id, job.token);
    (0..WORKERS)
        .map(|r| s.spawn(move || train_through_restores(url, id, token, r, keys, rounds, gates)))
        .collect()
}

/// Workers of the restore tests' jobs.
const WORKERS: u16 = 2;

/// Keys of the restore tests' jobs.
const RESTORE_KEYS: [u64; 3] = [5000, 3, 20_000];

/// Three one-lcore appliances a, b, c (racks r1, r2, r3) and a job named
/// `name` over them of [`WORKERS`] ranks and [`RESTORE_KEYS`], two
/// replicas: a's part is backed up on b, b's on c, c's on a.
fn three_appliance_job(name: &str) -> (Appliances, phub::proto::api::AdmitResponse) {
    let rack = Appliances::start(&[1, 1, 1], "256MiB");
    let job = rack
        .admit(&replicated_spec(
            name,
            WORKERS,
            &RESTORE_KEYS,
            &["a", "b", "c"],
            2,
        ))
        .unwrap();
    (rack, job)
}

/// Every rank went back to round 5 first (`back_to`: each rank's rounds
/// Control's detail of job `job`.
fn job_detail(rack: &Appliances, job: u16) -> JobDetail {
    rack.send(&control::job(job))
}

/// The last completed round of job `job` on each of the three appliances.
fn last_rounds(rack: &Appliances, job: u16) -> Vec<Option<u32>> {
    (0..3).map(|i| rack.last_round(i, job)).collect()
}

/// gone back to), and each of the three appliances completed `rounds`.
fn assert_back_to_5_then_done(rack: &Appliances, job: u16, back_to: &[Vec<u32>], rounds: u32) {
    for (rank, b) in back_to.iter().enumerate() {
        assert_eq!(
            b.first(),
            Some(&5),
            "rank {rank} went back to round 5 first: {b:?}"
        );
    }
    for i in 0..3 {
        assert_eq!(rack.last_round(i, job), Some(rounds), "{}", rack.names[i]);
    }
}

/// Every appliance of a replicated job dies at once (a power cut, control
/// with them) after a checkpoint of the round every chunk completed last:
/// no replica of any part kept its state, so control, back, restores each
/// appliance's part from its checkpoint (PROTOCOL.md §11.7, "Restored
/// parts"): each restored primary slot copies its state to its backup
/// before its next round completes, and training goes on exactly (each
/// rank told `ahead` by a restored lcore pulls every key, then pushes its
/// round again). Before, the backups came back holding nothing and
/// refused every next aggregate `ahead`: the job hung.
#[test]
fn a_replicated_job_whose_every_appliance_restarted_goes_on_from_its_checkpoints() {
    every_appliance_restarted(false);
}

/// The same with a hierarchical job (a rack of one rank each, PROTOCOL.md
/// §11.11): its checkpoints hold each appliance's home part, and it goes
/// back to them flat (the dataplane restores the part without its
/// hierarchy; the restored epoch is above 0).
#[test]
fn a_replicated_hierarchical_job_whose_every_appliance_restarted_goes_on_flat_from_its_checkpoints() {
    every_appliance_restarted(true);
}

fn every_appliance_restarted(hierarchical: bool) {
    let mut rack = Appliances::start(&[1, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let spec = if hierarchical {
        hierarchical_replicated_spec("restored", WORKERS, &keys, &["a", "b"], 2)
    } else {
        replicated_spec("restored", WORKERS, &keys, &["a", "b"], 2)
    };
    let job = rack.admit(&spec).unwrap();
    let rounds = 8u32;
    let url = rack.control_url.clone();
    // Both ranks stop after round 4 until both appliances are back.
    let gates = [Gate::before(5)];
    let back_to = std::thread::scope(|s| {
        let ranks = restore_ranks(s, &url, &job, &keys, rounds, &gates);
        gates[0].reached(WORKERS);
        // Every chunk completed round 4: the checkpoint holds it on both
        // appliances.
        let info = rack.send(&control::checkpoint(job.id));
        assert_eq!(info.id, job.id);
        // Control is stopped meanwhile, so that it finds both appliances
        // back without the job at once (otherwise it may see one back and
        // the other silent, and fail the part over to the silent one).
        rack.restart_with_control(&[0, 1]);
        // Control restores both parts within a few reconciliations.
        until("both parts restored at round 4", Duration::from_secs(30), || {
            (0..2).all(|i| rack.last_round(i, job.id) == Some(4))
        });
        gates[0].open.store(true, Ordering::SeqCst);
        ranks.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert!(
        back_to.iter().any(|b| !b.is_empty()),
        "no rank was told ahead: {back_to:?}"
    );
    // Both appliances completed every round.
    for i in 0..2 {
        assert_eq!(rack.last_round(i, job.id), Some(rounds), "{}", rack.names[i]);
    }
}

/// Two of a replicated job's three appliances die at once (control with
/// them) two rounds after a checkpoint, while the third goes on holding
/// its own part and its backup of the second's, at round 6. Part a (set
/// a, b) kept no replica, so the whole job goes back to its checkpoints
/// (PROTOCOL.md §11.7, "Restored parts"): control removes it from c and
/// restores all three parts at round 4; the ranks, told `ahead`, pull
/// every key (at round 4 everywhere, c's chunks too) and repeat rounds 5
/// and 6, every round exact. Before, a and b were restored beside c's
/// newer state: c's backup slots of b's part refused its restored
/// primary's aggregates `stale` and a's restored backup slots of c's
/// part c's aggregates `ahead`, and the job hung.
/// A replicated job with a table (PROTOCOL.md §11.9) whose every
/// appliance restarted goes back to its checkpoints: each appliance's
/// checkpoint holds its own entry's tables, each is restored from it,
/// each restored entry copies its tables to its backup, and the ranks
/// train on with every row of every answer exact.
#[test]
fn a_replicated_table_job_whose_every_appliance_restarted_goes_on_from_its_checkpoints() {
    let mut rack = Appliances::start(&[1, 1], "256MiB");
    let job = rack
        .admit(&replicated_table_spec("table-restored", &["a", "b"]))
        .unwrap();
    let rounds = 8u32;
    let gates = Gates::new(&[4], rounds);
    let url = rack.control_url.clone();
    std::thread::scope(|s| {
        let ranks = train_table_ranks(s, &url, &job, &gates, rounds);
        gates.wait_at(0);
        // Every entry completed round 4 (rank 0 waits before round 5, so
        // no later round completed): the checkpoint holds it.
        let info = rack.send(&control::checkpoint(job.id));
        assert_eq!(info.id, job.id);
        rack.restart_with_control(&[0, 1]);
        // Control takes the job back to its checkpoints: restored on both,
        // at an epoch that says so, each entry's copy at its backup.
        let copied = || {
            rack.send(&control::epoch(job.id)).restored > 0
                && (0..2).all(|i| {
                    let s: phub::proto::api::DataplaneStats = rack.dataplane(i, &mgmt::stats());
                    s.jobs
                        .iter()
                        .find(|j| j.id == job.id)
                        .and_then(|j| j.copies)
                        .is_some_and(|c| c.awaiting == 0 && c.owed == 0 && c.bytes_received > 0)
                })
        };
        if !try_until(Duration::from_secs(30), copied) {
            let views = rack.copies_views(job.id);
            panic!(
                "not restored and copied 30 s after the restart: epoch {:?}; appliances {views:?}",
                rack.send(&control::epoch(job.id))
            );
        }
        gates.open(0);
        for h in ranks {
            h.join().unwrap();
        }
    });
}

#[test]
fn a_part_that_lost_every_replica_takes_the_whole_job_back_to_its_checkpoints() {
    let (mut rack, job) = three_appliance_job("back");
    let keys = RESTORE_KEYS;
    let rounds = 8u32;
    let url = rack.control_url.clone();
    let gates = [Gate::before(5), Gate::before(7)];
    let back_to = std::thread::scope(|s| {
        let ranks = restore_ranks(s, &url, &job, &keys, rounds, &gates);
        gates[0].reached(WORKERS);
        rack.send(&control::checkpoint(job.id));
        gates[0].open.store(true, Ordering::SeqCst);
        gates[1].reached(WORKERS);
        assert_eq!(rack.last_round(2, job.id), Some(6), "c ahead of the checkpoint");
        rack.restart_with_control(&[0, 1]);
        until("every part back at round 4", Duration::from_secs(30), || {
            last_rounds(&rack, job.id) == [Some(4); 3]
        });
        gates[1].open.store(true, Ordering::SeqCst);
        ranks.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert_back_to_5_then_done(&rack, job.id, &back_to, rounds);
}

/// Past a failover and a re-replication: b is killed and comes back
/// (joined at epoch 2, filled by copies, full strength), then every part
/// is checkpointed (b's file holds its install at epoch 2, b joined), and
/// then a and b die at once with control: part a kept no replica, so the
/// whole job goes back to its checkpoints, b's included. Each appliance
/// restores its own part as the checkpoint's job naming nobody down or
/// joined (a checkpoint holds its own slots) and takes the new epoch;
/// training goes on exactly.
#[test]
fn a_job_goes_back_to_checkpoints_taken_after_a_re_replication() {
    let (mut rack, job) = three_appliance_job("back-later");
    let keys = RESTORE_KEYS;
    let rounds = 8u32;
    let url = rack.control_url.clone();
    let gates = [Gate::before(3), Gate::before(5), Gate::before(7)];
    let detail = |rack: &Appliances| job_detail(rack, job.id);
    let full = |rack: &Appliances| {
        detail(rack).replicas.is_some_and(|r| {
            r.state == Strength::FullStrength && r.rereplication.is_some_and(|x| x.ended_unix_ms.is_some())
        })
    };
    let back_to = std::thread::scope(|s| {
        let ranks = restore_ranks(s, &url, &job, &keys, rounds, &gates);
        gates[0].reached(WORKERS);
        rack.kill_dataplane(1);
        until("epoch 1 without b", Duration::from_secs(20), || {
            rack.send(&control::epoch(job.id)).down == [1]
        });
        rack.start_dataplane(1);
        until("b back at full strength", Duration::from_secs(30), || full(&rack));
        gates[0].open.store(true, Ordering::SeqCst);
        gates[1].reached(WORKERS);
        let e: EpochView = rack.send(&control::epoch(job.id));
        assert_eq!((e.epoch, e.joined.len()), (2, 1), "{e:?}");
        rack.send(&control::checkpoint(job.id));
        gates[1].open.store(true, Ordering::SeqCst);
        gates[2].reached(WORKERS);
        rack.restart_with_control(&[0, 1]);
        if !try_until(Duration::from_secs(30), || {
            last_rounds(&rack, job.id) == [Some(4); 3]
        }) {
            let log = rack.control.as_ref().map(|c| c.log_text()).unwrap_or_default();
            eprintln!("control's log:\n{log}");
            panic!(
                "not every part back at round 4: {:?}; epoch {:?}; {:?}",
                last_rounds(&rack, job.id),
                rack.send(&control::epoch(job.id)),
                detail(&rack).summary.failed,
            );
        }
        let e: EpochView = rack.send(&control::epoch(job.id));
        assert!(e.names_nobody() && e.restored == e.epoch && e.epoch == 3, "{e:?}");
        gates[2].open.store(true, Ordering::SeqCst);
        ranks.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert_back_to_5_then_done(&rack, job.id, &back_to, rounds);
}

/// Both appliances of a part's replica set are killed one after the
/// other (control stays up), two rounds after a checkpoint: a first,
/// then b, once the job failed over without a and b's and c's parts were
/// checkpointed again at its epoch 1. Part a kept no live
/// replica, so the job stalls (PROTOCOL.md §11.7, "Stalled jobs"):
/// `job show` says so and why, and the ranks' pushes of round 7 meanwhile
/// wait on the lost part. When both dataplanes are back, empty, the
/// whole job goes back to its checkpoints: a's part at round 4, b's and
/// c's at round 6 (their files of epoch 1, installed as their own parts
/// naming nobody down), c's adopted work since thrown away; the ranks,
/// told `ahead`, pull every key and repeat rounds 5 to 8, every round
/// exact. Before, the second death failed the
/// job.
#[test]
fn a_part_whose_every_replica_was_killed_stalls_the_job_until_both_are_back() {
    let (mut rack, job) = three_appliance_job("stall");
    let keys = RESTORE_KEYS;
    let rounds = 8u32;
    let url = rack.control_url.clone();
    let gates = [Gate::before(5), Gate::before(7)];
    let detail = |rack: &Appliances| job_detail(rack, job.id);
    let back_to = std::thread::scope(|s| {
        let ranks = restore_ranks(s, &url, &job, &keys, rounds, &gates);
        gates[0].reached(WORKERS);
        rack.send(&control::checkpoint(job.id));
        gates[0].open.store(true, Ordering::SeqCst);
        gates[1].reached(WORKERS);
        rack.kill_dataplane(0);
        until("epoch 1 without a", Duration::from_secs(20), || {
            rack.send(&control::epoch(job.id)).down == [0]
        });
        // A checkpoint past the failover: b's and c's parts at round 6,
        // installed at epoch 1; a's part keeps its file of round 4 (its
        // appliance does not answer: the call fails naming it).
        let token = rack.operator_token();
        let taken = crate::common::client(&rack.control_url, Some(&token)).send(&control::checkpoint(job.id));
        assert!(
            taken.as_ref().is_err_and(|e| e.message().contains("\"a\"")),
            "{:?}",
            taken.map(|i| i.round_range)
        );
        rack.kill_dataplane(1);
        until("the job stalled", Duration::from_secs(20), || {
            detail(&rack)
                .replicas
                .is_some_and(|r| r.state == Strength::Stalled)
        });
        let d = detail(&rack);
        assert!(d.summary.failed.is_none(), "{:?}", d.summary.failed);
        let why = d.replicas.and_then(|r| r.stalled).unwrap_or_default();
        assert!(why.contains("part 0 ") && why.contains("\"a\""), "{why}");
        assert_eq!(rack.send(&control::epoch(job.id)).down, [0, 1]);
        // The ranks push round 7 into the stall.
        gates[1].open.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(
            detail(&rack).replicas.map(|r| r.state),
            Some(Strength::Stalled),
            "still stalled with a and b down"
        );
        rack.start_dataplane(0);
        rack.start_dataplane(1);
        until("the job back at full strength", Duration::from_secs(30), || {
            detail(&rack)
                .replicas
                .is_some_and(|r| r.state == Strength::FullStrength)
        });
        let e: EpochView = rack.send(&control::epoch(job.id));
        assert!(e.names_nobody() && e.restored == e.epoch, "{e:?}");
        ranks.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert_back_to_5_then_done(&rack, job.id, &back_to, rounds);
    assert!(detail(&rack).summary.failed.is_none());
}
