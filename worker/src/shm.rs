//! Shared memory with a dataplane on this host (PROTOCOL.md §3.4).
//!
//! A kernel-UDP dataplane started with `--shm` creates, per job and lcore,
//! one staging region per rank and one result region in `/dev/shm`
//! ([`phub_proto::shm`] names them and places the chunks). A worker that
//! opened its regions ([`RegionSpec::open`]) writes each chunk's wire bytes
//! into its staging region at the slot's offset and sends the header alone
//! with [`flags::SHM`](phub_proto::wire::flags::SHM); RESULTs with the flag
//! carry no payload either, and the worker reads the result from the
//! lcore's result region at the slot's offset.
//!
//! Who touches the regions: [`Worker::init`](crate::Worker::init),
//! [`Worker::push_pull`](crate::Worker::push_pull) and
//! `push_pull_in_place` encode the caller's values straight into the
//! staging region, on the caller's thread, and
//! [`Worker::wait`](crate::Worker::wait) decodes the results straight out
//! of the result regions into the caller's slice: one copy each way, while
//! the I/O thread only sends and matches headers. The I/O thread itself
//! writes chunks into a new mapping when the regions change (below), stages
//! the lent gradients of [`Worker::exchange`](crate::Worker::exchange), and
//! reads the results of `exchange` and `pull`.
//!
//! [`ShmMode`] chooses: [`ShmMode::Auto`] (the default) uses shared memory
//! when every dataplane address is a loopback address and every region the
//! worker needs opens with the expected length, and datagrams otherwise;
//! [`ShmMode::On`] insists (the join fails, naming the region and the
//! reason); [`ShmMode::Off`] never tries. The environment variable
//! [`SHM_ENV`] (`off`, `auto` or `on`) replaces `Auto`.
//!
//! Writers and readers stay apart by the protocol's order alone: this rank
//! writes a chunk of round r + 1 only after it holds round r's result of
//! that chunk (so the lcore has read round r's bytes, or dropped them as a
//! duplicate), and reads a result only for the round it waits for, which
//! the lcore cannot overwrite before this rank pushes the next round of
//! that chunk. The key's claim enforces both on the caller's side: a key
//! is claimed (busy) from `push_pull` until its request has ended and, when
//! its results are left in the result regions, until `wait` copied them out
//! (or the handle was dropped unread); only a claimed key's chunks are
//! written.
//!
//! A dataplane that restarts (or removes and reinstalls the job) makes new
//! files under the same names, and a chunk written into the old mapping
//! would never reach it. While requests are in flight, the I/O thread
//! checks every few milliseconds that the names still lead to the mapped
//! files ([`Regions::replaced`]); when they do not, it opens the new ones
//! (writing its outstanding chunks into them), and sends datagrams while
//! there are none. The API side stages into the mapping the I/O thread
//! last opened (shared as an `Arc`); a request keeps the mapping it was
//! staged into, so when that is no longer the I/O thread's, its chunks are
//! copied from it into the new staging region or into datagrams, and its
//! results that arrive through another mapping (or as datagrams) go into a
//! buffer of the request, from which `wait` copies them.

use std::net::SocketAddr;

use phub_net::shm::ShmRegion;
use phub_proto::layout::Layout;
use phub_proto::shm::{region_len, region_path, slot_offset, Part};
use phub_proto::wire::MAX_PAYLOAD;
use phub_proto::Dtype;

use crate::elem::{Dst, Src};
use crate::error::WorkerError;

/// The environment variable that replaces [`ShmMode::Auto`]: `off`, `auto`
/// or `on`.
pub const SHM_ENV: &str = "PHUB_WORKER_SHM";

/// Whether a worker exchanges chunks through shared memory with a dataplane
/// on its own host ([`crate::WorkerConfig::shm`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ShmMode {
    /// Datagrams only.
    Off,
    /// Shared memory when the dataplane is on loopback and its regions for
    /// this job open; datagrams otherwise. The default.
    #[default]
    Auto,
    /// Shared memory, or the join fails ([`WorkerError::SharedMemory`]).
    /// Control has counted the rank as joined by then: join again with
    /// [`Worker::rejoin`](crate::Worker::rejoin).
    On,
}

impl ShmMode {
    /// `off`, `auto` or `on`.
    pub fn name(self) -> &'static str {
        match self {
            ShmMode::Off => "off",
            ShmMode::Auto => "auto",
            ShmMode::On => "on",
        }
    }
}

