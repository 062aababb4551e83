//! The appliances control manages (`/v1/appliances`): listed with their
//! descriptions now, added once known to be a phub dataplane control does
//! not manage already under another name, removed once no job uses them.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use phub_proto::api::{ApplianceSpec, ApplianceStatus, DataplaneInfo};

use super::config::{check_appliance, token_path_of};
use super::http::RequestError;
use super::registry::{Appliance, Entry, Shared};
use crate::dataplane::Client;
use crate::watch::{self, READ_WAIT};

impl Shared {
    /// `GET /v1/appliances`: every appliance, asked for its description now.
    pub(super) fn appliances(&self) -> Vec<ApplianceStatus> {
        let infos: BTreeMap<String, Result<DataplaneInfo, String>> = self
            .views(None, READ_WAIT)
            .into_iter()
            .map(|(n, v)| (n, v.map(|v| v.info)))
            .collect();
        let inner = self.lock();
        inner
            .appliances
            .values()
            .map(|a| {
                let info = infos.get(&a.spec.name).and_then(|r| r.as_ref().ok());
                ApplianceStatus {
                    name: a.spec.name.clone(),
                    url: a.spec.url.clone(),
                    rack: a.spec.rack.clone(),
                    token_file: a.client.token_path().display().to_string(),
                    down: a
                        .alias
                        .clone()
                        .or_else(|| a.liveness.down.clone())
                        .or_else(|| infos.get(&a.spec.name).and_then(|r| r.as_ref().err().cloned())),
                    data: info.map(|i| i.data.clone()),
                    lcores: info.map(|i| u32::try_from(i.lcores.len()).unwrap_or(u32::MAX)),
                    memory_budget_bytes: info.map(|i| i.memory_budget_bytes),
                    memory_used_bytes: info.map(|i| i.memory_used_bytes),
                    jobs: inner.jobs_on(&a.spec.name),
                    draining: a.spec.draining,
                }
            })
            .collect()
    }

    /// `POST /v1/appliances`: manages one more appliance, durably, once it
    /// is known to be a phub dataplane that takes the management token and
    /// that control does not manage already under another name (by its URL
    /// in any spelling, its id or its data address). With `force`, one
    /// that does not answer is added unchecked (reconciliation checks it
    /// when it answers: an alias is then left alone, never reconciled).
    pub(super) fn add_appliance(
        &self,
        a: ApplianceSpec,
        force: bool,
    ) -> Result<ApplianceStatus, RequestError> {
        check_appliance(&a).map_err(RequestError::BadRequest)?;
        if a.draining {
            return Err(RequestError::BadRequest(format!(
                "appliance {:?}: \"draining\" is set by phubctl appliance drain (POST \
                 /v1/appliances/{{name}}/drain), not given; leave it out. Not added",
                a.name
            )));
        }
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        {
            let inner = self.lock();
            if let Some(old) = inner.appliances.get(&a.name) {
                return Err(RequestError::Conflict(format!(
                    "appliance {:?} already exists (at {}); remove it first",
                    a.name, old.spec.url
                )));
            }
            if let Some(old) = inner.appliances.values().find(|o| same_url(&o.spec.url, &a.url)) {
                return Err(RequestError::Conflict(format!(
                    "appliance {:?}: {} is the management API of appliance {:?} (at {}), which control \
                     manages already; one dataplane is managed under one name. Not added",
                    a.name, a.url, old.spec.name, old.spec.url
                )));
            }
        }
        let client = Client::new(&a.name, &a.url, token_path_of(&a));
        let info = match client.info() {
            Ok(info) => Some(info),
            Err(e) if e.is_unreachable() && force => {
                log::warn!(
                    "adding appliance {:?} at {}, which does not answer (--force): {e}",
                    a.name,
                    a.url
                );
                None
            }
            Err(e) if e.is_unreachable() => {
                return Err(RequestError::BadRequest(format!(
                    "{e}. Not added: give --force to add an appliance that is down (reconciliation checks \
                     it once it answers)"
                )))
            }
            Err(e) => {
                return Err(RequestError::BadRequest(format!(
                "appliance {:?}: {} does not answer as a phub dataplane's management API ({e}). Not added",
                a.name, a.url
            )))
            }
        };
        if let Some(info) = &info {
            if let Err(e) = client.check_token() {
                return Err(RequestError::BadRequest(format!(
                    "appliance {:?}: the management token in {} does not open the dataplane at {} ({e}); give \
                     the file its phub-dataplane wrote (token_file, phubctl --token-file). Not added",
                    a.name,
                    client.token_path().display(),
                    a.url
                )));
            }
            let views = self.views(None, READ_WAIT);
            let inner = self.lock();
            for other in inner.appliances.values() {
                let now = views
                    .get(&other.spec.name)
                    .and_then(|v| v.as_ref().ok())
                    .map(|v| &v.info);
                let theirs = now.or(other.info.as_ref());
                if let Some(why) = theirs.and_then(|t| watch::same_dataplane(info, t)) {
                    return Err(RequestError::Conflict(format!(
                        "appliance {:?} at {} is the dataplane control manages already as appliance {:?} (at \
                         {}): {why}; one dataplane is managed under one name. Not added",
                        a.name, a.url, other.spec.name, other.spec.url
                    )));
                }
            }
        }
        let mut inner = self.lock();
        if inner.appliances.contains_key(&a.name) {
            return Err(RequestError::Conflict(format!(
                "appliance {:?} was added meanwhile; remove it first",
                a.name
            )));
        }
        let name = a.name.clone();
        let mut added = Appliance::new(a);
        added.info = info;
        let recorded = self.commit(&mut inner, Entry::Appliance(&name), |inner| {
            inner.appliances.insert(name.clone(), added)
        });
        if let Err(e) = recorded {
            return Err(RequestError::State(format!(
                "{e}; appliance {name:?} was not added"
            )));
        }
        let added = &inner.appliances[&name];
        log::info!(
            "added appliance {name:?} at {} (rack {:?})",
            added.spec.url,
            added.spec.rack
        );
        let status = ApplianceStatus {
            name: name.clone(),
            url: added.spec.url.clone(),
            rack: added.spec.rack.clone(),
            token_file: added.client.token_path().display().to_string(),
            down: None,
            data: None,
            lcores: None,
            memory_budget_bytes: None,
            memory_used_bytes: None,
            jobs: Vec::new(),
            draining: false,
        };
        drop(inner);
        Ok(self
            .appliances()
            .into_iter()
            .find(|s| s.name == name)
            .unwrap_or(status))
    }

