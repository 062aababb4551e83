//! Checkpoint files: a job's parameters, optimizer state and stored results,
//! self-contained so a restarted dataplane can reinstall the job from one.
//!
//! Layout (all integers little-endian):
//!
//! | bytes | what |
//! | --- | --- |
//! | 8 | magic `PHUBCKPT` |
//! | 4 | format version (3; version 2, which lacks the tables, and 1, which lacks the clocks too, are read too) |
//! | 4 | length J of the JSON that follows |
//! | J | [`InstallJob`] as JSON: id, token, spec, layout (of one appliance's part, for a sharded job) |
//! | 4 | number of lcores L (must equal the layout's) |
//! | per lcore: 4 | number of slots S (must equal the layout's for that lcore) |
//! | per slot: 4 | last completed round, `0xffffffff` for none |
//! | per slot: 4 x 4 | lengths (in elements) of params, state 1, state 2 (f32) and of the stored result (wire elements, u16 or f32 by dtype size) |
//! | per slot | the four arrays, little-endian |
//! | per slot: 4 | number of clocks K: 0 for a BSP job, W otherwise (version 2 only) |
//! | per slot: K x 4 | each rank's last applied clock on the chunk, bit 31 set while its answer is held |
//! | per lcore (version 3 only) | its tables: a count T (the spec's table keys), then each (table, lcore)'s state, [`crate::table_checkpoint`] |
//! | 4 | CRC-32 (IEEE) of every byte before it |
//!
//! Decoding checks every length against the layout and the checksum, so a
//! truncated or corrupted file is refused with a reason, never half-loaded.
//! A file of version 1 or 2 reads with no table state: its job's tables, if
//! any, start empty, as they did when it was written.

use crate::api::InstallJob;
use crate::layout::{Layout, Placement};
use crate::spec::{Consistency, Optimizer};
use crate::table_checkpoint::{self, Source, TableRoundsState, TableState};
use std::io::Read;

/// First bytes of every checkpoint file.
pub const MAGIC: &[u8; 8] = b"PHUBCKPT";
/// Format version this code writes (it reads this one, 2 and 1).
pub const VERSION: u32 = 3;
/// The bit of a saved clock that says the rank's answer is held.
pub const CLOCK_HELD: u32 = 1 << 31;

/// One slot's durable state.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotState {
    /// Last completed round, if any.
    pub completed: Option<u32>,
    /// Parameters (empty for sum/mean jobs).
    pub params: Vec<f32>,
    /// First optimizer state buffer (momentum or Adam's m), possibly empty.
    pub s1: Vec<f32>,
    /// Second optimizer state buffer (Adam's v), possibly empty.
    pub s2: Vec<f32>,
    /// The stored result in wire bytes (empty when the parameters are it).
    pub result: Vec<u8>,
    /// Jobs that are not BSP: per rank, its last applied clock on the chunk,
    /// [`CLOCK_HELD`] set while its answer is held (empty for BSP).
    pub clocks: Vec<u32>,
}

/// A whole job's checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// What to install: id, token, spec, layout.
    pub job: InstallJob,
    /// Per lcore, per slot in slot order.
    pub lcores: Vec<Vec<SlotState>>,
    /// Per lcore, its tables' state in the order of the spec's table keys
    /// (PROTOCOL.md §10.6); every list empty in a file of version 1 or 2
    /// (the tables start empty).
    pub tables: Vec<Vec<TableState>>,
}

/// Why a checkpoint could not be read (or, [`CheckpointError::TooLarge`], written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// The file ends before the data it announces.
    #[error("checkpoint is truncated at byte {0}")]
    Truncated(usize),
    /// Not a phub checkpoint.
    #[error("not a phub checkpoint (no PHUBCKPT magic)")]
    BadMagic,
    /// A phub checkpoint of a format version this code does not read.
    #[error("checkpoint format version {0}: this phub reads versions 1 to {VERSION}")]
    BadVersion(u32),
    /// The checksum does not match.
    #[error("checkpoint checksum mismatch (file corrupted)")]
    BadChecksum,
    /// The embedded job is not valid JSON or not a valid job.
    #[error("checkpoint's job description: {0}")]
    BadJob(String),
    /// Slot counts or lengths disagree with the layout.
    #[error("checkpoint does not match its layout: {0}")]
    Mismatch(String),
    /// Reading a streamed checkpoint failed ([`Checkpoint::scan`]).
    #[error("reading the checkpoint: {0}")]
    Io(String),
    /// A table's rows, handed on as they streamed
    /// ([`Restoring::finish`]), were refused by what took them.
    #[error("checkpoint's table key {key} on lcore {lcore}: {why}")]
    Rows {
        /// The lcore whose section holds the table.
        lcore: usize,
        /// The table's key.
        key: u32,
        /// What was wrong.
        why: String,
    },
    /// Encoding only: a length does not fit the format's 4-byte field.
    #[error("checkpoint cannot hold {what} of {len}: the format's lengths are 4 bytes")]
    TooLarge {
        /// Which length.
        what: &'static str,
        /// Its value.
        len: usize,
    },
}

/// The lowest and highest of the slots' completed rounds `completed`
/// (`None`: a slot with none), `None` when no slot has one.
pub fn round_range(completed: impl IntoIterator<Item = Option<u32>>) -> Option<(u32, u32)> {
    completed.into_iter().flatten().fold(None, |acc, r| {
        Some(acc.map_or((r, r), |(lo, hi): (u32, u32)| (lo.min(r), hi.max(r))))
    })
}

impl Checkpoint {
    /// Lowest and highest completed round over the slots that have one.
    pub fn round_range(&self) -> Option<(u32, u32)> {
        round_range(self.lcores.iter().flatten().map(|s| s.completed))
    }

