//! Async and bounded-delay jobs (PROTOCOL.md §5.8) on the whole appliance:
//! phub-dataplane and phub-control as real processes on loopback, workers
//! on the phub-worker library with the same calls as a BSP job.
//!
//! Every job here has a **census** key of W elements: rank r pushes 1 into
//! element r and 0 elsewhere, so any answer's element j is the number of
//! clocks the appliance had applied of rank j when it sent that answer.
//! That makes each mode's promise checkable from the workers' side, answer
//! by answer: a rank's own clock is applied exactly once by the time it is
//! answered, and with bounded delay τ no answer to clock c leaves while a
//! rank is below c − τ. A second key of many chunks carries the shared
//! small-integer gradients, whose sums are exact in any order.

use std::sync::Barrier;
use std::time::Duration;

use crate::common;
use crate::common::{grad, init, Operator, Rack};
use phub::proto::api::{AdmitResponse, JobDetail, Stats};
use phub::proto::routes::control;
use phub_worker::{Consistency, FaultSpec, Worker, WorkerConfig, WorkerStats};

/// Elements of the gradient key (three chunks of 8 KiB).
const BIG: u64 = 5000;

fn spec(name: &str, workers: u16, consistency: Consistency) -> String {
    common::census_spec(name, workers, BIG, consistency)
}

/// What each rank saw: per answer to clock c, the census (clocks applied
/// per rank when it was sent).
struct Seen {
    rank: u16,
    answers: Vec<(u32, Vec<f32>)>,
    stats: WorkerStats,
}

/// One rank: init (rank 0's values: census 0, grads [`init`]), then
/// `clocks` push_pulls of both keys, sleeping `pause` before each; checks
/// every census answer against the rank's own clock, waits at `all_done`
/// for every rank, then pulls both keys and checks the exact totals.
#[allow(clippy::too_many_arguments)]
fn rank(
    rack: &Rack,
    job: &AdmitResponse,
    rank: u16,
    workers: u16,
    clocks: u32,
    pause: Duration,
    config: WorkerConfig,
    all_done: &Barrier,
) -> Seen {
    let w = Worker::join_with(&rack.control_url, job.id, job.token, rank, config).unwrap();
    let what = format!("{} rank {rank}", w.consistency());
    let mut census = vec![0f32; usize::from(workers)];
    let mut big: Vec<f32> = (0..BIG as usize)
        .map(|e| if rank == 0 { init(1, e) } else { -1.0 })
        .collect();
    w.wait(w.init(0, &mut census).unwrap()).unwrap();
    w.wait(w.init(1, &mut big).unwrap()).unwrap();
    assert_eq!(w.clock(), Some(0), "{what}");
    let mut mine = vec![0f32; usize::from(workers)];
    mine[usize::from(rank)] = 1.0;
    let mut answers = Vec::new();
    for c in 1..=clocks {
        std::thread::sleep(pause);
        let g: Vec<f32> = (0..BIG as usize).map(|e| grad(rank, 1, e, c)).collect();
        let h0 = w.push_pull(0, &mine, &mut census).unwrap();
        let h1 = w.push_pull(1, &g, &mut big).unwrap();
        assert_eq!(
            (h0.round(), h1.round()),
            (c, c),
            "{what}: pushes carry the next clock"
        );
        w.wait(h0).unwrap();
        w.wait(h1).unwrap();
        // Applied once, and before the answer: the rank's own count is c.
        assert_eq!(
            census[usize::from(rank)],
            c as f32,
            "{what}: the answer to clock {c} counts {} of its own clocks",
            census[usize::from(rank)]
        );
        assert_eq!(w.clock(), Some(c), "{what}");
        answers.push((c, census.clone()));
    }
    all_done.wait();
    let mut out = vec![0f32; usize::from(workers)];
    assert_eq!(
        w.pull(0, &mut out).unwrap(),
        clocks,
        "{what}: a pull answers the rank's clock"
    );
    assert!(
        out.iter().all(|&n| n == clocks as f32),
        "{what}: every rank's {clocks} clocks applied once each: {out:?}"
    );
    let mut out = vec![0f32; BIG as usize];
    assert_eq!(w.pull(1, &mut out).unwrap(), clocks);
    for (e, &v) in out.iter().enumerate() {
        let pushed: f32 = (0..workers)
            .flat_map(|r| (1..=clocks).map(move |c| grad(r, 1, e, c)))
            .sum();
        assert_eq!(v, init(1, e) + pushed, "{what}: grads element {e}");
    }
    Seen {
        rank,
        answers,
        stats: w.stats(),
    }
}

