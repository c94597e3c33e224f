//! Log-probabilities in each API's shape, with the token texts filled in:
//! `/generate`'s entries (ids and texts), chat's `logprobs.content`, and
//! the legacy completions object (parallel arrays, over an echoed prompt
//! too). Log-probabilities travel as f32 and are written as f64, the
//! numbers the untyped JSON of earlier versions wrote.

use std::collections::BTreeMap;

use common::protocol::WireLogprobs;
use serde::Serialize;

use crate::text::Tokenizer;

/// A prompt echoed back by `/v1/completions`.
#[derive(Clone)]
pub struct Echo {
    pub text: String,
    pub ids: Vec<u32>,
}

/// One token of `/generate`'s `logprobs` or `prompt_logprobs`.
#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    token_id: u32,
    token: String,
    logprob: f64,
    top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize)]
struct TopLogprob {
    token_id: u32,
    token: String,
    logprob: f64,
}

impl TokenLogprob {
    /// The entries of `ids`, one per logprob (the shorter of the two decides).
    pub fn list(tokenizer: &Tokenizer, ids: &[u32], lps: &[WireLogprobs]) -> Vec<Self> {
        lps.iter().zip(ids).map(|(l, &id)| Self::new(tokenizer, id, l)).collect()
    }

    fn new(tokenizer: &Tokenizer, id: u32, l: &WireLogprobs) -> Self {
        let top =
            |&(t, lp): &(u32, f32)| TopLogprob { token_id: t, token: tokenizer.token_text(t), logprob: lp.into() };
        Self {
            token_id: id,
            token: tokenizer.token_text(id),
            logprob: l.logprob.into(),
            top_logprobs: l.top.iter().map(top).collect(),
        }
    }
}

/// Chat's `logprobs`: each token with its UTF-8 bytes.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize)]
struct ChatTokenLogprob {
    token: String,
    logprob: f64,
    bytes: Vec<u8>,
    top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Serialize)]
struct ChatTopLogprob {
    token: String,
    logprob: f64,
    bytes: Vec<u8>,
}

impl ChatLogprobs {
    pub fn new(tokenizer: &Tokenizer, ids: &[u32], lps: &[WireLogprobs]) -> Self {
        let top = |&(t, lp): &(u32, f32)| {
            let token = tokenizer.token_text(t);
            ChatTopLogprob { bytes: token.as_bytes().to_vec(), token, logprob: lp.into() }
        };
        let content = ids
            .iter()
            .zip(lps)
            .map(|(&id, l)| {
                let token = tokenizer.token_text(id);
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: l.logprob.into(),
                    top_logprobs: l.top.iter().map(top).collect(),
                }
            })
            .collect();
        Self { content }
    }
}

/// OpenAI's legacy completions logprobs object. `top_logprobs` maps token
/// texts to logprobs (tokens with the same text share one entry).
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f64>>,
    top_logprobs: Vec<Option<BTreeMap<String, f64>>>,
    text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Over an echoed prompt (with the logprobs of all but its first token,
    /// which has `null`s), then the completion's `ids`. `text_offset` counts
    /// characters from the start of the choice's text, of which `start` came
    /// in earlier streamed chunks: the completion's tokens start after the
    /// echoed text; the prompt's offsets add up its token texts, as vLLM's
    /// do (a BOS token or a leading space the decoded text drops still
    /// counts there).
    pub fn new(
        tokenizer: &Tokenizer,
        prompt: Option<(&Echo, &[WireLogprobs])>,
        ids: &[u32],
        lps: &[WireLogprobs],
        start: usize,
    ) -> Self {
        let mut out = Self::default();
        let mut offset = start;
        if let Some((echo, prompt_lps)) = prompt {
            for (i, &id) in echo.ids.iter().enumerate() {
                out.push(tokenizer, id, i.checked_sub(1).and_then(|j| prompt_lps.get(j)), &mut offset);
            }
            offset = start + echo.text.chars().count();
        }
        for (&id, l) in ids.iter().zip(lps) {
            out.push(tokenizer, id, Some(l), &mut offset);
        }
        out
    }

    fn push(&mut self, tokenizer: &Tokenizer, id: u32, lp: Option<&WireLogprobs>, offset: &mut usize) {
        let t = tokenizer.token_text(id);
        self.text_offset.push(*offset);
        *offset += t.chars().count();
        self.tokens.push(t);
        self.token_logprobs.push(lp.map(|l| l.logprob.into()));
        self.top_logprobs
            .push(lp.map(|l| l.top.iter().map(|&(t, lp)| (tokenizer.token_text(t), f64::from(lp))).collect()));
    }
}
