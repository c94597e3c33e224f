//! The worker's Prometheus endpoint: `GET /metrics` (and `/`) over HTTP/1.
//!
//! It must outlive anything a scraper or the host throws at it. An accept
//! error (EMFILE when the process is out of file descriptors, ECONNABORTED,
//! ENOBUFS) is logged once per burst and retried after a backoff that grows
//! from 10 ms to 1 s, so it neither ends the endpoint nor spins a core. A
//! connection must send its request head within [`HEADER_TIMEOUT`], and at
//! most [`MAX_CONNECTIONS`] are served at once (more are closed on accept),
//! so idle or slow clients cannot hold the worker's descriptors.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

/// Most metrics connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may take to send its request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Binds the metrics listener (port 0 picks a free port).
/// Binds `addr`, HOST:PORT (a host name is resolved; the first address is used).
pub async fn bind(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Serves the text rendered by `render` forever.
pub async fn serve_metrics(listener: tokio::net::TcpListener, render: Arc<dyn Fn() -> String + Send + Sync>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut errors = AcceptErrors::default();
    loop {
        let stream = accept_next(|| async { listener.accept().await.map(|(stream, _)| stream) }, &mut errors).await;
        // Over the cap the connection is closed at once (dropped).
        let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
        let render = render.clone();
        tokio::spawn(async move {
            serve_connection(stream, render).await;
            drop(slot);
        });
    }
}

async fn serve_connection(stream: tokio::net::TcpStream, render: Arc<dyn Fn() -> String + Send + Sync>) {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::service::service_fn;
    use hyper::{Response, StatusCode};

    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let render = render.clone();
        async move {
            let response = match req.uri().path() {
                "/metrics" | "/" => Response::builder()
                    .header("content-type", "text/plain; version=0.0.4")
                    .body(Full::new(Bytes::from(render()))),
                _ => Response::builder().status(StatusCode::NOT_FOUND).body(Full::new(Bytes::from("not found\n"))),
            };
            Ok::<_, hyper::http::Error>(response.expect("static response parts"))
        }
    });
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(io, service)
        .await;
}

/// The state of a burst of accept errors.
#[derive(Debug, Default)]
pub(crate) struct AcceptErrors {
    /// Errors since the last accepted connection.
    pub in_burst: u64,
    /// Errors ever (for tests and logs).
    pub total: u64,
    backoff: Duration,
}

/// The next connection from `accept`, waiting out its errors: the first of
/// a burst is logged, the rest only counted, and each is followed by a
/// growing pause; the end of a burst is logged with its count.
pub(crate) async fn accept_next<S, F, Fut>(mut accept: F, errors: &mut AcceptErrors) -> S
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::io::Result<S>>,
{
    loop {
        match accept().await {
            Ok(stream) => {
                if errors.in_burst > 0 {
                    tracing::info!("metrics endpoint: accepting again after {} failed accepts", errors.in_burst);
                    errors.in_burst = 0;
                }
                errors.backoff = Duration::ZERO;
                return stream;
            }
            Err(e) => {
                if errors.in_burst == 0 {
                    tracing::warn!(
                        "metrics endpoint: accept failed: {e}; retrying with backoff (logged once per burst)"
                    );
                }
                errors.in_burst += 1;
                errors.total += 1;
                errors.backoff = (errors.backoff * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
                tokio::time::sleep(errors.backoff).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accept_errors_are_survived_with_backoff() {
        let mut calls = 0u32;
        let mut errors = AcceptErrors::default();
        let started = std::time::Instant::now();
        let got = accept_next(
            || {
                calls += 1;
                let n = calls;
                async move {
                    if n <= 5 { Err(std::io::Error::from_raw_os_error(24)) } else { Ok(n) } // 24 = EMFILE
                }
            },
            &mut errors,
        )
        .await;
        assert_eq!((got, errors.total, errors.in_burst), (6, 5, 0));
        // 10 + 20 + 40 + 80 + 160 ms of backoff: not a spin.
        assert!(started.elapsed() >= Duration::from_millis(300), "{:?}", started.elapsed());
        // A later burst starts from the shortest pause again.
        assert_eq!(errors.backoff, Duration::ZERO);
    }
}
