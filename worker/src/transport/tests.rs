//! The transport driven without a socket: a clock the tests advance,
//! requests encoded as the API side encodes them, and RESULTs and ERRORs
//! crafted with [`Repr`].
// Test data: small numbers cast freely.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::collections::BTreeSet;

use phub_proto::wire::{Header, HEADER_LEN};

use super::*;
use crate::codec;
use crate::elem::Values;

const JOB: u16 = 7;
const TOKEN: u64 = 0x5eed_f00d;
const RANK: u16 = 1;
/// Elements per chunk.
const ELEMS: usize = 4;
const MS: Duration = Duration::from_millis(1);

fn lcore_addr(lcore: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9000 + lcore))
}

/// The slot of chunk `c` of `key` (distinct per chunk, as a layout gives).
fn slot(key: u32, c: u32) -> u32 {
    key * 100 + c
}

/// Chunk `c` of `key`'s gradient in round `round`.
fn grad(key: u32, c: u32, round: u32) -> [f32; ELEMS] {
    std::array::from_fn(|i| (key * 1000 + c * 10 + round * 100_000) as f32 + i as f32)
}

fn repr(kind: MsgType, rank: u16, key: u32, chunk: u32, round: u32, count: usize) -> Repr {
    Repr::request(kind, JOB, TOKEN, rank, round, slot(key, chunk))
        .with_payload(Dtype::F32, count as u16)
        .with_chunk(key, chunk)
}

/// A datagram as the appliance sends it: `repr` and `values`.
fn datagram(repr: &Repr, values: &[f32]) -> Vec<u8> {
    repr.to_datagram(values)
}

/// A datagram the transport sent, parsed.
#[derive(Debug, Clone, PartialEq)]
struct Sent {
    to: SocketAddr,
    repr: Repr,
    values: Vec<f32>,
}

impl Sent {
    fn chunk(&self) -> (u32, u32) {
        (self.repr.key, self.repr.chunk)
    }

    fn retransmit(&self) -> bool {
        self.repr.flags & flags::RETRANSMIT != 0
    }
}

/// How a request ended: its tag, and its round and values or the error.
type Ended = (u32, Result<(u32, Vec<f32>), WorkerError>);

struct Harness {
    t: Transport<u32>,
    stats: Arc<Counters>,
    t0: Instant,
    now: Instant,
}

impl Harness {
    fn new(window: usize) -> Harness {
        Harness::with(window, WorkerConfig::default())
    }

    fn with(window: usize, config: WorkerConfig) -> Harness {
        Harness::of(window, config, true)
    }

    /// A harness for a job whose lcores answer in order or (`in_order`
    /// false: a hierarchical job) not.
    fn of(window: usize, config: WorkerConfig, in_order: bool) -> Harness {
        let stats = Arc::new(Counters::default());
        let info = JobInfo {
            job: JOB,
            token: TOKEN,
            rank: RANK,
            dtype: Dtype::F32,
            in_order,
        };
        let t0 = Instant::now();
        Harness {
            t: Transport::new(info, window, &config, Arc::clone(&stats), None, t0),
            stats,
            t0,
            now: t0,
        }
    }

    /// Moves the clock to `ms` milliseconds after the start.
    fn at(&mut self, ms: u64) {
        let to = self.t0 + MS * ms as u32;
        assert!(to >= self.now, "the clock goes forward");
        self.now = to;
    }

    /// Submits round `round` of `key` as a PUSH of one chunk of [`ELEMS`]
    /// elements per entry of `lcores` (chunk c to lcore `lcores[c]`),
    /// tagged `key`.
    fn push(&mut self, key: u32, round: u32, lcores: &[u16]) {
        self.submit(Kind::Push, key, round, lcores);
    }

    /// Submits a PULL of `key`, its chunks placed as [`Harness::push`]
    /// places them, tagged `key`.
    fn pull(&mut self, key: u32, lcores: &[u16]) {
        self.submit(Kind::Pull, key, 0, lcores);
    }

    /// A PUSH (with its gradients) or a PULL (headers only) of `key`.
    fn submit(&mut self, kind: Kind, key: u32, round: u32, lcores: &[u16]) {
        let (msg, elems) = match kind {
            Kind::Pull => (MsgType::Pull, 0),
            _ => (MsgType::Push, ELEMS),
        };
        let bytes = HEADER_LEN + elems * 4;
        let mut buf = vec![0u8; lcores.len() * bytes];
        let mut chunks = Vec::new();
        for (c, &lcore) in lcores.iter().enumerate() {
            let c32 = c as u32;
            let start = c * bytes;
            let r = repr(msg, RANK, key, c32, round, elems);
            let mut h = Header::new_unchecked(&mut buf[start..start + bytes]);
            r.emit(&mut h);
            if elems > 0 {
                codec::encode(Dtype::F32, &grad(key, c32, round), h.payload_mut());
            }
            chunks.push(ChunkMsg {
                chunk: c32,
                slot: slot(key, c32),
                offset: c * ELEMS,
                len: ELEMS as u32,
                to: lcore_addr(lcore),
                lcore,
                start,
                bytes,
            });
        }
        let request = Request {
            key,
            round,
            kind,
            chunks,
            tx: Tx::Owned(buf),
            sink: Sink::Owned(Values::F32(vec![f32::NAN; lcores.len() * ELEMS])),
            done: key,
        };
        self.t.submit(self.now, request);
    }

    /// What the transport sends now.
    fn poll(&mut self) -> Vec<Sent> {
        let mut out = Vec::new();
        self.t.poll_transmit(self.now, &mut out);
        let sent: Vec<Sent> = out
            .iter()
            .map(|d| {
                let mut bytes = d.head.to_vec();
                bytes.extend_from_slice(d.body);
                let (repr, payload) = wire::parse(&bytes).expect("the transport sends well-formed datagrams");
                let mut values = vec![0f32; usize::from(repr.count)];
                codec::decode(Dtype::F32, payload, &mut values);
                Sent {
                    to: d.to,
                    repr,
                    values,
                }
            })
            .collect();
        // A lane with none out may send one past the window (Pending).
        assert!(
            self.t.table.outstanding.len() <= self.t.flow.window + self.t.table.pending.out.len(),
            "{} chunks outstanding, window {}",
            self.t.table.outstanding.len(),
            self.t.flow.window
        );
        assert!(
            self.t.congestion.cwnd <= self.t.flow.window
                && self.t.congestion.cwnd >= MIN_CWND.min(self.t.flow.window)
        );
        sent
    }

    /// The (key, chunk)s of what the transport sends now.
    fn poll_chunks(&mut self) -> Vec<(u32, u32)> {
        self.poll().iter().map(Sent::chunk).collect()
    }

    /// Runs the timers now; whether chunks were queued.
    fn tick(&mut self) -> bool {
        self.t.handle_timeout(self.now)
    }

    /// The appliance's RESULT for chunk `c` of `key` in `round`, with
    /// `values`.
    fn result_with(&mut self, key: u32, c: u32, round: u32, values: &[f32]) {
        let r = repr(MsgType::Result, APPLIANCE_RANK, key, c, round, values.len());
        self.t.handle_datagram(self.now, &datagram(&r, values));
    }

