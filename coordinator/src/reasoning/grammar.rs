//! The grammar side of reasoning: what a constrained output may write
//! before its constrained part. vLLM applies a structured output only once
//! the reasoning has ended; here the thinking is part of the grammar, free
//! text in the format's own markup, and the constraint follows it
//! (`StructuredOutput::Then`). Forced tool calls follow it the same way.

use common::StructuredOutput;
use serde_json::json;

use super::ReasoningFormat;

/// The id of a marker when the vocabulary has it as one special token.
pub type SpecialIds<'a> = &'a dyn Fn(&str) -> Option<u32>;

/// A marker in Lark: the special token it is (`<[id]>`), else its characters.
pub fn marker(special: SpecialIds, text: &str) -> String {
    match special(text) {
        Some(id) => format!("<[{id}]>"),
        None => json!(text).to_string(),
    }
}

/// Lark rules for rule `reasoning`: one stretch of thinking as `format`
/// writes it, up to where the answer starts.
/// * `qwen3`: `<think>...</think>` and the whitespace after it;
/// * `deepseek_r1`: the same, its `<think>` optional (the prompt opens it);
/// * `gpt_oss`: an `analysis` message and the next message's
///   `<|start|>assistant`.
pub fn thinking_rules(format: ReasoningFormat, special: SpecialIds) -> String {
    match format {
        ReasoningFormat::Qwen3 | ReasoningFormat::DeepSeekR1 => {
            let open = if format == ReasoningFormat::Qwen3 { "\"<think>\"" } else { "\"<think>\"?" };
            format!("reasoning: {open} thinking /[ \\n]*/\nthinking[suffix=\"</think>\"]: /(?s:.*)/\n")
        }
        ReasoningFormat::GptOss => {
            let [channel, message, end, start] =
                ["<|channel|>", "<|message|>", "<|end|>", "<|start|>"].map(|m| marker(special, m));
            // Free text up to the end marker: as one token, text cannot hold
            // it; as characters, the text stops at their first appearance.
            match special("<|end|>") {
                Some(_) => format!(
                    "reasoning: {channel} \"analysis\" {message} thinking {end} {start} \"assistant\"\n\
                     thinking: /(?s:.*)/\n"
                ),
                None => format!(
                    "reasoning: {channel} \"analysis\" {message} thinking {start} \"assistant\"\n\
                     thinking[suffix={end}]: /(?s:.*)/\n"
                ),
            }
        }
    }
}

/// `answer` after the thinking `format` may write first (gpt-oss's answer
/// is its `final` message).
pub fn then_answer(format: ReasoningFormat, special: SpecialIds, answer: StructuredOutput) -> StructuredOutput {
    let open = match format {
        ReasoningFormat::GptOss => {
            format!("{} \"final\" {} ", marker(special, "<|channel|>"), marker(special, "<|message|>"))
        }
        ReasoningFormat::Qwen3 | ReasoningFormat::DeepSeekR1 => String::new(),
    };
    let lark = format!("%llguidance {{}}\n\nstart: reasoning? {open}@answer\n{}", thinking_rules(format, special));
    StructuredOutput::Then { lark, answer: Box::new(answer) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::structured::GrammarCompiler;

    /// Whether `constraint` accepts `text` whole, then EOS, over a
    /// vocabulary of bytes with `specials` as one token each.
    fn accepts(constraint: &StructuredOutput, specials: &[&str], text: &str) -> bool {
        let mut tokens: Vec<Vec<u8>> = (0u8..=255).map(|b| vec![b]).collect();
        let first_special = tokens.len() as u32;
        tokens.extend(specials.iter().map(|m| [b"\xFF".as_slice(), m.as_bytes()].concat()));
        tokens.push(b"\xFF</s>".to_vec());
        let eos = tokens.len() as u32 - 1;
        let size = tokens.len();
        let compiler = GrammarCompiler::from_token_bytes(tokens, size, &[eos]).expect("vocabulary");
        let mut matcher = compiler.compile(constraint).unwrap_or_else(|e| panic!("{e}: {constraint:?}"));
        let mut pos = 0;
        while pos < text.len() {
            let found = specials.iter().position(|m| text.is_char_boundary(pos) && text[pos..].starts_with(m));
            let token = match found {
                Some(i) => {
                    pos += specials[i].len();
                    first_special + i as u32
                }
                None => {
                    pos += 1;
                    text.as_bytes()[pos - 1] as u32
                }
            };
            let allowed = matcher.compute_mask_or_eos().expect("mask").is_allowed(token);
            if !allowed || matcher.consume_tokens(&[token]).is_err() {
                return false;
            }
        }
        matcher.compute_mask_or_eos().expect("mask").is_allowed(eos)
    }

    #[test]
    fn a_constraint_applies_once_the_thinking_ends() {
        let schema = StructuredOutput::JsonSchema(
            r#"{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}"#.into(),
        );
        let harmony = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>"];
        let none: &[&str] = &[];
        for (format, specials, good, bad) in [
            (ReasoningFormat::Qwen3, none, "<think>\nHm, {n}.\n</think>\n\n{\"n\":1}", "{\"n\":\"x\"}"),
            (ReasoningFormat::Qwen3, none, "{\"n\":2}", "thinking without a tag {\"n\":2}"),
            (ReasoningFormat::DeepSeekR1, none, "Count.</think>\n\n{\"n\":3}", "{\"n\":3} and more"),
            (
                ReasoningFormat::GptOss,
                &harmony[..],
                "<|channel|>analysis<|message|>Count.<|end|><|start|>assistant<|channel|>final<|message|>{\"n\":4}",
                "<|channel|>final<|message|>{}",
            ),
            (
                ReasoningFormat::GptOss,
                none,
                "<|channel|>analysis<|message|>Count.<|end|><|start|>assistant<|channel|>final<|message|>{\"n\":5}",
                "<|channel|>analysis<|message|>{\"n\":5}",
            ),
        ] {
            let constraint = {
                let ids: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
                let special = |m: &str| ids.iter().position(|s| s == m).map(|i| 256 + i as u32);
                then_answer(format, &special, schema.clone())
            };
            assert!(accepts(&constraint, specials, good), "{format}: {good}");
            assert!(!accepts(&constraint, specials, bad), "{format} accepted {bad}");
        }
    }
}
