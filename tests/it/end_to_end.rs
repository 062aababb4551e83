//! The whole appliance on loopback: phub-dataplane and phub-control as real
//! processes, workers on the phub-worker library, phubctl as the operator.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::{client, flood, train, train_rank, Operator, Rack};
use phub::proto::api::{JobDetail, JobSummary, Stats};
use phub::proto::routes::{control, mgmt};
use phub_http::ClientError;
use phub_worker::Worker;

fn sum_spec(name: &str, workers: u16, keys: &[u64]) -> String {
    common::sum_spec(name, workers, None, keys)
}

#[test]
fn three_workers_big_and_tiny_keys_twenty_rounds_with_a_flood() {
    let rack = Rack::start(2, "1GiB");
    let keys = [10_000_000u64, 1, 4097];
    let job = rack.admit(&sum_spec("big", 3, &keys)).unwrap();
    // A flood of random and truncated datagrams at every data port while training.
    let stop = Arc::new(AtomicBool::new(false));
    let info: phub::proto::api::DataplaneInfo = rack.dataplane(&mgmt::info());
    let flood = {
        let stop = Arc::clone(&stop);
        let (base, n) = (info.data.base_port, info.lcores.len() as u16);
        std::thread::spawn(move || flood(&stop, "127.0.0.1", base, n))
    };
    train(&rack.control_url, &job, 3, &keys, 20);
    stop.store(true, Ordering::Relaxed);
    let flooded = flood.join().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let stats: Stats = rack.send(&control::stats());
    let d = stats.dataplane.expect("dataplane stats");
    let drops: u64 = d.lcores.iter().flat_map(|l| l.drops.values()).sum();
    let bad_token: u64 = d.lcores.iter().filter_map(|l| l.drops.get("bad_token")).sum();
    assert!(flooded > 100, "the flood sent {flooded}");
    assert!(
        drops >= flooded,
        "{drops} drops counted for {flooded} bad datagrams"
    );
    assert!(bad_token > 0, "no bad_token drops among {:?}", d.lcores[0].drops);
    let (ok, out, _) = rack.phubctl(&["stats"]);
    assert!(ok && out.contains("bad_token"), "{out}");
}

/// Many keys over two lcores, more chunks than a window: every rank must
/// send its chunks in the same order whenever its requests reach its I/O
/// thread. When the order depended on that (a queue per lcore, taken in
/// turn), the two ranks filled their windows with chunks of different
/// lcores that the other had not sent, and round 0 never completed.
#[test]
fn many_keys_over_two_lcores_never_wait_on_each_other() {
    let rack = Rack::start(2, "1GiB");
    let keys = [100_000u64; 60];
    let job = rack.admit(&sum_spec("many", 2, &keys)).unwrap();
    train(&rack.control_url, &job, 2, &keys, 3);
}

/// An appliance of one lcore whose socket asks for a 256 KiB receive
/// buffer, and the buffer it states (as the kernel charges it).
fn small_buffer_rack() -> (Rack, u64) {
    let rack = Rack::start_with(1, "1GiB", &["--socket-buffer", "262144"]);
    let info: phub::proto::api::DataplaneInfo = rack.dataplane(&mgmt::info());
    let rx = info.lcores[0]
        .rx_buffer_bytes
        .expect("the UDP backend states its buffer");
    (rack, rx)
}

/// Trains `jobs` sum jobs at once, W = 2 each, 3 rounds of a 2 M-element
/// key, on one lcore whose socket asks for a 256 KiB receive buffer, and
/// asserts that the kernel turned no datagram away there (`socket_full`).
fn train_on_a_small_receive_buffer(jobs: usize) {
    let (rack, rx) = small_buffer_rack();
    let keys = [2_000_000u64];
    let admitted: Vec<_> = (0..jobs)
        .map(|i| {
            rack.admit(&sum_spec(&format!("small-buffer-{i}"), 2, &keys))
                .unwrap()
        })
        .collect();
    std::thread::scope(|s| {
        for job in &admitted {
            s.spawn(|| train(&rack.control_url, job, 2, &keys, 3));
        }
    });
    let stats: Stats = rack.send(&control::stats());
    let d = stats.dataplane.expect("dataplane stats");
    let full: u64 = d.lcores.iter().filter_map(|l| l.drops.get("socket_full")).sum();
    assert_eq!(
        full, 0,
        "datagrams turned away by a {rx}-byte receive buffer, {jobs} job(s): {:?}",
        d.lcores[0].drops
    );
}

