//! The packaged configuration files (packaging/etc/phub/*.toml) against the
//! daemons' real flags: every flag is listed in its daemon's file (so they
//! cannot drift), every key listed is a flag, the shipped files are
//! accepted, a file's value is used and the command line overrides it.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DATAPLANE: &str = env!("CARGO_BIN_EXE_phub-dataplane");
const CONTROL: &str = env!("CARGO_BIN_EXE_phub-control");

fn shipped(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("packaging/etc/phub")
        .join(name)
}

/// The long flags `bin --help` lists, but help, version and config.
fn flags(bin: &str) -> Vec<String> {
    let out = Command::new(bin).arg("--help").output().unwrap();
    assert!(out.status.success(), "{bin} --help failed");
    let mut flags = Vec::new();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let t = line.trim_start();
        let t = t
            .strip_prefix("-h, ")
            .or_else(|| t.strip_prefix("-V, "))
            .unwrap_or(t);
        if let Some(rest) = t.strip_prefix("--") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            if !["help", "version", "config"].contains(&name.as_str()) && !flags.contains(&name) {
                flags.push(name);
            }
        }
    }
    assert!(
        flags.len() > 5,
        "{bin}: too few flags parsed from --help: {flags:?}"
    );
    flags
}

/// The keys a shipped file sets or shows commented out (`key =` or
/// `# key =` at the start of a line).
fn listed_keys(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    text.lines()
        .filter_map(|l| {
            let l = l.strip_prefix("# ").unwrap_or(l);
            let (key, _) = l.split_once(" = ")?;
            key.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                .then(|| key.to_string())
        })
        .collect()
}

