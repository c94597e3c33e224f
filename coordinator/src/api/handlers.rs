//! The endpoints: `/generate`, `/v1/completions`, `/v1/chat/completions`
//! (with SSE streaming), `/v1/models`, `/health`, `/v1/workers`. Response
//! shapes follow OpenAI's; `/generate` is tinyvllm's simple API.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use common::SamplingParams;
use common::protocol::WireLogprobs;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::run::{self, ChoiceEnd, ChoiceSpec, Collected, Update};
use super::types::{
    ChatRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, PromptInput, TokenizeRequest, top_n,
};
use crate::app::AppState;
use crate::http::Reply;

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

fn check_model(app: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None => Ok(()),
        Some(m) if m == app.served_model_name => Ok(()),
        Some(m) => Err(ApiError::model_not_found(m)),
    }
}

/// Refuses prompts the model cannot extend.
fn check_prompt(app: &AppState, ids: &[u32]) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if ids.len() >= app.max_model_len {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "This model's maximum context length is {} tokens; the prompt has {} tokens.",
                app.max_model_len,
                ids.len()
            ),
        ));
    }
    check_in_vocabulary(app, "prompt", ids.iter().copied())
}

/// Refuses ids the tokenizer does not have, naming the request's `param`.
fn check_in_vocabulary(app: &AppState, param: &str, mut ids: impl Iterator<Item = u32>) -> Result<(), ApiError> {
    let vocab_size = app.tokenizer.vocab_size();
    match ids.find(|&t| t as usize >= vocab_size) {
        Some(bad) => Err(ApiError::invalid(param, format!("token id {bad} in {param} is outside the vocabulary"))),
        None => Ok(()),
    }
}

/// Fits the request to the model. The completion goes beside a prompt of
/// `prompt_len` tokens (at most `max_model_len - 1`, per [`check_prompt`]): a
/// `max_tokens` the request names must fit, else a 400 as vLLM answers; the
/// default shrinks to the room. Biased tokens must be in the vocabulary.
fn fit_completion(
    app: &AppState,
    prompt_len: usize,
    named: bool,
    params: &SamplingParams,
) -> Result<SamplingParams, ApiError> {
    check_in_vocabulary(app, "logit_bias", params.logit_bias.iter().map(|&(t, _)| t))?;
    let room = app.max_model_len.saturating_sub(prompt_len) as u32;
    let mut params = params.clone();
    if params.max_tokens > room {
        if named {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the \
                     prompt, {} in the completion). Please reduce the length of the prompt or completion.",
                    app.max_model_len,
                    prompt_len as u64 + u64::from(params.max_tokens),
                    prompt_len,
                    params.max_tokens
                ),
            ));
        }
        params.max_tokens = room;
        params.min_tokens = params.min_tokens.min(room);
    }
    Ok(params)
}

