//! hyper answers a request head it cannot take by itself, before any handler runs: 431 for a
//! head past its buffer, 400 for one that does not parse, each with an empty body. Between
//! hyper and the socket, [`JsonErrors`] replaces exactly those answers with the same status in
//! the API's JSON error shape, so a client sees what went wrong as for every other error.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A connection whose writes pass through, except hyper's own empty-bodied error answers.
pub(super) struct JsonErrors<S> {
    inner: S,
    /// A replacement answer still to be written, and how much of it is.
    pending: Option<(Vec<u8>, usize)>,
}

impl<S> JsonErrors<S> {
    pub(super) fn new(inner: S) -> Self {
        JsonErrors {
            inner,
            pending: None,
        }
    }
}

/// The JSON answer for `head` when it is one of hyper's own: a bare 431 or 400 head with no
/// body (handlers' answers always have a body).
fn replacement(head: &[u8]) -> Option<Vec<u8>> {
    let (status, reason, message) = if head.starts_with(b"HTTP/1.1 431 ") {
        (
            431,
            "Request Header Fields Too Large",
            format!(
                "the request's headers are too large: at most {} KiB",
                super::MAX_HEAD_BYTES >> 10
            ),
        )
    } else if head.starts_with(b"HTTP/1.1 400 ") {
        (
            400,
            "Bad Request",
            "the request is not valid HTTP/1.1 (its request line or headers do not parse)"
                .to_owned(),
        )
    } else {
        return None;
    };
    let text = std::str::from_utf8(head).ok()?;
    let bare = text.ends_with("\r\n\r\n")
        && text
            .lines()
            .any(|l| l.eq_ignore_ascii_case("content-length: 0"));
    if !bare {
        return None;
    }
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": null,
        "code": null,
    }})
    .to_string();
    Some(
        format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

impl<S: AsyncWrite + Unpin> JsonErrors<S> {
    /// Writes what is left of a replacement answer.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, written)) = &mut self.pending {
            if *written == bytes.len() {
                self.pending = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonErrors<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonErrors<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        if let Some(answer) = replacement(buf) {
            // hyper's answer counts as written; ours goes out in its place.
            self.pending = Some((answer, 0));
            ready!(self.poll_pending(cx))?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    // One buffer per write, so an answer's head arrives whole in one call.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hypers_bare_error_heads_are_replaced() {
        let bare =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let answer = String::from_utf8(replacement(bare).unwrap()).unwrap();
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        let body: serde_json::Value =
            serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("headers are too large")
        );
        let bad = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n";
        assert!(replacement(bad).is_some());
        // A handler's 400 has a body; a 200 is never touched.
        let handler = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 20\r\n\r\n{\"error\": {}}";
        assert!(replacement(handler).is_none());
        assert!(replacement(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
    }
}
