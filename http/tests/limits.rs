//! The listener under slow, large, many and early-closing clients, slow
//! handlers, guessed tokens, its shutdown, and TLS. Loopback only; several
//! client hosts are loopback addresses 127.0.0.2, 127.0.0.3, ... (Linux
//! answers all of 127.0.0.0/8 on the loopback interface).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use phub_http::{Class, Handler, Limits, Request, Response, Server};

struct Echo;

impl Handler for Echo {
    fn class(&self, head: &Request) -> Class {
        match head.path.as_str() {
            "/write" | "/secret" => Class::Write,
            _ => Class::Read,
        }
    }

    fn needs_credential(&self, head: &Request) -> bool {
        head.path == "/secret"
    }

    fn check_head(&self, head: &Request) -> Result<(), Response> {
        if head.path == "/secret" {
            match head.header("Authorization") {
                Some("Bearer ok") => {}
                Some(_) => return Err(Response::error(403, "wrong token")),
                None => return Err(Response::error(401, "needs a token")),
            }
        }
        Ok(())
    }

    fn handle(&self, req: Request) -> Response {
        match req.path.as_str() {
            "/panic" => panic!("handler panics on purpose"),
            "/sleep" => {
                std::thread::sleep(Duration::from_secs(3));
                Response::new(200, "text/plain", b"slept".to_vec())
            }
            _ => Response::new(
                200,
                "text/plain",
                format!("{} {} {}", req.method, req.path, req.body.len()).into_bytes(),
            ),
        }
    }
}

fn limits() -> Limits {
    Limits {
        max_connections: 32,
        max_connections_per_source: 32,
        header_bytes: 16 << 10,
        header_timeout: Duration::from_millis(800),
        body_bytes: 64 << 10,
        body_timeout: Duration::from_millis(800),
        inflight_body_bytes: 1 << 20,
        read_handlers: 4,
        write_handlers: 2,
        credential_failures: 5,
        credential_window: Duration::from_secs(2),
        connection_timeout: Duration::from_secs(10),
        shutdown_grace: Duration::from_millis(300),
    }
}

fn server(limits: Limits) -> Server {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    Server::bind("test-http", addr, limits, None, Arc::new(Echo)).unwrap()
}

/// The loopback address 127.0.0.`n`: one client host of a test.
fn host(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, n)
}

/// A connection to `to` from the loopback address `from`.
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&SocketAddr::from((from, 0)).into())?;
    s.connect(&to.into())?;
    Ok(s.into())
}

/// Sends raw bytes and reads the whole answer (until the server closes).
fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    raw_from(host(1), addr, bytes)
}

/// [`raw`] from the loopback address `from`.
fn raw_from(from: Ipv4Addr, addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = connect_from(from, addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let t = Instant::now();
    let r = match ureq::get(&format!("http://{addr}{path}"))
        .timeout(Duration::from_secs(5))
        .call()
    {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("GET {path}: {e}"),
    };
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "GET {path} took {:?}",
        t.elapsed()
    );
    r
}

#[test]
fn answers_within_a_second_while_clients_trickle_headers() {
    let srv = server(limits());
    let addr = srv.local_addr();
    // 20 clients that send one header byte now and then.
    let mut slow: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"POST /x HTTP/1.1\r\nHost: a\r\n").unwrap();
            s
        })
        .collect();
    for _ in 0..3 {
        for s in &mut slow {
            let _ = s.write_all(b"X");
        }
        assert_eq!(get(addr, "/ok"), (200, "GET /ok 0".to_string()));
        std::thread::sleep(Duration::from_millis(100));
    }
    // The header timeout closes them.
    std::thread::sleep(Duration::from_millis(900));
    let mut buf = [0u8; 256];
    for s in &mut slow {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let _ = s.write_all(b"Y");
        let n = s.read(&mut buf).unwrap_or(0);
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(
            n == 0 || text.starts_with("HTTP/1.1 408"),
            "slow client got {text:?}"
        );
    }
}

