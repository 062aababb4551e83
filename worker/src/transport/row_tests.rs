//! The row transport driven without a socket: a clock the tests advance,
//! and an appliance played by hand with [`phub_proto::rows::write`]
//! ([`FakeLcore`]: PROTOCOL.md §10.3's BSP rules for one rank, with the
//! `sum` optimizer and rows that start at zero).
// Test data: small numbers cast freely.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_proto::placement::RowPlacement;
use phub_proto::rows::{self, ids_signature, CacheRef, KeyCache, RowMsgType, RowPayload, RowRepr};
use phub_proto::wire::{flags, DropReason, MsgType, Repr, APPLIANCE_RANK};
use phub_proto::Dtype;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::row_plan::{plan_pull, plan_push, TableInfo};
use super::rows::{RowOutput, RowRequest, RowTransport, PULL_TAG};
use super::JobInfo;
use crate::config::WorkerConfig;
use crate::error::WorkerError;
use crate::stats::Counters;

pub(crate) const JOB: u16 = 5;
pub(crate) const TOKEN: u64 = 0x7ab1_e5ee_d000_0001;
const RANK: u16 = 0;
pub(crate) const KEY: u32 = 1;

fn addr(entry: u32) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9000 + entry as u16))
}

fn table(lcores: u32, dim: u32, per: u32) -> TableInfo {
    TableInfo {
        key: KEY,
        name: "emb".into(),
        dim,
        per,
        placement: RowPlacement::new(7, KEY, &[lcores]).unwrap(),
        key_cache: 0,
    }
}

/// A message the transport sent, parsed.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    pub(crate) to: SocketAddr,
    pub(crate) repr: RowRepr,
    /// The ids it carried (none in the cached form, PROTOCOL.md §10.7).
    pub(crate) ids: Vec<u64>,
    pub(crate) rows: Vec<f32>,
    /// The datagram.
    pub(crate) raw: Vec<u8>,
}

impl Sent {
    /// A row message a worker sent to `to`, parsed.
    pub(crate) fn parse(to: SocketAddr, d: &[u8]) -> Sent {
        let (repr, payload) = rows::parse(d).expect("the transport sends well-formed row messages");
        let (ids, rows) = match payload {
            RowPayload::Rows(r) => {
                let mut v = vec![0f32; r.len() * repr.dim as usize];
                for (i, row) in v.chunks_exact_mut(repr.dim as usize).enumerate() {
                    assert!(r.decode_row(i, row));
                }
                (r.ids().iter().collect(), v)
            }
            RowPayload::Ids(ids) => (ids.iter().collect(), Vec::new()),
            RowPayload::Empty => (Vec::new(), Vec::new()),
            RowPayload::Cached(values) => {
                let mut v = vec![0f32; values.len() / 4];
                phub_proto::dtype::decode(Dtype::F32, values, &mut v);
                (Vec::new(), v)
            }
        };
        Sent {
            to,
            repr,
            ids,
            rows,
            raw: d.to_vec(),
        }
    }

    fn retransmit(&self) -> bool {
        self.repr.flags & flags::RETRANSMIT != 0
    }
}

/// A row answer as the appliance writes it.
fn answer(kind: RowMsgType, round: u32, dim: u32, seq: u32, ids: &[u64], rows: &[f32]) -> Vec<u8> {
    answer_in(None, kind, round, dim, seq, ids, rows)
}

/// A row answer, in the cached form with `cache` (PROTOCOL.md §10.7).
fn answer_in(
    cache: Option<CacheRef>,
    kind: RowMsgType,
    round: u32,
    dim: u32,
    seq: u32,
    ids: &[u64],
    rows: &[f32],
) -> Vec<u8> {
    let repr = RowRepr {
        kind,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        rank: APPLIANCE_RANK,
        count: ids.len() as u16,
        round,
        dim,
        key: KEY,
        seq,
        cache: cache.map_or(KeyCache::Off, KeyCache::Cached),
    };
    let mut buf = vec![0u8; 9000];
    let n = rows::write(&repr, ids, rows, &mut buf);
    buf.truncate(n);
    buf
}

/// The ERROR the appliance answers a refused `m` with (§5.7).
fn error_for(m: &Sent, reason: u16) -> Vec<u8> {
    Repr {
        kind: MsgType::Error,
        dtype: m.repr.dtype,
        flags: 0,
        token: m.repr.token,
        job: m.repr.job,
        rank: m.repr.rank,
        count: 0,
        error: reason,
        round: m.repr.round,
        slot: m.repr.dim,
        key: m.repr.key,
        chunk: m.repr.seq,
    }
    .to_datagram(&[])
}

/// One lcore of the appliance, for one rank (W = 1), BSP, `sum`, rows
/// starting at zero: §10.3's rules as the worker sees them.
#[derive(Debug, Default, Clone)]
pub(crate) struct FakeLcore {
    dim: usize,
    stored: HashMap<u64, Vec<f32>>,
    /// The last completed round.
    done: u32,
    got: BTreeMap<u32, (Vec<u64>, Option<CacheRef>)>,
    /// The rank's key-cache slots: signature and ids (PROTOCOL.md §10.7).
    pub(crate) slots: HashMap<u32, (u64, Vec<u64>)>,
    n: Option<u32>,
    acc: BTreeMap<u64, Vec<f32>>,
}

impl FakeLcore {
    /// An lcore of a table of `dim` whose rows all start at zero.
    pub(crate) fn new(dim: u32) -> FakeLcore {
        FakeLcore {
            dim: dim as usize,
            ..FakeLcore::default()
        }
    }

    fn row(&self, id: u64) -> Vec<f32> {
        self.stored
            .get(&id)
            .cloned()
            .unwrap_or_else(|| vec![0.0; self.dim])
    }

    fn rows_of(&self, ids: &[u64]) -> Vec<f32> {
        ids.iter().flat_map(|&id| self.row(id)).collect()
    }

