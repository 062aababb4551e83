//! The I/O thread: windowed sending, retransmission, result matching.
//!
//! One thread per [`Worker`](crate::Worker) owns the UDP socket's receive
//! side. Requests arrive over a channel with their datagrams already encoded
//! (one buffer per request, reused round after round for the same key);
//! the thread keeps at most `window` chunks outstanding across all requests
//! (first come, first sent), sends each refill of the window as one batch
//! ([`crate::net`]: `sendmmsg`, GSO trains per destination), receives in
//! batches (`recvmmsg`, GRO trains split per datagram), retransmits a chunk
//! whose RESULT is late (fast retransmission when later chunks' results
//! overtake it; otherwise a loss timer from the smallest round trip, run
//! only while no result comes in, with probes that back off; Karn's rule
//! for samples), writes accepted results into the request's buffer (or the
//! caller's, lent by an [`Exchange`](crate::Exchange)) and completes the
//! request when all its chunks are in. Every request ends: with its result,
//! with the appliance's refusal, with a timeout after `timeout` without any
//! accepted result, or with [`WorkerError::Closed`] when the worker is
//! dropped. With [`crate::inject`] on, every datagram sent and received
//! first gets a fate (lost, duplicated, held back, delayed).
//!
//! With shared memory ([`crate::shm`]), a chunk's datagrams (retransmissions
//! too) are the header alone with the SHM flag. `init` and `push_pull`
//! requests come staged: the caller's thread wrote their payloads into the
//! staging region ([`Tx::Staged`]), and their results are left in the
//! result regions for `wait` to copy out ([`Sink::Direct`]), so this thread
//! moves headers only. Other requests' payloads (their buffers, or the
//! caller's lent gradient) are copied into the staging region when a chunk
//! is first sent, and their RESULTs with the flag are read from the lcore's
//! result region here. Every request can still produce its payloads (a
//! staged one from the mapping it was staged into), so chunks can be
//! written again into new regions, or sent as datagrams, when the
//! dataplane's regions change ([`Shm`]).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use phub_proto::wire::{self, flags, DropReason, Header, MsgType, APPLIANCE_RANK, HEADER_LEN};
use phub_proto::Dtype;

use crate::codec;
use crate::error::WorkerError;
use crate::inject::Injector;
use crate::net::{BatchSocket, Datagram};
use crate::shm::{RegionSpec, Regions};
use crate::stats::{add, Counters};
use crate::WorkerConfig;

/// Where a key stands, shared between the API and the I/O thread.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyState {
    /// Last round whose result this worker holds, `None` before init/pull.
    pub(crate) round: Option<u32>,
    /// A request is in flight.
    pub(crate) busy: bool,
    /// The datagram buffer of the key's last request, for the next one
    /// (no allocation, no page faults, no zeroing round after round).
    pub(crate) tx_spare: Vec<u8>,
    /// The result buffer of the key's last request, likewise.
    pub(crate) values_spare: Vec<f32>,
}

/// The shared key table.
pub(crate) type Keys = Arc<Mutex<Vec<KeyState>>>;

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Round 0.
    Init,
    /// Round >= 1.
    Push,
    /// Last completed result, any round.
    Pull,
}

/// One chunk's datagram and where its result goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkMsg {
    /// Chunk index within the key.
    pub(crate) chunk: u32,
    /// Slot on the owning lcore.
    pub(crate) slot: u32,
    /// First element of the chunk within the key.
    pub(crate) offset: usize,
    /// Elements of the chunk.
    pub(crate) len: u32,
    /// The owning lcore's address.
    pub(crate) to: SocketAddr,
    /// The owning lcore.
    pub(crate) lcore: u16,
    /// Where the datagram (header and payload, ready to send) starts in the
    /// request's buffer.
    pub(crate) start: usize,
    /// The datagram's length in bytes.
    pub(crate) bytes: usize,
}

impl ChunkMsg {
    /// The whole datagram in an owned buffer.
    fn range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.bytes
    }

    /// The header, in either kind of buffer.
    fn header_range(&self) -> std::ops::Range<usize> {
        self.start..self.start + HEADER_LEN
    }
}

/// Where a request's datagrams come from.
#[derive(Debug)]
pub(crate) enum Tx {
    /// Every chunk's datagram (header and payload) at the chunk's `start`.
    Owned(Vec<u8>),
    /// Every chunk's header at the chunk's `start` (HEADER_LEN bytes); the
    /// payloads are the caller's `f32`s, little-endian as on the wire,
    /// borrowed for the whole request (see [`crate::Exchange`]).
    Borrowed {
        /// The headers.
        headers: Vec<u8>,
        /// The caller's gradient, as bytes.
        payload: RawBytes,
    },
    /// Every chunk's header at the chunk's `start` (HEADER_LEN bytes); the
    /// payloads were written by the caller's thread into the staging
    /// region of `regions`, the mapping current when the key was claimed
    /// (see [`crate::Worker::push_pull`]).
    Staged {
        /// The headers.
        headers: Vec<u8>,
        /// The mapping the payloads are in.
        regions: Arc<Regions>,
        /// Element size of the job's wire type.
        size: usize,
        /// Payloads copied back from `regions` (chunk at its first element
        /// times `size`) for chunks that go elsewhere: to another mapping
        /// or as datagrams. Empty until one does.
        copied: Vec<u8>,
    },
}

impl Tx {
    /// The buffer the headers live in (mutable: the RETRANSMIT flag).
    fn headers_mut(&mut self) -> &mut [u8] {
        match self {
            Tx::Owned(b) => b,
            Tx::Borrowed { headers, .. } | Tx::Staged { headers, .. } => headers,
        }
    }

