//! The worker's transport, without I/O: windowed sending, retransmission,
//! sequence tracking and result matching (PROTOCOL.md §6).
//!
//! Layer: protocol state machine, in quinn-proto's shape. It holds no
//! socket, no thread and no clock: the caller passes the time, hands in
//! requests ([`Transport::submit`]) and datagrams
//! ([`Transport::handle_datagram`]), and polls what to send
//! ([`Transport::poll_transmit`]), when to call again
//! ([`Transport::poll_timeout`], [`Transport::handle_timeout`]) and which
//! requests ended ([`Transport::poll_done`]). The I/O thread
//! ([`crate::io`]) drives it with a socket; the unit tests drive it with a
//! clock they advance.
//!
//! Invariants:
//! - Pending chunks wait in lanes, one per lcore (one in a hierarchical
//!   job), each request's chunks in its lcores' lanes; in a lane, requests
//!   by round (lowest first), then first come, first sent, in an order
//!   that does not depend on when requests arrived, so that every rank
//!   sends each lcore the same sequence ([`Pending`]). Each lane has a
//!   window of its own, `cwnd` shared over the lanes with chunks waiting
//!   or out (at least one each), so that all of a job's lcores, and the
//!   appliances of a job sharded over several, work at once and no lane
//!   waits on another; at most `cwnd` chunks are outstanding (sent, no
//!   result yet) in all, but for a lane with none out, which may always
//!   send one (a window that shrank lets nothing new out until results
//!   bring the count under it, but there); a chunk is outstanding once
//!   (one request per key). `cwnd`
//!   (the congestion window) starts at `window`, the most the appliance's
//!   receive buffers take. With [`WorkerConfig::congestion`] (off by
//!   default), a loss found by fast retransmission (later results overtook
//!   a chunk; a silence is not taken for loss) halves it once per episode
//!   (a smoothed round trip, and until the chunks outstanding at the cut
//!   have come back), never below [`congestion::MIN_CWND`]; every ⌈cwnd/16⌉
//!   results of chunks sent once then grow it by one, up to `window` again;
//!   `1 <= cwnd <= window` (`congestion.rs`, `window.rs`).
//! - A late chunk is sent again unchanged but for the RETRANSMIT flag: at
//!   once when the result of a chunk sent [`REORDER`] or more places after
//!   it to the same lcore is in (fast retransmission; in a hierarchical
//!   job, whose lcores answer out of order, once it has also been out for
//!   an RTO), otherwise when its
//!   loss timer has expired and no result at all has come in for the loss
//!   timeout ([`Rto::loss`]), a few chunks per silence, the silences
//!   doubling.
//! - Only a RESULT for this job (id, token, dtype, from the appliance), for
//!   a chunk outstanding at that slot, with its element count and round (or
//!   a later one: a rank repeating rounds after a pull), is accepted, once;
//!   anything else is counted (`results_ignored`, `foreign_dropped`), never
//!   an error.
//! - Every request ends: with its result, with the appliance's refusal,
//!   with [`WorkerError::Timeout`] once no result has come in for
//!   `timeout`, or with [`WorkerError::Closed`] ([`Transport::close`]); it
//!   completes once every chunk's result is in, each counted once.
//!
//! - A replicated job's chunk goes where its epoch serves it
//!   ([`Routing`], `route.rs`), with the epoch in its header. An ERROR
//!   `wrong_epoch` is never a failure: one naming a newer epoch asks the
//!   caller for it ([`Transport::poll_epoch`]), one naming an older epoch
//!   is ignored (the loss timer resends); a chunk retransmitted
//!   [`SILENT_SENDS`] times asks too. A newer epoch given
//!   ([`Transport::set_epoch`]) re-addresses and resends every
//!   outstanding chunk at once; a RESULT at a slot the chunk was sent to
//!   in an earlier epoch still answers it, unless the job went back to its
//!   checkpoints since ([`EpochView::restored`]): a RESULT or ERROR sent
//!   before that epoch is ignored.
//!
//! The invariants are `debug_assert!`ed where they must hold (never on what
//! comes from the network, which is counted instead).
//!
//! State, grouped by concern as quinn groups its path state: the flow
//! window ([`window::FlowWindow`], `window.rs`), the congestion window
//! ([`congestion::Congestion`], `congestion.rs`), loss detection
//! ([`LossDetection`]: round trips in `rto.rs`, the lanes of fast
//! retransmission, the loss timer), the request table ([`RequestTable`]:
//! requests, pending, outstanding and queued chunks, ended requests) and
//! shared memory ([`ShmState`]). What a request carries and how its
//! results are written is `request.rs`.
//!
//! Shared memory: the caller maps the dataplane's regions and checks them
//! (file system calls); the transport is told which mapping is in use
//! ([`Transport::set_regions`]), stages chunks into it and reads results
//! from it. It says when a check is due before a datagram is handled
//! ([`Transport::checks_regions_first`]) and after a silence
//! ([`Transport::silent`], [`Transport::handle_timeout`]'s answer).

mod congestion;
#[cfg(test)]
mod epoch_tests;
mod request;
mod route;
mod row_plan;
#[cfg(test)]
pub(crate) mod row_tests;
mod rows;
mod rto;
#[cfg(test)]
mod tests;
mod watch;
mod window;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::net::SocketAddr;
use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_proto::failover::EpochView;
use phub_proto::wire::{self, flags, DropReason, Header, MsgType, Repr, APPLIANCE_RANK};
use phub_proto::Dtype;

use congestion::Congestion;
#[cfg(test)]
use congestion::MIN_CWND;
pub(crate) use request::{Arrived, ChunkMsg, Kind, RawBytes, RawDst, Request, Sink, Tx};
pub(crate) use route::Routing;
pub(crate) use row_plan::{id_lists, plan_pull, plan_push, RowPlan, TableInfo};
#[cfg(feature = "sim")]
pub(crate) use rows::unknown_table;
pub(crate) use rows::{RowFinished, RowOutput, RowRequest, RowTransport};
use rto::Rto;
use watch::{Verdict, Watch};
pub(crate) use window::AutoWindow;
use window::FlowWindow;

use crate::config::WorkerConfig;
use crate::error::WorkerError;
use crate::net::Datagram;
use crate::shm::Regions;
use crate::stats::{add, Counters};

/// A chunk still waiting when the result of one sent this many places
/// after it to the same lcore is in counts as lost (TCP's duplicate-ACK
/// threshold plays the same role).
pub(crate) const REORDER: u64 = 3;
/// The loss timer's resolution: the outstanding chunks are scanned for
/// late ones at most this often.
pub(crate) const TICK: Duration = Duration::from_millis(1);
/// A replicated job's chunk retransmitted this many times without an answer makes
/// the worker ask control for the job's epoch (its serving appliance may
/// be dead, and a worker learns of a new epoch only from an appliance
/// that is alive). Three: the loss timer's first resends are probes of a
/// chunk that waits on a slow rank as often as of a lost one, and each
/// doubles the wait, so the third comes several RTOs into a silence (by
/// then loss alone is unlikely), while an appliance's death costs at most
/// those few RTOs before the question is asked.
pub(crate) const SILENT_SENDS: u32 = 3;
/// A silence asks control for the epoch at most this often.
pub(crate) const EPOCH_ASK_GAP: Duration = Duration::from_millis(100);
/// Batches of resends in one silence after which a flat, unreplicated
/// job's rank asks the lcores it has nothing out on where they stand
/// ([`watch`]): by then the silence is several RTOs long.
const PROBE_AFTER: u32 = 2;

/// What the transport needs to know about the job.
#[derive(Debug, Clone)]
pub(crate) struct JobInfo {
    pub(crate) job: u16,
    pub(crate) token: u64,
    pub(crate) rank: u16,
    pub(crate) dtype: Dtype,
    /// An lcore answers this rank's chunks in the order they were sent,
    /// so a result overtaking a chunk means the chunk was lost (fast
    /// retransmission). Not so for a hierarchical job: a rack slot answers
    /// when its chunk's home answers it, and the chunks' homes are on
    /// different appliances, some across the spine; there an overtaken
    /// chunk is lost only once it has also been out for an RTO.
    pub(crate) in_order: bool,
}

