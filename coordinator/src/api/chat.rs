//! `POST /v1/chat/completions`: a conversation through the model's chat
//! template, `n` choices, OpenAI's chat logprobs (tokens with their bytes),
//! and tool calls (`tools`, `tool_choice`, `parallel_tool_calls`; see
//! `api::tool_calls`).

use std::sync::Arc;

use bytes::Bytes;

use super::error::ApiError;
use super::logprobs::ChatLogprobs;
use super::openai::{Choice, ChunkStream, Completion, Content, EchoStream, Kind, Logprobs, Message, Usage};
use super::prepare::{chat_prompt_ids, check_model, check_prompt, fit_completion, n_choices, now, parse};
use super::reply::Reply;
use super::request::{ChatRequest, reasoning_effort_kwargs, top_n};
use super::run::{self, ChoiceEnd, ChoiceSpec};
use super::structured::constrain;
use super::tool_calls::{self, ChoiceTools, ToolCall, ToolRequest};
use super::validate::Kind as Shape;
use crate::app::AppState;
use crate::reasoning::grammar::then_answer;
use crate::reasoning::{ReasoningFormat, ReasoningSplitter, Split};
use crate::tool_parser::{Function, ToolFormat};

/// Fields of a chat body besides the sampling ones.
const FIELDS: &[(&str, Shape)] = &[
    ("messages", Shape::Messages),
    ("logprobs", Shape::Bool),
    ("top_logprobs", Shape::Int),
    ("tool_choice", Shape::Any),
    ("parallel_tool_calls", Shape::Bool),
    ("chat_template_kwargs", Shape::Object),
    ("reasoning_effort", Shape::Any),
];

/// How the choices' output is read for tool calls.
#[derive(Clone)]
pub(super) struct ToolParsing {
    pub format: ToolFormat,
    pub functions: Arc<[Function]>,
    pub parallel: bool,
}

impl ToolParsing {
    /// One choice's reader, its call ids unique.
    pub fn choice(&self, app: &AppState) -> ChoiceTools {
        ChoiceTools::new(self.format, &self.functions, self.parallel, app.next_id())
    }
}

/// A request read, checked and tokenized: what runs it.
pub(super) struct Plan {
    pub req: ChatRequest,
    pub specs: Vec<ChoiceSpec>,
    pub logprobs: Option<u32>,
    pub tools: Option<ToolParsing>,
}

/// `POST /v1/chat/completions`. Templating and tokenizing run on the blocking pool.
pub async fn chat(app: Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    let Plan { req, specs, logprobs, tools } = app.offload(body.len(), move |app| plan(app, &body)).await?;
    let n = specs.len();
    let rx = run::launch(&app, "/v1/chat/completions", specs)?;
    let id = format!("chatcmpl-{}", app.next_id());
    if req.sampling.stream() {
        let include_usage = req.sampling.include_usage();
        let tools = tools.as_ref().map(|t| (0..n).map(|_| t.choice(&app)).collect()).unwrap_or_default();
        let reasoning = app.reasoning_format.map(|f| (0..n).map(|_| ReasoningSplitter::new(f)).collect());
        let echo = EchoStream::default();
        let reasoning = reasoning.unwrap_or_default();
        let stream = ChunkStream { id, n, include_usage, kind: Kind::Chat, echo, tools, reasoning };
        return Ok(stream.reply(app, rx));
    }
    let choices = run::collect(rx, n).await?;
    let ends: Vec<&ChoiceEnd> = choices.iter().filter_map(|c| c.end.as_ref()).collect();
    let usage = Usage::of(&ends);
    let choices = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let Answer { reasoning, content, calls } =
                answer(app.reasoning_format, &c.text, tools.as_ref().map(|t| t.choice(&app)));
            let called = !calls.is_empty();
            let message = Content::Message(Message {
                role: "assistant",
                content,
                reasoning_content: reasoning,
                tool_calls: calls,
            });
            let lp = logprobs.map(|_| Logprobs::Chat(ChatLogprobs::new(&app.tokenizer, &c.token_ids, &c.logprobs)));
            let mut choice = Choice::ended(i, message, lp, c.end.as_ref());
            choice.finish_reason = c.end.as_ref().map(|e| tool_calls::finish_reason(called, e.finish_reason));
            choice
        })
        .collect();
    let object = "chat.completion";
    let model = &app.served_model_name;
    Ok(Reply::json(&Completion { id: &id, object, created: now(), model, choices, usage: Some(usage) }))
}

