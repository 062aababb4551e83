//! The I/O thread: the socket and the command channel around the
//! [`Transport`].
//!
//! One thread per [`Worker`](crate::worker::Worker) owns the UDP socket's receive
//! side. Requests arrive over a channel with their datagrams already encoded
//! (one buffer per request, reused round after round for the same key). Each
//! turn of the loop takes the waiting requests, sends what the transport
//! has to send as one batch ([`crate::net`]: `sendmmsg`, GSO trains per
//! destination), runs its timers, receives in batches (`recvmmsg`, GRO
//! trains split per datagram) and hands every datagram to it, and sends
//! each finished request's outcome to its waiter; the window, the timers and
//! result matching are the transport's. With [`crate::inject`] on, every
//! datagram sent and received first gets a fate (lost, duplicated, held
//! back, delayed).
//!
//! With shared memory ([`crate::shm`]), a chunk's datagrams (retransmissions
//! too) are the header alone with the SHM flag. `init` and `push_pull`
//! requests come staged: the caller's thread wrote their payloads into the
//! staging region ([`Tx::Staged`]), and their results are left in the
//! result regions for `wait` to copy out ([`Sink::Direct`]), so this thread
//! moves headers only. Other requests' payloads (their buffers, or the
//! caller's lent gradient) are copied into the staging region when a chunk
//! is first sent, and their RESULTs with the flag are read from the lcore's
//! result region. This thread checks that the mapped files are still the
//! dataplane's regions ([`RegionWatch`]) and tells the transport when the
//! mapping changes; every request can still produce its payloads (a staged
//! one from the mapping it was staged into), so chunks can be written again
//! into new regions, or sent as datagrams.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::epoch::{EpochFetch, Fetched};
use crate::error::WorkerError;
use crate::inject::Injector;
use crate::keys::{KeyClaim, KeyTable};
use crate::net::{BatchSocket, Datagram};
use crate::shm::{RegionSpec, Regions};
use crate::stats::{add, Counters};
use crate::transport::{Finished, Output, RowFinished, RowOutput, RowTransport, Sink, Transport, TICK};

/// A request as the API side hands it to the I/O thread.
pub(crate) type Request = crate::transport::Request<Sender<Completion>>;

/// A completed request as its waiter gets it: the transport's [`Output`]
/// as it ended, and, while its results are still in the result regions
/// (a [`Sink::Direct`] request), the key's claim.
#[derive(Debug)]
pub(crate) struct Done {
    /// The key.
    pub(crate) key: u32,
    /// The round and the results.
    pub(crate) output: Output,
    /// Frees the key when dropped: after the waiter copied the results out
    /// of the regions, or unread when the handle is dropped without a
    /// wait. `None`: the key was freed when the request ended.
    pub(crate) claim: Option<KeyClaim>,
}

/// How a request ends.
pub(crate) type Completion = Result<Done, WorkerError>;

/// A table request as the API side hands it to the I/O thread.
pub(crate) type RowRequest = crate::transport::RowRequest<Sender<RowCompletion>>;

/// How a table request ends: each id's row, or why not.
pub(crate) type RowCompletion = Result<RowOutput, WorkerError>;

/// Messages to the I/O thread.
#[derive(Debug)]
pub(crate) enum Command {
    /// Start a request.
    Submit(Request),
    /// Start a table request.
    SubmitRows(RowRequest),
    /// Register (`cache`) or forget id lists of table `key` for key
    /// caching (PROTOCOL.md §10.7): (entry, signature) each.
    CacheIds {
        key: u32,
        lists: Vec<(u32, u64)>,
        cache: bool,
        done: Sender<Result<(), WorkerError>>,
    },
    /// Fail everything with `Closed` and exit.
    Shutdown,
}

/// Longest wait while idle; a submit wakes the thread at once anyway.
const IDLE: Duration = Duration::from_millis(100);
/// How often the mapped shared-memory files are checked against their
/// names while requests are in flight (two `stat`s per lcore; a restarted
/// dataplane takes far longer than this to install the job again).
const SHM_CHECK: Duration = Duration::from_millis(5);
/// How often opening the regions is tried again while they cannot be.
const SHM_REOPEN: Duration = Duration::from_millis(100);

/// The mapping in use, shared with the API side, which stages chunks into
/// it; `None` while the regions cannot be opened.
pub(crate) type CurrentRegions = Arc<Mutex<Option<Arc<Regions>>>>;

