//! phub-control end to end: a real `Daemon` on 127.0.0.1:0 against a fake
//! dataplane management API, driven over HTTP.

use std::path::Path;
use std::time::Duration;

use crate::client::{call, err, err_at, ok_at, wait_for};
use crate::fake::{Fake, FakeConfig, TempState, BASE_PORT};
use phub_control::daemon::{Config, Daemon};
use phub_proto::api::{AdmitResponse, ApiError, JobDetail, JobMap, JobSummary, JoinResponse, Stats};
use phub_proto::layout::{Place, Placement};
use phub_proto::memory::{MemoryModel, ResultStore};
use phub_proto::routes::{ControlRoute as R, MgmtRoute, Route};
use phub_proto::spec::JobSpec;

const SPEC: &str = r#"
name = "toy"
workers = 4
chunk_bytes = 1024
[optimizer]
kind = "sum"
[[keys]]
name = "a"
elements = 1000
[[keys]]
name = "b"
elements = 5000
[[keys]]
elements = 300
"#;

fn spec_json(name: &str, workers: u32, elements: u64) -> String {
    format!(
        r#"{{"name": "{name}", "workers": {workers}, "chunk_bytes": 1024,
            "optimizer": {{"kind": "sgd", "lr": 0.1}}, "keys": [{{"elements": {elements}}}]}}"#
    )
}

fn temp_state(tag: &str) -> TempState {
    TempState::new("phub-control-test", tag)
}

/// Starts a daemon on loopback over `dataplane` and `state`.
fn start(dataplane: &str, state: &Path) -> anyhow::Result<Daemon> {
    Daemon::start(Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        dataplane: dataplane.to_string(),
        state: state.to_path_buf(),
        reconcile_interval: Duration::from_millis(100),
        ..Config::default()
    })
}

fn daemon(dataplane: &str, state: &Path) -> Daemon {
    start(dataplane, state).unwrap()
}

/// The operator token the daemon generated beside its state file.
fn operator_token(d: &Daemon) -> String {
    d.operator_token().to_string()
}

fn list(d: &Daemon) -> Vec<JobSummary> {
    ok_at(d, &R::Jobs, None)
}

