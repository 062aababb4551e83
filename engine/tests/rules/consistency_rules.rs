//! The engine's async and bounded-delay rules (PROTOCOL.md §5.8), one
//! packet at a time: what is applied, what is answered, to whom, with which
//! clock, and what a checkpoint keeps.

use phub_engine::kernels::{self, Kernels};
use phub_engine::{EngineError, InstallKind, JobInstall, Shard, Verdict};
use phub_proto::checkpoint::CLOCK_HELD;
use phub_proto::layout::SlotChunk;
use phub_proto::spec::{Consistency, Optimizer};
use phub_proto::wire::{self, DropReason, MsgType, Repr};
use phub_proto::Dtype;

const TOKEN: u64 = 0x5151;

fn install(workers: u16, dtype: Dtype, optimizer: Optimizer, consistency: Consistency) -> JobInstall {
    JobInstall {
        id: 1,
        token: TOKEN,
        workers,
        dtype,
        optimizer,
        consistency,
        chunk_elems: 2,
        slots: vec![SlotChunk {
            key: 0,
            chunk: 0,
            elems: 2,
        }],
    }
}

fn shard(workers: u16, dtype: Dtype, optimizer: Optimizer, consistency: Consistency) -> Shard<u32> {
    let mut s = Shard::new(0, Kernels::best());
    s.install(
        install(workers, dtype, optimizer, consistency),
        InstallKind::Plain,
    )
    .unwrap();
    s
}

fn msg(dtype: Dtype, kind: MsgType, rank: u16, round: u32, values: &[f32]) -> Vec<u8> {
    let repr = Repr::request(kind, 1, TOKEN, rank, round, 0)
        .with_payload(dtype, values.len() as u16)
        .with_chunk(0, 0);
    repr.to_datagram(values)
}

/// Everything queued to send, as (destination rank, round field, values).
fn drain(s: &mut Shard<u32>, dtype: Dtype) -> Vec<(u32, u32, Vec<f32>)> {
    let mut out = Vec::new();
    for t in s.transmits() {
        let mut b = t.header.to_vec();
        b.extend_from_slice(t.payload);
        let (repr, payload) = wire::parse(&b).unwrap();
        assert_eq!(repr.kind, MsgType::Result);
        let mut v = vec![0f32; payload.len() / dtype.size()];
        kernels::decode(dtype, payload, &mut v);
        for to in t.to {
            out.push((to, repr.round, v.clone()));
        }
    }
    s.clear_transmits();
    out.sort_by_key(|o| o.0);
    out
}

/// Every rank's INIT (rank 0 with `init`); the barrier answers all.
fn init(s: &mut Shard<u32>, dtype: Dtype, workers: u16, values: &[f32]) {
    for r in 0..workers {
        let v: &[f32] = if r == 0 { values } else { &[] };
        s.handle(u32::from(r), &msg(dtype, MsgType::Init, r, 0, v), 0);
    }
    let out = drain(s, dtype);
    assert_eq!(
        out.len(),
        usize::from(workers),
        "INIT is a barrier answered to all"
    );
    assert!(out.iter().all(|o| o.1 == 0 && o.2 == values));
}

