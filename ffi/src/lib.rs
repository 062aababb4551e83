//! phub-ffi: the only crate with raw DPDK symbols, and the one safe layer
//! over them.
//!
//! Layer: `sys` (private) is bindgen's output over the installed DPDK's
//! headers, restricted by named allowlists, plus `shim.c` for the static
//! inline fast-path functions. Everything public here is safe:
//!
//! - [`eal`]: EAL initialisation, once per process, with the arguments
//!   passed through; lcore and port enumeration; ports made of rings.
//! - [`mempool`]: packet mbuf pools (freed only once no mbuf is out).
//! - [`mbuf`]: [`Mbuf`], `#[repr(transparent)]` over `NonNull<rte_mbuf>`, so
//!   `&mut [Option<Mbuf>]` is what rx/tx burst take; Drop frees.
//! - [`port`]: the port builder (queues, descriptors clamped, MTU up to
//!   jumbo, the offloads the device has, NUMA socket), rx/tx queue handles
//!   handed out once and moved into their lcore, port stats, rte_flow.
//! - [`ring`]: rte_rings of mbufs (hand-off between lcores, test ports).
//! - [`malloc`]: zeroed, aligned slices from DPDK's heap on a NUMA socket
//!   (slot memory), and the heap's counters.
//! - [`lcore`]: launching closures on EAL worker lcores.
//!
//! Invariants: every DPDK resource has one owner whose Drop releases it in a
//! safe order (a port closes before its pools are freed; a pool is freed
//! only when none of its mbufs is out). Nothing here allocates on the
//! burst paths.
// Casts that may truncate or drop a sign are checked here rather than in
// Cargo.toml: `[lints] workspace = true` cannot be mixed with crate-level
// lint keys there. Each remaining `as` names its bound in a `// Cast:` note.
#![warn(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

// Generated code (bindgen's output over DPDK's headers): its lints, the casts
// included, are not ours to fix.
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_docs,
    unreachable_pub,
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    unsafe_op_in_unsafe_fn
)]
mod sys {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

pub mod eal;
mod error;
pub mod lcore;
pub mod malloc;
pub mod mbuf;
pub mod mempool;
pub mod port;
pub mod ring;

pub use eal::Eal;
pub use error::Error;
pub use malloc::{HeapSlice, HeapStats};
pub use mbuf::Mbuf;
pub use mempool::Mempool;
pub use port::{Port, PortBuilder, PortInfo, PortStats, RxQueue, TxQueue};
pub use ring::Ring;

/// The DPDK version this crate was built against (from pkg-config).
pub const DPDK_VERSION: &str = env!("PHUB_DPDK_VERSION");

/// Bytes DPDK reserves in front of packet data in every mbuf.
// Cast: the headroom fits a u16 (asserted below; rte_mbuf's data_off is one).
#[allow(clippy::cast_possible_truncation)]
pub const PKTMBUF_HEADROOM: u16 = sys::RTE_PKTMBUF_HEADROOM as u16;
const _: () = assert!(sys::RTE_PKTMBUF_HEADROOM <= u16::MAX as u32);

/// Result with this crate's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A name unique within this process, for DPDK objects that need one
/// (pools, rings: DPDK keeps a global namespace of them). At most 24 bytes.
pub(crate) fn unique_name(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tag: String = tag.chars().filter(char::is_ascii_alphanumeric).take(12).collect();
    format!("ph_{tag}_{n}")
}
