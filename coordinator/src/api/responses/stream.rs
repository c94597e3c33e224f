//! The Responses API's stream: the semantic events of one response
//! (`response.created`, then per output item `response.output_item.added`,
//! its deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`), its `.done` events and
//! `response.output_item.done`, then `response.completed` with the whole
//! response), each numbered. Items come in the order of the whole
//! response's `output`: reasoning, message, calls.

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{Output, function_call_id, function_call_item};
use crate::api::run::Update;
use crate::api::sse::{self, Events};
use crate::api::tool_calls::{ChoiceTools, FunctionCall, ToolCall, ToolDelta};
use crate::app::AppState;
use crate::reasoning::{ReasoningSplitter, Split};

impl Output {
    pub(super) async fn stream(
        self,
        events: Events,
        app: Arc<AppState>,
        mut rx: mpsc::UnboundedReceiver<Update>,
        mut tools: Option<ChoiceTools>,
        mut splitter: Option<ReasoningSplitter>,
    ) {
        let mut sink =
            Sink { events: &events, sequence: 0, message_shown: false, reasoning: None, reasoning_done: false };
        let created = self.response("in_progress", Vec::new(), Value::Null, Value::Null);
        if sink.send("response.created", json!({"response": created})).await.is_err() {
            return;
        }
        let mut text = String::new();
        let mut calls: Vec<ToolCall> = Vec::new();
        let mut message_open = false;
        while let Some(update) = rx.recv().await {
            let delta = match update {
                Update::PromptLogprobs { .. } => continue,
                Update::Delta { text: piece, .. } => {
                    let piece = match &mut splitter {
                        Some(s) => {
                            let Split { reasoning, content } = s.push(&piece);
                            if self.think(&mut sink, &reasoning).await.is_err() {
                                return;
                            }
                            content
                        }
                        None => piece,
                    };
                    match &mut tools {
                        Some(t) => t.push(&piece),
                        None => ToolDelta { content: piece, calls: Vec::new() },
                    }
                }
                Update::End(end) => {
                    let held = match &mut splitter {
                        Some(s) => {
                            let Split { reasoning, content } = s.finish();
                            if self.think(&mut sink, &reasoning).await.is_err() {
                                return;
                            }
                            content
                        }
                        None => String::new(),
                    };
                    let rest = match tools.as_mut() {
                        Some(t) => t.finish_after(&held),
                        None => ToolDelta { content: held, calls: Vec::new() },
                    };
                    let reasoning = sink.reasoning.clone().unwrap_or_default();
                    if self.end_thinking(&mut sink).await.is_err() {
                        return;
                    }
                    if self.show(&mut sink, rest, &mut text, &mut calls, &mut message_open).await.is_err() {
                        return;
                    }
                    if message_open || calls.is_empty() {
                        if !message_open && self.open_message(&mut sink).await.is_err() {
                            return;
                        }
                        if self.close_message(&mut sink, &text).await.is_err() {
                            return;
                        }
                    }
                    if self.close_call(&mut sink, &calls).await.is_err() {
                        return;
                    }
                    let response = self.finish(&app, &reasoning, text, &calls, &end);
                    let _ = sink.send("response.completed", json!({"response": response})).await;
                    return;
                }
                Update::Failed { message, .. } => {
                    let _ =
                        sink.send("error", json!({"code": "server_error", "message": message, "param": null})).await;
                    return;
                }
            };
            if self.show(&mut sink, delta, &mut text, &mut calls, &mut message_open).await.is_err() {
                return;
            }
        }
    }

    /// A piece of thinking, in the reasoning item (the first one).
    async fn think(&self, sink: &mut Sink<'_>, piece: &str) -> Result<(), sse::ClientGone> {
        if piece.is_empty() {
            return Ok(());
        }
        if sink.reasoning.is_none() {
            let item = self.reasoning_item("", "in_progress");
            sink.send("response.output_item.added", json!({"output_index": 0, "item": item})).await?;
            sink.reasoning = Some(String::new());
        }
        if let Some(text) = &mut sink.reasoning {
            text.push_str(piece);
        }
        let delta = json!({"item_id": self.reasoning_id, "output_index": 0, "content_index": 0, "delta": piece});
        sink.send("response.reasoning_text.delta", delta).await
    }

    /// Ends the reasoning item, once, before the answer's items.
    async fn end_thinking(&self, sink: &mut Sink<'_>) -> Result<(), sse::ClientGone> {
        let Some(text) = sink.reasoning.clone().filter(|_| !sink.reasoning_done) else { return Ok(()) };
        sink.reasoning_done = true;
        let done = json!({"item_id": self.reasoning_id, "output_index": 0, "content_index": 0, "text": text});
        sink.send("response.reasoning_text.done", done).await?;
        sink.send(
            "response.output_item.done",
            json!({"output_index": 0, "item": self.reasoning_item(&text, "completed")}),
        )
        .await
    }

