//! A request's chunks as they go out and its results as they come back
//! by shared memory: one datagram per chunk encoded into one buffer
//! (`messages`), headers for a lent gradient (`push_headers`), chunks
//! staged into the shared-memory regions (`staged`), and a direct
//! request's results copied out of the result regions (`copy_out`).

use std::sync::{Arc, PoisonError};

use phub_proto::layout::Place;
use phub_proto::wire::{Header, MsgType, Repr, HEADER_LEN};

use crate::elem::{Dst, Src, ValueType};
use crate::shm::Regions;
use crate::transport::{ChunkMsg, Sink, Tx};
use crate::worker::Worker;

/// A request as encoded for the I/O thread: its chunks, where their
/// datagrams come from and where their results go.
#[derive(Debug)]
pub(crate) struct Encoded {
    pub(crate) chunks: Vec<ChunkMsg>,
    pub(crate) tx: Tx,
    pub(crate) sink: Sink,
}

/// A key's chunks staged into a shared-memory mapping: the chunks, their
/// headers (HEADER_LEN bytes each, chunk c's at c * HEADER_LEN) and the
/// mapping their payloads are in.
#[derive(Debug)]
pub(crate) struct StagedChunks {
    chunks: Vec<ChunkMsg>,
    headers: Vec<u8>,
    regions: Arc<Regions>,
}

/// What a staged request's chunks carry.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StagedValues<'p> {
    /// These values (none for a request that carries no values), copied
    /// into the staging regions here.
    Copy(Option<Src<'p>>),
    /// The values the caller already wrote into the staging regions
    /// ([`Worker::stage`]): every chunk carries its full length.
    InPlace,
}

impl Worker {
    /// A request's chunks, datagrams and result buffer (of `ty`): staged
    /// into the shared-memory mapping in use when there is one
    /// ([`Worker::staged`]), encoded into datagrams otherwise. `key` is
    /// claimed.
    pub(crate) fn prepare(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        payload: Option<Src<'_>>,
        ty: ValueType,
    ) -> Encoded {
        if let Some(staged) = self.staged(key, elements, kind, round, payload) {
            return self.staged_request(key, elements, ty, staged);
        }
        let (chunks, buf) = self.messages(key, elements, kind, round, payload);
        Encoded {
            chunks,
            tx: Tx::Owned(buf),
            sink: Sink::Owned(self.keys.take_values(key, elements, ty)),
        }
    }

    /// A staged request's transmit side (headers, the chunks in their
    /// mapping) and its result sink (read from the result regions by
    /// `wait`; results that come as datagrams in a buffer of `ty`).
    pub(crate) fn staged_request(
        &self,
        key: u32,
        elements: usize,
        ty: ValueType,
        staged: StagedChunks,
    ) -> Encoded {
        let StagedChunks {
            chunks,
            headers,
            regions,
        } = staged;
        let in_region = vec![false; chunks.len()];
        let tx = Tx::Staged {
            headers,
            regions: Arc::clone(&regions),
            size: self.spec.dtype.size(),
            copied: Vec::new(),
        };
        let sink = Sink::Direct {
            values: self.keys.take_values(key, elements, ty),
            regions,
            in_region,
        };
        Encoded { chunks, tx, sink }
    }

    /// With shared memory mapped: writes every chunk of `payload` (in the
    /// wire type) into this rank's staging region of the mapping in use,
    /// at the chunk's slot, and emits the headers (HEADER_LEN bytes each,
    /// chunk c's at c * HEADER_LEN; the I/O thread sets [`flags::SHM`]
    /// when it sends them, or copies the chunk elsewhere if the mapping
    /// changed meanwhile). Returns the chunks, the headers and the
    /// mapping; `None` (nothing staged that matters) without a mapping.
    ///
    /// `key` must be claimed: then no request of the key is in flight, so
    /// this rank holds the result of every chunk of its previous round,
    /// and no lcore reads this rank's staged chunks of that round again
    /// (an lcore may read a chunk as late as the round's second
    /// contribution, but never after the round's result went out); only
    /// requests of this key write them. After a failed request (timeout)
    /// a round this rank never got the result of may still complete with
    /// what is written now: that changes only this rank's own
    /// contribution, which the retry sends anyway.
    ///
    /// [`flags::SHM`]: phub_proto::wire::flags::SHM
    pub(crate) fn staged(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        payload: Option<Src<'_>>,
    ) -> Option<StagedChunks> {
        let regions = self.current_regions()?;
        self.staged_in(key, elements, kind, round, StagedValues::Copy(payload), regions)
    }

