//! A job's shared-memory regions on one lcore (PROTOCOL.md §3.4): what a
//! kernel-UDP dataplane started with `--shm` gives each job, so that workers
//! on its host pass chunks through `/dev/shm` and send only headers.
//!
//! Names, offsets and lengths are [`phub_proto::shm`]'s; the mappings are
//! [`ShmRegion`]s, created here (mode 0600) and unlinked when the
//! [`JobRegions`] is dropped, that is when the job is removed from the lcore
//! or the lcore stops.
//!
//! Who touches what, and when (the protocol's order, §5 and §6.1):
//! - rank `r`'s staging region is written by that rank's worker alone; the
//!   lcore reads chunk `s` of it ([`Staging::staged`]) after receiving a
//!   PUSH or INIT with SHM for slot `s` and before sending that round's
//!   result: while handling it, or (a round's first contribution to an f32
//!   sum/mean slot, deferred) while handling the round's second
//!   contribution. The worker sends the message after writing the chunk
//!   and may write it again only once it holds that round's result;
//! - the result region is written by the lcore alone
//!   ([`JobRegions::publish`], or in place through
//!   [`JobRegions::result_mut`]), once per completed round, before the RESULT
//!   headers leave; a worker reads chunk `s` after receiving such a header and
//!   before it pushes the next round, which is needed before the lcore writes
//!   chunk `s` again. In between, the lcore reads the chunk itself
//!   ([`JobRegions::result`]): for f32 sum/mean jobs it is the slot's stored
//!   result, which resends and PULL answers carry.
//!
//! The system calls that carry the datagrams order the memory accesses
//! between the processes.
//!
//! What a misbehaving worker can do: the regions are files of the
//! dataplane's user, so only processes of that user (who can signal or trace
//! the dataplane anyway) open them. A worker that writes its staging chunk
//! while the lcore sums it only garbles its own contribution to that round:
//! the lcore reads the bytes as element values and nothing else (no length,
//! index or control decision comes from them). One that shrinks a region
//! file makes the lcore's next read of it fault (SIGBUS).

use std::path::Path;

use phub_net::shm::ShmRegion;
use phub_proto::layout::SlotChunk;
use phub_proto::shm::{region_len, region_path, slot_offset, Part};
use phub_proto::Dtype;

/// Whose regions to make: a job as one lcore holds it.
#[derive(Debug, Clone, Copy)]
pub struct RegionsOf<'a> {
    /// Job id.
    pub id: u16,
    /// Job token (its hash names the files).
    pub token: u64,
    /// Worker count: one staging region per rank.
    pub workers: u16,
    /// Element type on the wire.
    pub dtype: Dtype,
    /// The job's chunks on this lcore, in slot order.
    pub slots: &'a [SlotChunk],
}

/// How an lcore lays out and names a job's regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmSetup {
    /// The dataplane's base UDP port (part of every region's name).
    pub base_port: u16,
    /// Elements in a full chunk of the job (the layout's `chunk_elems`):
    /// slot `s` starts at [`slot_offset`]`(s, chunk_elems, dtype)`.
    pub chunk_elems: u32,
}

/// One job's regions on one lcore: a staging region per rank and a result
/// region, each one chunk stride per slot of the job on this lcore. A job
/// with no slots on the lcore has no files (a region cannot be empty), but
/// still counts as set up for shared memory.
#[derive(Debug)]
pub struct JobRegions {
    dtype: Dtype,
    chunk_elems: u32,
    /// Indexed by rank; empty when the job has no slots here.
    staging: Vec<ShmRegion>,
    /// `None` when the job has no slots here.
    results: Option<ShmRegion>,
}

/// The staging regions of a job, read-only, borrowed apart from its result
/// region (see [`JobRegions::result_mut`]).
#[derive(Debug, Clone, Copy)]
pub struct Staging<'a> {
    dtype: Dtype,
    chunk_elems: u32,
    /// Indexed by rank.
    regions: &'a [ShmRegion],
}

impl<'a> Staging<'a> {
    /// The `len` bytes of `rank`'s chunk for `slot` in its staging region,
    /// read in place; `None` when they are not all inside the region.
    ///
    /// Call only after receiving that rank's PUSH or INIT with SHM for the
    /// slot, and let the slice go before the RESULT for that round can be
    /// sent: that is the window in which the protocol keeps the worker from
    /// writing the chunk (module docs).
    pub fn staged(self, rank: u16, slot: u32, len: usize) -> Option<&'a [u8]> {
        let region = self.regions.get(usize::from(rank))?;
        let p = region.ptr(slot_offset(slot, self.chunk_elems, self.dtype), len)?;
        // SAFETY: `p..p + len` lies inside the mapping (`ptr` checked it),
        // which stays mapped while the regions are borrowed (it is unmapped
        // only when the region is dropped); the bytes are initialised (a
        // zero-filled file mapping) and `u8` has no alignment or validity
        // requirement. This process never writes a staging region. The
        // rank's worker does not write this chunk between sending the
        // message being handled and receiving its round's result, which
        // the caller does not let happen while the slice lives (see
        // above); a worker breaking that rule can only change
        // the element values read for its own contribution (module docs).
        Some(unsafe { std::slice::from_raw_parts(p, len) })
    }
}

