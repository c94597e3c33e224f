//! `POST /v1/messages`, Anthropic's Messages API (what Claude Code speaks),
//! and `POST /v1/messages/count_tokens`.
//!
//! A Messages body becomes the chat conversation it stands for (the system
//! prompt first; `tool_use` blocks as the assistant's tool calls,
//! `tool_result` blocks as tool messages; `tools` as functions, `tool_choice`
//! `auto`/`any`/`tool`/`none` as OpenAI's) and runs exactly as
//! `/v1/chat/completions` runs it: the same template, sampling, tool-call
//! parsing and forced calls. The reply is Anthropic's: `text` and
//! `tool_use` content blocks, `stop_reason`, and usage with the prefix
//! cache's hits as `cache_read_input_tokens`; streamed as its named events
//! (`message_start`, `content_block_start`/`_delta`/`_stop`,
//! `message_delta`, `message_stop`). Fields this server cannot honour
//! (`thinking`, `metadata`, `cache_control`, `context_management`, ...) are
//! ignored, as Anthropic-compatible servers do; image and document blocks
//! are refused with a 400. A `max_tokens` beyond the room left in the
//! context is cut to that room. Errors take Anthropic's shape
//! (`ApiError::anthropic_body`).

use std::sync::Arc;

use bytes::Bytes;
use common::FinishReason;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::chat::{self, Answer, Plan};
use super::error::ApiError;
use super::fields::Fields;
use super::reply::Reply;
use super::request::{ChatRequest, SamplingFields, StopInput};
use super::run::{self, ChoiceEnd, Update};
use super::sse::{self, Events};
use super::tool_calls::{ChoiceTools, ToolCall, ToolDelta};
use crate::app::AppState;
use crate::reasoning::{ReasoningSplitter, Split};

/// `POST /v1/messages`.
pub async fn messages(app: Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    let (plan, prompt_tokens) = app
        .offload(body.len(), move |app| {
            let req = chat_request(&parse_body(&body)?, true)?;
            let plan = chat::plan_request(app, req, true)?;
            let prompt_tokens = plan.specs.first().map_or(0, |s| s.prompt_ids.len());
            Ok::<_, ApiError>((plan, prompt_tokens))
        })
        .await?;
    let Plan { req, specs, tools, .. } = plan;
    let rx = run::launch(&app, "/v1/messages", specs)?;
    let id = format!("msg_{}", app.next_id());
    let tools = tools.map(|t| t.choice(&app));
    if req.sampling.stream() {
        let reasoning = app.reasoning_format.map(ReasoningSplitter::new);
        let stream = MessageStream { id, tools, reasoning, prompt_tokens };
        return Ok(sse::stream_named(&app.clone(), ApiError::anthropic_body, move |events| {
            stream.write(events, app, rx)
        }));
    }
    let choice = run::collect(rx, 1).await?.pop().ok_or_else(|| ApiError::internal("no choice came back"))?;
    let end = choice.end.ok_or_else(|| ApiError::internal("the choice did not end"))?;
    let Answer { reasoning, content: text, calls } = chat::answer(app.reasoning_format, &choice.text, tools);
    let mut content: Vec<Value> = Vec::new();
    if let Some(reasoning) = reasoning.filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
    }
    if let Some(text) = text.filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    let called = !calls.is_empty();
    content.extend(calls.iter().map(tool_use_block));
    let (stop_reason, stop_sequence) = stop_reason(&end, called);
    Ok(Reply::json(&Message {
        id: &id,
        kind: "message",
        role: "assistant",
        model: &app.served_model_name,
        content,
        stop_reason: Some(stop_reason),
        stop_sequence,
        usage: Usage::ended(&end),
    }))
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as `/v1/messages`
/// would template them (no `max_tokens` needed).
pub async fn count_tokens(app: Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    let tokens = app
        .offload(body.len(), move |app| {
            let mut req = chat_request(&parse_body(&body)?, false)?;
            req.sampling.max_tokens = Some(1);
            let plan = chat::plan_request(app, req, true)?;
            Ok::<_, ApiError>(plan.specs.first().map_or(0, |s| s.prompt_ids.len()))
        })
        .await?;
    Ok(Reply::json(&json!({ "input_tokens": tokens })))
}

fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the body is not JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok(value)
}

