//! `phub-bench run` end to end: a local appliance (phub-dataplane and
//! phub-control as child processes), emulated workers, verification of every
//! result, the JSON report; `--procs`; a sweep with its plot. No timed
//! assertions: figures are only checked to be present and sane.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// A file `name` in a directory of its own under the temporary directory,
/// which goes (with whatever else was written into it) when this is
/// dropped.
struct Scratch {
    dir: PathBuf,
    file: PathBuf,
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.file
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.file
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("phub-bench-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Scratch {
        file: dir.join(name),
        dir,
    }
}

fn bench(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_phub-bench"))
        .args(args)
        .output()
        .expect("running phub-bench");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn num(v: &Value, k: &str) -> f64 {
    v[k].as_f64()
        .unwrap_or_else(|| panic!("{k} is not a number: {}", v[k]))
}

#[test]
fn local_run_verifies_and_writes_the_json() {
    let json = scratch("run.json");
    let (ok, out) = bench(&[
        "run",
        "--local",
        "--model",
        "synthetic:100000",
        "--workers",
        "2",
        "--rounds",
        "3",
        "--verify",
        "--json",
        json.to_str().unwrap(),
        "--ceiling-rounds",
        "1",
        "--quiet",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("median ms"), "the table is printed: {out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["model"], "synthetic:100000");
    assert_eq!(v["workers"], 2);
    assert_eq!(v["backend"], "udp");
    assert_eq!(v["rounds"], 3);
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["mismatches"], 0);
    assert_eq!(v["model_bytes"], 400_000);
    for k in [
        "round_ms_median",
        "round_ms_p99",
        "goodput_gbps",
        "appliance_gbps_in",
        "appliance_gbps_out",
        "efficiency",
    ] {
        assert!(num(&v, k) > 0.0, "{k} = {}", v[k]);
    }
    assert!(num(&v, "round_ms_p99") >= num(&v, "round_ms_median"));
    assert!(v["efficiency_bound"].as_str().unwrap().contains("UDP echo"));
    // Two workers, three timed rounds each.
    assert_eq!(v["round_ms"].as_array().unwrap().len(), 2);
    assert!(v["round_ms"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r.as_array().unwrap().len() == 3));
    // The appliance saw both workers' pushes of the timed rounds.
    assert!(v["appliance"]["rx_bytes"].as_u64().unwrap() >= 2 * 3 * 400_000);
    assert!(v["machine"]["cpu_model"].is_string());
    assert!(v["machine"]["logical_cpus"].as_u64().unwrap() >= 1);
    assert!(v["commit"].is_string());
    assert_eq!(v["arguments"]["workers"], 2);
    assert!(v["argv"].as_array().unwrap().iter().any(|a| a == "--verify"));
    let _ = std::fs::remove_file(&json);
}

/// `sparse --local --baseline tcp-ps`: two worker threads push a table's
/// rows end to end, then the same draws go to the TCP row server; the
/// JSON states both rates and their ratio, the rows the appliance stores
/// (no more than the ids drawn, no more than the cap), the bytes per
/// row (a row and its id each way at least), and with `--verify` that
/// every rank's rows, every step, were the reference table's.
#[test]
fn sparse_local_pushes_rows_end_to_end_and_writes_the_json() {
    let json = scratch("sparse.json");
    let (ok, out) = bench(&[
        "sparse",
        "--local",
        "--workers",
        "2",
        "--rows",
        "1000",
        "--dim",
        "4",
        "--batch",
        "64",
        "--steps",
        "5",
        "--baseline",
        "tcp-ps",
        "--verify",
        "--take-checkpoint",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((v["workers"].as_u64(), v["steps"].as_u64()), (Some(2), Some(5)));
    // Two checkpoints of the same rows (nothing pushed between): the same
    // bytes, at least each stored row's id, touch word, values and
    // Adagrad state (12 + 4 x (4 + 4) bytes); memory sampled.
    let c = v["checkpoints"].as_array().unwrap();
    assert_eq!(c.len(), 2, "{v}");
    assert_eq!(c[0]["bytes"], c[1]["bytes"]);
    let rows = v["rows_stored"].as_u64().unwrap();
    assert!(c[0]["bytes"].as_u64().unwrap() > rows * 44, "{v}");
    // Then the dataplane restarted and the job restored from the file.
    assert_eq!(v["restore"]["bytes"], c[1]["bytes"], "{v}");
    assert!(num(&v["restore"], "seconds") > 0.0, "{v}");
    for c in c.iter().chain([&v["restore"]]) {
        for who in ["dataplane", "control"] {
            let (before, peak) = (
                c[format!("{who}_rss_before")].as_u64().unwrap(),
                c[format!("{who}_rss_peak")].as_u64().unwrap(),
            );
            assert!(before > 0 && peak >= before, "{who}: {c}");
        }
    }
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["baseline"], "tcp-ps");
    for k in ["baseline_row_updates_per_s", "speedup_vs_baseline"] {
        assert!(num(&v, k) > 0.0, "{k} = {}", v[k]);
    }
    for k in ["row_updates_per_s", "round_ms_median", "wire_bytes_per_row"] {
        assert!(num(&v, k) > 0.0, "{k} = {}", v[k]);
    }
    // The steps' tail: percentiles in order, the baseline's too.
    for who in ["", "baseline_"] {
        let at = |q: &str| num(&v, &format!("{who}round_ms_{q}"));
        assert!(at("median") <= at("p90") && at("p90") <= at("p99"), "{who}: {v}");
    }
    assert!(num(&v, "round_ms_p99") <= num(&v, "round_ms_max"), "{v}");
    // The machine's CPU a row, both sides: read from /proc/stat (in ticks
    // of 10 ms: five short steps may not see one).
    for k in ["cpu_us_per_row", "baseline_cpu_us_per_row"] {
        assert!(v[k].as_f64().is_some_and(|x| x >= 0.0), "{k} = {}", v[k]);
    }
    let stored = v["rows_stored"].as_u64().unwrap();
    assert!((64..=1000).contains(&stored), "rows stored: {stored}");
    // The dataplane's memory, and the job's charge: its table at the cap
    // of 2,000 rows (--verify doubles it) of 4 values and 4 of Adagrad
    // state, at least.
    assert!(v["rss_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(v["charged_bytes"].as_u64().unwrap() >= 2000 * 32, "{v}");
    assert!(num(&v, "wire_bytes_per_row") >= 2.0 * (4.0 * 4.0 + 8.0), "{v}");
}

/// `sparse --local` on a small table (W = 2, 2 lcores, 1,000 rows of
/// D = 4, 300 ids a step, 4 steps) with `flags`: its output and JSON.
fn small_sparse_local(flags: &[&str]) -> (String, Value) {
    let json = scratch(&format!("sparse{}.json", flags.join("")));
    let mut args = vec![
        "sparse",
        "--local",
        "--workers",
        "2",
        "--lcores",
        "2",
        "--rows",
        "1000",
        "--dim",
        "4",
        "--batch",
        "300",
        "--steps",
        "4",
    ];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--json", json.to_str().unwrap()]);
    let (ok, out) = bench(&args);
    assert!(ok, "{out}");
    let v = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (out, v)
}

/// [`small_sparse_local`], run again (up to 5 runs in all) until none of
/// its messages was sent twice: its wire bytes per row are then the
/// messages' own, which a comparison of two runs' bytes needs (a
/// retransmitted message counts twice, and a loaded machine's loopback
/// drops some: `make test` once saw 5.8 bytes a row more in one run).
fn sparse_local_without_resends(flags: &[&str]) -> (String, Value) {
    let mut last = small_sparse_local(flags);
    for _ in 1..5 {
        if last.1["row_retransmits"].as_u64() == Some(0) {
            break;
        }
        last = small_sparse_local(flags);
    }
    last
}

/// `sparse --local --optimizer NAME`: the job's table, the TCP row server
/// and the reference all run that optimizer: every rank's rows, every
/// step, are the reference's; the JSON and the output name it; `--quiet`
/// changes nothing but the progress bar.
#[test]
fn sparse_local_runs_the_optimizer_it_is_given() {
    for name in ["adam", "ftrl"] {
        let (out, v) =
            small_sparse_local(&["--verify", "--optimizer", name, "--baseline", "tcp-ps", "--quiet"]);
        assert_eq!(v["verified"], true, "{name}: {v}");
        assert_eq!(v["optimizer"], name, "{v}");
        assert!(num(&v, "baseline_row_updates_per_s") > 0.0, "{v}");
        assert!(out.contains(&format!("x 4 ({name})")), "{out}");
    }
}

/// Key caching end to end (PROTOCOL.md §10.7): the same fixed ids every
/// step, once sent with every message and once registered with
/// `cache_ids`: both runs' rows verified against the reference (so a
/// cached message applies the rows of its list's ids), and the cached
/// run moves fewer bytes per row by the ids it left out, less its
/// prefixes.
#[test]
fn sparse_local_with_cached_ids_moves_fewer_bytes_and_the_same_rows() {
    let fixed = sparse_local_without_resends(&["--verify", "--fixed-ids"]).1;
    let cached = sparse_local_without_resends(&["--verify", "--cache-ids"]).1;
    for v in [&fixed, &cached] {
        assert_eq!(v["verified"], true, "{v}");
        assert_eq!(v["fixed_ids"], true, "{v}");
    }
    assert_eq!(
        (fixed["cache_ids"].as_bool(), cached["cache_ids"].as_bool()),
        (Some(false), Some(true))
    );
    assert_eq!(num(&fixed, "key_cache_id_bytes_saved_per_row"), 0.0);
    // Every timed message and answer names its list: 8 bytes an id each
    // way, a ROW_PUSH and its ROW_RESULT.
    let saved = num(&cached, "key_cache_id_bytes_saved_per_row");
    assert_eq!(saved, 16.0, "{cached}");
    let prefixes = num(&cached, "key_cache_prefix_bytes_per_row");
    assert!(prefixes > 0.0 && prefixes < 2.0, "{cached}");
    assert_cached_run_saves_its_ids(&fixed, &cached, saved, prefixes);
}

/// `--pull-only`: the timed steps pull (no updates), and pulls of a
/// registered id list carry no ids either way (the ROW_PULL is its prefix
/// alone, its answer the rows): fewer bytes per row by the ids left out,
/// less the prefixes.
#[test]
fn sparse_local_pulls_of_cached_ids_carry_no_ids() {
    let run = |flag: &str| -> Value {
        let (out, v) = sparse_local_without_resends(&["--pull-only", flag]);
        assert!(out.contains("row lookups/s (pulls only)"), "{out}");
        v
    };
    let fixed = run("--fixed-ids");
    let cached = run("--cache-ids");
    for v in [&fixed, &cached] {
        assert_eq!(v["pull_only"], true, "{v}");
        assert_eq!(num(v, "row_updates_per_s"), 0.0, "{v}");
        assert!(num(v, "row_lookups_per_s") > 0.0, "{v}");
    }
    let saved = num(&cached, "key_cache_id_bytes_saved_per_row");
    let prefixes = num(&cached, "key_cache_prefix_bytes_per_row");
    assert!(saved >= 8.0 && prefixes > 0.0, "{cached}");
    assert_cached_run_saves_its_ids(&fixed, &cached, saved, prefixes);
}

/// `--pull-only --dense-pull`: after the table's pulls, the same ranks
/// pull a dense key of `--batch` x `--dim` elements in a job of its own;
/// the JSON has its median step and the table pull's ratio to it (null
/// without the flag).
#[test]
fn sparse_local_times_a_dense_pull_of_the_same_values() {
    let (out, v) = small_sparse_local(&["--pull-only", "--dense-pull"]);
    assert!(out.contains("a dense key of 300 x 4 elements pulled"), "{out}");
    let dense = num(&v, "dense_pull_ms_median");
    assert!(dense > 0.0, "{v}");
    let ratio = num(&v, "pull_vs_dense");
    assert!((ratio - num(&v, "round_ms_median") / dense).abs() < 1e-9, "{v}");
    // The lcores' spin at the end of each phase, as the dataplane says
    // (`auto`: its governor's choice); a fixed one holds for both.
    assert!(v["spin_us"].is_u64() && v["dense_spin_us"].is_u64(), "{v}");
    let (out, fixed) = small_sparse_local(&["--pull-only", "--dense-pull", "--dataplane-arg=--spin-us=37"]);
    assert_eq!(
        (num(&fixed, "spin_us"), num(&fixed, "dense_spin_us")),
        (37.0, 37.0),
        "{fixed}"
    );
    assert!(out.contains("of the dense pulls: 37 us"), "{out}");
    let (_, plain) = small_sparse_local(&["--pull-only"]);
    assert!(
        plain["dense_pull_ms_median"].is_null()
            && plain["pull_vs_dense"].is_null()
            && plain["dense_spin_us"].is_null(),
        "{plain}"
    );
}

/// The cached run moved fewer wire bytes per row than the run with the
/// ids sent by the id bytes it left out (`saved`), less its prefixes.
fn assert_cached_run_saves_its_ids(fixed: &Value, cached: &Value, saved: f64, prefixes: f64) {
    let resent = |v: &Value| v["row_retransmits"].as_u64().unwrap_or(u64::MAX);
    if resent(fixed) > 0 || resent(cached) > 0 {
        // Five runs each and still resends: the machine is too loaded
        // for a comparison of bytes (the rest was checked).
        eprintln!(
            "wire bytes per row not compared: {} and {} messages resent in the runs",
            resent(fixed),
            resent(cached)
        );
        return;
    }
    let (with, without) = (
        num(cached, "wire_bytes_per_row"),
        num(fixed, "wire_bytes_per_row"),
    );
    assert!(
        (without - with - (saved - prefixes)).abs() < 1.0,
        "wire bytes per row {without} without, {with} with key caching: {saved} saved, {prefixes} of prefixes"
    );
}

/// `sparse --engine-only --checkpoint DIR`: two lcores' stores filled,
/// updated and read, then written to one checkpoint file each, dropped
/// and restored (row-wise Adagrad: one accumulator a row): the JSON
/// states the rows and bytes written (a header, a record per row of its
/// id, touch, values and accumulator, and a checksum, per file) and that
/// the restored rows are the written ones.
#[test]
fn sparse_engine_only_checkpoints_and_restores_its_stores() {
    let json = scratch("sparse-ckpt.json");
    let dir = scratch("sparse-ckpt");
    let (ok, out) = bench(&[
        "sparse",
        "--engine-only",
        "--lcores",
        "2",
        "--rows",
        "3000",
        "--dim",
        "4",
        "--batch",
        "64",
        "--ops",
        "2000",
        "--optimizer",
        "adagrad-rowwise",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let c = &v["checkpoint"];
    assert_eq!(c["verified"], true, "{v}");
    assert_eq!(c["rows"].as_u64(), Some(3000), "{v}");
    assert_eq!(c["rows"], v["rows_stored"], "{v}");
    let files: u64 = ["lcore-0.ckpt", "lcore-1.ckpt"]
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).unwrap().len())
        .sum();
    assert_eq!(c["bytes"].as_u64(), Some(files), "{v}");
    // Row-wise: 32 bytes a row, not element-wise Adagrad's 44.
    assert!(
        files > 3000 * (8 + 4 + 4 * 4 + 4) && files < 3000 * (8 + 4 + 4 * 8),
        "{files} bytes for 3000 rows"
    );
    assert_eq!(v["optimizer"], "adagrad-rowwise", "{v}");
    for k in [
        "write_s",
        "restore_s",
        "restore_rows_per_s",
        "rss_bytes_after_restore",
    ] {
        assert!(num(c, k) > 0.0, "{k} = {}", c[k]);
    }
}

#[test]
fn injected_faults_still_verify_and_are_reported() {
    let json = scratch("inject.json");
    let spec = "loss=0.05,dup=0.01,reorder=0.01,seed=3";
    let (ok, out) = bench(&[
        "run",
        "--local",
        "--model",
        "synthetic:100000",
        "--workers",
        "2",
        "--rounds",
        "3",
        "--inject",
        spec,
        "--verify",
        "--json",
        json.to_str().unwrap(),
        "--no-ceiling",
        "--quiet",
    ]);
    assert!(ok, "{out}");
    assert!(out.contains(&format!("faults injected ({spec})")), "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["mismatches"], 0);
    assert_eq!(v["inject"], spec);
    assert_eq!(v["arguments"]["inject"], spec);
    // The workers lost, duplicated and reordered datagrams, and recovered.
    let w = &v["worker_injected"];
    assert!(
        w["drops"].as_u64().unwrap() > 0 && w["dups"].as_u64().unwrap() > 0,
        "{w}"
    );
    assert!(v["retransmits"].as_u64().unwrap() > 0, "{v}");
    // So did the local dataplane (its counters cover the timed rounds).
    let d = &v["appliance"]["injected"];
    assert!(d["drops"].as_u64().unwrap() > 0, "{}", v["appliance"]);
    let _ = std::fs::remove_file(&json);
}

#[test]
fn worker_processes_and_a_sweep_with_its_plot() {
    let json = scratch("sweep.json");
    let svg = scratch("sweep.svg");
    let (ok, out) = bench(&[
        "run",
        "--local",
        "--model",
        "uniform:3:20000",
        "--procs",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--verify",
        "--no-ceiling",
        "--sweep",
        "workers=1,2",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["sweep"]["variable"], "workers");
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for (p, w) in points.iter().zip([1, 2]) {
        assert_eq!(p["workers"], w);
        assert_eq!(p["procs"], true);
        assert_eq!(p["verified"], true);
        assert_eq!(p["tensors"], 3);
        assert!(p["efficiency"].is_null(), "no ceiling asked for");
    }
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("polyline") && plot.contains("workers W"));
    let _ = std::fs::remove_file(&json);
    let _ = std::fs::remove_file(&svg);
}

/// `--shm`: the local dataplane starts with `--shm`, the workers pass
/// chunks through shared memory (the join fails otherwise), every result
/// verifies, and the report says so.
#[test]
fn shared_memory_run_verifies_and_says_so() {
    let json = scratch("shm.json");
    let (ok, out) = bench(&[
        "run",
        "--local",
        "--shm",
        "--model",
        "synthetic:100000",
        "--workers",
        "2",
        "--rounds",
        "3",
        "--verify",
        "--json",
        json.to_str().unwrap(),
        "--no-ceiling",
        "--quiet",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("chunk 8192 B, shm,"),
        "the header line says shm: {out}"
    );
    assert!(
        out.contains("shm = chunks and results through shared memory"),
        "{out}"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["shm"], true, "{v}");
    assert_eq!(v["arguments"]["shm"], true);
    assert_eq!(v["verified"], true, "{v}");
    // Headers only reached the dataplane's sockets: far fewer bytes than
    // the pushes' payloads (2 workers x 3 rounds x 400 kB).
    let rx = v["appliance"]["rx_bytes"].as_u64().unwrap();
    assert!(rx > 0 && rx < 2 * 3 * 400_000 / 10, "rx_bytes {rx}");
    let _ = std::fs::remove_file(&json);
}

#[test]
fn bad_arguments_say_what_is_accepted() {
    let (ok, out) = bench(&["run", "--model", "resnet-51", "--rounds", "1"]);
    assert!(!ok);
    assert!(out.contains("resnet50, vgg16, bert-base, bert-large"), "{out}");
    let (ok, out) = bench(&["run", "--model", "synthetic:10", "--sweep", "speed=1,2"]);
    assert!(!ok);
    assert!(out.contains("accepted variables"), "{out}");
    let (ok, out) = bench(&["run", "--model", "synthetic:10", "--backend", "dpdk", "--shm"]);
    assert!(!ok);
    assert!(
        out.contains("--shm with --backend dpdk") && out.contains("--backend udp"),
        "{out}"
    );
}

/// The processes holding a file under `dir` open, or naming it on their
/// command line (phub-control's `--state`).
fn holders(dir: &std::path::Path) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let named = String::from_utf8_lossy(&cmdline).contains(&*dir.to_string_lossy());
        let open = std::fs::read_dir(e.path().join("fd"))
            .map(|fds| {
                fds.flatten()
                    .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t.starts_with(dir)))
            })
            .unwrap_or(false);
        if named || open {
            out.push(pid);
        }
    }
    out
}

/// `phub-bench run --local` stopped by SIGTERM (or SIGINT, SIGHUP) stops the
/// phub-dataplane and phub-control it started and removes its scratch
/// directory (it used to orphan both, and leave the directory behind).
#[test]
fn a_local_run_stopped_by_a_signal_leaves_no_daemon_or_directory() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_phub-bench"))
        .args([
            "run",
            "--local",
            "--model",
            "resnet50",
            "--workers",
            "1",
            "--rounds",
            "100000",
            "--no-ceiling",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let prefix = format!("phub-bench-{}-", child.id());
    let t = std::time::Instant::now();
    let dir = loop {
        let found = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path());
        // Both daemons up: control's state file exists.
        if let Some(d) = found.filter(|d| d.join("control-state.json.operator-token").exists()) {
            break d;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "the appliance never came up"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(
        !holders(&dir).is_empty(),
        "the daemons hold files in {}",
        dir.display()
    );
    // SAFETY: kill(2) on our own child; no memory is involved.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{status}");
    assert!(!dir.exists(), "{} is left behind", dir.display());
    let left = holders(&dir);
    assert!(
        left.is_empty(),
        "processes still holding {}: {left:?}",
        dir.display()
    );
}
