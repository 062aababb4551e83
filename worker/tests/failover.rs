//! A replicated job's worker across a failover (PROTOCOL.md §11.6), with
//! loopback sockets playing two appliances and a tiny fake control: the
//! appliance holding chunk 1 goes silent, the worker asks control for the
//! epoch after its retransmissions, and sends chunk 1 to the appliance
//! that adopted it, at its extended slot, with the new epoch.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use phub_proto::api::{ApplianceAddr, DataAddr, JoinReplication, JoinResponse};
use phub_proto::failover::EpochView;
use phub_proto::layout::{ChunkRange, Layout};
use phub_proto::routes::ControlRoute;
use phub_proto::spec::JobSpec;
use phub_proto::wire::{self, Header, MsgType, Repr, APPLIANCE_RANK};
use phub_proto::Dtype;
use phub_worker::{Worker, WorkerConfig};

const JOB: u16 = 11;
const TOKEN: u64 = 0xfa11_0e7e_0000_0001;
/// Elements per chunk (8192-byte chunks of f32).
const ELEMS: usize = 2048;

/// What an appliance received: (chunk, slot, epoch).
type Seen = Arc<Mutex<Vec<(u32, u32, u32)>>>;

/// Plays one appliance of one lcore on `sock`: records every datagram and,
/// if `answers`, answers each chunk with its own payload as the RESULT
/// (round 0 of one rank: the INIT's values), at the slot and epoch it came
/// with.
fn appliance(sock: UdpSocket, answers: bool, stop: Arc<AtomicBool>) -> Seen {
    let seen: Seen = Arc::default();
    let record = Arc::clone(&seen);
    sock.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 9000];
        while !stop.load(Ordering::Relaxed) {
            let Ok((n, from)) = sock.recv_from(&mut buf) else {
                continue;
            };
            let Ok((r, payload)) = wire::parse(&buf[..n]) else {
                continue;
            };
            let epoch = Header::new_unchecked(&buf[..n]).epoch();
            record.lock().unwrap().push((r.chunk, r.slot, epoch));
            if answers {
                let values: Vec<f32> = payload
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let out = Repr::request(MsgType::Result, JOB, TOKEN, APPLIANCE_RANK, r.round, r.slot)
                    .with_payload(Dtype::F32, r.count)
                    .with_chunk(r.key, r.chunk);
                let mut d = out.to_datagram(&values);
                Header::new_unchecked(&mut d[..]).set_epoch(epoch);
                sock.send_to(&d, from).unwrap();
            }
        }
    });
    seen
}

/// A fake control answering job [`JOB`]'s epoch route with `status` and
/// `text` (200 and an `EpochView`, or an error); counts requests.
fn fake_control(status: u16, text: String, stop: Arc<AtomicBool>) -> (String, Arc<Mutex<u32>>) {
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let url = format!("http://{}", server.server_addr().to_ip().unwrap());
    let asked: Arc<Mutex<u32>> = Arc::default();
    let count = Arc::clone(&asked);
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let Ok(Some(req)) = server.recv_timeout(Duration::from_millis(50)) else {
                continue;
            };
            let route = ControlRoute::parse(req.method().as_str(), req.url(), None);
            let (status, text) = match route {
                Ok(ControlRoute::Epoch { job: JOB }) => {
                    *count.lock().unwrap() += 1;
                    (status, text.clone())
                }
                _ => (404, r#"{"error":"no such route"}"#.to_string()),
            };
            let json = tiny_http::Header::from_bytes("Content-Type", "application/json").unwrap();
            req.respond(
                tiny_http::Response::from_string(text)
                    .with_status_code(status)
                    .with_header(json),
            )
            .unwrap();
        }
    });
    (url, asked)
}

/// The join answer of a one-rank job of two chunks over two one-lcore
/// appliances on ports `p0` and `p1`, replicas 2, epoch 0.
fn two_appliances(p0: u16, p1: u16) -> JoinResponse {
    let spec = JobSpec::new("failover-test", 1, &[2 * ELEMS as u64]).with_chunk_bytes(8192);
    let layout = Layout {
        chunk_elems: ELEMS as u32,
        lcores: vec![
            ChunkRange { first: 0, count: 1 },
            ChunkRange { first: 1, count: 1 },
        ],
    };
    let at = |name: &str, base_port| ApplianceAddr {
        name: name.into(),
        host: "127.0.0.1".into(),
        base_port,
        lcores: 1,
        rx_buffer_bytes: None,
    };
    JoinResponse {
        job: JOB,
        rank: 0,
        spec,
        layout,
        dataplane: DataAddr {
            host: "127.0.0.1".into(),
            base_port: p0,
        },
        appliances: vec![at("a0", p0), at("a1", p1)],
        replication: Some(JoinReplication {
            replicas: 2,
            racks: vec![String::new(); 2],
            epoch: EpochView::default(),
            rack: None,
        }),
    }
}

