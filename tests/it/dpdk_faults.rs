//! Issue 6's fault scenarios on the DPDK backend: phub-dataplane `--backend
//! dpdk` on net_af_packet over a veth pair in a private network namespace
//! (the virtual rack, `phub_hwtests::virt`), phub-control beside it, real
//! workers over kernel UDP on the other end. The scenario bodies are
//! `phub_hwtests::scenarios`, shared with the kernel-UDP tests: loss,
//! duplication and reordering injected per lcore queue in both directions
//! (`--inject`) and by a netem qdisc on the veth; a dataplane killed with
//! SIGKILL and restored from a checkpoint; phub-control killed and restarted
//! while workers train; a killed worker that stalls only
//! its own job and rejoins; another tenant's forged datagrams. Skips
//! (printing why) where it cannot run: without root.

use std::path::Path;
use std::sync::Mutex;

use phub_hwtests::scenarios::{self, Appliance};
use phub_hwtests::virt::VirtualRack;
use phub_hwtests::workload::{admit, sum_spec, train};

/// The virtual rack, or `None` after printing why the test is skipped.
fn rack(tag: &str, tx_qdisc: bool, dataplane: &str) -> Option<VirtualRack> {
    match VirtualRack::start_with(tag, 2, tx_qdisc, dataplane, "") {
        Ok(r) => Some(r),
        Err(why) => {
            println!("SKIPPED: DPDK fault test {tag}: {why}");
            None
        }
    }
}

fn appliance<'a>(rack: &VirtualRack, enter: &'a (dyn Fn() + Sync)) -> Appliance<'a> {
    Appliance {
        control_url: rack.control_url(),
        mgmt_url: rack.mgmt_url(),
        operator_token: rack.operator_token(),
        enter,
    }
}

#[test]
fn dpdk_loss_duplication_and_reordering_leave_the_result_exact() {
    for (i, loss) in ["0.01", "0.05", "0.2"].iter().enumerate() {
        let faults = format!("loss={loss},dup=0.02,reorder=0.02,delay=0.02,delay_ms=3,seed={i}");
        let Some(rack) = rack(&format!("inject{i}"), false, &format!("--inject {faults}")) else {
            return;
        };
        let enter = rack.enterer();
        let app = appliance(&rack, &enter);
        let (d, phubctl) = scenarios::sgd_exact_through_faults(&app, &faults, &[50_000, 1, 4097], 8);
        assert_eq!(d.backend, phub_proto::api::BackendKind::Dpdk);
        let injected: u64 = d.lcores.iter().map(|l| l.injected_drops).sum();
        let dups: u64 = d.lcores.iter().map(|l| l.injected_dups).sum();
        let reorders: u64 = d.lcores.iter().map(|l| l.injected_reorders).sum();
        let delays: u64 = d.lcores.iter().map(|l| l.injected_delays).sum();
        println!(
            "{faults}: injected {injected} losses, {dups} duplicates, {reorders} reorders, {delays} delays; \
             {} results resent, \
             {} duplicates dropped",
            d.lcores.iter().map(|l| l.results_resent).sum::<u64>(),
            scenarios::drops(&d, "duplicate")
        );
        assert!(
            injected > 0 && dups > 0 && reorders > 0 && delays > 0,
            "{faults}: the injector did nothing on DPDK: {injected} lost, {dups} duplicated, {reorders} reordered, \
             {delays} delayed"
        );
        scenarios::assert_recovered(&faults, &d, &phubctl);
    }
}