#[test]
fn every_flag_is_in_its_shipped_config_and_the_file_is_accepted() {
    for (bin, file) in [(DATAPLANE, "dataplane.toml"), (CONTROL, "control.toml")] {
        let file = shipped(file);
        let flags = flags(bin);
        let keys = listed_keys(&file);
        let missing: Vec<_> = flags.iter().filter(|f| !keys.contains(f)).collect();
        assert!(
            missing.is_empty(),
            "{}: flags of {bin} not listed (add `# flag = default` with its meaning): {missing:?}",
            file.display()
        );
        let stale: Vec<_> = keys.iter().filter(|k| !flags.contains(k)).collect();
        assert!(
            stale.is_empty(),
            "{}: keys that are no flag: {stale:?}",
            file.display()
        );
        // The file as shipped parses (the file is read before --version
        // answers), and so does every commented example once uncommented.
        let out = Command::new(bin)
            .arg("--config")
            .arg(&file)
            .arg("--version")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{bin}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = tempdir();
        for line in std::fs::read_to_string(&file).unwrap().lines() {
            let Some(example) = line.strip_prefix("# ") else {
                continue;
            };
            if !listed_keys_line(example) {
                continue;
            }
            let one = dir.join("one.toml");
            std::fs::write(&one, format!("{example}\n")).unwrap();
            let out = Command::new(bin)
                .arg("--config")
                .arg(&one)
                .arg("--version")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: the example `{example}` is refused: {}",
                file.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn listed_keys_line(l: &str) -> bool {
    l.split_once(" = ").is_some_and(|(k, _)| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    })
}

fn tempdir() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "phub-packaging-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `cmd` until a line of its stderr contains `want` (then kills it and
/// returns true) or it exits (false); the stderr seen so far goes in `log`.
fn starts(mut cmd: Command, want: &str, log: &mut String) -> bool {
    let mut child: Child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = false;
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let Ok(line) = line else { break };
        log.push_str(&line);
        log.push('\n');
        if line.contains(want) {
            seen = true;
            break;
        }
        if Instant::now() > deadline {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    seen
}

#[test]
fn a_file_value_is_used_and_the_command_line_overrides_it() {
    let dir = tempdir();
    // The dataplane: `lcores = 300` is parsed, then refused by the daemon.
    let conf = dir.join("dataplane.toml");
    let token = dir.join("dataplane.token");
    std::fs::write(
        &conf,
        format!(
            "lcores = 300\nmgmt = \"127.0.0.1:0\"\nbase-port = 0\nidle-backoff = true\nmgmt-token-file = \"{}\"\n",
            token.display()
        ),
    )
    .unwrap();
    let out = Command::new(DATAPLANE)
        .arg("--config")
        .arg(&conf)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--lcores 300"), "{err}");
    let mut log = String::new();
    let mut cmd = Command::new(DATAPLANE);
    cmd.arg("--config").arg(&conf).args(["--lcores", "1"]);
    assert!(starts(cmd, "1 udp lcore(s)", &mut log), "{log}");
    assert!(
        log.contains(&format!("configuration file {}", conf.display())),
        "{log}"
    );
    assert!(
        log.contains(&format!("management token in {}", token.display())),
        "{log}"
    );

    // Control: a clear-text listener beyond loopback is refused...
    let conf = dir.join("control.toml");
    std::fs::write(
        &conf,
        format!(
            "listen = \"192.0.2.1:7700\"\nstate = \"{}\"\nreconcile-ms = 60000\n",
            dir.join("state.json").display()
        ),
    )
    .unwrap();
    let out = Command::new(CONTROL).arg("--config").arg(&conf).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("192.0.2.1:7700"), "{err}");
    // ... and the command line's loopback address is taken instead, with
    // the file's state path.
    let mut log = String::new();
    let mut cmd = Command::new(CONTROL);
    cmd.arg("--config").arg(&conf).args(["--listen", "127.0.0.1:0"]);
    assert!(starts(cmd, "listening on http://127.0.0.1:", &mut log), "{log}");
    assert!(
        log.contains(&format!("state {}", dir.join("state.json").display())),
        "{log}"
    );

    // A mistake names the file and the key.
    std::fs::write(&conf, "reconcile_ms = 5\n").unwrap();
    let out = Command::new(CONTROL).arg("--config").arg(&conf).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(2)
            && err.contains(&conf.display().to_string())
            && err.contains("`reconcile-ms`"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The metric names an expression names (`phub_...`).
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("phub_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

#[test]
fn every_series_the_dashboard_plots_is_exported_and_documented() {
    use phub_proto::api::{DataplaneStats, JobLive, JobSummary, LcoreStats};
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/grafana/phub.json");
    let dash: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} plots nothing", p["title"]);
        exprs.extend(targets.iter().map(|t| t["expr"].as_str().unwrap().to_string()));
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"].as_str() {
            exprs.push(q.to_string());
        }
    }
    // /metrics as control renders it for a DPDK dataplane with a job live
    // and a drop counted, so that every family is present.
    let dp = DataplaneStats {
        spin_us: None,
        port: Some(phub_proto::api::PortStats::default()),
        backend: phub_proto::api::BackendKind::Dpdk,
        lcores: vec![LcoreStats {
            lcore: 0,
            drops: [("bad_token".to_string(), 1)].into(),
            ..Default::default()
        }],
        jobs: vec![JobLive {
            id: 1,
            pushes: 4,
            rounds_completed: 2,
            round_range: Some((1, 2)),
            silent_ms: vec![Some(1), Some(1)],
            clock: Default::default(),
            copies: None,
            tables: Vec::new(),
        }],
    };
    let job = JobSummary {
        id: 1,
        name: "j".into(),
        workers: 2,
        joined: vec![0, 1],
        keys: 1,
        chunks: 1,
        dtype: "f32".into(),
        optimizer: "sgd".into(),
        memory_bytes: 4096,
        appliances: vec!["default".into()],
        installed: true,
        failed: None,
        held: None,
    };
    let metrics = phub_control::metrics::render(Some(&dp), &[job]);
    let ops =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/OPERATING.md")).unwrap();
    let mut seen = 0;
    for e in &exprs {
        for name in metric_names(e) {
            seen += 1;
            assert!(
                metrics.contains(&format!("# HELP {name} ")),
                "{}: `{e}` plots {name}, which /metrics does not export",
                path.display()
            );
            assert!(
                ops.contains(&format!("`{name}`")),
                "{}: {name} is plotted but docs/OPERATING.md does not document it (as `{name}`)",
                path.display()
            );
        }
    }
    assert!(
        seen >= 10,
        "too few series found in {}: {exprs:?}",
        path.display()
    );
}

/// The shipped files and units agree: the units start each daemon with its
/// file at the path the daemon reads by default, and control reads the
/// management token where the dataplane (and the unit's `phub-setup token`)
/// put it.
#[test]
fn the_units_and_the_shipped_files_agree() {
    let read = |p: &str| std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(p)).unwrap();
    let table = |p: &str| -> toml::Table { read(p).parse().unwrap() };
    let dp = table("packaging/etc/phub/dataplane.toml");
    let ctl = table("packaging/etc/phub/control.toml");
    assert_eq!(
        dp.get("mgmt-token-file"),
        ctl.get("dataplane-token-file"),
        "control's dataplane-token-file must be the dataplane's mgmt-token-file"
    );
    for (unit, bin, conf) in [
        (
            "phub-dataplane.service",
            "phub-dataplane",
            phub_dataplane::config::CONFIG_FILE,
        ),
        (
            "phub-control.service",
            "phub-control",
            phub_control::daemon::CONFIG_FILE,
        ),
    ] {
        let text = read(&format!("packaging/systemd/{unit}"));
        let exec = text.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap();
        assert_eq!(exec, format!("/usr/bin/{bin} --config {conf}"), "{unit}");
        assert!(text.contains("Restart=on-failure"), "{unit}");
    }
    let dp_unit = read("packaging/systemd/phub-dataplane.service");
    assert!(dp_unit.contains(&format!(
        "ExecStartPre=/usr/bin/phub-setup token --config {} --owner phub",
        phub_dataplane::config::CONFIG_FILE
    )));
    let token = dp["mgmt-token-file"].as_str().unwrap();
    assert!(
        token.starts_with("/run/phub/") && dp_unit.contains("RuntimeDirectory=phub\n"),
        "the token file must be in the unit's RuntimeDirectory"
    );
    let ctl_unit = read("packaging/systemd/phub-control.service");
    for line in [
        "User=phub",
        "StateDirectory=phub",
        "After=network-online.target phub-dataplane.service",
    ] {
        assert!(
            ctl_unit.lines().any(|l| l == line),
            "phub-control.service: no {line:?}"
        );
    }
    assert!(ctl["state"].as_str().unwrap().starts_with("/var/lib/phub/"));
}

const SETUP: &str = env!("CARGO_BIN_EXE_phub-setup");

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether `tool` is on PATH.
fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// What the machine's hugepages are: each size's `nr_hugepages` (file and
/// content) and whether hugetlbfs is mounted at /dev/hugepages.
fn hugepages_now() -> (Vec<(PathBuf, String)>, bool) {
    let mut sizes: Vec<(PathBuf, String)> = std::fs::read_dir("/sys/kernel/mm/hugepages")
        .map(|d| {
            d.filter_map(|e| {
                let f = e.ok()?.path().join("nr_hugepages");
                Some((f.clone(), std::fs::read_to_string(&f).ok()?))
            })
            .collect()
        })
        .unwrap_or_default();
    sizes.sort();
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let mounted = mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == Some("/dev/hugepages") && l.split(' ').nth(2) == Some("hugetlbfs"));
    (sizes, mounted)
}

