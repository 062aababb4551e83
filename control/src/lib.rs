//! phub-control: the appliance's control process and its operator CLI.
//!
//! Layer: control. Blocking threads and HTTP (tiny_http as server, ureq as
//! client); nothing here touches the data path, which keeps running while
//! control is down or restarting.
//!
//! - [`daemon`]: the `phub-control` daemon. It admits jobs (validation,
//!   capacity, chunk placement balanced over every admitted job and kept on
//!   the NIC's NUMA node), installs them on the dataplane through its
//!   management API, answers workers that join, keeps its jobs in a state
//!   file written atomically after every change, reinstalls jobs a restarted
//!   dataplane lost, and serves status and Prometheus metrics. One file
//!   per concept under `daemon/` (HTTP routes, the registry and its state
//!   file, admission, joins, eviction, views, checkpoints, reconciliation,
//!   appliances); see its head.
//! - [`cli`]: `phubctl`, the operator's CLI over the daemon's API.
//! - [`admission`]: the pure part of admission (lcore choice, loads,
//!   capacity, placement), unit-tested without I/O.
//! - [`format`]: human byte sizes and aligned tables, pure.
//! - [`metrics`]: the Prometheus text rendering, pure.
//! - `job`: a stored job's geometry (its parts, who sends to each, what
//!   each installs and costs), flat or hierarchical by its `JobShape`, pure.
//! - `ckpt_file`: a job part's checkpoint file: whether the one there is
//!   the part's, and keeping a new one (never over a newer, fuller or
//!   unusable one; the previous one kept until the new one reads back).
//! - `watch`: what control last heard from each appliance, which its read
//!   routes answer from without waiting on a hung one, and how two
//!   registrations of one dataplane are told apart from two dataplanes.
//! - `state`: the state file (its format version, atomic writes, its
//!   lock), and the job as stored.
//! - `refit`: what reconciliation does with a job whose layout names lcores
//!   a restarted dataplane no longer has (resize, place anew, or fail), pure.
//!
//! Invariants: a job is recorded only once the dataplane has installed it,
//! and never half-installed; job ids and tokens never change once given;
//! control never removes a job on its own.
#![forbid(unsafe_code)]
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod admission;
mod ckpt_file;
pub mod cli;
pub mod daemon;
mod dataplane;
pub mod format;
mod job;
pub mod metrics;
mod refit;
mod state;
mod watch;
