//! phub-proto: what every side of phub agrees on.
//!
//! Layer: pure. No I/O, no clock, no `unsafe`. Holds the wire header views
//! ([`wire`]), the element types ([`Dtype`]), the job spec ([`spec`]), the
//! chunk layout ([`layout`]), what a job costs ([`memory`]), the HTTP APIs'
//! bodies ([`api`]) and routes ([`routes`]); for table keys (PROTOCOL.md
//! §10), the placement of rows ([`placement`]) and the row messages
//! ([`rows`]); for replicas (PROTOCOL.md §11), the replica sets and the
//! replication messages ([`replica`]). Parsing received bytes never
//! panics and never allocates.
#![forbid(unsafe_code)]
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod api;
pub mod checkpoint;
pub mod counters;
pub mod dtype;
pub mod failover;
pub mod fault;
pub mod layout;
pub mod memory;
pub mod placement;
pub mod replica;
pub mod replica_rows;
pub mod routes;
pub mod row_ops;
pub mod rows;
pub mod shm;
pub mod spec;
pub mod spec_builder;
pub mod table_checkpoint;
pub mod wire;

pub use dtype::Dtype;
