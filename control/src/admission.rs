//! Admission, the pure part: which lcores a job may use, what every admitted
//! job already puts on each lcore, whether the job fits the dataplane's slot
//! memory, and where its chunks go.
//!
//! No I/O: the daemon fetches [`DataplaneInfo`] and the admitted jobs, calls
//! [`plan`], and installs the result.

use std::collections::BTreeSet;

use phub_proto::api::DataplaneInfo;
use phub_proto::layout::{job_bytes, layout, slot_bytes, Layout, Place};
use phub_proto::spec::JobSpec;

use crate::format::human_bytes;

/// Why a job cannot be admitted on this dataplane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The dataplane reports no lcores at all.
    #[error("the dataplane has no lcores to place the job's chunks on")]
    NoLcores,
    /// The dataplane reports more lcores than a chunk's place can name.
    #[error(
        "the dataplane reports {0} lcores; a chunk's place names its lcore by a u16, so at most {MAX_LCORES}"
    )]
    TooManyLcores(usize),
    /// The job's slot memory exceeds what the dataplane has free.
    #[error(
        "job needs {} of slot memory; the dataplane has {} free of {}",
        human_bytes(*need),
        human_bytes(*free),
        human_bytes(*budget)
    )]
    Memory {
        /// Bytes the job needs.
        need: u64,
        /// Bytes free on the dataplane.
        free: u64,
        /// The dataplane's whole budget.
        budget: u64,
    },
    /// Every job id is taken.
    #[error("all job ids 1..=65535 are in use; evict a job first")]
    NoIds,
}

/// Most lcores a dataplane may report: a chunk's [`Place`] names its lcore
/// by a `u16`.
pub const MAX_LCORES: usize = 1 << 16;

/// Where an admitted job goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The layout, with one entry per dataplane lcore.
    pub layout: Layout,
    /// Slot memory the job takes, in bytes.
    pub memory_bytes: u64,
    /// The lcores that hold at least one of its chunks, ascending.
    pub lcores: Vec<u16>,
}

/// The lcores (indices into `info.lcores`) a new job may use: all of them,
/// or, when the NIC's NUMA node is known and the lcores span more than one
/// node, those on the NIC's node (all of them if none is on it). Only the
/// first [`MAX_LCORES`] are candidates ([`plan`] refuses a dataplane with
/// more).
pub fn choose_lcores(info: &DataplaneInfo) -> Vec<u16> {
    let all: Vec<u16> = (0..=u16::MAX).take(info.lcores.len()).collect();
    let Some(nic) = info.nic_numa_node else {
        return all;
    };
    let nodes: BTreeSet<u32> = info.lcores.iter().filter_map(|l| l.numa_node).collect();
    if nodes.len() < 2 {
        return all;
    }
    let local: Vec<u16> = info
        .lcores
        .iter()
        .zip(0..=u16::MAX)
        .filter(|(l, _)| l.numa_node == Some(nic))
        .map(|(_, i)| i)
        .collect();
    if local.is_empty() {
        all
    } else {
        local
    }
}

/// Slot memory in bytes `layout` puts on each lcore (`layout.lcores.len()` entries).
pub fn bytes_per_lcore(spec: &JobSpec, layout: &Layout) -> Vec<u64> {
    layout
        .lcores
        .iter()
        .map(|slots| {
            slots
                .iter()
                .map(|s| slot_bytes(spec.dtype, &spec.optimizer, s.elems))
                .sum()
        })
        .collect()
}

/// Slot memory on each of `lcores` lcores from the given admitted jobs.
/// Entries of a layout beyond `lcores` (from a dataplane that had more) are
/// ignored.
pub fn loads<'a>(lcores: usize, jobs: impl IntoIterator<Item = (&'a JobSpec, &'a Layout)>) -> Vec<u64> {
    let mut load = vec![0u64; lcores];
    for (spec, layout) in jobs {
        for (l, b) in load.iter_mut().zip(bytes_per_lcore(spec, layout)) {
            *l += b;
        }
    }
    load
}

