//! `phub-demo`: the main job, out of the box.
//!
//! Starts phub-dataplane and phub-control as separate processes, admits a
//! job, and trains a real small model (an MLP on a generated, seeded
//! classification set) with W worker processes that push gradients and
//! receive new parameters from the appliance's server-side SGD. Shows a
//! progress bar, the loss and accuracy per epoch and the exchange
//! throughput, checks the result against one process averaging the same W
//! gradients, then shuts everything down.
//!
//! The backend (`--backend auto|dpdk|udp`): as root, with a phub-dataplane
//! built with DPDK, the dataplane runs on DPDK's af_packet driver over a
//! veth pair in a private network namespace (the virtual rack's network,
//! [`phub_hwtests::virt`]), with phub-control and the workers inside the
//! namespace too; the namespace goes at the end, on failure and on Ctrl-C.
//! Otherwise the dataplane runs on kernel UDP on loopback. The demo says
//! which, and why, on one line.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use phub_hwtests::process;
use phub_hwtests::virt::{self, Netns};
use phub_proto::api::{AdmitResponse, ApiError, Stats};
use phub_worker::Worker;
use serde::{Deserialize, Serialize};

use crate::model::{batch_indices, reference_sgd, steps_per_epoch, Dataset, Mlp};

/// phub-demo: train a small model through a local phub appliance.
#[derive(Debug, Parser)]
#[command(name = "phub-demo", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// One worker process (started by the demo itself).
    Worker(WorkerArgs),
}

/// The model and training set-up, shared by the demo and its workers.
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct TrainArgs {
    /// Input features.
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    /// Hidden units.
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Classes.
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Samples in the generated data set.
    #[arg(long, default_value_t = 16384)]
    pub samples: usize,
    /// Samples per worker per step.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Learning rate of the appliance's SGD.
    #[arg(long, default_value_t = 0.1)]
    pub lr: f32,
    /// Epochs.
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    /// Seed of the data and the initial parameters.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

impl TrainArgs {
    /// The model's shape.
    pub fn mlp(&self) -> Mlp {
        Mlp {
            dim: self.dim,
            hidden: self.hidden,
            classes: self.classes,
        }
    }

    /// The data set every worker generates identically.
    pub fn data(&self) -> Dataset {
        Dataset::generate(self.seed, self.samples, self.dim, self.classes)
    }

    /// The job spec for `workers` workers.
    pub fn spec_toml(&self, workers: usize) -> String {
        let mlp = self.mlp();
        let mut s = format!(
            "name = \"demo-mlp\"\nworkers = {workers}\ndtype = \"f32\"\nchunk_bytes = 8192\n\n\
             [optimizer]\nkind = \"sgd\"\nlr = {}\n",
            self.lr
        );
        for (name, n) in mlp.names().iter().zip(mlp.sizes()) {
            s += &format!("\n[[keys]]\nname = \"{name}\"\nelements = {n}\n");
        }
        s
    }
}

/// Which packet I/O the demo's dataplane uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendChoice {
    /// DPDK where it can run (root, a DPDK build, a namespace and a veth
    /// pair could be made), else kernel UDP on loopback.
    Auto,
    /// DPDK's af_packet driver on a veth pair in a private network
    /// namespace (needs root).
    Dpdk,
    /// Kernel UDP sockets on loopback (runs anywhere).
    Udp,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Packet I/O of the dataplane: auto (DPDK when possible), dpdk or udp.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Queues (lcore threads) of the dataplane.
    #[arg(long, default_value_t = 2)]
    lcores: usize,
    /// Where phub-control and phub-dataplane are (default: beside this program).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Debug, Args)]
struct WorkerArgs {
    #[arg(long)]
    control: String,
    #[arg(long)]
    job: u16,
    /// Token, hex.
    #[arg(long)]
    token: String,
    #[arg(long)]
    rank: u16,
    /// Where rank 0 writes its final parameters.
    #[arg(long)]
    params_out: Option<PathBuf>,
    #[command(flatten)]
    train: TrainArgs,
}

/// One line a worker prints on stdout for the demo to show.
#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    /// Rank.
    pub rank: u16,
    /// Steps done.
    pub step: usize,
    /// Epoch just finished, when this report closes one.
    pub epoch: Option<usize>,
    /// Loss over the whole data set (rank 0, at epoch ends).
    pub loss: Option<f32>,
    /// Accuracy over the whole data set (rank 0, at epoch ends).
    pub accuracy: Option<f32>,
    /// Seconds spent in push_pull/wait so far.
    pub exchange_secs: f64,
    /// UDP payload bytes sent plus received so far.
    pub exchange_bytes: u64,
    /// Retransmissions so far.
    pub retransmits: u64,
    /// Whether training is over.
    pub done: bool,
}

