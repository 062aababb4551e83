//! The control plane under hostile and careless clients, on loopback with
//! the real binaries: slow and huge requests, many connections, the
//! dataplane's management API without credentials, racing admits and
//! evictions, a second control on one state file, TLS, and shutdown with
//! clients still connected, an appliance that never answers, guessed
//! tokens and one address holding many connections. Throughout, control
//! must answer a plain `GET /v1/jobs` within a second and lose nothing it
//! admitted.
//!
//! Linux answers all of 127.0.0.0/8 on the loopback interface: a test that
//! needs several client hosts binds its sockets to 127.0.0.2, 127.0.0.3, ...
//! ([`connect_from`]).

use crate::common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{client, Appliances, Operator, Rack};
use phub::proto::api::{AdmitResponse, InstalledJob, JobSummary};
use phub::proto::routes::{control, mgmt, ControlRoute as R, MgmtRoute as M, Route};
use phub_hwtests::workload::{grad, init_values, sgd_reference};
use phub_worker::{Worker, WorkerConfig};

const SPEC: &str = r#"name = "adv"
workers = 1
chunk_bytes = 1024
[optimizer]
kind = "sum"
[[keys]]
elements = 4096
"#;

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Polls `GET {url}/v1/jobs` every 100 ms until stopped; the slowest
/// answer, and the failures.
struct Prober {
    stop: Arc<AtomicBool>,
    worst: Arc<Mutex<(Duration, Vec<String>)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prober {
    fn start(url: &str) -> Prober {
        let (stop, worst) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new((Duration::ZERO, vec![]))),
        );
        let (s, w, url) = (stop.clone(), worst.clone(), format!("{url}{}", R::Jobs.path()));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let t = Instant::now();
                let r = ureq::get(&url).timeout(Duration::from_secs(5)).call();
                let took = t.elapsed();
                let mut w = w.lock().unwrap();
                w.0 = w.0.max(took);
                if let Err(e) = r {
                    w.1.push(e.to_string());
                }
                drop(w);
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Prober {
            stop,
            worst,
            thread: Some(thread),
        }
    }

    /// Stops and checks: every answer came, each within a second.
    fn finish(mut self, what: &str) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        let (worst, errors) = self.worst.lock().unwrap().clone();
        assert!(errors.is_empty(), "{what}: control failed to answer: {errors:?}");
        assert!(
            worst < Duration::from_secs(1),
            "{what}: control took {worst:?} to answer"
        );
    }
}

/// The loopback address 127.0.0.`n`: one client host of a test.
fn host(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, n)
}

/// A connection to `to` from the loopback address `from`.
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&SocketAddr::from((from, 0)).into())?;
    s.connect(&to.into())?;
    Ok(s.into())
}

/// `route`'s request line, `GET /v1/jobs HTTP/1.1\r\n`, then `rest` (raw
/// requests: headers trickled, bodies over the limit, guessed tokens).
fn raw(route: &impl Route, rest: &str) -> Vec<u8> {
    format!("{} {} HTTP/1.1\r\n{rest}", route.method(), route.path()).into_bytes()
}

