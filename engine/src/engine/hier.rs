//! A hierarchical job's part on one lcore (PROTOCOL.md §9): which ranks
//! are this rack's, where each chunk's home slot and every rack's slot of
//! it are, the partial sums waiting for their home's answer and their
//! retransmission timers, and this lcore's home slots.
//!
//! Invariants (on top of the engine's):
//! - A rack slot whose rack's workers have all contributed to round r
//!   holds their sum in its accumulator, untouched, until a PARTIAL_RESULT
//!   of round r from the chunk's home closes the round: only then does the
//!   stored result change and the round complete. Until then it resends
//!   the same partial on its timer, never giving up while installed.
//! - A home slot runs the slot rules of §5 with the R racks as its ranks:
//!   a partial is added at most once per (rack, round), the optimizer runs
//!   once per round with W = the job's worker count, and a partial of the
//!   last completed round is answered with the stored result, to that
//!   rack alone.
//! - Appliance-to-appliance messages go to the addresses of the install,
//!   never to a message's source; a PARTIAL_RESULT is taken only from the
//!   chunk's home address, and a rack's PARTIAL only from the address of
//!   that rack's lcore holding the chunk (the job's token alone, which
//!   workers hold, never speaks for an appliance).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::ops::Range;

use phub_proto::api::InstallJob;
use phub_proto::layout::{ChunkRange, Chunks, Layout, Placement, SlotChunk};
use phub_proto::memory::ResultStore;
use phub_proto::spec::{Consistency, Optimizer};
use phub_proto::wire::{DropReason, MsgType, Repr, APPLIANCE_RANK, MAX_PAYLOAD};
use phub_proto::Dtype;

use crate::counters::ShardCounters;
use crate::kernels::Kernels;
use crate::slotmem::SlotBlock;
use crate::transmit::{Transmit, MAX_BURST};

use super::error::EngineError;
use super::install::JobInstall;
use super::outbox::{answer, Attempt, Pending, Ranks};
use super::replica::ReplicaInstall;
use super::slot::{slot_for, RankSet, ResultKind, Round, Slot};
use super::{round_done, Job, Shard, Step, Verdict};

/// What an lcore is told of a hierarchical job beside its rack slots (the
/// [`super::JobInstall`], installed with the `sum` optimizer: a rack slot
/// only adds and relays).
#[derive(Debug, Clone, PartialEq)]
pub struct HierInstall {
    /// This appliance's rack index.
    pub rack: u16,
    /// The ranks of this rack (rack 0 holds rank 0).
    pub ranks: Range<u16>,
    /// The job's optimizer, which the home slots run.
    pub optimizer: Optimizer,
    /// Sequence number of this lcore's rack slot 0 in the job's chunks.
    pub first: u64,
    /// Per rack, in rack order: its appliance's lcores' data addresses and
    /// its rack layout's runs (one per lcore).
    pub racks: Vec<Peers<SocketAddrV4>>,
    /// The home layout: every rack appliance's lcores' addresses, rack 0's
    /// first, and the runs over them.
    pub homes: Peers<SocketAddrV4>,
    /// This lcore's home slots: the sequence number of slot 0, and the
    /// chunks (empty when this lcore is home to none).
    pub home_first: u64,
    /// The chunks of this lcore's home slots, in slot order.
    pub home_slots: Vec<SlotChunk>,
    /// A replicated job's (PROTOCOL.md §11.11): the home slots are the
    /// primary slots of their chunks over the home layout, and this says
    /// where their backups are and which backup slots this lcore keeps, in
    /// epoch 0; none without replicas.
    pub replica: Option<ReplicaInstall>,
}

/// The lcores of one appliance (or of all, for the home layout) and the
/// runs of chunks they hold: as the install gives them (data addresses),
/// and as the shard keeps them (the backend's addresses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peers<A> {
    /// The lcores' addresses, in lcore order.
    pub addrs: Vec<A>,
    /// The runs of chunks they hold, one per lcore.
    pub runs: Vec<ChunkRange>,
}

