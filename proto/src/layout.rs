//! Chunk layout: keys -> chunks -> (lcore, slot).
//!
//! Each key is cut into chunks of [`JobSpec::chunk_elems`] elements (the last
//! chunk of a key may be shorter). Chunks are placed on lcores so that bytes
//! of slot memory are balanced, counting what other jobs already put on each
//! lcore. Slots are numbered per (job, lcore) from 0 in placement order. The
//! function is pure and deterministic: the same spec and loads give the same
//! layout on every machine.

use serde::{Deserialize, Serialize};

use crate::spec::{JobSpec, Optimizer};
use crate::Dtype;

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

/// A job's chunks and where they live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Elements in a full chunk.
    pub chunk_elems: u32,
    /// Per key, the place of each of its chunks, in chunk order.
    pub keys: Vec<Vec<Place>>,
    /// Per lcore, the slots it owns for this job, in slot order.
    pub lcores: Vec<Vec<SlotChunk>>,
}

impl Layout {
    /// Number of lcores the layout spreads over.
    pub fn lcore_count(&self) -> usize {
        self.lcores.len()
    }

    /// Total number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.lcores.iter().map(Vec::len).sum()
    }

    /// Elements of chunk `chunk` of a key with `elements` elements.
    // Cast: the result is at most chunk_elems, a u32, by the min.
    #[allow(clippy::cast_possible_truncation)]
    pub fn chunk_len(&self, elements: u64, chunk: u32) -> u32 {
        let start = u64::from(chunk) * u64::from(self.chunk_elems);
        (elements.saturating_sub(start)).min(u64::from(self.chunk_elems)) as u32
    }
}

/// Bytes of appliance memory one chunk of `elems` elements takes: the `f32`
/// accumulator, the stored result, and with a server-side optimizer the `f32`
/// parameters and optimizer state. With `f32` on the wire and an optimizer,
/// the parameters themselves are the stored result.
pub fn slot_bytes(dtype: Dtype, optimizer: &Optimizer, elems: u32) -> u64 {
    let e = u64::from(elems);
    let acc = 4 * e;
    let result = if optimizer.keeps_params() && dtype == Dtype::F32 {
        0
    } else {
        dtype.size() as u64 * e
    };
    let params = if optimizer.keeps_params() { 4 * e } else { 0 };
    let state = optimizer.state_buffers() as u64 * 4 * e;
    acc + result + params + state
}

/// Number of chunks a key of `elements` elements is cut into.
pub fn chunks_of(elements: u64, chunk_elems: u32) -> u64 {
    elements.div_ceil(u64::from(chunk_elems))
}

/// Places a job's chunks on `load.len()` lcores, where `load[i]` is the
/// slot memory in bytes already on lcore `i` (from other jobs). Returns the
/// layout and adds this job's bytes to `load`.
///
/// Chunks go, in key order, each to the least-loaded lcore (lowest index on
/// a tie): full chunks are all the same size, so this balances bytes to
/// within one chunk and spreads every large key over all lcores.
///
/// `load` has at most 65536 entries: a place names its lcore by a `u16`.
///
/// # Panics
/// If `load` is empty (an appliance has at least one lcore).
pub fn layout(spec: &JobSpec, load: &mut [u64]) -> Layout {
    assert!(!load.is_empty(), "layout needs at least one lcore");
    let chunk_elems = spec.chunk_elems();
    let mut keys = Vec::with_capacity(spec.keys.len());
    let mut lcores: Vec<Vec<SlotChunk>> = vec![Vec::new(); load.len()];
    for (k, key) in spec.keys.iter().enumerate() {
        let n = chunks_of(key.elements, chunk_elems);
        // Cast: n <= MAX_KEY_ELEMENTS (u32::MAX, checked in JobSpec::validate),
        // and usize is 64 bits on every target phub builds for.
        #[allow(clippy::cast_possible_truncation)]
        let mut places = Vec::with_capacity(n as usize);
        for c in 0..n {
            let start = c * u64::from(chunk_elems);
            // Cast: at most chunk_elems, a u32, by the min.
            #[allow(clippy::cast_possible_truncation)]
            let elems = (key.elements - start).min(u64::from(chunk_elems)) as u32;
            let bytes = slot_bytes(spec.dtype, &spec.optimizer, elems);
            let (lcore, _) = load
                .iter()
                .enumerate()
                .min_by_key(|&(i, &b)| (b, i))
                .expect("load is not empty");
            load[lcore] += bytes;
            // Cast: k < MAX_KEYS (2^20) and c < chunks_of(elements) <= u32::MAX,
            // both checked in JobSpec::validate; lcore < load.len(), one entry
            // per dataplane lcore (at most MAX_LCORES, 256; admission::plan
            // refuses more than 65536); slots on one lcore stay far below 2^32,
            // as each takes slot memory that admission checks against the
            // dataplane's budget before placing.
            #[allow(clippy::cast_possible_truncation)]
            let (key, chunk, lcore16, slot) = (k as u32, c as u32, lcore as u16, lcores[lcore].len() as u32);
            lcores[lcore].push(SlotChunk { key, chunk, elems });
            places.push(Place { lcore: lcore16, slot });
        }
        keys.push(places);
    }
    Layout {
        chunk_elems,
        keys,
        lcores,
    }
}

