//! `POST /v1/chat/completions`: a conversation through the model's chat
//! template, `n` choices, OpenAI's chat logprobs (tokens with their bytes).

use std::sync::Arc;

use bytes::Bytes;

use super::error::ApiError;
use super::logprobs::ChatLogprobs;
use super::openai::{Choice, ChunkStream, Completion, Content, EchoStream, Kind, Logprobs, Message, Usage};
use super::prepare::{chat_prompt_ids, check_model, check_prompt, fit_completion, n_choices, now, parse};
use super::reply::Reply;
use super::request::{ChatRequest, top_n};
use super::run::{self, ChoiceEnd, ChoiceSpec};
use super::structured::constrain;
use super::validate::Kind as Shape;
use crate::app::AppState;

/// Fields of a chat body besides the sampling ones.
const FIELDS: &[(&str, Shape)] =
    &[("messages", Shape::Messages), ("logprobs", Shape::Bool), ("top_logprobs", Shape::Int)];

/// `POST /v1/chat/completions`. Templating and tokenizing run on the blocking pool.
pub async fn chat(app: Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    let (req, specs, logprobs) = app.offload(body.len(), move |app| plan(app, &body)).await?;
    let n = specs.len();
    let rx = run::launch(&app, "/v1/chat/completions", specs)?;
    let id = format!("chatcmpl-{}", app.next_id());
    if req.sampling.stream() {
        let include_usage = req.sampling.include_usage();
        let stream = ChunkStream { id, n, include_usage, kind: Kind::Chat, echo: EchoStream::default() };
        return Ok(stream.reply(app, rx));
    }
    let choices = run::collect(rx, n).await?;
    let ends: Vec<&ChoiceEnd> = choices.iter().filter_map(|c| c.end.as_ref()).collect();
    let usage = Usage::of(&ends);
    let choices = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let message = Content::Message(Message { role: "assistant", content: c.text.clone() });
            let lp = logprobs.map(|_| Logprobs::Chat(ChatLogprobs::new(&app.tokenizer, &c.token_ids, &c.logprobs)));
            Choice::ended(i, message, lp, c.end.as_ref())
        })
        .collect();
    let object = "chat.completion";
    let model = &app.served_model_name;
    Ok(Reply::json(&Completion { id: &id, object, created: now(), model, choices, usage: Some(usage) }))
}

/// Everything before the request runs: the body read and checked, the
/// conversation templated and tokenized, the choices fitted to the context.
fn plan(app: &AppState, body: &[u8]) -> Result<(ChatRequest, Vec<ChoiceSpec>, Option<u32>), ApiError> {
    let mut req: ChatRequest = parse(body, &["messages"], FIELDS)?;
    check_model(app, req.model.as_deref())?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (true, top) => Some(top_n("top_logprobs", top)?.unwrap_or(0)),
        (false, None | Some(0)) => None,
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs set to true")),
    };
    let n = req.sampling.n()?;
    req.unserved.check(n)?;
    let stops = req.sampling.stop_strings()?;
    let max_len = app.max_model_len();
    let messages = std::mem::take(&mut req.messages);
    let prompt_ids = chat_prompt_ids(app, &messages, true, false, Some(max_len))?;
    check_prompt(app, &prompt_ids, max_len)?;
    // Chat's default is the whole room left (OpenAI's, vLLM's).
    let default_max = max_len.saturating_sub(prompt_ids.len()) as u32;
    let mut params = req.sampling.to_params(default_max, logprobs)?;
    constrain(app, &req.sampling.structured, &mut params)?;
    let params = fit_completion(app, max_len, "messages", prompt_ids.len(), req.sampling.names_max_tokens(), &params)?;
    Ok((req, n_choices(&prompt_ids, &params, &stops, n), logprobs))
}
