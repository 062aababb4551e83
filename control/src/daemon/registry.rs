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

use super::checkpoints::Checkpoints;
use super::config::token_path_of;
use super::http::RequestError;
use crate::admission;
use crate::dataplane::Client;
use crate::job::{part_of, rack_of};
use crate::state::{self, StateError, StoredJob};
use crate::watch::{View, Watch, READ_WAIT};

/// One appliance control manages.
#[derive(Debug)]
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
                let rack = rack_of(j, name).map(|r| (&j.spec, r.clone()));
                part_of(j, name).map(|p| (&j.spec, p)).into_iter().chain(rack)
            })
            .collect();
        admission::loads(info, held.iter().map(|(s, l)| (*s, l)))
    }

    /// Appliance `name`'s data address, as control last heard it.
    pub(super) fn data_of(&self, name: &str) -> Option<DataAddr> {
        Some(self.appliances.get(name)?.info.as_ref()?.data.clone())
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

pub(super) struct Shared {
    /// Admission, eviction, checkpoints and appliance changes need it
    /// (`Authorization: Bearer`).
    pub(super) operator_token: String,
    pub(super) token_path: PathBuf,
    pub(super) state_path: PathBuf,
    pub(super) interval: Duration,
    pub(super) inner: Mutex<Inner>,
    /// Held across every call that changes the dataplanes' sets of jobs
    /// or control's set of appliances.
    pub(super) ops: Mutex<()>,
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

    pub(super) fn persist(&self, inner: &Inner) -> Result<(), StateError> {
        let appliances: Vec<&ApplianceSpec> = inner.appliances.values().map(|a| &a.spec).collect();
        let jobs: Vec<&StoredJob> = inner.jobs.values().collect();
        state::save(&self.state_path, &appliances, &jobs)
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
