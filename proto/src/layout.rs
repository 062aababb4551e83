//! Chunk layout: keys -> chunks -> (lcore, slot), described by rule.
//!
//! Each key is cut into chunks of [`JobSpec::chunk_elems`] elements (the last
//! chunk of a key may be shorter). Taken key by key, the job's chunks form
//! its **chunk sequence**: chunk c of key k is number `first(k) + c`, where
//! `first(k)` is the number of chunks of the keys before k.
//!
//! A [`Layout`] gives each lcore of the appliance one run of that sequence
//! ([`ChunkRange`]): the runs follow one another in lcore order and cover the
//! sequence exactly once; an lcore that holds none of the job's chunks has
//! an empty run that starts where the next one does. Slot s of the job on
//! lcore l holds chunk `lcores[l].first + s`. So a layout is O(lcores) in
//! size, whatever the number of chunks; what is O(keys) ([`Chunks`], each
//! key's first chunk) is derived from the spec, and looking a chunk up is
//! two binary searches ([`Placement`]).
//!
//! Runs are cut so that bytes are balanced over the lcores chosen for the
//! job, counting what other jobs already put on each ([`layout`]). The
//! function is pure and deterministic: the same spec, loads and costs give
//! the same layout on every machine.

use std::ops::Range;

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

use crate::spec::JobSpec;

/// Where one chunk lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Place {
    /// The lcore (queue) that owns the chunk; its UDP port is base + lcore.
    pub lcore: u16,
    /// The slot on that lcore, within the job.
    pub slot: u32,
}

/// One slot as an lcore installs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotChunk {
    /// Key index.
    pub key: u32,
    /// Chunk index within the key.
    pub chunk: u32,
    /// Elements in this chunk.
    pub elems: u32,
}

/// One lcore's share of a job: a run of the job's chunk sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkRange {
    /// Sequence number of the run's first chunk (slot 0).
    pub first: u64,
    /// Chunks in the run, one slot each.
    pub count: u64,
}

impl ChunkRange {
    /// The sequence numbers of the run.
    pub fn range(&self) -> Range<u64> {
        self.first..self.first + self.count
    }

    /// Whether the run holds no chunk.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// A job's chunks and where they live: per lcore, one run of the chunk
/// sequence (module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "LayoutRepr")]
pub struct Layout {
    /// Elements in a full chunk.
    pub chunk_elems: u32,
    /// Per lcore of the appliance, the run of the job's chunks it holds.
    pub lcores: Vec<ChunkRange>,
}

/// A layout as read: the form by rule, or the per-chunk lists that phub
/// wrote before layouts were described by rule, which are refused by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LayoutRepr {
    chunk_elems: u32,
    lcores: Vec<LcoreRepr>,
    /// Only in the per-chunk form: `keys[k][c]` was the place of a chunk.
    #[serde(default)]
    keys: Option<IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum LcoreRepr {
    Range(ChunkRange),
    /// The per-chunk form's list of slots.
    Slots(IgnoredAny),
}

/// What [`Layout`]'s deserialisation says of a layout in the per-chunk form.
pub const PER_CHUNK_FORM: &str = "a layout in the per-chunk form (`keys` and `lcores` as lists of \
     every chunk), which phub wrote before layouts were described by rule; this version reads \
     `lcores` as one {\"first\", \"count\"} run of the chunk sequence per lcore";

impl TryFrom<LayoutRepr> for Layout {
    type Error = String;

    fn try_from(r: LayoutRepr) -> Result<Layout, String> {
        if r.keys.is_some() {
            return Err(PER_CHUNK_FORM.into());
        }
        let lcores = r
            .lcores
            .into_iter()
            .map(|l| match l {
                LcoreRepr::Range(c) => Ok(c),
                LcoreRepr::Slots(_) => Err(PER_CHUNK_FORM.to_string()),
            })
            .collect::<Result<_, _>>()?;
        Ok(Layout {
            chunk_elems: r.chunk_elems,
            lcores,
        })
    }
}

impl Layout {
    /// Number of lcores the layout spans (the appliance's, including those
    /// holding none of the job's chunks).
    pub fn lcore_count(&self) -> usize {
        self.lcores.len()
    }

