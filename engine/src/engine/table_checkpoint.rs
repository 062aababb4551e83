//! A job's tables in a checkpoint (PROTOCOL.md §10.6): what each (table,
//! lcore) saves ([`Shard::snapshot_tables`], a copy; or streamed while the
//! lcore goes on serving, [`Shard::stream_tables_begin`] and
//! [`Shard::stream_tables_fill`]) and putting it back
//! ([`Shard::restore_tables`]; or away from the lcore, a table at a time
//! as a checkpoint streams in, [`RestoredTable::read`], which the lcore
//! then takes in whole, [`Shard::install_restored`]).
//!
//! A stream: at its start every table of the job on this lcore has its
//! round state taken and its store's stream begun (copy on write,
//! `crate::table::snapshot`), so the bytes are this lcore's tables'
//! section of a checkpoint file (`phub_proto::table_checkpoint`'s
//! format) as they were at that instant, as [`Shard::snapshot_tables`]
//! would have saved them then; they come a slice at a time, between
//! bursts. One stream per lcore at a time. A job removed (or removed and
//! installed again) during its stream ends it with
//! [`TablesStreamError::Gone`].
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

use phub_proto::table_checkpoint::{self as format, RankClockState, TableRoundsState, TableState};

use crate::table::snapshot::StreamError;

use super::error::EngineError;
use super::table::{RowRank, SeqSet, Table, TableRounds};
use super::Shard;

impl Table {
    /// This (table, lcore)'s state for a checkpoint. Allocates (the rows,
    /// O(rows stored)).
    pub(super) fn save(&self) -> TableState {
        // Cast: the bytes are written into memory, so they fit a usize.
        #[allow(clippy::cast_possible_truncation)]
        let mut rows = Vec::with_capacity(self.store.checkpoint_bytes() as usize);
        let written = self.store.write_to(&mut rows);
        debug_assert!(written.is_ok(), "writing into a Vec does not fail");
        TableState {
            key: self.key,
            rounds: self.rounds_state(),
            rows: rows.into(),
        }
    }

    /// Where this (table, lcore)'s rounds stand, as a checkpoint keeps it.
    fn rounds_state(&self) -> TableRoundsState {
        match &self.rounds {
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
        }
    }

    /// Why `st` does not fit this table, if it does not.
    fn misfit(&self, st: &TableState) -> Option<String> {
        self.misfit_rounds(st.key, &st.rounds)
    }

    /// Why a state of table `key` with `rounds` does not fit this table,
    /// if it does not.
    fn misfit_rounds(&self, key: u32, rounds: &TableRoundsState) -> Option<String> {
        if key != self.key {
            return Some(format!("state of key {key} for table key {}", self.key));
        }
        if self.store.rows_stored() != 0 {
            return Some(format!("table key {} already holds rows", self.key));
        }
        match (&self.rounds, rounds) {
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
        self.load_from(&st.rounds, &st.rows[..])
    }

    /// Puts `rounds` (which fit) back, then the row store read from `rows`.
    fn load_from(&mut self, rounds: &TableRoundsState, rows: impl std::io::Read) -> Result<(), String> {
        let d = self.dim as usize;
        match (&mut self.rounds, rounds) {
            (TableRounds::Bsp(b), TableRoundsState::Bsp { completed }) => {
                b.clear(d);
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
            .read_into(rows)
            .map_err(|e| format!("table key {}: {e}", self.key))
    }
}

/// A table of a job made and filled away from its lcore: installed as an
/// install makes it, then its round state and rows read from a
/// checkpoint as they stream (`phub_proto::checkpoint::Restoring`), so
/// that no copy of the file is held and the lcore, which only takes the
/// table in ([`Shard::install_restored`]), goes on serving meanwhile.
pub struct RestoredTable {
    /// The job it was made for, and its W.
    id: u16,
    workers: u16,
    table: Table,
    /// What the lcore was told of the table (a replicated job's backup
    /// tables are made from it).
    install: super::TableInstall,
}

impl std::fmt::Debug for RestoredTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoredTable")
            .field("id", &self.id)
            .field("key", &self.table.key)
            .field("rows", &self.table.store.rows_stored())
            .finish_non_exhaustive()
    }
}

impl RestoredTable {
    /// Table `t` of job `id` (W `workers`, its dtype and consistency, as
    /// its [`super::JobInstall`] says) holding the saved `rounds` and the
    /// row store checkpoint read from `rows` (all of it, checked as
    /// [`Shard::restore_tables`] checks a saved table).
    pub fn read(
        id: u16,
        workers: u16,
        dtype: phub_proto::Dtype,
        consistency: phub_proto::spec::Consistency,
        t: &super::TableInstall,
        rounds: &TableRoundsState,
        rows: impl std::io::Read,
    ) -> Result<RestoredTable, EngineError> {
        let mut table = Table::new(id, t, workers, dtype, consistency)?;
        let refuse = |reason: String| EngineError::Restore { id, reason };
        if let Some(why) = table.misfit_rounds(t.key, rounds) {
            return Err(refuse(why));
        }
        table.load_from(rounds, rows).map_err(refuse)?;
        Ok(RestoredTable {
            id,
            workers,
            table,
            install: t.clone(),
        })
    }

