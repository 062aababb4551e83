//! Draining an appliance while a job runs (PROTOCOL.md §11.8), end to
//! end: four phub-dataplane processes under one phub-control, a job with
//! two replicas of every chunk over a, b and c, workers on the
//! phub-worker library training it. `phubctl appliance drain b` mid-
//! training moves b's place in the job to d (the spare): d is filled with
//! state copies while the rounds go on, b is out of the job at once (its
//! dataplane no longer holds it soon after) and can be removed. Then c,
//! the other member of b's old part's replica set, is killed: d serves
//! that part from its copy, and every element of every result of every
//! round stays exact (`train_rank` checks each against the formula). A
//! drain that cannot move a job (not replicated) is refused naming it,
//! and changes nothing. The second test drains b after it died (killed,
//! the job failed over without it): the spare replaces it, and the job is
//! back to full strength without b's return.

use std::time::Duration;

use crate::common::{
    all_trained, assert_async_sums, async_replicated_spec, hierarchical_replicated_spec, replicated_spec,
    replicated_table_spec, train_async_ranks, train_ranks, train_table_ranks, try_until, until, Appliances,
    Gates, Operator, Stopped,
};
use phub::proto::api::{JobDetail, Strength};
use phub::proto::routes::{control, mgmt};

/// The tests' training job: these keys, two workers, two replicas of
/// every chunk over a, b and c, trained this many rounds.
const KEYS: [u64; 3] = [5000, 3, 20_000];
const WORKERS: u16 = 2;
const ROUNDS: u32 = 16;

/// Admits the tests' training job (or another job like it) as `name`.
fn admit_job(rack: &Appliances, name: &str) -> phub::proto::api::AdmitResponse {
    rack.admit(&replicated_spec(name, WORKERS, &KEYS, &["a", "b", "c"], 2))
        .unwrap()
}

#[test]
fn a_drained_appliance_s_place_moves_to_a_spare_while_the_job_runs_exactly() {
    drain_b(false, false);
}

#[test]
fn a_dead_appliance_drained_is_replaced_by_a_spare_and_the_job_is_whole_again() {
    drain_b(true, false);
}

/// A hierarchical job (a rack of one rank each over a, b and c, PROTOCOL.md
/// §11.11) drained of b at epoch 0: the drain's epoch makes it flat over
/// the home layout, d takes b's index, and rank 1 (b's rack's) follows.
#[test]
fn a_hierarchical_job_s_drained_rack_appliance_moves_to_a_spare_and_the_job_goes_on_flat() {
    drain_b(false, true);
}

/// With `--spare-after-ms`, control moves the jobs of an appliance that
/// stays down to a spare by itself: b stopped (SIGSTOP: silent, as behind
/// a partition), nobody drains it, d takes its place; b resumed still
/// holds the job, and reconciliation removes it there (a spare took its
/// place); then c is killed and every round stays exact.
#[test]
fn an_appliance_down_past_spare_after_ms_is_replaced_by_a_spare_without_the_operator() {
    let mut rack = Appliances::start_with_control(&[1, 1, 1, 1], "256MiB", &[], &["--spare-after-ms", "300"]);
    let job = admit_job(&rack, "spare");
    let gates = Gates::new(&[4, 10], ROUNDS);
    let url = rack.control_url.clone();
    let more = |rank: u16, r: u32| gates.more(rank, r);
    std::thread::scope(|s| {
        let ranks = train_ranks(s, &url, &job, WORKERS, &KEYS, &more);
        gates.wait_at(0);
        let b_pid = rack.dataplanes[1].as_ref().unwrap().pid();
        let stopped = Stopped::new(b_pid);
        gates.open(0);
        let d = d_in_b_s_place(&rack, job.id);
        let epoch = rack.send(&control::epoch(job.id));
        assert_eq!((epoch.epoch, epoch.down.as_slice()), (2, &[][..]), "{epoch:?}");
        assert_eq!(epoch.moved_to(1).map(|m| m.name.as_str()), Some("d"));
        let x = d.replicas.and_then(|r| r.rereplication).unwrap();
        assert_eq!(x.replaced.as_deref(), Some("b"), "{x:?}");
        // b back: it answers heartbeats again, holding the job at epoch 0;
        // control removes it there and gives it nothing back.
        drop(stopped);
        until("b without the job", Duration::from_secs(20), || {
            rack.dataplane(1, &mgmt::jobs()).is_empty()
        });
        gates.wait_at(1);
        rack.kill_dataplane(2);
        gates.open(1);
        all_trained(ranks, ROUNDS);
    });
}

