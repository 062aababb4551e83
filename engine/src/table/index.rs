//! A row store's id index: open addressing with linear probing, from
//! arbitrary u64 ids to row slots.
//!
//! Layout: one array of [`Entry`]s (16 bytes, four to a cache line),
//! allocated whole and zeroed at creation, with a third more entries than
//! the store's cap (at most three quarters full:
//! [`phub_proto::memory::TableShape::index_entries`]). An entry holds the
//! id, the row's slot plus one, and the row's touch word. An entry whose
//! slot-plus-one is 0 is empty, so every id, 0 and `u64::MAX` included, can
//! be stored, and zeroed memory is an empty index (the pages of a large
//! index are only made resident as entries land in them).
//!
//! Hash: an id's home entry is `(mix(id ^ key) * entries) >> 64` (the high
//! bits of a 128-bit product: any entry count, no division), where `mix` is
//! a multiply-xorshift finalizer with the constants and shifts of Pelle
//! Evensen's "moremur" (0x3C79AC492BA7B653, 0x1C69B3F74AC4AE35; shifts 27,
//! 33, 27) and `key` is the store's own (`StoreConfig::hash_key`). The hash
//! that spreads a table's ids over lcores is a different function (see
//! PROTOCOL.md §10), so the ids that land on one lcore, which share
//! structure in that hash, are still spread evenly here.
//!
//! Removal is backward-shift deletion (no tombstones): the entries after
//! the removed one in its cluster move back where their probe sequence
//! allows, so lookups never get longer as rows come and go.

use bytemuck::{Pod, Zeroable};

use super::prefetch::prefetch;
use super::snapshot::EntrySnap;

/// One entry of the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub(crate) struct Entry {
    /// The row's id (meaningless when empty).
    pub(crate) id: u64,
    /// The row's slot plus one; 0: empty.
    slot1: u32,
    /// Bit 0: the CLOCK bit (set on every update, cleared as the hand
    /// passes); bits 1..32: the round of its last update, modulo 2^31.
    pub(crate) touch: u32,
}

const _: () = assert!(std::mem::size_of::<Entry>() as u64 == phub_proto::memory::TABLE_INDEX_ENTRY_BYTES);

impl Entry {
    /// Whether the entry holds a row.
    #[inline]
    pub(crate) fn is_full(&self) -> bool {
        self.slot1 != 0
    }

    /// The row's slot (the entry must be full).
    #[inline]
    pub(crate) fn slot(&self) -> u32 {
        debug_assert!(self.is_full());
        self.slot1 - 1
    }
}

/// The touch word of a row updated in round `now` (bits 0..31 of it).
#[inline]
pub(crate) fn touch_word(now: u32) -> u32 {
    (now << 1) | 1
}

/// Rounds since the touch word's round, modulo 2^31.
#[inline]
pub(crate) fn touch_age(touch: u32, now: u32) -> u32 {
    now.wrapping_sub(touch >> 1) & (u32::MAX >> 1)
}

/// The index's mixer (module head).
#[inline]
pub(crate) fn mix(id: u64, key: u64) -> u64 {
    let mut x = id ^ key;
    x ^= x >> 27;
    x = x.wrapping_mul(0x3C79_AC49_2BA7_B653);
    x ^= x >> 33;
    x = x.wrapping_mul(0x1C69_B3F7_4AC4_AE35);
    x ^ (x >> 27)
}

/// `hash` scaled onto `0..n` by its high bits.
#[inline]
pub(crate) fn scale(hash: u64, n: usize) -> usize {
    // Cast: the high half of a product with a usize n is below n.
    #[allow(clippy::cast_possible_truncation)]
    let pos = ((u128::from(hash) * n as u128) >> 64) as usize;
    pos
}

/// Where a probe for an id ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The id's entry.
    Found(usize),
    /// The empty entry where the id would be inserted.
    Vacant(usize),
}

/// The index (module head).
pub(crate) struct Index {
    entries: super::huge::Zeroed<Entry>,
    key: u64,
    len: usize,
    /// Removals so far: a position a probe found stays the id's until
    /// the next removal (an insert moves no entry; a removal's backward
    /// shift may).
    removals: u64,
    /// A checkpoint being streamed: entries kept as they were
    /// ([`super::snapshot`]); every change goes through [`keep`] first.
    pub(crate) snap: Option<Box<EntrySnap>>,
}

