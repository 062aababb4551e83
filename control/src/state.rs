//! The state file: the appliances control manages and every admitted job
//! with its id, token, spec, layout and joined ranks, as JSON, under the
//! format version [`FORMAT_VERSION`]. Written atomically (temporary file, fsync, rename,
//! fsync of the directory) so a crash leaves the old or the new state, never
//! a torn one; created 0600, since it holds every job's token (so are
//! checkpoints, written the same way). One phub-control at a time uses a
//! state file ([`lock`]); only a regular file of at most
//! [`MAX_STATE_BYTES`] is read.
//!
//! The same content may instead live in etcd ([`etcd`]); [`store`] is the
//! seam between the two.

pub(crate) mod etcd;
pub(crate) mod store;
pub(crate) mod transfer;

use std::collections::BTreeSet;
use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use phub_proto::api::{hex_u64, ApplianceSpec, Rereplication};
use phub_proto::failover::EpochView;
use phub_proto::layout::{Layout, Placement, PER_CHUNK_FORM};
use phub_proto::spec::JobSpec;
use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

/// The format version this phub-control writes (`"version": 1`) and reads.
///
/// - Without a `version`: written before the file stated one. Such a file
///   is read as version 1, its appliances and job parts filled in when it
///   predates sharding ([`load`]), unless its layouts are in the per-chunk
///   form of the versions before layouts were described by rule: that one
///   is refused by name, never converted (its chunks would move to other
///   slots, while the dataplanes and the checkpoints hold them where the
///   old layout put them).
/// - 1: the appliances, and per job its parts and, for a hierarchical
///   job, its rack layouts.
///
/// A file of any other version is refused, naming it.
pub(crate) const FORMAT_VERSION: u32 = 1;

/// One admitted job as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StoredJob {
    /// Job id.
    pub(crate) id: u16,
    /// Job token.
    #[serde(with = "hex_u64")]
    pub(crate) token: u64,
    /// The spec as admitted.
    pub(crate) spec: JobSpec,
    /// The layout as installed.
    pub(crate) layout: Layout,
    /// Ranks that have joined.
    pub(crate) joined: BTreeSet<u16>,
    /// The appliances holding the job, in layout order, each with the
    /// number of the layout's lcores that are its. A state file written
    /// before sharding has none: the job is on the one appliance
    /// "default" (filled in by [`load`]).
    #[serde(default)]
    pub(crate) parts: Vec<StoredPart>,
    /// Why the job failed (the dataplane can no longer hold it), if it did:
    /// it is then never reinstalled and joins are refused with the reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) failed: Option<String>,
    /// Flat, or hierarchical with its rack layouts; stored as `racks`
    /// (absent for a flat job).
    #[serde(default, rename = "racks", skip_serializing_if = "JobShape::is_flat")]
    pub(crate) shape: JobShape,
    /// A replicated job's epoch (PROTOCOL.md §11.6): its number and the
    /// appliances declared down since admission. Left out at epoch 0
    /// (every job when admitted, and every job of a file written before
    /// failover), which is read back as that.
    #[serde(default, skip_serializing_if = "is_epoch_zero")]
    pub(crate) epoch: EpochView,
    /// A replicated job's last re-replication (PROTOCOL.md §11.7): the
    /// appliance given the job again, at which epoch, when it started and
    /// when the job was back to full strength. Absent before any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rereplication: Option<Rereplication>,
    /// Why a replicated job is stalled (PROTOCOL.md §11.7, "Stalled
    /// jobs"): every replica of some part is down, or lost its state past
    /// a failover; it waits for every appliance of it to answer, then goes
    /// back to its checkpoints as a whole (which clears it). Absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) stalled: Option<String>,
}

/// Whether `e` is epoch 0 with nobody down (what the file leaves out).
fn is_epoch_zero(e: &EpochView) -> bool {
    *e == EpochView::default()
}

