//! phubctl: the operator's CLI over phub-control's HTTP API.
//!
//! Every command prints a human rendering (aligned tables, binary byte
//! sizes) or, with `--json`, the answer's JSON pretty-printed. Errors from
//! control are printed as `phubctl: <message>` with exit code 1. The
//! renderers are pure functions of the API types.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use phub_http::{ClientError, Controls, Timeouts, CONTROL_ENV};
use phub_proto::api::{
    AdmitResponse, ApplianceSpec, ApplianceStatus, JobDetail, JobMap, JobSummary, LcoreStats,
    RetriedCheckpoint, RetriedInstall, RetryRequest, RetryResponse, Stats,
};
use phub_proto::counters::{Column, Kind};
use phub_proto::routes::control::{self, ControlCall};
use phub_proto::routes::{AddMode, ControlRoute, Route};
use phub_proto::spec::{Consistency, JobSpec};
use serde::Serialize;

use crate::format::{human_bytes, human_ms, table, Align};

/// Control's address when neither `--control` nor `PHUB_CONTROL` is given.
pub const DEFAULT_CONTROL: &str = "http://127.0.0.1:7700";

/// phubctl: operate a phub appliance through phub-control.
#[derive(Debug, Parser)]
#[command(name = "phubctl", version)]
struct Args {
    /// Base URL of phub-control, or of several controls on one etcd
    /// prefix separated by commas (each tried in turn while one does not
    /// answer or answers 503, for 10 s at most) [default: $PHUB_CONTROL, else http://127.0.0.1:7700]
    #[arg(long, global = true, value_name = "URL")]
    control: Option<String>,
    /// Print control's answer as JSON.
    #[arg(long, global = true)]
    json: bool,
    /// File holding the operator token that admission, eviction,
    /// checkpoints and retries need [default: $PHUB_OPERATOR_TOKEN (the token itself),
    /// else ./phub-control.state.json.operator-token when it exists]
    #[arg(long, global = true, value_name = "FILE")]
    operator_token_file: Option<std::path::PathBuf>,
    /// PEM file of the CA that signed control's certificate, for an https
    /// --control [default: $PHUB_CA_FILE, else the system's roots]
    #[arg(long, global = true, value_name = "FILE")]
    ca_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Admit, list, show, checkpoint, retry and evict jobs.
    Job {
        #[command(subcommand)]
        cmd: JobCmd,
    },
    /// Where a job's chunks live.
    Map {
        #[command(subcommand)]
        cmd: MapCmd,
    },
    /// The appliances control manages: list, add, remove.
    Appliance {
        #[command(subcommand)]
        cmd: ApplianceCmd,
    },
    /// Copy a state between a state file and etcd, with no control running
    /// on the target (local: phub-control is not asked).
    State {
        #[command(subcommand)]
        cmd: StateCmd,
    },
    /// Dataplane counters and jobs.
    Stats {
        /// Repeat every SECS seconds (default 1), clearing the screen.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "1")]
        watch: Option<f64>,
    },
}

/// Both take FROM and TO, each a state file or
/// `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`; TO must be empty.
#[derive(Debug, Subcommand)]
enum StateCmd {
    /// Copy the state in etcd (FROM) to a new state file (TO).
    Export {
        /// etcd://HOST:PORT[,...]/PREFIX (or a state file).
        from: String,
        /// A new state file (or an unused etcd prefix).
        to: String,
        #[command(flatten)]
        etcd: crate::state::etcd::EtcdFlags,
    },
    /// Copy a state file (FROM) into an unused etcd prefix (TO).
    Import {
        /// A state file (or etcd://...).
        from: String,
        /// etcd://HOST:PORT[,...]/PREFIX, nothing under it yet (or a new file).
        to: String,
        #[command(flatten)]
        etcd: crate::state::etcd::EtcdFlags,
    },
}

#[derive(Debug, Subcommand)]
enum JobCmd {
    /// Admit a job from a spec file (TOML or JSON; `-` reads stdin).
    Admit {
        /// The spec file.
        spec: String,
    },
    /// List admitted jobs.
    List,
    /// Show one job, with its ranks.
    Show {
        /// Job id.
        id: u16,
    },
    /// Evict a job: the dataplane drops it and control forgets it.
    Evict {
        /// Job id.
        id: u16,
    },
    /// Save the job's parameters and optimizer state now; after a dataplane
    /// restart control reinstalls the job from its last checkpoint. Refused
    /// while the job is held, and when the file there holds later rounds
    /// than the appliance now (it is never written over by an older or
    /// emptier state).
    Checkpoint {
        /// Job id.
        id: u16,
    },
    /// Move one part of a replicated job at full strength from the most
    /// loaded of its appliances (the most jobs with parts there) to the
    /// least loaded appliance that is not the job's (one added since, say),
    /// while the job runs, when that evens their load; the part is filled
    /// by state copies (`job show` says when the job is back to full
    /// strength, and the next part can move). Says so when no move evens
    /// the load.
    Rebalance {
        /// Job id.
        id: u16,
    },
    /// Retry a HELD job (`job show` says why it is held: a part's
    /// checkpoint file is there but cannot be restored, so that part is
    /// not installed and the file is left as it is). Once the file is
    /// repaired or a good copy put in its place, this reads it again and
    /// restores the part from it; if it is still unusable, says why.
    Retry {
        /// Job id.
        id: u16,
        /// Give up the held parts' checkpoints instead: each file is
        /// renamed aside (FILE.discarded-<unix ms>, not deleted) and the
        /// part starts over without it (its parameters are lost).
        #[arg(long)]
        discard_checkpoint: bool,
    },
}

