//! Pushes whose values the caller writes in place, straight into this
//! rank's shared-memory staging regions ([`Worker::stage`]).
//!
//! [`Worker::push_pull`] copies the caller's values into the staging region
//! itself. A caller whose values are produced elsewhere (a GPU: a
//! device-to-host copy can land in the staging region directly once that
//! memory is registered with the device's driver) saves that copy: it
//! claims the key with [`Worker::stage`], writes the key's values, in the
//! job's wire type, into the spans [`Staged::spans`] names (each a run of
//! the key's elements contiguous in one lcore's staging region), and hands
//! the claim to [`Worker::push_pull_staged`] (or [`Worker::push_staged`], for
//! results read in place), which sends only the headers.
//!
//! The claim is what makes writing safe: while a key is claimed no request
//! of it is in flight, so this rank holds the result of every chunk of its
//! previous round and no lcore reads this rank's staged chunks of that round
//! again (the rule [`Worker::push_pull`] stages by). A `Staged` dropped
//! without being pushed gives the claim back. The mapping its spans point
//! into stays mapped while the `Staged` (or a [`StagingMemory`] taken from
//! it) lives, even if the dataplane replaces its regions meanwhile; a push
//! staged into a replaced mapping is copied from it, as any staged request.

use std::sync::Arc;

use phub_proto::wire::MsgType;

use crate::elem::{Dst, Element, Src, ValueType, Values};
use crate::encode::{chunk_index, StagedValues};
use crate::error::WorkerError;
use crate::io::Done;
use crate::keys::KeyClaim;
use crate::shm::Regions;
use crate::transport::{Kind, Sink};
use crate::worker::{recv, Handle, Worker};

/// A run of a key's elements that lies contiguous in one region (or, for
/// [`Results`], in the buffer of results that came as datagrams).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingSpan {
    /// The key's element the span starts with.
    pub first: usize,
    /// Elements in the span.
    pub elements: usize,
    /// The address where the span's bytes start, inside the mapping of the
    /// [`Staged`] it came from.
    addr: usize,
    /// Bytes in the span.
    bytes: usize,
}

impl StagingSpan {
    /// The address of the span's first byte, for a caller that copies by
    /// other means (a device copy). A [`Staged`]'s span: valid while the
    /// `Staged` or a [`StagingMemory`] of its mapping lives, to be written
    /// only while the `Staged` holds the key. A [`Results`]' span: valid,
    /// and to be read only, while the `Results` lives (a span of results
    /// that came as datagrams is in its buffer, not in the mapping).
    pub fn address(&self) -> usize {
        self.addr
    }

    /// The span's length in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A key's spans, built chunk by chunk in the key's order: a chunk that
/// starts where the previous one ended, in the same place (a region, or
/// the buffer of results that came as datagrams), extends its span.
struct Spans<P> {
    spans: Vec<StagingSpan>,
    /// The place of the last chunk and the offset where it ends there.
    end: Option<(P, usize)>,
}

impl<P: PartialEq + Copy> Spans<P> {
    fn new() -> Spans<P> {
        Spans {
            spans: Vec::new(),
            end: None,
        }
    }

    /// The chunk of `elements` elements (`bytes` long) starting with the
    /// key's element `first`, at `addr`: offset `at` in `place`.
    fn add(&mut self, place: P, at: usize, addr: usize, first: usize, elements: usize, bytes: usize) {
        match (self.spans.last_mut(), self.end) {
            (Some(s), Some((p, end))) if p == place && end == at => {
                s.elements += elements;
                s.bytes += bytes;
            }
            _ => self.spans.push(StagingSpan {
                first,
                elements,
                addr,
                bytes,
            }),
        }
        self.end = Some((place, at + bytes));
    }
}

/// This rank's staging regions of one mapping, kept mapped while this
/// lives: what a caller registers with a device driver (e.g. CUDA's
/// `cudaHostRegister`) so that device copies land in them directly.
#[derive(Debug, Clone)]
pub struct StagingMemory(Arc<Regions>);

impl StagingMemory {
    /// Start address and length in bytes of each staging region (one per
    /// lcore the job has chunks on).
    pub fn regions(&self) -> Vec<(usize, usize)> {
        self.0
            .staging_memory()
            .into_iter()
            .map(|(p, len)| (p as usize, len))
            .collect()
    }

