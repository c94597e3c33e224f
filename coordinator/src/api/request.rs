//! Request bodies of `/generate`, `/v1/completions` and
//! `/v1/chat/completions`, and their translation into sampling parameters.
//! Numbers are read wide (i64/f64) so that out-of-range values get a clear
//! 400 naming the parameter instead of a serde type error.

use common::SamplingParams;
use common::sampling::rules;
use serde::Deserialize;

use super::error::ApiError;
use super::structured::StructuredFields;

/// `stop`: a string or a list of strings.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// Sampling fields shared by every endpoint (vLLM's extra fields included).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub min_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub stop_token_ids: Option<Vec<u32>>,
    /// OpenAI's map of token id (a string) to a bias in [-100, 100].
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Speculative decoding for this request (the worker's setting if absent).
    pub speculative: Option<SpeculativeField>,
    /// vLLM's scheduling priority: lower runs first (default 0). It counts
    /// on workers started with `--scheduling-policy priority`.
    pub priority: Option<i64>,
    /// `response_format`, `structured_outputs` and `guided_*` (see `structured`).
    #[serde(flatten)]
    pub structured: StructuredFields,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Largest `n` accepted.
pub const MAX_N: i64 = 16;
pub const MAX_STOP_STRINGS: usize = 16;
/// A stop string longer than this is refused: the stop-string matcher holds
/// back that much text, and no reasonable stop is longer.
pub const MAX_STOP_BYTES: usize = 4096;

impl SamplingFields {
    /// Checks ranges and builds the worker's parameters. `default_max_tokens`
    /// applies when the request gives none; `logprobs` is the top-n asked for.
    pub fn to_params(&self, default_max_tokens: u32, logprobs: Option<u32>) -> Result<SamplingParams, ApiError> {
        if self.stream_options.is_some() && !self.stream() {
            return Err(ApiError::invalid("stream_options", "stream_options can only be given when stream is true"));
        }
        // Every range is `common::sampling::rules`'; values are checked as
        // written (wide), before they narrow to the carried types.
        let max_tokens = self.max_tokens.or(self.max_completion_tokens);
        if let Some(m) = max_tokens {
            rules::check_int("max_tokens", rules::MAX_TOKENS, m)?;
        }
        let max_tokens = max_tokens.map_or(default_max_tokens, |m| m as u32);
        let min_tokens = self.min_tokens.unwrap_or(0);
        rules::check_min_tokens(min_tokens, max_tokens)?;
        let top_k = self.top_k.unwrap_or(0);
        rules::check_top_k(top_k)?;
        let number = |name: &'static str, range: rules::Range, value: Option<f64>, default: f64| {
            let value = value.unwrap_or(default);
            rules::check(name, range, value).map(|()| value as f32)
        };
        let mut logit_bias = Vec::new();
        for (key, &bias) in self.logit_bias.iter().flatten() {
            let id = key.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid("logit_bias", format!("logit_bias keys must be token ids, got {key:?}"))
            })?;
            rules::check_logit_bias(id, bias)?;
            logit_bias.push((id, bias as f32));
        }
        logit_bias.sort_unstable_by_key(|&(id, _)| id);
        let params = SamplingParams {
            temperature: number("temperature", rules::TEMPERATURE, self.temperature, 1.0)?,
            top_p: number("top_p", rules::TOP_P, self.top_p, 1.0)?,
            top_k: top_k.max(0) as u32,
            min_p: number("min_p", rules::MIN_P, self.min_p, 0.0)?,
            repetition_penalty: number("repetition_penalty", rules::REPETITION_PENALTY, self.repetition_penalty, 1.0)?,
            presence_penalty: number("presence_penalty", rules::PENALTY, self.presence_penalty, 0.0)?,
            frequency_penalty: number("frequency_penalty", rules::PENALTY, self.frequency_penalty, 0.0)?,
            // Negative seeds wrap: any i64 names one stream.
            seed: self.seed.map(|s| s as u64),
            max_tokens,
            min_tokens: min_tokens as u32,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            // Set by the endpoints that score prompts (`echo` with `logprobs`, `/generate`).
            prompt_logprobs: None,
            logit_bias,
            // Set by the endpoints from `response_format`, `guided_*` or `tool_choice`.
            structured_output: None,
            speculative: self.speculative.as_ref().map(SpeculativeField::to_param).transpose()?,
        };
        // The rest of the rules (duplicate biases, the speculative count).
        params.validate()?;
        Ok(params)
    }

    /// The request's scheduling priority (0 when not given).
    pub fn priority(&self) -> Result<i32, ApiError> {
        let priority = self.priority.unwrap_or(0);
        rules::check_int("priority", rules::PRIORITY, priority)?;
        Ok(priority as i32)
    }

    pub fn stop_strings(&self) -> Result<Vec<String>, ApiError> {
        let stops = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOP_STRINGS} stop strings, got {}", stops.len()),
            ));
        }
        if stops.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid(
                "stop",
                format!("each stop string must be at most {MAX_STOP_BYTES} bytes, got {}", long.len()),
            ));
        }
        Ok(stops)
    }

    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=MAX_N).contains(&n) => Ok(n as usize),
            Some(n) => Err(ApiError::invalid("n", format!("n must be in [1, {MAX_N}], got {n}"))),
        }
    }

    /// Whether the request names its completion length itself.
    pub fn names_max_tokens(&self) -> bool {
        self.max_tokens.or(self.max_completion_tokens).is_some()
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }
}

