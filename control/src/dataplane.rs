//! Client of the dataplane's management API: the calls of
//! `phub_proto::routes::mgmt`, with the management token read from its file
//! (and read again when the dataplane made a new one).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use phub_proto::api::{ApiError, DataplaneInfo, DataplaneStats, InstallJob, InstalledJob};
use phub_proto::failover::EpochView;
use phub_proto::routes::mgmt::{self, MgmtCall};
use phub_proto::routes::Route;

/// What went wrong talking to the dataplane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DataplaneError {
    /// No answer: connection refused, reset, timed out.
    #[error("cannot reach the dataplane at {base} (appliance {appliance:?}): {reason}")]
    Unreachable {
        /// The appliance.
        appliance: String,
        /// The management base URL.
        base: String,
        /// What the transport said.
        reason: String,
    },
    /// An error answer (4xx or 5xx).
    #[error("the dataplane of appliance {appliance:?} refused {what}: {message} (HTTP {status})")]
    Refused {
        /// The appliance.
        appliance: String,
        /// The request, e.g. `PUT /v1/jobs/3`.
        what: String,
        /// The status code.
        status: u16,
        /// Its `ApiError` message, or the body.
        message: String,
    },
    /// The management token file cannot be read: the dataplane is not
    /// running (it removes the file it made when it stops), or control was
    /// pointed at another file.
    #[error(
        "cannot read the management token of appliance {appliance:?}: {reason} (is its phub-dataplane \
         running? point --dataplane-token-file, or the appliance's token-file, at its --mgmt-token-file)"
    )]
    Credentials {
        /// The appliance.
        appliance: String,
        /// What is wrong with the file (names it).
        reason: String,
    },
    /// An answer that is not what the API defines.
    #[error("the answer of appliance {appliance:?}'s dataplane to {what} is not understood: {reason}")]
    BadAnswer {
        /// The appliance.
        appliance: String,
        /// The request.
        what: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint file to restore from cannot be read.
    #[error("cannot read the checkpoint file {path} to restore appliance {appliance:?} from: {reason}")]
    File {
        /// The appliance.
        appliance: String,
        /// The file.
        path: String,
        /// What reading it said.
        reason: String,
    },
}

impl DataplaneError {
    /// Whether the dataplane could not be reached at all.
    pub(crate) fn is_unreachable(&self) -> bool {
        matches!(
            self,
            DataplaneError::Unreachable { .. } | DataplaneError::Credentials { .. }
        )
    }
}

/// Longest wait for a connection to a dataplane's management API.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest wait for the answer to a read (`GET /v1/info`, `/v1/jobs`,
/// `/v1/stats`, `/v1/auth`): small answers that a live dataplane gives at
/// once.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for the answer to a change or a checkpoint, which carry a
/// job's memory.
pub(crate) const CHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a checkpoint's transfer may take in all (the dataplane cuts one
/// that stalls for a minute long before).
pub(crate) const CHECKPOINT_LIMIT: Duration = Duration::from_secs(6 * 3600);

/// A blocking client; cheap to clone.
#[derive(Clone)]
pub(crate) struct Client {
    name: String,
    base: String,
    agent: ureq::Agent,
    token_path: PathBuf,
    /// The token last read from `token_path`; read again after a 401 or
    /// 403 (the dataplane restarted with a new one).
    token: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("Client")
            .field("name", &self.name)
            .field("base", &self.base)
            .field("token_path", &self.token_path)
            .finish_non_exhaustive()
    }
}

/// A success's body read whole into `call`'s answer.
fn read_answer<A>(call: &MgmtCall<'_, A>, body: &mut dyn Read) -> Result<A, String> {
    let mut bytes = Vec::new();
    body.read_to_end(&mut bytes).map_err(|e| e.to_string())?;
    call.answer(&bytes)
}

impl Client {
    /// A client for the management API of appliance `name` at `base`
    /// (e.g. `http://127.0.0.1:7800`) that authenticates with the token in
    /// `token_path`.
    pub(crate) fn new(name: &str, base: &str, token_path: PathBuf) -> Client {
        // No pooled connections: calls are rare, and a fresh connection
        // notices at once that a dataplane went away (a pooled one can hang
        // on a half-dead peer until the timeout).
        let agent = ureq::AgentBuilder::new()
            .max_idle_connections(0)
            .timeout_connect(CONNECT_TIMEOUT)
            .timeout(CHANGE_TIMEOUT)
            .build();
        Client {
            name: name.to_string(),
            base: base.trim_end_matches('/').to_string(),
            agent,
            token_path,
            token: Arc::new(Mutex::new(None)),
        }
    }

