//! The poll loop every lcore runs, whatever its backend: apply management
//! commands between bursts, receive a burst, hand each datagram to the
//! engine shard, send what the shard queued, repeat.
//!
//! The loop never allocates, locks or logs per packet. When idle it either
//! spins (busy polling, for an appliance whose lcores own their cores) or
//! waits in the backend for up to `idle_wait`, so a small shared machine
//! stays usable; with a `spin`, only once nothing has come for that long.
//!
//! Fault injection, when asked for, wraps the backend's queue
//! ([`crate::inject`]); the loop does not know about it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use phub_proto::checkpoint::SlotState;
use phub_proto::failover::EpochView;

use phub_engine::engine::{
    EngineError, InstallKind, JobInstall, JobShardStats, RestoredTable, Shard, TableInstall,
    TablesStreamError,
};

use crate::backend::PacketIo;
use crate::spin::SpinGate;

/// Install a job's slots on an lcore, as `kind` says (plain, with its
/// shared-memory regions, or as a hierarchical job's part), restored from
/// saved state when given: all in one step, so no packet sees the job half
/// installed or half restored.
#[derive(Debug)]
pub struct Install {
    /// The job as this lcore sees it.
    pub job: JobInstall,
    /// What it gets beside its slots.
    pub kind: InstallKind,
    /// Its table keys on this lcore (PROTOCOL.md §10).
    pub tables: Vec<TableInstall>,
    /// Its saved state on this lcore, from a checkpoint.
    pub restore: Option<Saved>,
    /// Answered with the memory the job holds here, or why it was refused
    /// (nothing of it is left installed then).
    pub reply: Sender<Result<u64, EngineError>>,
}

/// A job's saved state on one lcore: what a checkpoint holds of it.
#[derive(Debug, Default)]
pub struct Saved {
    /// Its slots, in slot order.
    pub slots: Vec<SlotState>,
    /// Its tables, in key order, made and read away from the lcore as the
    /// checkpoint streamed in (empty: none saved, PROTOCOL.md §10.6; the
    /// install makes them empty).
    pub tables: Vec<RestoredTable>,
}

/// Bytes of one slice of a streamed checkpoint: the lcore makes one per
/// turn of its loop while its channel has room.
pub const SLICE_BYTES: usize = 512 << 10;
/// Slices an lcore may have made ahead of the checkpoint's reader.
pub const SLICES_AHEAD: usize = 16;

/// A checkpoint of a job on this lcore: its slots are copied at once, its
/// tables streamed from the same instant (copy on write, the lcore going
/// on serving: [`Shard::stream_tables_begin`]), a slice of at most
/// [`SLICE_BYTES`] per turn of the loop while `slices` has room.
#[derive(Debug)]
pub struct Checkpoint {
    /// The job.
    pub job: u16,
    /// Answered with the job's slots here and the bytes its tables'
    /// section will have, or why not (nothing is streamed then).
    pub reply: Sender<Result<(Vec<SlotState>, u64), CheckpointRefused>>,
    /// Where the section's bytes go; dropped by the reader to end the
    /// stream (the lcore then frees what it kept).
    pub slices: Sender<Slice>,
}

/// Why an lcore took no checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointRefused {
    /// The job is not installed here.
    NotInstalled,
    /// A checkpoint is being streamed here (of this job or another).
    Busy(u16),
    /// The stream could not start (the heap refused what it keeps).
    Failed(String),
}

/// Part of a job's tables' section from an lcore.
#[derive(Debug)]
pub enum Slice {
    /// The next bytes.
    Bytes(Vec<u8>),
    /// The stream ended in an error (its bytes are not complete).
    Failed(String),
}

/// A management request for one lcore, answered on its reply channel.
#[derive(Debug)]
pub enum Command {
    /// Install a job ([`Install`]).
    Install(Install),
    /// Start a job's checkpoint here ([`Checkpoint`]).
    Checkpoint(Checkpoint),
    /// Evict a job (its ranks' messages get an ERROR `evicted` for a
    /// minute, [`Shard::evict`]); answers whether it was installed.
    Remove(u16, Sender<bool>),
    /// Report every installed job's stats.
    JobStats(Sender<Vec<JobShardStats>>),
    /// Apply a replicated job's epoch ([`Shard::change_epoch`]): answers
    /// whether it changed anything, or why it was refused (nothing
    /// changed then).
    Epoch(u16, EpochView, Sender<Result<bool, EngineError>>),
}