/// The shared-memory regions as the I/O thread watches them: whether the
/// mapped files are still the dataplane's, and opening them again.
#[derive(Debug)]
pub(crate) struct RegionWatch {
    /// How to open the regions again.
    spec: RegionSpec,
    /// The mapped regions; `None` while they cannot be opened.
    regions: Option<Arc<Regions>>,
    /// `regions`, as the API side sees it (updated with it).
    current: CurrentRegions,
    /// When the mapped files were last checked, or opening them last tried.
    checked: Instant,
    /// For log lines.
    job: u16,
    rank: u16,
}

impl RegionWatch {
    /// Watches `regions`, opened from `spec` for `job`'s `rank`; `current`
    /// is handed to the API side.
    pub(crate) fn new(
        spec: RegionSpec,
        regions: Regions,
        job: u16,
        rank: u16,
    ) -> (RegionWatch, CurrentRegions) {
        let regions = Arc::new(regions);
        let current = Arc::new(Mutex::new(Some(Arc::clone(&regions))));
        let watch = RegionWatch {
            spec,
            regions: Some(regions),
            current: Arc::clone(&current),
            checked: Instant::now(),
            job,
            rank,
        };
        (watch, current)
    }

    /// The mapping in use.
    pub(crate) fn regions(&self) -> Option<Arc<Regions>> {
        self.regions.clone()
    }

    /// Checks that the mapped files are still the dataplane's regions,
    /// every [`SHM_CHECK`] (or, unmapped, tries to open them every
    /// [`SHM_REOPEN`]) when `when` is [`When::Due`], at once when it is
    /// [`When::Now`]. A dataplane that restarted (or reinstalled the job)
    /// made new files: they are opened instead.
    fn check(&mut self, now: Instant, when: When) -> RegionCheck {
        let every = if self.regions.is_some() {
            SHM_CHECK
        } else {
            SHM_REOPEN
        };
        if when == When::Due && now.saturating_duration_since(self.checked) < every {
            return RegionCheck::Unchanged;
        }
        self.checked = now;
        let (job, rank) = (self.job, self.rank);
        if let Some(r) = &self.regions {
            let Some(why) = r.replaced() else {
                return RegionCheck::Unchanged;
            };
            log::warn!(
                "phub-worker: job {job} rank {rank}: the dataplane's shared-memory regions changed ({why}); \
                 opening them again, datagrams meanwhile"
            );
            self.set_regions(None);
        }
        match self.spec.open() {
            Ok(r) => {
                log::info!("phub-worker: job {job} rank {rank}: shared-memory regions mapped again");
                self.set_regions(Some(Arc::new(r)));
            }
            Err(e) => log::debug!("phub-worker: job {job} rank {rank}: shared memory: {e}"),
        }
        match &self.regions {
            Some(r) => RegionCheck::Remapped(Arc::clone(r)),
            None => RegionCheck::Unavailable,
        }
    }

    /// Replaces the mapping in use, on both sides.
    fn set_regions(&mut self, regions: Option<Arc<Regions>>) {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = regions.clone();
        self.regions = regions;
    }
}

/// When [`RegionWatch::check`] checks the regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    /// If [`SHM_CHECK`] (mapped) or [`SHM_REOPEN`] (unmapped) has passed
    /// since the last check.
    Due,
    /// At once.
    Now,
}

impl When {
    /// At once if `now`, else when due.
    fn now_if(now: bool) -> When {
        if now {
            When::Now
        } else {
            When::Due
        }
    }
}

/// What [`RegionWatch::check`] found.
#[derive(Debug)]
enum RegionCheck {
    /// Not checked (not due), or the mapped files are still the
    /// dataplane's: the mapping in use stays.
    Unchanged,
    /// The regions were opened (again): this is the mapping in use now.
    Remapped(Arc<Regions>),
    /// The regions cannot be opened now: chunks go as datagrams.
    Unavailable,
}

/// The I/O thread's state.
pub(crate) struct IoThread {
    /// Taken by [`IoThread::run`], which lends it to the methods that send.
    socket: Option<BatchSocket>,
    /// Set while the thread waits in the kernel for a datagram: only then
    /// does a new request need a wake-up datagram (a system call and a trip
    /// through the stack per request otherwise).
    sleeping: Arc<AtomicBool>,
    own: SocketAddr,
    cmds: Receiver<Command>,
    keys: KeyTable,
    stats: Arc<Counters>,
    transport: Transport<Sender<Completion>>,
    /// Table rows (PROTOCOL.md §10), beside the dense chunks.
    rows: RowTransport<Sender<RowCompletion>>,
    /// The fault injector, when configured (tests and soaks).
    inject: Option<Injector>,
    /// Shared memory, when the join chose it.
    regions: Option<RegionWatch>,
    /// [`crate::config::WorkerConfig::spin`].
    spin: Duration,
    /// A replicated job's epoch, fetched from control off this thread.
    epoch: EpochFetch,
}

