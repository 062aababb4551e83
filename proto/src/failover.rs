//! Where a replicated job's chunks are served in an epoch (PROTOCOL.md
//! §11.6): after appliances are declared down, each chunk is served by the
//! first live member of its replica set (§11.1), in the slots that member
//! already keeps for it: its own slots if it is the chunk's home, else the
//! backup slots of §11.2. Control, every appliance and every worker
//! compute the same from the job's layout, rack labels, replica count and
//! the epoch's down list ([`EpochView`]), so a new epoch is a few bytes:
//! its number and who is down.
//!
//! **Extended slot numbers.** A worker names a chunk by (appliance, lcore,
//! slot). On lcore j of appliance q, slots `0 .. own` are q's own slots
//! (§4.1, `own` = the length of q's run on j), and the backup slots follow:
//! for each part q backs up, in ascending order of its home appliance, that
//! part's backup slots on j (§11.2, numbered from 0 there) numbered on from
//! where the previous part's ended. The numbering covers every backup part
//! from epoch 0 on, so a slot's number never changes with the epoch.
//! Replication messages keep §11.3's per-part numbering.

use serde::{Deserialize, Serialize};

use crate::layout::ChunkRange;
use crate::replica::{backup_runs, place, replica_set};

/// A replicated job's epoch as control publishes it: its number and the
/// appliances declared down (indices in layout order, ascending, each
/// once). Epoch 0, nobody down, when admitted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpochView {
    /// The layout's epoch (§11.5).
    pub epoch: u32,
    /// Appliances declared down since admission.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub down: Vec<u16>,
}

impl EpochView {
    /// Whether appliance `a` is down in this epoch.
    pub fn is_down(&self, a: usize) -> bool {
        self.down.iter().any(|&d| usize::from(d) == a)
    }

    /// The next epoch, with `a` also down (`None` if it already is).
    pub fn with_down(&self, a: u16) -> Option<EpochView> {
        if self.is_down(usize::from(a)) {
            return None;
        }
        let mut down = self.down.clone();
        down.push(a);
        down.sort_unstable();
        Some(EpochView {
            epoch: self.epoch + 1,
            down,
        })
    }
}

/// Where a chunk is served in an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// The appliance (index in layout order).
    pub appliance: usize,
    /// Its lcore.
    pub lcore: usize,
    /// The extended slot number on that lcore (module head).
    pub slot: u64,
    /// Whether the slot is a backup slot the appliance took over (the
    /// chunk's home is down), not one of its own.
    pub adopted: bool,
}

/// A replicated job's layout as far as failover needs it: the §4.1 runs
/// over every appliance's lcores, each appliance's lcore count and rack
/// label, and the replica count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaLayout<R> {
    runs: Vec<ChunkRange>,
    /// Per appliance: index of its first run in `runs`, and its lcores.
    at: Vec<(usize, usize)>,
    racks: Vec<R>,
    replicas: usize,
}

impl<R: Eq> ReplicaLayout<R> {
    /// `runs`: the job's layout over all appliances (appliance 0's lcores
    /// first); `lcores[i]`: appliance i's lcore count; `racks[i]`: its rack
    /// label. Refused, naming what disagrees, when the counts differ, an
    /// appliance has no lcore or `replicas` is not 1 ..= appliances.
    pub fn new(
        runs: Vec<ChunkRange>,
        lcores: &[usize],
        racks: Vec<R>,
        replicas: usize,
    ) -> Result<Self, String> {
        let n = lcores.len();
        if racks.len() != n {
            return Err(format!("{} rack labels for {n} appliances", racks.len()));
        }
        if !(1..=n).contains(&replicas) {
            return Err(format!("replicas = {replicas}: 1 to {n} (the appliance count)"));
        }
        if let Some(i) = lcores.iter().position(|&l| l == 0) {
            return Err(format!("appliance {i} has no lcore"));
        }
        let total: usize = lcores.iter().sum();
        if total != runs.len() {
            return Err(format!("{} runs for {total} lcores", runs.len()));
        }
        let mut at = Vec::with_capacity(n);
        let mut k = 0;
        for &l in lcores {
            at.push((k, l));
            k += l;
        }
        Ok(ReplicaLayout {
            runs,
            at,
            racks,
            replicas,
        })
    }

