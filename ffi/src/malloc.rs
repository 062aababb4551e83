//! Memory from DPDK's heap (`rte_malloc`): hugepage memory when the EAL has
//! hugepages, the `-m` area of normal memory with `--no-huge`, on a chosen
//! NUMA socket.
//!
//! A [`HeapSlice`] is an owned, zeroed, aligned slice of plain numbers from
//! `rte_zmalloc_socket`, freed with `rte_free` when dropped. Like every DPDK
//! object it must be dropped before the EAL is cleaned up
//! ([`crate::eal::cleanup`]'s contract). [`heap_stats`] reads a socket's
//! heap counters (`rte_malloc_get_socket_stats`).

use std::ptr::NonNull;

use crate::eal::Eal;
use crate::error::Error;
use crate::{sys, Result};

mod sealed {
    pub trait Sealed {}
}

/// Element types a zeroed [`HeapSlice`] may hold: plain numbers, for which
/// all-zero bytes are a valid value (`0`, `0.0`) and any bytes are valid.
pub trait Plain: sealed::Sealed + Copy + Send + Sync + 'static {}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {}
    )*};
}
plain!(u8, u16, u32, u64, i8, i16, i32, i64, f32, f64);

/// An owned, zeroed slice from DPDK's heap, freed with `rte_free` on drop.
pub struct HeapSlice<T: Plain> {
    /// Start of the slice (dangling, never freed, when `len` is 0).
    ptr: NonNull<T>,
    len: usize,
    socket: Option<u32>,
}

// SAFETY: the slice is owned (no other handle to the memory exists) and T
// is Send; rte_free may be called from any thread.
unsafe impl<T: Plain> Send for HeapSlice<T> {}
// SAFETY: shared access only hands out `&[T]`, and T is Sync.
unsafe impl<T: Plain> Sync for HeapSlice<T> {}

impl<T: Plain> std::fmt::Debug for HeapSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapSlice")
            .field("len", &self.len)
            .field("bytes", &self.bytes())
            .field("socket", &self.socket)
            .finish()
    }
}

impl<T: Plain> HeapSlice<T> {
    /// `len` zeroed elements from DPDK's heap on NUMA `socket` (`None`: any,
    /// the calling lcore's socket first), starting on an `align`-byte
    /// boundary (a power of two; at least T's own alignment is used).
    ///
    /// An explicit socket is kept to: when its heap has no room the
    /// allocation fails ([`Error::NoMemory`], with the heap's free bytes)
    /// rather than landing on another socket.
    pub fn zeroed(eal: Eal, len: usize, align: usize, socket: Option<u32>) -> Result<HeapSlice<T>> {
        if !align.is_power_of_two() {
            return Err(Error::Invalid(format!(
                "alignment {align}: expected a power of two (64 for a cache line)"
            )));
        }
        let align = align.max(std::mem::align_of::<T>());
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::Invalid(format!("{len} elements of {} bytes overflow", size_of::<T>())))?;
        if bytes == 0 {
            return Ok(HeapSlice {
                ptr: NonNull::dangling(),
                len,
                socket,
            });
        }
        let Ok(align_c) = u32::try_from(align) else {
            return Err(Error::Invalid(format!("alignment {align}: at most 2^31")));
        };
        let sock = socket.map_or(sys::SOCKET_ID_ANY, |s| s as i32);
        // SAFETY: the EAL is up (the Eal token proves it); a null type name
        // is accepted; bytes > 0 and align_c is a power of two.
        let p = unsafe { sys::rte_zmalloc_socket(std::ptr::null(), bytes, align_c, sock) };
        let ptr = NonNull::new(p.cast::<T>()).ok_or_else(|| {
            let stats = socket.and_then(|s| heap_stats(eal, s).ok());
            Error::NoMemory {
                bytes,
                socket,
                free: stats.map(|s| s.free_bytes),
                largest_free: stats.map(|s| s.greatest_free_bytes),
            }
        })?;
        debug_assert!((ptr.as_ptr() as usize).is_multiple_of(align));
        Ok(HeapSlice { ptr, len, socket })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The socket asked for (`None`: any).
    pub fn socket(&self) -> Option<u32> {
        self.socket
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr points to len initialised (zeroed, then only written
        // through &mut self) elements of T, owned by self, for as long as
        // the borrow of self; dangling only when len is 0.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in as_slice; &mut self makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Plain> std::ops::Deref for HeapSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Plain> std::ops::DerefMut for HeapSlice<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

impl<T: Plain> Drop for HeapSlice<T> {
    fn drop(&mut self) {
        if self.bytes() > 0 {
            // SAFETY: ptr came from rte_zmalloc_socket and is freed only
            // here, once; the EAL is still up (cleanup's contract says every
            // DPDK object is dropped before it).
            unsafe { sys::rte_free(self.ptr.as_ptr().cast()) };
        }
    }
}

/// One socket's DPDK heap counters (`rte_malloc_socket_stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeapStats {
    /// Bytes the heap spans (grows with hugepages in dynamic memory mode).
    pub total_bytes: u64,
    /// Free bytes.
    pub free_bytes: u64,
    /// Allocated bytes (allocator headers and padding included).
    pub allocated_bytes: u64,
    /// The largest free block: the largest single allocation that fits.
    pub greatest_free_bytes: u64,
    /// Allocated elements.
    pub alloc_count: u32,
    /// Free elements.
    pub free_count: u32,
}

/// The DPDK heap counters of NUMA `socket`.
pub fn heap_stats(_eal: Eal, socket: u32) -> Result<HeapStats> {
    let mut s = sys::rte_malloc_socket_stats::default();
    let sock = i32::try_from(socket).map_err(|_| Error::Invalid(format!("socket {socket}")))?;
    // SAFETY: the EAL is up; s is a valid out pointer.
    let rc = unsafe { sys::rte_malloc_get_socket_stats(sock, &mut s) };
    if rc < 0 {
        return Err(Error::call(
            format!("rte_malloc_get_socket_stats(socket {socket})"),
            rc,
        ));
    }
    Ok(HeapStats {
        total_bytes: s.heap_totalsz_bytes as u64,
        free_bytes: s.heap_freesz_bytes as u64,
        allocated_bytes: s.heap_allocsz_bytes as u64,
        greatest_free_bytes: s.greatest_free_size as u64,
        alloc_count: s.alloc_count,
        free_count: s.free_count,
    })
}
