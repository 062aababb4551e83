//! How the daemon runs: its command line ([`Args`]), the [`Config`] it
//! becomes, the token files' default paths, and the appliances as the
//! operator writes them (`--appliance`, `POST /v1/appliances`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use phub_proto::api::ApplianceSpec;
use phub_proto::spec::{appliance_name_ok, APPLIANCE_NAME_RULE};

use crate::state::etcd::{EtcdFlags, EtcdTarget};
use crate::state::{self, DEFAULT_APPLIANCE};

/// How the daemon runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Address the HTTP API listens on; port 0 picks a free one.
    pub listen: SocketAddr,
    /// Base URL of the management API of the appliance "default", used
    /// when neither `appliances` nor the state file names any appliance.
    pub dataplane: String,
    /// Appliances given at start (`--appliance`, and `--dataplane` as the
    /// one named "default"). They join those the state file records; one
    /// of the same name replaces the recorded one.
    pub appliances: Vec<ApplianceSpec>,
    /// The state file; with `etcd`, the path whose siblings are the
    /// checkpoint files and, by default, the operator token file.
    pub state: PathBuf,
    /// The state in etcd instead of the file `state` (several controls on
    /// one prefix, one leading; see `daemon::leader`).
    pub etcd: Option<EtcdTarget>,
    /// The URL this control's API is reached at, which followers name to
    /// clients (default: the address it is bound to).
    pub advertise: Option<String>,
    /// The time to live of the leader lease (etcd only).
    pub lease_ttl: Duration,
    /// How often the dataplanes' jobs are compared with the admitted ones.
    pub reconcile_interval: Duration,
    /// The operator token file (default: the state file's path with
    /// `.operator-token` appended). Created with a random token, readable by
    /// its owner only, when missing.
    pub operator_token: Option<PathBuf>,
    /// The management token file of `dataplane` (default: the dataplane's
    /// default for its port; see [`phub_http::secret::mgmt_token_path`]).
    pub dataplane_token: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain and private key.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Listen beyond loopback in clear text (refused without it).
    pub insecure_listen: bool,
    /// How often every appliance is sent a heartbeat, and how long one
    /// may go unanswered before it is declared down ([`Heartbeat`]).
    pub heartbeat: Heartbeat,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 7700)),
            dataplane: "http://127.0.0.1:7800".into(),
            appliances: Vec::new(),
            state: PathBuf::from("phub-control.state.json"),
            etcd: None,
            advertise: None,
            lease_ttl: Duration::from_secs(2),
            reconcile_interval: Duration::from_secs(2),
            operator_token: None,
            dataplane_token: None,
            tls: None,
            insecure_listen: false,
            heartbeat: Heartbeat::default(),
        }
    }
}

/// The heartbeat's timing (PROTOCOL.md §11.6, detection): every
/// `interval`, control asks every appliance `GET /v1/auth` on its
/// management API; one that has answered none for `deadline` is declared
/// down. Refused, naming the key, unless `0 < interval < deadline`
/// ([`Heartbeat::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// Between two heartbeats to an appliance.
    pub interval: Duration,
    /// Without an answer for this long, an appliance is declared down.
    pub deadline: Duration,
    /// Declared down for this long, an appliance's replicated jobs move
    /// to spares (PROTOCOL.md §11.8); `None`: only `phubctl appliance
    /// drain` moves them.
    pub spare_after: Option<Duration>,
}

/// [`Heartbeat::interval`]'s default, in milliseconds.
pub const HEARTBEAT_MS: u64 = 100;
/// [`Heartbeat::deadline`]'s default, in milliseconds: failover within
/// about 0.6 s of a death (the deadline and one interval), 3 missed
/// heartbeats, and above the slowest management round trip measured on a
/// loaded 2-core machine (README.md, "Failover").
pub const HEARTBEAT_DEADLINE_MS: u64 = 500;
/// The longest deadline accepted, in milliseconds (an hour): beyond it an
/// appliance's death would go unnoticed for good.
pub const MAX_HEARTBEAT_DEADLINE_MS: u64 = 3_600_000;

