//! `phub-bench run --local --racks 2`: two virtual racks (a namespace per
//! rack with its workers, one per rack appliance on kernel UDP or DPDK, a spine
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

/// `--backend dpdk`: each rack appliance runs DPDK's af_packet driver on
/// its link, holding the data address while the kernel keeps the
/// management one, and sends every frame to the rack switch. A replicated
/// job over two racks fails over when rack 2's appliance is killed, every
/// result verified, nothing repeated or lost, nothing left behind.
#[test]
fn two_virtual_racks_on_dpdk_fail_over_exactly() {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-bench run --local --racks --backend dpdk {why}");
        return;
    }
    let (v, text, left) = bench(
        "dpdk",
        &[
            "--racks",
            "2",
            "--backend",
            "dpdk",
            "--replicas",
            "2",
            "--kill-appliance",
            "rack2",
            "--kill-at-round",
            "3",
            "--model",
            "synthetic:100000",
            "--workers",
            "2",
            "--rounds",
            "8",
        ],
    );
    assert_eq!(v["verified"], true, "{text}");
    assert_eq!(v["backend"], "dpdk", "{v}");
    assert_eq!(
        (&v["rounds_repeated"], &v["rounds_lost"]),
        (&0.into(), &0.into()),
        "{v}"
    );
    assert_eq!(
        v["epoch_after"],
        serde_json::json!({ "epoch": 1, "down": [1] }),
        "{v}"
    );
    assert!(v["failover_ms"].as_f64().is_some_and(|f| f > 0.0), "{v}");
    // Only a DPDK port sees the frames of the kernel's management
    // address beside its own, and counts them under this reason.
    let foreign = v["appliance"]["drops_by_reason"]["not_our_address"].as_u64();
    assert!(foreign.is_some_and(|n| n > 0), "{v}");
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

/// `phub-bench torch`'s racks: every rank in a namespace of its own behind
/// a tbf-limited link to its rack's switch. A rank reaches a rank of the
/// other rack across the spine, and the bytes are counted on the spine and
/// on both ranks' links, not on the others'.
#[test]
fn ranks_with_links_of_their_own_reach_across_the_spine_and_are_counted() {
    use phub_tools::bench::racks::{worker_ip, RackNet};
    use std::net::UdpSocket;
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-bench torch's racks {why}");
        return;
    }
    let me = std::process::id();
    let mut net = RackNet::create(2, None, None, 50.0).unwrap();
    net.add_workers(&[0, 0, 1, 1], Some(0.1), 50.0).unwrap();
    let names: Vec<String> = net.workers.iter().map(|n| n.name.clone()).collect();
    let qdisc = Command::new("tc")
        .args(["-n", &names[2], "qdisc", "show", "dev", "nic"])
        .output()
        .unwrap();
    let qdisc = String::from_utf8_lossy(&qdisc.stdout);
    assert!(qdisc.contains("tbf") && qdisc.contains("100Mbit"), "{qdisc}");
    let (spine0, links0) = (net.spine_rx_bytes().unwrap(), net.worker_link_bytes().unwrap());
    let (n, len) = (200usize, 1000usize);
    let rx_ns = names[3].clone();
    let to = format!("{}:5000", worker_ip(3));
    let receiver = std::thread::spawn(move || {
        phub_hwtests::virt::try_enter_netns(&rx_ns).unwrap();
        let s = UdpSocket::bind(format!("{}:5000", worker_ip(3))).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut buf = vec![0u8; 2048];
        (0..n).map(|_| s.recv(&mut buf).unwrap()).sum::<usize>()
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    let tx_ns = names[0].clone();
    std::thread::spawn(move || {
        phub_hwtests::virt::try_enter_netns(&tx_ns).unwrap();
        let s = UdpSocket::bind(format!("{}:0", worker_ip(0))).unwrap();
        let payload = vec![7u8; len];
        for _ in 0..n {
            s.send_to(&payload, &to).unwrap();
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    })
    .join()
    .unwrap();
    assert_eq!(receiver.join().unwrap(), n * len);
    let spine = net.spine_rx_bytes().unwrap() - spine0;
    let links: Vec<u64> = net
        .worker_link_bytes()
        .unwrap()
        .iter()
        .zip(&links0)
        .map(|(b, a)| b - a)
        .collect();
    let sent = (n * len) as u64;
    assert!(
        (sent..sent * 2).contains(&spine),
        "{spine} bytes entered the spine for {sent}"
    );
    for r in [0, 3] {
        assert!((sent..sent * 2).contains(&links[r]), "rank {r}'s link: {links:?}");
    }
    for r in [1, 2] {
        assert!(links[r] < 1000, "rank {r} carried what was not for it: {links:?}");
    }
    drop(net);
    assert!(
        leftovers(me).is_empty(),
        "namespaces left behind: {:?}",
        leftovers(me)
    );
}

/// `phub-bench torch --racks 2 --workers 4 ...` with `stub_rank.py` (no
/// torch) in place of the rank script: whether it succeeded, its JSON and
/// output, and the namespaces it left behind.
fn torch_stub(fail_rank: Option<usize>) -> (bool, Value, String, Vec<String>) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/stub_rank.py");
    let args = [
        "torch",
        "--model",
        "synthetic:100000",
        "--trials",
        "3",
        "--warmup",
        "1",
        "--python",
        "/usr/bin/python3",
        "--script",
        script,
        "--timeout-s",
        "120",
    ];
    let fail = fail_rank.map(|r| r.to_string());
    let env: Vec<(&str, &str)> = fail.iter().map(|r| ("STUB_FAIL_RANK", r.as_str())).collect();
    let (ok, v, text, pid) =
        common::bench_json(&format!("torch-{}", fail.as_deref().unwrap_or("ok")), &args, &env);
    (ok, v, text, leftovers(pid))
}

/// Why the torch stub tests cannot run here, if they cannot.
fn torch_stub_unavailable() -> Option<String> {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        return Some(why);
    }
    (!std::path::Path::new("/usr/bin/python3").exists()).then(|| "needs /usr/bin/python3".to_string())
}

