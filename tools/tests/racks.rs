//! `phub-bench run --local --racks 2`: two virtual racks (a namespace per
//! rack with its workers, one per rack appliance on kernel UDP, a spine
//! namespace between the racks' uplinks), a job sharded flat over both
//! appliances, every result verified, the bytes that crossed the spine read
//! from the spine's interfaces and checked against what flat sharding must
//! carry, and nothing left behind. Needs root; skips with the reason
//! otherwise.

mod common;

use std::process::Command;

use serde_json::Value;

/// Every namespace the run named `phub-*-PID` for its process `pid`.
fn leftovers(pid: u32) -> Vec<String> {
    let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("phub-") && n.ends_with(&format!("-{pid}")))
        .map(String::from)
        .collect()
}

/// Runs `phub-bench run --local` with `args` and `--verify --quiet
/// --no-pin`; its JSON, output, and the namespaces it left behind.
fn bench(tag: &str, args: &[&str]) -> (Value, String, Vec<String>) {
    let args: Vec<&str> = args
        .iter()
        .copied()
        .chain(["--verify", "--quiet", "--no-pin"])
        .collect();
    let (v, text, pid) = common::run_local(&format!("racks-{tag}"), &args);
    (v, text, leftovers(pid))
}

#[test]
fn two_virtual_racks_flat_verify_and_count_the_spine_bytes() {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-bench run --local --racks {why}");
        return;
    }
    let (workers, racks, model_bytes) = (2.0, 2.0, 400_000.0);
    let (v, text, left) = bench(
        "flat",
        &[
            "--racks",
            "2",
            "--flat",
            "--model",
            "synthetic:100000",
            "--workers",
            "2",
            "--rounds",
            "10",
        ],
    );
    assert_eq!(v["verified"], true, "{text}");
    assert_eq!(v["mismatches"], 0);
    assert_eq!(v["racks"], 2, "{v}");
    assert_eq!(v["appliances"], 2, "{v}");
    assert_eq!(v["mode"], "flat", "{v}");
    assert_eq!(v["workers_per_rack"], serde_json::json!([1, 1]), "{v}");
    assert!(v["round_ms_median"].as_f64().unwrap() > 0.0, "{v}");
    // Flat: each worker sends the (R-1)/R of its chunks whose home is in
    // the other rack across the spine and gets their results back the
    // same way: 2W(R-1)/R model bytes per round, plus the frames' headers
    // (about 2% for 8 KiB chunks), retransmissions and control's few
    // management requests. Nothing across the spine fails the lower bound.
    let flat = 2.0 * workers * (racks - 1.0) / racks * model_bytes;
    let crossed = v["cross_rack_bytes_per_round"]
        .as_f64()
        .unwrap_or_else(|| panic!("cross_rack_bytes_per_round: {v}"));
    assert!(
        (0.95 * flat..=1.4 * flat).contains(&crossed),
        "{crossed} bytes crossed the spine per round; flat carries {flat} plus headers\n{text}"
    );
    assert!(text.contains("crossed the spine per round"), "{text}");
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    let qdiscs = Command::new("tc").args(["qdisc", "show"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&qdiscs.stdout).contains("tbf"),
        "a tbf qdisc was left in the root namespace"
    );
}

#[test]
fn two_virtual_racks_hierarchical_verify_and_carry_one_partial_per_chunk() {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-bench run --local --racks --hierarchical {why}");
        return;
    }
    let (workers, racks, model_bytes): (f64, f64, f64) = (6.0, 2.0, 400_000.0);
    let (v, text, left) = bench(
        "hier",
        &[
            "--racks",
            "2",
            "--hierarchical",
            "--model",
            "synthetic:100000",
            "--workers",
            "6",
            "--rounds",
            "10",
        ],
    );
    assert_eq!(v["verified"], true, "{text}");
    assert_eq!(v["mode"], "hierarchical", "{v}");
    assert_eq!(v["workers_per_rack"], serde_json::json!([3, 3]), "{v}");
    // One partial up and one result down per chunk for the rack that is
    // not the chunk's home: 2(R-1) model bytes per round whatever W/R is,
    // plus headers, where flat carries 2W(R-1)/R (6 model bytes here).
    // Partials and their results resent on a timer add to it, by how the
    // machine keeps time (PROTOCOL.md 9), so the upper bound is only
    // "well below flat".
    let hier = 2.0 * (racks - 1.0) * model_bytes;
    let flat = 2.0 * workers * (racks - 1.0) / racks * model_bytes;
    let crossed = v["cross_rack_bytes_per_round"]
        .as_f64()
        .unwrap_or_else(|| panic!("cross_rack_bytes_per_round: {v}"));
    assert!(
        (0.95 * hier..=0.7 * flat).contains(&crossed),
        "{crossed} bytes crossed the spine per round; hierarchical carries {hier} plus headers, \
         flat {flat}\n{text}"
    );
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

#[test]
fn three_virtual_racks_hierarchical_stay_exact_with_loss_on_the_spine() {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-bench run --local --racks 3 --spine-loss {why}");
        return;
    }
    let (v, text, left) = bench(
        "loss",
        &[
            "--racks",
            "3",
            "--hierarchical",
            "--spine-loss",
            "5",
            "--model",
            "synthetic:100000",
            "--workers",
            "3",
            "--rounds",
            "10",
        ],
    );
    // Every partial and result lost on the spine was sent again: every
    // element of every round is still the exact sum.
    assert_eq!(v["verified"], true, "{text}");
    assert_eq!(v["mode"], "hierarchical", "{v}");
    assert_eq!(v["spine_loss_pct"], 5, "{v}");
    assert!(
        v["spine_dropped"].as_u64().unwrap_or(0) > 0,
        "the spine dropped nothing: {v}"
    );
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}