/// Trains as one worker of the job; `report` gets a line per step.
pub fn train_worker(w: &Worker, t: &TrainArgs, mut report: impl FnMut(Report)) -> Result<Vec<Vec<f32>>> {
    let mlp = t.mlp();
    let data = t.data();
    let workers = w.workers() as usize;
    let rank = w.rank();
    let mut params = mlp.init(t.seed);
    {
        let handles = params
            .iter_mut()
            .enumerate()
            .map(|(k, p)| w.init(k as u32, p))
            .collect::<Result<Vec<_>, _>>()?;
        for h in handles {
            w.wait(h)?;
        }
    }
    let per_epoch = steps_per_epoch(data.len(), workers, t.batch);
    let mut exchange = Duration::ZERO;
    for step in 0..t.epochs * per_epoch {
        let idx = batch_indices(data.len(), usize::from(rank), workers, t.batch, step);
        let (_, grads) = mlp.grad(&params, &data, &idx);
        let start = Instant::now();
        let handles = params
            .iter_mut()
            .zip(&grads)
            .enumerate()
            .map(|(k, (p, g))| w.push_pull(k as u32, g, p))
            .collect::<Result<Vec<_>, _>>()?;
        for h in handles {
            w.wait(h)?;
        }
        exchange += start.elapsed();
        let end_of_epoch = (step + 1) % per_epoch == 0;
        let (loss, accuracy) = if end_of_epoch && rank == 0 {
            let (l, a) = mlp.evaluate(&params, &data);
            (Some(l), Some(a))
        } else {
            (None, None)
        };
        let s = w.stats();
        report(Report {
            rank,
            step: step + 1,
            epoch: end_of_epoch.then_some((step + 1) / per_epoch),
            loss,
            accuracy,
            exchange_secs: exchange.as_secs_f64(),
            exchange_bytes: s.bytes_sent + s.bytes_received,
            retransmits: s.retransmits,
            done: step + 1 == t.epochs * per_epoch,
        });
    }
    Ok(params)
}

fn worker_main(a: WorkerArgs) -> Result<()> {
    let token = u64::from_str_radix(a.token.trim_start_matches("0x"), 16)
        .map_err(|_| anyhow!("--token {:?}: expected hex digits", a.token))?;
    let w = Worker::join(&a.control, a.job, token, a.rank)?;
    let rank0 = a.rank == 0;
    let params = train_worker(&w, &a.train, |r| {
        if rank0 {
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
        }
    })?;
    if let Some(path) = a.params_out {
        let flat: Vec<u8> = params.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, flat).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// What Ctrl-C (SIGINT) or SIGTERM reaches: the processes the demo started,
/// which it stops so that the run unwinds through its normal clean-up
/// (daemons stopped, namespace removed).
struct Interrupt {
    flag: AtomicBool,
    pids: Mutex<Vec<u32>>,
}

static INTERRUPT: Interrupt = Interrupt {
    flag: AtomicBool::new(false),
    pids: Mutex::new(Vec::new()),
};

impl Interrupt {
    /// Installs the handler (once per process).
    fn install() -> Result<()> {
        ctrlc::set_handler(|| {
            if !INTERRUPT.flag.swap(true, Ordering::SeqCst) {
                eprintln!("phub-demo: interrupted; stopping the processes and cleaning up");
            }
            for &pid in INTERRUPT.pids.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                // SAFETY: kill(2) on a child this process started and has
                // not reaped yet (pids leave the list before they are
                // waited for); no memory is involved.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            }
        })
        .context("installing the Ctrl-C handler")
    }

    fn interrupted() -> bool {
        INTERRUPT.flag.load(Ordering::SeqCst)
    }

    fn track(pid: u32) {
        INTERRUPT.pids.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
    }

    fn untrack(pid: u32) {
        INTERRUPT
            .pids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&p| p != pid);
    }
}

/// A daemon the Ctrl-C handler knows about (it forwards SIGTERM to it),
/// stopped with SIGTERM (then SIGKILL) when dropped.
struct Tracked(process::Daemon);

