//! JSON bodies of the HTTP APIs: phub-control's (for phubctl and workers)
//! and phub-dataplane's management API (for phub-control). Shared here so
//! every side serialises the same types.
//!
//! Tokens travel as 16 lower-case hex digits (a JSON number cannot carry 64
//! bits exactly in every language).
//!
//! phub-control, default `127.0.0.1:7700`:
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `POST /v1/jobs` | spec, TOML or JSON | [`AdmitResponse`] (201) |
//! | `GET /v1/jobs` | | `Vec<`[`JobSummary`]`>` |
//! | `GET /v1/jobs/{id}` | | [`JobDetail`] |
//! | `DELETE /v1/jobs/{id}` | | [`JobSummary`] of the evicted job |
//! | `POST /v1/jobs/{id}/checkpoint` | | [`CheckpointInfo`] |
//! | `POST /v1/jobs/{id}/retry` | [`RetryRequest`] or none | [`RetryResponse`] |
//! | `POST /v1/jobs/{id}/rebalance` | | [`Rebalance`]: the part moved, if one was (PROTOCOL.md §11.8); 409 for a job that cannot move |
//! | `GET /v1/jobs/{id}/map` | | [`JobMap`]: per lcore its run of chunks, no keys |
//! | `GET /v1/jobs/{id}/map/keys/{k}` | | [`JobMap`] with key k's chunks ([`KeyMap`]) |
//! | `POST /v1/jobs/{id}/join` | [`JoinRequest`] | [`JoinResponse`] |
//! | `GET /v1/jobs/{id}/epoch` | | [`crate::failover::EpochView`]: the layout's epoch and who is down (PROTOCOL.md §11.6) |
//! | `GET /v1/stats` | | [`Stats`] |
//! | `GET /v1/appliances` | | `Vec<`[`ApplianceStatus`]`>` |
//! | `POST /v1/appliances` | [`ApplianceSpec`] | [`ApplianceStatus`] (201) |
//! | `DELETE /v1/appliances/{name}` | | [`ApplianceStatus`] of the removed appliance |
//! | `POST /v1/appliances/{name}/drain` | | [`Drain`]: every job moved off it (PROTOCOL.md §11.8); 409 naming each job that cannot move |
//! | `GET /metrics` | | Prometheus text format |
//!
//! phub-dataplane management, default `127.0.0.1:7800`:
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `GET /v1/info` | | [`DataplaneInfo`] |
//! | `PUT /v1/jobs/{id}` | [`InstallJob`], or a checkpoint file ([`crate::checkpoint`]) to install it restored | [`InstalledJob`] (201) |
//! | `GET /v1/jobs/{id}/checkpoint` | | a checkpoint file (`application/octet-stream`) |
//! | `DELETE /v1/jobs/{id}` | | 204 |
//! | `PUT /v1/jobs/{id}/epoch` | [`crate::failover::EpochView`] | 204: a replicated job's new epoch installed (PROTOCOL.md §11.6) |
//! | `GET /v1/jobs` | | `Vec<`[`InstalledJob`]`>` |
//! | `GET /v1/stats` | | [`DataplaneStats`] |
//!
//! Who may call what: on control, `POST /v1/jobs`, `DELETE /v1/jobs/{id}`,
//! `POST /v1/jobs/{id}/checkpoint`, `POST /v1/jobs/{id}/retry`, `POST
//! /v1/jobs/{id}/rebalance`, `POST /v1/appliances`, `DELETE /v1/appliances/{name}` and `POST
//! /v1/appliances/{name}/drain` need
//! `Authorization: Bearer <operator token>` (401 without, 403 wrong); a
//! join carries the job's token in its
//! body. On the dataplane, every route but `GET /v1/info`, `GET /v1/jobs`
//! and `GET /v1/stats` needs `Authorization: Bearer <management token>`;
//! `GET /v1/auth` does nothing else than check it (control calls it when
//! an appliance is added, so that a wrong token is found then).
//! Both check the header before reading a body, and both refuse what is
//! over their limits (README, "Threat model").
//!
//! Every error answer (4xx, 5xx) is an [`ApiError`] with a message that names
//! the problem.
//!
//! Several phub-controls on one etcd prefix (`--state etcd://...`): only
//! the leader takes writes (the token-guarded routes above and the join);
//! a follower answers them `503` with the leader's URL in the header
//! `X-Phub-Leader` (absent while none leads) and in the message, and never
//! forwards them. Reads are answered by any control.
//!
//! The routes as typed values, for servers to parse and clients to build
//! calls with (method, path, body and answer types), are
//! [`crate::routes`]'s [`ControlRoute`](crate::routes::ControlRoute) and
//! [`MgmtRoute`](crate::routes::MgmtRoute).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::memory::MemoryModel;
use crate::spec::JobSpec;

/// Serde for `u64` tokens as 16 hex digits.
pub mod hex_u64 {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `v` as 16 lower-case hex digits.
    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }

    /// Reads 1 to 16 hex digits.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.strip_prefix("0x").unwrap_or(&s);
        if t.is_empty() || t.len() > 16 {
            return Err(serde::de::Error::custom(format!(
                "token {s:?}: expected 1 to 16 hex digits"
            )));
        }
        u64::from_str_radix(t, 16)
            .map_err(|_| serde::de::Error::custom(format!("token {s:?}: expected 1 to 16 hex digits")))
    }
}

/// Body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    /// What went wrong, naming the field, value or object at fault.
    pub error: String,
}

impl ApiError {
    /// An error answer's body read as an [`ApiError`], if it is one.
    pub fn parse(body: &str) -> Option<ApiError> {
        serde_json::from_str(body).ok()
    }

    /// The message of an error answer's body: its `error` when the body is
    /// an [`ApiError`], else the body itself (trimmed, at most 500
    /// characters), or "(no error message in the answer)" when empty.
    pub fn message_of(body: &str) -> String {
        match ApiError::parse(body) {
            Some(e) => e.error,
            None if body.trim().is_empty() => "(no error message in the answer)".to_string(),
            None => body.trim().chars().take(500).collect(),
        }
    }
}

