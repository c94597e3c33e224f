//! Tool calling's text side: which format a model writes its calls in,
//! the streaming parsers that find them in the output, and the Lark
//! grammar that forces a call when a request requires one (`grammar`).
//! The HTTP side (request fields, response shapes) lives in
//! `api::tool_calls`.
//!
//! The formats follow vLLM's parsers of the same names:
//! * `hermes`, `llama3_json` and `mistral`: calls as JSON (`json_calls`);
//! * `qwen3_coder`: Qwen3-Coder's XML, `<function=NAME>` with one
//!   `<parameter=NAME>` per argument, typed by the tool's schema (`xml_calls`);
//! * `harmony` (vLLM's `openai`): gpt-oss's messages to `functions.NAME`
//!   (`harmony_calls`, over `crate::harmony`'s reader).

pub mod grammar;
mod harmony_calls;
mod json_calls;
mod json_scan;
mod xml_calls;

pub use grammar::call_grammar;

use json_calls::{JsonCalls, Style};
use xml_calls::XmlCalls;

use harmony_calls::HarmonyCalls;

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Qwen3Coder,
    Mistral(MistralCalls),
    Harmony,
}

/// Mistral's two ways of writing calls after `[TOOL_CALLS]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MistralCalls {
    /// A JSON list of `{"name", "arguments"}` objects (Mistral Nemo, the v3 tokenizers).
    List,
    /// `NAME[ARGS]{...}`, one marker per call (the v11 tokenizers and later).
    Args,
}

impl ToolFormat {
    /// The format a chat template asks its model for, from the markers it
    /// writes: gpt-oss's `<|channel|>`; Qwen3-Coder's `<function=` inside
    /// `<tool_call>`; Hermes' `<tool_call>`; Mistral's `[TOOL_CALLS]`;
    /// Llama 3.1's `<|python_tag|>` or its JSON instruction (`"parameters":
    /// dictionary of argument name ...`).
    pub fn detect(template_source: &str) -> Option<Self> {
        let has = |marker: &str| template_source.contains(marker);
        if has("<|channel|>") {
            Some(Self::Harmony)
        } else if has("<tool_call>") && has("<function=") {
            Some(Self::Qwen3Coder)
        } else if has("<tool_call>") {
            Some(Self::Hermes)
        } else if has("[TOOL_CALLS]") {
            Some(Self::Mistral(MistralCalls::List).for_template(template_source))
        } else if has("<|python_tag|>") || has("\"parameters\": dictionary") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// The format named on the command line, fitted to the template: a
    /// Mistral template that writes `[ARGS]` takes that way of writing calls.
    pub fn for_template(self, template_source: &str) -> Self {
        match self {
            Self::Mistral(_) if template_source.contains("[ARGS]") => Self::Mistral(MistralCalls::Args),
            other => other,
        }
    }

    /// vLLM's `--tool-call-parser` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Qwen3Coder => "qwen3_coder",
            Self::Mistral(_) => "mistral",
            Self::Harmony => "harmony",
        }
    }

    /// The format's markers are special tokens (`[TOOL_CALLS]`,
    /// `<|channel|>`): its output is decoded with them kept.
    pub fn needs_special_tokens(self) -> bool {
        matches!(self, Self::Mistral(_) | Self::Harmony)
    }
}

impl std::str::FromStr for ToolFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hermes" => Ok(Self::Hermes),
            "llama3_json" => Ok(Self::Llama3Json),
            "qwen3_coder" => Ok(Self::Qwen3Coder),
            "mistral" => Ok(Self::Mistral(MistralCalls::List)),
            "harmony" | "openai" => Ok(Self::Harmony),
            other => Err(format!(
                "unknown tool-call parser {other:?} (known: hermes, llama3_json, qwen3_coder, mistral, harmony)"
            )),
        }
    }
}

impl std::fmt::Display for ToolFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A function a request offers the model (OpenAI's `tools[i].function`),
/// checked: `parameters` is a JSON-schema object.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    pub name: String,
    pub parameters: serde_json::Value,
}

/// OpenAI's rule for function names, with `.` and `:` also allowed (MCP
/// tools use them).
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside calls.
    Content(String),
    /// Call number `index` (from 0) begins: its function's name.
    CallStart { index: usize, name: String },
    /// The next piece of call `index`'s arguments (JSON text).
    Arguments { index: usize, fragment: String },
}

/// Finds tool calls in one output as it streams, in any format. Every
/// parser gives the same events however the text was split.
pub enum ToolCallParser {
    Json(JsonCalls),
    Xml(XmlCalls),
    Harmony(HarmonyCalls),
}

impl ToolCallParser {
    /// A parser for `format`; `functions` type Qwen3-Coder's parameters.
    pub fn new(format: ToolFormat, functions: &[Function]) -> Self {
        match format {
            ToolFormat::Hermes => Self::Json(JsonCalls::new(Style::Hermes)),
            ToolFormat::Llama3Json => Self::Json(JsonCalls::new(Style::Llama3)),
            ToolFormat::Mistral(_) => Self::Json(JsonCalls::new(Style::Mistral)),
            ToolFormat::Qwen3Coder => Self::Xml(XmlCalls::new(functions)),
            ToolFormat::Harmony => Self::Harmony(HarmonyCalls::new()),
        }
    }

    /// Everything in a whole output, as the events of a stream.
    pub fn parse(format: ToolFormat, functions: &[Function], text: &str) -> Vec<ToolEvent> {
        let mut parser = Self::new(format, functions);
        let mut events = parser.push(text);
        events.extend(parser.finish());
        events
    }

