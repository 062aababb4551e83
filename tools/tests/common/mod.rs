//! What the phub-bench tests share.

use std::process::{Command, Stdio};

use serde_json::Value;

/// Runs `phub-bench ARGS --json F` with `env` added (F in a scratch
/// directory named after `tag`, removed after): whether it succeeded, its
/// JSON (null when it wrote none), its output (stdout, then stderr) and its
/// process id (which names the namespaces it made).
#[allow(dead_code)] // each test binary uses its part of this module
pub(crate) fn bench_json(tag: &str, args: &[&str], env: &[(&str, &str)]) -> (bool, Value, String, u32) {
    let dir = std::env::temp_dir().join(format!("phub-bench-{tag}-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("run.json");
    let child = Command::new(env!("CARGO_BIN_EXE_phub-bench"))
        .args(args)
        .arg("--json")
        .arg(&json)
        .envs(env.iter().copied())
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
    let v = std::fs::read_to_string(&json)
        .map(|t| serde_json::from_str(&t).unwrap())
        .unwrap_or(Value::Null);
    let _ = std::fs::remove_dir_all(&dir);
    (out.status.success(), v, text, pid)
}

/// Runs `phub-bench run --local ARGS --json F` ([`bench_json`]), asserts
/// it succeeded, and returns its JSON, its output and its process id.
#[allow(dead_code)] // each test binary uses its part of this module
pub(crate) fn run_local(tag: &str, args: &[&str]) -> (Value, String, u32) {
    let args: Vec<&str> = ["run", "--local"]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let (ok, v, text, pid) = bench_json(tag, &args, &[]);
    assert!(ok, "{text}");
    (v, text, pid)
}
