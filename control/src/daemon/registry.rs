//! What the daemon holds: the appliances it manages and the jobs it
//! admitted ([`Inner`], behind one mutex never held across an HTTP call to
//! a dataplane), the lock that serialises every change to the dataplanes'
//! sets of jobs ([`Shared::ops`]), the state file they are saved to, and
//! the appliances' descriptions as control last heard them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use phub_proto::api::{ApplianceSpec, DataAddr, DataplaneInfo};
use phub_proto::layout::Layout;
use phub_proto::spec::JobSpec;

use super::checkpoints::{CheckpointFiles, Checkpoints};
use super::config::token_path_of;
use super::heartbeat::Liveness;
use super::http::{failed, held, RequestError};
use super::leader::Leadership;
use crate::admission;
use crate::dataplane::Client;
use crate::state::store::{Change, Store};
use crate::state::{StateError, StoredJob};
use crate::watch::{View, Watch, READ_WAIT};

/// One appliance control manages.
#[derive(Debug, Clone)]
pub(super) struct Appliance {
    /// As given and recorded.
    pub(super) spec: ApplianceSpec,
    /// Its management client.
    pub(super) client: Client,
    /// Its last answer to `GET /v1/info`.
    pub(super) info: Option<DataplaneInfo>,
    /// The requests of the read routes to it ([`watch`](crate::watch)).
    pub(super) watch: Arc<Watch>,
    /// Set when reconciliation found it to be another appliance's
    /// dataplane under a second name: which, and why; it is then neither
    /// reconciled nor chosen for a job ([`watch::alias_of`](crate::watch::alias_of)).
    pub(super) alias: Option<String>,
    /// Its heartbeats: whether it is declared down ([`Liveness`]).
    pub(super) liveness: Liveness,
}

impl Appliance {
    pub(super) fn new(spec: ApplianceSpec) -> Appliance {
        let client = Client::new(&spec.name, &spec.url, token_path_of(&spec));
        Appliance {
            spec,
            client,
            info: None,
            watch: Arc::default(),
            alias: None,
            liveness: Liveness::default(),
        }
    }
}

/// What the lock guards.
#[derive(Debug)]
pub(super) struct Inner {
    /// The appliances by name.
    pub(super) appliances: BTreeMap<String, Appliance>,
    /// Admitted jobs by id.
    pub(super) jobs: BTreeMap<u16, StoredJob>,
    /// Each job part's last checkpoint, and the parts held for an
    /// unusable one.
    pub(super) checkpoints: Checkpoints,
    /// Replicated jobs being installed on an appliance that came back
    /// (PROTOCOL.md §11.7), by job and appliance: reconciliation leaves
    /// those installs to the re-replication (`failover.rs`).
    pub(super) rejoining: BTreeSet<(u16, String)>,
}

impl Inner {
    /// The client of appliance `name`.
    pub(super) fn client(&self, name: &str) -> Result<Client, RequestError> {
        self.appliances
            .get(name)
            .map(|a| a.client.clone())
            .ok_or_else(|| {
                RequestError::NotFound(format!("no appliance {name:?}; see phubctl appliance list"))
            })
    }

    /// Every appliance's name and client.
    pub(super) fn clients(&self) -> Vec<(String, Client)> {
        self.appliances
            .values()
            .map(|a| (a.spec.name.clone(), a.client.clone()))
            .collect()
    }

    /// Every appliance's name, client and watch.
    pub(super) fn watched(&self) -> Vec<(String, Client, Arc<Watch>)> {
        self.appliances
            .values()
            .map(|a| (a.spec.name.clone(), a.client.clone(), a.watch.clone()))
            .collect()
    }

    /// Bytes on each lcore of appliance `name` (described by `info`) from
    /// the parts of admitted jobs in service there, but job `except`.
    pub(super) fn load_on(&self, name: &str, info: &DataplaneInfo, except: Option<u16>) -> Vec<u64> {
        let held: Vec<(&JobSpec, Layout)> = self
            .jobs
            .values()
            .filter(|j| j.failed.is_none() && Some(j.id) != except)
            .flat_map(|j| {
                // A hierarchical job's rack slots weigh on the appliance too.
                let rack = j.rack_layout_on(name).map(|r| (&j.spec, r.clone()));
                j.part_on(name).map(|p| (&j.spec, p)).into_iter().chain(rack)
            })
            .collect();
        admission::loads(info, held.iter().map(|(s, l)| (*s, l)))
    }

    /// Appliance `name`'s data address, as control last heard it.
    pub(super) fn data_of(&self, name: &str) -> Option<DataAddr> {
        Some(self.appliances.get(name)?.info.as_ref()?.data.clone())
    }

