//! OpenAI's completion objects, shared by `/v1/completions` and
//! `/v1/chat/completions`: the response and its stream chunks, their
//! choices and usage; and the chunk stream itself, which reads chat
//! choices for tool calls when the request offers tools. Each choice
//! carries two tinyvllm extensions once it ends: the worker it ran on and
//! its prefix-cache hit (`cached_tokens`).

use std::sync::Arc;

use common::FinishReason;
use common::protocol::TokenLogprobs;
use serde::Serialize;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::logprobs::{ChatLogprobs, CompletionLogprobs, Echo, TextOffsets};
use super::prepare::now;
use super::reply::Reply;
use super::run::{ChoiceEnd, Update};
use super::sse::{self, Events};
use super::tool_calls::{self, ChoiceTools, ToolCall, ToolCallDelta, ToolDelta};
use crate::app::AppState;
use crate::reasoning::{ReasoningSplitter, Split};

/// A whole response, or one chunk of a stream.
#[derive(Serialize)]
pub struct Completion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<Choice>,
    /// Always in a whole response; in a stream, only in the last chunk,
    /// when `stream_options.include_usage` asks for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Serialize)]
pub struct Choice {
    pub index: usize,
    #[serde(flatten)]
    pub content: Content,
    pub logprobs: Option<Logprobs>,
    /// `stop`, `length`, `abort`, or `tool_calls` (see `tool_calls::finish_reason`).
    pub finish_reason: Option<&'static str>,
    /// Left out of the stream chunks before the choice's end.
    #[serde(flatten)]
    pub end: Option<EndDetails>,
}

/// A choice's text: `text` (completions), `message` (chat) or `delta`
/// (chat chunks).
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Content {
    Text(String),
    Message(Message),
    Delta(Delta),
}

#[derive(Serialize)]
pub struct Message {
    pub role: &'static str,
    /// `null` when the reply is only tool calls.
    pub content: Option<String>,
    /// The thinking, apart (with `--reasoning-parser`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A chat chunk's delta: the role only in a choice's first chunk; empty in
/// its last.
#[derive(Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

impl Delta {
    /// A piece of a choice's thinking (`reasoning_content`).
    fn thinking(first: bool, reasoning: String) -> Content {
        Content::Delta(Self {
            role: first.then_some("assistant"),
            reasoning_content: Some(reasoning),
            ..Self::default()
        })
    }

    /// A chat choice's next deltas: one, or one per call piece (a call's
    /// start and its arguments go in chunks of their own, as OpenAI sends
    /// them). The role goes in the choice's first; the content in the
    /// first here, unless there are only call pieces.
    fn chat(first: bool, content: String, calls: Vec<ToolCallDelta>) -> Vec<Content> {
        let only_calls = content.is_empty() && !calls.is_empty();
        let mut content = (!only_calls).then_some(content);
        let mut role = first.then_some("assistant");
        if calls.is_empty() {
            return vec![Content::Delta(Self { role, content, ..Self::default() })];
        }
        calls
            .into_iter()
            .map(|call| {
                let (role, content) = (role.take(), content.take());
                Content::Delta(Self { role, content, tool_calls: Some(vec![call]), ..Self::default() })
            })
            .collect()
    }
}

#[derive(Serialize)]
#[serde(untagged)]
pub enum Logprobs {
    Completion(CompletionLogprobs),
    Chat(ChatLogprobs),
}

#[derive(Serialize)]
pub struct EndDetails {
    /// The stop string that ended the choice, if one did.
    pub stop_reason: Option<String>,
    pub worker: Option<String>,
    pub cached_tokens: Option<u32>,
}

impl Choice {
    /// A choice still streaming.
    pub fn running(index: usize, content: Content, logprobs: Option<Logprobs>) -> Self {
        Self { index, content, logprobs, finish_reason: None, end: None }
    }

