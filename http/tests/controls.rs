//! [`Controls`] against fake controls on loopback: a port nothing listens
//! on, a control that takes the request and never answers, followers that
//! answer `503` with or without `X-Phub-Leader`, one that leads after a
//! few `503`s, one that refuses with a `4xx`. Each test says which
//! controls were asked (each fake counts its requests) and what the error
//! names.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_http::{ClientError, Controls, Handler, Limits, Request, Response, Server, Timeouts, LEADER_HEADER};
use phub_proto::routes::control;

/// How a fake control answers.
#[derive(Clone)]
enum Part {
    /// Serves every call (`GET /v1/jobs`: no jobs; `POST /v1/jobs`: 400
    /// "admitted nothing", so that the test sees that it arrived).
    Leader,
    /// Answers 503, naming the leader at this URL when given.
    Follower(Option<String>),
    /// Answers 503 "no control leads" to the first N requests, then leads.
    LeadsAfter(u32),
    /// Answers 403.
    Refuses,
}

struct Fake {
    part: Part,
    asked: Arc<AtomicU32>,
}

impl Handler for Fake {
    fn handle(&self, req: Request) -> Response {
        let n = self.asked.fetch_add(1, Ordering::SeqCst);
        let lead = || match req.method.as_str() {
            "GET" => Response::new(200, "application/json", b"[]".to_vec()),
            _ => Response::error(400, "admitted nothing"),
        };
        match &self.part {
            Part::Leader => lead(),
            Part::Follower(Some(l)) => {
                Response::error(503, format!("a follower; send writes to the leader at {l}"))
                    .with_header(LEADER_HEADER, l.clone())
            }
            Part::Follower(None) => Response::error(503, "cannot reach etcd at 127.0.0.1:1"),
            Part::LeadsAfter(k) if n < *k => Response::error(503, "no control leads now"),
            Part::LeadsAfter(_) => lead(),
            Part::Refuses => Response::error(403, "wrong operator token"),
        }
    }
}

/// A fake control: its server, URL and request count.
struct Ctl {
    srv: Option<Server>,
    url: String,
    asked: Arc<AtomicU32>,
}

impl Ctl {
    fn start(part: Part) -> Ctl {
        let asked = Arc::new(AtomicU32::new(0));
        let srv = Server::bind(
            "fake-control",
            "127.0.0.1:0".parse().unwrap(),
            Limits::default(),
            None,
            Arc::new(Fake {
                part,
                asked: Arc::clone(&asked),
            }),
        )
        .unwrap();
        let url = format!("http://{}", srv.local_addr());
        Ctl {
            srv: Some(srv),
            url,
            asked,
        }
    }

    fn asked(&self) -> u32 {
        self.asked.load(Ordering::SeqCst)
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        if let Some(s) = self.srv.take() {
            s.shutdown();
        }
    }
}

/// A URL nothing listens on (a port bound, then closed).
fn refused() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

/// A control that takes connections (the kernel's backlog) and never
/// answers: kept open while the listener lives.
fn silent() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    (l, url)
}

fn timeouts(call_ms: u64, wait_ms: u64) -> Timeouts {
    Timeouts {
        connect: Duration::from_millis(call_ms),
        call: Duration::from_millis(call_ms),
        wait: Duration::from_millis(wait_ms),
    }
}

#[test]
fn a_refused_connection_moves_on_and_the_next_call_starts_where_one_served() {
    let dead = refused();
    let live = Ctl::start(Part::Leader);
    let c = Controls::new(
        &format!(" {dead}/ , {} ,{dead}", live.url),
        None,
        Timeouts::default(),
    )
    .unwrap();
    assert_eq!(c.bases(), format!("{dead},{}", live.url), "trimmed, each once");
    assert_eq!(c.send(&control::jobs()), Ok(Vec::new()));
    assert_eq!(c.base(), live.url);
    // A write too: refused means it never left.
    let e = c.send(&control::admit("name = \"a\"\n")).unwrap_err();
    assert_eq!(e.message(), "admitted nothing", "{e}");
    assert_eq!(live.asked(), 2, "each call reached the live control once");
}

#[test]
fn a_follower_s_leader_header_is_followed_even_to_a_control_not_given() {
    let leader = Ctl::start(Part::Leader);
    let follower = Ctl::start(Part::Follower(Some(format!("{}/", leader.url))));
    let other = Ctl::start(Part::Refuses);
    // The follower first, then a control that would refuse: the header
    // sends the call to the leader, which was not given, before it.
    let c = Controls::new(
        &format!("{},{}", follower.url, other.url),
        None,
        Timeouts::default(),
    )
    .unwrap();
    let e = c.send(&control::admit("name = \"a\"\n")).unwrap_err();
    assert_eq!(e.message(), "admitted nothing", "{e}");
    assert_eq!((follower.asked(), leader.asked(), other.asked()), (1, 1, 0));
    assert_eq!(c.base(), leader.url, "the leader serves the next call first");
    assert_eq!(
        c.bases(),
        format!("{},{},{}", follower.url, other.url, leader.url)
    );
    assert_eq!(c.send(&control::jobs()), Ok(Vec::new()));
    assert_eq!((follower.asked(), leader.asked()), (1, 2));
}

