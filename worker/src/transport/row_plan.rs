//! A table request's messages, planned before anything is sent
//! (PROTOCOL.md §10.2, "A rank's round on a table"): the caller's ids with
//! duplicates merged (a push's gradient rows summed), split by the lcore
//! the placement (§10.1) puts each on, sorted within each lcore, and cut
//! into messages of at most R rows (or ids).
//!
//! Layer: pure. A plan is made on the caller's thread, so a request that
//! cannot be sent (a gradient of the wrong length, more rows for one lcore
//! than one round may carry) fails there, before the I/O thread sees it.
//!
//! Invariants (asserted by [`RowPlan::check`] in debug builds):
//! - every distinct id appears once in `ids`, in the run of its lcore, the
//!   runs in lcore order, ids sorted within a run;
//! - `slot_of[i]` is the index in `ids` of the caller's id `i`;
//! - a push has, per lcore e, `n_e` ROW_PUSH messages numbered 0 ..
//!   `n_e` − 1 (`n_e` ≤ [`MAX_ROW_MESSAGES`], each of 1 to R rows) and then
//!   one ROW_END with `seq` = `n_e`, also for an lcore with no row
//!   (`n_e` = 0); a pull has ROW_PULLs of 1 to R ids, numbered over the
//!   whole request, and nothing for an lcore with no id.

use std::ops::Range;

use phub_proto::placement::RowPlacement;
use phub_proto::rows::{ids_signature, messages_for, RowMsgType, MAX_ROW_MESSAGES};

use crate::error::WorkerError;

/// What a row transport needs to know about one table of the job.
#[derive(Debug, Clone)]
pub(crate) struct TableInfo {
    /// The table's key index (the `key` field of its messages).
    pub(crate) key: u32,
    /// The table's name, for errors.
    pub(crate) name: String,
    /// Values per row, D.
    pub(crate) dim: u32,
    /// Rows (or ids) per datagram, R (≥ 1).
    pub(crate) per: u32,
    /// Where each row lives.
    pub(crate) placement: RowPlacement,
    /// Id lists this rank may keep per lcore (the spec's `key_cache`,
    /// PROTOCOL.md §10.7); 0: no key caching.
    pub(crate) key_cache: u32,
}

/// What a planned request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PlanKind {
    /// ROW_PUSHes and ROW_ENDs of this round (BSP) or clock.
    Push {
        /// The round or clock, ≥ 1.
        round: u32,
    },
    /// ROW_PULLs.
    Pull,
}

/// One message of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlanMsg {
    /// The lcore it goes to (entry in the job's lcores, §10.1).
    pub(crate) entry: u32,
    /// ROW_PUSH, ROW_END or ROW_PULL.
    pub(crate) kind: RowMsgType,
    /// ROW_PUSH: its sequence number s; ROW_END: the lcore's message count
    /// n; ROW_PULL: its index among the request's messages (the transport
    /// adds its tag, `rows.rs`).
    pub(crate) seq: u32,
    /// Its rows: indices into [`RowPlan::ids`] (empty for a ROW_END).
    pub(crate) rows: Range<usize>,
}

/// Where an lcore's messages are in [`RowPlan::msgs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Lane {
    /// Index of its first message (its ROW_END's for n = 0).
    pub(crate) first: usize,
    /// Its ROW_PUSH count n (a push), or ROW_PULL count (a pull).
    pub(crate) n: u32,
}

/// A table request, planned.
#[derive(Debug, Clone)]
pub(crate) struct RowPlan {
    /// The table's key index.
    pub(crate) key: u32,
    /// Values per row.
    pub(crate) dim: u32,
    pub(crate) kind: PlanKind,
    /// The distinct ids, by lcore then id.
    pub(crate) ids: Vec<u64>,
    /// A push: the summed gradient row of each id of `ids`
    /// (`ids.len() * dim`); a pull: empty.
    pub(crate) grads: Vec<f32>,
    /// The caller's id `i` is `ids[slot_of[i]]`.
    pub(crate) slot_of: Vec<u32>,
    /// The messages, in the order they go out: lcore by lcore.
    pub(crate) msgs: Vec<PlanMsg>,
    /// Per lcore (entry): where its messages are.
    pub(crate) lanes: Vec<Lane>,
}

/// The caller's ids with their lcores, merged: the distinct ids by (lcore,
/// id), each id's lcore, and the caller's positions' indices into them.
struct Merged {
    ids: Vec<u64>,
    entries: Vec<u32>,
    slot_of: Vec<u32>,
    /// Per distinct id, the caller's positions of it in their order
    /// (flattened: `order[starts[u]..starts[u + 1]]`).
    order: Vec<u32>,
    starts: Vec<usize>,
}

