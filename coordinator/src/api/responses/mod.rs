//! `POST /v1/responses`, OpenAI's Responses API (what Codex CLI and the
//! Agents SDK speak), with `GET` and `DELETE /v1/responses/{id}`.
//!
//! The request becomes the chat conversation it stands for: `instructions`
//! as the system prompt, then (with `previous_response_id`) the stored
//! conversation that response ended, then `input` (a string, or message,
//! `function_call` and `function_call_output` items); function `tools`,
//! `tool_choice`, `parallel_tool_calls`, `max_output_tokens` and
//! `text.format` (a JSON schema, through structured outputs) as chat
//! completions take them. It runs as `/v1/chat/completions` runs it; the
//! output is a `message` item with `output_text` and `function_call` items,
//! streamed as the semantic events (`response.created`,
//! `response.output_item.added`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`, ..., `response.completed`).
//! With `store` (the default) each response and its conversation are kept
//! in memory ([`ResponseStore`]: the newest [`STORED_RESPONSES`], each for
//! [`STORED_FOR`]), so that follow-ups can name it; a response gone from
//! there is a 400 naming it. Tools other than functions (hosted ones
//! such as `web_search`, `namespace` groups) are left out of the prompt.
//! Reasoning items sent back are dropped;
//! `reasoning`, `metadata`, `truncation` and `user` are accepted and
//! ignored; image and file inputs are refused.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::FinishReason;
use serde_json::{Value, json};

use super::chat::{self, Answer, Plan};
use super::error::ApiError;
use super::fields::Fields;
use super::prepare::now;
use super::reply::Reply;
use super::request::{ChatRequest, SamplingFields};
use super::run::{self, ChoiceEnd};
use super::sse;
use super::tool_calls::ToolCall;
use crate::app::AppState;
use crate::reasoning::ReasoningSplitter;

mod stream;

/// Responses kept for `previous_response_id` and `GET`.
pub const STORED_RESPONSES: usize = 1024;
/// How long one is kept.
pub const STORED_FOR: Duration = Duration::from_secs(3600);

/// Stored responses: each one's JSON and the conversation it ended (chat
/// messages, its own output included), the newest [`STORED_RESPONSES`]
/// for [`STORED_FOR`] each.
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<Stored>,
}

#[derive(Default)]
struct Stored {
    by_id: HashMap<String, (Instant, Value, Vec<Value>)>,
    order: VecDeque<String>,
}

impl ResponseStore {
    fn put(&self, id: &str, response: Value, conversation: Vec<Value>) {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        s.by_id.insert(id.to_string(), (Instant::now(), response, conversation));
        s.order.push_back(id.to_string());
        while s.order.len() > STORED_RESPONSES {
            if let Some(old) = s.order.pop_front() {
                s.by_id.remove(&old);
            }
        }
    }

    fn get(&self, id: &str) -> Option<(Value, Vec<Value>)> {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match s.by_id.get(id) {
            Some((at, response, conversation)) if at.elapsed() < STORED_FOR => {
                Some((response.clone(), conversation.clone()))
            }
            Some(_) => {
                s.by_id.remove(id);
                None
            }
            None => None,
        }
    }

    fn delete(&self, id: &str) -> bool {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        s.order.retain(|o| o != id);
        s.by_id.remove(id).is_some()
    }
}

/// `GET /v1/responses/{id}`.
pub fn get(app: &AppState, id: &str) -> Result<Reply, ApiError> {
    app.responses.get(id).map(|(response, _)| Reply::json(&response)).ok_or_else(|| not_found(id))
}

/// `DELETE /v1/responses/{id}`.
pub fn delete(app: &AppState, id: &str) -> Result<Reply, ApiError> {
    match app.responses.delete(id) {
        true => Ok(Reply::json(&json!({"id": id, "object": "response", "deleted": true}))),
        false => Err(not_found(id)),
    }
}

fn not_found(id: &str) -> ApiError {
    let mut e = ApiError::invalid("response_id", format!("Response with id '{id}' not found."));
    e.status = hyper::StatusCode::NOT_FOUND;
    e
}

/// A request read: how to run it and what to echo back.
struct Prepared {
    plan: Plan,
    conversation: Vec<Value>,
    echo: Value,
    store: bool,
}

