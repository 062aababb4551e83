//! The worker's transport for table rows, without I/O (PROTOCOL.md §10.2,
//! §10.3 "The worker's side"): sends a planned request's ROW_PUSH,
//! ROW_END and ROW_PULL messages, resends those unanswered after a
//! timeout, matches ROW_RESULT, ROW_DONE and ROW_PULL_RESULT answers and
//! ERRORs to them, and hands back each id's row.
//!
//! Layer: protocol state machine, in the shape of the dense transport
//! ([`super::Transport`]): the caller passes the time and the datagrams
//! with their source addresses, and polls what to send, when to call
//! again and which requests ended. The I/O thread drives it beside the
//! dense one; the unit tests (`row_tests.rs`) play the appliance by hand.
//!
//! Invariants:
//! - At most one request per table is in flight (a second is refused with
//!   [`WorkerError::Busy`]), and a request ends only once every message of
//!   it is answered: round t + 1 of a table goes to no lcore before this
//!   rank holds round t's ROW_DONE and every ROW_RESULT from every lcore.
//! - Messages go out in the order of submission, each request lcore by
//!   lcore (so every rank sends the same sequence); at most `window` are
//!   outstanding, except that an lcore's messages of a request, once its
//!   first is out, all go (an lcore answers a push only when all of every
//!   rank's messages of the round are in: a window that split them could
//!   leave every rank waiting with half of them sent), and that a check
//!   of an idle table goes at once and counts against no window (held
//!   behind lanes waiting on the lcore it tells, it never went: simulator
//!   seed 559274).
//! - A message unanswered at its deadline, once no answer at all came for
//!   the base loss timeout, is sent again unchanged but for RETRANSMIT;
//!   its deadline then doubles ([`Rto::loss`]).
//! - An answer is matched by its source address (the lcore it came from:
//!   the appliance answers from the port the message went to, §1, §6.3),
//!   its table, its round and its sequence number (a ROW_PULL's `chunk`
//!   carries [`PULL_TAG`], a per-table generation and the message's
//!   index). It is taken once, and only if its dim, count and ids are the
//!   message's; anything else is counted (`row_answers_ignored`,
//!   `row_answers_malformed`, `foreign_dropped`), never an error, never a
//!   panic.
//! - A ROW_PUSH or ROW_END of round t ≥ 2 refused `ahead` does not end its
//!   request: its lcore was restored from an older checkpoint
//!   (PROTOCOL.md §10.6). That lcore's messages of the request are parked
//!   (answered ones too), a ROW_PULL of one id asks its round c, an empty
//!   round (ROW_END, n = 0) goes for each of c + 1 .. t − 1, one at a time,
//!   and then the parked messages go again at once, past the window
//!   ([`CatchUp`]).
//! - A push with a message resent twice sends its answered messages
//!   again with the unanswered ones (an lcore restored behind a round or
//!   clock it completed waits for them, PROTOCOL.md §10.6;
//!   [`RowTransport::handle_timeout`]). A transport without an answer for
//!   a while asks where the tables of the lanes held behind its window
//!   stand ([`RowTransport::probe_held_lanes`]).
//! - A rank whose dense chunks stall checks its idle tables: each sends
//!   every lcore an empty round of its last completed push, ended
//!   silently, so that an lcore restored before that round completed gets
//!   this rank's part ([`RowTransport::check_idle_tables`]). A transport
//!   with no caller's request in flight does so on its own too, 1 s into
//!   the idle spell and then at doubling intervals of at most a quarter of
//!   `timeout` ([`IDLE_CHECK_FIRST`]): a rank that finished its run, or
//!   computes between steps, tells a restored lcore its part before the
//!   ranks waiting there time out.
//! - Every request ends: with its rows, with the appliance's refusal
//!   ([`WorkerError::TableRefused`]), with [`WorkerError::TableTimeout`]
//!   once no answer at all has come for `timeout`, or with
//!   [`WorkerError::Closed`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_proto::failover::EpochView;
use phub_proto::row_ops::copy_row;
use phub_proto::rows::{
    self, ids_signature, CacheRef, KeyCache, RowMsgType, RowPayload, RowRepr, Rows, KEY_CACHE_PREFIX,
};
use phub_proto::spec::ROW_ID_BYTES;
use phub_proto::wire::{self, flags, DropReason, MsgType, APPLIANCE_RANK, HEADER_LEN};

use super::row_plan::{plan_push, PlanKind, RowPlan, TableInfo};
use super::rto::Rto;
use super::{add_flag, describe, micros, JobInfo, Routing};
use crate::config::WorkerConfig;
use crate::error::WorkerError;
use crate::net::Datagram;
use crate::stats::{add, Counters};

/// The top bit of a ROW_PULL's `chunk`: no ROW_PUSH or ROW_END has it (their
/// `chunk` is at most [`rows::MAX_ROW_MESSAGES`]), so an ERROR echoing it
/// is known to be a pull's.
pub(crate) const PULL_TAG: u32 = 1 << 31;
/// Below it, a ROW_PULL's `chunk` holds the pull's generation (11 bits,
/// counting the table's pulls) above the message's index (20 bits): an
/// answer to an earlier pull of the table is not taken for this one's.
const GEN_SHIFT: u32 = 20;
const INDEX_MASK: u32 = (1 << GEN_SHIFT) - 1;
const GEN_MASK: u32 = (1 << 11) - 1;

/// A planned table request and what its caller gets back when it ends.
#[derive(Debug)]
pub(crate) struct RowRequest<D> {
    pub(crate) plan: RowPlan,
    pub(crate) done: D,
}

/// A completed table request's result.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RowOutput {
    /// A push: its round (clock). A pull: the lowest round the answering
    /// lcores stated (0 for a pull of no ids).
    pub(crate) round: u32,
    /// A push: its round. A pull: the highest round stated.
    pub(crate) highest: u32,
    /// The rows of the request's distinct ids, in the plan's order, as
    /// they were answered.
    pub(crate) rows: Vec<f32>,
    /// The caller's id `i`'s row is row `slot_of[i]` of `rows` (the
    /// plan's [`RowPlan::slot_of`]).
    pub(crate) slot_of: Vec<u32>,
    /// Values per row.
    pub(crate) dim: usize,
}

impl RowOutput {
    /// Each of the caller's ids' row into `out`, in the caller's order
    /// (`slot_of.len() * dim` values): each row copied once, from the
    /// answers' order straight to the caller's.
    pub(crate) fn write_into(&self, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.slot_of.len() * self.dim);
        for (dst, &s) in out.chunks_exact_mut(self.dim.max(1)).zip(&self.slot_of) {
            copy_row(dst, &self.rows[s as usize * self.dim..][..self.dim]);
        }
    }

    /// [`RowOutput::write_into`] a new vector.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn caller_rows(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.slot_of.len() * self.dim];
        self.write_into(&mut out);
        out
    }

    /// For a pull of one id on each lcore (a rank catching up after a
    /// rejoin): the round its pushes go on after. The lowest round
    /// stated, unless an lcore stated one more than a round above it: in
    /// BSP a rank that left mid-round leaves its lcores one round apart
    /// at most, and goes on from the lower (the higher answers the push
    /// again and adds nothing, PROTOCOL.md §10.3 rule 3); an lcore lower
    /// still was restored from an older checkpoint since, and a push of
    /// the round after its round would be two or more behind the others,
    /// which only answer it (§10.3 rule 4; before that rule, never:
    /// simulator seed 11567): the rank goes on from one below the
    /// highest, and the restored lcore refuses it `ahead` and is caught
    /// up (§10.6).
    pub(crate) fn caught_up(&self) -> u32 {
        self.round.max(self.highest.saturating_sub(1))
    }
}

/// A table request that ended.
#[derive(Debug)]
pub(crate) struct RowFinished<D> {
    /// The table's key index.
    pub(crate) key: u32,
    pub(crate) done: D,
    pub(crate) result: Result<RowOutput, WorkerError>,
}

/// A push sends its answered messages again, with its unanswered
/// ones, from this many sends of one of those on, while no answer comes
/// ([`RowTransport::handle_timeout`]).
const RESEND_ANSWERED_AFTER: u32 = 2;

/// A transport with no answer for the loss timeout after this many
/// backoffs is stalled: it asks where the tables of its held lanes stand
/// ([`RowTransport::probe_held_lanes`]) and resends answered messages.
const STALL_AFTER: u32 = 2;

/// A transport with no caller's request in flight checks its idle tables
/// this long into the idle spell, then at doubling intervals of at most
/// a quarter of its `timeout` (so that a rank waiting on a restored lcore
/// sees at least three checks before it times out), for as long as the
/// spell lasts ([`RowTransport::check_idle_tables`]; simulator seed
/// 559274).
const IDLE_CHECK_FIRST: Duration = Duration::from_secs(1);

/// A ROW_PULL's `chunk` that asks a restored lcore where a table stands
/// there (below): no pull of a request has this index.
const CATCH_UP_TAG: u32 = PULL_TAG | INDEX_MASK;

