//! The I/O thread: windowed sending, retransmission, result matching.
//!
//! One thread per [`Worker`](crate::Worker) owns the UDP socket's receive
//! side. Requests arrive over a channel with their datagrams already encoded;
//! the thread keeps at most `window` chunks outstanding across all requests
//! (first come, first sent), retransmits a chunk whose RESULT is late
//! (RFC 6298 timeout, Karn's rule, per-chunk doubling), writes accepted
//! results into the request's buffer and completes the request when all its
//! chunks are in. Every request ends: with its result, with the appliance's
//! refusal, with a timeout after `timeout` without any accepted result, or
//! with [`WorkerError::Closed`] when the worker is dropped.

use std::collections::{HashMap, VecDeque};
use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use phub_proto::wire::{self, flags, DropReason, Header, MsgType, APPLIANCE_RANK};
use phub_proto::Dtype;

use crate::codec;
use crate::error::WorkerError;
use crate::stats::{add, Counters};
use crate::WorkerConfig;

/// Where a key stands, shared between the API and the I/O thread.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeyState {
    /// Last round whose result this worker holds, `None` before init/pull.
    pub(crate) round: Option<u32>,
    /// A request is in flight.
    pub(crate) busy: bool,
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
#[derive(Debug)]
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
    /// Header and payload, ready to send.
    pub(crate) datagram: Vec<u8>,
}

/// A finished request.
#[derive(Debug)]
pub(crate) struct Done {
    /// The key's values (result of the round).
    pub(crate) values: Vec<f32>,
    /// The round they are the result of (for a pull, the lowest over chunks).
    pub(crate) round: u32,
}

/// How a request ends.
pub(crate) type Completion = Result<Done, WorkerError>;

/// A request for all chunks of one key.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) key: u32,
    pub(crate) round: u32,
    pub(crate) kind: Kind,
    pub(crate) elements: usize,
    pub(crate) chunks: Vec<ChunkMsg>,
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

/// What the I/O thread needs to know about the job.
#[derive(Debug, Clone)]
pub(crate) struct JobInfo {
    pub(crate) job: u16,
    pub(crate) token: u64,
    pub(crate) rank: u16,
    pub(crate) dtype: Dtype,
}

/// Read timeout while chunks are outstanding: the retransmission timer's
/// resolution.
const TICK: Duration = Duration::from_millis(1);
/// Read timeout while idle; a submit wakes the thread at once anyway.
const IDLE: Duration = Duration::from_millis(100);

/// RFC 6298 retransmission timer state.
#[derive(Debug)]
struct Rto {
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    min: Duration,
    max: Duration,
}

impl Rto {
    fn new(c: &WorkerConfig) -> Rto {
        Rto {
            srtt: None,
            rttvar: Duration::ZERO,
            rto: c.initial_rto.clamp(c.min_rto, c.max_rto),
            min: c.min_rto,
            max: c.max_rto,
        }
    }

    fn sample(&mut self, r: Duration) {
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

    /// Timeout for a chunk sent `retries` times before.
    fn backoff(&self, retries: u32) -> Duration {
        self.rto
            .checked_mul(1u32 << retries.min(20))
            .unwrap_or(self.max)
            .min(self.max)
    }
}

#[derive(Debug)]
struct Active {
    key: u32,
    round: u32,
    kind: Kind,
    values: Vec<f32>,
    chunks: usize,
    remaining: usize,
    min_round: u32,
    done: Sender<Completion>,
}

#[derive(Debug)]
struct Outstanding {
    id: u64,
    msg: ChunkMsg,
    first_sent: Instant,
    deadline: Instant,
    /// Times sent again (Karn's rule: no RTT sample once non-zero).
    retries: u32,
    /// Doublings of the RTO for this chunk; reset when results flow again.
    backoff: u32,
}

/// The I/O thread's state.
pub(crate) struct IoThread {
    socket: UdpSocket,
    own: SocketAddr,
    info: JobInfo,
    window: usize,
    timeout: Duration,
    cmds: Receiver<Command>,
    keys: Keys,
    stats: Arc<Counters>,
    rto: Rto,
    next_id: u64,
    requests: HashMap<u64, Active>,
    pending: VecDeque<(u64, ChunkMsg)>,
    outstanding: HashMap<(u32, u32), Outstanding>,
    /// Last accepted result, or when work started after an idle spell.
    last_progress: Instant,
    last_scan: Instant,
    /// A result was accepted since the last retransmission scan.
    progressed: bool,
    read_timeout: Duration,
}

impl IoThread {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        socket: UdpSocket,
        own: SocketAddr,
        info: JobInfo,
        config: &WorkerConfig,
        cmds: Receiver<Command>,
        keys: Keys,
        stats: Arc<Counters>,
    ) -> IoThread {
        let rto = Rto::new(config);
        stats
            .rto_us
            .store(rto.rto.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
        let now = Instant::now();
        IoThread {
            socket,
            own,
            info,
            window: config.window.max(1),
            timeout: config.timeout,
            cmds,
            keys,
            stats,
            rto,
            next_id: 0,
            requests: HashMap::new(),
            pending: VecDeque::new(),
            outstanding: HashMap::new(),
            last_progress: now,
            last_scan: now,
            progressed: false,
            read_timeout: Duration::ZERO,
        }
    }

    fn busy(&self) -> bool {
        !self.requests.is_empty()
    }

    /// The thread's body; returns when the worker is dropped.
    pub(crate) fn run(mut self) {
        let mut buf = vec![0u8; 65536];
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
            self.fill_window(now);
            if now.saturating_duration_since(self.last_scan) >= TICK {
                self.last_scan = now;
                self.retransmit(now);
            }
            if self.busy() && now.saturating_duration_since(self.last_progress) >= self.timeout {
                self.time_out(now);
            }
            let want = if self.busy() { TICK } else { IDLE };
            if want != self.read_timeout {
                if let Err(e) = self.socket.set_read_timeout(Some(want)) {
                    log::warn!("phub-worker: cannot set the socket's read timeout: {e}");
                }
                self.read_timeout = want;
            }
            match self.socket.recv_from(&mut buf) {
                Ok((n, from)) => {
                    if n == 0 || from == self.own {
                        continue; // a wake-up from the API side
                    }
                    add(&self.stats.bytes_received, n as u64);
                    self.on_datagram(&buf[..n], Instant::now());
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock
                            | ErrorKind::TimedOut
                            | ErrorKind::Interrupted
                            | ErrorKind::ConnectionRefused
                            | ErrorKind::ConnectionReset
                    ) => {}
                Err(e) => {
                    log::warn!("phub-worker: receiving on {}: {e}", self.own);
                    std::thread::sleep(TICK);
                }
            }
        }
    }