/// Answer to a successful admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitResponse {
    /// The job's id.
    pub id: u16,
    /// The job's secret token: workers present it to join, every packet carries it.
    #[serde(with = "hex_u64")]
    pub token: u64,
    /// Number of chunks.
    pub chunks: u64,
    /// Memory the job holds on the appliance, in bytes: every byte
    /// [`crate::memory::MemoryModel::job_cost`] counts (slot buffers and
    /// records, blocks, per-rank entries, its registry entry and, with
    /// shared memory, its region files).
    pub memory_bytes: u64,
    /// Of `memory_bytes`, the shared-memory region files in `/dev/shm`.
    #[serde(default)]
    pub shm_bytes: u64,
    /// Lcores the job's chunks are spread over (indices into the layout:
    /// for a job over several appliances, the lcores of the first, then
    /// those of the next, ...).
    pub lcores: Vec<u16>,
    /// The appliances holding the job, in layout order.
    #[serde(default)]
    pub appliances: Vec<String>,
}

/// One line of `phubctl job list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSummary {
    /// Job id.
    pub id: u16,
    /// Job name from the spec.
    pub name: String,
    /// Worker count W.
    pub workers: u32,
    /// Ranks that have joined.
    pub joined: Vec<u16>,
    /// Number of keys.
    pub keys: usize,
    /// Number of chunks.
    pub chunks: u64,
    /// Element type on the wire.
    pub dtype: String,
    /// Optimizer name.
    pub optimizer: String,
    /// Memory the job holds on the appliance, in bytes (as
    /// [`AdmitResponse::memory_bytes`]).
    pub memory_bytes: u64,
    /// Whether every appliance of the job has its part installed right now.
    pub installed: bool,
    /// The appliances holding the job's chunks, in layout order (one for
    /// a job that is not sharded).
    #[serde(default)]
    pub appliances: Vec<String>,
    /// Why the job failed, if it did: the dataplane can no longer hold it
    /// (e.g. it restarted with fewer lcores and the job does not fit them).
    /// A failed job is never reinstalled; joins are refused with this
    /// reason; it can still be evicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
    /// Why the job is held, if it is: a part's checkpoint file exists but
    /// cannot be restored (unreadable, corrupt, another job's or part's,
    /// not movable onto the part's layout, refused by its appliance), so
    /// that part is not installed again (one its appliance still runs
    /// keeps running), joins and checkpoints are refused, and the file is
    /// never written over, until the operator repairs it and retries
    /// (`POST /v1/jobs/{id}/retry`, [`RetryRequest`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<String>,
}

/// `POST /v1/jobs/{id}/retry` on control: retry a held job's parts
/// ([`JobSummary::held`]). No body is the default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryRequest {
    /// Give up each held part's checkpoint: its file is renamed aside
    /// (`<file>.discarded-<unix ms>`, never deleted) and the part starts
    /// over without it. Without it, each file is read again and the part
    /// restored from it if it is usable now.
    #[serde(default)]
    pub discard_checkpoint: bool,
}

/// The answer to `POST /v1/jobs/{id}/retry`: per part that was held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryResponse {
    /// Job id.
    pub id: u16,
    /// Each part that was held, in layout order.
    pub parts: Vec<RetriedPart>,
}

/// One held part, retried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetriedPart {
    /// Its appliance.
    pub appliance: String,
    /// Its checkpoint file.
    pub file: String,
    /// What became of the file.
    pub checkpoint: RetriedCheckpoint,
    /// What the appliance holds of the part now.
    pub install: RetriedInstall,
}

/// A retried part's checkpoint file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RetriedCheckpoint {
    /// Usable now: the part's checkpoint again, with these rounds.
    Usable {
        /// Its lowest and highest completed round (`None`: none yet).
        round_range: Option<(u32, u32)>,
    },
    /// Set aside by `discard_checkpoint`: renamed to `moved_to` (`None`:
    /// the file was already gone).
    SetAside {
        /// Where it is now.
        moved_to: Option<String>,
    },
}

/// What a retried part's appliance holds now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RetriedInstall {
    /// Installed now: restored from a usable checkpoint, or empty after
    /// one was set aside.
    Installed,
    /// The appliance had the part installed all along (only control's
    /// view of the file was in question): its state there is kept.
    StillInstalled,
    /// Not installed yet (its appliance is down or refused it for now):
    /// reconciliation installs it when it can; the part is not held.
    Pending {
        /// Why not now.
        why: String,
    },
}

/// What phub-control knows of one rank of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankStatus {
    /// The rank.
    pub rank: u16,
    /// Whether it has joined through control.
    pub joined: bool,
    /// Milliseconds since the dataplane last heard from it, if ever.
    pub silent_ms: Option<u64>,
}

/// `phubctl job show`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobDetail {
    /// The summary line.
    pub summary: JobSummary,
    /// The spec as admitted, its `keys` cut after the first
    /// [`DETAIL_KEYS`] (a spec may list a million; `GET
    /// /v1/jobs/{id}/map/keys/{k}` shows any one).
    pub spec: JobSpec,
    /// Keys of the spec not listed in `spec.keys`.
    #[serde(default)]
    pub keys_omitted: u64,
    /// Per rank: joined, and how long silent.
    pub ranks: Vec<RankStatus>,
    /// Rounds completed over all the job's chunks.
    pub rounds_completed: u64,
    /// Lowest and highest last-completed round over the job's chunks (for
    /// a job that is not BSP: updates applied per chunk).
    pub round_range: Option<(u32, u32)>,
    /// Jobs that are not BSP: clocks, lead and held answers (the same as
    /// [`JobLive::clock`], over every appliance holding the job).
    #[serde(flatten)]
    pub clock: ClockStats,
    /// The job's last checkpoint, if it has one (every part of a sharded
    /// job: rounds over all, bytes added up, the files listed).
    #[serde(default)]
    pub checkpoint: Option<CheckpointInfo>,
    /// Per appliance holding some of the job: its part and whether it is
    /// installed there now.
    #[serde(default)]
    pub parts: Vec<JobPart>,
    /// A replicated job's epoch (PROTOCOL.md §11.6): its number and the
    /// appliances declared down (indices into `parts`); `None` for a job
    /// that is not replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<crate::failover::EpochView>,
    /// A replicated job's strength (PROTOCOL.md §11.7): replicas live and
    /// wanted, and its last re-replication; `None` for a job that is not
    /// replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaStrength>,
    /// Its tables (PROTOCOL.md §10), by key, over its appliances; absent
    /// for a job without table keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<TableLive>,
}

