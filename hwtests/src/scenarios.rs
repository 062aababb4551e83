//! Fault scenarios that run unchanged on both backends: the kernel-UDP
//! appliance on loopback (`tests/it/common::Rack`) and the DPDK one on the
//! virtual rack ([`crate::virt::VirtualRack`]). Each takes an
//! [`Appliance`] (where phub-control and the dataplane's management API are,
//! the operator token, and how a thread gets to where they can be reached);
//! the one that crashes the dataplane also takes closures that kill and
//! restart it. A scenario asserts (panics) on everything it checks.
//!
//! Layer: test support only.

use std::net::UdpSocket;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use phub_proto::api::{AdmitResponse, DataplaneStats, JobDetail, JobMap, JoinRequest, JoinResponse};
use phub_proto::routes::control::{self, ControlCall};
use phub_proto::routes::mgmt::{self, MgmtCall};
use phub_proto::wire::{MsgType, Repr};
use phub_worker::{FaultSpec, Worker, WorkerConfig, WorkerError, WorkerStats};

use crate::workload::{
    admit, client, expected, grad, init_values, key_index, sgd_reference, sgd_spec, sum_spec, train,
};

/// A running appliance as a scenario sees it.
pub struct Appliance<'a> {
    /// phub-control's URL.
    pub control_url: String,
    /// The dataplane's management URL (`GET /v1/stats`).
    pub mgmt_url: String,
    /// The operator token, where control has one.
    pub operator_token: Option<String>,
    /// Moves the calling thread to where the appliance can be reached (the
    /// virtual rack's network namespace), or does nothing (loopback).
    pub enter: &'a (dyn Fn() + Sync),
}

impl std::fmt::Debug for Appliance<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Appliance")
            .field("control_url", &self.control_url)
            .field("mgmt_url", &self.mgmt_url)
            .finish_non_exhaustive()
    }
}

