//! Shared by the dataplane's integration tests: an allocator that counts
//! allocations (the no-alloc tests install it as their global allocator),
//! and a test EAL (`--no-huge`, no PCI, no shared config) that skips with a
//! printed reason where DPDK cannot start.
#![allow(dead_code, unreachable_pub)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counting allocations and reallocations in
/// [`ALLOCS`]. A test binary installs it with
/// `#[global_allocator] static GLOBAL: common::Counting = common::Counting;`.
pub struct Counting;

/// Allocations (and reallocations) made since the program started.
pub static ALLOCS: AtomicU64 = AtomicU64::new(0);

/// Allocations made so far.
pub fn allocations() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

// SAFETY: forwards every call unchanged to the system allocator; the only
// addition is a relaxed counter increment, which cannot affect soundness.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for `l`.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` was allocated by `System` with layout `l` (above).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `p` came from `System` with layout `l`; the caller upholds
        // `realloc`'s contract for the new size.
        unsafe { System.realloc(p, l, n) }
    }
}

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
