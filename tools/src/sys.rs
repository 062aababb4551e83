//! What the benchmarks record about where they ran: the machine, the
//! commit, and the CPU time a process has used (from `/proc/PID/stat`).

use std::process::Command;

use serde::Serialize;

/// The machine, as /proc/cpuinfo and the standard library see it.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// `model name` of the first processor.
    pub cpu_model: String,
    /// `processor` entries in /proc/cpuinfo.
    pub logical_cpus: usize,
    /// What `std::thread::available_parallelism` says (affinity, cgroups).
    pub available_parallelism: usize,
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// `std::env::consts::OS`.
    pub os: &'static str,
    /// `std::env::consts::ARCH`.
    pub arch: &'static str,
}

impl Machine {
    /// Reads the machine's description.
    pub fn detect() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|r| r.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".to_string());
        let logical_cpus = cpuinfo.lines().filter(|l| l.starts_with("processor")).count();
        Machine {
            cpu_model,
            logical_cpus,
            available_parallelism: std::thread::available_parallelism().map_or(0, |n| n.get()),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
        }
    }
}

/// `git rev-parse --short HEAD` of the current directory's repository, with
/// `-dirty` when tracked files differ from it; `unknown` outside a
/// repository. Read-only git commands only.
pub fn commit() -> String {
    let run = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "--short", "HEAD"]) {
        Some(c) if !c.is_empty() => {
            let dirty =
                run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{c}-dirty")
            } else {
                c
            }
        }
        _ => "unknown".to_string(),
    }
}

/// The host's steal time so far (`/proc/stat`'s cpu line, 8th value),
/// in ticks; `None` where there is no such file.
pub fn steal_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    cpu_ticks(&stat)?.get(7).copied()
}

/// The values of `/proc/stat`'s `cpu` line (all CPUs), in ticks: user,
/// nice, system, idle, iowait, irq, softirq, steal, ...
fn cpu_ticks(stat: &str) -> Option<Vec<u64>> {
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    cpu.split_whitespace().skip(1).map(|x| x.parse().ok()).collect()
}

/// CPU seconds every process of the machine has run so far: the `cpu`
/// line of `/proc/stat`, user, nice, system, irq and softirq (not idle,
/// iowait or steal); `None` where there is no such file.
pub fn busy_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_busy_ticks(&stat).map(|t| t as f64 / clock_ticks())
}

/// user + nice + system + irq + softirq in ticks from `/proc/stat`'s
/// `cpu` line (guest time is within user already).
pub fn parse_busy_ticks(stat: &str) -> Option<u64> {
    let v = cpu_ticks(stat)?;
    Some(v.first()? + v.get(1)? + v.get(2)? + v.get(5)? + v.get(6)?)
}

/// CPU seconds (user + system) process `pid` has used so far, from
/// `/proc/PID/stat`; `None` if it cannot be read (gone, or not Linux).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_cpu(&stat).map(|ticks| ticks as f64 / clock_ticks())
}

/// utime + stime in clock ticks from a `/proc/PID/stat` line. The command
/// name (field 2) may contain spaces and parentheses, so fields are counted
/// after its closing parenthesis.
pub fn parse_stat_cpu(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, so utime (14) and stime (15) are
    // at indices 11 and 12.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// CPU seconds of every thread of process `pid`, by thread name (threads
/// of the same name are summed), from `/proc/PID/task/TID/stat`.
pub fn thread_cpu_seconds(pid: u32) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let name = match (stat.find('('), stat.rfind(')')) {
            (Some(a), Some(b)) if a < b => stat[a + 1..b].to_string(),
            _ => continue,
        };
        if let Some(t) = parse_stat_cpu(&stat) {
            *out.entry(name).or_insert(0.0) += t as f64 / clock_ticks();
        }
    }
    out
}

/// `after - before` per thread name (threads that appeared count from 0).
pub fn cpu_delta(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
) -> std::collections::BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions; it only reads a constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_cpu_fields() {
        let line = "1234 (phub (x) y) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 1 1 1";
        assert_eq!(parse_stat_cpu(line), Some(325));
        assert_eq!(parse_stat_cpu("garbage"), None);
        assert!(cpu_seconds(std::process::id()).is_some());
    }

    #[test]
    fn busy_ticks_leave_idle_iowait_and_steal_out() {
        let stat = "cpu  100 2 30 5000 40 5 6 700 0 0\ncpu0 50 1 15 2500 20 2 3 350 0 0\n";
        assert_eq!(parse_busy_ticks(stat), Some(100 + 2 + 30 + 5 + 6));
        assert_eq!(parse_busy_ticks("cpu0 1 2 3\n"), None);
        assert_eq!(parse_busy_ticks("cpu  1 2\n"), None);
        assert!(busy_seconds().is_some());
    }
}
