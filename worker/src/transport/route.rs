//! Where a replicated job's chunks go in the epoch this worker holds
//! (PROTOCOL.md §11.6, "Where a chunk is served in an epoch").
//!
//! Layer: pure routing, no I/O. A replicated job's chunk is served by the
//! first live appliance of its part's replica set ([`ReplicaLayout::serve`]):
//! at its home, at the slot the layout gives it, while the home is up;
//! otherwise by the backup that adopted the part, at an extended slot number
//! on one of that backup's lcores. The encoders write every chunk's header
//! for its home at epoch 0 ([`crate::encode`]); the transport re-addresses
//! each chunk here when it sends it, and again for every chunk still waiting
//! when the epoch changes ([`Routing::route`]): its destination, its lcore,
//! the header's slot and the header's epoch.
//!
//! Jobs without replication have no [`Routing`]: their chunks go where the
//! layout places them, with epoch 0, as before.

use std::net::SocketAddr;

use phub_proto::failover::{EpochView, ReplicaLayout};
use phub_proto::layout::ChunkRange;
use phub_proto::replica_rows::entry_backup;
use phub_proto::wire::Header;

use super::request::ChunkMsg;

/// Where a chunk is served in an epoch, resolved to this worker's view of
/// the job's lcores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    /// The serving lcore's address.
    pub(crate) to: SocketAddr,
    /// The serving lcore, numbered as the join's layout numbers lcores
    /// (appliance by appliance).
    pub(crate) lcore: u16,
    /// The slot on it (an extended slot number on an adopting backup).
    pub(crate) slot: u32,
}

/// A replicated job's routing: the replica layout, the epoch held, and
/// this worker's lcore addresses.
#[derive(Debug, Clone)]
pub(crate) struct Routing {
    layout: ReplicaLayout<String>,
    epoch: EpochView,
    /// Per appliance, the layout's number of its lcore 0.
    base: Vec<usize>,
    /// Per lcore of the layout, its address.
    lcores: Vec<SocketAddr>,
    /// Per key, the sequence number of its chunk 0.
    key_first: Vec<u64>,
    /// A hierarchical job's (PROTOCOL.md §11.11): this worker's rack's
    /// appliance and its rack layout's runs, where every chunk goes at
    /// epoch 0.
    rack: Option<(usize, Vec<ChunkRange>)>,
}

impl Routing {
    /// The routing of a job whose lcores hold `runs` (the join's layout,
    /// appliance by appliance), `per_appliance[a]` of them on appliance
    /// `a`, at `lcores` (one address per run), whose key `k`'s chunk 0 is
    /// chunk `key_first[k]` of the job's sequence; with `replicas` copies
    /// over appliances in `racks`, in `epoch`. Says what disagrees when the
    /// join's parts do not fit together.
    pub(crate) fn new(
        runs: Vec<ChunkRange>,
        per_appliance: &[usize],
        racks: Vec<String>,
        replicas: usize,
        epoch: EpochView,
        lcores: Vec<SocketAddr>,
        key_first: Vec<u64>,
    ) -> Result<Routing, String> {
        if lcores.len() != runs.len() {
            return Err(format!(
                "{} lcore addresses for {} runs",
                lcores.len(),
                runs.len()
            ));
        }
        if u16::try_from(lcores.len()).is_err() {
            return Err(format!(
                "{} lcores; at most {} are addressed",
                lcores.len(),
                u16::MAX
            ));
        }
        let layout = ReplicaLayout::new(runs, per_appliance, racks, replicas)?;
        if let Some(a) = epoch
            .down
            .iter()
            .find(|&&a| usize::from(a) >= per_appliance.len())
        {
            return Err(format!(
                "epoch {}: appliance {a} is down, but the job has {} appliances",
                epoch.epoch,
                per_appliance.len()
            ));
        }
        let mut base = Vec::with_capacity(per_appliance.len());
        let mut k = 0;
        for &l in per_appliance {
            base.push(k);
            k += l;
        }
        Ok(Routing {
            layout,
            epoch,
            base,
            lcores,
            key_first,
            rack: None,
        })
    }

    /// A hierarchical job's routing (PROTOCOL.md §11.11): at epoch 0 every
    /// chunk goes to appliance `appliance` (this worker's rack's), to the
    /// lcore and slot its rack layout `runs` give it; from the first
    /// epoch change on, as a flat job's. Says what disagrees.
    pub(crate) fn set_rack(&mut self, appliance: usize, runs: Vec<ChunkRange>) -> Result<(), String> {
        let Some(&first) = self.base.get(appliance) else {
            return Err(format!(
                "rack appliance {appliance} of {} appliances",
                self.base.len()
            ));
        };
        let end = self.base.get(appliance + 1).copied().unwrap_or(self.lcores.len());
        if runs.len() != end - first {
            return Err(format!(
                "a rack layout of {} lcores for appliance {appliance}, which has {}",
                runs.len(),
                end - first
            ));
        }
        self.rack = Some((appliance, runs));
        Ok(())
    }

    /// The rack routing, while it holds (epoch 0).
    fn rack(&self) -> Option<&(usize, Vec<ChunkRange>)> {
        self.rack.as_ref().filter(|_| self.epoch.epoch == 0)
    }

