//! The HTTP server (hyper 1.x): routing, the API-key check, the limits a
//! client must keep (head size, body size, read timeouts, connections) and
//! the shutdown refusal. `handle` is a plain function of a request, so
//! tests can call it without a socket; `serve` runs it on a real listener.
//!
//! What hyper answers itself (a request line or header it cannot parse:
//! 400; a head over its buffer, ~400 KiB, or with more than
//! `HYPER_MAX_HEADERS` headers: 431; a URI over 64 KiB: 414) it sends with
//! an empty body; `refusals` puts our JSON error in it on the way out.
//! Everything smaller that is still too large gets our JSON error directly.

mod refusals;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, EXPECT, HeaderMap};
use hyper::{Method, Request, Response, StatusCode};
use tokio::io::AsyncWriteExt;
use tokio::sync::{oneshot, watch};

use crate::api::reply::{PROMETHEUS_TEXT, ReplyBody};
use crate::api::{ApiError, Reply, chat, completions, generate, info, messages, responses, tokenize};
use crate::app::{AppState, HttpLimits};
use crate::connections::{Admission, Busy, Connections};
use crate::idempotency::{self, Lookup};

/// Headers we accept, in number and in bytes (request line included).
const MAX_HEADERS: usize = 100;
const MAX_HEADER_BYTES: usize = 64 << 10;
const MAX_URI_BYTES: usize = 8 << 10;
/// hyper's own header count limit, above ours so that ours answers first.
const HYPER_MAX_HEADERS: usize = 1000;

/// Routes one request. Never panics on input; every failure is a JSON error.
pub async fn handle(app: Arc<AppState>, req: Request<Incoming>) -> Result<Response<ReplyBody>, Infallible> {
    let started = std::time::Instant::now();
    let path = req.uri().path().to_string();
    let reply = match refuse_at_once(&app, req) {
        Err(reply) => {
            app.metrics.rejected(reply.status());
            reply
        }
        Ok(req) => match route(app.clone(), req).await {
            Ok(reply) => reply,
            Err(e) => {
                app.metrics.rejected(e.status);
                // The body was not read to its end: the connection cannot carry another request.
                if e.status == StatusCode::REQUEST_TIMEOUT {
                    Reply::error_closing(&e)
                } else if path.starts_with("/v1/messages") {
                    Reply::anthropic_error(&e)
                } else {
                    Reply::error(&e)
                }
            }
        },
    };
    app.metrics.http_request(&path, reply.status().as_u16(), started.elapsed());
    Ok(reply.into_response())
}

