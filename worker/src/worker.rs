//! The joined [`Worker`]: its accessors, the request calls (`init`,
//! `push_pull`, `push_pull_in_place`, `pull`, `wait`) and the hand-over of
//! requests to the I/O thread. Keys are claimed, and their results kept
//! for the next request, through the key table (`keys.rs`); chunks are
//! encoded by `encode.rs`.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use phub_proto::layout::{Layout, Place, Placement};
use phub_proto::spec::{Consistency, JobSpec};
use phub_proto::wire::MsgType;

use crate::elem::{self, Dst, Element, Src, ValueType};
use crate::encode::Encoded;
use crate::error::WorkerError;
use crate::io::{Command, Completion, CurrentRegions, Done, Request};
use crate::keys::KeyTable;
use crate::net;
use crate::stats::{self, WorkerStats};
use crate::tables::TableClaims;
use crate::transport::{Kind, Sink, TableInfo, Tx};
#[cfg(doc)]
use crate::{config::WorkerConfig, exchange::Exchange};

/// A request in flight; give it to [`Worker::wait`] to get its result.
///
/// Dropping a handle without waiting abandons the result, not the request:
/// the exchange still completes in the background and the key becomes free
/// (when the request has ended, or at once if it had).
#[must_use = "the result is only written by Worker::wait"]
pub struct Handle<'a> {
    pub(crate) key: u32,
    pub(crate) round: u32,
    pub(crate) done: Receiver<Completion>,
    /// Where [`Worker::wait`] writes the result; `None` for a push without
    /// an output ([`Worker::push_staged`]), waited only in place.
    pub(crate) out: Option<Dst<'a>>,
}

impl std::fmt::Debug for Handle<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("key", &self.key)
            .field("round", &self.round)
            .field("elements", &self.out.as_ref().map(Dst::len))
            .finish()
    }
}

impl Handle<'_> {
    /// The key this request exchanges.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// The round this request completes (0 for `init`).
    pub fn round(&self) -> u32 {
        self.round
    }
}

/// A joined worker: one rank of one job.
///
/// `Send + Sync`; every method takes `&self`, so threads may share it. One
/// background thread owns the UDP socket; dropping the worker stops it and
/// fails requests still in flight with [`WorkerError::Closed`].
#[derive(Debug)]
pub struct Worker {
    pub(crate) job: u16,
    pub(crate) token: u64,
    pub(crate) rank: u16,
    pub(crate) spec: JobSpec,
    /// The layout, checked against the spec.
    pub(crate) placement: Placement,
    /// Where each chunk of the job's chunk sequence lives, expanded from
    /// the layout once (8 bytes a chunk).
    pub(crate) places: Vec<Place>,
    /// Per lcore, where its chunks go.
    pub(crate) lcores: Vec<SocketAddr>,
    /// Where each key stands (shared with the I/O thread).
    pub(crate) keys: KeyTable,
    pub(crate) cmds: Sender<Command>,
    /// A handle on the socket, to wake the I/O thread with an empty datagram.
    pub(crate) waker: UdpSocket,
    pub(crate) local: SocketAddr,
    /// The I/O thread waits in the kernel (see `send_request`).
    pub(crate) sleeping: Arc<std::sync::atomic::AtomicBool>,
    pub(crate) socket_info: net::SocketInfo,
    pub(crate) stats: Arc<stats::Counters>,
    /// The shared-memory mapping in use, when the join chose shared
    /// memory: `init` and `push_pull` stage chunks into it and `wait`
    /// reads results from it on the caller's thread.
    pub(crate) shm: Option<CurrentRegions>,
    /// The job's table keys (PROTOCOL.md §10), in key order.
    pub(crate) tables: Vec<TableInfo>,
    /// Each table's round (clock) and whether a request of it is in flight.
    pub(crate) table_claims: TableClaims,
    pub(crate) thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// This worker's rank.
    pub fn rank(&self) -> u16 {
        self.rank
    }