    /// The answers to `m`.
    pub(crate) fn handle(&mut self, m: &Sent) -> Vec<Vec<u8>> {
        let (t, dim) = (m.repr.round, m.repr.dim);
        // §10.7: a store keeps the ids, a cached form names them.
        let mut m = m.clone();
        let cache = match m.repr.cache {
            KeyCache::Off => None,
            KeyCache::Store(c) => {
                assert_eq!(c.sig, ids_signature(m.ids.iter().copied()));
                self.slots.insert(c.slot, (c.sig, m.ids.clone()));
                Some(c)
            }
            KeyCache::Cached(c) => match self.slots.get(&c.slot) {
                Some((sig, ids)) if *sig == c.sig && ids.len() == usize::from(m.repr.count) => {
                    m.ids.clone_from(ids);
                    Some(c)
                }
                _ => return vec![error_for(&m, DropReason::UnknownSignature.code())],
            },
        };
        let m = &m;
        match m.repr.kind {
            RowMsgType::RowPull => {
                vec![answer_in(
                    cache,
                    RowMsgType::RowPullResult,
                    self.done,
                    dim,
                    m.repr.seq,
                    &m.ids,
                    &self.rows_of(&m.ids),
                )]
            }
            RowMsgType::RowPush if t == self.done + 1 => {
                if self.got.contains_key(&m.repr.seq) {
                    return Vec::new(); // duplicate
                }
                for (i, &id) in m.ids.iter().enumerate() {
                    let g = &m.rows[i * self.dim..][..self.dim];
                    let a = self.acc.entry(id).or_insert_with(|| vec![0.0; self.dim]);
                    for (x, y) in a.iter_mut().zip(g) {
                        *x += y;
                    }
                }
                self.got.insert(m.repr.seq, (m.ids.clone(), cache));
                self.complete(dim)
            }
            RowMsgType::RowPush if t == self.done => {
                vec![answer_in(
                    cache,
                    RowMsgType::RowResult,
                    t,
                    dim,
                    m.repr.seq,
                    &m.ids,
                    &self.rows_of(&m.ids),
                )]
            }
            RowMsgType::RowEnd if t == self.done + 1 => {
                if self.n.is_some() {
                    return Vec::new(); // duplicate
                }
                self.n = Some(m.repr.seq);
                self.complete(dim)
            }
            // The last completed round, or an older one (a worker of the
            // rank that another replaced checks its idle table, as the
            // engine answers it: PROTOCOL.md §10.3 rule 4).
            RowMsgType::RowEnd if t >= 1 && t <= self.done => {
                vec![answer(RowMsgType::RowDone, t, dim, m.repr.seq, &[], &[])]
            }
            // Beyond the round in progress (an lcore restored from an
            // older checkpoint): rule 5.
            RowMsgType::RowPush | RowMsgType::RowEnd if t > self.done + 1 => {
                vec![error_for(m, DropReason::Ahead.code())]
            }
            _ => panic!("the fake appliance got {:?} while at round {}", m.repr, self.done),
        }
    }

    fn complete(&mut self, dim: u32) -> Vec<Vec<u8>> {
        let Some(n) = self.n else {
            return Vec::new();
        };
        if (0..n).any(|s| !self.got.contains_key(&s)) {
            return Vec::new();
        }
        for (id, g) in std::mem::take(&mut self.acc) {
            let mut r = self.row(id);
            for (x, y) in r.iter_mut().zip(&g) {
                *x += y;
            }
            self.stored.insert(id, r);
        }
        self.done += 1;
        let t = self.done;
        let mut out: Vec<Vec<u8>> = std::mem::take(&mut self.got)
            .into_iter()
            .map(|(s, (ids, cache))| {
                answer_in(cache, RowMsgType::RowResult, t, dim, s, &ids, &self.rows_of(&ids))
            })
            .collect();
        out.push(answer(RowMsgType::RowDone, t, dim, n, &[], &[]));
        self.n = None;
        out
    }
}

/// How a request ended: its tag and its output or error.
type Ended = (u32, Result<RowOutput, WorkerError>);

struct Harness {
    t: RowTransport<u32>,
    table: TableInfo,
    stats: Arc<Counters>,
    now: Instant,
    lcores: Vec<FakeLcore>,
}

impl Harness {
    fn new(lcores: u32, dim: u32, per: u32, window: usize) -> Harness {
        let table = table(lcores, dim, per);
        let stats = Arc::new(Counters::default());
        let now = Instant::now();
        let info = JobInfo {
            job: JOB,
            token: TOKEN,
            rank: RANK,
            dtype: Dtype::F32,
            in_order: true,
        };
        let t = RowTransport::new(
            info,
            (0..lcores).map(addr).collect(),
            vec![table.clone()],
            window,
            &WorkerConfig::default(),
            Arc::clone(&stats),
            now,
        );
        let lcores = (0..lcores).map(|_| FakeLcore::new(dim)).collect();
        Harness {
            t,
            table,
            stats,
            now,
            lcores,
        }
    }

    fn t_info(&self) -> JobInfo {
        JobInfo {
            job: JOB,
            token: TOKEN,
            rank: RANK,
            dtype: Dtype::F32,
            in_order: true,
        }
    }

    fn push(&mut self, tag: u32, round: u32, ids: &[u64], grads: &[f32]) {
        let plan = plan_push(self.t.table(KEY).unwrap(), round, ids, grads).unwrap();
        self.t.submit(self.now, RowRequest { plan, done: tag });
    }

    fn pull(&mut self, tag: u32, ids: &[u64]) {
        let plan = plan_pull(self.t.table(KEY).unwrap(), ids).unwrap();
        self.t.submit(self.now, RowRequest { plan, done: tag });
    }

    /// What the transport sends now, parsed.
    fn sent(&mut self) -> Vec<Sent> {
        let mut out = Vec::new();
        self.t.poll_transmit(self.now, &mut out);
        out.iter()
            .map(|d| {
                assert!(d.body.is_empty());
                let m = Sent::parse(d.to, d.head);
                assert_eq!(
                    (m.repr.job, m.repr.token, m.repr.rank, m.repr.key),
                    (JOB, TOKEN, RANK, KEY)
                );
                m
            })
            .collect()
    }

    fn deliver(&mut self, from: SocketAddr, d: &[u8]) {
        assert!(
            self.t.handle(self.now, from, d),
            "the row transport takes row answers"
        );
    }

    /// The fake appliance's answers to `sent`, each with its source.
    fn answers(&mut self, sent: &[Sent]) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut out = Vec::new();
        for m in sent {
            let e = (m.to.port() - 9000) as usize;
            out.extend(self.lcores[e].handle(m).into_iter().map(|d| (m.to, d)));
        }
        out
    }

    /// Moves the clock to the transport's next timer and runs it.
    fn advance(&mut self) {
        let at = self.t.poll_timeout().expect("a timer while busy");
        self.now = self.now.max(at);
        self.t.handle_timeout(self.now);
    }

    fn ended(&mut self) -> Vec<Ended> {
        std::iter::from_fn(|| self.t.poll_done())
            .map(|f| {
                assert_eq!(f.key, KEY);
                (f.done, f.result)
            })
            .collect()
    }

    /// Runs until the transport is idle, losing each datagram for which
    /// `lose(to_appliance, bytes)` says so; returns what ended.
    fn run(&mut self, mut lose: impl FnMut(bool, &[u8]) -> bool) -> Vec<Ended> {
        self.run_with(|to, d| usize::from(!lose(to, d)), |_| {})
    }

    /// Runs until the transport is idle: each datagram is delivered
    /// `copies(to_appliance, bytes)` times (0: lost), each batch of
    /// answers in the order `shuffle` leaves it; returns what ended.
    fn run_with(
        &mut self,
        mut copies: impl FnMut(bool, &[u8]) -> usize,
        mut shuffle: impl FnMut(&mut Vec<(SocketAddr, Vec<u8>)>),
    ) -> Vec<Ended> {
        let mut ended = Vec::new();
        for _ in 0..10_000 {
            let sent = self.sent();
            let mut kept = Vec::new();
            for m in sent {
                for _ in 0..copies(true, &m.raw) {
                    kept.push(m.clone());
                }
            }
            let mut answers = Vec::new();
            for (from, d) in self.answers(&kept) {
                for _ in 0..copies(false, &d) {
                    answers.push((from, d.clone()));
                }
            }
            shuffle(&mut answers);
            for (from, d) in answers {
                self.deliver(from, &d);
            }
            ended.extend(self.ended());
            if !self.t.busy() {
                return ended;
            }
            if self.t.outstanding() > 0 {
                self.advance();
            }
        }
        panic!("the transport did not finish");
    }
}

