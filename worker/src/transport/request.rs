//! What a request carries: its chunks, where their datagrams come from
//! ([`Tx`]) and where their results go ([`Sink`]).
//!
//! A request's datagrams are encoded by the caller's thread, once; the
//! transport only flips flags in their headers (RETRANSMIT, SHM) and, with
//! shared memory, copies payloads into the staging region. Results are
//! written through [`Sink::write`], whether they came in a datagram or in a
//! result region. Which API call makes which `Tx` and `Sink`, and who
//! copies what, is tabled in the crate's docs ("Which path a call takes").

use std::net::SocketAddr;
use std::sync::Arc;

use phub_proto::wire::{flags, Header, HEADER_LEN};
use phub_proto::Dtype;

use crate::elem::{Dst, Values};
use crate::shm::Regions;

/// A request for all chunks of one key; `done` is what the caller gets
/// back with the outcome (the I/O thread's: a channel to the waiter).
#[derive(Debug)]
pub(crate) struct Request<D> {
    pub(crate) key: u32,
    pub(crate) round: u32,
    pub(crate) kind: Kind,
    pub(crate) chunks: Vec<ChunkMsg>,
    /// The datagrams.
    pub(crate) tx: Tx,
    /// Where the result goes (the key's length).
    pub(crate) sink: Sink,
    pub(crate) done: D,
}

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Round 0.
    Init,
    /// Round >= 1.
    Push,
    /// Last completed result, any round.
    Pull,
}

/// One chunk's datagram and where its result goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkMsg {
    /// Chunk index within the key.
    pub(crate) chunk: u32,
    /// Slot on the owning lcore.
    pub(crate) slot: u32,
    /// First element of the chunk within the key.
    pub(crate) offset: usize,
    /// Elements of the chunk.
    pub(crate) len: u32,
    /// The owning lcore's address.
    pub(crate) to: SocketAddr,
    /// The owning lcore.
    pub(crate) lcore: u16,
    /// Where the datagram (header and payload, ready to send) starts in the
    /// request's buffer.
    pub(crate) start: usize,
    /// The datagram's length in bytes.
    pub(crate) bytes: usize,
}

impl ChunkMsg {
    /// The whole datagram in an owned buffer.
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.bytes
    }

    /// The header, in either kind of buffer.
    pub(crate) fn header_range(&self) -> std::ops::Range<usize> {
        self.start..self.start + HEADER_LEN
    }
}

/// Where a request's datagrams come from.
#[derive(Debug)]
pub(crate) enum Tx {
    /// Every chunk's datagram (header and payload) at the chunk's `start`.
    Owned(Vec<u8>),
    /// Every chunk's header at the chunk's `start` (HEADER_LEN bytes); the
    /// payloads are the caller's elements, already as on the wire (`f32`
    /// for an `f32` job, or the job's 16-bit type, little-endian),
    /// borrowed for the whole request (see [`crate::exchange::Exchange`]).
    Borrowed {
        /// The headers.
        headers: Vec<u8>,
        /// The caller's gradient, as bytes.
        payload: RawBytes,
        /// Bytes per element.
        size: usize,
    },
    /// Every chunk's header at the chunk's `start` (HEADER_LEN bytes); the
    /// payloads were written by the caller's thread into the staging
    /// region of `regions`, the mapping current when the key was claimed
    /// (see [`crate::worker::Worker::push_pull`]).
    Staged {
        /// The headers.
        headers: Vec<u8>,
        /// The mapping the payloads are in.
        regions: Arc<Regions>,
        /// Element size of the job's wire type.
        size: usize,
        /// Payloads copied back from `regions` (chunk at its first element
        /// times `size`) for chunks that go elsewhere: to another mapping
        /// or as datagrams. Empty until one does.
        copied: Vec<u8>,
    },
}

impl Tx {
    /// The buffer the headers live in (mutable: the RETRANSMIT flag).
    pub(crate) fn headers_mut(&mut self) -> &mut [u8] {
        match self {
            Tx::Owned(b) => b,
            Tx::Borrowed { headers, .. } | Tx::Staged { headers, .. } => headers,
        }
    }

    /// Chunk `m`'s datagram as head and body (the body is empty when the
    /// head holds the whole datagram). With [`flags::SHM`] in its header,
    /// the datagram is the header alone.
    pub(crate) fn parts(&self, m: &ChunkMsg) -> (&[u8], &[u8]) {
        let header = match self {
            Tx::Owned(b) => &b[m.header_range()],
            Tx::Borrowed { headers, .. } | Tx::Staged { headers, .. } => &headers[m.header_range()],
        };
        if Header::new_unchecked(header).flags() & flags::SHM != 0 {
            return (header, &[]);
        }
        match self {
            Tx::Owned(b) => (&b[m.range()], &[]),
            Tx::Borrowed { .. } => (header, self.payload(m)),
            // `stage` copied the payload back before clearing the flag.
            Tx::Staged { copied, size, .. } => (header, &copied[Tx::copied_range(m, *size)]),
        }
    }