    /// Chunk `m`'s datagram as head and body (the body is empty when the
    /// head holds the whole datagram). With [`flags::SHM`] in its header,
    /// the datagram is the header alone.
    fn parts(&self, m: &ChunkMsg) -> (&[u8], &[u8]) {
        let header = match self {
            Tx::Owned(b) => &b[m.header_range()],
            Tx::Borrowed { headers, .. } | Tx::Staged { headers, .. } => &headers[m.header_range()],
        };
        if Header::new_unchecked(header).flags() & flags::SHM != 0 {
            return (header, &[]);
        }
        match self {
            Tx::Owned(b) => (&b[m.range()], &[]),
            Tx::Borrowed { .. } => (header, self.payload(m)),
            // `stage` copied the payload back before clearing the flag.
            Tx::Staged { copied, size, .. } => (header, &copied[Tx::copied_range(m, *size)]),
        }
    }

    /// Where a staged request keeps chunk `m`'s payload once copied back.
    fn copied_range(m: &ChunkMsg, size: usize) -> std::ops::Range<usize> {
        let at = m.offset * size;
        at..at + (m.bytes - HEADER_LEN)
    }

    /// Chunk `m`'s payload: its elements as wire bytes.
    fn payload(&self, m: &ChunkMsg) -> &[u8] {
        match self {
            Tx::Owned(b) => &b[m.start + HEADER_LEN..m.start + m.bytes],
            Tx::Borrowed { payload, .. } => {
                let at = m.offset * 4;
                let len = m.bytes - HEADER_LEN;
                // SAFETY: the Exchange that made this request keeps the
                // caller's gradient borrowed (shared) until the request has
                // ended, and the chunk lies inside it (offset and length
                // come from the key's layout, checked against its length).
                unsafe { payload.slice(at, len) }
            }
            Tx::Staged { copied, size, .. } => &copied[Tx::copied_range(m, *size)],
        }
    }

    /// Puts chunk `m`'s payload where the next transmission of it takes
    /// it from: with `regions`, into the staging region at its slot and
    /// [`flags::SHM`] set in its header (the datagram is the header alone);
    /// otherwise (or when the slot is not in the regions) the flag cleared
    /// and the payload in the datagram. Returns whether it went to shared
    /// memory.
    ///
    /// A staged request's payload is already in its own mapping: when that
    /// is `regions`, nothing is copied. Otherwise (the dataplane made new
    /// regions, or there are none) the payload is first copied back from
    /// the request's own mapping, which stays mapped with it and which
    /// nothing else writes at that slot: only a request for the same key,
    /// and the key is claimed until this one has ended.
    fn stage(&mut self, m: &ChunkMsg, regions: Option<&Arc<Regions>>) -> bool {
        if let Tx::Staged {
            regions: own,
            size,
            copied,
            ..
        } = self
        {
            if regions.is_some_and(|r| Arc::ptr_eq(r, own)) {
                return self.set_shm(m, true);
            }
            let range = Tx::copied_range(m, *size);
            if copied.len() < range.end {
                copied.resize(range.end, 0);
            }
            if !own.read_staged(m.lcore, m.slot, &mut copied[range]) {
                // Cannot happen: the chunk was written at this slot.
                log::error!(
                    "phub-worker: chunk {} of slot {} not in its staging region",
                    m.chunk,
                    m.slot
                );
            }
        }
        let shm = regions.is_some_and(|r| {
            let p = self.payload(m);
            p.is_empty() || r.write_chunk(m.lcore, m.slot, p)
        });
        self.set_shm(m, shm)
    }

    /// Sets or clears [`flags::SHM`] in chunk `m`'s header; returns `shm`.
    fn set_shm(&mut self, m: &ChunkMsg, shm: bool) -> bool {
        let mut h = Header::new_unchecked(&mut self.headers_mut()[m.header_range()]);
        let f = h.flags() & !flags::SHM;
        h.set_flags(if shm { f | flags::SHM } else { f });
        shm
    }

    /// Gives the owned buffer back for reuse (an empty one for borrowed).
    fn into_spare(self) -> Vec<u8> {
        match self {
            Tx::Owned(b) => b,
            Tx::Borrowed { headers, .. } | Tx::Staged { headers, .. } => headers,
        }
    }
}

/// Where a request's result goes.
#[derive(Debug)]
pub(crate) enum Sink {
    /// A buffer of the key's length, handed to the waiter at the end.
    Owned(Vec<f32>),
    /// The caller's output slice, borrowed for the whole request (see
    /// [`crate::Exchange`]).
    Borrowed(RawF32s),
    /// Results left in the result regions of `regions` for the waiter to
    /// copy out: chunk c's is there (at its slot) when `in_region[c]`, in
    /// `values` otherwise (it came as a datagram, or from another mapping).
    Direct {
        /// A buffer of the key's length for the chunks not in `regions`.
        values: Vec<f32>,
        /// The mapping the request was staged into.
        regions: Arc<Regions>,
        /// Per chunk of the key: its result is in `regions`.
        in_region: Vec<bool>,
    },
}

impl Sink {
    fn slice_mut(&mut self, start: usize, end: usize) -> &mut [f32] {
        match self {
            Sink::Owned(v) | Sink::Direct { values: v, .. } => &mut v[start..end],
            // SAFETY: the Exchange that made this request keeps the
            // caller's output borrowed (exclusively) until the request has
            // ended, and only this thread writes it meanwhile; `end` is
            // within the key's length, which the slice was checked to have.
            Sink::Borrowed(r) => unsafe { r.slice_mut(start, end - start) },
        }
    }
}

/// A caller's byte buffer, lent to the I/O thread by an Exchange.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawBytes {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

impl RawBytes {
    /// # Safety
    /// The buffer must still be borrowed by the Exchange that lent it, and
    /// `at + len` must not exceed its length.
    unsafe fn slice(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.len, "chunk outside the lent gradient");
        // SAFETY: in bounds (checked above); live and unaliased by writers
        // per this function's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) }
    }
}

/// A caller's output slice, lent to the I/O thread by an Exchange.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawF32s {
    pub(crate) ptr: *mut f32,
    pub(crate) len: usize,
}