    /// The number of appliances.
    pub fn appliances(&self) -> usize {
        self.at.len()
    }

    /// Appliance `p`'s runs, one per lcore.
    pub fn runs_of(&self, p: usize) -> &[ChunkRange] {
        let (k, l) = self.at[p];
        &self.runs[k..k + l]
    }

    /// Appliance `p`'s part: the chunks of its runs, which follow one
    /// another (§11.2).
    pub fn part(&self, p: usize) -> ChunkRange {
        let own = self.runs_of(p);
        ChunkRange {
            first: own.first().map_or(0, |r| r.first),
            count: own.iter().map(|r| r.count).sum(),
        }
    }

    /// The replica set of `p`'s part (§11.1): `p`, then its backups.
    pub fn set(&self, p: usize) -> Vec<usize> {
        replica_set(&self.racks, p, self.replicas)
    }

    /// The appliance whose part holds chunk `seq` (its home), if any.
    pub fn home(&self, seq: u64) -> Option<usize> {
        (0..self.appliances()).find(|&p| self.part(p).range().contains(&seq))
    }

    /// Who serves `p`'s part in an epoch: the first member of its replica
    /// set not down; `None` when all are (the part is lost).
    pub fn primary(&self, p: usize, epoch: &EpochView) -> Option<usize> {
        self.set(p).into_iter().find(|&a| !epoch.is_down(a))
    }

    /// The parts appliance `q` keeps backup slots of (their homes), in
    /// ascending order.
    pub fn backs_up(&self, q: usize) -> Vec<usize> {
        (0..self.appliances())
            .filter(|&p| p != q && self.set(p).contains(&q))
            .collect()
    }

    /// The extended slot number of backup slot 0 of `p`'s part on lcore
    /// `j` of appliance `q`, and that lcore's backup run of the part;
    /// `None` when `q` does not back `p` up.
    pub fn backup_base(&self, q: usize, j: usize, p: usize) -> Option<(u64, ChunkRange)> {
        let lcores = self.at[q].1;
        let mut base = self.runs_of(q)[j].count;
        for b in self.backs_up(q) {
            let run = backup_runs(self.part(b), lcores)[j];
            if b == p {
                return Some((base, run));
            }
            base += run.count;
        }
        None
    }

    /// Where chunk `seq` is served in `epoch`; `None` when no appliance
    /// holds it (out of the layout) or every member of its set is down.
    pub fn serve(&self, seq: u64, epoch: &EpochView) -> Option<Served> {
        let p = self.home(seq)?;
        let q = self.primary(p, epoch)?;
        if q == p {
            let (lcore, slot) = place(self.runs_of(p), seq)?;
            return Some(Served {
                appliance: p,
                lcore,
                slot,
                adopted: false,
            });
        }
        let runs = backup_runs(self.part(p), self.at[q].1);
        let (lcore, index) = place(&runs, seq)?;
        let (base, _) = self.backup_base(q, lcore, p)?;
        Some(Served {
            appliance: q,
            lcore,
            slot: base + index,
            adopted: true,
        })
    }