    /// Where a staged request keeps chunk `m`'s payload once copied back.
    fn copied_range(m: &ChunkMsg, size: usize) -> std::ops::Range<usize> {
        let at = m.offset * size;
        at..at + (m.bytes - HEADER_LEN)
    }

    /// Chunk `m`'s payload: its elements as wire bytes.
    fn payload(&self, m: &ChunkMsg) -> &[u8] {
        match self {
            Tx::Owned(b) => &b[m.start + HEADER_LEN..m.start + m.bytes],
            Tx::Borrowed { payload, size, .. } => {
                let at = m.offset * size;
                let len = m.bytes - HEADER_LEN;
                // SAFETY: the Exchange that made this request keeps the
                // caller's gradient borrowed (shared) until the request has
                // ended, and the chunk lies inside it (offset and length
                // come from the key's layout, checked against its length).
                unsafe { payload.slice(at, len) }
            }
            Tx::Staged { copied, size, .. } => &copied[Tx::copied_range(m, *size)],
        }
    }

    /// Puts chunk `m`'s payload where the next transmission of it takes
    /// it from: with `regions`, into the staging region at its slot and
    /// [`flags::SHM`] set in its header (the datagram is the header alone);
    /// otherwise (or when the slot is not in the regions) the flag cleared
    /// and the payload in the datagram. Returns whether it went to shared
    /// memory.
    ///
    /// A staged request's payload is already in its own mapping: when that
    /// is `regions`, nothing is copied. Otherwise (the dataplane made new
    /// regions, or there are none) the payload is first copied back from
    /// the request's own mapping, which stays mapped with it and which
    /// nothing else writes at that slot: only a request for the same key,
    /// and the key is claimed until this one has ended.
    pub(crate) fn stage(&mut self, m: &ChunkMsg, regions: Option<&Arc<Regions>>) -> bool {
        if let Tx::Staged {
            regions: own,
            size,
            copied,
            ..
        } = self
        {
            if regions.is_some_and(|r| Arc::ptr_eq(r, own)) {
                return self.set_shm(m, true);
            }
            let range = Tx::copied_range(m, *size);
            if copied.len() < range.end {
                copied.resize(range.end, 0);
            }
            if !own.read_staged(m.lcore, m.slot, &mut copied[range]) {
                // Cannot happen: the chunk was written at this slot.
                log::error!(
                    "phub-worker: chunk {} of slot {} not in its staging region",
                    m.chunk,
                    m.slot
                );
            }
        }
        let shm = regions.is_some_and(|r| {
            let p = self.payload(m);
            p.is_empty() || r.write_chunk(m.lcore, m.slot, p)
        });
        self.set_shm(m, shm)
    }

    /// Sets or clears [`flags::SHM`] in chunk `m`'s header; returns `shm`.
    fn set_shm(&mut self, m: &ChunkMsg, shm: bool) -> bool {
        let mut h = Header::new_unchecked(&mut self.headers_mut()[m.header_range()]);
        let f = h.flags() & !flags::SHM;
        h.set_flags(if shm { f | flags::SHM } else { f });
        shm
    }

    /// Gives the owned buffer back for reuse (an empty one for borrowed).
    pub(crate) fn into_spare(self) -> Vec<u8> {
        match self {
            Tx::Owned(b) => b,
            Tx::Borrowed { headers, .. } | Tx::Staged { headers, .. } => headers,
        }
    }
}

/// Where a request's result goes.
#[derive(Debug)]
pub(crate) enum Sink {
    /// A buffer of the key's length, handed to the waiter at the end.
    Owned(Values),
    /// The caller's output slice, borrowed for the whole request (see
    /// [`crate::exchange::Exchange`]).
    Borrowed(RawDst),
    /// Results left in the result regions of `regions` for the waiter to
    /// copy out: chunk c's is there (at its slot) when `in_region[c]`, in
    /// `values` otherwise (it came as a datagram, or from another mapping).
    Direct {
        /// A buffer of the key's length for the chunks not in `regions`.
        values: Values,
        /// The mapping the request was staged into.
        regions: Arc<Regions>,
        /// Per chunk of the key: its result is in `regions`.
        in_region: Vec<bool>,
    },
}

impl Sink {
    /// The result buffer, for the key's next request (an empty one for a
    /// lent output).
    pub(crate) fn into_values(self) -> Values {
        match self {
            Sink::Owned(v) | Sink::Direct { values: v, .. } => v,
            Sink::Borrowed(_) => Values::default(),
        }
    }