    /// What the lcore was told of the table.
    pub(super) fn install(&self) -> &super::TableInstall {
        &self.install
    }

    /// The table's key.
    pub fn key(&self) -> u32 {
        self.table.key
    }

    /// Rows it holds.
    pub fn rows_stored(&self) -> u64 {
        self.table.store.rows_stored()
    }

    /// The table, checked to be of job `id` with W `workers`.
    pub(super) fn into_table(self, id: u16, workers: u16) -> Result<Table, EngineError> {
        if (self.id, self.workers) != (id, workers) {
            return Err(EngineError::Table {
                id,
                key: self.table.key,
                reason: format!(
                    "restored for job {} of {} workers, installed as job {id} of {workers}",
                    self.id, self.workers
                ),
            });
        }
        Ok(self.table)
    }
}

/// A stream of one job's tables on an lcore (module head).
#[derive(Debug)]
pub(super) struct TablesStream {
    job: u16,
    /// The tables streamed, by (key, entry), in key order: found again at
    /// each fill (a replicated lcore's own entry's tables move between
    /// its backup tables and its served ones when it adopts its entry).
    tables: Vec<(u32, u32)>,
    /// What precedes each table's store bytes (its key, rounds and the
    /// length of its store's checkpoint), in key order; the table count
    /// before the first.
    heads: Vec<Vec<u8>>,
    /// The table being streamed, and whether its head is written.
    next: usize,
    head_written: bool,
    /// The most its stores kept at once so far (at the start of a fill).
    kept: StreamKept,
}

/// What copy on write kept for a stream of a job's tables on an lcore, at
/// most at once (as seen at the start of each slice): the rows and index
/// entries changed after the stream's start before it passed them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamKept {
    /// Index entries kept (an id, its slot and touch word each).
    pub entries: usize,
    /// Bytes of rows (values and optimizer state) kept.
    pub row_bytes: usize,
}

/// Why a stream of a job's tables did not start or cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TablesStreamError {
    /// The job is not installed on this lcore.
    #[error("job {0} is not installed on this lcore")]
    NotInstalled(u16),
    /// A stream of this lcore's tables is in progress.
    #[error("a checkpoint of job {0}'s tables is being streamed on this lcore; one at a time")]
    Busy(u16),
    /// No stream is in progress.
    #[error("no checkpoint of tables is being streamed on this lcore")]
    NotStarted,
    /// The job was removed during its stream.
    #[error("job {0} was removed while its tables' checkpoint was being streamed")]
    Gone(u16),
    /// A table's store could not stream (the stream is ended).
    #[error("table key {key} of job {job}: {source}")]
    Store {
        /// The job.
        job: u16,
        /// The table's key index.
        key: u32,
        /// The store's reason.
        source: StreamError,
    },
    /// The section does not fit the file format's fields.
    #[error("job {job}: {reason}")]
    Format {
        /// The job.
        job: u16,
        /// The format's reason.
        reason: String,
    },
}