    /// The first part (its home) every replica of which is down in
    /// `epoch`, if any: such a job cannot go on.
    pub fn lost_part(&self, epoch: &EpochView) -> Option<usize> {
        (0..self.appliances()).find(|&p| self.part(p).count > 0 && self.primary(p, epoch).is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn runs(counts: &[u64]) -> Vec<ChunkRange> {
        let mut first = 0;
        counts
            .iter()
            .map(|&count| {
                let r = ChunkRange { first, count };
                first += count;
                r
            })
            .collect()
    }

    #[test]
    fn with_nobody_down_every_chunk_is_served_at_home_as_the_layout_says() {
        // Three appliances, 2 + 1 + 2 lcores, one rack, replicas 2.
        let l = ReplicaLayout::new(runs(&[3, 2, 4, 1, 2]), &[2, 1, 2], vec![""; 3], 2).unwrap();
        let e0 = EpochView::default();
        let want = [
            (0, 0, 0),
            (0, 0, 1),
            (0, 0, 2),
            (0, 1, 0),
            (0, 1, 1),
            (1, 0, 0),
            (1, 0, 3),
            (2, 0, 0),
            (2, 1, 1),
        ];
        for (seq, (a, j, s)) in [0, 1, 2, 3, 4, 5, 8, 9, 11].into_iter().zip(want) {
            let got = l.serve(seq, &e0).unwrap();
            assert_eq!(
                (got.appliance, got.lcore, got.slot, got.adopted),
                (a, j, s, false),
                "chunk {seq}"
            );
        }
        assert_eq!(l.serve(12, &e0), None);
    }

    #[test]
    fn a_down_home_is_served_by_its_first_backup_in_its_backup_slots() {
        // Appliance 1 (chunks 5..9 on one lcore) is backed up by 2 (two
        // lcores: chunks 5, 6 on lcore 0, 7, 8 on lcore 1). Appliance 2
        // also backs up nothing else with replicas 2 over 3 (0 → 1, 1 → 2,
        // 2 → 0), so its backup slots start right after its own.
        let l = ReplicaLayout::new(runs(&[3, 2, 4, 1, 2]), &[2, 1, 2], vec![""; 3], 2).unwrap();
        let e1 = EpochView::default().with_down(1).unwrap();
        assert_eq!(
            e1,
            EpochView {
                epoch: 1,
                down: vec![1]
            }
        );
        assert_eq!(l.backs_up(2), [1]);
        let s = |seq| l.serve(seq, &e1).unwrap();
        assert_eq!(
            s(5),
            Served {
                appliance: 2,
                lcore: 0,
                slot: 1,
                adopted: true
            }
        );
        assert_eq!(
            s(6),
            Served {
                appliance: 2,
                lcore: 0,
                slot: 2,
                adopted: true
            }
        );
        assert_eq!(
            s(7),
            Served {
                appliance: 2,
                lcore: 1,
                slot: 2,
                adopted: true
            }
        );
        assert_eq!(
            s(8),
            Served {
                appliance: 2,
                lcore: 1,
                slot: 3,
                adopted: true
            }
        );
        // The others' chunks stay where they were.
        assert_eq!(s(0).appliance, 0);
        assert_eq!(
            s(11),
            Served {
                appliance: 2,
                lcore: 1,
                slot: 1,
                adopted: false
            }
        );
        assert_eq!(l.lost_part(&e1), None);
        // Appliance 2 down too: 1's part has no live replica left.
        let e2 = e1.with_down(2).unwrap();
        assert_eq!(e2.down, [1, 2]);
        assert_eq!(l.lost_part(&e2), Some(1));
        assert_eq!(e2.with_down(1), None);
    }

    #[test]
    fn backup_slots_follow_the_own_slots_part_by_part_in_home_order() {
        // Replicas 3 over 3 appliances of one lcore: each backs up both
        // others. Appliance 0 (2 chunks) keeps 1's part (3) then 2's (4).
        let l = ReplicaLayout::new(runs(&[2, 3, 4]), &[1, 1, 1], vec![""; 3], 3).unwrap();
        assert_eq!(l.backs_up(0), [1, 2]);
        assert_eq!(l.backup_base(0, 0, 1).unwrap().0, 2);
        assert_eq!(l.backup_base(0, 0, 2).unwrap().0, 5);
        let both = EpochView {
            epoch: 2,
            down: vec![1, 2],
        };
        assert_eq!(l.serve(2, &both).unwrap().slot, 2);
        assert_eq!(l.serve(8, &both).unwrap().slot, 8);
        // With only 1 down, 2's part stays at 2; 1's goes to its set's
        // next live member.
        let one = EpochView {
            epoch: 1,
            down: vec![1],
        };
        assert_eq!(l.serve(5, &one).unwrap().appliance, 2);
        let next = l.set(1)[1];
        assert_eq!(l.serve(2, &one).unwrap().appliance, next);
    }

    #[test]
    fn a_bad_layout_is_refused_naming_what_disagrees() {
        let e = ReplicaLayout::new(runs(&[1, 1]), &[1, 1], vec![""; 3], 2).unwrap_err();
        assert!(e.contains("3 rack labels for 2 appliances"), "{e}");
        let e = ReplicaLayout::new(runs(&[1, 1]), &[1, 1], vec![""; 2], 3).unwrap_err();
        assert!(e.contains("replicas = 3"), "{e}");
        let e = ReplicaLayout::new(runs(&[1, 1]), &[1, 2], vec![""; 2], 2).unwrap_err();
        assert!(e.contains("2 runs for 3 lcores"), "{e}");
    }

    #[test]
    fn an_epoch_view_reads_and_writes_as_documented() {
        let v: EpochView = serde_json::from_str(r#"{ "epoch": 3, "down": [0, 2] }"#).unwrap();
        assert_eq!(
            v,
            EpochView {
                epoch: 3,
                down: vec![0, 2]
            }
        );
        assert_eq!(
            serde_json::to_string(&EpochView::default()).unwrap(),
            r#"{"epoch":0}"#
        );
        assert!(serde_json::from_str::<EpochView>(r#"{ "epoch": 1, "up": [] }"#).is_err());
    }

    proptest! {
        #[test]
        fn every_chunk_is_served_once_by_a_live_member_of_its_set(
            counts in prop::collection::vec(0u64..9, 1..6),
            lcores_seed in prop::collection::vec(1usize..4, 6),
            racks_seed in prop::collection::vec(0u8..3, 6),
            r in 1usize..=3,
            down_mask in 0u8..64,
        ) {
            let n = counts.len();
            let lcores: Vec<usize> = lcores_seed[..n].to_vec();
            let racks: Vec<u8> = racks_seed[..n].to_vec();
            let r = r.min(n);
            // Spread each appliance's part over its lcores.
            let mut all = Vec::new();
            let mut first = 0;
            for (p, &c) in counts.iter().enumerate() {
                all.extend(backup_runs(ChunkRange { first, count: c }, lcores[p]));
                first += c;
            }
            let l = ReplicaLayout::new(all, &lcores, racks, r).unwrap();
            let down: Vec<u16> = (0..u16::try_from(n).unwrap()).filter(|&a| down_mask & (1 << a) != 0).collect();
            let e = EpochView { epoch: u32::try_from(down.len()).unwrap(), down };
            let mut seen = std::collections::HashSet::new();
            for seq in 0..first {
                let p = l.home(seq).unwrap();
                match l.serve(seq, &e) {
                    None => prop_assert!(l.set(p).iter().all(|&a| e.is_down(a))),
                    Some(s) => {
                        prop_assert!(!e.is_down(s.appliance));
                        prop_assert!(l.set(p).contains(&s.appliance));
                        prop_assert_eq!(s.adopted, s.appliance != p);
                        prop_assert!(seen.insert((s.appliance, s.lcore, s.slot)), "two chunks in one slot");
                        // The slot is the one the same appliance names
                        // with nobody down for its own chunks.
                        if !s.adopted {
                            prop_assert_eq!(l.serve(seq, &EpochView::default()), Some(s));
                        }
                    }
                }
            }
        }
    }
}
