//! Which rows a row store evicts: at the cap, CLOCK; after `idle_rounds`
//! rounds without an update, an incremental sweep.
//!
//! Both walk the id index (whose entries carry each row's touch word: the
//! CLOCK bit and the round of its last update), not the rows, so deciding
//! costs no access to row memory.
//!
//! - CLOCK (second chance): a hand moves over the index; a full entry with
//!   its bit set has the bit cleared and is passed, the first one with the
//!   bit clear is the victim. Every update sets the bit, so a row updated
//!   since the hand last passed survives one not updated: the least
//!   recently updated rows go first, approximately, in O(1) amortized. The
//!   hand stays on the victim's entry, which a later entry of the cluster
//!   may fill when the victim is removed.
//! - Idle: each round the sweep examines `ceil(index entries / idle_rounds)`
//!   entries from where it stopped and evicts those not updated for
//!   `idle_rounds` rounds or more, so a lap takes `idle_rounds` rounds and
//!   a row is evicted between `idle_rounds` and about twice that many
//!   rounds after its last update; no round does more than its share, and
//!   no packet does any. (An entry that a cap eviction shifts back past the
//!   sweep's hand waits for the next lap.)
//!
//! - Idle by time (`idle_s`): [`RoundTimes`] keeps when rounds completed
//!   (a fixed ring of 32 samples, at least `idle_s` / 16 apart), and each
//!   round the sweep's rounds become those since the newest sampled round
//!   that completed `idle_s` or more ago: the same sweep then evicts the
//!   rows updated in that round or before. No round old enough yet (or
//!   none since a restart: samples are not checkpointed), no eviction.
//!
//! Reads do not count as touches: a store's reads take `&self`, and in
//! training the rows a worker pulls are the rows it pushes.

use super::index::{touch_age, Index};

/// The CLOCK hand.
#[derive(Debug, Default)]
pub(crate) struct Clock {
    /// The entry the hand is on (a checkpoint keeps it).
    pub(crate) hand: usize,
}

impl Clock {
    /// The position of the entry to evict (the index must hold a row);
    /// clears the bits of the entries passed.
    pub(crate) fn victim(&mut self, index: &mut Index) -> usize {
        assert!(index.len() > 0, "CLOCK on an empty index");
        let n = index.capacity();
        // Terminates within two laps: the first clears every bit it passes.
        loop {
            if self.hand >= n {
                self.hand = 0;
            }
            let e = *index.entry(self.hand);
            if e.is_full() {
                if e.touch & 1 == 0 {
                    return self.hand;
                }
                index.set_touch(self.hand, e.touch & !1);
            }
            self.hand += 1;
        }
    }
}

/// The idle sweep.
#[derive(Debug)]
pub(crate) struct IdleSweep {
    /// The entry the sweep goes on from (a checkpoint keeps it).
    pub(crate) hand: usize,
    idle_rounds: u32,
    per_round: usize,
}

impl IdleSweep {
    /// A sweep over an index of `entries` entries evicting rows idle for
    /// `idle_rounds` rounds.
    pub(crate) fn new(entries: usize, idle_rounds: u32) -> IdleSweep {
        assert!(idle_rounds > 0 && entries > 0);
        IdleSweep {
            hand: 0,
            idle_rounds,
            per_round: entries.div_ceil(idle_rounds as usize),
        }
    }

    /// The rounds a row must go without an update to be evicted.
    pub(crate) fn idle_rounds(&self) -> u32 {
        self.idle_rounds
    }

    /// Evict rows idle for `idle_rounds` rounds from now on, with a lap
    /// of about that many rounds over an index of `entries` entries.
    pub(crate) fn set_idle_rounds(&mut self, entries: usize, idle_rounds: u32) {
        self.idle_rounds = idle_rounds.max(1);
        self.per_round = entries.div_ceil(self.idle_rounds as usize);
    }

    /// One round's share of the sweep at round `now`: calls `evict` with
    /// the position of each idle row (which `evict` must remove from the
    /// index before returning).
    pub(crate) fn sweep(&mut self, index: &mut Index, now: u32, mut evict: impl FnMut(&mut Index, usize)) {
        let n = index.capacity();
        for _ in 0..self.per_round {
            if self.hand >= n {
                self.hand = 0;
            }
            let e = *index.entry(self.hand);
            if e.is_full() && touch_age(e.touch, now) >= self.idle_rounds {
                let before = index.len();
                evict(index, self.hand);
                debug_assert_eq!(index.len() + 1, before, "evict must remove the entry");
                // A later entry of the cluster may have moved here: look
                // again (it counts against this round's share).
                continue;
            }
            self.hand += 1;
        }
    }
}

