//! What the results must be, computed apart from the engine from
//! PROTOCOL.md §5's rules: a BSP round sums every rank's gradient (as the
//! wire carries it) and runs the optimizer once over the sum.
//!
//! Gradients are small integers, so their sums are exact in any order:
//! the reference need not know the order datagrams arrived in, and results
//! must match it bit for bit.

use phub_engine::optim::{self, ChunkBufs};
use phub_proto::dtype::{decode, encode};
use phub_proto::spec::Optimizer;
use phub_proto::Dtype;

/// Rank `rank`'s gradient for element `elem` of key `key` in round (or
/// clock) `round`: an integer in [-8, 8], exact in every dtype.
pub fn grad(rank: u16, key: u32, elem: u64, round: u32) -> f32 {
    let mut h = (u64::from(rank) << 48) ^ (u64::from(key) << 40) ^ (elem << 8) ^ u64::from(round);
    h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^= h >> 29;
    // Cast: h % 17 < 17.
    #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
    let g = (h % 17) as i32 - 8;
    // Cast: |g| <= 8, exact in f32.
    #[allow(clippy::cast_precision_loss)]
    let g = g as f32;
    g
}

/// Rank `rank`'s gradient for all of key `key` (`elements` long) in `round`.
pub fn grads(rank: u16, key: u32, elements: usize, round: u32) -> Vec<f32> {
    (0..elements as u64).map(|e| grad(rank, key, e, round)).collect()
}

/// `v` rounded through the wire type, as the other side decodes it.
pub fn through_wire(dtype: Dtype, v: &[f32]) -> Vec<f32> {
    let mut bytes = vec![0u8; v.len() * dtype.size()];
    encode(dtype, v, &mut bytes);
    let mut out = vec![0f32; v.len()];
    decode(dtype, &bytes, &mut out);
    out
}

/// A BSP job's results: per key, per round 0..=rounds, the values every
/// rank must receive (decoded from the wire type). `init` is rank 0's
/// INIT per key.
pub fn bsp(
    dtype: Dtype,
    optimizer: &Optimizer,
    workers: u16,
    init: &[Vec<f32>],
    rounds: u32,
) -> Vec<Vec<Vec<f32>>> {
    init.iter()
        .enumerate()
        .map(|(k, init)| {
            // Cast: keys are numbered by u32 on the wire.
            #[allow(clippy::cast_possible_truncation)]
            let key = k as u32;
            let n = init.len();
            let mut params = through_wire(dtype, init);
            let (mut s1, mut s2) = (vec![0f32; n], vec![0f32; n]);
            let mut out = vec![params.clone()];
            for r in 1..=rounds {
                let mut acc = vec![0f32; n];
                for rank in 0..workers {
                    for (a, x) in acc.iter_mut().zip(through_wire(dtype, &grads(rank, key, n, r))) {
                        *a += x;
                    }
                }
                let keeps = optimizer.keeps_params();
                let (ns1, ns2) = match optimizer.state_buffers() {
                    0 => (0, 0),
                    1 => (n, 0),
                    _ => (n, n),
                };
                let mut empty: Vec<f32> = Vec::new();
                // The engine steps chunk by chunk; every pass is element-wise,
                // so one step over the whole key is the same arithmetic.
                optim::step(
                    optimizer,
                    u32::from(workers),
                    r,
                    ChunkBufs {
                        acc: &mut acc,
                        params: if keeps { &mut params } else { &mut empty },
                        s1: &mut s1[..ns1],
                        s2: &mut s2[..ns2],
                    },
                );
                let res = if keeps { params.clone() } else { acc };
                out.push(through_wire(dtype, &res));
            }
            out
        })
        .collect()
}

/// One of each optimizer, with the hyperparameters the cases use.
pub fn optimizers() -> Vec<Optimizer> {
    vec![
        Optimizer::Sum,
        Optimizer::Mean,
        Optimizer::Sgd {
            lr: 0.01,
            weight_decay: 1e-3,
        },
        Optimizer::Momentum {
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 1e-3,
        },
        Optimizer::Nesterov {
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 1e-3,
        },
        Optimizer::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-4,
        },
        Optimizer::Adamw {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        },
    ]
}

/// Bounded delay τ = 0 with SGD (no weight decay): per key, per clock
/// 0..=rounds, the values after every rank's pushes of clocks up to it,
/// as BSP `sum` then `w -= lr * sum` computes them clock by clock
/// (exact when `lr` is a power of two: every value is dyadic).
pub fn sum_then_sgd(
    dtype: Dtype,
    lr: f32,
    workers: u16,
    init: &[Vec<f32>],
    rounds: u32,
) -> Vec<Vec<Vec<f32>>> {
    init.iter()
        .enumerate()
        .map(|(k, init)| {
            // Cast: keys are numbered by u32 on the wire.
            #[allow(clippy::cast_possible_truncation)]
            let key = k as u32;
            let mut w = through_wire(dtype, init);
            let mut out = vec![through_wire(dtype, &w)];
            for c in 1..=rounds {
                let mut sum = vec![0f32; w.len()];
                for rank in 0..workers {
                    for (s, g) in sum
                        .iter_mut()
                        .zip(through_wire(dtype, &grads(rank, key, w.len(), c)))
                    {
                        *s += g;
                    }
                }
                for (x, s) in w.iter_mut().zip(&sum) {
                    *x -= lr * s;
                }
                out.push(through_wire(dtype, &w));
            }
            out
        })
        .collect()
}