    /// The same state on another layout of the same job (its chunks placed
    /// anew, e.g. over the lcores of a dataplane that restarted with fewer):
    /// each slot's state follows its chunk, so nothing is lost. Both layouts
    /// give the lcores runs of the one chunk sequence in lcore order, so the
    /// slots taken lcore by lcore are the sequence in both. Fails if the
    /// layouts do not cut the same sequence.
    pub fn relayout(self, layout: Layout) -> Result<Checkpoint, CheckpointError> {
        let Checkpoint { job, lcores, tables } = self;
        if job.hierarchy.is_some() {
            return Err(CheckpointError::Mismatch(
                "a hierarchical job's checkpoint is restored onto the layouts it was taken with only".into(),
            ));
        }
        let (had, has) = (job.layout.chunk_count(), layout.chunk_count());
        // A part of a sharded job moves within its own share of the chunks.
        if job.layout.span() != layout.span() || job.layout.chunk_elems != layout.chunk_elems {
            return Err(CheckpointError::Mismatch(format!(
                "the new layout has {has} chunks of {} elements, the checkpoint {had} of {}",
                layout.chunk_elems, job.layout.chunk_elems
            )));
        }
        // A table's rows are placed by the job's lcore count and each
        // lcore's entry (§10.1): they stay with their lcore, which exists
        // only on a layout of as many lcores.
        if tables.iter().any(|t| !t.is_empty()) && layout.lcores.len() != job.layout.lcores.len() {
            return Err(CheckpointError::Mismatch(format!(
                "the job's tables were saved over {} lcores and are restored onto as many only, not {}",
                job.layout.lcores.len(),
                layout.lcores.len()
            )));
        }
        let tables = if tables.len() == layout.lcores.len() {
            tables
        } else {
            vec![Vec::new(); layout.lcores.len()]
        };
        let mut states = lcores.into_iter().flatten();
        let moved = layout
            .lcores
            .iter()
            .map(|run| {
                // Cast: a run's slots are held in memory, so they fit a usize.
                #[allow(clippy::cast_possible_truncation)]
                let n = run.count as usize;
                states.by_ref().take(n).collect()
            })
            .collect();
        Ok(Checkpoint {
            job: InstallJob { layout, ..job },
            lcores: moved,
            tables,
        })
    }

