//! phub-hwtests: the regression suite for a lab rack, and the virtual rack
//! it also runs on.
//!
//! A rack file (TOML, [`rack::RackFile`]) names the appliance's NIC (PCI
//! address), its cores and the worker hosts; `PHUB_RACK=rack.toml cargo
//! test -p phub-hwtests` runs the suite there. `PHUB_RACK=virtual` builds
//! the same topology on this machine ([`virt::VirtualRack`]: a network
//! namespace, a veth pair, phub-dataplane on DPDK's af_packet driver,
//! phub-control, workers over kernel UDP) and runs the suite on it. Without
//! PHUB_RACK every test prints that it needs a rack file and skips. On
//! either rack the suite ([`running::Rack`]) starts the worker side as
//! `phub-rack-agent` processes ([`agent`]) through one [`launch::Launcher`]:
//! ssh to the rack file's worker hosts, or `ip netns exec` into the virtual
//! rack's namespace; on a lab rack it starts the appliance here
//! ([`lab::LabRack`]).
//! [`dataplane_args`] is phub-dataplane's command line as a typed value,
//! for every harness that starts one.
//! [`scenarios`] holds the fault scenarios the workspace's tests run on both
//! backends (kernel UDP on loopback, DPDK on the virtual rack).
//!
//! Layer: test support only (spawns the real binaries, which must be built:
//! `cargo build --bins`, as `cargo test --workspace` does).

use std::path::PathBuf;

pub mod agent;
pub mod dataplane_args;
pub mod lab;
pub mod launch;
pub mod process;
pub mod rack;
pub mod running;
pub mod scenarios;
pub mod virt;
pub mod workload;

/// Where a phub binary is: `$PHUB_BIN_DIR/NAME`, else next to the running
/// test's directory (`target/<profile>/NAME`, where cargo puts binaries).
pub fn bin(name: &str) -> Result<PathBuf, String> {
    let dirs: Vec<PathBuf> = std::env::var_os("PHUB_BIN_DIR")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().and_then(|d| d.parent()).map(PathBuf::from)),
        )
        .collect();
    dirs.iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{name} is not built (looked in {dirs:?}): run `cargo build --bins` first, or set PHUB_BIN_DIR"))
}