/// How many replicas a replicated job has (`phubctl job show`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaStrength {
    /// `[placement] replicas`.
    pub wanted: u32,
    /// Replicas holding state of the part with the fewest in the job's
    /// epoch (an appliance whose state copy is not done is not counted).
    pub live: u32,
    /// `full_strength` (live = wanted), `degraded` (fewer, nothing under
    /// way), `rereplicating` (an appliance that came back is being
    /// copied to) or `stalled` (some part has no replica left).
    pub state: Strength,
    /// The last re-replication, if there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rereplication: Option<Rereplication>,
    /// Why it is stalled, while it is ([`Strength::Stalled`]): the part
    /// every replica of which is down, and what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stalled: Option<String>,
}

/// A replicated job's state (`ReplicaStrength::state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strength {
    /// Every part has all its replicas.
    FullStrength,
    /// Some part has fewer, and none is being copied.
    Degraded,
    /// An appliance that came back is being given its state copies.
    Rereplicating,
    /// Every replica of some part is down (PROTOCOL.md §11.7, "Stalled
    /// jobs"): the job waits for its appliances to answer again, then
    /// goes back to its checkpoints as a whole.
    Stalled,
}

impl Strength {
    /// As `phubctl job show` writes it.
    pub fn name(self) -> &'static str {
        match self {
            Strength::FullStrength => "full strength",
            Strength::Degraded => "degraded",
            Strength::Rereplicating => "re-replicating",
            Strength::Stalled => "stalled",
        }
    }
}

/// One re-replication of a job (PROTOCOL.md §11.7): an appliance that
/// came back, given the job again at `epoch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rereplication {
    /// The appliance that came back.
    pub appliance: String,
    /// The epoch it joined at.
    pub epoch: u32,
    /// When control decided it (Unix time, ms).
    pub started_unix_ms: u64,
    /// When every state copy of the epoch was acknowledged (Unix time,
    /// ms): the job was back to full strength.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_unix_ms: Option<u64>,
    /// Bytes of state copies the appliance took, as it reported them when
    /// the copies were done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_copied: Option<u64>,
    /// Why it stopped short, if it did (the appliance down again, the job
    /// failed or moved on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abandoned: Option<String>,
    /// The appliance whose place in the job `appliance` took (a drain or a
    /// spare, PROTOCOL.md §11.8); absent for an appliance that came back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced: Option<String>,
}

impl Rereplication {
    /// From its start to full strength, in ms (`None` while under way).
    pub fn full_strength_ms(&self) -> Option<u64> {
        Some(self.ended_unix_ms?.saturating_sub(self.started_unix_ms))
    }
}

/// One appliance's part of a job (`phubctl job show`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobPart {
    /// The appliance.
    pub appliance: String,
    /// Its rack label.
    pub rack: String,
    /// Lcores of the appliance the layout spans.
    pub lcores: u32,
    /// Sequence numbers of the chunks it holds: `chunks.0 .. chunks.1`.
    pub chunks: (u64, u64),
    /// Memory the part holds there, in bytes.
    pub memory_bytes: u64,
    /// Whether the appliance has the part installed right now.
    pub installed: bool,
    /// Why its state is not known (the appliance does not answer): the
    /// part is reinstalled when it answers again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub down: Option<String>,
    /// Rounds completed over the part's chunks.
    pub rounds_completed: u64,
    /// Lowest and highest last-completed round over the part's chunks.
    pub round_range: Option<(u32, u32)>,
    /// A hierarchical job's: the ranks of this appliance's rack,
    /// `ranks.0 .. ranks.1` (`chunks` are then the chunks it is home to;
    /// it keeps a rack slot of every chunk besides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<(u16, u16)>,
}

/// An appliance as the operator names it to control (`phubctl appliance
/// add`, `--appliance`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplianceSpec {
    /// Its name, unique within control (`crate::spec::appliance_name_ok`).
    pub name: String,
    /// Base URL of its dataplane's management API.
    pub url: String,
    /// Its rack label.
    #[serde(default)]
    pub rack: String,
    /// Its dataplane's management token file; default: the dataplane's
    /// default for the port of `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    /// Drained (`phubctl appliance drain`, PROTOCOL.md §11.8): it takes no
    /// new job. Set by control, recorded with the appliance; absent
    /// (false) otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// What `POST /v1/appliances/{name}/drain` did (PROTOCOL.md §11.8).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    /// The appliance drained: it holds no job now, and takes no new one.
    pub appliance: String,
    /// Each job it held, moved.
    pub moved: Vec<DrainMove>,
}

/// One job a drain moved off its appliance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainMove {
    /// The job.
    pub job: u16,
    /// Its name.
    pub name: String,
    /// The appliance that took the drained appliance's place in the job
    /// (its index in layout order): empty at first, filled by state
    /// copies while the job runs (`phubctl job show` reports full
    /// strength when they are done).
    pub to: String,
    /// The job's epoch with it moved.
    pub epoch: u32,
}

/// What `POST /v1/jobs/{id}/rebalance` did (PROTOCOL.md §11.8): at most
/// one part moved, from its most loaded appliance to the least loaded
/// one that is not the job's; none when no move makes the load more even.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rebalance {
    /// The job.
    pub job: u16,
    /// The part moved, if one was.
    pub moved: Option<PartMove>,
    /// Each appliance of the job (after the move) with the jobs it holds
    /// parts of, in layout order: what the choice was made on.
    pub load: Vec<(String, usize)>,
}

/// A part of a replicated job moved to another appliance while it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartMove {
    /// The part's index in layout order.
    pub index: u16,
    /// The appliance it leaves.
    pub from: String,
    /// The appliance that takes its place, empty at first and filled by
    /// state copies while the job runs.
    pub to: String,
    /// The job's epoch with it moved.
    pub epoch: u32,
}

/// An appliance as control sees it (`phubctl appliance list`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplianceStatus {
    /// Its name.
    pub name: String,
    /// Its management URL.
    pub url: String,
    /// Its rack label.
    pub rack: String,
    /// The management token file control reads.
    pub token_file: String,
    /// Why it does not answer, if it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub down: Option<String>,
    /// Where workers send, when known.
    pub data: Option<DataAddr>,
    /// Its lcores, when known.
    pub lcores: Option<u32>,
    /// Its memory budget and what is in use, in bytes, when known.
    pub memory_budget_bytes: Option<u64>,
    /// What its installed jobs hold, in bytes, when known.
    pub memory_used_bytes: Option<u64>,
    /// Admitted jobs with a part on it.
    pub jobs: Vec<u16>,
    /// Being drained (`phubctl appliance drain`): it takes no new job.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// One appliance's counters in control's `GET /v1/stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApplianceStats {
    /// The appliance.
    pub name: String,
    /// Its rack label.
    pub rack: String,
    /// Its counters, or `None` when it cannot be reached.
    pub dataplane: Option<DataplaneStats>,
    /// Why it could not be reached.
    pub error: Option<String>,
}

