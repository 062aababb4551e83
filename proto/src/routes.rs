//! Every route of phub's two HTTP APIs as a typed value: phub-control's
//! ([`ControlRoute`]) and phub-dataplane's management API ([`MgmtRoute`]).
//!
//! A route knows its method, its path (built from typed ids, never from a
//! string a caller formats) and whether it needs a token. A server parses
//! what it received with [`ControlRoute::parse`] or [`MgmtRoute::parse`]; a
//! client builds a [`Call`] with the functions of [`control`] and [`mgmt`],
//! which fix each route's request body and the type its answer is read
//! into, in this one place. The bodies and answers are the types of
//! [`crate::api`], whose module head has the route table.
//!
//! Layer: pure (no I/O). `phub_http::client` sends a [`Call`].
//!
//! Invariant: `parse(method, path)` of a route's [`Route::method`] and
//! [`Route::path`] gives the route back (tested below for every route).

use std::borrow::Cow;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::{
    AdmitResponse, ApplianceSpec, ApplianceStatus, CheckpointInfo, DataplaneInfo, DataplaneStats, Drain,
    InstallJob, InstalledJob, JobDetail, JobMap, JobSummary, JoinRequest, JoinResponse, Rebalance,
    RetryRequest, RetryResponse, Stats,
};
use crate::failover::EpochView;

/// An HTTP method the APIs use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// `GET`: reads.
    Get,
    /// `POST`: creates or acts.
    Post,
    /// `PUT`: installs at a known id.
    Put,
    /// `DELETE`: removes.
    Delete,
}

impl Method {
    /// The method as HTTP spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Delete => "DELETE",
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a request's method and path name no route.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No route has this path.
    #[error("no route for {method} {path}")]
    NotFound {
        /// The method used.
        method: String,
        /// The path asked for.
        path: String,
    },
    /// The path is a route's, but not with this method.
    #[error("method {method} is not allowed on {path}; allowed: {allowed}")]
    Method {
        /// The method used.
        method: String,
        /// The path asked for.
        path: String,
        /// The methods the path takes, e.g. `GET, DELETE`.
        allowed: &'static str,
    },
    /// A job id that is not written as ids are: decimal, 1 to 65535, no
    /// sign, no leading zero (`01` and `+1` name no job).
    #[error("job id {given:?} is not an integer from 1 to 65535")]
    JobId {
        /// The path segment given.
        given: String,
    },
    /// A key index that is not one.
    #[error("key {given:?} is not a key index (0, 1, ...)")]
    Key {
        /// The path segment given.
        given: String,
    },
}

impl RouteError {
    fn method(method: &str, path: &str, allowed: &'static str) -> RouteError {
        RouteError::Method {
            method: method.into(),
            path: path.into(),
            allowed,
        }
    }
}

/// What every route of either API tells: how it is asked for.
pub trait Route {
    /// Its method.
    fn method(&self) -> Method;
    /// Its path with its query, if it has one (`/v1/jobs/3`,
    /// `/v1/appliances?force=true`).
    fn path(&self) -> String;
    /// Whether it needs a token (`Authorization: Bearer`): control's
    /// operator token, the dataplane's management token.
    fn needs_token(&self) -> bool;
}

/// A job id as the APIs write them, or why `s` is none.
fn job_id(s: &str) -> Result<u16, RouteError> {
    let canonical = !s.starts_with('0') && s.bytes().all(|b| b.is_ascii_digit());
    match s.parse::<u16>() {
        Ok(id) if id > 0 && canonical => Ok(id),
        _ => Err(RouteError::JobId { given: s.to_string() }),
    }
}

fn segments(path: &str) -> Vec<&str> {
    path.trim_matches('/').split('/').collect()
}

/// Whether a query string asks for `force`.
fn forced(query: Option<&str>) -> bool {
    query.is_some_and(|q| {
        q.split('&')
            .any(|kv| matches!(kv, "force" | "force=true" | "force=1"))
    })
}

/// How `POST /v1/appliances` treats a dataplane that does not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddMode {
    /// Refused unless it answers, takes the token and is not managed
    /// already.
    Checked,
    /// Added unchecked (`?force=true`); reconciliation checks it when it
    /// answers.
    Forced,
}

