//! The outbox: messages queued while handling packets ([`Pending`]) and
//! the [`Transmit`]s the backend sends from them, with their destination
//! lists ([`Ranks`]).

use phub_proto::replica;
use phub_proto::wire;
use phub_proto::wire::{flags, MsgType, Repr, APPLIANCE_RANK, HEADER_LEN};

use crate::transmit::{Destinations, Transmit};

use super::replica::Replica;
use super::slot::{RankSet, Slot};
use super::{Job, Shard};

/// The bytes of the queued table answers ([`Pending::Answer`]):
/// `buf[..len]` is queued; the bytes past it were written by earlier
/// bursts and are written over without being zeroed again (a table
/// answer's writer writes every byte it sends: the header, whose
/// preamble zeroes the fields an answer leaves, the ids, the rows). Zeroed as the writers asked for room, they
/// were 2% of a BSP table run's CPU (`perf`, BENCHMARKS.md). Keeps its
/// room between bursts, as the pending list does.
#[derive(Debug, Default)]
pub(super) struct AnswerBytes {
    buf: Vec<u8>,
    len: usize,
}

impl AnswerBytes {
    /// The bytes queued.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Room for `n` bytes from `at` (at least [`AnswerBytes::len`]: the
    /// bytes between are skipped, never sent), now queued; their contents
    /// are whatever earlier bursts left there (the caller writes them
    /// all).
    pub(super) fn room(&mut self, at: usize, n: usize) -> &mut [u8] {
        debug_assert!(
            at >= self.len,
            "room at {at} inside the {} bytes queued",
            self.len
        );
        let end = at + n;
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        self.len = end;
        &mut self.buf[at..end]
    }

    /// Bytes `r` of those queued.
    pub(super) fn get(&self, r: std::ops::Range<usize>) -> Option<&[u8]> {
        self.buf[..self.len].get(r)
    }

    /// Forgets what was queued (once sent).
    pub(super) fn clear(&mut self) {
        self.len = 0;
    }
}

/// Who gets a queued result.
#[derive(Debug, Clone, Copy)]
pub(super) enum To {
    /// Every rank (a completed BSP round).
    All,
    /// One rank.
    One(u16),
    /// These ranks (released bounded-delay answers).
    Set(RankSet),
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Pending<A> {
    /// The stored result (current values) of a slot, with the round field
    /// `round` (BSP: the slot's last completed round when sent).
    Result {
        job: u16,
        slot: u32,
        to: To,
        round: Option<u32>,
    },
    /// A refusal notice to a token-authenticated sender; `epoch` goes in
    /// the header's epoch field (a replicated job's, PROTOCOL.md §11.5).
    Error {
        repr: Repr,
        epoch: u32,
        entry: u32,
        to: A,
    },
    /// A rack slot's partial sum, to the chunk's home.
    Partial { job: u16, slot: u32, attempt: Attempt },
    /// A home slot's stored result, to rack `rack`'s slot of the chunk.
    PartialResult { job: u16, slot: u32, rack: u16 },
    /// A table message built whole (a replica's or a table copy's): bytes
    /// `at .. at + len` of the shard's row outbox, header first.
    Row { at: u32, len: u32, to: A },
    /// A table answer (ROW_RESULT, ROW_DONE, ROW_PULL_RESULT): bytes
    /// `at .. at + len` of the shard's [`AnswerBytes`], header first.
    Answer { at: u32, len: u32, to: A },
    /// A primary slot's pending aggregate, to its backup `backup` (an
    /// index into the chunk's backups).
    Replicate {
        job: u16,
        slot: u32,
        backup: u8,
        attempt: Attempt,
    },
    /// Update `t` of a primary slot of an async or bounded-delay job, to
    /// its backup `backup` (PROTOCOL.md §11.10).
    Update {
        job: u16,
        slot: u32,
        backup: u8,
        t: u32,
        attempt: Attempt,
    },
    /// Acknowledgements of backup slots' rounds to one primary lcore, in
    /// one REPLICATE_ACK (PROTOCOL.md §11.3): its header, built whole, is
    /// bytes `at .. at + HEADER_LEN` of the shard's ack outbox, and its
    /// `more` further acknowledgements follow it there.
    ReplicaAcks { job: u16, at: u32, more: u16, to: A },
    /// Fragment `fragment` of a primary slot's state copy, to its new
    /// backup `backup` (PROTOCOL.md §11.7).
    State {
        job: u16,
        slot: u32,
        backup: u8,
        fragment: u8,
        attempt: Attempt,
    },
    /// The ACK of backup slot `slot` of the part of home `home`'s
    /// installed state copy.
    StateAck { job: u16, home: u16, slot: u32 },
}

/// Whether a queued message goes for the first time or again, its timer
/// having gone off (the header then has [`flags::RETRANSMIT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Attempt {
    /// The first time.
    First,
    /// Again.
    Again,
}

