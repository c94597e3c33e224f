//! `POST /tokenize` and `POST /detokenize` (vLLM's): a prompt, or chat
//! messages through the template, to the ids the engine would see; and ids
//! back to text.

use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use super::error::ApiError;
use super::prepare::{chat_prompt_ids, check_in_vocabulary, check_model};
use super::reply::Reply;
use super::request::{DetokenizeRequest, TokenizeRequest};
use super::validate::{self, Kind as Shape};
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

/// `POST /tokenize`, on the blocking pool. No length limit (as vLLM's):
/// it counts a prompt's tokens, long or not.
pub async fn tokenize(app: &Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    app.offload(body.len(), move |app| tokenize_body(app, &body)).await
}

fn tokenize_body(app: &AppState, body: &[u8]) -> Result<Reply, ApiError> {
    let fields = [
        ("model", Shape::String),
        ("prompt", Shape::String),
        ("messages", Shape::Messages),
        ("tools", Shape::Array),
        ("add_special_tokens", Shape::Bool),
        ("add_generation_prompt", Shape::Bool),
        ("return_token_strs", Shape::Bool),
        ("chat_template_kwargs", Shape::Object),
    ];
    let req: TokenizeRequest = validate::parse(body, &[], &fields, &[])?;
    check_model(app, req.model.as_deref())?;
    let ids = match (&req.prompt, &req.messages) {
        (Some(text), None) => app
            .tokenizer
            .encode(text, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        (None, Some(messages)) => chat_prompt_ids(
            app,
            messages,
            (req.tools.as_deref(), req.chat_template_kwargs.as_ref()),
            req.add_generation_prompt.unwrap_or(true),
            req.add_special_tokens.unwrap_or(false),
            None,
        )?,
        (Some(_), Some(_)) => return Err(ApiError::invalid("prompt", "give prompt or messages, not both")),
        (None, None) => return Err(ApiError::invalid("prompt", "prompt or messages is required")),
    };
    let token_strs =
        req.return_token_strs.unwrap_or(false).then(|| ids.iter().map(|&id| app.tokenizer.token_piece(id)).collect());
    Ok(Reply::json(&Tokenized { count: ids.len(), max_model_len: app.max_model_len(), tokens: ids, token_strs }))
}

/// `POST /detokenize`: ids to text, special tokens kept (on the blocking pool).
pub async fn detokenize(app: &Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    app.offload(body.len(), move |app| detokenize_body(app, &body)).await
}

fn detokenize_body(app: &AppState, body: &[u8]) -> Result<Reply, ApiError> {
    let fields = [("model", Shape::String), ("tokens", Shape::TokenIds)];
    let req: DetokenizeRequest = validate::parse(body, &["tokens"], &fields, &[])?;
    check_model(app, req.model.as_deref())?;
    check_in_vocabulary(app, "tokens", req.tokens.iter().copied())?;
    Ok(Reply::json(&Detokenized { prompt: app.tokenizer.decode(&req.tokens, false) }))
}
