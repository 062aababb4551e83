//! `phub-bench run`: W emulated workers exchange a model with an appliance
//! for R timed rounds; per-round statistics, appliance throughput and CPU,
//! efficiency against a ceiling measured in the same run, JSON, table,
//! sweeps and plots.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use phub_proto::routes::control;
use phub_proto::spec::Consistency;
use phub_worker::FaultSpec;
use serde::Serialize;

use super::ceiling::{self, Ceilings, Forward, VethCeiling};
use super::emulate::{self, Event, Outcome, Plan};
use super::failover::{FailoverArgs, FailoverFigures, Kill};
use super::local::{self, Local, LocalOptions};
use super::plot;
use super::racks::{Fabric, RackArgs, RackFigures};
use crate::profiles::{self, Profile};
use crate::stats::summarize;
use crate::sys::{self, Machine};

/// Packet I/O backend of a local appliance: the dataplane's own type.
pub use phub_proto::api::BackendKind as Backend;

/// How the emulated workers call the worker library.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `Worker::exchange`: every key's push_pull in one exchange, buffers lent.
    Exchange,
    /// `Worker::push_pull` on every key, then `Worker::wait` on every handle.
    Handles,
}

/// What `--sweep` varies.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sweep {
    /// The variable.
    pub variable: SweepVariable,
    /// The values, as given.
    pub values: Vec<String>,
}

/// A variable `--sweep` can vary (serialised and shown in lower case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SweepVariable {
    /// `--workers`.
    Workers,
    /// `--chunk-bytes`.
    Chunk,
    /// `--lcores`.
    Lcores,
    /// `--window`.
    Window,
    /// `--model`.
    Model,
}

impl SweepVariable {
    /// The name, as `--sweep` takes it.
    pub const fn name(self) -> &'static str {
        match self {
            SweepVariable::Workers => "workers",
            SweepVariable::Chunk => "chunk",
            SweepVariable::Lcores => "lcores",
            SweepVariable::Window => "window",
            SweepVariable::Model => "model",
        }
    }
}

impl std::fmt::Display for SweepVariable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SweepVariable {
    type Err = String;

    fn from_str(s: &str) -> Result<SweepVariable, String> {
        match s.trim() {
            "workers" | "w" => Ok(SweepVariable::Workers),
            "chunk" | "chunk-bytes" | "chunk_bytes" => Ok(SweepVariable::Chunk),
            "lcores" => Ok(SweepVariable::Lcores),
            "model" => Ok(SweepVariable::Model),
            "window" => Ok(SweepVariable::Window),
            v => Err(format!(
                "--sweep {v:?}: accepted variables: workers, chunk, lcores, window, model"
            )),
        }
    }
}

/// Parses `workers=1,2,4`, `chunk=1024,8192`, `lcores=1,2` or `model=a,b`.
pub fn parse_sweep(s: &str) -> Result<Sweep, String> {
    let (var, list) = s.split_once('=').ok_or_else(|| {
        format!("{s:?}: expected VARIABLE=V1,V2,... (workers, chunk, lcores, window or model)")
    })?;
    let variable: SweepVariable = var.parse()?;
    let values: Vec<String> = list
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if values.is_empty() {
        return Err(format!("--sweep {s:?}: no values"));
    }
    if variable != SweepVariable::Model {
        for v in &values {
            if v.parse::<u64>().map_or(true, |n| n == 0) {
                return Err(format!("--sweep {variable}={v}: expected positive integers"));
            }
        }
    }
    Ok(Sweep { variable, values })
}

/// Serialises a value as its `Display` text (how `--consistency` and
/// `--inject` are written in the JSON's `arguments`).
pub(crate) fn as_text<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// [`as_text`] of an optional value (null when `None`).
#[allow(clippy::ref_option)] // serde's serialize_with hands a &Option.
fn as_text_opt<T: std::fmt::Display, S: serde::Serializer>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.collect_str(v),
        None => s.serialize_none(),
    }
}

/// `phub-bench run` options.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct RunArgs {
    /// Start phub-dataplane and phub-control here (the default without --control).
    #[arg(long, conflicts_with = "control")]
    pub local: bool,
    /// Packet I/O backend of the local dataplane.
    #[arg(long, value_parser = phub_dataplane::config::backend_parser(), default_value_t = Backend::Udp)]
    pub backend: Backend,
    /// Use a running appliance through phub-control at URL.
    #[arg(long, value_name = "URL")]
    pub control: Option<String>,
    /// Model: resnet50, vgg16, bert-large, synthetic:N or uniform:K:N.
    #[arg(long)]
    pub model: String,
    /// Emulated workers W.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Timed rounds per worker.
    #[arg(long, default_value_t = 10)]
    pub rounds: u32,
    /// Untimed rounds before them.
    #[arg(long, default_value_t = 2)]
    pub warmup: u32,
    /// Check every result exactly (sum mode, small-integer gradients).
    #[arg(long)]
    pub verify: bool,
    /// Write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// One process per worker instead of one thread.
    #[arg(long)]
    pub procs: bool,
    /// Dataplane queues (lcore threads) of the local appliance.
    #[arg(long, default_value_t = 1)]
    pub lcores: usize,
    /// Payload bytes per chunk (multiple of 64, at most 8832).
    #[arg(long, default_value_t = 8192)]
    pub chunk_bytes: u32,
    /// Worker window in chunks (default: the worker library's own choice).
    #[arg(long)]
    pub window: Option<usize>,
    /// Repeat the run for each value: workers=1,2,4 | chunk=1024,8192 | lcores=1,2 | window=64,256 | model=A,B.
    #[arg(long, value_parser = parse_sweep)]
    pub sweep: Option<Sweep>,
    /// Plot round time and goodput against the swept variable (.svg, or .png rendered with resvg).
    #[arg(long, value_name = "FILE", requires = "sweep")]
    pub plot: Option<PathBuf>,
    /// Run phub-dataplane and phub-control from DIR instead of this program.
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Skip the same-run loopback ceilings (efficiency is then null).
    #[arg(long)]
    pub no_ceiling: bool,
    /// Rounds of each ceiling measurement (the median is used).
    #[arg(long, default_value_t = 3)]
    pub ceiling_rounds: u32,
    /// Seconds the veth ceiling's senders run (`--local --backend dpdk`).
    #[arg(long, default_value_t = 3.0)]
    pub ceiling_secs: f64,
    /// Local dataplane: spin on empty queues.
    #[arg(long)]
    pub busy_poll: bool,
    /// Local dataplane: do not pin lcore threads to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// Local dataplane: socket buffer per queue, bytes.
    #[arg(long)]
    pub socket_buffer: Option<usize>,
    /// Local dataplane: one more argument for phub-dataplane, as is
    /// (repeatable; e.g. `--dataplane-arg=--eal-arg=--no-huge` with `--backend dpdk`).
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub dataplane_arg: Vec<String>,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// How workers call the library: `exchange` lends the gradient and output
    /// buffers (Worker::exchange), `handles` copies them (push_pull + wait).
    #[arg(long, value_enum, default_value_t = Api::Exchange)]
    pub api: Api,
    /// Turn UDP GSO sends off in the workers, the local dataplane and the ceiling.
    #[arg(long)]
    pub no_gso: bool,
    /// Turn UDP GRO receives off in the workers, the local dataplane and the ceiling.
    #[arg(long)]
    pub no_gro: bool,
    /// Inject faults: every emulated worker loses, duplicates and reorders
    /// what it sends and receives at these rates, and with --local so does
    /// the dataplane (both directions); e.g. `loss=0.05,dup=0.01,reorder=0.01,seed=3`.
    #[arg(long, value_name = "SPEC")]
    #[serde(serialize_with = "as_text_opt")]
    pub inject: Option<FaultSpec>,
    /// Workers pass chunks and results through shared memory with the
    /// dataplane on this host, sending headers only: with --local the
    /// dataplane starts with --shm; with --control it must run here with
    /// --shm. Kernel UDP only (not with --backend dpdk).
    #[arg(long)]
    pub shm: bool,
    /// Also run the same exchange (model, workers, rounds) through a peer
    /// in the same run: `tcp-ps`, a plain TCP parameter server (one
    /// process, keys of at most 4 MB, summed and answered when all W have
    /// pushed), and report phub's speed-up over it.
    #[arg(long, value_enum)]
    pub baseline: Option<BaselineKind>,
    /// The job's consistency: `bsp` (default), `async`, or `ssp:TAU`
    /// (bounded delay TAU). Not with --verify outside bsp.
    #[arg(long, default_value = "bsp")]
    #[serde(serialize_with = "as_text")]
    pub consistency: Consistency,
    /// Emulated compute before each round's exchange, ms per worker.
    #[arg(long, default_value_t = 0.0)]
    pub compute_ms: f64,
    /// Random jitter added to each round's compute: `exp:M` (exponential,
    /// mean M ms, seeded per rank).
    #[arg(long, value_name = "exp:M", value_parser = crate::bench::emulate::parse_exp_jitter)]
    pub jitter: Option<f64>,
    /// Rank 0's compute and jitter are multiplied by this (a persistent
    /// straggler), e.g. 2.
    #[arg(long, default_value_t = 1.0)]
    pub slow_rank0: f64,
    /// Occasional slow rounds: `p=P,x=X`, with probability P a round's
    /// compute (jitter included) takes X times as long (seeded per rank).
    #[arg(long, value_name = "p=P,x=X")]
    pub spike: Option<emulate::Spike>,
    /// Virtual racks (`--racks R` and what goes with it).
    #[command(flatten)]
    #[serde(flatten)]
    pub rack: RackArgs,
    /// Replicas and a kill of one appliance (virtual racks only).
    #[command(flatten)]
    #[serde(flatten)]
    pub failover: FailoverArgs,
}