impl Attempt {
    /// The header's flags for it: [`flags::RETRANSMIT`] when again.
    pub(super) fn flags(self) -> u8 {
        match self {
            Attempt::First => 0,
            Attempt::Again => flags::RETRANSMIT,
        }
    }
}

/// The destinations of a queued message: every known rank's endpoint (or
/// those of the ranks that do, or do not, use shared memory), or one. A
/// round's result to ranks of both kinds is two transmits: the header with
/// the SHM flag and no payload to the ranks using shared memory, the header
/// and payload to the others.
#[derive(Debug, Clone)]
pub struct Ranks<'a, A> {
    all: std::iter::Enumerate<std::slice::Iter<'a, Option<A>>>,
    /// Only the ranks whose membership in the set is the flag.
    only: Option<(RankSet, bool)>,
    one: Option<A>,
}

impl<'a, A: Copy> Ranks<'a, A> {
    pub(super) fn new(all: &'a [Option<A>], only: Option<(RankSet, bool)>, one: Option<A>) -> Ranks<'a, A> {
        Ranks {
            all: all.iter().enumerate(),
            only,
            one,
        }
    }
}

impl<A: Copy> Iterator for Ranks<'_, A> {
    type Item = A;
    // Cast: r indexes a job's endpoints, one per rank, fewer than
    // MAX_WORKERS (256, checked in Shard::install_with).
    #[allow(clippy::cast_possible_truncation)]
    fn next(&mut self) -> Option<A> {
        if let Some(a) = self.one.take() {
            return Some(a);
        }
        let only = self.only;
        self.all
            .by_ref()
            .filter(|(r, _)| only.is_none_or(|(set, member)| set.contains(*r as u16) == member))
            .find_map(|(_, e)| *e)
    }
}

