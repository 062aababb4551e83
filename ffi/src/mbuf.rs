//! Packet buffers.
//!
//! [`Mbuf`] owns one reference to an `rte_mbuf` (and the segments chained
//! behind it); dropping it frees that reference. It is
//! `#[repr(transparent)]` over `NonNull<rte_mbuf>`, so `Option<Mbuf>` has
//! the layout of a nullable `*mut rte_mbuf` and a `&mut [Option<Mbuf>]` is
//! what `rte_eth_rx_burst` fills.
//!
//! Data may be shared: an indirect mbuf ([`Mbuf::indirect`]) points at
//! another mbuf's data and holds a reference on it, and one segment may end
//! several chains, each holding a reference ([`Mbuf::into_shares`],
//! [`Mbuf::chain_shared`]). Shared data is never handed out mutably
//! ([`Mbuf::data_mut`] checks).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};

use crate::mempool::Mempool;
use crate::sys;

/// `addr_of!((*m).field)` for a raw mbuf pointer.
macro_rules! unsafe_field {
    ($m:expr, $f:ident) => {
        // SAFETY: callers pass a valid mbuf pointer (see Mbuf::field).
        unsafe { std::ptr::addr_of!((*$m).$f) }
    };
}

/// One owned reference to a packet buffer (a chain of segments).
#[repr(transparent)]
pub struct Mbuf(NonNull<sys::rte_mbuf>);

// SAFETY: an mbuf reference may move between threads (that is what rings
// and TX queues do); DPDK's refcounts are atomic.
unsafe impl Send for Mbuf {}

const _: () = assert!(std::mem::size_of::<Option<Mbuf>>() == std::mem::size_of::<*mut sys::rte_mbuf>());

impl std::fmt::Debug for Mbuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mbuf")
            .field("pkt_len", &self.pkt_len())
            .field("segs", &self.segments())
            .finish()
    }
}

impl Drop for Mbuf {
    fn drop(&mut self) {
        // SAFETY: self owns one reference to a valid mbuf chain.
        unsafe { sys::phub_pktmbuf_free(self.0.as_ptr()) }
    }
}

impl Mbuf {
    /// Takes ownership of a raw mbuf reference.
    ///
    /// # Safety
    ///
    /// `p` is a valid mbuf whose reference the caller owns and gives up.
    pub(crate) unsafe fn from_raw(p: NonNull<sys::rte_mbuf>) -> Mbuf {
        Mbuf(p)
    }

