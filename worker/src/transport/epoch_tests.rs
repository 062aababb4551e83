//! A replicated job's transport across epochs (PROTOCOL.md §11.6), driven
//! without a socket: three appliances of one lcore each, every part held
//! by two of them, appliances played by hand (RESULTs and ERRORs crafted
//! with [`Repr`]).
// Test data: small numbers cast freely.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use phub_proto::failover::{ReplicaLayout, Served};
use phub_proto::layout::ChunkRange;
use phub_proto::wire::{Header, HEADER_LEN};

use super::*;
use crate::codec;
use crate::elem::Values;

const JOB: u16 = 9;
const TOKEN: u64 = 0x000e_90c4;
const RANK: u16 = 0;
const ELEMS: usize = 4;
const MS: Duration = Duration::from_millis(1);
/// Chunks per appliance (each appliance has one lcore).
const PART: u64 = 2;
const APPLIANCES: usize = 3;
/// The one key's chunks: every appliance's part.
const CHUNKS: u32 = (PART as u32) * APPLIANCES as u32;

/// Appliance `a`'s lcore (lcore `a` of the layout).
fn addr(a: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9100 + a as u16))
}

fn runs() -> Vec<ChunkRange> {
    (0..APPLIANCES as u64)
        .map(|a| ChunkRange {
            first: a * PART,
            count: PART,
        })
        .collect()
}

/// The layout the tests check the transport against (built apart from
/// the transport's).
fn layout() -> ReplicaLayout<String> {
    ReplicaLayout::new(runs(), &[1; APPLIANCES], vec![String::new(); APPLIANCES], 2).unwrap()
}

fn routing(epoch: EpochView) -> Routing {
    Routing::new(
        runs(),
        &[1; APPLIANCES],
        vec![String::new(); APPLIANCES],
        2,
        epoch,
        (0..APPLIANCES).map(addr).collect(),
        vec![0],
    )
    .unwrap()
}

fn down(epoch: u32, down: &[u16]) -> EpochView {
    EpochView {
        epoch,
        down: down.to_vec(),
        ..Default::default()
    }
}

fn grad(c: u32) -> [f32; ELEMS] {
    std::array::from_fn(|i| (c * 10) as f32 + i as f32)
}

/// A datagram the transport sent, parsed, with its header's epoch.
#[derive(Debug, Clone, PartialEq)]
struct Sent {
    to: SocketAddr,
    repr: Repr,
    epoch: u32,
}

struct Harness {
    t: Transport<u32>,
    stats: Arc<Counters>,
    t0: Instant,
    now: Instant,
}

impl Harness {
    /// A transport for the job in `epoch`; `None`: the job is not
    /// replicated (no routing).
    fn new(epoch: Option<EpochView>) -> Harness {
        Harness::with_window(epoch, 64, true)
    }

    /// As [`Harness::new`], with a flow window of `window` chunks and
    /// `in_order` as the join sets it (false for a hierarchical spec).
    fn with_window(epoch: Option<EpochView>, window: usize, in_order: bool) -> Harness {
        let stats = Arc::new(Counters::default());
        let info = JobInfo {
            job: JOB,
            token: TOKEN,
            rank: RANK,
            dtype: Dtype::F32,
            in_order,
        };
        let t0 = Instant::now();
        let mut t = Transport::new(
            info,
            window,
            &WorkerConfig::default(),
            Arc::clone(&stats),
            None,
            t0,
        );
        if let Some(e) = epoch {
            t.set_routing(routing(e));
        }
        Harness {
            t,
            stats,
            t0,
            now: t0,
        }
    }

    fn at(&mut self, ms: u64) {
        let to = self.t0 + MS * ms as u32;
        assert!(to >= self.now, "the clock goes forward");
        self.now = to;
    }

