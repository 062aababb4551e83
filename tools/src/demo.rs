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
//! `--consistency async` or `--consistency ssp:TAU` admits the job async or
//! with bounded delay TAU (PROTOCOL.md §5.8; default BSP): the appliance's
//! SGD then steps on each push alone, with the learning rate divided by W
//! so that W pushes move the parameters as far as one BSP round, and the
//! check against one process (which averages in lock step) is skipped.
//! `--compute-ms`, `--jitter`, `--spike` and `--slow-rank0` add emulated
//! compute before each step (stragglers); `--eval-every N` has rank 0 keep
//! its parameters every N steps and evaluate them after training (off the
//! clock), `--target-loss` reports when the loss first reached it, and
//! `--summary PATH` writes the run's figures as JSON (BENCHMARKS.md,
//! "Convergence per consistency mode").
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
use phub_hwtests::dataplane_args::{Backend, DataplaneArgs};
use phub_hwtests::process;
use phub_hwtests::virt::{self, Netns};
use phub_proto::api::{AdmitResponse, JobDetail};
use phub_proto::routes::control;
use phub_proto::spec::Consistency;
use phub_worker::Worker;
use serde::{Deserialize, Serialize};

use crate::bench::emulate::{parse_exp_jitter, Compute, Spike};
use crate::bench::local;
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
    /// Trains the demo's job once per mode and run (runs outermost, so
    /// that a slow minute of the host touches every mode alike) and
    /// prints, per mode, the steps and seconds to `--target-loss`, the
    /// final loss and the waiting, with their median and range; writes
    /// each run's `--summary` into `--out` and, with `--plot`, an SVG.
    Converge(ConvergeArgs),
}

/// `phub-demo converge`.
#[derive(Debug, Args)]
struct ConvergeArgs {
    /// The modes, comma separated (bsp, async, ssp:TAU).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bsp,async,ssp:0,ssp:1,ssp:2,ssp:4,ssp:8,ssp:16"
    )]
    modes: Vec<Consistency>,
    /// Runs of each mode.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Directory for each run's summary (MODE-runN.json) and all of them
    /// (converge.json).
    #[arg(long)]
    out: PathBuf,
    /// Write the figure here (.svg, or .png rendered from it).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Train nothing: read `--out`'s converge.json of an earlier run and
    /// print its table and figure again.
    #[arg(long)]
    replot: bool,
    #[command(flatten)]
    run: RunArgs,
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
    /// The job's consistency: bsp, async or ssp:TAU (bounded delay TAU).
    #[arg(long, default_value = "bsp")]
    pub consistency: Consistency,
    /// Emulated compute before each step's exchange, ms per worker.
    #[arg(long, default_value_t = 0.0)]
    pub compute_ms: f64,
    /// Random jitter added to each step's compute: `exp:M` (exponential,
    /// mean M ms, seeded per rank).
    #[arg(long, value_name = "exp:M", value_parser = parse_exp_jitter)]
    pub jitter: Option<f64>,
    /// Occasional slow steps: `p=P,x=X`, with probability P a step's
    /// compute takes X times as long.
    #[arg(long, value_name = "p=P,x=X")]
    pub spike: Option<Spike>,
    /// Rank 0's compute is multiplied by this (a persistent straggler).
    #[arg(long, default_value_t = 1.0)]
    pub slow_rank0: f64,
    /// Rank 0 keeps its parameters every N steps (and at each epoch's
    /// end) and evaluates them after training, off the clock (0: it
    /// evaluates at each epoch's end, on the clock).
    #[arg(long, default_value_t = 0)]
    pub eval_every: usize,
    /// Seed of the emulated compute's draws (mixed with the rank's);
    /// `converge` gives each run its own.
    #[arg(long, default_value_t = 0)]
    pub compute_seed: u64,
}

impl Default for TrainArgs {
    /// The command line's defaults.
    fn default() -> TrainArgs {
        TrainArgs {
            dim: 64,
            hidden: 256,
            classes: 10,
            samples: 16384,
            batch: 32,
            lr: 0.1,
            epochs: 4,
            seed: 42,
            consistency: Consistency::Sync,
            compute_ms: 0.0,
            jitter: None,
            spike: None,
            slow_rank0: 1.0,
            eval_every: 0,
            compute_seed: 0,
        }
    }
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

