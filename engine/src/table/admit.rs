//! Admission counting (`admit_after = N`): a row is stored only from the
//! N-th push of its id on; the pushes before it are dropped (their
//! gradients are not applied anywhere) and counted apart, as the frequency
//! filters of Monolith and DeepRec do. Until then a read of the id returns
//! its initial values.
//!
//! The pending counts live in a fixed table of saturating u16 counters,
//! one per row of the cap, allocated at creation: a count-min sketch of
//! one row with two positions per id (two halves of a keyed hash, a key
//! apart from the index's) and conservative update (a push raises only the
//! counters that are at the id's current minimum, to that minimum plus
//! one). An id's estimate (the smaller of its two counters) is never below
//! the pushes it has had: other ids that share a counter can only raise
//! it. So collisions may admit an id early, never late. Counters are never
//! lowered: a row evicted after admission is admitted again on its next
//! push, and as more distinct ids are seen the estimates of rare ids rise
//! (the filter weakens, it never withholds a row that reached N).

use super::index::{mix, scale};

/// The key the counters' hash adds to the store's, so that it is not the
/// index's.
const ADMIT_KEY: u64 = 0xA5A5_5A5A_C3C3_3C3C;

/// The counters (module head).
pub(crate) struct AdmitCounts {
    counts: Box<[u16]>,
    after: u16,
    key: u64,
}

impl std::fmt::Debug for AdmitCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmitCounts")
            .field("counters", &self.counts.len())
            .field("after", &self.after)
            .finish()
    }
}

impl AdmitCounts {
    /// `counters` zeroed counters admitting from the `after`-th push on;
    /// `None` when the heap refuses them.
    pub(crate) fn new(counters: usize, after: u16, key: u64) -> Option<AdmitCounts> {
        assert!(
            counters > 0 && after >= 2,
            "{counters} counters admitting after {after}"
        );
        let counts = bytemuck::allocation::try_zeroed_slice_box::<u16>(counters).ok()?;
        Some(AdmitCounts {
            counts,
            after,
            key: key ^ ADMIT_KEY,
        })
    }

    /// The id's two counters.
    #[inline]
    fn positions(&self, id: u64) -> [usize; 2] {
        let h = mix(id, self.key);
        let n = self.counts.len();
        [scale(h << 32, n), scale(h & !0xFFFF_FFFF, n)]
    }

    /// Count a push of an id that is not stored: true when this push
    /// admits it (its estimate, this push included, reaches `after`).
    #[inline]
    pub(crate) fn push(&mut self, id: u64) -> bool {
        let [a, b] = self.positions(id);
        let next = self.counts[a].min(self.counts[b]).saturating_add(1);
        self.counts[a] = self.counts[a].max(next);
        self.counts[b] = self.counts[b].max(next);
        next >= self.after
    }

    /// The id's estimate: at least the pushes counted for it.
    #[cfg(test)]
    pub(crate) fn estimate(&self, id: u64) -> u16 {
        let [a, b] = self.positions(id);
        self.counts[a].min(self.counts[b])
    }

    /// The counters (a checkpoint keeps them).
    pub(crate) fn counts(&self) -> &[u16] {
        &self.counts
    }

    /// The counters, to put saved ones back.
    pub(crate) fn counts_mut(&mut self) -> &mut [u16] {
        &mut self.counts
    }

    /// Bytes allocated.
    pub(crate) fn bytes(&self) -> u64 {
        std::mem::size_of_val(&*self.counts) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_on_the_nth_push_and_never_late_when_counters_collide() {
        // 8 counters for 200 ids: collisions everywhere, yet no id needs
        // more than 3 pushes.
        let mut c = AdmitCounts::new(8, 3, 1).unwrap();
        let mut pushes = vec![0u16; 200];
        for round in 0..3 {
            for (id, n) in (0..200u64).zip(pushes.iter_mut()) {
                let admitted = c.push(id);
                *n += 1;
                assert!(c.estimate(id) >= *n);
                if round == 2 {
                    assert!(admitted, "id {id} not admitted on its 3rd push");
                }
            }
        }
        // Without collisions: exactly the 3rd push.
        let mut c = AdmitCounts::new(1 << 16, 3, 1).unwrap();
        assert_eq!([c.push(42), c.push(42), c.push(42)], [false, false, true]);
    }
}