    /// The same lcores holding no chunk (each run emptied where it
    /// starts): what an appliance of a replicated job installed again after
    /// being declared down holds as primary slots (PROTOCOL.md §11.7).
    pub fn without_chunks(&self) -> Layout {
        Layout {
            chunk_elems: self.chunk_elems,
            lcores: self
                .lcores
                .iter()
                .map(|r| ChunkRange {
                    first: r.first,
                    count: 0,
                })
                .collect(),
        }
    }

    /// Total number of chunks.
    pub fn chunk_count(&self) -> u64 {
        self.lcores.iter().map(|r| r.count).sum()
    }

    /// Slots of the job on `lcore` (0 for an lcore outside the layout).
    pub fn slots(&self, lcore: usize) -> u64 {
        self.lcores.get(lcore).map_or(0, |r| r.count)
    }

    /// Elements of chunk `chunk` of a key with `elements` elements.
    // Cast: the result is at most chunk_elems, a u32, by the min.
    #[allow(clippy::cast_possible_truncation)]
    pub fn chunk_len(&self, elements: u64, chunk: u32) -> u32 {
        let start = u64::from(chunk) * u64::from(self.chunk_elems);
        (elements.saturating_sub(start)).min(u64::from(self.chunk_elems)) as u32
    }

    /// The sequence numbers the runs cover: all of the job's chunks, or,
    /// for one appliance's part of a sharded job, its share.
    pub fn span(&self) -> Range<u64> {
        match (self.lcores.first(), self.lcores.last()) {
            (Some(a), Some(b)) => a.first..b.first + b.count,
            _ => 0..0,
        }
    }

    /// The parts of a layout over the lcores of several appliances, taken
    /// in order: `counts[i]` lcores each (they add up to the layout's).
    /// Part i holds the runs of its lcores, numbered from 0 on its
    /// appliance, with their slots unchanged.
    ///
    /// # Panics
    /// If the counts do not add up to the layout's lcores.
    pub fn split(&self, counts: &[usize]) -> Vec<Layout> {
        assert_eq!(
            counts.iter().sum::<usize>(),
            self.lcores.len(),
            "parts must cover the layout's lcores"
        );
        let mut at = 0;
        counts
            .iter()
            .map(|&n| {
                let part = Layout {
                    chunk_elems: self.chunk_elems,
                    lcores: self.lcores[at..at + n].to_vec(),
                };
                at += n;
                part
            })
            .collect()
    }

    /// The lcores holding at least one of the job's chunks, ascending.
    pub fn used_lcores(&self) -> Vec<u16> {
        // Cast: a validated layout has at most MAX_LCORES (2^16) entries.
        #[allow(clippy::cast_possible_truncation)]
        let used = self
            .lcores
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.is_empty())
            .map(|(i, _)| i as u16)
            .collect();
        used
    }
}

/// Most lcores a layout may span: a [`Place`] names its lcore by a `u16`.
pub const MAX_LCORES: usize = 1 << 16;

/// Number of chunks a key of `elements` elements is cut into.
pub fn chunks_of(elements: u64, chunk_elems: u32) -> u64 {
    elements.div_ceil(u64::from(chunk_elems))
}

/// The chunk sequence of a job, from its spec: O(keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunks {
    chunk_elems: u32,
    /// `first[k]`: sequence number of key k's chunk 0; `first[keys]` is the
    /// number of chunks.
    first: Vec<u64>,
    /// Elements of each key's last chunk.
    last: Vec<u32>,
}

impl Chunks {
    /// The chunk sequence of `spec` (a validated spec: every dense key has
    /// 1 to 2^32 - 1 elements, so a key's chunks are numbered by a `u32`;
    /// a table key has 0, so no chunk, PROTOCOL.md §10.1).
    pub fn new(spec: &JobSpec) -> Chunks {
        let chunk_elems = spec.chunk_elems().max(1);
        let mut first = Vec::with_capacity(spec.keys.len() + 1);
        let mut last = Vec::with_capacity(spec.keys.len());
        let mut at = 0u64;
        for k in &spec.keys {
            first.push(at);
            let n = chunks_of(k.elements, chunk_elems);
            at += n;
            // Cast: at most chunk_elems, a u32, by the min.
            #[allow(clippy::cast_possible_truncation)]
            last.push(
                (k.elements - n.saturating_sub(1) * u64::from(chunk_elems)).min(u64::from(chunk_elems))
                    as u32,
            );
        }
        first.push(at);
        Chunks {
            chunk_elems,
            first,
            last,
        }
    }