/// Where one message of a request stands.
#[derive(Debug, Clone, Copy)]
enum MsgState {
    /// Not sent yet.
    Pending,
    /// Sent, no answer yet.
    Out(Sent),
    /// Its answer is in.
    Answered,
    /// Its lcore refused the request's round `ahead` and is being brought
    /// up to it ([`CatchUp`]): sent again once it is.
    Parked,
}

/// A lane whose lcore refused a push `ahead` (PROTOCOL.md §10.6): it was
/// restored from a checkpoint older than the rounds this rank completed
/// there. The worker asks where the table stands there (a ROW_PULL of one
/// id placed there, whose answer states the lcore's round), sends it an
/// empty round (a ROW_END with n = 0) for each round between that and the
/// push's, each once the last is done, then the push's messages again.
#[derive(Debug, Clone, Copy)]
struct CatchUp {
    /// The message out: the ROW_PULL (`round` = None) or the empty round's
    /// ROW_END.
    round: Option<u32>,
    sent: Sent,
    /// The ROW_PULL's id.
    id: u64,
}

#[derive(Debug, Clone, Copy)]
struct Sent {
    first_sent: Instant,
    deadline: Instant,
    /// Times sent again (Karn's rule: no round-trip sample once non-zero).
    retries: u32,
}

impl Sent {
    /// A first send at `now`, due again at `deadline`.
    fn first(now: Instant, deadline: Instant) -> Sent {
        Sent {
            first_sent: now,
            deadline,
            retries: 0,
        }
    }
}

/// A request in flight.
#[derive(Debug)]
struct Active<D> {
    plan: RowPlan,
    /// A push's round (clock); 0 for a pull.
    round: u32,
    /// A pull's `chunk` bits above the index; 0 for a push.
    tag: u32,
    /// Every message's datagram, one after the other (a message written
    /// again in another key-cache form is appended).
    bytes: Vec<u8>,
    /// Message i is `bytes[spans[i]]`.
    spans: Vec<Range<usize>>,
    /// Message i's key-cache form (PROTOCOL.md §10.7).
    forms: Vec<KeyCache>,
    states: Vec<MsgState>,
    /// The answered rows, in the plan's id order.
    rows: Vec<f32>,
    remaining: usize,
    /// A pull: the lowest and highest rounds its answers stated.
    min_round: u32,
    max_round: u32,
    /// Per entry, its lcore's catching up, while one is (a push only).
    catch_up: BTreeMap<u32, CatchUp>,
    /// A push (not a pull): its answered messages may go again
    /// ([`RowTransport::handle_timeout`]).
    push: bool,
    /// What its caller gets back; `None` for a check of an idle table
    /// ([`RowTransport::check_idle_tables`]), which ends silently.
    done: Option<D>,
}

impl<D> Active<D> {
    /// Whether message `i`'s lcore has a message of this request out or
    /// answered (then the rest of its messages go regardless of the window).
    fn lane_started(&self, i: usize) -> bool {
        let entry = self.plan.msgs[i].entry;
        let first = self.plan.lanes[entry as usize].first;
        first < i && !matches!(self.states[first], MsgState::Pending)
    }

    /// Whether its messages count against the window: a caller's do, a
    /// check's of an idle table do not (it goes past the window).
    fn windowed(&self) -> bool {
        self.done.is_some()
    }
}

/// The row transport's state; `D` is what a request's caller gets back.
#[derive(Debug)]
pub(crate) struct RowTransport<D> {
    info: JobInfo,
    /// Per entry (§10.1), the lcore's address.
    lcores: Vec<SocketAddr>,
    entry_of: HashMap<SocketAddr, u32>,
    /// A replicated job's routing by epoch (PROTOCOL.md §11.9): where each
    /// entry is served, and the epoch every message carries; `None` for
    /// any other job.
    routing: Option<Routing>,
    /// Per entry, where its messages go: its lcore, or where the epoch
    /// held serves it (set with the routing and each new epoch).
    dests: Vec<SocketAddr>,
    /// The epoch to fetch from control, at least ([`RowTransport::poll_epoch`]).
    epoch_wanted: Option<u32>,
    tables: Vec<TableInfo>,
    timeout: Duration,
    window: usize,
    rto: Rto,
    stats: Arc<Counters>,
    /// By table key.
    active: BTreeMap<u32, Active<D>>,
    /// Messages not sent yet, in the order they go: (key, message).
    pending: VecDeque<(u32, usize)>,
    /// Messages out and unanswered, over all callers' requests (a check's are
    /// not counted: [`Active::windowed`]).
    outstanding: usize,
    /// To transmit at the next [`RowTransport::poll_transmit`].
    queue: Vec<(u32, usize)>,
    /// Catch-up messages to transmit then (a lane's ROW_PULL or empty
    /// round, [`CatchUp`]): (key, entry).
    catch_up_queue: Vec<(u32, u32)>,
    /// Their datagrams with their entries, made at each send.
    catch_up_out: Vec<(u32, Vec<u8>)>,
    finished: VecDeque<RowFinished<D>>,
    /// The last accepted answer, or when work started after an idle spell.
    last_progress: Instant,
    /// Per table key, its pulls so far.
    pulls: HashMap<u32, u32>,
    /// Per table key, the id lists registered for key caching.
    id_lists: HashMap<u32, IdLists>,
    /// Per table key, the round of its last push that completed (ordered:
    /// checks go in key order, the simulator's runs replay exactly).
    pushed: BTreeMap<u32, u32>,
    /// In an idle spell after a push: when the idle tables are next
    /// checked, and the interval to the one after
    /// ([`IDLE_CHECK_FIRST`]); `None` while a caller's request is in
    /// flight, or before any push completed.
    idle_check: Option<(Instant, Duration)>,
    /// The silence (its start, `last_progress`) in which this transport's
    /// own stall last checked its idle tables: once per silence.
    stall_checked: Option<Instant>,
    /// When a silence last asked control for the epoch (a replicated
    /// job): asked again at most every `EPOCH_ASK_GAP`.
    epoch_asked: Option<Instant>,
    /// Messages were resent on the timer in the silence going on now.
    resent_in_silence: bool,
    /// The last silence in which messages were resent on the timer, its
    /// length once an answer ended it: the least a spurious resend's
    /// loss timer must outlast ([`Rto::spurious`]).
    resend_silence: Duration,
    /// The datagram bytes of the last request that ended (at most
    /// [`SPARE_BYTES_MAX`] of room), for the next one's messages: a
    /// step's are written into memory in the cache, without growing a
    /// new vector from empty (each growth a copy; a fresh allocation's
    /// pages faulted in and zeroed).
    spare: Vec<u8>,
}

/// The most room [`RowTransport`]'s spare datagram buffer keeps.
const SPARE_BYTES_MAX: usize = 8 << 20;

/// A table's id lists registered for key caching (PROTOCOL.md §10.7):
/// which slot of this rank's cache on each lcore holds which list, and
/// whether that lcore has answered a message that stored it.
#[derive(Debug, Default)]
struct IdLists {
    /// (entry, signature) to its slot.
    by_sig: HashMap<(u32, u64), Listed>,
    /// Per entry, the slots not in use (the lowest popped first).
    free: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, Copy)]
struct Listed {
    slot: u32,
    /// The lcore answered a message that stored it: later messages name
    /// it (KEYS_CACHED) instead of storing it (KEYS_STORE).
    stored: bool,
    /// Registrations that hold it ([`RowTransport::cache_ids`]).
    users: u32,
}

impl<D> RowTransport<D> {
    /// A row transport for `info`'s job, whose lcores (entries, §10.1)
    /// are at `lcores`, serving `tables`, with at most `window` messages
    /// outstanding (see the module's invariants) and `config`'s timers.
    pub(crate) fn new(
        info: JobInfo,
        lcores: Vec<SocketAddr>,
        tables: Vec<TableInfo>,
        window: usize,
        config: &WorkerConfig,
        stats: Arc<Counters>,
        now: Instant,
    ) -> RowTransport<D> {
        for t in &tables {
            assert_eq!(
                t.placement.lcores() as usize,
                lcores.len(),
                "table {:?} placed over {} lcores, the job has {}",
                t.name,
                t.placement.lcores(),
                lcores.len()
            );
            assert!(
                t.per >= 1 && t.dim >= 1,
                "table {:?}: R = {}, D = {}",
                t.name,
                t.per,
                t.dim
            );
        }
        let entry_of = (0u32..).zip(&lcores).map(|(e, a)| (*a, e)).collect();
        RowTransport {
            info,
            dests: lcores.clone(),
            lcores,
            entry_of,
            routing: None,
            epoch_wanted: None,
            tables,
            timeout: config.timeout,
            window: window.max(1),
            rto: Rto::new(config),
            stats,
            active: BTreeMap::new(),
            pending: VecDeque::new(),
            outstanding: 0,
            queue: Vec::new(),
            catch_up_queue: Vec::new(),
            catch_up_out: Vec::new(),
            finished: VecDeque::new(),
            last_progress: now,
            pulls: HashMap::new(),
            id_lists: HashMap::new(),
            pushed: BTreeMap::new(),
            idle_check: None,
            stall_checked: None,
            epoch_asked: None,
            resent_in_silence: false,
            resend_silence: Duration::ZERO,
            spare: Vec::new(),
        }
    }

