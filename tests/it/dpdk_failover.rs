//! Failover of a replicated job (PROTOCOL.md §11.6) with a DPDK appliance:
//! phub-dataplane `--backend dpdk` on net_af_packet over the virtual
//! rack's veth pair ("default") and a kernel-UDP phub-dataplane on the
//! workers' end of the veth ("u", rack r2) hold a job with two replicas
//! of every chunk, the DPDK appliance reaching the other at the Ethernet
//! address `--neighbor` gives. One of the two is killed (SIGKILL) between
//! two rounds while a rank is already pushing the next; control declares
//! it down, the survivor takes epoch 1 and adopts the dead one's part
//! from its backup slots, and every element of every round stays exact
//! (`train_rank` checks each against the formula). Skips (printing why)
//! without root.

use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

use crate::common::udp_beside::{neighbor_arg, UdpBeside};
use crate::common::{
    all_trained, appliances_settled, at_full_strength, replicated_spec, replicated_table_spec, train_ranks,
    train_table_ranks, Gates,
};
use phub::proto::api::{BackendKind, DataplaneStats};
use phub::proto::failover::EpochView;
use phub::proto::routes::{control, mgmt};
use phub_hwtests::virt::VirtualRack;
use phub_hwtests::workload::{admit, client};

const UDP_MGMT: &str = "127.0.0.1:7812";

/// The DPDK appliance killed, or the kernel-UDP one: the other adopts its
/// part.
#[test]
fn a_dpdk_appliance_adopts_a_killed_partner_s_part_and_every_round_stays_exact() {
    kill_mid_training(false);
}

#[test]
fn a_killed_dpdk_appliance_s_part_is_adopted_by_its_partner_and_every_round_stays_exact() {
    kill_mid_training(true);
}

/// Appliance "default" (DPDK) when `kill_dpdk`, else "u" (kernel UDP),
/// killed between rounds 4 and 5 of 10 (module head).
fn kill_mid_training(kill_dpdk: bool) {
    let tag = if kill_dpdk { "repd" } else { "repu" };
    let rack = match VirtualRack::start(
        tag,
        1,
        &neighbor_arg(),
        &UdpBeside::appliance_arg("u", "r2", UDP_MGMT, tag),
    ) {
        Ok(r) => r,
        Err(why) => {
            println!("SKIPPED: DPDK failover test: {why}");
            return;
        }
    };
    let mut udp = UdpBeside::start(&rack, UDP_MGMT, tag);
    let dpdk_pid = rack.dataplane.as_ref().expect("the rack's dataplane").id();
    let url = rack.control_url();
    let token = rack.operator_token();
    let keys = [5000u64, 3, 20_000];
    let (workers, rounds, kill_after) = (2u16, 10u32, 4u32);
    let spec = replicated_spec("dpdk-failover", workers, &keys, &["default", "u"], 2);
    let (epoch, before, survivor, backend) = rack.inside(|| {
        udp.wait_up();
        appliances_settled(&url, token.as_deref());
        let job = admit(&url, token.as_deref(), &spec);
        assert_eq!(job.appliances, ["default", "u"]);
        let gates = Gates::new(&[kill_after], rounds);
        // When rank 0 completed the first round after the kill.
        let first_after: Mutex<Option<Instant>> = Mutex::new(None);
        let more = |rank: u16, r: u32| {
            if rank == 0 && r == kill_after + 2 {
                *first_after.lock().unwrap() = Some(Instant::now());
            }
            gates.more(rank, r)
        };
        let (killed_at, before) = std::thread::scope(|s| {
            // Rank 0 waits before round 5 until the kill; rank 1 goes on,
            // so the appliance dies with pushes of that round in flight.
            let ranks = train_ranks(s, &url, &job, workers, &keys, &more);
            gates.wait_at(0);
            let before = at_full_strength(&url, token.as_deref(), job.id);
            if kill_dpdk {
                let killed = Command::new("kill")
                    .args(["-KILL", &dpdk_pid.to_string()])
                    .status()
                    .unwrap();
                assert!(killed.success(), "SIGKILL to the DPDK dataplane");
            } else {
                udp.kill();
            }
            let at = Instant::now();
            gates.open(0);
            let trained =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| all_trained(ranks, rounds)));
            if let Err(p) = trained {
                // What control and the DPDK appliance stood at, and its log.
                let c = client(&url, token.as_deref());
                eprintln!("epoch: {:?}", c.send(&control::epoch(job.id)));
                eprintln!("appliances: {:?}", c.send(&control::appliances()));
                let st = client(&rack.mgmt_url(), None).send(&mgmt::stats());
                eprintln!("DPDK appliance's stats: {st:?}");
                eprintln!(
                    "DPDK appliance's log:\n{}",
                    std::fs::read_to_string(&rack.log).unwrap_or_default()
                );
                eprintln!(
                    "phub-control's log:\n{}",
                    std::fs::read_to_string(rack.control_log()).unwrap_or_default()
                );
                std::panic::resume_unwind(p);
            }
            (at, before)
        });
        let resumed = first_after
            .into_inner()
            .unwrap()
            .expect("rank 0 completed a round after the kill");
        eprintln!(
            "failover with {} killed: the kill to the first round completed after it: {:?}",
            if kill_dpdk {
                "the DPDK appliance"
            } else {
                "the kernel-UDP appliance"
            },
            resumed - killed_at
        );
        let epoch: EpochView = client(&url, token.as_deref())
            .send(&control::epoch(job.id))
            .unwrap();
        let survivor = if kill_dpdk {
            format!("http://{UDP_MGMT}")
        } else {
            rack.mgmt_url()
        };
        let stats: DataplaneStats = client(&survivor, None).send(&mgmt::stats()).unwrap();
        let last = stats
            .jobs
            .iter()
            .find(|j| j.id == job.id)
            .and_then(|j| j.round_range)
            .map(|r| r.1);
        (epoch, before, last, stats.backend)
    });
    // Control moved the job to the next epoch (1, unless a loaded host
    // had an appliance declared down and given the job back before the
    // kill) with the killed appliance down, and the survivor completed
    // every round.
    let down = u16::from(!kill_dpdk);
    assert_eq!(
        epoch,
        EpochView {
            epoch: before.epoch + 1,
            down: vec![down],
            ..before
        }
    );
    assert_eq!(survivor, Some(rounds));
    let want = if kill_dpdk {
        BackendKind::Udp
    } else {
        BackendKind::Dpdk
    };
    assert_eq!(backend, want);
}

