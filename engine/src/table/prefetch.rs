//! Software prefetch: a hint that a cache line will be read soon, so that
//! a batch's index entries and rows are fetched from memory in parallel
//! instead of one miss after another.
//!
//! A prefetch never faults and never changes what the program computes; on
//! targets without one it does nothing.

/// Ask for the cache line holding `p` (any address, valid or not) to be
/// brought into every cache level.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: PREFETCHT0 is a hint: it reads no memory the program can
        // observe and raises no fault, whatever the address (Intel SDM,
        // PREFETCHh); SSE, which it needs, is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = p;
    }
}

/// Prefetch every line of the `bytes` bytes from `p`.
#[inline(always)]
pub(crate) fn prefetch_span<T>(p: *const T, bytes: usize) {
    const LINE: usize = 64;
    let p = p.cast::<u8>();
    let lead = (p as usize) % LINE;
    let mut off = 0;
    while off < lead + bytes {
        prefetch(p.wrapping_add(off).wrapping_sub(lead));
        off += LINE;
    }
}