#[test]
fn admit_toml_and_json_then_list_show_map() {
    let fake = Fake::start(FakeConfig::lcores(4));
    let state = temp_state("admit");
    let d = daemon(&fake.url(), &state);

    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    assert_eq!(a.id, 1);
    assert_ne!(a.token, 0);
    assert_eq!(a.chunks, 4 + 20 + 2);
    assert_eq!(a.lcores, vec![0, 1, 2, 3]);
    let b: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec_json("js", 2, 2560)));
    assert_eq!(b.id, 2);
    assert_eq!(b.chunks, 10);

    // The fake has both, each over every lcore, and bytes are balanced
    // across the two jobs together.
    let jobs = fake.jobs();
    assert_eq!(jobs.len(), 2);
    assert_eq!(jobs[&1].token, a.token);
    assert_eq!(jobs[&2].token, b.token);
    let mut total = vec![0u64; 4];
    let mut biggest = 0;
    for j in jobs.values() {
        assert_eq!(j.layout.lcores.len(), 4);
        assert!(
            j.layout.lcores.iter().all(|s| !s.is_empty()),
            "job {} skips an lcore",
            j.id
        );
        // What the fake reports its dataplane allocates.
        let model = MemoryModel::default();
        for (t, b) in total
            .iter_mut()
            .zip(model.job_cost(&j.spec, &j.layout, ResultStore::Slot).lcores)
        {
            *t += b;
        }
        biggest = biggest.max(model.chunk_cost(&j.spec, ResultStore::Slot)(j.spec.chunk_elems()));
    }
    // Each job's runs are cut to the nearest chunk: within a chunk a job.
    let (lo, hi) = (total.iter().min().unwrap(), total.iter().max().unwrap());
    assert!(hi - lo <= 2 * biggest, "unbalanced: {total:?}");

    let l = list(&d);
    assert_eq!(l.iter().map(|j| j.id).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(l[0].name, "toy");
    assert_eq!(l[0].keys, 3);
    assert_eq!(l[0].optimizer, "sum");
    assert_eq!(l[1].optimizer, "sgd");
    assert!(l.iter().all(|j| j.installed));

    let show: JobDetail = ok_at(&d, &R::Job { job: 1 }, None);
    assert_eq!(show.summary, l[0]);
    assert_eq!(show.spec, JobSpec::from_toml(SPEC).unwrap());
    assert_eq!(show.ranks.len(), 4);
    assert_eq!(show.ranks[0].silent_ms, Some(250));
    assert_eq!(show.ranks[1].silent_ms, None);
    assert_eq!(show.rounds_completed, 42);
    assert_eq!(show.round_range, Some((3, 5)));

    let map: JobMap = ok_at(&d, &R::Map { job: 1, key: None }, None);
    assert_eq!(map.chunk_elems, 256);
    assert_eq!(map.lcores.len(), 4);
    for (i, l) in map.lcores.iter().enumerate() {
        assert_eq!((l.lcore, l.port), (i as u16, BASE_PORT + i as u16));
    }
    assert_eq!(map.lcores.iter().map(|l| l.slots).sum::<u64>(), 26);
    assert_eq!(
        (map.keys_total, map.chunks, map.memory_bytes),
        (3, 26, a.memory_bytes)
    );
    assert!(map.keys.is_empty(), "keys only when one is asked for");
    // One key's chunks, as runs on lcores: where the layout's rule puts them.
    let key: JobMap = ok_at(&d, &R::Map { job: 1, key: Some(1) }, None);
    assert_eq!(key.lcores, map.lcores);
    let k = &key.keys[0];
    assert_eq!((k.key, k.name.as_str(), k.elements, k.first), (1, "b", 5000, 4));
    let places: Vec<Place> = k
        .runs
        .iter()
        .flat_map(|r| {
            (0..r.count).map(move |i| Place {
                lcore: r.lcore,
                slot: r.slot + i,
            })
        })
        .collect();
    let chunks: Vec<u32> = k.runs.iter().flat_map(|r| r.chunk..r.chunk + r.count).collect();
    assert_eq!(chunks, (0..20).collect::<Vec<_>>());
    let placed = Placement::new(&jobs[&1].spec, jobs[&1].layout.clone()).unwrap();
    assert_eq!(places, placed.places(1).collect::<Vec<_>>());
    let e = err_at(&d, &R::Map { job: 1, key: Some(3) }, None, 404);
    assert_eq!(e, "job 1 has no key 3; its keys are 0 to 2");
    let e = err(&d, "GET", "/v1/jobs/1/map/keys/x", None, 400);
    assert!(e.contains("\"x\" is not a key index"), "{e}");

    let stats: Stats = ok_at(&d, &R::Stats, None);
    assert!(stats.dataplane.is_some() && stats.dataplane_error.is_none());
    assert_eq!(stats.jobs.len(), 2);
    d.shutdown();
}

#[test]
fn bad_requests_are_named() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("bad");
    let d = daemon(&fake.url(), &state);
    let e = err_at(
        &d,
        &R::Admit,
        Some(&SPEC.replace("workers = 4", "workers = 0")),
        400,
    );
    assert!(e.contains("`workers` = 0") && e.contains("1 to 256"), "{e}");
    let e = err_at(&d, &R::Admit, Some("{\"name\": 1"), 400);
    assert!(e.contains("invalid job spec"), "{e}");
    let e = err(&d, "GET", "/v1/jobs/abc", None, 400);
    assert!(e.contains("\"abc\"") && e.contains("1 to 65535"), "{e}");
    let e = err(&d, "GET", "/v1/jobs/0", None, 400);
    assert!(e.contains("\"0\""), "{e}");
    let e = err(&d, "GET", "/v1/nothing", None, 404);
    assert!(e.contains("no route for GET /v1/nothing"), "{e}");
    let e = err(&d, "PATCH", "/v1/jobs", None, 405);
    assert!(e.contains("GET, POST"), "{e}");
    let e = err_at(&d, &R::Job { job: 9 }, None, 404);
    assert_eq!(e, "job 9 is not admitted");
    let e = err_at(&d, &R::Map { job: 9, key: None }, None, 404);
    assert_eq!(e, "job 9 is not admitted");
    let e = err_at(&d, &R::Evict { job: 9 }, None, 404);
    assert_eq!(e, "job 9 is not admitted");
    // A body over the limit is refused from its Content-Length, before it
    // is read (a client that goes on writing it then finds the connection
    // closed: only the head is sent here).
    let head = format!(
        "{} {} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n",
        R::Admit.method(),
        R::Admit.path(),
        operator_token(&d),
        phub_control::daemon::MAX_BODY_BYTES + 1
    );
    let mut conn = std::net::TcpStream::connect(d.addr()).unwrap();
    std::io::Write::write_all(&mut conn, head.as_bytes()).unwrap();
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut conn, &mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("larger than the limit"), "{answer}");
    assert!(fake.jobs().is_empty());
    assert!(list(&d).is_empty());
    assert!(!state.exists(), "nothing admitted, nothing written");
}

