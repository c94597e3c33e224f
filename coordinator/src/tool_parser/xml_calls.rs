//! Finds Qwen3-Coder's tool calls in its output as it streams, as vLLM's
//! `qwen3_coder` parser does:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! A parameter's value is text, typed by the tool's schema: a string stays
//! one; an integer, number or boolean is read as one; an object or array as
//! JSON; `null` is null; a value that does not read as its type, or a
//! parameter the schema does not declare, stays a string. The arguments
//! stream as JSON, a parameter at a time (a value's type is known only
//! once it is whole): `{"city": "Paris"`, then `, "days": 3`, then `}`.
//!
//! As in the JSON formats, no markup is shown as content, text that may
//! become a marker is held back, and the events do not depend on how the
//! text was split.

use std::collections::HashMap;

use serde_json::Value;

use super::{Events, Function, ToolEvent, valid_name};
use crate::text::held_prefix;

const BLOCK_OPEN: &str = "<tool_call>";
const BLOCK_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAMETER_OPEN: &str = "<parameter=";
const PARAMETER_CLOSE: &str = "</parameter>";

enum State {
    /// Outside calls: text, up to `<tool_call>` or a bare `<function=`.
    Text,
    /// After `<tool_call>`: a function or the block's end.
    Block,
    /// After `<function=`: the name, up to `>`.
    Name,
    /// Inside a function: a parameter or the function's end.
    Params,
    /// After `<parameter=`: the parameter's name, up to `>`.
    ParamName,
    /// A parameter's value, up to `</parameter>`.
    Value(String),
    /// After `</function>`: the block's end, another function, or text.
    AfterFunction,
}

pub struct XmlCalls {
    /// Each function's parameters' JSON types, from the request's tools.
    types: HashMap<String, HashMap<String, Vec<String>>>,
    state: State,
    buf: String,
    /// The markup read since the call's opening, shown as text if it turns
    /// out to be no call.
    raw: String,
    /// The function being read.
    function: String,
    /// Parameters written into the current call's arguments.
    params: usize,
    out: Events,
}

impl XmlCalls {
    pub fn new(functions: &[Function]) -> Self {
        let types = functions.iter().map(|f| (f.name.clone(), parameter_types(&f.parameters))).collect();
        Self {
            types,
            state: State::Text,
            buf: String::new(),
            raw: String::new(),
            function: String::new(),
            params: 0,
            out: Events::default(),
        }
    }

    pub fn calls(&self) -> usize {
        self.out.calls()
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        while self.step() {}
        self.out.take()
    }

    pub fn finish(&mut self) -> Vec<ToolEvent> {
        while self.step() {}
        let rest = std::mem::take(&mut self.buf);
        match std::mem::replace(&mut self.state, State::Text) {
            // After calls, an unfinished `<tool_call>` is the next call cut short, not text.
            State::Text if self.out.calls() > 0 && BLOCK_OPEN.starts_with(rest.as_str()) => {}
            State::Text => self.out.outside(&rest),
            State::Block | State::Name => {
                let raw = std::mem::take(&mut self.raw);
                self.out.outside(&format!("{raw}{rest}"));
            }
            // Cut inside a value: the value as far as it got.
            State::Value(param) => self.parameter(&param, &rest),
            State::Params | State::ParamName => {}
            State::AfterFunction if BLOCK_CLOSE.starts_with(rest.trim_start()) => {}
            State::AfterFunction => self.out.outside(&rest),
        }
        self.out.finish()
    }