/// Drains b mid-training (after killing it and its failover when `dead`),
/// waits for d at full strength, removes b, kills c; every round exact.
/// `hierarchical`: the job is, with one rank per rack.
fn drain_b(dead: bool, hierarchical: bool) {
    let mut rack = Appliances::start(&[1, 1, 1, 1], "256MiB");
    let (job, workers) = if hierarchical {
        let spec = hierarchical_replicated_spec("drain", 3, &KEYS, &["a", "b", "c"], 2);
        (rack.admit(&spec).unwrap(), 3u16)
    } else {
        (admit_job(&rack, "drain"), WORKERS)
    };
    assert_eq!(job.appliances, ["a", "b", "c"]);
    // A job that cannot move (one copy of each chunk) on b: the drain is
    // refused naming it, nothing changed. Evicted before the real drain.
    let single = rack
        .admit(
            &phub::proto::spec::JobSpec::new("single", 1, &[64])
                .sharded_over(phub::proto::spec::Appliances::Names(vec!["b".into()]))
                .to_toml(),
        )
        .unwrap();
    let (ok, _out, err) = rack.phubctl(&["appliance", "drain", "b"]);
    assert!(!ok, "a drain with an unreplicated job on b went through");
    assert!(
        err.contains(&format!("job {} (\"single\") is not replicated", single.id))
            && err.contains("nothing was changed"),
        "{err}"
    );
    assert_eq!(rack.send(&control::epoch(job.id)).epoch, 0);
    rack.send(&control::evict(single.id));

    // Rank 0 waits before round 5 for the drain, before 11 for the kill.
    let gates = Gates::new(&[4, 10], ROUNDS);
    let url = rack.control_url.clone();
    let more = |rank: u16, r: u32| gates.more(rank, r);
    std::thread::scope(|s| {
        let ranks = train_ranks(s, &url, &job, workers, &KEYS, &more);
        gates.wait_at(0);
        if dead {
            rack.kill_dataplane(1);
            until("epoch 1 without b", Duration::from_secs(20), || {
                rack.send(&control::epoch(job.id)).down == [1]
            });
        }
        let moved_at = if dead { 2 } else { 1 };
        let (ok, out, err) = rack.phubctl(&["appliance", "drain", "b"]);
        assert!(ok, "{out}{err}");
        assert!(
            out.contains("drained appliance \"b\": 1 jobs moved")
                && out.contains(&format!("-> appliance \"d\" at epoch {moved_at}")),
            "{out}"
        );
        gates.open(0);
        // Drained, recorded with the appliance (a restarted control keeps it).
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(rack.dir.join("state.json")).unwrap()).unwrap();
        let b = state["appliances"]
            .as_array()
            .and_then(|l| l.iter().find(|a| a["name"] == "b"))
            .cloned()
            .unwrap_or_default();
        assert_eq!(b["draining"], true, "{state}");
        let epoch = rack.send(&control::epoch(job.id));
        assert_eq!(
            (epoch.epoch, epoch.joined_at(1), epoch.down.as_slice()),
            (moved_at, Some(moved_at), &[][..]),
            "{epoch:?}"
        );
        assert_eq!(epoch.moved_to(1).map(|m| m.name.as_str()), Some("d"));
        // d is filled while the rounds go on.
        d_in_b_s_place(&rack, job.id);
        // b holds nothing now: reconciliation removed the job there, and
        // control lets it go.
        if !dead {
            until("b without the job", Duration::from_secs(20), || {
                rack.dataplane(1, &mgmt::jobs()).is_empty()
            });
        }
        let (ok, out, err) = rack.phubctl(&["appliance", "remove", "b"]);
        assert!(ok, "{out}{err}");
        // c, the other member of b's old part's set, dies: d serves it.
        gates.wait_at(1);
        rack.kill_dataplane(2);
        gates.open(1);
        all_trained(ranks, ROUNDS);
    });
    // d completed every round of index 1's part, from the copy on.
    let stats: phub::proto::api::DataplaneStats = rack.dataplane(3, &mgmt::stats());
    let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
    assert_eq!(live.round_range.map(|r| r.1), Some(ROUNDS), "d: {live:?}");
}

/// A job with a table (PROTOCOL.md §11.9): b drained mid-training moves
/// to d, which gets the entries it backs up by state copies (b's own is
/// served by c meanwhile) while the ranks train; then c dies, and d
/// serves b's old entry from its copy: every row of every answer of every
/// round stays exact (`train_table_ranks` checks each).
#[test]
fn a_table_job_s_drained_appliance_moves_to_a_spare_and_every_row_stays_exact() {
    let mut rack = Appliances::start(&[1, 1, 1, 1], "256MiB");
    let job = rack
        .admit(&replicated_table_spec("table-drain", &["a", "b", "c"]))
        .unwrap();
    let rounds = 12u32;
    let gates = Gates::new(&[3, 8], rounds);
    let url = rack.control_url.clone();
    std::thread::scope(|s| {
        let ranks = train_table_ranks(s, &url, &job, &gates, rounds);
        gates.wait_at(0);
        let (ok, out, err) = rack.phubctl(&["appliance", "drain", "b"]);
        assert!(ok, "{out}{err}");
        assert!(out.contains("-> appliance \"d\" at epoch 1"), "{out}");
        gates.open(0);
        d_in_b_s_place(&rack, job.id);
        gates.wait_at(1);
        rack.kill_dataplane(2);
        gates.open(1);
        for h in ranks {
            h.join().unwrap();
        }
    });
    let epoch = rack.send(&control::epoch(job.id));
    assert_eq!((epoch.epoch, epoch.down.as_slice()), (2, &[2][..]), "{epoch:?}");
}

