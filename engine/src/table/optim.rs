//! Row optimizers (issue 32, PROTOCOL.md §10.5): what a round's aggregated
//! gradient does to one stored row of a table.
//!
//! Layer: pure. A row's round gradient `a` is the sum of the contributions
//! the round received for that row, in arrival order, not divided by the
//! worker count: how many ranks push a row differs from row to row and
//! round to round, so there is no W to divide by (a worker that wants a
//! mean scales its rows before pushing). A row that no contribution
//! touched in a round is not updated (lazy: its optimizer state, Adam's
//! step count included, stays as it was).
//!
//! Every formula is plain `f32` arithmetic without fused multiply-add, in
//! the order PROTOCOL.md §10.5 writes it, so every build and instruction
//! set gives the same bits; engine/tests/rules/protocol_row_optimizers.rs runs
//! the document's blocks beside this code and checks them bit for bit.
//! The loops run over slices cut to the row's length, so the compiler
//! drops the bounds checks and vectorises them; the only per-element
//! choice is FTRL's clamp of `z` to [-l1, l1] (a min and a max).
//!
//! State layout after a row's `dim` values (`state_len` words):
//! `sum`, `sgd`: none; `adagrad`: `h` per element (dim); `adagrad`
//! row-wise: `h` (1); `adam`: `m` (dim), `v` (dim), then the row's step
//! count `t` (1, an `f32` holding an integer: exact up to 2^24, where
//! `t + 1` rounds back to `t`, so the count stops there); `ftrl`: `z`
//! (dim), `n` (dim).

use thiserror::Error;

use super::RowUpdate;
#[cfg(test)]
use crate::optim::pow;

/// A table's optimizer (the spec's `optimizer` of a table key). The
/// parameters are the `f32` values of the spec's numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowOptimizer {
    /// `w = w + a`: the stored row accumulates what is pushed (a table of
    /// counts or sums).
    Sum,
    /// `w = w - lr * a`.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Adagrad: one accumulator per element, or one per row as FBGEMM's
    /// row-wise Adagrad keeps it (growing by the mean of `a * a` over the
    /// row).
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Added to the accumulator's square root.
        eps: f32,
        /// The accumulator of a row being stored for the first time.
        initial_accumulator: f32,
        /// One accumulator per row instead of one per element.
        rowwise: bool,
    },
    /// Lazy Adam: moments and step count per row, updated only when the
    /// row is touched; bias corrections use the row's own step count.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First moment's decay.
        beta1: f32,
        /// Second moment's decay.
        beta2: f32,
        /// Added to the square root of the corrected second moment.
        eps: f32,
    },
    /// FTRL-proximal per coordinate (McMahan et al., KDD 2013, Algorithm 1).
    Ftrl {
        /// Learning rate's scale.
        alpha: f32,
        /// Learning rate's offset.
        beta: f32,
        /// L1 strength: `|z| <= l1` gives an exact zero.
        l1: f32,
        /// L2 strength.
        l2: f32,
    },
}

/// A [`RowOptimizer`] that cannot be used: the field, its value and what
/// would be accepted.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("row optimizer {optimizer}: {field} = {value}: want {want}")]
pub struct RowOptimizerError {
    /// The optimizer's name ([`RowOptimizer::name`]).
    pub optimizer: &'static str,
    /// The hyper-parameter.
    pub field: &'static str,
    /// Its value.
    pub value: f32,
    /// What would be accepted.
    pub want: &'static str,
}

