//! Request bodies of `/generate`, `/v1/completions` and
//! `/v1/chat/completions`, and their translation into sampling parameters.
//! Numbers are read wide (i64/f64) so that out-of-range values get a clear
//! 400 naming the parameter instead of a serde type error.

use common::SamplingParams;
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
pub use super::validate::MAX_STOP_STRINGS;
/// OpenAI's temperature range.
pub const MAX_TEMPERATURE: f64 = 2.0;

impl SamplingFields {
    /// Checks ranges and builds the worker's parameters. `default_max_tokens`
    /// applies when the request gives none; `logprobs` is the top-n asked for.
    pub fn to_params(&self, default_max_tokens: u32, logprobs: Option<u32>) -> Result<SamplingParams, ApiError> {
        let max_tokens = self.max_tokens.or(self.max_completion_tokens);
        let max_tokens = match max_tokens {
            None => default_max_tokens,
            Some(m) if m >= 1 && m <= u32::MAX as i64 => m as u32,
            Some(m) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("max_tokens must be in [1, {}], got {m}", u32::MAX),
                ));
            }
        };
        let min_tokens = match self.min_tokens {
            None => 0,
            Some(m) if m >= 0 && m <= max_tokens as i64 => m as u32,
            Some(m) => {
                return Err(ApiError::invalid("min_tokens", format!("min_tokens must be in [0, max_tokens], got {m}")));
            }
        };
        if self.stream_options.is_some() && !self.stream() {
            return Err(ApiError::invalid("stream_options", "stream_options can only be given when stream is true"));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be in [0, {MAX_TEMPERATURE}], got {temperature:?}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid("top_p", format!("top_p must be in (0, 1], got {top_p:?}")));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 && k <= u32::MAX as i64 => k as u32,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1 or 0 (off), or in [1, {}], got {k}", u32::MAX),
                ));
            }
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid("min_p", format!("min_p must be in [0, 1], got {min_p:?}")));
        }
        let penalty = |name: &str, v: Option<f64>| -> Result<f32, ApiError> {
            let v = v.unwrap_or(0.0);
            if (-2.0..=2.0).contains(&v) {
                Ok(v as f32)
            } else {
                Err(ApiError::invalid(name, format!("{name} must be in [-2, 2], got {v:?}")))
            }
        };
        let repetition_penalty = self.repetition_penalty.unwrap_or(1.0);
        if !(repetition_penalty > 0.0 && repetition_penalty <= 10.0) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("repetition_penalty must be in (0, 10], got {repetition_penalty:?}"),
            ));
        }
        let mut logit_bias = Vec::new();
        for (key, &bias) in self.logit_bias.iter().flatten() {
            let id = key.trim().parse::<u32>().map_err(|_| {
                ApiError::invalid("logit_bias", format!("logit_bias keys must be token ids, got {key:?}"))
            })?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias values must be in [-100, 100], got {bias:?} for token {id}"),
                ));
            }
            logit_bias.push((id, bias as f32));
        }
        logit_bias.sort_unstable_by_key(|&(id, _)| id);
        if let Some(w) = logit_bias.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ApiError::invalid("logit_bias", format!("token {} is biased twice", w[0].0)));
        }
        // Negative seeds wrap: any i64 names one stream.
        let seed = self.seed.map(|s| s as u64);
        Ok(SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            min_p: min_p as f32,
            repetition_penalty: repetition_penalty as f32,
            presence_penalty: penalty("presence_penalty", self.presence_penalty)?,
            frequency_penalty: penalty("frequency_penalty", self.frequency_penalty)?,
            seed,
            max_tokens,
            min_tokens,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            // Set by the endpoints that score prompts (`echo` with `logprobs`, `/generate`).
            prompt_logprobs: None,
            logit_bias,
            // Set by the endpoints from `response_format`, `guided_*` or `tool_choice`.
            structured_output: None,
            speculative: self.speculative.as_ref().map(SpeculativeField::to_param).transpose()?,
        })
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
    /// Tool calling (see `api::tools`); read here, so `unserved` never sees them.
    pub tools: Option<Vec<serde_json::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub unserved: UnservedFields,
    #[serde(flatten)]
    pub sampling: SamplingFields,
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
                let max = common::MAX_SPECULATIVE_TOKENS;
                let k = v.as_u64().filter(|k| (1..=max as u64).contains(k)).ok_or_else(|| {
                    ApiError::invalid(
                        "speculative.num_speculative_tokens",
                        format!("num_speculative_tokens must be an integer in [1, {max}], got {v}"),
                    )
                })?;
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
}

/// `POST /detokenize`.
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// `logprobs` as top-n: 0..=20.
pub fn top_n(param: &str, n: Option<i64>) -> Result<Option<u32>, ApiError> {
    match n {
        None => Ok(None),
        Some(n) if (0..=common::sampling::MAX_LOGPROBS as i64).contains(&n) => Ok(Some(n as u32)),
        Some(n) => Err(ApiError::invalid(param, format!("{param} must be in [0, 20], got {n}"))),
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
    }
}
