//! Where the lcores a stalled rank has nothing out on stand (PROTOCOL.md
//! §6.1, "A stalled rank"): a flat, unreplicated job's lcore restored from
//! a checkpoint older than rounds it completed tells a rank so only by
//! refusing one of its messages (`ahead`, `nothing_to_pull`). A rank whose
//! chunks there are all answered sends it none: waiting on another lcore
//! for a rank that waits on the restored one, it would wait for ever
//! (simulator seed 81589: a rank rejoined while appliance 1 was down; back
//! from a checkpoint taken before round 0 completed, appliance 1 waited
//! for the other ranks' INITs, which waited on appliance 0 for the
//! rejoined rank's round 1, which it sends only once its INITs are
//! answered).
//!
//! So the transport remembers, per lcore, the last chunk answered there
//! and its round; once the loss timer has found a silence twice over, it
//! PULLs that chunk from every lcore it has nothing out on. The answer
//! says where the lcore stands: a round below the one remembered (twice
//! in a row: an old RESULT delayed in the network reads the same once), or
//! `nothing_to_pull` echoing the PULL's round (a nonce), means the lcore
//! lost rounds this rank holds the results of, and every request fails
//! with `ahead`, as a refusal would have made it: the caller pulls every
//! key and repeats the rounds since.

use std::net::SocketAddr;

use phub_proto::wire::{DropReason, Header, MsgType, Repr, HEADER_LEN};

use super::JobInfo;

/// The last chunk answered on an lcore.
#[derive(Debug, Clone, Copy)]
struct Watched {
    key: u32,
    chunk: u32,
    slot: u32,
    to: SocketAddr,
    /// The round its last accepted RESULT carried: the lcore has completed
    /// it, unless it lost it.
    round: u32,
    /// The round field (a nonce) of the PULL out to it, if one is.
    probe: Option<u32>,
    /// Answers in a row that stood below `round`.
    below: u32,
}

/// What a probe's answer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Not a probe's answer, or the lcore stands where it stood.
    Nothing,
    /// The lcore stands below a round it answered: restored behind this
    /// rank. The key, chunk and round of what it lost.
    Behind { key: u32, chunk: u32, round: u32 },
}

/// The lcores' last answered chunks and the probes out to them.
#[derive(Debug, Default)]
pub(super) struct Watch {
    lcores: Vec<Option<Watched>>,
    nonce: u32,
    /// The PULLs to send at the next transmit: headers back to back.
    headers: Vec<u8>,
    to: Vec<SocketAddr>,
    /// How many of them the last transmit gave out.
    handed: usize,
}

impl Watch {
    /// A RESULT of `round` for `key`'s chunk `chunk` at `slot` was accepted
    /// from lcore `lcore` at `to`.
    pub(super) fn answered(
        &mut self,
        lcore: u16,
        key: u32,
        chunk: u32,
        slot: u32,
        to: SocketAddr,
        round: u32,
    ) {
        let l = usize::from(lcore);
        if self.lcores.len() <= l {
            self.lcores.resize(l + 1, None);
        }
        self.lcores[l] = Some(Watched {
            key,
            chunk,
            slot,
            to,
            round,
            probe: None,
            below: 0,
        });
    }

    /// Queues a PULL to every lcore remembered for which `busy` is false
    /// (the rank has chunks out there, whose resends ask it already), and
    /// again to every lcore whose last probe found an older round and was
    /// not confirmed, busy or not: the rank may have pushed chunks of a
    /// later round there since, which a restored lcore with that round in
    /// progress drops as duplicates and never refuses (simulator seed
    /// 155482: the PULL to confirm an older round never came back, and
    /// every rank then waited on another). Returns how many.
    pub(super) fn probe(&mut self, info: &JobInfo, busy: impl Fn(u16) -> bool) -> u64 {
        let mut asked = 0;
        for l in 0..self.lcores.len() {
            let unconfirmed = self.lcores[l].is_some_and(|w| w.probe.is_some() && w.below > 0);
            // Cast: `lcores` grows only to a u16 lcore's index + 1.
            #[allow(clippy::cast_possible_truncation)]
            if busy(l as u16) && !unconfirmed {
                continue;
            }
            if self.lcores[l].is_some() {
                self.send(info, l);
                asked += 1;
            }
        }
        asked
    }

    /// Queues a PULL of lcore `l`'s remembered chunk, with a fresh nonce.
    fn send(&mut self, info: &JobInfo, l: usize) {
        let Some(w) = self.lcores[l].as_mut() else {
            return;
        };
        self.nonce = self.nonce.wrapping_add(1);
        w.probe = Some(self.nonce);
        let repr = Repr::request(MsgType::Pull, info.job, info.token, info.rank, self.nonce, w.slot)
            .with_payload(info.dtype, 0)
            .with_chunk(w.key, w.chunk);
        let at = self.headers.len();
        self.headers.resize(at + HEADER_LEN, 0);
        repr.emit(&mut Header::new_unchecked(&mut self.headers[at..]));
        self.to.push(w.to);
    }

    /// Forgets the PULLs the last [`Watch::hand_out`] gave (sent by now),
    /// and gives out every PULL queued, as (destination, datagram).
    pub(super) fn hand_out(&mut self) -> impl Iterator<Item = (SocketAddr, &[u8])> {
        self.to.drain(..self.handed);
        self.headers.drain(..self.handed * HEADER_LEN);
        self.handed = self.to.len();
        self.to.iter().copied().zip(self.headers.chunks_exact(HEADER_LEN))
    }

    /// Reads an accepted RESULT or ERROR from `from` (where known) as the
    /// answer to a probe, if it is one.
    pub(super) fn on_answer(&mut self, info: &JobInfo, repr: &Repr, from: Option<SocketAddr>) -> Verdict {
        let Some(l) = self.lcores.iter().position(|w| {
            w.is_some_and(|w| {
                w.probe.is_some()
                    && (w.key, w.chunk, w.slot) == (repr.key, repr.chunk, repr.slot)
                    && from.is_none_or(|f| f == w.to)
            })
        }) else {
            return Verdict::Nothing;
        };
        let Some(w) = self.lcores[l].as_mut() else {
            return Verdict::Nothing;
        };
        let behind = Verdict::Behind {
            key: w.key,
            chunk: w.chunk,
            round: w.round,
        };
        match repr.kind {
            MsgType::Error
                if repr.error == DropReason::NothingToPull.code() && Some(repr.round) == w.probe =>
            {
                behind
            }
            MsgType::Result if repr.round < w.round => {
                w.below += 1;
                if w.below >= 2 {
                    return behind;
                }
                // Once could be an old RESULT the network held back: ask
                // again, now that it is in.
                self.send(info, l);
                Verdict::Nothing
            }
            MsgType::Result => {
                w.probe = None;
                w.below = 0;
                Verdict::Nothing
            }
            _ => Verdict::Nothing,
        }
    }

    /// Forgets every lcore: the rank is to pull every key.
    pub(super) fn reset(&mut self) {
        self.lcores.clear();
    }
}
