//! Sparse tables (issue 32): rows of `dim` values keyed by arbitrary u64
//! ids, stored only once touched.
//!
//! Layer: pure, as the rest of the engine. A table lives on an lcore as a
//! row store (ids to row slots in 2 MiB blocks); a row slot holds the row's
//! `dim` f32 values followed by its optimizer state. What a row's values
//! are before it is stored is a [`RowInit`]; how a round's aggregated
//! gradient changes a stored row is a [`RowUpdate`]. The two traits are the
//! seam between the store and the row optimizers and initial values, so
//! that each can be written and tested alone.
//!
//! The store: [`store::RowStore`] (one lcore's store of one table; its
//! parts in [`index`], [`blocks`], [`evict`], [`admit`], [`checkpoint`], [`snapshot`]).
//! Initial values: [`init`] (PROTOCOL.md §10.4); row optimizers: [`optim`]
//! (§10.5).
//!
//! Served by the engine's `table.rs`, `rows.rs` and `row_clock.rs`
//! (`crate::engine`), which route table messages to one store per (table,
//! lcore) by PROTOCOL.md §10.3's rules.

mod admit;
mod blocks;
pub mod checkpoint;
mod evict;
mod huge;
mod index;
pub mod init;
pub mod optim;
mod prefetch;
mod reserve;
pub mod snapshot;
pub mod store;

pub use init::{Init, InitError, TableInit};
pub use optim::{RowOptimizer, RowOptimizerError};
pub use reserve::start_block_maker;
pub use store::{Admission, Pushed, RowStore, StoreConfig, StoreError, StoreStats};

/// The values of a row that was never stored (or was evicted): the same on
/// every lcore, restart and checkpoint, so untouched rows need no memory.
pub trait RowInit {
    /// Fill `values` (the row's `dim` values) for row `id`.
    fn fill(&self, id: u64, values: &mut [f32]);
}

/// A row optimizer: what one aggregated gradient does to a stored row.
pub trait RowUpdate {
    /// The f32 words of state a stored row keeps after its `dim` values.
    fn state_len(&self, dim: usize) -> usize;
    /// The state of a row being stored for the first time.
    fn init_state(&self, state: &mut [f32]);
    /// Apply `grad` (the round's aggregate for this row, `dim` values) to a
    /// stored row: `values` (`dim`) and `state` (`state_len(dim)`).
    fn apply(&self, values: &mut [f32], state: &mut [f32], grad: &[f32]);
}
