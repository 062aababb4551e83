//! A local appliance for `phub-bench run --local`: phub-dataplane and
//! phub-control as child processes on free ports, so that their CPU time can
//! be read from `/proc/PID/stat`, stopped (SIGTERM, then SIGKILL) on drop.
//!
//! By default both are this program itself, re-executed with the hidden
//! `serve-dataplane` / `serve-control` subcommands: they run the very same
//! library code as the `phub-dataplane` and `phub-control` binaries
//! (`phub_dataplane::app::Appliance`, `phub_control::daemon::Daemon`), built
//! in the same build as the benchmark, so a stale binary in `target/` can
//! never be measured by mistake. `--bin-dir DIR` runs the real binaries
//! from DIR instead.
//!
//! With `--backend dpdk` the appliance runs on the virtual rack's network
//! ([`VethNet`]): the dataplane on DPDK's af_packet driver over a veth pair
//! in a private namespace, control and the workers inside it too.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use phub_http::Client;
use phub_hwtests::dataplane_args::{Backend, DataplaneArgs};
use phub_hwtests::process::{self, Daemon};
use phub_hwtests::virt::{self, Netns};
use phub_proto::api::AdmitResponse;
use phub_proto::routes::control;

/// How to start the local appliance.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// Dataplane queues (lcores).
    pub lcores: usize,
    /// `udp` or `dpdk`.
    pub backend: String,
    /// Slot memory budget, bytes.
    pub memory_budget: u64,
    /// Run the real binaries from this directory instead of re-executing
    /// this program.
    pub bin_dir: Option<PathBuf>,
    /// Spin instead of waiting in the kernel when idle.
    pub busy_poll: bool,
    /// Do not pin lcore threads.
    pub no_pin: bool,
    /// Socket buffer per dataplane queue, bytes (None: the dataplane's default).
    pub socket_buffer: Option<usize>,
    /// Environment for the dataplane (e.g. `PHUB_UDP_GSO=0`).
    pub env: Vec<(String, String)>,
    /// More phub-dataplane arguments, as given.
    pub extra_args: Vec<String>,
    /// Shared memory for the workers on this host (`phub-dataplane --shm`;
    /// kernel UDP only).
    pub shm: bool,
    /// With `backend` `dpdk`: the virtual rack's namespace ([`VethNet`]),
    /// which the calling thread is inside; the dataplane runs DPDK's
    /// af_packet driver on its veth pair at [`virt::APPLIANCE_IP`].
    pub veth: Option<String>,
}

/// The virtual rack's network for `run --local --backend dpdk`: a private
/// network namespace holding a veth pair (the tests' set-up,
/// [`phub_hwtests::virt::veth_link`]); the dataplane runs DPDK's af_packet
/// driver on one end, the emulated workers use kernel UDP on the other.
/// The namespace is removed when this is dropped.
#[derive(Debug)]
pub struct VethNet {
    /// The namespace.
    pub ns: Netns,
}

impl VethNet {
    /// Creates `phub-bench-PID` with the veth pair in it; says why not
    /// (not root, no `ip`, no namespaces).
    pub fn create() -> Result<VethNet> {
        if let Some(why) = virt::unavailable() {
            bail!("--backend dpdk with --local runs on a virtual rack, which {why}");
        }
        let ns = Netns::create("bench").map_err(|e| anyhow::anyhow!("creating the namespace: {e}"))?;
        virt::veth_link(&ns).map_err(|e| anyhow::anyhow!("setting up the veth pair in {}: {e}", ns.name))?;
        Ok(VethNet { ns })
    }

