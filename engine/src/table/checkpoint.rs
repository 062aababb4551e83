//! A row store's checkpoint: its stored rows only, streamed to any
//! [`Write`] and back from any [`Read`] (time and size O(index entries +
//! rows stored); no copy of the table is made in memory).
//!
//! Format (version 2), every field little-endian:
//!
//! | offset | bytes | field                                            |
//! |--------|-------|--------------------------------------------------|
//! | 0      | 8     | magic `PHUBROWS`                                 |
//! | 8      | 4     | version, 2                                       |
//! | 12     | 4     | `dim`: f32 values per row                        |
//! | 16     | 4     | `state_len`: f32 words of optimizer state per row |
//! | 20     | 4     | the store's round, modulo 2^31 (idle eviction's clock) |
//! | 24     | 8     | `rows`: the rows that follow                     |
//! | 32     | 8     | the CLOCK hand: an index position                |
//! | 40     | 8     | the idle sweep's hand (0 without `idle_rounds`)  |
//! | 48     | 8     | `counters`: admission counters that follow the rows (0 without `admit_after`) |
//! | 56     | `rows` x (12 + 4 (dim + state_len)) | per row: its id (u64), its touch word (u32: CLOCK bit, round of its last update), its values, its state (f32 bits) |
//! | then   | 2 `counters`, rounded up to 4 | the admission counters (u16), a 0 after an odd count |
//! | end    | 8     | checksum                                         |
//!
//! The checksum folds every 4-byte word before it, read as a
//! little-endian u32 `w`, into `h` (from 0): `h = (rotl(h, 5) ^ w) *
//! 0x517CC1B727220A95` (wrapping). Rows come in index order from the
//! index's first empty entry on, so that a restore, inserting them in
//! that order, puts each at its position (the index is restored as it
//! was, not only its contents). With the round, the touch words, both
//! hands and the admission counters, the restored store evicts and admits
//! exactly as the saved one would have: what it answers next is bit for
//! bit what the saved store would have answered. A restore checks the
//! header against the store it builds (same dim, state length and
//! admission counters, rows within the cap), reads exactly `rows` rows,
//! the counters and the checksum, then the hands against the index size,
//! and fails with an error naming what is wrong (a truncated file says
//! where it ended) rather than panicking. What is not saved: the counters
//! ([`super::StoreStats`]), and where each row sits in the row blocks
//! (slots are handed out again; nothing a store answers depends on them).

use std::io::{self, BufWriter, Read, Write};

use super::store::{RowStore, StoreConfig, StoreError};
use super::{RowInit, RowUpdate};

/// The first 8 bytes of a row store checkpoint.
pub const MAGIC: [u8; 8] = *b"PHUBROWS";
/// The format version written.
pub const VERSION: u32 = 2;
/// Bytes of the header.
pub const HEADER_BYTES: usize = 56;

const CHECKSUM_MUL: u64 = 0x517C_C1B7_2722_0A95;

