//! The engine with shared-memory regions (PROTOCOL.md §3.4), real files in
//! /dev/shm: workers open their staging regions as a worker would, leave
//! chunks there and send headers with the SHM flag; results come back as
//! headers and are read from the result region. Region names carry a base
//! port made from this process's id and a job id per test, so tests running
//! side by side never share a file.

use std::path::PathBuf;

use phub_engine::kernels::{self, Kernels};
use phub_engine::{EngineError, InstallKind, JobInstall, Shard, ShmSetup, Verdict};
use phub_net::shm::ShmRegion;
use phub_proto::layout::SlotChunk;
use phub_proto::shm::{region_len, region_path, slot_offset, Part};
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, flags, DropReason, MsgType, Repr, APPLIANCE_RANK};
use phub_proto::Dtype;

const TOKEN: u64 = 0x5eed_0000_1234;
/// The regions are laid out for chunks of this many elements; the job's
/// slots here are shorter (a key shorter than a chunk), so offsets follow
/// the layout's chunk length, not the slots'.
const CHUNK: u32 = 40;
const ELEMS: [u32; 2] = [20, 7];

fn base_port() -> u16 {
    (20_000 + std::process::id() % 40_000) as u16
}

fn setup() -> ShmSetup {
    ShmSetup {
        base_port: base_port(),
        chunk_elems: CHUNK,
    }
}

fn job(id: u16, workers: u16, dtype: Dtype, optimizer: Optimizer) -> JobInstall {
    JobInstall {
        id,
        token: TOKEN,
        workers,
        dtype,
        optimizer,
        consistency: Default::default(),
        chunk_elems: CHUNK,
        slots: ELEMS
            .iter()
            .enumerate()
            .map(|(c, &elems)| SlotChunk {
                key: 0,
                chunk: c as u32,
                elems,
            })
            .collect(),
    }
}

fn path(id: u16, part: Part) -> PathBuf {
    region_path(base_port(), id, TOKEN, 3, part)
}

/// A worker's view of a job's regions on lcore 3.
struct Worker {
    staging: ShmRegion,
    results: ShmRegion,
    dtype: Dtype,
}

impl Worker {
    fn open(id: u16, rank: u16, dtype: Dtype) -> Worker {
        let len = region_len(ELEMS.len(), CHUNK, dtype);
        Worker {
            staging: ShmRegion::open(&path(id, Part::Staging(rank)), len).unwrap(),
            results: ShmRegion::open(&path(id, Part::Results), len).unwrap(),
            dtype,
        }
    }

    fn stage(&self, slot: u32, values: &[f32]) {
        let mut b = vec![0u8; values.len() * self.dtype.size()];
        kernels::encode(self.dtype, values, &mut b);
        assert!(self.staging.write(slot_offset(slot, CHUNK, self.dtype), &b));
    }

    fn result(&self, slot: u32) -> Vec<f32> {
        let n = ELEMS[slot as usize] as usize;
        let mut b = vec![0u8; n * self.dtype.size()];
        assert!(self.results.read(slot_offset(slot, CHUNK, self.dtype), &mut b));
        let mut v = vec![0f32; n];
        kernels::decode(self.dtype, &b, &mut v);
        v
    }
}

/// A header (and with `payload`, the values after it).
fn msg(job: u16, kind: MsgType, rank: u16, round: u32, slot: u32, shm: bool, dtype: Dtype) -> Vec<u8> {
    msg_with(job, kind, rank, round, slot, shm, dtype, None)
}

#[allow(clippy::too_many_arguments)]
fn msg_with(
    job: u16,
    kind: MsgType,
    rank: u16,
    round: u32,
    slot: u32,
    shm: bool,
    dtype: Dtype,
    payload: Option<&[f32]>,
) -> Vec<u8> {
    let carries = kind == MsgType::Push || (kind == MsgType::Init && rank == 0);
    let count = if carries { ELEMS[slot as usize] } else { 0 };
    let repr = Repr::request(kind, job, TOKEN, rank, round, slot)
        .with_payload(dtype, count as u16)
        .with_chunk(0, slot)
        .with_flags(if shm { flags::SHM } else { 0 });
    repr.to_datagram(if !shm && carries {
        payload.expect("a datagram payload")
    } else {
        &[]
    })
}

