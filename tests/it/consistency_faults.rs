//! Async and bounded-delay jobs (PROTOCOL.md §5.8) through faults, with
//! phub-dataplane and phub-control as real processes on loopback: the
//! dataplane killed after a checkpoint and the job reinstalled from it, and
//! a worker that leaves and rejoins. Each keeps every rank's own clock.
//!
//! As in `tests/it/consistency.rs`, every job has a **census** key of W
//! elements (rank r pushes 1 into element r), so an answer's element j is
//! the number of rank j's clocks applied when it was sent, and a key of
//! small-integer gradients whose sums are exact in any order: a (rank,
//! clock) lost with the crash and pushed again, or applied twice, shows.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::common;
use crate::common::{grad, init, Operator, Rack};
use phub::proto::api::{AdmitResponse, JobDetail};
use phub::proto::routes::control;
use phub::proto::spec::Consistency;
use phub_worker::{Worker, WorkerConfig, WorkerError};

/// Elements of the gradient key (three chunks of 8 KiB).
const BIG: u64 = 5000;
/// Chunks of one rank's push of both keys: the census's one and BIG's
/// three.
const CHUNKS: u64 = 4;
/// Clocks every rank ends at.
const TOTAL: u32 = 10;

fn spec(name: &str, consistency: Consistency) -> String {
    common::census_spec(name, 3, BIG, consistency)
}

/// Retries for as long as a dataplane restart and a reinstall take.
fn patient() -> WorkerConfig {
    WorkerConfig {
        timeout: Duration::from_secs(20),
        ..WorkerConfig::default()
    }
}