    /// Round `round` of key 0 (`chunks` chunks), encoded as the API side
    /// encodes it: each chunk for its home lcore and slot, epoch 0.
    fn push(&mut self, round: u32, chunks: u32) {
        let bytes = HEADER_LEN + ELEMS * 4;
        let mut buf = vec![0u8; chunks as usize * bytes];
        let mut msgs = Vec::new();
        for c in 0..chunks {
            let start = c as usize * bytes;
            let home = layout().serve(u64::from(c), &EpochView::default()).unwrap();
            let r = Repr::request(MsgType::Push, JOB, TOKEN, RANK, round, home.slot as u32)
                .with_payload(Dtype::F32, ELEMS as u16)
                .with_chunk(0, c);
            let mut h = Header::new_unchecked(&mut buf[start..start + bytes]);
            r.emit(&mut h);
            codec::encode(Dtype::F32, &grad(c), h.payload_mut());
            msgs.push(ChunkMsg {
                chunk: c,
                slot: home.slot as u32,
                offset: c as usize * ELEMS,
                len: ELEMS as u32,
                to: addr(home.appliance),
                lcore: home.appliance as u16,
                start,
                bytes,
            });
        }
        self.t.submit(
            self.now,
            Request {
                key: 0,
                round,
                kind: Kind::Push,
                chunks: msgs,
                tx: Tx::Owned(buf),
                sink: Sink::Owned(Values::F32(vec![f32::NAN; chunks as usize * ELEMS])),
                done: 0,
            },
        );
    }

    fn poll(&mut self) -> Vec<Sent> {
        let mut out = Vec::new();
        self.t.poll_transmit(self.now, &mut out);
        out.iter()
            .map(|d| {
                let mut bytes = d.head.to_vec();
                bytes.extend_from_slice(d.body);
                let (repr, _) = wire::parse(&bytes).expect("well-formed");
                Sent {
                    to: d.to,
                    repr,
                    epoch: Header::new_unchecked(&bytes[..]).epoch(),
                }
            })
            .collect()
    }

    /// A RESULT of chunk `c` in `round` at `slot`, from an appliance in
    /// `epoch`.
    fn result(&mut self, c: u32, round: u32, slot: u32, epoch: u32) {
        let r = Repr::request(MsgType::Result, JOB, TOKEN, APPLIANCE_RANK, round, slot)
            .with_payload(Dtype::F32, ELEMS as u16)
            .with_chunk(0, c);
        let mut d = r.to_datagram(&grad(c));
        Header::new_unchecked(&mut d[..]).set_epoch(epoch);
        self.t.handle_datagram(self.now, &d);
    }

    /// An ERROR `wrong_epoch` refusing chunk `c` of `round` sent at
    /// `slot`, from an appliance in `epoch`.
    fn wrong_epoch(&mut self, c: u32, round: u32, slot: u32, epoch: u32) {
        let mut r = Repr::request(MsgType::Error, JOB, TOKEN, RANK, round, slot).with_chunk(0, c);
        r.dtype = Dtype::F32;
        r.error = DropReason::WrongEpoch.code();
        let mut d = r.to_datagram(&[]);
        Header::new_unchecked(&mut d[..]).set_epoch(epoch);
        self.t.handle_datagram(self.now, &d);
    }

    /// Ended requests: (round, values) or the error.
    fn ended(&mut self) -> Vec<Result<(u32, Vec<f32>), WorkerError>> {
        std::iter::from_fn(|| self.t.poll_done())
            .map(|f| {
                f.result.map(|o| match o.sink {
                    Sink::Owned(Values::F32(v)) => (o.round, v),
                    other => panic!("an owned f32 sink came back as {other:?}"),
                })
            })
            .collect()
    }
}

/// Where `layout()` serves chunk `c` in `epoch`, as a destination.
fn served(c: u32, epoch: &EpochView) -> (SocketAddr, u32, Served) {
    let s = layout().serve(u64::from(c), epoch).unwrap();
    (addr(s.appliance), s.slot as u32, s)
}