/// How a job aggregates: flat, or in a hierarchy of racks. Stored as the
/// list of rack layouts, empty (and left out) for a flat job.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "Vec<Layout>", into = "Vec<Layout>")]
pub(crate) enum JobShape {
    /// Every rank sends to every part of the job's layout.
    #[default]
    Flat,
    /// PROTOCOL.md §9.1: each part's appliance leads a rack, whose ranks
    /// send to it alone; the job's `layout` is the home layout, over which
    /// the racks' appliances exchange partial sums.
    Hierarchical {
        /// The rack layouts, one per part in order, each the whole job
        /// over that appliance's lcores. Never empty.
        racks: Vec<Layout>,
    },
}

impl JobShape {
    /// Whether the job is flat (what the state file leaves out).
    pub(crate) fn is_flat(&self) -> bool {
        matches!(self, JobShape::Flat)
    }
}

impl From<Vec<Layout>> for JobShape {
    fn from(racks: Vec<Layout>) -> JobShape {
        if racks.is_empty() {
            JobShape::Flat
        } else {
            JobShape::Hierarchical { racks }
        }
    }
}

impl From<JobShape> for Vec<Layout> {
    fn from(shape: JobShape) -> Vec<Layout> {
        match shape {
            JobShape::Flat => Vec::new(),
            JobShape::Hierarchical { racks } => {
                assert!(!racks.is_empty(), "a hierarchical job has racks");
                racks
            }
        }
    }
}

/// One appliance's part of a job: the next `lcores` lcores of its layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StoredPart {
    /// The appliance's name.
    pub(crate) appliance: String,
    /// Lcores of the layout that are its.
    pub(crate) lcores: u32,
}

/// The name of the appliance `--dataplane` gives, and that the jobs of a
/// state file written before sharding are on.
pub(crate) const DEFAULT_APPLIANCE: &str = "default";

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StateFile {
    /// The format version ([`FORMAT_VERSION`]); `None` in a file written
    /// before the file stated one.
    #[serde(default)]
    pub(crate) version: Option<u32>,
    /// The appliances control manages; `None` in a state file written
    /// before sharding (its appliance is `--dataplane`'s).
    #[serde(default)]
    pub(crate) appliances: Option<Vec<ApplianceSpec>>,
    /// Admitted jobs, by ascending id.
    pub(crate) jobs: Vec<StoredJob>,
}

/// The whole file, borrowed for writing.
#[derive(Serialize)]
struct StateRef<'a> {
    version: u32,
    appliances: &'a [&'a ApplianceSpec],
    jobs: &'a [&'a StoredJob],
}