#[test]
fn dpdk_netem_on_the_veth_leaves_the_result_exact() {
    // qdisc_bypass=0: the appliance's own packets pass dpv1's qdisc too.
    let Some(rack) = rack("netem", true, "") else {
        return;
    };
    let enter = rack.enterer();
    let app = appliance(&rack, &enter);
    // First, that a qdisc on dpv1 sees what the appliance sends (DPDK's
    // af_packet bypasses it by default); pfifo exists in every kernel.
    rack.qdisc("dpv1", "pfifo limit 10000")
        .unwrap_or_else(|e| panic!("a pfifo qdisc on dpv1: {e}"));
    let before = rack.tx_qdisc_packets().unwrap();
    let keys = [3000u64];
    app.run(|| {
        let job = admit(
            &app.control_url,
            app.operator_token.as_deref(),
            &sum_spec("probe", 1, None, &keys),
        );
        train(&app.control_url, &job, 1, &keys, 2);
    });
    let sent = rack.tx_qdisc_packets().unwrap() - before;
    assert!(
        sent >= 6,
        "dpv1's qdisc saw {sent} packets: the appliance's results bypass it"
    );

    let spec = "loss 5% duplicate 1% reorder 25% 50% delay 1ms";
    if let Err(e) = rack.netem(spec) {
        if e.contains("qdisc kind is unknown") {
            println!("SKIPPED (netem part; dpv1's qdisc path checked): no sch_netem in this kernel: {e}");
            return;
        }
        if e.contains("No such file") {
            println!("SKIPPED (netem part; dpv1's qdisc path checked): needs tc: {e}");
            return;
        }
        panic!("netem {spec}: {e}");
    }
    let label = format!("netem {spec} on dpv0 and dpv1");
    let (d, phubctl) = scenarios::sgd_exact_through_faults(&app, &label, &[50_000, 1, 4097], 8);
    scenarios::assert_recovered(&label, &d, &phubctl);
}

#[test]
fn dpdk_dataplane_killed_and_restored_from_a_checkpoint() {
    let Some(rack) = rack("ckpt", false, "") else {
        return;
    };
    let prefix = rack.ns.name.clone();
    let enter = rack.enterer();
    let app = appliance(&rack, &enter);
    let rack = Mutex::new(rack);
    let kill = || {
        rack.lock().unwrap().kill_dataplane();
        // --no-huge --no-shconf: a crash leaves no hugepage file and no
        // shared config for the next start to trip on.
        let runtime = Path::new("/var/run/dpdk").join(&prefix);
        let left: Vec<_> = std::fs::read_dir(&runtime)
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
            .unwrap_or_default();
        println!("after SIGKILL, {} holds {left:?}", runtime.display());
        let huge: Vec<_> = std::fs::read_dir("/dev/hugepages")
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default();
        assert!(huge.is_empty(), "hugepage files left by the crash: {huge:?}");
    };
    let start = || rack.lock().unwrap().start_dataplane();
    scenarios::checkpoint_and_restore(&app, &kill, &start);
    let mut rack = rack.into_inner().unwrap();
    let (clean, log) = rack.stop_dataplane();
    assert!(clean, "the restarted dataplane did not exit cleanly:\n{log}");
    assert!(
        !Path::new("/var/run/dpdk").join(&prefix).exists(),
        "EAL runtime files left behind by the restarted dataplane"
    );
}

#[test]
fn dpdk_control_killed_and_restarted_mid_training() {
    let Some(rack) = rack("ctlkill", false, "") else {
        return;
    };
    let enter = rack.enterer();
    let app = appliance(&rack, &enter);
    let rack = Mutex::new(rack);
    let kill = || rack.lock().unwrap().kill_control();
    let start = || rack.lock().unwrap().start_control();
    scenarios::control_killed_mid_training(&app, &kill, &start);
}

#[test]
fn dpdk_a_killed_worker_stalls_only_its_job_and_rejoins() {
    let Some(rack) = rack("deadrank", false, "") else {
        return;
    };
    let enter = rack.enterer();
    scenarios::killed_worker_stalls_only_its_job(&appliance(&rack, &enter));
}

#[test]
fn dpdk_another_tenant_never_changes_a_victims_parameters() {
    let Some(rack) = rack("tenant", false, "") else {
        return;
    };
    let enter = rack.enterer();
    scenarios::tenant_isolation(&appliance(&rack, &enter));
}