impl RawF32s {
    /// # Safety
    /// The slice must still be borrowed by the Exchange that lent it, with
    /// no other access to it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, at: usize, len: usize) -> &mut [f32] {
        assert!(at + len <= self.len, "chunk outside the lent output");
        // SAFETY: in bounds (checked above); live and exclusively ours per
        // this function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }
}

// SAFETY: the pointers are lent by an Exchange, which does not let the
// borrowed buffers go (or be touched by the caller) before every request
// using them has ended; until then only the I/O thread uses them (reads
// of the gradient, writes of the output).
unsafe impl Send for RawBytes {}
// SAFETY: as for RawBytes.
unsafe impl Send for RawF32s {}

/// A finished request.
#[derive(Debug)]
pub(crate) struct Done {
    /// The key.
    pub(crate) key: u32,
    /// The key's values (result of the round).
    pub(crate) values: Vec<f32>,
    /// The round they are the result of (for a pull, the lowest over chunks).
    pub(crate) round: u32,
    /// For a [`Sink::Direct`] request: where the results are, and the
    /// key's claim, held until they are copied out.
    pub(crate) direct: Option<DirectDone>,
}

/// Where a [`Sink::Direct`] request's results are.
#[derive(Debug)]
pub(crate) struct DirectDone {
    /// The mapping whose result regions hold chunk c's result when
    /// `in_region[c]`; `Done::values` holds the others.
    pub(crate) regions: Arc<Regions>,
    /// Per chunk of the key.
    pub(crate) in_region: Vec<bool>,
    /// Frees the key when dropped: after the waiter copied the results out
    /// of the regions, or unread when the handle is dropped without a wait.
    pub(crate) _claim: KeyClaim,
}

/// The claim on a key whose results still sit in the result regions:
/// frees the key when dropped. Until then no new request can push the
/// key's chunks, so the lcores cannot overwrite their results.
#[derive(Debug)]
pub(crate) struct KeyClaim {
    keys: Keys,
    key: u32,
}

impl Drop for KeyClaim {
    fn drop(&mut self) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = keys.get_mut(self.key as usize) {
            k.busy = false;
        }
    }
}

/// How a request ends.
pub(crate) type Completion = Result<Done, WorkerError>;

/// A request for all chunks of one key.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) key: u32,
    pub(crate) round: u32,
    pub(crate) kind: Kind,
    pub(crate) chunks: Vec<ChunkMsg>,
    /// The datagrams.
    pub(crate) tx: Tx,
    /// Where the result goes (the key's length).
    pub(crate) values: Sink,
    pub(crate) done: Sender<Completion>,
}

/// Messages to the I/O thread.
#[derive(Debug)]
pub(crate) enum Command {
    /// Start a request.
    Submit(Request),
    /// Fail everything with `Closed` and exit.
    Shutdown,
}

/// A fast hasher for the I/O thread's integer keys (request ids, (key,
/// chunk) pairs): a multiply-rotate per word instead of SipHash, which took
/// about 5% of the thread's time. The maps only ever hold what this worker
/// sent, so hash flooding from the network cannot grow them.
#[derive(Default)]
pub(crate) struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// What the I/O thread needs to know about the job.
#[derive(Debug, Clone)]
pub(crate) struct JobInfo {
    pub(crate) job: u16,
    pub(crate) token: u64,
    pub(crate) rank: u16,
    pub(crate) dtype: Dtype,
}

/// Longest wait for a datagram while chunks are outstanding: the
/// retransmission timer's resolution.
const TICK: Duration = Duration::from_millis(1);
/// Longest wait while idle; a submit wakes the thread at once anyway.
const IDLE: Duration = Duration::from_millis(100);
/// A chunk still waiting when the result of one sent this many places
/// after it to the same lcore is in counts as lost (TCP's duplicate-ACK
/// threshold plays the same role).
const REORDER: u64 = 3;
/// How often the mapped shared-memory files are checked against their
/// names while requests are in flight (two `stat`s per lcore; a restarted
/// dataplane takes far longer than this to install the job again).
const SHM_CHECK: Duration = Duration::from_millis(5);
/// How often opening the regions is tried again while they cannot be.
const SHM_REOPEN: Duration = Duration::from_millis(100);

/// The mapping in use, shared with the API side, which stages chunks into
/// it; `None` while the regions cannot be opened.
pub(crate) type CurrentRegions = Arc<Mutex<Option<Arc<Regions>>>>;

/// Shared memory as the I/O thread uses it.
#[derive(Debug)]
pub(crate) struct Shm {
    /// How to open the regions again.
    spec: RegionSpec,
    /// The mapped regions; `None` while they cannot be opened (chunks go
    /// as datagrams meanwhile).
    regions: Option<Arc<Regions>>,
    /// `regions`, as the API side sees it (updated with it).
    current: CurrentRegions,
    /// When the mapped files were last checked, or opening them last tried.
    checked: Instant,
    /// Wire bytes of a 16-bit result on their way to being decoded.
    scratch: Vec<u8>,
}

impl Shm {
    /// Shared memory through `regions`, opened from `spec`; `current` is
    /// handed to the API side.
    pub(crate) fn new(spec: RegionSpec, regions: Regions) -> (Shm, CurrentRegions) {
        let regions = Arc::new(regions);
        let current = Arc::new(Mutex::new(Some(Arc::clone(&regions))));
        let shm = Shm {
            spec,
            regions: Some(regions),
            current: Arc::clone(&current),
            checked: Instant::now(),
            scratch: Vec::new(),
        };
        (shm, current)
    }

    /// Replaces the mapping in use, on both sides.
    fn set_regions(&mut self, regions: Option<Arc<Regions>>) {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = regions.clone();
        self.regions = regions;
    }
}

