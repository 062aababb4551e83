//! The element types the API takes, and the caller's values as the rest of
//! the library sees them.
//!
//! `f32` slices work with every job: they are encoded into the job's wire
//! type on the way out and decoded on the way back (a copy for an `f32`
//! job, a conversion for a 16-bit one). [`half::bf16`] and [`half::f16`]
//! slices work with a job of that wire type only, and are never converted:
//! their bits are the wire's, so a mixed-precision caller's 16-bit
//! gradients go out and its results come back without a `float32` round
//! trip (and, lent through [`crate::Exchange`], without any copy of their
//! own).

use phub_proto::Dtype;

use phub_net::copy::copy_streaming;

use crate::codec;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// An element type of the slices [`crate::Worker`] exchanges: `f32`,
/// [`half::bf16`] or [`half::f16`] (sealed).
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed {
    /// The job wire type whose elements these are bit for bit (copied,
    /// never converted); `None` for `f32`, which every job takes.
    const WIRE: Option<Dtype>;
    /// The type's name in messages.
    const NAME: &'static str;
}

impl Element for f32 {
    const WIRE: Option<Dtype> = None;
    const NAME: &'static str = "f32";
}

impl Element for half::bf16 {
    const WIRE: Option<Dtype> = Some(Dtype::Bf16);
    const NAME: &'static str = "bf16";
}

impl Element for half::f16 {
    const WIRE: Option<Dtype> = Some(Dtype::F16);
    const NAME: &'static str = "f16";
}

/// Whether slices of `E` can be exchanged by a job of wire type `dtype`.
pub(crate) fn fits<E: Element>(dtype: Dtype) -> bool {
    E::WIRE.is_none_or(|w| w == dtype)
}

/// Copies 16-bit elements (native-endian, as the caller holds them) into
/// wire bytes (little-endian), or back: a plain copy on a little-endian
/// machine.
fn copy_swapped16(src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "16-bit copy: lengths differ");
    if cfg!(target_endian = "little") {
        dst.copy_from_slice(src);
    } else {
        for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
            d.copy_from_slice(&[s[1], s[0]]);
        }
    }
}

/// The caller's values to send: `f32`s (encoded into any wire type) or
/// elements of the job's 16-bit wire type (their bytes, copied as they
/// are).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Src<'a> {
    /// `f32` values.
    F32(&'a [f32]),
    /// 16-bit elements of the job's wire type, as native-endian bytes.
    Wire16(&'a [u8]),
}

impl<'a> Src<'a> {
    /// The slice as the library handles it (the caller checked [`fits`]).
    pub(crate) fn of<E: Element>(s: &'a [E]) -> Src<'a> {
        match E::WIRE {
            None => Src::F32(bytemuck::cast_slice(s)),
            Some(_) => Src::Wire16(bytemuck::cast_slice(s)),
        }
    }

    /// Number of elements.
    pub(crate) fn len(self) -> usize {
        match self {
            Src::F32(v) => v.len(),
            Src::Wire16(b) => b.len() / 2,
        }
    }

    /// Elements `start..start + len`.
    pub(crate) fn range(self, start: usize, len: usize) -> Src<'a> {
        match self {
            Src::F32(v) => Src::F32(&v[start..start + len]),
            Src::Wire16(b) => Src::Wire16(&b[start * 2..(start + len) * 2]),
        }
    }

    /// The bytes of the values as they go on the wire when no conversion
    /// is needed (an `f32` job on a little-endian machine, or 16-bit
    /// elements there): they can be sent straight from the caller's memory.
    pub(crate) fn wire_bytes(self, dtype: Dtype) -> Option<&'a [u8]> {
        match self {
            Src::F32(v) if dtype == Dtype::F32 && cfg!(target_endian = "little") => {
                Some(bytemuck::cast_slice(v))
            }
            Src::Wire16(b) if cfg!(target_endian = "little") => Some(b),
            _ => None,
        }
    }

    /// Writes the values into `dst` (exactly their size in `dtype`).
    pub(crate) fn encode(self, dtype: Dtype, dst: &mut [u8]) {
        match self {
            Src::F32(v) => codec::encode(dtype, v, dst),
            Src::Wire16(b) => copy_swapped16(b, dst),
        }
    }
}

