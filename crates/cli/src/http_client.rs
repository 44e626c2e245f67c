//! A small blocking HTTP/1.1 client for talking to OpenAI-compatible servers on this machine or
//! the local network (`ember bench idle`): plain `http://` only, one request per connection,
//! bodies read as they arrive (chunked or by length) so streams can be timed token by token.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail};

/// Where a server is: `http://host:port`, with any path prefix before `/v1`.
#[derive(Clone, Debug)]
pub struct BaseUrl {
    pub host: String,
    pub port: u16,
    /// Prefix of every request path, without a trailing slash (often empty).
    pub prefix: String,
}

impl BaseUrl {
    /// Parses `http://host[:port][/prefix]`; a trailing `/v1` is dropped, so both the server's
    /// address and its OpenAI base URL work.
    pub fn parse(url: &str) -> anyhow::Result<BaseUrl> {
        let Some(rest) = url.strip_prefix("http://") else {
            if url.starts_with("https://") {
                bail!("{url}: https is not supported; use the server's plain http:// address");
            }
            bail!("{url}: expected a URL such as http://127.0.0.1:8026");
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        // A literal IPv6 address is bracketed: [::1]:8026.
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => {
                let (host, after) = v6
                    .split_once(']')
                    .with_context(|| format!("{url}: unclosed '['"))?;
                (host, after.strip_prefix(':'))
            }
            None => match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            },
        };
        let port = match port {
            Some(p) => p
                .parse::<u16>()
                .with_context(|| format!("{url}: bad port {p:?}"))?,
            None => 80,
        };
        if host.is_empty() {
            bail!("{url}: no host");
        }
        let prefix = path.trim_end_matches('/');
        let prefix = prefix.strip_suffix("/v1").unwrap_or(prefix);
        Ok(BaseUrl {
            host: host.into(),
            port,
            prefix: prefix.into(),
        })
    }

    pub fn is_local(&self) -> bool {
        matches!(
            self.host.as_str(),
            "127.0.0.1" | "localhost" | "::1" | "0.0.0.0"
        ) || self.host.starts_with("127.")
    }
}

/// A response whose body has not been read yet.
pub struct Response {
    pub status: u16,
    body: BufReader<Body>,
}

impl Response {
    /// The next server-sent event's JSON (`data: {...}`), skipping other lines; `None` at
    /// `data: [DONE]` or the end. An event that is not JSON, or an `error` event (a stream cut
    /// by the server), is an error.
    pub fn next_event(&mut self) -> anyhow::Result<Option<serde_json::Value>> {
        while let Some(line) = self.read_line()? {
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                return Ok(None);
            }
            let event: serde_json::Value = serde_json::from_str(data)
                .with_context(|| format!("a stream event is not JSON: {data}"))?;
            if let Some(error) = event.get("error") {
                bail!("the server sent an error mid-stream: {error}");
            }
            return Ok(Some(event));
        }
        Ok(None)
    }

    /// The next line of the body without its line ending; `None` at the end.
    pub fn read_line(&mut self) -> io::Result<Option<String>> {
        let mut line = String::new();
        if self.body.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        let trimmed = line.trim_end_matches(['\r', '\n']).len();
        line.truncate(trimmed);
        Ok(Some(line))
    }

    pub fn text(mut self) -> io::Result<String> {
        let mut text = String::new();
        self.body.read_to_string(&mut text)?;
        Ok(text)
    }
}

