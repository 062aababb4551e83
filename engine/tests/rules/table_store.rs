//! The row store of sparse tables against a `HashMap` model: pushes,
//! reads, CLOCK and idle eviction, admission, batched forms, checkpoints,
//! the memory model, edge ids.

use std::collections::HashMap;
use std::num::NonZeroU32;

use phub_engine::table::checkpoint::CheckpointError;
use phub_engine::table::snapshot::StreamError;
use phub_engine::table::{Admission, Pushed, RowInit, RowStore, RowUpdate, StoreConfig, StoreError};
use phub_proto::memory::table_bytes;
use proptest::prelude::*;

/// Initial values that differ by id and element.
#[derive(Debug, Clone, Copy)]
struct Seeded;

impl RowInit for Seeded {
    fn fill(&self, id: u64, values: &mut [f32]) {
        let base = (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 44) as f32 / 1024.0;
        for (i, v) in values.iter_mut().enumerate() {
            *v = base + i as f32;
        }
    }
}

/// A test optimizer: values += grad; state (one word per value, from 0.5)
/// counts the pushes.
#[derive(Debug, Clone, Copy)]
struct SumCount;

impl RowUpdate for SumCount {
    fn state_len(&self, dim: usize) -> usize {
        dim
    }
    fn init_state(&self, state: &mut [f32]) {
        state.fill(0.5);
    }
    fn apply(&self, values: &mut [f32], state: &mut [f32], grad: &[f32]) {
        for ((v, s), g) in values.iter_mut().zip(state.iter_mut()).zip(grad) {
            *v += g;
            *s += 1.0;
        }
    }
}

fn config(dim: u32, rows_cap: u64) -> StoreConfig {
    StoreConfig {
        dim,
        rows_cap,
        admission: Admission::Always,
        idle_rounds: None,
        idle_seconds: None,
        hash_key: 0x1234_5678,
    }
}

/// A proptest's store: `admit` 1 for none, `idle` 0 for no idle eviction.
fn drawn_config(dim: u32, cap: u64, admit: u16, idle: u32) -> StoreConfig {
    StoreConfig {
        admission: if admit == 1 {
            Admission::Always
        } else {
            Admission::AfterPushes(admit)
        },
        idle_rounds: NonZeroU32::new(idle),
        ..config(dim, cap)
    }
}

fn store(c: StoreConfig) -> RowStore<Seeded, SumCount> {
    RowStore::new(c, Seeded, SumCount).unwrap()
}

fn grad(dim: usize, seed: u8) -> Vec<f32> {
    (0..dim)
        .map(|i| f32::from(seed % 7) - 3.0 + i as f32 * 0.25)
        .collect()
}

fn init_row(id: u64, dim: usize) -> (Vec<f32>, Vec<f32>) {
    let mut v = vec![0.0; dim];
    Seeded.fill(id, &mut v);
    let mut s = vec![0.0; dim];
    SumCount.init_state(&mut s);
    (v, s)
}

fn bits(r: &[f32]) -> Vec<u32> {
    r.iter().map(|v| v.to_bits()).collect()
}

/// Every stored row as (id, value bits, state bits), sorted.
fn dump(s: &RowStore<Seeded, SumCount>) -> Vec<(u64, Vec<u32>, Vec<u32>)> {
    let mut rows: Vec<_> = s.rows().map(|(id, v, st)| (id, bits(v), bits(st))).collect();
    rows.sort_by_key(|r| r.0);
    rows
}

#[derive(Debug, Clone)]
enum Op {
    Push(u64, u8),
    Read(u64),
    Batch(Vec<(u64, u8)>),
    Round,
}

fn id_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        0u64..24,
        any::<u64>(),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (id_strategy(), any::<u8>()).prop_map(|(id, g)| Op::Push(id, g)),
        3 => id_strategy().prop_map(Op::Read),
        2 => prop::collection::vec((id_strategy(), any::<u8>()), 0..20).prop_map(Op::Batch),
        // Strictly ascending ids, as a worker's messages carry them.
        2 => prop::collection::vec((id_strategy(), any::<u8>()), 0..20).prop_map(|mut p| {
            p.sort_by_key(|x| x.0);
            p.dedup_by_key(|x| x.0);
            Op::Batch(p)
        }),
        // Distinct ids in any order, as a BSP round's.
        2 => prop::collection::vec((id_strategy(), any::<u8>()), 0..20)
            .prop_map(|mut p| {
                p.sort_by_key(|x| x.0);
                p.dedup_by_key(|x| x.0);
                p
            })
            .prop_shuffle()
            .prop_map(Op::Batch),
        1 => Just(Op::Round),
    ]
}

