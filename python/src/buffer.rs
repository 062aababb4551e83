//! Arrays through the buffer protocol: which element type they hold, and
//! reading them as or writing them from `f32` without Python objects.
//!
//! Accepted: C-contiguous, native-endian buffers of `float32` (format `f`,
//! any job), `float16` (format `e`, jobs whose wire dtype is f16), or 16-bit
//! integers (formats `h`/`H`) holding the raw bits of the job's 16-bit dtype
//! (how bfloat16 arrives: NumPy has no bfloat16, and a torch bf16 tensor is
//! passed as `t.view(torch.int16).numpy()`).

use std::ptr::NonNull;

use half::{bf16, f16};
use phub_proto::Dtype;
use pyo3::buffer::{ElementType, PyUntypedBuffer};
use pyo3::prelude::*;

use crate::errors::usage;

/// The element type of an accepted array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (bits in a 16-bit integer array).
    Bf16,
}

/// An element type phub exchanges in place: `f32`, or a job's 16-bit
/// wire type (never converted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Native {
    /// `f32`.
    F32,
    /// bfloat16 (a bf16 job).
    Bf16,
    /// IEEE binary16 (an f16 job).
    F16,
}

/// An array's memory as a slice of its native element type.
pub(crate) enum Slice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// An array's memory as a writable slice of its native element type.
pub(crate) enum SliceMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// A copy of an array's values in their native element type.
pub(crate) enum Owned {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Owned {
    /// The copy as a slice.
    pub(crate) fn as_slice(&self) -> Slice<'_> {
        match self {
            Owned::F32(v) => Slice::F32(v),
            Owned::Bf16(v) => Slice::Bf16(v),
            Owned::F16(v) => Slice::F16(v),
        }
    }
}

/// A buffer export of a Python object, checked to be usable by phub.
///
/// Holding it keeps the object alive and its memory in place (an exporter
/// refuses to resize while exported).
pub(crate) struct Array {
    buf: PyUntypedBuffer,
    elem: Elem,
    len: usize,
}