#[test]
fn async_sum_applies_each_push_once_and_answers_the_pusher_alone() {
    for dtype in Dtype::ALL {
        let mut s = shard(3, dtype, Optimizer::Sum, Consistency::Async);
        init(&mut s, dtype, 3, &[1.0, 2.0]);
        let push = |r: u16, c: u32, v: &[f32]| msg(dtype, MsgType::Push, r, c, v);
        assert_eq!(s.handle(1, &push(1, 1, &[10.0, 20.0]), 1), Verdict::Applied);
        assert_eq!(drain(&mut s, dtype), [(1, 1, vec![11.0, 22.0])]);
        // Rank 1 runs ahead: no one waits in async.
        assert_eq!(s.handle(1, &push(1, 2, &[1.0, 1.0]), 2), Verdict::Applied);
        assert_eq!(drain(&mut s, dtype), [(1, 2, vec![12.0, 23.0])]);
        // A retransmission of an applied clock is answered, not applied.
        assert_eq!(s.handle(1, &push(1, 1, &[10.0, 20.0]), 3), Verdict::Resent);
        assert_eq!(s.handle(1, &push(1, 2, &[1.0, 1.0]), 3), Verdict::Resent);
        assert_eq!(
            drain(&mut s, dtype),
            [(1, 1, vec![12.0, 23.0]), (1, 2, vec![12.0, 23.0])]
        );
        // A gap in the clocks is refused.
        assert_eq!(
            s.handle(2, &push(2, 2, &[5.0, 5.0]), 4),
            Verdict::Dropped(DropReason::Ahead)
        );
        s.clear_transmits();
        assert_eq!(s.handle(2, &push(2, 1, &[-2.0, 0.0]), 5), Verdict::Applied);
        assert_eq!(drain(&mut s, dtype), [(2, 1, vec![10.0, 23.0])]);
        // PULL: current values, with the rank's own clock.
        let pull = msg(dtype, MsgType::Pull, 0, 0, &[]);
        assert_eq!(s.handle(0, &pull, 6), Verdict::Pulled);
        assert_eq!(drain(&mut s, dtype), [(0, 0, vec![10.0, 23.0])]);
        let pull = msg(dtype, MsgType::Pull, 1, 0, &[]);
        assert_eq!(s.handle(1, &pull, 6), Verdict::Pulled);
        assert_eq!(drain(&mut s, dtype), [(1, 2, vec![10.0, 23.0])]);
        assert_eq!(s.result(1, 0).unwrap().0, 3, "three updates applied");
    }
}

#[test]
fn async_sgd_steps_on_each_gradient_alone() {
    let sgd = Optimizer::Sgd {
        lr: 0.5,
        weight_decay: 0.0,
    };
    let mut s = shard(2, Dtype::F32, sgd, Consistency::Async);
    init(&mut s, Dtype::F32, 2, &[4.0, 4.0]);
    s.handle(1, &msg(Dtype::F32, MsgType::Push, 1, 1, &[2.0, -2.0]), 1);
    assert_eq!(drain(&mut s, Dtype::F32), [(1, 1, vec![3.0, 5.0])]);
    s.handle(0, &msg(Dtype::F32, MsgType::Push, 0, 1, &[2.0, 2.0]), 1);
    assert_eq!(drain(&mut s, Dtype::F32), [(0, 1, vec![2.0, 4.0])]);
    assert_eq!(s.params(1, 0).unwrap(), [2.0, 4.0]);
}

#[test]
fn bounded_delay_holds_answers_until_the_slowest_catches_up() {
    let tau = 1;
    let mut s = shard(3, Dtype::F32, Optimizer::Sum, Consistency::Bounded { delay: tau });
    init(&mut s, Dtype::F32, 3, &[0.0, 0.0]);
    let push = |r: u16, c: u32| msg(Dtype::F32, MsgType::Push, r, c, &[1.0, 0.0]);
    // Clock 1 is within τ = 1 of the slowest (0): answered at once.
    assert_eq!(s.handle(0, &push(0, 1), 1_000), Verdict::Applied);
    assert_eq!(drain(&mut s, Dtype::F32), [(0, 1, vec![1.0, 0.0])]);
    // Clock 2 would be 2 ahead of ranks 1 and 2: applied, answer held.
    assert_eq!(s.handle(0, &push(0, 2), 2_000), Verdict::Held);
    assert!(drain(&mut s, Dtype::F32).is_empty());
    assert_eq!(s.counters().answers_held.get(), 1);
    // Its retransmission is neither applied nor answered; its next clock
    // is ahead (it has no answer to push from).
    assert_eq!(
        s.handle(0, &push(0, 2), 3_000),
        Verdict::Dropped(DropReason::Duplicate)
    );
    assert_eq!(
        s.handle(0, &push(0, 3), 3_000),
        Verdict::Dropped(DropReason::Ahead)
    );
    s.clear_transmits();
    // PULL says clock 1: the last answered.
    s.handle(0, &msg(Dtype::F32, MsgType::Pull, 0, 0, &[]), 3_000);
    assert_eq!(drain(&mut s, Dtype::F32), [(0, 1, vec![2.0, 0.0])]);
    // Rank 1 reaches clock 1, rank 2 is still at 0: still held.
    assert_eq!(s.handle(1, &push(1, 1), 4_000), Verdict::Applied);
    assert_eq!(drain(&mut s, Dtype::F32), [(1, 1, vec![3.0, 0.0])]);
    // Rank 2's clock 1 raises the slowest to 1: rank 0's answer goes, with
    // the values current now, beside rank 2's own.
    assert_eq!(s.handle(2, &push(2, 1), 9_000), Verdict::Applied);
    assert_eq!(
        drain(&mut s, Dtype::F32),
        [(0, 2, vec![4.0, 0.0]), (2, 1, vec![4.0, 0.0])]
    );
    let c = s.counters();
    assert_eq!(
        (c.answers_released.get(), c.held_wait_us.get()),
        (1, 7),
        "held from 2 µs to 9 µs"
    );
    let st = &s.job_stats()[0];
    assert_eq!(st.clocks, [(2, 2), (1, 1), (1, 1)]);
    assert_eq!((st.max_lead, st.held), (Some(2), 0), "τ + 1 at most");
    assert_eq!(
        (st.held_total, st.held_wait_us, st.held_wait_max_us),
        (1, 7, 7),
        "the job's own count of held answers and their waits"
    );
    // The released rank's retransmission is now answered.
    assert_eq!(s.handle(0, &push(0, 2), 9_500), Verdict::Resent);
    assert_eq!(drain(&mut s, Dtype::F32), [(0, 2, vec![4.0, 0.0])]);
}