fn merge(table: &TableInfo, ids: &[u64]) -> Result<Merged, WorkerError> {
    let Ok(n) = u32::try_from(ids.len()) else {
        return Err(WorkerError::Rows {
            table: table.name.clone(),
            message: format!("{} ids in one call; accepted: at most 2^32 - 1", ids.len()),
        });
    };
    // (entry, id, position): sorting makes the order of every output a
    // function of the ids alone, and sums repeats in the caller's order.
    // Packed in one u128 (entry in the high 32 bits, the position in the
    // low): the same order, sorted in 0.6x the time of the tuples (4096
    // ids: 92 against 150 us here, BENCHMARKS.md).
    let mut keyed: Vec<u128> = ids
        .iter()
        .zip(0..n)
        .map(|(&id, i)| {
            (u128::from(table.placement.entry(id)) << 96) | (u128::from(id) << 32) | u128::from(i)
        })
        .collect();
    keyed.sort_unstable();
    let mut m = Merged {
        ids: Vec::new(),
        entries: Vec::new(),
        slot_of: vec![0; ids.len()],
        order: Vec::with_capacity(ids.len()),
        starts: Vec::new(),
    };
    for &k in &keyed {
        // Casts: the fields packed above.
        #[allow(clippy::cast_possible_truncation)]
        let (entry, id, pos) = ((k >> 96) as u32, (k >> 32) as u64, k as u32);
        if m.ids.last() != Some(&id) || m.entries.last() != Some(&entry) {
            m.starts.push(m.order.len());
            m.ids.push(id);
            m.entries.push(entry);
        }
        // Cast: at most `n` distinct ids, n < 2^32.
        #[allow(clippy::cast_possible_truncation)]
        let slot = (m.ids.len() - 1) as u32;
        m.slot_of[pos as usize] = slot;
        m.order.push(pos);
    }
    m.starts.push(m.order.len());
    Ok(m)
}

/// The runs of `entries` (sorted): per lcore of `lcores`, the range of
/// indices whose entry it is.
fn runs(entries: &[u32], lcores: u32) -> Vec<Range<usize>> {
    (0..lcores)
        .map(|e| entries.partition_point(|&x| x < e)..entries.partition_point(|&x| x <= e))
        .collect()
}

/// Plans round (or clock) `round` of `table`: `grads` holds `ids.len()`
/// rows of D values, row i being id i's.
pub(crate) fn plan_push(
    table: &TableInfo,
    round: u32,
    ids: &[u64],
    grads: &[f32],
) -> Result<RowPlan, WorkerError> {
    let dim = table.dim as usize;
    let expected = ids.len().checked_mul(dim);
    if expected != Some(grads.len()) {
        return Err(WorkerError::Rows {
            table: table.name.clone(),
            message: format!(
                "grads has {} values; expected ids.len() * dim = {} * {} = {}",
                grads.len(),
                ids.len(),
                dim,
                expected.map_or_else(|| "more than memory holds".to_string(), |e| e.to_string())
            ),
        });
    }
    let m = merge(table, ids)?;
    let mut sums = Vec::with_capacity(m.ids.len() * dim);
    for u in 0..m.ids.len() {
        let positions = &m.order[m.starts[u]..m.starts[u + 1]];
        // The first copies, the others add: one repeat is its own row
        // bit for bit. (Appended: zeroing the sums first cost a third as
        // much as the copies, perf.)
        sums.extend_from_slice(&grads[positions[0] as usize * dim..][..dim]);
        let row = &mut sums[u * dim..];
        for &p in &positions[1..] {
            for (s, g) in row.iter_mut().zip(&grads[p as usize * dim..][..dim]) {
                *s += g;
            }
        }
    }
    let lcores = table.placement.lcores();
    let mut msgs = Vec::new();
    let mut lanes = Vec::with_capacity(lcores as usize);
    for (entry, run) in (0..lcores).zip(runs(&m.entries, lcores)) {
        let rows = run.len() as u64;
        let n = messages_for(rows, table.per);
        if n > u64::from(MAX_ROW_MESSAGES) {
            return Err(WorkerError::Rows {
                table: table.name.clone(),
                message: format!(
                    "{rows} distinct rows for lcore {entry} in one round: they need {n} ROW_PUSH messages of at \
                     most {} rows; accepted: at most {MAX_ROW_MESSAGES} messages ({} rows) per lcore and round \
                     (PROTOCOL.md §10.2): push fewer ids per call",
                    table.per,
                    u64::from(MAX_ROW_MESSAGES) * u64::from(table.per)
                ),
            });
        }
        // Cast: n ≤ MAX_ROW_MESSAGES.
        #[allow(clippy::cast_possible_truncation)]
        let n = n as u32;
        lanes.push(Lane { first: msgs.len(), n });
        let per = table.per as usize;
        for s in 0..n {
            let a = run.start + s as usize * per;
            msgs.push(PlanMsg {
                entry,
                kind: RowMsgType::RowPush,
                seq: s,
                rows: a..(a + per).min(run.end),
            });
        }
        msgs.push(PlanMsg {
            entry,
            kind: RowMsgType::RowEnd,
            seq: n,
            rows: run.end..run.end,
        });
    }
    let plan = RowPlan {
        key: table.key,
        dim: table.dim,
        kind: PlanKind::Push { round },
        ids: m.ids,
        grads: sums,
        slot_of: m.slot_of,
        msgs,
        lanes,
    };
    plan.check(table);
    Ok(plan)
}