    /// Elements in a full chunk.
    pub fn chunk_elems(&self) -> u32 {
        self.chunk_elems
    }

    /// Number of chunks.
    pub fn total(&self) -> u64 {
        *self.first.last().expect("first has keys + 1 entries")
    }

    /// Number of keys.
    pub fn keys(&self) -> usize {
        self.last.len()
    }

    /// The sequence numbers of key `key`'s chunks (empty for no such key).
    pub fn of_key(&self, key: u32) -> Range<u64> {
        let k = key as usize;
        match (self.first.get(k), self.first.get(k + 1)) {
            (Some(&a), Some(&b)) => a..b,
            _ => 0..0,
        }
    }

    /// Key, chunk and length of sequence number `seq`, if there is one.
    pub fn chunk(&self, seq: u64) -> Option<SlotChunk> {
        if seq >= self.total() {
            return None;
        }
        // The last key whose first chunk is at or before `seq`: the one
        // holding it (a table key has no chunk and the same first as the
        // key after it, so the search passes over it).
        let k = self.first.partition_point(|&f| f <= seq) - 1;
        let c = seq - self.first[k];
        let elems = if seq + 1 == self.first[k + 1] {
            self.last[k]
        } else {
            self.chunk_elems
        };
        // Cast: k < keys <= MAX_KEYS (2^20) and c < a key's chunk count,
        // which is at most 2^32 - 1 (checked by JobSpec::validate).
        #[allow(clippy::cast_possible_truncation)]
        let (key, chunk) = (k as u32, c as u32);
        Some(SlotChunk { key, chunk, elems })
    }

    /// The chunks with sequence numbers in `seqs`, in order: one binary
    /// search, then a walk.
    pub fn iter(&self, seqs: Range<u64>) -> impl Iterator<Item = SlotChunk> + '_ {
        let end = seqs.end.min(self.total());
        let mut key = self.chunk(seqs.start).map_or(self.keys(), |c| c.key as usize);
        (seqs.start..end).map(move |seq| {
            while self.first[key + 1] <= seq {
                key += 1;
            }
            let elems = if seq + 1 == self.first[key + 1] {
                self.last[key]
            } else {
                self.chunk_elems
            };
            // Cast: as in `chunk`.
            #[allow(clippy::cast_possible_truncation)]
            let (k, chunk) = (key as u32, (seq - self.first[key]) as u32);
            SlotChunk { key: k, chunk, elems }
        })
    }

    /// Prefix sums of `cost(elems)` over the sequence, for sums over runs in
    /// O(log keys).
    pub fn weigh(&self, cost: impl Fn(u32) -> u64) -> Weights {
        let full = cost(self.chunk_elems);
        let mut before = Vec::with_capacity(self.first.len());
        let mut at = 0u64;
        for (k, w) in self.first.windows(2).enumerate() {
            before.push(at);
            // A table key has no chunk (PROTOCOL.md §10.1), so no cost.
            let n = w[1] - w[0];
            if n > 0 {
                at += (n - 1) * full + cost(self.last[k]);
            }
        }
        before.push(at);
        Weights {
            first: self.first.clone(),
            before,
            full,
        }
    }
}

/// Prefix sums of a per-chunk cost over a job's chunk sequence
/// ([`Chunks::weigh`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Weights {
    first: Vec<u64>,
    /// `before[k]`: cost of every chunk of the keys before k.
    before: Vec<u64>,
    /// Cost of a full chunk.
    full: u64,
}

impl Weights {
    /// Cost of the whole sequence.
    pub fn total(&self) -> u64 {
        *self.before.last().expect("one entry per key and one more")
    }

    /// Cost of the chunks before sequence number `seq` (all of them when
    /// `seq` is past the end).
    pub fn before(&self, seq: u64) -> u64 {
        let total = *self.first.last().expect("one entry per key and one more");
        if seq >= total {
            return self.total();
        }
        let k = self.first.partition_point(|&f| f <= seq) - 1;
        // Every chunk of key k before `seq` is full: only a key's last chunk
        // may be short, and it is at or after `seq`.
        self.before[k] + (seq - self.first[k]) * self.full
    }

