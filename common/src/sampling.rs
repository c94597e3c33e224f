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
    /// A Lark grammar that reaches `answer` through `@answer`: what a
    /// reasoning model writes before the constrained part (its thinking,
    /// free), then the constraint.
    Then { lark: String, answer: Box<StructuredOutput> },
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

/// A token's log-probability and the `n` most likely tokens' (id, value),
/// most likely first, lower id first on a tie. One type from the worker's
/// samplers through both wires (stage to stage, worker to coordinator) to
/// the API's logprobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What a sampler drew at one row of logits: the token and, when the
/// request asked for logprobs, its logprobs as the worker reports them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SampledToken {
    pub token_id: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// A parameter outside its valid range; `param` names the field as the
/// OpenAI API does, so the HTTP layer can put it in its error body.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
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

    /// Checks every parameter against its rule ([`rules`]): the one check
    /// the HTTP layer runs on a request's values and the scheduler on what
    /// arrives. The error names the parameter as the OpenAI API does.
    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        use rules::*;
        check("temperature", TEMPERATURE, self.temperature.into())?;
        check("top_p", TOP_P, self.top_p.into())?;
        check("min_p", MIN_P, self.min_p.into())?;
        check("repetition_penalty", REPETITION_PENALTY, self.repetition_penalty.into())?;
        check("presence_penalty", PENALTY, self.presence_penalty.into())?;
        check("frequency_penalty", PENALTY, self.frequency_penalty.into())?;
        check_int("max_tokens", MAX_TOKENS, self.max_tokens.into())?;
        check_min_tokens(self.min_tokens.into(), self.max_tokens)?;
        if let Some(n) = self.logprobs {
            check_int("logprobs", LOGPROBS, n.into())?;
        }
        if let Some(n) = self.prompt_logprobs {
            check_int("prompt_logprobs", LOGPROBS, n.into())?;
        }
        for &(id, bias) in &self.logit_bias {
            check_logit_bias(id, bias.into())?;
        }
        check_logit_bias_ids(self.logit_bias.iter().map(|&(id, _)| id))?;
        if let Some(k) = self.speculative.and_then(Speculative::num_speculative_tokens) {
            check_int("num_speculative_tokens", SPECULATIVE_TOKENS, k.into())?;
        }
        Ok(())
    }

    /// The bias `logit_bias` gives `token` (0 if none).
    pub fn bias_of(&self, token: u32) -> f32 {
        self.logit_bias.binary_search_by_key(&token, |&(id, _)| id).map_or(0.0, |i| self.logit_bias[i].1)
    }
}

/// Every sampling parameter's valid values, written once: the HTTP layer
/// checks a request's values as written (so a message shows `1e308`, not
/// what it became in f32) and [`SamplingParams::validate`] the values as
/// carried. Where OpenAI and vLLM differ, OpenAI's ranges hold.
pub mod rules {
    use super::{MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS, SamplingParamsError};

    /// `[lo, hi]`, either end open; NaN is never inside.
    #[derive(Clone, Copy, Debug)]
    pub struct Range {
        pub lo: f64,
        pub hi: f64,
        pub open_lo: bool,
        pub open_hi: bool,
    }

    impl Range {
        const fn closed(lo: f64, hi: f64) -> Self {
            Self { lo, hi, open_lo: false, open_hi: false }
        }

        pub fn contains(&self, v: f64) -> bool {
            let above = if self.open_lo { v > self.lo } else { v >= self.lo };
            let below = if self.open_hi { v < self.hi } else { v <= self.hi };
            above && below
        }
    }

    impl std::fmt::Display for Range {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let (l, r) = (if self.open_lo { '(' } else { '[' }, if self.open_hi { ')' } else { ']' });
            write!(f, "{l}{}, {}{r}", self.lo, self.hi)
        }
    }

    /// OpenAI's temperature range (0 is greedy).
    pub const TEMPERATURE: Range = Range::closed(0.0, 2.0);
    pub const TOP_P: Range = Range { open_lo: true, ..Range::closed(0.0, 1.0) };
    pub const MIN_P: Range = Range::closed(0.0, 1.0);
    /// vLLM's multiplicative penalty; above 10 it only garbles.
    pub const REPETITION_PENALTY: Range = Range { open_lo: true, ..Range::closed(0.0, 10.0) };
    /// `presence_penalty` and `frequency_penalty` (OpenAI's range).
    pub const PENALTY: Range = Range::closed(-2.0, 2.0);
    pub const LOGIT_BIAS: Range = Range::closed(-MAX_LOGIT_BIAS as f64, MAX_LOGIT_BIAS as f64);
    pub const MAX_TOKENS: Range = Range::closed(1.0, u32::MAX as f64);
    /// `top_k` when it is on (-1 and 0 turn it off).
    pub const TOP_K: Range = Range::closed(1.0, u32::MAX as f64);
    pub const LOGPROBS: Range = Range::closed(0.0, MAX_LOGPROBS as f64);
    pub const SPECULATIVE_TOKENS: Range = Range::closed(1.0, MAX_SPECULATIVE_TOKENS as f64);
    /// A request's scheduling priority (an i32, as vLLM's).
    pub const PRIORITY: Range = Range::closed(i32::MIN as f64, i32::MAX as f64);

    fn err(param: &'static str, message: String) -> Result<(), SamplingParamsError> {
        Err(SamplingParamsError { param, message })
    }

    /// A number against its range; the message shows `value` as `{:?}`.
    pub fn check(param: &'static str, range: Range, value: f64) -> Result<(), SamplingParamsError> {
        if range.contains(value) { Ok(()) } else { err(param, format!("{param} must be in {range}, got {value:?}")) }
    }

    /// An integer against its range.
    pub fn check_int(param: &'static str, range: Range, value: i64) -> Result<(), SamplingParamsError> {
        if range.contains(value as f64) {
            Ok(())
        } else {
            err(param, format!("{param} must be in {range}, got {value}"))
        }
    }

    /// `min_tokens` may not exceed `max_tokens`.
    pub fn check_min_tokens(value: i64, max_tokens: u32) -> Result<(), SamplingParamsError> {
        if (0..=i64::from(max_tokens)).contains(&value) {
            Ok(())
        } else {
            err("min_tokens", format!("min_tokens must be in [0, max_tokens], got {value}"))
        }
    }

    /// `top_k`: -1 or 0 (off), or a count.
    pub fn check_top_k(value: i64) -> Result<(), SamplingParamsError> {
        if value == -1 || value == 0 || TOP_K.contains(value as f64) {
            Ok(())
        } else {
            err("top_k", format!("top_k must be -1 or 0 (off), or in {TOP_K}, got {value}"))
        }
    }

    /// One `logit_bias` entry's value.
    pub fn check_logit_bias(token: u32, bias: f64) -> Result<(), SamplingParamsError> {
        if LOGIT_BIAS.contains(bias) {
            Ok(())
        } else {
            err("logit_bias", format!("logit_bias values must be in {LOGIT_BIAS}, got {bias:?} for token {token}"))
        }
    }

    /// `logit_bias` ids as carried: sorted, each biased once.
    pub fn check_logit_bias_ids(ids: impl Iterator<Item = u32>) -> Result<(), SamplingParamsError> {
        let mut previous: Option<u32> = None;
        for id in ids {
            match previous {
                Some(p) if p == id => return err("logit_bias", format!("token {id} is biased twice")),
                Some(p) if p > id => return err("logit_bias", "token ids must be sorted".to_string()),
                _ => previous = Some(id),
            }
        }
        Ok(())
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