#[test]
fn a_trickled_body_times_out_with_408() {
    let srv = server(limits());
    let addr = srv.local_addr();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\nab")
        .unwrap();
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(out.contains("did not arrive within"), "{out}");
    assert!(t.elapsed() < Duration::from_secs(3));
    assert_eq!(get(addr, "/ok").0, 200);
}

#[test]
fn huge_headers_are_refused_with_431() {
    let srv = server(limits());
    let addr = srv.local_addr();
    let mut req = b"GET /x HTTP/1.1\r\nHost: a\r\nX-Big: ".to_vec();
    req.extend(std::iter::repeat_n(b'a', 1 << 20));
    req.extend_from_slice(b"\r\n\r\n");
    let out = raw(addr, &req);
    assert!(out.starts_with("HTTP/1.1 431"), "{}", &out[..out.len().min(200)]);
    assert_eq!(get(addr, "/ok").0, 200);
}

#[test]
fn a_body_over_the_limit_is_refused_before_it_is_read() {
    let srv = server(limits());
    let addr = srv.local_addr();
    // Declares 10 MB, sends none of it: answered at once.
    let t = Instant::now();
    let out = raw(
        addr,
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 10000000\r\n\r\n",
    );
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");
    assert!(out.contains("larger than the limit of 65536 bytes"), "{out}");
    assert!(t.elapsed() < Duration::from_millis(700));
    // Chunked, no length: stopped once it passes the limit.
    let mut req = b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..20 {
        req.extend_from_slice(b"1000\r\n");
        req.extend(std::iter::repeat_n(b'z', 0x1000));
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let out = raw(addr, &req);
    assert!(out.starts_with("HTTP/1.1 413"), "{}", &out[..out.len().min(200)]);
    // A body within the limit is whole.
    let out = raw(
        addr,
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    );
    assert!(out.ends_with("POST /x 5"), "{out}");
}

#[test]
fn a_refused_head_never_has_its_body_read() {
    let srv = server(limits());
    let addr = srv.local_addr();
    let t = Instant::now();
    let out = raw(
        addr,
        b"POST /secret HTTP/1.1\r\nHost: a\r\nContent-Length: 60000\r\n\r\n",
    );
    assert!(out.starts_with("HTTP/1.1 401"), "{out}");
    assert!(out.contains("needs a token"), "{out}");
    assert!(t.elapsed() < Duration::from_millis(700));
    let out = raw(
        addr,
        b"POST /secret HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer ok\r\nContent-Length: 2\r\n\r\nhi",
    );
    assert!(out.ends_with("POST /secret 2"), "{out}");
}

#[test]
fn connections_over_the_limit_get_503_and_the_rest_are_served() {
    let mut l = limits();
    l.max_connections = 4;
    l.header_timeout = Duration::from_secs(3);
    let srv = server(l);
    let addr = srv.local_addr();
    let idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(100));
    let out = raw(addr, b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n");
    assert!(out.starts_with("HTTP/1.1 503"), "{out}");
    assert!(out.contains("at most 4 at once"), "{out}");
    drop(idle);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(get(addr, "/ok").0, 200);
}

/// Reads cannot take the handlers of the other class. Reproduction (one
/// pool of `handlers`, before classes): fill it with slow reads and any
/// other request waits until one of them ends, here 3 s.
#[test]
fn slow_reads_do_not_hold_up_writes() {
    let srv = server(limits());
    let addr = srv.local_addr();
    // Twice the read handlers, each taking 3 s.
    let sleepers: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let _ = ureq::get(&format!("http://{addr}/sleep"))
                    .timeout(Duration::from_secs(10))
                    .call();
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // Reads wait...
    let r = ureq::get(&format!("http://{addr}/ok"))
        .timeout(Duration::from_millis(500))
        .call();
    assert!(r.is_err(), "a read was answered while the read handlers slept");
    // ... writes do not.
    let t = Instant::now();
    assert_eq!(get(addr, "/write"), (200, "GET /write 0".to_string()));
    assert!(
        t.elapsed() < Duration::from_millis(300),
        "a write took {:?} while the reads slept",
        t.elapsed()
    );
    for s in sleepers {
        s.join().unwrap();
    }
}

/// A handler whose client left still holds its slot until it ends.
/// Reproduction (slots given back when the client went): clients that ask
/// for slow reads and leave at once have more handlers started than the
/// read pool holds; they take every blocking thread, and a write waits in
/// the runtime's queue behind them.
#[test]
fn reads_whose_clients_left_still_hold_their_handlers() {
    let srv = server(limits());
    let addr = srv.local_addr();
    // For 600 ms, 8 clients at a time ask for a 3 s read and leave after
    // 100 ms.
    let impatient: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..6 {
                    let _ = ureq::get(&format!("http://{addr}/sleep"))
                        .timeout(Duration::from_millis(100))
                        .call();
                }
            })
        })
        .collect();
    for t in impatient {
        t.join().unwrap();
    }
    let t = Instant::now();
    assert_eq!(get(addr, "/write").0, 200);
    assert!(
        t.elapsed() < Duration::from_millis(300),
        "a write took {:?} behind reads whose clients had left",
        t.elapsed()
    );
}