    /// Registers id lists of table `key` for key caching (PROTOCOL.md
    /// §10.7): each (entry, signature) of `lists` gets a slot of this
    /// rank's cache on that lcore (a list registered already is counted
    /// once more). Refused, changing nothing, when the table caches no
    /// lists or an lcore has too few slots free.
    pub(crate) fn cache_ids(&mut self, key: u32, lists: &[(u32, u64)]) -> Result<(), WorkerError> {
        let Some(t) = self.table(key) else {
            return Err(unknown_table(key, &self.tables));
        };
        let (name, slots, lcores) = (t.name.clone(), t.key_cache, self.lcores.len());
        if slots == 0 {
            return Err(WorkerError::Rows {
                table: name,
                message:
                    "its spec has key_cache = 0: no id lists are kept; set key_cache (lists per rank and \
                          lcore) in the table's spec to cache ids (PROTOCOL.md §10.7)"
                        .into(),
            });
        }
        let reg = self.id_lists.entry(key).or_insert_with(|| IdLists {
            by_sig: HashMap::new(),
            free: vec![(0..slots).rev().collect(); lcores],
        });
        let mut need = vec![0usize; lcores];
        for l in lists {
            if !reg.by_sig.contains_key(l) {
                need[l.0 as usize] += 1;
            }
        }
        if let Some(e) = (0..lcores).find(|&e| need[e] > reg.free[e].len()) {
            return Err(WorkerError::Rows {
                table: name,
                message: format!(
                    "these ids need {} more cached lists on lcore {e}, which has {} of its key_cache = {slots} \
                     free: register fewer ids, uncache_ids some, or raise key_cache in the spec",
                    need[e],
                    reg.free[e].len()
                ),
            });
        }
        for &(entry, sig) in lists {
            let free = &mut reg.free[entry as usize];
            reg.by_sig
                .entry((entry, sig))
                .and_modify(|l| l.users += 1)
                .or_insert_with(|| Listed {
                    slot: free.pop().expect("counted free above"),
                    stored: false,
                    users: 1,
                });
        }
        Ok(())
    }

    /// Forgets one registration of each list of `lists` ([`Self::cache_ids`]);
    /// a list none holds any more gives its slot back. Messages already
    /// made keep their form: should the slot be taken again meanwhile,
    /// their lcore refuses them `unknown_signature` and they go again
    /// with their ids.
    pub(crate) fn uncache_ids(&mut self, key: u32, lists: &[(u32, u64)]) {
        let Some(reg) = self.id_lists.get_mut(&key) else {
            return;
        };
        for l in lists {
            if let Some(listed) = reg.by_sig.get_mut(l) {
                listed.users -= 1;
                if listed.users == 0 {
                    reg.free[l.0 as usize].push(listed.slot);
                    reg.by_sig.remove(l);
                }
            }
        }
    }

    /// The key-cache form of a message of table `key` to `entry` with
    /// `ids`: KEYS_CACHED if the list is registered and its lcore has
    /// stored it, KEYS_STORE if registered only, else none.
    fn form(&self, key: u32, entry: u32, ids: &[u64]) -> KeyCache {
        let Some(reg) = self.id_lists.get(&key).filter(|r| !r.by_sig.is_empty()) else {
            return KeyCache::Off;
        };
        if ids.is_empty() {
            return KeyCache::Off;
        }
        let sig = ids_signature(ids.iter().copied());
        match reg.by_sig.get(&(entry, sig)) {
            Some(l) if l.stored => KeyCache::Cached(CacheRef { sig, slot: l.slot }),
            Some(l) => KeyCache::Store(CacheRef { sig, slot: l.slot }),
            None => KeyCache::Off,
        }
    }

    /// The table of key index `key`, if it is one of the job's tables.
    pub(crate) fn table(&self, key: u32) -> Option<&TableInfo> {
        self.tables.iter().find(|t| t.key == key)
    }

    /// Whether a caller's requests are in flight (a check of an idle
    /// table, [`RowTransport::check_idle_tables`], is no one's).
    pub(crate) fn busy(&self) -> bool {
        self.active.values().any(|a| a.done.is_some())
    }

    /// Whether any request is in flight, a check's too: its timers run.
    fn working(&self) -> bool {
        !self.active.is_empty()
    }

    /// Messages sent and not answered.
    #[cfg(test)]
    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Takes a request at `now`; its messages go with the following
    /// [`RowTransport::poll_transmit`]s. One for a table that has one in
    /// flight fails with [`WorkerError::Busy`]; a pull of no ids is done at
    /// once.
    pub(crate) fn submit(&mut self, now: Instant, r: RowRequest<D>) {
        let RowRequest { plan, done } = r;
        let key = plan.key;
        let Some(table) = self.table(key) else {
            let err = unknown_table(key, &self.tables);
            self.finished.push_back(RowFinished {
                key,
                done,
                result: Err(err),
            });
            return;
        };
        assert_eq!(plan.dim, table.dim, "a plan for table {key} with another dim");
        // A check of the idle table gives way to the caller's request.
        if self.active.get(&key).is_some_and(|a| a.done.is_none()) {
            self.drop_request(key);
        }
        self.idle_check = None;
        self.start(now, plan, Some(done));
    }

    /// Starts `plan`'s request at `now` (`done`: `None` for a check of an
    /// idle table, [`RowTransport::check_idle_tables`]).
    fn start(&mut self, now: Instant, plan: RowPlan, done: Option<D>) {
        let key = plan.key;
        let push = matches!(plan.kind, PlanKind::Push { .. });
        if self.active.contains_key(&key) {
            if let Some(done) = done {
                self.finished.push_back(RowFinished {
                    key,
                    done,
                    result: Err(WorkerError::Busy { key }),
                });
            }
            return;
        }
        if !self.working() {
            // Idle time does not count towards the timeout.
            self.last_progress = now;
        }
        let (round, tag) = match plan.kind {
            PlanKind::Push { round } => (round, 0),
            PlanKind::Pull => {
                let g = self.pulls.entry(key).or_insert(0);
                *g = g.wrapping_add(1);
                (0, PULL_TAG | ((*g & GEN_MASK) << GEN_SHIFT))
            }
        };
        let spare = std::mem::take(&mut self.spare);
        let (bytes, spans, forms) = self.encode(&plan, round, tag, spare);
        let n = plan.msgs.len();
        let a = Active {
            rows: vec![0f32; plan.ids.len() * plan.dim as usize],
            round,
            tag,
            bytes,
            spans,
            forms,
            states: vec![MsgState::Pending; n],
            remaining: n,
            min_round: u32::MAX,
            max_round: 0,
            catch_up: BTreeMap::new(),
            push,
            plan,
            done,
        };
        let windowed = a.windowed();
        self.active.insert(key, a);
        if windowed {
            self.pending.extend((0..n).map(|i| (key, i)));
        } else {
            // A check goes first, past the window (`fill_window`).
            for i in (0..n).rev() {
                self.pending.push_front((key, i));
            }
        }
        if n == 0 {
            self.complete(key);
        }
    }

    /// Every message of `plan` as a datagram, each in the key-cache form
    /// [`Self::form`] gives it, written into `bytes` (cleared first).
    fn encode(
        &self,
        plan: &RowPlan,
        round: u32,
        tag: u32,
        mut bytes: Vec<u8>,
    ) -> (Vec<u8>, Vec<Range<usize>>, Vec<KeyCache>) {
        let forms: Vec<KeyCache> = (plan.msgs.iter())
            .map(|m| self.form(plan.key, m.entry, &plan.ids[m.rows.clone()]))
            .collect();
        let reprs = || (0..plan.msgs.len()).map(|i| msg_repr(&self.info, plan, i, round, tag, forms[i]));
        bytes.clear();
        bytes.reserve(reprs().map(|r| msg_len(&r)).sum());
        let mut spans = Vec::with_capacity(plan.msgs.len());
        for (i, repr) in reprs().enumerate() {
            spans.push(write_msg(plan, i, &repr, &mut bytes));
            // A ROW_END's row range is empty (the plan's invariant).
            self.count_cached(forms[i], plan.msgs[i].rows.len());
        }
        (bytes, spans, forms)
    }

    /// Keeps `bytes`, an ended request's datagrams, for the next request
    /// ([`RowTransport::spare`]).
    fn keep_spare(&mut self, bytes: Vec<u8>) {
        if bytes.capacity() <= SPARE_BYTES_MAX && bytes.capacity() > self.spare.capacity() {
            self.spare = bytes;
        }
    }

    /// Counts what a message (or answer) of `ids` ids in `form` saved and
    /// cost against sending its ids.
    fn count_cached(&self, form: KeyCache, ids: usize) {
        match form {
            KeyCache::Off => {}
            KeyCache::Store(_) => add(&self.stats.key_cache_prefix_bytes, KEY_CACHE_PREFIX as u64),
            KeyCache::Cached(_) => {
                add(&self.stats.key_cache_prefix_bytes, KEY_CACHE_PREFIX as u64);
                add(&self.stats.key_cache_id_bytes_saved, (ids * ROW_ID_BYTES) as u64);
            }
        }
    }