    fn submit(&mut self, r: Request) {
        if !self.busy() {
            // Idle time does not count towards the timeout.
            self.last_progress = Instant::now();
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
                values: vec![0f32; r.elements],
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

    fn send(&self, msg: &ChunkMsg) {
        match self.socket.send_to(&msg.datagram, msg.to) {
            Ok(n) => add(&self.stats.bytes_sent, n as u64),
            // A failed send is a lost packet: the chunk stays outstanding and
            // is retransmitted; a persistent failure ends in a timeout.
            Err(e) => log::debug!("phub-worker: sending to {}: {e}", msg.to),
        }
    }

    fn fill_window(&mut self, now: Instant) {
        while self.outstanding.len() < self.window {
            let Some((id, msg)) = self.pending.pop_front() else {
                break;
            };
            let Some(req) = self.requests.get(&id) else {
                continue;
            };
            let key = req.key;
            self.send(&msg);
            add(&self.stats.chunks_sent, 1);
            let o = Outstanding {
                id,
                first_sent: now,
                deadline: now + self.rto.backoff(0),
                retries: 0,
                backoff: 0,
                msg,
            };
            self.outstanding.insert((key, o.msg.chunk), o);
        }
    }

    fn retransmit(&mut self, now: Instant) {
        // Results came back since the last scan: the appliance answers and the
        // other ranks push, so chunks backed off while they waited are given
        // the base timeout again (as TCP's backoff ends with a new ACK).
        // Without this a result lost after a long wait for a slow rank would
        // cost up to `max_rto`, and slow ranks would slow each other down.
        let reset = self.progressed;
        self.progressed = false;
        let mut resent = 0;
        for o in self.outstanding.values_mut() {
            if reset && o.backoff > 0 {
                o.backoff = 0;
                o.deadline = o.deadline.min(now + self.rto.backoff(0));
            }
            if now < o.deadline {
                continue;
            }
            if o.retries == 0 {
                Header::new_unchecked(&mut o.msg.datagram[..]).set_flags(flags::RETRANSMIT);
            }
            o.retries += 1;
            o.backoff += 1;
            o.deadline = now + self.rto.backoff(o.backoff);
            match self.socket.send_to(&o.msg.datagram, o.msg.to) {
                Ok(n) => add(&self.stats.bytes_sent, n as u64),
                Err(e) => log::debug!("phub-worker: resending to {}: {e}", o.msg.to),
            }
            resent += 1;
        }
        add(&self.stats.retransmits, resent);
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
            if repr.round != sent_round {
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
        codec::decode(self.info.dtype, payload, &mut req.values[start..end]);
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
        self.outstanding.remove(&(repr.key, repr.chunk));
        add(&self.stats.results_accepted, 1);
        self.last_progress = now;
        self.progressed = true;
        if done {
            self.complete(id);
        }
    }

    fn set_key(&self, key: u32, round: Option<u32>) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = keys.get_mut(key as usize) {
            if round.is_some() {
                k.round = round;
            }
            k.busy = false;
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
        self.set_key(req.key, Some(round));
        // The caller may have dropped its handle; the key is free either way.
        let _ = req.done.send(Ok(Done {
            values: req.values,
            round,
        }));
    }

    fn fail(&mut self, id: u64, err: WorkerError) {
        let Some(req) = self.requests.remove(&id) else {
            return;
        };
        self.outstanding.retain(|_, o| o.id != id);
        self.pending.retain(|(i, _)| *i != id);
        self.set_key(req.key, None);
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
    fn error_codes_are_named() {
        assert_eq!(describe(15).0, "count_mismatch");
        assert!(describe(19).1.contains("restarted"));
        assert_eq!(describe(999).0, "unknown error code 999");
    }
}
