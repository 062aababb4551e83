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
