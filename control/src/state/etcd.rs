//! The state in etcd: what the state file holds, one key per entry under a
//! prefix (`--state etcd://HOST:PORT[,HOST:PORT...]/PREFIX`), and the
//! leader key several phub-controls on one prefix elect their leader by.
//!
//! Keys under PREFIX (`/phub` in `etcd://127.0.0.1:2379/phub`):
//!
//! - `PREFIX/version`: the format version ([`FORMAT_VERSION`]), as text;
//! - `PREFIX/appliances/NAME`: one appliance, JSON as in the state file;
//! - `PREFIX/jobs/ID`: one admitted job (`ID` zero-padded to 5 digits),
//!   JSON as in the state file, token included (etcd's access control
//!   guards it, as the file's mode 0600 does);
//! - `PREFIX/leader`: the leader's advertised URL, bound to its lease;
//! - `PREFIX/pieces/ENTRY/GENERATION/INDEX`: a large entry's pieces
//!   (`ENTRY` as `jobs/00001`, `GENERATION` zero-padded to 20 digits,
//!   `INDEX` to 5), the entry's own key holding a manifest (below).
//!
//! Every write is one transaction that compares the key's mod revision
//! with the one this control last read or wrote (two controls never
//! overwrite each other), and, as fencing, the leader key's create
//! revision with the one this control created when it won: a leader whose
//! lease ran out (paused, partitioned) has its write refused by etcd
//! itself, however late it sends it, and steps down at once.
//!
//! Large values are split ([`Split`]). One etcd request is bounded by
//! etcd's `--max-request-bytes` (1.5 MiB by default), so a value over
//! [`MAX_VALUE_BYTES`] (a job with many keys) is written in pieces of at
//! most that size under `PREFIX/pieces/<entry>/<generation>/<index>`, each
//! piece in a transaction of its own fenced by the leader key, and then the
//! entry's own key gets a small manifest, `{"split": {"generation": G,
//! "pieces": N, "bytes": B}}`, in the one fenced, revision-compared
//! transaction every write is. The manifest is what makes the change
//! atomic: until it is written readers see the old value, from then on the
//! new one; that transaction also deletes the entry's pieces of every other
//! generation (and a value written whole, or deleted, deletes them all).
//! The generation is the entry's mod revision this control read (0 when
//! absent), which every write to the entry raises, so no two manifests of
//! one entry name the same generation. Pieces no manifest names (a write
//! cut off before its manifest) are ignored by readers and deleted by the
//! entry's next write. A value over [`MAX_SPLIT_BYTES`] is refused, naming
//! the key, its size and the bound; so is an answer over it.
//!
//! How control talks to etcd: etcd's JSON gateway (`/v3/kv/range`,
//! `/v3/kv/txn`, `/v3/lease/grant`, `/v3/lease/keepalive`,
//! `/v3/lease/revoke`; keys and values base64, 64-bit integers as strings),
//! served by etcd 3.4 and later on its client port, over ureq, which
//! phub's HTTP client already uses. The gRPC client crate (etcd-client)
//! would bring tonic, prost, tower and tokio-stream (none of them in
//! phub's lock file) and a build script that runs `protoc`, a system
//! package phub does not otherwise need; the gateway adds no crate (base64
//! was already built for rustls).
//!
//! TLS and credentials ([`EtcdSecurity`]: `--etcd-ca`, `--etcd-cert` and
//! `--etcd-key`, `--etcd-user` and `--etcd-password-file`): with a CA or a
//! client certificate the endpoints are `https://` (the server's
//! certificate checked against the CA file, else the system's roots; the
//! client certificate presented when etcd asks, `--client-cert-auth`);
//! with a user, control authenticates (`/v3/auth/authenticate`) and sends
//! etcd's token with every request, authenticating again once when etcd
//! says the token is no longer valid.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use phub_proto::api::ApplianceSpec;
use serde_json::{json, Value};

use super::store::Change;
use super::{StateFile, StoredJob, FORMAT_VERSION};

/// The largest value written whole, and the size of a split value's
/// pieces (1 MiB): under etcd's default request limit (1.5 MiB) with room
/// for the transaction around it.
pub(crate) const MAX_VALUE_BYTES: usize = 1 << 20;

/// The largest value written at all, split (as the largest state file
/// control reads), and the largest answer read from etcd.
// Cast: 1 GiB fits a usize.
#[allow(clippy::cast_possible_truncation)]
pub(crate) const MAX_SPLIT_BYTES: usize = super::MAX_STATE_BYTES as usize;

/// The manifest a split value's key holds (module head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Split {
    split: SplitRef,
}

/// Where a split value's pieces are and what they add up to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SplitRef {
    /// The generation its pieces are under.
    generation: i64,
    /// How many pieces (each [`MAX_VALUE_BYTES`] but the last).
    pieces: u32,
    /// The value's length.
    bytes: u64,
}