    /// The events `text` makes certain.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        match self {
            Self::Json(p) => p.push(text),
            Self::Xml(p) => p.push(text),
            Self::Harmony(p) => p.push(text),
        }
    }

    /// The output ended: what was held back is decided.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        match self {
            Self::Json(p) => p.finish(),
            Self::Xml(p) => p.finish(),
            Self::Harmony(p) => p.finish(),
        }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        match self {
            Self::Json(p) => p.calls(),
            Self::Xml(p) => p.calls(),
            Self::Harmony(p) => p.calls(),
        }
    }
}

/// The events a parser has made certain, with the rules all formats share
/// for the text around calls: content is sent up to its last
/// non-whitespace character (whitespace waits until text follows it), and
/// whitespace right after a call, or before calls when there is no text,
/// is dropped.
#[derive(Default)]
pub(crate) struct Events {
    events: Vec<ToolEvent>,
    /// Whitespace outside calls, held until text follows it.
    pending_ws: String,
    /// A call ended and no text came after it yet.
    after_call: bool,
    calls: usize,
}

impl Events {
    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Text outside calls.
    pub fn outside(&mut self, text: &str) {
        self.pending_ws.push_str(text);
        let Some((last, c)) = self.pending_ws.char_indices().rev().find(|(_, c)| !c.is_whitespace()) else {
            return;
        };
        let rest = self.pending_ws.split_off(last + c.len_utf8());
        let sure = std::mem::replace(&mut self.pending_ws, rest);
        let sure = if self.after_call { sure.trim_start().to_string() } else { sure };
        self.after_call = false;
        self.emit(ToolEvent::Content(sure));
    }

    /// A call begins, named.
    pub fn start_call(&mut self, name: String) {
        let index = self.calls;
        self.calls += 1;
        self.pending_ws.clear();
        self.emit(ToolEvent::CallStart { index, name });
    }

    /// The next piece of the last call's arguments.
    pub fn arguments(&mut self, fragment: String) {
        let index = self.calls.saturating_sub(1);
        self.emit(ToolEvent::Arguments { index, fragment });
    }

    /// A call ended and no text came after it yet.
    pub fn after_call(&self) -> bool {
        self.after_call
    }

    /// The last call ended: whitespace after it is dropped.
    pub fn end_call(&mut self) {
        self.after_call = true;
    }

    /// What was made certain since the last take.
    pub fn take(&mut self) -> Vec<ToolEvent> {
        std::mem::take(&mut self.events)
    }

    /// The output ended: held whitespace is content if there were no calls.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        if self.calls == 0 {
            let ws = std::mem::take(&mut self.pending_ws);
            self.emit(ToolEvent::Content(ws));
        }
        self.take()
    }

    /// Queues `event`, merged into the last one when it continues it.
    fn emit(&mut self, event: ToolEvent) {
        match (self.events.last_mut(), event) {
            (_, ToolEvent::Content(text) | ToolEvent::Arguments { fragment: text, .. }) if text.is_empty() => {}
            (Some(ToolEvent::Content(last)), ToolEvent::Content(text)) => last.push_str(&text),
            (Some(ToolEvent::Arguments { index: a, fragment: last }), ToolEvent::Arguments { index: b, fragment })
                if *a == b =>
            {
                last.push_str(&fragment)
            }
            (_, event) => self.events.push(event),
        }
    }
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_detected_from_their_markers() {
        let hermes = "{{- '<tool_call>\\n{\"name\": ' }}";
        assert_eq!(ToolFormat::detect(hermes), Some(ToolFormat::Hermes));
        let llama = "{{- '<|python_tag|>' }}";
        assert_eq!(ToolFormat::detect(llama), Some(ToolFormat::Llama3Json));
        let llama_json = "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name \
                          and its value}.";
        assert_eq!(ToolFormat::detect(llama_json), Some(ToolFormat::Llama3Json));
        assert_eq!(ToolFormat::detect("{{ messages[0].content }}"), None);
        assert_eq!("hermes".parse::<ToolFormat>(), Ok(ToolFormat::Hermes));
        assert_eq!("llama3_json".parse::<ToolFormat>().map(ToolFormat::name), Ok("llama3_json"));
        assert_eq!("openai".parse::<ToolFormat>(), Ok(ToolFormat::Harmony));
        assert!("pythonic".parse::<ToolFormat>().is_err());
    }

    /// The templates published with the models, as llama.cpp keeps them
    /// (coordinator/src/text/testdata/published): each one's format.
    #[test]
    fn published_templates_name_their_formats() {
        let published = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/testdata/published");
        for (file, format) in [
            ("qwen3.jinja", ToolFormat::Hermes),
            ("gpt-oss.jinja", ToolFormat::Harmony),
            ("qwen3-coder.jinja", ToolFormat::Qwen3Coder),
            ("mistral-nemo.jinja", ToolFormat::Mistral(MistralCalls::List)),
            ("mistral-small-3.2.jinja", ToolFormat::Mistral(MistralCalls::Args)),
            ("devstral-small.jinja", ToolFormat::Mistral(MistralCalls::Args)),
        ] {
            let source = std::fs::read_to_string(published.join(file)).expect(file);
            assert_eq!(ToolFormat::detect(&source), Some(format), "{file}");
        }
        let small = std::fs::read_to_string(published.join("mistral-small-3.2.jinja")).expect("template");
        let named: ToolFormat = "mistral".parse().expect("mistral");
        assert_eq!(named.for_template(&small), ToolFormat::Mistral(MistralCalls::Args));
    }
}