impl std::fmt::Display for ShmMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ShmMode {
    type Err = String;

    fn from_str(s: &str) -> Result<ShmMode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" => Ok(ShmMode::Off),
            "auto" => Ok(ShmMode::Auto),
            "on" => Ok(ShmMode::On),
            _ => Err(format!("{s:?}: accepted: off, auto, on")),
        }
    }
}

/// The mode in effect: `configured`, or with `Auto` what `env` (the value
/// of [`SHM_ENV`]) says when it is set and not empty.
pub(crate) fn effective_mode(configured: ShmMode, env: Option<&str>) -> Result<ShmMode, WorkerError> {
    match (configured, env) {
        (ShmMode::Auto, Some(v)) if !v.trim().is_empty() => {
            v.parse().map_err(|e: String| WorkerError::Config {
                message: format!("{SHM_ENV}={e}"),
            })
        }
        (m, _) => Ok(m),
    }
}

/// A mapped region and the identity of the file it maps.
#[derive(Debug)]
struct Mapped {
    region: ShmRegion,
    /// (device, inode) of the file when it was opened.
    id: (u64, u64),
}

impl Mapped {
    fn open(path: std::path::PathBuf, len: usize) -> Result<Mapped, OpenError> {
        let region = ShmRegion::open(&path, len).map_err(|e| OpenError {
            reason: e.to_string(),
            path: path.clone(),
        })?;
        // Another file may have taken the name since open(2): then the next
        // check finds it replaced, and the regions are opened again.
        let id = file_id(&path).map_err(|e| OpenError {
            reason: format!("stat: {e}"),
            path,
        })?;
        Ok(Mapped { region, id })
    }

    /// Why the name no longer leads to the mapped file, if it does not.
    fn replaced(&self) -> Option<String> {
        let path = self.region.path();
        match file_id(path) {
            Ok(id) if id == self.id => None,
            Ok(_) => Some(format!("{} was replaced by another file", path.display())),
            Err(e) => Some(format!("{}: {e}", path.display())),
        }
    }
}

fn file_id(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// One lcore's regions, as this rank sees them.
#[derive(Debug)]
struct LcoreRegions {
    /// This rank's staging region (written here, read by the lcore).
    staging: Mapped,
    /// The lcore's result region (written by the lcore, read here).
    results: Mapped,
}

/// Which regions a rank of a job needs: everything [`RegionSpec::open`]
/// needs to open them again.
#[derive(Debug, Clone)]
pub(crate) struct RegionSpec {
    base_port: u16,
    job: u16,
    token: u64,
    rank: u16,
    /// The job's slots per lcore of its layout.
    slots: Vec<usize>,
    chunk_elems: u32,
    dtype: Dtype,
}

impl RegionSpec {
    /// The regions of `rank` in a job with `layout`, on a dataplane whose
    /// lcore 0 listens on `base_port`.
    pub(crate) fn new(
        base_port: u16,
        job: u16,
        token: u64,
        rank: u16,
        layout: &Layout,
        dtype: Dtype,
    ) -> RegionSpec {
        RegionSpec {
            base_port,
            job,
            token,
            rank,
            // Cast: a run's slots are numbered by a u32 (checked at join,
            // `Placement::new`), which fits a usize.
            #[allow(clippy::cast_possible_truncation)]
            slots: layout.lcores.iter().map(|r| r.count as usize).collect(),
            chunk_elems: layout.chunk_elems,
            dtype,
        }
    }

    /// Opens this rank's staging region and the result region of every
    /// lcore that holds slots of the job, each checked against the length
    /// its slot count gives.
    pub(crate) fn open(&self) -> Result<Regions, OpenError> {
        let mut lcores = Vec::with_capacity(self.slots.len());
        for (l, &slots) in self.slots.iter().enumerate() {
            if slots == 0 {
                lcores.push(None);
                continue;
            }
            let len = region_len(slots, self.chunk_elems, self.dtype);
            // Cast: one entry per lcore of the layout, whose indexes `check_join`
            // made sure fit u16 (each is a port offset).
            #[allow(clippy::cast_possible_truncation)]
            let l = l as u16;
            let path = |part| region_path(self.base_port, self.job, self.token, l, part);
            lcores.push(Some(LcoreRegions {
                staging: Mapped::open(path(Part::Staging(self.rank)), len)?,
                results: Mapped::open(path(Part::Results), len)?,
            }));
        }
        Ok(Regions {
            lcores,
            chunk_elems: self.chunk_elems,
            dtype: self.dtype,
        })
    }
}

/// The regions of one rank of one job, per lcore.
#[derive(Debug)]
pub(crate) struct Regions {
    /// Per lcore of the layout; `None` where the job has no slot.
    lcores: Vec<Option<LcoreRegions>>,
    chunk_elems: u32,
    dtype: Dtype,
}

/// Why a region could not be used.
#[derive(Debug)]
pub(crate) struct OpenError {
    /// The region's file.
    pub(crate) path: std::path::PathBuf,
    /// The operating system's or the length check's message.
    pub(crate) reason: String,
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = self.path.display().to_string();
        if self.reason.contains(&path) {
            f.write_str(&self.reason)
        } else {
            write!(f, "{path}: {}", self.reason)
        }
    }
}