/// How long connecting to an etcd endpoint, or a read or write of a
/// request to it, may wait before the next endpoint is tried.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Why etcd could not be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EtcdError {
    /// The `--state` URL is not `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`.
    #[error("--state {url:?}: {reason}; expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX")]
    BadUrl {
        /// As given.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// No endpoint answered.
    #[error("etcd unreachable at {endpoints}: {reason}")]
    Unreachable {
        /// Every endpoint tried.
        endpoints: String,
        /// The last endpoint's error.
        reason: String,
    },
    /// An endpoint answered with an error.
    #[error("etcd at {endpoint} refused {what}: {message}")]
    Refused {
        /// The endpoint.
        endpoint: String,
        /// The request.
        what: &'static str,
        /// etcd's message.
        message: String,
    },
    /// A TLS or credential setting that cannot be used (a file, etcd's
    /// answer to the user).
    #[error("{0}")]
    Security(String),
    /// A stored value is not what phub-control wrote.
    #[error("etcd key {key:?} is corrupt: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The key changed since this control read it: another control wrote.
    #[error(
        "etcd key {key:?} changed since this phub-control read it (revision {read}, now {now}): another \
         phub-control wrote it; nothing was written"
    )]
    Conflict {
        /// The key.
        key: String,
        /// The mod revision read.
        read: i64,
        /// The mod revision now (0: deleted).
        now: i64,
    },
    /// This control does not hold the leader key (any more): nothing was
    /// written.
    #[error(
        "this phub-control is not the leader of {prefix}{}; nothing was written",
        leader_text(leader)
    )]
    NotLeader {
        /// The prefix.
        prefix: String,
        /// The leader's URL, if one leads.
        leader: Option<String>,
    },
    /// A value over [`MAX_SPLIT_BYTES`].
    #[error(
        "etcd key {key:?}: its value is {bytes} bytes, over the {limit} bytes phub-control stores under \
         one key (in pieces of 1 MiB); nothing was written"
    )]
    TooLarge {
        /// The key.
        key: String,
        /// The value's size.
        bytes: usize,
        /// [`MAX_SPLIT_BYTES`].
        limit: usize,
    },
}

fn leader_text(leader: &Option<String>) -> String {
    match leader {
        Some(l) => format!(" (the leader is {l})"),
        None => " (no leader now)".into(),
    }
}

/// Where the state lives in etcd: the endpoints and the prefix, and how
/// to reach them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTarget {
    /// `http://HOST:PORT` of each endpoint, in the order given
    /// (`https://` with TLS: [`EtcdTarget::with_security`]).
    pub endpoints: Vec<String>,
    /// `/PREFIX`, without a trailing slash.
    pub prefix: String,
    /// TLS and credentials (none: plain http, no authentication).
    pub security: EtcdSecurity,
}

/// How control talks to etcd beyond plain http (module head).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdSecurity {
    /// PEM file of the CA that signed etcd's certificate (TLS).
    pub ca: Option<std::path::PathBuf>,
    /// PEM files of the client certificate and its key (mutual TLS).
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// etcd user name, and the file holding its password (first line).
    pub user: Option<(String, std::path::PathBuf)>,
}

impl EtcdSecurity {
    /// Whether the endpoints are `https://`.
    pub fn tls(&self) -> bool {
        self.ca.is_some() || self.identity.is_some()
    }
}

/// The flags (and control.toml keys) that make an [`EtcdSecurity`]:
/// phub-control's and `phubctl state`'s alike.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct EtcdFlags {
    /// With --state etcd://: the PEM file of the CA that signed etcd's
    /// certificate; the endpoints are then https:// [default with
    /// --etcd-cert: the system's roots].
    #[arg(long, value_name = "FILE")]
    pub(crate) etcd_ca: Option<std::path::PathBuf>,
    /// With --state etcd://: a PEM client certificate for etcd's
    /// `--client-cert-auth` (with --etcd-key; the endpoints are https://).
    #[arg(long, value_name = "FILE", requires = "etcd_key")]
    pub(crate) etcd_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --etcd-cert.
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    pub(crate) etcd_key: Option<std::path::PathBuf>,
    /// With --state etcd://: the etcd user to authenticate as (with
    /// --etcd-password-file), when etcd's authentication is enabled.
    #[arg(long, value_name = "NAME", requires = "etcd_password_file")]
    pub(crate) etcd_user: Option<String>,
    /// The file whose first line is --etcd-user's password (keep it
    /// owner-only).
    #[arg(long, value_name = "FILE", requires = "etcd_user")]
    pub(crate) etcd_password_file: Option<std::path::PathBuf>,
}

impl EtcdFlags {
    /// The settings given; an error names a file that cannot be read.
    pub(crate) fn security(&self) -> Result<EtcdSecurity, String> {
        for (flag, f) in [
            ("--etcd-ca", &self.etcd_ca),
            ("--etcd-cert", &self.etcd_cert),
            ("--etcd-key", &self.etcd_key),
            ("--etcd-password-file", &self.etcd_password_file),
        ] {
            if let Some(p) = f {
                std::fs::metadata(p).map_err(|e| format!("{flag} {}: {e}", p.display()))?;
            }
        }
        Ok(EtcdSecurity {
            ca: self.etcd_ca.clone(),
            identity: self.etcd_cert.clone().zip(self.etcd_key.clone()),
            user: self.etcd_user.clone().zip(self.etcd_password_file.clone()),
        })
    }
}

impl EtcdTarget {
    /// Whether `text` names etcd (rather than a state file).
    pub fn is_etcd(text: &str) -> bool {
        text.starts_with("etcd://")
    }

    /// Parses `etcd://HOST:PORT[,HOST:PORT...]/PREFIX`.
    pub fn parse(text: &str) -> Result<EtcdTarget, String> {
        let bad = |reason: &str| {
            EtcdError::BadUrl {
                url: text.into(),
                reason: reason.into(),
            }
            .to_string()
        };
        let rest = text.strip_prefix("etcd://").ok_or_else(|| bad("not etcd://"))?;
        let (hosts, prefix) = rest.split_once('/').ok_or_else(|| bad("no /PREFIX"))?;
        let prefix = prefix.trim_end_matches('/');
        if prefix.is_empty() || prefix.len() > 200 || prefix.chars().any(|c| c.is_control() || c == ' ') {
            return Err(bad(
                "the prefix must be 1 to 200 characters, no spaces or control characters",
            ));
        }
        let mut endpoints = Vec::new();
        for h in hosts.split(',') {
            let port_ok = h
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
            if !port_ok || h.contains(['@', '?', '#']) {
                return Err(bad(&format!("endpoint {h:?} is not HOST:PORT")));
            }
            endpoints.push(format!("http://{h}"));
        }
        Ok(EtcdTarget {
            endpoints,
            prefix: format!("/{prefix}"),
            security: EtcdSecurity::default(),
        })
    }

