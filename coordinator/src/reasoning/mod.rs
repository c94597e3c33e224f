//! Reasoning split from the answer, as reasoning models write it: the
//! thinking between `<think>` and `</think>`, the answer after.
//!
//! - `qwen3` (Qwen3, QwQ): the output opens its thinking with `<think>`;
//!   an output that does not start with it (thinking switched off, the
//!   template's empty `<think></think>` in the prompt) is all answer.
//! - `deepseek_r1` (DeepSeek-R1 and its distills): the template opens the
//!   thinking in the prompt, so the output starts inside it (a `<think>`
//!   it repeats is dropped) and everything up to `</think>` is reasoning.
//!
//! - `gpt_oss` (gpt-oss): Harmony's `analysis` channel is the reasoning,
//!   `final` (and a preamble on `commentary`) the answer; a message to a
//!   tool is passed on whole to the tool-call parser (`crate::harmony`).
//!
//! [`ReasoningSplitter`] works on a stream: a piece of a tag at the end of
//! a delta is held back until the next one shows whether it is the tag,
//! so splitting the text anywhere gives the same reasoning and answer.

use std::str::FromStr;

pub mod grammar;

use crate::harmony::{HarmonyReader, Piece, call_text};
use crate::text::held_prefix;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// A reasoning format (vLLM's `--reasoning-parser` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    Qwen3,
    DeepSeekR1,
    GptOss,
}

impl ReasoningFormat {
    /// The format a chat template's model thinks in, from what the
    /// template writes: Harmony's channels; DeepSeek-R1's generation prompt,
    /// which opens `<think>` (its distills'); a template that shows or closes
    /// `<think>` in history or the prompt (Qwen3, QwQ, GLM-4.5).
    pub fn detect(template_source: &str) -> Option<Self> {
        let has = |marker: &str| template_source.contains(marker);
        if has("<|channel|>") {
            Some(Self::GptOss)
        } else if has("<｜Assistant｜><think>") {
            Some(Self::DeepSeekR1)
        } else if has("<think>") || has("</think>") {
            Some(Self::Qwen3)
        } else {
            None
        }
    }

    /// vLLM's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::DeepSeekR1 => "deepseek_r1",
            Self::GptOss => "gpt_oss",
        }
    }

    /// The format's markers are special tokens (Harmony's): its output is
    /// decoded with them kept.
    pub fn needs_special_tokens(self) -> bool {
        self == Self::GptOss
    }
}

impl std::fmt::Display for ReasoningFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReasoningFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "qwen3" => Ok(Self::Qwen3),
            "deepseek_r1" => Ok(Self::DeepSeekR1),
            "gpt_oss" => Ok(Self::GptOss),
            other => Err(format!("unknown reasoning parser {other:?} (qwen3, deepseek_r1, gpt_oss)")),
        }
    }
}

/// Text of a delta, split.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not yet known whether the output opens with `<think>` (qwen3), or
    /// whether a repeated `<think>` starts it (deepseek_r1).
    Start,
    Reasoning,
    Answer,
}

/// One output's split, fed its text as it streams.
#[derive(Debug)]
pub struct ReasoningSplitter {
    format: ReasoningFormat,
    state: State,
    /// Text not yet given out: a possible tag's start.
    held: String,
    /// `gpt_oss`: the Harmony messages.
    harmony: Option<HarmonyReader>,
}

impl ReasoningSplitter {
    pub fn new(format: ReasoningFormat) -> Self {
        let harmony = (format == ReasoningFormat::GptOss).then(HarmonyReader::new);
        Self { format, state: State::Start, held: String::new(), harmony }
    }

    /// Harmony's pieces, split: a call goes on to the answer as its markup.
    fn harmony_split(pieces: Vec<Piece>) -> Split {
        let mut out = Split::default();
        for piece in pieces {
            match &piece {
                Piece::Reasoning(text) => out.reasoning.push_str(text),
                Piece::Answer(text) => out.content.push_str(text),
                call => out.content.push_str(&call_text(call).unwrap_or_default()),
            }
        }
        out
    }

