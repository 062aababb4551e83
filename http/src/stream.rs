//! Bodies produced after their handler has returned: a handler answers
//! with [`Response::streamed`] and hands the [`StreamSender`] to a thread
//! of its own, which sends the body's bytes as they are made. The length
//! is stated up front (`Content-Length`), so a client reading the body
//! knows a cut one from a whole one.
//!
//! While a streamed body is being sent the connection's life
//! ([`crate::server::Limits::connection_timeout`]) no longer applies: a
//! large body may take longer. What bounds it instead is progress: a body
//! that gets nothing for its `stall` time ends in an error (the client
//! sees the connection close short of the stated length), and a sender
//! whose client reads nothing for its `stall` time is told the stream is
//! gone. A sender dropped before the stated length, or one that
//! [`StreamSender::fail`]s, cuts the body the same way.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};
use tokio::sync::mpsc::{self, error::TrySendError};

use crate::server::Response;

/// Slices a streamed body holds in flight between its sender and the
/// connection.
const DEPTH: usize = 4;

/// The sending half of a streamed body (module head).
#[derive(Debug)]
pub struct StreamSender {
    tx: mpsc::Sender<Result<Bytes, String>>,
    stall: Duration,
}

/// Why a streamed body's sender can send no more.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamGone {
    /// The connection closed (the client went away, or the body ended in
    /// an error).
    #[error("the client closed the connection")]
    Closed,
    /// The client read nothing for the stall time.
    #[error("the client read nothing for {0:?}")]
    Stalled(Duration),
}

impl StreamSender {
    /// Send the body's next bytes; waits (on this thread, not in an async
    /// context) while the client is behind, up to the stall time.
    pub fn send(&self, bytes: Vec<u8>) -> Result<(), StreamGone> {
        let mut item = Ok(Bytes::from(bytes));
        let start = std::time::Instant::now();
        loop {
            match self.tx.try_send(item) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Closed(_)) => return Err(StreamGone::Closed),
                Err(TrySendError::Full(back)) => {
                    if start.elapsed() >= self.stall {
                        return Err(StreamGone::Stalled(self.stall));
                    }
                    item = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// End the body short, with `why` in the listener's log.
    pub fn fail(&self, why: impl Into<String>) {
        let why = why.into();
        log::warn!("a streamed answer was cut: {why}");
        let _ = self.tx.try_send(Err(why));
    }
}

/// The receiving half, the body of a [`Response::streamed`].
#[derive(Debug)]
pub struct Streamed {
    rx: mpsc::Receiver<Result<Bytes, String>>,
    left: u64,
    stall: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Streamed {
    /// Bytes not yet sent.
    pub fn len(&self) -> u64 {
        self.left
    }

    /// Whether every byte is sent.
    pub fn is_empty(&self) -> bool {
        self.left == 0
    }
}

/// A streamed body of `len` bytes whose sender is given `stall` to make
/// progress (and whose client is given as long to read).
pub fn streamed(len: u64, stall: Duration) -> (StreamSender, Streamed) {
    let (tx, rx) = mpsc::channel(DEPTH);
    (
        StreamSender { tx, stall },
        Streamed {
            rx,
            left: len,
            stall,
            timer: None,
        },
    )
}

impl Response {
    /// An answer whose body `body` is sent as its sender makes it.
    pub fn streamed(status: u16, content_type: &'static str, body: Streamed) -> Response {
        let mut r = Response::new(status, content_type, Vec::new());
        r.stream = Some(Stream(std::sync::Arc::new(std::sync::Mutex::new(Some(body)))));
        r
    }
}

/// A streamed body inside a [`Response`] (taken once, when it is sent).
#[derive(Debug, Clone)]
pub struct Stream(pub(crate) std::sync::Arc<std::sync::Mutex<Option<Streamed>>>);

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Stream {}

/// The body hyper sends: whole, or streamed.
#[derive(Debug)]
pub(crate) enum Body {
    Whole(Option<Bytes>),
    Streamed(Streamed),
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let s = match self.get_mut() {
            Body::Whole(b) => return Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Streamed(s) => s,
        };
        if s.left == 0 {
            return Poll::Ready(None);
        }
        match s.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(b))) => {
                s.timer = None;
                let n = b.len() as u64;
                if n > s.left {
                    return Poll::Ready(Some(Err(std::io::Error::other(format!(
                        "the streamed body got {n} bytes with {} left of its stated length",
                        s.left
                    )))));
                }
                s.left -= n;
                Poll::Ready(Some(Ok(Frame::data(b))))
            }
            Poll::Ready(Some(Err(why))) => Poll::Ready(Some(Err(std::io::Error::other(why)))),
            Poll::Ready(None) => Poll::Ready(Some(Err(std::io::Error::other(format!(
                "the streamed body's sender stopped {} bytes short",
                s.left
            ))))),
            Poll::Pending => {
                let stall = s.stall;
                let timer = s.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(std::io::Error::other(format!(
                        "the streamed body's sender made no progress for {stall:?} ({} bytes left)",
                        s.left
                    ))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Whole(b) => b.is_none(),
            Body::Streamed(s) => s.left == 0,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Whole(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Streamed(s) => SizeHint::with_exact(s.left),
        }
    }
}

/// A request body handed to its handler as it arrives
/// ([`crate::Handler::body_stall`]), read with [`std::io::Read`] on the
/// handler's thread. It holds a few batches of the client's frames at a
/// time, not the body (at most 8 of 256 KiB): what the handler has not
/// read yet waits in the client's socket. It ends in an error (never a
/// short `Ok(0)`) when the client sends less than its `Content-Length`,
/// when the connection fails, when
/// the client sends nothing for the stall time, or when the body grows
/// past the handler's limit; the connection's life does not bound it
/// while it makes progress.
#[derive(Debug)]
pub struct BodyReader {
    rx: mpsc::Receiver<Result<Bytes, String>>,
    buf: Bytes,
    got: u64,
    declared: Option<u64>,
}

impl BodyReader {
    pub(crate) fn new(rx: mpsc::Receiver<Result<Bytes, String>>, declared: Option<u64>) -> BodyReader {
        BodyReader {
            rx,
            buf: Bytes::new(),
            got: 0,
            declared,
        }
    }

    /// The body's `Content-Length`, when the client stated one.
    pub fn declared_len(&self) -> Option<u64> {
        self.declared
    }

    /// Bytes read so far.
    pub fn received(&self) -> u64 {
        self.got
    }
}

impl std::io::Read for BodyReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        while self.buf.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.buf = b,
                Some(Err(why)) => return Err(std::io::Error::other(why)),
                None => {
                    return match self.declared {
                        Some(n) if self.got < n => Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!("the request body ended after {} of its {n} bytes", self.got),
                        )),
                        _ => Ok(0),
                    }
                }
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf.split_to(n));
        self.got += n as u64;
        Ok(n)
    }
}