    /// The same target reached as `security` says: `https://` endpoints
    /// with TLS.
    pub fn with_security(mut self, security: EtcdSecurity) -> EtcdTarget {
        let scheme = if security.tls() { "https://" } else { "http://" };
        for e in &mut self.endpoints {
            let host = e.trim_start_matches("http://").trim_start_matches("https://");
            *e = format!("{scheme}{host}");
        }
        self.security = security;
        self
    }

    /// The URL as given (for logs).
    pub fn url(&self) -> String {
        let hosts: Vec<&str> = self
            .endpoints
            .iter()
            .map(|e| e.trim_start_matches("http://").trim_start_matches("https://"))
            .collect();
        let tls = if self.security.tls() { " (TLS)" } else { "" };
        format!("etcd://{}{}{tls}", hosts.join(","), self.prefix)
    }
}

/// One etcd cluster over its JSON gateway.
#[derive(Debug)]
struct Gateway {
    endpoints: Vec<String>,
    agent: ureq::Agent,
    /// The endpoint that answered last, tried first.
    preferred: AtomicUsize,
    /// With a user: its name and password, and etcd's token once
    /// authenticated.
    user: Option<(String, String)>,
    token: Mutex<Option<String>>,
}

impl Gateway {
    /// A gateway to `endpoints` as `security` says; an error names the
    /// file that cannot be used.
    fn new(endpoints: Vec<String>, security: &EtcdSecurity) -> Result<Gateway, EtcdError> {
        assert!(!endpoints.is_empty(), "an etcd target has an endpoint");
        // Each step bounded rather than the whole request: a state read
        // of many split values takes as long as its bytes do.
        let mut builder = ureq::AgentBuilder::new()
            .timeout_connect(REQUEST_TIMEOUT)
            .timeout_read(REQUEST_TIMEOUT)
            .timeout_write(REQUEST_TIMEOUT);
        if security.tls() {
            let identity = security
                .identity
                .as_ref()
                .map(|(c, k)| (c.as_path(), k.as_path()));
            let tls = phub_http::client_config_with_identity(security.ca.as_deref(), identity)
                .map_err(|e| EtcdError::Security(format!("etcd TLS: {e}")))?;
            builder = builder.tls_config(tls);
        }
        let user = match &security.user {
            None => None,
            Some((name, file)) => {
                let text = std::fs::read_to_string(file).map_err(|e| {
                    EtcdError::Security(format!("--etcd-password-file {}: {e}", file.display()))
                })?;
                let password = text.lines().next().unwrap_or_default().to_string();
                if password.is_empty() {
                    return Err(EtcdError::Security(format!(
                        "--etcd-password-file {}: empty (the password is its first line)",
                        file.display()
                    )));
                }
                Some((name.clone(), password))
            }
        };
        Ok(Gateway {
            endpoints,
            agent: builder.build(),
            preferred: AtomicUsize::new(0),
            user,
            token: Mutex::new(None),
        })
    }

    /// POSTs `body` to `path` (authenticated when a user is configured:
    /// once more with a new token if etcd refuses the one held).
    fn call(&self, what: &'static str, path: &str, body: &Value) -> Result<Value, EtcdError> {
        if self.user.is_none() {
            return self.send(what, path, body, None);
        }
        let held = self.token.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let token = match held {
            Some(t) => t,
            None => self.authenticate()?,
        };
        match self.send(what, path, body, Some(&token)) {
            Err(EtcdError::Refused { message, .. }) if message.contains("invalid auth token") => {
                let token = self.authenticate()?;
                self.send(what, path, body, Some(&token))
            }
            r => r,
        }
    }

    /// Asks etcd for a token as the configured user, and keeps it.
    fn authenticate(&self) -> Result<String, EtcdError> {
        let (name, password) = self.user.as_ref().expect("called with a user");
        let answer = self.send(
            "authenticate",
            "/v3/auth/authenticate",
            &json!({ "name": name, "password": password }),
            None,
        )?;
        let token = answer["token"].as_str().unwrap_or_default().to_string();
        if token.is_empty() {
            return Err(EtcdError::Security(format!(
                "etcd gave user {name:?} no token (is authentication enabled there?)"
            )));
        }
        *self.token.lock().unwrap_or_else(|p| p.into_inner()) = Some(token.clone());
        Ok(token)
    }

