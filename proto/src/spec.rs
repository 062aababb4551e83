//! Job specs: what a tenant asks the appliance to run, in TOML or JSON.
//!
//! ```toml
//! name = "resnet50"
//! workers = 4
//! dtype = "f32"          # f32 | bf16 | f16 on the wire; f32 accumulation
//! chunk_bytes = 8192     # payload bytes per packet; multiple of 64, <= 8832
//!
//! [optimizer]
//! kind = "sgd"           # sum | mean | sgd | momentum | nesterov | adam | adamw
//! lr = 0.1
//!
//! [consistency]
//! mode = "sync"
//!
//! [[keys]]
//! name = "conv1.weight"
//! elements = 9408
//! ```
//!
//! [`JobSpec::validate`] names the bad field, its value and what is accepted.

use serde::{Deserialize, Serialize};

use crate::memory::ResultStore;
use crate::wire::MAX_PAYLOAD;
use crate::Dtype;

mod table;
pub(crate) use table::is_zero;
pub use table::{
    max_dim, rows_per_datagram, Evict, RowInitSpec, RowOptimizerSpec, TableSpec, MAX_KEY_CACHE,
    MAX_TABLE_ROWS, ROW_ID_BYTES,
};

/// Most workers a job may have (ranks fit the header's `u16`, bitmaps 256 bits).
pub const MAX_WORKERS: u32 = 256;
/// Most keys one job may declare.
pub const MAX_KEYS: usize = 1 << 20;
/// Most elements one key may hold (2^32 - 1, so chunk indices fit `u32`).
pub const MAX_KEY_ELEMENTS: u64 = u32::MAX as u64;
/// Smallest chunk in bytes.
pub const MIN_CHUNK_BYTES: u32 = 64;
/// Largest chunk in bytes: what fits a 9000-byte jumbo frame, a multiple of 64.
// Cast: MAX_PAYLOAD is below 9000 (asserted in wire.rs).
#[allow(clippy::cast_possible_truncation)]
pub const MAX_CHUNK_BYTES: u32 = MAX_PAYLOAD as u32;
/// Default chunk size in bytes.
pub const DEFAULT_CHUNK_BYTES: u32 = 8192;

/// A job as a tenant submits it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Human name, 1..=128 characters.
    pub name: String,
    /// Number of workers W, 1..=256. Every round waits for all of them.
    pub workers: u32,
    /// Element type on the wire.
    #[serde(default = "default_dtype")]
    pub dtype: Dtype,
    /// Payload bytes per chunk (one packet).
    #[serde(default = "default_chunk_bytes")]
    pub chunk_bytes: u32,
    /// What the appliance does with a chunk once all workers have pushed.
    pub optimizer: Optimizer,
    /// Consistency model.
    #[serde(default)]
    pub consistency: Consistency,
    /// The tensors, in the order workers refer to them (key = index).
    pub keys: Vec<KeySpec>,
    /// Seconds between automatic checkpoints (none when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_interval_s: Option<u32>,
    /// Which appliances hold the job's chunks (`[placement]`; one, the one
    /// with the most free memory, when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementSpec>,
}

/// Most appliances one job may be sharded over.
pub const MAX_APPLIANCES: usize = 64;

/// `[placement]`: which appliances hold the job's chunks. A job over several
/// appliances has its chunks placed over the union of their lcores, each
/// chunk on one of them (its home).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementSpec {
    /// `appliances = N` (the N with the most free memory) or `appliances =
    /// ["a", "b"]` (those, by name).
    pub appliances: Appliances,
    /// `hierarchical = true` (PROTOCOL.md §9): each appliance is a rack's
    /// appliance; a worker sends every chunk to its rack's, which sends one
    /// partial sum per chunk to the chunk's home and relays the result.
    /// Racks are the job's appliances in order (as listed, or by name for a
    /// count); needs two or more, BSP, and each rack at least one worker.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hierarchical: bool,
    /// With `hierarchical`: how many workers each rack has, in rack order;
    /// rack r's ranks follow rack r - 1's. Default: the W workers spread
    /// evenly, the first W mod R racks one more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks_per_rack: Option<Vec<u32>>,
    /// `replicas = R` (PROTOCOL.md §11): every chunk is held by R of the
    /// job's appliances, its primary and R − 1 backups that apply the same
    /// rounds ([`crate::replica::replica_set`]). 1 (the default) to
    /// [`MAX_REPLICAS`](crate::replica::MAX_REPLICAS), at most the job's
    /// appliance count; more than 1 needs a flat BSP job of dense keys.
    #[serde(default = "one_replica", skip_serializing_if = "is_one_replica")]
    pub replicas: u32,
}

fn one_replica() -> u32 {
    1
}

// serde's skip_serializing_if passes a reference.
#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_one_replica(r: &u32) -> bool {
    *r == 1
}

/// Largest `chunk_bytes` of a hierarchical job whose dtype is 2 bytes wide:
/// its partial sums travel as `f32`, twice the bytes, and must fit one
/// datagram (PROTOCOL.md §9.2).
// Cast: MAX_PAYLOAD is below 9000 (asserted in phub_proto::wire).
#[allow(clippy::cast_possible_truncation)]
pub const MAX_HIERARCHICAL_HALF_CHUNK_BYTES: u32 = (crate::wire::MAX_PAYLOAD as u32 / 2) / 64 * 64;

/// The appliances a job asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Appliances {
    /// This many, chosen by control (most free memory first).
    Count(u32),
    /// These, by name, in this order.
    Names(Vec<String>),
}

impl<'de> Deserialize<'de> for Appliances {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Appliances, D::Error> {
        struct V;
        const EXPECTED: &str = "a number of appliances (1 or more) or a list of appliance names";
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Appliances;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Appliances, E> {
                u32::try_from(v)
                    .map(Appliances::Count)
                    .map_err(|_| E::custom(format!("placement.appliances = {v}: expected {EXPECTED}")))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Appliances, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("placement.appliances = {v}: expected {EXPECTED}")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Appliances, A::Error> {
                let mut names = Vec::new();
                while let Some(n) = seq.next_element::<String>()? {
                    names.push(n);
                }
                Ok(Appliances::Names(names))
            }
        }
        d.deserialize_any(V)
    }
}