/// The chat request a Messages body stands for (`max_tokens` required
/// unless `counting`, which only templates it).
fn chat_request(body: &Value, needs_max_tokens: bool) -> Result<ChatRequest, ApiError> {
    let fields = Fields(body);
    let max_tokens = fields.int("max_tokens")?;
    if needs_max_tokens && max_tokens.is_none() {
        return Err(ApiError::invalid("max_tokens", "max_tokens: Field required"));
    }
    let mut messages = Vec::new();
    if let Some(system) = fields.get("system") {
        messages.push(json!({"role": "system", "content": text_of("system", system)?}));
    }
    let turns = fields
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("messages", "messages must be a list of messages"))?;
    for (i, turn) in turns.iter().enumerate() {
        messages.extend(chat_messages(i, turn)?);
    }
    let stop = match fields.get("stop_sequences") {
        None => None,
        Some(Value::Array(list)) => Some(StopInput::Many(
            list.iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ApiError::invalid("stop_sequences", "stop_sequences must be a list of strings"))?,
        )),
        Some(_) => return Err(ApiError::invalid("stop_sequences", "stop_sequences must be a list of strings")),
    };
    let stream = match fields.get("stream") {
        None => None,
        Some(v) => Some(v.as_bool().ok_or_else(|| ApiError::invalid("stream", "stream must be a boolean"))?),
    };
    let tools = match fields.get("tools") {
        None => None,
        Some(Value::Array(tools)) => {
            Some(tools.iter().enumerate().map(|(i, t)| function_tool(i, t)).collect::<Result<_, _>>()?)
        }
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list")),
    };
    let (tool_choice, parallel_tool_calls) = match fields.get("tool_choice") {
        None => (None, None),
        Some(choice) => tool_choice(choice)?,
    };
    let sampling = SamplingFields {
        max_tokens,
        temperature: fields.number("temperature")?,
        top_p: fields.number("top_p")?,
        top_k: fields.int("top_k")?,
        // Not Anthropic's: vLLM's extra, for reproducible sampling (the SDKs' extra_body).
        seed: fields.int("seed")?,
        stop,
        stream,
        ..SamplingFields::default()
    };
    // Extended thinking on or off, as the template switches it; adaptive
    // (Claude Code's) leaves the template's default.
    let chat_template_kwargs = match fields.get("thinking") {
        None => None,
        Some(thinking) => match thinking.get("type").and_then(Value::as_str) {
            Some("enabled") => Some(json!({"enable_thinking": true})),
            Some("disabled") => Some(json!({"enable_thinking": false})),
            Some("adaptive") => None,
            _ => {
                return Err(ApiError::invalid(
                    "thinking.type",
                    "thinking.type must be \"enabled\", \"disabled\" or \"adaptive\"",
                ));
            }
        },
    };
    Ok(ChatRequest {
        model: fields.string("model")?,
        messages,
        logprobs: None,
        top_logprobs: None,
        tools,
        tool_choice,
        parallel_tool_calls,
        chat_template_kwargs: chat_template_kwargs.and_then(|k| k.as_object().cloned()),
        reasoning_effort: None,
        unserved: Default::default(),
        sampling,
    })
}

/// A system prompt or a message's content: a string, or text blocks
/// (joined by newlines; `cache_control` and other block fields ignored).
fn text_of(param: &str, content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, block) in blocks.iter().enumerate() {
                match block_type(block) {
                    Some("text") => texts.push(block_text(&format!("{param}[{i}]"), block)?),
                    other => return Err(refused_block(&format!("{param}[{i}]"), other)),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::invalid(param, format!("{param} must be a string or a list of text blocks"))),
    }
}

fn block_type(block: &Value) -> Option<&str> {
    block.get("type").and_then(Value::as_str)
}

fn block_text(param: &str, block: &Value) -> Result<String, ApiError> {
    block
        .get("text")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| ApiError::invalid(format!("{param}.text"), "a text block needs a string `text`"))
}

fn refused_block(param: &str, kind: Option<&str>) -> ApiError {
    match kind {
        Some(kind @ ("image" | "document" | "search_result")) => ApiError::invalid(
            format!("{param}.type"),
            format!("{kind} content blocks are not supported: this server runs text-only models"),
        ),
        Some(kind) => ApiError::invalid(
            format!("{param}.type"),
            format!("content blocks of type {kind:?} are not supported here"),
        ),
        None => ApiError::invalid(format!("{param}.type"), "a content block needs a `type`"),
    }
}