/// A route of phub-control's API.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ControlRoute {
    /// `POST /v1/jobs`: admits a spec (TOML or JSON).
    Admit,
    /// `GET /v1/jobs`.
    Jobs,
    /// `GET /v1/jobs/{job}`.
    Job {
        /// The job.
        job: u16,
    },
    /// `DELETE /v1/jobs/{job}`.
    Evict {
        /// The job.
        job: u16,
    },
    /// `POST /v1/jobs/{job}/checkpoint`.
    Checkpoint {
        /// The job.
        job: u16,
    },
    /// `POST /v1/jobs/{job}/retry`.
    Retry {
        /// The job.
        job: u16,
    },
    /// `POST /v1/jobs/{job}/rebalance`: moves one part of a replicated
    /// job to a less loaded appliance (PROTOCOL.md §11.8).
    Rebalance {
        /// The job.
        job: u16,
    },
    /// `GET /v1/jobs/{job}/map`, or with a key `GET
    /// /v1/jobs/{job}/map/keys/{key}`.
    Map {
        /// The job.
        job: u16,
        /// The key whose chunks to list.
        key: Option<u32>,
    },
    /// `POST /v1/jobs/{job}/join`.
    Join {
        /// The job.
        job: u16,
    },
    /// `GET /v1/jobs/{job}/epoch`: a replicated job's epoch and the
    /// appliances down in it (PROTOCOL.md §11.6); needs no token.
    Epoch {
        /// The job.
        job: u16,
    },
    /// `GET /v1/stats`.
    Stats,
    /// `GET /v1/appliances`.
    Appliances,
    /// `POST /v1/appliances`, `?force=true` when forced.
    AddAppliance {
        /// Whether a dataplane that does not answer is refused.
        mode: AddMode,
    },
    /// `DELETE /v1/appliances/{name}`.
    RemoveAppliance {
        /// The appliance's name.
        name: String,
    },
    /// `POST /v1/appliances/{name}/drain` (PROTOCOL.md §11.8).
    DrainAppliance {
        /// The appliance's name.
        name: String,
    },
    /// `GET /metrics` (Prometheus text).
    Metrics,
}

impl ControlRoute {
    /// The route a request names: its method, its path and query.
    pub fn parse(method: &str, path: &str, query: Option<&str>) -> Result<ControlRoute, RouteError> {
        use ControlRoute as R;
        let wrong = |allowed| Err(RouteError::method(method, path, allowed));
        match (segments(path).as_slice(), method) {
            (["v1", "jobs"], "GET") => Ok(R::Jobs),
            (["v1", "jobs"], "POST") => Ok(R::Admit),
            (["v1", "jobs"], _) => wrong("GET, POST"),
            (["v1", "jobs", id], "GET") => Ok(R::Job { job: job_id(id)? }),
            (["v1", "jobs", id], "DELETE") => Ok(R::Evict { job: job_id(id)? }),
            (["v1", "jobs", _], _) => wrong("GET, DELETE"),
            (["v1", "jobs", id, "checkpoint"], "POST") => Ok(R::Checkpoint { job: job_id(id)? }),
            (["v1", "jobs", id, "retry"], "POST") => Ok(R::Retry { job: job_id(id)? }),
            (["v1", "jobs", id, "join"], "POST") => Ok(R::Join { job: job_id(id)? }),
            (["v1", "jobs", id, "rebalance"], "POST") => Ok(R::Rebalance { job: job_id(id)? }),
            (["v1", "jobs", _, "checkpoint" | "retry" | "join" | "rebalance"], _) => wrong("POST"),
            (["v1", "jobs", id, "epoch"], "GET") => Ok(R::Epoch { job: job_id(id)? }),
            (["v1", "jobs", _, "epoch"], _) => wrong("GET"),
            (["v1", "jobs", id, "map"], "GET") => Ok(R::Map {
                job: job_id(id)?,
                key: None,
            }),
            (["v1", "jobs", id, "map", "keys", key], "GET") => {
                let key = key.parse::<u32>().map_err(|_| RouteError::Key {
                    given: key.to_string(),
                })?;
                Ok(R::Map {
                    job: job_id(id)?,
                    key: Some(key),
                })
            }
            (["v1", "jobs", _, "map"] | ["v1", "jobs", _, "map", "keys", _], _) => wrong("GET"),
            (["v1", "appliances"], "GET") => Ok(R::Appliances),
            (["v1", "appliances"], "POST") => Ok(R::AddAppliance {
                mode: if forced(query) {
                    AddMode::Forced
                } else {
                    AddMode::Checked
                },
            }),
            (["v1", "appliances"], _) => wrong("GET, POST"),
            (["v1", "appliances", name], "DELETE") => Ok(R::RemoveAppliance {
                name: (*name).to_string(),
            }),
            (["v1", "appliances", _], _) => wrong("DELETE"),
            (["v1", "appliances", name, "drain"], "POST") => Ok(R::DrainAppliance {
                name: (*name).to_string(),
            }),
            (["v1", "appliances", _, "drain"], _) => wrong("POST"),
            (["v1", "stats"], "GET") => Ok(R::Stats),
            (["metrics"], "GET") => Ok(R::Metrics),
            (["v1", "stats"] | ["metrics"], _) => wrong("GET"),
            _ => Err(RouteError::NotFound {
                method: method.into(),
                path: path.into(),
            }),
        }
    }
}

