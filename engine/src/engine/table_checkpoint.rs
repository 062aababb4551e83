//! A job's tables in a checkpoint (PROTOCOL.md §10.6): what each (table,
//! lcore) saves ([`Shard::snapshot_tables`]) and putting it back
//! ([`Shard::restore_tables`]).
//!
//! Saved per table: its row store (stored rows, optimizer state, the
//! store's round, touch words, eviction hands and admission counters, in
//! the store's own format, `crate::table::checkpoint`) and its round state:
//! BSP, the last completed round (the round in progress is not saved: no
//! rank got an answer of it, each resends its messages, §10.3); async and
//! bounded delay, each rank's applied clock, `got[r]` and `n[r]` of the
//! clock in progress and its held ROW_DONE (pushes of a clock in progress
//! were applied and answered as they came: the store holds what they did,
//! `got[r]` that they were taken).
//!
//! Invariants checked when restoring, before anything changes: one state
//! per table of the job on this lcore, in key order, of the job's
//! consistency mode and W; `got[r]` holds no sequence number at or above
//! `n[r]`; a held ROW_DONE only in bounded delay, with `got[r]` and `n[r]`
//! empty. Each table's store is read into the freshly installed (empty)
//! store; a store that fails to read leaves the job to be removed (the
//! lcore removes a job whose restore failed).

use phub_proto::table_checkpoint::{RankClockState, TableRoundsState, TableState};

use super::error::EngineError;
use super::table::{RowRank, SeqSet, Table, TableRounds};
use super::Shard;

impl Table {
    /// This (table, lcore)'s state for a checkpoint. Allocates (the rows,
    /// O(rows stored)).
    fn save(&self) -> TableState {
        let rounds = match &self.rounds {
            TableRounds::Bsp(b) => TableRoundsState::Bsp {
                completed: b.completed,
            },
            TableRounds::Clocked { .. } => TableRoundsState::Clocked {
                ranks: self
                    .ranks
                    .iter()
                    .map(|r| RankClockState {
                        applied: r.applied,
                        n: r.n,
                        held: r.held,
                        got: r.got.words(),
                    })
                    .collect(),
            },
        };
        // Cast: the bytes are written into memory, so they fit a usize.
        #[allow(clippy::cast_possible_truncation)]
        let mut rows = Vec::with_capacity(self.store.checkpoint_bytes() as usize);
        let written = self.store.write_to(&mut rows);
        debug_assert!(written.is_ok(), "writing into a Vec does not fail");
        TableState {
            key: self.key,
            rounds,
            rows,
        }
    }

    /// Why `st` does not fit this table, if it does not.
    fn misfit(&self, st: &TableState) -> Option<String> {
        if st.key != self.key {
            return Some(format!("state of key {} for table key {}", st.key, self.key));
        }
        if self.store.rows_stored() != 0 {
            return Some(format!("table key {} already holds rows", self.key));
        }
        match (&self.rounds, &st.rounds) {
            (TableRounds::Bsp(_), TableRoundsState::Bsp { .. }) => None,
            (TableRounds::Clocked { delay }, TableRoundsState::Clocked { ranks }) => {
                if ranks.len() != self.ranks.len() {
                    return Some(format!(
                        "table key {}: {} rank clocks saved, {} ranks installed",
                        self.key,
                        ranks.len(),
                        self.ranks.len()
                    ));
                }
                ranks.iter().enumerate().find_map(|(r, s)| {
                    let got = SeqSet::from_words(s.got);
                    let bad = if s.n.is_some_and(|n| got.any_at_or_above(u32::from(n))) {
                        "a ROW_PUSH sequence number at or above its ROW_END count"
                    } else if s.held.is_some() && delay.is_none() {
                        "a held ROW_DONE in async (only bounded delay holds one)"
                    } else if s.held.is_some() && (s.n.is_some() || got.len() > 0) {
                        "a held ROW_DONE beside a clock in progress"
                    } else {
                        return None;
                    };
                    Some(format!("table key {} rank {r}: {bad}", self.key))
                })
            }
            (TableRounds::Bsp(_), TableRoundsState::Clocked { .. }) => Some(format!(
                "table key {}: rank clocks saved for a BSP table",
                self.key
            )),
            (TableRounds::Clocked { .. }, TableRoundsState::Bsp { .. }) => Some(format!(
                "table key {}: a BSP round saved for a table that is not BSP",
                self.key
            )),
        }
    }

    /// Puts `st` (which fits) back: rounds first, then the rows.
    fn load(&mut self, st: &TableState) -> Result<(), String> {
        match (&mut self.rounds, &st.rounds) {
            (TableRounds::Bsp(b), TableRoundsState::Bsp { completed }) => {
                b.clear();
                b.completed = *completed;
                for r in &mut self.ranks {
                    r.clear_round();
                }
            }
            (TableRounds::Clocked { .. }, TableRoundsState::Clocked { ranks }) => {
                for (r, s) in self.ranks.iter_mut().zip(ranks) {
                    *r = RowRank {
                        got: SeqSet::from_words(s.got),
                        n: s.n,
                        applied: s.applied,
                        held: s.held,
                        closed: false,
                    };
                }
            }
            _ => unreachable!("misfit() checked the rounds' kind"),
        }
        self.store
            .read_into(&st.rows[..])
            .map_err(|e| format!("table key {}: {e}", self.key))
    }
}

impl<A: Copy + Eq> Shard<A> {
    /// The durable state of every table of job `id` on this lcore, in key
    /// order (module head); `None` when the job is not installed.
    /// Allocates (O(rows stored)); call between bursts.
    pub fn snapshot_tables(&self, id: u16) -> Option<Vec<TableState>> {
        let j = self.job(id)?;
        Some(j.tables.iter().map(Table::save).collect())
    }

    /// Puts job `id`'s tables back as [`Shard::snapshot_tables`] saved
    /// them, onto a job just installed. `state` empty: nothing saved (a
    /// checkpoint of format 1 or 2), the tables stay empty. Every table's
    /// shape is checked before any changes; a store that then fails to
    /// read is an error after which the job is to be removed.
    pub fn restore_tables(&mut self, id: u16, state: &[TableState]) -> Result<(), EngineError> {
        let j = self
            .jobs
            .iter_mut()
            .find(|j| j.id == id)
            .ok_or(EngineError::Restore {
                id,
                reason: "the job is not installed".into(),
            })?;
        if state.is_empty() {
            return Ok(());
        }
        let refuse = |reason: String| EngineError::Restore { id, reason };
        if state.len() != j.tables.len() {
            return Err(refuse(format!(
                "{} tables saved, {} installed",
                state.len(),
                j.tables.len()
            )));
        }
        if let Some(why) = j.tables.iter().zip(state).find_map(|(t, st)| t.misfit(st)) {
            return Err(refuse(why));
        }
        for (t, st) in j.tables.iter_mut().zip(state) {
            t.load(st).map_err(refuse)?;
        }
        Ok(())
    }
}