/// The spec's `consistency` value for `--consistency` (none for BSP, the
/// default).
fn consistency_json(c: Consistency) -> Option<serde_json::Value> {
    (c != Consistency::Sync).then(|| serde_json::json!(c))
}

/// The same-run peers `--baseline` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BaselineKind {
    /// A plain TCP parameter server (`bench::tcp_ps`).
    TcpPs,
}

/// One run's figures (one point of a sweep).
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// Model name.
    pub model: String,
    /// Parameters.
    pub model_elements: u64,
    /// Bytes per worker per round (f32).
    pub model_bytes: u64,
    /// Tensors (keys).
    pub tensors: usize,
    /// W.
    pub workers: usize,
    /// `udp` or `dpdk` (what the dataplane reports; the asked one with --local).
    pub backend: String,
    /// Dataplane lcores holding the job's chunks.
    pub lcores: usize,
    /// Payload bytes per chunk.
    pub chunk_bytes: u32,
    /// Chunks per worker per round.
    pub chunks: u64,
    /// Timed rounds.
    pub rounds: u32,
    /// Warm-up rounds.
    pub warmup: u32,
    /// Workers were processes (else threads).
    pub procs: bool,
    /// `exchange` or `handles`.
    pub api: Api,
    /// Every worker exchanged through shared memory (`--shm`); the
    /// appliance's byte counters and GB/s then count headers only.
    pub shm: bool,
    /// Median exchange time of a round (all workers' rounds), ms.
    pub round_ms_median: f64,
    /// 99th percentile (nearest rank), ms.
    pub round_ms_p99: f64,
    /// Fastest round, ms.
    pub round_ms_min: f64,
    /// Mean round, ms.
    pub round_ms_mean: f64,
    /// Slowest round, ms.
    pub round_ms_max: f64,
    /// Model bytes per second per worker at the median round, GB/s.
    pub goodput_gbps: f64,
    /// Bytes the appliance received per second over the timed rounds, GB/s.
    pub appliance_gbps_in: Option<f64>,
    /// Bytes the appliance sent per second over the timed rounds, GB/s.
    pub appliance_gbps_out: Option<f64>,
    /// bound round time / median round time (1.0 = as fast as the bound).
    pub efficiency: Option<f64>,
    /// What `efficiency` is measured against.
    pub efficiency_bound: String,
    /// The bound's round time, ms.
    pub bound_round_ms: Option<f64>,
    /// The same-run ceilings.
    pub ceilings: Option<Ceilings>,
    /// `--local --backend dpdk`: the veth path's ceiling with testpmd
    /// 5tswap (every frame echoed back to its sender, which counts it; same
    /// senders, same run); `efficiency` is `appliance_gbps_in` over its
    /// `payload_gbps` (`efficiency_bound`: "testpmd-5tswap").
    pub veth_echo_ceiling: Option<VethCeiling>,
    /// `--local --backend dpdk`: the veth path's ceiling with testpmd
    /// rxonly (same senders, same run).
    pub veth_ceiling: Option<VethCeiling>,
    /// `--local --backend dpdk`: `appliance_gbps_in` over `veth_ceiling`'s
    /// `payload_gbps` (the rxonly ceiling), a second figure beside
    /// `efficiency`.
    pub efficiency_rxonly: Option<f64>,
    /// Wall time of the timed phase (all workers), s.
    pub timed_secs: f64,
    /// CPU seconds of the dataplane process over the timed rounds.
    pub appliance_cpu_s: Option<f64>,
    /// CPU seconds of the dataplane per GB (1e9 bytes) it received (null
    /// with `--shm`: its sockets carry headers only).
    pub appliance_cpu_s_per_gb: Option<f64>,
    /// CPU seconds of the workers over the timed rounds (all of them).
    pub workers_cpu_s: Option<f64>,
    /// Workers' CPU seconds per GB (1e9 bytes) of gradients they pushed
    /// over the timed rounds (model bytes x W x rounds).
    pub workers_cpu_s_per_gb: Option<f64>,
    /// `--baseline`: its name, null without.
    pub baseline: Option<String>,
    /// The baseline's median round, same model, workers and rounds, ms.
    pub baseline_round_ms_median: Option<f64>,
    /// baseline median round / phub's median round (> 1: phub is faster).
    pub speedup_vs_baseline: Option<f64>,
    /// The baseline's whole measurement.
    pub baseline_detail: Option<super::tcp_ps::Baseline>,
    /// `bsp`, `async` or `ssp:TAU`.
    pub consistency: String,
    /// Emulated compute per round, ms (`--compute-ms`), and the mean of its
    /// exponential jitter (`--jitter exp:M`).
    pub compute_ms: f64,
    /// Mean of the exponential jitter, ms.
    pub jitter_exp_ms: f64,
    /// `--spike p=P,x=X`, null without.
    pub spike: Option<emulate::Spike>,
    /// Timed rounds per second of each rank (its rounds over its own timed
    /// wall time, compute included).
    pub rounds_per_s_per_rank: Vec<f64>,
    /// Timed rounds per second, all ranks together over the slowest rank's
    /// wall time, divided by W (a rank's average rate).
    pub rounds_per_s: f64,
    /// Share of the ranks' timed wall time spent waiting in the exchange.
    pub blocked_fraction: f64,
    /// The largest lead (clocks) the dataplane ever let a rank have
    /// (bounded delay and async jobs; null for bsp).
    pub max_lead_observed: Option<u32>,
    /// Dataplane CPU per timed round, ms.
    pub appliance_cpu_ms_per_round: Option<f64>,
    /// Workers' CPU per timed round (all workers), ms.
    pub workers_cpu_ms_per_round: Option<f64>,
    /// CPU seconds per thread name over the timed rounds: the dataplane's
    /// threads (`dp:` prefix) and, with worker threads, this process's.
    pub thread_cpu_s: std::collections::BTreeMap<String, f64>,
    /// true / false when --verify, null otherwise.
    pub verified: Option<bool>,
    /// Elements that differed, all workers.
    pub mismatches: u64,
    /// The first difference.
    pub first_mismatch: Option<String>,
    /// Worker window, chunks.
    pub window: usize,
    /// The fault spec injected (`--inject`), in full; null when off.
    pub inject: Option<String>,
    /// Faults the workers injected, all workers, warm-up included.
    pub worker_injected: Injected,
    /// Retransmissions, all workers, warm-up included.
    pub retransmits: u64,
    /// The part of `retransmits` that were fast retransmissions.
    pub fast_retransmits: u64,
    /// Chunks sent for the first time, all workers, warm-up included.
    pub chunks_sent: u64,
    /// RESULTs ignored (duplicates), all workers, warm-up included.
    pub results_ignored: u64,
    /// PULLs stalled workers sent to lcores they had nothing out on, to
    /// learn whether one was restored behind them (PROTOCOL.md §6.1), all
    /// workers, warm-up included.
    pub lcores_probed: u64,
    /// Those PULLs that found their lcore restored behind.
    pub lcores_found_behind: u64,
    /// Dataplane counters over the timed rounds.
    pub appliance: Option<Counters>,
    /// Every timed round of every worker, ms (`[rank][round]`).
    pub round_ms: Vec<Vec<f64>>,
    /// The virtual racks' figures (`--racks`).
    #[serde(flatten)]
    pub racks: RackFigures,
    /// `--replicas` and `--kill-appliance`'s figures.
    #[serde(flatten)]
    pub failover: FailoverFigures,
}

