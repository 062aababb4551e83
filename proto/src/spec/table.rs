//! Table keys (issue 32, PROTOCOL.md §10.1): a key of `kind = "table"` is a
//! sparse table of rows of `dim` values keyed by arbitrary `u64` ids,
//! stored only once touched, instead of a dense tensor.
//!
//! ```toml
//! [[keys]]
//! name = "emb"
//! kind = "table"
//! dim = 16
//! rows = 1000000                                   # optional cap
//! seed = 7                                         # default 0
//! init = { kind = "uniform", a = -0.05, b = 0.05 } # default zeros
//! optimizer = { kind = "adagrad", lr = 0.05 }      # default sum
//! evict = { idle_rounds = 100 }                    # or { idle_s = S }
//! admit_after = 2                                  # optional
//! key_cache = 64                                   # default 0 (off)
//! ```
//!
//! In a [`KeySpec`](super::KeySpec) a table is `table: Some(TableSpec)` with
//! `elements = 0`; a dense key is `table: None` with its elements. The
//! text form is flat (`kind` beside the other fields); [`KeyFields`] is
//! that form, read and written through [`KeySpec`]'s serde impls.
//! [`validate_table`] names the key, the field, the value and what is
//! accepted.

use serde::{Deserialize, Serialize};

use super::{bad, shown, SpecError};
use crate::Dtype;

/// Most rows a table may be capped at (`rows`): 2^40, about 1.1 x 10^12.
pub const MAX_TABLE_ROWS: u64 = 1 << 40;

/// Bytes of a row id on the wire (a little-endian `u64`).
pub const ROW_ID_BYTES: usize = 8;

/// A sparse table: what a key of `kind = "table"` declares besides its
/// name (which stays in [`KeySpec::name`](super::KeySpec::name), required
/// for a table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableSpec {
    /// Values per row, 1 or more, such that one row and its id fit a
    /// datagram of the job's `chunk_bytes` (PROTOCOL.md §10.1).
    pub dim: u32,
    /// The most rows stored at once over all the job's lcores; none: no
    /// cap stated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<u64>,
    /// Keys the placement of rows (PROTOCOL.md §10.1) and the initial
    /// values' generator: the same seed gives the same placement and the
    /// same initial rows on every lcore, restart and checkpoint.
    #[serde(default)]
    pub seed: u64,
    /// What a row never stored reads as.
    #[serde(default)]
    pub init: RowInitSpec,
    /// What the appliance does to a row with a round's (or a push's)
    /// gradient.
    #[serde(default)]
    pub optimizer: RowOptimizerSpec,
    /// When stored rows are evicted besides at the `rows` cap; none: only
    /// at the cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evict: Option<Evict>,
    /// A row is stored only once it has been pushed this many times; until
    /// then it reads as its initial value. None: stored on its first push.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admit_after: Option<u32>,
    /// Key caching (PROTOCOL.md §10.7): the id lists each rank may keep
    /// on each lcore and then name by signature instead of sending the
    /// ids; 0 (the default): none. Charged by admission.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub key_cache: u32,
}

/// The most id lists a rank may keep per lcore of a table (`key_cache`).
pub const MAX_KEY_CACHE: u32 = 1 << 16;

// Serde's `skip_serializing_if` passes a reference.
#[allow(clippy::trivially_copy_pass_by_ref)]
pub(crate) fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What a row that was never stored reads as, per element, from (seed,
/// table, id, element) by the counter-based generator of PROTOCOL.md §10.5.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RowInitSpec {
    /// Every element +0.
    #[default]
    Zeros,
    /// Uniform on [a, b).
    Uniform {
        /// Lower bound, finite.
        a: f32,
        /// Upper bound, finite, > a.
        b: f32,
    },
    /// Normal with mean 0 and standard deviation `std`.
    Normal {
        /// Standard deviation, finite, > 0.
        std: f32,
    },
}