/// Everything queued to send, as (destination, header, payload bytes).
fn drain(s: &mut Shard<u32>) -> Vec<(u32, Repr, Vec<u8>)> {
    let mut out = Vec::new();
    for t in s.transmits() {
        let mut b = t.header.to_vec();
        b.extend_from_slice(t.payload);
        let (repr, payload) = wire::parse(&b).unwrap();
        for to in t.to {
            out.push((to, repr, payload.to_vec()));
        }
    }
    s.clear_transmits();
    out.sort_by_key(|o| (o.1.slot, o.0));
    out
}

/// Values rank `rank` pushes for `slot` in `round`: small integers and
/// halves, so every sum is exact in f32 and in bf16.
fn grad(rank: u16, round: u32, slot: u32) -> Vec<f32> {
    (0..ELEMS[slot as usize])
        .map(|e| (e as f32 - 3.0) * 0.5 + f32::from(rank) * 2.0 + round as f32 + slot as f32 * 8.0)
        .collect()
}

fn encoded(dtype: Dtype, v: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; v.len() * dtype.size()];
    kernels::encode(dtype, v, &mut b);
    b
}

#[test]
fn pushes_through_shared_memory_sum_exactly_into_the_result_region() {
    for (id, dtype) in [(11, Dtype::F32), (12, Dtype::Bf16)] {
        const W: u16 = 3;
        let mut s: Shard<u32> = Shard::new(3, Kernels::best());
        s.install(job(id, W, dtype, Optimizer::Sum), InstallKind::Shared(setup()))
            .unwrap();
        let workers: Vec<Worker> = (0..W).map(|r| Worker::open(id, r, dtype)).collect();
        for round in 0..3u32 {
            for slot in 0..2 {
                for rank in 0..W {
                    let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
                    if round > 0 || rank == 0 {
                        workers[usize::from(rank)].stage(slot, &grad(rank, round, slot));
                    }
                    let v = s.handle(u32::from(rank), &msg(id, kind, rank, round, slot, true, dtype), 1);
                    let want = if rank == W - 1 {
                        Verdict::Completed
                    } else {
                        Verdict::Aggregated
                    };
                    assert_eq!(v, want, "{dtype:?} round {round} slot {slot} rank {rank}");
                }
            }
            let sent = drain(&mut s);
            assert_eq!(sent.len(), 2 * usize::from(W), "every rank, both slots");
            for (to, repr, payload) in &sent {
                assert_eq!(repr.kind, MsgType::Result);
                assert_eq!(repr.flags, flags::SHM, "headers only, to rank {to}");
                assert!(payload.is_empty());
                assert_eq!(repr.rank, APPLIANCE_RANK);
                assert_eq!(repr.round, round);
                assert_eq!(u32::from(repr.count), ELEMS[repr.slot as usize]);
            }
            for slot in 0..2 {
                let want: Vec<f32> = if round == 0 {
                    grad(0, 0, slot)
                } else {
                    let g: Vec<Vec<f32>> = (0..W).map(|r| grad(r, round, slot)).collect();
                    (0..g[0].len()).map(|e| g.iter().map(|v| v[e]).sum()).collect()
                };
                for w in &workers {
                    assert_eq!(w.result(slot), want, "{dtype:?} round {round} slot {slot}");
                }
                // The region holds exactly the stored result.
                let (r, bytes) = s.result(id, slot).unwrap();
                assert_eq!((r, bytes), (round, &encoded(dtype, &want)[..]));
            }
        }
        assert_eq!(s.counters().shm_rx.get(), 3 * 2 * u64::from(W));
        assert_eq!(s.counters().drops_total(), 0);
    }
}

