//! A client of several phub-controls on one etcd prefix, one of which
//! leads: phubctl, the worker library (join, epoch) and the Python worker
//! (through it) send their calls through [`Controls`].
//!
//! Given `URL1,URL2,...` (`--control`, `$PHUB_CONTROL`), a call goes to the
//! control that served the last one (the first given at start), and on to
//! another while the one asked
//!
//! - did not take the request: the name did not resolve, the connection
//!   was refused or not made within the connect timeout;
//! - answered `503`: a follower turning a write away (its `X-Phub-Leader`
//!   header, when present, names the control asked next, added to those
//!   known if it is not one of them), no control leading yet, etcd out of
//!   reach, the listener full;
//! - for a read (`GET`) only: the connection ended or timed out after the
//!   request left.
//!
//! A write whose connection ends after it left is not sent again, to any
//! control: it may have been carried out (an admission twice is two jobs).
//! Its error, [`ClientError::Unanswered`], says so. Any other answer
//! (success, 4xx, other 5xx) is the call's.
//!
//! With one control known (one given, no leader named), a transport error
//! is the answer at once ([`ClientError::Unreachable`]), as with a
//! [`Client`]: there is no other control to wait for; its `503`s are
//! waited out as with several.
//!
//! The wait is bounded: each control is asked in turn, a pause
//! ([`PAUSE`]) after each round, and none is asked after
//! [`Timeouts::wait`], so a call takes at most that plus one call's
//! timeout. Then [`ClientError::NoneServed`] names every control asked and
//! its last answer.
//!
//! Invariants: the list of controls is never empty; the current index is
//! always one of it; at most [`MAX_CONTROLS`] are known (a leader named
//! by a header is added only below it).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use phub_proto::routes::{Call, Method, Route};

use crate::client::{Client, ClientError, Failure};
use crate::TlsError;

/// The header of a follower's `503` that names the leader's URL.
pub const LEADER_HEADER: &str = "X-Phub-Leader";

/// The environment variable that names phub-control, or several separated
/// by commas (phubctl and the worker library read it).
pub const CONTROL_ENV: &str = "PHUB_CONTROL";

/// The pause after each round of controls that did not serve a call.
pub const PAUSE: Duration = Duration::from_millis(200);

/// The most controls known at once: those given plus leaders named by
/// answers.
pub const MAX_CONTROLS: usize = 16;

/// A control asked, and its last answer, for [`ClientError::NoneServed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    /// The control's base URL.
    pub url: String,
    /// How many times it was asked.
    pub times: u32,
    /// The status of its last answer; None when it did not answer.
    pub status: Option<u16>,
    /// Its last answer's message, or what the transport said.
    pub answer: String,
}

