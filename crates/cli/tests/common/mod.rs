//! Shared by the server tests: start the real `ember serve` binary on a free loopback port and
//! talk plain HTTP/1.1 to it over `std::net::TcpStream` (no client crates).

#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a server may take from spawn to `ready: serving` (the fixtures load in milliseconds).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// No test request should take anywhere near this; it only keeps a broken server from hanging
/// the suite.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/golden")
        .join(name)
}

/// The fixture's `expected.json` (transformers' greedy completions).
pub fn expected(name: &str) -> Value {
    let path = fixture(name).join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("reading expected.json"))
        .expect("parsing expected.json")
}

pub fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("an array of token ids")
        .iter()
        .map(|v| v.as_u64().expect("a token id") as u32)
        .collect()
}

/// `ember run` on the same model: its stdout is exactly the generated text.
pub fn ember_run(model: &str, prompt: &str, max_tokens: usize) -> String {
    ember_run_args(
        model,
        &[
            "--prompt",
            prompt,
            "-n",
            &max_tokens.to_string(),
            "--ignore-eos",
        ],
    )
}

/// `ember run --model <fixture> --threads 2 <args>`; returns stdout.
pub fn ember_run_args(model: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["run", "--model"])
        .arg(fixture(model))
        .args(["--threads", "2"])
        .args(args)
        .env("EMBER_LOG", "warn")
        .output()
        .expect("running ember run");
    assert!(
        out.status.success(),
        "ember run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("ember run prints UTF-8")
}

/// `body` with `extra`'s fields set over it.
pub fn with(mut body: Value, extra: Value) -> Value {
    for (key, value) in extra.as_object().expect("extra fields as an object") {
        body[key] = value.clone();
    }
    body
}

/// POSTs `body` as JSON and returns the 200 answer (any other status fails the test).
pub fn ok(server: &Server, path: &str, body: &Value) -> Value {
    let (status, response) = server.post_json(path, body);
    assert_eq!(status, 200, "{path} {body}: {response}");
    response
}

/// A temporary file that is removed when dropped.
pub struct TempFile(pub PathBuf);

impl TempFile {
    pub fn new(tag: &str, contents: &str) -> TempFile {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("ember-test-{}-{tag}-{n}", std::process::id()));
        std::fs::write(&path, contents).expect("writing a temp file");
        TempFile(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A running `ember serve`; killed when dropped.
pub struct Server {
    child: Option<Child>,
    addr: String,
    lines: mpsc::Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
    ready: bool,
    /// The `/health` status right after the `ready: serving` line was read (None when the line
    /// came before the listening one was seen).
    pub health_at_ready_line: Option<u16>,
}

impl Server {
    /// Starts `ember serve --model <fixture> --port 0 --threads 2 <extra>` and waits until the
    /// model is loaded.
    pub fn start(model: &str, extra: &[&str]) -> Server {
        let mut server = Server::spawn(model, extra);
        server.wait_ready();
        server
    }

    /// Starts the server and returns once it listens (the model may still be loading).
    pub fn spawn(model: &str, extra: &[&str]) -> Server {
        Server::spawn_with_env(model, extra, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_with_env(model: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut server = Server::spawn_with_env(model, extra, env);
        server.wait_ready();
        server
    }

    pub fn spawn_with_env(model: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
            .arg("serve")
            .arg("--model")
            .arg(fixture(model))
            .args(["--port", "0", "--threads", "2", "--host", "127.0.0.1"])
            .args(extra)
            .env("EMBER_LOG", "info")
            .env("NO_COLOR", "1")
            .env_remove("EMBER_API_KEYS_FILE")
            .env_remove("EMBER_CONTEXT")
            .env_remove("EMBER_PORT")
            .env_remove("EMBER_HOST")
            .env_remove("EMBER_NO_RESIDENCY")
            .env_remove("EMBER_LOAD_LIMIT_GB")
            .env_remove("EMBER_KEEP_WARM")
            .env_remove("EMBER_KEEPALIVE_INTERVAL_MS")
            // A small prompt cache by default (the server's own default takes gigabytes, and
            // several test servers run at once); `--prompt-cache-gib` in `extra` wins.
            .env("EMBER_PROMPT_CACHE_GIB", "0.0625")
            .env_remove("EMBER_PROMPT_CACHE_HOST_GIB")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning ember serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        {
            let log = Arc::clone(&log);
            // Keeps draining stderr for the server's whole life, so logging never blocks it.
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    log.lock().unwrap().push(line.clone());
                    let _ = tx.send(line);
                }
            });
        }
        let mut server = Server {
            child: Some(child),
            addr: String::new(),
            lines,
            log,
            ready: false,
            health_at_ready_line: None,
        };
        let line =
            server.wait_for_line(|l| l.contains("listening on") || l.contains("ready: serving"));
        server.addr = parse_addr(&line).unwrap_or_else(|| panic!("no address in {line:?}"));
        if line.contains("ready: serving") {
            server.ready = true;
        }
        server
    }

    /// Waits for the `ready: serving http://...` line, then until `/health` says 200.
    ///
    /// The server logs that line just before it marks itself ready, so a request sent the
    /// moment the line appears can still get 503 "loading"; `health_at_ready_line` records what
    /// the first one got, and the test `health_is_ok_as_soon_as_ready_is_logged` holds the
    /// server to the line. Here, other tests are kept clear of that race.
    pub fn wait_ready(&mut self) {
        if !self.ready {
            let line = self.wait_for_line(|l| l.contains("ready: serving"));
            let addr = parse_addr(&line).unwrap_or_else(|| panic!("no address in {line:?}"));
            assert_eq!(
                addr, self.addr,
                "the ready line names the address the server listens on"
            );
            self.ready = true;
            self.health_at_ready_line = Some(self.get("/health").status);
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        while self.get("/health").status != 200 {
            assert!(
                Instant::now() < deadline,
                "/health never answered 200; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn wait_for_line(&mut self, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if want(&line) => return line,
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("the server did not get ready in time; log:\n{}", self.log())
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.as_mut().and_then(|c| c.wait().ok());
                    panic!(
                        "the server exited ({status:?}) before it was ready; log:\n{}",
                        self.log()
                    )
                }
            }
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything the server wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("a running server").id()
    }

    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut().expect("a server");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().expect("waiting for the server") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> HttpResponse {
        request(&self.addr, method, path, headers, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}; server log:\n{}", self.log()))
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        self.request("GET", path, &[], b"")
    }

    /// POSTs JSON and parses the JSON answer.
    pub fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        );
        let status = response.status;
        (status, response.json())
    }