/// A whole output read: the thinking (with a reasoning parser), then the
/// answer's content (`None` if there is none) and tool calls.
pub(super) struct Answer {
    pub reasoning: Option<String>,
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// Reads a whole output as every chat API does: the thinking split off
/// first, then the rest read for tool calls.
pub(super) fn answer(format: Option<ReasoningFormat>, text: &str, tools: Option<ChoiceTools>) -> Answer {
    let (reasoning, rest) = match format {
        Some(format) => {
            let Split { reasoning, content } = ReasoningSplitter::whole(format, text);
            (Some(reasoning), content)
        }
        None => (None, text.to_string()),
    };
    let (content, calls) = match tools {
        Some(t) => t.whole(&rest),
        None => (Some(rest), Vec::new()),
    };
    Answer { reasoning, content, calls }
}

/// Everything before the request runs: the body read and checked, the
/// conversation templated (with its tools) and tokenized, the choices
/// fitted to the context, and the calls a tool choice requires forced.
fn plan(app: &AppState, body: &[u8]) -> Result<Plan, ApiError> {
    plan_request(app, parse(body, &["messages"], FIELDS)?, false)
}

/// [`plan`] for a request already read (`/v1/messages` builds one from
/// Anthropic's body). `cut_max_tokens`: a `max_tokens` beyond the room
/// left in the context is cut to it (Anthropic's servers' rule) rather
/// than refused (OpenAI's).
pub(super) fn plan_request(app: &AppState, mut req: ChatRequest, cut_max_tokens: bool) -> Result<Plan, ApiError> {
    check_model(app, req.model.as_deref())?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (true, top) => Some(top_n("top_logprobs", top)?.unwrap_or(0)),
        (false, None | Some(0)) => None,
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs set to true")),
    };
    let n = req.sampling.n()?;
    req.unserved.check(n)?;
    let stops = req.sampling.stop_strings()?;
    let tool_request = ToolRequest::read(req.tools.as_deref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
    let format = match &tool_request {
        Some(t) => t.format(app.tool_format)?,
        None => None,
    };
    let max_len = app.max_model_len();
    let messages = std::mem::take(&mut req.messages);
    tool_calls::check_messages(&messages)?;
    let template_tools = tool_request.as_ref().map(|t| t.tools.as_slice());
    if let Some(effort) = req.reasoning_effort.take().filter(|e| !e.is_null()) {
        reasoning_effort_kwargs("reasoning_effort", &effort, &mut req.chat_template_kwargs)?;
    }
    let kwargs = req.chat_template_kwargs.as_ref();
    let prompt_ids = chat_prompt_ids(app, &messages, (template_tools, kwargs), true, false, Some(max_len))?;
    check_prompt(app, &prompt_ids, max_len)?;
    // Chat's default is the whole room left (OpenAI's, vLLM's).
    let default_max = max_len.saturating_sub(prompt_ids.len()) as u32;
    let mut params = req.sampling.to_params(default_max, logprobs)?;
    let constrained_by = constrain(app, &req.sampling.structured, &mut params)?;
    let mut forced_call = false;
    if let Some(forced) = tool_request
        .as_ref()
        .zip(format)
        .and_then(|(t, f)| t.constraint(f, &|marker| app.tokenizer.special_token_id(marker)))
    {
        // A turn that must call has no text for response_format to shape
        // (OpenAI's meaning: the Agents SDK sends both); guided decoding
        // asks for the whole output and cannot be both.
        match constrained_by {
            Some("response_format") | None => {}
            Some(param) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice \"required\" or a named function cannot be combined with {param}, which \
                         constrains the whole output"
                    ),
                ));
            }
        }
        let compiler = app.grammar_compiler().map_err(|why| ApiError::invalid("tool_choice", why.to_string()))?;
        compiler.compile(&forced).map_err(|e| {
            ApiError::invalid("tools", format!("the tools' parameters do not compile into a call grammar: {e}"))
        })?;
        params.structured_output = Some(forced);
        forced_call = true;
    }
    // A constraint applies once the thinking ends (Harmony's call grammar
    // has its analysis message already), unless it is to cover the thinking.
    let harmony_call = format == Some(ToolFormat::Harmony) && forced_call;
    let free_thinking = !harmony_call && (forced_call || !app.constrain_reasoning);
    if let Some(reasoning) = app.reasoning_format.filter(|_| free_thinking)
        && let Some(constraint) = params.structured_output.take()
    {
        let special = |marker: &str| app.tokenizer.special_token_id(marker);
        params.structured_output = Some(then_answer(reasoning, &special, constraint));
    }
    let named = req.sampling.names_max_tokens() && !cut_max_tokens;
    let params = fit_completion(app, max_len, "messages", prompt_ids.len(), named, &params)?;
    let mut specs = n_choices(&prompt_ids, &params, &stops, req.sampling.priority()?, n);
    // Markers that are special tokens must reach the parsers as text.
    let keep_specials = app.reasoning_format.is_some_and(ReasoningFormat::needs_special_tokens)
        || format.is_some_and(ToolFormat::needs_special_tokens);
    for spec in &mut specs {
        spec.skip_special_tokens = !keep_specials;
    }
    let parallel = tool_request.as_ref().is_none_or(|t| t.parallel);
    let functions: Arc<[Function]> =
        tool_request.map(|t| Arc::from(t.functions)).unwrap_or_else(|| Arc::from(Vec::new()));
    Ok(Plan { req, specs, logprobs, tools: format.map(|format| ToolParsing { format, functions, parallel }) })
}