/// Places `spec` on the `chosen` lcores (indices below `load.len()`), balancing
/// bytes per lcore given the existing `load`. The layout has one entry per
/// lcore in `load` (empty for those not chosen) and its places name real
/// lcore indices.
///
/// # Panics
/// If `chosen` is empty or names an lcore outside `load`.
pub fn place(spec: &JobSpec, load: &[u64], chosen: &[u16]) -> Layout {
    let mut sub: Vec<u64> = chosen.iter().map(|&i| load[usize::from(i)]).collect();
    let l = layout(spec, &mut sub);
    let mut lcores = vec![Vec::new(); load.len()];
    for (slots, &real) in l.lcores.into_iter().zip(chosen) {
        lcores[usize::from(real)] = slots;
    }
    let keys = l
        .keys
        .into_iter()
        .map(|places| {
            places
                .into_iter()
                .map(|p| Place {
                    lcore: chosen[usize::from(p.lcore)],
                    slot: p.slot,
                })
                .collect()
        })
        .collect();
    Layout {
        chunk_elems: l.chunk_elems,
        keys,
        lcores,
    }
}

/// Decides whether and where `spec` goes on the dataplane `info` describes,
/// given the jobs already admitted.
pub fn plan<'a>(
    spec: &JobSpec,
    info: &DataplaneInfo,
    admitted: impl IntoIterator<Item = (&'a JobSpec, &'a Layout)>,
) -> Result<Plan, AdmitError> {
    if info.lcores.is_empty() {
        return Err(AdmitError::NoLcores);
    }
    if info.lcores.len() > MAX_LCORES {
        return Err(AdmitError::TooManyLcores(info.lcores.len()));
    }
    let need = job_bytes(spec);
    let free = info.memory_budget_bytes.saturating_sub(info.memory_used_bytes);
    if need > free {
        return Err(AdmitError::Memory {
            need,
            free,
            budget: info.memory_budget_bytes,
        });
    }
    let load = loads(info.lcores.len(), admitted);
    let chosen = choose_lcores(info);
    let layout = place(spec, &load, &chosen);
    // One entry per dataplane lcore, at most MAX_LCORES (checked above).
    let lcores = layout
        .lcores
        .iter()
        .zip(0..=u16::MAX)
        .filter(|(s, _)| !s.is_empty())
        .map(|(_, i)| i)
        .collect();
    Ok(Plan {
        layout,
        memory_bytes: need,
        lcores,
    })
}

