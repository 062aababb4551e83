//! `phub-demo` end to end on each backend, with tiny settings: DPDK
//! (net_af_packet over a veth pair in a namespace the demo makes and
//! removes; needs root, skips with the reason otherwise) and kernel UDP.
//! Each passes only if the demo's own check against the one-process
//! reference passes.

use std::process::Command;

fn demo(backend: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_phub-demo"))
        .args(["--backend", backend, "--workers", "2", "--lcores", "1"])
        .args(["--epochs", "1", "--samples", "512", "--hidden", "32"])
        .output()
        .expect("running phub-demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn demo_trains_on_dpdk_in_a_namespace_and_removes_it() {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-demo --backend dpdk {why}");
        return;
    }
    let (ok, out) = demo("dpdk");
    assert!(ok, "{out}");
    assert!(
        out.contains("backend: DPDK (net_af_packet over a veth pair in namespace phub-demo-"),
        "{out}"
    );
    assert!(out.contains("result check passed on the DPDK backend"), "{out}");
    assert!(out.contains("appliance (dpdk)"), "{out}");
    let ns = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("namespace ")?.strip_suffix(" removed"))
        .unwrap_or_else(|| panic!("the demo names the namespace it removed: {out}"));
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(
        !list.lines().any(|l| l.split_whitespace().next() == Some(ns)),
        "{ns} is still there: {list}"
    );
}

#[test]
fn demo_trains_on_kernel_udp_when_asked() {
    let (ok, out) = demo("udp");
    assert!(ok, "{out}");
    assert!(
        out.contains("backend: kernel UDP on loopback (--backend udp)"),
        "{out}"
    );
    assert!(
        out.contains("result check passed on the kernel UDP backend"),
        "{out}"
    );
}
