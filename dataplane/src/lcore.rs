//! The poll loop every lcore runs, whatever its backend: apply management
//! commands between bursts, receive a burst, hand each datagram to the
//! engine shard, send what the shard queued, repeat.
//!
//! The loop never allocates, locks or logs per packet. When idle it either
//! spins (busy polling, for an appliance whose lcores own their cores) or
//! waits in the backend for up to `idle_wait`, so a small shared machine
//! stays usable.
//!
//! With fault injection on, a received datagram may be held back: until
//! after the next burst (reordered) or until its hold time has passed
//! (delayed; the wait in the backend never runs past the first one due).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::backend::PacketIo;
use phub_proto::checkpoint::SlotState;
use phub_proto::fault::{Fate, FaultSpec, Faults};

use crate::engine::{EngineError, JobInstall, JobShardStats, Shard};
use crate::shm::ShmSetup;

/// A management request for one lcore, answered on its reply channel.
#[derive(Debug)]
pub enum Command {
    /// Install a job's slots, with its shared-memory regions when set up
    /// for them, restored from saved state when given (all in one step, so
    /// no packet sees the job half installed or half restored); answers the
    /// slot memory allocated.
    Install(
        JobInstall,
        Option<ShmSetup>,
        Option<Vec<SlotState>>,
        Sender<Result<u64, EngineError>>,
    ),
    /// Save a job's slots (None when the job is not installed here).
    Snapshot(u16, Sender<Option<Vec<SlotState>>>),
    /// Remove a job; answers whether it was installed.
    Remove(u16, Sender<bool>),
    /// Report every installed job's stats.
    JobStats(Sender<Vec<JobShardStats>>),
}

/// How an lcore waits when there is nothing to do.
#[derive(Debug, Clone, Copy)]
pub struct LoopOptions {
    /// Inject faults on received and sent packets (tests and soaks; off by
    /// default).
    pub faults: Option<FaultSpec>,
    /// Spin without ever waiting in the kernel.
    pub busy_poll: bool,
    /// Longest wait in the backend when idle (also how quickly management
    /// commands and shutdown are noticed).
    pub idle_wait: Duration,
}

impl Default for LoopOptions {
    fn default() -> LoopOptions {
        LoopOptions {
            faults: None,
            busy_poll: false,
            idle_wait: Duration::from_millis(20),
        }
    }
}

/// The clock the engine sees: nanoseconds since the dataplane started.
#[derive(Debug, Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    /// A clock starting now.
    pub fn start() -> Clock {
        Clock(Instant::now())
    }

    /// Nanoseconds since start (at least 1, so 0 can mean "never").
    pub fn now(&self) -> u64 {
        (self.0.elapsed().as_nanos() as u64).max(1)
    }
}

/// Runs one lcore until `stop` is set. Returns the last I/O error, if the
/// backend failed in a way the loop cannot continue from.
pub fn run<Io: PacketIo>(
    mut io: Io,
    mut shard: Shard<Io::Addr>,
    commands: Receiver<Command>,
    stop: Arc<AtomicBool>,
    clock: Clock,
    opts: LoopOptions,
) -> std::io::Result<()> {
    let counters = Arc::clone(shard.counters());
    let wait = (!opts.busy_poll).then_some(opts.idle_wait);
    let lcore = u64::from(shard.lcore());
    let rx_faults = opts.faults.map(|f| Faults::new(f, 2 * lcore));
    shard.set_tx_faults(opts.faults.map(|f| Faults::new(f, 2 * lcore + 1)));
    // Datagrams the injector held back, delivered after the next burst.
    let mut held: Vec<(Io::Addr, Vec<u8>)> = Vec::new();
    // Datagrams the injector delayed, with the clock time they are due at.
    // One hold time for all, so arrival order is also due order.
    let mut delayed: VecDeque<(u64, Io::Addr, Vec<u8>)> = VecDeque::new();
    let delay_ns = opts.faults.map_or(0, |f| f.delay_time().as_nanos() as u64);
    while !stop.load(Ordering::Relaxed) {
        while let Ok(cmd) = commands.try_recv() {
            apply(&mut shard, cmd);
        }
        let now = clock.now();
        let released = std::mem::take(&mut held);
        // Never wait past the first delayed datagram's time (rounded up to
        // whole milliseconds, as the UDP backend waits).
        let wait = match (wait, delayed.front()) {
            (Some(w), Some(&(due, _, _))) => {
                Some(w.min(Duration::from_millis(due.saturating_sub(now).div_ceil(1_000_000))))
            }
            (w, _) => w,
        };
        let n = match &rx_faults {
            None => io.rx_burst(wait, &mut |from, datagram| {
                shard.handle(from, datagram, now);
            })?,
            Some(faults) => io.rx_burst(wait, &mut |from, datagram| match faults.fate() {
                Fate::Deliver => {
                    shard.handle(from, datagram, now);
                }
                Fate::Drop => counters.injected_drops.inc(),
                Fate::Duplicate => {
                    counters.injected_dups.inc();
                    shard.handle(from, datagram, now);
                    shard.handle(from, datagram, now);
                }
                Fate::Reorder => {
                    counters.injected_reorders.inc();
                    held.push((from, datagram.to_vec()));
                }
                Fate::Delay => {
                    counters.injected_delays.inc();
                    delayed.push_back((now + delay_ns, from, datagram.to_vec()));
                }
            })?,
        };
        for (from, datagram) in &released {
            shard.handle(*from, datagram, now);
        }
        if !delayed.is_empty() {
            let now = clock.now();
            while delayed.front().is_some_and(|d| d.0 <= now) {
                if let Some((_, from, datagram)) = delayed.pop_front() {
                    shard.handle(from, &datagram, now);
                }
            }
        }
        if shard.has_transmits() {
            let r = io.tx_burst(&shard, &counters);
            shard.clear_transmits();
            if let Err(e) = r {
                log::warn!("lcore {}: send failed: {e}", shard.lcore());
            }
        }
        if n == 0 {
            counters.idle_loops.inc();
        } else {
            counters.busy_loops.inc();
        }
    }
    Ok(())
}

fn apply<A: Copy + Eq>(shard: &mut Shard<A>, cmd: Command) {
    // A dropped reply channel only means the requester gave up waiting.
    match cmd {
        Command::Install(job, shm, restore, reply) => {
            let id = job.id;
            let mut r = match shm {
                Some(setup) => shard.install_shared(job, setup),
                None => shard.install(job),
            };
            if let (Ok(()), Some(state)) = (&r, restore) {
                r = shard.restore(id, &state);
                if r.is_err() {
                    shard.remove(id);
                }
            }
            let _ = reply.send(r.map(|()| shard.job_memory_bytes(id).unwrap_or(0)));
        }
        Command::Snapshot(id, reply) => {
            let _ = reply.send(shard.snapshot(id));
        }
        Command::Remove(id, reply) => {
            let _ = reply.send(shard.remove(id));
        }
        Command::JobStats(reply) => {
            let _ = reply.send(shard.job_stats());
        }
    }
}