    /// Serialises the checkpoint; fails only if a length does not fit the
    /// format's 4-byte fields.
    pub fn encode(&self) -> Result<Vec<u8>, CheckpointError> {
        let mut out = Checkpoint::encode_head(&self.job, &self.lcores)?;
        if self.tables.len() != self.lcores.len() {
            return Err(CheckpointError::Mismatch(format!(
                "tables of {} lcores for {} lcores of slots",
                self.tables.len(),
                self.lcores.len()
            )));
        }
        for tables in &self.tables {
            table_checkpoint::encode(&mut out, tables)?;
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(out)
    }

    /// The bytes of a checkpoint of `job` up to its tables: magic,
    /// version, the job and every lcore's slots (module head). Each
    /// lcore's tables follow ([`table_checkpoint::encode_count`] and
    /// [`table_checkpoint::encode_head`], then each row store's bytes),
    /// then the CRC-32 of all that comes before it: so a checkpoint can
    /// be written as its parts are produced.
    pub fn encode_head(job: &InstallJob, lcores: &[Vec<SlotState>]) -> Result<Vec<u8>, CheckpointError> {
        fn len(out: &mut Vec<u8>, what: &'static str, len: usize) -> Result<(), CheckpointError> {
            let n = u32::try_from(len).map_err(|_| CheckpointError::TooLarge { what, len })?;
            out.extend_from_slice(&n.to_le_bytes());
            Ok(())
        }
        let json = serde_json::to_vec(job).expect("InstallJob serialises");
        let mut out = Vec::with_capacity(64 + json.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        len(&mut out, "a job description", json.len())?;
        out.extend_from_slice(&json);
        len(&mut out, "an lcore count", lcores.len())?;
        for slots in lcores {
            len(&mut out, "a slot count", slots.len())?;
            for s in slots {
                out.extend_from_slice(&s.completed.unwrap_or(u32::MAX).to_le_bytes());
                let rlen = s.result.len() / job.spec.dtype.size();
                for n in [s.params.len(), s.s1.len(), s.s2.len(), rlen] {
                    len(&mut out, "an array length", n)?;
                }
                for v in s.params.iter().chain(&s.s1).chain(&s.s2) {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&s.result);
                len(&mut out, "a clock count", s.clocks.len())?;
                for c in &s.clocks {
                    out.extend_from_slice(&c.to_le_bytes());
                }
            }
        }
        Ok(out)
    }

    /// Reads and checks a checkpoint.
    pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
        Checkpoint::decode_with(bytes)
    }

    fn decode_with(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
        if bytes.len() < 12 || &bytes[..8] != MAGIC {
            return Err(CheckpointError::BadMagic);
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let mut r = Reader { b: body, at: 8 };
        let version = r.u32()?;
        if !(1..=VERSION).contains(&version) {
            return Err(CheckpointError::BadVersion(version));
        }
        if crc32fast::hash(body) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
            return Err(CheckpointError::BadChecksum);
        }
        let c = Checkpoint::decode_from(&mut r, version)?;
        if r.at != body.len() {
            return Err(CheckpointError::Mismatch(format!(
                "{} bytes left over",
                body.len() - r.at
            )));
        }
        Ok(c)
    }

    /// Reads and checks a checkpoint as it streams from `r`, keeping no
    /// values: the job, every slot's completed round and clocks, every
    /// table's rounds, with every array (parameters, state, results, row
    /// stores) empty. The same checks as [`Checkpoint::decode`], the CRC
    /// last; memory O(slots), whatever the file's size. Returns it and the
    /// file's length.
    pub fn scan(r: impl std::io::Read) -> Result<(Checkpoint, u64), CheckpointError> {
        let mut r = Scanner::new(r, false);
        let version = r.start()?;
        // Read before the CRC is: a corrupt file fails on its structure
        // or, if that holds, on the CRC below.
        let c = Checkpoint::decode_from(&mut r, version)?;
        let len = r.end()?;
        Ok((c, len))
    }

    /// Begins restoring a checkpoint as it streams from `r`: reads and
    /// checks its job and every slot (values kept: a job's dense state is
    /// what its install needs), and leaves the tables, which may be
    /// gigabytes, to [`Restoring::finish`], which hands each table's rows
    /// on as they come. Nothing of the file is trusted before the CRC at
    /// its end has been checked: what the caller builds from it meanwhile
    /// is to be dropped when `finish` fails.
    pub fn restore_from<R: std::io::Read>(r: R) -> Result<Restoring<R>, CheckpointError> {
        let mut r = Scanner::new(r, true);
        let version = r.start()?;
        let (job, lcores) = Checkpoint::decode_head(&mut r, version)?;
        Ok(Restoring {
            r,
            version,
            job,
            lcores,
        })
    }

    /// One lcore's tables' section (what follows the slots, per lcore:
    /// [`table_checkpoint::encode_count`] and the tables), alone, as an
    /// lcore streams it, for lcore `l` of a job of `spec`; all of `section`
    /// must be it.
    pub fn decode_tables(
        section: &[u8],
        spec: &crate::spec::JobSpec,
        l: usize,
    ) -> Result<Vec<TableState>, CheckpointError> {
        let mut r = Reader { b: section, at: 0 };
        let tables = table_checkpoint::decode(&mut r, spec, l)?;
        if r.at != section.len() {
            return Err(CheckpointError::Mismatch(format!(
                "lcore {l}: {} bytes left over after its tables",
                section.len() - r.at
            )));
        }
        Ok(tables)
    }

    /// The checkpoint after its magic and version.
    fn decode_from(r: &mut impl Source, version: u32) -> Result<Checkpoint, CheckpointError> {
        let (job, lcores) = Checkpoint::decode_head(r, version)?;
        let tables = Checkpoint::decode_all_tables(r, &job, version)?;
        Ok(Checkpoint { job, lcores, tables })
    }

    /// Every lcore's tables (version 3; none before), after the slots.
    fn decode_all_tables(
        r: &mut impl Source,
        job: &InstallJob,
        version: u32,
    ) -> Result<Vec<Vec<TableState>>, CheckpointError> {
        (0..job.layout.lcores.len())
            .map(|l| {
                if version >= 3 {
                    table_checkpoint::decode(r, &job.spec, l)
                } else {
                    Ok(Vec::new())
                }
            })
            .collect()
    }

    /// The job and every lcore's slots, after the magic and version.
    fn decode_head(
        r: &mut impl Source,
        version: u32,
    ) -> Result<(InstallJob, Vec<Vec<SlotState>>), CheckpointError> {
        let jlen = r.u32()? as usize;
        let job: InstallJob =
            serde_json::from_slice(r.take(jlen)?).map_err(|e| CheckpointError::BadJob(e.to_string()))?;
        job.spec
            .validate()
            .map_err(|e| CheckpointError::BadJob(e.to_string()))?;
        // One appliance's part of a sharded job has a checkpoint of its own.
        let placement = Placement::part(&job.spec, job.layout.clone())
            .map_err(|e| CheckpointError::BadJob(format!("layout: {e}")))?;
        // A hierarchical job's part keeps, per lcore, its rack slots (a sum
        // job's) and then its home slots (PROTOCOL.md §9.1).
        let home = match &job.hierarchy {
            None => None,
            Some(h) => {
                let part = h
                    .home_part()
                    .ok_or_else(|| CheckpointError::BadJob(format!("hierarchy: no rack {}", h.rack)))?;
                Some(
                    Placement::part(&job.spec, part)
                        .map_err(|e| CheckpointError::BadJob(format!("home layout: {e}")))?,
                )
            }
        };
        let sum = Optimizer::Sum;
        let rack_opt = if home.is_some() { &sum } else { &job.spec.optimizer };
        let dsize = job.spec.dtype.size();
        let nl = r.u32()? as usize;
        if nl != job.layout.lcores.len() {
            return Err(CheckpointError::Mismatch(format!(
                "{nl} lcores, layout has {}",
                job.layout.lcores.len()
            )));
        }
        let mut lcores = Vec::with_capacity(nl);
        for (l, run) in job.layout.lcores.iter().enumerate() {
            let ns = r.u32()? as usize;
            let homes: Vec<_> = home.as_ref().map(|h| h.slots(l).collect()).unwrap_or_default();
            if ns as u64 != run.count + homes.len() as u64 {
                return Err(CheckpointError::Mismatch(format!(
                    "lcore {l}: {ns} slots, layout has {} (and {} home slots)",
                    run.count,
                    homes.len()
                )));
            }
            // At most what the rest of the file can hold: 20 bytes a slot.
            let mut slots = Vec::with_capacity(ns.min(r.left() / 20));
            let all = placement
                .slots(l)
                .map(|c| (c, rack_opt))
                .chain(homes.into_iter().map(|c| (c, &job.spec.optimizer)));
            for (i, (sc, opt)) in all.enumerate() {
                let completed = match r.u32()? {
                    u32::MAX => None,
                    c => Some(c),
                };
                let lens = [r.u32()?, r.u32()?, r.u32()?, r.u32()?].map(|n| n as usize);
                let e = sc.elems as usize;
                let want = [
                    if opt.keeps_params() { e } else { 0 },
                    if opt.state_buffers() >= 1 { e } else { 0 },
                    if opt.state_buffers() >= 2 { e } else { 0 },
                    lens[3],
                ];
                if lens[..3] != want[..3] || (lens[3] != 0 && lens[3] != e) {
                    return Err(CheckpointError::Mismatch(format!(
                        "lcore {l} slot {i}: array lengths {lens:?} do not fit a chunk of {e} elements"
                    )));
                }
                let mut f = |n: usize| -> Result<Vec<f32>, CheckpointError> {
                    Ok(r.values(4 * n)?
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect())
                };
                let (params, s1, s2) = (f(lens[0])?, f(lens[1])?, f(lens[2])?);
                let result = r.values(lens[3] * dsize)?;
                let nclocks = if version == 1 { 0 } else { r.u32()? as usize };
                let want_clocks = if job.spec.consistency == Consistency::Sync {
                    0
                } else {
                    job.spec.workers as usize
                };
                // A version-1 file of a job that is not BSP cannot exist:
                // such jobs came with version 2.
                if nclocks != want_clocks {
                    return Err(CheckpointError::Mismatch(format!(
                        "lcore {l} slot {i}: {nclocks} rank clocks; a {} job of {} workers has {want_clocks}",
                        job.spec.consistency.mode(),
                        job.spec.workers
                    )));
                }
                let clocks = r
                    .take(4 * nclocks)?
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                slots.push(SlotState {
                    completed,
                    params,
                    s1,
                    s2,
                    result,
                    clocks,
                });
            }
            lcores.push(slots);
        }
        Ok((job, lcores))
    }
}

/// A checkpoint being restored as it streams ([`Checkpoint::restore_from`]):
/// its job and slots read, its tables to come.
pub struct Restoring<R> {
    r: Scanner<R>,
    version: u32,
    job: InstallJob,
    lcores: Vec<Vec<SlotState>>,
}

impl<R> std::fmt::Debug for Restoring<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restoring")
            .field("version", &self.version)
            .field("job", &self.job.id)
            .field("at", &self.r.at)
            .finish_non_exhaustive()
    }
}