    /// Appends to `out` what to send at `now`: messages resent by
    /// [`RowTransport::handle_timeout`] and first transmissions as the
    /// window allows, each in one datagram borrowed from its request.
    pub(crate) fn poll_transmit<'a>(&'a mut self, now: Instant, out: &mut Vec<Datagram<'a>>) {
        self.fill_window(now);
        self.catch_up_out.clear();
        for (key, entry) in std::mem::take(&mut self.catch_up_queue) {
            if let Some(d) = self.catch_up_datagram(key, entry) {
                self.catch_up_out.push((entry, d));
            }
        }
        if let Some(epoch) = self.routing.as_ref().map(|r| r.epoch().epoch) {
            // A replicated job's messages name their entry and the epoch
            // they are routed by (PROTOCOL.md §11.9).
            for (e, d) in &mut self.catch_up_out {
                let mut h = wire::Header::new_unchecked(&mut d[..]);
                h.set_entry(*e);
                h.set_epoch(epoch);
            }
            for &(key, i) in &self.queue {
                if let Some(a) = self.active.get_mut(&key) {
                    let entry = a.plan.msgs[i].entry;
                    let mut h = wire::Header::new_unchecked(&mut a.bytes[a.spans[i].clone()]);
                    h.set_entry(entry);
                    h.set_epoch(epoch);
                }
            }
        }
        let (active, lcores) = (&self.active, &self.dests);
        out.extend(self.catch_up_out.iter().map(|(e, d)| Datagram {
            to: lcores[*e as usize],
            head: d,
            body: &[],
        }));
        out.extend(self.queue.drain(..).filter_map(|(key, i)| {
            let a = active.get(&key)?;
            Some(Datagram {
                to: lcores[a.plan.msgs[i].entry as usize],
                head: &a.bytes[a.spans[i].clone()],
                body: &[],
            })
        }));
    }

    fn fill_window(&mut self, now: Instant) {
        let deadline = now + self.rto.loss(0);
        while let Some(&(key, i)) = self.pending.front() {
            let Some(a) = self.active.get_mut(&key) else {
                self.pending.pop_front();
                continue;
            };
            if a.windowed() && self.outstanding >= self.window && !a.lane_started(i) {
                break;
            }
            self.pending.pop_front();
            debug_assert!(matches!(a.states[i], MsgState::Pending));
            a.states[i] = MsgState::Out(Sent::first(now, deadline));
            self.outstanding += usize::from(a.windowed());
            self.queue.push((key, i));
            add(&self.stats.row_messages_sent, 1);
        }
    }

    /// The base loss timeout now (tests).
    #[cfg(test)]
    pub(crate) fn loss_timeout(&self) -> std::time::Duration {
        self.rto.loss(0)
    }

    /// The next instant [`RowTransport::handle_timeout`] has something to
    /// do; `None` while idle.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let idle = self.idle_check.map(|(at, _)| at);
        if !self.working() {
            return idle;
        }
        let mut at = self.last_progress + self.timeout;
        if let Some(idle) = idle {
            at = at.min(idle);
        }
        // A late message waits for a silence too (`handle_timeout`).
        let quiet = self.last_progress + self.rto.loss(0);
        for a in self.active.values() {
            for s in &a.states {
                if let MsgState::Out(s) = s {
                    at = at.min(s.deadline.max(quiet));
                }
            }
            for c in a.catch_up.values() {
                at = at.min(c.sent.deadline);
            }
        }
        Some(at)
    }

    /// Runs the timers at `now`: queues every message past its deadline
    /// for sending again, and fails every request once no answer at all
    /// has come for `timeout`. Returns whether it queued messages.
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> bool {
        let checked = self.check_when_idle(now);
        let mut resent = 0;
        // No answer for a while (below: answered messages and held lanes).
        let silent = now.saturating_duration_since(self.last_progress);
        let stalled = silent >= self.rto.loss(STALL_AFTER);
        // A message is late only once its own timer expired *and* no answer
        // at all came for the base loss timeout (as the dense transport's
        // chunks, RFC 6298 5.3): while answers stream in, an lcore applying
        // a large lane (thousands of rows on a shared core) answers it after
        // its timer, and resending it then only adds work (the resends of
        // `phub-bench sparse --local` were all spurious, BENCHMARKS.md).
        let quiet = silent >= self.rto.loss(0);
        for (&key, a) in &mut self.active {
            // Whether the request's answered messages go again with this
            // send (below).
            let mut again = false;
            for (i, s) in a.states.iter_mut().enumerate() {
                let MsgState::Out(sent) = s else {
                    continue;
                };
                if now < sent.deadline || !quiet {
                    continue;
                }
                if sent.retries == 0 {
                    add_flag(&mut a.bytes[a.spans[i].clone()], flags::RETRANSMIT);
                }
                sent.retries += 1;
                sent.deadline = now + self.rto.loss(sent.retries);
                self.queue.push((key, i));
                resent += 1;
                again |= stalled && sent.retries >= RESEND_ANSWERED_AFTER && a.push;
            }
            // A BSP lcore answers a round only once it completes, so a
            // message of a round whose other answers are in, or whose
            // other lanes are answered, has only lost its answer, or its
            // lcore was restored since from a checkpoint older than that
            // round: then the lcore takes what it is sent again as the
            // round in progress and waits for the rest of the round from
            // every rank, answered messages too, which a rank resending
            // only unanswered ones never sends (PROTOCOL.md §10.6:
            // simulator seeds 6816 and 29233). Not BSP, an lcore answers
            // each push at once, and a ROW_END unanswered while the
            // clock's pushes are answered has lost its answer, or its
            // lcore was restored from a checkpoint taken before those
            // pushes came: it then waits for them (seed 839), and a copy
            // of one it took is answered, not applied again (§10.3 rule
            // 1). They go again with the
            // request's resends from the second on, once no answer at all
            // has come for a while (so that a message lost twice while
            // others are answered costs its own resends only); a copy the
            // lcore already took is a duplicate, one of a completed round
            // is answered again and ignored here.
            if again {
                for (i, st) in a.states.iter().enumerate() {
                    if matches!(st, MsgState::Answered) {
                        add_flag(&mut a.bytes[a.spans[i].clone()], flags::RETRANSMIT);
                        self.queue.push((key, i));
                        resent += 1;
                    }
                }
            }
            for (&entry, c) in &mut a.catch_up {
                if now >= c.sent.deadline {
                    c.sent.retries += 1;
                    c.sent.deadline = now + self.rto.loss(c.sent.retries);
                    self.catch_up_queue.push((key, entry));
                    resent += 1;
                }
            }
        }
        add(&self.stats.row_retransmits, resent);
        self.resent_in_silence |= resent > 0;
        let probed = if stalled { self.probe_held_lanes(now) } else { 0 };
        // A replicated job's silence asks control whether the epoch held
        // is still current (an appliance serving some entry may be down),
        // and asks again at most every EPOCH_ASK_GAP while it lasts: an
        // appliance that dies during a silence is declared down after the
        // first ask (simulator seed 13287: the rank asked once, was told
        // the epoch it held, and waited on a dead appliance for 30 s).
        if stalled
            && self
                .epoch_asked
                .is_none_or(|t| now.saturating_duration_since(t) >= super::EPOCH_ASK_GAP)
        {
            if let Some(r) = &self.routing {
                self.epoch_asked = Some(now);
                self.epoch_wanted = self.epoch_wanted.max(Some(r.epoch().epoch));
            }
        }
        // Stalled on one table, the rank checks the others, once a silence:
        // a restored lcore may wait on this rank for a table it has every
        // answer of, while the ranks it waits on wait on that table
        // (PROTOCOL.md §10.6; simulator seed 789173: rank 0 waited on
        // table 0, whose round the restored lcore held for ranks 1 and 2,
        // which waited on table 1, whose round it held for rank 0).
        let mut checked = checked;
        if stalled && self.stall_checked != Some(self.last_progress) {
            self.stall_checked = Some(self.last_progress);
            checked |= self.check_idle_tables(now);
        }
        if self.working() && now.saturating_duration_since(self.last_progress) >= self.timeout {
            self.time_out(now);
        }
        checked || resent > 0 || probed > 0
    }

    /// In an idle spell, its next check of the idle tables, if due
    /// ([`IDLE_CHECK_FIRST`]); returns whether it ran.
    fn check_when_idle(&mut self, now: Instant) -> bool {
        let Some((at, step)) = self.idle_check else {
            return false;
        };
        if now < at || self.busy() {
            return false;
        }
        let step = (step * 2).min((self.timeout / 4).max(IDLE_CHECK_FIRST));
        self.idle_check = Some((now + step, step));
        self.check_idle_tables(now);
        true
    }

    /// A caller's request ended: with no other in flight, an idle spell
    /// begins at the last answer, and its idle tables are checked from
    /// [`IDLE_CHECK_FIRST`] into it on.
    fn caller_ended(&mut self) {
        if self.idle_check.is_none() && !self.busy() && !self.pushed.is_empty() {
            self.idle_check = Some((self.last_progress + IDLE_CHECK_FIRST, IDLE_CHECK_FIRST));
        }
    }

    /// No answer for a while: every lane of a push of round t ≥ 2 still
    /// held behind the window asks its lcore where the table stands, as
    /// after `ahead` ([`CatchUp`]): one restored behind is brought up,
    /// one at round t − 1 gets the lane at once. An lcore restored from a
    /// checkpoint older than a round it completed waits for the empty
    /// round of every rank that moved on, and such a rank learns it only
    /// from a message of its next round there: held behind a window full
    /// of lanes that wait on the ranks that wait on that lcore, it sent
    /// none (simulator seed 35557: table key 4's round 1 on the restored
    /// lcore waited for four ranks whose windows were full of key 3's
    /// round 2, which waited for the fifth, whose key 4 round 1 waited on
    /// that lcore). Returns the lanes asked.
    fn probe_held_lanes(&mut self, now: Instant) -> u64 {
        let held: Vec<(u32, usize)> = self
            .pending
            .iter()
            .copied()
            .filter(|&(key, i)| {
                self.active.get(&key).is_some_and(|a| {
                    matches!(a.plan.kind, PlanKind::Push { round } if round >= 2)
                        && a.plan.lanes[a.plan.msgs[i].entry as usize].first == i
                })
            })
            .collect();
        let mut asked = 0;
        for (key, i) in held {
            if self.start_catch_up(now, key, i) {
                asked += 1;
            }
        }
        add(&self.stats.row_lanes_probed, asked);
        asked
    }

    /// The next request that ended, if any.
    pub(crate) fn poll_done(&mut self) -> Option<RowFinished<D>> {
        self.finished.pop_front()
    }

    /// Fails every request with [`WorkerError::Closed`]; no idle table is
    /// checked until a caller's next push ends.
    pub(crate) fn close(&mut self) {
        let keys: Vec<u32> = self.active.keys().copied().collect();
        for key in keys {
            self.fail(key, WorkerError::Closed);
        }
        self.idle_check = None;
    }

    /// Handles a datagram from `from` received at `now`, if it is the row
    /// transport's: a table answer (types 11 to 13, or any row type, which
    /// is counted and dropped when it is not an answer of this job), or an
    /// ERROR of this job and rank about one of its tables. Returns false
    /// for anything else, which is the dense transport's; an ERROR
    /// `shutting_down` fails every table request and is the dense
    /// transport's too.
    pub(crate) fn handle(&mut self, now: Instant, from: SocketAddr, d: &[u8]) -> bool {
        if rows::is_row_message(d) {
            self.on_row_message(now, from, d);
            return true;
        }
        let Ok((repr, _)) = wire::parse(d) else {
            return false;
        };
        let info = &self.info;
        if repr.kind != MsgType::Error
            || repr.job != info.job
            || repr.token != info.token
            || repr.dtype != info.dtype
            || repr.rank != info.rank
        {
            return false;
        }
        if repr.error == DropReason::ShuttingDown.code() {
            self.appliance_stopping(&repr);
            return false;
        }
        if self.table(repr.key).is_none() {
            return false;
        }
        let Some(entry) = self.entry_for(from, d) else {
            // Not from one of the job's lcores: a table's ERROR, not ours.
            add(&self.stats.row_answers_ignored, 1);
            return true;
        };
        if repr.error == DropReason::WrongEpoch.code() {
            // Never a failure (PROTOCOL.md §11.9): a newer epoch is
            // fetched, and the message goes on being resent on its timer
            // until the epoch changes; an older one says the lcore has
            // not taken the epoch yet.
            if let Some(r) = &self.routing {
                let named = wire::Header::new_unchecked(d).epoch();
                if named > r.epoch().epoch {
                    self.epoch_wanted = self.epoch_wanted.max(Some(named));
                }
            }
            add(&self.stats.row_answers_ignored, 1);
            return true;
        }
        if let Some(r) = &self.routing {
            if self.dests.get(entry as usize) != Some(&from) {
                // A replicated job's message is refused only by where the
                // epoch held sends its entry: an appliance a drain took
                // the job off answers a copy sent there before the epoch
                // changed `evicted` (PROTOCOL.md §11.8), which ends
                // nothing.
                add(&self.stats.row_answers_ignored, 1);
                return true;
            }
            if repr.error == DropReason::Evicted.code() {
                // Where the epoch held sends it, the job is gone: a newer
                // epoch has it elsewhere, or control evicted it and says
                // so; its answer re-routes or ends it.
                let newer = r.epoch().epoch + 1;
                self.epoch_wanted = self.epoch_wanted.max(Some(newer));
                add(&self.stats.row_answers_ignored, 1);
                return true;
            }
        }
        self.on_error(now, from, entry, &repr);
        true
    }

    /// The entry a table answer or ERROR from `from` is for: its lcore's
    /// (the address a message went to), or, in a replicated job, the
    /// header's `entry` (an lcore may serve an adopted entry beside its
    /// own, PROTOCOL.md §11.9) from any of the job's lcores or from where
    /// the entry is sent now.
    fn entry_for(&self, from: SocketAddr, d: &[u8]) -> Option<u32> {
        let own = self.entry_of.get(&from).copied();
        if self.routing.is_none() {
            return own;
        }
        // A replicated job: the header's entry, from one of the job's
        // lcores, or from where the epoch held sends that entry (an
        // index moved to another appliance by a drain answers from its
        // new addresses, PROTOCOL.md §11.8).
        let e = wire::Header::new_checked(d).ok()?.entry();
        let to = self.dests.get(usize::try_from(e).ok()?)?;
        (own.is_some() || *to == from).then_some(e)
    }

    /// Where each entry is served by the routing's epoch (a replicated
    /// job; an entry no live appliance holds stays at its lcore), into
    /// [`RowTransport::dests`].
    fn route_entries(&mut self) {
        let Some(r) = &self.routing else { return };
        for (e, (to, own)) in (0u32..).zip(self.dests.iter_mut().zip(&self.lcores)) {
            *to = r.entry_to(e).unwrap_or(*own);
        }
    }

    /// Routes every entry by `routing`'s epoch from now on (a replicated
    /// job). Set before the first request.
    pub(crate) fn set_routing(&mut self, routing: Routing) {
        self.routing = Some(routing);
        self.route_entries();
    }

    /// The epoch the caller is to fetch from control, at least (taken):
    /// an ERROR `wrong_epoch` named it, or a silence asks whether the one
    /// held is still current.
    pub(crate) fn poll_epoch(&mut self) -> Option<u32> {
        self.epoch_wanted.take()
    }

    /// Control says the job is in `view`: a newer epoch is held from now
    /// on, and every message sent and still unanswered goes again at once
    /// to where it serves the message's entry, with the new epoch (the
    /// lcore that adopted an entry has none of them). Returns how many.
    pub(crate) fn set_epoch(&mut self, now: Instant, view: EpochView) -> usize {
        let Some(r) = self.routing.as_mut() else {
            return 0;
        };
        if view.epoch <= r.epoch().epoch {
            return 0;
        }
        r.set_epoch(view);
        self.route_entries();
        let deadline = now + self.rto.loss(0);
        let mut sent = 0;
        for (&key, a) in &mut self.active {
            for (i, st) in a.states.iter_mut().enumerate() {
                if let MsgState::Out(out) = st {
                    *out = Sent::first(now, deadline);
                    self.queue.push((key, i));
                    sent += 1;
                }
            }
            for (&entry, c) in &mut a.catch_up {
                c.sent.deadline = now;
                self.catch_up_queue.push((key, entry));
            }
        }
        add(&self.stats.row_retransmits, sent as u64);
        self.last_progress = now;
        sent
    }

    fn on_row_message(&mut self, now: Instant, from: SocketAddr, d: &[u8]) {
        let Ok((repr, payload)) = rows::parse(d) else {
            add(&self.stats.row_answers_malformed, 1);
            return;
        };
        let info = &self.info;
        if repr.job != info.job
            || repr.token != info.token
            || repr.dtype != info.dtype
            || repr.rank != APPLIANCE_RANK
            || repr.kind.from_worker()
        {
            add(&self.stats.foreign_dropped, 1);
            return;
        }
        let Some(entry) = self.entry_for(from, d) else {
            add(&self.stats.foreign_dropped, 1);
            return;
        };
        let dim_ok = self.table(repr.key).is_some_and(|t| t.dim == repr.dim);
        if !dim_ok {
            add(&self.stats.row_answers_malformed, 1);
            return;
        }
        if self.caught_up(now, entry, &repr) {
            return;
        }
        let verdict = match self.active.get_mut(&repr.key) {
            None => Verdict::Ignored,
            Some(a) => {
                let answer = match payload {
                    RowPayload::Rows(r) => Some(Answer::Ids(r)),
                    RowPayload::Cached(values) => repr.cache.reference().map(|c| Answer::Cached(c, values)),
                    _ => None,
                };
                match (repr.kind, answer) {
                    (RowMsgType::RowResult, Some(r)) => on_result(a, entry, &repr, r),
                    (RowMsgType::RowPullResult, Some(r)) => on_pull_result(a, entry, &repr, r),
                    (RowMsgType::RowDone, _) => on_done(a, entry, &repr),
                    _ => Verdict::Malformed,
                }
            }
        };
        match verdict {
            Verdict::Ignored => add(&self.stats.row_answers_ignored, 1),
            Verdict::Malformed => add(&self.stats.row_answers_malformed, 1),
            Verdict::Answers(i) => {
                if let KeyCache::Cached(c) = repr.cache {
                    self.count_cached(repr.cache, usize::from(repr.count));
                    self.list_stored(repr.key, entry, c);
                }
                self.answered(now, repr.key, i, rows::answers_first_copy(&repr));
            }
        }
    }

    /// An answer in the cached form (PROTOCOL.md §10.7) shows that its
    /// lcore keeps the list `c` names: later messages name it.
    fn list_stored(&mut self, key: u32, entry: u32, c: CacheRef) {
        let listed = self
            .id_lists
            .get_mut(&key)
            .and_then(|r| r.by_sig.get_mut(&(entry, c.sig)));
        if let Some(l) = listed.filter(|l| l.slot == c.slot) {
            l.stored = true;
        }
    }

    /// An ERROR `unknown_signature` for message `i` of `key`'s request,
    /// which named a cached list: its lcore no longer keeps it (restarted,
    /// or the slot was taken again). The list is stored again if it is
    /// still registered, and the message goes again at once with its ids
    /// (PROTOCOL.md §10.7). False when the message names no list now (the
    /// refusal of a copy of its earlier form, handled already).
    fn cache_miss(&mut self, now: Instant, key: u32, i: usize) -> bool {
        let Some(a) = self.active.get(&key) else {
            return false;
        };
        let KeyCache::Cached(c) = a.forms[i] else {
            return false;
        };
        let entry = a.plan.msgs[i].entry;
        let form = match self
            .id_lists
            .get_mut(&key)
            .and_then(|r| r.by_sig.get_mut(&(entry, c.sig)))
        {
            Some(l) => {
                l.stored = false;
                KeyCache::Store(CacheRef {
                    sig: c.sig,
                    slot: l.slot,
                })
            }
            None => KeyCache::Off,
        };
        let Some(a) = self.active.get_mut(&key) else {
            return false;
        };
        let repr = msg_repr(&self.info, &a.plan, i, a.round, a.tag, form);
        let span = write_msg(&a.plan, i, &repr, &mut a.bytes);
        add_flag(&mut a.bytes[span.clone()], flags::RETRANSMIT);
        a.spans[i] = span;
        a.forms[i] = form;
        if let MsgState::Out(sent) = &mut a.states[i] {
            sent.retries += 1;
            sent.deadline = now + self.rto.loss(sent.retries);
        }
        self.queue.push((key, i));
        add(&self.stats.key_cache_misses, 1);
        true
    }

    /// Message `i` of `key`'s request is answered (its rows, if any, are
    /// written); `first_copy`: the answer says it answers the message's
    /// first copy (FIRST_COPY).
    fn answered(&mut self, now: Instant, key: u32, i: usize, first_copy: bool) {
        let Some(a) = self.active.get_mut(&key) else {
            return;
        };
        let MsgState::Out(sent) = std::mem::replace(&mut a.states[i], MsgState::Answered) else {
            unreachable!("only an outstanding message is answered");
        };
        if std::mem::take(&mut self.resent_in_silence) {
            self.resend_silence = now.saturating_duration_since(self.last_progress);
        }
        if sent.retries == 0 {
            self.rto.sample(now.saturating_duration_since(sent.first_sent));
            let srtt = micros(self.rto.srtt.unwrap_or_default());
            self.stats.srtt_us.store(srtt, Ordering::Relaxed);
        } else if first_copy {
            // Resent, but its first copy was answered: the silence that
            // set the resend off was the lcore's, not a loss
            // (PROTOCOL.md §10.3, "Loss timer").
            add(&self.stats.row_resends_spurious, 1);
            self.rto.spurious(self.resend_silence, now);
        }
        self.rto.decay(now);
        debug_assert!(a.remaining > 0 && (self.outstanding > 0 || !a.windowed()));
        a.remaining -= 1;
        self.outstanding -= usize::from(a.windowed());
        self.last_progress = now;
        add(&self.stats.row_answers_accepted, 1);
        if a.remaining == 0 {
            self.complete(key);
        }
    }

    /// The message of the request in flight that an ERROR from entry
    /// `entry` refuses, if it is one still out (or answered and sent
    /// again, below).
    fn refused_message(&self, entry: u32, repr: &wire::Repr) -> Option<usize> {
        let a = self.active.get(&repr.key)?;
        let i = if repr.chunk & PULL_TAG != 0 {
            if a.plan.kind != PlanKind::Pull || repr.chunk & !INDEX_MASK != a.tag {
                return None;
            }
            a.plan.msg_index(entry, repr.chunk & INDEX_MASK)?
        } else {
            if a.plan.kind == PlanKind::Pull || repr.round != a.round {
                return None;
            }
            a.plan.msg_index(entry, repr.chunk)?
        };
        // An answered message sent again (`handle_timeout`) to a
        // restored lcore is refused as an unanswered one would be:
        // `ahead` where the lcore lost rounds before it (its catching
        // up starts: the rank may have nothing else to send there,
        // simulator seed 102435), `unknown_signature` where it lost
        // the id lists this rank stored there (it goes again with its
        // ids).
        let resent = matches!(a.states[i], MsgState::Answered)
            && (repr.error == DropReason::UnknownSignature.code() || repr.error == DropReason::Ahead.code());
        (matches!(a.states[i], MsgState::Out(_)) || resent).then_some(i)
    }

    fn on_error(&mut self, now: Instant, from: SocketAddr, entry: u32, repr: &wire::Repr) {
        if self.catch_up_refused(now, from, entry, repr) {
            return;
        }
        let at = self.refused_message(entry, repr);
        let Some(i) = at else {
            add(&self.stats.row_answers_ignored, 1);
            return;
        };
        if repr.error == DropReason::UnknownSignature.code() {
            // A refusal of a copy of the message's earlier form when it
            // names no list now: handled already.
            let handled = self.cache_miss(now, repr.key, i);
            add(
                if handled {
                    &self.stats.errors
                } else {
                    &self.stats.row_answers_ignored
                },
                1,
            );
            return;
        }
        add(&self.stats.errors, 1);
        if repr.error == DropReason::Ahead.code() && self.start_catch_up(now, repr.key, i) {
            return;
        }
        let a = &self.active[&repr.key];
        let m = &a.plan.msgs[i];
        let message = match m.kind {
            RowMsgType::RowPull => format!("ROW_PULL of {} ids to {from}", m.rows.len()),
            RowMsgType::RowEnd => format!("ROW_END (n = {}) to {from}", m.seq),
            k => format!("{} {} of {} rows to {from}", k.name(), m.seq, m.rows.len()),
        };
        let (reason, hint) = describe_row(repr.error);
        let err = WorkerError::TableRefused {
            table: self.table_name(repr.key),
            key: repr.key,
            message,
            round: repr.round,
            reason,
            hint,
        };
        self.fail(repr.key, err);
    }

    /// An ERROR `shutting_down`: every table request fails with it.
    fn appliance_stopping(&mut self, repr: &wire::Repr) {
        let (reason, hint) = describe(repr.error);
        let keys: Vec<u32> = self.active.keys().copied().collect();
        if !keys.is_empty() {
            add(&self.stats.errors, 1);
        }
        for key in keys {
            let a = &self.active[&key];
            let err = WorkerError::TableRefused {
                table: self.table_name(key),
                key,
                message: "every message in flight".to_string(),
                round: a.round,
                reason: reason.clone(),
                hint,
            };
            self.fail(key, err);
        }
    }

    /// Message `i` of `key`'s request, a ROW_PUSH or ROW_END of round
    /// t ≥ 2, was refused `ahead`: its lcore was restored from an older
    /// checkpoint (PROTOCOL.md §10.6). Parks that lcore's messages of the
    /// request (those answered too: the restored lcore lost them) and asks
    /// the lcore where the table stands there. False when the refusal
    /// cannot be a restore's (round 1, a pull): the request fails.
    fn start_catch_up(&mut self, now: Instant, key: u32, i: usize) -> bool {
        let Some(a) = self.active.get(&key) else {
            return false;
        };
        let entry = a.plan.msgs[i].entry;
        let round = match a.plan.kind {
            PlanKind::Push { round } if round >= 2 => round,
            _ => return false,
        };
        let Some(id) = self.table(key).and_then(|t| id_on(t, entry)) else {
            return false;
        };
        let rto = self.rto.loss(0);
        let a = self.active.get_mut(&key).expect("looked up above");
        let lane = a.plan.lanes[entry as usize];
        let span = lane.first..lane.first + lane.n as usize + 1;
        for j in span.clone() {
            match a.states[j] {
                MsgState::Out(_) => self.outstanding -= usize::from(a.windowed()),
                MsgState::Answered => a.remaining += 1,
                MsgState::Pending | MsgState::Parked => {}
            }
            a.states[j] = MsgState::Parked;
        }
        self.pending.retain(|&(k, j)| k != key || !span.contains(&j));
        self.queue.retain(|&(k, j)| k != key || !span.contains(&j));
        a.catch_up.insert(
            entry,
            CatchUp {
                round: None,
                sent: Sent::first(now, now + rto),
                id,
            },
        );
        debug_assert!(round >= 2);
        self.catch_up_queue.push((key, entry));
        true
    }

    /// An answer to a lane's catch-up message ([`CatchUp`]): the ROW_PULL's
    /// (the lcore's round c: its empty rounds start at c + 1) or an empty
    /// round's ROW_DONE (of any count: a held one is released with the
    /// count the lcore kept). Once the lcore stands at the push's round,
    /// the lane's messages go again. True when `repr` was one.
    fn caught_up(&mut self, now: Instant, entry: u32, repr: &RowRepr) -> bool {
        let Some(a) = self.active.get_mut(&repr.key) else {
            return false;
        };
        let PlanKind::Push { round } = a.plan.kind else {
            return false;
        };
        let Some(c) = a.catch_up.get_mut(&entry) else {
            return false;
        };
        let next = match (c.round, repr.kind) {
            (None, RowMsgType::RowPullResult) if repr.seq == CATCH_UP_TAG => repr.round.saturating_add(1),
            (Some(u), RowMsgType::RowDone) if repr.round == u => u + 1,
            _ => return false,
        };
        add(&self.stats.row_answers_accepted, 1);
        self.last_progress = now;
        if next < round {
            c.round = Some(next);
            c.sent = Sent::first(now, now + self.rto.loss(0));
            add(&self.stats.row_rounds_caught_up, 1);
            self.catch_up_queue.push((repr.key, entry));
            return true;
        }
        // The lcore stands at the push's round: the lane goes again at
        // once, whole, past the window, as a lane already started does
        // (`fill_window`). It was out before it was parked, and the lcore
        // now waits for it while this rank's other lanes may wait there for
        // ranks that wait on this lcore: held behind the window, two ranks
        // each with a window full of lanes the other's parked lane
        // completes waited for ever (simulator seed 10066).
        a.catch_up.remove(&entry);
        let lane = a.plan.lanes[entry as usize];
        let deadline = now + self.rto.loss(0);
        for j in lane.first..=lane.first + lane.n as usize {
            a.states[j] = MsgState::Out(Sent::first(now, deadline));
            self.outstanding += usize::from(a.windowed());
            self.queue.push((repr.key, j));
        }
        add(&self.stats.row_messages_sent, u64::from(lane.n) + 1);
        true
    }

    /// An ERROR refusing a lane's catch-up message at `now`: an empty
    /// round refused `ahead` asks again where the lcore stands; any other
    /// refusal fails the request with it (the lcore cannot be brought up
    /// to the push's round). True when `repr` was one.
    ///
    /// An ERROR names the message it refuses by round and `chunk` only,
    /// and the empty round u's (n = 0) is that of the push's message 0 of
    /// round u: a refusal that only a message with a key-cache prefix can
    /// get (`unknown_signature`, `bad_signature`) is that push's, sent
    /// before the catching up began and held in the network, never the
    /// empty round's, which carries none (simulator seed 1082260: the
    /// push failed on it, the lcore restored without this rank's lists).
    fn catch_up_refused(&mut self, now: Instant, from: SocketAddr, entry: u32, repr: &wire::Repr) -> bool {
        let for_a_prefix = repr.error == DropReason::UnknownSignature.code()
            || repr.error == DropReason::BadSignature.code();
        let Some(c) = self.active.get(&repr.key).and_then(|a| a.catch_up.get(&entry)) else {
            return false;
        };
        let message = match c.round {
            None if repr.chunk == CATCH_UP_TAG => {
                format!("ROW_PULL of id {} to {from}, asking its round", c.id)
            }
            Some(u) if repr.round == u && repr.chunk == 0 && !for_a_prefix => {
                if repr.error == DropReason::Ahead.code() {
                    // The empty round u is ahead: the lcore stands below
                    // u − 1, and an answer that moved the catching up on
                    // was an old one (a ROW_DONE sent before the restore,
                    // held in the network: simulator seed 637579). Ask
                    // again where it stands.
                    let deadline = now + self.rto.loss(0);
                    if let Some(c) = self
                        .active
                        .get_mut(&repr.key)
                        .and_then(|a| a.catch_up.get_mut(&entry))
                    {
                        c.round = None;
                        c.sent = Sent::first(now, deadline);
                    }
                    self.catch_up_queue.push((repr.key, entry));
                    add(&self.stats.errors, 1);
                    return true;
                }
                format!("ROW_END (n = 0) of round {u} to {from}, bringing the lcore restored behind this worker up")
            }
            _ => return false,
        };
        add(&self.stats.errors, 1);
        let (reason, hint) = describe_row(repr.error);
        let err = WorkerError::TableRefused {
            table: self.table_name(repr.key),
            key: repr.key,
            message,
            round: repr.round,
            reason,
            hint,
        };
        self.fail(repr.key, err);
        true
    }

    /// A lane's catch-up message ([`CatchUp`]) as a datagram.
    fn catch_up_datagram(&self, key: u32, entry: u32) -> Option<Vec<u8>> {
        let a = self.active.get(&key)?;
        let c = a.catch_up.get(&entry)?;
        let (kind, count, round, seq, ids) = match c.round {
            None => (RowMsgType::RowPull, 1, 0, CATCH_UP_TAG, &[c.id][..]),
            Some(u) => (RowMsgType::RowEnd, 0, u, 0, &[][..]),
        };
        let repr = RowRepr {
            kind,
            dtype: self.info.dtype,
            flags: if c.sent.retries > 0 { flags::RETRANSMIT } else { 0 },
            token: self.info.token,
            job: self.info.job,
            rank: self.info.rank,
            count,
            round,
            dim: a.plan.dim,
            key,
            seq,
            cache: KeyCache::Off,
        };
        let mut bytes = vec![0u8; HEADER_LEN + repr.payload_len()?];
        let written = rows::write(&repr, ids, &[], &mut bytes);
        debug_assert_eq!(written, bytes.len());
        add(&self.stats.row_messages_sent, u64::from(c.sent.retries == 0));
        Some(bytes)
    }

    fn table_name(&self, key: u32) -> String {
        self.table(key).map_or_else(String::new, |t| t.name.clone())
    }

    /// `key`'s request is complete: its rows go to [`RowTransport::poll_done`]
    /// in the caller's order.
    fn complete(&mut self, key: u32) {
        let Some(a) = self.active.remove(&key) else {
            return;
        };
        debug_assert_eq!(a.remaining, 0);
        let (round, highest) = match a.plan.kind {
            PlanKind::Push { round } => {
                self.pushed.insert(key, round);
                (round, round)
            }
            PlanKind::Pull if a.plan.msgs.is_empty() => (0, 0),
            PlanKind::Pull => (a.min_round, a.max_round),
        };
        self.keep_spare(a.bytes);
        if let Some(done) = a.done {
            self.finished.push_back(RowFinished {
                key,
                done,
                // The rows stay in the plan's order: the caller copies
                // each where its ids want it ([`RowOutput::write_into`]),
                // or not at all (a push without output).
                result: Ok(RowOutput {
                    round,
                    highest,
                    rows: a.rows,
                    slot_of: a.plan.slot_of,
                    dim: a.plan.dim as usize,
                }),
            });
            self.caller_ended();
        }
    }

    /// Control cannot serve the epoch a replicated job's tables need, or
    /// answered that the job failed: every request ends with `err()`, as
    /// the dense transport's do ([`super::Transport::epoch_unavailable`]),
    /// instead of waiting out its silence.
    pub(crate) fn epoch_unavailable(&mut self, err: impl Fn() -> WorkerError) {
        let keys: Vec<u32> = self.active.keys().copied().collect();
        for key in keys {
            self.fail(key, err());
        }
    }

    /// `key`'s request failed with `err`.
    fn fail(&mut self, key: u32, err: WorkerError) {
        if let Some(done) = self.drop_request(key) {
            self.finished.push_back(RowFinished {
                key,
                done,
                result: Err(err),
            });
            self.caller_ended();
        }
    }

    /// Forgets `key`'s request, what it has out and queued; returns what
    /// its caller is to get back (`None`: none, or a check's).
    fn drop_request(&mut self, key: u32) -> Option<D> {
        let a = self.active.remove(&key)?;
        let out = a.states.iter().filter(|s| matches!(s, MsgState::Out(_))).count();
        if a.windowed() {
            self.outstanding -= out;
        }
        self.pending.retain(|&(k, _)| k != key);
        self.queue.retain(|&(k, _)| k != key);
        self.catch_up_queue.retain(|&(k, _)| k != key);
        self.keep_spare(a.bytes);
        a.done
    }

    /// The rank is stalled (its dense chunks went unanswered through
    /// several backoffs, [`super::Transport::take_stall`]): each table
    /// with no request in flight whose last push completed round t ≥ 1
    /// sends every lcore an empty round t (a ROW_END with n = 0), which
    /// ends silently. An lcore that completed round t answers it again;
    /// one restored from a checkpoint taken before round t completed
    /// takes it as this rank's part of round t, or refuses it `ahead` and
    /// is caught up to it first (PROTOCOL.md §10.6). Without it, a rank
    /// that completed the round and then waited on dense keys for a rank
    /// whose push of that round waits on the restored lcore never told
    /// the lcore anything (simulator seed 293895). Returns whether it
    /// started a check.
    pub(crate) fn check_idle_tables(&mut self, now: Instant) -> bool {
        let due: Vec<(u32, u32)> = self
            .pushed
            .iter()
            .filter(|(k, &t)| t >= 1 && !self.active.contains_key(k))
            .map(|(&k, &t)| (k, t))
            .collect();
        let mut started = false;
        for (key, round) in due {
            if let Some(plan) = self.table(key).and_then(|t| plan_push(t, round, &[], &[]).ok()) {
                self.start(now, plan, None);
                started = true;
            }
        }
        started
    }

    fn time_out(&mut self, now: Instant) {
        let waited = now.saturating_duration_since(self.last_progress);
        let keys: Vec<u32> = self.active.keys().copied().collect();
        for key in keys {
            let a = &self.active[&key];
            let mut addrs: Vec<SocketAddr> = a
                .states
                .iter()
                .zip(&a.plan.msgs)
                .filter(|(s, _)| !matches!(s, MsgState::Answered))
                .map(|(_, m)| self.dests[m.entry as usize])
                .collect();
            addrs.sort();
            addrs.dedup();
            let err = WorkerError::TableTimeout {
                table: self.table_name(key),
                round: a.round,
                addrs,
                waited,
                missing: a.remaining,
                messages: a.plan.msgs.len(),
            };
            // A check of an idle table ends silently.
            if a.done.is_some() {
                add(&self.stats.timeouts, 1);
            }
            self.fail(key, err);
        }
    }
}