impl RowOptimizer {
    /// The name of the optimizer's block in PROTOCOL.md §10.5.
    pub fn name(&self) -> &'static str {
        match self {
            RowOptimizer::Sum => "sum",
            RowOptimizer::Sgd { .. } => "sgd",
            RowOptimizer::Adagrad { rowwise: false, .. } => "adagrad",
            RowOptimizer::Adagrad { rowwise: true, .. } => "adagrad-rowwise",
            RowOptimizer::Adam { .. } => "adam",
            RowOptimizer::Ftrl { .. } => "ftrl",
        }
    }

    /// Checks the hyper-parameters: finite, and such that a zero gradient
    /// on a fresh row divides no zero by zero (Adagrad: `eps > 0` or
    /// `initial_accumulator > 0`; Adam: `eps > 0`; FTRL: `beta > 0` or
    /// `l2 > 0`).
    pub fn check(&self) -> Result<(), RowOptimizerError> {
        let optimizer = self.name();
        let err = |field, value, want| {
            Err(RowOptimizerError {
                optimizer,
                field,
                value,
                want,
            })
        };
        let finite = |field: &'static str, value: f32| {
            if value.is_finite() {
                Ok(())
            } else {
                err(field, value, "a finite number")
            }
        };
        match *self {
            RowOptimizer::Sum => Ok(()),
            RowOptimizer::Sgd { lr } => finite("lr", lr),
            RowOptimizer::Adagrad {
                lr,
                eps,
                initial_accumulator,
                ..
            } => {
                finite("lr", lr)?;
                if !(eps.is_finite() && eps >= 0.0) {
                    return err("eps", eps, "a finite eps >= 0");
                }
                if !(initial_accumulator.is_finite() && initial_accumulator >= 0.0) {
                    return err(
                        "initial_accumulator",
                        initial_accumulator,
                        "a finite initial_accumulator >= 0",
                    );
                }
                if eps == 0.0 && initial_accumulator == 0.0 {
                    return err("eps", eps, "eps > 0 when initial_accumulator is 0");
                }
                Ok(())
            }
            RowOptimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                finite("lr", lr)?;
                if !(0.0..1.0).contains(&beta1) {
                    return err("beta1", beta1, "0 <= beta1 < 1");
                }
                if !(0.0..1.0).contains(&beta2) {
                    return err("beta2", beta2, "0 <= beta2 < 1");
                }
                if !(eps.is_finite() && eps > 0.0) {
                    return err("eps", eps, "a finite eps > 0");
                }
                Ok(())
            }
            RowOptimizer::Ftrl { alpha, beta, l1, l2 } => {
                if !(alpha.is_finite() && alpha > 0.0) {
                    return err("alpha", alpha, "a finite alpha > 0");
                }
                for (field, x) in [("beta", beta), ("l1", l1), ("l2", l2)] {
                    if !(x.is_finite() && x >= 0.0) {
                        return err(field, x, "a finite number >= 0");
                    }
                }
                if beta == 0.0 && l2 == 0.0 {
                    return err("beta", beta, "beta > 0 when l2 is 0");
                }
                Ok(())
            }
        }
    }
}

impl RowUpdate for RowOptimizer {
    fn state_len(&self, dim: usize) -> usize {
        match self {
            RowOptimizer::Sum | RowOptimizer::Sgd { .. } => 0,
            RowOptimizer::Adagrad { rowwise: false, .. } => dim,
            RowOptimizer::Adagrad { rowwise: true, .. } => 1,
            RowOptimizer::Adam { .. } => 2 * dim + 1,
            RowOptimizer::Ftrl { .. } => 2 * dim,
        }
    }

    fn init_state(&self, state: &mut [f32]) {
        match *self {
            RowOptimizer::Adagrad {
                initial_accumulator, ..
            } => state.fill(initial_accumulator),
            _ => state.fill(0.0),
        }
    }