/// The model: what each stored row must hold, and when it was pushed.
#[derive(Default)]
struct Model {
    rows: HashMap<u64, (Vec<f32>, Vec<f32>)>,
    last_push: HashMap<u64, u32>,
    /// Pushes of an id while it was not stored.
    pending: HashMap<u64, u32>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_a_hashmap_model(
        ops in prop::collection::vec(op_strategy(), 1..300),
        cap in 1u64..12,
        dim in 1u32..5,
        admit in prop_oneof![Just(1u16), 2u16..4],
        idle in prop_oneof![Just(0u32), 1u32..4],
    ) {
        let c = drawn_config(dim, cap, admit, idle);
        let d = dim as usize;
        // One store driven id by id (checked against the model), one driven
        // by the batched forms, one by `update_batch_into` (or, for a batch
        // of distinct ids not ascending, `update_distinct_into`): they must
        // end equal, and the rows the last gives are those read after the
        // batched update.
        let mut s = store(c);
        let mut b = store(c);
        let mut f = store(c);
        let mut m = Model::default();
        let mut round = 0u32;
        let mut stats_evicted = 0u64;
        for op in &ops {
            let pushes: Vec<(u64, u8)> = match op {
                Op::Push(id, g) => vec![(*id, *g)],
                Op::Batch(p) => p.clone(),
                Op::Read(id) => {
                    let mut out = vec![0.0; d];
                    let stored = s.read(*id, &mut out);
                    let want = m.rows.get(id).map_or_else(|| init_row(*id, d).0, |r| r.0.clone());
                    prop_assert_eq!(stored, m.rows.contains_key(id));
                    prop_assert_eq!(bits(&out), bits(&want));
                    let mut out_b = vec![0.0; d];
                    b.read_batch(&[*id], &mut out_b);
                    prop_assert_eq!(bits(&out_b), bits(&out));
                    vec![]
                }
                Op::Round => {
                    let evicted = s.advance_round();
                    prop_assert_eq!(b.advance_round(), evicted);
                    prop_assert_eq!(f.advance_round(), evicted);
                    round += 1;
                    let gone: Vec<u64> = m.rows.keys().copied().filter(|id| s.get(*id).is_none()).collect();
                    prop_assert_eq!(gone.len() as u64, evicted);
                    for id in gone {
                        // Idle eviction only: never before `idle` rounds.
                        prop_assert!(idle > 0 && round - m.last_push[&id] >= idle, "id {} evicted early", id);
                        m.rows.remove(&id);
                    }
                    vec![]
                }
            };
            if let Op::Batch(p) = op {
                let ids: Vec<u64> = p.iter().map(|x| x.0).collect();
                let grads: Vec<f32> = p.iter().flat_map(|x| grad(d, x.1)).collect();
                b.update_batch(&ids, &grads);
                let mut after = vec![0.0; ids.len() * d];
                b.read_batch(&ids, &mut after);
                let mut fused = vec![f32::NAN; ids.len() * d];
                let mut sorted = ids.clone();
                sorted.sort_unstable();
                let distinct = sorted.windows(2).all(|w| w[0] != w[1]);
                if distinct && sorted != ids {
                    f.update_distinct_into(&ids, &grads, &mut fused);
                } else {
                    f.update_batch_into(&ids, &grads, &mut fused);
                }
                prop_assert_eq!(bits(&fused), bits(&after));
            } else if let Op::Push(id, g) = op {
                b.update(*id, &grad(d, *g));
                f.update(*id, &grad(d, *g));
            }
            for (id, g) in pushes {
                let was = s.get(id).is_some();
                prop_assert_eq!(was, m.rows.contains_key(&id));
                let full = s.rows_stored() == cap;
                let before = s.stats();
                let pushed = s.update(id, &grad(d, g));
                let gr = grad(d, g);
                let apply = |r: &mut (Vec<f32>, Vec<f32>)| SumCount.apply(&mut r.0, &mut r.1, &gr);
                match pushed {
                    Pushed::Applied => {
                        prop_assert!(was);
                        apply(m.rows.get_mut(&id).unwrap());
                    }
                    Pushed::Created => {
                        prop_assert!(!was);
                        // Early is allowed (shared counters); never late
                        // is checked on every push not admitted.
                        *m.pending.entry(id).or_default() += 1;
                        let mut r = init_row(id, d);
                        apply(&mut r);
                        m.rows.insert(id, r);
                        let evicted = s.stats().evicted_cap - before.evicted_cap;
                        prop_assert_eq!(evicted, u64::from(full));
                    }
                    Pushed::NotAdmitted => {
                        prop_assert!(!was && admit >= 2);
                        let n = m.pending.entry(id).or_default();
                        *n += 1;
                        prop_assert!(*n < u32::from(admit), "id {} not admitted on push {} (admit_after {})", id, n, admit);
                        prop_assert_eq!(s.stats().not_admitted, before.not_admitted + 1);
                    }
                    Pushed::NoMemory => prop_assert!(false, "no memory"),
                }
                if pushed != Pushed::NotAdmitted {
                    m.last_push.insert(id, round);
                }
                // A cap eviction removes one row other than this one.
                let gone: Vec<u64> = m.rows.keys().copied().filter(|id| s.get(*id).is_none()).collect();
                prop_assert!(gone.len() <= 1);
                for id in gone {
                    m.rows.remove(&id);
                    stats_evicted += 1;
                }
                prop_assert_eq!(s.stats().evicted_cap, stats_evicted);
            }
            // Every stored row is the model's, bit for bit.
            prop_assert_eq!(s.rows_stored(), m.rows.len() as u64);
            prop_assert!(s.rows_stored() <= cap);
            for (id, r) in &m.rows {
                prop_assert_eq!(bits(s.get(*id).unwrap()), bits(&r.0), "values of {}", id);
                prop_assert_eq!(bits(s.state(*id).unwrap()), bits(&r.1), "state of {}", id);
            }
            prop_assert!(s.allocated_bytes() <= table_bytes(&s.shape()));
        }
        // Batched and one by one agree.
        prop_assert_eq!(dump(&b), dump(&s));
        prop_assert_eq!(dump(&f), dump(&s));
        let (sa, sb) = (s.stats(), b.stats());
        prop_assert_eq!((sa.created, sa.updates, sa.not_admitted, sa.evicted_cap, sa.evicted_idle),
            (sb.created, sb.updates, sb.not_admitted, sb.evicted_cap, sb.evicted_idle));
        // A checkpoint restores every row bit for bit.
        let mut file = Vec::new();
        let n = s.write_to(&mut file).unwrap();
        prop_assert_eq!(n, file.len() as u64);
        let r = RowStore::read_from(&file[..], c, Seeded, SumCount).unwrap();
        prop_assert_eq!(dump(&r), dump(&s));
        // Fed a piece at a time (a state copy's fragments), the same.
        let mut p = RowStore::new(c, Seeded, SumCount).unwrap();
        let mut load = p.load_begin();
        let step = 1 + ops.len() % 97;
        for piece in file.chunks(step) {
            load.feed(&mut p, piece).unwrap();
        }
        load.finish(&mut p).unwrap();
        prop_assert_eq!(dump(&p), dump(&s));
        // Cut anywhere: an error, never a panic.
        let cut = (ops.len() * 7919) % file.len();
        let truncated = matches!(
            RowStore::read_from(&file[..cut], c, Seeded, SumCount),
            Err(CheckpointError::Truncated { .. })
        );
        prop_assert!(truncated, "a checkpoint cut at {} of {} bytes", cut, file.len());
    }
}