    /// The RESULT of chunk `c` of `key` in `round`, stating a receive-buffer
    /// share of `share` bytes.
    fn result_stating(&mut self, key: u32, c: u32, round: u32, share: u32) {
        let r = repr(MsgType::Result, APPLIANCE_RANK, key, c, round, ELEMS);
        let mut d = datagram(&r, &expected(key, c, round));
        Header::new_unchecked(&mut d[..]).set_rx_share(share);
        self.t.handle_datagram(self.now, &d);
    }

    /// The RESULT of chunk `c` of `key` in `round`: its gradient times 2.
    fn result(&mut self, key: u32, c: u32, round: u32) {
        self.result_with(key, c, round, &expected(key, c, round));
    }

    /// The requests that completed, as (tag, round, values); panics on a
    /// failed one.
    fn completed(&mut self) -> Vec<(u32, u32, Vec<f32>)> {
        self.ended()
            .into_iter()
            .map(|(tag, r)| match r {
                Ok((round, values)) => (tag, round, values),
                Err(e) => panic!("request {tag} failed: {e}"),
            })
            .collect()
    }

    fn ended(&mut self) -> Vec<Ended> {
        std::iter::from_fn(|| self.t.poll_done())
            .map(|f| {
                let r = f.result.map(|o| match o.sink {
                    Sink::Owned(Values::F32(v)) => (o.round, v),
                    other => panic!("an owned f32 sink came back as {other:?}"),
                });
                (f.done, r)
            })
            .collect()
    }
}

/// The result the simulated appliance sends for a chunk: its gradient
/// doubled.
fn expected(key: u32, c: u32, round: u32) -> Vec<f32> {
    grad(key, c, round).iter().map(|x| x * 2.0).collect()
}

/// The values a request of `chunks` chunks ends with.
fn expected_key(key: u32, chunks: u32, round: u32) -> Vec<f32> {
    (0..chunks).flat_map(|c| expected(key, c, round)).collect()
}

#[test]
fn the_window_bounds_the_chunks_outstanding_and_they_go_first_come_first_sent() {
    let mut h = Harness::new(4);
    h.push(0, 1, &[0; 6]);
    h.push(1, 1, &[0; 3]);
    let first = h.poll();
    assert_eq!(
        first.iter().map(Sent::chunk).collect::<Vec<_>>(),
        [(0, 0), (0, 1), (0, 2), (0, 3)]
    );
    assert!(first.iter().all(|s| !s.retransmit() && s.to == lcore_addr(0)));
    assert_eq!(first[2].values, grad(0, 2, 1), "the chunk's own payload");
    assert_eq!(h.poll(), [], "the window is full");
    // Each result lets exactly one more chunk out, in the order submitted.
    let mut order: Vec<(u32, u32)> = first.iter().map(Sent::chunk).collect();
    let mut waiting: VecDeque<(u32, u32)> = order.iter().copied().collect();
    while let Some((key, c)) = waiting.pop_front() {
        h.at(1 + order.len() as u64);
        h.result(key, c, 1);
        let next = h.poll_chunks();
        assert!(next.len() <= 1, "{next:?} after one result");
        waiting.extend(&next);
        order.extend(next);
    }
    let want: Vec<(u32, u32)> = (0..6).map(|c| (0, c)).chain((0..3).map(|c| (1, c))).collect();
    assert_eq!(order, want);
    assert_eq!(
        h.completed(),
        [(0, 1, expected_key(0, 6, 1)), (1, 1, expected_key(1, 3, 1))]
    );
    let s = h.stats.snapshot();
    assert_eq!((s.chunks_sent, s.retransmits, s.results_accepted), (9, 0, 9));
    assert!(!h.t.busy() && h.t.poll_timeout().is_none());
}

#[test]
fn a_reordered_result_completes_its_own_chunk() {
    let mut h = Harness::new(16);
    h.push(3, 5, &[0, 0, 0, 0]);
    assert_eq!(h.poll().len(), 4);
    h.at(2);
    // Overtaking by fewer than REORDER places is not loss.
    for c in [2, 0, 3, 1] {
        assert!(h.ended().is_empty(), "done before chunk {c}");
        h.result(3, c, 5);
        assert_eq!(h.poll(), [], "nothing to resend after chunk {c}");
    }
    assert_eq!(h.completed(), [(3, 5, expected_key(3, 4, 5))]);
    let s = h.stats.snapshot();
    assert_eq!((s.results_accepted, s.results_ignored, s.retransmits), (4, 0, 0));
    assert_eq!(s.srtt_us, 2000, "four samples of 2 ms");
}

/// PROTOCOL.md §6.2: a RESULT of a later round answers a PUSH (the chunk
/// completed rounds past it with this rank's contributions: a rank
/// repeating rounds after a pull, as after a restore from an older
/// checkpoint); before, it was ignored and the request waited for ever.
#[test]
fn a_later_rounds_result_answers_a_push() {
    let mut h = Harness::new(16);
    h.push(0, 1, &[0, 0]);
    h.poll();
    h.result(0, 0, 1);
    h.result(0, 1, 3);
    let done = h.completed();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].1, 1, "the request's round");
    assert_eq!(
        done[0].2[ELEMS..],
        expected(0, 1, 3)[..],
        "chunk 1 as round 3 left it"
    );
    assert_eq!(h.stats.snapshot().results_accepted, 2);
}

#[test]
fn a_duplicate_or_unasked_result_is_ignored_and_counted() {
    let mut h = Harness::new(16);
    h.push(0, 1, &[0, 0]);
    h.poll();
    h.result(0, 0, 1);
    // The same chunk again, with other values: counted, not written.
    h.result_with(0, 0, 1, &[9.0; ELEMS]);
    assert_eq!(h.stats.snapshot().results_ignored, 1);
    // An earlier round, another element count, another slot: not this
    // chunk's.
    h.result(0, 1, 0);
    h.result_with(0, 1, 1, &[1.0; ELEMS - 1]);
    let mut r = repr(MsgType::Result, APPLIANCE_RANK, 0, 1, 1, ELEMS);
    r.slot += 1;
    h.t.handle_datagram(h.now, &datagram(&r, &expected(0, 1, 1)));
    assert_eq!(h.stats.snapshot().results_ignored, 4);
    // Another job's token, a PUSH, a RESULT not from the appliance, junk:
    // not this job's at all.
    for (i, mut r) in [
        repr(MsgType::Result, APPLIANCE_RANK, 0, 1, 1, ELEMS),
        repr(MsgType::Push, APPLIANCE_RANK, 0, 1, 1, ELEMS),
        repr(MsgType::Result, RANK, 0, 1, 1, ELEMS),
    ]
    .into_iter()
    .enumerate()
    {
        if i == 0 {
            r.token ^= 1;
        }
        h.t.handle_datagram(h.now, &datagram(&r, &expected(0, 1, 1)));
    }
    h.t.handle_datagram(h.now, b"not a phub datagram");
    assert!(h.ended().is_empty());
    h.result(0, 1, 1);
    assert_eq!(h.completed(), [(0, 1, expected_key(0, 2, 1))]);
    // Once the request is done, a late duplicate finds nothing to fill.
    h.result(0, 1, 1);
    let s = h.stats.snapshot();
    assert_eq!(
        (s.results_accepted, s.results_ignored, s.foreign_dropped),
        (2, 5, 4)
    );
}