/// A fast hasher for the transport's integer keys (request ids, (key,
/// chunk) pairs): a multiply-rotate per word instead of SipHash, which took
/// about 5% of the I/O thread's time. The maps only ever hold what this
/// worker sent, so hash flooding from the network cannot grow them.
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

/// A request that ended, for [`Transport::poll_done`].
#[derive(Debug)]
pub(crate) struct Finished<D> {
    /// The request's key.
    pub(crate) key: u32,
    /// The request's `done`.
    pub(crate) done: D,
    /// The request's datagram buffer, for the key's next request.
    pub(crate) tx: Vec<u8>,
    /// The result, or why there is none.
    pub(crate) result: Result<Output, WorkerError>,
}

/// A completed request's result.
#[derive(Debug)]
pub(crate) struct Output {
    /// The round the values are the result of (for a pull, the lowest over
    /// chunks; 0 for a pull of no chunks). A push's chunks may stand at a
    /// later round ([`Active::answered_by`]).
    pub(crate) round: u32,
    /// The values, as the request's sink holds them.
    pub(crate) sink: Sink,
}

/// A received datagram that is this job's, for [`Transport::handle`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Incoming<'d> {
    repr: Repr,
    payload: &'d [u8],
    /// The receive-buffer share the datagram states (0: none).
    rx_share: u32,
    /// The epoch its header carries.
    epoch: u32,
    /// Where it came from, where the caller knows.
    from: Option<SocketAddr>,
}

/// The answer stream chunk `msg` is sequenced in for fast retransmission
/// ([`Transport::fast_retransmit`]): the chunks an lcore answers in the
/// order they were sent. Its lcore's; for a replicated job (`routing`),
/// an lcore's own slots and the slots of parts it adopted (PROTOCOL.md
/// §11.6) are two streams: each is answered when its own backups
/// acknowledge a round, so one overtakes the other.
fn stream_of(routing: Option<&Routing>, msg: &ChunkMsg) -> usize {
    let l = usize::from(msg.lcore);
    match routing {
        Some(r) => 2 * l + usize::from(r.adopted_slot(msg.lcore, msg.slot)),
        None => l,
    }
}

/// A chunk of a key: what names an outstanding chunk (a RESULT carries
/// both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ChunkId {
    key: u32,
    chunk: u32,
}

impl ChunkId {
    /// The chunk a datagram names.
    fn of(repr: &Repr) -> ChunkId {
        ChunkId {
            key: repr.key,
            chunk: repr.chunk,
        }
    }
}

/// A request in flight.
#[derive(Debug)]
struct Active<D> {
    key: u32,
    round: u32,
    kind: Kind,
    sink: Sink,
    tx: Tx,
    chunks: usize,
    remaining: usize,
    min_round: u32,
    done: D,
}

impl<D> Active<D> {
    /// Whether a RESULT with `repr` answers this request's chunk of `len`
    /// elements: its count, and its round unless this is a pull (any round
    /// answers a pull). A later round answers an INIT or PUSH too
    /// (PROTOCOL.md §6.2): the chunk completed rounds past it with this
    /// rank's contributions, which a rank repeating rounds after a pull
    /// made before it.
    fn answered_by(&self, repr: &Repr, len: u32) -> bool {
        u32::from(repr.count) == len && (self.kind == Kind::Pull || repr.round >= self.round)
    }

    /// Whether an ERROR with `repr` refuses this request (not an earlier
    /// one of the same key).
    fn refused_by(&self, repr: &Repr) -> bool {
        // An ERROR echoes the refused message's round: one for an earlier
        // request of this key is stale.
        let sent_round = if self.kind == Kind::Pull {
            repr.round
        } else {
            self.round
        };
        // A PULL is never refused for its round (the appliance answers any
        // round with its latest result), so such an ERROR echoes an earlier
        // PUSH of this key still in flight: a worker pulling to catch up
        // after the appliance restarted sees those.
        let about_round = matches!(
            DropReason::from_code(repr.error),
            Some(DropReason::Ahead | DropReason::WrongTypeForRound | DropReason::Stale)
        );
        // `nothing_to_pull` refuses only a PULL: one that reaches an INIT
        // or PUSH of the key is a late copy for a PULL before it (a rank
        // told `nothing_to_pull` sends its INIT, whose round 0 a PULL's
        // echo can carry).
        let pull_only = DropReason::from_code(repr.error) == Some(DropReason::NothingToPull);
        repr.round == sent_round
            && !(self.kind == Kind::Pull && about_round)
            && !(self.kind != Kind::Pull && pull_only)
    }

    /// The round the request's result stands at once complete.
    fn result_round(&self) -> u32 {
        match self.kind {
            Kind::Init => 0,
            Kind::Push => self.round,
            Kind::Pull if self.chunks == 0 => 0,
            Kind::Pull => self.min_round,
        }
    }
}

/// A chunk sent and waiting for its result.
#[derive(Debug)]
struct Outstanding {
    id: u64,
    /// Its lane in [`Pending`].
    lane: u16,
    msg: ChunkMsg,
    /// Position in the sequence of datagrams sent to the chunk's lcore
    /// (its latest transmission's).
    seq: u64,
    first_sent: Instant,
    /// When its latest transmission went out.
    sent: Instant,
    deadline: Instant,
    /// Times sent again (Karn's rule: no RTT sample once non-zero).
    retries: u32,
    /// Doublings of the loss timer for this chunk; reset when results flow
    /// again.
    backoff: u32,
    /// Slots the chunk was sent to before it was re-addressed in a new
    /// epoch (empty, unallocated, in any other case): a RESULT from its
    /// old place for the round it waits for answers it too (PROTOCOL.md
    /// §11.4 (a)).
    earlier: Vec<u32>,
}

/// The datagrams sent to one lcore, in order.
#[derive(Debug, Default)]
struct Lane {
    /// The sequence number the next datagram gets.
    next_seq: u64,
    /// The highest sequence number whose result was accepted (first
    /// transmissions only).
    acked_seq: u64,
    /// Outstanding chunks in the order sent; entries whose chunk is gone
    /// or was sent again are skipped lazily.
    sent: VecDeque<LaneEntry>,
}

/// A transmission to an lcore: its sequence number and its chunk.
#[derive(Debug, Clone, Copy)]
struct LaneEntry {
    seq: u64,
    id: ChunkId,
}

/// A late chunk found by the loss timer's scan.
#[derive(Debug, Clone, Copy)]
struct Late {
    /// When it was last sent: probes go oldest first (then by `first_sent`).
    sent: Instant,
    first_sent: Instant,
    id: ChunkId,
}

/// Shared memory as the transport sees it.
#[derive(Debug)]
struct ShmState {
    /// The mapping in use; `None` while the regions cannot be opened
    /// (chunks go as datagrams meanwhile).
    regions: Option<Arc<Regions>>,
    /// Wire bytes of a 16-bit result on their way to being decoded.
    scratch: Vec<u8>,
}

/// The requests in flight and their chunks: pending (not sent yet),
/// outstanding (sent, no result yet), queued for the next transmit, and
/// the requests that ended.
#[derive(Debug)]
struct RequestTable<D> {
    next_id: u64,
    requests: IntMap<u64, Active<D>>,
    /// Chunks not sent yet, in the order they go out: (request id, chunk).
    pending: Pending,
    /// Chunks sent and waiting.
    outstanding: IntMap<ChunkId, Outstanding>,
    /// Chunks to transmit at the next [`Transport::poll_transmit`], in the
    /// order their sequence numbers were given.
    queue: Vec<(u64, ChunkMsg)>,
    finished: VecDeque<Finished<D>>,
}

/// Loss detection: the round-trip estimator, what each lcore has
/// answered (fast retransmission) and the loss timer's state.
#[derive(Debug)]
struct LossDetection {
    rto: Rto,
    /// Per lcore.
    lanes: Vec<Lane>,
    /// A result raised a lane's `acked_seq` since the last fast
    /// retransmission scan.
    acked: bool,
    /// Late chunks found by the last scan (kept for its allocation).
    late: Vec<Late>,
    /// Last accepted result, or when work started after an idle spell.
    last_progress: Instant,
    last_scan: Instant,
    /// A result was accepted since the last retransmission scan.
    progressed: bool,
    /// The last batch of retransmissions.
    last_resend: Instant,
    /// Batches of retransmissions since the last accepted result.
    quiet_backoff: u32,
}

