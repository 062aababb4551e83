//! The data path does not allocate, one test binary with the counting
//! allocator ([`Counting`], which counts each thread's allocations apart,
//! so that these tests run side by side): dense slots (`no_alloc`),
//! replicated slots (`no_alloc_replica`) and tables (`table_no_alloc`).

use phub_engine::testing::Counting;

#[global_allocator]
static GLOBAL: Counting = Counting;

mod no_alloc;
mod no_alloc_replica;
mod table_no_alloc;
