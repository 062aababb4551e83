//! Reconciliation's choice for an admitted job that the dataplane lacks when
//! the dataplane no longer has the lcores the job's layout was made for (it
//! restarted with another lcore count). Pure: the daemon fetches the
//! dataplane's info and the admitted jobs, calls [`refit`], persists the
//! result and installs it.
//!
//! This is the one place that reads how many lcores a layout spans and
//! which it uses, so a change of the layout's shape touches it alone.

use phub_proto::api::DataplaneInfo;
use phub_proto::layout::{ChunkRange, Layout};
use phub_proto::spec::JobSpec;

use crate::admission;

/// What to do with a job before installing it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refit {
    /// The layout is for as many lcores as the dataplane has: install it.
    AsIs,
    /// Every lcore the job uses still exists: the same places, the layout
    /// sized for the dataplane's lcores. Ranks that joined keep theirs.
    Resized(Layout),
    /// Placed anew over the lcores that exist, balanced with the other
    /// jobs, within the memory budget. Ranks that joined must join again:
    /// their layout names lcores or slots that now hold other chunks.
    Replaced(Layout),
    /// It cannot be placed on this dataplane: the reason, for `job show`
    /// and for refused joins.
    Failed(String),
}

/// Lcores the layout was made for (one entry per dataplane lcore).
fn span(layout: &Layout) -> usize {
    layout.lcore_count()
}

/// The highest lcore holding one of the job's chunks (none for a job
/// without chunks).
fn highest_used(layout: &Layout) -> Option<usize> {
    layout.used_lcores().last().map(|&l| usize::from(l))
}

/// The same places, the layout sized for `n` lcores: lcores beyond the
/// highest it uses are dropped, or added holding none of its chunks (an
/// empty run at the end of the chunk sequence). Every lcore the job uses
/// must be below `n`.
fn resized(layout: &Layout, n: usize) -> Layout {
    debug_assert!(highest_used(layout).is_none_or(|h| h < n));
    let end = ChunkRange {
        first: layout.span().end,
        count: 0,
    };
    let mut l = layout.clone();
    l.lcores.resize(n, end);
    l
}

/// Decides how job `id` (`spec`, `layout`) goes onto the dataplane `info`
/// describes, given the other admitted jobs still in service there. For a
/// job sharded over several appliances, `layout` is this appliance's part
/// (its share of the chunk sequence, which stays its share).
pub(crate) fn refit<'a>(
    spec: &JobSpec,
    layout: &Layout,
    info: &DataplaneInfo,
    others: impl IntoIterator<Item = (&'a JobSpec, &'a Layout)>,
) -> Refit {
    let n = info.lcores.len();
    if span(layout) == n {
        return Refit::AsIs;
    }
    let high = highest_used(layout);
    if high.is_none_or(|h| h < n) && n > 0 {
        return Refit::Resized(resized(layout, n));
    }
    let target = admission::Target {
        name: "",
        info,
        load: admission::loads(info, others),
    };
    match admission::plan_part(spec, layout.span(), &target) {
        Ok(plan) => Refit::Replaced(plan.layout),
        Err(e) => Refit::Failed(format!(
            "placed on {} lcores (up to lcore {}), the dataplane now has {n} and placing the job \
             anew on them fails: {e}",
            layout.used_lcores().len(),
            high.unwrap_or(0)
        )),
    }
}

#[cfg(test)]
// Tests cast small, literal sizes.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use phub_proto::api::{DataAddr, LcoreInfo};
    use phub_proto::memory::MemoryModel;

    fn info(lcores: usize, budget: u64, used: u64) -> DataplaneInfo {
        DataplaneInfo {
            id: String::new(),
            backend: phub_proto::api::BackendKind::Udp,
            data: DataAddr {
                host: "127.0.0.1".into(),
                base_port: 9000,
            },
            lcores: (0..lcores)
                .map(|i| LcoreInfo {
                    lcore: i as u16,
                    cpu: Some(i),
                    numa_node: None,
                    rx_buffer_bytes: None,
                })
                .collect(),
            nic_numa_node: None,
            memory_budget_bytes: budget,
            memory_used_bytes: used,
            memory_model: MemoryModel::default(),
            slot_memory: "Rust heap".into(),
            kernels: "scalar".into(),
            shm: false,
            version: "test".into(),
        }
    }

    fn spec(elements: u64) -> JobSpec {
        JobSpec::new("t", 2, &[elements]).with_chunk_bytes(1024)
    }

    /// One appliance's part of a sharded job keeps its share of the chunk
    /// sequence when resized or placed anew.
    #[test]
    fn a_part_keeps_its_share_of_the_chunks() {
        let s = spec(256 * 8);
        let whole = admission::plan(&s, &info(6, 1 << 30, 0), []).unwrap().layout;
        let part = whole.split(&[2, 4]).remove(1);
        let share = part.span();
        assert!(share.start > 0);
        let Refit::Resized(five) = refit(&s, &part, &info(5, 1 << 30, 0), []) else {
            panic!("not resized")
        };
        assert_eq!((five.span(), five.lcores[4].first), (share.clone(), share.end));
        let Refit::Replaced(two) = refit(&s, &part, &info(2, 1 << 30, 0), []) else {
            panic!("not replaced")
        };
        assert_eq!(two.span(), share);
        assert!(phub_proto::layout::Placement::part(&s, two).is_ok());
    }

    #[test]
    fn same_count_as_is_unused_lcores_resized_others_replaced_or_failed() {
        let s = spec(256 * 8);
        let four = admission::plan(&s, &info(4, 1 << 30, 0), []).unwrap().layout;
        assert_eq!((span(&four), highest_used(&four)), (4, Some(3)));
        assert_eq!(refit(&s, &four, &info(4, 1 << 30, 0), []), Refit::AsIs);

        // More lcores: the same places, padded.
        let Refit::Resized(six) = refit(&s, &four, &info(6, 1 << 30, 0), []) else {
            panic!("not resized")
        };
        assert_eq!((span(&six), &six.lcores[..4]), (6, &four.lcores[..]));
        assert!(six.lcores[4..]
            .iter()
            .all(|r| r.is_empty() && r.first == four.chunk_count()));

        // Fewer lcores than it uses: placed anew over the two.
        let Refit::Replaced(two) = refit(&s, &four, &info(2, 1 << 30, 0), []) else {
            panic!("not replaced")
        };
        assert_eq!((span(&two), highest_used(&two)), (2, Some(1)));
        assert_eq!(two.chunk_count(), four.chunk_count());

        // Fewer lcores, and it no longer fits the memory.
        let Refit::Failed(why) = refit(&s, &four, &info(2, 1 << 20, 1 << 20), []) else {
            panic!("not failed")
        };
        assert!(
            why.contains("placed on 4 lcores (up to lcore 3), the dataplane now has 2")
                && why.contains("job needs"),
            "{why}"
        );

        // Fewer lcores, but the job only uses those that remain (NUMA).
        let low = resized(&two, 4);
        assert_eq!(
            refit(&s, &low, &info(3, 1 << 30, 0), []),
            Refit::Resized(resized(&two, 3))
        );
    }
}