/// Whether `name` may name an appliance: 1 to 64 of ASCII letters, digits,
/// `-`, `_` and `.`, not starting with `.` (it is part of checkpoint file
/// names).
pub fn appliance_name_ok(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What [`appliance_name_ok`] accepts, for error messages.
pub const APPLIANCE_NAME_RULE: &str = "1 to 64 ASCII letters, digits, '-', '_' or '.', not starting with '.'";

impl PlacementSpec {
    /// How many appliances the spec asks for.
    pub fn count(&self) -> usize {
        match &self.appliances {
            Appliances::Count(n) => *n as usize,
            Appliances::Names(n) => n.len(),
        }
    }

    fn validate(&self) -> Result<(), SpecError> {
        match &self.appliances {
            Appliances::Count(n) if *n == 0 || *n as usize > MAX_APPLIANCES => Err(bad(
                "placement.appliances",
                n,
                format!("a number from 1 to {MAX_APPLIANCES}, or a list of appliance names"),
            )),
            Appliances::Count(_) => Ok(()),
            Appliances::Names(names) => {
                if names.is_empty() || names.len() > MAX_APPLIANCES {
                    return Err(bad(
                        "placement.appliances",
                        format!("{} names", names.len()),
                        format!("1 to {MAX_APPLIANCES} appliance names"),
                    ));
                }
                let mut seen = std::collections::HashSet::new();
                for (i, n) in names.iter().enumerate() {
                    if !appliance_name_ok(n) {
                        return Err(bad(
                            format!("placement.appliances[{i}]"),
                            shown(n),
                            APPLIANCE_NAME_RULE,
                        ));
                    }
                    if !seen.insert(n.as_str()) {
                        return Err(bad(
                            format!("placement.appliances[{i}]"),
                            shown(n),
                            "a name not listed before",
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

fn default_dtype() -> Dtype {
    Dtype::F32
}

fn default_chunk_bytes() -> u32 {
    DEFAULT_CHUNK_BYTES
}

/// One key of a job: a dense tensor, or a sparse table (`kind = "table"`,
/// a [`TableSpec`]; PROTOCOL.md §10.1).
///
/// Written flat, as `{ name, elements }` or `{ name, kind = "table", dim,
/// ... }`; a key with neither `kind` nor a table field is dense, as every
/// spec before tables.
#[derive(Debug, Clone, PartialEq)]
pub struct KeySpec {
    /// Optional name of a dense key, required of a table (unique within
    /// the job when given); left out of the JSON when empty, so a spec of
    /// a million unnamed keys stays small. `name = ""` is the same as no
    /// name (state files of earlier versions wrote unnamed keys so, and
    /// must still load): a key is addressed by its index, its name is only
    /// shown.
    pub name: String,
    /// Number of elements of a dense key, 1..=2^32-1; 0 for a table, which
    /// has no dense chunks (so the layout, the memory model and every
    /// reader of `elements` give it none).
    pub elements: u64,
    /// `Some` for a table key (and then `elements` is 0), `None` for a
    /// dense key.
    pub table: Option<TableSpec>,
}

impl KeySpec {
    /// A dense key of `elements` elements (unnamed when `name` is empty).
    pub fn dense(name: &str, elements: u64) -> KeySpec {
        KeySpec {
            name: name.to_string(),
            elements,
            table: None,
        }
    }

    /// A table key named `name`.
    pub fn table(name: &str, table: TableSpec) -> KeySpec {
        KeySpec {
            name: name.to_string(),
            elements: 0,
            table: Some(table),
        }
    }
}

impl Serialize for KeySpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        table::KeyFieldsRef {
            name: &self.name,
            kind: self.table.as_ref().map(|_| "table"),
            elements: self.table.is_none().then_some(self.elements),
            table: self.table.as_ref(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<KeySpec, D::Error> {
        table::KeyFields::deserialize(d)?
            .into_key()
            .map_err(serde::de::Error::custom)
    }
}

/// A table key of a job, as [`JobSpec::tables`] lists them.
#[derive(Debug, Clone, Copy)]
pub struct TableKey<'a> {
    /// The key's index in the job's keys: what the header's `key` field
    /// carries (PROTOCOL.md §10.2) and what the placement mixes in.
    pub key: u32,
    /// The key's name.
    pub name: &'a str,
    /// The table.
    pub spec: &'a TableSpec,
}

/// The per-chunk update the appliance runs once a round is complete.
///
/// `g` below is the mean of the W workers' gradients (their sum times
/// `1 / W`); `t` is the round number (1 for the first update). The formulas
/// here are the textbook forms; PROTOCOL.md §5.6 gives the exact `f32`
/// operations the appliance carries out.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Optimizer {
    /// Result = sum of the workers' pushes (all-reduce sum).
    Sum,
    /// Result = mean of the workers' pushes (all-reduce mean).
    Mean,
    /// `w -= lr * (g + wd * w)`.
    Sgd {
        /// Learning rate, > 0.
        lr: f32,
        /// L2 weight decay, >= 0.
        #[serde(default)]
        weight_decay: f32,
    },
    /// Heavy-ball momentum (MXNet `sgd_mom_update`):
    /// `m = mu * m - lr * (g + wd * w); w += m`.
    Momentum {
        /// Learning rate, > 0.
        lr: f32,
        /// Momentum, in [0, 1).
        #[serde(default = "default_momentum")]
        momentum: f32,
        /// L2 weight decay, >= 0.
        #[serde(default)]
        weight_decay: f32,
    },
    /// Nesterov momentum as PHub/MXNet's NAG defines it:
    /// `g' = g + wd * w; m = mu * m + g'; w -= lr * (g' + mu * m)`.
    Nesterov {
        /// Learning rate, > 0.
        lr: f32,
        /// Momentum, in [0, 1).
        #[serde(default = "default_momentum")]
        momentum: f32,
        /// L2 weight decay, >= 0.
        #[serde(default)]
        weight_decay: f32,
    },
    /// Adam with bias correction (multiplying by `1 / (1 - beta^t)`) and L2
    /// weight decay folded into `g`.
    Adam {
        /// Learning rate, > 0.
        lr: f32,
        /// First-moment decay, in [0, 1).
        #[serde(default = "default_beta1")]
        beta1: f32,
        /// Second-moment decay, in [0, 1).
        #[serde(default = "default_beta2")]
        beta2: f32,
        /// Added to the denominator, > 0.
        #[serde(default = "default_eps")]
        eps: f32,
        /// L2 weight decay, >= 0.
        #[serde(default)]
        weight_decay: f32,
    },
    /// AdamW: Adam with decoupled weight decay, `w *= 1 - lr * wd` first.
    Adamw {
        /// Learning rate, > 0.
        lr: f32,
        /// First-moment decay, in [0, 1).
        #[serde(default = "default_beta1")]
        beta1: f32,
        /// Second-moment decay, in [0, 1).
        #[serde(default = "default_beta2")]
        beta2: f32,
        /// Added to the denominator, > 0.
        #[serde(default = "default_eps")]
        eps: f32,
        /// Decoupled weight decay, >= 0.
        #[serde(default = "default_adamw_decay")]
        weight_decay: f32,
    },
}

fn default_momentum() -> f32 {
    0.9
}
fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_eps() -> f32 {
    1e-8
}
fn default_adamw_decay() -> f32 {
    0.01
}

impl Optimizer {
    /// The spec name of this optimizer.
    pub const fn name(&self) -> &'static str {
        match self {
            Optimizer::Sum => "sum",
            Optimizer::Mean => "mean",
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Momentum { .. } => "momentum",
            Optimizer::Nesterov { .. } => "nesterov",
            Optimizer::Adam { .. } => "adam",
            Optimizer::Adamw { .. } => "adamw",
        }
    }

    /// Whether the appliance keeps parameters (false for sum and mean, which
    /// return the aggregate itself).
    pub const fn keeps_params(&self) -> bool {
        !matches!(self, Optimizer::Sum | Optimizer::Mean)
    }

    /// Per-element `f32` state buffers beyond the parameters.
    pub const fn state_buffers(&self) -> usize {
        match self {
            Optimizer::Sum | Optimizer::Mean | Optimizer::Sgd { .. } => 0,
            Optimizer::Momentum { .. } | Optimizer::Nesterov { .. } => 1,
            Optimizer::Adam { .. } | Optimizer::Adamw { .. } => 2,
        }
    }
}

/// Consistency model (Li et al., OSDI 2014), per chunk; PROTOCOL.md §5.8
/// states each mode's rules. In a spec: `consistency = { mode = "sync" }`
/// (the default), `{ mode = "async" }`, or `{ bounded_delay = N }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "ConsistencyFields", into = "ConsistencyFields")]
pub enum Consistency {
    /// Bulk synchronous (BSP): a round completes when all W workers have
    /// pushed it; every rank gets the result.
    #[default]
    Sync,
    /// Each push is applied at once and answered to its sender alone with
    /// the chunk's current values.
    Async,
    /// Each push is applied at once; the answer to a rank's clock c is held
    /// until every rank's applied clock on the chunk is at least c − delay.
    Bounded {
        /// The bound τ on staleness, in clocks, 0..=[`MAX_BOUNDED_DELAY`].
        delay: u32,
    },
}

/// Largest τ a bounded-delay job may ask for.
pub const MAX_BOUNDED_DELAY: u32 = 1024;

impl Consistency {
    /// The mode's name as a spec writes it: `sync`, `async` or
    /// `bounded_delay`.
    pub const fn mode(&self) -> &'static str {
        match self {
            Consistency::Sync => "sync",
            Consistency::Async => "async",
            Consistency::Bounded { .. } => "bounded_delay",
        }
    }

    /// τ for a bounded-delay job.
    pub const fn delay(&self) -> Option<u32> {
        match self {
            Consistency::Bounded { delay } => Some(*delay),
            _ => None,
        }
    }
}

/// The short spelling every tool's command line takes and prints: `bsp`,
/// `async` or `ssp:τ` (bounded delay τ); [`FromStr`](std::str::FromStr)
/// reads it back.
impl std::fmt::Display for Consistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Consistency::Sync => f.write_str("bsp"),
            Consistency::Async => f.write_str("async"),
            Consistency::Bounded { delay } => write!(f, "ssp:{delay}"),
        }
    }
}

/// A consistency mode on a command line that is none of `bsp` (or `sync`),
/// `async` and `ssp:τ` with τ from 0 to [`MAX_BOUNDED_DELAY`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "consistency {value:?}: expected bsp (or sync), async, or ssp:TAU with TAU from 0 to {MAX_BOUNDED_DELAY}"
)]
pub struct ConsistencyError {
    /// The text given (cut to 64 characters).
    pub value: String,
}

impl std::str::FromStr for Consistency {
    type Err = ConsistencyError;

    fn from_str(s: &str) -> Result<Consistency, ConsistencyError> {
        match s {
            "bsp" | "sync" => Ok(Consistency::Sync),
            "async" => Ok(Consistency::Async),
            _ => match s.strip_prefix("ssp:").map(str::parse::<u32>) {
                Some(Ok(delay)) if delay <= MAX_BOUNDED_DELAY => Ok(Consistency::Bounded { delay }),
                _ => Err(ConsistencyError { value: cut(s, 64) }),
            },
        }
    }
}

/// `[consistency]` as written: `mode` and/or `bounded_delay`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConsistencyFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bounded_delay: Option<u32>,
}