#[derive(Debug, Subcommand)]
enum ApplianceCmd {
    /// List the appliances, with their lcores, memory and jobs.
    List,
    /// Manage one more appliance (needs the operator token).
    Add {
        /// Its name (letters, digits, '-', '_', '.').
        name: String,
        /// Base URL of its dataplane's management API.
        #[arg(long)]
        url: String,
        /// Its rack label.
        #[arg(long, default_value = "")]
        rack: String,
        /// Its dataplane's management token file [default: the dataplane's
        /// default for the URL's port, on control's host].
        #[arg(long, value_name = "FILE")]
        token_file: Option<String>,
        /// Add it even though it does not answer now (control checks at
        /// once that the URL is a phub dataplane that takes the token and
        /// is not an appliance it manages already; with --force a dataplane
        /// that is down is added unchecked, and reconciliation checks it
        /// when it answers).
        #[arg(long)]
        force: bool,
    },
    /// Stop managing an appliance (refused while a job uses it).
    Remove {
        /// Its name.
        name: String,
    },
    /// Move every job off an appliance while the jobs run, so that it can
    /// be removed (needs the operator token). Each job must be replicated
    /// and at full strength; each moves to a spare appliance, which is
    /// filled with state copies (see `job show`). Refused, nothing
    /// changed, naming each job that cannot move.
    Drain {
        /// Its name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum MapCmd {
    /// Show a job's lcores, ports and runs of chunks; with `--key`, where
    /// that key's chunks are.
    Show {
        /// Job id.
        id: u16,
        /// Key index: show its chunks' lcores and slots.
        #[arg(long)]
        key: Option<u32>,
    },
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
enum CliError {
    /// Control answered with an error.
    #[error("{0}")]
    Api(String),
    /// Control did not answer.
    #[error("cannot reach phub-control at {url}: {reason}")]
    Unreachable {
        /// Control's base URL.
        url: String,
        /// What the transport said.
        reason: String,
    },
    /// A local problem (reading the spec, bad arguments).
    #[error("{0}")]
    Local(String),
    /// Control's answer is not what the API defines.
    #[error("unexpected answer from phub-control: {0}")]
    BadAnswer(String),
}

/// Entry point of the `phubctl` binary.
pub fn main() -> ExitCode {
    let args = Args::parse();
    let url = args
        .control
        .clone()
        .or_else(|| std::env::var(CONTROL_ENV).ok().filter(|s| !s.trim().is_empty()))
        .unwrap_or_else(|| DEFAULT_CONTROL.to_string());
    let token = match operator_token(args.operator_token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("phubctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ctl = match Ctl::new(&url, token, args.ca_file.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("phubctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&ctl, &args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("phubctl: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The operator token: from `--operator-token-file`, `$PHUB_OPERATOR_TOKEN`,
/// or the default file beside the default state file; None when none is set
/// (read-only commands need none; control says so when one is needed).
fn operator_token(file: Option<&std::path::Path>) -> Result<Option<String>, String> {
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p)
            .map(|t| t.trim().to_string())
            .map_err(|e| format!("cannot read the operator token file {}: {e}", p.display()))
    };
    if let Some(f) = file {
        return read(f).map(Some);
    }
    if let Some(t) = std::env::var("PHUB_OPERATOR_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(Some(t.trim().to_string()));
    }
    let default = std::path::Path::new("phub-control.state.json.operator-token");
    if default.exists() {
        return read(default).map(Some);
    }
    Ok(None)
}

fn run(ctl: &Ctl, args: &Args) -> Result<(), CliError> {
    let json = args.json;
    match &args.cmd {
        Cmd::Job { cmd } => match cmd {
            JobCmd::Admit { spec } => {
                let text = read_spec(spec)?;
                let r = ctl.send(&control::admit(&text))?;
                show(json, r, |r| {
                    let workers = JobSpec::parse(&text, None).ok().map(|s| s.workers);
                    render_admit(&r, &ctl.base(), workers)
                })
            }
            JobCmd::List => show(json, ctl.send(&control::jobs())?, |r| render_list(&r)),
            JobCmd::Show { id } => show(json, ctl.send(&control::job(*id))?, |r| render_show(&r)),
            JobCmd::Rebalance { id } => show(json, ctl.send(&control::rebalance_job(*id))?, |r| {
                let load: Vec<String> = r.load.iter().map(|(n, l)| format!("{n} {l}")).collect();
                match &r.moved {
                    Some(m) => format!(
                        "job {}: part {} moves from appliance {:?} to {:?} at epoch {} (filling: phubctl job \
                         show {}); jobs per appliance now: {}\n",
                        r.job,
                        m.index,
                        m.from,
                        m.to,
                        m.epoch,
                        r.job,
                        load.join(", ")
                    ),
                    None => format!(
                        "job {}: balanced, nothing moved (no appliance outside it holds two jobs fewer than \
                         one of its own); jobs per appliance: {}\n",
                        r.job,
                        load.join(", ")
                    ),
                }
            }),
            JobCmd::Checkpoint { id } => show(json, ctl.send(&control::checkpoint(*id))?, |c| {
                let rounds = match c.round_range {
                    Some((lo, hi)) if lo == hi => format!("round {lo}"),
                    Some((lo, hi)) => format!("rounds {lo}..={hi}"),
                    None => "no completed round yet".into(),
                };
                format!(
                    "checkpoint of job {}: {rounds}, {} in {}\n",
                    c.id,
                    human_bytes(c.bytes),
                    c.file
                )
            }),
            JobCmd::Retry {
                id,
                discard_checkpoint,
            } => {
                let req = RetryRequest {
                    discard_checkpoint: *discard_checkpoint,
                };
                show(json, ctl.send(&control::retry(*id, &req))?, |r| render_retry(&r))
            }
            JobCmd::Evict { id } => show(json, ctl.send(&control::evict(*id))?, |r| {
                format!(
                    "evicted job {} {:?} ({} freed)\n",
                    r.id,
                    r.name,
                    human_bytes(r.memory_bytes)
                )
            }),
        },
        Cmd::Map {
            cmd: MapCmd::Show { id, key },
        } => show(json, ctl.send(&control::map(*id, *key))?, |r| render_map(&r)),
        Cmd::Appliance { cmd } => match cmd {
            ApplianceCmd::List => show(json, ctl.send(&control::appliances())?, |r| render_appliances(&r)),
            ApplianceCmd::Add {
                name,
                url,
                rack,
                token_file,
                force,
            } => {
                let spec = ApplianceSpec {
                    name: name.clone(),
                    url: url.clone(),
                    rack: rack.clone(),
                    token_file: token_file.clone(),
                    draining: false,
                };
                let mode = if *force { AddMode::Forced } else { AddMode::Checked };
                show(json, ctl.send(&control::add_appliance(&spec, mode))?, |a| {
                    format!(
                        "added appliance {:?} at {}
{}",
                        a.name,
                        a.url,
                        render_appliances(std::slice::from_ref(&a))
                    )
                })
            }
            ApplianceCmd::Drain { name } => show(json, ctl.send(&control::drain_appliance(name))?, |d| {
                let mut out = format!(
                    "drained appliance {:?}: {} jobs moved; it takes no new job
",
                    d.appliance,
                    d.moved.len()
                );
                for m in &d.moved {
                    out += &format!(
                        "  job {} ({:?}) -> appliance {:?} at epoch {} (filling: phubctl job show {})
",
                        m.job, m.name, m.to, m.epoch, m.job
                    );
                }
                out
            }),
            ApplianceCmd::Remove { name } => show(json, ctl.send(&control::remove_appliance(name))?, |a| {
                format!(
                    "removed appliance {:?} ({})
",
                    a.name, a.url
                )
            }),
        },
        Cmd::State {
            cmd: StateCmd::Export { from, to, etcd } | StateCmd::Import { from, to, etcd },
        } => {
            let security = etcd.security().map_err(CliError::Local)?;
            let (jobs, appliances) = crate::state::transfer::copy(from, to, &security)
                .map_err(|e| CliError::Local(e.to_string()))?;
            println!("copied {jobs} jobs and {appliances} appliances from {from} to {to}");
            Ok(())
        }
        Cmd::Stats { watch: None } => show(json, ctl.send(&control::stats())?, |r| render_stats(&r)),
        Cmd::Stats { watch: Some(secs) } => {
            if !(secs.is_finite() && *secs > 0.0) {
                return Err(CliError::Local(format!(
                    "--watch {secs}: expected a number of seconds > 0"
                )));
            }
            let every = Duration::from_secs_f64(*secs);
            // The previous answer and when it came, for the rates.
            let mut prev: Option<(Stats, std::time::Instant)> = None;
            loop {
                let answer = ctl.send(&control::stats());
                let at = std::time::Instant::now();
                let text = answer.map(|r| {
                    render(json, r, |r| {
                        let mut t = match &prev {
                            Some((p, then)) => render_rates(p, &r, at.duration_since(*then).as_secs_f64()),
                            None => "rates: from the next refresh on\n\n".to_string(),
                        };
                        t.push_str(&render_stats(&r));
                        prev = Some((r, at));
                        t
                    })
                });
                print!("\x1b[2J\x1b[H");
                println!("phubctl stats, every {secs} s, from {}\n", ctl.base());
                match text {
                    Ok(t) => print!("{t}"),
                    Err(e) => println!("phubctl: {e}"),
                }
                std::thread::sleep(every);
            }
        }
    }
}

fn read_spec(path: &str) -> Result<String, CliError> {
    if path == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CliError::Local(format!("cannot read the spec from stdin: {e}")))?;
        Ok(s)
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| CliError::Local(format!("cannot read spec file {path}: {e}")))
    }
}

/// Control's answer as JSON (`--json`) or as `f` renders it.
fn render<T: Serialize>(json: bool, v: T, f: impl FnOnce(T) -> String) -> String {
    if json {
        // Through the typed answer, so fields keep the API's order.
        let mut s = serde_json::to_string_pretty(&v).expect("API types serialise");
        s.push('\n');
        s
    } else {
        f(v)
    }
}

fn show<T: Serialize>(json: bool, v: T, f: impl FnOnce(T) -> String) -> Result<(), CliError> {
    print!("{}", render(json, v, f));
    Ok(())
}

/// A connection to control: the shared client of one or several controls
/// (`--control URL1,URL2,...`, [`phub_http::Controls`]: a call goes on to
/// the next control while the one asked does not take it or answers `503`,
/// following `X-Phub-Leader`, for 10 s at most), with phubctl's timeouts
/// (3 s to connect, 30 s a call) and its errors.
struct Ctl {
    controls: Controls,
}

impl Ctl {
    fn new(
        bases: &str,
        operator_token: Option<String>,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Ctl, String> {
        let controls = Controls::new(bases, ca_file, Timeouts::default())
            .map_err(|e| format!("--control: {e}"))?
            .with_token(operator_token);
        Ok(Ctl { controls })
    }

    /// The base URL of the control that answered last.
    fn base(&self) -> String {
        self.controls.base()
    }

    /// Sends a call; its answer on success.
    fn send<A>(&self, call: &ControlCall<'_, A>) -> Result<A, CliError> {
        self.controls.send(call).map_err(|e| match e {
            ClientError::Api { message, .. } => CliError::Api(message),
            ClientError::Unreachable { base, reason } => CliError::Unreachable { url: base, reason },
            ClientError::BadAnswer { reason, .. } => CliError::BadAnswer(reason),
            e @ (ClientError::Http { .. }
            | ClientError::Unanswered { .. }
            | ClientError::NoneServed { .. }) => CliError::Api(e.to_string()),
        })
    }
}

/// Lcore indices as compact ranges: `0-3,6`.
pub fn lcore_ranges(lcores: &[u16]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < lcores.len() {
        let mut j = i;
        while j + 1 < lcores.len() && lcores[j + 1] == lcores[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            lcores[i].to_string()
        } else {
            format!("{}-{}", lcores[i], lcores[j])
        });
        i = j + 1;
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(",")
    }
}

/// `job admit`: id, token and how workers join (`workers` from the spec, if known).
pub fn render_admit(r: &AdmitResponse, control: &str, workers: Option<u32>) -> String {
    let ranks = match workers {
        Some(w) if w > 0 => format!(" for R in 0..={}", w - 1),
        _ => String::new(),
    };
    format!(
        "admitted job {id}: {chunks} chunks, {mem} on lcores {lcores}{on}\n\
         id     {id}\n\
         token  {token:016x}\n\
         workers join with: POST {control}{join} {{\"token\": \"{token:016x}\", \"rank\": R}}{ranks}\n",
        id = r.id,
        join = Route::path(&ControlRoute::Join { job: r.id }),
        chunks = r.chunks,
        mem = human_bytes(r.memory_bytes),
        lcores = lcore_ranges(&r.lcores),
        on = if r.appliances.len() > 1 {
            format!(" of appliances {}", r.appliances.join(", "))
        } else {
            String::new()
        },
        token = r.token,
    )
}

/// `appliance list`.
pub fn render_appliances(list: &[ApplianceStatus]) -> String {
    if list.is_empty() {
        return "no appliances\n".into();
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|a| {
            let ids: Vec<String> = a.jobs.iter().map(u16::to_string).collect();
            vec![
                a.name.clone(),
                a.rack.clone(),
                a.url.clone(),
                a.data
                    .as_ref()
                    .map_or_else(|| "-".into(), |d| format!("{}:{}", d.host, d.base_port)),
                a.lcores.map_or_else(|| "-".into(), |n| n.to_string()),
                match (a.memory_used_bytes, a.memory_budget_bytes) {
                    (Some(u), Some(b)) => format!("{} of {}", human_bytes(u), human_bytes(b)),
                    _ => "-".into(),
                },
                if ids.is_empty() { "-".into() } else { ids.join(",") },
                match (&a.down, a.draining) {
                    (None, false) => "up".into(),
                    (None, true) => "up, drained".into(),
                    (Some(why), _) => format!("DOWN: {why}"),
                },
            ]
        })
        .collect();
    table(
        &[
            ("NAME", Align::Left),
            ("RACK", Align::Left),
            ("MANAGEMENT", Align::Left),
            ("DATA", Align::Left),
            ("LCORES", Align::Right),
            ("MEMORY USED", Align::Right),
            ("JOBS", Align::Left),
            ("STATE", Align::Left),
        ],
        &rows,
    )
}

fn yes(b: bool) -> String {
    if b { "yes" } else { "no" }.to_string()
}

/// `job retry`: per retried part, what became of its file and its install.
pub fn render_retry(r: &RetryResponse) -> String {
    let mut out = String::new();
    for p in &r.parts {
        let file = match &p.checkpoint {
            RetriedCheckpoint::Usable { round_range } => {
                let rounds = match round_range {
                    Some((lo, hi)) if lo == hi => format!("round {lo}"),
                    Some((lo, hi)) => format!("rounds {lo}..={hi}"),
                    None => "no completed round yet".into(),
                };
                format!("checkpoint {} usable ({rounds})", p.file)
            }
            RetriedCheckpoint::SetAside { moved_to: Some(to) } => {
                format!("checkpoint {} set aside as {to}", p.file)
            }
            RetriedCheckpoint::SetAside { moved_to: None } => format!("checkpoint {} was gone", p.file),
        };
        let restored = matches!(p.checkpoint, RetriedCheckpoint::Usable { .. });
        let install = match (&p.install, restored) {
            (RetriedInstall::Installed, true) => "restored from it".to_string(),
            (RetriedInstall::Installed, false) => "installed without it (starts over)".to_string(),
            (RetriedInstall::StillInstalled, _) => {
                "the appliance still had the part: its state there is kept".to_string()
            }
            (RetriedInstall::Pending { why }, _) => format!("not installed yet ({why})"),
        };
        out.push_str(&format!(
            "job {} part on appliance {:?}: {file}; {install}\n",
            r.id, p.appliance
        ));
    }
    out
}

/// `job list`.
pub fn render_list(jobs: &[JobSummary]) -> String {
    if jobs.is_empty() {
        return "no jobs admitted\n".into();
    }
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            vec![
                j.id.to_string(),
                j.name.clone(),
                j.workers.to_string(),
                j.joined.len().to_string(),
                j.keys.to_string(),
                j.chunks.to_string(),
                j.dtype.clone(),
                j.optimizer.clone(),
                human_bytes(j.memory_bytes),
                if j.failed.is_some() {
                    "FAILED".to_string()
                } else if j.held.is_some() {
                    "HELD".to_string()
                } else {
                    yes(j.installed)
                },
            ]
        })
        .collect();
    table(
        &[
            ("ID", Align::Right),
            ("NAME", Align::Left),
            ("WORKERS", Align::Right),
            ("JOINED", Align::Right),
            ("KEYS", Align::Right),
            ("CHUNKS", Align::Right),
            ("DTYPE", Align::Left),
            ("OPTIMIZER", Align::Left),
            ("MEMORY", Align::Right),
            ("INSTALLED", Align::Left),
        ],
        &rows,
    )
}

