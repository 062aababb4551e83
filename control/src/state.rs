//! The state file: every admitted job with its id, token, spec, layout and
//! joined ranks, as JSON. Written atomically (temporary file, fsync, rename,
//! fsync of the directory) so a crash leaves the old or the new state, never
//! a torn one.

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use phub_proto::api::hex_u64;
use phub_proto::layout::Layout;
use phub_proto::spec::JobSpec;
use serde::{Deserialize, Serialize};

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
}

/// The whole file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StateFile {
    /// Admitted jobs, by ascending id.
    pub(crate) jobs: Vec<StoredJob>,
}

/// The whole file, borrowed for writing.
#[derive(Serialize)]
struct StateRef<'a> {
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
    /// Writing failed.
    #[error("cannot write state file {}: {source}", path.display())]
    Write {
        /// The file (or its temporary sibling or directory).
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Loads the state file; `None` when it does not exist.
pub(crate) fn load(path: &Path) -> Result<Option<StateFile>, StateError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(StateError::Read {
                path: path.to_owned(),
                source,
            })
        }
    };
    let corrupt = |reason: String| StateError::Corrupt {
        path: path.to_owned(),
        reason,
    };
    let state: StateFile = serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
    let mut ids = BTreeSet::new();
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
        if job.layout.lcores.len() > crate::admission::MAX_LCORES {
            return Err(corrupt(format!(
                "job {}: layout has {} lcores, more than the {} a place can name",
                job.id,
                job.layout.lcores.len(),
                crate::admission::MAX_LCORES
            )));
        }
        let chunks: usize = job.layout.keys.iter().map(Vec::len).sum();
        if job.layout.keys.len() != job.spec.keys.len() || chunks != job.layout.chunk_count() {
            return Err(corrupt(format!("job {}: layout does not match its spec", job.id)));
        }
        if let Some(r) = job.joined.iter().find(|&&r| u32::from(r) >= job.spec.workers) {
            return Err(corrupt(format!(
                "job {}: joined rank {r} is outside 0..{}",
                job.id, job.spec.workers
            )));
        }
    }
    Ok(Some(state))
}

/// Writes the state of `jobs` to `path` atomically: `path.tmp` is written and synced,
/// renamed over `path`, and the directory is synced.
pub(crate) fn save(path: &Path, jobs: &[&StoredJob]) -> Result<(), StateError> {
    let mut text = serde_json::to_vec_pretty(&StateRef { jobs }).expect("state serialises");
    text.push(b'\n');
    write_atomic(path, &text)
}

/// Replaces `path` with `bytes` atomically: a temporary file beside it,
/// written and synced, renamed over it, and the directory synced.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = |p: &Path| {
        let p = p.to_owned();
        move |source| StateError::Write { path: p, source }
    };
    let mut f = fs::File::create(&tmp).map_err(write(&tmp))?;
    f.write_all(bytes).map_err(write(&tmp))?;
    f.sync_all().map_err(write(&tmp))?;
    drop(f);
    fs::rename(&tmp, path).map_err(write(path))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write(dir))?;
    Ok(())
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
        let layout = layout(&spec, &mut [0, 0]);
        let state = StateFile {
            jobs: vec![StoredJob {
                id: 3,
                token: 0xdead_beef,
                spec,
                layout,
                joined: [1].into(),
            }],
        };
        save(&path, &state.jobs.iter().collect::<Vec<_>>()).unwrap();
        assert!(!dir.join("s.json.tmp").exists());
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"00000000deadbeef\""), "{text}");
        assert_eq!(load(&path).unwrap(), Some(state));

        fs::write(&path, "{\"jobs\": [").unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(
            e.contains("s.json") && e.contains("corrupt") && e.contains("EOF"),
            "{e}"
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