impl ControlRoute {
    /// The route a request's method and path have the shape of, reading a
    /// malformed job id or key index as a well-formed one
    /// (`DELETE /v1/jobs/01` has the shape of [`ControlRoute::Evict`]);
    /// None when no route has it. A server asks this of a request's head
    /// to know whether it needs the operator token before it reads the
    /// ids, so that an operator's route with a bad id is refused for want
    /// of the token as it would be with a good one.
    pub fn shape(method: &str, path: &str, query: Option<&str>) -> Option<ControlRoute> {
        match ControlRoute::parse(method, path, query) {
            Ok(route) => Some(route),
            Err(RouteError::JobId { .. } | RouteError::Key { .. }) => {
                let mut segs = segments(path);
                // The ids' places: /v1/jobs/{job}/map/keys/{key}.
                if let Some(job) = segs.get_mut(2) {
                    *job = "1";
                }
                if let Some(key) = segs.get_mut(5) {
                    *key = "0";
                }
                ControlRoute::parse(method, &segs.join("/"), query).ok()
            }
            Err(RouteError::NotFound { .. } | RouteError::Method { .. }) => None,
        }
    }

    /// Whether a request with this method and path needs the operator
    /// token, by its [`ControlRoute::shape`]: what names no route needs
    /// none (anyone is told it is not found).
    pub fn needs_token_at(method: &str, path: &str, query: Option<&str>) -> bool {
        ControlRoute::shape(method, path, query).is_some_and(|r| r.needs_token())
    }

    /// One of every route, for job `job`, key 0 and appliance `appliance`
    /// (both modes of [`ControlRoute::AddAppliance`], the map with and
    /// without a key): what a test walks to see that a server handles
    /// every route, and what the route table other languages mirror is
    /// written from. The match below has no catch-all arm: a route added
    /// to [`ControlRoute`] does not build until it is listed here too.
    pub fn every(job: u16, appliance: &str) -> Vec<ControlRoute> {
        use ControlRoute as R;
        let all = vec![
            R::Admit,
            R::Jobs,
            R::Job { job },
            R::Evict { job },
            R::Checkpoint { job },
            R::Retry { job },
            R::Rebalance { job },
            R::Map { job, key: None },
            R::Map { job, key: Some(0) },
            R::Join { job },
            R::Epoch { job },
            R::Stats,
            R::Appliances,
            R::AddAppliance {
                mode: AddMode::Checked,
            },
            R::AddAppliance {
                mode: AddMode::Forced,
            },
            R::RemoveAppliance {
                name: appliance.to_string(),
            },
            R::DrainAppliance {
                name: appliance.to_string(),
            },
            R::Metrics,
        ];
        for r in &all {
            match r {
                R::Admit
                | R::Jobs
                | R::Job { .. }
                | R::Evict { .. }
                | R::Checkpoint { .. }
                | R::Retry { .. }
                | R::Rebalance { .. }
                | R::Map { .. }
                | R::Join { .. }
                | R::Epoch { .. }
                | R::Stats
                | R::Appliances
                | R::AddAppliance { .. }
                | R::RemoveAppliance { .. }
                | R::DrainAppliance { .. }
                | R::Metrics => {}
            }
        }
        all
    }
}

impl Route for ControlRoute {
    fn method(&self) -> Method {
        use ControlRoute as R;
        match self {
            R::Jobs
            | R::Job { .. }
            | R::Map { .. }
            | R::Epoch { .. }
            | R::Stats
            | R::Appliances
            | R::Metrics => Method::Get,
            R::Admit
            | R::Checkpoint { .. }
            | R::Retry { .. }
            | R::Rebalance { .. }
            | R::Join { .. }
            | R::AddAppliance { .. }
            | R::DrainAppliance { .. } => Method::Post,
            R::Evict { .. } | R::RemoveAppliance { .. } => Method::Delete,
        }
    }

    fn path(&self) -> String {
        use ControlRoute as R;
        match self {
            R::Admit | R::Jobs => "/v1/jobs".into(),
            R::Job { job } | R::Evict { job } => format!("/v1/jobs/{job}"),
            R::Checkpoint { job } => format!("/v1/jobs/{job}/checkpoint"),
            R::Retry { job } => format!("/v1/jobs/{job}/retry"),
            R::Rebalance { job } => format!("/v1/jobs/{job}/rebalance"),
            R::Map { job, key: None } => format!("/v1/jobs/{job}/map"),
            R::Map { job, key: Some(k) } => format!("/v1/jobs/{job}/map/keys/{k}"),
            R::Join { job } => format!("/v1/jobs/{job}/join"),
            R::Epoch { job } => format!("/v1/jobs/{job}/epoch"),
            R::Stats => "/v1/stats".into(),
            R::Appliances => "/v1/appliances".into(),
            R::AddAppliance {
                mode: AddMode::Checked,
            } => "/v1/appliances".into(),
            R::AddAppliance {
                mode: AddMode::Forced,
            } => "/v1/appliances?force=true".into(),
            R::RemoveAppliance { name } => format!("/v1/appliances/{name}"),
            R::DrainAppliance { name } => format!("/v1/appliances/{name}/drain"),
            R::Metrics => "/metrics".into(),
        }
    }

