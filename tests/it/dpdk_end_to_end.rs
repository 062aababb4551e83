//! The whole appliance on DPDK: phub-dataplane `--backend dpdk` on
//! net_af_packet over a veth pair in a private network namespace, with
//! phub-control, and real workers (the phub-worker library over kernel UDP)
//! on the other end of the veth. The same scenarios as the kernel-UDP
//! end-to-end tests: exact sums over several keys and rounds with 3
//! workers under a flood of bad input counted by reason; then a clean
//! SIGTERM shutdown that leaves nothing behind. Skips (printing why) where
//! it cannot run: without root.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use phub::proto::api::Stats;
use phub::proto::routes::control;
use phub_hwtests::virt::{Link, VirtualRack, APPLIANCE_IP, BASE_PORT};
use phub_hwtests::workload::{admit, client, flood, sum_spec, train};

#[test]
fn dpdk_three_workers_keys_and_rounds_under_a_flood_then_a_clean_shutdown() {
    let mut rack = match VirtualRack::start("e2e", 2, "", "") {
        Ok(r) => r,
        Err(why) => {
            println!("SKIPPED: DPDK whole-system test: {why}");
            return;
        }
    };
    let url = rack.control_url();
    let token = rack.operator_token();
    let keys = [200_000u64, 1, 4097];
    let spec = sum_spec("dpdk", 3, None, &keys);
    let flooded = rack.inside(|| {
        let job = admit(&url, token.as_deref(), &spec);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let f = s.spawn(|| flood(&stop, APPLIANCE_IP, BASE_PORT, 2));
            train(&url, &job, 3, &keys, 8);
            stop.store(true, Ordering::Relaxed);
            f.join().unwrap()
        })
    });
    std::thread::sleep(Duration::from_millis(300));
    let stats: Stats = rack.inside(|| client(&url, None).send(&control::stats()).unwrap());
    let d = stats.dataplane.expect("dataplane stats");
    assert_eq!(d.backend, phub_proto::api::BackendKind::Dpdk);
    let drops: u64 = d.lcores.iter().flat_map(|l| l.drops.values()).sum();
    let bad_token: u64 = d.lcores.iter().filter_map(|l| l.drops.get("bad_token")).sum();
    let rx: u64 = d.lcores.iter().map(|l| l.rx_packets).sum();
    println!(
        "flood {flooded}, drops {drops}, rx {rx}, misrouted {}, arp {}, port {:?}",
        d.lcores.iter().map(|l| l.misrouted).sum::<u64>(),
        d.lcores.iter().map(|l| l.arp_replies).sum::<u64>(),
        d.port
    );
    assert!(flooded > 100, "the flood sent {flooded}");
    assert!(
        drops >= flooded,
        "{drops} drops counted for {flooded} bad datagrams"
    );
    assert!(bad_token > 0, "no bad_token drops: {:?}", d.lcores[0].drops);
    assert!(
        d.lcores.iter().map(|l| l.arp_replies).sum::<u64>() >= 1,
        "the dataplane answered ARP"
    );
    let port = d.port.expect("the DPDK port's own counters");
    assert!(port.ipackets >= rx && port.opackets > 0, "{port:?}");
    let (ok, out, _) = rack.phubctl(&["stats"]);
    assert!(ok && out.contains("bad_token"), "{out}");

    let prefix = rack.ns.name.clone();
    let ns = rack.ns.name.clone();
    let (clean, log) = rack.stop_dataplane();
    assert!(clean, "phub-dataplane did not exit cleanly on SIGTERM:\n{log}");
    assert!(
        log.contains("stopped and closed") && log.contains("EAL released"),
        "{log}"
    );
    assert!(
        !std::path::Path::new(&format!("/var/run/dpdk/{prefix}")).exists(),
        "EAL runtime files left behind"
    );
    drop(rack);
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains(&ns),
        "namespace {ns} left behind"
    );
}

#[test]
fn dpdk_two_jobs_at_once_neither_disturbs_the_other() {
    let rack = match VirtualRack::start("twojobs", 2, "", "") {
        Ok(r) => r,
        Err(why) => {
            println!("SKIPPED: DPDK whole-system test: {why}");
            return;
        }
    };
    let url = rack.control_url();
    let token = rack.operator_token();
    let (ka, kb) = ([5000u64, 3], [7000u64]);
    rack.inside(|| {
        let a = admit(&url, token.as_deref(), &sum_spec("a", 2, None, &ka));
        let b = admit(&url, token.as_deref(), &sum_spec("b", 3, Some(1024), &kb));
        assert_ne!(a.id, b.id);
        std::thread::scope(|s| {
            s.spawn(|| train(&url, &a, 2, &ka, 6));
            s.spawn(|| train(&url, &b, 3, &kb, 6));
        });
    });
    let d = rack.stats();
    assert_eq!(d.jobs.len(), 2);
    assert!(
        d.jobs.iter().all(|j| j.round_range == Some((6, 6))),
        "{:?}",
        d.jobs
    );
}

/// Datagrams the calling thread's network namespace dropped for a bad
/// checksum: IPv4 `InHdrErrors` (a bad header checksum lands there) and UDP
/// `InCsumErrors`.
fn checksum_errors() -> u64 {
    let snmp = std::fs::read_to_string("/proc/thread-self/net/snmp").expect("reading snmp");
    let counter = |proto: &str, name: &str| -> u64 {
        let mut rows = snmp.lines().filter(|l| l.starts_with(proto));
        let (names, values) = (rows.next().unwrap(), rows.next().unwrap());
        let at = names
            .split_whitespace()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no {proto} {name} counter"));
        values.split_whitespace().nth(at).unwrap().parse().unwrap()
    };
    counter("Ip: ", "InHdrErrors") + counter("Udp: ", "InCsumErrors")
}

/// On a port that fills in checksums (net_tap, whose driver does DPDK's
/// IPv4 and UDP TX checksum offloads), results leave with the fields for
/// the port to finish and the lcore copies them without summing; the
/// workers' kernel, which verifies both checksums of every datagram the
/// tap hands it, takes every result (exact sums, no checksum errors;
/// results sent with those fields but without asking the port dropped
/// them all, and the workers timed out). The same with
/// `--software-tx-checksums`, where the lcore sums them. 1 KiB chunks:
/// net_tap takes frames of MTU 1504 at most.
#[test]
fn dpdk_results_are_right_where_the_port_fills_in_their_checksums() {
    for (args, said) in [
        ("", "filled in by the port (TX checksum offload)"),
        (
            "--software-tx-checksums",
            "summed by the lcores (--software-tx-checksums)",
        ),
    ] {
        let rack = match VirtualRack::start_on("tapsum", 1, Link::Tap, args, "") {
            Ok(r) => r,
            Err(why) => {
                println!("SKIPPED: DPDK tap test: {why}");
                return;
            }
        };
        let url = rack.control_url();
        let token = rack.operator_token();
        let keys = [30_000u64, 3];
        let errors = rack.inside(|| {
            let before = checksum_errors();
            let job = admit(&url, token.as_deref(), &sum_spec("tap", 2, Some(1024), &keys));
            train(&url, &job, 2, &keys, 4);
            checksum_errors() - before
        });
        let log = std::fs::read_to_string(&rack.log).unwrap_or_default();
        assert!(
            log.contains(said),
            "{args:?}: the log does not say {said:?}:\n{log}"
        );
        assert_eq!(errors, 0, "{args:?}: results dropped for bad checksums");
        let d = rack.stats();
        assert!(d.lcores[0].results_sent > 0, "{:?}", d.lcores[0]);
    }
}