/// One Messages turn as chat messages: a user turn's `tool_result` blocks
/// become tool messages (before its text, as they answer the last turn's
/// calls); an assistant turn's `tool_use` blocks, its tool calls; its
/// `thinking` blocks, its reasoning (redacted ones are dropped).
fn chat_messages(i: usize, turn: &Value) -> Result<Vec<Value>, ApiError> {
    let param = format!("messages[{i}]");
    let role = turn.get("role").and_then(Value::as_str).unwrap_or_default();
    if !matches!(role, "user" | "assistant" | "system") {
        return Err(ApiError::invalid(format!("{param}.role"), "role must be \"user\" or \"assistant\""));
    }
    let content =
        turn.get("content").ok_or_else(|| ApiError::invalid(format!("{param}.content"), "content is required"))?;
    let blocks = match content {
        Value::String(s) => return Ok(vec![json!({"role": role, "content": s})]),
        Value::Array(blocks) => blocks,
        _ => return Err(ApiError::invalid(format!("{param}.content"), "content must be a string or a list of blocks")),
    };
    let (mut texts, mut calls, mut results, mut thinking) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{param}.content[{j}]");
        match block_type(block) {
            Some("text") => texts.push(block_text(&at, block)?),
            // Thinking sent back goes to the template as the turn's reasoning.
            Some("thinking") if role == "assistant" => {
                thinking.extend(block.get("thinking").and_then(Value::as_str).map(str::to_string))
            }
            Some("thinking" | "redacted_thinking") => {}
            Some("tool_use") if role == "assistant" => {
                let id = block
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(format!("{at}.id"), "tool_use needs an id"))?;
                let name = block
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(format!("{at}.name"), "tool_use needs a name"))?;
                let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(
                    json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}),
                );
            }
            Some("tool_result") if role == "user" => {
                let id = block
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(format!("{at}.tool_use_id"), "tool_result needs a tool_use_id"))?;
                let text = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(content) => text_of(&format!("{at}.content"), content)?,
                };
                results.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
            }
            other => return Err(refused_block(&at, other)),
        }
    }
    let mut out = results;
    if !texts.is_empty() || !calls.is_empty() || out.is_empty() {
        let mut message = json!({"role": role, "content": texts.join("\n")});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        if !thinking.is_empty() {
            message["reasoning_content"] = json!(thinking.join("\n"));
        }
        out.push(message);
    }
    Ok(out)
}

/// An Anthropic tool (`name`, `description`, `input_schema`) as an OpenAI function.
fn function_tool(i: usize, tool: &Value) -> Result<Value, ApiError> {
    let name = tool
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(format!("tools[{i}].name"), "a tool needs a name"))?;
    let mut function = json!({"name": name, "parameters": tool.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}))});
    if let Some(description) = tool.get("description").filter(|d| !d.is_null()) {
        function["description"] = description.clone();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// Anthropic's `tool_choice` as OpenAI's, and `disable_parallel_tool_use`.
fn tool_choice(choice: &Value) -> Result<(Option<Value>, Option<bool>), ApiError> {
    let parallel = choice.get("disable_parallel_tool_use").and_then(Value::as_bool).map(|off| !off);
    let openai = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = choice
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("tool_choice.name", "tool_choice of type \"tool\" needs a name"))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => return Err(ApiError::invalid("tool_choice.type", "tool_choice.type must be auto, any, tool or none")),
    };
    Ok((Some(openai), parallel))
}

/// A parsed call as a `tool_use` block; arguments that are not JSON
/// (a model off its format) travel as a string under `input`.
fn tool_use_block(call: &ToolCall) -> Value {
    let input: Value =
        serde_json::from_str(&call.function.arguments).unwrap_or(Value::String(call.function.arguments.clone()));
    json!({"type": "tool_use", "id": tool_use_id(&call.id), "name": call.function.name, "input": input})
}

/// Anthropic's ids of tool uses start `toolu_`.
fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// `stop_reason` and `stop_sequence` of an ended choice.
fn stop_reason(end: &ChoiceEnd, called: bool) -> (&'static str, Option<String>) {
    match (called, end.finish_reason, &end.stop) {
        (true, _, _) => ("tool_use", None),
        (false, FinishReason::Length, _) => ("max_tokens", None),
        (false, _, Some(stop)) => ("stop_sequence", Some(stop.clone())),
        (false, _, None) => ("end_turn", None),
    }
}

#[derive(Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<Value>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<String>,
    usage: Usage,
}

/// Anthropic's usage: `input_tokens` excludes what the prefix cache served.
#[derive(Serialize)]
struct Usage {
    input_tokens: u32,
    output_tokens: u32,
    cache_creation_input_tokens: u32,
    cache_read_input_tokens: u32,
}

