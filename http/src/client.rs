//! The one blocking client of phub's HTTP APIs: sends a typed
//! [`Call`] (`phub_proto::routes`) to phub-control or a dataplane's
//! management API and reads the answer into the call's type. phubctl, the
//! tests, the lab suite and the tools use it; control's own client of its
//! dataplanes adds the management token's refresh on top of the same calls.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use phub_proto::api::ApiError;
use phub_proto::routes::{Call, Route};

use crate::controls::Asked;
use crate::TlsError;

/// What went wrong with a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The server refused: an error answer (4xx, 5xx) whose body is an
    /// [`ApiError`]; its message names the problem.
    #[error("{message}")]
    Api {
        /// The status code.
        status: u16,
        /// The `ApiError`'s message.
        message: String,
    },
    /// An error answer that is not an [`ApiError`] (a proxy's, say).
    #[error("HTTP {status} from {url}: {message}")]
    Http {
        /// The status code.
        status: u16,
        /// The URL asked for.
        url: String,
        /// The body, trimmed ([`ApiError::message_of`]).
        message: String,
    },
    /// No answer: connection refused, reset, timed out, TLS refused.
    #[error("cannot reach {base}: {reason}")]
    Unreachable {
        /// The server's base URL.
        base: String,
        /// What the transport said.
        reason: String,
    },
    /// A successful answer that is not what the route defines.
    #[error("the answer to {what} is not understood: {reason}")]
    BadAnswer {
        /// The request, e.g. `GET /v1/stats`.
        what: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A request that changes state left and the connection ended without
    /// an answer (reset, timed out): it may have been carried out, so
    /// [`crate::Controls`] asks no other control.
    #[error(
        "{what} was sent to {base} and no answer came ({reason}); it may have been carried out: \
         look (list the jobs, show the job) before sending it again"
    )]
    Unanswered {
        /// The request, e.g. `POST /v1/jobs`.
        what: String,
        /// The server's base URL.
        base: String,
        /// What the transport said.
        reason: String,
    },
    /// None of several controls served the call within the wait
    /// ([`crate::Controls`]): each did not answer or answered `503`.
    #[error("no phub-control served {what} within {:.1} s; asked {}", waited.as_secs_f64(), crate::controls::list(asked))]
    NoneServed {
        /// The request, e.g. `POST /v1/jobs`.
        what: String,
        /// How long the controls were asked.
        waited: Duration,
        /// Each control asked, in the order first asked, with its last answer.
        asked: Vec<Asked>,
    },
}

impl ClientError {
    /// The error answer's status code (of several controls, the last one
    /// asked's); None when there was no answer or it was a success not
    /// understood.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } | ClientError::Http { status, .. } => Some(*status),
            ClientError::NoneServed { asked, .. } => asked.last().and_then(|a| a.status),
            ClientError::Unreachable { .. }
            | ClientError::BadAnswer { .. }
            | ClientError::Unanswered { .. } => None,
        }
    }

    /// What the server or the transport said, without the URL (of
    /// several controls, the last one asked).
    pub fn message(&self) -> &str {
        match self {
            ClientError::Api { message, .. } | ClientError::Http { message, .. } => message,
            ClientError::Unreachable { reason, .. }
            | ClientError::BadAnswer { reason, .. }
            | ClientError::Unanswered { reason, .. } => reason,
            ClientError::NoneServed { asked, .. } => asked.last().map_or("", |a| a.answer.as_str()),
        }
    }
}

/// A client of one server, with a token for the routes that need one.
#[derive(Clone)]
pub struct Client {
    base: String,
    agent: ureq::Agent,
    token: Option<String>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the server at `base` (`http://127.0.0.1:7700`); an
    /// `https` one checks the server's certificate against `ca_file`,
    /// `$PHUB_CA_FILE` or the system's roots ([`crate::agent`]).
    /// `builder` sets the timeouts.
    pub fn new(base: &str, ca_file: Option<&Path>, builder: ureq::AgentBuilder) -> Result<Client, TlsError> {
        Ok(Client {
            agent: crate::agent(base, ca_file, builder)?,
            base: base.trim_end_matches('/').to_string(),
            token: None,
        })
    }