    /// Cost of the chunks in `seqs`.
    pub fn of(&self, seqs: Range<u64>) -> u64 {
        self.before(seqs.end) - self.before(seqs.start)
    }

    /// The sequence number whose prefix cost is nearest `cost` (the higher
    /// one on a tie, so that a lone chunk goes to the first lcore).
    pub fn cut_near(&self, cost: u64) -> u64 {
        let total = *self.first.last().expect("one entry per key and one more");
        if cost >= self.total() {
            return total;
        }
        // The key in which the prefix cost passes `cost`.
        let k = self.before.partition_point(|&b| b <= cost) - 1;
        let n = self.first[k + 1] - self.first[k];
        let c = (cost - self.before[k])
            .checked_div(self.full)
            .map_or(0, |c| c.min(n));
        let lo = self.first[k] + c;
        let hi = (lo + 1).min(total);
        if cost - self.before(lo) < self.before(hi).saturating_sub(cost) {
            lo
        } else {
            hi
        }
    }
}

/// Why a layout does not describe a job's chunks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// `chunk_elems` is not the spec's.
    #[error("layout.chunk_elems is {layout}; the spec's chunk_bytes and dtype give {spec}")]
    ChunkElems {
        /// The layout's.
        layout: u32,
        /// What the spec gives.
        spec: u32,
    },
    /// The layout spans no lcore, or more than a place can name.
    #[error("the layout spans {0} lcores; accepted: 1 to {MAX_LCORES}")]
    Lcores(usize),
    /// The runs do not follow one another.
    #[error(
        "lcore {lcore}'s run starts at chunk {first}, but the runs before it end at chunk {expected}; \
         runs follow one another in lcore order"
    )]
    Gap {
        /// The lcore.
        lcore: usize,
        /// Where its run starts.
        first: u64,
        /// Where it should.
        expected: u64,
    },
    /// The runs do not cover the job's chunks.
    #[error("the layout's runs cover {covered} chunks; the spec's keys have {chunks}")]
    Coverage {
        /// Chunks the runs cover.
        covered: u64,
        /// Chunks the spec has.
        chunks: u64,
    },
    /// More slots on one lcore than a slot index names.
    #[error("lcore {lcore} holds {count} slots of the job; a slot index is a u32")]
    TooManySlots {
        /// The lcore.
        lcore: usize,
        /// Its slots.
        count: u64,
    },
}

/// A layout checked against its job's spec, for lookups both ways.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    chunks: Chunks,
    layout: Layout,
}

impl Placement {
    /// Checks that `layout` places exactly `spec`'s chunks (a validated
    /// spec): its `chunk_elems` is the spec's, it spans 1 to
    /// [`MAX_LCORES`] lcores, runs follow one another from chunk 0 to the
    /// last and every lcore's slots are numbered by a `u32`.
    pub fn new(spec: &JobSpec, layout: Layout) -> Result<Placement, LayoutError> {
        Placement::check(spec, layout, true)
    }

    /// Checks that `layout` places one part of `spec`'s chunks, as one
    /// appliance of a job sharded over several holds it: as [`Placement::new`]
    /// checks, except that the runs may start at any chunk (the first run's
    /// `first`) and end at any chunk up to the last. Lookups of chunks
    /// outside the part find nothing.
    pub fn part(spec: &JobSpec, layout: Layout) -> Result<Placement, LayoutError> {
        Placement::check(spec, layout, false)
    }