/// The optimizer of a table's rows, run on the appliance per row
/// (PROTOCOL.md §10.4 gives each exactly in `f32`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RowOptimizerSpec {
    /// The gradient is added to the row.
    #[default]
    Sum,
    /// `row -= lr * g`.
    Sgd {
        /// Learning rate, finite, > 0.
        lr: f32,
    },
    /// Adagrad, element-wise or (`rowwise`) with one accumulator per row.
    Adagrad {
        /// Learning rate, finite, > 0.
        lr: f32,
        /// Added to the denominator, finite, > 0.
        #[serde(default = "default_adagrad_eps")]
        eps: f32,
        /// The accumulator of a row when it is stored, finite, >= 0.
        #[serde(default)]
        initial_accumulator: f32,
        /// One accumulator per row (the mean of the squared gradient's
        /// elements) instead of one per element.
        #[serde(default)]
        rowwise: bool,
    },
    /// Lazy Adam: moments and step count per row, touched rows only.
    Adam {
        /// Learning rate, finite, > 0.
        lr: f32,
        /// First-moment decay, in [0, 1).
        #[serde(default = "default_beta1")]
        beta1: f32,
        /// Second-moment decay, in [0, 1).
        #[serde(default = "default_beta2")]
        beta2: f32,
        /// Added to the denominator, finite, > 0.
        #[serde(default = "default_adam_eps")]
        eps: f32,
    },
    /// FTRL-proximal (McMahan et al.) with L1 and L2 regularisation.
    Ftrl {
        /// Learning rate alpha, finite, > 0.
        alpha: f32,
        /// Learning-rate offset beta, finite, >= 0.
        #[serde(default = "default_ftrl_beta")]
        beta: f32,
        /// L1 strength, finite, >= 0.
        #[serde(default)]
        l1: f32,
        /// L2 strength, finite, >= 0.
        #[serde(default)]
        l2: f32,
    },
}

fn default_adagrad_eps() -> f32 {
    1e-8
}
fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_adam_eps() -> f32 {
    1e-8
}
fn default_ftrl_beta() -> f32 {
    1.0
}

impl RowOptimizerSpec {
    /// `f32` words of state a stored row keeps after its `dim` values
    /// (PROTOCOL.md §10.5): none for `sum` and `sgd`; `adagrad` one per
    /// element (one per row when `rowwise`); `adam` two per element and a
    /// step count; `ftrl` two per element. The engine's row optimizers
    /// keep exactly this (its tests hold the two equal).
    pub const fn state_len(&self, dim: u32) -> u32 {
        match self {
            RowOptimizerSpec::Sum | RowOptimizerSpec::Sgd { .. } => 0,
            RowOptimizerSpec::Adagrad { rowwise: false, .. } => dim,
            RowOptimizerSpec::Adagrad { rowwise: true, .. } => 1,
            RowOptimizerSpec::Adam { .. } => dim.saturating_mul(2).saturating_add(1),
            RowOptimizerSpec::Ftrl { .. } => dim.saturating_mul(2),
        }
    }

    /// The spec name: `sum`, `sgd`, `adagrad`, `adam` or `ftrl`.
    pub const fn name(&self) -> &'static str {
        match self {
            RowOptimizerSpec::Sum => "sum",
            RowOptimizerSpec::Sgd { .. } => "sgd",
            RowOptimizerSpec::Adagrad { .. } => "adagrad",
            RowOptimizerSpec::Adam { .. } => "adam",
            RowOptimizerSpec::Ftrl { .. } => "ftrl",
        }
    }
}

/// When stored rows are evicted besides at the `rows` cap: `evict = {
/// idle_rounds = N }` or `evict = { idle_s = S }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "EvictFields", into = "EvictFields")]
pub enum Evict {
    /// A row not touched for this many of its lcore's rounds (BSP) or
    /// clocks (async), 1 or more.
    IdleRounds(u32),
    /// A row not touched for this many seconds, 1 or more.
    IdleSeconds(u32),
}

/// `evict` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EvictFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    idle_rounds: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    idle_s: Option<u32>,
}

impl TryFrom<EvictFields> for Evict {
    type Error = String;

    fn try_from(f: EvictFields) -> Result<Evict, String> {
        match (f.idle_rounds, f.idle_s) {
            (Some(n), None) => Ok(Evict::IdleRounds(n)),
            (None, Some(s)) => Ok(Evict::IdleSeconds(s)),
            (a, b) => Err(format!(
                "evict = {{ idle_rounds = {a:?}, idle_s = {b:?} }}: accepted: evict = {{ idle_rounds = N }} \
                 or evict = {{ idle_s = S }}, one of them"
            )),
        }
    }
}

