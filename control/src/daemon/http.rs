//! The HTTP boundary: which routes need the operator token and which take
//! a large body, the dispatch of each [`ControlRoute`] (parsed by
//! `phub_proto::routes`, the one route table) to its handler, and how each
//! [`RequestError`] becomes a status. Everything behind a route is a
//! method of [`Shared`] in the module of its use case.

use phub_proto::api::{ApplianceSpec, RetryRequest};
use phub_proto::routes::{AddMode, ControlRoute, Route, RouteError};
use phub_proto::spec::SpecError;
use serde::Serialize;

use super::registry::Shared;
use crate::admission::AdmitError;
use crate::dataplane::DataplaneError;
use crate::metrics;

/// Largest job spec accepted by `POST /v1/jobs`, in bytes (a spec lists
/// every key: a 10^6-key spec is about 15 MB of TOML).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Largest body of any other request (a join), in bytes.
pub const MAX_SMALL_BODY_BYTES: usize = 64 << 10;

/// Why a request failed; each variant has its HTTP status.
#[derive(Debug, thiserror::Error)]
pub(super) enum RequestError {
    /// Malformed body, bad id, invalid spec: 400.
    #[error("{0}")]
    BadRequest(String),
    /// No operator token: 401.
    #[error("{0}")]
    Unauthorized(String),
    /// Wrong token: 403.
    #[error("{0}")]
    Forbidden(String),
    /// Unknown job or appliance: 404.
    #[error("{0}")]
    NotFound(String),
    /// The method and path name no route: 404 for an unknown path, 405
    /// for a known path with another method, 400 for a malformed job id or
    /// key index.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// Duplicate rank: 409.
    #[error("{0}")]
    Conflict(String),
    /// The job does not fit: 507.
    #[error(transparent)]
    Capacity(#[from] AdmitError),
    /// The dataplane is unreachable or refused: 502.
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    /// The state file could not be written: 500.
    #[error("{0}")]
    State(String),
    /// A write sent to a follower (state in etcd, another control
    /// leads): 503, with the leader's URL in `X-Phub-Leader` when one
    /// leads.
    #[error("{message}")]
    NotLeader {
        /// What to do, naming the leader.
        message: String,
        /// The leader's URL.
        leader: Option<String>,
    },
}

impl RequestError {
    pub(super) fn status(&self) -> u16 {
        match self {
            RequestError::BadRequest(_) => 400,
            RequestError::Unauthorized(_) => 401,
            RequestError::Forbidden(_) => 403,
            RequestError::NotFound(_) | RequestError::Route(RouteError::NotFound { .. }) => 404,
            RequestError::Route(RouteError::Method { .. }) => 405,
            RequestError::Route(RouteError::JobId { .. } | RouteError::Key { .. }) => 400,
            RequestError::Conflict(_) => 409,
            RequestError::Capacity(_) => 507,
            RequestError::Dataplane(_) => 502,
            RequestError::State(_) => 500,
            RequestError::NotLeader { .. } => 503,
        }
    }
}

impl From<SpecError> for RequestError {
    fn from(e: SpecError) -> RequestError {
        RequestError::BadRequest(e.to_string())
    }
}

/// An answer ready to send.
pub(super) struct Reply {
    pub(super) status: u16,
    pub(super) content_type: &'static str,
    pub(super) body: Vec<u8>,
}

impl Reply {
    pub(super) fn json<T: Serialize>(status: u16, body: &T) -> Reply {
        let mut body = serde_json::to_vec(body).expect("API types serialise");
        body.push(b'\n');
        Reply {
            status,
            content_type: "application/json",
            body,
        }
    }
}

pub(super) fn not_admitted(id: u16) -> RequestError {
    RequestError::NotFound(format!("job {id} is not admitted"))
}

/// The answer to a join or checkpoint of a failed job: 409 with its reason.
pub(super) fn failed(id: u16, why: &str) -> RequestError {
    RequestError::Conflict(format!("job {id} failed: {why}; evict it and admit again"))
}

/// The answer to a join or checkpoint of a held job: 409 with its reason
/// and the way out.
pub(super) fn held(id: u16, why: &str) -> RequestError {
    RequestError::Conflict(format!(
        "job {id} is held: {why}; repair or restore the file, then `phubctl job retry {id}` (or `phubctl job \
         retry {id} --discard-checkpoint` to set the file aside and start the part over without it)"
    ))
}

pub(super) fn body_text(req: &phub_http::Request) -> Result<&str, RequestError> {
    std::str::from_utf8(&req.body)
        .map_err(|e| RequestError::BadRequest(format!("request body is not UTF-8: {e}")))
}

/// Whether a request needs the operator token, by its route's shape
/// ([`ControlRoute::needs_token_at`]: an operator's route with a malformed
/// id needs it too).
fn needs_operator(head: &phub_http::Request) -> bool {
    ControlRoute::needs_token_at(&head.method, &head.path, head.query.as_deref())
}

pub(super) fn error_response(e: &RequestError) -> phub_http::Response {
    let mut r = phub_http::Response::error(e.status(), e.to_string());
    if e.status() == 401 {
        r = r.with_header("WWW-Authenticate", "Bearer");
    }
    if let RequestError::NotLeader { leader: Some(l), .. } = e {
        r = r.with_header(LEADER_HEADER, l.clone());
    }
    r
}

/// The header of a follower's `503` that names the leader's URL (the one
/// [`phub_http::Controls`] follows).
pub use phub_http::LEADER_HEADER;

/// Whether `route` changes state (joins and the operator's routes): a
/// follower turns it away.
fn is_write(route: &ControlRoute) -> bool {
    route.needs_token() || matches!(route, ControlRoute::Join { .. })
}

/// Joins and the operator's routes run in handlers of their own, which
/// reads (anyone may make them, and a hung appliance may slow them) cannot
/// take; everything else is a read.
fn class_of(head: &phub_http::Request) -> phub_http::Class {
    match ControlRoute::shape(&head.method, &head.path, head.query.as_deref()) {
        Some(r) if is_write(&r) => phub_http::Class::Write,
        _ => phub_http::Class::Read,
    }
}

impl phub_http::Handler for Shared {
    fn class(&self, head: &phub_http::Request) -> phub_http::Class {
        class_of(head)
    }