#[test]
fn over_budget_is_refused_and_nothing_installed() {
    let fake = Fake::start(FakeConfig {
        budget: 20_000,
        ..FakeConfig::lcores(2)
    });
    let state = temp_state("budget");
    let d = daemon(&fake.url(), &state);
    let e = err_at(&d, &R::Admit, Some(SPEC), 507);
    assert!(
        e.starts_with("job needs ")
            && e.contains("of memory (49.2 KiB of chunk data;")
            && e.ends_with("the dataplane has 19.5 KiB free of 19.5 KiB"),
        "{e}"
    );
    assert!(fake.jobs().is_empty());
    assert!(list(&d).is_empty());
    // A job that fits still goes in.
    let _: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec_json("small", 1, 256)));
    assert_eq!(fake.jobs().len(), 1);
}

#[test]
fn dataplane_down_or_refusing_records_nothing() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let state = temp_state("down");
    let d = daemon(&format!("http://127.0.0.1:{port}"), &state);
    let e = err_at(&d, &R::Admit, Some(SPEC), 502);
    assert!(
        e.contains("cannot reach the dataplane at http://127.0.0.1:"),
        "{e}"
    );
    assert!(list(&d).is_empty());
    assert!(!state.exists());
    let stats: Stats = ok_at(&d, &R::Stats, None);
    assert!(stats.dataplane.is_none());
    assert!(stats
        .dataplane_error
        .unwrap()
        .contains("cannot reach the dataplane"));
    d.shutdown();

    let fake = Fake::start(FakeConfig::lcores(2));
    fake.state.lock().unwrap().refuse = Some("ring allocation failed".into());
    let d = daemon(&fake.url(), &state);
    let e = err_at(&d, &R::Admit, Some(SPEC), 502);
    assert!(
        e.contains("ring allocation failed")
            && e.contains(&format!("PUT {}", MgmtRoute::Install { job: 1 }.path())),
        "{e}"
    );
    assert!(list(&d).is_empty());
    assert!(fake.jobs().is_empty());
}

#[test]
fn join_checks_job_token_and_rank() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("join");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    let join = |token: u64, rank: u16| format!("{{\"token\": \"{token:016x}\", \"rank\": {rank}}}");

    let j: JoinResponse = ok_at(&d, &R::Join { job: 1 }, Some(&join(a.token, 2)));
    assert_eq!((j.job, j.rank), (1, 2));
    assert_eq!(j.spec.name, "toy");
    assert_eq!(j.layout, fake.jobs()[&1].layout);
    assert_eq!(
        (j.dataplane.host.as_str(), j.dataplane.base_port),
        ("127.0.0.1", BASE_PORT)
    );

    let e = err_at(&d, &R::Join { job: 7 }, Some(&join(a.token, 0)), 404);
    assert_eq!(e, "job 7 is not admitted");
    let e = err_at(&d, &R::Join { job: 1 }, Some(&join(a.token ^ 1, 0)), 403);
    assert_eq!(e, "wrong token for job 1");
    let e = err_at(&d, &R::Join { job: 1 }, Some(&join(a.token, 5)), 400);
    assert_eq!(e, "rank 5 is outside 0..=3 for job 1 (workers = 4)");
    let e = err_at(&d, &R::Join { job: 1 }, Some(&join(a.token, 2)), 409);
    assert_eq!(
        e,
        "rank 2 has already joined job 1 (a restarted worker rejoins with \"rejoin\": true)"
    );
    let e = err_at(&d, &R::Join { job: 1 }, Some("{\"rank\": 1}"), 400);
    assert!(e.contains("invalid join request") && e.contains("token"), "{e}");

    let l = list(&d);
    assert_eq!(l[0].joined, vec![2]);
    let show: JobDetail = ok_at(&d, &R::Job { job: 1 }, None);
    assert!(show.ranks[2].joined && !show.ranks[0].joined);
}

