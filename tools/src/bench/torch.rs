//! `phub-bench torch`: the same PyTorch DDP training step with gloo's
//! all-reduce and with phub's comm hook (flat and hierarchical), on the
//! virtual racks ([`super::racks`]), over the same tbf-limited links, in
//! the same processes, trial by trial.
//!
//! The racks: a namespace per rank behind its own link to its rack's
//! switch (`--worker-gbps`), an appliance per rack behind its link
//! (`--appliance-gbps`, default W/R times a worker's), a spine between the
//! racks' uplinks (`--spine-gbps`, default half the rack's workers' sum:
//! oversubscribed 2:1). One Python process per rank
//! (`python/bench/rack_step.py`, run with `--python`, default the torch
//! environment of `make torch-venv`) holds a DDP model per mode over one
//! gloo process group; every trial runs each mode's step once. Rank 0
//! stops at a mark before and after each step (every rank at a barrier),
//! and the links' byte counters are read there: the bytes a step moved on
//! the spine and on the ranks' links are counted, never computed.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use phub_hwtests::dataplane_args::DataplaneArgs;
use phub_hwtests::process::{self, Daemon};
use serde::Serialize;

use super::local;
use super::racks::{self, Daemons, Placement, RackNet};
use super::run::Job;
use crate::profiles::{self, Profile};
use crate::stats;
use crate::sys::steal_ticks;

/// The TCP port of gloo's rendezvous, on rank 0's address.
const GLOO_PORT: u16 = 29500;
/// Payload bytes per chunk of the phub jobs.
const CHUNK_BYTES: u32 = 8192;

/// How a step exchanges its gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// DDP's own all-reduce over gloo.
    Gloo,
    /// phub's comm hook, the job sharded flat over every rack's appliance.
    Flat,
    /// phub's comm hook, the job hierarchical over every rack's appliance.
    Hierarchical,
}

impl Mode {
    /// Its name, as rack_step.py takes it.
    fn name(self) -> &'static str {
        match self {
            Mode::Gloo => "gloo",
            Mode::Flat => "flat",
            Mode::Hierarchical => "hierarchical",
        }
    }
}

/// `phub-bench torch`'s options.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct TorchArgs {
    /// Virtual racks (as root): a namespace per rank, an appliance per rack.
    #[arg(long, default_value_t = 2)]
    pub racks: usize,
    /// Ranks (W), spread over the racks in contiguous blocks.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Each rank's link to its rack's switch, Gbit/s both ways (tbf).
    #[arg(long, value_name = "G", default_value_t = 1.0)]
    pub worker_gbps: f64,
    /// Each appliance's link, Gbit/s (default: W/R times --worker-gbps).
    #[arg(long, value_name = "G")]
    pub appliance_gbps: Option<f64>,
    /// Each rack's uplink to the spine, Gbit/s (default: half of W/R times
    /// --worker-gbps, a 2:1 oversubscribed spine).
    #[arg(long, value_name = "G")]
    pub spine_gbps: Option<f64>,
    /// Queue of each limited link's tbf, in ms at its rate (at least 1 MiB).
    #[arg(long, value_name = "MS", default_value_t = 50.0)]
    pub link_queue_ms: f64,
    /// Model whose parameter shapes the step exchanges: resnet50, bert-base,
    /// or any of phub-bench run's (synthetic:N, ...).
    #[arg(long, default_value = "resnet50")]
    pub model: String,
    /// What each trial runs, besides the step without exchange.
    #[arg(long, value_delimiter = ',', default_value = "gloo,flat,hierarchical")]
    pub modes: Vec<Mode>,
    /// Timed trials (each runs every mode once).
    #[arg(long, default_value_t = 5)]
    pub trials: usize,
    /// Untimed trials first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// DDP's bucket_cap_mb.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// phub's window, chunks in flight per rank (default: the worker
    /// library's choice).
    #[arg(long, value_name = "N")]
    pub window: Option<usize>,
    /// Dataplane lcores per appliance.
    #[arg(long, default_value_t = 1)]
    pub lcores: usize,
    /// Let the dataplanes pin their lcores (default: not, the ranks' Python
    /// processes share the cores).
    #[arg(long)]
    pub pin: bool,
    /// Where phub-dataplane and phub-control are (default: this program's
    /// own `serve-*` subcommands).
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// The Python with torch and phub (default: $PHUB_PYTHON, else
    /// target/torch-venv/bin/python, made by `make torch-venv`).
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// The rank script (default: python/bench/rack_step.py of this
    /// source tree).
    #[arg(long, value_name = "PATH")]
    pub script: Option<PathBuf>,
    /// Give up (killing everything) after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
    /// Also write the figures as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// One mode's figures.