    /// The job's id.
    pub fn job(&self) -> u16 {
        self.job
    }

    /// The job's worker count W.
    pub fn workers(&self) -> u32 {
        self.spec.workers
    }

    /// The job's spec as admitted.
    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    /// The job's chunk layout.
    pub fn layout(&self) -> &Layout {
        self.placement.layout()
    }

    /// Where each chunk of `key` lives, in chunk order (empty for no such
    /// key).
    pub(crate) fn places(&self, key: u32) -> &[Place] {
        let seqs = self.placement.chunks().of_key(key);
        // Cast: sequence numbers index `places`, which is in memory.
        #[allow(clippy::cast_possible_truncation)]
        let (a, b) = (seqs.start as usize, seqs.end as usize);
        &self.places[a..b]
    }

    /// Elements of `key`, or `None` if the job has no such key.
    pub fn key_len(&self, key: u32) -> Option<u64> {
        self.spec.keys.get(key as usize).map(|k| k.elements)
    }

    /// The last round whose result this worker holds for `key` (`None`
    /// before `init` or `pull` completed, or for an unknown key). In an
    /// async or bounded-delay job this is the key's **clock**: the number
    /// of `push_pull`s of the key whose answers this rank holds (every
    /// chunk of a key carries the same clock, PROTOCOL.md §5.8).
    pub fn key_round(&self, key: u32) -> Option<u32> {
        self.keys.round(key)
    }

    /// This rank's clock: the lowest [`Worker::key_round`] over the job's
    /// keys, that is the number of steps (a `push_pull` of every key) whose
    /// answers this rank holds; 0 after `init`, `None` while a key is not
    /// initialised. In a BSP job it is the last round completed on every
    /// key; in an async or bounded-delay job each rank has its own, and
    /// with bounded delay τ a rank's clock is never more than τ + 1 ahead
    /// of the slowest rank's (PROTOCOL.md §5.8).
    pub fn clock(&self) -> Option<u32> {
        self.keys.clock()
    }

    /// The job's consistency mode (its spec's `consistency`): BSP, async
    /// or bounded delay τ. The same calls work in every mode; what a
    /// `push_pull`'s result holds differs (PROTOCOL.md §5.8).
    pub fn consistency(&self) -> Consistency {
        self.spec.consistency
    }

    /// The local address of the worker's UDP socket.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The window in use: most chunks outstanding at once. A window made
    /// from the job's shape ([`WorkerConfig::window`] = 0) follows the
    /// receive-buffer share the appliance's lcores state in their results
    /// (PROTOCOL.md §6.1): it shrinks when other jobs come to them and grows
    /// back when they leave.
    pub fn window(&self) -> usize {
        usize::try_from(self.stats.window.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(usize::MAX)
    }

    /// What the UDP socket got (GSO, GRO, buffer sizes).
    pub fn socket_info(&self) -> net::SocketInfo {
        self.socket_info
    }

    /// A snapshot of the worker's counters.
    pub fn stats(&self) -> WorkerStats {
        self.stats.snapshot()
    }

    /// Bytes this worker keeps between rounds to reuse: each key's
    /// datagram buffer and result buffer from its last request with a copy
    /// ([`Worker::init`], [`Worker::push_pull`], [`Worker::pull`]): up to
    /// twice the model, which saves allocating and faulting them in again
    /// every round. A key exchanged with its buffers lent
    /// ([`Worker::exchange`]) keeps only its datagrams' headers.
    pub fn spare_bytes(&self) -> usize {
        self.keys.spare_bytes()
    }

    /// Whether chunks and results go through shared memory with the
    /// dataplane now (see [`WorkerConfig::shm`]).
    pub fn shm(&self) -> bool {
        self.stats.shm.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Round 0 for `key`: rank 0's `params` become everyone's initial values.
    /// Every rank must call it (other ranks' `params` are not sent); after
    /// [`Worker::wait`], `params` holds the broadcast values on every rank.
    ///
    /// Like every method that takes values, it takes `f32` slices for any
    /// job, or slices of the job's 16-bit wire type (see [`Element`]).
    pub fn init<'a, E: Element>(&'a self, key: u32, params: &'a mut [E]) -> Result<Handle<'a>, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, params.len())?;
        self.keys.claim(key, |held| match held {
            Some(r) if r > 0 => Err(format!(
                "init is round 0 but this worker already holds round {r}; use push_pull (or pull to catch up)"
            )),
            _ => Ok(0),
        })?;
        let payload = (self.rank == 0).then_some(Src::of(&params[..]));
        let encoded = self.prepare(key, elements, MsgType::Init, 0, payload, ValueType::of::<E>());
        self.submit(key, 0, Kind::Init, encoded, Some(Dst::of(params)))
    }

