//! Nanoseconds per row of the row optimizers' `apply` and of the initial
//! values' `fill` (issue 32): the optimizer alone, rows in cache, no store.
//!
//! `cargo run --release -p phub-engine --example row_optim_bench [-- DIM...]`
//!
//! For each optimizer and dim: 4096 rows (values and state in one slab,
//! laid out as a row store lays them: values then state per row), each
//! updated with its own gradient; passes over all rows until at least
//! 0.2 s have gone by; the figure is the median of 3 such runs, in ns per
//! row update, counted in the thread's CPU time (CLOCK_THREAD_CPUTIME_ID:
//! time the thread spent descheduled on a shared machine is left out;
//! the wall-clock figure is printed beside it). The store's hashing and cache misses come on top (the
//! issue's target, 10 M row updates/s per lcore, leaves 100 ns a row for
//! all of it).

use std::hint::black_box;
use std::time::{Duration, Instant};

mod common;
use common::cpu_time;

/// Nanoseconds per item of CPU time and of wall-clock time.
#[derive(Clone, Copy)]
struct Ns {
    cpu: f64,
    wall: f64,
}

impl std::fmt::Display for Ns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:8.2} ns cpu  ({:8.2} ns wall)", self.cpu, self.wall)
    }
}

use phub_engine::table::{Init, RowInit, RowOptimizer, RowUpdate, TableInit};

const ROWS: usize = 4096;

/// A small deterministic generator for the benchmark's inputs.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Cast: the top 24 bits, exact in f32.
        ((self.0 >> 40) as f32) * (1.0 / 16_777_216.0) * 2.0 - 1.0
    }
}

/// Runs `pass` (which handles `n` items) until 0.2 s of CPU time have
/// gone by, three times; the median run's figures per item.
fn median3(n: usize, mut pass: impl FnMut()) -> Ns {
    let mut runs: Vec<Ns> = (0..3)
        .map(|_| {
            let (c0, w0) = (cpu_time(), Instant::now());
            let mut items = 0usize;
            while cpu_time() - c0 < Duration::from_millis(200) {
                pass();
                items += n;
            }
            let (cpu, wall) = (cpu_time() - c0, w0.elapsed());
            Ns {
                cpu: cpu.as_nanos() as f64 / items as f64,
                wall: wall.as_nanos() as f64 / items as f64,
            }
        })
        .collect();
    runs.sort_by(|a, b| a.cpu.total_cmp(&b.cpu));
    runs[1]
}

fn bench_apply(opt: RowOptimizer, dim: usize) -> Ns {
    let stride = dim + opt.state_len(dim);
    let mut rng = Lcg(7);
    let mut slab = vec![0f32; ROWS * stride];
    for row in slab.chunks_exact_mut(stride) {
        let (w, s) = row.split_at_mut(dim);
        w.iter_mut().for_each(|x| *x = rng.next());
        opt.init_state(s);
    }
    let grads: Vec<f32> = (0..ROWS * dim).map(|_| rng.next() * 0.01).collect();
    median3(ROWS, || {
        for (row, g) in slab.chunks_exact_mut(stride).zip(grads.chunks_exact(dim)) {
            let (w, s) = row.split_at_mut(dim);
            black_box(&opt).apply(w, s, g);
        }
        black_box(&mut slab);
    })
}

fn bench_fill(init: Init, dim: usize) -> Ns {
    let t = TableInit::new(init, 0x5eed, 1).unwrap();
    let mut row = vec![0f32; dim];
    let mut next = 0u64;
    median3(1024, || {
        for id in next..next + 1024 {
            t.fill(black_box(id), &mut row);
            black_box(&mut row);
        }
        next += 1024;
    })
}

fn main() {
    let dims: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a dim"))
        .collect();
    let dims = if dims.is_empty() { vec![16, 64] } else { dims };
    let opts = [
        RowOptimizer::Sum,
        RowOptimizer::Sgd { lr: 0.1 },
        RowOptimizer::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.1,
            rowwise: false,
        },
        RowOptimizer::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.1,
            rowwise: true,
        },
        RowOptimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        RowOptimizer::Ftrl {
            alpha: 0.1,
            beta: 1.0,
            l1: 0.01,
            l2: 0.01,
        },
    ];
    println!("row optimizer apply, ns per row (median of 3 runs of >= 0.2 s CPU, {ROWS} rows in cache)");
    for &dim in &dims {
        for opt in opts {
            println!("  D = {dim:3}  {:16} {}", opt.name(), bench_apply(opt, dim));
        }
    }
    println!("initial values fill, ns per row (median of 3 runs of >= 0.2 s CPU)");
    for &dim in &dims {
        for (name, init) in [
            ("zeros", Init::Zeros),
            ("uniform", Init::Uniform { a: -0.1, b: 0.1 }),
            ("normal", Init::Normal { std: 0.1 }),
        ] {
            println!("  D = {dim:3}  {name:16} {}", bench_fill(init, dim));
        }
    }
}