impl TryFrom<ConsistencyFields> for Consistency {
    type Error = String;

    fn try_from(f: ConsistencyFields) -> Result<Consistency, String> {
        const ACCEPTED: &str =
            "accepted: mode = \"sync\" (the default), mode = \"async\", or bounded_delay = N";
        match (f.mode.as_deref(), f.bounded_delay) {
            (None | Some("sync"), None) => Ok(Consistency::Sync),
            (Some("async"), None) => Ok(Consistency::Async),
            (None | Some("bounded_delay"), Some(delay)) => Ok(Consistency::Bounded { delay }),
            (Some("bounded_delay"), None) => Err(format!(
                "consistency: mode = \"bounded_delay\" needs bounded_delay = N (τ, 0 to {MAX_BOUNDED_DELAY})"
            )),
            (Some(m @ ("sync" | "async")), Some(d)) => Err(format!(
                "consistency: mode = {m:?} with bounded_delay = {d}: a bound is for bounded_delay jobs alone; {ACCEPTED}"
            )),
            (Some(m), _) => Err(format!("consistency.mode = {}: {ACCEPTED}", shown(m))),
        }
    }
}

impl From<Consistency> for ConsistencyFields {
    fn from(c: Consistency) -> ConsistencyFields {
        ConsistencyFields {
            mode: Some(c.mode().to_string()),
            bounded_delay: c.delay(),
        }
    }
}

/// What is wrong with a spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The text is not a well-formed spec (syntax, unknown field, wrong type).
    #[error("invalid job spec: {0}")]
    Parse(String),
    /// A field has a value outside what is accepted.
    #[error("invalid job spec: `{field}` = {value}: {accepted}")]
    Field {
        /// Dotted path of the field, e.g. `keys[3].elements`.
        field: String,
        /// The value given.
        value: String,
        /// What would be accepted.
        accepted: String,
    },
}

fn bad(field: impl Into<String>, value: impl std::fmt::Display, accepted: impl Into<String>) -> SpecError {
    SpecError::Field {
        field: field.into(),
        value: value.to_string(),
        accepted: accepted.into(),
    }
}

/// Where in the spec a parse error is, as a prefix: `keys[2].consistency: `
/// (nothing at the top level).
fn at_path(path: &serde_path_to_error::Path) -> String {
    let p = path.to_string();
    if p.is_empty() || p == "." {
        String::new()
    } else {
        format!("{p}: ")
    }
}