    /// POSTs `body` to `path` on the preferred endpoint, then each other
    /// one while they cannot be reached.
    fn send(
        &self,
        what: &'static str,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<Value, EtcdError> {
        let first = self.preferred.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..self.endpoints.len() {
            let at = (first + i) % self.endpoints.len();
            let endpoint = &self.endpoints[at];
            let mut req = self.agent.post(&format!("{endpoint}{path}"));
            if let Some(t) = token {
                req = req.set("Authorization", t);
            }
            match req.send_json(body) {
                Ok(r) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    // Not `into_string`, which stops at 10 MB: a state
                    // read may be larger.
                    let mut body = Vec::new();
                    let read = std::io::Read::read_to_end(
                        &mut std::io::Read::take(r.into_reader(), MAX_SPLIT_BYTES as u64 + 1),
                        &mut body,
                    );
                    let refused = |message: String| EtcdError::Refused {
                        endpoint: endpoint.clone(),
                        what,
                        message,
                    };
                    if let Err(e) = read {
                        return Err(refused(format!("unreadable answer: {e}")));
                    }
                    if body.len() > MAX_SPLIT_BYTES {
                        return Err(refused(format!("an answer over {MAX_SPLIT_BYTES} bytes")));
                    }
                    return serde_json::from_slice(&body).map_err(|e| {
                        refused(format!(
                            "answer is not JSON ({e}): {:.200}",
                            String::from_utf8_lossy(&body[..body.len().min(200)])
                        ))
                    });
                }
                Err(ureq::Error::Status(status, r)) => {
                    let text = r.into_string().unwrap_or_default();
                    let message = serde_json::from_str::<Value>(&text)
                        .ok()
                        .and_then(|v| v["error"].as_str().map(str::to_string))
                        .unwrap_or_else(|| format!("HTTP {status}: {text:.200}"));
                    // An endpoint without a quorum says so; another may have one.
                    if status >= 500 {
                        last = format!("{endpoint}: {message}");
                        continue;
                    }
                    return Err(EtcdError::Refused {
                        endpoint: endpoint.clone(),
                        what,
                        message,
                    });
                }
                Err(e) => last = format!("{endpoint}: {e}"),
            }
        }
        Err(EtcdError::Unreachable {
            endpoints: self.endpoints.join(","),
            reason: last,
        })
    }
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// A 64-bit integer of a gateway answer (a string, or absent for 0).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// One key-value of a range answer.
struct Kv {
    key: String,
    value: Vec<u8>,
    create_revision: i64,
    mod_revision: i64,
}

fn kvs(range: &Value) -> Result<Vec<Kv>, EtcdError> {
    let Some(list) = range["kvs"].as_array() else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|kv| {
            let raw = |field: &str| {
                B64.decode(kv[field].as_str().unwrap_or_default())
                    .map_err(|e| EtcdError::Corrupt {
                        key: kv["key"].to_string(),
                        reason: format!("{field} is not base64: {e}"),
                    })
            };
            let key = String::from_utf8(raw("key")?).map_err(|e| EtcdError::Corrupt {
                key: kv["key"].to_string(),
                reason: format!("the key is not UTF-8: {e}"),
            })?;
            Ok(Kv {
                key,
                value: raw("value")?,
                create_revision: int(&kv["create_revision"]),
                mod_revision: int(&kv["mod_revision"]),
            })
        })
        .collect()
}

/// The first key-value of a transaction answer's `i`-th range response,
/// if there is one.
fn first_kv(answer: &Value, i: usize) -> Result<Option<Kv>, EtcdError> {
    Ok(answer["responses"]
        .get(i)
        .map(|r| kvs(&r["response_range"]))
        .transpose()?
        .and_then(|l| l.into_iter().next()))
}

/// A transaction operation deleting the keys from `from` up to, not
/// including, `to`.
fn delete_between(from: &[u8], to: &[u8]) -> Value {
    json!({"request_delete_range": {"key": b64(from), "range_end": b64(to)}})
}

/// A transaction operation deleting every key under `dir` (ending in
/// '/').
fn delete_range(dir: &str) -> Value {
    delete_between(dir.as_bytes(), &prefix_end(dir))
}

/// The range end that covers every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    // The prefix ends in '/', never in 0xff.
    *end.last_mut().expect("a prefix is not empty") += 1;
    end
}

/// The lease and leader key this control holds while it leads.
#[derive(Debug, Clone, Copy)]
struct Lead {
    lease: i64,
    /// The leader key's create revision: what every write compares.
    create_revision: i64,
}

/// How a campaign for the leader key ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Campaign {
    /// This control leads.
    Won,
    /// Another leads (its URL, if its key could be read).
    Lost(Option<String>),
}

/// The state under one prefix of one etcd cluster.
#[derive(Debug)]
pub(crate) struct EtcdStore {
    target: EtcdTarget,
    gateway: Gateway,
    /// Each entry's key with the mod revision this control last read or
    /// wrote (absent: the key was absent).
    revisions: Mutex<BTreeMap<String, i64>>,
    /// Set while this control leads.
    lead: Mutex<Option<Lead>>,
    /// What the last [`EtcdStore::load`] read under the prefix: how many
    /// keys, and the highest mod revision among them.
    loaded: Mutex<Option<(i64, i64)>>,
}

impl EtcdStore {
    pub(crate) fn new(target: EtcdTarget) -> Result<EtcdStore, EtcdError> {
        Ok(EtcdStore {
            gateway: Gateway::new(target.endpoints.clone(), &target.security)?,
            target,
            revisions: Mutex::default(),
            lead: Mutex::default(),
            loaded: Mutex::default(),
        })
    }

    pub(crate) fn target(&self) -> &EtcdTarget {
        &self.target
    }

    fn key(&self, rest: &str) -> String {
        format!("{}/{rest}", self.target.prefix)
    }

    fn leader_key(&self) -> String {
        self.key("leader")
    }