    /// A client of a plain `http` server with ureq's default settings
    /// (tests on loopback); an `https` one as [`Client::new`] says.
    pub fn plain(base: &str) -> Result<Client, TlsError> {
        Client::new(base, None, ureq::AgentBuilder::new())
    }

    /// The client, sending `token` as `Authorization: Bearer` with every
    /// call (control's operator token, a dataplane's management token).
    pub fn with_token(mut self, token: Option<String>) -> Client {
        self.token = token;
        self
    }

    /// The server's base URL, without a trailing slash.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Sends `call`; its answer read into the call's type.
    pub fn send<Rt: Route, A>(&self, call: &Call<'_, Rt, A>) -> Result<A, ClientError> {
        self.exchange(call).map_err(Failure::into_error)
    }

    /// Sends `call` and says how it failed: before the request left,
    /// after, or with an answer (and the leader it names, if any).
    pub(crate) fn exchange<Rt: Route, A>(&self, call: &Call<'_, Rt, A>) -> Result<A, Failure> {
        let route = &call.route;
        let url = format!("{}{}", self.base, route.path());
        let mut req = self.agent.request(route.method().as_str(), &url);
        if let Some(t) = &self.token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        let res = match call.body.content_type() {
            Some(ct) => req.set("Content-Type", ct).send_bytes(call.body.bytes()),
            None => req.call(),
        };
        let bad = |reason: String| Failure::Answered {
            error: ClientError::BadAnswer {
                what: call.what(),
                reason,
            },
            leader: None,
        };
        match res {
            Ok(r) => {
                let mut body = Vec::new();
                r.into_reader()
                    .read_to_end(&mut body)
                    .map_err(|e| bad(format!("reading the answer: {e}")))?;
                call.answer(&body).map_err(bad)
            }
            Err(ureq::Error::Status(status, r)) => {
                let leader = r
                    .header(crate::LEADER_HEADER)
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(str::to_string);
                let body = r.into_string().unwrap_or_default();
                let error = match ApiError::parse(&body) {
                    Some(e) => ClientError::Api {
                        status,
                        message: e.error,
                    },
                    None => ClientError::Http {
                        status,
                        url,
                        message: ApiError::message_of(&body),
                    },
                };
                Err(Failure::Answered { error, leader })
            }
            Err(ureq::Error::Transport(t)) => {
                let text = t.to_string();
                let error = ClientError::Unreachable {
                    base: self.base.clone(),
                    reason: text
                        .strip_prefix(&format!("{url}: "))
                        .unwrap_or(&text)
                        .to_string(),
                };
                // ureq names a failure to resolve or connect so; anything
                // else (reset, timed out reading, TLS) may come after the
                // request left.
                Err(match t.kind() {
                    ureq::ErrorKind::Dns | ureq::ErrorKind::ConnectionFailed => Failure::NotSent(error),
                    _ => Failure::MaybeSent(error),
                })
            }
        }
    }
}

/// How a call failed, for [`crate::Controls`] to decide whether another
/// control may be asked.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The request never left: the name did not resolve, the connection
    /// was refused or not made in time.
    NotSent(ClientError),
    /// The connection failed after it was made: the request may have been
    /// carried out.
    MaybeSent(ClientError),
    /// The server answered (an error, or a success not understood).
    Answered {
        /// The error.
        error: ClientError,
        /// The `X-Phub-Leader` header of the answer, if any.
        leader: Option<String>,
    },
}

impl Failure {
    pub(crate) fn into_error(self) -> ClientError {
        match self {
            Failure::NotSent(e) | Failure::MaybeSent(e) | Failure::Answered { error: e, .. } => e,
        }
    }
}
