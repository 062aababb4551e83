//! The per-lcore aggregation engine, sans I/O.
//!
//! A [`Shard`] owns the chunk slots one lcore serves, for every job installed
//! on it. Packets go in through [`Shard::handle`] with the sender's address
//! (any `Copy + Eq` type: a socket address, a MAC/IP/port triple) and the
//! caller's clock; what must be sent comes out of [`Shard::transmits`] as
//! headers with borrowed payloads and destination lists, which the backend
//! sends and then clears with [`Shard::clear_transmits`].
//!
//! Invariants:
//! - `handle` never panics, never blocks, and does not allocate as long as the
//!   backend drains transmits at least every [`MAX_BURST`] packets.
//! - A contribution is added at most once per (slot, round, rank): the
//!   contributor bitmap makes pushes idempotent.
//! - A slot's stored result is the result of its last completed round; it
//!   changes only when the next round completes, which needs a push from
//!   every rank, which no correct rank sends before it holds that result.
//!
//! The round rules are DESIGN.md's "Rounds, loss and duplicates" and are
//! written out normatively in PROTOCOL.md.

use std::sync::Arc;

use phub_proto::checkpoint::SlotState;
use phub_proto::fault::{Fate, Faults};
use phub_proto::layout::SlotChunk;
use phub_proto::spec::Optimizer;
use phub_proto::wire::{self, DropReason, MsgType, Repr, APPLIANCE_RANK, HEADER_LEN, MAX_PAYLOAD};
use phub_proto::Dtype;

use crate::counters::ShardCounters;
use crate::kernels::{self, Kernels};
use crate::optim::{self, ChunkBufs};

/// Most packets a backend may hand to [`Shard::handle`] between two drains
/// of [`Shard::transmits`] without the transmit queue allocating.
pub const MAX_BURST: usize = 512;

/// What a job looks like to one lcore.
#[derive(Debug, Clone, PartialEq)]
pub struct JobInstall {
    /// Job id (carried in every packet).
    pub id: u16,
    /// The job's secret token (carried in every packet).
    pub token: u64,
    /// Worker count W, 1..=256.
    pub workers: u16,
    /// Element type on the wire.
    pub dtype: Dtype,
    /// Per-chunk update.
    pub optimizer: Optimizer,
    /// The job's slots on this lcore, in slot order.
    pub slots: Vec<SlotChunk>,
}

/// Why a job could not be installed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// A job with this id is already installed.
    #[error("job {0} is already installed on this lcore")]
    JobExists(u16),
    /// The worker count is outside 1..=256.
    #[error("job {id}: worker count {workers} is outside 1..=256")]
    BadWorkers {
        /// Job id.
        id: u16,
        /// Worker count given.
        workers: u16,
    },
    /// A checkpoint could not be restored into the job.
    #[error("job {id}: cannot restore the checkpoint: {reason}")]
    Restore {
        /// Job id.
        id: u16,
        /// What did not fit.
        reason: String,
    },
    /// A slot's element count is zero or does not fit a packet.
    #[error("job {id}: slot {slot} has {elems} elements; accepted: 1..={max} for {dtype}")]
    BadSlot {
        /// Job id.
        id: u16,
        /// Slot index.
        slot: u32,
        /// Elements given.
        elems: u32,
        /// Most elements a packet carries for this dtype.
        max: u32,
        /// The job's dtype.
        dtype: Dtype,
    },
}

/// What became of one received packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A contribution was added; the round is still open.
    Aggregated,
    /// A contribution completed the round; the result is queued for all ranks.
    Completed,
    /// The stored result is queued again for the sender, who lost it.
    Resent,
    /// A PULL was answered with the stored result.
    Pulled,
    /// The packet was dropped and counted under this reason.
    Dropped(DropReason),
}

const NO_ROUND: u32 = u32::MAX;

/// Which ranks contributed to the round in progress.
#[derive(Debug, Clone, Copy, Default)]
struct RankSet([u64; 4]);

impl RankSet {
    fn contains(&self, r: u16) -> bool {
        self.0[usize::from(r >> 6) & 3] & (1 << (r & 63)) != 0
    }
    fn insert(&mut self, r: u16) {
        self.0[usize::from(r >> 6) & 3] |= 1 << (r & 63);
    }
}