impl Array {
    /// Exports `obj`'s buffer for a job of wire type `dtype`; `what` names
    /// the argument in messages. `writable`: the result is written into it.
    pub(crate) fn get(obj: &Bound<'_, PyAny>, dtype: Dtype, what: &str, writable: bool) -> PyResult<Array> {
        let type_name = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        let buf = PyUntypedBuffer::get(obj).map_err(|e| {
            usage(format!(
                "`{what}` ({type_name}) does not export a buffer ({e}); pass a NumPy array \
                 (for a torch tensor: tensor.numpy()) or another object with the buffer protocol"
            ))
        })?;
        if writable && buf.readonly() {
            return Err(usage(format!(
                "`{what}` is read-only, but the result is written into it; pass a writable array"
            )));
        }
        if !buf.is_c_contiguous() {
            return Err(usage(format!(
                "`{what}` is not C-contiguous; pass numpy.ascontiguousarray(...) (or tensor.contiguous())"
            )));
        }
        let format = buf.format().to_string_lossy().into_owned();
        if format.starts_with(['>', '!']) {
            return Err(usage(format!(
                "`{what}` is big-endian (format {format:?}); phub takes native little-endian arrays"
            )));
        }
        let accepted = match dtype {
            Dtype::F32 => "float32",
            Dtype::F16 => "float32, or float16 (format 'e', or its bits as int16/uint16)",
            Dtype::Bf16 => "float32, or bfloat16 bits as int16/uint16 (torch: t.view(torch.int16).numpy())",
        };
        let elem = match (ElementType::from_format(buf.format()), dtype) {
            (ElementType::Float { bytes: 4 }, _) => Elem::F32,
            (ElementType::Float { bytes: 2 }, Dtype::F16) => Elem::F16,
            (
                ElementType::SignedInteger { bytes: 2 } | ElementType::UnsignedInteger { bytes: 2 },
                Dtype::F16,
            ) => Elem::F16,
            (
                ElementType::SignedInteger { bytes: 2 } | ElementType::UnsignedInteger { bytes: 2 },
                Dtype::Bf16,
            ) => Elem::Bf16,
            (t, _) => {
                let held = match t {
                    ElementType::Float { bytes } => format!("float{}", bytes * 8),
                    ElementType::SignedInteger { bytes } => format!("int{}", bytes * 8),
                    ElementType::UnsignedInteger { bytes } => format!("uint{}", bytes * 8),
                    ElementType::Bool => "bool".to_string(),
                    ElementType::Unknown => format!("{}-byte", buf.item_size()),
                };
                return Err(usage(format!(
                    "`{what}` holds {held} elements (format {format:?}); this job's dtype is \
                     {dtype}, which accepts {accepted}"
                )));
            }
        };
        let len = buf.item_count();
        Ok(Array { buf, elem, len })
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The element type.
    pub(crate) fn elem(&self) -> Elem {
        self.elem
    }

    fn ptr(&self) -> *mut u8 {
        self.buf.buf_ptr().cast()
    }

    /// The bytes the array spans, `[start, end)`.
    pub(crate) fn byte_range(&self) -> (usize, usize) {
        let start = self.ptr() as usize;
        (start, start + self.buf.len_bytes())
    }

    /// Whether the two arrays share any memory.
    pub(crate) fn overlaps(&self, other: &Array) -> bool {
        let (a0, a1) = self.byte_range();
        let (b0, b1) = other.byte_range();
        a0 < b1 && b0 < a1
    }

    /// The array's element type as phub exchanges it in place (`f32`, or
    /// the job's 16-bit wire type), if it is non-empty and aligned for it.
    pub(crate) fn native(&self) -> Option<Native> {
        let p = self.ptr();
        let align = match self.elem {
            Elem::F32 => std::mem::align_of::<f32>(),
            Elem::F16 | Elem::Bf16 => std::mem::align_of::<u16>(),
        };
        (self.len > 0 && (p as usize).is_multiple_of(align)).then_some(match self.elem {
            Elem::F32 => Native::F32,
            Elem::F16 => Native::F16,
            Elem::Bf16 => Native::Bf16,
        })
    }

    /// The array in place, as [`Array::native`] says.
    ///
    /// # Safety
    /// The slice must not outlive `self` (the export keeps the memory in
    /// place), and nothing may write that memory while it is in use.
    pub(crate) unsafe fn slice<'a>(&self) -> Option<Slice<'a>> {
        let (p, n) = (self.ptr(), self.len);
        // SAFETY: the export holds `n` elements of the classified type at
        // `p`, contiguous and (checked by `native`) aligned; lifetime and
        // aliasing are the caller's contract.
        Some(unsafe {
            match self.native()? {
                Native::F32 => Slice::F32(std::slice::from_raw_parts(p.cast(), n)),
                Native::Bf16 => Slice::Bf16(std::slice::from_raw_parts(p.cast(), n)),
                Native::F16 => Slice::F16(std::slice::from_raw_parts(p.cast(), n)),
            }
        })
    }

    /// The array in place, writable, as [`Array::native`] says.
    ///
    /// # Safety
    /// The slice must not outlive `self`, the array must have been exported
    /// writable, and nothing else may reference that memory while the slice
    /// is in use.
    pub(crate) unsafe fn slice_mut<'a>(&self) -> Option<SliceMut<'a>> {
        let (p, n) = (self.ptr(), self.len);
        // SAFETY: as in `slice`; exclusivity is the caller's contract.
        Some(unsafe {
            match self.native()? {
                Native::F32 => SliceMut::F32(std::slice::from_raw_parts_mut(p.cast(), n)),
                Native::Bf16 => SliceMut::Bf16(std::slice::from_raw_parts_mut(p.cast(), n)),
                Native::F16 => SliceMut::F16(std::slice::from_raw_parts_mut(p.cast(), n)),
            }
        })
    }

    /// A copy of the values in their own element type (16-bit: the bits,
    /// unconverted).
    pub(crate) fn to_native_vec(&self) -> Owned {
        let p = self.ptr();
        let bits = || -> Vec<u16> {
            (0..self.len)
                // SAFETY: as in `to_f32_vec`.
                .map(|i| unsafe { p.cast::<u16>().add(i).read_unaligned() })
                .collect()
        };
        match self.elem {
            Elem::F32 => Owned::F32(self.to_f32_vec()),
            Elem::Bf16 => Owned::Bf16(bits().into_iter().map(bf16::from_bits).collect()),
            Elem::F16 => Owned::F16(bits().into_iter().map(f16::from_bits).collect()),
        }
    }

    /// A copy of the values, converted to `f32`.
    pub(crate) fn to_f32_vec(&self) -> Vec<f32> {
        let p = self.ptr();
        (0..self.len)
            .map(|i| {
                // SAFETY: the export holds `len` elements of the classified
                // type at `p`, contiguous, and stays alive while `self` does;
                // reads are unaligned-tolerant.
                unsafe {
                    match self.elem {
                        Elem::F32 => p.cast::<f32>().add(i).read_unaligned(),
                        Elem::F16 => f16::from_bits(p.cast::<u16>().add(i).read_unaligned()).to_f32(),
                        Elem::Bf16 => bf16::from_bits(p.cast::<u16>().add(i).read_unaligned()).to_f32(),
                    }
                }
            })
            .collect()
    }

    /// Writes `src` (as long as the array) into the array, converting to its
    /// element type (16-bit: round to nearest, ties to even).
    pub(crate) fn write_from(&self, src: &[f32]) {
        assert_eq!(src.len(), self.len, "write_from: length mismatch");
        let p = self.ptr();
        for (i, &x) in src.iter().enumerate() {
            // SAFETY: as in `to_f32_vec`; the array was checked writable when
            // exported for output, and `src` is a separate allocation.
            unsafe {
                match self.elem {
                    Elem::F32 => p.cast::<f32>().add(i).write_unaligned(x),
                    Elem::F16 => p.cast::<u16>().add(i).write_unaligned(f16::from_f32(x).to_bits()),
                    Elem::Bf16 => p
                        .cast::<u16>()
                        .add(i)
                        .write_unaligned(bf16::from_f32(x).to_bits()),
                }
            }
        }
    }
}

/// An `f32` buffer owned through a raw pointer, so that a `&mut` to its
/// contents can live beside it (in a pending handle) without the owner
/// asserting uniqueness when it moves.
pub(crate) struct Scratch {
    ptr: NonNull<[f32]>,
}

// SAFETY: Scratch owns its allocation exactly like a Box<[f32]>.
unsafe impl Send for Scratch {}

impl Scratch {
    /// A scratch buffer holding `values`.
    pub(crate) fn new(values: Vec<f32>) -> Scratch {
        Scratch {
            ptr: NonNull::from(Box::leak(values.into_boxed_slice())),
        }
    }

