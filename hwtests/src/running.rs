//! A started rack of either kind, as the suite sees it: where the appliance
//! is, its counters, and the launcher that starts `phub-rack-agent` on the
//! worker hosts. The suite's tests are written once against [`Rack`].
//!
//! Layer: test support only.

use std::time::{Duration, Instant};

use phub_proto::api::{DataplaneInfo, DataplaneStats};

use crate::agent::{Amount, BlastReport, TrainReport};
use crate::lab::LabRack;
use crate::launch::{run_all, Launcher};
use crate::rack::{self, Target};
use crate::virt::{self, VirtualRack};
use crate::workload::{admit, sum_spec};

/// A started rack.
#[derive(Debug)]
pub enum Rack {
    /// Namespaces and veth pairs on this machine.
    Virtual(VirtualRack),
    /// A lab rack's appliance, started on this host.
    Lab(LabRack),
}

impl Rack {
    /// The rack `PHUB_RACK` names, started for `test` (a virtual one with
    /// `lcores` queues; a lab rack uses one per core of its rack file), or
    /// `None` after printing why the test is skipped: no PHUB_RACK, or a
    /// virtual rack that cannot run here (no root). A wrong rack file or a
    /// lab rack that does not come up is a failure.
    pub fn for_test(test: &str, lcores: usize) -> Option<Rack> {
        match rack::target() {
            None => {
                println!(
                    "SKIPPED {test}: needs a rack file: PHUB_RACK=rack.toml (format in hwtests/rack.example.toml) or PHUB_RACK=virtual"
                );
                None
            }
            Some(Err(e)) => panic!("{e}"),
            Some(Ok(Target::Lab(r))) => {
                Some(Rack::Lab(LabRack::start(test, *r).unwrap_or_else(|e| {
                    panic!("{test}: starting the lab rack's appliance: {e}")
                })))
            }
            Some(Ok(Target::Virtual)) => match VirtualRack::start(test, lcores, "", "") {
                Ok(r) => Some(Rack::Virtual(r)),
                Err(why) => {
                    println!("SKIPPED {test}: the virtual rack cannot run here: {why}");
                    None
                }
            },
        }
    }

    /// Whether this is a lab rack.
    pub fn is_lab(&self) -> bool {
        matches!(self, Rack::Lab(_))
    }

    /// The appliance's data address (what workers send to).
    pub fn data_ip(&self) -> String {
        match self {
            Rack::Virtual(_) => virt::APPLIANCE_IP.to_string(),
            Rack::Lab(l) => l.rack.appliance.ip.clone(),
        }
    }

    /// UDP port of lcore 0.
    pub fn base_port(&self) -> u16 {
        match self {
            Rack::Virtual(_) => virt::BASE_PORT,
            Rack::Lab(l) => l.rack.appliance.base_port,
        }
    }

    /// Data lcores (queues).
    pub fn lcores(&self) -> usize {
        match self {
            Rack::Virtual(v) => v.lcores,
            Rack::Lab(l) => l.rack.appliance.cores.len(),
        }
    }

    /// The rack network's MTU.
    pub fn mtu(&self) -> u16 {
        match self {
            Rack::Virtual(_) => 9000,
            Rack::Lab(l) => l.rack.appliance.mtu,
        }
    }

    /// The NIC's link speed in Gb/s, where the rack file gives it.
    pub fn link_gbps(&self) -> Option<u32> {
        match self {
            Rack::Virtual(_) => None,
            Rack::Lab(l) => l.rack.appliance.link_gbps,
        }
    }

    /// phub-control's URL, the same from the test (inside
    /// [`Rack::inside`]) and from the agents.
    pub fn control_url(&self) -> String {
        match self {
            Rack::Virtual(v) => v.control_url(),
            Rack::Lab(l) => l.control_url(),
        }
    }

    /// The operator token, where control has one.
    pub fn operator_token(&self) -> Option<String> {
        match self {
            Rack::Virtual(v) => v.operator_token(),
            Rack::Lab(l) => l.operator_token(),
        }
    }

