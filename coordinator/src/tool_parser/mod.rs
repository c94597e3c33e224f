//! Tool calling's text side: which format a model writes its calls in,
//! the streaming parser that finds them in the output (`parser`, over the
//! JSON scanner in `json_scan`), and the Lark grammar that forces a call
//! when a request requires one (`grammar`). The HTTP side (request fields,
//! response shapes) lives in `api::tool_calls`.
//!
//! The formats follow vLLM's parsers of the same names: `hermes` (Hermes,
//! Qwen 2.5/3: `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`)
//! and `llama3_json` (Llama 3.1/3.2: `{"name": ..., "parameters": ...}`,
//! optionally after `<|python_tag|>`, several joined by `; `).

pub mod grammar;
mod json_scan;
pub mod parser;

pub use grammar::call_grammar;
pub use parser::{ToolCallParser, ToolEvent};

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
}

impl ToolFormat {
    /// The format a chat template asks its model for, from the markers it
    /// writes: Hermes' `<tool_call>` tag; Llama 3.1's `<|python_tag|>` or its
    /// JSON instruction (`"parameters": dictionary of argument name ...`).
    pub fn detect(template_source: &str) -> Option<Self> {
        if template_source.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if template_source.contains("<|python_tag|>") || template_source.contains("\"parameters\": dictionary") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// vLLM's `--tool-call-parser` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
        }
    }
}

impl std::str::FromStr for ToolFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hermes" => Ok(Self::Hermes),
            "llama3_json" => Ok(Self::Llama3Json),
            other => Err(format!("unknown tool-call parser {other:?} (known: hermes, llama3_json)")),
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
        assert!("mistral".parse::<ToolFormat>().is_err());
    }
}
