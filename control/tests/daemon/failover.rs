//! Failover on control's side (PROTOCOL.md §11.6): a real `Daemon` on
//! 127.0.0.1:0 with its default heartbeat timing, over three fake
//! dataplanes (`fake/`), each one lcore in one rack. A replicated job
//! (replicas 2) is admitted over all three; one fake stops (its listener
//! closes, as a killed dataplane's) or hangs, and control declares it
//! down, moves the job to epoch 1 without it, sends that epoch to the
//! two others and serves it; a second death that takes both replicas of
//! a part fails the job, naming the part, or stalls it until both answer
//! again when it has checkpoints (then it goes back to them); an
//! appliance that answers again gets the job back (§11.7).

// Not every test file uses every part of the fake.
#[allow(dead_code)]
use std::path::Path;
use std::time::{Duration, Instant};

use crate::client::{call_route, err_at, ok_at, wait_for, wait_within};
use crate::fake::{Fake, FakeConfig, TempState, FAKE_COPY_BYTES};
use phub_control::daemon::{Config, Daemon, Heartbeat, HEARTBEAT_DEADLINE_MS, HEARTBEAT_MS};
use phub_proto::api::{
    AdmitResponse, ApiError, ApplianceSpec, ApplianceStatus, JobDetail, JoinResponse, Rebalance,
    Rereplication, Strength,
};
use phub_proto::failover::{EpochView, Joined, ReplicaLayout};
use phub_proto::routes::ControlRoute as R;
use phub_proto::spec::{Appliances as Placed, JobSpec};

const NAMES: [&str; 3] = ["a", "b", "c"];

/// Slack on a loaded 2-core machine beyond what the timing allows: a
/// heartbeat thread woken late, the state file's fsync, the fake's
/// 20 ms poll.
const MARGIN: Duration = Duration::from_millis(1500);

fn daemon(fakes: &[&Fake], state: &Path) -> Daemon {
    daemon_reconciling_every(fakes, state, Duration::from_millis(200))
}

/// [`daemon`] reconciling every `interval`.
fn daemon_reconciling_every(fakes: &[&Fake], state: &Path, interval: Duration) -> Daemon {
    let appliances = NAMES
        .iter()
        .zip(fakes)
        .map(|(n, f)| ApplianceSpec {
            name: (*n).into(),
            url: f.url(),
            rack: String::new(),
            token_file: None,
            draining: false,
        })
        .collect();
    Daemon::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        dataplane: "http://127.0.0.1:1".into(),
        appliances,
        state: state.to_path_buf(),
        reconcile_interval: interval,
        ..Config::default()
    })
    .unwrap()
}

/// Three one-lcore fakes with distinct data ports.
fn three_fakes() -> [Fake; 3] {
    [9100, 9200, 9300].map(|p| Fake::start(FakeConfig::lcores(1).at(p)))
}

/// Admits a sum job of 24 chunks over the three appliances, replicas 2.
fn admit_replicated(d: &Daemon) -> AdmitResponse {
    let spec = JobSpec::new("r", 2, &[24 * 256])
        .with_chunk_bytes(1024)
        .sharded_over(Placed::Count(3))
        .with_replicas(2)
        .to_toml();
    ok_at(d, &R::Admit, Some(&spec))
}

fn join(d: &Daemon, job: &AdmitResponse, rank: u16) -> JoinResponse {
    let body = format!(
        "{{\"token\": \"{:016x}\", \"rank\": {rank}, \"rejoin\": true}}",
        job.token
    );
    ok_at(d, &R::Join { job: job.id }, Some(&body))
}

/// The epochs fake `f` was sent for `job`.
fn epochs(f: &Fake, job: u16) -> Vec<EpochView> {
    f.state
        .lock()
        .unwrap()
        .epochs
        .get(&job)
        .cloned()
        .unwrap_or_default()
}

/// Epoch 2 with appliance 1 (b) joined at it: b back after epoch 1.
fn b_joined_at_2() -> EpochView {
    EpochView {
        epoch: 2,
        down: vec![],
        joined: vec![Joined {
            appliance: 1,
            epoch: 2,
        }],
        moved: vec![],
        restored: 0,
    }
}

/// Silences b (a hung dataplane's heartbeats go unanswered) and waits
/// for `job`'s epoch 1 without it on a and c; returns the wait's bound
/// (a heartbeat deadline and interval, and the margin), which the caller
/// uses for what follows.
fn silence_b_until_epoch_1(a: &Fake, b: &Fake, c: &Fake, job: u16) -> Duration {
    b.set_silent(true);
    epoch_1_without_b_on(a, c, job)
}

/// Waits for `job`'s epoch 1 without b (appliance 1) on a and c, within
/// a heartbeat deadline and interval and the margin; returns that bound.
fn epoch_1_without_b_on(a: &Fake, c: &Fake, job: u16) -> Duration {
    let e1 = EpochView {
        epoch: 1,
        down: vec![1],
        ..Default::default()
    };
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    wait_within("epoch 1 on a and c", within, || {
        epochs(a, job).contains(&e1) && epochs(c, job).contains(&e1)
    });
    within
}

