//! Faults on the whole appliance: a dataplane crash recovered from a
//! checkpoint, a worker killed mid-round that rejoins, and the other job
//! going on meanwhile; loss, duplication and reordering injected in the
//! dataplane and in the workers.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{grad, Rack};
use phub::proto::api::{CheckpointInfo, JobDetail};
use phub_worker::{FaultSpec, Worker, WorkerConfig, WorkerError, WorkerStats};

fn config() -> WorkerConfig {
    WorkerConfig {
        timeout: Duration::from_secs(20),
        ..WorkerConfig::default()
    }
}

const LR: f32 = 0.125;

/// What SGD on the appliance makes of `rounds` rounds (mean gradient, exact
/// small-integer sums), from initial parameters `init`.
fn sgd_reference(workers: u16, key: u32, init: &[f32], rounds: u32) -> Vec<f32> {
    let mut w = init.to_vec();
    for r in 1..=rounds {
        for (e, v) in w.iter_mut().enumerate() {
            let sum: f32 = (0..workers).map(|rank| grad(rank, key, e, r)).sum();
            *v -= LR * (sum * (1.0 / f32::from(workers)));
        }
    }
    w
}

fn init_values(key: u32, n: u64) -> Vec<f32> {
    (0..n as usize).map(|e| common::init(key, e)).collect()
}

/// Pulls every key after the appliance lost rounds; returns the round to
/// go on from.
fn resync(w: &Worker, params: &mut [Vec<f32>]) -> u32 {
    let mut round = u32::MAX;
    for (k, p) in params.iter_mut().enumerate() {
        round = round.min(w.pull(k as u32, p).expect("pull after the appliance came back"));
    }
    round
}

#[test]
fn dataplane_killed_and_restored_from_a_checkpoint() {
    let mut rack = Rack::start(2, "256MiB");
    let keys = [5000u64, 3];
    let spec = format!(
        "name = \"durable\"\nworkers = 2\n[optimizer]\nkind = \"sgd\"\nlr = {LR}\n\
         [[keys]]\nelements = {}\n[[keys]]\nelements = {}\n",
        keys[0], keys[1]
    );
    let job = rack.admit(&spec).unwrap();
    const TOTAL: u32 = 12;
    let at_checkpoint = Arc::new(Barrier::new(3));
    let checkpointed = Arc::new(Barrier::new(3));
    let at_crash = Arc::new(Barrier::new(3));
    let restarted = Arc::new(Barrier::new(3));
    let url = rack.control_url.clone();
    let finals: Vec<(Vec<Vec<f32>>, u32)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u16)
            .map(|rank| {
                let (url, b1, b2, b3, b4) = (
                    url.clone(),
                    at_checkpoint.clone(),
                    checkpointed.clone(),
                    at_crash.clone(),
                    restarted.clone(),
                );
                s.spawn(move || {
                    let w = Worker::join_with(&url, job.id, job.token, rank, config()).unwrap();
                    let mut params: Vec<Vec<f32>> = keys
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| init_values(k as u32, n))
                        .collect();
                    for (k, p) in params.iter_mut().enumerate() {
                        w.wait(w.init(k as u32, p).unwrap()).unwrap();
                    }
                    let mut round = 0;
                    let mut repeated = 0;
                    let (mut checkpoint_passed, mut crash_passed) = (false, false);
                    while round < TOTAL {
                        let r = round + 1;
                        let mut failed = None;
                        for (k, p) in params.iter_mut().enumerate() {
                            let g: Vec<f32> = (0..p.len()).map(|e| grad(rank, k as u32, e, r)).collect();
                            if let Err(e) = w.push_pull(k as u32, &g, p).and_then(|h| w.wait(h)) {
                                failed = Some(e);
                                break;
                            }
                        }
                        match failed {
                            None => round = r,
                            Some(WorkerError::Refused { reason, .. }) if reason == "ahead" => {
                                // The appliance came back at its checkpoint.
                                let back = resync(&w, &mut params);
                                repeated += round - back;
                                round = back;
                                continue;
                            }
                            Some(e) => panic!("rank {rank} round {r}: {e}"),
                        }
                        if round == 5 && !checkpoint_passed {
                            checkpoint_passed = true;
                            b1.wait(); // the test takes a checkpoint here
                            b2.wait();
                        }
                        if round == 8 && !crash_passed {
                            crash_passed = true;
                            b3.wait(); // the test kills and restarts the dataplane
                            b4.wait();
                        }
                    }
                    (params, repeated)
                })
            })
            .collect();
        at_checkpoint.wait();
        let c: CheckpointInfo = rack.post(&format!("/v1/jobs/{}/checkpoint", job.id));
        assert_eq!(c.round_range, Some((5, 5)));
        checkpointed.wait();
        at_crash.wait();
        rack.kill_dataplane();
        rack.start_dataplane();
        restarted.wait();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (params, repeated)) in finals.iter().enumerate() {
        assert_eq!(
            *repeated, 3,
            "rank {rank} should repeat rounds 6..=8 exactly once"
        );
        for (k, p) in params.iter().enumerate() {
            let want = sgd_reference(2, k as u32, &init_values(k as u32, keys[k]), TOTAL);
            assert_eq!(
                p, &want,
                "rank {rank} key {k}: parameters differ from a run that never crashed"
            );
        }
    }
    let show: JobDetail = rack.get(&format!("/v1/jobs/{}", job.id));
    assert_eq!(show.round_range, Some((TOTAL, TOTAL)));
    assert_eq!(show.checkpoint.unwrap().round_range, Some((5, 5)));
}