    /// The token, read from its file unless known (or `fresh` is asked).
    fn token(&self, fresh: bool) -> Result<String, DataplaneError> {
        let mut t = self
            .token
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if fresh || t.is_none() {
            *t =
                Some(
                    phub_http::secret::read(&self.token_path).map_err(|e| DataplaneError::Credentials {
                        appliance: self.name.clone(),
                        reason: e.to_string(),
                    })?,
                );
        }
        Ok(t.clone().unwrap_or_default())
    }

    /// The base URL.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The management token file.
    pub(crate) fn token_path(&self) -> &std::path::Path {
        &self.token_path
    }

    fn send<A>(&self, call: &MgmtCall<'_, A>) -> Result<A, DataplaneError> {
        self.send_within(call, None)
    }

    /// [`Client::send`], the whole request (connection included) within
    /// `limit` when given.
    fn send_within<A>(&self, call: &MgmtCall<'_, A>, limit: Option<Duration>) -> Result<A, DataplaneError> {
        self.with_token(|fresh| self.send_with(call, fresh, limit))
    }

    /// `send(false)`, then `send(true)` (the token read again) when the
    /// dataplane refused the token: it restarted and made a new one. A
    /// refusal has no body: the first call read and wrote nothing.
    fn with_token<T>(
        &self,
        mut send: impl FnMut(bool) -> Result<T, DataplaneError>,
    ) -> Result<T, DataplaneError> {
        match send(false) {
            Err(DataplaneError::Refused {
                status: 401 | 403, ..
            }) => send(true),
            r => r,
        }
    }

    fn send_with<A>(
        &self,
        call: &MgmtCall<'_, A>,
        fresh: bool,
        limit: Option<Duration>,
    ) -> Result<A, DataplaneError> {
        self.exchange(call, fresh, limit, None, |body| read_answer(call, body))
    }

    /// Sends `call` (its body, or `upload`'s file of that many bytes,
    /// streamed from it) and hands a success's body to `read` (which says
    /// why it is not the answer, if it is not).
    fn exchange<A, T>(
        &self,
        call: &MgmtCall<'_, A>,
        fresh: bool,
        limit: Option<Duration>,
        upload: Option<(&std::path::Path, u64)>,
        read: impl FnOnce(&mut dyn Read) -> Result<T, String>,
    ) -> Result<T, DataplaneError> {
        let route = call.route;
        let url = format!("{}{}", self.base, route.path());
        let mut req = self.agent.request(route.method().as_str(), &url);
        if let Some(limit) = limit {
            req = req.timeout(limit);
        } else if route.is_quick() {
            req = req.timeout(READ_TIMEOUT);
        }
        // Reading the description, jobs and counters needs no token: without
        // one (a dataplane that is down removed its file), such a call still
        // tells whether the dataplane answers.
        match self.token(fresh) {
            Ok(t) => req = req.set("Authorization", &format!("Bearer {t}")),
            Err(_) if !route.needs_token() => {}
            Err(e) => return Err(e),
        }
        let res = match (upload, call.body.content_type()) {
            (Some((path, len)), ct) => {
                let f = std::fs::File::open(path).map_err(|e| DataplaneError::File {
                    appliance: self.name.clone(),
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })?;
                req.set("Content-Type", ct.unwrap_or("application/octet-stream"))
                    .set("Content-Length", &len.to_string())
                    .send(std::io::BufReader::with_capacity(1 << 20, f))
            }
            (None, Some(ct)) => req.set("Content-Type", ct).send_bytes(call.body.bytes()),
            (None, None) => req.call(),
        };
        let bad = |reason: String| DataplaneError::BadAnswer {
            appliance: self.name.clone(),
            what: call.what(),
            reason,
        };
        match res {
            Ok(r) => read(&mut r.into_reader()).map_err(bad),
            Err(ureq::Error::Status(status, r)) => {
                let body = r.into_string().unwrap_or_default();
                let message = ApiError::message_of(&body);
                Err(DataplaneError::Refused {
                    appliance: self.name.clone(),
                    what: call.what(),
                    status,
                    message,
                })
            }
            Err(ureq::Error::Transport(t)) => {
                let text = t.to_string();
                let reason = text
                    .strip_prefix(&format!("{url}: "))
                    .unwrap_or(&text)
                    .to_string();
                Err(DataplaneError::Unreachable {
                    appliance: self.name.clone(),
                    base: self.base.clone(),
                    reason,
                })
            }
        }
    }

