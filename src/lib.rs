//! phub: a rack-scale parameter server appliance.
//!
//! This umbrella crate re-exports the layers (the wire protocol and job specs
//! in [`proto`], the sans-IO aggregation engine in [`engine`], the appliance's
//! data path around it in [`dataplane`]) and carries the
//! build stamp. The workspace-level integration tests live beside it in
//! `tests/`.

pub use phub_dataplane as dataplane;
pub use phub_engine as engine;
pub use phub_proto as proto;

/// phub's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit the build came from ("unknown" outside a checkout).
pub const GIT_COMMIT: &str = env!("PHUB_GIT_COMMIT");
/// Target features the compiler could assume (comma-separated).
pub const TARGET_FEATURES: &str = env!("PHUB_TARGET_FEATURES");

/// One line naming this build: version, commit and compile-time features.
pub fn build_info() -> String {
    format!("phub {VERSION} (commit {GIT_COMMIT})")
}
