//! The kernel-UDP backend end to end on loopback: a real dataplane with two
//! queues, a job installed through the management state, workers on UDP
//! sockets, every result checked; and a flood of garbage counted as drops.
//! With `--shm`: one worker through shared memory, one in datagrams.

use std::net::UdpSocket;
use std::time::Duration;

use phub_dataplane::app::{Appliance, BackendKind, Config};
use phub_engine::kernels;
use phub_net::shm::ShmRegion;
use phub_proto::api::InstallJob;
use phub_proto::layout::{layout, Place, Placement};
use phub_proto::memory::ResultStore;
use phub_proto::shm::{region_len, region_path, slot_offset, Part};
use phub_proto::spec::JobSpec;
use phub_proto::wire::{self, flags, DropReason, MsgType, Repr, HEADER_LEN};
use phub_proto::Dtype;

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

#[test]
fn three_workers_sum_over_udp_and_garbage_is_counted() {
    let app = Appliance::start(&config()).unwrap();
    let spec = JobSpec::from_toml(
        "name = \"t\"\nworkers = 3\nchunk_bytes = 256\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 150\n",
    )
    .unwrap();
    let mut load = vec![0; 2];
    let lay = layout(&spec, &mut load, u64::from);
    let places: Vec<Place> = Placement::new(&spec, lay.clone()).unwrap().places(0).collect();
    app.manager()
        .install(
            4,
            InstallJob {
                id: 4,
                token: 77,
                spec: spec.clone(),
                layout: lay.clone(),
                hierarchy: None,
                replication: None,
                entries: None,
            },
        )
        .unwrap();
    let err = app
        .manager()
        .install(
            4,
            InstallJob {
                id: 4,
                token: 77,
                spec,
                layout: lay.clone(),
                hierarchy: None,
                replication: None,
                entries: None,
            },
        )
        .unwrap_err();
    assert_eq!(err.status, 409);
    let base = app.data_addr();
    let socks: Vec<UdpSocket> = (0..3)
        .map(|_| {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s
        })
        .collect();
    let garbage = UdpSocket::bind("127.0.0.1:0").unwrap();
    for round in 0..4u32 {
        for (c, place) in places.iter().enumerate() {
            let elems = lay.chunk_len(150, c as u32) as usize;
            for (rank, s) in socks.iter().enumerate() {
                let carries = round > 0 || rank == 0;
                let vals: Vec<f32> = (0..if carries { elems } else { 0 })
                    .map(|e| (rank * 10 + e + round as usize) as f32)
                    .collect();
                let repr = Repr::request(
                    if round == 0 { MsgType::Init } else { MsgType::Push },
                    4,
                    77,
                    rank as u16,
                    round,
                    place.slot,
                )
                .with_payload(Dtype::F32, vals.len() as u16)
                .with_chunk(0, c as u32);
                let b = repr.to_datagram(&vals);
                let to = std::net::SocketAddrV4::new(*base.ip(), base.port() + place.lcore);
                s.send_to(&b, to).unwrap();
                garbage.send_to(&b[..b.len() / 2], to).unwrap();
            }
            for s in &socks {
                let mut buf = [0u8; 9000];
                let n = s.recv(&mut buf).unwrap();
                let (repr, payload) = wire::parse(&buf[..n]).unwrap();
                assert_eq!(
                    (repr.kind, repr.round, repr.chunk),
                    (MsgType::Result, round, c as u32)
                );
                let mut got = vec![0f32; elems];
                kernels::decode(Dtype::F32, payload, &mut got);
                for (e, g) in got.iter().enumerate() {
                    let want = if round == 0 {
                        e as f32
                    } else {
                        (30 + 3 * e + 3 * round as usize) as f32
                    };
                    assert_eq!(*g, want, "round {round} chunk {c} elem {e}");
                }
            }
        }
    }
    // Counters show the traffic and the garbage, by reason.
    std::thread::sleep(Duration::from_millis(100));
    let stats = app.manager().stats();
    let truncated: u64 = stats.lcores.iter().map(|l| l.drops.values().sum::<u64>()).sum();
    let rounds: u64 = stats.lcores.iter().map(|l| l.rounds_completed).sum();
    assert_eq!(rounds, 4 * lay.chunk_count() as u64);
    assert_eq!(truncated, 4 * 3 * lay.chunk_count() as u64);
    assert_eq!(stats.jobs.len(), 1);
    assert_eq!(stats.jobs[0].round_range, Some((3, 3)));
    assert!(stats.jobs[0].silent_ms.iter().all(Option::is_some));
    app.manager().remove(4).unwrap();
    assert_eq!(app.manager().remove(4).unwrap_err().status, 404);
    assert_eq!(app.manager().info().memory_used_bytes, 0);
    app.shutdown();
}

