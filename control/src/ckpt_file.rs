//! A job part's checkpoint file beside the state file: whether the one
//! there belongs to the part, and how a new one is kept. Layer: control,
//! file I/O only (no HTTP, no lock).
//!
//! Invariants:
//! - A checkpoint file is never replaced by one that is older or emptier
//!   (a slot whose completed round would go back, or be lost), nor when
//!   the file there cannot be read or is not the part's: such a file may
//!   be the only copy of the part's state, and only the operator decides
//!   to give it up ([`keep`]).
//! - While a new checkpoint is written, the previous one stays beside it
//!   as `<file>.prev`, until the new one is synced and read back whole.
//! - A file that exists but is not the part's (another job's, another
//!   admission's, another part's chunks) is as unusable as a corrupt one
//!   ([`Owner::check`]): never restored, never written over.

use std::io::Write;
use std::path::{Path, PathBuf};

use phub_proto::api::InstallJob;
use phub_proto::checkpoint::Checkpoint;
use phub_proto::layout::Layout;
use phub_proto::spec::JobSpec;

use crate::state;

/// Where a checkpoint file's previous version waits while a new one is
/// written.
pub(crate) fn prev_path(path: &Path) -> PathBuf {
    state::sibling(path, ".prev")
}

/// What a job part's checkpoint must describe to be the part's.
#[derive(Debug, Clone)]
pub(crate) struct Owner<'a> {
    /// The job id.
    pub(crate) id: u16,
    /// The job's token (another admission of the same id has another).
    pub(crate) token: u64,
    /// The admitted spec.
    pub(crate) spec: &'a JobSpec,
    /// The appliance of the part.
    pub(crate) appliance: &'a str,
    /// Which of the job's chunks the part holds.
    pub(crate) part: PartShape<'a>,
}

/// The chunks a part holds, as a checkpoint of it must have them.
#[derive(Debug, Clone)]
pub(crate) enum PartShape<'a> {
    /// A flat job's part: a run of the job's chunk sequence, which the
    /// checkpoint's layout must span (it may cut it over other lcores: a
    /// refitted part's checkpoint is moved onto its new layout).
    Flat(&'a Layout),
    /// A hierarchical job's rack `rack`: restored onto this very layout
    /// only.
    Rack {
        /// The rack's index.
        rack: u16,
        /// Its rack layout.
        layout: &'a Layout,
    },
}

impl Owner<'_> {
    /// Whether `found` (a checkpoint's job description) is this part's:
    /// the reason it is not, naming what it is and what was expected.
    pub(crate) fn check(&self, found: &InstallJob) -> Result<(), String> {
        if found.id != self.id {
            return Err(format!(
                "it is job {}'s checkpoint, not job {}'s",
                found.id, self.id
            ));
        }
        if found.token != self.token {
            return Err(format!(
                "it is from another admission of job {} (its token differs from the admitted job's)",
                self.id
            ));
        }
        if found.spec != *self.spec {
            return Err(format!(
                "its job spec (name {:?}, {} keys, {} workers) is not the admitted one's (name {:?}, {} keys, \
                 {} workers)",
                found.spec.name,
                found.spec.keys.len(),
                found.spec.workers,
                self.spec.name,
                self.spec.keys.len(),
                self.spec.workers
            ));
        }
        match (&self.part, &found.hierarchy) {
            (PartShape::Flat(part), None) => {
                let (had, has) = (found.layout.span(), part.span());
                if had != has || found.layout.chunk_elems != part.chunk_elems {
                    return Err(format!(
                        "it holds chunks {}..{} of {} elements, but the part on appliance {:?} holds chunks \
                         {}..{} of {} (another part's checkpoint?)",
                        had.start,
                        had.end,
                        found.layout.chunk_elems,
                        self.appliance,
                        has.start,
                        has.end,
                        part.chunk_elems
                    ));
                }
                Ok(())
            }
            (PartShape::Rack { rack, layout }, Some(h)) => {
                if h.rack != *rack || found.layout != **layout {
                    return Err(format!(
                        "it is rack {}'s checkpoint, the part on appliance {:?} is rack {rack}'s{}",
                        h.rack,
                        self.appliance,
                        if h.rack == *rack {
                            " with another rack layout"
                        } else {
                            ""
                        }
                    ));
                }
                Ok(())
            }
            (PartShape::Flat(_), Some(_)) => {
                Err("it is a hierarchical job's checkpoint; the job is not hierarchical".into())
            }
            (PartShape::Rack { .. }, None) => {
                Err("it is a flat job's checkpoint; the job is hierarchical".into())
            }
        }
    }
}