    /// Whether `other` keeps the same mapping alive.
    pub fn same(&self, other: &StagingMemory) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Start address and length in bytes of each lcore's result region of
    /// this mapping (what [`Results::spans`] point into, mostly).
    pub fn result_regions(&self) -> Vec<(usize, usize)> {
        self.0
            .result_memory()
            .into_iter()
            .map(|(p, len)| (p as usize, len))
            .collect()
    }
}

/// A request's results left where they arrived ([`Worker::wait_in_place`]):
/// in the lcores' result regions, or (chunks that came as datagrams) in a
/// buffer this holds. While results are in the regions the key stays
/// claimed as long as this lives, so no lcore writes another result over
/// them; dropping it gives the key back.
pub struct Results<'a> {
    worker: &'a Worker,
    key: u32,
    round: u32,
    spans: Vec<StagingSpan>,
    /// The results that came as datagrams (and the buffer for the key's
    /// next request, given back when dropped).
    values: Option<Values>,
    /// For a direct request, the mapping whose result regions hold the
    /// others.
    regions: Option<Arc<Regions>>,
    /// Holds the key while results are in the regions.
    claim: Option<KeyClaim>,
}

impl std::fmt::Debug for Results<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Results")
            .field("key", &self.key)
            .field("round", &self.round)
            .field("spans", &self.spans)
            .finish()
    }
}

impl Results<'_> {
    /// The key.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// The round they are the result of.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Where the key's results are: its elements in order, run by run, in
    /// the wire type (little-endian `f32`, or the job's 16-bit type).
    pub fn spans(&self) -> &[StagingSpan] {
        &self.spans
    }

    /// The mapping of the result regions the spans point into (none when
    /// every result came as a datagram), kept mapped by what this returns.
    pub fn memory(&self) -> Option<StagingMemory> {
        self.regions.as_ref().map(|r| StagingMemory(Arc::clone(r)))
    }

    /// Span `i`'s bytes.
    pub fn span(&self, i: usize) -> Option<&[u8]> {
        let s = self.spans.get(i)?;
        // SAFETY: the span lies in a result region of `self.regions`
        // (mapped while `self` lives) or in `self.values`, checked
        // when it was made; the key is claimed while `self` lives, so no
        // lcore writes these results again (module docs) and the worker
        // writes `values` only for a request of the key.
        Some(unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.bytes) })
    }
}

impl Drop for Results<'_> {
    fn drop(&mut self) {
        if let Some(v) = self.values.take() {
            self.worker.keys.keep_values(self.key, v);
        }
        // Frees the key.
        self.claim = None;
    }
}

/// A key claimed for a push whose values are written in place
/// ([`Worker::stage`]); pushed with [`Worker::push_pull_staged`], or given
/// back when dropped.
#[must_use = "a staged key is pushed with Worker::push_pull_staged; dropping it gives the key back"]
pub struct Staged<'a> {
    worker: &'a Worker,
    key: u32,
    round: u32,
    elements: usize,
    regions: Arc<Regions>,
    spans: Vec<StagingSpan>,
    /// Still holds the key (not handed to a request).
    claimed: bool,
}

impl std::fmt::Debug for Staged<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("key", &self.key)
            .field("round", &self.round)
            .field("spans", &self.spans)
            .finish()
    }
}