/// Entry `pos` is about to change: a stream in progress keeps it.
#[inline]
fn keep(snap: &mut Option<Box<EntrySnap>>, entries: &[Entry], pos: usize) {
    if let Some(s) = snap {
        s.keep(entries.len(), pos, &entries[pos]);
    }
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("entries", &self.entries.len())
            .field("len", &self.len)
            .finish()
    }
}

/// The largest index faulted in whole at creation ([`Index::new`]): 64
/// MiB, 4 M entries (about 50 ms where a fresh page costs 1.3 GB/s).
const POPULATE_AT_MOST: usize = 64 << 20;

impl Index {
    /// An empty index of `entries` entries (more than the rows it will
    /// hold), or `None` when the heap refuses them.
    pub(crate) fn new(entries: usize, key: u64) -> Option<Index> {
        assert!(entries > 0, "an index needs an entry");
        let mut entries = super::huge::Zeroed::<Entry>::new(entries)?;
        // The first rows spread over every page of the index at once: a
        // small one is faulted in here, at install, rather than page by
        // page in the table's first rounds (each holding its round);
        // a large one as it fills (faulting it in would hold the lcore
        // installing it for seconds).
        if std::mem::size_of_val::<[Entry]>(&entries) <= POPULATE_AT_MOST {
            entries.populate();
        }
        Some(Index {
            entries,
            key,
            len: 0,
            removals: 0,
            snap: None,
        })
    }

    /// The id's hash.
    #[inline]
    pub(crate) fn hash(&self, id: u64) -> u64 {
        mix(id, self.key)
    }

    /// The id's home entry.
    #[inline]
    fn home(&self, hash: u64) -> usize {
        scale(hash, self.entries.len())
    }

    /// Entries, full or empty.
    pub(crate) fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// Full entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Removals so far (see the field).
    #[inline]
    pub(crate) fn removals(&self) -> u64 {
        self.removals
    }

    /// Bytes allocated.
    pub(crate) fn bytes(&self) -> u64 {
        std::mem::size_of_val(&*self.entries) as u64
    }