/// Controls asked and their answers, one after the other.
pub(crate) fn list(asked: &[Asked]) -> String {
    asked
        .iter()
        .map(|a| {
            let times = if a.times > 1 {
                format!(", {} times", a.times)
            } else {
                String::new()
            };
            match a.status {
                Some(s) => format!("{} ({s}{times}: {})", a.url, a.answer),
                None => format!("{} (no answer{times}: {})", a.url, a.answer),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The timeouts of [`Controls`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// To make a connection to one control.
    pub connect: Duration,
    /// For one call to one control, connection included.
    pub call: Duration,
    /// After which no control is asked again.
    pub wait: Duration,
}

impl Default for Timeouts {
    /// 3 s to connect, 30 s a call, 10 s of trying (a follower leads
    /// within the leader lease's TTL plus about half a second: 2.4 s with
    /// control's default TTL of 2 s).
    fn default() -> Timeouts {
        Timeouts {
            connect: Duration::from_secs(3),
            call: Duration::from_secs(30),
            wait: Duration::from_secs(10),
        }
    }
}

/// Why [`Controls::new`] refused a list.
#[derive(Debug, thiserror::Error)]
pub enum ControlsError {
    /// No URL in the list.
    #[error("control URL list {list:?}: expected the URL of phub-control (http://HOST:PORT), or several separated by commas")]
    Empty {
        /// The list as given.
        list: String,
    },
    /// More URLs than [`MAX_CONTROLS`].
    #[error("control URL list {list:?}: {count} URLs, at most {MAX_CONTROLS} are taken")]
    TooMany {
        /// The list as given.
        list: String,
        /// How many URLs it holds.
        count: usize,
    },
    /// An `https` URL whose TLS settings cannot be made.
    #[error("control URL {url}: {source}")]
    Tls {
        /// The URL.
        url: String,
        /// Why.
        source: TlsError,
    },
}

/// The controls known, and the one that served last.
#[derive(Debug)]
struct Known {
    clients: Vec<Client>,
    current: usize,
}

/// A client of one or several phub-controls (see the module head).
#[derive(Debug)]
pub struct Controls {
    known: Mutex<Known>,
    ca_file: Option<PathBuf>,
    token: Option<String>,
    timeouts: Timeouts,
}

impl Controls {
    /// Controls at `list` (`URL1,URL2,...`; spaces around each are
    /// dropped, a URL given twice is asked once); an `https` one checks
    /// the server's certificate against `ca_file`, `$PHUB_CA_FILE` or the
    /// system's roots.
    pub fn new(list: &str, ca_file: Option<&Path>, timeouts: Timeouts) -> Result<Controls, ControlsError> {
        let mut bases: Vec<&str> = Vec::new();
        for b in list.split(',').map(|b| b.trim().trim_end_matches('/')) {
            if !b.is_empty() && !bases.contains(&b) {
                bases.push(b);
            }
        }
        if bases.is_empty() {
            return Err(ControlsError::Empty { list: list.into() });
        }
        if bases.len() > MAX_CONTROLS {
            return Err(ControlsError::TooMany {
                list: list.into(),
                count: bases.len(),
            });
        }
        let mut controls = Controls {
            known: Mutex::new(Known {
                clients: Vec::new(),
                current: 0,
            }),
            ca_file: ca_file.map(Path::to_path_buf),
            token: None,
            timeouts,
        };
        let clients = bases
            .iter()
            .map(|b| controls.client(b))
            .collect::<Result<Vec<_>, _>>()?;
        controls
            .known
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .clients = clients;
        Ok(controls)
    }

    /// The controls, sending `token` as `Authorization: Bearer` with every
    /// call (the operator token).
    pub fn with_token(mut self, token: Option<String>) -> Controls {
        let known = self.known.get_mut().unwrap_or_else(|p| p.into_inner());
        known.clients = known
            .clients
            .drain(..)
            .map(|c| c.with_token(token.clone()))
            .collect();
        self.token = token;
        self
    }

    fn client(&self, base: &str) -> Result<Client, ControlsError> {
        let builder = ureq::AgentBuilder::new()
            .timeout_connect(self.timeouts.connect)
            .timeout(self.timeouts.call);
        Client::new(base, self.ca_file.as_deref(), builder)
            .map(|c| c.with_token(self.token.clone()))
            .map_err(|source| ControlsError::Tls {
                url: base.into(),
                source,
            })
    }

    fn known(&self) -> MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The base URL of the control that served the last call (the first
    /// given, before any).
    pub fn base(&self) -> String {
        let k = self.known();
        k.clients[k.current].base().to_string()
    }

    /// The base URLs known, in order, joined by commas (for messages).
    pub fn bases(&self) -> String {
        let k = self.known();
        k.clients.iter().map(Client::base).collect::<Vec<_>>().join(",")
    }

    /// Sends `call` to the controls as the module head says; its answer
    /// read into the call's type.
    pub fn send<Rt: Route, A>(&self, call: &Call<'_, Rt, A>) -> Result<A, ClientError> {
        let start = Instant::now();
        let read = call.route.method() == Method::Get;
        let mut asked: Vec<Asked> = Vec::new();
        let mut cursor = self.known().current;
        // The controls asked in this round, by index; a leader named by a
        // header is asked next unless it was asked in the round already.
        let mut round = vec![false; self.known().clients.len()];
        let mut detour = None;
        loop {
            let at = match detour.take() {
                Some(i) => i,
                None => {
                    while round[cursor] {
                        cursor = (cursor + 1) % round.len();
                    }
                    cursor
                }
            };
            let client = self.known().clients[at].clone();
            let failure = match client.exchange(call) {
                Ok(a) => {
                    self.known().current = at;
                    return Ok(a);
                }
                Err(f) => f,
            };
            round[at] = true;
            let (status, answer) = match failure {
                // With one control, no other can take over: its transport
                // error is the answer at once.
                Failure::NotSent(e) | Failure::MaybeSent(e) if round.len() == 1 => return Err(e),
                Failure::NotSent(e) => (None, e.message().to_string()),
                Failure::MaybeSent(e) if read => (None, e.message().to_string()),
                Failure::MaybeSent(e) => {
                    return Err(ClientError::Unanswered {
                        what: call.what(),
                        base: client.base().to_string(),
                        reason: e.message().to_string(),
                    })
                }
                Failure::Answered { error, leader } if error.status() == Some(503) => {
                    if let Some(i) = leader.and_then(|l| self.index_of(&l)) {
                        round.resize(self.known().clients.len(), false);
                        detour = (!round[i]).then_some(i);
                    }
                    (Some(503), error.message().to_string())
                }
                Failure::Answered { error, .. } => {
                    self.known().current = at;
                    return Err(error);
                }
            };
            match asked.iter_mut().find(|a| a.url == client.base()) {
                Some(a) => {
                    a.times += 1;
                    a.status = status;
                    a.answer = answer;
                }
                None => asked.push(Asked {
                    url: client.base().to_string(),
                    times: 1,
                    status,
                    answer,
                }),
            }
            let waited = start.elapsed();
            if waited >= self.timeouts.wait {
                return Err(ClientError::NoneServed {
                    what: call.what(),
                    waited,
                    asked,
                });
            }
            if round.iter().all(|r| *r) {
                round.fill(false);
                std::thread::sleep(PAUSE.min(self.timeouts.wait - waited));
            }
        }
    }

    /// The index of the control at `url`, added to those known when it is
    /// not one of them and there is room; None when there is not, or it
    /// cannot be a client (`url` came from a server's header).
    fn index_of(&self, url: &str) -> Option<usize> {
        let url = url.trim().trim_end_matches('/');
        if let Some(i) = self.known().clients.iter().position(|c| c.base() == url) {
            return Some(i);
        }
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return None;
        }
        let client = self.client(url).ok()?;
        let mut k = self.known();
        if k.clients.len() >= MAX_CONTROLS {
            return None;
        }
        k.clients.push(client);
        Some(k.clients.len() - 1)
    }
}