    #[inline]
    fn apply(&self, values: &mut [f32], state: &mut [f32], grad: &[f32]) {
        let dim = values.len();
        debug_assert_eq!(grad.len(), dim, "a gradient of the row's length");
        debug_assert_eq!(state.len(), self.state_len(dim), "{}'s state", self.name());
        // Cut every slice to the row's length once: the loops below then
        // run without bounds checks.
        let grad = &grad[..dim];
        match *self {
            RowOptimizer::Sum => {
                for (w, a) in values.iter_mut().zip(grad) {
                    *w += *a;
                }
            }
            RowOptimizer::Sgd { lr } => {
                for (w, a) in values.iter_mut().zip(grad) {
                    *w -= lr * *a;
                }
            }
            RowOptimizer::Adagrad {
                lr,
                eps,
                rowwise: false,
                ..
            } => {
                let h = &mut state[..dim];
                for ((w, h), a) in values.iter_mut().zip(h.iter_mut()).zip(grad) {
                    *h += *a * *a;
                    *w -= lr * *a / (h.sqrt() + eps);
                }
            }
            RowOptimizer::Adagrad {
                lr,
                eps,
                rowwise: true,
                ..
            } => {
                // Cast: a row's dim is below 2^24 (the store's rows are far
                // shorter), exact in f32.
                #[allow(clippy::cast_precision_loss)]
                let d = dim as f32;
                let h = &mut state[0];
                *h += sum8_squares(grad) / d;
                let k = lr / (h.sqrt() + eps);
                for (w, a) in values.iter_mut().zip(grad) {
                    *w -= *a * k;
                }
            }
            RowOptimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let (m, rest) = state.split_at_mut(dim);
                let (v, t) = rest.split_at_mut(dim);
                let t = &mut t[0];
                *t += 1.0;
                // Cast: t holds an integer in 1..=2^24 (it stops there).
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let steps = *t as u32;
                let c1 = 1.0 / (1.0 - pow_underflow_early(beta1, steps));
                let c2 = 1.0 / (1.0 - pow_underflow_early(beta2, steps));
                let (d1, d2) = (1.0 - beta1, 1.0 - beta2);
                for (((w, m), v), a) in values.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(grad) {
                    *m = beta1 * *m + d1 * *a;
                    *v = beta2 * *v + d2 * (*a * *a);
                    *w -= lr * (*m * c1) / ((*v * c2).sqrt() + eps);
                }
            }
            RowOptimizer::Ftrl { alpha, beta, l1, l2 } => {
                let nl1 = 0.0 - l1;
                let (z, n) = state.split_at_mut(dim);
                let n = &mut n[..dim];
                for (((w, z), n), a) in values.iter_mut().zip(z.iter_mut()).zip(n.iter_mut()).zip(grad) {
                    let u = *n + *a * *a;
                    let su = u.sqrt();
                    let o = (su - n.sqrt()) / alpha;
                    *z = *z + *a - o * *w;
                    *n = u;
                    let c = *z - max(min(*z, l1), nl1);
                    *w = 0.0 - c / ((beta + su) / alpha + l2);
                }
            }
        }
    }
}

/// §5.6's `pow(x, n)` (square-and-multiply from the lowest bit of `n`,
/// each product rounded), bit for bit, but returning as soon as the square
/// would underflow: once |x| < 2^-75, every later square is +0 (x * x <
/// 2^-150 rounds to +0), and the bits of `n` still to come hold at least
/// one 1, so the result is `p * +0`. Lazy Adam's rows reach such step
/// counts (0.9^t underflows from t ≈ 900), and an underflowing multiply
/// costs a microcode assist on x86 (pow(0.9, ~3000) took 165 ns, this
/// 88 ns, in a loop on the development machine).
#[inline(always)]
fn pow_underflow_early(mut x: f32, mut n: u32) -> f32 {
    const TINY: f32 = f32::from_bits(0x1A00_0000); // 2^-75
    let mut p = 1.0f32;
    loop {
        if n & 1 == 1 {
            p *= x;
        }
        n >>= 1;
        if n == 0 {
            return p;
        }
        if x.abs() < TINY {
            return p * 0.0;
        }
        x *= x;
    }
}

/// `x` if `x < y`, else `y` (PROTOCOL.md §10.5's `min`; x86's `minps`).
#[inline(always)]
fn min(x: f32, y: f32) -> f32 {
    if x < y {
        x
    } else {
        y
    }
}

/// `x` if `x > y`, else `y` (PROTOCOL.md §10.5's `max`; x86's `maxps`).
#[inline(always)]
fn max(x: f32, y: f32) -> f32 {
    if x > y {
        x
    } else {
        y
    }
}

/// §10.5's `sum8(a * a)`: eight partial sums, `p[j] = +0 + x[j] + x[j +
/// 8] + ...` in increasing index, then `((p0 + p4) + (p2 + p6)) + ((p1 +
/// p5) + (p3 + p7))`: the order of an 8-lane vector sum and its halving
/// reduction, fixed so that every build gets the same bits.
#[inline(always)]
fn sum8_squares(a: &[f32]) -> f32 {
    let mut p = [0.0f32; 8];
    let mut chunks = a.chunks_exact(8);
    for c in &mut chunks {
        for (p, x) in p.iter_mut().zip(c) {
            *p += *x * *x;
        }
    }
    for (p, x) in p.iter_mut().zip(chunks.remainder()) {
        *p += *x * *x;
    }
    ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))
}

