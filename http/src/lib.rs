//! phub's HTTP listener, shared by phub-control's API and the dataplane's
//! management API, and the TLS settings of phub's HTTP clients.
//!
//! The listener is hyper 1 on a tokio runtime of its own (one thread for
//! every connection's I/O, a bounded pool for the handlers), so that no
//! client, however slow or large, can hold the API:
//!
//! - at most [`Limits::max_connections`] connections at once; one more is
//!   answered `503` and closed at once;
//! - the request head (line and headers) must arrive within
//!   [`Limits::header_timeout`] and fit [`Limits::header_bytes`] (`431`
//!   otherwise); one request per connection (no keep-alive);
//! - the body must fit [`Limits::body_bytes`] (`413`, decided from
//!   `Content-Length` before a byte of it is read) and arrive within
//!   [`Limits::body_timeout`] (`408`); all bodies being received at once
//!   share [`Limits::inflight_body_bytes`] (`503` when a body cannot get its
//!   share in time);
//! - at most [`Limits::handlers`] handlers run at once, on blocking threads;
//!   a connection lives at most [`Limits::connection_timeout`] in all;
//! - [`Server::shutdown`] stops accepting, gives requests in progress
//!   [`Limits::shutdown_grace`] to finish, then drops every connection: it
//!   never waits on a client.
//!
//! Every refusal by the listener is a JSON body `{"error": "..."}` that says
//! which limit was hit, the same shape the APIs use for their own errors.
//!
//! Handlers are plain synchronous functions of a buffered [`Request`]; the
//! routing stays in the daemons.

pub mod secret;
#[cfg(feature = "server")]
mod server;
mod tls;

#[cfg(feature = "server")]
pub use server::{Handler, Limits, Request, Response, Server};
pub use tls::{agent, client_config, server_config, TlsError, CA_FILE_ENV};

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
