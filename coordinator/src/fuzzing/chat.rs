//! Fuzz target: chat-template rendering. Real templates (tiny-qwen3's own,
//! and Qwen2.5 with tools, Llama 2 and Llama 3.1 as the template tests
//! check them against Jinja2) render arbitrary conversations: any roles,
//! content of any JSON type, tool calls, tools and template variables.
//!
//! The input is one byte choosing the template, then a JSON object
//! `{"messages", "tools", "add_generation_prompt", "chat_template_kwargs"}`
//! (or just the messages array); other bytes are not a conversation and
//! are skipped, as the HTTP layer refuses them before rendering.
//!
//! Invariants: no panic; a conversation is refused as an invalid message
//! exactly when a message is not an object with a string `role` and text
//! content (a string, null, or a list of text parts); text that renders
//! for tiny-qwen3 tokenizes, as the chat endpoint then does.

use serde_json::{Map, Value};

use super::{MODELS, fixtures};
use crate::text::{RenderOptions, TemplateError};

/// One fuzz case: a template index and the request's JSON.
pub struct ChatInput {
    pub template: u8,
    pub body: Value,
}

impl ChatInput {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![self.template];
        out.extend(self.body.to_string().into_bytes());
        out
    }
}

/// Renders one input and checks every invariant.
pub fn chat_template(data: &[u8]) {
    let Some((&choice, json)) = data.split_first() else { return };
    let Ok(body) = serde_json::from_slice::<Value>(json) else { return };
    let fixtures = fixtures();
    let index = choice as usize % fixtures.templates.len();
    let (name, template) = &fixtures.templates[index];
    let empty = Map::new();
    let (messages, tools, add_generation_prompt, extra) = match &body {
        Value::Array(messages) => (messages.as_slice(), None, choice & 0x80 != 0, &empty),
        Value::Object(fields) => (
            fields.get("messages").and_then(Value::as_array).map_or(&[][..], Vec::as_slice),
            fields.get("tools").and_then(Value::as_array).map(Vec::as_slice),
            fields.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(false),
            fields.get("chat_template_kwargs").and_then(Value::as_object).unwrap_or(&empty),
        ),
        _ => return,
    };
    let options = RenderOptions { add_generation_prompt, tools, extra: Some(extra) };
    let result = template.render_with(messages, &options);
    let malformed = messages.iter().position(|m| !well_formed(m));
    match (&result, malformed) {
        (Err(TemplateError::InvalidMessage(_)), Some(_)) => {}
        (Err(TemplateError::InvalidMessage(e)), None) => panic!("{name}: well-formed messages refused: {e}"),
        (_, Some(i)) => panic!("{name}: messages[{i}] is malformed but was not refused: {result:?}"),
        (_, None) => {}
    }
    if let (Ok(text), "tiny-qwen3") = (&result, name.as_str()) {
        let tokenizer = &fixtures.tokenizers[MODELS.len() - 1];
        if let Err(e) = tokenizer.encode(text, false) {
            panic!("{name}: rendered text does not tokenize: {e}");
        }
    }
}

/// The shape the chat endpoint accepts, written independently of
/// `chat_template::normalize_message`.
fn well_formed(message: &Value) -> bool {
    let Some(fields) = message.as_object() else { return false };
    if !fields.get("role").is_some_and(Value::is_string) {
        return false;
    }
    match fields.get("content") {
        None | Some(Value::Null | Value::String(_)) => true,
        Some(Value::Array(parts)) => parts
            .iter()
            .all(|p| p.get("type") == Some(&Value::from("text")) && p.get("text").is_some_and(Value::is_string)),
        Some(_) => false,
    }
}