impl Tracked {
    fn new(d: process::Daemon) -> Tracked {
        Interrupt::track(d.pid());
        Tracked(d)
    }

    fn stop(&mut self) {
        Interrupt::untrack(self.0.pid());
        // Ask politely first: both daemons shut down cleanly on SIGTERM.
        if !self.0.stop(Duration::from_secs(5)) {
            eprintln!("phub-demo: {} did not stop on SIGTERM; killed it", self.0.name());
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether `bin` (phub-dataplane) holds DPDK's EAL: a build with the
/// `dpdk` feature links it (dynamically, as Debian's DPDK is, or
/// statically) and names `rte_eal_init`; a build without it has no DPDK
/// symbol at all.
fn built_with_dpdk(bin: &Path) -> Result<bool> {
    let bytes = std::fs::read(bin).with_context(|| format!("reading {}", bin.display()))?;
    let needle = b"rte_eal_init";
    Ok(bytes.windows(needle.len()).any(|w| w == needle))
}

/// The packet I/O the demo runs on, and where.
enum Net {
    /// Kernel UDP on loopback.
    Loopback,
    /// DPDK (net_af_packet) on the appliance's end of a veth pair inside
    /// this namespace; the demo's processes run there too.
    Veth(Netns),
}

/// Picks the backend as `--backend` asks, and says why on one line. With
/// `auto`, anything that rules DPDK out falls back to kernel UDP; with
/// `dpdk`, it is an error.
fn choose_backend(choice: BackendChoice, dataplane_bin: &Path) -> Result<Net> {
    if choice == BackendChoice::Udp {
        println!("backend: kernel UDP on loopback (--backend udp)");
        return Ok(Net::Loopback);
    }
    let ruled_out = (|| -> Result<Option<String>> {
        // SAFETY: geteuid(2) has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            return Ok(Some(
                "not root (DPDK needs root for the namespace and the veth pair)".into(),
            ));
        }
        if let Some(why) = virt::unavailable() {
            return Ok(Some(why));
        }
        if !built_with_dpdk(dataplane_bin)? {
            return Ok(Some(format!(
                "{} was built without DPDK (phub-dataplane's `dpdk` feature)",
                dataplane_bin.display()
            )));
        }
        Ok(None)
    })()?;
    let made = match ruled_out {
        None => Netns::create("demo")
            .and_then(|ns| virt::veth_link(&ns).map(|()| ns))
            .map_err(|e| format!("could not make the namespace and the veth pair: {e}")),
        Some(why) => Err(why),
    };
    match (made, choice) {
        (Ok(ns), _) => {
            println!(
                "backend: DPDK (net_af_packet over a veth pair in namespace {}; workers use kernel UDP on the \
                 other end)",
                ns.name
            );
            Ok(Net::Veth(ns))
        }
        (Err(why), BackendChoice::Dpdk) => bail!("--backend dpdk: {why}"),
        (Err(why), _) => {
            println!("backend: kernel UDP on loopback: {why}");
            Ok(Net::Loopback)
        }
    }
}

