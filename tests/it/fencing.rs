//! A partitioned primary is fenced (PROTOCOL.md §11.6, "Fencing"), end to
//! end: three phub-dataplane processes under one phub-control, a job with
//! two replicas of every chunk. Appliance b is stopped (SIGSTOP) between
//! two rounds: alive, but it answers neither control nor workers. Control
//! declares it down, the survivors take epoch 1 (c adopts b's part), and
//! the workers complete the next round there. Then control is stopped too
//! (the partition goes on: nobody tells b of the new epoch or removes the
//! job from it) and b resumes, still in epoch 0, with its workers' pushes
//! of that round queued in its socket. It is probed directly: epoch-0
//! pushes of that round, from both ranks, other values than the workers'.
//! It must answer no RESULT of it: the round needs its backup c's ACK, and
//! c, in epoch 1, drops b's REPLICATEs (`wrong_epoch`). b's chunks stay at
//! the round before, the survivors' at the new one, and every element any
//! worker received is exact (`train_rank` checks each).

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::common::{all_trained, replicated_spec, train_ranks, Appliances, Operator, Stopped};
use phub::proto::api::{AdmitResponse, DataplaneStats, JobMap};
use phub::proto::failover::EpochView;
use phub::proto::routes::{control, mgmt};
use phub::proto::wire::{self, MsgType, Repr};
use phub::proto::Dtype;

/// The home (epoch 0) of the first chunk in slot 0 of `appliance`'s lcore
/// 0, from control's map of the job: (UDP port, key, chunk, elements).
fn home_chunk(rack: &Appliances, job: &AdmitResponse, appliance: &str) -> (u16, u32, u32, u16) {
    let map: JobMap = rack.send(&control::map(job.id, None));
    let home = map
        .lcores
        .iter()
        .find(|l| l.appliance == appliance && l.lcore == 0 && l.slots > 0)
        .unwrap_or_else(|| panic!("{appliance} is home to no chunk: {map:?}"));
    for k in 0..u32::try_from(map.keys_total).unwrap() {
        let mut m: JobMap = rack.send(&control::map(job.id, Some(k)));
        let key = m.keys.remove(0);
        if let Some(run) = key
            .runs
            .iter()
            .find(|r| r.appliance == appliance && r.lcore == 0 && r.slot == 0)
        {
            let elems = (key.elements - u64::from(run.chunk) * u64::from(map.chunk_elems))
                .min(u64::from(map.chunk_elems));
            return (home.port, key.key, run.chunk, u16::try_from(elems).unwrap());
        }
    }
    panic!("no key of job {} has a chunk in slot 0 of {appliance}", job.id)
}

/// Appliance `i`'s view of the job: its last completed round over its
/// chunks, and its `wrong_epoch` drops (all jobs).
fn appliance_view(rack: &Appliances, i: usize, job: u16) -> (Option<(u32, u32)>, u64) {
    let stats: DataplaneStats = rack.dataplane(i, &mgmt::stats());
    let range = stats
        .jobs
        .iter()
        .find(|j| j.id == job)
        .and_then(|j| j.round_range);
    let wrong_epoch = stats
        .total()
        .drops
        .get(wire::DropReason::WrongEpoch.name())
        .copied()
        .unwrap_or(0);
    (range, wrong_epoch)
}

