//! Sockets cannot exhaust the server: a connection that never finishes its headers, or sits
//! idle after a request, is closed after `--header-timeout`; past `--max-connections` a new
//! connection gets a 503 in the API's error shape; and the server serves again once they go.
//! (Timeouts here are generous bounds for a loaded machine, not speed checks.)

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::Server;
use serde_json::Value;

const MODEL: &str = "llama-f32";

/// Reads until the server closes the connection (or `limit` passes: then `None`).
fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Some(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(got),
            Err(_) => return None,
        }
    }
}

#[test]
fn half_sent_headers_and_idle_connections_are_closed_after_the_header_timeout() {
    let server = Server::start(MODEL, &["--header-timeout", "1"]);
    // Headers begun and never finished.
    let mut half = TcpStream::connect(server.addr()).unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let start = Instant::now();
    let closed = read_until_closed(&mut half, Duration::from_secs(20));
    assert!(
        closed.is_some(),
        "a half-sent request is still open after 20 s"
    );
    eprintln!("half-sent headers closed after {:?}", start.elapsed());

    // A keep-alive connection after a whole request: answered, then closed when idle.
    let mut idle = TcpStream::connect(server.addr()).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let answer = read_until_closed(&mut idle, Duration::from_secs(20))
        .expect("an idle keep-alive connection is still open after 20 s");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(server.get("/health").status, 200);
}

#[test]
fn connections_past_the_limit_get_a_503_and_the_server_recovers() {
    // A header timeout far past the test's time: connections that send nothing stay held.
    let server = Server::start(MODEL, &["--max-connections", "4", "--header-timeout", "60"]);
    let mut streams: Vec<TcpStream> = (0..12)
        .map(|_| TcpStream::connect(server.addr()).unwrap())
        .collect();
    // At most four hold a place (the harness's own connection may hold one more for a
    // while); the others are answered with a 503 and closed at once.
    let answers: Vec<String> = streams
        .iter_mut()
        .map(|s| {
            let got = read_until_closed(s, Duration::from_secs(3)).unwrap_or_default();
            String::from_utf8_lossy(&got).into_owned()
        })
        .collect();
    let refused: Vec<&String> = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 503"))
        .collect();
    assert!(
        (8..=9).contains(&refused.len()),
        "{answers:?}\n{}",
        server.log()
    );
    let body = &refused[0][refused[0].find("\r\n\r\n").expect("a body") + 4..];
    let error: Value = serde_json::from_str(body).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-connections"),
        "{error}"
    );
    // They leave; the server answers again.
    drop(streams);
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let mut probe = TcpStream::connect(server.addr()).unwrap();
        probe
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let answer = read_until_closed(&mut probe, Duration::from_secs(10)).unwrap_or_default();
        if String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "the server did not recover");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn heads_hyper_refuses_are_answered_in_the_json_error_shape() {
    let server = Server::start(MODEL, &[]);
    let answer = |request: &[u8]| -> (String, Value) {
        let mut stream = TcpStream::connect(server.addr()).unwrap();
        // The server may answer and close before the whole request is sent.
        let _ = stream.write_all(request);
        let got = read_until_closed(&mut stream, Duration::from_secs(20))
            .expect("the connection is closed after the answer");
        let text = String::from_utf8_lossy(&got).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        let body: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{text}: {e}"));
        (head.to_owned(), body)
    };
    // A 1 MB header.
    let mut huge = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 1 << 20));
    huge.extend_from_slice(b"\r\n\r\n");
    let (head, body) = answer(&huge);
    assert!(head.starts_with("HTTP/1.1 431 "), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    common::assert_error_shape(&body);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("headers are too large")
    );
    // Not HTTP at all.
    let (head, body) = answer(b"THIS IS NOT HTTP\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 400 "), "{head}");
    common::assert_error_shape(&body);
    // And the server goes on.
    assert_eq!(server.get("/health").status, 200);
}