/// A join answer states the job's share of each lcore's receive buffer:
/// the buffer times its W over the W of every admitted job with chunks on
/// that lcore, so that all their workers' windows together fit it.
#[test]
fn the_join_answer_shares_the_receive_buffer_among_the_jobs_on_an_lcore() {
    let fake = Fake::start(FakeConfig::lcores(1));
    let state = temp_state("share");
    let d = daemon(&fake.url(), &state);
    let join = |job: u16, token: u64, rank: u16, rejoin: bool| -> Option<u64> {
        let body = format!("{{\"token\": \"{token:016x}\", \"rank\": {rank}, \"rejoin\": {rejoin}}}");
        let j: JoinResponse = ok_at(&d, &R::Join { job }, Some(&body));
        j.appliances[0].rx_buffer_bytes
    };
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec_json("a", 2, 100)));
    assert_eq!(
        join(a.id, a.token, 0, false),
        Some(crate::fake::FAKE_RX_BUFFER),
        "alone: the whole buffer"
    );
    let b: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec_json("b", 6, 100)));
    assert_eq!(
        join(b.id, b.token, 0, false),
        Some(crate::fake::FAKE_RX_BUFFER * 6 / 8)
    );
    assert_eq!(
        join(a.id, a.token, 1, false),
        Some(crate::fake::FAKE_RX_BUFFER * 2 / 8)
    );
    // Once b is gone, a worker of a that joins again gets the whole buffer.
    let _: JobSummary = ok_at(&d, &R::Evict { job: b.id }, None);
    assert_eq!(join(a.id, a.token, 0, true), Some(crate::fake::FAKE_RX_BUFFER));
}

#[test]
fn evict_removes_from_both() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("evict");
    let d = daemon(&fake.url(), &state);
    let _: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    let b: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec_json("b", 1, 10)));
    let gone: JobSummary = ok_at(&d, &R::Evict { job: 1 }, None);
    assert_eq!((gone.id, gone.name.as_str(), gone.installed), (1, "toy", false));
    assert_eq!(fake.jobs().keys().copied().collect::<Vec<_>>(), vec![b.id]);
    assert_eq!(list(&d).iter().map(|j| j.id).collect::<Vec<_>>(), vec![b.id]);
    err_at(&d, &R::Evict { job: 1 }, None, 404);
    // The smallest free id is reused.
    let c: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    assert_eq!(c.id, 1);
    // A job the dataplane already lost is still evicted.
    fake.state.lock().unwrap().jobs.remove(&b.id);
    let _: JobSummary = ok_at(&d, &R::Evict { job: b.id }, None);
    assert_eq!(list(&d).len(), 1);
}

#[test]
fn restart_keeps_jobs_and_joined_ranks() {
    let fake = Fake::start(FakeConfig::lcores(3));
    let state = temp_state("restart");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    let join = format!("{{\"token\": \"{:016x}\", \"rank\": 1}}", a.token);
    let _: JoinResponse = ok_at(&d, &R::Join { job: 1 }, Some(&join));
    let before = list(&d);
    d.shutdown();

    let d = daemon(&fake.url(), &state);
    assert_eq!(list(&d), before);
    assert_eq!(list(&d)[0].joined, vec![1]);
    let e = err_at(&d, &R::Join { job: 1 }, Some(&join), 409);
    assert_eq!(
        e,
        "rank 1 has already joined job 1 (a restarted worker rejoins with \"rejoin\": true)"
    );
    // The dataplane kept the job; control did not reinstall or remove it.
    assert_eq!(fake.jobs()[&1].token, a.token);
    assert!(!fake
        .state
        .lock()
        .unwrap()
        .log
        .iter()
        .any(|l| l.starts_with("DELETE")));
    d.shutdown();

    std::fs::write(&state, "{\"jobs\": [}").unwrap();
    let e = start(&fake.url(), &state).unwrap_err().to_string();
    assert!(
        e.contains(&state.display().to_string()) && e.contains("corrupt"),
        "{e}"
    );
}

#[test]
fn reconcile_reinstalls_what_a_restarted_dataplane_lost() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("reconcile");
    let d = daemon(&fake.url(), &state);
    let _: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    let _: AdmitResponse = ok_at(&d, &R::Admit, Some(&spec_json("b", 2, 1000)));
    let before = fake.jobs();
    fake.forget_all();
    wait_for("reinstallation", || fake.jobs().len() == 2);
    assert_eq!(fake.jobs(), before, "same ids, tokens, specs and layouts");
}

