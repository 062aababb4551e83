//! What a job costs, measured on loopback with the real binaries: the
//! figure admission charges covers what phub-dataplane really allocates
//! (its resident set is read from /proc before and after the install), a
//! job's layout is described by rule so the state file and the join answer
//! stay the size of the spec (never O(chunks)), a spec of a million keys
//! runs, and a job over the budget by its bookkeeping alone is refused
//! with the figure.

use std::time::{Duration, Instant};

use crate::common::{Operator, Rack};
use phub::proto::api::{AdmitResponse, DataplaneInfo, JobDetail, JobMap, JoinRequest, JoinResponse};
use phub::proto::routes::{control, mgmt, ControlRoute, Route};
use phub_worker::{Worker, WorkerConfig};

/// What the dataplane may keep resident beyond what admission charged:
/// buffers of the install request (its 15 MB body, the parsed spec before
/// it is moved into the registry, each lcore's slot list) that the
/// allocator keeps for reuse rather than returning them at once. Fixed, and
/// small beside the 300-odd MB the million-key job costs (measured: 12 MB
/// over the figure for it, 0.3 MB for the 4,000,000-element key).
const SLACK: u64 = 32 << 20;

/// The resident set of process `pid`, in bytes (`VmRSS` in
/// /proc/PID/status).
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"));
    kb * 1024
}

/// A sum job over `keys` (elements each) in chunks of `chunk_bytes`, as
/// JSON (a million keys are 22 MB of TOML, over control's 16 MiB limit).
fn spec_json(name: &str, workers: u32, chunk_bytes: u32, keys: impl Iterator<Item = u64>) -> String {
    let keys: Vec<String> = keys.map(|e| format!("{{\"elements\":{e}}}")).collect();
    format!(
        "{{\"name\":\"{name}\",\"workers\":{workers},\"chunk_bytes\":{chunk_bytes},\
         \"optimizer\":{{\"kind\":\"sum\"}},\"keys\":[{}]}}",
        keys.join(",")
    )
}

fn info(rack: &Rack) -> DataplaneInfo {
    rack.dataplane(&mgmt::info())
}

/// Admits `spec` and returns the answer, the dataplane's resident set
/// before, and how much it grew, checked against the charged figure plus
/// [`SLACK`].
fn admit_measured(rack: &Rack, spec: &str) -> (AdmitResponse, u64, u64) {
    let pid = rack.dataplane.as_ref().unwrap().pid();
    let before = rss(pid);
    let job = rack.admit(spec).unwrap();
    let grew = rss(pid).saturating_sub(before);
    println!(
        "job {}: {} chunks charged {} bytes; the dataplane's RSS grew by {grew} bytes",
        job.id, job.chunks, job.memory_bytes
    );
    assert!(
        grew <= job.memory_bytes + SLACK,
        "the dataplane's RSS grew by {grew} bytes; admission charged {} (+ {SLACK} slack)",
        job.memory_bytes
    );
    (job, before, grew)
}

