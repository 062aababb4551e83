//! The listener: accept loop, per-connection and per-source limits,
//! handlers on two bounded blocking pools (reads, and what reads cannot
//! hold up), shutdown that does not wait on clients.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::HeaderMap;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use crate::source::{Connections, Failures, Report, Source};
use crate::stream::{Body, BodyReader, Stream};

/// What one listener allows; see the crate documentation for what happens
/// when each is exceeded.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one source (an IPv4 address, or an
    /// IPv6 /64), so that one host cannot hold them all.
    pub max_connections_per_source: usize,
    /// Bytes of the request line and headers (at least 8 KiB).
    pub header_bytes: usize,
    /// Time from accepting a connection (and its TLS handshake) to the end
    /// of the request's headers.
    pub header_timeout: Duration,
    /// Bytes of one request body.
    pub body_bytes: usize,
    /// Time to receive a whole body, from the end of the headers.
    pub body_timeout: Duration,
    /// Bytes of all bodies being received or handled at once.
    pub inflight_body_bytes: usize,
    /// Handlers of [`Class::Read`] requests running at once (their head
    /// checks included).
    pub read_handlers: usize,
    /// Handlers of [`Class::Write`] requests running at once: a pool of
    /// its own, which reads cannot take.
    pub write_handlers: usize,
    /// Failed credential checks allowed per source in
    /// [`Limits::credential_window`]; past them, the source's failed
    /// checks are answered `429` (a right credential still passes) until
    /// that window ends.
    pub credential_failures: u32,
    /// The window of [`Limits::credential_failures`], from a source's
    /// first failure in it.
    pub credential_window: Duration,
    /// Longest life of one connection, answer included.
    pub connection_timeout: Duration,
    /// How long [`Server::shutdown`] lets requests in progress finish.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 256,
            max_connections_per_source: 64,
            header_bytes: 16 << 10,
            header_timeout: Duration::from_secs(5),
            body_bytes: 1 << 20,
            body_timeout: Duration::from_secs(30),
            inflight_body_bytes: 64 << 20,
            read_handlers: 8,
            write_handlers: 8,
            credential_failures: 10,
            credential_window: Duration::from_secs(10),
            connection_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(1),
        }
    }
}

/// A request as handlers see it: head and the whole body, or the body as
/// it arrives ([`Handler::body_stall`]).
#[derive(Debug)]
pub struct Request {
    /// The method, upper case (`GET`, `POST`, ...).
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query, without the `?`, if any.
    pub query: Option<String>,
    /// The headers.
    pub headers: HeaderMap,
    /// The body (empty for a head-only check, and for a body streamed to
    /// the handler).
    pub body: Bytes,
    /// The body as it arrives, for a request whose handler asked for it
    /// ([`Handler::body_stall`]); taken by the handler.
    pub body_stream: Option<BodyReader>,
    /// The client's address.
    pub peer: SocketAddr,
}

impl Request {
    /// The value of header `name`, if present and valid UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status.
    pub status: u16,
    /// The `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
    /// Further headers.
    pub headers: Vec<(&'static str, String)>,
    /// A body sent as it is made, instead of `body`
    /// ([`Response::streamed`]).
    pub stream: Option<Stream>,
}

impl Response {
    /// An answer with this status, content type and body.
    pub fn new(status: u16, content_type: &'static str, body: Vec<u8>) -> Response {
        Response {
            status,
            content_type,
            body,
            headers: Vec::new(),
            stream: None,
        }
    }

    /// An error answer: `{"error": message}`.
    pub fn error(status: u16, message: impl Into<String>) -> Response {
        let mut body = serde_json::json!({ "error": message.into() })
            .to_string()
            .into_bytes();
        body.push(b'\n');
        Response::new(status, "application/json", body)
    }

    /// Adds a header.
    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Response {
        self.headers.push((name, value.into()));
        self
    }