/// Whether fake `f` holds `job` installed at epoch `view`.
fn installed_at(f: &Fake, job: u16, view: &EpochView) -> bool {
    f.jobs().get(&job).is_some_and(|j| {
        j.replication
            .as_ref()
            .is_some_and(|r| (r.epoch, &r.down, &r.joined) == (view.epoch, &view.down, &view.joined))
    })
}

/// The job's layout as failover sees it, from a worker's join.
fn replica_layout(j: &JoinResponse) -> ReplicaLayout<String> {
    let r = j
        .replication
        .as_ref()
        .expect("a replicated job's join carries its replication");
    let lcores: Vec<usize> = j.appliances.iter().map(|a| a.lcores as usize).collect();
    ReplicaLayout::new(
        j.layout.lcores.clone(),
        &lcores,
        r.racks.clone(),
        usize::from(r.replicas),
    )
    .unwrap()
}

/// The defaults are the documented ones, and give failover well under a
/// second; a deadline not beyond the interval is refused naming the key.
#[test]
fn heartbeat_defaults_and_nonsense_timing_refused() {
    let h = Heartbeat::default();
    assert_eq!(h.interval, Duration::from_millis(HEARTBEAT_MS));
    assert_eq!(h.deadline, Duration::from_millis(HEARTBEAT_DEADLINE_MS));
    assert_eq!((HEARTBEAT_MS, HEARTBEAT_DEADLINE_MS), (100, 500));
    assert!(h.interval + h.deadline < Duration::from_secs(1));
    let state = TempState::new("phub-control-failover", "timing");
    let e = Daemon::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        state: state.to_path_buf(),
        heartbeat: Heartbeat {
            interval: Duration::from_millis(300),
            deadline: Duration::from_millis(300),
            spare_after: None,
        },
        ..Config::default()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("heartbeat-deadline-ms = 300") && e.contains("more than heartbeat-ms (300)"),
        "{e}"
    );
}

/// A killed appliance of a replicated job: declared down within the
/// deadline (and one interval, and the margin); epoch 1 with it down is
/// sent to the other two, served on `GET /v1/jobs/{id}/epoch`, given at
/// join, shown by `job show`, the appliance list and `/metrics`, and kept
/// across a restart of control. A second death that leaves a part with
/// no live replica fails the job, naming the part.
#[test]
fn a_dead_appliance_moves_a_replicated_job_to_the_next_epoch_and_a_lost_part_fails_it() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "kill");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    let e0: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(e0, EpochView::default());
    let j = join(&d, &job, 0);
    let r = j.replication.as_ref().expect("replication at join");
    assert_eq!((r.replicas, r.racks.len(), &r.epoch), (2, 3, &e0));
    let names: Vec<&str> = j.appliances.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(names, NAMES, "the job's appliances in layout order");
    // Let a few heartbeats be answered: nobody is declared down.
    std::thread::sleep(Duration::from_millis(3 * HEARTBEAT_MS));
    assert!(epochs(&a, job.id).is_empty() && epochs(&c, job.id).is_empty());

    // b dies: its listener closes, as a dataplane's killed with -9.
    let killed = Instant::now();
    drop(b);
    let want = EpochView {
        epoch: 1,
        down: vec![1],
        ..Default::default()
    };
    epoch_1_without_b_on(&a, &c, job.id);
    let took = killed.elapsed();
    eprintln!("epoch 1 installed on both survivors {took:?} after the kill");
    // The deadline runs from the last answer, up to an interval before
    // the kill.
    assert!(
        took >= Duration::from_millis(HEARTBEAT_DEADLINE_MS - HEARTBEAT_MS),
        "{took:?}: declared before the deadline"
    );
    let e1: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(e1, want);
    assert_eq!(join(&d, &job, 1).replication.unwrap().epoch, want);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert_eq!(show.epoch.as_ref(), Some(&want));
    assert!(show.summary.failed.is_none(), "{:?}", show.summary.failed);
    let bpart = &show.parts[1];
    assert!(
        bpart
            .down
            .as_deref()
            .is_some_and(|w| w.contains("declared down") && w.contains("epoch 1")),
        "{bpart:?}"
    );
    let list: Vec<ApplianceStatus> = ok_at(&d, &R::Appliances, None);
    let bs = list.iter().find(|s| s.name == "b").unwrap();
    assert!(
        bs.down.as_deref().is_some_and(|w| w.contains("declared down")),
        "{bs:?}"
    );
    let (_, metrics) = call_route(&d, &R::Metrics, None);
    assert!(
        metrics.contains("phub_appliance_declared_down{appliance=\"b\"} 1")
            && metrics.contains("phub_appliance_declared_down{appliance=\"a\"} 0")
            && metrics.contains("phub_appliance_down_declarations_total{appliance=\"b\"} 1"),
        "{metrics}"
    );

    // The epoch is kept with the job: a restarted control serves it.
    d.shutdown();
    // b's dataplane comes back at another address, empty.
    let b2 = Fake::start(FakeConfig::lcores(1).at(9400));
    let d = daemon(&[&a, &b2, &c], &state);
    let again: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(again, want);

    // The member of part 0's set other than b dies too... unless part 0
    // is b's own: then part 1's. Either way a part has no replica left.
    let layout = replica_layout(&j);
    let (part, second) = (0..3)
        .filter(|&p| layout.set(p).contains(&1))
        .map(|p| (p, *layout.set(p).iter().find(|&&x| x != 1).unwrap()))
        .next()
        .unwrap();
    let gone = if second == 0 { &a } else { &c };
    gone.set_silent(true);
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    // A failed job's epoch route answers 409 with the reason (its workers
    // stop with it); `job show` keeps the epoch it failed in.
    wait_within(
        "the job to fail",
        within + Duration::from_millis(HEARTBEAT_DEADLINE_MS),
        || call_route(&d, &R::Epoch { job: job.id }, None).0 == 409,
    );
    gone.set_silent(false);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    let why = show.summary.failed.expect("the job failed");
    assert!(
        why.contains(&format!("part {part} "))
            && why.contains("\"b\"")
            && why.contains(&format!("{:?}", NAMES[second])),
        "{why}"
    );
    let (_, text) = call_route(&d, &R::Epoch { job: job.id }, None);
    assert!(text.contains(&format!("part {part} ")), "{text}");
    let e2: EpochView = show.epoch.expect("a failed job keeps its epoch");
    assert_eq!(e2.down, {
        let mut v = vec![1u16, u16::try_from(second).unwrap()];
        v.sort_unstable();
        v
    });
    d.shutdown();
}

