//! `PUT /v1/jobs/{id}/epoch` (PROTOCOL.md §11.6) on a running dataplane
//! (kernel UDP on loopback, 2 lcores): a replicated job takes a new epoch
//! on every lcore (204, again 204 with nothing changed), an older epoch or
//! a job without replicas is refused 409, a job not installed 404, a
//! malformed view 400, each naming the job and the epoch; the change and
//! the worker messages of the old epoch are counted in the stats.

use std::io::{Read, Write};
use std::net::{TcpStream, UdpSocket};
use std::time::Duration;

use phub_dataplane::app::{Appliance, BackendKind, Config};
use phub_proto::api::{DataAddr, InstallJob, ReplicaPeer, Replication};
use phub_proto::failover::EpochView;
use phub_proto::layout::{ChunkRange, Layout};
use phub_proto::spec::{Appliances, JobSpec};
use phub_proto::wire::{self, DropReason, MsgType, Repr};

fn config() -> Config {
    Config {
        backend: BackendKind::Udp,
        host: "127.0.0.1".parse().unwrap(),
        base_port: 0,
        lcores: Some(2),
        mgmt: "127.0.0.1:0".parse().unwrap(),
        mgmt_token_file: None,
        memory_budget: 64 << 20,
        busy_poll: false,
        spin_us: phub_dataplane::spin::SpinSetting::Fixed(0),
        inject: None,
        no_pin: true,
        socket_buffer: 4 << 20,
        shm: false,
        build: "test".into(),
        dpdk: Default::default(),
    }
}

/// Job `id`, 12 chunks over this appliance (2 lcores, appliance 0) and a
/// second of 1 lcore (appliance 1, never started), replicas 2.
fn replicated(id: u16, base_port: u16) -> InstallJob {
    let spec = JobSpec::new("e", 2, &[12 * 2048])
        .sharded_over(Appliances::Count(2))
        .with_replicas(2);
    let chunk_elems = spec.chunk_elems();
    let run = |first, count| ChunkRange { first, count };
    let parts = [vec![run(0, 4), run(4, 4)], vec![run(8, 4)]];
    let appliances: Vec<ReplicaPeer> = parts
        .iter()
        .enumerate()
        .map(|(i, l)| ReplicaPeer {
            name: format!("a{i}"),
            data: DataAddr {
                host: "127.0.0.1".into(),
                base_port: if i == 0 { base_port } else { 1 },
            },
            rack: String::new(),
            layout: Layout {
                chunk_elems,
                lcores: l.clone(),
            },
        })
        .collect();
    InstallJob {
        id,
        token: 7,
        layout: appliances[0].layout.clone(),
        spec,
        hierarchy: None,
        entries: None,
        replication: Some(Replication {
            epoch: 0,
            appliance: 0,
            appliances,
            down: Vec::new(),
            joined: Vec::new(),
            moved: Vec::new(),
            restored: 0,
        }),
    }
}

/// A PUT of `body` to `path` on the management API: status and body.
fn put(app: &Appliance, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(app.mgmt_addr()).unwrap();
    write!(
        s,
        "PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        app.mgmt_token(),
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

#[test]
fn an_epoch_is_taken_on_every_lcore_or_refused_naming_job_and_epoch() {
    let app = Appliance::start(&config()).unwrap();
    let base = app.data_addr().port();
    app.manager().install(3, replicated(3, base)).unwrap();
    let e1 = serde_json::to_string(&EpochView {
        epoch: 1,
        down: vec![1],
        ..Default::default()
    })
    .unwrap();
    assert_eq!(put(&app, "/v1/jobs/3/epoch", &e1).0, 204);
    assert_eq!(put(&app, "/v1/jobs/3/epoch", &e1).0, 204, "the same epoch again");
    let (st, why) = put(&app, "/v1/jobs/3/epoch", r#"{"epoch": 0}"#);
    assert_eq!(st, 409, "{why}");
    assert!(
        why.contains("job 3") && why.contains("epoch 0") && why.contains("epoch 1 is installed"),
        "{why}"
    );
    let (st, why) = put(&app, "/v1/jobs/3/epoch", r#"{"epoch": 2, "down": [5]}"#);
    assert_eq!(st, 400, "{why}");
    assert!(why.contains("down [5]") && why.contains("0..2"), "{why}");
    let (st, why) = put(&app, "/v1/jobs/3/epoch", r#"{"epoch": "two"}"#);
    assert_eq!(st, 400, "{why}");
    assert!(why.contains("epoch of job 3"), "{why}");
    let (st, why) = put(&app, "/v1/jobs/9/epoch", &e1);
    assert_eq!(st, 404, "{why}");
    assert!(why.contains("job 9 is not installed"), "{why}");
    // A job without replicas has no epochs.
    let mut plain = replicated(4, base);
    plain.spec = plain.spec.with_replicas(1).sharded_over(Appliances::Count(1));
    plain.replication = None;
    plain.layout = phub_proto::layout::layout(&plain.spec, &mut [0, 0], u64::from);
    app.manager().install(4, plain).unwrap();
    let (st, why) = put(&app, "/v1/jobs/4/epoch", &e1);
    assert_eq!(st, 409, "{why}");
    assert!(why.contains("job 4") && why.contains("not replicated"), "{why}");

    // A worker still in epoch 0 gets an ERROR wrong_epoch carrying epoch 1.
    let w = UdpSocket::bind("127.0.0.1:0").unwrap();
    w.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let d = Repr::request(MsgType::Pull, 3, 7, 0, 0, 0).to_datagram(&[]);
    w.send_to(&d, app.data_addr()).unwrap();
    let mut buf = [0u8; 9000];
    let n = w.recv(&mut buf).unwrap();
    let (e, _) = wire::parse(&buf[..n]).unwrap();
    assert_eq!(e.kind, MsgType::Error);
    assert_eq!(e.error, DropReason::WrongEpoch.code());
    assert_eq!(wire::Header::new_checked(&buf[..n]).unwrap().epoch(), 1);

    let stats = app.manager().stats();
    let changes: u64 = stats.lcores.iter().map(|l| l.epoch_changes).sum();
    assert_eq!(changes, 2, "one change on each of the 2 lcores");
    let wrong: u64 = stats
        .lcores
        .iter()
        .filter_map(|l| l.drops.get("wrong_epoch"))
        .sum();
    assert_eq!(wrong, 1);
    app.shutdown();
}