/// Refuses what needs no routing: an oversized head or URI, and a declared
/// body over the limit, answered before any of it is read (so with
/// `Expect: 100-continue`, no 100 is ever sent).
fn refuse_at_once(app: &AppState, req: Request<Incoming>) -> Result<Request<Incoming>, Reply> {
    let uri_bytes = req.uri().to_string().len();
    if uri_bytes > MAX_URI_BYTES {
        return Err(Reply::error_closing(&ApiError::uri_too_long(MAX_URI_BYTES)));
    }
    let headers = req.headers();
    if headers.len() > MAX_HEADERS {
        let message = format!("The request has {} headers; at most {MAX_HEADERS} are accepted.", headers.len());
        return Err(Reply::error_closing(&ApiError::headers_too_large(message)));
    }
    let head_bytes = uri_bytes + headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum::<usize>();
    if head_bytes > MAX_HEADER_BYTES {
        let message = format!("The request's headers exceed {MAX_HEADER_BYTES} bytes.");
        return Err(Reply::error_closing(&ApiError::headers_too_large(message)));
    }
    let limit = app.limits.max_body_bytes;
    let declared = headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let Some(declared) = declared.filter(|&len| len > limit as u64) else { return Ok(req) };
    let expects_continue = headers.get(EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let error = ApiError::too_large(limit);
    if expects_continue || declared > DRAIN_MAX_BYTES as u64 {
        // The client waits for a 100 that never comes (or the body is too big
        // to read just to drop it): answer and close.
        return Err(Reply::error_closing(&error));
    }
    // The client is sending the body now. Closing with unread data resets
    // the connection, and the client would see a broken pipe instead of the
    // 413: send the 413 at once, keep reading and dropping, then close.
    let (done, until) = oneshot::channel();
    let mut body = req.into_body();
    tokio::spawn(async move {
        let _ = tokio::time::timeout(DRAIN_TIME, drain(&mut body, DRAIN_MAX_BYTES)).await;
        let _ = done.send(());
    });
    Err(Reply::error_lingering(&error, until))
}

/// The endpoints that take a JSON body.
const POST_PATHS: [&str; 8] = [
    "/tokenize",
    "/detokenize",
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
];

/// The fixed endpoints that are only read.
const GET_PATHS: [&str; 5] = ["/health", "/metrics", "/v1/prometheus/targets", "/v1/models", "/v1/workers"];

async fn route(app: Arc<AppState>, req: Request<Incoming>) -> Result<Reply, ApiError> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    // Health, metrics and the page's files stay open; the API needs the key.
    match (&method, path.as_str()) {
        (&Method::GET, "/health") => return Ok(info::health(&app)),
        (&Method::GET, p) if let Some(file) = crate::page::file(p) => return Ok(file),
        (&Method::GET, "/metrics") => {
            return Ok(Reply::text(StatusCode::OK, PROMETHEUS_TEXT, app.metrics.render(&app.cluster)));
        }
        _ => {}
    }
    if !authorized(app.api_key.as_deref(), req.headers()) {
        return Err(ApiError::unauthorized());
    }
    match (&method, path.as_str()) {
        // Workers' addresses: for Prometheus with the key, not for anyone.
        (&Method::GET, "/v1/prometheus/targets") => Ok(info::prometheus_targets(&app)),
        (&Method::GET, "/v1/models") => Ok(info::models(&app)),
        (&Method::GET, "/v1/workers") => Ok(info::workers(&app)),
        (&Method::GET, p) if p.starts_with("/v1/models/") => info::model(&app, &p["/v1/models/".len()..]),
        (&Method::GET, p) if p.starts_with("/v1/responses/") => responses::get(&app, &p["/v1/responses/".len()..]),
        (&Method::DELETE, p) if p.starts_with("/v1/responses/") => {
            responses::delete(&app, &p["/v1/responses/".len()..])
        }
        (&Method::POST, p) if POST_PATHS.contains(&p) => {
            check_content_type(req.headers())?;
            let counting = ["/tokenize", "/detokenize", "/v1/messages/count_tokens"].contains(&path.as_str());
            if !counting && app.shutting_down() {
                return Err(ApiError::unavailable("the server is shutting down"));
            }
            // Generations may carry a key their retries send again.
            let key = if counting || path == "/tokenize" || path == "/detokenize" {
                None
            } else {
                idempotency_key(req.headers())?
            };
            let body = read_body(req, &app.limits).await?;
            let held = match &key {
                Some(key) => {
                    let digest = idempotency::request_digest(&body);
                    match app.idempotency.begin(&path, key, &digest) {
                        Lookup::Run => {
                            Some(HeldKey { app: app.clone(), path: path.clone(), key: key.clone(), finished: false })
                        }
                        Lookup::Replay(answer) => {
                            let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::OK);
                            return Ok(Reply::replayed(status, &answer.content_type, answer.body));
                        }
                        Lookup::Running => {
                            return Err(ApiError::conflict(
                                "Idempotency-Key",
                                "A request with this Idempotency-Key is still running; retry once it has finished.",
                            ));
                        }
                        Lookup::Mismatch => {
                            return Err(ApiError::unprocessable(
                                "Idempotency-Key",
                                "This Idempotency-Key was used for a different request body.",
                            ));
                        }
                    }
                }
                None => None,
            };
            let work = async {
                match path.as_str() {
                    "/tokenize" => tokenize::tokenize(&app, body).await,
                    "/detokenize" => tokenize::detokenize(&app, body).await,
                    "/generate" => generate::generate(app.clone(), body).await,
                    "/v1/completions" => completions::completions(app.clone(), body).await,
                    "/v1/messages" => messages::messages(app.clone(), body).await,
                    "/v1/messages/count_tokens" => messages::count_tokens(app.clone(), body).await,
                    "/v1/responses" => responses::create(app.clone(), body).await,
                    _ => chat::chat(app.clone(), body).await,
                }
            };
            // At the shutdown timeout a whole response still waited for is
            // refused (streams end themselves, see `sse`); dropping it aborts
            // its requests on the workers.
            let reply = tokio::select! {
                reply = work => reply,
                () = app.cut() => Err(ApiError::unavailable("the server is shutting down; the request was cut")),
            };
            match (reply, held) {
                (Ok(reply), Some(held)) => Ok(reply.record(move |recorded| held.finish(recorded))),
                // An error frees the key (dropping `held`).
                (reply, _) => reply,
            }
        }
        (_, p) if POST_PATHS.contains(&p) || GET_PATHS.contains(&p) => Err(ApiError::method_not_allowed()),
        _ => Err(ApiError::not_found(&path)),
    }
}