#[test]
fn clock_gives_rows_updated_since_the_hand_passed_a_second_chance() {
    let mut s = store(config(2, 4));
    let g = grad(2, 3);
    for id in [10, 20, 30, 40] {
        assert_eq!(s.update(id, &g), Pushed::Created);
    }
    // Every bit is set: the hand clears them all and evicts one.
    assert_eq!(s.update(50, &g), Pushed::Created);
    let first: Vec<u64> = [10, 20, 30, 40]
        .into_iter()
        .filter(|id| s.get(*id).is_none())
        .collect();
    assert_eq!(first.len(), 1);
    let mut left: Vec<u64> = [10, 20, 30, 40]
        .into_iter()
        .filter(|id| s.get(*id).is_some())
        .collect();
    // Update two of the three old rows: the third has its bit clear and
    // goes next, whatever the index order.
    let cold = left.pop().unwrap();
    for id in &left {
        assert_eq!(s.update(*id, &g), Pushed::Applied);
    }
    assert_eq!(s.update(60, &g), Pushed::Created);
    assert!(
        s.get(cold).is_none(),
        "row {cold}, not updated since the hand passed, should be evicted"
    );
    for id in left.iter().chain(&[50, 60]) {
        assert!(s.get(*id).is_some(), "row {id} evicted");
    }
    assert_eq!(s.stats().evicted_cap, 2);
}

