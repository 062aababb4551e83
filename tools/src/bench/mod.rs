//! `phub-bench run`: end-to-end figures of a whole appliance with emulated
//! workers.
//!
//! - [`run`]: the command (options, coordination, figures, JSON, table).
//! - [`emulate`]: one emulated worker (thread or process).
//! - [`local`]: the local appliance (`--local`) as child processes.
//! - [`ceiling`]: the same-run loopback ceilings the efficiency is stated
//!   against.
//! - [`plot`]: the sweep's plot (SVG, or PNG rendered from it).
//! - [`tcp_ps`]: the same-run TCP parameter server of `--baseline tcp-ps`.
//! - [`failover`]: `--replicas` and `--kill-appliance`: a replicated
//!   job's failover measured on the virtual racks.
//! - [`racks`]: virtual racks (`--racks R`): namespaces, veth links, tbf
//!   limits, an appliance per rack, the bytes across the spine.
//! - [`sparse`]: `phub-bench sparse`: sparse tables' row store
//!   (`--engine-only`).
//! - [`torch`]: `phub-bench torch`: a PyTorch DDP step with gloo and with
//!   phub's comm hook on the virtual racks, same links, same run.

pub mod ceiling;
pub mod emulate;
pub mod failover;
pub mod local;
pub mod plot;
#[cfg(feature = "png")]
mod png;
pub mod racks;
pub mod run;
pub mod sparse;
pub mod tcp_ps;
pub mod tcp_rows;
pub mod torch;