/// Failed credential checks are limited per source. Reproduction (before):
/// a client could try wrong tokens as fast as the listener answered, each
/// checked.
#[test]
fn a_source_that_keeps_failing_gets_429_but_a_right_token_still_passes() {
    let srv = server(limits());
    let addr = srv.local_addr();
    let wrong = b"POST /secret HTTP/1.1\r\nAuthorization: Bearer no\r\nContent-Length: 0\r\n\r\n";
    let right = b"POST /secret HTTP/1.1\r\nAuthorization: Bearer ok\r\nContent-Length: 0\r\n\r\n";
    let none = b"POST /secret HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
    // Open routes do not count, nor are they refused.
    for _ in 0..10 {
        assert!(raw_from(host(2), addr, b"GET /ok HTTP/1.1\r\n\r\n").ends_with("GET /ok 0"));
    }
    // Five failures (401 and 403 alike) are checked, then refused.
    assert!(raw_from(host(2), addr, none).starts_with("HTTP/1.1 401"));
    for _ in 0..4 {
        let out = raw_from(host(2), addr, wrong);
        assert!(out.starts_with("HTTP/1.1 403"), "{out}");
    }
    let t = Instant::now();
    let out = raw_from(host(2), addr, wrong);
    assert!(out.starts_with("HTTP/1.1 429"), "{out}");
    assert!(out.to_ascii_lowercase().contains("retry-after: 2"), "{out}");
    assert!(
        out.contains("too many failed credential checks from 127.0.0.2"),
        "{out}"
    );
    // The right token from that source is still served (on loopback every
    // local client is one source: a guesser must not lock control out)...
    assert!(raw_from(host(2), addr, right).ends_with("POST /secret 0"));
    assert!(raw_from(host(2), addr, none).starts_with("HTTP/1.1 429"));
    assert!(raw_from(host(2), addr, b"GET /ok HTTP/1.1\r\n\r\n").ends_with("GET /ok 0"));
    // ... from another source it is.
    assert!(raw_from(host(3), addr, right).ends_with("POST /secret 0"));
    assert!(raw_from(host(3), addr, wrong).starts_with("HTTP/1.1 403"));
    // Once the window has passed, the source is checked again.
    std::thread::sleep(Duration::from_secs(2).saturating_sub(t.elapsed()) + Duration::from_millis(100));
    assert!(raw_from(host(2), addr, right).ends_with("POST /secret 0"));
}