/// Where the caller's results go: `f32`s (decoded from any wire type) or
/// elements of the job's 16-bit wire type (the wire's bytes, copied).
#[derive(Debug)]
pub(crate) enum Dst<'a> {
    /// `f32` values.
    F32(&'a mut [f32]),
    /// 16-bit elements of the job's wire type, as native-endian bytes.
    Wire16(&'a mut [u8]),
}

impl<'a> Dst<'a> {
    /// The slice as the library handles it (the caller checked [`fits`]).
    pub(crate) fn of<E: Element>(s: &'a mut [E]) -> Dst<'a> {
        match E::WIRE {
            None => Dst::F32(bytemuck::cast_slice_mut(s)),
            Some(_) => Dst::Wire16(bytemuck::cast_slice_mut(s)),
        }
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            Dst::F32(v) => v.len(),
            Dst::Wire16(b) => b.len() / 2,
        }
    }

    /// Elements `start..end`, reborrowed.
    pub(crate) fn range(&mut self, start: usize, end: usize) -> Dst<'_> {
        let whole = match self {
            Dst::F32(v) => Dst::F32(v),
            Dst::Wire16(b) => Dst::Wire16(b),
        };
        whole.into_range(start, end)
    }

    /// Elements `start..end`.
    pub(crate) fn into_range(self, start: usize, end: usize) -> Dst<'a> {
        match self {
            Dst::F32(v) => Dst::F32(&mut v[start..end]),
            Dst::Wire16(b) => Dst::Wire16(&mut b[start * 2..end * 2]),
        }
    }

    /// Writes the wire bytes `wire` (of exactly this many elements of
    /// `dtype`) into the slice: with streaming stores where the slice is
    /// the caller's output (`to_caller`, see [`phub_net::copy`]) and the
    /// wire's bytes are the elements' own.
    pub(crate) fn decode(self, dtype: Dtype, wire: &[u8], to_caller: bool) {
        match self.wire_bytes(dtype) {
            Ok(b) if to_caller => copy_streaming(b, wire),
            Ok(b) => b.copy_from_slice(wire),
            Err(Dst::F32(v)) => codec::decode(dtype, wire, v),
            Err(Dst::Wire16(b)) => copy_swapped16(wire, b),
        }
    }

    /// The slice's own bytes when the wire's can be written straight into
    /// them (as for [`Src::wire_bytes`]).
    pub(crate) fn wire_bytes(self, dtype: Dtype) -> Result<&'a mut [u8], Dst<'a>> {
        match self {
            Dst::F32(v) if dtype == Dtype::F32 && cfg!(target_endian = "little") => {
                Ok(bytemuck::cast_slice_mut(v))
            }
            Dst::Wire16(b) if cfg!(target_endian = "little") => Ok(b),
            d => Err(d),
        }
    }

    /// Copies `src` (the same kind and length) into the slice, the
    /// caller's output (with streaming stores, see [`phub_net::copy`]).
    pub(crate) fn copy_from(self, src: Src<'_>) {
        match (self, src) {
            (Dst::F32(d), Src::F32(s)) => {
                copy_streaming(bytemuck::cast_slice_mut(d), bytemuck::cast_slice(s))
            }
            (Dst::Wire16(d), Src::Wire16(s)) => copy_streaming(d, s),
            _ => unreachable!("a request's result buffer has its output's element kind"),
        }
    }
}

/// The element kind of a result buffer ([`Values`]): `f32`, or the job's
/// 16-bit wire type, as the request's output (or, for a push without one,
/// the job's wire type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ValueType {
    /// `f32` values.
    F32,
    /// 16-bit elements of the job's wire type.
    Wire16,
}

impl ValueType {
    /// The kind of a buffer of `E`s.
    pub(crate) fn of<E: Element>() -> ValueType {
        match E::WIRE {
            None => ValueType::F32,
            Some(_) => ValueType::Wire16,
        }
    }

    /// The kind that holds `dtype`'s elements as the wire carries them.
    pub(crate) fn wire(dtype: Dtype) -> ValueType {
        match dtype {
            Dtype::F32 => ValueType::F32,
            Dtype::Bf16 | Dtype::F16 => ValueType::Wire16,
        }
    }
}

/// A key's result buffers from its last requests, one of each kind, for
/// its next one (no allocation, no page faults, no zeroing round after
/// round, also when a caller alternates `f32` and 16-bit slices).
#[derive(Debug, Clone, Default)]
pub(crate) struct Spares {
    f32: Vec<f32>,
    wire16: Vec<u8>,
}

impl Spares {
    /// A buffer of `elements` elements of `ty`: the spare of that kind
    /// when it has that length (its contents do not matter), else a new one.
    pub(crate) fn take(&mut self, ty: ValueType, elements: usize) -> Values {
        match ty {
            ValueType::Wire16 => {
                let b = std::mem::take(&mut self.wire16);
                Values::Wire16(if b.len() == elements * 2 {
                    b
                } else {
                    vec![0; elements * 2]
                })
            }
            ValueType::F32 => {
                let v = std::mem::take(&mut self.f32);
                Values::F32(if v.len() == elements {
                    v
                } else {
                    vec![0.0; elements]
                })
            }
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of_val(&self.f32[..]) + self.wire16.len()
    }

    /// Keeps `values` as the spare of its kind (an empty one, from a
    /// request whose results went straight to the caller, is not kept).
    pub(crate) fn keep(&mut self, values: Values) {
        match values {
            Values::F32(v) if !v.is_empty() => self.f32 = v,
            Values::Wire16(b) if !b.is_empty() => self.wire16 = b,
            _ => {}
        }
    }
}

/// A result buffer the library owns: `f32`s, or the bytes of 16-bit
/// elements (for a request made with [`half::bf16`] or [`half::f16`]
/// slices).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Values {
    /// `f32` values.
    F32(Vec<f32>),
    /// 16-bit elements, as native-endian bytes.
    Wire16(Vec<u8>),
}