/// OpenAI fields this server does not implement, read so that a request
/// relying on one gets a 400 naming it rather than an answer without it.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct UnservedFields {
    pub tools: Option<Vec<serde_json::Value>>,
    pub functions: Option<Vec<serde_json::Value>>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

impl UnservedFields {
    /// Refuses what would change the answer; an empty tool list and
    /// `best_of == n` are what every answer here already is.
    pub fn check(&self, n: usize) -> Result<(), ApiError> {
        for (param, list, why) in [
            ("tools", &self.tools, "tools (tool calling) are served on /v1/chat/completions only"),
            (
                "functions",
                &self.functions,
                "functions (OpenAI's deprecated function calling) are not supported; use tools",
            ),
        ] {
            if list.as_ref().is_some_and(|l| !l.is_empty()) {
                return Err(ApiError::invalid(param, why));
            }
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix is not supported by this server"));
        }
        match self.best_of {
            None => Ok(()),
            Some(b) if b == n as i64 => Ok(()),
            Some(b) => Err(ApiError::invalid(
                "best_of",
                format!("best_of other than n is not supported by this server (best_of {b}, n {n})"),
            )),
        }
    }
}

/// A prompt: text, token ids, or (completions only) a list of either.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptInput,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub unserved: UnservedFields,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<serde_json::Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Tool calling (see `api::tool_calls`); read here, so `unserved` never sees them.
    pub tools: Option<Vec<serde_json::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's: extra variables for the chat template (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// OpenAI's: how hard a reasoning model thinks (see [`reasoning_effort_kwargs`]).
    pub reasoning_effort: Option<serde_json::Value>,
    #[serde(flatten)]
    pub unserved: UnservedFields,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// A reasoning effort (chat's `reasoning_effort`, Responses' `reasoning.effort`)
/// as the chat templates take it: `none` switches thinking off
/// (`enable_thinking: false`, Qwen3's and GLM's); any other level is
/// `reasoning_effort` (gpt-oss's). Variables `kwargs` already sets win.
pub fn reasoning_effort_kwargs(
    param: &str,
    effort: &serde_json::Value,
    kwargs: &mut Option<serde_json::Map<String, serde_json::Value>>,
) -> Result<(), super::error::ApiError> {
    const LEVELS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];
    let Some(level) = effort.as_str().filter(|l| LEVELS.contains(l)) else {
        return Err(super::error::ApiError::invalid(
            param,
            format!("{param} must be one of none, minimal, low, medium, high, xhigh; got {effort}"),
        ));
    };
    let kwargs = kwargs.get_or_insert_with(Default::default);
    match level {
        "none" => kwargs.entry("enable_thinking").or_insert(serde_json::Value::Bool(false)),
        level => kwargs.entry("reasoning_effort").or_insert(serde_json::Value::from(level)),
    };
    Ok(())
}

