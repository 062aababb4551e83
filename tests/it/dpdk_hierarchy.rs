//! A DPDK appliance as one rack's appliance of a hierarchical job
//! (PROTOCOL.md §9): phub-dataplane `--backend dpdk` on net_af_packet over
//! the virtual rack's veth pair is rack 0, a kernel-UDP phub-dataplane on
//! the workers' end of the veth is rack 1; the two exchange partial sums
//! and results across the veth, DPDK reaching the other appliance at the
//! Ethernet address `--neighbor` gives. Skips (printing why) without root.

use std::time::{Duration, Instant};

use crate::common::udp_beside::{neighbor_arg, UdpBeside};
use phub::proto::api::DataplaneStats;
use phub::proto::routes::mgmt;
use phub_hwtests::virt::{VirtualRack, APPLIANCE_IP, WORKER_IP};
use phub_hwtests::workload::{admit, client, forged_partial, sum_spec, train};

const UDP_MGMT: &str = "127.0.0.1:7811";

fn stats(url: &str) -> DataplaneStats {
    client(url, None).send(&mgmt::stats()).unwrap()
}

fn totals(s: &DataplaneStats) -> (u64, u64, u64) {
    s.lcores.iter().fold((0, 0, 0), |t, l| {
        (
            t.0 + l.partials_sent,
            t.1 + l.partial_results_sent,
            t.2 + l.drops.values().sum::<u64>(),
        )
    })
}

/// Before the workers start, one PARTIAL is forged with nothing but the
/// job's token (which every worker holds), from an ordinary socket at the
/// workers' address inside the namespace, to the DPDK appliance's lcore
/// that is home to a chunk: rack 0's partial of round 0, every element
/// 1000. The DPDK appliance takes a rack's partial only from the address
/// of that rack appliance's lcore holding the chunk (PROTOCOL.md §9.4):
/// here its own lcore, whose frames come back through its hand-off ring
/// with its own address and port. Reproduction (issue 36, finding 3), on
/// the code before: the forged partial was added as rack 0's, the real one
/// was `duplicate`, and every rank got 1000 back as rank 0's initial values
/// of that chunk (train panics at round 0). Now it is `wrong_peer`, once,
/// and every round is exact.
#[test]
fn dpdk_and_kernel_udp_rack_appliances_train_a_hierarchical_job_exactly() {
    let rack = match VirtualRack::start(
        "hier",
        2,
        &neighbor_arg(),
        &UdpBeside::appliance_arg("u", "r2", UDP_MGMT, "dpdk-hier"),
    ) {
        Ok(r) => r,
        Err(why) => {
            println!("SKIPPED: DPDK hierarchical test: {why}");
            return;
        }
    };
    let mut udp = UdpBeside::start(&rack, UDP_MGMT, "dpdk-hier");
    let url = rack.control_url();
    let token = rack.operator_token();
    let keys = [20_000u64, 3, 4097];
    let mut spec = sum_spec("hier-dpdk", 4, None, &keys);
    spec += "[placement]\nappliances = [\"default\", \"u\"]\nhierarchical = true\n";
    let (dpdk, other) = rack.inside(|| {
        udp.wait_up();
        let job = admit(&url, token.as_deref(), &spec);
        let (port, forged) = forged_partial(&url, &job, "default", 1000.0);
        let s = std::net::UdpSocket::bind((WORKER_IP, 0)).unwrap();
        s.send_to(&forged, (APPLIANCE_IP, port)).unwrap();
        let t = Instant::now();
        loop {
            let st = stats(&rack.mgmt_url());
            let taken: u64 = st.lcores.iter().map(|l| l.pushes_aggregated).sum();
            if wrong_peer(&st) + taken > 0 {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the forged partial was not handled: {st:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Ranks 0 and 1 on the DPDK appliance (rack 0), 2 and 3 on the
        // kernel-UDP one; exact sums every round.
        train(&url, &job, 4, &keys, 6);
        (
            (job.chunks, stats(&rack.mgmt_url())),
            stats(&format!("http://{UDP_MGMT}")),
        )
    });
    let (chunks, dpdk) = dpdk;
    udp.kill();
    let (d, o) = (totals(&dpdk), totals(&other));
    let reasons = |s: &DataplaneStats| s.lcores.iter().flat_map(|l| l.drops.clone()).collect::<Vec<_>>();
    println!(
        "dpdk (partials, results, drops) {d:?} {:?}, kernel UDP {o:?} {:?}",
        reasons(&dpdk),
        reasons(&other)
    );
    assert_eq!(dpdk.backend, phub_proto::api::BackendKind::Dpdk);
    // One partial per chunk and round (0 to 6) from each rack appliance;
    // each is home to some chunks and answers both racks for them.
    assert_eq!(d.0, 7 * chunks, "{dpdk:?}");
    assert_eq!(o.0, 7 * chunks, "{other:?}");
    assert!(d.1 > 0 && o.1 > 0);
    assert_eq!(d.1 + o.1, 2 * 7 * chunks);
    assert_eq!(wrong_peer(&dpdk), 1, "the forged partial alone");
    assert_eq!(wrong_peer(&other), 0);
}

fn wrong_peer(s: &DataplaneStats) -> u64 {
    s.lcores.iter().filter_map(|l| l.drops.get("wrong_peer")).sum()
}
