//! A replicated job's failover, measured by `phub-bench run --local --racks
//! R --replicas 2 --kill-appliance NAME --kill-at-round N` (PROTOCOL.md
//! §11.6): the job is placed with `[placement] replicas`, and when every
//! worker has completed timed round N the coordinator kills (SIGKILL) the
//! named appliance's dataplane; control declares it down, the survivors
//! take the next epoch and the workers follow it.
//!
//! Figures ([`FailoverFigures`]):
//!
//! - `failover_ms`: from the kill to the first round a worker completed
//!   after it (a round beyond the highest any worker had reported when the
//!   kill was sent), both as the coordinator saw them;
//! - `epoch_served_ms`: from the kill to control serving the job's next
//!   epoch (asked every 5 ms): detection (`--heartbeat-ms`,
//!   `--heartbeat-deadline-ms`, control's defaults 100 and 500) and the
//!   new epoch's making; the rest of `failover_ms` is the workers'
//!   learning it and resending;
//! - `rounds_lost`: rounds that some worker saw answered with anything but
//!   that round's exact sum (`--verify`), plus the rounds the workers
//!   completed that a surviving appliance had not (its chunks' lowest last
//!   completed round, from control, below the workers' last round);
//! - `rounds_repeated`: the rounds a surviving appliance completed beyond
//!   the workers' last (an aggregate applied twice advances its round
//!   twice);
//! - `verified` (the run's own field): every element of every round equal
//!   to the closed form of the sum (`emulate`'s pattern), which is what the
//!   same seed's run without the kill gives bit for bit (small integers sum
//!   exactly in `f32` in any order): the reference is computed, not run.
//!
//! With `--restart-after-ms MS` the killed appliance's dataplane is
//! started again (empty, same addresses) MS after the kill, and control
//! brings the job back to full strength while it trains (PROTOCOL.md
//! §11.7):
//!
//! - `full_strength_ms`: control's time from giving the job back to the
//!   appliance to full strength (`phubctl job show`), and
//!   `rereplication_bytes` the state it copied;
//! - `full_strength_seen_ms`: from the restart to the coordinator seeing
//!   full strength (control asked every 20 ms);
//! - `longest_round_during_ms`, `rounds_during`: the longest round (as
//!   its slowest worker timed it) among those reported from the restart's
//!   start to the first reported after full strength was seen, against
//!   the run's median round.
//!
//! With `--drain-appliance NAME --drain-at-round N` instead of a kill
//! (and a spare: `--racks` above `--appliances`), the coordinator asks
//! control to drain the named appliance (`POST
//! /v1/appliances/{name}/drain`, PROTOCOL.md §11.8) when every worker has
//! completed timed round N: the job's place on it moves to the spare,
//! which is filled while the job trains. `drain_ms` is the drain request
//! to the first round completed after it; `full_strength_ms` and
//! `full_strength_seen_ms` (from the request), `rereplication_bytes`,
//! `longest_round_during_ms` and `rounds_during` (from the request to the
//! first round after full strength was seen) as for a restart, and
//! `rounds_lost` / `rounds_repeated` as for a kill.
//!
//! Kills are on the virtual racks only (`--racks`): they are the only
//! `--local` set-up with several appliances.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use phub_proto::api::{JobDetail, Strength};
use phub_proto::failover::EpochView;
use phub_proto::routes::control;
use serde::Serialize;

use super::local;