/// Waits until the server's `/health` answers 200 (ember, llama-server and vLLM answer 503
/// while the model loads), polling twice a second for up to `timeout`. A server without the
/// route (404) counts as ready; one that does not answer at all is an error at once.
pub fn wait_ready(base: &BaseUrl, api_key: Option<&str>, timeout: Duration) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    let mut said = false;
    loop {
        let response = request(
            base,
            "GET",
            "/health",
            api_key,
            None,
            Duration::from_secs(30),
        )
        .with_context(|| format!("asking {}:{} for /health", base.host, base.port))?;
        match response.status {
            200 | 404 => return Ok(()),
            503 if start.elapsed() < timeout => {
                if !said {
                    eprintln!("waiting for the server to finish loading (/health answers 503)");
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            status => {
                let text = response.text().unwrap_or_default();
                bail!("/health answered {status}: {}", text.trim());
            }
        }
    }
}

/// POSTs `body` as JSON with `"stream": true` expected of it, and returns the response once
/// the server has answered 200 (any other status is an error carrying the server's message),
/// ready for [`Response::next_event`].
pub fn post_stream(
    base: &BaseUrl,
    path: &str,
    api_key: Option<&str>,
    body: &serde_json::Value,
    timeout: Duration,
) -> anyhow::Result<Response> {
    let body = serde_json::to_vec(body)?;
    let response = request(base, "POST", path, api_key, Some(&body), timeout)?;
    if response.status != 200 {
        let status = response.status;
        let text = response.text().unwrap_or_default();
        bail!("the server answered {status}: {}", text.trim());
    }
    Ok(response)
}

/// POSTs `body` as JSON and returns the server's JSON answer once it has answered 200 (any
/// other status is an error carrying the server's message).
pub fn post_json(
    base: &BaseUrl,
    path: &str,
    api_key: Option<&str>,
    body: &serde_json::Value,
    timeout: Duration,
) -> anyhow::Result<serde_json::Value> {
    let body = serde_json::to_vec(body)?;
    let response = request(base, "POST", path, api_key, Some(&body), timeout)?;
    let status = response.status;
    let text = response
        .text()
        .with_context(|| format!("reading the answer to POST {path}"))?;
    if status != 200 {
        bail!("the server answered {status}: {}", text.trim());
    }
    serde_json::from_str(&text).with_context(|| format!("the answer to POST {path} is not JSON"))
}

/// Sends one request and reads the status line and headers.
pub fn request(
    base: &BaseUrl,
    method: &str,
    path: &str,
    api_key: Option<&str>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> anyhow::Result<Response> {
    let addr = (base.host.as_str(), base.port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {}", base.host))?
        .next()
        .with_context(|| format!("{} has no address", base.host))?;
    let stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    let mut head = format!(
        "{method} {}{path} HTTP/1.1\r\nHost: {}:{}\r\nConnection: close\r\nAccept: */*\r\n",
        base.prefix, base.host, base.port
    );
    if let Some(key) = api_key {
        head.push_str(&format!("Authorization: Bearer {key}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    let mut writer = &stream;
    writer.write_all(head.as_bytes())?;
    if let Some(body) = body {
        writer.write_all(body)?;
    }
    writer.flush()?;

    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader
        .read_line(&mut status_line)
        .with_context(|| format!("reading the response to {method} {path}"))?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("not an HTTP response: {:?}", status_line.trim_end()))?;
    let (mut chunked, mut length) = (false, None);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            bail!("the connection closed inside the response headers");
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.to_ascii_lowercase().contains("chunked");
            } else if name.eq_ignore_ascii_case("content-length") {
                length = value.parse::<u64>().ok();
            }
        }
    }
    let body = match (chunked, length) {
        (true, _) => Body::Chunked {
            inner: reader,
            left: 0,
            done: false,
        },
        (false, Some(n)) => Body::Length {
            inner: reader,
            left: n,
        },
        (false, None) => Body::UntilClose(reader),
    };
    Ok(Response {
        status,
        body: BufReader::new(body),
    })
}

/// A response body, framed as the headers said.
enum Body {
    Chunked {
        inner: BufReader<TcpStream>,
        /// Bytes left in the current chunk.
        left: u64,
        done: bool,
    },
    Length {
        inner: BufReader<TcpStream>,
        left: u64,
    },
    UntilClose(BufReader<TcpStream>),
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Body::UntilClose(inner) => inner.read(buf),
            Body::Length { inner, left } => {
                if *left == 0 {
                    return Ok(0);
                }
                let want = buf.len().min(*left as usize);
                let n = inner.read(&mut buf[..want])?;
                *left -= n as u64;
                Ok(n)
            }
            Body::Chunked { inner, left, done } => {
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut size = String::new();
                    inner.read_line(&mut size)?;
                    let size = size.trim();
                    // Chunk extensions (";name=value") are allowed and ignored.
                    let digits = size.split(';').next().unwrap_or("");
                    let n = u64::from_str_radix(digits, 16).map_err(|_| {
                        io::Error::new(io::ErrorKind::InvalidData, "bad chunk size")
                    })?;
                    if n == 0 {
                        *done = true;
                        return Ok(0);
                    }
                    *left = n;
                }
                let want = buf.len().min(*left as usize);
                let n = inner.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                *left -= n as u64;
                if *left == 0 {
                    let mut crlf = [0u8; 2];
                    inner.read_exact(&mut crlf)?;
                }
                Ok(n)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_base_urls() {
        let b = BaseUrl::parse("http://127.0.0.1:8026").unwrap();
        assert_eq!(
            (b.host.as_str(), b.port, b.prefix.as_str()),
            ("127.0.0.1", 8026, "")
        );
        let b = BaseUrl::parse("http://localhost:8080/v1/").unwrap();
        assert_eq!(
            (b.host.as_str(), b.port, b.prefix.as_str()),
            ("localhost", 8080, "")
        );
        let b = BaseUrl::parse("http://box/api/v1").unwrap();
        assert_eq!(
            (b.host.as_str(), b.port, b.prefix.as_str()),
            ("box", 80, "/api")
        );
        let b = BaseUrl::parse("http://[::1]:9000").unwrap();
        assert_eq!((b.host.as_str(), b.port), ("::1", 9000));
        assert!(
            BaseUrl::parse("https://x")
                .unwrap_err()
                .to_string()
                .contains("https")
        );
        assert!(BaseUrl::parse("127.0.0.1:8026").is_err());
        assert!(BaseUrl::parse("http://h:notaport").is_err());
    }
}
