//! Bearer secrets kept in owner-only files: the operator token of
//! phub-control and the management token of the dataplane, which control
//! reads to call the dataplane's management API.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// Why a secret file could not be used; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Reading, creating or writing failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file or its directory may be read or replaced by other users,
    /// or holds no usable token.
    #[error("{}: {message}", path.display())]
    Unsafe {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Where phub's daemons keep run-time secrets: `$PHUB_RUNTIME_DIR`, else
/// `/run/phub` for root, else `$XDG_RUNTIME_DIR/phub`, else
/// `/tmp/phub-<uid>`. Made owner-only when missing.
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PHUB_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let uid = euid();
    if uid == 0 {
        return PathBuf::from("/run/phub");
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("phub");
    }
    PathBuf::from(format!("/tmp/phub-{uid}"))
}

/// The default management token file of a dataplane whose management API
/// listens on `port`: `<runtime dir>/dataplane-<port>.token`.
pub fn mgmt_token_path(port: u16) -> PathBuf {
    runtime_dir().join(format!("dataplane-{port}.token"))
}

fn euid() -> u32 {
    // SAFETY: geteuid takes no arguments, cannot fail and touches no memory
    // of ours.
    unsafe { libc::geteuid() }
}

/// Makes `dir` (and its parents) if missing, owner-only; refuses a
/// directory owned by another user or open to others.
fn ensure_private_dir(dir: &Path) -> Result<(), SecretError> {
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| SecretError::Io {
                what: "creating the directory",
                path: dir.to_path_buf(),
                source,
            })?;
    }
    let meta = std::fs::metadata(dir).map_err(|source| SecretError::Io {
        what: "reading",
        path: dir.to_path_buf(),
        source,
    })?;
    let uid = euid();
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(SecretError::Unsafe {
            path: dir.to_path_buf(),
            message: format!(
                "owned by uid {}, not by this user (uid {uid}); remove it or choose another directory",
                meta.uid()
            ),
        });
    }
    // A shared directory (like /tmp itself, sticky and world-writable) is
    // acceptable only when the file is made exclusively; a directory that
    // others may write without the sticky bit lets them replace the file.
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(SecretError::Unsafe {
            path: dir.to_path_buf(),
            message: format!(
                "writable by other users (mode {:o}) without the sticky bit",
                mode & 0o7777
            ),
        });
    }
    Ok(())
}

/// Reads the token in `path`: one line of at least 16 printable ASCII
/// characters, in a regular file no other user can read.
pub fn read(path: &Path) -> Result<String, SecretError> {
    let meta = std::fs::symlink_metadata(path).map_err(|source| SecretError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.file_type().is_file() {
        return Err(SecretError::Unsafe {
            path: path.to_path_buf(),
            message: "not a regular file".into(),
        });
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(SecretError::Unsafe {
            path: path.to_path_buf(),
            message: format!(
                "readable by other users (mode {:o}); chmod 600 it",
                meta.permissions().mode() & 0o777
            ),
        });
    }
    if meta.len() > 4096 {
        return Err(SecretError::Unsafe {
            path: path.to_path_buf(),
            message: format!("{} bytes; a token file holds one short line", meta.len()),
        });
    }
    let text = std::fs::read_to_string(path).map_err(|source| SecretError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    let t = text.trim();
    if t.len() < 16 || !t.chars().all(|c| c.is_ascii_graphic()) {
        return Err(SecretError::Unsafe {
            path: path.to_path_buf(),
            message: "the token must be at least 16 printable characters on one line".into(),
        });
    }
    Ok(t.to_string())
}

/// Reads the token in `path`, or creates the file (and an owner-only
/// directory for it) with a new random token: mode 0600, made exclusively so
/// that a racing start or another user cannot put one there first. Returns
/// the token and whether this call created the file.
pub fn load_or_create(path: &Path) -> Result<(String, bool), SecretError> {
    match read(path) {
        Ok(t) => return Ok((t, false)),
        Err(SecretError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        ensure_private_dir(dir)?;
    }
    let token = random_token()?;
    let io = |what, source| SecretError::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    let mut f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(f) => f,
        // Another process made it between our read and our create.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return read(path).map(|t| (t, false)),
        Err(e) => return Err(io("creating", e)),
    };
    f.write_all(token.as_bytes())
        .and_then(|()| f.write_all(b"\n"))
        .and_then(|()| f.sync_all())
        .map_err(|e| io("writing", e))?;
    Ok((token, true))
}

/// 32 hex digits from the kernel's random source (a token, or an id no
/// other process will have).
pub fn random_token() -> Result<String, SecretError> {
    use std::io::Read as _;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| SecretError::Io {
            what: "reading",
            path: PathBuf::from("/dev/urandom"),
            source,
        })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("phub-secret-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn created_owner_only_then_read_back() {
        let d = dir("create");
        let p = d.join("sub/t.token");
        let (t, made) = load_or_create(&p).unwrap();
        assert!(made);
        assert_eq!(t.len(), 32);
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::metadata(d.join("sub")).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert_eq!(load_or_create(&p).unwrap(), (t, false));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unsafe_files_are_refused_by_name() {
        let d = dir("unsafe");
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("t.token");
        std::fs::write(&p, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(
            e.contains("readable by other users") && e.contains("t.token"),
            "{e}"
        );
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read(&p).unwrap(), "0123456789abcdef0123");
        std::fs::write(&p, "short\n").unwrap();
        assert!(read(&p).unwrap_err().to_string().contains("at least 16"));
        let e = read(&d).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let open = d.join("open");
        std::fs::create_dir_all(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = load_or_create(&open.join("x.token")).unwrap_err().to_string();
        assert!(e.contains("writable by other users"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