fn grads(ids: &[u64], dim: u32, salt: f32) -> Vec<f32> {
    ids.iter()
        .enumerate()
        .flat_map(|(i, &id)| (0..dim).map(move |e| (id % 1000) as f32 + e as f32 * 0.25 + i as f32 * salt))
        .collect()
}

#[test]
fn every_row_goes_to_its_lcore_in_sorted_messages_of_at_most_r_and_every_lcore_gets_a_row_end() {
    let (lcores, dim, per) = (4, 3, 5);
    let mut h = Harness::new(lcores, dim, per, 1024);
    // Ids that miss lcore 2 altogether: it must still get a ROW_END of 0.
    let ids: Vec<u64> = (0..400u64)
        .map(|i| i * 7919 + 3)
        .filter(|&id| h.table.placement.entry(id) != 2)
        .take(60)
        .collect();
    let g = grads(&ids, dim, 0.0);
    h.push(1, 1, &ids, &g);
    let sent = h.sent();
    // Per lcore: its ROW_PUSH sequence numbers, their ids, its ROW_END's n.
    type Lane = (Vec<u32>, Vec<u64>, Option<u32>);
    let mut per_lcore: BTreeMap<u32, Lane> = BTreeMap::new();
    for m in &sent {
        let e = u32::from(m.to.port() - 9000);
        let lane = per_lcore.entry(e).or_default();
        assert_eq!(m.repr.round, 1);
        assert_eq!(m.repr.dim, dim);
        assert!(!m.retransmit());
        match m.repr.kind {
            RowMsgType::RowPush => {
                assert!(lane.2.is_none(), "a ROW_PUSH after the lcore's ROW_END");
                assert!(
                    !m.ids.is_empty() && m.ids.len() <= per as usize,
                    "{} rows",
                    m.ids.len()
                );
                assert!(m.ids.windows(2).all(|w| w[0] < w[1]), "sorted: {:?}", m.ids);
                for &id in &m.ids {
                    assert_eq!(h.table.placement.entry(id), e, "id {id} sent to lcore {e}");
                }
                lane.0.push(m.repr.seq);
                lane.1.extend(&m.ids);
            }
            RowMsgType::RowEnd => {
                assert!(lane.2.is_none(), "two ROW_ENDs to lcore {e}");
                assert!(m.ids.is_empty());
                lane.2 = Some(m.repr.seq);
            }
            k => panic!("a {k:?} in a push"),
        }
    }
    assert_eq!(per_lcore.len(), lcores as usize, "every lcore gets messages");
    let mut all: Vec<u64> = Vec::new();
    for (e, (seqs, got, n)) in &per_lcore {
        let rows = ids
            .iter()
            .filter(|&&id| h.table.placement.entry(id) == *e)
            .count();
        let want = rows.div_ceil(per as usize) as u32;
        assert_eq!(*n, Some(want), "lcore {e}: ROW_END count");
        assert_eq!(
            seqs,
            &(0..want).collect::<Vec<_>>(),
            "lcore {e}: sequence numbers"
        );
        assert_eq!(got.len(), rows);
        all.extend(got);
    }
    assert_eq!(
        per_lcore[&2].2,
        Some(0),
        "the lcore with no row gets ROW_END n = 0"
    );
    all.sort_unstable();
    let mut want = ids.clone();
    want.sort_unstable();
    assert_eq!(all, want, "each id once");
}

#[test]
fn duplicate_ids_are_summed_and_their_rows_come_back_at_every_position() {
    let dim = 2;
    let mut h = Harness::new(2, dim, 4, 64);
    let ids = [7u64, 3, 7, 9, 7];
    let g = [1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 4.0, 40.0, 5.0, 50.0];
    h.push(1, 1, &ids, &g);
    let sent = h.sent();
    let pushed: Vec<(u64, Vec<f32>)> = sent
        .iter()
        .filter(|m| m.repr.kind == RowMsgType::RowPush)
        .flat_map(|m| {
            m.ids
                .iter()
                .enumerate()
                .map(|(i, &id)| (id, m.rows[i * 2..i * 2 + 2].to_vec()))
        })
        .collect();
    let seven: Vec<_> = pushed.iter().filter(|(id, _)| *id == 7).collect();
    assert_eq!(seven.len(), 1, "id 7 is sent once");
    assert_eq!(seven[0].1, vec![1.0 + 3.0 + 5.0, 10.0 + 30.0 + 50.0]);
    assert_eq!(pushed.len(), 3);
    for (from, d) in h.answers(&sent) {
        h.deliver(from, &d);
    }
    let ended = h.ended();
    let out = ended[0].1.as_ref().unwrap();
    assert_eq!(out.round, 1);
    assert_eq!(
        out.caller_rows(),
        vec![9.0, 90.0, 2.0, 20.0, 9.0, 90.0, 4.0, 40.0, 9.0, 90.0],
        "each position gets its id's row after the update"
    );
}

/// Runs a round in which the first datagram of kind `kind` (in either
/// direction) is lost, and checks it is resent with RETRANSMIT and the
/// round completes.
fn lose_first(kind: RowMsgType) {
    let dim = 2;
    let mut h = Harness::new(3, dim, 2, 64);
    let ids: Vec<u64> = (0..12).collect();
    let g = grads(&ids, dim, 0.0);
    h.push(1, 1, &ids, &g);
    let mut lost = 0;
    let mut resent_after_loss = 0;
    let ended = h.run(|to_appliance, d| {
        let (r, _) = rows::parse(d).unwrap();
        if to_appliance && r.flags & flags::RETRANSMIT != 0 {
            resent_after_loss += 1;
        }
        if r.kind == kind && lost == 0 {
            lost += 1;
            return true;
        }
        false
    });
    assert_eq!(lost, 1, "a {kind:?} was lost");
    assert!(resent_after_loss >= 1, "something was resent with RETRANSMIT");
    assert!(h.stats.row_retransmits.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    let out = ended[0].1.as_ref().unwrap();
    assert_eq!(
        out.caller_rows(),
        g,
        "rows that started at zero hold the gradient"
    );
}

#[test]
fn a_lost_row_push_is_resent_and_the_round_completes() {
    lose_first(RowMsgType::RowPush);
}

#[test]
fn a_lost_row_result_is_fetched_again_by_resending_its_push() {
    lose_first(RowMsgType::RowResult);
}

#[test]
fn a_lost_row_end_is_resent_and_the_round_completes() {
    lose_first(RowMsgType::RowEnd);
}

#[test]
fn a_lost_row_done_is_fetched_again_by_resending_the_row_end() {
    lose_first(RowMsgType::RowDone);
}

#[test]
fn duplicated_and_reordered_answers_are_taken_once() {
    let dim = 3;
    let mut h = Harness::new(2, dim, 2, 64);
    let ids: Vec<u64> = (100..109).collect();
    let g = grads(&ids, dim, 0.5);
    h.push(1, 1, &ids, &g);
    let sent = h.sent();
    let mut answers = h.answers(&sent);
    answers.reverse();
    let n = answers.len() as u64;
    // Every answer twice, the second copies after the first ones.
    for (from, d) in answers.clone().into_iter().chain(answers) {
        h.deliver(from, &d);
    }
    let ended = h.ended();
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].1.as_ref().unwrap().caller_rows(), g);
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&h.stats.row_answers_accepted), n);
    assert_eq!(
        load(&h.stats.row_answers_ignored),
        n,
        "the second copies are ignored"
    );
    // A stale answer of round 1 during round 2 is ignored too.
    h.push(2, 2, &ids, &g);
    let sent2 = h.sent();
    let (_, stale) = &h.answers(&sent)[0];
    let stale = stale.clone();
    h.deliver(sent2[0].to, &stale);
    assert_eq!(load(&h.stats.row_answers_ignored), n + 1);
    assert!(h.ended().is_empty());
}

