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
use phub_proto::row_ops::{add_row, extend_row};
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

/// The caller's ids merged: the distinct ids by (lcore, id), the run of
/// each lcore's, the caller's positions' indices into them and, for a
/// push, each distinct id's gradient row summed.
struct Merged {
    ids: Vec<u64>,
    /// Per entry (lcore), the range of `ids` on it.
    runs: Vec<Range<usize>>,
    slot_of: Vec<u32>,
    /// A push: `ids.len()` rows of D values, each id's rows summed in the
    /// caller's order; a pull: empty.
    sums: Vec<f32>,
}

/// A call's gradient rows: `grads[i * dim..][..dim]` is id i's.
#[derive(Clone, Copy)]
struct Grads<'a> {
    grads: &'a [f32],
    dim: usize,
}

/// [`merge`]'s working memory, kept by each thread that plans from one
/// call to the next (allocated afresh, its pages were faulted in again
/// on every call: as much time as the merge itself, BENCHMARKS.md).
#[derive(Default)]
struct Scratch {
    /// Each position's high digit.
    hi_of: Vec<u32>,
    /// Each position's low digit.
    lo_of: Vec<u32>,
    /// Counts, then starts, of the high digits (one more than digits).
    hi: Vec<u32>,
    /// The same of the low digits, then where the next position of each
    /// goes.
    lo: Vec<u32>,
    /// Where the next position of each high digit goes.
    next: Vec<u32>,
    /// Positions, by low digit.
    by_lo: Vec<u32>,
    /// Positions, by (high digit, low digit, position), then by (high
    /// digit, id, position).
    keyed: Vec<u32>,
}