/// With --shm, a job's region files count: an install whose regions do
/// not fit /dev/shm's free space is refused before anything is made, with
/// the bytes needed and free; the same job fits without shared memory's
/// regions only as far as the budget goes.
#[test]
fn with_shm_regions_beyond_dev_shms_free_space_are_refused_naming_it() {
    let app = Appliance::start(&Config {
        shm: true,
        memory_budget: 1 << 50,
        ..config()
    })
    .unwrap();
    let mgr = app.manager();
    let info = mgr.info();
    // 64 workers, each with a staging region of the whole job: 65 regions
    // of 17 GB, terabytes; the heap's share (34 GB of slot buffers) is
    // within the budget, and is never allocated.
    let spec = JobSpec::from_toml(
        "name = \"t\"\nworkers = 64\nchunk_bytes = 8832\n[optimizer]\nkind = \"sum\"\n\
         [[keys]]\nelements = 4294967295\n",
    )
    .unwrap();
    let lay = layout(
        &spec,
        &mut [0, 0],
        info.memory_model.chunk_cost(&spec, ResultStore::SharedRegion),
    );
    let cost = info.memory_model.job_cost(&spec, &lay, ResultStore::SharedRegion);
    let free = phub_net::shm::free_bytes(std::path::Path::new("/dev/shm")).unwrap();
    assert!(cost.shm > free && cost.total() < info.memory_budget_bytes);
    let e = mgr
        .install(
            8,
            InstallJob {
                id: 8,
                token: 0x88,
                spec,
                layout: lay,
                hierarchy: None,
                replication: None,
                entries: None,
            },
        )
        .unwrap_err();
    assert_eq!(e.status, 507, "{e:?}");
    assert!(
        e.message.starts_with(&format!(
            "job 8's shared-memory regions need {} bytes in /dev/shm, which has ",
            cost.shm
        )) && e.message.ends_with(" bytes free"),
        "{}",
        e.message
    );
    assert!(mgr.list().is_empty());
    assert_eq!(mgr.info().memory_used_bytes, 0);
    app.shutdown();
}