/// An async job (PROTOCOL.md §11.10): b drained mid-training moves to d,
/// which gets its chunks' state copies (with the ranks' clocks; no push
/// applied to a chunk while its copy runs) while the ranks push; then c
/// dies and d serves what it took: every element ends at rank 0's initial
/// value plus every push of every clock, exactly.
#[test]
fn an_async_job_s_drained_appliance_moves_to_a_spare_and_no_push_is_lost() {
    let mut rack = Appliances::start(&[1, 1, 1, 1], "256MiB");
    let job = rack
        .admit(&async_replicated_spec(
            "async-drain",
            WORKERS,
            &KEYS,
            &["a", "b", "c"],
        ))
        .unwrap();
    let gates = Gates::new(&[4, 10], ROUNDS);
    let url = rack.control_url.clone();
    let done = std::sync::Barrier::new(usize::from(WORKERS));
    let finals = std::thread::scope(|s| {
        let ranks = train_async_ranks(s, (&url, &job), WORKERS, &KEYS, &gates, &done);
        gates.wait_at(0);
        let (ok, out, err) = rack.phubctl(&["appliance", "drain", "b"]);
        assert!(ok, "{out}{err}");
        gates.open(0);
        d_in_b_s_place(&rack, job.id);
        gates.wait_at(1);
        rack.kill_dataplane(2);
        gates.open(1);
        ranks.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert_async_sums(&finals, WORKERS, ROUNDS);
    let epoch = rack.send(&control::epoch(job.id));
    assert_eq!(epoch.moved_to(1).map(|m| m.name.as_str()), Some("d"), "{epoch:?}");
}

/// Waits (30 s at most) for job `id` at full strength with d filled in
/// b's place (its re-replication to d ended), checks d is the job's second
/// appliance, and returns the job as control then shows it.
fn d_in_b_s_place(rack: &Appliances, id: u16) -> JobDetail {
    let d = d_filled(rack, id);
    assert_eq!(d.summary.appliances, ["a", "d", "c"]);
    d
}

/// Waits (30 s at most) for job `id` at full strength with d filled (its
/// re-replication to d ended); the job as control then shows it.
fn d_filled(rack: &Appliances, id: u16) -> JobDetail {
    let detail = || -> JobDetail { rack.send(&control::job(id)) };
    let full = || {
        detail().replicas.is_some_and(|r| {
            r.state == Strength::FullStrength
                && r.rereplication
                    .as_ref()
                    .is_some_and(|x| x.appliance == "d" && x.ended_unix_ms.is_some())
        })
    };
    if !try_until(Duration::from_secs(30), full) {
        panic!(
            "d not filled at full strength within 30 s: {:?}, epoch {:?}",
            detail().replicas,
            rack.send(&control::epoch(id))
        );
    }
    detail()
}

/// `phubctl job rebalance` while the job runs (PROTOCOL.md §11.8): a
/// second job, idle, loads a, b and c; d holds nothing. Rebalancing the
/// training job moves its part on a (the first of the most loaded) to d,
/// which is filled with state copies while the rounds go on; a second
/// rebalance then finds nothing to even. Then b (the backup of a's old
/// part, which d now serves) is killed: every round stays exact.
#[test]
fn a_rebalance_moves_a_part_to_an_idle_appliance_while_the_job_runs_exactly() {
    let mut rack = Appliances::start(&[1, 1, 1, 1], "256MiB");
    let job = admit_job(&rack, "rebalance");
    // Loads a, b and c; never trained.
    admit_job(&rack, "idle");
    let gates = Gates::new(&[4, 10], ROUNDS);
    let url = rack.control_url.clone();
    let more = |rank: u16, r: u32| gates.more(rank, r);
    std::thread::scope(|s| {
        let ranks = train_ranks(s, &url, &job, WORKERS, &KEYS, &more);
        gates.wait_at(0);
        let (ok, out, err) = rack.phubctl(&["job", "rebalance", &job.id.to_string()]);
        assert!(ok, "{out}{err}");
        assert!(
            out.contains(&format!(
                "job {}: part 0 moves from appliance \"a\" to \"d\" at epoch 1",
                job.id
            )),
            "{out}"
        );
        gates.open(0);
        assert_eq!(d_filled(&rack, job.id).summary.appliances, ["d", "b", "c"]);
        let (ok, out, err) = rack.phubctl(&["job", "rebalance", &job.id.to_string()]);
        assert!(ok && out.contains("balanced, nothing moved"), "{out}{err}");
        until("a without the job", Duration::from_secs(20), || {
            !rack.dataplane(0, &mgmt::jobs()).iter().any(|j| j.id == job.id)
        });
        gates.wait_at(1);
        rack.kill_dataplane(1);
        gates.open(1);
        all_trained(ranks, ROUNDS);
    });
}