fn usage(ends: &[&ChoiceEnd]) -> Value {
    let prompt = ends.first().map_or(0, |e| e.prompt_tokens);
    let completion: u32 = ends.iter().map(|e| e.completion_tokens).sum();
    let cached = ends.first().map_or(0, |e| e.cached_tokens);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// The `n` choices of one prompt. With a seed, choice i uses seed + i, so
/// n > 1 still gives n different samples, reproducibly.
fn n_choices(prompt_ids: &[u32], params: &SamplingParams, stops: &[String], n: usize) -> Vec<ChoiceSpec> {
    (0..n)
        .map(|i| {
            let mut params = params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            ChoiceSpec { prompt_ids: prompt_ids.to_vec(), params, stops: stops.to_vec() }
        })
        .collect()
}

/// `POST /generate`.
pub async fn generate(app: Arc<AppState>, body: &[u8]) -> Result<Reply, ApiError> {
    let req: GenerateRequest = parse(body)?;
    let prompt_ids = match (&req.prompt, &req.prompt_token_ids) {
        (Some(_), Some(_)) => return Err(ApiError::invalid("prompt", "give prompt or prompt_token_ids, not both")),
        (Some(text), None) => {
            app.tokenizer.encode(text, true).map_err(|e| ApiError::invalid("prompt", e.to_string()))?
        }
        (None, Some(ids)) => ids.clone(),
        (None, None) => return Err(ApiError::invalid("prompt", "prompt or prompt_token_ids is required")),
    };
    check_prompt(&app, &prompt_ids)?;
    let logprobs = top_n("logprobs", req.logprobs)?;
    let mut params = req.sampling.to_params(16, logprobs)?;
    params.prompt_logprobs = top_n("prompt_logprobs", req.prompt_logprobs)?;
    let params = fit_completion(&app, prompt_ids.len(), req.sampling.names_max_tokens(), &params)?;
    let spec = ChoiceSpec { prompt_ids: prompt_ids.clone(), params, stops: req.sampling.stop_strings()? };
    let rx = run::launch(&app, "/generate", vec![spec])?;
    if req.sampling.stream() {
        return Ok(Reply::sse(stream_generate(app, rx, prompt_ids)));
    }
    let mut choices = run::collect(rx, 1).await?;
    let c = choices.remove(0);
    let end = c.end.as_ref().ok_or_else(|| ApiError::internal("missing end"))?;
    let mut out = json!({
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": end.finish_reason,
        "usage": {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens, "cached_tokens": end.cached_tokens},
        "worker": end.worker,
    });
    if logprobs.is_some() {
        out["logprobs"] =
            json!(c.logprobs.iter().zip(&c.token_ids).map(|(l, &id)| logprob_entry(&app, id, l)).collect::<Vec<_>>());
    }
    if req.prompt_logprobs.is_some() {
        // vLLM's shape: the first prompt token has none.
        let entries = c.prompt_logprobs.iter().zip(&prompt_ids[1..]).map(|(l, &id)| logprob_entry(&app, id, l));
        out["prompt_logprobs"] = json!(std::iter::once(Value::Null).chain(entries).collect::<Vec<_>>());
    }
    Ok(Reply::json(out))
}

fn logprob_entry(app: &AppState, id: u32, l: &WireLogprobs) -> Value {
    json!({
        "token_id": id,
        "token": app.tokenizer.token_text(id),
        "logprob": l.logprob,
        "top_logprobs": l.top.iter().map(|&(t, lp)| json!({"token_id": t, "token": app.tokenizer.token_text(t), "logprob": lp})).collect::<Vec<_>>(),
    })
}

/// `/generate`'s SSE events; prompt logprobs come first, in events of
/// their own, each entry naming its prompt token.
fn stream_generate(
    app: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<Update>,
    prompt_ids: Vec<u32>,
) -> mpsc::Receiver<String> {
    let (tx, out) = mpsc::channel(64);
    tokio::spawn(async move {
        // The prompt token whose logprob comes next (the first has none).
        let mut next_prompt_token = 1;
        while let Some(update) = rx.recv().await {
            let event = match update {
                Update::PromptLogprobs { logprobs, .. } => {
                    let ids = prompt_ids.get(next_prompt_token..).unwrap_or_default();
                    next_prompt_token += logprobs.len();
                    let entries: Vec<Value> =
                        logprobs.iter().zip(ids).map(|(l, &id)| logprob_entry(&app, id, l)).collect();
                    json!({"text": "", "token_ids": [], "prompt_logprobs": entries})
                }
                Update::Delta { text, token_ids, logprobs, .. } => {
                    let mut e = json!({"text": text, "token_ids": token_ids});
                    if !logprobs.is_empty() {
                        e["logprobs"] = json!(
                            logprobs
                                .iter()
                                .zip(&token_ids)
                                .map(|(l, &id)| logprob_entry(&app, id, l))
                                .collect::<Vec<_>>()
                        );
                    }
                    e
                }
                Update::End(end) => json!({
                    "text": "", "token_ids": [], "finish_reason": end.finish_reason, "worker": end.worker,
                    "usage": {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens, "cached_tokens": end.cached_tokens},
                }),
                Update::Failed { message, .. } => json!({"error": {"message": message, "type": "server_error"}}),
            };
            let done = event.get("finish_reason").is_some() || event.get("error").is_some();
            if tx.send(format!("data: {event}\n\n")).await.is_err() {
                return; // client gone; dropping rx aborts the request
            }
            if done {
                break;
            }
        }
        let _ = tx.send("data: [DONE]\n\n".to_string()).await;
    });
    out
}

/// `POST /v1/completions`.
pub async fn completions(app: Arc<AppState>, body: &[u8]) -> Result<Reply, ApiError> {
    let req: CompletionRequest = parse(body)?;
    check_model(&app, req.model.as_deref())?;
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        PromptInput::Text(t) => {
            vec![app.tokenizer.encode(t, true).map_err(|e| ApiError::invalid("prompt", e.to_string()))?]
        }
        PromptInput::Texts(ts) => ts
            .iter()
            .map(|t| app.tokenizer.encode(t, true).map_err(|e| ApiError::invalid("prompt", e.to_string())))
            .collect::<Result<_, _>>()?,
        PromptInput::Tokens(ids) => vec![ids.clone()],
        PromptInput::TokenLists(lists) => lists.clone(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt list is empty"));
    }
    for p in &prompts {
        check_prompt(&app, p)?;
    }
    let logprobs = top_n("logprobs", req.logprobs)?;
    let n = req.sampling.n()?;
    req.unserved.check(n)?;
    let stops = req.sampling.stop_strings()?;
    let echo = req.echo.unwrap_or(false);
    // OpenAI's scoring idiom: `echo` with `max_tokens: 0` answers the prompt
    // alone (with its logprobs). The engine computes one token, as vLLM
    // does, and the answer leaves it out.
    let mut sampling = req.sampling.clone();
    let echo_only = echo && sampling.max_tokens.or(sampling.max_completion_tokens) == Some(0);
    if echo_only {
        (sampling.max_tokens, sampling.max_completion_tokens) = (Some(1), None);
    }
    let mut params = sampling.to_params(16, logprobs)?;
    if echo {
        // The echoed prompt's tokens carry logprobs too (what scoring harnesses read).
        params.prompt_logprobs = logprobs;
    }
    let mut specs = Vec::new();
    for p in &prompts {
        let params = fit_completion(&app, p.len(), sampling.names_max_tokens(), &params)?;
        specs.extend(n_choices(p, &params, &stops, n));
    }
    let count = specs.len();
    let echoes: Vec<Echo> = if echo {
        prompts.iter().map(|p| Echo { text: app.tokenizer.decode(p, true), ids: p.clone() }).collect()
    } else {
        Vec::new()
    };
    let rx = run::launch(&app, "/v1/completions", specs)?;
    let id = format!("cmpl-{}", app.next_id());
    if sampling.stream() {
        let include_usage = sampling.include_usage();
        let per_choice = echoes.into_iter().flat_map(|e| vec![e; n]).collect();
        let echo = EchoStream { per_choice, only: echo_only, logprobs: logprobs.is_some() };
        let stream = stream_openai(app, rx, id, count, include_usage, Kind::Completion, echo);
        return Ok(Reply::sse(stream));
    }
    let mut choices = run::collect(rx, count).await?;
    if echo_only {
        for c in &mut choices {
            leave_out_completion(c);
        }
    }
    let ends: Vec<&ChoiceEnd> = choices.iter().filter_map(|c| c.end.as_ref()).collect();
    let mut usage = usage(&ends);
    // Usage counts each prompt once.
    let prompt_total: usize = prompts.iter().map(Vec::len).sum();
    usage["prompt_tokens"] = json!(prompt_total);
    usage["total_tokens"] = json!(prompt_total as u64 + usage["completion_tokens"].as_u64().unwrap_or(0));
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let echoed = echoes.get(i / n);
            let prefix = echoed.map_or("", |e| e.text.as_str());
            let prompt = echoed.map(|e| (e, c.prompt_logprobs.as_slice()));
            json!({
                "index": i,
                "text": format!("{prefix}{}", c.text),
                "logprobs": logprobs.map(|_| completion_logprobs(&app, prompt, &c.token_ids, &c.logprobs, 0)),
                "finish_reason": c.end.as_ref().map(|e| e.finish_reason),
                "stop_reason": c.end.as_ref().and_then(|e| e.stop.clone()),
                // tinyvllm extensions: where the choice ran, and its prefix-cache hit.
                "worker": c.end.as_ref().map(|e| e.worker.clone()),
                "cached_tokens": c.end.as_ref().map(|e| e.cached_tokens),
            })
        })
        .collect();
    Ok(Reply::json(json!({
        "id": id, "object": "text_completion", "created": now(), "model": app.served_model_name,
        "choices": choices, "usage": usage,
    })))
}

