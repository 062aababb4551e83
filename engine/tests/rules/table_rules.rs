//! The engine's table rules (PROTOCOL.md §10.3), one datagram at a time:
//! a Shard with a job's table key, driven by messages built with
//! `phub_proto::rows::write`, its answers parsed back, its rows checked
//! against the row optimizers and initial values applied directly in the
//! same arrival order.

use std::collections::HashMap;

use phub_engine::engine::{
    memory_model, row_init, row_optimizer, RestoredTable, TableInstall, TablesStreamError,
};
use phub_engine::table::{RowInit, RowOptimizer, RowUpdate, TableInit};
use phub_engine::{EngineError, InstallKind, JobInstall, Kernels, RustHeap, Shard, Verdict};
use phub_proto::placement::RowPlacement;
use phub_proto::rows::{self, ids_signature, CacheRef, KeyCache, RowMsgType, RowPayload, RowRepr};
use phub_proto::spec::{Consistency, Evict, JobSpec, Optimizer, RowInitSpec, RowOptimizerSpec, TableSpec};
use phub_proto::wire::{self, flags, DropReason, MsgType, HEADER_LEN};
use phub_proto::Dtype;

const TOKEN: u64 = 0x7ab1e;
const JOB: u16 = 3;
const KEY: u32 = 1;
const SEED: u64 = 7;
const DIM: u32 = 4;
/// The job's lcores L; the shard under test is entry 0.
const L: u32 = 2;

fn table_spec() -> TableSpec {
    TableSpec {
        dim: DIM,
        rows: Some(1000),
        seed: SEED,
        init: RowInitSpec::Uniform { a: -0.5, b: 0.5 },
        optimizer: RowOptimizerSpec::Adagrad {
            lr: 0.25,
            eps: 1e-8,
            initial_accumulator: 0.1,
            rowwise: false,
        },
        evict: None,
        admit_after: None,
        key_cache: 0,
    }
}

fn job(workers: u16, consistency: Consistency) -> JobInstall {
    JobInstall {
        id: JOB,
        token: TOKEN,
        workers,
        dtype: Dtype::F32,
        optimizer: Optimizer::Sum,
        consistency,
        chunk_elems: 16,
        slots: Vec::new(),
    }
}

fn table(spec: TableSpec, chunk_bytes: u32) -> TableInstall {
    TableInstall {
        key: KEY,
        spec,
        chunk_bytes,
        lcores: L,
        entry: 0,
    }
}

fn shard_with(workers: u16, consistency: Consistency, chunk_bytes: u32) -> Shard<u32> {
    let mut s = Shard::new(0, Kernels::best());
    s.install_with_tables(
        job(workers, consistency),
        InstallKind::Plain,
        vec![table(table_spec(), chunk_bytes)],
    )
    .unwrap();
    s
}

fn shard(workers: u16, consistency: Consistency) -> Shard<u32> {
    shard_with(workers, consistency, 8192)
}

/// Ids the placement puts on entry `entry` of the L lcores, in order.
fn ids_on(entry: u32, n: usize) -> Vec<u64> {
    let p = RowPlacement::new(SEED, KEY, &[L]).unwrap();
    (0u64..).filter(|&id| p.entry(id) == entry).take(n).collect()
}

/// The address rank r sends from.
fn addr(rank: u16) -> u32 {
    100 + u32::from(rank)
}

fn head(kind: RowMsgType, rank: u16, round: u32, seq: u32, count: usize) -> RowRepr {
    RowRepr {
        kind,
        dtype: Dtype::F32,
        flags: 0,
        token: TOKEN,
        job: JOB,
        rank,
        count: count as u16,
        round,
        dim: DIM,
        key: KEY,
        seq,
        cache: KeyCache::Off,
    }
}

fn build(repr: RowRepr, ids: &[u64], rows: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN + 9000];
    let n = rows::write(&repr, ids, rows, &mut b);
    b.truncate(n);
    b
}

fn push(rank: u16, round: u32, seq: u32, ids: &[u64], rows: &[f32]) -> Vec<u8> {
    build(head(RowMsgType::RowPush, rank, round, seq, ids.len()), ids, rows)
}

fn end(rank: u16, round: u32, n: u32) -> Vec<u8> {
    build(head(RowMsgType::RowEnd, rank, round, n, 0), &[], &[])
}

fn pull(rank: u16, seq: u32, ids: &[u64]) -> Vec<u8> {
    build(head(RowMsgType::RowPull, rank, 0, seq, ids.len()), ids, &[])
}

/// A gradient row for (id, salt): small, distinct values.
fn grad(id: u64, salt: u32) -> Vec<f32> {
    (0..DIM)
        .map(|e| ((id % 13) as f32 - 6.0) * 0.125 + salt as f32 * 0.5 - e as f32 * 0.25)
        .collect()
}

fn grads(ids: &[u64], salt: u32) -> Vec<f32> {
    ids.iter().flat_map(|&id| grad(id, salt)).collect()
}

/// What the shard sent, in order.
#[derive(Debug, Clone, PartialEq)]
enum Sent {
    Rows {
        to: u32,
        kind: RowMsgType,
        round: u32,
        seq: u32,
        ids: Vec<u64>,
        rows: Vec<f32>,
    },
    Error {
        to: u32,
        code: u16,
        round: u32,
        seq: u32,
    },
    /// An answer in the key cache's cached form (PROTOCOL.md §10.7).
    Cached {
        to: u32,
        kind: RowMsgType,
        round: u32,
        seq: u32,
        cache: CacheRef,
        rows: Vec<f32>,
    },
}

fn drain(s: &mut Shard<u32>) -> Vec<Sent> {
    let mut out = Vec::new();
    for t in s.transmits() {
        let mut b = t.header.to_vec();
        b.extend_from_slice(t.payload);
        let to: Vec<u32> = t.to.collect();
        assert_eq!(to.len(), 1, "table answers go to one rank each");
        if b[wire::field::TYPE] == MsgType::Error.code() {
            let (r, _) = wire::parse(&b).unwrap();
            out.push(Sent::Error {
                to: to[0],
                code: r.error,
                round: r.round,
                seq: r.chunk,
            });
            continue;
        }
        let (r, payload) = rows::parse(&b).unwrap();
        assert_eq!(
            (r.job, r.token, r.key, r.dim, r.rank),
            (JOB, TOKEN, KEY, DIM, 0xffff)
        );
        let (ids, rows) = match payload {
            RowPayload::Rows(rows) => {
                let mut v = vec![0f32; rows.len() * DIM as usize];
                for i in 0..rows.len() {
                    assert!(rows.decode_row(i, &mut v[i * DIM as usize..(i + 1) * DIM as usize]));
                }
                (rows.ids().iter().collect(), v)
            }
            RowPayload::Empty => (Vec::new(), Vec::new()),
            RowPayload::Ids(_) => panic!("the appliance sends no ids alone"),
            RowPayload::Cached(values) => {
                let KeyCache::Cached(cache) = r.cache else {
                    panic!("a cached payload without its prefix: {r:?}")
                };
                let mut rows = vec![0f32; values.len() / 4];
                phub_proto::dtype::decode(Dtype::F32, values, &mut rows);
                out.push(Sent::Cached {
                    to: to[0],
                    kind: r.kind,
                    round: r.round,
                    seq: r.seq,
                    cache,
                    rows,
                });
                continue;
            }
        };
        out.push(Sent::Rows {
            to: to[0],
            kind: r.kind,
            round: r.round,
            seq: r.seq,
            ids,
            rows,
        });
    }
    s.clear_transmits();
    out
}

/// The table's rows computed with its initial values and optimizer
/// applied directly: gradients in the order given.
struct Reference {
    init: TableInit,
    opt: RowOptimizer,
    rows: HashMap<u64, (Vec<f32>, Vec<f32>)>,
}

impl Reference {
    fn new(spec: &TableSpec) -> Reference {
        Reference {
            init: TableInit::new(row_init(&spec.init), spec.seed, KEY).unwrap(),
            opt: row_optimizer(&spec.optimizer),
            rows: HashMap::new(),
        }
    }

    fn initial(&self, id: u64) -> Vec<f32> {
        let mut v = vec![0f32; DIM as usize];
        self.init.fill(id, &mut v);
        v
    }

    fn apply(&mut self, id: u64, g: &[f32]) {
        let d = DIM as usize;
        let (init, opt) = (self.init, self.opt);
        let (values, state) = self.rows.entry(id).or_insert_with(|| {
            let mut v = vec![0f32; d];
            init.fill(id, &mut v);
            let mut st = vec![0f32; opt.state_len(d)];
            opt.init_state(&mut st);
            (v, st)
        });
        opt.apply(values, state, g);
    }

    fn row(&self, id: u64) -> Vec<f32> {
        self.rows
            .get(&id)
            .map_or_else(|| self.initial(id), |(v, _)| v.clone())
    }

    fn rows_of(&self, ids: &[u64]) -> Vec<f32> {
        ids.iter().flat_map(|&id| self.row(id)).collect()
    }
}