/// The smallest id the placement puts on `entry` (each entry gets about
/// 1 / L of the ids, so a few times L tries find one).
fn id_on(t: &TableInfo, entry: u32) -> Option<u64> {
    let tries = u64::from(t.placement.lcores()).saturating_mul(1024).max(1 << 16);
    (0..tries).find(|&id| t.placement.entry(id) == entry)
}

/// The error for key `key`, which is none of `tables`.
pub(crate) fn unknown_table(key: u32, tables: &[TableInfo]) -> WorkerError {
    let names: Vec<String> = tables
        .iter()
        .map(|t| format!("{:?} (key {})", t.name, t.key))
        .collect();
    WorkerError::UnknownTable {
        name: format!("key {key}"),
        tables: if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        },
    }
}

/// What an answer does.
enum Verdict {
    /// It answers message i (its rows, if any, written).
    Answers(usize),
    /// A duplicate, or for a round or message not waited for.
    Ignored,
    /// Not what the message asked: another sequence number, count or ids.
    Malformed,
}

/// A ROW_RESULT for `a`.
fn on_result<D>(a: &mut Active<D>, entry: u32, repr: &RowRepr, r: Answer<'_>) -> Verdict {
    let PlanKind::Push { round } = a.plan.kind else {
        return Verdict::Ignored;
    };
    if repr.round != round {
        return Verdict::Ignored;
    }
    match a.plan.lanes.get(entry as usize) {
        Some(lane) if repr.seq < lane.n => take_rows(a, lane.first + repr.seq as usize, repr, r),
        _ => Verdict::Malformed,
    }
}