/// A prompt echoed back by `/v1/completions`.
#[derive(Clone)]
struct Echo {
    text: String,
    ids: Vec<u32>,
}

/// What a completions stream echoes: each choice's prompt, first (with
/// its logprobs if `logprobs`); with `only`, nothing after it (`max_tokens: 0`).
struct EchoStream {
    per_choice: Vec<Echo>,
    only: bool,
    logprobs: bool,
}

/// An `echo` with `max_tokens: 0` answer: the token the engine computed is
/// not part of it.
fn leave_out_completion(c: &mut Collected) {
    c.text.clear();
    c.token_ids.clear();
    c.logprobs.clear();
    if let Some(end) = &mut c.end {
        end.completion_tokens = 0;
        end.finish_reason = "length";
        end.stop = None;
    }
}

/// OpenAI's legacy completions logprobs object over an echoed prompt (with
/// the logprobs of all but its first token, which has `null`s), then the
/// completion's `ids`. `text_offset` counts characters from the start of
/// the choice's text, of which `start` came in earlier streamed chunks:
/// the completion's tokens start after the echoed text; the prompt's
/// offsets add up its token texts, as vLLM's do (a BOS token or a leading
/// space the decoded text drops still counts there).
fn completion_logprobs(
    app: &AppState,
    prompt: Option<(&Echo, &[WireLogprobs])>,
    ids: &[u32],
    lps: &[WireLogprobs],
    start: usize,
) -> Value {
    let (mut tokens, mut offsets, mut token_logprobs, mut top_logprobs) = (vec![], vec![], vec![], vec![]);
    let mut push = |id: u32, lp: Option<&WireLogprobs>, offset: &mut usize| {
        let t = app.tokenizer.token_text(id);
        offsets.push(*offset);
        *offset += t.chars().count();
        tokens.push(t);
        token_logprobs.push(lp.map(|l| l.logprob));
        top_logprobs.push(lp.map(|l| {
            l.top.iter().map(|&(t, lp)| (app.tokenizer.token_text(t), json!(lp))).collect::<serde_json::Map<_, _>>()
        }));
    };
    let mut offset = start;
    if let Some((echo, prompt_lps)) = prompt {
        for (i, &id) in echo.ids.iter().enumerate() {
            push(id, i.checked_sub(1).and_then(|j| prompt_lps.get(j)), &mut offset);
        }
        offset = start + echo.text.chars().count();
    }
    for (&id, l) in ids.iter().zip(lps) {
        push(id, Some(l), &mut offset);
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    })
}

