//! Aggregation kernels: decode received gradient bytes and add them into an
//! `f32` accumulator, or sum two f32 sources into a third buffer in one pass
//! ([`Kernels::sum_f32`]).
//!
//! Layer: pure compute, no I/O. One kernel family per instruction set
//! ([`KernelKind`]): a scalar reference in plain Rust, AVX2 (+F16C) and
//! AVX-512 (F + BW). A [`Kernels`] value is chosen once at start-up
//! ([`Kernels::best`]) and holds plain function pointers, so the hot path pays
//! one indirect call per chunk and no feature check.
//!
//! Invariants:
//! - Wire bytes are little-endian and need not be aligned; every kernel reads
//!   them with unaligned loads.
//! - Accumulators are always `f32`. Decoding bf16/f16 to `f32` is exact, so
//!   every family produces results bit-identical to the scalar reference
//!   (apart from the payload of NaNs, which IEEE 754 leaves open).
//! - The only `unsafe` here is calling `#[target_feature]` functions and their
//!   unaligned loads and stores. A SIMD function pointer is put into a
//!   [`Kernels`] only after runtime detection found the features it needs
//!   (see [`Kernels::for_kind`]).
//!
//! The AVX-512 kernels handle tails with masked loads and stores; the AVX2
//! kernels finish tails with the scalar reference. No prefetching and no
//! manual unrolling: `phub-bench kernels` showed neither helped (see
//! BENCHMARKS.md).

use phub_proto::Dtype;

/// Instruction set a kernel family is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelKind {
    /// Plain Rust; the reference every other family is tested against.
    Scalar,
    /// AVX2 with F16C (x86-64).
    Avx2,
    /// AVX-512 F and BW (x86-64).
    Avx512,
}

impl KernelKind {
    /// Every kind, in order of preference from worst to best.
    pub const ALL: [KernelKind; 3] = [KernelKind::Scalar, KernelKind::Avx2, KernelKind::Avx512];

    /// The name used in reports and on the command line: `scalar`, `avx2`, `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            KernelKind::Scalar => "scalar",
            KernelKind::Avx2 => "avx2",
            KernelKind::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for KernelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One kernel: `acc` and the wire bytes `src`, whose length is
/// `acc.len() * dtype.size()` (checked by the kernel itself).
type KernelFn = fn(&mut [f32], &[u8]);

/// The three-operand f32 kernel: `out`, two f32 wire-byte sources of
/// `4 * out.len()` bytes each, and a scale (checked by the kernel itself).
type SumFn = fn(&mut [f32], &[u8], &[u8], f32);

/// A family of kernels chosen once at start-up; cheap to copy (function
/// pointers inside).
#[derive(Clone, Copy)]
pub struct Kernels {
    kind: KernelKind,
    /// Indexed by [`slot`].
    add: [KernelFn; 3],
    /// Indexed by [`slot`].
    copy: [KernelFn; 3],
    /// `out = (a + b) * scale` over f32 wire bytes.
    sum_f32: SumFn,
    /// The same, `out` written with streaming (non-temporal) stores.
    sum_f32_stream: SumFn,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("kind", &self.kind).finish()
    }
}

/// Index of a dtype's kernels in [`Kernels::add`] and [`Kernels::copy`].
fn slot(dtype: Dtype) -> usize {
    match dtype {
        Dtype::F32 => 0,
        Dtype::Bf16 => 1,
        Dtype::F16 => 2,
    }
}

/// Panics unless `src` holds exactly `n` elements of `size` bytes.
#[inline]
#[track_caller]
fn check_len(n: usize, src: &[u8], size: usize) {
    assert!(
        n.checked_mul(size) == Some(src.len()),
        "kernel length mismatch: {} source bytes for {} accumulator elements of {} bytes",
        src.len(),
        n,
        size
    );
}

impl Kernels {
    /// The scalar reference family; runs everywhere.
    pub fn scalar() -> Kernels {
        Kernels {
            kind: KernelKind::Scalar,
            add: [scalar::add_f32, scalar::add_bf16, scalar::add_f16],
            copy: [scalar::copy_f32, scalar::copy_bf16, scalar::copy_f16],
            sum_f32: scalar::sum_f32,
            sum_f32_stream: scalar::sum_f32,
        }
    }

    /// The best family this CPU supports (runtime detection).
    pub fn best() -> Kernels {
        KernelKind::ALL
            .iter()
            .rev()
            .find_map(|&k| Kernels::for_kind(k))
            .unwrap_or_else(Kernels::scalar)
    }

