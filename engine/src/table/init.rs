//! Initial values of table rows (issue 32, PROTOCOL.md §10.4).
//!
//! Layer: pure. A row that was never stored reads as its initial value,
//! computed from (job seed, table, row id, element) alone by a
//! counter-based generator, so that every lcore, restart, checkpoint and
//! worker agrees without storing untouched rows. The computation is exact:
//! the bits come from Philox4x32-10 (integer operations only), and the
//! arithmetic that turns them into values is IEEE binary32 or binary64
//! `+`, `-`, `*`, `/` and `sqrt`, each correctly rounded, in a stated
//! order. The normal distribution does not call the C library's `ln` or
//! `cos` (whose results are not specified to the bit); it evaluates its own
//! polynomials, whose coefficients PROTOCOL.md lists and
//! engine/tests/rules/protocol_row_optimizers.rs checks against the constants
//! here.
//!
//! Invariants: [`TableInit::fill`] is a pure function of (seed, table, id,
//! element index, [`Init`]); a row's element `e` does not depend on the
//! row's length (`fill` of a longer row extends a shorter one).

use thiserror::Error;

use super::RowInit;

/// What a table's rows are before they are first stored (the spec's
/// `init`). The parameters are the `f32` values of the spec's numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Every element +0.
    Zeros,
    /// `a + (b - a) * u` with `u` uniform on [0, 1) in steps of 2^-24.
    Uniform {
        /// The lower end.
        a: f32,
        /// The upper end (reached only by rounding).
        b: f32,
    },
    /// Normal with mean 0 and standard deviation `std` (Box–Muller with
    /// the polynomials of PROTOCOL.md §10.4).
    Normal {
        /// The standard deviation.
        std: f32,
    },
}

/// An [`Init`] that cannot be used.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum InitError {
    /// `uniform(a, b)` with an end that is not finite or `a > b`.
    #[error("init uniform: a = {a}, b = {b}: want finite a <= b")]
    Uniform {
        /// The lower end given.
        a: f32,
        /// The upper end given.
        b: f32,
    },
    /// `normal(0, std)` with `std` negative or not finite.
    #[error("init normal: std = {std}: want a finite std >= 0")]
    Normal {
        /// The standard deviation given.
        std: f32,
    },
}

impl Init {
    /// Checks the parameters: finite, `a <= b`, `std >= 0`.
    pub fn check(&self) -> Result<(), InitError> {
        match *self {
            Init::Zeros => Ok(()),
            Init::Uniform { a, b } if a.is_finite() && b.is_finite() && a <= b => Ok(()),
            Init::Uniform { a, b } => Err(InitError::Uniform { a, b }),
            Init::Normal { std } if std.is_finite() && std >= 0.0 => Ok(()),
            Init::Normal { std } => Err(InitError::Normal { std }),
        }
    }
}

/// The initial values of one table of one job: [`Init`] keyed by the job's
/// seed and the table's key number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableInit {
    /// The distribution.
    pub init: Init,
    /// The job's 64-bit seed.
    pub seed: u64,
    /// The table's key number in the job spec.
    pub table: u32,
}

impl TableInit {
    /// A table's initial values; refuses parameters [`Init::check`] refuses.
    pub fn new(init: Init, seed: u64, table: u32) -> Result<TableInit, InitError> {
        init.check()?;
        Ok(TableInit { init, seed, table })
    }

    /// Words x0 and x1 of Philox's output for elements `e0 .. e0 + LANES`
    /// of row `id`: counter (e, table, low and high half of id), key (low
    /// and high half of the seed). Eight counters at once, lane by lane,
    /// so that the compiler keeps them in vector registers.
    #[inline(always)]
    fn bits(&self, id: u64, e0: u32) -> [[u32; LANES]; 2] {
        let mut c = [[0u32; LANES]; 4];
        for (l, e) in (0u32..).zip(c[0].iter_mut()) {
            *e = e0.wrapping_add(l);
        }
        c[1] = [self.table; LANES];
        c[2] = [low32(id); LANES];
        c[3] = [high32(id); LANES];
        let mut k = [low32(self.seed), high32(self.seed)];
        for round in 0..10 {
            if round > 0 {
                k[0] = k[0].wrapping_add(PHILOX_W[0]);
                k[1] = k[1].wrapping_add(PHILOX_W[1]);
            }
            let [c0, c1, c2, c3] = &mut c;
            let lanes = c0
                .iter_mut()
                .zip(c1.iter_mut())
                .zip(c2.iter_mut())
                .zip(c3.iter_mut());
            for (((c0, c1), c2), c3) in lanes {
                let p0 = u64::from(PHILOX_M[0]) * u64::from(*c0);
                let p1 = u64::from(PHILOX_M[1]) * u64::from(*c2);
                *c0 = high32(p1) ^ *c1 ^ k[0];
                *c1 = low32(p1);
                *c2 = high32(p0) ^ *c3 ^ k[1];
                *c3 = low32(p0);
            }
        }
        [c[0], c[1]]
    }
}

