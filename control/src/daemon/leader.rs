//! Several phub-controls on one etcd prefix, one leader.
//!
//! The leader holds the key `PREFIX/leader` (its advertised URL), created
//! in a transaction that requires it absent and bound to a lease of
//! [`Leadership::ttl`] (`--lease-ttl`, 2 s by default), which a thread
//! renews every quarter of the TTL. The leader alone writes (every write
//! also compares the leader key: fencing, `state::etcd`), reconciles the
//! appliances and takes checkpoints. A follower campaigns on the same
//! tick and, losing, asks etcd whether anything under the prefix changed
//! since it last read it (one small read: `EtcdStore::changed_since_load`),
//! reloading the state only then, and looks at the checkpoint files,
//! reading only those that changed (its reads are at most one tick old);
//! it turns every write away with `503` naming the leader (`X-Phub-Leader:
//! URL` and the message); see `http`.
//!
//! While etcd does not serve the election (out of reach, no quorum), a
//! follower knows no leader, and its `503` says why, naming etcd and its
//! error.
//!
//! A leader steps down at once when etcd says its lease is gone (a
//! renewal answered without a TTL), when a fenced write fails, or when it
//! could not renew for a whole TTL; it then follows. On winning, a control
//! reloads the whole state before it serves a write, and records the
//! appliances given on its command line. With the state in a file there is
//! no election: the one control always acts.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use phub_proto::api::ApplianceSpec;

use super::checkpoints::{load_checkpoints, Checkpoints};
use super::http::RequestError;
use super::registry::{Appliance, Entry, Shared};
use crate::state::etcd::Campaign;
use crate::state::{StateError, StoredJob};

/// This control's part in the election.
#[derive(Debug)]
pub(super) struct Leadership {
    /// The URL other controls and clients are told to send writes to
    /// (`--advertise-url`; default: the address the API is bound to).
    pub(super) me: OnceLock<String>,
    /// The lease's time to live.
    pub(super) ttl: Duration,
    /// The appliances given at start, which join those stored.
    pub(super) given: Vec<ApplianceSpec>,
    /// What the election thread last saw.
    seen: Mutex<Seen>,
}

/// What the election thread last saw.
#[derive(Debug)]
struct Seen {
    /// The leader's URL, when another leads.
    leader: Option<String>,
    /// When the lease was last renewed (while leading).
    renewed: Instant,
    /// The last error logged, so that a failing etcd is logged once.
    error: Option<String>,
}