/// `phub-bench run`'s replica and kill options.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct FailoverArgs {
    /// Copies of every chunk (`[placement] replicas`, PROTOCOL.md §11): 1
    /// to 3, at most --appliances (virtual racks only).
    #[arg(long, value_name = "R", requires = "racks")]
    pub replicas: Option<u32>,
    /// Kill (SIGKILL) this appliance's dataplane mid-run, named as control
    /// names it (`rack2`); needs --replicas 2 and --kill-at-round.
    #[arg(long, value_name = "NAME", requires_all = ["racks", "kill_at_round"])]
    pub kill_appliance: Option<String>,
    /// The kill comes when every worker has completed timed round N (1 to
    /// --rounds - 1, so that a round follows it).
    #[arg(long, value_name = "N", requires = "kill_appliance")]
    pub kill_at_round: Option<u32>,
    /// Start the killed appliance's dataplane again MS after the kill
    /// (empty, same addresses): control re-replicates the job to it while
    /// it trains (PROTOCOL.md §11.7).
    #[arg(long, value_name = "MS", requires = "kill_appliance")]
    pub restart_after_ms: Option<u64>,
    /// Drain this appliance mid-run (`phubctl appliance drain`, named as
    /// control names it): the job's place on it moves to a spare (needs
    /// --replicas 2, --racks above --appliances, and --drain-at-round).
    #[arg(long, value_name = "NAME", requires_all = ["racks", "drain_at_round"], conflicts_with = "kill_appliance")]
    pub drain_appliance: Option<String>,
    /// The drain comes when every worker has completed timed round N (1
    /// to --rounds - 1).
    #[arg(long, value_name = "N", requires = "drain_appliance")]
    pub drain_at_round: Option<u32>,
    /// Control's heartbeat interval, ms (phub-control's `--heartbeat-ms`;
    /// default its own, 100).
    #[arg(long, value_name = "MS", requires = "racks")]
    pub heartbeat_ms: Option<u64>,
    /// Control's heartbeat deadline, ms (phub-control's
    /// `--heartbeat-deadline-ms`; default its own, 500).
    #[arg(long, value_name = "MS", requires = "racks")]
    pub heartbeat_deadline_ms: Option<u64>,
}

impl FailoverArgs {
    /// phub-control's arguments for the heartbeat timing asked for.
    pub fn control_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(ms) = self.heartbeat_ms {
            v.extend(["--heartbeat-ms".to_string(), ms.to_string()]);
        }
        if let Some(ms) = self.heartbeat_deadline_ms {
            v.extend(["--heartbeat-deadline-ms".to_string(), ms.to_string()]);
        }
        v
    }
}

/// What a run with `--kill-appliance` measured (all null without it;
/// `replicas` is set whenever `--replicas` was given).
#[derive(Debug, Clone, Default, Serialize)]
pub struct FailoverFigures {
    /// `--replicas`.
    pub replicas: Option<u32>,
    /// `--kill-appliance`.
    pub killed_appliance: Option<String>,
    /// `--kill-at-round` (a timed round).
    pub kill_at_round: Option<u32>,
    /// `--drain-appliance`.
    pub drained_appliance: Option<String>,
    /// `--drain-at-round` (a timed round).
    pub drain_at_round: Option<u32>,
    /// The drain request to the first round a worker completed after it,
    /// ms.
    pub drain_ms: Option<f64>,
    /// The kill to the first round a worker completed after it, ms.
    pub failover_ms: Option<f64>,
    /// The kill to control serving the job's next epoch (`GET
    /// /v1/jobs/{id}/epoch`, asked every 5 ms from the kill on), ms: the
    /// detection's share of `failover_ms`.
    pub epoch_served_ms: Option<f64>,
    /// Rounds a surviving appliance completed beyond the workers' last.
    pub rounds_repeated: Option<u32>,
    /// Rounds answered inexactly to some worker, plus rounds the workers
    /// completed that a surviving appliance had not.
    pub rounds_lost: Option<u32>,
    /// The job's epoch after the run, as control has it.
    pub epoch_after: Option<EpochView>,
    /// Lowest and highest last completed round over the surviving
    /// appliances' chunks at the end (the workers' last round is
    /// warm-up + rounds).
    pub survivors_round_range: Option<(u32, u32)>,
    /// What `verified` compares with: `computed` (the closed form of the
    /// sum, equal bit for bit to the same run without the kill).
    pub verified_against: Option<&'static str>,
    /// `--restart-after-ms`.
    pub restart_after_ms: Option<u64>,
    /// The kill to the restarted dataplane answering, ms.
    pub restarted_ms: Option<f64>,
    /// Control's time from giving the job back to the restarted appliance
    /// to full strength, ms.
    pub full_strength_ms: Option<u64>,
    /// The restart to the coordinator seeing full strength, ms.
    pub full_strength_seen_ms: Option<f64>,
    /// Bytes of state the restarted appliance was copied.
    pub rereplication_bytes: Option<u64>,
    /// The longest round reported from the restart to the first round
    /// reported after full strength was seen, as its slowest worker timed
    /// it, ms (module head).
    pub longest_round_during_ms: Option<f64>,
    /// How many rounds that covers.
    pub rounds_during: Option<u32>,
}