#[test]
fn every_chunk_goes_where_serve_puts_it_with_the_epoch_in_its_header() {
    // Joined in epoch 1, appliance 1 down: its part is served by its
    // backup, in that appliance's backup slots.
    let e1 = down(1, &[1]);
    let mut h = Harness::new(Some(e1.clone()));
    h.push(1, CHUNKS);
    let sent = h.poll();
    assert_eq!(sent.len(), CHUNKS as usize);
    let mut adopted = 0;
    for s in &sent {
        let (to, slot, place) = served(s.repr.chunk, &e1);
        assert_eq!(
            (s.to, s.repr.slot, s.epoch),
            (to, slot, 1),
            "chunk {}",
            s.repr.chunk
        );
        adopted += usize::from(place.adopted);
    }
    assert_eq!(adopted, PART as usize, "appliance 1's part, served elsewhere");
    assert!(
        sent.iter().all(|s| s.to != addr(1)),
        "nothing to the down appliance"
    );
}

#[test]
fn a_job_without_replication_keeps_its_homes_and_epoch_0() {
    let mut h = Harness::new(None);
    h.push(1, CHUNKS);
    for s in h.poll() {
        let (to, slot, _) = served(s.repr.chunk, &EpochView::default());
        assert_eq!((s.to, s.repr.slot, s.epoch), (to, slot, 0));
    }
}

/// PROTOCOL.md §11.6: an ERROR `wrong_epoch` naming a newer epoch makes
/// the transport ask for it; once given, every chunk still unanswered goes
/// at once to its new primary with the new epoch, the same round, as a
/// first transmission; one answered before the switch is not sent again,
/// and a RESULT from the old primary still answers (§11.4 (a)).
#[test]
fn a_newer_wrong_epoch_re_addresses_every_unanswered_chunk_to_its_new_primary() {
    let e0 = EpochView::default();
    let mut h = Harness::new(Some(e0.clone()));
    h.push(4, CHUNKS);
    assert_eq!(h.poll().len(), CHUNKS as usize);
    h.at(1);
    // Appliance 0 answers chunk 0 in epoch 0, then appliance 1 dies.
    let (_, slot0, _) = served(0, &e0);
    h.result(0, 4, slot0, 0);
    assert_eq!(h.t.poll_epoch(), None, "nothing asked yet");
    // Appliance 2 has installed epoch 1 and refuses chunk 4.
    h.at(2);
    let (_, slot4, _) = served(4, &e0);
    h.wrong_epoch(4, 4, slot4, 1);
    assert_eq!(
        h.t.poll_epoch(),
        Some(1),
        "the epoch the ERROR named is asked for"
    );
    assert_eq!(h.t.poll_epoch(), None, "asked once");
    assert_eq!(h.poll(), [], "nothing moves before the epoch is known");
    assert!(h.ended().is_empty(), "the ERROR fails nothing");
    // Control serves epoch 1: appliance 1 down.
    h.at(3);
    let e1 = down(1, &[1]);
    assert_eq!(h.t.set_epoch(h.now, e1.clone()), CHUNKS as usize - 1);
    let sent = h.poll();
    let mut chunks: Vec<u32> = sent.iter().map(|s| s.repr.chunk).collect();
    chunks.sort_unstable();
    assert_eq!(
        chunks,
        [1, 2, 3, 4, 5],
        "every unanswered chunk, once; chunk 0 not again"
    );
    for s in &sent {
        let (to, slot, _) = served(s.repr.chunk, &e1);
        assert_eq!(
            (s.to, s.repr.slot, s.epoch, s.repr.round),
            (to, slot, 1, 4),
            "chunk {}",
            s.repr.chunk
        );
        assert_eq!(
            s.repr.flags & flags::RETRANSMIT,
            0,
            "a first transmission on its new path"
        );
    }
    let (to2, _, p2) = served(2, &e1);
    assert!(
        p2.adopted && to2 != addr(1),
        "chunk 2 moved off the dead appliance"
    );
    // The new primary answers in epoch 1 at the extended slot; the old
    // primary's late RESULT of chunk 3 (sent before it died) answers too.
    h.at(4);
    for c in [1, 2, 4, 5] {
        let (_, slot, _) = served(c, &e1);
        h.result(c, 4, slot, 1);
    }
    let (_, old3, _) = served(3, &e0);
    h.result(3, 4, old3, 0);
    let done = h.ended();
    assert_eq!(done.len(), 1, "{done:?}");
    let (round, values) = done[0].as_ref().expect("completed");
    assert_eq!(*round, 4);
    let want: Vec<f32> = (0..CHUNKS).flat_map(grad).collect();
    assert_eq!(values, &want);
    assert_eq!(h.stats.snapshot().results_accepted, u64::from(CHUNKS));
    assert_eq!(h.t.epoch(), Some(&e1));
}

