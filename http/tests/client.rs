//! The typed client against phub-http's own listener on loopback: each
//! call's method, path, body and token arrive as its route says, answers
//! are read into the call's type, and every kind of failure comes back as
//! its own [`ClientError`].

use std::sync::Arc;

use phub_http::{Client, ClientError, Handler, Limits, Request, Response, Server};
use phub_proto::api::RetryRequest;
use phub_proto::routes::{control, mgmt, ControlRoute, MgmtRoute};

/// A server that parses every request with the typed routes, as the
/// daemons do, and answers what the test checks.
struct Routes;

impl Handler for Routes {
    fn handle(&self, req: Request) -> Response {
        let ct = req.header("Content-Type").unwrap_or("none").to_string();
        let auth = req.header("Authorization").unwrap_or("none").to_string();
        // `GET /v1/jobs` and `GET /v1/stats` are both APIs' routes: the
        // test sends `GET /v1/jobs` as control's.
        if let Some(r) = MgmtRoute::parse(&req.method, &req.path)
            .ok()
            .filter(|r| *r != MgmtRoute::Jobs)
        {
            return match r {
                MgmtRoute::Remove { job: 3 } => Response::new(204, "application/json", Vec::new()),
                // What the client sent, as the answer's bytes.
                MgmtRoute::Checkpoint { job: 3 } => {
                    Response::new(200, "application/octet-stream", auth.into_bytes())
                }
                MgmtRoute::Install { job: 4 }
                    if ct == "application/octet-stream" && req.body[..] == b"abc"[..] =>
                {
                    Response::new(201, "application/json", b"{}".to_vec())
                }
                MgmtRoute::Stats => Response::new(200, "application/json", b"not json".to_vec()),
                MgmtRoute::Checkpoint { job: 6 } => Response::error(409, "job 6 is held"),
                MgmtRoute::Checkpoint { job: 7 } => {
                    Response::new(502, "text/plain", b" bad gateway \n".to_vec())
                }
                other => Response::error(404, format!("unexpected {other:?}")),
            };
        }
        match ControlRoute::parse(&req.method, &req.path, req.query.as_deref()) {
            Ok(ControlRoute::Jobs) => Response::new(200, "application/json", b"[]".to_vec()),
            Ok(ControlRoute::Metrics) => Response::new(200, "text/plain", b"phub_up 1\n".to_vec()),
            // The body's type, as an error the test reads.
            Ok(ControlRoute::Admit) => Response::error(400, ct),
            Ok(ControlRoute::Retry { job: 5 }) => {
                Response::error(400, format!("{ct} {}", String::from_utf8_lossy(&req.body)))
            }
            other => Response::error(404, format!("unexpected {other:?}")),
        }
    }
}

/// The message of a call that failed.
fn msg<A: std::fmt::Debug>(r: Result<A, ClientError>) -> String {
    r.unwrap_err().message().to_string()
}

fn server() -> (Server, String) {
    let srv = Server::bind(
        "test-client",
        "127.0.0.1:0".parse().unwrap(),
        Limits::default(),
        None,
        Arc::new(Routes),
    )
    .unwrap();
    let url = format!("http://{}", srv.local_addr());
    (srv, url)
}

#[test]
fn calls_arrive_as_their_routes_say_and_answers_are_typed() {
    let (srv, url) = server();
    let c = Client::plain(&format!("{url}/")).unwrap();
    assert_eq!(c.base(), url, "the trailing slash is dropped");
    assert_eq!(c.send(&mgmt::remove(3)), Ok(()));
    assert_eq!(c.send(&control::jobs()), Ok(Vec::new()));
    assert_eq!(c.send(&control::metrics()), Ok("phub_up 1\n".to_string()));
    assert_eq!(c.send(&mgmt::restore(4, b"abc")), Ok(()));
    // No token unless given; then on every call.
    assert_eq!(c.send(&mgmt::checkpoint(3)), Ok(b"none".to_vec()));
    let t = c.clone().with_token(Some("s3cret".into()));
    assert_eq!(t.send(&mgmt::checkpoint(3)), Ok(b"Bearer s3cret".to_vec()));
    // A spec goes as TOML or JSON, whichever it is; a retry as JSON.
    assert_eq!(msg(c.send(&control::admit("name = \"a\"\n"))), "application/toml");
    assert_eq!(
        msg(c.send(&control::admit("{\"name\": \"a\"}"))),
        "application/json"
    );
    assert_eq!(
        msg(c.send(&control::retry(
            5,
            &RetryRequest {
                discard_checkpoint: true
            }
        ))),
        "application/json {\"discard_checkpoint\":true}"
    );
    srv.shutdown();
}

#[test]
fn each_failure_is_its_own_error() {
    let (srv, url) = server();
    let c = Client::plain(&url).unwrap();
    assert_eq!(
        c.send(&mgmt::checkpoint(6)),
        Err(ClientError::Api {
            status: 409,
            message: "job 6 is held".into()
        })
    );
    let e = c.send(&mgmt::checkpoint(7)).unwrap_err();
    assert_eq!(
        e,
        ClientError::Http {
            status: 502,
            url: format!("{url}/v1/jobs/7/checkpoint"),
            message: "bad gateway".into()
        }
    );
    assert_eq!(
        e.to_string(),
        format!("HTTP 502 from {url}/v1/jobs/7/checkpoint: bad gateway")
    );
    let e = c.send(&mgmt::stats()).unwrap_err();
    assert!(
        matches!(&e, ClientError::BadAnswer { what, .. } if what == "GET /v1/stats"),
        "{e:?}"
    );
    assert_eq!(e.status(), None);
    srv.shutdown();
    // Nothing listens there now.
    let e = c.send(&mgmt::remove(3)).unwrap_err();
    assert!(
        matches!(&e, ClientError::Unreachable { base, .. } if *base == url),
        "{e:?}"
    );
    assert!(e.to_string().starts_with(&format!("cannot reach {url}: ")), "{e}");
}