#[test]
fn ranks_with_and_without_shared_memory_each_get_their_form() {
    let id = 21;
    let dtype = Dtype::F32;
    let mut s: Shard<u32> = Shard::new(3, Kernels::best());
    let opt = Optimizer::Sgd {
        lr: 0.5,
        weight_decay: 0.0,
    };
    s.install(job(id, 2, dtype, opt), InstallKind::Shared(setup()))
        .unwrap();
    let w0 = Worker::open(id, 0, dtype);
    for round in 0..3u32 {
        let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
        // Rank 0 through shared memory, rank 1 in datagrams.
        w0.stage(0, &grad(0, round, 0));
        assert_eq!(
            s.handle(100, &msg(id, kind, 0, round, 0, true, dtype), 1),
            Verdict::Aggregated
        );
        let g1 = grad(1, round, 0);
        let m1 = msg_with(
            id,
            kind,
            1,
            round,
            0,
            false,
            dtype,
            (round > 0).then_some(&g1[..]),
        );
        assert_eq!(s.handle(101, &m1, 1), Verdict::Completed);
        let sent = drain(&mut s);
        let (_, stored) = s.result(id, 0).unwrap();
        assert_eq!(sent.len(), 2);
        assert_eq!((sent[0].0, sent[0].1.flags), (100, flags::SHM));
        assert!(sent[0].2.is_empty());
        assert_eq!((sent[1].0, sent[1].1.flags), (101, 0));
        assert_eq!(sent[1].2, stored, "the payload is the stored result");
        assert_eq!(encoded(dtype, &w0.result(0)), stored, "and so is the region");
        assert_eq!(sent[0].1.round, round);
        assert_eq!(sent[1].1.round, round);
    }
    // SGD keeps the parameters: w = init - 0.5 * mean(g) per round.
    let mut w = grad(0, 0, 0);
    for round in 1..3 {
        let (a, b) = (grad(0, round, 0), grad(1, round, 0));
        for e in 0..w.len() {
            w[e] -= 0.5 * ((a[e] + b[e]) * 0.5);
        }
    }
    assert_eq!(w0.result(0), w);
}

#[test]
fn the_shm_flag_on_a_job_without_regions_is_dropped_after_the_token_check() {
    let dtype = Dtype::F32;
    let mut s: Shard<u32> = Shard::new(3, Kernels::best());
    s.install(job(31, 2, dtype, Optimizer::Sum), InstallKind::Plain)
        .unwrap();
    assert_eq!(s.shm_paths(31), None);
    assert!(
        !path(31, Part::Results).exists(),
        "a plain install creates no file"
    );
    let m = msg(31, MsgType::Init, 0, 0, 0, true, dtype);
    assert_eq!(s.handle(1, &m, 1), Verdict::Dropped(DropReason::NoSharedMemory));
    // Even from a rank the job does not have: the flag is checked first.
    let m = msg(31, MsgType::Init, 9, 0, 0, true, dtype);
    assert_eq!(s.handle(1, &m, 1), Verdict::Dropped(DropReason::NoSharedMemory));
    let mut bad = msg(31, MsgType::Init, 0, 0, 0, true, dtype);
    bad[8] ^= 1; // the token
    assert_eq!(s.handle(1, &bad, 1), Verdict::Dropped(DropReason::BadToken));
    let m = msg(32, MsgType::Init, 0, 0, 0, true, dtype);
    assert_eq!(s.handle(1, &m, 1), Verdict::Dropped(DropReason::UnknownJob));
    assert!(drain(&mut s).is_empty(), "no ERROR for any of these");
    let c = s.counters();
    assert_eq!(c.drops_of(DropReason::NoSharedMemory), 2);
    assert_eq!(c.shm_rx.get(), 0);
    // A job with regions checks the rank after the flag.
    s.install(job(33, 2, dtype, Optimizer::Sum), InstallKind::Shared(setup()))
        .unwrap();
    let m = msg(33, MsgType::Init, 2, 0, 0, true, dtype);
    assert_eq!(s.handle(1, &m, 1), Verdict::Dropped(DropReason::RankOutOfRange));
}

