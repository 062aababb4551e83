//! The HTTP boundary: which routes need the operator token and which take
//! a large body, the route table (a match on the path, method by method),
//! and how each [`RequestError`] becomes a status. Everything behind a
//! route is a method of [`Shared`] in the module of its use case.

use phub_proto::api::{ApplianceSpec, RetryRequest};
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
    /// Unknown job or route: 404.
    #[error("{0}")]
    NotFound(String),
    /// Known path, wrong method: 405.
    #[error("method {method} is not allowed on {path}; allowed: {allowed}")]
    Method {
        /// The method used.
        method: String,
        /// The path.
        path: String,
        /// The methods the path takes.
        allowed: &'static str,
    },
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
}

impl RequestError {
    pub(super) fn status(&self) -> u16 {
        match self {
            RequestError::BadRequest(_) => 400,
            RequestError::Unauthorized(_) => 401,
            RequestError::Forbidden(_) => 403,
            RequestError::NotFound(_) => 404,
            RequestError::Method { .. } => 405,
            RequestError::Conflict(_) => 409,
            RequestError::Capacity(_) => 507,
            RequestError::Dataplane(_) => 502,
            RequestError::State(_) => 500,
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

/// A job id as control writes them: decimal digits, no sign, no leading
/// zero ("+1" and "01" name no job).
pub(super) fn parse_id(s: &str) -> Result<u16, RequestError> {
    let canonical = !s.starts_with('0') && s.bytes().all(|b| b.is_ascii_digit());
    match s.parse::<u16>() {
        Ok(id) if id > 0 && canonical => Ok(id),
        _ => Err(RequestError::BadRequest(format!(
            "job id {s:?} is not an integer from 1 to 65535"
        ))),
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

/// The routes that need the operator token.
pub(super) fn needs_operator(method: &str, segs: &[&str]) -> bool {
    matches!(
        (method, segs),
        ("POST", ["v1", "jobs"])
            | ("DELETE", ["v1", "jobs", _])
            | ("POST", ["v1", "jobs", _, "checkpoint"])
            | ("POST", ["v1", "jobs", _, "retry"])
            | ("POST", ["v1", "appliances"])
            | ("DELETE", ["v1", "appliances", _])
    )
}

pub(super) fn segments(path: &str) -> Vec<&str> {
    path.trim_matches('/').split('/').collect()
}

pub(super) fn error_response(e: &RequestError) -> phub_http::Response {
    let mut r = phub_http::Response::error(e.status(), e.to_string());
    if e.status() == 401 {
        r = r.with_header("WWW-Authenticate", "Bearer");
    }
    r
}

/// Joins and the operator's routes run in handlers of their own, which
/// reads (anyone may make them, and a hung appliance may slow them) cannot
/// take; everything else is a read.
pub(super) fn class_of(method: &str, segs: &[&str]) -> phub_http::Class {
    if needs_operator(method, segs) || matches!((method, segs), ("POST", ["v1", "jobs", _, "join"])) {
        phub_http::Class::Write
    } else {
        phub_http::Class::Read
    }
}

impl phub_http::Handler for Shared {
    fn class(&self, head: &phub_http::Request) -> phub_http::Class {
        class_of(&head.method, &segments(&head.path))
    }

    /// The operator token; failed checks are logged and limited per source
    /// by the listener.
    fn needs_credential(&self, head: &phub_http::Request) -> bool {
        needs_operator(&head.method, &segments(&head.path))
    }

    fn check_head(&self, head: &phub_http::Request) -> Result<(), phub_http::Response> {
        if needs_operator(&head.method, &segments(&head.path)) {
            self.check_operator(head).map_err(|e| error_response(&e))?;
        }
        Ok(())
    }

    fn body_limit(&self, head: &phub_http::Request) -> usize {
        // Only the operator, checked above, may send a large body.
        if head.method == "POST" && segments(&head.path) == ["v1", "jobs"] {
            MAX_BODY_BYTES
        } else {
            MAX_SMALL_BODY_BYTES
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
    pub(super) fn route(&self, req: &phub_http::Request) -> Result<Reply, RequestError> {
        let (method, path) = (req.method.as_str(), req.path.as_str());
        let segs = segments(path);
        let wrong = |allowed| RequestError::Method {
            method: method.to_string(),
            path: path.to_string(),
            allowed,
        };
        // Checked before the body was read too ([`Handler::check_head`]);
        // again here so that no route depends on the listener for it.
        if needs_operator(method, &segs) {
            self.check_operator(req)?;
        }
        match segs.as_slice() {
            ["v1", "jobs"] => match method {
                "GET" => Ok(Reply::json(200, &self.list())),
                "POST" => {
                    let body = body_text(req)?;
                    Ok(Reply::json(201, &self.admit(body, req.header("Content-Type"))?))
                }
                _ => Err(wrong("GET, POST")),
            },
            ["v1", "jobs", id] => match method {
                "GET" => Ok(Reply::json(200, &self.show(parse_id(id)?)?)),
                "DELETE" => Ok(Reply::json(200, &self.evict(parse_id(id)?)?)),
                _ => Err(wrong("GET, DELETE")),
            },
            ["v1", "jobs", id, "checkpoint"] => match method {
                "POST" => Ok(Reply::json(200, &self.checkpoint(parse_id(id)?)?)),
                _ => Err(wrong("POST")),
            },
            ["v1", "jobs", id, "retry"] => match method {
                "POST" => {
                    let id = parse_id(id)?;
                    let body = body_text(req)?;
                    let r: RetryRequest = if body.trim().is_empty() {
                        RetryRequest::default()
                    } else {
                        serde_json::from_str(body).map_err(|e| {
                            RequestError::BadRequest(format!(
                                "invalid retry request: {e}; expected {{\"discard_checkpoint\": false}} (or true), \
                                 or no body"
                            ))
                        })?
                    };
                    Ok(Reply::json(200, &self.retry(id, r.discard_checkpoint)?))
                }
                _ => Err(wrong("POST")),
            },
            ["v1", "jobs", id, "map"] => match method {
                "GET" => Ok(Reply::json(200, &self.map(parse_id(id)?, None)?)),
                _ => Err(wrong("GET")),
            },
            ["v1", "jobs", id, "map", "keys", key] => match method {
                "GET" => {
                    let key = key.parse::<u32>().map_err(|_| {
                        RequestError::BadRequest(format!("key {key:?} is not a key index (0, 1, ...)"))
                    })?;
                    Ok(Reply::json(200, &self.map(parse_id(id)?, Some(key))?))
                }
                _ => Err(wrong("GET")),
            },
            ["v1", "jobs", id, "join"] => match method {
                "POST" => {
                    let id = parse_id(id)?;
                    let body = body_text(req)?;
                    Ok(Reply::json(200, &self.join(id, body)?))
                }
                _ => Err(wrong("POST")),
            },
            ["v1", "appliances"] => match method {
                "GET" => Ok(Reply::json(200, &self.appliances())),
                "POST" => {
                    let a: ApplianceSpec = serde_json::from_str(body_text(req)?).map_err(|e| {
                        RequestError::BadRequest(format!(
                            "invalid appliance: {e}; expected {{\"name\": ..., \"url\": ..., \"rack\": ..., \
                             \"token_file\": ...}}"
                        ))
                    })?;
                    let force = req.query.as_deref().is_some_and(|q| {
                        q.split('&')
                            .any(|kv| matches!(kv, "force" | "force=true" | "force=1"))
                    });
                    Ok(Reply::json(201, &self.add_appliance(a, force)?))
                }
                _ => Err(wrong("GET, POST")),
            },
            ["v1", "appliances", name] => match method {
                "DELETE" => Ok(Reply::json(200, &self.remove_appliance(name)?)),
                _ => Err(wrong("DELETE")),
            },
            ["v1", "stats"] => match method {
                "GET" => Ok(Reply::json(200, &self.stats())),
                _ => Err(wrong("GET")),
            },
            ["metrics"] => match method {
                "GET" => Ok(Reply {
                    status: 200,
                    content_type: metrics::CONTENT_TYPE,
                    body: self.metrics().into_bytes(),
                }),
                _ => Err(wrong("GET")),
            },
            _ => Err(RequestError::NotFound(format!(
                "no route for {method} {path}; see the route table in phub_proto::api"
            ))),
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