/// A ROW_PULL_RESULT for `a`.
fn on_pull_result<D>(a: &mut Active<D>, entry: u32, repr: &RowRepr, r: Answer<'_>) -> Verdict {
    if a.plan.kind != PlanKind::Pull || repr.seq & !INDEX_MASK != a.tag {
        return Verdict::Ignored;
    }
    let Some(i) = a.plan.msg_index(entry, repr.seq & INDEX_MASK) else {
        return Verdict::Malformed;
    };
    let v = take_rows(a, i, repr, r);
    if matches!(v, Verdict::Answers(_)) {
        a.min_round = a.min_round.min(repr.round);
        a.max_round = a.max_round.max(repr.round);
    }
    v
}

/// A ROW_DONE for `a`.
fn on_done<D>(a: &mut Active<D>, entry: u32, repr: &RowRepr) -> Verdict {
    let PlanKind::Push { round } = a.plan.kind else {
        return Verdict::Ignored;
    };
    if repr.round != round {
        return Verdict::Ignored;
    }
    let Some(lane) = a.plan.lanes.get(entry as usize) else {
        return Verdict::Malformed;
    };
    if repr.seq != lane.n {
        return Verdict::Malformed;
    }
    let i = lane.first + lane.n as usize;
    match a.states[i] {
        MsgState::Out(_) => Verdict::Answers(i),
        _ => Verdict::Ignored,
    }
}

