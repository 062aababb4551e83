//! `GET /metrics`: Prometheus text exposition format 0.0.4, rendered from
//! the dataplane's counters and control's jobs. Pure.
//!
//! Names follow Prometheus' conventions: base units only (`_bytes`,
//! `_seconds`), spelled last before `_total`; counters end in `_total`,
//! gauges do not. A lcore counter whose JSON name ends in a unit of time
//! (`held_wait_us`) is exported in seconds under the stem's name
//! (`phub_lcore_held_wait_seconds_total`); the JSON API (`/v1/stats`)
//! keeps its name and unit. A unit test checks every family rendered.

use std::fmt::{Display, Write};

use phub_proto::api::{DataplaneStats, JobSummary, LcoreStats, PortStats, TableLive};
use phub_proto::counters::CounterDef;

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Escapes a label value: backslash, double quote and newline.
pub fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape_label(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }
}

/// One appliance's heartbeats, as `/metrics` exports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness<'a> {
    /// The appliance.
    pub name: &'a str,
    /// Whether control declares it down now (PROTOCOL.md §11.6).
    pub declared_down: bool,
    /// Times control declared it down since it started.
    pub declarations: u64,
}

/// A replicated job's strength, as `/metrics` exports it (PROTOCOL.md
/// §11.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strength {
    /// The job's id.
    pub job: u16,
    /// Replicas live (the fewest over its parts).
    pub live: u32,
    /// Replicas wanted (`[placement] replicas`).
    pub wanted: u32,
    /// Whether a re-replication is under way.
    pub rereplicating: bool,
    /// Whether it is stalled: every replica of some part down.
    pub stalled: bool,
    /// The last re-replication's time to full strength, ms, once done.
    pub full_strength_ms: Option<u64>,
}

/// Per replicated job: `phub_job_replicas_live`,
/// `phub_job_replicas_wanted`, `phub_job_rereplicating`, `phub_job_stalled` (gauges) and,
/// once a re-replication is done, `phub_job_rereplication_seconds` (its
/// time to full strength).
pub fn render_strength(jobs: &[Strength]) -> String {
    let mut o = Out(String::new());
    if jobs.is_empty() {
        return o.0;
    }
    let ids: Vec<String> = jobs.iter().map(|j| j.job.to_string()).collect();
    o.family(
        "phub_job_replicas_live",
        "gauge",
        "Replicas of a replicated job holding state, the fewest over its parts",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample("phub_job_replicas_live", &[("job", id)], j.live);
    }
    o.family(
        "phub_job_replicas_wanted",
        "gauge",
        "Replicas a replicated job's spec asks for",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample("phub_job_replicas_wanted", &[("job", id)], j.wanted);
    }
    o.family(
        "phub_job_rereplicating",
        "gauge",
        "Whether an appliance that came back is being given the job's state (1) or not (0)",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample(
            "phub_job_rereplicating",
            &[("job", id)],
            u64::from(j.rereplicating),
        );
    }
    o.family(
        "phub_job_stalled",
        "gauge",
        "Whether every replica of some part of the job is down (1): it waits for its appliances, then goes back \
         to its checkpoints",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample("phub_job_stalled", &[("job", id)], u64::from(j.stalled));
    }
    o.family(
        "phub_job_rereplication_seconds",
        "gauge",
        "The job's last re-replication: from the appliance answering again to full strength",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        if let Some(ms) = j.full_strength_ms {
            o.sample(
                "phub_job_rereplication_seconds",
                &[("job", id)],
                format!("{:.3}", ms as f64 / 1000.0),
            );
        }
    }
    o.0
}

