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