/// `POST /generate`: the simple API.
#[derive(Clone, Debug, Deserialize)]
pub struct GenerateRequest {
    pub prompt: Option<String>,
    pub prompt_token_ids: Option<Vec<u32>>,
    pub logprobs: Option<i64>,
    /// vLLM's: each prompt token's logprob (after the first) plus this many top ones.
    pub prompt_logprobs: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `"speculative": {"method": "ngram" | "draft" | "off",
/// "num_speculative_tokens": k}`, in the words of vLLM's
/// `speculative_config` (vLLM sets it per server; here any request may).
/// `draft` needs a worker started with a draft model.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeField {
    pub method: Option<String>,
    pub num_speculative_tokens: Option<serde_json::Value>,
}

impl SpeculativeField {
    pub fn to_param(&self) -> Result<common::Speculative, ApiError> {
        let k = match &self.num_speculative_tokens {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let param = "speculative.num_speculative_tokens";
                let k = v.as_i64().ok_or_else(|| {
                    ApiError::invalid(param, format!("num_speculative_tokens must be an integer, got {v}"))
                })?;
                rules::check_int(param, rules::SPECULATIVE_TOKENS, k)?;
                Some(k as u8)
            }
        };
        match self.method.as_deref() {
            Some("off") if k.is_some() => Err(ApiError::invalid(
                "speculative.num_speculative_tokens",
                "num_speculative_tokens needs method \"ngram\" or \"draft\"",
            )),
            Some("off") => Ok(common::Speculative::Off),
            Some("ngram") | None => Ok(common::Speculative::Ngram { num_speculative_tokens: k }),
            Some("draft") => Ok(common::Speculative::Draft { num_speculative_tokens: k }),
            Some(other) => Err(ApiError::invalid(
                "speculative.method",
                format!("speculative method must be \"ngram\", \"draft\" or \"off\", got {other:?}"),
            )),
        }
    }
}