#[test]
fn numa_keeps_jobs_on_the_nics_node() {
    let fake = Fake::start(FakeConfig {
        numa: vec![Some(0), Some(0), Some(1), Some(1)],
        nic: Some(1),
        budget: 1 << 30,
        base_port: BASE_PORT,
    });
    let state = temp_state("numa");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    assert_eq!(a.lcores, vec![2, 3]);
    let job = &fake.jobs()[&1];
    assert_eq!(job.layout.lcores.len(), 4);
    assert!(job.layout.lcores[0].is_empty() && job.layout.lcores[1].is_empty());
    assert_eq!(
        job.layout.lcores[2].count + job.layout.lcores[3].count,
        job.layout.chunk_count()
    );
    let map: JobMap = ok_at(&d, &R::Map { job: 1, key: None }, None);
    assert_eq!(
        map.lcores.iter().map(|l| (l.lcore, l.port)).collect::<Vec<_>>(),
        vec![(2, BASE_PORT + 2), (3, BASE_PORT + 3)]
    );
}

#[test]
fn metrics_in_prometheus_text_format() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("metrics");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    let join = format!("{{\"token\": \"{:016x}\", \"rank\": 0}}", a.token);
    let _: JoinResponse = ok_at(&d, &R::Join { job: 1 }, Some(&join));
    let r = ureq::get(&format!("http://{}{}", d.addr(), R::Metrics.path()))
        .call()
        .unwrap();
    assert_eq!(r.header("Content-Type"), Some("text/plain; version=0.0.4"));
    let text = r.into_string().unwrap();
    for line in [
        "# TYPE phub_dataplane_up gauge",
        "phub_dataplane_up 1",
        "# TYPE phub_lcore_rx_packets_total counter",
        "phub_lcore_rx_packets_total{lcore=\"1\"} 101",
        "phub_lcore_drops_total{lcore=\"0\",reason=\"bad_token\"} 7",
        "phub_jobs 1",
        "phub_job_workers_joined{job=\"1\",name=\"toy\"} 1",
        "phub_job_rounds_completed_total{job=\"1\"} 42",
        &format!("phub_job_memory_bytes{{job=\"1\"}} {}", a.memory_bytes),
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    drop(fake);
    let text = ureq::get(&format!("http://{}{}", d.addr(), R::Metrics.path()))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        text.contains("phub_dataplane_up 0\n") && text.contains("phub_jobs 1\n"),
        "{text}"
    );
}

/// Two phub-controls on one state file would interleave their writes (one
/// job lost from control, kept on the dataplane): the second one refuses to
/// start, naming the file; once the first stops, the file is free again.
#[test]
fn a_second_control_on_the_same_state_file_refuses_to_start() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("second");
    let first = daemon(&fake.url(), &state);
    let e = start(&fake.url(), &state).unwrap_err().to_string();
    assert!(
        e.contains(&state.display().to_string()) && e.contains("in use by another phub-control"),
        "{e}"
    );
    first.shutdown();
    daemon(&fake.url(), &state).shutdown();
}

/// Job ids are control's decimal numbers: "+1" and "01" name no job. The
/// operator token goes as `Bearer <token>`: an empty one, or a bare token,
/// is a 401 that says how to send it, never accepted.
#[test]
fn job_ids_are_canonical_and_the_operator_token_needs_its_bearer() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("ids");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    assert_eq!(a.id, 1);
    let _: JobDetail = ok_at(&d, &R::Job { job: 1 }, None);
    for id in ["+1", "01", "1.0", " 1"] {
        let path = format!("/v1/jobs/{}", id.replace(' ', "%20"));
        let e = err(&d, "GET", &path, None, 400);
        assert!(e.contains("not an integer from 1 to 65535"), "{id}: {e}");
    }
    let url = format!("http://{}{}", d.addr(), R::Evict { job: 1 }.path());
    for header in [
        "Bearer",
        "Bearer  ",
        &operator_token(&d),
        &format!("Token {}", operator_token(&d)),
    ] {
        match ureq::delete(&url).set("Authorization", header).call() {
            Err(ureq::Error::Status(401, r)) => {
                let e = r.into_json::<ApiError>().unwrap().error;
                assert!(e.contains("Bearer <operator token>"), "{header:?}: {e}");
            }
            other => panic!("{header:?}: {other:?}"),
        }
    }
    // Nothing was evicted by those.
    assert_eq!(list(&d).len(), 1);
    d.shutdown();
}