/// An ERROR `wrong_epoch` naming an older epoch than the worker's: the
/// appliance has not installed the worker's yet. Nothing is asked, nothing
/// moves; the chunk is sent again on the timer, to the same place.
#[test]
fn an_older_wrong_epoch_keeps_the_chunk_pending_and_resends_it_on_the_timer() {
    let e2 = down(2, &[1]);
    let mut h = Harness::new(Some(e2.clone()));
    h.push(1, CHUNKS);
    let first = h.poll();
    h.at(1);
    let (to2, slot2, _) = served(2, &e2);
    h.wrong_epoch(2, 1, slot2, 1);
    assert_eq!(h.t.poll_epoch(), None);
    assert_eq!(h.poll(), [], "not resent at once");
    assert!(h.ended().is_empty(), "not failed");
    // The others answer; chunk 2 is resent by the loss timer, unchanged.
    for s in first.iter().filter(|s| s.repr.chunk != 2) {
        h.result(s.repr.chunk, 1, s.repr.slot, 2);
    }
    let mut resent = Vec::new();
    for ms in 2..5_000 {
        h.at(ms);
        h.t.handle_timeout(h.now);
        resent = h.poll();
        if !resent.is_empty() {
            break;
        }
    }
    assert_eq!(resent.len(), 1, "{resent:?}");
    let r = &resent[0];
    assert_eq!((r.repr.chunk, r.to, r.repr.slot, r.epoch), (2, to2, slot2, 2));
    assert_ne!(r.repr.flags & flags::RETRANSMIT, 0);
}

/// PROTOCOL.md §11.7: once the whole job went back to its checkpoints
/// (the view's `restored` epoch), a RESULT sent in an earlier epoch is of
/// a round the appliances repeat since and may answer differently: held
/// in the network, it is ignored (counted), and the chunk waits for the
/// answer of the epoch it went back at or a later one.
#[test]
fn a_result_sent_before_the_job_went_back_to_its_checkpoints_is_ignored() {
    let back = EpochView {
        epoch: 3,
        restored: 2,
        ..Default::default()
    };
    let mut h = Harness::new(Some(back.clone()));
    h.push(1, CHUNKS);
    let sent = h.poll();
    assert_eq!(sent.len(), CHUNKS as usize);
    h.at(1);
    let ignored = h.stats.results_ignored.load(Ordering::Relaxed);
    for s in &sent {
        h.result(s.repr.chunk, 1, s.repr.slot, 1);
    }
    assert!(h.ended().is_empty(), "answered by a history the job left");
    assert_eq!(
        h.stats.results_ignored.load(Ordering::Relaxed),
        ignored + u64::from(CHUNKS)
    );
    // The restored appliances' answers (at the epoch it went back at, and
    // after) complete it.
    for (i, s) in sent.iter().enumerate() {
        h.result(s.repr.chunk, 1, s.repr.slot, if i % 2 == 0 { 2 } else { 3 });
    }
    let ended = h.ended();
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].as_ref().map(|(r, _)| *r).ok(), Some(1), "{ended:?}");
    // A job that never went back keeps taking RESULTs of earlier epochs
    // (a failover's new primary answers what the old one completed).
    let mut h = Harness::new(Some(down(3, &[1])));
    h.push(1, CHUNKS);
    for s in h.poll() {
        h.result(s.repr.chunk, 1, s.repr.slot, 0);
    }
    assert_eq!(h.ended().len(), 1);
}