/// Where the stored result lives.
#[derive(Debug)]
enum ResultBuf {
    /// f32 on the wire with a server-side optimizer: the parameters are it.
    Params,
    /// f32 sum/mean: swapped with the accumulator at completion.
    F32(Box<[f32]>),
    /// bf16/f16: the result encoded for the wire.
    Half(Box<[u16]>),
}

#[derive(Debug)]
struct Slot {
    key: u32,
    chunk: u32,
    elems: u32,
    /// Last completed round, `NO_ROUND` before round 0 completes.
    completed: u32,
    contributed: RankSet,
    ncontrib: u16,
    acc: Box<[f32]>,
    params: Box<[f32]>,
    s1: Box<[f32]>,
    s2: Box<[f32]>,
    result: ResultBuf,
}

impl Slot {
    fn new(c: SlotChunk, dtype: Dtype, opt: &Optimizer) -> Slot {
        let n = c.elems as usize;
        let zeros = |len: usize| vec![0f32; len].into_boxed_slice();
        let keeps = opt.keeps_params();
        let result = match (dtype, keeps) {
            (Dtype::F32, true) => ResultBuf::Params,
            (Dtype::F32, false) => ResultBuf::F32(zeros(n)),
            _ => ResultBuf::Half(vec![0u16; n].into_boxed_slice()),
        };
        let states = opt.state_buffers();
        Slot {
            key: c.key,
            chunk: c.chunk,
            elems: c.elems,
            completed: NO_ROUND,
            contributed: RankSet::default(),
            ncontrib: 0,
            acc: zeros(n),
            params: zeros(if keeps { n } else { 0 }),
            s1: zeros(if states >= 1 { n } else { 0 }),
            s2: zeros(if states >= 2 { n } else { 0 }),
            result,
        }
    }

    fn in_progress(&self) -> u32 {
        self.completed.wrapping_add(1)
    }

    fn result_bytes(&self) -> &[u8] {
        match &self.result {
            ResultBuf::Params => bytemuck::cast_slice(&self.params),
            ResultBuf::F32(r) => bytemuck::cast_slice(r),
            ResultBuf::Half(r) => bytemuck::cast_slice(r),
        }
    }

    fn memory_bytes(&self) -> u64 {
        let f = self.acc.len() + self.params.len() + self.s1.len() + self.s2.len();
        let r = match &self.result {
            ResultBuf::Params => 0,
            ResultBuf::F32(r) => 4 * r.len(),
            ResultBuf::Half(r) => 2 * r.len(),
        };
        (4 * f + r) as u64
    }

    /// Closes the round in progress: runs the optimizer (or, for round 0,
    /// takes rank 0's payload as the initial value) and stores the result.
    fn complete(&mut self, dtype: Dtype, opt: &Optimizer, workers: u16) {
        let round = self.in_progress();
        if opt.keeps_params() {
            if round == 0 {
                self.params.copy_from_slice(&self.acc);
                self.s1.fill(0.0);
                self.s2.fill(0.0);
            } else {
                optim::step(
                    opt,
                    u32::from(workers),
                    round,
                    ChunkBufs {
                        acc: &mut self.acc,
                        params: &mut self.params,
                        s1: &mut self.s1,
                        s2: &mut self.s2,
                    },
                );
            }
        } else if round != 0 {
            optim::step(
                opt,
                u32::from(workers),
                round,
                ChunkBufs {
                    acc: &mut self.acc,
                    params: &mut [],
                    s1: &mut [],
                    s2: &mut [],
                },
            );
        }
        match &mut self.result {
            ResultBuf::Params => {}
            ResultBuf::F32(r) => std::mem::swap(r, &mut self.acc),
            ResultBuf::Half(r) => {
                let src = if opt.keeps_params() {
                    &self.params
                } else {
                    &self.acc
                };
                kernels::encode(dtype, src, bytemuck::cast_slice_mut(r));
            }
        }
        self.completed = round;
        self.contributed = RankSet::default();
        self.ncontrib = 0;
    }
}

#[derive(Debug)]
struct Job<A> {
    id: u16,
    token: u64,
    workers: u16,
    dtype: Dtype,
    optimizer: Optimizer,
    slots: Vec<Slot>,
    /// Where each rank's results go: the source of its last valid packet.
    endpoints: Vec<Option<A>>,
    /// When each rank was last heard from (caller's clock), 0 if never.
    last_seen: Vec<u64>,
    /// Contributions aggregated on this lcore.
    pushes: u64,
    /// Rounds completed on this lcore, over all slots.
    rounds: u64,
}