impl<A: Copy> Peers<A> {
    /// The address of the lcore holding sequence number `seq`, and its
    /// slot there.
    pub(super) fn place(&self, seq: u64) -> Option<(A, u32)> {
        let l = self.runs.partition_point(|r| r.first + r.count <= seq);
        let r = self.runs.get(l)?;
        if !r.range().contains(&seq) {
            return None;
        }
        Some((*self.addrs.get(l)?, u32::try_from(seq - r.first).ok()?))
    }
}

/// A rack slot's partial sum waiting for its home's answer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Partial {
    /// The round it belongs to; none when none is waiting.
    pub round: Round,
    /// When it was first sent (caller's clock), for the estimate of how
    /// long a home takes to answer (its wait for the other racks
    /// included); sampled only if it was not resent.
    pub sent: u64,
    /// When to resend it.
    pub deadline: u64,
    /// Resends so far (the timeout doubles with each, up to [`MAX_RTO_NS`]).
    pub resends: u8,
}

impl Default for Partial {
    fn default() -> Partial {
        Partial {
            round: Round::NONE,
            sent: 0,
            deadline: u64::MAX,
            resends: 0,
        }
    }
}

/// Shortest time before a partial is resent: 2 ms.
pub(super) const MIN_RTO_NS: u64 = 2_000_000;
/// Longest: 200 ms (a home that restarts is back within seconds; the
/// partial keeps going until it answers).
pub(super) const MAX_RTO_NS: u64 = 200_000_000;
/// Before any round trip was measured: 20 ms.
const INITIAL_RTO_NS: u64 = 20_000_000;

/// How long a home takes to answer a partial (its wait for the other
/// racks included), RFC 6298's estimator in ns, with TCP's treatment of
/// timeouts: a sample only from a partial sent once (Karn's rule), and the
/// timeout's back-off kept across partials until such a sample comes, so
/// that a wait longer than the timer lengthens it rather than being left
/// out of the estimate for good.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Rtt {
    srtt: u64,
    rttvar: u64,
    /// Doublings kept since the last sample (at most [`MAX_BACKOFF`]).
    backoff: u8,
}

/// Most doublings the timer keeps across partials.
const MAX_BACKOFF: u8 = 4;

impl Rtt {
    /// A partial's timer went off: later partials wait twice as long,
    /// until a sample.
    pub(super) fn back_off(&mut self) {
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
    }

    /// A timer that went off at `now` resends: later timers back off once
    /// per poll (`backed_off` says whether this poll did already), its
    /// `resends` count one more, and its next deadline is returned.
    pub(super) fn fire(&mut self, backed_off: &mut bool, resends: &mut u8, now: u64) -> u64 {
        if !*backed_off {
            self.back_off();
            *backed_off = true;
        }
        *resends = resends.saturating_add(1);
        now.saturating_add(self.rto(*resends))
    }

    pub(super) fn sample(&mut self, rtt: u64) {
        self.backoff = 0;
        if self.srtt == 0 {
            self.srtt = rtt.max(1);
            self.rttvar = rtt / 2;
        } else {
            let err = self.srtt.abs_diff(rtt);
            self.rttvar = (3 * self.rttvar + err) / 4;
            self.srtt = (7 * self.srtt + rtt) / 8;
        }
    }

    /// The timeout after `resends` resends: SRTT + 4 RTTVAR, RTTVAR
    /// counted at least SRTT / 4 (so at least 2 SRTT). A rack's partials
    /// (a primary's aggregates) come back in bursts, thousands of samples
    /// per round trip, each close to the one before: RTTVAR shrinks to
    /// the spread within a burst, well under the spread between bursts,
    /// and SRTT + 4 RTTVAR alone fired for a fifth of a replicated
    /// hierarchical job's partials (RTT median 3.1 ms, p90 4.3, RTTVAR
    /// 0.2 ms: BENCHMARKS.md).
    pub(super) fn rto(&self, resends: u8) -> u64 {
        let base = if self.srtt == 0 {
            INITIAL_RTO_NS
        } else {
            (self.srtt + 4 * self.rttvar.max(self.srtt / 4)).clamp(MIN_RTO_NS, MAX_RTO_NS)
        };
        base.saturating_mul(1 << resends.saturating_add(self.backoff).min(16))
            .min(MAX_RTO_NS)
    }
}