/// The orchestration of `phub-bench torch` without torch: the ranks start
/// in their namespaces, rank 0's marks are answered, the bytes each step
/// moved are counted on the spine and the ranks' links between them, each
/// mode's step is its slowest rank's median, and everything is removed.
#[test]
fn torch_counts_each_steps_bytes_between_rank_0s_marks() {
    if let Some(why) = torch_stub_unavailable() {
        eprintln!("skipped: phub-bench torch {why}");
        return;
    }
    let (ok, v, text, left) = torch_stub(None);
    assert!(ok, "{text}");
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    assert_eq!(v["workers_per_rack"], serde_json::json!([2, 2]), "{v}");
    assert_eq!(v["spine_gbps"], 1.0, "{v}");
    assert_eq!(v["appliance_gbps"], 2.0, "{v}");
    let close = |x: &Value, want: f64| (x.as_f64().unwrap() - want).abs() < 1e-9;
    assert!(close(&v["baseline_step_ms"], 1.0), "{v}");
    // Modes in order none, gloo, flat, hierarchical: steps of 2, 3, 4 ms
    // and 200, 300, 400 datagrams of 1000 bytes from rack 1 to rack 2.
    for (i, mode) in ["gloo", "flat", "hierarchical"].iter().enumerate() {
        let m = &v["modes"][mode];
        let n = 100.0 * (i as f64 + 2.0);
        assert!(close(&m["step_ms_median"], i as f64 + 2.0), "{mode}: {m}");
        assert!(close(&m["exchange_ms"], i as f64 + 1.0), "{mode}: {m}");
        let spine = m["spine_bytes_per_step"].as_f64().unwrap();
        assert!(
            (n * 1000.0..n * 2000.0).contains(&spine),
            "{mode}: {spine} bytes entered the spine per step for {n} datagrams\n{text}"
        );
        // Rank 0's link and the last rank's carried them; the mean of four.
        let link = m["worker_link_bytes_per_step"].as_f64().unwrap();
        assert!((n * 1000.0 / 2.0..n * 2000.0).contains(&link), "{mode}: {link}");
    }
    assert!(close(&v["modes"]["flat"]["speedup_vs_gloo"], 2.0 / 3.0), "{v}");
    assert!(close(&v["speedup_vs_gloo"], 2.0 / 4.0), "{v}");
    assert!(text.contains("hierarchical"), "{text}");
}

