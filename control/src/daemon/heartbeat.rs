//! Heartbeats (PROTOCOL.md §11.6, detection): every interval, control
//! asks every appliance `GET /v1/info` on its management API (answered
//! without touching the dataplane's jobs); one whose dataplane answers
//! with a new identity restarted within the deadline, and reconciliation
//! runs at once ([`Shared::reconcile_soon`]); an appliance that has left a
//! heartbeat unanswered for the deadline (from the first one sent since
//! its last answer) is **declared down**: logged, shown in its
//! status (`phubctl appliance list`), counted in `/metrics`, and each
//! replicated job on it fails over ([`Shared::fail_over`]).
//!
//! The heartbeat thread never waits on an appliance: each heartbeat runs
//! in a short-lived thread of its own, bounded by the deadline, and at
//! most one per appliance is in flight; answers come back over a channel
//! and the thread judges at each tick. Nothing else (installs,
//! checkpoints, reconciliation, which hold [`Shared::ops`]) holds it up:
//! it takes only the registry's lock, briefly (but that may wait on a
//! state file's fsync, and a loaded host may not run the thread at once:
//! a wait in which it sent nothing is not counted against an appliance).
//! An appliance is declared down at most once per silence, within the
//! deadline and one interval of the first heartbeat it left unanswered; one that answers again is logged and shown up again,
//! and each replicated job that failed over without it is given back to
//! it ([`Shared::rereplicate`], PROTOCOL.md §11.7).

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::config::Heartbeat;
use super::registry::Shared;
use crate::dataplane::Client;
#[cfg(doc)]
use crate::state::StoredJob;
use crate::watch::Watch;

/// What control knows of an appliance's heartbeats, as its status and
/// metrics show it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Liveness {
    /// Set while it is declared down: why (how long it had not
    /// answered).
    pub(super) down: Option<String>,
    /// Times it was declared down since control started.
    pub(super) declarations: u64,
}

/// The heartbeat thread's view of one appliance.
#[derive(Debug)]
struct Pulse {
    /// Its last answer, or when the thread first saw it.
    last: Instant,
    /// The dataplane's identity in its last answer that gave one (a
    /// restart makes a new one).
    id: Option<String>,
    /// A heartbeat to it is in flight.
    in_flight: bool,
    /// Declared down, and not heard from since.
    declared: bool,
    /// When it was last declared down: an answer to a heartbeat sent
    /// before that says nothing of it now.
    declared_at: Option<Instant>,
    /// When the first heartbeat since its last answer was sent (`None`:
    /// every heartbeat sent was answered). Its silence counts from then,
    /// not from its last answer: while this thread itself waits (for the
    /// registry's lock behind a state file's fsync, or for a core) it
    /// sends nothing, and a wait past the deadline is no silence of the
    /// appliance's.
    asked: Option<Instant>,
}

impl Pulse {
    /// Takes an answer to a heartbeat sent at `sent`, taken at `at`: the
    /// appliance's last answer, unless the heartbeat was sent before it
    /// was last declared down (no news of it since: `false`).
    fn take_answer(&mut self, sent: Instant, at: Instant) -> bool {
        if self.declared_at.is_some_and(|d| sent < d) {
            return false;
        }
        self.last = self.last.max(at);
        if self.asked.is_some_and(|a| a <= sent) {
            self.asked = None;
        }
        true
    }

    /// It answered another of control's requests at `at` (a read's or an
    /// admission's `GET /v1/info`, [`Watch::answered`]): an answer, unless
    /// it is declared down (that request may have been sent before the
    /// declaration; only a heartbeat's answer, or an admission that clears
    /// [`Liveness::down`], brings it back).
    fn heard(&mut self, at: Option<Instant>) {
        if let (false, Some(at)) = (self.declared, at) {
            self.last = self.last.max(at);
        }
    }

    /// A heartbeat is sent to it at `at`.
    fn ask(&mut self, at: Instant) {
        self.asked.get_or_insert(at);
    }