    /// The operator token: admission, eviction, checkpoints, retries,
    /// rebalancing and the appliance changes. A join carries the job's token in its body.
    fn needs_token(&self) -> bool {
        use ControlRoute as R;
        matches!(
            self,
            R::Admit
                | R::Evict { .. }
                | R::Checkpoint { .. }
                | R::Retry { .. }
                | R::Rebalance { .. }
                | R::AddAppliance { .. }
                | R::RemoveAppliance { .. }
                | R::DrainAppliance { .. }
        )
    }
}

/// A route of phub-dataplane's management API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MgmtRoute {
    /// `GET /v1/info`.
    Info,
    /// `GET /v1/auth`: checks the management token, does nothing else.
    Auth,
    /// `GET /v1/jobs`.
    Jobs,
    /// `GET /v1/stats`.
    Stats,
    /// `PUT /v1/jobs/{job}`: installs, or restores from a checkpoint file.
    Install {
        /// The job.
        job: u16,
    },
    /// `GET /v1/jobs/{job}/checkpoint`.
    Checkpoint {
        /// The job.
        job: u16,
    },
    /// `DELETE /v1/jobs/{job}`.
    Remove {
        /// The job.
        job: u16,
    },
    /// `PUT /v1/jobs/{job}/epoch`: a replicated job's new epoch
    /// (PROTOCOL.md §11.6), its body an [`crate::failover::EpochView`].
    Epoch {
        /// The job.
        job: u16,
    },
}

impl MgmtRoute {
    /// The route a request names.
    pub fn parse(method: &str, path: &str) -> Result<MgmtRoute, RouteError> {
        use MgmtRoute as R;
        let wrong = |allowed| Err(RouteError::method(method, path, allowed));
        match (segments(path).as_slice(), method) {
            (["v1", "info"], "GET") => Ok(R::Info),
            (["v1", "auth"], "GET") => Ok(R::Auth),
            (["v1", "jobs"], "GET") => Ok(R::Jobs),
            (["v1", "stats"], "GET") => Ok(R::Stats),
            (["v1", "info" | "auth" | "jobs" | "stats"], _) => wrong("GET"),
            (["v1", "jobs", id], "PUT") => Ok(R::Install { job: job_id(id)? }),
            (["v1", "jobs", id], "DELETE") => Ok(R::Remove { job: job_id(id)? }),
            (["v1", "jobs", _], _) => wrong("PUT, DELETE"),
            (["v1", "jobs", id, "checkpoint"], "GET") => Ok(R::Checkpoint { job: job_id(id)? }),
            (["v1", "jobs", _, "checkpoint"], _) => wrong("GET"),
            (["v1", "jobs", id, "epoch"], "PUT") => Ok(R::Epoch { job: job_id(id)? }),
            (["v1", "jobs", _, "epoch"], _) => wrong("PUT"),
            _ => Err(RouteError::NotFound {
                method: method.into(),
                path: path.into(),
            }),
        }
    }

    /// Whether a request with this method and path needs no management
    /// token: reading the dataplane's description, job list and counters,
    /// which hold no secret. What names no route needs one.
    pub fn is_open(method: &str, path: &str) -> bool {
        MgmtRoute::parse(method, path).is_ok_and(|r| !r.needs_token())
    }

    /// Whether its answer is small and at once (the reads and the token
    /// check), not a change or a checkpoint, which carry a job's memory.
    pub fn is_quick(&self) -> bool {
        matches!(
            self,
            MgmtRoute::Info | MgmtRoute::Auth | MgmtRoute::Jobs | MgmtRoute::Stats
        )
    }
}

impl Route for MgmtRoute {
    fn method(&self) -> Method {
        match self {
            MgmtRoute::Info
            | MgmtRoute::Auth
            | MgmtRoute::Jobs
            | MgmtRoute::Stats
            | MgmtRoute::Checkpoint { .. } => Method::Get,
            MgmtRoute::Install { .. } | MgmtRoute::Epoch { .. } => Method::Put,
            MgmtRoute::Remove { .. } => Method::Delete,
        }
    }

    fn path(&self) -> String {
        match self {
            MgmtRoute::Info => "/v1/info".into(),
            MgmtRoute::Auth => "/v1/auth".into(),
            MgmtRoute::Jobs => "/v1/jobs".into(),
            MgmtRoute::Stats => "/v1/stats".into(),
            MgmtRoute::Install { job } | MgmtRoute::Remove { job } => format!("/v1/jobs/{job}"),
            MgmtRoute::Checkpoint { job } => format!("/v1/jobs/{job}/checkpoint"),
            MgmtRoute::Epoch { job } => format!("/v1/jobs/{job}/epoch"),
        }
    }