/// Two appliances until `stop`: 0 answering, 1 dead (it takes datagrams
/// and answers none); the join answer over them ([`two_appliances`]) and
/// what each saw.
fn live_and_dead(stop: &Arc<AtomicBool>) -> (JoinResponse, Seen, Seen) {
    let a0 = UdpSocket::bind("127.0.0.1:0").unwrap();
    let a1 = UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = |s: &UdpSocket| s.local_addr().unwrap().port();
    let join = two_appliances(port(&a0), port(&a1));
    (
        join,
        appliance(a0, true, Arc::clone(stop)),
        appliance(a1, false, Arc::clone(stop)),
    )
}

#[test]
fn a_silent_primary_makes_the_worker_follow_control_to_the_adopting_backup() {
    let stop = Arc::new(AtomicBool::new(false));
    let (join, seen0, seen1) = live_and_dead(&stop);
    let e1 = EpochView {
        epoch: 1,
        down: vec![1],
        ..Default::default()
    };
    let (url, asked) = fake_control(200, serde_json::to_string(&e1).unwrap(), Arc::clone(&stop));
    let config = WorkerConfig {
        timeout: Duration::from_secs(20),
        ..WorkerConfig::default()
    };
    let w = Worker::from_join_at(join, TOKEN, config, Some(&url)).unwrap();
    let mut params: Vec<f32> = (0..2 * ELEMS).map(|i| i as f32 * 0.5).collect();
    let want = params.clone();
    w.wait(w.init(0, &mut params).unwrap()).unwrap();
    stop.store(true, Ordering::Relaxed);
    assert_eq!(params, want, "the INIT's values back from both chunks");

    let seen1 = seen1.lock().unwrap().clone();
    let seen0 = seen0.lock().unwrap().clone();
    // Chunk 1's home saw it in epoch 0, first sent and then retransmitted
    // until the worker asked control.
    assert!(seen1.iter().all(|&(c, s, e)| (c, s, e) == (1, 0, 0)), "{seen1:?}");
    assert!(seen1.len() >= 4, "sent once and retransmitted 3 times: {seen1:?}");
    assert!(*asked.lock().unwrap() >= 1, "control was asked");
    // Appliance 0 got chunk 0 at its home slot in epoch 0, and chunk 1 in
    // epoch 1 at its extended slot: after its own slot 0, the backup slot
    // of appliance 1's part.
    assert!(seen0.contains(&(0, 0, 0)), "{seen0:?}");
    assert!(seen0.contains(&(1, 1, 1)), "{seen0:?}");
    assert!(seen0.iter().all(|&(c, _, _)| c == 0 || c == 1), "{seen0:?}");
}

/// Control answers that the job failed (409, PROTOCOL.md §11.6): the
/// request ends at once with control's reason, not after the timeout.
#[test]
fn a_failed_job_s_worker_stops_with_control_s_reason() {
    let stop = Arc::new(AtomicBool::new(false));
    let (join, _, _) = live_and_dead(&stop);
    let why = "job 11 failed: part 1 (chunks 1..2, home appliance a1) is lost; evict it and admit again";
    let (url, asked) = fake_control(409, format!("{{\"error\": \"{why}\"}}"), Arc::clone(&stop));
    let config = WorkerConfig {
        timeout: Duration::from_secs(20),
        ..WorkerConfig::default()
    };
    let w = Worker::from_join_at(join, TOKEN, config, Some(&url)).unwrap();
    let mut params: Vec<f32> = (0..2 * ELEMS).map(|i| i as f32 * 0.5).collect();
    let t = std::time::Instant::now();
    let err = w.wait(w.init(0, &mut params).unwrap()).unwrap_err().to_string();
    stop.store(true, Ordering::Relaxed);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "failed after {:?}",
        t.elapsed()
    );
    assert!(err.contains("part 1") && err.contains("is lost"), "{err}");
    assert_eq!(
        *asked.lock().unwrap(),
        1,
        "asked once: a failed job does not come back"
    );
}
