//! Shared-memory regions mapped into this process (`phub_proto::shm` says
//! what they hold and who writes what).
//!
//! A [`ShmRegion`] is a file in `/dev/shm` mapped `MAP_SHARED`, read and
//! written. The dataplane [`create`](ShmRegion::create)s its regions (mode
//! 0600, and unlinks them when dropped); a worker [`open`](ShmRegion::open)s
//! them, checking the length it expects. Another process writes the same
//! bytes, so the region hands out no references: [`ShmRegion::read`] and
//! [`ShmRegion::write`] copy, bounds-checked, and [`ShmRegion::ptr`] gives a
//! raw pointer for readers that must not copy (the lcore's kernels). The
//! protocol keeps a chunk's writer and readers apart in time; the system
//! calls that carry the datagrams between them order the memory accesses.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// A shared mapping of a `/dev/shm` file.
#[derive(Debug)]
pub struct ShmRegion {
    ptr: NonNull<u8>,
    len: usize,
    path: PathBuf,
    /// Created here: unlinked on drop.
    owner: bool,
}

// SAFETY: the region is plain memory shared with other processes; this type
// hands out no references into it, only bounds-checked copies and a raw
// pointer whose users state their own synchronisation.
unsafe impl Send for ShmRegion {}
// SAFETY: as for Send: no method gives out references to the bytes.
unsafe impl Sync for ShmRegion {}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path"))
}

