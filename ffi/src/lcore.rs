//! Running closures on EAL worker lcores (`rte_eal_remote_launch`).

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::eal::Eal;
use crate::error::Error;
use crate::{sys, Result};

type Job = Box<dyn FnOnce() -> i32 + Send + 'static>;

extern "C" fn trampoline(arg: *mut c_void) -> c_int {
    // SAFETY: arg is the Box<Job> leaked by launch(), handed to exactly one
    // run of this function.
    let job: Box<Job> = unsafe { Box::from_raw(arg.cast::<Job>()) };
    // A panic must not unwind into C.
    match catch_unwind(AssertUnwindSafe(job)) {
        Ok(rc) => rc,
        Err(_) => {
            log::error!(
                "a function launched on lcore {} panicked",
                current().unwrap_or(u32::MAX)
            );
            -1
        }
    }
}

/// A function running on an lcore; [`Launched::wait`] collects its result.
/// Dropping it without waiting leaves the function running; the lcore takes
/// no new function until it is waited for.
#[derive(Debug)]
#[must_use = "wait() for the lcore, or it takes no new function"]
pub struct Launched {
    lcore: u32,
}

impl Launched {
    /// The lcore it runs on.
    pub fn lcore(&self) -> u32 {
        self.lcore
    }

    /// Waits for the function to return and gives its return value (-1 if
    /// it panicked).
    pub fn wait(self) -> i32 {
        // SAFETY: EAL is up (a Launched exists only after a launch); waits
        // for this lcore only.
        unsafe { sys::rte_eal_wait_lcore(self.lcore) }
    }
}

/// Runs `f` on worker lcore `lcore`. Fails if the lcore is not a worker
/// lcore or is busy.
pub fn launch<F>(eal: Eal, lcore: u32, f: F) -> Result<Launched>
where
    F: FnOnce() -> i32 + Send + 'static,
{
    if lcore == eal.main_lcore() || !eal.worker_lcores().contains(&lcore) {
        return Err(Error::Invalid(format!(
            "lcore {lcore} is not a worker lcore; worker lcores: {:?} (EAL -l/--lcores)",
            eal.worker_lcores()
        )));
    }
    let job: Box<Job> = Box::new(Box::new(f));
    let arg = Box::into_raw(job);
    // SAFETY: trampoline matches lcore_function_t; arg is a leaked Box<Job>
    // that the trampoline takes back exactly once when the launch succeeds.
    let rc = unsafe { sys::rte_eal_remote_launch(Some(trampoline), arg.cast(), lcore) };
    if rc != 0 {
        // SAFETY: not launched: the box is still ours.
        drop(unsafe { Box::from_raw(arg) });
        return Err(Error::call(format!("rte_eal_remote_launch(lcore {lcore})"), rc));
    }
    Ok(Launched { lcore })
}

/// The lcore id of the calling thread, `None` on a non-EAL thread.
pub fn current() -> Option<u32> {
    // SAFETY: reads a thread-local; valid on any thread.
    let id = unsafe { sys::phub_lcore_id() };
    (id < sys::RTE_MAX_LCORE).then_some(id)
}
