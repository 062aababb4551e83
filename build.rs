//! Stamps the build into the binaries: version, git commit and the target
//! features the compiler was allowed to use (runtime kernel choice is
//! separate and reported by the kernels themselves).

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    println!("cargo:rustc-env=PHUB_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=PHUB_TARGET_FEATURES={features}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=build.rs");
}