/// What [`Kill`] asks of the appliance it kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// SIGKILL its dataplane.
    Kill,
    /// Start its dataplane again, empty; `false` if it could not.
    Restart,
    /// Ask control to drain it; `false` if control refused.
    Drain,
}

/// The job's appliances' names on `n` virtual racks (control's names).
fn names(n: usize) -> Vec<String> {
    (1..=n).map(super::racks::appliance_name).collect()
}

/// Why these options cannot run a kill or a drain, if they cannot; `n`
/// is the job's appliance count, `racks` the appliances started, `rounds`
/// the timed rounds. Returns the index (0-based) of the appliance to kill
/// or drain, if any.
pub fn check(f: &FailoverArgs, n: usize, racks: usize, rounds: u32, compare: bool) -> Result<Option<usize>> {
    if let Some(r) = f.replicas {
        ensure!(
            (1..=3).contains(&r) && r as usize <= n,
            "--replicas {r}: expected 1 to {} (at most 3 and at most the job's {n} appliance(s))",
            n.min(3)
        );
    }
    let (flag, name, at, what) = match (&f.kill_appliance, &f.drain_appliance) {
        (Some(name), _) => ("--kill-appliance", name, f.kill_at_round, "kill"),
        (None, Some(name)) => ("--drain-appliance", name, f.drain_at_round, "drain"),
        (None, None) => return Ok(None),
    };
    let replicas = f.replicas.unwrap_or(1);
    ensure!(
        replicas == 2,
        "{flag} {name} with --replicas {replicas}: expected --replicas 2 (with 1 there is \
         no backup to fail over to; with 3, adopting a part whose set keeps another live backup is \
         not built, PROTOCOL.md §11.6 rule 4)"
    );
    let all = names(n);
    let index = all.iter().position(|a| a == name).ok_or_else(|| {
        anyhow::anyhow!(
            "{flag} {name}: not one of the job's appliances; expected one of {}",
            all.join(", ")
        )
    })?;
    let at = at.unwrap_or(0);
    ensure!(
        (1..rounds).contains(&at),
        "--{what}-at-round {at} with --rounds {rounds}: expected 1 to {} (a timed round with one \
         after it)",
        rounds.saturating_sub(1)
    );
    ensure!(
        !compare,
        "{flag} with --compare-single or --compare-flat: the comparison would run on \
         the appliances left; drop one of them"
    );
    ensure!(
        what == "kill" || racks > n,
        "--drain-appliance {name} with --racks {racks} --appliances {n}: the drain needs a spare \
         appliance the job does not use; give --racks {} or more",
        n + 1
    );
    Ok(Some(index))
}