impl<A: Copy + Eq> Shard<A> {
    /// Start streaming job `id`'s tables on this lcore as they are now
    /// (module head); returns the bytes of the section. The lcore goes on
    /// serving; [`Shard::stream_tables_fill`] produces the bytes. A job
    /// without tables streams its table count alone.
    pub fn stream_tables_begin(&mut self, id: u16) -> Result<u64, TablesStreamError> {
        if let Some(s) = &self.tables_stream {
            return Err(TablesStreamError::Busy(s.job));
        }
        let j = self
            .jobs
            .iter_mut()
            .find(|j| j.id == id)
            .ok_or(TablesStreamError::NotInstalled(id))?;
        let format_err = |e: phub_proto::checkpoint::CheckpointError| TablesStreamError::Format {
            job: id,
            reason: e.to_string(),
        };
        let which = j
            .checkpoint_tables()
            .map_err(|reason| TablesStreamError::Format { job: id, reason })?;
        // Every head first (the format's checks, no side effect), then
        // every store's stream: a store that cannot begin ends those begun.
        let mut first = Vec::new();
        format::encode_count(&mut first, which.len()).map_err(format_err)?;
        let mut heads = Vec::with_capacity(which.len().max(1));
        let mut total = 0u64;
        for t in which.iter().filter_map(|&(k, e)| j.table_at(k, e)) {
            let rows = t.store.checkpoint_bytes();
            let mut head = if heads.is_empty() {
                std::mem::take(&mut first)
            } else {
                Vec::new()
            };
            format::encode_head(&mut head, t.key, &t.rounds_state(), rows).map_err(format_err)?;
            total += head.len() as u64 + rows;
            heads.push(head);
        }
        if heads.is_empty() {
            // A job without tables: its count alone.
            total = first.len() as u64;
            heads.push(first);
        }
        // A state copy streaming from a store gives it up (made whole).
        j.finish_copy_streams();
        for (i, &(k, e)) in which.iter().enumerate() {
            let Some(t) = j.table_at_mut(k, e) else {
                continue;
            };
            if let Err(source) = t.store.stream_begin() {
                for &(k, e) in &which[..i] {
                    if let Some(t) = j.table_at_mut(k, e) {
                        t.store.stream_abort();
                    }
                }
                return Err(TablesStreamError::Store {
                    job: id,
                    key: k,
                    source,
                });
            }
        }
        self.tables_stream = Some(TablesStream {
            job: id,
            tables: which,
            heads,
            next: 0,
            head_written: false,
            kept: StreamKept::default(),
        });
        self.tables_stream_kept = StreamKept::default();
        Ok(total)
    }

    /// Append the stream's next bytes to `out` (about `max` of them, at
    /// least one row); true when the section is complete (the stream is
    /// then over). An error ends the stream.
    pub fn stream_tables_fill(&mut self, out: &mut Vec<u8>, max: usize) -> Result<bool, TablesStreamError> {
        let mut s = self.tables_stream.take().ok_or(TablesStreamError::NotStarted)?;
        let Some(j) = self.jobs.iter_mut().find(|j| j.id == s.job) else {
            return Err(TablesStreamError::Gone(s.job));
        };
        let start = out.len();
        let now =
            s.tables
                .iter()
                .filter_map(|&(k, e)| j.table_at(k, e))
                .fold(StreamKept::default(), |kept, t| {
                    let (entries, row_bytes) = t.store.stream_kept();
                    StreamKept {
                        entries: kept.entries + entries,
                        row_bytes: kept.row_bytes + row_bytes,
                    }
                });
        s.kept.entries = s.kept.entries.max(now.entries);
        s.kept.row_bytes = s.kept.row_bytes.max(now.row_bytes);
        self.tables_stream_kept = s.kept;
        loop {
            if !s.head_written {
                out.extend_from_slice(&s.heads[s.next]);
                s.head_written = true;
            }
            let Some(&(k, e)) = s.tables.get(s.next) else {
                // A job without tables: its count alone.
                return Ok(true);
            };
            let Some(t) = j.table_at_mut(k, e).filter(|t| t.store.streaming()) else {
                // Removed and installed again: not the tables begun.
                return Err(TablesStreamError::Gone(s.job));
            };
            let budget = max.saturating_sub(out.len() - start).max(1);
            let done = t
                .store
                .stream_fill(out, budget)
                .map_err(|source| TablesStreamError::Store {
                    job: s.job,
                    key: t.key,
                    source,
                });
            match done {
                Err(err) => {
                    for &(k, e) in &s.tables[s.next..] {
                        if let Some(t) = j.table_at_mut(k, e) {
                            t.store.stream_abort();
                        }
                    }
                    return Err(err);
                }
                Ok(false) => {
                    self.tables_stream = Some(s);
                    return Ok(false);
                }
                Ok(true) if s.next + 1 == s.tables.len() => return Ok(true),
                Ok(true) => {
                    s.next += 1;
                    s.head_written = false;
                    if out.len() - start >= max {
                        self.tables_stream = Some(s);
                        return Ok(false);
                    }
                }
            }
        }
    }