/// Round-trip state: the RFC 6298 estimator (reported as `srtt_us` and
/// `rto_us`) and the smallest round trip seen, which sets the loss timer.
///
/// Why not RFC 6298's RTO as the loss timer: with a window of thousands of
/// chunks a chunk's round trip includes its wait behind the rest of the
/// window, and with W > 1 the wait for the slowest rank (who may itself be
/// recovering a loss); samples swing from microseconds to a second, and the
/// RTO follows them up to `max_rto`, so a lost chunk at the end of a round
/// cost up to a second (measured: 10 rounds of 3 workers with 10% loss took
/// 6-11 s against 0.3 s with a window of 64). The loss timer is therefore
/// `max(min_rto, 2 x smallest round trip)` (the path's own round trip, not
/// the queue's), and it only runs while no result comes in at all: while
/// results stream in, late chunks are found by fast retransmission.
#[derive(Debug)]
struct Rto {
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    min_rtt: Option<Duration>,
    initial: Duration,
    min: Duration,
    max: Duration,
}

impl Rto {
    fn new(c: &WorkerConfig) -> Rto {
        Rto {
            srtt: None,
            rttvar: Duration::ZERO,
            rto: c.initial_rto.clamp(c.min_rto, c.max_rto),
            min_rtt: None,
            initial: c.initial_rto.clamp(c.min_rto, c.max_rto),
            min: c.min_rto,
            max: c.max_rto,
        }
    }

    fn sample(&mut self, r: Duration) {
        self.min_rtt = Some(self.min_rtt.map_or(r, |m| m.min(r)));
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(r);
                self.rttvar = self.rttvar * 3 / 4 + diff / 4;
                self.srtt = Some(s * 7 / 8 + r / 8);
            }
        }
        let s = self.srtt.unwrap_or(r);
        self.rto = (s + self.rttvar * 4).clamp(self.min, self.max);
    }

    /// The RFC 6298 timeout after `retries` doublings (reported, and the
    /// unit test's reference).
    #[cfg(test)]
    fn backoff(&self, retries: u32) -> Duration {
        self.rto
            .checked_mul(1u32 << retries.min(20))
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The loss timer after `doublings`: `max(min_rto, 2 x min RTT)`
    /// (the initial RTO before any sample), doubled, at most `max_rto`.
    fn loss(&self, doublings: u32) -> Duration {
        let base = self
            .min_rtt
            .map_or(self.initial, |m| (m * 2).clamp(self.min, self.max));
        base.checked_mul(1u32 << doublings.min(20))
            .unwrap_or(self.max)
            .min(self.max)
    }
}

#[derive(Debug)]
struct Active {
    key: u32,
    round: u32,
    kind: Kind,
    values: Sink,
    tx: Tx,
    chunks: usize,
    remaining: usize,
    min_round: u32,
    done: Sender<Completion>,
}

#[derive(Debug)]
struct Outstanding {
    id: u64,
    msg: ChunkMsg,
    /// Position in the sequence of datagrams sent to the chunk's lcore
    /// (its latest transmission's).
    seq: u64,
    first_sent: Instant,
    deadline: Instant,
    /// Times sent again (Karn's rule: no RTT sample once non-zero).
    retries: u32,
    /// Doublings of the RTO for this chunk; reset when results flow again.
    backoff: u32,
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
    info: JobInfo,
    window: usize,
    timeout: Duration,
    cmds: Receiver<Command>,
    keys: Keys,
    stats: Arc<Counters>,
    rto: Rto,
    next_id: u64,
    requests: IntMap<u64, Active>,
    pending: VecDeque<(u64, ChunkMsg)>,
    outstanding: IntMap<(u32, u32), Outstanding>,
    /// Last accepted result, or when work started after an idle spell.
    last_progress: Instant,
    last_scan: Instant,
    /// A result was accepted since the last retransmission scan.
    progressed: bool,
    /// The last batch of retransmissions.
    last_resend: Instant,
    /// Batches of retransmissions since the last accepted result.
    quiet_backoff: u32,
    /// Per lcore: the sequence number the next datagram to it gets.
    next_seq: Vec<u64>,
    /// Per lcore: the highest sequence number whose result was accepted.
    acked_seq: Vec<u64>,
    /// Per lcore: outstanding chunks in the order sent, (seq, (key, chunk));
    /// entries whose chunk is gone or was sent again are skipped lazily.
    sent_order: Vec<VecDeque<(u64, (u32, u32))>>,
    /// Chunks to send in the current batch: (request id, chunk).
    batch: Vec<(u64, ChunkMsg)>,
    /// The fault injector, when configured (tests and soaks).
    inject: Option<Injector>,
    /// Shared memory, when the join chose it.
    shm: Option<Shm>,
}