/// One (table, lcore)'s row store checkpoint as it streams
/// ([`Restoring::finish`]).
pub struct TableRows<'a> {
    /// The lcore whose section holds it.
    pub lcore: usize,
    /// The table's key.
    pub key: u32,
    /// Its rounds (read before the rows).
    pub rounds: &'a TableRoundsState,
    /// Bytes of the row store checkpoint: all of them are to be read.
    pub len: u64,
    /// The bytes, as they come (every one into the file's CRC); ends
    /// after `len`.
    pub bytes: &'a mut dyn std::io::Read,
}

impl<R: std::io::Read> Restoring<R> {
    /// The job the checkpoint installs (checked as [`Checkpoint::decode`]
    /// checks it).
    pub fn job(&self) -> &InstallJob {
        &self.job
    }

    /// Reads every lcore's tables, in the file's order (lcore 0's in the
    /// spec's table key order, then lcore 1's, ...), handing each table's
    /// row store bytes to `rows`, which must read all of them; then the
    /// CRC. Returns the checkpoint (every table's `rows` empty: `rows` took
    /// them) and the file's length. An error from `rows` ends it, as
    /// [`CheckpointError::Rows`].
    pub fn finish(
        mut self,
        mut rows: impl FnMut(TableRows<'_>) -> Result<(), String>,
    ) -> Result<(Checkpoint, u64), CheckpointError> {
        let mut source = Handing {
            s: &mut self.r,
            rows: &mut rows,
        };
        let tables = Checkpoint::decode_all_tables(&mut source, &self.job, self.version)?;
        let len = self.r.end()?;
        Ok((
            Checkpoint {
                job: self.job,
                lcores: self.lcores,
                tables,
            },
            len,
        ))
    }
}

/// A [`Scanner`] whose tables' rows go to a caller as they stream.
struct Handing<'a, R> {
    s: &'a mut Scanner<R>,
    rows: &'a mut dyn FnMut(TableRows<'_>) -> Result<(), String>,
}

impl<R: std::io::Read> Source for Handing<'_, R> {
    fn take(&mut self, n: usize) -> Result<&[u8], CheckpointError> {
        self.s.take(n)
    }

    fn values(&mut self, n: usize) -> Result<Vec<u8>, CheckpointError> {
        self.s.values(n)
    }

    fn rows(
        &mut self,
        l: usize,
        key: u32,
        rounds: &TableRoundsState,
        n: usize,
    ) -> Result<bytes::Bytes, CheckpointError> {
        let mut bytes = Hashed {
            s: &mut *self.s,
            left: n as u64,
            cut: None,
        };
        let r = (self.rows)(TableRows {
            lcore: l,
            key,
            rounds,
            len: n as u64,
            bytes: &mut bytes,
        });
        let (left, cut) = (bytes.left, bytes.cut.take());
        // A file that ended or failed inside the rows is that, whatever
        // the taker made of it.
        if let Some(e) = cut {
            return Err(e);
        }
        let refused = |why: String| CheckpointError::Rows { lcore: l, key, why };
        r.map_err(refused)?;
        if left != 0 {
            return Err(refused(format!(
                "{} of its {n} bytes of rows were read",
                n as u64 - left
            )));
        }
        Ok(bytes::Bytes::new())
    }

    fn left(&self) -> usize {
        self.s.left()
    }
}

/// A table's row bytes read through a [`Scanner`]: hashed and counted,
/// ending after `left`; where the file ends or fails inside them is kept
/// in `cut`.
struct Hashed<'a, R> {
    s: &'a mut Scanner<R>,
    left: u64,
    cut: Option<CheckpointError>,
}

impl<R: std::io::Read> std::io::Read for Hashed<'_, R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let want = usize::try_from(self.left).unwrap_or(usize::MAX).min(out.len());
        if want == 0 {
            return Ok(0);
        }
        loop {
            match self.s.r.read(&mut out[..want]) {
                Ok(0) => {
                    self.cut = Some(CheckpointError::Truncated(self.s.at));
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                Ok(n) => {
                    self.s.crc.update(&out[..n]);
                    self.s.at += n;
                    self.left -= n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.cut = Some(CheckpointError::Io(e.to_string()));
                    return Err(e);
                }
            }
        }
    }
}