impl Usage {
    fn ended(end: &ChoiceEnd) -> Self {
        Self {
            input_tokens: end.prompt_tokens.saturating_sub(end.cached_tokens),
            output_tokens: end.completion_tokens,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: end.cached_tokens,
        }
    }
}

/// The content block a stream has open.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    None,
    Thinking,
    Text,
    Tool,
}

/// One streamed reply.
struct MessageStream {
    id: String,
    tools: Option<ChoiceTools>,
    /// The thinking split from the answer (`--reasoning-parser`).
    reasoning: Option<ReasoningSplitter>,
    prompt_tokens: usize,
}

/// Writes one stream's events, tracking its content blocks.
struct Blocks<'a> {
    events: &'a Events,
    open: Open,
    /// The index of the next block.
    next: usize,
}

impl Blocks<'_> {
    async fn close(&mut self) -> Result<(), sse::ClientGone> {
        if self.open != Open::None {
            let index = self.next - 1;
            self.events
                .send_named("content_block_stop", &json!({"type": "content_block_stop", "index": index}))
                .await?;
            self.open = Open::None;
        }
        Ok(())
    }

    async fn start(&mut self, open: Open, block: Value) -> Result<(), sse::ClientGone> {
        self.close().await?;
        let event = json!({"type": "content_block_start", "index": self.next, "content_block": block});
        self.events.send_named("content_block_start", &event).await?;
        self.next += 1;
        self.open = open;
        Ok(())
    }

    async fn delta(&mut self, delta: Value) -> Result<(), sse::ClientGone> {
        let event = json!({"type": "content_block_delta", "index": self.next - 1, "delta": delta});
        self.events.send_named("content_block_delta", &event).await
    }

    /// A piece of thinking, in a `thinking` block.
    async fn think(&mut self, thinking: String) -> Result<(), sse::ClientGone> {
        if thinking.is_empty() {
            return Ok(());
        }
        if self.open != Open::Thinking {
            self.start(Open::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""})).await?;
        }
        self.delta(json!({"type": "thinking_delta", "thinking": thinking})).await
    }

    /// Text and call pieces, in order: text first (it came before the calls' markup).
    async fn show(&mut self, ToolDelta { content, calls }: ToolDelta) -> Result<(), sse::ClientGone> {
        if !content.is_empty() {
            if self.open != Open::Text {
                self.start(Open::Text, json!({"type": "text", "text": ""})).await?;
            }
            self.delta(json!({"type": "text_delta", "text": content})).await?;
        }
        for call in calls {
            if let (Some(id), Some(name)) = (&call.id, &call.function.name) {
                let block = json!({"type": "tool_use", "id": tool_use_id(id), "name": name, "input": {}});
                self.start(Open::Tool, block).await?;
            }
            if !call.function.arguments.is_empty() && self.open == Open::Tool {
                self.delta(json!({"type": "input_json_delta", "partial_json": call.function.arguments})).await?;
            }
        }
        Ok(())
    }
}

impl MessageStream {
    async fn write(self, events: Events, app: Arc<AppState>, rx: mpsc::UnboundedReceiver<Update>) {
        let _ = self.run(&events, &app, rx).await;
    }

