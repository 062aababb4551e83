//! A job sharded over two appliances on loopback: two phub-dataplane
//! processes under one phub-control, workers on the phub-worker library
//! sending each chunk to its home appliance, phubctl as the operator.

use std::time::Duration;

use crate::common::{train, until, Appliances, Operator};
use phub::proto::api::{DataplaneStats, InstalledJob, JobDetail, JobMap};
use phub::proto::routes::{control, mgmt};

#[test]
fn a_job_over_two_appliances_trains_exactly_and_each_holds_only_its_part() {
    let mut rack = Appliances::start(&[2, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let mut spec = "name = \"sharded\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n".to_string();
    for k in keys {
        spec += &format!("[[keys]]\nelements = {k}\n");
    }
    spec += "[placement]\nappliances = [\"a\", \"b\"]\n";
    let job = rack.admit(&spec).unwrap();
    assert_eq!(job.appliances, ["a", "b"]);
    // 2048-element chunks: 3 + 1 + 10.
    assert_eq!(job.chunks, 14);

    // Exact sums every round (train checks every element of every key).
    train(&rack.control_url, &job, 2, &keys, 6);

    // Each appliance holds the job, and only its share of the chunks.
    let show: JobDetail = rack.send(&control::job(job.id));
    let shares: Vec<(String, u64)> = show
        .parts
        .iter()
        .map(|p| (p.appliance.clone(), p.chunks.1 - p.chunks.0))
        .collect();
    assert_eq!(shares.iter().map(|s| s.1).sum::<u64>(), 14, "{shares:?}");
    assert!(shares.iter().all(|s| s.1 > 0), "{shares:?}");
    for (i, (name, chunks)) in shares.iter().enumerate() {
        assert_eq!(name, &rack.names[i]);
        let installed: Vec<InstalledJob> = rack.dataplane(i, &mgmt::jobs());
        assert_eq!(installed.iter().map(|j| j.id).collect::<Vec<_>>(), [job.id]);
        let stats: DataplaneStats = rack.dataplane(i, &mgmt::stats());
        let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
        // Each of its chunks ran rounds 1..=6 (round 0 is the initial
        // broadcast), and no other chunk did here.
        assert_eq!(live.rounds_completed % chunks, 0, "{name}: {live:?}");
        let per_chunk = live.rounds_completed / chunks;
        assert!(per_chunk >= 6, "{name}: {live:?}");
        assert_eq!(live.round_range, Some((6, 6)), "{name}");
        let rx: u64 = stats.lcores.iter().map(|l| l.rx_packets).sum();
        assert!(rx > 0, "{name} received nothing");
        assert_eq!(show.parts[i].rounds_completed, live.rounds_completed);
    }
    assert!(show.summary.installed);
    assert_eq!(show.round_range, Some((6, 6)));

    // phubctl: the map names each lcore's appliance, the list both.
    let map: JobMap = rack.send(&control::map(job.id, None));
    assert_eq!(map.lcores.iter().map(|l| l.slots).sum::<u64>(), 14);
    let (ok, out, err) = rack.phubctl(&["map", "show", &job.id.to_string(), "--key", "2"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("APPLIANCE") && out.contains("of 2 appliances"),
        "{out}"
    );
    let (ok, out, err) = rack.phubctl(&["appliance", "list"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("r1") && out.contains("r2") && out.contains(" up"),
        "{out}"
    );
    let (ok, _, err) = rack.phubctl(&["appliance", "remove", "b"]);
    assert!(!ok && err.contains("holds jobs 1"), "{err}");

    // Appliance b dies: job show names it; back, it gets its part again
    // from its checkpoint.
    let (ok, _, err) = rack.phubctl(&["job", "checkpoint", &job.id.to_string()]);
    assert!(ok, "{err}");
    rack.kill_dataplane(1);
    let (ok, out, err) = rack.phubctl(&["job", "show", &job.id.to_string()]);
    assert!(ok, "{err}");
    assert!(out.contains("DOWN (") && out.contains("installed"), "{out}");
    rack.start_dataplane(1);
    until("b's part reinstalled", Duration::from_secs(20), || {
        let installed: Vec<InstalledJob> = rack.dataplane(1, &mgmt::jobs());
        installed.iter().any(|j| j.id == job.id)
    });
    let stats: DataplaneStats = rack.dataplane(1, &mgmt::stats());
    let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
    assert_eq!(live.round_range, Some((6, 6)), "restored from its checkpoint");
}