/// The `Idempotency-Key` (or, as vLLM names a request, `X-Request-Id`)
/// header: visible ASCII, at most `idempotency::MAX_KEY_BYTES`.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key").or_else(|| headers.get("x-request-id")) else {
        return Ok(None);
    };
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > idempotency::MAX_KEY_BYTES || !bytes.iter().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::invalid(
            "Idempotency-Key",
            format!("An Idempotency-Key is 1 to {} visible ASCII characters.", idempotency::MAX_KEY_BYTES),
        ));
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

/// A key held by the request running under it: its answer is kept when
/// it finishes well; dropped unfinished (an error, a cut), the key is free.
struct HeldKey {
    app: Arc<AppState>,
    path: String,
    key: String,
    finished: bool,
}

impl HeldKey {
    fn finish(mut self, recorded: crate::api::reply::Recorded) {
        let answer = recorded.and_then(|(status, content_type, body)| {
            let answer = idempotency::answer(status.as_u16(), content_type, &body)?;
            let whole = content_type != "text/event-stream" || idempotency::stream_succeeded(&answer.body);
            whole.then_some(answer)
        });
        self.app.idempotency.finish(&self.path, &self.key, answer);
        self.finished = true;
    }
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        if !self.finished {
            self.app.idempotency.finish(&self.path, &self.key, None);
        }
    }
}

/// `Authorization: Bearer KEY`, the scheme in any case (RFC 9110 §11.1),
/// or Anthropic's `x-api-key: KEY`; the key compared in constant time.
fn authorized(key: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(key) = key else { return true };
    if let Some(given) = headers.get("x-api-key") {
        return constant_time_eq(given.as_bytes(), key.as_bytes());
    }
    let given = headers.get(AUTHORIZATION).map(|v| v.as_bytes()).unwrap_or_default();
    let Some(space) = given.iter().position(|&b| b == b' ' || b == b'\t') else { return false };
    let (scheme, token) = given.split_at(space);
    let token = token.trim_ascii_start();
    scheme.eq_ignore_ascii_case(b"bearer") && constant_time_eq(token, key.as_bytes())
}

/// Compares SHA-256 digests with an xor-fold, so the time taken says
/// nothing about where the given key first differs, nor its length.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let (a, b) = (ring::digest::digest(&ring::digest::SHA256, a), ring::digest::digest(&ring::digest::SHA256, b));
    let diff = a.as_ref().iter().zip(b.as_ref()).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// JSON bodies only (vLLM answers 415 too). A request without a type, or
/// with `curl -d`'s default form type (the README's examples), is read as
/// JSON; any other type is a 415.
fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(CONTENT_TYPE) else { return Ok(()) };
    let text = String::from_utf8_lossy(value.as_bytes());
    let media = text.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    if media == "application/json" || media.ends_with("+json") || media == "application/x-www-form-urlencoded" {
        Ok(())
    } else {
        Err(ApiError::unsupported_media_type(&text))
    }
}

/// An oversized body up to this size is read and dropped after the 413 goes
/// out, for at most `DRAIN_TIME`; larger ones are not read at all.
const DRAIN_MAX_BYTES: usize = 16 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(10);

/// The body, within the size limit and the body timeout.
async fn read_body(req: Request<Incoming>, limits: &HttpLimits) -> Result<Bytes, ApiError> {
    let limit = limits.max_body_bytes;
    let mut body = req.into_body();
    let read = async {
        let mut data = bytes::BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
            let Ok(chunk) = frame.into_data() else { continue };
            if data.len() + chunk.len() > limit {
                // Chunked, so its size was unknown up front.
                drain(&mut body, DRAIN_MAX_BYTES.saturating_sub(data.len() + chunk.len())).await;
                return Err(ApiError::too_large(limit));
            }
            data.extend_from_slice(&chunk);
        }
        Ok(data.freeze())
    };
    tokio::time::timeout(limits.body_timeout, read)
        .await
        .unwrap_or_else(|_| Err(ApiError::body_timeout(limits.body_timeout.as_secs())))
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

