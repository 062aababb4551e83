//! Where a replicated job's chunks are served in an epoch (PROTOCOL.md
//! §11.6): after appliances are declared down, each chunk is served by the
//! first live member of its replica set (§11.1), in the slots that member
//! already keeps for it: its own slots if it is the chunk's home, else the
//! backup slots of §11.2. Control, every appliance and every worker
//! compute the same from the job's layout, rack labels, replica count and
//! the epoch's down list ([`EpochView`]), so a new epoch is a few bytes:
//! its number and who is down.
//!
//! **Re-joined appliances** (§11.7). An appliance declared down that comes
//! back (empty) is listed in the view's `joined` with the epoch it came
//! back at; in every replica set it is a member of it goes to the end,
//! after the members that kept their state, in the order of those epochs
//! ([`ReplicaLayout::set_in`]). So it is never made primary while a member
//! that kept the part's state is live; it becomes a backup, filled by a
//! state copy from the part's primary. A view without `joined` means what
//! it meant before re-joins existed.
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

/// A replicated job's epoch as control publishes it: its number, the
/// appliances down (indices in layout order, ascending, each once) and
/// those that came back after being declared down. Epoch 0, nobody down,
/// when admitted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpochView {
    /// The layout's epoch (§11.5).
    pub epoch: u32,
    /// Appliances down in this epoch: declared down and not come back
    /// since.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub down: Vec<u16>,
    /// Appliances that came back after being declared down (PROTOCOL.md
    /// §11.7), ascending by appliance, each once, with the epoch each last
    /// came back at. One also in `down` went down again and is down.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub joined: Vec<Joined>,
    /// Appliance indices served by another appliance than the one the
    /// job was admitted with (a drain, PROTOCOL.md §11.8), ascending by
    /// index, each once: the index's data address from that epoch on.
    /// Each is also `joined` at its epoch or later (it came in empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moved: Vec<Moved>,
    /// The epoch at which the whole job last went back to its checkpoints
    /// (PROTOCOL.md §11.7, restored parts); 0 (absent): never. A RESULT
    /// an appliance sent in an earlier epoch is of a history the job
    /// left: its rounds are repeated since, and a worker drops it.
    #[serde(default, skip_serializing_if = "crate::spec::is_zero")]
    pub restored: u32,
}

/// An appliance index of a replicated job that another appliance serves
/// from an epoch on (PROTOCOL.md §11.8): a drain moved it there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Moved {
    /// Its index in layout order.
    pub appliance: u16,
    /// The epoch it moved at (at least 1, at most the view's).
    pub epoch: u32,
    /// The appliance that serves it now (control's name for it).
    pub name: String,
    /// That appliance's data address: an IPv4 address, and the UDP port
    /// of its lcore 0 (lcore i listens on `base_port + i`).
    pub data: crate::api::DataAddr,
}

impl Moved {
    /// Lcore `lcore`'s data address; `None` when the host is not an IPv4
    /// address or the port is past 65535.
    pub fn lcore_addr(&self, lcore: usize) -> Option<std::net::SocketAddrV4> {
        let ip: std::net::Ipv4Addr = self.data.host.parse().ok()?;
        let port = u16::try_from(usize::from(self.data.base_port) + lcore).ok()?;
        Some(std::net::SocketAddrV4::new(ip, port))
    }
}

/// An appliance that came back into a replicated job (PROTOCOL.md §11.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Joined {
    /// Its index in layout order.
    pub appliance: u16,
    /// The epoch it came back at (at least 1, at most the view's).
    pub epoch: u32,
}

impl EpochView {
    /// Whether appliance `a` is down in this epoch.
    pub fn is_down(&self, a: usize) -> bool {
        self.down.iter().any(|&d| usize::from(d) == a)
    }

    /// The epoch appliance `a` last came back at, if it ever did.
    pub fn joined_at(&self, a: usize) -> Option<u32> {
        self.joined
            .iter()
            .find(|j| usize::from(j.appliance) == a)
            .map(|j| j.epoch)
    }