/// Whether a retransmission doubles the chunk's loss timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backoff {
    /// The timer restarts as it was (fast retransmission: results flow).
    Keep,
    /// The timer doubles (the loss timer fired: nothing comes back).
    Double,
}

/// The transport's state; `D` is what a request's caller gets back when
/// it ends ([`Request::done`]).
#[derive(Debug)]
pub(crate) struct Transport<D> {
    info: JobInfo,
    /// Requests fail once no result has come in for this long.
    timeout: Duration,
    stats: Arc<Counters>,
    /// How many chunks the appliance takes at once.
    flow: FlowWindow,
    /// How many of those are let out now.
    congestion: Congestion,
    /// Round trips, loss timers and fast retransmission.
    loss: LossDetection,
    /// Requests, and their chunks pending, outstanding and ended.
    table: RequestTable<D>,
    /// Shared memory, when the join chose it.
    shm: Option<ShmState>,
    /// A replicated job's routing by epoch ([`route`]); `None` for any
    /// other job.
    routing: Option<Routing>,
    /// The epoch control is to be asked for, at least, by the caller
    /// ([`Transport::poll_epoch`]): an ERROR `wrong_epoch` named a newer
    /// one, or chunks went unanswered [`SILENT_SENDS`] times.
    epoch_wanted: Option<u32>,
    /// When a silence last asked for the epoch.
    epoch_asked: Option<Instant>,
    /// The last chunk answered on each lcore, asked for once a silence
    /// goes on ([`watch`]; flat, unreplicated jobs).
    watch: Watch,
    /// A silence went on long enough for the lcores to be probed since
    /// the caller last asked ([`Transport::take_stall`]).
    stalled: bool,
    /// Lcores that refused this rank `ahead` (or that a probe found
    /// behind) and have not answered an INIT or PUSH of it since: its
    /// PULLs to them carry RESYNC, which lifts §5.4 rule 0 there.
    resync: Vec<SocketAddr>,
}

/// A key's chunk `i`'s place in the order a hierarchical job's ranks send
/// it: the bits of `i` reversed (chunks 0, 2^31, 2^30, 3 x 2^30, ...
/// compared as numbers), which visits any contiguous run of a key's chunks
/// (an lcore's share of it, on any rack's layout) early and evenly, and
/// depends on `i` alone.
fn spread_order(i: u32) -> u32 {
    i.reverse_bits()
}

/// Chunks not sent yet, in lanes, one per lcore (one for all in a
/// hierarchical job): in each lane requests by round, lowest first, then
/// first come, first sent, each request's chunks of that lcore in their
/// order, or in a hierarchical job by [`spread_order`]. Each lane has a
/// window of its own: at most `cap` of its chunks out, and all lanes
/// together at most the transport's window, except that a lane with none
/// out may always send one.
///
/// A lane's order is a function of the requests and their order alone,
/// never of when they reached this thread: every rank submits the same
/// requests in the same order, so every rank sends each lcore the same
/// sequence, and the chunks one rank has sent an lcore are a prefix of
/// what another has sent it or the other way round. A round's chunk
/// completes only once every rank has sent it, so in each lane the rank
/// furthest behind has nothing out there that the others have not sent
/// too, may send there (a lane with none out always may), and the job
/// moves on. Lanes never wait on each other. (One queue for all lcores,
/// as this was before, sent the chunk sequence in its order: a layout
/// gives each lcore one run of it, so all ranks' windows went to one
/// lcore at a time and the job ran at one lcore's speed whatever L: 2.5
/// GB/s at L = 1 to 8 on 16 cores, BENCHMARKS.md. A queue per lcore taken
/// in turn under one shared window, as it was before that, made what each
/// rank sent depend on which requests had arrived when the window had
/// room: two ranks could fill their windows with chunks of different
/// lcores that the other had not sent, and wait for each other forever: a
/// 2-lcore ResNet-50 job hung in its first round.)
///
/// A rank that rejoined, or pulled after `ahead`, can hold its keys at
/// different rounds, and submits them in key order; the others wait for
/// its chunks of the lowest round, so those go first (the simulator's
/// finding, seed 133: with a window smaller than a round, a rejoined rank
/// filled it with chunks of a round the others could not reach before it
/// sent the ones they waited for).
///
/// A hierarchical job's ranks send to their own rack's appliance, whose
/// layout differs from rack to rack, so lanes by lcore differ too, and
/// racks whose windows hold different chunks wait on each other's partial
/// sums for ever (the simulator's finding, seed 450): its chunks go in one
/// lane, in an order every rack shares.
#[derive(Debug, Default)]
struct Pending {
    /// Per lane, its chunks not sent yet, in order.
    lanes: BTreeMap<u16, VecDeque<Queued>>,
    /// Per lane, its chunks sent and not answered (lanes with none absent).
    out: BTreeMap<u16, usize>,
    /// The lane the last chunk was taken from (lanes are served in turn,
    /// from the lowest).
    turn: Option<u16>,
}

/// A chunk of request `id`, of round `round`, waiting to go out.
#[derive(Debug)]
struct Queued {
    id: u64,
    round: u32,
    msg: ChunkMsg,
}

/// The lane of hierarchical jobs' chunks (they have one).
const ONE_LANE: u16 = 0;

impl Pending {
    /// Queues request `id`'s chunks, each in its lcore's lane when
    /// `by_lcore`, else in the one lane in [`spread_order`].
    fn push_request(&mut self, id: u64, round: u32, mut chunks: Vec<ChunkMsg>, by_lcore: bool) {
        if !by_lcore {
            chunks.sort_by_key(|c| spread_order(c.chunk));
            let lane = self.lanes.entry(ONE_LANE).or_default();
            Self::insert(
                lane,
                round,
                chunks.into_iter().map(|msg| Queued { id, round, msg }),
            );
            return;
        }
        let mut by: BTreeMap<u16, Vec<ChunkMsg>> = BTreeMap::new();
        for c in chunks {
            by.entry(c.lcore).or_default().push(c);
        }
        for (l, cs) in by {
            let lane = self.lanes.entry(l).or_default();
            Self::insert(lane, round, cs.into_iter().map(|msg| Queued { id, round, msg }));
        }
    }

    /// Puts `items` (of round `round`) after the last chunk of this round
    /// or a lower one in `lane` (at the end but after a rejoin or a pull).
    fn insert(lane: &mut VecDeque<Queued>, round: u32, items: impl Iterator<Item = Queued>) {
        let at = lane.iter().rposition(|q| q.round <= round).map_or(0, |p| p + 1);
        let later = lane.split_off(at);
        lane.extend(items);
        lane.extend(later);
    }

    /// Lanes with chunks waiting or out.
    fn active(&self) -> usize {
        // Without allocating: fill_window asks on every transmit.
        self.lanes.len() + self.out.keys().filter(|l| !self.lanes.contains_key(l)).count()
    }

    /// The next chunk, with its request's id and its lane, from the lanes
    /// in turn: one with fewer than `cap` out while fewer than `window`
    /// are out in all (`total`), or one with none out. The caller counts
    /// it out with [`Pending::sent`] once it went.
    fn pop(&mut self, cap: usize, window: usize, total: usize) -> Option<(u64, ChunkMsg, u16)> {
        let may = |l: &u16, out: &BTreeMap<u16, usize>| {
            let n = out.get(l).copied().unwrap_or(0);
            n == 0 || (n < cap && total < window)
        };
        let (after, upto) = match self.turn {
            Some(t) => (
                (Bound::Excluded(t), Bound::Unbounded),
                (Bound::Unbounded, Bound::Included(t)),
            ),
            None => (
                (Bound::Unbounded, Bound::Unbounded),
                (Bound::Unbounded, Bound::Excluded(0)),
            ),
        };
        let lane = self
            .lanes
            .range(after)
            .chain(self.lanes.range(upto))
            .find(|(l, q)| !q.is_empty() && may(l, &self.out))
            .map(|(l, _)| *l)?;
        self.turn = Some(lane);
        let q = self.lanes.get_mut(&lane)?;
        let item = q.pop_front()?;
        if q.is_empty() {
            self.lanes.remove(&lane);
        }
        Some((item.id, item.msg, lane))
    }