impl Default for Heartbeat {
    fn default() -> Heartbeat {
        Heartbeat {
            interval: Duration::from_millis(HEARTBEAT_MS),
            deadline: Duration::from_millis(HEARTBEAT_DEADLINE_MS),
            spare_after: None,
        }
    }
}

impl Heartbeat {
    /// Checks the timing: an interval of at least 1 ms, a deadline longer
    /// than the interval (a deadline within one interval declares an
    /// appliance down between two heartbeats it answers) and at most
    /// [`MAX_HEARTBEAT_DEADLINE_MS`]. The error names the key and value and
    /// says what is accepted.
    pub fn check(&self) -> Result<(), String> {
        let (i, d) = (self.interval.as_millis(), self.deadline.as_millis());
        if i == 0 {
            return Err(format!(
                "heartbeat-ms = {i}: expected at least 1 (milliseconds between heartbeats; default {HEARTBEAT_MS})"
            ));
        }
        if d <= i {
            return Err(format!(
                "heartbeat-deadline-ms = {d}: expected more than heartbeat-ms ({i}), so that an appliance \
                 misses at least one heartbeat before it is declared down (default {HEARTBEAT_DEADLINE_MS})"
            ));
        }
        if d > u128::from(MAX_HEARTBEAT_DEADLINE_MS) {
            return Err(format!(
                "heartbeat-deadline-ms = {d}: expected at most {MAX_HEARTBEAT_DEADLINE_MS} (an hour)"
            ));
        }
        Ok(())
    }
}

impl Config {
    /// Where the operator token lives.
    pub fn operator_token_path(&self) -> PathBuf {
        self.operator_token
            .clone()
            .unwrap_or_else(|| default_token_path(&self.state))
    }

    /// Where the management token of `dataplane` lives.
    pub fn dataplane_token_path(&self) -> PathBuf {
        self.dataplane_token
            .clone()
            .unwrap_or_else(|| default_mgmt_token_path(&self.dataplane))
    }

    /// The appliance "default" that `dataplane` names.
    pub(super) fn default_appliance(&self) -> ApplianceSpec {
        ApplianceSpec {
            name: DEFAULT_APPLIANCE.into(),
            url: self.dataplane.clone(),
            rack: String::new(),
            token_file: self.dataplane_token.as_ref().map(|p| p.display().to_string()),
            draining: false,
        }
    }
}

/// The management token file a dataplane at `url` keeps by default: the
/// dataplane's default for the URL's port.
pub fn default_mgmt_token_path(url: &str) -> PathBuf {
    // The port of the URL: what follows the host's last colon.
    let authority = url.split("://").nth(1).unwrap_or(url);
    let authority = authority.split('/').next().unwrap_or(authority);
    let port = authority
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(80);
    phub_http::secret::mgmt_token_path(port)
}

/// The management token file control reads for `a`.
pub(super) fn token_path_of(a: &ApplianceSpec) -> PathBuf {
    a.token_file
        .as_ref()
        .map_or_else(|| default_mgmt_token_path(&a.url), PathBuf::from)
}

/// Checks an appliance as the operator gives it: its name and URL.
pub fn check_appliance(a: &ApplianceSpec) -> Result<(), String> {
    if !appliance_name_ok(&a.name) {
        return Err(format!(
            "appliance name {:?}: expected {APPLIANCE_NAME_RULE}",
            a.name
        ));
    }
    if !(a.url.starts_with("http://") || a.url.starts_with("https://")) || a.url.len() > 2048 {
        return Err(format!(
            "appliance {:?}: url {:?} is not an http:// or https:// URL of its management API",
            a.name, a.url
        ));
    }
    if a.rack.chars().count() > 128 || a.rack.chars().any(char::is_control) {
        return Err(format!(
            "appliance {:?}: rack {:?}: expected at most 128 characters, none of them a control character",
            a.name, a.rack
        ));
    }
    Ok(())
}