#[test]
fn idle_rows_go_between_n_and_2n_rounds_after_their_last_update() {
    let c = StoreConfig {
        idle_rounds: NonZeroU32::new(3),
        ..config(4, 1000)
    };
    let mut s = store(c);
    let g = grad(4, 1);
    let hot: Vec<u64> = (0..10).collect();
    for id in 0..100u64 {
        s.update(id, &g);
    }
    for round in 1..=6u32 {
        s.advance_round();
        for id in &hot {
            s.update(*id, &g);
        }
        if round < 3 {
            assert_eq!(
                s.rows_stored(),
                100,
                "evicted before 3 idle rounds (round {round})"
            );
        }
    }
    assert_eq!(s.rows_stored(), 10);
    assert_eq!(s.stats().evicted_idle, 90);
    assert!(hot.iter().all(|id| s.get(*id).is_some()));
    // Freed slots are reused: 90 new rows need no new block.
    let blocks = s.blocks_allocated();
    for id in 1000..1090u64 {
        assert_eq!(s.update(id, &g), Pushed::Created);
    }
    assert_eq!(s.blocks_allocated(), blocks);
}

/// `idle_s = 10` with a round a second: rows updated only in round 0 are
/// kept while round 0 is under 10 s old, and gone within a lap (about
/// 10 s) after; rows updated every round stay; a round given no clock
/// (`advance_round`) evicts nothing; samples are kept in a fixed ring,
/// so nothing allocates per round. Before, `idle_s` was refused.
#[test]
fn idle_seconds_evict_rows_by_the_time_of_their_last_update() {
    const S: u64 = 1_000_000_000;
    let c = StoreConfig {
        idle_seconds: NonZeroU32::new(10),
        ..config(4, 1000)
    };
    let mut s = store(c);
    let g = grad(4, 1);
    let hot: Vec<u64> = (0..10).collect();
    for id in 0..100u64 {
        s.update(id, &g);
    }
    let mut gone_at = None;
    for round in 1..=30u64 {
        s.advance_round_at(round * S);
        for id in &hot {
            s.update(*id, &g);
        }
        if round < 10 {
            assert_eq!(s.rows_stored(), 100, "evicted before 10 s ({round} s)");
        }
        if gone_at.is_none() && s.rows_stored() == 10 {
            gone_at = Some(round);
        }
    }
    let gone_at = gone_at.expect("the idle rows went");
    assert!((10..=23).contains(&gone_at), "idle rows gone at {gone_at} s");
    assert_eq!(s.stats().evicted_idle, 90);
    assert!(hot.iter().all(|id| s.get(*id).is_some()));
    // Rounds without a clock evict nothing more.
    for id in 200..210u64 {
        s.update(id, &g);
    }
    for _ in 0..50 {
        s.advance_round();
    }
    assert_eq!(s.rows_stored(), 20);
    let both = StoreConfig {
        idle_rounds: NonZeroU32::new(3),
        ..c
    };
    assert!(RowStore::new(both, Seeded, SumCount).is_err());
}