    /// The next piece of output, split; a tag's possible start is held.
    pub fn push(&mut self, text: &str) -> Split {
        if let Some(reader) = &mut self.harmony {
            return Self::harmony_split(reader.push(text));
        }
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if let Some(thinking) = trimmed.strip_prefix(OPEN) {
                        self.held = thinking.to_string();
                        self.state = State::Reasoning;
                    } else if OPEN.starts_with(trimmed) {
                        return out; // all of it could still be the tag
                    } else {
                        self.state = match self.format {
                            ReasoningFormat::DeepSeekR1 => State::Reasoning,
                            ReasoningFormat::Qwen3 | ReasoningFormat::GptOss => State::Answer,
                        };
                    }
                }
                State::Reasoning => match self.held.find(CLOSE) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.state = State::Answer;
                    }
                    None => {
                        let keep = held_prefix(&self.held, CLOSE);
                        let give = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..give]);
                        self.held.drain(..give);
                        return out;
                    }
                },
                State::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The output ended: what was held goes where it stood.
    pub fn finish(&mut self) -> Split {
        if let Some(reader) = &mut self.harmony {
            return Self::harmony_split(reader.finish());
        }
        let held = std::mem::take(&mut self.held);
        match (self.state, self.format) {
            (State::Reasoning, _) | (State::Start, ReasoningFormat::DeepSeekR1) => {
                Split { reasoning: held, content: String::new() }
            }
            _ => Split { reasoning: String::new(), content: held },
        }
    }

    /// A whole output, split.
    pub fn whole(format: ReasoningFormat, text: &str) -> Split {
        let mut splitter = Self::new(format);
        let mut out = splitter.push(text);
        let rest = splitter.finish();
        out.reasoning.push_str(&rest.reasoning);
        out.content.push_str(&rest.content);
        out
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn whole(format: ReasoningFormat, text: &str) -> (String, String) {
        let s = ReasoningSplitter::whole(format, text);
        (s.reasoning, s.content)
    }

    #[test]
    fn qwen3_thinks_only_when_it_opens_a_think_tag() {
        let q = ReasoningFormat::Qwen3;
        assert_eq!(whole(q, "<think>\nhm\n</think>\n\nHi"), ("\nhm\n".into(), "\n\nHi".into()));
        assert_eq!(whole(q, "Hi <think>x</think>"), (String::new(), "Hi <think>x</think>".into()));
        assert_eq!(whole(q, "<think>never closed"), ("never closed".into(), String::new()));
        assert_eq!(whole(q, "<thi"), (String::new(), "<thi".into()));
        assert_eq!(whole(q, ""), (String::new(), String::new()));
    }

    #[test]
    fn deepseek_r1_starts_inside_its_thinking() {
        let r1 = ReasoningFormat::DeepSeekR1;
        assert_eq!(whole(r1, "hm</think>Hi"), ("hm".into(), "Hi".into()));
        assert_eq!(whole(r1, "<think>hm</think>Hi"), ("hm".into(), "Hi".into()));
        assert_eq!(whole(r1, "all thinking"), ("all thinking".into(), String::new()));
        assert_eq!(whole(r1, "a</think>b</think>c"), ("a".into(), "b</think>c".into()));
    }

    #[test]
    fn gpt_oss_reasons_on_the_analysis_channel() {
        let g = ReasoningFormat::GptOss;
        let text = "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!";
        assert_eq!(whole(g, text), ("User greets.".into(), "Hi!".into()));
        // A call goes on whole to the tool-call parser.
        let text = "<|channel|>analysis<|message|>Look up.<|end|><|start|>assistant<|channel|>commentary \
                    to=functions.f <|constrain|>json<|message|>{}";
        assert_eq!(
            whole(g, text),
            ("Look up.".into(), "<|channel|>commentary to=functions.f<|message|>{}<|call|>".into())
        );
        assert_eq!(ReasoningFormat::detect("{{- '<|channel|>analysis' }}"), Some(g));
        assert_eq!(ReasoningFormat::detect("{{'<｜Assistant｜><think>\\n'}}"), Some(ReasoningFormat::DeepSeekR1));
        assert_eq!(ReasoningFormat::detect("{{ '<think>\\n\\n</think>' }}"), Some(ReasoningFormat::Qwen3));
        assert_eq!(ReasoningFormat::detect("{{ messages }}"), None);
    }

    /// The templates published with the models (text/testdata/published):
    /// each one's reasoning format.
    #[test]
    fn published_templates_name_their_reasoning() {
        let published = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/testdata/published");
        for (file, format) in [
            ("qwen3.jinja", Some(ReasoningFormat::Qwen3)),
            ("glm-4.6.jinja", Some(ReasoningFormat::Qwen3)),
            ("gpt-oss.jinja", Some(ReasoningFormat::GptOss)),
            ("deepseek-r1-distill-qwen.jinja", Some(ReasoningFormat::DeepSeekR1)),
            ("qwen3-coder.jinja", None),
            ("mistral-nemo.jinja", None),
        ] {
            let source = std::fs::read_to_string(published.join(file)).expect(file);
            assert_eq!(ReasoningFormat::detect(&source), format, "{file}");
        }
    }

    proptest! {
        /// Streamed in pieces cut at every char boundary, the split is the
        /// whole text's.
        #[test]
        fn every_cut_gives_the_whole_split(
            parts in proptest::collection::vec(prop_oneof![
                Just("<think>".to_string()), Just("</think>".to_string()), Just("<".to_string()),
                Just("</th".to_string()), "[a-z é\n]{0,6}", Just("<|channel|>".to_string()),
                Just("<|message|>".to_string()), Just("analysis".to_string()), Just("<|end|>".to_string()),
                Just("<|start|>assistant".to_string()), Just(" to=functions.f".to_string()),
            ], 0..8),
            cut in 1usize..9,
            which in 0..3usize,
        ) {
            let text: String = parts.concat();
            let format = [ReasoningFormat::DeepSeekR1, ReasoningFormat::Qwen3, ReasoningFormat::GptOss][which];
            let want = ReasoningSplitter::whole(format, &text);
            let mut splitter = ReasoningSplitter::new(format);
            let mut got = Split::default();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(cut) {
                let s = splitter.push(&piece.iter().collect::<String>());
                got.reasoning.push_str(&s.reasoning);
                got.content.push_str(&s.content);
            }
            let rest = splitter.finish();
            got.reasoning.push_str(&rest.reasoning);
            got.content.push_str(&rest.content);
            prop_assert_eq!(got, want);
        }
    }
}