    /// A chunk of `lane` went out.
    fn sent(&mut self, lane: u16) {
        *self.out.entry(lane).or_default() += 1;
    }

    /// A chunk of `lane` is no longer out (answered, or its request ended).
    fn settled(&mut self, lane: u16) {
        if let Some(n) = self.out.get_mut(&lane) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.out.remove(&lane);
            }
        }
    }

    /// Drops request `id`'s chunks.
    fn remove(&mut self, id: u64) {
        for q in self.lanes.values_mut() {
            q.retain(|q| q.id != id);
        }
        self.lanes.retain(|_, q| !q.is_empty());
    }

    /// Request `id`'s chunks.
    fn of(&self, id: u64) -> impl Iterator<Item = &ChunkMsg> {
        self.lanes
            .values()
            .flatten()
            .filter(move |q| q.id == id)
            .map(|q| &q.msg)
    }
}

impl<D> Transport<D> {
    /// A transport for `info`'s job with `window` chunks in flight at most,
    /// the timeouts of `config`, counting into `stats`; with `regions`,
    /// through that shared-memory mapping. `now` starts its clock.
    pub(crate) fn new(
        info: JobInfo,
        window: usize,
        config: &WorkerConfig,
        stats: Arc<Counters>,
        regions: Option<Arc<Regions>>,
        now: Instant,
    ) -> Transport<D> {
        let rto = Rto::new(config);
        stats.rto_us.store(micros(rto.rto), Ordering::Relaxed);
        stats.cwnd.store(window.max(1) as u64, Ordering::Relaxed);
        stats.window.store(window.max(1) as u64, Ordering::Relaxed);
        let flow = FlowWindow::new(window);
        Transport {
            info,
            congestion: Congestion::new(flow.window, config.congestion),
            flow,
            timeout: config.timeout,
            stats,
            loss: LossDetection {
                rto,
                lanes: Vec::new(),
                acked: false,
                late: Vec::new(),
                last_progress: now,
                last_scan: now,
                progressed: false,
                last_resend: now,
                quiet_backoff: 0,
            },
            table: RequestTable {
                next_id: 0,
                requests: IntMap::default(),
                pending: Pending::default(),
                outstanding: IntMap::default(),
                queue: Vec::new(),
                finished: VecDeque::new(),
            },
            shm: regions.map(|r| ShmState {
                regions: Some(r),
                scratch: Vec::new(),
            }),
            routing: None,
            epoch_wanted: None,
            epoch_asked: None,
            watch: Watch::default(),
            stalled: false,
            resync: Vec::new(),
        }
    }

    /// Whether a silence went on long enough for the lcores to be probed
    /// ([`watch`]) since the last call: the caller then has the row
    /// transport check its idle tables too
    /// ([`RowTransport::check_idle_tables`]).
    pub(crate) fn take_stall(&mut self) -> bool {
        std::mem::take(&mut self.stalled)
    }

    /// Routes every chunk by `routing`'s epoch from now on (a replicated
    /// job). Set before the first request.
    pub(crate) fn set_routing(&mut self, routing: Routing) {
        self.routing = Some(routing);
    }

