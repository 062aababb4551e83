//! Streamed answers: the body comes from a thread after the handler
//! returned, with its length stated up front; it outlives the connection's
//! life while it makes progress; a sender that stops short or stalls cuts
//! it (the client sees fewer bytes than stated); a client that leaves
//! tells the sender. Loopback only.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use phub_http::{streamed, Class, Handler, Limits, Request, Response, Server, StreamGone};

/// Answers `/whole/N`, `/short` and `/stall` with streamed bodies of
/// slices sent every `gap`; reports how each sender ended.
struct Slices {
    gap: Duration,
    ended: Mutex<mpsc::Sender<Result<(), StreamGone>>>,
}

const SLICE: usize = 1000;

impl Handler for Slices {
    fn class(&self, _head: &Request) -> Class {
        Class::Read
    }

    fn handle(&self, req: Request) -> Response {
        let (slices, sent, stall) = match req.path.as_str() {
            "/short" => (5, 3, false),
            "/stall" => (5, 2, true),
            p => (
                p.trim_start_matches("/whole/").parse().unwrap_or(1),
                usize::MAX,
                false,
            ),
        };
        let (tx, body) = streamed((slices * SLICE) as u64, Duration::from_millis(300));
        let gap = self.gap;
        let ended = self.ended.lock().unwrap().clone();
        std::thread::spawn(move || {
            let mut r = Ok(());
            for i in 0..slices.min(sent) {
                std::thread::sleep(gap);
                if let Err(e) = tx.send(vec![u8::try_from(i % 251).unwrap(); SLICE]) {
                    r = Err(e);
                    break;
                }
            }
            if stall {
                std::thread::sleep(Duration::from_millis(900));
            }
            let _ = ended.send(r);
        });
        Response::streamed(200, "application/octet-stream", body)
    }
}

fn server(gap: Duration, connection_timeout: Duration) -> (Server, mpsc::Receiver<Result<(), StreamGone>>) {
    let (tx, rx) = mpsc::channel();
    let limits = Limits {
        connection_timeout,
        ..Limits::default()
    };
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let h = Slices {
        gap,
        ended: Mutex::new(tx),
    };
    (
        Server::bind("test-stream", addr, limits, None, Arc::new(h)).unwrap(),
        rx,
    )
}

/// The answer's head and the body bytes read before the connection ended.
fn get(addr: SocketAddr, path: &str) -> (String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    std::io::Write::write_all(
        &mut s,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    let at = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an answer head");
    (
        String::from_utf8_lossy(&all[..at]).into_owned(),
        all[at + 4..].to_vec(),
    )
}

#[test]
fn a_streamed_body_arrives_whole_with_its_length_and_outlives_the_connection_timeout() {
    // 12 slices 50 ms apart: 600 ms, past a 200 ms connection life.
    let (srv, ended) = server(Duration::from_millis(50), Duration::from_millis(200));
    let (head, body) = get(srv.local_addr(), "/whole/12");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("content-length: 12000"),
        "{head}"
    );
    assert_eq!(body.len(), 12 * SLICE);
    for (i, s) in body.chunks(SLICE).enumerate() {
        assert!(s.iter().all(|&b| usize::from(b) == i % 251), "slice {i}");
    }
    assert_eq!(ended.recv_timeout(Duration::from_secs(5)).unwrap(), Ok(()));
}

#[test]
fn a_sender_that_stops_short_or_stalls_cuts_the_body() {
    let (srv, ended) = server(Duration::from_millis(5), Duration::from_secs(10));
    let (head, body) = get(srv.local_addr(), "/short");
    assert!(
        head.contains("content-length: 5000") || head.contains("Content-Length: 5000"),
        "{head}"
    );
    // Cut: what hyper had not written when the body failed may be lost.
    assert!(
        body.len() <= 3 * SLICE,
        "{} bytes of a body cut after 3000",
        body.len()
    );
    assert_eq!(ended.recv_timeout(Duration::from_secs(5)).unwrap(), Ok(()));
    // Two slices, then nothing for longer than the 300 ms stall limit.
    let (_, body) = get(srv.local_addr(), "/stall");
    assert!(
        body.len() <= 2 * SLICE,
        "{} bytes of a body stalled after 2000",
        body.len()
    );
}

#[test]
fn a_client_that_leaves_tells_the_sender() {
    let (srv, ended) = server(Duration::from_millis(20), Duration::from_secs(10));
    let mut s = TcpStream::connect(srv.local_addr()).unwrap();
    std::io::Write::write_all(&mut s, b"GET /whole/100000 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut first = [0u8; 100];
    let _ = s.read(&mut first).unwrap();
    drop(s);
    let r = ended.recv_timeout(Duration::from_secs(20)).unwrap();
    assert!(
        matches!(r, Err(StreamGone::Closed | StreamGone::Stalled(_))),
        "{r:?}"
    );
}
