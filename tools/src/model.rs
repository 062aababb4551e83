//! A small real model for the demo and the end-to-end tests: a one-hidden-
//! layer MLP (ReLU, softmax cross-entropy) on a generated, seeded
//! classification data set (Gaussian clusters, one per class).
//!
//! Everything is plain `f32` loops: deterministic, no dependencies.

/// A labelled data set, row-major.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Features, `n * dim`.
    pub x: Vec<f32>,
    /// Labels, `n`.
    pub y: Vec<u8>,
    /// Features per sample.
    pub dim: usize,
    /// Number of classes.
    pub classes: usize,
}

/// SplitMix64: a tiny seeded generator, so data is the same everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

impl Dataset {
    /// `n` samples of `dim` features in `classes` overlapping Gaussian clusters.
    pub fn generate(seed: u64, n: usize, dim: usize, classes: usize) -> Dataset {
        let mut rng = Rng::new(seed);
        let centers: Vec<f32> = (0..classes * dim).map(|_| rng.normal() * 0.3).collect();
        let mut x = Vec::with_capacity(n * dim);
        let mut y = Vec::with_capacity(n);
        for i in 0..n {
            let c = i % classes;
            for d in 0..dim {
                x.push(centers[c * dim + d] + rng.normal());
            }
            y.push(c as u8);
        }
        Dataset { x, y, dim, classes }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
}

/// The MLP's shape. Its parameters are four tensors (keys 0..4): W1
/// (hidden x dim), b1 (hidden), W2 (classes x hidden), b2 (classes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mlp {
    /// Input features.
    pub dim: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Output classes.
    pub classes: usize,
}

impl Mlp {
    /// Element count of each parameter tensor, in key order.
    pub fn sizes(&self) -> [usize; 4] {
        [
            self.hidden * self.dim,
            self.hidden,
            self.classes * self.hidden,
            self.classes,
        ]
    }

    /// Names of the tensors, in key order.
    pub fn names(&self) -> [&'static str; 4] {
        ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    }

    /// He-style initial parameters from `seed`.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = Rng::new(seed);
        let s1 = (2.0 / self.dim as f32).sqrt();
        let s2 = (2.0 / self.hidden as f32).sqrt();
        let [a, b, c, d] = self.sizes();
        vec![
            (0..a).map(|_| rng.normal() * s1).collect(),
            vec![0.0; b],
            (0..c).map(|_| rng.normal() * s2).collect(),
            vec![0.0; d],
        ]
    }

    fn forward(&self, p: &[Vec<f32>], x: &[f32], h: &mut [f32], logits: &mut [f32]) {
        for j in 0..self.hidden {
            let w = &p[0][j * self.dim..(j + 1) * self.dim];
            let z: f32 = w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>() + p[1][j];
            h[j] = z.max(0.0);
        }
        for k in 0..self.classes {
            let w = &p[2][k * self.hidden..(k + 1) * self.hidden];
            logits[k] = w.iter().zip(h.iter()).map(|(a, b)| a * b).sum::<f32>() + p[3][k];
        }
    }

    fn softmax(logits: &mut [f32]) {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0.0;
        for l in logits.iter_mut() {
            *l = (*l - m).exp();
            s += *l;
        }
        for l in logits.iter_mut() {
            *l /= s;
        }
    }

    /// Mean loss and mean gradient over the samples `idx` of `data`.
    pub fn grad(&self, p: &[Vec<f32>], data: &Dataset, idx: &[usize]) -> (f32, Vec<Vec<f32>>) {
        let mut g: Vec<Vec<f32>> = self.sizes().iter().map(|&n| vec![0.0; n]).collect();
        let (mut h, mut prob) = (vec![0.0; self.hidden], vec![0.0; self.classes]);
        let mut dh = vec![0.0; self.hidden];
        let mut loss = 0.0;
        let scale = 1.0 / idx.len().max(1) as f32;
        for &i in idx {
            let x = &data.x[i * self.dim..(i + 1) * self.dim];
            let y = usize::from(data.y[i]);
            self.forward(p, x, &mut h, &mut prob);
            Self::softmax(&mut prob);
            loss -= prob[y].max(1e-12).ln();
            dh.iter_mut().for_each(|v| *v = 0.0);
            for k in 0..self.classes {
                let d = (prob[k] - if k == y { 1.0 } else { 0.0 }) * scale;
                g[3][k] += d;
                let row = k * self.hidden;
                for j in 0..self.hidden {
                    g[2][row + j] += d * h[j];
                    dh[j] += d * p[2][row + j];
                }
            }
            for j in 0..self.hidden {
                if h[j] <= 0.0 {
                    continue;
                }
                g[1][j] += dh[j];
                let row = j * self.dim;
                for (gw, xv) in g[0][row..row + self.dim].iter_mut().zip(x) {
                    *gw += dh[j] * xv;
                }
            }
        }
        (loss * scale, g)
    }

    /// Mean loss and accuracy over the whole data set.
    pub fn evaluate(&self, p: &[Vec<f32>], data: &Dataset) -> (f32, f32) {
        let (mut h, mut prob) = (vec![0.0; self.hidden], vec![0.0; self.classes]);
        let (mut loss, mut right) = (0.0f64, 0usize);
        for i in 0..data.len() {
            let x = &data.x[i * self.dim..(i + 1) * self.dim];
            let y = usize::from(data.y[i]);
            self.forward(p, x, &mut h, &mut prob);
            let best = (0..self.classes)
                .max_by(|&a, &b| prob[a].total_cmp(&prob[b]))
                .unwrap_or(0);
            right += usize::from(best == y);
            Self::softmax(&mut prob);
            loss -= f64::from(prob[y].max(1e-12).ln());
        }
        (
            (loss / data.len() as f64) as f32,
            right as f32 / data.len() as f32,
        )
    }
}