    /// The contents, mutably, for as long as the caller keeps `self` alive.
    ///
    /// # Safety
    /// The caller must drop the returned slice before `self`, and must not
    /// call [`Scratch::values`] or this method again while it is in use.
    pub(crate) unsafe fn slice_mut<'a>(&self) -> &'a mut [f32] {
        // SAFETY: the allocation is live while `self` is (caller's
        // contract), and the caller guarantees exclusivity.
        unsafe { &mut *self.ptr.as_ptr() }
    }

    /// The contents.
    ///
    /// # Safety
    /// No slice from [`Scratch::slice_mut`] may be in use.
    pub(crate) unsafe fn values(&self) -> &[f32] {
        // SAFETY: live allocation; no mutable borrow in use (caller's contract).
        unsafe { &*self.ptr.as_ptr() }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from Box::leak in `new` and is freed only here.
        drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
    }
}

/// A table's row ids from `obj`'s buffer: C-contiguous `uint64`, or
/// `int64` with no negative id (a torch `LongTensor`'s `.numpy()`), one
/// dimension or any (read in order); copied. `what` names the argument.
pub(crate) fn row_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    let buf = PyUntypedBuffer::get(obj).map_err(|e| {
        usage(format!(
            "`{what}` does not export a buffer ({e}); pass a NumPy array of uint64 or int64 ids"
        ))
    })?;
    if !buf.is_c_contiguous() {
        return Err(usage(format!(
            "`{what}` is not C-contiguous; pass numpy.ascontiguousarray(...)"
        )));
    }
    let format = buf.format().to_string_lossy().into_owned();
    let signed = match ElementType::from_format(buf.format()) {
        _ if format.starts_with(['>', '!']) => None,
        ElementType::UnsignedInteger { bytes: 8 } => Some(false),
        ElementType::SignedInteger { bytes: 8 } => Some(true),
        _ => None,
    };
    let Some(signed) = signed else {
        return Err(usage(format!(
            "`{what}` holds elements of format {format:?}; row ids are native uint64 or int64"
        )));
    };
    let p = buf.buf_ptr().cast::<u64>();
    let ids: Vec<u64> = (0..buf.item_count())
        // SAFETY: the export holds `item_count` 8-byte elements at `p`,
        // contiguous, alive while `buf` is; reads tolerate misalignment.
        .map(|i| unsafe { p.add(i).read_unaligned() })
        .collect();
    if signed {
        if let Some(at) = ids.iter().position(|&id| id >> 63 != 0) {
            // Cast: the bits of an int64 id, shown as the caller wrote it.
            #[allow(clippy::cast_possible_wrap)]
            let id = ids[at] as i64;
            return Err(usage(format!("`{what}`[{at}] = {id}: row ids are >= 0")));
        }
    }
    Ok(ids)
}