#[test]
fn the_next_round_is_not_sent_before_the_last_is_complete() {
    let dim = 1;
    let mut h = Harness::new(2, dim, 4, 64);
    let ids: Vec<u64> = (0..10).collect();
    let g = grads(&ids, dim, 0.0);
    h.push(1, 1, &ids, &g);
    let sent = h.sent();
    let answers = h.answers(&sent);
    // Everything but the last ROW_DONE.
    let (held_from, held) = answers
        .iter()
        .rev()
        .find(|(_, d)| rows::parse(d).unwrap().0.kind == RowMsgType::RowDone)
        .cloned()
        .unwrap();
    for (from, d) in &answers {
        if *d != held {
            h.deliver(*from, d);
        }
    }
    assert!(h.ended().is_empty(), "not complete without a ROW_DONE");
    h.push(2, 2, &ids, &g);
    assert!(
        h.sent().iter().all(|m| m.repr.round == 1),
        "nothing of round 2 goes out"
    );
    let ended = h.ended();
    assert!(
        matches!(ended[0].1, Err(WorkerError::Busy { key: KEY })),
        "{:?}",
        ended[0].1
    );
    h.deliver(held_from, &held);
    assert_eq!(h.ended()[0].0, 1);
    h.push(3, 2, &ids, &g);
    let sent = h.sent();
    assert!(!sent.is_empty() && sent.iter().all(|m| m.repr.round == 2));
}

#[test]
fn an_error_is_matched_to_its_message_and_named() {
    let dim = 2;
    let mut h = Harness::new(2, dim, 2, 64);
    let ids: Vec<u64> = (0..9).collect();
    h.push(1, 1, &ids, &grads(&ids, dim, 0.0));
    let sent = h.sent();
    let push1 = sent
        .iter()
        .find(|m| m.repr.kind == RowMsgType::RowPush && m.repr.seq == 1)
        .unwrap()
        .clone();
    // An ERROR about another round is not this request's.
    let mut other = push1.clone();
    other.repr.round = 7;
    h.deliver(push1.to, &error_for(&other, DropReason::Ahead.code()));
    assert!(h.ended().is_empty());
    // From an address that is no lcore of the job: not it either.
    let e = error_for(&push1, DropReason::RowOutOfPlace.code());
    h.deliver(addr(40), &e);
    assert!(h.ended().is_empty());
    h.deliver(push1.to, &e);
    let ended = h.ended();
    let err = ended[0].1.as_ref().unwrap_err().to_string();
    assert!(
        err.contains("row_out_of_place")
            && err.contains("ROW_PUSH 1")
            && err.contains("emb")
            && err.contains("round 1"),
        "{err}"
    );
    assert!(!h.t.busy());
    assert_eq!(h.t.outstanding(), 0);
    // A ROW_END refused as `ahead`, and a pull's ERROR, name theirs.
    h.push(2, 1, &ids, &grads(&ids, dim, 0.0));
    let sent = h.sent();
    let end = sent.iter().find(|m| m.repr.kind == RowMsgType::RowEnd).unwrap();
    h.deliver(end.to, &error_for(end, DropReason::Ahead.code()));
    let err = h.ended()[0].1.as_ref().unwrap_err().to_string();
    assert!(err.contains("ahead") && err.contains("ROW_END"), "{err}");
    h.pull(3, &ids);
    let sent = h.sent();
    assert!(sent.iter().all(|m| m.repr.seq & PULL_TAG != 0));
    h.deliver(sent[0].to, &error_for(&sent[0], DropReason::DimMismatch.code()));
    let err = h.ended()[0].1.as_ref().unwrap_err().to_string();
    assert!(err.contains("dim_mismatch") && err.contains("ROW_PULL"), "{err}");
}

/// PROTOCOL.md §10.6: an lcore restored from a checkpoint older than the
/// rounds this rank completed there refuses its next push `ahead`. The
/// worker asks it where the table stands, sends it an empty round for
/// each round it lost, then the push's messages again; the push ends with
/// the rows the lcore holds (the lost rounds' rows gone with the
/// checkpoint), and the other lcore is not touched. Before this rule the
/// push failed naming `ahead`.
#[test]
fn a_push_refused_ahead_by_a_restored_lcore_brings_it_up_to_the_round() {
    let dim = 2;
    let mut h = Harness::new(2, dim, 2, 4);
    let ids: Vec<u64> = (0..12).collect();
    let mut saved = None;
    for round in 1..=3u32 {
        h.push(round, round, &ids, &grads(&ids, dim, round as f32));
        let ended = h.run(|_, _| false);
        assert!(ended[0].1.is_ok(), "round {round}: {:?}", ended[0].1);
        if round == 1 {
            saved = Some(h.lcores[1].clone());
        }
    }
    // Lcore 1 restarts from its checkpoint of round 1: rounds 2 and 3 lost.
    h.lcores[1] = saved.unwrap();
    let sent_before = h
        .stats
        .row_messages_sent
        .load(std::sync::atomic::Ordering::Relaxed);
    h.push(4, 4, &ids, &grads(&ids, dim, 4.0));
    let ended = h.run(|_, _| false);
    let out = match &ended[0].1 {
        Ok(o) => o,
        Err(e) => panic!("the push after the restore failed: {e}"),
    };
    assert_eq!(out.round, 4);
    assert_eq!((h.lcores[0].done, h.lcores[1].done), (4, 4));
    let d = dim as usize;
    for (i, &id) in ids.iter().enumerate() {
        let rounds: &[u32] = if h.table.placement.entry(id) == 1 {
            &[1, 4]
        } else {
            &[1, 2, 3, 4]
        };
        let want: Vec<f32> = (0..d)
            .map(|e| {
                rounds
                    .iter()
                    .map(|&r| grads(&ids, dim, r as f32)[i * d + e])
                    .sum()
            })
            .collect();
        assert_eq!(&out.caller_rows()[i * d..(i + 1) * d], &want[..], "id {id}");
    }
    let s = h.stats.snapshot();
    assert_eq!(
        s.row_rounds_caught_up, 2,
        "empty rounds 2 and 3 to lcore 1: {s:?}"
    );
    assert!(s.row_messages_sent > sent_before);
    assert!(!h.t.busy() && h.t.outstanding() == 0);
    // Round 1 refused `ahead` is no restore's: the push fails, naming it
    // (an_error_is_matched_to_its_message_and_named).
}