/// One job as one lcore sees it (for stats; computed on request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobShardStats {
    /// Job id.
    pub id: u16,
    /// Contributions aggregated.
    pub pushes: u64,
    /// Rounds completed over all slots.
    pub rounds_completed: u64,
    /// Lowest and highest last-completed round over the slots that have one.
    pub round_range: Option<(u32, u32)>,
    /// When each rank was last heard from (caller's clock; 0 if never).
    pub last_seen: Vec<u64>,
}

#[derive(Debug, Clone, Copy)]
enum Pending<A> {
    /// The stored result of a slot, to all ranks or to one.
    Result { job: u16, slot: u32, to: Option<u16> },
    /// A refusal notice to a token-authenticated sender.
    Error { repr: Repr, to: A },
}

/// One message to send: a header, a payload borrowed from slot memory, and
/// the destinations. The header is the same for every destination, so a
/// backend sends the payload W times without copying it W times.
#[derive(Debug)]
pub struct Transmit<'a, A> {
    /// The phub header.
    pub header: [u8; HEADER_LEN],
    /// The payload (empty for ERROR).
    pub payload: &'a [u8],
    /// Where to send it.
    pub to: Destinations<'a, A>,
}

/// The destinations of a [`Transmit`]: every known rank's endpoint, or one.
/// With fault injection on (tests), some are skipped or repeated.
#[derive(Debug, Clone)]
pub struct Destinations<'a, A> {
    all: std::slice::Iter<'a, Option<A>>,
    one: Option<A>,
    faults: Option<(&'a Faults, &'a ShardCounters)>,
    again: Option<A>,
}

impl<A: Copy> Destinations<'_, A> {
    fn next_plain(&mut self) -> Option<A> {
        if let Some(a) = self.one.take() {
            return Some(a);
        }
        self.all.by_ref().flatten().next().copied()
    }
}

impl<A: Copy> Iterator for Destinations<'_, A> {
    type Item = A;
    fn next(&mut self) -> Option<A> {
        if let Some(a) = self.again.take() {
            return Some(a);
        }
        let Some((faults, counters)) = self.faults else {
            return self.next_plain();
        };
        loop {
            let a = self.next_plain()?;
            match faults.fate() {
                Fate::Drop => counters.injected_drops.inc(),
                Fate::Duplicate => {
                    counters.injected_dups.inc();
                    self.again = Some(a);
                    return Some(a);
                }
                // Sends cannot be held back here; the network reorders.
                Fate::Deliver | Fate::Reorder => return Some(a),
            }
        }
    }
}

/// The slots of one lcore, for every job installed on it.
#[derive(Debug)]
pub struct Shard<A> {
    lcore: u16,
    kernels: Kernels,
    jobs: Vec<Job<A>>,
    pending: Vec<Pending<A>>,
    counters: Arc<ShardCounters>,
    tx_faults: Option<Faults>,
}

impl<A: Copy + Eq> Shard<A> {
    /// An empty shard for `lcore`, aggregating with `kernels`.
    pub fn new(lcore: u16, kernels: Kernels) -> Shard<A> {
        Shard {
            lcore,
            kernels,
            jobs: Vec::new(),
            pending: Vec::with_capacity(MAX_BURST),
            counters: Arc::new(ShardCounters::default()),
            tx_faults: None,
        }
    }

    /// Turns fault injection on the results this shard sends on (tests and
    /// soaks) or off. Off by default; costs one branch per destination off.
    pub fn set_tx_faults(&mut self, faults: Option<Faults>) {
        self.tx_faults = faults;
    }

    /// The lcore this shard serves.
    pub fn lcore(&self) -> u16 {
        self.lcore
    }

    /// This shard's counters, to share with a stats reader.
    pub fn counters(&self) -> &Arc<ShardCounters> {
        &self.counters
    }