    fn check(spec: &JobSpec, layout: Layout, whole: bool) -> Result<Placement, LayoutError> {
        if layout.chunk_elems != spec.chunk_elems() {
            return Err(LayoutError::ChunkElems {
                layout: layout.chunk_elems,
                spec: spec.chunk_elems(),
            });
        }
        if layout.lcores.is_empty() || layout.lcores.len() > MAX_LCORES {
            return Err(LayoutError::Lcores(layout.lcores.len()));
        }
        let chunks = Chunks::new(spec);
        let mut at = if whole { 0 } else { layout.lcores[0].first };
        for (lcore, r) in layout.lcores.iter().enumerate() {
            if r.first != at {
                return Err(LayoutError::Gap {
                    lcore,
                    first: r.first,
                    expected: at,
                });
            }
            if u32::try_from(r.count).is_err() {
                return Err(LayoutError::TooManySlots {
                    lcore,
                    count: r.count,
                });
            }
            at = at.checked_add(r.count).ok_or(LayoutError::Coverage {
                covered: u64::MAX,
                chunks: chunks.total(),
            })?;
        }
        if at != chunks.total() && (whole || at > chunks.total()) {
            return Err(LayoutError::Coverage {
                covered: at,
                chunks: chunks.total(),
            });
        }
        Ok(Placement { chunks, layout })
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The chunk sequence.
    pub fn chunks(&self) -> &Chunks {
        &self.chunks
    }

    /// Where sequence number `seq` lives.
    pub fn place_of(&self, seq: u64) -> Option<Place> {
        if seq >= self.chunks.total() || !self.layout.span().contains(&seq) {
            return None;
        }
        // The first lcore whose run ends after `seq` holds it (runs follow
        // one another, so ends ascend).
        let l = self.layout.lcores.partition_point(|r| r.first + r.count <= seq);
        let r = self.layout.lcores.get(l)?;
        // Cast: l < lcores <= MAX_LCORES (2^16) and the slot is below the
        // run's count, which fits a u32 (both checked in `new`).
        #[allow(clippy::cast_possible_truncation)]
        let (lcore, slot) = (l as u16, (seq - r.first) as u32);
        Some(Place { lcore, slot })
    }

    /// Where chunk `chunk` of key `key` lives.
    pub fn place(&self, key: u32, chunk: u32) -> Option<Place> {
        let seqs = self.chunks.of_key(key);
        let seq = seqs.start + u64::from(chunk);
        if seq >= seqs.end {
            return None;
        }
        self.place_of(seq)
    }

    /// The places of every chunk of `key`, in chunk order.
    pub fn places(&self, key: u32) -> impl Iterator<Item = Place> + '_ {
        self.chunks.of_key(key).filter_map(|seq| self.place_of(seq))
    }

    /// The chunk in slot `slot` of `lcore`.
    pub fn slot_chunk(&self, lcore: usize, slot: u32) -> Option<SlotChunk> {
        let r = self.layout.lcores.get(lcore)?;
        (u64::from(slot) < r.count)
            .then(|| self.chunks.chunk(r.first + u64::from(slot)))
            .flatten()
    }

    /// The job's slots on `lcore`, in slot order.
    pub fn slots(&self, lcore: usize) -> impl Iterator<Item = SlotChunk> + '_ {
        let r = self.layout.lcores.get(lcore).map_or(0..0, ChunkRange::range);
        self.chunks.iter(r)
    }
}

/// Places a job's chunks on `load.len()` lcores, where `load[i]` is the
/// bytes already on lcore `i` (from other jobs) and `cost(elems)` what a
/// chunk of `elems` elements puts on its lcore. Returns the layout and adds
/// this job's bytes to `load`.
///
/// Each lcore gets one run of the chunk sequence, in lcore order, sized by
/// water-filling: the least-loaded lcores are filled up to a common level
/// first, so that after placement the loads differ by about one chunk
/// (rounding each cut to the nearest chunk) and a large key spreads over
/// every lcore.
///
/// `load` has at most [`MAX_LCORES`] entries.
///
/// # Panics
/// If `load` is empty (an appliance has at least one lcore).
pub fn layout(spec: &JobSpec, load: &mut [u64], cost: impl Fn(u32) -> u64) -> Layout {
    let all = 0..Chunks::new(spec).total();
    layout_part(spec, all, load, cost)
}

/// As [`layout`], for the chunks `seqs` of the job's sequence only (one
/// appliance's part of a sharded job, placed anew over its lcores): the
/// runs start at `seqs.start` and end at `seqs.end`.
///
/// # Panics
/// If `load` is empty, or `seqs` is not within the job's chunks.
pub fn layout_part(spec: &JobSpec, seqs: Range<u64>, load: &mut [u64], cost: impl Fn(u32) -> u64) -> Layout {
    assert!(!load.is_empty(), "layout needs at least one lcore");
    let chunks = Chunks::new(spec);
    assert!(
        seqs.start <= seqs.end && seqs.end <= chunks.total(),
        "chunks {seqs:?} are not within the job's {}",
        chunks.total()
    );
    let weights = chunks.weigh(cost);
    let shares = water_fill(load, weights.of(seqs.clone()));
    let mut lcores = Vec::with_capacity(load.len());
    let (mut at, mut target) = (seqs.start, weights.before(seqs.start));
    for (i, share) in shares.iter().enumerate() {
        target += share;
        let end = if i + 1 == shares.len() {
            seqs.end
        } else {
            weights.cut_near(target).clamp(at, seqs.end)
        };
        lcores.push(ChunkRange {
            first: at,
            count: end - at,
        });
        load[i] += weights.of(at..end);
        at = end;
    }
    Layout {
        chunk_elems: chunks.chunk_elems(),
        lcores,
    }
}

