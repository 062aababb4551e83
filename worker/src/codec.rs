//! `f32` <-> wire elements, little-endian.

use phub_proto::Dtype;

/// Encodes `src` into `dst` (`src.len() * dtype.size()` bytes); bf16 and f16
/// round to nearest, ties to even (the `half` crate's conversions).
pub(crate) fn encode(dtype: Dtype, src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(src.len() * dtype.size(), dst.len());
    match dtype {
        // Little-endian f32 is the wire format: a plain copy.
        Dtype::F32 if cfg!(target_endian = "little") => dst.copy_from_slice(bytemuck::cast_slice(src)),
        Dtype::F32 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&half::bf16::from_f32(*x).to_bits().to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&half::f16::from_f32(*x).to_bits().to_le_bytes());
            }
        }
    }
}

/// Decodes `src` (`dst.len() * dtype.size()` bytes) into `dst`; exact.
pub(crate) fn decode(dtype: Dtype, src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(dst.len() * dtype.size(), src.len());
    match dtype {
        // The payload need not be 4-byte aligned: copy into the f32s' bytes.
        Dtype::F32 if cfg!(target_endian = "little") => {
            bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(src)
        }
        Dtype::F32 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::Bf16 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        Dtype::F16 => {
            for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rounds_to_nearest_even() {
        let xs = [0.0f32, -1.5, 3.0, 256.0, 1.0 + f32::EPSILON];
        for d in Dtype::ALL {
            let mut bytes = vec![0u8; xs.len() * d.size()];
            encode(d, &xs, &mut bytes);
            let mut back = vec![0f32; xs.len()];
            decode(d, &bytes, &mut back);
            assert_eq!(&back[..4], &xs[..4], "{d}");
        }
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (1.0).
        let mut b = [0u8; 2];
        encode(Dtype::Bf16, &[1.0 + 1.0 / 256.0], &mut b);
        assert_eq!(u16::from_le_bytes(b), 0x3f80);
        // 1 + 3 * 2^-8 is halfway too: ties to even rounds up.
        encode(Dtype::Bf16, &[1.0 + 3.0 / 256.0], &mut b);
        assert_eq!(u16::from_le_bytes(b), 0x3f82);
    }
}
