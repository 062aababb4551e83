//! The soak: two jobs with 5% loss in each direction and a flood of bad
//! packets for a set time (PHUB_SOAK_SECS, default 60). Not part of the
//! default test run (`#[ignore]`); `tools/soak.sh` runs it. Reports rounds
//! done, retransmissions, drops and the dataplane's resident memory at the
//! start and the end; fails on a wrong result, a hang or memory growth.

mod common;

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{expected_sum, grad, init, Rack};
use phub::proto::api::{DataplaneInfo, Stats};
use phub_worker::{Worker, WorkerConfig};

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
    let spec = |name: &str| {
        let mut s = format!("name = \"{name}\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n");
        for k in keys {
            s += &format!("[[keys]]\nelements = {k}\n");
        }
        s
    };
    let jobs = [
        rack.admit(&spec("soak-a")).unwrap(),
        rack.admit(&spec("soak-b")).unwrap(),
    ];
    let info: DataplaneInfo = ureq::get(&format!("{}/v1/info", rack.mgmt_url))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    let pid = rack.dataplane.as_ref().unwrap().id();
    let rss_start = rss_kib(pid);
    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);
    let retransmits = AtomicU64::new(0);
    let flooded = AtomicU64::new(0);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut rss_after_warmup = 0;
    std::thread::scope(|s| {
        // The flood: random bytes and wrong-token headers at every port.
        s.spawn(|| {
            let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut buf = [0u8; 1500];
            while !stop.load(Ordering::Relaxed) {
                for b in buf.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8;
                }
                if x.is_multiple_of(2) {
                    buf[..4].copy_from_slice(b"PHUB");
                    buf[4] = 1;
                    buf[5] = 2;
                }
                let port = info.data.base_port + (x % info.lcores.len() as u64) as u16;
                let _ = sock.send_to(&buf[..(x % 1500) as usize], ("127.0.0.1", port));
                flooded.fetch_add(1, Ordering::Relaxed);
                if x.is_multiple_of(32) {
                    std::thread::sleep(Duration::from_micros(500));
                }
            }
        });
        for job in &jobs {
            for rank in 0..2u16 {
                let (url, stop, rounds, retransmits) =
                    (rack.control_url.clone(), &stop, &rounds, &retransmits);
                s.spawn(move || {
                    let cfg = WorkerConfig {
                        timeout: Duration::from_secs(30),
                        ..WorkerConfig::default()
                    };
                    let w = Worker::join_with(&url, job.id, job.token, rank, cfg).unwrap();
                    let mut params: Vec<Vec<f32>> = keys
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| (0..n as usize).map(|e| init(k as u32, e)).collect())
                        .collect();
                    for (k, p) in params.iter_mut().enumerate() {
                        w.wait(w.init(k as u32, p).unwrap()).unwrap();
                    }
                    let mut r = 0;
                    while Instant::now() < end {
                        r += 1;
                        let grads: Vec<Vec<f32>> = params
                            .iter()
                            .enumerate()
                            .map(|(k, p)| (0..p.len()).map(|e| grad(rank, k as u32, e, r)).collect())
                            .collect();
                        let hs: Vec<_> = params
                            .iter_mut()
                            .zip(&grads)
                            .enumerate()
                            .map(|(k, (p, g))| w.push_pull(k as u32, g, p).unwrap())
                            .collect();
                        for h in hs {
                            w.wait(h).unwrap();
                        }
                        for (k, p) in params.iter().enumerate() {
                            for (e, v) in p.iter().enumerate() {
                                assert_eq!(*v, expected_sum(2, k as u32, e, r), "job {} round {r}", job.id);
                            }
                        }
                        if rank == 0 {
                            rounds.fetch_add(1, Ordering::Relaxed);
                        }
                        // Both ranks must leave in the same round.
                        if r.is_multiple_of(50) && stop.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                    retransmits.fetch_add(w.stats().retransmits, Ordering::Relaxed);
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
    let stats: Stats = rack.get("/v1/stats");
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