    /// What copy on write kept for the stream in progress, or the last one
    /// (at most at once, [`StreamKept`]).
    pub fn stream_tables_kept(&self) -> StreamKept {
        self.tables_stream_kept
    }

    /// End the stream in progress, if any (its job's stores free what
    /// they kept).
    pub fn stream_tables_abort(&mut self) {
        let Some(s) = self.tables_stream.take() else {
            return;
        };
        if let Some(j) = self.jobs.iter_mut().find(|j| j.id == s.job) {
            for &(k, e) in &s.tables {
                if let Some(t) = j.table_at_mut(k, e) {
                    t.store.stream_abort();
                }
            }
        }
    }

    /// The job whose tables are being streamed, if any.
    pub fn tables_streaming(&self) -> Option<u16> {
        self.tables_stream.as_ref().map(|s| s.job)
    }

    /// Whether row `row` of the table of key index `key` of job `id` is
    /// stored on this lcore (admitted, and not evicted since); `None` when
    /// the job or the table is not here. For tests and the simulator,
    /// which check admission and eviction against a model.
    pub fn row_stored(&self, id: u16, key: u32, row: u64) -> Option<bool> {
        let tables = &self.job(id)?.tables;
        // Where an lcore serves an adopted entry beside its own (PROTOCOL.md
        // §11.9), the table whose placement holds the row.
        let t = tables
            .iter()
            .find(|t| t.key == key && t.holds(row))
            .or_else(|| tables.iter().find(|t| t.key == key))?;
        Some(t.store.get(row).is_some())
    }

    /// The table of key index `key` of job `id` on this lcore: its row cap
    /// here, the rows it stores and the rows it evicted at the cap so far;
    /// `None` when the job or the table is not here. For tests and the
    /// simulator, which check eviction at the cap against a model.
    pub fn row_cap_count(&self, id: u16, key: u32) -> Option<(u64, u64, u64)> {
        let t = self.job(id)?.tables.iter().find(|t| t.key == key)?;
        let s = t.store.stats();
        Some((t.store.config().rows_cap, s.rows_stored, s.evicted_cap))
    }

    /// The ids the table of key index `key` of job `id` evicted at the
    /// cap since the last call, in order (feature `eviction-log`: the
    /// simulator's model replays them); `None` when the job or the table
    /// is not here.
    #[cfg(feature = "eviction-log")]
    pub fn take_cap_victims(&mut self, id: u16, key: u32) -> Option<Vec<u64>> {
        let j = self.jobs.iter_mut().find(|j| j.id == id)?;
        let t = j.tables.iter_mut().find(|t| t.key == key)?;
        Some(t.store.take_cap_victims())
    }

    /// The durable state of every table of job `id` on this lcore, in key
    /// order (module head); in a replicated job, those of this lcore's own
    /// entry alone (PROTOCOL.md §11.9: served here, or kept as backup
    /// tables where its appliance came back), never an adopted entry's.
    /// `None` when the job is not installed, or its own entry's tables
    /// await their state copy.
    /// Allocates (O(rows stored)); call between bursts.
    pub fn snapshot_tables(&self, id: u16) -> Option<Vec<TableState>> {
        let j = self.job(id)?;
        let which = j.checkpoint_tables().ok()?;
        Some(
            which
                .iter()
                .filter_map(|&(k, e)| j.table_at(k, e))
                .map(Table::save)
                .collect(),
        )
    }

    /// Puts job `id`'s tables back as [`Shard::snapshot_tables`] saved
    /// them, onto a job just installed (a replicated job's: its own
    /// entry's, whose copies to its backups then start, PROTOCOL.md §11.9). `state` empty: nothing saved (a
    /// checkpoint of format 1 or 2), the tables stay empty. Every table's
    /// shape is checked before any changes; a store that then fails to
    /// read is an error after which the job is to be removed.
    pub fn restore_tables(&mut self, id: u16, state: &[TableState]) -> Result<(), EngineError> {
        let i = self
            .jobs
            .iter()
            .position(|j| j.id == id)
            .ok_or(EngineError::Restore {
                id,
                reason: "the job is not installed".into(),
            })?;
        let j = &mut self.jobs[i];
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
        self.start_restored_copies(i);
        Ok(())
    }
}