/// A saved checkpoint (`POST /v1/jobs/{id}/checkpoint` on control).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// Job id.
    pub id: u16,
    /// Lowest and highest completed round saved, over the job's chunks.
    pub round_range: Option<(u32, u32)>,
    /// Size of the checkpoint file in bytes.
    pub bytes: u64,
    /// When it was taken, milliseconds since the Unix epoch.
    pub taken_unix_ms: u64,
    /// Where control keeps it.
    pub file: String,
}

/// Most keys [`JobDetail::spec`] lists.
pub const DETAIL_KEYS: usize = 1000;

/// `phubctl map show`: where a job's chunks live, O(lcores) whatever the
/// number of chunks (the layout's rule, PROTOCOL.md §4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobMap {
    /// Job id.
    pub id: u16,
    /// Elements per full chunk.
    pub chunk_elems: u32,
    /// Keys of the job.
    #[serde(default)]
    pub keys_total: u64,
    /// Chunks of the job.
    #[serde(default)]
    pub chunks: u64,
    /// Memory the job holds on the appliance, in bytes.
    #[serde(default)]
    pub memory_bytes: u64,
    /// Per lcore used by the job.
    pub lcores: Vec<LcoreShare>,
    /// The key asked for (`/map/keys/{k}`), else empty.
    pub keys: Vec<KeyMap>,
}

/// One lcore's share of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LcoreShare {
    /// The appliance the lcore belongs to.
    #[serde(default)]
    pub appliance: String,
    /// Lcore index on that appliance.
    pub lcore: u16,
    /// UDP port workers send its chunks to.
    pub port: u16,
    /// Sequence number of its first chunk (slot 0).
    #[serde(default)]
    pub first: u64,
    /// Number of the job's slots on it.
    pub slots: u64,
    /// Memory the job holds on it, in bytes (heap; shared memory apart).
    pub bytes: u64,
}

/// One key's chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyMap {
    /// Key index.
    pub key: u32,
    /// Key name (may be empty).
    pub name: String,
    /// Elements.
    pub elements: u64,
    /// Sequence number of its chunk 0.
    pub first: u64,
    /// Its chunks, as runs: one per lcore holding some of them.
    pub runs: Vec<KeyRun>,
}

/// Chunks `chunk .. chunk + count` of a key, in slots `slot .. slot +
/// count` of one lcore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRun {
    /// The appliance of the lcore.
    #[serde(default)]
    pub appliance: String,
    /// The lcore, on that appliance.
    pub lcore: u16,
    /// The run's first chunk (within the key).
    pub chunk: u32,
    /// Its slot on the lcore.
    pub slot: u32,
    /// Chunks in the run.
    pub count: u32,
}

/// A worker asks to join a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    /// The job's token.
    #[serde(with = "hex_u64")]
    pub token: u64,
    /// The worker's rank, below W.
    pub rank: u16,
    /// Take the place of a rank that already joined (a restarted worker).
    #[serde(default)]
    pub rejoin: bool,
    /// The worker's rack label (a hierarchical job: checked against the
    /// rack its rank belongs to). Absent: not said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rack: Option<String>,
}

/// Where the dataplane takes data packets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataAddr {
    /// IP address workers send to.
    pub host: String,
    /// Lcore i listens on UDP port `base_port + i`.
    pub base_port: u16,
}

/// What a joined worker needs to push and pull.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JoinResponse {
    /// Job id.
    pub job: u16,
    /// The worker's rank.
    pub rank: u16,
    /// The spec as admitted.
    pub spec: JobSpec,
    /// Where each chunk lives: per lcore, one run of the job's chunk
    /// sequence (PROTOCOL.md §4), a few bytes per lcore. For a job over
    /// several appliances, the lcores of `appliances[0]`, then those of
    /// `appliances[1]`, and so on.
    pub layout: Layout,
    /// Where to send (a sharded job's: its first appliance's).
    pub dataplane: DataAddr,
    /// The job's appliances in layout order, each with its data address
    /// and the number of the layout's lcores that are its. Absent (empty)
    /// from a control that predates sharding: then every lcore is
    /// `dataplane`'s.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub appliances: Vec<ApplianceAddr>,
    /// A replicated job's (PROTOCOL.md §11): what a worker needs to find
    /// each chunk's primary in any epoch ([`crate::failover`]). Absent for
    /// any other job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<JoinReplication>,
}

/// What a worker of a replicated job is told at join (PROTOCOL.md §11.6):
/// with the layout and `appliances`, enough to compute where each chunk is
/// served in an epoch ([`crate::failover::ReplicaLayout::serve`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinReplication {
    /// Appliances holding each chunk (`[placement] replicas`).
    pub replicas: u8,
    /// Per appliance of `appliances`, its rack label (empty: the one rack
    /// of appliances without one).
    pub racks: Vec<String>,
    /// The epoch at the time of the join.
    pub epoch: crate::failover::EpochView,
    /// A hierarchical job's (PROTOCOL.md §11.11): at epoch 0 the worker
    /// sends every chunk to its rack's appliance, where that appliance's
    /// rack layout places it; from the job's first epoch change on, where
    /// [`crate::failover::ReplicaLayout::serve`] puts it, as a flat
    /// replicated job's worker does. Absent for a flat job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rack: Option<JoinRack>,
}

/// A hierarchical replicated job's worker's rack (PROTOCOL.md §11.11).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinRack {
    /// Its appliance's index in the join answer's `appliances`.
    pub appliance: u16,
    /// That appliance's rack layout: the whole job over its lcores.
    pub layout: Layout,
}

/// One appliance of a job, as a worker sees it at join.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplianceAddr {
    /// The appliance's name.
    pub name: String,
    /// IP address workers send to.
    pub host: String,
    /// Its lcore i listens on UDP port `base_port + i`.
    pub base_port: u16,
    /// How many of the layout's lcores are its (the next ones in order).
    pub lcores: u32,
    /// This job's share of its lcores' receive buffers, in bytes: on each
    /// lcore the job's workers send to, the buffer
    /// ([`LcoreInfo::rx_buffer_bytes`]) times the job's W (a hierarchical
    /// job: its rack's ranks) over everyone who sends to that lcore (each
    /// admitted job's W, rack ranks, or racks to its home slots there;
    /// PROTOCOL.md §4), and the smallest of those. What the chunks in
    /// flight of this job's workers sending there must fit in together. Absent where the appliance does not state a buffer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_buffer_bytes: Option<u64>,
}

