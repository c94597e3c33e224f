//! What a handler answers: a status and a JSON body, or a stream of
//! server-sent events. The HTTP server turns it into the hyper response.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::{Response, StatusCode};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::error::ApiError;

/// A response body: a whole buffer, or SSE events as they come.
pub enum ReplyBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<String>),
    /// A whole buffer whose end waits for `until`: the client has all of it
    /// at once (its length is sent), while the connection stays open until
    /// the request body it is still sending has been read and dropped.
    Linger(Option<Bytes>, oneshot::Receiver<()>),
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ReplyBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ReplyBody::Stream(rx) => rx.poll_recv(cx).map(|event| event.map(|e| Ok(Frame::data(Bytes::from(e))))),
            ReplyBody::Linger(bytes, until) => match bytes.take() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None => Pin::new(until).poll(cx).map(|_| None),
            },
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ReplyBody::Full(bytes) | ReplyBody::Linger(bytes, _) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            ReplyBody::Stream(_) => SizeHint::default(),
        }
    }
}

pub struct Reply {
    status: StatusCode,
    body: ReplyBody,
    content_type: &'static str,
    retry_after: Option<u64>,
    /// Sends `connection: close`: the request's body was not read.
    close: bool,
    /// Sends `idempotent-replayed: true`: an answer kept for an `Idempotency-Key`.
    replayed: bool,
}

/// A whole answer as it was sent: status, content type and body.
pub type Recorded = Option<(StatusCode, &'static str, Bytes)>;

const JSON: &str = "application/json";
const SSE: &str = "text/event-stream";
/// Prometheus' text exposition format; Prometheus 3 refuses a scrape
/// served under any other type.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

impl Reply {
    pub fn json(body: &impl Serialize) -> Self {
        Self::json_status(StatusCode::OK, body)
    }

    pub fn json_status(status: StatusCode, body: &impl Serialize) -> Self {
        match serde_json::to_vec(body) {
            Ok(bytes) => Self {
                status,
                body: ReplyBody::Full(Some(Bytes::from(bytes))),
                content_type: JSON,
                retry_after: None,
                close: false,
                replayed: false,
            },
            Err(e) => Self::error(&ApiError::internal(format!("encoding the response: {e}"))),
        }
    }

    pub fn sse(events: mpsc::Receiver<String>) -> Self {
        Self {
            status: StatusCode::OK,
            body: ReplyBody::Stream(events),
            content_type: SSE,
            retry_after: None,
            close: false,
            replayed: false,
        }
    }

    /// A body that is not JSON, served as `content_type`.
    pub fn text(status: StatusCode, content_type: &'static str, body: String) -> Self {
        Self {
            status,
            body: ReplyBody::Full(Some(Bytes::from(body))),
            content_type,
            retry_after: None,
            close: false,
            replayed: false,
        }
    }

    pub fn error(e: &ApiError) -> Self {
        Self {
            status: e.status,
            body: ReplyBody::Full(Some(Bytes::from(e.body()))),
            content_type: JSON,
            retry_after: e.retry_after,
            close: false,
            replayed: false,
        }
    }

    /// `e`, with the connection closed after it.
    /// `e` in Anthropic's shape (`/v1/messages`).
    pub fn anthropic_error(e: &ApiError) -> Self {
        Self { retry_after: e.retry_after, ..Self::json_status(e.status, &e.anthropic_body()) }
    }

    pub fn error_closing(e: &ApiError) -> Self {
        Self { close: true, ..Self::error(e) }
    }

    /// `e`, sent at once; the connection closes once `until` fires.
    pub fn error_lingering(e: &ApiError, until: oneshot::Receiver<()>) -> Self {
        Self { body: ReplyBody::Linger(Some(Bytes::from(e.body())), until), ..Self::error_closing(e) }
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// An answer kept for an idempotency key, sent again as it was.
    pub fn replayed(status: StatusCode, content_type: &str, body: String) -> Self {
        let content_type = if content_type == SSE { SSE } else { JSON };
        Self { replayed: true, ..Self::text(status, content_type, body) }
    }

    /// This reply, calling `done` with all of it once it is produced: a
    /// whole body at once, a stream's events when it ends. A failure (a
    /// status over 299, a stream the client left) gives `None`.
    pub fn record(self, done: impl FnOnce(Recorded) + Send + 'static) -> Self {
        let success = self.status.is_success();
        match self.body {
            ReplyBody::Full(Some(bytes)) => {
                done(success.then(|| (self.status, self.content_type, bytes.clone())));
                Self { body: ReplyBody::Full(Some(bytes)), ..self }
            }
            ReplyBody::Stream(mut events) if success => {
                let (tx, rx) = mpsc::channel(64);
                let (status, content_type) = (self.status, self.content_type);
                tokio::spawn(async move {
                    let mut all = String::new();
                    while let Some(event) = events.recv().await {
                        all.push_str(&event);
                        if tx.send(event).await.is_err() {
                            // The client left: dropping `events` aborts the request.
                            return done(None);
                        }
                    }
                    done(Some((status, content_type, Bytes::from(all))));
                });
                Self { body: ReplyBody::Stream(rx), ..self }
            }
            body => {
                done(None);
                Self { body, ..self }
            }
        }
    }

    pub fn into_response(self) -> Response<ReplyBody> {
        let mut builder = Response::builder().status(self.status).header("content-type", self.content_type);
        if self.content_type == SSE {
            builder = builder.header("cache-control", "no-cache");
        }
        if self.close {
            builder = builder.header("connection", "close");
        }
        if self.replayed {
            builder = builder.header("idempotent-replayed", "true");
        }
        if let Some(seconds) = self.retry_after {
            builder = builder.header("retry-after", seconds.to_string());
        }
        builder.body(self.body).unwrap_or_else(|_| Response::new(ReplyBody::Full(None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content_type(reply: Reply) -> String {
        reply.into_response().headers()["content-type"].to_str().unwrap().to_string()
    }

    #[test]
    fn each_body_kind_has_its_content_type() {
        assert_eq!(content_type(Reply::json(&serde_json::json!({}))), "application/json");
        assert_eq!(content_type(Reply::error(&ApiError::bad_request("no"))), "application/json");
        let (_tx, rx) = mpsc::channel(1);
        assert_eq!(content_type(Reply::sse(rx)), "text/event-stream");
        // Prometheus 3 refuses `/metrics` served as JSON.
        let metrics = Reply::text(StatusCode::OK, PROMETHEUS_TEXT, "up 1\n".into());
        assert!(content_type(metrics).starts_with("text/plain; version=0.0.4"));
    }
}