#[test]
fn a_duplicate_shm_push_is_dropped_and_a_lost_result_is_resent_as_a_header() {
    let id = 41;
    let dtype = Dtype::F32;
    let mut s: Shard<u32> = Shard::new(3, Kernels::best());
    s.install(job(id, 2, dtype, Optimizer::Sum), InstallKind::Shared(setup()))
        .unwrap();
    let w: Vec<Worker> = (0..2).map(|r| Worker::open(id, r, dtype)).collect();
    assert_eq!(
        s.handle(10, &msg(id, MsgType::Pull, 0, 0, 1, true, dtype), 1),
        Verdict::Dropped(DropReason::NothingToPull)
    );
    for rank in 0..2u16 {
        if rank == 0 {
            w[0].stage(1, &grad(0, 0, 1));
        }
        s.handle(
            10 + u32::from(rank),
            &msg(id, MsgType::Init, rank, 0, 1, true, dtype),
            1,
        );
    }
    drain(&mut s);
    w[0].stage(1, &grad(0, 1, 1));
    let push0 = msg(id, MsgType::Push, 0, 1, 1, true, dtype);
    assert_eq!(s.handle(10, &push0, 1), Verdict::Aggregated);
    // Rank 0 sends again, its chunk untouched: the copy is a duplicate.
    assert_eq!(s.handle(10, &push0, 1), Verdict::Dropped(DropReason::Duplicate));
    assert!(drain(&mut s).is_empty());
    w[1].stage(1, &grad(1, 1, 1));
    assert_eq!(
        s.handle(11, &msg(id, MsgType::Push, 1, 1, 1, true, dtype), 1),
        Verdict::Completed
    );
    drain(&mut s);
    let want: Vec<f32> = grad(0, 1, 1)
        .iter()
        .zip(grad(1, 1, 1))
        .map(|(a, b)| a + b)
        .collect();
    assert_eq!(w[1].result(1), want);
    // Rank 1 lost the result and pushes again: a header to it alone.
    assert_eq!(
        s.handle(11, &msg(id, MsgType::Push, 1, 1, 1, true, dtype), 1),
        Verdict::Resent
    );
    let sent = drain(&mut s);
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].0, sent[0].1.flags, sent[0].1.round), (11, flags::SHM, 1));
    assert!(sent[0].2.is_empty());
    // A PULL with the flag is answered the same way; one without it
    // switches the rank back to payloads.
    assert_eq!(
        s.handle(10, &msg(id, MsgType::Pull, 0, 7, 1, true, dtype), 1),
        Verdict::Pulled
    );
    assert_eq!(
        s.handle(
            12,
            &msg_with(id, MsgType::Pull, 1, 7, 1, false, dtype, Some(&[])),
            1
        ),
        Verdict::Pulled
    );
    let sent = drain(&mut s);
    assert_eq!(sent.len(), 2);
    assert_eq!((sent[0].0, sent[0].1.flags), (10, flags::SHM));
    assert_eq!((sent[1].0, sent[1].1.flags), (12, 0));
    assert_eq!(sent[1].2, encoded(dtype, &want));
    assert_eq!(s.counters().drops_of(DropReason::Duplicate), 1);
    // Rank 1's push resent a result; the two PULLs are counted apart.
    assert_eq!(s.counters().results_resent.get(), 1);
    assert_eq!(s.counters().pulls_answered.get(), 2);
}