    /// A hierarchical job's rack ([`Routing::set_rack`], PROTOCOL.md
    /// §11.11), on the routing set before; says what disagrees.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn set_rack(
        &mut self,
        appliance: usize,
        runs: Vec<phub_proto::layout::ChunkRange>,
    ) -> Result<(), String> {
        match self.routing.as_mut() {
            Some(r) => r.set_rack(appliance, runs),
            None => Err("a rack without a replicated job's routing".into()),
        }
    }

    /// The epoch this transport holds (a replicated job's; `None` for any
    /// other).
    pub(crate) fn epoch(&self) -> Option<&EpochView> {
        self.routing.as_ref().map(Routing::epoch)
    }

    /// The epoch the caller is to fetch from control, at least (taken:
    /// asked once): an ERROR `wrong_epoch` named it, or a silence asks
    /// whether the held one is still current (then it is the held one).
    /// The caller answers with [`Transport::set_epoch`] once control has
    /// it, or [`Transport::epoch_unavailable`] if control never does.
    pub(crate) fn poll_epoch(&mut self) -> Option<u32> {
        self.epoch_wanted.take()
    }

    /// Control says the job is in `view` (fetched at `now`). An epoch not
    /// newer than the one held changes nothing (the chunks go on being
    /// retransmitted on the timer). A newer one is held from now on:
    /// every chunk sent and still unanswered is re-addressed to where the
    /// new epoch serves it and sent again at once, with the new epoch and
    /// the same round, as a first transmission on a fresh path (its loss
    /// timer, retransmission count and the congestion window start over);
    /// chunks not yet sent go to their new places when they go. Returns
    /// how many chunks were re-sent.
    pub(crate) fn set_epoch(&mut self, now: Instant, view: EpochView) -> usize {
        let Some(routing) = self.routing.as_mut() else {
            return 0;
        };
        if view.epoch <= routing.epoch().epoch {
            return 0;
        }
        log::info!(
            "phub-worker: job {} rank {}: epoch {} -> {} (down: {:?}); {} chunks in flight re-addressed",
            self.info.job,
            self.info.rank,
            routing.epoch().epoch,
            view.epoch,
            view.down,
            self.table.outstanding.len()
        );
        let was_at_rack = routing.at_rack();
        routing.set_epoch(view);
        if was_at_rack && !routing.at_rack() {
            // Flat from now on (§11.11): the window made for the rack
            // appliance's lcores is remade for every appliance's.
            let lcores = routing.lcore_count();
            self.reshape_window(lcores);
        }
        // Taken while the chunks are re-addressed (`sequence` borrows the
        // whole transport), and put back below.
        let routing = self.routing.take().expect("checked above");
        // Oldest transmissions first, as they went out.
        let mut order: Vec<(Instant, u64, ChunkId)> = self
            .table
            .outstanding
            .iter()
            .map(|(k, o)| (o.sent, o.seq, *k))
            .collect();
        order.sort_unstable_by_key(|&(sent, seq, k)| (sent, seq, k.key, k.chunk));
        let deadline = now + self.loss.rto.loss(0);
        let mut sent = 0;
        for (_, _, k) in order {
            let Some(o) = self.table.outstanding.get_mut(&k) else {
                continue;
            };
            let Some(req) = self.table.requests.get_mut(&o.id) else {
                continue;
            };
            let header = &mut req.tx.headers_mut()[o.msg.header_range()];
            let slot = o.msg.slot;
            if routing.route(k.key, &mut o.msg, header) && !o.earlier.contains(&slot) {
                o.earlier.push(slot);
            }
            // A first transmission on its new path.
            let mut h = Header::new_unchecked(header);
            let f = h.flags();
            h.set_flags(f & !flags::RETRANSMIT);
            o.retries = 0;
            o.backoff = 0;
            o.first_sent = now;
            o.sent = now;
            o.deadline = deadline;
            let (id, msg) = (o.id, o.msg);
            let seq = self.sequence(stream_of(Some(&routing), &msg), k);
            if let Some(o) = self.table.outstanding.get_mut(&k) {
                o.seq = seq;
            }
            self.table.queue.push((id, msg));
            sent += 1;
        }
        self.routing = Some(routing);
        // Sent again, if to a new place.
        add(&self.stats.retransmits, sent as u64);
        self.congestion.fresh(self.flow.window, &self.stats);
        // A new epoch is progress: the requests' timeout and the loss
        // timer's backoff start over.
        self.loss.last_progress = now;
        self.loss.quiet_backoff = 0;
        self.loss.last_resend = now;
        sent
    }

    /// Control did not come to hold the epoch wanted: every request in
    /// flight fails with `err` (which names the job, the epochs and
    /// control).
    pub(crate) fn epoch_unavailable(&mut self, err: impl Fn() -> WorkerError) {
        let ids: Vec<u64> = self.table.requests.keys().copied().collect();
        for id in ids {
            self.fail(id, err());
        }
    }

    /// Lets the window follow the receive-buffer shares the lcores state:
    /// it was made by `auto` from the job's shape (the caller set none).
    pub(crate) fn set_auto_window(&mut self, auto: AutoWindow) {
        self.flow.set_auto(auto);
    }

    /// The window in use: chunks outstanding at most.
    #[cfg(test)]
    pub(crate) fn window(&self) -> usize {
        self.flow.window
    }

    /// Lcore `lcore` stated a receive-buffer share of `share` bytes for
    /// this job (0: none): the flow window may change
    /// ([`FlowWindow::note_share`]), and the congestion window follows it.
    fn note_share(&mut self, lcore: u16, share: u32) {
        let before = self.flow.window;
        let Some(window) = self.flow.note_share(lcore, share) else {
            return;
        };
        log::debug!(
            "phub-worker: lcore {lcore} states a receive-buffer share of {share} bytes: window {before} -> {window}"
        );
        self.window_changed(window);
    }

    /// The job's chunks now spread over `lcores` lcores: an automatic
    /// window is remade for them ([`FlowWindow::reshape`]).
    fn reshape_window(&mut self, lcores: usize) {
        let before = self.flow.window;
        let Some(window) = self.flow.reshape(lcores) else {
            return;
        };
        log::debug!(
            "phub-worker: job {} rank {}: chunks spread over {lcores} lcores: window {before} -> {window}",
            self.info.job,
            self.info.rank
        );
        self.window_changed(window);
    }

    /// The flow window became `window`: the congestion window follows it.
    fn window_changed(&mut self, window: usize) {
        self.congestion.on_window(window);
        self.stats.window.store(window as u64, Ordering::Relaxed);
        self.stats
            .cwnd
            .store(self.congestion.cwnd as u64, Ordering::Relaxed);
    }

    /// Whether requests are in flight.
    pub(crate) fn busy(&self) -> bool {
        !self.table.requests.is_empty()
    }

    /// Whether chunks were sent again and no result has come in since: the
    /// appliance may be gone or restarting (its shared-memory regions with
    /// it), so every send is preceded by a check of them.
    pub(crate) fn silent(&self) -> bool {
        self.loss.quiet_backoff > 0
    }

    /// Takes a request at `now`; its chunks are sent by the following
    /// [`Transport::poll_transmit`]s as the window allows. A request of no
    /// chunks is done at once.
    pub(crate) fn submit(&mut self, now: Instant, mut r: Request<D>) {
        if r.kind == Kind::Pull && !self.resync.is_empty() {
            // After a refusal `ahead` (PROTOCOL.md §5.4 rule 0).
            for m in &r.chunks {
                if self.resync.contains(&m.to) {
                    add_flag(&mut r.tx.headers_mut()[m.header_range()], flags::RESYNC);
                }
            }
        }
        if !self.busy() {
            // Idle time does not count towards the timeout.
            self.loss.last_progress = now;
            self.loss.quiet_backoff = 0;
        }
        let id = self.table.next_id;
        self.table.next_id += 1;
        let chunks = r.chunks.len();
        self.table.requests.insert(
            id,
            Active {
                key: r.key,
                round: r.round,
                kind: r.kind,
                sink: r.sink,
                tx: r.tx,
                chunks,
                remaining: chunks,
                min_round: u32::MAX,
                done: r.done,
            },
        );
        self.table
            .pending
            .push_request(id, r.round, r.chunks, self.info.in_order);
        if chunks == 0 {
            self.complete(id);
        }
    }

    /// Appends to `out` what to send at `now`: chunks that fast
    /// retransmission finds lost, pending chunks as the window allows
    /// (first transmissions), and what [`Transport::handle_timeout`]
    /// queued; each in one datagram, borrowed from its request.
    pub(crate) fn poll_transmit<'a>(&'a mut self, now: Instant, out: &mut Vec<Datagram<'a>>) {
        self.fast_retransmit(now);
        self.fill_window(now);
        let requests = &self.table.requests;
        out.extend(self.table.queue.drain(..).filter_map(|(id, m)| {
            requests.get(&id).map(|r| {
                let (head, body) = r.tx.parts(&m);
                Datagram { to: m.to, head, body }
            })
        }));
        out.extend(
            self.watch
                .hand_out()
                .map(|(to, head)| Datagram { to, head, body: &[] }),
        );
    }

    /// The next instant [`Transport::handle_timeout`] may have something to
    /// do (a loss timer, a request's timeout); `None` while idle.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        if !self.busy() {
            return None;
        }
        let since = self.loss.last_progress.max(self.loss.last_resend);
        let loss = (since + self.loss.rto.loss(self.loss.quiet_backoff)).max(self.loss.last_scan + TICK);
        Some(loss.min(self.loss.last_progress + self.timeout))
    }

    /// Runs the timers at `now`: queues late chunks for retransmission and
    /// fails every request once no result has come in for `timeout`.
    /// Returns whether chunks were queued: the caller checks the
    /// shared-memory regions before it polls them.
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> bool {
        let mut resent = false;
        if now.saturating_duration_since(self.loss.last_scan) >= TICK {
            self.loss.last_scan = now;
            resent = self.resend_late(now);
        }
        if self.busy() && now.saturating_duration_since(self.loss.last_progress) >= self.timeout {
            self.time_out(now);
        }
        resent
    }

    /// The next request that ended, if any.
    pub(crate) fn poll_done(&mut self) -> Option<Finished<D>> {
        self.table.finished.pop_front()
    }

    /// Fails every request with [`WorkerError::Closed`].
    pub(crate) fn close(&mut self) {
        self.fail_every(|| WorkerError::Closed);
    }

    /// Handles a datagram received at `now`:
    /// [`Transport::accept`] then [`Transport::handle`]. (The I/O thread
    /// calls the two itself, to check the shared-memory regions in between
    /// when [`Transport::checks_regions_first`].)
    #[cfg(test)]
    pub(crate) fn handle_datagram(&mut self, now: Instant, d: &[u8]) {
        if let Some(m) = self.accept(None, d) {
            self.handle(now, m);
        }
    }

    /// `d` if it is a well-formed RESULT or ERROR of this job for this
    /// rank; otherwise counted as `foreign_dropped`.
    pub(crate) fn accept<'d>(&self, from: Option<SocketAddr>, d: &'d [u8]) -> Option<Incoming<'d>> {
        let info = &self.info;
        let ours = |r: &Repr| r.job == info.job && r.token == info.token && r.dtype == info.dtype;
        match wire::parse(d) {
            Ok((repr, payload))
                if ours(&repr)
                    && match repr.kind {
                        MsgType::Result => repr.rank == APPLIANCE_RANK,
                        MsgType::Error => repr.rank == info.rank,
                        _ => false,
                    } =>
            {
                let h = Header::new_unchecked(d);
                Some(Incoming {
                    repr,
                    payload,
                    rx_share: h.rx_share(),
                    epoch: h.epoch(),
                    from,
                })
            }
            _ => {
                add(&self.stats.foreign_dropped, 1);
                None
            }
        }
    }

    /// Whether the shared-memory regions must be checked before `m` is
    /// handled: it may be the first word of a restarted dataplane (an
    /// ERROR, or a result in shared memory after a silence), whose regions
    /// it is to be read from (and which a pull after this ERROR should find
    /// mapped).
    pub(crate) fn checks_regions_first(&self, m: &Incoming<'_>) -> bool {
        self.shm.is_some() && (m.repr.kind == MsgType::Error || (m.repr.shm() && self.silent()))
    }

    /// Handles an accepted datagram at `now`: an ERROR fails the request
    /// it refuses, a RESULT fills its chunk; one that no outstanding chunk
    /// waits for is counted as `results_ignored`.
    pub(crate) fn handle(&mut self, now: Instant, m: Incoming<'_>) {
        let Incoming {
            repr,
            payload,
            rx_share,
            epoch,
            from,
        } = m;
        if repr.shm() && self.shm.as_ref().is_none_or(|s| s.regions.is_none()) {
            // A result in shared memory this worker has not mapped is malformed.
            add(&self.stats.foreign_dropped, 1);
            return;
        }
        if self.routing.as_ref().is_some_and(|r| epoch < r.epoch().restored) {
            // Sent before the whole job went back to its checkpoints
            // (PROTOCOL.md §11.7): an answer of a history the job left,
            // held in the network (a RESULT of a round the appliances
            // repeat since may differ, and one answering this rank's
            // PULL would skip the INIT a restored chunk needs again).
            add(&self.stats.results_ignored, 1);
            return;
        }
        if repr.kind == MsgType::Error && repr.error == DropReason::ShuttingDown.code() {
            self.appliance_stopping(&repr);
            return;
        }
        if repr.kind == MsgType::Error && repr.error == DropReason::WrongEpoch.code() {
            // The appliance refused a message of a replicated job whose
            // header's epoch is not the one it installed; its ERROR's
            // header carries the appliance's epoch (PROTOCOL.md §11.6).
            if let Some(routing) = &self.routing {
                // Newer than ours: control is asked for it, and the chunks
                // are re-addressed once it is held. Not newer: the
                // appliance has not installed ours yet, and the chunk is
                // sent again on the timer.
                if epoch > routing.epoch().epoch {
                    self.epoch_wanted = self.epoch_wanted.max(Some(epoch));
                }
                add(&self.stats.results_ignored, 1);
                return;
            }
        }
        if repr.kind == MsgType::Error && repr.error == DropReason::Ahead.code() {
            // Every lcore that refuses this rank `ahead` gets RESYNC on its
            // PULLs (PROTOCOL.md §5.4 rule 0), also one whose refusal comes
            // for a request another lcore's refusal already ended: the
            // caller's pulls go to all of them.
            let to = from.or_else(|| self.table.outstanding.get(&ChunkId::of(&repr)).map(|o| o.msg.to));
            if let Some(to) = to {
                self.needs_resync(to);
            }
        }
        if self.watches() {
            if let Verdict::Behind { key, chunk, round } = self.watch.on_answer(&self.info, &repr, from) {
                if let Some(from) = from {
                    self.needs_resync(from);
                }
                self.restored_behind(key, chunk, round);
            }
        }
        let Some(id) = self.waiting_for(&repr) else {
            add(&self.stats.results_ignored, 1);
            return;
        };
        if repr.kind == MsgType::Error
            && self.routing.is_some()
            && from.is_some_and(|f| !self.sent_to(&repr, f))
        {
            // A replicated job's chunk is refused only by where it is
            // sent in the epoch held: an appliance a drain took the job
            // off answers a copy sent there before the epoch changed
            // `evicted` (PROTOCOL.md §11.8), which ends nothing.
            add(&self.stats.results_ignored, 1);
            return;
        }
        if repr.kind == MsgType::Error && repr.error == DropReason::Evicted.code() {
            if let Some(routing) = &self.routing {
                // Where this epoch sends it, the job is gone: drained off
                // that appliance (a newer epoch has it elsewhere), or
                // evicted (control no longer admits it, and says so).
                // Control is asked; its answer re-routes or ends it.
                let newer = routing.epoch().epoch + 1;
                self.epoch_wanted = self.epoch_wanted.max(Some(newer));
                add(&self.stats.results_ignored, 1);
                return;
            }
        }
        match repr.kind {
            MsgType::Error => self.on_error(id, &repr),
            _ => self.on_result(now, id, &repr, payload, rx_share),
        }
    }

    /// Tells the transport which shared-memory mapping is in use now
    /// (`None`: none can be opened) after the caller checked the regions;
    /// every outstanding chunk is written again into its staging region
    /// (or goes as a datagram from now on), as a dataplane that made new
    /// regions would never see a chunk left in the old ones.
    pub(crate) fn set_regions(&mut self, regions: Option<Arc<Regions>>) {
        let Some(shm) = self.shm.as_mut() else {
            return;
        };
        shm.regions = regions;
        for o in self.table.outstanding.values() {
            if let Some(req) = self.table.requests.get_mut(&o.id) {
                req.tx.stage(&o.msg, shm.regions.as_ref());
            }
        }
    }

    /// Whether the outstanding chunk `repr` names is addressed to `from`.
    fn sent_to(&self, repr: &Repr, from: SocketAddr) -> bool {
        self.table
            .outstanding
            .get(&ChunkId::of(repr))
            .is_some_and(|o| o.msg.to == from)
    }

    /// The request whose outstanding chunk `repr` names, at its slot.
    fn waiting_for(&self, repr: &Repr) -> Option<u64> {
        let o = self.table.outstanding.get(&ChunkId::of(repr))?;
        let slot = repr.slot == o.msg.slot || o.earlier.contains(&repr.slot);
        (slot && self.table.requests.contains_key(&o.id)).then_some(o.id)
    }

    fn on_error(&mut self, id: u64, repr: &Repr) {
        if !self.table.requests.get(&id).is_some_and(|r| r.refused_by(repr)) {
            add(&self.stats.results_ignored, 1);
            return;
        }
        add(&self.stats.errors, 1);
        if repr.error == DropReason::Ahead.code() {
            // The caller pulls every key and repeats the rounds since: a
            // probe still out would only say it again, to requests made
            // after it caught up.
            self.watch.reset();
        }
        let (reason, hint) = describe(repr.error);
        let err = WorkerError::Refused {
            key: repr.key,
            chunk: repr.chunk,
            round: repr.round,
            reason,
            hint: hint.to_string(),
        };
        self.fail(id, err);
    }

    /// The appliance is shutting down (an ERROR `shutting_down`, which it
    /// sends to every rank it knows as it stops, whatever the round, slot,
    /// key and chunk): every request in flight fails with it at once, as
    /// none of them will be answered. Each names its key, its round and
    /// its first chunk still waiting.
    fn appliance_stopping(&mut self, repr: &Repr) {
        if self.table.requests.is_empty() {
            add(&self.stats.results_ignored, 1);
            return;
        }
        add(&self.stats.errors, 1);
        let (reason, hint) = describe(repr.error);
        let ids: Vec<u64> = self.table.requests.keys().copied().collect();
        for id in ids {
            let req = &self.table.requests[&id];
            let chunk = self
                .table
                .outstanding
                .iter()
                .filter(|(_, o)| o.id == id)
                .map(|(c, _)| c.chunk)
                .min()
                .unwrap_or(0);
            let err = WorkerError::Refused {
                key: req.key,
                chunk,
                round: req.round,
                reason: reason.clone(),
                hint: hint.to_string(),
            };
            self.fail(id, err);
        }
    }

    fn on_result(&mut self, now: Instant, id: u64, repr: &Repr, payload: &[u8], rx_share: u32) {
        let k = ChunkId::of(repr);
        let (Some(o), Some(req)) = (self.table.outstanding.get(&k), self.table.requests.get_mut(&id)) else {
            return;
        };
        if !req.answered_by(repr, o.msg.len) {
            add(&self.stats.results_ignored, 1);
            return;
        }
        if req.kind != Kind::Pull && !self.resync.is_empty() {
            // An INIT or PUSH taken: rule 0 is lifted there.
            let to = o.msg.to;
            self.resync.retain(|&a| a != to);
        }
        let mut no_scratch = Vec::new();
        let (arrived, scratch) = match (repr.shm(), self.shm.as_mut()) {
            (
                true,
                Some(ShmState {
                    regions: Some(r),
                    scratch,
                }),
            ) => (Arrived::Region(r), scratch),
            // `handle` dropped a shared-memory result without a mapping.
            _ => (Arrived::Datagram(payload), &mut no_scratch),
        };
        if !req.sink.write(&o.msg, arrived, self.info.dtype, scratch) {
            add(&self.stats.foreign_dropped, 1);
            return;
        }
        if repr.shm() {
            add(&self.stats.shm_results, 1);
        }
        debug_assert!(
            req.remaining > 0,
            "key {}: a result past the request's last chunk",
            req.key
        );
        req.remaining -= 1;
        req.min_round = req.min_round.min(repr.round);
        let done = req.remaining == 0;
        let (lcore, slot, to) = (o.msg.lcore, o.msg.slot, o.msg.to);
        if self.watches() {
            self.watch.answered(lcore, k.key, k.chunk, slot, to, repr.round);
        }
        self.answered(now, k);
        self.note_share(lcore, rx_share);
        if done {
            self.complete(id);
        }
    }

    /// Chunk `k`'s result was accepted at `now`: it leaves the window, and
    /// if it was sent once only, its round trip is a sample and its
    /// sequence number says how far its lcore has got.
    fn answered(&mut self, now: Instant, k: ChunkId) {
        let Some(o) = self.table.outstanding.remove(&k) else {
            return;
        };
        self.table.pending.settled(o.lane);
        // Only first transmissions count (Karn's rule), and only they say
        // how far the lcore has got: a resent chunk's result may overtake
        // chunks that are merely waiting for a slow rank (with W > 1),
        // which must not count as lost.
        let first = o.retries == 0;
        if first {
            self.loss.rto.sample(now.saturating_duration_since(o.first_sent));
            let srtt = micros(self.loss.rto.srtt.unwrap_or_default());
            self.stats.srtt_us.store(srtt, Ordering::Relaxed);
            self.stats
                .rto_us
                .store(micros(self.loss.rto.rto), Ordering::Relaxed);
            let stream = stream_of(self.routing.as_ref(), &o.msg);
            if let Some(lane) = self.loss.lanes.get_mut(stream) {
                if o.seq > lane.acked_seq {
                    lane.acked_seq = o.seq;
                    self.loss.acked = true;
                }
            }
        }
        let rtt = self.loss.rto.smoothed();
        self.congestion
            .on_answer(now, first, self.flow.window, rtt, &self.stats);
        add(&self.stats.results_accepted, 1);
        self.loss.last_progress = now;
        self.loss.progressed = true;
        self.loss.quiet_backoff = 0;
    }

    /// The next sequence number of answer stream `l` ([`stream_of`]),
    /// remembering that chunk `id` was sent with it.
    fn sequence(&mut self, l: usize, id: ChunkId) -> u64 {
        if self.loss.lanes.len() <= l {
            self.loss.lanes.resize_with(l + 1, Lane::default);
        }
        let lane = &mut self.loss.lanes[l];
        lane.next_seq += 1;
        lane.sent.push_back(LaneEntry {
            seq: lane.next_seq,
            id,
        });
        lane.next_seq
    }

    /// Moves pending chunks into the window, as far as it has room.
    fn fill_window(&mut self, now: Instant) {
        let deadline = now + self.loss.rto.loss(0);
        // The window may have shrunk below what is out (a share stated, a
        // cut): then nothing new goes until results bring it under, but
        // in a lane with none out (Pending).
        let before = self.table.outstanding.len();
        let window = self.congestion.cwnd;
        let cap = if self.info.in_order {
            (window / self.table.pending.active().max(1)).max(1)
        } else {
            window
        };
        loop {
            let total = self.table.outstanding.len();
            let Some((id, mut msg, lane)) = self.table.pending.pop(cap, window, total) else {
                break;
            };
            let Some(req) = self.table.requests.get_mut(&id) else {
                continue;
            };
            let key = req.key;
            if let Some(routing) = &self.routing {
                let header = msg.header_range();
                routing.route(key, &mut msg, &mut req.tx.headers_mut()[header]);
            }
            if let Some(shm) = &self.shm {
                // The key's previous round of this chunk has its result: the
                // lcore no longer reads the slot, and this rank may write it.
                req.tx.stage(&msg, shm.regions.as_ref());
            }
            self.table.queue.push((id, msg));
            add(&self.stats.chunks_sent, 1);
            let chunk = ChunkId {
                key,
                chunk: msg.chunk,
            };
            let seq = self.sequence(stream_of(self.routing.as_ref(), &msg), chunk);
            self.table.pending.sent(lane);
            let o = Outstanding {
                id,
                lane,
                first_sent: now,
                sent: now,
                deadline,
                seq,
                retries: 0,
                backoff: 0,
                msg,
                earlier: Vec::new(),
            };
            let again = self.table.outstanding.insert(chunk, o);
            // At most one request per key is in flight, so a chunk of it
            // is outstanding once.
            debug_assert!(
                again.is_none(),
                "key {key} chunk {} sent twice at once",
                msg.chunk
            );
        }
        debug_assert!(
            self.table.outstanding.len() <= window.max(before) + self.table.pending.active(),
            "{} chunks outstanding, cwnd {}",
            self.table.outstanding.len(),
            window
        );
        debug_assert!(self.congestion.cwnd <= self.flow.window);
    }

    /// Queues chunk `k` for sending again at `now`, with a new sequence
    /// number and the RETRANSMIT flag; returns whether it was outstanding.
    fn resend(&mut self, k: ChunkId, now: Instant, backoff: Backoff) -> bool {
        let Some(stream) = self
            .table
            .outstanding
            .get(&k)
            .map(|o| stream_of(self.routing.as_ref(), &o.msg))
        else {
            return false;
        };
        let seq = self.sequence(stream, k);
        let Some(o) = self.table.outstanding.get_mut(&k) else {
            return false;
        };
        if o.retries == 0 {
            if let Some(r) = self.table.requests.get_mut(&o.id) {
                add_flag(&mut r.tx.headers_mut()[o.msg.header_range()], flags::RETRANSMIT);
            }
        }
        o.retries += 1;
        o.seq = seq;
        o.sent = now;
        if backoff == Backoff::Double {
            o.backoff += 1;
        }
        o.deadline = now + self.loss.rto.loss(o.backoff);
        self.table.queue.push((o.id, o.msg));
        true
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
    ///
    /// A hierarchical job's rack lcore answers a chunk when the chunk's
    /// home does, and homes are on different appliances, so there later
    /// results overtake a chunk that is merely waiting for a far home: it
    /// counts as lost only once it has also been out for the retransmission
    /// timeout (RTO), which its round trips, far homes' included, set.
    fn fast_retransmit(&mut self, now: Instant) {
        if !std::mem::take(&mut self.loss.acked) {
            return;
        }
        // How long an overtaken chunk may still be on its way.
        let patience = if self.info.in_order {
            Duration::ZERO
        } else {
            self.loss.rto.rto
        };
        let mut resent = 0;
        for l in 0..self.loss.lanes.len() {
            while let Some(&LaneEntry { seq, id: k }) = self.loss.lanes[l].sent.front() {
                let o = self.table.outstanding.get(&k).filter(|o| o.seq == seq);
                let live = o.is_some();
                if live && seq + REORDER > self.loss.lanes[l].acked_seq {
                    break;
                }
                if o.is_some_and(|o| now.saturating_duration_since(o.sent) < patience) {
                    // Not yet: looked at again with the next result.
                    self.loss.acked = true;
                    break;
                }
                self.loss.lanes[l].sent.pop_front();
                if live && self.resend(k, now, Backoff::Keep) {
                    resent += 1;
                }
            }
        }
        add(&self.stats.retransmits, resent);
        add(&self.stats.fast_retransmits, resent);
        if resent > 0 {
            let rtt = self.loss.rto.smoothed();
            let out = self.table.outstanding.len();
            self.congestion
                .on_loss(now, out, self.flow.window, rtt, &self.stats);
        }
    }

    /// The loss timer: queues the oldest late chunks once no result at all
    /// has come in for the loss timeout; returns whether it queued any.
    fn resend_late(&mut self, now: Instant) -> bool {
        // A chunk is late only once its own timer has expired *and* no result
        // at all has come back for a base RTO (RFC 6298 5.3: the timer
        // restarts when new data is acknowledged). With a window of
        // thousands of chunks sent in bursts, a chunk's round trip includes
        // its wait behind the rest of the window in the appliance's queue,
        // and per-chunk timers alone fire spuriously while results are
        // still streaming in. A chunk really lost while others flow is
        // resent once the flow stops: at worst one RTO after the last
        // result of its round.
        // While the silence goes on, the resends themselves back off (as
        // TCP's single timer does): one batch of the oldest late chunks per
        // RTO, then per 2 RTO, 4 RTO...
        let since = self.loss.last_progress.max(self.loss.last_resend);
        if now.saturating_duration_since(since) < self.loss.rto.loss(self.loss.quiet_backoff) {
            return false;
        }
        // Results came back since the last scan: the appliance answers and the
        // other ranks push, so chunks backed off while they waited are given
        // the base timeout again (as TCP's backoff ends with a new ACK).
        // Without this a result lost after a long wait for a slow rank would
        // cost up to `max_rto`, and slow ranks would slow each other down.
        let reset = std::mem::take(&mut self.loss.progressed);
        let mut late = std::mem::take(&mut self.loss.late);
        late.clear();
        for (k, o) in self.table.outstanding.iter_mut() {
            if reset && o.backoff > 0 {
                o.backoff = 0;
                o.deadline = o.deadline.min(now + self.loss.rto.loss(0));
            }
            if now >= o.deadline {
                late.push(Late {
                    sent: o.sent,
                    first_sent: o.first_sent,
                    id: *k,
                });
            }
        }
        // As TCP's tail loss probe resends only its last segment, resend only
        // the late chunk sent longest ago on the first silence, two on the
        // next, four... By last transmission, not first: the probes then go
        // round every late chunk, where by first transmission up to `cap`
        // chunks that are late only because they wait on another rank
        // would be probed every silence and a lost one behind them never
        // (the simulator's seed 7348: every rank timed out).
        // When the silence is a slow rank (or a descheduled lcore) rather
        // than loss, the probes are few duplicates the appliance drops; when
        // it is loss, each probe's result resets the count, and the chunks
        // still missing behind it follow one silence each.
        let cap = (1usize << self.loss.quiet_backoff.min(16)).min((self.flow.window / 16).max(16));
        if late.len() > cap {
            late.sort_unstable_by_key(|l| (l.sent, l.first_sent));
            late.truncate(cap);
        }
        for l in &late {
            self.resend(l.id, now, Backoff::Double);
        }
        let resent = !late.is_empty();
        if resent {
            self.loss.last_resend = now;
            self.loss.quiet_backoff += 1;
            self.ask_epoch_if_silent(now, &late);
            if self.loss.quiet_backoff >= PROBE_AFTER && self.watches() {
                self.stalled = true;
                let mut busy = Vec::new();
                for o in self.table.outstanding.values() {
                    let l = usize::from(o.msg.lcore);
                    if busy.len() <= l {
                        busy.resize(l + 1, false);
                    }
                    busy[l] = true;
                }
                let asked = self
                    .watch
                    .probe(&self.info, |l| busy.get(usize::from(l)) == Some(&true));
                add(&self.stats.lcores_probed, asked);
            }
        }
        add(&self.stats.retransmits, late.len() as u64);
        self.loss.late = late;
        resent
    }

    /// A replicated job's chunk of `late` (just resent) has now been
    /// retransmitted [`SILENT_SENDS`] times without an answer: its appliance may be dead,
    /// and control is asked whether the epoch is still the one held (at
    /// most every [`EPOCH_ASK_GAP`]). If it is, the chunks go on being
    /// retransmitted as before.
    fn ask_epoch_if_silent(&mut self, now: Instant, late: &[Late]) {
        let Some(routing) = &self.routing else {
            return;
        };
        if self
            .epoch_asked
            .is_some_and(|t| now.saturating_duration_since(t) < EPOCH_ASK_GAP)
        {
            return;
        }
        let outstanding = &self.table.outstanding;
        if late
            .iter()
            .any(|l| outstanding.get(&l.id).is_some_and(|o| o.retries >= SILENT_SENDS))
        {
            self.epoch_asked = Some(now);
            let held = routing.epoch().epoch;
            self.epoch_wanted = self.epoch_wanted.max(Some(held));
        }
    }

    /// Whether this job's lcores are watched ([`watch`]): a flat job's
    /// (whose lcores answer in order) that is not replicated (whose
    /// serving appliances never stand behind a round they answered).
    fn watches(&self) -> bool {
        self.info.in_order && self.routing.is_none()
    }

    /// The lcore at `to` refused this rank `ahead` or was found behind:
    /// PULLs to it carry RESYNC until it answers an INIT or PUSH.
    fn needs_resync(&mut self, to: SocketAddr) {
        if !self.resync.contains(&to) {
            self.resync.push(to);
        }
    }

    /// A probe found an lcore below `round` of `key`'s chunk `chunk`, a
    /// round it had answered ([`watch`]): every request fails with
    /// `ahead`, as the lcore would have refused any of them, and the
    /// caller pulls every key and repeats the rounds since.
    fn restored_behind(&mut self, key: u32, chunk: u32, round: u32) {
        add(&self.stats.lcores_found_behind, 1);
        self.watch.reset();
        let hint = format!(
            " (a PULL found the appliance no longer holding round {round} of this chunk, which it had \
             answered: it restarted from an older checkpoint; pull every key and repeat the rounds since)"
        );
        self.fail_every(|| WorkerError::Refused {
            key,
            chunk,
            round,
            reason: DropReason::Ahead.name().to_string(),
            hint: hint.clone(),
        });
    }

    /// Fails every request in flight with `err()`.
    fn fail_every(&mut self, err: impl Fn() -> WorkerError) {
        let ids: Vec<u64> = self.table.requests.keys().copied().collect();
        for id in ids {
            self.fail(id, err());
        }
    }

    /// Request `id` is complete: its result goes to [`Transport::poll_done`].
    fn complete(&mut self, id: u64) {
        let Some(req) = self.table.requests.remove(&id) else {
            return;
        };
        debug_assert_eq!(req.remaining, 0, "key {}: completed with chunks missing", req.key);
        let round = req.result_round();
        self.table.finished.push_back(Finished {
            key: req.key,
            done: req.done,
            tx: req.tx.into_spare(),
            result: Ok(Output {
                round,
                sink: req.sink,
            }),
        });
    }

    /// Request `id` failed with `err`: its chunks are dropped, and the
    /// failure goes to [`Transport::poll_done`].
    fn fail(&mut self, id: u64, err: WorkerError) {
        let Some(req) = self.table.requests.remove(&id) else {
            return;
        };
        let pending = &mut self.table.pending;
        self.table.outstanding.retain(|_, o| {
            if o.id == id {
                pending.settled(o.lane);
            }
            o.id != id
        });
        pending.remove(id);
        self.table.finished.push_back(Finished {
            key: req.key,
            done: req.done,
            tx: req.tx.into_spare(),
            result: Err(err),
        });
    }

    /// Fails every request with [`WorkerError::Timeout`].
    fn time_out(&mut self, now: Instant) {
        let waited = now.saturating_duration_since(self.loss.last_progress);
        let ids: Vec<u64> = self.table.requests.keys().copied().collect();
        for id in ids {
            let mut addrs: Vec<SocketAddr> = self
                .table
                .outstanding
                .values()
                .filter(|o| o.id == id)
                .map(|o| o.msg.to)
                .chain(self.table.pending.of(id).map(|m| m.to))
                .collect();
            addrs.sort();
            addrs.dedup();
            let req = &self.table.requests[&id];
            let err = WorkerError::Timeout {
                key: req.key,
                round: req.round,
                addrs,
                waited,
                missing: req.remaining,
                chunks: req.chunks,
            };
            add(&self.stats.timeouts, 1);
            self.fail(id, err);
        }
    }
}

/// Sets `flag` (RETRANSMIT, RESYNC) in a header we emitted (or a
/// datagram starting with one), keeping its others (SHM, key caching's).
pub(super) fn add_flag(header: &mut [u8], flag: u8) {
    let mut h = Header::new_unchecked(header);
    let f = h.flags();
    h.set_flags(f | flag);
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
                DropReason::NothingToPull => {
                    " (the chunk has no completed round: the appliance restarted before round 0 \
                     completed; send the INIT again)"
                }
                DropReason::Evicted => {
                    " (the job was evicted from the appliance: it is gone, and rejoining cannot help)"
                }
                DropReason::ShuttingDown => {
                    " (the appliance is shutting down: nothing in flight will be answered; once it is \
                     back, phub-control reinstalls the job, from its last checkpoint if it has one)"
                }
                _ => "",
            };
            (r.name().to_string(), hint)
        }
        None => (format!("unknown error code {code}"), ""),
    }
}

/// `d` in whole microseconds, for the stats (saturating: 2^64 us is far
/// beyond any timer here).
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