fn rows_sent(to: u32, kind: RowMsgType, round: u32, seq: u32, ids: &[u64], reference: &Reference) -> Sent {
    Sent::Rows {
        to,
        kind,
        round,
        seq,
        ids: ids.to_vec(),
        rows: reference.rows_of(ids),
    }
}

fn done(to: u32, round: u32, n: u32) -> Sent {
    Sent::Rows {
        to,
        kind: RowMsgType::RowDone,
        round,
        seq: n,
        ids: Vec::new(),
        rows: Vec::new(),
    }
}

fn error(to: u32, reason: DropReason, round: u32, seq: u32) -> Sent {
    Sent::Error {
        to,
        code: reason.code(),
        round,
        seq,
    }
}

/// Three ranks push overlapping ids (one repeated inside a message) in two
/// messages and one; rank 2's ROW_END comes before its pushes. Nothing is
/// answered until the last rank completes; then each accumulated row goes
/// through Adagrad once, in the order its id first arrived, and every rank
/// gets its ROW_RESULTs, with the rows after the update, and its ROW_DONE.
#[test]
fn a_bsp_round_sums_each_row_then_applies_the_optimizer_once() {
    let mut s = shard(3, Consistency::Sync);
    let ids = ids_on(0, 6);
    let (a, b, c) = (&ids[0..3], &ids[2..5], [ids[5], ids[0], ids[5]]);
    // (rank, seq, ids, salt) in arrival order.
    let msgs: [(u16, u32, &[u64], u32); 4] = [(0, 0, a, 1), (1, 0, b, 2), (0, 1, &c, 3), (2, 0, a, 4)];
    assert_eq!(s.handle(addr(2), &end(2, 1, 1), 0), Verdict::Aggregated);
    assert_eq!(s.handle(addr(1), &end(1, 1, 1), 0), Verdict::Aggregated);
    let mut sums: Vec<(u64, Vec<f32>)> = Vec::new();
    for (i, &(r, seq, m, salt)) in msgs.iter().enumerate() {
        let v = s.handle(addr(r), &push(r, 1, seq, m, &grads(m, salt)), 0);
        for &id in m {
            let g = grad(id, salt);
            match sums.iter_mut().find(|(x, _)| *x == id) {
                Some((_, acc)) => acc.iter_mut().zip(&g).for_each(|(a, g)| *a += g),
                None => sums.push((id, g)),
            }
        }
        assert_eq!(v, Verdict::Aggregated, "message {i}");
        assert!(drain(&mut s).is_empty(), "no answer before the round completes");
    }
    assert_eq!(s.handle(addr(0), &end(0, 1, 2), 0), Verdict::Completed);
    let mut reference = Reference::new(&table_spec());
    for (id, g) in &sums {
        reference.apply(*id, g);
    }
    let want = vec![
        rows_sent(addr(0), RowMsgType::RowResult, 1, 0, a, &reference),
        rows_sent(addr(0), RowMsgType::RowResult, 1, 1, &c, &reference),
        rows_sent(addr(1), RowMsgType::RowResult, 1, 0, b, &reference),
        rows_sent(addr(2), RowMsgType::RowResult, 1, 0, a, &reference),
        done(addr(0), 1, 2),
        done(addr(1), 1, 1),
        done(addr(2), 1, 1),
    ];
    assert_eq!(drain(&mut s), want);
    let c = s.counters();
    assert_eq!((c.pushes_aggregated.get(), c.rounds_completed.get()), (4, 1));
    assert_eq!(c.results_sent.get(), 7);
}

/// Loss and duplicates: a copy of a push (same s) or of a ROW_END is
/// dropped as a duplicate while the round is open; once it completed, a
/// resent push of it gets its ROW_RESULT (current rows, nothing added) and
/// a resent ROW_END its ROW_DONE; a round older than that is stale; round
/// 0 and a round beyond the one in progress are refused with an ERROR.
#[test]
fn duplicates_are_dropped_and_lost_answers_resent() {
    let mut s = shard(2, Consistency::Sync);
    let ids = ids_on(0, 3);
    let mut reference = Reference::new(&table_spec());
    let p0 = push(0, 1, 0, &ids, &grads(&ids, 1));
    assert_eq!(s.handle(addr(0), &p0, 0), Verdict::Aggregated);
    assert_eq!(s.handle(addr(0), &p0, 0), Verdict::Dropped(DropReason::Duplicate));
    assert_eq!(s.handle(addr(0), &end(0, 1, 1), 0), Verdict::Aggregated);
    assert_eq!(
        s.handle(addr(0), &end(0, 1, 1), 0),
        Verdict::Dropped(DropReason::Duplicate)
    );
    assert!(drain(&mut s).is_empty(), "duplicates are only counted");
    assert_eq!(
        s.handle(addr(1), &push(1, 0, 0, &ids, &grads(&ids, 2)), 0),
        Verdict::Dropped(DropReason::WrongTypeForRound)
    );
    assert_eq!(
        s.handle(addr(1), &push(1, 2, 0, &ids, &grads(&ids, 2)), 0),
        Verdict::Dropped(DropReason::Ahead)
    );
    assert_eq!(
        drain(&mut s),
        vec![
            error(addr(1), DropReason::WrongTypeForRound, 0, 0),
            error(addr(1), DropReason::Ahead, 2, 0)
        ]
    );
    assert_eq!(s.handle(addr(1), &end(1, 1, 0), 0), Verdict::Completed);
    for &id in &ids {
        reference.apply(id, &grad(id, 1));
    }
    assert_eq!(
        drain(&mut s),
        vec![
            rows_sent(addr(0), RowMsgType::RowResult, 1, 0, &ids, &reference),
            done(addr(0), 1, 1),
            done(addr(1), 1, 0),
        ]
    );
    // Rank 0 lost its answers: the copies of its push and ROW_END are
    // answered with the rows as they are, and the push not added again.
    let copies_answered = |s: &mut Shard<u32>| {
        assert_eq!(s.handle(addr(0), &p0, 0), Verdict::Resent);
        assert_eq!(s.handle(addr(0), &end(0, 1, 1), 0), Verdict::Resent);
        assert_eq!(
            drain(s),
            vec![
                rows_sent(addr(0), RowMsgType::RowResult, 1, 0, &ids, &reference),
                done(addr(0), 1, 1),
            ]
        );
    };
    copies_answered(&mut s);
    // Round 2, empty for both: round 1's messages are then older than the
    // last completed round, and answered the same way (a rank that
    // rejoined pushes again rounds its former incarnation completed:
    // simulator seed 365177), adding nothing.
    assert_eq!(s.handle(addr(0), &end(0, 2, 0), 0), Verdict::Aggregated);
    assert_eq!(s.handle(addr(1), &end(1, 2, 0), 0), Verdict::Completed);
    assert_eq!(drain(&mut s), vec![done(addr(0), 2, 0), done(addr(1), 2, 0)]);
    copies_answered(&mut s);
    // The rows did not move in the empty round.
    assert_eq!(s.handle(addr(1), &pull(1, 9, &ids), 0), Verdict::Pulled);
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(
            addr(1),
            RowMsgType::RowPullResult,
            2,
            9,
            &ids,
            &reference
        )]
    );
    let c = s.counters();
    assert_eq!(c.drops_of(DropReason::Duplicate), 2);
    assert_eq!(c.drops_of(DropReason::Stale), 0);
    assert_eq!(c.results_resent.get(), 4);
}

/// A restored lcore took copies of some of rank 0's round-1 messages (a
/// push and its ROW_END of count 2; push 1 not), then rank 0 learnt from
/// the lcore's answers before its restart that round 1 had completed,
/// moved on, was refused `ahead` and catches the lcore up with an empty
/// round 1 (PROTOCOL.md §10.6). The empty round closes rank 0's part with
/// the push taken: its later copies are duplicates, and round 1 completes
/// once rank 1 is complete, answering rank 0's push taken and its ROW_DONE
/// with the count it stated. Before, the empty round was refused
/// `bad_row_count` (the count changed) and the worker's push failed
/// (simulator seed 10066).
#[test]
fn an_empty_round_over_a_rank_s_own_copies_closes_its_part() {
    let mut s = shard(2, Consistency::Sync);
    let ids = ids_on(0, 4);
    let (a, b) = (&ids[0..2], &ids[2..4]);
    let mut reference = Reference::new(&table_spec());
    assert_eq!(
        s.handle(addr(0), &push(0, 1, 0, a, &grads(a, 1)), 0),
        Verdict::Aggregated
    );
    assert_eq!(s.handle(addr(0), &end(0, 1, 2), 0), Verdict::Aggregated);
    assert_eq!(s.handle(addr(0), &end(0, 1, 0), 0), Verdict::Aggregated);
    assert_eq!(
        s.handle(addr(0), &push(0, 1, 1, b, &grads(b, 1)), 0),
        Verdict::Dropped(DropReason::Duplicate)
    );
    assert_eq!(
        s.handle(addr(0), &end(0, 1, 2), 0),
        Verdict::Dropped(DropReason::Duplicate)
    );
    assert!(
        drain(&mut s).is_empty(),
        "nothing is answered before rank 1 is complete"
    );
    // A count other than the first, not empty, is still refused.
    rank_1_completes_past_another_count(&mut s, &mut reference, 1, a, b);
    assert_eq!(
        drain(&mut s),
        vec![
            error(addr(1), DropReason::BadRowCount, 1, 3),
            rows_sent(addr(0), RowMsgType::RowResult, 1, 0, a, &reference),
            rows_sent(addr(1), RowMsgType::RowResult, 1, 0, b, &reference),
            done(addr(0), 1, 2),
            done(addr(1), 1, 1),
        ]
    );
    // Round 2 is as any round: the closing is gone with round 1.
    assert_eq!(s.handle(addr(0), &end(0, 2, 0), 0), Verdict::Aggregated);
    assert_eq!(
        s.handle(addr(0), &end(0, 2, 0), 0),
        Verdict::Dropped(DropReason::Duplicate)
    );
}