/// A hierarchical job's rack lcore answers a chunk when its home does, and
/// homes differ: later results overtaking a chunk are not a loss there
/// until the chunk has also been out for an RTO; then it is resent at
/// once, while results still stream in (not at the end of the round).
#[test]
fn results_out_of_order_in_a_hierarchical_job_resend_only_after_an_rto() {
    let mut h = Harness::of(16, WorkerConfig::default(), false);
    h.push(0, 1, &[0, 0, 0, 0, 0, 0]);
    assert_eq!(h.poll().len(), 6);
    h.at(10);
    for c in [1, 2, 3, 4, 5] {
        h.result(0, c, 1);
        assert_eq!(h.poll(), [], "after chunk {c}");
    }
    let s = h.stats.snapshot();
    assert_eq!((s.retransmits, s.fast_retransmits), (0, 0));
    // Results keep streaming in (a later chunk every 2 ms, answered at
    // once): chunk 0 is resent as lost once it has been out for the RTO,
    // not before, and not by the silence timer (results never stop).
    let rto = h.t.loss.rto.rto.as_millis() as u64;
    let mut resent_at = None;
    let mut t = 10;
    for key in 1..=(rto / 2 + 3) as u32 {
        t += 2;
        h.at(t);
        h.push(key, 1, &[0]);
        let mut sent = h.poll();
        h.result(key, 0, 1);
        sent.extend(h.poll());
        for s in sent.iter().filter(|s| s.chunk() == (0, 0)) {
            assert!(
                s.retransmit() && resent_at.is_none(),
                "chunk 0 resent once: {sent:?}"
            );
            resent_at = Some(t);
        }
    }
    let at = resent_at.expect("chunk 0 resent while results flow");
    assert!(at >= rto, "resent at {at} ms, before the RTO ({rto} ms) was up");
    let s = h.stats.snapshot();
    assert_eq!((s.retransmits, s.fast_retransmits), (1, 1));
    h.result(0, 0, 1);
    assert!(h.completed().iter().any(|d| d.0 == 0), "key 0 completes");
}

#[test]
fn a_lost_chunk_is_resent_once_three_later_results_are_in_and_not_sampled() {
    let mut h = Harness::new(16);
    // Chunks 0-5 to lcore 0 (sequence numbers 1-6), 6-9 to lcore 1.
    h.push(0, 1, &[0, 0, 0, 0, 0, 0, 1, 1, 1, 1]);
    assert_eq!(h.poll().len(), 10);
    h.at(10);
    // Chunk 0 is lost. Lcore 1's results say nothing about lcore 0.
    for c in [6, 7, 8, 9, 1, 2] {
        h.result(0, c, 1);
        assert_eq!(h.poll(), [], "after chunk {c}");
    }
    // The third later result from lcore 0: chunk 0 goes again, at once.
    h.result(0, 3, 1);
    let resent = h.poll();
    assert_eq!(resent.len(), 1);
    assert_eq!(resent[0].chunk(), (0, 0));
    assert!(resent[0].retransmit());
    assert_eq!(resent[0].values, grad(0, 0, 1));
    for c in [4, 5] {
        h.result(0, c, 1);
        assert_eq!(h.poll(), [], "chunk 0 is resent once");
    }
    let s = h.stats.snapshot();
    assert_eq!((s.retransmits, s.fast_retransmits), (1, 1));
    assert_eq!(s.srtt_us, 10_000);
    // Congestion control is off by default: the loss leaves the window.
    assert_eq!((h.t.congestion.cwnd, s.window_cuts), (16, 0));
    // Its result, much later, is not a round-trip sample (Karn's rule).
    h.at(500);
    h.result(0, 0, 1);
    assert_eq!(h.completed(), [(0, 1, expected_key(0, 10, 1))]);
    assert_eq!(h.stats.snapshot().srtt_us, 10_000);
}

#[test]
fn a_loss_halves_the_congestion_window_once_per_round_trip_and_results_grow_it_back() {
    let config = WorkerConfig {
        congestion: true,
        ..WorkerConfig::default()
    };
    let mut h = Harness::with(64, config);
    // 200 chunks to lcore 0: 64 go out.
    h.push(0, 1, &[0; 200]);
    assert_eq!(h.poll().len(), 64);
    h.at(10);
    // Chunks 0 and 10 are lost; three later results find each.
    for c in 1..4 {
        h.result(0, c, 1);
    }
    let first = h.poll();
    assert!(
        first.iter().any(|d| d.chunk() == (0, 0) && d.retransmit()),
        "{:?}",
        first.len()
    );
    assert_eq!(h.t.congestion.cwnd, 32, "the first loss halves the window");
    assert_eq!(h.stats.snapshot().window_cuts, 1);
    for c in (4..14).filter(|&c| c != 10) {
        h.result(0, c, 1);
    }
    let second = h.poll();
    assert!(second.iter().any(|d| d.chunk() == (0, 10) && d.retransmit()));
    assert_eq!(
        h.t.congestion.cwnd, 32,
        "a second loss within one round trip is the same event"
    );
    assert_eq!(h.stats.snapshot().window_cuts, 1);
    // The resent chunks' results come back.
    h.result(0, 0, 1);
    h.result(0, 10, 1);
    // Outstanding chunks drain below the new window before any new one goes:
    // 64 were out, 12 came back; nothing new until fewer than 32 are out.
    let new_chunks = |sent: &[Sent]| sent.iter().filter(|d| !d.retransmit()).count();
    assert_eq!(new_chunks(&first) + new_chunks(&second), 0);
    for c in 14..40 {
        h.result(0, c, 1);
    }
    let out = h.poll();
    assert!(
        h.t.table.outstanding.len() <= h.t.congestion.cwnd,
        "{} out, cwnd {}",
        h.t.table.outstanding.len(),
        h.t.congestion.cwnd
    );
    assert!(new_chunks(&out) > 0, "below the window again, new chunks go");
    // Results of chunks sent once grow it back, to the window at most.
    let cwnd_before = h.t.congestion.cwnd;
    let mut t = 20;
    let mut next = 40;
    while next < 200 {
        h.at(t);
        t += 1;
        for _ in 0..8 {
            if next < 200 {
                h.result(0, next, 1);
                next += 1;
            }
        }
        h.poll();
    }
    assert!(
        h.t.congestion.cwnd > cwnd_before,
        "grew from {cwnd_before} to {}",
        h.t.congestion.cwnd
    );
    assert!(h.t.congestion.cwnd <= 64);
    assert_eq!(h.stats.snapshot().cwnd, h.t.congestion.cwnd as u64);
    // A later loss, more than a round trip after the first, halves it again.
    h.push(1, 1, &[0; 40]);
    h.poll();
    h.at(t + 100);
    for c in 1..4 {
        h.result(1, c, 1);
    }
    let before = h.t.congestion.cwnd;
    h.poll();
    assert_eq!(h.t.congestion.cwnd, (before / 2).max(MIN_CWND));
    assert_eq!(h.stats.snapshot().window_cuts, 2);
}