/// The tester's spec: a million one-element keys in 64-byte chunks (a sum,
/// so 8 bytes of data a chunk, all admission used to charge: "7.6 MiB";
/// the dataplane grew by 500 MB, control's state file reached 875 MB and
/// every join answered 87 MB).
#[test]
fn a_million_one_element_keys_are_charged_what_they_cost_and_run_a_round() {
    const KEYS: u32 = 1_000_000;
    let started = Instant::now();
    let rack = Rack::start(2, "1GiB");
    let spec = spec_json("million", 2, 64, (0..KEYS).map(|_| 1));
    let (job, before, grew) = admit_measured(&rack, &spec);
    assert_eq!(job.chunks, u64::from(KEYS));
    // Far more than the data: padded buffers, a slot record and a key
    // entry per chunk. And not a blanket overestimate: most of the figure
    // is resident once installed (buffers are zeroed, records written).
    assert!(
        job.memory_bytes > 30 * 8 * u64::from(KEYS),
        "{}",
        job.memory_bytes
    );
    assert!(
        grew > job.memory_bytes / 2,
        "RSS grew {grew} of {} charged",
        job.memory_bytes
    );
    // The dataplane counts the same bytes as used.
    assert_eq!(info(&rack).memory_used_bytes, job.memory_bytes);

    // The state file and a join answer are the spec and a few bytes per
    // lcore (not per chunk).
    let small = spec.len() as u64 + (64 << 10);
    let state = std::fs::metadata(rack.dir.join("state.json")).unwrap().len();
    assert!(
        state < small,
        "state file of {state} bytes for a spec of {}",
        spec.len()
    );
    let t = Instant::now();
    let answer = ureq::post(&format!(
        "{}{}",
        rack.control_url,
        ControlRoute::Join { job: job.id }.path()
    ))
    .send_json(JoinRequest {
        token: job.token,
        rank: 0,
        rejoin: false,
        rack: None,
    })
    .unwrap()
    .into_string_limited();
    println!(
        "join answer: {} bytes in {:?}; state file {state} bytes; spec {} bytes",
        answer.len(),
        t.elapsed(),
        spec.len()
    );
    assert!(
        (answer.len() as u64) < small,
        "a join answer of {} bytes",
        answer.len()
    );
    let join: JoinResponse = serde_json::from_str(&answer).unwrap();
    assert_eq!(join.layout.lcores.len(), 2);

    // phubctl's views answer within the response limit: per-lcore runs,
    // one key's chunks, a show listing the first keys.
    let map: JobMap = rack.send(&control::map(job.id, None));
    assert_eq!((map.keys_total, map.chunks), (u64::from(KEYS), u64::from(KEYS)));
    assert_eq!(map.lcores.iter().map(|l| l.slots).sum::<u64>(), u64::from(KEYS));
    let key: JobMap = rack.send(&control::map(job.id, Some(KEYS - 1)));
    assert_eq!(key.keys[0].runs.len(), 1);
    assert_eq!(key.keys[0].runs[0].lcore, 1);
    let show: JobDetail = rack.send(&control::job(job.id));
    assert_eq!(show.spec.keys.len() as u64 + show.keys_omitted, u64::from(KEYS));
    let (ok, out, err) = rack.phubctl(&["map", "show", &job.id.to_string()]);
    assert!(ok, "{err}");
    assert!(out.contains("1000000 chunks"), "{out}");
    let (ok, _, err) = rack.phubctl(&["job", "show", &job.id.to_string()]);
    assert!(ok, "{err}");

    // Two workers run round 0 of every key: rank 0's values reach rank 1.
    let w0 = Worker::from_join(join, job.token, WorkerConfig::default()).unwrap();
    let w1 = Worker::join(&rack.control_url, job.id, job.token, 1).unwrap();
    let t = Instant::now();
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = [&w0, &w1]
            .into_iter()
            .map(|w| {
                s.spawn(move || {
                    let mut params: Vec<f32> = (0..KEYS)
                        .map(|k| if w.rank() == 0 { (k % 1000) as f32 } else { -1.0 })
                        .collect();
                    // In batches, so that requests in flight stay bounded.
                    for (b, batch) in params.chunks_mut(20_000).enumerate() {
                        let first = (b * 20_000) as u32;
                        let handles: Vec<_> = batch
                            .chunks_mut(1)
                            .zip(first..)
                            .map(|(p, k)| w.init(k, p).unwrap())
                            .collect();
                        for h in handles {
                            w.wait(h).unwrap();
                        }
                    }
                    params
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!("round 0 of {KEYS} keys on two workers: {:?}", t.elapsed());
    assert_eq!(results[0], results[1]);
    assert!(results[1]
        .iter()
        .enumerate()
        .all(|(k, &v)| v == (k % 1000) as f32));
    // Every slot's buffers have now been written, results sent: still
    // within the figure.
    let pid = rack.dataplane.as_ref().unwrap().pid();
    let grew = rss(pid).saturating_sub(before);
    println!("the dataplane's RSS grew by {grew} bytes by the end of the round");
    assert!(
        grew <= job.memory_bytes + SLACK,
        "the dataplane's RSS grew by {grew} bytes; admission charged {} (+ {SLACK} slack)",
        job.memory_bytes
    );
    println!("whole test: {:?}", started.elapsed());
}

/// One key of 4,000,000 f32 in 64-byte chunks: 250,000 chunks of 16
/// elements. Admission used to charge its 32 MB of data ("30.5 MiB") while
/// the dataplane took about 99 MB.
#[test]
fn one_large_key_in_small_chunks_is_charged_what_it_costs() {
    let rack = Rack::start(1, "1GiB");
    let spec = spec_json("one", 2, 64, std::iter::once(4_000_000));
    let (job, _, grew) = admit_measured(&rack, &spec);
    assert_eq!(job.chunks, 250_000);
    // Twice its data: each chunk's two 64-byte lines and its slot record.
    assert!(job.memory_bytes > 2 * 32_000_000, "{}", job.memory_bytes);
    assert!(
        grew > job.memory_bytes / 2,
        "RSS grew {grew} of {} charged",
        job.memory_bytes
    );
    assert_eq!(info(&rack).memory_used_bytes, job.memory_bytes);
}

/// A job whose data fits what is free but whose slot records and padding
/// do not is refused, and the refusal gives the whole figure and the data
/// within it.
#[test]
fn a_job_over_the_budget_by_its_bookkeeping_alone_is_refused_with_the_figure() {
    let rack = Rack::start(1, "64MiB");
    // 6,000,000 elements: 48 MB of data (accumulator and result), within
    // 64 MiB; 375,000 chunks of 16, each with its padded lines and record.
    let spec = spec_json("over", 2, 64, std::iter::once(6_000_000));
    let (code, message) = rack.admit(&spec).unwrap_err();
    assert_eq!(code, 507, "{message}");
    assert!(
        message.starts_with("job needs ")
            && message.contains("of memory (45.8 MiB of chunk data; ")
            && message.ends_with("the dataplane has 64.0 MiB free of 64.0 MiB"),
        "{message}"
    );
    assert_eq!(info(&rack).memory_used_bytes, 0);
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        let jobs = rack.send(&control::jobs());
        assert!(jobs.is_empty());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `into_string` of ureq stops at 10 MB; a join answer is read whole here
/// to measure it.
trait IntoStringLimited {
    fn into_string_limited(self) -> String;
}

impl IntoStringLimited for ureq::Response {
    fn into_string_limited(self) -> String {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut self.into_reader(), &mut s).unwrap();
        s
    }
}