/// Datagrams a fault injector lost, duplicated and held back.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Injected {
    /// Lost.
    pub drops: u64,
    /// Duplicated.
    pub dups: u64,
    /// Held back behind later ones.
    pub reorders: u64,
    /// Held back for the spec's `delay_ms`.
    pub delays: u64,
}

impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} lost, {} duplicated, {} reordered, {} delayed",
            self.drops, self.dups, self.reorders, self.delays
        )
    }
}

/// Dataplane counter deltas.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    /// Datagrams received.
    pub rx_packets: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Datagrams sent.
    pub tx_packets: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Stored results sent again.
    pub results_resent: u64,
    /// Partial sums sent to their homes the first time (hierarchical
    /// jobs).
    pub partials_sent: u64,
    /// Partial sums sent again, their home's answer late.
    pub partials_resent: u64,
    /// Aggregates sent to backups the first time (replicated jobs).
    pub replicates_sent: u64,
    /// Aggregates sent again, a backup's acknowledgement late.
    pub replicates_resent: u64,
    /// Drops, all reasons.
    pub drops: u64,
    /// Drops by reason.
    pub drops_by_reason: std::collections::BTreeMap<String, u64>,
    /// Faults the dataplane's injector caused (`--inject` with `--local`).
    pub injected: Injected,
    /// The spin the kernel-UDP lcores used at the end of the rounds
    /// (`--spin-us`; `auto` sets it as the machine allows), microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spin_us: Option<u64>,
}

fn dataplane_counters(control_url: &str) -> Option<(String, Counters)> {
    let client = local::control_client(control_url, None, Duration::from_secs(10)).ok()?;
    let dp = client.send(&control::stats()).ok()?.dataplane?;
    let t = dp.total();
    let c = Counters {
        rx_packets: t.rx_packets,
        rx_bytes: t.rx_bytes,
        tx_packets: t.tx_packets,
        tx_bytes: t.tx_bytes,
        results_resent: t.results_resent,
        partials_sent: t.partials_sent,
        partials_resent: t.partials_resent,
        replicates_sent: t.replicates_sent,
        replicates_resent: t.replicates_resent,
        drops: t.drops.values().sum(),
        drops_by_reason: t.drops,
        injected: Injected {
            drops: t.injected_drops,
            dups: t.injected_dups,
            reorders: t.injected_reorders,
            delays: t.injected_delays,
        },
        spin_us: dp.spin_us,
    };
    let backend = dp.backend.name().to_string();
    Some((backend, c))
}

impl Counters {
    fn delta(&self, before: &Counters) -> Counters {
        Counters {
            rx_packets: self.rx_packets.saturating_sub(before.rx_packets),
            rx_bytes: self.rx_bytes.saturating_sub(before.rx_bytes),
            tx_packets: self.tx_packets.saturating_sub(before.tx_packets),
            tx_bytes: self.tx_bytes.saturating_sub(before.tx_bytes),
            results_resent: self.results_resent.saturating_sub(before.results_resent),
            partials_sent: self.partials_sent.saturating_sub(before.partials_sent),
            partials_resent: self.partials_resent.saturating_sub(before.partials_resent),
            replicates_sent: self.replicates_sent.saturating_sub(before.replicates_sent),
            replicates_resent: self.replicates_resent.saturating_sub(before.replicates_resent),
            drops: self.drops.saturating_sub(before.drops),
            drops_by_reason: self
                .drops_by_reason
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v.saturating_sub(before.drops_by_reason.get(k).copied().unwrap_or(0)),
                    )
                })
                .filter(|(_, v)| *v > 0)
                .collect(),
            injected: Injected {
                drops: self.injected.drops.saturating_sub(before.injected.drops),
                dups: self.injected.dups.saturating_sub(before.injected.dups),
                reorders: self.injected.reorders.saturating_sub(before.injected.reorders),
                delays: self.injected.delays.saturating_sub(before.injected.delays),
            },
            spin_us: self.spin_us,
        }
    }
}

/// A message from a worker (thread or process) to the coordinator.
enum Msg {
    Event(Event),
    Done(Box<Outcome>),
    Failed(u16, String),
}

/// The start gate after warm-up: `Some(true)` go, `Some(false)` abort.
type Gate = Arc<(Mutex<Option<bool>>, Condvar)>;

fn gate_wait(g: &Gate) -> bool {
    let (m, c) = &**g;
    let mut v = m.lock().unwrap_or_else(|e| e.into_inner());
    while v.is_none() {
        v = c.wait(v).unwrap_or_else(|e| e.into_inner());
    }
    v.unwrap_or(false)
}

fn gate_open(g: &Gate, go: bool) {
    let (m, c) = &**g;
    *m.lock().unwrap_or_else(|e| e.into_inner()) = Some(go);
    c.notify_all();
}

/// `phub-bench bench-worker --plan JSON`: one worker process. Prints one
/// JSON line per event; after `Ready` waits for a `go` line on stdin.
pub fn worker_process(plan_json: &str) -> Result<()> {
    #[derive(Serialize)]
    enum Line<'a> {
        Event(&'a Event),
        Done(&'a Outcome),
        Failed(String),
    }
    let plan: Plan = serde_json::from_str(plan_json).context("parsing --plan")?;
    let profile = profiles::load(&plan.model)?;
    let out = std::io::stdout();
    let emit = |l: Line<'_>| {
        let mut o = out.lock();
        let _ = writeln!(o, "{}", serde_json::to_string(&l).unwrap_or_default());
        let _ = o.flush();
    };
    let r = emulate::run(
        &plan,
        &profile,
        |e| emit(Line::Event(&e)),
        || {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            line.trim() == "go"
        },
    );
    match r {
        Ok(o) => emit(Line::Done(&o)),
        Err(e) => {
            emit(Line::Failed(format!("{e:#}")));
            std::process::exit(1);
        }
    }
    Ok(())
}

#[derive(serde::Deserialize)]
enum ChildLine {
    Event(Event),
    Done(Box<Outcome>),
    Failed(String),
}