/// An appliance declared down that answers again (restarted: it holds
/// no job) gets each replicated job back (PROTOCOL.md §11.7): the job
/// moves to epoch 2 with it joined, is installed on it at that epoch,
/// empty (never from a checkpoint), epoch 2 is put on the two others, and
/// `job show` says re-replicating, one replica live of two, until the
/// appliances' stats say no state copy is awaited; then full strength,
/// with the time it took and the bytes copied, kept across a restart of
/// control and exported in `/metrics`.
#[test]
fn a_down_appliance_that_answers_again_gets_the_job_back_at_the_next_epoch_joined() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "back");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    assert!(b.jobs().contains_key(&job.id));
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    let r = show.replicas.expect("a replicated job reports its replicas");
    assert_eq!((r.live, r.wanted, r.state), (2, 2, Strength::FullStrength));
    let within = silence_b_until_epoch_1(&a, &b, &c, job.id);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    let r = show.replicas.unwrap();
    assert_eq!((r.live, r.wanted, r.state), (1, 2, Strength::Degraded));
    // b restarts (it forgets its jobs) and answers again; its copies are
    // not done until the test says so.
    {
        let mut st = b.state.lock().unwrap();
        st.jobs.clear();
        st.copies_awaiting = 3;
    }
    b.set_silent(false);
    let e2 = b_joined_at_2();
    wait_within("the job installed on b at epoch 2, joined", within, || {
        installed_at(&b, job.id, &e2)
    });
    assert!(
        b.state.lock().unwrap().restored.is_empty(),
        "an appliance that came back is installed empty, not from a checkpoint"
    );
    wait_within("epoch 2 on a and c", within, || {
        epochs(&a, job.id).last() == Some(&e2) && epochs(&c, job.id).last() == Some(&e2)
    });
    let e: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(e, e2);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert_eq!(show.epoch.as_ref(), Some(&e2));
    assert!(show.parts[1].down.is_none(), "{:?}", show.parts[1]);
    let r = show.replicas.unwrap();
    assert_eq!((r.live, r.wanted, r.state), (1, 2, Strength::Rereplicating));
    let x = r.rereplication.expect("the re-replication is reported");
    assert_eq!((x.appliance.as_str(), x.epoch, x.ended_unix_ms), ("b", 2, None));
    // Several polls later, still under way while b awaits copies.
    std::thread::sleep(Duration::from_millis(5 * HEARTBEAT_MS));
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert_eq!(show.replicas.unwrap().state, Strength::Rereplicating);

    b.state.lock().unwrap().copies_awaiting = 0;
    let full = || -> Option<Rereplication> {
        let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
        let r = show.replicas?;
        (r.state == Strength::FullStrength && r.live == 2).then_some(r.rereplication?)
    };
    wait_within("full strength", within, || full().is_some());
    let x = full().unwrap();
    assert_eq!(x.bytes_copied, Some(FAKE_COPY_BYTES));
    assert!(x.full_strength_ms().is_some(), "{x:?}");
    let (_, metrics) = call_route(&d, &R::Metrics, None);
    let id = job.id;
    assert!(
        metrics.contains(&format!("phub_job_replicas_live{{job=\"{id}\"}} 2"))
            && metrics.contains(&format!("phub_job_replicas_wanted{{job=\"{id}\"}} 2"))
            && metrics.contains(&format!("phub_job_rereplicating{{job=\"{id}\"}} 0"))
            && metrics.contains(&format!("phub_job_rereplication_seconds{{job=\"{id}\"}}")),
        "{metrics}"
    );
    // Kept with the job: a restarted control reports the same.
    d.shutdown();
    let d = daemon(&[&a, &b, &c], &state);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert_eq!(show.epoch.as_ref(), Some(&e2));
    let r = show.replicas.unwrap();
    assert_eq!((r.live, r.state), (2, Strength::FullStrength));
    assert_eq!(r.rereplication, Some(x));
    // And reconciliation leaves b's install as it is.
    std::thread::sleep(Duration::from_millis(600));
    assert!(b.jobs().contains_key(&job.id));
    d.shutdown();
}

