//! Rings of mbufs (`rte_ring`, multi-producer multi-consumer): the hand-off
//! from an lcore that received a packet to the lcore that owns it, and the
//! queues of ports made of rings.

use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::eal::Eal;
use crate::error::Error;
use crate::mbuf::Mbuf;
use crate::{sys, Result};

struct Inner {
    ptr: NonNull<sys::rte_ring>,
    name: String,
    /// Made by this process (freed with the last handle), or looked up in
    /// another DPDK process's memory (left to that process).
    owned: bool,
}

// SAFETY: the ring is created multi-producer/multi-consumer: every
// operation is thread-safe.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // Free what is still queued, then the ring.
        let mut buf: [Option<Mbuf>; 32] = Default::default();
        loop {
            let n = dequeue(self.ptr, &mut buf);
            for s in &mut buf[..n] {
                *s = None;
            }
            if n == 0 {
                break;
            }
        }
        // SAFETY: last handle; empty now.
        unsafe { sys::rte_ring_free(self.ptr.as_ptr()) };
    }
}

fn dequeue(ring: NonNull<sys::rte_ring>, out: &mut [Option<Mbuf>]) -> usize {
    for s in out.iter_mut() {
        *s = None;
    }
    // SAFETY: the ring only ever holds owned mbuf pointers (enqueue takes
    // Mbufs); Option<Mbuf> has the layout of a nullable mbuf pointer and
    // the slots are None, so ownership moves from the ring into `out`.
    unsafe {
        sys::phub_ring_dequeue_burst(
            ring.as_ptr(),
            out.as_mut_ptr().cast::<*mut std::ffi::c_void>(),
            u32::try_from(out.len()).unwrap_or(u32::MAX),
        ) as usize
    }
}

/// A ring of mbufs. Clones share the ring.
#[derive(Clone)]
pub struct Ring(Arc<Inner>);

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("name", &self.0.name)
            .field("len", &self.len())
            .finish()
    }
}

impl Ring {
    /// A ring holding up to `count - 1` mbufs (`count` a power of two), on
    /// NUMA `socket` (`None`: any). `tag` goes into its unique name.
    pub fn create(eal: Eal, tag: &str, count: u32, socket: Option<u32>) -> Result<Ring> {
        Ring::create_named(eal, &crate::unique_name(tag), count, socket)
    }

    /// A ring as [`Ring::create`] makes it, under exactly `name`, which
    /// another DPDK process of the same runtime (same `--file-prefix`, a
    /// secondary) can find with [`Ring::lookup`]. Fails if the name is taken.
    pub fn create_named(_eal: Eal, name: &str, count: u32, socket: Option<u32>) -> Result<Ring> {
        if !count.is_power_of_two() {
            return Err(Error::Invalid(format!(
                "ring size {count}: expected a power of two"
            )));
        }
        let name = name.to_string();
        let c = CString::new(name.clone()).map_err(|_| Error::Invalid(format!("ring name {name:?}")))?;
        let socket = socket.map_or(sys::SOCKET_ID_ANY, |s| s as i32);
        // SAFETY: EAL up; name NUL-terminated (DPDK copies it); flags 0 =
        // multi-producer, multi-consumer.
        let p = unsafe { sys::rte_ring_create(c.as_ptr(), count, socket, 0) };
        let ptr =
            NonNull::new(p).ok_or_else(|| Error::call(format!("rte_ring_create({name}, {count})"), 0))?;
        Ok(Ring(Arc::new(Inner {
            ptr,
            name,
            owned: true,
        })))
    }

    /// The ring named `name` in the DPDK runtime this process belongs to
    /// (made by another process of it, typically the primary). Dropping the
    /// last handle leaves the ring and what it holds to its maker.
    pub fn lookup(_eal: Eal, name: &str) -> Result<Ring> {
        let c = CString::new(name).map_err(|_| Error::Invalid(format!("ring name {name:?}")))?;
        // SAFETY: EAL up; name NUL-terminated; the ring, if found, lives in
        // shared memory for as long as its maker keeps it.
        let p = unsafe { sys::rte_ring_lookup(c.as_ptr()) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::Invalid(format!(
                "no DPDK ring named {name:?} in this runtime (is the process that makes it up, with the same --file-prefix?)"
            ))
        })?;
        Ok(Ring(Arc::new(Inner {
            ptr,
            name: name.to_string(),
            owned: false,
        })))
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::rte_ring {
        self.0.ptr.as_ptr()
    }

    /// Queues one mbuf; gives it back when the ring is full.
    pub fn enqueue(&self, m: Mbuf) -> Result<(), Mbuf> {
        let p = m.into_raw();
        let objs = [p.as_ptr().cast::<std::ffi::c_void>()];
        // SAFETY: live ring; one valid pointer whose ownership moves into
        // the ring if (and only if) it is enqueued.
        let n = unsafe { sys::phub_ring_enqueue_burst(self.as_ptr(), objs.as_ptr(), 1) };
        if n == 1 {
            Ok(())
        } else {
            // SAFETY: not enqueued: the reference is still ours.
            Err(unsafe { Mbuf::from_raw(p) })
        }
    }

    /// Queues as many of `v`'s mbufs as fit, from the front; those queued
    /// leave `v`. Returns how many.
    pub fn enqueue_burst(&self, v: &mut Vec<Mbuf>) -> usize {
        if v.is_empty() {
            return 0;
        }
        // SAFETY: Mbuf is a transparent non-null mbuf pointer, so v's buffer
        // is an array of owned pointers; the first n move into the ring and
        // are removed from v without being dropped.
        unsafe {
            let n = sys::phub_ring_enqueue_burst(
                self.as_ptr(),
                v.as_ptr().cast::<*mut std::ffi::c_void>(),
                u32::try_from(v.len()).unwrap_or(u32::MAX),
            ) as usize;
            let rest = v.len() - n;
            std::ptr::copy(v.as_ptr().add(n), v.as_mut_ptr(), rest);
            v.set_len(rest);
            n
        }
    }

    /// Takes up to `out.len()` mbufs into `out[..n]` and returns n. What
    /// `out` held before is dropped.
    pub fn dequeue_burst(&self, out: &mut [Option<Mbuf>]) -> usize {
        dequeue(self.0.ptr, out)
    }

    /// Mbufs queued now.
    pub fn len(&self) -> usize {
        // SAFETY: live ring.
        unsafe { sys::phub_ring_count(self.as_ptr()) as usize }
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
