//! Row blocks made ahead of a store's growth, off its lcore.
//!
//! A store's rows live in 2 MiB blocks allocated as the table grows
//! ([`super::blocks`]); a block's pages come zeroed from the kernel at
//! their first touch, and the thread that touches them waits while the
//! kernel zeroes them: on this project's VMs 1 to 2 ms a 2 MiB huge page
//! (about 1.3 GB/s, the hypervisor backing fresh memory). An lcore that
//! took that wait in the middle of a BSP round held the whole round: the
//! ranks' loss timers fired and every rank resent its part, and the steps
//! that met a new block were the slowest 1% (`phub-bench sparse --local
//! --consistency bsp`: p99 8-9 ms against 3-4 ms with every block made
//! before the steps, resends 5,000-8,000 against 60-1,400 a run;
//! BENCHMARKS.md).
//!
//! So where the process runs the block maker ([`start_block_maker`], the
//! dataplane does at start-up), each store keeps [`AHEAD`] blocks ready:
//! the maker's thread (`phub-blocks`, in the `SCHED_IDLE` class: it runs
//! on CPU time nothing else wants) maps them and faults every page in, and
//! the store's lcore takes a ready one when it grows (a lock held for a
//! push or a pop), then asks for the next. It never waits for the maker:
//! a store that outgrows its reserve (a round creating more than `AHEAD`
//! blocks of rows, or a maker starved of CPU) makes the rest itself, as
//! every store does where no maker runs (the simulator, unit tests:
//! nothing here is observable but time and memory).
//!
//! Memory: a store's blocks, ready ones included, stay within the blocks
//! of its cap, which admission charges ([`Reserve::made`] counts both
//! sides' blocks against that; one more for the moment the maker takes
//! to drop a block the store made itself meanwhile); a store gone (a job
//! evicted) frees its ready blocks with it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use super::huge::Zeroed;

/// Blocks a store keeps ready (4 MiB of rows): a step creates far fewer
/// rows than that on one lcore.
pub(crate) const AHEAD: usize = 2;

/// The maker's queue: reserves that asked for blocks.
static MAKER: OnceLock<Sender<Weak<dyn Fill>>> = OnceLock::new();

/// Starts the block maker's thread (module head), once per process;
/// later calls do nothing. Stores created before it make their blocks
/// themselves.
pub fn start_block_maker() -> std::io::Result<()> {
    if MAKER.get().is_some() {
        return Ok(());
    }
    let (tx, rx) = channel::<Weak<dyn Fill>>();
    std::thread::Builder::new()
        .name("phub-blocks".into())
        .spawn(move || {
            idle_priority();
            // Ends when every sender is gone (never, in a process that
            // started it: the static keeps one).
            for asked in rx {
                if let Some(r) = asked.upgrade() {
                    r.fill();
                }
            }
        })?;
    // Two threads starting it at once: the second's thread ends at once
    // (its sender is dropped here).
    let _ = MAKER.set(tx);
    Ok(())
}

/// Puts the calling thread in Linux's `SCHED_IDLE` class: it runs only
/// on a CPU nothing else wants, so the maker never takes a CPU from an
/// lcore or a worker (on a 2-vCPU machine it did, for the 1-2 ms of each
/// block). A maker starved so makes nothing, and the stores make their
/// blocks themselves, as without it. Best effort: refused, it runs at
/// the normal priority.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for SCHED_IDLE (priority 0);
    // pid 0 is the calling thread; the call changes only its scheduling.
    let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if r != 0 {
        log::debug!(
            "phub-blocks: SCHED_IDLE refused ({}); at the normal priority",
            std::io::Error::last_os_error()
        );
    }
}

/// What the maker's thread does for a reserve that asked.
trait Fill: Send + Sync {
    fn fill(&self);
}

/// One store's ready blocks of `lines` `T`s each (module head).
pub(crate) struct Reserve<T> {
    lines: usize,
    /// The store's cap in blocks.
    max: usize,
    /// Blocks made for the store, by the maker or by the store itself,
    /// ready ones included: at most `max`.
    made: AtomicUsize,
    ready: Mutex<Vec<Zeroed<T>>>,
    /// The reserve is in the maker's queue (asked once until it fills).
    asked: AtomicBool,
    maker: Sender<Weak<dyn Fill>>,
    /// Itself, to queue.
    me: Weak<Reserve<T>>,
}

