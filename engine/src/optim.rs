//! Fused optimizer passes over one chunk.
//!
//! Once all W contributions of a round are in the accumulator, one pass over
//! the chunk turns the sum into the new parameters (or into the mean, for
//! all-reduce jobs). Every pass reads and writes each buffer once. The
//! arithmetic is plain `f32` without fused multiply-add, so every build and
//! instruction set gives bit-identical results; the reference in the tests
//! is the same formula in `f64`. PROTOCOL.md §5.6 states these passes
//! operation by operation for workers written elsewhere;
//! engine/tests/rules/protocol_optimizers.rs checks it against them bit for
//! bit.

use phub_proto::spec::Optimizer;

/// The buffers of one chunk an optimizer pass touches.
#[derive(Debug)]
pub struct ChunkBufs<'a> {
    /// Sum of the round's contributions; turned into the result for sum/mean.
    pub acc: &'a mut [f32],
    /// Parameters (empty for sum/mean).
    pub params: &'a mut [f32],
    /// First state buffer: momentum, or Adam's first moment (else empty).
    pub s1: &'a mut [f32],
    /// Second state buffer: Adam's second moment (else empty).
    pub s2: &'a mut [f32],
}

/// Runs `opt` on a chunk for round `t` (>= 1) of a job with `workers` workers.
///
/// For [`Optimizer::Sum`] and [`Optimizer::Mean`] the result is left in
/// `acc`; for the others in `params`.
///
/// The same code is compiled for AVX-512 and AVX2 and the widest the CPU has
/// is used (the detection result is cached by std). Without fused
/// multiply-add contraction, which Rust never does on its own, every version
/// computes bit-identical results.
pub fn step(opt: &Optimizer, workers: u32, t: u32, b: ChunkBufs<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked on the line above.
            return unsafe { step_avx512(opt, workers, t, b) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked on the line above.
            return unsafe { step_avx2(opt, workers, t, b) };
        }
    }
    step_impl(opt, workers, t, b)
}

/// [`step`] compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn step_avx512(opt: &Optimizer, workers: u32, t: u32, b: ChunkBufs<'_>) {
    step_impl(opt, workers, t, b)
}

/// [`step`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn step_avx2(opt: &Optimizer, workers: u32, t: u32, b: ChunkBufs<'_>) {
    step_impl(opt, workers, t, b)
}

/// What [`step`] multiplies a sum of `workers` contributions by to average
/// it (the mean's result, and every optimizer's gradient): 1 / W, rounded
/// once. Paths that fuse the averaging into another pass use it too, so
/// their results stay bit-identical.
pub(crate) fn inv_workers(workers: u32) -> f32 {
    1.0 / workers as f32
}

#[inline(always)]
fn step_impl(opt: &Optimizer, workers: u32, t: u32, b: ChunkBufs<'_>) {
    let inv_w = inv_workers(workers);
    match *opt {
        Optimizer::Sum => {}
        Optimizer::Mean => {
            for a in b.acc.iter_mut() {
                *a *= inv_w;
            }
        }
        Optimizer::Sgd { lr, weight_decay: wd } => {
            for (w, a) in b.params.iter_mut().zip(b.acc.iter()) {
                let g = *a * inv_w + wd * *w;
                *w -= lr * g;
            }
        }
        Optimizer::Momentum {
            lr,
            momentum: mu,
            weight_decay: wd,
        } => {
            for ((w, m), a) in b.params.iter_mut().zip(b.s1.iter_mut()).zip(b.acc.iter()) {
                let g = *a * inv_w + wd * *w;
                *m = mu * *m - lr * g;
                *w += *m;
            }
        }
        Optimizer::Nesterov {
            lr,
            momentum: mu,
            weight_decay: wd,
        } => {
            for ((w, m), a) in b.params.iter_mut().zip(b.s1.iter_mut()).zip(b.acc.iter()) {
                let g = *a * inv_w + wd * *w;
                *m = mu * *m + g;
                *w -= lr * (g + mu * *m);
            }
        }
        Optimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => adam(b, inv_w, t, lr, beta1, beta2, eps, weight_decay, 0.0),
        Optimizer::Adamw {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => adam(b, inv_w, t, lr, beta1, beta2, eps, 0.0, lr * weight_decay),
    }
}

/// Adam with L2 decay `wd` folded into the gradient and decoupled decay
/// `decoupled` (= lr * weight_decay for AdamW) applied to the weights first.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn adam(
    b: ChunkBufs<'_>,
    inv_w: f32,
    t: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    wd: f32,
    decoupled: f32,
) {
    let t = t.max(1);
    let c1 = 1.0 / (1.0 - pow(beta1, t));
    let c2 = 1.0 / (1.0 - pow(beta2, t));
    let (d1, d2) = (1.0 - beta1, 1.0 - beta2);
    let keep = 1.0 - decoupled;
    for (((w, m), v), a) in b
        .params
        .iter_mut()
        .zip(b.s1.iter_mut())
        .zip(b.s2.iter_mut())
        .zip(b.acc.iter())
    {
        let wt = *w * keep;
        let g = *a * inv_w + wd * wt;
        *m = beta1 * *m + d1 * g;
        *v = beta2 * *v + d2 * (g * g);
        let mhat = *m * c1;
        let vhat = *v * c2;
        *w = wt - lr * mhat / (vhat.sqrt() + eps);
    }
}