    /// Every route but the reads of the description, the job list and the
    /// counters (`GET /v1/info`, `/v1/jobs`, `/v1/stats`).
    fn needs_token(&self) -> bool {
        !matches!(self, MgmtRoute::Info | MgmtRoute::Jobs | MgmtRoute::Stats)
    }
}

/// A request body, borrowed where the caller has it already (a spec, a
/// checkpoint file of a job's whole memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body<'a> {
    /// None.
    Empty,
    /// JSON (`application/json`).
    Json(Cow<'a, [u8]>),
    /// TOML (`application/toml`): a job spec.
    Toml(&'a str),
    /// Bytes (`application/octet-stream`): a checkpoint file.
    Octets(&'a [u8]),
}

impl Body<'_> {
    fn json<T: Serialize>(v: &T) -> Body<'static> {
        // The API types are plain structs, maps with string keys and
        // numbers: nothing serde_json refuses.
        Body::Json(Cow::Owned(
            serde_json::to_vec(v).expect("the API's request types serialise"),
        ))
    }

    /// Its `Content-Type`, if it has a body.
    pub fn content_type(&self) -> Option<&'static str> {
        match self {
            Body::Empty => None,
            Body::Json(_) => Some("application/json"),
            Body::Toml(_) => Some("application/toml"),
            Body::Octets(_) => Some("application/octet-stream"),
        }
    }

    /// Its bytes (none for [`Body::Empty`]).
    pub fn bytes(&self) -> &[u8] {
        match self {
            Body::Empty => &[],
            Body::Json(b) => b,
            Body::Octets(b) => b,
            Body::Toml(t) => t.as_bytes(),
        }
    }
}

/// One request a client sends to route `Rt`, with its body, and how its
/// answer is read into an `A`. Made by the functions of [`control`] and
/// [`mgmt`]: each route's body and answer types are fixed there.
#[derive(Debug, Clone)]
pub struct Call<'a, Rt, A> {
    /// The route.
    pub route: Rt,
    /// The body sent.
    pub body: Body<'a>,
    decode: fn(&[u8]) -> Result<A, String>,
}

impl<'a, Rt: Route, A> Call<'a, Rt, A> {
    fn new(route: Rt, body: Body<'a>, decode: fn(&[u8]) -> Result<A, String>) -> Call<'a, Rt, A> {
        Call { route, body, decode }
    }

    /// Reads a successful answer's body, or says why it is not the route's.
    pub fn answer(&self, body: &[u8]) -> Result<A, String> {
        (self.decode)(body)
    }

    /// `METHOD path`, for messages.
    pub fn what(&self) -> String {
        format!("{} {}", self.route.method(), self.route.path())
    }
}

fn json<T: DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    serde_json::from_slice(body).map_err(|e| e.to_string())
}

/// An answer with no body (`204`), or one whose body says nothing more.
fn nothing(_: &[u8]) -> Result<(), String> {
    Ok(())
}

fn octets(body: &[u8]) -> Result<Vec<u8>, String> {
    Ok(body.to_vec())
}

fn text(body: &[u8]) -> Result<String, String> {
    String::from_utf8(body.to_vec()).map_err(|e| format!("the answer is not UTF-8: {e}"))
}

/// The calls of phub-control's API.
pub mod control {
    use super::*;

    /// A call to phub-control.
    pub type ControlCall<'a, A> = Call<'a, ControlRoute, A>;