/// Reconciliation reads an appliance's jobs as they were when it asked:
/// on a loaded host the answer may come after the job was given back to
/// it (b declared down, restarted, answering again: re-replicated at
/// epoch 2). Such a stale answer does not take b for an appliance that
/// lost the job again (another failover at epoch 3 and another
/// re-replication at epoch 4, as .ci/run once saw on real dataplanes):
/// here every answer of b's to `GET /v1/jobs` is 600 ms old, three
/// reconciliation passes long, and the job stays at epoch 2.
#[test]
fn a_stale_answer_to_reconciliation_does_not_take_a_returned_appliance_for_one_that_lost_the_job() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "stale");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    let within = silence_b_until_epoch_1(&a, &b, &c, job.id);
    b.restart();
    b.state.lock().unwrap().jobs_delay = Some(Duration::from_millis(600));
    b.set_silent(false);
    let e2 = b_joined_at_2();
    let full = || -> bool {
        let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
        show.replicas
            .is_some_and(|r| r.state == Strength::FullStrength && r.live == 2 && r.rereplication.is_some())
    };
    wait_within("full strength", within + Duration::from_millis(600), full);
    // Passes go on, each reading b's jobs as they were 600 ms before.
    std::thread::sleep(Duration::from_millis(2000));
    let e: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(e, e2, "b was taken for having lost the job it was given back");
    assert_eq!(b.state.lock().unwrap().installs, vec![(job.id, 0), (job.id, 2)]);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    let x = show.replicas.and_then(|r| r.rereplication).unwrap();
    assert_eq!((x.appliance.as_str(), x.epoch), ("b", 2), "{x:?}");
    d.shutdown();
}

/// An appliance that restarts within the heartbeat deadline (it loses
/// its jobs but never misses a heartbeat) is not given a replicated job
/// again at the epoch it served it in, where it would serve its parts
/// empty: the job fails over without it (epoch 1) and re-replicates to it
/// (epoch 2, joined), installed there empty and filled by state copies.
#[test]
fn an_appliance_that_restarted_unnoticed_fails_over_and_gets_the_job_back_joined() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "restart");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    assert_eq!(b.state.lock().unwrap().installs, vec![(job.id, 0)]);
    // b restarts at once: it holds nothing, and answers every heartbeat.
    b.forget_all();
    let e2 = b_joined_at_2();
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    wait_within("the job installed on b at epoch 2, joined", within, || {
        installed_at(&b, job.id, &e2)
    });
    {
        let st = b.state.lock().unwrap();
        assert_eq!(
            st.installs,
            vec![(job.id, 0), (job.id, 2)],
            "b is given the job again only at epoch 2 (never at epoch 0, where it would serve its parts empty)"
        );
        assert!(st.restored.is_empty(), "installed empty, not from a checkpoint");
    }
    let e1 = EpochView {
        epoch: 1,
        down: vec![1],
        ..Default::default()
    };
    // Not a second deadline: the epochs follow b's install, which the
    // wait above bounded (2.1 s here failed once under a loaded make test).
    // An epoch may be put twice (the failover's put and reconciliation's,
    // racing: a second put of the same view changes nothing), and epoch 1
    // skipped where epoch 2 was recorded before its put went out (its put
    // thread stops once the job moved on).
    let seen = |f: &Fake| {
        let mut e = epochs(f, job.id);
        e.dedup();
        e
    };
    wait_for("epochs 1 then 2, or 2, on a and c", || {
        [&a, &c].iter().all(|f| {
            let e = seen(f);
            e == vec![e1.clone(), e2.clone()] || e == vec![e2.clone()]
        })
    });
    let full = || -> bool {
        let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
        show.replicas
            .is_some_and(|r| r.state == Strength::FullStrength && r.live == 2 && r.rereplication.is_some())
    };
    wait_within("full strength", within, full);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert!(show.summary.failed.is_none(), "{:?}", show.summary.failed);
    let (_, appliances) = call_route(&d, &R::Appliances, None);
    assert!(
        !appliances.contains("declared down"),
        "b was never declared down: {appliances}"
    );
    d.shutdown();
}

/// Two of three appliances of a replicated job restart (control with
/// them) after a checkpoint: part 0 (set a, b) kept no replica, while c
/// still holds its own part and its backup of b's, rounds ahead of the
/// checkpoint. The whole job goes back to its checkpoints, at a new epoch
/// naming nobody: control
/// removes it from c and restores every part, c's too, rather than
/// restore a and b beside c's newer state (c's backup slots would refuse
/// b's restored primary `stale`, a's restored backup slots c's aggregates
/// `ahead`: the job hung).
#[test]
fn a_part_that_lost_every_replica_takes_the_whole_job_back_to_its_checkpoints() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "lost-part");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    let _: serde_json::Value = ok_at(&d, &R::Checkpoint { job: job.id }, None);
    d.shutdown();
    a.forget_all();
    b.forget_all();
    let d = daemon(&[&a, &b, &c], &state);
    wait_for("every part restored from its checkpoint", || {
        [&a, &b, &c]
            .iter()
            .all(|f| f.state.lock().unwrap().restored.contains_key(&job.id))
    });
    let st = c.state.lock().unwrap();
    assert_eq!(
        st.installs,
        vec![(job.id, 0), (job.id, 0)],
        "c, which held the job, is installed again (restored, as its checkpoint's job)"
    );
    let delete = format!("DELETE /v1/jobs/{}", job.id);
    assert!(st.log.contains(&delete), "c's part removed first: {:?}", st.log);
    drop(st);
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert!(show.summary.failed.is_none(), "{:?}", show.summary.failed);
    // Restored as the checkpoints' jobs, then put the job's new epoch,
    // which names nobody (what their former selves sent is refused) and
    // says the job went back at it (the workers drop RESULTs sent before).
    let e1 = EpochView {
        epoch: 1,
        restored: 1,
        ..Default::default()
    };
    wait_for("epoch 1 on every part", || {
        [&a, &b, &c].iter().all(|f| epochs(f, job.id) == vec![e1.clone()])
    });
    let now: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(now, e1);
    d.shutdown();
}

