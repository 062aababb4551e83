//! What control last heard from each appliance, for its read routes, and
//! how it tells one dataplane registered twice from two dataplanes.
//!
//! Reads (`GET /v1/jobs`, `/v1/stats`, `/metrics`, `/v1/appliances`, a
//! job's view) never wait on an appliance for long: each appliance has one
//! [`Watch`], with at most one request in flight to it at any time. A read
//! starts one if none is in flight and waits for its answer at most
//! [`READ_WAIT`]; when one is already in flight for longer than that (the
//! appliance accepts connections but does not answer, or is slow), the
//! read does not wait at all and shows the appliance as not answering for
//! so long, with the age of its last answer; nor is one whose last
//! request failed (the read gives that failure and its age). However many
//! readers there are, a hung appliance costs one blocked thread, not one
//! per reader.
//!
//! Identity: a dataplane says what it is in `GET /v1/info`, by a random id
//! it makes when it starts and by its data address; two appliances that
//! share either are one dataplane ([`alias_of`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use phub_proto::api::{DataplaneInfo, DataplaneStats};

use crate::dataplane::Client;

/// Longest a read waits for an appliance's answer.
pub(crate) const READ_WAIT: Duration = Duration::from_millis(300);

/// An appliance's answer: its description and its counters (which list
/// the jobs it holds).
#[derive(Debug, Clone)]
pub(crate) struct View {
    /// `GET /v1/info`.
    pub(crate) info: DataplaneInfo,
    /// `GET /v1/stats`.
    pub(crate) stats: DataplaneStats,
}

#[derive(Debug, Default)]
struct State {
    /// When the request in flight was sent, if one is.
    asking_since: Option<Instant>,
    /// The last request's outcome, and when it came.
    last: Option<(Instant, Result<View, String>)>,
    /// When the appliance last answered.
    answered: Option<Instant>,
    /// Bumped by every outcome.
    generation: u64,
}

/// One appliance's requests for views: at most one in flight.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    state: Mutex<State>,
    done: Condvar,
}

impl Watch {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends the appliance a request unless one is in flight.
    pub(crate) fn kick(self: &Arc<Self>, client: &Client) -> Result<(), String> {
        self.ask_unless_asking(&mut self.lock(), client).map(drop)
    }

    /// Sends the appliance a request (on a thread of its own) unless one
    /// is in flight, with `st` locked: when the one in flight was sent.
    fn ask_unless_asking(self: &Arc<Self>, st: &mut State, client: &Client) -> Result<Instant, String> {
        if let Some(since) = st.asking_since {
            return Ok(since);
        }
        let (me, c) = (Arc::clone(self), client.clone());
        std::thread::Builder::new()
            .name("control-watch".into())
            .spawn(move || me.ask(&c))
            .map_err(|e| format!("cannot start a thread to ask appliance {}: {e}", client.base()))?;
        let now = Instant::now();
        st.asking_since = Some(now);
        Ok(now)
    }

    /// The appliance's view now: a fresh answer if one comes within
    /// `wait` (not waited for when a request has been in flight longer
    /// than that already), else why not, with the age of the last answer.
    pub(crate) fn look(self: &Arc<Self>, client: &Client, wait: Duration) -> Result<View, String> {
        let mut st = self.lock();
        // Sent by this call or by another: its outcome is the next one.
        let since = self.ask_unless_asking(&mut st, client)?;
        // An appliance whose last request failed is not waited for: the
        // read says why, and the request in flight tells the next read
        // whether it is back.
        if let Some((at, Err(e))) = &st.last {
            return Err(format!("{e} ({:.1} s ago)", at.elapsed().as_secs_f64()));
        }
        let seen = st.generation;
        let deadline = since + wait;
        while st.generation == seen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let last = st.answered.map_or_else(
                    || "it has not answered since control started".to_string(),
                    |t| format!("its last answer came {:.1} s ago", t.elapsed().as_secs_f64()),
                );
                return Err(format!(
                    "the dataplane at {} has not answered for {:.1} s (reads wait at most {} ms for an \
                     appliance); {last}",
                    client.base(),
                    since.elapsed().as_secs_f64(),
                    wait.as_millis()
                ));
            }
            st = self
                .done
                .wait_timeout(st, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        st.last
            .as_ref()
            .map_or_else(|| Err("no answer yet".into()), |(_, r)| r.clone())
    }

    /// When the appliance last answered a request of this watch, or one
    /// recorded by [`Watch::heard`]: the heartbeat thread counts it as an
    /// answer to a heartbeat (PROTOCOL.md §11.6).
    pub(crate) fn answered(&self) -> Option<Instant> {
        self.lock().answered
    }