    /// Whether chunks go to the rack appliance's rack slots now (a
    /// hierarchical job at epoch 0, §11.11).
    pub(crate) fn at_rack(&self) -> bool {
        self.rack().is_some()
    }

    /// The lcores of the job's layout, every appliance's.
    pub(crate) fn lcore_count(&self) -> usize {
        self.lcores.len()
    }

    /// The epoch held.
    pub(crate) fn epoch(&self) -> &EpochView {
        &self.epoch
    }

    /// Holds `epoch` from now on.
    /// An index the epoch newly names moved (a drain, PROTOCOL.md §11.8)
    /// is sent to at its new appliance's lcores from now on; a moved
    /// address that is not IPv4 (control never writes one) leaves the
    /// index where it was, logged.
    pub(crate) fn set_epoch(&mut self, epoch: EpochView) {
        for m in epoch.moves_since(&self.epoch) {
            let a = usize::from(m.appliance);
            let Some(&first) = self.base.get(a) else {
                continue;
            };
            let end = self.base.get(a + 1).copied().unwrap_or(self.lcores.len());
            for (k, to) in self.lcores[first..end].iter_mut().enumerate() {
                match m.lcore_addr(k) {
                    Some(at) => *to = SocketAddr::V4(at),
                    None => log::error!(
                        "epoch {}: appliance {a} moved to {:?} at {}:{}, not an IPv4 address and port; \
                         its lcore {k} stays at {to}",
                        epoch.epoch,
                        m.name,
                        m.data.host,
                        m.data.base_port
                    ),
                }
            }
        }
        self.epoch = epoch;
    }

    /// Where chunk `chunk` of `key` is served in the epoch held; `None`
    /// when no live appliance holds it (control fails such a job) or the
    /// chunk is not the job's.
    pub(crate) fn place(&self, key: u32, chunk: u32) -> Option<Route> {
        let first = *self.key_first.get(usize::try_from(key).ok()?)?;
        if let Some((a, runs)) = self.rack() {
            let (l, slot) = phub_proto::replica::place(runs, first + u64::from(chunk))?;
            let global = self.base.get(*a)? + l;
            return Some(Route {
                to: *self.lcores.get(global)?,
                lcore: u16::try_from(global).ok()?,
                slot: u32::try_from(slot).ok()?,
            });
        }
        let s = self.layout.serve(first + u64::from(chunk), &self.epoch)?;
        let global = self.base.get(s.appliance)? + s.lcore;
        Some(Route {
            to: *self.lcores.get(global)?,
            // `new` checked that every lcore number fits.
            lcore: u16::try_from(global).ok()?,
            slot: u32::try_from(s.slot).ok()?,
        })
    }

    /// Where a table's entry `entry` (the layout's lcore of that number,
    /// PROTOCOL.md §10.1) is served in the epoch held (§11.9): at its own
    /// lcore while its appliance serves its part, else at the lcore of the
    /// part's primary keeping the entry's backup tables. `None` when no
    /// live appliance holds it or the entry is not the job's.
    pub(crate) fn entry_to(&self, entry: u32) -> Option<SocketAddr> {
        let e = usize::try_from(entry).ok()?;
        if e >= self.lcores.len() {
            return None;
        }
        let p = self.base.iter().rposition(|&b| b <= e)?;
        let q = self.layout.primary(p, &self.epoch)?;
        if q == p {
            return self.lcores.get(e).copied();
        }
        let count = |a: usize| self.base.get(a + 1).copied().unwrap_or(self.lcores.len()) - self.base[a];
        let part = ChunkRange {
            first: self.base[p] as u64,
            count: count(p) as u64,
        };
        let l = entry_backup(part, count(q), e as u64)?;
        self.lcores.get(self.base[q] + l).copied()
    }

    /// Whether `slot` on the layout's lcore `lcore` is past that lcore's
    /// own slots: a backup slot, served once its part is adopted.
    pub(crate) fn adopted_slot(&self, lcore: u16, slot: u32) -> bool {
        if self.rack().is_some() {
            // Rack slots: no part is adopted while the job is hierarchical.
            return false;
        }
        let l = usize::from(lcore);
        let Some(a) = self.base.iter().rposition(|&b| b <= l) else {
            return false;
        };
        self.layout
            .runs_of(a)
            .get(l - self.base[a])
            .is_some_and(|run| u64::from(slot) >= run.count)
    }

    /// Re-addresses `msg`, a chunk of `key` whose header is `header`, to
    /// where the epoch held serves it: its destination, lcore and slot,
    /// and the header's slot and epoch. Returns whether it moved (its
    /// lcore or slot changed); a chunk no live appliance holds is left
    /// where it was, with the epoch updated.
    pub(crate) fn route(&self, key: u32, msg: &mut ChunkMsg, header: &mut [u8]) -> bool {
        let mut h = Header::new_unchecked(header);
        h.set_epoch(self.epoch.epoch);
        let Some(r) = self.place(key, msg.chunk) else {
            return false;
        };
        let moved = r.lcore != msg.lcore || r.slot != msg.slot;
        msg.to = r.to;
        msg.lcore = r.lcore;
        msg.slot = r.slot;
        h.set_slot(r.slot);
        moved
    }
}
