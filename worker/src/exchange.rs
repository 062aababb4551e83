//! The lent path: [`Worker::exchange`] runs a step's `push_pull`s with the
//! caller's buffers lent to the I/O thread instead of copied
//! ([`Exchange`]).

use crossbeam_channel::Receiver;
use phub_proto::wire::MsgType;

use crate::elem::{Dst, Element, Src};
use crate::error::WorkerError;
use crate::io::{Completion, Request};
use crate::transport::{ChunkMsg, Kind, RawBytes, RawDst, Sink, Tx};
use crate::worker::{recv, Worker};

/// Requests whose buffers are lent to the I/O thread rather than copied;
/// see [`Worker::exchange`].
///
/// `'b` is the lifetime of the lent buffers: it outlives the whole
/// `exchange` call, which does not return before every request started
/// here has ended, so the I/O thread never touches a buffer after it is
/// released. `'b` is invariant (as `std::thread::scope`'s `'env`), so
/// buffers with a shorter life cannot be passed in.
pub struct Exchange<'x, 'b> {
    worker: &'x Worker,
    waiting: std::cell::RefCell<Vec<(u32, Receiver<Completion>)>>,
    _lent: std::marker::PhantomData<fn(&'b ()) -> &'b ()>,
}

impl std::fmt::Debug for Exchange<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange")
            .field("requests", &self.waiting.borrow().len())
            .finish_non_exhaustive()
    }
}

impl<'b> Exchange<'_, 'b> {
    /// The next round for `key`, like [`Worker::push_pull`], but `grad` is
    /// read and `out` written in place by the I/O thread: neither may be
    /// touched until [`Worker::exchange`] returns (the borrows enforce it).
    /// Returns at once, with the round (clock) it completes; the exchange
    /// waits for the result.
    ///
    /// `grad` and `out` are `f32` for any job, or the job's 16-bit wire
    /// type (see [`Element`]): then their bits go out and come back as
    /// they are, with no conversion and no copy on the caller's side.
    pub fn push_pull<E: Element>(
        &self,
        key: u32,
        grad: &'b [E],
        out: &'b mut [E],
    ) -> Result<u32, WorkerError> {
        self.worker.check_elem::<E>()?;
        let (rx, round) = self.worker.push_pull_lent(key, Src::of(grad), Dst::of(out))?;
        self.waiting.borrow_mut().push((key, rx));
        Ok(round)
    }

    /// [`Exchange::push_pull`] with the gradient and the result in one
    /// buffer, lent: `buf` is read for the push and written with the
    /// result in place, chunk by chunk as results arrive, by the I/O
    /// thread (a chunk's result comes only after its push left, and an
    /// answered chunk is never sent again). No copy on the caller's side
    /// either way. If the request fails, `buf` holds the results of the
    /// chunks answered and the gradient elsewhere: compute it again
    /// before pushing it again. Returns the round (clock) it completes.
    pub fn push_pull_in_place<E: Element>(&self, key: u32, buf: &'b mut [E]) -> Result<u32, WorkerError> {
        self.worker.check_elem::<E>()?;
        let (rx, round) = self.worker.push_pull_lent_in_place(key, buf)?;
        self.waiting.borrow_mut().push((key, rx));
        Ok(round)
    }

    /// Ends the exchange's scope without waiting: the requests started on
    /// it so far go on, and the returned [`Detached`] waits for them (its
    /// [`Detached::wait`], or its drop). [`Worker::exchange`] then returns
    /// at once. For a caller whose buffers outlive the call by other means
    /// (a Python array kept alive by its handle, say) and who wants the
    /// next exchange started before this one ends, as the DDP comm hook
    /// does bucket by bucket.
    ///
    /// # Safety
    ///
    /// Every buffer lent to this exchange must stay valid, and be neither
    /// read nor written by anything but the I/O thread, until the returned
    /// value has been waited or dropped: the I/O thread reads the
    /// gradients and writes the results until then, beyond `'b`.
    pub unsafe fn detach(&self) -> Detached {
        Detached {
            waiting: std::mem::take(&mut *self.waiting.borrow_mut()),
        }
    }

    /// Waits for every request started here; the first error, if any.
    fn wait_all(&self) -> Result<(), WorkerError> {
        wait_each(std::mem::take(&mut *self.waiting.borrow_mut()))
    }
}