    /// A choice that ended (`end`, unless it was lost on the way).
    pub fn ended(index: usize, content: Content, logprobs: Option<Logprobs>, end: Option<&ChoiceEnd>) -> Self {
        Self {
            index,
            content,
            logprobs,
            finish_reason: end.map(|e| e.finish_reason.as_str()),
            end: Some(EndDetails {
                stop_reason: end.and_then(|e| e.stop.clone()),
                worker: end.map(|e| e.worker.clone()),
                cached_tokens: end.map(|e| e.cached_tokens),
            }),
        }
    }
}

#[derive(Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl Usage {
    /// The usage of choices of one prompt: its tokens once, every choice's
    /// completion.
    pub fn of(ends: &[&ChoiceEnd]) -> Self {
        let prompt = ends.first().map_or(0, |e| e.prompt_tokens);
        let completion: u32 = ends.iter().map(|e| e.completion_tokens).sum();
        let cached = ends.first().map_or(0, |e| e.cached_tokens);
        Self {
            prompt_tokens: prompt.into(),
            completion_tokens: completion.into(),
            total_tokens: u64::from(prompt) + u64::from(completion),
            prompt_tokens_details: PromptTokensDetails { cached_tokens: cached },
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
pub enum Kind {
    Completion,
    Chat,
}

/// What a completions stream echoes: each choice's prompt, first (with
/// its logprobs if `logprobs`); with `only`, nothing after it (`max_tokens: 0`).
#[derive(Default)]
pub struct EchoStream {
    pub per_choice: Vec<Echo>,
    pub only: bool,
    pub logprobs: bool,
    /// Each choice's `text_offset`s, when completions logprobs are asked.
    pub offsets: Vec<TextOffsets>,
}

/// One response's chunk stream: `n` choices under `id`.
pub struct ChunkStream {
    pub id: String,
    pub n: usize,
    pub include_usage: bool,
    pub kind: Kind,
    pub echo: EchoStream,
    /// Chat: each choice read for tool calls; empty when tools are not parsed.
    pub tools: Vec<ChoiceTools>,
    /// Chat: each choice's thinking split from its answer; empty when no
    /// reasoning parser is set.
    pub reasoning: Vec<ReasoningSplitter>,
}

impl ChunkStream {
    pub fn reply(self, app: Arc<AppState>, rx: mpsc::UnboundedReceiver<Update>) -> Reply {
        sse::stream(&app.clone(), |events| self.write(events, app, rx))
    }

    /// OpenAI SSE chunks, then the usage chunk if asked for. An echoed
    /// prompt is each choice's first chunk, sent once its prompt logprobs
    /// (which come before any token) are in.
    async fn write(self, events: Events, app: Arc<AppState>, mut rx: mpsc::UnboundedReceiver<Update>) {
        let Self { id, n, include_usage, kind, mut echo, mut tools, mut reasoning } = self;
        let created = now();
        let object = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk =
            |choices, usage| Completion { id: &id, object, created, model: &app.served_model_name, choices, usage };
        let mut started = vec![false; n];
        let mut prompt_logprobs: Vec<Vec<TokenLogprobs>> = vec![Vec::new(); n];
        let mut ends: Vec<ChoiceEnd> = Vec::new();
        while ends.len() < n {
            let Some(mut update) = rx.recv().await else { break };
            let index = match &update {
                Update::PromptLogprobs { index, logprobs } => {
                    prompt_logprobs[*index].extend_from_slice(logprobs);
                    continue;
                }
                Update::Delta { index, .. } => Some(*index),
                Update::End(end) => Some(end.index),
                Update::Failed { .. } => None,
            };
            if let Some((index, e)) = index.filter(|&i| !started[i]).and_then(|i| Some((i, echo.per_choice.get(i)?))) {
                let lp = echo.logprobs.then(|| {
                    let prompt = Some((e, prompt_logprobs[index].as_slice()));
                    Logprobs::Completion(CompletionLogprobs::new(&app.tokenizer, prompt, &[], &[], &[]))
                });
                let choice = Choice::running(index, Content::Text(e.text.clone()), lp);
                if events.send(&chunk(vec![choice], None)).await.is_err() {
                    return;
                }
                started[index] = true;
            }
            if echo.only {
                match &mut update {
                    Update::Delta { .. } => continue,
                    Update::End(end) => {
                        (end.completion_tokens, end.finish_reason, end.stop) = (0, FinishReason::Length, None)
                    }
                    _ => {}
                }
            }
            let choice = match update {
                Update::PromptLogprobs { .. } => continue,
                Update::Delta { index, text, token_ids, logprobs } => {
                    let text = match reasoning.get_mut(index) {
                        Some(splitter) => {
                            let Split { reasoning, content } = splitter.push(&text);
                            if !reasoning.is_empty() {
                                let delta = Delta::thinking(!started[index], reasoning);
                                let choice = Choice::running(index, delta, None);
                                if events.send(&chunk(vec![choice], None)).await.is_err() {
                                    return;
                                }
                                started[index] = true;
                            }
                            content
                        }
                        None => text,
                    };
                    let ToolDelta { content: text, calls } = match tools.get_mut(index) {
                        Some(choice_tools) => choice_tools.push(&text),
                        None => ToolDelta { content: text, calls: Vec::new() },
                    };
                    // Held back by a stop-string candidate or a possible tool call's markup.
                    let quiet = text.is_empty() && calls.is_empty() && (tools.is_empty() || logprobs.is_empty());
                    if quiet && (kind == Kind::Chat && started[index]) {
                        continue; // nothing to show yet
                    }
                    let mut lp = (!logprobs.is_empty()).then(|| match kind {
                        Kind::Chat => Logprobs::Chat(ChatLogprobs::new(&app.tokenizer, &token_ids, &logprobs)),
                        Kind::Completion => {
                            let offsets = echo.offsets.get_mut(index).map(|o| o.next(&token_ids)).unwrap_or_default();
                            let lp = CompletionLogprobs::new(&app.tokenizer, None, &token_ids, &logprobs, &offsets);
                            Logprobs::Completion(lp)
                        }
                    });
                    if kind == Kind::Completion {
                        started[index] = true;
                        Choice::running(index, Content::Text(text), lp)
                    } else {
                        for delta in Delta::chat(!started[index], text, calls) {
                            let choice = Choice::running(index, delta, lp.take());
                            if events.send(&chunk(vec![choice], None)).await.is_err() {
                                return;
                            }
                        }
                        started[index] = true;
                        continue;
                    }
                }
                Update::End(end) => {
                    let mut called = false;
                    // What the reasoning split held back until the end.
                    let mut held = String::new();
                    if let Some(splitter) = reasoning.get_mut(end.index) {
                        let Split { reasoning, content } = splitter.finish();
                        if !reasoning.is_empty() {
                            let choice =
                                Choice::running(end.index, Delta::thinking(!started[end.index], reasoning), None);
                            if events.send(&chunk(vec![choice], None)).await.is_err() {
                                return;
                            }
                            started[end.index] = true;
                        }
                        held = content;
                    }
                    if tools.get(end.index).is_none() && !held.is_empty() {
                        for delta in Delta::chat(!started[end.index], std::mem::take(&mut held), Vec::new()) {
                            if events.send(&chunk(vec![Choice::running(end.index, delta, None)], None)).await.is_err() {
                                return;
                            }
                        }
                        started[end.index] = true;
                    }
                    if let Some(choice_tools) = tools.get_mut(end.index) {
                        // What the parser held back until the end.
                        let ToolDelta { content, calls } = choice_tools.finish_after(&held);
                        called = choice_tools.called();
                        if !content.is_empty() || !calls.is_empty() {
                            for delta in Delta::chat(!started[end.index], content, calls) {
                                let rest = Choice::running(end.index, delta, None);
                                if events.send(&chunk(vec![rest], None)).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                    let content = match kind {
                        Kind::Chat => Content::Delta(Delta::default()),
                        Kind::Completion => Content::Text(String::new()),
                    };
                    let mut choice = Choice::ended(end.index, content, None, Some(&end));
                    choice.finish_reason = Some(tool_calls::finish_reason(called, end.finish_reason));
                    ends.push(end);
                    choice
                }
                Update::Failed { message, .. } => {
                    let _ = events.send(&ApiError::internal(message).to_body()).await;
                    break;
                }
            };
            if events.send(&chunk(vec![choice], None)).await.is_err() {
                return; // client gone: dropping rx aborts every choice
            }
        }
        if include_usage && ends.len() == n {
            let refs: Vec<&ChoiceEnd> = ends.iter().collect();
            let _ = events.send(&chunk(Vec::new(), Some(Usage::of(&refs)))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use common::protocol::ModelIdentity;
    use http_body_util::BodyExt;
    use serde_json::Value;

    use super::*;
    use crate::app::HttpLimits;
    use crate::cluster::Cluster;
    use crate::text::Tokenizer;
    use crate::tool_parser::ToolFormat;

    /// A coordinator's state with tiny-qwen3's tokenizer and no workers.
    fn app() -> Arc<AppState> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models/tiny-qwen3");
        let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
        let identity = ModelIdentity { name: "m".into(), config_hash: 0 };
        let cluster = Cluster::new("test".into(), identity, 8, Default::default(), 16);
        Arc::new(AppState::new(cluster, tokenizer, None, "m".into(), 1024, 16, None, HttpLimits::default()))
    }

    fn delta(text: &str) -> Update {
        Update::Delta { index: 0, text: text.into(), token_ids: Vec::new(), logprobs: Vec::new() }
    }

    /// The chunks a chat stream with tool parsing writes for `updates`.
    fn chat_chunks(updates: Vec<Update>, format: ToolFormat, parallel: bool) -> Vec<Value> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(async {
            let app = app();
            let (tx, rx) = mpsc::unbounded_channel();
            for update in updates {
                tx.send(update).expect("send");
            }
            let tools = vec![ChoiceTools::new(format, &[], parallel, "t".into())];
            let stream = ChunkStream {
                id: "c".into(),
                n: 1,
                include_usage: false,
                kind: Kind::Chat,
                echo: EchoStream::default(),
                tools,
                reasoning: Vec::new(),
            };
            let body = stream.reply(app, rx).into_response().into_body().collect().await.expect("body").to_bytes();
            let body = String::from_utf8(body.to_vec()).expect("utf-8");
            assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
            body.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str(d).expect("chunk JSON"))
                .collect()
        })
    }

    fn end(reason: FinishReason) -> Update {
        Update::End(ChoiceEnd {
            index: 0,
            finish_reason: reason,
            stop: None,
            prompt_tokens: 3,
            completion_tokens: 9,
            cached_tokens: 0,
            worker: "w".into(),
        })
    }

    #[test]
    fn streamed_calls_are_openai_deltas() {
        let updates = vec![
            delta("Sure.\n<tool"),
            delta("_call>\n{\"name\": \"get_weather\", \"argu"),
            delta("ments\": {\"city\": "),
            delta("\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}"),
            delta("\n</tool_call>"),
            end(FinishReason::Stop),
        ];
        let chunks = chat_chunks(updates, ToolFormat::Hermes, true);
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        assert_eq!(deltas[0]["role"], "assistant");
        let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
        assert_eq!(content, "Sure.");
        let calls: Vec<&Value> = deltas.iter().filter_map(|d| d["tool_calls"].as_array()).flatten().collect();
        assert_eq!(
            calls[0],
            &serde_json::json!({"index": 0, "id": "call_t_0", "type": "function",
            "function": {"name": "get_weather", "arguments": ""}})
        );
        let arguments = |index: u64| -> String {
            calls.iter().filter(|c| c["index"] == index).map(|c| c["function"]["arguments"].as_str().unwrap()).collect()
        };
        assert_eq!(arguments(0), r#"{"city": "Paris"}"#);
        assert!(calls[1..].iter().filter(|c| c["index"] == 0).all(|c| c.get("id").is_none()));
        // Each chunk carries one call piece, as OpenAI's do.
        assert!(deltas.iter().all(|d| d["tool_calls"].as_array().is_none_or(|c| c.len() == 1)));
        assert!(calls.iter().any(|c| c["index"] == 1 && c["id"] == "call_t_1" && c["function"]["name"] == "now"));
        assert_eq!(arguments(1), "{}");
        let last = chunks.last().expect("chunks");
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
        assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    }

    #[test]
    fn held_back_text_comes_out_at_the_end() {
        // Text that looked like the start of a call, and a call cut by max_tokens.
        let chunks = chat_chunks(vec![delta("a <tool"), end(FinishReason::Stop)], ToolFormat::Hermes, true);
        let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(content, "a <tool");
        assert_eq!(chunks.last().expect("chunks")["choices"][0]["finish_reason"], "stop");
        let cut = vec![delta("{\"name\": \"f\", \"parameters\": {\"a\": "), end(FinishReason::Length)];
        let chunks = chat_chunks(cut, ToolFormat::Llama3Json, false);
        assert_eq!(chunks.last().expect("chunks")["choices"][0]["finish_reason"], "length");
        let calls: Vec<&Value> =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
        assert_eq!(calls[0]["function"], serde_json::json!({"name": "f", "arguments": ""}));
        let arguments: String = calls.iter().map(|c| c["function"]["arguments"].as_str().unwrap()).collect();
        assert_eq!(arguments, "{\"a\": ");
    }
}