/// `x` to the power `e` in `f32`, by square-and-multiply from the lowest
/// bit of `e` up, each product rounded (PROTOCOL.md §5.6 spells out the
/// same loop, so a worker in another language can compute Adam's bias
/// corrections bit for bit). For `e` below 2^31 this is what `f32::powi`
/// computes on x86-64 (compiler-builtins' `__powisf2`, a unit test checks
/// it), but `powi`'s precision is unspecified and its exponent an `i32`,
/// which rounds from 2^31 on would turn negative.
pub(crate) fn pow(mut x: f32, mut e: u32) -> f32 {
    let mut p = 1.0f32;
    loop {
        if e & 1 == 1 {
            p *= x;
        }
        e >>= 1;
        if e == 0 {
            return p;
        }
        x *= x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The textbook formulas in f64, one element at a time.
    fn reference(
        opt: &Optimizer,
        workers: u32,
        t: u32,
        acc: f64,
        w: &mut f64,
        m: &mut f64,
        v: &mut f64,
    ) -> f64 {
        let g0 = acc / f64::from(workers);
        match *opt {
            Optimizer::Sum => acc,
            Optimizer::Mean => g0,
            Optimizer::Sgd { lr, weight_decay } => {
                *w -= f64::from(lr) * (g0 + f64::from(weight_decay) * *w);
                *w
            }
            Optimizer::Momentum {
                lr,
                momentum,
                weight_decay,
            } => {
                *m = f64::from(momentum) * *m - f64::from(lr) * (g0 + f64::from(weight_decay) * *w);
                *w += *m;
                *w
            }
            Optimizer::Nesterov {
                lr,
                momentum,
                weight_decay,
            } => {
                let g = g0 + f64::from(weight_decay) * *w;
                *m = f64::from(momentum) * *m + g;
                *w -= f64::from(lr) * (g + f64::from(momentum) * *m);
                *w
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | Optimizer::Adamw {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let (lr, b1, b2, eps, wd) = (
                    f64::from(lr),
                    f64::from(beta1),
                    f64::from(beta2),
                    f64::from(eps),
                    f64::from(weight_decay),
                );
                let g = if matches!(opt, Optimizer::Adamw { .. }) {
                    *w -= lr * wd * *w;
                    g0
                } else {
                    g0 + wd * *w
                };
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let mhat = *m / (1.0 - b1.powi(t as i32));
                let vhat = *v / (1.0 - b2.powi(t as i32));
                *w -= lr * mhat / (vhat.sqrt() + eps);
                *w
            }
        }
    }

    pub(crate) fn all_optimizers() -> Vec<Optimizer> {
        vec![
            Optimizer::Sum,
            Optimizer::Mean,
            Optimizer::Sgd {
                lr: 0.05,
                weight_decay: 1e-3,
            },
            Optimizer::Momentum {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 1e-3,
            },
            Optimizer::Nesterov {
                lr: 0.05,
                momentum: 0.9,
                weight_decay: 1e-3,
            },
            Optimizer::Adam {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 1e-3,
            },
            Optimizer::Adamw {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 1e-2,
            },
        ]
    }

    #[test]
    fn every_optimizer_matches_the_f64_reference_over_several_steps() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let n = 1037;
        let workers = 3;
        for opt in all_optimizers() {
            let mut params: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (mut s1, mut s2) = (vec![0f32; n], vec![0f32; n]);
            let mut rw: Vec<f64> = params.iter().map(|&x| f64::from(x)).collect();
            let (mut rm, mut rv) = (vec![0f64; n], vec![0f64; n]);
            for t in 1..=5u32 {
                let mut acc: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let expect: Vec<f64> = (0..n)
                    .map(|i| {
                        reference(
                            &opt,
                            workers,
                            t,
                            f64::from(acc[i]),
                            &mut rw[i],
                            &mut rm[i],
                            &mut rv[i],
                        )
                    })
                    .collect();
                let (np, n1, n2) = match opt.state_buffers() {
                    _ if !opt.keeps_params() => (0, 0, 0),
                    0 => (n, 0, 0),
                    1 => (n, n, 0),
                    _ => (n, n, n),
                };
                step(
                    &opt,
                    workers,
                    t,
                    ChunkBufs {
                        acc: &mut acc,
                        params: &mut params[..np],
                        s1: &mut s1[..n1],
                        s2: &mut s2[..n2],
                    },
                );
                let got = if opt.keeps_params() { &params } else { &acc };
                for i in 0..n {
                    let (g, e) = (f64::from(got[i]), expect[i]);
                    assert!(
                        (g - e).abs() <= 1e-5 * e.abs().max(1.0),
                        "{} t={t} i={i}: got {g}, f64 reference {e}",
                        opt.name()
                    );
                }
                if !opt.keeps_params() {
                    // sum/mean have no state: restart the reference each step.
                    rw.iter_mut().for_each(|x| *x = 0.0);
                }
            }
        }
    }

    #[test]
    fn pow_is_square_and_multiply_as_powi_computes_it() {
        use std::hint::black_box;
        // black_box: a constant-folded powi is computed differently.
        let powi = |x: f32, e: u32| black_box(x).powi(black_box(e as i32));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for _ in 0..20_000 {
            let x: f32 = rng.gen_range(0.0..1.0);
            let e: u32 = rng.gen_range(1..50_000);
            assert_eq!(pow(x, e).to_bits(), powi(x, e).to_bits(), "{x}^{e}");
        }
        for e in 1..2000 {
            for x in [0.5f32, 0.75, 0.9, 0.99, 0.999] {
                assert_eq!(pow(x, e).to_bits(), powi(x, e).to_bits(), "{x}^{e}");
            }
        }
        // Not the running product: 0.9^7 differs.
        let running = (0..7).fold(1.0f32, |p, _| p * black_box(0.9f32));
        assert_ne!(pow(0.9, 7).to_bits(), running.to_bits());
        // Rounds a u32 holds and an i32 does not.
        assert_eq!(pow(0.9, u32::MAX - 1), 0.0);
        assert_eq!(pow(0.9, 0), 1.0);
    }
}
