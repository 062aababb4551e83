//! Sparse tables through the real daemons (PROTOCOL.md §10): phub-control
//! admits a job with a table key (and refuses one it cannot serve, naming
//! the key), the kernel-UDP dataplane installs the table on every lcore,
//! and two ranks' ROW_PUSH / ROW_END rounds sent to each lcore by the
//! placement come back as ROW_RESULTs and ROW_DONEs with the rows the
//! table's optimizer made of their sum; a ROW_PULL reads them back.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use crate::common::{Appliances, Operator, Rack};
use phub::proto::api::{AdmitResponse, DataplaneInfo, DataplaneStats, JobDetail};
use phub::proto::memory::{table_bytes, table_shape};
use phub::proto::placement::RowPlacement;
use phub::proto::routes::{control, mgmt};
use phub::proto::rows::{self, RowMsgType, RowPayload, RowRepr};
use phub::proto::spec::JobSpec;
use phub::proto::wire::HEADER_LEN;
use phub::proto::Dtype;
use phub_worker::WorkerError;

const DIM: u32 = 4;
const KEY: u32 = 1;

fn spec(table_fields: &str) -> String {
    format!(
        "name = \"tables\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n\
         [[keys]]\nname = \"w\"\nelements = 64\n\
         [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = {DIM}\nseed = 11\n\
         optimizer = {{ kind = \"sgd\", lr = 0.5 }}\n{table_fields}"
    )
}

fn send(s: &UdpSocket, port: u16, repr: RowRepr, ids: &[u64], rows: &[f32]) {
    let mut b = vec![0u8; HEADER_LEN + 9000];
    let n = rows::write(&repr, ids, rows, &mut b);
    s.send_to(&b[..n], ("127.0.0.1", port)).unwrap();
}

/// The next `n` table answers on `s`: (kind, round, seq, ids, rows).
#[allow(clippy::type_complexity)]
fn receive(s: &UdpSocket, n: usize) -> Vec<(RowMsgType, u32, u32, Vec<u64>, Vec<f32>)> {
    let mut buf = vec![0u8; 65536];
    (0..n)
        .map(|_| {
            let len = s.recv(&mut buf).expect("an answer within the timeout");
            let (r, payload) = rows::parse(&buf[..len]).unwrap_or_else(|e| panic!("not a row answer: {e}"));
            let (ids, values) = match payload {
                RowPayload::Rows(rows) => {
                    let d = DIM as usize;
                    let mut v = vec![0f32; rows.len() * d];
                    for i in 0..rows.len() {
                        assert!(rows.decode_row(i, &mut v[i * d..(i + 1) * d]));
                    }
                    (rows.ids().iter().collect(), v)
                }
                _ => (Vec::new(), Vec::new()),
            };
            (r.kind, r.round, r.seq, ids, values)
        })
        .collect()
}