/// Waits for every request of `waiting`; the first error, if any.
fn wait_each(waiting: Vec<(u32, Receiver<Completion>)>) -> Result<(), WorkerError> {
    let mut first = Ok(());
    for (_, rx) in waiting {
        // The results are in the caller's output already.
        let r = recv(&rx).map(drop);
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// Lent requests that outlive their [`Worker::exchange`] call
/// ([`Exchange::detach`]). Dropping it waits for them as [`Detached::wait`]
/// does, so the buffers they were lent are free once it is gone.
#[must_use = "dropping it blocks until its requests end"]
#[derive(Default)]
pub struct Detached {
    waiting: Vec<(u32, Receiver<Completion>)>,
}

impl std::fmt::Debug for Detached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detached")
            .field("requests", &self.waiting.len())
            .finish()
    }
}

impl Detached {
    /// Blocks until every request has ended (its result in the lent output,
    /// or failed); the first error, if any. The lent buffers are then the
    /// caller's again.
    pub fn wait(mut self) -> Result<(), WorkerError> {
        wait_each(std::mem::take(&mut self.waiting))
    }

    /// The keys of the requests not waited for yet.
    pub fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.waiting.iter().map(|&(k, _)| k)
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        let _ = wait_each(std::mem::take(&mut self.waiting));
    }
}

impl Worker {
    /// Starts every chunk of a round for `key` with the caller's buffers
    /// lent, not copied (see [`Exchange`]): the result is written into
    /// `out` in place, and with an `f32` job the datagrams' payloads are
    /// `grad` itself (other dtypes are encoded into datagrams first; with
    /// shared memory the I/O thread copies the payloads into the staging
    /// regions).
    fn push_pull_lent(
        &self,
        key: u32,
        grad: Src<'_>,
        mut out: Dst<'_>,
    ) -> Result<(Receiver<Completion>, u32), WorkerError> {
        let elements = self.check_len(key, grad.len())?;
        self.check_len(key, out.len())?;
        let round = self.claim_next_round(key)?;
        self.keys.drop_values(key);
        let (chunks, tx) = if let Some(bytes) = grad.wire_bytes(self.spec.dtype) {
            let payload = RawBytes {
                ptr: bytes.as_ptr(),
                len: bytes.len(),
            };
            self.lent_tx(key, elements, round, payload)
        } else {
            let (chunks, buf) = self.messages(key, elements, MsgType::Push, round, Some(grad));
            (chunks, Tx::Owned(buf))
        };
        let rx = self.send_lent(key, round, chunks, tx, RawDst::new(&mut out))?;
        Ok((rx, round))
    }

    /// A lent push's chunks and transmit side: headers only, each chunk's
    /// payload read from `payload` (the caller's wire bytes) when sent.
    fn lent_tx(&self, key: u32, elements: usize, round: u32, payload: RawBytes) -> (Vec<ChunkMsg>, Tx) {
        let (chunks, headers) = self.push_headers(key, elements, round);
        let size = self.spec.dtype.size();
        (
            chunks,
            Tx::Borrowed {
                headers,
                payload,
                size,
            },
        )
    }

    /// Hands a lent push (its result written through `out`) to the I/O
    /// thread.
    fn send_lent(
        &self,
        key: u32,
        round: u32,
        chunks: Vec<ChunkMsg>,
        tx: Tx,
        out: RawDst,
    ) -> Result<Receiver<Completion>, WorkerError> {
        let (done, rx) = crossbeam_channel::bounded(1);
        self.send_request(Request {
            key,
            round,
            kind: Kind::Push,
            chunks,
            tx,
            sink: Sink::Borrowed(out),
            done,
        })?;
        Ok(rx)
    }