/// A TOML error that names where it is: the field's path, the line, the
/// table it is in and the line's text (toml's own message alone names no
/// field: "number too large to fit in target type"; nor, in an inline
/// table, which table).
fn toml_error(text: &str, e: &serde_path_to_error::Error<toml::de::Error>) -> SpecError {
    let path = at_path(e.path());
    let e = e.inner();
    let Some(span) = e.span() else {
        return SpecError::Parse(format!("{path}{}", e.message()));
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line_no = before.matches('\n').count() + 1;
    let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
    let table = before
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|t| format!(" (in {})", cut(t, 40)))
        .unwrap_or_default();
    SpecError::Parse(format!(
        "{path}{} (line {line_no}{table}, `{}`)",
        e.message(),
        cut(line, 80)
    ))
}

/// `s` cut to its first `n` characters, marked when cut.
fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}...", s.chars().take(n).collect::<String>())
    }
}

/// A name as an error message shows it: quoted, control characters escaped,
/// and cut to its first 64 characters when longer (a 15 MB name is not
/// echoed back whole).
fn shown(name: &str) -> String {
    let n = name.chars().count();
    if n <= 64 {
        format!("{name:?}")
    } else {
        let head: String = name.chars().take(64).collect();
        format!("{head:?}... ({n} characters)")
    }
}

/// Whether `name` is 1 to 128 characters, none of them a control character
/// (a name with a newline or an escape sequence could forge a row of
/// phubctl's tables).
fn printable_name(name: &str) -> bool {
    (1..=128).contains(&name.chars().count()) && !name.chars().any(char::is_control)
}

impl JobSpec {
    /// Parses and validates a TOML spec.
    pub fn from_toml(text: &str) -> Result<JobSpec, SpecError> {
        let spec: JobSpec = serde_path_to_error::deserialize(toml::Deserializer::new(text))
            .map_err(|e| toml_error(text, &e))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Whether the job gets shared-memory regions on a dataplane started
    /// with `--shm` (`dataplane_shm`): BSP jobs only, not hierarchical.
    /// Results written once per round into a region fit BSP; a job whose
    /// values change with every push goes by datagrams.
    pub fn result_store(&self, dataplane_shm: bool) -> ResultStore {
        ResultStore::of(dataplane_shm && self.consistency == Consistency::Sync && !self.hierarchical())
    }

    /// Parses and validates a JSON spec.
    pub fn from_json(text: &str) -> Result<JobSpec, SpecError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let spec: JobSpec = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| SpecError::Parse(format!("{}{}", at_path(e.path()), e.inner())))?;
        de.end().map_err(|e| SpecError::Parse(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Parses and validates a spec in either format: JSON when
    /// `content_type` says `application/json`, TOML when it says
    /// `application/toml` or `text/toml`, and otherwise JSON when the text
    /// starts with `{`, else TOML. A leading byte-order mark is skipped.
    pub fn parse(text: &str, content_type: Option<&str>) -> Result<JobSpec, SpecError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let media = content_type
            .and_then(|c| c.split(';').next())
            .map(|m| m.trim().to_ascii_lowercase());
        let json = match media.as_deref() {
            Some("application/json") => true,
            Some("application/toml" | "text/toml") => false,
            _ => Self::looks_like_json(text),
        };
        if json {
            JobSpec::from_json(text)
        } else {
            JobSpec::from_toml(text)
        }
    }

    /// Whether `text` (after a byte-order mark and white space) starts as a
    /// JSON object, the one thing a spec in JSON can be.
    pub fn looks_like_json(text: &str) -> bool {
        text.strip_prefix('\u{feff}')
            .unwrap_or(text)
            .trim_start()
            .starts_with('{')
    }

    /// Elements per full chunk.
    pub fn chunk_elems(&self) -> u32 {
        // Cast: a dtype's size is 2 or 4 bytes.
        #[allow(clippy::cast_possible_truncation)]
        let size = self.dtype.size() as u32;
        self.chunk_bytes / size
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), SpecError> {
        if !printable_name(&self.name) {
            return Err(bad(
                "name",
                shown(&self.name),
                "a name of 1 to 128 characters, none of them a control character",
            ));
        }
        if self.workers == 0 || self.workers > MAX_WORKERS {
            return Err(bad(
                "workers",
                self.workers,
                format!("an integer from 1 to {MAX_WORKERS}"),
            ));
        }
        if self.chunk_bytes < MIN_CHUNK_BYTES
            || self.chunk_bytes > MAX_CHUNK_BYTES
            || !self.chunk_bytes.is_multiple_of(64)
        {
            return Err(bad(
                "chunk_bytes",
                self.chunk_bytes,
                format!(
                    "a multiple of 64 from {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES} \
                     (the payload of a 9000-byte jumbo frame)"
                ),
            ));
        }
        validate_optimizer(&self.optimizer)?;
        match self.consistency {
            Consistency::Sync => {}
            Consistency::Bounded { delay } if delay > MAX_BOUNDED_DELAY => {
                return Err(bad(
                    "consistency.bounded_delay",
                    delay,
                    format!(
                        "an integer from 0 to {MAX_BOUNDED_DELAY} (how many clocks a rank's answer may \
                         run ahead of the slowest rank); mode = \"async\" has no bound"
                    ),
                ));
            }
            Consistency::Async | Consistency::Bounded { .. } => {
                if self.optimizer == Optimizer::Mean {
                    return Err(bad(
                        "optimizer.kind",
                        "\"mean\"",
                        format!(
                            "with consistency {}, each push is applied alone, so a mean has no \
                             meaning: \"sum\" (workers push deltas) or a server-side optimizer \
                             (sgd, momentum, nesterov, adam, adamw); or consistency sync",
                            self.consistency.mode()
                        ),
                    ));
                }
            }
        }
        if self.checkpoint_interval_s == Some(0) {
            return Err(bad(
                "checkpoint_interval_s",
                0,
                "a number of seconds >= 1, or no such field",
            ));
        }
        if self.keys.is_empty() {
            return Err(bad("keys", "[]", "at least one key"));
        }
        if self.keys.len() > MAX_KEYS {
            return Err(bad(
                "keys",
                format!("{} keys", self.keys.len()),
                format!("at most {MAX_KEYS} keys"),
            ));
        }
        let mut names = std::collections::HashSet::new();
        for (i, k) in self.keys.iter().enumerate() {
            if let Some(t) = &k.table {
                if !printable_name(&k.name) {
                    return Err(bad(
                        format!("keys[{i}].name"),
                        shown(&k.name),
                        "a table key needs a name of 1 to 128 characters, none of them a control character",
                    ));
                }
                if k.elements != 0 {
                    return Err(bad(
                        format!("keys[{i}].elements"),
                        k.elements,
                        "0 for a table key (its size is `dim` and `rows`)",
                    ));
                }
                table::validate_table(i, &k.name, t, self.dtype, self.chunk_bytes)?;
            } else if k.elements == 0 || k.elements > MAX_KEY_ELEMENTS {
                return Err(bad(
                    format!("keys[{i}].elements"),
                    k.elements,
                    format!("an integer from 1 to {MAX_KEY_ELEMENTS}"),
                ));
            }
            if !k.name.is_empty() && !printable_name(&k.name) {
                return Err(bad(
                    format!("keys[{i}].name"),
                    shown(&k.name),
                    "no name, or one of 1 to 128 characters, none of them a control character",
                ));
            }
            if !k.name.is_empty() && !names.insert(k.name.as_str()) {
                return Err(bad(
                    format!("keys[{i}].name"),
                    shown(&k.name),
                    "a name no other key of the job has",
                ));
            }
        }
        if let Some(p) = &self.placement {
            p.validate()?;
            if p.hierarchical {
                self.validate_hierarchy(p)?;
            }
            self.validate_replicas(p)?;
        }
        Ok(())
    }

    /// `[placement] replicas` (PROTOCOL.md §11.1).
    fn validate_replicas(&self, p: &PlacementSpec) -> Result<(), SpecError> {
        let r = p.replicas;
        let max = crate::replica::MAX_REPLICAS;
        if r == 0 || r > u32::from(max) {
            return Err(bad(
                "placement.replicas",
                r,
                format!("1 to {max}: the chunk's primary and up to {} backups", max - 1),
            ));
        }
        if r as usize > p.count() {
            return Err(bad(
                "placement.replicas",
                r,
                format!(
                    "at most the job's appliance count ({}, placement.appliances): each replica is on \
                     another appliance",
                    p.count()
                ),
            ));
        }
        if r == 1 {
            return Ok(());
        }
        if self.consistency != Consistency::Sync {
            // PROTOCOL.md §11.10: each update replicated.
            if let Some(t) = self.tables().next() {
                return Err(bad(
                    "placement.replicas",
                    r,
                    format!(
                        "1 for a job of consistency {} with a table key (keys[{}]): replication of \
                         its tables is specified for BSP only (PROTOCOL.md §11.9)",
                        self.consistency.mode(),
                        t.key
                    ),
                ));
            }
        }
        // A hierarchical job's home slots are replicated over its home
        // layout, and it goes flat at its first epoch change (PROTOCOL.md
        // §11.11); it is BSP without tables (checked as hierarchical).
        if self.tables().next().is_some() {
            if let Some(t) = self
                .tables()
                .find(|t| crate::replica_rows::rows_per_fragment(t.spec.dim) == 0)
            {
                return Err(bad(
                    format!("keys[{}].dim", t.key),
                    t.spec.dim,
                    "a row that fits a replication fragment as f32 (at most 2202) in a replicated \
                     job (PROTOCOL.md §11.9)",
                ));
            }
        }
        if self.dtype.size() == 2 && self.chunk_bytes > MAX_HIERARCHICAL_HALF_CHUNK_BYTES {
            return Err(bad(
                "chunk_bytes",
                self.chunk_bytes,
                format!(
                    "at most {MAX_HIERARCHICAL_HALF_CHUNK_BYTES} for a replicated {} job: a round's \
                     aggregate travels to the backups as f32 and must fit one datagram",
                    self.dtype
                ),
            ));
        }
        Ok(())
    }

    /// How many appliances hold each chunk (`[placement] replicas`, 1
    /// without a placement).
    pub fn replicas(&self) -> usize {
        self.placement.as_ref().map_or(1, |p| p.replicas as usize)
    }

    /// The job's table keys (PROTOCOL.md §10), in key order, with their
    /// key indices.
    pub fn tables(&self) -> impl Iterator<Item = TableKey<'_>> {
        self.keys.iter().enumerate().filter_map(|(i, k)| {
            // Cast: a validated spec has at most MAX_KEYS (2^20) keys.
            #[allow(clippy::cast_possible_truncation)]
            let key = i as u32;
            k.table.as_ref().map(|spec| TableKey {
                key,
                name: &k.name,
                spec,
            })
        })
    }