/// An eviction is reported done only once it is durable: when the state
/// file cannot be written, the job stays admitted (and installed) and the
/// answer says why; once it can, the eviction goes through.
#[test]
fn an_eviction_that_cannot_be_written_changes_nothing() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("durable");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    // A directory where the state's temporary goes: the write fails.
    let tmp = state.with_extension("json.tmp");
    std::fs::create_dir(&tmp).unwrap();
    let e = err_at(&d, &R::Evict { job: a.id }, None, 500);
    assert!(
        e.contains("not evicted") && e.contains(&tmp.display().to_string()),
        "{e}"
    );
    assert_eq!(list(&d).len(), 1, "still admitted");
    assert!(fake.jobs().contains_key(&a.id), "still installed");
    std::fs::remove_dir(&tmp).unwrap();
    let _: JobSummary = ok_at(&d, &R::Evict { job: a.id }, None);
    assert!(list(&d).is_empty() && !fake.jobs().contains_key(&a.id));
    d.shutdown();
    // It stays evicted across a restart.
    let d = daemon(&fake.url(), &state);
    assert!(list(&d).is_empty());
    d.shutdown();
}

/// A dataplane that cannot be told (down, refusing) does not stop an
/// eviction; reconciliation removes the job there once it answers, as it
/// removes any job control has not admitted.
#[test]
fn reconciliation_removes_jobs_control_has_not_admitted() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("unknown");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    fake.state.lock().unwrap().refuse_delete = Some("down for maintenance".into());
    let _: JobSummary = ok_at(&d, &R::Evict { job: a.id }, None);
    assert!(list(&d).is_empty());
    assert!(fake.jobs().contains_key(&a.id), "the dataplane refused");
    // A job nobody admitted, installed behind control's back.
    let mut hidden = fake.jobs()[&a.id].clone();
    hidden.id = 77;
    fake.state.lock().unwrap().jobs.insert(77, hidden);
    fake.state.lock().unwrap().refuse_delete = None;
    wait_for("reconciliation to remove both", || fake.jobs().is_empty());
    let log = fake.state.lock().unwrap().log.clone();
    let removal = format!("DELETE {}", MgmtRoute::Remove { job: 77 }.path());
    assert!(log.contains(&removal), "{log:?}");
    d.shutdown();
}

/// A JSON spec with a byte-order mark is admitted as JSON (it was read as
/// TOML), and the Content-Type decides the format when given.
#[test]
fn admission_reads_the_spec_in_the_format_it_is_in() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("format");
    let d = daemon(&fake.url(), &state);
    let bom = format!("\u{feff}{}", spec_json("bom", 2, 100));
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(&bom));
    assert_eq!(a.id, 1);
    let url = format!("http://{}{}", d.addr(), R::Admit.path());
    let bearer = format!("Bearer {}", operator_token(&d));
    let r = ureq::post(&url)
        .set("Authorization", &bearer)
        .set("Content-Type", "application/toml")
        .send_string(SPEC)
        .unwrap();
    assert_eq!(r.status(), 201);
    match ureq::post(&url)
        .set("Authorization", &bearer)
        .set("Content-Type", "application/json")
        .send_string(SPEC)
    {
        Err(ureq::Error::Status(400, r)) => {
            let e = r.into_json::<ApiError>().unwrap().error;
            assert!(
                e.contains("invalid job spec") && e.contains(" column "),
                "a JSON error: {e}"
            );
        }
        other => panic!("TOML sent as JSON: {other:?}"),
    }
    assert_eq!(list(&d).len(), 2);
    d.shutdown();
}

/// Requests the fake saw that start with `prefix`.
fn seen(fake: &Fake, prefix: &str) -> usize {
    fake.state
        .lock()
        .unwrap()
        .log
        .iter()
        .filter(|l| l.starts_with(prefix))
        .count()
}

/// Issue 16 item 7: a dataplane back with fewer lcores than a job's layout
/// uses. The job is placed anew over the lcores there are (it used to be
/// retried for ever with its old layout, which the dataplane refuses, while
/// joins answered with ports nobody listens on); the new layout is durable,
/// and ranks that had joined join again.
#[test]
fn a_dataplane_back_with_fewer_lcores_gets_its_jobs_placed_anew() {
    let fake = Fake::start(FakeConfig::lcores(4));
    let state = temp_state("fewer");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    assert_eq!(a.lcores, vec![0, 1, 2, 3]);
    let join = |rank: u16| format!("{{\"token\": \"{:016x}\", \"rank\": {rank}}}", a.token);
    let before: JoinResponse = ok_at(&d, &R::Join { job: 1 }, Some(&join(0)));
    assert_eq!(before.layout.lcore_count(), 4);

    fake.restart_as(FakeConfig::lcores(2));
    wait_for("the job placed over 2 lcores", || {
        fake.jobs().get(&1).is_some_and(|j| j.layout.lcore_count() == 2)
    });
    let installed = fake.jobs()[&1].clone();
    assert_eq!((installed.token, &installed.spec), (a.token, &before.spec));
    assert_eq!(installed.layout.chunk_count(), before.layout.chunk_count());
    let jobs = list(&d);
    assert!(jobs[0].joined.is_empty(), "rank 0 holds a stale layout: {jobs:?}");
    assert!(jobs[0].installed && jobs[0].failed.is_none(), "{jobs:?}");
    // Rank 0 joins again (no `rejoin` needed) and learns the new layout.
    let after: JoinResponse = ok_at(&d, &R::Join { job: 1 }, Some(&join(0)));
    assert_eq!(after.layout, installed.layout);
    d.shutdown();

    // Durable: a restarted control hands out the new layout.
    let d = daemon(&fake.url(), &state);
    let again: JoinResponse = ok_at(&d, &R::Join { job: 1 }, Some(&join(1)));
    assert_eq!(again.layout, installed.layout);
    d.shutdown();
}