/// A rank whose part of the round in progress is complete there sends
/// the round again with another count: a new incarnation of it (a rejoin)
/// whose former one sent the round, with other rows, or closed its part
/// with an empty round after a restore. Its messages are copies, dropped
/// as duplicates and answered once the round completes, never refused
/// `bad_row_count` (the rejoined rank's push failed: simulator seed
/// 313394). An incomplete part still refuses another count.
#[test]
fn a_complete_part_takes_a_round_pushed_again_with_another_count_as_copies() {
    let mut s = shard(2, Consistency::Sync);
    let ids = ids_on(0, 4);
    let (a, b) = (&ids[0..2], &ids[2..4]);
    let mut reference = Reference::new(&table_spec());
    // Rank 0's part closed empty; rank 1's complete with one push.
    assert_eq!(s.handle(addr(0), &end(0, 1, 0), 0), Verdict::Aggregated);
    assert_eq!(
        s.handle(addr(1), &push(1, 1, 0, b, &grads(b, 2)), 0),
        Verdict::Aggregated
    );
    assert_eq!(s.handle(addr(1), &end(1, 1, 1), 0), Verdict::Completed);
    for &id in b {
        reference.apply(id, &grad(id, 2));
    }
    let first = drain(&mut s);
    assert_eq!(first.len(), 3, "{first:?}");
    // Round 2: rank 0 complete with one push, then its new incarnation
    // sends the round with two pushes and a count of 2.
    assert_eq!(
        s.handle(addr(0), &push(0, 2, 0, a, &grads(a, 1)), 0),
        Verdict::Aggregated
    );
    assert_eq!(s.handle(addr(0), &end(0, 2, 1), 0), Verdict::Aggregated);
    for m in [
        push(0, 2, 0, b, &grads(b, 3)),
        push(0, 2, 1, a, &grads(a, 3)),
        end(0, 2, 2),
    ] {
        assert_eq!(s.handle(addr(0), &m, 0), Verdict::Dropped(DropReason::Duplicate));
    }
    assert!(drain(&mut s).is_empty(), "nothing before rank 1 is complete");
    // Rank 1's part: a ROW_END then another count, refused while incomplete.
    rank_1_completes_past_another_count(&mut s, &mut reference, 2, a, b);
    let sent = drain(&mut s);
    assert!(
        sent.contains(&rows_sent(addr(0), RowMsgType::RowResult, 2, 0, a, &reference)),
        "{sent:?}"
    );
    // The copies sent again now are answered from round 2, adding nothing.
    assert_eq!(
        s.handle(addr(0), &push(0, 2, 1, a, &grads(a, 3)), 0),
        Verdict::Resent
    );
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(addr(0), RowMsgType::RowResult, 2, 1, a, &reference)]
    );
    assert_eq!(s.handle(addr(0), &end(0, 2, 2), 0), Verdict::Resent);
    assert_eq!(drain(&mut s), vec![done(addr(0), 2, 2)]);
}

/// Rank 1 states a count of 1 for round `t`, then a count of 3 (refused
/// `bad_row_count`: its part is not complete), then pushes `b` (grads of
/// salt 2), which completes the round; `reference` takes the round: rank
/// 0's `a` (salt 1) and rank 1's `b`.
fn rank_1_completes_past_another_count(
    s: &mut Shard<u32>,
    reference: &mut Reference,
    t: u32,
    a: &[u64],
    b: &[u64],
) {
    assert_eq!(s.handle(addr(1), &end(1, t, 1), 0), Verdict::Aggregated);
    assert_eq!(
        s.handle(addr(1), &end(1, t, 3), 0),
        Verdict::Dropped(DropReason::BadRowCount)
    );
    assert_eq!(
        s.handle(addr(1), &push(1, t, 0, b, &grads(b, 2)), 0),
        Verdict::Completed
    );
    for &id in a {
        reference.apply(id, &grad(id, 1));
    }
    for &id in b {
        reference.apply(id, &grad(id, 2));
    }
}

/// A ROW_PULL answers initial values for ids never pushed and the rows of
/// the last completed round for the others (a round's updates apply at its
/// completion), with that round in `round`.
#[test]
fn a_pull_reads_initial_values_then_completed_rounds() {
    let mut s = shard(2, Consistency::Sync);
    let ids = ids_on(0, 4);
    let reference0 = Reference::new(&table_spec());
    assert_eq!(s.handle(addr(0), &pull(0, 5, &ids), 0), Verdict::Pulled);
    let initial = vec![rows_sent(
        addr(0),
        RowMsgType::RowPullResult,
        0,
        5,
        &ids,
        &reference0,
    )];
    assert_eq!(drain(&mut s), initial);
    // Uniform init: not all zeros.
    assert!(reference0.rows_of(&ids).iter().any(|&v| v != 0.0));
    let pushed = &ids[..2];
    assert_eq!(
        s.handle(addr(0), &push(0, 1, 0, pushed, &grads(pushed, 1)), 0),
        Verdict::Aggregated
    );
    assert_eq!(s.handle(addr(0), &end(0, 1, 1), 0), Verdict::Aggregated);
    // Round 1 is open: a pull still reads round 0's rows.
    assert_eq!(s.handle(addr(1), &pull(1, 6, &ids), 0), Verdict::Pulled);
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(
            addr(1),
            RowMsgType::RowPullResult,
            0,
            6,
            &ids,
            &reference0
        )]
    );
    assert_eq!(s.handle(addr(1), &end(1, 1, 0), 0), Verdict::Completed);
    drain(&mut s);
    let mut reference = Reference::new(&table_spec());
    for &id in pushed {
        reference.apply(id, &grad(id, 1));
    }
    assert_eq!(s.handle(addr(1), &pull(1, 7, &ids), 0), Verdict::Pulled);
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(
            addr(1),
            RowMsgType::RowPullResult,
            1,
            7,
            &ids,
            &reference
        )]
    );
    assert_ne!(reference.rows_of(pushed), reference0.rows_of(pushed));
    assert_eq!(reference.rows_of(&ids[2..]), reference0.rows_of(&ids[2..]));
}

/// Each datagram the shard would send, header and payload, in order.
fn drain_bytes(s: &mut Shard<u32>) -> Vec<Vec<u8>> {
    let out = s
        .transmits()
        .map(|t| [&t.header[..], t.payload].concat())
        .collect();
    s.clear_transmits();
    out
}

/// An answer is written over the bytes an earlier burst's answers left
/// (not zeroed first): every byte it sends is its own, the same bytes a
/// fresh shard sends.
#[test]
fn an_answer_over_an_earlier_bursts_bytes_is_a_fresh_shards() {
    let (mut used, mut fresh) = (shard(2, Consistency::Sync), shard(2, Consistency::Sync));
    let many = ids_on(0, 40);
    assert_eq!(used.handle(addr(0), &pull(0, 1, &many), 0), Verdict::Pulled);
    let first = drain_bytes(&mut used);
    assert_eq!(first.len(), 1);
    assert!(first[0].len() > HEADER_LEN + 40 * 8, "{} bytes", first[0].len());
    // Two answers: the second one's header falls where the first burst's
    // ids and rows were.
    let (few, other) = (&many[7..11], &many[20..23]);
    for s in [&mut used, &mut fresh] {
        assert_eq!(s.handle(addr(1), &pull(1, 9, few), 0), Verdict::Pulled);
        assert_eq!(s.handle(addr(1), &pull(1, 10, other), 0), Verdict::Pulled);
    }
    let (again, want) = (drain_bytes(&mut used), drain_bytes(&mut fresh));
    assert_eq!(want.len(), 2);
    assert_eq!(again, want);
}

