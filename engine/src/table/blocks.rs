//! A row store's rows: slots of `dim + state_len` f32 words, packed whole
//! into blocks of at most 2 MiB that are allocated, zeroed, as the table
//! grows (one allocation per block, never one per row), up to the blocks
//! of the cap.
//!
//! Slot `s` is row `s % rows_per_block` of block `s / rows_per_block`; a
//! row is its `dim` values, then its optimizer state. The block table (a
//! handle per block) is reserved for the blocks of the cap at creation, so
//! growing never moves it. Sizes come from
//! [`phub_proto::memory::TableShape`], the model admission charges. Each
//! block is mapped on a 2 MiB boundary with huge pages asked for
//! ([`super::huge`]); where the process runs the block maker, a new
//! block is one it made ahead, its pages already faulted in
//! ([`super::reserve`]).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use phub_proto::memory::{TableShape, TABLE_BLOCK_HANDLE_BYTES, TABLE_LINE_BYTES};

use super::huge::Zeroed;
use super::prefetch::prefetch_span;
use super::reserve::Reserve;
use super::snapshot::RowSnap;

/// One cache line of a block.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

const _: () = assert!(std::mem::size_of::<Line>() as u64 == TABLE_LINE_BYTES);
const _: () = assert!(std::mem::size_of::<Zeroed<Line>>() as u64 == TABLE_BLOCK_HANDLE_BYTES);

/// `ceil(2^64 / d)` for `d` > 0, wrapped (0 for `d` = 1): what
/// [`divide`] multiplies by.
fn inverse_of(d: u32) -> u64 {
    (u64::MAX / u64::from(d)).wrapping_add(1)
}

/// `n / d`, given `inverse_of(d)`: the high half of a multiplication,
/// exact for every 32-bit `n` and `d` (Lemire, Kaser and Kurz, "Faster
/// remainder by direct computation", 2019).
#[inline]
fn divide(n: u32, inverse: u64) -> u32 {
    if inverse == 0 {
        return n;
    }
    // Cast: the high half of a u64 times a u32 is below 2^32.
    #[allow(clippy::cast_possible_truncation)]
    let q = ((u128::from(inverse) * u128::from(n)) >> 64) as u32;
    q
}

/// The rows (module head).
pub(crate) struct Blocks {
    blocks: Vec<Zeroed<Line>>,
    row_words: usize,
    rows_per_block: usize,
    /// `inverse_of(rows_per_block)`, for [`Blocks::place`]'s division.
    per_block_inverse: u64,
    block_lines: usize,
    max_blocks: usize,
    /// A checkpoint being streamed: rows kept as they were
    /// ([`super::snapshot`]); every write goes through `row_mut` first.
    pub(crate) snap: Option<Box<RowSnap>>,
    /// Blocks made ahead by the block maker, where it runs.
    reserve: Option<Arc<Reserve<Line>>>,
    /// Blocks this store made itself (none ready from a maker, or none
    /// runs): each faulted in on the lcore as its rows are first written.
    made_here: u64,
}

impl std::fmt::Debug for Blocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocks")
            .field("blocks", &self.blocks.len())
            .field("row_words", &self.row_words)
            .field("rows_per_block", &self.rows_per_block)
            .finish()
    }
}

impl Blocks {
    /// No blocks yet, room in the block table for those of the cap; `None`
    /// when the heap refuses the table.
    pub(crate) fn new(shape: &TableShape) -> Option<Blocks> {
        let max_blocks = usize::try_from(shape.blocks()).ok()?;
        let mut blocks = Vec::new();
        blocks.try_reserve_exact(max_blocks).ok()?;
        let rows_per_block = u32::try_from(shape.rows_per_block()).ok().filter(|&r| r > 0)?;
        let block_lines = usize::try_from(shape.block_bytes() / TABLE_LINE_BYTES).ok()?;
        Some(Blocks {
            blocks,
            row_words: usize::try_from(shape.row_words()).ok()?,
            rows_per_block: rows_per_block as usize,
            per_block_inverse: inverse_of(rows_per_block),
            block_lines,
            max_blocks,
            snap: None,
            reserve: Reserve::new(block_lines, max_blocks),
            made_here: 0,
        })
    }