    /// The family for `kind`, or `None` if this CPU (or this build's target
    /// architecture) lacks the instructions it needs.
    pub fn for_kind(kind: KernelKind) -> Option<Kernels> {
        match kind {
            KernelKind::Scalar => Some(Kernels::scalar()),
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx2 => {
                // This check is what makes the `x86::avx2_*` function
                // pointers sound to call: see the SAFETY comments there.
                if is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("f16c")
                    && is_x86_feature_detected!("fma")
                {
                    Some(Kernels {
                        kind,
                        add: [x86::avx2_add_f32, x86::avx2_add_bf16, x86::avx2_add_f16],
                        copy: [x86::avx2_copy_f32, x86::avx2_copy_bf16, x86::avx2_copy_f16],
                        sum_f32: x86::avx2_sum_f32,
                        sum_f32_stream: x86::avx2_sum_f32_stream,
                    })
                } else {
                    None
                }
            }
            #[cfg(target_arch = "x86_64")]
            KernelKind::Avx512 => {
                // This check is what makes the `x86::avx512_*` function
                // pointers sound to call: see the SAFETY comments there.
                if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                    Some(Kernels {
                        kind,
                        add: [x86::avx512_add_f32, x86::avx512_add_bf16, x86::avx512_add_f16],
                        copy: [x86::avx512_copy_f32, x86::avx512_copy_bf16, x86::avx512_copy_f16],
                        sum_f32: x86::avx512_sum_f32,
                        sum_f32_stream: x86::avx512_sum_f32_stream,
                    })
                } else {
                    None
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            KernelKind::Avx2 | KernelKind::Avx512 => None,
        }
    }

    /// Every family this CPU can run, scalar first, best last.
    pub fn available() -> Vec<Kernels> {
        KernelKind::ALL
            .iter()
            .filter_map(|&k| Kernels::for_kind(k))
            .collect()
    }

    /// The instruction set of this family.
    pub fn kind(&self) -> KernelKind {
        self.kind
    }

    /// `acc[i] += decode(src[i])`.
    ///
    /// # Panics
    /// If `src.len() != acc.len() * dtype.size()` (a caller bug: the engine
    /// checks lengths before).
    #[inline]
    pub fn add(&self, dtype: Dtype, acc: &mut [f32], src: &[u8]) {
        check_len(acc.len(), src, dtype.size());
        (self.add[slot(dtype)])(acc, src)
    }

    /// `acc[i] = decode(src[i])` (the first contribution of a round is a copy).
    ///
    /// # Panics
    /// If `src.len() != acc.len() * dtype.size()`.
    #[inline]
    pub fn copy(&self, dtype: Dtype, acc: &mut [f32], src: &[u8]) {
        check_len(acc.len(), src, dtype.size());
        (self.copy[slot(dtype)])(acc, src)
    }

    /// `out[i] = (a[i] + b[i]) * scale`, `a` and `b` being f32 wire bytes
    /// (little-endian, unaligned): two contributions, or an accumulator and
    /// the last contribution, summed into a third buffer in one pass, with
    /// the mean's `1 / W` as `scale` (1 for a plain sum, which leaves every
    /// value but a NaN's payload unchanged). The addition and the
    /// multiplication are rounded separately (no fused multiply-add), as
    /// `add` followed by the optimizer's mean pass rounds them.
    ///
    /// # Panics
    /// If `a` or `b` is not `4 * out.len()` bytes long.
    #[inline]
    pub fn sum_f32(&self, out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        check_len(out.len(), a, 4);
        check_len(out.len(), b, 4);
        (self.sum_f32)(out, a, b, scale)
    }

    /// [`Kernels::sum_f32`] writing `out` with streaming (non-temporal)
    /// stores: its cache lines are neither read for ownership nor left in
    /// the cache, so a pass that reads W inputs and writes the sum to a
    /// buffer not read again soon (a result leaving the host, or read by
    /// another process later) moves W + 1 lines per line of output rather
    /// than W + 2. The values are bit-identical to `sum_f32`'s. The stores
    /// are fenced (`sfence`) before this returns, so they are visible to any
    /// core or device that sees a later store or system call. The scalar
    /// family has no streaming stores and is `sum_f32` itself.
    ///
    /// # Panics
    /// If `a` or `b` is not `4 * out.len()` bytes long.
    #[inline]
    pub fn sum_f32_stream(&self, out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        check_len(out.len(), a, 4);
        check_len(out.len(), b, 4);
        (self.sum_f32_stream)(out, a, b, scale)
    }
}

/// The codec between `f32` and wire elements is phub-proto's (the worker
/// library's too); the kernels' tests check it against the scalar kernels.
pub use phub_proto::dtype::{decode, encode};

/// The scalar reference kernels.
mod scalar {
    use super::check_len;

    #[inline(always)]
    fn f32_at(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    #[inline(always)]
    fn bf16_at(b: &[u8]) -> f32 {
        f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
    }

    #[inline(always)]
    fn f16_at(b: &[u8]) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }

    macro_rules! scalar_kernels {
        ($add:ident, $copy:ident, $size:expr, $dec:ident) => {
            pub(super) fn $add(acc: &mut [f32], src: &[u8]) {
                check_len(acc.len(), src, $size);
                for (a, b) in acc.iter_mut().zip(src.chunks_exact($size)) {
                    *a += $dec(b);
                }
            }

            pub(super) fn $copy(acc: &mut [f32], src: &[u8]) {
                check_len(acc.len(), src, $size);
                for (a, b) in acc.iter_mut().zip(src.chunks_exact($size)) {
                    *a = $dec(b);
                }
            }
        };
    }

