//! A row store's checkpoint taken while the store goes on serving: the
//! bytes [`RowStore::write_to`] would have written at the moment
//! [`RowStore::stream_begin`] was called, produced a slice at a time by
//! [`RowStore::stream_fill`] between the store's pushes, reads and
//! rounds, without a copy of the table.
//!
//! Copy on write, per index entry and per row slot. From the start on,
//! the first change to an index entry that the stream has not passed yet
//! keeps that entry as it was ([`EntrySnap`], held by the index), and the
//! first write to a row slot that was handed out at the start, before the
//! stream has taken that slot's row, keeps the row as it was ([`RowSnap`],
//! held by the blocks). The stream walks the index in `write_to`'s order
//! (from the first empty entry at the start, wrapping) and at each
//! position takes the kept entry if there is one, else the entry there now
//! (then unchanged since the start), and the row of its slot likewise.
//!
//! Memory while a stream runs: a bit per index entry and per slot handed
//! out, an entry (16 bytes) per index entry changed ahead of the stream
//! and a row per slot written ahead of it (a push to a row not yet
//! streamed, a row created in a slot freed before the start, an eviction),
//! and, with `admit_after`, a copy of the admission counters (2 bytes per
//! row of the cap) taken at the start. Never a copy of the rows that do
//! not change. One stream at a time per store; a store dropped or a
//! stream aborted frees all of it.

use std::collections::HashMap;

use super::checkpoint::{counter_bytes, Checksum, HEADER_BYTES};
use super::index::Entry;
use super::store::RowStore;
use super::{RowInit, RowUpdate};

/// A fixed set of bits, allocated zeroed.
#[derive(Debug)]
pub(crate) struct Bits(Box<[u64]>);

impl Bits {
    /// `n` bits, all clear; `None` when the heap refuses them.
    pub(crate) fn new(n: usize) -> Option<Bits> {
        bytemuck::allocation::try_zeroed_slice_box::<u64>(n.div_ceil(64))
            .ok()
            .map(Bits)
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> bool {
        self.0[i / 64] & (1 << (i % 64)) != 0
    }

    #[inline]
    pub(crate) fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }

    #[inline]
    pub(crate) fn clear(&mut self, i: usize) {
        self.0[i / 64] &= !(1 << (i % 64));
    }

    /// Sets bits `0..n`.
    pub(crate) fn set_first(&mut self, n: usize) {
        let (full, rest) = (n / 64, n % 64);
        self.0[..full].fill(u64::MAX);
        if rest != 0 {
            self.0[full] |= (1 << rest) - 1;
        }
    }
}

/// The index's side of a stream: entries as they were at the start, for
/// the positions changed since then that the stream has not passed.
#[derive(Debug)]
pub(crate) struct EntrySnap {
    /// The position the stream started from (the first empty entry).
    gap: usize,
    /// Positions passed, from `gap` on.
    done: usize,
    /// Positions whose entry at the start is in `side`.
    kept: Bits,
    side: HashMap<usize, Entry>,
}

impl EntrySnap {
    /// A stream over `n` entries from `gap`; `None` when the heap refuses
    /// its bits.
    pub(crate) fn new(n: usize, gap: usize) -> Option<EntrySnap> {
        Some(EntrySnap {
            gap,
            done: 0,
            kept: Bits::new(n)?,
            side: HashMap::new(),
        })
    }

    /// Entry `e` at `pos` (of `n`) is about to change: keep it if the
    /// stream still needs it as it is.
    #[inline]
    pub(crate) fn keep(&mut self, n: usize, pos: usize, e: &Entry) {
        let ahead = (pos + n - self.gap) % n >= self.done;
        if ahead && !self.kept.get(pos) {
            self.kept.set(pos);
            self.side.insert(pos, *e);
        }
    }

    /// The entry at the next position as it was at the start (`current`
    /// reads the entry there now), or `None` once all `n` are passed.
    pub(crate) fn next(&mut self, n: usize, current: impl FnOnce(usize) -> Entry) -> Option<Entry> {
        if self.done == n {
            return None;
        }
        let pos = (self.gap + self.done) % n;
        self.done += 1;
        Some(if self.kept.get(pos) {
            self.side.remove(&pos).expect("a kept position has its entry")
        } else {
            current(pos)
        })
    }