    /// Output index of call `i` (after the reasoning and message items shown).
    fn call_index(&self, sink: &Sink<'_>, i: usize) -> usize {
        i + usize::from(sink.message_shown) + sink.message_index()
    }

    async fn open_message(&self, sink: &mut Sink<'_>) -> Result<(), sse::ClientGone> {
        self.end_thinking(sink).await?;
        let index = sink.message_index();
        let item = json!({"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant", "content": []});
        sink.send("response.output_item.added", json!({"output_index": index, "item": item})).await?;
        let part = json!({"type": "output_text", "text": "", "annotations": []});
        let added = json!({"item_id": self.message_id, "output_index": index, "content_index": 0, "part": part});
        sink.send("response.content_part.added", added).await
    }

    async fn close_message(&self, sink: &mut Sink<'_>, text: &str) -> Result<(), sse::ClientGone> {
        let index = sink.message_index();
        let at = json!({"item_id": self.message_id, "output_index": index, "content_index": 0});
        let mut done = at.clone();
        done["text"] = json!(text);
        sink.send("response.output_text.done", done).await?;
        let mut part = at;
        part["part"] = json!({"type": "output_text", "text": text, "annotations": []});
        sink.send("response.content_part.done", part).await?;
        sink.send(
            "response.output_item.done",
            json!({"output_index": index, "item": self.message_item(text, "completed")}),
        )
        .await
    }

    /// Ends the last call's item, if one is open.
    async fn close_call(&self, sink: &mut Sink<'_>, calls: &[ToolCall]) -> Result<(), sse::ClientGone> {
        let Some(call) = calls.last() else { return Ok(()) };
        let index = self.call_index(sink, calls.len() - 1);
        let item = function_call_item(&self.id, call);
        let done = json!({"item_id": item["id"], "output_index": index, "arguments": call.function.arguments});
        sink.send("response.function_call_arguments.done", done).await?;
        sink.send("response.output_item.done", json!({"output_index": index, "item": item})).await
    }

    async fn show(
        &self,
        sink: &mut Sink<'_>,
        ToolDelta { content, calls: pieces }: ToolDelta,
        text: &mut String,
        calls: &mut Vec<ToolCall>,
        message_open: &mut bool,
    ) -> Result<(), sse::ClientGone> {
        if !content.is_empty() && calls.is_empty() {
            if !*message_open {
                self.open_message(sink).await?;
                *message_open = true;
                sink.message_shown = true;
            }
            text.push_str(&content);
            let delta = json!({"item_id": self.message_id, "output_index": 0, "content_index": 0, "delta": content});
            sink.send("response.output_text.delta", delta).await?;
        }
        for piece in pieces {
            if let (Some(id), Some(name)) = (piece.id, piece.function.name) {
                if *message_open {
                    self.close_message(sink, text).await?;
                    *message_open = false;
                }
                self.close_call(sink, calls).await?;
                self.end_thinking(sink).await?;
                calls.push(ToolCall {
                    id,
                    kind: "function",
                    function: FunctionCall { name, arguments: String::new() },
                });
                let call = calls.last().map(|c| function_call_item(&self.id, c)).unwrap_or_default();
                let mut item = call;
                item["status"] = json!("in_progress");
                let index = self.call_index(sink, calls.len() - 1);
                sink.send("response.output_item.added", json!({"output_index": index, "item": item})).await?;
            }
            if let Some(call) = calls.last_mut().filter(|_| !piece.function.arguments.is_empty()) {
                call.function.arguments.push_str(&piece.function.arguments);
                let item_id = function_call_id(&self.id, &call.id);
                let index = self.call_index(sink, calls.len() - 1);
                let delta = json!({"item_id": item_id, "output_index": index, "delta": piece.function.arguments});
                sink.send("response.function_call_arguments.delta", delta).await?;
            }
        }
        Ok(())
    }
}

/// Numbered events of one stream.
struct Sink<'a> {
    events: &'a Events,
    sequence: u64,
    /// Whether a message item was shown (before any call).
    message_shown: bool,
    /// The thinking shown so far, once a reasoning item (index 0) opened.
    reasoning: Option<String>,
    reasoning_done: bool,
}

impl Sink<'_> {
    /// The message item's output index: after the reasoning item, if any.
    fn message_index(&self) -> usize {
        usize::from(self.reasoning.is_some())
    }

    async fn send(&mut self, kind: &str, mut event: Value) -> Result<(), sse::ClientGone> {
        event["type"] = json!(kind);
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.events.send_named(kind, &event).await
    }
}