/// A chunk retransmitted [`SILENT_SENDS`] times without an answer makes
/// the transport ask whether the epoch held is still current; told it is,
/// it goes on retransmitting to the same place.
#[test]
fn silence_asks_for_the_epoch_after_silent_sends_retransmissions() {
    let e0 = EpochView::default();
    let mut h = Harness::new(Some(e0.clone()));
    h.push(1, 1);
    assert_eq!(h.poll().len(), 1);
    let mut resends = 0;
    let mut asked_after = None;
    for ms in 1..120_000 {
        h.at(ms);
        h.t.handle_timeout(h.now);
        resends += h.poll().len() as u32;
        if let Some(e) = h.t.poll_epoch() {
            assert_eq!(e, 0, "the epoch held: is it still current?");
            asked_after = Some(resends);
            break;
        }
    }
    assert_eq!(asked_after, Some(SILENT_SENDS));
    // Unchanged: nothing moves, and the chunk is resent on the timer.
    assert_eq!(h.t.set_epoch(h.now, e0.clone()), 0);
    assert_eq!(h.poll(), []);
    let (to, slot, _) = served(0, &e0);
    let start = h.now.duration_since(h.t0).as_millis() as u64;
    let mut again = Vec::new();
    for ms in start + 1..start + 120_000 {
        h.at(ms);
        h.t.handle_timeout(h.now);
        again = h.poll();
        if !again.is_empty() {
            break;
        }
    }
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].to, again[0].repr.slot, again[0].epoch), (to, slot, 0));
}

/// Control never served the epoch an appliance named: every request fails
/// with the reason, naming the job and both epochs.
#[test]
fn an_epoch_control_never_serves_fails_the_requests_naming_it() {
    let mut h = Harness::new(Some(EpochView::default()));
    h.push(1, CHUNKS);
    h.poll();
    h.t.epoch_unavailable(|| WorkerError::Epoch {
        job: JOB,
        wanted: 3,
        held: 0,
        url: "http://127.0.0.1:1/v1/jobs/9/epoch".into(),
        waited: Duration::from_secs(10),
        message: "control serves epoch 2".into(),
    });
    let done = h.ended();
    assert_eq!(done.len(), 1);
    let e = done[0].as_ref().unwrap_err().to_string();
    for part in ["job 9", "epoch 3", "epoch 0", "127.0.0.1:1", "epoch 2"] {
        assert!(e.contains(part), "{e:?} names {part}");
    }
    assert!(!h.t.busy());
}

#[test]
fn an_index_moved_by_a_drain_is_sent_to_its_new_appliance_from_that_epoch_on() {
    let mut r = routing(EpochView::default());
    let data = phub_proto::api::DataAddr {
        host: "127.0.0.2".into(),
        base_port: 9300,
    };
    let e1 = EpochView::default().with_moved(1, "d", data);
    r.set_epoch(e1.clone());
    let moved = SocketAddr::from(([127, 0, 0, 2], 9300));
    for c in 0..CHUNKS {
        let s = layout().serve(u64::from(c), &e1).unwrap();
        let want = if s.appliance == 1 {
            moved
        } else {
            addr(s.appliance)
        };
        assert_eq!(r.place(0, c).unwrap().to, want, "chunk {c}");
    }
    // Index 1 serves nothing at first (it joined empty); once its partner
    // is down it serves its part, at the new address.
    let e2 = e1.with_down(2).unwrap();
    r.set_epoch(e2);
    assert_eq!(r.place(0, PART as u32).unwrap().to, moved);
    assert_eq!(r.place(0, 0).unwrap().to, addr(0));
}