#[cfg(test)]
// The reference below is written as the document writes it (`w = w - x`,
// indexed element by element), not as idiomatic Rust.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::assign_op_pattern,
    clippy::needless_range_loop
)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn adagrad(rowwise: bool) -> RowOptimizer {
        RowOptimizer::Adagrad {
            lr: 0.3,
            eps: 1e-8,
            initial_accumulator: 0.1,
            rowwise,
        }
    }
    const ADAM: RowOptimizer = RowOptimizer::Adam {
        lr: 0.3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    const FTRL: RowOptimizer = RowOptimizer::Ftrl {
        alpha: 0.3,
        beta: 1.0,
        l1: 0.05,
        l2: 0.01,
    };

    fn every_kind() -> Vec<RowOptimizer> {
        vec![
            RowOptimizer::Sum,
            RowOptimizer::Sgd { lr: 0.3 },
            adagrad(false),
            adagrad(true),
            ADAM,
            FTRL,
        ]
    }

    /// A stored row: values and state.
    #[derive(Clone)]
    struct Row {
        w: Vec<f32>,
        s: Vec<f32>,
    }

    fn fresh(opt: &RowOptimizer, w: &[f32]) -> Row {
        let mut s = vec![f32::NAN; opt.state_len(w.len())];
        opt.init_state(&mut s);
        Row { w: w.to_vec(), s }
    }

    /// The PROTOCOL.md §10.5 text, written out per optimizer element by
    /// element in f32 (no f64, no shared helper with the code above except
    /// `pow`, which §5.6 defines and its own test checks).
    fn reference(opt: &RowOptimizer, r: &mut Row, a: &[f32]) {
        let d = a.len();
        match *opt {
            RowOptimizer::Sum => (0..d).for_each(|i| r.w[i] = r.w[i] + a[i]),
            RowOptimizer::Sgd { lr } => (0..d).for_each(|i| r.w[i] = r.w[i] - lr * a[i]),
            RowOptimizer::Adagrad {
                lr,
                eps,
                rowwise: false,
                ..
            } => {
                for i in 0..d {
                    r.s[i] = r.s[i] + a[i] * a[i];
                    r.w[i] = r.w[i] - lr * a[i] / (r.s[i].sqrt() + eps);
                }
            }
            RowOptimizer::Adagrad {
                lr,
                eps,
                rowwise: true,
                ..
            } => {
                let mut p = [0.0f32; 8];
                for i in 0..d {
                    p[i % 8] = p[i % 8] + a[i] * a[i];
                }
                let q = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
                r.s[0] = r.s[0] + q / d as f32;
                let k = lr / (r.s[0].sqrt() + eps);
                (0..d).for_each(|i| r.w[i] = r.w[i] - a[i] * k);
            }
            RowOptimizer::Adam {
                lr,
                beta1: b1,
                beta2: b2,
                eps,
            } => {
                r.s[2 * d] = r.s[2 * d] + 1.0;
                let t = r.s[2 * d] as u32;
                let c1 = 1.0 / (1.0 - pow(b1, t));
                let c2 = 1.0 / (1.0 - pow(b2, t));
                for i in 0..d {
                    let (m, v) = (r.s[i], r.s[d + i]);
                    let m = b1 * m + (1.0 - b1) * a[i];
                    let v = b2 * v + (1.0 - b2) * (a[i] * a[i]);
                    r.w[i] = r.w[i] - lr * (m * c1) / ((v * c2).sqrt() + eps);
                    (r.s[i], r.s[d + i]) = (m, v);
                }
            }
            RowOptimizer::Ftrl { alpha, beta, l1, l2 } => {
                for i in 0..d {
                    let (z, n, g) = (r.s[i], r.s[d + i], a[i]);
                    let sigma = ((n + g * g).sqrt() - n.sqrt()) / alpha;
                    let z = z + g - sigma * r.w[i];
                    let n = n + g * g;
                    r.w[i] = if z.abs() <= l1 {
                        0.0
                    } else {
                        let sign = if z < 0.0 { -1.0 } else { 1.0 };
                        -(z - sign * l1) / ((beta + n.sqrt()) / alpha + l2)
                    };
                    (r.s[i], r.s[d + i]) = (z, n);
                }
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_optimizer_is_the_reference_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for opt in every_kind() {
            opt.check().unwrap();
            for dim in [1usize, 3, 8, 15, 16, 17, 64] {
                let w0: Vec<f32> = (0..dim).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let (mut got, mut want) = (fresh(&opt, &w0), fresh(&opt, &w0));
                for _ in 0..20 {
                    let a: Vec<f32> = (0..dim).map(|_| rng.gen_range(-3.0..3.0)).collect();
                    opt.apply(&mut got.w, &mut got.s, &a);
                    reference(&opt, &mut want, &a);
                    assert_eq!(bits(&got.w), bits(&want.w), "{} dim {dim}: values", opt.name());
                    assert_eq!(bits(&got.s), bits(&want.s), "{} dim {dim}: state", opt.name());
                }
            }
        }
    }

    #[test]
    fn state_lengths_and_initial_state() {
        let want = [0, 0, 16, 1, 33, 32];
        for (opt, n) in every_kind().iter().zip(want) {
            assert_eq!(opt.state_len(16), n, "{}", opt.name());
        }
        for rowwise in [false, true] {
            let r = fresh(&adagrad(rowwise), &[0.0; 5]);
            assert!(
                r.s.iter().all(|&h| h == 0.1),
                "adagrad starts at initial_accumulator"
            );
        }
        assert!(fresh(&ADAM, &[0.0; 5]).s.iter().all(|&x| x.to_bits() == 0));
        assert!(fresh(&FTRL, &[0.0; 5]).s.iter().all(|&x| x.to_bits() == 0));
    }

    /// Lazy Adam: the bias corrections follow each row's own count of
    /// updates, not the rounds.
    #[test]
    fn adam_counts_steps_per_row() {
        let g = [0.5f32, -1.0, 2.0];
        let (mut often, mut once) = (fresh(&ADAM, &[0.0; 3]), fresh(&ADAM, &[0.0; 3]));
        for _ in 0..3 {
            ADAM.apply(&mut often.w, &mut often.s, &g);
        }
        ADAM.apply(&mut once.w, &mut once.s, &g);
        assert_eq!((often.s[6], once.s[6]), (3.0, 1.0), "step counts");
        // A row's first update with bias correction moves each element by
        // lr (m * c1 = a, v * c2 = a * a), whatever round it comes in.
        for (w, a) in once.w.iter().zip(g) {
            assert!((w + 0.3 * a.signum()).abs() < 1e-6, "{w}");
        }
        // Its second update equals the other row's second one, not its
        // fourth.
        let mut twice = fresh(&ADAM, &[0.0; 3]);
        ADAM.apply(&mut twice.w, &mut twice.s, &g);
        ADAM.apply(&mut twice.w, &mut twice.s, &g);
        ADAM.apply(&mut once.w, &mut once.s, &g);
        assert_eq!(bits(&once.w), bits(&twice.w));
        assert_ne!(bits(&once.w), bits(&often.w));
        // The count stops at 2^24, where t + 1 rounds to t.
        let mut far = fresh(&ADAM, &[0.0; 3]);
        far.s[6] = 16_777_216.0;
        ADAM.apply(&mut far.w, &mut far.s, &g);
        assert_eq!(far.s[6], 16_777_216.0);
    }

    /// FTRL's L1: while |z| <= l1 the weight is exactly +0.
    #[test]
    fn ftrl_with_a_large_l1_gives_exact_zeros() {
        let opt = RowOptimizer::Ftrl {
            alpha: 0.1,
            beta: 1.0,
            l1: 1e3,
            l2: 0.0,
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let mut r = fresh(&opt, &[0.0; 16]);
        for _ in 0..50 {
            let a: Vec<f32> = (0..16).map(|_| rng.gen_range(-3.0..3.0)).collect();
            opt.apply(&mut r.w, &mut r.s, &a);
            assert!(r.w.iter().all(|w| w.to_bits() == 0), "{:?}", r.w);
        }
        // With l1 small the same gradients give non-zero weights of the
        // sign opposite to z.
        let opt = RowOptimizer::Ftrl {
            alpha: 0.1,
            beta: 1.0,
            l1: 0.01,
            l2: 0.0,
        };
        let mut r = fresh(&opt, &[0.0; 4]);
        opt.apply(&mut r.w, &mut r.s, &[1.0, -1.0, 0.005, 0.0]);
        assert!(r.w[0] < 0.0 && r.w[1] > 0.0, "{:?}", r.w);
        assert_eq!(bits(&r.w[2..]), [0, 0], "|z| <= l1: +0");
    }

    /// A zero gradient on a fresh row whose accumulators are zero: eps
    /// (added after the square root) keeps every denominator positive.
    #[test]
    fn a_zero_accumulator_gives_no_nan() {
        let opts = [
            RowOptimizer::Adagrad {
                lr: 0.1,
                eps: 1e-10,
                initial_accumulator: 0.0,
                rowwise: false,
            },
            RowOptimizer::Adagrad {
                lr: 0.1,
                eps: 1e-10,
                initial_accumulator: 0.0,
                rowwise: true,
            },
            ADAM,
            RowOptimizer::Ftrl {
                alpha: 0.1,
                beta: 0.0,
                l1: 0.0,
                l2: 1e-3,
            },
        ];
        for opt in opts {
            opt.check().unwrap();
            let mut r = fresh(&opt, &[0.25, -0.5, 0.0, 1.0]);
            opt.apply(&mut r.w, &mut r.s, &[0.0; 4]);
            assert!(
                r.w.iter().chain(&r.s).all(|x| !x.is_nan()),
                "{}: {:?} {:?}",
                opt.name(),
                r.w,
                r.s
            );
            if !matches!(opt, RowOptimizer::Ftrl { .. }) {
                assert_eq!(r.w, [0.25, -0.5, 0.0, 1.0], "{}", opt.name());
            }
        }
    }

    #[test]
    fn hyper_parameters_that_would_divide_zero_by_zero_are_refused() {
        let e = RowOptimizer::Adagrad {
            lr: 0.1,
            eps: 0.0,
            initial_accumulator: 0.0,
            rowwise: true,
        }
        .check()
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "row optimizer adagrad-rowwise: eps = 0: want eps > 0 when initial_accumulator is 0"
        );
        let e = RowOptimizer::Ftrl {
            alpha: 0.1,
            beta: 0.0,
            l1: 0.0,
            l2: 0.0,
        }
        .check()
        .unwrap_err();
        assert_eq!(e.field, "beta");
        let e = RowOptimizer::Adam {
            lr: 0.1,
            beta1: 1.0,
            beta2: 0.9,
            eps: 1e-8,
        }
        .check()
        .unwrap_err();
        assert_eq!((e.field, e.want), ("beta1", "0 <= beta1 < 1"));
        assert!(RowOptimizer::Sgd { lr: f32::NAN }.check().is_err());
    }

    #[test]
    fn pow_underflow_early_is_pow_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        for _ in 0..200_000 {
            let x: f32 = match rng.gen_range(0..4) {
                0 => rng.gen_range(0.0..1.0),
                1 => rng.gen_range(0.9..1.0),
                2 => rng.gen_range(-1.5..1.5),
                _ => rng.gen_range(0.0..1e-20),
            };
            let n = rng.gen_range(0..(1u32 << 25));
            assert_eq!(
                pow_underflow_early(x, n).to_bits(),
                pow(x, n).to_bits(),
                "{x}^{n}"
            );
        }
        for x in [
            0.0f32,
            -0.0,
            2e-23,
            -2e-23,
            2.6e-23,
            f32::NAN,
            f32::INFINITY,
            1e30,
            -1e30,
        ] {
            for n in [0u32, 1, 2, 3, 4, 5, 7, 8, 1000, u32::MAX] {
                let (a, b) = (pow_underflow_early(x, n), pow(x, n));
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{x}^{n}: {a} vs {b}"
                );
            }
        }
    }

    /// Row-wise Adagrad's sum is the stated 8-lane order, which is not the
    /// running sum: a row where the two differ.
    #[test]
    fn the_rowwise_sum_is_the_eight_lane_order() {
        let c: Vec<f32> = (0..16).map(|i| 1.0 + (i as f32) * 0.37).collect();
        let running = c.iter().fold(0.0f32, |s, x| s + x * x);
        let lanes = sum8_squares(&c);
        assert_ne!(running.to_bits(), lanes.to_bits(), "{running} {lanes}");
        let mut p = [0.0f32; 8];
        for (i, x) in c.iter().enumerate() {
            p[i % 8] += x * x;
        }
        let tree = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
        assert_eq!(lanes.to_bits(), tree.to_bits());
    }
}
