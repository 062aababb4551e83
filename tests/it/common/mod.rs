//! A whole appliance on loopback for integration tests: phub-dataplane and
//! phub-control as real processes on free ports, stopped when dropped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use phub::proto::api::AdmitResponse;
use phub::proto::routes::control::{self, ControlCall};
use phub::proto::routes::mgmt::MgmtCall;
use phub::proto::routes::{Call, ControlRoute, MgmtRoute, Route};
use phub::proto::spec::{Consistency, JobSpec};
use phub_hwtests::dataplane_args::DataplaneArgs;
use phub_hwtests::process::{self, Daemon};
pub(crate) use phub_hwtests::workload::client;

pub(crate) mod udp_beside;

pub(crate) struct Rack {
    pub(crate) dataplane: Option<Daemon>,
    pub(crate) control: Option<Daemon>,
    pub(crate) mgmt_url: String,
    pub(crate) control_url: String,
    control_port: u16,
    dataplane_args: Vec<String>,
    /// Extra phub-control arguments (TLS, say).
    pub(crate) control_args: Vec<String>,
    pub(crate) dir: PathBuf,
}

/// A base port with `n` consecutive free UDP ports on 127.0.0.1.
pub(crate) fn free_udp_ports(n: u16) -> u16 {
    process::free_udp_ports(n).unwrap()
}

pub(crate) fn free_port() -> u16 {
    process::free_port().unwrap()
}

/// Starts `name` (`program args`), its log in `dir`, and waits up to 20 s
/// for its API at `url`; panics saying why it did not come up.
/// The daemons keep their run-time secrets (the dataplane's management
/// token) in `dir`, not in the machine's runtime directory.
fn start(name: &str, program: &str, args: &[String], dir: &Path, url: &str) -> Daemon {
    let log = dir.join(format!("{name}.log"));
    let env = [("PHUB_RUNTIME_DIR".to_string(), dir.display().to_string())];
    let mut d = Daemon::spawn(name, Path::new(program), args, &env, &log).unwrap();
    if let Err(e) = d.wait_up(url, Duration::from_secs(20), || false) {
        panic!("{e}");
    }
    d
}

impl Rack {
    pub(crate) fn start(lcores: usize, budget: &str) -> Rack {
        Rack::start_with(lcores, budget, &[])
    }

    /// Like [`Rack::start`], with extra phub-dataplane arguments.
    pub(crate) fn start_with(lcores: usize, budget: &str, extra: &[&str]) -> Rack {
        let dir = std::env::temp_dir().join(format!("phub-test-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let mgmt = free_port();
        let base = free_udp_ports(lcores as u16);
        let dataplane_args = loopback_dataplane(base, lcores, mgmt, budget, extra).to_args();
        let mut rack = Rack {
            dataplane: None,
            control: None,
            mgmt_url: format!("http://127.0.0.1:{mgmt}"),
            control_url: String::new(),
            control_port: free_port(),
            dataplane_args,
            control_args: Vec::new(),
            dir,
        };
        rack.start_dataplane();
        rack.control_url = format!("http://127.0.0.1:{}", rack.control_port);
        rack.start_control();
        rack
    }

    /// Starts phub-dataplane (again), on the same ports.
    pub(crate) fn start_dataplane(&mut self) {
        self.dataplane = Some(start(
            "phub-dataplane",
            env!("CARGO_BIN_EXE_phub-dataplane"),
            &self.dataplane_args,
            &self.dir,
            &format!("{}{}", self.mgmt_url, MgmtRoute::Info.path()),
        ));
    }

    /// Kills phub-dataplane outright (SIGKILL), as a crash would.
    pub(crate) fn kill_dataplane(&mut self) {
        if let Some(mut d) = self.dataplane.take() {
            d.kill();
        }
    }

    pub(crate) fn start_control(&mut self) {
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{}", self.control_port),
            "--dataplane".into(),
            self.mgmt_url.clone(),
            "--reconcile-ms".into(),
            "200".into(),
            "--state".into(),
            self.dir.join("state.json").display().to_string(),
        ];
        args.extend(self.control_args.iter().cloned());
        self.control = Some(start(
            "phub-control",
            env!("CARGO_BIN_EXE_phub-control"),
            &args,
            &self.dir,
            &format!("{}{}", self.control_url, ControlRoute::Jobs.path()),
        ));
    }

    /// Kills phub-control outright (SIGKILL), as a crash would.
    pub(crate) fn kill_control(&mut self) {
        if let Some(mut c) = self.control.take() {
            c.kill();
        }
    }

    /// The dataplane's management token (in the rack's runtime directory).
    pub(crate) fn mgmt_token(&self) -> String {
        let port: u16 = self.mgmt_url.rsplit(':').next().unwrap().parse().unwrap();
        std::fs::read_to_string(self.dir.join(format!("dataplane-{port}.token")))
            .unwrap()
            .trim()
            .to_string()
    }

    /// `call` to the dataplane's management API (an open route).
    pub(crate) fn dataplane<A>(&self, call: &MgmtCall<'_, A>) -> A {
        send(&self.mgmt_url, call)
    }

    /// `call` to the dataplane's management API with its token, as
    /// control sends it.
    pub(crate) fn dataplane_as_control<A>(&self, call: &MgmtCall<'_, A>) -> A {
        client(&self.mgmt_url, Some(&self.mgmt_token()))
            .send(call)
            .unwrap_or_else(|e| panic!("{} at {}: {e}", call.what(), self.mgmt_url))
    }
}

impl Operator for Rack {
    fn control_url(&self) -> &str {
        &self.control_url
    }