impl<T: bytemuck::Pod + Send + 'static> Reserve<T> {
    /// A reserve for a store of at most `max` blocks of `lines` `T`s,
    /// already asking for its first blocks; `None` where no maker runs.
    pub(crate) fn new(lines: usize, max: usize) -> Option<Arc<Reserve<T>>> {
        let maker = MAKER.get()?.clone();
        let r = Arc::new_cyclic(|me| Reserve {
            lines,
            max,
            made: AtomicUsize::new(0),
            ready: Mutex::new(Vec::with_capacity(AHEAD)),
            asked: AtomicBool::new(false),
            maker,
            me: me.clone(),
        });
        r.ask();
        Some(r)
    }

    /// A block for the store, which has fewer than `max`, and whether it
    /// was made here: a ready one, or else one made here (`None` when the
    /// kernel refuses it); the maker is asked for more. Never waits for
    /// the maker (a maker starved of CPU would hold the lcore): where the
    /// maker is making the cap's last block when the store makes it too,
    /// the maker's is dropped once made (`fill`: a moment of one block
    /// over the cap).
    pub(crate) fn take(&self) -> Option<(Zeroed<T>, bool)> {
        let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        let block = match ready.pop() {
            Some(b) => Some((b, false)),
            None => {
                // Counted under the lock: the maker, adding a block under
                // it, sees this one.
                let before = self.made.fetch_add(1, Ordering::AcqRel);
                debug_assert!(
                    before <= self.max,
                    "{before} blocks made of a cap of {}",
                    self.max
                );
                drop(ready);
                let b = Zeroed::new(self.lines);
                if b.is_none() {
                    self.made.fetch_sub(1, Ordering::AcqRel);
                }
                b.map(|b| (b, true))
            }
        };
        self.ask();
        block
    }

    /// Blocks ready now (a moment's count: the maker may be adding one).
    pub(crate) fn ready(&self) -> usize {
        self.ready.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Blocks made for the store so far, ready ones included.
    pub(crate) fn made(&self) -> usize {
        self.made.load(Ordering::Acquire)
    }

    fn ask(&self) {
        if self.made() >= self.max || self.asked.swap(true, Ordering::AcqRel) {
            return;
        }
        let me: Weak<dyn Fill> = self.me.clone();
        if self.maker.send(me).is_err() {
            self.asked.store(false, Ordering::Release);
        }
    }
}

impl<T: bytemuck::Pod + Send + 'static> Fill for Reserve<T> {
    fn fill(&self) {
        // A block taken from here on asks again.
        self.asked.store(false, Ordering::Release);
        while self.ready() < AHEAD {
            let claimed = self.made.fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                (m < self.max).then_some(m + 1)
            });
            if claimed.is_err() {
                return;
            }
            let Some(mut block) = Zeroed::<T>::new(self.lines) else {
                self.made.fetch_sub(1, Ordering::AcqRel);
                return;
            };
            // Every page faulted in here, not on the lcore.
            block.populate();
            let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
            if self.made() > self.max {
                // The store made the cap's last block itself meanwhile.
                self.made.fetch_sub(1, Ordering::AcqRel);
                return;
            }
            ready.push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "waited 20 s for {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// With the maker running, a reserve fills to AHEAD blocks, a block
    /// taken is a ready one and is refilled, and the blocks made stay
    /// within the cap, the store's own included (one over it for the
    /// moment the maker drops a block the store made meanwhile); zeroed
    /// throughout.
    #[test]
    fn a_reserve_keeps_blocks_ready_within_the_cap() {
        start_block_maker().unwrap();
        let r = Reserve::<u64>::new(4096, 5).expect("the maker runs");
        wait_for("two ready blocks", || r.ready() == AHEAD);
        assert_eq!(r.made(), AHEAD);
        let (first, made_here) = r.take().unwrap();
        assert!(!made_here, "the block taken was a ready one");
        let mut store = vec![first];
        wait_for("the reserve refilled", || r.ready() == AHEAD);
        assert_eq!(r.made(), AHEAD + 1);
        while store.len() < 5 {
            store.push(r.take().unwrap().0);
            assert!(r.made() <= 6, "made {} of a cap of 5", r.made());
        }
        wait_for("the cap's blocks, none ready", || (r.made(), r.ready()) == (5, 0));
        assert!(store.iter().all(|b| b.len() == 4096 && b.iter().all(|&w| w == 0)));
    }

    /// A store taking its whole cap at once, racing the maker: at most one
    /// block over the cap (the maker's last, dropped once made), and in
    /// the end the cap's blocks, none ready.
    #[test]
    fn a_store_racing_the_maker_stays_within_its_cap() {
        start_block_maker().unwrap();
        for max in (1..=4).cycle().take(400) {
            let r = Reserve::<u64>::new(64, max).unwrap();
            let taken: Vec<_> = (0..max).map(|_| r.take().unwrap()).collect();
            assert!(r.made() <= max + 1, "made {} of a cap of {max}", r.made());
            wait_for("the cap's blocks, none ready", || {
                (r.made(), r.ready()) == (max, 0)
            });
            assert_eq!(taken.len(), max);
        }
    }

    /// A store dropped while its reserve is queued: the maker skips it
    /// and its ready blocks go with it.
    #[test]
    fn a_reserve_dropped_is_skipped() {
        start_block_maker().unwrap();
        for _ in 0..50 {
            drop(Reserve::<u64>::new(512, 3).unwrap());
        }
        let r = Reserve::<u64>::new(512, 3).unwrap();
        wait_for("the last reserve filled", || r.ready() == AHEAD);
    }
}
