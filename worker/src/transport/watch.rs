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
//! So the transport remembers, per lcore, the last [`REMEMBERED`] distinct
//! chunks answered there and their rounds; once the loss timer has found
//! a silence twice over, it PULLs those chunks from every lcore it has
//! nothing out on. The answer says where the lcore stands: a round below
//! the one remembered (twice in a row: an old RESULT delayed in the
//! network reads the same once), or `nothing_to_pull` echoing the PULL's
//! round (a nonce), means the lcore lost rounds this rank holds the
//! results of, and every request fails with `ahead`, as a refusal would
//! have made it: the caller pulls every key and repeats the rounds since.
//!
//! Why several: the chunk answered last is not always the one completed
//! last. An answer lost in the network comes to a resend long after the
//! chunk completed, and a checkpoint taken between the two completions
//! keeps the chunk answered last and loses the other (simulator seed
//! 229254: rank 1's INIT of one chunk completed after the checkpoint and
//! was answered at once; its INIT of another, completed before the
//! checkpoint, was answered only to a resend, later; the probes of that
//! one found the restored lcore where the rank had left it, while the
//! other ranks waited there for rank 1's INIT of the first for ever).
//!
//! A probe carries the PROBE flag: the lcore answers it as any PULL but
//! still refuses the rank's next INIT or PUSH `ahead` after a restore
//! (PROTOCOL.md §5.4 rule 0), which a plain PULL would have lifted. A
//! probe that misses what the lcore lost (or whose answer is lost) so
//! leaves the rank the refusal to learn it from, on an lcore it sends to.

use std::net::SocketAddr;

use phub_proto::wire::{flags, DropReason, Header, MsgType, Repr, HEADER_LEN};

use super::JobInfo;

/// A chunk answered on an lcore.
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

/// How many distinct chunks the watch remembers per lcore, the last
/// answered (module head): a stalled rank PULLs each.
pub(super) const REMEMBERED: usize = 4;