/// A response body that marks its connection busy until it is dropped
/// (written out, or the client gone), so the connection cap never closes a
/// connection in the middle of a response.
struct Tracked {
    inner: ReplyBody,
    _busy: Busy,
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The answer to a connection over the cap when every slot serves a request.
const FULL: &str = "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
                    connection: close\r\ncontent-length: 110\r\n\r\n\
                    {\"error\":{\"message\":\"Too many open connections; retry later.\",\"type\":\"server_error\",\
                    \"param\":null,\"code\":null}}";

/// Backoff after an accept error that is not the peer's (EMFILE, ENOBUFS):
/// retrying at once would spin a core and still fail.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How long a new connection waits for the idle one it replaces to close.
const EVICTION_WAIT: Duration = Duration::from_millis(100);

/// Serves HTTP on `listener` until `shutdown` turns true, then lets open
/// connections finish (bounded by the caller).
pub async fn serve(listener: tokio::net::TcpListener, app: Arc<AppState>, mut shutdown: watch::Receiver<bool>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let connections = Connections::new(app.limits.max_connections);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(app.limits.header_timeout)
        .max_headers(HYPER_MAX_HEADERS);
    let mut backoff: Option<Duration> = None;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.changed() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff = None;
                stream
            }
            // The peer gave up before we took it: nothing to wait for.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => {
                let wait = backoff.map_or(ACCEPT_BACKOFF_MIN, |b| (b * 2).min(ACCEPT_BACKOFF_MAX));
                if backoff != Some(wait) {
                    tracing::warn!("accepting HTTP connections: {e}; retrying in {wait:?}");
                }
                backoff = Some(wait);
                app.metrics.connection_refused("accept_error");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => continue,
                    _ = shutdown.changed() => break,
                }
            }
        };
        let admitted = match connections.admit() {
            Admission::Admitted(a) => a,
            Admission::Evicted(a, old) => {
                app.metrics.connection_refused("evicted_idle");
                // Its socket closes in its own task; under a flood, accepting on
                // before it has would hold descriptors past the cap (EMFILE).
                let _ = tokio::time::timeout(EVICTION_WAIT, old.closed()).await;
                a
            }
            Admission::Full => {
                app.metrics.connection_refused("full");
                tokio::spawn(async move {
                    let mut stream = stream;
                    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(FULL.as_bytes())).await;
                });
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let slot = admitted.slot.clone();
        let service_app = app.clone();
        let service = hyper::service::service_fn(move |req| {
            let busy = slot.busy();
            let app = service_app.clone();
            async move {
                let response = handle(app, req).await?;
                Ok::<_, Infallible>(response.map(|inner| Tracked { inner, _busy: busy }))
            }
        });
        let io = hyper_util::rt::TokioIo::new(refusals::JsonRefusals::new(stream));
        let conn = graceful.watch(builder.serve_connection(io, service));
        tokio::spawn(async move {
            tokio::select! {
                _ = conn => {}
                // Dropping the connection closes it.
                () = admitted.slot.evicted() => {}
            }
            drop(admitted);
        });
    }
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, value.parse().unwrap());
        headers
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_the_key_exact() {
        for ok in ["Bearer k3y", "bearer k3y", "BEARER k3y", "Bearer   k3y"] {
            assert!(authorized(Some("k3y"), &auth(ok)), "{ok}");
        }
        for bad in ["Bearer k3", "Bearer k3y4", "Basic k3y", "k3y", "Bearer", "Bearerk3y", "Bearer K3Y"] {
            assert!(!authorized(Some("k3y"), &auth(bad)), "{bad}");
        }
        assert!(!authorized(Some("k3y"), &HeaderMap::new()));
        assert!(authorized(None, &HeaderMap::new()));
    }

    #[test]
    fn the_full_answer_is_well_formed() {
        let (head, body) = FULL.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())), "{}", body.len());
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(v["error"]["message"].is_string());
    }

    #[test]
    fn json_content_types_pass_and_others_are_refused() {
        let with = |ct: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, ct.parse().unwrap());
            check_content_type(&headers)
        };
        assert!(with("application/json").is_ok());
        assert!(with("Application/JSON; charset=utf-8").is_ok());
        assert!(with("application/vnd.api+json").is_ok());
        assert!(check_content_type(&HeaderMap::new()).is_ok());
        assert!(with("application/x-www-form-urlencoded").is_ok(), "curl -d");
        assert_eq!(with("text/plain").unwrap_err().status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(with("multipart/form-data; boundary=x").unwrap_err().status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
}