/// This lcore's home slots of the job.
#[derive(Debug)]
pub(super) struct Home {
    /// Sequence number of home slot 0.
    pub first: u64,
    pub slots: Vec<Slot>,
    pub blocks: Vec<Box<dyn SlotBlock>>,
}

/// A hierarchical job's state on one lcore.
#[derive(Debug)]
pub(super) struct Hier<A> {
    pub rack: u16,
    pub racks: u16,
    /// The job's worker count W (the home's optimizer divides a mean by it).
    pub workers: u16,
    pub optimizer: Optimizer,
    /// Sequence number of rack slot 0.
    pub first: u64,
    /// Per rack: where its slot of each chunk is.
    pub rack_peers: Vec<Peers<A>>,
    /// Where each chunk's home slot is.
    pub homes: Peers<A>,
    /// Per rack slot: its partial waiting for an answer, if any.
    pub partials: Vec<Partial>,
    /// The earliest deadline of `partials` (u64::MAX: none).
    pub next_deadline: u64,
    pub rtt: Rtt,
    /// This lcore's home slots (none: it is home to no chunk of the job).
    pub home: Option<Home>,
}

impl<A: Copy> Hier<A> {
    /// Where the home slot of rack slot `slot` is.
    pub(super) fn home_of(&self, slot: u32) -> Option<(A, u32)> {
        self.homes.place(self.first + u64::from(slot))
    }