    /// `DELETE /v1/appliances/{name}`: stops managing an appliance no job
    /// uses (refused, naming the jobs, while one does), durably.
    pub(super) fn remove_appliance(&self, name: &str) -> Result<ApplianceStatus, RequestError> {
        let _ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let mut inner = self.lock();
        if !inner.appliances.contains_key(name) {
            return Err(RequestError::NotFound(format!(
                "no appliance {name:?}; see phubctl appliance list"
            )));
        }
        let users = inner.jobs_on(name);
        if !users.is_empty() {
            let ids: Vec<String> = users
                .iter()
                .map(|id| format!("{id} ({:?})", inner.jobs[id].spec.name))
                .collect();
            return Err(RequestError::Conflict(format!(
                "appliance {name:?} holds jobs {}; evict them first",
                ids.join(", ")
            )));
        }
        let gone = match self.commit(&mut inner, Entry::Appliance(name), |inner| {
            inner.appliances.remove(name)
        }) {
            Ok(gone) => gone.expect("managed, checked under the same lock"),
            Err(e) => {
                return Err(RequestError::State(format!(
                    "{e}; appliance {name:?} was not removed"
                )))
            }
        };
        log::info!("removed appliance {name:?} at {}", gone.spec.url);
        Ok(ApplianceStatus {
            name: gone.spec.name.clone(),
            url: gone.spec.url.clone(),
            rack: gone.spec.rack.clone(),
            token_file: gone.client.token_path().display().to_string(),
            down: None,
            data: gone.info.as_ref().map(|i| i.data.clone()),
            lcores: gone
                .info
                .as_ref()
                .map(|i| u32::try_from(i.lcores.len()).unwrap_or(u32::MAX)),
            memory_budget_bytes: gone.info.as_ref().map(|i| i.memory_budget_bytes),
            memory_used_bytes: gone.info.as_ref().map(|i| i.memory_used_bytes),
            jobs: Vec::new(),
            draining: gone.spec.draining,
        })
    }
}

/// Whether two management URLs name one API: the same scheme, path and
/// port, on hosts that resolve to a common address (`localhost` and
/// `127.0.0.1`), whatever their case or trailing `/`.
pub(super) fn same_url(a: &str, b: &str) -> bool {
    use std::net::ToSocketAddrs as _;
    /// (scheme, "host:port", path) of an http(s) URL, lower-cased.
    fn split(url: &str) -> Option<(String, String, String)> {
        let url = url.trim().to_ascii_lowercase();
        let (scheme, rest) = url.split_once("://")?;
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let default = if scheme == "https" { 443 } else { 80 };
        let has_port = authority.rsplit_once(':').is_some_and(|(h, p)| {
            !h.ends_with(':') && p.bytes().all(|c| c.is_ascii_digit()) && !p.is_empty()
        });
        let hostport = if has_port {
            authority.to_string()
        } else {
            format!("{authority}:{default}")
        };
        Some((
            scheme.to_string(),
            hostport,
            path.trim_end_matches('/').to_string(),
        ))
    }
    let (Some((sa, ha, pa)), Some((sb, hb, pb))) = (split(a), split(b)) else {
        return a == b;
    };
    if sa != sb || pa != pb {
        return false;
    }
    if ha == hb {
        return true;
    }
    let resolve =
        |h: &str| -> Vec<SocketAddr> { h.to_socket_addrs().map(Iterator::collect).unwrap_or_default() };
    let ra = resolve(&ha);
    resolve(&hb).iter().any(|x| ra.contains(x))
}
