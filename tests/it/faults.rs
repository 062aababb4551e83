//! Faults on the whole appliance (kernel UDP on loopback): a dataplane crash
//! recovered from a checkpoint, phub-control killed and restarted while
//! workers train, a worker killed mid-round that rejoins, and
//! the other job going on meanwhile; loss, duplication, reordering and
//! delay injected in the dataplane and in the workers. The scenario bodies are
//! `phub_hwtests::scenarios`, which `tests/it/dpdk_faults.rs` runs on the DPDK
//! backend too.

use std::sync::Mutex;

use crate::common::{Operator, Rack};
use phub_hwtests::scenarios::{self, Appliance};
use phub_worker::{FaultSpec, WorkerStats};

/// Loopback needs no namespace: the scenarios' threads stay where they are.
fn nowhere() {}

fn appliance<'a>(rack: &Rack, enter: &'a (dyn Fn() + Sync)) -> Appliance<'a> {
    Appliance {
        control_url: rack.control_url.clone(),
        mgmt_url: rack.mgmt_url.clone(),
        operator_token: Some(rack.operator_token()),
        enter,
    }
}

/// Packets the dataplane's injector lost, over its lcores.
fn injected_drops(run: &scenarios::FaultRun) -> u64 {
    run.dataplane.lcores.iter().map(|l| l.injected_drops).sum()
}

#[test]
fn dataplane_killed_and_restored_from_a_checkpoint() {
    let rack = Rack::start(2, "256MiB");
    let app = appliance(&rack, &nowhere);
    let rack = Mutex::new(rack);
    let kill = || rack.lock().unwrap().kill_dataplane();
    let start = || rack.lock().unwrap().start_dataplane();
    scenarios::checkpoint_and_restore(&app, &kill, &start);
}

#[test]
fn control_killed_and_restarted_mid_training() {
    let rack = Rack::start(2, "256MiB");
    let app = appliance(&rack, &nowhere);
    let rack = Mutex::new(rack);
    let kill = || rack.lock().unwrap().kill_control();
    let start = || rack.lock().unwrap().start_control();
    scenarios::control_killed_mid_training(&app, &kill, &start);
}

#[test]
fn a_killed_worker_stalls_only_its_job_and_rejoins() {
    let rack = Rack::start(2, "256MiB");
    scenarios::killed_worker_stalls_only_its_job(&appliance(&rack, &nowhere));
}

#[test]
fn loss_duplication_and_reordering_leave_the_result_exact() {
    for (i, loss) in ["0.01", "0.05", "0.2"].iter().enumerate() {
        let faults = format!("loss={loss},dup=0.02,reorder=0.02,seed={i}");
        let rack = Rack::start_with(2, "256MiB", &["--inject", &faults]);
        let run = scenarios::sgd_through_faults(&appliance(&rack, &nowhere), &faults, &[20_000, 3], 8, None);
        assert!(injected_drops(&run) > 0, "{faults}: the injector lost nothing");
        scenarios::assert_recovered(&faults, &run.dataplane, &run.phubctl);
        assert_eq!(
            run.workers.injected_drops, 0,
            "the workers inject nothing unless asked"
        );
    }
}

/// Loss in the workers' transport as well as in the dataplane: every
/// datagram is exposed to the loss rate twice on its way (once leaving,
/// once arriving), and training still ends exactly where the loss-free
/// computation does. Every run also delays 2% of datagrams by 3 ms on
/// both sides (a run this small delays only a few, or none: hence all three).
#[test]
fn faults_on_both_sides_leave_the_result_exact() {
    // Counters over the three runs: at 1% loss a run this small may lose
    // nothing on one side.
    let mut workers = WorkerStats::default();
    let (mut injected, mut resent, mut dups, mut delays) = (0, 0, 0, 0);
    for (i, loss) in ["0.01", "0.05", "0.2"].iter().enumerate() {
        let delay = "delay=0.02,delay_ms=3";
        let dataplane = format!("loss={loss},dup=0.02,reorder=0.02,{delay},seed={i}");
        let worker: FaultSpec = format!("loss={loss},dup=0.02,reorder=0.02,{delay},seed={}", 10 + i)
            .parse()
            .unwrap();
        let label = format!("dataplane {dataplane}, workers {worker}");
        let rack = Rack::start_with(2, "256MiB", &["--inject", &dataplane]);
        let t =
            scenarios::sgd_through_faults(&appliance(&rack, &nowhere), &label, &[12_000, 3], 5, Some(worker));
        assert_eq!(t.workers.timeouts, 0, "{label}");
        scenarios::add_worker_counts(&mut workers, &t.workers);
        let (i, r, d) = (
            injected_drops(&t),
            t.dataplane.lcores.iter().map(|l| l.results_resent).sum::<u64>(),
            scenarios::drops(&t.dataplane, "duplicate"),
        );
        eprintln!(
            "loss {loss} on both sides: dataplane {i} lost, {r} results resent, {d} duplicate drops; \
             workers {} lost, {} duplicated, {} reordered, {} retransmits",
            t.workers.injected_drops,
            t.workers.injected_dups,
            t.workers.injected_reorders,
            t.workers.retransmits
        );
        let dl: u64 = t.dataplane.lcores.iter().map(|l| l.injected_delays).sum();
        eprintln!("  delayed: dataplane {dl}, workers {}", t.workers.injected_delays);
        (injected, resent, dups, delays) = (injected + i, resent + r, dups + d, delays + dl);
        if *loss == "0.2" {
            // The dataplane and phubctl show the resent results and the
            // duplicate drops.
            scenarios::assert_recovered(&label, &t.dataplane, &t.phubctl);
        }
    }
    assert!(
        workers.injected_drops > 0
            && workers.injected_dups > 0
            && workers.injected_reorders > 0
            && workers.injected_delays > 0
            && workers.retransmits > 0,
        "workers: {workers:?}"
    );
    assert!(
        injected > 0 && resent > 0 && dups > 0 && delays > 0,
        "dataplane: {injected} lost, {resent} resent, {dups} duplicates, {delays} delayed"
    );
}