#[test]
fn a_slow_control_s_read_moves_on_its_write_is_not_sent_again() {
    let (_hold, slow) = silent();
    let live = Ctl::start(Part::Leader);
    let c = Controls::new(&format!("{slow},{}", live.url), None, timeouts(300, 5_000)).unwrap();
    let t0 = Instant::now();
    assert_eq!(c.send(&control::jobs()), Ok(Vec::new()));
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "the read waited out its timeout"
    );
    assert_eq!(live.asked(), 1);

    // A write to it left and got no answer: it may have been carried out,
    // so no other control gets it.
    let c = Controls::new(&format!("{slow},{}", live.url), None, timeouts(300, 5_000)).unwrap();
    let e = c.send(&control::admit("name = \"a\"\n")).unwrap_err();
    assert!(
        matches!(&e, ClientError::Unanswered { base, .. } if *base == slow),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with(&format!("POST /v1/jobs was sent to {slow} and no answer came"))
            && text.contains("may have been carried out"),
        "{text}"
    );
    assert_eq!(live.asked(), 1, "the write went nowhere else");
}

#[test]
fn a_takeover_is_waited_out() {
    let a = Ctl::start(Part::Follower(None));
    let b = Ctl::start(Part::LeadsAfter(3));
    let c = Controls::new(&format!("{},{}", a.url, b.url), None, timeouts(1_000, 5_000)).unwrap();
    let t0 = Instant::now();
    let e = c.send(&control::admit("name = \"a\"\n")).unwrap_err();
    assert_eq!(e.message(), "admitted nothing", "{e}");
    // Each round goes on from the control after the last one asked: a, b;
    // b, a; b, a; b (served).
    assert_eq!((a.asked(), b.asked()), (3, 4), "b: three 503s, then served");
    let took = t0.elapsed();
    assert!(
        took >= 3 * phub_http::controls::PAUSE && took < Duration::from_secs(4),
        "a pause after each round that served nothing: {took:?}"
    );
}

#[test]
fn the_wait_is_bounded_and_the_error_names_every_control_and_its_answer() {
    let dead = refused();
    let a = Ctl::start(Part::Follower(None));
    let b = Ctl::start(Part::Follower(Some(a.url.clone())));
    let c = Controls::new(&format!("{dead},{},{}", a.url, b.url), None, timeouts(1_000, 700)).unwrap();
    let t0 = Instant::now();
    let e = c.send(&control::admit("name = \"a\"\n")).unwrap_err();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_millis(700 + 1_000),
        "asked for the wait, then at most one call's timeout: {took:?}"
    );
    let ClientError::NoneServed { what, asked, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(what, "POST /v1/jobs");
    let urls: Vec<&str> = asked.iter().map(|a| a.url.as_str()).collect();
    assert_eq!(urls, [dead.as_str(), &a.url, &b.url], "in the order first asked");
    assert_eq!(asked[0].status, None);
    assert_eq!(asked[1].status, Some(503));
    assert_eq!(asked[1].answer, "cannot reach etcd at 127.0.0.1:1");
    assert!(
        asked.iter().all(|x| x.times >= 2),
        "more than one round in 700 ms: {asked:?}"
    );
    assert_eq!(e.status(), Some(503), "the last answer's");
    let text = e.to_string();
    assert!(
        text.starts_with("no phub-control served POST /v1/jobs within 0."),
        "{text}"
    );
    for part in [
        format!("{dead} (no answer, "),
        format!("{} (503, ", a.url),
        "cannot reach etcd at 127.0.0.1:1".to_string(),
        format!("send writes to the leader at {}", a.url),
    ] {
        assert!(text.contains(&part), "{part:?} in {text}");
    }
}

#[test]
fn an_answer_other_than_503_is_the_call_s() {
    let no = Ctl::start(Part::Refuses);
    let live = Ctl::start(Part::Leader);
    let c = Controls::new(&format!("{},{}", no.url, live.url), None, Timeouts::default()).unwrap();
    let e = c.send(&control::jobs()).unwrap_err();
    assert_eq!(
        e,
        ClientError::Api {
            status: 403,
            message: "wrong operator token".into()
        }
    );
    assert_eq!(live.asked(), 0);
}

#[test]
fn one_control_s_transport_error_is_the_answer_at_once() {
    let dead = refused();
    let c = Controls::new(&dead, None, Timeouts::default()).unwrap();
    let t0 = Instant::now();
    let e = c.send(&control::admit("name = \"a\"\n")).unwrap_err();
    assert!(
        matches!(&e, ClientError::Unreachable { base, .. } if *base == dead),
        "{e:?}"
    );
    assert!(
        t0.elapsed() < phub_http::controls::PAUSE,
        "no wait: {:?}",
        t0.elapsed()
    );
    // Its 503s are waited out.
    let b = Ctl::start(Part::LeadsAfter(2));
    let c = Controls::new(&b.url, None, Timeouts::default()).unwrap();
    assert_eq!(c.send(&control::jobs()), Ok(Vec::new()));
    assert_eq!(b.asked(), 3);
}

#[test]
fn a_list_without_a_url_is_refused_naming_it() {
    let e = Controls::new(" , ,", None, Timeouts::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "control URL list \" , ,\": expected the URL of phub-control (http://HOST:PORT), or several separated by commas"
    );
}