/// Puts the machine's hugepages back as they were (on drop, so that a
/// failed assertion restores them too): the reservation, the mount, and
/// the mount point if phub-setup made it.
struct RestoreHugepages((Vec<(PathBuf, String)>, bool), bool);

impl Drop for RestoreHugepages {
    fn drop(&mut self) {
        let (sizes, mounted) = &self.0;
        if !mounted && hugepages_now().1 {
            let _ = Command::new("umount").arg("/dev/hugepages").status();
        }
        if !self.1 {
            let _ = std::fs::remove_dir("/dev/hugepages");
        }
        for (f, n) in sizes {
            if let Err(e) = std::fs::write(f, n.trim()) {
                eprintln!("could not restore {} to {}: {e}", f.display(), n.trim());
            }
        }
        assert_eq!(hugepages_now(), self.0, "hugepages not restored");
    }
}

/// `phub-setup hugepages 4M` reserves two 2 MB pages through DPDK's
/// dpdk-hugepages.py and mounts hugetlbfs: the kernel's counts say so.
/// The machine's reservation and mount are put back after. As root with
/// DPDK's tools, on a machine with no hugepages reserved (the tool clears
/// every reservation first: a machine using some is left alone).
#[test]
fn phub_setup_hugepages_reserves_them_and_the_machine_is_restored() {
    let two_mb = Path::new("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages");
    let skip = if !is_root() {
        Some("needs root (writes /sys/kernel/mm/hugepages, mounts hugetlbfs)".to_string())
    } else if !on_path("dpdk-hugepages.py") {
        Some("needs DPDK's tools (apt install dpdk; tools/setup.sh installs it)".to_string())
    } else if !two_mb.exists() {
        Some(format!(
            "no 2 MB hugepages in this kernel ({} missing)",
            two_mb.display()
        ))
    } else if std::fs::read_to_string("/proc/mounts").unwrap().lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.len() > 3 && f[1] == "/sys" && f[3].split(',').any(|o| o == "ro")
    }) {
        Some("/sys is mounted read-only here (a container)".to_string())
    } else {
        let (sizes, _) = hugepages_now();
        sizes.iter().find(|(_, n)| n.trim() != "0").map(|(f, n)| {
            format!(
                "{} is {}: this machine uses hugepages, left alone",
                f.display(),
                n.trim()
            )
        })
    };
    if let Some(why) = skip {
        eprintln!("phub_setup_hugepages: skipped: {why}");
        return;
    }
    // A machine without systemd's dev-hugepages.mount (a fresh CI
    // machine) has no mount point: phub-setup makes it.
    let had_mount_point = Path::new("/dev/hugepages").exists();
    let restore = RestoreHugepages(hugepages_now(), had_mount_point);
    let out = Command::new(SETUP)
        .args(["hugepages", "4M", "--pagesize", "2M"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "phub-setup hugepages failed:\n{text}");
    assert!(
        text.contains("dpdk-hugepages.py --pagesize 2M --setup 4M"),
        "{text}"
    );
    assert_eq!(
        text.contains("phub-setup: made /dev/hugepages"),
        !had_mount_point,
        "{text}"
    );
    assert_eq!(std::fs::read_to_string(two_mb).unwrap().trim(), "2", "{text}");
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    assert!(
        meminfo
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["HugePages_Total:", "2"]),
        "{meminfo}"
    );
    assert!(
        hugepages_now().1,
        "hugetlbfs not mounted at /dev/hugepages:\n{text}"
    );
    drop(restore);
}