/// The heartbeat's families, labelled by appliance:
/// `phub_appliance_declared_down` (a gauge, 1 while declared down) and
/// `phub_appliance_down_declarations_total`.
pub fn render_liveness(appliances: &[Liveness<'_>]) -> String {
    let mut o = Out(String::new());
    o.family(
        "phub_appliance_declared_down",
        "gauge",
        "Whether phub-control declares the appliance down (1: no answer to a heartbeat for the deadline) or not (0)",
    );
    for a in appliances {
        o.sample(
            "phub_appliance_declared_down",
            &[("appliance", a.name)],
            u64::from(a.declared_down),
        );
    }
    o.family(
        "phub_appliance_down_declarations_total",
        "counter",
        "Times phub-control declared the appliance down since it started",
    );
    for a in appliances {
        o.sample(
            "phub_appliance_down_declarations_total",
            &[("appliance", a.name)],
            a.declarations,
        );
    }
    o.0
}

/// The JSON name suffixes of time units that Prometheus names spell in
/// seconds: the suffix and how many of the unit make a second.
const TIME_UNITS: &[(&str, f64)] = &[("_ns", 1e9), ("_us", 1e6), ("_ms", 1e3)];

/// How one lcore counter of [`LcoreStats::COUNTERS`] is exported.
#[derive(Debug, Clone, PartialEq)]
pub struct LcoreFamily {
    /// `phub_lcore_<name>_total` (a time in seconds: `<stem>_seconds`; a
    /// gauge: no `_total`).
    pub name: String,
    /// The table's help, with the unit when it is converted, per lcore.
    pub help: String,
    /// The Prometheus type.
    pub kind: &'static str,
    /// What a JSON value is divided by (a time unit's per second).
    per: Option<f64>,
}

impl LcoreFamily {
    /// The family of `def`.
    pub fn of(def: &CounterDef) -> Self {
        let total = if def.kind.sums() { "_total" } else { "" };
        let time = TIME_UNITS
            .iter()
            .find_map(|&(suffix, per)| Some((def.name.strip_suffix(suffix)?, per)));
        let (name, help, per) = match time {
            Some((stem, per)) => (
                format!("phub_lcore_{stem}_seconds{total}"),
                format!("{}, in seconds, per lcore", def.help),
                Some(per),
            ),
            None => (
                format!("phub_lcore_{}{total}", def.name),
                format!("{}, per lcore", def.help),
                None,
            ),
        };
        LcoreFamily {
            name,
            help,
            kind: def.kind.prometheus_type(),
            per,
        }
    }

    /// `v` (the JSON value) in the family's unit, as the text format writes it.
    pub fn value(&self, v: u64) -> String {
        match self.per {
            Some(per) => (v as f64 / per).to_string(),
            None => v.to_string(),
        }
    }
}

/// Renders every metric of one appliance's dataplane and the jobs
/// ([`render_all`] with one appliance: no `appliance` label).
pub fn render(dataplane: Option<&DataplaneStats>, jobs: &[JobSummary]) -> String {
    render_all(&[("", dataplane)], jobs)
}

/// `rest`, after an `appliance` label naming `name` when `labelled`.
fn labels<'a>(labelled: bool, name: &'a str, rest: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut l = Vec::with_capacity(rest.len() + 1);
    if labelled {
        l.push(("appliance", name));
    }
    l.extend_from_slice(rest);
    l
}

/// One port counter: the stem of `phub_port_<stem>_total`, its help, and
/// the field of [`PortStats`] it reads.
type PortCounter = (&'static str, &'static str, fn(&PortStats) -> u64);

/// The DPDK port's own counters (`rte_eth_stats`) as counter families.
const PORT: &[PortCounter] = &[
    ("rx_packets", "Packets the DPDK port received (ipackets)", |p| {
        p.ipackets
    }),
    ("tx_packets", "Packets the DPDK port sent (opackets)", |p| {
        p.opackets
    }),
    (
        "rx_bytes",
        "Bytes the DPDK port received, frames whole (ibytes)",
        |p| p.ibytes,
    ),
    (
        "tx_bytes",
        "Bytes the DPDK port sent, frames whole (obytes)",
        |p| p.obytes,
    ),
    (
        "rx_missed_packets",
        "Packets the NIC dropped because the RX queues were full (imissed)",
        |p| p.imissed,
    ),
    ("rx_errors", "Receive errors of the DPDK port (ierrors)", |p| {
        p.ierrors
    }),
    ("tx_errors", "Transmit errors of the DPDK port (oerrors)", |p| {
        p.oerrors
    }),
    (
        "rx_nombuf",
        "RX mbuf allocation failures of the DPDK port (rx_nombuf)",
        |p| p.rx_nombuf,
    ),
];