/// A second death that leaves a part no live replica, in a job with a
/// checkpoint of every part, stalls the job instead of failing it
/// (PROTOCOL.md §11.7, "Stalled jobs"): its epoch names both appliances
/// down, `job show` says stalled and why, `/metrics` has
/// `phub_job_stalled` 1, and neither appliance is given the job back
/// when it answers again while the other is still down. Once both answer
/// (restarted, empty), the whole job goes back to its checkpoints at the
/// next epoch naming nobody: removed from the survivor, every part
/// restored, and full strength again.
#[test]
fn a_part_whose_every_replica_is_down_stalls_the_job_until_it_goes_back_to_its_checkpoints() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "stall");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    let layout = replica_layout(&join(&d, &job, 0));
    let _: serde_json::Value = ok_at(&d, &R::Checkpoint { job: job.id }, None);
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    b.set_silent(true);
    wait_within("epoch 1 without b", within, || {
        let e: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
        e.down == [1]
    });
    // The other member of a part's set with b dies too.
    let (part, second) = (0..3)
        .filter(|&p| layout.set(p).contains(&1))
        .map(|p| (p, *layout.set(p).iter().find(|&&x| x != 1).unwrap()))
        .next()
        .unwrap();
    let (gone, survivor) = if second == 0 { (&a, &c) } else { (&c, &a) };
    gone.set_silent(true);
    let show = || -> JobDetail { ok_at(&d, &R::Job { job: job.id }, None) };
    wait_within("the job to stall", within + within, || {
        show().replicas.is_some_and(|r| r.state == Strength::Stalled)
    });
    let s = show();
    assert!(s.summary.failed.is_none(), "{:?}", s.summary.failed);
    let why = s.replicas.unwrap().stalled.expect("the stall's reason");
    assert!(
        why.contains(&format!("part {part} ")) && why.contains("goes back to its checkpoints"),
        "{why}"
    );
    let mut down = vec![1u16, u16::try_from(second).unwrap()];
    down.sort_unstable();
    let e2: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(
        (e2.epoch, &e2.down),
        (2, &down),
        "the workers are served the stalled epoch"
    );
    let (_, metrics) = call_route(&d, &R::Metrics, None);
    assert!(
        metrics.contains(&format!("phub_job_stalled{{job=\"{}\"}} 1", job.id)),
        "{metrics}"
    );
    // b comes back alone, restarted: it is not given the job (no
    // re-replication of a stalled job), which stays stalled.
    b.restart();
    b.set_silent(false);
    std::thread::sleep(Duration::from_millis(4 * HEARTBEAT_MS) + Duration::from_millis(600));
    assert!(
        b.jobs().is_empty(),
        "b given the stalled job: {:?}",
        b.jobs().keys()
    );
    let s = show();
    assert_eq!(s.replicas.map(|r| r.state), Some(Strength::Stalled));
    assert!(s.summary.failed.is_none(), "{:?}", s.summary.failed);
    // The second comes back too: the job goes back to its checkpoints.
    gone.restart();
    gone.set_silent(false);
    wait_for("every part restored from its checkpoint", || {
        [&a, &b, &c]
            .iter()
            .all(|f| f.state.lock().unwrap().restored.contains_key(&job.id))
    });
    let delete = format!("DELETE /v1/jobs/{}", job.id);
    assert!(
        survivor.state.lock().unwrap().log.contains(&delete),
        "the survivor's part removed before its restore"
    );
    let e3 = EpochView {
        epoch: 3,
        restored: 3,
        ..Default::default()
    };
    let t = Instant::now();
    while ![&a, &b, &c].iter().all(|f| epochs(f, job.id).last() == Some(&e3)) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "epochs: a {:?} b {:?} c {:?}",
            epochs(&a, job.id),
            epochs(&b, job.id),
            epochs(&c, job.id)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let s = show();
    assert!(s.summary.failed.is_none(), "{:?}", s.summary.failed);
    let r = s.replicas.unwrap();
    assert_eq!((r.state, r.live, r.stalled), (Strength::FullStrength, 2, None));
    let now: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(now, e3);
    d.shutdown();
}