    scalar_kernels!(add_f32, copy_f32, 4, f32_at);

    pub(super) fn sum_f32(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        check_len(out.len(), a, 4);
        check_len(out.len(), b, 4);
        for ((o, x), y) in out.iter_mut().zip(a.chunks_exact(4)).zip(b.chunks_exact(4)) {
            *o = (f32_at(x) + f32_at(y)) * scale;
        }
    }
    scalar_kernels!(add_bf16, copy_bf16, 2, bf16_at);
    scalar_kernels!(add_f16, copy_f16, 2, f16_at);
}

/// The x86-64 SIMD kernels.
///
/// Each `#[target_feature]` function is an `unsafe fn` whose contract is
/// "the CPU has the features named, and `src.len() >= acc.len() * size`".
/// The safe wrappers (`avx2_*`, `avx512_*`) check the length themselves and
/// rely on the module-level invariant that they are only ever reached through
/// a [`Kernels`] built by [`Kernels::for_kind`] after runtime detection.
/// They are private to this module tree, so nothing else can call them.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{check_len, scalar};
    use std::arch::x86_64::*;

    /// Generates an AVX2 kernel: 8 elements per step, scalar tail.
    macro_rules! avx2_kernel {
        ($name:ident, $wrapper:ident, $add:literal, $size:literal, $tail:path, |$p:ident| $load:expr) => {
            /// # Safety
            /// The CPU must support AVX2, F16C and FMA, and
            /// `src.len() >= acc.len() * size` for this dtype's size.
            #[target_feature(enable = "avx2,f16c,fma")]
            unsafe fn $name(acc: &mut [f32], src: &[u8]) {
                let n = acc.len();
                let main = n - n % 8;
                let a = acc.as_mut_ptr();
                let s = src.as_ptr();
                let mut i = 0;
                while i < main {
                    // SAFETY: i + 8 <= n, so acc[i..i + 8] is in bounds, and
                    // src[i * size..(i + 8) * size] is in bounds by this fn's
                    // length contract. All loads and stores are unaligned.
                    unsafe {
                        let $p = s.add(i * $size);
                        let x: __m256 = $load;
                        let v = if $add {
                            _mm256_add_ps(_mm256_loadu_ps(a.add(i)), x)
                        } else {
                            x
                        };
                        _mm256_storeu_ps(a.add(i), v);
                    }
                    i += 8;
                }
                $tail(&mut acc[main..], &src[main * $size..n * $size]);
            }

            pub(super) fn $wrapper(acc: &mut [f32], src: &[u8]) {
                check_len(acc.len(), src, $size);
                // SAFETY: lengths checked above; this wrapper is only stored
                // in a `Kernels` after `Kernels::for_kind` detected AVX2,
                // F16C and FMA at runtime (module invariant).
                unsafe { $name(acc, src) }
            }
        };
    }