/// What the I/O thread is made of, for [`IoThread::new`].
pub(crate) struct IoParts {
    pub(crate) socket: BatchSocket,
    /// The socket's own address (wake-ups come from it).
    pub(crate) own: SocketAddr,
    pub(crate) sleeping: Arc<AtomicBool>,
    pub(crate) cmds: Receiver<Command>,
    pub(crate) keys: KeyTable,
    pub(crate) stats: Arc<Counters>,
    pub(crate) inject: Option<Injector>,
    pub(crate) regions: Option<RegionWatch>,
    pub(crate) spin: Duration,
    pub(crate) epoch: EpochFetch,
}

impl IoThread {
    /// The thread around `transport` and `rows` (which count into
    /// `parts.stats` too).
    pub(crate) fn new(
        parts: IoParts,
        transport: Transport<Sender<Completion>>,
        rows: RowTransport<Sender<RowCompletion>>,
    ) -> IoThread {
        parts.stats.shm.store(parts.regions.is_some(), Ordering::Relaxed);
        IoThread {
            socket: Some(parts.socket),
            sleeping: parts.sleeping,
            own: parts.own,
            cmds: parts.cmds,
            keys: parts.keys,
            stats: parts.stats,
            transport,
            rows,
            inject: parts.inject,
            regions: parts.regions,
            spin: parts.spin,
            epoch: parts.epoch,
        }
    }

    /// The thread's body; returns when the worker is dropped.
    pub(crate) fn run(mut self) {
        let mut socket = self.socket.take().expect("the I/O thread runs once");
        // When a datagram last came in (polling on until `spin` after it).
        let mut last_rx: Option<Instant> = None;
        loop {
            if !self.take_commands() {
                return;
            }
            let now = Instant::now();
            self.follow_epoch(now);
            if self.transport.busy() {
                // While nothing answers (the dataplane may be restarting),
                // every send is preceded by a check.
                self.check_regions(now, When::now_if(self.transport.silent()));
            }
            self.transmit(&mut socket, now);
            if self.transport.handle_timeout(now) {
                if self.transport.take_stall() {
                    self.rows.check_idle_tables(now);
                }
                self.check_regions(now, When::Now);
                self.transmit(&mut socket, now);
            }
            if self.rows.handle_timeout(now) {
                self.transmit(&mut socket, now);
            }
            self.deliver();
            if let Some(inj) = self.inject.as_mut() {
                let stats = &self.stats;
                inj.release(now, |d| send_counted(&mut socket, stats, d));
            }
            let wait = self.wait();
            let own = self.own;
            let mut n = match self.receive(&mut socket) {
                Ok(n) => n,
                Err(e) => {
                    log::warn!("phub-worker: receiving on {own}: {e}");
                    std::thread::sleep(TICK);
                    continue;
                }
            };
            if n == 0 && self.busy() && last_rx.is_some_and(|t| t.elapsed() < self.spin) {
                // Results are coming: poll again rather than sleep (a
                // sleeping thread, on a VM a halted vCPU, takes long to wake).
                std::hint::spin_loop();
                continue;
            }
            if n == 0 {
                // Dekker with send_request: either the API side sees
                // `sleeping` and sends a wake-up, or this side sees its
                // command before waiting.
                self.sleeping.store(true, Ordering::SeqCst);
                std::sync::atomic::fence(Ordering::SeqCst);
                if self.cmds.is_empty() && socket.wait_readable(wait).unwrap_or(false) {
                    n = self.receive(&mut socket).unwrap_or(0);
                }
                self.sleeping.store(false, Ordering::SeqCst);
            }
            if n > 0 {
                if !self.spin.is_zero() {
                    last_rx = Some(Instant::now());
                }
                // Results may have freed the window or shown chunks lost.
                self.transmit(&mut socket, Instant::now());
            }
        }
    }