/// Creates a region, or adopts a file of the same name left by a dataplane
/// on this port that did not stop cleanly (the name carries the base port,
/// the job and a tag of its token; a job restored from its checkpoint keeps
/// its token): when the file is this user's, mode 0600 and of the right
/// length it is kept with its contents, so workers that mapped it before
/// the crash go on without noticing; any other file there is replaced.
fn create(path: &Path, len: usize) -> Result<ShmRegion, String> {
    let (r, adopted) = ShmRegion::create_or_adopt(path, len).map_err(|e| e.to_string())?;
    if adopted {
        log::warn!(
            "adopting the shared-memory region {} left by an earlier run",
            path.display()
        );
    }
    Ok(r)
}

impl JobRegions {
    /// Creates the regions of `job` on `lcore`, all or none (what was
    /// created is removed again on failure). Fails when a file cannot be
    /// created or sized, or when a slot is longer than `setup.chunk_elems`.
    pub fn create(setup: ShmSetup, lcore: u16, job: RegionsOf<'_>) -> Result<JobRegions, String> {
        if let Some((i, s)) = job
            .slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.elems > setup.chunk_elems)
        {
            return Err(format!(
                "slot {i} has {} elements, more than the chunk length {} the regions are laid out for",
                s.elems, setup.chunk_elems
            ));
        }
        let mut regions = JobRegions {
            dtype: job.dtype,
            chunk_elems: setup.chunk_elems,
            staging: Vec::new(),
            results: None,
        };
        if job.slots.is_empty() {
            return Ok(regions);
        }
        let len = region_len(job.slots.len(), setup.chunk_elems, job.dtype);
        let path = |part| region_path(setup.base_port, job.id, job.token, lcore, part);
        regions.staging.reserve_exact(usize::from(job.workers));
        for rank in 0..job.workers {
            // On failure `regions` is dropped: the files made so far go.
            regions.staging.push(create(&path(Part::Staging(rank)), len)?);
        }
        regions.results = Some(create(&path(Part::Results), len)?);
        Ok(regions)
    }

    /// Where slot `slot`'s chunk starts in every region.
    fn offset(&self, slot: u32) -> usize {
        slot_offset(slot, self.chunk_elems, self.dtype)
    }

    /// The staging regions alone.
    pub fn staging(&self) -> Staging<'_> {
        Staging {
            dtype: self.dtype,
            chunk_elems: self.chunk_elems,
            regions: &self.staging,
        }
    }

    /// The `len` bytes of `slot`'s chunk in the result region, read in
    /// place; `None` when the job has no regions here or the bytes do not
    /// fit the slot's chunk.
    pub fn result(&self, slot: u32, len: usize) -> Option<&[u8]> {
        let p = self.result_ptr(slot, len)?;
        // SAFETY: `p..p + len` lies inside the mapping (`result_ptr`
        // checked it), mapped while `self` is borrowed; the bytes are
        // initialised (a file mapping) and `u8` has no alignment or validity
        // requirement. This process writes the result region only through
        // `&mut self` (`publish`, `result_mut`), so not while the slice
        // lives. Workers only read it (module docs); one that writes it
        // anyway can only change the element values a later RESULT
        // carries, values it could have pushed itself.
        Some(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// `slot`'s chunk of the result region as `n` `f32`s to write in place
    /// (the wire's little-endian layout on this little-endian host),
    /// together with the staging regions to read from meanwhile; `None`
    /// when the job has no regions here or the chunk does not fit the
    /// slot's stride.
    ///
    /// Write only while completing a round of the slot, before its RESULT
    /// headers leave: every rank has then pushed that round, so every rank
    /// has copied the previous round's result out of the chunk already
    /// (module docs).
    pub fn result_mut(&mut self, slot: u32, n: usize) -> Option<(Staging<'_>, &mut [f32])> {
        let p = self.result_ptr(slot, n.checked_mul(4)?)?;
        // Every chunk starts a whole number of 64-byte strides into a
        // page-aligned mapping.
        if !p.cast::<f32>().is_aligned() {
            return None;
        }
        // SAFETY: the `4 * n` bytes at `p` lie inside the mapping
        // (`result_ptr` checked it), which stays mapped while `self` is
        // borrowed; `p` is aligned for `f32` (checked above) and any bit
        // pattern is an `f32`. `&mut self` makes this the only reference
        // into the result region in this process; the staging regions
        // handed out with it are other mappings. No worker reads the chunk
        // while the caller writes it (the rule above), and one that breaks
        // the rule only reads values of its own job half written.
        let out = unsafe { std::slice::from_raw_parts_mut(p.cast::<f32>(), n) };
        Some((self.staging(), out))
    }

    /// The address of `slot`'s chunk in the result region, when `len` bytes
    /// of it fit the slot's stride and the region.
    fn result_ptr(&self, slot: u32, len: usize) -> Option<*mut u8> {
        let stride = phub_proto::shm::chunk_stride(self.chunk_elems, self.dtype);
        if len > stride {
            return None;
        }
        self.results.as_ref()?.ptr(self.offset(slot), len)
    }

    /// Writes a completed round's result (wire bytes) for `slot` into the
    /// result region; `false` (nothing written) when the job has no
    /// regions here or the bytes do not fit the slot.
    pub fn publish(&mut self, slot: u32, bytes: &[u8]) -> bool {
        // `result_ptr` checks the stride and the region's bounds.
        self.result_ptr(slot, bytes.len()).is_some()
            && self
                .results
                .as_ref()
                .is_some_and(|r| r.write(self.offset(slot), bytes))
    }

    /// The files, staging regions in rank order, then the result region.
    pub fn paths(&self) -> impl Iterator<Item = &Path> + '_ {
        self.staging.iter().chain(&self.results).map(ShmRegion::path)
    }
}