impl IoThread {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        socket: BatchSocket,
        own: SocketAddr,
        info: JobInfo,
        window: usize,
        config: &WorkerConfig,
        sleeping: Arc<AtomicBool>,
        cmds: Receiver<Command>,
        keys: Keys,
        stats: Arc<Counters>,
        inject: Option<Injector>,
        shm: Option<Shm>,
    ) -> IoThread {
        let rto = Rto::new(config);
        stats.shm.store(shm.is_some(), Ordering::Relaxed);
        stats
            .rto_us
            .store(rto.rto.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
        let now = Instant::now();
        IoThread {
            socket: Some(socket),
            sleeping,
            own,
            info,
            window: window.max(1),
            timeout: config.timeout,
            cmds,
            keys,
            stats,
            rto,
            next_id: 0,
            requests: IntMap::default(),
            pending: VecDeque::new(),
            outstanding: IntMap::default(),
            last_progress: now,
            last_scan: now,
            progressed: false,
            last_resend: now,
            quiet_backoff: 0,
            next_seq: Vec::new(),
            acked_seq: Vec::new(),
            sent_order: Vec::new(),
            batch: Vec::new(),
            inject,
            shm,
        }
    }

    fn busy(&self) -> bool {
        !self.requests.is_empty()
    }

    /// The thread's body; returns when the worker is dropped.
    pub(crate) fn run(mut self) {
        let mut socket = self.socket.take().expect("the I/O thread runs once");
        loop {
            loop {
                match self.cmds.try_recv() {
                    Ok(Command::Submit(r)) => self.submit(r),
                    Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => {
                        let ids: Vec<u64> = self.requests.keys().copied().collect();
                        for id in ids {
                            self.fail(id, WorkerError::Closed);
                        }
                        return;
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            let now = Instant::now();
            if self.busy() {
                // While nothing answers (the dataplane may be restarting),
                // every send is preceded by a check.
                self.check_shm(now, self.quiet_backoff > 0);
            }
            self.fill_window(&mut socket, now);
            if now.saturating_duration_since(self.last_scan) >= TICK {
                self.last_scan = now;
                self.retransmit(&mut socket, now);
            }
            if let Some(inj) = self.inject.as_mut() {
                let stats = &self.stats;
                inj.release(now, |d| send_counted(&mut socket, stats, d));
            }
            if self.busy() && now.saturating_duration_since(self.last_progress) >= self.timeout {
                self.time_out(now);
            }
            let holds = self.inject.as_ref().is_some_and(Injector::holds_sends);
            let mut wait = if self.busy() || holds { TICK } else { IDLE };
            // Delayed datagrams are released by the first turn after they
            // are due: do not sleep past the first.
            if let Some(due) = self.inject.as_ref().and_then(Injector::next_due) {
                wait = wait.min(due.saturating_duration_since(Instant::now()));
            }
            let own = self.own;
            let mut n = match self.receive(&mut socket) {
                Ok(n) => n,
                Err(e) => {
                    log::warn!("phub-worker: receiving on {own}: {e}");
                    std::thread::sleep(TICK);
                    continue;
                }
            };
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
                self.fast_retransmit(&mut socket, Instant::now());
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
                self.on_datagram(d, Instant::now());
            }
        })?;
        let held = self
            .inject
            .as_mut()
            .map_or_else(Vec::new, |inj| inj.released(Instant::now()));
        for h in &held {
            self.on_datagram(&h.bytes, Instant::now());
        }
        Ok(n + held.len())
    }

    fn submit(&mut self, r: Request) {
        if !self.busy() {
            // Idle time does not count towards the timeout.
            self.last_progress = Instant::now();
            self.quiet_backoff = 0;
        }
        let id = self.next_id;
        self.next_id += 1;
        let chunks = r.chunks.len();
        self.requests.insert(
            id,
            Active {
                key: r.key,
                round: r.round,
                kind: r.kind,
                values: r.values,
                tx: r.tx,
                chunks,
                remaining: chunks,
                min_round: u32::MAX,
                done: r.done,
            },
        );
        self.pending.extend(r.chunks.into_iter().map(|c| (id, c)));
        if chunks == 0 {
            self.complete(id);
        }
    }

    /// Sends the chunks in `self.batch` in one batch; a chunk the kernel
    /// did not take counts as lost (its retransmission timer covers it).
    fn send_batch(&mut self, socket: &mut BatchSocket) {
        if self.batch.is_empty() {
            return;
        }
        let requests = &self.requests;
        let dgrams: Vec<Datagram<'_>> = self
            .batch
            .iter()
            .filter_map(|(id, m)| {
                requests.get(id).map(|r| {
                    let (head, body) = r.tx.parts(m);
                    Datagram { to: m.to, head, body }
                })
            })
            .collect();
        match self.inject.as_mut() {
            None => send_counted(socket, &self.stats, &dgrams),
            Some(inj) => {
                let mut out = Vec::with_capacity(dgrams.len());
                inj.outgoing(&dgrams, &mut out, Instant::now());
                send_counted(socket, &self.stats, &out);
            }
        }
        self.batch.clear();
    }

    /// The next sequence number towards `lcore`, remembering that
    /// `(key, chunk)` was sent with it.
    fn sequence(&mut self, lcore: u16, k: (u32, u32)) -> u64 {
        let l = usize::from(lcore);
        if self.next_seq.len() <= l {
            self.next_seq.resize(l + 1, 0);
            self.acked_seq.resize(l + 1, 0);
            self.sent_order.resize_with(l + 1, VecDeque::new);
        }
        self.next_seq[l] += 1;
        let seq = self.next_seq[l];
        self.sent_order[l].push_back((seq, k));
        seq
    }

    /// With shared memory: checks that the mapped files are still the
    /// dataplane's regions, every [`SHM_CHECK`] while requests are in
    /// flight, and whenever `force`d: before sends while nothing answers,
    /// on an ERROR and on the first RESULT after such a silence (a
    /// dataplane that restarted answers from its new regions). A dataplane
    /// that restarted (or reinstalled the job) made new files, and a chunk
    /// left in the old staging region would never reach it: the regions are
    /// opened again and every outstanding chunk is written into the new
    /// staging region; while they cannot be opened, chunks go as datagrams
    /// (tried again every [`SHM_REOPEN`], or when forced).
    fn check_shm(&mut self, now: Instant, force: bool) {
        let Some(shm) = self.shm.as_mut() else {
            return;
        };
        let every = if shm.regions.is_some() {
            SHM_CHECK
        } else {
            SHM_REOPEN
        };
        if !force && now.saturating_duration_since(shm.checked) < every {
            return;
        }
        shm.checked = now;
        let (job, rank) = (self.info.job, self.info.rank);
        if let Some(r) = &shm.regions {
            let Some(why) = r.replaced() else {
                return;
            };
            log::warn!(
                "phub-worker: job {job} rank {rank}: the dataplane's shared-memory regions changed ({why}); \
                 opening them again, datagrams meanwhile"
            );
            shm.set_regions(None);
        }
        match shm.spec.open() {
            Ok(r) => {
                log::info!("phub-worker: job {job} rank {rank}: shared-memory regions mapped again");
                shm.set_regions(Some(Arc::new(r)));
            }
            Err(e) => log::debug!("phub-worker: job {job} rank {rank}: shared memory: {e}"),
        }
        let regions = shm.regions.as_ref();
        self.stats.shm.store(regions.is_some(), Ordering::Relaxed);
        for o in self.outstanding.values() {
            if let Some(req) = self.requests.get_mut(&o.id) {
                req.tx.stage(&o.msg, regions);
            }
        }
    }

    fn fill_window(&mut self, socket: &mut BatchSocket, now: Instant) {
        let deadline = now + self.rto.loss(0);
        while self.outstanding.len() < self.window {
            let Some((id, msg)) = self.pending.pop_front() else {
                break;
            };
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            let key = req.key;
            if let Some(shm) = &self.shm {
                // The key's previous round of this chunk has its result: the
                // lcore no longer reads the slot, and this rank may write it.
                req.tx.stage(&msg, shm.regions.as_ref());
            }
            self.batch.push((id, msg));
            add(&self.stats.chunks_sent, 1);
            let seq = self.sequence(msg.lcore, (key, msg.chunk));
            let o = Outstanding {
                id,
                first_sent: now,
                deadline,
                seq,
                retries: 0,
                backoff: 0,
                msg,
            };
            self.outstanding.insert((key, msg.chunk), o);
        }
        self.send_batch(socket);
    }

    /// Fast retransmission (TCP's, by sequence instead of duplicate ACKs):
    /// an lcore answers a worker's chunks in the order it sent them (its
    /// pushes arrive in order, and with W workers all send in the same
    /// order), so once the result of a chunk sent [`REORDER`] or more
    /// places later to the same lcore is in, an older chunk still waiting
    /// was lost, its push or its result (or, with W > 1, another rank's
    /// push for it, which that rank resends; ours is then a duplicate the
    /// appliance drops). It is resent at once, without waiting for a
    /// timeout, which with a deep window only fires after the stream of
    /// results has dried up.
    fn fast_retransmit(&mut self, socket: &mut BatchSocket, now: Instant) {
        let mut resent = 0;
        for l in 0..self.sent_order.len() {
            while let Some(&(seq, k)) = self.sent_order[l].front() {
                let live = self.outstanding.get(&k).is_some_and(|o| o.seq == seq);
                if !live {
                    self.sent_order[l].pop_front();
                    continue;
                }
                if seq + REORDER > self.acked_seq[l] {
                    break;
                }
                self.sent_order[l].pop_front();
                let new_seq = self.sequence(l as u16, k);
                let Some(o) = self.outstanding.get_mut(&k) else {
                    continue;
                };
                if o.retries == 0 {
                    if let Some(r) = self.requests.get_mut(&o.id) {
                        mark_retransmit(&mut r.tx.headers_mut()[o.msg.header_range()]);
                    }
                }
                o.retries += 1;
                o.seq = new_seq;
                o.deadline = now + self.rto.loss(o.backoff);
                self.batch.push((o.id, o.msg));
                resent += 1;
            }
        }
        if resent > 0 {
            add(&self.stats.retransmits, resent);
            add(&self.stats.fast_retransmits, resent);
            self.send_batch(socket);
        }
    }

    fn retransmit(&mut self, socket: &mut BatchSocket, now: Instant) {
        // A chunk is late only once its own timer has expired *and* no result
        // at all has come back for a base RTO (RFC 6298 5.3: the timer
        // restarts when new data is acknowledged). With a window of
        // thousands of chunks sent in bursts, a chunk's round trip includes
        // its wait behind the rest of the window in the appliance's queue,
        // and per-chunk timers alone fire spuriously by the thousand while
        // results are still streaming in (measured: 11281 retransmissions in
        // 12 rounds of ResNet-50, W = 1, window 2026). A chunk really lost
        // while others flow is resent once the flow stops: at worst one RTO
        // after the last result of its round.
        // While the silence goes on, the resends themselves back off (as
        // TCP's single timer does): one batch of the oldest late chunks per
        // RTO, then per 2 RTO, 4 RTO...
        let since = self.last_progress.max(self.last_resend);
        if now.saturating_duration_since(since) < self.rto.loss(self.quiet_backoff) {
            return;
        }
        // Results came back since the last scan: the appliance answers and the
        // other ranks push, so chunks backed off while they waited are given
        // the base timeout again (as TCP's backoff ends with a new ACK).
        // Without this a result lost after a long wait for a slow rank would
        // cost up to `max_rto`, and slow ranks would slow each other down.
        let reset = self.progressed;
        self.progressed = false;
        let mut late: Vec<(Instant, (u32, u32))> = Vec::new();
        for (k, o) in self.outstanding.iter_mut() {
            if reset && o.backoff > 0 {
                o.backoff = 0;
                o.deadline = o.deadline.min(now + self.rto.loss(0));
            }
            if now >= o.deadline {
                late.push((o.first_sent, *k));
            }
        }
        // As TCP's tail loss probe resends only its last segment, resend only
        // the oldest late chunk on the first silence, two on the next, four...
        // When the silence is a slow rank (or a descheduled lcore) rather
        // than loss, the probes are few duplicates the appliance drops; when
        // it is loss, each probe's result resets the count, and the chunks
        // still missing behind it follow one silence each.
        let cap = (1usize << self.quiet_backoff.min(16)).min((self.window / 16).max(16));
        if late.len() > cap {
            late.sort_unstable_by_key(|l| l.0);
            late.truncate(cap);
        }
        for (_, k) in &late {
            let Some(lcore) = self.outstanding.get(k).map(|o| o.msg.lcore) else {
                continue;
            };
            let new_seq = self.sequence(lcore, *k);
            let Some(o) = self.outstanding.get_mut(k) else {
                continue;
            };
            o.seq = new_seq;
            if o.retries == 0 {
                if let Some(r) = self.requests.get_mut(&o.id) {
                    mark_retransmit(&mut r.tx.headers_mut()[o.msg.header_range()]);
                }
            }
            o.retries += 1;
            o.backoff += 1;
            o.deadline = now + self.rto.loss(o.backoff);
            self.batch.push((o.id, o.msg));
        }
        if !late.is_empty() {
            self.last_resend = now;
            self.quiet_backoff += 1;
            self.check_shm(now, true);
        }
        add(&self.stats.retransmits, late.len() as u64);
        self.send_batch(socket);
    }

    fn on_datagram(&mut self, d: &[u8], now: Instant) {
        let Ok((repr, payload)) = wire::parse(d) else {
            add(&self.stats.foreign_dropped, 1);
            return;
        };
        let info = &self.info;
        let ours = repr.job == info.job && repr.token == info.token && repr.dtype == info.dtype;
        let valid = match repr.kind {
            MsgType::Result => ours && repr.rank == APPLIANCE_RANK,
            MsgType::Error => ours && repr.rank == info.rank,
            _ => false,
        };
        if !valid {
            add(&self.stats.foreign_dropped, 1);
            return;
        }
        if repr.kind == MsgType::Error || (repr.shm() && self.quiet_backoff > 0) {
            // Possibly the first word of a restarted dataplane: read its
            // regions, not the old ones (and let a pull after this ERROR
            // find them mapped).
            self.check_shm(now, true);
        }
        if repr.shm() && self.shm.as_ref().is_none_or(|s| s.regions.is_none()) {
            // A result in shared memory this worker has not mapped is malformed.
            add(&self.stats.foreign_dropped, 1);
            return;
        }
        let Some(o) = self.outstanding.get(&(repr.key, repr.chunk)) else {
            add(&self.stats.results_ignored, 1);
            return;
        };
        let Some(req) = self.requests.get_mut(&o.id) else {
            add(&self.stats.results_ignored, 1);
            return;
        };
        if repr.slot != o.msg.slot {
            add(&self.stats.results_ignored, 1);
            return;
        }
        let id = o.id;
        if repr.kind == MsgType::Error {
            // An ERROR echoes the refused message's round: one for an
            // earlier request of this key is stale.
            let sent_round = if req.kind == Kind::Pull {
                repr.round
            } else {
                req.round
            };
            // A PULL is never refused for its round (the appliance answers
            // any round with its latest result), so such an ERROR echoes an
            // earlier PUSH of this key still in flight: a worker pulling to
            // catch up after the appliance restarted sees those.
            let about_round = matches!(
                DropReason::from_code(repr.error),
                Some(DropReason::Ahead | DropReason::WrongTypeForRound | DropReason::Stale)
            );
            if repr.round != sent_round || (req.kind == Kind::Pull && about_round) {
                add(&self.stats.results_ignored, 1);
                return;
            }
            add(&self.stats.errors, 1);
            let (reason, hint) = describe(repr.error);
            let err = WorkerError::Refused {
                key: repr.key,
                chunk: repr.chunk,
                round: repr.round,
                reason,
                hint: hint.to_string(),
            };
            self.fail(id, err);
            return;
        }
        if u32::from(repr.count) != o.msg.len || (req.kind != Kind::Pull && repr.round != req.round) {
            add(&self.stats.results_ignored, 1);
            return;
        }
        let start = o.msg.offset;
        let end = start + o.msg.len as usize;
        let shm = self.shm.as_mut().filter(|_| repr.shm());
        let left_in_region = match (&mut req.values, &shm) {
            (
                Sink::Direct {
                    regions, in_region, ..
                },
                Some(shm),
            ) if shm.regions.as_ref().is_some_and(|r| Arc::ptr_eq(r, regions))
                && regions.holds_result(o.msg.lcore, o.msg.slot, o.msg.len as usize) =>
            {
                // The waiter reads it from there (see `DirectDone`).
                in_region
                    .get_mut(o.msg.chunk as usize)
                    .map(|c| *c = true)
                    .is_some()
            }
            _ => false,
        };
        let dst = req.values.slice_mut(start, end);
        match shm {
            _ if left_in_region => add(&self.stats.shm_results, 1),
            None => codec::decode(self.info.dtype, payload, dst),
            Some(shm) => {
                // The regions are mapped (checked above). The lcore wrote
                // this round's result before sending its RESULT, and writes
                // the slot again only after this rank pushed the next round
                // of the chunk.
                let read = shm
                    .regions
                    .as_ref()
                    .is_some_and(|r| r.read_result(o.msg.lcore, o.msg.slot, dst, &mut shm.scratch));
                if !read {
                    add(&self.stats.foreign_dropped, 1);
                    return;
                }
                add(&self.stats.shm_results, 1);
            }
        }
        req.remaining -= 1;
        req.min_round = req.min_round.min(repr.round);
        let done = req.remaining == 0;
        if o.retries == 0 {
            self.rto.sample(now.saturating_duration_since(o.first_sent));
            let srtt = self.rto.srtt.unwrap_or_default().as_micros() as u64;
            self.stats
                .srtt_us
                .store(srtt, std::sync::atomic::Ordering::Relaxed);
            self.stats.rto_us.store(
                self.rto.rto.as_micros() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        // Only first transmissions say how far the lcore has got: a resent
        // chunk's result may overtake chunks that are merely waiting for a
        // slow rank (with W > 1), which must not count as lost.
        if o.retries == 0 {
            let l = usize::from(o.msg.lcore);
            if let Some(a) = self.acked_seq.get_mut(l) {
                *a = (*a).max(o.seq);
            }
        }
        self.outstanding.remove(&(repr.key, repr.chunk));
        add(&self.stats.results_accepted, 1);
        self.last_progress = now;
        self.progressed = true;
        self.quiet_backoff = 0;
        if done {
            self.complete(id);
        }
    }

    /// Sets `key`'s new round, if any, frees it if `free`, and keeps the
    /// request's datagram buffer for the key's next request.
    fn set_key(&self, key: u32, round: Option<u32>, free: bool, tx: Vec<u8>) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = keys.get_mut(key as usize) {
            if round.is_some() {
                k.round = round;
            }
            if free {
                k.busy = false;
            }
            k.tx_spare = tx;
        }
    }

    fn complete(&mut self, id: u64) {
        let Some(req) = self.requests.remove(&id) else {
            return;
        };
        let round = match req.kind {
            Kind::Init => 0,
            Kind::Push => req.round,
            Kind::Pull => {
                if req.chunks == 0 {
                    0
                } else {
                    req.min_round
                }
            }
        };
        let direct = matches!(req.values, Sink::Direct { .. });
        // A direct request's results may still be in the result regions:
        // the key stays claimed until the waiter copied them out.
        self.set_key(req.key, Some(round), !direct, req.tx.into_spare());
        let (values, direct) = match req.values {
            Sink::Owned(v) => (v, None),
            Sink::Borrowed(_) => (Vec::new(), None),
            Sink::Direct {
                values,
                regions,
                in_region,
            } => (
                values,
                Some(DirectDone {
                    regions,
                    in_region,
                    _claim: KeyClaim {
                        keys: Arc::clone(&self.keys),
                        key: req.key,
                    },
                }),
            ),
        };
        // The caller may have dropped its handle; the key is free either way
        // (a direct request's claim is dropped with the unread completion).
        let _ = req.done.send(Ok(Done {
            key: req.key,
            values,
            round,
            direct,
        }));
    }

    fn fail(&mut self, id: u64, err: WorkerError) {
        let Some(req) = self.requests.remove(&id) else {
            return;
        };
        self.outstanding.retain(|_, o| o.id != id);
        self.pending.retain(|(i, _)| *i != id);
        self.set_key(req.key, None, true, req.tx.into_spare());
        let _ = req.done.send(Err(err));
    }

    fn time_out(&mut self, now: Instant) {
        let waited = now.saturating_duration_since(self.last_progress);
        let ids: Vec<u64> = self.requests.keys().copied().collect();
        for id in ids {
            let mut addrs: Vec<SocketAddr> = self
                .outstanding
                .values()
                .filter(|o| o.id == id)
                .map(|o| o.msg.to)
                .chain(self.pending.iter().filter(|(i, _)| *i == id).map(|(_, m)| m.to))
                .collect();
            addrs.sort();
            addrs.dedup();
            let req = &self.requests[&id];
            let err = WorkerError::Timeout {
                key: req.key,
                round: req.round,
                addrs,
                waited,
                missing: req.remaining,
                chunks: req.chunks,
            };
            log::warn!("phub-worker: {err}");
            add(&self.stats.timeouts, 1);
            self.fail(id, err);
        }
    }
}

/// Sets the RETRANSMIT flag of a header we emitted, keeping its others
/// (SHM).
fn mark_retransmit(header: &mut [u8]) {
    let mut h = Header::new_unchecked(header);
    let f = h.flags();
    h.set_flags(f | flags::RETRANSMIT);
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

/// The name of an ERROR's drop reason, and a hint on its likely cause.
fn describe(code: u16) -> (String, &'static str) {
    match DropReason::from_code(code) {
        Some(r) => {
            let hint = match r {
                DropReason::SlotOutOfRange | DropReason::ChunkMismatch | DropReason::CountMismatch => {
                    " (this worker's layout does not match the appliance's: rejoin the job)"
                }
                DropReason::DtypeMismatch => " (this worker's dtype differs from the job's)",
                DropReason::Ahead => {
                    " (the appliance is behind this worker: it may have restarted and lost the job's state)"
                }
                DropReason::WrongTypeForRound => " (INIT is for round 0 only, PUSH for rounds >= 1)",
                _ => "",
            };
            (r.name().to_string(), hint)
        }
        None => (format!("unknown error code {code}"), ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rto_follows_rfc6298_and_backs_off() {
        let c = WorkerConfig::default();
        let mut r = Rto::new(&c);
        assert_eq!(r.rto, c.initial_rto);
        r.sample(Duration::from_millis(10));
        assert_eq!(r.srtt, Some(Duration::from_millis(10)));
        assert_eq!(r.rto, Duration::from_millis(30));
        r.sample(Duration::from_millis(10));
        // rttvar = 3/4 * 5 = 3.75 ms; rto = 10 + 15 = 25 ms.
        assert_eq!(r.rto, Duration::from_micros(25_000));
        assert_eq!(r.backoff(1), Duration::from_millis(50));
        assert_eq!(r.backoff(40), c.max_rto);
        for _ in 0..50 {
            r.sample(Duration::from_micros(10));
        }
        assert_eq!(r.rto, c.min_rto);
    }

    #[test]
    fn loss_timer_follows_the_smallest_round_trip() {
        let c = WorkerConfig::default();
        let mut r = Rto::new(&c);
        assert_eq!(r.loss(0), c.initial_rto);
        // Queueing behind a deep window inflates samples, not the loss timer.
        r.sample(Duration::from_millis(3));
        r.sample(Duration::from_millis(400));
        assert_eq!(r.loss(0), Duration::from_millis(6));
        assert_eq!(r.loss(2), Duration::from_millis(24));
        assert_eq!(r.loss(30), c.max_rto);
        r.sample(Duration::from_micros(50));
        assert_eq!(r.loss(0), c.min_rto);
        assert!(r.rto > Duration::from_millis(100));
    }

    #[test]
    fn error_codes_are_named() {
        assert_eq!(describe(15).0, "count_mismatch");
        assert!(describe(19).1.contains("restarted"));
        assert_eq!(describe(999).0, "unknown error code 999");
    }
}
