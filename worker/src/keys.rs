//! Where each key stands, shared by the API side and the I/O thread: the
//! one owner of a key's state. Every change of it is a method here.
//!
//! A key's life: free → [`KeyTable::claim`] (the API side, for a request;
//! the claim fails with [`WorkerError::Busy`] while another request of the
//! key is in flight) → the I/O thread's [`KeyTable::end`] when the request
//! has ended, which records the round and returns the [`KeyClaim`] → the
//! claim is dropped, which frees the key: at once by the I/O thread, or,
//! for a request whose results stay in the shared-memory result regions,
//! by the waiter once it has copied them out (or let them go). A claim the
//! API side made and could not hand over is given back with
//! [`KeyTable::release`].
//!
//! Invariant: at most one request per key is in flight (PROTOCOL.md §6):
//! a key is busy from its claim until its claim is dropped or released.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::elem::{Spares, ValueType, Values};
use crate::error::WorkerError;

/// Where a key stands.
#[derive(Debug, Clone, Default)]
struct KeyState {
    /// Last round whose result this worker holds, `None` before init/pull.
    round: Option<u32>,
    /// A request is in flight, or its results are still being read.
    busy: bool,
    /// The datagram buffer of the key's last request, for the next one
    /// (no allocation, no page faults, no zeroing round after round).
    tx_spare: Vec<u8>,
    /// The result buffers of the key's last requests (one of each kind), likewise.
    values_spare: Spares,
    /// A table key (PROTOCOL.md §10): no dense request claims it, and
    /// [`KeyTable::clock`] passes over it (`tables.rs` keeps its rounds).
    table: bool,
}

/// The job's keys, shared between the API side and the I/O thread.
#[derive(Debug, Clone)]
pub(crate) struct KeyTable(Arc<Mutex<Vec<KeyState>>>);

impl KeyTable {
    /// A table of `keys` free keys that hold no round yet.
    pub(crate) fn new(keys: usize) -> KeyTable {
        KeyTable(Arc::new(Mutex::new(vec![KeyState::default(); keys])))
    }

    fn lock(&self) -> MutexGuard<'_, Vec<KeyState>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The last round whose result this worker holds for `key` (`None`
    /// before init or pull, or for an unknown key).
    pub(crate) fn round(&self, key: u32) -> Option<u32> {
        self.lock().get(key as usize).and_then(|k| k.round)
    }

    /// The lowest [`KeyTable::round`] over the dense keys (`None` while
    /// one holds none, or the job has none).
    pub(crate) fn clock(&self) -> Option<u32> {
        self.lock()
            .iter()
            .filter(|k| !k.table)
            .map(|k| k.round)
            .min()
            .flatten()
    }

    /// Marks `key` a table key: dense calls refuse it, and the clock is
    /// the dense keys'.
    pub(crate) fn set_table(&self, key: u32) {
        if let Some(k) = self.lock().get_mut(key as usize) {
            k.table = true;
        }
    }

    /// Whether `key` is a table key.
    pub(crate) fn is_table(&self, key: u32) -> bool {
        self.lock().get(key as usize).is_some_and(|k| k.table)
    }

    /// Marks `key` busy if it is free and `round`, given the key's last
    /// round, accepts it; returns the round `round` picked. `key` is one of
    /// the job's (the caller checked).
    pub(crate) fn claim(
        &self,
        key: u32,
        round: impl FnOnce(Option<u32>) -> Result<u32, String>,
    ) -> Result<u32, WorkerError> {
        let mut keys = self.lock();
        let k = &mut keys[key as usize];
        if k.busy {
            return Err(WorkerError::Busy { key });
        }
        let r = round(k.round).map_err(|message| WorkerError::Sequence { key, message })?;
        k.busy = true;
        Ok(r)
    }

    /// Gives back a claim that was never handed to a request.
    pub(crate) fn release(&self, key: u32) {
        let mut keys = self.lock();
        if let Some(k) = keys.get_mut(key as usize) {
            debug_assert!(k.busy, "key {key} released without a claim");
            k.busy = false;
        }
    }