impl Regions {
    fn lcore(&self, lcore: u16) -> Option<&LcoreRegions> {
        self.lcores.get(usize::from(lcore)).and_then(Option::as_ref)
    }

    /// This rank's staging region of `lcore` and the offset of `slot`'s
    /// chunk in it, when `len` wire bytes fit a chunk.
    fn staging_at(&self, lcore: u16, slot: u32, len: usize) -> Option<(&ShmRegion, usize)> {
        let r = self.lcore(lcore)?;
        (len <= self.chunk_elems as usize * self.dtype.size())
            .then(|| (&r.staging.region, slot_offset(slot, self.chunk_elems, self.dtype)))
    }

    /// Copies one chunk's wire bytes into this rank's staging region of
    /// `lcore` at `slot`'s offset; `false` (nothing written) when they do
    /// not fit there.
    pub(crate) fn write_chunk(&self, lcore: u16, slot: u32, wire: &[u8]) -> bool {
        self.staging_at(lcore, slot, wire.len())
            .is_some_and(|(region, at)| region.write(at, wire))
    }

    /// Encodes `values` (one chunk) into this rank's staging region of
    /// `lcore` at `slot`'s offset, in the job's wire type; `false` (nothing
    /// written) when they do not fit there. `f32` values for a 16-bit job
    /// are encoded into a buffer on the stack first (one chunk, in L1),
    /// then copied; values already in the wire type are copied straight.
    pub(crate) fn write_values(&self, lcore: u16, slot: u32, values: Src<'_>) -> bool {
        if values.len() > self.chunk_elems as usize {
            return false;
        }
        if let Some(wire) = values.wire_bytes(self.dtype) {
            return self.write_chunk(lcore, slot, wire);
        }
        let mut buf = [0u8; MAX_PAYLOAD];
        let Some(wire) = buf.get_mut(..values.len() * self.dtype.size()) else {
            return false;
        };
        values.encode(self.dtype, wire);
        self.write_chunk(lcore, slot, wire)
    }

    /// Where `len` wire bytes of `slot`'s chunk go in this rank's staging
    /// region of `lcore`, and the region's offset of them; `None` when
    /// they do not fit there. Writers through it must hold the chunk's
    /// key (see [`crate::Worker::stage`]).
    pub(crate) fn staging_ptr(&self, lcore: u16, slot: u32, len: usize) -> Option<(*mut u8, usize)> {
        let (region, at) = self.staging_at(lcore, slot, len)?;
        Some((region.ptr(at, len)?, at))
    }

    /// Where `len` wire bytes of `slot`'s result are in the result region
    /// of `lcore`, and the region's offset of them; `None` when they are
    /// not all inside it. Readers through it must hold the chunk's key
    /// (see [`crate::Worker::wait_in_place`]).
    pub(crate) fn result_ptr(&self, lcore: u16, slot: u32, len: usize) -> Option<(*mut u8, usize)> {
        let r = self.lcore(lcore)?;
        if len > self.chunk_elems as usize * self.dtype.size() {
            return None;
        }
        let at = slot_offset(slot, self.chunk_elems, self.dtype);
        Some((r.results.region.ptr(at, len)?, at))
    }

    /// The lcores' result regions: the start and length of each mapping.
    pub(crate) fn result_memory(&self) -> Vec<(*mut u8, usize)> {
        self.lcores
            .iter()
            .flatten()
            .filter_map(|l| {
                let r = &l.results.region;
                Some((r.ptr(0, r.len())?, r.len()))
            })
            .collect()
    }