/// Every check of §10.3 step (4) and the table reasons 25 to 28, each with
/// its ERROR; a message with one misplaced id is dropped whole.
#[test]
fn every_table_drop_reason_is_counted_and_told() {
    // chunk_bytes 64 at dim 4 in f32: R = 64 / 24 = 2 rows a message.
    let mut s = shard_with(2, Consistency::Sync, 64);
    let here = ids_on(0, 3);
    let there = ids_on(1, 1);
    let refuse = |s: &mut Shard<u32>, b: Vec<u8>, reason: DropReason, round: u32, seq: u32| {
        assert_eq!(s.handle(addr(0), &b, 0), Verdict::Dropped(reason), "{reason}");
        assert_eq!(drain(s), vec![error(addr(0), reason, round, seq)], "{reason}");
    };
    let two = &here[..2];
    let mut b = push(0, 1, 0, two, &grads(two, 1));
    b[wire::field::KEY].copy_from_slice(&0u32.to_le_bytes());
    refuse(&mut s, b, DropReason::UnknownTable, 1, 0);
    let mut b = push(0, 1, 0, two, &grads(two, 1));
    b[wire::field::KEY].copy_from_slice(&9u32.to_le_bytes());
    refuse(&mut s, b, DropReason::UnknownTable, 1, 0);
    // Dim 2 with the same bytes: 2 rows of (8 + 8) no longer match, so
    // send one of dim 2 whose length is right.
    let mut r = head(RowMsgType::RowPush, 0, 1, 0, 1);
    r.dim = 2;
    refuse(
        &mut s,
        build(r, &here[..1], &[1.0, 2.0]),
        DropReason::DimMismatch,
        1,
        0,
    );
    refuse(
        &mut s,
        push(0, 1, 0, &here, &grads(&here, 1)),
        DropReason::BadRowCount,
        1,
        0,
    );
    refuse(&mut s, pull(0, 4, &here), DropReason::BadRowCount, 0, 4);
    let mixed = [here[0], there[0]];
    refuse(
        &mut s,
        push(0, 1, 0, &mixed, &grads(&mixed, 1)),
        DropReason::RowOutOfPlace,
        1,
        0,
    );
    refuse(&mut s, pull(0, 3, &there), DropReason::RowOutOfPlace, 0, 3);
    refuse(
        &mut s,
        push(0, 1, 1024, two, &grads(two, 1)),
        DropReason::BadRowCount,
        1,
        1024,
    );
    refuse(&mut s, end(0, 1, 1025), DropReason::BadRowCount, 1, 1025);
    assert_eq!(s.handle(addr(0), &end(0, 1, 1), 0), Verdict::Aggregated);
    refuse(&mut s, end(0, 1, 2), DropReason::BadRowCount, 1, 2);
    refuse(
        &mut s,
        push(0, 1, 1, two, &grads(two, 1)),
        DropReason::BadRowCount,
        1,
        1,
    );
    // A ROW_END whose count leaves out a push already taken.
    assert_eq!(
        s.handle(addr(1), &push(1, 1, 3, two, &grads(two, 1)), 0),
        Verdict::Aggregated
    );
    assert_eq!(
        s.handle(addr(1), &end(1, 1, 2), 0),
        Verdict::Dropped(DropReason::BadRowCount)
    );
    drain(&mut s);
    // The common checks: dtype, SHM, rank, a message only the appliance
    // sends, a wrong token.
    let mut r = head(RowMsgType::RowPull, 0, 0, 1, 1);
    r.dtype = Dtype::Bf16;
    refuse(&mut s, build(r, &here[..1], &[]), DropReason::DtypeMismatch, 0, 1);
    let mut b = pull(0, 1, &here[..1]);
    b[wire::field::FLAGS] = flags::SHM;
    assert_eq!(
        s.handle(addr(0), &b, 0),
        Verdict::Dropped(DropReason::NoSharedMemory)
    );
    assert_eq!(
        s.handle(addr(0), &pull(2, 1, &here[..1]), 0),
        Verdict::Dropped(DropReason::RankOutOfRange)
    );
    let r = head(RowMsgType::RowDone, 0, 1, 0, 0);
    assert_eq!(
        s.handle(addr(0), &build(r, &[], &[]), 0),
        Verdict::Dropped(DropReason::NotForAppliance)
    );
    let mut b = pull(0, 1, &here[..1]);
    b[wire::field::TOKEN].copy_from_slice(&1u64.to_le_bytes());
    assert_eq!(s.handle(addr(0), &b, 0), Verdict::Dropped(DropReason::BadToken));
    assert!(drain(&mut s).is_empty(), "none of these is told");
    let c = s.counters();
    for (reason, n) in [
        (DropReason::UnknownTable, 2),
        (DropReason::DimMismatch, 1),
        (DropReason::BadRowCount, 7),
        (DropReason::RowOutOfPlace, 2),
        (DropReason::DtypeMismatch, 1),
        (DropReason::NoSharedMemory, 1),
        (DropReason::RankOutOfRange, 1),
        (DropReason::NotForAppliance, 1),
        (DropReason::BadToken, 1),
        (DropReason::UnknownType, 0),
    ] {
        assert_eq!(c.drops_of(reason), n, "{reason}");
    }
    // Nothing of the refused pushes was added: rank 0's round holds no
    // push, rank 1's the one taken.
    assert_eq!(s.handle(addr(0), &pull(0, 1, two), 0), Verdict::Pulled);
    let reference = Reference::new(&table_spec());
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(
            addr(0),
            RowMsgType::RowPullResult,
            0,
            1,
            two,
            &reference
        )]
    );
}

/// Async: each push is applied at once, pair by pair with its own row as
/// the gradient, and answered at once with the rows after it; a copy is
/// answered with the current rows and not applied again; a ROW_END
/// completes the rank's clock at once; a clock beyond the next is ahead.
#[test]
fn async_applies_each_push_at_once() {
    let mut s = shard(2, Consistency::Async);
    let ids = ids_on(0, 3);
    let mut reference = Reference::new(&table_spec());
    let m = [ids[0], ids[1], ids[0]];
    let p = push(1, 1, 0, &m, &grads(&m, 1));
    assert_eq!(s.handle(addr(1), &p, 0), Verdict::Applied);
    for (&id, salt) in m.iter().zip([1, 1, 1]) {
        reference.apply(id, &grad(id, salt));
    }
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(addr(1), RowMsgType::RowResult, 1, 0, &m, &reference)]
    );
    assert_eq!(s.handle(addr(1), &p, 0), Verdict::Resent);
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(addr(1), RowMsgType::RowResult, 1, 0, &m, &reference)]
    );
    assert_eq!(s.handle(addr(1), &end(1, 1, 1), 0), Verdict::Completed);
    assert_eq!(drain(&mut s), vec![done(addr(1), 1, 1)]);
    // Rank 0 at clock 1 reads rank 1's update.
    let q = [ids[1], ids[2]];
    assert_eq!(
        s.handle(addr(0), &push(0, 1, 0, &q, &grads(&q, 2)), 0),
        Verdict::Applied
    );
    for &id in &q {
        reference.apply(id, &grad(id, 2));
    }
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(addr(0), RowMsgType::RowResult, 1, 0, &q, &reference)]
    );
    // Rank 1: clock 3 is ahead, clock 1 again is answered.
    assert_eq!(
        s.handle(addr(1), &push(1, 3, 0, &q, &grads(&q, 3)), 0),
        Verdict::Dropped(DropReason::Ahead)
    );
    assert_eq!(s.handle(addr(1), &end(1, 1, 1), 0), Verdict::Resent);
    assert_eq!(
        drain(&mut s),
        vec![error(addr(1), DropReason::Ahead, 3, 0), done(addr(1), 1, 1)]
    );
    assert_eq!(s.handle(addr(0), &pull(0, 2, &ids), 0), Verdict::Pulled);
    assert_eq!(
        drain(&mut s),
        vec![rows_sent(
            addr(0),
            RowMsgType::RowPullResult,
            0,
            2,
            &ids,
            &reference
        )]
    );
}

/// The type and flags of each answer the shard sent, in order.
fn answer_flags(s: &mut Shard<u32>) -> Vec<(u8, u8)> {
    let out = s
        .transmits()
        .map(|t| (t.header[wire::field::TYPE], t.header[wire::field::FLAGS]))
        .collect();
    s.clear_transmits();
    out
}

/// `bytes` with RETRANSMIT set, as a worker resends it.
fn resent(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes[wire::field::FLAGS] |= flags::RETRANSMIT;
    bytes
}