/// Runs one point: ceiling, appliance, job, workers. `--local --backend
/// dpdk` runs all of it inside the virtual rack's namespace.
fn run_point(a: &RunArgs, profile: &Profile, label: &str) -> Result<RunResult> {
    if a.rack.racks.is_some() {
        return super::racks::run_point(a, profile, label);
    }
    let mut r = if a.backend == Backend::Dpdk && a.control.is_none() {
        let net = local::VethNet::create()?;
        net.inside(|| run_point_here(a, profile, label, Some(&net.ns.name)))?
    } else {
        run_point_here(a, profile, label, None)?
    };
    if let Some(BaselineKind::TcpPs) = a.baseline {
        // Right after phub's rounds, on the same machine, same model,
        // workers and rounds.
        let b = super::tcp_ps::measure(profile, a.workers, a.rounds.max(1), a.warmup)
            .context("the tcp-ps baseline")?;
        r.baseline = Some(b.name.clone());
        r.baseline_round_ms_median = Some(b.round_ms_median);
        r.speedup_vs_baseline = Some(b.round_ms_median / r.round_ms_median);
        r.baseline_detail = Some(b);
    }
    Ok(r)
}

/// The job a run admits: its spec as JSON and parsed, and its chunks.
pub(super) struct Job {
    /// The spec, as sent to control.
    pub(super) json: serde_json::Value,
    /// The spec, parsed.
    pub(super) parsed: phub_proto::spec::JobSpec,
    /// Elements per chunk.
    pub(super) chunk_elems: u64,
    /// Chunks per worker per round.
    pub(super) chunks: u64,
}

impl Job {
    /// A dataplane memory budget that holds the whole job on `lcores`
    /// lcores by the dataplane's upper bounds, with room to spare.
    pub(super) fn budget(&self, lcores: usize, shm: bool) -> u64 {
        let model = phub_proto::memory::MemoryModel::default();
        let mut load = vec![0; lcores.max(1)];
        let lay = phub_proto::layout::layout(
            &self.parsed,
            &mut load,
            model.chunk_cost(&self.parsed, self.parsed.result_store(shm)),
        );
        model
            .job_cost(&self.parsed, &lay, self.parsed.result_store(shm))
            .total()
            + (64 << 20)
    }
}

/// The job for `profile` with `a`'s workers, chunk size and consistency.
pub(super) fn job_spec(a: &RunArgs, profile: &Profile, label: &str) -> Result<Job> {
    ensure!(
        a.workers >= 1 && a.workers <= 256,
        "--workers {}: expected 1 to 256",
        a.workers
    );
    ensure!(
        a.lcores >= 1 && a.lcores <= 256,
        "--lcores {}: expected 1 to 256",
        a.lcores
    );
    let mut json = profile.job_json(&format!("phub-bench {label}"), a.workers, a.chunk_bytes);
    if let (Some(c), Some(o)) = (consistency_json(a.consistency), json.as_object_mut()) {
        o.insert("consistency".into(), c);
    }
    Job::new(json, profile)
}