    /// This rank's staging regions, one per lcore of the job: the start
    /// and length of each mapping.
    pub(crate) fn staging_memory(&self) -> Vec<(*mut u8, usize)> {
        self.lcores
            .iter()
            .flatten()
            .filter_map(|l| {
                let r = &l.staging.region;
                Some((r.ptr(0, r.len())?, r.len()))
            })
            .collect()
    }

    /// Copies back one chunk's wire bytes (`dst.len()`) from this rank's
    /// staging region of `lcore` at `slot`'s offset; `false` (nothing read)
    /// when the region has no such slot.
    pub(crate) fn read_staged(&self, lcore: u16, slot: u32, dst: &mut [u8]) -> bool {
        self.staging_at(lcore, slot, dst.len())
            .is_some_and(|(region, at)| region.read(at, dst))
    }

    /// Whether the lcore's result region holds a result of `elems`
    /// elements at `slot`.
    pub(crate) fn holds_result(&self, lcore: u16, slot: u32, elems: usize) -> bool {
        self.lcore(lcore).is_some_and(|r| {
            elems <= self.chunk_elems as usize
                && r.results.region.contains(
                    slot_offset(slot, self.chunk_elems, self.dtype),
                    elems * self.dtype.size(),
                )
        })
    }

    /// Decodes the result of `slot` on `lcore` (`dst.len()` elements) from
    /// the lcore's result region into `dst` (with streaming stores when it
    /// is the caller's output: `to_caller`); `scratch` holds the wire bytes
    /// on the way when they must be converted. `false` (nothing written)
    /// when the region has no such slot.
    pub(crate) fn read_result(
        &self,
        lcore: u16,
        slot: u32,
        dst: Dst<'_>,
        scratch: &mut Vec<u8>,
        to_caller: bool,
    ) -> bool {
        let Some(r) = self.lcore(lcore) else {
            return false;
        };
        let n = dst.len();
        if n > self.chunk_elems as usize {
            return false;
        }
        let (region, off) = (&r.results.region, slot_offset(slot, self.chunk_elems, self.dtype));
        // Already the wire type (little-endian f32, or 16-bit elements of
        // the job's type): straight into `dst`.
        let dst = match dst.wire_bytes(self.dtype) {
            Ok(bytes) if to_caller => return region.read_streaming(off, bytes),
            Ok(bytes) => return region.read(off, bytes),
            Err(d) => d,
        };
        scratch.resize(n * self.dtype.size(), 0);
        if !region.read(off, scratch) {
            return false;
        }
        dst.decode(self.dtype, scratch, to_caller);
        true
    }

    /// Why the mapped files are no longer the dataplane's regions (it
    /// removed or recreated them: it restarted, or the job was removed),
    /// if they are not.
    pub(crate) fn replaced(&self) -> Option<String> {
        self.lcores
            .iter()
            .flatten()
            .find_map(|l| l.staging.replaced().or_else(|| l.results.replaced()))
    }
}

/// What the join decides: shared memory (`Some`) or datagrams (`None`),
/// with `mode` already the effective one. `open` opens the regions.
pub(crate) fn decide(
    mode: ShmMode,
    job: u16,
    rank: u16,
    lcores: &[SocketAddr],
    open: impl FnOnce() -> Result<Regions, OpenError>,
) -> Result<Option<Regions>, WorkerError> {
    if mode == ShmMode::Off {
        return Ok(None);
    }
    if let Some(a) = lcores.iter().find(|a| !a.ip().is_loopback()) {
        let why = format!(
            "the dataplane's address {a} is not a loopback address (shared memory needs the \
             dataplane on this host, reached through loopback)"
        );
        if mode == ShmMode::On {
            return Err(WorkerError::SharedMemory { message: why });
        }
        log::debug!("phub-worker: job {job} rank {rank}: datagrams, not shared memory: {why}");
        return Ok(None);
    }
    match open() {
        Ok(r) => Ok(Some(r)),
        Err(e) if mode == ShmMode::On => Err(WorkerError::SharedMemory {
            message: format!(
                "{e}; is phub-dataplane on this host started with --shm, by this user, and the job installed?"
            ),
        }),
        Err(e) => {
            log::info!(
                "phub-worker: job {job} rank {rank}: datagrams, not shared memory: {e} \
                 (a dataplane without --shm?)"
            );
            Ok(None)
        }
    }
}