    fn into_hyper(self) -> hyper::Response<Body> {
        let mut b = hyper::Response::builder()
            .status(self.status)
            .header("Content-Type", self.content_type);
        for (k, v) in self.headers {
            b = b.header(k, v);
        }
        let streamed = self.stream.and_then(|s| {
            s.0.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take()
        });
        let body = match streamed {
            Some(s) => {
                b = b.header("Content-Length", s.len().to_string());
                Body::Streamed(s)
            }
            None => Body::Whole(Some(Bytes::from(self.body))),
        };
        b.body(body).unwrap_or_else(|e| {
            let mut r = hyper::Response::new(Body::Whole(Some(Bytes::from(format!(
                "{{\"error\":\"bad response: {e}\"}}"
            )))));
            *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
            r
        })
    }
}

/// Which handler pool a request runs in: requests of one class never wait
/// for handlers of the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Reads: at most [`Limits::read_handlers`] at once.
    Read,
    /// Requests that reads must not hold up (joins, the operator's
    /// changes): at most [`Limits::write_handlers`] at once.
    Write,
}

/// What answers requests. Runs on a blocking thread; may block (file
/// writes, calls to other daemons), except [`Handler::class`] and
/// [`Handler::needs_credential`], which the listener asks on its I/O
/// thread.
pub trait Handler: Send + Sync + 'static {
    /// The pool this request's head check and handler run in, decided from
    /// its head alone; must not block. By default `GET` and `HEAD` are
    /// [`Class::Read`], every other method [`Class::Write`].
    fn class(&self, head: &Request) -> Class {
        match head.method.as_str() {
            "GET" | "HEAD" => Class::Read,
            _ => Class::Write,
        }
    }

    /// Whether [`Handler::check_head`] checks a credential (a token) for
    /// this request; must not block. A `401` or `403` from that check is a
    /// failed credential check of the client's source, logged at WARN (a
    /// line or two per source and window); a source with
    /// [`Limits::credential_failures`] of them in
    /// [`Limits::credential_window`] gets `429` with `Retry-After` for each
    /// further failed check (a right credential still passes) until the
    /// window ends. By default no request needs one.
    fn needs_credential(&self, _head: &Request) -> bool {
        false
    }

    /// Checks a request's head before its body is read (authentication,
    /// route, method): an `Err` is the answer, and the body is never read.
    /// The [`Request`] given here has an empty body.
    fn check_head(&self, _head: &Request) -> Result<(), Response> {
        Ok(())
    }

    /// The largest body this request may have (checked after
    /// [`Handler::check_head`]); at most [`Limits::body_bytes`] applies.
    fn body_limit(&self, _head: &Request) -> usize {
        usize::MAX
    }

    /// `Some(stall)`: this request's body is not read whole first but
    /// handed to [`Handler::handle`] as it arrives
    /// ([`Request::body_stream`]), so that a body of gigabytes is never
    /// held in memory; neither [`Limits::body_timeout`] nor the
    /// connection's life bounds it, but it fails when the client sends
    /// nothing (or the handler reads nothing) for `stall`. The size limits
    /// apply as to a whole body. By default every body is read whole.
    fn body_stall(&self, _head: &Request) -> Option<Duration> {
        None
    }

    /// Answers a request.
    fn handle(&self, req: Request) -> Response;
}

/// A running listener. Dropping it shuts it down as [`Server::shutdown`]
/// does.
pub struct Server {
    addr: SocketAddr,
    stop: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

struct Ctx {
    handler: Arc<dyn Handler>,
    limits: Limits,
    bodies: Arc<Semaphore>,
    read_handlers: Arc<Semaphore>,
    write_handlers: Arc<Semaphore>,
    failures: Mutex<Failures>,
}

impl Ctx {
    fn pool(&self, class: Class) -> &Arc<Semaphore> {
        match class {
            Class::Read => &self.read_handlers,
            Class::Write => &self.write_handlers,
        }
    }