#[test]
fn a_table_is_admitted_installed_and_served() {
    let rack = Rack::start(2, "256MiB");
    // Without a rows cap there is nothing to charge: refused, naming it.
    let (status, why) = rack.admit(&spec("")).unwrap_err();
    assert_eq!(status, 400, "{why}");
    assert!(
        why.contains("keys[1] \"emb\"") && why.contains("rows = none"),
        "{why}"
    );

    let text = spec("rows = 1000\n");
    let job = rack.admit(&text).unwrap();
    let info: DataplaneInfo = rack.dataplane(&mgmt::info());
    let l = info.lcores.len() as u32;
    assert_eq!(l, 2);
    let parsed = JobSpec::from_toml(&text).unwrap();
    let shape = table_shape(parsed.tables().next().unwrap().spec, l).unwrap();
    assert!(
        job.memory_bytes >= u64::from(l) * table_bytes(&shape),
        "admission charged {} bytes; the stores alone take {} on each of {l} lcores",
        job.memory_bytes,
        table_bytes(&shape)
    );

    let place = RowPlacement::new(11, KEY, &[l]).unwrap();
    let ids: Vec<Vec<u64>> = (0..l)
        .map(|e| (0u64..).filter(|&id| place.entry(id) == e).take(3).collect())
        .collect();
    let head = |kind, rank, round, seq, count: usize| RowRepr {
        kind,
        dtype: Dtype::F32,
        flags: 0,
        token: job.token,
        job: job.id,
        rank,
        count: count as u16,
        round,
        dim: DIM,
        key: KEY,
        seq,
        cache: phub::proto::rows::KeyCache::Off,
    };
    let socks: Vec<UdpSocket> = (0..2)
        .map(|_| {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s
        })
        .collect();
    let grad = |rank: u16, id: u64| -> Vec<f32> {
        (0..DIM)
            .map(|e| (rank + 1) as f32 * (id % 5 + e as u64) as f32)
            .collect()
    };
    // Round 1: both ranks push their rows to each lcore, then ROW_END
    // (rank 1 pushes nothing to entry 1: its ROW_END there says 0).
    for (rank, s) in socks.iter().enumerate() {
        let rank = rank as u16;
        for e in 0..l {
            let port = info.data.base_port + e as u16;
            let n = if rank == 1 && e == 1 { 0 } else { 1 };
            if n == 1 {
                let m = &ids[e as usize];
                let rows: Vec<f32> = m.iter().flat_map(|&id| grad(rank, id)).collect();
                send(s, port, head(RowMsgType::RowPush, rank, 1, 0, m.len()), m, &rows);
            }
            send(s, port, head(RowMsgType::RowEnd, rank, 1, n, 0), &[], &[]);
        }
    }
    // What SGD with lr 0.5 makes of zeros and the round's sum.
    let want = |e: u32, id: u64| -> Vec<f32> {
        let pushers: &[u16] = if e == 1 { &[0] } else { &[0, 1] };
        (0..DIM as usize)
            .map(|k| {
                let sum: f32 = pushers.iter().map(|&r| grad(r, id)[k]).sum();
                0.0 - 0.5 * sum
            })
            .collect()
    };
    for (rank, s) in socks.iter().enumerate() {
        let mut got = receive(s, if rank == 0 { 4 } else { 3 });
        let mut expect = Vec::new();
        for e in 0..l {
            if rank == 0 || e == 0 {
                let m = &ids[e as usize];
                let rows: Vec<f32> = m.iter().flat_map(|&id| want(e, id)).collect();
                expect.push((RowMsgType::RowResult, 1, 0, m.clone(), rows));
            }
        }
        for e in 0..l {
            let n = if rank == 1 && e == 1 { 0 } else { 1 };
            expect.push((RowMsgType::RowDone, 1, n, Vec::new(), Vec::new()));
        }
        expect.sort_by_key(|(kind, _, seq, ids, _)| {
            (kind.code(), ids.first().map(|&id| place.entry(id)), *seq)
        });
        got.sort_by_key(|(kind, _, seq, ids, _)| (kind.code(), ids.first().map(|&id| place.entry(id)), *seq));
        assert_eq!(got, expect, "rank {rank}");
    }
    // A pull reads the rows of round 1 back, with round 1 in `round`.
    let s = &socks[1];
    for e in 0..l {
        let m = &ids[e as usize];
        send(
            s,
            info.data.base_port + e as u16,
            head(RowMsgType::RowPull, 1, 0, 40 + e, m.len()),
            m,
            &[],
        );
        let got = receive(s, 1).remove(0);
        let rows: Vec<f32> = m.iter().flat_map(|&id| want(e, id)).collect();
        assert_eq!(
            got,
            (RowMsgType::RowPullResult, 1, 40 + e, m.clone(), rows),
            "entry {e}"
        );
    }
    // A row sent to the wrong lcore is refused there (row_out_of_place):
    // the ERROR is no row answer, so it is read raw.
    send(
        s,
        info.data.base_port + 1,
        head(RowMsgType::RowPull, 1, 0, 9, 1),
        &ids[0][..1],
        &[],
    );
    let mut buf = [0u8; 256];
    let len = s.recv(&mut buf).unwrap();
    let (e, _) = phub::proto::wire::parse(&buf[..len]).unwrap();
    assert_eq!(
        e.error,
        phub::proto::wire::DropReason::RowOutOfPlace.code(),
        "{e:?}"
    );
}