    fn lead(&self) -> Option<Lead> {
        *self.lead.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_lead(&self, lead: Option<Lead>) {
        *self.lead.lock().unwrap_or_else(|p| p.into_inner()) = lead;
    }

    /// Whether this control holds the leader key, as far as it knows.
    pub(crate) fn leads(&self) -> bool {
        self.lead().is_some()
    }

    /// Everything under the prefix, as the state file would hold it;
    /// `None` when nothing is stored yet. Remembers each entry's revision.
    pub(crate) fn load(&self) -> Result<Option<StateFile>, EtcdError> {
        let dir = self.key("");
        let answer = self.gateway.call(
            "a range read",
            "/v3/kv/range",
            &json!({"key": b64(dir.as_bytes()), "range_end": b64(&prefix_end(&dir))}),
        )?;
        let all = kvs(&answer)?;
        // Cast: a range answer holds far fewer than 2^63 keys.
        #[allow(clippy::cast_possible_wrap)]
        let mark = (
            all.len() as i64,
            all.iter().map(|kv| kv.mod_revision).max().unwrap_or(0),
        );
        let (pieces, entries): (Vec<Kv>, Vec<Kv>) = all
            .into_iter()
            .partition(|kv| kv.key[dir.len()..].starts_with("pieces/"));
        let pieces: BTreeMap<String, Vec<u8>> = pieces.into_iter().map(|kv| (kv.key, kv.value)).collect();
        let mut state = StateFile::default();
        let mut appliances = Vec::new();
        let mut revisions = BTreeMap::new();
        for kv in entries {
            let rest = &kv.key[dir.len()..];
            let corrupt = |reason: String| EtcdError::Corrupt {
                key: kv.key.clone(),
                reason,
            };
            if rest == "leader" {
                continue;
            }
            let value = self.whole(&kv.key, rest, &kv.value, &pieces)?;
            if rest == "version" {
                let v = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok());
                if v != Some(FORMAT_VERSION) {
                    return Err(corrupt(format!(
                        "format version {:?}; this phub-control reads version {FORMAT_VERSION}",
                        String::from_utf8_lossy(&value)
                    )));
                }
                state.version = v;
            } else if let Some(name) = rest.strip_prefix("appliances/") {
                let a: ApplianceSpec = serde_json::from_slice(&value).map_err(|e| corrupt(e.to_string()))?;
                if a.name != name {
                    return Err(corrupt(format!("holds appliance {:?}", a.name)));
                }
                appliances.push(a);
            } else if let Some(id) = rest.strip_prefix("jobs/") {
                let job: StoredJob = serde_json::from_slice(&value).map_err(|e| corrupt(e.to_string()))?;
                if id.parse::<u16>().ok() != Some(job.id) {
                    return Err(corrupt(format!("holds job {}", job.id)));
                }
                state.jobs.push(job);
            } else {
                return Err(corrupt("not a key phub-control writes".into()));
            }
            revisions.insert(kv.key, kv.mod_revision);
        }
        *self.loaded.lock().unwrap_or_else(|p| p.into_inner()) = Some(mark);
        if revisions.is_empty() {
            *self.revisions.lock().unwrap_or_else(|p| p.into_inner()) = revisions;
            return Ok(None);
        }
        state.appliances = Some(appliances);
        state.jobs.sort_by_key(|j| j.id);
        *self.revisions.lock().unwrap_or_else(|p| p.into_inner()) = revisions;
        Ok(Some(state))
    }

    /// Whether anything under the prefix may have changed since the last
    /// [`EtcdStore::load`]: one small read (the number of keys there and
    /// the highest mod revision among them), which a follower makes every
    /// quarter TTL instead of reading the whole state. Any put raises the
    /// highest revision; a delete alone lowers the count.
    pub(crate) fn changed_since_load(&self) -> Result<bool, EtcdError> {
        let Some(mark) = *self.loaded.lock().unwrap_or_else(|p| p.into_inner()) else {
            return Ok(true);
        };
        let dir = self.key("");
        let answer = self.gateway.call(
            "a range read",
            "/v3/kv/range",
            &json!({"key": b64(dir.as_bytes()), "range_end": b64(&prefix_end(&dir)), "limit": "1",
                    "sort_order": "DESCEND", "sort_target": "MOD", "keys_only": true}),
        )?;
        let top = kvs(&answer)?.first().map_or(0, |kv| kv.mod_revision);
        Ok((int(&answer["count"]), top) != mark)
    }

    /// Where entry `rest`'s (`jobs/00001`) pieces of every generation are.
    fn pieces_dir(&self, rest: &str) -> String {
        self.key(&format!("pieces/{rest}/"))
    }

    /// Where entry `rest`'s pieces of `generation` are.
    fn generation_dir(&self, rest: &str, generation: i64) -> String {
        format!("{}{generation:020}/", self.pieces_dir(rest))
    }