#[test]
fn regions_exist_while_the_job_is_installed_and_a_failed_install_leaves_none() {
    let id = 51;
    let dtype = Dtype::F16;
    let all = |id| -> Vec<PathBuf> {
        (0..3)
            .map(|r| path(id, Part::Staging(r)))
            .chain([path(id, Part::Results)])
            .collect()
    };
    let mut s: Shard<u32> = Shard::new(3, Kernels::best());
    s.install(job(id, 3, dtype, Optimizer::Mean), InstallKind::Shared(setup()))
        .unwrap();
    assert_eq!(s.shm_paths(id), Some(all(id)));
    for p in all(id) {
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len() as usize, region_len(2, CHUNK, dtype), "{}", p.display());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
    }
    assert!(s.remove(id));
    assert!(
        all(id).iter().all(|p| !p.exists()),
        "removing the job removes its files"
    );

    // Slots longer than the chunk length the regions are laid out for.
    let short = ShmSetup {
        chunk_elems: 10,
        ..setup()
    };
    let e = s
        .install(job(id, 3, dtype, Optimizer::Mean), InstallKind::Shared(short))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("slot 0 has 20 elements, more than the chunk length 10"),
        "{e}"
    );
    assert_eq!(s.job_ids().count(), 0);

    // The result region cannot be created (a directory has its name): the
    // staging regions made before it go again, and nothing is installed.
    let blocker = path(id, Part::Results);
    std::fs::create_dir(&blocker).unwrap();
    let e = s
        .install(job(id, 3, dtype, Optimizer::Mean), InstallKind::Shared(setup()))
        .unwrap_err();
    std::fs::remove_dir(&blocker).unwrap();
    assert!(matches!(e, EngineError::SharedMemory { id: 51, .. }), "{e:?}");
    assert!(e.to_string().contains(&blocker.display().to_string()), "{e}");
    assert_eq!(s.job_ids().count(), 0);
    assert!(all(id).iter().all(|p| !p.exists()), "nothing left behind");

    // A stale file of the same name but another length (a dataplane on
    // this port that died, a job of another shape) is replaced; dropping
    // the shard removes the files.
    std::fs::write(path(id, Part::Staging(1)), b"stale").unwrap();
    s.install(job(id, 3, dtype, Optimizer::Mean), InstallKind::Shared(setup()))
        .unwrap();
    assert_eq!(
        std::fs::metadata(path(id, Part::Staging(1))).unwrap().len() as usize,
        region_len(2, CHUNK, dtype)
    );
    drop(s);
    assert!(all(id).iter().all(|p| !p.exists()));

    // A job with no slots on this lcore has no files, but still takes SHM
    // messages as far as the slot check.
    let mut s: Shard<u32> = Shard::new(3, Kernels::best());
    let mut empty = job(id, 3, dtype, Optimizer::Mean);
    empty.slots.clear();
    s.install(empty, InstallKind::Shared(setup())).unwrap();
    assert_eq!(s.shm_paths(id), Some(vec![]));
    assert!(all(id).iter().all(|p| !p.exists()));
    let mut m = msg(id, MsgType::Pull, 0, 0, 0, true, dtype);
    wire::Header::new_unchecked(&mut m[..]).set_slot(5);
    assert_eq!(s.handle(1, &m, 1), Verdict::Dropped(DropReason::SlotOutOfRange));
}

#[test]
fn a_restored_job_has_its_results_in_the_result_region() {
    let id = 61;
    let dtype = Dtype::Bf16;
    let adam = Optimizer::Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    // Two rounds on a plain shard, in datagrams.
    let mut a: Shard<u32> = Shard::new(3, Kernels::best());
    a.install(job(id, 2, dtype, adam), InstallKind::Plain).unwrap();
    for round in 0..2u32 {
        for slot in 0..2 {
            for rank in 0..2u16 {
                let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
                let g = grad(rank, round, slot);
                let carries = round > 0 || rank == 0;
                let m = msg_with(
                    id,
                    kind,
                    rank,
                    round,
                    slot,
                    false,
                    dtype,
                    Some(if carries { &g } else { &[] }),
                );
                assert!(!matches!(a.handle(u32::from(rank), &m, 1), Verdict::Dropped(_)));
            }
        }
        drain(&mut a);
    }
    let saved = a.snapshot(id).unwrap();
    let mut b: Shard<u32> = Shard::new(3, Kernels::best());
    b.install(job(id, 2, dtype, adam), InstallKind::Shared(setup()))
        .unwrap();
    b.restore(id, &saved).unwrap();
    let w = Worker::open(id, 1, dtype);
    for slot in 0..2 {
        let (round, stored) = a.result(id, slot).unwrap();
        assert_eq!(round, 1);
        assert_eq!(encoded(dtype, &w.result(slot)), stored, "slot {slot}");
        assert_eq!(
            b.handle(7, &msg(id, MsgType::Pull, 1, 0, slot, true, dtype), 1),
            Verdict::Pulled
        );
    }
    let sent = drain(&mut b);
    assert_eq!(sent.len(), 2);
    assert!(sent
        .iter()
        .all(|(to, r, p)| *to == 7 && r.flags == flags::SHM && r.round == 1 && p.is_empty()));
}

