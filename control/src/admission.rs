//! Admission, the pure part: which lcores a job may use, what every admitted
//! job already puts on each lcore, whether the job fits the dataplane's slot
//! memory, and where its chunks go.
//!
//! No I/O: the daemon fetches [`DataplaneInfo`] and the admitted jobs, calls
//! [`plan`], and installs the result.

use std::collections::BTreeSet;

use phub_proto::api::DataplaneInfo;
use phub_proto::layout::{layout, Layout};
use phub_proto::memory::{data_bytes, JobCost};
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
    /// What the job costs exceeds what the dataplane has free.
    #[error(
        "job needs {} of memory ({} of chunk data; {} of slot records, line padding, blocks and \
         per-rank and per-key bookkeeping{}); the dataplane has {} free of {}",
        human_bytes(*need),
        human_bytes(*data),
        human_bytes(need.saturating_sub(*data + *shm)),
        if *shm > 0 { format!("; {} of shared-memory regions", human_bytes(*shm)) } else { String::new() },
        human_bytes(*free),
        human_bytes(*budget)
    )]
    Memory {
        /// Bytes the job costs in all.
        need: u64,
        /// Of those, the chunks' values and state without padding (what
        /// the job's keys hold).
        data: u64,
        /// Of those, its shared-memory region files.
        shm: u64,
        /// Bytes free on the dataplane.
        free: u64,
        /// The dataplane's whole budget.
        budget: u64,
    },
    /// Every job id is taken.
    #[error("all job ids 1..=65535 are in use; evict a job first")]
    NoIds,
}

/// Most lcores a dataplane may report: a chunk's place names its lcore by
/// a `u16`.
pub const MAX_LCORES: usize = phub_proto::layout::MAX_LCORES;

/// Where an admitted job goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The layout, with one entry per dataplane lcore.
    pub layout: Layout,
    /// What the job costs, byte by byte.
    pub cost: JobCost,
    /// Memory the job takes, in bytes: `cost.total()`.
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

/// What `spec` placed by `layout` costs on the dataplane `info` describes
/// (its memory model; shared-memory regions when it gives jobs them).
pub fn cost(spec: &JobSpec, layout: &Layout, info: &DataplaneInfo) -> JobCost {
    info.memory_model.job_cost(spec, layout, info.shm)
}

/// Heap bytes `layout` puts on each lcore (`layout.lcores.len()` entries).
pub fn bytes_per_lcore(spec: &JobSpec, layout: &Layout, info: &DataplaneInfo) -> Vec<u64> {
    cost(spec, layout, info).lcores
}

/// Heap bytes on each of the dataplane's lcores from the given admitted
/// jobs. Entries of a layout beyond the dataplane's lcores (from a
/// dataplane that had more) are ignored.
pub fn loads<'a>(
    info: &DataplaneInfo,
    jobs: impl IntoIterator<Item = (&'a JobSpec, &'a Layout)>,
) -> Vec<u64> {
    let mut load = vec![0u64; info.lcores.len()];
    for (spec, layout) in jobs {
        for (l, b) in load.iter_mut().zip(bytes_per_lcore(spec, layout, info)) {
            *l += b;
        }
    }
    load
}

/// Places `spec` on the `chosen` lcores (ascending indices below
/// `load.len()`), balancing bytes per lcore given the existing `load`, a
/// chunk of `elems` elements costing `chunk_cost(elems)`. The layout has one
/// entry per lcore in `load` (an empty run for those not chosen).
///
/// # Panics
/// If `chosen` is empty or names an lcore outside `load`.
pub fn place(spec: &JobSpec, load: &[u64], chosen: &[u16], chunk_cost: impl Fn(u32) -> u64) -> Layout {
    let mut sub: Vec<u64> = chosen.iter().map(|&i| load[usize::from(i)]).collect();
    let l = layout(spec, &mut sub, chunk_cost);
    // The chosen lcores' runs in their order; an lcore not chosen gets an
    // empty run where the next chosen one starts (or at the end).
    let mut lcores = Vec::with_capacity(load.len());
    let mut runs = chosen.iter().zip(&l.lcores).peekable();
    let mut at = 0;
    for i in 0..load.len() {
        match runs.peek() {
            Some(&(&c, r)) if usize::from(c) == i => {
                lcores.push(*r);
                at = r.first + r.count;
                runs.next();
            }
            _ => lcores.push(phub_proto::layout::ChunkRange { first: at, count: 0 }),
        }
    }
    Layout {
        chunk_elems: l.chunk_elems,
        lcores,
    }
}