/// `POST /v1/responses`.
pub async fn create(app: Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    let prepared = app.offload(body.len(), move |app| prepare(app, &body)).await?;
    let Prepared { plan, conversation, echo, store } = prepared;
    let Plan { req, specs, tools, .. } = plan;
    let rx = run::launch(&app, "/v1/responses", specs)?;
    let base = app.next_id();
    let tools = tools.map(|t| t.choice(&app));
    let out = Output {
        id: format!("resp_{base}"),
        message_id: format!("msg_{base}"),
        reasoning_id: format!("rs_{base}"),
        echo,
        conversation,
        store,
    };
    if req.sampling.stream() {
        let reasoning = app.reasoning_format.map(ReasoningSplitter::new);
        let cut = |e: &ApiError| json!({"type": "error", "code": "server_error", "message": e.message, "param": null});
        return Ok(sse::stream_named(&app.clone(), cut, move |events| out.stream(events, app, rx, tools, reasoning)));
    }
    let choice = run::collect(rx, 1).await?.pop().ok_or_else(|| ApiError::internal("no choice came back"))?;
    let end = choice.end.ok_or_else(|| ApiError::internal("the choice did not end"))?;
    let Answer { reasoning, content, calls } = chat::answer(app.reasoning_format, &choice.text, tools);
    let reasoning = reasoning.unwrap_or_default();
    Ok(Reply::json(&out.finish(&app, &reasoning, content.unwrap_or_default(), &calls, &end)))
}

fn prepare(app: &AppState, body: &[u8]) -> Result<Prepared, ApiError> {
    let body: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the body is not JSON: {e}")))?;
    let fields = Fields(&body);
    let mut conversation = Vec::new();
    if let Some(instructions) = fields.get("instructions") {
        let text =
            instructions.as_str().ok_or_else(|| ApiError::invalid("instructions", "instructions must be a string"))?;
        conversation.push(json!({"role": "system", "content": text}));
    }
    let previous = match fields.get("previous_response_id") {
        None => None,
        Some(id) => {
            let id = id.as_str().ok_or_else(|| ApiError::invalid("previous_response_id", "must be a string"))?;
            let (_, earlier) = app.responses.get(id).ok_or_else(|| {
                ApiError::invalid(
                    "previous_response_id",
                    format!(
                        "Previous response with id '{id}' not found (responses are kept {} s).",
                        STORED_FOR.as_secs()
                    ),
                )
            })?;
            // The earlier instructions do not carry over (OpenAI's rule).
            conversation.extend(earlier.into_iter().filter(|m| m["role"] != "system"));
            Some(id.to_string())
        }
    };
    match fields.get("input") {
        None => return Err(ApiError::invalid("input", "input is required")),
        Some(Value::String(text)) => conversation.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut conversation)?;
            }
        }
        Some(_) => return Err(ApiError::invalid("input", "input must be a string or a list of items")),
    }
    let tools = match fields.get("tools") {
        None => None,
        Some(Value::Array(tools)) => Some(
            tools
                .iter()
                .enumerate()
                .filter(|(_, t)| t.get("type").and_then(Value::as_str) == Some("function"))
                .map(|(i, t)| function_tool(i, t))
                .collect::<Result<Vec<_>, _>>()?,
        )
        .filter(|t: &Vec<Value>| !t.is_empty()),
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list")),
    };
    let tool_choice = match fields.get("tool_choice") {
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("tool_choice.name", "a name is required"))?;
            Some(json!({"type": "function", "function": {"name": name}}))
        }
        other => other.cloned(),
    };
    let mut sampling = SamplingFields {
        max_tokens: fields.int("max_output_tokens")?,
        temperature: fields.number("temperature")?,
        top_p: fields.number("top_p")?,
        stream: fields.boolean("stream")?,
        ..SamplingFields::default()
    };
    if let Some(format) = body.pointer("/text/format").filter(|f| f["type"] == "json_schema") {
        let schema = json!({"name": format["name"], "schema": format["schema"], "strict": format["strict"]});
        sampling.structured.response_format = Some(json!({"type": "json_schema", "json_schema": schema}));
    }
    let req = ChatRequest {
        model: fields.get("model").and_then(Value::as_str).map(str::to_string),
        messages: conversation.clone(),
        logprobs: None,
        top_logprobs: None,
        tools,
        tool_choice,
        parallel_tool_calls: fields.boolean("parallel_tool_calls")?,
        chat_template_kwargs: None,
        reasoning_effort: body.pointer("/reasoning/effort").filter(|e| !e.is_null()).cloned(),
        unserved: Default::default(),
        sampling,
    };
    let plan = chat::plan_request(app, req, true)?;
    let echo = json!({
        "instructions": fields.get("instructions"),
        "max_output_tokens": fields.get("max_output_tokens"),
        "parallel_tool_calls": fields.boolean("parallel_tool_calls")?.unwrap_or(true),
        "previous_response_id": previous,
        "temperature": fields.number("temperature")?.unwrap_or(1.0),
        "top_p": fields.number("top_p")?.unwrap_or(1.0),
        "tool_choice": fields.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "tools": fields.get("tools").cloned().unwrap_or(json!([])),
        "text": fields.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
        "metadata": fields.get("metadata").cloned().unwrap_or(json!({})),
    });
    Ok(Prepared { plan, conversation, echo, store: fields.boolean("store")?.unwrap_or(true) })
}