/// Opens `n` connections from `from` that send part of a request and then
/// a byte now and then, from a thread, until `stop`.
fn tricklers(
    addr: SocketAddr,
    n: usize,
    start: Vec<u8>,
    from: Ipv4Addr,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut conns: Vec<TcpStream> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            conns.retain_mut(|c| c.write_all(b"x").is_ok());
            while conns.len() < n {
                match connect_from(from, addr) {
                    Ok(mut c) => {
                        let _ = c.write_all(&start);
                        conns.push(c);
                    }
                    Err(_) => break,
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
}

/// Sends raw bytes from `from`; the whole answer (empty when none came).
fn raw_from(from: Ipv4Addr, addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = connect_from(from, addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends raw bytes; the answer's status line (empty when none came).
fn raw_status(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

#[test]
fn slow_huge_and_many_clients_do_not_hold_control_or_the_dataplane() {
    let rack = Rack::start(1, "64MiB");
    let control = addr_of(&rack.control_url);
    let mgmt = addr_of(&rack.mgmt_url);
    let prober = Prober::start(&rack.control_url);
    let stop = Arc::new(AtomicBool::new(false));
    // On both listeners: clients that trickle headers, and clients that
    // declare a body and trickle it, from hosts other than the prober's
    // (one host holds at most `max_connections_per_source`).
    let threads = vec![
        tricklers(control, 50, raw(&R::Jobs, "X-Slow: "), host(2), stop.clone()),
        tricklers(control, 50, raw(&R::Jobs, "X-Slow: "), host(3), stop.clone()),
        tricklers(
            control,
            20,
            raw(&R::Join { job: 1 }, "Content-Length: 100000\r\n\r\n{"),
            host(4),
            stop.clone(),
        ),
        tricklers(mgmt, 50, raw(&M::Info, "X-Slow: "), host(5), stop.clone()),
    ];
    std::thread::sleep(Duration::from_millis(500));

    // Huge headers: refused, memory not taken.
    let mut big = raw(&R::Jobs, "X-Big: ");
    big.extend(std::iter::repeat_n(b'a', 4 << 20));
    big.extend_from_slice(b"\r\n\r\n");
    for _ in 0..3 {
        assert!(raw_status(control, &big).contains("431"));
    }
    // Bodies over the limit: refused before they are read, with or without
    // the operator token (without, the token is asked for first).
    let huge = raw(&R::Admit, "Content-Length: 1000000000\r\n\r\n");
    assert!(raw_status(control, &huge).contains("401"));
    let with_token = raw(
        &R::Admit,
        &format!(
            "Authorization: Bearer {}\r\nContent-Length: 1000000000\r\n\r\n",
            rack.operator_token()
        ),
    );
    assert!(raw_status(control, &with_token).contains("413"));
    let join = raw(&R::Join { job: 1 }, "Content-Length: 10000000\r\n\r\n");
    assert!(raw_status(control, &join).contains("413"));

    // Meanwhile admission (control -> dataplane) works, promptly.
    let t = Instant::now();
    let job = rack.admit(SPEC).expect("admission while clients trickle");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "admission took {:?}",
        t.elapsed()
    );
    let (ok, out, err) = rack.phubctl(&["job", "list"]);
    assert!(ok, "{err}");
    assert!(out.contains("adv"), "{out}");

    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    prober.finish("slow and huge clients");
    let jobs: Vec<JobSummary> = rack.send(&control::jobs());
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![job.id]);
}

#[test]
fn the_dataplane_api_refuses_changes_and_secrets_without_the_token() {
    let rack = Rack::start(1, "64MiB");
    let job = rack.admit(SPEC).unwrap();
    let base = &rack.mgmt_url;
    let id = job.id;
    let call = |method: &str, path: &str, auth: Option<&str>, body: &str| -> (u16, String) {
        let mut req = ureq::request(method, &format!("{base}{path}"));
        if let Some(a) = auth {
            req = req.set("Authorization", a);
        }
        match req.send_string(body) {
            Ok(r) => (r.status(), String::new()),
            Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap_or_default()),
            Err(e) => panic!("{method} {path}: {e}"),
        }
    };
    // Reading what holds no secret is open.
    assert_eq!(call("GET", &M::Info.path(), None, "").0, 200);
    assert_eq!(call("GET", &M::Stats.path(), None, "").0, 200);
    // A checkpoint (token and parameters), a removal, a hidden install:
    // refused without the token, naming the file; refused with a wrong one.
    let hidden = r#"{"id": 9, "token": 0, "spec": {}, "layout": {}}"#;
    for (route, body) in [
        (M::Checkpoint { job: id }, ""),
        (M::Remove { job: id }, ""),
        (M::Install { job: 9 }, hidden),
    ] {
        let (method, path) = (route.method().as_str(), route.path());
        let (code, msg) = call(method, &path, None, body);
        assert_eq!(code, 401, "{method} {path}: {msg}");
        assert!(
            msg.contains("management token") && msg.contains(".token"),
            "{msg}"
        );
        let (code, msg) = call(method, &path, Some("Bearer 0123456789abcdef0123"), body);
        assert_eq!(code, 403, "{method} {path}: {msg}");
    }
    // The job is still installed, the hidden one is not.
    let installed: Vec<InstalledJob> = ureq::get(&format!("{base}{}", M::Jobs.path()))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(installed.iter().map(|j| j.id).collect::<Vec<_>>(), vec![id]);
    // With the token, an install is still validated: token 0 is refused.
    let bearer = format!("Bearer {}", rack.mgmt_token());
    let (code, msg) = call("PUT", &M::Install { job: 9 }.path(), Some(&bearer), hidden);
    assert_eq!(code, 400, "{msg}");
    // The token file is the owner's only.
    use std::os::unix::fs::PermissionsExt;
    let port = rack.mgmt_url.rsplit(':').next().unwrap();
    let mode = std::fs::metadata(rack.dir.join(format!("dataplane-{port}.token")))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn racing_admits_and_evictions_lose_nothing() {
    let rack = Arc::new(Rack::start(2, "256MiB"));
    let kept = Arc::new(Mutex::new(Vec::<u16>::new()));
    let prober = Prober::start(&rack.control_url);
    let threads: Vec<_> = (0..6)
        .map(|t| {
            let (rack, kept) = (rack.clone(), kept.clone());
            std::thread::spawn(move || {
                for i in 0..6 {
                    let job: AdmitResponse = rack.admit(SPEC).expect("admission");
                    // Every other job is evicted at once, racing the others.
                    if (t + i) % 2 == 0 {
                        let r = client(&rack.control_url, Some(&rack.operator_token()))
                            .send(&control::evict(job.id));
                        assert!(r.is_ok(), "evicting {}: {r:?}", job.id);
                    } else {
                        kept.lock().unwrap().push(job.id);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    prober.finish("racing admits and evictions");
    let mut kept = kept.lock().unwrap().clone();
    kept.sort_unstable();
    let listed: Vec<u16> = rack.send(&control::jobs()).iter().map(|j| j.id).collect();
    assert_eq!(
        listed, kept,
        "control's jobs are exactly those admitted and not evicted"
    );
    let installed: Vec<InstalledJob> = rack.dataplane(&mgmt::jobs());
    let installed: Vec<u16> = installed.iter().map(|j| j.id).collect();
    assert_eq!(installed, kept, "the dataplane holds exactly those jobs");
}

#[test]
fn a_second_control_on_the_same_state_file_is_refused() {
    let rack = Rack::start(1, "64MiB");
    let out = Command::new(env!("CARGO_BIN_EXE_phub-control"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--dataplane",
            &rack.mgmt_url,
            "--state",
        ])
        .arg(rack.dir.join("state.json"))
        .env("PHUB_RUNTIME_DIR", &rack.dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("state.json"), "{err}");
}

#[test]
fn control_refuses_clear_text_beyond_loopback() {
    let dir = std::env::temp_dir().join(format!("phub-adv-listen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_phub-control"))
        .args(["--listen", "0.0.0.0:0", "--state"])
        .arg(dir.join("state.json"))
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("clear text") && err.contains("--tls-cert"), "{err}");
}

/// Starts a phub-control of its own over `rack`'s dataplane (whose own
/// control the caller stopped: one control per dataplane) on a free port,
/// its state at `state`, with `extra` arguments and its log at
/// `<rack dir>/<log>`; the process and its port.
fn spawn_control(
    rack: &Rack,
    state: &std::path::Path,
    extra: &[&std::ffi::OsStr],
    log: &str,
) -> (std::process::Child, u16) {
    let port = common::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_phub-control"))
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--dataplane",
            &rack.mgmt_url,
        ])
        .args(["--reconcile-ms", "200", "--state"])
        .arg(state)
        .args(extra)
        .env("PHUB_RUNTIME_DIR", &rack.dir)
        .stderr(std::fs::File::create(rack.dir.join(log)).unwrap())
        .spawn()
        .unwrap();
    (child, port)
}

/// Starts phub-control over TLS beside `rack`'s and waits until it answers
/// through a client that trusts `ca`.
fn tls_control(
    rack: &Rack,
    cert: &std::path::Path,
    key: &std::path::Path,
    ca: &std::path::Path,
) -> (std::process::Child, String) {
    let extra = [
        "--tls-cert".as_ref(),
        cert.as_os_str(),
        "--tls-key".as_ref(),
        key.as_os_str(),
    ];
    let (child, port) = spawn_control(rack, &rack.dir.join("tls-state.json"), &extra, "tls-control.log");
    let url = format!("https://localhost:{port}");
    let agent = ureq::AgentBuilder::new()
        .tls_config(phub_http::client_config(Some(ca)).unwrap())
        .build();
    let t = Instant::now();
    while agent.get(&format!("{url}{}", R::Jobs.path())).call().is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "TLS control did not come up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (child, url)
}

#[test]
fn control_over_tls_is_verified_by_phubctl_and_workers() {
    let rack = Rack::start(1, "64MiB");
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert, key) = (rack.dir.join("cert.pem"), rack.dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    // The rack's own control is stopped: one control per dataplane.
    let mut rack = rack;
    rack.kill_control();
    let (mut child, url) = tls_control(&rack, &cert, &key, &cert);
    let token = std::fs::read_to_string(rack.dir.join("tls-state.json.operator-token")).unwrap();
    let phubctl = |args: &[&str], ca: Option<&std::path::Path>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_phubctl"));
        c.env("PHUB_OPERATOR_TOKEN", token.trim())
            .env_remove("PHUB_CA_FILE");
        if let Some(ca) = ca {
            c.arg("--ca-file").arg(ca);
        }
        let out = c.args(["--control", &url]).args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Trusting the certificate: admission over HTTPS.
    let spec = rack.dir.join("spec.toml");
    std::fs::write(&spec, SPEC).unwrap();
    let (ok, out, err) = phubctl(&["--json", "job", "admit", spec.to_str().unwrap()], Some(&cert));
    assert!(ok, "{err}");
    let admitted: AdmitResponse = serde_json::from_str(&out).unwrap();
    // Not trusting it: refused, and the error says why.
    let (ok, _, err) = phubctl(&["job", "list"], None);
    assert!(!ok);
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    // A worker joins over HTTPS with PHUB_CA_FILE; without it, it cannot.
    // (Only https clients read the variable, and this is the one test in
    // this binary, tests/it, whose in-process clients use https.)
    std::env::remove_var(phub_http::CA_FILE_ENV);
    let e = phub_worker::Worker::join(&url, admitted.id, admitted.token, 0).unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    std::env::set_var(phub_http::CA_FILE_ENV, &cert);
    let w = phub_worker::Worker::join(&url, admitted.id, admitted.token, 0);
    std::env::remove_var(phub_http::CA_FILE_ENV);
    let w = w.expect("joining over HTTPS with PHUB_CA_FILE");
    drop(w);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn sigterm_stops_control_at_once_with_clients_connected() {
    let mut rack = Rack::start(1, "64MiB");
    let control = addr_of(&rack.control_url);
    let stop = Arc::new(AtomicBool::new(false));
    let t = tricklers(
        control,
        50,
        raw(&R::Join { job: 1 }, "Content-Length: 9000\r\n\r\n"),
        host(1),
        stop.clone(),
    );
    std::thread::sleep(Duration::from_millis(500));
    let mut d = rack.control.take().unwrap();
    let started = Instant::now();
    assert!(
        d.stop(Duration::from_secs(10)),
        "phub-control did not exit on SIGTERM"
    );
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
    assert!(
        took < Duration::from_secs(3),
        "phub-control took {took:?} to stop on SIGTERM"
    );
}

/// Runs `cmd` (mount, umount); false when it fails.
fn sh(cmd: &[&str]) -> bool {
    Command::new(cmd[0])
        .args(&cmd[1..])
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn full_and_read_only_state_directories_lose_nothing() {
    // SAFETY: geteuid has no preconditions and touches no memory of ours.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting a small tmpfs for the state directory needs root");
        return;
    }
    let mut rack = Rack::start(1, "256MiB");
    rack.kill_control();
    let dir = rack.dir.join("small-state");
    std::fs::create_dir_all(&dir).unwrap();
    assert!(sh(&[
        "mount",
        "-t",
        "tmpfs",
        "-o",
        "size=256k",
        "tmpfs",
        dir.to_str().unwrap()
    ]));
    struct Unmount(std::path::PathBuf, Option<std::process::Child>);
    impl Drop for Unmount {
        fn drop(&mut self) {
            if let Some(mut c) = self.1.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            // The read-only bind mount, if any, then the tmpfs.
            let _ = sh(&["umount", "-l", self.0.to_str().unwrap()]);
            let _ = sh(&["umount", "-l", self.0.to_str().unwrap()]);
        }
    }
    let mut guard = Unmount(dir.clone(), None);
    // The operator token file goes elsewhere: the state directory fills up.
    let token_file = rack.dir.join("small.operator-token");
    let extra = ["--operator-token-file".as_ref(), token_file.as_os_str()];
    let (mut child, port) = spawn_control(&rack, &dir.join("state.json"), &extra, "small-control.log");
    let url = format!("http://127.0.0.1:{port}");
    phub_hwtests::process::wait_http(
        &phub_hwtests::process::control_ready(&url),
        &mut child,
        Duration::from_secs(20),
        || false,
    )
    .unwrap();
    guard.1 = Some(child);
    let token = std::fs::read_to_string(&token_file).unwrap().trim().to_string();
    let admit = || -> Result<AdmitResponse, (u16, String)> { common::admit(&url, &token, SPEC) };
    let installed = || -> Vec<u16> {
        let v: Vec<InstalledJob> = rack.dataplane(&mgmt::jobs());
        v.iter().map(|j| j.id).collect()
    };
    let first = admit().expect("admission with room for the state file");
    let prober = Prober::start(&url);

    // Full: the admission fails naming the state file, nothing is installed.
    let filler = dir.join("filler");
    let _ = Command::new("dd")
        .args([
            "if=/dev/zero",
            &format!("of={}", filler.display()),
            "bs=4k",
            "count=1000",
        ])
        .output();
    let (code, msg) = admit().unwrap_err();
    assert_eq!(code, 500, "{msg}");
    assert!(
        msg.contains("state") && msg.to_lowercase().contains("space"),
        "{msg}"
    );
    assert_eq!(installed(), vec![first.id]);
    // An eviction that cannot be written changes nothing.
    // The status of an eviction of the first job.
    let evict = || -> u16 {
        match client(&url, Some(&token)).send(&control::evict(first.id)) {
            Ok(_) => 200,
            Err(e) => e.status().unwrap_or_else(|| panic!("eviction: {e}")),
        }
    };
    assert_eq!(evict(), 500);
    assert_eq!(installed(), vec![first.id]);
    std::fs::remove_file(&filler).unwrap();

    // Read-only: the same. (A read-only bind mount over the directory:
    // control holds its lock file open for writing, which a remount of the
    // tmpfs itself would wait for.)
    let d = dir.to_str().unwrap();
    assert!(sh(&["mount", "--bind", d, d]));
    assert!(sh(&["mount", "-o", "remount,bind,ro", d]));
    let (code, msg) = admit().unwrap_err();
    assert_eq!(code, 500, "{msg}");
    assert!(msg.to_lowercase().contains("read-only"), "{msg}");
    assert_eq!(evict(), 500);
    assert_eq!(installed(), vec![first.id]);
    assert!(sh(&["umount", d]));

    // Writable again: everything works, nothing was lost.
    let second = admit().expect("admission once the state directory is writable");
    prober.finish("full and read-only state directories");
    let listed: Vec<u16> = client(&url, None)
        .send(&control::jobs())
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(listed, vec![first.id, second.id]);
}

/// Issue 36, finding 1, end to end: `phubctl appliance add a2 --url URL`
/// for a dataplane already managed as `a` (the same URL, with a trailing
/// `/`, or `localhost` for `127.0.0.1`) was accepted; a2's reconciliation
/// then removed the flat job's part there as "not admitted there", a's
/// reinstalled it empty, and the job was wedged (its parts at different
/// rounds). Now every spelling is refused naming `a`, and the job, trained
/// through the attempts, finishes every round exactly.
#[test]
fn a_second_name_for_a_dataplane_is_refused_and_its_job_loses_no_round() {
    let rack = common::Appliances::start(&[1, 1], "64MiB");
    let keys = [5000u64];
    let job = rack
        .admit(
            "name = \"alias\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 5000\n\
             [placement]\nappliances = [\"a\", \"b\"]\n",
        )
        .unwrap();
    let url = rack.mgmt_urls[0].clone();
    let port = url.rsplit(':').next().unwrap().to_string();
    let spellings = [url.clone(), format!("{url}/"), format!("http://localhost:{port}")];
    let attempts = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for rank in 0..2u16 {
            let (rack, job, keys, spellings, attempts) = (&rack, &job, &keys, &spellings, &attempts);
            s.spawn(move || {
                let cfg = phub_worker::WorkerConfig::default();
                common::train_rank(&rack.control_url, job.id, job.token, rank, 2, keys, cfg, |r| {
                    if rank == 0 && r == 4 {
                        for u in spellings {
                            let out = rack.phubctl(&["appliance", "add", "a2", "--url", u, "--rack", "r9"]);
                            attempts.lock().unwrap().push((u.clone(), out));
                        }
                        // Several reconcile periods (200 ms) pass.
                        std::thread::sleep(Duration::from_millis(800));
                    }
                    r <= 8
                })
            });
        }
    });
    for (u, (ok, _, err)) in attempts.into_inner().unwrap() {
        assert!(!ok, "{u} was accepted as a second name for appliance a");
        assert!(err.contains("appliance \"a\""), "{u}: {err}");
    }
    let (_, out, _) = rack.phubctl(&["appliance", "list"]);
    assert!(!out.contains("a2"), "{out}");
    let log = std::fs::read_to_string(rack.dir.join("phub-control.log")).unwrap();
    assert!(
        !log.contains("reinstalled job") && !log.contains("removed"),
        "the job was moved: {log}"
    );
}

/// Issue 36, finding 4: an appliance that accepts connections but never
/// answers (`phubctl appliance add --force`, a listener that never reads)
/// made every read (`GET /v1/jobs`, `/metrics`) take about 10 s, and
/// twelve anonymous readers then held the 8 handlers: a worker's join took
/// 9.7 s instead of milliseconds (with 50 readers, 30 s and a timeout).
/// Now reads never wait on a hung appliance (at most 300 ms for one that
/// was answering, then not at all while its request hangs), and joins and
/// the operator's routes run in handlers of their own that reads cannot
/// take; with a black hole registered and 50 readers looping on both
/// routes, every join answers within 100 ms and every read within 2 s.
#[test]
fn a_hung_appliance_and_fifty_readers_do_not_hold_joins() {
    let rack = Rack::start(1, "64MiB");
    let job = rack.admit(SPEC).unwrap();
    let hole = BlackHole::start();
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, _, err) = rack.phubctl(&["appliance", "add", "hole", "--url", &hole.url, "--force"]);
    assert!(ok, "{err}");
    let worst = Arc::new(Mutex::new((Duration::ZERO, 0u64, Vec::<String>::new())));
    let readers: Vec<_> = (0..50)
        .map(|i| {
            let (stop, worst) = (stop.clone(), worst.clone());
            let route = if i % 2 == 0 { R::Jobs } else { R::Metrics };
            let url = format!("{}{}", rack.control_url, route.path());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let r = ureq::get(&url).timeout(Duration::from_secs(30)).call();
                    let mut w = worst.lock().unwrap();
                    w.0 = w.0.max(t.elapsed());
                    w.1 += 1;
                    if let Err(e) = r {
                        w.2.push(e.to_string());
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let join = format!(
        "{{\"token\": \"{:016x}\", \"rank\": 0, \"rejoin\": true}}",
        job.token
    );
    let mut took: Vec<Duration> = (0..20)
        .map(|_| {
            let t = Instant::now();
            ureq::post(&format!("{}{}", rack.control_url, R::Join { job: job.id }.path()))
                .send_string(&join)
                .unwrap();
            let d = t.elapsed();
            std::thread::sleep(Duration::from_millis(50));
            d
        })
        .collect();
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    took.sort();
    let (worst_read, reads, errors) = worst.lock().unwrap().clone();
    println!(
        "joins with a black hole and 50 readers: median {:?}, max {:?}; {reads} reads, slowest {worst_read:?}",
        took[took.len() / 2],
        took[took.len() - 1]
    );
    assert!(errors.is_empty(), "{:?}", &errors[..errors.len().min(5)]);
    assert!(
        took[took.len() - 1] < Duration::from_secs(2),
        "joins took {took:?}"
    );
    assert!(worst_read < Duration::from_secs(2), "a read took {worst_read:?}");
    // The hole is shown down, saying for how long it has not answered.
    let (_, out, _) = rack.phubctl(&["appliance", "list"]);
    assert!(out.contains("hole"), "{out}");
}

// Finding 2 of issue 36: a part's checkpoint that cannot be used.

/// The keys of the checkpoint tests: 14 chunks of 2048 elements, shared by
/// two appliances.
const CKPT_KEYS: [u64; 3] = [5000, 3, 20_000];

/// An SGD job of one worker over [`CKPT_KEYS`], sharded over appliances a
/// and b, with `extra` spec lines.
fn sharded_sgd(name: &str, extra: &str) -> String {
    let mut s = format!("name = \"{name}\"\nworkers = 1\n{extra}[optimizer]\nkind = \"sgd\"\nlr = 0.125\n");
    for k in CKPT_KEYS {
        s += &format!("[[keys]]\nelements = {k}\n");
    }
    s + "[placement]\nappliances = [\"a\", \"b\"]\n"
}

/// Rank 0 of `job` joined, its initial values sent and broadcast back.
fn ckpt_worker(rack: &Appliances, job: &AdmitResponse) -> (Worker, Vec<Vec<f32>>) {
    let w = Worker::join_with(&rack.control_url, job.id, job.token, 0, WorkerConfig::default()).unwrap();
    let mut params: Vec<Vec<f32>> = CKPT_KEYS
        .iter()
        .enumerate()
        .map(|(k, &n)| init_values(k as u32, n))
        .collect();
    for (k, p) in params.iter_mut().enumerate() {
        w.wait(w.init(k as u32, p).unwrap()).unwrap();
    }
    (w, params)
}

/// SGD rounds `rounds` of the one worker, each result checked exactly
/// against a run that never stopped.
fn sgd_rounds(w: &Worker, params: &mut [Vec<f32>], rounds: std::ops::RangeInclusive<u32>) {
    for round in rounds {
        for (k, p) in params.iter_mut().enumerate() {
            let g: Vec<f32> = (0..p.len()).map(|e| grad(0, k as u32, e, round)).collect();
            w.wait(w.push_pull(k as u32, &g, p).unwrap())
                .unwrap_or_else(|e| panic!("round {round} key {k}: {e}"));
            let want = sgd_reference(1, k as u32, &init_values(k as u32, CKPT_KEYS[k]), round);
            assert!(
                *p == want,
                "round {round} key {k}: parameters differ from a run that never stopped"
            );
        }
    }
}

/// After a part was restored from its checkpoint: the worker pulls every
/// key (a restored lcore refuses a rank's pushes `ahead` until it pulled,
/// PROTOCOL.md §5.4 rule 0), and each stands at `round` with the values the
/// worker holds.
fn pull_after_restore(w: &Worker, params: &mut [Vec<f32>], round: u32) {
    for (k, p) in params.iter_mut().enumerate() {
        let held = p.clone();
        let at = w
            .pull(k as u32, p)
            .unwrap_or_else(|e| panic!("pull key {k}: {e}"));
        assert_eq!(at, round, "key {k} pulled at round {at}");
        assert!(*p == held, "key {k}: pulled values differ from round {round}'s");
    }
}

/// Job `id`'s part on appliance `name`'s checkpoint file.
fn part_file(rack: &Appliances, id: u16, name: &str) -> std::path::PathBuf {
    rack.dir.join(format!("state.json.job-{id}.{name}.ckpt"))
}

/// Waits up to 20 s for job `id`'s `held` reason in `GET /v1/jobs` (a
/// control without the field never shows one).
fn wait_held(rack: &Appliances, id: u16) -> String {
    let t = Instant::now();
    loop {
        let jobs = rack.send(&control::jobs());
        let job = jobs.iter().find(|j| j.id == id).unwrap();
        if let Some(why) = &job.held {
            assert!(!job.installed, "{job:?}");
            return why.clone();
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "job {id} is not shown held (installed: {}); phubctl job list:\n{}",
            job.installed,
            rack.phubctl(&["job", "list"]).1
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The job's held part is not installed on appliance `i`, nor are its
/// joins and checkpoints taken, and `file` stays `bytes`, through more than
/// one `checkpoint_interval_s`.
fn stays_held(rack: &Appliances, i: usize, job: &AdmitResponse, file: &std::path::Path, bytes: &[u8]) {
    let id = job.id.to_string();
    let (ok, out, err) = rack.phubctl(&["job", "list"]);
    assert!(
        ok && out.lines().nth(1).is_some_and(|l| l.ends_with("  HELD")),
        "{out}{err}"
    );
    let metrics = ureq::get(&format!("{}{}", rack.control_url, R::Metrics.path()))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        metrics.contains(&format!("phub_job_held{{job=\"{id}\"}} 1")),
        "{metrics}"
    );
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(
        !ok && err.contains("is held") && err.contains("job retry"),
        "{out}{err}"
    );
    let join_path = R::Join { job: job.id }.path();
    let join = ureq::post(&format!("{}{join_path}", rack.control_url)).send_string(&format!(
        "{{\"token\": \"{:016x}\", \"rank\": 0, \"rejoin\": true}}",
        job.token
    ));
    match join {
        Err(ureq::Error::Status(409, r)) => {
            let m = r.into_string().unwrap();
            assert!(m.contains("is held"), "{m}");
        }
        other => panic!("a join of a held job: {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        std::fs::read(file).unwrap() == bytes,
        "{} was written over",
        file.display()
    );
    let installed: Vec<InstalledJob> = rack.dataplane(i, &mgmt::jobs());
    assert!(
        installed.iter().all(|j| j.id != job.id),
        "the held part was installed: {installed:?}"
    );
}

/// Finding 2 of issue 36: a corrupt part checkpoint was installed empty,
/// then written over. Reproduction (before the fix): a flat job sharded
/// over appliances a and b trains 3 rounds and is checkpointed; b's
/// dataplane is killed, one byte of b's part file flipped, b started again.
/// Control logged one ERROR and installed the part empty: `job list` said
/// INSTALLED yes, `job show` still listed the checkpoint's rounds, and the
/// next periodic checkpoint (`checkpoint_interval_s = 1`) wrote "no
/// completed round yet" over the file. Now the job is held, with the
/// reason, in `job list`, `job show` and /metrics; a checkpoint by hand
/// and a join are refused (409); the file stays byte for byte through
/// periodic checkpoints; and once the good copy is put back, `phubctl job
/// retry` restores the part from it and training goes on exactly from
/// round 3.
#[test]
fn a_corrupt_part_checkpoint_holds_the_job_until_the_file_is_repaired() {
    let mut rack = Appliances::start(&[1, 1], "256MiB");
    let job = rack
        .admit(&sharded_sgd("corrupt", "checkpoint_interval_s = 1\n"))
        .unwrap();
    let id = job.id.to_string();
    let (w, mut params) = ckpt_worker(&rack, &job);
    sgd_rounds(&w, &mut params, 1..=3);
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(ok && out.contains("round 3"), "{out}{err}");
    let file = part_file(&rack, job.id, "b");
    let good = std::fs::read(&file).unwrap();

    rack.kill_dataplane(1);
    // A periodic checkpoint in flight at the kill ends before the file is
    // damaged.
    std::thread::sleep(Duration::from_millis(500));
    let mut bad = good.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0x10;
    std::fs::write(&file, &bad).unwrap();
    rack.start_dataplane(1);

    let why = wait_held(&rack, job.id);
    assert!(
        why.contains("part on appliance \"b\"") && why.contains(".b.ckpt") && why.contains("checksum"),
        "{why}"
    );
    let (ok, out, err) = rack.phubctl(&["job", "show", &id]);
    assert!(ok && out.contains("HELD: part on appliance \"b\""), "{out}{err}");
    assert!(
        !out.contains("last checkpoint"),
        "the refused checkpoint is still listed:\n{out}"
    );
    stays_held(&rack, 1, &job, &file, &bad);

    // Still corrupt: retry says why, and the job stays held.
    let (ok, out, err) = rack.phubctl(&["job", "retry", &id]);
    assert!(!ok && err.contains("checksum"), "{out}{err}");
    wait_held(&rack, job.id);

    // The good copy back: restored from it, exactly where it says.
    std::fs::write(&file, &good).unwrap();
    let (ok, out, err) = rack.phubctl(&["job", "retry", &id]);
    assert!(
        ok && out.contains("appliance \"b\"") && out.contains("usable (round 3); restored from it"),
        "{out}{err}"
    );
    let stats: phub::proto::api::DataplaneStats = rack.dataplane(1, &mgmt::stats());
    let live = stats.jobs.iter().find(|j| j.id == job.id).unwrap();
    assert_eq!(live.round_range, Some((3, 3)), "{live:?}");
    let listed = rack.send(&control::jobs());
    assert!(listed[0].installed && listed[0].held.is_none(), "{listed:?}");
    pull_after_restore(&w, &mut params, 3);
    sgd_rounds(&w, &mut params, 4..=6);
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(ok && out.contains("round 6"), "{out}{err}");
}

/// Finding 2 of issue 36, the same fault another way: a flat job's two
/// part files swapped. Reproduction (before the fix): train 2 rounds,
/// checkpoint, kill b's dataplane, swap `state.json.job-1.a.ckpt` and
/// `...b.ckpt`, start b: control could not move a's chunks onto b's part,
/// logged one ERROR and installed b's part empty (the pushes then got
/// `ahead`). Now it is caught as not the part's (another part's chunks)
/// and the job held, as a corrupt file is (and as another job's file is:
/// one way for the whole class, held, never failed, so that the operator
/// can put the right file back); put back, `job retry` restores it.
#[test]
fn swapped_part_checkpoints_hold_the_job_until_put_back() {
    let mut rack = Appliances::start(&[1, 1], "256MiB");
    let job = rack.admit(&sharded_sgd("swapped", "")).unwrap();
    let id = job.id.to_string();
    let (w, mut params) = ckpt_worker(&rack, &job);
    sgd_rounds(&w, &mut params, 1..=2);
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(ok && out.contains("round 2"), "{out}{err}");
    let (fa, fb) = (part_file(&rack, job.id, "a"), part_file(&rack, job.id, "b"));
    let (a, b) = (std::fs::read(&fa).unwrap(), std::fs::read(&fb).unwrap());

    rack.kill_dataplane(1);
    std::fs::write(&fa, &b).unwrap();
    std::fs::write(&fb, &a).unwrap();
    rack.start_dataplane(1);

    let why = wait_held(&rack, job.id);
    assert!(
        why.contains("part on appliance \"b\"") && why.contains("another part's checkpoint"),
        "{why}"
    );
    stays_held(&rack, 1, &job, &fb, &a);
    assert!(std::fs::read(&fa).unwrap() == b, "a's file was written over");

    std::fs::write(&fa, &a).unwrap();
    std::fs::write(&fb, &b).unwrap();
    let (ok, out, err) = rack.phubctl(&["job", "retry", &id]);
    assert!(
        ok && out.contains("usable (round 2); restored from it"),
        "{out}{err}"
    );
    pull_after_restore(&w, &mut params, 2);
    sgd_rounds(&w, &mut params, 3..=4);
}

/// Finding 2 of issue 36, (c): a checkpoint with no completed round never
/// replaces one with rounds. Reproduction (before the fix): a job trains 3
/// rounds and is checkpointed; with control down, its part is removed from
/// the dataplane and installed again empty (by hand, with the management
/// token: state lost that control never restored); control comes back and
/// sees it installed; `phubctl job checkpoint` then wrote "no completed
/// round yet" over the file of round 3. Now it is refused (409), naming
/// what each holds, and the file stays byte for byte.
#[test]
fn an_empty_checkpoint_never_replaces_one_with_rounds() {
    let mut rack = Rack::start(1, "256MiB");
    let keys = [3000u64, 5];
    let job = rack
        .admit(&phub_hwtests::workload::sum_spec("kept", 1, None, &keys))
        .unwrap();
    let id = job.id.to_string();
    common::train(&rack.control_url, &job, 1, &keys, 3);
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(ok && out.contains("round 3"), "{out}{err}");
    let file = rack.dir.join(format!("state.json.job-{id}.ckpt"));
    let good = std::fs::read(&file).unwrap();

    rack.kill_control();
    let install = phub::proto::checkpoint::Checkpoint::decode(&good).unwrap().job;
    let url = |route: M| format!("{}{}", rack.mgmt_url, route.path());
    let bearer = format!("Bearer {}", rack.mgmt_token());
    ureq::delete(&url(M::Remove { job: job.id }))
        .set("Authorization", &bearer)
        .call()
        .unwrap();
    ureq::put(&url(M::Install { job: job.id }))
        .set("Authorization", &bearer)
        .send_string(&serde_json::to_string(&install).unwrap())
        .unwrap();
    rack.start_control();

    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(
        !ok && err.contains("older or emptier")
            && err.contains("round 3")
            && err.contains("no completed round"),
        "{out}{err}"
    );
    assert!(
        std::fs::read(&file).unwrap() == good,
        "the checkpoint of round 3 was written over"
    );
}

/// Finding 2 of issue 36: the held state survives a control restart, and
/// the operator may give the checkpoint up. Reproduction (before the fix):
/// a checkpointed job's file is damaged while control is down; control
/// started again logged "ignoring the checkpoint" and forgot it, and the
/// next checkpoint wrote over it. Now control finds it unusable at start
/// and holds the job (its part, still installed on the dataplane, keeps
/// running); `job retry --discard-checkpoint` renames the file aside, keeps
/// the dataplane's state, and checkpoints are taken again.
#[test]
fn a_checkpoint_found_corrupt_at_start_holds_the_job_until_given_up() {
    let mut rack = Rack::start(1, "256MiB");
    let keys = [3000u64, 5];
    let job = rack
        .admit(&phub_hwtests::workload::sum_spec("restart", 1, None, &keys))
        .unwrap();
    let id = job.id.to_string();
    common::train(&rack.control_url, &job, 1, &keys, 2);
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(ok && out.contains("round 2"), "{out}{err}");
    let file = rack.dir.join(format!("state.json.job-{id}.ckpt"));
    let mut bad = std::fs::read(&file).unwrap();
    bad.truncate(bad.len() - 9);

    rack.kill_control();
    std::fs::write(&file, &bad).unwrap();
    rack.start_control();

    let (ok, out, err) = rack.phubctl(&["job", "show", &id]);
    assert!(
        ok && out.contains("HELD: part on appliance \"default\"") && out.contains("unusable"),
        "{out}{err}"
    );
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(!ok && err.contains("is held"), "{out}{err}");
    assert!(std::fs::read(&file).unwrap() == bad);

    let (ok, out, err) = rack.phubctl(&["job", "retry", &id, "--discard-checkpoint"]);
    assert!(
        ok && out.contains("set aside as") && out.contains("still had the part"),
        "{out}{err}"
    );
    assert!(!file.exists(), "the file was not set aside");
    let aside: Vec<_> = std::fs::read_dir(&rack.dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".ckpt.discarded-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert!(std::fs::read(aside[0].path()).unwrap() == bad);
    let (ok, out, err) = rack.phubctl(&["job", "checkpoint", &id]);
    assert!(ok && out.contains("round 2"), "{out}{err}");
}

/// An appliance that accepts connections and never answers: a listener on
/// 127.0.0.1 whose connections are held, unread, until it is dropped.
struct BlackHole {
    url: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BlackHole {
    fn start() -> BlackHole {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((c, _)) => held.push(c),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        BlackHole {
            url,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Tries `guess` from `from` against `addr`, one request after another, for
/// `span`: the answers' status codes, and the first `429` answer whole.
fn guesses(from: Ipv4Addr, addr: SocketAddr, guess: &[u8], span: Duration) -> (Vec<u16>, Option<String>) {
    let (mut codes, mut refusal) = (Vec::new(), None);
    let t = Instant::now();
    while t.elapsed() < span {
        let out = raw_from(from, addr, guess);
        let code = out
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .unwrap_or(0);
        if code == 429 && refusal.is_none() {
            refusal = Some(out);
        }
        codes.push(code);
    }
    (codes, refusal)
}

/// The lines of `log` that report a refused credential from `source`.
fn credential_lines(log: &std::path::Path, source: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("credential") && l.contains(source))
        .map(str::to_string)
        .collect()
}

/// Finding 6 of issue 36 (tokens): failed checks of the operator token and
/// of the dataplane's management token were neither logged nor slowed.
///
/// Reproduction: loop `DELETE /v1/jobs/1` with a wrong `Authorization:
/// Bearer` from one host: control answered `403` to about 3,200 guesses a
/// second and logged none of them; the dataplane's management API the same.
/// Now a source with ten failed checks within ten seconds gets `429` with
/// `Retry-After` for every further wrong token until those ten seconds
/// pass (a right one is still served); each source's failures are logged
/// at WARN, at most two lines per window; other sources are served
/// throughout.
#[test]
fn wrong_tokens_are_logged_and_slowed_per_source() {
    let rack = Rack::start(1, "64MiB");
    let control = addr_of(&rack.control_url);
    let mgmt = addr_of(&rack.mgmt_url);
    let wrong = "Bearer 0123456789abcdef0123456789abcdef";

    // Control's operator token, guessed from 127.0.0.1 for two seconds.
    let guess = raw(&R::Evict { job: 1 }, &format!("Authorization: {wrong}\r\n\r\n"));
    let (codes, refusal) = guesses(host(1), control, &guess, Duration::from_secs(2));
    let checked = codes.iter().filter(|&&c| c == 403).count();
    let refused = codes.iter().filter(|&&c| c == 429).count();
    eprintln!(
        "control, 2 s of wrong tokens from one host: {} tries, {checked} checked, {refused} refused",
        codes.len()
    );
    // At most ten failed checks per host in ten seconds (the defaults).
    assert!(
        checked <= 10 && refused > 0,
        "control checked {checked} wrong tokens from one host in 2 s and refused {refused} ({} tries)",
        codes.len()
    );
    let refusal = refusal.unwrap();
    assert!(
        refusal.to_ascii_lowercase().contains("retry-after: "),
        "{refusal}"
    );
    assert!(refusal.contains("failed credential checks"), "{refusal}");
    // The right token from the same host is still served (no job 999:
    // 404): every local client is one host on loopback, and a guesser must
    // not lock out the others; so it is from another host, and reads stay
    // open.
    let token = rack.operator_token();
    let right = raw(
        &R::Evict { job: 999 },
        &format!("Authorization: Bearer {token}\r\n\r\n"),
    );
    let out = raw_from(host(1), control, &right);
    assert!(out.starts_with("HTTP/1.1 404"), "{out}");
    let out = raw_from(host(2), control, &right);
    assert!(out.starts_with("HTTP/1.1 404"), "{out}");
    let out = raw_from(host(1), control, &raw(&R::Jobs, "\r\n"));
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let lines = credential_lines(&rack.dir.join("phub-control.log"), "127.0.0.1");
    eprintln!("control's log: {lines:#?}");
    assert!(
        !lines.is_empty() && lines.len() <= 3,
        "control's log has {} lines on refused credentials from 127.0.0.1: {lines:#?}",
        lines.len()
    );

    // The dataplane's management token, guessed from 127.0.0.3; control
    // (from 127.0.0.1) still installs a job with the right one.
    let guess = raw(&M::Remove { job: 7 }, &format!("Authorization: {wrong}\r\n\r\n"));
    let (codes, _) = guesses(host(3), mgmt, &guess, Duration::from_secs(1));
    let checked = codes.iter().filter(|&&c| c == 403).count();
    eprintln!(
        "the dataplane, 1 s of wrong tokens from one host: {} tries, {checked} checked",
        codes.len()
    );
    assert!(
        checked <= 10 && codes.contains(&429),
        "the dataplane checked {checked} wrong tokens from one host in 1 s ({} tries)",
        codes.len()
    );
    let admit = raw(
        &R::Admit,
        &format!(
            "Authorization: Bearer {token}\r\nContent-Length: {}\r\n\r\n{SPEC}",
            SPEC.len()
        ),
    );
    let out = raw_from(host(2), control, &admit);
    assert!(
        out.starts_with("HTTP/1.1 201"),
        "admission while another host guesses the management token: {out}"
    );
    let lines = credential_lines(&rack.dir.join("phub-dataplane.log"), "127.0.0.3");
    assert!(
        !lines.is_empty(),
        "the dataplane's log names no refused credential from 127.0.0.3"
    );
}

/// Finding 6 of issue 36 (connections): the connection limit was global, so
/// one host could hold every connection.
///
/// Reproduction: open 300 connections to control from one host, each
/// sending half a request head and then nothing; every other client was
/// answered `503 too many connections` until they timed out. The same on
/// the dataplane's management API. Now one source holds at most
/// `max_connections_per_source` (64) connections: its next one is answered
/// `503` naming that limit, and other hosts are served.
#[test]
fn one_host_cannot_hold_every_connection() {
    let rack = Rack::start(1, "64MiB");
    for (what, addr) in [
        ("control", addr_of(&rack.control_url)),
        ("the dataplane", addr_of(&rack.mgmt_url)),
    ] {
        let held: Vec<TcpStream> = (0..300)
            .filter_map(|_| {
                let mut c = connect_from(host(1), addr).ok()?;
                let _ = c.write_all(&raw(&R::Jobs, "X-Slow: "));
                Some(c)
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        // `GET /v1/jobs` is a route of both APIs.
        let get = raw(&R::Jobs, "\r\n");
        let out = raw_from(host(2), addr, &get);
        assert!(
            out.starts_with("HTTP/1.1 200"),
            "{what}, with 300 connections held from 127.0.0.1, answered 127.0.0.2: {out}"
        );
        let out = raw_from(host(1), addr, &get);
        assert!(
            out.starts_with("HTTP/1.1 503") && out.contains("at most 64 at once from one address"),
            "{what}: {out}"
        );
        drop(held);
    }
}