    /// `POST /v1/jobs`: admits `spec`, sent as JSON when it is a JSON
    /// object ([`crate::spec::JobSpec::looks_like_json`]), else as TOML.
    pub fn admit(spec: &str) -> ControlCall<'_, AdmitResponse> {
        let body = if crate::spec::JobSpec::looks_like_json(spec) {
            Body::Json(Cow::Borrowed(spec.as_bytes()))
        } else {
            Body::Toml(spec)
        };
        Call::new(ControlRoute::Admit, body, json)
    }

    /// `GET /v1/jobs`.
    pub fn jobs() -> ControlCall<'static, Vec<JobSummary>> {
        Call::new(ControlRoute::Jobs, Body::Empty, json)
    }

    /// `GET /v1/jobs/{job}`.
    pub fn job(job: u16) -> ControlCall<'static, JobDetail> {
        Call::new(ControlRoute::Job { job }, Body::Empty, json)
    }

    /// `DELETE /v1/jobs/{job}`: the evicted job's summary.
    pub fn evict(job: u16) -> ControlCall<'static, JobSummary> {
        Call::new(ControlRoute::Evict { job }, Body::Empty, json)
    }

    /// `POST /v1/jobs/{job}/checkpoint`.
    pub fn checkpoint(job: u16) -> ControlCall<'static, CheckpointInfo> {
        Call::new(ControlRoute::Checkpoint { job }, Body::Empty, json)
    }

    /// `POST /v1/jobs/{job}/retry`.
    pub fn retry(job: u16, req: &RetryRequest) -> ControlCall<'static, RetryResponse> {
        Call::new(ControlRoute::Retry { job }, Body::json(req), json)
    }

    /// `GET /v1/jobs/{job}/map`, or with `key` its chunks too.
    pub fn map(job: u16, key: Option<u32>) -> ControlCall<'static, JobMap> {
        Call::new(ControlRoute::Map { job, key }, Body::Empty, json)
    }

    /// `POST /v1/jobs/{job}/join`.
    pub fn join(job: u16, req: &JoinRequest) -> ControlCall<'static, JoinResponse> {
        Call::new(ControlRoute::Join { job }, Body::json(req), json)
    }

    /// `GET /v1/jobs/{job}/epoch`: a replicated job's epoch and who is
    /// down in it (PROTOCOL.md §11.6).
    pub fn epoch(job: u16) -> ControlCall<'static, EpochView> {
        Call::new(ControlRoute::Epoch { job }, Body::Empty, json)
    }

    /// `GET /v1/stats`.
    pub fn stats() -> ControlCall<'static, Stats> {
        Call::new(ControlRoute::Stats, Body::Empty, json)
    }

    /// `GET /v1/appliances`.
    pub fn appliances() -> ControlCall<'static, Vec<ApplianceStatus>> {
        Call::new(ControlRoute::Appliances, Body::Empty, json)
    }

    /// `POST /v1/appliances`.
    pub fn add_appliance(spec: &ApplianceSpec, mode: AddMode) -> ControlCall<'static, ApplianceStatus> {
        Call::new(ControlRoute::AddAppliance { mode }, Body::json(spec), json)
    }

    /// `DELETE /v1/appliances/{name}`: the removed appliance.
    pub fn remove_appliance(name: &str) -> ControlCall<'static, ApplianceStatus> {
        Call::new(
            ControlRoute::RemoveAppliance {
                name: name.to_string(),
            },
            Body::Empty,
            json,
        )
    }

    /// `POST /v1/appliances/{name}/drain`: what the drain moved.
    pub fn drain_appliance(name: &str) -> ControlCall<'static, Drain> {
        Call::new(
            ControlRoute::DrainAppliance {
                name: name.to_string(),
            },
            Body::Empty,
            json,
        )
    }

    /// `POST /v1/jobs/{job}/rebalance`: the part moved, if any.
    pub fn rebalance_job(job: u16) -> ControlCall<'static, Rebalance> {
        Call::new(ControlRoute::Rebalance { job }, Body::Empty, json)
    }

    /// `GET /metrics`: the Prometheus text.
    pub fn metrics() -> ControlCall<'static, String> {
        Call::new(ControlRoute::Metrics, Body::Empty, text)
    }
}

/// The calls of phub-dataplane's management API.
pub mod mgmt {
    use super::*;

    /// A call to a dataplane's management API.
    pub type MgmtCall<'a, A> = Call<'a, MgmtRoute, A>;