/// The prompt a conversation becomes: the model's chat template, then the
/// tokenizer, without special tokens for chat (the template writes BOS where
/// the model wants it).
fn chat_prompt_ids(
    app: &AppState,
    messages: &[Value],
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let template = app.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request(
            "This model has no chat template (tokenizer_config.json has no chat_template); use /v1/completions",
        )
    })?;
    let text =
        template.render(messages, add_generation_prompt).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    app.tokenizer.encode(&text, add_special_tokens).map_err(|e| ApiError::invalid("messages", e.to_string()))
}

/// `POST /v1/chat/completions`.
pub async fn chat(app: Arc<AppState>, body: &[u8]) -> Result<Reply, ApiError> {
    let req: ChatRequest = parse(body)?;
    check_model(&app, req.model.as_deref())?;
    let prompt_ids = chat_prompt_ids(&app, &req.messages, true, false)?;
    check_prompt(&app, &prompt_ids)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (true, top) => Some(top_n("top_logprobs", top)?.unwrap_or(0)),
        (false, None | Some(0)) => None,
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs set to true")),
    };
    let n = req.sampling.n()?;
    req.unserved.check(n)?;
    let stops = req.sampling.stop_strings()?;
    // Chat's default is the whole room left (OpenAI's, vLLM's).
    let default_max = app.max_model_len.saturating_sub(prompt_ids.len()) as u32;
    let params = req.sampling.to_params(default_max, logprobs)?;
    let params = fit_completion(&app, prompt_ids.len(), req.sampling.names_max_tokens(), &params)?;
    let specs = n_choices(&prompt_ids, &params, &stops, n);
    let rx = run::launch(&app, "/v1/chat/completions", specs)?;
    let id = format!("chatcmpl-{}", app.next_id());
    if req.sampling.stream() {
        let include_usage = req.sampling.include_usage();
        let no_echo = EchoStream { per_choice: Vec::new(), only: false, logprobs: false };
        return Ok(Reply::sse(stream_openai(app, rx, id, n, include_usage, Kind::Chat, no_echo)));
    }
    let choices = run::collect(rx, n).await?;
    let ends: Vec<&ChoiceEnd> = choices.iter().filter_map(|c| c.end.as_ref()).collect();
    let usage = usage(&ends);
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs.map(|_| chat_logprobs(&app, &c.token_ids, &c.logprobs)),
                "finish_reason": c.end.as_ref().map(|e| e.finish_reason),
                "stop_reason": c.end.as_ref().and_then(|e| e.stop.clone()),
                // tinyvllm extensions: where the choice ran, and its prefix-cache hit.
                "worker": c.end.as_ref().map(|e| e.worker.clone()),
                "cached_tokens": c.end.as_ref().map(|e| e.cached_tokens),
            })
        })
        .collect();
    Ok(Reply::json(json!({
        "id": id, "object": "chat.completion", "created": now(), "model": app.served_model_name,
        "choices": choices, "usage": usage,
    })))
}

