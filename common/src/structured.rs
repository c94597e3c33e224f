//! Structured outputs: a [`StructuredOutput`] compiled by llguidance (the
//! grammar engine vLLM and llama.cpp use) into a matcher over the model's
//! vocabulary. Both sides compile with this one definition: the coordinator
//! to refuse a schema, regex or grammar with a 400 before dispatch, the
//! worker to mask each step's logits. Behind the `structured` feature, so
//! pure users of the types do not link a grammar engine.
//!
//! The vocabulary is read from `tokenizer.json` (the bytes of every token,
//! as llguidance decodes byte-level and byte-fallback vocabularies) and
//! sized to the model's embedding rows, so a mask has one bit per logit.
//!
//! JSON is generated compact (no whitespace between tokens, as vLLM's
//! `disable_any_whitespace`): it costs fewer tokens, and a model cannot
//! loop on whitespace until `max_tokens` instead of closing the object.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::StructuredOutput;

pub use llguidance::Matcher as GrammarMatcher;
pub use llguidance::toktrie::SimpleVob as TokenMask;

/// Why a vocabulary or a constraint could not be compiled; the message
/// names the problem as llguidance reports it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct StructuredError(pub String);

/// Compiles constraints against one model's vocabulary. Building it scans
/// the whole vocabulary (tens of ms for 150k tokens): do it once per process.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab_size", &self.vocab_size).finish()
    }
}

impl GrammarCompiler {
    /// The vocabulary of `tokenizer_json` (the file's text), padded or cut
    /// to `vocab_size` ids (the model's logits); generation ends on any of
    /// `eos_token_ids`.
    pub fn from_tokenizer_json(
        tokenizer_json: &str,
        vocab_size: usize,
        eos_token_ids: &[u32],
    ) -> Result<Self, StructuredError> {
        let json: Value = serde_json::from_str(tokenizer_json)
            .map_err(|e| StructuredError(format!("tokenizer.json is not JSON: {e}")))?;
        let tokens = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| StructuredError(format!("tokenizer.json: {e}")))?;
        Self::from_token_bytes(tokens, vocab_size, eos_token_ids)
    }

    /// The vocabulary given as each token's bytes (special tokens start
    /// with [`TokTrie::SPECIAL_TOKEN_MARKER`]).
    pub fn from_token_bytes(
        mut tokens: Vec<Vec<u8>>,
        vocab_size: usize,
        eos_token_ids: &[u32],
    ) -> Result<Self, StructuredError> {
        let Some(&eos) = eos_token_ids.first() else {
            return Err(StructuredError("the model has no EOS token to end a structured output with".into()));
        };
        if let Some(bad) = eos_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(StructuredError(format!("EOS token {bad} is outside the vocabulary (size {vocab_size})")));
        }
        // Ids past the model's logits can never be drawn; rows the tokenizer
        // lacks (padded embeddings) are specials no grammar allows.
        tokens.truncate(vocab_size);
        while tokens.len() < vocab_size {
            let mut name = format!(".<[{}]>", tokens.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            tokens.push(name);
        }
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let mut trie = TokTrie::from(&info, &tokens);
        if eos_token_ids.len() > 1 {
            trie = trie.with_eos_tokens(eos_token_ids);
        }
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| StructuredError(e.to_string()))?;
        // Compile errors go back to the client; nothing for stderr.
        factory.quiet();
        Ok(Self { factory, vocab_size })
    }

    /// Width of every mask: the model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A fresh matcher for `constraint`, or what is wrong with it.
    pub fn compile(&self, constraint: &StructuredOutput) -> Result<Matcher, StructuredError> {
        let grammar = top_level_grammar(constraint)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| StructuredError(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(StructuredError(e)),
            None => Ok(matcher),
        }
    }
}