/// The lcores' last answered chunks and the probes out to them.
#[derive(Debug, Default)]
pub(super) struct Watch {
    /// Per lcore, its last [`REMEMBERED`] distinct chunks answered, the
    /// latest last.
    lcores: Vec<Vec<Watched>>,
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
            self.lcores.resize(l + 1, Vec::new());
        }
        let seen = &mut self.lcores[l];
        seen.retain(|w| (w.key, w.chunk) != (key, chunk));
        if seen.len() == REMEMBERED {
            seen.remove(0);
        }
        seen.push(Watched {
            key,
            chunk,
            slot,
            to,
            round,
            probe: None,
            below: 0,
        });
    }

    /// Queues a PULL of every chunk remembered on each lcore for which
    /// `busy` is false (the rank has chunks out there, whose resends ask
    /// it already), and again of every chunk whose last probe found an
    /// older round and was not confirmed, on a busy lcore too: the rank
    /// may have pushed chunks of a later round there since, which a
    /// restored lcore with that round in progress drops as duplicates and
    /// never refuses (simulator seed 155482: the PULL to confirm an older
    /// round never came back, and every rank then waited on another).
    /// Returns how many.
    pub(super) fn probe(&mut self, info: &JobInfo, busy: impl Fn(u16) -> bool) -> u64 {
        let mut asked = 0;
        for l in 0..self.lcores.len() {
            // Cast: `lcores` grows only to a u16 lcore's index + 1.
            #[allow(clippy::cast_possible_truncation)]
            let busy = busy(l as u16);
            for i in 0..self.lcores[l].len() {
                let w = &self.lcores[l][i];
                if !busy || (w.probe.is_some() && w.below > 0) {
                    self.send(info, l, i);
                    asked += 1;
                }
            }
        }
        asked
    }

    /// Queues a PULL of lcore `l`'s `i`-th remembered chunk, with a fresh
    /// nonce.
    fn send(&mut self, info: &JobInfo, l: usize, i: usize) {
        let Some(w) = self.lcores[l].get_mut(i) else {
            return;
        };
        self.nonce = self.nonce.wrapping_add(1);
        w.probe = Some(self.nonce);
        let repr = Repr::request(MsgType::Pull, info.job, info.token, info.rank, self.nonce, w.slot)
            .with_payload(info.dtype, 0)
            .with_chunk(w.key, w.chunk)
            .with_flags(flags::PROBE);
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
        let probed = |w: &Watched| {
            w.probe.is_some()
                && (w.key, w.chunk, w.slot) == (repr.key, repr.chunk, repr.slot)
                && from.is_none_or(|f| f == w.to)
        };
        let Some((l, i)) = self
            .lcores
            .iter()
            .enumerate()
            .find_map(|(l, seen)| Some((l, seen.iter().position(probed)?)))
        else {
            return Verdict::Nothing;
        };
        let w = &mut self.lcores[l][i];
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
                self.send(info, l, i);
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

#[cfg(test)]
mod tests {
    use super::*;
    use phub_proto::Dtype;

    const INFO: JobInfo = JobInfo {
        job: 1,
        token: 7,
        rank: 1,
        dtype: Dtype::F32,
        in_order: true,
    };

    /// The (key, chunk, nonce) of each PULL the watch gives out.
    fn pulls(w: &mut Watch) -> Vec<(u32, u32, u32)> {
        w.hand_out()
            .map(|(_, d)| {
                let h = Header::new_checked(d).unwrap();
                (h.key(), h.chunk(), h.round())
            })
            .collect()
    }

    /// Seed 229254's shape: the chunk the restored lcore lost was not the
    /// one answered last there. Every chunk of the last few is asked, and
    /// `nothing_to_pull` for the lost one says the lcore is behind.
    #[test]
    fn a_stalled_rank_asks_the_last_chunks_answered_and_finds_the_one_lost() {
        let to: SocketAddr = "10.1.0.0:9000".parse().unwrap();
        let mut w = Watch::default();
        // Chunk 8 answered first (completed after the checkpoint), chunk 3
        // later (completed before it, its answer lost and resent).
        w.answered(0, 1, 8, 14, to, 0);
        w.answered(0, 1, 3, 9, to, 0);
        assert_eq!(w.probe(&INFO, |_| false), 2);
        let asked = pulls(&mut w);
        assert_eq!(
            asked.iter().map(|&(k, c, _)| (k, c)).collect::<Vec<_>>(),
            [(1, 8), (1, 3)]
        );
        // Chunk 3 stands where the rank left it: nothing.
        let mut answer = Repr::request(MsgType::Result, 1, 7, u16::MAX, 0, 9).with_chunk(1, 3);
        assert_eq!(w.on_answer(&INFO, &answer, Some(to)), Verdict::Nothing);
        // Chunk 8's INIT is gone: the ERROR echoes its probe's nonce.
        answer = Repr::request(MsgType::Error, 1, 7, 1, asked[0].2, 14).with_chunk(1, 8);
        answer.error = DropReason::NothingToPull.code();
        assert_eq!(
            w.on_answer(&INFO, &answer, Some(to)),
            Verdict::Behind {
                key: 1,
                chunk: 8,
                round: 0
            }
        );
    }

    /// At most [`REMEMBERED`] chunks per lcore, the latest answered, each
    /// once (at its last round); a busy lcore is not asked.
    #[test]
    fn the_watch_remembers_the_last_distinct_chunks_of_each_lcore() {
        let to: SocketAddr = "10.1.0.0:9000".parse().unwrap();
        let mut w = Watch::default();
        for c in 0..6u32 {
            w.answered(0, 0, c, c, to, 1);
        }
        w.answered(0, 0, 3, 3, to, 2);
        w.answered(1, 0, 9, 0, to, 1);
        assert_eq!(w.probe(&INFO, |l| l == 1), REMEMBERED as u64);
        let asked: Vec<u32> = pulls(&mut w).iter().map(|&(_, c, _)| c).collect();
        assert_eq!(asked, [2, 4, 5, 3]);
    }
}