/// FIRST_COPY (PROTOCOL.md §10.2, §10.3 "Loss timer"): an answer sent at
/// once to a message that came without RETRANSMIT says so, one to a
/// retransmitted copy does not (whether that copy was applied, its first
/// lost, or answered as a duplicate); a BSP round's answers, sent at its
/// completion, and ROW_DONEs never do. Seen failing with the flag set on
/// every answer (the BSP completion's and the resends' then carry it).
#[test]
fn answers_sent_at_once_say_whether_they_answer_a_first_copy() {
    let (result, pulled, done_code) = (
        RowMsgType::RowResult.code(),
        RowMsgType::RowPullResult.code(),
        RowMsgType::RowDone.code(),
    );
    let first = flags::FIRST_COPY;
    let mut s = shard(2, Consistency::Async);
    let ids = ids_on(0, 3);
    let p = push(1, 1, 0, &ids, &grads(&ids, 1));
    assert_eq!(s.handle(addr(1), &p, 0), Verdict::Applied);
    assert_eq!(answer_flags(&mut s), vec![(result, first)]);
    // Its resend, a duplicate: answered, not as a first copy.
    assert_eq!(s.handle(addr(1), &resent(p.clone()), 0), Verdict::Resent);
    assert_eq!(answer_flags(&mut s), vec![(result, 0)]);
    // A first copy again (a duplicate in the network): as the first.
    assert_eq!(s.handle(addr(1), &p, 0), Verdict::Resent);
    assert_eq!(answer_flags(&mut s), vec![(result, first)]);
    // Rank 0's first copy lost: its resend is applied, answered without.
    let q = resent(push(0, 1, 0, &ids, &grads(&ids, 2)));
    assert_eq!(s.handle(addr(0), &q, 0), Verdict::Applied);
    assert_eq!(answer_flags(&mut s), vec![(result, 0)]);
    assert_eq!(s.handle(addr(0), &end(0, 1, 1), 0), Verdict::Completed);
    assert_eq!(answer_flags(&mut s), vec![(done_code, 0)]);
    assert_eq!(s.handle(addr(0), &pull(0, 4, &ids), 0), Verdict::Pulled);
    assert_eq!(answer_flags(&mut s), vec![(pulled, first)]);
    assert_eq!(s.handle(addr(0), &resent(pull(0, 4, &ids)), 0), Verdict::Pulled);
    assert_eq!(answer_flags(&mut s), vec![(pulled, 0)]);

    // BSP: the round's answers go at its completion, without the flag;
    // a push of the completed round again is answered at once, with it
    // when it is a first copy (a rank's new incarnation).
    let mut s = shard(2, Consistency::Sync);
    for r in 0..2u16 {
        assert_eq!(
            s.handle(addr(r), &push(r, 1, 0, &ids, &grads(&ids, 3)), 0),
            Verdict::Aggregated
        );
    }
    assert_eq!(s.handle(addr(0), &end(0, 1, 1), 0), Verdict::Aggregated);
    assert_eq!(s.handle(addr(1), &end(1, 1, 1), 0), Verdict::Completed);
    assert_eq!(
        answer_flags(&mut s),
        vec![(result, 0), (result, 0), (done_code, 0), (done_code, 0)]
    );
    let again = push(1, 1, 0, &ids, &grads(&ids, 3));
    assert_eq!(s.handle(addr(1), &resent(again.clone()), 0), Verdict::Resent);
    assert_eq!(answer_flags(&mut s), vec![(result, 0)]);
    assert_eq!(s.handle(addr(1), &again, 0), Verdict::Resent);
    assert_eq!(answer_flags(&mut s), vec![(result, first)]);
}

/// Async: an lcore restored from a checkpoint that held part of rank 0's
/// clock 1 (a push taken, its count stated or not), which rank 0 catches
/// up with an empty clock 1 (PROTOCOL.md §10.6): the empty clock closes
/// the clock with what the lcore holds, at once, as a BSP round's part
/// closes; the push taken is not applied again, and clock 2 goes on as
/// any. Before, the empty clock was refused `bad_row_count` and the
/// worker's push failed (simulator seed 839).
#[test]
fn an_empty_clock_over_part_of_a_clock_closes_it() {
    for stated in [false, true] {
        let mut s = shard(2, Consistency::Async);
        let ids = ids_on(0, 2);
        let mut reference = Reference::new(&table_spec());
        assert_eq!(
            s.handle(addr(0), &push(0, 1, 0, &ids, &grads(&ids, 1)), 0),
            Verdict::Applied
        );
        for &id in &ids {
            reference.apply(id, &grad(id, 1));
        }
        if stated {
            assert_eq!(s.handle(addr(0), &end(0, 1, 2), 0), Verdict::Aggregated);
        }
        drain(&mut s);
        assert_eq!(
            s.handle(addr(0), &end(0, 1, 0), 0),
            Verdict::Completed,
            "stated {stated}"
        );
        let n = if stated { 2 } else { 0 };
        assert_eq!(drain(&mut s), vec![done(addr(0), 1, n)]);
        // Clock 1 is complete: a copy of its push is answered, not applied.
        assert_eq!(
            s.handle(addr(0), &push(0, 1, 1, &ids, &grads(&ids, 9)), 0),
            Verdict::Resent
        );
        assert_eq!(
            drain(&mut s),
            vec![rows_sent(addr(0), RowMsgType::RowResult, 1, 1, &ids, &reference)]
        );
        // Clock 2 as any: an empty clock over nothing held completes.
        assert_eq!(s.handle(addr(0), &end(0, 2, 0), 0), Verdict::Completed);
        assert_eq!(drain(&mut s), vec![done(addr(0), 2, 0)]);
    }
}

/// Bounded delay τ = 1: a rank's ROW_DONE of clock c leaves at once while
/// c <= slowest + 1, else it is held (its next clock is ahead, its
/// ROW_END's copy a duplicate, its pulls report c − 1) until the slowest
/// rank's clock rises; its ROW_RESULTs are never held.
#[test]
fn bounded_delay_holds_row_done_until_the_slowest_rises() {
    let mut s = shard(2, Consistency::Bounded { delay: 1 });
    let ids = ids_on(0, 2);
    let mut reference = Reference::new(&table_spec());
    for clock in 1..=2 {
        assert_eq!(
            s.handle(addr(0), &push(0, clock, 0, &ids, &grads(&ids, clock)), 0),
            Verdict::Applied
        );
        for &id in &ids {
            reference.apply(id, &grad(id, clock));
        }
        let result = rows_sent(addr(0), RowMsgType::RowResult, clock, 0, &ids, &reference);
        let v = s.handle(addr(0), &end(0, clock, 1), 0);
        if clock == 1 {
            assert_eq!(v, Verdict::Completed);
            assert_eq!(drain(&mut s), vec![result, done(addr(0), 1, 1)]);
        } else {
            assert_eq!(v, Verdict::Held, "clock 2 > slowest 0 + 1");
            assert_eq!(drain(&mut s), vec![result]);
        }
    }
    assert_eq!(
        s.handle(addr(0), &push(0, 3, 0, &ids, &grads(&ids, 3)), 0),
        Verdict::Dropped(DropReason::Ahead)
    );
    assert_eq!(
        s.handle(addr(0), &end(0, 2, 1), 0),
        Verdict::Dropped(DropReason::Duplicate)
    );
    assert_eq!(s.handle(addr(0), &pull(0, 1, &ids), 0), Verdict::Pulled);
    assert_eq!(
        drain(&mut s),
        vec![
            error(addr(0), DropReason::Ahead, 3, 0),
            rows_sent(addr(0), RowMsgType::RowPullResult, 1, 1, &ids, &reference)
        ]
    );
    // The slowest rank completes clock 1 (empty): slowest 1, and rank 0's
    // held ROW_DONE of clock 2 <= 1 + 1 goes.
    assert_eq!(s.handle(addr(1), &end(1, 1, 0), 0), Verdict::Completed);
    assert_eq!(drain(&mut s), vec![done(addr(1), 1, 0), done(addr(0), 2, 1)]);
    assert_eq!(s.counters().answers_held.get(), 1);
    // Released: clock 3 is taken.
    assert_eq!(
        s.handle(addr(0), &push(0, 3, 0, &ids, &grads(&ids, 3)), 0),
        Verdict::Applied
    );
}

/// A job's tables count in its memory as admission charges them: the
/// engine's figure grows by exactly what the memory model adds for the
/// spec's tables on L lcores.
#[test]
fn table_memory_is_what_admission_charges() {
    let spec = JobSpec::from_toml(
        "name = \"t\"\nworkers = 2\nchunk_bytes = 8192\n[optimizer]\nkind = \"sum\"\n\
         [[keys]]\nname = \"w\"\nelements = 8\n\
         [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 4\nrows = 1000\nseed = 7\nadmit_after = 2\nkey_cache = 3\n\
         init = { kind = \"uniform\", a = -0.5, b = 0.5 }\n\
         optimizer = { kind = \"adagrad\", lr = 0.25, initial_accumulator = 0.1 }\n",
    )
    .unwrap();
    let t = spec.tables().next().unwrap();
    let mut plain = Shard::<u32>::new(0, Kernels::best());
    plain
        .install(job(2, Consistency::Sync), InstallKind::Plain)
        .unwrap();
    let mut with = Shard::<u32>::new(0, Kernels::best());
    with.install_with_tables(
        job(2, Consistency::Sync),
        InstallKind::Plain,
        vec![table(t.spec.clone(), spec.chunk_bytes)],
    )
    .unwrap();
    let extra = with.job_memory_bytes(JOB).unwrap() - plain.job_memory_bytes(JOB).unwrap();
    let model = memory_model(&RustHeap);
    assert_eq!(extra, model.tables_lcore_bytes(&spec, L as usize));
    assert!(extra > 500 * 16, "the index of 500 rows at least: {extra}");
    // The key cache: 2 ranks x 3 slots x (R = 341 ids of 8 bytes, a
    // signature and a count).
    let cache = phub_proto::memory::key_cache_bytes(t.spec, 2, 8192, Dtype::F32);
    assert_eq!(cache, 2 * 3 * (341 * 8 + 10));
    let no_cache = TableSpec {
        key_cache: 0,
        ..t.spec.clone()
    };
    let mut without = Shard::<u32>::new(0, Kernels::best());
    without
        .install_with_tables(
            job(2, Consistency::Sync),
            InstallKind::Plain,
            vec![table(no_cache, spec.chunk_bytes)],
        )
        .unwrap();
    assert_eq!(
        with.job_memory_bytes(JOB).unwrap() - without.job_memory_bytes(JOB).unwrap(),
        cache
    );
}