    /// Appliance `name`'s rack label (empty: none, or not managed).
    pub(super) fn rack_of(&self, name: &str) -> String {
        self.appliances
            .get(name)
            .map(|a| a.spec.rack.clone())
            .unwrap_or_default()
    }

    /// Where `job` stands in its life ([`Standing`]).
    pub(super) fn standing<'a>(&self, job: &'a StoredJob) -> Standing<'a> {
        match (&job.failed, self.checkpoints.held_reason(job.id)) {
            (Some(why), _) => Standing::Failed(why),
            (None, Some(why)) => Standing::Held(why),
            (None, None) => Standing::InService,
        }
    }

    /// The admitted jobs with a part on appliance `name`.
    pub(super) fn jobs_on(&self, name: &str) -> Vec<u16> {
        self.jobs
            .values()
            .filter(|j| j.parts.iter().any(|p| p.appliance == name))
            .map(|j| j.id)
            .collect()
    }
}

/// Where an admitted job stands in its life. Admission records it in
/// service; a part whose checkpoint file is there but unusable holds it
/// until `POST /v1/jobs/{id}/retry` (or a restart that finds the file
/// usable); an appliance that can no longer hold it fails it for good;
/// eviction ends it, whatever it stands at. Whether its parts are
/// installed now is the appliances' to say ([`Survey`]), not a state of
/// the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Standing<'a> {
    /// Installed, and reinstalled by reconciliation where an appliance
    /// lost it.
    InService,
    /// A part is not installed for its unusable checkpoint file: joins
    /// and checkpoints are refused. Why, part by part.
    Held(String),
    /// Never reinstalled; everything but eviction is refused. Why (a held
    /// part of a failed job is moot).
    Failed(&'a str),
}

impl Standing<'_> {
    /// Whether job `id` is in service, as a request that needs it to be
    /// asks: 409 with why not, and the way out.
    pub(super) fn check(&self, id: u16) -> Result<(), RequestError> {
        match self {
            Standing::InService => Ok(()),
            Standing::Held(why) => Err(held(id, why)),
            Standing::Failed(why) => Err(failed(id, why)),
        }
    }
}

/// The one entry of [`Inner`] a change touches ([`Shared::commit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Entry<'a> {
    /// The admitted job of this id (there or not).
    Job(u16),
    /// The appliance of this name (managed or not).
    Appliance(&'a str),
}

/// An entry as it was before a change, to put back.
enum Before {
    Job(u16, Option<StoredJob>),
    Appliance(String, Option<Appliance>),
}

/// The daemon's state, shared by the HTTP handlers and the reconcile
/// thread.
pub(super) struct Shared {
    /// Admission, eviction, checkpoints and appliance changes need it
    /// (`Authorization: Bearer`).
    pub(super) operator_token: String,
    pub(super) token_path: PathBuf,
    /// The state file; with the state in etcd, the path whose siblings
    /// are the checkpoint files (`--state-dir`/phub-control).
    pub(super) state_path: PathBuf,
    /// Where the state is saved.
    pub(super) store: Store,
    /// The election, when the state is in etcd.
    pub(super) lead: Leadership,
    pub(super) interval: Duration,
    /// The heartbeat interval: how often failover and re-replication
    /// retry and poll when reconciliation starts them.
    pub(super) beat: Duration,
    pub(super) inner: Mutex<Inner>,
    /// Held across every call that changes the dataplanes' sets of jobs
    /// or control's set of appliances.
    pub(super) ops: Mutex<()>,
    /// Itself, for the work a request hands to threads of their own (a
    /// drain's re-replications).
    pub(super) this: std::sync::Weak<Shared>,
    /// Wakes the reconcile thread for a pass now (an appliance's
    /// dataplane restarted: [`Shared::reconcile_soon`]); taken at
    /// shutdown.
    pub(super) reconcile_poke: Mutex<Option<std::sync::mpsc::Sender<()>>>,
    /// Replicated jobs gone back to their checkpoints, with the epoch
    /// they went back at, until every part is held again: a pass that
    /// finds them still restoring does not make another epoch.
    pub(super) gone_back: Mutex<BTreeMap<u16, u32>>,
    /// The checkpoint files as last read, which a reload does not read
    /// again while unchanged.
    pub(super) checkpoint_files: Mutex<CheckpointFiles>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the operator token.
        f.debug_struct("Shared")
            .field("state_path", &self.state_path)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A handler that panicked cannot have left the maps half-changed:
        // every change is one insert or remove.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Saves `entry` as `inner` holds it (a state file gets all of
    /// `inner`).
    pub(super) fn persist(&self, inner: &Inner, entry: Entry<'_>) -> Result<(), StateError> {
        let appliances: Vec<&ApplianceSpec> = inner.appliances.values().map(|a| &a.spec).collect();
        let jobs: Vec<&StoredJob> = inner.jobs.values().collect();
        let change = match entry {
            Entry::Job(id) => Change::Job(id, inner.jobs.get(&id)),
            Entry::Appliance(name) => Change::Appliance(name, inner.appliances.get(name).map(|a| &a.spec)),
        };
        self.store.save(change, &appliances, &jobs)
    }