/// `POST /tokenize`: `prompt` (special tokens added by default) or chat
/// `messages` (through the template, generation prompt added and special
/// tokens not, by default, as chat generation does).
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<serde_json::Value>>,
    /// Chat tools, rendered by the template as chat completions renders them.
    pub tools: Option<Vec<serde_json::Value>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub return_token_strs: Option<bool>,
    /// vLLM's: extra variables for the chat template (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `POST /detokenize`.
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// `logprobs` as top-n: 0..=20.
pub fn top_n(param: &'static str, n: Option<i64>) -> Result<Option<u32>, ApiError> {
    match n {
        None => Ok(None),
        Some(n) => {
            rules::check_int(param, rules::LOGPROBS, n)?;
            Ok(Some(n as u32))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn ranges_are_checked_with_the_param_named() {
        for (json, param) in [
            (r#"{"max_tokens": -1}"#, "max_tokens"),
            (r#"{"temperature": -0.5}"#, "temperature"),
            (r#"{"temperature": 1e308}"#, "temperature"),
            (r#"{"temperature": 2.5}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"presence_penalty": 3}"#, "presence_penalty"),
            (r#"{"logit_bias": {"50": 101}}"#, "logit_bias"),
            (r#"{"stream_options": {"include_usage": true}}"#, "stream_options"),
            (r#"{"logit_bias": {"fifty": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"50": 1, " 50": 2}}"#, "logit_bias"),
        ] {
            let err = fields(json).to_params(16, None).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{json}");
            assert_eq!(err.status, hyper::StatusCode::BAD_REQUEST);
        }
        assert_eq!(fields(r#"{"n": 0}"#).n().unwrap_err().param.as_deref(), Some("n"));
        assert!(top_n("logprobs", Some(21)).is_err());
    }

    #[test]
    fn every_range_message_names_its_range() {
        for (json, range) in [
            (r#"{"max_tokens": 0}"#, "[1, 4294967295]"),
            (r#"{"max_tokens": 5, "min_tokens": 6}"#, "[0, max_tokens]"),
            (r#"{"temperature": 1e308}"#, "[0, 2]"),
            (r#"{"top_p": 2}"#, "(0, 1]"),
            (r#"{"top_k": -2}"#, "[1, 4294967295]"),
            (r#"{"min_p": -1}"#, "[0, 1]"),
            (r#"{"presence_penalty": 2.5}"#, "[-2, 2]"),
            (r#"{"frequency_penalty": -9}"#, "[-2, 2]"),
            (r#"{"repetition_penalty": 11}"#, "(0, 10]"),
            (r#"{"logit_bias": {"5": -101}}"#, "[-100, 100]"),
        ] {
            let err = fields(json).to_params(16, None).unwrap_err();
            assert!(err.message.contains(range), "{json}: {}", err.message);
        }
        assert!(fields(r#"{"n": 17}"#).n().unwrap_err().message.contains("[1, 16]"));
        assert!(top_n("logprobs", Some(-1)).unwrap_err().message.contains("[0, 20]"));
        // The value is shown as written, not as 309 digits.
        let err = fields(r#"{"temperature": 1e308}"#).to_params(16, None).unwrap_err();
        assert!(err.message.ends_with("got 1e308"), "{}", err.message);
    }

    #[test]
    fn fields_this_server_lacks_are_refused_by_name() {
        let unserved = |json: &str| serde_json::from_str::<UnservedFields>(json).unwrap();
        for (json, param) in [
            (r#"{"tools": [{"type": "function", "function": {"name": "f"}}]}"#, "tools"),
            (r#"{"functions": [{"name": "f"}]}"#, "functions"),
            (r#"{"suffix": "end"}"#, "suffix"),
            (r#"{"best_of": 3}"#, "best_of"),
        ] {
            let err = unserved(json).check(1).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{json}");
        }
        for json in [r#"{"tools": []}"#, r#"{"suffix": ""}"#, r#"{"best_of": 2}"#] {
            assert!(unserved(json).check(2).is_ok(), "{json}");
        }
    }

    #[test]
    fn defaults_follow_openai() {
        let p = fields("{}").to_params(16, None).unwrap();
        assert_eq!((p.max_tokens, p.temperature, p.top_p, p.top_k), (16, 1.0, 1.0, 0));
        let p = fields(r#"{"top_k": -1, "seed": 7, "stop": "x"}"#).to_params(16, None).unwrap();
        assert_eq!((p.top_k, p.seed), (0, Some(7)));
        let p = fields(r#"{"logit_bias": {"9": -100, "3": 2.5}}"#).to_params(16, None).unwrap();
        assert_eq!(p.logit_bias, vec![(3, 2.5), (9, -100.0)]);
        assert_eq!(fields(r#"{"stop": ["a", "b"]}"#).stop_strings().unwrap(), vec!["a", "b"]);
        assert_eq!(fields("{}").priority().unwrap(), 0);
        assert_eq!(fields(r#"{"priority": -5}"#).priority().unwrap(), -5);
        let err = fields(r#"{"priority": 4294967296}"#).priority().unwrap_err();
        assert_eq!((err.param.as_deref(), err.status), (Some("priority"), hyper::StatusCode::BAD_REQUEST));
    }

    #[test]
    fn reasoning_effort_becomes_template_variables() {
        let mut kwargs = None;
        reasoning_effort_kwargs("reasoning_effort", &serde_json::json!("high"), &mut kwargs).unwrap();
        assert_eq!(kwargs.as_ref().unwrap()["reasoning_effort"], "high");
        let mut kwargs = Some(serde_json::json!({"enable_thinking": true}).as_object().unwrap().clone());
        reasoning_effort_kwargs("reasoning_effort", &serde_json::json!("none"), &mut kwargs).unwrap();
        assert_eq!(kwargs.unwrap()["enable_thinking"], true, "the request's own variables win");
        let err = reasoning_effort_kwargs("reasoning.effort", &serde_json::json!("max"), &mut None).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("reasoning.effort"));
    }
}