/// `GET /v1/stats` on control.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// The first appliance's counters, or `None` when it cannot be reached
    /// (`appliances` has every appliance's).
    pub dataplane: Option<DataplaneStats>,
    /// Why the first appliance could not be reached.
    pub dataplane_error: Option<String>,
    /// Every appliance's counters, by name.
    #[serde(default)]
    pub appliances: Vec<ApplianceStats>,
    /// Per admitted job.
    pub jobs: Vec<JobSummary>,
}

/// One lcore of the dataplane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LcoreInfo {
    /// Lcore (queue) index.
    pub lcore: u16,
    /// CPU it is pinned to, if pinned.
    pub cpu: Option<usize>,
    /// NUMA node of that CPU, when known.
    pub numa_node: Option<u32>,
    /// Bytes its receive queue holds before the kernel drops what arrives
    /// (kernel-UDP backend: the socket's `SO_RCVBUF` as the kernel reports
    /// it, against which each queued datagram is charged its buffer's true
    /// size, about twice its bytes). Workers size their windows by it
    /// (phub-worker's `auto_window`); absent where the backend does not
    /// say (DPDK) or from an older dataplane.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rx_buffer_bytes: Option<u64>,
}

/// `GET /v1/info` on the dataplane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataplaneInfo {
    /// This dataplane process's identity: 32 random hex digits it makes
    /// when it starts (a restart makes a new one). Control tells two
    /// registrations of one dataplane apart from two dataplanes by it and
    /// by [`DataplaneInfo::data`], never by the spelling of a URL; empty
    /// from a dataplane that does not say.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// `udp` or `dpdk`.
    pub backend: BackendKind,
    /// Where workers send.
    pub data: DataAddr,
    /// The lcores.
    pub lcores: Vec<LcoreInfo>,
    /// NUMA node of the NIC, when known.
    pub nic_numa_node: Option<u32>,
    /// Memory the dataplane may give jobs, in bytes (every byte a job
    /// costs, [`crate::memory::MemoryModel::job_cost`]).
    pub memory_budget_bytes: u64,
    /// Memory installed jobs hold, in bytes: the sum of what each job's
    /// lcores report having allocated, its registry entry and its region
    /// files.
    pub memory_used_bytes: u64,
    /// What the dataplane allocates per slot, block, job, rank and key:
    /// what admission charges a job. A dataplane that does not say gets
    /// [`MemoryModel::default`]'s upper bounds.
    #[serde(default)]
    pub memory_model: MemoryModel,
    /// Where slot memory comes from, e.g. `Rust heap` or `DPDK heap,
    /// socket 0, hugepages: no` (empty from a dataplane that does not say).
    #[serde(default)]
    pub slot_memory: String,
    /// Aggregation kernel family in use.
    pub kernels: String,
    /// Whether every job gets shared-memory regions for workers on the
    /// dataplane's host (`phub-dataplane --shm`, PROTOCOL.md §3.4); false
    /// from a dataplane that does not say.
    #[serde(default)]
    pub shm: bool,
    /// phub version and commit.
    pub version: String,
}

/// `PUT /v1/jobs/{id}` on the dataplane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstallJob {
    /// Job id.
    pub id: u16,
    /// Job token.
    #[serde(with = "hex_u64")]
    pub token: u64,
    /// The spec.
    pub spec: JobSpec,
    /// The layout; `layout.lcores.len()` must equal the dataplane's lcores.
    /// For a job sharded over several appliances, this appliance's part:
    /// its runs cover its share of the chunk sequence, which need not start
    /// at chunk 0 (`crate::layout::Placement::part`). For a hierarchical
    /// job, this appliance's rack layout: a whole layout of the job.
    pub layout: Layout,
    /// A hierarchical job's (PROTOCOL.md §9.1): who the racks are and where
    /// each chunk's home is. Absent for any other job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hierarchy: Option<Hierarchy>,
    /// A replicated job's (`[placement] replicas` above 1, PROTOCOL.md
    /// §11): every appliance of the job, its index among them and the
    /// layout's epoch. Absent for any other job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<Replication>,
    /// A flat job with tables sharded over several appliances (PROTOCOL.md
    /// §4.1, §10.1): where this appliance's lcores are among the job's L.
    /// Absent: the job's lcores are this appliance's alone (entry i is its
    /// lcore i).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries: Option<Entries>,
}

/// Where one appliance's lcores are among a sharded job's (PROTOCOL.md
/// §10.1): its lcore j is the job's entry `first + j` of `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entries {
    /// The entry of its lcore 0: the lcores of the appliances before it.
    pub first: u32,
    /// L, the job's lcores over all its appliances.
    pub total: u32,
}

/// What an appliance of a replicated job is told at install beyond its
/// part (PROTOCOL.md §11): from it, the appliance computes which chunks it
/// is primary of, which backups they have and which backup slots each of
/// its lcores keeps (§11.1, §11.2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replication {
    /// The job layout's epoch (§11.5): 0 when admitted; above 0 when an
    /// appliance that came back is installed again (§11.7).
    pub epoch: u32,
    /// This appliance's index in `appliances`.
    pub appliance: u16,
    /// Every appliance of the job, in layout order (§4.1).
    pub appliances: Vec<ReplicaPeer>,
    /// The epoch's down list ([`crate::failover::EpochView::down`]);
    /// absent (empty) at epoch 0.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub down: Vec<u16>,
    /// The epoch's joined list ([`crate::failover::EpochView::joined`]);
    /// absent (empty) at epoch 0.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub joined: Vec<crate::failover::Joined>,
    /// The epoch's moved list ([`crate::failover::EpochView::moved`]):
    /// `appliances` already gives the moved indices' new addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moved: Vec<crate::failover::Moved>,
    /// The epoch's restored field ([`crate::failover::EpochView::restored`]);
    /// absent (0) when the job never went back to its checkpoints.
    #[serde(default, skip_serializing_if = "crate::spec::is_zero")]
    pub restored: u32,
}

impl Replication {
    /// The epoch the install is at, whole.
    pub fn view(&self) -> crate::failover::EpochView {
        crate::failover::EpochView {
            epoch: self.epoch,
            down: self.down.clone(),
            joined: self.joined.clone(),
            moved: self.moved.clone(),
            restored: self.restored,
        }
    }
}