    /// How long it has left a heartbeat unanswered at `now`: since the
    /// first one sent after its last answer (or since the answer, were it
    /// later: another request's, [`Shared::heartbeats`]).
    fn silent(&self, now: Instant) -> Duration {
        self.asked.map_or(Duration::ZERO, |a| {
            now.saturating_duration_since(self.last.max(a))
        })
    }
}

/// A heartbeat's outcome: the appliance, and, when it answered, when the
/// heartbeat was sent and when its answer was taken, with the dataplane's
/// identity if it gave one (`None`: no answer within the deadline). An
/// answer to a heartbeat sent before the appliance was declared down says
/// nothing of it now (on a loaded host the thread that took it may run
/// long after, past the appliance's death and declaration): it is not
/// taken for an appliance answering again.
type Answer = (String, Option<(Instant, Instant, Option<String>)>);

impl Shared {
    /// The heartbeat thread's loop, until `stop` is dropped (or sent to).
    pub(super) fn heartbeats(self: &Arc<Self>, timing: Heartbeat, stop: &mpsc::Receiver<()>) {
        debug_assert!(timing.check().is_ok(), "the daemon checks the timing at start");
        self.resume_rereplications(timing.interval);
        let (tx, rx) = mpsc::channel::<Answer>();
        let mut pulses: BTreeMap<String, Pulse> = BTreeMap::new();
        loop {
            let tick = Instant::now();
            while let Ok((name, answered)) = rx.try_recv() {
                if let Some(p) = pulses.get_mut(&name) {
                    p.in_flight = false;
                    if let Some((sent, at, id)) = answered {
                        if !p.take_answer(sent, at) {
                            continue;
                        }
                        if let Some(id) = id {
                            if p.id.as_ref().is_some_and(|old| *old != id) {
                                self.restarted_unnoticed(&name);
                            }
                            p.id = Some(id);
                        }
                    }
                }
            }
            let watched: Vec<(String, Client, Arc<Watch>)> = self.lock().watched();
            pulses.retain(|n, _| watched.iter().any(|(c, ..)| c == n));
            for (name, client, _) in &watched {
                let (name, client) = (name.clone(), client.clone());
                let p = pulses.entry(name.clone()).or_insert(Pulse {
                    last: tick,
                    id: None,
                    in_flight: false,
                    declared: false,
                    declared_at: None,
                    asked: None,
                });
                if p.in_flight {
                    continue;
                }
                let tx = tx.clone();
                let limit = timing.deadline;
                let spawned = std::thread::Builder::new()
                    .name("control-beat".into())
                    .spawn(move || {
                        let sent = Instant::now();
                        let answered = client.heartbeat(limit).ok().map(|id| (sent, Instant::now(), id));
                        let _ = tx.send((name, answered));
                    });
                // A thread that cannot start is a heartbeat unanswered.
                p.in_flight = spawned.is_ok();
                p.ask(Instant::now());
            }
            let now = Instant::now();
            for (name, p) in &mut pulses {
                // Its answers to other requests count too: an appliance
                // that answered an admission is not declared down for
                // heartbeats sent before it listened (control started
                // first) that a loaded host's thread did not follow up.
                if let Some((.., w)) = watched.iter().find(|(n, ..)| n == name) {
                    p.heard(w.answered());
                }
                // Declared down, but found answering by another request
                // since (an admission that named it): an answer.
                if p.declared
                    && self
                        .lock()
                        .appliances
                        .get(name)
                        .is_some_and(|a| a.liveness.down.is_none())
                {
                    p.last = p.last.max(now);
                }
                let silent = p.silent(now);
                match (p.declared, silent >= timing.deadline) {
                    (false, true) => {
                        p.declared = true;
                        p.declared_at = Some(now);
                        self.declare_down(name, silent, timing);
                    }
                    (true, false) => {
                        p.declared = false;
                        self.answers_again(name, timing);
                    }
                    // Still down: a replicated job admitted on it since
                    // the declaration (it answered for its description,
                    // not yet a heartbeat), or one whose epoch could not
                    // be recorded then, fails over now; by the control
                    // that acts (a follower's writes would fail each tick).
                    (true, true) if self.acts() && self.owes_failover(name) => {
                        self.fail_over_in_thread(name, timing);
                    }
                    _ => {}
                }
            }
            let next = tick + timing.interval;
            match stop.recv_timeout(next.saturating_duration_since(Instant::now())) {
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
        }
    }

    /// Appliance `name`'s dataplane answered with another identity than
    /// before: it restarted between two heartbeats, within the deadline,
    /// and holds none of its jobs. Reconciliation runs now rather than at
    /// its next interval, so that a replicated job fails over without it
    /// (and is given back to it) at once, and other jobs are reinstalled.
    fn restarted_unnoticed(&self, name: &str) {
        log::warn!("appliance {name:?} restarted (its dataplane answers a heartbeat with a new identity): reconciling now");
        self.reconcile_soon();
    }

    /// Wakes the reconcile thread for a pass now (none while the daemon
    /// stops).
    pub(super) fn reconcile_soon(&self) {
        if let Some(tx) = self
            .reconcile_poke
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            let _ = tx.send(());
        }
    }