impl Appliance<'_> {
    /// Runs `f` on a thread that entered the appliance's network (threads
    /// and processes it starts are there too). The other methods must be
    /// called from inside.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                (self.enter)();
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// Admits a job.
    pub fn admit(&self, spec: &str) -> AdmitResponse {
        admit(&self.control_url, self.operator_token.as_deref(), spec)
    }

    /// `call` to control, with the operator token; panics saying why it
    /// failed.
    pub fn send<A>(&self, call: &ControlCall<'_, A>) -> A {
        client(&self.control_url, self.operator_token.as_deref())
            .send(call)
            .unwrap_or_else(|e| panic!("{} at {}: {e}", call.what(), self.control_url))
    }

    /// `call` to the dataplane's management API (an open route); panics
    /// saying why it failed.
    pub fn dataplane<A>(&self, call: &MgmtCall<'_, A>) -> A {
        client(&self.mgmt_url, None)
            .send(call)
            .unwrap_or_else(|e| panic!("{} at {}: {e}", call.what(), self.mgmt_url))
    }

    /// The dataplane's counters from its management API.
    pub fn dataplane_stats(&self) -> DataplaneStats {
        self.dataplane(&mgmt::stats())
    }

    /// Runs phubctl against control; returns (success, stdout, stderr).
    pub fn phubctl(&self, args: &[&str]) -> (bool, String, String) {
        let bin = crate::bin("phubctl").unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = std::process::Command::new(bin);
        if let Some(t) = &self.operator_token {
            cmd.env("PHUB_OPERATOR_TOKEN", t);
        }
        let out = cmd
            .args(["--control", &self.control_url])
            .args(args)
            .output()
            .expect("running phubctl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// A worker configuration that gives up after `secs` without any result.
fn patient(secs: u64) -> WorkerConfig {
    WorkerConfig {
        timeout: Duration::from_secs(secs),
        ..WorkerConfig::default()
    }
}

/// A drop counter summed over the lcores.
pub fn drops(d: &DataplaneStats, reason: &str) -> u64 {
    d.total().drops.get(reason).copied().unwrap_or(0)
}

/// Joins `job` as `rank`, sends every key's initial values (rank 0's from
/// [`init_values`]) and returns the worker and its parameters.
fn join_and_init(
    url: &str,
    job: &AdmitResponse,
    rank: u16,
    keys: &[u64],
    cfg: WorkerConfig,
) -> (Worker, Vec<Vec<f32>>) {
    let w = Worker::join_with(url, job.id, job.token, rank, cfg).unwrap();
    let params = init_keys(&w, keys);
    (w, params)
}

/// Round 0 of every key (`keys` holds their lengths) with
/// [`init_values`]; returns the broadcast values.
fn init_keys(w: &Worker, keys: &[u64]) -> Vec<Vec<f32>> {
    let mut params: Vec<Vec<f32>> = keys
        .iter()
        .enumerate()
        .map(|(k, &n)| init_values(k as u32, n))
        .collect();
    for (k, p) in params.iter_mut().enumerate() {
        w.wait(w.init(k as u32, p).unwrap()).unwrap();
    }
    params
}

/// One round of every key, all keys in flight at once. On a failure every
/// request already in flight is still waited for (its key stays busy until
/// then, and a resync must pull it), and the first error is returned.
fn sgd_round(w: &Worker, rank: u16, params: &mut [Vec<f32>], round: u32) -> Result<(), WorkerError> {
    let grads: Vec<Vec<f32>> = params
        .iter()
        .enumerate()
        .map(|(k, p)| (0..p.len()).map(|e| grad(rank, k as u32, e, round)).collect())
        .collect();
    let mut first = None;
    let mut hs = Vec::with_capacity(params.len());
    for (k, (p, g)) in params.iter_mut().zip(&grads).enumerate() {
        match w.push_pull(k as u32, g, p) {
            Ok(h) => hs.push(h),
            Err(e) => {
                first = Some(e);
                break;
            }
        }
    }
    for h in hs {
        if let Err(e) = w.wait(h) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Trains `rounds` rounds of an SGD job with 2 workers over `keys` through
/// whatever faults the appliance or its network was set up with (`label`
/// names them in messages), and checks that both ranks end with the
/// parameters of a loss-free computation, bit for bit. Returns the
/// dataplane's counters and `phubctl stats` output afterwards, for
/// [`assert_recovered`] and the caller's own checks.
pub fn sgd_exact_through_faults(
    app: &Appliance,
    label: &str,
    keys: &[u64],
    rounds: u32,
) -> (DataplaneStats, String) {
    let run = sgd_through_faults(app, label, keys, rounds, None);
    (run.dataplane, run.phubctl)
}

/// What [`sgd_through_faults`] ends with.
#[derive(Debug)]
pub struct FaultRun {
    /// The dataplane's counters afterwards.
    pub dataplane: DataplaneStats,
    /// `phubctl stats` afterwards.
    pub phubctl: String,
    /// Both workers' counters, summed ([`add_worker_counts`]).
    pub workers: WorkerStats,
}

/// Adds `b`'s event counters (not its RTT estimates) to `a`.
pub fn add_worker_counts(a: &mut WorkerStats, b: &WorkerStats) {
    a.add_counters(b);
}

/// [`sgd_exact_through_faults`], the workers injecting `worker_faults` on
/// what they send and receive (`None`: the worker's default, no
/// injection); also returns the workers' counters.
pub fn sgd_through_faults(
    app: &Appliance,
    label: &str,
    keys: &[u64],
    rounds: u32,
    worker_faults: Option<FaultSpec>,
) -> FaultRun {
    app.run(|| {
        let job = app.admit(&sgd_spec("lossy", 2, keys));
        let job = &job;
        let cfg = WorkerConfig {
            inject: worker_faults,
            ..patient(20)
        };
        let finals: Vec<(Vec<Vec<f32>>, WorkerStats)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u16)
                .map(|rank| {
                    let cfg = cfg.clone();
                    s.spawn(move || {
                        let (w, mut params) = join_and_init(&app.control_url, job, rank, keys, cfg);
                        for r in 1..=rounds {
                            sgd_round(&w, rank, &mut params, r)
                                .unwrap_or_else(|e| panic!("{label}: rank {rank} round {r}: {e}"));
                        }
                        (params, w.stats())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (k, &n) in keys.iter().enumerate() {
            let want = sgd_reference(2, k as u32, &init_values(k as u32, n), rounds);
            for (rank, (f, _)) in finals.iter().enumerate() {
                assert!(
                    f[k] == want,
                    "{label}: rank {rank} key {k}: parameters differ from the loss-free computation"
                );
            }
        }
        let mut workers = WorkerStats::default();
        for (_, s) in &finals {
            add_worker_counts(&mut workers, s);
        }
        let (ok, phubctl, err) = app.phubctl(&["stats"]);
        assert!(ok, "{label}: phubctl stats: {err}");
        FaultRun {
            dataplane: app.dataplane_stats(),
            phubctl,
            workers,
        }
    })
}

/// Checks that a run through faults was recovered by the protocol: the
/// dataplane resent results and dropped duplicates (management API), and
/// `phubctl stats` shows the same (the RESENT column of its `all` row, and
/// `duplicate` among the drops by reason).
pub fn assert_recovered(label: &str, d: &DataplaneStats, phubctl_stats: &str) {
    let resent: u64 = d.lcores.iter().map(|l| l.results_resent).sum();
    let dups = drops(d, "duplicate");
    assert!(
        resent > 0 && dups > 0,
        "{label}: {resent} results resent, {dups} duplicates dropped"
    );
    let all = phubctl_stats
        .lines()
        .find(|l| l.split_whitespace().next() == Some(if d.lcores.len() > 1 { "all" } else { "0" }))
        .unwrap_or_else(|| panic!("{label}: no totals row in phubctl stats:\n{phubctl_stats}"));
    let shown: u64 = all
        .split_whitespace()
        .nth(8)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{label}: no RESENT column in {all:?}"));
    assert!(
        shown > 0 && shown <= resent,
        "{label}: phubctl shows {shown} resent, the dataplane counted {resent}:\n{phubctl_stats}"
    );
    assert!(
        phubctl_stats.lines().any(|l| l.starts_with("duplicate ")),
        "{label}: no duplicate drops in phubctl stats:\n{phubctl_stats}"
    );
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

/// An SGD job with 2 workers trains 12 rounds; after round 5 the operator
/// takes a checkpoint (`phubctl job checkpoint`); after round 8 the
/// dataplane is killed (`kill`, SIGKILL) and started again (`start`).
/// Control reinstalls the job from the checkpoint, the workers are told they
/// are `ahead`, pull, repeat rounds 6..=8 exactly once, and end with the
/// parameters of a run that never crashed.
pub fn checkpoint_and_restore(app: &Appliance, kill: &(dyn Fn() + Sync), start: &(dyn Fn() + Sync)) {
    const TOTAL: u32 = 12;
    let keys = [5000u64, 3];
    app.run(|| {
        let job = app.admit(&sgd_spec("durable", 2, &keys));
        let at_checkpoint = Arc::new(Barrier::new(3));
        let checkpointed = Arc::new(Barrier::new(3));
        let at_crash = Arc::new(Barrier::new(3));
        let restarted = Arc::new(Barrier::new(3));
        let finals: Vec<(Vec<Vec<f32>>, u32)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u16)
                .map(|rank| {
                    let (b1, b2, b3, b4) = (
                        at_checkpoint.clone(),
                        checkpointed.clone(),
                        at_crash.clone(),
                        restarted.clone(),
                    );
                    let job = &job;
                    let keys = &keys;
                    s.spawn(move || {
                        let (w, mut params) = join_and_init(&app.control_url, job, rank, keys, patient(20));
                        let (mut round, mut repeated) = (0, 0);
                        let (mut checkpoint_passed, mut crash_passed) = (false, false);
                        while round < TOTAL {
                            match sgd_round(&w, rank, &mut params, round + 1) {
                                Ok(()) => round += 1,
                                Err(WorkerError::Refused { reason, .. }) if reason == "ahead" => {
                                    // The appliance came back at its checkpoint.
                                    let back = resync(&w, &mut params);
                                    repeated += round - back;
                                    round = back;
                                    continue;
                                }
                                Err(e) => panic!("rank {rank} round {}: {e}", round + 1),
                            }
                            if round == 5 && !checkpoint_passed {
                                checkpoint_passed = true;
                                b1.wait(); // the checkpoint is taken here
                                b2.wait();
                            }
                            if round == 8 && !crash_passed {
                                crash_passed = true;
                                b3.wait(); // the dataplane is killed and restarted
                                b4.wait();
                            }
                        }
                        (params, repeated)
                    })
                })
                .collect();
            at_checkpoint.wait();
            let (ok, out, err) = app.phubctl(&["job", "checkpoint", &job.id.to_string()]);
            assert!(ok && out.contains("checkpoint of job"), "{out}{err}");
            let show: JobDetail = app.send(&control::job(job.id));
            assert_eq!(show.checkpoint.map(|c| c.round_range), Some(Some((5, 5))));
            checkpointed.wait();
            at_crash.wait();
            kill();
            start();
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
                assert!(
                    *p == want,
                    "rank {rank} key {k}: parameters differ from a run that never crashed"
                );
            }
        }
        let show: JobDetail = app.send(&control::job(job.id));
        assert_eq!(show.round_range, Some((TOTAL, TOTAL)));
        assert_eq!(show.checkpoint.unwrap().round_range, Some((5, 5)));
    });
}

/// Two workers of a sum job join; phub-control is then killed (SIGKILL),
/// and while the workers train 15 rounds on the data path alone it is
/// started again from its state file: every result is exact, and the
/// restarted control knows the job, both ranks and the round they reached.
pub fn control_killed_mid_training(app: &Appliance, kill: &(dyn Fn() + Sync), start: &(dyn Fn() + Sync)) {
    const ROUNDS: u32 = 15;
    let keys = [300_000u64, 10];
    app.run(|| {
        let job = app.admit(&sum_spec("survivor", 2, None, &keys));
        let workers: Vec<Worker> = (0..2u16)
            .map(|rank| Worker::join_with(&app.control_url, job.id, job.token, rank, patient(20)).unwrap())
            .collect();
        kill();
        std::thread::scope(|s| {
            for (rank, w) in workers.iter().enumerate() {
                s.spawn(move || {
                    let mut params = init_keys(w, &keys);
                    sum_rounds(w, rank as u16, &mut params, 1, ROUNDS, 2);
                });
            }
            // Control comes back while they train (threads started here
            // share this thread's network namespace).
            std::thread::sleep(Duration::from_millis(300));
            start();
        });
        let show: JobDetail = app.send(&control::job(job.id));
        assert_eq!(show.summary.joined, vec![0, 1]);
        assert_eq!(show.round_range, Some((ROUNDS, ROUNDS)));
    });
}

/// Sum rounds `from..=to` of every key, each result checked exactly.
fn sum_rounds(w: &Worker, rank: u16, params: &mut [Vec<f32>], from: u32, to: u32, workers: u16) {
    for r in from..=to {
        for (k, p) in params.iter_mut().enumerate() {
            let g: Vec<f32> = (0..p.len()).map(|e| grad(rank, k as u32, e, r)).collect();
            w.wait(w.push_pull(k as u32, &g, p).unwrap()).unwrap();
            for (e, v) in p.iter().enumerate() {
                assert_eq!(
                    *v,
                    expected(workers, k as u32, e, r),
                    "rank {rank} round {r} key {k} elem {e}"
                );
            }
        }
    }
}

/// Of a sum job of 3 workers, rank 2 trains 3 rounds, pushes one key of
/// round 4 and dies. Its job stalls (ranks 0 and 1 wait), `phubctl job
/// show` names the silent rank, while another job trains 10 rounds to the
/// end undisturbed. A plain join of rank 2 is refused; `Worker::rejoin`,
/// `pull` and the remaining rounds finish the stalled job exactly.
pub fn killed_worker_stalls_only_its_job(app: &Appliance) {
    let keys = [3000u64, 7];
    let url = app.control_url.as_str();
    app.run(|| {
        let stalled = app.admit(&sum_spec("stalled", 3, None, &keys));
        let other = app.admit(&sum_spec("other", 2, None, &keys));
        std::thread::scope(|s| {
            // Ranks 0 and 1 train 10 rounds, waiting for rank 2 through its
            // death and rejoin.
            let hs: Vec<_> = (0..2u16)
                .map(|rank| {
                    let (stalled, keys) = (&stalled, &keys);
                    s.spawn(move || {
                        let (w, mut params) = join_and_init(url, stalled, rank, keys, patient(120));
                        sum_rounds(&w, rank, &mut params, 1, 10, 3);
                    })
                })
                .collect();
            // Rank 2 trains 3 rounds, pushes key 0 of round 4 and dies.
            {
                let (w, mut params) = join_and_init(url, &stalled, 2, &keys, patient(20));
                sum_rounds(&w, 2, &mut params, 1, 3, 3);
                let g: Vec<f32> = (0..keys[0] as usize).map(|e| grad(2, 0, e, 4)).collect();
                let h = w.push_pull(0, &g, &mut params[0]).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                drop(h);
                drop(w);
            }
            // Meanwhile another job trains to the end.
            std::thread::scope(|s2| {
                for rank in 0..2u16 {
                    let (other, keys) = (&other, &keys);
                    s2.spawn(move || {
                        let (w, mut params) = join_and_init(url, other, rank, keys, patient(20));
                        sum_rounds(&w, rank, &mut params, 1, 10, 2);
                    });
                }
            });
            // Control names the silent rank (the two waiting ranks keep
            // retransmitting, so they are heard from).
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let show: JobDetail = app.send(&control::job(stalled.id));
                let silent: Vec<u64> = show.ranks.iter().map(|r| r.silent_ms.unwrap_or(0)).collect();
                if silent[2] >= 500 && silent[0] < silent[2] && silent[1] < silent[2] {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "rank 2 never showed as the silent one: {silent:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            let (ok, out, err) = app.phubctl(&["job", "show", &stalled.id.to_string()]);
            assert!(ok && out.contains("silent for"), "{out}{err}");
            // A plain join of the same rank is refused; a rejoin takes its place.
            let e = Worker::join(url, stalled.id, stalled.token, 2)
                .unwrap_err()
                .to_string();
            assert!(e.contains("rejoin"), "{e}");
            let w = Worker::rejoin(url, stalled.id, stalled.token, 2, patient(20)).unwrap();
            let mut params: Vec<Vec<f32>> = keys
                .iter()
                .enumerate()
                .map(|(k, &n)| init_values(k as u32, n))
                .collect();
            let back = resync(&w, &mut params);
            assert_eq!(back, 3, "the job stood at round 3");
            // Keys can stand at different rounds (key 0's round 4 completed
            // with the dead rank's push): each key goes on from its own.
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
                            expected(3, k as u32, e, r),
                            "rejoined rank, round {r} key {k}"
                        );
                    }
                }
            }
            for h in hs {
                h.join().unwrap();
            }
        });
        let show: JobDetail = app.send(&control::job(stalled.id));
        assert_eq!(show.round_range, Some((10, 10)));
    });
}

/// A datagram: `repr`'s header (count set from `values`) and `values`.
fn datagram(mut repr: Repr, values: &[f32]) -> Vec<u8> {
    repr.count = values.len() as u16;
    let mut b = repr.to_bytes().to_vec();
    for v in values {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

/// Every key's parameters as bits, and the lowest round, pulled by `w`.
fn pull_bits(w: &Worker, keys: &[u64]) -> (Vec<Vec<u32>>, u32) {
    let mut round = u32::MAX;
    let bits = keys
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let mut p = vec![0f32; n as usize];
            round = round.min(w.pull(k as u32, &mut p).expect("pulling the victim's parameters"));
            p.iter().map(|v| v.to_bits()).collect()
        })
        .collect();
    (bits, round)
}

/// Tenant isolation (README, "Threat model"): a victim sum job trains
/// 3 rounds and its parameters are pulled. Another tenant, joined to a job
/// of its own, then sends PUSH, INIT and PULL datagrams that name the
/// victim's job and exact slots, keys, chunks, counts and the round in
/// progress (from the public map), for every rank, with wrong tokens (zero,
/// its own job's, the victim's with one bit flipped); and, with its own
/// valid token, datagrams for slots outside its own job. The victim's
/// parameters pulled again are bit-identical, its next round is exact (no
/// forged contribution sits in an accumulator), the wrong-token socket
/// never hears back, and the drops are counted as `bad_token` and
/// `slot_out_of_range`.
pub fn tenant_isolation(app: &Appliance) {
    const TRAINED: u32 = 3;
    let keys = [3000u64, 5];
    let url = app.control_url.as_str();
    app.run(|| {
        let victim = app.admit(&sum_spec("victim", 2, None, &keys));
        let attacker = app.admit(&sum_spec("attacker", 1, None, &[100]));
        train(url, &victim, 2, &keys, TRAINED);
        let ranks: Vec<Worker> = (0..2u16)
            .map(|r| Worker::rejoin(url, victim.id, victim.token, r, patient(20)).unwrap())
            .collect();
        let (before, round) = pull_bits(&ranks[0], &keys);
        assert_eq!(round, TRAINED);
        for (k, bits) in before.iter().enumerate() {
            for (e, b) in bits.iter().enumerate() {
                assert_eq!(
                    f32::from_bits(*b),
                    expected(2, k as u32, e, TRAINED),
                    "key {k} elem {e}"
                );
            }
        }

        // The attacker joins its own job, and learns where the victim's
        // chunks are from control's (unauthenticated) map.
        let join: JoinResponse = client(url, None)
            .send(&control::join(
                attacker.id,
                &JoinRequest {
                    token: attacker.token,
                    rank: 0,
                    rejoin: false,
                    rack: None,
                },
            ))
            .expect("the attacker joins its own job");
        let map: JobMap = app.send(&control::map(victim.id, None));
        let victim_keys: Vec<_> = (0..map.keys_total)
            .flat_map(|k| app.send(&control::map(victim.id, Some(key_index(k)))).keys)
            .collect();
        let host = join.dataplane.host.as_str();
        let port = |lcore: u16| join.dataplane.base_port + lcore;
        let d0 = app.dataplane_stats();

        let spy = UdpSocket::bind("0.0.0.0:0").unwrap();
        let mut bad_token = 0u64;
        let forged = 1.0e6f32;
        let places = victim_keys.iter().flat_map(|km| {
            km.runs.iter().flat_map(move |r| {
                (0..r.count).map(move |i| {
                    (
                        km,
                        r.chunk + i,
                        phub_proto::layout::Place {
                            lcore: r.lcore,
                            slot: r.slot + i,
                        },
                    )
                })
            })
        });
        for (km, c, place) in places {
            {
                let len =
                    (km.elements - u64::from(c) * u64::from(map.chunk_elems)).min(u64::from(map.chunk_elems));
                let values = vec![forged; len as usize];
                for token in [0, attacker.token, victim.token ^ 1] {
                    for rank in 0..2u16 {
                        let h = Repr::request(MsgType::Push, victim.id, token, rank, TRAINED + 1, place.slot)
                            .with_chunk(km.key, c);
                        let init = Repr {
                            kind: MsgType::Init,
                            round: 0,
                            ..h
                        };
                        let pull = Repr {
                            kind: MsgType::Pull,
                            round: 0,
                            ..h
                        };
                        let init_values = if rank == 0 { &values[..] } else { &[] };
                        for d in [
                            datagram(h, &values),
                            datagram(init, init_values),
                            datagram(pull, &[]),
                        ] {
                            spy.send_to(&d, (host, port(place.lcore))).unwrap();
                            bad_token += 1;
                        }
                    }
                }
            }
        }
        // With its own valid token: slots beyond its own on each lcore it
        // uses, carrying the victim's keys and chunks.
        let own = UdpSocket::bind("0.0.0.0:0").unwrap();
        let mut out_of_range = 0u64;
        for (lcore, slots) in join.layout.lcores.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            let n = slots.count as u32;
            for slot in [n, n + 1, 1 << 20, u32::MAX] {
                for km in &victim_keys {
                    let h = Repr::request(MsgType::Push, attacker.id, attacker.token, 0, 1, slot)
                        .with_chunk(km.key, 0);
                    own.send_to(&datagram(h, &[forged; 100]), (host, port(lcore as u16)))
                        .unwrap();
                    out_of_range += 1;
                }
            }
        }

        // Every forged datagram is counted under its reason.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let d = app.dataplane_stats();
            let (bt, oor) = (
                drops(&d, "bad_token") - drops(&d0, "bad_token"),
                drops(&d, "slot_out_of_range") - drops(&d0, "slot_out_of_range"),
            );
            if bt >= bad_token && oor >= out_of_range {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{bt} bad_token drops counted for {bad_token} sent, {oor} slot_out_of_range for \
                 {out_of_range}: {:?}",
                d.lcores.iter().map(|l| &l.drops).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Nothing is sent back for a wrong token: no RESULT, no ERROR.
        spy.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut buf = [0u8; 9000];
        if let Ok((n, from)) = spy.recv_from(&mut buf) {
            panic!("the appliance answered a wrong-token datagram: {n} bytes from {from}");
        }

        let (after, round) = pull_bits(&ranks[1], &keys);
        assert_eq!(round, TRAINED, "the victim's round moved");
        assert!(after == before, "the victim's parameters changed");
        // The next round of the victim is exact: no forged push sits in an
        // accumulator, and no forged push took a rank's place.
        std::thread::scope(|s| {
            for (rank, w) in ranks.iter().enumerate() {
                let keys = &keys;
                s.spawn(move || {
                    let mut params: Vec<Vec<f32>> = keys.iter().map(|&n| vec![0.0; n as usize]).collect();
                    sum_rounds(w, rank as u16, &mut params, TRAINED + 1, TRAINED + 1, 2);
                });
            }
        });
    });
}