    /// Decides on some of `buf`; false when it needs more text.
    fn step(&mut self) -> bool {
        match &self.state {
            State::Text => {
                let found = [BLOCK_OPEN, FUNCTION_OPEN].into_iter().filter_map(|m| Some((self.buf.find(m)?, m))).min();
                if let Some((i, marker)) = found {
                    let before = self.buf[..i].to_string();
                    self.buf.drain(..i + marker.len());
                    self.out.outside(&before);
                    self.raw = marker.to_string();
                    self.state = if marker == BLOCK_OPEN { State::Block } else { State::Name };
                    return true;
                }
                let held = held_prefix(&self.buf, BLOCK_OPEN).max(held_prefix(&self.buf, FUNCTION_OPEN));
                let sure = self.buf.len() - held;
                let text: String = self.buf.drain(..sure).collect();
                self.out.outside(&text);
                sure > 0
            }
            State::Block => match self.next_marker(&[FUNCTION_OPEN, BLOCK_CLOSE]) {
                Next::Wait => false,
                Next::Marker(FUNCTION_OPEN) => {
                    self.raw.push_str(FUNCTION_OPEN);
                    self.state = State::Name;
                    true
                }
                // An empty block: nothing.
                Next::Marker(_) => {
                    self.raw.clear();
                    self.state = State::Text;
                    true
                }
                Next::Other => self.not_a_call(),
            },
            State::Name => {
                let Some(end) = self.buf.find('>') else {
                    // A name is short and on one line: anything else is text.
                    if self.buf.len() > 64 || self.buf.contains('\n') {
                        return self.not_a_call();
                    }
                    return false;
                };
                let name = self.buf[..end].trim().to_string();
                if self.buf[..end].contains('\n') || !valid_name(&name) {
                    return self.not_a_call();
                }
                self.buf.drain(..=end);
                self.raw.clear();
                self.out.start_call(name.clone());
                self.function = name;
                self.params = 0;
                self.state = State::Params;
                true
            }
            State::Params => match self.next_marker(&[PARAMETER_OPEN, FUNCTION_CLOSE]) {
                Next::Wait => false,
                Next::Marker(PARAMETER_OPEN) => {
                    self.state = State::ParamName;
                    true
                }
                Next::Marker(_) => {
                    self.out.arguments(if self.params == 0 { "{}" } else { "}" }.to_string());
                    self.out.end_call();
                    self.state = State::AfterFunction;
                    true
                }
                // Stray text inside a function: skipped up to the next tag.
                Next::Other => {
                    let first = self.buf.chars().next().map_or(1, char::len_utf8);
                    let skip = self.buf[first..].find('<').map_or(self.buf.len(), |i| i + first);
                    self.buf.drain(..skip);
                    true
                }
            },
            State::ParamName => {
                let Some(end) = self.buf.find('>') else { return false };
                let param = self.buf[..end].trim().to_string();
                self.buf.drain(..=end);
                self.state = State::Value(param);
                true
            }
            State::Value(param) => {
                // A value ends at its closing tag, or where the model went on
                // to the next parameter or the function's end without one.
                let ends = [PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE];
                let Some((i, marker)) = ends.into_iter().filter_map(|m| Some((self.buf.find(m)?, m))).min() else {
                    return false;
                };
                let param = param.clone();
                let value = self.buf[..i].to_string();
                let used = if marker == PARAMETER_CLOSE { i + marker.len() } else { i };
                self.buf.drain(..used);
                self.parameter(&param, &value);
                self.state = State::Params;
                true
            }
            State::AfterFunction => match self.next_marker(&[BLOCK_CLOSE, FUNCTION_OPEN]) {
                Next::Wait => false,
                Next::Marker(BLOCK_CLOSE) => {
                    self.state = State::Text;
                    true
                }
                Next::Marker(_) => {
                    self.state = State::Name;
                    true
                }
                Next::Other => {
                    self.state = State::Text;
                    true
                }
            },
        }
    }

    /// The opening read so far was no call: its markup is text, and what
    /// follows is read again as text.
    fn not_a_call(&mut self) -> bool {
        let raw = std::mem::take(&mut self.raw);
        self.out.outside(&raw);
        self.state = State::Text;
        true
    }

