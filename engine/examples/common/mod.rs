//! What the engine's benchmark examples share.

use std::time::Duration;

/// The calling thread's CPU time (time it spent descheduled on a shared
/// machine left out).
pub(crate) fn cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration;
    // CLOCK_THREAD_CPUTIME_ID is supported by Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    // Casts: a thread's CPU time is positive and its nanoseconds below 10^9.
    #[allow(clippy::cast_sign_loss, clippy::cast_possible_truncation)]
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