/// A BSP round completes on its lcore, but of its answers only the first
/// arrives before the lcore restarts from a checkpoint older than the
/// round: the restored lcore takes the unanswered messages as the round in
/// progress and needs the answered one too, which goes again with the
/// lane's later resends (PROTOCOL.md §10.6; simulator seed 6816). Before,
/// it never went again and the push timed out.
#[test]
fn a_bsp_lane_sends_its_answered_messages_again_for_a_restored_lcore() {
    let dim = 2;
    let mut h = Harness::new(1, dim, 2, 64);
    let ids: Vec<u64> = (0..6).collect();
    let g = grads(&ids, dim, 1.0);
    let saved = h.lcores[0].clone();
    h.push(1, 1, &ids, &g);
    let sent = h.sent();
    let answers = h.answers(&sent);
    assert_eq!(answers.len(), 4, "three ROW_RESULTs and a ROW_DONE");
    let (from, d) = answers[0].clone();
    h.deliver(from, &d);
    h.lcores[0] = saved;
    let ended = h.run(|_, _| false);
    let out = match &ended[..] {
        [(1, Ok(out))] => out,
        other => panic!("the push after the restore: {other:?}"),
    };
    assert_eq!(out.caller_rows(), g);
    assert_eq!(h.lcores[0].done, 1, "the restored lcore completed round 1 again");
}

/// Round 2 with a window of one: the lane to lcore 0 goes, the lane to
/// lcore 1 is held behind the window. Lcore 0 never answers (it waits on
/// other ranks) and lcore 1 was restored from before round 1, so it waits
/// for this rank's empty round 1, which the rank would only learn from
/// round 2's `ahead` there. Once no answer has come for a while the held
/// lane asks lcore 1 where the table stands, brings it up and goes (then
/// lcore 0 answers and the push completes). Before, nothing went to lcore
/// 1 until lcore 0 answered (simulator seed 35557: four ranks' windows
/// full of one table's lanes, a fifth waiting on the restored lcore).
#[test]
fn a_lane_held_behind_the_window_asks_a_restored_lcore_where_it_stands() {
    let dim = 2;
    let mut h = Harness::new(2, dim, 2, 1);
    let ids: Vec<u64> = (0..12).collect();
    let saved = h.lcores[1].clone();
    h.push(1, 1, &ids, &grads(&ids, dim, 1.0));
    assert!(h.run(|_, _| false)[0].1.is_ok());
    h.lcores[1] = saved;
    h.push(2, 2, &ids, &grads(&ids, dim, 2.0));
    let mut to_lcore_1 = 0;
    for _ in 0..40 {
        for m in h.sent() {
            if m.to == addr(0) {
                continue; // lcore 0 waits on other ranks
            }
            to_lcore_1 += 1;
            for (from, d) in h.answers(std::slice::from_ref(&m)) {
                h.deliver(from, &d);
            }
        }
        if h.lcores[1].done == 2 {
            break;
        }
        h.advance();
    }
    assert_eq!(h.lcores[1].done, 2, "lcore 1 brought up and given round 2");
    assert!(to_lcore_1 >= 3, "a ROW_PULL, an empty round and the lane");
    let s = h.stats.snapshot();
    assert_eq!((s.row_lanes_probed, s.row_rounds_caught_up), (1, 1), "{s:?}");
    let ended = h.run(|_, _| false);
    assert!(matches!(&ended[..], [(2, Ok(_))]), "{ended:?}");
}

#[test]
fn malformed_answers_are_counted_and_dropped() {
    let dim = 2;
    let mut h = Harness::new(1, dim, 4, 64);
    let ids = [4u64, 5, 6];
    let g = grads(&ids, dim, 0.0);
    h.push(1, 1, &ids, &g);
    let sent = h.sent();
    let to = sent[0].to;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let bad = [
        // Another dim.
        answer(RowMsgType::RowResult, 1, dim + 1, 0, &ids, &[0.0; 9]),
        // Fewer ids than asked.
        answer(RowMsgType::RowResult, 1, dim, 0, &ids[..2], &[0.0; 4]),
        // Other ids.
        answer(RowMsgType::RowResult, 1, dim, 0, &[4, 5, 7], &[0.0; 6]),
        // A sequence number beyond the lcore's messages.
        answer(RowMsgType::RowResult, 1, dim, 5, &ids, &[0.0; 6]),
        // A ROW_DONE with another count.
        answer(RowMsgType::RowDone, 1, dim, 3, &[], &[]),
        // Truncated.
        answer(RowMsgType::RowResult, 1, dim, 0, &ids, &[0.0; 6])[..100].to_vec(),
    ];
    for b in &bad {
        h.deliver(to, b);
    }
    assert_eq!(load(&h.stats.row_answers_malformed), bad.len() as u64);
    // From an address that is no lcore of the job.
    h.deliver(
        addr(40),
        &answer(RowMsgType::RowResult, 1, dim, 0, &ids, &[0.0; 6]),
    );
    assert_eq!(load(&h.stats.foreign_dropped), 1);
    assert!(h.ended().is_empty());
    for (from, d) in h.answers(&sent) {
        h.deliver(from, &d);
    }
    assert_eq!(h.ended()[0].1.as_ref().unwrap().caller_rows(), g);
}

#[test]
fn a_lost_row_pull_is_resent_and_an_earlier_pull_s_answer_is_not_taken() {
    let dim = 2;
    let mut h = Harness::new(2, dim, 3, 64);
    let ids: Vec<u64> = (0..8).collect();
    let g = grads(&ids, dim, 0.0);
    h.push(1, 1, &ids, &g);
    assert!(h.run(|_, _| false)[0].1.is_ok());
    // A first pull, answered; its answers kept to replay during the second.
    h.pull(2, &ids);
    let first = h.sent();
    let old = h.answers(&first);
    for (from, d) in &old {
        h.deliver(*from, d);
    }
    let out = h.ended().remove(0).1.unwrap();
    assert_eq!((out.round, out.caller_rows()), (1, g.clone()));
    // Round 2 changes every row.
    h.push(3, 2, &ids, &g);
    assert!(h.run(|_, _| false)[0].1.is_ok());
    // The second pull asks for the same rows (in another order, one
    // twice: the same messages) and loses its first ROW_PULL; the first
    // pull's answers, replayed, carry the same ids but older rows.
    let ids2 = [7u64, 6, 5, 4, 3, 2, 1, 0, 7];
    h.pull(4, &ids2);
    let sent = h.sent();
    assert_eq!(sent.len(), first.len());
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let ignored = load(&h.stats.row_answers_ignored);
    for (from, d) in &old {
        h.deliver(*from, d);
    }
    assert!(
        h.ended().is_empty(),
        "the first pull's answers do not answer the second"
    );
    assert_eq!(load(&h.stats.row_answers_ignored), ignored + old.len() as u64);
    let kept = &sent[1..];
    for (from, d) in h.answers(kept) {
        h.deliver(from, &d);
    }
    assert!(h.ended().is_empty());
    h.advance();
    let again = h.sent();
    assert_eq!(again.len(), 1);
    assert!(again[0].retransmit() && again[0].ids == sent[0].ids);
    for (from, d) in h.answers(&again) {
        h.deliver(from, &d);
    }
    let out = h.ended().remove(0).1.unwrap();
    let want: Vec<f32> = ids2
        .iter()
        .flat_map(|&id| g[id as usize * 2..][..2].iter().map(|x| 2.0 * x))
        .collect();
    assert_eq!((out.round, out.caller_rows()), (2, want));
}