/// Parses `--appliance name=a,url=http://127.0.0.1:7800[,rack=r1][,token-file=PATH]`.
pub fn parse_appliance(text: &str) -> Result<ApplianceSpec, String> {
    let (mut name, mut url, mut rack, mut token_file) = (None, None, String::new(), None);
    for field in text.split(',') {
        let (k, v) = field
            .split_once('=')
            .ok_or_else(|| format!("{field:?} in {text:?}: expected key=value"))?;
        match k.trim() {
            "name" => name = Some(v.trim().to_string()),
            "url" => url = Some(v.trim().to_string()),
            "rack" => rack = v.trim().to_string(),
            "token-file" => token_file = Some(v.trim().to_string()),
            other => {
                return Err(format!(
                    "{other:?} in {text:?}: expected name=, url=, rack= or token-file="
                ))
            }
        }
    }
    let a = ApplianceSpec {
        name: name.ok_or_else(|| format!("{text:?}: name= is missing"))?,
        url: url.ok_or_else(|| format!("{text:?}: url= is missing"))?,
        rack,
        token_file,
        draining: false,
    };
    check_appliance(&a)?;
    Ok(a)
}

/// The operator token file that goes with a state file.
pub fn default_token_path(state: &std::path::Path) -> PathBuf {
    state::sibling(state, ".operator-token")
}

/// Reads the operator token, or creates the file with a new random one
/// (mode 0600, created exclusively so a racing start cannot clobber it).
pub(super) fn load_or_create_token(path: &std::path::Path) -> anyhow::Result<String> {
    let (token, made) = phub_http::secret::load_or_create(path).context("the operator token file")?;
    if made {
        log::info!("generated the operator token in {} (owner-only)", path.display());
    }
    Ok(token)
}

/// The configuration file read when `--config` is not given, if it exists
/// (see `phub_appliance::config`).
pub const CONFIG_FILE: &str = "/etc/phub/control.toml";

