//! What every generating endpoint does to a request before it runs: parse
//! the body, check the model name, the prompt and the token ids against the
//! model, fit `max_tokens` to the context, and split `n` into choices.

use common::SamplingParams;
use serde_json::Value;

use super::error::ApiError;
use super::run::ChoiceSpec;
use super::validate::{self, Kind};
use crate::app::AppState;
use crate::text::RenderOptions;

/// Reads a generating endpoint's body: its own `fields` besides the
/// sampling ones, shapes checked (see `validate`).
pub fn parse<T: serde::de::DeserializeOwned>(
    body: &[u8],
    required: &[&str],
    fields: &[(&str, Kind)],
) -> Result<T, ApiError> {
    validate::parse(body, required, fields, validate::SAMPLING)
}

/// Seconds since the epoch, for `created`.
pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub fn check_model(app: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None => Ok(()),
        Some(m) if m == app.served_model_name => Ok(()),
        Some(m) => Err(ApiError::model_not_found(m)),
    }
}

/// A text prompt's ids, special tokens (BOS) included; refused unread if
/// it is too long to fit `max_len` tokens however it tokenizes.
pub fn encode_prompt(app: &AppState, text: &str, max_len: usize) -> Result<Vec<u32>, ApiError> {
    check_text_fits(app, "prompt", text, max_len)?;
    app.tokenizer.encode(text, true).map_err(|e| ApiError::invalid("prompt", e.to_string()))
}

/// Refuses a text whose byte length alone shows it cannot fit, before the
/// tokenizer spends seconds on it.
fn check_text_fits(app: &AppState, param: &str, text: &str, max_len: usize) -> Result<(), ApiError> {
    if app.text_can_fit(text.len(), max_len) {
        return Ok(());
    }
    Err(ApiError::invalid(
        param,
        format!(
            "This model's maximum context length is {max_len} tokens (max_model_len); a {param} of {} bytes is \
             longer than that however it tokenizes.",
            text.len()
        ),
    ))
}

/// Refuses prompts the model cannot extend within `max_len` (the effective
/// context, [`AppState::max_model_len`]).
pub fn check_prompt(app: &AppState, ids: &[u32], max_len: usize) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if ids.len() >= max_len {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "This model's maximum context length is {max_len} tokens (max_model_len). However, the prompt has \
                 {} tokens, which leaves no room for the completion. Please reduce the length of the prompt.",
                ids.len()
            ),
        ));
    }
    check_in_vocabulary(app, "prompt", ids.iter().copied())
}

/// Refuses ids the tokenizer does not have, naming the request's `param`.
pub fn check_in_vocabulary(app: &AppState, param: &str, mut ids: impl Iterator<Item = u32>) -> Result<(), ApiError> {
    let vocab_size = app.tokenizer.vocab_size();
    match ids.find(|&t| t as usize >= vocab_size) {
        Some(bad) => Err(ApiError::invalid(param, format!("token id {bad} in {param} is outside the vocabulary"))),
        None => Ok(()),
    }
}

