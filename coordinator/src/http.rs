//! The HTTP server (hyper 1.x): routing, API-key check, body-size limit,
//! and the shutdown refusal. `handle` is a plain function of a request, so
//! tests can call it without a socket; `serve` runs it on a real listener.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use tokio::sync::watch;

use crate::api::reply::{PROMETHEUS_TEXT, ReplyBody};
use crate::api::{ApiError, Reply, chat, completions, generate, info, tokenize};
use crate::app::AppState;

/// Routes one request. Never panics on input; every failure is a JSON error.
pub async fn handle(app: Arc<AppState>, req: Request<Incoming>) -> Result<Response<ReplyBody>, Infallible> {
    let started = std::time::Instant::now();
    let path = req.uri().path().to_string();
    let reply = match route(app.clone(), req).await {
        Ok(reply) => reply,
        Err(e) => {
            app.metrics.rejected(e.status);
            Reply::error(&e)
        }
    };
    app.metrics.http_request(&path, reply.status().as_u16(), started.elapsed());
    Ok(reply.into_response())
}

async fn route(app: Arc<AppState>, req: Request<Incoming>) -> Result<Reply, ApiError> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    // Health and metrics stay open to probes; the API needs the key.
    match (&method, path.as_str()) {
        (&Method::GET, "/health") => return Ok(info::health(&app)),
        (&Method::GET, "/metrics") => {
            return Ok(Reply::text(StatusCode::OK, PROMETHEUS_TEXT, app.metrics.render(&app.cluster)));
        }
        (&Method::GET, "/v1/prometheus/targets") => return Ok(info::prometheus_targets(&app)),
        _ => {}
    }
    if let Some(key) = &app.api_key {
        let given =
            req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            return Err(ApiError::unauthorized());
        }
    }
    match (&method, path.as_str()) {
        (&Method::GET, "/v1/models") => Ok(info::models(&app)),
        (&Method::GET, "/v1/workers") => Ok(info::workers(&app)),
        (&Method::GET, p) if p.starts_with("/v1/models/") => info::model(&app, &p["/v1/models/".len()..]),
        (&Method::POST, "/tokenize") => tokenize::tokenize(&app, &read_body(req, app.max_body_bytes).await?),
        (&Method::POST, "/detokenize") => tokenize::detokenize(&app, &read_body(req, app.max_body_bytes).await?),
        (&Method::POST, "/generate" | "/v1/completions" | "/v1/chat/completions") => {
            if app.shutting_down() {
                return Err(ApiError::unavailable("the server is shutting down"));
            }
            let body = read_body(req, app.max_body_bytes).await?;
            match path.as_str() {
                "/generate" => generate::generate(app, &body).await,
                "/v1/completions" => completions::completions(app, &body).await,
                _ => chat::chat(app, &body).await,
            }
        }
        (
            _,
            "/health"
            | "/metrics"
            | "/v1/prometheus/targets"
            | "/v1/models"
            | "/v1/workers"
            | "/tokenize"
            | "/detokenize"
            | "/generate"
            | "/v1/completions"
            | "/v1/chat/completions",
        ) => Err(ApiError::method_not_allowed()),
        _ => Err(ApiError::not_found(&path)),
    }
}

/// An oversized body up to this size is read and dropped before the 413
/// goes out: closing on a client that is still writing resets the
/// connection, and the client sees a broken pipe instead of the answer.
/// Larger ones are refused at once.
const DRAIN_MAX_BYTES: usize = 16 << 20;

async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let declared =
        req.headers().get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    let mut body = req.into_body();
    if let Some(len) = declared
        && len > limit
    {
        if len <= DRAIN_MAX_BYTES {
            drain(&mut body, DRAIN_MAX_BYTES).await;
        }
        return Err(ApiError::too_large(limit));
    }
    let mut data = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
        let Ok(chunk) = frame.into_data() else { continue };
        if data.len() + chunk.len() > limit {
            drain(&mut body, DRAIN_MAX_BYTES.saturating_sub(data.len() + chunk.len())).await;
            return Err(ApiError::too_large(limit));
        }
        data.extend_from_slice(&chunk);
    }
    Ok(data.freeze())
}

/// Reads and drops up to `max` more bytes of `body`.
async fn drain(body: &mut Incoming, max: usize) {
    let mut read = 0;
    while read <= max {
        match body.frame().await {
            Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len()),
            _ => return,
        }
    }
}

/// Serves HTTP on `listener` until `shutdown` turns true, then lets open
/// connections finish (bounded by the caller).
pub async fn serve(listener: tokio::net::TcpListener, app: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let app = app.clone();
                let service = hyper::service::service_fn(move |req| handle(app.clone(), req));
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = shutdown.changed() => break,
        }
    }
    graceful.shutdown().await;
}