/// Total slot memory in bytes the job needs on each of `lcores` lcores if
/// placed on an empty appliance; admission checks the real placement.
pub fn job_bytes(spec: &JobSpec) -> u64 {
    let c = spec.chunk_elems();
    spec.keys
        .iter()
        .map(|k| {
            let full = k.elements / u64::from(c);
            // Cast: a remainder modulo c, a u32.
            #[allow(clippy::cast_possible_truncation)]
            let tail = (k.elements % u64::from(c)) as u32;
            full * slot_bytes(spec.dtype, &spec.optimizer, c) + slot_bytes(spec.dtype, &spec.optimizer, tail)
        })
        .sum()
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use super::*;
    use crate::spec::{Consistency, KeySpec};
    use proptest::prelude::*;

    fn spec(keys: &[u64], dtype: Dtype, chunk_bytes: u32) -> JobSpec {
        JobSpec {
            checkpoint_interval_s: None,
            name: "t".into(),
            workers: 2,
            dtype,
            chunk_bytes,
            optimizer: Optimizer::Sgd {
                lr: 0.1,
                weight_decay: 0.0,
            },
            consistency: Consistency::Sync,
            keys: keys
                .iter()
                .map(|&e| KeySpec {
                    name: String::new(),
                    elements: e,
                })
                .collect(),
        }
    }

    #[test]
    fn last_chunk_is_short_and_slots_are_dense() {
        let s = spec(&[5000, 1, 2048], Dtype::F32, 8192);
        let mut load = vec![0; 3];
        let l = layout(&s, &mut load);
        assert_eq!(l.chunk_elems, 2048);
        assert_eq!(l.keys[0].len(), 3);
        assert_eq!(l.keys[1].len(), 1);
        assert_eq!(l.keys[2].len(), 1);
        assert_eq!(l.chunk_len(5000, 2), 5000 - 4096);
        for (i, slots) in l.lcores.iter().enumerate() {
            for (j, sc) in slots.iter().enumerate() {
                let p = l.keys[sc.key as usize][sc.chunk as usize];
                assert_eq!((p.lcore as usize, p.slot as usize), (i, j));
            }
        }
        assert_eq!(load.iter().sum::<u64>(), job_bytes(&s));
    }

    #[test]
    fn slot_bytes_counts_every_buffer() {
        let sum = Optimizer::Sum;
        let adam = Optimizer::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        assert_eq!(slot_bytes(Dtype::F32, &sum, 100), 800);
        assert_eq!(slot_bytes(Dtype::Bf16, &sum, 100), 600);
        assert_eq!(slot_bytes(Dtype::F32, &adam, 100), 1600);
        assert_eq!(slot_bytes(Dtype::F16, &adam, 100), 1800);
    }

    proptest! {
        #[test]
        fn balanced_within_one_chunk_and_deterministic(
            keys in prop::collection::vec(1u64..50_000, 1..20),
            lcores in 1usize..9,
            dtype in prop::sample::select(Dtype::ALL.to_vec()),
        ) {
            let s = spec(&keys, dtype, 4096);
            let mut load = vec![0; lcores];
            let l = layout(&s, &mut load);
            let mut again = vec![0; lcores];
            prop_assert_eq!(&l, &layout(&s, &mut again));
            let max_chunk = slot_bytes(dtype, &s.optimizer, s.chunk_elems());
            let (lo, hi) = (load.iter().min().unwrap(), load.iter().max().unwrap());
            prop_assert!(hi - lo <= max_chunk);
            for (k, places) in l.keys.iter().enumerate() {
                let total: u64 = (0..places.len() as u32).map(|c| u64::from(l.chunk_len(keys[k], c))).sum();
                prop_assert_eq!(total, keys[k]);
            }
        }
    }
}