/// A checkpoint in memory.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Source for Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], CheckpointError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or(CheckpointError::Truncated(self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn values(&mut self, n: usize) -> Result<Vec<u8>, CheckpointError> {
        self.take(n).map(<[u8]>::to_vec)
    }

    fn rows(
        &mut self,
        _l: usize,
        _key: u32,
        _rounds: &TableRoundsState,
        n: usize,
    ) -> Result<bytes::Bytes, CheckpointError> {
        self.take(n).map(bytes::Bytes::copy_from_slice)
    }

    fn left(&self) -> usize {
        self.b.len() - self.at
    }
}

/// A checkpoint streamed ([`Checkpoint::scan`]): values are read past
/// (or, `keep`, kept: [`Checkpoint::restore_from`]), every byte goes into
/// the CRC.
struct Scanner<R> {
    r: R,
    crc: crc32fast::Hasher,
    at: usize,
    buf: Vec<u8>,
    keep: bool,
}

impl<R: std::io::Read> Scanner<R> {
    fn new(r: R, keep: bool) -> Scanner<R> {
        Scanner {
            r,
            crc: crc32fast::Hasher::new(),
            at: 0,
            buf: Vec::new(),
            keep,
        }
    }

    /// Reads past `n` bytes (hashed), a megabyte at a time.
    fn skip(&mut self, mut n: usize) -> Result<(), CheckpointError> {
        while n > 0 {
            let piece = n.min(1 << 20);
            self.fill(piece)?;
            n -= piece;
        }
        self.buf = Vec::new();
        Ok(())
    }

    /// The magic and version.
    fn start(&mut self) -> Result<u32, CheckpointError> {
        if self.take(8).map_err(|_| CheckpointError::BadMagic)? != MAGIC {
            return Err(CheckpointError::BadMagic);
        }
        let version = self.u32()?;
        if !(1..=VERSION).contains(&version) {
            return Err(CheckpointError::BadVersion(version));
        }
        Ok(version)
    }

    /// The CRC, then nothing more; returns the file's length.
    fn end(mut self) -> Result<u64, CheckpointError> {
        let computed = self.crc.clone().finalize();
        let crc = self.take(4)?;
        if computed != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) {
            return Err(CheckpointError::BadChecksum);
        }
        let len = self.at as u64;
        let mut more = [0u8; 1];
        loop {
            return match self.r.read(&mut more) {
                Ok(0) => Ok(len),
                Ok(_) => Err(CheckpointError::Mismatch(
                    "bytes left over after the checksum".into(),
                )),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(CheckpointError::Io(e.to_string())),
            };
        }
    }

    /// Reads `n` bytes into `buf` (hashed), or says where the file ended.
    fn fill(&mut self, n: usize) -> Result<(), CheckpointError> {
        self.buf.clear();
        let got = std::io::Read::take(&mut self.r, n as u64)
            .read_to_end(&mut self.buf)
            .map_err(|e| CheckpointError::Io(e.to_string()))?;
        if got < n {
            return Err(CheckpointError::Truncated(self.at + got));
        }
        self.crc.update(&self.buf);
        self.at += n;
        Ok(())
    }
}

impl<R: std::io::Read> Source for Scanner<R> {
    fn take(&mut self, n: usize) -> Result<&[u8], CheckpointError> {
        self.fill(n)?;
        Ok(&self.buf)
    }

    fn values(&mut self, n: usize) -> Result<Vec<u8>, CheckpointError> {
        if self.keep {
            // Read a megabyte at a time: a stated length is not trusted
            // with an allocation before its bytes came.
            let mut v = Vec::new();
            let mut left = n;
            while left > 0 {
                let piece = left.min(1 << 20);
                self.fill(piece)?;
                v.extend_from_slice(&self.buf);
                left -= piece;
            }
            return Ok(v);
        }
        self.skip(n).map(|()| Vec::new())
    }

    fn rows(
        &mut self,
        _l: usize,
        _key: u32,
        _rounds: &TableRoundsState,
        n: usize,
    ) -> Result<bytes::Bytes, CheckpointError> {
        self.skip(n).map(|()| bytes::Bytes::new())
    }

