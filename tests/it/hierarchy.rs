//! Hierarchical aggregation end to end on loopback (PROTOCOL.md §9): one
//! phub-dataplane per rack under one phub-control, workers on the
//! phub-worker library each talking to its rack's appliance only, the
//! appliances exchanging one partial sum and one result per chunk.

use crate::common;

use crate::common::{client, train, Appliances, Operator};
use phub::proto::api::{DataplaneStats, InstalledJob, JobDetail, JoinRequest};
use phub::proto::routes::{control, mgmt};
use phub::proto::spec::{Appliances as Placed, Consistency, JobSpec};
use phub_http::ClientError;

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

#[test]
fn two_racks_train_exactly_with_one_partial_per_chunk_and_round() {
    let rack = Appliances::start(&[2, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let job = rack
        .admit(
            &JobSpec::new("hier", 4, &keys)
                .hierarchical_over(Placed::named(&["a", "b"]))
                .to_toml(),
        )
        .unwrap();
    assert_eq!(job.appliances, ["a", "b"]);
    // 2048-element chunks: 3 + 1 + 10.
    assert_eq!(job.chunks, 14);

    // A worker that says the wrong rack is told which one its rank is in.
    let wrong = client(&rack.control_url, None).send(&control::join(
        job.id,
        &JoinRequest {
            token: job.token,
            rank: 0,
            rejoin: false,
            rack: Some("r2".into()),
        },
    ));
    match wrong {
        Err(ClientError::Api { status: 400, message }) => {
            assert!(
                message.contains("rack 0") && message.contains("ranks 0..2 on a"),
                "{message}"
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
        let stats: DataplaneStats = rack.dataplane(i, &mgmt::stats());
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
    let show: JobDetail = rack.send(&control::job(job.id));
    for (i, part) in show.parts.iter().enumerate() {
        let held: Vec<InstalledJob> = rack.dataplane(i, &mgmt::jobs());
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

/// The drops of `reason` over an appliance's lcores.
fn drops(stats: &DataplaneStats, reason: &str) -> u64 {
    stats.lcores.iter().filter_map(|l| l.drops.get(reason)).sum()
}

/// A PARTIAL forged with nothing but the job's token, which every worker
/// holds, is refused: a home appliance takes a rack's partial only from the
/// data address of that rack appliance's lcore holding the chunk
/// (PROTOCOL.md §9.4). Reproduction (issue 36, finding 3), on the code
/// before: two racks (appliances a, b), a 4-worker sum job; before any
/// worker sends, one datagram from an ordinary socket on 127.0.0.1 to the
/// lcore of b that is home to a chunk: a PARTIAL of round 0 naming rack 0,
/// the job's token, every element 1000. b added it as rack 0's partial;
/// a's real one was then `duplicate`, and every rank got 1000 back as rank
/// 0's initial values of that chunk (train panics at round 0), with no
/// counter naming it. Now it is counted `wrong_peer`, once, on b, and every
/// round is exact.
#[test]
fn a_partial_forged_with_the_jobs_token_is_wrong_peer_and_the_job_stays_exact() {
    let rack = Appliances::start(&[2, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let job = rack
        .admit(
            &JobSpec::new("hier", 4, &keys)
                .hierarchical_over(Placed::named(&["a", "b"]))
                .to_toml(),
        )
        .unwrap();
    let (port, forged) = phub_hwtests::workload::forged_partial(&rack.control_url, &job, "b", 1000.0);
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.send_to(&forged, ("127.0.0.1", port)).unwrap();
    // Handled, one way or the other, before any worker sends.
    let t = std::time::Instant::now();
    loop {
        let stats: DataplaneStats = rack.dataplane(1, &mgmt::stats());
        let taken: u64 = stats.lcores.iter().map(|l| l.pushes_aggregated).sum();
        if drops(&stats, "wrong_peer") + taken > 0 {
            break;
        }
        assert!(
            t.elapsed().as_secs() < 10,
            "the forged partial was not handled: {stats:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    train(&rack.control_url, &job, 4, &keys, 3);
    for (i, forged) in [(0, 0), (1, 1)] {
        let stats: DataplaneStats = rack.dataplane(i, &mgmt::stats());
        assert_eq!(drops(&stats, "wrong_peer"), forged, "appliance {i}: {stats:?}");
    }
}

#[test]
fn three_racks_train_exactly_under_loss_on_every_hop() {
    let faults = "loss=0.05,dup=0.02,reorder=0.02,seed=9";
    let rack = Appliances::start_with(&[1, 2, 1], "256MiB", &["--inject", faults]);
    let keys = [3000u64, 7, 9000];
    let job = rack
        .admit(
            &JobSpec::new("hier", 5, &keys)
                .hierarchical_over(Placed::Count(3))
                .with_ranks_per_rack(&[1, 3, 1])
                .to_toml(),
        )
        .unwrap();
    assert_eq!(job.appliances, ["a", "b", "c"]);
    train(&rack.control_url, &job, 5, &keys, 5);
    let mut resent = 0;
    for i in 0..3 {
        let stats: DataplaneStats = rack.dataplane(i, &mgmt::stats());
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
        .admit(
            &JobSpec::new("hier", 2, &[10])
                .hierarchical_over(Placed::Count(1))
                .to_toml(),
        )
        .unwrap_err();
    assert!(e.0 == 400 && e.1.contains("2 or more appliances"), "{e:?}");
    let e = rack
        .admit(
            &JobSpec::new("hier", 2, &[10])
                .hierarchical_over(Placed::Count(2))
                .with_consistency(Consistency::Async)
                .to_toml(),
        )
        .unwrap_err();
    assert!(e.0 == 400 && e.1.contains("BSP"), "{e:?}");
    let e = rack
        .admit(
            &JobSpec::new("hier", 1, &[10])
                .hierarchical_over(Placed::Count(2))
                .to_toml(),
        )
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
        .admit(
            &JobSpec::new("hier", 4, &keys)
                .hierarchical_over(Placed::named(&["a", "b"]))
                .to_toml(),
        )
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
                let stats: DataplaneStats = rack.dataplane(kill, &mgmt::stats());
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
        let stats: DataplaneStats = rack.dataplane(i, &mgmt::stats());
        let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
        assert_eq!(live.round_range, Some((7, 7)), "appliance {i}");
    }
}

/// An Adam job over three racks (hierarchical) and the same job on one
/// appliance, side by side, with the same workers' gradients and 5% loss,
/// duplicates and reordering injected on every appliance (both hops): after
/// every round each rank's parameters from the two are equal bit for bit.
/// The gradients are small integers, whose f32 sums do not depend on the
/// order of the additions, so the optimizer sees the same sum either way.
#[test]
fn an_adam_job_over_racks_equals_one_appliance_bit_for_bit_under_loss() {
    let faults = "loss=0.05,dup=0.02,reorder=0.02,seed=4";
    let rack = Appliances::start_with(&[1, 2, 1], "256MiB", &["--inject", faults]);
    let keys = [5000u64, 3, 2500];
    let mut base = "name = \"adam\"\nworkers = 4\n[optimizer]\nkind = \"adam\"\nlr = 0.01\n".to_string();
    for k in keys {
        base += &format!("[[keys]]\nelements = {k}\n");
    }
    let hier = rack
        .admit(&format!(
            "{base}[placement]\nappliances = 3\nhierarchical = true\n"
        ))
        .unwrap();
    let one = rack
        .admit(&format!("{base}[placement]\nappliances = [\"b\"]\n"))
        .unwrap();
    let url = rack.control_url.clone();
    std::thread::scope(|s| {
        for rank in 0..4u16 {
            let (url, hier, one, keys) = (&url, &hier, &one, &keys);
            s.spawn(move || {
                let cfg = phub_worker::WorkerConfig::default;
                let join = |job: &phub::proto::api::AdmitResponse| {
                    phub_worker::Worker::join_with(url, job.id, job.token, rank, cfg()).unwrap()
                };
                let (wh, wo) = (join(hier), join(one));
                let start = |k: usize, n: u64| -> Vec<f32> {
                    (0..n as usize)
                        .map(|e| if rank == 0 { common::init(k as u32, e) } else { 0.0 })
                        .collect()
                };
                let mut ph: Vec<Vec<f32>> = keys.iter().enumerate().map(|(k, &n)| start(k, n)).collect();
                let mut po = ph.clone();
                for (k, (a, b)) in ph.iter_mut().zip(po.iter_mut()).enumerate() {
                    wh.wait(wh.init(k as u32, a).unwrap()).unwrap();
                    wo.wait(wo.init(k as u32, b).unwrap()).unwrap();
                }
                for round in 1..=5u32 {
                    for (k, (a, b)) in ph.iter_mut().zip(po.iter_mut()).enumerate() {
                        let g: Vec<f32> = (0..a.len())
                            .map(|e| common::grad(rank, k as u32, e, round))
                            .collect();
                        wh.wait(wh.push_pull(k as u32, &g, a).unwrap()).unwrap();
                        wo.wait(wo.push_pull(k as u32, &g, b).unwrap()).unwrap();
                        let differ = a
                            .iter()
                            .zip(b.iter())
                            .position(|(x, y)| x.to_bits() != y.to_bits());
                        assert_eq!(
                            differ, None,
                            "rank {rank} round {round} key {k}: not one appliance's result"
                        );
                    }
                }
            });
        }
    });
}