    avx2_kernel!(avx2_add_f32_tf, avx2_add_f32, true, 4, scalar::add_f32, |p| {
        _mm256_loadu_ps(p.cast::<f32>())
    });
    avx2_kernel!(avx2_copy_f32_tf, avx2_copy_f32, false, 4, scalar::copy_f32, |p| {
        _mm256_loadu_ps(p.cast::<f32>())
    });
    avx2_kernel!(avx2_add_bf16_tf, avx2_add_bf16, true, 2, scalar::add_bf16, |p| {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
            p.cast::<__m128i>(),
        ))))
    });
    avx2_kernel!(
        avx2_copy_bf16_tf,
        avx2_copy_bf16,
        false,
        2,
        scalar::copy_bf16,
        |p| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                p.cast::<__m128i>(),
            ))))
        }
    );
    avx2_kernel!(avx2_add_f16_tf, avx2_add_f16, true, 2, scalar::add_f16, |p| {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>()))
    });
    avx2_kernel!(avx2_copy_f16_tf, avx2_copy_f16, false, 2, scalar::copy_f16, |p| {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>()))
    });

    /// Generates an AVX-512 kernel: 16 elements per step, masked tail.
    /// `$load` reads 16 elements at `$p`; `$mload` reads the first `$m`
    /// elements at `$p` under the 32-bit element mask `$m` (bit i = element i),
    /// touching no memory for masked-off elements.
    macro_rules! avx512_kernel {
        ($name:ident, $wrapper:ident, $add:literal, $size:literal,
         |$p:ident| $load:expr, |$mp:ident, $m:ident| $mload:expr) => {
            /// # Safety
            /// The CPU must support AVX-512 F and BW, and
            /// `src.len() >= acc.len() * size` for this dtype's size.
            // Cast: the tail mask `$m` has rem <= 15 bits set, so it fits
            // the 16-bit `__mmask16` (here and in `$mload`).
            #[allow(clippy::cast_possible_truncation)]
            #[target_feature(enable = "avx512f,avx512bw")]
            unsafe fn $name(acc: &mut [f32], src: &[u8]) {
                let n = acc.len();
                let a = acc.as_mut_ptr();
                let s = src.as_ptr();
                let mut i = 0;
                while i + 16 <= n {
                    // SAFETY: i + 16 <= n, so acc[i..i + 16] is in bounds, and
                    // src[i * size..(i + 16) * size] is in bounds by this fn's
                    // length contract. All loads and stores are unaligned.
                    unsafe {
                        let $p = s.add(i * $size);
                        let x: __m512 = $load;
                        let v = if $add {
                            _mm512_add_ps(_mm512_loadu_ps(a.add(i)), x)
                        } else {
                            x
                        };
                        _mm512_storeu_ps(a.add(i), v);
                    }
                    i += 16;
                }
                if i < n {
                    let rem = n - i; // 1..=15
                    let $m: u32 = (1u32 << rem) - 1;
                    let k = $m as __mmask16;
                    // SAFETY: masked loads and stores touch only the enabled
                    // elements, i.e. acc[i..n] and src[i * size..n * size],
                    // which are in bounds (length contract). Masked-off
                    // elements are never accessed and cannot fault.
                    unsafe {
                        let $mp = s.add(i * $size);
                        let x: __m512 = $mload;
                        let v = if $add {
                            _mm512_add_ps(_mm512_maskz_loadu_ps(k, a.add(i)), x)
                        } else {
                            x
                        };
                        _mm512_mask_storeu_ps(a.add(i), k, v);
                    }
                }
            }

            pub(super) fn $wrapper(acc: &mut [f32], src: &[u8]) {
                check_len(acc.len(), src, $size);
                // SAFETY: lengths checked above; this wrapper is only stored
                // in a `Kernels` after `Kernels::for_kind` detected AVX-512 F
                // and BW at runtime (module invariant).
                unsafe { $name(acc, src) }
            }
        };
    }

    avx512_kernel!(
        avx512_add_f32_tf,
        avx512_add_f32,
        true,
        4,
        |p| _mm512_loadu_ps(p.cast::<f32>()),
        |p, m| _mm512_maskz_loadu_ps(m as __mmask16, p.cast::<f32>())
    );
    avx512_kernel!(
        avx512_copy_f32_tf,
        avx512_copy_f32,
        false,
        4,
        |p| _mm512_loadu_ps(p.cast::<f32>()),
        |p, m| _mm512_maskz_loadu_ps(m as __mmask16, p.cast::<f32>())
    );
    avx512_kernel!(
        avx512_add_bf16_tf,
        avx512_add_bf16,
        true,
        2,
        |p| bf16x16(_mm256_loadu_si256(p.cast::<__m256i>())),
        |p, m| bf16x16(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(
            m,
            p.cast::<i16>()
        )))
    );
    avx512_kernel!(
        avx512_copy_bf16_tf,
        avx512_copy_bf16,
        false,
        2,
        |p| bf16x16(_mm256_loadu_si256(p.cast::<__m256i>())),
        |p, m| bf16x16(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(
            m,
            p.cast::<i16>()
        )))
    );
    avx512_kernel!(
        avx512_add_f16_tf,
        avx512_add_f16,
        true,
        2,
        |p| _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())),
        |p, m| _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(
            m,
            p.cast::<i16>()
        )))
    );
    avx512_kernel!(
        avx512_copy_f16_tf,
        avx512_copy_f16,
        false,
        2,
        |p| _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())),
        |p, m| _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(
            m,
            p.cast::<i16>()
        )))
    );

    /// # Safety
    /// The CPU must support AVX2, and `a.len() >= 4 * out.len()`,
    /// `b.len() >= 4 * out.len()`.
    #[target_feature(enable = "avx2")]
    unsafe fn avx2_sum_f32_tf(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        let n = out.len();
        let main = n - n % 8;
        let o = out.as_mut_ptr();
        let (pa, pb) = (a.as_ptr().cast::<f32>(), b.as_ptr().cast::<f32>());
        let k = _mm256_set1_ps(scale);
        let mut i = 0;
        while i < main {
            // SAFETY: i + 8 <= n, so out[i..i + 8] is in bounds, and so are
            // the 32 bytes at 4 * i of `a` and `b` (length contract). All
            // loads and stores are unaligned.
            unsafe {
                let s = _mm256_add_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)));
                _mm256_storeu_ps(o.add(i), _mm256_mul_ps(s, k));
            }
            i += 8;
        }
        scalar::sum_f32(&mut out[main..], &a[4 * main..4 * n], &b[4 * main..4 * n], scale);
    }

    pub(super) fn avx2_sum_f32(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        check_len(out.len(), a, 4);
        check_len(out.len(), b, 4);
        // SAFETY: lengths checked above; this wrapper is only stored in a
        // `Kernels` after `Kernels::for_kind` detected AVX2 at runtime
        // (module invariant).
        unsafe { avx2_sum_f32_tf(out, a, b, scale) }
    }

    /// # Safety
    /// The CPU must support AVX2, and `a.len() >= 4 * out.len()`,
    /// `b.len() >= 4 * out.len()`.
    #[target_feature(enable = "avx2")]
    unsafe fn avx2_sum_f32_stream_tf(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        let n = out.len();
        // Elements before `out` reaches a 32-byte boundary (streaming
        // stores need one), done by the scalar kernel; `out` is f32, so
        // 4-byte aligned and at most 7 of them.
        let head = ((32 - (out.as_ptr() as usize) % 32) % 32 / 4).min(n);
        scalar::sum_f32(&mut out[..head], &a[..4 * head], &b[..4 * head], scale);
        let main = head + (n - head) / 8 * 8;
        let o = out.as_mut_ptr();
        let (pa, pb) = (a.as_ptr().cast::<f32>(), b.as_ptr().cast::<f32>());
        let k = _mm256_set1_ps(scale);
        let mut i = head;
        while i < main {
            // SAFETY: i + 8 <= main <= n, so out[i..i + 8] is in bounds and
            // 32-byte aligned (i starts at the boundary and steps by 8
            // elements), and so are the 32 bytes at 4 * i of `a` and `b`
            // (length contract; their loads are unaligned).
            unsafe {
                let s = _mm256_add_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)));
                _mm256_stream_ps(o.add(i), _mm256_mul_ps(s, k));
            }
            i += 8;
        }
        scalar::sum_f32(&mut out[main..], &a[4 * main..4 * n], &b[4 * main..4 * n], scale);
        // The streaming stores are weakly ordered: fence them before any
        // later store (a RESULT's header, a flag another process reads).
        _mm_sfence();
    }

    pub(super) fn avx2_sum_f32_stream(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        check_len(out.len(), a, 4);
        check_len(out.len(), b, 4);
        // SAFETY: lengths checked above; this wrapper is only stored in a
        // `Kernels` after `Kernels::for_kind` detected AVX2 at runtime
        // (module invariant).
        unsafe { avx2_sum_f32_stream_tf(out, a, b, scale) }
    }

    /// # Safety
    /// The CPU must support AVX-512 F, and `a.len() >= 4 * out.len()`,
    /// `b.len() >= 4 * out.len()`.
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512_sum_f32_tf(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        let n = out.len();
        let o = out.as_mut_ptr();
        let (pa, pb) = (a.as_ptr().cast::<f32>(), b.as_ptr().cast::<f32>());
        let k = _mm512_set1_ps(scale);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, so out[i..i + 16] is in bounds, and so are
            // the 64 bytes at 4 * i of `a` and `b` (length contract). All
            // loads and stores are unaligned.
            unsafe {
                let s = _mm512_add_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)));
                _mm512_storeu_ps(o.add(i), _mm512_mul_ps(s, k));
            }
            i += 16;
        }
        if i < n {
            // Cast: n - i <= 15, so the mask has at most 15 bits set.
            #[allow(clippy::cast_possible_truncation)]
            let m = ((1u32 << (n - i)) - 1) as __mmask16;
            // SAFETY: masked loads and stores touch only out[i..n] and the
            // bytes 4 * i..4 * n of `a` and `b`, which are in bounds (length
            // contract); masked-off elements are never accessed.
            unsafe {
                let s = _mm512_add_ps(
                    _mm512_maskz_loadu_ps(m, pa.add(i)),
                    _mm512_maskz_loadu_ps(m, pb.add(i)),
                );
                _mm512_mask_storeu_ps(o.add(i), m, _mm512_mul_ps(s, k));
            }
        }
    }

    pub(super) fn avx512_sum_f32(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        check_len(out.len(), a, 4);
        check_len(out.len(), b, 4);
        // SAFETY: lengths checked above; this wrapper is only stored in a
        // `Kernels` after `Kernels::for_kind` detected AVX-512 F and BW at
        // runtime (module invariant).
        unsafe { avx512_sum_f32_tf(out, a, b, scale) }
    }

    /// # Safety
    /// The CPU must support AVX-512 F, and `a.len() >= 4 * out.len()`,
    /// `b.len() >= 4 * out.len()`.
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512_sum_f32_stream_tf(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        let n = out.len();
        let o = out.as_mut_ptr();
        let (pa, pb) = (a.as_ptr().cast::<f32>(), b.as_ptr().cast::<f32>());
        let k = _mm512_set1_ps(scale);
        // out[i..i + len] with masked loads and stores (len <= 16).
        let masked = |i: usize, len: usize| {
            // Cast: len <= 16, so the mask has at most 16 bits set.
            #[allow(clippy::cast_possible_truncation)]
            let m = ((1u32 << len) - 1) as __mmask16;
            // SAFETY: masked loads and stores touch only out[i..i + len] and
            // the bytes 4 * i..4 * (i + len) of `a` and `b`, in bounds by the
            // callers below (i + len <= n) and the length contract.
            unsafe {
                let s = _mm512_add_ps(
                    _mm512_maskz_loadu_ps(m, pa.add(i)),
                    _mm512_maskz_loadu_ps(m, pb.add(i)),
                );
                _mm512_mask_storeu_ps(o.add(i), m, _mm512_mul_ps(s, k));
            }
        };
        // Up to the first 64-byte boundary of `out` (at most 15 elements:
        // `out` is f32, so 4-byte aligned), with ordinary masked stores.
        let head = ((64 - (o as usize) % 64) % 64 / 4).min(n);
        if head > 0 {
            masked(0, head);
        }
        let mut i = head;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, so out[i..i + 16] is in bounds and
            // 64-byte aligned (i starts at the boundary and steps by 16
            // elements), and so are the 64 bytes at 4 * i of `a` and `b`
            // (length contract; their loads are unaligned).
            unsafe {
                let s = _mm512_add_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)));
                _mm512_stream_ps(o.add(i), _mm512_mul_ps(s, k));
            }
            i += 16;
        }
        if i < n {
            masked(i, n - i);
        }
        // The streaming stores are weakly ordered: fence them before any
        // later store (a RESULT's header, a flag another process reads).
        _mm_sfence();
    }

    pub(super) fn avx512_sum_f32_stream(out: &mut [f32], a: &[u8], b: &[u8], scale: f32) {
        check_len(out.len(), a, 4);
        check_len(out.len(), b, 4);
        // SAFETY: lengths checked above; this wrapper is only stored in a
        // `Kernels` after `Kernels::for_kind` detected AVX-512 F and BW at
        // runtime (module invariant).
        unsafe { avx512_sum_f32_stream_tf(out, a, b, scale) }
    }

    /// 16 bf16 values -> 16 `f32`: zero-extend each to 32 bits, shift left 16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn bf16x16(x: __m256i) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(x)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Bit-identical, except that any NaN matches any NaN (IEEE 754 leaves
    /// the payload of an addition's NaN result open).
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn assert_same(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                same(*g, *w),
                "{what}: element {i}: got {g:e} ({:#010x}), want {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            );
        }
    }

    /// Random wire bytes for `n` elements: mostly ordinary values, with some
    /// zeros, subnormals, infinities and NaNs mixed in when `specials`.
    fn random_bytes(rng: &mut ChaCha8Rng, dtype: Dtype, n: usize, specials: bool) -> Vec<u8> {
        let vals: Vec<f32> = (0..n)
            .map(|_| {
                if specials && rng.gen_ratio(1, 8) {
                    let pick = [
                        0.0,
                        -0.0,
                        f32::INFINITY,
                        f32::NEG_INFINITY,
                        f32::NAN,
                        1e-40,
                        6e-8,
                        1e-45,
                    ];
                    pick[rng.gen_range(0..pick.len())]
                } else {
                    rng.gen_range(-1000.0f32..1000.0)
                }
            })
            .collect();
        let mut bytes = vec![0u8; n * dtype.size()];
        encode(dtype, &vals, &mut bytes);
        if specials && dtype != Dtype::F32 {
            // Raw random 16-bit patterns hit every exponent, subnormals and NaN payloads.
            for c in bytes.chunks_exact_mut(2) {
                if rng.gen_ratio(1, 8) {
                    c.copy_from_slice(&rng.gen::<u16>().to_le_bytes());
                }
            }
        }
        bytes
    }

    /// Runs copy then add twice with `k` and with the scalar reference, on a
    /// source slice starting `offset` bytes into its buffer.
    fn check_family(k: Kernels, dtype: Dtype, n: usize, offset: usize, rng: &mut ChaCha8Rng, specials: bool) {
        let r = Kernels::scalar();
        let size = dtype.size();
        let bufs: Vec<Vec<u8>> = (0..3)
            .map(|_| {
                let mut b = vec![0u8; offset];
                b.extend(random_bytes(rng, dtype, n, specials));
                b
            })
            .collect();
        let init: Vec<f32> = (0..n).map(|_| rng.gen_range(-10.0f32..10.0)).collect();
        let mut got = init.clone();
        let mut want = init;
        let what = format!("{} {} n={n} offset={offset}", k.kind().name(), dtype.name());
        k.copy(dtype, &mut got, &bufs[0][offset..]);
        r.copy(dtype, &mut want, &bufs[0][offset..]);
        assert_same(&got, &want, &format!("{what} copy"));
        for b in &bufs[1..] {
            assert_eq!(b[offset..].len(), n * size);
            k.add(dtype, &mut got, &b[offset..]);
            r.add(dtype, &mut want, &b[offset..]);
        }
        assert_same(&got, &want, &format!("{what} add"));
        if dtype == Dtype::F32 {
            // The three-operand sum, against the scalar reference and
            // against what copy, add and the mean's scaling give.
            let (a, b) = (&bufs[1][offset..], &bufs[2][offset..]);
            for scale in [1.0f32, 1.0 / 3.0, 0.25] {
                let mut got = vec![7.0f32; n];
                let mut want = vec![-7.0f32; n];
                k.sum_f32(&mut got, a, b, scale);
                r.sum_f32(&mut want, a, b, scale);
                assert_same(&got, &want, &format!("{what} sum scale {scale}"));
                // Streaming stores, into `out` at every alignment a slot's
                // f32s can have (the kernel peels up to a 64-byte boundary).
                for at in 0..17 {
                    let mut big = vec![7.0f32; n + at];
                    k.sum_f32_stream(&mut big[at..], a, b, scale);
                    assert_same(&big[at..], &want, &format!("{what} stream at {at} scale {scale}"));
                    assert!(
                        big[..at].iter().all(|&x| x == 7.0),
                        "{what} stream at {at} wrote before out"
                    );
                }
                let mut two_pass = vec![0.0f32; n];
                r.copy(dtype, &mut two_pass, a);
                r.add(dtype, &mut two_pass, b);
                two_pass.iter_mut().for_each(|x| *x *= scale);
                assert_same(&got, &two_pass, &format!("{what} sum vs copy+add scale {scale}"));
            }
        }
    }

    #[test]
    fn kernels_every_family_matches_scalar() {
        let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
        let lens: Vec<usize> = (0..=67).chain([255, 256, 257, 2048, 2051, 4096, 4111]).collect();
        for k in Kernels::available() {
            for dtype in Dtype::ALL {
                for &n in &lens {
                    for offset in 0..4 {
                        check_family(k, dtype, n, offset, &mut rng, n % 3 == 0);
                    }
                }
            }
        }
    }

    #[test]
    fn kernels_available_and_best() {
        let all = Kernels::available();
        assert_eq!(all[0].kind(), KernelKind::Scalar);
        assert_eq!(Kernels::best().kind(), all.last().unwrap().kind());
        assert!(Kernels::for_kind(KernelKind::Scalar).is_some());
        for k in &all {
            assert_eq!(Kernels::for_kind(k.kind()).unwrap().kind(), k.kind());
        }
        #[cfg(target_arch = "x86_64")]
        {
            let has512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
            assert_eq!(Kernels::for_kind(KernelKind::Avx512).is_some(), has512);
        }
        assert_eq!(KernelKind::Avx512.name(), "avx512");
        assert_eq!(KernelKind::Avx2.to_string(), "avx2");
        assert_eq!(KernelKind::Scalar.name(), "scalar");
    }

    #[test]
    #[should_panic(expected = "kernel length mismatch")]
    fn kernels_length_mismatch_panics() {
        let mut acc = [0.0f32; 4];
        Kernels::best().add(Dtype::F32, &mut acc, &[0u8; 15]);
    }

    #[test]
    #[should_panic(expected = "kernel length mismatch")]
    fn kernels_length_mismatch_panics_sum() {
        let mut out = [0.0f32; 5];
        Kernels::best().sum_f32(&mut out, &[0u8; 20], &[0u8; 16], 1.0);
    }

    #[test]
    #[should_panic(expected = "kernel length mismatch")]
    fn kernels_length_mismatch_panics_stream() {
        let mut out = [0.0f32; 5];
        Kernels::best().sum_f32_stream(&mut out, &[0u8; 20], &[0u8; 24], 1.0);
    }

    #[test]
    #[should_panic(expected = "kernel length mismatch")]
    fn kernels_length_mismatch_panics_half() {
        let mut acc = [0.0f32; 17];
        Kernels::best().copy(Dtype::Bf16, &mut acc, &[0u8; 36]);
    }

    #[test]
    fn kernels_known_values() {
        // 1.5 in each encoding, little-endian.
        let f32b = 1.5f32.to_le_bytes();
        let bf16b = 0x3fc0u16.to_le_bytes();
        let f16b = 0x3e00u16.to_le_bytes();
        for k in Kernels::available() {
            for (dtype, b) in [
                (Dtype::F32, &f32b[..]),
                (Dtype::Bf16, &bf16b[..]),
                (Dtype::F16, &f16b[..]),
            ] {
                let src: Vec<u8> = b.iter().copied().cycle().take(b.len() * 19).collect();
                let mut acc = vec![7.0f32; 19];
                k.copy(dtype, &mut acc, &src);
                assert!(acc.iter().all(|&x| x == 1.5), "{} {dtype}", k.kind());
                k.add(dtype, &mut acc, &src);
                assert!(acc.iter().all(|&x| x == 3.0), "{} {dtype}", k.kind());
                if dtype == Dtype::F32 {
                    let three: Vec<u8> = 3.0f32
                        .to_le_bytes()
                        .iter()
                        .copied()
                        .cycle()
                        .take(4 * 19)
                        .collect();
                    k.sum_f32(&mut acc, &src, &three, 0.5);
                    assert!(acc.iter().all(|&x| x == 2.25), "{} sum_f32", k.kind());
                    k.sum_f32_stream(&mut acc, &src, &three, 2.0);
                    assert!(acc.iter().all(|&x| x == 9.0), "{} sum_f32_stream", k.kind());
                }
            }
        }
    }

    #[test]
    fn kernels_encode_decode_roundtrip_exact_values() {
        // Exactly representable in all three: small integers, powers of two, halves.
        let vals: Vec<f32> = (-64..=64)
            .map(|i| i as f32 * 0.5)
            .chain([0.0, -0.0, 1.0 / 1024.0, 2048.0, f32::INFINITY, f32::NEG_INFINITY])
            .collect();
        for dtype in Dtype::ALL {
            let mut bytes = vec![0u8; vals.len() * dtype.size()];
            encode(dtype, &vals, &mut bytes);
            let mut back = vec![0.0f32; vals.len()];
            decode(dtype, &bytes, &mut back);
            assert_same(&back, &vals, dtype.name());
            // NaN stays NaN.
            let mut nb = vec![0u8; dtype.size()];
            encode(dtype, &[f32::NAN], &mut nb);
            let mut n = [0.0f32];
            decode(dtype, &nb, &mut n);
            assert!(n[0].is_nan(), "{dtype}: NaN lost");
        }
        // Every bf16 and f16 bit pattern survives decode then encode (NaNs quieted).
        for bits in 0..=u16::MAX {
            for dtype in [Dtype::Bf16, Dtype::F16] {
                let mut x = [0.0f32];
                decode(dtype, &bits.to_le_bytes(), &mut x);
                let mut out = [0u8; 2];
                encode(dtype, &x, &mut out);
                let back = u16::from_le_bytes(out);
                if x[0].is_nan() {
                    let mut y = [0.0f32];
                    decode(dtype, &out, &mut y);
                    assert!(y[0].is_nan());
                } else {
                    assert_eq!(back, bits, "{dtype} {bits:#06x}");
                }
            }
        }
    }

    /// Independent round-to-nearest-even for bf16 on non-NaN inputs.
    fn bf16_rne(x: f32) -> u16 {
        let b = x.to_bits();
        let lsb = (b >> 16) & 1;
        ((b + 0x7fff + lsb) >> 16) as u16
    }

    #[test]
    fn kernels_encode_rounds_to_nearest_even() {
        // bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to 1 + 2^-6.
        let cases_bf16 = [
            (1.0 + 2f32.powi(-8), 0x3f80u16),
            (1.0 + 3.0 * 2f32.powi(-8), 0x3f82),
            (1.0 + 2f32.powi(-8) + 2f32.powi(-20), 0x3f81),
        ];
        for (x, want) in cases_bf16 {
            let mut b = [0u8; 2];
            encode(Dtype::Bf16, &[x], &mut b);
            assert_eq!(u16::from_le_bytes(b), want, "bf16 of {x}");
        }
        // f16: 1 + 2^-11 ties to 1.0; 1 + 3 * 2^-11 ties to 1 + 2^-9.
        let cases_f16 = [
            (1.0 + 2f32.powi(-11), 0x3c00u16),
            (1.0 + 3.0 * 2f32.powi(-11), 0x3c02),
            (65520.0, 0x7c00),
        ];
        for (x, want) in cases_f16 {
            let mut b = [0u8; 2];
            encode(Dtype::F16, &[x], &mut b);
            assert_eq!(u16::from_le_bytes(b), want, "f16 of {x}");
        }
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for _ in 0..100_000 {
            let x = f32::from_bits(rng.gen::<u32>());
            let mut b = [0u8; 2];
            encode(Dtype::Bf16, &[x], &mut b);
            let got = u16::from_le_bytes(b);
            assert_eq!(got, half::bf16::from_f32(x).to_bits());
            if x.is_nan() {
                assert!(half::bf16::from_bits(got).is_nan());
            } else {
                assert_eq!(got, bf16_rne(x), "bf16 of {x:e}");
            }
            encode(Dtype::F16, &[x], &mut b);
            let got = u16::from_le_bytes(b);
            assert_eq!(got, half::f16::from_f32(x).to_bits());
            if x.is_nan() {
                assert!(half::f16::from_bits(got).is_nan());
            }
        }
    }

    proptest! {
        #[test]
        fn kernels_prop_match_scalar(
            seed in any::<u64>(),
            n in 0usize..600,
            offset in 0usize..8,
            d in 0usize..3,
            specials in any::<bool>(),
        ) {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            for k in Kernels::available() {
                check_family(k, Dtype::ALL[d], n, offset, &mut rng, specials);
            }
        }
    }
}