    /// The shared-memory mapping in use, if any.
    pub(crate) fn current_regions(&self) -> Option<Arc<Regions>> {
        self.shm
            .as_ref()?
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// [`Worker::staged`] of `values` into `regions`.
    pub(crate) fn staged_in(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        values: StagedValues<'_>,
        regions: Arc<Regions>,
    ) -> Option<StagedChunks> {
        let dtype = self.spec.dtype;
        let places = self.places(key);
        let mut buf = self.keys.take_tx(key, places.len() * HEADER_LEN);
        let mut chunks = Vec::with_capacity(places.len());
        let payload = match values {
            StagedValues::Copy(payload) => payload,
            StagedValues::InPlace => None,
        };
        for (c, place) in places.iter().enumerate() {
            let (len, values_c) = self.chunk_values(payload, elements, c);
            if let Some(v) = values_c {
                if !regions.write_values(place.lcore, place.slot, v) {
                    // The regions were opened for this layout: not expected.
                    log::warn!(
                        "phub-worker: key {key} chunk {c}: slot {} of lcore {} is not in the shared-memory \
                         regions; sending datagrams",
                        place.slot,
                        place.lcore
                    );
                    return None;
                }
            }
            let count = match values {
                StagedValues::InPlace => len as usize,
                StagedValues::Copy(_) => values_c.map_or(0, Src::len),
            };
            let start = c * HEADER_LEN;
            let repr = self.chunk_repr(kind, round, key, c, place.slot, count);
            repr.emit(&mut Header::new_unchecked(&mut buf[start..start + HEADER_LEN]));
            chunks.push(self.chunk_msg(c, place, len, start, HEADER_LEN + count * dtype.size()));
        }
        Some(StagedChunks {
            chunks,
            headers: buf,
            regions,
        })
    }

    /// Copies a request's results out of `sink` into `out`: an owned
    /// buffer's at once; a direct request's chunk by chunk, from the result
    /// region of its lcore when it is there, from the buffer otherwise. A
    /// direct request's key is still claimed (its waiter holds the claim),
    /// so this rank has not pushed the next round of any of its chunks and
    /// no lcore can have written another result into those slots.
    pub(crate) fn copy_out(&self, key: u32, sink: &Sink, mut out: Dst<'_>) {
        let (values, regions, in_region) = match sink {
            Sink::Owned(values) => return out.copy_from(values.as_src()),
            Sink::Direct {
                values,
                regions,
                in_region,
            } => (values, regions, in_region),
            Sink::Borrowed(_) => unreachable!("a lent output is written by the I/O thread, never copied out"),
        };
        let ce = self.layout().chunk_elems as usize;
        let mut scratch = Vec::new();
        for (c, place) in self.places(key).iter().enumerate() {
            let start = c * ce;
            let end = start + self.layout().chunk_len(out.len() as u64, chunk_index(c)) as usize;
            let dst = out.range(start, end);
            if in_region[c] {
                let read = regions.read_result(place.lcore, place.slot, dst, &mut scratch, true);
                // The I/O thread checked the slot (`Regions::holds_result`).
                assert!(read, "key {key} chunk {c}: result slot outside its region");
            } else {
                dst.copy_from(values.as_src().range(start, end - start));
            }
        }
    }

    /// Chunk `c` of a key of `elements` elements: its length, and its values
    /// in `payload` (none for a request that carries no values).
    pub(crate) fn chunk_values<'p>(
        &self,
        payload: Option<Src<'p>>,
        elements: usize,
        c: usize,
    ) -> (u32, Option<Src<'p>>) {
        let len = self.layout().chunk_len(elements as u64, chunk_index(c));
        let offset = c * self.layout().chunk_elems as usize;
        (len, payload.map(|p| p.range(offset, len as usize)))
    }