/// Reads the checkpoint at `path` for `owner`: `None` if there is no file;
/// the reason it cannot be used if it cannot be read or decoded or is not
/// the part's (with a word on `<file>.prev` when one is there).
pub(crate) fn read(path: &Path, owner: &Owner<'_>) -> Result<Option<(Vec<u8>, Checkpoint)>, String> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(with_prev(path, format!("cannot be read: {e}"))),
    };
    let ckpt = Checkpoint::decode(&bytes).map_err(|e| with_prev(path, e.to_string()))?;
    owner.check(&ckpt.job).map_err(|e| with_prev(path, e))?;
    Ok(Some((bytes, ckpt)))
}

/// `why`, and where the previous checkpoint is if a write left one.
fn with_prev(path: &Path, why: String) -> String {
    let prev = prev_path(path);
    if prev.exists() {
        format!(
            "{why} (a previous checkpoint is at {}: check it, and copy it over the file to use it)",
            prev.display()
        )
    } else {
        why
    }
}

/// A checkpoint's completed round in each slot, in chunk order: what
/// [`regression`] compares, kept without the slots' values (a part's
/// checkpoint can be many gigabytes; this is 8 bytes a slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rounds(Vec<Option<u32>>);

impl Rounds {
    /// `c`'s.
    pub(crate) fn of(c: &Checkpoint) -> Rounds {
        Rounds(c.lcores.iter().flatten().map(|s| s.completed).collect())
    }

    /// The lowest and highest completed round of any slot (as
    /// [`Checkpoint::round_range`]).
    pub(crate) fn range(&self) -> Option<(u32, u32)> {
        phub_proto::checkpoint::round_range(self.0.iter().copied())
    }
}

/// Why `new` must not replace `old` (a checkpoint of the same part): one
/// of its slots went back or lost its completed round, so it is older or
/// emptier; `None` when it is as new and as full or more. Slots are
/// compared in chunk order (both cut the part's one chunk sequence); when
/// their counts differ, the round ranges are.
pub(crate) fn regression(old: &Rounds, new: &Rounds) -> Option<String> {
    let (olds, news) = (&old.0, &new.0);
    let (had, has) = (rounds(old.range()), rounds(new.range()));
    if olds.len() == news.len() {
        let back = olds
            .iter()
            .zip(news)
            .enumerate()
            .find(|(_, (o, n))| match (o, n) {
                (Some(_), None) => true,
                (Some(o), Some(n)) => n < o,
                (None, _) => false,
            });
        let (i, (o, n)) = back?;
        let o = o.expect("found above: the file's slot has a round");
        return Some(format!(
            "the file holds {had}, the appliance's state now {has}: its slot {i} (in chunk order) is at \
             round {o} in the file, {} now",
            n.map_or("with no completed round".to_string(), |n| format!("at round {n}"))
        ));
    }
    let newer = match (old.range(), new.range()) {
        (Some(_), None) => true,
        (Some((_, a)), Some((_, b))) => b < a,
        (None, _) => false,
    };
    newer.then(|| format!("the file holds {had}, the appliance's state now {has}"))
}

/// `path`'s file, kept as `prev` too: a second (hard) link to it, so that
/// replacing `path` leaves it there; a copy where the file system has no
/// hard links. A `prev` left by an earlier keep is replaced.
fn link_prev(path: &Path, prev: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(prev) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::hard_link(path, prev).or_else(|_| std::fs::copy(path, prev).map(drop))
}

/// "rounds 3..=5", "round 3", "no completed round".
fn rounds(r: Option<(u32, u32)>) -> String {
    match r {
        None => "no completed round".into(),
        Some((a, b)) if a == b => format!("round {a}"),
        Some((a, b)) => format!("rounds {a}..={b}"),
    }
}

