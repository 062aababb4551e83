//! Copies and sums of one table row (D f32 values) at a time, inlined for
//! the common row widths.
//!
//! A table's rows move one at a time between the store, the answers, a
//! round's accumulator and a worker's call (each of a step's thousands of
//! rows: 64 bytes at D = 16). `copy_from_slice` of a length known only at
//! run time is a call of the C library's `memmove` per row: its call and
//! size dispatch cost as much as the copy (a copy of 4,096 rows of 16
//! values by slot: 15 us a call, against 8 us with the width fixed at
//! compile time; BENCHMARKS.md). These functions branch once per row on
//! the width (the same branch every row of a table, predicted) to a copy
//! of a fixed-size array, which the compiler inlines as vector moves;
//! other widths take the plain slice copy.

/// Expands `$body` with `$n` the row width as a constant for the widths
/// inlined (2 to 128, powers of two), else runs `$other`.
macro_rules! by_width {
    ($len:expr, $n:ident => $body:expr, _ => $other:expr) => {
        by_width!(@arms $len, $n, $body, $other; 2, 4, 8, 16, 32, 64, 128)
    };
    (@arms $len:expr, $n:ident, $body:expr, $other:expr; $($w:literal),*) => {
        match $len {
            $($w => {
                const $n: usize = $w;
                $body
            })*
            _ => $other,
        }
    };
}

/// `dst.copy_from_slice(src)`, inlined for the common widths.
///
/// # Panics
///
/// If the lengths differ (as `copy_from_slice`).
#[inline(always)]
pub fn copy_row(dst: &mut [f32], src: &[f32]) {
    by_width!(src.len(), N => fixed_mut::<N>(dst).copy_from_slice(fixed::<N>(src)), _ => dst.copy_from_slice(src))
}

/// `dst[i] += src[i]` for each i, inlined for the common widths.
///
/// # Panics
///
/// If the lengths differ.
#[inline(always)]
pub fn add_row(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "a row added to a row of another width");
    by_width!(src.len(), N => add(fixed_mut::<N>(dst), fixed::<N>(src)), _ => add(dst, src))
}

/// `v.extend_from_slice(src)`, inlined for the common widths.
#[inline(always)]
pub fn extend_row(v: &mut Vec<f32>, src: &[f32]) {
    by_width!(src.len(), N => v.extend_from_slice(fixed::<N>(src)), _ => v.extend_from_slice(src))
}

#[inline(always)]
fn fixed<const N: usize>(s: &[f32]) -> &[f32; N] {
    s.try_into().expect("a row of the width matched")
}

#[inline(always)]
fn fixed_mut<const N: usize>(s: &mut [f32]) -> &mut [f32; N] {
    let len = s.len();
    s.try_into()
        .unwrap_or_else(|_| panic!("a row of {N} values copied into one of {len}"))
}

#[inline(always)]
fn add(dst: &mut [f32], src: &[f32]) {
    for (a, b) in dst.iter_mut().zip(src) {
        *a += *b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_width_copies_adds_and_extends_as_the_slice_ops() {
        for d in 0..=130usize {
            let src: Vec<f32> = (0..d).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut dst = vec![7.0f32; d];
            copy_row(&mut dst, &src);
            assert_eq!(dst, src, "copy, width {d}");
            let before: Vec<f32> = (0..d).map(|i| 1.0 / (i as f32 + 1.0)).collect();
            let mut sum = before.clone();
            add_row(&mut sum, &src);
            let want: Vec<f32> = before.iter().zip(&src).map(|(a, b)| a + b).collect();
            assert_eq!(
                sum.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "add, width {d}"
            );
            let mut v = vec![1.0f32];
            extend_row(&mut v, &src);
            assert_eq!(v.len(), d + 1);
            assert_eq!(&v[1..], &src[..], "extend, width {d}");
        }
    }

    /// Not a check: times a gather of 4,096 rows of 16 values by slot and
    /// an append of as many, by the slice ops and by these, in turn
    /// (`cargo test --release -p phub-proto --lib row_ops -- --ignored
    /// --nocapture`; BENCHMARKS.md).
    #[test]
    #[ignore = "a timing, run by hand"]
    fn row_copies_timed() {
        use std::hint::black_box;
        use std::time::Instant;
        let (k, dim, distinct) = (4096usize, 16usize, 1800u64);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            usize::try_from(x % m).expect("below m")
        };
        let slots: Vec<usize> = (0..k).map(|_| next(distinct)).collect();
        let rows: Vec<f32> = (0..usize::try_from(distinct).expect("small") * dim)
            .map(|i| i as f32)
            .collect();
        let mut out = vec![0f32; k * dim];
        let mut appended = Vec::with_capacity(k * dim);
        let calls = 2000;
        let time = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            for _ in 0..calls {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / f64::from(calls)
        };
        for round in 0..3 {
            let d = black_box(dim);
            let slice = time(&mut || {
                for (o, &s) in out.chunks_exact_mut(d).zip(&slots) {
                    o.copy_from_slice(&rows[s * d..][..d]);
                }
            });
            let ours = time(&mut || {
                for (o, &s) in out.chunks_exact_mut(d).zip(&slots) {
                    copy_row(o, &rows[s * d..][..d]);
                }
            });
            let slice_ext = time(&mut || {
                appended.clear();
                for &s in &slots {
                    appended.extend_from_slice(&rows[s * d..][..d]);
                }
            });
            let ours_ext = time(&mut || {
                appended.clear();
                for &s in &slots {
                    extend_row(&mut appended, &rows[s * d..][..d]);
                }
            });
            println!(
                "round {round}: gather {slice:.1} us (slice) against {ours:.1} us (copy_row); append {slice_ext:.1} \
                 us against {ours_ext:.1} us (extend_row)"
            );
            black_box((&out, &appended));
        }
    }

    #[test]
    #[should_panic(expected = "copied into one of 15")]
    fn a_copy_into_a_row_of_another_width_panics() {
        copy_row(&mut [0.0; 15], &[1.0; 16]);
    }

    #[test]
    #[should_panic(expected = "another width")]
    fn an_add_of_another_width_panics() {
        add_row(&mut [0.0; 16], &[1.0; 8]);
    }
}
