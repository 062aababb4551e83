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