/// Why a checkpoint was not kept.
#[derive(Debug, thiserror::Error)]
pub(crate) enum KeepError {
    /// The file there cannot be read or decoded, or is not the part's: it
    /// is left as it is.
    #[error("the checkpoint file {file} there is unusable: {why}; it is left as it is")]
    Unusable {
        /// The file.
        file: String,
        /// Why.
        why: String,
    },
    /// The file there is newer or fuller than the new checkpoint.
    #[error(
        "refusing to replace the checkpoint {file} with an older or emptier one: {why} (the appliance lost \
         state that was not restored?)"
    )]
    Older {
        /// The file.
        file: String,
        /// What each holds.
        why: String,
    },
    /// Writing, syncing or reading back failed.
    #[error("{0}")]
    Write(String),
}

/// Where a checkpoint being received is written, beside the file it may
/// replace ([`receive`], then [`keep`]).
pub(crate) fn incoming_path(path: &Path) -> PathBuf {
    state::sibling(path, ".incoming")
}

/// A checkpoint received into its incoming file and read back whole.
#[derive(Debug)]
pub(crate) struct Received {
    /// Its job (id, token, spec, layout).
    pub(crate) job: InstallJob,
    /// Its slots' completed rounds.
    pub(crate) rounds: Rounds,
    /// Its bytes.
    pub(crate) bytes: u64,
}

/// Why a checkpoint was not received.
#[derive(Debug)]
pub(crate) enum ReceiveError<E> {
    /// `fill` failed (the appliance's answer).
    Fill(E),
    /// Writing the file, or reading it back, failed: what and why.
    File(String),
}

