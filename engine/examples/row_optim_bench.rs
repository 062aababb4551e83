//! Nanoseconds per row of the row optimizers' `apply` and of the initial
//! values' `fill` (issue 32): the optimizer alone, rows in cache, no store.
//!
//! `cargo run --release -p phub-engine --example row_optim_bench [-- DIM...]`
//!
//! For each optimizer and dim: 4096 rows (values and state in one slab,
//! laid out as a row store lays them: values then state per row), each
//! updated with its own gradient; passes over all rows until at least
//! 0.2 s have gone by; the figure is the median of 3 such runs, in ns per
//! row update. The store's hashing and cache misses come on top (the
//! issue's target, 10 M row updates/s per lcore, leaves 100 ns a row for
//! all of it).

use std::hint::black_box;
use std::time::{Duration, Instant};

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

fn median3(mut f: impl FnMut() -> f64) -> f64 {
    let mut v = [f(), f(), f()];
    v.sort_by(f64::total_cmp);
    v[1]
}

fn bench_apply(opt: RowOptimizer, dim: usize) -> f64 {
    let stride = dim + opt.state_len(dim);
    let mut rng = Lcg(7);
    let mut slab = vec![0f32; ROWS * stride];
    for row in slab.chunks_exact_mut(stride) {
        let (w, s) = row.split_at_mut(dim);
        w.iter_mut().for_each(|x| *x = rng.next());
        opt.init_state(s);
    }
    let grads: Vec<f32> = (0..ROWS * dim).map(|_| rng.next() * 0.01).collect();
    median3(|| {
        let start = Instant::now();
        let mut rows = 0usize;
        while start.elapsed() < Duration::from_millis(200) {
            for (row, g) in slab.chunks_exact_mut(stride).zip(grads.chunks_exact(dim)) {
                let (w, s) = row.split_at_mut(dim);
                black_box(&opt).apply(w, s, g);
            }
            black_box(&mut slab);
            rows += ROWS;
        }
        start.elapsed().as_nanos() as f64 / rows as f64
    })
}

fn bench_fill(init: Init, dim: usize) -> f64 {
    let t = TableInit::new(init, 0x5eed, 1).unwrap();
    let mut row = vec![0f32; dim];
    median3(|| {
        let start = Instant::now();
        let mut rows = 0u64;
        while start.elapsed() < Duration::from_millis(200) {
            for id in rows..rows + 1024 {
                t.fill(black_box(id), &mut row);
                black_box(&mut row);
            }
            rows += 1024;
        }
        start.elapsed().as_nanos() as f64 / rows as f64
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
    println!("row optimizer apply, ns per row (median of 3 runs of >= 0.2 s, {ROWS} rows in cache)");
    for &dim in &dims {
        for opt in opts {
            println!(
                "  D = {dim:3}  {:16} {:7.2} ns",
                opt.name(),
                bench_apply(opt, dim)
            );
        }
    }
    println!("initial values fill, ns per row (median of 3 runs of >= 0.2 s)");
    for &dim in &dims {
        for (name, init) in [
            ("zeros", Init::Zeros),
            ("uniform", Init::Uniform { a: -0.1, b: 0.1 }),
            ("normal", Init::Normal { std: 0.1 }),
        ] {
            println!("  D = {dim:3}  {name:16} {:7.2} ns", bench_fill(init, dim));
        }
    }
}
