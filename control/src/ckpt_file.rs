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

/// Why `new` must not replace `old` (a checkpoint of the same part): one
/// of its slots went back or lost its completed round, so it is older or
/// emptier; `None` when it is as new and as full or more. Slots are
/// compared in chunk order (both cut the part's one chunk sequence); when
/// their counts differ, the round ranges are.
pub(crate) fn regression(old: &Checkpoint, new: &Checkpoint) -> Option<String> {
    let olds: Vec<Option<u32>> = old.lcores.iter().flatten().map(|s| s.completed).collect();
    let news: Vec<Option<u32>> = new.lcores.iter().flatten().map(|s| s.completed).collect();
    let (had, has) = (rounds(old.round_range()), rounds(new.round_range()));
    if olds.len() == news.len() {
        let back = olds
            .iter()
            .zip(&news)
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
    let newer = match (old.round_range(), new.round_range()) {
        (Some(_), None) => true,
        (Some((_, a)), Some((_, b))) => b < a,
        (None, _) => false,
    };
    newer.then(|| format!("the file holds {had}, the appliance's state now {has}"))
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

/// Keeps `bytes` (`new`, encoded) as the checkpoint at `path` of the part
/// `owner` describes, unless the file there is unusable or newer
/// ([`regression`]). The file there is first copied to `<file>.prev`; the
/// new one is written and synced atomically ([`state::write_atomic`]),
/// read back and decoded; only then is `<file>.prev` removed. If it does
/// not read back, the previous one is put back.
pub(crate) fn keep(path: &Path, bytes: &[u8], new: &Checkpoint, owner: &Owner<'_>) -> Result<(), KeepError> {
    let file = path.display().to_string();
    let old = read(path, owner).map_err(|why| KeepError::Unusable {
        file: file.clone(),
        why,
    })?;
    let prev = prev_path(path);
    if let Some((old_bytes, old)) = &old {
        if let Some(why) = regression(old, new) {
            return Err(KeepError::Older { file, why });
        }
        state::write_atomic(&prev, old_bytes).map_err(|e| KeepError::Write(e.to_string()))?;
    }
    state::write_atomic(path, bytes).map_err(|e| KeepError::Write(e.to_string()))?;
    let back = std::fs::read(path).map_err(|e| e.to_string()).and_then(|b| {
        if b != bytes {
            return Err(format!("{} of {} bytes read back differ", b.len(), bytes.len()));
        }
        Checkpoint::decode(&b).map(drop).map_err(|e| e.to_string())
    });
    if let Err(why) = back {
        let put_back = if old.is_some() {
            std::fs::rename(&prev, path).map_or_else(
                |e| format!("; the previous one stays at {} ({e})", prev.display()),
                |()| "; the previous one is back".to_string(),
            )
        } else {
            let _ = std::fs::remove_file(path);
            String::new()
        };
        return Err(KeepError::Write(format!(
            "the checkpoint written to {file} does not read back: {why}{put_back}"
        )));
    }
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
        keep(&path, &good, &at5, &owner(&at5)).unwrap();
        for (new, says) in [(ckpt(None), "no completed round"), (ckpt(Some(4)), "at round 4")] {
            let e = keep(&path, &new.encode().unwrap(), &new, &owner(&at5)).unwrap_err();
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
        keep(&path, &at6.encode().unwrap(), &at6, &owner(&at5)).unwrap();
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
        let e = keep(&path, &c.encode().unwrap(), &c, &owner(&c)).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), bad);
        let mut other = c.clone();
        other.job.id = 9;
        std::fs::write(&path, other.encode().unwrap()).unwrap();
        let e = keep(&path, &c.encode().unwrap(), &c, &owner(&c)).unwrap_err();
        assert!(e.to_string().contains("job 9's checkpoint, not job 4's"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
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
