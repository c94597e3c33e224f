//! Server-sent events, as `/generate`, `/v1/completions` and
//! `/v1/chat/completions` stream them: each event one `data: {json}` line
//! and a blank line, the stream ended by `data: [DONE]`. A writer task per
//! response turns the request's updates into events; when the client goes
//! away its send fails, the task ends, and dropping the updates' receiver
//! aborts the request on its worker.

use std::future::Future;

use serde::Serialize;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::reply::Reply;
use crate::app::AppState;

/// Events written ahead of a slow client before the writer waits.
const BUFFER_EVENTS: usize = 64;

const DONE: &str = "data: [DONE]\n\n";

/// The client is gone: stop writing.
#[derive(Debug)]
pub struct ClientGone;

/// The sending side of one response's event stream.
pub struct Events {
    tx: mpsc::Sender<String>,
}

impl Events {
    /// An event with a name (`event: NAME`), as Anthropic's API streams.
    pub async fn send_named(&self, name: &str, event: &impl Serialize) -> Result<(), ClientGone> {
        let data = serde_json::to_string(event)
            .unwrap_or_else(|e| ApiError::internal(format!("encoding an event: {e}")).body());
        self.tx.send(format!("event: {name}\ndata: {data}\n\n")).await.map_err(|_| ClientGone)
    }

    pub async fn send(&self, event: &impl Serialize) -> Result<(), ClientGone> {
        let data = serde_json::to_string(event)
            .unwrap_or_else(|e| ApiError::internal(format!("encoding an event: {e}")).body());
        self.tx.send(format!("data: {data}\n\n")).await.map_err(|_| ClientGone)
    }
}

/// A streaming reply whose events `write` sends from its own task; `[DONE]`
/// follows whatever it wrote. If the server cuts its responses (the
/// shutdown timeout) first, the writer is dropped (which aborts its
/// requests) and the stream ends with an error event and `[DONE]`, a whole
/// chunked transfer rather than a broken one.
pub fn stream<F>(app: &AppState, write: impl FnOnce(Events) -> F) -> Reply
where
    F: Future<Output = ()> + Send + 'static,
{
    spawn(app, write, None)
}

/// [`stream`] with named events and no `[DONE]` (Anthropic's API, OpenAI's
/// Responses); a cut stream ends with an `error` event, `cut_event` of the error.
pub fn stream_named<F>(
    app: &AppState,
    cut_event: fn(&ApiError) -> serde_json::Value,
    write: impl FnOnce(Events) -> F,
) -> Reply
where
    F: Future<Output = ()> + Send + 'static,
{
    spawn(app, write, Some(cut_event))
}

/// The writer's task: OpenAI's framing (`cut_event` None: an error body,
/// then `[DONE]`) or named events.
fn spawn<F>(
    app: &AppState,
    write: impl FnOnce(Events) -> F,
    cut_event: Option<fn(&ApiError) -> serde_json::Value>,
) -> Reply
where
    F: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(BUFFER_EVENTS);
    let cut = app.cut();
    let writing = write(Events { tx: tx.clone() });
    tokio::spawn(async move {
        tokio::select! {
            () = writing => {}
            () = cut => {
                let error = ApiError::unavailable("the server is shutting down; the stream was cut");
                let events = Events { tx: tx.clone() };
                let _ = match cut_event {
                    Some(event) => events.send_named("error", &event(&error)).await,
                    None => events.send(&error.to_body()).await,
                };
            }
        }
        if cut_event.is_none() {
            let _ = tx.send(DONE.to_string()).await;
        }
    });
    Reply::sse(rx)
}
