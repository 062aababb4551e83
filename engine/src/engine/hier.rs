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

use std::net::SocketAddrV4;
use std::ops::Range;

use phub_proto::layout::{ChunkRange, SlotChunk};
use phub_proto::spec::Optimizer;

use super::{Slot, NO_ROUND};
use crate::slotmem::SlotBlock;

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
    pub racks: Vec<(Vec<SocketAddrV4>, Vec<ChunkRange>)>,
    /// The home layout: every rack appliance's lcores' addresses, rack 0's
    /// first, and the runs over them.
    pub homes: (Vec<SocketAddrV4>, Vec<ChunkRange>),
    /// This lcore's home slots: the sequence number of slot 0, and the
    /// chunks (empty when this lcore is home to none).
    pub home_first: u64,
    /// The chunks of this lcore's home slots, in slot order.
    pub home_slots: Vec<SlotChunk>,
}

/// The lcores of one appliance (or of all, for the home layout) and the
/// runs of chunks they hold.
#[derive(Debug)]
pub(super) struct Peers<A> {
    pub addrs: Vec<A>,
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
    /// The round it belongs to; [`NO_ROUND`] when none is waiting.
    pub round: u32,
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
            round: NO_ROUND,
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

    /// The timeout after `resends` resends.
    pub(super) fn rto(&self, resends: u8) -> u64 {
        let base = if self.srtt == 0 {
            INITIAL_RTO_NS
        } else {
            (self.srtt + 4 * self.rttvar).clamp(MIN_RTO_NS, MAX_RTO_NS)
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
