//! Accepting connections so that sockets cannot exhaust the server: a connection must send its
//! request headers within a time limit (and an idle keep-alive connection is closed after
//! it: hyper times the wait for each request's head), and past a number of open connections a
//! new one gets a 503 in the API's JSON shape and is closed, before the process runs out of
//! file descriptors and `/health` with it. A request head hyper refuses itself (too large,
//! or not HTTP) is answered in the API's JSON error shape too ([`json_errors`]).

mod json_errors;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;

use self::json_errors::JsonErrors;

/// The most bytes of a request's head (its request line and headers): past them, a 431.
const MAX_HEAD_BYTES: usize = 64 << 10;

/// How connections are held to account.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Connections open at once; one more gets a 503 and is closed.
    pub max_connections: usize,
    /// Time a connection has to send a request's headers, and that an idle keep-alive
    /// connection is kept.
    pub header_timeout: Duration,
}

impl ConnectionLimits {
    /// Connections that leave room in this process's file descriptor limit for everything
    /// else it opens (model files, the engine's, the runtime's): the soft limit less 64, at
    /// most 1024, at least 16.
    pub fn default_max_connections() -> usize {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
            usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
        } else {
            1024
        };
        soft.saturating_sub(64).clamp(16, 1024)
    }
}

/// Serves `router` on `listener` until `stop` turns true; then accepts nothing more, lets each
/// open connection finish the request it is in, and returns once all have closed.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let service = router
        .map_request(|request: Request<hyper::body::Incoming>| request.map(axum::body::Body::new));
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or a connection reset before it was taken: wait a
                    // moment rather than spin, as the next accept may well succeed.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.wait_for(|stop| *stop) => break,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_buf_size(MAX_HEAD_BYTES)
            .serve_connection(
                TokioIo::new(JsonErrors::new(stream)),
                TowerToHyperService::new(service.clone()),
            );
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A client gone mid-request or a header timeout ends the connection; nothing to do.
            let _ = connection.await;
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers a connection past the limit with a 503 in the API's error shape, and closes it.
async fn refuse(mut stream: TcpStream, limit: usize) -> Result<(), Infallible> {
    let body = serde_json::json!({"error": {
        "message": format!(
            "the server has {limit} connections open, its limit (--max-connections); retry shortly"
        ),
        "type": "server_overloaded",
        "param": null,
        "code": null,
    }})
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), write).await;
    Ok(())
}
