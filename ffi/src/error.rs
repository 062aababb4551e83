//! The crate's error type.

use std::ffi::CStr;

use crate::sys;

/// What went wrong in a DPDK call or in setting one up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `rte_eal_init` refused the arguments (or failed for another reason).
    #[error("EAL initialisation with {args:?} failed: {reason}")]
    EalInit {
        /// The arguments passed through.
        args: Vec<String>,
        /// DPDK's reason.
        reason: String,
    },
    /// A DPDK object was used before the EAL was initialised, or after it
    /// was cleaned up.
    #[error("the DPDK EAL is not initialised")]
    NoEal,
    /// A DPDK call failed.
    #[error("{what}: {reason} (rte error {code})")]
    Call {
        /// The call and its object, e.g. `rte_eth_dev_configure(port 0)`.
        what: String,
        /// DPDK's (positive) error number.
        code: i32,
        /// DPDK's text for it.
        reason: String,
    },
    /// DPDK's heap has no room for an allocation.
    #[error("the DPDK heap on {} has no room for {bytes} bytes{}", socket_name(*.socket), heap_state(*.free, *.largest_free))]
    NoMemory {
        /// Bytes asked for.
        bytes: usize,
        /// NUMA socket asked for (`None`: any).
        socket: Option<u32>,
        /// Free bytes on that socket's heap, when known.
        free: Option<u64>,
        /// The largest free block on that socket's heap, when known.
        largest_free: Option<u64>,
    },
    /// A request the device or the EAL cannot satisfy, with what would be
    /// accepted.
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    /// An error for `what` from a DPDK return code (negative errno) or,
    /// when `code` is not negative, from `rte_errno`.
    pub(crate) fn call(what: impl Into<String>, code: i32) -> Error {
        let code = if code < 0 {
            -code
        } else {
            // SAFETY: reads the calling thread's rte_errno; always valid.
            unsafe { sys::phub_errno() }
        };
        Error::Call {
            what: what.into(),
            code,
            reason: strerror(code),
        }
    }
}

fn socket_name(s: Option<u32>) -> String {
    s.map_or_else(|| "any socket".into(), |s| format!("socket {s}"))
}

fn heap_state(free: Option<u64>, largest: Option<u64>) -> String {
    match (free, largest) {
        (Some(f), Some(l)) => format!(" ({f} bytes free, the largest free block {l} bytes)"),
        (Some(f), None) => format!(" ({f} bytes free)"),
        _ => String::new(),
    }
}

/// DPDK's text for an error number (covers both libc and rte errors).
pub(crate) fn strerror(code: i32) -> String {
    // SAFETY: rte_strerror returns a pointer to a NUL-terminated string that
    // stays valid at least until the next call on this thread; it is copied
    // at once.
    unsafe {
        let p = sys::rte_strerror(code);
        if p.is_null() {
            format!("error {code}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}
