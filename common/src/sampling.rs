//! Per-request sampling parameters, as the worker's sampler applies them and
//! as they travel from the coordinator to a worker. Names and meanings follow
//! vLLM's `SamplingParams`.

use serde::{Deserialize, Serialize};

/// Largest number of top log-probabilities a request may ask for per token.
pub const MAX_LOGPROBS: u32 = 20;
/// Largest |bias| in `logit_bias` (OpenAI's range).
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// Most tokens one request may propose per step (`num_speculative_tokens`).
pub const MAX_SPECULATIVE_TOKENS: u8 = 16;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, lowest id on a tie).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability
    /// reaches `top_p`. 1.0 disables it.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 disables it.
    pub top_k: u32,
    /// Drop tokens whose probability is below `min_p` times the top token's.
    pub min_p: f32,
    /// Divides positive logits (multiplies negative ones) of every token seen
    /// in the prompt or output; 1.0 disables it.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Seed of this request's own random stream; `None` draws one at random.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Stop tokens and EOS are suppressed until this many were generated.
    pub min_tokens: u32,
    /// Generation also stops on these ids (the token is kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS token(s).
    pub ignore_eos: bool,
    /// Return the chosen token's log-probability plus this many top ones.
    pub logprobs: Option<u32>,
    /// Return each prompt token's log-probability (given the tokens before
    /// it) plus this many top ones, from the second prompt token on (vLLM's
    /// `prompt_logprobs`). Such a request computes its whole prompt: a
    /// prefix-cache hit would skip the positions it asks about.
    pub prompt_logprobs: Option<u32>,
    /// Added to these tokens' logits before the penalties (OpenAI's
    /// `logit_bias`); sorted by id, each id once.
    pub logit_bias: Vec<(u32, f32)>,
    /// Constrains the output to a grammar (vLLM's `structured_outputs`): the
    /// worker compiles it once and masks every step's logits with it.
    pub structured_output: Option<StructuredOutput>,
    /// Speculative decoding for this request; `None` follows the worker's
    /// `--speculative-method`. Never changes what is generated, only how fast.
    pub speculative: Option<Speculative>,
}

/// A request's own choice of speculative decoding (vLLM configures it per
/// server; `/generate` also takes it per request).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Speculative {
    /// No proposals for this request.
    Off,
    /// n-gram prompt lookup, with this many proposed tokens per step
    /// (`None`: the worker's `--num-speculative-tokens`, or 4).
    Ngram { num_speculative_tokens: Option<u8> },
    /// The worker's draft model (`--draft-model`) proposes, greedily.
    Draft { num_speculative_tokens: Option<u8> },
}

impl Speculative {
    /// The request's own k, if it set one.
    pub fn num_speculative_tokens(self) -> Option<u8> {
        match self {
            Self::Off => None,
            Self::Ngram { num_speculative_tokens } | Self::Draft { num_speculative_tokens } => num_speculative_tokens,
        }
    }
}

/// What a structured output must match. The coordinator builds it from
/// `response_format`, vLLM's `guided_*` fields or a forced tool call; the
/// worker compiles it (llguidance) into a per-step token mask.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StructuredOutput {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this JSON Schema, given as JSON text.
    JsonSchema(String),
    /// Text matching this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (which may embed JSON schemas).
    Lark(String),
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            structured_output: None,
            speculative: None,
        }
    }
}

/// A parameter outside its valid range; `param` names the field as the
/// OpenAI API does, so the HTTP layer can put it in its error body.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct SamplingParamsError {
    pub param: &'static str,
    pub message: String,
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self { temperature: 0.0, max_tokens, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        let err = |param, message: String| Err(SamplingParamsError { param, message });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return err("temperature", format!("must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return err("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return err("min_p", format!("must be in [0, 1], got {}", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return err("repetition_penalty", format!("must be > 0, got {}", self.repetition_penalty));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return err("presence_penalty", format!("must be in [-2, 2], got {}", self.presence_penalty));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return err("frequency_penalty", format!("must be in [-2, 2], got {}", self.frequency_penalty));
        }
        if self.max_tokens == 0 {
            return err("max_tokens", "must be at least 1".to_string());
        }
        if self.min_tokens > self.max_tokens {
            return err("min_tokens", format!("must be <= max_tokens ({}), got {}", self.max_tokens, self.min_tokens));
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return err("logprobs", format!("must be <= {MAX_LOGPROBS}, got {n}"));
        }
        if let Some(n) = self.prompt_logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return err("prompt_logprobs", format!("must be <= {MAX_LOGPROBS}, got {n}"));
        }
        if let Some(&(id, b)) = self.logit_bias.iter().find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b)) {
            return err("logit_bias", format!("must be in [-100, 100], got {b} for token {id}"));
        }
        if !self.logit_bias.is_sorted_by(|a, b| a.0 < b.0) {
            return err("logit_bias", "token ids must be sorted and unique".to_string());
        }
        if let Some(k) = self.speculative.and_then(Speculative::num_speculative_tokens)
            && !(1..=MAX_SPECULATIVE_TOKENS).contains(&k)
        {
            return err("num_speculative_tokens", format!("must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"));
        }
        Ok(())
    }

    /// The bias `logit_bias` gives `token` (0 if none).
    pub fn bias_of(&self, token: u32) -> f32 {
        self.logit_bias.binary_search_by_key(&token, |&(id, _)| id).map_or(0.0, |i| self.logit_bias[i].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_name_their_param() {
        assert!(SamplingParams::default().validate().is_ok());
        let bad = SamplingParams { top_p: 0.0, ..SamplingParams::default() };
        assert_eq!(bad.validate().unwrap_err().param, "top_p");
        let bad = SamplingParams { temperature: -1.0, ..SamplingParams::default() };
        assert_eq!(bad.validate().unwrap_err().param, "temperature");
        let bad = SamplingParams { logprobs: Some(21), ..SamplingParams::default() };
        assert_eq!(bad.validate().unwrap_err().param, "logprobs");
        let bad = SamplingParams { prompt_logprobs: Some(21), ..SamplingParams::default() };
        assert_eq!(bad.validate().unwrap_err().param, "prompt_logprobs");
        for bias in [vec![(3, 100.5)], vec![(3, f32::NAN)], vec![(4, 1.0), (3, 1.0)], vec![(3, 1.0), (3, 2.0)]] {
            let bad = SamplingParams { logit_bias: bias, ..SamplingParams::default() };
            assert_eq!(bad.validate().unwrap_err().param, "logit_bias");
        }
        let biased = SamplingParams { logit_bias: vec![(3, -100.0), (9, 2.5)], ..SamplingParams::default() };
        assert!(biased.validate().is_ok());
        assert_eq!([0, 3, 9, 10].map(|t| biased.bias_of(t)), [0.0, -100.0, 2.5, 0.0]);
    }
}