impl<A: Copy> Destinations for Ranks<'_, A> {
    fn planned(&self) -> usize {
        self.clone().count()
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// What must be sent now, in the order it was queued.
    pub fn transmits(&self) -> impl Iterator<Item = Transmit<'_, Ranks<'_, A>>> + '_ {
        self.pending.iter().flat_map(move |p| {
            let [a, b] = self.transmits_of(p);
            a.into_iter().chain(b)
        })
    }

    /// The one or two transmits of a queued message: a result to ranks of
    /// both kinds (shared memory or not) is two.
    pub(super) fn transmits_of(&self, p: &Pending<A>) -> [Option<Transmit<'_, Ranks<'_, A>>>; 2] {
        let (job, slot, to, round) = match *p {
            Pending::Result { job, slot, to, round } => (job, slot, to, round),
            Pending::Error {
                repr,
                epoch,
                entry,
                to,
            } => {
                let mut header = repr.to_bytes();
                let mut h = wire::Header::new_unchecked(&mut header[..]);
                h.set_epoch(epoch);
                h.set_entry(entry);
                let t = Transmit {
                    header,
                    payload: &[],
                    to: Ranks::new(&[], None, Some(to)),
                };
                return [Some(t), None];
            }
            Pending::Partial { job, slot, attempt } => {
                return [self.partial_transmit(job, slot, attempt), None]
            }
            Pending::PartialResult { job, slot, rack } => {
                return [self.partial_result_transmit(job, slot, rack), None];
            }
            Pending::Row { at, len, to } => return [whole(self.rows_out.get(span(at, len)), to), None],
            Pending::Answer { at, len, to } => return [whole(self.answers_out.get(span(at, len)), to), None],
            Pending::Replicate {
                job,
                slot,
                backup,
                attempt,
            } => return [self.replicate_transmit(job, slot, backup, attempt), None],
            Pending::Update {
                job,
                slot,
                backup,
                t,
                attempt,
            } => return [self.update_transmit(job, slot, backup, t, attempt), None],
            Pending::ReplicaAcks { at, more, to, .. } => {
                let at = at as usize;
                let end = at + HEADER_LEN + usize::from(more) * replica::ACK_ENTRY_LEN;
                let msg = self.acks_out.get(at..end);
                debug_assert!(msg.is_some(), "queued acknowledgements inside the ack outbox");
                let Some(msg) = msg else { return [None, None] };
                let (head, payload) = msg.split_at(HEADER_LEN);
                let mut header = [0u8; HEADER_LEN];
                header.copy_from_slice(head);
                // `count`: two f32 words per further acknowledgement.
                wire::Header::new_unchecked(&mut header[..]).set_count(2 * more);
                let t = Transmit {
                    header,
                    payload,
                    to: Ranks::new(&[], None, Some(to)),
                };
                return [Some(t), None];
            }
            Pending::State {
                job,
                slot,
                backup,
                fragment,
                attempt,
            } => return [self.state_transmit(job, slot, backup, fragment, attempt), None],
            Pending::StateAck { job, home, slot } => return [self.state_ack_transmit(job, home, slot), None],
        };
        let Some((j, s)) = self.job(job).and_then(|j| Some((j, j.slots.get(slot as usize)?))) else {
            return [None, None];
        };
        // A BSP result goes once its round completed.
        let Some(round) = round.or(s.completed.get()) else {
            return [None, None];
        };
        let repr = answer(MsgType::Result, j, s, round, slot);
        let payload = s.result_bytes(slot, j.shm.as_ref(), &j.blocks);
        // What a worker checks first (`length_mismatch`): the stored result
        // is as long as the header says, in every result kind.
        debug_assert_eq!(
            payload.len(),
            repr.payload_len(),
            "job {job} slot {slot}: a result of the wrong length"
        );
        let share = self.rx_share(j);
        // A replicated job's RESULT carries the lcore's epoch (PROTOCOL.md
        // §2): a worker drops one sent before the job went back to its
        // checkpoints (§11.7).
        let epoch = j.replica.as_deref().map_or(0, Replica::epoch);
        let stamped = |r: Repr| {
            let mut h = r.to_bytes();
            let mut w = wire::Header::new_unchecked(&mut h[..]);
            w.set_rx_share(share);
            w.set_epoch(epoch);
            h
        };
        let plain = |to| Transmit {
            header: stamped(repr),
            payload,
            to,
        };
        // The result is in the result region: the header says so, alone.
        let shm = |to| Transmit {
            header: stamped(Repr {
                flags: flags::SHM,
                ..repr
            }),
            payload: &[],
            to,
        };
        let ranks = |only| Ranks::new(&j.endpoints, only, None);
        match to {
            // Non-BSP jobs have no shared-memory regions: datagrams alone.
            To::Set(set) => [Some(plain(ranks(Some((set, true))))), None],
            To::One(r) => {
                let one = Ranks::new(&[], None, j.endpoints.get(usize::from(r)).copied().flatten());
                if j.shm_ranks.contains(r) {
                    [Some(shm(one)), None]
                } else {
                    [Some(plain(one)), None]
                }
            }
            To::All => match j.shm_ranks.len() {
                0 => [Some(plain(ranks(None))), None],
                n if n == u32::from(j.workers) => [Some(shm(ranks(None))), None],
                _ => [
                    Some(plain(ranks(Some((j.shm_ranks, false))))),
                    Some(shm(ranks(Some((j.shm_ranks, true))))),
                ],
            },
        }
    }

    /// Whether anything is waiting to be sent.
    pub fn has_transmits(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Forgets what [`Shard::transmits`] returned, once it has been sent.
    pub fn clear_transmits(&mut self) {
        self.pending.clear();
        self.rows_out.clear();
        self.answers_out.clear();
        self.acks_out.clear();
    }
}

/// Bytes `at .. at + len`.
fn span(at: u32, len: u32) -> std::ops::Range<usize> {
    at as usize..at as usize + len as usize
}

/// The transmit of a message queued whole in a row outbox (`msg`: its
/// bytes, header first), to `to`.
fn whole<A: Copy>(msg: Option<&[u8]>, to: A) -> Option<Transmit<'_, Ranks<'_, A>>> {
    debug_assert!(msg.is_some(), "a queued table message inside its outbox");
    let (head, payload) = msg?.split_at(HEADER_LEN);
    let mut header = [0u8; HEADER_LEN];
    header.copy_from_slice(head);
    Some(Transmit {
        header,
        payload,
        to: Ranks::new(&[], None, Some(to)),
    })
}

/// The header of the appliance's answer of `kind` (RESULT, PARTIAL_RESULT)
/// carrying slot `s`'s stored result of `round` of job `j`, addressed to
/// `slot` at the receiving end.
pub(super) fn answer<A>(kind: MsgType, j: &Job<A>, s: &Slot, round: u32, slot: u32) -> Repr {
    // Cast: s.elems <= MAX_PAYLOAD / dtype size (checked at install; a
    // home slot's, MAX_PAYLOAD / 4).
    #[allow(clippy::cast_possible_truncation)]
    let count = s.elems as u16;
    Repr {
        kind,
        dtype: j.dtype,
        flags: 0,
        token: j.token,
        job: j.id,
        rank: APPLIANCE_RANK,
        count,
        error: 0,
        round,
        slot,
        key: s.key,
        chunk: s.chunk,
    }
}