/// `job show`.
pub fn render_show(d: &JobDetail) -> String {
    let s = &d.summary;
    let mut out = format!(
        "job {} {:?}: {} workers ({} joined), {} keys, {} chunks of {} elements\n\
         dtype {}, optimizer {}, memory {}, installed {}\n",
        s.id,
        s.name,
        s.workers,
        s.joined.len(),
        s.keys,
        s.chunks,
        d.spec.chunk_elems(),
        s.dtype,
        s.optimizer,
        human_bytes(s.memory_bytes),
        yes(s.installed),
    );
    if let Some(why) = &s.failed {
        out.push_str(&format!(
            "FAILED: {why}\n  (joins are refused; evict the job and admit it again)\n"
        ));
    }
    if let Some(why) = &s.held {
        out.push_str(&format!(
            "HELD: {why}\n  (that part is not installed, joins and checkpoints are refused, the file is left as \
             it is: repair it or put a good copy in its place, then `phubctl job retry {}`; or `phubctl job \
             retry {} --discard-checkpoint` to start the part over without it)\n",
            s.id, s.id
        ));
    }
    out.push_str(&render_consistency(d));
    out.push_str(&format!("rounds completed {}", d.rounds_completed));
    if let Some((lo, hi)) = d.round_range {
        out.push_str(&format!(", last completed round {lo}..={hi} over its chunks"));
    }
    if let Some(c) = &d.checkpoint {
        match c.round_range {
            Some((lo, hi)) => out.push_str(&format!("\nlast checkpoint: rounds {lo}..={hi}")),
            None => out.push_str("\nlast checkpoint: before round 0 completed"),
        }
        out.push_str(&format!(", {} ({})", human_bytes(c.bytes), c.file));
    }
    if let Some(e) = &d.epoch {
        let down: Vec<&str> = e
            .down
            .iter()
            .filter_map(|&i| d.parts.get(usize::from(i)))
            .map(|p| p.appliance.as_str())
            .collect();
        out.push_str(&format!(
            "\nreplicas {}, epoch {}, appliances down: {}",
            d.spec.replicas(),
            e.epoch,
            if down.is_empty() {
                "none".to_string()
            } else {
                down.join(", ")
            }
        ));
        if e.restored > 0 {
            // PROTOCOL.md §11.7, "Restored parts": the rounds since the
            // checkpoints were repeated.
            out.push_str(&format!(
                "\nwent back to its checkpoints at epoch {} (a part lost every replica)",
                e.restored
            ));
        }
    }
    if let Some(r) = &d.replicas {
        out.push_str(&format!(
            "\nreplicas live {} of {} ({})",
            r.live,
            r.wanted,
            r.state.name()
        ));
        if let Some(why) = &r.stalled {
            out.push_str(&format!("\nSTALLED: {why}"));
        }
        if let Some(x) = &r.rereplication {
            out.push_str(&format!(
                "\nre-replication to {} at epoch {}",
                x.appliance, x.epoch
            ));
            if let Some(old) = &x.replaced {
                out.push_str(&format!(" (in place of {old})"));
            }
            out.push_str(": ");
            let after = if x.replaced.is_some() {
                "after it took the place"
            } else {
                "after it answered again"
            };
            match (x.full_strength_ms(), &x.abandoned) {
                (Some(ms), _) => {
                    out.push_str(&format!("full strength {ms} ms {after}"));
                    if let Some(b) = x.bytes_copied {
                        out.push_str(&format!(", {} copied", human_bytes(b)));
                    }
                }
                (None, Some(why)) => out.push_str(&format!("stopped: {why}")),
                (None, None) => out.push_str("under way"),
            }
        }
    }
    out.push_str("\n\n");
    let hierarchical = d.parts.iter().any(|p| p.ranks.is_some());
    if hierarchical {
        out.push_str(
            "hierarchical: each rank sends to its rack's appliance, which keeps a slot of every chunk and \
             sends one partial sum per chunk to its home (CHUNKS: the chunks each appliance is home to)\n",
        );
    }
    if d.parts.len() > 1 || d.parts.iter().any(|p| !p.installed) {
        let rows: Vec<Vec<String>> = d
            .parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let out_of_job = d.epoch.as_ref().is_some_and(|e| e.is_down(i));
                vec![
                    p.appliance.clone(),
                    match p.ranks {
                        Some((lo, hi)) => format!("{} (ranks {lo}..{hi})", p.rack),
                        None => p.rack.clone(),
                    },
                    p.lcores.to_string(),
                    format!("{}..{}", p.chunks.0, p.chunks.1),
                    human_bytes(p.memory_bytes),
                    match p.round_range {
                        Some((lo, hi)) => format!("{} ({lo}..={hi})", p.rounds_completed),
                        None => p.rounds_completed.to_string(),
                    },
                    match (&p.down, p.installed) {
                        (Some(why), _) if out_of_job => format!("OUT ({why})"),
                        (Some(why), _) => format!("DOWN ({why}); reinstalled when it answers"),
                        (None, true) => "installed".into(),
                        (None, false) => "NOT installed; reconciliation reinstalls it".into(),
                    },
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                ("APPLIANCE", Align::Left),
                ("RACK", Align::Left),
                ("LCORES", Align::Right),
                ("CHUNKS", Align::Left),
                ("MEMORY", Align::Right),
                ("ROUNDS", Align::Left),
                ("STATE", Align::Left),
            ],
            &rows,
        ));
        out.push('\n');
    }
    if !d.tables.is_empty() {
        // Each table's rows over the appliances (PROTOCOL.md §10): counters
        // since each appliance installed or restored it.
        let rows: Vec<Vec<String>> = d
            .tables
            .iter()
            .map(|t| {
                let name = d
                    .spec
                    .keys
                    .get(t.key as usize)
                    .map_or_else(|| format!("key {}", t.key), |k| format!("{} ({})", t.key, k.name));
                vec![
                    name,
                    t.rows_stored.to_string(),
                    t.created.to_string(),
                    format!("{} / {}", t.evicted_cap, t.evicted_idle),
                    t.updates.to_string(),
                    t.lookups.to_string(),
                    (t.not_admitted + t.no_memory).to_string(),
                    human_bytes(t.bytes),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                ("TABLE", Align::Left),
                ("ROWS", Align::Right),
                ("CREATED", Align::Right),
                ("EVICTED CAP / IDLE", Align::Right),
                ("UPDATES", Align::Right),
                ("LOOKUPS", Align::Right),
                ("DROPPED", Align::Right),
                ("BYTES", Align::Right),
            ],
            &rows,
        ));
        out.push('\n');
    }
    // Jobs that are not BSP: each rank's applied clock, lowest..=highest
    // over the job's chunks (one number when they agree).
    let clocked = d.spec.consistency != Consistency::Sync;
    let rows: Vec<Vec<String>> = d
        .ranks
        .iter()
        .map(|r| {
            let mut row = vec![r.rank.to_string(), yes(r.joined)];
            if clocked {
                row.push(match d.clock.clocks.get(usize::from(r.rank)) {
                    Some((lo, hi)) if lo == hi => lo.to_string(),
                    Some((lo, hi)) => format!("{lo}..={hi}"),
                    None => "-".into(),
                });
            }
            row.push(match r.silent_ms {
                Some(ms) => format!("silent for {}", human_ms(ms)),
                None => "never heard from".into(),
            });
            row
        })
        .collect();
    let mut columns = vec![("RANK", Align::Right), ("JOINED", Align::Left)];
    if clocked {
        columns.push(("CLOCK", Align::Left));
    }
    columns.push(("DATAPLANE", Align::Left));
    out.push_str(&table(&columns, &rows));
    out
}