/// A replicated job with a table (PROTOCOL.md §11.9) on the DPDK appliance
/// and the kernel-UDP one: each keeps the other's entry as a backup table
/// (REPLICATE_ROWS between the two backends); the DPDK appliance is killed
/// while rank 1's round is in flight, the kernel-UDP one serves its entry
/// from the backup table, and every row of every round is exact.
#[test]
fn a_killed_dpdk_appliance_s_table_entry_is_served_by_its_partner_exactly() {
    let tag = "rept";
    let rack = match VirtualRack::start(
        tag,
        1,
        &neighbor_arg(),
        &UdpBeside::appliance_arg("u", "r2", UDP_MGMT, tag),
    ) {
        Ok(r) => r,
        Err(why) => {
            println!("SKIPPED: DPDK table failover test: {why}");
            return;
        }
    };
    let udp = UdpBeside::start(&rack, UDP_MGMT, tag);
    let dpdk_pid = rack.dataplane.as_ref().expect("the rack's dataplane").id();
    let url = rack.control_url();
    let token = rack.operator_token();
    let (rounds, kill_after) = (8u32, 3u32);
    let spec = replicated_table_spec("dpdk-table-failover", &["default", "u"]);
    let (epoch, before) = rack.inside(|| {
        udp.wait_up();
        appliances_settled(&url, token.as_deref());
        let job = admit(&url, token.as_deref(), &spec);
        assert_eq!(job.appliances, ["default", "u"]);
        let gates = Gates::new(&[kill_after], rounds);
        let before = std::thread::scope(|s| {
            let ranks = train_table_ranks(s, &url, &job, &gates, rounds);
            gates.wait_at(0);
            let before = at_full_strength(&url, token.as_deref(), job.id);
            std::thread::sleep(std::time::Duration::from_millis(50));
            let killed = Command::new("kill")
                .args(["-KILL", &dpdk_pid.to_string()])
                .status()
                .unwrap();
            assert!(killed.success(), "SIGKILL to the DPDK dataplane");
            gates.open(0);
            let trained = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for h in ranks {
                    h.join().unwrap();
                }
            }));
            if let Err(p) = trained {
                eprintln!(
                    "epoch: {:?}",
                    client(&url, token.as_deref()).send(&control::epoch(job.id))
                );
                eprintln!(
                    "phub-control's log:\n{}",
                    std::fs::read_to_string(rack.control_log()).unwrap_or_default()
                );
                std::panic::resume_unwind(p);
            }
            before
        });
        let epoch: EpochView = client(&url, token.as_deref())
            .send(&control::epoch(job.id))
            .unwrap();
        (epoch, before)
    });
    assert_eq!(
        epoch,
        EpochView {
            epoch: before.epoch + 1,
            down: vec![0],
            ..before
        }
    );
}
