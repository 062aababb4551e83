//! A job's tables in a checkpoint file (PROTOCOL.md §10.6): per lcore, the
//! state of each (table, lcore), in the order of the spec's table keys,
//! after the slots of every lcore ([`crate::checkpoint`], format version 3).
//!
//! Per table, all integers little-endian:
//!
//! | bytes | what |
//! | --- | --- |
//! | 4 | the table's key index k |
//! | 4 | 0: BSP; 1: async or bounded delay |
//! | BSP: 4 | the last completed round c |
//! | not BSP: 4 | W, the ranks that follow |
//! | not BSP, per rank: 4 | its applied clock a[r] |
//! | not BSP, per rank: 4 | `n[r]`, the count its ROW_END of clock a[r] + 1 stated, `0xffffffff` for none |
//! | not BSP, per rank: 4 | the count of its held ROW_DONE (bounded delay), `0xffffffff` for none |
//! | not BSP, per rank: 128 | `got[r]`: the bitmap of its ROW_PUSH sequence numbers of clock a[r] + 1, 16 u64 words, bit s of word s / 64 |
//! | 8 | length B of the row store's checkpoint that follows |
//! | B | the row store's checkpoint (its stored rows, their optimizer state, its round, touch words, hands and admission counters: `engine/src/table/checkpoint.rs`'s format, checked by the engine) |
//!
//! A BSP table's round in progress is not saved: its pushes were not
//! answered, their senders resend them (§10.3). An async table's pushes of
//! a clock in progress were applied and answered when they came: the
//! `got[r]` bits say so, and the rows they changed are in the store.

use crate::checkpoint::CheckpointError;
use crate::rows::MAX_ROW_MESSAGES;
use crate::spec::{Consistency, JobSpec};

/// Words of a `got[r]` bitmap: one bit per sequence number below
/// [`MAX_ROW_MESSAGES`].
pub const GOT_WORDS: usize = MAX_ROW_MESSAGES as usize / 64;

/// A saved count that is absent.
const NONE: u32 = u32::MAX;

/// One (table, lcore)'s durable state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableState {
    /// The table's key index k in the spec's keys.
    pub key: u32,
    /// Its rounds (BSP) or its ranks' clocks.
    pub rounds: TableRoundsState,
    /// The row store's checkpoint, as the engine wrote it (empty where a
    /// streamed restore handed it on, `Checkpoint::restore_from`).
    pub rows: bytes::Bytes,
}

/// Where a (table, lcore)'s rounds stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableRoundsState {
    /// BSP: the last completed round (0: none yet).
    Bsp {
        /// c.
        completed: u32,
    },
    /// Async or bounded delay: each rank's clock state, W of them.
    Clocked {
        /// Per rank.
        ranks: Vec<RankClockState>,
    },
}

/// One rank's clock on a (table, lcore) of a job that is not BSP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankClockState {
    /// a[r], its applied clock.
    pub applied: u32,
    /// `n[r]` of clock a[r] + 1.
    pub n: Option<u16>,
    /// The count of its held ROW_DONE (bounded delay).
    pub held: Option<u16>,
    /// `got[r]` of clock a[r] + 1.
    pub got: [u64; GOT_WORDS],
}