/// Why the state file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StateError {
    /// Reading failed (other than the file being absent).
    #[error("cannot read state file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a valid state.
    #[error("state file {} is corrupt: {reason}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The path is not a state file phub-control may read.
    #[error("state file {} cannot be used: {reason}", path.display())]
    Unusable {
        /// The file.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// Another phub-control holds the state file.
    #[error(
        "state file {} is in use by another phub-control (its lock {} is held); stop that one or give --state another file",
        path.display(),
        lock.display()
    )]
    InUse {
        /// The file.
        path: PathBuf,
        /// Its lock file.
        lock: PathBuf,
    },
    /// Writing failed.
    #[error("cannot write state file {}: {source}", path.display())]
    Write {
        /// The file (or its temporary sibling or directory).
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The state is in etcd, which could not be read or written.
    #[error(transparent)]
    Etcd(#[from] etcd::EtcdError),
}

/// The largest state file read (1 GiB): a FIFO, a device or a runaway file
/// is refused instead of read without end.
pub(crate) const MAX_STATE_BYTES: u64 = 1 << 30;

/// Loads the state file; `None` when it does not exist. Anything but a
/// regular file of at most [`MAX_STATE_BYTES`] is refused without being
/// opened for reading (a FIFO would block, a device never end).
pub(crate) fn load(path: &Path) -> Result<Option<StateFile>, StateError> {
    let read_error = |source| StateError::Read {
        path: path.to_owned(),
        source,
    };
    let unusable = |reason: String| StateError::Unusable {
        path: path.to_owned(),
        reason,
    };
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(read_error(source)),
    };
    if !meta.is_file() {
        return Err(unusable(format!(
            "not a regular file ({:?}); expected a JSON file phub-control writes",
            meta.file_type()
        )));
    }
    if meta.len() > MAX_STATE_BYTES {
        return Err(unusable(format!(
            "{} bytes, more than the {MAX_STATE_BYTES} a state file may have",
            meta.len()
        )));
    }
    let mut text = String::new();
    fs::File::open(path)
        .and_then(|f| f.take(MAX_STATE_BYTES + 1).read_to_string(&mut text))
        .map_err(read_error)?;
    if text.len() as u64 > MAX_STATE_BYTES {
        return Err(unusable(format!(
            "grew beyond {MAX_STATE_BYTES} bytes while it was read"
        )));
    }
    let corrupt = |reason: String| StateError::Corrupt {
        path: path.to_owned(),
        reason,
    };
    let head: Head = serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
    match head.version {
        Some(FORMAT_VERSION) => {}
        Some(v) => {
            return Err(unusable(format!(
                "format version {v}; this phub-control reads version {FORMAT_VERSION} and files without a \
                 version (written before the file stated one)"
            )))
        }
        None => {
            if let Some(id) = per_chunk_job(&text) {
                return Err(unusable(format!(
                    "job {id} has {PER_CHUNK_FORM}. Evict its jobs with the phub-control that wrote it, or \
                     move the file away and admit the jobs again"
                )));
            }
        }
    }
    let mut state: StateFile = serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
    assert_eq!(state.version, head.version, "one file, read twice");
    let mut names = BTreeSet::new();
    for a in state.appliances.iter().flatten() {
        if !phub_proto::spec::appliance_name_ok(&a.name) {
            return Err(corrupt(format!(
                "appliance name {:?}: expected {}",
                a.name,
                phub_proto::spec::APPLIANCE_NAME_RULE
            )));
        }
        if !names.insert(a.name.as_str()) {
            return Err(corrupt(format!("appliance {:?} appears twice", a.name)));
        }
    }
    let mut ids = BTreeSet::new();
    for job in &mut state.jobs {
        if job.parts.is_empty() {
            job.parts.push(StoredPart {
                appliance: DEFAULT_APPLIANCE.into(),
                lcores: u32::try_from(job.layout.lcores.len()).unwrap_or(u32::MAX),
            });
        }
        let spanned: u64 = job.parts.iter().map(|p| u64::from(p.lcores)).sum();
        if spanned != job.layout.lcores.len() as u64 {
            return Err(corrupt(format!(
                "job {}: its parts name {spanned} lcores, its layout has {}",
                job.id,
                job.layout.lcores.len()
            )));
        }
        let mut on = BTreeSet::new();
        if let Some(p) = job
            .parts
            .iter()
            .find(|p| !on.insert(p.appliance.as_str()) || p.lcores == 0)
        {
            return Err(corrupt(format!(
                "job {}: appliance {:?} has no lcores in its layout or appears twice",
                job.id, p.appliance
            )));
        }
    }
    for job in &state.jobs {
        if job.id == 0 {
            return Err(corrupt("job id 0 (ids are 1 to 65535)".into()));
        }
        if !ids.insert(job.id) {
            return Err(corrupt(format!("job {} appears twice", job.id)));
        }
        job.spec
            .validate()
            .map_err(|e| corrupt(format!("job {}: {e}", job.id)))?;
        Placement::new(&job.spec, job.layout.clone()).map_err(|e| {
            corrupt(format!(
                "job {}: its layout does not place its spec's chunks: {e}",
                job.id
            ))
        })?;
        if let Some(r) = job.joined.iter().find(|&&r| u32::from(r) >= job.spec.workers) {
            return Err(corrupt(format!(
                "job {}: joined rank {r} is outside 0..{}",
                job.id, job.spec.workers
            )));
        }
    }
    Ok(Some(state))
}

/// The state file's version, read before the rest (every other field is
/// skipped).
#[derive(Deserialize)]
struct Head {
    #[serde(default)]
    version: Option<u32>,
}

/// A job of a file without a version, as far as telling its layout's form
/// needs: the per-chunk form had `keys` beside `lcores`, and a list of
/// chunks per lcore where the form by rule has one `{"first", "count"}`
/// run. Only what is needed is read; the rest is checked by [`StateFile`].
#[derive(Deserialize)]
struct OldJob {
    #[serde(default)]
    id: Option<u16>,
    layout: OldLayout,
}

