//! Element types carried on the wire. Accumulation is always in `f32`.

use serde::{Deserialize, Serialize};

/// The element type of a job's payloads on the wire (little-endian).
///
/// Whatever the wire type, the appliance accumulates and keeps parameters and
/// optimizer state in `f32`; results are converted back to the wire type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE 754 binary32.
    F32,
    /// bfloat16: the upper 16 bits of an `f32`.
    Bf16,
    /// IEEE 754 binary16.
    F16,
}

impl Dtype {
    /// All element types, in wire-code order.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    /// Bytes per element on the wire.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// The code carried in the header's `dtype` byte.
    pub const fn code(self) -> u8 {
        match self {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            Dtype::F16 => 2,
        }
    }

    /// The element type for a header's `dtype` byte, if it names one.
    pub const fn from_code(code: u8) -> Option<Dtype> {
        match code {
            0 => Some(Dtype::F32),
            1 => Some(Dtype::Bf16),
            2 => Some(Dtype::F16),
            _ => None,
        }
    }

    /// The name used in job specs and reports.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