    /// Declares appliance `name` down, `silent` after its last answer:
    /// logged, recorded in its [`Liveness`], and its replicated jobs fail
    /// over in a thread of their own.
    fn declare_down(self: &Arc<Self>, name: &str, silent: Duration, timing: Heartbeat) {
        let why = format!(
            "declared down: no answer to a heartbeat for {} ms (deadline {} ms)",
            silent.as_millis(),
            timing.deadline.as_millis()
        );
        {
            let mut inner = self.lock();
            let Some(a) = inner.appliances.get_mut(name) else {
                return;
            };
            a.liveness.down = Some(why.clone());
            a.liveness.declarations += 1;
            log::error!("appliance {name:?} at {}: {why}", a.spec.url);
        }
        let shared = self.clone();
        let name = name.to_string();
        let declarations = self
            .lock()
            .appliances
            .get(&name)
            .map_or(0, |a| a.liveness.declarations);
        let started = std::thread::Builder::new()
            .name("control-failover".into())
            .spawn(move || {
                shared.fail_over(&name, timing.interval);
                if let Some(after) = timing.spare_after {
                    // Still down, from this declaration on: spares.
                    std::thread::sleep(after);
                    let still = shared.lock().appliances.get(&name).is_some_and(|a| {
                        a.liveness.down.is_some() && a.liveness.declarations == declarations
                    });
                    if still {
                        shared.move_to_spares(&name);
                    }
                }
            });
        if let Err(e) = started {
            log::error!("cannot start the failover thread: {e}; its jobs do not fail over");
        }
    }

    /// Whether appliance `name`, declared down, has a replicated job that
    /// has not failed over without it ([`StoredJob::decide`] would move
    /// it on).
    fn owes_failover(&self, name: &str) -> bool {
        let inner = self.lock();
        inner
            .jobs_on(name)
            .iter()
            .filter_map(|id| inner.jobs.get(id))
            .any(|j| j.decide(name, |n| inner.rack_of(n)).is_some())
    }

    /// Its jobs fail over without appliance `name` ([`Shared::fail_over`]),
    /// in a thread of their own.
    fn fail_over_in_thread(self: &Arc<Self>, name: &str, timing: Heartbeat) {
        let (shared, name) = (self.clone(), name.to_string());
        let started = std::thread::Builder::new()
            .name("control-failover".into())
            .spawn(move || shared.fail_over(&name, timing.interval));
        if let Err(e) = started {
            log::error!("cannot start the failover thread: {e}; its jobs fail over at the next tick");
        }
    }