/// One appliance of a replicated job, as the others see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaPeer {
    /// The appliance's name.
    pub name: String,
    /// Its data address (IPv4) and first UDP port: its lcore i listens on
    /// `base_port + i`.
    pub data: DataAddr,
    /// Its rack label (empty: the one rack of appliances without one).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rack: String,
    /// Its part of the job's layout: one run per lcore, in lcore order.
    pub layout: Layout,
}

/// What a rack appliance of a hierarchical job is told at install beyond
/// its rack layout (PROTOCOL.md §9.1). The ranks of each rack follow from
/// the spec ([`crate::spec::JobSpec::rack_ranks`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hierarchy {
    /// This appliance's rack index, below `racks.len()`.
    pub rack: u16,
    /// Every rack's appliance, in rack order.
    pub racks: Vec<RackPeer>,
    /// The home layout: the job's chunks over the racks' appliances'
    /// lcores, those of rack 0 first (as many as `racks[0].layout` has),
    /// then rack 1's, and so on.
    pub homes: Layout,
}

impl Hierarchy {
    /// This rack's part of the home layout: the runs of its appliance's
    /// lcores, which follow those of the racks before it. None if `rack`
    /// names no rack or the home layout is too short.
    pub fn home_part(&self) -> Option<Layout> {
        let r = usize::from(self.rack);
        let at: usize = self.racks.get(..r)?.iter().map(|p| p.layout.lcores.len()).sum();
        let n = self.racks.get(r)?.layout.lcores.len();
        Some(Layout {
            chunk_elems: self.homes.chunk_elems,
            lcores: self.homes.lcores.get(at..at + n)?.to_vec(),
        })
    }
}

/// One rack appliance of a hierarchical job, as the others see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RackPeer {
    /// The appliance's name.
    pub name: String,
    /// Its data address (IPv4) and first UDP port.
    pub data: DataAddr,
    /// Its rack layout: where each chunk's rack slot is on it.
    pub layout: Layout,
}

/// A job as the dataplane holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstalledJob {
    /// Job id.
    pub id: u16,
    /// Memory it holds in bytes, shared-memory files included.
    pub memory_bytes: u64,
    /// Of that, its shared-memory region files in `/dev/shm`.
    #[serde(default)]
    pub shm_bytes: u64,
}

crate::counter_table! {
    /// Counters of one lcore: the snapshot the management API serves
    /// (`GET /v1/stats`), phubctl shows and `/metrics` exports.
    #[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
    pub struct LcoreStats {
        /// Lcore index.
        pub lcore: u16,
        /// Drops by reason name (only reasons with a non-zero count): the
        /// engine's [`crate::wire::DropReason`]s and the backend's own.
        pub drops: BTreeMap<String, u64>,
    }
    /// The live counters of one lcore, which only that lcore writes.
    pub struct LcoreCounters of crate::counters::Counter;
    counters {
        rx_packets: Count, Always("RX PKTS"), "Datagrams received";
        rx_bytes: Bytes, Always("RX MB"), "Bytes received (UDP payload)";
        tx_packets: Count, Always("TX PKTS"), "Datagrams sent (one per destination)";
        tx_bytes: Bytes, Always("TX MB"), "Bytes sent (UDP payload, per destination)";
        pushes_aggregated: Count, Always("PUSHES"), "Contributions added to an accumulator (INIT and PUSH)";
        rounds_completed: Count, Always("ROUNDS"), "Rounds completed (optimizer runs)";
        results_sent: Count, Always("RESULTS"), "Results queued for sending, one per destination";
        results_resent: Count, Always("RESENT"), "Stored results sent again to a worker that lost one";
        pulls_answered: Count, Hidden, "PULL requests answered";
        errors_sent: Count, Hidden, "ERROR messages queued";
        misrouted: Count, Always("MISROUTED"), "Packets that reached this lcore but belong to another";
        arp_replies: Count, Always("ARP"), "ARP requests for the appliance's address answered (DPDK backend)";
        answers_held: Count, IfAny("HELD"), "Bounded-delay answers held (the push applied, its answer waiting for the slowest rank)";
        answers_released: Count, Hidden, "Held bounded-delay answers released";
        held_wait_us: Count, Hidden, "Time the released answers were held, summed (divide by answers_released for the mean)";
        partials_sent: Count, IfAny("PARTIALS"), "Partial sums a rack appliance sent to a chunk's home (hierarchical jobs, first sends)";
        partials_resent: Count, IfAny("PART RESENT"), "Partial sums sent again because the home's answer did not come in time";
        partial_results_sent: Count, Hidden, "Results a home appliance sent to the racks' appliances (one per rack)";
        partial_results_resent: Count, Hidden, "Stored results a home sent again to a rack whose partial of a completed round came again";
        replicates_sent: Count, IfAny("REPL"), "Aggregates a primary sent its backups (replicated jobs, REPLICATE first sends, one per backup)";
        replicates_resent: Count, IfAny("REPL RESENT"), "Aggregates a primary sent again because a backup's REPLICATE_ACK did not come in time";
        replicate_acks_sent: Count, IfAny("REPL ACKS"), "Acknowledgements a backup sent of rounds it applied to its backup slots (a burst's travel in one REPLICATE_ACK)";
        replicate_acks_resent: Count, Hidden, "Acknowledgements a backup sent again for a copy of a round it had applied";
        rounds_replicated: Count, Hidden, "Rounds a primary completed once every backup acknowledged them (also counted in rounds_completed)";
        epoch_changes: Count, IfAny("EPOCHS"), "Epoch changes of replicated jobs applied on this lcore (PUT /v1/jobs/{id}/epoch; worker messages of another epoch are counted as drops, wrong_epoch)";
        shm_rx: Count, IfAny("SHM RX"), "Messages with the SHM flag from a rank of an installed job (payload, if any, read from shared memory)";
        busy_loops: Count, Hidden, "Poll-loop iterations that found work";
        idle_loops: Count, Hidden, "Poll-loop iterations that found none";
        injected_drops: Count, Hidden, "Packets the fault injector dropped, received or sent (only with --inject)";
        injected_dups: Count, Hidden, "Packets the fault injector duplicated (only with --inject)";
        injected_reorders: Count, Hidden, "Received packets the fault injector reordered (only with --inject)";
        injected_delays: Count, Hidden, "Received packets the fault injector delayed (only with --inject and delay=)";
    }
}

