//! A job's geometry, pure: its parts over its appliances, who sends to
//! each, what each installs and what each costs. Methods of the stored
//! job ([`StoredJob`]); whether it is flat or hierarchical is its
//! [`JobShape`], matched here rather than tested at each use.
//!
//! A job's `parts` name its appliances in layout order; part i holds the
//! next `parts[i].lcores` lcores of `layout`. A hierarchical job's part i
//! also leads rack i: its rack layout is `racks[i]`, its ranks
//! `spec.rack_ranks()[i]`, and `layout` is the home layout (PROTOCOL.md
//! §9.1).

use phub_proto::api::{
    DataAddr, DataplaneInfo, Entries, Hierarchy, InstallJob, RackPeer, ReplicaPeer, Replication,
};
use phub_proto::failover::EpochView;
use phub_proto::layout::Layout;
use phub_proto::memory::{MemoryModel, ResultStore};

use crate::state::{JobShape, StoredJob};

/// One rack of a hierarchical job.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rack<'a> {
    /// Its place among the racks (and its appliance's among the parts).
    pub(crate) index: usize,
    /// The appliance that leads it.
    pub(crate) appliance: &'a str,
    /// Its rack layout: the whole job over that appliance's lcores.
    pub(crate) layout: &'a Layout,
}

impl StoredJob {
    /// Takes `view` as its epoch. A replicated hierarchical job is
    /// hierarchical at epoch 0 only: from its first epoch change on it is
    /// a flat replicated job over its home layout, as its appliances make
    /// it when they take that epoch (PROTOCOL.md §11.11).
    pub(crate) fn set_epoch(&mut self, view: EpochView) {
        if view.epoch > 0 {
            self.shape = JobShape::Flat;
        }
        self.epoch = view;
    }

    /// Its parts: each appliance's name and its part of the layout, in
    /// layout order. O(lcores).
    pub(crate) fn part_layouts(&self) -> Vec<(&str, Layout)> {
        let counts: Vec<usize> = self.parts.iter().map(|p| p.lcores as usize).collect();
        let parts: Vec<(&str, Layout)> = self
            .parts
            .iter()
            .map(|p| p.appliance.as_str())
            .zip(self.layout.split(&counts))
            .collect();
        debug_assert_eq!(parts.len(), self.parts.len(), "the parts span the layout");
        parts
    }

