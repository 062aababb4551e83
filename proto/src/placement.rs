//! Where a table's rows live (PROTOCOL.md §10.1): row `id` of the table
//! at key index `key` goes to one of the job's lcores, over all its
//! appliances, by a keyed 64-bit mix of (seed, key, id) reduced to the
//! number of lcores by multiply-high. A worker computes it from its join
//! answer alone ([`RowPlacement::from_join`]); an appliance checks with
//! it that a row was sent to the right lcore.
//!
//! Layer: pure, no allocation after [`RowPlacement::new`].
//!
//! Every lcore gets the same share of any set of ids up to the hash's
//! randomness (the tests: 10^6 sequential and 10^6 random ids over 2 to
//! 16 lcores on 1 to 4 appliances, every share within 10% of the mean).
//! Dense chunks are placed by bytes instead (`layout`); rows ignore that
//! balance, each lcore gets 1/L of every table.

use crate::api::JoinResponse;

/// Constant mixed into a table's key so that placement hashes differ from
/// any other use of the same seed: the ASCII bytes `phubrows` read as a
/// big-endian `u64`.
pub const PLACEMENT_TAG: u64 = u64::from_be_bytes(*b"phubrows");

/// The 64-bit finalizer of SplitMix64 (Steele, Lea and Flood, 2014;
/// Stafford's "Mix13" constants): a bijection of `u64` in which every
/// input bit changes every output bit with probability close to 1/2.
pub const fn mix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The placement key of table `key` of a table spec's `seed`:
/// `mix64(seed ^ mix64(PLACEMENT_TAG ^ key))`.
pub const fn table_key(seed: u64, key: u32) -> u64 {
    mix64(seed ^ mix64(PLACEMENT_TAG ^ key as u64))
}

/// Row `id`'s hash under a table's placement key: `mix64(id ^ tk)`.
pub const fn row_hash(tk: u64, id: u64) -> u64 {
    mix64(id ^ tk)
}

/// `floor(h * n / 2^64)`: the high 64 bits of the 128-bit product, an
/// index below `n` (Lemire's multiply-high reduction: no division, and
/// each index gets `floor` or `ceil` of `2^64 / n` hashes).
pub const fn reduce(h: u64, n: u32) -> u32 {
    // Cast: the product's high half is below n, a u32.
    #[allow(clippy::cast_possible_truncation)]
    let i = ((h as u128 * n as u128) >> 64) as u32;
    i
}

/// Where one row goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowPlace {
    /// Index into the job's lcores over all its appliances (the join
    /// answer's `layout.lcores`).
    pub entry: u32,
    /// Which of the job's appliances (`appliances[i]` of the join answer;
    /// 0 for a job on one appliance).
    pub appliance: u32,
    /// The lcore on that appliance: messages go to its `base_port +
    /// lcore`.
    pub lcore: u32,
}

/// What is wrong with a placement's inputs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowPlacementError {
    /// An appliance with no lcores, or no appliance at all.
    #[error("row placement: appliance lcore counts {counts:?}: every appliance needs 1 or more lcores, 1 or more appliances in all, at most 2^32 - 1 lcores")]
    NoLcores {
        /// The counts given.
        counts: Vec<u32>,
    },
    /// `key` names no table key of the job.
    #[error("row placement: key {key} is not a table key of the job (it has {keys} keys)")]
    NotATable {
        /// The key index asked for.
        key: u32,
        /// How many keys the job has.
        keys: usize,
    },
}

/// The placement of one table's rows over a job's lcores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowPlacement {
    tk: u64,
    /// `first[i]`: the entry of appliance i's lcore 0; `first[len]` is the
    /// number of lcores L.
    first: Vec<u32>,
}

impl RowPlacement {
    /// The placement of table `key` with `seed` over appliances of these
    /// lcore counts, in the join answer's order.
    pub fn new(seed: u64, key: u32, appliance_lcores: &[u32]) -> Result<RowPlacement, RowPlacementError> {
        let mut first = Vec::with_capacity(appliance_lcores.len() + 1);
        let mut at = 0u32;
        for &n in appliance_lcores {
            first.push(at);
            match at.checked_add(n) {
                Some(next) if n > 0 => at = next,
                _ => {
                    return Err(RowPlacementError::NoLcores {
                        counts: appliance_lcores.to_vec(),
                    })
                }
            }
        }
        if appliance_lcores.is_empty() {
            return Err(RowPlacementError::NoLcores { counts: Vec::new() });
        }
        first.push(at);
        Ok(RowPlacement {
            tk: table_key(seed, key),
            first,
        })
    }

    /// Table `key`'s placement as a worker reads it from its join answer:
    /// the table's `seed` from the spec, the lcore counts from
    /// `appliances` (or all of `layout.lcores` on `dataplane` when the
    /// answer lists no appliances).
    pub fn from_join(r: &JoinResponse, key: u32) -> Result<RowPlacement, RowPlacementError> {
        let table = r
            .spec
            .keys
            .get(key as usize)
            .and_then(|k| k.table.as_ref())
            .ok_or(RowPlacementError::NotATable {
                key,
                keys: r.spec.keys.len(),
            })?;
        let counts: Vec<u32> = if r.appliances.is_empty() {
            vec![u32::try_from(r.layout.lcores.len()).unwrap_or(u32::MAX)]
        } else {
            r.appliances.iter().map(|a| a.lcores).collect()
        };
        RowPlacement::new(table.seed, key, &counts)
    }