#[test]
fn with_shm_a_local_worker_sends_and_gets_headers_only() {
    use clap::Parser;
    let cfg = Config::try_parse_from(["phub-dataplane", "--shm", "--backend", "dpdk"]).unwrap();
    let e = Appliance::start(&cfg).unwrap_err();
    assert!(
        e.to_string()
            .contains("--shm needs the udp backend (workers on this host)"),
        "{e:#}"
    );
    let app = Appliance::start(&Config {
        shm: true,
        ..config()
    })
    .unwrap();
    assert!(app.manager().info().shm);
    let spec = JobSpec::from_toml(
        "name = \"t\"\nworkers = 2\nchunk_bytes = 256\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 150\n",
    )
    .unwrap();
    let lay = layout(&spec, &mut [0, 0], u64::from);
    let places: Vec<Place> = Placement::new(&spec, lay.clone()).unwrap().places(0).collect();
    let token = 0x5111_0000_0000_0077;
    app.manager()
        .install(
            5,
            InstallJob {
                id: 5,
                token,
                spec,
                layout: lay.clone(),
                hierarchy: None,
                replication: None,
                entries: None,
            },
        )
        .unwrap();
    let base = app.data_addr();
    // What rank 0 opens, as a worker on this host would: its staging and
    // the result region of each lcore that has slots of the job.
    let open = |lcore: u16, part| {
        let len = region_len(
            lay.lcores[usize::from(lcore)].count as usize,
            lay.chunk_elems,
            Dtype::F32,
        );
        let p = region_path(base.port(), 5, token, lcore, part);
        (ShmRegion::open(&p, len).unwrap(), p)
    };
    let staging: Vec<(ShmRegion, _)> = (0..2).map(|l| open(l, Part::Staging(0))).collect();
    let results: Vec<(ShmRegion, _)> = (0..2).map(|l| open(l, Part::Results)).collect();
    let socks: Vec<UdpSocket> = (0..2)
        .map(|_| {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s
        })
        .collect();
    for round in 0..3u32 {
        for (c, place) in places.iter().enumerate() {
            let elems = lay.chunk_len(150, c as u32) as usize;
            let off = slot_offset(place.slot, lay.chunk_elems, Dtype::F32);
            for (rank, s) in socks.iter().enumerate() {
                let carries = round > 0 || rank == 0;
                let vals: Vec<f32> = (0..if carries { elems } else { 0 })
                    .map(|e| (rank * 10 + e + round as usize) as f32)
                    .collect();
                let shm = rank == 0;
                let repr = Repr::request(
                    if round == 0 { MsgType::Init } else { MsgType::Push },
                    5,
                    token,
                    rank as u16,
                    round,
                    place.slot,
                )
                .with_payload(Dtype::F32, vals.len() as u16)
                .with_chunk(0, c as u32)
                .with_flags(if shm { flags::SHM } else { 0 });
                let b = if shm {
                    let mut bytes = vec![0u8; 4 * vals.len()];
                    kernels::encode(Dtype::F32, &vals, &mut bytes);
                    assert!(staging[usize::from(place.lcore)].0.write(off, &bytes));
                    repr.to_datagram(&[])
                } else {
                    repr.to_datagram(&vals)
                };
                let to = std::net::SocketAddrV4::new(*base.ip(), base.port() + place.lcore);
                s.send_to(&b, to).unwrap();
            }
            let want: Vec<f32> = (0..elems)
                .map(|e| {
                    if round == 0 {
                        e as f32
                    } else {
                        (10 + 2 * e + 2 * round as usize) as f32
                    }
                })
                .collect();
            for (rank, s) in socks.iter().enumerate() {
                let mut buf = [0u8; 9000];
                let n = s.recv(&mut buf).unwrap();
                let (repr, payload) = wire::parse(&buf[..n]).unwrap();
                assert_eq!(
                    (repr.kind, repr.round, repr.chunk, usize::from(repr.count)),
                    (MsgType::Result, round, c as u32, elems)
                );
                let bytes = if rank == 0 {
                    assert_eq!((repr.flags, n), (flags::SHM, HEADER_LEN), "a header alone");
                    let mut b = vec![0u8; 4 * elems];
                    assert!(results[usize::from(place.lcore)].0.read(off, &mut b));
                    b
                } else {
                    assert_eq!(repr.flags, 0);
                    payload.to_vec()
                };
                let mut got = vec![0f32; elems];
                kernels::decode(Dtype::F32, &bytes, &mut got);
                assert_eq!(got, want, "rank {rank} round {round} chunk {c}");
            }
        }
    }
    let stats = app.manager().stats();
    let shm_rx: u64 = stats.lcores.iter().map(|l| l.shm_rx).sum();
    assert_eq!(shm_rx, 3 * lay.chunk_count() as u64, "rank 0's messages");
    app.manager().remove(5).unwrap();
    for (_, p) in staging.iter().chain(&results) {
        assert!(!p.exists(), "{} removed with the job", p.display());
    }
    app.shutdown();
}