/// Batches of a streamed request body held between the connection and
/// the handler.
pub(crate) const BODY_DEPTH: usize = 8;
/// Bytes of one such batch, at most.
const BODY_BATCH: usize = 256 << 10;

/// Moves a streamed request body's frames from the connection to its
/// [`BodyReader`] until the body ends, fails, stalls for `stall` (on
/// either side: a handler that reads nothing for `stall` is left too) or
/// passes `limit` bytes; each failure is told to the reader.
pub(crate) async fn pump(
    mut body: hyper::body::Incoming,
    tx: mpsc::Sender<Result<Bytes, String>>,
    stall: Duration,
    limit: u64,
) {
    use http_body_util::BodyExt;
    // Told behind the frames already queued, so that the reader never
    // takes a body cut short for a whole one.
    let tell = |why: String| async {
        let _ = tokio::time::timeout(stall, tx.send(Err(why))).await;
    };
    let mut got = 0u64;
    let mut batch = bytes::BytesMut::new();
    let mut ended = false;
    while !ended {
        // The next frame (within the stall), then those ready at once, up
        // to BODY_BATCH bytes: the reader is woken once a batch, not once
        // a read of the socket (a frame is at most the connection's 16 KiB
        // buffer).
        let mut wait = stall;
        while batch.len() < BODY_BATCH {
            let next = match tokio::time::timeout(wait, body.frame()).await {
                Err(_) if wait.is_zero() => break,
                Err(_) => {
                    tell(format!(
                        "the request body made no progress for {stall:?} ({got} bytes received)"
                    ))
                    .await;
                    return;
                }
                Ok(next) => next,
            };
            wait = Duration::ZERO;
            match next {
                None => {
                    ended = true;
                    break;
                }
                Some(Err(e)) => {
                    tell(format!("reading the request body: {e}")).await;
                    return;
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else { continue };
                    got += data.len() as u64;
                    if got > limit {
                        tell(crate::server::too_large_why(limit)).await;
                        return;
                    }
                    batch.extend_from_slice(&data);
                }
            }
        }
        // The handler gone, or reading nothing for the stall time: stop.
        if !batch.is_empty()
            && !matches!(
                tokio::time::timeout(stall, tx.send(Ok(batch.split().freeze()))).await,
                Ok(Ok(()))
            )
        {
            return;
        }
    }
}