/// Values with rounding in every sum (unlike [`grad`]), so that a sum taken
/// in another order or rounded differently would show.
fn rough(rank: u16, round: u32, slot: u32) -> Vec<f32> {
    (0..ELEMS[slot as usize])
        .map(|e| {
            let x = e as f32 * 0.37 + f32::from(rank) * 1.13 + round as f32 * 0.71 + slot as f32;
            x.sin() * 100.0 + 1.0 / 3.0
        })
        .collect()
}

/// Feeds the same f32 contributions to a plain shard (datagrams only) and
/// to one with regions, where rank `r` sends through shared memory when
/// `shm[r]`, the ranks arriving in `order`; after every round the region,
/// the stored result, every RESULT payload and every header must be what
/// the plain shard gives, bit for bit. Returns both shards.
fn against_plain(
    id: u16,
    opt: Optimizer,
    shm: &[bool],
    order: &[u16],
    rounds: u32,
) -> (Shard<u32>, Shard<u32>) {
    let dtype = Dtype::F32;
    let w = shm.len() as u16;
    let mut plain: Shard<u32> = Shard::new(3, Kernels::best());
    plain.install(job(id, w, dtype, opt), InstallKind::Plain).unwrap();
    let mut s: Shard<u32> = Shard::new(3, Kernels::best());
    s.install(job(id, w, dtype, opt), InstallKind::Shared(setup()))
        .unwrap();
    let workers: Vec<Worker> = (0..w).map(|r| Worker::open(id, r, dtype)).collect();
    let what = format!("{} shm {shm:?} order {order:?}", opt.name());
    for round in 0..rounds {
        let kind = if round == 0 { MsgType::Init } else { MsgType::Push };
        for slot in 0..2 {
            for (i, &rank) in order.iter().enumerate() {
                let g = rough(rank, round, slot);
                let carries = round > 0 || rank == 0;
                let vals = Some(if carries { &g[..] } else { &[] });
                let m = msg_with(id, kind, rank, round, slot, false, dtype, vals);
                let want = plain.handle(u32::from(rank), &m, 1);
                let via_shm = shm[usize::from(rank)];
                if via_shm && carries {
                    workers[usize::from(rank)].stage(slot, &g);
                }
                let m = msg_with(id, kind, rank, round, slot, via_shm, dtype, vals);
                let got = s.handle(u32::from(rank), &m, 1);
                assert_eq!(got, want, "{what} round {round} slot {slot} rank {rank}");
                let last = i + 1 == order.len();
                assert_eq!(got == Verdict::Completed, last, "{what}");
            }
        }
        let want = drain(&mut plain);
        let got = drain(&mut s);
        assert_eq!(got.len(), want.len(), "{what} round {round}");
        for ((to, r, p), (wto, wr, wp)) in got.iter().zip(&want) {
            assert_eq!((to, r.slot, r.round, r.count), (wto, wr.slot, wr.round, wr.count));
            if shm[*to as usize] {
                assert_eq!((r.flags, p.len()), (flags::SHM, 0), "{what} to {to}");
            } else {
                assert_eq!((r.flags, p), (0, wp), "{what} round {round} to {to}");
            }
        }
        for slot in 0..2 {
            let want = plain.result(id, slot).unwrap();
            assert_eq!(
                s.result(id, slot).unwrap(),
                want,
                "{what} round {round} slot {slot}"
            );
            for wk in &workers {
                assert_eq!(encoded(dtype, &wk.result(slot)), want.1, "{what} round {round}");
            }
        }
    }
    assert_eq!(s.counters().drops_total(), 0);
    (plain, s)
}

#[test]
fn f32_sum_and_mean_through_the_result_region_match_plain_datagrams_bit_for_bit() {
    let mut id = 70;
    for opt in [Optimizer::Sum, Optimizer::Mean] {
        let cases: [(&[bool], &[u16]); 10] = [
            (&[true], &[0]),
            (&[false], &[0]),
            (&[true, true], &[0, 1]),
            (&[true, true], &[1, 0]),
            (&[true, false], &[0, 1]),
            (&[true, false], &[1, 0]),
            (&[true, true, true], &[2, 0, 1]),
            (&[true, false, true], &[0, 1, 2]),
            (&[false, true, true], &[0, 1, 2]),
            (&[false, true, false], &[2, 1, 0]),
        ];
        for (shm, order) in cases {
            id += 1;
            against_plain(id, opt, shm, order, 4);
        }
    }
}