impl Job {
    /// The job of spec `json`, for `profile`'s tensors (one key each).
    pub(super) fn new(json: serde_json::Value, profile: &Profile) -> Result<Job> {
        let parsed =
            phub_proto::spec::JobSpec::from_json(&json.to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let chunk_elems = u64::from(parsed.chunk_elems());
        let chunks: u64 = profile
            .tensors
            .iter()
            .map(|t| t.elements.div_ceil(chunk_elems))
            .sum();
        Ok(Job {
            json,
            parsed,
            chunk_elems,
            chunks,
        })
    }
}

/// One point, on the calling thread's network (`veth`: the virtual rack's
/// namespace, which that thread is inside).
fn run_point_here(a: &RunArgs, profile: &Profile, label: &str, veth: Option<&str>) -> Result<RunResult> {
    let job = job_spec(a, profile, label)?;
    let (spec, chunk_elems, chunks) = (&job.json, job.chunk_elems, job.chunks);
    // On the virtual rack the bound is the veth path's, measured after the run.
    let ceilings = if a.no_ceiling || veth.is_some() {
        None
    } else {
        let c = ceiling::measure(&ceiling::Setup {
            workers: a.workers,
            lcores: a.lcores,
            profile_bytes: profile.bytes_f32(),
            chunk_bytes: a.chunk_bytes as usize,
            rounds: a.ceiling_rounds.max(1),
            window: a.window,
            chunks,
            gso: !a.no_gso,
            gro: !a.no_gro,
        })?;
        Some(c)
    };
    let mut local = None;
    let control_url = match &a.control {
        Some(u) => u.trim_end_matches('/').to_string(),
        None => {
            let budget = job.budget(a.lcores, a.shm);
            let mut extra_args = a.dataplane_arg.clone();
            if let Some(spec) = &a.inject {
                extra_args.extend(["--inject".to_string(), spec.to_string()]);
            }
            let l = Local::start(&LocalOptions {
                lcores: a.lcores,
                backend: a.backend.name().to_string(),
                memory_budget: budget,
                bin_dir: a.bin_dir.clone(),
                busy_poll: a.busy_poll,
                no_pin: a.no_pin,
                socket_buffer: a.socket_buffer,
                shm: a.shm,
                veth: veth.map(str::to_string),
                extra_args,
                env: [("PHUB_UDP_GSO", a.no_gso), ("PHUB_UDP_GRO", a.no_gro)]
                    .into_iter()
                    .filter(|(_, off)| *off)
                    .map(|(k, _)| (k.to_string(), "0".to_string()))
                    .collect(),
            })?;
            let u = l.control_url.clone();
            local = Some(l);
            u
        }
    };
    let token = match &local {
        Some(l) => Some(l.operator_token()?),
        None => local::env_operator_token(),
    };
    let admitted = local::admit(&control_url, &spec.to_string(), token.as_deref())?;
    let r = drive(
        a,
        profile,
        &control_url,
        &admitted,
        local.as_ref(),
        chunks,
        ceilings,
        &Fabric::default(),
        None,
    );
    local::evict(&control_url, admitted.id, token.as_deref());
    if let Some(l) = local {
        l.stop();
    }
    match (r, veth) {
        (Ok(r), Some(ns)) if !a.no_ceiling => Ok(with_veth_ceiling(a, profile, chunk_elems, r, ns)),
        (r, _) => r,
    }
}

/// `--local --backend dpdk`: the veth path's ceilings, measured now (the
/// dataplane has stopped) on the same port with the same senders, rxonly
/// then 5tswap ([`ceiling::veth_testpmd`]), and the efficiency as phub's
/// gradient ingress over each: `efficiency` over 5tswap (the bound: it
/// also sends every frame back, as phub sends every result),
/// `efficiency_rxonly` over rxonly. A ceiling that cannot be measured
/// leaves its efficiency null and says why (testpmd is stopped and its
/// files removed either way; the namespace goes with the caller's
/// `VethNet`).
fn with_veth_ceiling(
    a: &RunArgs,
    profile: &Profile,
    chunk_elems: u64,
    mut r: RunResult,
    ns: &str,
) -> RunResult {
    let datagrams = profile
        .tensors
        .iter()
        .flat_map(|t| {
            (0..t.elements.div_ceil(chunk_elems)).map(move |c| {
                let elems = (t.elements - c * chunk_elems).min(chunk_elems);
                phub_proto::wire::HEADER_LEN + elems as usize * 4
            })
        })
        .collect();
    let setup = ceiling::VethSetup {
        workers: a.workers,
        lcores: a.lcores,
        datagrams,
        secs: a.ceiling_secs,
        gso: !a.no_gso,
        gro: !a.no_gro,
        window: a.window,
        chunks: r.chunks,
        pin: !a.no_pin,
        ns: ns.to_string(),
    };
    let over = |c: &VethCeiling| {
        r.appliance_gbps_in
            .filter(|_| c.payload_gbps > 0.0)
            .map(|g| g / c.payload_gbps)
    };
    match ceiling::veth_testpmd(&setup, Forward::RxOnly) {
        Ok(c) => {
            r.efficiency_rxonly = over(&c);
            r.veth_ceiling = Some(c);
        }
        Err(e) => eprintln!("phub-bench: no rxonly veth ceiling: {e:#}"),
    }
    match ceiling::veth_testpmd(&setup, Forward::FiveTupleSwap) {
        Ok(c) => {
            r.efficiency = over(&c);
            r.efficiency_bound = Forward::FiveTupleSwap.bound_name().into();
            r.veth_echo_ceiling = Some(c);
        }
        Err(e) => {
            eprintln!("phub-bench: no 5tswap veth ceiling: {e:#}");
            r.efficiency_bound = format!("none: the 5tswap veth ceiling could not be measured: {e:#}");
        }
    }
    r
}

/// Starts the workers (each in its `fabric` namespace, if any), runs the
/// rounds, collects the figures; with `kill`, kills an appliance when the
/// workers reach its round and measures the failover.
#[allow(clippy::too_many_arguments)] // the run's parts, each owned elsewhere
pub(super) fn drive(
    a: &RunArgs,
    profile: &Profile,
    control_url: &str,
    admitted: &phub_proto::api::AdmitResponse,
    local: Option<&Local>,
    chunks: u64,
    ceilings: Option<Ceilings>,
    fabric: &Fabric<'_>,
    mut kill: Option<&mut Kill<'_>>,
) -> Result<RunResult> {
    let w = a.workers;
    let total_rounds = u64::from(a.warmup + a.rounds) * w as u64;
    let bar = if a.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total_rounds).with_style(
            ProgressStyle::with_template("  [{bar:40}] {pos}/{len} worker-rounds {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        )
    };
    bar.set_message("joining");
    let (tx, rx) = mpsc::channel::<Msg>();
    let gate: Gate = Arc::new((Mutex::new(None), Condvar::new()));
    let plans: Vec<Plan> = (0..w)
        .map(|rank| Plan {
            control_url: control_url.to_string(),
            job: admitted.id,
            token: admitted.token,
            rank: rank as u16,
            model: profile.name.clone(),
            warmup: a.warmup,
            rounds: a.rounds,
            verify: a.verify,
            window: a.window,
            exchange: a.api == Api::Exchange,
            gso: !a.no_gso,
            gro: !a.no_gro,
            inject: a.inject.as_ref().map(ToString::to_string),
            shm: a.shm,
            compute_ms: a.compute_ms,
            jitter_exp_ms: a.jitter.unwrap_or(0.0),
            compute_factor: if rank == 0 { a.slow_rank0 } else { 1.0 },
            spike: a.spike,
            rack: fabric.rack_of(rank as u16),
        })
        .collect();
    let mut threads = Vec::new();
    let mut children = Vec::new();
    if a.procs {
        let me = std::env::current_exe()?;
        for plan in &plans {
            let mut cmd = match fabric.ns_of(plan.rank) {
                Some(ns) => {
                    let mut c = Command::new("ip");
                    c.args(["netns", "exec", ns]).arg(&me);
                    c
                }
                None => Command::new(&me),
            };
            let mut child = cmd
                .args(["bench-worker", "--plan", &serde_json::to_string(plan)?])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .context("starting a worker process")?;
            let out = child.stdout.take().context("worker stdout")?;
            let (tx, rank) = (tx.clone(), plan.rank);
            threads.push(std::thread::spawn(move || {
                let mut finished = false;
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    let msg = match serde_json::from_str::<ChildLine>(&line) {
                        Ok(ChildLine::Event(e)) => Msg::Event(e),
                        Ok(ChildLine::Done(o)) => {
                            finished = true;
                            Msg::Done(o)
                        }
                        Ok(ChildLine::Failed(m)) => {
                            finished = true;
                            Msg::Failed(rank, m)
                        }
                        Err(_) => continue,
                    };
                    let _ = tx.send(msg);
                }
                if !finished {
                    let _ = tx.send(Msg::Failed(
                        rank,
                        "the worker process ended without a result".into(),
                    ));
                }
            }));
            children.push(child);
        }
    } else {
        for plan in plans {
            let (tx, gate) = (tx.clone(), Arc::clone(&gate));
            let profile = profile.clone();
            let ns = fabric.ns_of(plan.rank).map(str::to_string);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("bench-worker-{}", plan.rank))
                    .spawn(move || {
                        let rank = plan.rank;
                        if let Some(Err(e)) = ns.map(|n| phub_hwtests::virt::try_enter_netns(&n)) {
                            let _ = tx.send(Msg::Failed(rank, e));
                            return;
                        }
                        let tx2 = tx.clone();
                        let r = emulate::run(
                            &plan,
                            &profile,
                            |e| {
                                let _ = tx2.send(Msg::Event(e));
                            },
                            || gate_wait(&gate),
                        );
                        let _ = tx.send(match r {
                            Ok(o) => Msg::Done(Box::new(o)),
                            Err(e) => Msg::Failed(rank, format!("{e:#}")),
                        });
                    })
                    .context("starting a worker thread")?,
            );
        }
    }
    drop(tx);
    let dp_pid = local.map(|l| l.dataplane.pid());
    let mut ready = 0;
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut failure: Option<String> = None;
    let mut before = None;
    let mut started = Instant::now();
    let mut cpu0 = (None, None);
    let mut threads0 = (Default::default(), Default::default());
    let mut timed_secs = 0.0;
    let spine = |what: &str| {
        fabric.spine_bytes.and_then(|f| {
            f().map_err(|e| eprintln!("phub-bench: the spine's byte counters {what}: {e:#}"))
                .ok()
        })
    };
    let (mut spine0, mut spine1) = (None, None);
    while outcomes.len() + usize::from(failure.is_some()) < w {
        // After a kill, control is asked for the epoch (and, with a
        // restart, for full strength) between messages.
        let msg = match kill.as_deref_mut() {
            Some(k) if k.awaits_control() => {
                k.poll(control_url, admitted.id);
                match rx.recv_timeout(Duration::from_millis(5)) {
                    Ok(m) => m,
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            _ => match rx.recv() {
                Ok(m) => m,
                Err(_) => break,
            },
        };
        match msg {
            Msg::Event(Event::Ready) => {
                ready += 1;
                if ready == w {
                    bar.set_message("timed rounds");
                    before = dataplane_counters(control_url);
                    spine0 = spine("before the timed rounds");
                    cpu0 = (dp_pid.and_then(sys::cpu_seconds), workers_cpu(a.procs, &children));
                    threads0 = (
                        dp_pid.map(sys::thread_cpu_seconds).unwrap_or_default(),
                        sys::thread_cpu_seconds(std::process::id()),
                    );
                    started = Instant::now();
                    if a.procs {
                        for c in &mut children {
                            if let Some(s) = c.stdin.as_mut() {
                                let _ = writeln!(s, "go");
                                let _ = s.flush();
                            }
                        }
                    } else {
                        gate_open(&gate, true);
                    }
                }
            }
            Msg::Event(Event::Round { round, timed, ms }) => {
                if let Some(k) = kill.as_deref_mut() {
                    k.on_round(round, ms);
                }
                bar.inc(1);
                let phase = if timed { "timed" } else { "warm-up" };
                bar.set_message(format!("{phase} round {round}: {ms:.1} ms"));
            }
            Msg::Done(o) => {
                outcomes.push(*o);
                if outcomes.len() == w {
                    timed_secs = started.elapsed().as_secs_f64();
                    spine1 = spine("after the timed rounds");
                }
            }
            Msg::Failed(rank, m) => {
                failure = Some(format!("worker {rank}: {m}"));
                gate_open(&gate, false);
                for c in &mut children {
                    let _ = c.kill();
                }
                break;
            }
        }
    }
    let cpu1 = (
        dp_pid.and_then(sys::cpu_seconds),
        if a.procs {
            None
        } else {
            workers_cpu(false, &children)
        },
    );
    let threads1 = (
        dp_pid.map(sys::thread_cpu_seconds).unwrap_or_default(),
        sys::thread_cpu_seconds(std::process::id()),
    );
    let after = dataplane_counters(control_url);
    bar.finish_and_clear();
    for c in &mut children {
        if let Some(s) = c.stdin.take() {
            drop(s);
        }
        let _ = c.wait();
    }
    for t in threads {
        let _ = t.join();
    }
    if let Some(f) = failure {
        bail!("{f}");
    }
    ensure!(
        outcomes.len() == w,
        "only {} of {w} workers reported",
        outcomes.len()
    );
    outcomes.sort_by_key(|o| o.rank);
    let all: Vec<f64> = outcomes.iter().flat_map(|o| o.round_ms.iter().copied()).collect();
    let s = summarize(&all);
    let model_bytes = profile.bytes_f32();
    let (backend, counters) = match (&before, &after) {
        (Some((b, x)), Some((_, y))) => (b.clone(), Some(y.delta(x))),
        _ => (a.backend.name().to_string(), None),
    };
    let gb = |bytes: u64| bytes as f64 / 1e9;
    let appliance_cpu_s = cpu0.0.zip(cpu1.0).map(|(x, y)| y - x);
    let workers_cpu_s = if a.procs {
        let v: Vec<f64> = outcomes.iter().filter_map(|o| o.cpu_s).collect();
        (v.len() == w).then(|| v.iter().sum())
    } else {
        cpu0.1.zip(cpu1.1).map(|(x, y)| y - x)
    };
    let mut thread_cpu_s: std::collections::BTreeMap<String, f64> = sys::cpu_delta(&threads0.0, &threads1.0)
        .into_iter()
        .map(|(k, v)| (format!("dp:{k}"), v))
        .collect();
    if !a.procs {
        thread_cpu_s.extend(sys::cpu_delta(&threads0.1, &threads1.1));
    }
    let rounds_f = f64::from(a.rounds.max(1));
    let verified = if a.verify {
        Some(outcomes.iter().all(|o| o.verified == Some(true)))
    } else {
        None
    };
    let failover = match kill {
        Some(k) => {
            let mismatched: Vec<u32> = outcomes
                .iter()
                .flat_map(|o| o.mismatched_rounds.iter().copied())
                .collect();
            let f = k.figures(control_url, admitted.id, a.warmup + a.rounds, &mismatched)?;
            if a.consistency == Consistency::Sync {
                f
            } else {
                // Not BSP: the appliances count updates, not rounds, and
                // the ranks' clocks need not agree; what is lost or
                // repeated is not counted here (PROTOCOL.md §11.10; the
                // engine's rules tests and the simulator check it).
                FailoverFigures {
                    rounds_repeated: None,
                    rounds_lost: None,
                    survivors_round_range: None,
                    ..f
                }
            }
        }
        None => FailoverFigures {
            replicas: a.failover.replicas,
            ..FailoverFigures::default()
        },
    };
    let (bound_round_ms, mut efficiency_bound) = match &ceilings {
        Some(c) => (Some(c.udp_echo_round_ms), c.describe_bound()),
        None => (None, "none (--no-ceiling)".to_string()),
    };
    if a.shm && ceilings.is_some() {
        efficiency_bound.push_str(" (a datagram bound; the workers used shared memory)");
    }
    Ok(RunResult {
        model: profile.name.clone(),
        model_elements: profile.elements(),
        model_bytes,
        tensors: profile.len(),
        workers: w,
        backend,
        lcores: admitted.lcores.len().max(1),
        chunk_bytes: a.chunk_bytes,
        chunks,
        rounds: a.rounds,
        warmup: a.warmup,
        procs: a.procs,
        api: a.api,
        shm: outcomes.iter().all(|o| o.stats.shm),
        round_ms_median: s.median,
        round_ms_p99: s.p99,
        round_ms_min: s.min,
        round_ms_mean: s.mean,
        round_ms_max: s.max,
        goodput_gbps: gb(model_bytes) / (s.median / 1e3),
        appliance_gbps_in: counters.as_ref().map(|c| gb(c.rx_bytes) / timed_secs),
        appliance_gbps_out: counters.as_ref().map(|c| gb(c.tx_bytes) / timed_secs),
        efficiency: bound_round_ms.map(|b| b / s.median),
        efficiency_bound,
        bound_round_ms,
        ceilings,
        veth_echo_ceiling: None,
        veth_ceiling: None,
        efficiency_rxonly: None,
        timed_secs,
        appliance_cpu_s,
        appliance_cpu_s_per_gb: match (appliance_cpu_s, &counters) {
            // With shared memory the sockets carry headers only.
            (Some(cpu), Some(c)) if c.rx_bytes > 0 && !a.shm => Some(cpu / gb(c.rx_bytes)),
            _ => None,
        },
        workers_cpu_s,
        workers_cpu_s_per_gb: workers_cpu_s.map(|c| c / (gb(model_bytes) * w as f64 * rounds_f)),
        baseline: None,
        baseline_round_ms_median: None,
        speedup_vs_baseline: None,
        baseline_detail: None,
        consistency: a.consistency.to_string(),
        compute_ms: a.compute_ms,
        jitter_exp_ms: a.jitter.unwrap_or(0.0),
        spike: a.spike,
        rounds_per_s_per_rank: outcomes
            .iter()
            .map(|o| o.round_ms.len() as f64 / o.timed_secs.max(1e-9))
            .collect(),
        rounds_per_s: {
            let slowest = outcomes
                .iter()
                .map(|o| o.timed_secs)
                .fold(0.0, f64::max)
                .max(1e-9);
            outcomes.iter().map(|o| o.round_ms.len() as f64).sum::<f64>() / slowest / w as f64
        },
        blocked_fraction: {
            let blocked: f64 = outcomes
                .iter()
                .map(|o| o.round_ms.iter().sum::<f64>() / 1e3)
                .sum();
            let wall: f64 = outcomes.iter().map(|o| o.timed_secs).sum();
            if wall > 0.0 {
                blocked / wall
            } else {
                0.0
            }
        },
        max_lead_observed: if a.consistency == Consistency::Sync {
            None
        } else {
            max_lead(control_url, admitted.id)
        },
        appliance_cpu_ms_per_round: appliance_cpu_s.map(|c| c * 1e3 / rounds_f),
        workers_cpu_ms_per_round: workers_cpu_s.map(|c| c * 1e3 / rounds_f),
        thread_cpu_s,
        verified,
        mismatches: outcomes.iter().map(|o| o.mismatches).sum(),
        first_mismatch: outcomes.iter().find_map(|o| o.first_mismatch.clone()),
        window: outcomes.first().map_or(0, |o| o.window),
        inject: a.inject.as_ref().map(ToString::to_string),
        worker_injected: Injected {
            drops: outcomes.iter().map(|o| o.stats.injected_drops).sum(),
            dups: outcomes.iter().map(|o| o.stats.injected_dups).sum(),
            reorders: outcomes.iter().map(|o| o.stats.injected_reorders).sum(),
            delays: outcomes.iter().map(|o| o.stats.injected_delays).sum(),
        },
        retransmits: outcomes.iter().map(|o| o.stats.retransmits).sum(),
        fast_retransmits: outcomes.iter().map(|o| o.stats.fast_retransmits).sum(),
        chunks_sent: outcomes.iter().map(|o| o.stats.chunks_sent).sum(),
        results_ignored: outcomes.iter().map(|o| o.stats.results_ignored).sum(),
        lcores_probed: outcomes.iter().map(|o| o.stats.lcores_probed).sum(),
        lcores_found_behind: outcomes.iter().map(|o| o.stats.lcores_found_behind).sum(),
        appliance: counters,
        round_ms: outcomes.iter().map(|o| o.round_ms.clone()).collect(),
        racks: RackFigures {
            cross_rack_bytes_per_round: spine0
                .zip(spine1)
                .map(|(x, y)| y.saturating_sub(x) as f64 / rounds_f),
            ..RackFigures::default()
        },
        failover,
    })
}

/// The largest lead the dataplane allowed in job `id`, from control's
/// `GET /v1/jobs/{id}`; None when it cannot be read.
fn max_lead(control_url: &str, id: u16) -> Option<u32> {
    let client = local::control_client(control_url, None, Duration::from_secs(5)).ok()?;
    client.send(&control::job(id)).ok()?.clock.max_lead
}

/// CPU seconds of the worker threads' process (threads mode only).
fn workers_cpu(procs: bool, _children: &[std::process::Child]) -> Option<f64> {
    if procs {
        None
    } else {
        sys::cpu_seconds(std::process::id())
    }
}

/// The run's context for the JSON report.
#[derive(Debug, Serialize)]
struct RunContext<'a> {
    tool: &'static str,
    machine: Machine,
    commit: String,
    date_unix_s: u64,
    arguments: &'a RunArgs,
    argv: Vec<String>,
    units: serde_json::Value,
}