#[derive(Debug, Clone, Serialize)]
pub struct ModeFigures {
    /// Each timed trial's step (the slowest rank's backward with its
    /// exchange), ms, in order.
    pub step_ms: Vec<f64>,
    /// Their median.
    pub step_ms_median: f64,
    /// The smallest.
    pub step_ms_min: f64,
    /// The largest.
    pub step_ms_max: f64,
    /// The median step less the median step without exchange, ms.
    pub exchange_ms: f64,
    /// Bytes that entered the spine per timed step (its rack-facing
    /// interfaces' counters, between the marks around the step).
    pub spine_bytes_per_step: f64,
    /// Bytes each rank's own link carried per timed step, both ways, the
    /// mean over ranks.
    pub worker_link_bytes_per_step: f64,
    /// gloo's median step over this one (> 1: faster than gloo); phub modes
    /// when gloo ran.
    pub speedup_vs_gloo: Option<f64>,
    /// phub's retransmissions over the whole run, summed over ranks.
    pub retransmits: Option<u64>,
}

/// `phub-bench torch`'s report.
#[derive(Debug, Clone, Serialize)]
pub struct TorchReport {
    /// R.
    pub racks: usize,
    /// W.
    pub workers: usize,
    /// Ranks in each rack.
    pub workers_per_rack: Vec<usize>,
    /// The model whose shapes were exchanged.
    pub model: String,
    /// Its bytes in f32.
    pub model_bytes: u64,
    /// Its tensors (the jobs' keys).
    pub tensors: usize,
    /// Each rank's link, Gbit/s.
    pub worker_gbps: f64,
    /// Each appliance's link, Gbit/s.
    pub appliance_gbps: f64,
    /// Each rack's uplink, Gbit/s.
    pub spine_gbps: f64,
    /// DDP's bucket_cap_mb.
    pub bucket_mb: f64,
    /// Dataplane lcores per appliance.
    pub lcores: usize,
    /// `--window` (none: the worker library's choice).
    pub window: Option<usize>,
    /// Timed trials.
    pub trials: usize,
    /// The step without exchange (a comm hook that hands the bucket
    /// back), median ms.
    pub baseline_step_ms: f64,
    /// gloo's median step, ms.
    pub gloo_step_ms: Option<f64>,
    /// phub's median step, ms: hierarchical's when it ran, else flat's.
    pub phub_step_ms: Option<f64>,
    /// gloo_step_ms / phub_step_ms.
    pub speedup_vs_gloo: Option<f64>,
    /// Each mode's figures, by name.
    pub modes: BTreeMap<String, ModeFigures>,
    /// Steal time over the run, in ticks of /proc/stat's cpu line.
    pub steal_ticks: Option<u64>,
    /// CPUs this machine has.
    pub cpus: usize,
}

/// Why these options cannot run, if they cannot.
fn check(a: &TorchArgs) -> Result<()> {
    ensure!(
        (1..=racks::MAX_RACKS).contains(&a.racks),
        "--racks {}: expected 1 to {}",
        a.racks,
        racks::MAX_RACKS
    );
    ensure!(
        a.workers >= a.racks.max(2) && a.workers <= racks::MAX_WORKER_LINKS,
        "--workers {}: expected at least 2 and one per rack ({}), at most {}",
        a.workers,
        a.racks,
        racks::MAX_WORKER_LINKS
    );
    ensure!(
        !a.modes.is_empty(),
        "--modes: expected at least one of gloo, flat, hierarchical"
    );
    ensure!(
        !a.modes.contains(&Mode::Hierarchical) || a.racks >= 2,
        "--modes hierarchical with --racks 1: a hierarchical job needs two racks or more"
    );
    ensure!(a.trials >= 1, "--trials 0: expected at least 1");
    racks::check_links(
        &[
            ("--worker-gbps", Some(a.worker_gbps)),
            ("--appliance-gbps", a.appliance_gbps),
            ("--spine-gbps", a.spine_gbps),
        ],
        a.link_queue_ms,
    )?;
    ensure!(
        a.bucket_mb.is_finite() && a.bucket_mb > 0.0,
        "--bucket-mb {}: expected more than 0",
        a.bucket_mb
    );
    ensure!(
        (1..=64).contains(&a.lcores),
        "--lcores {}: expected 1 to 64",
        a.lcores
    );
    Ok(())
}