/// A kill to send mid-run, and what the coordinator saw around it.
pub struct Kill<'a> {
    name: String,
    /// The timed round given (`--kill-at-round`).
    timed_round: u32,
    /// The round (as the workers number them, warm-up first) whose
    /// completion at every worker triggers the kill.
    after_round: u32,
    workers: usize,
    /// Kills, or restarts, the appliance; a restart says whether it came up.
    act: Box<dyn FnMut(Act) -> bool + 'a>,
    token: Option<String>,
    /// `--restart-after-ms`.
    restart_after: Option<Duration>,
    /// A drain instead of a kill ([`Kill::draining`]).
    drain: bool,
    /// When the restart began, and when the restarted dataplane answered
    /// (or the restart failed: `None` then, with `restart_failed`).
    restart_begun: Option<Instant>,
    restarted: Option<Instant>,
    restart_failed: bool,
    /// When control was first seen with the job at full strength after
    /// the restart.
    full_seen: Option<Instant>,
    /// When the job's detail was last asked for.
    asked_full: Option<Instant>,
    /// Per round, when its last worker reported it, and its slowest
    /// worker's time for it (ms).
    done_at: BTreeMap<u32, (Instant, f64)>,
    /// Workers that have completed `after_round`.
    reached: usize,
    /// The highest round any worker has reported.
    highest: u32,
    /// When the kill was sent, and the highest round reported then.
    sent: Option<(Instant, u32)>,
    /// The first report of a round beyond it.
    first_after: Option<Instant>,
    /// When control was first seen serving an epoch beyond 0.
    epoch_served: Option<Instant>,
    /// When control was last asked for the epoch.
    asked: Option<Instant>,
}