/// A message in a key-cache form (PROTOCOL.md §10.7): `form` with the
/// prefix of `slot` and `ids`' signature (or `sig` when given).
fn keyed(mut repr: RowRepr, store: bool, slot: u32, ids: &[u64], sig: Option<u64>, rows: &[f32]) -> Vec<u8> {
    let c = CacheRef {
        sig: sig.unwrap_or_else(|| ids_signature(ids.iter().copied())),
        slot,
    };
    repr.cache = if store {
        KeyCache::Store(c)
    } else {
        KeyCache::Cached(c)
    };
    build(repr, ids, rows)
}

/// Key caching (PROTOCOL.md §10.7), BSP, two ranks, `key_cache = 2`: rank 0
/// stores its list with its round 1 push and names it in round 2 and in a
/// pull, each answered in the cached form with the rows a plain rank's
/// messages get; a slot that does not hold the named list (empty, another
/// signature, another count, another rank's) is `unknown_signature`, a
/// slot beyond the cache or a store under a wrong signature
/// `bad_signature`, each told and counted, none changing a row.
#[test]
fn key_caching_stores_names_and_refuses_lists() {
    let mut s = Shard::new(0, Kernels::best());
    let spec = TableSpec {
        key_cache: 2,
        ..table_spec()
    };
    s.install_with_tables(
        job(2, Consistency::Sync),
        InstallKind::Plain,
        vec![table(spec.clone(), 8192)],
    )
    .unwrap();
    let ids = ids_on(0, 5);
    let (a, b) = (&ids[0..3], &ids[2..5]);
    let sig_a = ids_signature(a.iter().copied());
    let at = |slot| CacheRef { sig: sig_a, slot };
    let push_head = |rank, round, n| head(RowMsgType::RowPush, rank, round, 0, n);
    let mut reference = Reference::new(&spec);
    for round in 1..=2u32 {
        // Round 1 stores the list in slot 1; round 2 names it.
        let m = keyed(
            push_head(0, round, a.len()),
            round == 1,
            1,
            a,
            None,
            &grads(a, round),
        );
        assert_eq!(s.handle(addr(0), &m, 0), Verdict::Aggregated, "round {round}");
        assert_eq!(s.handle(addr(0), &end(0, round, 1), 0), Verdict::Aggregated);
        assert_eq!(
            s.handle(addr(1), &push(1, round, 0, b, &grads(b, 10 + round)), 0),
            Verdict::Aggregated
        );
        assert_eq!(s.handle(addr(1), &end(1, round, 1), 0), Verdict::Completed);
        for &id in &ids {
            let mut g = vec![0f32; DIM as usize];
            for (list, salt) in [(a, round), (b, 10 + round)] {
                if list.contains(&id) {
                    g.iter_mut().zip(grad(id, salt)).for_each(|(x, y)| *x += y);
                }
            }
            if a.contains(&id) || b.contains(&id) {
                reference.apply(id, &g);
            }
        }
        let want = vec![
            Sent::Cached {
                to: addr(0),
                kind: RowMsgType::RowResult,
                round,
                seq: 0,
                cache: at(1),
                rows: reference.rows_of(a),
            },
            rows_sent(addr(1), RowMsgType::RowResult, round, 0, b, &reference),
            done(addr(0), round, 1),
            done(addr(1), round, 1),
        ];
        assert_eq!(drain(&mut s), want, "round {round}");
    }
    // A pull naming the list, and a copy of round 2's push (rule 3).
    let named_pull = keyed(
        head(RowMsgType::RowPull, 0, 0, 9, a.len()),
        false,
        1,
        a,
        None,
        &[],
    );
    assert_eq!(s.handle(addr(0), &named_pull, 0), Verdict::Pulled);
    let copy = keyed(push_head(0, 2, a.len()), false, 1, a, None, &grads(a, 2));
    assert_eq!(s.handle(addr(0), &copy, 0), Verdict::Resent);
    let cached = |kind, round, seq| Sent::Cached {
        to: addr(0),
        kind,
        round,
        seq,
        cache: at(1),
        rows: reference.rows_of(a),
    };
    assert_eq!(
        drain(&mut s),
        vec![
            cached(RowMsgType::RowPullResult, 2, 9),
            cached(RowMsgType::RowResult, 2, 0)
        ]
    );
    // Refusals, each an ERROR, none changing the rows.
    let pull_head = |rank, n| head(RowMsgType::RowPull, rank, 0, 4, n);
    let refused: Vec<(u16, Vec<u8>, DropReason)> = vec![
        // Slot 0 holds nothing.
        (
            0,
            keyed(pull_head(0, 3), false, 0, a, None, &[]),
            DropReason::UnknownSignature,
        ),
        // Slot 1 holds `a`, not `b`.
        (
            0,
            keyed(pull_head(0, 3), false, 1, b, None, &[]),
            DropReason::UnknownSignature,
        ),
        // Slot 1's list has 3 ids, not 2.
        (
            0,
            keyed(pull_head(0, 2), false, 1, &a[..2], Some(sig_a), &[]),
            DropReason::UnknownSignature,
        ),
        // Rank 1's slot 1 is its own, and empty.
        (
            1,
            keyed(pull_head(1, 3), false, 1, a, None, &[]),
            DropReason::UnknownSignature,
        ),
        // Beyond key_cache = 2.
        (
            0,
            keyed(pull_head(0, 3), false, 2, a, None, &[]),
            DropReason::BadSignature,
        ),
        (
            0,
            keyed(pull_head(0, 3), true, 2, a, None, &[]),
            DropReason::BadSignature,
        ),
        // A store whose signature is not its ids'.
        (
            0,
            keyed(pull_head(0, 3), true, 0, a, Some(sig_a ^ 1), &[]),
            DropReason::BadSignature,
        ),
    ];
    let before = s.counters();
    let (unknown0, bad0) = (
        before.drops_of(DropReason::UnknownSignature),
        before.drops_of(DropReason::BadSignature),
    );
    for (i, (rank, m, why)) in refused.iter().enumerate() {
        assert_eq!(s.handle(addr(*rank), m, 0), Verdict::Dropped(*why), "message {i}");
        assert_eq!(drain(&mut s), vec![error(addr(*rank), *why, 0, 4)], "message {i}");
    }
    let c = s.counters();
    assert_eq!(c.drops_of(DropReason::UnknownSignature) - unknown0, 4);
    assert_eq!(c.drops_of(DropReason::BadSignature) - bad0, 3);
    // The bad store left slot 0 empty; slot 1 still holds `a`, its rows
    // as the rounds left them.
    assert_eq!(
        s.handle(addr(0), &keyed(pull_head(0, 3), false, 0, a, None, &[]), 0),
        Verdict::Dropped(DropReason::UnknownSignature)
    );
    drain(&mut s);
    assert_eq!(s.handle(addr(0), &named_pull, 0), Verdict::Pulled);
    assert_eq!(drain(&mut s), vec![cached(RowMsgType::RowPullResult, 2, 9)]);
    // A new store replaces the slot's list: `a` is no longer named there.
    let store_b = keyed(pull_head(0, 3), true, 1, b, None, &[]);
    assert_eq!(s.handle(addr(0), &store_b, 0), Verdict::Pulled);
    drain(&mut s);
    assert_eq!(
        s.handle(addr(0), &named_pull, 0),
        Verdict::Dropped(DropReason::UnknownSignature)
    );
}

/// `evict = { idle_s = 2 }`, one rank, a round every half second by the
/// clock `handle` is given: the rows pushed only in round 1 stay while
/// round 1 is under 2 s old and are evicted within about a lap (2 s)
/// after; the rows pushed every round stay. Before, an install with
/// `idle_s` was refused.
#[test]
fn rows_idle_for_seconds_are_evicted_by_the_clock_handle_gets() {
    const HALF_S: u64 = 500_000_000;
    let spec = TableSpec {
        evict: Some(Evict::IdleSeconds(2)),
        ..table_spec()
    };
    let mut s = Shard::<u32>::new(0, Kernels::best());
    s.install_with_tables(
        job(1, Consistency::Sync),
        InstallKind::Plain,
        vec![table(spec, 8192)],
    )
    .unwrap();
    let ids = ids_on(0, 12);
    let (cold, hot) = (&ids[..8], &ids[8..]);
    let rows = |s: &Shard<u32>| s.job_stats()[0].tables[0];
    let mut gone_at = None;
    for round in 1..=16u32 {
        let now = u64::from(round) * HALF_S;
        let m = if round == 1 { &ids[..] } else { hot };
        assert_eq!(
            s.handle(addr(0), &push(0, round, 0, m, &grads(m, round)), now),
            Verdict::Aggregated
        );
        assert_eq!(s.handle(addr(0), &end(0, round, 1), now), Verdict::Completed);
        drain(&mut s);
        let t = rows(&s);
        if round <= 4 {
            assert_eq!(t.rows_stored, 12, "round {round}: evicted before 2 s");
        }
        if gone_at.is_none() && t.rows_stored == hot.len() as u64 {
            gone_at = Some(round);
        }
    }
    let gone_at = gone_at.expect("the cold rows went");
    assert!((5..=12).contains(&gone_at), "cold rows gone at round {gone_at}");
    let t = rows(&s);
    assert_eq!(
        (t.evicted_idle, t.rows_stored),
        (cold.len() as u64, hot.len() as u64)
    );
}