impl Staged<'_> {
    /// The key.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// The round (or clock) the push will carry.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Where the key's values go: its elements in order, run by run.
    pub fn spans(&self) -> &[StagingSpan] {
        &self.spans
    }

    /// The mapping the spans point into, kept mapped by what this returns.
    pub fn memory(&self) -> StagingMemory {
        StagingMemory(Arc::clone(&self.regions))
    }

    /// Span `i`'s bytes, to write the values of its elements into as the
    /// wire carries them (little-endian `f32`, or the job's 16-bit type).
    pub fn span_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        let s = self.spans.get(i)?;
        // SAFETY: the span lies inside a staging region of `self.regions`
        // (checked when it was made), mapped while `self` lives; this rank
        // alone writes its staging regions, and only for a claimed key,
        // which `self` holds, so nothing else in this process writes these
        // bytes, and no lcore reads them before the push (module docs);
        // `&mut self` keeps this the only reference made through `self`.
        Some(unsafe { std::slice::from_raw_parts_mut(s.addr as *mut u8, s.bytes) })
    }

    /// Writes the key's values (`values.len()` = the key's length) into its
    /// spans, encoding `f32` for a 16-bit job; the one copy
    /// [`Worker::push_pull`] would make.
    pub fn write<E: Element>(&mut self, values: &[E]) -> Result<(), WorkerError> {
        self.worker.check_elem::<E>()?;
        if values.len() != self.elements {
            return Err(WorkerError::Length {
                key: self.key,
                expected: self.elements as u64,
                got: values.len(),
            });
        }
        let dtype = self.worker.spec.dtype;
        let src = Src::of(values);
        for i in 0..self.spans.len() {
            let s = self.spans[i];
            let part = src.range(s.first, s.elements);
            let dst = self.span_mut(i).expect("a span of this key");
            match part.wire_bytes(dtype) {
                Some(wire) => dst.copy_from_slice(wire),
                None => part.encode(dtype, dst),
            }
        }
        Ok(())
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        if self.claimed {
            self.worker.keys.release(self.key);
        }
    }
}