    /// Make slot `slot` backed by a block (allocating the blocks up to
    /// it); false when the heap refuses one.
    pub(crate) fn ensure(&mut self, slot: u32) -> bool {
        let block = slot as usize / self.rows_per_block;
        assert!(
            block < self.max_blocks,
            "slot {slot} is beyond the cap's {} blocks",
            self.max_blocks
        );
        while self.blocks.len() <= block {
            let made = match &self.reserve {
                Some(r) => r.take(),
                None => Zeroed::<Line>::new(self.block_lines).map(|b| (b, true)),
            };
            let Some((b, here)) = made else { return false };
            self.made_here += u64::from(here);
            self.blocks.push(b);
        }
        true
    }

    /// Slot `slot`'s block, and its first word in the block. The division
    /// is a multiplication ([`divide`]): a `div` on the path from an index
    /// entry to its row's address cost about a tenth of a row update at
    /// 10^8 rows.
    #[inline]
    fn place(&self, slot: u32) -> (usize, usize) {
        let s = slot as usize;
        let block = divide(slot, self.per_block_inverse) as usize;
        debug_assert_eq!(block, s / self.rows_per_block);
        (block, (s - block * self.rows_per_block) * self.row_words)
    }

    /// The row slot `slot` (values then state), which must be backed.
    #[inline]
    pub(crate) fn row(&self, slot: u32) -> &[f32] {
        let (b, at) = self.place(slot);
        &bytemuck::cast_slice::<Line, f32>(&self.blocks[b])[at..at + self.row_words]
    }

    /// The row slot `slot`, mutably (a stream in progress keeps it first,
    /// if it needs it as it is).
    #[inline]
    pub(crate) fn row_mut(&mut self, slot: u32) -> &mut [f32] {
        let (b, at) = self.place(slot);
        let w = self.row_words;
        let row = &mut bytemuck::cast_slice_mut::<Line, f32>(&mut self.blocks[b])[at..at + w];
        if let Some(s) = &mut self.snap {
            s.keep(slot, row);
        }
        row
    }

    /// A stream's row of slot `slot` as it was at the stream's start
    /// (module [`super::snapshot`]); the stream has taken it after this.
    pub(crate) fn snap_row(&mut self, slot: u32) -> &[f32] {
        let (b, at) = self.place(slot);
        let w = self.row_words;
        let row = &bytemuck::cast_slice::<Line, f32>(&self.blocks[b])[at..at + w];
        match &mut self.snap {
            Some(s) => s.take(slot, row),
            None => row,
        }
    }

    /// Prefetch every line of row slot `slot`, which must be backed.
    #[inline]
    pub(crate) fn prefetch(&self, slot: u32) {
        let (b, at) = self.place(slot);
        let block = bytemuck::cast_slice::<Line, f32>(&self.blocks[b]);
        prefetch_span(block[at..].as_ptr(), self.row_words * 4);
    }

    /// Blocks the store made itself ([`Blocks::made_here`]).
    pub(crate) fn made_here(&self) -> u64 {
        self.made_here
    }

    /// Blocks allocated.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes allocated: the blocks (all of `block_lines` lines) and the
    /// block table. O(1): a row store asks at every block it adds. Not
    /// the blocks its reserve holds ready (at most
    /// [`super::reserve::AHEAD`], within the cap).
    pub(crate) fn bytes(&self) -> u64 {
        let blocks = self.blocks.len() * self.block_lines * std::mem::size_of::<Line>();
        (blocks + self.blocks.capacity() * std::mem::size_of::<Zeroed<Line>>()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::{divide, inverse_of};

    /// The multiplication divides as `/` does: every divisor a row store
    /// can have (1 to 2^32 - 1 rows a block), at the slots where a quotient
    /// changes and at random ones.
    #[test]
    #[allow(clippy::cast_possible_truncation)]
    fn divide_is_exact_for_32_bit_slots() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut divisors = vec![1u32, 2, 3, 5, 7, 10, 341, 16_384, 16_385, u32::MAX - 1, u32::MAX];
        divisors.extend((0..200).map(|_| (next() as u32).max(1)));
        divisors.extend((0..200).map(|_| ((next() % 100_000) as u32).max(1)));
        for d in divisors {
            let inv = inverse_of(d);
            let mut slots = vec![0u32, 1, u32::MAX, u32::MAX - 1, d - 1, d, d.saturating_add(1)];
            slots.extend(
                (1..8u64)
                    .filter_map(|k| u32::try_from(u64::from(d) * k).ok())
                    .flat_map(|m| [m - 1, m]),
            );
            slots.extend((0..500).map(|_| next() as u32));
            for n in slots {
                assert_eq!(divide(n, inv), n / d, "{n} / {d}");
            }
        }
    }
}