/// Every PCI device's driver (by address), to see that nothing changed.
fn pci_drivers() -> Vec<(String, Option<PathBuf>)> {
    let mut v: Vec<_> = std::fs::read_dir("/sys/bus/pci/devices")
        .map(|d| {
            d.filter_map(|e| {
                let e = e.ok()?;
                Some((
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read_link(e.path().join("driver")).ok(),
                ))
            })
            .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `phub-setup bind-nic` with an address that names no device, one that is
/// not an address, and (when the machine has one) a PCI device that is not
/// a NIC: each fails with a message naming the address and what is wrong,
/// before anything changes (no driver bound or unbound, vfio-pci not
/// loaded). No NIC is bound here: there is none to spare.
#[test]
fn phub_setup_bind_nic_refuses_what_is_not_a_nic_and_changes_nothing() {
    let vfio = Path::new("/sys/bus/pci/drivers/vfio-pci");
    let before = (pci_drivers(), vfio.exists());
    let mut cases = vec![
        ("0000:ff:1f.7", "no such PCI device on this machine"),
        ("eth0", "not a PCI address"),
    ];
    assert!(
        !Path::new("/sys/bus/pci/devices/0000:ff:1f.7").exists(),
        "the made-up address exists here"
    );
    let other: Option<String> = before.0.iter().find_map(|(a, _)| {
        let class = std::fs::read_to_string(format!("/sys/bus/pci/devices/{a}/class")).ok()?;
        (!class.starts_with("0x02")).then(|| a.clone())
    });
    if let Some(a) = &other {
        cases.push((a.as_str(), "not a network controller"));
    } else {
        eprintln!("bind-nic: no PCI device other than a NIC here; the not-a-NIC case skipped");
    }
    for (addr, want) in cases {
        let out = Command::new(SETUP).args(["bind-nic", addr]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{addr}: {err}");
        assert!(
            err.starts_with("phub-setup: ") && err.contains(&format!("{addr:?}")) && err.contains(want),
            "{addr}: expected {want:?}, got: {err}"
        );
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("dpdk-devbind.py"),
            "{addr}: ran the tool"
        );
    }
    assert_eq!(
        (pci_drivers(), vfio.exists()),
        before,
        "bind-nic changed the machine"
    );
}
