//! Where slot memory comes from.
//!
//! The engine asks a [`SlotAllocator`] for zeroed blocks of `f32`s when a
//! job is installed (never per packet), several slots to a block, and
//! carves the slots' buffers out of them. The backend chooses the allocator: Rust's
//! ([`RustHeap`]: the kernel-UDP backend, tests, simulations) or DPDK's heap
//! on the port's NUMA socket (the DPDK backend, behind the `dpdk` feature,
//! in `backend::dpdk`). The engine itself sees only these traits, so it
//! stays free of DPDK.
//!
//! Invariants every allocator keeps: a block holds exactly the `len`
//! elements asked for, all zero, starting on a [`LINE_BYTES`] boundary; it
//! is freed when dropped; a failure is an `Err` that says what was asked
//! and what the allocator had, never a panic or an abort.

use std::fmt::Debug;

/// Alignment of every block, and of every buffer the engine carves from one:
/// a cache line, and an AVX-512 vector.
pub const LINE_BYTES: usize = 64;

/// `f32`s per line.
pub const LINE_F32: usize = LINE_BYTES / 4;

/// One block of zeroed slot memory.
pub trait SlotBlock: Send + Debug {
    /// The block's elements.
    fn as_slice(&self) -> &[f32];
    /// The block's elements, mutably.
    fn as_mut_slice(&mut self) -> &mut [f32];
}

/// A source of slot memory, shared by a backend's lcores.
pub trait SlotAllocator: Send + Sync + Debug {
    /// `len` zeroed `f32`s starting on a [`LINE_BYTES`] boundary; `Err`
    /// says why not (the bytes asked for and what the heap had).
    fn zeroed(&self, len: usize) -> Result<Box<dyn SlotBlock>, String>;
    /// Where the memory comes from, for the start-up log and `/v1/info`,
    /// e.g. `Rust heap` or `DPDK heap, socket 0, hugepages: no`.
    fn describe(&self) -> String;
    /// Bytes one block costs beyond its elements, at most: the block's
    /// own record, the allocator's header, alignment and rounding to pages
    /// (what admission charges per block). The default, a page and two
    /// lines, bounds glibc's and DPDK's heaps alike.
    fn block_overhead(&self) -> u64 {
        4096 + 2 * LINE_BYTES as u64
    }
}

/// One line of slot memory.
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(64))]
struct Line([f32; LINE_F32]);

const _: () =
    assert!(std::mem::size_of::<Line>() == LINE_BYTES && std::mem::align_of::<Line>() == LINE_BYTES);

/// Rust's global allocator (zeroed pages from `alloc_zeroed`).
#[derive(Debug, Clone, Copy, Default)]
pub struct RustHeap;

struct RustBlock {
    lines: Box<[Line]>,
    len: usize,
}

impl Debug for RustBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RustBlock").field("len", &self.len).finish()
    }
}

impl SlotBlock for RustBlock {
    fn as_slice(&self) -> &[f32] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
    fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

impl SlotAllocator for RustHeap {
    fn zeroed(&self, len: usize) -> Result<Box<dyn SlotBlock>, String> {
        let lines = bytemuck::allocation::try_zeroed_slice_box::<Line>(len.div_ceil(LINE_F32))
            .map_err(|()| format!("the Rust heap has no room for {} bytes", 4 * len))?;
        Ok(Box::new(RustBlock { lines, len }))
    }

    fn describe(&self) -> String {
        "Rust heap".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_blocks_are_zeroed_aligned_and_exactly_as_long_as_asked() {
        for len in [1, 15, 16, 17, 1000] {
            let mut b = RustHeap.zeroed(len).unwrap();
            assert_eq!(b.as_slice().len(), len);
            assert_eq!(b.as_slice().as_ptr() as usize % LINE_BYTES, 0);
            assert!(b.as_slice().iter().all(|&x| x == 0.0));
            b.as_mut_slice()[len - 1] = 1.0;
            assert_eq!(b.as_slice()[len - 1], 1.0);
        }
        assert_eq!(RustHeap.describe(), "Rust heap");
        assert!(
            RustHeap.zeroed(usize::MAX / 8).is_err(),
            "an impossible size is an Err, not an abort"
        );
    }
}