/// Runs `f(rank, worker)` for both ranks of the rack's two-rank `job` at
/// once, each on a thread of its own with a worker joined; the results in
/// rank order.
fn on_both_ranks<T: Send>(
    rack: &Rack,
    job: &AdmitResponse,
    f: impl Fn(u16, phub_worker::Worker) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u16)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    f(
                        rank,
                        phub_worker::Worker::join(&rack.control_url, job.id, job.token, rank).unwrap(),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A push started with `start_push_rows` against the real appliance: the
/// table is busy until it is waited (a pull meanwhile is refused `Busy`),
/// waiting gives the round, and a push dropped unwaited is waited by its
/// drop: both rounds are applied once each (SGD, lr 0.5, gradients 1 and
/// 2 from the two ranks: -1.5 a round). A pull started with
/// `start_pull_rows` likewise: busy until waited (a push meanwhile is
/// refused), the rows written by `wait_into`, freed by its drop, and an
/// `out` of the wrong length refused.
#[test]
fn started_pushes_and_pulls_are_waited_later_or_by_their_drop() {
    let rack = Rack::start(2, "256MiB");
    let job = rack.admit(&spec("rows = 1000\n")).unwrap();
    let ids: Vec<u64> = (0..40).map(|i| i * 11 + 5).collect();
    let d = DIM as usize;
    let pulled = on_both_ranks(&rack, &job, |rank, w| {
        let grads = vec![f32::from(rank + 1); ids.len() * d];
        let mut out = vec![0f32; ids.len() * d];
        let p = w.start_push_rows("emb", &ids, &grads).unwrap();
        assert_eq!(p.round(), 1);
        assert!(
            matches!(w.pull_rows("emb", &ids, &mut out), Err(WorkerError::Busy { .. })),
            "rank {rank}: a pull of a table being pushed"
        );
        assert_eq!(p.wait().unwrap(), 1);
        drop(w.start_push_rows("emb", &ids, &grads).unwrap());
        assert_eq!(w.table_round("emb").unwrap(), 2, "rank {rank}");
        // A started pull: the table busy until it is waited, the rows
        // written by wait_into: the rows of round 2.
        let pull = w.start_pull_rows("emb", &ids).unwrap();
        assert_eq!(pull.values(), out.len());
        assert!(
            matches!(
                w.start_push_rows("emb", &ids, &grads),
                Err(WorkerError::Busy { .. })
            ),
            "rank {rank}: a push of a table being pulled"
        );
        assert_eq!(pull.wait_into(&mut out).unwrap(), 2);
        // A dropped pull frees the table; a short `out` is refused.
        drop(w.start_pull_rows("emb", &ids).unwrap());
        let mut short = vec![0f32; out.len() - 1];
        let refused = w.start_pull_rows("emb", &ids).unwrap().wait_into(&mut short);
        assert!(matches!(refused, Err(WorkerError::Rows { .. })), "{refused:?}");
        out
    });
    for (rank, rows) in pulled.iter().enumerate() {
        assert!(rows.iter().all(|&v| v == -3.0), "rank {rank}: {rows:?}");
    }
}

/// The worker library's row calls against the real appliance: two ranks
/// `push_pull_rows` the same ids (placed over both lcores) for three
/// rounds, each getting the rows SGD made of both ranks' sums, round
/// after round; `pull_rows` then reads the same.
#[test]
fn workers_push_and_pull_rows_through_the_appliance() {
    let rack = Rack::start(2, "256MiB");
    let job = rack.admit(&spec("rows = 1000\n")).unwrap();
    let ids: Vec<u64> = (0..40).map(|i| i * 7 + 3).collect();
    let d = DIM as usize;
    let g = |rank: u16, round: u32, id: u64, e: usize| -> f32 {
        (rank + 1) as f32 * 0.25 + (round as f32) - (id % 3) as f32 + e as f32 * 0.5
    };
    let rounds = 3u32;
    // What SGD with lr 0.5 makes of zeros after `t` rounds of both ranks.
    let want = |t: u32| -> Vec<f32> {
        ids.iter()
            .flat_map(|&id| {
                (0..d).map(move |e| {
                    let mut w = 0f32;
                    for r in 1..=t {
                        w -= 0.5 * (g(0, r, id, e) + g(1, r, id, e));
                    }
                    w
                })
            })
            .collect()
    };
    let got = on_both_ranks(&rack, &job, |rank, w| {
        let outs: Vec<Vec<f32>> = (1..=rounds)
            .map(|round| {
                let grads: Vec<f32> = ids
                    .iter()
                    .flat_map(|&id| (0..d).map(move |e| g(rank, round, id, e)))
                    .collect();
                let mut out = vec![0f32; ids.len() * d];
                let r = w.push_pull_rows("emb", &ids, &grads, &mut out).unwrap();
                assert_eq!(r, round, "rank {rank}");
                out
            })
            .collect();
        // Every round this rank pushed is complete: a pull reads the last
        // one's rows.
        let mut pulled = vec![0f32; ids.len() * d];
        let r = w.pull_rows("emb", &ids, &mut pulled).unwrap();
        (outs, r, pulled)
    });
    for (rank, (per_round, pulled_round, pulled)) in got.iter().enumerate() {
        for (t, out) in per_round.iter().enumerate() {
            assert_eq!(out, &want(t as u32 + 1), "rank {rank} round {}", t + 1);
        }
        assert_eq!(
            (*pulled_round, pulled),
            (rounds, &want(rounds)),
            "rank {rank}'s pull"
        );
    }
    // `job show` and /metrics count the table's rows, over both lcores.
    let detail: JobDetail = rack.send(&control::job(job.id));
    let [t] = detail.tables.as_slice() else {
        panic!("one table: {:?}", detail.tables)
    };
    assert_eq!((t.key, t.rows_stored, t.created), (KEY, 40, 40), "{t:?}");
    assert_eq!(
        (t.evicted_cap, t.evicted_idle, t.not_admitted, t.no_memory),
        (0, 0, 0, 0),
        "{t:?}"
    );
    assert!(
        t.updates >= 40 * u64::from(rounds) && t.lookups >= 40 && t.bytes > 0,
        "{t:?}"
    );
    let metrics: String = rack.send(&control::metrics());
    assert!(
        metrics.contains(&format!(
            "phub_table_rows{{job=\"{}\",key=\"{KEY}\"}} 40\n",
            job.id
        )),
        "{metrics}"
    );
}

/// Rank `rank`'s gradient for element `e` of row `id` in round `round`
/// (the checkpoint tests' pushes).
fn grad_of(rank: u16, round: u32, id: u64, e: usize) -> f32 {
    f32::from(rank + 1) * 0.5 - (round as f32) * 0.25 + (id % 5) as f32 - e as f32 * 0.125
}

/// Row `id`'s values after round t of two ranks pushing [`grad_of`]
/// (SGD, lr 0.5, from zeros; the two ranks' sum is exact in any order).
fn sgd_row(t: u32, id: u64) -> Vec<f32> {
    (0..DIM as usize)
        .map(|e| {
            let mut w = 0f32;
            for r in 1..=t {
                w -= 0.5 * (grad_of(0, r, id, e) + grad_of(1, r, id, e));
            }
            w
        })
        .collect()
}

/// A table's rows and rounds survive a checkpoint and a crash of the
/// dataplane (PROTOCOL.md §10.6): two ranks push three BSP rounds, control
/// checkpoints the job, the dataplane is killed and started again and
/// control restores the job from the file; each rank's pull then reads
/// round 3's rows, and rounds 4 and 5 give the rows a run that never
/// crashed gives. Before tables were checkpointed the restored appliance
/// read every row as its initial value (zeros) at round 0, and refused
/// round 4 as ahead.
#[test]
fn a_table_survives_a_checkpoint_and_a_dataplane_restart() {
    let mut rack = Rack::start(2, "256MiB");
    let job = rack.admit(&spec("rows = 1000\n")).unwrap();
    let ids: Vec<u64> = (0..40).map(|i| i * 11 + 1).collect();
    let d = DIM as usize;
    let g = grad_of;
    let want = |t: u32| -> Vec<f32> { ids.iter().flat_map(|&id| sgd_row(t, id)).collect() };
    let workers: Vec<phub_worker::Worker> = (0..2u16)
        .map(|rank| phub_worker::Worker::join(&rack.control_url, job.id, job.token, rank).unwrap())
        .collect();
    let rounds = |from: u32, to: u32| {
        std::thread::scope(|s| {
            for (rank, w) in (0u16..).zip(&workers) {
                let ids = &ids;
                s.spawn(move || {
                    for round in from..=to {
                        let grads: Vec<f32> = ids
                            .iter()
                            .flat_map(|&id| (0..d).map(move |e| g(rank, round, id, e)))
                            .collect();
                        let mut out = vec![0f32; ids.len() * d];
                        let r = w.push_pull_rows("emb", ids, &grads, &mut out).unwrap();
                        assert_eq!((r, &out), (round, &want(round)), "rank {rank} round {round}");
                    }
                });
            }
        });
    };
    rounds(1, 3);
    let info = rack.send(&control::checkpoint(job.id));
    assert_eq!(info.id, job.id);
    rack.kill_dataplane();
    rack.start_dataplane();
    // Control reinstalls the job from its checkpoint within a few of its
    // 200 ms reconciliations; until then a pull goes unanswered.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut pulled = vec![0f32; ids.len() * d];
    let round = loop {
        match workers[0].pull_rows("emb", &ids, &mut pulled) {
            Ok(r) => break r,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("no pull answered 30 s after the restart: {e}"),
        }
    };
    assert_eq!((round, &pulled), (3, &want(3)), "rank 0's pull after the restore");
    let r = workers[1].pull_rows("emb", &ids, &mut pulled).unwrap();
    assert_eq!((r, &pulled), (3, &want(3)), "rank 1's pull after the restore");
    rounds(4, 5);
}

/// A table over two appliances (flat sharding, PROTOCOL.md §4.1, §10.1):
/// `a` with two lcores and `b` with one. Control tells each appliance
/// where its lcores are among the job's three (its first entry and L), so
/// each lcore keeps the rows the placement gives its entry; two ranks
/// route each id to its appliance and lcore by the same hash and push
/// three BSP rounds, exact against SGD computed here; both appliances get
/// rows. Before, control refused a job with a table over several
/// appliances.
#[test]
fn a_table_over_two_appliances_is_exact() {
    let rack = Appliances::start(&[2, 1], "256MiB");
    let spec = spec("rows = 3000\n") + "[placement]\nappliances = [\"a\", \"b\"]\n";
    let job = rack.admit(&spec).unwrap();
    let ids: Vec<u64> = (0..60).map(|i| i * 13 + 5).collect();
    let placement = RowPlacement::new(11, KEY, &[2, 1]).unwrap();
    let on_b = ids
        .iter()
        .filter(|&&id| placement.place(id).appliance == 1)
        .count();
    assert!(on_b > 0 && on_b < ids.len(), "{on_b} of {} ids on b", ids.len());
    let d = DIM as usize;
    let g = |rank: u16, round: u32, id: u64, e: usize| -> f32 {
        (rank + 1) as f32 * 0.75 - round as f32 + (id % 7) as f32 * 0.5 - e as f32 * 0.25
    };
    let want = |t: u32| -> Vec<f32> {
        ids.iter()
            .flat_map(|&id| {
                (0..d).map(move |e| {
                    let mut w = 0f32;
                    for r in 1..=t {
                        w -= 0.5 * (g(0, r, id, e) + g(1, r, id, e));
                    }
                    w
                })
            })
            .collect()
    };
    std::thread::scope(|s| {
        for rank in 0..2u16 {
            let (url, ids, want) = (&rack.control_url, &ids, &want);
            s.spawn(move || {
                let w = phub_worker::Worker::join(url, job.id, job.token, rank).unwrap();
                for round in 1..=3u32 {
                    let grads: Vec<f32> = ids
                        .iter()
                        .flat_map(|&id| (0..d).map(move |e| g(rank, round, id, e)))
                        .collect();
                    let mut out = vec![0f32; ids.len() * d];
                    let r = w.push_pull_rows("emb", ids, &grads, &mut out).unwrap();
                    assert_eq!((r, &out), (round, &want(round)), "rank {rank} round {round}");
                }
                let mut pulled = vec![0f32; ids.len() * d];
                let r = w.pull_rows("emb", ids, &mut pulled).unwrap();
                assert_eq!((r, &pulled), (3, &want(3)), "rank {rank}'s pull");
            });
        }
    });
    // Each appliance answered rows: b's one lcore holds its share.
    for i in 0..2 {
        let stats: DataplaneStats = rack.dataplane(i, &mgmt::stats());
        let results: u64 = stats.lcores.iter().map(|l| l.results_sent).sum();
        assert!(results > 0, "appliance {i} sent no table answer");
    }
}

/// A checkpoint taken while two ranks push: each lcore streams its share
/// of the table (copy on write, the lcore serving between slices; here
/// 40,000 rows of 28 bytes per lcore, three slices of 512 KiB) and the
/// file holds, per lcore, exactly the rows of the round it says was
/// completed: no row of a later round, none of an earlier one, whatever
/// the pushes did while the bytes were being sent. Read from the
/// dataplane's API as control reads it, three times during the rounds.
#[test]
fn a_table_checkpointed_while_ranks_push_holds_one_round_per_lcore() {
    use phub::proto::checkpoint::Checkpoint;
    use phub::proto::table_checkpoint::TableRoundsState;
    use std::sync::atomic::{AtomicU32, Ordering};

    let rack = Rack::start(2, "512MiB");
    let job = rack.admit(&spec("rows = 100000\n")).unwrap();
    let ids: Vec<u64> = (0..80_000u64).map(|i| i * 7 + 3).collect();
    let d = DIM as usize;
    let g = grad_of;
    let want = sgd_row;
    let workers: Vec<phub_worker::Worker> = (0..2u16)
        .map(|rank| phub_worker::Worker::join(&rack.control_url, job.id, job.token, rank).unwrap())
        .collect();
    const ROUNDS: u32 = 8;
    let done = AtomicU32::new(0);
    let files: Vec<Vec<u8>> = std::thread::scope(|s| {
        for (rank, w) in (0u16..).zip(&workers) {
            let (ids, done) = (&ids, &done);
            s.spawn(move || {
                let mut out = vec![0f32; ids.len() * d];
                for round in 1..=ROUNDS {
                    let grads: Vec<f32> = ids
                        .iter()
                        .flat_map(|&id| (0..d).map(move |e| g(rank, round, id, e)))
                        .collect();
                    let r = w.push_pull_rows("emb", ids, &grads, &mut out).unwrap();
                    assert_eq!(r, round, "rank {rank}");
                    if rank == 0 {
                        done.store(round, Ordering::Release);
                    }
                }
            });
        }
        while done.load(Ordering::Acquire) < 1 {
            std::thread::sleep(Duration::from_millis(5));
        }
        (0..3)
            .map(|_| rack.dataplane_as_control(&mgmt::checkpoint(job.id)))
            .collect()
    });
    let d32 = DIM as usize;
    let mut rounds_seen = Vec::new();
    for (n, file) in files.iter().enumerate() {
        let c = Checkpoint::decode(file).unwrap_or_else(|e| panic!("checkpoint {n}: {e}"));
        assert_eq!(c.tables.len(), 2, "one section per lcore");
        let mut rows_in_file = 0usize;
        for (l, tables) in c.tables.iter().enumerate() {
            assert_eq!(tables.len(), 1);
            let t = &tables[0];
            let TableRoundsState::Bsp { completed } = t.rounds else {
                panic!("a BSP table saved clocks")
            };
            assert!(
                (1..=ROUNDS).contains(&completed),
                "checkpoint {n} lcore {l}: round {completed}"
            );
            rounds_seen.push(completed);
            // The row store's bytes (PROTOCOL.md §10.6): a 56-byte header
            // (dim at 12, state length at 16, rows at 24), then per row its
            // id, touch word, values and state.
            let b = &t.rows;
            let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
            let (dim, state) = (u32_at(12) as usize, u32_at(16) as usize);
            assert_eq!(dim, d32);
            let rows = u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize;
            let record = 12 + 4 * (dim + state);
            for r in 0..rows {
                let at = 56 + r * record;
                let id = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
                let values: Vec<f32> = (0..dim)
                    .map(|e| f32::from_bits(u32_at(at + 12 + 4 * e)))
                    .collect();
                assert_eq!(
                    values,
                    want(completed, id),
                    "checkpoint {n} lcore {l}: row {id} is not round {completed}'s"
                );
            }
            rows_in_file += rows;
        }
        assert_eq!(rows_in_file, ids.len(), "checkpoint {n}: every row, once");
    }
    eprintln!("rounds in the checkpoints, per lcore: {rounds_seen:?}");
}

/// One checkpoint at a time per lcore: while a reader holds one open
/// without reading it (its lcores' slices waiting, 16 of 512 KiB each,
/// for a table of 34 MB: 17 MB per lcore), a second request is refused 409 naming the job
/// being streamed; once that reader goes away the lcores end their
/// streams, and the next checkpoint comes whole.
#[test]
fn a_second_checkpoint_while_one_streams_is_refused_409() {
    use std::io::{Read, Write};
    let rack = Rack::start(2, "512MiB");
    let job = rack.admit(&spec("rows = 1300000\n")).unwrap();
    let ids: Vec<u64> = (0..1_200_000u64).collect();
    let d = DIM as usize;
    let w = phub_worker::Worker::join(&rack.control_url, job.id, job.token, 0).unwrap();
    let w1 = phub_worker::Worker::join(&rack.control_url, job.id, job.token, 1).unwrap();
    std::thread::scope(|s| {
        for w in [&w, &w1] {
            let ids = &ids;
            s.spawn(move || {
                // A round holds at most 1024 messages per lcore (§10.2).
                for part in ids.chunks(400_000) {
                    let grads = vec![0.25f32; part.len() * d];
                    let mut out = vec![0f32; part.len() * d];
                    w.push_pull_rows("emb", part, &grads, &mut out).unwrap();
                }
            });
        }
    });
    let token = rack.mgmt_token();
    let addr = rack.mgmt_url.trim_start_matches("http://").to_string();
    let mut held = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        held,
        "GET /v1/jobs/{}/checkpoint HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n",
        job.id
    )
    .unwrap();
    let mut head = [0u8; 64];
    held.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let n = held.read(&mut head).unwrap();
    assert!(
        head[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head[..n])
    );
    let client = phub_hwtests::workload::client(&rack.mgmt_url, Some(&token));
    let e = client.send(&mgmt::checkpoint(job.id)).unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(
        e.message()
            .contains(&format!("streaming a checkpoint of job {}", job.id)),
        "{e}"
    );
    drop(held);
    // The lcores notice the reader gone at their next slice.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let file = loop {
        match client.send(&mgmt::checkpoint(job.id)) {
            Ok(f) => break f,
            Err(e) if e.status() == Some(409) && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("the checkpoint after the first reader left: {e}"),
        }
    };
    let c = phub::proto::checkpoint::Checkpoint::decode(&file).unwrap();
    let rows: usize = c
        .tables
        .iter()
        .map(|t| usize::try_from(u64::from_le_bytes(t[0].rows[24..32].try_into().unwrap())).unwrap())
        .sum();
    assert_eq!(rows, ids.len());
}