#[test]
fn a_result_that_lives_only_in_the_region_is_resent_and_pulled_after_the_next_round_began() {
    let id = 91;
    let dtype = Dtype::F32;
    // Rank 0 by shared memory, rank 1 in datagrams; mean of two.
    let (plain, mut s) = against_plain(id, Optimizer::Mean, &[true, false], &[0, 1], 3);
    let (round, stored) = plain.result(id, 1).map(|(r, b)| (r, b.to_vec())).unwrap();
    assert_eq!(round, 2);
    // Round 3 begins: rank 0's contribution goes into the accumulator.
    let w0 = Worker::open(id, 0, dtype);
    w0.stage(1, &rough(0, 3, 1));
    let push = msg(id, MsgType::Push, 0, 3, 1, true, dtype);
    assert_eq!(s.handle(0, &push, 1), Verdict::Aggregated);
    // Rank 1 lost round 2's result: its push again, and a PULL, get it.
    let g = rough(1, 2, 1);
    let again = msg_with(id, MsgType::Push, 1, 2, 1, false, dtype, Some(&g));
    assert_eq!(s.handle(1, &again, 1), Verdict::Resent);
    let pull = msg_with(id, MsgType::Pull, 1, 0, 1, false, dtype, Some(&[]));
    assert_eq!(s.handle(1, &pull, 1), Verdict::Pulled);
    let sent = drain(&mut s);
    assert_eq!(sent.len(), 2);
    for (to, r, p) in &sent {
        assert_eq!((*to, r.round, r.flags), (1, 2, 0));
        assert_eq!(p, &stored, "round 2's result, not round 3's partial sum");
    }
    assert_eq!(encoded(dtype, &w0.result(1)), stored);
    assert_eq!(s.result(id, 1).unwrap(), (2, &stored[..]));
}

#[test]
fn a_snapshot_of_a_job_with_its_results_in_the_region_restores_them_there() {
    let id = 92;
    let dtype = Dtype::F32;
    for opt in [Optimizer::Sum, Optimizer::Mean] {
        let (mut plain, s) = against_plain(id, opt, &[true, true, false], &[1, 2, 0], 3);
        let saved = s.snapshot(id).unwrap();
        assert_eq!(saved, plain.snapshot(id).unwrap(), "{}", opt.name());
        let results: Vec<Vec<u8>> = (0..2).map(|sl| s.result(id, sl).unwrap().1.to_vec()).collect();
        drop(s); // its files go; the restored job makes them anew.
        let mut b: Shard<u32> = Shard::new(3, Kernels::best());
        b.install(job(id, 3, dtype, opt), InstallKind::Shared(setup()))
            .unwrap();
        b.restore(id, &saved).unwrap();
        assert_eq!(b.snapshot(id).unwrap(), saved);
        let w: Vec<Worker> = (0..3).map(|r| Worker::open(id, r, dtype)).collect();
        for slot in 0..2 {
            assert_eq!(b.result(id, slot).unwrap(), (2, &results[slot as usize][..]));
            assert_eq!(encoded(dtype, &w[0].result(slot)), results[slot as usize]);
        }
        // The restored job goes on exactly as the plain one does, once each
        // rank pulled (PROTOCOL.md §5.4 rule 0).
        for rank in 0..3u16 {
            let m = msg(id, MsgType::Pull, rank, 0, 0, rank != 0, dtype);
            assert_eq!(b.handle(u32::from(rank), &m, 1), Verdict::Pulled);
        }
        drain(&mut b);
        for slot in 0..2 {
            for rank in [0u16, 2, 1] {
                let g = rough(rank, 3, slot);
                let m = msg_with(id, MsgType::Push, rank, 3, slot, false, dtype, Some(&g));
                let want = plain.handle(u32::from(rank), &m, 1);
                if rank != 0 {
                    w[usize::from(rank)].stage(slot, &g);
                }
                let m = msg_with(id, MsgType::Push, rank, 3, slot, rank != 0, dtype, Some(&g));
                assert_eq!(b.handle(u32::from(rank), &m, 1), want);
            }
            assert_eq!(b.result(id, slot), plain.result(id, slot), "{}", opt.name());
            assert_eq!(
                encoded(dtype, &w[2].result(slot)),
                plain.result(id, slot).unwrap().1
            );
        }
        drain(&mut b);
        drain(&mut plain);
    }
}