/// A checkpoint that cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The reader failed (other than by ending early).
    #[error("reading a row store checkpoint at byte {offset}: {source}")]
    Io {
        /// Bytes read before the failure.
        offset: u64,
        /// The reader's error.
        source: io::Error,
    },
    /// The input ended inside a part of the checkpoint.
    #[error("row store checkpoint truncated: it ends after {offset} bytes, inside {what} (expected {expected} bytes in all)")]
    Truncated {
        /// The header, a row (`row i of n`) or the checksum.
        what: String,
        /// Bytes read.
        offset: u64,
        /// Bytes the header announced (the header's own bytes when it is
        /// the part cut).
        expected: u64,
    },
    /// Not a row store checkpoint.
    #[error("not a row store checkpoint: magic {found:02x?}, expected {MAGIC:02x?} (\"PHUBROWS\")")]
    Magic {
        /// The first 8 bytes.
        found: [u8; 8],
    },
    /// A version this code does not read.
    #[error("row store checkpoint version {found}: accepted {VERSION}")]
    Version {
        /// The version in the header.
        found: u32,
    },
    /// The header does not match the store being restored.
    #[error("row store checkpoint {field} = {found}, but the table has {field} = {expected}")]
    Shape {
        /// `dim` or `state_len`.
        field: &'static str,
        /// In the checkpoint.
        found: u64,
        /// In the table.
        expected: u64,
    },
    /// A hand beyond the index, or a round of 2^31 or more (the file is of
    /// another store, or corrupt past what the checksum tells).
    #[error("row store checkpoint {field} = {found}: accepted 0 to {limit}")]
    Position {
        /// `clock hand`, `idle hand` or `round`.
        field: &'static str,
        /// In the checkpoint.
        found: u64,
        /// The largest accepted.
        limit: u64,
    },
    /// More rows than the store's cap.
    #[error("row store checkpoint holds {rows} rows, over the table's rows cap of {cap} on this lcore")]
    TooManyRows {
        /// In the header.
        rows: u64,
        /// The store's cap.
        cap: u64,
    },
    /// An id twice.
    #[error("row store checkpoint holds id {id} twice (row {row})")]
    DuplicateId {
        /// The id.
        id: u64,
        /// Its second row's number.
        row: u64,
    },
    /// A new row's block could not be allocated.
    #[error("out of memory restoring row {row} of a row store checkpoint")]
    NoMemory {
        /// The row's number.
        row: u64,
    },
    /// The bytes are not those written.
    #[error("row store checkpoint checksum {found:#018x}, computed {computed:#018x}: the file is corrupt")]
    Checksum {
        /// In the file.
        found: u64,
        /// Over the bytes read.
        computed: u64,
    },
    /// The store itself cannot be set up.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The checksum (module head).
#[derive(Debug, Default)]
pub(super) struct Checksum(pub(super) u64);

impl Checksum {
    pub(super) fn add(&mut self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len() % 4, 0);
        for w in bytes.chunks_exact(4) {
            let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            self.0 = (self.0.rotate_left(5) ^ u64::from(w)).wrapping_mul(CHECKSUM_MUL);
        }
    }
}

/// What the header says beyond magic and version.
#[derive(Debug)]
struct Head {
    dim: usize,
    state_len: usize,
    round: u32,
    rows: u64,
    clock_hand: u64,
    idle_hand: u64,
    counters: u64,
}

impl Head {
    fn bytes(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        // Cast: a store's dim and state length are u32s.
        #[allow(clippy::cast_possible_truncation)]
        {
            h[12..16].copy_from_slice(&(self.dim as u32).to_le_bytes());
            h[16..20].copy_from_slice(&(self.state_len as u32).to_le_bytes());
        }
        h[20..24].copy_from_slice(&self.round.to_le_bytes());
        h[24..32].copy_from_slice(&self.rows.to_le_bytes());
        h[32..40].copy_from_slice(&self.clock_hand.to_le_bytes());
        h[40..48].copy_from_slice(&self.idle_hand.to_le_bytes());
        h[48..56].copy_from_slice(&self.counters.to_le_bytes());
        h
    }

    fn parse(h: &[u8; HEADER_BYTES]) -> Head {
        let u32_at = |at: usize| u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Head {
            dim: u32_at(12) as usize,
            state_len: u32_at(16) as usize,
            round: u32_at(20),
            rows: u64_at(24),
            clock_hand: u64_at(32),
            idle_hand: u64_at(40),
            counters: u64_at(48),
        }
    }
}

/// Bytes of `n` admission counters in the file (u16s, padded to 4).
pub(super) fn counter_bytes(n: u64) -> u64 {
    (2 * n).next_multiple_of(4)
}

impl<I: RowInit, U: RowUpdate> RowStore<I, U> {
    fn admit_counters(&self) -> u64 {
        self.admit.as_ref().map_or(0, |a| a.counts().len() as u64)
    }