    fn left(&self) -> usize {
        // Unknown: what a slot list may allocate ahead (20 bytes a slot).
        20 << 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::layout;
    use crate::spec::JobSpec;
    use crate::table_checkpoint::RankClockState;

    fn sample() -> Checkpoint {
        let spec = JobSpec::from_toml(
            "name = \"c\"\nworkers = 2\ndtype = \"bf16\"\nchunk_bytes = 128\n[optimizer]\nkind = \"adam\"\nlr = 0.1\n[[keys]]\nelements = 100\n",
        )
        .unwrap();
        let mut load = vec![0; 2];
        let layout = layout(&spec, &mut load, u64::from);
        let placement = Placement::new(&spec, layout.clone()).unwrap();
        let lcores = (0..layout.lcores.len())
            .map(|l| {
                placement
                    .slots(l)
                    .enumerate()
                    .map(|(i, s)| {
                        let e = s.elems as usize;
                        SlotState {
                            completed: (i % 2 == 0).then_some(7),
                            params: (0..e).map(|x| x as f32).collect(),
                            s1: vec![0.5; e],
                            s2: vec![0.25; e],
                            result: vec![3; 2 * e],
                            clocks: Vec::new(),
                        }
                    })
                    .collect()
            })
            .collect();
        let tables = vec![Vec::new(); layout.lcores.len()];
        Checkpoint {
            job: InstallJob {
                id: 3,
                token: 99,
                spec,
                layout,
                hierarchy: None,
                replication: None,
                entries: None,
            },
            lcores,
            tables,
        }
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let c = sample();
        let bytes = c.encode().unwrap();
        assert_eq!(Checkpoint::decode(&bytes).unwrap(), c);
        assert_eq!(c.round_range(), Some((7, 7)));
        for cut in [0, 7, 12, 40, bytes.len() - 5, bytes.len() - 1] {
            assert!(Checkpoint::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = bytes.clone();
        bad[100] ^= 1;
        assert_eq!(
            Checkpoint::decode(&bad).unwrap_err(),
            CheckpointError::BadChecksum
        );
        let mut other = c.clone();
        other.lcores[0][0].s2.clear();
        let e = Checkpoint::decode(&other.encode().unwrap()).unwrap_err();
        assert!(matches!(e, CheckpointError::Mismatch(_)), "{e}");
        let mut future = bytes.clone();
        future[8..12].copy_from_slice(&4u32.to_le_bytes());
        let e = Checkpoint::decode(&future).unwrap_err();
        assert_eq!(e, CheckpointError::BadVersion(4));
        assert!(e.to_string().contains("reads versions 1 to 3"), "{e}");
    }

    /// Version 1 wrote no clock count: the same bytes without them read as
    /// the same checkpoint (a BSP job has no clocks).
    #[test]
    fn version_one_files_are_read() {
        let c = sample();
        let v2 = c.encode().unwrap();
        let jlen = u32::from_le_bytes(v2[12..16].try_into().unwrap()) as usize;
        let mut v1 = v2[..16 + jlen].to_vec();
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        let mut at = 16 + jlen;
        let word = |v1: &mut Vec<u8>, at: &mut usize| {
            let w = u32::from_le_bytes(v2[*at..*at + 4].try_into().unwrap());
            v1.extend_from_slice(&v2[*at..*at + 4]);
            *at += 4;
            w
        };
        let nl = word(&mut v1, &mut at);
        for _ in 0..nl {
            let ns = word(&mut v1, &mut at);
            for _ in 0..ns {
                word(&mut v1, &mut at);
                let lens: Vec<u32> = (0..4).map(|_| word(&mut v1, &mut at)).collect();
                let bytes = 4 * (lens[0] + lens[1] + lens[2]) as usize + 2 * lens[3] as usize;
                v1.extend_from_slice(&v2[at..at + bytes]);
                at += bytes;
                assert_eq!(
                    u32::from_le_bytes(v2[at..at + 4].try_into().unwrap()),
                    0,
                    "no clocks"
                );
                at += 4;
            }
        }
        // Version 3's tables: a count of 0 per lcore, then the checksum.
        assert_eq!(at, v2.len() - 4 - 4 * nl as usize);
        let crc = crc32fast::hash(&v1);
        v1.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(Checkpoint::decode(&v1).unwrap(), c);
    }

    /// A checkpoint scanned as it streams is the one decoded, less its
    /// values; every damage decode refuses, scan refuses too (a cut file
    /// saying where it ends, a flipped byte, a byte too many).
    #[test]
    fn a_scan_is_the_decode_without_values() {
        let without = |mut c: Checkpoint| {
            for s in c.lcores.iter_mut().flatten() {
                s.params.clear();
                s.s1.clear();
                s.s2.clear();
                s.result.clear();
            }
            for t in c.tables.iter_mut().flatten() {
                t.rows.clear();
            }
            c
        };
        for c in [
            sample(),
            with_table("{ mode = \"sync\" }"),
            with_table("{ bounded_delay = 2 }"),
        ] {
            let bytes = c.encode().unwrap();
            let (scanned, len) = Checkpoint::scan(&bytes[..]).unwrap();
            assert_eq!(len, bytes.len() as u64);
            assert_eq!(scanned, without(c.clone()));
            for cut in [0, 11, 40, bytes.len() / 2, bytes.len() - 1] {
                let e = Checkpoint::scan(&bytes[..cut]).unwrap_err();
                assert!(
                    matches!(e, CheckpointError::Truncated(_) | CheckpointError::BadMagic),
                    "cut at {cut}: {e}"
                );
                assert!(Checkpoint::decode(&bytes[..cut]).is_err());
            }
            if let Err(CheckpointError::Truncated(at)) = Checkpoint::scan(&bytes[..bytes.len() / 2]) {
                assert_eq!(at, bytes.len() / 2);
            }
            let mut bad = bytes.clone();
            let last_value = bad.len() - 6;
            bad[last_value] ^= 0x10;
            assert!(Checkpoint::scan(&bad[..]).is_err());
            assert!(Checkpoint::decode(&bad).is_err());
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(Checkpoint::scan(&longer[..]).is_err());
        }
    }

    /// Restored as it streams, a checkpoint is the one decoded: its slots
    /// with their values, each table's rows handed on in the file's
    /// order, whole, exactly the bytes decode keeps; damage is refused as
    /// decode refuses it (a cut inside the rows says where, a flipped row
    /// byte fails the CRC after the rows were handed on), and a taker that
    /// refuses or reads short ends it naming the table.
    #[test]
    fn a_restore_from_a_stream_hands_on_each_tables_rows_and_is_the_decode() {
        let restore = |bytes: &[u8]| {
            let r = Checkpoint::restore_from(bytes)?;
            assert_eq!(
                r.job(),
                &Checkpoint::decode_head(&mut Reader { b: bytes, at: 12 }, 3)?.0
            );
            let mut got = Vec::new();
            let (c, len) = r.finish(|t| {
                let mut rows = Vec::new();
                t.bytes.read_to_end(&mut rows).map_err(|e| e.to_string())?;
                assert_eq!(rows.len() as u64, t.len);
                got.push((t.lcore, t.key, t.rounds.clone(), rows));
                Ok(())
            })?;
            assert_eq!(len, bytes.len() as u64);
            Ok::<_, CheckpointError>((c, got))
        };
        for mode in ["{ mode = \"sync\" }", "{ bounded_delay = 2 }"] {
            let c = with_table(mode);
            let bytes = c.encode().unwrap();
            let (restored, got) = restore(&bytes).unwrap();
            assert_eq!(restored.lcores, c.lcores);
            assert_eq!(restored.job, c.job);
            let want: Vec<_> = c
                .tables
                .iter()
                .enumerate()
                .flat_map(|(l, ts)| {
                    ts.iter()
                        .map(move |t| (l, t.key, t.rounds.clone(), t.rows.to_vec()))
                })
                .collect();
            assert_eq!(got, want);
            assert!(got.iter().any(|g| !g.3.is_empty()));
            for t in restored.tables.iter().flatten() {
                assert!(t.rows.is_empty());
            }
            // Cut inside the first table's rows: truncated there.
            let rows = &want.iter().find(|w| w.3.len() > 2).expect("a table with rows").3;
            let first_rows = bytes
                .windows(rows.len())
                .position(|w| w == &rows[..])
                .expect("the rows in the file");
            let cut = first_rows + rows.len() / 2;
            assert_eq!(
                restore(&bytes[..cut]).unwrap_err(),
                CheckpointError::Truncated(cut)
            );
            // A flipped row byte: every row handed on, then the CRC fails.
            let mut bad = bytes.clone();
            bad[first_rows + 1] ^= 1;
            assert_eq!(restore(&bad).unwrap_err(), CheckpointError::BadChecksum);
            // A taker that refuses, or reads short.
            let e = Checkpoint::restore_from(&bytes[..])
                .unwrap()
                .finish(|t| Err(format!("no room for key {}", t.key)))
                .unwrap_err();
            assert_eq!(
                e.to_string(),
                "checkpoint's table key 1 on lcore 0: no room for key 1"
            );
            let e = Checkpoint::restore_from(&bytes[..])
                .unwrap()
                .finish(|t| {
                    let mut one = [0u8; 1];
                    t.bytes.read_exact(&mut one).map_err(|e| e.to_string())
                })
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("bytes of rows were read") && e.contains("1 of its"),
                "{e}"
            );
        }
        // Not a checkpoint: refused before anything is read past the magic.
        assert_eq!(
            Checkpoint::restore_from(&b"PHUBROWS\x02\0\0\0"[..]).unwrap_err(),
            CheckpointError::BadMagic
        );
    }

    /// A job that is not BSP keeps W clocks per slot, held bits included;
    /// a slot with another count is refused naming the mode.
    #[test]
    fn clocks_of_an_async_job_round_trip() {
        let mut c = sample();
        c.job.spec.consistency = Consistency::Bounded { delay: 2 };
        for s in c.lcores.iter_mut().flatten() {
            s.clocks = vec![5, 7 | CLOCK_HELD];
        }
        assert_eq!(Checkpoint::decode(&c.encode().unwrap()).unwrap(), c);
        c.lcores[0][0].clocks.pop();
        let e = Checkpoint::decode(&c.encode().unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("1 rank clocks; a bounded_delay job of 2 workers has 2"),
            "{e}"
        );
    }

    /// Moving a checkpoint onto a layout over other lcores keeps every
    /// chunk's state with its chunk, and moving it back restores it; a
    /// layout of another chunk count is refused.
    #[test]
    fn relayout_moves_each_chunks_state_with_it() {
        use crate::layout::ChunkRange;
        let c = sample();
        let total = c.job.layout.chunk_count();
        assert!(total >= 2 && c.lcores.iter().filter(|s| !s.is_empty()).count() >= 2);
        let chunk_elems = c.job.layout.chunk_elems;
        let all_on_one = |n: u64| Layout {
            chunk_elems,
            lcores: vec![
                ChunkRange { first: 0, count: n },
                ChunkRange { first: n, count: 0 },
                ChunkRange { first: n, count: 0 },
            ],
        };
        let moved = c.clone().relayout(all_on_one(total)).unwrap();
        assert_eq!(moved.job.layout, all_on_one(total));
        let n = usize::try_from(total).unwrap();
        assert_eq!(moved.lcores.iter().map(Vec::len).collect::<Vec<_>>(), [n, 0, 0]);
        let seq = |c: &Checkpoint| c.lcores.iter().flatten().cloned().collect::<Vec<_>>();
        assert_eq!(seq(&moved), seq(&c));
        assert_eq!(Checkpoint::decode(&moved.encode().unwrap()).unwrap(), moved);
        assert_eq!(moved.relayout(c.job.layout.clone()).unwrap(), c);
        let e = c.relayout(all_on_one(total - 1)).unwrap_err().to_string();
        assert!(e.contains(&format!("{} chunks", total - 1)), "{e}");
    }

    /// A job with a table between its dense keys: BSP.
    fn with_table(consistency: &str) -> Checkpoint {
        let spec = JobSpec::from_toml(&format!(
            "name = \"t\"\nworkers = 2\nchunk_bytes = 64\nconsistency = {consistency}\noptimizer = {{ kind = \"sum\" }}\n\
             [[keys]]\nelements = 40\n\
             [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 4\nrows = 100\n\
             [[keys]]\nelements = 8\n"
        ))
        .unwrap();
        let mut load = vec![0; 2];
        let layout = layout(&spec, &mut load, u64::from);
        let placement = Placement::new(&spec, layout.clone()).unwrap();
        let bsp = spec.consistency == Consistency::Sync;
        let lcores = (0..layout.lcores.len())
            .map(|l| {
                placement
                    .slots(l)
                    .map(|s| SlotState {
                        completed: Some(4),
                        params: Vec::new(),
                        s1: Vec::new(),
                        s2: Vec::new(),
                        result: vec![1; 4 * s.elems as usize],
                        clocks: if bsp { Vec::new() } else { vec![4, 4] },
                    })
                    .collect()
            })
            .collect();
        let tables = (0..layout.lcores.len())
            .map(|l| {
                let rounds = if bsp {
                    TableRoundsState::Bsp {
                        completed: 3 + u32::try_from(l).unwrap(),
                    }
                } else {
                    let mut got = [0u64; table_checkpoint::GOT_WORDS];
                    got[0] = 0b101;
                    got[15] = 1 << 63;
                    TableRoundsState::Clocked {
                        ranks: vec![
                            RankClockState {
                                applied: 5,
                                n: Some(3),
                                held: None,
                                got,
                            },
                            RankClockState {
                                applied: 7,
                                n: None,
                                held: Some(1024),
                                got: [0; table_checkpoint::GOT_WORDS],
                            },
                        ],
                    }
                };
                vec![TableState {
                    key: 1,
                    rounds,
                    rows: (0..=u8::try_from(l).unwrap() * 13).collect(),
                }]
            })
            .collect();
        Checkpoint {
            job: InstallJob {
                id: 8,
                token: 5,
                spec,
                layout,
                hierarchy: None,
                replication: None,
                entries: None,
            },
            lcores,
            tables,
        }
    }

    /// Tables round-trip in every mode; a file whose tables do not fit the
    /// spec (another key, another mode, another W, a count beyond 1024) or
    /// that is cut inside them is refused saying so.
    #[test]
    fn tables_round_trip_and_are_checked_against_the_spec() {
        for mode in [
            "{ mode = \"sync\" }",
            "{ mode = \"async\" }",
            "{ bounded_delay = 2 }",
        ] {
            let c = with_table(mode);
            let bytes = c.encode().unwrap();
            assert_eq!(Checkpoint::decode(&bytes).unwrap(), c, "{mode}");
            let cut = bytes.len() - 4 - 3;
            assert!(matches!(
                Checkpoint::decode(&refit_crc(&bytes[..cut])),
                Err(CheckpointError::Truncated(_))
            ));
        }
        let mut c = with_table("{ mode = \"sync\" }");
        c.tables[0][0].key = 2;
        let e = Checkpoint::decode(&c.encode().unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("lcore 0: a table saved as key 2, the spec's next table key is 1"),
            "{e}"
        );
        let mut c = with_table("{ mode = \"sync\" }");
        c.tables[1].clear();
        let e = Checkpoint::decode(&c.encode().unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("lcore 1: 0 tables saved, the spec has 1 table keys"),
            "{e}"
        );
        let mut c = with_table("{ mode = \"async\" }");
        c.tables[0][0].rounds = TableRoundsState::Bsp { completed: 1 };
        let e = Checkpoint::decode(&c.encode().unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("rounds of kind 0") && e.contains("the job is async"),
            "{e}"
        );
        let mut c = with_table("{ mode = \"async\" }");
        if let TableRoundsState::Clocked { ranks } = &mut c.tables[0][0].rounds {
            ranks[1].held = Some(1025);
        }
        let e = Checkpoint::decode(&c.encode().unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("rank 1: held ROW_DONE count 1025, accepted 0 to 1024"),
            "{e}"
        );
        let mut c = with_table("{ mode = \"async\" }");
        if let TableRoundsState::Clocked { ranks } = &mut c.tables[1][0].rounds {
            ranks.pop();
        }
        let e = Checkpoint::decode(&c.encode().unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("table 1: 1 rank clocks saved, the job has 2 workers"),
            "{e}"
        );
    }

    /// `bytes` with its last 4 bytes replaced by the CRC of the rest.
    fn refit_crc(bytes: &[u8]) -> Vec<u8> {
        let body = &bytes[..bytes.len() - 4];
        let mut v = body.to_vec();
        v.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
        v
    }

    /// A version-2 file (no tables section) of a job with a table reads,
    /// its tables empty: they start empty, as before version 3.
    #[test]
    fn version_two_files_of_a_job_with_tables_are_read_with_empty_tables() {
        let mut c = with_table("{ mode = \"sync\" }");
        for t in &mut c.tables {
            t.clear();
        }
        // Version 3 with empty table lists would be refused (the spec has a
        // table): build the version-2 bytes from the version-3 encoding.
        let full = with_table("{ mode = \"sync\" }");
        let v3 = full.encode().unwrap();
        let tables_len: usize = full
            .tables
            .iter()
            .map(|t| {
                let mut out = Vec::new();
                table_checkpoint::encode(&mut out, t).unwrap();
                out.len()
            })
            .sum();
        let mut v2 = v3[..v3.len() - 4 - tables_len].to_vec();
        v2[8..12].copy_from_slice(&2u32.to_le_bytes());
        let crc = crc32fast::hash(&v2);
        v2.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(Checkpoint::decode(&v2).unwrap(), c);
    }

    /// A checkpoint with tables moves onto a layout of as many lcores (the
    /// tables stay with their lcores) and not onto one of another count.
    #[test]
    fn relayout_keeps_tables_with_their_lcores() {
        use crate::layout::ChunkRange;
        let c = with_table("{ mode = \"sync\" }");
        let total = c.job.layout.chunk_count();
        let chunk_elems = c.job.layout.chunk_elems;
        let on_first = Layout {
            chunk_elems,
            lcores: vec![
                ChunkRange {
                    first: 0,
                    count: total,
                },
                ChunkRange {
                    first: total,
                    count: 0,
                },
            ],
        };
        let moved = c.clone().relayout(on_first).unwrap();
        assert_eq!(moved.tables, c.tables);
        let one = Layout {
            chunk_elems,
            lcores: vec![ChunkRange {
                first: 0,
                count: total,
            }],
        };
        let e = c.relayout(one).unwrap_err().to_string();
        assert!(e.contains("saved over 2 lcores") && e.contains("not 1"), "{e}");
    }
}
