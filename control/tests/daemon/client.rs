//! Talking to the daemon under test as its clients do: requests with or
//! without the operator token, typed answers and refusals, and waiting
//! for what a test expects to happen.

use std::time::{Duration, Instant};

use phub_control::daemon::Daemon;
use phub_proto::api::ApiError;
use phub_proto::routes::{ControlRoute as R, Route};

/// Sends `method path` with `body`, with the operator token when `token`;
/// (status, body).
pub(crate) fn send(d: &Daemon, method: &str, path: &str, body: Option<&str>, token: bool) -> (u16, String) {
    let url = format!("http://{}{path}", d.addr());
    let mut req = ureq::request(method, &url);
    if token {
        req = req.set("Authorization", &format!("Bearer {}", d.operator_token()));
    }
    let res = match body {
        Some(b) => req.send_string(b),
        None => req.call(),
    };
    match res {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap()),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

/// Sends `method path` with the operator token; (status, body).
pub(crate) fn call(d: &Daemon, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    send(d, method, path, body, true)
}

/// Sends `route` as a client does (its method, path and query) with the
/// operator token; (status, body).
pub(crate) fn call_route(d: &Daemon, route: &R, body: Option<&str>) -> (u16, String) {
    call(d, route.method().as_str(), &route.path(), body)
}

/// Sends `route`, expecting success; its answer.
pub(crate) fn ok_at<T: serde::de::DeserializeOwned>(d: &Daemon, route: &R, body: Option<&str>) -> T {
    let (method, path) = (route.method(), route.path());
    let (s, text) = call(d, method.as_str(), &path, body);
    assert!((200..300).contains(&s), "{method} {path}: {s} {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Sends `route`, expecting error `status`; returns its message.
pub(crate) fn err_at(d: &Daemon, route: &R, body: Option<&str>, status: u16) -> String {
    err(d, route.method().as_str(), &route.path(), body, status)
}

/// Sends `method path`, expecting error `status`; returns its message.
pub(crate) fn err(d: &Daemon, method: &str, path: &str, body: Option<&str>, status: u16) -> String {
    let (s, text) = call(d, method, path, body);
    assert_eq!(s, status, "{method} {path}: {text}");
    serde_json::from_str::<ApiError>(&text)
        .unwrap_or_else(|e| panic!("not an ApiError ({e}): {text}"))
        .error
}

/// Waits until `f` holds, 5 s at most.
pub(crate) fn wait_for(what: &str, f: impl FnMut() -> bool) {
    wait_within(what, Duration::from_secs(5), f);
}

/// Waits until `f` holds, `within` at most; how long it took.
pub(crate) fn wait_within(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < within,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    t.elapsed()
}
