//! The DPDK backend in process, on a port made of rings (net_ring) with two
//! queues (`--ring-port`, its rings found by name): the test injects
//! crafted Ethernet frames into chosen RX queues and reads what the
//! dataplane sends from the TX rings. Checks exact sums,
//! duplicates not counted twice, lost results re-obtained, misrouted
//! packets handed to their lcore, ARP answered, malformed frames dropped by
//! reason, frames handed back on the completion ring freed, and the port's
//! own counters beside phub's.
//!
//! One EAL for this test binary (`--no-huge --no-pci`); skips with a printed
//! reason where the EAL cannot start.

#![cfg(feature = "dpdk")]

mod common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use phub_dataplane::app::{Appliance, BackendKind, Config, DpdkOptions};
use phub_dataplane::backend::dpdk::frame::{self, Frame, ParseOptions, PeerAddr};
use phub_engine::kernels;
use phub_ffi::{Eal, Mbuf, Mempool, Ring};
use phub_proto::api::InstallJob;
use phub_proto::layout::{layout, Place, Placement};
use phub_proto::spec::JobSpec;
use phub_proto::wire::{self, MsgType, Repr};
use phub_proto::Dtype;

const APPLIANCE: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const BASE: u16 = 7900;
const LCORES: usize = 2;

fn eal() -> Option<Eal> {
    common::test_eal("phub-dpdk-rings-test", 512, "(0-2)@(0-1)")
}

fn worker(rank: u16) -> PeerAddr {
    PeerAddr {
        mac: [2, 0, 0, 0, 1, rank as u8],
        ip: Ipv4Addr::new(10, 77, 0, 10 + rank as u8),
        port: 40000 + rank,
    }
}

struct Rig {
    app: Option<Appliance>,
    pool: Mempool,
    rx: Vec<Ring>,
    tx: Vec<Ring>,
    mac: [u8; 6],
}

impl Rig {
    /// The dataplane on its own ring port (`--ring-port name`), whose
    /// rings the test finds by name as another process would.
    fn start(eal: Eal, name: &str) -> Rig {
        let cfg = Config {
            backend: BackendKind::Dpdk,
            host: APPLIANCE,
            base_port: BASE,
            lcores: Some(LCORES),
            mgmt: "127.0.0.1:0".parse().unwrap(),
            mgmt_token_file: None,
            memory_budget: 64 << 20,
            busy_poll: false,
            spin_us: phub_dataplane::spin::SpinSetting::Fixed(0),
            inject: None,
            no_pin: true,
            socket_buffer: 0,
            shm: false,
            build: "test".into(),
            dpdk: DpdkOptions {
                ring_port: Some(name.into()),
                mbufs: 4096,
                mbuf_size: 9216 + 128,
                tx_mbufs: 4096,
                idle_backoff: true,
                ..DpdkOptions::default()
            },
        };
        let app = Appliance::start(&cfg).unwrap();
        let ring = |dir: &str, i: usize| Ring::lookup(eal, &format!("{name}-{dir}{i}")).unwrap();
        let rx: Vec<Ring> = (0..LCORES).map(|i| ring("rx", i)).collect();
        let tx: Vec<Ring> = (0..LCORES).map(|i| ring("tx", i)).collect();
        let id = eal
            .port_by_name(&format!("net_ring_{name}"))
            .expect("the ring port");
        let mac = phub_ffi::port::info(eal, id).unwrap().mac;
        Rig {
            app: Some(app),
            pool: Mempool::pktmbuf(eal, "inject", 4096, 0, 9216 + 128, None).unwrap(),
            rx,
            tx,
            mac,
        }
    }

    fn app(&self) -> &Appliance {
        self.app.as_ref().unwrap()
    }

    fn inject(&self, queue: usize, frame: &[u8]) {
        let mut m = self.pool.alloc().unwrap();
        assert!(m.extend_from_slice(frame));
        self.rx[queue].enqueue(m).unwrap();
    }