/// A hierarchical job (PROTOCOL.md §11.11), one lcore per appliance: at
/// epoch 0 every chunk goes to this rank's rack appliance (1), at the slot
/// its rack layout gives it (the whole job on that lcore), and not past
/// that appliance's own slots in the answer streams; from epoch 1 on,
/// where the replicated layout serves it, as for a flat job.
#[test]
fn a_hierarchical_job_s_chunks_go_to_the_rack_at_epoch_0_and_where_served_after() {
    let mut r = routing(EpochView::default());
    let rack = vec![ChunkRange {
        first: 0,
        count: u64::from(CHUNKS),
    }];
    assert!(r.set_rack(3, rack.clone()).is_err(), "no appliance 3");
    assert!(r.set_rack(1, Vec::new()).is_err(), "a rack layout of no lcore");
    r.set_rack(1, rack).unwrap();
    for c in 0..CHUNKS {
        let p = r.place(0, c).unwrap();
        assert_eq!((p.to, p.lcore, p.slot), (addr(1), 1, c), "chunk {c}");
        assert!(!r.adopted_slot(p.lcore, p.slot), "chunk {c}: a rack slot");
    }
    let e1 = down(1, &[2]);
    r.set_epoch(e1.clone());
    for c in 0..CHUNKS {
        let s = layout().serve(u64::from(c), &e1).unwrap();
        let p = r.place(0, c).unwrap();
        assert_eq!(
            (p.to, p.lcore, p.slot),
            (addr(s.appliance), s.appliance as u16, s.slot as u32),
            "chunk {c}"
        );
    }
}

/// A replicated hierarchical job's rank (its spec hierarchical, so
/// `in_order` false, as for any hierarchical job: its rack slots answer a
/// chunk when the chunk's home does) makes its automatic window for its
/// rack appliance's lcores while its chunks go there (epoch 0, §11.11),
/// and remakes it for every appliance's at the first epoch change, when
/// the job goes flat (measured: made for every appliance's from the
/// start, the rack appliance's buffer took three times its share, and the
/// ranks resent about 27,000 chunks per 30 ResNet-50 rounds). Results
/// overtaking a chunk do not make it lost before it has been out for an
/// RTO, at either epoch.
#[test]
fn a_hierarchical_job_s_window_is_its_rack_s_until_it_goes_flat() {
    let d = HEADER_LEN + ELEMS * 4;
    // An incast bound of 2 chunks per lcore: 2 for the rack's one
    // lcore, 6 (the job's chunks) for the three appliances'.
    let auto = AutoWindow {
        workers: 1,
        lcores: 1,
        chunks: CHUNKS as usize,
        datagram: d,
        own_rcvbuf: 64 << 20,
        joined: 2 * 2 * d.max(64),
    };
    assert_eq!(auto.window(auto.joined), 2);
    let rack = || {
        vec![ChunkRange {
            first: 0,
            count: u64::from(CHUNKS),
        }]
    };
    let mut h = Harness::with_window(Some(EpochView::default()), 2, false);
    h.t.set_auto_window(auto);
    h.t.set_rack(1, rack()).unwrap();
    assert_eq!(h.t.window(), 2);
    // With a window of 6: chunks 3, 4 and 5 answered first.
    let mut w = Harness::with_window(Some(EpochView::default()), 6, false);
    w.t.set_rack(1, rack()).unwrap();
    w.push(4, CHUNKS);
    let sent = w.poll();
    assert_eq!(sent.len(), CHUNKS as usize);
    assert!(sent.iter().all(|s| s.to == addr(1)), "{sent:?}");
    w.at(1);
    for c in [5, 4, 3] {
        w.result(c, 4, c, 0);
    }
    assert!(
        w.poll().is_empty(),
        "nothing resent: 0, 1 and 2 wait for their homes"
    );
    assert_eq!(w.stats.fast_retransmits.load(Ordering::Relaxed), 0);
    // The first epoch change: flat, the window for 3 lcores.
    h.at(1);
    h.t.set_epoch(h.now, down(1, &[2]));
    assert_eq!(h.t.window(), CHUNKS as usize);
    assert_eq!(h.stats.window.load(Ordering::Relaxed), CHUNKS as u64);
    // A later epoch keeps it.
    h.at(2);
    h.t.set_epoch(h.now, down(2, &[2]));
    assert_eq!(h.t.window(), CHUNKS as usize);
}