/// One job as the dataplane sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobLive {
    /// Job id.
    pub id: u16,
    /// Contributions aggregated, over all lcores.
    pub pushes: u64,
    /// Rounds completed, over all chunks.
    pub rounds_completed: u64,
    /// Lowest and highest last-completed round over the job's chunks.
    pub round_range: Option<(u32, u32)>,
    /// Per rank, milliseconds since last heard from on any lcore.
    pub silent_ms: Vec<Option<u64>>,
    /// Jobs that are not BSP: clocks, lead and held answers.
    #[serde(flatten)]
    pub clock: ClockStats,
    /// A replicated job's: its epoch here and its state copies
    /// (PROTOCOL.md §11.7); absent for a job that is not replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copies: Option<CopyProgress>,
    /// Its tables (PROTOCOL.md §10), by key, over the lcores; absent for
    /// a job without table keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<TableLive>,
}

/// One table of a job (PROTOCOL.md §10): its rows and what was done to
/// them, summed over the lcores (and appliances) that hold its rows.
/// Counters count from the install (or the restore) on each appliance.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableLive {
    /// The table's key index.
    pub key: u32,
    /// Rows stored now.
    pub rows_stored: u64,
    /// Rows created (a first push, or the first after an eviction).
    pub created: u64,
    /// Rows evicted to make room at the `rows` cap.
    pub evicted_cap: u64,
    /// Rows evicted after `evict = { idle_rounds }` rounds (or `{ idle_s }`
    /// seconds) untouched.
    pub evicted_idle: u64,
    /// Row updates applied (pushes of a row, creations included).
    pub updates: u64,
    /// Row lookups (ids read by pulls and push-pulls).
    pub lookups: u64,
    /// Row pushes dropped before their id was admitted.
    pub not_admitted: u64,
    /// Row pushes dropped: a new row's memory could not be allocated.
    pub no_memory: u64,
    /// Bytes the rows' stores hold now.
    pub bytes: u64,
    /// Row blocks (2 MiB) an lcore made itself, none being ready from the
    /// dataplane's block maker: each faulted in on the lcore, holding its
    /// rounds for a moment (README, "Faults, checkpoints and security").
    #[serde(default)]
    pub blocks_made_on_lcore: u64,
}

impl TableLive {
    /// Adds another lcore's or appliance's share of the same table.
    pub fn merge(&mut self, o: &TableLive) {
        self.rows_stored += o.rows_stored;
        self.created += o.created;
        self.evicted_cap += o.evicted_cap;
        self.evicted_idle += o.evicted_idle;
        self.updates += o.updates;
        self.lookups += o.lookups;
        self.not_admitted += o.not_admitted;
        self.no_memory += o.no_memory;
        self.bytes += o.bytes;
        self.blocks_made_on_lcore += o.blocks_made_on_lcore;
    }

    /// `into`'s tables with `from`'s merged in, by key, in key order.
    pub fn merge_all(into: &mut Vec<TableLive>, from: &[TableLive]) {
        for t in from {
            match into.iter_mut().find(|x| x.key == t.key) {
                Some(x) => x.merge(t),
                None => into.push(*t),
            }
        }
        into.sort_by_key(|t| t.key);
    }
}

/// A replicated job's state copies on an appliance (PROTOCOL.md §11.7):
/// what control watches to tell when the job is back to full strength.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyProgress {
    /// The epoch installed (the lowest over the lcores).
    pub epoch: u32,
    /// Backup slots awaiting a state copy.
    pub awaiting: u64,
    /// Copies owed: per primary slot, its new backups that have not
    /// acknowledged its state copy yet.
    pub owed: u64,
    /// Bytes of REPLICATE_STATE fragments taken here (payloads, since the
    /// job was installed here).
    pub bytes_received: u64,
}

impl CopyProgress {
    /// Adds another lcore's or appliance's: counts added up, the lowest
    /// epoch kept.
    pub fn merge(&mut self, o: &CopyProgress) {
        self.epoch = self.epoch.min(o.epoch);
        self.awaiting += o.awaiting;
        self.owed += o.owed;
        self.bytes_received += o.bytes_received;
    }
}

/// A job's consistency state (PROTOCOL.md §5.8), in [`JobLive`] and
/// [`JobDetail`] alike; its fields sit at the top level of their JSON.
/// All zero or empty for a BSP job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockStats {
    /// Per rank, the lowest and highest clock it had applied over the
    /// job's chunks (empty for BSP).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clocks: Vec<(u32, u32)>,
    /// The largest lead an answer ever allowed, over the job's chunks: the
    /// clock answered plus one (the clock the rank may push next) minus
    /// the slowest rank's applied clock on that chunk then. At most τ + 1
    /// for a bounded-delay job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lead: Option<u32>,
    /// Bounded-delay answers held now.
    #[serde(default)]
    pub held: u64,
    /// Bounded-delay answers ever held (since the job was installed on
    /// each appliance that reports it).
    #[serde(default)]
    pub held_total: u64,
    /// Microseconds the released answers were held, summed.
    #[serde(default)]
    pub held_wait_us: u64,
    /// The longest any released answer was held, µs.
    #[serde(default)]
    pub held_wait_max_us: u64,
}

impl ClockStats {
    /// Adds in another lcore's or appliance's view of the same job: held
    /// answers and waits added up, each rank's clocks spanned (a view
    /// without clocks, from a place with none of the job's chunks, changes
    /// none), the largest lead and wait kept.
    pub fn merge(&mut self, o: &ClockStats) {
        if self.clocks.is_empty() {
            self.clocks.clone_from(&o.clocks);
        } else {
            for (m, &(lo, hi)) in self.clocks.iter_mut().zip(&o.clocks) {
                *m = (m.0.min(lo), m.1.max(hi));
            }
        }
        self.max_lead = self.max_lead.max(o.max_lead);
        self.held += o.held;
        self.held_total += o.held_total;
        self.held_wait_us += o.held_wait_us;
        self.held_wait_max_us = self.held_wait_max_us.max(o.held_wait_max_us);
    }
}

/// A dataplane's packet I/O backend: what `phub-dataplane --backend` takes
/// and `/v1/info` and `/v1/stats` show, as `udp` or `dpdk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Kernel UDP sockets: runs anywhere.
    Udp,
    /// DPDK poll-mode driver: the port and lcores given by `--eal` and
    /// `--port` (needs phub-dataplane's `dpdk` feature, on by default).
    Dpdk,
}