    /// Runs `f` where control and the management API can be reached (the
    /// virtual rack's namespace; anywhere on a lab rack's appliance host).
    pub fn inside<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        match self {
            Rack::Virtual(v) => v.inside(f),
            Rack::Lab(_) => f(),
        }
    }

    /// The dataplane's counters.
    pub fn stats(&self) -> DataplaneStats {
        match self {
            Rack::Virtual(v) => v.stats(),
            Rack::Lab(l) => l.stats(),
        }
    }

    /// What the dataplane says about itself.
    pub fn info(&self) -> DataplaneInfo {
        match self {
            Rack::Virtual(v) => v.info(),
            Rack::Lab(l) => l.info(),
        }
    }

    /// phubctl against control; returns (success, stdout, stderr).
    pub fn phubctl(&self, args: &[&str]) -> (bool, String, String) {
        match self {
            Rack::Virtual(v) => v.phubctl(args),
            Rack::Lab(l) => l.phubctl(args),
        }
    }

    /// The launcher of agents on the worker hosts.
    pub fn launcher(&self) -> Launcher {
        match self {
            Rack::Virtual(v) => {
                let agent = crate::bin("phub-rack-agent").unwrap_or_else(|e| panic!("{e}"));
                Launcher::netns(&v.ns.name, &agent)
            }
            Rack::Lab(l) => l.launcher(),
        }
    }

    /// Every worker host blasts PUSHes of `payload` bytes with job ids
    /// `job + q` at lcore q's port, all at once; returns their reports.
    pub fn blast(&self, payload: usize, job: u16, amount: Amount, pause_us: u64) -> Vec<BlastReport> {
        let l = self.launcher();
        let mut args = vec![
            "blast".to_string(),
            "--to".into(),
            self.data_ip(),
            "--base-port".into(),
            self.base_port().to_string(),
            "--queues".into(),
            self.lcores().to_string(),
            "--payload".into(),
            payload.to_string(),
            "--job".into(),
            job.to_string(),
            "--pause-us".into(),
            pause_us.to_string(),
        ];
        match amount {
            Amount::Secs(s) => args.extend(["--secs".into(), s.to_string()]),
            Amount::PerPort(n) => args.extend(["--count".into(), n.to_string()]),
        }
        let runs: Vec<(usize, Vec<String>)> = (0..l.hosts()).map(|h| (h, args.clone())).collect();
        run_all(&l, &runs)
    }

    /// Admits a sum job of `workers` ranks over `keys` and trains it
    /// `rounds` rounds, one agent per rank (rank r on worker host r mod
    /// hosts), each checking every element of every result; returns their
    /// reports, checked to have done every round.
    pub fn train(
        &self,
        name: &str,
        workers: u16,
        chunk_bytes: Option<u32>,
        keys: &[u64],
        rounds: u32,
    ) -> Vec<TrainReport> {
        let url = self.control_url();
        let token = self.operator_token();
        let spec = sum_spec(name, workers, chunk_bytes, keys);
        let job = self.inside(|| admit(&url, token.as_deref(), &spec));
        let keys = keys.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let runs: Vec<(usize, Vec<String>)> = (0..workers)
            .map(|rank| {
                let args = [
                    "train",
                    "--control",
                    &url,
                    "--job",
                    &job.id.to_string(),
                    "--token",
                    &format!("{:016x}", job.token),
                    "--rank",
                    &rank.to_string(),
                    "--workers",
                    &workers.to_string(),
                    "--keys",
                    &keys,
                    "--rounds",
                    &rounds.to_string(),
                ];
                (usize::from(rank), args.into_iter().map(String::from).collect())
            })
            .collect();
        let reports: Vec<TrainReport> = run_all(&self.launcher(), &runs);
        for r in &reports {
            assert_eq!(r.rounds, rounds, "rank {} stopped early", r.rank);
        }
        reports
    }

    /// The dataplane's counters once they stop moving: read until two reads
    /// 200 ms apart agree on what the port received and the lcores counted
    /// (packets still queued in the NIC or the af_packet ring are drained
    /// by then), or 20 s pass. Returns them and whether they settled.
    pub fn settled_stats(&self) -> (DataplaneStats, bool) {
        let seen = |s: &DataplaneStats| {
            (
                s.port.map(|p| p.ipackets),
                s.lcores.iter().map(|l| l.rx_packets).sum::<u64>(),
            )
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = self.stats();
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let now = self.stats();
            if seen(&now) == seen(&last) {
                return (now, true);
            }
            if Instant::now() > deadline {
                return (now, false);
            }
            last = now;
        }
    }
}