fn put(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn count(c: Option<u16>) -> u32 {
    c.map_or(NONE, u32::from)
}

/// Appends `tables` (one lcore's) to `out`.
pub(crate) fn encode(out: &mut Vec<u8>, tables: &[TableState]) -> Result<(), CheckpointError> {
    encode_count(out, tables.len())?;
    for t in tables {
        encode_head(out, t.key, &t.rounds, t.rows.len() as u64)?;
        out.extend_from_slice(&t.rows);
    }
    Ok(())
}

/// Appends an lcore's table count T, the first field of its tables
/// (module head), to `out`.
pub fn encode_count(out: &mut Vec<u8>, tables: usize) -> Result<(), CheckpointError> {
    put(
        out,
        u32::try_from(tables).map_err(|_| CheckpointError::TooLarge {
            what: "a table count",
            len: tables,
        })?,
    );
    Ok(())
}

/// Appends what comes before a (table, lcore)'s row store checkpoint
/// (module head: key, rounds, its length `rows_len`) to `out`, so that
/// the row store's bytes can follow as they are produced.
pub fn encode_head(
    out: &mut Vec<u8>,
    key: u32,
    rounds: &TableRoundsState,
    rows_len: u64,
) -> Result<(), CheckpointError> {
    put(out, key);
    match rounds {
        TableRoundsState::Bsp { completed } => {
            put(out, 0);
            put(out, *completed);
        }
        TableRoundsState::Clocked { ranks } => {
            put(out, 1);
            put(
                out,
                u32::try_from(ranks.len()).map_err(|_| CheckpointError::TooLarge {
                    what: "a rank count",
                    len: ranks.len(),
                })?,
            );
            for r in ranks {
                put(out, r.applied);
                put(out, count(r.n));
                put(out, count(r.held));
                for w in r.got {
                    out.extend_from_slice(&w.to_le_bytes());
                }
            }
        }
    }
    out.extend_from_slice(&rows_len.to_le_bytes());
    Ok(())
}

/// What [`decode`] reads from: a file in memory, or one streamed
/// (`crate::checkpoint::scan`), which keeps no values.
pub(crate) trait Source {
    /// The next `n` bytes (a field, not values: a few bytes).
    fn take(&mut self, n: usize) -> Result<&[u8], CheckpointError>;
    /// The next `n` bytes of values, or nothing for a source that keeps
    /// none (they are read past, and checked by the CRC).
    fn values(&mut self, n: usize) -> Result<Vec<u8>, CheckpointError>;
    /// The next `n` bytes: lcore `l`'s table `key`'s row store checkpoint
    /// (after its `rounds`): a slice of the file where the source shares
    /// it, a copy where it does not, nothing for a source that keeps no
    /// values or hands them on as they stream.
    fn rows(
        &mut self,
        l: usize,
        key: u32,
        rounds: &TableRoundsState,
        n: usize,
    ) -> Result<bytes::Bytes, CheckpointError>;
    /// Bytes left, or a bound on what to allocate ahead when unknown.
    fn left(&self) -> usize;
    fn u32(&mut self) -> Result<u32, CheckpointError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, CheckpointError> {
        let s = self.take(8)?;
        let mut b = [0u8; 8];
        b.copy_from_slice(s);
        Ok(u64::from_le_bytes(b))
    }
}

/// Reads lcore `l`'s tables of a job of `spec`, checking them against it:
/// every table key of the spec, in order, in the spec's consistency mode
/// with its W ranks; counts at most [`MAX_ROW_MESSAGES`].
pub(crate) fn decode(
    r: &mut impl Source,
    spec: &JobSpec,
    l: usize,
) -> Result<Vec<TableState>, CheckpointError> {
    let mismatch = |what: String| CheckpointError::Mismatch(format!("lcore {l}: {what}"));
    let keys: Vec<u32> = spec.tables().map(|t| t.key).collect();
    let n = r.u32()? as usize;
    if n != keys.len() {
        return Err(mismatch(format!(
            "{n} tables saved, the spec has {} table keys",
            keys.len()
        )));
    }
    let bsp = spec.consistency == Consistency::Sync;
    let mut tables = Vec::with_capacity(n);
    for &want in &keys {
        let key = r.u32()?;
        if key != want {
            return Err(mismatch(format!(
                "a table saved as key {key}, the spec's next table key is {want}"
            )));
        }
        let kind = r.u32()?;
        let rounds = match (kind, bsp) {
            (0, true) => TableRoundsState::Bsp { completed: r.u32()? },
            (1, false) => {
                let w = r.u32()?;
                if w != spec.workers {
                    return Err(mismatch(format!(
                        "table {key}: {w} rank clocks saved, the job has {} workers",
                        spec.workers
                    )));
                }
                let mut ranks = Vec::new();
                for rank in 0..w {
                    let applied = r.u32()?;
                    let mut counts = [None; 2];
                    for (c, what) in counts.iter_mut().zip(["ROW_END count", "held ROW_DONE count"]) {
                        *c = match r.u32()? {
                            NONE => None,
                            v if v <= MAX_ROW_MESSAGES => Some(u16::try_from(v).unwrap_or(u16::MAX)),
                            v => {
                                return Err(mismatch(format!(
                                    "table {key} rank {rank}: {what} {v}, accepted 0 to {MAX_ROW_MESSAGES} or none"
                                )))
                            }
                        };
                    }
                    let mut got = [0u64; GOT_WORDS];
                    for g in &mut got {
                        *g = r.u64()?;
                    }
                    ranks.push(RankClockState {
                        applied,
                        n: counts[0],
                        held: counts[1],
                        got,
                    });
                }
                TableRoundsState::Clocked { ranks }
            }
            (k, _) => {
                return Err(mismatch(format!(
                    "table {key} saved with rounds of kind {k} (0: BSP, 1: clocks); the job is {}",
                    spec.consistency.mode()
                )))
            }
        };
        let len = r.u64()?;
        let len = usize::try_from(len).map_err(|_| mismatch(format!("table {key}: {len} bytes of rows")))?;
        let rows = r.rows(l, key, &rounds, len)?;
        tables.push(TableState { key, rounds, rows });
    }
    Ok(tables)
}
