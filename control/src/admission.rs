//! Admission, the pure part: which appliances and lcores a job may use, what
//! every admitted job already puts on each lcore, whether the job fits each
//! appliance's memory, and where its chunks go.
//!
//! No I/O: the daemon fetches each appliance's [`DataplaneInfo`] and the
//! admitted jobs, calls [`plan_over`] (or [`plan`] for one appliance), and
//! installs the result, each appliance its part.

use std::collections::BTreeSet;
use std::ops::Range;

use phub_proto::api::DataplaneInfo;
use phub_proto::layout::{layout_part, Chunks, Layout};
use phub_proto::memory::{data_bytes, JobCost, ResultStore};
use phub_proto::spec::JobSpec;

use crate::format::human_bytes;

/// Why a job cannot be admitted on this dataplane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The dataplane reports no lcores at all.
    #[error("the dataplane{} has no lcores to place the job's chunks on", on(.0))]
    NoLcores(String),
    /// The appliances report more lcores than a chunk's place can name.
    #[error(
        "the dataplane{} reports {} lcores; a chunk's place names its lcore by a u16, so at most {MAX_LCORES} \
         over all the job's appliances", on(.1), .0
    )]
    TooManyLcores(usize, String),
    /// What the job costs exceeds what the dataplane has free.
    #[error(
        "job needs {} of memory ({} of chunk data; {} of slot records, line padding, blocks and \
         per-rank and per-key bookkeeping{}){}; the dataplane has {} free of {}",
        human_bytes(*need),
        human_bytes(*data),
        human_bytes(need.saturating_sub(*data + *shm)),
        if *shm > 0 { format!("; {} of shared-memory regions", human_bytes(*shm)) } else { String::new() },
        on(appliance),
        human_bytes(*free),
        human_bytes(*budget)
    )]
    Memory {
        /// The appliance short of memory (empty when there is one and it
        /// has no name).
        appliance: String,
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
    /// The job asks for more appliances than answer.
    #[error(
        "the job asks for {asked} appliances; {} answer{}",
        answer.len(),
        if answer.is_empty() { String::new() } else { format!(": {}", answer.join(", ")) }
    )]
    Appliances {
        /// How many it asks for.
        asked: usize,
        /// The appliances that answer.
        answer: Vec<String>,
    },
}

/// " on appliance \"a\"", or nothing for an unnamed one.
fn on(appliance: &str) -> String {
    if appliance.is_empty() {
        String::new()
    } else {
        format!(" on appliance {appliance:?}")
    }
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
    part_cost(spec, layout, info, layout.lcores.len())
}

/// What the part `part` of `spec` costs on the dataplane `info` describes,
/// the job's tables' rows spread over its `job_lcores` lcores on every
/// appliance (PROTOCOL.md §10.1): each lcore holds its share of them, as
/// the engine counts them.
pub fn part_cost(spec: &JobSpec, part: &Layout, info: &DataplaneInfo, job_lcores: usize) -> JobCost {
    info.memory_model
        .part_cost(spec, part, spec.result_store(info.shm), job_lcores)
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
    place_part(spec, 0..Chunks::new(spec).total(), load, chosen, chunk_cost)
}

/// As [`place`], for the chunks `seqs` of the job's sequence only (one
/// appliance's part of a sharded job).
///
/// # Panics
/// As [`place`], or if `seqs` is not within the job's chunks.
pub fn place_part(
    spec: &JobSpec,
    seqs: Range<u64>,
    load: &[u64],
    chosen: &[u16],
    chunk_cost: impl Fn(u32) -> u64,
) -> Layout {
    let mut sub: Vec<u64> = chosen.iter().map(|&i| load[usize::from(i)]).collect();
    let start = seqs.start;
    let l = layout_part(spec, seqs, &mut sub, chunk_cost);
    // The chosen lcores' runs in their order; an lcore not chosen gets an
    // empty run where the next chosen one starts (or at the end).
    let mut lcores = Vec::with_capacity(load.len());
    let mut runs = chosen.iter().zip(&l.lcores).peekable();
    let mut at = start;
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
    let target = Target {
        name: "",
        info,
        load: loads(info, admitted),
    };
    let mut p = plan_over(spec, &[target])?;
    Ok(p.parts.remove(0))
}

