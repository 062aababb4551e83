//! A replicated job (PROTOCOL.md §11) over appliances on loopback: two
//! phub-dataplane processes under one phub-control, each the primary of
//! its part of the chunks and the backup of the other's; workers on the
//! phub-worker library train it and check every result exactly, and the
//! dataplanes' counters show every round of every chunk replicated.

use crate::common::{replicated_spec, train, Appliances, Operator};
use phub::proto::api::{DataplaneStats, JobDetail};
use phub::proto::routes::{control, mgmt};

#[test]
fn a_job_with_two_replicas_over_two_appliances_trains_exactly_and_replicates_every_round() {
    // Unequal appliances: a's part is cut over b's one lcore and b's over
    // a's two (PROTOCOL.md §11.2).
    let rack = Appliances::start(&[2, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let job = rack
        .admit(&replicated_spec("replicated", 3, &keys, &["a", "b"], 2))
        .unwrap();
    assert_eq!(job.appliances, ["a", "b"]);
    // 2048-element chunks: 3 + 1 + 10.
    assert_eq!(job.chunks, 14);
    let rounds = 6;
    // Every element of every result is checked (train_rank).
    train(&rack.control_url, &job, 3, &keys, rounds);

    let show: JobDetail = rack.send(&control::job(job.id));
    let chunks: Vec<u64> = show.parts.iter().map(|p| p.chunks.1 - p.chunks.0).collect();
    assert_eq!(chunks.iter().sum::<u64>(), 14, "{chunks:?}");
    assert!(chunks.iter().all(|&c| c > 0), "{chunks:?}");
    let stats: Vec<DataplaneStats> = (0..2).map(|i| rack.dataplane(i, &mgmt::stats())).collect();
    let sum = |i: usize, f: fn(&phub::proto::api::LcoreStats) -> u64| -> u64 {
        stats[i].lcores.iter().map(f).sum()
    };
    for i in 0..2 {
        let other = 1 - i;
        let name = &rack.names[i];
        // Round 0 (the initial values) and rounds 1..=6 of each chunk this
        // appliance is primary of were completed here only once the other
        // acknowledged them; the other applied each once.
        let replicated = chunks[i] * u64::from(rounds + 1);
        assert_eq!(
            sum(i, |l| l.rounds_replicated),
            replicated,
            "{name}: {:?}",
            stats[i].lcores
        );
        assert!(
            sum(i, |l| l.replicates_sent) >= replicated,
            "{name}: {:?}",
            stats[i].lcores
        );
        assert_eq!(
            sum(other, |l| l.replicate_acks_sent),
            replicated,
            "{}: {:?}",
            rack.names[other],
            stats[other].lcores
        );
        let live = stats[i].jobs.iter().find(|j| j.id == job.id).unwrap();
        assert_eq!(live.round_range, Some((rounds, rounds)), "{name}: {live:?}");
        // Nothing refused: no replication message of another epoch, peer
        // or slot.
        for l in &stats[i].lcores {
            for reason in ["wrong_epoch", "wrong_peer", "chunk_mismatch", "slot_out_of_range"] {
                assert_eq!(
                    l.drops.get(reason),
                    None,
                    "{name} lcore {}: {:?}",
                    l.lcore,
                    l.drops
                );
            }
        }
    }
    // Each appliance is charged its backup slots as primary slots: the
    // job costs about twice what it costs without replicas.
    let replicated: u64 = show.parts.iter().map(|p| p.memory_bytes).sum();
    let again = rack
        .admit(
            &replicated_spec("replicated", 3, &keys, &["a", "b"], 1).replace("\"replicated\"", "\"plain\""),
        )
        .unwrap();
    let plain: JobDetail = rack.send(&control::job(again.id));
    let plain: u64 = plain.parts.iter().map(|p| p.memory_bytes).sum();
    assert!(
        2 * replicated > 3 * plain,
        "replicated {replicated}, plain {plain}"
    );
}

#[test]
fn a_job_with_more_replicas_than_appliances_is_refused_naming_the_field() {
    let rack = Appliances::start(&[1, 1], "64MiB");
    let (status, message) = rack
        .admit(&replicated_spec("replicated", 2, &[100], &["a", "b"], 3))
        .unwrap_err();
    assert_eq!(status, 400, "{message}");
    assert!(
        message.contains("placement.replicas")
            && message.contains("= 3")
            && message.contains("appliance count (2"),
        "{message}"
    );
    // Nothing was installed anywhere.
    for i in 0..2 {
        let jobs: Vec<phub::proto::api::InstalledJob> = rack.dataplane(i, &mgmt::jobs());
        assert!(jobs.is_empty(), "{}: {jobs:?}", rack.names[i]);
    }
}