fn chat_logprobs(app: &AppState, ids: &[u32], lps: &[WireLogprobs]) -> Value {
    let content: Vec<Value> = ids
        .iter()
        .zip(lps)
        .map(|(&id, l)| {
            let token = app.tokenizer.token_text(id);
            json!({
                "token": token, "logprob": l.logprob, "bytes": token.as_bytes(),
                "top_logprobs": l.top.iter().map(|&(t, lp)| {
                    let tt = app.tokenizer.token_text(t);
                    json!({"token": tt, "logprob": lp, "bytes": tt.as_bytes()})
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// OpenAI SSE chunks, ending with `data: [DONE]`. An echoed prompt is
/// each choice's first chunk, sent once its prompt logprobs (which come
/// before any token) are in.
fn stream_openai(
    app: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<Update>,
    id: String,
    n: usize,
    include_usage: bool,
    kind: Kind,
    echo: EchoStream,
) -> mpsc::Receiver<String> {
    let (tx, out) = mpsc::channel(64);
    tokio::spawn(async move {
        let created = now();
        let object = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |choice: Value| json!({"id": id, "object": object, "created": created, "model": app.served_model_name, "choices": [choice]});
        let mut started = vec![false; n];
        // Characters of each choice's text streamed so far: where the next
        // chunk's `text_offset`s start.
        let mut streamed_chars = vec![0usize; n];
        let mut prompt_logprobs: Vec<Vec<WireLogprobs>> = vec![Vec::new(); n];
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
                let lp =
                    echo.logprobs.then(|| completion_logprobs(&app, Some((e, &prompt_logprobs[index])), &[], &[], 0));
                let choice = json!({"index": index, "text": e.text, "logprobs": lp, "finish_reason": null});
                if tx.send(format!("data: {}\n\n", chunk(choice))).await.is_err() {
                    return;
                }
                started[index] = true;
                streamed_chars[index] = e.text.chars().count();
            }
            if echo.only {
                match &mut update {
                    Update::Delta { .. } => continue,
                    Update::End(end) => (end.completion_tokens, end.finish_reason, end.stop) = (0, "length", None),
                    _ => {}
                }
            }
            let value = match update {
                Update::PromptLogprobs { .. } => continue,
                Update::Delta { index, text, token_ids, logprobs } => {
                    if text.is_empty() && (kind == Kind::Chat && started[index]) {
                        continue; // held back by a stop-string candidate; nothing to show yet
                    }
                    let lp = (!logprobs.is_empty()).then(|| match kind {
                        Kind::Chat => chat_logprobs(&app, &token_ids, &logprobs),
                        Kind::Completion => {
                            completion_logprobs(&app, None, &token_ids, &logprobs, streamed_chars[index])
                        }
                    });
                    streamed_chars[index] += text.chars().count();
                    let choice = match kind {
                        Kind::Chat => {
                            let delta = if started[index] {
                                json!({"content": text})
                            } else {
                                json!({"role": "assistant", "content": text})
                            };
                            json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": null})
                        }
                        Kind::Completion => {
                            json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null})
                        }
                    };
                    started[index] = true;
                    chunk(choice)
                }
                Update::End(end) => {
                    let choice = match kind {
                        Kind::Chat => {
                            json!({"index": end.index, "delta": {}, "logprobs": null, "finish_reason": end.finish_reason, "stop_reason": end.stop, "worker": end.worker, "cached_tokens": end.cached_tokens})
                        }
                        Kind::Completion => {
                            json!({"index": end.index, "text": "", "logprobs": null, "finish_reason": end.finish_reason, "stop_reason": end.stop, "worker": end.worker, "cached_tokens": end.cached_tokens})
                        }
                    };
                    ends.push(end);
                    chunk(choice)
                }
                Update::Failed { message, .. } => {
                    let _ = tx
                        .send(format!(
                            "data: {}\n\n",
                            json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}})
                        ))
                        .await;
                    break;
                }
            };
            if tx.send(format!("data: {value}\n\n")).await.is_err() {
                return; // client gone: dropping rx aborts every choice
            }
        }
        if include_usage && ends.len() == n {
            let refs: Vec<&ChoiceEnd> = ends.iter().collect();
            let usage_chunk = json!({"id": id, "object": object, "created": created, "model": app.served_model_name, "choices": [], "usage": usage(&refs)});
            let _ = tx.send(format!("data: {usage_chunk}\n\n")).await;
        }
        let _ = tx.send("data: [DONE]\n\n".to_string()).await;
    });
    out
}