/// Past a failover and a re-replication, a part that kept no replica
/// takes the job back to its checkpoints too: every appliance of it
/// answers, each restores its own part (never the parts it adopted), at
/// the next epoch naming nobody; nothing is installed empty at the job's
/// epoch (which would serve the part from nothing).
#[test]
fn a_part_lost_past_a_failover_takes_the_job_back_to_its_checkpoints() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "lost-later");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    let _: serde_json::Value = ok_at(&d, &R::Checkpoint { job: job.id }, None);
    // b restarts unnoticed: the job fails over and b is back, joined, at
    // epoch 2.
    b.forget_all();
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    wait_within("b back at epoch 2", within, || {
        installed_at(&b, job.id, &b_joined_at_2())
    });
    // At full strength the re-replication's thread is done with the state.
    wait_within("full strength", within, || {
        let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
        show.replicas.is_some_and(|r| r.state == Strength::FullStrength)
    });
    d.shutdown();
    // Part 2 (set c, a) keeps no replica.
    a.forget_all();
    c.forget_all();
    let installs = |f: &Fake| f.state.lock().unwrap().installs.len();
    let before = (installs(&a), installs(&c));
    let d = daemon(&[&a, &b, &c], &state);
    wait_for("every part restored from its checkpoint", || {
        [&a, &b, &c]
            .iter()
            .all(|f| f.state.lock().unwrap().restored.contains_key(&job.id))
    });
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert!(show.summary.failed.is_none(), "{:?}", show.summary.failed);
    assert!(
        b.state
            .lock()
            .unwrap()
            .log
            .contains(&format!("DELETE /v1/jobs/{}", job.id)),
        "b's part removed before its restore"
    );
    let e3 = EpochView {
        epoch: 3,
        restored: 3,
        ..Default::default()
    };
    wait_for("epoch 3 on every part", || {
        [&a, &b, &c].iter().all(|f| epochs(f, job.id).last() == Some(&e3))
    });
    for (f, n, from) in [(&a, "a", before.0), (&c, "c", before.1)] {
        let st = f.state.lock().unwrap();
        assert!(
            st.installs[from..].iter().all(|&(j, e)| j != job.id || e == 0),
            "{n} installed at the job's epoch rather than restored: {:?}",
            st.installs
        );
    }
    d.shutdown();
}

/// A dataplane that restarts between two heartbeats answers the next with
/// a new identity: control reconciles at once instead of at its next
/// interval (10 s here), so the replicated job fails over without it and
/// is given back to it joined within about a second, as a dataplane
/// restarted by its service manager right after a crash is.
#[test]
fn a_dataplane_restarted_between_heartbeats_is_reconciled_at_once() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "poke");
    let d = daemon_reconciling_every(&[&a, &b, &c], &state, Duration::from_secs(10));
    let job = admit_replicated(&d);
    // Heartbeats have seen b's identity.
    std::thread::sleep(Duration::from_millis(3 * HEARTBEAT_MS));
    let restarted = Instant::now();
    b.restart();
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    wait_within("the job installed on b at epoch 2, joined", within, || {
        installed_at(&b, job.id, &b_joined_at_2())
    });
    eprintln!("b given the job back {:?} after its restart", restarted.elapsed());
    d.shutdown();
}

/// An appliance declared down before a job existed that answers for its
/// description (slowly: past the heartbeat deadline, within admission's
/// wait) is given a replicated job, and never answers a heartbeat: the
/// job fails over without it at once, though no new declaration comes.
/// Before, failover ran only at the declaration, which found no job: the
/// job's other appliances waited for its acknowledgements for ever (a
/// DPDK failover test hung so in `.ci/run`: its kernel-UDP appliance,
/// slow to start, was declared down before the job was admitted and
/// killed before a heartbeat saw it up).
#[test]
fn a_job_admitted_on_an_appliance_declared_down_fails_over_without_it() {
    let [a, b, c] = three_fakes();
    b.state.lock().unwrap().info_delay = Some(Duration::from_millis(HEARTBEAT_DEADLINE_MS + 300));
    let state = TempState::new("phub-control-failover", "owed");
    let d = daemon(&[&a, &b, &c], &state);
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    wait_within("b declared down", within, || {
        let list: Vec<ApplianceStatus> = ok_at(&d, &R::Appliances, None);
        list.iter().any(|s| s.name == "b" && s.down.is_some())
    });
    let job = admit_replicated(&d);
    assert!(
        b.jobs().contains_key(&job.id),
        "admitted on b, which answered for its description"
    );
    let want = EpochView {
        epoch: 1,
        down: vec![1],
        ..Default::default()
    };
    wait_within("epoch 1 without b on a and c", within, || {
        epochs(&a, job.id).contains(&want) && epochs(&c, job.id).contains(&want)
    });
    d.shutdown();
}

/// A survivor that answers the new epoch 410 (it would serve a part whose
/// state copy it has not all received: the part is lost) fails the job
/// with its reason, and control's epoch route then answers 409 with it, so
/// that workers stop with the reason instead of waiting.
#[test]
fn a_survivor_that_cannot_serve_the_new_epoch_fails_the_job_naming_it() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "gone");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    let lost = "lcore 0: this appliance would serve appliance 1's part, whose state copy is not all here";
    c.state.lock().unwrap().part_lost = Some(lost.into());
    b.set_silent(true);
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    let failed = || -> Option<String> {
        let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
        show.summary.failed
    };
    wait_within("the job failed", within, || failed().is_some());
    let why = failed().unwrap();
    assert!(
        why.contains("appliance \"c\" cannot serve epoch 1 (HTTP 410)") && why.contains(lost),
        "{why}"
    );
    let (status, text) = call_route(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(status, 409, "{text}");
    assert!(text.contains("failed") && text.contains(lost), "{text}");
    b.set_silent(false);
    d.shutdown();
}