/// Plans a pull of `ids`' rows of `table`.
pub(crate) fn plan_pull(table: &TableInfo, ids: &[u64]) -> Result<RowPlan, WorkerError> {
    let m = merge(table, ids)?;
    let lcores = table.placement.lcores();
    let per = table.per as usize;
    let mut msgs = Vec::new();
    let mut lanes = Vec::with_capacity(lcores as usize);
    for (entry, run) in (0..lcores).zip(runs(&m.entries, lcores)) {
        let first = msgs.len();
        let mut a = run.start;
        while a < run.end {
            let seq = u32::try_from(msgs.len())
                .ok()
                .filter(|&s| s < PULL_MESSAGES)
                .ok_or_else(|| WorkerError::Rows {
                    table: table.name.clone(),
                    message: format!(
                        "{} distinct ids in one pull need more than {PULL_MESSAGES} ROW_PULL messages of at most \
                         {} ids: pull fewer at a time",
                        m.ids.len(),
                        table.per
                    ),
                })?;
            msgs.push(PlanMsg {
                entry,
                kind: RowMsgType::RowPull,
                seq,
                rows: a..(a + per).min(run.end),
            });
            a += per;
        }
        // Cast: below PULL_MESSAGES.
        #[allow(clippy::cast_possible_truncation)]
        let n = (msgs.len() - first) as u32;
        lanes.push(Lane { first, n });
    }
    let plan = RowPlan {
        key: table.key,
        dim: table.dim,
        kind: PlanKind::Pull,
        ids: m.ids,
        grads: Vec::new(),
        slot_of: m.slot_of,
        msgs,
        lanes,
    };
    plan.check(table);
    Ok(plan)
}

/// The id lists a push or pull of `ids` sends (PROTOCOL.md §10.7): per
/// message, its lcore's entry and its ids' signature, distinct, in plan
/// order; and the signature of the whole set (its distinct ids in plan
/// order). A push and a pull of the same ids cut them into the same
/// messages, whatever their order and repeats.
pub(crate) fn id_lists(table: &TableInfo, ids: &[u64]) -> Result<(Vec<(u32, u64)>, u64), WorkerError> {
    let plan = plan_pull(table, ids)?;
    let mut lists: Vec<(u32, u64)> = plan
        .msgs
        .iter()
        .map(|m| (m.entry, ids_signature(plan.ids[m.rows.clone()].iter().copied())))
        .collect();
    lists.dedup();
    Ok((lists, ids_signature(plan.ids.iter().copied())))
}

/// The most ROW_PULL messages one pull may have: their index takes the
/// low 20 bits of the `chunk` field (the transport's tag the others).
pub(crate) const PULL_MESSAGES: u32 = 1 << 20;

impl RowPlan {
    /// The message of lcore `entry` with sequence number `seq`: a push's
    /// ROW_PUSH s (`seq` < n) or ROW_END (`seq` = n); a pull's ROW_PULL of
    /// that index (when it goes to `entry`).
    pub(crate) fn msg_index(&self, entry: u32, seq: u32) -> Option<usize> {
        match self.kind {
            PlanKind::Push { .. } => {
                let lane = self.lanes.get(entry as usize)?;
                (seq <= lane.n).then_some(lane.first + seq as usize)
            }
            PlanKind::Pull => {
                let i = seq as usize;
                self.msgs.get(i).filter(|m| m.entry == entry).map(|_| i)
            }
        }
    }

    /// Debug builds: the module's invariants.
    fn check(&self, table: &TableInfo) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (i, &s) in self.slot_of.iter().enumerate() {
            assert!((s as usize) < self.ids.len(), "slot_of[{i}] = {s} beyond the ids");
        }
        for m in &self.msgs {
            let ids = &self.ids[m.rows.clone()];
            assert!(ids.len() <= table.per as usize, "a message of {} rows", ids.len());
            assert!(
                ids.windows(2).all(|w| w[0] < w[1]),
                "ids sorted and distinct per message"
            );
            assert!(
                ids.iter().all(|&id| table.placement.entry(id) == m.entry),
                "an id on another lcore"
            );
            match m.kind {
                RowMsgType::RowEnd => assert!(ids.is_empty()),
                _ => assert!(!ids.is_empty(), "a {} of no rows", m.kind.name()),
            }
        }
        if let PlanKind::Push { .. } = self.kind {
            assert_eq!(self.lanes.len(), table.placement.lcores() as usize);
            assert_eq!(self.grads.len(), self.ids.len() * self.dim as usize);
            for (e, lane) in self.lanes.iter().enumerate() {
                let end = &self.msgs[lane.first + lane.n as usize];
                assert!(end.kind == RowMsgType::RowEnd && end.seq == lane.n && end.entry as usize == e);
            }
        }
    }
}