impl Default for Values {
    fn default() -> Values {
        Values::F32(Vec::new())
    }
}

impl Values {
    /// The buffer's values.
    pub(crate) fn as_src(&self) -> Src<'_> {
        match self {
            Values::F32(v) => Src::F32(v),
            Values::Wire16(b) => Src::Wire16(b),
        }
    }

    /// The buffer as a result slice.
    pub(crate) fn as_dst(&mut self) -> Dst<'_> {
        match self {
            Values::F32(v) => Dst::F32(v),
            Values::Wire16(b) => Dst::Wire16(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn which_slices_fit_which_jobs() {
        for d in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            assert!(fits::<f32>(d), "f32 fits every job");
        }
        assert!(fits::<bf16>(Dtype::Bf16));
        assert!(!fits::<bf16>(Dtype::F16) && !fits::<bf16>(Dtype::F32));
        assert!(fits::<f16>(Dtype::F16));
        assert!(!fits::<f16>(Dtype::Bf16) && !fits::<f16>(Dtype::F32));
    }

    #[test]
    fn sixteen_bit_elements_are_the_wire_bits_and_f32_is_converted() {
        let x = [
            bf16::from_f32(1.5),
            bf16::from_f32(-3.0e-3),
            bf16::from_bits(0x7fc1),
        ];
        let mut wire = [0u8; 6];
        Src::of(&x[..]).encode(Dtype::Bf16, &mut wire);
        let bits: Vec<u16> = wire.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        // Bit for bit, a NaN payload too (a conversion would not keep it).
        assert_eq!(bits, x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        let mut back = [bf16::ZERO; 3];
        Dst::of(&mut back[..]).decode(Dtype::Bf16, &wire, false);
        assert_eq!(back.map(bf16::to_bits), x.map(bf16::to_bits));

        // The same values as f32 go through the codec.
        let f = [1.5f32, -3.0e-3];
        let mut w2 = [0u8; 4];
        Src::of(&f[..]).encode(Dtype::Bf16, &mut w2);
        assert_eq!(&w2[..], &wire[..4]);
        let mut g = [0f32; 2];
        Dst::of(&mut g[..]).decode(Dtype::Bf16, &w2, true);
        assert_eq!(g, [1.5, bf16::from_f32(-3.0e-3).to_f32()]);
    }

    #[test]
    fn ranges_count_elements_not_bytes() {
        let x: Vec<f16> = (0..10).map(|i| f16::from_f32(i as f32)).collect();
        let s = Src::of(&x[..]);
        assert_eq!(s.len(), 10);
        let mut b = [0u8; 4];
        s.range(3, 2).encode(Dtype::F16, &mut b);
        assert_eq!(
            b,
            [x[3].to_bits().to_le_bytes(), x[4].to_bits().to_le_bytes()].concat()[..]
        );
        let mut y = [f16::ZERO; 10];
        let mut d = Dst::of(&mut y[..]);
        assert_eq!(d.len(), 10);
        d.range(8, 10).decode(Dtype::F16, &b, false);
        assert_eq!(y[8..], x[3..5]);
        assert!(Src::of(&x[..]).wire_bytes(Dtype::F16).is_some() == cfg!(target_endian = "little"));
        assert!(
            Src::of(&[1.0f32][..]).wire_bytes(Dtype::Bf16).is_none(),
            "f32 into bf16 is converted"
        );
    }

    #[test]
    fn spares_keep_one_buffer_of_each_kind() {
        let mut s = Spares::default();
        assert_eq!(s.take(ValueType::Wire16, 4), Values::Wire16(vec![0; 8]));
        s.keep(Values::Wire16(vec![7; 8]));
        s.keep(Values::F32(vec![1.0; 4]));
        // Alternating kinds reuses both (the contents show it).
        assert_eq!(s.take(ValueType::F32, 4), Values::F32(vec![1.0; 4]));
        assert_eq!(s.take(ValueType::Wire16, 4), Values::Wire16(vec![7; 8]));
        // Another length: a new buffer; an empty one is not kept.
        s.keep(Values::F32(vec![1.0; 4]));
        assert_eq!(s.take(ValueType::F32, 3), Values::F32(vec![0.0; 3]));
        s.keep(Values::F32(vec![2.0; 3]));
        s.keep(Values::default());
        assert_eq!(s.take(ValueType::F32, 3), Values::F32(vec![2.0; 3]));
    }
}