    /// Prefetch the home entry of `hash`, and the entry two after it: the
    /// next cache line when the home is in the second half of its line,
    /// where a probe often goes on (at three quarters full a probe for a
    /// stored id reads 2.5 entries on average, 4 to a line).
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        let home = self.home(hash);
        prefetch(&raw const self.entries[home]);
        let next = if home + 2 < self.entries.len() {
            home + 2
        } else {
            0
        };
        prefetch(&raw const self.entries[next]);
    }

    /// Probe for `id` (whose hash is `hash`).
    #[inline]
    pub(crate) fn probe(&self, id: u64, hash: u64) -> Probe {
        let n = self.entries.len();
        let mut pos = self.home(hash);
        // Terminates: the index is never full (more entries than rows).
        loop {
            let e = &self.entries[pos];
            if !e.is_full() {
                return Probe::Vacant(pos);
            }
            if e.id == id {
                return Probe::Found(pos);
            }
            pos += 1;
            if pos == n {
                pos = 0;
            }
        }
    }

    /// The entry at `pos`.
    #[inline]
    pub(crate) fn entry(&self, pos: usize) -> &Entry {
        &self.entries[pos]
    }

    /// Set the touch word of the (full) entry at `pos`.
    #[inline]
    pub(crate) fn set_touch(&mut self, pos: usize, touch: u32) {
        debug_assert!(self.entries[pos].is_full());
        keep(&mut self.snap, &self.entries, pos);
        self.entries[pos].touch = touch;
    }

    /// Store `id` at the vacant entry `pos` that a probe for it returned.
    #[inline]
    pub(crate) fn insert(&mut self, pos: usize, id: u64, slot: u32, touch: u32) {
        debug_assert!(!self.entries[pos].is_full());
        debug_assert!(
            self.len + 1 < self.entries.len(),
            "the index must keep an empty entry"
        );
        keep(&mut self.snap, &self.entries, pos);
        self.entries[pos] = Entry {
            id,
            slot1: slot + 1,
            touch,
        };
        self.len += 1;
    }

    /// Remove the full entry at `pos` (backward-shift deletion: a later
    /// entry of the cluster may move into `pos`).
    pub(crate) fn remove(&mut self, pos: usize) {
        debug_assert!(self.entries[pos].is_full());
        let n = self.entries.len();
        let dist = |from: usize, to: usize| if to >= from { to - from } else { to + n - from };
        let mut hole = pos;
        let mut j = pos;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            let e = self.entries[j];
            if !e.is_full() {
                break;
            }
            // The entry may fill the hole when the hole lies on its probe
            // path, from its home up to where it is.
            if dist(self.home(self.hash(e.id)), j) >= dist(hole, j) {
                keep(&mut self.snap, &self.entries, hole);
                self.entries[hole] = e;
                hole = j;
            }
        }
        keep(&mut self.snap, &self.entries, hole);
        self.entries[hole] = Entry::zeroed();
        self.len -= 1;
        self.removals += 1;
    }

    /// Every full entry's (position, entry), in index order.
    pub(crate) fn full(&self) -> impl Iterator<Item = (usize, &Entry)> + '_ {
        self.entries.iter().enumerate().filter(|(_, e)| e.is_full())
    }

    /// The first empty entry's position (the index always has one).
    pub(crate) fn first_gap(&self) -> usize {
        self.entries.iter().position(|e| !e.is_full()).unwrap_or(0)
    }

    /// A stream's next entry as it was at its start (empty or full), or
    /// `None` once the stream has passed every position (or none runs).
    pub(crate) fn snap_next(&mut self) -> Option<Entry> {
        let n = self.entries.len();
        let entries = &self.entries;
        self.snap.as_mut()?.next(n, |pos| entries[pos])
    }

    /// Every full entry's (position, entry), in index order from the first
    /// empty entry on, wrapping: each cluster comes whole, first entry
    /// first, so inserting the ids in this order into an empty index of
    /// the same size and key puts each at the position it has here (an
    /// entry's probe path, from its home to it, lies in its cluster before
    /// it). A restore relies on it to give CLOCK the same order.
    pub(crate) fn full_from_gap(&self) -> impl Iterator<Item = (usize, &Entry)> + '_ {
        let n = self.entries.len();
        let gap = self.first_gap();
        (gap..n)
            .chain(0..gap)
            .map(|p| (p, &self.entries[p]))
            .filter(|(_, e)| e.is_full())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_zero_and_max_are_stored_and_removed_like_any_other() {
        let mut ix = Index::new(4, 7).unwrap();
        for (slot, id) in (0u32..).zip([0u64, u64::MAX, 1]) {
            let h = ix.hash(id);
            let Probe::Vacant(pos) = ix.probe(id, h) else {
                panic!("{id} found before insert")
            };
            ix.insert(pos, id, slot, touch_word(0));
        }
        for (slot, id) in (0u32..).zip([0u64, u64::MAX, 1]) {
            let Probe::Found(pos) = ix.probe(id, ix.hash(id)) else {
                panic!("{id} lost")
            };
            assert_eq!(ix.entry(pos).slot(), slot);
        }
        let Probe::Found(pos) = ix.probe(0, ix.hash(0)) else {
            panic!()
        };
        ix.remove(pos);
        assert!(matches!(ix.probe(0, ix.hash(0)), Probe::Vacant(_)));
        assert!(matches!(ix.probe(u64::MAX, ix.hash(u64::MAX)), Probe::Found(_)));
        assert_eq!(ix.len(), 2);
    }

    #[test]
    fn backward_shift_keeps_every_cluster_reachable() {
        // A small index, many removals and inserts: every stored id stays
        // findable, every removed one is gone (clusters wrap the end).
        let mut ix = Index::new(11, 3).unwrap();
        let mut live: Vec<u64> = Vec::new();
        let mut x = 1u64;
        for step in 0..5000u32 {
            x = mix(x, 99);
            let id = x % 16;
            let h = ix.hash(id);
            match ix.probe(id, h) {
                Probe::Found(pos) => {
                    ix.remove(pos);
                    live.retain(|&l| l != id);
                }
                Probe::Vacant(pos) if ix.len() < 10 => {
                    ix.insert(pos, id, step, 1);
                    live.push(id);
                }
                Probe::Vacant(_) => {}
            }
            for id in 0..16u64 {
                let found = matches!(ix.probe(id, ix.hash(id)), Probe::Found(_));
                assert_eq!(found, live.contains(&id), "id {id} at step {step}");
            }
            assert_eq!(ix.len(), live.len());
        }
    }

    #[test]
    fn touch_age_wraps_at_31_bits() {
        assert_eq!(touch_age(touch_word(5), 9), 4);
        assert_eq!(touch_age(touch_word(u32::MAX >> 1), 2), 3);
    }
}