/// Writes a checkpoint (what `fill` writes, as it comes) to `incoming`
/// (0600, a leftover one replaced), syncs it, and reads it back whole as
/// it streams ([`Checkpoint::scan`]: structure and CRC, no values kept),
/// so that memory stays O(slots) whatever its size. The file is removed
/// on any error.
pub(crate) fn receive<E>(
    incoming: &Path,
    fill: impl FnOnce(&mut dyn Write) -> Result<u64, E>,
) -> Result<Received, ReceiveError<E>> {
    let file_err = |what: &str, e: &dyn std::fmt::Display| {
        let _ = std::fs::remove_file(incoming);
        ReceiveError::File(format!("{what} {}: {e}", incoming.display()))
    };
    let f = state::create_private(incoming).map_err(|e| file_err("creating", &e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let written = match fill(&mut w) {
        Ok(n) => n,
        Err(e) => {
            drop(w);
            let _ = std::fs::remove_file(incoming);
            return Err(ReceiveError::Fill(e));
        }
    };
    let f = w
        .into_inner()
        .map_err(|e| file_err("writing", &e.error().to_string()))?;
    f.sync_all().map_err(|e| file_err("syncing", &e))?;
    drop(f);
    let r = std::fs::File::open(incoming).map_err(|e| file_err("reading back", &e))?;
    let (c, bytes) = scan_file(r).map_err(|e| file_err("reading back", &e))?;
    if bytes != written {
        return Err(file_err(
            "reading back",
            &format!("{bytes} bytes read back, {written} written"),
        ));
    }
    Ok(Received {
        rounds: Rounds::of(&c),
        job: c.job,
        bytes,
    })
}

/// The checkpoint in `f` read as it streams, its values left out, and its
/// length ([`Checkpoint::scan`], 1 MiB reads).
fn scan_file(f: std::fs::File) -> Result<(Checkpoint, u64), phub_proto::checkpoint::CheckpointError> {
    Checkpoint::scan(std::io::BufReader::with_capacity(1 << 20, f))
}

/// The checkpoint at `path` for `owner` read as it streams, its values
/// left out ([`Checkpoint::scan`]), and its length: `None` if there is no
/// file; why it cannot be used as [`read`] says.
pub(crate) fn scan(path: &Path, owner: &Owner<'_>) -> Result<Option<(Checkpoint, u64)>, String> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(with_prev(path, format!("cannot be read: {e}"))),
    };
    let (c, len) = scan_file(f).map_err(|e| with_prev(path, e.to_string()))?;
    owner.check(&c.job).map_err(|e| with_prev(path, e))?;
    Ok(Some((c, len)))
}

/// The rounds of the checkpoint at `path` for `owner` ([`scan`]).
fn scan_rounds(path: &Path, owner: &Owner<'_>) -> Result<Option<Rounds>, String> {
    Ok(scan(path, owner)?.map(|(c, _)| Rounds::of(&c)))
}

/// Keeps the checkpoint [`receive`]d into `incoming` (`new` are its
/// rounds) as the checkpoint at `path` of the part `owner` describes,
/// unless the file there is unusable or newer ([`regression`]); then the
/// incoming file is removed and the one there left as it is. The file
/// there stays as `<file>.prev` (a second link to it, not a copy) until
/// the incoming one has replaced it (a rename, then the directory synced);
/// the incoming one was synced and read back whole before. Memory: the
/// file there is read as it streams, no copy of either is held.
pub(crate) fn keep(path: &Path, incoming: &Path, new: &Rounds, owner: &Owner<'_>) -> Result<(), KeepError> {
    let file = path.display().to_string();
    let refuse = |e: KeepError| {
        let _ = std::fs::remove_file(incoming);
        e
    };
    let old = scan_rounds(path, owner).map_err(|why| {
        refuse(KeepError::Unusable {
            file: file.clone(),
            why,
        })
    })?;
    let prev = prev_path(path);
    if let Some(old) = &old {
        if let Some(why) = regression(old, new) {
            return Err(refuse(KeepError::Older { file, why }));
        }
        link_prev(path, &prev).map_err(|e| {
            refuse(KeepError::Write(format!(
                "keeping {file} as {}: {e}",
                prev.display()
            )))
        })?;
    }
    state::rename_synced(incoming, path).map_err(|e| refuse(KeepError::Write(e.to_string())))?;
    match std::fs::remove_file(&prev) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => {
            log::warn!(
                "checkpoint {file} kept; its previous version {} stays: {e}",
                prev.display()
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use phub_proto::checkpoint::SlotState;
    use phub_proto::layout::{layout, Placement};

    fn spec() -> JobSpec {
        JobSpec::new("k", 1, &[100]).with_chunk_bytes(128)
    }

    /// Job 4's checkpoint on 2 lcores, every slot at `round`.
    fn ckpt(round: Option<u32>) -> Checkpoint {
        let spec = spec();
        let layout = layout(&spec, &mut [0, 0], u64::from);
        let placement = Placement::new(&spec, layout.clone()).unwrap();
        let lcores = (0..layout.lcores.len())
            .map(|l| {
                placement
                    .slots(l)
                    .map(|s| SlotState {
                        completed: round,
                        params: Vec::new(),
                        s1: Vec::new(),
                        s2: Vec::new(),
                        result: vec![1; 4 * s.elems as usize],
                        clocks: Vec::new(),
                    })
                    .collect()
            })
            .collect();
        let tables = vec![Vec::new(); layout.lcores.len()];
        Checkpoint {
            job: InstallJob {
                id: 4,
                token: 77,
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

    fn owner<'a>(c: &'a Checkpoint) -> Owner<'a> {
        Owner {
            id: 4,
            token: 77,
            spec: &c.job.spec,
            appliance: "a",
            part: PartShape::Flat(&c.job.layout),
        }
    }

    /// `c` received beside `path` ([`receive`]), then [`keep`]: what
    /// control does with an appliance's answer.
    fn keep_ckpt(path: &Path, c: &Checkpoint, owner: &Owner<'_>) -> Result<(), KeepError> {
        let inc = incoming_path(path);
        let bytes = c.encode().unwrap();
        let got = receive::<std::io::Error>(&inc, |w| w.write_all(&bytes).map(|()| bytes.len() as u64))
            .unwrap_or_else(|_| panic!("a whole checkpoint is received"));
        assert_eq!(got.bytes, bytes.len() as u64);
        assert_eq!(got.rounds, Rounds::of(c));
        let r = keep(path, &inc, &got.rounds, owner);
        assert!(!inc.exists(), "the incoming file is kept or removed, never left");
        r
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("phub-ckpt-file-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Finding 2 of issue 36, (c): a checkpoint with no completed round
    /// (the appliance lost the part and was given it empty) never replaces
    /// one with rounds, nor does an older one; the file stays byte for byte
    /// and the error names both. Before the fix `checkpoint_part` wrote
    /// whatever the appliance answered over the file.
    #[test]
    fn an_emptier_or_older_checkpoint_never_replaces_the_file() {
        let d = dir("older");
        let path = d.join("job-4.ckpt");
        let at5 = ckpt(Some(5));
        let good = at5.encode().unwrap();
        keep_ckpt(&path, &at5, &owner(&at5)).unwrap();
        for (new, says) in [(ckpt(None), "no completed round"), (ckpt(Some(4)), "at round 4")] {
            let e = keep_ckpt(&path, &new, &owner(&at5)).unwrap_err();
            assert!(matches!(e, KeepError::Older { .. }), "{e}");
            let m = e.to_string();
            assert!(
                m.contains("round 5") && m.contains(says) && m.contains("job-4.ckpt"),
                "{m}"
            );
            assert_eq!(std::fs::read(&path).unwrap(), good);
        }
        // As new, or newer: kept, and no .prev stays.
        let at6 = ckpt(Some(6));
        keep_ckpt(&path, &at6, &owner(&at5)).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), at6.encode().unwrap());
        assert!(!prev_path(&path).exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A corrupt file, or another job's, is never written over: it may be
    /// the only copy of the part's state.
    #[test]
    fn an_unusable_file_is_never_written_over() {
        let d = dir("unusable");
        let path = d.join("job-4.ckpt");
        let c = ckpt(Some(2));
        let mut bad = c.encode().unwrap();
        bad[40] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        let e = keep_ckpt(&path, &c, &owner(&c)).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), bad);
        let mut other = c.clone();
        other.job.id = 9;
        std::fs::write(&path, other.encode().unwrap()).unwrap();
        let e = keep_ckpt(&path, &c, &owner(&c)).unwrap_err();
        assert!(e.to_string().contains("job 9's checkpoint, not job 4's"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A received checkpoint is read back whole as it streams: one cut or
    /// corrupted on the way, or whose sender failed, is refused naming
    /// why and its incoming file removed; the previous file is kept by a
    /// link that a later keep replaces.
    #[test]
    fn a_received_checkpoint_is_read_back_and_the_previous_kept_by_a_link() {
        let d = dir("readback");
        let path = d.join("job-4.ckpt");
        let inc = incoming_path(&path);
        let bytes = ckpt(Some(3)).encode().unwrap();
        let send = |b: &[u8]| {
            let b = b.to_vec();
            move |w: &mut dyn Write| w.write_all(&b).map(|()| b.len() as u64)
        };
        let refused = |r: Result<Received, ReceiveError<std::io::Error>>| match r {
            Err(ReceiveError::File(why)) => why,
            other => panic!("{other:?}"),
        };
        let why = refused(receive(&inc, send(&bytes[..bytes.len() - 9])));
        assert!(why.contains("reading back") && why.contains("truncated"), "{why}");
        assert!(!inc.exists());
        let mut bad = bytes.clone();
        bad[bytes.len() - 1] ^= 1;
        let why = refused(receive(&inc, send(&bad)));
        assert!(why.contains("checksum"), "{why}");
        assert!(!inc.exists());
        let failed = receive(&inc, |w: &mut dyn Write| {
            w.write_all(&bytes[..100])?;
            Err(std::io::Error::other("the appliance went away"))
        });
        assert!(matches!(failed, Err(ReceiveError::Fill(_))));
        assert!(!inc.exists());
        let got = receive(&inc, send(&bytes)).unwrap();
        assert_eq!((got.bytes, got.job.id), (bytes.len() as u64, 4));
        assert_eq!(std::fs::read(&inc).unwrap(), bytes);
        std::fs::write(&path, b"old").unwrap();
        let prev = prev_path(&path);
        std::fs::write(&prev, b"stale").unwrap();
        link_prev(&path, &prev).unwrap();
        state::rename_synced(&inc, &path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        assert_eq!(
            std::fs::read(&prev).unwrap(),
            b"old",
            "the previous file, replaced at its path, stays as .prev"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn rounds_range_as_the_checkpoints() {
        for c in [ckpt(None), ckpt(Some(3))] {
            assert_eq!(Rounds::of(&c).range(), c.round_range());
        }
        assert_eq!(
            Rounds(vec![Some(4), None, Some(2), Some(9)]).range(),
            Some((2, 9))
        );
    }

    /// Another part's chunks, another admission's token: not the part's.
    #[test]
    fn a_checkpoint_of_another_part_or_admission_is_refused() {
        let c = ckpt(Some(1));
        let mut other = c.job.clone();
        other.token = 78;
        assert!(owner(&c).check(&other).unwrap_err().contains("another admission"));
        let mut shifted = c.job.clone();
        for r in &mut shifted.layout.lcores {
            r.first += 100;
        }
        let e = owner(&c).check(&shifted).unwrap_err();
        assert!(e.contains("another part's checkpoint"), "{e}");
        assert!(owner(&c).check(&c.job).is_ok());
    }
}