    /// Changes `inner` by `change`, which touches `entry` alone, and saves
    /// the state file: a change is recorded or it did not happen. Returns
    /// what `change` returned; if the file cannot be written, `entry` is
    /// put back as it was (inserted again, removed, or restored) and the
    /// error says why. The copy kept to undo costs O(that job's spec), less
    /// than the save, which writes every job.
    pub(super) fn commit<R>(
        &self,
        inner: &mut Inner,
        entry: Entry<'_>,
        change: impl FnOnce(&mut Inner) -> R,
    ) -> Result<R, StateError> {
        let before = match entry {
            Entry::Job(id) => Before::Job(id, inner.jobs.get(&id).cloned()),
            Entry::Appliance(name) => {
                Before::Appliance(name.to_string(), inner.appliances.get(name).cloned())
            }
        };
        let others = |inner: &Inner| {
            let jobs: Vec<u16> = inner
                .jobs
                .keys()
                .copied()
                .filter(|id| Entry::Job(*id) != entry)
                .collect();
            let appliances: Vec<String> = inner
                .appliances
                .keys()
                .filter(|n| Entry::Appliance(n) != entry)
                .cloned()
                .collect();
            (jobs, appliances)
        };
        let untouched = cfg!(debug_assertions).then(|| others(inner));
        let out = change(inner);
        if let Some(untouched) = untouched {
            debug_assert!(others(inner) == untouched, "a commit changes only {entry:?}");
        }
        match self.persist(inner, entry) {
            Ok(()) => Ok(out),
            Err(e) => {
                match before {
                    Before::Job(id, Some(job)) => {
                        inner.jobs.insert(id, job);
                    }
                    Before::Job(id, None) => {
                        inner.jobs.remove(&id);
                    }
                    Before::Appliance(name, Some(a)) => {
                        inner.appliances.insert(name, a);
                    }
                    Before::Appliance(name, None) => {
                        inner.appliances.remove(&name);
                    }
                }
                Err(e)
            }
        }
    }

    /// Appliance `name`'s cached description, or a fresh one.
    pub(super) fn info_of(&self, name: &str) -> Result<DataplaneInfo, RequestError> {
        let client = {
            let inner = self.lock();
            if let Some(i) = inner.appliances.get(name).and_then(|a| a.info.clone()) {
                return Ok(i);
            }
            inner.client(name)?
        };
        let info = client.info()?;
        if let Some(a) = self.lock().appliances.get_mut(name) {
            a.info = Some(info.clone());
        }
        Ok(info)
    }

    /// The views of the appliances named in `only` (all when `None`),
    /// each fresh if it answers within `wait` ([`Watch::look`]: one asked
    /// while a request to it is in flight since longer is not waited for);
    /// all are asked at once. Fresh descriptions are remembered.
    pub(super) fn views(
        &self,
        only: Option<&[String]>,
        wait: Duration,
    ) -> BTreeMap<String, Result<View, String>> {
        let watched: Vec<(String, Client, Arc<Watch>)> = self
            .lock()
            .watched()
            .into_iter()
            .filter(|(n, ..)| only.is_none_or(|o| o.contains(n)))
            .collect();
        for (_, c, w) in &watched {
            // A failure to start shows in `look`.
            let _ = w.kick(c);
        }
        let views: BTreeMap<String, Result<View, String>> = watched
            .iter()
            .map(|(n, c, w)| (n.clone(), w.look(c, wait)))
            .collect();
        let mut inner = self.lock();
        for (n, v) in &views {
            if let (Some(a), Ok(v)) = (inner.appliances.get_mut(n), v) {
                a.info = Some(v.info.clone());
            }
        }
        views
    }

    /// Which appliances hold which jobs now, by [`Shared::views`].
    pub(super) fn survey(&self) -> Survey {
        survey_of(&self.views(None, READ_WAIT))
    }
}

/// Which appliances hold which jobs now: per appliance its installed job
/// ids, or why it did not answer.
pub(super) type Survey = BTreeMap<String, Result<BTreeSet<u16>, String>>;