    /// Chunk `c` of a key, at `place`, with `len` elements; its datagram is
    /// `bytes` long at `start` in the request's buffer.
    pub(crate) fn chunk_msg(
        &self,
        c: usize,
        place: &Place,
        len: u32,
        start: usize,
        bytes: usize,
    ) -> ChunkMsg {
        ChunkMsg {
            chunk: chunk_index(c),
            slot: place.slot,
            offset: c * self.layout().chunk_elems as usize,
            len,
            to: self.lcores[usize::from(place.lcore)],
            lcore: place.lcore,
            start,
            bytes,
        }
    }

    /// The header of chunk `chunk` of `key` in slot `slot`, from this
    /// worker, announcing `count` elements.
    pub(crate) fn chunk_repr(
        &self,
        kind: MsgType,
        round: u32,
        key: u32,
        chunk: usize,
        slot: u32,
        count: usize,
    ) -> Repr {
        // Cast: a chunk holds at most chunk_elems <= MAX_PAYLOAD / size
        // elements (checked at join, `check_join`), under 2^16.
        #[allow(clippy::cast_possible_truncation)]
        let count = count as u16;
        Repr::request(kind, self.job, self.token, self.rank, round, slot)
            .with_payload(self.spec.dtype, count)
            .with_chunk(key, chunk_index(chunk))
    }

    /// Encodes one datagram per chunk of `key`, all into one buffer (the
    /// key's buffer from its previous request when it has the right size).
    pub(crate) fn messages(
        &self,
        key: u32,
        elements: usize,
        kind: MsgType,
        round: u32,
        payload: Option<Src<'_>>,
    ) -> (Vec<ChunkMsg>, Vec<u8>) {
        let dtype = self.spec.dtype;
        let places = self.places(key);
        let total: usize = (0..places.len())
            .map(|c| {
                let count = self.chunk_values(payload, elements, c).1.map_or(0, Src::len);
                HEADER_LEN + count * dtype.size()
            })
            .sum();
        let mut buf = self.keys.take_tx(key, total);
        let mut start = 0;
        let chunks = places
            .iter()
            .enumerate()
            .map(|(c, place)| {
                let (len, values) = self.chunk_values(payload, elements, c);
                let count = values.map_or(0, Src::len);
                let bytes = HEADER_LEN + count * dtype.size();
                let datagram = &mut buf[start..start + bytes];
                let repr = self.chunk_repr(kind, round, key, c, place.slot, count);
                let mut h = Header::new_unchecked(datagram);
                repr.emit(&mut h);
                if let Some(v) = values {
                    v.encode(dtype, h.payload_mut());
                }
                let m = self.chunk_msg(c, place, len, start, bytes);
                start += bytes;
                m
            })
            .collect();
        (chunks, buf)
    }

    /// The headers of a PUSH of every chunk of `key` (HEADER_LEN bytes each,
    /// chunk c's at c * HEADER_LEN), for payloads sent from the caller's
    /// own elements (already the wire's: see [`Src::wire_bytes`]).
    pub(crate) fn push_headers(&self, key: u32, elements: usize, round: u32) -> (Vec<ChunkMsg>, Vec<u8>) {
        let places = self.places(key);
        let mut buf = self.keys.take_tx(key, places.len() * HEADER_LEN);
        let chunks = places
            .iter()
            .enumerate()
            .map(|(c, place)| {
                let len = self.layout().chunk_len(elements as u64, chunk_index(c));
                let start = c * HEADER_LEN;
                let repr = self.chunk_repr(MsgType::Push, round, key, c, place.slot, len as usize);
                repr.emit(&mut Header::new_unchecked(&mut buf[start..start + HEADER_LEN]));
                self.chunk_msg(
                    c,
                    place,
                    len,
                    start,
                    HEADER_LEN + len as usize * self.spec.dtype.size(),
                )
            })
            .collect();
        (chunks, buf)
    }
}

/// Chunk `c` of a key as the wire numbers it.
pub(crate) fn chunk_index(c: usize) -> u32 {
    // Cast: a layout numbers a key's chunks with u32 (the header's chunk
    // field), so every index it yields fits.
    #[allow(clippy::cast_possible_truncation)]
    let c = c as u32;
    c
}