/// A table the engine cannot serve refuses the whole install, naming the
/// key and the field; the state each row optimizer keeps is what the spec
/// says admission charges for it.
#[test]
fn unservable_tables_are_refused_and_state_lengths_agree() {
    let mut s = Shard::<u32>::new(0, Kernels::best());
    let uncapped = TableSpec {
        rows: None,
        ..table_spec()
    };
    let e = s
        .install_with_tables(
            job(2, Consistency::Sync),
            InstallKind::Plain,
            vec![table(uncapped, 8192)],
        )
        .unwrap_err();
    assert!(
        matches!(&e, EngineError::Table { key: KEY, reason, .. } if reason.contains("rows")),
        "{e}"
    );
    assert!(s.job_ids().next().is_none(), "nothing installed");
    let mut wrong = table(table_spec(), 8192);
    wrong.entry = L;
    assert!(s
        .install_with_tables(job(2, Consistency::Sync), InstallKind::Plain, vec![wrong])
        .is_err());
    for spec in [
        RowOptimizerSpec::Sum,
        RowOptimizerSpec::Sgd { lr: 0.1 },
        RowOptimizerSpec::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.0,
            rowwise: false,
        },
        RowOptimizerSpec::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.0,
            rowwise: true,
        },
        RowOptimizerSpec::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        RowOptimizerSpec::Ftrl {
            alpha: 0.1,
            beta: 1.0,
            l1: 0.0,
            l2: 0.0,
        },
    ] {
        for dim in [1, 4, 17] {
            assert_eq!(
                spec.state_len(dim) as usize,
                row_optimizer(&spec).state_len(dim as usize),
                "{}",
                spec.name()
            );
        }
    }
}

/// A table that evicts (a cap of 6 rows per lcore, idle after 4 rounds)
/// and admits on the second push: what a checkpoint must keep besides
/// the rows for a restored lcore to answer as the saved one.
fn evicting_spec() -> TableSpec {
    TableSpec {
        rows: Some(12),
        evict: Some(Evict::IdleRounds(4)),
        admit_after: Some(2),
        key_cache: 0,
        ..table_spec()
    }
}

fn evicting_shard(workers: u16, consistency: Consistency) -> Shard<u32> {
    let mut s = Shard::new(0, Kernels::best());
    s.install_with_tables(
        job(workers, consistency),
        InstallKind::Plain,
        vec![table(evicting_spec(), 8192)],
    )
    .unwrap();
    s
}

/// A new shard with the job installed as `s` has it, restored from `s`'s
/// checkpoint (slots and tables, as the dataplane takes and restores one).
fn restarted(s: &Shard<u32>, workers: u16, consistency: Consistency) -> Shard<u32> {
    let slots = s.snapshot(JOB).unwrap();
    let tables = s.snapshot_tables(JOB).unwrap();
    assert_eq!(tables.len(), 1);
    let mut r = evicting_shard(workers, consistency);
    r.restore(JOB, &slots).unwrap();
    r.restore_tables(JOB, &tables).unwrap();
    r
}

/// [`restarted`] the way the dataplane restores a checkpoint as it
/// streams: each table made and read away from the shard
/// (`RestoredTable::read`), then taken in whole (`install_restored`).
fn restarted_away(s: &Shard<u32>, workers: u16, consistency: Consistency) -> Shard<u32> {
    let slots = s.snapshot(JOB).unwrap();
    let tables = s.snapshot_tables(JOB).unwrap();
    let t = table(evicting_spec(), 8192);
    let restored = tables
        .iter()
        .map(|st| {
            RestoredTable::read(
                JOB,
                workers,
                Dtype::F32,
                consistency,
                &t,
                &st.rounds,
                &st.rows[..],
            )
            .unwrap()
        })
        .collect();
    let mut r = Shard::new(0, Kernels::best());
    r.install_restored(job(workers, consistency), InstallKind::Plain, restored)
        .unwrap();
    r.restore(JOB, &slots).unwrap();
    r
}

/// A table restored away from its lcore and taken in whole (as the
/// dataplane restores a checkpoint as it streams) is the table restored
/// on the lcore: the same checkpoint again, the same answers after; a
/// state that does not fit, or a table read for another job, is refused
/// naming why.
#[test]
fn a_table_restored_away_from_its_lcore_is_the_one_restored_on_it() {
    let ids = ids_on(0, 24);
    for mode in [Consistency::Sync, Consistency::Bounded { delay: 1 }] {
        let mut live = evicting_shard(2, mode);
        for round in 1..=5 {
            bsp_round(&mut live, &ids, 0, round);
            bsp_round(&mut live, &ids, 1, round);
        }
        drain(&mut live);
        let mut back = restarted(&live, 2, mode);
        let mut away = restarted_away(&live, 2, mode);
        let saved = live.snapshot_tables(JOB).unwrap();
        assert!(saved[0].rows.len() > 100, "{mode:?}: rows saved");
        assert_eq!(away.snapshot_tables(JOB).unwrap(), saved, "{mode:?}");
        assert_eq!(back.snapshot_tables(JOB).unwrap(), saved, "{mode:?}");
        for round in 6..=8 {
            for rank in 0..2 {
                let (a, b) = (
                    bsp_round(&mut back, &ids, rank, round),
                    bsp_round(&mut away, &ids, rank, round),
                );
                assert_eq!(a, b, "{mode:?} round {round} rank {rank}");
                assert_eq!(drain(&mut back), drain(&mut away), "{mode:?} round {round}");
            }
        }
        assert_eq!(away.snapshot_tables(JOB), back.snapshot_tables(JOB));
    }
    let mut live = evicting_shard(2, Consistency::Sync);
    bsp_round(&mut live, &ids, 0, 1);
    let saved = live.snapshot_tables(JOB).unwrap();
    let t = table(evicting_spec(), 8192);
    let read = |workers, mode| {
        RestoredTable::read(
            JOB,
            workers,
            Dtype::F32,
            mode,
            &t,
            &saved[0].rounds,
            &saved[0].rows[..],
        )
    };
    let e = read(2, Consistency::Async).unwrap_err().to_string();
    assert!(e.contains("a BSP round saved for a table that is not BSP"), "{e}");
    let e = RestoredTable::read(
        JOB,
        2,
        Dtype::F32,
        Consistency::Sync,
        &t,
        &saved[0].rounds,
        &saved[0].rows[..9],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("table key 1") && e.contains("truncated"), "{e}");
    let other = read(3, Consistency::Sync).unwrap();
    let mut s = Shard::<u32>::new(0, Kernels::best());
    let e = s
        .install_restored(job(2, Consistency::Sync), InstallKind::Plain, vec![other])
        .unwrap_err()
        .to_string();
    assert!(e.contains("restored for job 3 of 3 workers"), "{e}");
    assert!(s.snapshot_tables(JOB).is_none(), "nothing installed");
}

/// Round `round` of BSP from `rank`: its ids of the round (a window of
/// `ids` moving with the round, so rows go idle and the cap is passed)
/// in one push, then its ROW_END.
fn bsp_round(s: &mut Shard<u32>, ids: &[u64], rank: u16, round: u32) -> Vec<Verdict> {
    let at = (round as usize * 3 + usize::from(rank) * 2) % (ids.len() - 5);
    let m = &ids[at..at + 5];
    vec![
        s.handle(
            addr(rank),
            &push(rank, round, 0, m, &grads(m, round + u32::from(rank))),
            0,
        ),
        s.handle(addr(rank), &end(rank, round, 1), 0),
    ]
}

/// BSP: an lcore checkpointed after 5 rounds and while round 6 is in
/// progress (rank 0's messages in, rank 1's not), restored into a new
/// shard: a ROW_PULL of every id reads the same rows, and rounds 6 to 9
/// (rank 0 resending its unanswered round-6 messages, as §10.3's worker
/// does) give the same answers bit for bit, evictions and admissions
/// included. Before tables were checkpointed the restored lcore read
/// every row as its initial value and took round 6 as ahead of round 0.
#[test]
fn a_restored_bsp_table_answers_as_the_saved_one() {
    let ids = ids_on(0, 24);
    let mut live = evicting_shard(2, Consistency::Sync);
    for round in 1..=5 {
        bsp_round(&mut live, &ids, 0, round);
        bsp_round(&mut live, &ids, 1, round);
    }
    bsp_round(&mut live, &ids, 0, 6);
    drain(&mut live);
    let mut back = restarted(&live, 2, Consistency::Sync);
    for s in [&mut live, &mut back] {
        assert_eq!(s.handle(addr(0), &pull(0, 9, &ids[..20]), 0), Verdict::Pulled);
    }
    let pulled = drain(&mut live);
    assert!(matches!(&pulled[0], Sent::Rows { round: 5, .. }), "{pulled:?}");
    assert_eq!(drain(&mut back), pulled);
    // Rank 0's round-6 messages are lost on the restored lcore: it resends
    // them (the live one takes the copies as duplicates).
    let resent = bsp_round(&mut back, &ids, 0, 6);
    assert_eq!(resent, vec![Verdict::Aggregated, Verdict::Aggregated]);
    for round in 6..=9 {
        let a = bsp_round(&mut live, &ids, 1, round);
        let b = bsp_round(&mut back, &ids, 1, round);
        assert_eq!(a, b, "round {round}");
        let (a, b) = (drain(&mut live), drain(&mut back));
        assert_eq!(a, b, "round {round}");
        assert!(!a.is_empty());
        if round < 9 {
            bsp_round(&mut live, &ids, 0, round + 1);
            bsp_round(&mut back, &ids, 0, round + 1);
        }
    }
    for s in [&mut live, &mut back] {
        assert_eq!(s.handle(addr(1), &pull(1, 10, &ids[..20]), 0), Verdict::Pulled);
    }
    assert_eq!(drain(&mut live), drain(&mut back));
}

