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
//! ([`super::huge`]).

use bytemuck::{Pod, Zeroable};
use phub_proto::memory::{TableShape, TABLE_BLOCK_HANDLE_BYTES, TABLE_LINE_BYTES};

use super::huge::Zeroed;
use super::prefetch::prefetch_span;
use super::snapshot::RowSnap;

/// One cache line of a block.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

const _: () = assert!(std::mem::size_of::<Line>() as u64 == TABLE_LINE_BYTES);
const _: () = assert!(std::mem::size_of::<Zeroed<Line>>() as u64 == TABLE_BLOCK_HANDLE_BYTES);

/// The rows (module head).
pub(crate) struct Blocks {
    blocks: Vec<Zeroed<Line>>,
    row_words: usize,
    rows_per_block: usize,
    block_lines: usize,
    max_blocks: usize,
    /// A checkpoint being streamed: rows kept as they were
    /// ([`super::snapshot`]); every write goes through `row_mut` first.
    pub(crate) snap: Option<Box<RowSnap>>,
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
        Some(Blocks {
            blocks,
            row_words: usize::try_from(shape.row_words()).ok()?,
            rows_per_block: usize::try_from(shape.rows_per_block()).ok()?,
            block_lines: usize::try_from(shape.block_bytes() / TABLE_LINE_BYTES).ok()?,
            max_blocks,
            snap: None,
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
            match Zeroed::<Line>::new(self.block_lines) {
                Some(b) => self.blocks.push(b),
                None => return false,
            }
        }
        true
    }

    #[inline]
    fn place(&self, slot: u32) -> (usize, usize) {
        let s = slot as usize;
        (
            s / self.rows_per_block,
            (s % self.rows_per_block) * self.row_words,
        )
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

    /// Blocks allocated.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes allocated: the blocks (all of `block_lines` lines) and the
    /// block table. O(1): a row store asks at every block it adds.
    pub(crate) fn bytes(&self) -> u64 {
        let blocks = self.blocks.len() * self.block_lines * std::mem::size_of::<Line>();
        (blocks + self.blocks.capacity() * std::mem::size_of::<Zeroed<Line>>()) as u64
    }
}
