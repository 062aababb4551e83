//! The rack regression suite: line-rate receive on every queue, steering,
//! jumbo frames, NUMA placement, end-to-end training.
//!
//! `PHUB_RACK=virtual` runs it on a virtual rack built here (network
//! namespace, veth pair, phub-dataplane on DPDK's af_packet driver,
//! phub-control); `PHUB_RACK=rack.toml` names a lab rack (the appliance is
//! started on this host, on the rack file's NIC and cores); without
//! PHUB_RACK each test prints that it needs a rack file and skips. On both,
//! the worker side is `phub-rack-agent` started through the same launcher:
//! ssh to each worker host, or `ip netns exec` into the namespace. Tests run
//! one at a time (each starts its own appliance).

use std::sync::Mutex;

use phub_hwtests::agent::Amount;
use phub_hwtests::running::Rack;
use phub_proto::wire::{DropReason, HEADER_LEN};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Bytes a datagram of `payload` takes on an Ethernet link: phub header,
/// UDP, IPv4, Ethernet header, FCS, preamble and inter-frame gap.
fn wire_bytes(payload: usize) -> usize {
    payload + HEADER_LEN + 8 + 20 + 14 + 4 + 8 + 12
}

#[test]
fn line_rate_receive_on_every_queue() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = Rack::for_test("line_rate_receive_on_every_queue", 2) else {
        return;
    };
    // 8 KiB pushes for jobs that are not installed, from every worker host
    // flat out for 2 s: each goes through the whole receive path and is
    // counted (unknown_job).
    let payload = 8192;
    let reports = rack.blast(payload, 9, Amount::Secs(2), 0);
    let sent: u64 = reports.iter().map(|r| r.sent).sum();
    let secs = reports.iter().map(|r| r.secs).fold(0.0, f64::max);
    // Read the counters once they stop moving: what the port received but
    // the lcores had not polled yet would otherwise count as lost.
    let (st, settled) = rack.settled_stats();
    let port = st.port.expect("port stats");
    let link = rack.link_gbps();
    let mut total_gbps = 0.0;
    for l in &st.lcores {
        let got = l.drops.get("unknown_job").copied().unwrap_or(0);
        let gbps = (got * wire_bytes(payload) as u64 * 8) as f64 / secs / 1e9;
        total_gbps += gbps;
        println!(
            "queue {}: {got} datagrams, {:.3} Mpps, {gbps:.2} Gb/s on the wire{}",
            l.lcore,
            got as f64 / secs / 1e6,
            link.map(|g| format!(" ({:.0}% of the {g} Gb/s link)", gbps * 100.0 / f64::from(g)))
                .unwrap_or_default()
        );
        assert!(got > 0, "queue {} received nothing", l.lcore);
    }
    let total = st.total();
    let counted = total.rx_packets;
    // Frames dropped before the engine, each under its reason (the engine's
    // own drops are among the packets it counted).
    let engine_reasons: Vec<&str> = DropReason::ALL.iter().map(|r| r.name()).collect();
    let before_engine: Vec<(&String, &u64)> = total
        .drops
        .iter()
        .filter(|(r, _)| !engine_reasons.contains(&r.as_str()))
        .collect();
    let dropped: u64 = before_engine.iter().map(|(_, n)| **n).sum();
    println!(
        "{} host(s) sent {sent} in {secs:.2} s; the port received {} (imissed {}, rx_nombuf {}, ierrors {}), \
         the lcores counted {counted} and dropped {dropped} before the engine {before_engine:?}: \
         {total_gbps:.2} Gb/s in all{}{}",
        reports.len(),
        port.ipackets,
        port.imissed,
        port.rx_nombuf,
        port.ierrors,
        link.map(|g| format!(" of {g} Gb/s")).unwrap_or_default(),
        if settled { "" } else { " (counters still moving after 20 s)" }
    );
    // Every datagram the port handed to a queue reaches phub's engine or is
    // dropped under a reason (a full hand-off ring when the fanout puts it
    // on the other queue); the port also counts the odd ARP request, which
    // is answered, not counted.
    assert!(
        (counted + dropped + total.arp_replies) * 100 >= port.ipackets * 99,
        "the lcores counted {counted} and dropped {dropped} {before_engine:?} of the {} packets the port received",
        port.ipackets
    );
    assert!(
        counted + dropped <= port.ipackets,
        "the lcores saw {} packets, the port received {}",
        counted + dropped,
        port.ipackets
    );
}

#[test]
fn steering_every_datagram_reaches_the_lcore_of_its_port() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = Rack::for_test("steering", 2) else {
        return;
    };
    // Job id = the port's lcore + 100: each lcore's unknown_job count must
    // equal what was sent to its port, whichever queue the NIC chose.
    let per_port = 2000u64;
    let hosts = rack.blast(64, 100, Amount::PerPort(per_port), 300).len() as u64;
    let (st, _) = rack.settled_stats();
    let misrouted: u64 = st.lcores.iter().map(|l| l.misrouted).sum();
    let total = per_port * hosts * rack.lcores() as u64;
    println!("misrouted (handed over): {misrouted} of {total}");
    for l in &st.lcores {
        assert_eq!(
            l.drops.get("unknown_job").copied().unwrap_or(0),
            per_port * hosts,
            "lcore {}: {:?}",
            l.lcore,
            l.drops
        );
        assert_eq!(l.drops.get("handoff_full"), None);
    }
    if rack.is_lab() {
        // A lab NIC steers by rte_flow: nothing lands on the wrong queue.
        assert_eq!(
            misrouted, 0,
            "{misrouted} of {total} datagrams reached the wrong queue: rte_flow steering is not in place \
             (see the dataplane's log)"
        );
    }
}

#[test]
fn jumbo_frames_carry_the_largest_chunks() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let Some(rack) = Rack::for_test("jumbo_frames", 2) else {
        return;
    };
    let chunk = 8832;
    if usize::from(rack.mtu()) < chunk + HEADER_LEN + 28 {
        println!(
            "SKIPPED jumbo_frames: the rack's MTU is {}; {chunk}-byte chunks need {}",
            rack.mtu(),
            chunk + HEADER_LEN + 28
        );
        return;
    }
    rack.train("jumbo", 2, Some(chunk as u32), &[50_000, 2208], 3);
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
    let Some(rack) = Rack::for_test("numa_placement", 2) else {
        return;
    };
    let info = rack.info();
    println!("NIC node {:?}, lcores {:?}", info.nic_numa_node, info.lcores);
    assert_eq!(info.backend, phub_proto::api::BackendKind::Dpdk);
    assert_eq!(info.lcores.len(), rack.lcores());
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
    let Some(rack) = Rack::for_test("end_to_end_training", 2) else {
        return;
    };
    let reports = rack.train("e2e", 3, None, &[100_000, 1, 4097], 10);
    let retransmits: u64 = reports.iter().map(|r| r.stats.retransmits).sum();
    let st = rack.stats();
    let rounds: u64 = st.lcores.iter().map(|l| l.rounds_completed).sum();
    println!(
        "3 ranks on {} worker host(s): 10 rounds exact, {retransmits} retransmits, {rounds} chunk rounds on the appliance",
        rack.launcher().hosts().min(3)
    );
    assert!(rounds > 0);
}