/// Bounded delay τ = 1: rank 0's ROW_DONE of clock 2 held, rank 1 in the
/// middle of clock 1 (one of two pushes applied and answered, no ROW_END
/// yet): checkpointed and restored, the new shard goes on exactly as the
/// live one (rank 1's clock completes with its second push, rank 0's held
/// ROW_DONE is released, rank 0's clock 3 is taken).
#[test]
fn a_restored_bounded_delay_table_keeps_clocks_held_answers_and_pushes_in_progress() {
    let ids = ids_on(0, 6);
    let mode = Consistency::Bounded { delay: 1 };
    let mut live = evicting_shard(2, mode);
    for clock in 1..=2 {
        live.handle(
            addr(0),
            &push(0, clock, 0, &ids[..3], &grads(&ids[..3], clock)),
            0,
        );
        live.handle(addr(0), &end(0, clock, 1), 0);
    }
    live.handle(addr(1), &push(1, 1, 0, &ids[2..5], &grads(&ids[2..5], 7)), 0);
    drain(&mut live);
    let mut back = restarted(&live, 2, mode);
    let steps: [(u16, Vec<u8>); 5] = [
        (1, push(1, 1, 0, &ids[2..5], &grads(&ids[2..5], 7))),
        (0, push(0, 3, 0, &ids[..3], &grads(&ids[..3], 3))),
        (1, end(1, 1, 2)),
        (1, push(1, 1, 1, &ids[1..4], &grads(&ids[1..4], 8))),
        (0, push(0, 3, 0, &ids[..3], &grads(&ids[..3], 3))),
    ];
    for (i, (rank, msg)) in steps.iter().enumerate() {
        let (a, b) = (live.handle(addr(*rank), msg, 0), back.handle(addr(*rank), msg, 0));
        assert_eq!(a, b, "step {i}");
        assert_eq!(drain(&mut live), drain(&mut back), "step {i}");
    }
    for s in [&mut live, &mut back] {
        assert_eq!(s.handle(addr(1), &pull(1, 3, &ids), 0), Verdict::Pulled);
    }
    assert_eq!(drain(&mut live), drain(&mut back));
}

/// A table state that does not fit is refused naming what is wrong, and
/// a checkpoint without tables (format 1 or 2) leaves the tables empty.
#[test]
fn a_table_state_that_does_not_fit_is_refused() {
    let ids = ids_on(0, 6);
    let mut live = evicting_shard(2, Consistency::Sync);
    for rank in 0..2 {
        bsp_round(&mut live, &ids, rank, 1);
    }
    let tables = live.snapshot_tables(JOB).unwrap();
    let mut fresh = evicting_shard(2, Consistency::Sync);
    fresh.restore_tables(JOB, &[]).unwrap();
    let restore = |t: &[phub_proto::table_checkpoint::TableState], mode| {
        let mut s = evicting_shard(2, mode);
        s.restore_tables(JOB, t).unwrap_err().to_string()
    };
    let e = restore(&tables, Consistency::Async);
    assert!(e.contains("a BSP round saved for a table that is not BSP"), "{e}");
    let mut cut = tables.clone();
    let n = cut[0].rows.len();
    cut[0].rows.truncate(n - 3);
    let e = restore(&cut, Consistency::Sync);
    assert!(e.contains("table key 1") && e.contains("truncated"), "{e}");
    let mut other = tables.clone();
    other[0].key = 0;
    let e = restore(&other, Consistency::Sync);
    assert!(e.contains("state of key 0 for table key 1"), "{e}");
    let e = restore(&[tables[0].clone(), tables[0].clone()], Consistency::Sync);
    assert!(e.contains("2 tables saved, 1 installed"), "{e}");
}

/// What `snapshot_tables` saved, as a checkpoint file's section of one
/// lcore's tables.
fn section(tables: &[phub_proto::table_checkpoint::TableState]) -> Vec<u8> {
    use phub_proto::table_checkpoint::{encode_count, encode_head};
    let mut out = Vec::new();
    encode_count(&mut out, tables.len()).unwrap();
    for t in tables {
        encode_head(&mut out, t.key, &t.rounds, t.rows.len() as u64).unwrap();
        out.extend_from_slice(&t.rows);
    }
    out
}

/// A job's tables streamed while the lcore goes on serving (pushes,
/// ROW_ENDs and pulls between slices, rounds completing, rows created and
/// evicted) are the section `snapshot_tables` would have saved at the
/// stream's start, byte for byte; the shard answers exactly what a shard
/// without a stream answers; one stream at a time; a job removed during
/// its stream ends it.
#[test]
fn tables_streamed_during_traffic_are_the_tables_at_the_streams_start() {
    let ids = ids_on(0, 40);
    for mode in [Consistency::Sync, Consistency::Async] {
        let mut live = evicting_shard(2, mode);
        let mut plain = evicting_shard(2, mode);
        // Round or clock `r` of both ranks: one push and its ROW_END each.
        let step = |s: &mut Shard<u32>, r: u32| -> Vec<Verdict> {
            let mut v = bsp_round(s, &ids, 0, r);
            v.extend(bsp_round(s, &ids, 1, r));
            v.push(s.handle(addr(1), &pull(1, r, &ids[..8]), 0));
            v
        };
        for r in 1..=4 {
            assert_eq!(step(&mut live, r), step(&mut plain, r));
            assert_eq!(drain(&mut live), drain(&mut plain));
        }
        let want = section(&live.snapshot_tables(JOB).unwrap());
        let total = live.stream_tables_begin(JOB).unwrap();
        assert_eq!(total, want.len() as u64, "{mode:?}");
        assert_eq!(live.tables_streaming(), Some(JOB));
        assert_eq!(live.stream_tables_begin(JOB), Err(TablesStreamError::Busy(JOB)));
        let mut got = Vec::new();
        let mut r = 5;
        while !live.stream_tables_fill(&mut got, 60).unwrap() {
            assert_eq!(step(&mut live, r), step(&mut plain, r), "{mode:?} round {r}");
            assert_eq!(drain(&mut live), drain(&mut plain), "{mode:?} round {r}");
            r += 1;
        }
        assert!(r > 8, "{mode:?}: the stream took {} slices", r - 5);
        assert_eq!(live.tables_streaming(), None);
        assert!(
            got == want,
            "{mode:?}: the streamed section differs from the tables at its start"
        );
        // Nothing the stream kept changed what the tables hold now.
        assert_eq!(
            section(&live.snapshot_tables(JOB).unwrap()),
            section(&plain.snapshot_tables(JOB).unwrap())
        );
        // Rows were pushed between slices: copy on write kept some, and
        // says so after the stream (a row is D values and its state).
        let kept = live.stream_tables_kept();
        assert!(kept.entries > 0 && kept.row_bytes > 0, "{mode:?}: {kept:?}");
        assert_eq!(kept.row_bytes % 4, 0, "{mode:?}: {kept:?}");
        // A job removed during its stream ends it; the lcore may stream
        // again.
        live.stream_tables_begin(JOB).unwrap();
        assert!(!live.stream_tables_fill(&mut Vec::new(), 1).unwrap());
        assert!(live.remove(JOB));
        assert_eq!(
            live.stream_tables_fill(&mut Vec::new(), 1 << 20),
            Err(TablesStreamError::Gone(JOB))
        );
        assert_eq!(
            live.stream_tables_begin(JOB),
            Err(TablesStreamError::NotInstalled(JOB))
        );
        assert_eq!(
            live.stream_tables_fill(&mut Vec::new(), 1),
            Err(TablesStreamError::NotStarted)
        );
        plain.stream_tables_begin(JOB).unwrap();
        plain.stream_tables_abort();
        assert_eq!(plain.tables_streaming(), None);
        let mut again = Vec::new();
        plain.stream_tables_begin(JOB).unwrap();
        while !plain.stream_tables_fill(&mut again, 1 << 20).unwrap() {}
        assert_eq!(again, section(&plain.snapshot_tables(JOB).unwrap()));
    }
}