    /// POSTs a streaming request and returns the `data:` payloads, `[DONE]` included.
    pub fn stream_json(&self, path: &str, body: &Value) -> Vec<String> {
        let mut stream = SseStream::open(
            &self.addr,
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        if stream.status != 200 {
            let body = stream.read_body().unwrap_or_default();
            panic!(
                "streaming {path} failed: {} {}",
                stream.status,
                String::from_utf8_lossy(&body)
            );
        }
        assert!(
            stream
                .header("content-type")
                .is_some_and(|t| t.starts_with("text/event-stream")),
            "content-type {:?}",
            stream.header("content-type")
        );
        stream.collect_data().expect("reading the stream")
    }

    /// The `/metrics` text.
    pub fn metrics(&self) -> String {
        let response = self.get("/metrics");
        assert_eq!(response.status, 200);
        response.text()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The value of the series `name` (exactly as written before the value, labels included).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

fn parse_addr(line: &str) -> Option<String> {
    const PREFIX: &str = "http://127.0.0.1:";
    let rest = &line[line.find(PREFIX)? + PREFIX.len()..];
    let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
    (!port.is_empty()).then(|| format!("127.0.0.1:{port}"))
}

#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    /// Names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: the body is not JSON ({e}): {:?}",
                self.status,
                self.text()
            )
        })
    }
}

fn connect(addr: &str) -> io::Result<TcpStream> {
    let stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(stream)
}

fn write_request(
    stream: &mut TcpStream,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<()> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    // A server may answer (413) and close before reading a large body; its answer is still
    // readable, so a failed write of the body is not an error by itself.
    if let Err(e) = stream.write_all(body)
        && !matches!(
            e.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        )
    {
        return Err(e);
    }
    stream.flush()
}

/// Reads a status line and headers.
fn read_head(reader: &mut BufReader<TcpStream>) -> io::Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed before a status line",
        ));
    }
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {line:?}"),
            )
        })?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed in the headers",
            ));
        }
        let trimmed = line.trim_end();
        if trimmed.is_empty() {
            break;
        }
        if let Some((name, value)) = trimmed.split_once(':') {
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
    }
    Ok((status, headers))
}

/// A response body read piece by piece: chunked, by length, or to the end of the connection.
struct Body {
    reader: BufReader<TcpStream>,
    chunked: bool,
    remaining: Option<usize>,
    ended: bool,
}

