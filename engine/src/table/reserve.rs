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
//! the maker's thread (`phub-blocks`) maps them and touches every page,
//! and the store's lcore takes a ready one when it grows (a lock held for
//! a push or a pop), then asks for the next. A store that outgrows its
//! reserve (a round creating more than `AHEAD` blocks of rows) makes the
//! rest itself, as every store does where no maker runs (the simulator,
//! unit tests: nothing here is observable but time and memory).
//!
//! Memory: a store's blocks, ready ones included, never exceed the blocks
//! of its cap, which admission charges ([`Reserve::made`] counts both
//! sides' blocks against that); a store gone (a job evicted) frees its
//! ready blocks with it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use super::huge::Zeroed;

/// Blocks a store keeps ready (4 MiB of rows): a step creates far fewer
/// rows than that on one lcore.
pub(crate) const AHEAD: usize = 2;

/// The bytes between two touches of a block being made: a page (where
/// the kernel gives no huge page, each 4 KiB page is its own fault).
const PAGE: usize = 4096;

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

    /// A block for the store, which has fewer than `max`: a ready one, or
    /// else one made here (`None` when the kernel refuses it); the maker
    /// is asked for more. Where the maker is making the cap's last blocks
    /// at that moment, one of them (a short wait: the time the store
    /// would take to make it).
    pub(crate) fn take(&self) -> Option<Zeroed<T>> {
        let start = std::time::Instant::now();
        let block = loop {
            if let Some(b) = self.ready.lock().unwrap_or_else(PoisonError::into_inner).pop() {
                break Some(b);
            }
            if self.claim() {
                let b = Zeroed::new(self.lines);
                if b.is_none() {
                    self.made.fetch_sub(1, Ordering::AcqRel);
                }
                break b;
            }
            // The cap's last blocks are the maker's, being made; a maker
            // that never delivers (it cannot fail but by the kernel's
            // refusal, which gives its claim back) is a store out of
            // memory after a while, not an lcore held for good.
            if start.elapsed() > std::time::Duration::from_secs(10) {
                break None;
            }
            std::thread::yield_now();
        };
        self.ask();
        block
    }

    /// Claims one of the cap's blocks: false when every one is made or
    /// being made.
    fn claim(&self) -> bool {
        self.made
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                (m < self.max).then_some(m + 1)
            })
            .is_ok()
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
            if !self.claim() {
                return;
            }
            let Some(mut block) = Zeroed::<T>::new(self.lines) else {
                self.made.fetch_sub(1, Ordering::AcqRel);
                return;
            };
            // Every page faulted in here, not on the lcore: a write to
            // each (of zero, so the block stays zeroed).
            let bytes = bytemuck::cast_slice_mut::<T, u8>(&mut block);
            for at in (0..bytes.len()).step_by(PAGE) {
                bytes[at] = 0;
            }
            self.ready
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(block);
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
    /// taken is a ready one (the count of blocks made does not move) and
    /// is refilled, and the blocks made never exceed the cap, the store's
    /// own included; zeroed throughout.
    #[test]
    fn a_reserve_keeps_blocks_ready_within_the_cap() {
        start_block_maker().unwrap();
        let r = Reserve::<u64>::new(4096, 5).expect("the maker runs");
        wait_for("two ready blocks", || r.ready() == AHEAD);
        assert_eq!(r.made(), AHEAD);
        let mut store = vec![r.take().unwrap()];
        assert_eq!(r.made(), AHEAD, "the block taken was a ready one");
        wait_for("the reserve refilled", || r.ready() == AHEAD);
        assert_eq!(r.made(), AHEAD + 1);
        // Taking the rest of the cap: ready ones or made here, never more
        // than the cap in all.
        while store.len() < 5 {
            store.push(r.take().unwrap());
            assert!(r.made() <= 5, "made {} of a cap of 5", r.made());
        }
        wait_for("the maker done", || !r.asked.load(Ordering::Acquire));
        assert_eq!((r.made(), r.ready()), (5, 0));
        assert!(store.iter().all(|b| b.len() == 4096 && b.iter().all(|&w| w == 0)));
    }

    /// A store taking its whole cap at once, racing the maker: never more
    /// blocks than the cap, none left over.
    #[test]
    fn a_store_racing_the_maker_stays_within_its_cap() {
        start_block_maker().unwrap();
        for max in (1..=4).cycle().take(400) {
            let r = Reserve::<u64>::new(64, max).unwrap();
            let taken: Vec<_> = (0..max).map(|_| r.take().unwrap()).collect();
            assert!(r.made() <= max, "made {} of a cap of {max}", r.made());
            wait_for("the maker done", || !r.asked.load(Ordering::Acquire));
            assert_eq!((r.made(), r.ready(), taken.len()), (max, 0, max));
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