#[test]
fn a_silent_appliance_times_the_request_out_naming_its_lcores() {
    let mut h = Harness::new(2, 1, 2, 64);
    h.push(1, 1, &[1, 2, 3], &[1.0, 2.0, 3.0]);
    let _ = h.sent();
    let deadline = h.now + WorkerConfig::default().timeout;
    while h.t.busy() {
        h.advance();
        let _ = h.sent();
        assert!(h.now <= deadline);
    }
    let err = h.ended().remove(0).1.unwrap_err();
    assert!(matches!(err, WorkerError::TableTimeout { .. }), "{err}");
    let s = err.to_string();
    assert!(
        s.contains("127.0.0.1:9000") && s.contains("127.0.0.1:9001") && s.contains("emb"),
        "{s}"
    );
}

#[test]
fn requests_that_cannot_be_sent_fail_before_sending() {
    let t = table(2, 4, 3);
    let e = plan_push(&t, 1, &[1, 2], &[0.0; 7]).unwrap_err().to_string();
    assert!(
        e.contains("emb") && e.contains("7") && e.contains("2 * 4 = 8"),
        "{e}"
    );
    // More rows for one lcore than 1024 messages of R carry.
    let one = table(1, 4, 3);
    let ids: Vec<u64> = (0..3 * 1024 + 1).collect();
    let e = plan_push(&one, 1, &ids, &vec![0.0; ids.len() * 4])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("3073") && e.contains("1024") && e.contains("lcore 0"),
        "{e}"
    );
    let ids: Vec<u64> = (0..3 * 1024).collect();
    assert!(
        plan_push(&one, 1, &ids, &vec![0.0; ids.len() * 4]).is_ok(),
        "exactly 1024 messages fit"
    );
}

#[test]
fn a_lane_larger_than_the_window_goes_whole_and_the_window_holds_the_rest() {
    // Window 2, one lcore with 5 messages: once started they all go (the
    // lcore answers only when it has them all); the next request waits.
    let mut h = Harness::new(1, 1, 1, 2);
    let ids: Vec<u64> = (0..4).collect();
    h.push(1, 1, &ids, &[1.0; 4]);
    let sent = h.sent();
    assert_eq!(sent.len(), 5);
    assert_eq!(h.t.outstanding(), 5);
    for (from, d) in h.answers(&sent) {
        h.deliver(from, &d);
    }
    assert_eq!(h.t.outstanding(), 0);
    assert!(h.ended()[0].1.is_ok());
}

/// Seeded: random id sets (repeats included) over random lcore counts,
/// datagrams lost, duplicated and reordered both ways; every round's rows
/// must be the reference's (every push summed, rows from zero).
#[test]
fn random_rounds_under_loss_match_a_reference() {
    for seed in 0..24u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let lcores = rng.gen_range(1..6);
        let dim = rng.gen_range(1..5);
        let per = rng.gen_range(1..6);
        let window = rng.gen_range(1..40);
        let loss = [0.0, 0.1, 0.3][rng.gen_range(0..3)];
        let mut h = Harness::new(lcores, dim, per, window);
        let mut reference: HashMap<u64, Vec<f32>> = HashMap::new();
        for round in 1..=4u32 {
            let n = rng.gen_range(0..80);
            let ids: Vec<u64> = (0..n)
                .map(|_| {
                    if rng.gen_bool(0.3) {
                        rng.gen_range(0..20)
                    } else {
                        rng.gen()
                    }
                })
                .collect();
            let g: Vec<f32> = (0..ids.len() * dim as usize)
                .map(|_| f32::from(rng.gen_range(-8i8..8)))
                .collect();
            for (i, &id) in ids.iter().enumerate() {
                let r = reference.entry(id).or_insert_with(|| vec![0.0; dim as usize]);
                for (x, y) in r.iter_mut().zip(&g[i * dim as usize..][..dim as usize]) {
                    *x += y;
                }
            }
            h.push(round, round, &ids, &g);
            let mut fate = StdRng::seed_from_u64(seed * 1000 + u64::from(round));
            let mut order = StdRng::seed_from_u64(seed * 1000 + u64::from(round) + 500);
            let ended = h.run_with(
                |_, _| match fate.gen_range(0.0..1.0) {
                    x if x < loss => 0,
                    x if x < loss + 0.1 => 2,
                    _ => 1,
                },
                |batch| batch.shuffle(&mut order),
            );
            assert_eq!(ended.len(), 1, "seed {seed} round {round}");
            let out = ended[0]
                .1
                .as_ref()
                .unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
            let want: Vec<f32> = ids.iter().flat_map(|id| reference[id].clone()).collect();
            assert_eq!(out.caller_rows(), want, "seed {seed} round {round}");
            assert_eq!(h.t.outstanding(), 0);
            // A pull of some of them (and an id never pushed) agrees.
            let mut pull: Vec<u64> = ids.iter().copied().take(7).collect();
            pull.push(u64::MAX - seed);
            h.pull(100 + round, &pull);
            let ended = h.run(|_, _| fate.gen_bool(loss));
            let out = ended[0].1.as_ref().unwrap();
            let want: Vec<f32> = pull
                .iter()
                .flat_map(|id| {
                    reference
                        .get(id)
                        .cloned()
                        .unwrap_or_else(|| vec![0.0; dim as usize])
                })
                .collect();
            assert_eq!(
                (out.round, &out.caller_rows()),
                (round, &want),
                "seed {seed} pull after round {round}"
            );
        }
    }
}