#[test]
fn a_store_at_its_cap_has_allocated_exactly_the_memory_model() {
    for admission in [Admission::Always, Admission::AfterPushes(2)] {
        // 128-byte rows (16 values, 16 words of state): 7 blocks at 100,000.
        let c = StoreConfig {
            admission,
            ..config(16, 100_000)
        };
        let mut s = store(c);
        let g = grad(16, 0);
        let ids: Vec<u64> = (0..100_000u64)
            .map(|i| i.wrapping_mul(0x2545_F491_4F6C_DD1D))
            .collect();
        let grads: Vec<f32> = ids.iter().flat_map(|_| g.clone()).collect();
        let charged = table_bytes(&s.shape());
        assert!(s.allocated_bytes() < charged);
        s.update_batch(&ids, &grads);
        if admission != Admission::Always {
            s.update_batch(&ids, &grads);
        }
        assert_eq!(s.rows_stored(), 100_000);
        assert_eq!(s.blocks_allocated(), 7);
        // No block maker runs in this process: the store made each block.
        assert_eq!(s.stats().blocks_made_on_lcore, 7);
        assert_eq!(s.allocated_bytes(), charged, "{admission:?}");
        assert_eq!(s.stats().bytes, charged);
        // A new row at the cap evicts: no more memory.
        s.update(u64::MAX, &g);
        assert_eq!(s.allocated_bytes(), charged);
    }
}

#[test]
fn rows_grow_across_blocks_and_keep_their_values() {
    // 100,000 values and as much state: 800,000-byte rows, 2 to a block.
    let mut s = store(config(100_000, 5));
    let mut want = HashMap::new();
    for (n, id) in [0u64, u64::MAX, 7, 1 << 40, 3].into_iter().enumerate() {
        let g = grad(100_000, n as u8);
        s.update(id, &g);
        let mut r = init_row(id, 100_000);
        SumCount.apply(&mut r.0, &mut r.1, &g);
        want.insert(id, r);
        assert_eq!(s.blocks_allocated(), n / 2 + 1);
    }
    for (id, r) in &want {
        assert_eq!(bits(s.get(*id).unwrap()), bits(&r.0));
        assert_eq!(bits(s.state(*id).unwrap()), bits(&r.1));
    }
    assert_eq!(s.allocated_bytes(), table_bytes(&s.shape()));
}

#[test]
fn edge_ids_read_push_and_checkpoint_like_any_other() {
    let mut s = store(config(3, 10));
    let mut out = [0.0; 3];
    for id in [0u64, u64::MAX] {
        assert!(!s.read(id, &mut out));
        assert_eq!(bits(&out), bits(&init_row(id, 3).0));
        assert_eq!(s.update(id, &grad(3, 5)), Pushed::Created);
        assert!(s.read(id, &mut out));
    }
    assert!(s.get(1).is_none());
    let mut file = Vec::new();
    s.write_to(&mut file).unwrap();
    let r = RowStore::read_from(&file[..], config(3, 10), Seeded, SumCount).unwrap();
    assert_eq!(dump(&r), dump(&s));
    assert_eq!(
        dump(&r).iter().map(|r| r.0).collect::<Vec<_>>(),
        vec![0, u64::MAX]
    );
}

#[test]
fn a_bad_checkpoint_is_an_error_that_says_what_is_wrong() {
    let mut s = store(config(2, 10));
    for id in 0..4 {
        s.update(id, &grad(2, 1));
    }
    let mut file = Vec::new();
    s.write_to(&mut file).unwrap();
    // 56-byte header, 4 rows of 8 + 4 + 4 x 4 bytes, an 8-byte checksum.
    assert_eq!(file.len(), 56 + 4 * 28 + 8);
    let err = |bytes: &[u8], c: StoreConfig| match RowStore::read_from(bytes, c, Seeded, SumCount) {
        Ok(_) => panic!("restored a bad checkpoint"),
        Err(e) => e.to_string(),
    };
    let c = config(2, 10);
    let e = err(&file[..20], c);
    assert!(
        e.contains("truncated") && e.contains("after 20 bytes") && e.contains("the header"),
        "{e}"
    );
    let e = err(&file[..56 + 28 + 5], c);
    assert!(
        e.contains("row 1 of 4") && e.contains("expected 176 bytes"),
        "{e}"
    );
    let e = err(&file[..file.len() - 1], c);
    assert!(e.contains("the checksum"), "{e}");
    let mut bad = file.clone();
    bad[70] ^= 1;
    assert!(err(&bad, c).contains("checksum"), "{}", err(&bad, c));
    let mut bad = file.clone();
    bad[0] = b'X';
    assert!(err(&bad, c).contains("magic"), "{}", err(&bad, c));
    let e = err(&file, config(3, 10));
    assert!(e.contains("dim = 2") && e.contains("dim = 3"), "{e}");
    let e = err(&file, config(2, 3));
    assert!(e.contains("4 rows") && e.contains("cap of 3"), "{e}");
    // The same id twice (row 1 made a copy of row 0, checksum fixed by
    // rewriting: the duplicate is found before the checksum).
    let mut dup = file.clone();
    dup.copy_within(56..84, 84);
    assert!(err(&dup, c).contains("twice"), "{}", err(&dup, c));
}