/// Samples of when rounds completed, for `idle_s` (module head).
const TIME_SAMPLES: usize = 32;

/// When rounds completed, sampled: the clock of eviction by `idle_s`.
#[derive(Debug)]
pub(crate) struct RoundTimes {
    idle_ns: u64,
    /// Least time between two samples: `idle_s` / 16, so that the ring
    /// spans twice `idle_s`.
    spacing_ns: u64,
    /// (round completed, when), a ring, oldest at `start`.
    samples: [(u32, u64); TIME_SAMPLES],
    start: usize,
    len: usize,
}

impl RoundTimes {
    pub(crate) fn new(idle_s: u32) -> RoundTimes {
        let idle_ns = u64::from(idle_s) * 1_000_000_000;
        RoundTimes {
            idle_ns,
            spacing_ns: idle_ns / (TIME_SAMPLES as u64 / 2),
            samples: [(0, 0); TIME_SAMPLES],
            start: 0,
            len: 0,
        }
    }

    fn at(&self, i: usize) -> (u32, u64) {
        self.samples[(self.start + i) % TIME_SAMPLES]
    }

    /// The samples, oldest first.
    pub(crate) fn samples(&self) -> Vec<(u32, u64)> {
        (0..self.len).map(|i| self.at(i)).collect()
    }

    /// Puts back what [`RoundTimes::samples`] gave (at most the ring's 32).
    pub(crate) fn set_samples(&mut self, samples: &[(u32, u64)]) -> Result<(), String> {
        if samples.len() > TIME_SAMPLES {
            return Err(format!(
                "{} idle-time samples (the ring holds {TIME_SAMPLES})",
                samples.len()
            ));
        }
        self.samples = [(0, 0); TIME_SAMPLES];
        self.samples[..samples.len()].copy_from_slice(samples);
        self.start = 0;
        self.len = samples.len();
        Ok(())
    }

    /// Round `round` completed at `now_ns`, and the store stands at round
    /// `now`: the rounds a row must have gone without an update to have
    /// gone `idle_s` seconds (those since the newest sampled round that
    /// completed `idle_s` or more ago), or `None` when no such round is
    /// known. Drops the samples older than that round's.
    pub(crate) fn completed(&mut self, round: u32, now_ns: u64, now: u32) -> Option<u32> {
        let last = self.len.checked_sub(1).map(|i| self.at(i));
        if last.is_none_or(|(_, t)| now_ns.saturating_sub(t) >= self.spacing_ns) {
            if self.len == TIME_SAMPLES {
                self.start = (self.start + 1) % TIME_SAMPLES;
                self.len -= 1;
            }
            self.samples[(self.start + self.len) % TIME_SAMPLES] = (round, now_ns);
            self.len += 1;
        }
        let cutoff = now_ns.checked_sub(self.idle_ns)?;
        let old = (0..self.len).rev().find(|&i| self.at(i).1 <= cutoff)?;
        let (r_old, _) = self.at(old);
        self.start = (self.start + old) % TIME_SAMPLES;
        self.len -= old;
        // Rounds are kept modulo 2^31 (the touch word's round bits).
        Some(now.wrapping_sub(r_old) & (u32::MAX >> 1))
    }
}

#[cfg(test)]
mod tests {
    use super::RoundTimes;

    const S: u64 = 1_000_000_000;

    #[test]
    fn round_times_name_the_rounds_of_idle_seconds() {
        let mut t = RoundTimes::new(10);
        // A round every second: nothing is 10 s old before t = 10 s.
        for r in 0..10u32 {
            assert_eq!(t.completed(r, u64::from(r) * S, r + 1), None, "round {r}");
        }
        // At 10 s, round 0 (done at 0 s) is 10 s old: rows updated in round
        // 0 or before are idle, i.e. rows 11 rounds behind round 11.
        assert_eq!(t.completed(10, 10 * S, 11), Some(11));
        assert_eq!(t.completed(11, 11 * S, 12), Some(11));
        // Rounds every 0.1 s from 12 s: samples 0.625 s apart at least.
        let mut last = None;
        for k in 0..200u32 {
            let r = 12 + k;
            last = t.completed(r, 12 * S + u64::from(k) * S / 10, r + 1);
        }
        // At 31.9 s the newest round completed by 21.9 s: about 100 rounds.
        let rounds = last.unwrap();
        assert!((99..=106).contains(&rounds), "{rounds}");
        assert!(t.len <= 32);
    }

    #[test]
    fn round_times_wrap_with_the_rounds() {
        let mut t = RoundTimes::new(1);
        let top = u32::MAX >> 1;
        assert_eq!(t.completed(top, 0, 0), None);
        assert_eq!(t.completed(0, S, 1), Some(2));
    }
}