/// One appliance a job may go on: its name, its description and the bytes
/// the admitted jobs' parts put on each of its lcores ([`loads`]).
#[derive(Debug, Clone)]
pub struct Target<'a> {
    /// The appliance's name.
    pub name: &'a str,
    /// What it reported.
    pub info: &'a DataplaneInfo,
    /// Bytes on each of its lcores.
    pub load: Vec<u64>,
}

/// Where a job over several appliances goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// The layout over the lcores of every target, in order.
    pub layout: Layout,
    /// Per target, in order: its part ([`Plan::layout`] is the part's).
    pub parts: Vec<Plan>,
}

/// Decides whether and where `spec` goes over the `targets` (at least one):
/// its chunks are placed over the union of their lcores (each target's
/// NUMA choice, [`choose_lcores`]), balancing bytes given the existing
/// loads as [`place`] does, so each chunk has one home; then each target
/// is charged its part against what it has free. Chunk costs are the first
/// target's memory model's.
///
/// # Panics
/// If `targets` is empty.
pub fn plan_over(spec: &JobSpec, targets: &[Target<'_>]) -> Result<ShardPlan, AdmitError> {
    let racks = vec![""; targets.len()];
    plan_replicated(spec, targets, &racks)
}

/// [`plan_over`] for a job that may be replicated (`[placement] replicas`
/// above 1, PROTOCOL.md §11), `racks[i]` being target i's rack label: each
/// target is charged, beside its part, the backup slots it keeps of the
/// other targets' parts, as primary slots of the job's optimizer
/// ([`phub_proto::memory::MemoryModel::replica_cost`]).
///
/// # Panics
/// If `targets` is empty or `racks` is not as long.
pub fn plan_replicated(
    spec: &JobSpec,
    targets: &[Target<'_>],
    racks: &[&str],
) -> Result<ShardPlan, AdmitError> {
    assert_eq!(racks.len(), targets.len(), "a rack label per target");
    let layout = place_over(spec, targets)?;
    let counts: Vec<usize> = targets.iter().map(|t| t.info.lcores.len()).collect();
    let chunks = Chunks::new(spec);
    let elems = chunks.weigh(u64::from);
    let split = layout.split(&counts);
    let all: Vec<&Layout> = split.iter().collect();
    let parts = targets
        .iter()
        .zip(&split)
        .enumerate()
        .map(|(i, (t, part))| {
            let backups = backups(spec, t, &all, racks, i);
            charge(spec, t, part.clone(), layout.lcores.len(), &elems, &backups)
        })
        .collect::<Result<_, _>>()?;
    Ok(ShardPlan { layout, parts })
}

/// What target `i` of a replicated `spec` keeps of the other targets'
/// parts (`parts`, their rack labels `racks`), per lcore: the backup slots
/// [`phub_proto::memory::MemoryModel::replica_cost`] charges; nothing
/// without replicas.
fn backups(spec: &JobSpec, target: &Target<'_>, parts: &[&Layout], racks: &[&str], i: usize) -> Vec<u64> {
    if spec.replicas() > 1 {
        target.info.memory_model.replica_cost(spec, parts, racks, i)
    } else {
        Vec::new()
    }
}

/// The layout of [`plan_over`], before anything is charged.
fn place_over(spec: &JobSpec, targets: &[Target<'_>]) -> Result<Layout, AdmitError> {
    assert!(!targets.is_empty(), "a job goes on at least one appliance");
    let mut load = Vec::new();
    let mut chosen = Vec::new();
    for t in targets {
        let n = t.info.lcores.len();
        if n == 0 {
            return Err(AdmitError::NoLcores(t.name.to_string()));
        }
        if load.len() + n > MAX_LCORES {
            return Err(AdmitError::TooManyLcores(load.len() + n, t.name.to_string()));
        }
        let offset = load.len();
        // Cast: offset + i < MAX_LCORES (2^16), checked above.
        #[allow(clippy::cast_possible_truncation)]
        chosen.extend(
            choose_lcores(t.info)
                .iter()
                .map(|&i| (offset + usize::from(i)) as u16),
        );
        load.extend(t.load.iter().copied().chain(std::iter::repeat(0)).take(n));
    }
    let first = targets[0].info;
    Ok(place(
        spec,
        &load,
        &chosen,
        first.memory_model.chunk_cost(spec, spec.result_store(first.shm)),
    ))
}

/// Where a hierarchical job goes (PROTOCOL.md §9.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HierPlan {
    /// The home layout over the targets' lcores, and per target its part
    /// of it ([`Plan::layout`]) with what the target is charged for its
    /// home and rack slots together ([`Plan::cost`]).
    pub homes: ShardPlan,
    /// Per target, its rack layout: the whole job over its lcores.
    pub racks: Vec<Layout>,
}

/// Decides whether and where a hierarchical `spec` goes over the `targets`
/// (its racks' appliances, in rack order): homes placed over the union of
/// their lcores as [`plan_over`] places a sharded job, and on each target
/// a rack slot for every chunk, placed over its lcores balanced with its
/// load and its home part; each target is charged both
/// ([`phub_proto::memory::MemoryModel::hierarchical_cost`]).
///
/// # Panics
/// If `targets` is empty.
pub fn plan_hierarchical(spec: &JobSpec, targets: &[Target<'_>]) -> Result<HierPlan, AdmitError> {
    let home = place_over(spec, targets)?;
    let counts: Vec<usize> = targets.iter().map(|t| t.info.lcores.len()).collect();
    let peers = home.lcores.len();
    let relay = JobSpec {
        optimizer: phub_proto::spec::Optimizer::Sum,
        ..spec.clone()
    };
    let mut racks = Vec::with_capacity(targets.len());
    let mut parts = Vec::with_capacity(targets.len());
    let split = home.split(&counts);
    // Replicated: each home keeps backup slots of other homes' parts
    // (PROTOCOL.md §11.11); one rack per appliance, so any distinct labels
    // give the replica sets.
    let all: Vec<&Layout> = split.iter().collect();
    let labels: Vec<&str> = targets.iter().map(|t| t.name).collect();
    for (i, (t, part)) in targets.iter().zip(split.iter().cloned()).enumerate() {
        let info = t.info;
        let backups = backups(spec, t, &all, &labels, i);
        let homes = cost(spec, &part, info).lcores;
        let load: Vec<u64> = t
            .load
            .iter()
            .copied()
            .chain(std::iter::repeat(0))
            .zip(&homes)
            .map(|(l, h)| l + h)
            .collect();
        let rack = place(
            &relay,
            &load,
            &choose_lcores(info),
            info.memory_model.chunk_cost(&relay, ResultStore::Slot),
        );
        let mut cost = info.memory_model.hierarchical_cost(spec, &rack, &part, peers);
        for (c, b) in cost.lcores.iter_mut().zip(&backups) {
            *c += b;
        }
        let need = cost.total();
        let free = info.memory_budget_bytes.saturating_sub(info.memory_used_bytes);
        if need > free {
            return Err(AdmitError::Memory {
                appliance: t.name.to_string(),
                need,
                data: data_bytes(&relay, ResultStore::Slot).min(need),
                shm: 0,
                free,
                budget: info.memory_budget_bytes,
            });
        }
        let lcores = rack.used_lcores();
        racks.push(rack);
        parts.push(Plan {
            layout: part,
            cost,
            memory_bytes: need,
            lcores,
        });
    }
    Ok(HierPlan {
        homes: ShardPlan { layout: home, parts },
        racks,
    })
}

/// Places the chunks `seqs` of `spec` (one appliance's part) anew over the
/// lcores of `target`, balanced with its load, and charges them.
pub fn plan_part(spec: &JobSpec, seqs: Range<u64>, target: &Target<'_>) -> Result<Plan, AdmitError> {
    let n = target.info.lcores.len();
    if n == 0 {
        return Err(AdmitError::NoLcores(target.name.to_string()));
    }
    if n > MAX_LCORES {
        return Err(AdmitError::TooManyLcores(n, target.name.to_string()));
    }
    let info = target.info;
    let load: Vec<u64> = target
        .load
        .iter()
        .copied()
        .chain(std::iter::repeat(0))
        .take(n)
        .collect();
    let layout = place_part(
        spec,
        seqs,
        &load,
        &choose_lcores(info),
        info.memory_model.chunk_cost(spec, spec.result_store(info.shm)),
    );
    let elems = Chunks::new(spec).weigh(u64::from);
    let lcores = layout.lcores.len();
    charge(spec, target, layout, lcores, &elems, &[])
}

/// Charges `target` what `part` of `spec` costs on it, or says it does not
/// fit. `elems` weighs the job's chunks by their elements; `job_lcores`
/// is the job's lcore count over every appliance, over which its tables'
/// rows are spread (PROTOCOL.md §10.1): each lcore is charged its share,
/// as control's accounting of the admitted job and the engine count it.
fn charge(
    spec: &JobSpec,
    target: &Target<'_>,
    part: Layout,
    job_lcores: usize,
    elems: &phub_proto::layout::Weights,
    backups: &[u64],
) -> Result<Plan, AdmitError> {
    let info = target.info;
    let mut cost = part_cost(spec, &part, info, job_lcores);
    for (c, b) in cost.lcores.iter_mut().zip(backups) {
        *c += b;
    }
    let need = cost.total();
    let free = info.memory_budget_bytes.saturating_sub(info.memory_used_bytes);
    if need > free {
        // The part's share of the job's data: every element costs the same.
        let all = elems.total().max(1);
        let data = data_bytes(spec, spec.result_store(info.shm)) / all * elems.of(part.span());
        return Err(AdmitError::Memory {
            appliance: target.name.to_string(),
            need,
            data: data.min(need),
            shm: cost.shm,
            free,
            budget: info.memory_budget_bytes,
        });
    }
    let lcores = part.used_lcores();
    Ok(Plan {
        layout: part,
        cost,
        memory_bytes: need,
        lcores,
    })
}

/// The `count` appliances a job goes on when it asks for a number of them:
/// those with the most free memory (`candidates`: name and free bytes of
/// each appliance that answers), ties to the lower name; in that order.
pub fn choose_appliances(count: usize, candidates: &[(String, u64)]) -> Result<Vec<String>, AdmitError> {
    if count > candidates.len() {
        let mut answer: Vec<String> = candidates.iter().map(|(n, _)| n.clone()).collect();
        answer.sort();
        return Err(AdmitError::Appliances { asked: count, answer });
    }
    let mut by_free: Vec<&(String, u64)> = candidates.iter().collect();
    by_free.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(by_free.into_iter().take(count).map(|(n, _)| n.clone()).collect())
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
            id: String::new(),
            backend: phub_proto::api::BackendKind::Udp,
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
                    rx_buffer_bytes: None,
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
        JobSpec::new("t", 2, keys).with_chunk_bytes(chunk_bytes)
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
            AdmitError::NoLcores(String::new())
        );
        let many = vec![None; MAX_LCORES + 1];
        assert_eq!(
            plan(&s, &info(&many, None, 1 << 30, 0), []).unwrap_err(),
            AdmitError::TooManyLcores(MAX_LCORES + 1, String::new())
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

    /// A job that gets no regions (here: async) on a dataplane that gives
    /// BSP jobs regions is charged and described as on a dataplane without
    /// them: its f32 results live in slot memory. Before the job's result
    /// store had one source, the refusal's data figure was computed with the
    /// dataplane's `--shm` alone and left the second buffer out.
    #[test]
    fn a_job_without_regions_costs_the_same_on_a_dataplane_that_gives_them() {
        let mut s = spec_with(&vec![1; 1_000_000], 64);
        s.consistency = phub_proto::spec::Consistency::Async;
        let mut dp = info(&[None, None], None, 64 << 20, 0);
        let plain = plan(&s, &dp, []).unwrap_err();
        dp.shm = true;
        let with = plan(&s, &dp, []).unwrap_err();
        assert_eq!(with, plain);
        let AdmitError::Memory { data, shm, .. } = with else {
            panic!("{with:?}")
        };
        assert_eq!((data, shm), (8_000_000, 0));
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

    /// Two appliances of 2 and 3 lcores, the second already loaded on its
    /// lcore 0: the job's chunks go over all 5, bytes balanced as over one
    /// appliance of 5, each chunk on one of them, and each part is charged
    /// to its own appliance.
    #[test]
    fn a_job_over_two_appliances_is_balanced_over_their_union() {
        let a = info(&[None, None], None, 1 << 30, 0);
        let b = info(&[None, None, None], None, 1 << 30, 0);
        let other = spec(&[256 * 4]);
        let on_b = plan(&other, &b, []).unwrap().layout;
        let b_load = loads(&b, [(&other, &on_b)]);
        let s = spec(&[256 * 40, 100]);
        let targets = [
            Target {
                name: "a",
                info: &a,
                load: loads(&a, []),
            },
            Target {
                name: "b",
                info: &b,
                load: b_load.clone(),
            },
        ];
        let p = plan_over(&s, &targets).unwrap();
        assert_eq!(p.layout.lcores.len(), 5);
        assert_eq!(p.parts.len(), 2);
        assert_eq!(p.parts[0].layout.lcores, p.layout.lcores[..2]);
        assert_eq!(p.parts[1].layout.lcores, p.layout.lcores[2..]);
        assert_eq!(p.parts[0].layout.span().end, p.parts[1].layout.span().start);
        assert!(Placement::new(&s, p.layout.clone()).is_ok());
        for part in &p.parts {
            assert!(Placement::part(&s, part.layout.clone()).is_ok());
        }
        // The same as one appliance whose lcores are both appliances'.
        let union = info(&[None; 5], None, 1 << 30, 0);
        let mut union_load = vec![0, 0];
        union_load.extend(&b_load);
        let chosen: Vec<u16> = (0..5).collect();
        let cost = union.memory_model.chunk_cost(&s, ResultStore::Slot);
        assert_eq!(p.layout, place(&s, &union_load, &chosen, cost));
        // Balanced: every lcore ends within about one chunk of the others.
        let mut after = loads(&a, [(&s, &p.parts[0].layout)]);
        let mut on_b_after = b_load.clone();
        for (l, x) in on_b_after
            .iter_mut()
            .zip(bytes_per_lcore(&s, &p.parts[1].layout, &b))
        {
            *l += x;
        }
        after.extend(on_b_after);
        let (lo, hi) = (after.iter().min().unwrap(), after.iter().max().unwrap());
        assert!(hi - lo <= 2 * cost(s.chunk_elems()), "{after:?}");
        // Each part costs what its own layout costs on its appliance.
        assert_eq!(
            p.parts[1].memory_bytes,
            super::cost(&s, &p.parts[1].layout, &b).total()
        );
    }

    /// A replicated hierarchical job (PROTOCOL.md §11.11): each rack
    /// appliance is charged what the same job without replicas costs it
    /// plus the backup slots it keeps of the homes before it in rack order
    /// (`replica_cost` over the home layout's parts), and refused when
    /// that does not fit.
    #[test]
    fn a_replicated_hierarchical_job_charges_each_rack_its_backup_slots() {
        let dp = [
            info(&[None, None], None, 1 << 30, 0),
            info(&[None], None, 1 << 30, 0),
            info(&[None, None], None, 1 << 30, 0),
        ];
        let targets: Vec<Target<'_>> = ["a", "b", "c"]
            .iter()
            .zip(&dp)
            .map(|(&name, info)| Target {
                name,
                info,
                load: loads(info, []),
            })
            .collect();
        let hier = |replicas: u32| {
            JobSpec::new("h", 3, &[256 * 40, 100])
                .with_chunk_bytes(1024)
                .hierarchical_over(phub_proto::spec::Appliances::Count(3))
                .with_replicas(replicas)
        };
        let one = plan_hierarchical(&hier(1), &targets).unwrap();
        let two = plan_hierarchical(&hier(2), &targets).unwrap();
        assert_eq!(one.homes.layout, two.homes.layout);
        let parts: Vec<&Layout> = two.homes.parts.iter().map(|p| &p.layout).collect();
        for (i, d) in dp.iter().enumerate() {
            let backups: u64 = d
                .memory_model
                .replica_cost(&hier(2), &parts, &["a", "b", "c"], i)
                .iter()
                .sum();
            assert!(backups > 0, "appliance {i} keeps no backup slots");
            assert_eq!(
                two.homes.parts[i].memory_bytes,
                one.homes.parts[i].memory_bytes + backups,
                "appliance {i}"
            );
        }
        // Room for the job without replicas on c, not for its backups.
        let tight = info(&[None, None], None, one.homes.parts[2].memory_bytes, 0);
        let mut short = targets.clone();
        short[2] = Target {
            name: "c",
            info: &tight,
            load: loads(&tight, []),
        };
        assert!(plan_hierarchical(&hier(1), &short).is_ok());
        let e = plan_hierarchical(&hier(2), &short).unwrap_err();
        assert!(
            matches!(&e, AdmitError::Memory { appliance, .. } if appliance == "c"),
            "{e:?}"
        );
    }

    #[test]
    fn memory_is_checked_per_appliance_and_the_refusal_names_it() {
        let s = spec(&[256 * 40]);
        let roomy = info(&[None, None], None, 1 << 30, 0);
        let whole = plan(&s, &roomy, []).unwrap().memory_bytes;
        // Either alone is too small for the job, but each holds its half.
        let half = info(&[None, None], None, whole * 3 / 4, 0);
        let t = |name, info| Target {
            name,
            info,
            load: vec![0, 0],
        };
        assert!(plan(&s, &half, []).is_err());
        let p = plan_over(&s, &[t("a", &half), t("b", &half)]).unwrap();
        assert!(p.parts.iter().all(|part| part.memory_bytes <= whole * 3 / 4));
        // One of them nearly full: refused, naming it and its figures.
        let full = info(&[None, None], None, whole * 3 / 4, whole / 2);
        let e = plan_over(&s, &[t("a", &half), t("b", &full)]).unwrap_err();
        assert!(
            matches!(&e, AdmitError::Memory { appliance, .. } if appliance == "b"),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(
            m.starts_with("job needs ") && m.contains(" on appliance \"b\"; the dataplane has "),
            "{m}"
        );
        let none = info(&[], None, 1 << 30, 0);
        let e = plan_over(&s, &[t("a", &half), t("c", &none)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("on appliance \"c\" has no lcores"), "{e}");
    }

    /// A table's rows are spread over the job's lcores on every appliance
    /// (PROTOCOL.md §10.1): a part of a sharded job is charged its lcores'
    /// share of them, as the engine holds them and control counts the
    /// admitted job, not the whole table on each lcore (three times the
    /// rows over three appliances; seen as the dataplane's "admission
    /// charged" warnings of the replicated table tests).
    #[test]
    fn a_sharded_table_is_charged_each_lcore_its_share_of_the_rows() {
        let s = JobSpec::from_toml(
            "name = \"t\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n\
             [[keys]]\nname = \"w\"\nelements = 64\n\
             [[keys]]\nname = \"emb\"\nkind = \"table\"\ndim = 16\nrows = 3000000\n\
             optimizer = { kind = \"adagrad\", lr = 0.1 }\n",
        )
        .unwrap();
        let one = info(&[None], None, 1 << 36, 0);
        let t = |name| Target {
            name,
            info: &one,
            load: vec![0],
        };
        let p = plan_over(&s, &[t("a"), t("b"), t("c")]).unwrap();
        let m = MemoryModel::default();
        for part in &p.parts {
            assert_eq!(
                part.cost.lcores,
                m.part_cost(&s, &part.layout, ResultStore::Slot, 3).lcores
            );
            let whole = m.job_cost(&s, &part.layout, ResultStore::Slot).total();
            assert!(
                part.memory_bytes * 2 < whole,
                "{} bytes charged, the whole table {whole}",
                part.memory_bytes
            );
        }
        // Alone, the job's one lcore holds the whole table.
        let alone = plan(&s, &one, []).unwrap();
        assert_eq!(
            alone.memory_bytes,
            m.job_cost(&s, &alone.layout, ResultStore::Slot).total()
        );
    }

    #[test]
    fn a_number_of_appliances_takes_those_with_the_most_free_memory() {
        let c = |n: &str, f| (n.to_string(), f);
        let all = [c("a", 10), c("b", 30), c("c", 30), c("d", 5)];
        assert_eq!(choose_appliances(1, &all).unwrap(), ["b"]);
        assert_eq!(choose_appliances(3, &all).unwrap(), ["b", "c", "a"]);
        let e = choose_appliances(5, &all).unwrap_err().to_string();
        assert_eq!(e, "the job asks for 5 appliances; 4 answer: a, b, c, d");
        let e = choose_appliances(1, &[]).unwrap_err().to_string();
        assert_eq!(e, "the job asks for 1 appliances; 0 answer");
    }

    #[test]
    fn ids() {
        assert_eq!(free_id(|_| false), Ok(1));
        assert_eq!(free_id(|id| id < 5 && id != 3), Ok(3));
        assert_eq!(free_id(|_| true), Err(AdmitError::NoIds));
    }
}
