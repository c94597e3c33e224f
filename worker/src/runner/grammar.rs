//! The worker's side of structured outputs: one llguidance matcher per
//! constrained request, and each step's token masks (vLLM's
//! `StructuredOutputManager` with the guidance backend).
//!
//! A matcher's state is a function of the request's output tokens alone,
//! so it is kept in step with them rather than fed by the sampler: before
//! a step's masks are computed, each matcher consumes the tokens generated
//! since it last looked. A request resumed after a lost worker starts its
//! matcher on the output it brings, and a preempted one (recomputed, its
//! output kept) needs nothing at all. The engine core never sees any of
//! this; it only sees the token the masked sampler drew.
//!
//! Masks are computed on another thread while the model runs (see
//! `Engine::step`): they depend on the tokens so far, not on the logits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use common::structured::{GrammarCompiler, GrammarMatcher, StructuredError, TokenMask};
use common::{RequestId, StructuredOutput};

use crate::error::WorkerError;

/// The constrained requests of one engine and what compiles theirs.
pub struct Grammars {
    vocabulary: Vocabulary,
    /// Built from `vocabulary` on first use (a scan of the whole vocabulary,
    /// which engines that never see a constraint should not pay for). `Err`
    /// says why this model cannot take constraints (no tokenizer.json, an
    /// unsupported vocabulary); such requests are refused with it.
    compiler: OnceLock<Result<Arc<GrammarCompiler>, String>>,
    eos_token_ids: Vec<u32>,
    vocab_size: usize,
    active: HashMap<RequestId, RequestGrammar>,
}

/// One request's matcher, compiled and caught up with its output.
pub struct RequestGrammar {
    matcher: GrammarMatcher,
    /// Output tokens the matcher has consumed.
    consumed: usize,
}

/// Where the token strings come from.
#[derive(Clone, Debug)]
pub enum Vocabulary {
    /// A `tokenizer.json`.
    TokenizerJson(PathBuf),
    /// None: the message says why (e.g. a `random:` preset).
    Missing(String),
    /// Given (tests): each token's bytes.
    Tokens(Vec<Vec<u8>>),
}

impl Grammars {
    /// `eos_token_ids` must be inside `vocab_size` (the model's logits).
    pub fn new(vocabulary: Vocabulary, eos_token_ids: &[u32], vocab_size: usize) -> Self {
        Self {
            vocabulary,
            compiler: OnceLock::new(),
            eos_token_ids: eos_token_ids.to_vec(),
            vocab_size,
            active: HashMap::new(),
        }
    }

    /// The compiler (built on first use), for compiling off the step loop
    /// too; `Err` says why there is none.
    pub fn compiler(&self) -> Result<&Arc<GrammarCompiler>, StructuredError> {
        let built = self.compiler.get_or_init(|| {
            let (vocab, eos) = (self.vocab_size, &self.eos_token_ids[..]);
            let compiler = match &self.vocabulary {
                Vocabulary::Missing(why) => return Err(why.clone()),
                Vocabulary::Tokens(tokens) => GrammarCompiler::from_token_bytes(tokens.clone(), vocab, eos),
                Vocabulary::TokenizerJson(path) => std::fs::read_to_string(path)
                    .map_err(|e| StructuredError(e.to_string()))
                    .and_then(|text| GrammarCompiler::from_tokenizer_json(&text, vocab, eos))
                    .map_err(|e| StructuredError(format!("{}: {e}", path.display()))),
            };
            compiler.map(Arc::new).map_err(|e| format!("structured outputs are unavailable for this model: {e}"))
        });
        built.as_ref().map_err(|why| StructuredError(why.clone()))
    }

    /// A matcher for `constraint` that has consumed the `output` the
    /// request already has (a resumed request's), ready to [`insert`](Self::insert).
    pub fn prepare(&self, constraint: &StructuredOutput, output: &[u32]) -> Result<RequestGrammar, StructuredError> {
        prepare(self.compiler()?, constraint, output)
    }

    /// Starts constraining `id`.
    pub fn insert(&mut self, id: RequestId, grammar: RequestGrammar) {
        self.active.insert(id, grammar);
    }

    pub fn remove(&mut self, id: RequestId) {
        self.active.remove(&id);
    }

    pub fn is_constrained(&self, id: RequestId) -> bool {
        self.active.contains_key(&id)
    }

    /// Whether any of `ids` is constrained (so a step needs masks).
    pub fn any_constrained(&self, mut ids: impl Iterator<Item = RequestId>) -> bool {
        !self.active.is_empty() && ids.any(|id| self.active.contains_key(&id))
    }

    /// Runs `forward` (the model) on this thread while another computes the
    /// masks of `rows` (one per sampling row, `None` for unconstrained
    /// ones); joins both before sampling. Without a constrained row,
    /// `forward` runs alone.
    pub fn masks_beside<T>(
        &mut self,
        rows: &[(RequestId, &[u32])],
        forward: impl FnOnce() -> crate::error::Result<T>,
    ) -> crate::error::Result<(T, Vec<Option<TokenMask>>)> {
        if !self.any_constrained(rows.iter().map(|r| r.0)) {
            return Ok((forward()?, vec![None; rows.len()]));
        }
        std::thread::scope(|s| {
            let masker = s.spawn(|| self.masks(rows));
            let out = forward();
            let masks =
                masker.join().map_err(|_| WorkerError::Unsupported("the structured-output masker panicked".into()))?;
            Ok((out?, masks))
        })
    }