/// An appliance with a small receive buffer states it, and the workers'
/// windows fit it: a W = 2 job with far more chunks than the buffer holds
/// trains with nothing turned away at the appliance's socket. With the
/// window sized for the 32 MiB buffer assumed before (59 chunks of 8 KiB
/// per worker against 512 KiB as the kernel counts it), the buffer
/// overflowed and the workers retransmitted into it.
#[test]
fn workers_keep_within_an_appliances_small_receive_buffer() {
    train_on_a_small_receive_buffer(1);
}

/// Two jobs training at once on that lcore: each job's workers get a share
/// of the buffer in the join answer (by W), so that together they fit it.
#[test]
fn two_jobs_share_an_appliances_small_receive_buffer() {
    train_on_a_small_receive_buffer(2);
}

/// A job admitted onto the lcore after another job's workers joined: those
/// workers' join answer gave them the whole buffer, and the lcore's RESULTs
/// now state their share of it (PROTOCOL.md §6.1), so their windows shrink
/// to the new job's (checked in the workers' stats; without the share in
/// the RESULTs they stay at the whole buffer's), and nothing is turned
/// away.
#[test]
fn workers_shrink_their_window_when_a_job_joins_their_lcore_later() {
    let (rack, rx) = small_buffer_rack();
    let rx = rx as usize;
    let keys = [2_000_000u64];
    // 8 KiB chunks; the workers' own 32 MiB buffers do not bound it.
    let window =
        |share| phub_worker::auto_window(2, 1, 2_000_000usize.div_ceil(2048), 86 + 8192, 32 << 20, share);
    assert!(
        window(rx / 2) < window(rx),
        "the test needs a buffer that bounds the window"
    );
    let a = rack.admit(&sum_spec("first", 2, &keys)).unwrap();
    // a joined and initialised, then b admitted while a runs round 1 (whose
    // RESULTs may leave before b is installed, so they need not state the
    // share); round 2 starts only once b is installed, so its RESULTs state
    // a's share, and b trains only after it: with b starting after round 1
    // the first job's window could still be the whole buffer's when b's
    // datagrams arrived (2 `socket_full` drops seen once under load).
    let (a_joined, a_learned) = (std::sync::Barrier::new(3), std::sync::Barrier::new(3));
    let windows = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for rank in 0..2u16 {
            let (a, a_joined, a_learned, windows) = (&a, &a_joined, &a_learned, &windows);
            let url = &rack.control_url;
            s.spawn(move || {
                let cfg = phub_worker::WorkerConfig::default();
                let (rounds, stats) = train_rank(url, a.id, a.token, rank, 2, &keys, cfg, |r| {
                    match r {
                        1 => drop(a_joined.wait()),
                        3 => drop(a_learned.wait()),
                        _ => {}
                    }
                    r <= 10
                });
                assert_eq!(rounds, 10);
                windows.lock().unwrap().push(stats.window);
            });
        }
        a_joined.wait();
        let b = rack.admit(&sum_spec("second", 2, &keys)).unwrap();
        a_learned.wait();
        train(&rack.control_url, &b, 2, &keys, 4);
    });
    // Each job has half of the buffer now.
    let w = windows.into_inner().unwrap();
    assert_eq!(
        w,
        [window(rx / 2) as u64; 2],
        "first job's windows (alone: {})",
        window(rx)
    );
    let stats: Stats = rack.send(&control::stats());
    let d = stats.dataplane.expect("dataplane stats");
    let full: u64 = d.lcores.iter().filter_map(|l| l.drops.get("socket_full")).sum();
    let dup: u64 = d.lcores.iter().filter_map(|l| l.drops.get("duplicate")).sum();
    // The windows bound the chunks in flight, not their copies: a loaded
    // machine (the suite's other tests) makes the lcore slower than the
    // workers' loss timers, and a resend can wait in the socket buffer
    // beside its first copy (seen once: 152 duplicates, 1 turned away).
    // Without resends nothing may be turned away; with them, no more than
    // the copies that came.
    if dup == 0 {
        assert_eq!(full, 0, "datagrams turned away: {:?}", d.lcores[0].drops);
    } else {
        assert!(full <= dup, "datagrams turned away: {:?}", d.lcores[0].drops);
    }
}

