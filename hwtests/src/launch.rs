//! Starting `phub-rack-agent` on the worker hosts, the one path the suite
//! drives worker-side traffic through on either kind of rack: `SSH HOST
//! AGENT args...` on a lab rack, `ip netns exec NS AGENT args...` on the
//! virtual one (so the CI run exercises the same agent and launcher a lab
//! rack uses).
//!
//! Layer: test support only.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use serde::de::DeserializeOwned;

use crate::rack::RackFile;

/// Where and how agents start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launcher {
    /// A lab rack's worker hosts, each reached with `ssh` (words), running
    /// its agent binary.
    Ssh {
        /// The command that reaches a host, e.g. `ssh -o BatchMode=yes`.
        ssh: Vec<String>,
        /// Per worker host: (host, agent path there).
        hosts: Vec<(String, String)>,
    },
    /// The virtual rack: one "host", the workers' side of its namespace.
    Netns {
        /// The namespace.
        ns: String,
        /// The agent binary (built with the suite).
        agent: String,
    },
}

/// Quotes `s` for the remote shell ssh hands the command line to: as it is
/// when it holds only characters no shell treats specially, else in single
/// quotes.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=,@%+".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

impl Launcher {
    /// The lab rack's worker hosts.
    pub fn lab(rack: &RackFile) -> Launcher {
        Launcher::Ssh {
            ssh: rack.ssh_words(),
            hosts: (0..rack.workers.len())
                .map(|i| (rack.workers[i].host.clone(), rack.agent_of(i)))
                .collect(),
        }
    }

    /// The virtual rack's namespace `ns`, with the agent at `agent`.
    pub fn netns(ns: &str, agent: &Path) -> Launcher {
        Launcher::Netns {
            ns: ns.to_string(),
            agent: agent.to_string_lossy().into_owned(),
        }
    }

    /// How many worker hosts there are.
    pub fn hosts(&self) -> usize {
        match self {
            Launcher::Ssh { hosts, .. } => hosts.len(),
            Launcher::Netns { .. } => 1,
        }
    }

    /// The whole command line that runs the agent with `args` on worker
    /// host `host` (0-based; taken modulo [`Launcher::hosts`]).
    pub fn argv(&self, host: usize, args: &[String]) -> Vec<String> {
        match self {
            Launcher::Ssh { ssh, hosts } => {
                let (h, agent) = &hosts[host % hosts.len()];
                // ssh joins the words after the host into one line for the
                // remote shell: each is quoted for it.
                let mut v = ssh.clone();
                v.push(h.clone());
                v.push(shell_quote(agent));
                v.extend(args.iter().map(|a| shell_quote(a)));
                v
            }
            Launcher::Netns { ns, agent } => {
                let mut v: Vec<String> = ["ip", "netns", "exec", ns, agent]
                    .into_iter()
                    .map(String::from)
                    .collect();
                v.extend(args.iter().cloned());
                v
            }
        }
    }

    /// Starts the agent with `args` on worker host `host`.
    pub fn spawn(&self, host: usize, args: &[String]) -> Result<Agent, String> {
        if self.hosts() == 0 {
            return Err(
                "the rack file names no [[workers]]: the suite needs at least one worker host".into(),
            );
        }
        let argv = self.argv(host, args);
        let what = argv.join(" ");
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{what}: {e}"))?;
        Ok(Agent { child, what })
    }
}

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    child: Child,
    what: String,
}

impl Agent {
    /// Waits for the agent and returns its report (the last line of its
    /// stdout, JSON). Panics with its command line and stderr when it
    /// failed or printed no report.
    pub fn report<T: DeserializeOwned>(self) -> T {
        let out = self
            .child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("{}: {e}", self.what));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{} failed ({}):\n{stderr}",
            self.what,
            out.status
        );
        let line = stdout.lines().last().unwrap_or("");
        serde_json::from_str(line).unwrap_or_else(|e| {
            panic!(
                "{}: no report in its output ({e}):\n{stdout}\n{stderr}",
                self.what
            )
        })
    }
}

/// Starts one agent per `(host, args)` and returns their reports, in order;
/// all run at once.
pub fn run_all<T: DeserializeOwned>(launcher: &Launcher, runs: &[(usize, Vec<String>)]) -> Vec<T> {
    let agents: Vec<Agent> = runs
        .iter()
        .map(|(h, a)| launcher.spawn(*h, a).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    agents.into_iter().map(Agent::report).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn a_lab_rack_runs_the_agent_over_ssh() {
        let rack = RackFile::parse(
            "agent = \"/usr/local/bin/phub-rack-agent\"\n\
             [appliance]\npci = \"0000:3b:00.0\"\ncores = [2, 3]\nmain_core = 1\nip = \"192.168.50.1\"\n\
             [[workers]]\nhost = \"worker1\"\nip = \"192.168.50.11\"\n\
             [[workers]]\nhost = \"root@worker2\"\nip = \"192.168.50.12\"\nagent = \"/opt/phub dir/agent\"\n",
        )
        .unwrap();
        let l = Launcher::lab(&rack);
        assert_eq!(l.hosts(), 2);
        let args =
            words("blast --to 192.168.50.1 --base-port 7900 --queues 2 --payload 8192 --secs 2 --job 9");
        assert_eq!(
            l.argv(0, &args),
            words(
                "ssh -o BatchMode=yes worker1 /usr/local/bin/phub-rack-agent blast --to 192.168.50.1 \
                 --base-port 7900 --queues 2 --payload 8192 --secs 2 --job 9"
            )
        );
        // Host 3 is host 1 again; its own agent path, quoted for the remote shell.
        let args = words("train --control http://10.0.0.1:7700 --job 1 --token 00ff --rank 3 --workers 4 --keys 100,1 --rounds 10");
        let mut want = words("ssh -o BatchMode=yes root@worker2");
        want.push("'/opt/phub dir/agent'".into());
        want.extend(args.clone());
        assert_eq!(l.argv(3, &args), want);
    }

    #[test]
    fn the_virtual_rack_runs_the_agent_in_its_namespace() {
        let l = Launcher::netns("phub-x-1", Path::new("/t/phub-rack-agent"));
        assert_eq!(l.hosts(), 1);
        assert_eq!(
            l.argv(2, &words("blast --count 5")),
            words("ip netns exec phub-x-1 /t/phub-rack-agent blast --count 5")
        );
    }

    #[test]
    fn arguments_are_quoted_for_the_remote_shell() {
        assert_eq!(shell_quote("http://10.0.0.1:7700"), "http://10.0.0.1:7700");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's;rm"), r"'it'\''s;rm'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$(x)"), "'$(x)'");
    }
}
