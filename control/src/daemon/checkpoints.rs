//! Job parts' checkpoints: taken from the appliances on request and
//! periodically, kept beside the state file ([`crate::ckpt_file`]), found
//! again at start, and read back to restore a part a restarted appliance
//! lost; a part whose file is there but unusable is held ([`Held`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use phub_proto::api::{CheckpointInfo, InstallJob};
use phub_proto::layout::Layout;

use super::http::{held, not_admitted, RequestError};
use super::registry::{Inner, Shared, Standing};
use crate::ckpt_file::{self, KeepError, Owner, PartShape, ReceiveError};
use crate::dataplane::Client;
use crate::state::{self, StoredJob};

/// What control knows of its job parts' checkpoint files (beside the
/// state file), by job and appliance.
#[derive(Debug, Default)]
pub(super) struct Checkpoints {
    /// Each part's last usable checkpoint.
    pub(super) taken: BTreeMap<(u16, String), CheckpointInfo>,
    /// Parts whose checkpoint file exists but cannot be restored: they are
    /// not installed (their job is held) until `POST /v1/jobs/{id}/retry`.
    pub(super) held: BTreeMap<(u16, String), Held>,
}

impl Checkpoints {
    /// Why job `id` is held ("part on appliance ...: checkpoint FILE
    /// unusable: WHY", "; " between parts), if one of its parts is.
    pub(super) fn held_reason(&self, id: u16) -> Option<String> {
        let parts: Vec<String> = self
            .held
            .range((id, String::new())..)
            .take_while(|((j, _), _)| *j == id)
            .map(|((_, name), h)| held_text(name, h))
            .collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// Why a job part is held: its checkpoint file is there, but it cannot be
/// read or decoded, is not the part's, cannot be moved onto the part's
/// layout, or the appliance refuses it. Installing the part without it
/// would lose the state the file may hold, and the next checkpoint would
/// write over it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Held {
    /// The file.
    pub(super) file: PathBuf,
    /// Why it cannot be used.
    pub(super) why: String,
}
impl Shared {
    /// Takes a checkpoint of every part of job `id` from its appliances and
    /// keeps each beside the state file ([`ckpt_file::keep`]: never over a
    /// newer or fuller one, nor over one that is unusable, which holds the
    /// job; the previous one kept as `.prev` until the new one reads back).
    /// A part whose appliance fails keeps its previous checkpoint, and the
    /// error names the appliance; the other parts are saved. A held job is
    /// refused (409).
    pub(super) fn checkpoint(&self, id: u16) -> Result<CheckpointInfo, RequestError> {
        let _files = CHECKPOINT_FILES.lock().unwrap_or_else(|p| p.into_inner());
        let clients: Vec<(String, Client)> = {
            let inner = self.lock();
            let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
            inner.standing(job).check(id)?;
            job.parts
                .iter()
                .map(|p| Ok((p.appliance.clone(), inner.client(&p.appliance)?)))
                .collect::<Result<_, RequestError>>()?
        };
        let mut first_error = None;
        for (name, c) in clients {
            match self.checkpoint_part(id, &name, &c) {
                Ok(info) => log::info!(
                    "checkpoint of job {id} on appliance {name:?}: rounds {:?}, {} bytes",
                    info.round_range,
                    info.bytes
                ),
                Err(e) => {
                    log::warn!("checkpoint of job {id} on appliance {name:?}: {e}");
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let inner = self.lock();
        let job = inner.jobs.get(&id).ok_or_else(|| not_admitted(id))?;
        combined_checkpoint(&inner, job).ok_or_else(|| not_admitted(id))
    }

    /// Takes job `id`'s part on appliance `name` from `client` and keeps it
    /// ([`ckpt_file::keep`]). Caller holds [`CHECKPOINT_FILES`].
    pub(super) fn checkpoint_part(
        &self,
        id: u16,
        name: &str,
        client: &Client,
    ) -> Result<CheckpointInfo, RequestError> {
        let job = self
            .lock()
            .jobs
            .get(&id)
            .cloned()
            .ok_or_else(|| not_admitted(id))?;
        let path = checkpoint_path(&self.state_path, &job, name);
        let part = job.part_on(name).ok_or_else(|| not_admitted(id))?;
        let owner = owner(&job, name, &part);
        // Written to a file beside the checkpoint as it comes and read back
        // whole (structure and CRC, no values kept): control never holds a
        // copy of the part's state.
        let incoming = ckpt_file::incoming_path(&path);
        let got = ckpt_file::receive(&incoming, |w| client.checkpoint_into(id, w)).map_err(|e| match e {
            ReceiveError::Fill(e) => RequestError::from(e),
            ReceiveError::File(why) => RequestError::State(format!(
                "appliance {name:?}'s checkpoint of job {id} is unreadable: {why}"
            )),
        })?;
        let (ckpt_job, rounds, bytes) = (got.job, got.rounds, got.bytes);
        if let Err(e) = owner.check(&ckpt_job) {
            let _ = std::fs::remove_file(&incoming);
            return Err(RequestError::State(format!(
                "appliance {name:?}'s checkpoint of job {id} is not the part's: {e}; nothing was written"
            )));
        }
        match ckpt_file::keep(&path, &incoming, &rounds, &owner) {
            Ok(()) => {}
            Err(KeepError::Unusable { why, .. }) => {
                let h = Held {
                    file: path.clone(),
                    why,
                };
                let text = held_text(name, &h);
                self.hold(id, name, h);
                return Err(held(id, &text));
            }
            Err(e @ KeepError::Older { .. }) => {
                return Err(RequestError::Conflict(format!(
                    "job {id}, part on appliance {name:?}: {e}"
                )))
            }
            Err(KeepError::Write(e)) => return Err(RequestError::State(e)),
        }
        let info = CheckpointInfo {
            id,
            round_range: rounds.range(),
            bytes,
            taken_unix_ms: unix_ms(),
            file: path.display().to_string(),
        };
        let mut inner = self.lock();
        if inner.jobs.contains_key(&id) {
            inner
                .checkpoints
                .taken
                .insert((id, name.to_string()), info.clone());
            Ok(info)
        } else {
            // Evicted meanwhile: the file must not outlive the job.
            let _ = std::fs::remove_file(&path);
            Err(not_admitted(id))
        }
    }

    /// Checkpoints every job whose spec asks for it and one of whose parts'
    /// last checkpoint is older than its interval (or missing); never a
    /// held job.
    pub(super) fn periodic_checkpoints(&self) {
        let now = unix_ms();
        let due: Vec<u16> = {
            let inner = self.lock();
            inner
                .jobs
                .values()
                .filter(|j| {
                    inner.standing(j) == Standing::InService
                        && j.spec.checkpoint_interval_s.is_some_and(|s| {
                            let last = j
                                .parts
                                .iter()
                                .map(|p| {
                                    inner
                                        .checkpoints
                                        .taken
                                        .get(&(j.id, p.appliance.clone()))
                                        .map_or(0, |c| c.taken_unix_ms)
                                })
                                .min()
                                .unwrap_or(0);
                            now.saturating_sub(last) >= u64::from(s) * 1000
                        })
                })
                .map(|j| j.id)
                .collect()
        };
        for id in due {
            if let Err(e) = self.checkpoint(id) {
                log::warn!("periodic checkpoint of job {id}: {e}");
            }
        }
    }

    /// The checkpoint to restore `job`'s part on appliance `name` from,
    /// moved onto the part's layout when it was taken on another (the part
    /// was placed anew since): `None` when the part has none (no file, and
    /// control took none). A file that cannot be read or decoded, is not
    /// the part's ([`Owner::check`]: another job's, another admission's,
    /// another part's), or cannot be moved, is refused, and so is a
    /// missing file control took a checkpoint into: the part must then be
    /// held, not installed without it.
    pub(super) fn checkpoint_for(&self, job: &InstallJob, name: &str) -> Result<Option<Restore>, Held> {
        // The stored job is cloned so that the file is read unlocked.
        let (stored, recorded) = {
            let inner = self.lock();
            let Some(stored) = inner.jobs.get(&job.id).cloned() else {
                return Ok(None);
            };
            let recorded = inner.checkpoints.taken.get(&(job.id, name.to_string())).cloned();
            (stored, recorded)
        };
        let Some(part) = stored.part_on(name) else {
            return Ok(None);
        };
        let path = checkpoint_path(&self.state_path, &stored, name);
        let unusable = |why: String| Held {
            file: path.clone(),
            why,
        };
        // Read as it streams first (structure, CRC, whose it is, its
        // layout), so that a part restored onto the layout it was taken on
        // is sent from the file as it is, never held in memory.
        let owner = owner(&stored, name, &part);
        let found = ckpt_file::scan(&path, &owner).map_err(unusable)?;
        let Some((ckpt, len)) = found else {
            return match recorded {
                None => Ok(None),
                Some(c) => Err(unusable(format!(
                    "the file is gone (control took it: {}, {} bytes)",
                    rounds_text(c.round_range),
                    c.bytes
                ))),
            };
        };
        let round_range = ckpt.round_range();
        if ckpt.job.layout == job.layout {
            return Ok(Some(Restore {
                body: RestoreBody::File { bytes: len },
                round_range,
                file: path,
            }));
        }
        // Moved onto another layout: read whole, its values moved chunk by
        // chunk.
        let ckpt = match ckpt_file::read(&path, &owner).map_err(unusable)? {
            Some((_, c)) => c,
            None => return Err(unusable("the file went away while it was read".into())),
        };
        let moved = ckpt
            .relayout(job.layout.clone())
            .and_then(|c| c.encode())
            .map_err(|e| unusable(format!("it cannot be moved onto the part's layout: {e}")))?;
        log::info!(
            "job {} on appliance {name:?}: its checkpoint is moved onto its new layout, chunk by chunk",
            job.id
        );
        Ok(Some(Restore {
            body: RestoreBody::Bytes(moved),
            round_range,
            file: path,
        }))
    }

    /// Holds job `id`'s part on appliance `name` for `h`: it is not
    /// installed, its checkpoint is no longer listed, and the job says why
    /// (logged once per reason).
    pub(super) fn hold(&self, id: u16, name: &str, h: Held) {
        let mut inner = self.lock();
        let Some(job) = inner.jobs.get(&id) else {
            return;
        };
        let job_name = job.spec.name.clone();
        let key = (id, name.to_string());
        inner.checkpoints.taken.remove(&key);
        if inner.checkpoints.held.get(&key) != Some(&h) {
            log::error!(
                "job {id} ({job_name:?}) held: part on appliance {name:?}: checkpoint {} unusable: {}; the part \
                 is not installed and the file is not written over: repair or restore it, then `phubctl job \
                 retry {id}` (or `--discard-checkpoint` to set it aside and start the part over)",
                h.file.display(),
                h.why
            );
            inner.checkpoints.held.insert(key, h);
        }
    }
}

/// Where control keeps `job`'s checkpoint of its part on appliance
/// `name`: beside the state file; one file for a job on one appliance
/// (`.job-ID.ckpt`, as before sharding), one per appliance for a job over
/// several, flat or hierarchical (`.job-ID.NAME.ckpt`).
pub(super) fn checkpoint_path(state: &std::path::Path, job: &StoredJob, name: &str) -> PathBuf {
    let id = job.id;
    if job.parts.len() > 1 {
        state::sibling(state, &format!(".job-{id}.{name}.ckpt"))
    } else {
        debug_assert!(
            job.parts.iter().all(|p| p.appliance == name),
            "job {id} has no part on {name:?}"
        );
        state::sibling(state, &format!(".job-{id}.ckpt"))
    }
}

/// Held while a checkpoint file is written or set aside (`job checkpoint`,
/// periodic checkpoints, `job retry`), so that two writers never race on
/// one file, its temporary or its `.prev`. Taken after `Shared::ops` when
/// both are.
pub(super) static CHECKPOINT_FILES: Mutex<()> = Mutex::new(());

/// A checkpoint to restore a part from, on the part's layout.
#[derive(Debug)]
pub(super) struct Restore {
    /// What to send the appliance.
    pub(super) body: RestoreBody,
    /// Its lowest and highest completed round.
    pub(super) round_range: Option<(u32, u32)>,
    /// The part's checkpoint file it was read from.
    pub(super) file: PathBuf,
}

/// What a restore sends.
#[derive(Debug)]
pub(super) enum RestoreBody {
    /// The file as it is (taken on the part's layout), streamed from it:
    /// its length when it was read.
    File {
        /// Its bytes.
        bytes: u64,
    },
    /// The checkpoint moved onto the part's layout, in memory.
    Bytes(Vec<u8>),
}

/// What a checkpoint of job `job`'s part on appliance `name` must describe;
/// `part` is that part's layout ([`StoredJob::part_on`]).
pub(super) fn owner<'a>(job: &'a StoredJob, name: &'a str, part: &'a Layout) -> Owner<'a> {
    let rack = job.part_index(name).and_then(|i| u16::try_from(i).ok());
    // A replicated hierarchical job's checkpoints are of its flat form,
    // its home part's (PROTOCOL.md §11.11).
    let shape = match (job.rack_layout_on(name).filter(|_| !job.is_replicated()), rack) {
        (Some(layout), Some(rack)) => PartShape::Rack { rack, layout },
        _ => PartShape::Flat(part),
    };
    Owner {
        id: job.id,
        token: job.token,
        spec: &job.spec,
        appliance: name,
        part: shape,
    }
}

/// "part on appliance "b": checkpoint FILE unusable: WHY".
pub(super) fn held_text(name: &str, h: &Held) -> String {
    format!(
        "part on appliance {name:?}: checkpoint {} unusable: {}",
        h.file.display(),
        h.why
    )
}

/// "rounds 3..=5", "round 3", "no completed round".
pub(super) fn rounds_text(r: Option<(u32, u32)>) -> String {
    match r {
        None => "no completed round".into(),
        Some((a, b)) if a == b => format!("round {a}"),
        Some((a, b)) => format!("rounds {a}..={b}"),
    }
}

/// When `path` was last written, in milliseconds since the Unix epoch (0
/// if that cannot be told).
pub(super) fn modified_ms(path: &std::path::Path) -> u64 {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A job's last checkpoint over all its parts: rounds spanned, bytes
/// added up, the oldest part's time, the files listed (", "); `None`
/// until every part has one.
pub(super) fn combined_checkpoint(inner: &Inner, job: &StoredJob) -> Option<CheckpointInfo> {
    let mut all: Option<CheckpointInfo> = None;
    for p in &job.parts {
        let c = inner.checkpoints.taken.get(&(job.id, p.appliance.clone()))?;
        all = Some(match all {
            None => c.clone(),
            Some(a) => CheckpointInfo {
                id: a.id,
                round_range: match (a.round_range, c.round_range) {
                    (Some((x, y)), Some((u, v))) => Some((x.min(u), y.max(v))),
                    (x, y) => x.or(y),
                },
                bytes: a.bytes + c.bytes,
                taken_unix_ms: a.taken_unix_ms.min(c.taken_unix_ms),
                file: format!("{}, {}", a.file, c.file),
            },
        });
    }
    all
}

pub(super) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The checkpoints found beside the state file for the admitted jobs'
/// parts: those usable, and the parts held for a file that is there but
/// unusable ([`ckpt_file::read`]), so that a part held before a restart is
/// held after it. A file `files` read before for the same part, and that
/// is the same file since (its device, inode, size and times), is not
/// read again: a follower of the state in etcd does this every quarter
/// lease TTL, and a part's checkpoint can be gigabytes.
pub(super) fn load_checkpoints(
    state: &std::path::Path,
    jobs: &BTreeMap<u16, StoredJob>,
    files: &mut CheckpointFiles,
) -> Checkpoints {
    let mut out = Checkpoints::default();
    let mut seen = BTreeMap::new();
    for job in jobs.values() {
        let id = job.id;
        for (name, part) in job.part_layouts() {
            let path = checkpoint_path(state, job, name);
            let key = (id, name.to_string());
            let owner = owner(job, name, &part);
            let Some(stamp) = FileStamp::of(&path) else {
                // Absent (or not to be looked at): read, which says which.
                if let Some(read) = read_part(&path, &owner, job, name) {
                    out.record(key, read);
                }
                continue;
            };
            let part_of = PartOf::of(&owner);
            let read = match files.seen.remove(&key) {
                Some((s, p, read)) if s == stamp && p == part_of => read,
                _ => {
                    files.reads += 1;
                    match read_part(&path, &owner, job, name) {
                        Some(read) => read,
                        None => continue,
                    }
                }
            };
            seen.insert(key.clone(), (stamp, part_of, read.clone()));
            out.record(key, read);
        }
    }
    files.seen = seen;
    out
}

/// A part's checkpoint file as [`load_checkpoints`] found it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PartRead {
    /// Usable.
    Taken(CheckpointInfo),
    /// There, but unusable.
    Held(Held),
}

impl Checkpoints {
    fn record(&mut self, key: (u16, String), read: PartRead) {
        match read {
            PartRead::Taken(c) => {
                self.taken.insert(key, c);
            }
            PartRead::Held(h) => {
                self.held.insert(key, h);
            }
        }
    }
}

/// Reads part `name`'s checkpoint file of `job` at `path` (`None`: there is
/// none); one that cannot be used is logged.
fn read_part(path: &std::path::Path, owner: &Owner<'_>, job: &StoredJob, name: &str) -> Option<PartRead> {
    let id = job.id;
    match ckpt_file::read(path, owner) {
        Ok(None) => None,
        Ok(Some((bytes, c))) => Some(PartRead::Taken(CheckpointInfo {
            id,
            round_range: c.round_range(),
            bytes: bytes.len() as u64,
            taken_unix_ms: modified_ms(path),
            file: path.display().to_string(),
        })),
        Err(why) => {
            let h = Held {
                file: path.to_path_buf(),
                why,
            };
            log::error!(
                "job {id} ({:?}) held: {}; the part is not installed and the file is not written \
                 over: repair or restore it, then `phubctl job retry {id}` (or `--discard-checkpoint`)",
                job.spec.name,
                held_text(name, &h)
            );
            Some(PartRead::Held(h))
        }
    }
}

/// What [`load_checkpoints`] read last time, by part, and how many files
/// it has read.
#[derive(Debug, Default)]
pub(super) struct CheckpointFiles {
    seen: BTreeMap<(u16, String), (FileStamp, PartOf, PartRead)>,
    /// Files read (not taken from `seen`) so far.
    pub(super) reads: u64,
}

/// Which file a path is, and as which write: a checkpoint is written to a
/// temporary file renamed over the last (another inode), and any write
/// moves its change time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    fn of(path: &std::path::Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// What a part's file is checked against ([`Owner`]), less the spec, which
/// a job id and token fix.
#[derive(Debug, Clone, PartialEq)]
struct PartOf {
    token: u64,
    appliance: String,
    part: PartShapeOf,
}

#[derive(Debug, Clone, PartialEq)]
enum PartShapeOf {
    Flat(Layout),
    Rack(u16, Layout),
}

impl PartOf {
    fn of(owner: &Owner<'_>) -> PartOf {
        PartOf {
            token: owner.token,
            appliance: owner.appliance.to_string(),
            part: match &owner.part {
                PartShape::Flat(l) => PartShapeOf::Flat((*l).clone()),
                PartShape::Rack { rack, layout } => PartShapeOf::Rack(*rack, (*layout).clone()),
            },
        }
    }
}

#[cfg(test)]
mod tests {