/// A restore is read as it streams in (PROTOCOL.md §10.6): the dataplane
/// builds each table from the body as it comes and checks the CRC at the
/// file's end before any lcore takes the job. A file cut inside a table's
/// rows, or with one row byte flipped (found only by the CRC, after every
/// row was read), is refused naming why and leaves nothing installed;
/// the same file whole restores every row. (The job is restored under
/// another id, which control does not know: it removes it again after.)
#[test]
fn a_restore_cut_or_corrupt_in_its_rows_installs_nothing() {
    let rack = Rack::start(2, "256MiB");
    let job = rack.admit(&spec("rows = 100000\n")).unwrap();
    let ids: Vec<u64> = (0..20_000u64).map(|i| i * 7 + 3).collect();
    let d = DIM as usize;
    let workers: Vec<phub_worker::Worker> = (0..2u16)
        .map(|rank| phub_worker::Worker::join(&rack.control_url, job.id, job.token, rank).unwrap())
        .collect();
    std::thread::scope(|s| {
        for w in &workers {
            let ids = &ids;
            s.spawn(move || {
                let grads = vec![0.5f32; ids.len() * d];
                let mut out = vec![0f32; ids.len() * d];
                w.push_pull_rows("emb", ids, &grads, &mut out).unwrap();
            });
        }
    });
    let file = rack.dataplane_as_control(&mgmt::checkpoint(job.id));
    let mut c = phub::proto::checkpoint::Checkpoint::decode(&file).unwrap();
    let other = job.id + 100;
    c.job.id = other;
    let file = c.encode().unwrap();
    let rows = &c.tables[0][0].rows;
    assert!(rows.len() > 100_000, "{} bytes of rows on lcore 0", rows.len());
    let at = file
        .windows(64)
        .position(|w| w == &rows[rows.len() / 2..rows.len() / 2 + 64])
        .expect("lcore 0's rows in the file");
    let client = phub_hwtests::workload::client(&rack.mgmt_url, Some(&rack.mgmt_token()));
    let installed = || -> Vec<u16> { client.send(&mgmt::jobs()).unwrap().iter().map(|j| j.id).collect() };
    let e = client.send(&mgmt::restore(other, &file[..at])).unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    assert!(e.message().contains("truncated"), "{e}");
    assert!(!installed().contains(&other));
    // A restore stalled in its rows (the body stops at `at`, the rest
    // never sent): control's heartbeat, `GET /v1/info`, still answers at
    // once (before, it waited for the stall's 60 s, and control declared a
    // healthy appliance down), and so do the list of jobs and a checkpoint
    // of the job beside it (before, both waited: the registry was held
    // across the restore, and with it every other job's epochs).
    {
        use std::io::Write;
        let addr = rack.mgmt_url.trim_start_matches("http://");
        let mut put = std::net::TcpStream::connect(addr).unwrap();
        write!(
            put,
            "PUT /v1/jobs/{other} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
            rack.mgmt_token(),
            file.len()
        )
        .unwrap();
        put.write_all(&file[..at]).unwrap();
        put.flush().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let asked = Instant::now();
        let info = client.send(&mgmt::info()).unwrap();
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "GET /v1/info took {:?} beside a stalled restore",
            asked.elapsed()
        );
        assert!(!info.id.is_empty());
        let asked = Instant::now();
        let now = installed();
        let beside = client.send(&mgmt::checkpoint(job.id)).unwrap();
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "GET /v1/jobs and a checkpoint of job {} took {:?} beside a stalled restore",
            job.id,
            asked.elapsed()
        );
        assert!(now.contains(&job.id) && !now.contains(&other), "{now:?}");
        assert!(!beside.is_empty());
        drop(put);
    }
    let mut bad = file.clone();
    bad[at + 5] ^= 0x40;
    let e = client.send(&mgmt::restore(other, &bad)).unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    assert!(e.message().contains("checksum"), "{e}");
    assert!(!installed().contains(&other));
    client.send(&mgmt::restore(other, &file)).unwrap();
    let back = client.send(&mgmt::checkpoint(other));
    // Control may already have removed the job it does not know.
    if let Ok(back) = back {
        let b = phub::proto::checkpoint::Checkpoint::decode(&back).unwrap();
        assert_eq!(b.tables, c.tables);
    }
}
