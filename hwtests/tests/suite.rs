//! The rack regression suite: line-rate receive on every queue, steering,
//! jumbo frames, NUMA placement, end-to-end training.
//!
//! `PHUB_RACK=virtual` runs it on a virtual rack built here (network
//! namespace, veth pair, phub-dataplane on DPDK's af_packet driver,
//! phub-control, workers over kernel UDP); `PHUB_RACK=rack.toml` names a lab
//! rack; without PHUB_RACK each test prints that it needs a rack file and
//! skips. Tests run one at a time (each builds its own rack).

use std::net::UdpSocket;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use phub_hwtests::rack::{self, Target};
use phub_hwtests::virt::{VirtualRack, APPLIANCE_IP, BASE_PORT};
use phub_hwtests::workload::{admit, sum_spec, train};
use phub_proto::wire::{MsgType, Repr, HEADER_LEN};
use phub_proto::Dtype;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The virtual rack for `test`, or `None` after printing why it is skipped.
fn rack(test: &str, lcores: usize, dataplane: &str) -> Option<VirtualRack> {
    match rack::target() {
        None => {
            println!(
                "SKIPPED {test}: needs a rack file: PHUB_RACK=rack.toml (format in hwtests/src/rack.rs) or PHUB_RACK=virtual"
            );
            None
        }
        Some(Err(e)) => panic!("{e}"),
        Some(Ok(Target::Lab(r))) => {
            println!(
                "SKIPPED {test}: lab rack {} with {} worker host(s): driving remote worker hosts is not implemented yet (EAL would get `{}`)",
                r.appliance.pci,
                r.workers.len(),
                r.eal_args()
            );
            None
        }
        Some(Ok(Target::Virtual)) => match VirtualRack::start(test, lcores, dataplane, "") {
            Ok(r) => Some(r),
            Err(why) => {
                println!("SKIPPED {test}: the virtual rack cannot run here: {why}");
                None
            }
        },
    }
}

/// A PUSH for job `job` (installed or not) with `payload` bytes.
fn datagram(job: u16, payload: usize) -> Vec<u8> {
    let repr = Repr {
        kind: MsgType::Push,
        dtype: Dtype::F32,
        flags: 0,
        token: 1,
        job,
        rank: 0,
        count: (payload / 4) as u16,
        error: 0,
        round: 1,
        slot: 0,
        key: 0,
        chunk: 0,
    };
    let mut b = vec![0u8; HEADER_LEN + payload];
    b[..HEADER_LEN].copy_from_slice(&repr.to_bytes());
    b
}

#[test]
fn line_rate_receive_on_every_queue() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = rack("line_rate_receive_on_every_queue", 2, "") else {
        return;
    };
    // 8 KiB pushes for a job that is not installed: each goes through the
    // whole receive path and is counted (unknown_job), for 2 s.
    let d = datagram(9, 8192);
    let secs = 2.0;
    let sent = rack.inside(|| {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        let t = Instant::now();
        let mut n = 0u64;
        while t.elapsed().as_secs_f64() < secs {
            for q in 0..2u16 {
                if s.send_to(&d, (APPLIANCE_IP, BASE_PORT + q)).is_ok() {
                    n += 1;
                }
            }
        }
        n
    });
    std::thread::sleep(Duration::from_millis(300));
    let st = rack.stats();
    let port = st.port.expect("port stats");
    for l in &st.lcores {
        let got = l.drops.get("unknown_job").copied().unwrap_or(0);
        println!(
            "queue {}: {got} datagrams, {:.3} Mpps, {:.2} GB/s of payload",
            l.lcore,
            got as f64 / secs / 1e6,
            got as f64 * 8192.0 / secs / 1e9
        );
        assert!(got > 0, "queue {} received nothing", l.lcore);
    }
    let counted: u64 = st.lcores.iter().map(|l| l.rx_packets).sum();
    println!(
        "sent {sent}, the port received {} (imissed {}, rx_nombuf {}, ierrors {}), the lcores counted {counted}",
        port.ipackets, port.imissed, port.rx_nombuf, port.ierrors
    );
    assert!(
        counted * 100 >= port.ipackets * 99,
        "the lcores lost packets the port received"
    );
}

#[test]
fn steering_every_datagram_reaches_the_lcore_of_its_port() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = rack("steering", 2, "") else {
        return;
    };
    // Job id = the port's lcore + 100: each lcore's unknown_job count must
    // equal what was sent to its port, whichever queue the NIC chose.
    let per_port = 2000u64;
    rack.inside(|| {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        for i in 0..per_port {
            for q in 0..2u16 {
                s.send_to(&datagram(100 + q, 64), (APPLIANCE_IP, BASE_PORT + q))
                    .unwrap();
            }
            if i % 32 == 0 {
                std::thread::sleep(Duration::from_micros(300));
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let st = rack.stats();
    let misrouted: u64 = st.lcores.iter().map(|l| l.misrouted).sum();
    println!("misrouted (handed over): {misrouted} of {}", 2 * per_port);
    for l in &st.lcores {
        assert_eq!(
            l.drops.get("unknown_job").copied().unwrap_or(0),
            per_port,
            "lcore {}: {:?}",
            l.lcore,
            l.drops
        );
        assert_eq!(l.drops.get("handoff_full"), None);
    }
}

#[test]
fn jumbo_frames_carry_the_largest_chunks() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = rack("jumbo_frames", 2, "") else {
        return;
    };
    let url = rack.control_url();
    let token = rack.operator_token();
    let keys = [50_000u64, 2208];
    let spec = sum_spec("jumbo", 2, Some(8832), &keys);
    rack.inside(|| {
        let job = admit(&url, token.as_deref(), &spec);
        train(&url, &job, 2, &keys, 3);
    });
    let st = rack.stats();
    let port = st.port.expect("port stats");
    let pushes: u64 = st.lcores.iter().map(|l| l.pushes_aggregated).sum();
    println!("port: {port:?}; {pushes} contributions");
    // Every push that carried a chunk was a frame of up to 8832 + 128 bytes.
    assert!(port.ibytes > pushes * 4000, "frames were not jumbo: {port:?}");
    assert!(
        port.obytes > port.opackets * 4000,
        "results were not jumbo: {port:?}"
    );
}

#[test]
fn numa_placement_lcores_on_the_nic_node() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = rack("numa_placement", 2, "") else {
        return;
    };
    let info = rack.info();
    println!("NIC node {:?}, lcores {:?}", info.nic_numa_node, info.lcores);
    assert_eq!(info.backend, "dpdk");
    if let Some(nic) = info.nic_numa_node {
        for l in &info.lcores {
            if let Some(n) = l.numa_node {
                assert_eq!(n, nic, "lcore {} is on node {n}, the NIC on {nic}", l.lcore);
            }
        }
    }
}

#[test]
fn end_to_end_training_across_the_rack() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = rack("end_to_end_training", 2, "") else {
        return;
    };
    let url = rack.control_url();
    let token = rack.operator_token();
    let keys = [100_000u64, 1, 4097];
    let spec = sum_spec("e2e", 3, None, &keys);
    rack.inside(|| {
        let job = admit(&url, token.as_deref(), &spec);
        train(&url, &job, 3, &keys, 10);
    });
    let st = rack.stats();
    let rounds: u64 = st.lcores.iter().map(|l| l.rounds_completed).sum();
    assert!(rounds > 0);
}