    /// The next round for `key`: pushes `grad` (copied at once, so the caller
    /// may reuse it) and, after [`Worker::wait`], `out` holds the round's
    /// result: the new parameters, or the sum or mean with a `sum`/`mean` job.
    ///
    /// In an async or bounded-delay job ([`Worker::consistency`]) the push
    /// carries this rank's next clock on the key and is applied alone: `out`
    /// gets the key's values when the appliance answered (with `sum`,
    /// `grad` is a delta added to the stored values); with bounded delay τ
    /// the answer waits until no rank is more than τ clocks behind this
    /// one (PROTOCOL.md §5.8).
    ///
    /// With shared memory ([`WorkerConfig::shm`]), `grad` is encoded here
    /// straight into the staging region and `wait` decodes the result
    /// straight from the result regions into `out`; the key stays busy
    /// until then (or until the handle is dropped).
    pub fn push_pull<'a, E: Element>(
        &'a self,
        key: u32,
        grad: &[E],
        out: &'a mut [E],
    ) -> Result<Handle<'a>, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, grad.len())?;
        self.check_len(key, out.len())?;
        let round = self.claim_next_round(key)?;
        let encoded = self.prepare(
            key,
            elements,
            MsgType::Push,
            round,
            Some(Src::of(grad)),
            ValueType::of::<E>(),
        );
        self.submit(key, round, Kind::Push, encoded, Some(Dst::of(out)))
    }

    /// [`Worker::push_pull`] with the gradient and the result in one buffer:
    /// pushes `buf` (copied at once) and, after [`Worker::wait`], `buf`
    /// holds the round's result. Saves the caller a copy of the gradient
    /// when it exchanges in place (a DDP bucket, a NumPy array).
    pub fn push_pull_in_place<'a, E: Element>(
        &'a self,
        key: u32,
        buf: &'a mut [E],
    ) -> Result<Handle<'a>, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, buf.len())?;
        let round = self.claim_next_round(key)?;
        let encoded = self.prepare(
            key,
            elements,
            MsgType::Push,
            round,
            Some(Src::of(&buf[..])),
            ValueType::of::<E>(),
        );
        self.submit(key, round, Kind::Push, encoded, Some(Dst::of(buf)))
    }

    /// Claims `key` for its next round (after init or pull): in a BSP job
    /// the next round, in the other modes this rank's next clock.
    pub(crate) fn claim_next_round(&self, key: u32) -> Result<u32, WorkerError> {
        let consistency = self.spec.consistency;
        self.keys.claim(key, |held| next_round(consistency, held))
    }

    /// Waits for a request's result and writes it into the slice the
    /// request was started with.
    ///
    /// With shared memory, the results are copied (decoded for 16-bit
    /// types) here, on the caller's thread, straight from the lcores'
    /// result regions into that slice.
    pub fn wait(&self, h: Handle<'_>) -> Result<(), WorkerError> {
        let Done { key, output, claim } = recv(&h.done)?;
        let Some(out) = h.out else {
            // The round completed; its results are let go.
            self.keys.keep_values(key, output.sink.into_values());
            drop(claim);
            return Err(WorkerError::Sequence {
                key,
                message: format!(
                    "round {} was pushed without an output (push_staged): \
                     its results can only be read in place (wait_in_place); they are let go",
                    output.round
                ),
            });
        };
        self.copy_out(key, &output.sink, out);
        self.keys.keep_values(key, output.sink.into_values());
        // Frees the key (for a direct request), now that its results are
        // out of the result regions.
        drop(claim);
        Ok(())
    }

    /// Fetches the last completed result of every chunk of `key` into `out`
    /// and returns its round (for a worker that rejoins a running job).
    /// Blocks until done.
    ///
    /// If the chunks stand at different rounds (this worker left in the
    /// middle of a round), the lowest is returned and becomes the key's
    /// round: the next `push_pull` completes the round the other ranks are
    /// waiting for. A key with a chunk that never completed round 0 has
    /// nothing to pull: the appliance refuses it (`nothing_to_pull`,
    /// PROTOCOL.md §5.5) and the call ends in [`WorkerError::Refused`]: the
    /// appliance restarted before round 0 completed, and the job's ranks
    /// send the key's INIT again (§6.1).
    ///
    /// In an async or bounded-delay job the round returned is this rank's
    /// last answered clock on the key (PROTOCOL.md §5.8), and `out` gets
    /// the key's current values.
    pub fn pull<E: Element>(&self, key: u32, out: &mut [E]) -> Result<u32, WorkerError> {
        self.check_elem::<E>()?;
        let elements = self.check_len(key, out.len())?;
        self.keys.claim(key, |_| Ok(0))?;
        let (chunks, buf) = self.messages(key, elements, MsgType::Pull, 0, None);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.send_request(Request {
            key,
            round: 0,
            kind: Kind::Pull,
            chunks,
            tx: Tx::Owned(buf),
            sink: Sink::Owned(self.keys.take_values(key, elements, ValueType::of::<E>())),
            done: tx,
        })?;
        let Done { key, output, claim } = recv(&rx)?;
        self.copy_out(key, &output.sink, Dst::of(out));
        self.keys.keep_values(key, output.sink.into_values());
        drop(claim);
        Ok(output.round)
    }

    /// The key's element count, checked against a slice length.
    pub(crate) fn check_len(&self, key: u32, got: usize) -> Result<usize, WorkerError> {
        if self.keys.is_table(key) {
            return Err(WorkerError::Sequence {
                key,
                message: format!(
                    "key {key} is the table {:?}, which has rows, not elements: use push_pull_rows, push_rows \
                     and pull_rows",
                    self.spec.keys[key as usize].name
                ),
            });
        }
        let expected = self.key_len(key).ok_or(WorkerError::UnknownKey {
            key,
            keys: self.spec.keys.len(),
        })?;
        if expected != got as u64 {
            return Err(WorkerError::Length { key, expected, got });
        }
        Ok(got)
    }

    /// Whether the job takes slices of `E` (see [`Element`]).
    pub(crate) fn check_elem<E: Element>(&self) -> Result<(), WorkerError> {
        if elem::fits::<E>(self.spec.dtype) {
            return Ok(());
        }
        Err(WorkerError::ElementType {
            elem: E::NAME,
            dtype: self.spec.dtype,
        })
    }

    /// Hands `key`'s `encoded` request of `kind` for `round` to the I/O
    /// thread (the key is claimed); [`Worker::wait`] on the handle writes
    /// `out`.
    pub(crate) fn submit<'a>(
        &'a self,
        key: u32,
        round: u32,
        kind: Kind,
        encoded: Encoded,
        out: Option<Dst<'a>>,
    ) -> Result<Handle<'a>, WorkerError> {
        let (done, rx) = crossbeam_channel::bounded(1);
        let Encoded { chunks, tx, sink } = encoded;
        self.send_request(Request {
            key,
            round,
            kind,
            chunks,
            tx,
            sink,
            done,
        })?;
        Ok(Handle {
            key,
            round,
            done: rx,
            out,
        })
    }

    /// Hands a request to the I/O thread (the key is already claimed).
    pub(crate) fn send_request(&self, r: Request) -> Result<(), WorkerError> {
        let key = r.key;
        self.send_command(Command::Submit(r))
            .inspect_err(|_| self.keys.release(key))
    }

    /// Hands `c` to the I/O thread, waking it if it may be waiting;
    /// [`WorkerError::Closed`] when the thread is gone.
    pub(crate) fn send_command(&self, c: Command) -> Result<(), WorkerError> {
        self.cmds.send(c).map_err(|_| WorkerError::Closed)?;
        // The I/O thread checks the channel before it waits; it only needs
        // a wake-up datagram when it may already be waiting.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.sleeping.load(std::sync::atomic::Ordering::SeqCst) {
            self.wake();
        }
        Ok(())
    }

    /// Interrupts the I/O thread's blocking receive.
    pub(crate) fn wake(&self) {
        if let Err(e) = self.waker.send_to(&[], self.local) {
            // The thread still notices within its read timeout.
            log::debug!("phub-worker: waking the I/O thread: {e}");
        }
    }
}