    pub(super) fn record_bytes(&self) -> usize {
        12 + 4 * (self.dim + self.state_len)
    }

    /// The header of this store's checkpoint as it stands now.
    pub(super) fn head(&self) -> [u8; HEADER_BYTES] {
        Head {
            dim: self.dim,
            state_len: self.state_len,
            round: self.now,
            rows: self.rows_stored(),
            clock_hand: self.clock.hand as u64,
            idle_hand: self.idle.as_ref().map_or(0, |i| i.hand as u64),
            counters: self.admit_counters(),
        }
        .bytes()
    }

    /// Bytes [`RowStore::write_to`] writes for this store.
    pub fn checkpoint_bytes(&self) -> u64 {
        HEADER_BYTES as u64
            + self.rows_stored() * self.record_bytes() as u64
            + counter_bytes(self.admit_counters())
            + 8
    }

    /// Write the stored rows and what decides the store's next evictions
    /// and admissions (module head's format); returns the bytes written.
    pub fn write_to(&self, w: impl Write) -> io::Result<u64> {
        let mut w = BufWriter::with_capacity(1 << 20, w);
        let mut sum = Checksum::default();
        let head = self.head();
        sum.add(&head);
        w.write_all(&head)?;
        let mut record = Vec::with_capacity(self.record_bytes());
        let mut rows = 0u64;
        for (_, e) in self.index.full_from_gap() {
            let row = self.blocks.row(e.slot());
            record.clear();
            record.extend_from_slice(&e.id.to_le_bytes());
            record.extend_from_slice(&e.touch.to_le_bytes());
            for v in row {
                record.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            debug_assert_eq!(record.len(), self.record_bytes());
            sum.add(&record);
            w.write_all(&record)?;
            rows += 1;
        }
        assert_eq!(rows, self.rows_stored(), "rows written and rows stored differ");
        if let Some(admit) = &self.admit {
            record.clear();
            for c in admit.counts() {
                record.extend_from_slice(&c.to_le_bytes());
            }
            if record.len() % 4 != 0 {
                record.extend_from_slice(&[0, 0]);
            }
            sum.add(&record);
            w.write_all(&record)?;
        }
        w.write_all(&sum.0.to_le_bytes())?;
        w.flush()?;
        Ok(self.checkpoint_bytes())
    }

    /// A store set up by `config`, `init` and `opt` holding the rows of
    /// the checkpoint `r` (module head's format), bit for bit, with the
    /// saved round, hands and admission counters.
    pub fn read_from(
        r: impl Read,
        config: StoreConfig,
        init: I,
        opt: U,
    ) -> Result<RowStore<I, U>, CheckpointError> {
        let mut store = RowStore::new(config, init, opt)?;
        store.read_into(r)?;
        Ok(store)
    }

    /// Puts the rows of checkpoint `r` into this store, which must hold no
    /// row yet (as installed), as [`RowStore::read_from`] would; on an
    /// error the store holds part of them and is to be dropped.
    pub fn read_into(&mut self, r: impl Read) -> Result<(), CheckpointError> {
        // Read a piece of up to 1 MiB at a time, straight from `r` (the
        // pieces are its buffer).
        let mut r = Reader { r, offset: 0 };
        let mut load = self.load_begin();
        let mut piece = vec![0u8; 1 << 20];
        while !load.fed_all() {
            // No further than the checkpoint's end (the header says it).
            // Cast: at most the piece's length.
            #[allow(clippy::cast_possible_truncation)]
            let want = (load.total - load.fed).min(piece.len() as u64) as usize;
            let n = r.read_some(&mut piece[..want])?;
            if n == 0 {
                break;
            }
            load.feed(self, &piece[..n])?;
        }
        load.finish(self)
    }

    /// Starts reading a checkpoint into this store, which must hold no row
    /// yet, a piece at a time ([`RowLoad::feed`], then
    /// [`RowLoad::finish`]): what [`RowStore::read_into`] does, its work
    /// spread over the pieces (a state copy taken as its fragments
    /// arrive).
    pub fn load_begin(&self) -> RowLoad {
        assert_eq!(self.rows_stored(), 0, "a checkpoint is read into an empty store");
        assert!(!self.streaming(), "a store being streamed holds rows");
        RowLoad {
            head: None,
            buf: Vec::with_capacity(HEADER_BYTES),
            sum: Checksum::default(),
            row: 0,
            fed: 0,
            total: HEADER_BYTES as u64,
            values: Vec::new(),
        }
    }
}

/// A checkpoint being read into a store a piece at a time
/// ([`RowStore::load_begin`]).
#[derive(Debug)]
pub struct RowLoad {
    /// The header, once all of it is in.
    head: Option<Head>,
    /// Bytes of the part being gathered: the header, a row's record, or
    /// the tail (admission counters and checksum).
    buf: Vec<u8>,
    sum: Checksum,
    /// Rows inserted so far.
    row: u64,
    /// Bytes fed so far (those past the checkpoint's end are ignored).
    fed: u64,
    /// The checkpoint's bytes (the header's, until it is in).
    total: u64,
    values: Vec<f32>,
}

impl RowLoad {
    /// Whether every byte of the checkpoint was fed.
    pub fn fed_all(&self) -> bool {
        self.head.is_some() && self.fed >= self.total
    }

