//! phub's HTTP listener, shared by phub-control's API and the dataplane's
//! management API, the TLS settings of phub's HTTP clients, and the typed
//! client of both APIs.
//!
//! The listener is hyper 1 on a tokio runtime of its own (one thread for
//! every connection's I/O, two bounded pools for the handlers), so that no
//! client, however slow, large or numerous, can hold the API:
//!
//! - at most [`Limits::max_connections`] (256) connections at once, and at
//!   most [`Limits::max_connections_per_source`] (64) from one source (an
//!   IPv4 address, or an IPv6 /64); one more is answered `503`, naming the
//!   limit, and closed at once;
//! - the request head (line and headers) must arrive within
//!   [`Limits::header_timeout`] (5 s) and fit [`Limits::header_bytes`]
//!   (16 KiB; `431` otherwise); one request per connection (no
//!   keep-alive);
//! - the body must fit [`Limits::body_bytes`] (1 MiB; `413`, decided from
//!   `Content-Length` before a byte of it is read) and arrive within
//!   [`Limits::body_timeout`] (30 s; `408`); all bodies being received at
//!   once share [`Limits::inflight_body_bytes`] (64 MiB; `503` when a body
//!   cannot get its share in time); a handler may instead take a route's
//!   body as it arrives ([`Handler::body_stall`], [`BodyReader`]: a
//!   checkpoint of gigabytes is never held whole), bounded by its stall
//!   time rather than the body timeout and the connection's life;
//! - handlers run on blocking threads in two pools: the daemon classes
//!   each request from its head ([`Handler::class`]), reads get at most
//!   [`Limits::read_handlers`] (8) at once, and what reads must not hold
//!   up (joins, the operator's and control's changes) has
//!   [`Limits::write_handlers`] (8) of its own, which reads never take;
//!   a connection lives at most [`Limits::connection_timeout`] (120 s) in
//!   all;
//! - a request that needs a credential ([`Handler::needs_credential`])
//!   and fails its check (`401`, `403`) is logged at WARN with its source,
//!   at most two lines per source and window; after
//!   [`Limits::credential_failures`] (10) such failures within
//!   [`Limits::credential_window`] (10 s) of the first, the source's
//!   failed checks are answered `429` with `Retry-After` (neither logged
//!   nor counted as failures, only told as a count in the source's next
//!   line) until the window ends. A right credential from that source is
//!   still served: every local client that connects from 127.0.0.1 is one
//!   source, and a local guesser must not lock out control calling its
//!   dataplane on loopback. The guesses are not slowed: the tokens are
//!   128 random bits;
//! - [`Server::shutdown`] stops accepting, gives requests in progress
//!   [`Limits::shutdown_grace`] (1 s) to finish, then drops every
//!   connection: it never waits on a client.
//!
//! The figures are [`Limits::default`]'s. Every refusal by the listener is
//! a JSON body `{"error": "..."}` that says which limit was hit, the same
//! shape the APIs use for their own errors.
//!
//! Handlers are plain synchronous functions of a [`Request`] (buffered,
//! or with its body streamed where the handler asks for it); the
//! routing stays in the daemons (over `phub_proto::routes`).
//!
//! [`client`] is the other side: the one typed client of both APIs;
//! [`controls`] puts it in front of several phub-controls, one leading.

pub mod client;
pub mod controls;
pub mod secret;
#[cfg(feature = "server")]
mod server;
#[cfg(feature = "server")]
mod source;
#[cfg(feature = "server")]
pub mod stream;
mod tls;

pub use client::{Client, ClientError};
pub use controls::{Asked, Controls, ControlsError, Timeouts, CONTROL_ENV, LEADER_HEADER};
#[cfg(feature = "server")]
pub use server::{Class, Handler, Limits, Request, Response, Server};
#[cfg(feature = "server")]
pub use stream::{streamed, BodyReader, StreamGone, StreamSender, Streamed};
pub use tls::{agent, client_config, client_config_with_identity, server_config, TlsError, CA_FILE_ENV};

/// A re-export, so that users name the same rustls as this crate.
pub use rustls;

/// Whether `host` (the host part of a listen address) is a loopback
/// address: such listeners are reachable from this machine only.
pub fn is_loopback(addr: &std::net::SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// The token in an `Authorization: Bearer <token>` header value, or why
/// there is none. The comparison with the expected token is
/// [`token_matches`].
pub fn bearer(header: Option<&str>) -> Result<&str, &'static str> {
    let Some(value) = header else {
        return Err("no Authorization header");
    };
    match value.trim().strip_prefix("Bearer ") {
        Some(t) if !t.trim().is_empty() => Ok(t.trim()),
        _ => Err("the Authorization header must be `Bearer <token>`"),
    }
}

/// Compares a given token with the expected one without an early exit, so
/// that the time taken says nothing of the token.
pub fn token_matches(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    a.iter()
        .zip(b)
        .fold(a.len() ^ b.len(), |d, (x, y)| d | usize::from(x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer(Some("Bearer abc")), Ok("abc"));
        assert_eq!(bearer(Some("  Bearer  abc ")), Ok("abc"));
        assert!(bearer(None).is_err());
        assert!(bearer(Some("abc")).is_err());
        assert!(bearer(Some("Bearer ")).is_err());
        assert!(bearer(Some("Bearer    ")).is_err());
        assert!(token_matches("abc", "abc"));
        assert!(!token_matches("abd", "abc"));
        assert!(!token_matches("ab", "abc"));
        assert!(!token_matches("", "abc"));
    }
}
