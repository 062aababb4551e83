//! The listener: accept loop, per-connection limits, handlers on a bounded
//! blocking pool, shutdown that does not wait on clients.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
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

/// What one listener allows; see the crate documentation for what happens
/// when each is exceeded.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
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
    /// Handlers running at once.
    pub handlers: usize,
    /// Longest life of one connection, answer included.
    pub connection_timeout: Duration,
    /// How long [`Server::shutdown`] lets requests in progress finish.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 256,
            header_bytes: 16 << 10,
            header_timeout: Duration::from_secs(5),
            body_bytes: 1 << 20,
            body_timeout: Duration::from_secs(30),
            inflight_body_bytes: 64 << 20,
            handlers: 8,
            connection_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(1),
        }
    }
}

/// A request as handlers see it: head and the whole body.
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
    /// The body (empty for a head-only check).
    pub body: Bytes,
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
}

impl Response {
    /// An answer with this status, content type and body.
    pub fn new(status: u16, content_type: &'static str, body: Vec<u8>) -> Response {
        Response {
            status,
            content_type,
            body,
            headers: Vec::new(),
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

    fn into_hyper(self) -> hyper::Response<Full<Bytes>> {
        let mut b = hyper::Response::builder()
            .status(self.status)
            .header("Content-Type", self.content_type);
        for (k, v) in self.headers {
            b = b.header(k, v);
        }
        b.body(Full::new(Bytes::from(self.body))).unwrap_or_else(|e| {
            let mut r = hyper::Response::new(Full::new(Bytes::from(format!(
                "{{\"error\":\"bad response: {e}\"}}"
            ))));
            *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
            r
        })
    }
}

/// What answers requests. Runs on a blocking thread; may block (file
/// writes, calls to other daemons).
pub trait Handler: Send + Sync + 'static {
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
    handlers: Arc<Semaphore>,
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
        let handlers = limits.handlers.max(1);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .max_blocking_threads(handlers)
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
            handlers: Arc::new(Semaphore::new(handlers)),
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
        match conns.clone().try_acquire_owned() {
            Ok(permit) => {
                let (ctx, tls, stop) = (ctx.clone(), tls.clone(), stop.clone());
                tokio::spawn(async move {
                    connection(stream, peer, ctx, tls, stop).await;
                    drop(permit);
                });
            }
            Err(_) => {
                // Over the limit: say so and close, within a second; beyond
                // twice the limit, close without a word.
                if let Ok(p) = rejects.clone().try_acquire_owned() {
                    let plain = tls.is_none();
                    tokio::spawn(async move {
                        if plain {
                            let _ = tokio::time::timeout(Duration::from_secs(1), reject(stream, max)).await;
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

async fn reject(mut stream: TcpStream, max: usize) {
    let body = Response::error(
        503,
        format!("too many connections: this listener serves at most {max} at once"),
    );
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
    let service = service_fn(move |req: hyper::Request<Incoming>| {
        let ctx = svc_ctx.clone();
        async move { Ok::<_, Infallible>(answer(&ctx, req, peer).await.into_hyper()) }
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
            log::debug!("connection from {peer}: closed after {:?}", ctx.limits.connection_timeout);
        }
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            let grace = ctx.limits.shutdown_grace;
            let _ = tokio::time::timeout(grace, conn).await;
        }
    }
}

async fn answer(ctx: &Ctx, req: hyper::Request<Incoming>, peer: SocketAddr) -> Response {
    let (parts, body) = req.into_parts();
    let head = Request {
        method: parts.method.as_str().to_ascii_uppercase(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts.headers,
        body: Bytes::new(),
        peer,
    };
    // The head is checked on a blocking thread too: checks may read files.
    let (head, checked) = match run_handler(ctx, move |h| {
        let r = h.check_head(&head);
        (head, r)
    })
    .await
    {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    if let Err(resp) = checked {
        return resp;
    }
    let (body, permit) = match read_body(ctx, body, &head).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let req = Request { body, ..head };
    let resp = run_handler(ctx, move |h| h.handle(req))
        .await
        .unwrap_or_else(|r| r);
    drop(permit);
    resp
}

/// Runs `f` on a blocking thread once a handler slot is free.
async fn run_handler<T: Send + 'static>(
    ctx: &Ctx,
    f: impl FnOnce(&dyn Handler) -> T + Send + 'static,
) -> Result<T, Response> {
    let Ok(_slot) = ctx.handlers.clone().acquire_owned().await else {
        return Err(Response::error(503, "the server is shutting down"));
    };
    let handler = ctx.handler.clone();
    match tokio::task::spawn_blocking(move || f(handler.as_ref())).await {
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
    let limit = ctx.limits.body_bytes.min(ctx.handler.body_limit(head));
    let declared = head
        .header("Content-Length")
        .map(|v| v.trim().parse::<u64>())
        .transpose()
        .map_err(|_| Response::error(400, "Content-Length is not a number"))?;
    if let Some(n) = declared {
        if n > limit as u64 {
            return Err(too_large(limit));
        }
        if n == 0 {
            return Ok((Bytes::new(), None));
        }
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

fn too_large(limit: usize) -> Response {
    Response::error(
        413,
        format!("the request body is larger than the limit of {limit} bytes"),
    )
}