/// `POST /tokenize` (vLLM's): a prompt, or chat messages through the
/// template, to the ids the engine would see.
pub fn tokenize(app: &AppState, body: &[u8]) -> Result<Reply, ApiError> {
    let req: TokenizeRequest = parse(body)?;
    check_model(app, req.model.as_deref())?;
    let ids = match (&req.prompt, &req.messages) {
        (Some(text), None) => app
            .tokenizer
            .encode(text, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        (None, Some(messages)) => chat_prompt_ids(
            app,
            messages,
            req.add_generation_prompt.unwrap_or(true),
            req.add_special_tokens.unwrap_or(false),
        )?,
        (Some(_), Some(_)) => return Err(ApiError::invalid("prompt", "give prompt or messages, not both")),
        (None, None) => return Err(ApiError::invalid("prompt", "prompt or messages is required")),
    };
    let token_strs = req
        .return_token_strs
        .unwrap_or(false)
        .then(|| ids.iter().map(|&id| app.tokenizer.token_text(id)).collect::<Vec<_>>());
    Ok(Reply::json(json!({
        "count": ids.len(), "max_model_len": app.max_model_len, "tokens": ids, "token_strs": token_strs,
    })))
}

/// `POST /detokenize` (vLLM's): ids to text, special tokens kept.
pub fn detokenize(app: &AppState, body: &[u8]) -> Result<Reply, ApiError> {
    let req: DetokenizeRequest = parse(body)?;
    check_model(app, req.model.as_deref())?;
    check_in_vocabulary(app, "tokens", req.tokens.iter().copied())?;
    Ok(Reply::json(json!({"prompt": app.tokenizer.decode(&req.tokens, false)})))
}

/// `GET /v1/models`.
pub fn models(app: &AppState) -> Reply {
    Reply::json(json!({
        "object": "list",
        "data": [{"id": app.served_model_name, "object": "model", "created": app.started_at, "owned_by": "tinyvllm", "max_model_len": app.max_model_len}],
    }))
}

/// `GET /health`: 200 only with at least one ready worker.
pub fn health(app: &AppState) -> Reply {
    let workers = app.cluster.workers();
    let ready = app.cluster.is_ready();
    let body = json!({"status": if ready { "ok" } else { "no ready worker" }, "workers": workers.len()});
    if ready { Reply::json(body) } else { Reply::json_status(hyper::StatusCode::SERVICE_UNAVAILABLE, body) }
}

/// `GET /v1/workers`.
pub fn workers(app: &AppState) -> Reply {
    Reply::json(
        json!({"object": "list", "data": app.cluster.workers(), "in_flight": app.cluster.in_flight(), "redispatches": app.cluster.redispatches()}),
    )
}

/// `GET /v1/prometheus/targets`: the workers' metrics endpoints in
/// Prometheus `http_sd` format, so a scrape config needs no edit when
/// workers come and go.
pub fn prometheus_targets(app: &AppState) -> Reply {
    let groups: Vec<Value> = app
        .cluster
        .workers()
        .into_iter()
        .filter_map(|w| {
            let target = w.metrics_address?;
            Some(json!({"targets": [target], "labels": {"worker": w.name, "model_name": app.served_model_name}}))
        })
        .collect();
    Reply::json(Value::Array(groups))
}
