//! phub-dataplane: the appliance's data path.
//!
//! Layer: this crate's engine is pure (sans I/O): [`engine::Shard`] takes
//! received datagrams and the caller's clock and yields what to send; it
//! never blocks, logs or allocates per packet (installing a job with
//! shared memory creates its region files; handling packets does no I/O). The aggregation kernels
//! ([`kernels`]) are chosen once at start-up by CPU features; the optimizer
//! passes ([`optim`]) are fused single passes over a chunk. Packet I/O
//! backends (kernel UDP, DPDK) sit on top and share these pieces. With the
//! kernel-UDP backend, jobs may also get shared-memory regions ([`shm`]) for
//! workers on the same host, whose chunks then never cross a socket.
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod app;
pub mod backend;
pub mod config;
pub mod counters;
pub mod engine;
pub mod inject;
pub mod kernels;
pub mod lcore;
pub mod mgmt;
pub mod optim;
pub mod shm;
pub mod slotmem;
pub mod spin;
pub mod topology;
pub mod transmit;

pub use engine::{EngineError, JobInstall, JobShardStats, Shard, Verdict};
pub use kernels::Kernels;
pub use shm::ShmSetup;
pub use slotmem::{RustHeap, SlotAllocator, SlotBlock};
pub use transmit::Transmit;