impl From<Evict> for EvictFields {
    fn from(e: Evict) -> EvictFields {
        match e {
            Evict::IdleRounds(n) => EvictFields {
                idle_rounds: Some(n),
                idle_s: None,
            },
            Evict::IdleSeconds(s) => EvictFields {
                idle_rounds: None,
                idle_s: Some(s),
            },
        }
    }
}

/// Rows of `dim` elements of `dtype` that fit one datagram of
/// `chunk_bytes` payload bytes, each with its 8-byte id (PROTOCOL.md
/// §10.2): `floor(chunk_bytes / (8 + dim * size(dtype)))`; 0 when not even
/// one fits. Also the most ids one ROW_PULL may carry (its answer carries
/// that many rows).
pub fn rows_per_datagram(chunk_bytes: u32, dim: u32, dtype: Dtype) -> u32 {
    let row = ROW_ID_BYTES as u64 + u64::from(dim) * dtype.size() as u64;
    // Cast: at most chunk_bytes, a u32.
    #[allow(clippy::cast_possible_truncation)]
    let n = (u64::from(chunk_bytes) / row) as u32;
    n
}

/// Largest `dim` whose row and id fit `chunk_bytes` in `dtype`.
pub fn max_dim(chunk_bytes: u32, dtype: Dtype) -> u32 {
    // Cast: a dtype's size is 2 or 4, an id's 8.
    #[allow(clippy::cast_possible_truncation)]
    let (size, id) = (dtype.size() as u32, ROW_ID_BYTES as u32);
    chunk_bytes.saturating_sub(id) / size
}

/// A key's fields as a spec writes them, dense or table: what
/// [`KeySpec`](super::KeySpec) reads and writes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KeyFields {
    #[serde(default)]
    pub(super) name: String,
    #[serde(default)]
    pub(super) kind: Option<String>,
    #[serde(default)]
    pub(super) elements: Option<u64>,
    #[serde(default)]
    pub(super) dim: Option<u32>,
    #[serde(default)]
    pub(super) rows: Option<u64>,
    #[serde(default)]
    pub(super) seed: Option<u64>,
    #[serde(default)]
    pub(super) init: Option<RowInitSpec>,
    #[serde(default)]
    pub(super) optimizer: Option<RowOptimizerSpec>,
    #[serde(default)]
    pub(super) evict: Option<Evict>,
    #[serde(default)]
    pub(super) admit_after: Option<u32>,
    #[serde(default)]
    pub(super) key_cache: Option<u32>,
}

/// A key as a spec writes it, borrowed: dense keys as before (`name` when
/// given, `elements`), tables with `kind = "table"` and every field filled
/// in.
#[derive(Serialize)]
pub(super) struct KeyFieldsRef<'a> {
    #[serde(skip_serializing_if = "str::is_empty")]
    pub(super) name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kind: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) elements: Option<u64>,
    #[serde(flatten)]
    pub(super) table: Option<&'a TableSpec>,
}

impl KeyFields {
    /// The key these fields declare: dense (no `kind`, or `kind =
    /// "dense"`, with `elements` and no table field) or a table (`kind =
    /// "table"` with `dim` and no `elements`).
    pub(super) fn into_key(self) -> Result<super::KeySpec, String> {
        let name = self.name;
        let who = if name.is_empty() {
            "a key".to_string()
        } else {
            format!("key {}", shown(&name))
        };
        let table_fields = [
            ("dim", self.dim.is_some()),
            ("rows", self.rows.is_some()),
            ("seed", self.seed.is_some()),
            ("init", self.init.is_some()),
            ("optimizer", self.optimizer.is_some()),
            ("evict", self.evict.is_some()),
            ("admit_after", self.admit_after.is_some()),
            ("key_cache", self.key_cache.is_some()),
        ];
        match self.kind.as_deref() {
            None | Some("dense") => {
                if let Some((f, _)) = table_fields.iter().find(|(_, set)| *set) {
                    return Err(format!(
                        "{who}: `{f}` is a field of a table key; add kind = \"table\" (and no `elements`), \
                         or leave `{f}` out of a dense key"
                    ));
                }
                let Some(elements) = self.elements else {
                    return Err(format!(
                        "{who}: missing field `elements` (a dense key's number of elements; a table key \
                         says kind = \"table\" and dim = D)"
                    ));
                };
                Ok(super::KeySpec {
                    name,
                    elements,
                    table: None,
                })
            }
            Some("table") => {
                if let Some(e) = self.elements {
                    return Err(format!(
                        "{who}: elements = {e} on a table key: a table has `dim` values per row and no \
                         `elements`; leave it out, or drop kind = \"table\" for a dense key"
                    ));
                }
                let Some(dim) = self.dim else {
                    return Err(format!(
                        "{who}: missing field `dim` (values per row) of a table key"
                    ));
                };
                Ok(super::KeySpec {
                    name,
                    elements: 0,
                    table: Some(TableSpec {
                        dim,
                        rows: self.rows,
                        seed: self.seed.unwrap_or(0),
                        init: self.init.unwrap_or_default(),
                        optimizer: self.optimizer.unwrap_or_default(),
                        evict: self.evict,
                        admit_after: self.admit_after,
                        key_cache: self.key_cache.unwrap_or(0),
                    }),
                })
            }
            Some(k) => Err(format!(
                "{who}: kind = {}: accepted: \"dense\" (the default) or \"table\"",
                shown(k)
            )),
        }
    }
}