/// Decides whether and where `spec` goes on the dataplane `info` describes,
/// given the jobs already admitted: placed by [`place`], then charged every
/// byte [`cost`] counts against what the dataplane has free.
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
    let load = loads(info, admitted);
    let chosen = choose_lcores(info);
    let layout = place(spec, &load, &chosen, info.memory_model.chunk_cost(spec, info.shm));
    let cost = cost(spec, &layout, info);
    let need = cost.total();
    let free = info.memory_budget_bytes.saturating_sub(info.memory_used_bytes);
    if need > free {
        return Err(AdmitError::Memory {
            need,
            data: data_bytes(spec, info.shm).min(need),
            shm: cost.shm,
            free,
            budget: info.memory_budget_bytes,
        });
    }
    let lcores = layout.used_lcores();
    Ok(Plan {
        layout,
        cost,
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
    use phub_proto::layout::Placement;
    use phub_proto::memory::MemoryModel;

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
            memory_model: MemoryModel::default(),
            slot_memory: "Rust heap".into(),
            kernels: "scalar".into(),
            shm: false,
            version: "test".into(),
        }
    }

    fn spec(keys: &[u64]) -> JobSpec {
        spec_with(keys, 1024)
    }

    fn spec_with(keys: &[u64], chunk_bytes: u32) -> JobSpec {
        let mut text =
            format!("name = \"t\"\nworkers = 2\nchunk_bytes = {chunk_bytes}\n[optimizer]\nkind = \"sum\"\n");
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
        let need = plan(&s, &info(&[None], None, 1 << 30, 0), [])
            .unwrap()
            .memory_bytes;
        let e = plan(&s, &info(&[None], None, need - 1, 0), []).unwrap_err();
        assert!(
            matches!(e, AdmitError::Memory { need: n, free, budget, .. } if n == need && free == need - 1 && budget == need - 1),
            "{e:?}"
        );
        assert!(plan(&s, &info(&[None], None, need, 0), []).is_ok());
        assert!(plan(&s, &info(&[None], None, 64 << 20, 61 << 20), []).is_ok());
        let e = plan(&spec(&[1 << 30]), &info(&[None], None, 64 << 20, 61 << 20), []).unwrap_err();
        let m = e.to_string();
        assert!(
            m.starts_with("job needs 9.0 GiB of memory (8.0 GiB of chunk data; 1.0 GiB of slot records"),
            "{m}"
        );
        assert!(m.ends_with("the dataplane has 3.0 MiB free of 64.0 MiB"), "{m}");
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

    /// A million one-element keys in 64-byte chunks: 8 MB of data, which is
    /// all admission used to charge, but the dataplane holds a padded
    /// accumulator and result, a slot record and a key entry per chunk.
    #[test]
    fn metadata_alone_can_exceed_the_budget_and_the_refusal_says_so() {
        let s = spec_with(&vec![1; 1_000_000], 64);
        let dp = info(&[None, None], None, 64 << 20, 0);
        let e = plan(&s, &dp, []).unwrap_err();
        let AdmitError::Memory { need, data, .. } = e else {
            panic!("{e:?}")
        };
        assert_eq!(data, 8_000_000, "4 bytes of accumulator and 4 of result a chunk");
        assert!(data < 64 << 20 && need > 64 << 20, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("7.6 MiB of chunk data") && m.contains("of slot records, line padding"),
            "{m}"
        );
        let p = plan(&s, &info(&[None, None], None, 1 << 30, 0), []).unwrap();
        assert_eq!(p.memory_bytes, need);
        let model = MemoryModel::default();
        let per_chunk = 128 + u64::from(model.slot_bytes) + u64::from(model.key_bytes);
        assert!(need >= 1_000_000 * per_chunk, "{need}");
        assert!(need <= 1_000_000 * per_chunk + (1 << 20), "{need}");
    }

    /// One key of 4,000,000 f32 in 64-byte chunks: 250,000 chunks of 16,
    /// each with a 64-byte accumulator, a 64-byte result and a slot record.
    #[test]
    fn one_large_key_in_small_chunks_is_charged_per_chunk() {
        let s = spec_with(&[4_000_000], 64);
        let p = plan(&s, &info(&[None], None, 1 << 30, 0), []).unwrap();
        let model = MemoryModel::default();
        let per_chunk = 128 + u64::from(model.slot_bytes);
        assert!(p.memory_bytes >= 250_000 * per_chunk, "{}", p.memory_bytes);
        assert!(
            p.memory_bytes <= 250_000 * per_chunk + (1 << 20),
            "{}",
            p.memory_bytes
        );
        assert!(p.memory_bytes > 3 * 32_000_000, "more than three times its data");
    }

    #[test]
    fn shared_memory_regions_are_charged_when_the_dataplane_gives_them() {
        let s = spec(&[256 * 10]);
        let mut dp = info(&[None, None], None, 1 << 30, 0);
        let without = plan(&s, &dp, []).unwrap();
        assert_eq!(without.cost.shm, 0);
        dp.shm = true;
        let with = plan(&s, &dp, []).unwrap();
        // Two ranks and a result region per lcore, five 1 KiB chunks each.
        assert_eq!(with.cost.shm, 2 * 3 * 8192);
        assert_eq!(with.memory_bytes, with.cost.heap() + with.cost.shm);
        dp.memory_budget_bytes = with.memory_bytes - 1;
        let e = plan(&s, &dp, []).unwrap_err().to_string();
        assert!(e.contains("48.0 KiB of shared-memory regions"), "{e}");
    }

    #[test]
    fn placement_balances_over_every_job_and_remaps_lcores() {
        let dp = info(&[Some(0), Some(0), Some(1), Some(1)], Some(1), 1 << 30, 0);
        let a = spec(&[256 * 10]);
        let pa = plan(&a, &dp, []).unwrap();
        assert_eq!(pa.lcores, vec![2, 3]);
        assert_eq!(pa.layout.lcores.len(), 4);
        assert!(pa.layout.lcores[0].is_empty() && pa.layout.lcores[1].is_empty());
        assert_eq!(pa.layout.lcores[2].count, 5);
        assert_eq!(pa.layout.lcores[3].count, 5);
        let placed = Placement::new(&a, pa.layout.clone()).unwrap();
        for c in 0..10 {
            let p = placed.place(0, c).unwrap();
            assert_eq!(placed.slot_chunk(usize::from(p.lcore), p.slot).unwrap().chunk, c);
        }
        // One chunk (and its block) skews lcore 2; the next job's three
        // chunks all go to lcore 3, narrowing the gap.
        let b = spec(&[256]);
        let pb = plan(&b, &dp, [(&a, &pa.layout)]).unwrap();
        assert_eq!(pb.lcores, vec![2]);
        let before = loads(&dp, [(&a, &pa.layout), (&b, &pb.layout)]);
        assert!(before[2] > before[3]);
        let c = spec(&[256 * 3]);
        let pc = plan(&c, &dp, [(&a, &pa.layout), (&b, &pb.layout)]).unwrap();
        assert_eq!((pc.layout.lcores[2].count, pc.layout.lcores[3].count), (0, 3));
        let total = loads(&dp, [(&a, &pa.layout), (&b, &pb.layout), (&c, &pc.layout)]);
        assert_eq!(total[0], total[1]);
        assert!(
            total[2].abs_diff(total[3]) < before[2] - before[3],
            "{before:?} -> {total:?}"
        );
        // Even loads: a job's chunks split evenly.
        let d = spec(&[256 * 6]);
        let even = info(&[None, None], None, 1 << 30, 0);
        let pd = plan(&d, &even, []).unwrap();
        assert_eq!((pd.layout.lcores[0].count, pd.layout.lcores[1].count), (3, 3));
    }

    #[test]
    fn ids() {
        assert_eq!(free_id(|_| false), Ok(1));
        assert_eq!(free_id(|id| id < 5 && id != 3), Ok(3));
        assert_eq!(free_id(|_| true), Err(AdmitError::NoIds));
    }
}