#[derive(Deserialize)]
struct OldLayout {
    #[serde(default)]
    keys: Option<IgnoredAny>,
    #[serde(default)]
    lcores: Vec<serde_json::Value>,
}

#[derive(Deserialize)]
struct OldFile {
    #[serde(default)]
    jobs: Vec<OldJob>,
}

/// The id of the first job of `text` (a file without a version) whose
/// layout is in the per-chunk form, if one is (0 if it has no id); `None`
/// too when `text` does not read as such a file at all (then parsing it
/// as a [`StateFile`] says what is wrong).
fn per_chunk_job(text: &str) -> Option<u16> {
    let old: OldFile = serde_json::from_str(text).ok()?;
    old.jobs
        .iter()
        .find(|j| j.layout.keys.is_some() || j.layout.lcores.iter().any(serde_json::Value::is_array))
        .map(|j| j.id.unwrap_or(0))
}

/// Writes the state of `appliances` and `jobs` to `path` atomically:
/// `path.tmp` is written and synced, renamed over `path`, and the directory
/// is synced.
pub(crate) fn save(
    path: &Path,
    appliances: &[&ApplianceSpec],
    jobs: &[&StoredJob],
) -> Result<(), StateError> {
    // Compact: a spec may list a million keys, and every join rewrites it.
    let state = StateRef {
        version: FORMAT_VERSION,
        appliances,
        jobs,
    };
    let mut text = serde_json::to_vec(&state).expect("state serialises");
    text.push(b'\n');
    write_atomic(path, &text)
}

/// The file beside `path` named as it is with `suffix` appended (the state
/// file's temporary, lock, operator token and checkpoints).
pub(crate) fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(suffix);
    path.with_file_name(name)
}

/// Replaces `path` with `bytes` atomically: a temporary file beside it,
/// written and synced, renamed over it, and the directory synced.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let tmp = sibling(path, ".tmp");
    let write = |p: &Path| {
        let p = p.to_owned();
        move |source| StateError::Write { path: p, source }
    };
    let mut f = create_private(&tmp).map_err(write(&tmp))?;
    let written = f.write_all(bytes).and_then(|()| f.sync_all());
    if let Err(e) = written {
        // A full disk leaves a partial temporary: it must not stay behind
        // (it holds tokens, and takes the room the next write needs).
        let _ = fs::remove_file(&tmp);
        return Err(write(&tmp)(e));
    }
    rename_synced(&tmp, path)
}

/// Creates `path` afresh, 0600, for writing: a leftover one (which may
/// have other permissions) is removed first. A read-only directory says
/// so in the removal, not as "File exists" in the creation.
pub(crate) fn create_private(path: &Path) -> std::io::Result<fs::File> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Renames the synced file `from` to `path` (replacing what is there) and
/// syncs the directory, so that the rename survives a crash.
pub(crate) fn rename_synced(from: &Path, path: &Path) -> Result<(), StateError> {
    let write = |p: &Path| {
        let p = p.to_owned();
        move |source| StateError::Write { path: p, source }
    };
    fs::rename(from, path).map_err(write(path))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write(dir))?;
    Ok(())
}

/// An exclusive lock on a state file, held while a phub-control uses it, so
/// that a second one on the same file fails to start instead of
/// interleaving its writes. The lock is on `<state>.lock` (0600), since the
/// state file itself is replaced by every write; the kernel drops it when
/// the holder exits, however it exits.
#[derive(Debug)]
pub(crate) struct StateLock {
    _file: fs::File,
}

/// Takes the lock of the state file `path`, or says who holds it.
pub(crate) fn lock(path: &Path) -> Result<StateLock, StateError> {
    let lock = sibling(path, ".lock");
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock)
        .map_err(|source| StateError::Write {
            path: lock.clone(),
            source,
        })?;
    match file.try_lock() {
        Ok(()) => Ok(StateLock { _file: file }),
        Err(fs::TryLockError::WouldBlock) => Err(StateError::InUse {
            path: path.to_owned(),
            lock,
        }),
        Err(fs::TryLockError::Error(source)) => Err(StateError::Write { path: lock, source }),
    }
}