/// A request's outcome from its channel ([`WorkerError::Closed`] when the
/// I/O thread is gone).
pub(crate) fn recv(done: &Receiver<Completion>) -> Result<Done, WorkerError> {
    done.recv().unwrap_or(Err(WorkerError::Closed))
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.cmds.send(Command::Shutdown);
        self.wake();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("phub-worker: the I/O thread panicked");
            }
        }
    }
}
/// Largest clock a rank of an async or bounded-delay job may push
/// (PROTOCOL.md §5.8: the appliance keeps a flag in the clock's top bit).
pub const MAX_CLOCK: u32 = phub_proto::checkpoint::CLOCK_HELD - 1;

/// The round (BSP) or clock (the other modes) a key's next `push_pull`
/// carries, after `held`, the last one whose result this worker holds.
pub(crate) fn next_round(consistency: Consistency, held: Option<u32>) -> Result<u32, String> {
    match (held, consistency) {
        (None, _) => Err("push_pull before the key was initialised: call init (or pull) first".to_string()),
        (Some(r), Consistency::Sync) if r >= u32::MAX - 1 => {
            Err(format!("round {r} is the last a job can complete"))
        }
        (Some(c), Consistency::Async | Consistency::Bounded { .. }) if c >= MAX_CLOCK => Err(format!(
            "clock {c} is the last a rank of a {} job can push (clocks end at 2^31 - 1, PROTOCOL.md §5.8)",
            consistency.mode()
        )),
        (Some(r), _) => Ok(r + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_callers_hold_can_be_shared_between_threads() {
        // The Python binding keeps these in objects any thread may use.
        fn shared<T: Send + Sync>() {}
        shared::<Worker>();
        shared::<Handle<'_>>();
        shared::<crate::staged::Results<'_>>();
    }

    #[test]
    fn the_next_clock_ends_at_the_mode_s_limit_and_says_so() {
        let bounded = Consistency::Bounded { delay: 3 };
        assert_eq!(next_round(Consistency::Sync, Some(0)), Ok(1));
        assert_eq!(next_round(Consistency::Async, Some(41)), Ok(42));
        assert_eq!(next_round(bounded, Some(MAX_CLOCK - 1)), Ok(MAX_CLOCK));
        // BSP rounds go on past 2^31.
        assert_eq!(next_round(Consistency::Sync, Some(MAX_CLOCK)), Ok(MAX_CLOCK + 1));
        for c in [Consistency::Async, bounded] {
            let e = next_round(c, Some(MAX_CLOCK)).unwrap_err();
            assert!(
                e.contains(c.mode()) && e.contains("2^31 - 1") && e.contains("2147483647"),
                "{e}"
            );
        }
        let e = next_round(Consistency::Sync, Some(u32::MAX - 1)).unwrap_err();
        assert!(e.contains("last a job can complete"), "{e}");
        assert!(next_round(bounded, None).unwrap_err().contains("init"));
    }
}