/// The smallest id in 1..=65535 for which `taken` is false.
pub fn free_id(taken: impl Fn(u16) -> bool) -> Result<u16, AdmitError> {
    (1..=u16::MAX).find(|&id| !taken(id)).ok_or(AdmitError::NoIds)
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
mod tests {
    use super::*;
    use phub_proto::api::{DataAddr, LcoreInfo};

    fn info(nodes: &[Option<u32>], nic: Option<u32>, budget: u64, used: u64) -> DataplaneInfo {
        DataplaneInfo {
            backend: "udp".into(),
            data: DataAddr {
                host: "127.0.0.1".into(),
                base_port: 9000,
            },
            lcores: nodes
                .iter()
                .enumerate()
                .map(|(i, &n)| LcoreInfo {
                    lcore: i as u16,
                    cpu: Some(i),
                    numa_node: n,
                })
                .collect(),
            nic_numa_node: nic,
            memory_budget_bytes: budget,
            memory_used_bytes: used,
            slot_memory: "Rust heap".into(),
            kernels: "scalar".into(),
            shm: false,
            version: "test".into(),
        }
    }

    fn spec(keys: &[u64]) -> JobSpec {
        let mut text =
            String::from("name = \"t\"\nworkers = 2\nchunk_bytes = 1024\n[optimizer]\nkind = \"sum\"\n");
        for k in keys {
            text.push_str(&format!("[[keys]]\nelements = {k}\n"));
        }
        JobSpec::from_toml(&text).unwrap()
    }

    #[test]
    fn numa_choice() {
        let two = [Some(0), Some(0), Some(1), Some(1)];
        assert_eq!(choose_lcores(&info(&two, Some(1), 1, 0)), vec![2, 3]);
        assert_eq!(choose_lcores(&info(&two, Some(0), 1, 0)), vec![0, 1]);
        assert_eq!(choose_lcores(&info(&two, None, 1, 0)), vec![0, 1, 2, 3]);
        assert_eq!(choose_lcores(&info(&two, Some(7), 1, 0)), vec![0, 1, 2, 3]);
        let one = [Some(0), Some(0)];
        assert_eq!(choose_lcores(&info(&one, Some(1), 1, 0)), vec![0, 1]);
        let unknown = [None, None];
        assert_eq!(choose_lcores(&info(&unknown, Some(0), 1, 0)), vec![0, 1]);
    }

    #[test]
    fn capacity_and_lcores() {
        let s = spec(&[1000]);
        let need = job_bytes(&s);
        let e = plan(&s, &info(&[None], None, need - 1, 0), []).unwrap_err();
        assert_eq!(
            e,
            AdmitError::Memory {
                need,
                free: need - 1,
                budget: need - 1
            }
        );
        let e = plan(&s, &info(&[None], None, 64 << 20, 61 << 20), []);
        assert!(e.is_ok());
        let e = plan(&spec(&[1 << 30]), &info(&[None], None, 64 << 20, 61 << 20), []).unwrap_err();
        assert_eq!(
            e.to_string(),
            "job needs 8.0 GiB of slot memory; the dataplane has 3.0 MiB free of 64.0 MiB"
        );
        assert_eq!(
            plan(&s, &info(&[], None, 1 << 30, 0), []).unwrap_err(),
            AdmitError::NoLcores
        );
        let many = vec![None; MAX_LCORES + 1];
        assert_eq!(
            plan(&s, &info(&many, None, 1 << 30, 0), []).unwrap_err(),
            AdmitError::TooManyLcores(MAX_LCORES + 1)
        );
    }

    #[test]
    fn placement_balances_over_every_job_and_remaps_lcores() {
        let dp = info(&[Some(0), Some(0), Some(1), Some(1)], Some(1), 1 << 30, 0);
        let a = spec(&[256 * 10]);
        let pa = plan(&a, &dp, []).unwrap();
        assert_eq!(pa.lcores, vec![2, 3]);
        assert_eq!(pa.layout.lcores.len(), 4);
        assert!(pa.layout.lcores[0].is_empty() && pa.layout.lcores[1].is_empty());
        assert_eq!(bytes_per_lcore(&a, &pa.layout), vec![0, 0, 5 * 2048, 5 * 2048]);
        for places in &pa.layout.keys {
            for (c, p) in places.iter().enumerate() {
                let sc = pa.layout.lcores[usize::from(p.lcore)][p.slot as usize];
                assert_eq!(sc.chunk as usize, c);
            }
        }
        // One chunk skews lcore 2; the next job's three chunks even it out.
        let b = spec(&[256]);
        let pb = plan(&b, &dp, [(&a, &pa.layout)]).unwrap();
        assert_eq!(pb.lcores, vec![2]);
        let c = spec(&[256 * 3]);
        let pc = plan(&c, &dp, [(&a, &pa.layout), (&b, &pb.layout)]).unwrap();
        let total = loads(4, [(&a, &pa.layout), (&b, &pb.layout), (&c, &pc.layout)]);
        assert_eq!(total, vec![0, 0, 7 * 2048, 7 * 2048]);
    }

    #[test]
    fn ids() {
        assert_eq!(free_id(|_| false), Ok(1));
        assert_eq!(free_id(|id| id < 5 && id != 3), Ok(3));
        assert_eq!(free_id(|_| true), Err(AdmitError::NoIds));
    }
}