fn context(a: &RunArgs) -> RunContext<'_> {
    RunContext {
        tool: "phub-bench run",
        machine: Machine::detect(),
        commit: sys::commit(),
        date_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        arguments: a,
        argv: std::env::args().collect(),
        units: serde_json::json!({
            "*_gbps": "GB/s = 1e9 bytes per second",
            "*_ms": "milliseconds",
            "goodput_gbps": "model bytes (f32) per second per worker, at the median round",
            "appliance_gbps_in/out": "UDP payload bytes the dataplane received/sent per second over the timed rounds",
            "efficiency": "bound_round_ms / round_ms_median; with --local --backend dpdk: appliance_gbps_in / veth_echo_ceiling.payload_gbps (testpmd 5tswap: UDP payload echoed back to the senders)",
            "efficiency_rxonly": "with --local --backend dpdk: appliance_gbps_in / veth_ceiling.payload_gbps (testpmd rxonly)",
            "appliance_cpu_s_per_gb": "dataplane CPU seconds (user + system) per 1e9 bytes received",
        }),
    }
}

fn print_table(points: &[RunResult]) {
    let opt = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |v| format!("{v:.p$}"));
    println!(
        "{:<18} {:>3} {:>3} {:>6} {:>5} {:>3} {:>9} {:>9} {:>8} {:>7} {:>7} {:>9} {:>6} {:>7} {:>7} {:>7} {:>6} {:>8}",
        "model",
        "W",
        "L",
        "chunk",
        "win",
        "shm",
        "median ms",
        "p99 ms",
        "GB/s/w",
        "in GB/s",
        "out GB/s",
        "bound ms",
        "eff",
        "cpu s/GB",
        "dp cpu",
        "wk cpu",
        "rexmit",
        "verified"
    );
    for r in points {
        println!(
            "{:<18} {:>3} {:>3} {:>6} {:>5} {:>3} {:>9.1} {:>9.1} {:>8.3} {:>7} {:>7} {:>9} {:>6} {:>7} {:>7} {:>7} {:>6} {:>8}",
            r.model,
            r.workers,
            r.lcores,
            r.chunk_bytes,
            r.window,
            if r.shm { "yes" } else { "no" },
            r.round_ms_median,
            r.round_ms_p99,
            r.goodput_gbps,
            opt(r.appliance_gbps_in, 3),
            opt(r.appliance_gbps_out, 3),
            opt(r.bound_round_ms, 1),
            opt(r.efficiency, 2),
            opt(r.appliance_cpu_s_per_gb, 2),
            opt(r.appliance_cpu_ms_per_round, 1),
            opt(r.workers_cpu_ms_per_round, 1),
            r.retransmits,
            r.verified.map_or("-".to_string(), |v| v.to_string()),
        );
    }
    if let Some(r) = points.first() {
        println!("bound: {}", r.efficiency_bound);
        if let Some(c) = &r.veth_echo_ceiling {
            println!(
                "same-run veth ceiling for the first row (the bound): {:.3} GB/s of UDP payload echoed back \
                 by dpdk-testpmd 5tswap to the senders (testpmd received {:.3} GB/s; {}); efficiency {}",
                c.payload_gbps,
                c.testpmd_rx_gbps,
                c.senders,
                opt(r.efficiency, 2)
            );
        }
        if let Some(c) = &r.veth_ceiling {
            println!(
                "same-run veth ceiling for the first row: {:.3} GB/s of UDP payload into dpdk-testpmd rxonly ({}); \
                 efficiency_rxonly {}",
                c.payload_gbps,
                c.senders,
                opt(r.efficiency_rxonly, 2)
            );
        }
        if let Some(c) = &r.ceilings {
            println!(
                "same-run ceilings for the first row: UDP echo {:.1} ms/round ({}), TCP echo {:.1} ms/round",
                c.udp_echo_round_ms, c.udp_setup, c.tcp_echo_round_ms
            );
        }
        println!(
            "GB/s = 1e9 bytes/s; goodput = model bytes per worker / median round; in/out = dataplane counters / timed wall time;"
        );
        println!("dp cpu / wk cpu = CPU ms per timed round of the dataplane process / of all workers");
        let spins: Vec<String> = points
            .iter()
            .filter_map(|r| r.appliance.as_ref()?.spin_us)
            .map(|us| us.to_string())
            .collect();
        if !spins.is_empty() {
            println!(
                "lcore spin at the end of each row's rounds (kernel UDP, --spin-us): {} us",
                spins.join(", ")
            );
        }
        if points.iter().any(|r| r.shm) {
            println!(
                "shm = chunks and results through shared memory (--shm): in/out count datagram bytes, headers only; no cpu s/GB"
            );
        }
    }
    for r in points {
        if let (Some(b), Some(d)) = (&r.baseline, &r.baseline_detail) {
            println!(
                "same-run baseline {b} ({} keys of <= 4 MB, W = {}): median {:.1} ms, p99 {:.1} ms{}; \
                 phub's median {:.1} ms is {:.2}x faster ({:.2}x its time); workers' CPU {} s/GB{}",
                d.keys,
                r.workers,
                d.round_ms_median,
                d.round_ms_p99,
                if d.verified {
                    ", sums verified"
                } else {
                    ", SUMS WRONG"
                },
                r.round_ms_median,
                r.speedup_vs_baseline.unwrap_or(f64::NAN),
                r.round_ms_median / d.round_ms_median,
                opt(r.workers_cpu_s_per_gb, 2),
                d.server_cpu_s_per_gb
                    .map_or(String::new(), |c| format!(", its server's CPU {c:.2} s/GB")),
            );
        }
    }
    for r in points
        .iter()
        .filter(|r| r.consistency != "bsp" || r.compute_ms > 0.0 || r.jitter_exp_ms > 0.0)
    {
        println!(
            "consistency {}: compute {:.1} ms + exp jitter {:.1} ms per round{}; {:.2} rounds/s per rank \
             (each: {}); blocked {:.0}% of the time; largest lead allowed {}",
            r.consistency,
            r.compute_ms,
            r.jitter_exp_ms,
            r.spike.map_or(String::new(), |s| format!(", spike {s}")),
            r.rounds_per_s,
            r.rounds_per_s_per_rank
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            r.blocked_fraction * 100.0,
            r.max_lead_observed.map_or("-".to_string(), |l| l.to_string()),
        );
    }
    for r in points.iter().filter(|r| r.inject.is_some()) {
        println!("{}", fault_summary(r));
    }
    for line in points.iter().filter_map(super::racks::summary) {
        println!("{line}");
    }
}