/// One input item as chat messages.
fn input_item(i: usize, item: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let param = format!("input[{i}]");
    match item.get("type").and_then(Value::as_str).unwrap_or("message") {
        "message" => {
            let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
            let role = match role {
                "user" | "assistant" | "system" => role,
                "developer" => "system",
                _ => {
                    return Err(ApiError::invalid(
                        format!("{param}.role"),
                        "role must be user, assistant, system or developer",
                    ));
                }
            };
            let content = match item.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut texts = Vec::new();
                    for (j, part) in parts.iter().enumerate() {
                        match part.get("type").and_then(Value::as_str) {
                            Some("input_text" | "output_text" | "text") => {
                                texts.push(part.get("text").and_then(Value::as_str).unwrap_or_default().to_string())
                            }
                            Some(kind) => {
                                return Err(ApiError::invalid(
                                    format!("{param}.content[{j}].type"),
                                    format!("{kind} content is not supported: this server runs text-only models"),
                                ));
                            }
                            None => {
                                return Err(ApiError::invalid(
                                    format!("{param}.content[{j}].type"),
                                    "a type is required",
                                ));
                            }
                        }
                    }
                    texts.join("\n")
                }
                _ => {
                    return Err(ApiError::invalid(
                        format!("{param}.content"),
                        "content must be a string or a list of parts",
                    ));
                }
            };
            match out.last_mut() {
                Some(last) if role == "assistant" && reasoning_only(last) => last["content"] = json!(content),
                _ => out.push(json!({"role": role, "content": content})),
            }
        }
        "function_call" => {
            let get = |name: &str| {
                item.get(name)
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid(format!("{param}.{name}"), format!("{name} is required")))
            };
            let call = json!({"id": get("call_id")?, "type": "function", "function": {"name": get("name")?, "arguments": get("arguments")?}});
            // Calls of one turn go into one assistant message.
            match out.last_mut() {
                Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                    if let Some(calls) = last["tool_calls"].as_array_mut() {
                        calls.push(call);
                    }
                }
                Some(last) if reasoning_only(last) => last["tool_calls"] = json!([call]),
                _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let id = item
                .get("call_id")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(format!("{param}.call_id"), "call_id is required"))?;
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
        }
        // Reasoning sent back: the next assistant turn's, for the template.
        "reasoning" => {
            let parts = item.get("content").or_else(|| item.get("summary")).and_then(Value::as_array);
            let text: Vec<&str> =
                parts.into_iter().flatten().filter_map(|p| p.get("text").and_then(Value::as_str)).collect();
            if !text.is_empty() {
                out.push(json!({"role": "assistant", "content": "", "reasoning_content": text.join("\n")}));
            }
        }
        other => {
            return Err(ApiError::invalid(
                format!("{param}.type"),
                format!("input items of type {other:?} are not supported"),
            ));
        }
    }
    Ok(())
}

/// An assistant turn that so far holds only the reasoning sent back before it.
fn reasoning_only(message: &Value) -> bool {
    message["role"] == "assistant"
        && message["content"] == ""
        && message.get("tool_calls").is_none()
        && message.get("reasoning_content").is_some()
}