/// A message past its timer is not resent while answers to the others
/// stream in (an lcore slow to apply a large lane answers it late); once
/// no answer at all came for the base loss timeout, it is.
#[test]
fn a_late_message_waits_for_a_silence_before_it_is_resent() {
    let dim = 2;
    let mut h = Harness::new(2, dim, 2, 64);
    let ids: Vec<u64> = (0..8).collect();
    h.push(1, 1, &ids, &grads(&ids, dim, 0.0));
    let sent = h.sent();
    assert!(sent.len() >= 4, "{} messages", sent.len());
    let start = h.now;
    // The answers to every message but the first come in one by one, each
    // a little before the last's silence would end.
    let answers = h.answers(&sent[1..]);
    let step = h.t.loss_timeout() * 3 / 4;
    for (from, d) in answers {
        h.now += step;
        h.deliver(from, &d);
        h.t.handle_timeout(h.now);
        assert!(
            h.sent().is_empty(),
            "nothing is resent while answers flow ({:?} after the sends)",
            h.now - start
        );
    }
    // Then silence: what is unanswered goes again (the first message and
    // its lcore's others, which that lcore answers only with the round),
    // each once, marked.
    h.now += h.t.loss_timeout();
    h.t.handle_timeout(h.now);
    let again = h.sent();
    assert!(!again.is_empty());
    assert!(
        again.iter().all(|m| m.retransmit() && m.to == sent[0].to),
        "{again:?}"
    );
    assert!(again.iter().any(|m| m.repr.seq == sent[0].repr.seq));
}

/// Key caching (PROTOCOL.md §10.7), two lcores: a registered id set's
/// messages store their lists in round 1 (their answers in the cached
/// form), name them from round 2 on (no ids on the wire, the bytes
/// counted), and after the lcores forget them (a restart) each refused
/// `unknown_signature` goes again at once storing its list; the rows are
/// those of the same rounds without caching, round by round. Ids not
/// registered go as before; `uncache_ids` gives the slots back.
#[test]
fn registered_lists_are_stored_then_named_and_stored_again_after_a_miss() {
    let (lcores, dim, per) = (2, 3, 4);
    let mut h = Harness::new(lcores, dim, per, 64);
    let mut plain = Harness::new(lcores, dim, per, 64);
    let ids: Vec<u64> = (0..14u64).map(|i| i * 7919 + 3).collect();
    let mut cached_table = h.table.clone();
    cached_table.key_cache = 4;
    h.t = RowTransport::new(
        h.t_info(),
        (0..lcores).map(addr).collect(),
        vec![cached_table.clone()],
        64,
        &WorkerConfig::default(),
        Arc::clone(&h.stats),
        h.now,
    );
    let (lists, _) = super::row_plan::id_lists(&cached_table, &ids).unwrap();
    assert!(
        lists.len() >= 4,
        "14 ids in messages of 4 over 2 lcores: {lists:?}"
    );
    h.t.cache_ids(KEY, &lists).unwrap();
    // Registering them again takes no slot; one more list would need
    // a fifth on some lcore.
    h.t.cache_ids(KEY, &lists).unwrap();
    let more: Vec<u64> = (100..140u64).collect();
    let (more_lists, _) = super::row_plan::id_lists(&cached_table, &more).unwrap();
    let e = h.t.cache_ids(KEY, &more_lists).unwrap_err().to_string();
    assert!(e.contains("key_cache = 4") && e.contains("free"), "{e}");
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    for round in 1..=4u32 {
        if round == 3 {
            // The lcores restart: every list is gone.
            for l in &mut h.lcores {
                l.slots.clear();
            }
        }
        let g = grads(&ids, dim, round as f32);
        h.push(round, round, &ids, &g);
        plain.push(round, round, &ids, &g);
        if round != 3 {
            let sent = h.sent();
            for m in sent.iter().filter(|m| m.repr.kind == RowMsgType::RowPush) {
                match (round, m.repr.cache) {
                    (1, KeyCache::Store(_)) => assert_eq!(m.ids.len(), usize::from(m.repr.count)),
                    (2 | 4, KeyCache::Cached(_)) => {
                        assert!(m.ids.is_empty() && m.raw.len() < 86 + 16 + 8 * 4 * 4)
                    }
                    (r, f) => panic!("round {r}: a ROW_PUSH in form {f:?}"),
                }
            }
            let answers = h.answers(&sent);
            for (from, d) in answers {
                h.deliver(from, &d);
            }
        }
        let got = h.run(|_, _| false);
        let want = plain.run(|_, _| false);
        assert_eq!(got.len(), 1, "round {round}");
        assert_eq!(
            got[0].1.as_ref().unwrap(),
            want[0].1.as_ref().unwrap(),
            "round {round}"
        );
    }
    let messages = lists.len() as u64;
    assert_eq!(
        load(&h.stats.key_cache_misses),
        messages,
        "each named list missed once after the restart"
    );
    // Named in rounds 2, 3 (then refused) and 4, answered named in all
    // four: the ids left out 7 times; a prefix on every first send and
    // every answer (the stores sent again after a miss are resends).
    let id_bytes = ids.len() as u64 * 8;
    assert_eq!(load(&h.stats.key_cache_id_bytes_saved), 7 * id_bytes);
    assert_eq!(load(&h.stats.key_cache_prefix_bytes), 16 * messages * 8);
    // A pull of the same ids (another order, a repeat) names them too.
    let mut shuffled = ids.clone();
    shuffled.reverse();
    shuffled.push(ids[0]);
    h.pull(9, &shuffled);
    let sent = h.sent();
    assert!(sent
        .iter()
        .all(|m| matches!(m.repr.cache, KeyCache::Cached(_)) && m.raw.len() == 86 + 16));
    let answers = h.answers(&sent);
    for (from, d) in answers {
        h.deliver(from, &d);
    }
    let pulled = h.ended();
    plain.pull(9, &shuffled);
    assert_eq!(
        pulled[0].1.as_ref().unwrap().caller_rows(),
        plain.run(|_, _| false)[0].1.as_ref().unwrap().caller_rows()
    );
    // Forgotten twice (registered twice), the lists give their slots back
    // and the ids go without a prefix.
    h.t.uncache_ids(KEY, &lists);
    h.t.uncache_ids(KEY, &lists);
    let (fewer, _) = super::row_plan::id_lists(&cached_table, &more[..16]).unwrap();
    h.t.cache_ids(KEY, &fewer).unwrap();
    h.pull(10, &ids);
    assert!(h.sent().iter().all(|m| m.repr.cache == KeyCache::Off));
}

/// A transport with no caller's request in flight checks its idle table
/// on its own (simulator seed 559274's README finding: a rank with
/// nothing left to send never told a restored lcore its part): 1 s into
/// the idle spell, then at doubling intervals of at most a quarter of the
/// timeout, every lcore gets an empty round of the last push, answered
/// and ended silently; a caller's request ends the spell, and the next
/// spell starts over at 1 s.
#[test]
fn an_idle_transport_checks_its_table_at_growing_intervals() {
    let mut h = Harness::new(2, 4, 8, 1);
    assert_eq!(h.t.poll_timeout(), None, "nothing to check before a push");
    let secs = Duration::from_secs_f64;
    for (round, tag) in [(1u32, 7u32), (2, 8)] {
        let ids = [1u64, 2, 3];
        h.push(tag, round, &ids, &grads(&ids, 4, 1.0));
        let ended = h.run(|_, _| false);
        assert!(matches!(ended[..], [(t, Ok(_))] if t == tag), "{ended:?}");
        let mut last = h.now;
        let mut gaps = Vec::new();
        for _ in 0..5 {
            let at = h.t.poll_timeout().expect("an idle check is due");
            gaps.push(at - last);
            h.now = at;
            assert!(h.t.handle_timeout(h.now), "the check is to be sent");
            let sent = h.sent();
            assert_eq!(sent.len(), 2, "one message to each lcore");
            for m in &sent {
                assert_eq!(
                    (m.repr.kind, m.repr.round, m.repr.count),
                    (RowMsgType::RowEnd, round, 0)
                );
            }
            for (from, d) in h.answers(&sent) {
                h.deliver(from, &d);
            }
            assert!(h.ended().is_empty(), "a check ends silently");
            assert!(!h.t.busy(), "a check is no caller's request");
            last = at;
        }
        assert_eq!(gaps, [secs(1.0), secs(2.0), secs(4.0), secs(7.5), secs(7.5)]);
    }
}