impl BackendKind {
    /// Every backend, in the order `--help` lists them.
    pub const ALL: [BackendKind; 2] = [BackendKind::Udp, BackendKind::Dpdk];

    /// `udp` or `dpdk`.
    pub const fn name(self) -> &'static str {
        match self {
            BackendKind::Udp => "udp",
            BackendKind::Dpdk => "dpdk",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<BackendKind, String> {
        BackendKind::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("backend `{s}`: want `udp` or `dpdk`"))
    }
}

/// `GET /v1/stats` on the dataplane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataplaneStats {
    /// `udp` or `dpdk`.
    pub backend: BackendKind,
    /// Per lcore.
    pub lcores: Vec<LcoreStats>,
    /// Per installed job.
    pub jobs: Vec<JobLive>,
    /// The DPDK port's own counters (DPDK backend only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortStats>,
    /// How long the lcores poll on after traffic before they sleep now,
    /// microseconds (kernel UDP without busy polling; `--spin-us auto`
    /// changes it as the dataplane's cgroups allow).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spin_us: Option<u64>,
}

impl DataplaneStats {
    /// Every lcore's counters added up (`lcore` 0), drops by reason
    /// included.
    pub fn total(&self) -> LcoreStats {
        let mut t = LcoreStats::default();
        for l in &self.lcores {
            t.add_counters(l);
            for (r, n) in &l.drops {
                *t.drops.entry(r.clone()).or_default() += n;
            }
        }
        t
    }
}

/// A DPDK port's own counters (`rte_eth_stats`), beside phub's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PortStats {
    /// Packets received.
    pub ipackets: u64,
    /// Packets sent.
    pub opackets: u64,
    /// Bytes received.
    pub ibytes: u64,
    /// Bytes sent.
    pub obytes: u64,
    /// Packets the NIC dropped because RX queues were full.
    pub imissed: u64,
    /// Receive errors.
    pub ierrors: u64,
    /// Transmit errors.
    pub oerrors: u64,
    /// RX mbuf allocation failures.
    pub rx_nombuf: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/v1/info` and `/v1/stats` carry the backend as the word the command
    /// line takes; any other word is refused naming it and the choices.
    #[test]
    fn a_backend_reads_and_writes_as_its_name() {
        for b in BackendKind::ALL {
            let json = serde_json::to_string(&b).unwrap();
            assert_eq!(json, format!("\"{}\"", b.name()));
            assert_eq!(serde_json::from_str::<BackendKind>(&json).unwrap(), b);
            assert_eq!(b.name().parse::<BackendKind>(), Ok(b));
        }
        assert_eq!(
            "netmap".parse::<BackendKind>(),
            Err("backend `netmap`: want `udp` or `dpdk`".to_string())
        );
        assert!(serde_json::from_str::<BackendKind>("\"fake\"").is_err());
    }

    #[test]
    fn a_total_adds_every_lcore_and_every_drop_reason() {
        let lcore = |i: u16, drops: &[(&str, u64)]| LcoreStats {
            lcore: i,
            rx_packets: 10 + u64::from(i),
            results_resent: 1,
            injected_dups: 2,
            drops: drops.iter().map(|&(r, n)| (r.to_string(), n)).collect(),
            ..LcoreStats::default()
        };
        let d = DataplaneStats {
            spin_us: None,
            backend: BackendKind::Udp,
            lcores: vec![
                lcore(0, &[("duplicate", 3)]),
                lcore(1, &[("duplicate", 4), ("bad_magic", 1)]),
            ],
            jobs: vec![],
            port: None,
        };
        let t = d.total();
        assert_eq!(
            (t.lcore, t.rx_packets, t.results_resent, t.injected_dups),
            (0, 21, 2, 4)
        );
        assert_eq!(
            t.drops,
            [("bad_magic".to_string(), 1), ("duplicate".to_string(), 7)].into()
        );
    }

    #[test]
    fn tokens_travel_as_hex() {
        let j = JoinRequest {
            token: 0x0123_4567_89ab_cdef,
            rank: 2,
            rejoin: false,
            rack: None,
        };
        let s = serde_json::to_string(&j).unwrap();
        assert_eq!(s, r#"{"token":"0123456789abcdef","rank":2,"rejoin":false}"#);
        let old: JoinRequest = serde_json::from_str(r#"{"token":"0123456789abcdef","rank":2}"#).unwrap();
        assert_eq!(old, j);
        assert_eq!(serde_json::from_str::<JoinRequest>(&s).unwrap(), j);
        let e = serde_json::from_str::<JoinRequest>(r#"{"token":"xyz","rank":2}"#).unwrap_err();
        assert!(e.to_string().contains("hex digits"), "{e}");
    }

    #[test]
    fn clock_stats_sit_at_the_top_level_and_merge() {
        let mut a = ClockStats {
            clocks: vec![(3, 4), (1, 1)],
            max_lead: Some(2),
            held: 1,
            held_total: 5,
            held_wait_us: 700,
            held_wait_max_us: 300,
        };
        let live = JobLive {
            id: 1,
            pushes: 2,
            rounds_completed: 2,
            round_range: None,
            silent_ms: vec![],
            clock: a.clone(),
            copies: None,
            tables: Vec::new(),
        };
        let v = serde_json::to_value(&live).unwrap();
        assert_eq!(v["held_wait_max_us"], 300);
        assert_eq!(v["clocks"], serde_json::json!([[3, 4], [1, 1]]));
        assert_eq!(serde_json::from_value::<JobLive>(v).unwrap(), live);
        // An older dataplane's view, without the counts.
        let old: JobLive = serde_json::from_str(
            r#"{"id":1,"pushes":0,"rounds_completed":0,"round_range":null,"silent_ms":[]}"#,
        )
        .unwrap();
        assert_eq!(old.clock, ClockStats::default());
        a.merge(&ClockStats {
            clocks: vec![(2, 6), (1, 2)],
            max_lead: Some(1),
            held: 2,
            held_total: 1,
            held_wait_us: 50,
            held_wait_max_us: 50,
        });
        assert_eq!(
            a,
            ClockStats {
                clocks: vec![(2, 6), (1, 2)],
                max_lead: Some(2),
                held: 3,
                held_total: 6,
                held_wait_us: 750,
                held_wait_max_us: 300,
            }
        );
        a.merge(&ClockStats::default());
        assert_eq!(a.clocks, [(2, 6), (1, 2)], "a view without clocks");
    }
}
