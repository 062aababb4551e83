//! For the tests of the engine's data path, here and in phub-dataplane: an
//! allocator that counts allocations, to show that handling packets
//! allocates nothing. Nothing uses it unless a test binary installs it as
//! its global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counting allocations and reallocations in
/// [`ALLOCS`]. A test binary installs it with
/// `#[global_allocator] static GLOBAL: Counting = Counting;`.
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