impl<'a> Kill<'a> {
    /// `act(Act::Kill)` (which sends SIGKILL to `name`'s dataplane) runs
    /// when all `workers` have completed timed round `timed_round` (after
    /// `warmup` rounds), and `act(Act::Restart)` `restart_after` later if
    /// given; `token` reads control's view of the job.
    pub fn new(
        name: &str,
        timed_round: u32,
        warmup: u32,
        workers: usize,
        token: Option<String>,
        restart_after: Option<Duration>,
        act: impl FnMut(Act) -> bool + 'a,
    ) -> Kill<'a> {
        assert!(workers >= 1 && timed_round >= 1);
        Kill {
            name: name.to_string(),
            timed_round,
            after_round: warmup + timed_round,
            workers,
            act: Box::new(act),
            token,
            restart_after,
            drain: false,
            restart_begun: None,
            restarted: None,
            restart_failed: false,
            full_seen: None,
            asked_full: None,
            done_at: BTreeMap::new(),
            reached: 0,
            highest: 0,
            sent: None,
            first_after: None,
            epoch_served: None,
            asked: None,
        }
    }

    /// Drains the appliance instead of killing it (`act(Act::Drain)`):
    /// the rounds from the drain on are watched as a restart's are.
    pub fn draining(mut self) -> Kill<'a> {
        self.drain = true;
        self
    }

    /// A worker reported round `round` completed (now), in `ms`.
    pub fn on_round(&mut self, round: u32, ms: f64) {
        let now = Instant::now();
        if let Some((_, before)) = self.sent {
            if self.first_after.is_none() && round > before {
                self.first_after = Some(now);
            }
        }
        self.highest = self.highest.max(round);
        // The last report of a round is its completion at every worker.
        let e = self.done_at.entry(round).or_insert((now, ms));
        *e = (now, e.1.max(ms));
        if self.sent.is_none() && round == self.after_round {
            self.reached += 1;
            assert!(
                self.reached <= self.workers,
                "a worker reported round {round} twice"
            );
            if self.reached == self.workers && self.drain {
                let asked = Instant::now();
                if (self.act)(Act::Drain) {
                    self.restart_begun = Some(asked);
                    self.restarted = Some(asked);
                } else {
                    self.restart_failed = true;
                }
                self.sent = Some((asked, self.highest));
                eprintln!(
                    "phub-bench: drained {} after round {} (timed round {}){}",
                    self.name,
                    self.after_round,
                    self.timed_round,
                    if self.restart_failed { ": refused" } else { "" }
                );
            } else if self.reached == self.workers {
                // From the SIGKILL, not from the reaping after it: a DPDK
                // dataplane takes tens of milliseconds to exit.
                let killed = Instant::now();
                (self.act)(Act::Kill);
                self.sent = Some((killed, self.highest));
                eprintln!(
                    "phub-bench: killed {} (SIGKILL) after round {} (timed round {})",
                    self.name, self.after_round, self.timed_round
                );
            }
        }
    }

    /// Whether the kill was sent and control has not yet been seen
    /// serving the next epoch, or a restart is due or its full strength
    /// not yet seen: [`Kill::poll`] is due.
    pub fn awaits_control(&self) -> bool {
        let restarting =
            (self.restart_after.is_some() || self.drain) && !self.restart_failed && self.full_seen.is_none();
        self.sent.is_some() && (self.epoch_served.is_none() || restarting)
    }

    /// After the kill: restarts the appliance once `restart_after` has
    /// passed; asks control for job `job`'s epoch, at most every 5 ms,
    /// noting when it first serves one beyond 0; after the restart, asks
    /// for the job every 20 ms, noting when it is first at full strength
    /// with the re-replication ended.
    pub fn poll(&mut self, control_url: &str, job: u16) {
        let Some((sent, _)) = self.sent else {
            return;
        };
        if let Some(after) = self.restart_after {
            if self.restarted.is_none() && !self.restart_failed && sent.elapsed() >= after {
                self.restart_begun = Some(Instant::now());
                if (self.act)(Act::Restart) {
                    self.restarted = Some(Instant::now());
                    eprintln!("phub-bench: started {} again, empty", self.name);
                } else {
                    self.restart_failed = true;
                }
            }
        }
        if self.restarted.is_some()
            && self.full_seen.is_none()
            && self
                .asked_full
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(20))
        {
            self.asked_full = Some(Instant::now());
            if let Ok(client) =
                local::control_client(control_url, self.token.as_deref(), Duration::from_secs(2))
            {
                if let Ok(d) = client.send(&control::job(job)) {
                    let full = d.replicas.is_some_and(|r| {
                        r.state == Strength::FullStrength
                            && r.rereplication.is_some_and(|x| x.ended_unix_ms.is_some())
                    });
                    if full {
                        self.full_seen = Some(Instant::now());
                    }
                }
            }
        }
        if self.epoch_served.is_some() || self.asked.is_some_and(|t| t.elapsed() < Duration::from_millis(5)) {
            return;
        }
        self.asked = Some(Instant::now());
        let Ok(client) = local::control_client(control_url, self.token.as_deref(), Duration::from_secs(2))
        else {
            return;
        };
        if let Ok(e) = client.send(&control::epoch(job)) {
            if e.epoch > 0 {
                self.epoch_served = Some(Instant::now());
            }
        }
    }

    /// The times (ms, the slowest worker's) of the rounds reported from
    /// the restart's start to the first reported after full strength was
    /// seen (to the end of the run if it never was). The coordinator's
    /// clock only places them: it does not time them (it is busy while it
    /// starts the appliance, and reports wait meanwhile).
    fn rounds_during(&self) -> Vec<f64> {
        let (Some(from), Some(_)) = (self.restart_begun, self.restarted) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for &(at, ms) in self.done_at.values() {
            if at >= from {
                out.push(ms);
                if self.full_seen.is_some_and(|f| at >= f) {
                    break;
                }
            }
        }
        out
    }

    /// The figures, once every worker is done: `last_round` is the
    /// workers' last round, `mismatched` the rounds some worker saw
    /// inexact; the survivors' rounds and the epoch come from control.
    pub fn figures(
        &self,
        control_url: &str,
        job: u16,
        last_round: u32,
        mismatched: &[u32],
    ) -> Result<FailoverFigures> {
        let (sent, _) = self.sent.ok_or_else(|| {
            anyhow::anyhow!(
                "the {} of {} was never sent: the workers never all completed round {}",
                if self.drain { "drain" } else { "kill" },
                self.name,
                self.after_round
            )
        })?;
        ensure!(
            !(self.drain && self.restart_failed),
            "control refused to drain {} (its log says why)",
            self.name
        );
        let client = local::control_client(control_url, self.token.as_deref(), Duration::from_secs(30))?;
        let detail: JobDetail = client
            .send(&control::job(job))
            .map_err(|e| anyhow::anyhow!("reading job {job} from control at the end: {e}"))?;
        let live: Vec<(u32, u32)> = detail
            .parts
            .iter()
            .filter(|p| p.appliance != self.name)
            .filter_map(|p| p.round_range)
            .collect();
        // A job of tables alone has no chunk rounds in control's view:
        // its rounds are not counted here (`phub-bench sparse --verify`
        // checks its rows instead).
        ensure!(
            !live.is_empty() || !detail.tables.is_empty(),
            "control reports no round of job {job} on the appliances other than {}",
            self.name
        );
        let range = (!live.is_empty()).then(|| {
            (
                live.iter().map(|r| r.0).min().unwrap_or(0),
                live.iter().map(|r| r.1).max().unwrap_or(0),
            )
        });
        let mut bad: Vec<u32> = mismatched.to_vec();
        bad.sort_unstable();
        bad.dedup();
        let copy = detail.replicas.as_ref().and_then(|r| r.rereplication.as_ref());
        let during = self.rounds_during();
        Ok(FailoverFigures {
            restart_after_ms: self.restart_after.map(|d| d.as_millis() as u64),
            restarted_ms: self
                .restarted
                .filter(|_| !self.drain)
                .map(|t| t.duration_since(sent).as_secs_f64() * 1e3),
            full_strength_ms: copy.and_then(|x| x.full_strength_ms()),
            full_strength_seen_ms: self
                .restarted
                .zip(self.full_seen)
                .map(|(r, f)| f.duration_since(r).as_secs_f64() * 1e3),
            rereplication_bytes: copy.and_then(|x| x.bytes_copied),
            longest_round_during_ms: during.iter().copied().reduce(f64::max),
            rounds_during: self.restarted.map(|_| during.len() as u32),
            replicas: Some(2),
            killed_appliance: (!self.drain).then(|| self.name.clone()),
            kill_at_round: (!self.drain).then_some(self.timed_round),
            drained_appliance: self.drain.then(|| self.name.clone()),
            drain_at_round: self.drain.then_some(self.timed_round),
            drain_ms: self
                .first_after
                .filter(|_| self.drain)
                .map(|t| t.duration_since(sent).as_secs_f64() * 1e3),
            failover_ms: self
                .first_after
                .filter(|_| !self.drain)
                .map(|t| t.duration_since(sent).as_secs_f64() * 1e3),
            epoch_served_ms: self
                .epoch_served
                .map(|t| t.duration_since(sent).as_secs_f64() * 1e3),
            rounds_repeated: range.map(|(_, hi)| hi.saturating_sub(last_round)),
            rounds_lost: range.map(|(lo, _)| bad.len() as u32 + last_round.saturating_sub(lo)),
            epoch_after: detail.epoch,
            survivors_round_range: range,
            verified_against: Some("computed"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(replicas: u32, name: &str, at: u32) -> FailoverArgs {
        FailoverArgs {
            replicas: Some(replicas),
            kill_appliance: Some(name.into()),
            kill_at_round: Some(at),
            ..FailoverArgs::default()
        }
    }

    #[test]
    fn kills_that_cannot_run_are_refused_naming_the_flag() {
        assert_eq!(check(&args(2, "rack2", 3), 3, 3, 10, false).unwrap(), Some(1));
        let e = |a: &FailoverArgs, n| check(a, n, n, 10, false).unwrap_err().to_string();
        assert!(e(&args(1, "rack2", 3), 3).contains("expected --replicas 2"));
        assert!(e(&args(3, "rack2", 3), 3).contains("rule 4"));
        assert!(e(&args(2, "rack4", 3), 3).contains("expected one of rack1, rack2, rack3"));
        assert!(e(&args(2, "rack2", 10), 3).contains("expected 1 to 9"));
        assert!(e(&args(2, "rack2", 0), 3).contains("expected 1 to 9"));
        assert!(e(&args(4, "rack2", 3), 3).contains("--replicas 4: expected 1 to 3"));
        // A comparison would run on the appliances left.
        assert!(check(&args(2, "rack2", 3), 3, 3, 10, true).is_err());
        // A drain needs a spare: a rack beyond the job's appliances.
        let drain = FailoverArgs {
            replicas: Some(2),
            drain_appliance: Some("rack2".into()),
            drain_at_round: Some(3),
            ..FailoverArgs::default()
        };
        assert_eq!(check(&drain, 3, 4, 10, false).unwrap(), Some(1));
        let e = check(&drain, 3, 3, 10, false).unwrap_err().to_string();
        assert!(e.contains("needs a spare") && e.contains("--racks 4"), "{e}");
        let e = check(
            &FailoverArgs {
                drain_at_round: Some(10),
                ..drain
            },
            3,
            4,
            10,
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--drain-at-round 10") && e.contains("expected 1 to 9"),
            "{e}"
        );
    }

    #[test]
    fn the_kill_comes_when_every_worker_has_the_round_and_times_the_next() {
        let mut killed = 0;
        let mut k = Kill::new("rack2", 2, 1, 2, None, None, |act| {
            assert_eq!(act, Act::Kill);
            killed += 1;
            true
        });
        // Rank 0's round 4 reaches the coordinator before rank 1's round 3.
        for r in [1, 1, 2, 2, 3, 4] {
            k.on_round(r, 1.0);
        }
        assert!(k.sent.is_none(), "round 3 is not yet complete at both workers");
        k.on_round(3, 1.0);
        let (_, highest) = k.sent.expect("sent");
        assert_eq!(highest, 4);
        k.on_round(4, 1.0);
        assert!(k.first_after.is_none(), "round 4 was completed before the kill");
        k.on_round(5, 1.0);
        assert!(k.first_after.is_some());
        drop(k);
        assert_eq!(killed, 1);
    }

    #[test]
    fn the_restart_comes_once_after_its_delay_and_the_rounds_until_full_strength_are_timed() {
        let mut acts = Vec::new();
        let mut k = Kill::new("rack2", 1, 0, 1, None, Some(Duration::ZERO), |act| {
            acts.push(act);
            true
        });
        assert!(!k.awaits_control());
        k.on_round(1, 5.0);
        assert!(k.awaits_control(), "after the kill: the epoch, the restart");
        // No control at this address: nothing is seen served, the restart runs once.
        k.poll("http://127.0.0.1:1", 1);
        k.poll("http://127.0.0.1:1", 1);
        let restarted = k.restarted.expect("restarted");
        assert!(k.awaits_control(), "full strength not seen yet");
        // Rounds 2 to 4 are reported after the restart; full strength is
        // seen after round 3: rounds 2, 3 and 4 (the first after it)
        // count, each at its slowest worker's time.
        let t = |ms: u64| restarted + Duration::from_millis(ms);
        k.done_at.insert(2, (t(10), 9.0));
        k.done_at.insert(3, (t(40), 30.0));
        k.full_seen = Some(t(45));
        k.done_at.insert(4, (t(50), 10.0));
        k.done_at.insert(5, (t(60), 10.0));
        assert_eq!(k.rounds_during(), [9.0, 30.0, 10.0]);
        assert!(k.awaits_control(), "the epoch was never seen served");
        k.epoch_served = Some(t(5));
        assert!(!k.awaits_control());
        drop(k);
        assert_eq!(acts, [Act::Kill, Act::Restart]);
    }
}