    /// Installs a job's slots on this lcore. Allocates; call between bursts.
    pub fn install(&mut self, job: JobInstall) -> Result<(), EngineError> {
        if self.jobs.iter().any(|j| j.id == job.id) {
            return Err(EngineError::JobExists(job.id));
        }
        if job.workers == 0 || job.workers > 256 {
            return Err(EngineError::BadWorkers {
                id: job.id,
                workers: job.workers,
            });
        }
        let max = (MAX_PAYLOAD / job.dtype.size()) as u32;
        if let Some((i, s)) = job
            .slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.elems == 0 || s.elems > max)
        {
            return Err(EngineError::BadSlot {
                id: job.id,
                slot: i as u32,
                elems: s.elems,
                max,
                dtype: job.dtype,
            });
        }
        let slots = job
            .slots
            .iter()
            .map(|&c| Slot::new(c, job.dtype, &job.optimizer))
            .collect();
        self.jobs.push(Job {
            id: job.id,
            token: job.token,
            workers: job.workers,
            dtype: job.dtype,
            optimizer: job.optimizer,
            slots,
            endpoints: vec![None; usize::from(job.workers)],
            last_seen: vec![0; usize::from(job.workers)],
            pushes: 0,
            rounds: 0,
        });
        Ok(())
    }

    /// Removes a job and frees its slots; returns whether it was installed.
    /// Pending transmits for it are discarded.
    pub fn remove(&mut self, id: u16) -> bool {
        self.pending
            .retain(|p| !matches!(p, Pending::Result { job, .. } if *job == id));
        let before = self.jobs.len();
        self.jobs.retain(|j| j.id != id);
        before != self.jobs.len()
    }

    /// Ids of the installed jobs.
    pub fn job_ids(&self) -> impl Iterator<Item = u16> + '_ {
        self.jobs.iter().map(|j| j.id)
    }

    /// Bytes of slot memory a job holds on this lcore.
    pub fn job_memory_bytes(&self, id: u16) -> Option<u64> {
        self.job(id).map(|j| j.slots.iter().map(Slot::memory_bytes).sum())
    }

    /// Sets where a rank's results go before it has sent anything (from
    /// the address it registered at join).
    pub fn set_endpoint(&mut self, id: u16, rank: u16, addr: A) -> bool {
        match self.jobs.iter_mut().find(|j| j.id == id) {
            Some(j) => match j.endpoints.get_mut(usize::from(rank)) {
                Some(e) => {
                    *e = Some(addr);
                    true
                }
                None => false,
            },
            None => false,
        }
    }

    /// When each rank of a job was last heard from on this lcore.
    pub fn last_seen(&self, id: u16) -> Option<&[u64]> {
        self.job(id).map(|j| &j.last_seen[..])
    }

    /// A slot's last completed round and its stored result (wire bytes).
    pub fn result(&self, id: u16, slot: u32) -> Option<(u32, &[u8])> {
        let s = self.job(id)?.slots.get(slot as usize)?;
        (s.completed != NO_ROUND).then(|| (s.completed, s.result_bytes()))
    }

    /// A slot's parameters (`f32`), for jobs with a server-side optimizer.
    pub fn params(&self, id: u16, slot: u32) -> Option<&[f32]> {
        let j = self.job(id)?;
        let s = j.slots.get(slot as usize)?;
        j.optimizer.keeps_params().then_some(&s.params[..])
    }

    /// The durable state of every slot of a job (completed round,
    /// parameters, optimizer state, stored result), for a checkpoint. The
    /// round in progress is not saved: its contributors never got a result
    /// and will push again. Allocates; call between bursts.
    pub fn snapshot(&self, id: u16) -> Option<Vec<SlotState>> {
        let j = self.job(id)?;
        Some(
            j.slots
                .iter()
                .map(|s| SlotState {
                    completed: (s.completed != NO_ROUND).then_some(s.completed),
                    params: s.params.to_vec(),
                    s1: s.s1.to_vec(),
                    s2: s.s2.to_vec(),
                    result: match &s.result {
                        ResultBuf::Params => Vec::new(),
                        _ => s.result_bytes().to_vec(),
                    },
                })
                .collect(),
        )
    }

    /// Puts slots back in the state a [`Shard::snapshot`] saved. Every
    /// length is checked before anything changes.
    pub fn restore(&mut self, id: u16, state: &[SlotState]) -> Result<(), EngineError> {
        let j = self
            .jobs
            .iter_mut()
            .find(|j| j.id == id)
            .ok_or(EngineError::Restore {
                id,
                reason: "the job is not installed".into(),
            })?;
        if state.len() != j.slots.len() {
            return Err(EngineError::Restore {
                id,
                reason: format!("{} slots saved, {} installed", state.len(), j.slots.len()),
            });
        }
        for (i, (slot, st)) in j.slots.iter().zip(state).enumerate() {
            let result_len = match &slot.result {
                ResultBuf::Params => 0,
                _ => slot.result_bytes().len(),
            };
            if st.params.len() != slot.params.len()
                || st.s1.len() != slot.s1.len()
                || st.s2.len() != slot.s2.len()
                || st.result.len() != result_len
                || st.completed == Some(NO_ROUND)
            {
                return Err(EngineError::Restore {
                    id,
                    reason: format!("slot {i}: saved buffers do not fit the installed chunk"),
                });
            }
        }
        for (slot, st) in j.slots.iter_mut().zip(state) {
            slot.completed = st.completed.unwrap_or(NO_ROUND);
            slot.contributed = RankSet::default();
            slot.ncontrib = 0;
            slot.params.copy_from_slice(&st.params);
            slot.s1.copy_from_slice(&st.s1);
            slot.s2.copy_from_slice(&st.s2);
            match &mut slot.result {
                ResultBuf::Params => {}
                ResultBuf::F32(r) => bytemuck::cast_slice_mut(r).copy_from_slice(&st.result),
                ResultBuf::Half(r) => bytemuck::cast_slice_mut(r).copy_from_slice(&st.result),
            }
        }
        Ok(())
    }

    /// Stats of every installed job. Allocates; call between bursts.
    pub fn job_stats(&self) -> Vec<JobShardStats> {
        self.jobs
            .iter()
            .map(|j| {
                let done = j.slots.iter().map(|s| s.completed).filter(|&r| r != NO_ROUND);
                let round_range = done.fold(None, |acc: Option<(u32, u32)>, r| {
                    Some(acc.map_or((r, r), |(lo, hi)| (lo.min(r), hi.max(r))))
                });
                JobShardStats {
                    id: j.id,
                    pushes: j.pushes,
                    rounds_completed: j.rounds,
                    round_range,
                    last_seen: j.last_seen.clone(),
                }
            })
            .collect()
    }

    fn job(&self, id: u16) -> Option<&Job<A>> {
        self.jobs.iter().find(|j| j.id == id)
    }

    /// Handles one received datagram from `from` at time `now` (caller's
    /// monotonic clock, any unit). Never panics; counts every drop.
    pub fn handle(&mut self, from: A, datagram: &[u8], now: u64) -> Verdict {
        let c = &self.counters;
        c.rx_packets.inc();
        c.rx_bytes.add(datagram.len() as u64);
        let v = self.classify(from, datagram, now);
        if let Verdict::Dropped(r) = v {
            self.counters.count_drop(r);
        }
        v
    }

    fn classify(&mut self, from: A, datagram: &[u8], now: u64) -> Verdict {
        let (repr, payload) = match wire::parse(datagram) {
            Ok(p) => p,
            Err(r) => return Verdict::Dropped(r),
        };
        if matches!(repr.kind, MsgType::Result | MsgType::Error) {
            return Verdict::Dropped(DropReason::NotForAppliance);
        }
        let Some(job) = self.jobs.iter_mut().find(|j| j.id == repr.job) else {
            return Verdict::Dropped(DropReason::UnknownJob);
        };
        if repr.token != job.token {
            return Verdict::Dropped(DropReason::BadToken);
        }
        if repr.rank >= job.workers {
            return Verdict::Dropped(DropReason::RankOutOfRange);
        }
        // Authenticated from here on: remember where this rank lives.
        let rank = usize::from(repr.rank);
        job.endpoints[rank] = Some(from);
        job.last_seen[rank] = now;
        match Self::apply(&self.kernels, job, &repr, payload) {
            Ok(Step::Open) => {
                job.pushes += 1;
                self.counters.pushes_aggregated.inc();
                Verdict::Aggregated
            }
            Ok(Step::Closed) => {
                job.pushes += 1;
                job.rounds += 1;
                self.counters.pushes_aggregated.inc();
                self.counters.rounds_completed.inc();
                self.counters.results_sent.add(u64::from(job.workers));
                self.pending.push(Pending::Result {
                    job: job.id,
                    slot: repr.slot,
                    to: None,
                });
                Verdict::Completed
            }
            Ok(Step::Resend) => {
                self.counters.results_resent.inc();
                self.counters.results_sent.inc();
                self.pending.push(Pending::Result {
                    job: job.id,
                    slot: repr.slot,
                    to: Some(repr.rank),
                });
                if repr.kind == MsgType::Pull {
                    self.counters.pulls_answered.inc();
                    Verdict::Pulled
                } else {
                    Verdict::Resent
                }
            }
            Err(r) => {
                if r.notifies_sender() {
                    self.counters.errors_sent.inc();
                    let mut e = repr;
                    e.kind = MsgType::Error;
                    e.count = 0;
                    e.error = r.code();
                    e.flags = 0;
                    self.pending.push(Pending::Error { repr: e, to: from });
                }
                Verdict::Dropped(r)
            }
        }
    }

    /// The slot and round rules for an authenticated packet.
    fn apply(k: &Kernels, job: &mut Job<A>, repr: &Repr, payload: &[u8]) -> Result<Step, DropReason> {
        if repr.dtype != job.dtype {
            return Err(DropReason::DtypeMismatch);
        }
        let slot = job
            .slots
            .get_mut(repr.slot as usize)
            .ok_or(DropReason::SlotOutOfRange)?;
        if repr.key != slot.key || repr.chunk != slot.chunk {
            return Err(DropReason::ChunkMismatch);
        }
        let carries = match repr.kind {
            MsgType::Pull => false,
            MsgType::Init => repr.rank == 0,
            _ => true,
        };
        let expect = if carries { slot.elems } else { 0 };
        if u32::from(repr.count) != expect {
            return Err(DropReason::CountMismatch);
        }
        if repr.kind == MsgType::Pull {
            return if slot.completed == NO_ROUND {
                Err(DropReason::NothingToPull)
            } else {
                Ok(Step::Resend)
            };
        }
        if (repr.kind == MsgType::Init) != (repr.round == 0) {
            return Err(DropReason::WrongTypeForRound);
        }
        if repr.round == NO_ROUND {
            // The largest round a slot can complete is NO_ROUND - 1.
            return Err(DropReason::Ahead);
        }
        let current = slot.in_progress();
        if slot.completed != NO_ROUND && repr.round == slot.completed {
            return Ok(Step::Resend);
        }
        if repr.round != current {
            // Rounds are compared in the slot's window; anything not the
            // round in progress or the last completed one is outside it.
            return Err(if slot.completed != NO_ROUND && repr.round < slot.completed {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        }
        if slot.contributed.contains(repr.rank) {
            return Err(DropReason::Duplicate);
        }
        if carries {
            if slot.ncontrib == 0 || repr.kind == MsgType::Init {
                k.copy(job.dtype, &mut slot.acc, payload);
            } else {
                k.add(job.dtype, &mut slot.acc, payload);
            }
        }
        slot.contributed.insert(repr.rank);
        slot.ncontrib += 1;
        if slot.ncontrib == job.workers {
            slot.complete(job.dtype, &job.optimizer, job.workers);
            Ok(Step::Closed)
        } else {
            Ok(Step::Open)
        }
    }

    /// What must be sent now, in the order it was queued.
    pub fn transmits(&self) -> impl Iterator<Item = Transmit<'_, A>> + '_ {
        self.pending.iter().filter_map(move |p| match *p {
            Pending::Result { job, slot, to } => {
                let j = self.job(job)?;
                let s = j.slots.get(slot as usize)?;
                let repr = Repr {
                    kind: MsgType::Result,
                    dtype: j.dtype,
                    flags: 0,
                    token: j.token,
                    job: j.id,
                    rank: APPLIANCE_RANK,
                    count: s.elems as u16,
                    error: 0,
                    round: s.completed,
                    slot,
                    key: s.key,
                    chunk: s.chunk,
                };
                let faults = self.tx_faults.as_ref().map(|f| (f, &*self.counters));
                let to = match to {
                    None => Destinations {
                        all: j.endpoints.iter(),
                        one: None,
                        faults,
                        again: None,
                    },
                    Some(r) => Destinations {
                        all: [].iter(),
                        one: j.endpoints.get(usize::from(r)).copied().flatten(),
                        faults,
                        again: None,
                    },
                };
                Some(Transmit {
                    header: repr.to_bytes(),
                    payload: s.result_bytes(),
                    to,
                })
            }
            Pending::Error { repr, to } => Some(Transmit {
                header: repr.to_bytes(),
                payload: &[],
                to: Destinations {
                    all: [].iter(),
                    one: Some(to),
                    faults: self.tx_faults.as_ref().map(|f| (f, &*self.counters)),
                    again: None,
                },
            }),
        })
    }

    /// Whether anything is waiting to be sent.
    pub fn has_transmits(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Forgets what [`Shard::transmits`] returned, once it has been sent.
    pub fn clear_transmits(&mut self) {
        self.pending.clear();
    }
}

enum Step {
    Open,
    Closed,
    Resend,
}