    /// Number of lcores L over all appliances.
    pub fn lcores(&self) -> u32 {
        *self.first.last().expect("first has appliances + 1 entries")
    }

    /// The entry (0 to L − 1) row `id` goes to: `reduce(row_hash(tk,
    /// id), L)`.
    pub fn entry(&self, id: u64) -> u32 {
        reduce(row_hash(self.tk, id), self.lcores())
    }

    /// Where row `id` goes: its entry, and the appliance and lcore that
    /// entry is.
    pub fn place(&self, id: u64) -> RowPlace {
        let entry = self.entry(id);
        // The last appliance whose first entry is <= entry.
        let i = self.first.partition_point(|&f| f <= entry) - 1;
        debug_assert!(i + 1 < self.first.len() && entry < self.first[i + 1]);
        // Cast: at most 2^32 - 1 appliances, as counts are u32 and each >= 1.
        #[allow(clippy::cast_possible_truncation)]
        let appliance = i as u32;
        RowPlace {
            entry,
            appliance,
            lcore: entry - self.first[i],
        }
    }
}

#[cfg(test)]
// Tests cast small sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
mod tests {
    use super::*;

    /// xorshift64*: random ids from a generator unrelated to `mix64`.
    fn random_ids(n: usize, mut s: u64) -> Vec<u64> {
        (0..n)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                s.wrapping_mul(0x2545_f491_4f6c_dd1d)
            })
            .collect()
    }

    /// The balance requirement: for 10^6 sequential and 10^6
    /// random ids, over 2 to 16 lcores per appliance and 1 to 4
    /// appliances, every lcore's share within 10% of the mean.
    #[test]
    fn every_lcore_gets_its_share_within_ten_percent() {
        let sets = [
            (0..1_000_000u64).collect::<Vec<_>>(),
            random_ids(1_000_000, 0x9e37_79b9_7f4a_7c15),
        ];
        let mut worst = 0f64;
        for (seed, key) in [(0u64, 0u32), (7, 1)] {
            for ids in &sets {
                let tk = table_key(seed, key);
                let hashes: Vec<u64> = ids.iter().map(|&id| row_hash(tk, id)).collect();
                for appliances in 1..=4u32 {
                    for per in 2..=16u32 {
                        let p = RowPlacement::new(seed, key, &vec![per; appliances as usize]).unwrap();
                        let l = p.lcores();
                        let mut share = vec![0u64; l as usize];
                        for &h in &hashes {
                            share[reduce(h, l) as usize] += 1;
                        }
                        let mean = ids.len() as f64 / f64::from(l);
                        for (e, &n) in share.iter().enumerate() {
                            let off = (n as f64 - mean).abs() / mean;
                            worst = worst.max(off);
                            assert!(
                                off <= 0.10,
                                "seed {seed} key {key}, {appliances} x {per} lcores: entry {e} has {n}, mean {mean}"
                            );
                        }
                    }
                }
            }
        }
        // With L <= 64 and 10^6 ids the deviation is a few percent at most
        // (one standard deviation is about 0.8% of the mean at L = 64).
        assert!(worst < 0.05, "worst share {worst}");
    }

    #[test]
    fn unequal_appliances_are_balanced_per_lcore_and_places_are_consistent() {
        let p = RowPlacement::new(3, 2, &[2, 1, 5]).unwrap();
        assert_eq!(p.lcores(), 8);
        let mut per = [[0u32; 5]; 3];
        for id in random_ids(200_000, 1) {
            let pl = p.place(id);
            assert_eq!(pl.entry, p.entry(id));
            assert_eq!(pl.entry, [0, 2, 3][pl.appliance as usize] + pl.lcore);
            assert!(pl.lcore < [2, 1, 5][pl.appliance as usize]);
            per[pl.appliance as usize][pl.lcore as usize] += 1;
        }
        // Appliance b's single lcore gets 1/8 of the rows, like each other lcore.
        let b = f64::from(per[1][0]) / 200_000.0;
        assert!((b - 0.125).abs() < 0.01, "{b}");
        assert!(RowPlacement::new(0, 0, &[]).is_err());
        assert!(RowPlacement::new(0, 0, &[2, 0]).is_err());
        assert!(RowPlacement::new(0, 0, &[u32::MAX, 1]).is_err());
        // Seeds and keys give other placements.
        let q = RowPlacement::new(4, 2, &[2, 1, 5]).unwrap();
        let r = RowPlacement::new(3, 3, &[2, 1, 5]).unwrap();
        let moved = |o: &RowPlacement| (0..1000u64).filter(|&id| o.entry(id) != p.entry(id)).count();
        assert!(moved(&q) > 800 && moved(&r) > 800, "{} {}", moved(&q), moved(&r));
    }

    #[test]
    fn reduce_is_multiply_high() {
        assert_eq!(reduce(0, 7), 0);
        assert_eq!(reduce(u64::MAX, 7), 6);
        assert_eq!(reduce(1 << 63, 2), 1);
        assert_eq!(reduce((1 << 63) - 1, 2), 0);
        // SplitMix64's finalizer, checked against the generator's known
        // first output for seed 0 (state 0x9e3779b97f4a7c15).
        assert_eq!(mix64(0x9e37_79b9_7f4a_7c15), 0xe220_a839_7b1d_cdaf);
        assert_eq!(PLACEMENT_TAG, 0x7068_7562_726f_7773);
    }
}