/// `job show`'s consistency line (PROTOCOL.md §5.8): the mode, τ, the
/// largest lead an answer ever allowed (the clock a rank could push next
/// minus the slowest rank's, over the job's chunks), the answers held now
/// and (bounded delay) how many were ever held and how long they waited.
fn render_consistency(d: &JobDetail) -> String {
    let c = d.spec.consistency;
    let mut out = match c {
        Consistency::Sync => return "consistency sync (BSP: every round waits for all ranks)\n".into(),
        Consistency::Async => "consistency async (each push applied and answered at once)".to_string(),
        Consistency::Bounded { delay } => format!(
            "consistency bounded_delay, τ = {delay} (an answer waits until no rank is more than \
             {delay} clocks behind; a rank leads by at most {})",
            u64::from(delay) + 1
        ),
    };
    let k = &d.clock;
    match k.max_lead {
        Some(lead) => out.push_str(&format!("\nlargest lead allowed {lead} clocks")),
        None => out.push_str("\nlargest lead allowed: none yet"),
    }
    if c.delay().is_some() {
        out.push_str(&format!(
            ", answers held now {}\nanswers held so far {}, their waits {} in all, {} at most",
            k.held,
            k.held_total,
            human_us(k.held_wait_us),
            human_us(k.held_wait_max_us)
        ));
    }
    out.push('\n');
    out
}

/// Microseconds for a person: µs below 1 ms, ms with a decimal below 1 s.
fn human_us(us: u64) -> String {
    if us < 1000 {
        format!("{us} µs")
    } else if us < 1_000_000 {
        format!("{:.1} ms", us as f64 / 1000.0)
    } else {
        human_ms(us / 1000)
    }
}

/// `map show`: per lcore its run of the job's chunk sequence; with a key,
/// that key's chunks as runs on lcores.
pub fn render_map(m: &JobMap) -> String {
    let mut appliances: Vec<&str> = m.lcores.iter().map(|l| l.appliance.as_str()).collect();
    appliances.dedup();
    let mut out = format!(
        "job {}: {} keys, {} chunks of up to {} elements over {} lcores{}, memory {}\n\n",
        m.id,
        m.keys_total,
        m.chunks,
        m.chunk_elems,
        m.lcores.len(),
        if appliances.len() > 1 {
            format!(" of {} appliances", appliances.len())
        } else {
            String::new()
        },
        human_bytes(m.memory_bytes)
    );
    let rows: Vec<Vec<String>> = m
        .lcores
        .iter()
        .map(|l| {
            vec![
                l.appliance.clone(),
                l.lcore.to_string(),
                l.port.to_string(),
                format!("{}..{}", l.first, l.first + l.slots),
                l.slots.to_string(),
                human_bytes(l.bytes),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            ("APPLIANCE", Align::Left),
            ("LCORE", Align::Right),
            ("PORT", Align::Right),
            ("CHUNKS", Align::Left),
            ("SLOTS", Align::Right),
            ("MEMORY", Align::Right),
        ],
        &rows,
    ));
    out.push_str(
        "\nchunk g (key k's chunk c is g = first(k) + c) is in slot g - start of the lcore whose run holds it, \
         on that lcore's appliance\n",
    );
    for k in &m.keys {
        let n: u64 = k.runs.iter().map(|r| u64::from(r.count)).sum();
        out.push_str(&format!(
            "\nkey {} {}: {} elements, {n} chunks (sequence {}..{})\n",
            k.key,
            if k.name.is_empty() {
                "(unnamed)".to_string()
            } else {
                format!("{:?}", k.name)
            },
            k.elements,
            k.first,
            k.first + n
        ));
        let rows: Vec<Vec<String>> = k
            .runs
            .iter()
            .map(|r| {
                vec![
                    format!("{}..{}", r.chunk, u64::from(r.chunk) + u64::from(r.count)),
                    r.appliance.clone(),
                    r.lcore.to_string(),
                    format!("{}..{}", r.slot, u64::from(r.slot) + u64::from(r.count)),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                ("KEY CHUNKS", Align::Left),
                ("APPLIANCE", Align::Left),
                ("LCORE", Align::Right),
                ("SLOTS", Align::Left),
            ],
            &rows,
        ));
    }
    out
}

