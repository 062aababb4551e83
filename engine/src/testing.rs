//! For the tests of the engine's data path, here and in phub-dataplane: an
//! allocator that counts allocations, to show that handling packets
//! allocates nothing. Nothing uses it unless a test binary installs it as
//! its global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting the allocations and reallocations each
/// thread makes (a test measures its own thread's, so that tests in one
/// binary run side by side). A test binary installs it with
/// `#[global_allocator] static GLOBAL: Counting = Counting;`.
pub struct Counting;

thread_local! {
    /// This thread's allocations and reallocations. A `const` cell with
    /// nothing to drop: reaching it never allocates, nor fails while the
    /// thread exits.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

/// Allocations (and reallocations) this thread has made so far.
pub fn allocations() -> u64 {
    ALLOCS.with(Cell::get)
}

fn count() {
    ALLOCS.with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every call unchanged to the system allocator; the only
// addition is an increment of a thread-local counter, which cannot affect
// soundness (the cell is const-initialised and has no destructor, so
// reaching it does not allocate).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for `l`.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` was allocated by `System` with layout `l` (above).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        // SAFETY: `p` came from `System` with layout `l`; the caller upholds
        // `realloc`'s contract for the new size.
        unsafe { System.realloc(p, l, n) }
    }
}