    /// The appliance's learning rate: `lr` in BSP (where SGD steps on the
    /// mean of the W gradients), `lr / W` in the other modes (where it
    /// steps on each push alone), so that W pushes move the parameters as
    /// far as one BSP round.
    pub fn appliance_lr(&self, workers: usize) -> f32 {
        match self.consistency {
            Consistency::Sync => self.lr,
            _ => self.lr / workers as f32,
        }
    }

    /// The job spec for `workers` workers.
    pub fn spec_toml(&self, workers: usize) -> String {
        let mlp = self.mlp();
        let consistency = match self.consistency {
            Consistency::Sync => String::new(),
            Consistency::Async => "consistency = { mode = \"async\" }\n".into(),
            Consistency::Bounded { delay } => format!("consistency = {{ bounded_delay = {delay} }}\n"),
        };
        let mut s = format!(
            "name = \"demo-mlp\"\nworkers = {workers}\ndtype = \"f32\"\nchunk_bytes = 8192\n{consistency}\n\
             [optimizer]\nkind = \"sgd\"\nlr = {}\n",
            self.appliance_lr(workers)
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

#[derive(Debug, Clone, Args)]
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
    /// Report the first kept step whose loss is at most this (with
    /// `--eval-every`).
    #[arg(long)]
    target_loss: Option<f32>,
    /// Write the run's figures (mode, steps, times, loss curve, time to
    /// the target) to this file as JSON.
    #[arg(long)]
    summary: Option<PathBuf>,
    #[command(flatten)]
    train: TrainArgs,
}

/// `--summary`: one run's figures.
#[derive(Debug, Serialize, Deserialize)]
pub struct Summary {
    /// `bsp`, `async` or `ssp:TAU`.
    pub consistency: String,
    /// Worker processes.
    pub workers: usize,
    /// The appliance's learning rate (per push outside BSP).
    pub lr: f32,
    /// Emulated compute per step, ms, and its exponential jitter's mean.
    pub compute_ms: f64,
    /// Mean of the exponential jitter, ms.
    pub jitter_exp_ms: f64,
    /// `--spike`, if any.
    pub spike: Option<Spike>,
    /// Steps per rank.
    pub steps: usize,
    /// Seconds from the workers' start to the last one's exit.
    pub wall_s: f64,
    /// Rank 0's seconds from round 0 to its last step.
    pub train_s: f64,
    /// Rank 0's seconds in push_pull/wait.
    pub exchange_s: f64,
    /// Rank 0's kept steps, evaluated.
    pub curve: Vec<CurvePoint>,
    /// `--target-loss`.
    pub target_loss: Option<f32>,
    /// The first kept step at or below the target, and its time.
    pub steps_to_target: Option<usize>,
    /// Rank 0's seconds from round 0 to that step.
    pub secs_to_target: Option<f64>,
    /// Loss and accuracy of rank 0's last parameters.
    pub final_loss: Option<f32>,
    /// Accuracy of rank 0's last parameters.
    pub final_accuracy: Option<f32>,
    /// Control's view at the end (`phubctl job show`): the largest lead
    /// and the held answers.
    pub clock: Option<phub_proto::api::ClockStats>,
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
    /// With `--eval-every`, in the last report: rank 0's parameters
    /// evaluated at every kept step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<CurvePoint>,
}

/// Rank 0's parameters after a step, evaluated on the whole data set.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Rank 0's steps done (its clock).
    pub step: usize,
    /// Seconds from the end of round 0 to the end of that step, on rank 0.
    pub secs: f64,
    /// Loss over the data set.
    pub loss: f32,
    /// Accuracy over the data set.
    pub accuracy: f32,
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
    let compute = Compute {
        ms: t.compute_ms,
        jitter_exp_ms: t.jitter.unwrap_or(0.0),
        spike: t.spike,
        factor: if rank == 0 { t.slow_rank0 } else { 1.0 },
    };
    let mut rng = Compute::seed(rank) ^ t.compute_seed.wrapping_mul(0xd1b5_4a32_d192_ed03);
    if rng == 0 {
        rng = 1;
    }
    let deferred = t.eval_every > 0 && rank == 0;
    let trained = Instant::now();
    // Deferred evaluation: (step, seconds, parameters) kept on the way.
    let mut kept: Vec<(usize, f64, Vec<Vec<f32>>)> = Vec::new();
    if deferred {
        kept.push((0, 0.0, params.clone()));
    }
    for step in 0..t.epochs * per_epoch {
        let idx = batch_indices(data.len(), usize::from(rank), workers, t.batch, step);
        let (_, grads) = mlp.grad(&params, &data, &idx);
        let pause = compute.draw(&mut rng);
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
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
        if deferred && ((step + 1) % t.eval_every == 0 || end_of_epoch) {
            kept.push((step + 1, trained.elapsed().as_secs_f64(), params.clone()));
        }
        let (loss, accuracy) = if end_of_epoch && rank == 0 && !deferred {
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
            done: false,
            curve: Vec::new(),
        });
    }
    let s = w.stats();
    report(Report {
        rank,
        step: t.epochs * per_epoch,
        epoch: None,
        loss: None,
        accuracy: None,
        exchange_secs: exchange.as_secs_f64(),
        exchange_bytes: s.bytes_sent + s.bytes_received,
        retransmits: s.retransmits,
        done: true,
        curve: kept
            .iter()
            .map(|(step, secs, p)| {
                let (loss, accuracy) = mlp.evaluate(p, &data);
                CurvePoint {
                    step: *step,
                    secs: *secs,
                    loss,
                    accuracy,
                }
            })
            .collect(),
    });
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
    /// Installs the handler (the first call; later ones do nothing).
    fn install() -> Result<()> {
        static INSTALLED: AtomicBool = AtomicBool::new(false);
        if INSTALLED.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
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
    let mut args = DataplaneArgs {
        lcores: Some(a.lcores),
        mgmt: Some(format!("127.0.0.1:{mgmt}")),
        memory_budget: Some("256MiB".into()),
        ..DataplaneArgs::default()
    };
    let (backend, what, limit) = match net {
        Net::Loopback => {
            args.backend = Some(Backend::Udp);
            args.base_port = Some(0);
            ("udp", "kernel UDP queues on loopback", Duration::from_secs(15))
        }
        Net::Veth(ns) => {
            args.backend = Some(Backend::Dpdk);
            args.host = Some(virt::APPLIANCE_IP.into());
            args.base_port = Some(virt::BASE_PORT);
            args.no_pin = true;
            args.idle_backoff = true;
            args.eal = Some(virt::af_packet_eal(a.lcores, &ns.name, 0));
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
        process::Daemon::spawn("phub-dataplane", dataplane_bin, &args.to_args(), &[], &dp_log)
            .map_err(|e| dataplane_failed(e.into()))?,
    );
    dataplane
        .0
        .wait_up(
            &process::dataplane_ready(&mgmt_url),
            limit,
            Interrupt::interrupted,
        )
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
            &process::control_ready(&control_url),
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
    println!(
        "  consistency: {}",
        describe(t.consistency, t.appliance_lr(a.workers))
    );
    if t.compute_ms > 0.0 || t.jitter.is_some() || t.spike.is_some() {
        println!(
            "  emulated compute per step: {} ms{}{}{}",
            t.compute_ms,
            t.jitter.map_or(String::new(), |m| format!(" + exp({m} ms)")),
            t.spike.map_or(String::new(), |s| format!(", spike {s}")),
            if t.slow_rank0 == 1.0 {
                String::new()
            } else {
                format!(", rank 0 x{}", t.slow_rank0)
            }
        );
    }
    let net = choose_backend(a.backend, &dataplane_bin)?;
    // One directory per run (`converge` runs many in one process).
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(match n {
        0 => format!("phub-demo-{}", std::process::id()),
        n => format!("phub-demo-{}-{n}", std::process::id()),
    });
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

/// The mode as the demo prints it, with the appliance's learning rate.
fn describe(c: Consistency, lr: f32) -> String {
    match c {
        Consistency::Sync => format!("bsp (every step waits for all ranks; SGD on the mean gradient, lr {lr})"),
        Consistency::Async => {
            format!("async (each push applied and answered at once; SGD per push, lr {lr:.4} = lr / W)")
        }
        Consistency::Bounded { delay } => format!(
            "ssp:{delay}, bounded delay τ = {delay} (no rank more than {} steps ahead; SGD per push, lr {lr:.4} = lr / W)",
            u64::from(delay) + 1
        ),
    }
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
    let operator = operator.trim().to_string();
    let admit: AdmitResponse = local::admit(&control_url, &t.spec_toml(a.workers), Some(&operator))?;
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
            ("consistency", t.consistency.to_string()),
            ("compute-ms", t.compute_ms.to_string()),
            ("slow-rank0", t.slow_rank0.to_string()),
            ("eval-every", t.eval_every.to_string()),
            ("compute-seed", t.compute_seed.to_string()),
        ] {
            args.push(format!("--{k}"));
            args.push(v);
        }
        if let Some(m) = t.jitter {
            args.extend(["--jitter".into(), format!("exp:{m}")]);
        }
        if let Some(s) = t.spike {
            args.extend(["--spike".into(), s.to_string()]);
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
    let mut curve: Vec<CurvePoint> = Vec::new();
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
        if !r.curve.is_empty() {
            curve.clone_from(&r.curve);
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
    // Deferred evaluation: the epoch lines come now, from the curve.
    let per_epoch = steps_per_epoch(t.samples, a.workers, t.batch);
    for p in curve.iter().filter(|p| p.step > 0 && p.step % per_epoch == 0) {
        first_loss.get_or_insert(p.loss);
        last_loss = Some(p.loss);
        println!(
            "  epoch {}: loss {:.4}, accuracy {:.1}% (rank 0 at {:.1} s)",
            p.step / per_epoch,
            p.loss,
            p.accuracy * 100.0,
            p.secs
        );
    }
    let reached = a
        .target_loss
        .and_then(|target| curve.iter().find(|p| p.loss <= target));
    if let Some(target) = a.target_loss {
        match reached {
            Some(p) => println!(
                "  loss {target} reached at rank 0's step {} after {:.2} s (loss {:.4})",
                p.step, p.secs, p.loss
            ),
            None => println!("  loss {target} not reached in {} steps", last.step),
        }
    }
    let detail: Option<JobDetail> = local::control_client(&control_url, None, Duration::from_secs(30))
        .ok()
        .and_then(|c| c.send(&control::job(admit.id)).ok());
    if let (Some(d), Consistency::Bounded { .. } | Consistency::Async) = (&detail, t.consistency) {
        let k = &d.clock;
        let lead = k.max_lead.map_or("-".into(), |l| l.to_string());
        match t.consistency {
            Consistency::Bounded { .. } => println!(
                "  {}: largest lead allowed {lead} steps; {} chunk answers held, {:.1} ms of waiting in all, \
                 {:.1} ms at most",
                t.consistency,
                k.held_total,
                k.held_wait_us as f64 / 1e3,
                k.held_wait_max_us as f64 / 1e3
            ),
            _ => println!("  async: largest lead allowed {lead} steps"),
        }
    }
    if let Some(path) = &a.summary {
        let final_point = curve.last();
        let s = Summary {
            consistency: t.consistency.to_string(),
            workers: a.workers,
            lr: t.appliance_lr(a.workers),
            compute_ms: t.compute_ms,
            jitter_exp_ms: t.jitter.unwrap_or(0.0),
            spike: t.spike,
            steps: last.step,
            wall_s: wall,
            train_s: final_point.map_or(0.0, |p| p.secs),
            exchange_s: last.exchange_secs,
            curve: curve.clone(),
            target_loss: a.target_loss,
            steps_to_target: reached.map(|p| p.step),
            secs_to_target: reached.map(|p| p.secs),
            final_loss: final_point.map(|p| p.loss),
            final_accuracy: final_point.map(|p| p.accuracy),
            clock: detail.map(|d| d.clock),
        };
        std::fs::write(path, serde_json::to_string_pretty(&s)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
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

    // The end of the run either way: the appliance's counters, the job
    // evicted, the daemons stopped.
    let finish = |app: &mut Appliance| {
        print_appliance_stats(&control_url, app.backend);
        local::evict(&control_url, admit.id, Some(&operator));
        app.control.stop();
        app.dataplane.stop();
        println!("  job evicted, phub-control and phub-dataplane stopped");
    };
    if t.consistency != Consistency::Sync {
        println!(
            "  {}: no single-process reference (each push is applied alone, in arrival order)",
            t.consistency
        );
        finish(&mut app);
        return Ok(());
    }
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
    finish(&mut app);
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

/// The appliance's packet counts and drops, from control's `/v1/stats`.
fn print_appliance_stats(control_url: &str, backend: &str) {
    let client = local::control_client(control_url, None, Duration::from_secs(30));
    if let Ok(c) = client {
        if let Ok(s) = c.send(&control::stats()) {
            if let Some(d) = s.dataplane {
                let t = d.total();
                let (rx, tx, resent) = (t.rx_packets, t.tx_packets, t.results_resent);
                let drops: u64 = t.drops.values().sum();
                let mut reasons: Vec<_> = t.drops.iter().filter(|&(_, &n)| n > 0).collect();
                reasons.sort_by_key(|&(_, &n)| std::cmp::Reverse(n));
                let reasons: Vec<String> = reasons.iter().map(|(r, n)| format!("{r} {n}")).collect();
                println!(
                    "  appliance ({}): {rx} packets in, {tx} out, {resent} results resent, {drops} dropped{}",
                    backend,
                    if reasons.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", reasons.join(", "))
                    }
                );
            }
        }
    }
}

/// One run of `converge`.
#[derive(Debug, Serialize, Deserialize)]
struct ConvergeRun {
    /// Run number, from 1.
    run: usize,
    /// Steal ticks the host's CPUs lost during the run.
    steal_ticks: Option<u64>,
    /// What the demo measured.
    summary: Summary,
}

/// Median and range of `v` as "median (lo–hi)", or "-" when empty.
fn spread(v: &[f64], digits: usize) -> String {
    if v.is_empty() {
        return "-".into();
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let median = crate::stats::median(&s);
    if s.len() == 1 {
        format!("{median:.digits$}")
    } else {
        format!(
            "{median:.digits$} ({:.digits$}–{:.digits$})",
            s[0],
            s[s.len() - 1]
        )
    }
}

fn converge_main(c: ConvergeArgs) -> Result<()> {
    let target = c
        .run
        .target_loss
        .context("converge needs --target-loss (the loss each mode is timed to)")?;
    if c.run.train.eval_every == 0 {
        bail!("converge needs --eval-every N (rank 0's parameters kept every N steps)");
    }
    std::fs::create_dir_all(&c.out).with_context(|| format!("creating {}", c.out.display()))?;
    let mut all: Vec<ConvergeRun> = Vec::new();
    if c.replot {
        let path = c.out.join("converge.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        all = serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    }
    for run in (1..=c.runs).filter(|_| !c.replot) {
        for &mode in &c.modes {
            let name = mode.to_string();
            let path = c.out.join(format!("{}-run{run}.json", name.replace(':', "")));
            let mut a = c.run.clone();
            a.train.consistency = mode;
            // Each run its own draws of the emulated compute, the same for
            // every mode within the run.
            a.train.compute_seed = c.run.train.compute_seed + run as u64;
            a.summary = Some(path.clone());
            println!("== {name}, run {run} of {}", c.runs);
            let steal0 = crate::sys::steal_ticks();
            run_main(a).with_context(|| format!("{name} run {run}"))?;
            let steal_ticks = steal0
                .zip(crate::sys::steal_ticks())
                .map(|(a, b)| b.saturating_sub(a));
            let text =
                std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let summary: Summary = serde_json::from_str(&text)?;
            all.push(ConvergeRun {
                run,
                steal_ticks,
                summary,
            });
        }
    }
    if !c.replot {
        std::fs::write(c.out.join("converge.json"), serde_json::to_string_pretty(&all)?)?;
    }
    println!();
    println!(
        "| mode | reached | steps to loss {target} | s to loss {target} | final loss | final accuracy | rank 0 blocked | largest lead | chunk answers held | their waits, s in all | steal ticks |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for &mode in &c.modes {
        let runs: Vec<&ConvergeRun> = all
            .iter()
            .filter(|r| r.summary.consistency == mode.to_string())
            .collect();
        let col = |f: &dyn Fn(&Summary) -> Option<f64>| -> Vec<f64> {
            runs.iter().filter_map(|r| f(&r.summary)).collect()
        };
        let secs = col(&|s| s.secs_to_target);
        let held = |f: &dyn Fn(&phub_proto::api::ClockStats) -> f64, digits| match mode {
            Consistency::Bounded { .. } => spread(&col(&|s| s.clock.as_ref().map(f)), digits),
            _ => "-".to_string(),
        };
        let leads: Vec<f64> = col(&|s| s.clock.as_ref().and_then(|k| k.max_lead).map(f64::from));
        println!(
            "| {} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            mode,
            secs.len(),
            runs.len(),
            spread(&col(&|s| s.steps_to_target.map(|n| n as f64)), 0),
            spread(&secs, 2),
            spread(&col(&|s| s.final_loss.map(f64::from)), 4),
            spread(&col(&|s| s.final_accuracy.map(|a| f64::from(a) * 100.0)), 1),
            spread(
                &col(&|s| (s.train_s > 0.0).then(|| 100.0 * s.exchange_s / s.train_s)),
                0
            ),
            if leads.is_empty() {
                "-".into()
            } else {
                spread(&leads, 0)
            },
            held(&|k| k.held_total as f64, 0),
            held(&|k| k.held_wait_us as f64 / 1e6, 1),
            spread(
                &runs
                    .iter()
                    .filter_map(|r| r.steal_ticks.map(|t| t as f64))
                    .collect::<Vec<_>>(),
                0
            ),
        );
    }
    if let Some(path) = &c.plot {
        use crate::bench::plot::{panels_svg, write_text, Line, Panel, COLORS};
        // One colour per mode in every panel; bounded delay's τ line black.
        let color = |m: Consistency| {
            let i = c.modes.iter().position(|&x| x == m).unwrap_or(0);
            COLORS[i % COLORS.len()]
        };
        let runs_of = |m: Consistency| {
            all.iter()
                .filter(move |r| r.summary.consistency == m.to_string())
                .map(|r| &r.summary)
        };
        // Per mode, the median over its runs of `f`; none unless every
        // run has it (a target some runs missed has no time).
        let median_of = |m: Consistency, f: &dyn Fn(&Summary) -> Option<f64>| {
            let v: Option<Vec<f64>> = runs_of(m).map(f).collect();
            v.filter(|v| !v.is_empty()).map(|v| crate::stats::median(&v))
        };
        let against_tau = |name: &str, f: &dyn Fn(&Summary) -> Option<f64>| -> Vec<Line> {
            let taus: Vec<(f64, f64)> = c
                .modes
                .iter()
                .filter_map(|&m| match m {
                    Consistency::Bounded { delay } => median_of(m, f).map(|y| (f64::from(delay), y)),
                    _ => None,
                })
                .collect();
            let span = (
                taus.iter().map(|p| p.0).fold(f64::INFINITY, f64::min).min(0.0),
                taus.iter().map(|p| p.0).fold(1.0, f64::max),
            );
            let mut lines = vec![Line {
                name: name.into(),
                color: "#000000",
                dashed: false,
                points: taus,
            }];
            for &m in &c.modes {
                if let (Consistency::Sync | Consistency::Async, Some(y)) = (m, median_of(m, f)) {
                    lines.push(Line {
                        name: m.to_string(),
                        color: color(m),
                        dashed: true,
                        points: vec![(span.0, y), (span.1, y)],
                    });
                }
            }
            lines
        };
        let to_target = against_tau("bounded delay τ", &|s| s.secs_to_target);
        let blocked = against_tau("bounded delay τ", &|s| {
            (s.train_s > 0.0).then(|| 100.0 * s.exchange_s / s.train_s)
        });
        // Loss against time, each mode's first run, up to twice the
        // slowest time to target.
        let horizon = 2.0
            * all
                .iter()
                .filter_map(|r| r.summary.secs_to_target)
                .fold(1.0, f64::max);
        let loss: Vec<Line> = c
            .modes
            .iter()
            .filter_map(|&m| {
                let s = runs_of(m).next()?;
                Some(Line {
                    name: m.to_string(),
                    color: color(m),
                    dashed: false,
                    points: s
                        .curve
                        .iter()
                        .filter(|p| p.secs <= horizon && p.loss <= 1.5)
                        .map(|p| (p.secs, f64::from(p.loss)))
                        .collect(),
                })
            })
            .collect();
        let first = &all.first().context("no runs")?.summary;
        let caption = format!(
            "phub-demo converge: MLP, W={}, compute {} ms + exp({} ms){} per step; medians of {} runs; loss: run 1",
            first.workers,
            first.compute_ms,
            first.jitter_exp_ms,
            first.spike.map_or(String::new(), |s| format!(", spike {s}")),
            c.runs
        );
        let svg = panels_svg(
            &[
                Panel {
                    title: format!("time to loss {target}"),
                    xlabel: "τ (bounded delay)".into(),
                    ylabel: "seconds (rank 0)".into(),
                    lines: to_target,
                },
                Panel {
                    title: "rank 0 waiting in the exchange".into(),
                    xlabel: "τ (bounded delay)".into(),
                    ylabel: "% of its training time".into(),
                    lines: blocked,
                },
                Panel {
                    title: "loss (rank 0's parameters)".into(),
                    xlabel: "seconds".into(),
                    ylabel: "loss".into(),
                    lines: loss,
                },
            ],
            &caption,
        );
        write_text(path, svg)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// `phub-demo`'s entry point.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Some(Cmd::Worker(w)) => worker_main(w),
        Some(Cmd::Converge(c)) => converge_main(c),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_median_and_range() {
        assert_eq!(spread(&[], 1), "-");
        assert_eq!(spread(&[2.0], 1), "2.0");
        assert_eq!(spread(&[3.0, 1.0, 2.0], 1), "2.0 (1.0–3.0)");
    }

    #[test]
    fn train_args_default_to_the_command_line_s() {
        let cli = Cli::parse_from(["phub-demo"]);
        assert_eq!(
            serde_json::to_value(&cli.run.train).unwrap(),
            serde_json::to_value(TrainArgs::default()).unwrap()
        );
    }

    #[test]
    fn consistency_flag_and_spec() {
        // The flag is read by Consistency's FromStr (phub-proto).
        #[derive(Parser)]
        struct Flags {
            #[command(flatten)]
            train: TrainArgs,
        }
        for s in ["bsp", "async", "ssp:0", "ssp:16"] {
            let a = Flags::try_parse_from(["demo", "--consistency", s]).unwrap();
            assert_eq!(a.train.consistency.to_string(), s);
        }
        for wrong in ["ssp:2000", "eventual"] {
            let e = Flags::try_parse_from(["demo", "--consistency", wrong])
                .err()
                .unwrap();
            assert!(e.to_string().contains("0 to 1024"), "{e}");
        }
        let t = TrainArgs {
            consistency: Consistency::Bounded { delay: 4 },
            ..TrainArgs::default()
        };
        let spec = phub_proto::spec::JobSpec::from_toml(&t.spec_toml(4)).unwrap();
        assert_eq!(spec.consistency, Consistency::Bounded { delay: 4 });
        assert_eq!(t.appliance_lr(4), 0.025, "lr / W per push");
        let bsp = TrainArgs::default();
        assert!(!bsp.spec_toml(4).contains("consistency"));
        assert_eq!(bsp.appliance_lr(4), 0.1);
    }
}
