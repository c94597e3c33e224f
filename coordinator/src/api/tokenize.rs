//! `POST /tokenize` and `POST /detokenize` (vLLM's): a prompt, or chat
//! messages through the template, to the ids the engine would see; and ids
//! back to text.

use serde::Serialize;

use super::error::ApiError;
use super::prepare::{chat_prompt_ids, check_in_vocabulary, check_model, parse};
use super::reply::Reply;
use super::request::{DetokenizeRequest, TokenizeRequest};
use crate::app::AppState;

#[derive(Serialize)]
struct Tokenized {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
    /// `null` unless `return_token_strs` asked for them.
    token_strs: Option<Vec<String>>,
}

#[derive(Serialize)]
struct Detokenized {
    prompt: String,
}

/// `POST /tokenize`.
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
    let token_strs =
        req.return_token_strs.unwrap_or(false).then(|| ids.iter().map(|&id| app.tokenizer.token_text(id)).collect());
    Ok(Reply::json(&Tokenized { count: ids.len(), max_model_len: app.max_model_len, tokens: ids, token_strs }))
}

/// `POST /detokenize`: ids to text, special tokens kept.
pub fn detokenize(app: &AppState, body: &[u8]) -> Result<Reply, ApiError> {
    let req: DetokenizeRequest = parse(body)?;
    check_model(app, req.model.as_deref())?;
    check_in_vocabulary(app, "tokens", req.tokens.iter().copied())?;
    Ok(Reply::json(&Detokenized { prompt: app.tokenizer.decode(&req.tokens, false) }))
}