    /// Entries kept now.
    pub(crate) fn kept(&self) -> usize {
        self.side.len()
    }
}

/// The blocks' side of a stream: rows as they were at the start, for the
/// slots written since then whose rows the stream has not taken.
#[derive(Debug)]
pub(crate) struct RowSnap {
    /// Slots handed out at the start whose rows are neither taken nor
    /// kept.
    pending: Bits,
    /// Slot to its row's offset in `rows`.
    side: HashMap<u32, usize>,
    rows: Vec<f32>,
}

impl RowSnap {
    /// A stream over slots `0..slots`; `None` when the heap refuses its
    /// bits.
    pub(crate) fn new(slots: usize) -> Option<RowSnap> {
        let mut pending = Bits::new(slots.max(1))?;
        pending.set_first(slots);
        Some(RowSnap {
            pending,
            side: HashMap::new(),
            rows: Vec::new(),
        })
    }

    /// Row `slot` (now `row`) is about to be written: keep it if the
    /// stream still needs it as it is.
    #[inline]
    pub(crate) fn keep(&mut self, slot: u32, row: &[f32]) {
        let s = slot as usize;
        if s / 64 < self.pending.0.len() && self.pending.get(s) {
            self.pending.clear(s);
            self.side.insert(slot, self.rows.len());
            self.rows.extend_from_slice(row);
        }
    }

    /// Row `slot` as it was at the start (`current` is it now, when it was
    /// not kept); the stream has taken it after this.
    pub(crate) fn take<'a>(&'a mut self, slot: u32, current: &'a [f32]) -> &'a [f32] {
        let s = slot as usize;
        if s / 64 < self.pending.0.len() {
            self.pending.clear(s);
        }
        match self.side.get(&slot) {
            Some(&at) => &self.rows[at..at + current.len()],
            None => current,
        }
    }

    /// Bytes of rows kept now.
    pub(crate) fn kept_bytes(&self) -> usize {
        self.rows.len() * 4
    }
}

/// A stream in progress (module head).
#[derive(Debug)]
pub(crate) struct Stream {
    /// The header, until written.
    head: Option<[u8; HEADER_BYTES]>,
    sum: Checksum,
    /// Rows the header announced, and those not written yet.
    rows: u64,
    rows_left: u64,
    /// The admission counters at the start.
    counters: Option<Vec<u16>>,
    /// Bytes in all, and written so far.
    total: u64,
    written: u64,
}

/// A stream that cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// [`RowStore::stream_begin`] while a stream runs.
    #[error("a checkpoint of this table store is already being streamed")]
    Busy,
    /// [`RowStore::stream_fill`] without a stream.
    #[error("no checkpoint of this table store is being streamed")]
    NotStarted,
    /// The heap refused the stream's bits or counters.
    #[error("the heap refused {bytes} bytes to stream a table store's checkpoint")]
    NoMemory {
        /// What was asked for.
        bytes: u64,
    },
    /// The walk found another number of rows than the start held (a bug:
    /// a change the copy on write missed); the stream is ended, nothing
    /// more of it is written.
    #[error("table store checkpoint stream found {found} rows, {expected} were stored at its start")]
    Inconsistent {
        /// Rows at the start.
        expected: u64,
        /// Rows walked.
        found: u64,
    },
}

impl<I: RowInit, U: RowUpdate> RowStore<I, U> {
    /// Start streaming the store's checkpoint as it is now; returns its
    /// bytes ([`RowStore::checkpoint_bytes`] now). The store goes on
    /// serving; [`RowStore::stream_fill`] produces the bytes.
    pub fn stream_begin(&mut self) -> Result<u64, StreamError> {
        if self.stream.is_some() {
            return Err(StreamError::Busy);
        }
        let n = self.index.capacity();
        let slots = self.handed_out() as usize;
        let bits = (n.div_ceil(64) + slots.div_ceil(64)) as u64 * 8;
        let counters_bytes = self.admit.as_ref().map_or(0, |a| a.counts().len() as u64 * 2);
        let no_memory = StreamError::NoMemory {
            bytes: bits + counters_bytes,
        };
        let gap = self.index.first_gap();
        let entries = EntrySnap::new(n, gap).ok_or(no_memory.clone())?;
        let rows = RowSnap::new(slots).ok_or(no_memory.clone())?;
        let counters = match &self.admit {
            None => None,
            Some(a) => {
                let mut c = Vec::new();
                c.try_reserve_exact(a.counts().len())
                    .map_err(|_| no_memory.clone())?;
                c.extend_from_slice(a.counts());
                Some(c)
            }
        };
        let head = self.head();
        let total = self.checkpoint_bytes();
        self.index.snap = Some(Box::new(entries));
        self.blocks.snap = Some(Box::new(rows));
        self.stream = Some(Box::new(Stream {
            head: Some(head),
            sum: Checksum::default(),
            rows: self.rows_stored(),
            rows_left: self.rows_stored(),
            counters,
            total,
            written: 0,
        }));
        Ok(total)
    }

