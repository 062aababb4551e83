//! phub-engine: the appliance's aggregation engine, sans I/O.
//!
//! Layer: pure. [`engine::Shard`] takes received datagrams and the caller's
//! clock and yields what to send ([`Transmit`]s); it never blocks, logs or
//! allocates per packet, and holds no socket, no DPDK handle and no CLI
//! setting (installing a job with shared memory creates its region files;
//! handling packets does no I/O). The aggregation kernels ([`kernels`]) are
//! chosen once at start-up by CPU features; the optimizer passes ([`optim`])
//! are fused single passes over a chunk; slot buffers come from a
//! [`SlotAllocator`] the caller hands in ([`slotmem`]); jobs may get
//! shared-memory regions ([`shm`]) for workers on the same host, whose chunks
//! then never cross a socket. The packet I/O backends (kernel UDP, DPDK) of
//! phub-dataplane and the simulator (phub-sim) drive it.
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

pub mod counters;
pub mod engine;
pub mod kernels;
pub mod optim;
pub mod shm;
pub mod slotmem;
pub mod table;
pub mod testing;
pub mod transmit;

pub use engine::{EngineError, InstallKind, JobInstall, JobShardStats, Shard, Verdict};
pub use kernels::Kernels;
pub use shm::ShmSetup;
pub use slotmem::{RustHeap, SlotAllocator, SlotBlock};
pub use transmit::Transmit;