    /// Appliance `name`, declared down, answers a heartbeat again: shown
    /// up, and the jobs that failed over without it re-replicate to it in
    /// a thread of their own.
    fn answers_again(self: &Arc<Self>, name: &str, timing: Heartbeat) {
        let fenced = {
            let mut inner = self.lock();
            let fenced = inner.fenced_jobs_on(name);
            let Some(a) = inner.appliances.get_mut(name) else {
                return;
            };
            a.liveness.down = None;
            if fenced.is_empty() {
                log::info!("appliance {name:?} at {} answers heartbeats again", a.spec.url);
            } else {
                let ids: Vec<String> = fenced.iter().map(u16::to_string).collect();
                log::warn!(
                    "appliance {name:?} at {} answers heartbeats again; jobs {}, which failed over without it, \
                     re-replicate to it",
                    a.spec.url,
                    ids.join(", ")
                );
            }
            fenced
        };
        if fenced.is_empty() {
            return;
        }
        self.rereplicate_in_thread(name, timing.interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An appliance the thread first saw at `t`, not declared down.
    fn heard_of_at(t: Instant) -> Pulse {
        Pulse {
            last: t,
            id: None,
            in_flight: false,
            declared: false,
            declared_at: None,
            asked: None,
        }
    }

    /// An answer to a heartbeat sent before the declaration, taken after
    /// it (its thread ran late on a loaded host), does not bring a dead
    /// appliance back; one sent after it does.
    #[test]
    fn an_answer_sent_before_the_declaration_is_no_news() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut p = Pulse {
            declared: true,
            declared_at: Some(at(600)),
            ..heard_of_at(at(0))
        };
        assert!(!p.take_answer(at(50), at(700)));
        assert_eq!(p.last, at(0));
        assert!(p.take_answer(at(650), at(660)));
        assert_eq!(p.last, at(660));
        // Never declared: every answer counts.
        p.declared_at = None;
        assert!(p.take_answer(at(10), at(900)));
        assert_eq!(p.last, at(900));
    }

    /// Silence counts from the first heartbeat sent since the last
    /// answer: a heartbeat thread that sent nothing for 700 ms (it waited
    /// for the registry's lock, or a core) does not find an appliance
    /// that answered every heartbeat silent past a 500 ms deadline; one
    /// that leaves the next heartbeat unanswered is, 500 ms after it.
    #[test]
    fn a_wait_of_the_heartbeat_thread_is_no_silence() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let ms = Duration::from_millis;
        let mut p = heard_of_at(at(0));
        p.ask(at(0));
        assert!(p.take_answer(at(0), at(1)));
        // The thread stalls, then asks again at 700.
        assert_eq!(p.silent(at(700)), ms(0));
        p.ask(at(700));
        assert_eq!(p.silent(at(700)), ms(0));
        assert_eq!(p.silent(at(1100)), ms(400));
        // Asked again while the first is unanswered: still from 700.
        p.ask(at(800));
        assert_eq!(p.silent(at(1200)), ms(500));
        // Answered (the heartbeat of 800): silent no more.
        assert!(p.take_answer(at(800), at(1210)));
        assert_eq!(p.silent(at(1300)), ms(0));
        // Heard from another request after the ask: from then.
        p.ask(at(1300));
        p.last = at(1400);
        assert_eq!(p.silent(at(1500)), ms(100));
    }

    /// Control started first: its first heartbeat (at 0) went out before
    /// the appliance listened and failed, and the heartbeat thread, on a
    /// loaded host, did not run again for 600 ms. The appliance answered
    /// an admission at 450: it is silent from then, not from 0, and not
    /// declared down at 600 (500 ms deadline). An appliance declared down
    /// is not brought back by another request's answer.
    #[test]
    fn an_answer_to_another_request_ends_a_silence() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let ms = Duration::from_millis;
        let mut p = heard_of_at(at(0));
        p.ask(at(0));
        assert_eq!(p.silent(at(600)), ms(600));
        p.heard(None);
        assert_eq!(p.silent(at(600)), ms(600));
        p.heard(Some(at(450)));
        assert_eq!(p.silent(at(600)), ms(150));
        // An older answer moves nothing back.
        p.heard(Some(at(300)));
        assert_eq!(p.silent(at(600)), ms(150));
        // Silent from 450 if nothing else answers.
        assert_eq!(p.silent(at(950)), ms(500));
        p.declared = true;
        p.declared_at = Some(at(950));
        p.heard(Some(at(1000)));
        assert_eq!(p.silent(at(1100)), ms(650));
    }
}
