//! Shared by the dataplane's integration tests: the engine's allocator that
//! counts allocations (the no-alloc tests install it as their global
//! allocator), and a test EAL (`--no-huge`, no PCI, no shared config) that skips with a
//! printed reason where DPDK cannot start.
#![allow(dead_code, unreachable_pub, unused_imports)]

pub use phub_engine::testing::{allocations, Counting};

/// The EAL for one test binary: `--no-huge -m MEGABYTES --no-pci
/// --no-shconf --no-telemetry --file-prefix PREFIX --lcores LCORES`, plus
/// `extra` arguments (e.g. `--vdev=...`). `None`, after printing why, where
/// the EAL cannot start (no root, no DPDK).
#[cfg(feature = "dpdk")]
pub fn test_eal(prefix: &str, megabytes: u32, lcores: &str) -> Option<phub_ffi::Eal> {
    let args = phub_ffi::eal::standalone_args(prefix, megabytes, lcores);
    match phub_ffi::eal::init(&args) {
        Ok(e) => Some(e),
        Err(e) => {
            println!("SKIPPED: the DPDK EAL cannot start here: {e}");
            None
        }
    }
}
