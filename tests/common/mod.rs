//! A whole appliance on loopback for integration tests: phub-dataplane and
//! phub-control as real processes on free ports, stopped when dropped.
#![allow(dead_code, unreachable_pub, unused_imports)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use phub::proto::api::{AdmitResponse, ApiError};
use phub_hwtests::process;

pub struct Rack {
    pub dataplane: Option<Child>,
    pub control: Option<Child>,
    pub mgmt_url: String,
    pub control_url: String,
    control_port: u16,
    dataplane_args: Vec<String>,
    pub dir: PathBuf,
}

/// A base port with `n` consecutive free UDP ports on 127.0.0.1.
pub fn free_udp_ports(n: u16) -> u16 {
    process::free_udp_ports(n).unwrap()
}

pub fn free_port() -> u16 {
    process::free_port().unwrap()
}

fn wait_http(url: &str, child: &mut Child, what: &str) {
    if let Err(e) = process::wait_http(url, child, Duration::from_secs(20), || false) {
        panic!("{what} at {url} {e}");
    }
}

fn term(child: &mut Child) {
    process::terminate(child, Duration::from_secs(5));
}

impl Rack {
    pub fn start(lcores: usize, budget: &str) -> Rack {
        Rack::start_with(lcores, budget, &[])
    }

    /// Like [`Rack::start`], with extra phub-dataplane arguments.
    pub fn start_with(lcores: usize, budget: &str, extra: &[&str]) -> Rack {
        let dir = std::env::temp_dir().join(format!("phub-test-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let mgmt = free_port();
        let base = free_udp_ports(lcores as u16);
        let mut dataplane_args = vec![
            "--base-port".to_string(),
            base.to_string(),
            "--lcores".into(),
            lcores.to_string(),
            "--no-pin".into(),
            "--mgmt".into(),
            format!("127.0.0.1:{mgmt}"),
            "--memory-budget".into(),
            budget.into(),
        ];
        dataplane_args.extend(extra.iter().map(|a| a.to_string()));
        let mut rack = Rack {
            dataplane: None,
            control: None,
            mgmt_url: format!("http://127.0.0.1:{mgmt}"),
            control_url: String::new(),
            control_port: free_port(),
            dataplane_args,
            dir,
        };
        rack.start_dataplane();
        rack.control_url = format!("http://127.0.0.1:{}", rack.control_port);
        rack.start_control();
        rack
    }

    /// Starts phub-dataplane (again), on the same ports.
    pub fn start_dataplane(&mut self) {
        let mut dp = Command::new(env!("CARGO_BIN_EXE_phub-dataplane"))
            .args(&self.dataplane_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_http(&format!("{}/v1/info", self.mgmt_url), &mut dp, "phub-dataplane");
        self.dataplane = Some(dp);
    }

    /// Kills phub-dataplane outright (SIGKILL), as a crash would.
    pub fn kill_dataplane(&mut self) {
        if let Some(mut d) = self.dataplane.take() {
            d.kill().unwrap();
            d.wait().unwrap();
        }
    }

    pub fn start_control(&mut self) {
        let mut c = Command::new(env!("CARGO_BIN_EXE_phub-control"))
            .args(["--listen", &format!("127.0.0.1:{}", self.control_port)])
            .args(["--dataplane", &self.mgmt_url, "--reconcile-ms", "200"])
            .arg("--state")
            .arg(self.dir.join("state.json"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_http(&format!("{}/v1/jobs", self.control_url), &mut c, "phub-control");
        self.control = Some(c);
    }

    /// Kills phub-control outright (SIGKILL), as a crash would.
    pub fn kill_control(&mut self) {
        if let Some(mut c) = self.control.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// The operator token phub-control generated beside its state file.
    pub fn operator_token(&self) -> String {
        std::fs::read_to_string(self.dir.join("state.json.operator-token"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn bearer(&self) -> String {
        format!("Bearer {}", self.operator_token())
    }

    pub fn admit(&self, spec: &str) -> Result<AdmitResponse, (u16, String)> {
        let req = ureq::post(&format!("{}/v1/jobs", self.control_url)).set("Authorization", &self.bearer());
        match req.send_string(spec) {
            Ok(r) => Ok(r.into_json().unwrap()),
            Err(ureq::Error::Status(code, r)) => Err((code, ApiError::message_of(&r.into_string().unwrap()))),
            Err(e) => panic!("admission: {e}"),
        }
    }

    pub fn post<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        ureq::post(&format!("{}{path}", self.control_url))
            .set("Authorization", &self.bearer())
            .call()
            .unwrap()
            .into_json()
            .unwrap()
    }

    pub fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        ureq::get(&format!("{}{path}", self.control_url))
            .call()
            .unwrap()
            .into_json()
            .unwrap()
    }

    pub fn phubctl(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_phubctl"))
            .env("PHUB_OPERATOR_TOKEN", self.operator_token())
            .args(["--control", &self.control_url])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Drop for Rack {
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

// The workload every suite shares (small-integer gradients whose sums are
// exact in any order, rank 0's initial values, the expected sums) lives in
// phub-hwtests, which runs the same scenarios on a rack.
pub use phub_hwtests::workload::{expected as expected_sum, flood, grad, init, train};