/// The sample indices rank `rank` of `workers` uses at `step` (batches of
/// `batch` from its own shard, cycling through it epoch after epoch).
pub fn batch_indices(n: usize, rank: usize, workers: usize, batch: usize, step: usize) -> Vec<usize> {
    let shard: Vec<usize> = (rank..n).step_by(workers).collect();
    let per_epoch = (shard.len() / batch).max(1);
    let s = step % per_epoch;
    shard[s * batch..((s + 1) * batch).min(shard.len())].to_vec()
}

/// Steps in one epoch for this split.
pub fn steps_per_epoch(n: usize, workers: usize, batch: usize) -> usize {
    ((n / workers) / batch).max(1)
}

/// One process doing what W synchronous workers with plain SGD on the
/// appliance do: per step, average the W workers' gradients and apply
/// `w -= lr * g`. The reference the end-to-end test compares against.
pub fn reference_sgd(
    mlp: &Mlp,
    data: &Dataset,
    seed: u64,
    workers: usize,
    batch: usize,
    lr: f32,
    steps: usize,
) -> Vec<Vec<f32>> {
    let mut p = mlp.init(seed);
    for step in 0..steps {
        let mut sum: Vec<Vec<f32>> = mlp.sizes().iter().map(|&n| vec![0.0; n]).collect();
        for rank in 0..workers {
            let idx = batch_indices(data.len(), rank, workers, batch, step);
            let (_, g) = mlp.grad(&p, data, &idx);
            for (s, gk) in sum.iter_mut().zip(&g) {
                for (a, b) in s.iter_mut().zip(gk) {
                    *a += b;
                }
            }
        }
        let inv = 1.0 / workers as f32;
        for (pk, sk) in p.iter_mut().zip(&sum) {
            for (w, s) in pk.iter_mut().zip(sk) {
                *w -= lr * (s * inv);
            }
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradient_matches_finite_differences() {
        let mlp = Mlp {
            dim: 5,
            hidden: 7,
            classes: 3,
        };
        let data = Dataset::generate(1, 12, 5, 3);
        let p = mlp.init(2);
        let idx: Vec<usize> = (0..12).collect();
        let (_, g) = mlp.grad(&p, &data, &idx);
        for k in 0..4 {
            for i in [0, mlp.sizes()[k] - 1] {
                let mut q = p.clone();
                let eps = 1e-2;
                q[k][i] += eps;
                let (lp, _) = mlp.grad(&q, &data, &idx);
                q[k][i] -= 2.0 * eps;
                let (lm, _) = mlp.grad(&q, &data, &idx);
                let fd = (lp - lm) / (2.0 * eps);
                assert!(
                    (fd - g[k][i]).abs() < 2e-2,
                    "key {k} elem {i}: fd {fd} vs grad {}",
                    g[k][i]
                );
            }
        }
    }

    #[test]
    fn sgd_reference_learns() {
        let mlp = Mlp {
            dim: 16,
            hidden: 32,
            classes: 4,
        };
        let data = Dataset::generate(3, 2048, 16, 4);
        let before = mlp.evaluate(&mlp.init(5), &data).0;
        // Four classes: chance is 25%.
        let p = reference_sgd(&mlp, &data, 5, 2, 32, 0.1, 100);
        let (after, acc) = mlp.evaluate(&p, &data);
        assert!(
            after < before * 0.7 && acc > 0.35,
            "loss {before} -> {after}, accuracy {acc}"
        );
    }
}