#[test]
fn two_jobs_at_once_neither_disturbs_the_other() {
    let rack = Rack::start(2, "256MiB");
    let a = rack.admit(&sum_spec("a", 2, &[5000, 3])).unwrap();
    let b = rack.admit(&sum_spec("b", 3, &[7000])).unwrap();
    assert_ne!(a.id, b.id);
    std::thread::scope(|s| {
        s.spawn(|| train(&rack.control_url, &a, 2, &[5000, 3], 10));
        s.spawn(|| train(&rack.control_url, &b, 3, &[7000], 10));
    });
    let jobs: Vec<JobSummary> = rack.send(&control::jobs());
    assert_eq!(jobs.len(), 2);
    let show: JobDetail = rack.send(&control::job(b.id));
    assert_eq!(show.round_range, Some((10, 10)));
    assert!(show.ranks.iter().all(|r| r.joined && r.silent_ms.is_some()));
}

#[test]
fn bad_specs_and_bad_joins_are_refused_with_their_reason() {
    let rack = Rack::start(1, "1MiB");
    // Admission needs the operator token, kept in an owner-only file.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(rack.dir.join("state.json.operator-token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let spec = sum_spec("x", 1, &[10]);
    match client(&rack.control_url, None).send(&control::admit(&spec)) {
        Err(ClientError::Api { status: 401, message }) => {
            assert!(message.contains("operator token"), "{message}");
        }
        other => panic!("admission without the operator token: {other:?}"),
    }
    let wrong = client(&rack.control_url, Some("0000000000000000")).send(&control::admit(&spec));
    assert!(
        matches!(wrong, Err(ClientError::Api { status: 403, .. })),
        "{wrong:?}"
    );
    let (code, msg) = rack.admit(&sum_spec("x", 0, &[10])).unwrap_err();
    assert_eq!(code, 400);
    assert!(msg.contains("`workers` = 0"), "{msg}");
    let (code, msg) = rack
        .admit("name = \"x\"\nworkers = 2\n[optimizer]\nkind = \"lamb\"\n[[keys]]\nelements = 1\n")
        .unwrap_err();
    assert_eq!(code, 400);
    assert!(msg.contains("lamb"), "{msg}");
    let (code, msg) = rack.admit(&sum_spec("huge", 2, &[10_000_000])).unwrap_err();
    assert!(code >= 400 && msg.contains("memory"), "{code} {msg}");
    let jobs: Vec<JobSummary> = rack.send(&control::jobs());
    assert!(jobs.is_empty(), "a refused job was recorded: {jobs:?}");
    let job = rack.admit(&sum_spec("ok", 2, &[10])).unwrap();
    let e = Worker::join(&rack.control_url, job.id, job.token ^ 1, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("token"), "{e}");
    let e = Worker::join(&rack.control_url, job.id + 1, job.token, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not admitted") || e.contains("unknown"), "{e}");
    let e = Worker::join(&rack.control_url, job.id, job.token, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 2"), "{e}");
    let _w = Worker::join(&rack.control_url, job.id, job.token, 1).unwrap();
    let e = Worker::join(&rack.control_url, job.id, job.token, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("already joined"), "{e}");
    // phubctl prints control's message and fails.
    let spec = rack.dir.join("bad.toml");
    std::fs::write(&spec, sum_spec("x", 300, &[1])).unwrap();
    let (ok, _, err) = rack.phubctl(&["job", "admit", spec.to_str().unwrap()]);
    assert!(!ok && err.contains("`workers` = 300"), "{err}");
    let (ok, out, _) = rack.phubctl(&["job", "list"]);
    assert!(ok && out.contains("ok"), "{out}");
    let (ok, out, _) = rack.phubctl(&["map", "show", &job.id.to_string(), "--json"]);
    assert!(ok && out.contains("chunk_elems"), "{out}");
    let (ok, _, _) = rack.phubctl(&["job", "evict", &job.id.to_string()]);
    assert!(ok);
    let (ok, _, err) = rack.phubctl(&["job", "show", &job.id.to_string()]);
    assert!(!ok && err.contains("not admitted"), "{err}");
}

#[test]
fn synchronous_sgd_on_the_appliance_equals_one_process_averaging_gradients() {
    use phub_tools::demo::{train_worker, TrainArgs};
    use phub_tools::model::reference_sgd;
    let rack = Rack::start(2, "256MiB");
    let t = TrainArgs {
        dim: 16,
        hidden: 32,
        classes: 4,
        samples: 1536,
        batch: 16,
        lr: 0.2,
        epochs: 2,
        seed: 9,
        ..TrainArgs::default()
    };
    let workers = 3;
    let job = rack.admit(&t.spec_toml(workers)).unwrap();
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..workers as u16)
            .map(|rank| {
                let (url, t) = (rack.control_url.clone(), t.clone());
                s.spawn(move || {
                    let w = Worker::join(&url, job.id, job.token, rank).unwrap();
                    train_worker(&w, &t, |_| {}).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let steps = t.epochs * phub_tools::model::steps_per_epoch(t.samples, workers, t.batch);
    let want = reference_sgd(&t.mlp(), &t.data(), t.seed, workers, t.batch, t.lr, steps);
    for (rank, got) in results.iter().enumerate() {
        assert_eq!(
            got, &results[0],
            "rank {rank} ended with other parameters than rank 0"
        );
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            for (e, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "key {k} elem {e}: appliance {a}, reference {b}"
                );
            }
        }
    }
    let (l0, _) = t.mlp().evaluate(&t.mlp().init(t.seed), &t.data());
    let (l1, _) = t.mlp().evaluate(&results[0], &t.data());
    assert!(l1 < l0, "loss did not fall: {l0} -> {l1}");
}

/// Evicting a job that its workers still use: their next request fails at
/// once with an ERROR that says the job was evicted (it used to wait out the
/// 30 s timeout).
#[test]
fn an_evicted_jobs_worker_fails_at_once_saying_so() {
    let rack = Rack::start(2, "256MiB");
    let job = rack.admit(&sum_spec("gone", 1, &[5000, 3])).unwrap();
    let w = Worker::join(&rack.control_url, job.id, job.token, 0).unwrap();
    let mut p = vec![1f32; 5000];
    let h = w.init(0, &mut p).unwrap();
    w.wait(h).unwrap();
    let (ok, out, err) = rack.phubctl(&["job", "evict", &job.id.to_string()]);
    assert!(ok, "{out}{err}");
    let g = vec![0.5f32; 5000];
    let mut out = vec![0f32; 5000];
    let t = std::time::Instant::now();
    let h = w.push_pull(0, &g, &mut out).unwrap();
    let e = w.wait(h).unwrap_err();
    let took = t.elapsed();
    assert!(
        matches!(&e, phub_worker::WorkerError::Refused { reason, .. } if reason == "evicted"),
        "{e}"
    );
    assert!(e.to_string().contains("evicted from the appliance"), "{e}");
    assert!(took < Duration::from_secs(10), "failed after {took:?}");
}

/// A child cgroup with a CPU quota of half a CPU, removed when dropped
/// (after whatever was moved into it is moved back out).
struct HalfCpu {
    dir: std::path::PathBuf,
    parent: std::path::PathBuf,
}

impl HalfCpu {
    fn make(parent: &std::path::Path, v2: bool) -> std::io::Result<HalfCpu> {
        let dir = parent.join(format!("phub-spin-test-{}", std::process::id()));
        if v2 {
            // The controller must be enabled for the parent's children.
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+cpu");
        }
        std::fs::create_dir(&dir)?;
        let cg = HalfCpu {
            dir,
            parent: parent.to_path_buf(),
        };
        if v2 {
            std::fs::write(cg.dir.join("cpu.max"), "50000 100000")?;
        } else {
            std::fs::write(cg.dir.join("cpu.cfs_period_us"), "100000")?;
            std::fs::write(cg.dir.join("cpu.cfs_quota_us"), "50000")?;
        }
        Ok(cg)
    }

    /// Moves process `pid`, every thread, into `to`.
    fn move_to(to: &std::path::Path, pid: u32) {
        std::fs::write(to.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for HalfCpu {
    fn drop(&mut self) {
        if let Ok(procs) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for p in procs.lines() {
                let _ = std::fs::write(self.parent.join("cgroup.procs"), p);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `--spin-us auto` (the default): the kernel-UDP lcores poll on for 200 us
/// past traffic while nothing limits the dataplane, stop once it is moved
/// into a cgroup whose CPU quota (half a CPU) is under one per lcore and
/// one more, and spin again once it is moved back out; `/v1/stats` says
/// which (`spin_us`). Needs root and a writable cgroup CPU controller (CI
/// has both); says why it checked nothing otherwise.
#[test]
fn auto_spin_stops_under_a_cpu_quota_and_comes_back_without_one() {
    let mut rack = Rack::start(1, "64MiB");
    let spin = |rack: &Rack| -> Option<u64> {
        let s: phub::proto::api::DataplaneStats = rack.dataplane(&mgmt::stats());
        s.spin_us
    };
    let wait_for = |rack: &Rack, want: u64, what: &str| {
        let start = std::time::Instant::now();
        let mut seen = spin(rack);
        while seen != Some(want) && start.elapsed() < Duration::from_secs(8) {
            std::thread::sleep(Duration::from_millis(100));
            seen = spin(rack);
        }
        let log = rack.dataplane.as_ref().unwrap().log_text();
        assert_eq!(seen, Some(want), "{what}; the dataplane's log:\n{log}");
    };
    let pid = rack.dataplane.as_ref().unwrap().pid();
    // The dataplane's CPU cgroup: v1's `cpu` controller where mounted
    // (a hybrid host's v2 tree then has no CPU controller), else v2's.
    let mut cgroups = phub::dataplane::spin::cpu_cgroups(&pid.to_string());
    cgroups.sort_by_key(|d| d.v2);
    let Some(phub::dataplane::spin::CgroupDir { path: home, v2, .. }) = cgroups.into_iter().next() else {
        eprintln!("SKIPPED: no cgroup CPU controller mounted here");
        return;
    };
    let quota_now = std::fs::read_to_string(home.join(if v2 { "cpu.max" } else { "cpu.cfs_quota_us" }))
        .unwrap_or_default();
    if !(quota_now.starts_with("max") || quota_now.trim() == "-1") {
        eprintln!("SKIPPED: this test's own cgroup has a CPU quota ({quota_now:?})");
        return;
    }
    wait_for(&rack, 200, "no quota: the lcore spins");
    let cg = match HalfCpu::make(&home, v2) {
        Ok(cg) => cg,
        // Not root, or a cgroup v2 tree that does not delegate the CPU
        // controller to this one's children: nothing to test here.
        Err(e) => {
            eprintln!(
                "SKIPPED: cannot make a cgroup with a CPU quota under {}: {e}",
                home.display()
            );
            return;
        }
    };
    HalfCpu::move_to(&cg.dir, pid);
    wait_for(&rack, 0, "moved under half a CPU: the lcore no longer spins");
    let log = rack.dataplane.as_ref().unwrap().log_text();
    assert!(
        log.contains("now 0 us: CPU quota 0.50 CPUs"),
        "the log names the quota:\n{log}"
    );
    HalfCpu::move_to(&home, pid);
    // An idle dataplane is not throttled at half a CPU, so no hold-off: it
    // spins again, unless the other tests running beside this one crowd
    // the CPUs (`auto` then stays off, and says so).
    let start = std::time::Instant::now();
    let crowded = |log: &str| {
        log.split("now 0 us: CPU quota 0.50 CPUs")
            .nth(1)
            .is_some_and(|after| after.contains("other threads ready to run"))
    };
    while spin(&rack) != Some(200) && start.elapsed() < Duration::from_secs(8) {
        if crowded(&rack.dataplane.as_ref().unwrap().log_text()) {
            eprintln!("moved back out: other threads crowd the CPUs, the spin stays off");
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = rack.dataplane.as_ref().unwrap().log_text();
    assert!(
        spin(&rack) == Some(200) || crowded(&log),
        "moved back out: neither spinning again nor crowded; the log:\n{log}"
    );
    drop(cg);
    rack.kill_dataplane();
}
