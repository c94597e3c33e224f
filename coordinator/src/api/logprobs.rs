//! Log-probabilities in each API's shape, with the token texts filled in:
//! `/generate`'s entries (ids and texts), chat's `logprobs.content`, and
//! the legacy completions object (parallel arrays, over an echoed prompt
//! too). Log-probabilities travel as f32 and are written as f64, the
//! numbers the untyped JSON of earlier versions wrote; the OpenAI shapes
//! floor them at -9999 as vLLM does (JSON has no -inf: serde would write
//! `null`, which clients read as "no logprob").

use std::collections::BTreeMap;
use std::sync::Arc;

use common::protocol::TokenLogprobs;
use serde::Serialize;

use crate::text::Tokenizer;
use crate::text::detokenizer::IncrementalDetokenizer;

/// The lowest logprob the OpenAI shapes write (vLLM's floor).
const LOGPROB_FLOOR: f64 = -9999.0;

fn openai_logprob(lp: f32) -> f64 {
    f64::from(lp).max(LOGPROB_FLOOR)
}

/// A prompt echoed back by `/v1/completions`.
#[derive(Clone)]
pub struct Echo {
    pub text: String,
    pub ids: Vec<u32>,
    /// Where each token's text starts in `text`, in characters.
    pub offsets: Vec<usize>,
}

impl Echo {
    /// The prompt's text as the answer shows it (special tokens skipped),
    /// and its tokens' offsets into that text.
    pub fn new(tokenizer: &Arc<Tokenizer>, ids: Vec<u32>) -> Self {
        let text = tokenizer.decode(&ids, true);
        let offsets = TextOffsets::new(tokenizer.clone(), &[], 0).take(&ids, text.chars().count());
        Self { text, ids, offsets }
    }
}

/// Where each token's text starts in a choice's text, in characters (the
/// legacy `text_offset`). Tokens go one at a time through the incremental
/// detokenizer that makes the text, so an offset points at the token's own
/// text whatever its piece looks like (a BOS, a `▁`/`Ġ` space marker, a
/// `<0x0A>` byte). Text held back (a byte run, part of a UTF-8 character)
/// comes out with a later token: the held tokens point where it starts, and
/// that later token at its own text's start within it.
pub struct TextOffsets {
    tokenizer: Arc<Tokenizer>,
    detok: IncrementalDetokenizer,
    chars: usize,
    /// The last token's text was held back.
    held: bool,
}

impl TextOffsets {
    /// After `context` tokens (whose text is not counted), from `start`.
    pub fn new(tokenizer: Arc<Tokenizer>, context: &[u32], start: usize) -> Self {
        let detok = IncrementalDetokenizer::new(tokenizer.clone(), context, true);
        Self { tokenizer, detok, chars: start, held: false }
    }

    /// The offsets of the next `ids`.
    pub fn next(&mut self, ids: &[u32]) -> Vec<usize> {
        ids.iter().map(|&id| self.one(id)).collect()
    }

    fn one(&mut self, id: u32) -> usize {
        let delta = self.detok.push(&[id]);
        let len = delta.chars().count();
        let mut at = self.chars;
        if self.held && len > 0 {
            // The delta is the held text, then (when it decodes alone) this token's own.
            let own = self.tokenizer.decode(&[id], true);
            if !own.is_empty() && delta.ends_with(&own) {
                at += len - own.chars().count();
            }
        }
        self.held = len == 0;
        self.chars += len;
        at
    }

    /// The offsets of `ids`, none past `limit` (the end of a text that a
    /// stop string cut).
    pub fn take(mut self, ids: &[u32], limit: usize) -> Vec<usize> {
        self.next(ids).into_iter().map(|o| o.min(limit)).collect()
    }
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
    pub fn list(tokenizer: &Tokenizer, ids: &[u32], lps: &[TokenLogprobs]) -> Vec<Self> {
        lps.iter().zip(ids).map(|(l, &id)| Self::new(tokenizer, id, l)).collect()
    }