/// Runs `f` on a thread inside `ns`: the processes it starts and the
/// addresses it reaches are the namespace's.
fn inside<T: Send>(ns: &Netns, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            ns.try_enter().map_err(|e| anyhow!("{e}"))?;
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// The dataplane and control of one run, and where to reach them.
struct Appliance {
    // Field order is drop order: control stops before the dataplane.
    control: Tracked,
    dataplane: Tracked,
    control_url: String,
    dir: PathBuf,
    backend: &'static str,
}

/// Starts phub-dataplane on `net` and phub-control, each logging into `dir`.
/// `Err` from the dataplane's start is the first element: the caller may
/// fall back to the other backend.
fn start_appliance(
    a: &RunArgs,
    net: &Net,
    dataplane_bin: &Path,
    control_bin: &Path,
    dir: &Path,
) -> Result<Appliance, (bool, anyhow::Error)> {
    let dataplane_failed = |e: anyhow::Error| (true, e);
    let other = |e: anyhow::Error| (false, e);
    let port = || process::free_port().map_err(|e| other(e.into()));
    let (mgmt, ctl) = (port()?, port()?);
    let mgmt_url = format!("http://127.0.0.1:{mgmt}");
    let control_url = format!("http://127.0.0.1:{ctl}");
    let mut args: Vec<String> = vec![
        "--lcores".into(),
        a.lcores.to_string(),
        "--mgmt".into(),
        format!("127.0.0.1:{mgmt}"),
        "--memory-budget".into(),
        "256MiB".into(),
    ];
    let (backend, what, limit) = match net {
        Net::Loopback => {
            args.extend(["--backend".into(), "udp".into(), "--base-port".into(), "0".into()]);
            ("udp", "kernel UDP queues on loopback", Duration::from_secs(15))
        }
        Net::Veth(ns) => {
            args.extend(
                [
                    "--backend",
                    "dpdk",
                    "--host",
                    virt::APPLIANCE_IP,
                    "--base-port",
                    "7900",
                    "--no-pin",
                    "--idle-backoff",
                ]
                .map(String::from),
            );
            args.extend(["--eal".into(), virt::af_packet_eal(a.lcores, &ns.name)]);
            // The EAL and the af_packet port take a few seconds.
            (
                "dpdk",
                "DPDK queues (net_af_packet on dpv1, idle backoff on)",
                Duration::from_secs(45),
            )
        }
    };
    let dp_log = dir.join("phub-dataplane.log");
    let mut dataplane = Tracked::new(
        process::Daemon::spawn("phub-dataplane", dataplane_bin, &args, &[], &dp_log)
            .map_err(|e| dataplane_failed(e.into()))?,
    );
    dataplane
        .0
        .wait_up(&format!("{mgmt_url}/v1/info"), limit, Interrupt::interrupted)
        .map_err(|e| dataplane_failed(anyhow!(e)))?;
    println!(
        "  phub-dataplane up: {} {what}, management API {mgmt_url}",
        a.lcores
    );
    let ctl_log = dir.join("phub-control.log");
    let ctl_args = [
        "--listen".into(),
        format!("127.0.0.1:{ctl}"),
        "--dataplane".into(),
        mgmt_url.clone(),
        "--state".into(),
        dir.join("control-state.json").display().to_string(),
    ];
    let mut control = Tracked::new(
        process::Daemon::spawn("phub-control", control_bin, &ctl_args, &[], &ctl_log)
            .map_err(|e| other(e.into()))?,
    );
    control
        .0
        .wait_up(
            &format!("{control_url}/v1/jobs"),
            Duration::from_secs(15),
            Interrupt::interrupted,
        )
        .map_err(|e| other(anyhow!(e)))?;
    println!("  phub-control up: {control_url}");
    Ok(Appliance {
        control,
        dataplane,
        control_url,
        dir: dir.to_path_buf(),
        backend,
    })
}

fn run_main(a: RunArgs) -> Result<()> {
    let bin_dir = match &a.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("this program has no directory")?
            .to_path_buf(),
    };
    let bin = |name: &str| -> Result<PathBuf> {
        let p = bin_dir.join(name);
        if p.exists() {
            Ok(p)
        } else {
            bail!(
                "{} not found: build it with `cargo build --release --bins`",
                p.display()
            )
        }
    };
    let (dataplane_bin, control_bin) = (bin("phub-dataplane")?, bin("phub-control")?);
    if a.workers == 0 || a.workers > 64 {
        bail!("--workers {}: the demo runs 1 to 64 worker processes", a.workers);
    }
    if a.lcores == 0 || a.lcores > 16 {
        bail!("--lcores {}: the demo runs 1 to 16 dataplane queues", a.lcores);
    }
    Interrupt::install()?;
    let t = &a.train;
    let mlp = t.mlp();
    let params: usize = mlp.sizes().iter().sum();
    println!(
        "phub demo: an MLP ({} -> {} -> {}, {} parameters in 4 tensors) on {} generated samples, \
         {} worker processes, SGD on the appliance (lr {}), {} epochs",
        t.dim, t.hidden, t.classes, params, t.samples, a.workers, t.lr, t.epochs
    );
    let net = choose_backend(a.backend, &dataplane_bin)?;
    let dir = std::env::temp_dir().join(format!("phub-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!("  logs and state in {}", dir.display());
    let start = |net: &Net| start_appliance(&a, net, &dataplane_bin, &control_bin, &dir);
    let r = match &net {
        Net::Loopback => match start(&net) {
            Ok(app) => train(&a, app),
            Err((_, e)) => Err(e),
        },
        Net::Veth(ns) => {
            let on_dpdk = inside(ns, || match start(&net) {
                Ok(app) => Ok(Some(train(&a, app))),
                Err((true, e)) if a.backend == BackendChoice::Auto && !Interrupt::interrupted() => {
                    println!("backend: kernel UDP on loopback: the DPDK dataplane did not come up: {e:#}");
                    Ok(None)
                }
                Err((_, e)) => Err(e),
            });
            match on_dpdk {
                Ok(Some(r)) => r,
                Ok(None) => match start(&Net::Loopback) {
                    Ok(app) => train(&a, app),
                    Err((_, e)) => Err(e),
                },
                Err(e) => Err(e),
            }
        }
    };
    if let Net::Veth(ns) = &net {
        // Dropping it removes the namespace (and the veth pair with it).
        println!("  namespace {} removed", ns.name);
    }
    drop(net);
    if r.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("phub-demo: logs kept in {}", dir.display());
    }
    r
}

/// Admits the job on `app`, trains with the worker processes, checks the
/// result against one process and stops the appliance.
fn train(a: &RunArgs, mut app: Appliance) -> Result<()> {
    let t = &a.train;
    let mlp = t.mlp();
    let control_url = app.control_url.clone();
    let dir = app.dir.clone();
    // phub-control wrote its operator token beside its state file.
    let token_file = dir.join("control-state.json.operator-token");
    let operator = std::fs::read_to_string(&token_file)
        .with_context(|| format!("reading the operator token {}", token_file.display()))?;
    let operator = format!("Bearer {}", operator.trim());
    let admit: AdmitResponse = match ureq::post(&format!("{control_url}/v1/jobs"))
        .set("Authorization", &operator)
        .send_string(&t.spec_toml(a.workers))
    {
        Ok(r) => r.into_json()?,
        Err(ureq::Error::Status(code, r)) => {
            let body = r.into_string().unwrap_or_default();
            bail!("admission refused (HTTP {code}): {}", ApiError::message_of(&body));
        }
        Err(e) => bail!("admission: {e}"),
    };
    println!(
        "  job {} admitted: {} chunks over lcores {:?}, {} KiB of slot memory",
        admit.id,
        admit.chunks,
        admit.lcores,
        admit.memory_bytes / 1024
    );

    let me = std::env::current_exe()?;
    let params_out = dir.join("params-rank0.bin");
    let mut children = Vec::new();
    for rank in 0..a.workers {
        let mut args = vec![
            "worker".to_string(),
            "--control".into(),
            control_url.clone(),
            "--job".into(),
            admit.id.to_string(),
            "--token".into(),
            format!("{:016x}", admit.token),
            "--rank".into(),
            rank.to_string(),
        ];
        if rank == 0 {
            args.extend(["--params-out".into(), params_out.display().to_string()]);
        }
        for (k, v) in [
            ("dim", t.dim.to_string()),
            ("hidden", t.hidden.to_string()),
            ("classes", t.classes.to_string()),
            ("samples", t.samples.to_string()),
            ("batch", t.batch.to_string()),
            ("lr", t.lr.to_string()),
            ("epochs", t.epochs.to_string()),
            ("seed", t.seed.to_string()),
        ] {
            args.push(format!("--{k}"));
            args.push(v);
        }
        let child = Command::new(&me)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting a worker process")?;
        Interrupt::track(child.id());
        children.push(child);
    }
    let total = (t.epochs * steps_per_epoch(t.samples, a.workers, t.batch)) as u64;
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("  [{bar:40}] step {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let started = Instant::now();
    let mut last: Option<Report> = None;
    let mut first_loss = None;
    let mut last_loss = None;
    // Every worker's stdout is drained as it is written: a pipe nobody reads
    // fills up (64 KiB) and blocks its writer, and with it the whole job.
    let drains: Vec<_> = children[1..]
        .iter_mut()
        .filter_map(|c| c.stdout.take())
        .map(|out| std::thread::spawn(move || for _ in BufReader::new(out).lines() {}))
        .collect();
    let stdout = children[0].stdout.take().context("worker 0 has no stdout")?;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let Ok(r) = serde_json::from_str::<Report>(&line) else {
            println!("{line}");
            continue;
        };
        bar.set_position(r.step as u64);
        let gbps = r.exchange_bytes as f64 / r.exchange_secs.max(1e-9) / 1e9;
        bar.set_message(format!("exchange {:.3} GB/s per worker", gbps));
        if let (Some(e), Some(l), Some(acc)) = (r.epoch, r.loss, r.accuracy) {
            first_loss.get_or_insert(l);
            last_loss = Some(l);
            let line = format!(
                "  epoch {e}: loss {l:.4}, accuracy {:.1}%, exchange {:.3} GB/s per worker, {} retransmits",
                acc * 100.0,
                gbps,
                r.retransmits
            );
            if bar.is_hidden() {
                println!("{line}");
            } else {
                bar.println(line);
            }
        }
        last = Some(r);
    }
    bar.finish_and_clear();
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait();
        Interrupt::untrack(c.id());
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("worker {rank} exited with {s}")),
            Err(e) => failed.push(format!("worker {rank}: {e}")),
        }
    }
    for d in drains {
        let _ = d.join();
    }
    if Interrupt::interrupted() {
        bail!("interrupted");
    }
    if !failed.is_empty() {
        bail!("{}", failed.join("; "));
    }
    let last = last.context("worker 0 reported nothing")?;
    let wall = started.elapsed().as_secs_f64();
    if let (Some(first), Some(final_loss)) = (first_loss, last_loss) {
        let (start_loss, start_acc) = mlp.evaluate(&mlp.init(t.seed), &t.data());
        println!(
            "  loss {start_loss:.4} (accuracy {:.1}%) before training, {first:.4} after epoch 1, {final_loss:.4} at the end",
            start_acc * 100.0
        );
    }
    println!(
        "  trained {} steps in {wall:.1} s; rank 0 spent {:.2} s exchanging {:.1} MB ({:.3} GB/s)",
        last.step,
        last.exchange_secs,
        last.exchange_bytes as f64 / 1e6,
        last.exchange_bytes as f64 / last.exchange_secs.max(1e-9) / 1e9
    );

    // Check: one process averaging the same W gradients ends where we did.
    let got = std::fs::read(&params_out).context("reading rank 0's parameters")?;
    let got: Vec<f32> = got
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let reference = reference_sgd(&mlp, &t.data(), t.seed, a.workers, t.batch, t.lr, last.step);
    let (ref_loss, _) = mlp.evaluate(&reference, &t.data());
    let want: Vec<f32> = reference.into_iter().flatten().collect();
    let max_diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = want.iter().map(|w| w.abs()).fold(0f32, f32::max).max(1e-6);
    println!(
        "  single-process SGD averaging the same {} gradients: loss {ref_loss:.4}; parameters differ by \
         at most {max_diff:.2e} (largest parameter {scale:.2}): the appliance adds in arrival order",
        a.workers
    );
    if let Ok(r) = ureq::get(&format!("{control_url}/v1/stats")).call() {
        if let Ok(s) = r.into_json::<Stats>() {
            if let Some(d) = s.dataplane {
                let t = d.total();
                let (rx, tx, resent) = (t.rx_packets, t.tx_packets, t.results_resent);
                let drops: u64 = t.drops.values().sum();
                let mut reasons: Vec<_> = t.drops.iter().filter(|&(_, &n)| n > 0).collect();
                reasons.sort_by_key(|&(_, &n)| std::cmp::Reverse(n));
                let reasons: Vec<String> = reasons.iter().map(|(r, n)| format!("{r} {n}")).collect();
                println!(
                    "  appliance ({}): {rx} packets in, {tx} out, {resent} results resent, {drops} dropped{}",
                    app.backend,
                    if reasons.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", reasons.join(", "))
                    }
                );
            }
        }
    }
    let _ = ureq::delete(&format!("{control_url}/v1/jobs/{}", admit.id))
        .set("Authorization", &operator)
        .call();
    app.control.stop();
    app.dataplane.stop();
    println!("  job evicted, phub-control and phub-dataplane stopped");
    if got.len() != want.len() || max_diff > 1e-2 * scale {
        bail!("the appliance's parameters differ from the single-process reference by {max_diff}");
    }
    println!(
        "  result check passed on the {} backend",
        if app.backend == "dpdk" {
            "DPDK"
        } else {
            "kernel UDP"
        }
    );
    Ok(())
}

/// `phub-demo`'s entry point.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Some(Cmd::Worker(w)) => worker_main(w),
        None => run_main(cli.run),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("phub-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}
