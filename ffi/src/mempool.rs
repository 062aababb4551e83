//! Packet mbuf pools.
//!
//! A [`Mempool`] is a shared handle (clone it freely; pools are safe to use
//! from many threads). The pool is freed when the last handle goes, but only
//! if none of its mbufs is out: one that is still held (by a driver, a ring,
//! a peer) keeps the pool's memory alive and the pool is left to the EAL's
//! cleanup, with a log line.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::eal::Eal;
use crate::error::Error;
use crate::mbuf::Mbuf;
use crate::{sys, Result};

struct Inner {
    ptr: NonNull<sys::rte_mempool>,
    name: String,
    data_room: u16,
}

// SAFETY: rte_mempool operations are thread-safe (lockless rings with
// per-lcore caches; non-EAL threads bypass the caches).
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: ptr is a live pool (freed only here).
        let out = unsafe { sys::rte_mempool_in_use_count(self.ptr.as_ptr()) };
        if out == 0 {
            // SAFETY: no handle and no mbuf of the pool remain.
            unsafe { sys::rte_mempool_free(self.ptr.as_ptr()) };
        } else {
            log::debug!(
                "mempool {}: {out} mbufs still out at drop; left to EAL cleanup",
                self.name
            );
        }
    }
}

/// A pool of packet mbufs.
#[derive(Clone)]
pub struct Mempool(Arc<Inner>);

impl std::fmt::Debug for Mempool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mempool")
            .field("name", &self.0.name)
            .field("data_room", &self.0.data_room)
            .finish()
    }
}

impl Mempool {
    /// Creates a pool of `n` packet mbufs, each with `data_room` bytes of
    /// buffer (headroom included: [`crate::PKTMBUF_HEADROOM`] of it sit
    /// before the data), a per-lcore cache of `cache` mbufs, on NUMA
    /// `socket` (`None`: any). `tag` goes into the pool's unique name.
    pub fn pktmbuf(
        _eal: Eal,
        tag: &str,
        n: u32,
        cache: u32,
        data_room: u16,
        socket: Option<u32>,
    ) -> Result<Mempool> {
        let name = crate::unique_name(tag);
        let c = CString::new(name.clone()).map_err(|_| Error::Invalid(format!("pool name {name:?}")))?;
        let socket = socket.map_or(sys::SOCKET_ID_ANY, |s| s as i32);
        // DPDK caps the cache at 512 and wants it at most n / 1.5.
        let cache = cache.min(512).min(n * 2 / 3);
        // SAFETY: the EAL is up; c is NUL-terminated; DPDK copies the name.
        let p = unsafe { sys::rte_pktmbuf_pool_create(c.as_ptr(), n, cache, 0, data_room, socket) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::call(
                format!("rte_pktmbuf_pool_create({n} mbufs of {data_room} bytes on socket {socket})"),
                0,
            )
        })?;
        Ok(Mempool(Arc::new(Inner { ptr, name, data_room })))
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::rte_mempool {
        self.0.ptr.as_ptr()
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Buffer bytes per mbuf, headroom included.
    pub fn data_room(&self) -> u16 {
        self.0.data_room
    }

    /// One mbuf, reset and empty; `None` when the pool is exhausted.
    pub fn alloc(&self) -> Option<Mbuf> {
        // SAFETY: live pool.
        let p = unsafe { sys::phub_pktmbuf_alloc(self.as_ptr()) };
        // SAFETY: a freshly allocated mbuf whose only reference we now own.
        NonNull::new(p).map(|p| unsafe { Mbuf::from_raw(p) })
    }

    /// Fills every slot of `out` with a fresh mbuf, or none of them (false)
    /// when the pool has too few. What `out` held before is dropped.
    pub fn alloc_bulk(&self, out: &mut [Option<Mbuf>]) -> bool {
        for s in out.iter_mut() {
            *s = None;
        }
        // More than any pool holds (its size is a u32): too few.
        let Ok(n) = u32::try_from(out.len()) else {
            return false;
        };
        // SAFETY: Option<Mbuf> has the layout of a nullable mbuf pointer
        // (checked at compile time in mbuf.rs); the slots are all None, so
        // nothing is leaked when DPDK writes them; on failure it writes
        // nothing.
        let rc = unsafe {
            sys::phub_pktmbuf_alloc_bulk(self.as_ptr(), out.as_mut_ptr().cast::<*mut sys::rte_mbuf>(), n)
        };
        rc == 0
    }

    /// Mbufs currently in the pool (its caches included).
    pub fn available(&self) -> u32 {
        // SAFETY: live pool.
        unsafe { sys::rte_mempool_avail_count(self.as_ptr()) }
    }

    /// Mbufs currently out of the pool.
    pub fn in_use(&self) -> u32 {
        // SAFETY: live pool.
        unsafe { sys::rte_mempool_in_use_count(self.as_ptr()) }
    }
}