/// A pull resent after a silence, then the answer to its first copy,
/// which says so (FIRST_COPY, PROTOCOL.md §10.3 "Loss timer"): the resend
/// was spurious, and the loss timer rises to 1.5 times the silence. The
/// same answer without the flag (the resend's own: the first copy was
/// lost) leaves the timer as it was.
#[test]
fn an_answer_to_a_first_copy_after_a_resend_lengthens_the_loss_timer() {
    for first_copy in [true, false] {
        let mut h = Harness::new(1, 2, 8, 64);
        let base = h.t.loss_timeout();
        let start = h.now;
        let ids = [3u64, 5];
        h.pull(1, &ids);
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        h.advance();
        let resent = h.sent();
        assert!(resent.len() == 1 && resent[0].retransmit(), "{resent:?}");
        // The answer comes a while after the resend.
        h.now += base;
        let silence = h.now - start;
        let (from, mut d) = h.answers(&sent).remove(0);
        if first_copy {
            d[phub_proto::wire::field::FLAGS] |= flags::FIRST_COPY;
        }
        h.deliver(from, &d);
        assert_eq!(h.ended().len(), 1, "first copy {first_copy}");
        let spurious = h
            .stats
            .row_resends_spurious
            .load(std::sync::atomic::Ordering::Relaxed);
        if first_copy {
            assert_eq!((spurious, h.t.loss_timeout()), (1, silence * 3 / 2));
        } else {
            assert_eq!((spurious, h.t.loss_timeout()), (0, base));
        }
    }
}

/// A replicated job's rows (PROTOCOL.md §11.9): each message names its
/// entry and the epoch held and goes where that epoch serves the entry;
/// an answer is taken for the entry its header names; an ERROR
/// `wrong_epoch` naming a newer epoch asks for it and ends nothing; a
/// newer epoch sends every unanswered message again at once to the entry's
/// new lcore (appliance 0 down: its entries 0 and 1 served by appliance
/// 1's lcores 0 and 1), where the request ends.
#[test]
fn a_replicated_job_s_rows_follow_their_entries_to_a_new_epoch() {
    use phub_proto::failover::EpochView;
    use phub_proto::layout::ChunkRange;
    use phub_proto::wire::Header;

    let (lcores, dim) = (4u32, 2u32);
    let mut h = Harness::new(lcores, dim, 8, 1024);
    let runs: Vec<ChunkRange> = (0..4).map(|i| ChunkRange { first: i, count: 1 }).collect();
    let routing = super::Routing::new(
        runs,
        &[2, 2],
        vec![String::new(), String::new()],
        2,
        EpochView::default(),
        (0..lcores).map(addr).collect(),
        vec![0, 0],
    )
    .unwrap();
    h.t.set_routing(routing);
    // Answers as the lcores send them: with the entry and epoch stamped.
    let answer_all = |h: &mut Harness, sent: &[Sent], epoch: u32| -> Vec<(SocketAddr, Vec<u8>)> {
        let mut out = Vec::new();
        for m in sent {
            let e = Header::new_unchecked(&m.raw[..]).entry();
            for mut d in h.lcores[e as usize].handle(m) {
                let mut hd = Header::new_unchecked(&mut d[..]);
                hd.set_entry(e);
                hd.set_epoch(epoch);
                out.push((m.to, d));
            }
        }
        out
    };
    let ids: Vec<u64> = (0..40u64).map(|i| i * 7919 + 1).collect();
    let entries: std::collections::BTreeSet<u32> =
        ids.iter().map(|&id| h.table.placement.entry(id)).collect();
    assert_eq!(entries.len(), 4, "ids on every entry");
    let g = grads(&ids, dim, 0.0);
    h.push(1, 1, &ids, &g);
    let sent = h.sent();
    for m in &sent {
        let hd = Header::new_unchecked(&m.raw[..]);
        assert_eq!((addr(hd.entry()), hd.epoch()), (m.to, 0), "{:?}", m.repr);
    }
    for (from, d) in answer_all(&mut h, &sent, 0) {
        h.deliver(from, &d);
    }
    assert!(matches!(h.ended().as_slice(), [(1, Ok(_))]));

    // Round 2: appliance 0 (entries 0 and 1) answers nothing.
    h.push(2, 2, &ids, &g);
    let sent = h.sent();
    let (lost, live): (Vec<Sent>, Vec<Sent>) = sent
        .into_iter()
        .partition(|m| Header::new_unchecked(&m.raw[..]).entry() < 2);
    assert!(!lost.is_empty());
    for (from, d) in answer_all(&mut h, &live, 0) {
        h.deliver(from, &d);
    }
    // A silence asks whether the epoch held is current.
    h.now += Duration::from_secs(1);
    h.t.handle_timeout(h.now);
    assert_eq!(h.t.poll_epoch(), Some(0));
    // An ERROR naming epoch 1 asks for it, and ends nothing.
    let mut e = error_for(&live[0], DropReason::WrongEpoch.code());
    {
        let mut hd = Header::new_unchecked(&mut e[..]);
        hd.set_epoch(1);
        hd.set_entry(Header::new_unchecked(&live[0].raw[..]).entry());
    }
    h.deliver(live[0].to, &e);
    assert_eq!(h.t.poll_epoch(), Some(1));
    assert!(h.ended().is_empty());
    let _ = h.sent();
    // Epoch 1: the unanswered messages go at once to appliance 1.
    let view = EpochView {
        epoch: 1,
        down: vec![0],
        ..EpochView::default()
    };
    assert_eq!(h.t.set_epoch(h.now, view), lost.len());
    let again = h.sent();
    assert_eq!(again.len(), lost.len());
    for m in &again {
        let hd = Header::new_unchecked(&m.raw[..]);
        assert!(hd.entry() < 2);
        assert_eq!(
            (m.to, hd.epoch()),
            (addr(2 + hd.entry()), 1),
            "entry {}",
            hd.entry()
        );
    }
    // The adopter answers for entries 0 and 1 from its own addresses.
    for (from, d) in answer_all(&mut h, &again, 1) {
        h.deliver(from, &d);
    }
    let ended = h.ended();
    assert!(matches!(ended.as_slice(), [(2, Ok(_))]), "{ended:?}");
}