/// The jobs each appliance holds, by its view.
pub(super) fn survey_of(views: &BTreeMap<String, Result<View, String>>) -> Survey {
    views
        .iter()
        .map(|(n, v)| {
            let ids = v.as_ref().map(|v| v.stats.jobs.iter().map(|j| j.id).collect());
            (n.clone(), ids.map_err(Clone::clone))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state;

    fn job(id: u16) -> StoredJob {
        let spec = JobSpec::from_toml(
            "name = \"a\"\nworkers = 2\n[optimizer]\nkind = \"sum\"\n[[keys]]\nelements = 64\n",
        )
        .unwrap();
        state::test_job(id, 7, spec, &["a"])
    }

    fn appliance(name: &str) -> Appliance {
        Appliance::new(ApplianceSpec {
            name: name.into(),
            url: "http://127.0.0.1:1".into(),
            rack: String::new(),
            token_file: Some("/nonexistent/token".into()),
            draining: false,
        })
    }

    /// What the state file holds: its job ids with their joined ranks,
    /// and its appliances.
    fn saved(path: &std::path::Path) -> (Vec<(u16, Vec<u16>)>, Vec<String>) {
        let s = state::load(path).unwrap().unwrap();
        let jobs = s
            .jobs
            .iter()
            .map(|j| (j.id, j.joined.iter().copied().collect()))
            .collect();
        (
            jobs,
            s.appliances
                .unwrap_or_default()
                .into_iter()
                .map(|a| a.name)
                .collect(),
        )
    }

    /// A change is recorded or it did not happen: when the state file
    /// cannot be written, every kind of change (insert, change, remove;
    /// jobs and appliances) is undone in memory, and the file keeps what
    /// it had.
    #[test]
    fn a_change_that_cannot_be_saved_is_undone() {
        let dir = std::env::temp_dir().join(format!("phub-control-commit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.json");
        let shared = Shared {
            operator_token: String::new(),
            token_path: dir.join("token"),
            state_path: path.clone(),
            store: Store::file(path.clone()).unwrap(),
            lead: Leadership::new(Duration::from_secs(2), Vec::new()),
            interval: Duration::from_secs(1),
            beat: Duration::from_millis(100),
            inner: Mutex::new(Inner {
                appliances: BTreeMap::new(),
                jobs: BTreeMap::new(),
                checkpoints: Checkpoints::default(),
                rejoining: BTreeSet::new(),
            }),
            ops: Mutex::new(()),
            this: std::sync::Weak::new(),
            reconcile_poke: Mutex::new(None),
            gone_back: Mutex::new(BTreeMap::new()),
            checkpoint_files: Mutex::default(),
        };
        let mut inner = shared.lock();
        shared
            .commit(&mut inner, Entry::Job(1), |i| i.jobs.insert(1, job(1)))
            .unwrap();
        shared
            .commit(&mut inner, Entry::Appliance("a"), |i| {
                i.appliances.insert("a".into(), appliance("a"))
            })
            .unwrap();
        let before = (vec![(1, vec![])], vec!["a".to_string()]);
        assert_eq!(saved(&path), before);

        // A directory where the state's temporary goes: every save fails.
        std::fs::create_dir(dir.join("s.json.tmp")).unwrap();
        let join = shared.commit(&mut inner, Entry::Job(1), |i| {
            i.jobs.get_mut(&1).unwrap().joined.insert(1)
        });
        assert!(join.unwrap_err().to_string().contains("s.json.tmp"));
        assert_eq!(inner.jobs[&1], job(1), "the rank is not joined");
        assert!(shared
            .commit(&mut inner, Entry::Job(1), |i| i.jobs.remove(&1))
            .is_err());
        assert_eq!(inner.jobs[&1], job(1), "the job is not evicted");
        assert!(shared
            .commit(&mut inner, Entry::Job(2), |i| i.jobs.insert(2, job(2)))
            .is_err());
        assert!(!inner.jobs.contains_key(&2), "the job is not admitted");
        assert!(shared
            .commit(&mut inner, Entry::Appliance("a"), |i| i.appliances.remove("a"))
            .is_err());
        assert_eq!(
            inner.appliances["a"].spec.url, "http://127.0.0.1:1",
            "the appliance stays"
        );
        assert!(shared
            .commit(&mut inner, Entry::Appliance("b"), |i| i
                .appliances
                .insert("b".into(), appliance("b")))
            .is_err());
        assert!(!inner.appliances.contains_key("b"), "the appliance is not added");
        assert_eq!(saved(&path), before);

        // Writable again: the change is kept, in memory and in the file.
        std::fs::remove_dir(dir.join("s.json.tmp")).unwrap();
        let joined = shared.commit(&mut inner, Entry::Job(1), |i| {
            i.jobs.get_mut(&1).unwrap().joined.insert(1)
        });
        assert!(joined.unwrap());
        assert_eq!(saved(&path), (vec![(1, vec![1])], vec!["a".to_string()]));
        drop(inner);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
