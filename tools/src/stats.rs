//! Order statistics for benchmark samples (pure).
//!
//! Percentiles use the nearest-rank definition: the p-th percentile of n
//! sorted samples is the sample at rank ceil(p/100 * n) (1-based), so it is
//! always one of the measured values and the 100th is the maximum. With few
//! samples p99 is the maximum, which is what a reader of "p99 of 20 rounds"
//! should expect. The median of an even count is the mean of the two middle
//! samples.

/// Summary of a sample set.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Smallest sample.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// Arithmetic mean.
    pub mean: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

fn sorted(xs: &[f64]) -> Vec<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// The median (NaN for no samples; NaN samples are ignored).
pub fn median(xs: &[f64]) -> f64 {
    let v = sorted(xs);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The `p`-th percentile, `0 < p <= 100`, nearest rank (NaN for no samples).
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    let v = sorted(xs);
    if v.is_empty() {
        return f64::NAN;
    }
    // The epsilon keeps 99.9% of 1000 at rank 999 despite rounding.
    let rank = ((p.clamp(0.0, 100.0) / 100.0) * v.len() as f64 - 1e-9).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Min, median, mean, p99 and max of `xs`.
pub fn summarize(xs: &[f64]) -> Summary {
    let v = sorted(xs);
    let n = v.len();
    Summary {
        n,
        min: v.first().copied().unwrap_or(f64::NAN),
        median: median(&v),
        mean: if n == 0 {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / n as f64
        },
        p99: percentile(&v, 99.0),
        max: v.last().copied().unwrap_or(f64::NAN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
        assert_eq!(median(&[f64::NAN, 1.0, 3.0]), 2.0);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&xs, 99.0), 99.0);
        assert_eq!(percentile(&xs, 50.0), 50.0);
        assert_eq!(percentile(&xs, 100.0), 100.0);
        assert_eq!(percentile(&xs, 1.0), 1.0);
        assert_eq!(percentile(&xs, 0.0), 1.0);
        // Few samples: p99 is the maximum.
        assert_eq!(percentile(&[5.0, 1.0, 9.0, 3.0], 99.0), 9.0);
        let xs: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&xs, 99.0), 990.0);
        assert_eq!(percentile(&xs, 99.9), 999.0);
        assert!(percentile(&[], 99.0).is_nan());
    }

    #[test]
    fn summary() {
        let s = summarize(&[2.0, 4.0, 6.0, 8.0]);
        assert_eq!(s.n, 4);
        assert_eq!((s.min, s.median, s.mean, s.p99, s.max), (2.0, 5.0, 5.0, 8.0, 8.0));
    }
}