/// A job with a checkpoint, placed anew over fewer lcores, is restored from
/// it chunk by chunk: every slot's state lands on the slot that now holds
/// its chunk (the fake marks each slot's state with its chunk's number).
#[test]
fn a_checkpoint_moves_onto_the_new_placement() {
    let fake = Fake::start(FakeConfig::lcores(4));
    let state = temp_state("moved");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    let _: serde_json::Value = ok_at(&d, &R::Checkpoint { job: a.id }, None);
    fake.restart_as(FakeConfig::lcores(3));
    wait_for("the job restored over 3 lcores", || {
        fake.state.lock().unwrap().restored.contains_key(&a.id)
    });
    let restored = fake.state.lock().unwrap().restored[&a.id].clone();
    let layout = &restored.job.layout;
    assert_eq!(layout.lcore_count(), 3);
    assert_eq!(&fake.jobs()[&a.id].layout, layout);
    let counts: Vec<u64> = restored.lcores.iter().map(|s| s.len() as u64).collect();
    let runs: Vec<u64> = layout.lcores.iter().map(|r| r.count).collect();
    assert_eq!(counts, runs);
    let seqs: Vec<u32> = restored
        .lcores
        .iter()
        .flatten()
        .map(|s| s.completed.unwrap())
        .collect();
    assert_eq!(
        seqs,
        (0..26).collect::<Vec<u32>>(),
        "each chunk's state with its chunk"
    );
    d.shutdown();
}

/// A job that cannot be placed on the dataplane's new lcores is marked
/// failed: the reason is kept and shown, joins are refused naming it,
/// reconciliation stops trying, and the job can still be evicted.
#[test]
fn a_job_that_no_longer_fits_fails_with_its_reason_and_can_be_evicted() {
    let fake = Fake::start(FakeConfig::lcores(4));
    let state = temp_state("failed");
    let d = daemon(&fake.url(), &state);
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    let join = |rank: u16| format!("{{\"token\": \"{:016x}\", \"rank\": {rank}}}", a.token);
    let _: JoinResponse = ok_at(&d, &R::Join { job: 1 }, Some(&join(0)));
    fake.restart_as(FakeConfig {
        budget: 1,
        ..FakeConfig::lcores(2)
    });
    wait_for("the job marked failed", || list(&d)[0].failed.is_some());
    let why = list(&d)[0].failed.clone().unwrap();
    assert!(
        why.contains("placed on 4 lcores (up to lcore 3), the dataplane now has 2")
            && why.contains("job needs"),
        "{why}"
    );
    let show: JobDetail = ok_at(&d, &R::Job { job: 1 }, None);
    assert_eq!(show.summary.failed.as_deref(), Some(why.as_str()));
    assert!(!show.summary.installed);
    let raw = call(&d, "GET", &R::Jobs.path(), None).1;
    assert!(raw.contains("\"failed\":"), "{raw}");
    for body in [
        join(1),
        format!(
            "{{\"token\": \"{:016x}\", \"rank\": 0, \"rejoin\": true}}",
            a.token
        ),
    ] {
        let e = err_at(&d, &R::Join { job: 1 }, Some(&body), 409);
        assert_eq!(e, format!("job 1 failed: {why}; evict it and admit again"));
    }
    let e = err_at(&d, &R::Checkpoint { job: 1 }, None, 409);
    assert!(e.starts_with("job 1 failed: "), "{e}");
    // Reconciliation no longer tries it.
    let puts = seen(&fake, "PUT");
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(seen(&fake, "PUT"), puts);
    assert!(fake.jobs().is_empty());
    d.shutdown();

    // Durable; and evictable.
    let d = daemon(&fake.url(), &state);
    assert_eq!(list(&d)[0].failed.as_deref(), Some(why.as_str()));
    let _: JobSummary = ok_at(&d, &R::Evict { job: 1 }, None);
    assert!(list(&d).is_empty());
    d.shutdown();
}