/// A flat job of `spec` admitted as `id` with `token`, one lcore on each
/// of `appliances`, nothing joined (tests').
#[cfg(test)]
pub(crate) fn test_job(id: u16, token: u64, spec: JobSpec, appliances: &[&str]) -> StoredJob {
    StoredJob {
        id,
        token,
        layout: phub_proto::layout::layout(&spec, &mut vec![0; appliances.len()], u64::from),
        spec,
        joined: BTreeSet::new(),
        parts: appliances
            .iter()
            .map(|n| StoredPart {
                appliance: (*n).into(),
                lcores: 1,
            })
            .collect(),
        failed: None,
        shape: JobShape::Flat,
        epoch: EpochView::default(),
        rereplication: None,
        stalled: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use phub_proto::layout::layout;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("phub-control-state-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trip_and_errors_name_the_file() {
        let dir = temp_dir("rt");
        let path = dir.join("s.json");
        assert!(load(&path).unwrap().is_none());
        let spec = JobSpec::from_toml(
            "name = \"a\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 5000\n",
        )
        .unwrap();
        let layout = layout(&spec, &mut [0, 0], u64::from);
        let a = ApplianceSpec {
            name: "a".into(),
            url: "http://127.0.0.1:7800".into(),
            rack: "r1".into(),
            token_file: None,
            draining: false,
        };
        let b = ApplianceSpec {
            name: "b".into(),
            url: "http://127.0.0.1:7801".into(),
            rack: "r2".into(),
            token_file: Some("/run/phub/b.token".into()),
            draining: false,
        };
        let state = StateFile {
            version: Some(FORMAT_VERSION),
            appliances: Some(vec![a, b]),
            jobs: vec![StoredJob {
                shape: JobShape::Flat,
                id: 3,
                token: 0xdead_beef,
                spec,
                layout,
                joined: [1].into(),
                parts: vec![
                    StoredPart {
                        appliance: "b".into(),
                        lcores: 1,
                    },
                    StoredPart {
                        appliance: "a".into(),
                        lcores: 1,
                    },
                ],
                failed: Some("placed on 4 lcores".into()),
                epoch: EpochView {
                    epoch: 2,
                    down: vec![0],
                    ..Default::default()
                },
                rereplication: None,
                stalled: None,
            }],
        };
        let appliances: Vec<&ApplianceSpec> = state.appliances.iter().flatten().collect();
        save(&path, &appliances, &state.jobs.iter().collect::<Vec<_>>()).unwrap();
        assert!(!dir.join("s.json.tmp").exists());
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"00000000deadbeef\""), "{text}");
        assert_eq!(load(&path).unwrap(), Some(state));

        // A state file written before failover: its job is at epoch 0,
        // nobody down.
        let mut old: serde_json::Value = serde_json::from_str(&text).unwrap();
        old["jobs"][0].as_object_mut().unwrap().remove("epoch");
        fs::write(&path, old.to_string()).unwrap();
        assert_eq!(load(&path).unwrap().unwrap().jobs[0].epoch, EpochView::default());

        // A state file written before sharding: its jobs are on "default".
        let mut old: serde_json::Value = serde_json::from_str(&text).unwrap();
        old.as_object_mut().unwrap().remove("appliances");
        old["jobs"][0].as_object_mut().unwrap().remove("parts");
        fs::write(&path, old.to_string()).unwrap();
        let loaded = load(&path).unwrap().unwrap();
        assert_eq!(loaded.appliances, None);
        assert_eq!(
            loaded.jobs[0].parts,
            [StoredPart {
                appliance: "default".into(),
                lcores: 2
            }]
        );
        // Parts that do not add up to the layout are corrupt, named.
        old["jobs"][0]["parts"] = serde_json::json!([{"appliance": "a", "lcores": 3}]);
        fs::write(&path, old.to_string()).unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(
            e.contains("job 3: its parts name 3 lcores, its layout has 2"),
            "{e}"
        );

        fs::write(&path, "{\"jobs\": [").unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(
            e.contains("s.json") && e.contains("corrupt") && e.contains("EOF"),
            "{e}"
        );
        let _ = fs::remove_dir_all(&dir);
    }

    /// A state file of the version before layouts were described by rule
    /// is refused with what it is and what to do, not as "corrupt".
    #[test]
    fn a_state_file_with_per_chunk_layouts_is_refused_by_name() {
        let dir = temp_dir("old");
        let path = dir.join("s.json");
        fs::write(
            &path,
            r#"{"jobs": [{"id": 1, "token": "00000000deadbeef",
                "spec": {"name": "a", "workers": 2, "dtype": "f32", "chunk_bytes": 64,
                         "optimizer": {"kind": "sum"}, "consistency": {"mode": "sync"},
                         "keys": [{"name": "", "elements": 20}]},
                "layout": {"chunk_elems": 16,
                           "keys": [[{"lcore": 0, "slot": 0}, {"lcore": 1, "slot": 0}]],
                           "lcores": [[{"key": 0, "chunk": 0, "elems": 16}], [{"key": 0, "chunk": 1, "elems": 4}]]},
                "joined": []}]}"#,
        )
        .unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("s.json cannot be used"), "{e}");
        assert!(
            e.contains("per-chunk form") && e.contains("Evict its jobs with the phub-control that wrote it"),
            "{e}"
        );
        let _ = fs::remove_dir_all(&dir);
    }

    /// The file states its format version; one it does not know is
    /// refused naming the version, not read as if it were this one.
    #[test]
    fn the_format_version_is_written_and_an_unknown_one_refused() {
        let dir = temp_dir("version");
        let path = dir.join("s.json");
        save(&path, &[], &[]).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("{\"version\":1,"), "{text}");
        assert_eq!(load(&path).unwrap().unwrap().version, Some(FORMAT_VERSION));
        fs::write(&path, "{\"version\": 2, \"appliances\": [], \"jobs\": []}").unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(
            e.contains("s.json cannot be used: format version 2; this phub-control reads version 1"),
            "{e}"
        );
        // Without a version: written before the file stated one, read.
        fs::write(&path, "{\"jobs\": []}").unwrap();
        assert_eq!(load(&path).unwrap().unwrap().version, None);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn state_and_its_temporary_are_created_0600_even_over_an_older_0644_file() {
        let dir = temp_dir("mode");
        let path = dir.join("s.json");
        fs::write(&path, "{\"jobs\": []}").unwrap();
        fs::write(dir.join("s.json.tmp"), "left over").unwrap();
        for p in [&path, &dir.join("s.json.tmp")] {
            fs::set_permissions(p, fs::Permissions::from_mode(0o644)).unwrap();
        }
        save(&path, &[], &[]).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        write_atomic(&dir.join("ckpt.bin"), b"token inside").unwrap();
        let mode = fs::metadata(dir.join("ckpt.bin")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_fifo_a_device_or_an_oversized_file_is_refused_without_reading_it() {
        let dir = temp_dir("odd");
        let fifo = dir.join("fifo.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        // Opening the FIFO to read would block: load must not.
        let e = load(&fifo).unwrap_err().to_string();
        assert!(e.contains("fifo.json") && e.contains("not a regular file"), "{e}");
        let e = load(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("/dev/zero") && e.contains("not a regular file"), "{e}");
        let big = dir.join("big.json");
        fs::File::create(&big)
            .unwrap()
            .set_len(MAX_STATE_BYTES + 1)
            .unwrap();
        let e = load(&big).unwrap_err().to_string();
        assert!(e.contains("big.json") && e.contains("more than the"), "{e}");
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn one_holder_of_a_state_files_lock_at_a_time() {
        let dir = temp_dir("lock");
        let path = dir.join("s.json");
        let held = lock(&path).unwrap();
        let e = lock(&path).unwrap_err().to_string();
        assert!(
            e.contains("s.json") && e.contains("in use by another phub-control"),
            "{e}"
        );
        let mode = fs::metadata(dir.join("s.json.lock"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{mode:o}");
        drop(held);
        let _again = lock(&path).unwrap();
        let _ = fs::remove_dir_all(&dir);
    }
}