/// A rank that dies stops the run with its name and the ranks' logs, and
/// nothing is left behind.
#[test]
fn torch_stops_naming_a_rank_that_exited() {
    if let Some(why) = torch_stub_unavailable() {
        eprintln!("skipped: phub-bench torch {why}");
        return;
    }
    let (ok, _, text, left) = torch_stub(Some(1));
    assert!(!ok, "{text}");
    assert!(text.contains("rank 1 exited (exit status: 3)"), "{text}");
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

/// `phub-bench sparse --local --racks 3`: a table's rows over three racks'
/// appliances, with one copy and with two. Both verify every row every
/// rank read back; with two copies every round's rows also go to each
/// entry's backup on another rack before any rank is answered, so more
/// crosses the spine: at least the rows a step stores anew, once.
#[test]
fn a_table_over_three_virtual_racks_verifies_with_one_copy_and_with_two() {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-bench sparse --local --racks {why}");
        return;
    }
    let run = |replicas: &str| {
        sparse_on_three_racks(
            &format!("sparse-racks-{replicas}"),
            &["--replicas", replicas, "--steps", "20"],
        )
    };
    let (one, two) = (run("1"), run("2"));
    let spine = |v: &Value| v["cross_rack_bytes_per_step"].as_f64().unwrap();
    // The same draws both times: the same rows stored.
    assert_eq!(one["rows_stored"], two["rows_stored"]);
    // Every row stored went to its backup (id and 8 f32, 40 bytes) in at
    // least one of the 23 steps: half of that is well past what resends
    // alone could add.
    let stored = two["rows_stored"].as_f64().unwrap();
    assert!(
        spine(&two) - spine(&one) > stored * 40.0 / 23.0 / 2.0,
        "replicas 2 moved {} bytes a step across the spine, replicas 1 {}: {two}",
        spine(&two),
        spine(&one)
    );
}

/// `phub-bench sparse --local --racks 3 --replicas 2 --kill-appliance
/// --restart-after-ms`: rack 2's appliance killed mid-run; its entries
/// fail over to their backups, it is started again empty and given its
/// tables by state copies while the ranks train, and every rank's rows of
/// every step, those around the kill and the copies included, are still
/// the reference's (a round lost or applied twice would change them).
#[test]
fn a_table_s_appliance_killed_over_three_virtual_racks_fails_over_and_comes_back_exactly() {
    if let Some(why) = phub_hwtests::virt::unavailable() {
        eprintln!("skipped: phub-bench sparse --local --racks --kill-appliance {why}");
        return;
    }
    let v = sparse_on_three_racks(
        "sparse-racks-kill",
        &[
            "--replicas",
            "2",
            // Steps enough to outlast the failover (the heartbeat
            // deadline, 500 ms), the restart and the copies.
            "--steps",
            "400",
            "--kill-appliance",
            "rack2",
            "--kill-at-step",
            "5",
            "--restart-after-ms",
            "600",
        ],
    );
    assert_eq!(v["killed_appliance"], "rack2", "{v}");
    let ms = v["failover_ms"].as_f64().unwrap_or(f64::NAN);
    assert!(ms > 0.0 && ms < 30_000.0, "failover_ms {ms}: {v}");
    // Back to full strength, its tables copied (rows, optimizer state).
    assert!(v["full_strength_seen_ms"].as_f64().is_some(), "{v}");
    assert!(v["rereplication_bytes"].as_u64().unwrap_or(0) > 0, "{v}");
}

/// `phub-bench sparse --local --racks 3` with `extra` (the table: 3
/// ranks, 20,000 rows of 8, 256 ids a step, `--verify`): asserts that it
/// succeeded, verified every row, ran on three racks and left no
/// namespace behind; its JSON.
fn sparse_on_three_racks(tag: &str, extra: &[&str]) -> Value {
    let args: Vec<&str> = [
        "sparse",
        "--local",
        "--racks",
        "3",
        "--workers",
        "3",
        "--rows",
        "20000",
        "--dim",
        "8",
        "--batch",
        "256",
        "--verify",
    ]
    .into_iter()
    .chain(extra.iter().copied())
    .collect();
    let (ok, v, text, pid) = common::bench_json(tag, &args, &[]);
    assert!(ok, "{text}");
    assert_eq!(v["verified"], true, "{text}");
    assert_eq!(v["racks"], 3, "{v}");
    assert!(
        leftovers(pid).is_empty(),
        "namespaces left behind: {:?}",
        leftovers(pid)
    );
    v
}