#[test]
fn a_killed_worker_stalls_only_its_job_and_rejoins() {
    let rack = Rack::start(2, "256MiB");
    let keys = [3000u64, 7];
    let sum = |name: &str, w: u16| {
        format!(
            "name = \"{name}\"\nworkers = {w}\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = {}\n\
             [[keys]]\nelements = {}\n",
            keys[0], keys[1]
        )
    };
    let stalled = rack.admit(&sum("stalled", 3)).unwrap();
    let other = rack.admit(&sum("other", 2)).unwrap();
    let url = rack.control_url.clone();
    let run_rounds = |w: &Worker, rank: u16, params: &mut [Vec<f32>], from: u32, to: u32, workers: u16| {
        for r in from..=to {
            for (k, p) in params.iter_mut().enumerate() {
                let g: Vec<f32> = (0..p.len()).map(|e| grad(rank, k as u32, e, r)).collect();
                w.wait(w.push_pull(k as u32, &g, p).unwrap()).unwrap();
                for (e, v) in p.iter().enumerate() {
                    assert_eq!(*v, common::expected_sum(workers, k as u32, e, r));
                }
            }
        }
    };
    let fresh = |k: usize| init_values(k as u32, keys[k]);
    std::thread::scope(|s| {
        // Ranks 0 and 1 train 10 rounds; they stall while rank 2 is gone.
        let mut hs = Vec::new();
        for rank in 0..2u16 {
            let url = url.clone();
            hs.push(s.spawn(move || {
                // These two wait for rank 2 through its death and rejoin.
                let patient = WorkerConfig {
                    timeout: Duration::from_secs(120),
                    ..WorkerConfig::default()
                };
                let w = Worker::join_with(&url, stalled.id, stalled.token, rank, patient).unwrap();
                let mut params: Vec<Vec<f32>> = (0..2).map(fresh).collect();
                for (k, p) in params.iter_mut().enumerate() {
                    w.wait(w.init(k as u32, p).unwrap()).unwrap();
                }
                run_rounds(&w, rank, &mut params, 1, 10, 3);
            }));
        }
        // Rank 2 trains 3 rounds, pushes key 0 of round 4 and dies.
        {
            let w = Worker::join_with(&url, stalled.id, stalled.token, 2, config()).unwrap();
            let mut params: Vec<Vec<f32>> = (0..2).map(fresh).collect();
            for (k, p) in params.iter_mut().enumerate() {
                w.wait(w.init(k as u32, p).unwrap()).unwrap();
            }
            run_rounds(&w, 2, &mut params, 1, 3, 3);
            let g: Vec<f32> = (0..keys[0] as usize).map(|e| grad(2, 0, e, 4)).collect();
            let h = w.push_pull(0, &g, &mut params[0]).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            drop(h);
            drop(w);
        }
        // Meanwhile another job trains to the end, undisturbed.
        std::thread::scope(|s2| {
            for rank in 0..2u16 {
                let url = url.clone();
                s2.spawn(move || {
                    let w = Worker::join(&url, other.id, other.token, rank).unwrap();
                    let mut params: Vec<Vec<f32>> = (0..2).map(fresh).collect();
                    for (k, p) in params.iter_mut().enumerate() {
                        w.wait(w.init(k as u32, p).unwrap()).unwrap();
                    }
                    run_rounds(&w, rank, &mut params, 1, 10, 2);
                });
            }
        });
        // phubctl names the silent rank.
        std::thread::sleep(Duration::from_millis(600));
        let show: JobDetail = rack.get(&format!("/v1/jobs/{}", stalled.id));
        let silent: Vec<u64> = show.ranks.iter().map(|r| r.silent_ms.unwrap()).collect();
        assert!(
            silent[2] >= 500 && silent[0] < silent[2] && silent[1] < silent[2],
            "{silent:?}"
        );
        let (ok, out, _) = rack.phubctl(&["job", "show", &stalled.id.to_string()]);
        assert!(ok && out.contains("silent for"), "{out}");
        // A plain join of the same rank is refused; a rejoin takes its place.
        let e = Worker::join(&url, stalled.id, stalled.token, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rejoin"), "{e}");
        let w = Worker::rejoin(&url, stalled.id, stalled.token, 2, config()).unwrap();
        let mut params: Vec<Vec<f32>> = (0..2).map(fresh).collect();
        let mut back = u32::MAX;
        for (k, p) in params.iter_mut().enumerate() {
            back = back.min(w.pull(k as u32, p).unwrap());
        }
        assert_eq!(back, 3, "the job stood at round 3");
        // Keys can stand at different rounds (key 0's round 4 completed with
        // the dead rank's push): each key goes on from its own round.
        for r in back + 1..=10 {
            for (k, p) in params.iter_mut().enumerate() {
                if w.key_round(k as u32).unwrap() >= r {
                    continue;
                }
                let g: Vec<f32> = (0..p.len()).map(|e| grad(2, k as u32, e, r)).collect();
                w.wait(w.push_pull(k as u32, &g, p).unwrap()).unwrap();
            }
            for (k, p) in params.iter().enumerate() {
                for (e, v) in p.iter().enumerate() {
                    assert_eq!(
                        *v,
                        common::expected_sum(3, k as u32, e, r),
                        "rejoined rank, round {r} key {k}"
                    );
                }
            }
        }
        for h in hs {
            h.join().unwrap();
        }
    });
    let show: JobDetail = rack.get(&format!("/v1/jobs/{}", stalled.id));
    assert_eq!(show.round_range, Some((10, 10)));
}

/// What [`train_through_faults`] ends with.
struct Trained {
    /// Rank 0's final parameters (rank 1's are checked equal).
    params: Vec<Vec<f32>>,
    /// The appliance's stats (`GET /v1/stats`).
    stats: phub::proto::api::Stats,
    /// `phubctl stats`.
    phubctl: String,
    /// Both workers' counters, summed.
    workers: WorkerStats,
}

/// Trains `rounds` of an SGD job with 2 workers through a dataplane that
/// loses, duplicates and reorders packets in both directions at
/// `dataplane_faults`, the workers injecting `worker_faults` on what they
/// send and receive.
fn train_through_faults(
    dataplane_faults: &str,
    worker_faults: Option<FaultSpec>,
    keys: [u64; 2],
    rounds: u32,
) -> Trained {
    let rack = Rack::start_with(2, "256MiB", &["--inject", dataplane_faults]);
    let spec = format!(
        "name = \"lossy\"\nworkers = 2\n[optimizer]\nkind = \"sgd\"\nlr = {LR}\n\
         [[keys]]\nelements = {}\n[[keys]]\nelements = {}\n",
        keys[0], keys[1]
    );
    let job = rack.admit(&spec).unwrap();
    let config = WorkerConfig {
        inject: worker_faults,
        ..config()
    };
    let finals: Vec<(Vec<Vec<f32>>, WorkerStats)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u16)
            .map(|rank| {
                let (url, config) = (rack.control_url.clone(), config.clone());
                s.spawn(move || {
                    let w = Worker::join_with(&url, job.id, job.token, rank, config).unwrap();
                    let mut params: Vec<Vec<f32>> = keys
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| init_values(k as u32, n))
                        .collect();
                    for (k, p) in params.iter_mut().enumerate() {
                        w.wait(w.init(k as u32, p).unwrap()).unwrap();
                    }
                    for r in 1..=rounds {
                        let grads: Vec<Vec<f32>> = params
                            .iter()
                            .enumerate()
                            .map(|(k, p)| (0..p.len()).map(|e| grad(rank, k as u32, e, r)).collect())
                            .collect();
                        let hs: Vec<_> = params
                            .iter_mut()
                            .zip(&grads)
                            .enumerate()
                            .map(|(k, (p, g))| w.push_pull(k as u32, g, p).unwrap())
                            .collect();
                        for h in hs {
                            w.wait(h).unwrap();
                        }
                    }
                    (params, w.stats())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        finals[0].0, finals[1].0,
        "the two ranks ended with different parameters"
    );
    let (ok, phubctl, err) = rack.phubctl(&["stats"]);
    assert!(ok, "phubctl stats: {err}");
    let mut workers = finals[0].1;
    let o = finals[1].1;
    workers.retransmits += o.retransmits;
    workers.results_ignored += o.results_ignored;
    workers.injected_drops += o.injected_drops;
    workers.injected_dups += o.injected_dups;
    workers.injected_reorders += o.injected_reorders;
    workers.timeouts += o.timeouts;
    Trained {
        params: finals.into_iter().next().unwrap().0,
        stats: rack.get("/v1/stats"),
        phubctl,
        workers,
    }
}

/// The appliance's injected losses, resent results and duplicate drops.
fn appliance_counts(stats: &phub::proto::api::Stats) -> (u64, u64, u64) {
    let d = stats.dataplane.as_ref().unwrap();
    let injected: u64 = d.lcores.iter().map(|l| l.injected_drops).sum();
    let resent: u64 = d.lcores.iter().map(|l| l.results_resent).sum();
    let dups: u64 = d.lcores.iter().filter_map(|l| l.drops.get("duplicate")).sum();
    (injected, resent, dups)
}

#[test]
fn loss_duplication_and_reordering_leave_the_result_exact() {
    const ROUNDS: u32 = 8;
    let keys = [20_000u64, 3];
    let want: Vec<Vec<f32>> = (0..2)
        .map(|k| sgd_reference(2, k as u32, &init_values(k as u32, keys[k]), ROUNDS))
        .collect();
    for (i, loss) in ["0.01", "0.05", "0.2"].iter().enumerate() {
        let faults = format!("loss={loss},dup=0.02,reorder=0.02,seed={i}");
        let t = train_through_faults(&faults, None, keys, ROUNDS);
        assert_eq!(
            t.params, want,
            "{faults}: parameters differ from the loss-free computation"
        );
        let (injected, resent, dups) = appliance_counts(&t.stats);
        assert!(
            injected > 0 && resent > 0 && dups > 0,
            "{faults}: {injected} lost, {resent} resent, {dups} duplicates"
        );
        assert_eq!(
            t.workers.injected_drops, 0,
            "the workers inject nothing unless asked"
        );
    }
}

/// Loss in the workers' transport as well as in the dataplane: every
/// datagram is exposed to the loss rate twice on its way (once leaving,
/// once arriving), and training still ends exactly where the loss-free
/// computation does.
#[test]
fn faults_on_both_sides_leave_the_result_exact() {
    const ROUNDS: u32 = 5;
    let keys = [12_000u64, 3];
    let want: Vec<Vec<f32>> = (0..2)
        .map(|k| sgd_reference(2, k as u32, &init_values(k as u32, keys[k]), ROUNDS))
        .collect();
    // Counters over the three runs: at 1% loss a run this small may lose
    // nothing on one side.
    let mut workers = WorkerStats::default();
    let (mut injected, mut resent, mut dups) = (0, 0, 0);
    for (i, loss) in ["0.01", "0.05", "0.2"].iter().enumerate() {
        let dataplane = format!("loss={loss},dup=0.02,reorder=0.02,seed={i}");
        let worker: FaultSpec = format!("loss={loss},dup=0.02,reorder=0.02,seed={}", 10 + i)
            .parse()
            .unwrap();
        let t = train_through_faults(&dataplane, Some(worker), keys, ROUNDS);
        assert_eq!(
            t.params, want,
            "dataplane {dataplane}, workers {worker}: parameters differ from the loss-free computation"
        );
        assert_eq!(t.workers.timeouts, 0);
        workers.injected_drops += t.workers.injected_drops;
        workers.injected_dups += t.workers.injected_dups;
        workers.injected_reorders += t.workers.injected_reorders;
        workers.retransmits += t.workers.retransmits;
        let (i, r, d) = appliance_counts(&t.stats);
        eprintln!(
            "loss {loss} on both sides: dataplane {i} lost, {r} results resent, {d} duplicate drops; \
             workers {} lost, {} duplicated, {} reordered, {} retransmits",
            t.workers.injected_drops,
            t.workers.injected_dups,
            t.workers.injected_reorders,
            t.workers.retransmits
        );
        (injected, resent, dups) = (injected + i, resent + r, dups + d);
        if *loss == "0.2" {
            // phubctl shows the resent results and the duplicate drops.
            assert!(
                r > 0 && d > 0 && t.phubctl.contains("RESENT") && t.phubctl.contains("duplicate"),
                "{}",
                t.phubctl
            );
        }
    }
    assert!(
        workers.injected_drops > 0
            && workers.injected_dups > 0
            && workers.injected_reorders > 0
            && workers.retransmits > 0,
        "workers: {workers:?}"
    );
    assert!(
        injected > 0 && resent > 0 && dups > 0,
        "dataplane: {injected} lost, {resent} resent, {dups} duplicates"
    );
}