    async fn run(
        mut self,
        events: &Events,
        app: &AppState,
        mut rx: mpsc::UnboundedReceiver<Update>,
    ) -> Result<(), sse::ClientGone> {
        let start = json!({
            "type": "message_start",
            "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": app.served_model_name,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
            },
        });
        events.send_named("message_start", &start).await?;
        events.send_named("ping", &json!({"type": "ping"})).await?;
        let mut blocks = Blocks { events, open: Open::None, next: 0 };
        while let Some(update) = rx.recv().await {
            match update {
                Update::PromptLogprobs { .. } => {}
                Update::Delta { text, .. } => {
                    let text = match &mut self.reasoning {
                        Some(splitter) => {
                            let Split { reasoning, content } = splitter.push(&text);
                            blocks.think(reasoning).await?;
                            content
                        }
                        None => text,
                    };
                    let delta = match &mut self.tools {
                        Some(tools) => tools.push(&text),
                        None => ToolDelta { content: text, calls: Vec::new() },
                    };
                    blocks.show(delta).await?;
                }
                Update::End(end) => {
                    let held = match &mut self.reasoning {
                        Some(splitter) => {
                            let Split { reasoning, content } = splitter.finish();
                            blocks.think(reasoning).await?;
                            content
                        }
                        None => String::new(),
                    };
                    let called = match &mut self.tools {
                        Some(tools) => {
                            blocks.show(tools.finish_after(&held)).await?;
                            tools.called()
                        }
                        None => {
                            blocks.show(ToolDelta { content: held, calls: Vec::new() }).await?;
                            false
                        }
                    };
                    blocks.close().await?;
                    let (stop_reason, stop_sequence) = stop_reason(&end, called);
                    let delta = json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": Usage::ended(&end),
                    });
                    events.send_named("message_delta", &delta).await?;
                    return events.send_named("message_stop", &json!({"type": "message_stop"})).await;
                }
                Update::Failed { message, .. } => {
                    return events.send_named("error", &ApiError::internal(message).anthropic_body()).await;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> ChatRequest {
        chat_request(&body, true).unwrap()
    }

    /// What Claude Code sends: a system array with cache_control, a
    /// system message among the turns, thinking and metadata; unknown
    /// fields are ignored.
    #[test]
    fn claude_code_s_request_reads_as_a_chat() {
        let req = chat(json!({
            "model": "m", "max_tokens": 32000, "stream": true,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "system", "content": "reminder"},
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            ],
            "thinking": {"type": "adaptive"}, "metadata": {"user_id": "u"}, "context_management": {},
            "output_config": {}, "temperature": 1,
        }));
        assert_eq!(
            req.messages,
            vec![
                json!({"role": "system", "content": "You are Claude Code.\nBe brief."}),
                json!({"role": "system", "content": "reminder"}),
                json!({"role": "user", "content": "hi"}),
            ]
        );
        assert_eq!(
            (req.sampling.max_tokens, req.sampling.stream, req.sampling.temperature),
            (Some(32000), Some(true), Some(1.0))
        );
        // Adaptive thinking leaves the template's default; enabled and disabled switch it.
        assert!(req.chat_template_kwargs.is_none());
        for (thinking, enabled) in [("enabled", true), ("disabled", false)] {
            let req =
                chat(json!({"max_tokens": 5, "messages": [], "thinking": {"type": thinking, "budget_tokens": 1024}}));
            assert_eq!(req.chat_template_kwargs.unwrap()["enable_thinking"], enabled);
        }
    }

    /// tool_use blocks are the assistant's calls; tool_result blocks the
    /// tool messages, ahead of the user's text.
    #[test]
    fn tool_turns_become_calls_and_tool_messages() {
        let req = chat(json!({
            "max_tokens": 10,
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "..."},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "thanks"}]},
            ],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
        }));
        assert_eq!(req.messages[1]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(req.messages[1]["content"], "Let me check.");
        assert_eq!(req.messages[1]["reasoning_content"], "...");
        assert_eq!(req.messages[2], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}));
        assert_eq!(req.messages[3], json!({"role": "user", "content": "thanks"}));
        let tools = req.tools.unwrap();
        assert_eq!(tools[0]["function"]["parameters"], json!({"type": "object"}));
        assert_eq!(req.tool_choice, Some(json!({"type": "function", "function": {"name": "get_weather"}})));
        assert_eq!(req.parallel_tool_calls, Some(false));
        assert_eq!(tool_choice(&json!({"type": "any"})).unwrap().0, Some(json!("required")));
    }

    /// Bad input is a 400 naming the field; images are refused.
    #[test]
    fn bad_bodies_name_the_field() {
        let err = |body: Value| chat_request(&body, true).unwrap_err().param.unwrap();
        assert_eq!(err(json!({"messages": []})), "max_tokens");
        assert_eq!(err(json!({"max_tokens": 5})), "messages");
        let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}});
        assert_eq!(
            err(json!({"max_tokens": 5, "messages": [{"role": "user", "content": [image]}]})),
            "messages[0].content[0].type"
        );
        assert_eq!(err(json!({"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]})), "messages[0].role");
        assert_eq!(err(json!({"max_tokens": 5, "messages": [], "tool_choice": {"type": "maybe"}})), "tool_choice.type");
        assert_eq!(err(json!({"max_tokens": "5", "messages": []})), "max_tokens");
        assert_eq!(err(json!({"max_tokens": 5, "messages": [], "thinking": {"type": "deep"}})), "thinking.type");
        assert!(chat_request(&json!({"messages": []}), false).is_ok(), "count_tokens needs no max_tokens");
    }
}
