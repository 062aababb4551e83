//! The simulator's seeds: each draws a job (workers, lcores, keys, dtype,
//! optimizer, window, faults) and runs it through real worker transports
//! and real engine shards over the simulated network, checking every
//! invariant after every step (see the crate's doc).
//!
//! `PHUB_SIM_SEEDS=N` runs N seeds per test; `PHUB_SIM_SEED=N` replays one.

use phub_sim::{for_seeds, run, Case};

/// Random BSP jobs, most over a faulty network.
#[test]
fn bsp_random_jobs() {
    for_seeds(0, 300, "seeds", |seed| {
        run(&Case::draw(seed));
    });
}
