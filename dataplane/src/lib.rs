//! phub-dataplane: the appliance's data path around the engine.
//!
//! Layer: I/O. The aggregation itself is phub-engine's sans-IO
//! [`phub_engine::Shard`]; this crate runs one per lcore ([`lcore`]) over a
//! packet I/O backend ([`backend`]: kernel UDP, DPDK), takes the CLI and
//! config file ([`config`]), serves the management API ([`mgmt`], [`app`]),
//! places lcores on the machine ([`topology`]) and paces their polling
//! ([`spin`]). With the kernel-UDP backend, jobs may also get shared-memory
//! regions ([`phub_engine::shm`]) for workers on the same host, whose chunks
//! then never cross a socket.
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod app;
pub mod backend;
pub mod config;
pub mod inject;
pub mod lcore;
pub mod mgmt;
pub mod replication;
pub mod spin;
pub mod tables;
pub mod topology;