    /// Where rack `rack`'s slot of home slot `slot` is.
    pub(super) fn rack_slot_of(&self, rack: u16, slot: u32) -> Option<(A, u32)> {
        let home = self.home.as_ref()?;
        self.rack_peers
            .get(usize::from(rack))?
            .place(home.first + u64::from(slot))
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// Installs a hierarchical job's part on this lcore (PROTOCOL.md §9):
    /// `job`'s slots are its rack slots (a `sum` job of W workers, of which
    /// `hier.ranks` send here) and `hier` says where homes and the other
    /// racks are and which home slots this lcore keeps. Whole or refused,
    /// as [`Shard::install`] ([`InstallKind::Hierarchical`]).
    pub(super) fn install_hierarchical(
        &mut self,
        job: JobInstall,
        hier: HierInstall,
    ) -> Result<(), EngineError> {
        let id = job.id;
        let refuse = |reason: String| EngineError::Hierarchy { id, reason };
        let Some(resolve) = self.peers.0.clone() else {
            return Err(refuse(
                "this backend does not send to other appliances (kernel UDP does)".into(),
            ));
        };
        if job.consistency != Consistency::Sync || job.optimizer != Optimizer::Sum {
            return Err(refuse(
                "rack slots are BSP and only add (the sum optimizer)".into(),
            ));
        }
        let racks = hier.racks.len();
        if racks < 2 || racks > usize::from(u16::MAX) || usize::from(hier.rack) >= racks {
            return Err(refuse(format!("rack {} of {racks}", hier.rack)));
        }
        if hier.ranks.is_empty()
            || hier.ranks.end > job.workers
            || (hier.rack == 0) != (hier.ranks.start == 0)
        {
            return Err(refuse(format!(
                "ranks {:?} of {} workers (rack 0, and only it, holds rank 0)",
                hier.ranks, job.workers
            )));
        }
        let peers = |p: &Peers<SocketAddrV4>| {
            if p.addrs.len() != p.runs.len() {
                return Err(format!("{} addresses for {} lcores", p.addrs.len(), p.runs.len()));
            }
            let addrs = p
                .addrs
                .iter()
                .map(|&a| {
                    resolve(a).ok_or_else(|| {
                        format!(
                            "this backend cannot address appliance {a} (DPDK: give its Ethernet address \
                             with --neighbor IP=MAC, or the next hop's with --gateway-mac)"
                        )
                    })
                })
                .collect::<Result<Vec<A>, String>>()?;
            Ok(Peers {
                addrs,
                runs: p.runs.clone(),
            })
        };
        let rack_peers = hier
            .racks
            .iter()
            .map(peers)
            .collect::<Result<Vec<_>, _>>()
            .map_err(refuse)?;
        let homes = peers(&hier.homes).map_err(refuse)?;
        // Cast: MAX_PAYLOAD is below 9000 (asserted in phub_proto::wire).
        #[allow(clippy::cast_possible_truncation)]
        let max = ((MAX_PAYLOAD / 4) as u32).min(job.chunk_elems);
        if let Some(c) = job
            .slots
            .iter()
            .chain(&hier.home_slots)
            .find(|c| c.elems == 0 || c.elems > max)
        {
            return Err(refuse(format!(
                "a home slot of {} elements; a partial carries 1..={max} f32s",
                c.elems
            )));
        }
        // A replicated job's home slots are its primary slots (§11.11):
        // their replication made before anything is installed.
        let replica = match hier.replica {
            Some(rep) if rep.view.epoch == 0 && rep.view.names_nobody() => {
                Some(self.replica_for(&job, &hier.home_slots, &hier.optimizer, rep)?)
            }
            Some(rep) => {
                return Err(refuse(format!(
                    "epoch {}: a replicated hierarchical job is hierarchical at epoch 0 only, and flat \
                     over its home layout from its first epoch change on (PROTOCOL.md §11.11)",
                    rep.view.epoch
                )))
            }
            None => None,
        };
        let home = if hier.home_slots.is_empty() {
            None
        } else {
            let (slots, blocks) = self
                .alloc_slots(
                    &hier.home_slots,
                    job.dtype,
                    &hier.optimizer,
                    job.chunk_elems,
                    ResultStore::Slot,
                )
                .map_err(|reason| EngineError::SlotMemory {
                    id,
                    bytes: hier
                        .home_slots
                        .iter()
                        .map(|c| {
                            4 * Slot::block_len(c.elems, job.dtype, &hier.optimizer, ResultStore::Slot) as u64
                        })
                        .sum(),
                    slots: hier.home_slots.len(),
                    from: self.mem.describe(),
                    reason,
                })?;
            Some(Home {
                first: hier.home_first,
                slots,
                blocks,
            })
        };
        let nslots = job.slots.len();
        let workers = job.workers;
        self.install_with(job, None)?;
        if let Some(r) = &replica {
            self.reserve_replication(r.groups.first().map_or(0, |g| g.backups.len()));
        }
        // Cast: racks <= u16::MAX (checked above); the ranks are below W.
        #[allow(clippy::cast_possible_truncation)]
        let (racks, quorum) = (racks as u16, hier.ranks.len() as u16);
        // A completed home round queues one message per rack.
        self.pending.reserve(usize::from(racks) * MAX_BURST);
        let j = self.jobs.last_mut().expect("installed just now");
        j.quorum = quorum;
        j.members = RankSet::of(hier.ranks.clone());
        j.hier = Some(Box::new(Hier {
            rack: hier.rack,
            racks,
            workers,
            optimizer: hier.optimizer,
            first: hier.first,
            rack_peers,
            homes,
            partials: vec![Partial::default(); nslots],
            next_deadline: u64::MAX,
            rtt: Rtt::default(),
            home,
        }));
        j.replica = replica.map(Box::new);
        // Its senders here are its rack's ranks and, to home slots, the racks.
        self.count_rx_workers();
        Ok(())
    }

    /// A PARTIAL or PARTIAL_RESULT of installed job `i` with its token
    /// (PROTOCOL.md §9.3, §9.4). Refusals are counted, never answered: the
    /// sender is an appliance.
    pub(super) fn peer_message(
        &mut self,
        i: usize,
        from: A,
        repr: &Repr,
        payload: &[u8],
        now: u64,
    ) -> Verdict {
        if self.closing {
            return Verdict::Dropped(DropReason::ShuttingDown);
        }
        let (job, c) = (&mut self.jobs[i], &self.counters);
        if repr.kind == MsgType::PartialResult {
            return match Self::on_partial_result(job, from, repr, payload, now) {
                Ok(()) => round_done(&mut self.pending, c, job, repr.slot),
                Err(r) => Verdict::Dropped(r),
            };
        }
        match Self::on_partial(&self.kernels, job, from, repr, payload, now) {
            Ok(Step::Open) => {
                c.pushes_aggregated.inc();
                Verdict::Aggregated
            }
            Ok(Step::Closed) => {
                c.pushes_aggregated.inc();
                c.rounds_completed.inc();
                home_done(&mut self.pending, c, job, repr.slot)
            }
            Ok(Step::Replicate) => {
                // Every rack is in: the aggregate goes to the chunk's
                // backups before the round completes (§11.11).
                c.pushes_aggregated.inc();
                Self::queue_replicates(&mut self.pending, c, job, repr.slot)
            }
            Ok(_) => {
                c.partial_results_resent.inc();
                self.pending.push(Pending::PartialResult {
                    job: job.id,
                    slot: repr.slot,
                    rack: repr.rank,
                });
                Verdict::Resent
            }
            Err(r) => Verdict::Dropped(r),
        }
    }

    /// A rack's PARTIAL at a home slot: the slot rules of §5 with the racks
    /// as ranks (§9.4). `Step::Resend` asks for the stored result to go to
    /// the sending rack again. Only the lcore of rack `repr.rank`'s
    /// appliance that holds the chunk's rack slot (the one that sends its
    /// partials, from its own port) may speak for that rack: a partial from
    /// any other address is `wrong_peer`, whatever token it carries, so a
    /// worker cannot stand in for a whole rack.
    pub(super) fn on_partial(
        k: &Kernels,
        job: &mut Job<A>,
        from: A,
        repr: &Repr,
        payload: &[u8],
        now: u64,
    ) -> Result<Step, DropReason> {
        let dtype = job.dtype;
        let h = job.hier.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        if repr.rank >= h.racks {
            return Err(DropReason::RankOutOfRange);
        }
        // Where the rack's slot of this chunk is: its sender (None for a
        // slot that is no home slot here; slot_for refuses that first).
        let sender = h.rack_slot_of(repr.rank, repr.slot).map(|(at, _)| at);
        let home = h.home.as_mut().ok_or(DropReason::SlotOutOfRange)?;
        let slot = slot_for(&mut home.slots, repr, Dtype::F32)?;
        let carries = repr.round != 0 || repr.rank == 0;
        if u32::from(repr.count) != if carries { slot.elems } else { 0 } {
            return Err(DropReason::CountMismatch);
        }
        if sender != Some(from) {
            return Err(DropReason::WrongPeer);
        }
        if !Round::completable(repr.round) {
            return Err(DropReason::Ahead);
        }
        if slot.in_window(repr.round, repr.rank)? {
            return Ok(Step::Resend(None));
        }
        if carries {
            if slot.ncontrib == 0 || repr.round == 0 {
                k.copy(Dtype::F32, slot.mem.acc_mut(&mut home.blocks), payload);
            } else {
                k.add(Dtype::F32, slot.mem.acc_mut(&mut home.blocks), payload);
            }
        }
        debug_assert!(slot.ncontrib < h.racks, "a partial beyond the racks");
        slot.contributed.insert(repr.rank);
        slot.ncontrib += 1;
        if slot.ncontrib < h.racks {
            return Ok(Step::Open);
        }
        // A replicated job's home slot: the round completes once every
        // backup holds it (PROTOCOL.md §11.11, §11.4).
        if let Some(rep) = job.replica.as_deref_mut() {
            if rep.begin(repr.slot, repr.round, now) {
                return Ok(Step::Replicate);
            }
        }
        slot.complete(dtype, &h.optimizer, h.workers, h.racks, &mut home.blocks);
        Ok(Step::Closed)
    }

    /// The home's PARTIAL_RESULT at a rack slot whose partial waits for it:
    /// it becomes the stored result and the round completes (§9.3).
    pub(super) fn on_partial_result(
        job: &mut Job<A>,
        from: A,
        repr: &Repr,
        payload: &[u8],
        now: u64,
    ) -> Result<(), DropReason> {
        let quorum = job.quorum;
        let h = job.hier.as_deref_mut().ok_or(DropReason::WrongPeer)?;
        if repr.rank != APPLIANCE_RANK {
            return Err(DropReason::RankOutOfRange);
        }
        let slot = slot_for(&mut job.slots, repr, job.dtype)?;
        if u32::from(repr.count) != slot.elems {
            return Err(DropReason::CountMismatch);
        }
        if h.home_of(repr.slot).is_none_or(|(home, _)| home != from) {
            return Err(DropReason::WrongPeer);
        }
        let p = &mut h.partials[repr.slot as usize];
        if !p.round.is(repr.round) {
            let done = slot.completed.get().is_some_and(|c| repr.round <= c);
            return Err(if done || p.round.is_after(repr.round) {
                DropReason::Stale
            } else {
                DropReason::Ahead
            });
        }
        if p.resends == 0 {
            h.rtt.sample(now.saturating_sub(p.sent));
        }
        *p = Partial::default();
        let n = 2 * slot.mem.n;
        let [a, b, .., half] = slot.mem.all_mut(&mut job.blocks);
        match slot.result {
            ResultKind::F32 => {
                let r = if slot.mem.acc_in_a { b } else { a };
                bytemuck::cast_slice_mut(r).copy_from_slice(payload);
            }
            ResultKind::Half => bytemuck::cast_slice_mut::<f32, u8>(half)[..n].copy_from_slice(payload),
            // Rack slots are installed as sum jobs without shared memory.
            ResultKind::Params | ResultKind::Region => return Err(DropReason::DtypeMismatch),
        }
        // The partial went when the rack's last rank contributed; nothing
        // was added to the round since.
        slot.close(quorum);
        Ok(())
    }

    /// Resends the partial sums whose home has not answered in time
    /// (PROTOCOL.md §9.3 rule 4), and the aggregates whose backups have
    /// not all acknowledged in time (§11.4 rule 4), at most [`MAX_BURST`]
    /// messages per call (the rest at the next); cheap when none is due. Call between bursts with the
    /// clock `handle` gets.
    pub fn poll_timers(&mut self, now: u64) {
        let mut budget = MAX_BURST;
        for j in &mut self.jobs {
            let Some(h) = j.hier.as_deref_mut() else {
                continue;
            };
            if now < h.next_deadline {
                continue;
            }
            let mut rtt = h.rtt;
            let mut timed_out = false;
            let mut next = u64::MAX;
            // Cast: i indexes the job's slots, which fit a u32 (install).
            #[allow(clippy::cast_possible_truncation)]
            for (i, p) in h.partials.iter_mut().enumerate() {
                if p.round.is_none() {
                    continue;
                }
                if p.deadline <= now && budget > 0 {
                    budget -= 1;
                    // Backed off once per call, however many partials were due.
                    p.deadline = rtt.fire(&mut timed_out, &mut p.resends, now);
                    self.pending.push(Pending::Partial {
                        job: j.id,
                        slot: i as u32,
                        attempt: Attempt::Again,
                    });
                    self.counters.partials_resent.inc();
                }
                next = next.min(p.deadline);
            }
            h.next_deadline = next;
            h.rtt = rtt;
        }
        // What is left of the budget goes to replicated jobs' aggregates.
        self.poll_replicas(now, budget);
    }

    /// Rack slot `slot`'s partial sum, to its home (None once answered).
    pub(super) fn partial_transmit(
        &self,
        job: u16,
        slot: u32,
        attempt: Attempt,
    ) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let j = self.job(job)?;
        let h = j.hier.as_deref()?;
        let s = j.slots.get(slot as usize)?;
        let round = h.partials.get(slot as usize)?.round.get()?;
        let (to, home_slot) = h.home_of(slot)?;
        // Round 0: rank 0's rack carries its initial values, the others
        // only say they are in (PROTOCOL.md §9.3).
        let carries = round != 0 || h.rack == 0;
        // Cast: s.elems <= MAX_PAYLOAD / 4 (checked in install_hierarchical).
        #[allow(clippy::cast_possible_truncation)]
        let repr = Repr {
            kind: MsgType::Partial,
            dtype: Dtype::F32,
            flags: attempt.flags(),
            token: j.token,
            job: j.id,
            rank: h.rack,
            count: if carries { s.elems as u16 } else { 0 },
            error: 0,
            round,
            slot: home_slot,
            key: s.key,
            chunk: s.chunk,
        };
        let payload: &[u8] = if carries {
            bytemuck::cast_slice(s.mem.acc(&j.blocks))
        } else {
            &[]
        };
        debug_assert_eq!(payload.len(), repr.payload_len(), "a partial of the wrong length");
        Some(Transmit {
            header: repr.to_bytes(),
            payload,
            to: Ranks::new(&[], None, Some(to)),
        })
    }