    /// `GET /v1/info`.
    pub(crate) fn info(&self) -> Result<DataplaneInfo, DataplaneError> {
        self.send(&mgmt::info())
    }

    /// `GET /v1/auth`: whether the management token is the dataplane's
    /// (a `Refused` 401 or 403 if not).
    pub(crate) fn check_token(&self) -> Result<(), DataplaneError> {
        self.send_with(&mgmt::auth(), true, None)
    }

    /// A heartbeat: `GET /v1/info`, which the dataplane answers without
    /// touching its jobs, answered within `limit`. `Ok` for any answer
    /// (even a refusal: the dataplane is there), with the dataplane's
    /// identity when it gave one; `Err` when none came.
    pub(crate) fn heartbeat(&self, limit: Duration) -> Result<Option<String>, DataplaneError> {
        match self.send_within(&mgmt::info(), Some(limit)) {
            Ok(info) => Ok(Some(info.id).filter(|id| !id.is_empty())),
            Err(DataplaneError::Refused { .. } | DataplaneError::BadAnswer { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `PUT /v1/jobs/{id}/epoch`: installs a replicated job's epoch.
    pub(crate) fn epoch(&self, id: u16, view: &EpochView) -> Result<(), DataplaneError> {
        self.send(&mgmt::epoch(id, view))
    }

    /// `GET /v1/jobs`.
    pub(crate) fn jobs(&self) -> Result<Vec<InstalledJob>, DataplaneError> {
        self.send(&mgmt::jobs())
    }

    /// `GET /v1/stats`.
    pub(crate) fn stats(&self) -> Result<DataplaneStats, DataplaneError> {
        self.send(&mgmt::stats())
    }

    /// `PUT /v1/jobs/{id}`; any 2xx (the API says 201) means installed.
    pub(crate) fn install(&self, job: &InstallJob) -> Result<(), DataplaneError> {
        self.send(&mgmt::install(job))
    }

    /// `DELETE /v1/jobs/{id}`; `Ok(false)` when the dataplane did not have it (404).
    pub(crate) fn remove(&self, id: u16) -> Result<bool, DataplaneError> {
        match self.send(&mgmt::remove(id)) {
            Ok(()) => Ok(true),
            Err(DataplaneError::Refused { status: 404, .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `GET /v1/jobs/{id}/checkpoint`: the job's checkpoint file, written
    /// to `out` as it comes (never whole in memory); its bytes. The
    /// dataplane streams it and cuts it if it stalls, so the whole call is
    /// allowed [`CHECKPOINT_LIMIT`] rather than a change's 10 s.
    pub(crate) fn checkpoint_into(&self, id: u16, out: &mut dyn Write) -> Result<u64, DataplaneError> {
        let call = mgmt::checkpoint(id);
        self.with_token(|fresh| {
            self.exchange(&call, fresh, Some(CHECKPOINT_LIMIT), None, |body| {
                std::io::copy(body, out).map_err(|e| e.to_string())
            })
        })
    }

    /// `PUT /v1/jobs/{id}` with the checkpoint file at `path` (`bytes`
    /// long), streamed from the file: installs the job restored. Allowed
    /// [`CHECKPOINT_LIMIT`], as a checkpoint's transfer is.
    pub(crate) fn restore_file(
        &self,
        id: u16,
        path: &std::path::Path,
        bytes: u64,
    ) -> Result<(), DataplaneError> {
        let call = mgmt::restore(id, &[]);
        self.with_token(|fresh| {
            self.exchange(
                &call,
                fresh,
                Some(CHECKPOINT_LIMIT),
                Some((path, bytes)),
                |body| read_answer(&call, body),
            )
        })
    }

    /// `PUT /v1/jobs/{id}` with a checkpoint file: installs the job restored.
    pub(crate) fn restore(&self, id: u16, ckpt: &[u8]) -> Result<(), DataplaneError> {
        self.send(&mgmt::restore(id, ckpt))
    }
}
