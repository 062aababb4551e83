//! A kernel-UDP phub-dataplane beside a DPDK virtual rack's appliance:
//! on the workers' end of the rack's veth, in its namespace, so that the
//! two appliances of a job (hierarchical, replicated) reach each other
//! across the veth, the DPDK one at the Ethernet address `--neighbor`
//! gives it for the workers' end ([`WORKER_MAC`]).

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use phub_hwtests::dataplane_args::DataplaneArgs;
use phub_hwtests::process::dataplane_ready;
use phub_hwtests::virt::{VirtualRack, WORKER_IF, WORKER_IP};

/// The workers' end of the veth gets this address, which the DPDK
/// appliance is told for the other appliance there.
pub(crate) const WORKER_MAC: &str = "02:77:00:00:00:02";

/// The DPDK appliance's arguments for it: where the other appliance is.
pub(crate) fn neighbor_arg() -> String {
    format!("--neighbor {WORKER_IP}={WORKER_MAC}")
}

/// The kernel-UDP dataplane (one lcore, data port 7950), killed and its
/// token file removed when dropped.
pub(crate) struct UdpBeside {
    child: Option<Child>,
    /// Its management API, inside the rack's namespace.
    pub(crate) mgmt: String,
    token: PathBuf,
}

impl UdpBeside {
    /// Its management token's file for a test tagged `tag` (not the
    /// default, /run/phub/dataplane-<port>.token, which would outlive a
    /// SIGKILL), for control's `--appliance ...,token-file=` before the
    /// rack starts.
    pub(crate) fn token_file(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("phub-{tag}-{}.token", std::process::id()))
    }

    /// control's `--appliance` for it, named `name` in rack `rack`, its
    /// management API at `mgmt`.
    pub(crate) fn appliance_arg(name: &str, rack: &str, mgmt: &str, tag: &str) -> String {
        format!(
            "--appliance name={name},url=http://{mgmt},rack={rack},token-file={}",
            UdpBeside::token_file(tag).display()
        )
    }

    /// Starts it in `rack`'s namespace, the workers' end of the veth given
    /// [`WORKER_MAC`].
    pub(crate) fn start(rack: &VirtualRack, mgmt: &str, tag: &str) -> UdpBeside {
        rack.ns
            .ip(&["link", "set", WORKER_IF, "address", WORKER_MAC])
            .unwrap();
        let token = UdpBeside::token_file(tag);
        let bin = phub_hwtests::bin("phub-dataplane").unwrap();
        let child = rack
            .ns
            .command(&bin)
            .args(
                DataplaneArgs {
                    host: Some(WORKER_IP.into()),
                    base_port: Some(7950),
                    lcores: Some(1),
                    no_pin: true,
                    mgmt: Some(mgmt.into()),
                    memory_budget: Some("256MiB".into()),
                    mgmt_token_file: Some(token.clone()),
                    ..DataplaneArgs::default()
                }
                .to_args(),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        UdpBeside {
            child: Some(child),
            mgmt: mgmt.to_string(),
            token,
        }
    }

    /// Waits up to 20 s for its management API; called inside the
    /// namespace.
    pub(crate) fn wait_up(&self) {
        let t = Instant::now();
        while ureq::get(&dataplane_ready(&format!("http://{}", self.mgmt)))
            .call()
            .is_err()
        {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the kernel-UDP appliance did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills it (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for UdpBeside {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.token);
    }
}
