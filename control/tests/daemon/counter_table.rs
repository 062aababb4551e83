//! The lcore counters' table is what `/v1/stats`, `/metrics` and `phubctl
//! stats` show: every counter of `LcoreStats::COUNTERS`, under its name,
//! with its help text and its value, and nothing that is not in it.

use phub_control::{cli::render_stats, metrics};
use phub_proto::api::{DataplaneStats, LcoreStats, Stats};
use phub_proto::counters::{Column, Kind};

/// Two lcores whose every counter holds a value of its own (lcore 1 twice
/// lcore 0's), set through the JSON names alone.
fn stats() -> DataplaneStats {
    let lcore = |i: u64| {
        let mut m = serde_json::Map::new();
        m.insert("lcore".into(), i.into());
        m.insert("drops".into(), serde_json::json!({ "duplicate": 5 * (i + 1) }));
        for (k, d) in LcoreStats::COUNTERS.iter().enumerate() {
            m.insert(d.name.into(), (1000 * (k as u64 + 1) * (i + 1)).into());
        }
        serde_json::from_value::<LcoreStats>(m.into()).unwrap()
    };
    DataplaneStats {
        spin_us: None,
        backend: phub_proto::api::BackendKind::Udp,
        lcores: vec![lcore(0), lcore(1)],
        jobs: vec![],
        port: None,
    }
}

fn value(k: usize, lcore: u64) -> u64 {
    1000 * (k as u64 + 1) * (lcore + 1)
}

#[test]
fn v1_stats_carries_every_counter_of_the_table_and_only_those() {
    let dp = stats();
    let json = serde_json::to_value(&dp.lcores[1]).unwrap();
    let obj = json.as_object().unwrap();
    for (k, d) in LcoreStats::COUNTERS.iter().enumerate() {
        assert_eq!(obj[d.name].as_u64(), Some(value(k, 1)), "{}", d.name);
    }
    assert_eq!(
        obj.len(),
        LcoreStats::COUNTERS.len() + 2,
        "lcore, drops and the counters: {obj:?}"
    );
    let total = dp.total();
    for ((d, v), k) in total.counters().zip(0..) {
        assert_eq!(v, value(k, 0) + value(k, 1), "{}", d.name);
    }
}

#[test]
fn metrics_export_every_counter_with_the_tables_help() {
    let text = metrics::render(Some(&stats()), &[]);
    for (k, d) in LcoreStats::COUNTERS.iter().enumerate() {
        // phub_lcore_<name>_total, or a time's in seconds (metrics.rs).
        let f = metrics::LcoreFamily::of(d);
        let name = &f.name;
        assert!(f.help.starts_with(d.help), "{}: {}", d.name, f.help);
        let help = format!("# HELP {name} {}", f.help);
        assert!(text.lines().any(|l| l == help), "missing {help:?} in\n{text}");
        let ty = format!("# TYPE {name} {}", d.kind.prometheus_type());
        assert!(text.lines().any(|l| l == ty), "missing {ty:?}");
        for lcore in 0..2 {
            let sample = format!("{name}{{lcore=\"{lcore}\"}} {}", f.value(value(k, lcore)));
            assert!(text.lines().any(|l| l == sample), "missing {sample:?}");
        }
    }
    let families = text
        .lines()
        .filter(|l| l.starts_with("# TYPE phub_lcore_"))
        .count();
    assert_eq!(
        families,
        LcoreStats::COUNTERS.len() + 1,
        "the counters and drops by reason"
    );
}

#[test]
fn phubctl_stats_shows_every_column_of_the_table_with_its_value() {
    let text = render_stats(&Stats {
        dataplane: Some(stats()),
        dataplane_error: None,
        appliances: vec![],
        jobs: vec![],
    });
    let lines: Vec<&str> = text.lines().collect();
    let header = lines[2];
    let row = |name: &str| -> Vec<&str> {
        lines
            .iter()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row {name} in\n{text}"))
            .split_whitespace()
            .collect()
    };
    // Headings may hold a space ("RX PKTS"): find each one's position in
    // the header by the headings before it.
    let headings: Vec<&str> = LcoreStats::COUNTERS
        .iter()
        .filter_map(|d| match d.column {
            Column::Always(h) | Column::IfAny(h) => Some(h),
            Column::Hidden => None,
        })
        .collect();
    for h in &headings {
        assert!(header.contains(h), "no column {h:?} in {header:?}");
    }
    let mut shown = 0;
    for (k, d) in LcoreStats::COUNTERS.iter().enumerate() {
        let (Column::Always(h) | Column::IfAny(h)) = d.column else {
            continue;
        };
        // The column's index among the header's whitespace-separated words,
        // counting multi-word headings once.
        let at = header[..header.find(h).unwrap()]
            .split("  ")
            .filter(|w| !w.trim().is_empty())
            .count();
        let want = |lcore: u64| {
            let v = value(k, lcore);
            match d.kind {
                Kind::Bytes => format!("{:.1}", v as f64 / 1e6),
                Kind::Count | Kind::Gauge => v.to_string(),
            }
        };
        assert_eq!(row("0")[at], want(0), "column {h}, lcore 0");
        assert_eq!(row("1")[at], want(1), "column {h}, lcore 1");
        shown += 1;
    }
    assert_eq!(shown, headings.len());
}
