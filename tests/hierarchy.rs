//! Hierarchical aggregation end to end on loopback (PROTOCOL.md §9): one
//! phub-dataplane per rack under one phub-control, workers on the
//! phub-worker library each talking to its rack's appliance only, the
//! appliances exchanging one partial sum and one result per chunk.

mod common;

use common::{train, Appliances};
use phub::proto::api::{DataplaneStats, InstalledJob, JobDetail, JoinRequest};

fn totals(stats: &DataplaneStats) -> (u64, u64, u64, u64) {
    stats.lcores.iter().fold((0, 0, 0, 0), |t, l| {
        (
            t.0 + l.partials_sent,
            t.1 + l.partials_resent,
            t.2 + l.partial_results_sent,
            t.3 + l.rounds_completed,
        )
    })
}

fn spec(workers: u32, keys: &[u64], placement: &str) -> String {
    let mut spec = format!("name = \"hier\"\nworkers = {workers}\n[optimizer]\nkind = \"sum\"\n");
    for k in keys {
        spec += &format!("[[keys]]\nelements = {k}\n");
    }
    spec + "[placement]\n" + placement
}

#[test]
fn two_racks_train_exactly_with_one_partial_per_chunk_and_round() {
    let rack = Appliances::start(&[2, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let job = rack
        .admit(&spec(
            4,
            &keys,
            "appliances = [\"a\", \"b\"]\nhierarchical = true\n",
        ))
        .unwrap();
    assert_eq!(job.appliances, ["a", "b"]);
    // 2048-element chunks: 3 + 1 + 10.
    assert_eq!(job.chunks, 14);

    // A worker that says the wrong rack is told which one its rank is in.
    let url = format!("{}/v1/jobs/{}/join", rack.control_url, job.id);
    let wrong = ureq::post(&url).send_json(JoinRequest {
        token: job.token,
        rank: 0,
        rejoin: false,
        rack: Some("r2".into()),
    });
    match wrong {
        Err(ureq::Error::Status(400, r)) => {
            let body = r.into_string().unwrap();
            assert!(
                body.contains("rack 0") && body.contains("ranks 0..2 on a"),
                "{body}"
            );
        }
        other => panic!("a join from the wrong rack was not refused: {other:?}"),
    }

    // Ranks 0, 1 on rack a, 2, 3 on rack b; exact sums every round.
    train(&rack.control_url, &job, 4, &keys, 6);

    // Each appliance forwarded one partial per chunk and round (rounds 0
    // to 6), and, as home of its share of the chunks, ran the rounds of
    // those alone.
    let mut optimizer_runs = 0;
    for i in 0..2 {
        let stats: DataplaneStats = rack.dataplane_get(i, "/v1/stats");
        let (partials, _, results, rounds) = totals(&stats);
        assert_eq!(partials, 7 * 14, "appliance {i}: {stats:?}");
        assert!(results > 0 && rounds > 0, "appliance {i} is home to some chunks");
        assert_eq!(
            results,
            2 * rounds,
            "appliance {i}: one result per rack per optimizer run"
        );
        optimizer_runs += rounds;
        let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
        assert_eq!(live.round_range, Some((6, 6)), "appliance {i}");
    }
    assert_eq!(
        optimizer_runs,
        7 * 14,
        "one optimizer run per chunk and round over both homes"
    );

    // Admission charged each appliance exactly what it holds: rack slots,
    // home slots, pending-partial records and peers.
    let show: JobDetail = rack.get(&format!("/v1/jobs/{}", job.id));
    for (i, part) in show.parts.iter().enumerate() {
        let held: Vec<InstalledJob> = rack.dataplane_get(i, "/v1/jobs");
        assert_eq!(
            held[0].memory_bytes, part.memory_bytes,
            "appliance {}",
            part.appliance
        );
    }

    let (ok, out, err) = rack.phubctl(&["job", "show", &job.id.to_string()]);
    assert!(ok, "{err}");
    assert!(
        out.contains("hierarchical:") && out.contains("r1 (ranks 0..2)") && out.contains("r2 (ranks 2..4)"),
        "{out}"
    );
}

#[test]
fn three_racks_train_exactly_under_loss_on_every_hop() {
    let faults = "loss=0.05,dup=0.02,reorder=0.02,seed=9";
    let rack = Appliances::start_with(&[1, 2, 1], "256MiB", &["--inject", faults]);
    let keys = [3000u64, 7, 9000];
    let job = rack
        .admit(&spec(
            5,
            &keys,
            "appliances = 3\nhierarchical = true\nranks_per_rack = [1, 3, 1]\n",
        ))
        .unwrap();
    assert_eq!(job.appliances, ["a", "b", "c"]);
    train(&rack.control_url, &job, 5, &keys, 5);
    let mut resent = 0;
    for i in 0..3 {
        let stats: DataplaneStats = rack.dataplane_get(i, "/v1/stats");
        let (partials, again, _, _) = totals(&stats);
        assert_eq!(partials, 6 * job.chunks, "appliance {i}: first sends only");
        resent += again;
    }
    assert!(resent > 0, "5% loss made no partial go again");
}

#[test]
fn a_hierarchical_job_needs_one_appliance_per_rack_and_bsp() {
    let rack = Appliances::start(&[1, 1], "64MiB");
    let e = rack
        .admit(&spec(2, &[10], "appliances = 1\nhierarchical = true\n"))
        .unwrap_err();
    assert!(e.0 == 400 && e.1.contains("2 or more appliances"), "{e:?}");
    let e = rack
        .admit(
            &(spec(2, &[10], "appliances = 2\nhierarchical = true\n") + "[consistency]\nmode = \"async\"\n"),
        )
        .unwrap_err();
    assert!(e.0 == 400 && e.1.contains("BSP"), "{e:?}");
    let e = rack
        .admit(&spec(1, &[10], "appliances = 2\nhierarchical = true\n"))
        .unwrap_err();
    assert!(e.0 == 400 && e.1.contains("one worker per rack"), "{e:?}");
}

/// Both appliances of a two-rack job are each killed between rounds, after
/// a checkpoint (each is the home of some chunks and the rack appliance of
/// two workers): the job stalls, `job show` names the appliance down,
/// control reinstalls it from its checkpoint when it is back, and the job
/// finishes exactly.
#[test]
fn an_appliance_killed_between_rounds_is_restored_and_the_job_finishes_exactly() {
    use std::sync::Barrier;
    let mut rack = Appliances::start(&[2, 1], "256MiB");
    let keys = [4000u64, 5, 9000];
    let job = rack
        .admit(&spec(
            4,
            &keys,
            "appliances = [\"a\", \"b\"]\nhierarchical = true\n",
        ))
        .unwrap();
    let (paused, resume) = (Barrier::new(5), Barrier::new(5));
    let control_url = rack.control_url.clone();
    std::thread::scope(|s| {
        for rank in 0..4u16 {
            let (url, job, keys) = (&control_url, &job, &keys);
            let (paused, resume) = (&paused, &resume);
            s.spawn(move || {
                let cfg = phub_worker::WorkerConfig::default();
                phub_hwtests::workload::train_rank(url, job.id, job.token, rank, 4, keys, cfg, |r| {
                    if r == 3 || r == 5 {
                        paused.wait();
                        resume.wait();
                    }
                    r <= 7
                });
            });
        }
        for (kill, round) in [(1usize, 2u32), (0, 4)] {
            paused.wait();
            let (ok, _, err) = rack.phubctl(&["job", "checkpoint", &job.id.to_string()]);
            assert!(ok, "{err}");
            rack.kill_dataplane(kill);
            let (ok, out, err) = rack.phubctl(&["job", "show", &job.id.to_string()]);
            assert!(ok, "{err}");
            assert!(out.contains("DOWN ("), "{out}");
            rack.start_dataplane(kill);
            let t = std::time::Instant::now();
            loop {
                let stats: DataplaneStats = rack.dataplane_get(kill, "/v1/stats");
                if let Some(live) = stats.jobs.iter().find(|j| j.id == job.id) {
                    assert_eq!(
                        live.round_range,
                        Some((round, round)),
                        "restored from its checkpoint"
                    );
                    break;
                }
                assert!(t.elapsed().as_secs() < 20, "appliance {kill} not reinstalled");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            resume.wait();
        }
    });
    for i in 0..2 {
        let stats: DataplaneStats = rack.dataplane_get(i, "/v1/stats");
        let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
        assert_eq!(live.round_range, Some((7, 7)), "appliance {i}");
    }
}