#[test]
fn bounded_delay_zero_gives_every_rank_the_same_values_each_clock() {
    let sgd = Optimizer::Sgd {
        lr: 0.25,
        weight_decay: 0.0,
    };
    let w = 4u16;
    let mut s = shard(w, Dtype::F32, sgd, Consistency::Bounded { delay: 0 });
    init(&mut s, Dtype::F32, w, &[8.0, -8.0]);
    let mut want = [8.0f32, -8.0];
    for clock in 1..=5u32 {
        let mut sum = [0.0f32; 2];
        for r in (0..w).rev() {
            let g = [f32::from(r) + clock as f32, -(clock as f32)];
            sum[0] += g[0];
            sum[1] += g[1];
            let v = s.handle(u32::from(r), &msg(Dtype::F32, MsgType::Push, r, clock, &g), 0);
            assert_eq!(v, if r == 0 { Verdict::Applied } else { Verdict::Held });
        }
        want = [want[0] - 0.25 * sum[0], want[1] - 0.25 * sum[1]];
        let out = drain(&mut s, Dtype::F32);
        assert_eq!(out.len(), usize::from(w));
        for (r, (to, round, v)) in out.into_iter().enumerate() {
            assert_eq!((to, round), (r as u32, clock));
            assert_eq!(v, want, "BSP-sum then SGD with the same lr");
        }
    }
}

/// PROTOCOL.md §5.8 rule 1: a rank whose answer is held and that repeats
/// an older clock (after a pull) is answered when that clock is within τ
/// of the slowest; the held clock itself stays a duplicate. Dropped, the
/// older clock waited for a release that needed this rank's later clocks
/// on other chunks (the simulator's seed 4155).
#[test]
fn an_older_clock_of_a_held_rank_is_answered_within_tau() {
    let dtype = Dtype::F32;
    let mut s = shard(2, dtype, Optimizer::Sum, Consistency::Bounded { delay: 0 });
    init(&mut s, dtype, 2, &[1.0, 1.0]);
    for rank in 0..2 {
        s.handle(
            u32::from(rank),
            &msg(dtype, MsgType::Push, rank, 1, &[1.0, 1.0]),
            0,
        );
    }
    assert_eq!(drain(&mut s, dtype).len(), 2, "clock 1 answered to both");
    // Rank 0's clock 2 is held: rank 1 is at 1.
    assert_eq!(
        s.handle(0, &msg(dtype, MsgType::Push, 0, 2, &[1.0, 1.0]), 0),
        Verdict::Held
    );
    // Its clock 1 again: within τ of the slowest (1), answered.
    assert_eq!(
        s.handle(0, &msg(dtype, MsgType::Push, 0, 1, &[1.0, 1.0]), 0),
        Verdict::Resent
    );
    assert_eq!(drain(&mut s, dtype), [(0, 1, vec![4.0, 4.0])]);
    // Its clock 2 again: the held one, a duplicate, nothing sent.
    assert_eq!(
        s.handle(0, &msg(dtype, MsgType::Push, 0, 2, &[1.0, 1.0]), 0),
        Verdict::Dropped(DropReason::Duplicate)
    );
    assert!(drain(&mut s, dtype).is_empty());
}

