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

    /// The array as `f32` in place, if it is a non-empty, aligned `float32`
    /// array.
    pub(crate) fn f32_ptr(&self) -> Option<NonNull<f32>> {
        let p = self.ptr().cast::<f32>();
        (self.elem == Elem::F32 && self.len > 0 && p.is_aligned())
            .then_some(())
            .and_then(|()| NonNull::new(p))
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