#[test]
fn a_bad_config_says_which_field_and_what_is_accepted() {
    let e = RowStore::new(config(0, 10), Seeded, SumCount).unwrap_err();
    assert_eq!(e, StoreError::ZeroDim);
    let e = RowStore::new(config(2, 0), Seeded, SumCount).unwrap_err();
    assert!(
        e.to_string().contains("rows cap = 0") && e.to_string().contains("accepted 1 to"),
        "{e}"
    );
    let c = StoreConfig {
        admission: Admission::AfterPushes(1),
        ..config(2, 10)
    };
    assert!(RowStore::new(c, Seeded, SumCount)
        .unwrap_err()
        .to_string()
        .contains("admit_after = 1"));
}

/// A store restored from a checkpoint goes on exactly as the saved one:
/// the same rows, the same CLOCK victims at the cap, the same idle
/// evictions and the same admissions, bit for bit (the round, touch words,
/// both hands, the index's positions and the admission counters are
/// saved). Version 1 saved none of these: the restored store evicted
/// other rows.
#[test]
fn a_restored_store_evicts_and_admits_as_the_saved_one_would() {
    let c = StoreConfig {
        admission: Admission::AfterPushes(2),
        idle_rounds: NonZeroU32::new(3),
        ..config(2, 24)
    };
    let mut live = store(c);
    let mut x = 7u64;
    let step = |s: &mut RowStore<Seeded, SumCount>, x: &mut u64, n: u32| {
        for k in 0..n {
            *x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let id = (*x >> 40) % 60;
            s.update(id, &grad(2, (*x >> 20) as u8));
            if k % 9 == 8 {
                s.advance_round();
            }
        }
    };
    step(&mut live, &mut x, 400);
    assert!(live.stats().evicted_cap > 0 && live.stats().evicted_idle > 0 && live.stats().not_admitted > 0);
    let mut file = Vec::new();
    live.write_to(&mut file).unwrap();
    let mut restored = RowStore::read_from(&file[..], c, Seeded, SumCount).unwrap();
    assert_eq!(dump(&restored), dump(&live));
    assert_eq!(restored.round(), live.round());
    let (before, mut y) = (live.stats(), x);
    step(&mut live, &mut x, 400);
    step(&mut restored, &mut y, 400);
    assert_eq!(dump(&restored), dump(&live));
    let (a, b) = (live.stats(), restored.stats());
    assert_eq!(
        (
            a.evicted_cap - before.evicted_cap,
            a.evicted_idle - before.evicted_idle,
            a.not_admitted - before.not_admitted
        ),
        (b.evicted_cap, b.evicted_idle, b.not_admitted)
    );
    // The store's own shape is checked: the counters of another
    // admit_after are not this store's.
    let other = StoreConfig {
        admission: Admission::Always,
        ..c
    };
    let e = RowStore::read_from(&file[..], other, Seeded, SumCount)
        .unwrap_err()
        .to_string();
    assert!(e.contains("admission counters"), "{e}");
}