/// Renders every metric: `phub_dataplane_up`, one family per counter of
/// [`LcoreStats::COUNTERS`] ([`LcoreFamily`]: `phub_lcore_<name>_total{lcore}`,
/// its help text the table's), `phub_lcore_drops_total{lcore,reason}`,
/// `phub_jobs`, and per job `phub_job_workers`, `phub_job_workers_joined`,
/// `phub_job_installed`, `phub_job_held`, `phub_job_failed`,
/// `phub_job_memory_bytes` and, when a dataplane
/// knows the job, `phub_job_pushes_total` and `phub_job_rounds_completed_total`
/// (added up over the job's appliances), and per table of a job
/// `phub_table_rows`, `_bytes`, `_rows_created_total`,
/// `_rows_evicted_cap_total`, `_rows_evicted_idle_total`,
/// `_row_updates_total`, `_row_lookups_total` and
/// `_row_pushes_dropped_total` (labels `job`, `key`); with the DPDK backend, the port's
/// counters (`phub_port_<name>_total`, [`PORT`]). With more than one
/// appliance, `phub_dataplane_up`, the lcore and the port families carry an
/// `appliance` label.
pub fn render_all(appliances: &[(&str, Option<&DataplaneStats>)], jobs: &[JobSummary]) -> String {
    let mut o = Out(String::new());
    let labelled = appliances.len() > 1;
    o.family(
        "phub_dataplane_up",
        "gauge",
        "Whether phub-control could read the dataplane's counters (1) or not (0)",
    );
    for (name, dataplane) in appliances {
        o.sample(
            "phub_dataplane_up",
            &labels(labelled, name, &[]),
            u64::from(dataplane.is_some()),
        );
    }
    // Each lcore's appliance, label and counters in table order, read once.
    let rows: Vec<(&str, String, Vec<u64>)> = appliances
        .iter()
        .filter_map(|(name, d)| Some((*name, (*d)?)))
        .flat_map(|(name, dp)| {
            dp.lcores
                .iter()
                .map(move |l| (name, l.lcore.to_string(), l.counters().map(|(_, v)| v).collect()))
        })
        .collect();
    if !rows.is_empty() {
        for (i, def) in LcoreStats::COUNTERS.iter().enumerate() {
            let f = LcoreFamily::of(def);
            o.family(&f.name, f.kind, &f.help);
            for (appliance, lcore, values) in &rows {
                o.sample(
                    &f.name,
                    &labels(labelled, appliance, &[("lcore", lcore)]),
                    f.value(values[i]),
                );
            }
        }
        o.family(
            "phub_lcore_drops_total",
            "counter",
            "Packets dropped, per lcore and reason",
        );
        for (appliance, dp) in appliances.iter().filter_map(|(n, d)| Some((*n, (*d)?))) {
            for l in &dp.lcores {
                let lcore = l.lcore.to_string();
                for (reason, &n) in &l.drops {
                    o.sample(
                        "phub_lcore_drops_total",
                        &labels(labelled, appliance, &[("lcore", &lcore), ("reason", reason)]),
                        n,
                    );
                }
            }
        }
    }

    let ports: Vec<(&str, &PortStats)> = appliances
        .iter()
        .filter_map(|(name, d)| Some((*name, (*d)?.port.as_ref()?)))
        .collect();
    if !ports.is_empty() {
        for (stem, help, field) in PORT {
            let name = format!("phub_port_{stem}_total");
            o.family(&name, "counter", help);
            for (appliance, p) in &ports {
                o.sample(&name, &labels(labelled, appliance, &[]), field(p));
            }
        }
    }

    let spins: Vec<(&str, u64)> = appliances
        .iter()
        .filter_map(|(name, d)| Some((*name, (*d)?.spin_us?)))
        .collect();
    if !spins.is_empty() {
        o.family(
            "phub_dataplane_spin_seconds",
            "gauge",
            "How long the kernel-UDP lcores poll on after traffic before they sleep, now (--spin-us)",
        );
        for (appliance, us) in &spins {
            // Cast: microseconds, at most 10^6.
            #[allow(clippy::cast_precision_loss)]
            let secs = *us as f64 / 1e6;
            o.sample(
                "phub_dataplane_spin_seconds",
                &labels(labelled, appliance, &[]),
                secs,
            );
        }
    }

    o.family("phub_jobs", "gauge", "Jobs admitted by phub-control");
    o.sample("phub_jobs", &[], jobs.len() as u64);
    let ids: Vec<String> = jobs.iter().map(|j| j.id.to_string()).collect();
    o.family("phub_job_workers", "gauge", "Worker count W of the job");
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample(
            "phub_job_workers",
            &[("job", id), ("name", &j.name)],
            u64::from(j.workers),
        );
    }
    o.family(
        "phub_job_workers_joined",
        "gauge",
        "Ranks of the job that have joined through phub-control",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample(
            "phub_job_workers_joined",
            &[("job", id), ("name", &j.name)],
            j.joined.len() as u64,
        );
    }
    o.family(
        "phub_job_installed",
        "gauge",
        "Whether the dataplane has the job installed (1) or not (0)",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample("phub_job_installed", &[("job", id)], u64::from(j.installed));
    }
    o.family(
        "phub_job_held",
        "gauge",
        "Whether the job is held (1): a part's checkpoint file is there but unusable, so that part is not \
         installed until the operator repairs the file and runs phubctl job retry (the reason: phubctl job show)",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample("phub_job_held", &[("job", id)], u64::from(j.held.is_some()));
    }
    o.family(
        "phub_job_failed",
        "gauge",
        "Whether the job failed (1): it is never reinstalled; evict it and admit it again",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample("phub_job_failed", &[("job", id)], u64::from(j.failed.is_some()));
    }
    o.family(
        "phub_job_memory_bytes",
        "gauge",
        "Slot memory the job holds, in bytes",
    );
    for (j, id) in jobs.iter().zip(&ids) {
        o.sample("phub_job_memory_bytes", &[("job", id)], j.memory_bytes);
    }
    let up: Vec<&DataplaneStats> = appliances.iter().filter_map(|(_, d)| *d).collect();
    if !up.is_empty() {
        // Per job its pushes and rounds over every appliance that knows it.
        let live: Vec<(&String, (u64, u64))> = jobs
            .iter()
            .zip(&ids)
            .filter_map(|(j, id)| {
                let of: Vec<_> = up.iter().flat_map(|d| &d.jobs).filter(|l| l.id == j.id).collect();
                (!of.is_empty()).then(|| {
                    let pushes = of.iter().map(|l| l.pushes).sum();
                    (id, (pushes, of.iter().map(|l| l.rounds_completed).sum()))
                })
            })
            .collect();
        o.family(
            "phub_job_pushes_total",
            "counter",
            "Contributions aggregated for the job, over all lcores",
        );
        for (id, (pushes, _)) in &live {
            o.sample("phub_job_pushes_total", &[("job", id)], *pushes);
        }
        o.family(
            "phub_job_rounds_completed_total",
            "counter",
            "Rounds completed for the job, over all its chunks",
        );
        for (id, (_, rounds)) in &live {
            o.sample("phub_job_rounds_completed_total", &[("job", id)], *rounds);
        }
        // Per table (PROTOCOL.md §10) of each job, over every appliance.
        let tables: Vec<(&String, String, TableLive)> = jobs
            .iter()
            .zip(&ids)
            .flat_map(|(j, id)| {
                let mut merged: Vec<TableLive> = Vec::new();
                for l in up.iter().flat_map(|d| &d.jobs).filter(|l| l.id == j.id) {
                    TableLive::merge_all(&mut merged, &l.tables);
                }
                merged.into_iter().map(move |t| (id, t.key.to_string(), t))
            })
            .collect();
        if !tables.is_empty() {
            type Field = fn(&TableLive) -> u64;
            let families: [(&str, &str, &str, Field); 9] = [
                ("phub_table_rows", "gauge", "Rows a table stores now", |t| {
                    t.rows_stored
                }),
                (
                    "phub_table_bytes",
                    "gauge",
                    "Bytes a table's row stores hold now",
                    |t| t.bytes,
                ),
                (
                    "phub_table_rows_created_total",
                    "counter",
                    "Rows created (a first push, or the first after an eviction)",
                    |t| t.created,
                ),
                (
                    "phub_table_rows_evicted_cap_total",
                    "counter",
                    "Rows evicted to make room at the table's rows cap",
                    |t| t.evicted_cap,
                ),
                (
                    "phub_table_rows_evicted_idle_total",
                    "counter",
                    "Rows evicted after evict.idle_rounds rounds (or evict.idle_s seconds) untouched",
                    |t| t.evicted_idle,
                ),
                (
                    "phub_table_row_updates_total",
                    "counter",
                    "Row updates applied (pushes of a row)",
                    |t| t.updates,
                ),
                (
                    "phub_table_row_lookups_total",
                    "counter",
                    "Row lookups (ids read by pulls and push-pulls)",
                    |t| t.lookups,
                ),
                (
                    "phub_table_row_pushes_dropped_total",
                    "counter",
                    "Row pushes dropped: the id not admitted yet, or no memory for a new row",
                    |t| t.not_admitted + t.no_memory,
                ),
                (
                    "phub_table_blocks_made_on_lcore_total",
                    "counter",
                    "Row blocks an lcore made itself, none ready from the block maker (each faulted in on the lcore)",
                    |t| t.blocks_made_on_lcore,
                ),
            ];
            for (name, kind, help, field) in families {
                o.family(name, kind, help);
                for (id, key, t) in &tables {
                    o.sample(name, &[("job", id), ("key", key)], field(t));
                }
            }
        }
    }
    o.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use phub_proto::api::{JobLive, LcoreStats};

    /// Units Prometheus names must not carry: scaled or non-base units
    /// (a time is `_seconds`, a size `_bytes`, a ratio has none).
    const NOT_BASE_UNITS: &[&str] = &[
        "ns", "us", "usec", "micros", "ms", "msec", "millis", "minutes", "hours", "days", "kb", "mb", "gb",
        "kib", "mib", "gib", "bits", "kbps", "mbps", "gbps", "percent", "pct",
    ];

    /// /metrics with every family present: two appliances with lcores,
    /// every lcore counter non-zero, drops, a DPDK port, and a job live on both.
    fn everything() -> String {
        let lcore = |i: u16| {
            let mut m = serde_json::Map::new();
            m.insert("lcore".into(), i.into());
            m.insert("drops".into(), serde_json::json!({ "stale": 2 }));
            for d in LcoreStats::COUNTERS {
                m.insert(d.name.into(), 1_500_000u64.into());
            }
            serde_json::from_value::<LcoreStats>(m.into()).unwrap()
        };
        let dp = DataplaneStats {
            spin_us: Some(200),
            backend: phub_proto::api::BackendKind::Dpdk,
            port: Some(PortStats {
                imissed: 3,
                ..Default::default()
            }),
            lcores: vec![lcore(0), lcore(1)],
            jobs: vec![JobLive {
                id: 1,
                pushes: 1,
                rounds_completed: 1,
                round_range: None,
                silent_ms: vec![],
                clock: Default::default(),
                copies: None,
                tables: vec![TableLive {
                    key: 0,
                    rows_stored: 5,
                    created: 7,
                    evicted_cap: 2,
                    evicted_idle: 1,
                    updates: 9,
                    lookups: 4,
                    not_admitted: 1,
                    no_memory: 1,
                    bytes: 4096,
                    blocks_made_on_lcore: 3,
                }],
            }],
        };
        let job = JobSummary {
            id: 1,
            name: "j".into(),
            workers: 1,
            joined: vec![0],
            keys: 1,
            chunks: 1,
            dtype: "f32".into(),
            optimizer: "sum".into(),
            memory_bytes: 1,
            appliances: vec!["a".into(), "b".into()],
            installed: true,
            failed: None,
            held: None,
        };
        let liveness = [Liveness {
            name: "a",
            declared_down: true,
            declarations: 2,
        }];
        let strength = [Strength {
            job: 1,
            live: 2,
            wanted: 2,
            rereplicating: false,
            stalled: true,
            full_strength_ms: Some(1250),
        }];
        let text = render_all(&[("a", Some(&dp)), ("b", Some(&dp))], &[job])
            + &render_liveness(&liveness)
            + &render_strength(&strength);
        assert!(
            text.contains("phub_job_rereplication_seconds{job=\"1\"} 1.250\n")
                && text.contains("phub_job_stalled{job=\"1\"} 1\n"),
            "{text}"
        );
        // The table's counters added up over both appliances.
        for line in [
            "phub_table_rows{job=\"1\",key=\"0\"} 10\n",
            "phub_table_bytes{job=\"1\",key=\"0\"} 8192\n",
            "phub_table_rows_created_total{job=\"1\",key=\"0\"} 14\n",
            "phub_table_rows_evicted_cap_total{job=\"1\",key=\"0\"} 4\n",
            "phub_table_rows_evicted_idle_total{job=\"1\",key=\"0\"} 2\n",
            "phub_table_row_updates_total{job=\"1\",key=\"0\"} 18\n",
            "phub_table_row_lookups_total{job=\"1\",key=\"0\"} 8\n",
            "phub_table_row_pushes_dropped_total{job=\"1\",key=\"0\"} 4\n",
            "phub_table_blocks_made_on_lcore_total{job=\"1\",key=\"0\"} 6\n",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        text
    }

    /// Every family follows Prometheus' naming: a counter's name ends in
    /// `_total` and a gauge's does not, no name carries a scaled or
    /// non-base unit, a base unit (`bytes`, `seconds`) comes last, every
    /// family has one HELP then one TYPE, and every sample belongs to the
    /// family declared before it.
    #[test]
    fn every_family_follows_prometheus_naming() {
        let text = everything();
        let mut families: Vec<(String, String)> = Vec::new();
        let mut helped: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap();
                assert!(!help.is_empty(), "{name}: empty HELP");
                helped = Some(name.to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert_eq!(
                    helped.take().as_deref(),
                    Some(name),
                    "TYPE {name} without its HELP first"
                );
                assert!(!families.iter().any(|(n, _)| n == name), "{name} declared twice");
                families.push((name.to_string(), kind.to_string()));
            } else {
                let name = line.split(['{', ' ']).next().unwrap();
                assert_eq!(
                    families.last().map(|(n, _)| n.as_str()),
                    Some(name),
                    "sample {line:?} outside its family"
                );
                let value = line.rsplit(' ').next().unwrap();
                assert!(value.parse::<f64>().is_ok(), "{line:?}: value not a number");
            }
        }
        assert!(families.len() > LcoreStats::COUNTERS.len(), "{families:?}");
        for d in LcoreStats::COUNTERS {
            if d.kind == phub_proto::counters::Kind::Bytes {
                let name = LcoreFamily::of(d).name;
                assert!(
                    name.ends_with("_bytes_total"),
                    "{}: bytes, exported as {name}",
                    d.name
                );
            }
        }
        for (name, kind) in &families {
            assert!(
                name.starts_with("phub_")
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{name}"
            );
            let stem = match kind.as_str() {
                "counter" => name
                    .strip_suffix("_total")
                    .unwrap_or_else(|| panic!("counter {name} does not end in _total")),
                "gauge" => {
                    assert!(!name.ends_with("_total"), "gauge {name} ends in _total");
                    name.as_str()
                }
                k => panic!("{name}: type {k}, expected counter or gauge"),
            };
            let words: Vec<&str> = stem.split('_').collect();
            for w in &words {
                assert!(
                    !NOT_BASE_UNITS.contains(w),
                    "{name}: `{w}` is not a base unit (use _seconds or _bytes, converting the value)"
                );
            }
            for unit in ["bytes", "seconds"] {
                if let Some(at) = words.iter().position(|w| *w == unit) {
                    assert_eq!(at, words.len() - 1, "{name}: the unit `{unit}` comes last");
                }
            }
        }
    }

    #[test]
    fn a_time_in_microseconds_is_exported_in_seconds() {
        let text = everything();
        let f = LcoreFamily::of(
            LcoreStats::COUNTERS
                .iter()
                .find(|d| d.name == "held_wait_us")
                .unwrap(),
        );
        assert_eq!(f.name, "phub_lcore_held_wait_seconds_total");
        assert!(f.help.ends_with(", in seconds, per lcore"), "{}", f.help);
        for line in [
            "# TYPE phub_lcore_held_wait_seconds_total counter",
            "phub_lcore_held_wait_seconds_total{appliance=\"b\",lcore=\"1\"} 1.5",
            "phub_lcore_answers_released_total{appliance=\"b\",lcore=\"1\"} 1500000",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("_us"), "{text}");
        assert!(
            text.lines()
                .any(|l| l == "phub_port_rx_missed_packets_total{appliance=\"a\"} 3"),
            "{text}"
        );
        assert_eq!(f.value(1), "0.000001");
    }

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape_label(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape_label("x\ny"), "x\\ny");
    }

    #[test]
    fn renders_every_family() {
        let dp = DataplaneStats {
            spin_us: Some(200),
            port: None,
            backend: phub_proto::api::BackendKind::Udp,
            lcores: vec![
                LcoreStats {
                    lcore: 0,
                    rx_packets: 10,
                    drops: [("bad_token".to_string(), 3)].into(),
                    ..Default::default()
                },
                LcoreStats {
                    lcore: 1,
                    tx_bytes: 99,
                    ..Default::default()
                },
            ],
            jobs: vec![JobLive {
                id: 1,
                pushes: 40,
                rounds_completed: 5,
                round_range: Some((4, 5)),
                silent_ms: vec![Some(1), None],
                clock: Default::default(),
                copies: None,
                tables: Vec::new(),
            }],
        };
        let jobs = vec![JobSummary {
            id: 1,
            name: "my \"net\"".into(),
            workers: 2,
            joined: vec![0],
            keys: 1,
            chunks: 3,
            dtype: "f32".into(),
            optimizer: "sum".into(),
            memory_bytes: 4096,
            appliances: vec!["default".into()],
            installed: true,
            failed: None,
            held: None,
        }];
        let text = render(Some(&dp), &jobs);
        for line in [
            "phub_dataplane_up 1",
            "# TYPE phub_lcore_rx_packets_total counter",
            "phub_lcore_rx_packets_total{lcore=\"0\"} 10",
            "phub_lcore_rx_packets_total{lcore=\"1\"} 0",
            "phub_lcore_tx_bytes_total{lcore=\"1\"} 99",
            "phub_lcore_idle_loops_total{lcore=\"0\"} 0",
            "phub_lcore_drops_total{lcore=\"0\",reason=\"bad_token\"} 3",
            "phub_jobs 1",
            "phub_job_workers_joined{job=\"1\",name=\"my \\\"net\\\"\"} 1",
            "phub_job_rounds_completed_total{job=\"1\"} 5",
            "phub_job_memory_bytes{job=\"1\"} 4096",
            "phub_dataplane_spin_seconds 0.0002",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("phub_lcore_lcore"));
        let down = render(None, &jobs);
        assert!(down.contains("phub_dataplane_up 0\n") && !down.contains("phub_lcore_"));
        // Two appliances: labelled, and the job's counters added up.
        let two = render_all(&[("a", Some(&dp)), ("b", Some(&dp)), ("c", None)], &jobs);
        for line in [
            "phub_dataplane_up{appliance=\"a\"} 1",
            "phub_dataplane_up{appliance=\"c\"} 0",
            "phub_lcore_rx_packets_total{appliance=\"b\",lcore=\"0\"} 10",
            "phub_lcore_drops_total{appliance=\"a\",lcore=\"0\",reason=\"bad_token\"} 3",
            "phub_job_rounds_completed_total{job=\"1\"} 10",
            "phub_job_pushes_total{job=\"1\"} 80",
            "phub_dataplane_spin_seconds{appliance=\"b\"} 0.0002",
        ] {
            assert!(two.lines().any(|l| l == line), "missing {line:?} in\n{two}");
        }
    }
}