/// A Responses function tool (flat: `name`, `parameters`) as chat's.
/// Tools of other types (hosted ones such as `web_search`, `namespace`
/// groups) are left out: this server cannot run them (Codex CLI sends
/// both).
fn function_tool(i: usize, tool: &Value) -> Result<Value, ApiError> {
    let name = tool
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(format!("tools[{i}].name"), "a name is required"))?;
    let mut function =
        json!({"name": name, "parameters": tool.get("parameters").cloned().unwrap_or(json!({"type": "object"}))});
    if let Some(d) = tool.get("description").filter(|d| !d.is_null()) {
        function["description"] = d.clone();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// One response being made.
struct Output {
    id: String,
    message_id: String,
    reasoning_id: String,
    echo: Value,
    conversation: Vec<Value>,
    store: bool,
}

impl Output {
    fn response(&self, status: &str, output: Vec<Value>, usage: Value, incomplete: Value) -> Value {
        let mut r = json!({
            "id": self.id, "object": "response", "created_at": now(), "status": status, "error": null,
            "incomplete_details": incomplete, "output": output, "usage": usage, "store": self.store,
        });
        if let (Some(r), Some(echo)) = (r.as_object_mut(), self.echo.as_object()) {
            r.extend(echo.clone());
        }
        r
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        json!({"type": "message", "id": self.message_id, "status": status, "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }

    fn reasoning_item(&self, text: &str, status: &str) -> Value {
        json!({"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
               "content": [{"type": "reasoning_text", "text": text}]})
    }

    /// The whole response, stored when asked.
    fn finish(self, app: &AppState, reasoning: &str, text: String, calls: &[ToolCall], end: &ChoiceEnd) -> Value {
        let mut output = Vec::new();
        if !reasoning.is_empty() {
            output.push(self.reasoning_item(reasoning, "completed"));
        }
        if !text.is_empty() || calls.is_empty() {
            output.push(self.message_item(&text, "completed"));
        }
        output.extend(calls.iter().map(|c| function_call_item(&self.id, c)));
        let (status, incomplete) = match end.finish_reason {
            FinishReason::Length if calls.is_empty() => ("incomplete", json!({"reason": "max_output_tokens"})),
            _ => ("completed", Value::Null),
        };
        let response = self.response(status, output, usage(end), incomplete);
        if self.store {
            let mut conversation = self.conversation;
            let mut message = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                message["tool_calls"] = serde_json::to_value(calls).unwrap_or_default();
            }
            conversation.push(message);
            app.responses.put(&self.id, response.clone(), conversation);
        }
        response
    }
}

fn function_call_id(response_id: &str, call_id: &str) -> String {
    format!("fc_{}_{}", response_id.trim_start_matches("resp_"), call_id.trim_start_matches("call_"))
}

fn function_call_item(response_id: &str, call: &ToolCall) -> Value {
    json!({"type": "function_call", "id": function_call_id(response_id, &call.id), "call_id": call.id,
           "name": call.function.name, "arguments": call.function.arguments, "status": "completed"})
}

fn usage(end: &ChoiceEnd) -> Value {
    json!({
        "input_tokens": end.prompt_tokens,
        "input_tokens_details": {"cached_tokens": end.cached_tokens},
        "output_tokens": end.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": end.prompt_tokens + end.completion_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation(items: Value) -> Vec<Value> {
        let mut out = Vec::new();
        for (i, item) in items.as_array().unwrap().iter().enumerate() {
            input_item(i, item, &mut out).unwrap();
        }
        out
    }

    /// Messages (developer as system, text parts joined), one turn's calls
    /// in one assistant message, their outputs as tool messages; reasoning
    /// items sent back, the next assistant turn's reasoning.
    #[test]
    fn input_items_read_as_chat_messages() {
        let got = conversation(json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call f."}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]));
        assert_eq!(got[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(got[1], json!({"role": "user", "content": "a\nb"}));
        assert_eq!(got[2]["tool_calls"].as_array().map(Vec::len), Some(2));
        assert_eq!(got[2]["reasoning_content"], "Call f.");
        assert_eq!(got[3], json!({"role": "tool", "tool_call_id": "c1", "content": "ok"}));
        let got = conversation(json!([
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Greet."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
        ]));
        assert_eq!(got, [json!({"role": "assistant", "content": "Hi", "reasoning_content": "Greet."})]);
        let mut out = Vec::new();
        let image = json!({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]});
        assert_eq!(input_item(4, &image, &mut out).unwrap_err().param.as_deref(), Some("input[4].content[0].type"));
    }

    /// The newest responses are kept, the oldest dropped; deleted ones go.
    #[test]
    fn the_store_keeps_the_newest() {
        let store = ResponseStore::default();
        for i in 0..STORED_RESPONSES + 2 {
            store.put(&format!("resp_{i}"), json!({"i": i}), Vec::new());
        }
        assert!(store.get("resp_0").is_none() && store.get("resp_1").is_none());
        assert_eq!(store.get("resp_2").map(|(r, _)| r["i"].clone()), Some(json!(2)));
        assert!(store.delete("resp_2") && store.get("resp_2").is_none() && !store.delete("resp_2"));
    }
}