/// The Python and the rank script to run, found or said missing.
fn python_and_script(a: &TorchArgs) -> Result<(PathBuf, PathBuf)> {
    let python = a
        .python
        .clone()
        .or_else(|| std::env::var_os("PHUB_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("target/torch-venv/bin/python"));
    ensure!(
        python.exists(),
        "{} not found: give --python (or PHUB_PYTHON) a Python with torch and phub, or run \
         `make torch-venv`",
        python.display()
    );
    let script = a
        .script
        .clone()
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/bench/rack_step.py"));
    ensure!(
        script.exists(),
        "{} not found: give --script the path of python/bench/rack_step.py",
        script.display()
    );
    Ok((python, script))
}

/// Link rates: worker, appliance, spine (the defaults of a rack).
fn rates(a: &TorchArgs) -> (f64, f64, f64) {
    let per_rack = a.workers as f64 / a.racks as f64;
    let appliance = a.appliance_gbps.unwrap_or(a.worker_gbps * per_rack);
    let spine = a.spine_gbps.unwrap_or(a.worker_gbps * per_rack / 2.0);
    (a.worker_gbps, appliance, spine)
}

/// `phub-bench torch`.
pub fn run(a: &TorchArgs) -> Result<()> {
    check(a)?;
    // Killed or interrupted, it stops the ranks and appliances it started
    // and removes its namespaces and scratch directory.
    process::stop_on_signal("phub-bench").map_err(|e| anyhow!(e))?;
    let profile = profiles::load(&a.model).map_err(|e| anyhow!("--model: {e}"))?;
    let (python, script) = python_and_script(a)?;
    let (worker_gbps, appliance_gbps, spine_gbps) = rates(a);
    let of = racks::rack_of_ranks(a.workers, a.racks);
    let per_rack = racks::ranks_per_rack(&of, a.racks);
    eprintln!(
        "phub-bench torch: {} ({} tensors, {:.1} MB), W={} over R={} racks {per_rack:?}; links: ranks \
         {worker_gbps} Gbit/s, appliances {appliance_gbps} Gbit/s, spine {spine_gbps} Gbit/s; modes {:?}",
        profile.name,
        profile.len(),
        profile.bytes_f32() as f64 / 1e6,
        a.workers,
        a.racks,
        a.modes
    );
    let mut net = RackNet::create(a.racks, Some(spine_gbps), Some(appliance_gbps), a.link_queue_ms)?;
    net.add_workers(&of, Some(worker_gbps), a.link_queue_ms)?;
    let dir = std::env::temp_dir().join(format!("phub-bench-torch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    process::track_dir(&dir);
    let steal0 = steal_ticks();
    let r = RackNet::inside_named(&net.spine.name.clone(), || {
        in_spine(a, &profile, &net, &dir, &per_rack, &python, &script)
    });
    let steal = steal0.zip(steal_ticks()).map(|(s0, s1)| s1.saturating_sub(s0));
    if r.is_err() {
        eprintln!("phub-bench: the run's logs were in {} (removed)", dir.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
    process::untrack_dir(&dir);
    drop(net);
    let (baseline, modes) = r?;
    let median_of = |m: Mode| modes.get(m.name()).map(|f| f.step_ms_median);
    let gloo = median_of(Mode::Gloo);
    let phub = median_of(Mode::Hierarchical).or(median_of(Mode::Flat));
    let report = TorchReport {
        racks: a.racks,
        workers: a.workers,
        workers_per_rack: per_rack,
        model: profile.name.clone(),
        model_bytes: profile.bytes_f32(),
        tensors: profile.len(),
        worker_gbps,
        appliance_gbps,
        spine_gbps,
        bucket_mb: a.bucket_mb,
        lcores: a.lcores,
        window: a.window,
        trials: a.trials,
        baseline_step_ms: baseline,
        gloo_step_ms: gloo,
        phub_step_ms: phub,
        speedup_vs_gloo: gloo.zip(phub).map(|(g, p)| g / p),
        modes,
        steal_ticks: steal,
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
    };
    print_table(&report);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// What the ranks' marks counted, per mode: bytes on the spine and on the
/// ranks' links over the timed steps, and how many.
#[derive(Default)]
struct Counted {
    spine: u64,
    links: u64,
    steps: u64,
}

/// Starts the appliances and control (in the spine, the calling thread's
/// namespace), admits a job per phub mode, runs the ranks and gathers
/// their figures: the baseline's median step and each mode's figures.
fn in_spine(
    a: &TorchArgs,
    profile: &Profile,
    net: &RackNet,
    dir: &Path,
    per_rack: &[usize],
    python: &Path,
    script: &Path,
) -> Result<(f64, BTreeMap<String, ModeFigures>)> {
    let job = Job::new(
        profile.job_json(
            &format!("phub-bench torch {}", profile.name),
            a.workers,
            CHUNK_BYTES,
        ),
        profile,
    )?;
    // A flat job's share and a hierarchical job's rack slots and homes: room
    // for the job three times, on every appliance.
    let budget = 3 * job.budget(a.lcores, false);
    let daemons = Daemons {
        bin_dir: a.bin_dir.as_deref(),
        dataplane: DataplaneArgs {
            lcores: Some(a.lcores),
            no_pin: !a.pin,
            ..DataplaneArgs::default()
        },
        env: Vec::new(),
        control_extra: Vec::new(),
        dpdk: false,
    };
    let appl = racks::start(&daemons, net, dir, budget)?;
    let token = Some(appl.token.as_str());
    let mut admitted = Vec::new();
    let result = (|| {
        let mut jobs = Vec::new();
        for &m in &a.modes {
            let placement = match m {
                Mode::Gloo => continue,
                Mode::Flat => Placement::Flat(a.racks),
                Mode::Hierarchical => Placement::Hierarchical(per_rack.to_vec()),
            };
            let r = local::admit(
                &appl.control_url,
                &placement.spec(&job.json, None).to_string(),
                token,
            )
            .with_context(|| format!("admitting the {} job", m.name()))?;
            admitted.push(r.id);
            jobs.push(format!("{}:{}:{:016x}", m.name(), r.id, r.token));
        }
        run_ranks(a, profile, net, dir, &appl.control_url, &jobs, python, script)
    })();
    for id in admitted {
        local::evict(&appl.control_url, id, token);
    }
    appl.stop();
    result
}

/// Starts a rank's Python in its namespace.
fn spawn_rank(
    net: &RackNet,
    dir: &Path,
    rank: usize,
    rack: usize,
    python: &Path,
    args: Vec<String>,
) -> Result<Daemon> {
    let mut cmd = Command::new(python);
    cmd.args(args)
        .env("PHUB_WORKER_RACK", racks::rack_label(rack + 1))
        .env("GLOO_SOCKET_IFNAME", "nic")
        .env("OMP_NUM_THREADS", "1")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(if rank == 0 { Stdio::piped() } else { Stdio::null() })
        .stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() });
    let log = dir.join(format!("rank{rank}.log"));
    RackNet::inside_named(&net.workers[rank].name, || {
        Daemon::spawn_command(&format!("rank {rank}"), cmd, &log).map_err(anyhow::Error::from)
    })
}

/// The first rank that has exited, if one has: its name and status.
fn exited(ranks: &mut [Daemon]) -> Option<(String, std::process::ExitStatus)> {
    ranks
        .iter_mut()
        .find_map(|d| d.try_wait().ok().flatten().map(|s| (d.name().to_string(), s)))
}

/// The last lines of every rank's log, for an error.
fn logs(ranks: &[Daemon]) -> String {
    ranks
        .iter()
        .map(|d| {
            let text = d.log_text();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            format!("--- {} ({}):\n{tail}", d.name(), d.log().display())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[allow(clippy::too_many_arguments)] // the run's parts, each owned elsewhere
fn run_ranks(
    a: &TorchArgs,
    profile: &Profile,
    net: &RackNet,
    dir: &Path,
    control_url: &str,
    jobs: &[String],
    python: &Path,
    script: &Path,
) -> Result<(f64, BTreeMap<String, ModeFigures>)> {
    let sizes: Vec<u64> = profile.tensors.iter().map(|t| t.elements).collect();
    let sizes_path = dir.join("sizes.json");
    std::fs::write(&sizes_path, serde_json::to_string(&sizes)?)?;
    let modes: Vec<&str> = std::iter::once("none")
        .chain(a.modes.iter().map(|m| m.name()))
        .collect();
    let of = racks::rack_of_ranks(a.workers, a.racks);
    let mut ranks = Vec::new();
    for (rank, &rack) in of.iter().enumerate() {
        let mut args = vec![
            script.display().to_string(),
            "--rank".into(),
            rank.to_string(),
            "--world".into(),
            a.workers.to_string(),
            "--master".into(),
            format!("{}:{GLOO_PORT}", racks::worker_ip(0)),
            "--control".into(),
            control_url.into(),
            "--modes".into(),
            modes.join(","),
            "--sizes".into(),
            sizes_path.display().to_string(),
            "--trials".into(),
            a.trials.to_string(),
            "--warmup".into(),
            a.warmup.to_string(),
            "--bucket-mb".into(),
            a.bucket_mb.to_string(),
            "--out".into(),
            dir.join(format!("rank{rank}.json")).display().to_string(),
        ];
        for j in jobs {
            args.extend(["--job".into(), j.clone()]);
        }
        if let Some(w) = a.window {
            args.extend(["--window".into(), w.to_string()]);
        }
        ranks.push(spawn_rank(net, dir, rank, rack, python, args)?);
    }
    let (stdin, stdout) = ranks[0].take_stdio();
    let (mut stdin, stdout) = (
        stdin.context("rank 0's stdin")?,
        stdout.context("rank 0's stdout")?,
    );
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(a.timeout_s);
    let mut counted: BTreeMap<String, Counted> = BTreeMap::new();
    let mut at_begin: Option<(u64, u64)> = None;
    let counters =
        || -> Result<(u64, u64)> { Ok((net.spine_rx_bytes()?, net.worker_link_bytes()?.iter().sum())) };
    loop {
        ensure!(
            Instant::now() < deadline,
            "the ranks ran past --timeout-s {}; their logs:\n{}",
            a.timeout_s,
            logs(&ranks)
        );
        match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(line) => {
                let line = line.context("reading rank 0's output")?;
                let words: Vec<&str> = line.split_whitespace().collect();
                let ["PHUB-MARK", what, mode, trial] = words[..] else {
                    eprintln!("rank 0: {line}");
                    continue;
                };
                let trial: usize = trial.parse().with_context(|| format!("rank 0's mark {line:?}"))?;
                let now = counters()?;
                match what {
                    "begin" => at_begin = Some(now),
                    "end" => {
                        let (s0, l0) = at_begin.take().context("an end mark without a begin")?;
                        if trial >= a.warmup {
                            let c = counted.entry(mode.to_string()).or_default();
                            c.spine += now.0 - s0;
                            c.links += now.1 - l0;
                            c.steps += 1;
                        }
                    }
                    _ => bail!("rank 0's mark {line:?}"),
                }
                writeln!(stdin, "go").context("answering rank 0")?;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some((name, status)) = exited(&mut ranks).filter(|(_, s)| !s.success()) {
                    bail!("{name} exited ({status}); the ranks' logs:\n{}", logs(&ranks));
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for i in 0..ranks.len() {
        let status = loop {
            if let Some(s) = ranks[i].try_wait()? {
                break s;
            }
            ensure!(
                Instant::now() < deadline,
                "{} did not exit by --timeout-s; the ranks' logs:\n{}",
                ranks[i].name(),
                logs(&ranks)
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        ensure!(
            status.success(),
            "{} exited ({status}); the ranks' logs:\n{}",
            ranks[i].name(),
            logs(&ranks)
        );
    }
    figures(a, dir, &modes, &counted)
}

/// Each mode's figures from the ranks' files and the marks' counts; the
/// baseline's median step first.
fn figures(
    a: &TorchArgs,
    dir: &Path,
    modes: &[&str],
    counted: &BTreeMap<String, Counted>,
) -> Result<(f64, BTreeMap<String, ModeFigures>)> {
    #[derive(serde::Deserialize)]
    struct RankOut {
        step_s: BTreeMap<String, Vec<f64>>,
        retransmits: BTreeMap<String, u64>,
    }
    let mut outs = Vec::new();
    for rank in 0..a.workers {
        let path = dir.join(format!("rank{rank}.json"));
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        outs.push(serde_json::from_str::<RankOut>(&text).with_context(|| format!("{}", path.display()))?);
    }
    // A trial's step is its slowest rank's.
    let steps = |mode: &str| -> Result<Vec<f64>> {
        (0..a.trials)
            .map(|t| {
                outs.iter()
                    .map(|o| o.step_s.get(mode).and_then(|v| v.get(t)).copied())
                    .try_fold(0.0f64, |m, s| s.map(|s| m.max(s * 1e3)))
                    .with_context(|| format!("a rank has no step {t} of {mode}"))
            })
            .collect()
    };
    let baseline = stats::median(&steps("none")?);
    let mut figs = BTreeMap::new();
    for &mode in modes.iter().filter(|m| **m != "none") {
        let s = steps(mode)?;
        let sum = stats::summarize(&s);
        let c = counted.get(mode).context("no counted steps")?;
        let per = |b: u64| b as f64 / c.steps.max(1) as f64;
        figs.insert(
            mode.to_string(),
            ModeFigures {
                step_ms_median: sum.median,
                step_ms_min: sum.min,
                step_ms_max: sum.max,
                exchange_ms: sum.median - baseline,
                spine_bytes_per_step: per(c.spine),
                worker_link_bytes_per_step: per(c.links) / a.workers as f64,
                speedup_vs_gloo: None,
                retransmits: (mode != "gloo")
                    .then(|| outs.iter().filter_map(|o| o.retransmits.get(mode)).sum()),
                step_ms: s,
            },
        );
    }
    if let Some(g) = figs.get("gloo").map(|f| f.step_ms_median) {
        for (mode, f) in figs.iter_mut() {
            if mode != "gloo" {
                f.speedup_vs_gloo = Some(g / f.step_ms_median);
            }
        }
    }
    Ok((baseline, figs))
}

fn print_table(r: &TorchReport) {
    println!(
        "phub-bench torch: {} ({:.1} MB), W={} over R={} racks {:?}; links: ranks {} Gbit/s, appliances {} \
         Gbit/s, spine {} Gbit/s; {} trials; step without exchange {:.1} ms",
        r.model,
        r.model_bytes as f64 / 1e6,
        r.workers,
        r.racks,
        r.workers_per_rack,
        r.worker_gbps,
        r.appliance_gbps,
        r.spine_gbps,
        r.trials,
        r.baseline_step_ms
    );
    println!(
        "{:14}{:>12}{:>18}{:>13}{:>16}{:>18}{:>12}",
        "mode", "step ms", "(min-max)", "exchange ms", "spine MB/step", "rank link MB/step", "vs gloo"
    );
    for (mode, f) in &r.modes {
        println!(
            "{mode:14}{:>12.1}{:>18}{:>13.1}{:>16.1}{:>18.1}{:>12}",
            f.step_ms_median,
            format!("({:.1}-{:.1})", f.step_ms_min, f.step_ms_max),
            f.exchange_ms,
            f.spine_bytes_per_step / 1e6,
            f.worker_link_bytes_per_step / 1e6,
            f.speedup_vs_gloo.map_or("-".into(), |x| format!("{x:.2}x")),
        );
    }
    if let Some(s) = r.steal_ticks {
        println!("steal over the run: {s} ticks");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: TorchArgs,
    }

    fn args(line: &[&str]) -> TorchArgs {
        Cli::try_parse_from(std::iter::once("torch").chain(line.iter().copied()))
            .unwrap()
            .a
    }

    #[test]
    fn a_racks_links_default_to_w_over_r_workers_and_a_2_to_1_spine() {
        assert_eq!(rates(&args(&[])), (1.0, 2.0, 1.0));
        assert_eq!(
            rates(&args(&["--racks", "3", "--workers", "6", "--worker-gbps", "0.5"])),
            (0.5, 1.0, 0.5)
        );
        assert_eq!(rates(&args(&["--spine-gbps", "0.25"])).2, 0.25);
    }

    #[test]
    fn options_that_cannot_run_are_refused_with_the_reason() {
        let err = |line: &[&str]| check(&args(line)).unwrap_err().to_string();
        assert!(err(&["--racks", "1", "--workers", "2"]).contains("hierarchical job needs two racks"));
        assert!(err(&["--workers", "1"]).contains("--workers 1"));
        assert!(err(&["--racks", "3", "--workers", "2"]).contains("one per rack"));
        assert!(err(&["--worker-gbps", "0"]).contains("--worker-gbps 0"));
        assert!(err(&["--trials", "0"]).contains("--trials 0"));
        check(&args(&["--racks", "1", "--workers", "2", "--modes", "gloo,flat"])).unwrap();
        check(&args(&[])).unwrap();
    }
}
