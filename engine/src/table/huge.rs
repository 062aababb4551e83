//! Zeroed memory for a row store's large arrays (its id index and its
//! row blocks), mapped from the kernel on a 2 MiB boundary with
//! transparent huge pages asked for (`madvise(MADV_HUGEPAGE)`: the
//! kernel's `madvise` mode, Debian's default, gives them only to memory
//! that asks). A store's accesses are random over gigabytes: on 4 KiB
//! pages nearly every row read misses the TLB and walks the page tables,
//! which themselves no longer fit the caches; on 2 MiB pages the page
//! tables of 10^8 rows are a few tens of kilobytes. Where the kernel gives
//! no huge page (none free, THP off) the memory is ordinary pages, as
//! before; nothing depends on getting them.
//!
//! The pages come zeroed from the kernel and are touched only when used,
//! so an array costs resident memory as it fills (a whole huge page at its
//! first touch where one is given).

use std::ptr::NonNull;

/// The huge page size asked for.
pub(crate) const HUGE: usize = 2 << 20;
/// The base page size.
const PAGE: usize = 4096;

/// `len` zeroed `T`s (module head); freed when dropped.
pub(crate) struct Zeroed<T> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: `Zeroed` owns its mapping alone, as a `Box<[T]>` owns its
// allocation; sending or sharing it is sending or sharing the `T`s.
unsafe impl<T: Send> Send for Zeroed<T> {}
// SAFETY: as above: `&Zeroed<T>` gives only `&[T]`.
unsafe impl<T: Sync> Sync for Zeroed<T> {}

impl<T: bytemuck::Pod> Zeroed<T> {
    /// `len` zeroed `T`s, or `None` when the kernel refuses the mapping
    /// (or `len` of them overflows).
    pub(crate) fn new(len: usize) -> Option<Zeroed<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        if bytes == 0 {
            return Some(Zeroed {
                ptr: NonNull::dangling(),
                len,
            });
        }
        assert!(
            std::mem::align_of::<T>() <= PAGE,
            "a page-aligned mapping aligns T"
        );
        let map = mapped_bytes(bytes)?;
        // Room to move the start to a 2 MiB boundary: a mapping starts on
        // a page, not on a huge page.
        let over = if map >= HUGE { map.checked_add(HUGE)? } else { map };
        // SAFETY: a new private anonymous mapping, no address asked for:
        // it touches no memory of this process's; the result is checked.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return None;
        }
        let base = at as usize;
        let start = if over > map {
            base.next_multiple_of(HUGE)
        } else {
            base
        };
        // The head before the boundary and the tail after `map` bytes go
        // back to the kernel.
        let (head, tail) = (start - base, base + over - (start + map));
        for (from, n) in [(base, head), (start + map, tail)] {
            if n > 0 {
                // SAFETY: [from, from + n) lies within the mapping just
                // made, outside [start, start + map), which is kept; no
                // reference to it exists.
                unsafe { libc::munmap(from as *mut libc::c_void, n) };
            }
        }
        if map >= HUGE {
            // Best effort: without huge pages the memory works the same.
            // SAFETY: [start, start + map) is this mapping's; advice
            // changes no content.
            unsafe { libc::madvise(start as *mut libc::c_void, map, libc::MADV_HUGEPAGE) };
        }
        Some(Zeroed {
            ptr: NonNull::new(start as *mut T)?,
            len,
        })
    }

    /// Faults every page in now, so that the kernel zeroes them here
    /// rather than at each one's first touch (on this project's VMs 1-2 ms
    /// a 2 MiB page: an lcore's round held that long). The contents stay
    /// zeroed. `MADV_POPULATE_WRITE` (Linux 5.14) where the kernel has it,
    /// else a write of zero to each page.
    pub(crate) fn populate(&mut self) {
        let bytes = self.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return;
        }
        // SAFETY: [ptr, ptr + bytes) lies within this value's mapping
        // (page-aligned at its start); the advice faults pages in and
        // changes no content.
        let r = unsafe { libc::madvise(self.ptr.as_ptr().cast(), bytes, libc::MADV_POPULATE_WRITE) };
        if r != 0 {
            let bytes = bytemuck::cast_slice_mut::<T, u8>(self);
            for at in (0..bytes.len()).step_by(PAGE) {
                bytes[at] = 0;
            }
        }
    }
}

/// The bytes of the mapping for `bytes` bytes: whole pages, and whole
/// huge pages from 2 MiB up (so that a block of nearly 2 MiB still gets
/// one).
fn mapped_bytes(bytes: usize) -> Option<usize> {
    if bytes >= HUGE - HUGE / 8 {
        bytes.checked_next_multiple_of(HUGE)
    } else {
        bytes.checked_next_multiple_of(PAGE)
    }
}

impl<T> std::ops::Deref for Zeroed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points at `len` initialized (zeroed, `Pod`) `T`s
        // this value owns (or is dangling with `len` 0 or a zero size).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for Zeroed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`, and `&mut self` is the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for Zeroed<T> {
    fn drop(&mut self) {
        let bytes = self.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return;
        }
        // Mapped as `new` mapped it: the same length, which fit a usize.
        let map = mapped_bytes(bytes).unwrap_or(bytes);
        // SAFETY: [ptr, ptr + map) is the mapping `new` kept for this
        // value, and nothing refers to it once it is dropped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), map) };
    }
}

impl<T> std::fmt::Debug for Zeroed<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zeroed").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `z` resident now (`mincore`).
    fn resident(z: &Zeroed<u64>) -> usize {
        let bytes = z.len() * 8;
        let mut vec = vec![0u8; bytes.div_ceil(PAGE)];
        // SAFETY: the range is z's mapping, page-aligned at its start;
        // `vec` has a byte per page of it.
        let r = unsafe { libc::mincore(z.as_ptr() as *mut libc::c_void, bytes, vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// `populate` faults every page in and leaves them zeroed; nothing is
    /// resident before.
    #[test]
    fn populate_faults_every_page_in() {
        let mut z = Zeroed::<u64>::new(1 << 18).unwrap();
        assert_eq!(resident(&z), 0);
        z.populate();
        assert_eq!(resident(&z), (1usize << 21) / PAGE);
        assert!(z.iter().all(|&w| w == 0));
    }

    #[test]
    fn arrays_are_zeroed_writable_and_huge_ones_on_a_2mib_boundary() {
        for len in [0usize, 1, 1000, HUGE / 8, HUGE / 8 * 3 + 5] {
            let mut z = Zeroed::<u64>::new(len).unwrap();
            assert_eq!(z.len(), len);
            assert!(z.iter().all(|&x| x == 0));
            for (i, x) in z.iter_mut().enumerate() {
                *x = i as u64;
            }
            assert!(z.iter().enumerate().all(|(i, &x)| x == i as u64));
            if len * 8 >= HUGE {
                assert_eq!(z.as_ptr() as usize % HUGE, 0, "{len}");
            }
        }
        assert!(Zeroed::<u64>::new(usize::MAX / 4).is_none());
    }
}