#[test]
fn a_primary_stopped_past_its_failover_answers_no_round_of_its_old_epoch() {
    let rack = Appliances::start(&[1, 1, 1], "256MiB");
    let keys = [5000u64, 3, 20_000];
    let workers = 2u16;
    // b's backup is c (PROTOCOL.md §11.1 with one rack each).
    let job = rack
        .admit(&replicated_spec("fencing", workers, &keys, &["a", "b", "c"], 2))
        .unwrap();
    assert_eq!(job.appliances, ["a", "b", "c"]);
    let (port, key, chunk, elems) = home_chunk(&rack, &job, "b");
    let url = rack.control_url.clone();
    // Both ranks complete round `last_before`, wait for b to be stopped,
    // then complete one round more (in epoch 1) and stop.
    let last_before = 3u32;
    let probe_round = last_before + 1;
    let reached = AtomicU32::new(0);
    let stopped_b = AtomicBool::new(false);
    let b_pid = rack.dataplanes[1].as_ref().unwrap().pid();
    // Every rank stops at the probe round until b is stopped.
    let more = |_rank: u16, r: u32| {
        if r == probe_round {
            reached.fetch_add(1, Ordering::SeqCst);
            while !stopped_b.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        r <= probe_round
    };
    let b_stop = std::thread::scope(|s| {
        let ranks = train_ranks(s, &url, &job, workers, &keys, &more);
        while reached.load(Ordering::SeqCst) < u32::from(workers) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let stop = Stopped::new(b_pid);
        stopped_b.store(true, Ordering::SeqCst);
        all_trained(ranks, probe_round);
        stop
    });
    // Control declared b down and moved the job to epoch 1; a and c
    // completed the round in it (c as the new primary of b's part).
    let epoch: EpochView = rack.send(&control::epoch(job.id));
    assert_eq!(
        epoch,
        EpochView {
            epoch: 1,
            down: vec![1],
            ..Default::default()
        }
    );
    for i in [0, 2] {
        let (range, _) = appliance_view(&rack, i, job.id);
        assert_eq!(range.map(|r| r.1), Some(probe_round), "{}", rack.names[i]);
    }
    let (_, c_fenced_before) = appliance_view(&rack, 2, job.id);
    // The partition goes on: control stops too, then b resumes, in epoch 0.
    let control = Stopped::new(rack.control.as_ref().unwrap().pid());
    drop(b_stop);
    // Epoch-0 pushes of the round from both ranks, values no worker sent.
    let socks: Vec<UdpSocket> = (0..workers)
        .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let values = vec![1000.0f32; usize::from(elems)];
    let mut results = Vec::new();
    let deadline = Instant::now() + Duration::from_millis(1500);
    let mut buf = [0u8; 9216];
    let mut next_send = Instant::now();
    while Instant::now() < deadline {
        if Instant::now() >= next_send {
            for (rank, s) in socks.iter().enumerate() {
                let repr = Repr::request(
                    MsgType::Push,
                    job.id,
                    job.token,
                    u16::try_from(rank).unwrap(),
                    probe_round,
                    0,
                )
                .with_payload(Dtype::F32, elems)
                .with_chunk(key, chunk);
                let mut d = repr.to_datagram(&values);
                wire::Header::new_unchecked(&mut d[..]).set_epoch(0);
                s.send_to(&d, ("127.0.0.1", port)).unwrap();
            }
            next_send = Instant::now() + Duration::from_millis(100);
        }
        for s in &socks {
            s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
            if let Ok(n) = s.recv(&mut buf) {
                if let Ok((r, _)) = wire::parse(&buf[..n]) {
                    results.push(r);
                }
            }
        }
    }
    let answered: Vec<_> = results
        .iter()
        .filter(|r| r.kind == MsgType::Result && r.round >= probe_round)
        .collect();
    if !answered.is_empty() {
        // What b and c did, for the diagnosis (issue 33: seen once under
        // load): their job views (epoch, rounds) and replication counters.
        let dump = |i: usize| {
            let s: DataplaneStats = rack.dataplane(i, &mgmt::stats());
            format!("{}: jobs {:?}; lcores {:?}", rack.names[i], s.jobs, s.lcores)
        };
        panic!(
            "b, partitioned in epoch 0, answered round {probe_round}, which the new primary holds with \
             other values: {} RESULTs, the first {:?}\n{}\n{}",
            answered.len(),
            answered[0],
            dump(1),
            dump(2)
        );
    }
    // b never completed the round; c dropped its REPLICATEs as of another
    // epoch (so b did try: it is alive and holds the pushes).
    let (b_range, _) = appliance_view(&rack, 1, job.id);
    assert_eq!(b_range, Some((last_before, last_before)), "b's chunks");
    let (c_range, c_fenced) = appliance_view(&rack, 2, job.id);
    assert!(
        c_fenced > c_fenced_before,
        "c dropped no message of another epoch while b was probed ({c_fenced_before} before, {c_fenced} after)"
    );
    assert_eq!(c_range.map(|r| r.1), Some(probe_round), "c");
    drop(control);
}
