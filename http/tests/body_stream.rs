//! Request bodies handed to their handler as they arrive
//! (`Handler::body_stall`): read whole and in order past the connection's
//! life while they make progress; a body cut short, stalled or over the
//! limit is an error to the reader, never a short whole one; a handler
//! that refuses early is answered at once. Loopback only.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use phub_http::{Handler, Limits, Request, Response, Server};

/// Streams every `POST` body to the handler; `/refuse` answers after its
/// first 8 bytes. Each whole read reports the bytes it got, or its error.
struct Reads {
    got: Mutex<mpsc::Sender<Result<Vec<u8>, String>>>,
}

impl Handler for Reads {
    fn body_stall(&self, head: &Request) -> Option<Duration> {
        (head.method == "POST").then_some(Duration::from_millis(400))
    }

    fn body_limit(&self, _head: &Request) -> usize {
        1 << 20
    }

    fn handle(&self, mut req: Request) -> Response {
        let mut r = req.body_stream.take().expect("a streamed body");
        if req.path == "/refuse" {
            let mut first = [0u8; 8];
            return match r.read_exact(&mut first) {
                Ok(()) => Response::error(400, format!("refused after {:?}", &first[..])),
                Err(e) => Response::error(500, e.to_string()),
            };
        }
        let mut all = Vec::new();
        let read = r.read_to_end(&mut all).map(|_| all).map_err(|e| e.to_string());
        let status = if read.is_ok() { 200 } else { 400 };
        let _ = self.got.lock().unwrap().send(read);
        Response::new(status, "text/plain", Vec::new())
    }
}

fn server(connection_timeout: Duration) -> (Server, mpsc::Receiver<Result<Vec<u8>, String>>) {
    let (tx, rx) = mpsc::channel();
    let limits = Limits {
        connection_timeout,
        body_timeout: Duration::from_millis(100),
        ..Limits::default()
    };
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let h = Reads { got: Mutex::new(tx) };
    (
        Server::bind("test-body-stream", addr, limits, None, Arc::new(h)).unwrap(),
        rx,
    )
}

fn body(n: usize) -> Vec<u8> {
    (0..n).map(|i| u8::try_from(i % 251).unwrap()).collect()
}

/// Sends a head stating `len` bytes, then `pieces` of the body `gap`
/// apart; returns the answer's status line (empty if none came).
fn post(addr: SocketAddr, path: &str, len: usize, pieces: &[&[u8]], gap: Duration) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\n\r\n").as_bytes())
        .unwrap();
    for p in pieces {
        std::thread::sleep(gap);
        if s.write_all(p).is_err() {
            break;
        }
    }
    // A body cut short: the client closes its side. (A whole one keeps it
    // open: the listener takes a half-closed connection for a closed one.)
    if pieces.iter().map(|p| p.len()).sum::<usize>() < len {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    String::from_utf8_lossy(&all)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_streamed_body_arrives_whole_and_in_order_past_the_connection_and_body_timeouts() {
    let (srv, got) = server(Duration::from_millis(200));
    let b = body(300_000);
    // 12 pieces 50 ms apart: 600 ms, past the 200 ms life and the 100 ms
    // body timeout, each gap within the 400 ms stall.
    let pieces: Vec<&[u8]> = b.chunks(25_000).collect();
    let status = post(srv.local_addr(), "/", b.len(), &pieces, Duration::from_millis(50));
    let read = got.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(read.as_ref().map(Vec::len), Ok(b.len()));
    assert_eq!(read, Ok(b));
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
}

#[test]
fn a_body_cut_short_or_stalled_is_an_error_to_its_reader() {
    let (srv, got) = server(Duration::from_secs(10));
    let b = body(10_000);
    // The client stops after half and closes its side.
    post(srv.local_addr(), "/", b.len(), &[&b[..5000]], Duration::ZERO);
    let e = got.recv_timeout(Duration::from_secs(5)).unwrap().unwrap_err();
    assert!(e.contains("5000") || e.contains("request body"), "{e}");
    // The client sends half, then nothing for longer than the stall.
    let addr = srv.local_addr();
    let t = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10000\r\n\r\n")
            .unwrap();
        s.write_all(&[7u8; 5000]).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
    });
    let e = got.recv_timeout(Duration::from_secs(5)).unwrap().unwrap_err();
    assert!(e.contains("no progress"), "{e}");
    t.join().unwrap();
}

#[test]
fn a_body_over_the_limit_is_refused_and_an_early_answer_is_not_held_up() {
    let (srv, got) = server(Duration::from_secs(10));
    // Stated over the limit: 413 before the handler runs.
    let status = post(srv.local_addr(), "/", 2 << 20, &[], Duration::ZERO);
    assert!(status.starts_with("HTTP/1.1 413"), "{status}");
    // Not stated (chunked) and over the limit: the reader's error.
    let addr = srv.local_addr();
    let t = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            .unwrap();
        let piece = vec![1u8; 1 << 16];
        for _ in 0..20 {
            if s.write_all(format!("{:x}\r\n", piece.len()).as_bytes()).is_err()
                || s.write_all(&piece).is_err()
                || s.write_all(b"\r\n").is_err()
            {
                break;
            }
        }
    });
    let e = got.recv_timeout(Duration::from_secs(5)).unwrap().unwrap_err();
    assert!(e.contains("larger than the limit"), "{e}");
    t.join().unwrap();
    // The handler answers after 8 bytes of a 1 MB body the client is
    // still to send: the answer comes before the client sent the rest.
    let mut s = TcpStream::connect(srv.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n12345678")
        .unwrap();
    let mut answer = [0u8; 12];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 400");
}