/// Elements computed together by [`TableInit::fill`].
const LANES: usize = 8;

impl RowInit for TableInit {
    /// Compiled for AVX2 as well as the baseline, the widest the CPU has
    /// chosen per call; the same bits either way (integer operations and
    /// IEEE operations without fused multiply-add).
    fn fill(&self, id: u64, values: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2, checked on the line above.
                return unsafe { fill_avx2(self, id, values) };
            }
        }
        fill_impl(self, id, values)
    }
}

/// [`TableInit::fill`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fill_avx2(t: &TableInit, id: u64, values: &mut [f32]) {
    fill_impl(t, id, values)
}

#[inline(always)]
fn fill_impl(t: &TableInit, id: u64, values: &mut [f32]) {
    {
        debug_assert!(
            u32::try_from(values.len()).is_ok(),
            "a row of {} elements",
            values.len()
        );
        match t.init {
            Init::Zeros => values.fill(0.0),
            Init::Uniform { a, b } => {
                let span = b - a;
                for (e0, xs) in (0u32..).step_by(LANES).zip(values.chunks_mut(LANES)) {
                    let [w0, _] = t.bits(id, e0);
                    for (x, w) in xs.iter_mut().zip(w0) {
                        *x = a + span * unit_f32(w);
                    }
                }
            }
            Init::Normal { std } => {
                let std = f64::from(std);
                for (e0, xs) in (0u32..).step_by(LANES).zip(values.chunks_mut(LANES)) {
                    let [w0, w1] = t.bits(id, e0);
                    for ((x, w0), w1) in xs.iter_mut().zip(w0).zip(w1) {
                        *x = round_to_f32(standard_normal(w0, w1) * std);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as
// easy as 1, 2, 3", SC 2011), as the Random123 library defines it; the unit
// tests check the library's published known-answer vectors.

/// Philox's multipliers.
pub const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// Philox's key increments (Weyl sequence) between rounds.
pub const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32 with 10 rounds: four 32-bit words from a 128-bit counter and
/// a 64-bit key. Round i (0..10) uses the key bumped i times by
/// [`PHILOX_W`]; a round maps (c0, c1, c2, c3) to
/// (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0)), where
/// hi and lo are the halves of the 64-bit product.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c, mut k] = [counter, [key[0], key[1], 0, 0]];
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(PHILOX_W[0]);
            k[1] = k[1].wrapping_add(PHILOX_W[1]);
        }
        let p0 = u64::from(PHILOX_M[0]) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M[1]) * u64::from(c[2]);
        c = [
            high32(p1) ^ c[1] ^ k[0],
            low32(p1),
            high32(p0) ^ c[3] ^ k[1],
            low32(p0),
        ];
    }
    c
}

#[inline(always)]
fn low32(x: u64) -> u32 {
    // Cast: keeps the low 32 bits, which is the point.
    #[allow(clippy::cast_possible_truncation)]
    let lo = x as u32;
    lo
}

#[inline(always)]
fn high32(x: u64) -> u32 {
    low32(x >> 32)
}

// ---------------------------------------------------------------------------
// Bits to values.

/// The top 24 bits of `w` times 2^-24: uniform on [0, 1) in steps of 2^-24,
/// exact in `f32` (a 24-bit integer and a power of two).
#[inline(always)]
pub fn unit_f32(w: u32) -> f32 {
    // Cast: w >> 8 < 2^24, exact in f32.
    let top = (w >> 8) as f32;
    top * (1.0 / 16_777_216.0)
}

/// `ln 2` rounded to the nearest `f64`.
pub const LN2: f64 = f64::from_bits(0x3FE6_2E42_FEFA_39EF);

/// `1 / (2j + 1)` rounded to the nearest `f64`, j = 0..=10: the series
/// ln m = 2 (s + s^3/3 + s^5/5 + ...), s = (m - 1) / (m + 1).
pub const LN_COEFFS: [u64; 11] = [
    0x3FF0_0000_0000_0000,
    0x3FD5_5555_5555_5555,
    0x3FC9_9999_9999_999A,
    0x3FC2_4924_9249_2492,
    0x3FBC_71C7_1C71_C71C,
    0x3FB7_45D1_745D_1746,
    0x3FB3_B13B_13B1_3B14,
    0x3FB1_1111_1111_1111,
    0x3FAE_1E1E_1E1E_1E1E,
    0x3FAA_F286_BCA1_AF28,
    0x3FA8_6186_1861_8618,
];

/// `(-1)^k (pi/2)^(2k) / (2k)!` rounded to the nearest `f64`, k = 0..=8:
/// cos(pi/2 * f) = sum of COS_COEFFS[k] * f^(2k), for f in [0, 1].
pub const COS_COEFFS: [u64; 9] = [
    0x3FF0_0000_0000_0000,
    0xBFF3_BD3C_C9BE_45DE,
    0x3FD0_3C1F_081B_5AC4,
    0xBF95_5D3C_7E3C_BFFA,
    0x3F4E_1F50_6891_BABB,
    0xBEFA_6D1F_2A20_4A8C,
    0x3E9F_9D38_A376_3CC3,
    0xBE3B_6E24_F44B_128F,
    0x3DD2_0C62_C2F2_D7F5,
];

/// Horner's rule in `f64`, highest coefficient first: p = c[n]; then
/// p = p * x + c[i] for i = n-1 down to 0, each operation rounded (no
/// fused multiply-add).
#[inline(always)]
fn horner(coeffs: &[u64], x: f64) -> f64 {
    let mut p = 0.0;
    let mut first = true;
    for &c in coeffs.iter().rev() {
        let c = f64::from_bits(c);
        p = if first { c } else { p * x + c };
        first = false;
    }
    p
}

/// ln(x * 2^-32) for an integer x in [1, 2^32], in `f64` as §10.4 states
/// it: x = 2^k * m with m in [1, 2) (both exact), s = (m - 1) / (m + 1),
/// y = s * P(s * s) with P the series of [`LN_COEFFS`], and the result
/// (k - 32) * LN2 + (y + y).
#[inline(always)]
pub fn ln_unit(x: u64) -> f64 {
    debug_assert!((1..=1u64 << 32).contains(&x), "ln_unit({x})");
    let k = 63 - x.leading_zeros();
    // Cast: x <= 2^32 is exact in f64; the scaling by 2^-k is exact.
    let m = x as f64 * f64::from_bits((1023 - u64::from(k)) << 52);
    let s = (m - 1.0) / (m + 1.0);
    let y = s * horner(&LN_COEFFS, s * s);
    (f64::from(k) - 32.0) * LN2 + (y + y)
}

/// cos(2 pi * j * 2^-32) for a 32-bit j, in `f64` as §10.4 states it: the
/// quadrant q (top 2 bits of j) and the place in it, f = i * 2^-30 with
/// i the low 30 bits of j (2^30 minus them for q odd), give ±C(f) with C
/// the polynomial of [`COS_COEFFS`] in f * f, negative for q = 1 and 2.
#[inline(always)]
pub fn cos_turn(j: u32) -> f64 {
    let q = j >> 30;
    let low = j & ((1 << 30) - 1);
    let i = if q & 1 == 1 { (1 << 30) - low } else { low };
    let f = f64::from(i) * (1.0 / 1_073_741_824.0);
    let c = horner(&COS_COEFFS, f * f);
    if q == 1 || q == 2 {
        -c
    } else {
        c
    }
}

/// Box–Muller's first output from two words of Philox: sqrt(-2 ln u1) *
/// cos(2 pi u2), u1 = (w0 + 1) * 2^-32 in (0, 1], u2 = w1 * 2^-32, in
/// `f64`; |result| <= sqrt(64 ln 2) < 6.67.
#[inline(always)]
pub fn standard_normal(w0: u32, w1: u32) -> f64 {
    let l = ln_unit(u64::from(w0) + 1);
    (-2.0 * l).sqrt() * cos_turn(w1)
}

/// The `f32` nearest to `x` (ties to even), as Rust's `as` rounds.
#[inline(always)]
fn round_to_f32(x: f64) -> f32 {
    // Cast: rounding to nearest is the point; |x| is far below f32::MAX
    // for any finite std (and an infinite product stays infinite).
    #[allow(clippy::cast_possible_truncation)]
    let y = x as f32;
    y
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    fn row(init: Init, seed: u64, table: u32, id: u64, dim: usize) -> Vec<f32> {
        let t = TableInit::new(init, seed, table).unwrap();
        let mut v = vec![f32::NAN; dim];
        t.fill(id, &mut v);
        v
    }

    /// Random123's known-answer vectors for philox4x32-10 (its file
    /// kat_vectors): counter, key, output.
    #[test]
    fn philox_gives_the_published_known_answers() {
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0; 4],
                [0; 2],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (ctr, key, want) in kat {
            assert_eq!(philox4x32_10(ctr, key), want, "counter {ctr:x?} key {key:x?}");
        }
    }

    #[test]
    fn eight_lanes_are_eight_scalar_philox_calls() {
        let t = TableInit::new(Init::Zeros, 0xfeed_f00d_1234_5678, 9).unwrap();
        for (id, e0) in [(0u64, 0u32), (u64::MAX, 8), (1 << 40, u32::MAX - 3)] {
            let [x0, x1] = t.bits(id, e0);
            for l in 0..LANES {
                let e = e0.wrapping_add(l as u32);
                let w = philox4x32_10([e, 9, low32(id), high32(id)], [0x1234_5678, 0xfeed_f00d]);
                assert_eq!([x0[l], x1[l]], [w[0], w[1]], "id {id} element {e}");
            }
        }
    }

    #[test]
    fn the_listed_constants_are_what_they_claim_to_be() {
        assert_eq!(LN2, std::f64::consts::LN_2);
        for (j, &c) in LN_COEFFS.iter().enumerate() {
            assert_eq!(f64::from_bits(c), 1.0 / (2 * j + 1) as f64, "LN_COEFFS[{j}]");
        }
        // Each cos coefficient within an ulp or two of its value (they are
        // fixed by their bits; this only shows no digit was mistyped).
        let h = std::f64::consts::FRAC_PI_2;
        let mut want = 1.0f64;
        for (k, &c) in COS_COEFFS.iter().enumerate() {
            if k > 0 {
                want *= -h * h / ((2 * k - 1) * (2 * k)) as f64;
            }
            let got = f64::from_bits(c);
            assert!(
                (got - want).abs() <= 4.0 * f64::EPSILON * want.abs(),
                "COS_COEFFS[{k}]: {got} vs {want}"
            );
        }
    }

    #[test]
    fn the_polynomials_are_close_to_ln_and_cos() {
        let mut worst_ln = 0.0f64;
        let mut worst_cos = 0.0f64;
        for i in 0..200_000u64 {
            let w = philox4x32_10([low32(i), 0, 0, 0], [1, 2]);
            let x = u64::from(w[0]) + 1;
            let exact = (x as f64 * 2f64.powi(-32)).ln();
            worst_ln = worst_ln.max((ln_unit(x) - exact).abs());
            let turn = f64::from(w[1]) * 2f64.powi(-32);
            worst_cos = worst_cos.max((cos_turn(w[1]) - (std::f64::consts::TAU * turn).cos()).abs());
        }
        for x in [1u64, 2, 3, (1 << 32) - 1, 1 << 32] {
            let exact = (x as f64 * 2f64.powi(-32)).ln();
            worst_ln = worst_ln.max((ln_unit(x) - exact).abs());
        }
        for j in [0u32, 1 << 30, 1 << 31, 3 << 30, u32::MAX] {
            let turn = f64::from(j) * 2f64.powi(-32);
            worst_cos = worst_cos.max((cos_turn(j) - (std::f64::consts::TAU * turn).cos()).abs());
        }
        assert!(worst_ln < 1e-11, "ln: {worst_ln:e}");
        assert!(worst_cos < 1e-11, "cos: {worst_cos:e}");
        assert_eq!(ln_unit(1 << 32), 0.0);
        assert_eq!(cos_turn(0), 1.0);
    }

    /// Fixed vectors: the bits PROTOCOL.md §10.4's example states (the
    /// integration test checks the document; these pin the code alone).
    #[test]
    fn fixed_vectors() {
        let seed = 0x0123_4567_89ab_cdef;
        let u = row(Init::Uniform { a: -0.5, b: 0.5 }, seed, 3, 42, 4);
        let n = row(Init::Normal { std: 0.1 }, seed, 3, 42, 4);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Recomputed by hand from the definitions, step by step.
        let w: Vec<[u32; 4]> = (0..4)
            .map(|e| philox4x32_10([e, 3, 42, 0], [0x89ab_cdef, 0x0123_4567]))
            .collect();
        for e in 0..4 {
            let ue = -0.5f32 + 1.0f32 * (((w[e][0] >> 8) as f32) / 16_777_216.0);
            assert_eq!(u[e].to_bits(), ue.to_bits());
            let l = ln_unit(u64::from(w[e][0]) + 1);
            let ne = ((-2.0 * l).sqrt() * cos_turn(w[e][1]) * f64::from(0.1f32)) as f32;
            assert_eq!(n[e].to_bits(), ne.to_bits());
        }
        assert_eq!(row(Init::Zeros, seed, 3, 42, 3), vec![0.0; 3]);
        assert!(
            bits(&row(Init::Zeros, seed, 3, 42, 3)).iter().all(|&b| b == 0),
            "+0, not -0"
        );
    }

    #[test]
    fn a_row_depends_on_seed_table_id_and_element_alone() {
        let init = Init::Normal { std: 1.0 };
        let long = row(init, 9, 1, 77, 40);
        let short = row(init, 9, 1, 77, 7);
        assert_eq!(&long[..7], &short[..]);
        assert_ne!(row(init, 9, 1, 78, 7), short, "another id");
        assert_ne!(row(init, 9, 2, 77, 7), short, "another table");
        assert_ne!(row(init, 10, 1, 77, 7), short, "another seed");
        let all_distinct = long.windows(2).all(|p| p[0] != p[1]);
        assert!(all_distinct);
    }

    /// Mean and variance over 10^5 draws (100 rows of 1000, fixed seed, so
    /// the test gives the same figures every run). Bounds: about 6 standard
    /// errors of the estimates.
    #[test]
    fn distributions_have_the_stated_mean_and_variance() {
        let moments = |init: Init| {
            let (mut s1, mut s2, mut lo, mut hi) = (0f64, 0f64, f64::MAX, f64::MIN);
            let n = 100_000f64;
            for id in 0..100u64 {
                for x in row(init, 0x5eed, 4, id.wrapping_mul(0x9E37_79B9_7F4A_7C15), 1000) {
                    let x = f64::from(x);
                    s1 += x;
                    s2 += x * x;
                    lo = lo.min(x);
                    hi = hi.max(x);
                }
            }
            let mean = s1 / n;
            (mean, s2 / n - mean * mean, lo, hi)
        };
        // uniform(-1, 3): mean 1, variance 16/12.
        let (m, v, lo, hi) = moments(Init::Uniform { a: -1.0, b: 3.0 });
        assert!(
            (m - 1.0).abs() < 6.0 * (16.0f64 / 12.0 / 1e5).sqrt(),
            "uniform mean {m}"
        );
        assert!((v - 16.0 / 12.0).abs() < 0.02, "uniform variance {v}");
        assert!(lo >= -1.0 && hi < 3.0, "uniform range [{lo}, {hi}]");
        // normal(0, 2): mean 0, variance 4; fourth moment checked through
        // the share beyond 2 std (4.55 %).
        let (m, v, lo, hi) = moments(Init::Normal { std: 2.0 });
        assert!(m.abs() < 6.0 * (4.0f64 / 1e5).sqrt(), "normal mean {m}");
        assert!((v - 4.0).abs() < 0.08, "normal variance {v}");
        assert!(
            lo > -14.0 && hi < 14.0 && lo < -7.0 && hi > 7.0,
            "normal range [{lo}, {hi}]"
        );
        let tail = (0..100u64)
            .flat_map(|id| row(Init::Normal { std: 1.0 }, 1, 0, id, 1000))
            .filter(|x| x.abs() > 2.0)
            .count();
        assert!(
            (4100..5000).contains(&tail),
            "{tail} of 10^5 beyond 2 std (4,550 expected)"
        );
    }

    #[test]
    fn bad_parameters_are_refused_by_name() {
        let e = TableInit::new(Init::Uniform { a: 1.0, b: 0.0 }, 0, 0).unwrap_err();
        assert_eq!(e.to_string(), "init uniform: a = 1, b = 0: want finite a <= b");
        let e = Init::Normal { std: -1.0 }.check().unwrap_err();
        assert_eq!(e.to_string(), "init normal: std = -1: want a finite std >= 0");
        assert!(Init::Uniform {
            a: f32::NEG_INFINITY,
            b: 0.0
        }
        .check()
        .is_err());
        assert!(Init::Normal { std: f32::NAN }.check().is_err());
        assert!(Init::Normal { std: 0.0 }.check().is_ok());
    }
}
