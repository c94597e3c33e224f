//! The shape of a request body, checked before it is read into the request
//! types: every known field is tested for its JSON type (and list fields
//! for their size), so a wrong value gets a 400 that names the field and
//! what it must be, rather than serde's message about an untagged enum or
//! a flattened struct. Only shapes and sizes are checked here: every range
//! and rule on values is checked once, afterwards (`request`, which applies
//! `common::sampling::rules`, and `prepare`).

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::ApiError;

/// What a field must hold. `null` always means "not given".
#[derive(Clone, Copy)]
pub enum Kind {
    /// A JSON integer that fits in 64 bits.
    Int,
    Number,
    Bool,
    String,
    Object,
    Array,
    /// Anything (checked later, or ignored).
    Any,
    /// A list of token ids.
    TokenIds,
    /// A string or a list of strings.
    Stop,
    /// A map of token id (a string) to a number.
    LogitBias,
    /// Completions' prompt: text, texts, token ids, or lists of token ids.
    Prompt,
    /// Chat messages.
    Messages,
    /// `{"include_usage": bool}`.
    StreamOptions,
}

/// Sampling fields every generating endpoint reads (`SamplingFields`).
pub const SAMPLING: &[(&str, Kind)] = &[
    ("model", Kind::String),
    ("max_tokens", Kind::Int),
    ("max_completion_tokens", Kind::Int),
    ("min_tokens", Kind::Int),
    ("temperature", Kind::Number),
    ("top_p", Kind::Number),
    ("top_k", Kind::Int),
    ("min_p", Kind::Number),
    ("presence_penalty", Kind::Number),
    ("frequency_penalty", Kind::Number),
    ("repetition_penalty", Kind::Number),
    ("seed", Kind::Int),
    ("stop", Kind::Stop),
    ("stop_token_ids", Kind::TokenIds),
    ("logit_bias", Kind::LogitBias),
    ("ignore_eos", Kind::Bool),
    ("n", Kind::Int),
    ("stream", Kind::Bool),
    ("stream_options", Kind::StreamOptions),
    ("speculative", Kind::Object),
    ("priority", Kind::Int),
    // Structured outputs: shapes checked where they are read (`structured`).
    ("response_format", Kind::Any),
    ("structured_outputs", Kind::Any),
    ("guided_json", Kind::Any),
    ("guided_regex", Kind::Any),
    ("guided_choice", Kind::Any),
    ("guided_grammar", Kind::Any),
    // Read only to be refused by name (`UnservedFields`).
    ("tools", Kind::Array),
    ("functions", Kind::Array),
    ("suffix", Kind::String),
    ("best_of", Kind::Int),
];

/// More entries than this is abuse (OpenAI allows 300).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// OpenAI's roles (vLLM passes others to the template; OpenAI refuses them).
const ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "function"];

/// Parses `body` as a JSON object, checks `fields` (and those of `also`),
/// requires `required`, and reads it as `T`.
pub fn parse<T: DeserializeOwned>(
    body: &[u8],
    required: &[&str],
    fields: &[(&str, Kind)],
    also: &[(&str, Kind)],
) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid JSON in the request body: {e}")))?;
    let Value::Object(map) = value else {
        return Err(ApiError::bad_request(format!(
            "The request body must be a JSON object, got {}",
            type_name(&value)
        )));
    };
    for name in required {
        if map.get(*name).is_none_or(Value::is_null) {
            return Err(ApiError::invalid(*name, format!("{name} is required")));
        }
    }
    for (name, kind) in fields.iter().chain(also) {
        if let Some(value) = map.get(*name).filter(|v| !v.is_null()) {
            check(name, *kind, value)?;
        }
    }
    serde_json::from_value(Value::Object(map)).map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `v` as shown in a message: short values whole, long ones by their type.
fn shown(v: &Value) -> String {
    let text = v.to_string();
    if text.len() <= 40 { text } else { type_name(v).to_string() }
}

fn is_token_id(v: &Value) -> bool {
    v.as_u64().is_some_and(|id| id <= u64::from(u32::MAX))
}

fn check(name: &str, kind: Kind, v: &Value) -> Result<(), ApiError> {
    let wrong = |what: &str| Err(ApiError::invalid(name, format!("{name} must be {what}, got {}", shown(v))));
    match kind {
        Kind::Int if v.as_i64().is_none() => wrong("an integer (64-bit)"),
        Kind::Number if !v.is_number() => wrong("a number"),
        Kind::Bool if !v.is_boolean() => wrong("a boolean"),
        Kind::String if !v.is_string() => wrong("a string"),
        Kind::Object if !v.is_object() => wrong("an object"),
        Kind::Array if !v.is_array() => wrong("an array"),
        Kind::TokenIds => match v.as_array() {
            Some(ids) if ids.iter().all(is_token_id) => Ok(()),
            _ => wrong("a list of token ids (integers in [0, 4294967295])"),
        },
        Kind::Stop => check_stop(name, v),
        Kind::LogitBias => check_logit_bias(name, v),
        Kind::Prompt => check_prompt(name, v),
        Kind::Messages => check_messages(name, v),
        Kind::StreamOptions => match v.as_object().map(|o| o.get("include_usage")) {
            None => wrong("an object"),
            Some(None | Some(Value::Null | Value::Bool(_))) => Ok(()),
            Some(Some(other)) => {
                Err(ApiError::invalid(name, format!("{name}.include_usage must be a boolean, got {}", shown(other))))
            }
        },
        _ => Ok(()),
    }
}