/// One source holds at most `max_connections_per_source`. Reproduction
/// (before): one host holding `max_connections` connections turned every
/// other client away with `503`.
#[test]
fn one_source_cannot_hold_every_connection() {
    let mut l = limits();
    l.max_connections = 6;
    l.max_connections_per_source = 3;
    l.header_timeout = Duration::from_secs(3);
    let srv = server(l);
    let addr = srv.local_addr();
    let held: Vec<TcpStream> = (0..3).map(|_| connect_from(host(2), addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(100));
    let get = b"GET /ok HTTP/1.1\r\n\r\n";
    let out = raw_from(host(2), addr, get);
    assert!(out.starts_with("HTTP/1.1 503"), "{out}");
    assert!(
        out.contains("too many connections from 127.0.0.2")
            && out.contains("at most 3 at once from one address"),
        "{out}"
    );
    assert!(raw_from(host(3), addr, get).ends_with("GET /ok 0"));
    // The listener's own limit still holds across sources.
    let more: Vec<TcpStream> = (0..3).map(|_| connect_from(host(3), addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(100));
    let out = raw_from(host(4), addr, get);
    assert!(out.contains("at most 6 at once"), "{out}");
    // Closed connections give the source its share back.
    drop(held);
    std::thread::sleep(Duration::from_millis(100));
    assert!(raw_from(host(2), addr, get).ends_with("GET /ok 0"));
    drop(more);
}

#[test]
fn a_panicking_handler_answers_500_and_the_server_goes_on() {
    let srv = server(limits());
    let addr = srv.local_addr();
    let (code, body) = get(addr, "/panic");
    assert_eq!(code, 500);
    assert!(body.contains("internal error"), "{body}");
    assert_eq!(get(addr, "/ok").0, 200);
}

#[test]
fn shutdown_does_not_wait_on_clients() {
    let srv = server(limits());
    let addr = srv.local_addr();
    // Slow clients mid-headers and a handler that takes 3 s.
    let _slow: Vec<TcpStream> = (0..10)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /x HTTP/1.1\r\n").unwrap();
            s
        })
        .collect();
    let sleeper = std::thread::spawn(move || {
        let _ = ureq::get(&format!("http://{addr}/sleep"))
            .timeout(Duration::from_secs(5))
            .call();
    });
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    srv.shutdown();
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "shutdown took {:?}",
        t.elapsed()
    );
    assert!(
        TcpStream::connect(addr).is_err(),
        "still accepting after shutdown"
    );
    sleeper.join().unwrap();
}

#[test]
fn tls_is_served_and_verified() {
    let dir = std::env::temp_dir().join(format!("phub-http-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();

    let tls = phub_http::server_config(&cert, &key).unwrap();
    let srv = Server::bind(
        "test-https",
        "127.0.0.1:0".parse().unwrap(),
        limits(),
        Some(tls),
        Arc::new(Echo),
    )
    .unwrap();
    let port = srv.local_addr().port();

    // Trusting the certificate: served.
    let client = phub_http::client_config(Some(&cert)).unwrap();
    let agent = ureq::AgentBuilder::new().tls_config(client).build();
    let r = agent.get(&format!("https://localhost:{port}/ok")).call().unwrap();
    assert_eq!(r.into_string().unwrap(), "GET /ok 0");

    // Not trusting it: refused by the client.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let other_ca = dir.join("other.pem");
    std::fs::write(&other_ca, other.cert.pem()).unwrap();
    let agent = ureq::AgentBuilder::new()
        .tls_config(phub_http::client_config(Some(&other_ca)).unwrap())
        .build();
    let e = agent
        .get(&format!("https://localhost:{port}/ok"))
        .call()
        .unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");

    // Clear text to the TLS port: no answer, and the server goes on.
    let out = raw(srv.local_addr(), b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n");
    assert!(!out.contains("GET /ok 0"));

    // Bad files are named.
    let e = phub_http::server_config(&dir.join("missing.pem"), &key).unwrap_err();
    assert!(e.to_string().contains("missing.pem"), "{e}");
    let e = phub_http::client_config(Some(&key)).unwrap_err();
    assert!(e.to_string().contains("no PEM certificate"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
