//! A row store's checkpoint: its stored rows only, streamed to any
//! [`Write`] and back from any [`Read`] (time and size O(index entries +
//! rows stored); no copy of the table is made in memory).
//!
//! Format (version 1), every field little-endian:
//!
//! | offset | bytes | field                                            |
//! |--------|-------|--------------------------------------------------|
//! | 0      | 8     | magic `PHUBROWS`                                 |
//! | 8      | 4     | version, 1                                       |
//! | 12     | 4     | `dim`: f32 values per row                        |
//! | 16     | 4     | `state_len`: f32 words of optimizer state per row |
//! | 20     | 4     | 0 (reserved)                                     |
//! | 24     | 8     | `rows`: the rows that follow                     |
//! | 32     | `rows` x (8 + 4 (dim + state_len)) | per row: its id (u64), its values, its state (f32 bits) |
//! | end    | 8     | checksum                                         |
//!
//! The checksum folds every 4-byte word before it, read as a
//! little-endian u32 `w`, into `h` (from 0): `h = (rotl(h, 5) ^ w) *
//! 0x517CC1B727220A95` (wrapping). Rows come in index order. A restore
//! checks the header against the store it builds (same dim and state
//! length, rows within the cap), reads exactly `rows` rows and the
//! checksum, and fails with an error naming what is wrong (a truncated
//! file says where it ended) rather than panicking; values and state come
//! back bit for bit. What is not saved: the rows' recency (restored rows
//! count as updated in the store's first round), the admission counters,
//! and the counters.

use std::io::{self, BufReader, BufWriter, Read, Write};

use super::store::{RowStore, StoreConfig, StoreError};
use super::{RowInit, RowUpdate};

/// The first 8 bytes of a row store checkpoint.
pub const MAGIC: [u8; 8] = *b"PHUBROWS";
/// The format version written.
pub const VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_BYTES: usize = 32;

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
struct Checksum(u64);

impl Checksum {
    fn add(&mut self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len() % 4, 0);
        for w in bytes.chunks_exact(4) {
            let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            self.0 = (self.0.rotate_left(5) ^ u64::from(w)).wrapping_mul(CHECKSUM_MUL);
        }
    }
}

fn header(dim: usize, state_len: usize, rows: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    // Cast: a store's dim and state length are u32s.
    #[allow(clippy::cast_possible_truncation)]
    {
        h[12..16].copy_from_slice(&(dim as u32).to_le_bytes());
        h[16..20].copy_from_slice(&(state_len as u32).to_le_bytes());
    }
    h[24..32].copy_from_slice(&rows.to_le_bytes());
    h
}

impl<I: RowInit, U: RowUpdate> RowStore<I, U> {
    /// Bytes [`RowStore::write_to`] writes for this store.
    pub fn checkpoint_bytes(&self) -> u64 {
        HEADER_BYTES as u64 + self.rows_stored() * (8 + 4 * (self.dim + self.state_len) as u64) + 8
    }

    /// Write the stored rows (module head's format); returns the bytes
    /// written.
    pub fn write_to(&self, w: impl Write) -> io::Result<u64> {
        let mut w = BufWriter::with_capacity(1 << 20, w);
        let mut sum = Checksum::default();
        let head = header(self.dim, self.state_len, self.rows_stored());
        sum.add(&head);
        w.write_all(&head)?;
        let mut record = Vec::with_capacity(8 + 4 * (self.dim + self.state_len));
        let mut rows = 0u64;
        for (id, values, state) in self.rows() {
            record.clear();
            record.extend_from_slice(&id.to_le_bytes());
            for v in values.iter().chain(state) {
                record.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            sum.add(&record);
            w.write_all(&record)?;
            rows += 1;
        }
        assert_eq!(rows, self.rows_stored(), "rows written and rows stored differ");
        w.write_all(&sum.0.to_le_bytes())?;
        w.flush()?;
        Ok(self.checkpoint_bytes())
    }

    /// A store set up by `config`, `init` and `opt` holding the rows of
    /// the checkpoint `r` (module head's format), bit for bit.
    pub fn read_from(
        r: impl Read,
        config: StoreConfig,
        init: I,
        opt: U,
    ) -> Result<RowStore<I, U>, CheckpointError> {
        let mut store = RowStore::new(config, init, opt)?;
        let mut r = Reader {
            r: BufReader::with_capacity(1 << 20, r),
            offset: 0,
        };
        let mut head = [0u8; HEADER_BYTES];
        r.fill(&mut head, || "the header".to_string(), HEADER_BYTES as u64)?;
        let u32_at = |at: usize| u32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&head[0..8]);
        if magic != MAGIC {
            return Err(CheckpointError::Magic { found: magic });
        }
        if u32_at(8) != VERSION {
            return Err(CheckpointError::Version { found: u32_at(8) });
        }
        for (field, found, expected) in [
            ("dim", u32_at(12), store.dim),
            ("state_len", u32_at(16), store.state_len),
        ] {
            if found as usize != expected {
                return Err(CheckpointError::Shape {
                    field,
                    found: u64::from(found),
                    expected: expected as u64,
                });
            }
        }
        let mut rows_bytes = [0u8; 8];
        rows_bytes.copy_from_slice(&head[24..32]);
        let rows = u64::from_le_bytes(rows_bytes);
        if rows > config.rows_cap {
            return Err(CheckpointError::TooManyRows {
                rows,
                cap: config.rows_cap,
            });
        }
        let (dim, state_len) = (store.dim, store.state_len);
        let record_bytes = 8 + 4 * (dim + state_len);
        let total = HEADER_BYTES as u64 + rows * record_bytes as u64 + 8;
        let mut sum = Checksum::default();
        sum.add(&head);
        let mut record = vec![0u8; record_bytes];
        let mut values = vec![0f32; dim + state_len];
        for row in 0..rows {
            r.fill(&mut record, || format!("row {row} of {rows}"), total)?;
            sum.add(&record);
            let mut id = [0u8; 8];
            id.copy_from_slice(&record[..8]);
            let id = u64::from_le_bytes(id);
            for (v, b) in values.iter_mut().zip(record[8..].chunks_exact(4)) {
                *v = f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
            if store.get(id).is_some() {
                return Err(CheckpointError::DuplicateId { id, row });
            }
            if !store.insert_exact(id, &values[..dim], &values[dim..]) {
                return Err(CheckpointError::NoMemory { row });
            }
        }
        let mut found = [0u8; 8];
        r.fill(&mut found, || "the checksum".to_string(), total)?;
        let found = u64::from_le_bytes(found);
        if found != sum.0 {
            return Err(CheckpointError::Checksum {
                found,
                computed: sum.0,
            });
        }
        Ok(store)
    }
}

/// A reader that knows how far it got.
struct Reader<R> {
    r: R,
    offset: u64,
}

impl<R: Read> Reader<R> {
    /// Fill `buf` or say which part (`what`) was cut short.
    fn fill(
        &mut self,
        buf: &mut [u8],
        what: impl Fn() -> String,
        expected: u64,
    ) -> Result<(), CheckpointError> {
        let mut got = 0;
        while got < buf.len() {
            match self.r.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(CheckpointError::Truncated {
                        what: what(),
                        offset: self.offset,
                        expected,
                    })
                }
                Ok(n) => {
                    got += n;
                    self.offset += n as u64;
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
        Ok(())
    }
}