    fn state_dir(&self) -> &Path {
        &self.dir
    }
}

/// What a test does as the operator of a [`Rack`]'s or [`Appliances`]'
/// phub-control, with the token control wrote beside its state file.
pub(crate) trait Operator {
    /// Control's URL.
    fn control_url(&self) -> &str;

    /// The directory of control's state file.
    fn state_dir(&self) -> &Path;

    /// The operator token phub-control generated beside its state file.
    fn operator_token(&self) -> String {
        std::fs::read_to_string(self.state_dir().join("state.json.operator-token"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Admits `spec`: its answer, or the error's status and message.
    fn admit(&self, spec: &str) -> Result<AdmitResponse, (u16, String)> {
        admit(self.control_url(), &self.operator_token(), spec)
    }

    /// `call` to control with the operator token; panics saying why it
    /// failed.
    fn send<A>(&self, call: &ControlCall<'_, A>) -> A {
        client(self.control_url(), Some(&self.operator_token()))
            .send(call)
            .unwrap_or_else(|e| panic!("{}: {e}", call.what()))
    }

    /// Runs phubctl against control as the operator: (success, stdout,
    /// stderr).
    fn phubctl(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_phubctl"))
            .env("PHUB_OPERATOR_TOKEN", self.operator_token())
            .args(["--control", self.control_url()])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// A phub-dataplane on loopback: kernel UDP from port `base`, `lcores`
/// unpinned, its management API on 127.0.0.1:`mgmt`, and `extra`.
fn loopback_dataplane(base: u16, lcores: usize, mgmt: u16, budget: &str, extra: &[&str]) -> DataplaneArgs {
    DataplaneArgs {
        base_port: Some(base),
        lcores: Some(lcores),
        no_pin: true,
        mgmt: Some(format!("127.0.0.1:{mgmt}")),
        memory_budget: Some(budget.into()),
        extra: extra.iter().map(|a| a.to_string()).collect(),
        ..DataplaneArgs::default()
    }
}

/// Admits `spec` through the control at `control_url` with the operator
/// `token`: its answer, or the error's status and message.
pub(crate) fn admit(control_url: &str, token: &str, spec: &str) -> Result<AdmitResponse, (u16, String)> {
    client(control_url, Some(token))
        .send(&control::admit(spec))
        .map_err(|e| match e.status() {
            Some(status) => (status, e.message().to_string()),
            None => panic!("admission: {e}"),
        })
}

/// `call` to the server at `base`, without a token; panics saying why it
/// failed.
fn send<Rt: Route, A>(base: &str, call: &Call<'_, Rt, A>) -> A {
    client(base, None)
        .send(call)
        .unwrap_or_else(|e| panic!("{} at {base}: {e}", call.what()))
}

/// Removes a rack's directory (its daemons' logs, state and tokens),
/// unless `PHUB_KEEP_DIRS` is set: then it stays in the temporary
/// directory to be read after the test (`grep -r WARN /tmp/phub-test-*`).
pub(crate) fn remove_test_dir(dir: &Path) {
    if std::env::var_os("PHUB_KEEP_DIRS").is_none() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

impl Drop for Rack {
    fn drop(&mut self) {
        // Control first (each stops with SIGTERM, then SIGKILL, when dropped).
        drop(self.control.take());
        drop(self.dataplane.take());
        remove_test_dir(&self.dir);
    }
}

/// Several appliances on loopback under one phub-control: one
/// phub-dataplane each (named `a`, `b`, ..., in racks `r1`, `r2`, ...),
/// given to control with `--appliance`, stopped when dropped.
pub(crate) struct Appliances {
    /// Each appliance's dataplane, `None` while killed.
    pub(crate) dataplanes: Vec<Option<Daemon>>,
    pub(crate) names: Vec<String>,
    pub(crate) mgmt_urls: Vec<String>,
    dataplane_args: Vec<Vec<String>>,
    pub(crate) control: Option<Daemon>,
    pub(crate) control_url: String,
    control_args: Vec<String>,
    pub(crate) dir: PathBuf,
}

impl Appliances {
    /// One appliance per entry of `lcores`, each with that many lcores and
    /// `budget`. The second and later appliances' management tokens are
    /// given to control with `token-file=` (the first's by its default
    /// path), so both ways are exercised.
    pub(crate) fn start(lcores: &[usize], budget: &str) -> Appliances {
        Appliances::start_with(lcores, budget, &[])
    }

    /// As [`Appliances::start`], each phub-dataplane also given `extra`.
    pub(crate) fn start_with(lcores: &[usize], budget: &str, extra: &[&str]) -> Appliances {
        Appliances::start_with_control(lcores, budget, extra, &[])
    }

    /// As [`Appliances::start_with`], phub-control also given `control`.
    pub(crate) fn start_with_control(
        lcores: &[usize],
        budget: &str,
        extra: &[&str],
        control: &[&str],
    ) -> Appliances {
        let dir = std::env::temp_dir().join(format!("phub-test-appl-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut a = Appliances {
            dataplanes: Vec::new(),
            names: Vec::new(),
            mgmt_urls: Vec::new(),
            dataplane_args: Vec::new(),
            control: None,
            control_url: format!("http://127.0.0.1:{}", free_port()),
            control_args: Vec::new(),
            dir,
        };
        let mut control_args = vec![
            "--listen".to_string(),
            a.control_url.trim_start_matches("http://").to_string(),
            "--reconcile-ms".into(),
            "200".into(),
            "--state".into(),
            a.dir.join("state.json").display().to_string(),
        ];
        control_args.extend(control.iter().map(|s| (*s).to_string()));
        for (i, &n) in lcores.iter().enumerate() {
            let name = ((b'a' + i as u8) as char).to_string();
            let mgmt = free_port();
            let base = free_udp_ports(n as u16);
            a.dataplane_args
                .push(loopback_dataplane(base, n, mgmt, budget, extra).to_args());
            let url = format!("http://127.0.0.1:{mgmt}");
            let mut spec = format!("name={name},url={url},rack=r{}", i + 1);
            if i > 0 {
                spec += &format!(
                    ",token-file={}",
                    a.dir.join(format!("dataplane-{mgmt}.token")).display()
                );
            }
            control_args.push("--appliance".into());
            control_args.push(spec);
            a.names.push(name);
            a.mgmt_urls.push(url);
            a.dataplanes.push(None);
            a.start_dataplane(i);
        }
        a.control_args = control_args;
        a.start_control();
        a
    }

    /// A power cut over control and dataplanes `which`: all killed
    /// (SIGKILL), control first, then the dataplanes started again, empty,
    /// and control last, so that it finds them all back at once (it would
    /// otherwise see one back and another silent).
    pub(crate) fn restart_with_control(&mut self, which: &[usize]) {
        self.kill_control();
        for &i in which {
            self.kill_dataplane(i);
        }
        for &i in which {
            self.start_dataplane(i);
        }
        self.start_control();
    }

    /// Starts phub-control (again) with the arguments it was first given.
    pub(crate) fn start_control(&mut self) {
        self.control = Some(start(
            "phub-control",
            env!("CARGO_BIN_EXE_phub-control"),
            &self.control_args,
            &self.dir,
            &format!("{}{}", self.control_url, ControlRoute::Jobs.path()),
        ));
    }

    /// Kills phub-control outright (SIGKILL).
    pub(crate) fn kill_control(&mut self) {
        if let Some(mut c) = self.control.take() {
            c.kill();
        }
    }

    /// Starts appliance `i`'s phub-dataplane (again), on the same ports.
    pub(crate) fn start_dataplane(&mut self, i: usize) {
        self.dataplanes[i] = Some(start(
            &format!("phub-dataplane-{}", self.names[i]),
            env!("CARGO_BIN_EXE_phub-dataplane"),
            &self.dataplane_args[i],
            &self.dir,
            &format!("{}{}", self.mgmt_urls[i], MgmtRoute::Info.path()),
        ));
    }

    /// Kills appliance `i`'s phub-dataplane outright (SIGKILL).
    pub(crate) fn kill_dataplane(&mut self, i: usize) {
        if let Some(mut d) = self.dataplanes[i].take() {
            d.kill();
        }
    }

    /// `call` to appliance `i`'s management API (an open route).
    pub(crate) fn dataplane<A>(&self, i: usize, call: &MgmtCall<'_, A>) -> A {
        send(&self.mgmt_urls[i], call)
    }

    /// Each appliance's rounds and state copies of job `job` as its stats
    /// say them (for a test's diagnosis).
    pub(crate) fn copies_views(&self, job: u16) -> Vec<String> {
        (0..self.names.len())
            .map(|i| {
                let s: phub::proto::api::DataplaneStats =
                    self.dataplane(i, &phub::proto::routes::mgmt::stats());
                let j = s.jobs.iter().find(|j| j.id == job);
                format!("{}: {:?}", self.names[i], j.map(|j| (j.round_range, j.copies)))
            })
            .collect()
    }

    /// The last round job `job`'s slots on appliance `i` completed, the
    /// highest over its slots (`None`: none, or the job is not there).
    pub(crate) fn last_round(&self, i: usize, job: u16) -> Option<u32> {
        let stats: phub::proto::api::DataplaneStats = self.dataplane(i, &phub::proto::routes::mgmt::stats());
        stats.jobs.iter().find(|j| j.id == job)?.round_range.map(|r| r.1)
    }
}

impl Operator for Appliances {
    fn control_url(&self) -> &str {
        &self.control_url
    }

    fn state_dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Appliances {
    fn drop(&mut self) {
        drop(self.control.take());
        for d in &mut self.dataplanes {
            drop(d.take());
        }
        remove_test_dir(&self.dir);
    }
}

/// The consistency suites' job: `workers` ranks over two keys, "census"
/// (one element per rank) and "grads" (`grads` elements), summed.
pub(crate) fn census_spec(name: &str, workers: u16, grads: u64, consistency: Consistency) -> String {
    JobSpec::new(name, u32::from(workers), &[u64::from(workers), grads])
        .with_key_names(&["census", "grads"])
        .with_consistency(consistency)
        .to_toml()
}

/// Whether `ok` held within `within`, polled every 20 ms.
pub(crate) fn try_until(within: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let t = std::time::Instant::now();
    while !ok() {
        if t.elapsed() >= within {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Waits up to `within` for `ok` ([`try_until`]); panics naming `what`.
pub(crate) fn until(what: &str, within: Duration, ok: impl FnMut() -> bool) {
    assert!(
        try_until(within, ok),
        "timed out after {within:?} waiting for {what}"
    );
}

/// Waits up to 30 s until control at `url` has reported every appliance
/// answering and not declared down for a heartbeat deadline and one
/// interval (600 ms) in a row: an appliance started after control has
/// answered its heartbeats by then, so that the silence before it
/// listened (which control counts from its first heartbeat) cannot have
/// it declared down just after a job is admitted on it (the DPDK
/// failover test failed so on CI's loaded host).
pub(crate) fn appliances_settled(url: &str, token: Option<&str>) {
    let c = phub_hwtests::workload::client(url, token);
    let mut since: Option<std::time::Instant> = None;
    until(
        "every appliance answering for 600 ms",
        Duration::from_secs(30),
        || {
            let up = c
                .send(&control::appliances())
                .is_ok_and(|all| all.iter().all(|a| a.down.is_none() && a.data.is_some()));
            let at = *since.get_or_insert_with(std::time::Instant::now);
            if !up {
                since = None;
            }
            up && at.elapsed() >= Duration::from_millis(600)
        },
    );
}

/// Waits up to 30 s for control at `url` to report job `job` at full
/// strength (every part holds all its replicas, no copy under way) and
/// returns the job's epoch then. A test that kills an appliance kills it
/// from there: on a loaded host control may declare an appliance down
/// that is only slow (or not yet listening) and give the job back to it
/// (PROTOCOL.md §11.7), and a kill while that copy runs loses the part
/// for good, which is right, but not what the test is about.
pub(crate) fn at_full_strength(url: &str, token: Option<&str>, job: u16) -> phub::proto::failover::EpochView {
    let c = phub_hwtests::workload::client(url, token);
    let full = || {
        c.send(&control::job(job)).is_ok_and(|d| {
            d.replicas
                .is_some_and(|r| r.state == phub::proto::api::Strength::FullStrength)
        })
    };
    until(
        &format!("job {job} at full strength"),
        Duration::from_secs(30),
        full,
    );
    c.send(&control::epoch(job))
        .unwrap_or_else(|e| panic!("job {job}'s epoch from {url}: {e}"))
}

/// A sum job of `workers` ranks over `keys`, sharded over the named
/// appliances with `replicas` copies of every chunk (PROTOCOL.md §11): the
/// replication suites' job.
pub(crate) fn replicated_spec(
    name: &str,
    workers: u16,
    keys: &[u64],
    appliances: &[&str],
    replicas: u32,
) -> String {
    JobSpec::new(name, u32::from(workers), keys)
        .sharded_over(phub::proto::spec::Appliances::named(appliances))
        .with_replicas(replicas)
        .to_toml()
}

/// A hierarchical job (PROTOCOL.md §9) of `workers` ranks over `keys`,
/// one rack per named appliance (its ranks spread evenly), with
/// `replicas` copies of every home's chunks (§11.11).
pub(crate) fn hierarchical_replicated_spec(
    name: &str,
    workers: u16,
    keys: &[u64],
    appliances: &[&str],
    replicas: u32,
) -> String {
    JobSpec::new(name, u32::from(workers), keys)
        .hierarchical_over(phub::proto::spec::Appliances::named(appliances))
        .with_replicas(replicas)
        .to_toml()
}

/// An async job (PROTOCOL.md §5.8) of `workers` ranks over `keys`, sum,
/// sharded over the named appliances with two replicas of every chunk
/// (§11.10): the async replication suites' job.
pub(crate) fn async_replicated_spec(name: &str, workers: u16, keys: &[u64], appliances: &[&str]) -> String {
    JobSpec::new(name, u32::from(workers), keys)
        .with_consistency(phub::proto::spec::Consistency::Async)
        .sharded_over(phub::proto::spec::Appliances::named(appliances))
        .with_replicas(2)
        .to_toml()
}

/// Starts one rank per worker of an async job in scope `s`: each inits
/// `keys` (rank 0's values [`init`]), pushes every key's [`grad`]s each
/// clock while `gates.more` says so (rank 0 waits at the gates the test
/// opens), waits at `done` (a barrier of `workers`) until every rank is
/// done, pulls every key, checks its clock there is the last, and returns
/// what it pulled.
pub(crate) fn train_async_ranks<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    (url, job): (&'env str, &'env AdmitResponse),
    workers: u16,
    keys: &'env [u64],
    gates: &'env Gates,
    done: &'env std::sync::Barrier,
) -> Vec<std::thread::ScopedJoinHandle<'scope, Vec<Vec<f32>>>> {
    (0..workers)
        .map(|rank| {
            s.spawn(move || {
                let w = phub_worker::Worker::join(url, job.id, job.token, rank).unwrap();
                let mut params = phub_hwtests::workload::init_keys(&w, rank, keys);
                let mut c = 1;
                while gates.more(rank, c) {
                    let grads = phub_hwtests::workload::round_grads(rank, keys, c);
                    let hs: Vec<_> = params
                        .iter_mut()
                        .zip(&grads)
                        .enumerate()
                        .map(|(k, (p, g))| w.push_pull(k as u32, g, p).unwrap())
                        .collect();
                    for h in hs {
                        w.wait(h).unwrap_or_else(|e| panic!("rank {rank} clock {c}: {e}"));
                    }
                    c += 1;
                }
                done.wait();
                params
                    .iter_mut()
                    .enumerate()
                    .map(|(k, p)| {
                        assert_eq!(
                            w.pull(k as u32, p).unwrap(),
                            c - 1,
                            "rank {rank} key {k}: its clock"
                        );
                        p.clone()
                    })
                    .collect()
            })
        })
        .collect()
}

/// What each rank of [`train_async_ranks`] pulled at the end is rank 0's
/// initial value plus every rank's push of every clock 1..=`clocks`,
/// exactly (sums of whole numbers and halves: exact in any order): no
/// push lost, none applied twice.
pub(crate) fn assert_async_sums(finals: &[Vec<Vec<f32>>], workers: u16, clocks: u32) {
    for (rank, got) in finals.iter().enumerate() {
        for (k, p) in got.iter().enumerate() {
            for (e, v) in p.iter().enumerate() {
                let want = init(k as u32, e)
                    + (1..=clocks)
                        .flat_map(|c| (0..workers).map(move |r| grad(r, k as u32, e, c)))
                        .sum::<f32>();
                assert_eq!(*v, want, "rank {rank} key {k} elem {e}");
            }
        }
    }
}

/// Rank 0's progress and the gates a replication test opens: rank 0
/// records each round it reaches and, before round `at + 1` of each gate
/// at `at`, waits until the test opens it (120 s at most: a failing test
/// never opens it, and its scope waits for rank 0).
pub(crate) struct Gates {
    reached: std::sync::atomic::AtomicU32,
    gates: Vec<(u32, std::sync::atomic::AtomicBool)>,
    rounds: u32,
}

impl Gates {
    /// Gates before rounds `at[k] + 1`, for a run of rounds `0..=rounds`.
    pub(crate) fn new(at: &[u32], rounds: u32) -> Gates {
        Gates {
            reached: std::sync::atomic::AtomicU32::new(0),
            gates: at
                .iter()
                .map(|&a| (a, std::sync::atomic::AtomicBool::new(false)))
                .collect(),
            rounds,
        }
    }

    /// The ranks' `more` ([`train_ranks`]).
    pub(crate) fn more(&self, rank: u16, r: u32) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if rank == 0 {
            self.reached.store(r, SeqCst);
            for (at, gate) in &self.gates {
                if r == at + 1 {
                    until("the gate", Duration::from_secs(120), || gate.load(SeqCst));
                }
            }
        }
        r <= self.rounds
    }

    /// Waits until rank 0 is past gate `k`'s round (at its gate).
    pub(crate) fn wait_at(&self, k: usize) {
        let at = self.gates[k].0;
        until(
            &format!("rank 0 past round {at}"),
            Duration::from_secs(60),
            || self.reached.load(std::sync::atomic::Ordering::SeqCst) > at,
        );
    }

    /// Opens gate `k`.
    pub(crate) fn open(&self, k: usize) {
        self.gates[k].1.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Waits for every rank [`train_ranks`] started and checks each trained
/// `rounds` rounds.
pub(crate) fn all_trained(
    ranks: Vec<std::thread::ScopedJoinHandle<'_, (u32, phub_worker::WorkerStats)>>,
    rounds: u32,
) {
    for (rank, h) in ranks.into_iter().enumerate() {
        let (done, _stats) = h.join().unwrap();
        assert_eq!(done, rounds, "rank {rank}");
    }
}

/// Starts one [`train_rank`] thread per rank of `job` in scope `s` (the
/// default worker config), each training `keys` while `more(rank, round)`
/// says so: the replication suites' ranks, whose `more` holds them at the
/// gates the test opens (a kill, a restart) and records what they reached.
pub(crate) fn train_ranks<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    url: &'env str,
    job: &AdmitResponse,
    workers: u16,
    keys: &'env [u64],
    more: &'env (dyn Fn(u16, u32) -> bool + Sync),
) -> Vec<std::thread::ScopedJoinHandle<'scope, (u32, phub_worker::WorkerStats)>> {
    let (id, token) = (job.id, job.token);
    (0..workers)
        .map(|rank| {
            s.spawn(move || {
                train_rank(
                    url,
                    id,
                    token,
                    rank,
                    workers,
                    keys,
                    phub_worker::WorkerConfig::default(),
                    |r| more(rank, r),
                )
            })
        })
        .collect()
}

// The workload every suite shares (small-integer gradients whose sums are
// exact in any order, rank 0's initial values, the expected sums) lives in
// phub-hwtests, which runs the same scenarios on a rack.
pub(crate) use phub_hwtests::workload::{
    expected as expected_sum, flood, grad, init, sum_spec, train, train_rank,
};

/// A process held stopped (SIGSTOP) until this is dropped (SIGCONT), so
/// that a failing test leaves nothing stopped.
pub(crate) struct Stopped(u32);

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill {sig} {pid}");
}

impl Stopped {
    pub(crate) fn new(pid: u32) -> Stopped {
        signal("-STOP", pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

/// A BSP job of two ranks with a dense key and a table `emb` (dim 4, SGD
/// with lr 0.5), sharded over the named appliances with two replicas
/// (PROTOCOL.md §11.9): the table failover tests' job.
pub(crate) fn replicated_table_spec(name: &str, appliances: &[&str]) -> String {
    let names: Vec<String> = appliances.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "name = {name:?}\nworkers = 2\n[optimizer]\nkind = \"sum\"\n\
         [[keys]]\nname = \"w\"\nelements = 64\n\
         [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 4\nrows = 1000\nseed = 3\n\
         optimizer = {{ kind = \"sgd\", lr = 0.5 }}\n\
         [placement]\nappliances = [{}]\nreplicas = 2\n",
        names.join(", ")
    )
}

/// Rank `rank`'s gradient of element `e` of row `id` in round `round` in
/// [`train_table_ranks`]: multiples of 0.25, so that every sum of them is
/// the same bits in any order of arrival.
fn table_grad(rank: u16, round: u32, id: u64, e: usize) -> f32 {
    f32::from(rank + 1) * 0.25 + (round as f32) - (id % 3) as f32 + e as f32 * 0.5
}

/// The rows of [`train_table_ranks`]'s ids after round `t`: SGD with lr
/// 0.5 from zeros over both ranks' gradients.
fn table_rows_after(ids: &[u64], t: u32) -> Vec<f32> {
    ids.iter()
        .flat_map(|&id| {
            (0..4).map(move |e| {
                let mut w = 0f32;
                for r in 1..=t {
                    w -= 0.5 * (table_grad(0, r, id, e) + table_grad(1, r, id, e));
                }
                w
            })
        })
        .collect()
}

/// Starts both ranks of a [`replicated_table_spec`] job in scope `s`, each
/// `push_pull_rows` of the same 60 ids (placed over every entry) in rounds
/// 1 to `rounds`, asking `gates.more(rank, round)` before each (rank 0
/// waits at the gates the test opens), and checking every row of every
/// answer against [`table_rows_after`].
pub(crate) fn train_table_ranks<'scope, 'env>(
    s: &'scope std::thread::Scope<'scope, 'env>,
    url: &'env str,
    job: &AdmitResponse,
    gates: &'env Gates,
    rounds: u32,
) -> Vec<std::thread::ScopedJoinHandle<'scope, ()>> {
    let (id, token) = (job.id, job.token);
    (0..2u16)
        .map(|rank| {
            s.spawn(move || {
                let ids: Vec<u64> = (0..60).map(|i| i * 7 + 3).collect();
                let w = phub_worker::Worker::join(url, id, token, rank).unwrap();
                for round in 1..=rounds {
                    gates.more(rank, round);
                    let grads: Vec<f32> = ids
                        .iter()
                        .flat_map(|&i| (0..4).map(move |e| table_grad(rank, round, i, e)))
                        .collect();
                    let mut out = vec![0f32; ids.len() * 4];
                    let r = w
                        .push_pull_rows("emb", &ids, &grads, &mut out)
                        .unwrap_or_else(|e| panic!("rank {rank} round {round}: {e}"));
                    assert_eq!(r, round, "rank {rank}");
                    assert!(
                        out == table_rows_after(&ids, round),
                        "rank {rank} round {round}: rows not exact"
                    );
                }
            })
        })
        .collect()
}