fn with_path(path: &Path, what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

impl ShmRegion {
    /// Creates the file (it must not exist; mode 0600) of `len` bytes, zero
    /// filled, and maps it. The file is removed when the region is dropped.
    pub fn create(path: &Path, len: usize) -> io::Result<ShmRegion> {
        let c = cpath(path)?;
        // SAFETY: a NUL-terminated path; open(2) does not keep the pointer.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(with_path(path, "creating", io::Error::last_os_error()));
        }
        // SAFETY: fd is the file just opened; ftruncate only sizes it.
        let rc = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        let r = if rc != 0 {
            Err(with_path(path, "sizing", io::Error::last_os_error()))
        } else {
            Self::map(fd, path, len, true)
        };
        // SAFETY: fd is ours and closed once; the mapping stays valid after.
        unsafe { libc::close(fd) };
        if r.is_err() {
            // SAFETY: a NUL-terminated path; removes the file created above.
            unsafe { libc::unlink(c.as_ptr()) };
        }
        r
    }

    /// Creates the region as [`ShmRegion::create`], or, when a file of that
    /// name is already there, adopts it if it is this user's, mode 0600 (no
    /// group or other bits) and exactly `len` bytes: its contents stay, so
    /// processes that mapped it earlier keep working with the new owner (a
    /// dataplane restarted after a crash). Any other file there is removed
    /// and the region created afresh. Returns the region and whether it
    /// was adopted. Either way the file is removed when the region is
    /// dropped.
    pub fn create_or_adopt(path: &Path, len: usize) -> io::Result<(ShmRegion, bool)> {
        match Self::create(path, len) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            r => return r.map(|r| (r, false)),
        }
        let c = cpath(path)?;
        // SAFETY: a NUL-terminated path; O_NOFOLLOW refuses a symbolic link.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW) };
        if fd >= 0 {
            // SAFETY: an all-zero stat is a valid value to be overwritten.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is open; st is a valid out pointer; geteuid cannot fail.
            let ours = unsafe { libc::fstat(fd, &mut st) } == 0
                && st.st_uid == unsafe { libc::geteuid() }
                && st.st_mode & libc::S_IFMT == libc::S_IFREG
                && st.st_mode & 0o077 == 0
                && usize::try_from(st.st_size).is_ok_and(|size| size == len);
            let r = if ours {
                Some(Self::map(fd, path, len, true))
            } else {
                None
            };
            // SAFETY: fd is ours and closed once; a mapping stays valid after.
            unsafe { libc::close(fd) };
            if let Some(r) = r {
                return r.map(|r| (r, true));
            }
        }
        std::fs::remove_file(path).map_err(|e| with_path(path, "removing the foreign or mis-sized", e))?;
        Self::create(path, len).map(|r| (r, false))
    }

    /// Opens and maps an existing region, which must be exactly `len` bytes.
    pub fn open(path: &Path, len: usize) -> io::Result<ShmRegion> {
        let c = cpath(path)?;
        // SAFETY: a NUL-terminated path; open(2) does not keep the pointer.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(with_path(path, "opening", io::Error::last_os_error()));
        }
        // SAFETY: an all-zero stat is a valid value to be overwritten.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out pointer.
        let r = if unsafe { libc::fstat(fd, &mut st) } != 0 {
            Err(with_path(path, "stat of", io::Error::last_os_error()))
        } else if usize::try_from(st.st_size).ok() != Some(len) {
            Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: {} bytes, expected {len}", path.display(), st.st_size),
            ))
        } else {
            Self::map(fd, path, len, false)
        };
        // SAFETY: fd is ours and closed once; the mapping stays valid after.
        unsafe { libc::close(fd) };
        r
    }

    fn map(fd: libc::c_int, path: &Path, len: usize, owner: bool) -> io::Result<ShmRegion> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: empty region", path.display()),
            ));
        }
        // SAFETY: a fresh shared mapping of an open file of at least `len`
        // bytes; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(with_path(path, "mapping", io::Error::last_os_error()));
        }
        Ok(ShmRegion {
            ptr: NonNull::new(p.cast()).expect("mmap returned a non-null address"),
            len,
            path: path.to_path_buf(),
            owner,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: creation refuses length 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `[off, off + len)` lies inside the region.
    pub fn contains(&self, off: usize, len: usize) -> bool {
        off.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// The address of byte `off` (page-aligned base), or `None` when
    /// `[off, off + len)` is outside the region. Readers through it must
    /// know, from the protocol, that nobody writes those bytes meanwhile.
    pub fn ptr(&self, off: usize, len: usize) -> Option<*mut u8> {
        // SAFETY: off + len <= self.len, so the offset stays inside the mapping.
        self.contains(off, len)
            .then(|| unsafe { self.ptr.as_ptr().add(off) })
    }

    /// Copies `src` into the region at `off`; `false` (nothing written) when
    /// it does not fit.
    pub fn write(&self, off: usize, src: &[u8]) -> bool {
        let Some(dst) = self.ptr(off, src.len()) else {
            return false;
        };
        // SAFETY: dst..dst+len is inside the mapping; src is a separate
        // allocation of this process (it cannot alias the mapping through a
        // reference, since this type hands none out).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        true
    }

    /// Copies bytes at `off` into `dst`; `false` (nothing read) when they
    /// are not all inside the region.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> bool {
        let Some(src) = self.ptr(off, dst.len()) else {
            return false;
        };
        // SAFETY: src..src+len is inside the mapping; dst is an exclusive
        // borrow of memory that is not the mapping.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// [`ShmRegion::read`] into memory that is written once and not read
    /// again soon (a caller's output), with streaming stores
    /// ([`crate::copy::copy_streaming`]).
    pub fn read_streaming(&self, off: usize, dst: &mut [u8]) -> bool {
        let Some(src) = self.ptr(off, dst.len()) else {
            return false;
        };
        // SAFETY: as in `read`: inside the mapping, and `dst` is not it.
        unsafe { crate::copy::copy_streaming_from(dst, src) };
        true
    }
}

/// Bytes an unprivileged process may still write to the file system of
/// `dir` (statvfs(3): available blocks times the fragment size), e.g. how
/// much of `/dev/shm` new regions may take.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    let c = cpath(dir)?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a NUL-terminated path and a pointer to a statvfs the call
    // fills in when it returns 0; neither is kept.
    let r = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return Err(with_path(dir, "statvfs of", io::Error::last_os_error()));
    }
    // SAFETY: statvfs returned 0, so it initialised the whole struct.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if self.owner {
            if let Ok(c) = cpath(&self.path) {
                // SAFETY: a NUL-terminated path.
                unsafe { libc::unlink(c.as_ptr()) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        Path::new("/dev/shm").join(format!("phub-test-{}-{name}", std::process::id()))
    }

    #[test]
    fn free_bytes_of_dev_shm_shrink_as_a_region_is_written() {
        let before = free_bytes(Path::new("/dev/shm")).unwrap();
        assert!(before > 0);
        let p = tmp("free");
        let r = ShmRegion::create(&p, 8 << 20).unwrap();
        for off in (0..8 << 20).step_by(4096) {
            assert!(r.write(off, &[1]));
        }
        let after = free_bytes(Path::new("/dev/shm")).unwrap();
        drop(r);
        // Other processes use /dev/shm too: a loose bound.
        assert!(after + (4 << 20) <= before, "{before} -> {after}");
        let e = free_bytes(Path::new("/no/such/dir")).unwrap_err().to_string();
        assert!(e.contains("/no/such/dir"), "{e}");
    }

    #[test]
    fn two_mappings_see_each_others_writes_and_the_owner_removes_the_file() {
        let p = tmp("share");
        let a = ShmRegion::create(&p, 8192).unwrap();
        let b = ShmRegion::open(&p, 8192).unwrap();
        assert!(a.write(4096, &[1, 2, 3]));
        let mut got = [0u8; 3];
        assert!(b.read(4096, &mut got));
        assert_eq!(got, [1, 2, 3]);
        assert!(!b.write(8190, &[0; 3]), "past the end");
        assert!(!a.read(usize::MAX, &mut got), "overflowing offset");
        assert!(a.ptr(8192, 1).is_none() && a.ptr(8191, 1).is_some());
        let e = ShmRegion::create(&p, 64).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        let e = ShmRegion::open(&p, 4096).unwrap_err();
        assert!(e.to_string().contains("expected 4096"), "{e}");
        // A file left behind (a crash) is adopted with its contents when it
        // is ours, 0600 and of the right size; otherwise replaced.
        std::mem::forget(a);
        let (c, adopted) = ShmRegion::create_or_adopt(&p, 8192).unwrap();
        assert!(adopted);
        assert!(c.read(4096, &mut got) && got == [1, 2, 3], "contents kept");
        drop(c);
        assert!(!p.exists(), "the adopter removes it");
        std::fs::write(&p, b"short").unwrap();
        let (d, adopted) = ShmRegion::create_or_adopt(&p, 8192).unwrap();
        assert!(!adopted);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 8192);
        drop(b);
        drop(d);
        assert!(!p.exists());
        assert!(ShmRegion::open(&p, 8192).is_err());
    }
}