    /// Takes the checkpoint's next bytes into `store` (the one it was
    /// begun for): the header checked once in, each row inserted once its
    /// record is in. An error leaves the store with part of the rows: it
    /// is to be dropped.
    pub fn feed<I: RowInit, U: RowUpdate>(
        &mut self,
        store: &mut RowStore<I, U>,
        mut bytes: &[u8],
    ) -> Result<(), CheckpointError> {
        while !bytes.is_empty() && self.fed < self.total {
            // Cast: the part being gathered is at most a record or the
            // tail, which fit in memory.
            #[allow(clippy::cast_possible_truncation)]
            let want = match &self.head {
                None => HEADER_BYTES,
                Some(h) if self.row < h.rows => store.record_bytes(),
                Some(h) => counter_bytes(h.counters) as usize + 8,
            };
            let take = (want - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            self.fed += take as u64;
            if self.buf.len() < want {
                break;
            }
            match &self.head {
                None => self.take_head(store)?,
                Some(h) if self.row < h.rows => self.take_row(store)?,
                // The tail waits for `finish`.
                Some(_) => break,
            }
        }
        Ok(())
    }

    fn take_head<I: RowInit, U: RowUpdate>(&mut self, store: &RowStore<I, U>) -> Result<(), CheckpointError> {
        let mut head = [0u8; HEADER_BYTES];
        head.copy_from_slice(&self.buf);
        self.buf.clear();
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&head[0..8]);
        if magic != MAGIC {
            return Err(CheckpointError::Magic { found: magic });
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if version != VERSION {
            return Err(CheckpointError::Version { found: version });
        }
        let h = Head::parse(&head);
        for (field, found, expected) in [
            ("dim", h.dim as u64, store.dim as u64),
            ("state_len", h.state_len as u64, store.state_len as u64),
            ("admission counters", h.counters, store.admit_counters()),
        ] {
            if found != expected {
                return Err(CheckpointError::Shape {
                    field,
                    found,
                    expected,
                });
            }
        }
        if h.rows > store.config.rows_cap {
            return Err(CheckpointError::TooManyRows {
                rows: h.rows,
                cap: store.config.rows_cap,
            });
        }
        self.total =
            HEADER_BYTES as u64 + h.rows * store.record_bytes() as u64 + counter_bytes(h.counters) + 8;
        self.sum.add(&head);
        self.values = vec![0f32; store.dim + store.state_len];
        self.head = Some(h);
        Ok(())
    }

    fn take_row<I: RowInit, U: RowUpdate>(
        &mut self,
        store: &mut RowStore<I, U>,
    ) -> Result<(), CheckpointError> {
        let record = &self.buf;
        self.sum.add(record);
        let mut id = [0u8; 8];
        id.copy_from_slice(&record[..8]);
        let id = u64::from_le_bytes(id);
        let touch = u32::from_le_bytes([record[8], record[9], record[10], record[11]]);
        for (v, b) in self.values.iter_mut().zip(record[12..].chunks_exact(4)) {
            *v = f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        }
        let row = self.row;
        if store.get(id).is_some() {
            return Err(CheckpointError::DuplicateId { id, row });
        }
        let dim = store.dim;
        if !store.insert_exact(id, &self.values[..dim], &self.values[dim..], touch) {
            return Err(CheckpointError::NoMemory { row });
        }
        self.row += 1;
        self.buf.clear();
        Ok(())
    }

    /// Ends the load: the admission counters, the checksum and the hands
    /// checked and taken; an error when a part was cut short (what
    /// [`RowStore::read_into`] calls truncated) or is wrong.
    pub fn finish<I: RowInit, U: RowUpdate>(self, store: &mut RowStore<I, U>) -> Result<(), CheckpointError> {
        let (offset, expected) = (self.fed, self.total);
        let truncated = |what: String| CheckpointError::Truncated {
            what,
            offset,
            expected,
        };
        let Some(h) = &self.head else {
            return Err(truncated("the header".to_string()));
        };
        if self.row < h.rows {
            return Err(truncated(format!("row {} of {}", self.row, h.rows)));
        }
        // Cast: the counters are allocated, so their bytes fit a usize.
        #[allow(clippy::cast_possible_truncation)]
        let counters = counter_bytes(h.counters) as usize;
        if self.buf.len() < counters {
            return Err(truncated("the admission counters".to_string()));
        }
        if self.buf.len() < counters + 8 {
            return Err(truncated("the checksum".to_string()));
        }
        let mut sum = self.sum;
        let (bytes, found) = self.buf.split_at(counters);
        if let Some(admit) = &mut store.admit {
            sum.add(bytes);
            for (c, b) in admit.counts_mut().iter_mut().zip(bytes.chunks_exact(2)) {
                *c = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        let mut f = [0u8; 8];
        f.copy_from_slice(found);
        let found = u64::from_le_bytes(f);
        if found != sum.0 {
            return Err(CheckpointError::Checksum {
                found,
                computed: sum.0,
            });
        }
        let entries = store.index.capacity() as u64;
        for (field, found, limit) in [
            // A hand at the entry count wraps to 0 before its next step.
            ("clock hand", h.clock_hand, entries),
            ("idle hand", h.idle_hand, entries),
            ("round", u64::from(h.round), u64::from(u32::MAX >> 1)),
        ] {
            if found > limit {
                return Err(CheckpointError::Position { field, found, limit });
            }
        }
        // Casts: both hands are at most the index's entry count, a usize.
        #[allow(clippy::cast_possible_truncation)]
        {
            store.clock.hand = h.clock_hand as usize;
            if let Some(idle) = &mut store.idle {
                idle.hand = h.idle_hand as usize;
            }
        }
        store.now = h.round;
        Ok(())
    }
}

/// A reader that knows how far it got.
struct Reader<R> {
    r: R,
    offset: u64,
}

impl<R: Read> Reader<R> {
    /// Reads what comes next into `buf`, at most its length; 0 at the end.
    fn read_some(&mut self, buf: &mut [u8]) -> Result<usize, CheckpointError> {
        loop {
            match self.r.read(buf) {
                Ok(n) => {
                    self.offset += n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(CheckpointError::Io {
                        offset: self.offset,
                        source,
                    })
                }
            }
        }
    }
}