/// phub-control: admits jobs, maps chunks to lcores, answers workers.
#[derive(Debug, Parser)]
#[command(name = "phub-control", version)]
pub(super) struct Args {
    /// Address the HTTP API listens on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub(super) listen: SocketAddr,
    /// Base URL of the management API of the appliance named "default"
    /// [default: http://127.0.0.1:7800 when neither --appliance nor the
    /// state file names an appliance].
    #[arg(long)]
    pub(super) dataplane: Option<String>,
    /// An appliance: `name=a,url=http://127.0.0.1:7800[,rack=r1][,token-file=PATH]`
    /// (repeat for several). Appliances given here join those the state
    /// file records; `phubctl appliance add|remove` changes them at run time.
    #[arg(long, value_name = "SPEC", value_parser = parse_appliance)]
    pub(super) appliance: Vec<ApplianceSpec>,
    /// Where the state (appliances and admitted jobs) is kept: a file,
    /// written atomically after every change, or
    /// `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`, where several controls
    /// share it and one leads (TLS and credentials: --etcd-ca,
    /// --etcd-cert, --etcd-user).
    #[arg(long, value_name = "FILE|etcd://...", default_value = "phub-control.state.json", value_parser = parse_state)]
    pub(super) state: StateArg,
    /// With --state etcd://: the directory of the checkpoint files and of
    /// the operator token file (default); every control of the prefix
    /// needs the same token file and, to restore checkpoints another
    /// control took, the same (shared) directory.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub(super) state_dir: PathBuf,
    /// With --state etcd://: the URL of this control's API that followers
    /// name to clients [default: http(s)://the address it is bound to].
    #[arg(long, value_name = "URL")]
    pub(super) advertise_url: Option<String>,
    /// With --state etcd://: seconds the leader lease lives without renewal
    /// (renewed every quarter of it); etcd raises a TTL below its minimum
    /// (2 s with its default election timeout).
    #[arg(long, value_name = "SECONDS", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(super) lease_ttl: u64,
    /// Milliseconds between reconciliations with the dataplanes.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) reconcile_ms: u64,
    /// Operator token file (admission, eviction, checkpoints and appliance
    /// changes need the token); default: the state file's path +
    /// `.operator-token`.
    #[arg(long)]
    pub(super) operator_token_file: Option<PathBuf>,
    /// The management token file of --dataplane (its --mgmt-token-file);
    /// default: the dataplane's default for the port of --dataplane.
    #[arg(long, value_name = "FILE")]
    pub(super) dataplane_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub(super) etcd: EtcdFlags,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub(super) tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub(super) tls_key: Option<PathBuf>,
    /// Listen beyond loopback in clear text (tokens and job specs then
    /// cross the network unprotected). Without it, a non-loopback --listen
    /// needs --tls-cert and --tls-key.
    #[arg(long)]
    pub(super) insecure_listen: bool,
    /// Milliseconds between heartbeats to each appliance (PROTOCOL.md
    /// §11.6).
    #[arg(long, default_value_t = HEARTBEAT_MS)]
    pub(super) heartbeat_ms: u64,
    /// Milliseconds without an answer to a heartbeat after which an
    /// appliance is declared down and each replicated job on it fails
    /// over; more than --heartbeat-ms.
    #[arg(long, default_value_t = HEARTBEAT_DEADLINE_MS)]
    pub(super) heartbeat_deadline_ms: u64,
    /// Milliseconds an appliance stays declared down before each
    /// replicated job on it moves to a spare appliance, as `phubctl
    /// appliance drain` would move it (PROTOCOL.md §11.8); default: never
    /// (the jobs wait for it to answer again, or for the drain).
    #[arg(long, value_name = "MS")]
    pub(super) spare_after_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The heartbeat's keys take their defaults, are read from the
    /// command line (and so from control.toml, whose keys are its flags),
    /// and nonsense is refused naming the key, the value and what is
    /// accepted.
    #[test]
    fn heartbeat_timing_is_parsed_and_nonsense_refused() {
        let a = Args::try_parse_from(["phub-control"]).unwrap();
        assert_eq!(
            (a.heartbeat_ms, a.heartbeat_deadline_ms),
            (HEARTBEAT_MS, HEARTBEAT_DEADLINE_MS)
        );
        Heartbeat::default().check().unwrap();
        let a = Args::try_parse_from([
            "phub-control",
            "--heartbeat-ms",
            "20",
            "--heartbeat-deadline-ms",
            "90",
        ])
        .unwrap();
        assert_eq!((a.heartbeat_ms, a.heartbeat_deadline_ms), (20, 90));
        let h = |i, d| Heartbeat {
            interval: Duration::from_millis(i),
            deadline: Duration::from_millis(d),
            spare_after: None,
        };
        h(20, 90).check().unwrap();
        let e = h(100, 100).check().unwrap_err();
        assert!(
            e.contains("heartbeat-deadline-ms = 100") && e.contains("more than heartbeat-ms (100)"),
            "{e}"
        );
        let e = h(200, 50).check().unwrap_err();
        assert!(e.contains("heartbeat-deadline-ms = 50"), "{e}");
        let e = h(0, 500).check().unwrap_err();
        assert!(e.contains("heartbeat-ms = 0") && e.contains("at least 1"), "{e}");
        let e = h(100, MAX_HEARTBEAT_DEADLINE_MS + 1).check().unwrap_err();
        assert!(e.contains("at most 3600000"), "{e}");
        assert!(Args::try_parse_from(["phub-control", "--heartbeat-ms", "-1"]).is_err());
    }
}

/// `--state` as given: a file or etcd.
#[derive(Debug, Clone)]
pub(super) enum StateArg {
    /// The state file.
    File(PathBuf),
    /// The prefix in etcd.
    Etcd(EtcdTarget),
}

fn parse_state(text: &str) -> Result<StateArg, String> {
    if EtcdTarget::is_etcd(text) {
        EtcdTarget::parse(text).map(StateArg::Etcd)
    } else {
        Ok(StateArg::File(PathBuf::from(text)))
    }
}