/// Applies `op` to `s` (a push, a read, a batch of pushes, a round).
fn apply_op(s: &mut RowStore<Seeded, SumCount>, op: &Op) {
    let d = s.dim();
    match op {
        Op::Push(id, g) => {
            s.update(*id, &grad(d, *g));
        }
        Op::Read(id) => {
            let mut out = vec![0.0; d];
            s.read(*id, &mut out);
        }
        Op::Batch(p) => {
            let ids: Vec<u64> = p.iter().map(|x| x.0).collect();
            let grads: Vec<f32> = p.iter().flat_map(|x| grad(d, x.1)).collect();
            s.update_batch(&ids, &grads);
        }
        Op::Round => {
            s.advance_round();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// A checkpoint streamed while the store goes on (pushes creating,
    /// updating and evicting rows at the cap, idle sweeps, admissions,
    /// reads between every slice) is, byte for byte, the checkpoint
    /// `write_to` wrote at the stream's start; the store itself does what
    /// a store without a stream does; the stream restores.
    #[test]
    fn a_streamed_checkpoint_is_the_store_at_its_start(
        before in prop::collection::vec(op_strategy(), 0..200),
        during in prop::collection::vec(op_strategy(), 0..200),
        slice in 1usize..200,
        cap in 1u64..40,
        dim in 1u32..5,
        admit in prop_oneof![Just(1u16), 2u16..4],
        idle in prop_oneof![Just(0u32), 1u32..4],
    ) {
        let c = drawn_config(dim, cap, admit, idle);
        let (mut s, mut plain) = (store(c), store(c));
        for op in &before {
            apply_op(&mut s, op);
            apply_op(&mut plain, op);
        }
        let mut want = Vec::new();
        s.write_to(&mut want).unwrap();
        let total = s.stream_begin().unwrap();
        prop_assert_eq!(total, want.len() as u64);
        prop_assert_eq!(s.stream_begin(), Err(StreamError::Busy));
        let mut got = Vec::new();
        let mut ops = during.iter();
        loop {
            let done = s.stream_fill(&mut got, slice).unwrap();
            if done {
                break;
            }
            // One or two operations between slices, then the rest after.
            for op in ops.by_ref().take(2) {
                apply_op(&mut s, op);
                apply_op(&mut plain, op);
            }
        }
        prop_assert!(!s.streaming());
        prop_assert_eq!(s.stream_kept(), (0, 0));
        prop_assert_eq!(got.len(), want.len());
        prop_assert!(got == want, "the streamed checkpoint differs from the store at its start");
        for op in ops {
            apply_op(&mut s, op);
            apply_op(&mut plain, op);
        }
        // The stream changed nothing the store does.
        prop_assert_eq!(dump(&s), dump(&plain));
        let (a, b) = (s.stats(), plain.stats());
        prop_assert_eq!(a, b);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        s.write_to(&mut x).unwrap();
        plain.write_to(&mut y).unwrap();
        prop_assert!(x == y, "a store that streamed a checkpoint differs from one that did not");
        let r = RowStore::read_from(&got[..], c, Seeded, SumCount).unwrap();
        let mut z = Vec::new();
        r.write_to(&mut z).unwrap();
        prop_assert!(z == want);
    }
}

#[test]
fn a_stream_is_refused_twice_ended_by_abort_and_says_when_none_runs() {
    let mut s = store(config(2, 10));
    for id in 0..6 {
        s.update(id, &grad(2, 1));
    }
    let mut out = Vec::new();
    assert_eq!(s.stream_fill(&mut out, 64), Err(StreamError::NotStarted));
    assert!(out.is_empty());
    let total = s.stream_begin().unwrap();
    assert_eq!(s.stream_begin(), Err(StreamError::Busy));
    // Pushes to rows not yet streamed are kept as they were.
    assert!(!s.stream_fill(&mut out, 1).unwrap());
    for id in 0..6 {
        s.update(id, &grad(2, 2));
    }
    let (entries, row_bytes) = s.stream_kept();
    assert!(
        entries > 0 && row_bytes > 0,
        "{entries} entries, {row_bytes} bytes kept"
    );
    s.stream_abort();
    assert!(!s.streaming());
    assert_eq!(s.stream_kept(), (0, 0));
    assert_eq!(s.stream_fill(&mut out, 64), Err(StreamError::NotStarted));
    // A new stream after an abort starts from the store as it is then.
    out.clear();
    assert_eq!(s.stream_begin().unwrap(), total);
    while !s.stream_fill(&mut out, 100).unwrap() {}
    let mut want = Vec::new();
    s.write_to(&mut want).unwrap();
    assert_eq!(out, want);
}
