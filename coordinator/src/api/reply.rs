//! What a handler answers: a status and a JSON body, or a stream of
//! server-sent events. The HTTP server turns it into the hyper response.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame};
use hyper::{Response, StatusCode};
use serde::Serialize;
use tokio::sync::mpsc;

use super::error::ApiError;

/// A response body: a whole buffer, or SSE events as they come.
pub enum ReplyBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<String>),
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            ReplyBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ReplyBody::Stream(rx) => rx.poll_recv(cx).map(|event| event.map(|e| Ok(Frame::data(Bytes::from(e))))),
        }
    }
}

pub struct Reply {
    status: StatusCode,
    body: ReplyBody,
    sse: bool,
    retry_after: Option<u64>,
}

impl Reply {
    pub fn json(body: &impl Serialize) -> Self {
        Self::json_status(StatusCode::OK, body)
    }

    pub fn json_status(status: StatusCode, body: &impl Serialize) -> Self {
        match serde_json::to_vec(body) {
            Ok(bytes) => {
                Self { status, body: ReplyBody::Full(Some(Bytes::from(bytes))), sse: false, retry_after: None }
            }
            Err(e) => Self::error(&ApiError::internal(format!("encoding the response: {e}"))),
        }
    }

    pub fn sse(events: mpsc::Receiver<String>) -> Self {
        Self { status: StatusCode::OK, body: ReplyBody::Stream(events), sse: true, retry_after: None }
    }

    pub fn text(status: StatusCode, body: String) -> Self {
        Self { status, body: ReplyBody::Full(Some(Bytes::from(body))), sse: false, retry_after: None }
    }

    pub fn error(e: &ApiError) -> Self {
        Self {
            status: e.status,
            body: ReplyBody::Full(Some(Bytes::from(e.body()))),
            sse: false,
            retry_after: e.retry_after,
        }
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn into_response(self) -> Response<ReplyBody> {
        let content_type = if self.sse { "text/event-stream" } else { "application/json" };
        let mut builder = Response::builder().status(self.status).header("content-type", content_type);
        if self.sse {
            builder = builder.header("cache-control", "no-cache");
        }
        if let Some(seconds) = self.retry_after {
            builder = builder.header("retry-after", seconds.to_string());
        }
        builder.body(self.body).unwrap_or_else(|_| Response::new(ReplyBody::Full(None)))
    }
}