/// The same 410 for a job with a checkpoint of every part stalls it
/// instead (PROTOCOL.md §11.7, "Stalled jobs"), naming the answer; the
/// stalled epoch is put on nobody else; once b answers again the whole
/// job goes back to its checkpoints at the next epoch.
#[test]
fn a_survivor_that_cannot_serve_the_new_epoch_stalls_a_checkpointed_job() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "gone-stall");
    let d = daemon(&[&a, &b, &c], &state);
    let job = admit_replicated(&d);
    let _: serde_json::Value = ok_at(&d, &R::Checkpoint { job: job.id }, None);
    let lost = "lcore 0: this appliance would serve appliance 1's part, whose state copy is not all here";
    c.state.lock().unwrap().part_lost = Some(lost.into());
    b.set_silent(true);
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    let show = || -> JobDetail { ok_at(&d, &R::Job { job: job.id }, None) };
    wait_within("the job stalled", within, || {
        show().replicas.is_some_and(|r| r.state == Strength::Stalled)
    });
    let s = show();
    assert!(s.summary.failed.is_none(), "{:?}", s.summary.failed);
    let why = s.replicas.and_then(|r| r.stalled).unwrap();
    assert!(
        why.contains("appliance \"c\" cannot serve epoch 1 (HTTP 410)") && why.contains(lost),
        "{why}"
    );
    c.state.lock().unwrap().part_lost = None;
    b.restart();
    b.set_silent(false);
    wait_within("every part restored", within + within, || {
        [&a, &b, &c]
            .iter()
            .all(|f| f.state.lock().unwrap().restored.contains_key(&job.id))
    });
    let e2 = EpochView {
        epoch: 2,
        restored: 2,
        ..Default::default()
    };
    wait_for("epoch 2 on every part", || {
        [&a, &b, &c].iter().all(|f| epochs(f, job.id).last() == Some(&e2))
    });
    assert_eq!(show().replicas.map(|r| r.state), Some(Strength::FullStrength));
    d.shutdown();
}

/// An appliance declared down is chosen for no new job while it stays
/// silent: a spec naming it is refused saying so (once it did not answer
/// for its description either), a spec asking for more than the others
/// is refused naming it, and a spec asking for a count gets the others.
#[test]
fn an_appliance_declared_down_is_not_chosen_for_a_new_job() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "admit");
    let d = daemon(&[&a, &b, &c], &state);
    b.set_silent(true);
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    wait_within("b declared down", within, || {
        let list: Vec<ApplianceStatus> = ok_at(&d, &R::Appliances, None);
        list.iter().any(|s| s.name == "b" && s.down.is_some())
    });
    let named = JobSpec::new("named", 1, &[1024])
        .sharded_over(Placed::Names(vec!["a".into(), "b".into()]))
        .to_toml();
    let (status, text) = call_route(&d, &R::Admit, Some(&named));
    assert_eq!(status, 409, "{text}");
    let e = serde_json::from_str::<ApiError>(&text)
        .unwrap_or_else(|e| panic!("not an ApiError ({e}): {text}"))
        .error;
    assert!(
        e.contains("\"b\", which is declared down") && e.contains("not declared down: a, c"),
        "{e}"
    );
    assert!(!a.jobs().values().any(|j| j.spec.name == "named"), "{e}");
    // Three asked, two not declared down: refused naming the one that is.
    let three = JobSpec::new("three", 1, &[1024])
        .sharded_over(Placed::Count(3))
        .to_toml();
    let (status, text) = call_route(&d, &R::Admit, Some(&three));
    assert_eq!(status, 409, "{text}");
    let e = serde_json::from_str::<ApiError>(&text).unwrap().error;
    assert!(
        e.contains("asks for 3 appliances; 2 answer: a, c")
            && e.contains("declared down (no new job is placed on them): b"),
        "{e}"
    );
    assert!(!a.jobs().values().any(|j| j.spec.name == "three"), "{e}");
    let counted = JobSpec::new("counted", 1, &[1024])
        .sharded_over(Placed::Count(2))
        .to_toml();
    let job: AdmitResponse = ok_at(&d, &R::Admit, Some(&counted));
    let mut chosen = job.appliances.clone();
    chosen.sort();
    assert_eq!(chosen, ["a", "c"]);
    assert!(!b.jobs().contains_key(&job.id));
    d.shutdown();
}