#[cfg(test)]
// Test data: small numbers cast freely.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use super::*;
    use crate::codec;
    use phub_proto::layout::ChunkRange;
    use std::path::PathBuf;

    #[test]
    fn modes_parse_and_the_variable_replaces_auto_only() {
        for (text, mode) in [
            ("off", ShmMode::Off),
            (" Auto ", ShmMode::Auto),
            ("ON", ShmMode::On),
        ] {
            assert_eq!(text.parse::<ShmMode>().unwrap(), mode);
            assert_eq!(mode.to_string().parse::<ShmMode>().unwrap(), mode);
        }
        assert_eq!(ShmMode::default(), ShmMode::Auto);
        let e = "sometimes".parse::<ShmMode>().unwrap_err();
        assert!(e.contains("\"sometimes\"") && e.contains("off, auto, on"), "{e}");
        assert_eq!(effective_mode(ShmMode::Auto, None).unwrap(), ShmMode::Auto);
        assert_eq!(effective_mode(ShmMode::Auto, Some("")).unwrap(), ShmMode::Auto);
        assert_eq!(effective_mode(ShmMode::Auto, Some("on")).unwrap(), ShmMode::On);
        assert_eq!(effective_mode(ShmMode::Auto, Some("off")).unwrap(), ShmMode::Off);
        // An explicit choice in the configuration stands.
        assert_eq!(effective_mode(ShmMode::Off, Some("on")).unwrap(), ShmMode::Off);
        assert_eq!(effective_mode(ShmMode::On, Some("off")).unwrap(), ShmMode::On);
        let e = effective_mode(ShmMode::Auto, Some("maybe"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("PHUB_WORKER_SHM") && e.contains("maybe") && e.contains("off, auto, on"),
            "{e}"
        );
    }

    /// A layout of 3 lcores with 3, 0 and 1 slots of `chunk_elems`.
    fn layout(chunk_elems: u32) -> Layout {
        let run = |first, count| ChunkRange { first, count };
        Layout {
            chunk_elems,
            lcores: vec![run(0, 3), run(3, 0), run(3, 1)],
        }
    }

    /// A job id no other test (or process) uses for the same base port.
    fn spec(job: u16, rank: u16, dtype: Dtype) -> RegionSpec {
        let token = 0x5eed_0000_0000_0000 | u64::from(std::process::id());
        RegionSpec::new(1, job, token, rank, &layout(100), dtype)
    }

    /// Creates the regions of lcore `l` for `s` as the dataplane would.
    fn create(s: &RegionSpec, l: u16) -> (ShmRegion, ShmRegion) {
        let len = region_len(s.slots[usize::from(l)], s.chunk_elems, s.dtype);
        let path = |part| region_path(s.base_port, s.job, s.token, l, part);
        (
            ShmRegion::create(&path(Part::Staging(s.rank)), len).unwrap(),
            ShmRegion::create(&path(Part::Results), len).unwrap(),
        )
    }

    #[test]
    fn regions_carry_chunks_both_ways_at_their_slots() {
        for (job, dtype) in [
            (60_001u16, Dtype::F32),
            (60_002, Dtype::F16),
            (60_003, Dtype::Bf16),
        ] {
            let s = spec(job, 1, dtype);
            let missing = s.open().unwrap_err();
            assert_eq!(missing.path, region_path(1, job, s.token, 0, Part::Staging(1)));
            assert!(missing.to_string().contains("No such file"), "{missing}");
            let (st0, res0) = create(&s, 0);
            let (_st2, res2) = create(&s, 2);
            let r = s.open().unwrap();
            // A chunk's wire bytes land at its slot's offset (100 elements,
            // stride rounded up to 64 bytes).
            let wire: Vec<u8> = (0..100 * dtype.size()).map(|i| i as u8).collect();
            assert!(r.write_chunk(0, 2, &wire));
            let mut back = vec![0u8; wire.len()];
            assert!(st0.read(slot_offset(2, 100, dtype), &mut back));
            assert_eq!(back, wire);
            // Outside the job: no slot on lcore 1, slot 3 of 3, too long.
            assert!(!r.write_chunk(1, 0, &wire));
            assert!(!r.write_chunk(0, 3, &wire));
            assert!(!r.write_chunk(7, 0, &wire));
            assert!(!r.write_chunk(0, 0, &vec![0u8; wire.len() + 1]));
            // The lcore's result, decoded as a datagram's payload would be.
            let values: Vec<f32> = (0..40).map(|i| i as f32 - 20.5).collect();
            let mut bytes = vec![0u8; values.len() * dtype.size()];
            codec::encode(dtype, &values, &mut bytes);
            assert!(res2.write(slot_offset(0, 100, dtype), &bytes));
            assert!(res0.write(slot_offset(1, 100, dtype), &bytes));
            let mut scratch = Vec::new();
            for (l, slot) in [(2u16, 0u32), (0, 1)] {
                let mut got = vec![0f32; 40];
                assert!(r.read_result(l, slot, Dst::F32(&mut got), &mut scratch, l == 0));
                assert_eq!(got, values, "{dtype} lcore {l}");
            }
            let mut got = vec![0f32; 40];
            assert!(!r.read_result(1, 0, Dst::F32(&mut got), &mut scratch, false));
            assert!(!r.read_result(2, 1, Dst::F32(&mut got), &mut scratch, true));
            assert!(got.iter().all(|&x| x == 0.0), "nothing read from outside");
            assert_eq!(r.replaced(), None);
        }
    }

    #[test]
    fn wrong_lengths_and_recreated_files_are_named() {
        let s = spec(60_004, 0, Dtype::F32);
        let path = |part| region_path(s.base_port, s.job, s.token, 0, part);
        let (st0, res0) = create(&s, 0);
        let (st2, res2) = create(&s, 2);
        let r = s.open().unwrap();
        assert_eq!(r.replaced(), None);
        // The dataplane removes the job: the names lead nowhere.
        drop((st2, res2));
        let why = r.replaced().unwrap();
        assert!(why.contains("-l2-r0") && why.contains("No such file"), "{why}");
        // It installs the job again: new files under the old names.
        let (_st2, _res2) = create(&s, 2);
        let why = r.replaced().unwrap();
        assert!(why.contains("-l2-r0") && why.contains("replaced"), "{why}");
        assert_eq!(s.open().unwrap().replaced(), None);
        // A region of another size (another layout) is refused.
        drop((st0, res0));
        let _wrong = ShmRegion::create(&path(Part::Staging(0)), 64).unwrap();
        let e = s.open().unwrap_err();
        let want = region_len(3, 100, Dtype::F32);
        assert!(
            e.to_string().contains(&format!("64 bytes, expected {want}")),
            "{e}"
        );
        assert_eq!(e.path, path(Part::Staging(0)));
    }

    #[test]
    fn the_join_decides_by_mode_address_and_regions() {
        let lo: Vec<SocketAddr> = vec![
            "127.0.0.1:7000".parse().unwrap(),
            "127.0.0.1:7001".parse().unwrap(),
        ];
        let far: Vec<SocketAddr> = vec!["10.1.2.3:7000".parse().unwrap()];
        let never = || -> Result<Regions, OpenError> { panic!("opened regions it should not have") };
        let gone = || {
            Err(OpenError {
                path: PathBuf::from("/dev/shm/phub-7000-j1-x-l0-r0"),
                reason: "opening /dev/shm/phub-7000-j1-x-l0-r0: No such file or directory".into(),
            })
        };
        assert!(decide(ShmMode::Off, 1, 0, &lo, never).unwrap().is_none());
        assert!(decide(ShmMode::Auto, 1, 0, &far, never).unwrap().is_none());
        let e = decide(ShmMode::On, 1, 0, &far, never).unwrap_err().to_string();
        assert!(
            e.contains("shm = on") && e.contains("10.1.2.3:7000") && e.contains("loopback"),
            "{e}"
        );
        assert!(decide(ShmMode::Auto, 1, 0, &lo, gone).unwrap().is_none());
        let e = decide(ShmMode::On, 1, 0, &lo, gone).unwrap_err().to_string();
        assert!(
            e.contains("/dev/shm/phub-7000-j1-x-l0-r0: No such file") && e.contains("--shm"),
            "{e}"
        );
        let s = spec(60_005, 0, Dtype::F32);
        let _regions = (create(&s, 0), create(&s, 2));
        assert!(decide(ShmMode::On, 1, 0, &lo, || s.open()).unwrap().is_some());
        assert!(decide(ShmMode::Auto, 1, 0, &lo, || s.open()).unwrap().is_some());
    }
}
