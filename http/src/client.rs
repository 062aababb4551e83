//! The one blocking client of phub's HTTP APIs: sends a typed
//! [`Call`] (`phub_proto::routes`) to phub-control or a dataplane's
//! management API and reads the answer into the call's type. phubctl, the
//! tests, the lab suite and the tools use it; control's own client of its
//! dataplanes adds the management token's refresh on top of the same calls.

use std::io::Read;
use std::path::Path;

use phub_proto::api::ApiError;
use phub_proto::routes::{Call, Route};

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
}

impl ClientError {
    /// The error answer's status code; None when there was no answer or it
    /// was a success not understood.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } | ClientError::Http { status, .. } => Some(*status),
            ClientError::Unreachable { .. } | ClientError::BadAnswer { .. } => None,
        }
    }

    /// What the server or the transport said, without the URL.
    pub fn message(&self) -> &str {
        match self {
            ClientError::Api { message, .. } | ClientError::Http { message, .. } => message,
            ClientError::Unreachable { reason, .. } | ClientError::BadAnswer { reason, .. } => reason,
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
        let bad = |reason: String| ClientError::BadAnswer {
            what: call.what(),
            reason,
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
                let body = r.into_string().unwrap_or_default();
                Err(match ApiError::parse(&body) {
                    Some(e) => ClientError::Api {
                        status,
                        message: e.error,
                    },
                    None => ClientError::Http {
                        status,
                        url,
                        message: ApiError::message_of(&body),
                    },
                })
            }
            Err(ureq::Error::Transport(t)) => {
                let text = t.to_string();
                Err(ClientError::Unreachable {
                    base: self.base.clone(),
                    reason: text
                        .strip_prefix(&format!("{url}: "))
                        .unwrap_or(&text)
                        .to_string(),
                })
            }
        }
    }
}