/// An ERROR `evicted` refusing chunk `c` of `round` at `slot`, from `from`.
fn evicted(h: &mut Harness, from: SocketAddr, c: u32, round: u32, slot: u32) {
    let mut r = Repr::request(MsgType::Error, JOB, TOKEN, RANK, round, slot).with_chunk(0, c);
    r.dtype = Dtype::F32;
    r.error = DropReason::Evicted.code();
    let d = r.to_datagram(&[]);
    let m = h.t.accept(Some(from), &d).expect("well-formed");
    h.t.handle(h.now, m);
}

/// A drain (PROTOCOL.md §11.8): the appliance the worker's epoch still
/// sends to answers `evicted`, which asks control for a newer epoch and
/// ends nothing; once the worker holds the epoch with the index moved, an
/// `evicted` from the old address (a late answer to a copy sent there) is
/// ignored, and one from where the chunk is sent now asks again.
#[test]
fn a_drained_appliance_s_evicted_asks_for_the_epoch_and_fails_nothing() {
    let e0 = EpochView::default();
    let mut h = Harness::new(Some(e0.clone()));
    h.push(4, CHUNKS);
    assert_eq!(h.poll().len(), CHUNKS as usize);
    h.at(1);
    let (old, slot, _) = served(PART as u32, &e0);
    assert_eq!(old, addr(1));
    evicted(&mut h, old, PART as u32, 4, slot);
    assert_eq!(h.t.poll_epoch(), Some(1), "control is asked for a newer epoch");
    assert!(h.ended().is_empty(), "the ERROR fails nothing");
    // Index 1 moved to d at epoch 1, then 2 down at epoch 2: d serves
    // index 1's part (and 2's, its next member).
    let data = phub_proto::api::DataAddr {
        host: "127.0.0.2".into(),
        base_port: 9300,
    };
    let moved = SocketAddr::from(([127, 0, 0, 2], 9300));
    let e1 = e0.with_moved(1, "d", data).with_down(2).unwrap();
    h.at(2);
    h.t.set_epoch(h.now, e1);
    let sent = h.poll();
    assert!(
        sent.iter().all(|s| s.to != old),
        "nothing goes to the drained appliance: {sent:?}"
    );
    assert!(sent.iter().any(|s| s.to == moved), "{sent:?}");
    let c = sent.iter().find(|s| s.to == moved).unwrap().repr;
    h.at(3);
    evicted(&mut h, old, c.chunk, 4, c.slot);
    assert_eq!(
        h.t.poll_epoch(),
        None,
        "a late ERROR from the old address asks nothing"
    );
    assert!(h.ended().is_empty(), "and fails nothing");
    evicted(&mut h, moved, c.chunk, 4, c.slot);
    assert_eq!(
        h.t.poll_epoch(),
        Some(3),
        "where it is sent now: control is asked"
    );
    assert!(h.ended().is_empty());
}

/// An lcore's own slots and the slots of a part it adopted are answered
/// as their own backups acknowledge, so each is its own stream for fast
/// retransmission; without replication a stream is an lcore.
#[test]
fn own_and_adopted_slots_are_separate_answer_streams() {
    let e1 = down(1, &[1]);
    let r = routing(e1.clone());
    let mut own = None;
    let mut adopted = None;
    for c in 0..CHUNKS {
        let s = layout().serve(u64::from(c), &e1).unwrap();
        let msg = ChunkMsg {
            chunk: c,
            slot: s.slot as u32,
            offset: 0,
            len: ELEMS as u32,
            to: addr(s.appliance),
            lcore: s.appliance as u16,
            start: 0,
            bytes: 0,
        };
        assert_eq!(r.adopted_slot(msg.lcore, msg.slot), s.adopted, "chunk {c}");
        if s.appliance == 2 {
            let stream = stream_of(Some(&r), &msg);
            if s.adopted {
                adopted = Some(stream);
            } else {
                own = Some(stream);
            }
        }
        assert_eq!(stream_of(None, &msg), s.appliance);
    }
    let (own, adopted) = (own.unwrap(), adopted.unwrap());
    assert_ne!(own, adopted, "appliance 2's own part and 1's, adopted");
}