/// What fault injection did in one run, and how the protocol recovered.
fn fault_summary(r: &RunResult) -> String {
    let mut s = format!(
        "faults injected ({}), W={} {}: workers {} (all rounds); ",
        r.inject.as_deref().unwrap_or("off"),
        r.workers,
        r.model,
        r.worker_injected
    );
    match &r.appliance {
        Some(c) => s.push_str(&format!(
            "dataplane {} (timed rounds), {} results resent, {} duplicate pushes dropped; ",
            c.injected,
            c.results_resent,
            c.drops_by_reason.get("duplicate").copied().unwrap_or(0)
        )),
        None => s.push_str("dataplane counters unavailable; "),
    }
    s.push_str(&format!(
        "workers retransmitted {} chunks ({} fast), ignored {} duplicate results and probed idle lcores {} times",
        r.retransmits, r.fast_retransmits, r.results_ignored, r.lcores_probed
    ));
    s
}

/// `phub-bench run`.
pub fn run(a: &RunArgs) -> Result<()> {
    if let Some(path) = &a.plot {
        plot::check(path)?; // a bad name or a missing font fails before the runs
    }
    if a.control.is_none() {
        // Killed or interrupted, it stops the appliance it started and
        // removes its scratch directory, instead of orphaning them.
        phub_hwtests::process::stop_on_signal("phub-bench").map_err(|e| anyhow::anyhow!(e))?;
    }
    if a.verify && a.consistency != Consistency::Sync {
        bail!(
            "--verify with --consistency {}: the check knows BSP's sums only (in other modes a result \
             holds whichever pushes were applied when it left); drop one of them",
            a.consistency
        );
    }
    if a.shm && a.consistency != Consistency::Sync {
        bail!(
            "--shm with --consistency {}: shared memory is for BSP jobs only",
            a.consistency
        );
    }
    if a.shm && a.backend == Backend::Dpdk {
        bail!(
            "--shm with --backend dpdk: shared memory is for workers on the host of a kernel-UDP \
             dataplane; use --backend udp (the default) or drop --shm"
        );
    }
    if a.backend == Backend::Dpdk && a.control.is_none() {
        eprintln!("phub-bench: --backend dpdk: the dataplane decides whether it was built with DPDK");
    }
    if let (Some(spec), Some(_)) = (&a.inject, &a.control) {
        eprintln!(
            "phub-bench: --inject {spec}: in the workers only (the appliance at --control was started \
             elsewhere; give its phub-dataplane --inject for the other side)"
        );
    }
    let points: Vec<(String, RunArgs)> = match &a.sweep {
        None => vec![(a.model.clone(), a.clone())],
        Some(s) => {
            if a.control.is_some() && s.variable == SweepVariable::Lcores {
                bail!("--sweep lcores needs --local (a running appliance's lcores are fixed)");
            }
            s.values
                .iter()
                .map(|v| {
                    let mut p = a.clone();
                    match s.variable {
                        SweepVariable::Workers => p.workers = v.parse().unwrap_or(1),
                        SweepVariable::Chunk => p.chunk_bytes = v.parse().unwrap_or(8192),
                        SweepVariable::Lcores => p.lcores = v.parse().unwrap_or(1),
                        SweepVariable::Window => p.window = v.parse().ok(),
                        SweepVariable::Model => p.model = v.clone(),
                    }
                    (format!("{}={v}", s.variable), p)
                })
                .collect()
        }
    };
    let mut results = Vec::new();
    for (label, p) in &points {
        let profile = profiles::load(&p.model)?;
        eprintln!(
            "phub-bench run: {label}: {} ({} tensors, {:.2} M parameters, {:.1} MB), W={} {}, L={}, chunk {} B, {}{} warm-up + {} timed rounds",
            profile.name,
            profile.len(),
            profile.elements() as f64 / 1e6,
            profile.bytes_f32() as f64 / 1e6,
            p.workers,
            if p.procs { "processes" } else { "threads" },
            p.lcores,
            p.chunk_bytes,
            if p.shm { "shm, " } else { "" },
            p.warmup,
            p.rounds
        );
        let r = run_point(p, &profile, label).with_context(|| format!("run {label}"))?;
        eprintln!(
            "  median {:.1} ms, p99 {:.1} ms, goodput {:.3} GB/s per worker{}{}",
            r.round_ms_median,
            r.round_ms_p99,
            r.goodput_gbps,
            r.efficiency
                .map_or(String::new(), |e| format!(", efficiency {e:.2} of the bound")),
            r.efficiency_rxonly
                .map_or(String::new(), |e| format!(", {e:.2} of testpmd rxonly"))
        );
        results.push(r);
    }
    print_table(&results);
    if let Some(path) = &a.json {
        let ctx = context(a);
        let mut json = if a.sweep.is_some() {
            serde_json::json!({ "sweep": a.sweep, "points": results })
        } else {
            serde_json::to_value(&results[0])?
        };
        if let Some(o) = json.as_object_mut() {
            for (k, v) in serde_json::to_value(&ctx)?.as_object().into_iter().flatten() {
                o.insert(k.clone(), v.clone());
            }
        }
        let text = serde_json::to_string_pretty(&json)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let (Some(path), Some(s)) = (&a.plot, &a.sweep) {
        plot::write(path, s, &results)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(false) = results
        .iter()
        .map(|r| r.verified)
        .fold(None, |acc, v| match (acc, v) {
            (Some(false), _) | (_, Some(false)) => Some(false),
            (_, Some(true)) => Some(true),
            (x, None) => x,
        })
    {
        let m = results
            .iter()
            .find_map(|r| r.first_mismatch.clone())
            .unwrap_or_default();
        bail!("verification failed: {m}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn consistency_and_jitter_flags() {
        assert_eq!(consistency_json(Consistency::Sync), None);
        assert_eq!(
            consistency_json(Consistency::Async),
            Some(serde_json::json!({ "mode": "async" }))
        );
        assert_eq!(
            consistency_json(Consistency::Bounded { delay: 4 }),
            Some(serde_json::json!({ "mode": "bounded_delay", "bounded_delay": 4 }))
        );
        use crate::bench::emulate::parse_exp_jitter;
        assert_eq!(parse_exp_jitter("exp:2.5").unwrap(), 2.5);
        assert!(parse_exp_jitter("exp:-1").is_err());
        assert!(parse_exp_jitter("uniform:3").is_err());
    }

    use super::*;

    #[test]
    fn sweeps_parse() {
        let s = parse_sweep("workers=1,2,4").unwrap();
        assert_eq!((s.variable, s.values.len()), (SweepVariable::Workers, 3));
        assert_eq!(parse_sweep("chunk=1024, 8192").unwrap().values, ["1024", "8192"]);
        assert_eq!(
            parse_sweep("model=resnet50,synthetic:10").unwrap().values.len(),
            2
        );
        assert!(parse_sweep("workers").unwrap_err().contains("VARIABLE"));
        assert!(parse_sweep("speed=1").unwrap_err().contains("accepted"));
        assert!(parse_sweep("workers=0").is_err());
        assert!(parse_sweep("workers=").is_err());
    }

    #[test]
    fn inject_specs_are_checked_and_written_in_full() {
        // `--inject` is read by FaultSpec's FromStr and written (the JSON's
        // `arguments`, the dataplane's and the workers' flags) in full.
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            run: RunArgs,
        }
        use clap::Parser;
        let parse = |s: &str| {
            Flags::try_parse_from(["run", "--model", "resnet50", "--inject", s])
                .map(|f| f.run.inject.map(|i| i.to_string()))
        };
        assert_eq!(
            parse("loss=0.05,seed=3").unwrap().as_deref(),
            Some("loss=0.05,dup=0,reorder=0,seed=3")
        );
        let full = parse("loss=0.05,dup=0.01,reorder=0.01,seed=3").unwrap().unwrap();
        assert_eq!(parse(&full).unwrap().as_deref(), Some(full.as_str()));
        assert!(parse("loss=2").unwrap_err().to_string().contains("[0, 1)"));
        assert!(parse("jitter=1").unwrap_err().to_string().contains("accepted"));
        let args = Flags::try_parse_from([
            "run",
            "--model",
            "resnet50",
            "--inject",
            "loss=0.05,seed=3",
            "--consistency",
            "ssp:4",
        ])
        .unwrap();
        let json = serde_json::to_value(&args.run).unwrap();
        assert_eq!(json["inject"], "loss=0.05,dup=0,reorder=0,seed=3");
        assert_eq!(
            json["consistency"], "ssp:4",
            "written as before, not as a spec's table"
        );
    }
}