    /// Hands every waiting request to the transport; false (every request
    /// failed with `Closed`) once the worker is dropped.
    fn take_commands(&mut self) -> bool {
        let open = loop {
            match self.cmds.try_recv() {
                Ok(Command::Submit(r)) => self.transport.submit(Instant::now(), r),
                Ok(Command::SubmitRows(r)) => self.rows.submit(Instant::now(), r),
                Ok(Command::CacheIds {
                    key,
                    lists,
                    cache,
                    done,
                }) => {
                    let r = if cache {
                        self.rows.cache_ids(key, &lists)
                    } else {
                        self.rows.uncache_ids(key, &lists);
                        Ok(())
                    };
                    // The caller waits for it; gone, it no longer cares.
                    let _ = done.send(r);
                }
                Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => {
                    self.transport.close();
                    self.rows.close();
                    break false;
                }
                Err(TryRecvError::Empty) => break true,
            }
        };
        self.deliver();
        open
    }

    /// A replicated job's epoch (PROTOCOL.md §11.6): hands the transport's
    /// question to the fetch (a helper thread asks control), and the
    /// fetch's answer to the transport, which re-addresses its chunks
    /// when the epoch is new. When control did not serve an epoch an
    /// appliance named, or answered that the job failed, every request
    /// fails with the reason; when a silence asked and control did not
    /// answer, the chunks go on being retransmitted.
    fn follow_epoch(&mut self, now: Instant) {
        // The dense chunks' question, or the tables' (PROTOCOL.md §11.9).
        if let Some(wanted) = self.transport.poll_epoch().max(self.rows.poll_epoch()) {
            let held = self.transport.epoch().map_or(0, |e| e.epoch);
            self.epoch.ask(wanted, held);
        }
        match self.epoch.poll() {
            None => {}
            Some(Fetched::View(view)) => {
                self.rows.set_epoch(now, view.clone());
                self.transport.set_epoch(now, view);
            }
            Some(Fetched::Failed {
                wanted,
                held,
                waited,
                message,
                job_failed,
            }) => {
                let current = self.transport.epoch().map_or(0, |e| e.epoch);
                if job_failed {
                    let err = || self.epoch.job_failed(&message);
                    log::error!("phub-worker: {}", err());
                    self.transport.epoch_unavailable(err);
                    self.rows.epoch_unavailable(err);
                    self.deliver();
                } else if wanted > current {
                    let err = || self.epoch.error(wanted, held, waited, &message);
                    log::error!("phub-worker: {}", err());
                    self.transport.epoch_unavailable(err);
                    self.rows.epoch_unavailable(err);
                    self.deliver();
                } else {
                    log::warn!(
                        "phub-worker: asking control at {} whether epoch {held} is current (chunks unanswered): {message}",
                        self.epoch.url()
                    );
                }
            }
        }
    }

    /// How long to wait for a datagram: until the transport's next timer
    /// (at most [`TICK`] while requests are in flight, [`IDLE`] otherwise)
    /// or the injector's next release.
    fn wait(&self) -> Duration {
        let holds = self.inject.as_ref().is_some_and(Injector::holds_sends);
        let mut wait = if self.busy() || holds { TICK } else { IDLE };
        // Delayed datagrams are released by the first turn after they are
        // due: do not sleep past the first.
        let due = self.inject.as_ref().and_then(Injector::next_due);
        for at in [self.transport.poll_timeout(), self.rows.poll_timeout(), due]
            .into_iter()
            .flatten()
        {
            wait = wait.min(at.saturating_duration_since(Instant::now()));
        }
        wait
    }

    /// Whether dense or table requests are in flight.
    fn busy(&self) -> bool {
        self.transport.busy() || self.rows.busy()
    }

    /// Sends what the transports have to send at `now`, in one batch.
    fn transmit(&mut self, socket: &mut BatchSocket, now: Instant) {
        let mut dgrams = Vec::new();
        self.transport.poll_transmit(now, &mut dgrams);
        self.rows.poll_transmit(now, &mut dgrams);
        if dgrams.is_empty() {
            return;
        }
        match self.inject.as_mut() {
            None => send_counted(socket, &self.stats, &dgrams),
            Some(inj) => {
                let mut out = Vec::with_capacity(dgrams.len());
                inj.outgoing(&dgrams, &mut out, now);
                send_counted(socket, &self.stats, &out);
            }
        }
    }