    /// Append the stream's next bytes to `out`: about `max` of them (at
    /// least a row, a whole number of rows; fewer where the index is
    /// sparse: each entry passed counts 16). True when the checkpoint is
    /// complete (the stream is then over). An error ends the stream.
    pub fn stream_fill(&mut self, out: &mut Vec<u8>, max: usize) -> Result<bool, StreamError> {
        let mut st = self.stream.take().ok_or(StreamError::NotStarted)?;
        let start = out.len();
        if let Some(h) = st.head.take() {
            st.sum.add(&h);
            out.extend_from_slice(&h);
        }
        let record = self.record_bytes();
        let mut budget = max.max(1);
        let mut walked = false;
        while budget > 0 {
            let Some(e) = self.index.snap_next() else {
                walked = true;
                break;
            };
            budget = budget.saturating_sub(16);
            if !e.is_full() {
                continue;
            }
            if st.rows_left == 0 {
                return Err(self.stream_failed(&st, 1));
            }
            st.rows_left -= 1;
            let at = out.len();
            out.extend_from_slice(&e.id.to_le_bytes());
            out.extend_from_slice(&e.touch.to_le_bytes());
            for v in self.blocks.snap_row(e.slot()) {
                out.extend_from_slice(&v.to_le_bytes());
            }
            debug_assert_eq!(out.len() - at, record);
            st.sum.add(&out[at..]);
            budget = budget.saturating_sub(record);
        }
        if !walked {
            st.written += (out.len() - start) as u64;
            self.stream = Some(st);
            return Ok(false);
        }
        if st.rows_left != 0 {
            return Err(self.stream_failed(&st, 0));
        }
        if let Some(counters) = &st.counters {
            let at = out.len();
            for c in counters {
                out.extend_from_slice(&c.to_le_bytes());
            }
            // Cast: the counters' bytes were allocated, a usize.
            #[allow(clippy::cast_possible_truncation)]
            out.resize(at + counter_bytes(counters.len() as u64) as usize, 0);
            st.sum.add(&out[at..]);
        }
        out.extend_from_slice(&st.sum.0.to_le_bytes());
        st.written += (out.len() - start) as u64;
        debug_assert_eq!(st.written, st.total, "a stream writes the bytes it announced");
        self.stream_end();
        Ok(true)
    }

    /// End the stream in progress, if any, and free what it kept.
    pub fn stream_abort(&mut self) {
        self.stream = None;
        self.stream_end();
    }

    /// Whether a stream is in progress.
    pub fn streaming(&self) -> bool {
        self.stream.is_some()
    }

    /// What a stream in progress keeps now: (index entries, bytes of
    /// rows); (0, 0) without one.
    pub fn stream_kept(&self) -> (usize, usize) {
        (
            self.index.snap.as_ref().map_or(0, |s| s.kept()),
            self.blocks.snap.as_ref().map_or(0, |s| s.kept_bytes()),
        )
    }

    fn stream_end(&mut self) {
        self.index.snap = None;
        self.blocks.snap = None;
    }

    /// Ends the stream on a walk that found `extra` more rows than were
    /// left (or `rows_left` too few).
    fn stream_failed(&mut self, st: &Stream, extra: u64) -> StreamError {
        self.stream_end();
        StreamError::Inconsistent {
            expected: st.rows,
            found: st.rows - st.rows_left + extra,
        }
    }
}