#[test]
fn without_loss_the_congestion_window_stays_the_window() {
    let config = WorkerConfig {
        congestion: true,
        ..WorkerConfig::default()
    };
    let mut h = Harness::with(16, config);
    for round in 1..=20 {
        h.push(0, round, &[0, 1, 0, 1, 0, 1, 0, 1, 0, 1]);
        assert_eq!(h.poll().len(), 10);
        h.at(u64::from(round));
        for c in 0..10 {
            h.result(0, c, round);
        }
        h.completed();
    }
    assert_eq!(h.t.congestion.cwnd, 16);
    let s = h.stats.snapshot();
    assert_eq!((s.window_cuts, s.cwnd, s.retransmits), (0, 16, 0));
}

#[test]
fn the_loss_timer_probes_the_chunks_sent_longest_ago_and_backs_off_until_a_result() {
    // Before any sample the loss timer is the initial RTO: 50 ms, then
    // 100, 200, 400 ms.
    let mut h = Harness::new(16);
    for key in 0..4 {
        h.at(u64::from(key));
        h.push(key, 1, &[0]);
        assert_eq!(h.poll_chunks(), [(key, 0)]);
    }
    let probes = |h: &mut Harness, at: u64| {
        h.at(at);
        let queued = h.tick();
        let mut keys: Vec<u32> = h.poll().iter().map(|s| s.repr.key).collect();
        assert_eq!(queued, !keys.is_empty());
        keys.sort_unstable();
        keys
    };
    assert_eq!(h.t.poll_timeout(), Some(h.t0 + 50 * MS));
    assert_eq!(probes(&mut h, 49), [] as [u32; 0]);
    // The first silence: the oldest chunk alone.
    assert_eq!(probes(&mut h, 50), [0]);
    assert_eq!(h.t.poll_timeout(), Some(h.t0 + 150 * MS));
    assert_eq!(probes(&mut h, 149), [] as [u32; 0]);
    // The second: the two sent longest ago (key 0 went at 50 ms; keys 1
    // and 2 at 1 and 2 ms); the third: four.
    assert_eq!(probes(&mut h, 150), [1, 2]);
    assert_eq!(h.t.poll_timeout(), Some(h.t0 + 350 * MS));
    assert_eq!(probes(&mut h, 349), [] as [u32; 0]);
    assert_eq!(probes(&mut h, 350), [0, 1, 2, 3]);
    assert_eq!(h.t.poll_timeout(), Some(h.t0 + 750 * MS));
    assert_eq!(h.stats.snapshot().retransmits, 7);
    assert!(h.t.silent());
    // A result ends the silence: the timer is back to 50 ms after it, one
    // probe again, of the chunk sent longest ago whose own timer has run
    // out (keys 1 and 2 were last sent with 200 ms, key 3 with 100 ms).
    h.at(400);
    h.result(0, 0, 1);
    assert!(!h.t.silent());
    assert_eq!(h.completed(), [(0, 1, expected_key(0, 1, 1))]);
    assert_eq!(h.t.poll_timeout(), Some(h.t0 + 450 * MS));
    assert_eq!(probes(&mut h, 449), [] as [u32; 0]);
    assert_eq!(probes(&mut h, 450), [3]);
    assert_eq!(h.stats.snapshot().retransmits, 8);
    assert_eq!(h.stats.snapshot().fast_retransmits, 0);
}

#[test]
fn results_flowing_again_end_a_chunks_back_off() {
    let mut h = Harness::new(16);
    h.push(0, 1, &[0]);
    h.poll();
    h.at(1);
    h.push(1, 1, &[0]);
    h.poll();
    // Three silences back both chunks off (probes at 50, 150, 350 ms):
    // their own timers now run out at 750 and 550 ms.
    for (at, want) in [(50, &[0][..]), (150, &[0, 1]), (350, &[0, 1])] {
        h.at(at);
        assert!(h.tick());
        let mut keys: Vec<u32> = h.poll().iter().map(|s| s.repr.key).collect();
        keys.sort_unstable();
        assert_eq!(keys, want, "at {at} ms");
    }
    // Another key's result (a 10 ms round trip: a 20 ms loss timer) shows
    // the path works: the backed-off chunks get the base timer again,
    // from the first scan after it (390 ms), so they are late at 410 ms.
    h.at(360);
    h.push(2, 1, &[0]);
    assert_eq!(h.poll_chunks(), [(2, 0)]);
    h.at(370);
    h.result(2, 0, 1);
    assert_eq!(h.completed().len(), 1);
    assert_eq!(h.t.poll_timeout(), Some(h.t0 + 390 * MS));
    h.at(390);
    assert!(!h.tick());
    h.at(409);
    assert!(!h.tick());
    h.at(410);
    assert!(h.tick());
    assert_eq!(h.poll_chunks(), [(0, 0)], "the oldest first");
}

#[test]
fn the_loss_timer_follows_the_measured_round_trip() {
    let mut h = Harness::new(16);
    h.push(0, 1, &[0]);
    h.poll();
    h.at(4);
    h.result(0, 0, 1);
    assert_eq!(h.completed().len(), 1);
    assert_eq!(h.t.poll_timeout(), None, "no timer while idle");
    // Smallest round trip 4 ms: a chunk sent now is late 8 ms later.
    h.at(10);
    h.push(1, 1, &[0]);
    assert_eq!(h.poll_chunks(), [(1, 0)]);
    assert_eq!(h.t.poll_timeout(), Some(h.t0 + 18 * MS));
    h.at(17);
    assert!(!h.tick());
    h.at(18);
    assert!(h.tick());
    assert_eq!(h.poll_chunks(), [(1, 0)]);
}

#[test]
fn requests_time_out_after_a_silence_of_timeout() {
    let config = WorkerConfig {
        timeout: Duration::from_millis(300),
        ..WorkerConfig::default()
    };
    let mut h = Harness::with(2, config);
    h.push(0, 4, &[0, 1, 1]);
    h.poll();
    let mut at = 0;
    while h.ended().is_empty() {
        let next = h.t.poll_timeout().expect("a timer while busy");
        assert!(next <= h.t0 + 300 * MS, "the timeout is a timer too");
        at = (next - h.t0).as_millis() as u64;
        h.at(at);
        h.tick();
        h.poll();
        assert!(at <= 300);
    }
    assert_eq!(at, 300);
    let mut ended = Vec::new();
    h.t.close();
    assert!(h.t.poll_done().is_none(), "nothing left to close");
    h.push(1, 1, &[0]);
    h.t.close();
    ended.extend(h.ended());
    assert!(matches!(ended[..], [(1, Err(WorkerError::Closed))]), "{ended:?}");
    assert_eq!(h.stats.snapshot().timeouts, 1);
}

