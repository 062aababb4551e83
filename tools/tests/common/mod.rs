//! What the phub-bench tests share.

use std::process::{Command, Stdio};

use serde_json::Value;

/// Runs `phub-bench run --local ARGS --json F` (F in a scratch directory
/// named after `tag`, removed after), asserts it succeeded, and returns its
/// JSON, its output (stdout, then stderr) and its process id (which names
/// the namespaces it made).
pub(crate) fn run_local(tag: &str, args: &[&str]) -> (Value, String, u32) {
    let dir = std::env::temp_dir().join(format!("phub-bench-{tag}-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("run.json");
    let child = Command::new(env!("CARGO_BIN_EXE_phub-bench"))
        .args(["run", "--local"])
        .args(args)
        .arg("--json")
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running phub-bench");
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (v, text, pid)
}