    /// Everything sent on any TX queue within `wait` (until `n` frames).
    fn collect(&self, n: usize, wait: Duration) -> Vec<(usize, Mbuf)> {
        let t = Instant::now();
        let mut out = Vec::new();
        let mut buf: [Option<Mbuf>; 32] = Default::default();
        while out.len() < n && t.elapsed() < wait {
            for (q, r) in self.tx.iter().enumerate() {
                let k = r.dequeue_burst(&mut buf);
                out.extend(buf[..k].iter_mut().map(|m| (q, m.take().unwrap())));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        out
    }

    fn drops(&self) -> std::collections::BTreeMap<String, u64> {
        self.app().manager().stats().total().drops
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(a) = self.app.take() {
            a.shutdown();
        }
    }
}

fn push_frame(rank: u16, repr: &Repr, vals: &[f32]) -> Vec<u8> {
    let b = repr.to_datagram(vals);
    with_udp_checksum(frame::udp_frame(
        &worker(rank),
        [2, 0, 0, 0, 0, 1],
        APPLIANCE,
        BASE,
        &b,
    ))
}

/// Fills in a frame's UDP checksum, as a kernel sender on a NIC does (a
/// ring port checks none, so the dataplane verifies them in software).
fn with_udp_checksum(mut f: Vec<u8>) -> Vec<u8> {
    let ip = frame::ipv4::Ipv4Packet::new_checked(&f[frame::ETH_LEN..]).unwrap();
    let (src, dst, at) = (ip.src_addr(), ip.dst_addr(), frame::ETH_LEN + ip.header_len());
    frame::udp::UdpPacket::new_unchecked(&mut f[at..]).set_checksum(0);
    let c = frame::udp_checksum(src, dst, &f[at..]);
    frame::udp::UdpPacket::new_unchecked(&mut f[at..]).set_checksum(c);
    f
}

/// Rewrites the UDP destination port of a frame built by push_frame.
fn to_port(mut f: Vec<u8>, port: u16) -> Vec<u8> {
    f[36..38].copy_from_slice(&port.to_be_bytes());
    with_udp_checksum(f)
}

/// A result frame: (worker it went to, header, payload as f32).
fn read_result(m: &Mbuf) -> (u16, Repr, Vec<f32>) {
    let bytes = m.to_vec();
    let dst_ip = Ipv4Addr::new(bytes[30], bytes[31], bytes[32], bytes[33]);
    let rank = u16::from(bytes[33]) - 10;
    let parsed = frame::parse(
        &bytes,
        &ParseOptions {
            ip: dst_ip,
            check_ip_checksum: true,
            check_udp_checksum: true,
        },
    )
    .expect("a well-formed frame, its UDP checksum verified");
    let Frame::Udp { from, payload, .. } = parsed else {
        panic!("not UDP")
    };
    assert_ne!(&bytes[40..42], &[0, 0], "results carry a UDP checksum");
    assert_eq!(from.ip, APPLIANCE);
    assert_eq!(&bytes[0..6], &worker(rank).mac, "sent to the worker's MAC");
    let (repr, p) = wire::parse(&bytes[payload]).unwrap();
    let mut vals = vec![0f32; p.len() / 4];
    kernels::decode(Dtype::F32, p, &mut vals);
    (rank, repr, vals)
}

#[test]
fn a_ring_port_aggregates_exactly_hands_over_misrouted_and_drops_by_reason() {
    let Some(eal) = eal() else { return };
    let rig = Rig::start(eal, "phub0");
    let spec = JobSpec::from_toml(
        "name = \"t\"\nworkers = 3\nchunk_bytes = 1024\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 1000\n",
    )
    .unwrap();
    let mut load = vec![0; LCORES];
    let lay = layout(&spec, &mut load, u64::from);
    let places: Vec<Place> = Placement::new(&spec, lay.clone()).unwrap().places(0).collect();
    rig.app()
        .manager()
        .install(
            3,
            InstallJob {
                id: 3,
                token: 99,
                spec,
                layout: lay.clone(),
                hierarchy: None,
                replication: None,
                entries: None,
            },
        )
        .unwrap();
    let chunks = places.len();
    assert!(chunks >= 3, "{chunks} chunks");
    let mut misrouted_sent = 0;
    for round in 0..4u32 {
        for (c, place) in places.iter().enumerate() {
            let elems = lay.chunk_len(1000, c as u32) as usize;
            for rank in 0..3u16 {
                let carries = round > 0 || rank == 0;
                let vals: Vec<f32> = (0..if carries { elems } else { 0 })
                    .map(|e| (usize::from(rank) * 10 + e + round as usize) as f32)
                    .collect();
                let repr = Repr::request(
                    if round == 0 { MsgType::Init } else { MsgType::Push },
                    3,
                    99,
                    rank,
                    round,
                    place.slot,
                )
                .with_payload(Dtype::F32, vals.len() as u16)
                .with_chunk(0, c as u32);
                let f = to_port(push_frame(rank, &repr, &vals), BASE + place.lcore);
                // Rank 2's pushes land on the other lcore's queue: the
                // dataplane must hand them over.
                let q = if rank == 2 {
                    misrouted_sent += 1;
                    (usize::from(place.lcore) + 1) % LCORES
                } else {
                    usize::from(place.lcore)
                };
                rig.inject(q, &f);
                // Rank 0 sends every push twice: counted once. (The copy is
                // queued ahead of rank 1's push on the same ring, so the
                // round is still open when it arrives.)
                if rank == 0 {
                    rig.inject(q, &f);
                }
            }
            let got = rig.collect(3, Duration::from_secs(5));
            assert_eq!(got.len(), 3, "round {round} chunk {c}: results for all 3 ranks");
            let mut ranks = Vec::new();
            // One copy of the result for every rank: their frames' payload
            // segments are one buffer.
            let payloads: std::collections::BTreeSet<usize> = got
                .iter()
                .filter_map(|(_, m)| m.segments().get(1).map(|p| p.as_ptr() as usize))
                .collect();
            if round > 0 && elems > 0 {
                assert_eq!(payloads.len(), 1, "round {round} chunk {c}: one shared payload");
            }
            for (q, m) in &got {
                assert_eq!(*q, usize::from(place.lcore), "sent from the owning lcore's queue");
                if round > 0 && elems > 0 {
                    assert_eq!(m.nb_segs(), 2, "header mbuf + shared payload");
                }
                let (rank, repr, vals) = read_result(m);
                ranks.push(rank);
                assert_eq!(
                    (repr.kind, repr.round, repr.chunk),
                    (MsgType::Result, round, c as u32)
                );
                assert_eq!(vals.len(), elems);
                for (e, v) in vals.iter().enumerate() {
                    let want = if round == 0 {
                        e as f32
                    } else {
                        (30 + 3 * e + 3 * round as usize) as f32
                    };
                    assert_eq!(*v, want, "round {round} chunk {c} elem {e} to rank {rank}");
                }
            }
            ranks.sort_unstable();
            assert_eq!(ranks, vec![0, 1, 2]);
        }
    }
    // A lost result: rank 0 pushes the last round again and gets the
    // stored result, alone.
    let place = places[0];
    let elems = lay.chunk_len(1000, 0) as usize;
    let vals: Vec<f32> = (0..elems).map(|e| (e + 3) as f32).collect();
    let repr = Repr::request(MsgType::Push, 3, 99, 0, 3, place.slot)
        .with_payload(Dtype::F32, elems as u16)
        .with_flags(wire::flags::RETRANSMIT);
    rig.inject(
        usize::from(place.lcore),
        &to_port(push_frame(0, &repr, &vals), BASE + place.lcore),
    );
    let got = rig.collect(1, Duration::from_secs(5));
    assert_eq!(got.len(), 1);
    let (rank, r, v) = read_result(&got[0].1);
    assert_eq!((rank, r.round), (0, 3));
    assert_eq!(v[0], 39.0);
    // Handed back on the port's completion ring (as a NIC's TX completion),
    // a sent frame is taken and freed by the lcore that sent it.
    let done = Ring::lookup(eal, &format!("phub0-done{}", place.lcore)).unwrap();
    let (_, m) = got.into_iter().next().unwrap();
    done.enqueue(m).unwrap();
    let t = Instant::now();
    while !done.is_empty() && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        done.is_empty(),
        "the lcore took the frame off its completion ring"
    );

    // Malformed frames, one of each kind, and an ARP request.
    let good = to_port(push_frame(0, &repr, &vals), BASE);
    let mut not_ip = good.clone();
    not_ip[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    let mut bad_sum = good.clone();
    bad_sum[24] ^= 0x55;
    let wrong_port = to_port(good.clone(), BASE + 50);
    let mut short_udp = good.clone();
    short_udp[38..40].copy_from_slice(&4u16.to_be_bytes());
    let other_host = frame::udp_frame(
        &worker(0),
        rig.mac,
        Ipv4Addr::new(10, 77, 0, 99),
        BASE,
        &[0u8; 100],
    );
    let mut bad_magic = good.clone();
    bad_magic[42] = b'X';
    let bad_magic = with_udp_checksum(bad_magic);
    // A bit flipped on the way: the UDP checksum no longer verifies.
    let mut flipped = good.clone();
    flipped[200] ^= 0x10;
    for f in [
        &not_ip,
        &bad_sum,
        &wrong_port,
        &short_udp,
        &other_host,
        &bad_magic,
        &flipped,
        &good[..20].to_vec(),
    ] {
        rig.inject(0, f);
    }
    rig.inject(1, &frame::arp_request(&worker(1), APPLIANCE));
    rig.inject(1, &frame::arp_request(&worker(1), Ipv4Addr::new(10, 77, 0, 98)));
    let arp = rig.collect(1, Duration::from_secs(5));
    assert_eq!(arp.len(), 1, "one ARP reply");
    let a = arp[0].1.to_vec();
    assert_eq!(&a[0..6], &worker(1).mac);
    assert_eq!(&a[22..28], &rig.mac, "answered with the port's MAC");
    assert_eq!(&a[28..32], &APPLIANCE.octets());
    drop(arp);
    std::thread::sleep(Duration::from_millis(100));
    let d = rig.drops();
    let stats = rig.app().manager().stats();
    let misrouted: u64 = stats.lcores.iter().map(|l| l.misrouted).sum();
    assert_eq!(misrouted, misrouted_sent, "every misrouted push counted once");
    assert_eq!(d.get("duplicate"), Some(&(4 * chunks as u64)), "{d:?}");
    for reason in [
        "not_ipv4",
        "bad_ip_checksum",
        "wrong_port",
        "bad_udp_length",
        "not_our_address",
        "bad_magic",
        "bad_udp_checksum",
        "bad_ip_header",
        "arp_not_for_us",
    ] {
        assert_eq!(d.get(reason), Some(&1), "{reason}: {d:?}");
    }
    let arps: u64 = stats.lcores.iter().map(|l| l.arp_replies).sum();
    assert_eq!(arps, 1);
    let rounds: u64 = stats.lcores.iter().map(|l| l.rounds_completed).sum();
    assert_eq!(rounds, 4 * chunks as u64);
    let port = stats.port.expect("DPDK port stats");
    assert!(port.ipackets > 0 && port.opackets > 0, "{port:?}");
    assert_eq!(stats.backend, phub_proto::api::BackendKind::Dpdk);
    let info = rig.app().manager().info();
    assert_eq!(info.backend, phub_proto::api::BackendKind::Dpdk);
    assert_eq!(info.data.base_port, BASE);
}