    fn new(tokenizer: &Tokenizer, id: u32, l: &TokenLogprobs) -> Self {
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

/// Chat's `logprobs`: each token with its bytes (a partial UTF-8 character's
/// too, so that clients can join them, as OpenAI's).
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
    pub fn new(tokenizer: &Tokenizer, ids: &[u32], lps: &[TokenLogprobs]) -> Self {
        let top = |&(t, lp): &(u32, f32)| ChatTopLogprob {
            bytes: tokenizer.token_bytes(t),
            token: tokenizer.token_text(t),
            logprob: openai_logprob(lp),
        };
        let content = ids
            .iter()
            .zip(lps)
            .map(|(&id, l)| ChatTokenLogprob {
                bytes: tokenizer.token_bytes(id),
                token: tokenizer.token_text(id),
                logprob: openai_logprob(l.logprob),
                top_logprobs: l.top.iter().map(top).collect(),
            })
            .collect();
        Self { content }
    }
}

/// OpenAI's legacy completions logprobs object. `top_logprobs` maps token
/// texts to logprobs: the `logprobs` likeliest and the chosen token, so up
/// to `logprobs + 1` entries, as OpenAI and vLLM answer (tokens with the
/// same text share one entry).
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f64>>,
    top_logprobs: Vec<Option<BTreeMap<String, f64>>>,
    text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Over an echoed prompt (with the logprobs of all but its first token,
    /// which has `null`s), then the completion's `ids`. `offsets` are the
    /// completion tokens' `text_offset`s ([`TextOffsets`], counted from the
    /// start of the choice's text, echoed prompt included).
    pub fn new(
        tokenizer: &Tokenizer,
        prompt: Option<(&Echo, &[TokenLogprobs])>,
        ids: &[u32],
        lps: &[TokenLogprobs],
        offsets: &[usize],
    ) -> Self {
        let mut out = Self::default();
        if let Some((echo, prompt_lps)) = prompt {
            for ((i, &id), &offset) in echo.ids.iter().enumerate().zip(&echo.offsets) {
                out.push(tokenizer, id, i.checked_sub(1).and_then(|j| prompt_lps.get(j)), offset);
            }
        }
        for ((&id, l), &offset) in ids.iter().zip(lps).zip(offsets) {
            out.push(tokenizer, id, Some(l), offset);
        }
        out
    }

    fn push(&mut self, tokenizer: &Tokenizer, id: u32, lp: Option<&TokenLogprobs>, offset: usize) {
        let text = tokenizer.token_text(id);
        self.text_offset.push(offset);
        self.token_logprobs.push(lp.map(|l| openai_logprob(l.logprob)));
        self.top_logprobs.push(lp.map(|l| {
            let mut top: BTreeMap<String, f64> =
                l.top.iter().map(|&(t, lp)| (tokenizer.token_text(t), openai_logprob(lp))).collect();
            if !l.top.iter().any(|&(t, _)| t == id) {
                top.entry(text.clone()).or_insert(openai_logprob(l.logprob));
            }
            top
        }));
        self.tokens.push(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tokenizer(model: &str) -> Arc<Tokenizer> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models").join(model);
        Arc::new(Tokenizer::from_dir(&dir).expect("load tokenizer"))
    }

    fn chars_from(text: &str, offset: usize) -> String {
        text.chars().skip(offset).collect()
    }

    /// Every echoed token's offset points at its own text in the echoed
    /// prompt: SentencePiece (a BOS, `▁` spaces, `<0xHH>` bytes) and
    /// byte-level BPE (`Ġ` spaces, multi-byte characters) alike.
    #[test]
    fn echo_offsets_point_at_each_tokens_text() {
        for model in ["stories260K", "tiny-qwen2", "tiny-llama3"] {
            let tok = tokenizer(model);
            let prompt = "Once upon a time, Lily saw a café.\nThe end";
            let ids = tok.encode(prompt, true).expect("encode");
            let echo = Echo::new(&tok, ids.clone());
            assert_eq!(echo.offsets.len(), ids.len(), "{model}");
            assert!(echo.offsets.windows(2).all(|w| w[0] <= w[1]), "{model}: {:?}", echo.offsets);
            let total = echo.text.chars().count();
            assert!(echo.offsets.iter().all(|&o| o <= total), "{model}: {:?}", echo.offsets);
            // Decoding the tokens before each one gives the text before its offset.
            for (i, &offset) in echo.offsets.iter().enumerate() {
                let before = tok.decode(&ids[..i], true);
                let rest = chars_from(&echo.text, offset);
                assert!(
                    before.chars().count() == offset || !echo.text.starts_with(&before),
                    "{model}: token {i} at {offset}, text before it {before:?}, rest {rest:?}"
                );
            }
            let word = echo.text.find(" upon").map(|b| echo.text[..b].chars().count()).expect("' upon' in the text");
            assert!(echo.offsets.contains(&word), "{model}: {:?} lacks {word}", echo.offsets);
        }
    }

    /// The completion's offsets go on from the echoed prompt's end, and a
    /// stop string's cut caps them.
    #[test]
    fn completion_offsets_follow_the_prompt() {
        let tok = tokenizer("stories260K");
        let prompt = tok.encode("Once upon", true).expect("encode");
        let completion = tok.encode(" a time there was", false).expect("encode");
        let text = tok.decode(&prompt.iter().chain(&completion).copied().collect::<Vec<_>>(), true);
        let start = tok.decode(&prompt, true).chars().count();
        let offsets = TextOffsets::new(tok.clone(), &prompt, start).take(&completion, usize::MAX);
        assert_eq!(offsets[0], start);
        for (i, &o) in offsets.iter().enumerate() {
            let piece = tok.token_text(completion[i]);
            assert!(chars_from(&text, o).starts_with(&piece), "token {i} {piece:?} at {o} in {text:?}");
        }
        let capped = TextOffsets::new(tok, &prompt, start).take(&completion, start + 3);
        assert!(capped.iter().all(|&o| o <= start + 3) && capped.len() == completion.len(), "{capped:?}");
    }

    /// `top_logprobs` hold the `logprobs` likeliest and the chosen token
    /// when it is not among them (up to `logprobs + 1`), as OpenAI's; -inf
    /// is written as vLLM's floor, not `null`.
    #[test]
    fn top_logprobs_include_the_chosen_token() {
        let tok = tokenizer("stories260K");
        let (a, b, c) = (300u32, 301u32, 302u32);
        let lps = [
            TokenLogprobs { logprob: -3.0, top: vec![(a, -0.1), (b, -2.0)] },
            TokenLogprobs { logprob: -0.1, top: vec![(a, -0.1), (b, -2.0)] },
            TokenLogprobs { logprob: f32::NEG_INFINITY, top: vec![] },
        ];
        let lp = CompletionLogprobs::new(&tok, None, &[c, a, b], &lps, &[0, 1, 2]);
        let top = |i: usize| lp.top_logprobs[i].as_ref().expect("top");
        assert_eq!(top(0).len(), 3);
        assert_eq!(top(0).get(&tok.token_text(c)), Some(&-3.0));
        assert_eq!(top(1).len(), 2);
        assert_eq!(top(2).get(&tok.token_text(b)), Some(&LOGPROB_FLOOR));
        assert_eq!(lp.token_logprobs[2], Some(LOGPROB_FLOOR));
        let json = serde_json::to_value(&lp).expect("json");
        assert!(json["token_logprobs"].as_array().expect("array").iter().all(|v| v.is_f64()), "{json}");
    }
}