fn mb(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

/// One dataplane's counters under `title`, or why it is unreachable.
fn render_dataplane(
    title: &str,
    dataplane: Option<&phub_proto::api::DataplaneStats>,
    error: Option<&str>,
) -> String {
    let mut out = String::new();
    match (dataplane, error) {
        (Some(dp), _) => {
            let spin = dp
                .spin_us
                .map(|us| format!(", lcores spin {us} us past traffic before they sleep"))
                .unwrap_or_default();
            out.push_str(&format!(
                "{title}: {} backend, {} lcores{spin}\n\n",
                dp.backend,
                dp.lcores.len()
            ));
            let total = dp.total();
            let mut all: Vec<&LcoreStats> = dp.lcores.iter().collect();
            if dp.lcores.len() > 1 {
                all.push(&total);
            }
            let names: Vec<String> = dp
                .lcores
                .iter()
                .map(|l| l.lcore.to_string())
                .chain(std::iter::once("all".to_string()))
                .collect();
            let (columns, rows) = lcore_table(&all, &names);
            out.push_str(&table(&columns, &rows));
            out.push_str(&render_port(dp.backend.name(), dp.port.as_ref(), &total));
            let drops: Vec<Vec<String>> = dp
                .lcores
                .iter()
                .flat_map(|l| {
                    l.drops
                        .iter()
                        .filter(|(_, &c)| c > 0)
                        .map(move |(r, c)| vec![r.clone(), l.lcore.to_string(), c.to_string()])
                })
                .collect();
            if !drops.is_empty() {
                out.push_str("\ndrops by reason\n");
                out.push_str(&table(
                    &[
                        ("REASON", Align::Left),
                        ("LCORE", Align::Right),
                        ("DROPS", Align::Right),
                    ],
                    &drops,
                ));
            }
        }
        (None, err) => {
            out.push_str(&format!("{title}: unreachable: {}\n", err.unwrap_or("no answer")));
        }
    }
    out
}

/// Each appliance's dataplane in `s`, by name ("dataplane" for a control
/// that reports one only).
fn dataplanes(s: &Stats) -> Vec<(String, &phub_proto::api::DataplaneStats)> {
    if s.appliances.is_empty() {
        s.dataplane.iter().map(|d| ("dataplane".to_string(), d)).collect()
    } else {
        s.appliances
            .iter()
            .filter_map(|a| Some((a.name.clone(), a.dataplane.as_ref()?)))
            .collect()
    }
}

/// `stats --watch`: what changed between two answers `secs` apart, per
/// second: per lcore of each appliance the bytes in and out (GB/s),
/// contributions, rounds, results resent and drops; per job its rounds.
/// Counters that went back (an appliance restarted) show as `-`.
pub fn render_rates(prev: &Stats, now: &Stats, secs: f64) -> String {
    let secs = secs.max(1e-3);
    let rate = |a: u64, b: u64, scale: f64| {
        b.checked_sub(a)
            .map_or("-".to_string(), |d| format!("{:.2}", d as f64 / secs / scale))
    };
    let before = dataplanes(prev);
    let mut rows = Vec::new();
    for (name, d) in dataplanes(now) {
        let Some((_, p)) = before.iter().find(|(n, _)| *n == name) else {
            continue;
        };
        for l in &d.lcores {
            let Some(o) = p.lcores.iter().find(|o| o.lcore == l.lcore) else {
                continue;
            };
            let drops = |x: &LcoreStats| x.drops.values().sum::<u64>();
            rows.push(vec![
                name.clone(),
                l.lcore.to_string(),
                rate(o.rx_bytes, l.rx_bytes, 1e9),
                rate(o.tx_bytes, l.tx_bytes, 1e9),
                rate(o.pushes_aggregated, l.pushes_aggregated, 1.0),
                rate(o.rounds_completed, l.rounds_completed, 1.0),
                rate(o.results_resent, l.results_resent, 1.0),
                rate(drops(o), drops(l), 1.0),
            ]);
        }
    }
    let mut out = format!("per second over the last {secs:.1} s:\n");
    out.push_str(&table(
        &[
            ("APPLIANCE", Align::Left),
            ("LCORE", Align::Right),
            ("RX GB/s", Align::Right),
            ("TX GB/s", Align::Right),
            ("PUSHES/s", Align::Right),
            ("ROUNDS/s", Align::Right),
            ("RESENT/s", Align::Right),
            ("DROPS/s", Align::Right),
        ],
        &rows,
    ));
    let rounds = |s: &Stats, id: u16| -> u64 {
        dataplanes(s)
            .iter()
            .flat_map(|(_, d)| &d.jobs)
            .filter(|j| j.id == id)
            .map(|j| j.rounds_completed)
            .sum()
    };
    for j in &now.jobs {
        out.push_str(&format!(
            "job {} ({}): {} chunk rounds/s\n",
            j.id,
            j.name,
            rate(rounds(prev, j.id), rounds(now, j.id), 1.0)
        ));
    }
    out.push('\n');
    out
}

/// `stats`: per appliance its per-lcore counters and drops by reason, and
/// one line per job.
pub fn render_stats(s: &Stats) -> String {
    let mut out = String::new();
    if s.appliances.len() > 1 {
        for a in &s.appliances {
            let title = if a.rack.is_empty() {
                format!("appliance {}", a.name)
            } else {
                format!("appliance {} (rack {})", a.name, a.rack)
            };
            out.push_str(&render_dataplane(
                &title,
                a.dataplane.as_ref(),
                a.error.as_deref(),
            ));
            out.push('\n');
        }
    } else {
        out.push_str(&render_dataplane(
            "dataplane",
            s.dataplane.as_ref(),
            s.dataplane_error.as_deref(),
        ));
    }
    out.push('\n');
    if s.jobs.is_empty() {
        out.push_str("no jobs admitted\n");
    }
    for j in &s.jobs {
        // Every appliance's view of the job (one when it is not sharded).
        let lives: Vec<&phub_proto::api::JobLive> = if s.appliances.is_empty() {
            s.dataplane
                .iter()
                .flat_map(|d| &d.jobs)
                .filter(|l| l.id == j.id)
                .collect()
        } else {
            s.appliances
                .iter()
                .filter_map(|a| a.dataplane.as_ref())
                .flat_map(|d| &d.jobs)
                .filter(|l| l.id == j.id)
                .collect()
        };
        let live = (!lives.is_empty()).then(|| phub_proto::api::JobLive {
            id: j.id,
            pushes: lives.iter().map(|l| l.pushes).sum(),
            rounds_completed: lives.iter().map(|l| l.rounds_completed).sum(),
            round_range: lives
                .iter()
                .filter_map(|l| l.round_range)
                .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1))),
            silent_ms: Vec::new(),
            clock: phub_proto::api::ClockStats {
                held: lives.iter().map(|l| l.clock.held).sum(),
                ..Default::default()
            },
            copies: None,
            tables: Vec::new(),
        });
        let live = live.as_ref();
        out.push_str(&format!(
            "job {} {:?}: {}/{} joined, {}, {}",
            j.id,
            j.name,
            j.joined.len(),
            j.workers,
            match (&j.failed, &j.held, j.installed) {
                (Some(_), _, _) => "FAILED",
                (None, Some(_), _) => "HELD (see job show)",
                (None, None, true) => "installed",
                (None, None, false) => "NOT installed",
            },
            human_bytes(j.memory_bytes)
        ));
        if let Some(l) = live {
            out.push_str(&format!(", {} pushes, {} rounds", l.pushes, l.rounds_completed));
            if let Some((lo, hi)) = l.round_range {
                out.push_str(&format!(" (chunks at round {lo}..={hi})"));
            }
        }
        out.push('\n');
    }
    out
}

/// A column of phubctl's lcore table that is not one counter of the table
/// but worked out from several, and the counter it follows.
#[derive(Clone, Copy)]
enum Derived {
    /// Drops, all reasons.
    Drops,
    /// Busy share of the poll loop's iterations.
    Busy,
}

const DERIVED_AFTER: [(&str, Derived, &str); 2] = [
    // After RESENT (the hidden `pulls_answered` follows it in the table).
    ("pulls_answered", Derived::Drops, "DROPS"),
    ("arp_replies", Derived::Busy, "BUSY%"),
];

impl Derived {
    fn value(self, l: &LcoreStats) -> String {
        match self {
            Derived::Drops => l.drops.values().sum::<u64>().to_string(),
            Derived::Busy => {
                let loops = l.busy_loops + l.idle_loops;
                if loops == 0 {
                    "-".to_string()
                } else {
                    format!("{:.1}", l.busy_loops as f64 * 100.0 / loops as f64)
                }
            }
        }
    }
}