#[test]
fn a_snapshot_keeps_the_clocks_and_held_answers() {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let mode = Consistency::Bounded { delay: 0 };
        let mut s = shard(2, dtype, Optimizer::Sum, mode);
        init(&mut s, dtype, 2, &[1.0, 1.0]);
        s.handle(0, &msg(dtype, MsgType::Push, 0, 1, &[2.0, 2.0]), 0);
        assert!(drain(&mut s, dtype).is_empty(), "held");
        let snap = s.snapshot(1).unwrap();
        assert_eq!(snap[0].clocks, [1 | CLOCK_HELD, 0]);
        let mut t = shard(2, dtype, Optimizer::Sum, mode);
        t.restore(1, &snap).unwrap();
        // Each rank pulls first (PROTOCOL.md §5.4 rule 0): rank 0, held,
        // learns clock 0, rank 1 clock 0.
        for rank in 0..2 {
            assert_eq!(
                t.handle(u32::from(rank), &msg(dtype, MsgType::Pull, rank, 0, &[]), 0),
                Verdict::Pulled
            );
        }
        let pulled: Vec<(u32, u32)> = drain(&mut t, dtype)
            .into_iter()
            .map(|(to, r, _)| (to, r))
            .collect();
        assert_eq!(pulled, [(0, 0), (1, 0)]);
        // The held answer stays held after the restart, and goes when rank
        // 1 pushes, with the values summed on the restored ones.
        assert_eq!(
            t.handle(0, &msg(dtype, MsgType::Push, 0, 1, &[2.0, 2.0]), 0),
            Verdict::Dropped(DropReason::Duplicate)
        );
        assert_eq!(
            t.handle(1, &msg(dtype, MsgType::Push, 1, 1, &[4.0, 4.0]), 0),
            Verdict::Applied
        );
        assert_eq!(
            drain(&mut t, dtype),
            [(0, 1, vec![7.0, 7.0]), (1, 1, vec![7.0, 7.0])]
        );
        // A BSP job's snapshot has no clocks, and does not restore into
        // an async job of the same shape.
        let bsp = shard(2, dtype, Optimizer::Sum, Consistency::Sync);
        let e = t.restore(1, &bsp.snapshot(1).unwrap()).unwrap_err();
        assert!(matches!(e, EngineError::Restore { .. }), "{e}");
    }
}

#[test]
fn modes_that_do_not_fit_are_refused_at_install() {
    let mut s: Shard<u32> = Shard::new(0, Kernels::best());
    let e = s
        .install(
            install(2, Dtype::F32, Optimizer::Mean, Consistency::Async),
            InstallKind::Plain,
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("consistency async") && e.to_string().contains("sum"),
        "{e}"
    );
    assert_eq!(s.job_ids().count(), 0);
}

/// A job's clocks are charged as admission counts them: one [`RankClock`]
/// per slot and rank, BSP jobs none.
#[test]
fn clocks_are_charged_what_they_take() {
    let mut a: Shard<u32> = Shard::new(0, Kernels::best());
    let mut b: Shard<u32> = Shard::new(0, Kernels::best());
    a.install(
        install(5, Dtype::F32, Optimizer::Sum, Consistency::Sync),
        InstallKind::Plain,
    )
    .unwrap();
    b.install(
        install(5, Dtype::F32, Optimizer::Sum, Consistency::Async),
        InstallKind::Plain,
    )
    .unwrap();
    let per = phub_engine::engine::memory_model(a.slot_memory()).clock_bytes;
    assert_eq!(
        per as usize,
        std::mem::size_of::<phub_engine::engine::RankClock>()
    );
    assert_eq!(
        b.job_memory_bytes(1).unwrap() - a.job_memory_bytes(1).unwrap(),
        5 * u64::from(per)
    );
}