    fn failures(&self) -> MutexGuard<'_, Failures> {
        // Every change to the table is one insert or one field: a panic
        // while it was held left nothing half-done.
        self.failures.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Server {
    /// Binds `addr` (an error if it cannot) and serves `handler` on it, over
    /// TLS when `tls` is given, on a thread of its own named `name`.
    pub fn bind(
        name: &str,
        addr: SocketAddr,
        limits: Limits,
        tls: Option<Arc<rustls::ServerConfig>>,
        handler: Arc<dyn Handler>,
    ) -> std::io::Result<Server> {
        Server::serve(name, std::net::TcpListener::bind(addr)?, limits, tls, handler)
    }

    /// Serves `handler` on a listener already bound (so that its port is
    /// known before the handler is made), as [`Server::bind`] does.
    pub fn serve(
        name: &str,
        std_listener: std::net::TcpListener,
        limits: Limits,
        tls: Option<Arc<rustls::ServerConfig>>,
        handler: Arc<dyn Handler>,
    ) -> std::io::Result<Server> {
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (read, write) = (limits.read_handlers.max(1), limits.write_handlers.max(1));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .max_blocking_threads(read + write)
            .thread_name(format!("{name}-handler"))
            .build()?;
        let listener = {
            let _guard = rt.enter();
            TcpListener::from_std(std_listener)?
        };
        let (stop_tx, stop_rx) = watch::channel(false);
        let ctx = Arc::new(Ctx {
            handler,
            // One body of the largest size must always be able to get its share.
            bodies: Arc::new(Semaphore::new(
                limits.inflight_body_bytes.max(limits.body_bytes).max(1),
            )),
            read_handlers: Arc::new(Semaphore::new(read)),
            write_handlers: Arc::new(Semaphore::new(write)),
            failures: Mutex::new(Failures::new(
                limits.credential_failures,
                limits.credential_window,
            )),
            limits,
        });
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let grace = ctx.limits.shutdown_grace;
                rt.block_on(accept_loop(listener, ctx, tls.map(TlsAcceptor::from), stop_rx));
                // Handlers still running after the grace period are left to
                // finish on their own; nobody waits for them.
                rt.shutdown_timeout(grace.min(Duration::from_millis(100)));
            })?;
        Ok(Server {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests in progress finish for the grace
    /// period, then closes every connection and returns.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

async fn accept_loop(
    listener: TcpListener,
    ctx: Arc<Ctx>,
    tls: Option<TlsAcceptor>,
    mut stop: watch::Receiver<bool>,
) {
    let max = ctx.limits.max_connections.max(1);
    let conns = Arc::new(Semaphore::new(max));
    let rejects = Arc::new(Semaphore::new(max));
    let by_source = Arc::new(Mutex::new(Connections::new(
        ctx.limits.max_connections_per_source,
    )));
    let mut last_accept_error: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            _ = stop.changed() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, most likely: log once a second and
                // let connections drain.
                if last_accept_error.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                    log::warn!("accepting a connection: {e}");
                    last_accept_error = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let source = Source::of(peer.ip());
        // The source's share first, so that a source over its own limit
        // takes nothing from the others.
        let admitted = SourceSlot::take(&by_source, source)
            .ok_or(Refusal::Source(source))
            .and_then(|slot| {
                let permit = conns.clone().try_acquire_owned().map_err(|_| Refusal::Listener)?;
                Ok((slot, permit))
            });
        match admitted {
            Ok((slot, permit)) => {
                let (ctx, tls, stop) = (ctx.clone(), tls.clone(), stop.clone());
                tokio::spawn(async move {
                    connection(stream, peer, ctx, tls, stop).await;
                    drop(permit);
                    drop(slot);
                });
            }
            Err(refusal) => {
                // Over a limit: say so and close, within a second; beyond
                // twice the listener's limit, close without a word.
                if let Ok(p) = rejects.clone().try_acquire_owned() {
                    let message = match refusal {
                        Refusal::Listener => {
                            format!("too many connections: this listener serves at most {max} at once")
                        }
                        Refusal::Source(s) => format!(
                            "too many connections from {s}: this listener serves at most {} at once from one \
                             address",
                            ctx.limits.max_connections_per_source.max(1)
                        ),
                    };
                    let plain = tls.is_none();
                    tokio::spawn(async move {
                        if plain {
                            let _ =
                                tokio::time::timeout(Duration::from_secs(1), reject(stream, message)).await;
                        }
                        drop(p);
                    });
                }
            }
        }
    }
    drop(listener);
    // Requests in progress get the grace period; then the runtime goes.
    let grace = ctx.limits.shutdown_grace;
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(grace, conns.acquire_many(all)).await;
}

/// Which connection limit a refused connection hit.
enum Refusal {
    /// [`Limits::max_connections`].
    Listener,
    /// [`Limits::max_connections_per_source`], by this source.
    Source(Source),
}

/// A connection counted against its source's limit until dropped.
struct SourceSlot {
    table: Arc<Mutex<Connections>>,
    source: Source,
}

impl SourceSlot {
    /// Counts a connection from `source`; `None` when it holds its limit.
    fn take(table: &Arc<Mutex<Connections>>, source: Source) -> Option<SourceSlot> {
        let opened = lock_connections(table).open(source);
        opened.then(|| SourceSlot {
            table: table.clone(),
            source,
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut t = lock_connections(&self.table);
        t.close(self.source);
        debug_assert!(t.held_by(self.source) < t.per_source());
    }
}

fn lock_connections(t: &Mutex<Connections>) -> MutexGuard<'_, Connections> {
    // Each change is one counter: a panic cannot leave it half-done.
    t.lock().unwrap_or_else(|p| p.into_inner())
}

async fn reject(mut stream: TcpStream, message: String) {
    let body = Response::error(503, message);
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(&body.body).await;
    let _ = stream.shutdown().await;
}

async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    ctx: Arc<Ctx>,
    tls: Option<TlsAcceptor>,
    stop: watch::Receiver<bool>,
) {
    let deadline = Instant::now() + ctx.limits.connection_timeout;
    match tls {
        None => serve_http(stream, peer, ctx, stop, deadline).await,
        Some(acceptor) => {
            let handshake = tokio::time::timeout(ctx.limits.header_timeout, acceptor.accept(stream)).await;
            match handshake {
                Ok(Ok(s)) => serve_http(s, peer, ctx, stop, deadline).await,
                Ok(Err(e)) => log::debug!("TLS handshake with {peer}: {e}"),
                Err(_) => log::debug!("TLS handshake with {peer}: timed out"),
            }
        }
    }
}

async fn serve_http<S>(
    stream: S,
    peer: SocketAddr,
    ctx: Arc<Ctx>,
    mut stop: watch::Receiver<bool>,
    deadline: Instant,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc_ctx = ctx.clone();
    // Set once the answer is a streamed body, or the request's body is
    // streamed to its handler: their own stall limits bound the
    // connection from then on, not the connection's life.
    let streaming = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let svc_streaming = streaming.clone();
    let service = service_fn(move |req: hyper::Request<Incoming>| {
        let ctx = svc_ctx.clone();
        let streaming = svc_streaming.clone();
        async move {
            let resp = answer(&ctx, req, peer, &streaming).await;
            if resp.stream.is_some() {
                streaming.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            Ok::<_, Infallible>(resp.into_hyper())
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(ctx.limits.header_timeout)
        .max_buf_size(ctx.limits.header_bytes.max(8192))
        .keep_alive(false);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        r = &mut conn => {
            if let Err(e) = r {
                log::debug!("connection from {peer}: {e}");
            }
        }
        _ = tokio::time::sleep_until(deadline) => {
            if streaming.load(std::sync::atomic::Ordering::Relaxed) {
                // A streamed body ends by its own stall limit or when whole.
                tokio::select! {
                    r = &mut conn => {
                        if let Err(e) = r {
                            log::debug!("connection from {peer}: {e}");
                        }
                    }
                    _ = stop.changed() => {}
                }
            } else {
                log::debug!("connection from {peer}: closed after {:?}", ctx.limits.connection_timeout);
            }
        }
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            let grace = ctx.limits.shutdown_grace;
            let _ = tokio::time::timeout(grace, conn).await;
        }
    }
}

async fn answer(
    ctx: &Ctx,
    req: hyper::Request<Incoming>,
    peer: SocketAddr,
    streaming: &std::sync::atomic::AtomicBool,
) -> Response {
    let (parts, body) = req.into_parts();
    let head = Request {
        method: parts.method.as_str().to_ascii_uppercase(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts.headers,
        body: Bytes::new(),
        body_stream: None,
        peer,
    };
    let class = ctx.handler.class(&head);
    let guarded = ctx.handler.needs_credential(&head);
    let source = Source::of(peer.ip());
    // A source past its allowance of failed checks is still checked: a
    // right credential is served (every local client is one source on
    // loopback), a wrong one gets 429 instead of 401 or 403.
    let locked = if guarded {
        ctx.failures().admit(source, std::time::Instant::now()).err()
    } else {
        None
    };
    // The head is checked on a blocking thread too: checks may read files.
    let (head, checked) = match run_handler(ctx, class, move |h| {
        let r = h.check_head(&head);
        (head, r)
    })
    .await
    {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    if let Err(resp) = checked {
        if guarded && matches!(resp.status, 401 | 403) {
            if let Some(wait) = locked {
                ctx.failures().refused(source, std::time::Instant::now());
                return too_many_failures(ctx, source, wait);
            }
            let report = ctx.failures().failed(source, std::time::Instant::now());
            if let Some(r) = report {
                log_failure(ctx, &head, &resp, &r);
            }
        }
        return resp;
    }
    if let Some(stall) = ctx.handler.body_stall(&head) {
        return answer_streaming(ctx, class, body, head, stall, streaming).await;
    }
    let (body, permit) = match read_body(ctx, body, &head).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let req = Request { body, ..head };
    let resp = run_handler(ctx, class, move |h| h.handle(req))
        .await
        .unwrap_or_else(|r| r);
    drop(permit);
    resp
}

/// Answers a request whose body its handler reads as it arrives: the
/// handler runs while the body's frames are moved to it, and its answer is
/// sent as soon as it has one (a handler that refuses the body early is
/// not kept waiting for the rest of it).
async fn answer_streaming(
    ctx: &Ctx,
    class: Class,
    body: Incoming,
    head: Request,
    stall: Duration,
    streaming: &std::sync::atomic::AtomicBool,
) -> Response {
    let (limit, declared) = match body_bounds(ctx, &head) {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let limit = limit as u64;
    // Its progress bounds the connection from here on, not its life.
    streaming.store(true, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = tokio::sync::mpsc::channel(crate::stream::BODY_DEPTH);
    let req = Request {
        body_stream: Some(BodyReader::new(rx, declared)),
        ..head
    };
    let handled = run_handler(ctx, class, move |h| h.handle(req));
    let pumped = crate::stream::pump(body, tx, stall, limit);
    tokio::pin!(handled, pumped);
    let mut pumping = true;
    loop {
        tokio::select! {
            r = &mut handled => return r.unwrap_or_else(|r| r),
            () = &mut pumped, if pumping => pumping = false,
        }
    }
}

/// The answer to a request that needs a credential from a source that has
/// used up its failed checks: `429`, with when to try again.
fn too_many_failures(ctx: &Ctx, source: Source, wait: Duration) -> Response {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    Response::error(
        429,
        format!(
            "too many failed credential checks from {source}: at most {} in {:?}; try again in {secs} s",
            ctx.limits.credential_failures.max(1),
            ctx.limits.credential_window
        ),
    )
    .with_header("Retry-After", secs.max(1).to_string())
}

/// Logs a failed credential check that [`Failures::failed`] found worth a
/// line.
fn log_failure(ctx: &Ctx, head: &Request, resp: &Response, r: &Report) {
    let why = serde_json::from_slice::<serde_json::Value>(&resp.body)
        .ok()
        .and_then(|v| v.get("error")?.as_str().map(str::to_string))
        .unwrap_or_default();
    let earlier = match r.refused_since {
        0 => String::new(),
        n => format!("; {n} more failed checks answered 429 since the last line on this source"),
    };
    match r.locked_for {
        None => log::warn!(
            "credential refused to {} {} from {} ({}: {why}){earlier}",
            head.method,
            head.path,
            r.source,
            resp.status
        ),
        Some(d) => log::warn!(
            "{} failed credential checks from {} within {:?} (the latest {} {}: {why}); its requests that need \
             a credential are refused (429) for {} s{earlier}",
            r.failures,
            r.source,
            ctx.limits.credential_window,
            head.method,
            head.path,
            d.as_secs_f64().ceil()
        ),
    }
}

/// Runs `f` on a blocking thread once a handler slot of `class` is free.
/// The slot goes with `f` and is given back when `f` ends, not when the
/// client goes: a handler whose client left still counts, so the handlers
/// running are never more than the slots, nor more than the blocking
/// threads, and no request waits in the runtime's queue behind another
/// class.
async fn run_handler<T: Send + 'static>(
    ctx: &Ctx,
    class: Class,
    f: impl FnOnce(&dyn Handler) -> T + Send + 'static,
) -> Result<T, Response> {
    let Ok(slot) = ctx.pool(class).clone().acquire_owned().await else {
        return Err(Response::error(503, "the server is shutting down"));
    };
    let handler = ctx.handler.clone();
    let work = move || {
        let t = f(handler.as_ref());
        drop(slot);
        t
    };
    match tokio::task::spawn_blocking(work).await {
        Ok(t) => Ok(t),
        Err(e) => {
            log::error!("a request handler failed: {e}");
            Err(Response::error(
                500,
                "internal error while answering; see the daemon's log",
            ))
        }
    }
}

async fn read_body(
    ctx: &Ctx,
    mut body: Incoming,
    head: &Request,
) -> Result<(Bytes, Option<OwnedSemaphorePermit>), Response> {
    let (limit, declared) = body_bounds(ctx, head)?;
    if declared == Some(0) {
        return Ok((Bytes::new(), None));
    }
    let deadline = Instant::now() + ctx.limits.body_timeout;
    let mut buf = Vec::with_capacity(declared.map_or(0, |n| usize::try_from(n).unwrap_or(0)).min(limit));
    let mut permit: Option<OwnedSemaphorePermit> = None;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(Response::error(
                    408,
                    format!(
                        "the request body did not arrive within {:?} ({} bytes received)",
                        ctx.limits.body_timeout,
                        buf.len()
                    ),
                ))
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(Response::error(400, format!("reading the request body: {e}"))),
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else { continue };
        if buf.len() + data.len() > limit {
            return Err(too_large(limit));
        }
        let n = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let share = match tokio::time::timeout_at(deadline, ctx.bodies.clone().acquire_many_owned(n)).await {
            Ok(Ok(p)) => p,
            _ => {
                return Err(Response::error(
                    503,
                    format!(
                        "too many request bodies in flight (at most {} bytes at once); try again",
                        ctx.limits.inflight_body_bytes
                    ),
                ))
            }
        };
        match permit.as_mut() {
            Some(p) => p.merge(share),
            None => permit = Some(share),
        }
        buf.extend_from_slice(&data);
    }
    Ok((Bytes::from(buf), permit))
}

/// A request's body limit and its stated `Content-Length`, refused
/// (`400`, `413`) before a byte of the body is read when the length is
/// not a number or is over the limit.
fn body_bounds(ctx: &Ctx, head: &Request) -> Result<(usize, Option<u64>), Response> {
    let limit = ctx.limits.body_bytes.min(ctx.handler.body_limit(head));
    let declared = head
        .header("Content-Length")
        .map(|v| v.trim().parse::<u64>())
        .transpose()
        .map_err(|_| Response::error(400, "Content-Length is not a number"))?;
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit));
    }
    Ok((limit, declared))
}

fn too_large(limit: usize) -> Response {
    Response::error(413, too_large_why(limit as u64))
}

/// Why a body over `limit` bytes is refused (a whole body's `413`, or a
/// streamed body's reader's error).
pub(crate) fn too_large_why(limit: u64) -> String {
    format!("the request body is larger than the limit of {limit} bytes")
}