impl Worker {
    /// Claims `key` for its next push and says where its values go in this
    /// rank's shared-memory staging regions, for a caller that writes them
    /// there itself (see the module docs of `staged`); `None` when this
    /// worker has no shared-memory mapping (it sends datagrams: use
    /// [`Worker::push_pull`]). Errors as [`Worker::push_pull`] does for an
    /// unknown or busy key.
    pub fn stage(&self, key: u32) -> Result<Option<Staged<'_>>, WorkerError> {
        let elements = self.key_len(key).ok_or(WorkerError::UnknownKey {
            key,
            keys: self.spec.keys.len(),
        })?;
        // Cast: a key's elements are in memory on both sides.
        #[allow(clippy::cast_possible_truncation)]
        let elements = elements as usize;
        let Some(regions) = self.current_regions() else {
            return Ok(None);
        };
        let round = self.claim_next_round(key)?;
        let size = self.spec.dtype.size();
        // Chunks of the key in order, each at its lcore's slot (slots in a
        // row of chunks a multiple of 64 bytes make one span).
        let mut spans = Spans::new();
        for (c, place) in self.places(key).iter().enumerate() {
            let len = self.layout().chunk_len(elements as u64, chunk_index(c)) as usize;
            let first = c * self.layout().chunk_elems as usize;
            let Some((ptr, at)) = regions.staging_ptr(place.lcore, place.slot, len * size) else {
                // The regions were opened for this layout: not expected.
                self.keys.release(key);
                log::warn!(
                    "phub-worker: key {key} chunk {c}: slot {} of lcore {} is not in the shared-memory regions",
                    place.slot,
                    place.lcore
                );
                return Ok(None);
            };
            spans.add(place.lcore, at, ptr as usize, first, len, len * size);
        }
        Ok(Some(Staged {
            worker: self,
            key,
            round,
            elements,
            regions,
            spans: spans.spans,
            claimed: true,
        }))
    }

    /// Pushes a key whose values `staged` holds (written into its spans)
    /// and pulls the round's result into `out`, as [`Worker::push_pull`]
    /// does with values it copies itself: [`Worker::wait`] on the handle
    /// writes `out`.
    pub fn push_pull_staged<'a, E: Element>(
        &'a self,
        staged: Staged<'a>,
        out: &'a mut [E],
    ) -> Result<Handle<'a>, WorkerError> {
        self.check_staged(&staged)?;
        self.check_elem::<E>()?;
        self.check_len(staged.key, out.len())?;
        self.submit_staged(staged, ValueType::of::<E>(), Some(Dst::of(out)))
    }

    /// Pushes a key whose values `staged` holds, for a caller that reads
    /// the round's results where they arrive: the handle can only be
    /// waited with [`Worker::wait_in_place`] ([`Worker::wait`] on it is an
    /// error that lets the results go), so no output of the key's length
    /// is needed. Results that come as datagrams (chunks the regions do not
    /// hold) land in a buffer of the job's wire type the worker keeps.
    pub fn push_staged<'a>(&'a self, staged: Staged<'a>) -> Result<Handle<'a>, WorkerError> {
        self.check_staged(&staged)?;
        self.submit_staged(staged, ValueType::wire(self.spec.dtype), None)
    }

    fn check_staged(&self, staged: &Staged<'_>) -> Result<(), WorkerError> {
        if std::ptr::eq(staged.worker, self) {
            return Ok(());
        }
        Err(WorkerError::Sequence {
            key: staged.key,
            message: "staged by another worker: push it with the worker that staged it".into(),
        })
    }

    /// Sends a staged key's headers; datagram results go into a buffer of
    /// `ty`.
    fn submit_staged<'a>(
        &'a self,
        mut staged: Staged<'a>,
        ty: ValueType,
        out: Option<Dst<'a>>,
    ) -> Result<Handle<'a>, WorkerError> {
        let key = staged.key;
        let (elements, round) = (staged.elements, staged.round);
        let Some(parts) = self.staged_in(
            key,
            elements,
            MsgType::Push,
            round,
            StagedValues::InPlace,
            Arc::clone(&staged.regions),
        ) else {
            // Not expected: `stage` found every slot (dropping `staged`
            // gives the key back).
            return Err(WorkerError::Sequence {
                key,
                message: "its slots are not in the shared-memory regions".into(),
            });
        };
        let encoded = self.staged_request(key, elements, ty, parts);
        // The request holds the key from here on.
        staged.claimed = false;
        self.submit(key, round, Kind::Push, encoded, out)
    }

    /// Waits for a request's results and leaves them where they arrived,
    /// for a caller that copies them out by other means (a GPU's
    /// host-to-device copy from the result regions, registered with its
    /// driver): [`Worker::wait`] without its copy into the request's
    /// output, which is left as it was. The request's output must have
    /// been of the job's wire type (`f32`, or the 16-bit type itself), so
    /// that results that came as datagrams are in it too, or none
    /// ([`Worker::push_staged`]).
    pub fn wait_in_place(&self, h: Handle<'_>) -> Result<Results<'_>, WorkerError> {
        let Done { key, output, claim } = recv(&h.done)?;
        let round = output.round;
        // Per chunk of the key, whether its result is in `regions`.
        let (values, regions, in_region) = match output.sink {
            Sink::Owned(values) => (values, None, Vec::new()),
            Sink::Direct {
                values,
                regions,
                in_region,
            } => (values, Some(regions), in_region),
            Sink::Borrowed(_) => unreachable!("a lent output is written by the I/O thread, never waited"),
        };
        let dtype = self.spec.dtype;
        let size = dtype.size();
        let Some(wire) = values.as_src().wire_bytes(dtype) else {
            self.keys.keep_values(key, values);
            return Err(WorkerError::Sequence {
                key,
                message: format!(
                    "wait_in_place: the request's output was not the job's wire type ({dtype}); use wait"
                ),
            });
        };
        let base = wire.as_ptr() as usize;
        let ce = self.layout().chunk_elems as usize;
        let elements = wire.len() / size;
        // Chunks in order, each where its result is: an lcore's result
        // region, or (`None`) the buffer.
        let mut spans = Spans::new();
        for (c, place) in self.places(key).iter().enumerate() {
            let len = self.layout().chunk_len(elements as u64, chunk_index(c)) as usize;
            let first = c * ce;
            let held = regions.as_ref().filter(|_| in_region[c]);
            let (addr, at, lcore) = if let Some(regions) = held {
                let (p, at) = regions
                    .result_ptr(place.lcore, place.slot, len * size)
                    .expect("the I/O thread checked the slot (Regions::holds_result)");
                (p as usize, at, Some(place.lcore))
            } else {
                (base + first * size, first * size, None)
            };
            spans.add(lcore, at, addr, first, len, len * size);
        }
        Ok(Results {
            worker: self,
            key,
            round,
            spans: spans.spans,
            values: Some(values),
            regions,
            claim,
        })
    }
}