/// The lcore table: a row per entry of `lcores` (named by `names`), a
/// column per counter of [`LcoreStats::COUNTERS`] that is one (`IfAny`
/// ones only when a row's value is not zero), in table order, with the
/// derived columns after the counters [`DERIVED_AFTER`] names.
fn lcore_table(lcores: &[&LcoreStats], names: &[String]) -> (Vec<(&'static str, Align)>, Vec<Vec<String>>) {
    let n = Align::Right;
    let mut columns = vec![("LCORE", n)];
    let mut rows: Vec<Vec<String>> = names.iter().take(lcores.len()).map(|s| vec![s.clone()]).collect();
    // Each row's counters in table order, read once.
    let values: Vec<Vec<u64>> = lcores
        .iter()
        .map(|l| l.counters().map(|(_, v)| v).collect())
        .collect();
    for (i, def) in LcoreStats::COUNTERS.iter().enumerate() {
        let column = || values.iter().map(move |v| v[i]);
        let heading = match def.column {
            Column::Hidden => None,
            Column::Always(h) => Some(h),
            Column::IfAny(h) => column().any(|v| v > 0).then_some(h),
        };
        if let Some(h) = heading {
            columns.push((h, n));
            for (row, v) in rows.iter_mut().zip(column()) {
                row.push(match def.kind {
                    Kind::Bytes => mb(v),
                    Kind::Count | Kind::Gauge => v.to_string(),
                });
            }
        }
        for &(_, derived, h) in DERIVED_AFTER.iter().filter(|(after, ..)| *after == def.name) {
            columns.push((h, n));
            for (row, l) in rows.iter_mut().zip(lcores) {
                row.push(derived.value(l));
            }
        }
    }
    (columns, rows)
}

/// The port's own counters (DPDK's `rte_eth_stats`) beside phub's totals
/// over every lcore; `-` where a side has no such counter (the kernel-UDP
/// backend has no port counters at all).
fn render_port(
    backend: &str,
    port: Option<&phub_proto::api::PortStats>,
    phub: &phub_proto::api::LcoreStats,
) -> String {
    let dash = || "-".to_string();
    let port_row = match port {
        Some(p) => vec![
            "port".to_string(),
            p.ipackets.to_string(),
            mb(p.ibytes),
            p.opackets.to_string(),
            mb(p.obytes),
            p.imissed.to_string(),
            p.ierrors.to_string(),
            p.oerrors.to_string(),
            p.rx_nombuf.to_string(),
        ],
        None => std::iter::once("port".to_string())
            .chain(std::iter::repeat_with(dash).take(8))
            .collect(),
    };
    let phub_row = vec![
        "phub".to_string(),
        phub.rx_packets.to_string(),
        mb(phub.rx_bytes),
        phub.tx_packets.to_string(),
        mb(phub.tx_bytes),
        dash(),
        dash(),
        dash(),
        dash(),
    ];
    let n = Align::Right;
    format!(
        "\nport counters beside phub's (all lcores){}\n{}",
        if port.is_none() {
            format!(": none from the {backend} backend")
        } else {
            String::new()
        },
        table(
            &[
                ("", Align::Left),
                ("RX PKTS", n),
                ("RX MB", n),
                ("TX PKTS", n),
                ("TX MB", n),
                ("IMISSED", n),
                ("IERRORS", n),
                ("OERRORS", n),
                ("RX NOMBUF", n),
            ],
            &[port_row, phub_row],
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use phub_proto::api::{ClockStats, DataplaneStats, JobLive, LcoreStats, PortStats, RankStatus};

    #[test]
    fn watch_shows_what_changed_per_second() {
        let at = |rx: u64, rounds: u64, dropped: u64| {
            let mut l = LcoreStats {
                lcore: 1,
                rx_bytes: rx,
                rounds_completed: rounds,
                ..LcoreStats::default()
            };
            l.drops.insert("stale".into(), dropped);
            Stats {
                dataplane: Some(DataplaneStats {
                    spin_us: None,
                    backend: phub_proto::api::BackendKind::Udp,
                    lcores: vec![l],
                    jobs: vec![JobLive {
                        id: 3,
                        pushes: 0,
                        rounds_completed: rounds,
                        round_range: None,
                        silent_ms: Vec::new(),
                        clock: ClockStats::default(),
                        copies: None,
                        tables: Vec::new(),
                    }],
                    port: None,
                }),
                dataplane_error: None,
                appliances: Vec::new(),
                jobs: vec![summary(3, "toy", 0)],
            }
        };
        let t = render_rates(&at(1_000_000_000, 10, 1), &at(5_000_000_000, 30, 5), 2.0);
        assert!(t.contains("over the last 2.0 s"), "{t}");
        let row = t.lines().find(|l| l.starts_with("dataplane")).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        // 4 GB in 2 s; 20 rounds; 4 drops.
        assert_eq!(
            cols,
            ["dataplane", "1", "2.00", "0.00", "0.00", "10.00", "0.00", "2.00"],
            "{t}"
        );
        assert!(t.contains("job 3 (toy): 10.00 chunk rounds/s"), "{t}");
        // A restarted dataplane's counters went back: no rate.
        let t = render_rates(&at(5_000_000_000, 30, 5), &at(1, 1, 0), 1.0);
        assert!(
            t.lines().any(|l| l.starts_with("dataplane") && l.contains(" - ")),
            "{t}"
        );
    }

    fn summary(id: u16, name: &str, mem: u64) -> JobSummary {
        JobSummary {
            id,
            name: name.into(),
            workers: 4,
            joined: vec![0, 2],
            keys: 3,
            chunks: 120,
            dtype: "f32".into(),
            optimizer: "sgd".into(),
            memory_bytes: mem,
            appliances: vec!["default".into()],
            installed: true,
            failed: None,
            held: None,
        }
    }

    #[test]
    fn list_is_an_aligned_table() {
        let t = render_list(&[summary(1, "resnet50", 13 << 20), summary(12, "bert", 512)]);
        assert_eq!(
            t,
            "ID  NAME      WORKERS  JOINED  KEYS  CHUNKS  DTYPE  OPTIMIZER    MEMORY  INSTALLED\n\
             \x201  resnet50        4       2     3     120  f32    sgd        13.0 MiB  yes\n\
             12  bert            4       2     3     120  f32    sgd           512 B  yes\n"
        );
        assert_eq!(render_list(&[]), "no jobs admitted\n");
        let mut failed = summary(3, "lost", 512);
        failed.installed = false;
        failed.failed = Some("placed on 4 lcores (up to lcore 3), the dataplane now has 2".into());
        let t = render_list(&[failed]);
        assert!(t.lines().nth(1).is_some_and(|l| l.ends_with("  FAILED")), "{t}");
        let mut held = summary(4, "kept", 512);
        held.installed = false;
        held.held = Some("part on appliance \"b\": checkpoint /s.job-4.b.ckpt unusable: checksum".into());
        let t = render_list(&[held]);
        assert!(t.lines().nth(1).is_some_and(|l| l.ends_with("  HELD")), "{t}");
    }

    #[test]
    fn retry_says_what_each_part_got() {
        let r = RetryResponse {
            id: 4,
            parts: vec![
                phub_proto::api::RetriedPart {
                    appliance: "b".into(),
                    file: "/s.job-4.b.ckpt".into(),
                    checkpoint: RetriedCheckpoint::Usable {
                        round_range: Some((3, 3)),
                    },
                    install: RetriedInstall::Installed,
                },
                phub_proto::api::RetriedPart {
                    appliance: "c".into(),
                    file: "/s.job-4.c.ckpt".into(),
                    checkpoint: RetriedCheckpoint::SetAside {
                        moved_to: Some("/s.job-4.c.ckpt.discarded-1".into()),
                    },
                    install: RetriedInstall::Pending { why: "down".into() },
                },
            ],
        };
        let t = render_retry(&r);
        assert!(
            t.contains("appliance \"b\": checkpoint /s.job-4.b.ckpt usable (round 3); restored from it\n"),
            "{t}"
        );
        assert!(
            t.contains("set aside as /s.job-4.c.ckpt.discarded-1; not installed yet (down)"),
            "{t}"
        );
    }

    #[test]
    fn admit_prints_id_token_and_join_hint() {
        let r = AdmitResponse {
            id: 3,
            token: 0xab,
            chunks: 10,
            memory_bytes: 2048,
            shm_bytes: 0,
            lcores: vec![0, 1, 2, 5],
            appliances: vec!["default".into()],
        };
        let t = render_admit(&r, "http://h:1", Some(4));
        assert!(
            t.contains("admitted job 3: 10 chunks, 2.0 KiB on lcores 0-2,5"),
            "{t}"
        );
        assert!(t.contains("token  00000000000000ab"), "{t}");
        assert!(
            t.contains("POST http://h:1/v1/jobs/3/join {\"token\": \"00000000000000ab\", \"rank\": R} for R in 0..=3"),
            "{t}"
        );
    }

    #[test]
    fn map_shows_runs_per_lcore_and_one_keys_chunks() {
        use phub_proto::api::{KeyMap, KeyRun, LcoreShare};
        let m = JobMap {
            id: 2,
            chunk_elems: 16,
            keys_total: 1_000_000,
            chunks: 1_000_000,
            memory_bytes: 400 << 20,
            lcores: vec![
                LcoreShare {
                    appliance: "a".into(),
                    lcore: 0,
                    port: 9000,
                    first: 0,
                    slots: 500_000,
                    bytes: 200 << 20,
                },
                LcoreShare {
                    appliance: "a".into(),
                    lcore: 1,
                    port: 9001,
                    first: 500_000,
                    slots: 500_000,
                    bytes: 200 << 20,
                },
            ],
            keys: vec![KeyMap {
                key: 7,
                name: String::new(),
                elements: 40,
                first: 499_999,
                runs: vec![
                    KeyRun {
                        appliance: "a".into(),
                        lcore: 0,
                        chunk: 0,
                        slot: 499_999,
                        count: 1,
                    },
                    KeyRun {
                        appliance: "a".into(),
                        lcore: 1,
                        chunk: 1,
                        slot: 0,
                        count: 2,
                    },
                ],
            }],
        };
        let t = render_map(&m);
        assert!(
            t.contains(
                "job 2: 1000000 keys, 1000000 chunks of up to 16 elements over 2 lcores, memory 400.0 MiB"
            ),
            "{t}"
        );
        assert!(t.contains("500000..1000000"), "{t}");
        assert!(
            t.contains("key 7 (unnamed): 40 elements, 3 chunks (sequence 499999..500002)"),
            "{t}"
        );
        assert!(t.contains("1..3") && t.contains("499999..500000"), "{t}");
    }

    #[test]
    fn show_has_rank_lines() {
        let spec = JobSpec::from_toml(
            "name = \"x\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 9\n",
        )
        .unwrap();
        let d = JobDetail {
            summary: summary(1, "x", 100),
            spec,
            keys_omitted: 0,
            ranks: vec![
                RankStatus {
                    rank: 0,
                    joined: true,
                    silent_ms: Some(1500),
                },
                RankStatus {
                    rank: 1,
                    joined: false,
                    silent_ms: None,
                },
            ],
            rounds_completed: 7,
            round_range: Some((3, 4)),
            clock: ClockStats::default(),
            checkpoint: None,
            parts: Vec::new(),
            epoch: None,
            replicas: None,
            tables: Vec::new(),
        };
        let t = render_show(&d);
        assert!(
            t.contains(
                "RANK  JOINED  DATAPLANE\n   0  yes     silent for 1.5 s\n   1  no      never heard from\n"
            ),
            "{t}"
        );
        assert!(
            t.contains("rounds completed 7, last completed round 3..=4"),
            "{t}"
        );
        assert!(!t.contains("FAILED"), "{t}");
        assert!(!t.contains("epoch"), "not replicated: no epoch line: {t}");
        let mut d = d;
        // A replicated job after failover: its epoch, who is down, and
        // the down part out of the job (not waited for).
        d.spec.placement = Some(phub_proto::spec::PlacementSpec {
            appliances: phub_proto::spec::Appliances::Count(2),
            hierarchical: false,
            ranks_per_rack: None,
            replicas: 2,
        });
        let part = |name: &str, down: Option<&str>| phub_proto::api::JobPart {
            appliance: name.into(),
            rack: String::new(),
            lcores: 1,
            chunks: (0, 1),
            memory_bytes: 0,
            installed: down.is_none(),
            down: down.map(String::from),
            rounds_completed: 0,
            round_range: None,
            ranks: None,
        };
        d.parts = vec![part("a", None), part("b", Some("declared down"))];
        d.epoch = Some(phub_proto::failover::EpochView {
            epoch: 1,
            down: vec![1],
            ..Default::default()
        });
        let t = render_show(&d);
        assert!(
            t.contains("replicas 2, epoch 1, appliances down: b\n") && t.contains("OUT (declared down)"),
            "{t}"
        );
        assert!(!t.contains("went back"), "{t}");
        // A job that went back to its checkpoints says when.
        d.epoch = Some(phub_proto::failover::EpochView {
            epoch: 4,
            down: vec![1],
            restored: 3,
            ..Default::default()
        });
        let t = render_show(&d);
        assert!(
            t.contains("epoch 4, appliances down: b\nwent back to its checkpoints at epoch 3"),
            "{t}"
        );
        d.epoch = Some(phub_proto::failover::EpochView {
            epoch: 1,
            down: vec![1],
            ..Default::default()
        });
        // Re-replication (PROTOCOL.md §11.7): replicas live and wanted,
        // the state, and once done the time to full strength and bytes.
        let mut x = phub_proto::api::Rereplication {
            appliance: "b".into(),
            epoch: 2,
            started_unix_ms: 10_000,
            ended_unix_ms: None,
            bytes_copied: None,
            abandoned: None,
            replaced: None,
        };
        d.replicas = Some(phub_proto::api::ReplicaStrength {
            wanted: 2,
            live: 1,
            state: phub_proto::api::Strength::Rereplicating,
            rereplication: Some(x.clone()),
            stalled: None,
        });
        let t = render_show(&d);
        assert!(
            t.contains("replicas live 1 of 2 (re-replicating)\nre-replication to b at epoch 2: under way"),
            "{t}"
        );
        x.ended_unix_ms = Some(10_250);
        x.bytes_copied = Some(4096);
        d.replicas = Some(phub_proto::api::ReplicaStrength {
            wanted: 2,
            live: 2,
            state: phub_proto::api::Strength::FullStrength,
            rereplication: Some(x.clone()),
            stalled: None,
        });
        let t = render_show(&d);
        assert!(
            t.contains(
                "replicas live 2 of 2 (full strength)\nre-replication to b at epoch 2: full strength 250 ms \
                        after it answered again, 4.0 KiB copied"
            ),
            "{t}"
        );
        // A drain's or a spare's: the appliance it took the place of.
        x.appliance = "d".into();
        x.replaced = Some("b".into());
        d.replicas = Some(phub_proto::api::ReplicaStrength {
            wanted: 2,
            live: 2,
            state: phub_proto::api::Strength::FullStrength,
            rereplication: Some(x),
            stalled: None,
        });
        let t = render_show(&d);
        assert!(
            t.contains("re-replication to d at epoch 2 (in place of b): full strength 250 ms after it took the place"),
            "{t}"
        );
        // Stalled: every replica of a part down.
        d.replicas = Some(phub_proto::api::ReplicaStrength {
            wanted: 2,
            live: 0,
            state: phub_proto::api::Strength::Stalled,
            rereplication: None,
            stalled: Some("part 0 lost; it waits".into()),
        });
        let t = render_show(&d);
        assert!(
            t.contains("replicas live 0 of 2 (stalled)\nSTALLED: part 0 lost; it waits"),
            "{t}"
        );
        d.replicas = None;
        d.epoch = None;
        d.parts.clear();
        d.spec.placement = None;
        d.summary.failed = Some("the dataplane refuses to install it: bad layout".into());
        let t = render_show(&d);
        assert!(
            t.contains("FAILED: the dataplane refuses to install it: bad layout\n  (joins are refused"),
            "{t}"
        );
        d.summary.failed = None;
        d.summary.held = Some("part on appliance \"b\": checkpoint F unusable: checksum".into());
        let t = render_show(&d);
        assert!(
            t.contains("HELD: part on appliance \"b\": checkpoint F unusable: checksum\n")
                && t.contains("phubctl job retry"),
            "{t}"
        );
        // A job's tables: one line each, named by key and name.
        d.summary.held = None;
        assert!(
            !render_show(&d).contains("TABLE"),
            "no table section without tables"
        );
        d.tables = vec![phub_proto::api::TableLive {
            key: 0,
            rows_stored: 1200,
            created: 1500,
            evicted_cap: 300,
            evicted_idle: 0,
            updates: 4000,
            lookups: 2500,
            not_admitted: 2,
            no_memory: 1,
            bytes: 3 << 20,
            blocks_made_on_lcore: 0,
        }];
        let t = render_show(&d);
        let name = &d.spec.keys[0].name;
        let line = t
            .lines()
            .find(|l| l.starts_with(&format!("0 ({name})")))
            .unwrap_or_else(|| panic!("{t}"));
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert!(t.contains("TABLE") && t.contains("EVICTED CAP / IDLE"), "{t}");
        assert!(
            cols.ends_with(&["1200", "1500", "300", "/", "0", "4000", "2500", "3", "3.0", "MiB"]),
            "{line}"
        );
    }

    #[test]
    fn show_has_the_consistency_mode_and_each_rank_s_clock() {
        let spec = JobSpec::from_toml(
            "name = \"x\"\nworkers = 3\nconsistency = { bounded_delay = 2 }\n[optimizer]\nkind = \"sum\"\n\
             [[keys]]\nelements = 9\n",
        )
        .unwrap();
        let rank = |rank| RankStatus {
            rank,
            joined: true,
            silent_ms: Some(10),
        };
        let mut d = JobDetail {
            summary: summary(1, "x", 100),
            spec,
            keys_omitted: 0,
            ranks: vec![rank(0), rank(1), rank(2)],
            rounds_completed: 40,
            round_range: Some((20, 20)),
            clock: ClockStats {
                clocks: vec![(9, 9), (8, 9), (7, 7)],
                max_lead: Some(3),
                held: 2,
                held_total: 17,
                held_wait_us: 12_345,
                held_wait_max_us: 800,
            },
            checkpoint: None,
            parts: Vec::new(),
            epoch: None,
            replicas: None,
            tables: Vec::new(),
        };
        let t = render_show(&d);
        assert!(
            t.contains("consistency bounded_delay, τ = 2 (an answer waits until no rank is more than 2 clocks behind; a rank leads by at most 3)\nlargest lead allowed 3 clocks, answers held now 2\n\
                answers held so far 17, their waits 12.3 ms in all, 800 µs at most\n"),
            "{t}"
        );
        assert!(
            t.contains(
                "RANK  JOINED  CLOCK  DATAPLANE\n   0  yes     9      silent for 10 ms\n   1  yes     8..=9  silent for 10 ms\n   2  yes     7      silent for 10 ms\n"
            ),
            "{t}"
        );
        d.spec.consistency = Consistency::Async;
        d.clock.max_lead = None;
        let t = render_show(&d);
        assert!(
            t.contains("consistency async (each push applied and answered at once)\nlargest lead allowed: none yet\n"),
            "{t}"
        );
        assert!(!t.contains("held"), "{t}");
        d.spec.consistency = Consistency::Sync;
        let t = render_show(&d);
        assert!(
            t.contains("consistency sync (BSP") && !t.contains("CLOCK") && !t.contains("lead"),
            "{t}"
        );
    }

    #[test]
    fn stats_tables() {
        let s = Stats {
            appliances: Vec::new(),
            dataplane: Some(DataplaneStats {
                spin_us: None,
                port: None,
                backend: phub_proto::api::BackendKind::Udp,
                lcores: vec![
                    LcoreStats {
                        lcore: 0,
                        rx_packets: 1000,
                        rx_bytes: 8_500_000,
                        busy_loops: 1,
                        idle_loops: 3,
                        drops: [("bad_token".to_string(), 2)].into(),
                        ..Default::default()
                    },
                    LcoreStats {
                        lcore: 1,
                        ..Default::default()
                    },
                ],
                jobs: vec![JobLive {
                    id: 1,
                    pushes: 5,
                    rounds_completed: 2,
                    round_range: Some((1, 2)),
                    silent_ms: vec![],
                    clock: ClockStats::default(),
                    copies: None,
                    tables: Vec::new(),
                }],
            }),
            dataplane_error: None,
            jobs: vec![summary(1, "a", 1024)],
        };
        let t = render_stats(&s);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[2].starts_with("LCORE  RX PKTS  RX MB"), "{t}");
        assert!(lines[2].ends_with("DROPS  MISROUTED  ARP  BUSY%"), "{t}");
        assert!(lines[3].starts_with("    0     1000    8.5"), "{t}");
        assert!(lines[3].ends_with("2          0    0   25.0"), "{t}");
        assert!(lines[4].ends_with("-"), "{t}");
        assert!(lines[5].starts_with("  all     1000"), "{t}");
        assert!(
            t.contains("REASON     LCORE  DROPS\nbad_token      0      2\n"),
            "{t}"
        );
        // The kernel-UDP backend has no port: the same section, all dashes.
        assert!(
            t.contains(
                "port counters beside phub's (all lcores): none from the udp backend\n\
                 \x20     RX PKTS  RX MB  TX PKTS  TX MB  IMISSED  IERRORS  OERRORS  RX NOMBUF\n\
                 port        -      -        -      -        -        -        -          -\n\
                 phub     1000    8.5        0    0.0        -        -        -          -\n"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "job 1 \"a\": 2/4 joined, installed, 1.0 KiB, 5 pushes, 2 rounds (chunks at round 1..=2)"
            ),
            "{t}"
        );
        let down = render_stats(&Stats {
            appliances: Vec::new(),
            dataplane: None,
            dataplane_error: Some("cannot reach the dataplane".into()),
            jobs: vec![],
        });
        assert!(
            down.starts_with("dataplane: unreachable: cannot reach the dataplane\n"),
            "{down}"
        );
    }

    #[test]
    fn shared_memory_messages_get_a_column_only_when_there_are_any() {
        let lcore = |i: u16, shm_rx: u64| LcoreStats {
            lcore: i,
            rx_packets: 100,
            shm_rx,
            ..Default::default()
        };
        let stats = |lcores| Stats {
            appliances: Vec::new(),
            dataplane: Some(DataplaneStats {
                spin_us: None,
                backend: phub_proto::api::BackendKind::Udp,
                port: None,
                lcores,
                jobs: vec![],
            }),
            dataplane_error: None,
            jobs: vec![],
        };
        let t = render_stats(&stats(vec![lcore(0, 60), lcore(1, 40)]));
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[2].ends_with("SHM RX"), "{t}");
        assert!(lines[3].ends_with(" 60") && lines[4].ends_with(" 40"), "{t}");
        assert!(
            lines[5].trim_start().starts_with("all") && lines[5].ends_with(" 100"),
            "{t}"
        );
        let t = render_stats(&stats(vec![lcore(0, 0), lcore(1, 0)]));
        assert!(!t.contains("SHM RX"), "{t}");
    }

    #[test]
    fn dpdk_stats_show_the_port_beside_phub_and_misrouted_and_arp_per_lcore() {
        let lcore = |i: u16, misrouted: u64, arp: u64| LcoreStats {
            lcore: i,
            rx_packets: 500,
            rx_bytes: 4_000_000,
            tx_packets: 1500,
            tx_bytes: 12_000_000,
            misrouted,
            arp_replies: arp,
            ..Default::default()
        };
        let s = Stats {
            appliances: Vec::new(),
            dataplane: Some(DataplaneStats {
                spin_us: None,
                backend: phub_proto::api::BackendKind::Dpdk,
                port: Some(PortStats {
                    ipackets: 1012,
                    opackets: 3001,
                    ibytes: 8_100_000,
                    obytes: 24_000_000,
                    imissed: 7,
                    ierrors: 1,
                    oerrors: 2,
                    rx_nombuf: 3,
                }),
                lcores: vec![lcore(0, 4, 1), lcore(1, 9, 0)],
                jobs: vec![],
            }),
            dataplane_error: None,
            jobs: vec![],
        };
        let t = render_stats(&s);
        assert!(t.starts_with("dataplane: dpdk backend, 2 lcores\n"), "{t}");
        // A kernel-UDP dataplane says how long its lcores spin.
        let mut udp = s.clone();
        let d = udp.dataplane.as_mut().unwrap();
        (d.backend, d.spin_us, d.port) = (phub_proto::api::BackendKind::Udp, Some(200), None);
        let u = render_stats(&udp);
        assert!(
            u.starts_with(
                "dataplane: udp backend, 2 lcores, lcores spin 200 us past traffic before they sleep\n"
            ),
            "{u}"
        );
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[3].ends_with("0          4    1      -"), "{t}");
        assert!(lines[4].ends_with("0          9    0      -"), "{t}");
        assert!(
            lines[5].starts_with("  all     1000    8.0     3000   24.0"),
            "{t}"
        );
        assert!(lines[5].ends_with("0         13    1      -"), "{t}");
        assert!(
            t.contains(
                "port counters beside phub's (all lcores)\n\
                 \x20     RX PKTS  RX MB  TX PKTS  TX MB  IMISSED  IERRORS  OERRORS  RX NOMBUF\n\
                 port     1012    8.1     3001   24.0        7        1        2          3\n\
                 phub     1000    8.0     3000   24.0        -        -        -          -\n"
            ),
            "{t}"
        );
        // The JSON form carries the port counters as the API has them.
        let json = render(true, s, |_| String::new());
        assert!(
            json.contains("\"rx_nombuf\": 3") && json.contains("\"arp_replies\": 1"),
            "{json}"
        );
    }

    #[test]
    fn ranges() {
        assert_eq!(lcore_ranges(&[]), "none");
        assert_eq!(lcore_ranges(&[2]), "2");
        assert_eq!(lcore_ranges(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
    }
}