    /// After whitespace: which of `markers` comes next (consumed, with the
    /// whitespace), or other text (left in place).
    fn next_marker(&mut self, markers: &[&'static str]) -> Next {
        let trimmed = self.buf.trim_start();
        if let Some(&marker) = markers.iter().find(|m| trimmed.starts_with(**m)) {
            let used = self.buf.len() - trimmed.len() + marker.len();
            let taken: String = self.buf.drain(..used).collect();
            self.raw.push_str(&taken[..taken.len() - marker.len()]);
            return Next::Marker(marker);
        }
        if trimmed.is_empty() || markers.iter().any(|m| m.starts_with(trimmed)) {
            return Next::Wait;
        }
        Next::Other
    }

    /// One parameter written into the call's arguments.
    fn parameter(&mut self, param: &str, value: &str) {
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let types = self.types.get(&self.function).and_then(|p| p.get(param));
        let typed = typed_value(value, types.map(Vec::as_slice).unwrap_or_default());
        let key = Value::String(param.to_string());
        let separator = if self.params == 0 { "{" } else { ", " };
        self.params += 1;
        self.out.arguments(format!("{separator}{key}: {typed}"));
    }
}

enum Next {
    Wait,
    Marker(&'static str),
    Other,
}

/// Each declared parameter's JSON types (`type` as a name or a list, or
/// the types of an `anyOf`/`oneOf`).
fn parameter_types(parameters: &Value) -> HashMap<String, Vec<String>> {
    let Some(properties) = parameters.get("properties").and_then(Value::as_object) else {
        return HashMap::new();
    };
    properties.iter().map(|(name, schema)| (name.clone(), schema_types(schema))).collect()
}

fn schema_types(schema: &Value) -> Vec<String> {
    let mut types = Vec::new();
    match schema.get("type") {
        Some(Value::String(t)) => types.push(t.clone()),
        Some(Value::Array(list)) => types.extend(list.iter().filter_map(Value::as_str).map(String::from)),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        for option in schema.get(key).and_then(Value::as_array).into_iter().flatten() {
            types.extend(schema_types(option));
        }
    }
    if types.is_empty() && schema.get("enum").is_some() {
        types.push("enum".into());
    }
    types
}

/// A parameter's text as the JSON value its types make it (see the module
/// comment): the first type it reads as, else a string.
fn typed_value(text: &str, types: &[String]) -> Value {
    if text.trim().eq_ignore_ascii_case("null") && !types.iter().all(|t| t == "string") {
        return Value::Null;
    }
    for t in types {
        let trimmed = text.trim();
        let value = match t.as_str() {
            "string" => return Value::String(text.to_string()),
            "integer" => trimmed.parse::<i64>().ok().map(Value::from),
            "number" => match serde_json::from_str::<Value>(trimmed) {
                Ok(Value::Number(n)) => Some(Value::Number(n)),
                _ => None,
            },
            "boolean" => match trimmed.to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "object" | "array" | "enum" => serde_json::from_str::<Value>(trimmed)
                .ok()
                .filter(|v| t == "enum" || (t == "object") == v.is_object() && (t == "array") == v.is_array()),
            "null" if trimmed.eq_ignore_ascii_case("null") => Some(Value::Null),
            _ => None,
        };
        if let Some(value) = value {
            return value;
        }
    }
    Value::String(text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_parser::ToolFormat;
    use crate::tool_parser::testing::{call, cut, fold, parse_every_way, streamed};
    use serde_json::json;

    fn tools() -> Vec<Function> {
        vec![
            Function {
                name: "get_weather".into(),
                parameters: json!({"type": "object", "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "scale": {"type": ["number", "null"]},
                    "at": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                }}),
            },
            Function { name: "now".into(), parameters: json!({}) },
        ]
    }

    fn every_way(text: &str) -> (String, Vec<(String, String)>) {
        parse_every_way(ToolFormat::Qwen3Coder, &tools(), text, &["<", "parameter"])
    }

    #[test]
    fn calls_with_typed_parameters() {
        let text = "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n\
                    <parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n\
                    1.5\n</parameter>\n<parameter=at>\n{\"lat\": 1}\n</parameter>\n<parameter=tags>\n[\"a\"]\n\
                    </parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>";
        let (content, calls) = every_way(text);
        assert_eq!(content, "I will check.");
        assert_eq!(
            calls,
            [
                call(
                    "get_weather",
                    r#"{"city": "São Paulo", "days": 3, "metric": true, "scale": 1.5, "at": {"lat":1}, "tags": ["a"]}"#
                ),
                call("now", "{}")
            ]
        );
        let parsed: Value = serde_json::from_str(&calls[0].1).expect("arguments are JSON");
        assert_eq!(parsed["days"], 3);
    }

    #[test]
    fn values_that_do_not_read_as_their_type_stay_strings() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=scale>\n\
                    null\n</parameter>\n<parameter=extra>\n42\n</parameter>\n<parameter=city>\na < b\nc\n</parameter>\n\
                    </function>\n</tool_call>";
        let (_, calls) = parse_every_way(ToolFormat::Qwen3Coder, &tools(), text, &["<tool", "parameter"]);
        assert_eq!(
            calls,
            [call("get_weather", r#"{"days": "three", "scale": null, "extra": "42", "city": "a < b\nc"}"#)]
        );
        // A function the request did not offer: every value a string.
        let text = "<tool_call><function=other><parameter=n>1</parameter></function></tool_call>";
        assert_eq!(every_way(text).1, [call("other", r#"{"n": "1"}"#)]);
    }

    #[test]
    fn calls_without_the_block_or_closing_tags() {
        // A bare <function=...>, and a parameter left unclosed before the next one.
        let text = "<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>";
        assert_eq!(every_way(text), (String::new(), vec![call("get_weather", r#"{"city": "Rome", "days": 2}"#)]));
    }

    #[test]
    fn text_that_is_no_call_passes_unchanged() {
        for text in ["a <tool and <function", "<tool_call>\nnot a call", "x <function=a b> y", "", "  hi  "] {
            assert_eq!(every_way(text), (text.to_string(), vec![]), "{text:?}");
        }
    }

    #[test]
    fn cut_short() {
        // Inside a value: the value as far as it got, the object left open.
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
        assert_eq!(every_way(text), (String::new(), vec![call("get_weather", r#"{"city": "Par""#)]));
        // Inside the name: text.
        let text = "Hi <tool_call>\n<function=get_wea";
        assert_eq!(every_way(text), (text.to_string(), vec![]));
    }

    #[test]
    fn arguments_stream_a_parameter_at_a_time() {
        let mut parser = crate::tool_parser::ToolCallParser::new(ToolFormat::Qwen3Coder, &tools());
        assert_eq!(
            parser.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"),
            [ToolEvent::CallStart { index: 0, name: "get_weather".into() }]
        );
        assert_eq!(
            parser.push("ris\n</parameter>\n"),
            [ToolEvent::Arguments { index: 0, fragment: r#"{"city": "Paris""#.into() }]
        );
        assert_eq!(parser.push("</function>"), [ToolEvent::Arguments { index: 0, fragment: "}".into() }]);
        assert_eq!(parser.finish(), []);
    }

    const PIECES: [&str; 16] = [
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "<function=",
        "now>",
        "</function>",
        "<parameter=days>",
        "<parameter=",
        "city>",
        "</parameter>",
        "<tool",
        "\n",
        "3",
        "ü x",
        "<",
        ">",
    ];

    proptest::proptest! {
        #[test]
        fn any_split_gives_the_same_result(
            picks in proptest::collection::vec(0..PIECES.len(), 0..40),
            cuts in proptest::collection::vec(0..usize::MAX, 0..6),
        ) {
            let text: String = picks.iter().map(|&i| PIECES[i]).collect();
            let tools = tools();
            let whole = fold(&crate::tool_parser::ToolCallParser::parse(ToolFormat::Qwen3Coder, &tools, &text));
            proptest::prop_assert_eq!(fold(&streamed(ToolFormat::Qwen3Coder, &tools, &cut(&text, &cuts))), whole);
        }
    }
}