/// Shares of `total` for lcores with `load`s so that every lcore with a
/// share ends at one level (to within one byte) and none above it: the
/// lowest-loaded lcores are filled first, remainders go to the lowest
/// indexes.
fn water_fill(load: &[u64], total: u64) -> Vec<u64> {
    let mut order: Vec<usize> = (0..load.len()).collect();
    order.sort_by_key(|&i| (load[i], i));
    // The number j of lcores filled: the largest whose lowest j loads can
    // be raised to the j-th lowest with `total` (u128: no overflow).
    let (mut j, mut sum) = (0usize, 0u128);
    for (n, &i) in order.iter().enumerate() {
        let l = u128::from(load[i]);
        // Raising the first n loads to l costs n * l - sum.
        if (n as u128) * l - sum > u128::from(total) {
            break;
        }
        sum += l;
        j = n + 1;
    }
    let level = (u128::from(total) + sum) / j as u128;
    let mut extra = (u128::from(total) + sum) % j as u128;
    let mut shares = vec![0u64; load.len()];
    let mut filled: Vec<usize> = order[..j].to_vec();
    filled.sort_unstable();
    for i in filled {
        let mut s = level - u128::from(load[i]);
        if extra > 0 {
            s += 1;
            extra -= 1;
        }
        // Cast: every share is at most `total`, a u64.
        #[allow(clippy::cast_possible_truncation)]
        let s = s as u64;
        shares[i] = s;
    }
    shares
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use super::*;
    use crate::spec::Optimizer;
    use crate::Dtype;
    use proptest::prelude::*;

    fn spec(keys: &[u64], dtype: Dtype, chunk_bytes: u32) -> JobSpec {
        JobSpec::new("t", 2, keys)
            .with_dtype(dtype)
            .with_chunk_bytes(chunk_bytes)
            .with_optimizer(Optimizer::Sgd {
                lr: 0.1,
                weight_decay: 0.0,
            })
    }

    /// The naive reference: every chunk in sequence order, with its place.
    fn naive(s: &JobSpec, l: &Layout) -> Vec<(SlotChunk, Place)> {
        let ce = u64::from(s.chunk_elems());
        let mut all = Vec::new();
        for (k, key) in s.keys.iter().enumerate() {
            for c in 0..chunks_of(key.elements, s.chunk_elems()) {
                let elems = (key.elements - c * ce).min(ce) as u32;
                all.push(SlotChunk {
                    key: k as u32,
                    chunk: c as u32,
                    elems,
                });
            }
        }
        let mut places = Vec::new();
        for (lcore, r) in l.lcores.iter().enumerate() {
            for slot in 0..r.count {
                places.push(Place {
                    lcore: lcore as u16,
                    slot: slot as u32,
                });
            }
        }
        all.into_iter().zip(places).collect()
    }

    #[test]
    fn last_chunk_is_short_and_lookups_agree_both_ways() {
        let s = spec(&[5000, 1, 2048], Dtype::F32, 8192);
        let mut load = vec![0; 3];
        let l = layout(&s, &mut load, u64::from);
        assert_eq!(l.chunk_elems, 2048);
        assert_eq!(l.chunk_count(), 5);
        assert_eq!(l.chunk_len(5000, 2), 5000 - 4096);
        let p = Placement::new(&s, l.clone()).unwrap();
        assert_eq!(p.places(0).count(), 3);
        assert_eq!(p.places(1).count(), 1);
        assert_eq!(p.slot_chunk(0, 0).unwrap().elems, 2048);
        for (sc, place) in naive(&s, &l) {
            assert_eq!(p.place(sc.key, sc.chunk), Some(place));
            assert_eq!(p.slot_chunk(usize::from(place.lcore), place.slot), Some(sc));
        }
        assert_eq!(load.iter().sum::<u64>(), 5000 + 1 + 2048);
        assert_eq!(p.place(0, 3), None);
        assert_eq!(p.place(3, 0), None);
    }

    #[test]
    fn a_layout_is_a_few_bytes_per_lcore_whatever_the_chunk_count() {
        let s = spec(&vec![1; 1_000_000], Dtype::F32, 64);
        let l = layout(&s, &mut [0; 4], |e| 100 + u64::from(e));
        assert_eq!(l.chunk_count(), 1_000_000);
        assert_eq!(l.lcores.iter().map(|r| r.count).collect::<Vec<_>>(), [250_000; 4]);
        let json = serde_json::to_string(&l).unwrap();
        assert!(json.len() < 200, "{json}");
        let one = spec(&[4_000_000], Dtype::F32, 64);
        let l = layout(&one, &mut [0; 2], u64::from);
        assert_eq!(l.chunk_count(), 250_000);
        let p = Placement::new(&one, l).unwrap();
        assert_eq!(
            p.place(0, 124_999),
            Some(Place {
                lcore: 0,
                slot: 124_999
            })
        );
        assert_eq!(p.place(0, 125_000), Some(Place { lcore: 1, slot: 0 }));
    }

    #[test]
    fn placement_refuses_layouts_that_do_not_place_the_spec() {
        let s = spec(&[100, 50], Dtype::F32, 64);
        let good = layout(&s, &mut [0, 0], u64::from);
        assert!(Placement::new(&s, good.clone()).is_ok());
        let mut gap = good.clone();
        gap.lcores[1].first += 1;
        assert!(matches!(
            Placement::new(&s, gap),
            Err(LayoutError::Gap { lcore: 1, .. })
        ));
        let mut short = good.clone();
        short.lcores[1].count -= 1;
        let e = Placement::new(&s, short).unwrap_err().to_string();
        assert!(e.contains("cover 10 chunks; the spec's keys have 11"), "{e}");
        let mut ce = good.clone();
        ce.chunk_elems = 8;
        assert!(matches!(
            Placement::new(&s, ce),
            Err(LayoutError::ChunkElems { .. })
        ));
        let none = Layout {
            chunk_elems: 16,
            lcores: vec![],
        };
        assert_eq!(Placement::new(&s, none), Err(LayoutError::Lcores(0)));
    }

    #[test]
    fn the_per_chunk_form_is_refused_by_name() {
        let old = r#"{"chunk_elems": 16, "keys": [[{"lcore": 0, "slot": 0}]],
            "lcores": [[{"key": 0, "chunk": 0, "elems": 16}], []]}"#;
        let e = serde_json::from_str::<Layout>(old).unwrap_err().to_string();
        assert!(e.contains("per-chunk form"), "{e}");
        let new = r#"{"chunk_elems": 16, "lcores": [{"first": 0, "count": 1}, {"first": 1, "count": 0}]}"#;
        let l: Layout = serde_json::from_str(new).unwrap();
        assert_eq!(
            serde_json::from_str::<Layout>(&serde_json::to_string(&l).unwrap()).unwrap(),
            l
        );
    }

    /// A layout over the lcores of several appliances, split into their
    /// parts: each part is a valid part placement that places its own span
    /// of the sequence with the slots the whole layout gives, and the spans
    /// tile the sequence in order.
    #[test]
    fn parts_of_a_layout_over_several_appliances_place_their_spans() {
        let s = spec(&[5000, 1, 2048, 300], Dtype::F32, 256);
        let l = layout(&s, &mut [0; 5], u64::from);
        let whole = Placement::new(&s, l.clone()).unwrap();
        let parts = l.split(&[2, 3]);
        assert_eq!(parts[0].lcores.len(), 2);
        assert_eq!(parts[0].span().end, parts[1].span().start);
        assert_eq!((parts[0].span().start, parts[1].span().end), (0, l.chunk_count()));
        assert!(
            Placement::new(&s, parts[1].clone()).is_err(),
            "a part is not the whole"
        );
        let mut offset = 0;
        for part in &parts {
            let p = Placement::part(&s, part.clone()).unwrap();
            for seq in 0..l.chunk_count() {
                let global = whole.place_of(seq).unwrap();
                match p.place_of(seq) {
                    Some(local) => {
                        assert!(part.span().contains(&seq));
                        assert_eq!(usize::from(local.lcore) + offset, usize::from(global.lcore));
                        assert_eq!(local.slot, global.slot);
                        let sc = whole.slot_chunk(usize::from(global.lcore), global.slot);
                        assert_eq!(p.slot_chunk(usize::from(local.lcore), local.slot), sc);
                    }
                    None => assert!(!part.span().contains(&seq)),
                }
            }
            offset += part.lcores.len();
        }
        // A part that runs past the job's chunks is refused.
        let mut over = parts[1].clone();
        over.lcores.last_mut().unwrap().count += 1;
        assert!(matches!(
            Placement::part(&s, over),
            Err(LayoutError::Coverage { .. })
        ));
    }

    #[test]
    fn a_part_placed_anew_keeps_its_span_and_balances_it() {
        let s = spec(&[4096], Dtype::F32, 64);
        let total = Chunks::new(&s).total();
        let mut load = vec![0, 100];
        let p = layout_part(&s, 40..200, &mut load, |_| 10);
        assert_eq!(p.span(), 40..200);
        assert_eq!((p.lcores[0].count, p.lcores[1].count), (85, 75));
        assert_eq!(load, vec![850, 850]);
        assert!(Placement::part(&s, p).is_ok());
        let whole = layout_part(&s, 0..total, &mut [0, 0], |_| 10);
        assert_eq!(whole, layout(&s, &mut [0, 0], |_| 10));
    }

    #[test]
    fn water_filling_evens_out_existing_loads() {
        assert_eq!(water_fill(&[0, 0, 0], 9), [3, 3, 3]);
        assert_eq!(water_fill(&[0, 0, 0], 10), [4, 3, 3]);
        assert_eq!(water_fill(&[10, 0, 4], 6), [0, 5, 1]);
        assert_eq!(water_fill(&[10, 0, 4], 100), [28, 38, 34]);
        assert_eq!(water_fill(&[u64::MAX, 0], u64::MAX), [0, u64::MAX]);
    }

    proptest! {
        #[test]
        fn balanced_within_one_chunk_consistent_and_deterministic(
            keys in prop::collection::vec(1u64..50_000, 1..20),
            loads in prop::collection::vec(0u64..20_000, 1..9),
            dtype in prop::sample::select(Dtype::ALL.to_vec()),
        ) {
            let s = spec(&keys, dtype, 4096);
            let cost = |e: u32| 64 + 4 * u64::from(e);
            let mut load = loads.clone();
            let l = layout(&s, &mut load, cost);
            let mut again = loads.clone();
            prop_assert_eq!(&l, &layout(&s, &mut again, cost));
            let p = Placement::new(&s, l.clone()).unwrap();
            let all = naive(&s, &l);
            prop_assert_eq!(all.len() as u64, l.chunk_count());
            let mut added = vec![0u64; loads.len()];
            for &(sc, place) in &all {
                prop_assert_eq!(p.place(sc.key, sc.chunk), Some(place));
                prop_assert_eq!(p.slot_chunk(usize::from(place.lcore), place.slot), Some(sc));
                added[usize::from(place.lcore)] += cost(sc.elems);
            }
            for (i, r) in l.lcores.iter().enumerate() {
                prop_assert_eq!(p.slots(i).collect::<Vec<_>>(),
                    all.iter().filter(|(_, pl)| usize::from(pl.lcore) == i).map(|&(sc, _)| sc).collect::<Vec<_>>());
                prop_assert_eq!(load[i], loads[i] + added[i]);
                prop_assert_eq!(r.count == 0, added[i] == 0);
            }
            // Lcores that got chunks end within about one chunk of each
            // other, and none above an lcore that got nothing by more.
            let max_chunk = cost(s.chunk_elems());
            let got: Vec<u64> = (0..loads.len()).filter(|&i| added[i] > 0).map(|i| load[i]).collect();
            let (lo, hi) = (got.iter().min().unwrap(), got.iter().max().unwrap());
            prop_assert!(hi - lo <= 2 * max_chunk + 1, "{:?} -> {:?}", loads, load);
            for i in (0..loads.len()).filter(|&i| added[i] == 0) {
                prop_assert!(*lo <= load[i] + 2 * max_chunk + 1, "{:?} -> {:?}", loads, load);
            }
        }
    }
}