/// The header of message `i` of `plan` in key-cache form `form`, as rank
/// `info` sends it.
fn msg_repr(info: &JobInfo, plan: &RowPlan, i: usize, round: u32, tag: u32, form: KeyCache) -> RowRepr {
    let m = &plan.msgs[i];
    let count = m.rows.len();
    RowRepr {
        kind: m.kind,
        dtype: info.dtype,
        flags: 0,
        token: info.token,
        job: info.job,
        rank: info.rank,
        // Cast: at most R rows a message, R < 2^16 (8832 bytes).
        #[allow(clippy::cast_possible_truncation)]
        count: count as u16,
        round,
        dim: plan.dim,
        key: plan.key,
        seq: tag | m.seq,
        cache: form,
    }
}

/// A planned message's length, header included.
fn msg_len(repr: &RowRepr) -> usize {
    HEADER_LEN + repr.payload_len().expect("a planned message fits a datagram")
}

/// Appends message `i` of `plan` with header `repr` ([`msg_repr`]) to
/// `bytes`; returns where it is.
fn write_msg(plan: &RowPlan, i: usize, repr: &RowRepr, bytes: &mut Vec<u8>) -> Range<usize> {
    let m = &plan.msgs[i];
    let dim = plan.dim as usize;
    let len = msg_len(repr);
    let at = bytes.len();
    bytes.resize(at + len, 0);
    let values = match m.kind {
        RowMsgType::RowPush => &plan.grads[m.rows.start * dim..m.rows.end * dim],
        _ => &[][..],
    };
    // A ROW_END's row range is empty (the plan's invariant).
    let written = rows::write(repr, &plan.ids[m.rows.clone()], values, &mut bytes[at..]);
    debug_assert_eq!(written, len);
    at..at + len
}