    /// The mask of each sampling row, `rows[i] = (request, its output so
    /// far)`: `None` for unconstrained requests. A matcher that fails (it
    /// should not: the sampler only draws allowed tokens) allows only EOS,
    /// so its request ends rather than leaving the grammar.
    pub fn masks(&mut self, rows: &[(RequestId, &[u32])]) -> Vec<Option<TokenMask>> {
        rows.iter()
            .map(|&(id, output)| {
                let g = self.active.get_mut(&id)?;
                Some(next_mask(g, output).unwrap_or_else(|e| {
                    tracing::warn!("structured output of request {}: {e}; ending it", id.0);
                    eos_only(&self.eos_token_ids, self.vocab_size)
                }))
            })
            .collect()
    }
}

/// What [`Grammars::prepare`] does, with any compiler (for compiling off
/// the engine's thread).
pub fn prepare(
    compiler: &GrammarCompiler,
    constraint: &StructuredOutput,
    output: &[u32],
) -> Result<RequestGrammar, StructuredError> {
    let mut matcher = compiler.compile(constraint)?;
    matcher
        .consume_tokens(output)
        .map_err(|e| StructuredError(format!("the output so far does not match the constraint: {e}")))?;
    Ok(RequestGrammar { matcher, consumed: output.len() })
}

/// Catches the matcher up with `output`, then computes its mask (only EOS
/// once the grammar is complete).
fn next_mask(g: &mut RequestGrammar, output: &[u32]) -> Result<TokenMask, String> {
    // A complete grammar allows only EOS: tokens past it (`ignore_eos`
    // keeps a request going) are not the grammar's to check.
    if g.matcher.is_stopped() && !g.matcher.is_error() {
        g.consumed = output.len();
    }
    if let Some(new) = output.get(g.consumed..).filter(|n| !n.is_empty()) {
        g.matcher.consume_tokens(new).map_err(|e| e.to_string())?;
        g.consumed = output.len();
    }
    g.matcher.compute_mask_or_eos().map_err(|e| e.to_string())
}

fn eos_only(eos_token_ids: &[u32], vocab_size: usize) -> TokenMask {
    let mut mask = TokenMask::alloc(vocab_size);
    for &t in eos_token_ids {
        mask.allow_token(t);
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammars() -> Grammars {
        let mut tokens: Vec<Vec<u8>> = (0u8..128).map(|b| vec![b]).collect();
        tokens.push(b"\xFF</s>".to_vec());
        Grammars::new(Vocabulary::Tokens(tokens), &[128], 129)
    }

    fn allowed(mask: &TokenMask) -> Vec<u32> {
        (0..129).filter(|&t| mask.is_allowed(t)).collect()
    }

    #[test]
    fn the_matcher_follows_the_output_and_ends_on_eos() {
        let mut g = grammars();
        let id = RequestId(7);
        let grammar = g.prepare(&StructuredOutput::Regex("ab?c".into()), &[]).unwrap();
        g.insert(id, grammar);
        let masks = g.masks(&[(id, &[]), (RequestId(8), &[])]);
        assert_eq!(allowed(masks[0].as_ref().unwrap()), vec![b'a' as u32]);
        assert!(masks[1].is_none(), "an unconstrained row has no mask");
        let output = [b'a' as u32];
        assert_eq!(allowed(g.masks(&[(id, &output)])[0].as_ref().unwrap()), vec![b'b' as u32, b'c' as u32]);
        let output = [b'a' as u32, b'c' as u32];
        assert_eq!(allowed(g.masks(&[(id, &output)])[0].as_ref().unwrap()), vec![128]);
        g.remove(id);
        assert!(!g.is_constrained(id));
    }

    #[test]
    fn a_resumed_request_rebuilds_its_state_from_its_output() {
        let mut g = grammars();
        let choice = StructuredOutput::Choice(vec!["abc".into(), "abd".into()]);
        let grammar = g.prepare(&choice, &[b'a' as u32, b'b' as u32]).unwrap();
        g.insert(RequestId(1), grammar);
        let mask = g.masks(&[(RequestId(1), &[b'a' as u32, b'b' as u32])]).remove(0).unwrap();
        assert_eq!(allowed(&mask), vec![b'c' as u32, b'd' as u32]);
        // Output that leaves the grammar is refused up front.
        assert!(g.prepare(&choice, &[b'x' as u32]).is_err());
    }

    #[test]
    fn a_model_without_a_vocabulary_refuses_constraints_with_the_reason() {
        let g = Grammars::new(Vocabulary::Missing("random:tinyllama-1.1b has no tokenizer.json".into()), &[2], 32000);
        let err = g.prepare(&StructuredOutput::JsonObject, &[]).err().unwrap();
        assert!(err.0.contains("no tokenizer.json"), "{err}");
    }
}