    /// A claimed `key`'s request ended: records its new `round`, if any,
    /// keeps its datagram buffer `tx` for the key's next request, and
    /// returns the claim, which frees the key when dropped.
    pub(crate) fn end(&self, key: u32, round: Option<u32>, tx: Vec<u8>) -> KeyClaim {
        let mut keys = self.lock();
        if let Some(k) = keys.get_mut(key as usize) {
            debug_assert!(k.busy, "key {key}: a request ended that held no claim");
            if round.is_some() {
                k.round = round;
            }
            k.tx_spare = tx;
        }
        KeyClaim {
            keys: self.clone(),
            key,
        }
    }

    /// The key's spare result buffer, sized for `elements` of `ty`; its
    /// contents do not matter: every element is overwritten by a result.
    pub(crate) fn take_values(&self, key: u32, elements: usize, ty: ValueType) -> Values {
        self.lock()[key as usize].values_spare.take(ty, elements)
    }

    /// Lets the key's spare result buffers go: a request whose results go
    /// straight into the caller's memory (the lent path, [`crate::Exchange`])
    /// needs none, and a worker that exchanges that way would otherwise
    /// keep a copy of every key it once pushed with a copy.
    pub(crate) fn drop_values(&self, key: u32) {
        if let Some(k) = self.lock().get_mut(key as usize) {
            k.values_spare = Spares::default();
        }
    }

    /// Bytes of the spare buffers kept for the keys' next requests.
    pub(crate) fn spare_bytes(&self) -> usize {
        self.lock()
            .iter()
            .map(|k| k.tx_spare.len() + k.values_spare.bytes())
            .sum()
    }

    /// Keeps a result buffer for the key's next request.
    pub(crate) fn keep_values(&self, key: u32, values: Values) {
        if let Some(k) = self.lock().get_mut(key as usize) {
            k.values_spare.keep(values);
        }
    }

    /// The key's datagram buffer from its previous request, `len` bytes
    /// long (reused when it has that length, else a new zeroed one).
    pub(crate) fn take_tx(&self, key: u32, len: usize) -> Vec<u8> {
        let buf = std::mem::take(&mut self.lock()[key as usize].tx_spare);
        if buf.len() == len {
            buf
        } else {
            vec![0u8; len]
        }
    }
}

/// The claim on a key whose request has ended ([`KeyTable::end`]): frees
/// the key when dropped. While a request's results sit in the result
/// regions, its waiter holds this, so no new request can push the key's
/// chunks and the lcores cannot overwrite those results.
#[derive(Debug)]
pub(crate) struct KeyClaim {
    keys: KeyTable,
    key: u32,
}

impl Drop for KeyClaim {
    fn drop(&mut self) {
        self.keys.release(self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_busy_from_its_claim_until_its_claim_is_dropped() {
        let keys = KeyTable::new(2);
        assert_eq!(keys.claim(0, |r| r.map_or(Ok(0), |r| Ok(r + 1))).unwrap(), 0);
        assert!(matches!(
            keys.claim(0, |_| Ok(0)),
            Err(WorkerError::Busy { key: 0 })
        ));
        // The other key is free.
        assert_eq!(keys.claim(1, |_| Ok(0)).unwrap(), 0);
        let claim = keys.end(0, Some(0), vec![1, 2]);
        assert_eq!(keys.round(0), Some(0));
        assert!(matches!(
            keys.claim(0, |_| Ok(1)),
            Err(WorkerError::Busy { key: 0 })
        ));
        drop(claim);
        assert_eq!(keys.claim(0, |r| Ok(r.unwrap() + 1)).unwrap(), 1);
        assert_eq!(
            keys.take_tx(0, 2),
            vec![1, 2],
            "the ended request's buffer is kept"
        );
        // A failed request records no round; the clock is the lowest.
        drop(keys.end(0, None, Vec::new()));
        assert_eq!(keys.round(0), Some(0));
        assert_eq!(keys.clock(), None, "key 1 holds no round yet");
        drop(keys.end(1, Some(3), Vec::new()));
        assert_eq!(keys.clock(), Some(0));
        let e = keys.claim(1, |_| Err("no".into())).unwrap_err();
        assert!(matches!(e, WorkerError::Sequence { key: 1, .. }), "{e}");
    }
}