    /// Its part on appliance `name`, if it has one there.
    pub(crate) fn part_on(&self, name: &str) -> Option<Layout> {
        self.part_layouts()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, l)| l)
    }

    /// The place of its part on appliance `name` among its parts; for a
    /// hierarchical job, the rack that appliance leads.
    pub(crate) fn part_index(&self, name: &str) -> Option<usize> {
        self.parts.iter().position(|p| p.appliance == name)
    }

    /// A hierarchical job's rack layout on appliance `name`; `None` for a
    /// flat job.
    pub(crate) fn rack_layout_on(&self, name: &str) -> Option<&Layout> {
        match &self.shape {
            JobShape::Flat => None,
            JobShape::Hierarchical { racks } => racks.get(self.part_index(name)?),
        }
    }

    /// The layout its workers send to on appliance `name`, with how many
    /// of them do: a flat job's part there, from its W ranks; a
    /// hierarchical job's rack layout there, from its rack's ranks.
    pub(crate) fn workers_to(&self, name: &str) -> Option<(Layout, u64)> {
        match &self.shape {
            JobShape::Flat => Some((self.part_on(name)?, u64::from(self.spec.workers))),
            JobShape::Hierarchical { racks } => {
                let i = self.part_index(name)?;
                let ranks = self.spec.rack_ranks()?.get(i)?.len() as u64;
                Some((racks.get(i)?.clone(), ranks))
            }
        }
    }

    /// Who sends its chunks to appliance `name`: each layout of the job
    /// there with how many send to its lcores: its workers
    /// ([`StoredJob::workers_to`]) and, for a hierarchical job, every
    /// rack's appliance to its part of the home layout.
    pub(crate) fn senders_to(&self, name: &str) -> Vec<(Layout, u64)> {
        let home = match self.shape {
            JobShape::Flat => None,
            JobShape::Hierarchical { .. } => self.part_on(name).map(|l| (l, self.parts.len() as u64)),
        };
        home.into_iter().chain(self.workers_to(name)).collect()
    }

    /// What appliance `name` installs of it; for a hierarchical job, its
    /// rack layout and the hierarchy, with each appliance's data address
    /// as `data` gives it (None if it has none).
    ///
    /// A replicated job's install also carries every appliance's data
    /// address, rack label (as `rack` gives it) and part (a hierarchical
    /// job's: its part of the home layout), and this one's index among
    /// them ([`StoredJob::replication_for`]).
    pub(crate) fn install_for(
        &self,
        name: &str,
        data: impl Fn(&str) -> Option<DataAddr>,
        rack: impl Fn(&str) -> String,
    ) -> Option<InstallJob> {
        // A hierarchical job's: its home slots, over the home layout, at
        // epoch 0 (its shape is flat from its first epoch change on,
        // PROTOCOL.md §11.11).
        let replication = if self.spec.replicas() > 1 {
            Some(self.replication_for(name, &data, &rack)?)
        } else {
            None
        };
        let racks = match &self.shape {
            JobShape::Flat => {
                return Some(InstallJob {
                    id: self.id,
                    token: self.token,
                    spec: self.spec.clone(),
                    layout: self.part_on(name)?,
                    hierarchy: None,
                    replication,
                    entries: self.entries_of(name),
                });
            }
            JobShape::Hierarchical { racks } => racks,
        };
        let rack = self.part_index(name)?;
        let peers = self
            .parts
            .iter()
            .zip(racks)
            .map(|(p, layout)| {
                Some(RackPeer {
                    name: p.appliance.clone(),
                    data: data(&p.appliance)?,
                    layout: layout.clone(),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(InstallJob {
            id: self.id,
            token: self.token,
            spec: self.spec.clone(),
            layout: racks.get(rack)?.clone(),
            hierarchy: Some(Hierarchy {
                rack: u16::try_from(rack).ok()?,
                racks: peers,
                homes: self.layout.clone(),
            }),
            replication,
            entries: None,
        })
    }

    /// A replicated job's install's `replication` for appliance `name`:
    /// every appliance's data address (as `data` gives it), rack label (as
    /// `rack` does) and part of the layout, and this one's index among
    /// them (PROTOCOL.md §11), at epoch 0, or at the job's epoch for an
    /// appliance that came back at it (§11.7).
    fn replication_for(
        &self,
        name: &str,
        data: &impl Fn(&str) -> Option<DataAddr>,
        rack: &impl Fn(&str) -> String,
    ) -> Option<Replication> {
        let appliances = self
            .part_layouts()
            .into_iter()
            .map(|(n, layout)| {
                Some(ReplicaPeer {
                    name: n.to_string(),
                    data: data(n)?,
                    rack: rack(n),
                    layout,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let me = self.part_index(name)?;
        // An appliance that came back at the job's epoch is installed at
        // that epoch, joined (PROTOCOL.md §11.7); every other install is
        // at epoch 0.
        let back = self.is_returning(me);
        Some(Replication {
            epoch: if back { self.epoch.epoch } else { 0 },
            appliance: u16::try_from(me).ok()?,
            appliances,
            down: if back { self.epoch.down.clone() } else { Vec::new() },
            joined: if back {
                self.epoch.joined.clone()
            } else {
                Vec::new()
            },
            moved: if back {
                self.epoch.moved.clone()
            } else {
                Vec::new()
            },
            restored: if back { self.epoch.restored } else { 0 },
        })
    }

    /// Where part `name`'s lcores are among the job's (PROTOCOL.md §10.1),
    /// for a flat job with tables over several appliances; `None` for any
    /// other job (an appliance's lcores are then the job's).
    fn entries_of(&self, name: &str) -> Option<Entries> {
        let layouts = self.part_layouts();
        if layouts.len() < 2 || self.spec.tables().next().is_none() {
            return None;
        }
        let me = self.part_index(name)?;
        let count = |l: &Layout| u32::try_from(l.lcores.len()).unwrap_or(u32::MAX);
        Some(Entries {
            first: layouts[..me].iter().map(|(_, l)| count(l)).sum(),
            total: layouts.iter().map(|(_, l)| count(l)).sum(),
        })
    }

    /// What `part` of it (on its appliance `name`) costs on the appliance
    /// `info` describes (the last one control heard from), or by
    /// [`MemoryModel::default`]'s upper bounds before it heard from one; a
    /// hierarchical job's part with its rack slots; a replicated job's
    /// with the backup slots it keeps, the appliances' racks as `rack`
    /// gives them. O(keys + lcores).
    pub(crate) fn part_bytes(
        &self,
        name: &str,
        part: &Layout,
        info: Option<&DataplaneInfo>,
        rack: impl Fn(&str) -> String,
    ) -> u64 {
        let default = MemoryModel::default();
        let model = info.map_or(&default, |i| &i.memory_model);
        let backups: u64 = match (self.spec.replicas() > 1, self.part_index(name)) {
            (true, Some(me)) => {
                let layouts = self.part_layouts();
                let parts: Vec<&Layout> = layouts.iter().map(|(_, l)| l).collect();
                let racks: Vec<String> = layouts.iter().map(|(n, _)| rack(n)).collect();
                model.replica_cost(&self.spec, &parts, &racks, me).iter().sum()
            }
            _ => 0,
        };
        // A hierarchical job's home part is its part of the layout, and
        // its backups are of the other homes' parts (§11.11).
        if let Some(rack) = self.rack_layout_on(name) {
            return backups
                + model
                    .hierarchical_cost(&self.spec, rack, part, self.layout.lcores.len())
                    .total();
        }
        // A table's rows are spread over the job's lcores on every
        // appliance: each part is charged its lcores' share.
        let job_lcores = self.layout.lcores.len();
        backups
            + match info {
                Some(info) => model
                    .part_cost(&self.spec, part, self.spec.result_store(info.shm), job_lcores)
                    .total(),
                None => model
                    .part_cost(&self.spec, part, ResultStore::Slot, job_lcores)
                    .total(),
            }
    }

    /// The rack of a hierarchical job's rank; `None` for a flat job.
    pub(crate) fn rack_of_rank(&self, rank: u16) -> Option<Rack<'_>> {
        let JobShape::Hierarchical { racks } = &self.shape else {
            return None;
        };
        let index = self.spec.rack_ranks()?.iter().position(|r| r.contains(&rank))?;
        Some(Rack {
            index,
            appliance: &self.parts.get(index)?.appliance,
            layout: racks.get(index)?,
        })
    }

    /// "ranks 0..2 on a, ranks 2..4 on b": a hierarchical job's racks.
    pub(crate) fn rack_assignment(&self) -> String {
        let ranks = self.spec.rack_ranks().unwrap_or_default();
        self.parts
            .iter()
            .zip(ranks)
            .map(|(p, r)| format!("ranks {}..{} on {}", r.start, r.end, p.appliance))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