/// Runs `workers` ranks of `job`, rank i pausing `pauses[i]` before each
/// clock.
fn run(
    rack: &Rack,
    job: &AdmitResponse,
    pauses: &[Duration],
    clocks: u32,
    config: WorkerConfig,
) -> Vec<Seen> {
    let workers = pauses.len() as u16;
    let all_done = Barrier::new(pauses.len());
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..workers)
            .map(|r| {
                let (config, all_done) = (config.clone(), &all_done);
                let pause = pauses[usize::from(r)];
                s.spawn(move || rank(rack, job, r, workers, clocks, pause, config, all_done))
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// Every rank's clocks as control reports them: (lowest, highest) over
/// the job's chunks.
fn detail(rack: &Rack, job: &AdmitResponse) -> JobDetail {
    rack.send(&control::job(job.id))
}

#[test]
fn async_sum_applies_every_clock_once_and_ends_exact() {
    let rack = Rack::start(2, "256MiB");
    let job = rack.admit(&spec("async", 3, Consistency::Async)).unwrap();
    // Ranks at different paces: async never waits for the slow one.
    let pauses = [
        Duration::ZERO,
        Duration::from_millis(1),
        Duration::from_millis(15),
    ];
    let started = std::time::Instant::now();
    let seen = run(&rack, &job, &pauses, 12, WorkerConfig::default());
    let d = detail(&rack, &job);
    assert_eq!(d.spec.consistency, Consistency::Async);
    assert_eq!(d.clock.clocks, vec![(12, 12); 3]);
    assert_eq!(d.clock.held, 0);
    // Rank 0 did not wait for rank 2: some answer showed it ahead.
    let lead = seen
        .iter()
        .find(|s| s.rank == 0)
        .unwrap()
        .answers
        .iter()
        .map(|(c, census)| *c as f32 - census[2])
        .fold(0f32, f32::max);
    assert!(
        lead >= 4.0,
        "rank 0 was never well ahead of rank 2 ({lead} clocks); took {:?}",
        started.elapsed()
    );
}

#[test]
fn bounded_delay_2_keeps_every_rank_within_3_clocks_of_a_slow_one() {
    const TAU: u32 = 2;
    let rack = Rack::start(2, "256MiB");
    let job = rack
        .admit(&spec("ssp", 3, Consistency::Bounded { delay: TAU }))
        .unwrap();
    let pauses = [Duration::ZERO, Duration::ZERO, Duration::from_millis(25)];
    // Each rank's census says, per answer, how far behind the slowest
    // rank was when the appliance let the answer go.
    let mut worst = 0;
    let seen = run(&rack, &job, &pauses, 15, WorkerConfig::default());
    for s in &seen {
        for (c, census) in &s.answers {
            let slowest = census.iter().copied().fold(f32::MAX, f32::min) as u32;
            let lead = c.saturating_sub(slowest);
            worst = worst.max(lead);
            assert!(
                lead <= TAU,
                "rank {} got its answer to clock {c} while the slowest rank had applied {slowest}: \
                 it may push clock {} = {} ahead (τ + 1 = {})",
                s.rank,
                c + 1,
                c + 1 - slowest,
                TAU + 1
            );
        }
    }
    // The bound was reached, not merely respected by a slow test.
    assert_eq!(worst, TAU, "no rank ever led the slow one by τ");
    let d = detail(&rack, &job);
    assert_eq!(d.spec.consistency, Consistency::Bounded { delay: TAU });
    assert_eq!(d.clock.clocks, vec![(15, 15); 3]);
    assert_eq!(d.clock.max_lead, Some(TAU + 1));
    assert_eq!(d.clock.held, 0, "every held answer was released");
    let stats: Stats = rack.send(&control::stats());
    let held: u64 = stats
        .dataplane
        .unwrap()
        .lcores
        .iter()
        .map(|l| l.answers_held)
        .sum();
    assert!(held > 0, "the fast ranks' answers were never held");
    // The job's own counts: the job is alone on the appliance, so they
    // are the lcores' counts, and the slowed rank made the waits real.
    assert_eq!(d.clock.held_total, held, "held answers counted per job");
    assert!(d.clock.held_wait_us > 0, "{:?}", d.clock);
    assert!(
        d.clock.held_wait_max_us > 0 && d.clock.held_wait_max_us <= d.clock.held_wait_us,
        "{:?}",
        d.clock
    );
    let (ok, out, err) = rack.phubctl(&["job", "show", &job.id.to_string()]);
    assert!(ok, "{err}");
    assert!(out.contains("bounded_delay") && out.contains("τ = 2"), "{out}");
    assert!(
        out.contains(&format!("answers held so far {held}, their waits ")),
        "{out}"
    );
}

/// Loss, duplication and reordering in the dataplane and in the workers:
/// a (rank, clock) is still applied once (the census), an answer never
/// leaves early, and the sums end exact.
#[test]
fn bounded_delay_under_injected_faults_applies_each_clock_once() {
    const TAU: u32 = 1;
    let faults = "loss=0.05,dup=0.03,reorder=0.03,seed=5";
    let rack = Rack::start_with(2, "256MiB", &["--inject", faults]);
    let job = rack
        .admit(&spec("faults", 3, Consistency::Bounded { delay: TAU }))
        .unwrap();
    let config = WorkerConfig {
        inject: Some(faults.replace("seed=5", "seed=6").parse::<FaultSpec>().unwrap()),
        timeout: Duration::from_secs(8),
        ..WorkerConfig::default()
    };
    let pauses = [Duration::ZERO, Duration::from_millis(3), Duration::from_millis(6)];
    let seen = run(&rack, &job, &pauses, 10, config);
    let (mut retransmits, mut injected) = (0, 0);
    for s in &seen {
        assert_eq!(s.stats.timeouts, 0, "rank {}", s.rank);
        retransmits += s.stats.retransmits;
        injected += s.stats.injected_drops + s.stats.injected_dups;
        for (c, census) in &s.answers {
            let slowest = census.iter().copied().fold(f32::MAX, f32::min) as u32;
            assert!(
                c.saturating_sub(slowest) <= TAU,
                "rank {}: answer to clock {c} with the slowest at {slowest}",
                s.rank
            );
        }
    }
    assert!(injected > 0 && retransmits > 0, "the faults were not exercised");
    let stats: Stats = rack.send(&control::stats());
    let d = stats.dataplane.unwrap();
    let dropped: u64 = d.lcores.iter().map(|l| l.injected_drops).sum();
    assert!(dropped > 0, "the dataplane's injector lost nothing");
    assert_eq!(detail(&rack, &job).clock.clocks, vec![(10, 10); 3]);
}
