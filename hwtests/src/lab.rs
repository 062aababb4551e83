//! A lab rack's appliance, started on this host (the suite runs on the
//! appliance host, as root): phub-dataplane on DPDK over the rack file's
//! NIC, its lcores pinned to the rack file's cores and spinning (no idle
//! backoff), its management API on loopback; phub-control beside it,
//! listening where the worker hosts reach it. Both stop when the rack is
//! dropped. Untested against real hardware: CI runs the virtual rack.
//!
//! Layer: test support only.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use phub_proto::api::{DataplaneInfo, DataplaneStats};
use phub_proto::routes::mgmt;

use crate::dataplane_args::{Backend, DataplaneArgs};
use crate::launch::Launcher;
use crate::process::{control_ready, dataplane_ready};
use crate::rack::RackFile;
use crate::scenarios::Appliance;
use crate::virt::{term, wait_http};

/// The dataplane's management API on the appliance host.
pub const LAB_MGMT: &str = "127.0.0.1:7800";

/// A lab rack's running appliance.
#[derive(Debug)]
pub struct LabRack {
    // Field order is drop order: control stops before the dataplane.
    /// phub-control.
    pub control: Option<Child>,
    /// phub-dataplane.
    pub dataplane: Option<Child>,
    /// Scratch directory (state file, logs).
    pub dir: PathBuf,
    /// phub-dataplane's stderr.
    pub log: PathBuf,
    /// The rack file.
    pub rack: RackFile,
}

/// phub-dataplane's command line for `rack`: DPDK on its NIC, one data
/// lcore per core (the EAL lcore map pins them), the data address its rack
/// IP, spinning lcores.
pub fn dataplane_args(rack: &RackFile) -> Vec<String> {
    let a = &rack.appliance;
    DataplaneArgs {
        backend: Some(Backend::Dpdk),
        eal: Some(rack.eal_args().trim().to_string()),
        host: Some(a.ip.clone()),
        base_port: Some(a.base_port),
        lcores: Some(a.cores.len()),
        mtu: Some(a.mtu),
        mgmt: Some(LAB_MGMT.into()),
        ..DataplaneArgs::default()
    }
    .to_args()
}

/// phub-control's command line for `rack`, its state in `state`.
pub fn control_args(rack: &RackFile, state: &Path) -> Vec<String> {
    vec![
        "--listen".into(),
        rack.control_addr(),
        "--dataplane".into(),
        format!("http://{LAB_MGMT}"),
        "--reconcile-ms".into(),
        "200".into(),
        "--state".into(),
        state.to_string_lossy().into_owned(),
    ]
}

/// The appliance host needs no namespace: a scenario's threads stay put.
fn stay() {}

/// Starts `bin` with `args`, its stderr to `log`, and waits for `url` to
/// answer; on failure stops it and says why, with its log.
fn start_and_wait(bin: &str, args: &[String], log: &Path, url: &str) -> Result<Child, String> {
    let path = crate::bin(bin)?;
    let logf = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut child = Command::new(&path)
        .args(args)
        .stdout(Stdio::null())
        .stderr(logf)
        .spawn()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let up = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wait_http(url, &mut child, bin)));
    if up.is_err() {
        term(&mut child);
        return Err(format!(
            "{bin} did not come up at {url}; its log ({}):\n{}",
            log.display(),
            std::fs::read_to_string(log).unwrap_or_default()
        ));
    }
    Ok(child)
}

impl LabRack {
    /// Starts the appliance of `rack` on this host. `Err` says what is
    /// missing (root, the binaries) or what did not come up, with the log.
    pub fn start(tag: &str, rack: RackFile) -> Result<LabRack, String> {
        // SAFETY: plain getter.
        if unsafe { libc::geteuid() } != 0 {
            return Err("a lab rack's appliance needs root (DPDK on a vfio-pci NIC, hugepages)".into());
        }
        let dir = std::env::temp_dir().join(format!("phub-lab-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut lab = LabRack {
            control: None,
            dataplane: None,
            log: dir.join("dataplane.log"),
            dir,
            rack,
        };
        lab.dataplane = Some(start_and_wait(
            "phub-dataplane",
            &dataplane_args(&lab.rack),
            &lab.log,
            &dataplane_ready(&lab.mgmt_url()),
        )?);
        lab.control = Some(start_and_wait(
            "phub-control",
            &control_args(&lab.rack, &lab.dir.join("state.json")),
            &lab.dir.join("control.log"),
            &control_ready(&lab.control_url()),
        )?);
        Ok(lab)
    }

    /// phub-control's URL, from this host and from the worker hosts.
    pub fn control_url(&self) -> String {
        format!("http://{}", self.rack.control_addr())
    }

    /// The dataplane's management URL (on this host).
    pub fn mgmt_url(&self) -> String {
        format!("http://{LAB_MGMT}")
    }

    /// The operator token phub-control keeps beside its state file.
    pub fn operator_token(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("state.json.operator-token"))
            .ok()
            .map(|t| t.trim().to_string())
    }

    /// The appliance as the scenarios see it (reached from anywhere on
    /// this host).
    pub fn appliance(&self) -> Appliance<'static> {
        Appliance {
            control_url: self.control_url(),
            mgmt_url: self.mgmt_url(),
            operator_token: self.operator_token(),
            enter: &stay,
        }
    }

    /// The dataplane's counters.
    pub fn stats(&self) -> DataplaneStats {
        self.appliance().dataplane_stats()
    }

    /// What the dataplane says about itself.
    pub fn info(&self) -> DataplaneInfo {
        self.appliance().dataplane(&mgmt::info())
    }

    /// phubctl against control; returns (success, stdout, stderr).
    pub fn phubctl(&self, args: &[&str]) -> (bool, String, String) {
        self.appliance().phubctl(args)
    }

    /// The worker hosts' launcher.
    pub fn launcher(&self) -> Launcher {
        Launcher::lab(&self.rack)
    }
}

impl Drop for LabRack {
    fn drop(&mut self) {
        if let Some(c) = self.control.as_mut() {
            term(c);
        }
        if let Some(d) = self.dataplane.as_mut() {
            term(d);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lab_appliance_command_lines() {
        let rack = RackFile::parse(include_str!("../rack.example.toml")).unwrap();
        let dp = dataplane_args(&rack);
        assert_eq!(
            dp,
            [
                "--backend",
                "dpdk",
                "--host",
                "192.168.50.1",
                "--base-port",
                "7900",
                "--lcores",
                "4",
                "--mgmt",
                "127.0.0.1:7800",
                "--eal",
                "-a 0000:3b:00.0 --lcores 0@1,1@2,2@3,3@4,4@5 --in-memory",
                "--mtu",
                "9000"
            ]
        );
        // Spinning lcores, pinned by the EAL map: no backoff, no --no-pin.
        assert!(!dp.iter().any(|a| a == "--idle-backoff" || a == "--no-pin"));
        let ctl = control_args(&rack, Path::new("/tmp/s.json"));
        assert_eq!(ctl[..2], ["--listen", "10.0.0.1:7700"]);
        assert_eq!(ctl.last().unwrap(), "/tmp/s.json");
    }
}