fn check_stop(name: &str, v: &Value) -> Result<(), ApiError> {
    let is_strings = match v {
        Value::String(_) => true,
        Value::Array(list) => list.iter().all(Value::is_string),
        _ => false,
    };
    if is_strings {
        Ok(())
    } else {
        Err(ApiError::invalid(name, format!("{name} must be a string or a list of strings")))
    }
}

fn check_logit_bias(name: &str, v: &Value) -> Result<(), ApiError> {
    let Some(map) = v.as_object() else {
        return Err(ApiError::invalid(name, format!("{name} must be an object mapping token ids to biases")));
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            name,
            format!("{name} may hold at most {MAX_LOGIT_BIAS} entries, got {}", map.len()),
        ));
    }
    match map.iter().find(|(_, bias)| !bias.is_number()) {
        Some((token, bias)) => Err(ApiError::invalid(
            name,
            format!("{name} values must be numbers in [-100, 100], got {} for {token:?}", shown(bias)),
        )),
        None => Ok(()),
    }
}

fn check_prompt(name: &str, v: &Value) -> Result<(), ApiError> {
    let shape = || {
        ApiError::invalid(
            name,
            format!(
                "{name} must be a string, a list of strings, a list of token ids or a list of token-id lists \
                 (token ids are integers in [0, 4294967295])"
            ),
        )
    };
    let list = match v {
        Value::String(_) => return Ok(()),
        Value::Array(list) => list,
        _ => return Err(shape()),
    };
    let Some(first) = list.first() else { return Err(ApiError::invalid(name, "the prompt list is empty")) };
    let ok = match first {
        Value::String(_) => list.iter().all(Value::is_string),
        Value::Number(_) => list.iter().all(is_token_id),
        Value::Array(_) => {
            let lists: Option<Vec<&Vec<Value>>> = list.iter().map(Value::as_array).collect();
            let Some(lists) = lists else { return Err(shape()) };
            if lists.iter().any(|l| l.is_empty()) {
                return Err(ApiError::invalid(name, "a prompt's token list is empty"));
            }
            lists.iter().all(|l| l.iter().all(is_token_id))
        }
        _ => false,
    };
    if ok { Ok(()) } else { Err(shape()) }
}

fn check_messages(name: &str, v: &Value) -> Result<(), ApiError> {
    let Some(messages) = v.as_array() else {
        return Err(ApiError::invalid(name, format!("{name} must be an array of message objects")));
    };
    if messages.is_empty() {
        return Err(ApiError::invalid(name, format!("{name} must not be empty")));
    }
    for (i, m) in messages.iter().enumerate() {
        let invalid = |what: String| Err(ApiError::invalid(name, format!("{name}[{i}]{what}")));
        let Some(m) = m.as_object() else { return invalid(" must be an object".into()) };
        match m.get("role") {
            Some(Value::String(role)) if ROLES.contains(&role.as_str()) => {}
            Some(Value::String(role)) => {
                return invalid(format!(".role must be one of {}; got {role:?}", ROLES.join(", ")));
            }
            Some(other) => return invalid(format!(".role must be a string, got {}", shown(other))),
            None => return invalid(" has no role".into()),
        }
        if let Some(content) = m.get("content")
            && !matches!(content, Value::String(_) | Value::Array(_) | Value::Null)
        {
            return invalid(format!(
                ".content must be a string, a list of content parts or null, got {}",
                shown(content)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str, fields: &[(&str, Kind)]) -> ApiError {
        parse::<Value>(body.as_bytes(), &["prompt"], fields, &[]).unwrap_err()
    }

    #[test]
    fn each_wrong_shape_is_named() {
        let f = &[
            ("prompt", Kind::Prompt),
            ("n", Kind::Int),
            ("stop", Kind::Stop),
            ("messages", Kind::Messages),
            ("logit_bias", Kind::LogitBias),
        ];
        for (body, param, word) in [
            (r#"{"prompt": 1}"#, "prompt", "token-id lists"),
            (r#"{"prompt": []}"#, "prompt", "empty"),
            (r#"{"prompt": [[1], []]}"#, "prompt", "empty"),
            (r#"{"prompt": [1, "a"]}"#, "prompt", "token-id"),
            (r#"{"prompt": [4294967296]}"#, "prompt", "token"),
            (r#"{"prompt": "a", "n": 1.5}"#, "n", "integer"),
            (r#"{"prompt": "a", "n": 1e300}"#, "n", "integer"),
            (r#"{"prompt": "a", "stop": [1]}"#, "stop", "strings"),
            (r#"{"prompt": "a", "messages": [{"role": "x"}]}"#, "messages", "\"x\""),
            (r#"{"prompt": "a", "messages": [{"role": "user", "content": 1}]}"#, "messages", "content"),
            (r#"{"prompt": "a", "logit_bias": {"1": true}}"#, "logit_bias", "number"),
            (r#"{}"#, "prompt", "required"),
        ] {
            let e = err(body, f);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert!(e.message.contains(word), "{body}: {}", e.message);
        }
        for body in ["[]", "3", "{", r#"{"a": 1} x"#] {
            assert_eq!(err(body, f).status, hyper::StatusCode::BAD_REQUEST, "{body}");
        }
        let ok: Value = parse(br#"{"prompt": [[1, 2], [3]], "n": null, "stop": "x"}"#, &["prompt"], f, &[]).unwrap();
        assert_eq!(ok["prompt"][1][0], 3);
    }

    #[test]
    fn deep_nesting_is_a_400_not_a_stack_overflow() {
        let body = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(err(&body, &[]).status, hyper::StatusCode::BAD_REQUEST);
    }
}