    /// The value of entry `rest` (key `key`) as written: `value`, or, when
    /// that is a [`Split`] manifest, its pieces put together.
    fn whole<'a>(
        &self,
        key: &str,
        rest: &str,
        value: &'a [u8],
        pieces: &BTreeMap<String, Vec<u8>>,
    ) -> Result<std::borrow::Cow<'a, [u8]>, EtcdError> {
        let Ok(Split { split }) = serde_json::from_slice::<Split>(value) else {
            return Ok(std::borrow::Cow::Borrowed(value));
        };
        let corrupt = |reason: String| EtcdError::Corrupt {
            key: key.to_string(),
            reason,
        };
        let piece = MAX_VALUE_BYTES as u64;
        if split.bytes > MAX_SPLIT_BYTES as u64 || u64::from(split.pieces) != split.bytes.div_ceil(piece) {
            return Err(corrupt(format!(
                "its manifest says {} bytes in {} pieces of at most {piece}",
                split.bytes, split.pieces
            )));
        }
        let dir = self.generation_dir(rest, split.generation);
        // Cast: at most MAX_SPLIT_BYTES, checked above.
        #[allow(clippy::cast_possible_truncation)]
        let mut out = Vec::with_capacity(split.bytes as usize);
        for i in 0..split.pieces {
            let at = format!("{dir}{i:05}");
            let Some(p) = pieces.get(&at) else {
                return Err(corrupt(format!("its piece {at:?} is missing")));
            };
            let expected = piece.min(split.bytes - u64::from(i) * piece);
            if p.len() as u64 != expected {
                return Err(corrupt(format!(
                    "its piece {at:?} has {} bytes, not {expected}",
                    p.len()
                )));
            }
            out.extend_from_slice(p);
        }
        Ok(std::borrow::Cow::Owned(out))
    }

    /// One transaction of `ops`, compared with `fence` (the leader key's
    /// create revision) when given: [`EtcdError::NotLeader`] (and this
    /// control no longer leads) when that compare fails.
    fn fenced(&self, what: &'static str, fence: Option<&Value>, ops: Vec<Value>) -> Result<(), EtcdError> {
        let answer = self.gateway.call(
            what,
            "/v3/kv/txn",
            &json!({
                "compare": fence.into_iter().cloned().collect::<Vec<_>>(),
                "success": ops,
                "failure": [{"request_range": {"key": b64(self.leader_key().as_bytes())}}],
            }),
        )?;
        if answer["succeeded"].as_bool() == Some(true) {
            return Ok(());
        }
        self.set_lead(None);
        let url = first_kv(&answer, 0)?.map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
        Err(self.not_leader(url))
    }

    /// Writes `value` as entry `rest`'s pieces of `generation`, each in a
    /// transaction of its own (fenced when `fence` is given), after taking
    /// away what a write cut off may have left there; the manifest that
    /// names them.
    fn write_pieces(
        &self,
        rest: &str,
        generation: i64,
        value: &[u8],
        fence: Option<&Value>,
    ) -> Result<Split, EtcdError> {
        let dir = self.generation_dir(rest, generation);
        self.fenced("a piece's write", fence, vec![delete_range(&dir)])?;
        let mut pieces = 0u32;
        for piece in value.chunks(MAX_VALUE_BYTES) {
            let at = format!("{dir}{pieces:05}");
            self.fenced(
                "a piece's write",
                fence,
                vec![json!({"request_put": {"key": b64(at.as_bytes()), "value": b64(piece)}})],
            )?;
            pieces += 1;
        }
        Ok(Split {
            split: SplitRef {
                generation,
                pieces,
                bytes: value.len() as u64,
            },
        })
    }

    /// The operations that delete entry `rest`'s pieces but those of
    /// `keep`.
    fn delete_pieces(&self, rest: &str, keep: Option<i64>) -> Vec<Value> {
        let dir = self.pieces_dir(rest);
        let Some(g) = keep else {
            return vec![delete_range(&dir)];
        };
        let kept = self.generation_dir(rest, g);
        vec![
            delete_between(dir.as_bytes(), kept.as_bytes()),
            delete_between(&prefix_end(&kept), &prefix_end(&dir)),
        ]
    }

    /// Writes `entry` (or deletes it) in one transaction that compares the
    /// key's revision with the one last read or written and the leader key
    /// with this control's ([`EtcdError::NotLeader`]: then this control
    /// no longer leads). The version key is written with it. A value over
    /// [`MAX_VALUE_BYTES`] is split (module head).
    pub(crate) fn write(&self, entry: Change<'_>) -> Result<(), EtcdError> {
        let (rest, value) = match entry {
            Change::Job(id, job) => (format!("jobs/{id:05}"), job.map(serde_json::to_vec)),
            Change::Appliance(name, a) => (format!("appliances/{name}"), a.map(serde_json::to_vec)),
        };
        let key = self.key(&rest);
        let value = value.transpose().expect("state entries serialise");
        if let Some(v) = &value {
            if v.len() > MAX_SPLIT_BYTES {
                return Err(EtcdError::TooLarge {
                    key,
                    bytes: v.len(),
                    limit: MAX_SPLIT_BYTES,
                });
            }
        }
        let Some(lead) = self.lead() else {
            return Err(self.not_leader(None));
        };
        let read = self
            .revisions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .copied()
            .unwrap_or(0);
        let leader_key = self.leader_key();
        // Fencing: the leader key is still the one this control created.
        let fence = json!({"key": b64(leader_key.as_bytes()), "target": "CREATE", "result": "EQUAL",
                           "create_revision": lead.create_revision.to_string()});
        // A large value's pieces go first; its manifest stands for it
        // below. Its generation: the revision read, which this write
        // raises.
        let (value, kept) = match value {
            Some(v) if v.len() > MAX_VALUE_BYTES => {
                let split = self.write_pieces(&rest, read, &v, Some(&fence))?;
                (
                    Some(serde_json::to_vec(&split).expect("a manifest serialises")),
                    Some(read),
                )
            }
            v => (v, None),
        };
        let compare = vec![
            json!({"key": b64(key.as_bytes()), "target": "MOD", "result": "EQUAL", "mod_revision": read.to_string()}),
            fence.clone(),
        ];
        let change = match &value {
            Some(v) => json!({"request_put": {"key": b64(key.as_bytes()), "value": b64(v)}}),
            None => json!({"request_delete_range": {"key": b64(key.as_bytes())}}),
        };
        let version = self.key("version");
        let mut success = vec![
            change,
            json!({"request_put": {"key": b64(version.as_bytes()), "value": b64(FORMAT_VERSION.to_string().as_bytes())}}),
        ];
        success.extend(self.delete_pieces(&rest, kept));
        let failure = vec![
            json!({"request_range": {"key": b64(leader_key.as_bytes())}}),
            json!({"request_range": {"key": b64(key.as_bytes())}}),
        ];
        let answer = self.gateway.call(
            "a write",
            "/v3/kv/txn",
            &json!({"compare": compare, "success": success, "failure": failure}),
        )?;
        if answer["succeeded"].as_bool() == Some(true) {
            let revision = int(&answer["header"]["revision"]);
            let mut revisions = self.revisions.lock().unwrap_or_else(|p| p.into_inner());
            match value {
                Some(_) => revisions.insert(key, revision),
                None => revisions.remove(&key),
            };
            revisions.insert(version, revision);
            return Ok(());
        }
        let leader = first_kv(&answer, 0)?;
        if leader.as_ref().map(|kv| kv.create_revision) != Some(lead.create_revision) {
            // Another leads, or none: this control steps down at once
            // (the pieces written are the new leader's to delete).
            self.set_lead(None);
            let url = leader.map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
            return Err(self.not_leader(url));
        }
        if let Some(g) = kept {
            // Still leading: the pieces no manifest names go now.
            let dir = self.generation_dir(&rest, g);
            if let Err(e) = self.fenced("a piece's removal", Some(&fence), vec![delete_range(&dir)]) {
                log::warn!("{e}; the pieces under {dir} go at the entry's next write");
            }
        }
        let now = first_kv(&answer, 1)?.map_or(0, |kv| kv.mod_revision);
        Err(EtcdError::Conflict { key, read, now })
    }

    /// Writes `appliances` and `jobs` under the prefix, each key in a
    /// transaction that requires it absent (`phubctl state import`, no
    /// control running): an [`EtcdError::Conflict`] names a key that is
    /// there already. A value over [`MAX_VALUE_BYTES`] is split as
    /// [`EtcdStore::write`] splits it, at generation 0.
    pub(crate) fn import(&self, appliances: &[&ApplianceSpec], jobs: &[&StoredJob]) -> Result<(), EtcdError> {
        let mut entries: Vec<(String, Vec<u8>)> =
            vec![("version".into(), FORMAT_VERSION.to_string().into_bytes())];
        for a in appliances {
            let v = serde_json::to_vec(a).expect("state entries serialise");
            entries.push((format!("appliances/{}", a.name), v));
        }
        for j in jobs {
            let v = serde_json::to_vec(j).expect("state entries serialise");
            entries.push((format!("jobs/{:05}", j.id), v));
        }
        for (rest, value) in entries {
            let key = self.key(&rest);
            if value.len() > MAX_SPLIT_BYTES {
                return Err(EtcdError::TooLarge {
                    key,
                    bytes: value.len(),
                    limit: MAX_SPLIT_BYTES,
                });
            }
            let value = if value.len() > MAX_VALUE_BYTES {
                let split = self.write_pieces(&rest, 0, &value, None)?;
                serde_json::to_vec(&split).expect("a manifest serialises")
            } else {
                value
            };
            let k = b64(key.as_bytes());
            let answer = self.gateway.call(
                "an import",
                "/v3/kv/txn",
                &json!({
                    "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                    "success": [{"request_put": {"key": k, "value": b64(&value)}}],
                    "failure": [{"request_range": {"key": k}}],
                }),
            )?;
            if answer["succeeded"].as_bool() != Some(true) {
                let now = first_kv(&answer, 0)?.map_or(0, |kv| kv.mod_revision);
                return Err(EtcdError::Conflict { key, read: 0, now });
            }
        }
        Ok(())
    }

    fn not_leader(&self, leader: Option<String>) -> EtcdError {
        EtcdError::NotLeader {
            prefix: self.target.url(),
            leader,
        }
    }

    /// Tries to create the leader key with a new lease of `ttl`, holding
    /// `me` (this control's URL), if no key is there.
    pub(crate) fn campaign(&self, me: &str, ttl: Duration) -> Result<Campaign, EtcdError> {
        let granted = self.gateway.call(
            "a lease grant",
            "/v3/lease/grant",
            &json!({"TTL": ttl.as_secs().max(1).to_string()}),
        )?;
        let lease = int(&granted["ID"]);
        let key = b64(self.leader_key().as_bytes());
        let answer = self.gateway.call(
            "the leader campaign",
            "/v3/kv/txn",
            &json!({
                "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": {"key": key, "value": b64(me.as_bytes()), "lease": lease.to_string()}}],
                "failure": [{"request_range": {"key": key}}],
            }),
        );
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                self.revoke(lease);
                return Err(e);
            }
        };
        if answer["succeeded"].as_bool() == Some(true) {
            self.set_lead(Some(Lead {
                lease,
                create_revision: int(&answer["header"]["revision"]),
            }));
            return Ok(Campaign::Won);
        }
        self.revoke(lease);
        let leader = first_kv(&answer, 0)?.map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
        Ok(Campaign::Lost(leader))
    }

    /// Renews the lease of the leader key: `Ok(false)` (and this control no
    /// longer leads) when etcd says the lease is gone.
    pub(crate) fn renew(&self) -> Result<bool, EtcdError> {
        let Some(lead) = self.lead() else {
            return Ok(false);
        };
        let answer = self.gateway.call(
            "a lease renewal",
            "/v3/lease/keepalive",
            &json!({"ID": lead.lease.to_string()}),
        )?;
        if int(&answer["result"]["TTL"]) > 0 {
            return Ok(true);
        }
        self.set_lead(None);
        Ok(false)
    }

    /// Gives the leader key up (its lease revoked, so the key goes with
    /// it), if this control holds it.
    pub(crate) fn resign(&self) {
        let lead = self.lead.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(lead) = lead {
            self.revoke(lead.lease);
        }
    }

    /// Steps down without telling etcd (the lease is known lost).
    pub(crate) fn drop_lead(&self) {
        self.set_lead(None);
    }

    fn revoke(&self, lease: i64) {
        if let Err(e) = self.gateway.call(
            "a lease revocation",
            "/v3/lease/revoke",
            &json!({"ID": lease.to_string()}),
        ) {
            log::warn!("{e}; the lease expires by itself");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_url_is_parsed_or_refused_by_name() {
        let t = EtcdTarget::parse("etcd://127.0.0.1:2379,10.0.0.2:2379/phub/rack1/").unwrap();
        assert_eq!(t.endpoints, ["http://127.0.0.1:2379", "http://10.0.0.2:2379"]);
        assert_eq!(t.prefix, "/phub/rack1");
        assert_eq!(t.url(), "etcd://127.0.0.1:2379,10.0.0.2:2379/phub/rack1");
        for (bad, why) in [
            ("etcd://127.0.0.1:2379", "no /PREFIX"),
            ("etcd://127.0.0.1:2379/", "the prefix"),
            ("etcd://127.0.0.1/phub", "not HOST:PORT"),
            ("etcd://127.0.0.1:0/phub", "not HOST:PORT"),
            ("etcd://a:1,/phub", "not HOST:PORT"),
            ("http://127.0.0.1:2379/phub", "not etcd://"),
        ] {
            let e = EtcdTarget::parse(bad).unwrap_err();
            assert!(
                e.contains(why) && e.contains(bad) && e.contains("expected etcd://"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn tls_makes_the_endpoints_https_and_a_bad_setting_is_named() {
        let t = EtcdTarget::parse("etcd://127.0.0.1:2379,10.0.0.2:2379/phub").unwrap();
        let ca = std::path::PathBuf::from("/nonexistent/ca.pem");
        let tls = t.clone().with_security(EtcdSecurity {
            ca: Some(ca.clone()),
            ..EtcdSecurity::default()
        });
        assert_eq!(tls.endpoints, ["https://127.0.0.1:2379", "https://10.0.0.2:2379"]);
        assert_eq!(tls.url(), "etcd://127.0.0.1:2379,10.0.0.2:2379/phub (TLS)");
        // A user alone keeps plain http.
        let user = t.with_security(EtcdSecurity {
            user: Some(("root".into(), "/nonexistent/pw".into())),
            ..EtcdSecurity::default()
        });
        assert_eq!(user.endpoints[0], "http://127.0.0.1:2379");
        // Files that cannot be used are named.
        let e = EtcdStore::new(tls).unwrap_err().to_string();
        assert!(e.contains("etcd TLS") && e.contains("/nonexistent/ca.pem"), "{e}");
        let e = EtcdStore::new(user).unwrap_err().to_string();
        assert!(e.contains("--etcd-password-file /nonexistent/pw"), "{e}");
    }

    #[test]
    fn a_split_value_is_put_together_from_its_pieces_or_named_corrupt() {
        let store = EtcdStore::new(EtcdTarget::parse("etcd://127.0.0.1:2379/phub").unwrap()).unwrap();
        let (key, rest) = ("/phub/jobs/00001", "jobs/00001");
        let value: Vec<u8> = (0..MAX_VALUE_BYTES * 2 + 10)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect();
        let manifest = |pieces: u32, bytes: usize| {
            serde_json::to_vec(&Split {
                split: SplitRef {
                    generation: 7,
                    pieces,
                    bytes: bytes as u64,
                },
            })
            .unwrap()
        };
        assert_eq!(
            String::from_utf8(manifest(3, value.len())).unwrap(),
            format!(
                r#"{{"split":{{"generation":7,"pieces":3,"bytes":{}}}}}"#,
                value.len()
            ),
            "the manifest as the module head writes it"
        );
        let dir = "/phub/pieces/jobs/00001/00000000000000000007/";
        let mut pieces: BTreeMap<String, Vec<u8>> = value
            .chunks(MAX_VALUE_BYTES)
            .enumerate()
            .map(|(i, p)| (format!("{dir}{i:05}"), p.to_vec()))
            .collect();
        // Another generation's (a write cut off) is not read.
        pieces.insert(
            "/phub/pieces/jobs/00001/00000000000000000003/00000".into(),
            vec![1, 2, 3],
        );
        let whole = |m: &[u8], p: &BTreeMap<String, Vec<u8>>| {
            store.whole(key, rest, m, p).map(std::borrow::Cow::into_owned)
        };
        assert_eq!(whole(&manifest(3, value.len()), &pieces).unwrap(), value);
        // A value written whole is itself, a job's JSON included.
        let job = br#"{"id":1,"parts":[]}"#;
        assert_eq!(&*whole(job, &pieces).unwrap(), job.as_slice());
        // Wrong counts, a missing or short piece: named, with the key.
        let e = whole(&manifest(2, value.len()), &pieces).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains("in 2 pieces"), "{e}");
        let e = whole(&manifest(3, MAX_SPLIT_BYTES + 1), &pieces)
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{e}");
        let mut short = pieces.clone();
        short.get_mut(&format!("{dir}00001")).unwrap().pop();
        let e = whole(&manifest(3, value.len()), &short).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{dir}00001")) && e.contains("not 1048576"),
            "{e}"
        );
        pieces.remove(&format!("{dir}00002"));
        let e = whole(&manifest(3, value.len()), &pieces).unwrap_err().to_string();
        assert!(e.contains(&format!("{dir}00002")) && e.contains("missing"), "{e}");
    }

    #[test]
    fn a_prefix_range_covers_its_keys_alone() {
        assert_eq!(prefix_end("/phub/"), b"/phub0");
        assert!(b"/phub/jobs/00001".as_slice() < prefix_end("/phub/").as_slice());
        assert!(b"/phub0".as_slice() >= prefix_end("/phub/").as_slice());
    }

    #[test]
    fn gateway_integers_are_strings_or_absent() {
        assert_eq!(int(&json!("42")), 42);
        assert_eq!(int(&json!(7)), 7);
        assert_eq!(int(&Value::Null), 0);
    }
}