/// How an lcore waits when there is nothing to do.
#[derive(Debug, Clone)]
pub struct LoopOptions {
    /// Spin without ever waiting in the kernel.
    pub busy_poll: bool,
    /// Longest wait in the backend when idle (also how quickly management
    /// commands and shutdown are noticed).
    pub idle_wait: Duration,
    /// Without `busy_poll`: keep polling without waiting for this long
    /// after the last burst that brought something, before waiting in the
    /// kernel. A datagram that arrives meanwhile is taken at once, rather
    /// than after a sleeping thread (on a VM, a halted vCPU) is woken.
    /// Read every turn: `--spin-us auto` changes it as the dataplane's
    /// cgroups allow ([`crate::spin`]).
    pub spin: Arc<SpinGate>,
}

impl Default for LoopOptions {
    /// Waits at once when idle, for up to 20 ms.
    fn default() -> LoopOptions {
        LoopOptions {
            busy_poll: false,
            idle_wait: Duration::from_millis(20),
            spin: Arc::new(SpinGate::new(Duration::ZERO)),
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
    // Cast: u64 nanoseconds cover 584 years of uptime.
    #[allow(clippy::cast_possible_truncation)]
    pub fn now(&self) -> u64 {
        (self.0.elapsed().as_nanos() as u64).max(1)
    }
}

/// The longest an lcore keeps refusing messages once told to stop
/// ([`run`]): 1 s.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);
/// The grace ends sooner once nothing has arrived for this long: 100 ms.
pub const SHUTDOWN_QUIET: Duration = Duration::from_millis(100);

/// Runs one lcore until `stop` is set, then, if it holds any job, for a
/// grace period tells that job's ranks the appliance is shutting down
/// ([`Shard::shut_down`]; PROTOCOL.md §5.7): until nothing has arrived for
/// [`SHUTDOWN_QUIET`], at most [`SHUTDOWN_GRACE`]. Returns the last I/O
/// error, if the backend failed in a way the loop cannot continue from.
pub fn run<Io: PacketIo>(
    mut io: Io,
    mut shard: Shard<Io::Addr>,
    commands: Receiver<Command>,
    stop: Arc<AtomicBool>,
    clock: Clock,
    opts: LoopOptions,
) -> std::io::Result<()> {
    let counters = Arc::clone(shard.counters());
    shard.set_rx_buffer(io.stated_rx_buffer());
    // The spin governor tells this lcore running from asleep by its
    // thread's state.
    opts.spin.enlist();
    let wait = (!opts.busy_poll).then_some(opts.idle_wait);
    // The instant on `clock` of the last burst that brought something: the
    // turn's one clock read serves the spin too.
    let mut last_busy: Option<u64> = None;
    // Where the slices of a checkpoint being streamed go.
    let mut stream: Option<Sender<Slice>> = None;
    while !stop.load(Ordering::Relaxed) {
        while let Ok(cmd) = commands.try_recv() {
            apply(&mut shard, cmd, clock.now(), &mut stream);
        }
        // A slice of a checkpoint per turn; the loop does not wait while
        // the reader has room for more.
        let streaming = pump(&mut shard, &mut stream);
        // Nanoseconds to spin after such a burst (none when the loop never
        // waits anyway): one relaxed load of a line written only when the
        // spin changes.
        let spin_ns = if wait.is_some() { opts.spin.nanos() } else { 0 };
        let now = clock.now();
        let spinning = last_busy.is_some_and(|t| now.saturating_sub(t) < spin_ns);
        let n = io.rx_burst(
            if spinning || streaming { None } else { wait },
            &mut |from, datagram| {
                shard.handle(from, datagram, now);
            },
        )?;
        if n > 0 && spin_ns > 0 {
            last_busy = Some(now);
        } else if spinning {
            std::hint::spin_loop();
        }
        // After a burst that brought something the timers see the burst's
        // instant (it took microseconds; their resolution is a
        // millisecond): one clock read per busy turn of the loop. An empty
        // burst may have waited (`idle_wait`), so the clock is read again.
        shard.poll_timers(if n > 0 { now } else { clock.now() });
        flush(&mut io, &mut shard, &counters);
        if n == 0 {
            counters.idle_loops.inc();
        } else {
            counters.busy_loops.inc();
        }
    }
    if shard.job_ids().next().is_none() {
        return Ok(());
    }
    let told = shard.shut_down();
    log::info!(
        "lcore {}: shutting down; {told} rank(s) told, later messages refused for up to {SHUTDOWN_GRACE:?}",
        shard.lcore()
    );
    let start = Instant::now();
    let mut heard = start;
    loop {
        flush(&mut io, &mut shard, &counters);
        if start.elapsed() >= SHUTDOWN_GRACE || heard.elapsed() >= SHUTDOWN_QUIET {
            return Ok(());
        }
        let now = clock.now();
        let n = io.rx_burst(wait, &mut |from, datagram| {
            shard.handle(from, datagram, now);
        })?;
        if n > 0 {
            heard = Instant::now();
        }
    }
}

/// Sends what the shard queued.
fn flush<Io: PacketIo>(
    io: &mut Io,
    shard: &mut Shard<Io::Addr>,
    counters: &phub_engine::counters::ShardCounters,
) {
    if shard.has_transmits() {
        let r = io.tx_burst(shard.transmits(), counters);
        shard.clear_transmits();
        if let Err(e) = r {
            log::warn!("lcore {}: send failed: {e}", shard.lcore());
        }
    }
}

/// Makes the next slice of the checkpoint being streamed, if its reader
/// has room for it; true when it made one. A reader gone ends the stream.
fn pump<A: Copy + Eq>(shard: &mut Shard<A>, stream: &mut Option<Sender<Slice>>) -> bool {
    let Some(tx) = stream else {
        return false;
    };
    let (gone, done) = if tx.is_full() {
        // A reader that left a full channel behind is told only by a send
        // (the channel keeps its slices): an empty slice, which changes
        // nothing where it finds room after all.
        match tx.try_send(Slice::Bytes(Vec::new())) {
            Err(TrySendError::Disconnected(_)) => (true, false),
            _ => return false,
        }
    } else {
        let mut bytes = Vec::with_capacity(SLICE_BYTES + 4096);
        let (slice, done) = match shard.stream_tables_fill(&mut bytes, SLICE_BYTES) {
            Ok(done) => (Slice::Bytes(bytes), done),
            Err(e) => {
                log::warn!("lcore {}: checkpoint stream ended: {e}", shard.lcore());
                (Slice::Failed(e.to_string()), true)
            }
        };
        (tx.try_send(slice).is_err(), done)
    };
    if gone {
        shard.stream_tables_abort();
    }
    if gone || done {
        *stream = None;
        // Once a checkpoint: what taking it while serving cost in memory.
        let k = shard.stream_tables_kept();
        log::info!(
            "lcore {}: checkpoint stream {}; copy on write kept at most {} index entries and {} bytes of rows",
            shard.lcore(),
            if gone { "left by its reader" } else { "done" },
            k.entries,
            k.row_bytes
        );
    }
    true
}

fn apply<A: Copy + Eq>(shard: &mut Shard<A>, cmd: Command, now: u64, stream: &mut Option<Sender<Slice>>) {
    // A dropped reply channel only means the requester gave up waiting.
    match cmd {
        Command::Install(Install {
            job,
            kind,
            tables,
            restore,
            reply,
        }) => {
            let id = job.id;
            // Restored tables are taken in whole: the lcore reads no rows.
            let (mut r, slots) = match restore {
                Some(Saved {
                    slots,
                    tables: restored,
                }) if !restored.is_empty() => (shard.install_restored(job, kind, restored), Some(slots)),
                restore => (
                    shard.install_with_tables(job, kind, tables),
                    restore.map(|s| s.slots),
                ),
            };
            if let (Ok(()), Some(slots)) = (&r, slots) {
                r = shard.restore(id, &slots);
                if r.is_err() {
                    shard.remove(id);
                }
            }
            let _ = reply.send(r.map(|()| shard.job_memory_bytes(id).unwrap_or(0)));
        }
        Command::Checkpoint(c) => {
            // The tables' stream first (it refuses a job not installed or a
            // second stream), then the slots, at the same instant.
            let begun = match shard.stream_tables_begin(c.job) {
                Ok(bytes) => match shard.part_snapshot(c.job) {
                    Some(Ok(slots)) => Ok((slots, bytes)),
                    Some(Err(e)) => {
                        shard.stream_tables_abort();
                        Err(CheckpointRefused::Failed(e.to_string()))
                    }
                    None => {
                        shard.stream_tables_abort();
                        Err(CheckpointRefused::NotInstalled)
                    }
                },
                Err(TablesStreamError::NotInstalled(_)) => Err(CheckpointRefused::NotInstalled),
                Err(TablesStreamError::Busy(other)) => Err(CheckpointRefused::Busy(other)),
                Err(e) => Err(CheckpointRefused::Failed(e.to_string())),
            };
            let ok = begun.is_ok();
            if c.reply.send(begun).is_err() && ok {
                // The requester gave up: nobody reads the stream.
                shard.stream_tables_abort();
            } else if ok {
                *stream = Some(c.slices);
            }
        }
        Command::Remove(id, reply) => {
            let _ = reply.send(shard.evict(id, now));
        }
        Command::JobStats(reply) => {
            let _ = reply.send(shard.job_stats());
        }
        Command::Epoch(id, view, reply) => {
            let _ = reply.send(shard.change_epoch(id, &view));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use phub_engine::counters::ShardCounters;
    use phub_engine::kernels::Kernels;
    use phub_engine::transmit::{Destinations, Transmit};
    use std::sync::Mutex;

    /// A queue that brings one datagram on its first call and nothing
    /// after, sleeping for the wait it is given as a socket would, records
    /// each wait in `waits`, and stops the loop after `calls` calls; at
    /// call `close.0` it closes the gate `close.1` (as `--spin-us auto`'s
    /// governor does).
    struct Waits {
        calls: usize,
        waits: Arc<Mutex<Vec<Option<Duration>>>>,
        stop: Arc<AtomicBool>,
        close: Option<(usize, Arc<SpinGate>)>,
    }

    impl PacketIo for Waits {
        type Addr = u32;

        fn rx_burst(
            &mut self,
            wait: Option<Duration>,
            f: &mut dyn FnMut(u32, &[u8]),
        ) -> std::io::Result<usize> {
            let n = {
                let mut w = self.waits.lock().unwrap();
                w.push(wait);
                w.len()
            };
            if n >= self.calls {
                self.stop.store(true, Ordering::Relaxed);
            }
            if let Some((at, gate)) = &self.close {
                if n == *at {
                    gate.set(Duration::ZERO);
                }
            }
            if n == 1 {
                f(9, b"not a phub datagram");
                return Ok(1);
            }
            if let Some(d) = wait {
                std::thread::sleep(d);
            }
            Ok(0)
        }

        fn tx_burst<'a, D>(
            &mut self,
            _transmits: impl Iterator<Item = Transmit<'a, D>>,
            _counters: &ShardCounters,
        ) -> std::io::Result<()>
        where
            D: Destinations<Item = u32>,
        {
            Ok(())
        }
    }

    /// The waits an lcore loop with `opts` asks its queue for, turn by
    /// turn, over `calls` turns.
    fn waits(opts: LoopOptions, calls: usize) -> Vec<Option<Duration>> {
        waits_closing(opts, calls, None)
    }

    /// [`waits`], closing the loop's spin gate at call `close`.
    fn waits_closing(opts: LoopOptions, calls: usize, close: Option<usize>) -> Vec<Option<Duration>> {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let io = Waits {
            calls,
            waits: Arc::clone(&log),
            stop: Arc::clone(&stop),
            close: close.map(|at| (at, Arc::clone(&opts.spin))),
        };
        let (_tx, rx) = crossbeam_channel::bounded(1);
        run(io, Shard::new(0, Kernels::best()), rx, stop, Clock::start(), opts).unwrap();
        let w = log.lock().unwrap().clone();
        w
    }

    /// After a burst that brought something, the loop polls without
    /// waiting for `spin`, then waits again; with no spin it always waits,
    /// busy polling never does.
    #[test]
    fn the_loop_spins_for_its_spin_after_traffic_then_waits() {
        let idle = Duration::from_millis(1);
        // A spin far longer than the test: every turn after the datagram polls.
        let gate = |d| Arc::new(SpinGate::new(d));
        let long = || LoopOptions {
            busy_poll: false,
            idle_wait: idle,
            spin: gate(Duration::from_secs(3600)),
        };
        let w = waits(long(), 50);
        assert_eq!(w[0], Some(idle), "no traffic yet: it waits");
        assert!(w[1..].iter().all(Option::is_none), "{w:?}");
        let none = LoopOptions {
            spin: gate(Duration::ZERO),
            ..long()
        };
        assert!(waits(none, 50).iter().all(|&x| x == Some(idle)));
        let busy = LoopOptions {
            busy_poll: true,
            ..long()
        };
        assert!(waits(busy, 50).iter().all(Option::is_none));
        // A 1 us spin is over long before 200 turns are (each takes more
        // than 5 ns): the last turns wait again.
        let short = LoopOptions {
            spin: gate(Duration::from_micros(1)),
            ..long()
        };
        let w = waits(short, 200);
        assert_eq!(w.last(), Some(&Some(idle)), "{w:?}");
        // The gate closed mid-spin (the governor saw a quota): the next
        // turn waits, and every one after it.
        let w = waits_closing(long(), 50, Some(20));
        assert!(w[1..20].iter().all(Option::is_none), "{w:?}");
        assert!(w[20..].iter().all(|&x| x == Some(idle)), "{w:?}");
    }
}
