//! Where the state is kept: the state file (the default: one control, one
//! appliance or one host) or etcd (several controls on one prefix, one of
//! them leading). Both hold the same content; a change is saved through
//! [`Store::save`], which for the file writes the whole state atomically
//! and for etcd writes the one entry that changed, fenced by the leader
//! key ([`etcd`](super::etcd)).

use std::path::PathBuf;

use phub_proto::api::ApplianceSpec;

use super::etcd::EtcdStore;
use super::{StateError, StateFile, StateLock, StoredJob};

/// One changed entry: its new value, or `None` when it is gone.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Change<'a> {
    /// The job of this id.
    Job(u16, Option<&'a StoredJob>),
    /// The appliance of this name.
    Appliance(&'a str, Option<&'a ApplianceSpec>),
}

/// Where the state is kept.
#[derive(Debug)]
pub(crate) enum Store {
    /// The state file, locked for this control's life.
    File {
        /// The file.
        path: PathBuf,
        /// Held: no second control on this file.
        _lock: StateLock,
    },
    /// Entries under a prefix of an etcd cluster.
    Etcd(Box<EtcdStore>),
}

impl Store {
    /// The state file at `path`, locked.
    pub(crate) fn file(path: PathBuf) -> Result<Store, StateError> {
        let lock = super::lock(&path)?;
        Ok(Store::File { path, _lock: lock })
    }

    /// Everything stored; `None` when nothing is yet.
    pub(crate) fn load(&self) -> Result<Option<StateFile>, StateError> {
        match self {
            Store::File { path, .. } => super::load(path),
            Store::Etcd(e) => Ok(e.load()?),
        }
    }

    /// Saves `change`, made to the state whose entries are now
    /// `appliances` and `jobs`: a file is written whole, etcd gets the one
    /// entry.
    pub(crate) fn save(
        &self,
        change: Change<'_>,
        appliances: &[&ApplianceSpec],
        jobs: &[&StoredJob],
    ) -> Result<(), StateError> {
        match self {
            Store::File { path, .. } => super::save(path, appliances, jobs),
            Store::Etcd(e) => Ok(e.write(change)?),
        }
    }

    /// The etcd store, if the state is there.
    pub(crate) fn etcd(&self) -> Option<&EtcdStore> {
        match self {
            Store::File { .. } => None,
            Store::Etcd(e) => Some(e),
        }
    }

    /// Where the state is, for errors: `state file PATH` or `state in
    /// etcd://...`.
    pub(crate) fn describe(&self) -> String {
        match self {
            Store::File { path, .. } => format!("state file {}", path.display()),
            Store::Etcd(_) => format!("state in {}", self.place()),
        }
    }

    /// The file's path or the etcd URL.
    pub(crate) fn place(&self) -> String {
        match self {
            Store::File { path, .. } => path.display().to_string(),
            Store::Etcd(e) => e.target().url(),
        }
    }
}