    /// Where appliance `a` moved to (a drain), if it ever did: the
    /// latest move.
    pub fn moved_to(&self, a: usize) -> Option<&Moved> {
        self.moved.iter().find(|m| usize::from(m.appliance) == a)
    }

    /// The moves this view names that `old` does not (an index moved
    /// since, or moved again): where an appliance or a worker holding
    /// `old` re-addresses an index on taking this view.
    pub fn moves_since<'a>(&'a self, old: &'a EpochView) -> impl Iterator<Item = &'a Moved> + 'a {
        self.moved
            .iter()
            .filter(move |m| old.moved_to(usize::from(m.appliance)) != Some(*m))
    }

    /// Whether it names no appliance down, come back or moved: every
    /// index is served by the appliance the job was admitted with, in
    /// its own slots (epoch 0, or one the job went back to its
    /// checkpoints at).
    pub fn names_nobody(&self) -> bool {
        self.down.is_empty() && self.joined.is_empty() && self.moved.is_empty()
    }

    /// The next epoch, at which the whole job goes back to its
    /// checkpoints (PROTOCOL.md §11.7, "Restored parts"): naming nobody,
    /// `restored` at it.
    pub fn back_to_checkpoints(&self) -> EpochView {
        EpochView {
            epoch: self.epoch + 1,
            restored: self.epoch + 1,
            ..EpochView::default()
        }
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
            joined: self.joined.clone(),
            moved: self.moved.clone(),
            restored: self.restored,
        })
    }

    /// The next epoch, with index `a` served by appliance `name` at `data`
    /// (a drain, PROTOCOL.md §11.8): `a` leaves the down list if it was
    /// there and is joined at the new epoch (the new appliance comes in
    /// empty, at the end of its replica sets, and gets state copies), and
    /// `moved` records where it is now (replacing an earlier move of it).
    pub fn with_moved(&self, a: u16, name: &str, data: crate::api::DataAddr) -> EpochView {
        let epoch = self.epoch + 1;
        let down = self.down.iter().copied().filter(|&d| d != a).collect();
        let mut joined: Vec<Joined> = self.joined.iter().copied().filter(|j| j.appliance != a).collect();
        joined.push(Joined { appliance: a, epoch });
        joined.sort_unstable_by_key(|j| j.appliance);
        let mut moved: Vec<Moved> = self.moved.iter().filter(|m| m.appliance != a).cloned().collect();
        moved.push(Moved {
            appliance: a,
            epoch,
            name: name.to_string(),
            data,
        });
        moved.sort_unstable_by_key(|m| m.appliance);
        EpochView {
            epoch,
            down,
            joined,
            moved,
            restored: self.restored,
        }
    }

    /// The next epoch, with down appliance `a` back (`None` if it is not
    /// down): it leaves `down` and is `joined` at the new epoch, which puts
    /// it at the end of its replica sets ([`ReplicaLayout::set_in`]).
    pub fn with_joined(&self, a: u16) -> Option<EpochView> {
        if !self.is_down(usize::from(a)) {
            return None;
        }
        let epoch = self.epoch + 1;
        let down = self.down.iter().copied().filter(|&d| d != a).collect();
        let mut joined: Vec<Joined> = self.joined.iter().copied().filter(|j| j.appliance != a).collect();
        joined.push(Joined { appliance: a, epoch });
        joined.sort_unstable_by_key(|j| j.appliance);
        Some(EpochView {
            epoch,
            down,
            joined,
            moved: self.moved.clone(),
            restored: self.restored,
        })
    }

    /// Whether the view is well formed for a job of `n` appliances: `down`
    /// ascending indices below `n`, each once; `joined` ascending by
    /// appliance below `n`, each once, each at an epoch from 1 to the
    /// view's. The error names the list, its value and what is accepted.
    pub fn check(&self, n: usize) -> Result<(), String> {
        if self.down.windows(2).any(|w| w[0] >= w[1]) || self.down.iter().any(|&d| usize::from(d) >= n) {
            return Err(format!(
                "down {:?}: appliance indices 0..{n}, ascending, each once",
                self.down
            ));
        }
        if self.joined.windows(2).any(|w| w[0].appliance >= w[1].appliance)
            || self
                .joined
                .iter()
                .any(|j| usize::from(j.appliance) >= n || j.epoch == 0 || j.epoch > self.epoch)
        {
            return Err(format!(
                "joined {:?}: appliance indices 0..{n}, ascending, each once, each at an epoch 1..={}",
                self.joined, self.epoch
            ));
        }
        if self.moved.windows(2).any(|w| w[0].appliance >= w[1].appliance)
            || self.moved.iter().any(|m| {
                usize::from(m.appliance) >= n
                    || m.epoch == 0
                    || m.epoch > self.epoch
                    || self
                        .joined_at(usize::from(m.appliance))
                        .is_none_or(|j| j < m.epoch)
                    || m.lcore_addr(0).is_none()
            })
        {
            return Err(format!(
                "moved {:?}: appliance indices 0..{n}, ascending, each once, each at an epoch 1..={}, joined \
                 then or later, at an IPv4 data address",
                self.moved, self.epoch
            ));
        }
        Ok(())
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

    /// `p`'s replica set in an epoch (PROTOCOL.md §11.7): the set of
    /// §11.1 without its down members, those that came back moved to the
    /// end in the order of the epochs they came back at (set order among
    /// equals). Its first member serves the part, the others back it up.
    pub fn set_in(&self, p: usize, epoch: &EpochView) -> Vec<usize> {
        let mut live: Vec<usize> = self.set(p).into_iter().filter(|&a| !epoch.is_down(a)).collect();
        // Stable: members that never came back keep set order, first.
        live.sort_by_key(|&a| epoch.joined_at(a).unwrap_or(0));
        live
    }

    /// Who serves `p`'s part in an epoch: the first member of its replica
    /// set in that epoch ([`ReplicaLayout::set_in`]); `None` when all are
    /// down (the part is lost).
    pub fn primary(&self, p: usize, epoch: &EpochView) -> Option<usize> {
        self.set_in(p, epoch).first().copied()
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

    /// [`ReplicaLayout::lost_part`] for a job with table keys: every
    /// appliance's lcores are entries holding rows (PROTOCOL.md §11.9),
    /// whatever its chunks, so a part without chunks is lost too when
    /// every member of its set is down.
    pub fn lost_part_with_tables(&self, epoch: &EpochView) -> Option<usize> {
        (0..self.appliances()).find(|&p| self.primary(p, epoch).is_none())
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
                down: vec![1],
                ..Default::default()
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
            ..Default::default()
        };
        assert_eq!(l.serve(2, &both).unwrap().slot, 2);
        assert_eq!(l.serve(8, &both).unwrap().slot, 8);
        // With only 1 down, 2's part stays at 2; 1's goes to its set's
        // next live member.
        let one = EpochView {
            epoch: 1,
            down: vec![1],
            ..Default::default()
        };
        assert_eq!(l.serve(5, &one).unwrap().appliance, 2);
        let next = l.set(1)[1];
        assert_eq!(l.serve(2, &one).unwrap().appliance, next);
    }

    #[test]
    fn an_appliance_that_comes_back_goes_to_the_end_of_its_sets_and_is_never_made_primary() {
        // One lcore each, one rack, replicas 2: sets 0 → 1, 1 → 2, 2 → 0.
        let l = ReplicaLayout::new(runs(&[2, 3, 4]), &[1, 1, 1], vec![""; 3], 2).unwrap();
        let e1 = EpochView::default().with_down(1).unwrap();
        let e2 = e1.with_joined(1).unwrap();
        assert_eq!(
            e2,
            EpochView {
                epoch: 2,
                down: vec![],
                joined: vec![Joined {
                    appliance: 1,
                    epoch: 2
                }],
                moved: vec![],
                restored: 0,
            }
        );
        assert_eq!(e2.with_joined(1), None, "only a down appliance comes back");
        // 1's part stays with 2, 1 is its backup; 0's part keeps 1 as backup.
        assert_eq!(l.set_in(1, &e2), [2, 1]);
        assert_eq!(l.set_in(0, &e2), [0, 1]);
        assert_eq!(l.serve(2, &e2).unwrap().appliance, 2);
        assert!(l.serve(2, &e2).unwrap().adopted);
        // 2 dies: 1, the only live member of its own part's set, serves it
        // in its own slots again.
        let e3 = e2.with_down(2).unwrap();
        assert_eq!(e3.joined, e2.joined);
        assert_eq!(l.set_in(1, &e3), [1]);
        assert_eq!(
            l.serve(2, &e3).unwrap(),
            Served {
                appliance: 1,
                lcore: 0,
                slot: 0,
                adopted: false
            }
        );
        // 2's part goes to 0, its first live member.
        assert_eq!(l.primary(2, &e3), Some(0));
        // Two came back: in the order of their epochs, at the end.
        let l3 = ReplicaLayout::new(runs(&[2, 3, 4]), &[1, 1, 1], vec![""; 3], 3).unwrap();
        let e = EpochView {
            epoch: 5,
            down: vec![],
            joined: vec![
                Joined {
                    appliance: 0,
                    epoch: 4,
                },
                Joined {
                    appliance: 1,
                    epoch: 3,
                },
            ],
            moved: vec![],
            restored: 0,
        };
        assert_eq!(l3.set(0), [0, 1, 2]);
        assert_eq!(l3.set_in(0, &e), [2, 1, 0]);
        assert_eq!(l3.primary(0, &e), Some(2));
        // Without `joined`, every set is as before.
        let plain = EpochView {
            epoch: 1,
            down: vec![2],
            ..Default::default()
        };
        for p in 0..3 {
            let old: Vec<usize> = l3.set(p).into_iter().filter(|&a| !plain.is_down(a)).collect();
            assert_eq!(l3.set_in(p, &plain), old);
        }
    }

    /// The epoch a job went back to its checkpoints at stays in every
    /// later view, and is left out of the JSON while there is none.
    #[test]
    fn the_restored_epoch_is_carried_into_every_later_epoch() {
        let was = EpochView::default().with_down(1).unwrap();
        assert!(!was.names_nobody());
        let back = EpochView { epoch: 3, ..was }.back_to_checkpoints();
        assert_eq!(
            back,
            EpochView {
                epoch: 4,
                restored: 4,
                ..Default::default()
            }
        );
        assert!(back.names_nobody());
        let later = back.with_down(1).unwrap().with_joined(1).unwrap();
        assert_eq!((later.epoch, later.restored), (6, 4));
        let data = crate::api::DataAddr {
            host: "10.0.0.9".into(),
            base_port: 9000,
        };
        assert_eq!(later.with_moved(2, "d", data).restored, 4);
        let json = serde_json::to_string(&later).unwrap();
        assert!(json.contains("\"restored\":4"), "{json}");
        assert_eq!(serde_json::from_str::<EpochView>(&json).unwrap(), later);
        let never = serde_json::to_string(&EpochView::default().with_down(0).unwrap()).unwrap();
        assert!(!never.contains("restored"), "{never}");
        assert_eq!(serde_json::from_str::<EpochView>(&never).unwrap().restored, 0);
    }

    #[test]
    fn a_view_is_checked_naming_the_list_and_what_is_accepted() {
        let ok = EpochView {
            epoch: 3,
            down: vec![2],
            joined: vec![
                Joined {
                    appliance: 0,
                    epoch: 2,
                },
                Joined {
                    appliance: 2,
                    epoch: 3,
                },
            ],
            moved: vec![],
            restored: 0,
        };
        assert_eq!(ok.check(3), Ok(()));
        let e = ok.check(2).unwrap_err();
        assert!(e.contains("down [2]") && e.contains("0..2"), "{e}");
        let late = EpochView {
            epoch: 1,
            joined: vec![Joined {
                appliance: 0,
                epoch: 2,
            }],
            ..Default::default()
        };
        let e = late.check(3).unwrap_err();
        assert!(e.contains("joined") && e.contains("epoch 1..=1"), "{e}");
        let twice = EpochView {
            epoch: 4,
            joined: vec![
                Joined {
                    appliance: 1,
                    epoch: 2,
                },
                Joined {
                    appliance: 1,
                    epoch: 3,
                },
            ],
            ..Default::default()
        };
        assert!(twice.check(3).is_err());
    }

    #[test]
    fn a_view_with_joins_reads_and_writes_as_documented() {
        let v: EpochView =
            serde_json::from_str(r#"{ "epoch": 2, "joined": [ { "appliance": 1, "epoch": 2 } ] }"#).unwrap();
        assert_eq!(
            v,
            EpochView::default().with_down(1).unwrap().with_joined(1).unwrap()
        );
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"epoch":2,"joined":[{"appliance":1,"epoch":2}]}"#
        );
        // A view of before re-joins writes as it did.
        assert_eq!(
            serde_json::to_string(&EpochView::default().with_down(1).unwrap()).unwrap(),
            r#"{"epoch":1,"down":[1]}"#
        );
    }

    #[test]
    fn a_moved_index_joins_at_the_end_of_its_sets_at_its_new_address() {
        let at = |port| crate::api::DataAddr {
            host: "10.0.0.4".into(),
            base_port: port,
        };
        // Index 1 served by "d" from epoch 1, straight from epoch 0 (a
        // drain of a live appliance): joined there, at the end of its sets.
        let l = ReplicaLayout::new(runs(&[2, 3, 4]), &[1, 1, 1], vec![""; 3], 2).unwrap();
        let e1 = EpochView::default().with_moved(1, "d", at(7000));
        assert_eq!(e1.epoch, 1);
        assert_eq!(e1.check(3), Ok(()));
        assert!(!e1.is_down(1));
        assert_eq!(e1.joined_at(1), Some(1));
        assert_eq!(l.set_in(1, &e1), [2, 1]);
        assert_eq!(l.set_in(0, &e1), [0, 1]);
        let m = e1.moved_to(1).unwrap();
        assert_eq!((m.name.as_str(), m.epoch), ("d", 1));
        assert_eq!(m.lcore_addr(2), Some("10.0.0.4:7002".parse().unwrap()));
        // Carried by later epochs; a second move of the index replaces it.
        let e2 = e1.with_down(0).unwrap();
        assert_eq!(e2.moved, e1.moved);
        let e3 = e2.with_joined(0).unwrap().with_moved(1, "e", at(8000));
        assert_eq!(e3.moved.len(), 1);
        assert_eq!((e3.moved[0].name.as_str(), e3.moved[0].epoch), ("e", 4));
        assert_eq!(e3.check(3), Ok(()));
        // What a holder of an older view re-addresses on taking a newer.
        assert_eq!(e1.moves_since(&EpochView::default()).count(), 1);
        assert_eq!(e2.moves_since(&e1).count(), 0);
        assert_eq!(
            e3.moves_since(&e2).map(|m| m.name.as_str()).collect::<Vec<_>>(),
            ["e"]
        );
        // Refused: past the appliances, not joined since, not IPv4.
        assert!(e1.check(1).is_err());
        let mut stale = e1.clone();
        stale.joined.clear();
        assert!(stale.check(3).unwrap_err().contains("joined then or later"));
        let mut named = EpochView::default().with_moved(0, "d", at(7000));
        named.moved[0].data.host = "d.example".into();
        assert!(named.check(3).unwrap_err().contains("IPv4"));
        // Written only when there is a move: older views read as before.
        let json = serde_json::to_string(&e1).unwrap();
        assert!(
            json.contains(r#""moved":[{"appliance":1,"epoch":1,"name":"d""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<EpochView>(&json).unwrap(), e1);
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
                down: vec![0, 2],
                ..Default::default()
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
            let e = EpochView { epoch: u32::try_from(down.len()).unwrap(), down, ..Default::default() };
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