/// The llguidance grammar of a constraint.
pub fn top_level_grammar(constraint: &StructuredOutput) -> Result<TopLevelGrammar, StructuredError> {
    Ok(match constraint {
        StructuredOutput::JsonObject => {
            TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
        }
        StructuredOutput::JsonSchema(text) => {
            let schema: Value =
                serde_json::from_str(text).map_err(|e| StructuredError(format!("the JSON schema is not JSON: {e}")))?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(StructuredError("a JSON schema must be an object (or a boolean)".into()));
            }
            TopLevelGrammar::from_json_schema(compact(schema))
        }
        StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
        StructuredOutput::Choice(choices) => {
            if choices.is_empty() {
                return Err(StructuredError("choice needs at least one string".into()));
            }
            let alternatives: Vec<String> = choices.iter().map(|c| escape_regex(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
        }
        StructuredOutput::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        StructuredOutput::Then { lark, answer } => {
            let mut answer = top_level_grammar(answer)?;
            let Some(first) = answer.grammars.first_mut() else {
                return Err(StructuredError("the answer's constraint has no grammar".into()));
            };
            first.name = Some("answer".into());
            let mut grammar = TopLevelGrammar::from_lark(lark.clone());
            grammar.grammars.extend(answer.grammars);
            grammar
        }
    })
}

/// `schema` with llguidance's compact separators, unless it sets its own
/// (`x-guidance`).
fn compact(mut schema: Value) -> Value {
    if let Some(object) = schema.as_object_mut().filter(|o| !o.contains_key("x-guidance")) {
        object.insert("x-guidance".into(), serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// `text` as a regex that matches exactly it.
fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One token per printable ASCII byte plus a few words, EOS last.
    fn compiler() -> GrammarCompiler {
        let mut tokens: Vec<Vec<u8>> = (0u8..128).map(|b| vec![b]).collect();
        for word in ["yes", "no", "\"name\"", "true"] {
            tokens.push(word.as_bytes().to_vec());
        }
        tokens.push(b"\xFF</s>".to_vec());
        let eos = tokens.len() as u32 - 1;
        GrammarCompiler::from_token_bytes(tokens, 140, &[eos]).unwrap()
    }

    fn allowed(m: &mut Matcher) -> Vec<u32> {
        let mask = m.compute_mask_or_eos().unwrap();
        (0..140).filter(|&t| mask.is_allowed(t)).collect()
    }

    #[test]
    fn a_choice_allows_only_its_strings_then_eos() {
        let c = compiler();
        let mut m = c.compile(&StructuredOutput::Choice(vec!["yes".into(), "no".into()])).unwrap();
        let first = allowed(&mut m);
        assert!(first.contains(&(b'y' as u32)) && first.contains(&(b'n' as u32)) && first.contains(&128));
        assert!(!first.contains(&(b'x' as u32)) && !first.contains(&132), "{first:?}");
        m.consume_tokens(&[128]).unwrap();
        assert_eq!(allowed(&mut m), vec![132]);
    }

    #[test]
    fn json_is_compact_and_bad_constraints_are_refused_with_the_reason() {
        let c = compiler();
        let mut m = c.compile(&StructuredOutput::JsonObject).unwrap();
        assert_eq!(allowed(&mut m), vec![b'{' as u32]);
        m.consume_tokens(&[b'{' as u32]).unwrap();
        assert!(!allowed(&mut m).contains(&(b' ' as u32)));

        let schema = StructuredOutput::JsonSchema(r#"{"type": "integer", "minimum": 5, "maximum": 3}"#.into());
        assert!(c.compile(&schema).is_err());
        let err = c.compile(&StructuredOutput::JsonSchema("{not json".into())).err().unwrap();
        assert!(err.0.contains("not JSON"), "{err}");
        assert!(c.compile(&StructuredOutput::Regex("(unclosed".into())).is_err());
        assert!(c.compile(&StructuredOutput::Lark("start: missing_rule".into())).is_err());
        assert!(c.compile(&StructuredOutput::Choice(vec![])).is_err());
        assert!(c.compile(&StructuredOutput::Regex("[a-c]+x".into())).is_ok());
    }

    #[test]
    fn choices_are_literal_and_the_vocabulary_is_sized_to_the_model() {
        let c = compiler();
        assert_eq!(c.vocab_size(), 140);
        let mut m = c.compile(&StructuredOutput::Choice(vec!["a.b".into(), "(c)".into()])).unwrap();
        m.consume_tokens(&[b'a' as u32]).unwrap();
        assert_eq!(allowed(&mut m), vec![b'.' as u32]);
        assert!(GrammarCompiler::from_token_bytes(vec![vec![b'a']], 4, &[]).is_err());
        assert!(GrammarCompiler::from_token_bytes(vec![vec![b'a']], 4, &[9]).is_err());
    }
}