impl Body {
    fn new(reader: BufReader<TcpStream>, headers: &[(String, String)]) -> Body {
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let chunked =
            get("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
        let remaining = if chunked {
            None
        } else {
            get("content-length").and_then(|v| v.parse().ok())
        };
        Body {
            reader,
            chunked,
            remaining,
            ended: false,
        }
    }

    /// The next piece of the body; `None` at its end.
    fn next(&mut self) -> io::Result<Option<Vec<u8>>> {
        if self.ended {
            return Ok(None);
        }
        if self.chunked {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a chunked body",
                ));
            }
            let size_text = line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size_text, 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad chunk size {line:?}"),
                )
            })?;
            if size == 0 {
                // Trailers, then the blank line.
                loop {
                    line.clear();
                    if self.reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
                        break;
                    }
                }
                self.ended = true;
                return Ok(None);
            }
            let mut data = vec![0; size];
            self.reader.read_exact(&mut data)?;
            let mut crlf = [0; 2];
            self.reader.read_exact(&mut crlf)?;
            return Ok(Some(data));
        }
        if self.remaining == Some(0) {
            self.ended = true;
            return Ok(None);
        }
        let mut buf = vec![0; 16 * 1024];
        let want = self.remaining.map_or(buf.len(), |r| r.min(buf.len()));
        let n = self.reader.read(&mut buf[..want])?;
        if n == 0 {
            self.ended = true;
            if self.remaining.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before Content-Length bytes",
                ));
            }
            return Ok(None);
        }
        if let Some(r) = &mut self.remaining {
            *r -= n;
        }
        buf.truncate(n);
        Ok(Some(buf))
    }

    fn read_all(&mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        while let Some(piece) = self.next()? {
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`).
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<HttpResponse> {
    let mut stream = connect(addr)?;
    write_request(&mut stream, addr, method, path, headers, body)?;
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader)?;
    let body = Body::new(reader, &headers).read_all()?;
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

/// A response read as server-sent events.
pub struct SseStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    body: Body,
    buffer: Vec<u8>,
}

impl SseStream {
    pub fn open(
        addr: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<SseStream> {
        let mut stream = connect(addr)?;
        write_request(&mut stream, addr, "POST", path, headers, body)?;
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader)?;
        let body = Body::new(reader, &headers);
        Ok(SseStream {
            status,
            headers,
            body,
            buffer: Vec::new(),
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The whole (non-event) body, for error answers.
    pub fn read_body(&mut self) -> io::Result<Vec<u8>> {
        let mut out = std::mem::take(&mut self.buffer);
        out.extend(self.body.read_all()?);
        Ok(out)
    }

    /// The next event's `data:` payload (multi-line data joined with `\n`); events without data
    /// (keep-alive comments) are skipped. `None` when the stream ends.
    pub fn next_data(&mut self) -> io::Result<Option<String>> {
        loop {
            while let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buffer.drain(..end + 2).collect();
                if let Some(data) = event_data(&event) {
                    return Ok(Some(data));
                }
            }
            match self.body.next()? {
                Some(piece) => self
                    .buffer
                    .extend(piece.into_iter().filter(|&b| b != b'\r')),
                None => {
                    let rest = std::mem::take(&mut self.buffer);
                    return Ok(event_data(&rest));
                }
            }
        }
    }

    /// Every remaining `data:` payload, in order.
    pub fn collect_data(&mut self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        while let Some(data) = self.next_data()? {
            out.push(data);
        }
        Ok(out)
    }
}

fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect();
    (!data.is_empty()).then(|| data.join("\n"))
}

/// What is wrong with an error body, if anything; the OpenAI shape is
/// `{"error": {"message", "type", "param", "code"}}` (`param` and `code` may be null).
pub fn error_shape_problem(body: &Value) -> Option<String> {
    let Some(error) = body.get("error") else {
        return Some(format!("no `error` in {body}"));
    };
    if !error.is_object() {
        return Some(format!("`error` is not an object: {body}"));
    }
    if error["message"].as_str().is_none_or(str::is_empty) {
        return Some(format!("no message: {body}"));
    }
    if !error["type"].is_string() {
        return Some(format!("no type: {body}"));
    }
    for key in ["param", "code"] {
        if error.get(key).is_none() {
            return Some(format!("no `{key}` key (null is fine): {body}"));
        }
    }
    None
}

pub fn assert_error_shape(body: &Value) {
    if let Some(problem) = error_shape_problem(body) {
        panic!("{problem}");
    }
}

/// Whether `word` occurs in `text` on its own (not inside a longer identifier).
pub fn mentions_word(text: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
    })
}