    /// Whether the job has a table key.
    pub fn has_tables(&self) -> bool {
        self.keys.iter().any(|k| k.table.is_some())
    }

    fn validate_hierarchy(&self, p: &PlacementSpec) -> Result<(), SpecError> {
        if let Some(t) = self.tables().next() {
            return Err(bad(
                "placement.hierarchical",
                true,
                format!(
                    "a job without table keys (key {} is a table): hierarchical aggregation of rows is \
                     not specified; shard it flat (hierarchical = false)",
                    shown(t.name)
                ),
            ));
        }
        let racks = p.count();
        if racks < 2 {
            return Err(bad(
                "placement.appliances",
                racks,
                "2 or more appliances for a hierarchical job (one per rack); one appliance needs no hierarchy",
            ));
        }
        if self.consistency != Consistency::Sync {
            return Err(bad(
                "placement.hierarchical",
                true,
                format!(
                    "a BSP job (consistency sync): hierarchical aggregation forwards one partial sum per \
                     round, which consistency {} does not have",
                    self.consistency.mode()
                ),
            ));
        }
        if self.dtype.size() == 2 && self.chunk_bytes > MAX_HIERARCHICAL_HALF_CHUNK_BYTES {
            return Err(bad(
                "chunk_bytes",
                self.chunk_bytes,
                format!(
                    "at most {MAX_HIERARCHICAL_HALF_CHUNK_BYTES} for a hierarchical {} job: partial sums \
                     travel as f32 and must fit one datagram",
                    self.dtype
                ),
            ));
        }
        match &p.ranks_per_rack {
            Some(n) if n.len() != racks => Err(bad(
                "placement.ranks_per_rack",
                format!("{} entries", n.len()),
                format!("one worker count per rack: {racks} entries"),
            )),
            Some(n)
                if n.contains(&0)
                    || n.iter().map(|&c| u64::from(c)).sum::<u64>() != u64::from(self.workers) =>
            {
                Err(bad(
                    "placement.ranks_per_rack",
                    format!("{n:?}"),
                    format!("counts of 1 or more that add up to workers = {}", self.workers),
                ))
            }
            Some(_) => Ok(()),
            None if (self.workers as usize) < racks => Err(bad(
                "workers",
                self.workers,
                format!("at least one worker per rack of a hierarchical job ({racks} racks)"),
            )),
            None => Ok(()),
        }
    }