/// Checks table key `i` (named `name`) of a job of `dtype` and
/// `chunk_bytes`: every field in range, the first problem named.
pub(super) fn validate_table(
    i: usize,
    name: &str,
    t: &TableSpec,
    dtype: Dtype,
    chunk_bytes: u32,
) -> Result<(), SpecError> {
    let field = |f: &str| format!("keys[{i}].{f}");
    let of = |what: String| format!("table {}: {what}", shown(name));
    let max = max_dim(chunk_bytes, dtype);
    if t.dim == 0 || t.dim > max {
        return Err(bad(
            field("dim"),
            t.dim,
            of(format!(
                "an integer from 1 to {max}: a row of dim {dtype} values and its {ROW_ID_BYTES}-byte id must \
                 fit chunk_bytes = {chunk_bytes}"
            )),
        ));
    }
    if let Some(r) = t.rows {
        if r == 0 || r > MAX_TABLE_ROWS {
            return Err(bad(
                field("rows"),
                r,
                of(format!("an integer from 1 to {MAX_TABLE_ROWS} (2^40), or no cap")),
            ));
        }
    }
    let positive = |f: &str, v: f32| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(bad(field(f), v, of("a finite number > 0".into())))
        }
    };
    let non_negative = |f: &str, v: f32| {
        if v.is_finite() && v >= 0.0 {
            Ok(())
        } else {
            Err(bad(field(f), v, of("a finite number >= 0".into())))
        }
    };
    let unit = |f: &str, v: f32| {
        if (0.0..1.0).contains(&v) {
            Ok(())
        } else {
            Err(bad(field(f), v, of("a number in [0, 1)".into())))
        }
    };
    match t.init {
        RowInitSpec::Zeros => {}
        RowInitSpec::Uniform { a, b } => {
            if !a.is_finite() {
                return Err(bad(field("init.a"), a, of("a finite number below b".into())));
            }
            if !(b.is_finite() && b > a) {
                return Err(bad(
                    field("init.b"),
                    b,
                    of(format!("a finite number above a = {a}")),
                ));
            }
        }
        RowInitSpec::Normal { std } => positive("init.std", std)?,
    }
    match t.optimizer {
        RowOptimizerSpec::Sum => {}
        RowOptimizerSpec::Sgd { lr } => positive("optimizer.lr", lr)?,
        RowOptimizerSpec::Adagrad {
            lr,
            eps,
            initial_accumulator,
            rowwise: _,
        } => {
            positive("optimizer.lr", lr)?;
            positive("optimizer.eps", eps)?;
            non_negative("optimizer.initial_accumulator", initial_accumulator)?;
        }
        RowOptimizerSpec::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => {
            positive("optimizer.lr", lr)?;
            unit("optimizer.beta1", beta1)?;
            unit("optimizer.beta2", beta2)?;
            positive("optimizer.eps", eps)?;
        }
        RowOptimizerSpec::Ftrl { alpha, beta, l1, l2 } => {
            positive("optimizer.alpha", alpha)?;
            non_negative("optimizer.beta", beta)?;
            non_negative("optimizer.l1", l1)?;
            non_negative("optimizer.l2", l2)?;
        }
    }
    match t.evict {
        Some(Evict::IdleRounds(0)) => {
            return Err(bad(field("evict.idle_rounds"), 0, of("an integer >= 1".into())));
        }
        Some(Evict::IdleSeconds(0)) => {
            return Err(bad(
                field("evict.idle_s"),
                0,
                of("a number of seconds >= 1".into()),
            ));
        }
        _ => {}
    }
    if t.admit_after == Some(0) {
        return Err(bad(
            field("admit_after"),
            0,
            of("an integer >= 1 (pushes before a row is stored), or no such field".into()),
        ));
    }
    if t.key_cache > MAX_KEY_CACHE {
        return Err(bad(
            field("key_cache"),
            t.key_cache,
            of(format!(
                "an integer from 0 (no key caching) to {MAX_KEY_CACHE}: id lists a rank keeps per lcore"
            )),
        ));
    }
    let room = crate::wire::MAX_PAYLOAD - crate::rows::KEY_CACHE_PREFIX;
    if t.key_cache > 0 && chunk_bytes as usize > room {
        return Err(bad(
            field("key_cache"),
            t.key_cache,
            of(format!(
                "0 with chunk_bytes = {chunk_bytes}: a cached table's messages carry a {}-byte prefix beside \
                 a datagram of rows, so key caching needs chunk_bytes at most {}",
                crate::rows::KEY_CACHE_PREFIX,
                room / 64 * 64
            )),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{JobSpec, KeySpec};
    use super::*;

    /// A job of one dense key `w` and the table key written in `table`
    /// (TOML fields after `[[keys]]`).
    fn job(table: &str) -> String {
        format!(
            "name = \"t\"\nworkers = 2\nchunk_bytes = 1024\n[optimizer]\nkind = \"sum\"\n\
             [[keys]]\nname = \"w\"\nelements = 40\n[[keys]]\n{table}\n"
        )
    }

    fn err(table: &str) -> String {
        JobSpec::from_toml(&job(table)).unwrap_err().to_string()
    }

    #[test]
    fn a_table_key_parses_with_its_defaults_and_round_trips_through_json_and_toml() {
        let s = JobSpec::from_toml(&job("name = \"emb\"\nkind = \"table\"\ndim = 16")).unwrap();
        assert_eq!(s.keys[0], KeySpec::dense("w", 40));
        let want = TableSpec {
            dim: 16,
            rows: None,
            seed: 0,
            init: RowInitSpec::Zeros,
            optimizer: RowOptimizerSpec::Sum,
            evict: None,
            admit_after: None,
            key_cache: 0,
        };
        assert_eq!(s.keys[1], KeySpec::table("emb", want.clone()));
        let tables: Vec<(u32, &str)> = s.tables().map(|t| (t.key, t.name)).collect();
        assert_eq!(tables, [(1, "emb")]);
        assert!(s.has_tables());
        let json = serde_json::to_string(&s).unwrap();
        assert!(
            json.contains(
                r#""keys":[{"name":"w","elements":40},{"name":"emb","kind":"table","dim":16,"seed":0,"init":{"kind":"zeros"},"optimizer":{"kind":"sum"}}]"#
            ),
            "{json}"
        );
        assert_eq!(JobSpec::from_json(&json).unwrap(), s);
        assert_eq!(JobSpec::from_toml(&toml::to_string(&s).unwrap()).unwrap(), s);

        let full = JobSpec::from_toml(&job(
            "name = \"emb\"\nkind = \"table\"\ndim = 8\nrows = 1000000\nseed = 7\n\
             init = { kind = \"uniform\", a = -0.05, b = 0.05 }\n\
             optimizer = { kind = \"adagrad\", lr = 0.05, rowwise = true }\n\
             evict = { idle_rounds = 100 }\nadmit_after = 2",
        ))
        .unwrap();
        let t = full.keys[1].table.as_ref().unwrap();
        assert_eq!(t.rows, Some(1_000_000));
        assert_eq!(t.seed, 7);
        assert_eq!(t.init, RowInitSpec::Uniform { a: -0.05, b: 0.05 });
        assert_eq!(
            t.optimizer,
            RowOptimizerSpec::Adagrad {
                lr: 0.05,
                eps: 1e-8,
                initial_accumulator: 0.0,
                rowwise: true
            }
        );
        assert_eq!(t.evict, Some(Evict::IdleRounds(100)));
        assert_eq!(t.admit_after, Some(2));
        let json = serde_json::to_string(&full).unwrap();
        assert_eq!(JobSpec::from_json(&json).unwrap(), full);
        assert_eq!(
            JobSpec::from_toml(&toml::to_string(&full).unwrap()).unwrap(),
            full
        );
        // Every optimizer's defaults, and idle seconds.
        for (text, want) in [
            ("{ kind = \"sgd\", lr = 0.5 }", RowOptimizerSpec::Sgd { lr: 0.5 }),
            (
                "{ kind = \"adam\", lr = 0.5 }",
                RowOptimizerSpec::Adam {
                    lr: 0.5,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                },
            ),
            (
                "{ kind = \"ftrl\", alpha = 0.1 }",
                RowOptimizerSpec::Ftrl {
                    alpha: 0.1,
                    beta: 1.0,
                    l1: 0.0,
                    l2: 0.0,
                },
            ),
        ] {
            let s = JobSpec::from_toml(&job(&format!(
                "name = \"e\"\nkind = \"table\"\ndim = 4\noptimizer = {text}\nevict = {{ idle_s = 30 }}"
            )))
            .unwrap();
            let t = s.keys[1].table.as_ref().unwrap();
            assert_eq!(t.optimizer, want, "{text}");
            assert_eq!(t.evict, Some(Evict::IdleSeconds(30)));
            assert_eq!(
                JobSpec::from_json(&serde_json::to_string(&s).unwrap()).unwrap(),
                s
            );
        }
    }

    #[test]
    fn bad_table_fields_are_named_with_the_key_and_what_is_accepted() {
        let t = |rest: &str| format!("name = \"emb\"\nkind = \"table\"\n{rest}");
        for (text, field, accepted) in [
            (t("dim = 0"), "`keys[1].dim` = 0", "from 1 to 254"),
            (t("dim = 255"), "`keys[1].dim` = 255", "fit chunk_bytes = 1024"),
            (t("dim = 4\nrows = 0"), "`keys[1].rows` = 0", "from 1 to"),
            (
                t("dim = 4\noptimizer = { kind = \"sgd\", lr = 0 }"),
                "`keys[1].optimizer.lr` = 0",
                "> 0",
            ),
            (
                t("dim = 4\noptimizer = { kind = \"adagrad\", lr = 1, eps = -1 }"),
                "`keys[1].optimizer.eps` = -1",
                "> 0",
            ),
            (
                t("dim = 4\noptimizer = { kind = \"adagrad\", lr = 1, initial_accumulator = -0.5 }"),
                "`keys[1].optimizer.initial_accumulator` = -0.5",
                ">= 0",
            ),
            (
                t("dim = 4\noptimizer = { kind = \"adam\", lr = 1, beta2 = 1 }"),
                "`keys[1].optimizer.beta2` = 1",
                "[0, 1)",
            ),
            (
                t("dim = 4\noptimizer = { kind = \"ftrl\", alpha = 1, l1 = -1 }"),
                "`keys[1].optimizer.l1` = -1",
                ">= 0",
            ),
            (
                t("dim = 4\ninit = { kind = \"uniform\", a = 1, b = 1 }"),
                "`keys[1].init.b` = 1",
                "above a = 1",
            ),
            (
                t("dim = 4\ninit = { kind = \"normal\", std = 0 }"),
                "`keys[1].init.std` = 0",
                "> 0",
            ),
            (
                t("dim = 4\nevict = { idle_rounds = 0 }"),
                "`keys[1].evict.idle_rounds` = 0",
                ">= 1",
            ),
            (
                t("dim = 4\nevict = { idle_s = 0 }"),
                "`keys[1].evict.idle_s` = 0",
                ">= 1",
            ),
            (t("dim = 4\nadmit_after = 0"), "`keys[1].admit_after` = 0", ">= 1"),
            (
                "kind = \"table\"\ndim = 4".to_string(),
                "`keys[1].name` = \"\"",
                "a table key needs a name",
            ),
        ] {
            let e = err(&text);
            assert!(e.contains(field) && e.contains(accepted), "{text}: {e}");
            if !field.contains(".name") {
                assert!(e.contains("table \"emb\""), "{text}: names the table: {e}");
            }
        }
        // Structural mistakes, named by the key and the field.
        for (text, says) in [
            (t("elements = 4\ndim = 4"), "elements = 4 on a table key"),
            (t(""), "missing field `dim`"),
            (
                "name = \"emb\"\nelements = 4\ndim = 4".to_string(),
                "`dim` is a field of a table key",
            ),
            (
                "name = \"emb\"\nkind = \"sparse\"\ndim = 4".to_string(),
                "kind = \"sparse\"",
            ),
            (
                t("dim = 4\nevict = { idle_rounds = 1, idle_s = 1 }"),
                "one of them",
            ),
            (t("dim = 4\noptimizer = { kind = \"lamb\", lr = 1 }"), "lamb"),
            (
                t("dim = 4\ninit = { kind = \"normal\", std = 1, mean = 2 }"),
                "mean",
            ),
        ] {
            let e = err(&text);
            assert!(e.contains(says), "{text}: {e}");
        }
        let e = err("name = \"emb\"\nelements = 4\ndim = 4");
        assert!(e.contains("key \"emb\""), "{e}");
    }

    #[test]
    fn a_table_in_a_hierarchical_job_is_refused_and_dense_keys_are_unchanged() {
        let text = format!(
            "{}[placement]\nappliances = 2\nhierarchical = true\n",
            job("name = \"emb\"\nkind = \"table\"\ndim = 4")
        );
        let e = JobSpec::from_toml(&text).unwrap_err().to_string();
        assert!(
            e.contains("`placement.hierarchical`") && e.contains("key \"emb\""),
            "{e}"
        );
        // A dense key written as before reads and writes as before.
        let d = JobSpec::from_json(r#"{"name":"x","workers":1,"optimizer":{"kind":"sum"},"keys":[{"elements":4},{"name":"b","kind":"dense","elements":2}]}"#).unwrap();
        assert_eq!(d.keys, [KeySpec::dense("", 4), KeySpec::dense("b", 2)]);
        assert!(!d.has_tables());
        assert!(serde_json::to_string(&d)
            .unwrap()
            .contains(r#""keys":[{"elements":4},{"name":"b","elements":2}]"#));
    }

    /// A table has no chunks: a job of tables alone is placed (every run
    /// empty) and costed without a panic, as the spec fuzz target does to
    /// every spec it accepts, and a table between dense keys leaves their
    /// layout as it was.
    #[test]
    fn a_table_takes_no_chunk_in_the_layout() {
        use crate::layout::{layout, Chunks};
        use crate::memory::{data_bytes, MemoryModel, ResultStore};
        let only = JobSpec::from_toml(
            "name = \"t\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 8\n",
        )
        .unwrap();
        let model = MemoryModel::default();
        let lay = layout(&only, &mut [0, 0], model.chunk_cost(&only, ResultStore::Slot));
        assert!(lay.lcores.iter().all(|r| r.count == 0), "{lay:?}");
        assert_eq!(Chunks::new(&only).total(), 0);
        let _ = model.job_cost(&only, &lay, ResultStore::Slot).total();
        assert_eq!(data_bytes(&only, ResultStore::Slot), 0);
        let with = JobSpec::from_toml(&job("name = \"emb\"\nkind = \"table\"\ndim = 4")).unwrap();
        let mut without = with.clone();
        without.keys.pop();
        assert_eq!(
            layout(&with, &mut [0, 0, 0], model.chunk_cost(&with, ResultStore::Slot)),
            layout(
                &without,
                &mut [0, 0, 0],
                model.chunk_cost(&without, ResultStore::Slot)
            )
        );
    }

    #[test]
    fn rows_per_datagram_is_what_fits() {
        // 8832 bytes, f32 rows of 16: (8 + 64) bytes each.
        assert_eq!(rows_per_datagram(8832, 16, Dtype::F32), 122);
        assert_eq!(rows_per_datagram(8192, 16, Dtype::Bf16), 204);
        assert_eq!(rows_per_datagram(64, 14, Dtype::F32), 1);
        assert_eq!(rows_per_datagram(64, 15, Dtype::F32), 0);
        assert_eq!(max_dim(64, Dtype::F32), 14);
        assert_eq!(max_dim(8832, Dtype::F16), 4412);
        for d in [1, 7, 16, 100, 2206] {
            let n = u64::from(rows_per_datagram(8832, d, Dtype::F32));
            assert!(n * (8 + 4 * u64::from(d)) <= 8832);
            assert!((n + 1) * (8 + 4 * u64::from(d)) > 8832);
        }
    }
}