/// PROTOCOL.md §1 and §7: the destination port decides the lcore. A message
/// sent to another lcore's port is that lcore's to judge: refused with an
/// ERROR to its source (`chunk_mismatch` where that lcore has a slot of that
/// number, `slot_out_of_range` where it has none of the job), never
/// aggregated, and not `misrouted` (the kernel delivered it to the socket
/// of its port). Sent again to the right port, it counts.
#[test]
fn a_message_sent_to_another_lcores_port_is_refused_there_with_an_error() {
    let app = Appliance::start(&config()).unwrap();
    let base = app.data_addr();
    let port = |lcore: u16| std::net::SocketAddrV4::new(*base.ip(), base.port() + lcore);
    // Job 6: chunk 0 (16 elements) on lcore 0, chunk 1 (8) on lcore 1.
    // Job 7: one chunk of 16, on lcore 0 alone.
    for (id, elements, slots) in [(6u16, 24, [1, 1]), (7, 16, [1, 0])] {
        let spec = JobSpec::from_toml(&format!(
            "name = \"t\"\nworkers = 1\nchunk_bytes = 64\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = {elements}\n"
        ))
        .unwrap();
        let lay = layout(&spec, &mut [0, 0], u64::from);
        assert_eq!(lay.lcores.iter().map(|r| r.count).collect::<Vec<_>>(), slots);
        assert_eq!(lay.lcores[0].first, 0);
        app.manager()
            .install(
                id,
                InstallJob {
                    id,
                    token: 0x77,
                    spec,
                    layout: lay,
                    hierarchy: None,
                    replication: None,
                    entries: None,
                },
            )
            .unwrap();
    }
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let vals = [1.5f32; 16];
    // Rank 0's INIT of chunk 0 (lcore 0, slot 0).
    let init = |job: u16| {
        let repr = Repr::request(MsgType::Init, job, 0x77, 0, 0, 0).with_payload(Dtype::F32, 16);
        (repr, repr.to_datagram(&vals))
    };
    let answer = |s: &UdpSocket| {
        let mut buf = [0u8; 9000];
        let n = s.recv(&mut buf).unwrap();
        let (r, payload) = wire::parse(&buf[..n]).unwrap();
        let mut v = vec![0f32; payload.len() / 4];
        kernels::decode(Dtype::F32, payload, &mut v);
        (r, v)
    };
    // Chunk 0 of job 6 lives at lcore 0, slot 0; lcore 1's slot 0 holds
    // chunk 1. Job 7 has no slot on lcore 1.
    for (job, reason) in [(6, DropReason::ChunkMismatch), (7, DropReason::SlotOutOfRange)] {
        let (repr, b) = init(job);
        s.send_to(&b, port(1)).unwrap();
        let (e, _) = answer(&s);
        assert_eq!(
            e,
            Repr {
                kind: MsgType::Error,
                count: 0,
                error: reason.code(),
                ..repr
            },
            "job {job}: the refused header echoed, with the reason"
        );
        s.send_to(&b, port(0)).unwrap();
        let (r, v) = answer(&s);
        assert_eq!((r.kind, r.job, r.round, r.chunk), (MsgType::Result, job, 0, 0));
        assert_eq!(v, vals);
    }
    std::thread::sleep(Duration::from_millis(100));
    let stats = app.manager().stats();
    let l1 = &stats.lcores[1];
    for r in [DropReason::ChunkMismatch, DropReason::SlotOutOfRange] {
        assert_eq!(l1.drops.get(r.name()).copied(), Some(1), "{r} on lcore 1");
    }
    assert_eq!((l1.pushes_aggregated, l1.errors_sent), (0, 2));
    assert_eq!(stats.lcores[0].rounds_completed, 2);
    assert!(stats.lcores.iter().all(|l| l.misrouted == 0));
    app.shutdown();
}

/// Each lcore states its receive buffer in /v1/info (workers size their
/// windows by it), and datagrams the kernel turned away because that
/// buffer was full are counted as `socket_full` drops: everything sent is
/// either received or counted.
#[test]
fn a_full_socket_buffer_is_stated_and_what_it_turns_away_is_counted() {
    let app = Appliance::start(&Config {
        // The kernel's smallest buffer: one 8 KiB datagram fills it.
        socket_buffer: 1,
        lcores: Some(1),
        ..config()
    })
    .unwrap();
    let info = app.manager().info();
    let rx = info.lcores[0]
        .rx_buffer_bytes
        .expect("the UDP backend states its buffer");
    assert!(rx > 0 && rx < 64 << 10, "SO_RCVBUF {rx} for a 1-byte request");
    let to = app.data_addr();
    let (threads, each) = (2, 4000u64);
    let senders: Vec<_> = (0..threads)
        .map(|_| {
            std::thread::spawn(move || {
                let s = UdpSocket::bind("127.0.0.1:0").unwrap();
                for _ in 0..each {
                    s.send_to(&[0u8; 8192], to).unwrap();
                }
            })
        })
        .collect();
    for t in senders {
        t.join().unwrap();
    }
    let sent = threads * each;
    let mut last = None;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(20));
        let l = app.manager().stats().lcores.remove(0);
        let full = l.drops.get("socket_full").copied().unwrap_or(0);
        if l.rx_packets + full == sent {
            assert!(
                full > 0,
                "{sent} datagrams into a one-datagram buffer: none turned away?"
            );
            assert_eq!(
                l.drops.get("bad_magic"),
                Some(&l.rx_packets),
                "what arrived was refused"
            );
            app.shutdown();
            return;
        }
        last = Some((l.rx_packets, full));
    }
    panic!("sent {sent}; received and turned away (rx_packets, socket_full): {last:?}");
}
