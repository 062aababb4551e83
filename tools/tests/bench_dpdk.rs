//! `phub-bench run --local --backend dpdk`: the virtual rack's network (a
//! namespace with a veth pair), the dataplane on DPDK's af_packet driver,
//! the emulated workers inside the namespace, every result verified, and
//! the veth ceiling (dpdk-testpmd rxonly, same senders) with the efficiency
//! against it in the JSON. Needs root and dpdk-testpmd; skips with the
//! reason otherwise. No timed assertions: figures are only checked to be
//! present and positive.

mod common;

use std::process::Command;

fn skip_reason() -> Option<String> {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        return Some(why);
    }
    let testpmd = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("dpdk-testpmd").is_file()));
    (!testpmd).then(|| "needs dpdk-testpmd (Debian: dpdk-dev; tools/setup.sh installs it)".to_string())
}

#[test]
fn dpdk_run_verifies_and_states_its_efficiency_against_the_veth_ceiling() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: phub-bench run --local --backend dpdk {why}");
        return;
    }
    let (v, text, pid) = common::run_local(
        "dpdk",
        &[
            "--backend",
            "dpdk",
            "--model",
            "synthetic:100000",
            "--workers",
            "2",
            "--rounds",
            "3",
            "--verify",
            "--quiet",
            "--ceiling-secs",
            "1",
        ],
    );
    let ns = format!("phub-bench-{pid}");
    assert_eq!(v["backend"], "dpdk", "{v}");
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["mismatches"], 0);
    assert_eq!(
        v["efficiency_bound"], "veth -> dpdk-testpmd rxonly, same senders, same run",
        "{text}"
    );
    let eff = v["efficiency"]
        .as_f64()
        .unwrap_or_else(|| panic!("efficiency: {v}"));
    assert!(eff > 0.0, "{eff}");
    let c = &v["veth_ceiling"];
    assert!(c["payload_gbps"].as_f64().unwrap() > 0.0, "{c}");
    assert!(c["rx_packets"].as_u64().unwrap() > 0, "{c}");
    assert!(
        c["testpmd"].as_str().unwrap().contains("--forward-mode=rxonly"),
        "{c}"
    );
    // The appliance saw both workers' pushes of the timed rounds.
    assert!(
        v["appliance"]["rx_bytes"].as_u64().unwrap() >= 2 * 3 * 400_000,
        "{v}"
    );
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(
        !list
            .lines()
            .any(|l| l.split_whitespace().next() == Some(ns.as_str())),
        "{ns} is still there: {list}"
    );
}