    /// Home slot `slot`'s stored result, to rack `rack`'s slot of it.
    pub(super) fn partial_result_transmit(
        &self,
        job: u16,
        slot: u32,
        rack: u16,
    ) -> Option<Transmit<'_, Ranks<'_, A>>> {
        let j = self.job(job)?;
        let h = j.hier.as_deref()?;
        let home = h.home.as_ref()?;
        let s = home.slots.get(slot as usize)?;
        let (to, rack_slot) = h.rack_slot_of(rack, slot)?;
        let repr = answer(MsgType::PartialResult, j, s, s.completed.get()?, rack_slot);
        Some(Transmit {
            header: repr.to_bytes(),
            payload: s.result_bytes(slot, None, &home.blocks),
            to: Ranks::new(&[], None, Some(to)),
        })
    }
}

/// Home slot `slot` of `job` completed a round here: its result is queued
/// for every rack's slot of the chunk (PROTOCOL.md §9.4 rule 2).
pub(super) fn home_done<A>(
    pending: &mut Vec<Pending<A>>,
    c: &ShardCounters,
    job: &Job<A>,
    slot: u32,
) -> Verdict {
    let racks = job.hier.as_ref().map_or(0, |h| h.racks);
    c.partial_results_sent.add(u64::from(racks));
    pending.extend((0..racks).map(|rack| Pending::PartialResult {
        job: job.id,
        slot,
        rack,
    }));
    Verdict::Completed
}