impl Leadership {
    pub(super) fn new(ttl: Duration, given: Vec<ApplianceSpec>) -> Leadership {
        Leadership {
            me: OnceLock::new(),
            ttl,
            given,
            seen: Mutex::new(Seen {
                leader: None,
                renewed: Instant::now(),
                error: None,
            }),
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How often the election thread runs: a quarter of the TTL.
    pub(super) fn tick(&self) -> Duration {
        self.ttl / 4
    }
}

/// The appliances stored (`recorded`) with those `given` at start: one
/// given replaces the stored one of its name.
pub(super) fn merged(recorded: &[ApplianceSpec], given: &[ApplianceSpec]) -> BTreeMap<String, ApplianceSpec> {
    let mut specs: BTreeMap<String, ApplianceSpec> =
        recorded.iter().map(|a| (a.name.clone(), a.clone())).collect();
    for a in given {
        // Drained stays drained: control sets it, no command line does.
        let mut a = a.clone();
        a.draining |= specs.get(&a.name).is_some_and(|old| old.draining);
        let a = &a;
        if let Some(old) = specs.get(&a.name).filter(|old| *old != a) {
            log::warn!(
                "appliance {:?}: the state has it at {} (rack {:?}); now at {} (rack {:?})",
                a.name,
                old.url,
                old.rack,
                a.url,
                a.rack
            );
        }
        specs.insert(a.name.clone(), a.clone());
    }
    specs
}

impl Shared {
    /// Whether this control acts: the state is in a file, or it leads.
    pub(super) fn acts(&self) -> bool {
        self.store.etcd().is_none_or(|e| e.leads())
    }

    /// A write may go on here: this control acts, or `503` naming the
    /// leader.
    pub(super) fn check_leader(&self) -> Result<(), RequestError> {
        if self.acts() {
            return Ok(());
        }
        let (leader, error) = {
            let seen = self.lead.seen();
            (seen.leader.clone(), seen.error.clone())
        };
        let me = self.lead.me.get().map_or("", String::as_str);
        let message = match (&leader, error) {
            (Some(l), _) => {
                format!("this phub-control ({me}) is a follower; send writes to the leader at {l}")
            }
            (None, Some(e)) => format!(
                "this phub-control ({me}) is a follower and no control can lead while etcd does not serve \
                 the election: {e}"
            ),
            (None, None) => format!(
                "this phub-control ({me}) is a follower and no control leads now; try again within {} s",
                self.lead.ttl.as_secs()
            ),
        };
        Err(RequestError::NotLeader { message, leader })
    }

    /// One tick of the election (state in etcd only): a leader renews its
    /// lease, a follower campaigns and, losing, reloads the state.
    pub(super) fn elect(&self) {
        let Some(etcd) = self.store.etcd() else {
            return;
        };
        let me = self.lead.me.get().cloned().unwrap_or_default();
        if etcd.leads() {
            match etcd.renew() {
                Ok(true) => {
                    let mut seen = self.lead.seen();
                    seen.renewed = Instant::now();
                    seen.error = None;
                }
                Ok(false) => log::warn!("{me}: etcd says the leader lease is gone; following"),
                Err(e) => {
                    let late = self.lead.seen().renewed.elapsed();
                    if late > self.lead.ttl {
                        etcd.drop_lead();
                        log::warn!(
                            "{me}: could not renew the leader lease for {late:?} (over its {:?} TTL): {e}; following",
                            self.lead.ttl
                        );
                    } else {
                        self.log_once(format!("cannot renew the leader lease: {e}"));
                    }
                }
            }
            return;
        }
        match etcd.campaign(&me, self.lead.ttl) {
            Ok(Campaign::Won) => {
                {
                    let mut seen = self.lead.seen();
                    seen.renewed = Instant::now();
                    seen.error = None;
                }
                match self.take_over() {
                    Ok(()) => {
                        self.lead.seen().leader = None;
                        log::info!("{me} leads {}", etcd.target().url());
                    }
                    Err(e) => {
                        etcd.resign();
                        log::error!("{me} won the election but cannot load the state: {e}; resigned");
                    }
                }
            }
            Ok(Campaign::Lost(leader)) => {
                let changed = {
                    let mut seen = self.lead.seen();
                    let changed = seen.leader != leader;
                    seen.leader = leader.clone();
                    seen.error = None;
                    changed
                };
                if changed {
                    log::info!("{me} follows {}", leader.as_deref().unwrap_or("(no leader)"));
                }
                // The whole state only when etcd's changed; else the
                // checkpoint files (not in etcd), each read only when it
                // changed.
                match etcd.changed_since_load() {
                    Ok(false) => self.refresh_checkpoints(),
                    _ => {
                        if let Err(e) = self.reload() {
                            self.log_once(format!("cannot reload the state: {e}"));
                        }
                    }
                }
            }
            Err(e) => {
                // Who leads is not known while etcd does not answer.
                self.lead.seen().leader = None;
                self.log_once(format!("cannot campaign for the leader key: {e}"));
            }
        }
    }

    fn log_once(&self, message: String) {
        let mut seen = self.lead.seen();
        if seen.error.as_ref() != Some(&message) {
            log::warn!("{message}");
            seen.error = Some(message);
        }
    }

    /// Reloads the state, then records the appliances given at start
    /// that it lacks or holds otherwise.
    fn take_over(&self) -> Result<(), StateError> {
        let stored = self.reload()?;
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        for a in &self.lead.given {
            if stored.get(&a.name) != Some(a) {
                self.commit(&mut inner, Entry::Appliance(&a.name), |_| ())?;
            }
        }
        Ok(())
    }

    /// Finds the checkpoint files of the jobs held again, reading those
    /// that changed (a follower's: the leader writes them).
    fn refresh_checkpoints(&self) {
        let jobs = self.lock().jobs.clone();
        let checkpoints = self.checkpoints_of(&jobs);
        self.lock().checkpoints = checkpoints;
    }

    /// The checkpoint files of `jobs` beside the state, each read only
    /// when it changed since the last look ([`load_checkpoints`]).
    fn checkpoints_of(&self, jobs: &BTreeMap<u16, StoredJob>) -> Checkpoints {
        let mut files = self.checkpoint_files.lock().unwrap_or_else(|p| p.into_inner());
        load_checkpoints(&self.state_path, jobs, &mut files)
    }

    /// Replaces the appliances and jobs held with what is stored (the
    /// appliances given at start joining them); an appliance whose spec
    /// did not change keeps its client and last description. Returns the
    /// stored appliances.
    pub(super) fn reload(&self) -> Result<BTreeMap<String, ApplianceSpec>, StateError> {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let loaded = self.store.load()?.unwrap_or_default();
        let recorded = loaded.appliances.unwrap_or_default();
        let specs = merged(&recorded, &self.lead.given);
        let jobs: BTreeMap<u16, StoredJob> = loaded.jobs.into_iter().map(|j| (j.id, j)).collect();
        let checkpoints = self.checkpoints_of(&jobs);
        let mut inner = self.lock();
        let mut old = std::mem::take(&mut inner.appliances);
        inner.appliances = specs
            .into_values()
            .map(|spec| {
                let kept = old.remove(&spec.name).filter(|a| a.spec == spec);
                (spec.name.clone(), kept.unwrap_or_else(|| Appliance::new(spec)))
            })
            .collect();
        inner.jobs = jobs;
        inner.checkpoints = checkpoints;
        Ok(recorded.into_iter().map(|a| (a.name.clone(), a)).collect())
    }

    /// Gives the leader key up, if held (at shutdown: a follower takes
    /// over at once rather than after the TTL).
    pub(super) fn resign(&self) {
        if let Some(e) = self.store.etcd() {
            e.resign();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, url: &str, draining: bool) -> ApplianceSpec {
        ApplianceSpec {
            name: name.into(),
            url: url.into(),
            rack: String::new(),
            token_file: None,
            draining,
        }
    }

    /// The command line's appliances replace the recorded ones, but a
    /// drained appliance stays drained (no command line sets the flag).
    #[test]
    fn given_appliances_replace_the_recorded_ones_keeping_drained() {
        let recorded = [spec("a", "http://a:1", true), spec("b", "http://b:1", false)];
        let given = [spec("a", "http://a:2", false), spec("c", "http://c:1", false)];
        let m = merged(&recorded, &given);
        assert_eq!(m["a"], spec("a", "http://a:2", true));
        assert_eq!(m["b"], spec("b", "http://b:1", false));
        assert_eq!(m["c"], spec("c", "http://c:1", false));
    }
}