    /// Gives up ownership, returning the raw pointer.
    pub(crate) fn into_raw(self) -> NonNull<sys::rte_mbuf> {
        let p = self.0;
        std::mem::forget(self);
        p
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::rte_mbuf {
        self.0.as_ptr()
    }

    /// Reads a header field. Goes through the raw pointer (no reference to
    /// the whole header is made), since DPDK updates the refcount field of
    /// a shared mbuf atomically from other threads.
    fn field<T: Copy>(&self, f: impl FnOnce(*const sys::rte_mbuf) -> *const T) -> T {
        // SAFETY: self owns a reference, so the header is valid; the fields
        // read this way (lengths, offsets, links, flags) are only written by
        // the owner of the chain, which is us.
        unsafe { f(self.0.as_ptr()).read() }
    }

    /// Allocates an indirect mbuf from `pool` that shares `direct`'s data
    /// (first segment) and holds a reference on it, so the data lives until
    /// every sharer is freed. `None` when `pool` is empty.
    pub fn indirect(pool: &Mempool, direct: &Mbuf) -> Option<Mbuf> {
        let mi = pool.alloc()?;
        // SAFETY: mi is freshly allocated (direct, refcnt 1, no data);
        // direct is a valid mbuf; attach takes a reference on direct's
        // buffer (on its direct owner if direct is itself indirect).
        unsafe { sys::phub_pktmbuf_attach(mi.as_ptr(), direct.as_ptr()) };
        Some(mi)
    }

    /// Makes this fresh mbuf (direct, no data, the only reference to it)
    /// an indirect one sharing `direct`'s data, as [`Mbuf::indirect`]
    /// does with one from a pool; gives it back unchanged otherwise.
    pub fn attach(self, direct: &Mbuf) -> Result<Mbuf, Mbuf> {
        if !self.is_direct() || self.refcnt() != 1 || self.pkt_len() != 0 || self.nb_segs() != 1 {
            return Err(self);
        }
        // SAFETY: checked just above: a direct, empty, unshared single
        // segment, as rte_pktmbuf_attach requires; direct is a valid mbuf.
        unsafe { sys::phub_pktmbuf_attach(self.as_ptr(), direct.as_ptr()) };
        Ok(self)
    }

    /// Appends `tail`'s chain to this one. Fails (giving both back) when
    /// the chain would exceed DPDK's segment limit.
    pub fn chain(self, tail: Mbuf) -> Result<Mbuf, (Mbuf, Mbuf)> {
        // SAFETY: both are valid chains we own; on success head takes
        // ownership of tail's chain.
        let rc = unsafe { sys::phub_pktmbuf_chain(self.as_ptr(), tail.as_ptr()) };
        if rc == 0 {
            std::mem::forget(tail);
            Ok(self)
        } else {
            Err((self, tail))
        }
    }

    /// Puts this single segment in front of `tail`, a chain that may be
    /// shared: one reference from [`Mbuf::reserve`], say, so that many
    /// header segments end in the same payload without an indirect mbuf
    /// each (DPDK's multicast pattern: freeing each chain frees one
    /// reference per segment). Only this segment's fields are written,
    /// never `tail`'s. Fails (giving both back) unless this is a direct
    /// single segment held by no one else, or when the chain would exceed
    /// DPDK's segment limit.
    pub fn chain_shared(self, tail: Mbuf) -> Result<Mbuf, (Mbuf, Mbuf)> {
        let segs = tail.nb_segs().checked_add(1);
        let len = self.pkt_len().checked_add(tail.pkt_len());
        let (Some(segs), Some(len)) = (segs, len) else {
            return Err((self, tail));
        };
        if self.nb_segs() != 1 || self.refcnt() != 1 || !self.is_direct() {
            return Err((self, tail));
        }
        let h = self.as_ptr();
        // SAFETY: h is a valid single segment that only we hold (checked
        // above), so its fields are ours to write; its reference to tail's
        // chain is the one `tail` owned, which moves into it (forgotten
        // below), and tail's own fields are only read.
        unsafe {
            std::ptr::addr_of_mut!((*h).next).write(tail.into_raw().as_ptr());
            std::ptr::addr_of_mut!((*h).nb_segs).write(segs);
            std::ptr::addr_of_mut!((*h).pkt_len).write(len);
        }
        Ok(self)
    }

    /// Total length of the chain's data.
    pub fn pkt_len(&self) -> u32 {
        self.field(|m| unsafe_field!(m, pkt_len))
    }

    /// Number of segments.
    pub fn nb_segs(&self) -> u16 {
        self.field(|m| unsafe_field!(m, nb_segs))
    }

    /// The port that received it.
    pub fn port(&self) -> u16 {
        self.field(|m| unsafe_field!(m, port))
    }

    /// Offload flags (RX checksum status and the like).
    pub fn ol_flags(&self) -> u64 {
        self.field(|m| unsafe_field!(m, ol_flags))
    }

    /// References to this mbuf's buffer (1 unless shared).
    pub fn refcnt(&self) -> u16 {
        // Read here rather than through a C call (the fast path asks for it
        // per result frame). Acquire: a reader that sees the count drop to 1
        // also sees every access the releasing owners made to the data
        // before they let go.
        // SAFETY: valid mbuf; its refcnt is an aligned u16 that DPDK only
        // ever updates atomically, as the atomic view here reads it.
        unsafe {
            AtomicU16::from_ptr(std::ptr::addr_of_mut!((*self.as_ptr()).refcnt)).load(Ordering::Acquire)
        }
    }

    /// Whether this mbuf owns its buffer (not indirect or external).
    pub fn is_direct(&self) -> bool {
        // RTE_MBUF_DIRECT, read here rather than through a C call.
        self.ol_flags() & (sys::RTE_MBUF_F_INDIRECT | sys::RTE_MBUF_F_EXTERNAL) == 0
    }

    /// The first segment's data.
    pub fn data(&self) -> &[u8] {
        // SAFETY: self's first segment is valid while self lives.
        unsafe { seg_data(self.as_ptr()) }
    }

    /// Asks the CPU to bring this mbuf's own first cache line (data
    /// address, lengths, flags, refcount) into cache without reading it: a
    /// hint only, for a burst's mbufs before their fields are read.
    pub fn prefetch_header(&self) {
        prefetch_line(self.as_ptr().cast::<u8>());
    }

    /// Asks the CPU to bring the first segment's first `lines` cache lines
    /// of data (headers) into cache, ahead of reading them: a hint only,
    /// for frames of a burst handled a few frames later. Reads the mbuf's
    /// own fields (see [`Mbuf::prefetch_header`]).
    pub fn prefetch(&self, lines: usize) {
        let d = self.data();
        for line in d.chunks(64).take(lines) {
            prefetch_line(line.as_ptr());
        }
    }

    /// Asks the port to fill in the IPv4 header checksum and the UDP
    /// checksum of the frame this mbuf starts: `l2`, `l3` and `l4` bytes
    /// of Ethernet, IPv4 and UDP header in this first segment, the IPv4
    /// checksum field 0 and the UDP one the pseudo-header's sum (not
    /// complemented), as DPDK's TX checksum offload wants them. Only for a
    /// port whose [`Offloads::tx_checksums`](crate::port::Offloads::tx_checksums) is on;
    /// others send the fields as they are.
    pub fn offload_udp_checksums(&mut self, l2: u16, l3: u16, l4: u16) {
        // SAFETY: self owns a valid mbuf; the call writes only this
        // segment's metadata (offload flags and header lengths), not data
        // that another reference could be reading.
        unsafe { sys::phub_mbuf_tx_udp_cksum(self.as_ptr(), l2, l3, l4) }
    }

    /// The first segment's data, writable: `None` when the buffer is shared
    /// (refcount above 1, or indirect), since others read it.
    pub fn data_mut(&mut self) -> Option<&mut [u8]> {
        if self.refcnt() != 1 || !self.is_direct() {
            return None;
        }
        let d = self.data();
        let (p, len) = (d.as_ptr() as *mut u8, d.len());
        // SAFETY: the buffer is ours alone (checked above) and &mut self
        // keeps every other access out for the slice's lifetime.
        Some(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }

    /// Takes `n` more references to this direct mbuf with one refcount
    /// update; [`Shares::take`] hands them out one by one as owning handles
    /// without touching the refcount again, and what is not taken is given
    /// back when the `Shares` is dropped. `None` for an indirect mbuf or a
    /// chain (freeing a handle frees every segment's reference, and only
    /// the first one's count is raised here), for `n` above `i16::MAX`, or
    /// when the refcount would pass `u16::MAX`.
    pub fn reserve(&self, n: u16) -> Option<Shares> {
        if !self.is_direct()
            || self.nb_segs() != 1
            || n > i16::MAX as u16
            || u32::from(self.refcnt()) + u32::from(n) > u32::from(u16::MAX)
        {
            return None;
        }
        // SAFETY: a valid direct mbuf we hold a reference to; the n new
        // references are owned by the Shares returned.
        unsafe { sys::phub_mbuf_refcnt_update(self.as_ptr(), n as i16) };
        Some(Shares { m: self.0, left: n })
    }

    /// This reference and `n - 1` more as one [`Shares`], with at most one
    /// refcount update (none for `n == 1`; `n == 0` frees this one). Gives
    /// the mbuf back where [`Mbuf::reserve`] would refuse.
    pub fn into_shares(self, n: u16) -> Result<Shares, Mbuf> {
        let Some(more) = n.checked_sub(1) else {
            drop(self);
            return Ok(Shares {
                m: NonNull::dangling(),
                left: 0,
            });
        };
        if more > 0 {
            match self.reserve(more) {
                Some(mut s) => {
                    // The reserved references and ours, in one.
                    s.left += 1;
                    std::mem::forget(self);
                    return Ok(s);
                }
                None => return Err(self),
            }
        }
        if !self.is_direct() || self.nb_segs() != 1 {
            return Err(self);
        }
        Ok(Shares {
            m: self.into_raw(),
            left: 1,
        })
    }

    /// Every segment's data, in order.
    pub fn segments(&self) -> Vec<&[u8]> {
        let mut out = Vec::with_capacity(usize::from(self.nb_segs()));
        let mut p: *const sys::rte_mbuf = self.as_ptr();
        while !p.is_null() {
            // SAFETY: p is self's first segment or a `next` link of the
            // chain self owns; each is valid while self lives.
            unsafe {
                out.push(seg_data(p));
                p = std::ptr::addr_of!((*p).next).read();
            }
        }
        out
    }

    /// The chain's data, copied into one vector (tests, diagnostics).
    pub fn to_vec(&self) -> Vec<u8> {
        self.segments().concat()
    }

    /// Room left after the last segment's data.
    pub fn tailroom(&self) -> usize {
        let mut p = self.as_ptr();
        // SAFETY: walks the owned chain to its last segment.
        unsafe {
            while !std::ptr::addr_of!((*p).next).read().is_null() {
                p = std::ptr::addr_of!((*p).next).read();
            }
            usize::from(sys::phub_pktmbuf_tailroom(p))
        }
    }

    /// Grows the data by `len` bytes at the end of the last segment and
    /// returns them for writing; `None` if there is not enough tailroom or
    /// the buffer is shared.
    pub fn append(&mut self, len: usize) -> Option<&mut [u8]> {
        if self.refcnt() != 1 || !self.is_direct() || self.nb_segs() != 1 {
            return None;
        }
        let len16 = u16::try_from(len).ok()?;
        // SAFETY: valid single-segment mbuf we own exclusively; append
        // checks the tailroom and returns NULL when it is short.
        let p = unsafe { sys::phub_pktmbuf_append(self.as_ptr(), len16) };
        if p.is_null() {
            return None;
        }
        // SAFETY: append returned the start of `len` bytes just added to
        // our exclusively owned buffer.
        Some(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
    }

    /// Appends a copy of `bytes`; false (and nothing appended) when it does
    /// not fit.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) -> bool {
        match self.append(bytes.len()) {
            Some(d) => {
                d.copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }
}

/// Asks the CPU to bring the cache line at `p` into cache: a hint, which
/// never faults whatever the address (a no-op off x86-64).
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// One segment's data.
///
/// # Safety
///
/// `m` is a valid mbuf that stays valid (and whose data is not written) for
/// the returned lifetime.
unsafe fn seg_data<'a>(m: *const sys::rte_mbuf) -> &'a [u8] {
    // SAFETY: per the contract; buf_addr + data_off .. + data_len lies
    // inside the segment's buffer.
    unsafe {
        let addr = std::ptr::addr_of!((*m).buf_addr).read() as *const u8;
        let off = std::ptr::addr_of!((*m).data_off).read();
        let len = std::ptr::addr_of!((*m).data_len).read();
        std::slice::from_raw_parts(addr.add(usize::from(off)), usize::from(len))
    }
}

/// Frees every mbuf in `v` at once (one bulk call).
pub fn free_bulk(v: &mut Vec<Mbuf>) {
    if v.is_empty() {
        return;
    }
    // Cast: each Mbuf is a distinct live mbuf of a mempool, 128 bytes of
    // struct plus its data room, so far fewer than 2^32 exist at once.
    #[allow(clippy::cast_possible_truncation)]
    let n = v.len() as u32;
    // SAFETY: Mbuf is repr(transparent) over a non-null mbuf pointer, so the
    // vector's buffer is an array of v.len() owned mbuf pointers; after the
    // call they are freed, so the vector forgets them without dropping.
    unsafe {
        sys::rte_pktmbuf_free_bulk(v.as_mut_ptr().cast::<*mut sys::rte_mbuf>(), n);
        v.set_len(0);
    }
}

/// References to one mbuf taken in advance ([`Mbuf::reserve`]).
#[derive(Debug)]
pub struct Shares {
    m: NonNull<sys::rte_mbuf>,
    left: u16,
}

// SAFETY: the references are plain counts on an mbuf in DPDK memory; the
// refcount is updated atomically, from any thread.
unsafe impl Send for Shares {}

impl Shares {
    /// One of the reserved references, as an owning handle; `None` once
    /// all are taken.
    pub fn take(&mut self) -> Option<Mbuf> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // SAFETY: one reference reserved by Mbuf::reserve moves into the
        // handle; the mbuf lives at least as long as that reference.
        Some(unsafe { Mbuf::from_raw(self.m) })
    }

    /// References not taken yet.
    pub fn left(&self) -> u16 {
        self.left
    }
}

impl Drop for Shares {
    fn drop(&mut self) {
        if self.left > 1 {
            // SAFETY: gives back all but one of the references still
            // reserved; the one kept holds the mbuf alive.
            unsafe { sys::phub_mbuf_refcnt_update(self.m.as_ptr(), -((self.left - 1) as i16)) };
        }
        if self.left > 0 {
            // The last one is freed as any handle is: back to its pool if
            // it was the mbuf's last reference.
            self.left = 1;
            drop(self.take());
        }
    }
}