    /// The operator token; failed checks are logged and limited per source
    /// by the listener.
    fn needs_credential(&self, head: &phub_http::Request) -> bool {
        needs_operator(head)
    }

    fn check_head(&self, head: &phub_http::Request) -> Result<(), phub_http::Response> {
        if needs_operator(head) {
            self.check_operator(head).map_err(|e| error_response(&e))?;
        }
        Ok(())
    }

    fn body_limit(&self, head: &phub_http::Request) -> usize {
        // Only the operator, checked above, may send a large body.
        match ControlRoute::parse(&head.method, &head.path, head.query.as_deref()) {
            Ok(ControlRoute::Admit) => MAX_BODY_BYTES,
            _ => MAX_SMALL_BODY_BYTES,
        }
    }

    fn handle(&self, req: phub_http::Request) -> phub_http::Response {
        match self.route(&req) {
            Ok(r) => phub_http::Response::new(r.status, r.content_type, r.body),
            Err(e) => error_response(&e),
        }
    }
}

impl Shared {
    /// Answers a request: checks the operator token where its route needs
    /// it, parses its route and [`Shared::dispatch`]es it.
    pub(super) fn route(&self, req: &phub_http::Request) -> Result<Reply, RequestError> {
        // Checked before the body was read too ([`Handler::check_head`]);
        // again here so that no route depends on the listener for it.
        if needs_operator(req) {
            self.check_operator(req)?;
        }
        let route = ControlRoute::parse(&req.method, &req.path, req.query.as_deref())?;
        if is_write(&route) {
            self.check_leader()?;
        }
        self.dispatch(route, req)
    }

    /// Runs `route`'s handler with `req`'s body. One arm per route and no
    /// catch-all: a route added to [`ControlRoute`] does not build until
    /// it has its handler here.
    pub(super) fn dispatch(
        &self,
        route: ControlRoute,
        req: &phub_http::Request,
    ) -> Result<Reply, RequestError> {
        use ControlRoute as R;
        match route {
            R::Jobs => Ok(Reply::json(200, &self.list())),
            R::Admit => {
                let body = body_text(req)?;
                Ok(Reply::json(201, &self.admit(body, req.header("Content-Type"))?))
            }
            R::Job { job } => Ok(Reply::json(200, &self.show(job)?)),
            R::Evict { job } => Ok(Reply::json(200, &self.evict(job)?)),
            R::Checkpoint { job } => Ok(Reply::json(200, &self.checkpoint(job)?)),
            R::Retry { job } => {
                let body = body_text(req)?;
                let r: RetryRequest = if body.trim().is_empty() {
                    RetryRequest::default()
                } else {
                    serde_json::from_str(body).map_err(|e| {
                        RequestError::BadRequest(format!(
                            "invalid retry request: {e}; expected {{\"discard_checkpoint\": false}} (or true), or \
                             no body"
                        ))
                    })?
                };
                Ok(Reply::json(200, &self.retry(job, r.discard_checkpoint)?))
            }
            R::Map { job, key } => Ok(Reply::json(200, &self.map(job, key)?)),
            R::Join { job } => {
                let body = body_text(req)?;
                Ok(Reply::json(200, &self.join(job, body)?))
            }
            R::Epoch { job } => Ok(Reply::json(200, &self.epoch(job)?)),
            R::Appliances => Ok(Reply::json(200, &self.appliances())),
            R::AddAppliance { mode } => {
                let a: ApplianceSpec = serde_json::from_str(body_text(req)?).map_err(|e| {
                    RequestError::BadRequest(format!(
                        "invalid appliance: {e}; expected {{\"name\": ..., \"url\": ..., \"rack\": ..., \
                         \"token_file\": ...}}"
                    ))
                })?;
                Ok(Reply::json(201, &self.add_appliance(a, mode == AddMode::Forced)?))
            }
            R::RemoveAppliance { name } => Ok(Reply::json(200, &self.remove_appliance(&name)?)),
            R::DrainAppliance { name } => Ok(Reply::json(200, &self.drain(&name)?)),
            R::Rebalance { job } => Ok(Reply::json(200, &self.rebalance(job)?)),
            R::Stats => Ok(Reply::json(200, &self.stats())),
            R::Metrics => Ok(Reply {
                status: 200,
                content_type: metrics::CONTENT_TYPE,
                body: self.metrics().into_bytes(),
            }),
        }
    }

    /// Checks the `Authorization: Bearer` header against the operator token.
    pub(super) fn check_operator(&self, req: &phub_http::Request) -> Result<(), RequestError> {
        let Some(given) = req.header("Authorization") else {
            return Err(RequestError::Unauthorized(format!(
                "this request needs the operator token: send `Authorization: Bearer <token>`; \
                 phub-control keeps it in {} (readable by its owner only)",
                self.token_path.display()
            )));
        };
        let token = phub_http::bearer(Some(given)).map_err(|_| {
            RequestError::Unauthorized("the Authorization header must be `Bearer <operator token>`".into())
        })?;
        if !phub_http::token_matches(token, &self.operator_token) {
            return Err(RequestError::Forbidden("wrong operator token".into()));
        }
        Ok(())
    }
}
