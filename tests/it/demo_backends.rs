//! `phub-demo` end to end on each backend, with tiny settings: DPDK
//! (net_af_packet over a veth pair in a namespace the demo makes and
//! removes; needs root, skips with the reason otherwise) and kernel UDP.
//! Each passes only if the demo's own check against the one-process
//! reference passes.

use std::process::Command;

fn demo(backend: &str) -> (bool, String) {
    demo_with(backend, &[])
}

fn demo_with(backend: &str, extra: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_phub-demo"))
        .args(["--backend", backend, "--workers", "2", "--lcores", "1"])
        .args(["--epochs", "1", "--samples", "512", "--hidden", "32"])
        .args(extra)
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

/// `DEMO_CONSISTENCY=ssp:1 make demo`, tiny: the job is admitted with
/// bounded delay 1 and trains with jittered compute; the demo says so,
/// shows the lead the appliance allowed (at most τ + 1) and the held
/// answers, and skips the BSP-only check.
#[test]
fn demo_trains_with_bounded_delay_when_asked() {
    let (ok, out) = demo_with(
        "udp",
        &[
            "--consistency",
            "ssp:1",
            "--compute-ms",
            "1",
            "--jitter",
            "exp:2",
            "--eval-every",
            "4",
        ],
    );
    assert!(ok, "{out}");
    assert!(out.contains("consistency: ssp:1, bounded delay τ = 1"), "{out}");
    assert!(
        out.contains("ssp:1: largest lead allowed 1 steps")
            || out.contains("ssp:1: largest lead allowed 2 steps"),
        "{out}"
    );
    assert!(out.contains("chunk answers held"), "{out}");
    assert!(out.contains("ssp:1: no single-process reference"), "{out}");
    assert!(out.contains("epoch 1: loss"), "{out}");
}