/// A job that is not replicated does not change when an appliance of it
/// dies: no epoch, nothing sent; it waits for the appliance.
#[test]
fn a_job_that_is_not_replicated_waits_for_its_appliance() {
    let [a, b, c] = three_fakes();
    let state = TempState::new("phub-control-failover", "plain");
    let d = daemon(&[&a, &b, &c], &state);
    let spec = JobSpec::new("p", 2, &[24 * 256])
        .with_chunk_bytes(1024)
        .sharded_over(Placed::Count(3))
        .to_toml();
    let job: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec));
    b.set_silent(true);
    let list = || -> Vec<ApplianceStatus> { ok_at(&d, &R::Appliances, None) };
    wait_within("b declared down", Duration::from_secs(5), || {
        list()
            .iter()
            .any(|s| s.name == "b" && s.down.as_deref().is_some_and(|w| w.contains("declared down")))
    });
    let e: EpochView = ok_at(&d, &R::Epoch { job: job.id }, None);
    assert_eq!(e, EpochView::default());
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert_eq!(show.epoch, None);
    assert!(show.summary.failed.is_none());
    b.set_silent(false);
    // Answering again changes nothing either: no epoch, no new install,
    // no removal, nothing reported of replicas.
    let installed = b.jobs().get(&job.id).cloned();
    assert!(installed.is_some());
    std::thread::sleep(Duration::from_millis(1000));
    assert!(epochs(&a, job.id).is_empty() && epochs(&b, job.id).is_empty());
    assert_eq!(b.jobs().get(&job.id), installed.as_ref());
    let deleted = format!("DELETE /v1/jobs/{}", job.id);
    assert!(!b.state.lock().unwrap().log.contains(&deleted));
    let show: JobDetail = ok_at(&d, &R::Job { job: job.id }, None);
    assert_eq!((show.epoch, show.replicas), (None, None));
    d.shutdown();
}

/// `phubctl job rebalance` (PROTOCOL.md §11.8): two replicated jobs on
/// a, b and c, then d added. Rebalancing the second moves one part from
/// the most loaded appliance to d (the drain's move: d installed empty at
/// the next epoch, the index moved there); once the job is back to full
/// strength, nothing more evens the load and nothing moves. A job not
/// replicated is refused, nothing changed.
#[test]
fn a_rebalance_moves_one_part_to_an_appliance_added_since() {
    let [a, b, c] = three_fakes();
    let d_fake = Fake::start(FakeConfig::lcores(1).at(9400));
    let state = TempState::new("phub-control-failover", "rebalance");
    let d = daemon(&[&a, &b, &c], &state);
    let first = admit_replicated(&d);
    let second = admit_replicated(&d);
    let plain = JobSpec::new("p", 1, &[256])
        .with_chunk_bytes(1024)
        .sharded_over(Placed::Count(3))
        .to_toml();
    let plain: AdmitResponse = ok_at(&d, &R::Admit, Some(&plain));
    // No appliance outside the jobs yet: nothing to move to.
    let r: Rebalance = ok_at(&d, &R::Rebalance { job: second.id }, None);
    assert_eq!(r.moved, None, "{r:?}");
    let spec = ApplianceSpec {
        name: "d".into(),
        url: d_fake.url(),
        rack: String::new(),
        token_file: None,
        draining: false,
    };
    let body = serde_json::to_string(&spec).unwrap();
    let _: ApplianceStatus = ok_at(
        &d,
        &R::AddAppliance {
            mode: phub_proto::routes::AddMode::Checked,
        },
        Some(&body),
    );
    let e = err_at(&d, &R::Rebalance { job: plain.id }, None, 409);
    assert!(
        e.contains("not replicated") && e.contains("nothing was moved"),
        "{e}"
    );
    let r: Rebalance = ok_at(&d, &R::Rebalance { job: second.id }, None);
    let m = r.moved.clone().expect("a part moves to d");
    assert_eq!(
        (m.index, m.from.as_str(), m.to.as_str(), m.epoch),
        (0, "a", "d", 1),
        "{r:?}"
    );
    assert_eq!(
        r.load,
        [("d".to_string(), 1), ("b".into(), 3), ("c".into(), 3)],
        "{r:?}"
    );
    let now: EpochView = ok_at(&d, &R::Epoch { job: second.id }, None);
    assert_eq!((now.epoch, now.moved.len()), (1, 1), "{now:?}");
    assert_eq!(now.moved[0].name, "d");
    wait_for("d installed at epoch 1", || {
        d_fake.state.lock().unwrap().installs.contains(&(second.id, 1))
    });
    let within = Duration::from_millis(HEARTBEAT_DEADLINE_MS + HEARTBEAT_MS) + MARGIN;
    wait_within("full strength", within * 4, || {
        let show: JobDetail = ok_at(&d, &R::Job { job: second.id }, None);
        show.replicas.is_some_and(|r| r.state == Strength::FullStrength)
    });
    // a 2 jobs (the first and the plain one), b and c 3, d 1: the first
    // job's part on b (the first of the most loaded) moves to d.
    let r: Rebalance = ok_at(&d, &R::Rebalance { job: first.id }, None);
    let m = r.moved.clone().expect("a part of the first job moves to d");
    assert_eq!((m.index, m.from.as_str(), m.to.as_str()), (1, "b", "d"), "{r:?}");
    // a, b and d 2 jobs, c 3: the second job (d, b, c) would move its
    // part on c to a, which holds one job fewer: no more even.
    let r: Rebalance = ok_at(&d, &R::Rebalance { job: second.id }, None);
    assert_eq!(r.moved, None, "{r:?}");
    assert_eq!(
        r.load,
        [("d".to_string(), 2), ("b".into(), 2), ("c".into(), 3)],
        "{r:?}"
    );
    d.shutdown();
}
