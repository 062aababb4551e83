//! `phub-bench run --local --backend dpdk`: the virtual rack's network (a
//! namespace with a veth pair), the dataplane on DPDK's af_packet driver,
//! the emulated workers inside the namespace, every result verified, and
//! the veth ceilings (dpdk-testpmd 5tswap, which echoes every frame back to
//! the senders, the bound; and rxonly) with the efficiency against each in
//! the JSON. Needs root and dpdk-testpmd; skips with the reason otherwise.
//! No timed assertions: figures are only checked to be present, finite and
//! positive.

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
fn dpdk_run_verifies_and_states_its_efficiency_against_the_veth_ceilings() {
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
    assert_eq!(v["efficiency_bound"], "testpmd-5tswap", "{text}");
    let positive = |key: &str, x: &serde_json::Value| {
        let f = x
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {x} is not a number\n{text}"));
        assert!(f.is_finite() && f > 0.0, "{key}: {f}\n{text}");
    };
    positive("efficiency", &v["efficiency"]);
    positive("efficiency_rxonly", &v["efficiency_rxonly"]);
    // The bound: testpmd echoed the senders' frames back and they counted them.
    let e = &v["veth_echo_ceiling"];
    assert_eq!(e["mode"], "5tswap", "{e}");
    for key in ["payload_gbps", "testpmd_rx_gbps", "returned_gbps"] {
        positive(key, &e[key]);
    }
    assert_eq!(e["payload_gbps"], e["returned_gbps"], "{e}");
    assert!(e["rx_packets"].as_u64().unwrap() > 0, "{e}");
    assert!(e["tx_packets"].as_u64().unwrap() > 0, "{e}");
    assert!(e["returned_datagrams"].as_u64().unwrap() > 0, "{e}");
    assert!(
        e["testpmd"].as_str().unwrap().contains("--forward-mode=5tswap"),
        "{e}"
    );
    // The second figure: testpmd only received.
    let c = &v["veth_ceiling"];
    assert_eq!(c["mode"], "rxonly", "{c}");
    positive("payload_gbps", &c["payload_gbps"]);
    positive("testpmd_rx_gbps", &c["testpmd_rx_gbps"]);
    assert!(c["rx_packets"].as_u64().unwrap() > 0, "{c}");
    assert!(c["returned_datagrams"].is_null(), "{c}");
    assert!(
        c["testpmd"].as_str().unwrap().contains("--forward-mode=rxonly"),
        "{c}"
    );
    // Both printed in the run's summary lines.
    assert!(
        text.contains("5tswap") && text.contains("efficiency_rxonly"),
        "{text}"
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
    // Both testpmds stopped and their EAL runtime directories removed.
    for mode in ["rxonly", "5tswap"] {
        let dir = format!("/var/run/dpdk/{ns}-testpmd-{mode}");
        assert!(!std::path::Path::new(&dir).exists(), "{dir} is still there");
    }
    let prefix = format!("{ns}-testpmd");
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        assert!(
            !(cmdline.contains("dpdk-testpmd") && cmdline.contains(&prefix)),
            "a testpmd of this run is still running: {cmdline}"
        );
    }
}