    /// Takes chunk `m`'s accepted result from where it `arrived`: decoded
    /// from the datagram's payload (in the job's `dtype`), read from the
    /// lcore's result region (16-bit types through `scratch`), or, for a
    /// [`Sink::Direct`] request whose mapping is the one the result is in,
    /// left there for the waiter to copy out (see
    /// [`Done`](crate::io::Done)). Returns false, writing
    /// nothing, when the chunk's slot is not in the region.
    pub(crate) fn write(
        &mut self,
        m: &ChunkMsg,
        arrived: Arrived<'_>,
        dtype: Dtype,
        scratch: &mut Vec<u8>,
    ) -> bool {
        if let (
            Sink::Direct {
                regions, in_region, ..
            },
            Arrived::Region(current),
        ) = (&mut *self, arrived)
        {
            if std::ptr::eq(Arc::as_ptr(regions), current)
                && regions.holds_result(m.lcore, m.slot, m.len as usize)
            {
                if let Some(c) = in_region.get_mut(m.chunk as usize) {
                    *c = true;
                    return true;
                }
            }
        }
        // The caller's output (lent by an Exchange) is written once per
        // round: with streaming stores. The worker's own buffers are read
        // again by `wait`'s copy: ordinary ones.
        let to_caller = matches!(self, Sink::Borrowed(_));
        let dst = self.slice_mut(m.offset, m.offset + m.len as usize);
        match arrived {
            Arrived::Datagram(payload) => {
                dst.decode(dtype, payload, to_caller);
                true
            }
            // The lcore wrote this round's result before sending its
            // RESULT, and writes the slot again only after this rank pushed
            // the next round of the chunk.
            Arrived::Region(regions) => regions.read_result(m.lcore, m.slot, dst, scratch, to_caller),
        }
    }

    fn slice_mut(&mut self, start: usize, end: usize) -> Dst<'_> {
        match self {
            Sink::Owned(v) | Sink::Direct { values: v, .. } => v.as_dst().into_range(start, end),
            // SAFETY: the Exchange that made this request keeps the
            // caller's output borrowed (exclusively) until the request has
            // ended, and only this thread writes it meanwhile; `end` is
            // within the key's length, which the slice was checked to have.
            Sink::Borrowed(r) => unsafe { r.slice_mut(start, end - start) },
        }
    }
}

/// Where an accepted RESULT's values are.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arrived<'a> {
    /// In the datagram, after the header, in the job's wire type.
    Datagram(&'a [u8]),
    /// In the result region of the chunk's lcore in this mapping (the one
    /// in use: the RESULT had [`flags::SHM`]).
    Region(&'a Regions),
}

/// A caller's byte buffer, lent to the I/O thread by an Exchange.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawBytes {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

impl RawBytes {
    /// # Safety
    /// The buffer must still be borrowed by the Exchange that lent it, and
    /// `at + len` must not exceed its length.
    unsafe fn slice(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.len, "chunk outside the lent gradient");
        // SAFETY: in bounds (checked above); live and unaliased by writers
        // per this function's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) }
    }
}

/// A caller's output slice, lent to the I/O thread by an Exchange:
/// `len` elements of `f32`, or of 16-bit elements when `wire16`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawDst {
    ptr: *mut u8,
    len: usize,
    wire16: bool,
}

impl RawDst {
    /// The slice's address and kind, to be lent (the caller keeps it
    /// borrowed while the request may use it).
    pub(crate) fn new(out: &mut Dst<'_>) -> RawDst {
        let len = out.len();
        match out {
            Dst::F32(v) => RawDst {
                ptr: v.as_mut_ptr().cast(),
                len,
                wire16: false,
            },
            Dst::Wire16(b) => RawDst {
                ptr: b.as_mut_ptr(),
                len,
                wire16: true,
            },
        }
    }

    /// A lent output at `ptr`: `len` elements, 16-bit ones if `wire16`
    /// (else `f32`, and `ptr` aligned for it). For a buffer lent as the
    /// gradient too ([`crate::Exchange::push_pull_in_place`]), whose
    /// [`RawBytes`] must come from the same pointer.
    pub(crate) fn from_raw(ptr: *mut u8, len: usize, wire16: bool) -> RawDst {
        RawDst { ptr, len, wire16 }
    }

    /// # Safety
    /// The slice must still be borrowed by the Exchange that lent it, with
    /// no other access to it meanwhile.
    unsafe fn slice_mut<'s>(&self, at: usize, len: usize) -> Dst<'s> {
        assert!(at + len <= self.len, "chunk outside the lent output");
        // SAFETY: in bounds (checked above; an f32 output's pointer came
        // from an f32 slice, so it is aligned for f32); live and
        // exclusively ours per this function's contract.
        unsafe {
            if self.wire16 {
                Dst::Wire16(std::slice::from_raw_parts_mut(self.ptr.add(at * 2), len * 2))
            } else {
                Dst::F32(std::slice::from_raw_parts_mut(
                    self.ptr.cast::<f32>().add(at),
                    len,
                ))
            }
        }
    }
}

// SAFETY: the pointers are lent by an Exchange, which does not let the
// borrowed buffers go (or be touched by the caller) before every request
// using them has ended; until then only the I/O thread uses them (reads
// of the gradient, writes of the output).
unsafe impl Send for RawBytes {}
// SAFETY: as for RawBytes.
unsafe impl Send for RawDst {}