    /// `GET /v1/info`.
    pub fn info() -> MgmtCall<'static, DataplaneInfo> {
        Call::new(MgmtRoute::Info, Body::Empty, json)
    }

    /// `GET /v1/auth`: `Ok` when the token is the dataplane's.
    pub fn auth() -> MgmtCall<'static, ()> {
        Call::new(MgmtRoute::Auth, Body::Empty, nothing)
    }

    /// `GET /v1/jobs`.
    pub fn jobs() -> MgmtCall<'static, Vec<InstalledJob>> {
        Call::new(MgmtRoute::Jobs, Body::Empty, json)
    }

    /// `GET /v1/stats`.
    pub fn stats() -> MgmtCall<'static, DataplaneStats> {
        Call::new(MgmtRoute::Stats, Body::Empty, json)
    }

    /// `PUT /v1/jobs/{id}` with `job` (its id is `job.id`). The answer's
    /// body is not read: any 2xx (the API says 201) means installed.
    pub fn install(job: &InstallJob) -> MgmtCall<'static, ()> {
        Call::new(MgmtRoute::Install { job: job.id }, Body::json(job), nothing)
    }

    /// `PUT /v1/jobs/{job}` with a checkpoint file: installs it restored.
    /// The answer's body is not read.
    pub fn restore(job: u16, checkpoint: &[u8]) -> MgmtCall<'_, ()> {
        Call::new(MgmtRoute::Install { job }, Body::Octets(checkpoint), nothing)
    }

    /// `GET /v1/jobs/{job}/checkpoint`: the checkpoint file.
    pub fn checkpoint(job: u16) -> MgmtCall<'static, Vec<u8>> {
        Call::new(MgmtRoute::Checkpoint { job }, Body::Empty, octets)
    }

    /// `DELETE /v1/jobs/{job}` (`204`).
    pub fn remove(job: u16) -> MgmtCall<'static, ()> {
        Call::new(MgmtRoute::Remove { job }, Body::Empty, nothing)
    }

    /// `PUT /v1/jobs/{job}/epoch`: installs a replicated job's new epoch
    /// (PROTOCOL.md §11.6). The answer's body is not read.
    pub fn epoch(job: u16, view: &EpochView) -> MgmtCall<'static, ()> {
        Call::new(MgmtRoute::Epoch { job }, Body::json(view), nothing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control_routes() -> Vec<ControlRoute> {
        use ControlRoute as R;
        vec![
            R::Admit,
            R::Jobs,
            R::Job { job: 1 },
            R::Evict { job: 65535 },
            R::Checkpoint { job: 7 },
            R::Retry { job: 7 },
            R::Rebalance { job: 7 },
            R::Map { job: 7, key: None },
            R::Map { job: 7, key: Some(0) },
            R::Map {
                job: 7,
                key: Some(12),
            },
            R::Join { job: 300 },
            R::Epoch { job: 4 },
            R::Stats,
            R::Appliances,
            R::AddAppliance {
                mode: AddMode::Checked,
            },
            R::AddAppliance {
                mode: AddMode::Forced,
            },
            R::RemoveAppliance {
                name: "rack-a".into(),
            },
            R::DrainAppliance {
                name: "rack-a".into(),
            },
            R::Metrics,
        ]
    }

    fn mgmt_routes() -> Vec<MgmtRoute> {
        use MgmtRoute as R;
        vec![
            R::Info,
            R::Auth,
            R::Jobs,
            R::Stats,
            R::Install { job: 3 },
            R::Checkpoint { job: 3 },
            R::Remove { job: 65535 },
            R::Epoch { job: 2 },
        ]
    }

    #[test]
    fn every_route_parses_back_from_its_method_and_path() {
        for r in control_routes() {
            let target = r.path();
            let (path, query) = match target.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (target.as_str(), None),
            };
            assert_eq!(
                ControlRoute::parse(r.method().as_str(), path, query),
                Ok(r.clone()),
                "{target}"
            );
        }
        for r in mgmt_routes() {
            assert_eq!(
                MgmtRoute::parse(r.method().as_str(), &r.path()),
                Ok(r),
                "{}",
                r.path()
            );
        }
    }

    /// The table in `crate::api`'s head, and who may call what.
    #[test]
    fn routes_are_the_documented_ones() {
        let control: Vec<String> = control_routes()
            .iter()
            .map(|r| format!("{} {} {}", r.method(), r.path(), r.needs_token()))
            .collect();
        assert_eq!(
            control,
            [
                "POST /v1/jobs true",
                "GET /v1/jobs false",
                "GET /v1/jobs/1 false",
                "DELETE /v1/jobs/65535 true",
                "POST /v1/jobs/7/checkpoint true",
                "POST /v1/jobs/7/retry true",
                "POST /v1/jobs/7/rebalance true",
                "GET /v1/jobs/7/map false",
                "GET /v1/jobs/7/map/keys/0 false",
                "GET /v1/jobs/7/map/keys/12 false",
                "POST /v1/jobs/300/join false",
                "GET /v1/jobs/4/epoch false",
                "GET /v1/stats false",
                "GET /v1/appliances false",
                "POST /v1/appliances true",
                "POST /v1/appliances?force=true true",
                "DELETE /v1/appliances/rack-a true",
                "POST /v1/appliances/rack-a/drain true",
                "GET /metrics false",
            ]
        );
        let mgmt: Vec<String> = mgmt_routes()
            .iter()
            .map(|r| format!("{} {} {}", r.method(), r.path(), r.needs_token()))
            .collect();
        assert_eq!(
            mgmt,
            [
                "GET /v1/info false",
                "GET /v1/auth true",
                "GET /v1/jobs false",
                "GET /v1/stats false",
                "PUT /v1/jobs/3 true",
                "GET /v1/jobs/3/checkpoint true",
                "DELETE /v1/jobs/65535 true",
                "PUT /v1/jobs/2/epoch true",
            ]
        );
    }

    #[test]
    fn what_names_no_route_is_refused_saying_why() {
        assert_eq!(
            ControlRoute::parse("PUT", "/v1/jobs/3", None),
            Err(RouteError::Method {
                method: "PUT".into(),
                path: "/v1/jobs/3".into(),
                allowed: "GET, DELETE"
            })
        );
        for id in ["0", "01", "+1", "65536", "x", "-3"] {
            assert_eq!(
                ControlRoute::parse("GET", &format!("/v1/jobs/{id}/map"), None),
                Err(RouteError::JobId { given: id.into() }),
                "{id:?}"
            );
            assert_eq!(
                MgmtRoute::parse("DELETE", &format!("/v1/jobs/{id}")),
                Err(RouteError::JobId { given: id.into() }),
                "{id:?}"
            );
        }
        assert_eq!(
            ControlRoute::parse("GET", "/v1/jobs/3/map/keys/-1", None),
            Err(RouteError::Key { given: "-1".into() })
        );
        assert!(matches!(
            ControlRoute::parse("GET", "/v2/jobs", None),
            Err(RouteError::NotFound { .. })
        ));
        assert!(matches!(
            MgmtRoute::parse("POST", "/v1/info"),
            Err(RouteError::Method { allowed: "GET", .. })
        ));
        // Slashes around the path are ignored, as the daemons always did.
        assert_eq!(MgmtRoute::parse("GET", "v1/stats/"), Ok(MgmtRoute::Stats));
        assert_eq!(
            ControlRoute::parse("POST", "/v1/appliances", Some("a=b&force=1")),
            Ok(ControlRoute::AddAppliance {
                mode: AddMode::Forced
            })
        );
    }

    /// An operator's route needs the token whatever its ids say; a read,
    /// a join and what names no route need none.
    #[test]
    fn the_operator_s_routes_need_the_token_even_with_a_malformed_id() {
        for (m, p, q) in [
            ("DELETE", "/v1/jobs/01", None),
            ("DELETE", "/v1/jobs/abc", None),
            ("POST", "/v1/jobs/0/checkpoint", None),
            ("POST", "/v1/jobs/+1/retry", None),
            ("POST", "/v1/jobs", None),
            ("POST", "/v1/appliances", Some("force=true")),
            ("DELETE", "/v1/appliances/a", None),
        ] {
            assert!(ControlRoute::needs_token_at(m, p, q), "{m} {p}");
        }
        for (m, p) in [
            ("GET", "/v1/jobs/01"),
            ("GET", "/v1/jobs/1/map/keys/x"),
            ("POST", "/v1/jobs/x/join"),
            ("GET", "/v1/nothing"),
            ("PATCH", "/v1/jobs/1"),
        ] {
            assert!(!ControlRoute::needs_token_at(m, p, None), "{m} {p}");
        }
        assert_eq!(
            ControlRoute::shape("GET", "/v1/jobs/x/map/keys/y", None),
            Some(ControlRoute::Map { job: 1, key: Some(0) })
        );
    }

    /// `every` lists each kind of route once with its own arguments, and
    /// they parse back.
    #[test]
    fn every_lists_each_route_once() {
        let all = ControlRoute::every(9, "b");
        let shown: std::collections::BTreeSet<String> = all
            .iter()
            .map(|r| format!("{} {}", r.method(), r.path()))
            .collect();
        assert_eq!(shown.len(), all.len());
        assert_eq!(
            all.len(),
            control_routes().len() - 1,
            "the map with key 12 is the only extra"
        );
        assert!(shown.contains("DELETE /v1/appliances/b") && shown.contains("GET /v1/jobs/9/map/keys/0"));
    }

    #[test]
    fn only_the_dataplane_s_reads_are_open() {
        for (m, p) in [
            ("GET", "/v1/info"),
            ("GET", "/v1/jobs"),
            ("GET", "/v1/stats"),
            ("GET", "v1/stats/"),
        ] {
            assert!(MgmtRoute::is_open(m, p), "{m} {p}");
        }
        for (m, p) in [
            ("GET", "/v1/auth"),
            ("PUT", "/v1/jobs/1"),
            ("DELETE", "/v1/jobs/1"),
            ("GET", "/v1/jobs/1/checkpoint"),
            ("POST", "/v1/info"),
            ("GET", "/v1/nothing"),
            ("GET", "/v1/jobs/x/checkpoint"),
        ] {
            assert!(!MgmtRoute::is_open(m, p), "{m} {p}");
        }
    }

    #[test]
    fn calls_carry_their_route_s_body() {
        let toml = control::admit("name = \"a\"\n");
        assert_eq!(toml.body.content_type(), Some("application/toml"));
        let json = control::admit("\u{feff} {\"name\": \"a\"}");
        assert_eq!(json.body.content_type(), Some("application/json"));
        let retry = control::retry(
            4,
            &RetryRequest {
                discard_checkpoint: true,
            },
        );
        assert_eq!(retry.what(), "POST /v1/jobs/4/retry");
        assert_eq!(retry.body.bytes(), br#"{"discard_checkpoint":true}"#);
        let restore = mgmt::restore(5, &[1, 2, 3]);
        assert_eq!(restore.what(), "PUT /v1/jobs/5");
        assert_eq!(restore.body.content_type(), Some("application/octet-stream"));
        assert_eq!(mgmt::checkpoint(5).answer(&[9, 8]), Ok(vec![9, 8]));
        assert!(control::stats().answer(b"not json").is_err());
        assert_eq!(control::metrics().answer(b"x 1\n"), Ok("x 1\n".to_string()));
    }
}