/// Fits the request to the effective context `max_len`. The completion goes
/// beside a prompt of `prompt_len` tokens (at most `max_len - 1`, per
/// [`check_prompt`]): a `max_tokens` the request names must fit, else a 400
/// as vLLM answers; the default shrinks to the room. Biased and stop tokens
/// must be in the vocabulary. `what` names the prompt in messages ("prompt",
/// "messages").
pub fn fit_completion(
    app: &AppState,
    max_len: usize,
    what: &str,
    prompt_len: usize,
    named: bool,
    params: &SamplingParams,
) -> Result<SamplingParams, ApiError> {
    check_in_vocabulary(app, "logit_bias", params.logit_bias.iter().map(|&(t, _)| t))?;
    check_in_vocabulary(app, "stop_token_ids", params.stop_token_ids.iter().copied())?;
    let room = max_len.saturating_sub(prompt_len) as u32;
    let mut params = params.clone();
    if let Some(cap) = app.max_tokens_cap {
        params.max_tokens = params.max_tokens.min(cap);
        params.min_tokens = params.min_tokens.min(cap);
    }
    if params.max_tokens > room {
        if named {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({} \
                     in the {what}, {} in the completion). Please reduce the length of the {what} or completion.",
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

/// The `n` choices of one prompt. With a seed, choice i uses seed + i, so
/// n > 1 still gives n different samples, reproducibly.
pub fn n_choices(
    prompt_ids: &[u32],
    params: &SamplingParams,
    stops: &[String],
    priority: i32,
    n: usize,
) -> Vec<ChoiceSpec> {
    (0..n)
        .map(|i| {
            let mut params = params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            ChoiceSpec {
                prompt_ids: prompt_ids.to_vec(),
                params,
                stops: stops.to_vec(),
                priority,
                skip_special_tokens: true,
            }
        })
        .collect()
}

/// The prompt a conversation becomes: the model's chat template, then the
/// tokenizer, without special tokens for chat (the template writes BOS where
/// the model wants it). `tools` go to the template as transformers passes
/// them. With `max_len`, a rendering too long to fit is refused before
/// tokenizing.
/// The history's reasoning under every name templates read it by: an
/// assistant turn's thinking sent back as `reasoning_content` (vLLM's
/// field, read by Qwen3's and GLM's templates), `reasoning` (newer
/// vLLM's) or `thinking` (read by gpt-oss's) is given under the other names
/// too. gpt-oss's template refuses a tool-calling turn with both content
/// and thinking (its content is the analysis there): that turn is left as is.
fn reasoning_for_templates(messages: &[Value]) -> std::borrow::Cow<'_, [Value]> {
    const NAMES: [&str; 3] = ["reasoning_content", "reasoning", "thinking"];
    fn reasoning_of(m: &Value) -> Option<&str> {
        NAMES.iter().find_map(|n| m.get(*n).and_then(Value::as_str)).filter(|r| !r.is_empty())
    }
    if !messages.iter().any(|m| m["role"] == "assistant" && reasoning_of(m).is_some()) {
        return std::borrow::Cow::Borrowed(messages);
    }
    let filled = messages
        .iter()
        .map(|m| {
            let Some(reasoning) = reasoning_of(m).filter(|_| m["role"] == "assistant") else { return m.clone() };
            let mut m = m.clone();
            let calls_with_content = m.get("tool_calls").and_then(Value::as_array).is_some_and(|c| !c.is_empty())
                && m.get("content").and_then(Value::as_str).is_some_and(|c| !c.is_empty());
            let reasoning = Value::String(reasoning.to_string());
            m["reasoning_content"] = reasoning.clone();
            if !calls_with_content {
                m["thinking"] = reasoning;
            }
            m
        })
        .collect();
    std::borrow::Cow::Owned(filled)
}

pub fn chat_prompt_ids(
    app: &AppState,
    messages: &[Value],
    (tools, template_kwargs): (Option<&[Value]>, Option<&serde_json::Map<String, Value>>),
    add_generation_prompt: bool,
    add_special_tokens: bool,
    max_len: Option<usize>,
) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let template = app.chat_template.as_ref().ok_or_else(|| {
        ApiError::bad_request(
            "This model has no chat template (tokenizer_config.json has no chat_template); use /v1/completions",
        )
    })?;
    let options = RenderOptions { add_generation_prompt, tools, extra: template_kwargs };
    let messages = reasoning_for_templates(messages);
    let text = template.render_with(&messages, &options).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    if let Some(max_len) = max_len {
        check_text_fits(app, "messages", &text, max_len)?;
    }
    app.tokenizer.encode(&text, add_special_tokens).map_err(|e| ApiError::invalid("messages", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Reasoning sent back under any name reaches the template under all
    /// of them, but for gpt-oss's refused shape (a call with content).
    #[test]
    fn reasoning_in_history_is_given_under_every_name() {
        let messages = [
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "Hello", "reasoning_content": "Greet."}),
            json!({"role": "assistant", "content": "Checking.", "reasoning": "Look up.",
                   "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
            json!({"role": "assistant", "content": "x", "thinking": "T."}),
        ];
        let out = reasoning_for_templates(&messages);
        assert_eq!(out[0], messages[0]);
        assert_eq!(
            (out[1]["reasoning_content"].as_str(), out[1]["thinking"].as_str()),
            (Some("Greet."), Some("Greet."))
        );
        assert_eq!((out[2]["reasoning_content"].as_str(), out[2].get("thinking")), (Some("Look up."), None));
        assert_eq!(out[3]["reasoning_content"], "T.");
        let plain = [json!({"role": "user", "content": "hi"})];
        assert!(matches!(reasoning_for_templates(&plain), std::borrow::Cow::Borrowed(_)));
    }
}
