//! Table messages in async and bounded delay (PROTOCOL.md §10.3, "Async
//! and bounded delay"): `round` is the rank's clock on the (table, lcore);
//! each ROW_PUSH is applied at once and answered at once; a clock
//! completes per rank; in bounded delay τ a rank's ROW_DONE of clock c is
//! held while c > slowest + τ and sent when the slowest clock rises
//! enough.
//!
//! Per rank r, with a[r] its applied clock:
//! 1. a ROW_PUSH of clock c <= a[r], or of c = a[r] + 1 with s in `got[r]`:
//!    answered with the message's ids and their current rows, not applied;
//! 2. a ROW_PUSH of c = a[r] + 1, s new, r's ROW_DONE not held: each pair
//!    applied in order (the table's optimizer with the pair's row alone as
//!    its gradient), s joins `got[r]`, the ROW_RESULT goes at once
//!    (s >= 1024 or >= `n[r]`: `bad_row_count`);
//! 3. a ROW_END of c <= a[r]: its ROW_DONE again (`duplicate` while r's is
//!    held); of c = a[r] + 1: `n[r]` as in BSP, but an empty one (n = 0)
//!    while the lcore holds part of the clock (pushes in `got[r]`, or a
//!    count other than 0, restored from a checkpoint) closes the clock
//!    with what it holds;
//! 4. anything else (c > a[r] + 1, c = a[r] + 1 while held, c >= 2^31):
//!    `ahead`.
//!
//! The store's round (its idle eviction's clock) advances each time the
//! slowest clock over the ranks rises.

use phub_proto::rows::{RowMsgType, RowPayload, RowRepr, MAX_ROW_MESSAGES};
use phub_proto::wire::DropReason;

use super::rows::{end_round, AnswerTo, Answers};
use super::table::{Table, TableRounds};
use super::Verdict;

/// Clocks at or above this are `ahead` (bit 31 is kept free, as for a
/// dense chunk's clocks).
const CLOCK_LIMIT: u32 = 1 << 31;

impl Table {
    /// The async and bounded-delay rules of a ROW_PUSH or ROW_END (module
    /// head).
    pub(super) fn clocked<A: Copy>(
        &mut self,
        repr: &RowRepr,
        payload: &RowPayload<'_>,
        answers: &mut Answers<'_, A>,
    ) -> Result<Verdict, DropReason> {
        let TableRounds::Clocked { delay } = self.rounds else {
            unreachable!("clocked() is called for tables that are not BSP");
        };
        let r = usize::from(repr.rank);
        let (c, s) = (repr.round, repr.seq);
        let rank = self.ranks[r];
        let next = rank.applied + 1;
        if c >= CLOCK_LIMIT {
            return Err(DropReason::Ahead);
        }
        match repr.kind {
            RowMsgType::RowPush => {
                let RowPayload::Rows(rows) = payload else {
                    return Err(DropReason::LengthMismatch);
                };
                if c <= rank.applied || (c == next && rank.got.contains(s)) {
                    self.answer_push(repr, rows.ids().iter(), answers);
                    return Ok(Verdict::Resent);
                }
                if c != next || rank.held.is_some() {
                    return Err(DropReason::Ahead);
                }
                if s >= MAX_ROW_MESSAGES || rank.n.is_some_and(|n| s >= u32::from(n)) {
                    return Err(DropReason::BadRowCount);
                }
                // Decoded whole, then applied through the store's
                // pipeline (their index entries and rows fetched ahead),
                // the rows after it copied into the answer as they are
                // updated.
                self.batch.ids.clear();
                self.batch.ids.extend(rows.ids().iter());
                self.batch.decode_grads(rows, self.dim as usize);
                let to = AnswerTo::reply(repr, RowMsgType::RowResult, repr.round);
                answers.rows_after_push(&mut self.store, &mut self.batch, to);
                self.ranks[r].got.insert(s);
                Ok(self
                    .maybe_complete(repr.rank, c, delay, answers)
                    .unwrap_or(Verdict::Applied))
            }
            _ => {
                if c <= rank.applied {
                    if rank.held.is_some() {
                        return Err(DropReason::Duplicate);
                    }
                    // Cast: a count of a completed clock was <= 1024.
                    #[allow(clippy::cast_possible_truncation)]
                    answers.done(repr.rank, c, s.min(MAX_ROW_MESSAGES) as u16);
                    return Ok(Verdict::Resent);
                }
                if c != next || rank.held.is_some() {
                    return Err(DropReason::Ahead);
                }
                if s == 0 && rank.holds_part() {
                    // An empty clock (a worker catching a restored lcore
                    // up, PROTOCOL.md §10.6) over a part of the rank's
                    // clock in progress that the checkpoint held: the
                    // clock closes with what was taken, as a BSP round's
                    // part does.
                    self.ranks[r].closed = true;
                } else {
                    end_round(&mut self.ranks[r], s)?;
                }
                Ok(self
                    .maybe_complete(repr.rank, c, delay, answers)
                    .unwrap_or(Verdict::Aggregated))
            }
        }
    }

    /// A ROW_RESULT (c, s) of a push with these ids, their rows as now.
    fn answer_push<A: Copy>(
        &mut self,
        repr: &RowRepr,
        ids: impl Iterator<Item = u64>,
        answers: &mut Answers<'_, A>,
    ) {
        let to = AnswerTo::reply(repr, RowMsgType::RowResult, repr.round);
        answers.rows(&mut self.store, &mut self.batch, to, ids);
    }

    /// Rank `rank`'s clock `c` completes if its ROW_END and every push it
    /// counts are in: a[r] = c, its ROW_DONE goes (or, in bounded delay
    /// beyond slowest + τ, is held), and held ones the slowest clock's rise
    /// allows go too. `None` when the clock is not complete yet.
    fn maybe_complete<A: Copy>(
        &mut self,
        rank: u16,
        c: u32,
        delay: Option<u32>,
        answers: &mut Answers<'_, A>,
    ) -> Option<Verdict> {
        let r = usize::from(rank);
        if !self.ranks[r].complete() {
            return None;
        }
        let before = self.slowest();
        let n = self.ranks[r].n.unwrap_or(0);
        self.ranks[r].clear_round();
        self.ranks[r].applied = c;
        let slowest = self.slowest();
        let verdict = match delay {
            Some(tau) if u64::from(c) > u64::from(slowest) + u64::from(tau) => {
                self.ranks[r].held = Some(n);
                Verdict::Held
            }
            _ => {
                answers.done(rank, c, n);
                Verdict::Completed
            }
        };
        if slowest > before {
            self.store.advance_round_at(answers.now);
            if let Some(tau) = delay {
                // Cast: q < W <= 256.
                #[allow(clippy::cast_possible_truncation)]
                for (q, other) in self.ranks.iter_mut().enumerate() {
                    if let Some(n) = other.held {
                        if u64::from(other.applied) <= u64::from(slowest) + u64::from(tau) {
                            other.held = None;
                            answers.done(q as u16, other.applied, n);
                        }
                    }
                }
            }
        }
        Some(verdict)
    }
}