    /// A hierarchical job's ranks, rack by rack (`[placement]
    /// ranks_per_rack`, or the workers spread evenly); None for any other
    /// job. Meaningful for a validated spec.
    pub fn rack_ranks(&self) -> Option<Vec<std::ops::Range<u16>>> {
        let p = self.placement.as_ref().filter(|p| p.hierarchical)?;
        let racks = p.count().max(1);
        let w = self.workers as usize;
        let counts: Vec<usize> = match &p.ranks_per_rack {
            Some(n) => n.iter().map(|&c| c as usize).collect(),
            None => (0..racks)
                .map(|r| w / racks + usize::from(r < w % racks))
                .collect(),
        };
        let mut at = 0usize;
        Some(
            counts
                .into_iter()
                .map(|c| {
                    // Cast: ranks are below MAX_WORKERS (256), checked by validate.
                    #[allow(clippy::cast_possible_truncation)]
                    let r = at as u16..(at + c) as u16;
                    at += c;
                    r
                })
                .collect(),
        )
    }

    /// Whether the spec asks for hierarchical aggregation.
    pub fn hierarchical(&self) -> bool {
        self.placement.as_ref().is_some_and(|p| p.hierarchical)
    }
}

fn validate_optimizer(o: &Optimizer) -> Result<(), SpecError> {
    fn lr(v: f32) -> Result<(), SpecError> {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(bad("optimizer.lr", v, "a finite number > 0"))
        }
    }
    fn unit(field: &str, v: f32) -> Result<(), SpecError> {
        if (0.0..1.0).contains(&v) {
            Ok(())
        } else {
            Err(bad(format!("optimizer.{field}"), v, "a number in [0, 1)"))
        }
    }
    fn decay(v: f32) -> Result<(), SpecError> {
        if v.is_finite() && v >= 0.0 {
            Ok(())
        } else {
            Err(bad("optimizer.weight_decay", v, "a finite number >= 0"))
        }
    }
    match *o {
        Optimizer::Sum | Optimizer::Mean => Ok(()),
        Optimizer::Sgd { lr: l, weight_decay } => {
            lr(l)?;
            decay(weight_decay)
        }
        Optimizer::Momentum {
            lr: l,
            momentum,
            weight_decay,
        }
        | Optimizer::Nesterov {
            lr: l,
            momentum,
            weight_decay,
        } => {
            lr(l)?;
            unit("momentum", momentum)?;
            decay(weight_decay)
        }
        Optimizer::Adam {
            lr: l,
            beta1,
            beta2,
            eps,
            weight_decay,
        }
        | Optimizer::Adamw {
            lr: l,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            lr(l)?;
            unit("beta1", beta1)?;
            unit("beta2", beta2)?;
            if !(eps.is_finite() && eps > 0.0) {
                return Err(bad("optimizer.eps", eps, "a finite number > 0"));
            }
            decay(weight_decay)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "toy"
workers = 3
dtype = "bf16"
chunk_bytes = 4096
[optimizer]
kind = "adam"
lr = 0.001
[[keys]]
name = "w"
elements = 10
[[keys]]
elements = 1
"#;

    #[test]
    fn toml_and_json_agree() {
        let t = JobSpec::from_toml(GOOD).unwrap();
        assert_eq!(t.dtype, Dtype::Bf16);
        assert_eq!(t.consistency, Consistency::Sync);
        assert!(matches!(t.optimizer, Optimizer::Adam { beta1, .. } if beta1 == 0.9));
        let j = JobSpec::from_json(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(t, j);
        assert_eq!(t.chunk_elems(), 2048);
    }

    fn err(text: &str) -> String {
        JobSpec::from_toml(text).unwrap_err().to_string()
    }

    /// Each mode parses from what PROTOCOL.md and the README show, travels
    /// through JSON unchanged, and a bad mode, a τ out of range, a bound
    /// on another mode or a mean without BSP is refused naming the field.
    #[test]
    fn consistency_modes_parse_and_bad_ones_name_the_field() {
        let with = |c: &str| GOOD.replace("chunk_bytes = 4096\n", &format!("chunk_bytes = 4096\n{c}\n"));
        for (text, want) in [
            ("consistency = { mode = \"sync\" }", Consistency::Sync),
            ("consistency = { mode = \"async\" }", Consistency::Async),
            (
                "consistency = { bounded_delay = 4 }",
                Consistency::Bounded { delay: 4 },
            ),
            (
                "consistency = { mode = \"bounded_delay\", bounded_delay = 0 }",
                Consistency::Bounded { delay: 0 },
            ),
            ("consistency = {}", Consistency::Sync),
        ] {
            let s = JobSpec::from_toml(&with(text)).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(s.consistency, want, "{text}");
            let j = JobSpec::from_json(&serde_json::to_string(&s).unwrap()).unwrap();
            assert_eq!(j.consistency, want);
        }
        let json = serde_json::to_string(&Consistency::Bounded { delay: 8 }).unwrap();
        assert_eq!(json, r#"{"mode":"bounded_delay","bounded_delay":8}"#);
        for (text, c) in [
            ("bsp", Consistency::Sync),
            ("async", Consistency::Async),
            ("ssp:0", Consistency::Bounded { delay: 0 }),
            ("ssp:1024", Consistency::Bounded { delay: 1024 }),
        ] {
            assert_eq!(c.to_string(), text);
            assert_eq!(text.parse::<Consistency>(), Ok(c));
        }
        assert_eq!("sync".parse::<Consistency>(), Ok(Consistency::Sync));
        for wrong in ["ssp:1025", "ssp:", "ssp:-1", "bounded", "BSP", ""] {
            let e = wrong.parse::<Consistency>().unwrap_err().to_string();
            assert!(
                e.contains(&format!("{wrong:?}"))
                    && e.contains("bsp (or sync), async, or ssp:TAU")
                    && e.contains("0 to 1024"),
                "{e}"
            );
        }
        let e = err(&with("consistency = { bounded_delay = 1025 }"));
        assert!(
            e.contains("`consistency.bounded_delay` = 1025") && e.contains("0 to 1024"),
            "{e}"
        );
        let e = err(&with("consistency = { mode = \"ssp\" }"));
        assert!(
            e.contains("consistency.mode = \"ssp\"") && e.contains("bounded_delay = N"),
            "{e}"
        );
        let e = err(&with("consistency = { mode = \"async\", bounded_delay = 2 }"));
        assert!(e.contains("bounded_delay = 2") && e.contains("\"async\""), "{e}");
        let e = err(&with("consistency = { mode = \"bounded_delay\" }"));
        assert!(e.contains("needs bounded_delay = N"), "{e}");
        let e = err(&with("consistency = { bounded_delay = -1 }"));
        assert!(e.contains("consistency"), "{e}");
        let mean = with("consistency = { mode = \"async\" }")
            .replace("kind = \"adam\"\nlr = 0.001", "kind = \"mean\"");
        let e = err(&mean);
        assert!(
            e.contains("`optimizer.kind` = \"mean\"") && e.contains("consistency async"),
            "{e}"
        );
        let sum = mean.replace("kind = \"mean\"", "kind = \"sum\"");
        assert_eq!(JobSpec::from_toml(&sum).unwrap().consistency, Consistency::Async);
    }

    #[test]
    fn errors_name_field_value_and_what_is_accepted() {
        let e = err(&GOOD.replace("workers = 3", "workers = 0"));
        assert!(e.contains("`workers` = 0") && e.contains("1 to 256"), "{e}");
        let e = err(&GOOD.replace("elements = 10", "elements = 0"));
        assert!(e.contains("`keys[0].elements` = 0"), "{e}");
        let e = err(&GOOD.replace("chunk_bytes = 4096", "chunk_bytes = 16384"));
        assert!(e.contains("`chunk_bytes` = 16384") && e.contains("jumbo"), "{e}");
        let e = err(&GOOD.replace("chunk_bytes = 4096", "chunk_bytes = 100"));
        assert!(e.contains("multiple of 64"), "{e}");
        let e = err(&GOOD.replace("lr = 0.001", "lr = -0.1"));
        assert!(e.contains("`optimizer.lr` = -0.1") && e.contains("> 0"), "{e}");
        let e = err(&GOOD.replace("kind = \"adam\"", "kind = \"lamb\""));
        assert!(e.contains("lamb") && e.contains("adamw"), "{e}");
        let e = err(&GOOD.replace("dtype = \"bf16\"", "dtype = \"f64\""));
        assert!(e.contains("f64") && e.contains("bf16"), "{e}");
        let e = err(&GOOD.replace("name = \"w\"", "name = \"w\"\ncolour = 1"));
        assert!(e.contains("colour"), "{e}");
        let e = err(&GOOD.replace("lr = 0.001", "lr = 0.001\nbeta1 = 1.0"));
        assert!(e.contains("`optimizer.beta1` = 1"), "{e}");
        let e = err(&GOOD.replace(
            "elements = 1\n",
            "elements = 1\n[consistency]\nmode = \"eventual\"\n",
        ));
        assert!(e.contains("consistency.mode") && e.contains("\"async\""), "{e}");
        let e = err("name = \"x\"\nworkers = 1\nkeys = []\n[optimizer]\nkind = \"sum\"\n");
        assert!(e.contains("`keys` = []"), "{e}");
        let e = err(&GOOD.replace("elements = 1\n", "name = \"w\"\nelements = 1\n"));
        assert!(e.contains("`keys[1].name` = \"w\""), "{e}");
        let e = err(&GOOD.replace("workers = 3", "workers = 3\nworkers = 4"));
        assert!(e.contains("workers"), "{e}");
    }

    #[test]
    fn json_errors_too() {
        let e = JobSpec::from_json("{\"name\": \"x\"").unwrap_err();
        assert!(matches!(e, SpecError::Parse(_)));
        let e = JobSpec::from_json(
            r#"{"name":"x","workers":300,"optimizer":{"kind":"sum"},"keys":[{"elements":1}]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`workers` = 300"), "{e}");
    }

    #[test]
    fn names_with_control_characters_are_refused_and_long_ones_not_echoed_whole() {
        // JSON's string escapes (\n, \t, \u001b) are TOML's too.
        let q = |s: &str| serde_json::to_string(s).unwrap();
        let spec = |name: &str, key: &str| {
            format!(
                "name = {}\nworkers = 1\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 4\nname = {}\n",
                q(name),
                q(key)
            )
        };
        for bad_name in ["a\nb", "row\u{1b}[2J", "tab\there", "nul\u{0}"] {
            let e = err(&spec(bad_name, "k"));
            assert!(e.contains("`name`") && e.contains("control character"), "{e}");
            let e = err(&spec("ok", bad_name));
            assert!(
                e.contains("`keys[0].name`") && e.contains("control character"),
                "{e}"
            );
        }
        assert!(JobSpec::from_toml(&spec("caf\u{e9} net", "layer.0/weight")).is_ok());
        let long = "x".repeat(15 << 20);
        let e = err(&spec(&long, "k"));
        assert!(
            e.len() < 300 && e.contains("15728640 characters"),
            "{} bytes: {}",
            e.len(),
            &e[..200]
        );
        let e = err(&spec("ok", &"y".repeat(129)));
        assert!(
            e.contains("`keys[0].name`") && e.contains("129 characters"),
            "{e}"
        );
        // `name = ""` is no name (documented on KeySpec::name): two such
        // keys do not collide, and the name is not written back.
        let json = r#"{"name":"x","workers":1,"optimizer":{"kind":"sum"},
                       "keys":[{"elements":4,"name":""},{"elements":4,"name":""}]}"#;
        let s = JobSpec::parse(json, Some("application/json")).unwrap();
        assert!(s.keys.iter().all(|k| k.name.is_empty()));
        assert!(!serde_json::to_string(&s).unwrap().contains("\"name\":\"\""));
    }

    #[test]
    fn toml_type_errors_name_the_line_and_field() {
        let e = err("name = \"x\"\nworkers = \"two\"\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 4\n");
        assert!(e.contains("line 2") && e.contains("`workers = \"two\"`"), "{e}");
        let e = err(
            "name = \"x\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 99999999999999999999\n",
        );
        assert!(
            e.contains("line 6 (in [[keys]])") && e.contains("`elements = 99999999999999999999`"),
            "{e}"
        );
    }

    /// What a user writes is refused with the path of the field at fault,
    /// in TOML and in a one-line JSON body alike (issue 31, part 5: a
    /// one-line JSON body's "line 1 column 136" names no table).
    #[test]
    fn spec_errors_name_the_path_of_the_field() {
        let unknown = "consistency.delay: unknown field `delay`, expected `mode` or `bounded_delay`";
        let toml = GOOD.replacen(
            "[optimizer]",
            "consistency = { mode = \"bounded\", delay = 2 }\n[optimizer]",
            1,
        );
        let e = JobSpec::from_toml(&toml).unwrap_err().to_string();
        assert!(e.contains(unknown) && e.contains("(line "), "{e}");
        let json = r#"{"name":"x","workers":2,"optimizer":{"kind":"sum"},"consistency":{"mode":"bounded","delay":2},"keys":[{"elements":4}]}"#;
        let e = JobSpec::from_json(json).unwrap_err().to_string();
        assert!(e.contains(unknown) && e.contains("at line 1 column"), "{e}");
        let json = r#"{"name":"x","workers":2,"optimizer":{"kind":"sum"},"keys":[{"elements":4},{"elements":4},{"elements":4,"nme":"w"}]}"#;
        let e = JobSpec::from_json(json).unwrap_err().to_string();
        assert!(e.contains("keys[2].nme: unknown field `nme`"), "{e}");
        let toml = "name = \"x\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 4\n[[keys]]\nelements = \"many\"\n";
        let e = JobSpec::from_toml(toml).unwrap_err().to_string();
        assert!(
            e.contains("keys[1].elements: invalid type") && e.contains("line 8 (in [[keys]])"),
            "{e}"
        );
    }

    #[test]
    fn parse_takes_the_content_type_or_the_text_and_skips_a_bom() {
        let json = r#"{"name":"x","workers":2,"optimizer":{"kind":"sum"},"keys":[{"elements":4}]}"#;
        let toml = "name = \"x\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 4\n";
        let want = JobSpec::from_json(json).unwrap();
        for (text, ct) in [
            (json.to_string(), None),
            (format!("\u{feff}{json}"), None),
            (
                format!("\u{feff}  {json}"),
                Some("application/json; charset=utf-8"),
            ),
            (toml.to_string(), Some("application/toml")),
            (format!("\u{feff}{toml}"), None),
        ] {
            assert_eq!(JobSpec::parse(&text, ct).unwrap(), want, "{ct:?} {text:?}");
        }
        // Told JSON, TOML is a JSON error (not a TOML one).
        let e = JobSpec::parse(toml, Some("application/json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at line 1 column"), "a JSON error: {e}");
    }

    #[test]
    fn a_job_with_a_table_takes_replicas_whose_rows_fit_a_fragment() {
        let spec = |replicas: u32, dim: u32| {
            JobSpec::from_toml(&format!(
                "name = \"t\"\nworkers = 2\nchunk_bytes = 8192\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 10\n[[keys]]\n\
                 name = \"emb\"\nkind = \"table\"\ndim = {dim}\nrows = 1000\n\
                 [placement]\nappliances = 3\nreplicas = {replicas}\n"
            ))
        };
        assert_eq!(spec(2, 16).map(|s| s.replicas()), Ok(2));
        assert_eq!(spec(3, 16).map(|s| s.replicas()), Ok(3));
        // A row must fit a replication fragment as f32.
        let e = JobSpec::from_toml(
            "name = \"t\"\nworkers = 2\ndtype = \"bf16\"\nchunk_bytes = 8832\n[optimizer]\nkind = \"sum\"\n[[keys]]\nname = \"emb\"\n\
             kind = \"table\"\ndim = 4000\nrows = 10\n[placement]\nappliances = 2\nreplicas = 2\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`keys[0].dim` = 4000") && e.contains("at most 2202"),
            "{e}"
        );
    }

    #[test]
    fn replicas_default_to_one_and_are_checked_naming_the_field() {
        let with = |p: &str| JobSpec::from_toml(&format!("{GOOD}\n[placement]\n{p}\n"));
        let one = with("appliances = 3").unwrap();
        assert_eq!((one.placement.as_ref().unwrap().replicas, one.replicas()), (1, 1));
        assert_eq!(JobSpec::from_toml(GOOD).unwrap().replicas(), 1);
        // Written only when not the default, read back the same.
        assert!(!serde_json::to_string(&one).unwrap().contains("replicas"));
        let two = with("appliances = 3\nreplicas = 2").unwrap();
        assert_eq!(two.replicas(), 2);
        let json = serde_json::to_string(&two).unwrap();
        assert!(json.contains("\"replicas\":2"), "{json}");
        assert_eq!(JobSpec::from_json(&json).unwrap(), two);
        let built = JobSpec::new("b", 2, &[10])
            .sharded_over(Appliances::Count(2))
            .with_replicas(2);
        assert_eq!(built.validate().map(|()| built.replicas()), Ok(2));
        for (p, field, says) in [
            (
                "appliances = 3\nreplicas = 0",
                "`placement.replicas` = 0",
                "1 to 3",
            ),
            (
                "appliances = 4\nreplicas = 4",
                "`placement.replicas` = 4",
                "1 to 3",
            ),
            (
                "appliances = 2\nreplicas = 3",
                "`placement.replicas` = 3",
                "appliance count (2",
            ),
        ] {
            let e = with(p).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(says), "{p}: {e}");
        }
        // Hierarchical: its home slots replicated (PROTOCOL.md §11.11).
        let hier = with("appliances = 3\nreplicas = 2\nhierarchical = true").unwrap();
        assert_eq!((hier.replicas(), hier.hierarchical()), (2, true));
        // Async and bounded delay: replicated (PROTOCOL.md §11.10).
        for c in [Consistency::Async, Consistency::Bounded { delay: 2 }] {
            let three = JobSpec::new("a", 2, &[10])
                .with_consistency(c)
                .sharded_over(Appliances::Count(3));
            three.clone().with_replicas(2).validate().unwrap();
            three.with_replicas(3).validate().unwrap();
        }
        // A 2-byte dtype's aggregate travels as f32: half the largest chunk.
        let e = JobSpec::new("a", 2, &[10])
            .with_dtype(Dtype::F16)
            .with_chunk_bytes(8192)
            .sharded_over(Appliances::Count(2))
            .with_replicas(2)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`chunk_bytes` = 8192") && e.contains("at most 4416"),
            "{e}"
        );
    }

    #[test]
    fn placement_takes_a_count_or_names_and_says_what_is_wrong() {
        let with = |p: &str| JobSpec::from_toml(&format!("{GOOD}\n[placement]\n{p}\n"));
        let two = with("appliances = 2").unwrap();
        assert_eq!(two.placement.as_ref().unwrap().appliances, Appliances::Count(2));
        let named = with("appliances = [\"a\", \"b-1\"]").unwrap();
        assert_eq!(named.placement.as_ref().unwrap().count(), 2);
        let back = JobSpec::from_json(&serde_json::to_string(&named).unwrap()).unwrap();
        assert_eq!(back, named);
        assert_eq!(JobSpec::from_toml(GOOD).unwrap().placement, None);
        let e = with("appliances = 0").unwrap_err().to_string();
        assert!(
            e.contains("placement.appliances") && e.contains("from 1 to 64"),
            "{e}"
        );
        let e = with("appliances = [\"a\", \"a\"]").unwrap_err().to_string();
        assert!(
            e.contains("placement.appliances[1]") && e.contains("not listed before"),
            "{e}"
        );
        let e = with("appliances = [\"../x\"]").unwrap_err().to_string();
        assert!(
            e.contains("placement.appliances[0]") && e.contains("ASCII letters"),
            "{e}"
        );
        let e = with("appliances = \"a\"").unwrap_err().to_string();
        assert!(e.contains("a number of appliances"), "{e}");
    }
}