impl Scratch {
    /// Gives the memory of a call far larger than one of `n` ids back
    /// (a thread that once planned a huge call keeps no more than 8x
    /// what its later calls need, and 2^16 ids' worth at least).
    fn fit(&mut self, n: usize) {
        let keep = n.max(1 << 16).saturating_mul(8);
        if self.keyed.capacity() > keep {
            *self = Scratch::default();
        }
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

fn merge(table: &TableInfo, ids: &[u64], grads: Option<Grads<'_>>) -> Result<Merged, WorkerError> {
    let Ok(n) = u32::try_from(ids.len()) else {
        return Err(WorkerError::Rows {
            table: table.name.clone(),
            message: format!("{} ids in one call; accepted: at most 2^32 - 1", ids.len()),
        });
    };
    Ok(SCRATCH.with(|s| merge_in(table, ids, n, grads, &mut s.borrow_mut())))
}

/// [`merge`] of `n` = `ids.len()` ids in `scratch`.
///
/// The (entry, id, position) order makes the order of every output a
/// function of the ids alone and sums repeats in the caller's order. It
/// is reached without a comparison sort of the call (one of the triples
/// packed in u128s was a fifth of a pull's CPU, BENCHMARKS.md): two
/// stable counting passes of the positions, by a low digit (the id's
/// bits just below the high digit's) and then by a high digit (the
/// entry, then the id's leading bits), leave them by (entry, the id's
/// leading bits, the caller's position); a last pass puts in id order the
/// rare neighbours whose two digits are equal and ids not (a comparison
/// sort of each high digit's positions, should there be many: ids alike
/// in their leading bits). No branch depends on the ids but that last
/// pass's test.
fn merge_in(
    table: &TableInfo,
    ids: &[u64],
    n: u32,
    grads: Option<Grads<'_>>,
    scratch: &mut Scratch,
) -> Merged {
    let lcores = table.placement.lcores();
    let (or, and) = ids.iter().fold((0u64, u64::MAX), |(o, a), &id| (o | id, a & id));
    let d = Digits::new(ids.len(), lcores, or ^ and);
    scratch.fit(ids.len());
    let Scratch {
        hi_of,
        lo_of,
        hi,
        lo,
        next,
        by_lo,
        keyed,
    } = scratch;
    // Each pass works on slices taken once: the compiler keeps their
    // starts in registers (through the vectors, a store into one could
    // have changed another's start as far as it knew: each was read
    // again on every position, perf).
    let len = ids.len();
    for (v, n) in [
        (&mut *hi_of, len),
        (&mut *lo_of, len),
        (&mut *hi, d.hi_count() + 1),
        (&mut *lo, d.lo_count() + 1),
    ] {
        v.clear();
        v.resize(n, 0);
    }
    let (hi_of, lo_of, hi, lo) = (&mut hi_of[..], &mut lo_of[..], &mut hi[..], &mut lo[..]);
    // Both digits of each position, counted (at digit + 1, turned into
    // each digit's first index below).
    for ((&id, h), l) in ids.iter().zip(hi_of.iter_mut()).zip(lo_of.iter_mut()) {
        let (hd, ld) = (d.hi(table.placement.entry(id), id), d.lo(id));
        // Casts: below d.hi_count() and d.lo_count(), at most
        // max(n, lcores) and 2^16.
        #[allow(clippy::cast_possible_truncation)]
        {
            (*h, *l) = (hd as u32, ld as u32);
        }
        hi[hd + 1] += 1;
        lo[ld + 1] += 1;
    }
    for counts in [&mut *hi, &mut *lo] {
        for i in 1..counts.len() {
            counts[i] += counts[i - 1];
        }
    }
    // The positions by low digit, in the caller's order within one.
    by_lo.clear();
    by_lo.resize(len, 0);
    let by_lo = &mut by_lo[..];
    for (&l, i) in lo_of.iter().zip(0..n) {
        let at = &mut lo[l as usize];
        by_lo[*at as usize] = i;
        *at += 1;
    }
    // Then by high digit, stable: by (high, low, position).
    keyed.clear();
    keyed.resize(len, 0);
    let keyed = &mut keyed[..];
    next.clear();
    next.extend_from_slice(&hi[..hi.len() - 1]);
    let next = &mut next[..];
    for &p in by_lo.iter() {
        let at = &mut next[hi_of[p as usize] as usize];
        keyed[*at as usize] = p;
        *at += 1;
    }
    order_ties(keyed, ids, hi, hi_of, lo_of);
    let dim = grads.map_or(0, |g| g.dim);
    let mut m = Merged {
        ids: Vec::with_capacity(ids.len()),
        runs: Vec::with_capacity(lcores as usize),
        slot_of: vec![0; ids.len()],
        sums: Vec::with_capacity(if grads.is_some() { ids.len() * dim } else { 0 }),
    };
    let mut last = None;
    for entry in 0..lcores as usize {
        let first = m.ids.len();
        let span = hi[entry << d.hi_bits] as usize..hi[(entry + 1) << d.hi_bits] as usize;
        for &p in &keyed[span] {
            let p = p as usize;
            let id = ids[p];
            // Repeats of an id are neighbours, on one entry.
            if last != Some(id) {
                last = Some(id);
                m.ids.push(id);
                // The first copies, the others add: one repeat is its own
                // row bit for bit. (Appended: zeroing the sums first cost
                // a third as much as the copies, perf.)
                if let Some(g) = grads {
                    extend_row(&mut m.sums, &g.grads[p * dim..][..dim]);
                }
            } else if let Some(g) = grads {
                let at = m.sums.len() - dim;
                add_row(&mut m.sums[at..], &g.grads[p * dim..][..dim]);
            }
            // Cast: at most `n` distinct ids, n < 2^32.
            #[allow(clippy::cast_possible_truncation)]
            let slot = (m.ids.len() - 1) as u32;
            m.slot_of[p] = slot;
        }
        m.runs.push(first..m.ids.len());
    }
    m
}

/// [`merge_in`]'s last pass: `keyed`, positions by (high digit, low
/// digit, position), put by (high digit, id, position). Neighbours out of
/// id order with both digits equal are moved by insertion; past a budget
/// of moves (ids alike in all the digits' bits) each high digit's
/// positions are sorted instead.
fn order_ties(keyed: &mut [u32], ids: &[u64], hi: &[u32], hi_of: &[u32], lo_of: &[u32]) {
    let id = |p: u32| ids[p as usize];
    let group = |p: u32| (hi_of[p as usize], lo_of[p as usize]);
    let mut budget = 4 * keyed.len() + 64;
    for i in 1..keyed.len() {
        let p = keyed[i];
        if id(p) >= id(keyed[i - 1]) || group(p) != group(keyed[i - 1]) {
            continue;
        }
        let mut j = i;
        while j > 0 && id(keyed[j - 1]) > id(p) && group(keyed[j - 1]) == group(p) {
            keyed[j] = keyed[j - 1];
            j -= 1;
            if budget == 0 {
                keyed[j] = p;
                for w in hi.windows(2) {
                    keyed[w[0] as usize..w[1] as usize].sort_unstable_by_key(|&q| (id(q), q));
                }
                return;
            }
            budget -= 1;
        }
        keyed[j] = p;
    }
}

/// [`merge`]'s two digits of an id: per entry, `1 << hi_bits` high
/// digits, read from the id's leading bits among those where the call's
/// ids differ (below `width`), and `1 << lo_bits` low digits from the
/// bits below those.
#[derive(Debug, Clone, Copy)]
struct Digits {
    /// Entries.
    lcores: u32,
    /// Bits of the high digit taken from the id.
    hi_bits: u32,
    /// Bits of the low digit.
    lo_bits: u32,
    /// Bits where the call's ids differ: 64 less the leading zeros of
    /// (OR of the ids) XOR (AND of the ids); the bits above are alike in
    /// every id.
    width: u32,
}

impl Digits {
    /// Digits for `n` ids over `lcores` entries whose bits differ where
    /// `differ` is set: about two ids a high digit where ids spread
    /// evenly, and as many low digits as ids, each at most 2^16 (and no
    /// more than max(n / 2, lcores) high digits in all).
    fn new(n: usize, lcores: u32, differ: u64) -> Digits {
        let width = 64 - differ.leading_zeros();
        let per_entry = (n / lcores.max(1) as usize).max(1);
        let hi_bits = per_entry.ilog2().saturating_sub(1).min(16).min(width);
        let lo_bits = n.max(1).ilog2().min(16).min(width - hi_bits);
        Digits {
            lcores,
            hi_bits,
            lo_bits,
            width,
        }
    }

    /// High digits in all.
    fn hi_count(&self) -> usize {
        (self.lcores as usize) << self.hi_bits
    }

    /// Low digits.
    fn lo_count(&self) -> usize {
        1 << self.lo_bits
    }

    /// The high digit of `id` on `entry`: high digits in order hold their
    /// entry's ids in order.
    #[inline]
    fn hi(&self, entry: u32, id: u64) -> usize {
        ((entry as usize) << self.hi_bits) | Self::field(id, self.width - self.hi_bits, self.hi_bits)
    }

    /// The low digit of `id`.
    #[inline]
    fn lo(&self, id: u64) -> usize {
        Self::field(id, self.width - self.hi_bits - self.lo_bits, self.lo_bits)
    }

    /// `bits` bits of `id` from bit `at` up.
    #[inline]
    fn field(id: u64, at: u32, bits: u32) -> usize {
        if bits == 0 {
            return 0;
        }
        // Cast: masked to bits <= 16 bits.
        #[allow(clippy::cast_possible_truncation)]
        let f = ((id >> at) & ((1u64 << bits) - 1)) as usize;
        f
    }
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
    let m = merge(table, ids, Some(Grads { grads, dim }))?;
    let lcores = table.placement.lcores();
    let mut msgs = Vec::new();
    let mut lanes = Vec::with_capacity(lcores as usize);
    for (entry, run) in (0..lcores).zip(m.runs.iter().cloned()) {
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
        grads: m.sums,
        slot_of: m.slot_of,
        msgs,
        lanes,
    };
    plan.check(table);
    Ok(plan)
}

/// Plans a pull of `ids`' rows of `table`.
pub(crate) fn plan_pull(table: &TableInfo, ids: &[u64]) -> Result<RowPlan, WorkerError> {
    let m = merge(table, ids, None)?;
    let lcores = table.placement.lcores();
    let per = table.per as usize;
    let mut msgs = Vec::new();
    let mut lanes = Vec::with_capacity(lcores as usize);
    for (entry, run) in (0..lcores).zip(m.runs.iter().cloned()) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn table(lcores: &[u32]) -> TableInfo {
        TableInfo {
            key: 3,
            name: "emb".into(),
            dim: 2,
            per: 5,
            placement: RowPlacement::new(7, 3, lcores).unwrap(),
            key_cache: 0,
        }
    }

    /// What `merge` must give, by a comparison sort of every (entry, id,
    /// position), each id's rows summed in the caller's order.
    fn merge_by_sorting(table: &TableInfo, ids: &[u64], grads: Option<Grads<'_>>) -> Merged {
        let mut keyed: Vec<(u32, u64, u32)> = ids
            .iter()
            .zip(0u32..)
            .map(|(&id, i)| (table.placement.entry(id), id, i))
            .collect();
        keyed.sort_unstable();
        let lcores = table.placement.lcores();
        let mut m = Merged {
            ids: Vec::new(),
            runs: vec![0..0; lcores as usize],
            slot_of: vec![0; ids.len()],
            sums: Vec::new(),
        };
        for (entry, id, pos) in keyed {
            let p = pos as usize;
            if m.ids.last() != Some(&id) {
                m.ids.push(id);
                if let Some(g) = grads {
                    m.sums.extend_from_slice(&g.grads[p * g.dim..][..g.dim]);
                }
            } else if let Some(g) = grads {
                let at = m.sums.len() - g.dim;
                for (s, v) in m.sums[at..].iter_mut().zip(&g.grads[p * g.dim..][..g.dim]) {
                    *s += v;
                }
            }
            m.slot_of[p] = u32::try_from(m.ids.len() - 1).unwrap();
            let run = &mut m.runs[entry as usize];
            if run.start == run.end {
                *run = m.ids.len() - 1..m.ids.len();
            } else {
                run.end = m.ids.len();
            }
        }
        // Lcores with no id: an empty run where the ids before it end.
        let mut at = 0;
        for run in &mut m.runs {
            if run.start == run.end {
                *run = at..at;
            }
            at = run.end;
        }
        m
    }

    fn splitmix(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn merging_by_digits_gives_the_order_of_a_sort_of_every_entry_id_and_position() {
        let mut r = 1u64;
        for case in 0..700u64 {
            let lcores: Vec<u32> = match case % 4 {
                0 => vec![1],
                1 => vec![2],
                2 => vec![3, 2],
                _ => vec![1, 1, 1, 4],
            };
            let t = table(&lcores);
            let n = [0, 1, 2, 7, 64, 300, 4096][usize::try_from(case % 7).unwrap()];
            // Hashed ids, small ones (leading bits shared), a few ids
            // repeated, every id alike, the extremes, hashed ids repeated,
            // ids that differ only in bits the digits do not read.
            let ids: Vec<u64> = (0..n)
                .map(|_| match (case / 7) % 7 {
                    0 => splitmix(&mut r),
                    5 => {
                        let mut few = splitmix(&mut r) % 200;
                        splitmix(&mut few)
                    }
                    // Alike but in their top and low bits: every high and
                    // low digit the same, the insertions past their budget.
                    6 => ((splitmix(&mut r) & 1) << 62) | (splitmix(&mut r) & 0xFFF),
                    1 => splitmix(&mut r) % 100_000,
                    2 => splitmix(&mut r) % 13,
                    3 => 42,
                    _ => [0, u64::MAX, 1 << 63, 5][usize::try_from(splitmix(&mut r) % 4).unwrap()],
                })
                .collect();
            // Gradients whose sums depend on the order they are added in
            // (f32 rounding), so that the caller's order is checked too.
            let dim = 2;
            let grads: Vec<f32> = (0..n * dim)
                .map(|_| {
                    f32::from_bits(0x3f80_0000 | (u32::try_from(splitmix(&mut r) >> 41).unwrap())) * 1e-3
                })
                .collect();
            for g in [None, Some(Grads { grads: &grads, dim })] {
                let got = merge(&t, &ids, g).unwrap();
                let want = merge_by_sorting(&t, &ids, g);
                assert_eq!(got.ids, want.ids, "case {case}");
                assert_eq!(got.runs, want.runs, "case {case}");
                assert_eq!(got.slot_of, want.slot_of, "case {case}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.sums), bits(&want.sums), "case {case}");
            }
        }
    }

    #[test]
    fn digits_are_in_id_order_within_an_entry_and_in_entry_order() {
        let d = Digits::new(4096, 2, u64::MAX);
        assert_eq!(
            (d.hi_bits, d.lo_bits, d.hi_count(), d.lo_count()),
            (10, 12, 2048, 4096)
        );
        assert!(d.hi(0, u64::MAX) < d.hi(1, 0));
        assert!(d.hi(1, 1 << 53) < d.hi(1, 1 << 54));
        assert_eq!(d.hi(1, u64::MAX), 2047);
        assert_eq!(d.lo(0xFFC0_0000_0000_0000 | (5 << 42)), 5);
        // Ids that differ below bit 20 only: those bits make the digits.
        let small = Digits::new(4096, 1, (1 << 20) - 1);
        assert_eq!((small.hi_bits, small.lo_bits, small.width), (11, 9, 20));
        assert!(small.hi(0, 1 << 18) < small.hi(0, 1 << 19));
        assert_eq!(small.lo((1 << 9) - 1), 511);
        assert_eq!(small.lo(1 << 9), 0);
        assert_eq!(small.hi(0, 1 << 9), 1);
        // No more high digits than ids (or one per entry); ids all alike.
        assert_eq!(Digits::new(3, 8, 1 << 40).hi_count(), 8);
        let alike = Digits::new(100, 1, 0);
        assert_eq!((alike.hi_count(), alike.lo_count()), (1, 1));
    }
}