#[test]
fn a_deferred_first_contribution_is_read_once_with_the_second_and_its_duplicates_are_dropped() {
    let id = 93;
    let dtype = Dtype::F32;
    for opt in [Optimizer::Sum, Optimizer::Mean] {
        // The first contribution by shared memory (deferred), then its
        // duplicate, then a datagram and a shared-memory one.
        let (mut plain, mut s) = against_plain(id, opt, &[true, false, true], &[0, 1, 2], 2);
        let w: Vec<Worker> = (0..3).map(|r| Worker::open(id, r, dtype)).collect();
        let vals: Vec<Vec<f32>> = (0..3).map(|r| rough(r, 2, 0)).collect();
        let push = |rank: u16, shm: bool| {
            msg_with(
                id,
                MsgType::Push,
                rank,
                2,
                0,
                shm,
                dtype,
                Some(&vals[usize::from(rank)]),
            )
        };
        for rank in 0..3u16 {
            plain.handle(u32::from(rank), &push(rank, false), 1);
        }
        w[0].stage(0, &vals[0]);
        assert_eq!(s.handle(0, &push(0, true), 1), Verdict::Aggregated);
        assert_eq!(
            s.handle(0, &push(0, true), 1),
            Verdict::Dropped(DropReason::Duplicate)
        );
        assert_eq!(
            s.handle(0, &push(0, false), 1),
            Verdict::Dropped(DropReason::Duplicate)
        );
        assert_eq!(s.handle(1, &push(1, false), 1), Verdict::Aggregated);
        assert_eq!(
            s.handle(0, &push(0, true), 1),
            Verdict::Dropped(DropReason::Duplicate)
        );
        w[2].stage(0, &vals[2]);
        assert_eq!(s.handle(2, &push(2, true), 1), Verdict::Completed);
        assert_eq!(s.result(id, 0), plain.result(id, 0), "{}", opt.name());
        assert_eq!(s.counters().drops_of(DropReason::Duplicate), 3);
        drain(&mut s);
        drain(&mut plain);
    }
    // The deferred chunk is read when the second contribution arrives: a
    // rank that breaks §3.4 by rewriting it before holding the round's
    // result changes nothing but its own contribution.
    let id = 94;
    let mut s: Shard<u32> = Shard::new(3, Kernels::best());
    s.install(job(id, 2, dtype, Optimizer::Sum), InstallKind::Shared(setup()))
        .unwrap();
    let w: Vec<Worker> = (0..2).map(|r| Worker::open(id, r, dtype)).collect();
    for rank in 0..2u16 {
        let g = grad(0, 0, 1);
        let m = msg_with(
            id,
            MsgType::Init,
            rank,
            0,
            1,
            false,
            dtype,
            Some(if rank == 0 { &g } else { &[] }),
        );
        s.handle(u32::from(rank), &m, 1);
    }
    w[0].stage(1, &grad(0, 1, 1));
    assert_eq!(
        s.handle(0, &msg(id, MsgType::Push, 0, 1, 1, true, dtype), 1),
        Verdict::Aggregated
    );
    w[0].stage(1, &[1000.0; 7]);
    let g1 = grad(1, 1, 1);
    let m1 = msg_with(id, MsgType::Push, 1, 1, 1, false, dtype, Some(&g1));
    assert_eq!(s.handle(1, &m1, 1), Verdict::Completed);
    let want: Vec<f32> = g1.iter().map(|x| x + 1000.0).collect();
    assert_eq!(w[1].result(1), want);
}
