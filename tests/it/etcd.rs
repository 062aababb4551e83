//! phub-control with its state in etcd (`--state etcd://...`): a real etcd
//! started here on 127.0.0.1 (free ports, a temporary data directory,
//! killed and removed after), one dataplane, and two phub-controls on one
//! prefix. The state survives a restart; one control leads and the other
//! turns writes away naming it; a follower leads after the leader is
//! killed, jobs and tokens intact; a leader paused past its lease is
//! fenced: its write fails and it steps down; phubctl given several
//! controls reaches the leader.
//!
//! Needs the `etcd` binary (Debian's etcd-server, which tools/setup.sh
//! installs); without it each test says it skips.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use phub::proto::api::JoinRequest;
use phub::proto::routes::control;
use phub::proto::routes::ControlRoute;
use phub::proto::routes::Route;
use phub::proto::spec::Consistency;
use phub_hwtests::process::Daemon;

use crate::common::{admit, census_spec, client, free_port, Rack};

/// The lease TTL the controls run with, in seconds.
const TTL: u64 = 2;

/// A one-member etcd on free loopback ports.
struct Etcd {
    daemon: Option<Daemon>,
    dir: PathBuf,
    port: u16,
}

impl Etcd {
    /// Starts etcd, or `None` (saying so) when there is no etcd binary.
    fn start(dir: &Path) -> Option<Etcd> {
        if Command::new("etcd").arg("--version").output().is_err() {
            eprintln!(
                "SKIP: no etcd binary on PATH (Debian: apt-get install etcd-server; tools/setup.sh does)"
            );
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
        let mut d = Daemon::spawn("etcd", Path::new("etcd"), &args, &[], &dir.join("etcd.log")).unwrap();
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
        let port = free_port();
        let args = vec![
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
    let b = Control::start(&rack, &state, &dir, "control-b");
    let (status, leader, msg) = probe(&b.url, &token);
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
    // (X-Phub-Leader), and phubctl's client sends the write on to it.
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