    /// [`Worker::push_pull_lent`] over one buffer: the datagrams' payloads
    /// (or the encoding, for `f32` values of a 16-bit job) read from it
    /// and the results written into it, through pointers made from one
    /// raw pointer, so that no shared and mutable slices of it coexist.
    fn push_pull_lent_in_place<E: Element>(
        &self,
        key: u32,
        buf: &mut [E],
    ) -> Result<(Receiver<Completion>, u32), WorkerError> {
        let elements = self.check_len(key, buf.len())?;
        let round = self.claim_next_round(key)?;
        self.keys.drop_values(key);
        let wire16 = E::WIRE.is_some();
        let direct = Src::of(&*buf).wire_bytes(self.spec.dtype).is_some();
        let owned =
            (!direct).then(|| self.messages(key, elements, MsgType::Push, round, Some(Src::of(&*buf))));
        let (bytes, base) = (std::mem::size_of_val(buf), buf.as_mut_ptr().cast::<u8>());
        let (chunks, tx) = match owned {
            Some((chunks, encoded)) => (chunks, Tx::Owned(encoded)),
            None => {
                let payload = RawBytes {
                    ptr: base.cast_const(),
                    len: bytes,
                };
                self.lent_tx(key, elements, round, payload)
            }
        };
        let rx = self.send_lent(key, round, chunks, tx, RawDst::from_raw(base, elements, wire16))?;
        Ok((rx, round))
    }

    /// Runs `f` with an [`Exchange`]: every `push_pull` started on it lends
    /// its gradient and output buffers to the I/O thread instead of copying
    /// them, and `exchange` returns only once every one of them has ended
    /// (also when `f` panics), with the first error if any failed.
    ///
    /// This saves the copies [`Worker::push_pull`] and [`Worker::wait`] make
    /// of every byte: results are written straight into the caller's output
    /// (not into a buffer then copied), and when the caller's elements are
    /// the job's wire type (`f32` for an `f32` job, [`half::bf16`] or
    /// [`half::f16`] for a 16-bit one) datagrams go out as a header plus
    /// the caller's gradient (not encoded into a buffer first). `f32`
    /// values for a 16-bit job are still encoded. With shared memory
    /// ([`WorkerConfig::shm`]) an `f32` gradient is copied once, from the
    /// caller's buffer into the staging region, and results are read from
    /// the result region straight into the caller's output, by the I/O
    /// thread (`push_pull` and `wait` make the same single copies, on the
    /// caller's thread).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), phub_worker::WorkerError> {
    /// # let w = phub_worker::Worker::join("http://127.0.0.1:7700", 1, 7, 0)?;
    /// # let (grads, mut params): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (vec![], vec![]);
    /// w.exchange(|x| {
    ///     for (k, (g, p)) in grads.iter().zip(params.iter_mut()).enumerate() {
    ///         x.push_pull(k as u32, g, p)?;
    ///     }
    ///     Ok::<(), phub_worker::WorkerError>(())
    /// })??;
    /// // params now hold the round's results.
    /// # Ok(())
    /// # }
    /// ```
    pub fn exchange<'b, R>(
        &self,
        f: impl for<'x> FnOnce(&'x Exchange<'x, 'b>) -> R,
    ) -> Result<R, WorkerError> {
        let x = Exchange {
            worker: self,
            waiting: std::cell::RefCell::new(Vec::new()),
            _lent: std::marker::PhantomData,
        };
        // Waits for every lent request if `f` unwinds: the buffers must not
        // be released while the I/O thread may still use them.
        struct Guard<'g, 'x, 'b>(&'g Exchange<'x, 'b>);
        impl Drop for Guard<'_, '_, '_> {
            fn drop(&mut self) {
                let _ = self.0.wait_all();
            }
        }
        let guard = Guard(&x);
        let r = f(&x);
        let ended = x.wait_all();
        drop(guard);
        ended.map(|()| r)
    }
}