/// A barrier that gives up: a thread that failed never arrives, and the
/// others panic after a minute rather than wait for it for ever (a
/// failing test ends; the first panic says why).
struct Gate {
    parties: usize,
    at: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl Gate {
    fn new(parties: usize) -> Gate {
        Gate {
            parties,
            at: Mutex::new((0, 0)),
            cv: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut g = self.at.lock().unwrap_or_else(|e| e.into_inner());
        let generation = g.1;
        g.0 += 1;
        if g.0 == self.parties {
            *g = (0, generation + 1);
            self.cv.notify_all();
            return;
        }
        let (g, timeout) = self
            .cv
            .wait_timeout_while(g, Duration::from_secs(60), |g| g.1 == generation)
            .unwrap_or_else(|e| e.into_inner());
        drop(g);
        assert!(
            !timeout.timed_out(),
            "a peer never reached the barrier (it failed)"
        );
    }
}

fn detail(rack: &Rack, job: &AdmitResponse) -> JobDetail {
    rack.send(&control::job(job.id))
}

/// Polls control's view of the job until `ok` holds (20 s at most).
fn until(rack: &Rack, job: &AdmitResponse, what: &str, ok: impl Fn(&JobDetail) -> bool) -> JobDetail {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let d = detail(rack, job);
        if ok(&d) {
            return d;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: never; last seen {:?}",
            d.clock
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One rank's worker and buffers.
struct Rank {
    w: Worker,
    rank: u16,
    census: Vec<f32>,
    big: Vec<f32>,
}

impl Rank {
    fn join(control_url: &str, job: &AdmitResponse, rank: u16) -> Rank {
        let w = Worker::join_with(control_url, job.id, job.token, rank, patient()).unwrap();
        let mut r = Rank {
            w,
            rank,
            census: vec![0.0; 3],
            big: (0..BIG as usize)
                .map(|e| if rank == 0 { init(1, e) } else { -1.0 })
                .collect(),
        };
        r.w.wait(r.w.init(0, &mut r.census).unwrap()).unwrap();
        r.w.wait(r.w.init(1, &mut r.big).unwrap()).unwrap();
        r
    }

    /// Takes the place of this rank again, after its worker left.
    fn rejoin(control_url: &str, job: &AdmitResponse, rank: u16) -> Rank {
        let w = Worker::rejoin(control_url, job.id, job.token, rank, patient()).unwrap();
        Rank {
            w,
            rank,
            census: vec![0.0; 3],
            big: vec![0.0; BIG as usize],
        }
    }

    /// Pushes clock `c` of both keys and waits for both answers; checks
    /// that the answer counts exactly `c` of this rank's own clocks.
    fn clock(&mut self, c: u32) -> Result<(), WorkerError> {
        let mine: Vec<f32> = (0..3).map(|j| f32::from(j == self.rank)).collect();
        let g: Vec<f32> = (0..BIG as usize).map(|e| grad(self.rank, 1, e, c)).collect();
        let h0 = self.w.push_pull(0, &mine, &mut self.census)?;
        let h1 = self.w.push_pull(1, &g, &mut self.big)?;
        assert_eq!((h0.round(), h1.round()), (c, c), "rank {}", self.rank);
        // Both waited for, so that both keys are free again either way.
        let (a, b) = (self.w.wait(h0), self.w.wait(h1));
        a.and(b)?;
        assert_eq!(
            self.census[usize::from(self.rank)],
            c as f32,
            "rank {}: the answer to clock {c} counts its own clocks",
            self.rank
        );
        Ok(())
    }

    /// Pulls both keys: this rank's last answered clock on each.
    fn pull(&mut self) -> (u32, u32) {
        (
            self.w.pull(0, &mut self.census).unwrap(),
            self.w.pull(1, &mut self.big).unwrap(),
        )
    }

    /// Pulls both keys until they name the same clock (at most 5 s). They
    /// differ for a moment when a held answer is being released: the other
    /// ranks, pushing their lost clocks again, release it key by key, and a
    /// pull between the two sees one key released and the other not.
    fn pull_agreed(&mut self) -> (u32, u32) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (k0, k1) = self.pull();
            if k0 == k1 || Instant::now() >= deadline {
                return (k0, k1);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Clocks `from..=to`; an `ahead` refusal (the appliance came back at
    /// its checkpoint) is answered with a pull and a resumption from the
    /// clock the appliance has. Returns the clocks pushed again and the
    /// clock the pull gave, if one came.
    fn run(&mut self, from: u32, to: u32) -> (u32, Option<u32>) {
        let (mut c, mut again, mut resumed) = (from, 0, None);
        while c <= to {
            match self.clock(c) {
                Ok(()) => c += 1,
                Err(WorkerError::Refused { reason, .. }) if reason == "ahead" => {
                    let (k0, k1) = self.pull_agreed();
                    assert_eq!(k0, k1, "rank {}: both keys at one clock", self.rank);
                    assert!(resumed.is_none(), "rank {}: refused twice", self.rank);
                    resumed = Some(k0);
                    again += c - 1 - k0;
                    c = k0 + 1;
                }
                Err(e) => panic!("rank {} clock {c}: {e}", self.rank),
            }
        }
        (again, resumed)
    }

    /// Every rank's TOTAL clocks applied once each, and the exact sums.
    fn check_final(&mut self) {
        assert_eq!(self.pull(), (TOTAL, TOTAL), "rank {}", self.rank);
        assert_eq!(self.census, [TOTAL as f32; 3], "rank {}", self.rank);
        for (e, &v) in self.big.iter().enumerate() {
            let pushed: f32 = (0..3u16)
                .flat_map(|r| (1..=TOTAL).map(move |c| grad(r, 1, e, c)))
                .sum();
            assert_eq!(v, init(1, e) + pushed, "rank {} grads element {e}", self.rank);
        }
    }
}

/// Three ranks at clocks `at` (rank 0 the leader; with bounded delay τ
/// its last push applied and its answer held, `at[0]` = `at[1]` + τ + 1),
/// a checkpoint, the ranks further on (rank 0 held: released, nothing
/// more), the dataplane killed (SIGKILL) and started again: control
/// reinstalls the job from the checkpoint with each rank's clock (and the
/// held answer held), the ranks are told they are `ahead`, pull their own
/// clocks back, push the lost clocks once more and end exact at TOTAL.
fn restored_from_a_checkpoint(name: &str, consistency: Consistency, tau: Option<u32>) {
    let rack = Mutex::new(Rack::start(2, "256MiB"));
    let control_url = rack.lock().unwrap().control_url.clone();
    let job = rack.lock().unwrap().admit(&spec(name, consistency)).unwrap();
    let held = tau.is_some();
    let at: [u32; 3] = match tau {
        Some(t) => [2 + t + 1, 2, 3],
        None => [7, 2, 3],
    };
    // Clocks past the checkpoint, lost with the crash.
    let past: [u32; 3] = if held { [0, 2, 2] } else { [2, 2, 2] };
    let (pushed, checkpointed, at_crash, restarted) =
        (Gate::new(4), Gate::new(4), Gate::new(4), Gate::new(4));
    let all_done = Gate::new(3);
    let results: Vec<(u32, Option<u32>)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..3u16)
            .map(|rank| {
                let (pushed, checkpointed, at_crash, restarted, all_done, job, url) = (
                    &pushed,
                    &checkpointed,
                    &at_crash,
                    &restarted,
                    &all_done,
                    &job,
                    &control_url,
                );
                s.spawn(move || {
                    let mut r = Rank::join(url, job, rank);
                    let last = at[usize::from(rank)];
                    for c in 1..last {
                        r.clock(c).unwrap();
                    }
                    if rank == 0 && held {
                        let mine = [1.0, 0.0, 0.0];
                        let g: Vec<f32> = (0..BIG as usize).map(|e| grad(0, 1, e, last)).collect();
                        let h0 = r.w.push_pull(0, &mine, &mut r.census).unwrap();
                        let h1 = r.w.push_pull(1, &g, &mut r.big).unwrap();
                        pushed.wait();
                        checkpointed.wait();
                        // Released once ranks 1 and 2 move on.
                        r.w.wait(h0).unwrap();
                        r.w.wait(h1).unwrap();
                        assert_eq!(r.census[0], last as f32);
                    } else {
                        r.clock(last).unwrap();
                        pushed.wait();
                        checkpointed.wait();
                    }
                    let next = last + past[usize::from(rank)];
                    for c in last + 1..=next {
                        r.clock(c).unwrap();
                    }
                    at_crash.wait();
                    restarted.wait();
                    let out = r.run(next + 1, TOTAL);
                    all_done.wait();
                    r.check_final();
                    out
                })
            })
            .collect();
        pushed.wait();
        // Rank 0's push is applied (its answers held) before the checkpoint.
        let want_held = if held { CHUNKS } else { 0 };
        until(&rack.lock().unwrap(), &job, "every rank at its clock", |d| {
            d.clock.clocks == at.map(|c| (c, c)) && d.clock.held == want_held
        });
        let (ok, out, err) = rack
            .lock()
            .unwrap()
            .phubctl(&["job", "checkpoint", &job.id.to_string()]);
        assert!(ok && out.contains("checkpoint of job"), "{out}{err}");
        checkpointed.wait();
        at_crash.wait();
        let before = detail(&rack.lock().unwrap(), &job);
        let moved: [u32; 3] = std::array::from_fn(|r| at[r] + past[r]);
        assert_eq!(before.clock.clocks, moved.map(|c| (c, c)), "past the checkpoint");
        rack.lock().unwrap().kill_dataplane();
        rack.lock().unwrap().start_dataplane();
        // Control reinstalls the job from the checkpoint: each rank's
        // clock as it was then, rank 0's answer held again.
        until(
            &rack.lock().unwrap(),
            &job,
            "reinstalled at the checkpoint",
            |d| d.clock.clocks == at.map(|c| (c, c)) && d.clock.held == want_held,
        );
        restarted.wait();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for (rank, &(again, resumed)) in results.iter().enumerate() {
        // A held answer was not answered: its rank's last answered clock
        // is the one before (PROTOCOL.md §5.8, PULL), unless the other
        // ranks, pushing their lost clocks again, released it before the
        // rank's pull (a race the test does not order): then its applied
        // clock, and nothing to push again.
        let kept = at[rank] - u32::from(held && rank == 0);
        let lost = at[rank] + past[rank] - kept;
        let released = held && rank == 0 && (resumed, again) == (Some(at[rank]), lost - 1);
        assert!(
            (resumed, again) == (Some(kept), lost) || released,
            "rank {rank}: resumes from its own clock at the checkpoint: {:?}, expected {:?}",
            (resumed, again),
            (Some(kept), lost)
        );
    }
    let rack = rack.into_inner().unwrap();
    let d = detail(&rack, &job);
    assert_eq!(d.clock.clocks, vec![(TOTAL, TOTAL); 3]);
    assert_eq!(d.clock.held, 0);
    assert!(d.checkpoint.is_some());
}

#[test]
fn bounded_delay_job_restored_from_a_checkpoint_keeps_each_rank_clock() {
    restored_from_a_checkpoint("ssp-durable", Consistency::Bounded { delay: 1 }, Some(1));
}

#[test]
fn async_job_restored_from_a_checkpoint_keeps_each_rank_clock() {
    restored_from_a_checkpoint("async-durable", Consistency::Async, None);
}

/// Rank 1 of three leaves after clock 2 (its worker dropped) while the
/// others go on: with bounded delay τ = 1 the leader's answers are held
/// while it is away, in async nobody waits. It rejoins (`Worker::rejoin`),
/// pulls its own clock back (2), and every rank ends exact at TOTAL.
fn worker_leaves_and_rejoins(name: &str, consistency: Consistency, tau: Option<u32>) {
    let rack = Rack::start(2, "256MiB");
    let job = rack.admit(&spec(name, consistency)).unwrap();
    const LEFT_AT: u32 = 2;
    let (left, all_done) = (Gate::new(2), Gate::new(3));
    let url = &rack.control_url;
    std::thread::scope(|s| {
        let (left, all_done, job) = (&left, &all_done, &job);
        for rank in [0u16, 2] {
            s.spawn(move || {
                let mut r = Rank::join(url, job, rank);
                r.run(1, TOTAL);
                all_done.wait();
                r.check_final();
            });
        }
        s.spawn(move || {
            let mut r = Rank::join(url, job, 1);
            r.run(1, LEFT_AT);
            drop(r);
            left.wait();
            // Back, as a new process would be.
            left.wait();
            let mut r = Rank::rejoin(url, job, 1);
            assert_eq!(r.pull(), (LEFT_AT, LEFT_AT), "rank 1's clock kept");
            assert_eq!(r.census[1], LEFT_AT as f32);
            r.run(LEFT_AT + 1, TOTAL);
            all_done.wait();
            r.check_final();
        });
        left.wait();
        // Bounded delay: the others go as far as τ allows and their
        // answers wait there, held. Async: nobody waits for rank 1.
        let (ahead, want_held) = match tau {
            Some(t) => (LEFT_AT + t + 1, 2 * CHUNKS),
            None => (TOTAL, 0),
        };
        until(&rack, job, "the others as far as they may go", |d| {
            d.clock.clocks == [(ahead, ahead), (LEFT_AT, LEFT_AT), (ahead, ahead)]
                && d.clock.held == want_held
        });
        left.wait();
    });
    let d = detail(&rack, &job);
    assert_eq!(d.clock.clocks, vec![(TOTAL, TOTAL); 3]);
    assert_eq!(d.clock.held, 0);
}

#[test]
fn bounded_delay_worker_leaves_and_rejoins_with_its_clock() {
    worker_leaves_and_rejoins("ssp-rejoin", Consistency::Bounded { delay: 1 }, Some(1));
}

#[test]
fn async_worker_leaves_and_rejoins_with_its_clock() {
    worker_leaves_and_rejoins("async-rejoin", Consistency::Async, None);
}
