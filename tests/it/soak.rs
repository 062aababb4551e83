//! The soak: two jobs with 5% loss in each direction and a flood of bad
//! packets for a set time (PHUB_SOAK_SECS, default 60). Not part of the
//! default test run (`#[ignore]`); `tools/soak.sh` runs it. Reports rounds
//! done, retransmissions, drops and the dataplane's resident memory at the
//! start and the end; fails on a wrong result, a hang or memory growth.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::{flood, Operator, Rack};
use phub::proto::api::{DataplaneInfo, Stats};
use phub::proto::routes::{control, mgmt};
use phub_hwtests::workload::{sum_spec, train_rank};
use phub_worker::WorkerConfig;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[test]
#[ignore = "a soak: run with tools/soak.sh"]
fn soak() {
    let secs: u64 = std::env::var("PHUB_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let rack = Rack::start_with(
        2,
        "512MiB",
        &["--inject", "loss=0.05,dup=0.01,reorder=0.01,seed=11"],
    );
    let keys = [200_000u64, 1000, 1];
    let jobs = [
        rack.admit(&sum_spec("soak-a", 2, None, &keys)).unwrap(),
        rack.admit(&sum_spec("soak-b", 2, None, &keys)).unwrap(),
    ];
    let info: DataplaneInfo = rack.dataplane(&mgmt::info());
    let pid = rack.dataplane.as_ref().unwrap().pid();
    let rss_start = rss_kib(pid);
    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);
    let retransmits = AtomicU64::new(0);
    let flooded = AtomicU64::new(0);
    let stop_at = [AtomicU32::new(u32::MAX), AtomicU32::new(u32::MAX)];
    let end = Instant::now() + Duration::from_secs(secs);
    let mut rss_after_warmup = 0;
    std::thread::scope(|s| {
        // The flood: random, truncated and wrong-token datagrams at every port.
        s.spawn(|| {
            let n = flood(&stop, "127.0.0.1", info.data.base_port, info.lcores.len() as u16);
            flooded.store(n, Ordering::Relaxed);
        });
        for (job, stop_at) in jobs.iter().zip(&stop_at) {
            // The round both ranks stop after: the first rank that sees the
            // stop flag after a multiple of 50 rounds sets it 50 rounds on,
            // which the other (at most one round apart) reaches later.
            for rank in 0..2u16 {
                let (url, stop, rounds, retransmits) =
                    (rack.control_url.as_str(), &stop, &rounds, &retransmits);
                s.spawn(move || {
                    let cfg = WorkerConfig {
                        timeout: Duration::from_secs(30),
                        ..WorkerConfig::default()
                    };
                    let (done, stats) = train_rank(url, job.id, job.token, rank, 2, &keys, cfg, |next| {
                        let done = next - 1;
                        if done.is_multiple_of(50) && stop.load(Ordering::SeqCst) {
                            let _ = stop_at.compare_exchange(
                                u32::MAX,
                                done + 50,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                        }
                        done < stop_at.load(Ordering::SeqCst)
                    });
                    if rank == 0 {
                        rounds.fetch_add(u64::from(done), Ordering::Relaxed);
                    }
                    retransmits.fetch_add(stats.retransmits, Ordering::Relaxed);
                });
            }
        }
        std::thread::sleep(Duration::from_secs((secs / 10).max(1)));
        rss_after_warmup = rss_kib(pid);
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(200));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let rss_end = rss_kib(pid);
    let stats: Stats = rack.send(&control::stats());
    let d = stats.dataplane.unwrap();
    let drops: u64 = d.lcores.iter().flat_map(|l| l.drops.values()).sum();
    let injected: u64 = d.lcores.iter().map(|l| l.injected_drops).sum();
    let resent: u64 = d.lcores.iter().map(|l| l.results_resent).sum();
    println!(
        "soak: {secs} s, 2 jobs x 2 workers, 5% loss each way, {} bad datagrams sent",
        flooded.load(Ordering::Relaxed)
    );
    println!("  rounds done (both jobs): {}", rounds.load(Ordering::Relaxed));
    println!(
        "  worker retransmissions: {}",
        retransmits.load(Ordering::Relaxed)
    );
    println!(
        "  appliance: {injected} packets lost by injection, {resent} results resent, {drops} drops counted"
    );
    let mut reasons: Vec<(String, u64)> = Vec::new();
    for l in &d.lcores {
        for (r, n) in &l.drops {
            match reasons.iter_mut().find(|(x, _)| x == r) {
                Some(e) => e.1 += n,
                None => reasons.push((r.clone(), *n)),
            }
        }
    }
    for (r, n) in reasons {
        println!("    {r:<20} {n}");
    }
    println!("  dataplane RSS: {rss_start} KiB at start, {rss_after_warmup} KiB after warm-up, {rss_end} KiB at the end");
    assert!(
        rss_end < rss_after_warmup + 16 * 1024,
        "memory grew by {} KiB",
        rss_end - rss_after_warmup
    );
}