/// An install the dataplane refuses as invalid (HTTP 400) will not succeed
/// by retrying: the job fails with the dataplane's reason. A refusal that
/// may pass (HTTP 500) is retried.
#[test]
fn an_install_refused_as_invalid_fails_the_job() {
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("invalid");
    let d = daemon(&fake.url(), &state);
    let _: AdmitResponse = ok_at(&d, &R::Admit, Some(SPEC));
    fake.state.lock().unwrap().refuse = Some("out of hugepages".into());
    fake.forget_all();
    wait_for("two refused reinstalls", || seen(&fake, "PUT") >= 3);
    assert!(list(&d)[0].failed.is_none(), "a 500 is retried");
    {
        let mut st = fake.state.lock().unwrap();
        st.refuse = None;
        st.refuse_invalid = Some("layout names lcore 9".into());
    }
    wait_for("the job marked failed", || list(&d)[0].failed.is_some());
    let why = list(&d)[0].failed.clone().unwrap();
    assert!(
        why.contains("the dataplane refuses to install it") && why.contains("layout names lcore 9"),
        "{why}"
    );
    d.shutdown();
}

/// Async and bounded-delay specs are admitted (TOML and JSON), installed
/// with their mode, and shown with each rank's clocks, the largest lead
/// and the answers held; `mean` outside BSP is refused naming the mode.
#[test]
fn async_and_bounded_delay_jobs_are_admitted_and_shown_with_their_clocks() {
    use phub_proto::spec::Consistency;
    let fake = Fake::start(FakeConfig::lcores(2));
    let state = temp_state("consistency");
    let d = daemon(&fake.url(), &state);
    let toml = SPEC.replace(
        "workers = 4\n",
        "workers = 4\nconsistency = { mode = \"async\" }\n",
    );
    let a: AdmitResponse = ok_at(&d, &R::Admit, Some(&toml));
    let json = r#"{"name": "ssp", "workers": 3, "consistency": {"bounded_delay": 4},
        "optimizer": {"kind": "sgd", "lr": 0.1}, "keys": [{"elements": 5000}]}"#;
    let b: AdmitResponse = ok_at(&d, &R::Admit, Some(json));
    let jobs = fake.jobs();
    assert_eq!(jobs[&a.id].spec.consistency, Consistency::Async);
    assert_eq!(jobs[&b.id].spec.consistency, Consistency::Bounded { delay: 4 });
    let show: JobDetail = ok_at(&d, &R::Job { job: b.id }, None);
    assert_eq!(show.spec.consistency, Consistency::Bounded { delay: 4 });
    assert_eq!(show.clock.clocks, vec![(3, 4), (4, 5), (5, 6)]);
    assert_eq!((show.clock.max_lead, show.clock.held), (Some(5), 1));
    assert_eq!(
        (
            show.clock.held_total,
            show.clock.held_wait_us,
            show.clock.held_wait_max_us
        ),
        (4, 1500, 1000)
    );
    let t = phub_control::cli::render_show(&show);
    assert!(t.contains("consistency bounded_delay, τ = 4"), "{t}");
    assert!(
        t.contains(
            "largest lead allowed 5 clocks, answers held now 1\n\
             answers held so far 4, their waits 1.5 ms in all, 1.0 ms at most\n"
        ),
        "{t}"
    );
    assert!(t.contains("   2  no      5..=6  never heard from"), "{t}");
    let show: JobDetail = ok_at(&d, &R::Job { job: a.id }, None);
    assert_eq!(
        (show.clock.clocks.len(), show.clock.max_lead, show.clock.held),
        (4, Some(2), 0)
    );
    assert!(phub_control::cli::render_show(&show).contains("consistency async"));
    // `mean` divides by W, which only BSP has: refused with the mode.
    let mean = toml.replace("kind = \"sum\"", "kind = \"mean\"");
    let e = err_at(&d, &R::Admit, Some(&mean), 400);
    assert!(e.contains("mean") && e.contains("async"), "{e}");
    // A bound beyond 1024 is refused naming the accepted range.
    let e = err_at(
        &d,
        &R::Admit,
        Some(&json.replace("\"bounded_delay\": 4", "\"bounded_delay\": 5000")),
        400,
    );
    assert!(e.contains("5000") && e.contains("1024"), "{e}");
    assert_eq!(fake.jobs().len(), 2);
}
