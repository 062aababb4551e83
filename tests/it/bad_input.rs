//! A million malformed, truncated, oversized, wrong-version, wrong-token,
//! wrong-job and out-of-range-slot datagrams at a running appliance during
//! training: it keeps serving, training finishes exactly, every drop is
//! counted under its reason, and its memory stays flat. And another
//! tenant's forged datagrams never change a victim job's parameters.

use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::time::{Duration, Instant};

use crate::common::{expected_sum, grad, init, Operator, Rack};
use phub::proto::api::{DataplaneInfo, Stats};
use phub::proto::routes::{control, mgmt};
use phub::proto::wire::{MsgType, Repr, HEADER_LEN, VERSION};
use phub_worker::Worker;

const FLOOD: u64 = 1_000_000;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Datagrams the kernel dropped on the dataplane's sockets (receive buffer
/// full), from /proc/net/udp, summed over `ports`.
fn kernel_drops(ports: &[u16]) -> u64 {
    let table = std::fs::read_to_string("/proc/net/udp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let port = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
            ports
                .contains(&port)
                .then(|| f.last()?.parse::<u64>().ok())
                .flatten()
        })
        .sum()
}

#[test]
fn a_million_bad_datagrams_during_training() {
    let rack = Rack::start(2, "256MiB");
    let keys = [50_000u64, 5];
    let spec = format!(
        "name = \"target\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = {}\n[[keys]]\nelements = {}\n",
        keys[0], keys[1]
    );
    let job = rack.admit(&spec).unwrap();
    let info: DataplaneInfo = rack.dataplane(&mgmt::info());
    let ports: Vec<u16> = (0..info.lcores.len() as u16)
        .map(|i| info.data.base_port + i)
        .collect();
    let pid = rack.dataplane.as_ref().unwrap().pid();
    let before: Stats = rack.send(&control::stats());
    let rss_before = rss_kib(pid);
    let kernel_before = kernel_drops(&ports);

    // Each kind of bad datagram, and the reason it must be counted under.
    let valid = Repr::request(MsgType::Push, job.id, job.token, 0, 1, 0);
    let kinds: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", valid.to_bytes()[..HEADER_LEN / 2].to_vec()),
        ("bad_magic", {
            let mut b = valid.to_bytes().to_vec();
            b[0] = b'X';
            b
        }),
        ("bad_version", {
            let mut b = valid.to_bytes().to_vec();
            b[4] = VERSION + 1;
            b
        }),
        ("unknown_type", {
            let mut b = valid.to_bytes().to_vec();
            b[5] = 99;
            b
        }),
        ("length_mismatch", {
            let mut b = valid.to_bytes().to_vec();
            b.extend_from_slice(&[0u8; 13]);
            b
        }),
        ("count_too_large", {
            let mut r = valid;
            r.count = 4000;
            let mut b = r.to_bytes().to_vec();
            b.resize(HEADER_LEN + 16000, 0); // oversized
            b
        }),
        ("bad_token", {
            let mut r = valid;
            r.token ^= 0x5555;
            r.to_bytes().to_vec()
        }),
        ("unknown_job", {
            let mut r = valid;
            r.job = job.id.wrapping_add(100);
            r.to_bytes().to_vec()
        }),
        ("slot_out_of_range", {
            let mut r = valid;
            r.slot = 1_000_000;
            r.to_bytes().to_vec()
        }),
    ];
    let flood = {
        let ports = ports.clone();
        std::thread::spawn(move || {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.set_nonblocking(false).unwrap();
            let mut sent: BTreeMap<&str, u64> = BTreeMap::new();
            let start = Instant::now();
            for i in 0..FLOOD {
                let (name, bytes) = &kinds[(i % kinds.len() as u64) as usize];
                let port = ports[(i / kinds.len() as u64 % ports.len() as u64) as usize];
                s.send_to(bytes, ("127.0.0.1", port)).unwrap();
                *sent.entry(name).or_default() += 1;
                if i % 256 == 255 {
                    std::thread::yield_now();
                }
            }
            (sent, start.elapsed())
        })
    };
    // Training goes on meanwhile, every element checked.
    let rounds = 30;
    std::thread::scope(|s| {
        for rank in 0..2u16 {
            let url = rack.control_url.clone();
            s.spawn(move || {
                let w = Worker::join(&url, job.id, job.token, rank).unwrap();
                let mut params: Vec<Vec<f32>> = keys
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| (0..n as usize).map(|e| init(k as u32, e)).collect())
                    .collect();
                for (k, p) in params.iter_mut().enumerate() {
                    w.wait(w.init(k as u32, p).unwrap()).unwrap();
                }
                for r in 1..=rounds {
                    for (k, p) in params.iter_mut().enumerate() {
                        let g: Vec<f32> = (0..p.len()).map(|e| grad(rank, k as u32, e, r)).collect();
                        w.wait(w.push_pull(k as u32, &g, p).unwrap()).unwrap();
                        assert!(p
                            .iter()
                            .enumerate()
                            .all(|(e, v)| *v == expected_sum(2, k as u32, e, r)));
                    }
                }
            });
        }
    });
    let (sent, took) = flood.join().unwrap();
    eprintln!("flood: {FLOOD} datagrams in {took:?}");
    // Let the dataplane drain what is queued, then compare.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let after: Stats = rack.send(&control::stats());
        let count = |s: &Stats, reason: &str| -> u64 {
            s.dataplane
                .as_ref()
                .unwrap()
                .lcores
                .iter()
                .filter_map(|l| l.drops.get(reason))
                .sum()
        };
        let lost_in_kernel = kernel_drops(&ports) - kernel_before;
        let counted: u64 = sent.keys().map(|r| count(&after, r) - count(&before, r)).sum();
        if counted + lost_in_kernel >= FLOOD || Instant::now() > deadline {
            for (reason, n) in &sent {
                let c = count(&after, reason) - count(&before, reason);
                assert!(c <= *n + 10, "{reason}: {c} counted for {n} sent");
            }
            assert_eq!(
                counted + lost_in_kernel,
                FLOOD,
                "every bad datagram is counted under its reason or was dropped by the kernel's \
                 receive buffer ({lost_in_kernel})"
            );
            assert!(
                lost_in_kernel < FLOOD / 2,
                "the kernel dropped {lost_in_kernel} of {FLOOD}"
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let rss_after = rss_kib(pid);
    eprintln!("dataplane RSS {rss_before} KiB before, {rss_after} KiB after");
    assert!(
        rss_after < rss_before + 16 * 1024,
        "memory grew from {rss_before} KiB to {rss_after} KiB"
    );
}

/// Another tenant's forged datagrams (the victim's job id with wrong tokens,
/// its own token with slots outside its job) never change the victim's
/// parameters: the shared scenario, on kernel UDP (tests/it/dpdk_faults.rs runs
/// it on DPDK).
#[test]
fn another_tenant_never_changes_a_victims_parameters() {
    let rack = Rack::start(2, "256MiB");
    phub_hwtests::scenarios::tenant_isolation(&phub_hwtests::scenarios::Appliance {
        control_url: rack.control_url.clone(),
        mgmt_url: rack.mgmt_url.clone(),
        operator_token: Some(rack.operator_token()),
        enter: &|| {},
    });
}