    /// The appliance answered another of control's requests at `at` (an
    /// admission's `GET /v1/info` sent to it by name).
    pub(crate) fn heard(&self, at: Instant) {
        let mut st = self.lock();
        st.answered = st.answered.max(Some(at));
    }

    /// Asks the appliance (on its own thread) and records the outcome.
    fn ask(&self, client: &Client) {
        let r = client
            .info()
            .and_then(|info| {
                Ok(View {
                    info,
                    stats: client.stats()?,
                })
            })
            .map_err(|e| e.to_string());
        let mut st = self.lock();
        let now = Instant::now();
        if r.is_ok() {
            st.answered = Some(now);
        }
        st.last = Some((now, r));
        st.asking_since = None;
        st.generation += 1;
        drop(st);
        self.done.notify_all();
    }
}

/// Why two descriptions are one dataplane: the same id, or the same data
/// address. `None` when they are two.
pub(crate) fn same_dataplane(a: &DataplaneInfo, b: &DataplaneInfo) -> Option<String> {
    if !a.id.is_empty() && a.id == b.id {
        return Some(format!("the same dataplane id {}", a.id));
    }
    if a.data.host == b.data.host && a.data.base_port == b.data.base_port {
        return Some(format!(
            "the same data address {}:{}",
            a.data.host, a.data.base_port
        ));
    }
    None
}

/// The appliances of `seen` (name, whether admitted jobs have parts on
/// it, its description) that are aliases of another: for each, the other
/// name and why. Of a group of names for one dataplane, the one that holds
/// jobs is kept (the first by name when none does) and the others are
/// aliases; when several hold jobs, all of them are (none can be trusted
/// to reconcile the others' jobs away).
pub(crate) fn alias_of(seen: &[(String, bool, DataplaneInfo)]) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (i, (name, _, info)) in seen.iter().enumerate() {
        let group: Vec<(usize, String)> = seen
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(j, (_, _, other))| Some((j, same_dataplane(info, other)?)))
            .collect();
        let Some((first, why)) = group.first() else {
            continue;
        };
        let owners: Vec<usize> = std::iter::once(i)
            .chain(group.iter().map(|(j, _)| *j))
            .filter(|&k| seen[k].1)
            .collect();
        let keeper = match owners.as_slice() {
            [one] => Some(*one),
            [] => std::iter::once(i)
                .chain(group.iter().map(|(j, _)| *j))
                .min_by(|&a, &b| seen[a].0.cmp(&seen[b].0)),
            _ => None,
        };
        if keeper == Some(i) {
            continue;
        }
        let other = keeper.unwrap_or(*first);
        let why = if keeper.is_some() {
            why.clone()
        } else {
            format!("{why}, and both hold jobs")
        };
        out.push((name.clone(), seen[other].0.clone(), why));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use phub_proto::api::DataAddr;

    fn info(id: &str, port: u16) -> DataplaneInfo {
        DataplaneInfo {
            id: id.into(),
            backend: phub_proto::api::BackendKind::Udp,
            data: DataAddr {
                host: "127.0.0.1".into(),
                base_port: port,
            },
            lcores: Vec::new(),
            nic_numa_node: None,
            memory_budget_bytes: 0,
            memory_used_bytes: 0,
            memory_model: Default::default(),
            slot_memory: String::new(),
            kernels: String::new(),
            shm: false,
            version: String::new(),
        }
    }

    #[test]
    fn an_alias_is_the_name_without_jobs() {
        let two = |a_jobs, b_jobs| {
            alias_of(&[
                ("a".into(), a_jobs, info("x", 9000)),
                ("b".into(), b_jobs, info("x", 9000)),
                ("c".into(), true, info("y", 9100)),
            ])
        };
        let names = |v: Vec<(String, String, String)>| -> Vec<(String, String)> {
            v.into_iter().map(|(a, b, _)| (a, b)).collect()
        };
        assert_eq!(names(two(true, false)), [("b".into(), "a".into())]);
        assert_eq!(names(two(false, true)), [("a".into(), "b".into())]);
        assert_eq!(names(two(false, false)), [("b".into(), "a".into())]);
        let both = two(true, true);
        assert_eq!(both.len(), 2, "{both:?}");
        assert!(both[0].2.contains("both hold jobs"), "{both:?}");
        // One id, or one data address, is one dataplane.
        assert!(same_dataplane(&info("x", 1), &info("x", 2)).is_some());
        assert!(same_dataplane(&info("x", 1), &info("y", 1)).is_some());
        assert!(same_dataplane(&info("x", 1), &info("y", 2)).is_none());
        assert!(same_dataplane(&info("", 1), &info("", 2)).is_none());
    }
}