    use phub_proto::spec::JobSpec;

    use super::*;

    fn job(token: u64) -> StoredJob {
        state::test_job(3, token, JobSpec::new("k", 2, &[64]), &["a"])
    }

    /// A file read once is not read again while it is the same file for
    /// the same part (a follower's reload every quarter TTL); a rewritten
    /// file, or another admission of the job's id, is.
    #[test]
    fn an_unchanged_checkpoint_file_is_not_read_again() {
        let dir = std::env::temp_dir().join(format!("phub-control-ckpt-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("state.json");
        let jobs: BTreeMap<u16, StoredJob> = [(3, job(7))].into();
        let path = checkpoint_path(&state, &jobs[&3], "a");
        let mut files = CheckpointFiles::default();

        // No file: nothing read, nothing held.
        let c = load_checkpoints(&state, &jobs, &mut files);
        assert!(c.taken.is_empty() && c.held.is_empty());
        assert_eq!(files.reads, 0);

        // A file that is no checkpoint holds the part, read once.
        std::fs::write(&path, b"not a checkpoint").unwrap();
        for _ in 0..3 {
            let c = load_checkpoints(&state, &jobs, &mut files);
            let why = c.held_reason(3).expect("held");
            assert!(why.contains(&path.display().to_string()), "{why}");
            assert_eq!(files.reads, 1, "read once");
        }

        // Rewritten as a checkpoint is (another file renamed over it): read.
        let tmp = dir.join("tmp");
        std::fs::write(&tmp, b"still not a checkpoint, longer").unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        load_checkpoints(&state, &jobs, &mut files);
        load_checkpoints(&state, &jobs, &mut files);
        assert_eq!(files.reads, 2);

        // Another admission of id 3 (another token): read for it.
        let again: BTreeMap<u16, StoredJob> = [(3, job(8))].into();
        load_checkpoints(&state, &again, &mut files);
        assert_eq!(files.reads, 3);

        // Gone: nothing held, and nothing kept of it.
        std::fs::remove_file(&path).unwrap();
        let c = load_checkpoints(&state, &again, &mut files);
        assert!(c.held.is_empty() && files.seen.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
