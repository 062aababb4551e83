//! Workers on the appliance's host through shared memory (PROTOCOL.md
//! §3.4): real phub-dataplane (`--shm`) and phub-control processes on
//! loopback, workers on the phub-worker library passing chunks and results
//! through `/dev/shm` and sending headers only. Every result is checked
//! exactly; the dataplane's `shm_rx` counter shows the messages came
//! through shared memory.

use std::sync::Mutex;

use crate::common::{Operator, Rack};
use phub::proto::api::{AdmitResponse, Stats};
use phub::proto::routes::control;
use phub::proto::spec::JobSpec;
use phub::proto::Dtype;
use phub_hwtests::scenarios::{self, Appliance};
use phub_hwtests::workload::{sum_spec, train_rank};
use phub_worker::{ShmMode, Worker, WorkerConfig, WorkerError, WorkerStats};

fn with(shm: ShmMode) -> WorkerConfig {
    WorkerConfig {
        shm,
        timeout: std::time::Duration::from_secs(20),
        ..WorkerConfig::default()
    }
}

/// Trains `rounds` rounds of a sum job with one config per rank, checking
/// every element; returns each rank's counters.
fn train(
    rack: &Rack,
    job: &AdmitResponse,
    keys: &[u64],
    rounds: u32,
    configs: &[WorkerConfig],
) -> Vec<WorkerStats> {
    let w = configs.len() as u16;
    std::thread::scope(|s| {
        let hs: Vec<_> = configs
            .iter()
            .enumerate()
            .map(|(rank, cfg)| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    train_rank(
                        &rack.control_url,
                        job.id,
                        job.token,
                        rank as u16,
                        w,
                        keys,
                        cfg,
                        |r| r <= rounds,
                    )
                    .1
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Messages the dataplane took from shared memory, over its lcores.
fn shm_rx(rack: &Rack) -> u64 {
    let stats: Stats = rack.send(&control::stats());
    stats
        .dataplane
        .expect("dataplane stats")
        .lcores
        .iter()
        .map(|l| l.shm_rx)
        .sum()
}

#[test]
fn two_workers_sum_exactly_through_shared_memory() {
    let rack = Rack::start_with(2, "256MiB", &["--shm"]);
    let keys = [100_000u64, 3, 4097];
    let job = rack.admit(&sum_spec("shm", 2, None, &keys)).unwrap();
    let stats = train(&rack, &job, &keys, 6, &[with(ShmMode::On), with(ShmMode::On)]);
    for (rank, s) in stats.iter().enumerate() {
        assert!(s.shm, "rank {rank}: {s:?}");
        assert_eq!(
            s.shm_results, s.results_accepted,
            "rank {rank}: every result from shared memory"
        );
        // Headers only: 86 bytes per datagram sent (chunks, their resends,
        // and the probes of an lcore that seemed silent: a run in .ci/run
        // probed 4 and sent 4 x 86 bytes more than chunks and resends).
        assert_eq!(
            s.bytes_sent,
            (s.chunks_sent + s.retransmits + s.lcores_probed) * 86,
            "rank {rank}: {s:?}"
        );
    }
    assert!(shm_rx(&rack) >= stats.iter().map(|s| s.chunks_sent).sum::<u64>());
}

/// A 16-bit job, one rank through shared memory and one with datagrams:
/// messages of both kinds mix in every round, results exact.
#[test]
fn f16_job_mixes_shared_memory_and_datagrams() {
    let rack = Rack::start_with(1, "256MiB", &["--shm"]);
    let keys = [20_000u64, 5];
    let spec = JobSpec::new("shm-f16", 2, &keys).with_dtype(Dtype::F16).to_toml();
    let job = rack.admit(&spec).unwrap();
    let stats = train(&rack, &job, &keys, 5, &[with(ShmMode::On), with(ShmMode::Off)]);
    assert!(
        stats[0].shm && stats[0].shm_results == stats[0].results_accepted,
        "{:?}",
        stats[0]
    );
    assert!(!stats[1].shm && stats[1].shm_results == 0, "{:?}", stats[1]);
    assert!(shm_rx(&rack) > 0);
}

/// Loss, duplication and reordering injected in both workers' header
/// datagrams: retransmissions carry headers only, the staging regions still
/// hold the round's chunks, and the sums stay exact.
#[test]
fn injected_faults_leave_shared_memory_results_exact() {
    let rack = Rack::start_with(2, "256MiB", &["--shm"]);
    let keys = [50_000u64, 7];
    let job = rack.admit(&sum_spec("shm-loss", 2, None, &keys)).unwrap();
    let configs: Vec<WorkerConfig> = (0..2)
        .map(|i| WorkerConfig {
            inject: Some(
                format!("loss=0.05,dup=0.02,reorder=0.02,seed={i}")
                    .parse()
                    .unwrap(),
            ),
            ..with(ShmMode::On)
        })
        .collect();
    let stats = train(&rack, &job, &keys, 8, &configs);
    for s in &stats {
        assert!(
            s.shm && s.injected_drops > 0 && s.retransmits > 0 && s.timeouts == 0,
            "{s:?}"
        );
    }
}

/// A dataplane without `--shm`: `Auto` (the default) falls back to
/// datagrams and stays exact; `On` fails the join, naming the region.
#[test]
fn without_shm_auto_falls_back_and_on_refuses_to_join() {
    let rack = Rack::start(1, "256MiB");
    let keys = [30_000u64, 2];
    let job = rack.admit(&sum_spec("no-shm", 2, None, &keys)).unwrap();
    let stats = train(&rack, &job, &keys, 3, &[with(ShmMode::Auto), with(ShmMode::Auto)]);
    assert!(stats.iter().all(|s| !s.shm && s.shm_results == 0), "{stats:?}");
    assert_eq!(shm_rx(&rack), 0);
    // (Rank 0 joined above: it takes its place again, as a restarted worker.)
    let e = Worker::rejoin(&rack.control_url, job.id, job.token, 0, with(ShmMode::On)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, WorkerError::SharedMemory { .. }), "{e:?}");
    assert!(
        msg.contains("/dev/shm/phub-") && msg.contains("No such file") && msg.contains("--shm"),
        "{msg}"
    );
}

/// The dataplane is killed and restarted (with `--shm`) mid-training and
/// control restores the job from a checkpoint: the regions are made anew,
/// the workers (shared memory by default) map the new ones, resynchronise
/// and end exactly where a run that never crashed ends.
#[test]
fn a_restarted_dataplanes_new_regions_are_mapped() {
    let rack = Rack::start_with(2, "256MiB", &["--shm"]);
    let app = Appliance {
        control_url: rack.control_url.clone(),
        mgmt_url: rack.mgmt_url.clone(),
        operator_token: Some(rack.operator_token()),
        enter: &|| {},
    };
    let rack = Mutex::new(rack);
    let kill = || rack.lock().unwrap().kill_dataplane();
    let start = || rack.lock().unwrap().start_dataplane();
    scenarios::checkpoint_and_restore(&app, &kill, &start);
    // The restarted dataplane's counters: the rounds after the restart came
    // through shared memory.
    assert!(shm_rx(&rack.lock().unwrap()) > 0);
}
