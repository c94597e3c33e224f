//! `POST /v1/completions`: OpenAI's legacy completions. One or more
//! prompts (texts or token ids), `n` choices each, `echo` of the prompt
//! (with its logprobs, as scoring harnesses read them), and the
//! `text_offset`s of the legacy logprobs object.

use std::sync::Arc;

use bytes::Bytes;
use common::FinishReason;

use super::error::ApiError;
use super::logprobs::{CompletionLogprobs, Echo, TextOffsets};
use super::openai::{Choice, ChunkStream, Completion, Content, EchoStream, Kind, Logprobs, Usage};
use super::prepare::{check_model, check_prompt, encode_prompt, fit_completion, n_choices, now, parse};
use super::reply::Reply;
use super::request::{CompletionRequest, PromptInput, SamplingFields, top_n};
use super::run::{self, ChoiceEnd, ChoiceSpec, Collected};
use super::structured::constrain;
use super::validate::Kind as Shape;
use crate::app::AppState;

/// Fields of a completions body besides the sampling ones.
const FIELDS: &[(&str, Shape)] = &[("prompt", Shape::Prompt), ("logprobs", Shape::Int), ("echo", Shape::Bool)];

/// A request read, checked and tokenized: what runs it.
struct Plan {
    prompts: Vec<Vec<u32>>,
    specs: Vec<ChoiceSpec>,
    echoes: Vec<Echo>,
    n: usize,
    logprobs: Option<u32>,
    echo_only: bool,
    sampling: SamplingFields,
}

/// `POST /v1/completions`. Parsing and tokenizing run on the blocking pool.
pub async fn completions(app: Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    let Plan { prompts, specs, echoes, n, logprobs, echo_only, sampling } =
        app.offload(body.len(), move |app| plan(app, &body)).await?;
    let count = specs.len();
    let rx = run::launch(&app, "/v1/completions", specs)?;
    let id = format!("cmpl-{}", app.next_id());
    if sampling.stream() {
        // Each choice's `text_offset`s go on from its echoed prompt's end.
        let offsets = match logprobs {
            Some(_) => (0..count)
                .map(|i| {
                    let start = echoes.get(i / n).map_or(0, |e| e.text.chars().count());
                    TextOffsets::new(app.tokenizer.clone(), prompt_of(&prompts, i / n), start)
                })
                .collect(),
            None => Vec::new(),
        };
        let per_choice = echoes.into_iter().flat_map(|e| vec![e; n]).collect();
        let echo = EchoStream { per_choice, only: echo_only, logprobs: logprobs.is_some(), offsets };
        let include_usage = sampling.include_usage();
        let stream = ChunkStream {
            id,
            n: count,
            include_usage,
            kind: Kind::Completion,
            echo,
            tools: Vec::new(),
            reasoning: Vec::new(),
        };
        return Ok(stream.reply(app, rx));
    }
    let mut choices = run::collect(rx, count).await?;
    if echo_only {
        for c in &mut choices {
            leave_out_completion(c);
        }
    }
    let ends: Vec<&ChoiceEnd> = choices.iter().filter_map(|c| c.end.as_ref()).collect();
    let mut usage = Usage::of(&ends);
    // Usage counts each prompt once.
    let prompt_total = prompts.iter().map(Vec::len).sum::<usize>() as u64;
    usage.prompt_tokens = prompt_total;
    usage.total_tokens = prompt_total + usage.completion_tokens;
    let choices = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let echoed = echoes.get(i / n);
            let prefix = echoed.map_or("", |e| e.text.as_str());
            let prompt = echoed.map(|e| (e, c.prompt_logprobs.as_slice()));
            let lp = logprobs.map(|_| {
                // Offsets into the text below: after the echoed prompt, and
                // none past a stop string's cut.
                let start = prefix.chars().count();
                let offsets = TextOffsets::new(app.tokenizer.clone(), prompt_of(&prompts, i / n), start)
                    .take(&c.token_ids, start + c.text.chars().count());
                let lp = CompletionLogprobs::new(&app.tokenizer, prompt, &c.token_ids, &c.logprobs, &offsets);
                Logprobs::Completion(lp)
            });
            Choice::ended(i, Content::Text(format!("{prefix}{}", c.text)), lp, c.end.as_ref())
        })
        .collect();
    let object = "text_completion";
    let model = &app.served_model_name;
    Ok(Reply::json(&Completion { id: &id, object, created: now(), model, choices, usage: Some(usage) }))
}

/// Everything before the request runs; no I/O, so it can run off the runtime.
fn plan(app: &AppState, body: &[u8]) -> Result<Plan, ApiError> {
    let req: CompletionRequest = parse(body, &["prompt"], FIELDS)?;
    check_model(app, req.model.as_deref())?;
    let n = req.sampling.n()?;
    let count = match &req.prompt {
        PromptInput::Text(_) | PromptInput::Tokens(_) => 1,
        PromptInput::Texts(list) => list.len(),
        PromptInput::TokenLists(list) => list.len(),
    };
    if count.saturating_mul(n) > app.limits.max_choices {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "{count} prompts × n {n} asks for {} completions; one request may ask for at most {}",
                count * n,
                app.limits.max_choices
            ),
        ));
    }
    let max_len = app.max_model_len();
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        PromptInput::Text(t) => vec![encode_prompt(app, t, max_len)?],
        PromptInput::Texts(ts) => ts.iter().map(|t| encode_prompt(app, t, max_len)).collect::<Result<_, _>>()?,
        PromptInput::Tokens(ids) => vec![ids.clone()],
        PromptInput::TokenLists(lists) => lists.clone(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt list is empty"));
    }
    for p in &prompts {
        check_prompt(app, p, max_len)?;
    }
    let logprobs = top_n("logprobs", req.logprobs)?;
    req.unserved.check(n)?;
    let stops = req.sampling.stop_strings()?;
    let priority = req.sampling.priority()?;
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
    constrain(app, &sampling.structured, &mut params)?;
    if echo {
        // The echoed prompt's tokens carry logprobs too (what scoring harnesses read).
        params.prompt_logprobs = logprobs;
    }
    let mut specs = Vec::new();
    for p in &prompts {
        let params = fit_completion(app, max_len, "prompt", p.len(), sampling.names_max_tokens(), &params)?;
        specs.extend(n_choices(p, &params, &stops, priority, n));
    }
    let echoes: Vec<Echo> =
        if echo { prompts.iter().map(|p| Echo::new(&app.tokenizer, p.clone())).collect() } else { Vec::new() };
    Ok(Plan { prompts, specs, echoes, n, logprobs, echo_only, sampling })
}

/// Prompt `i`'s tokens (the context of its choices' text).
fn prompt_of(prompts: &[Vec<u32>], i: usize) -> &[u32] {
    prompts.get(i).map_or(&[], Vec::as_slice)
}

/// An `echo` with `max_tokens: 0` answer: the token the engine computed is
/// not part of it.
fn leave_out_completion(c: &mut Collected) {
    c.text.clear();
    c.token_ids.clear();
    c.logprobs.clear();
    if let Some(end) = &mut c.end {
        end.completion_tokens = 0;
        end.finish_reason = FinishReason::Length;
        end.stop = None;
    }
}