/// A table answer's rows: with their ids, or in the cached form (the
/// prefix of the list the message named, and the rows' wire bytes).
enum Answer<'a> {
    Ids(Rows<'a>),
    Cached(CacheRef, &'a [u8]),
}

/// Writes `r`'s rows as message `i`'s answer, if it is still out and `r`
/// carries exactly its ids (or names the list of exactly its ids).
fn take_rows<D>(a: &mut Active<D>, i: usize, repr: &RowRepr, r: Answer<'_>) -> Verdict {
    if !matches!(a.states[i], MsgState::Out(_)) {
        return Verdict::Ignored;
    }
    let span = a.plan.msgs[i].rows.clone();
    let asked = &a.plan.ids[span.clone()];
    let dim = a.plan.dim as usize;
    match r {
        Answer::Ids(r) => {
            if r.len() != asked.len() || !r.ids().iter().eq(asked.iter().copied()) {
                return Verdict::Malformed;
            }
            if !r.decode_all(&mut a.rows[span.start * dim..span.end * dim]) {
                return Verdict::Malformed;
            }
        }
        Answer::Cached(c, values) => {
            // The list of the message's ids, whatever form the message is
            // in now (an answer to its stored form may come after a miss):
            // the signature its form carries, or, with none left, its ids'.
            let named = a.forms[i]
                .reference()
                .map_or_else(|| ids_signature(asked.iter().copied()), |r| r.sig);
            if usize::from(repr.count) != asked.len()
                || values.len() != asked.len() * dim * repr.dtype.size()
                || c.sig != named
            {
                return Verdict::Malformed;
            }
            // The rows are one block, as the message's ids are one run.
            phub_proto::dtype::decode(repr.dtype, values, &mut a.rows[span.start * dim..span.end * dim]);
        }
    }
    Verdict::Answers(i)
}

/// The name of an ERROR's drop reason for a table message, and a hint.
fn describe_row(code: u16) -> (String, &'static str) {
    let hint = match DropReason::from_code(code) {
        Some(DropReason::Ahead) => {
            " (the appliance is behind this worker on this table: it may have restarted and lost the table's \
             rounds)"
        }
        Some(DropReason::WrongTypeForRound) => " (a table's rounds start at 1: round 0 is never pushed)",
        Some(DropReason::UnknownTable) => {
            " (the appliance does not serve this key as a table: it runs another spec of the job, or predates tables)"
        }
        Some(DropReason::DimMismatch) => " (this worker's dim for the table is not the appliance's: rejoin the job)",
        Some(DropReason::BadRowCount) => {
            " (more rows or ids than a datagram carries, or more than 1024 messages, or a ROW_END count that \
             changed within a round: this worker and the appliance disagree on the job's chunk_bytes or dim)"
        }
        Some(DropReason::BadSignature) => {
            " (a key-cache prefix the appliance does not take: this worker's key_cache for the table is not the \
             appliance's; rejoin the job)"
        }
        Some(DropReason::RowOutOfPlace) => {
            " (this worker places rows on other lcores than the appliance does: its view of the job's lcores or \
             the table's seed is stale; rejoin the job)"
        }
        _ => return describe(code),
    };
    (describe(code).0, hint)
}