    /// Runs `f` on a thread inside the namespace: the processes and threads
    /// it starts, and the addresses it reaches, are the namespace's.
    pub fn inside<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        std::thread::scope(|s| {
            s.spawn(|| {
                self.ns.try_enter().map_err(|e| anyhow::anyhow!("{e}"))?;
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

/// A running local appliance.
#[derive(Debug)]
pub struct Local {
    /// Control's base URL.
    pub control_url: String,
    /// The dataplane's management URL.
    pub mgmt_url: String,
    /// The dataplane process.
    pub dataplane: Daemon,
    /// The control process.
    pub control: Daemon,
    dir: PathBuf,
    /// How the dataplane was started (program, arguments, environment),
    /// for [`Local::restart_dataplane`].
    dp_cmd: (PathBuf, Vec<String>, Vec<(String, String)>),
}

/// Starts `name` ([`Daemon::spawn`]) and waits up to 20 s for its API at
/// `url`.
fn start_daemon(
    name: &str,
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
    url: &str,
) -> Result<Daemon> {
    let mut d = Daemon::spawn(name, program, args, env, log)?;
    d.wait_up(url, Duration::from_secs(20), || false)
        .map_err(|e| anyhow::anyhow!(e))?;
    Ok(d)
}

impl Local {
    /// Starts phub-dataplane, waits for its management API, starts
    /// phub-control and waits for its API.
    pub fn start(o: &LocalOptions) -> Result<Local> {
        let me = std::env::current_exe().context("finding this program")?;
        let (dp_prog, dp_pre, ctl_prog, ctl_pre): (PathBuf, Vec<String>, PathBuf, Vec<String>) =
            match &o.bin_dir {
                None => (
                    me.clone(),
                    vec!["serve-dataplane".into()],
                    me,
                    vec!["serve-control".into()],
                ),
                Some(d) => {
                    let (dp, ctl) = (d.join("phub-dataplane"), d.join("phub-control"));
                    for p in [&dp, &ctl] {
                        if !p.exists() {
                            bail!(
                                "{} not found (build it with `cargo build --release --bins`)",
                                p.display()
                            );
                        }
                    }
                    (dp, vec![], ctl, vec![])
                }
            };
        let dir = std::env::temp_dir().join(format!(
            "phub-bench-{}-{}",
            std::process::id(),
            process::free_port()?
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        process::track_dir(&dir);
        let (mgmt, ctl) = (process::free_port()?, process::free_port()?);
        let mgmt_url = format!("http://127.0.0.1:{mgmt}");
        let control_url = format!("http://127.0.0.1:{ctl}");
        let backend: Backend = o.backend.parse().map_err(anyhow::Error::msg)?;
        let mut dp = DataplaneArgs {
            backend: Some(backend),
            base_port: Some(0),
            lcores: Some(o.lcores),
            mgmt: Some(format!("127.0.0.1:{mgmt}")),
            memory_budget: Some(o.memory_budget.to_string()),
            busy_poll: o.busy_poll,
            no_pin: o.no_pin,
            socket_buffer: o.socket_buffer,
            // Both ways of running it take the flag: serve-dataplane parses
            // phub-dataplane's own options.
            shm: o.shm,
            extra: o.extra_args.clone(),
            ..DataplaneArgs::default()
        };
        if let (Some(ns), Backend::Dpdk) = (&o.veth, backend) {
            dp.host = Some(virt::APPLIANCE_IP.into());
            dp.base_port = Some(virt::BASE_PORT);
            dp.eal = Some(virt::af_packet_eal(o.lcores, ns, o.memory_budget));
        }
        let mut dp_args = dp_pre;
        dp_args.extend(dp.to_args());
        let dataplane = start_daemon(
            "phub-dataplane",
            &dp_prog,
            &dp_args,
            &o.env,
            &dir.join("phub-dataplane.log"),
            &process::dataplane_ready(&mgmt_url),
        )?;
        let mut args = ctl_pre;
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{ctl}"),
            "--dataplane".into(),
            mgmt_url.clone(),
            "--state".into(),
            dir.join("control-state.json").display().to_string(),
        ]);
        let control = start_daemon(
            "phub-control",
            &ctl_prog,
            &args,
            &[],
            &dir.join("phub-control.log"),
            &process::control_ready(&control_url),
        )?;
        Ok(Local {
            control_url,
            mgmt_url,
            dataplane,
            control,
            dir,
            dp_cmd: (dp_prog, dp_args, o.env.clone()),
        })
    }

    /// Stops the dataplane (SIGTERM) and starts it again as it was
    /// started; control then reinstalls its jobs, from their checkpoints
    /// where they have one.
    pub fn restart_dataplane(&mut self) -> Result<()> {
        self.dataplane.stop(Duration::from_secs(5));
        let (prog, args, env) = &self.dp_cmd;
        self.dataplane = start_daemon(
            "phub-dataplane",
            prog,
            args,
            env,
            &self.dir.join("phub-dataplane-2.log"),
            &process::dataplane_ready(&self.mgmt_url),
        )?;
        Ok(())
    }

    /// The operator token the phub-control this program started wrote
    /// beside its state file.
    pub fn operator_token(&self) -> Result<String> {
        let path = self.dir.join("control-state.json.operator-token");
        Ok(std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?
            .trim()
            .to_string())
    }

    /// The dataplane's log so far (its first run's: `phub-dataplane.log`).
    pub fn dataplane_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("phub-dataplane.log")).unwrap_or_default()
    }

    /// Stops both processes and removes the scratch directory.
    pub fn stop(mut self) {
        for d in [&mut self.control, &mut self.dataplane] {
            if !d.stop(Duration::from_secs(5)) {
                eprintln!("phub-bench: {} did not stop on SIGTERM; killed it", d.name());
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        process::untrack_dir(&self.dir);
    }
}

/// The operator token for a phub-control this program did not start:
/// `$PHUB_OPERATOR_TOKEN`, if set.
pub fn env_operator_token() -> Option<String> {
    std::env::var("PHUB_OPERATOR_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
}

/// The client of phub-control at `control_url` with the operator token,
/// calls answered within `timeout`.
pub fn control_client(control_url: &str, token: Option<&str>, timeout: Duration) -> Result<Client> {
    Ok(
        Client::new(control_url, None, ureq::AgentBuilder::new().timeout(timeout))
            .with_context(|| format!("a client of {control_url}"))?
            .with_token(token.map(str::to_string)),
    )
}

/// Admits a job (a spec, TOML or JSON) through phub-control, with the
/// operator token.
pub fn admit(control_url: &str, spec: &str, token: Option<&str>) -> Result<AdmitResponse> {
    let client = control_client(control_url, token, Duration::from_secs(120))?;
    client.send(&control::admit(spec)).map_err(|e| match e.status() {
        Some(code) => anyhow::anyhow!("admission refused (HTTP {code}): {}", e.message()),
        None => anyhow::anyhow!("admission at {control_url}: {e}"),
    })
}

/// Evicts a job; errors are ignored (the run is over either way).
pub fn evict(control_url: &str, job: u16, token: Option<&str>) {
    if let Ok(c) = control_client(control_url, token, Duration::from_secs(30)) {
        let _ = c.send(&control::evict(job));
    }
}

/// `phub-bench serve-dataplane ARGS`: phub-dataplane's program (same flags).
pub fn serve_dataplane(args: &[String]) -> Result<()> {
    use clap::Parser;
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).try_init();
    let mut cfg = phub_dataplane::app::Config::try_parse_from(
        std::iter::once("phub-dataplane".to_string()).chain(args.iter().cloned()),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    cfg.build = format!("phub-bench {}", env!("CARGO_PKG_VERSION"));
    phub_dataplane::app::serve(&cfg)
}

/// `phub-bench serve-control ARGS`: phub-control's program.
pub fn serve_control(args: &ControlArgs) -> Result<()> {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).try_init();
    let d = phub_control::daemon::Daemon::start(phub_control::daemon::Config {
        listen: args.listen,
        dataplane: args.dataplane.clone(),
        state: args.state.clone(),
        reconcile_interval: Duration::from_millis(args.reconcile_ms),
        appliances: args.appliance.clone(),
        insecure_listen: args.insecure_listen,
        heartbeat: phub_control::daemon::Heartbeat {
            interval: Duration::from_millis(args.heartbeat_ms),
            deadline: Duration::from_millis(args.heartbeat_deadline_ms),
            spare_after: None,
        },
        ..phub_control::daemon::Config::default()
    })?;
    wait_for_signal()?;
    d.shutdown();
    Ok(())
}

/// phub-control's flags, for `serve-control`.
#[derive(Debug, Clone, clap::Args)]
pub struct ControlArgs {
    /// Address the HTTP API listens on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: std::net::SocketAddr,
    /// Base URL of the dataplane's management API.
    #[arg(long, default_value = "http://127.0.0.1:7800")]
    pub dataplane: String,
    /// The state file.
    #[arg(long, default_value = "phub-control.state.json")]
    pub state: PathBuf,
    /// Milliseconds between reconciliations with the dataplane.
    #[arg(long, default_value_t = 2000)]
    pub reconcile_ms: u64,
    /// An appliance, as phub-control's `--appliance` (repeatable; the
    /// virtual racks give one per rack).
    #[arg(long, value_name = "SPEC", value_parser = phub_control::daemon::parse_appliance)]
    pub appliance: Vec<phub_proto::api::ApplianceSpec>,
    /// Listen beyond loopback in clear text (the virtual racks' control
    /// listens on the spine namespace's private address).
    #[arg(long)]
    pub insecure_listen: bool,
    /// Milliseconds between heartbeats to each appliance (as phub-control's).
    #[arg(long, default_value_t = phub_control::daemon::HEARTBEAT_MS)]
    pub heartbeat_ms: u64,
    /// An appliance silent this long is declared down (as phub-control's).
    #[arg(long, default_value_t = phub_control::daemon::HEARTBEAT_DEADLINE_MS)]
    pub heartbeat_deadline_ms: u64,
}

fn wait_for_signal() -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("installing the SIGINT/SIGTERM handler")?;
    let _ = rx.recv();
    Ok(())
}