/// Checks a hierarchical job's install against its spec (PROTOCOL.md §9.1)
/// and makes what each of this appliance's `n` lcores is told, with this
/// appliance's part of the home layout.
pub fn hierarchy_plan(req: &InstallJob, n: usize) -> Result<(Layout, Vec<HierInstall>), String> {
    let spec = &req.spec;
    let (Some(h), Some(ranks)) = (&req.hierarchy, spec.rack_ranks()) else {
        return Err("not a hierarchical job".into());
    };
    if h.racks.len() != ranks.len() {
        return Err(format!(
            "{} racks in the hierarchy; the spec's placement has {}",
            h.racks.len(),
            ranks.len()
        ));
    }
    let rack = usize::from(h.rack);
    let me = h
        .racks
        .get(rack)
        .ok_or_else(|| format!("rack {} of {}", h.rack, h.racks.len()))?;
    if me.layout != req.layout {
        return Err(format!(
            "the layout is not rack {}'s ({}) in the hierarchy",
            h.rack, me.name
        ));
    }
    let mut all = Vec::new();
    let mut racks = Vec::with_capacity(h.racks.len());
    for (r, p) in h.racks.iter().enumerate() {
        let at = |e: String| format!("rack {r} ({}): {e}", p.name);
        Placement::new(spec, p.layout.clone()).map_err(|e| at(e.to_string()))?;
        let ip: Ipv4Addr = p
            .data
            .host
            .parse()
            .map_err(|_| at(format!("data host {:?} is not an IPv4 address", p.data.host)))?;
        let addrs = (0..p.layout.lcores.len())
            .map(|l| {
                u16::try_from(l)
                    .ok()
                    .and_then(|l| p.data.base_port.checked_add(l))
                    .map(|port| SocketAddrV4::new(ip, port))
                    .ok_or_else(|| at(format!("lcore {l} has no UDP port above {}", p.data.base_port)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        all.extend(addrs.iter().copied());
        racks.push(Peers {
            addrs,
            runs: p.layout.lcores.clone(),
        });
    }
    Placement::new(spec, h.homes.clone()).map_err(|e| format!("home layout: {e}"))?;
    if h.homes.lcores.len() != all.len() {
        return Err(format!(
            "the home layout spans {} lcores; the racks' appliances have {}",
            h.homes.lcores.len(),
            all.len()
        ));
    }
    let home = h
        .home_part()
        .ok_or_else(|| "the home layout does not cover this rack".to_string())?;
    let home_runs = &home.lcores;
    let chunks = Chunks::new(spec);
    // A replicated job's home slots are replicated over the home layout
    // (PROTOCOL.md §11.11): the racks' appliances in rack order, each its
    // own rack (a replica set is the next appliances in rack order).
    let mut replicas = if spec.replicas() > 1 {
        let appliances = racks
            .iter()
            .zip(&h.racks)
            .map(|(p, r)| {
                let ip = *p.addrs.first().map_or(&Ipv4Addr::UNSPECIFIED, SocketAddrV4::ip);
                (
                    ip,
                    r.data.base_port,
                    u16::try_from(p.addrs.len()).unwrap_or(u16::MAX),
                )
            })
            .collect::<Vec<_>>();
        // The install's rack labels where it has them (any distinct ones
        // give the same sets: one rack per appliance).
        let labels: Vec<String> = match &req.replication {
            Some(r) if r.appliances.len() == h.racks.len() => {
                r.appliances.iter().map(|a| a.rack.clone()).collect()
            }
            _ => h.racks.iter().map(|r| r.name.clone()).collect(),
        };
        let view = req.replication.as_ref().map(|r| r.view()).unwrap_or_default();
        let plan =
            super::replica::replica_plan_at(spec, &h.homes.lcores, &appliances, &labels, h.rack, &view)
                .map_err(|e| format!("replicas of the home layout: {e}"))?;
        if plan.len() != n
            || plan
                .iter()
                .zip(home_runs)
                .any(|((own, _), run)| own.len() as u64 != run.count)
        {
            return Err("replicas of the home layout: its primary slots are not the home slots".into());
        }
        plan.into_iter().map(|(_, rep)| Some(rep)).collect()
    } else {
        vec![None; n]
    };
    let per_lcore = (0..n)
        .map(|i| HierInstall {
            rack: h.rack,
            ranks: ranks[rack].clone(),
            optimizer: spec.optimizer,
            first: req.layout.lcores[i].first,
            racks: racks.clone(),
            homes: Peers {
                addrs: all.clone(),
                runs: h.homes.lcores.clone(),
            },
            home_first: home_runs[i].first,
            home_slots: chunks.iter(home_runs[i].range()).collect(),
            replica: replicas[i].take(),
        })
        .collect();
    Ok((home, per_lcore))
}
