//! `phubctl state export|import`: a state file's content copied into etcd
//! and back, with no control running on the target. Each side is a state
//! file or `etcd://HOST:PORT[,...]/PREFIX`; the target must be empty (no
//! file there, nothing under the prefix), so nothing is ever merged or
//! overwritten.

use std::path::Path;

use phub_proto::api::ApplianceSpec;

use super::etcd::{EtcdSecurity, EtcdStore, EtcdTarget};
use super::{StateError, StateFile, StoredJob};

/// Why a state could not be copied.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TransferError {
    /// Reading the source or writing the target failed.
    #[error(transparent)]
    State(#[from] StateError),
    /// The source holds no state.
    #[error("{0}: no state there to copy")]
    Empty(String),
    /// The target holds a state already.
    #[error("{0} holds a state already; give an empty target (a new file, an unused prefix)")]
    NotEmpty(String),
    /// The `etcd://` URL is wrong.
    #[error("{0}")]
    Url(String),
}

/// One side of a copy, as given.
enum Side<'a> {
    File(&'a Path),
    Etcd(Box<EtcdStore>),
}

fn side<'a>(text: &'a str, security: &EtcdSecurity) -> Result<Side<'a>, TransferError> {
    if EtcdTarget::is_etcd(text) {
        let target = EtcdTarget::parse(text)
            .map_err(TransferError::Url)?
            .with_security(security.clone());
        Ok(Side::Etcd(Box::new(
            EtcdStore::new(target).map_err(|e| TransferError::Url(e.to_string()))?,
        )))
    } else {
        Ok(Side::File(Path::new(text)))
    }
}

fn read(side: &Side<'_>) -> Result<Option<StateFile>, StateError> {
    match side {
        Side::File(p) => super::load(p),
        Side::Etcd(e) => Ok(e.load()?),
    }
}

/// Copies the state at `from` to the empty `to`, reaching etcd (either
/// side) as `security` says: the number of jobs and appliances copied.
pub(crate) fn copy(from: &str, to: &str, security: &EtcdSecurity) -> Result<(usize, usize), TransferError> {
    let source = side(from, security)?;
    let target = side(to, security)?;
    let state = read(&source)?.ok_or_else(|| TransferError::Empty(from.to_string()))?;
    let appliances: Vec<&ApplianceSpec> = state.appliances.iter().flatten().collect();
    let jobs: Vec<&StoredJob> = state.jobs.iter().collect();
    match &target {
        Side::File(p) => {
            if p.exists() {
                return Err(TransferError::NotEmpty(to.to_string()));
            }
            super::save(p, &appliances, &jobs)?;
        }
        Side::Etcd(e) => {
            if e.load().map_err(StateError::from)?.is_some() {
                return Err(TransferError::NotEmpty(to.to_string()));
            }
            e.import(&appliances, &jobs).map_err(StateError::from)?;
        }
    }
    Ok((jobs.len(), appliances.len()))
}