#[test]
fn a_timeout_names_the_ports_still_waited_for() {
    let config = WorkerConfig {
        timeout: Duration::from_millis(100),
        ..WorkerConfig::default()
    };
    let mut h = Harness::with(2, config);
    // Chunk 0 answered; chunk 1 (lcore 1) outstanding; chunk 2 (lcore 1
    // too) sent once chunk 0's result left lcore 1's lane the whole window
    // of two, and answered.
    h.push(0, 4, &[0, 1, 1]);
    h.poll();
    h.result(0, 0, 4);
    assert_eq!(h.poll_chunks(), [(0, 2)]);
    h.result(0, 2, 4);
    h.at(100);
    h.tick();
    match &h.ended()[..] {
        [(
            0,
            Err(WorkerError::Timeout {
                key: 0,
                round: 4,
                addrs,
                missing: 1,
                chunks: 3,
                waited,
            }),
        )] => {
            assert_eq!(addrs, &[lcore_addr(1)]);
            assert_eq!(*waited, 100 * MS);
        }
        other => panic!("{other:?}"),
    }
    assert!(!h.t.busy() && h.poll().is_empty());
}

#[test]
fn an_error_fails_its_request_and_one_for_another_round_is_ignored() {
    let mut h = Harness::new(2);
    h.push(0, 3, &[0, 0, 0]);
    h.push(1, 3, &[0]);
    assert_eq!(h.poll().len(), 2);
    let mut e = repr(MsgType::Error, RANK, 0, 1, 2, 0);
    e.error = DropReason::SlotOutOfRange.code();
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    assert!(h.ended().is_empty(), "round 2's error is not round 3's");
    assert_eq!(h.stats.snapshot().results_ignored, 1);
    e.round = 3;
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    match &h.ended()[..] {
        [(
            0,
            Err(WorkerError::Refused {
                key: 0,
                chunk: 1,
                round: 3,
                reason,
                hint,
            }),
        )] => {
            assert_eq!(reason, "slot_out_of_range");
            assert!(hint.contains("rejoin"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.stats.snapshot().errors, 1);
    // Its chunks left the window: the next request's go out.
    assert_eq!(h.poll_chunks(), [(1, 0)]);
    h.result(0, 0, 3);
    assert_eq!(h.stats.snapshot().results_ignored, 2);
}

/// An ERROR `nothing_to_pull` refuses only a PULL: a late copy (of a PULL
/// retransmitted before the first copy's ERROR came back) reaching the
/// INIT or PUSH the rank sent next for the key, with the round 0 the
/// PULL's echo carries, is ignored (PROTOCOL.md §5.5, §6.1: the INIT is
/// what the refusal asked for; the simulator's seed 1270 failed on it).
#[test]
fn nothing_to_pull_does_not_refuse_an_init_or_push() {
    let mut h = Harness::new(2);
    h.push(0, 0, &[0]);
    assert_eq!(h.poll().len(), 1);
    let mut e = repr(MsgType::Error, RANK, 0, 0, 0, 0);
    e.error = DropReason::NothingToPull.code();
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    let ended = h.ended();
    assert!(ended.is_empty(), "{ended:?}");
    assert_eq!(h.stats.snapshot().results_ignored, 1);
    h.result(0, 0, 0);
    assert!(matches!(&h.ended()[..], [(0, Ok(_))]));
}

/// A rank with chunks answered on lcore 1 and a push waiting on lcore 0
/// (for a slow rank, say): after two silences it PULLs lcore 1's last
/// answered chunk, with a nonce in the round field (`None`: it sent no
/// PULL in two silences).
fn stalled_with_lcore_one_idle(in_order: bool) -> (Harness, Option<Sent>) {
    let mut h = Harness::of(16, WorkerConfig::default(), in_order);
    h.push(0, 1, &[1]);
    assert_eq!(h.poll_chunks(), [(0, 0)]);
    h.result(0, 0, 1);
    assert_eq!(h.completed().len(), 1);
    h.push(1, 1, &[0]);
    assert_eq!(h.poll_chunks(), [(1, 0)]);
    // The loss timer: 50 ms, then 100 more (no RTT sample taken at 0 ms
    // changes it: the first sample is 0).
    let rto = h.t.loss.rto.loss(0);
    let mut at = rto;
    for silence in 1..=2 {
        h.now = h.t0 + at;
        assert!(h.tick(), "silence {silence} resends");
        let sent = h.poll();
        assert!(
            sent.iter().any(|s| s.chunk() == (1, 0) && s.retransmit()),
            "{sent:?}"
        );
        let pulls: Vec<Sent> = sent
            .into_iter()
            .filter(|s| s.repr.kind == MsgType::Pull)
            .collect();
        if silence < PROBE_AFTER || !in_order {
            assert_eq!(pulls, [], "silence {silence}");
        } else {
            assert_eq!(pulls.len(), 1, "{pulls:?}");
            return (h, pulls.into_iter().next());
        }
        at += h.t.loss.rto.loss(silence);
    }
    (h, None)
}

/// PROTOCOL.md §6.1, "A stalled rank": an lcore restored from a checkpoint
/// taken before round 0 completed answers the probe `nothing_to_pull`
/// (echoing its nonce): every request fails `ahead`, and the caller pulls
/// every key (the simulator's seed 81589 waited for ever without it).
#[test]
fn a_stalled_rank_asks_an_idle_lcore_and_learns_it_was_restored_behind() {
    let (mut h, pull) = stalled_with_lcore_one_idle(true);
    let pull = pull.expect("a PULL after two silences");
    assert_eq!(pull.to, lcore_addr(1));
    assert_eq!(
        (pull.chunk(), pull.repr.slot, pull.repr.count, pull.repr.flags),
        ((0, 0), slot(0, 0), 0, flags::PROBE)
    );
    assert_eq!(h.stats.snapshot().lcores_probed, 1);
    // An ERROR echoing another round is not the probe's.
    let mut e = pull.repr;
    e.kind = MsgType::Error;
    e.error = DropReason::NothingToPull.code();
    e.round = pull.repr.round.wrapping_add(7);
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    assert!(h.ended().is_empty());
    e.round = pull.repr.round;
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    match &h.ended()[..] {
        [(
            1,
            Err(WorkerError::Refused {
                key: 0,
                chunk: 0,
                round: 1,
                reason,
                hint,
            }),
        )] => {
            assert_eq!(reason, "ahead");
            assert!(hint.contains("pull every key"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    let s = h.stats.snapshot();
    assert_eq!((s.lcores_found_behind, s.results_ignored), (1, 2), "{s:?}");
    assert!(!h.t.busy());
}

/// Told `ahead` by the lcore itself while a probe is out, the caller
/// pulls every key: the probe's answer, coming after, must fail neither
/// that PULL nor the rounds it repeats (`make test`'s shm restart
/// scenario failed once on it: its resync's pull refused `ahead`). An
/// `ahead` refusal forgets the probes out.
#[test]
fn an_ahead_refusal_forgets_the_probes_out() {
    let (mut h, pull) = stalled_with_lcore_one_idle(true);
    let probe = pull.expect("a PULL after two silences");
    let mut ahead = repr(MsgType::Error, RANK, 1, 0, 1, 0);
    ahead.error = DropReason::Ahead.code();
    h.t.handle_datagram(h.now, &datagram(&ahead, &[]));
    assert!(matches!(&h.ended()[..], [(1, Err(WorkerError::Refused { reason, .. }))] if reason == "ahead"));
    h.pull(2, &[1]);
    h.push(1, 1, &[0]);
    assert_eq!(h.poll().len(), 2);
    let mut e = probe.repr;
    e.kind = MsgType::Error;
    e.error = DropReason::NothingToPull.code();
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    assert!(h.ended().is_empty(), "the pull and the repeated push stand");
    assert_eq!(h.stats.snapshot().lcores_found_behind, 0);
    h.result(2, 0, 0);
    assert!(matches!(&h.ended()[..], [(2, Ok(_))]), "the pull is answered");
}

/// PROTOCOL.md §5.4 rule 0: after an lcore refused a push `ahead`, the
/// rank's PULLs to it carry RESYNC (which lifts the rule there) until it
/// answers an INIT or PUSH; PULLs to other lcores, and those sent before
/// the refusal, carry none (one sent before, answered by a restored
/// lcore, lifted the rule for a rank that had not learned of the restore:
/// simulator seed 1114154). Seen failing with the flag never set.
#[test]
fn pulls_after_an_ahead_refusal_carry_resync_until_a_push_is_taken() {
    let resync = |s: &Sent| s.repr.flags & flags::RESYNC != 0;
    let mut h = Harness::new(8);
    h.pull(5, &[0]);
    h.push(1, 1, &[0, 1]);
    let first = h.poll();
    assert_eq!(first.len(), 3);
    assert!(first.iter().all(|s| !resync(s)), "{first:?}");
    let mut ahead = repr(MsgType::Error, RANK, 1, 0, 1, 0);
    ahead.error = DropReason::Ahead.code();
    h.t.handle_datagram(h.now, &datagram(&ahead, &[]));
    assert!(matches!(&h.ended()[..], [(1, Err(WorkerError::Refused { reason, .. }))] if reason == "ahead"));
    // Lcore 0 refused: the pull of key 2 there carries RESYNC, lcore 1's not.
    h.pull(2, &[0, 1]);
    let pulls = h.poll();
    assert_eq!(pulls.len(), 2, "{pulls:?}");
    for p in &pulls {
        assert_eq!(resync(p), p.to == lcore_addr(0), "{p:?}");
    }
    h.result(2, 0, 0);
    h.result(2, 1, 0);
    h.result(5, 0, 0);
    assert_eq!(h.ended().len(), 2);
    // A push taken on lcore 0: its pulls go plain again.
    h.push(1, 1, &[0]);
    assert_eq!(h.poll().len(), 1);
    h.result(1, 0, 1);
    assert_eq!(h.ended().len(), 1);
    h.pull(3, &[0]);
    let after = h.poll();
    assert!(after.len() == 1 && !resync(&after[0]), "{after:?}");
}

/// The probe's RESULT: at the round answered before, nothing happens; below
/// it once (an old RESULT the network held back reads the same) another
/// PULL goes at once, and below it again fails every request `ahead`.
#[test]
fn a_probe_answered_below_the_round_answered_twice_in_a_row_fails_the_requests() {
    let (mut h, pull) = stalled_with_lcore_one_idle(true);
    let pull = pull.expect("a PULL after two silences");
    h.result(0, 0, 1);
    assert!(h.ended().is_empty());
    assert_eq!(h.poll(), [], "answered where it stood: no more PULLs");
    h.result(0, 0, 1);
    h.result(0, 0, 0);
    assert!(h.ended().is_empty(), "no probe out: an old RESULT is ignored");
    // The next silence asks again.
    h.now += h.t.loss.rto.loss(PROBE_AFTER);
    assert!(h.tick());
    let again: Vec<Sent> = h
        .poll()
        .into_iter()
        .filter(|s| s.repr.kind == MsgType::Pull)
        .collect();
    assert_eq!(again.len(), 1, "{again:?}");
    assert_ne!(again[0].repr.round, pull.repr.round, "a fresh nonce");
    h.result(0, 0, 0);
    assert!(h.ended().is_empty(), "once below could be an old RESULT");
    let third: Vec<Sent> = h.poll();
    assert!(
        matches!(&third[..], [s] if s.repr.kind == MsgType::Pull && s.to == lcore_addr(1)),
        "{third:?}"
    );
    h.result(0, 0, 0);
    assert!(matches!(&h.ended()[..], [(1, Err(WorkerError::Refused { reason, .. }))] if reason == "ahead"));
}

/// A hierarchical job's rack lcores answer out of order and stand for
/// other appliances: nothing is probed there.
#[test]
fn a_hierarchical_rank_probes_nothing() {
    let (h, pull) = stalled_with_lcore_one_idle(false);
    assert_eq!(pull, None);
    assert_eq!(h.stats.snapshot().lcores_probed, 0);
}

/// The ERROR an appliance sends each rank as it stops (round, slot, key
/// and chunk 0) fails every request in flight, those still waiting to be
/// sent included, at once; with none in flight it is ignored.
#[test]
fn shutting_down_fails_every_request_in_flight_at_once() {
    let mut h = Harness::new(2);
    h.push(0, 3, &[0, 0, 0]);
    h.push(1, 3, &[0]);
    assert_eq!(h.poll().len(), 2);
    let mut e = repr(MsgType::Error, RANK, 0, 0, 0, 0);
    e.slot = 0;
    e.error = DropReason::ShuttingDown.code();
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    let ended = h.ended();
    assert_eq!(ended.len(), 2, "{ended:?}");
    for (tag, r) in &ended {
        match r {
            Err(WorkerError::Refused {
                key,
                round: 3,
                reason,
                hint,
                ..
            }) if key == tag => {
                assert_eq!(reason, "shutting_down");
                assert!(hint.contains("shutting down"), "{hint}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(!h.t.busy() && h.poll().is_empty());
    assert_eq!(h.stats.snapshot().errors, 1);
    h.t.handle_datagram(h.now, &datagram(&e, &[]));
    assert_eq!(h.stats.snapshot().results_ignored, 1);
}

#[test]
fn error_codes_are_named() {
    assert_eq!(describe(15).0, "count_mismatch");
    assert!(describe(19).1.contains("restarted"));
    assert_eq!(describe(999).0, "unknown error code 999");
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 >= 1.0 - p
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Runs `rounds` rounds of `keys` keys of 8 chunks over 2 lcores through
/// a path that loses, duplicates and delays by 50 us plus up to
/// `jitter_us` (so reorders) datagrams both ways, in steps of 100 us; the simulated appliance answers every PUSH
/// with its RESULT. Returns the counters and the simulated time taken.
fn simulate(
    seed: u64,
    loss: f64,
    dup: f64,
    jitter_us: u64,
    rounds: u32,
    keys: u32,
) -> (crate::stats::WorkerStats, Duration) {
    const STEP: Duration = Duration::from_micros(100);
    let mut h = Harness::new(6);
    let mut rng = Rng(seed | 1);
    // Datagrams in flight: (arrival, is a result, bytes).
    let mut in_flight: Vec<(Instant, bool, Vec<u8>)> = Vec::new();
    let mut round = vec![0u32; keys as usize];
    let mut busy = vec![false; keys as usize];
    let lcores = [0, 1, 0, 1, 0, 1, 0, 1];
    // The last round each chunk completed at the appliance.
    let mut completed: HashMap<(u32, u32), u32> = HashMap::new();
    let send = |rng: &mut Rng, in_flight: &mut Vec<_>, now: Instant, result: bool, d: Vec<u8>| {
        if rng.chance(loss) {
            return;
        }
        let copies = if rng.chance(dup) { 2 } else { 1 };
        for _ in 0..copies {
            let latency = Duration::from_micros(50 + rng.below(jitter_us + 1));
            in_flight.push((now + latency, result, d.clone()));
        }
    };
    for step in 0..2_000_000u32 {
        if round.iter().all(|&r| r == rounds) && !busy.iter().any(|&b| b) {
            return (h.stats.snapshot(), h.now - h.t0);
        }
        h.now = h.t0 + STEP * step;
        for k in 0..keys as usize {
            if !busy[k] && round[k] < rounds {
                round[k] += 1;
                busy[k] = true;
                h.push(k as u32, round[k], &lcores);
            }
        }
        h.tick();
        let now = h.now;
        for s in h.poll() {
            if s.repr.kind == MsgType::Pull {
                // A stalled rank's probe of an idle lcore: the appliance
                // answers with the last round the chunk completed.
                let done = completed[&s.chunk()];
                let r = repr(
                    MsgType::Result,
                    APPLIANCE_RANK,
                    s.repr.key,
                    s.repr.chunk,
                    done,
                    ELEMS,
                );
                send(
                    &mut rng,
                    &mut in_flight,
                    now,
                    true,
                    datagram(&r, &expected(s.repr.key, s.repr.chunk, done)),
                );
                continue;
            }
            let done = completed.entry(s.chunk()).or_insert(0);
            *done = (*done).max(s.repr.round);
            assert_eq!(s.values, grad(s.repr.key, s.repr.chunk, s.repr.round));
            let r = repr(
                MsgType::Result,
                APPLIANCE_RANK,
                s.repr.key,
                s.repr.chunk,
                s.repr.round,
                ELEMS,
            );
            send(&mut rng, &mut in_flight, now, false, datagram(&r, &s.values));
        }
        // Deliver what has arrived, in arrival order: the appliance turns
        // a PUSH into its RESULT, the worker handles RESULTs.
        in_flight.sort_by_key(|w| w.0);
        let arrived = in_flight.partition_point(|w| w.0 <= now);
        for (_, result, d) in in_flight.drain(..arrived).collect::<Vec<_>>() {
            if result {
                h.t.handle_datagram(now, &d);
            } else {
                let (mut r, payload) = wire::parse(&d).unwrap();
                let mut values = vec![0f32; ELEMS];
                codec::decode(Dtype::F32, payload, &mut values);
                values.iter_mut().for_each(|v| *v *= 2.0);
                r.kind = MsgType::Result;
                r.flags = 0;
                send(&mut rng, &mut in_flight, now, true, datagram(&r, &values));
            }
        }
        for (key, r, values) in h.completed() {
            let k = key as usize;
            assert_eq!(
                (r, values),
                (round[k], expected_key(key, 8, round[k])),
                "key {key}"
            );
            busy[k] = false;
        }
    }
    panic!("{rounds} rounds did not complete");
}

#[test]
fn a_lossy_duplicating_reordering_path_completes_every_round() {
    let mut seen = BTreeSet::new();
    for seed in 1..=4 {
        let (s, took) = simulate(seed, 0.1, 0.05, 2000, 20, 3);
        assert_eq!(s.results_accepted, 20 * 3 * 8, "seed {seed}");
        assert_eq!(s.chunks_sent, 20 * 3 * 8, "seed {seed}");
        assert!(s.retransmits > 0 && s.fast_retransmits > 0, "seed {seed}: {s:?}");
        assert!(
            s.results_ignored > 0,
            "seed {seed}: duplicates are ignored, {s:?}"
        );
        assert_eq!((s.timeouts, s.errors, s.foreign_dropped), (0, 0, 0));
        assert!(took < Duration::from_secs(20), "seed {seed}: {took:?}");
        seen.insert(s.retransmits);
    }
    assert!(seen.len() > 1, "the seeds draw different paths");
    // Without faults and jitter nothing is resent or ignored.
    let (s, _) = simulate(9, 0.0, 0.0, 0, 5, 2);
    assert_eq!((s.retransmits, s.results_ignored), (0, 0));
}

/// A one-element chunk `chunk` of lcore `lcore`, for [`Pending`]'s order.
fn pending_msg(lcore: u16, chunk: u32) -> ChunkMsg {
    ChunkMsg {
        chunk,
        slot: chunk,
        offset: 0,
        len: 1,
        to: lcore_addr(lcore),
        lcore,
        start: 0,
        bytes: HEADER_LEN,
    }
}

/// Every pending chunk, lanes unbounded: (request, lcore, chunk).
fn drain(p: &mut Pending) -> Vec<(u64, u16, u32)> {
    std::iter::from_fn(|| p.pop(usize::MAX, usize::MAX, 0))
        .map(|(id, m, _)| (id, m.lcore, m.chunk))
        .collect()
}

/// `sent` by lane: each lcore's sequence of (request, chunk).
fn by_lane(sent: &[(u64, u16, u32)]) -> BTreeMap<u16, Vec<(u64, u32)>> {
    let mut lanes: BTreeMap<u16, Vec<(u64, u32)>> = BTreeMap::new();
    for &(id, l, c) in sent {
        lanes.entry(l).or_default().push((id, c));
    }
    lanes
}

#[test]
fn pending_chunks_go_to_the_lcores_in_turn_each_in_its_order() {
    // A key whose first chunks live on lcore 0 (one appliance of a sharded
    // job), the rest on lcore 2: interleaved, each lcore's in its order.
    let mut p = Pending::default();
    p.push_request(
        1,
        1,
        (0..4)
            .map(|c| pending_msg(0, c))
            .chain((4..6).map(|c| pending_msg(2, c)))
            .collect(),
        true,
    );
    assert_eq!(
        drain(&mut p),
        [(1, 0, 0), (1, 2, 4), (1, 0, 1), (1, 2, 5), (1, 0, 2), (1, 0, 3)]
    );
    // Each lcore's sequence does not depend on when requests arrive: a
    // rank whose second request came after it had sent part of the first
    // sends every lcore the same sequence as one that had both at once
    // (otherwise two ranks can fill an lcore's window with chunks the
    // other has not sent, and wait for each other forever).
    let (a, b): (Vec<ChunkMsg>, Vec<ChunkMsg>) = (
        (0..4)
            .map(|c| pending_msg(0, c))
            .chain([pending_msg(1, 9)])
            .collect(),
        (0..4).map(|c| pending_msg(1, c)).collect(),
    );
    let mut at_once = Pending::default();
    at_once.push_request(1, 1, a.clone(), true);
    at_once.push_request(2, 1, b.clone(), true);
    let mut later = Pending::default();
    later.push_request(1, 1, a, true);
    let mut seen: Vec<(u64, u16, u32)> = (0..2)
        .filter_map(|_| later.pop(usize::MAX, usize::MAX, 0))
        .map(|(id, m, _)| (id, m.lcore, m.chunk))
        .collect();
    later.push_request(2, 1, b, true);
    seen.extend(drain(&mut later));
    assert_eq!(by_lane(&seen), by_lane(&drain(&mut at_once)));
    for c in 0..3 {
        p.push_request(1, 1, vec![pending_msg(1, c)], true);
        p.push_request(2, 1, vec![pending_msg(0, c)], true);
    }
    p.remove(1);
    assert_eq!(p.of(1).count(), 0);
    assert_eq!(drain(&mut p).len(), 3);
}

/// Keys each on one lcore (a layout gives each lcore one run of the chunk
/// sequence): the window is shared over the lanes, so every lcore has
/// chunks out at once, not one after the other in the keys' order (which
/// ran ResNet-50 at one lcore's speed at any L, BENCHMARKS.md); a lane
/// full or the window full stops a lane, but a lane with none out may
/// always send one, so no lane waits on another.
#[test]
fn the_window_is_shared_over_the_lanes_and_none_waits_on_another() {
    let mut p = Pending::default();
    for l in 0..4u16 {
        p.push_request(
            u64::from(l),
            1,
            (0..10).map(|c| pending_msg(l, c)).collect(),
            true,
        );
    }
    assert_eq!(p.active(), 4);
    // A window of 8 over 4 lanes: 2 each.
    let (window, cap) = (8, 8 / p.active());
    let mut out = 0;
    let mut sent = Vec::new();
    while let Some((id, m, lane)) = p.pop(cap, window, out) {
        assert_eq!(lane, m.lcore);
        p.sent(lane);
        out += 1;
        sent.push((id, m.lcore, m.chunk));
    }
    assert_eq!(out, 8);
    for (l, s) in by_lane(&sent) {
        assert_eq!(s, [(u64::from(l), 0), (u64::from(l), 1)], "lane {l}");
    }
    // A result of lane 2 lets lane 2 (only) send its next chunk.
    p.settled(2);
    let next = p
        .pop(cap, window, out - 1)
        .map(|(id, m, _)| (id, m.lcore, m.chunk));
    assert_eq!(next, Some((2, 2, 2)));
    p.sent(2);
    assert!(p.pop(cap, window, out).is_none(), "every lane full");
    // A fifth lane with none out sends one though the window is full.
    p.push_request(9, 1, vec![pending_msg(7, 0), pending_msg(7, 1)], true);
    let fifth = p.pop(cap, window, out).map(|(id, m, _)| (id, m.lcore, m.chunk));
    assert_eq!(fifth, Some((9, 7, 0)));
    p.sent(7);
    assert!(p.pop(cap, window, out + 1).is_none());
}

/// A rank whose keys stand at different rounds (after a rejoin) submits
/// them in key order; its chunks of the lowest round go first, as the
/// other ranks wait for those (the simulator's seed 133: a window smaller
/// than a round filled with chunks of the later round, and every rank
/// waited for ever). Requests of one round keep their order.
#[test]
fn pending_chunks_of_a_lower_round_go_first() {
    let mut p = Pending::default();
    p.push_request(1, 4, vec![pending_msg(0, 0), pending_msg(0, 1)], true);
    p.push_request(2, 3, vec![pending_msg(0, 0)], true);
    p.push_request(3, 4, vec![pending_msg(0, 0)], true);
    p.push_request(4, 3, vec![pending_msg(0, 1)], true);
    let ids: Vec<u64> = drain(&mut p).into_iter().map(|(id, _, _)| id).collect();
    assert_eq!(ids, [2, 4, 1, 1, 3]);
}

/// A window made from the job's shape follows the receive-buffer share the
/// lcores state: smaller when another job came, back when it left; one the
/// caller set, or a share of 0, changes nothing.
#[test]
fn an_automatic_window_follows_the_stated_receive_buffer_share() {
    // W = 2 workers, 2 lcores, 8 KiB datagrams, a 32 MiB own buffer and a
    // join answer of 32 MiB: the cache bound gives 2 * 1 MiB / (2 * 8 KiB)
    // = 128, capped by 64 chunks.
    let auto = AutoWindow {
        workers: 2,
        lcores: 2,
        chunks: 64,
        datagram: 8192,
        own_rcvbuf: 32 << 20,
        joined: 32 << 20,
    };
    let full = auto.window(auto.joined);
    assert_eq!(full, 64);
    let mut h = Harness::new(full);
    h.t.set_auto_window(auto);
    h.push(1, 1, &[0, 1]);
    assert_eq!(h.poll_chunks().len(), 2);
    // Lcore 0 states 256 KiB: 2 lcores x 256 KiB / (2 x 2 x 8 KiB) = 16;
    // lcore 1 has stated nothing, so the smaller of its join share and
    // lcore 0's counts.
    h.result_stating(1, 0, 1, 256 << 10);
    assert_eq!(h.t.window(), 16);
    assert_eq!(h.stats.window.load(Ordering::Relaxed), 16);
    // A share of 0 states nothing.
    h.result_stating(1, 1, 1, 0);
    assert_eq!(h.t.window(), 16);
    assert_eq!(h.completed().len(), 1);
    // Lcore 0 states 64 KiB (more jobs came): 4.
    h.push(1, 2, &[0, 1]);
    h.poll();
    h.result_stating(1, 0, 2, 64 << 10);
    assert_eq!(h.t.window(), 4);
    // Both lcores state the whole buffer again (the others left): back to 64.
    h.result_stating(1, 1, 2, 32 << 20);
    assert_eq!(h.t.window(), 4, "lcore 0 still states 64 KiB");
    h.push(1, 3, &[0, 1]);
    h.poll();
    h.result_stating(1, 0, 3, 32 << 20);
    assert_eq!(h.t.window(), 64);

    // A window the caller set stays.
    let mut set = Harness::new(40);
    set.push(1, 1, &[0, 1]);
    set.poll();
    set.result_stating(1, 0, 1, 64 << 10);
    assert_eq!(set.t.window(), 40);
}

/// A hierarchical job's ranks send each key's chunks in one order whatever
/// their rack's layout (by the chunk index alone, spread over the key), so
/// no two racks fill their windows with chunks the other has not sent.
#[test]
fn hierarchical_ranks_send_in_an_order_that_does_not_depend_on_their_rack() {
    let order = |by: &dyn Fn(u32) -> u16| {
        let mut p = Pending::default();
        p.push_request(1, 1, (0..8).map(|c| pending_msg(by(c), c)).collect(), false);
        drain(&mut p).into_iter().map(|(_, _, c)| c).collect::<Vec<u32>>()
    };
    // Rack 0: one lcore; rack 1: chunks 0..3 on lcore 0, 3..8 on lcore 1.
    let rack0 = order(&|_| 0);
    let rack1 = order(&|c| u16::from(c >= 3));
    assert_eq!(rack0, rack1);
    assert_eq!(rack0, [0, 4, 2, 6, 1, 5, 3, 7]);
}