    /// Handles every datagram waiting on the socket (without blocking);
    /// returns how many there were.
    fn receive(&mut self, socket: &mut BatchSocket) -> std::io::Result<usize> {
        let own = self.own;
        // With injection, what was held back in the batch before (and
        // delayed ones now due) is handled after this batch.
        let now = Instant::now();
        let n = socket.recv(None, &mut |from, d| {
            if d.is_empty() || from == own {
                return; // a wake-up from the API side
            }
            add(&self.stats.bytes_received, d.len() as u64);
            let copies = match self.inject.as_mut() {
                None => 1,
                Some(inj) => inj.incoming(from, d, now),
            };
            for _ in 0..copies {
                self.on_datagram(from, d, Instant::now());
            }
        })?;
        let held = self
            .inject
            .as_mut()
            .map_or_else(Vec::new, |inj| inj.released(Instant::now()));
        for h in &held {
            self.on_datagram(h.addr, &h.bytes, Instant::now());
        }
        Ok(n + held.len())
    }

    /// Hands a datagram from `from` received at `now` to the row transport
    /// if it is a table answer or a table's ERROR, else to the dense
    /// transport, checking the shared-memory regions first when it asks,
    /// and delivers what they ended.
    fn on_datagram(&mut self, from: SocketAddr, d: &[u8], now: Instant) {
        let taken = self.rows.handle(now, from, d);
        self.deliver_rows();
        if taken {
            return;
        }
        let Some(m) = self.transport.accept(Some(from), d) else {
            return;
        };
        if self.transport.checks_regions_first(&m) {
            self.check_regions(now, When::Now);
        }
        self.transport.handle(now, m);
        self.deliver();
    }

    /// With shared memory: has the regions checked (see
    /// [`RegionWatch::check`]) and, when the mapping changed or opening it
    /// was tried, tells the transport (which writes every outstanding
    /// chunk into the mapping in use, or sends it as a datagram).
    fn check_regions(&mut self, now: Instant, when: When) {
        let Some(watch) = self.regions.as_mut() else {
            return;
        };
        let regions = match watch.check(now, when) {
            RegionCheck::Unchanged => return,
            RegionCheck::Remapped(r) => Some(r),
            RegionCheck::Unavailable => None,
        };
        self.stats.shm.store(regions.is_some(), Ordering::Relaxed);
        self.transport.set_regions(regions);
    }

    /// Sends every ended request's outcome to its waiter.
    fn deliver(&mut self) {
        while let Some(f) = self.transport.poll_done() {
            self.finish(f);
        }
        self.deliver_rows();
    }

    /// Sends every ended table request's outcome to its waiter.
    fn deliver_rows(&mut self) {
        while let Some(RowFinished { key, done, result }) = self.rows.poll_done() {
            if let Err(e @ WorkerError::TableTimeout { .. }) = &result {
                log::warn!("phub-worker: key {key}: {e}");
            }
            // The caller may be gone; the table's claim is its own.
            let _ = done.send(result);
        }
    }

    /// Records `f`'s outcome in the key table and sends it to its waiter.
    fn finish(&self, f: Finished<Sender<Completion>>) {
        let Finished {
            key,
            done,
            tx,
            result,
        } = f;
        let completion = match result {
            Ok(output) => {
                let claim = self.keys.end(key, Some(output.round), tx);
                // A direct request's results may still be in the result
                // regions: the key stays claimed until the waiter copied
                // them out; any other frees it here.
                let claim = matches!(output.sink, Sink::Direct { .. }).then_some(claim);
                Ok(Done { key, output, claim })
            }
            Err(e) => {
                if matches!(e, WorkerError::Timeout { .. }) {
                    log::warn!("phub-worker: {e}");
                }
                drop(self.keys.end(key, None, tx));
                Err(e)
            }
        };
        // The caller may have dropped its handle; the key is free either way
        // (a direct request's claim is dropped with the unread completion).
        let _ = done.send(completion);
    }
}

/// Sends `dgrams` in one batch and counts the bytes the kernel took.
fn send_counted(socket: &mut BatchSocket, stats: &Counters, dgrams: &[Datagram<'_>]) {
    if dgrams.is_empty() {
        return;
    }
    let bytes: u64 = dgrams.iter().map(|d| d.len() as u64).sum();
    match socket.send(dgrams) {
        Ok(n) if n == dgrams.len() => add(&stats.bytes_sent, bytes),
        Ok(n) => {
            log::debug!("phub-worker: the kernel took {n} of {} datagrams", dgrams.len());
            add(&stats.bytes_sent, bytes * n as u64 / dgrams.len() as u64);
        }
        // A failed send is a lost packet: the chunk stays outstanding and
        // is retransmitted; a persistent failure ends in a timeout.
        Err(e) => log::debug!("phub-worker: sending: {e}"),
    }
}
