//! Finds tool calls written as JSON in a model's output as it streams, as
//! vLLM's `hermes`, `llama3_json` and `mistral` parsers do:
//!
//! * Hermes (Qwen 2.5/3): `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`;
//! * Llama 3.1/3.2: `{"name": ..., "parameters": ...}`, optionally after
//!   `<|python_tag|>`, several joined by `; `;
//! * Mistral: `[TOOL_CALLS]` then a list of call objects (Mistral Nemo and
//!   the v3 tokenizers) or, one call per marker, `NAME[ARGS]{...}` (the v11
//!   tokenizers: Mistral Small 3.2, Devstral, Magistral), with
//!   `[CALL_ID]id` before `[ARGS]` in some.
//!
//! Text is pushed in the pieces the detokenizer produces; events come out
//! as soon as they are certain: content outside calls, a call's start (its
//! name, once read whole), then its arguments as fragments of the model's
//! own text. No partial markup is shown as content: text that may be the
//! start of `<tool_call>` is held back until it is known not to be. A
//! call's opening `{"name": "...", "arguments": ` is read before anything
//! of it is sent; a call in another shape (keys swapped, say) is read
//! whole and parsed, and sent as text if it is no call after all.
//! Whitespace between calls and text is dropped, so the content of a
//! reply with calls is the words around them. The result does not depend
//! on how the text was split, and a whole output parses through the same
//! path.

use serde_json::Value;

use super::ToolEvent;
use super::json_scan::JsonScan;
use super::{Events, valid_name};
use crate::text::held_prefix;

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
pub(super) const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
pub(super) const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";
/// The keys a call's arguments go under (Hermes writes the first, Llama the second).
const ARGUMENT_KEYS: [&str; 2] = ["\"arguments\"", "\"parameters\""];

/// Which of the JSON formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    Hermes,
    Llama3,
    Mistral,
}

enum State {
    /// Hermes, Mistral: text outside calls. Llama 3: the start, before it
    /// is known whether the output is text or calls.
    Text,
    /// Llama 3: the output is text: all of it is content.
    PlainText,
    /// Llama 3: after `<|python_tag|>` or a call: a call, `;`, or text.
    BetweenCalls,
    /// A call's opening, `{"name": "...", "arguments": `, not yet read whole.
    Header,
    Arguments(JsonScan),
    /// Skipping whatever follows the arguments in the call's object.
    ObjectEnd(JsonScan),
    /// Hermes: skipping up to `</tool_call>`.
    CloseTag,
    /// A call in another shape, read whole before it is parsed: up to
    /// `</tool_call>` (Hermes) or the object's end (Llama 3, a Mistral
    /// list; `scanned` bytes of it seen).
    Whole {
        scan: JsonScan,
        scanned: usize,
    },
    /// Mistral, after `[TOOL_CALLS]`: a list, or a name and `[ARGS]`.
    MistralOpen,
    /// Mistral: `NAME[ARGS]` or `NAME[CALL_ID]id[ARGS]`, not yet read whole
    /// (the buffer still holds all of it, for text if it is no call).
    MistralName,
    /// Mistral's list: the next call or the list's end.
    ListItem,
    /// Mistral's list, after a call: `,` or `]`.
    ListNext,
}

pub struct JsonCalls {
    style: Style,
    state: State,
    /// Text received and not yet decided on.
    buf: String,
    /// Inside Mistral's list of calls.
    in_list: bool,
    out: Events,
}

impl JsonCalls {
    pub fn new(style: Style) -> Self {
        Self { style, state: State::Text, buf: String::new(), in_list: false, out: Events::default() }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.out.calls()
    }

    /// The events `text` makes certain.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        while self.step() {}
        self.out.take()
    }

    /// The output ended: what was held back is decided (an unfinished call
    /// opening is text; an unfinished call stays as far as it got).
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        while self.step() {}
        let rest = std::mem::take(&mut self.buf);
        match (&self.state, self.style) {
            // After calls, an unfinished opening marker is the next call cut short, not text.
            (State::Text, Style::Hermes) if self.out.calls() > 0 && CALL_OPEN.starts_with(rest.as_str()) => {}
            (State::Text, Style::Mistral) if self.out.calls() > 0 && MISTRAL_CALLS.starts_with(rest.as_str()) => {}
            (State::Text | State::PlainText | State::BetweenCalls | State::ListItem | State::ListNext, _) => {
                self.out.outside(&rest)
            }
            (State::MistralOpen | State::MistralName, _) => {
                self.out.outside(MISTRAL_CALLS);
                self.state = State::Text;
                self.buf = rest;
                return self.finish();
            }
            (State::Header | State::Whole { .. }, Style::Hermes) => {
                self.whole_call(&rest, &format!("{CALL_OPEN}{rest}"))
            }
            (State::Header | State::Whole { .. }, _) => self.whole_call(&rest, &rest),
            (State::Arguments(_) | State::ObjectEnd(_) | State::CloseTag, _) => {}
        }
        self.state = State::PlainText;
        self.out.finish()
    }

    /// Text up to `marker` is content and the state becomes `next`; a
    /// possible start of the marker is held. False when it needs more text.
    fn until_marker(&mut self, marker: &str, next: State) -> bool {
        if let Some(i) = self.buf.find(marker) {
            let before = self.buf[..i].to_string();
            self.buf.drain(..i + marker.len());
            self.out.outside(&before);
            self.state = next;
            return true;
        }
        let sure = self.buf.len() - held_prefix(&self.buf, marker);
        let text: String = self.buf.drain(..sure).collect();
        self.out.outside(&text);
        sure > 0
    }

    /// A call begins: its name is sent and its arguments' scan starts.
    fn start_call(&mut self, name: String) {
        self.out.start_call(name);
        self.state = State::Arguments(JsonScan::new());
    }

    /// Decides on some of `buf`; false when it needs more text.
    fn step(&mut self) -> bool {
        match &mut self.state {
            State::Text if self.style == Style::Hermes => self.until_marker(CALL_OPEN, State::Header),
            State::Text if self.style == Style::Mistral => self.until_marker(MISTRAL_CALLS, State::MistralOpen),
            State::Text => {
                let trimmed = self.buf.trim_start();
                if trimmed.starts_with(PYTHON_TAG) {
                    let end = self.buf.len() - trimmed.len() + PYTHON_TAG.len();
                    self.buf.drain(..end);
                    self.state = State::BetweenCalls;
                } else if trimmed.starts_with('{') {
                    let ws: String = self.buf.drain(..self.buf.len() - trimmed.len()).collect();
                    self.out.outside(&ws);
                    self.state = State::Header;
                } else if trimmed.is_empty() || PYTHON_TAG.starts_with(trimmed) {
                    return false;
                } else {
                    self.state = State::PlainText;
                }
                true
            }
            State::PlainText => {
                let text = std::mem::take(&mut self.buf);
                self.out.outside(&text);
                !text.is_empty()
            }
            State::BetweenCalls => {
                let trimmed = self.buf.trim_start();
                let ws = self.buf.len() - trimmed.len();
                if trimmed.starts_with(';') && self.out.after_call() {
                    self.buf.drain(..ws + 1);
                } else if trimmed.starts_with('{') {
                    let ws: String = self.buf.drain(..ws).collect();
                    self.out.outside(&ws);
                    self.state = State::Header;
                } else if trimmed.is_empty() {
                    return false;
                } else {
                    self.state = State::PlainText;
                }
                true
            }
            State::MistralOpen => {
                let trimmed = self.buf.trim_start();
                if trimmed.is_empty() {
                    return false;
                }
                if trimmed.starts_with('[') {
                    let end = self.buf.len() - trimmed.len() + 1;
                    self.buf.drain(..end);
                    self.in_list = true;
                    self.state = State::ListItem;
                } else {
                    self.state = State::MistralName;
                }
                true
            }
            State::MistralName => match read_mistral_name(&self.buf) {
                MistralName::Incomplete => false,
                // The marker is text; what follows is read again as text.
                MistralName::Text => {
                    self.out.outside(MISTRAL_CALLS);
                    self.state = State::Text;
                    true
                }
                MistralName::Done { name, arguments_start } => {
                    self.buf.drain(..arguments_start);
                    self.in_list = false;
                    self.start_call(name);
                    true
                }
            },
            State::ListItem | State::ListNext => {
                let item = matches!(self.state, State::ListItem);
                let trimmed = self.buf.trim_start();
                let ws = self.buf.len() - trimmed.len();
                match trimmed.chars().next() {
                    None => return false,
                    Some('{') if item => {
                        self.buf.drain(..ws);
                        self.state = State::Header;
                    }
                    Some(',') if !item => {
                        self.buf.drain(..ws + 1);
                        self.state = State::ListItem;
                    }
                    Some(']') => {
                        self.buf.drain(..ws + 1);
                        self.in_list = false;
                        self.state = State::Text;
                    }
                    // Not a list of calls after all: the rest is text.
                    Some(_) => {
                        self.in_list = false;
                        self.state = State::Text;
                    }
                }
                true
            }
            State::Header => match read_header(&self.buf) {
                Header::Incomplete => false,
                Header::Mismatch => {
                    self.state = State::Whole { scan: JsonScan::new(), scanned: 0 };
                    true
                }
                Header::Done { name, value_start } => {
                    self.buf.drain(..value_start);
                    self.start_call(name);
                    true
                }
            },
            State::Arguments(scan) => {
                let used = scan.feed(&self.buf);
                let done = scan.done();
                let fragment: String = self.buf.drain(..used).collect();
                self.out.arguments(fragment);
                if done {
                    self.state = if self.style == Style::Mistral && !self.in_list {
                        self.out.end_call();
                        State::Text
                    } else {
                        State::ObjectEnd(JsonScan::inside_object())
                    };
                }
                used > 0 || done
            }
            State::ObjectEnd(scan) => {
                let used = scan.feed(&self.buf);
                let done = scan.done();
                self.buf.drain(..used);
                if done {
                    self.out.end_call();
                    self.state = self.after_object();
                }
                used > 0 || done
            }
            State::CloseTag => {
                if let Some(i) = self.buf.find(CALL_CLOSE) {
                    self.buf.drain(..i + CALL_CLOSE.len());
                    self.state = State::Text;
                    return true;
                }
                let skip = self.buf.len() - held_prefix(&self.buf, CALL_CLOSE);
                self.buf.drain(..skip);
                skip > 0
            }
            State::Whole { scan, scanned } => match self.style {
                Style::Hermes => {
                    let Some(i) = self.buf.find(CALL_CLOSE) else { return false };
                    let body = self.buf[..i].to_string();
                    self.buf.drain(..i + CALL_CLOSE.len());
                    self.state = State::Text;
                    self.whole_call(&body, &format!("{CALL_OPEN}{body}{CALL_CLOSE}"));
                    true
                }
                Style::Llama3 | Style::Mistral => {
                    let used = scan.feed(&self.buf[*scanned..]);
                    *scanned += used;
                    if !scan.done() {
                        return false;
                    }
                    let end = *scanned;
                    let body: String = self.buf.drain(..end).collect();
                    self.state = self.after_object();
                    self.whole_call(&body, &body);
                    true
                }
            },
        }
    }

    /// Where a call's object ends.
    fn after_object(&self) -> State {
        match self.style {
            Style::Hermes => State::CloseTag,
            Style::Llama3 => State::BetweenCalls,
            Style::Mistral => State::ListNext,
        }
    }

    /// A call read whole: sent as one if it is one, else `raw` is text.
    fn whole_call(&mut self, body: &str, raw: &str) {
        match parse_call(body.trim()) {
            Some((name, arguments)) => {
                self.out.start_call(name);
                self.out.arguments(arguments);
                self.out.end_call();
            }
            None => self.out.outside(raw),
        }
    }
}

/// A call in any key order: `{"name": "...", "arguments"|"parameters": ...}`.
fn parse_call(text: &str) -> Option<(String, String)> {
    let Ok(Value::Object(call)) = serde_json::from_str::<Value>(text) else { return None };
    let name = call.get("name")?.as_str()?.to_string();
    let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(value) => value.to_string(),
    };
    Some((name, arguments))
}

enum MistralName {
    Incomplete,
    /// Not `NAME[ARGS]`: the marker and what follows are text.
    Text,
    Done {
        name: String,
        arguments_start: usize,
    },
}

/// Reads `NAME[ARGS]` or `NAME[CALL_ID]id[ARGS]` at the start of `text`.
fn read_mistral_name(text: &str) -> MistralName {
    let name_end = [MISTRAL_ARGS, MISTRAL_CALL_ID].iter().filter_map(|m| text.find(m)).min();
    let Some(name_end) = name_end else {
        // The name so far, without what may be the start of a marker.
        let held = held_prefix(text, MISTRAL_ARGS).max(held_prefix(text, MISTRAL_CALL_ID));
        let name = text[..text.len() - held].trim();
        let plausible = name.len() <= 64 && (name.is_empty() || valid_name(name));
        return if plausible { MistralName::Incomplete } else { MistralName::Text };
    };
    let name = text[..name_end].trim();
    if !valid_name(name) {
        return MistralName::Text;
    }
    let rest = &text[name_end..];
    if rest.starts_with(MISTRAL_ARGS) {
        return MistralName::Done { name: name.to_string(), arguments_start: name_end + MISTRAL_ARGS.len() };
    }
    // `[CALL_ID]id[ARGS]`: the id is ours to give, not the model's.
    let after_id = &rest[MISTRAL_CALL_ID.len()..];
    match after_id.find(MISTRAL_ARGS) {
        Some(i) if !after_id[..i].contains(char::is_whitespace) => MistralName::Done {
            name: name.to_string(),
            arguments_start: name_end + MISTRAL_CALL_ID.len() + i + MISTRAL_ARGS.len(),
        },
        Some(_) => MistralName::Text,
        None if after_id.trim_end().contains(char::is_whitespace) || after_id.len() > 64 => MistralName::Text,
        None => MistralName::Incomplete,
    }
}

enum Header {
    Incomplete,
    Mismatch,
    Done { name: String, value_start: usize },
}

/// Reads `{"name": "<name>", "arguments": ` (any whitespace) at the start
/// of `text`, up to the first character of the arguments' value.
fn read_header(text: &str) -> Header {
    let mut reader = Reader { text, pos: 0 };
    match reader.header() {
        Ok(name) => Header::Done { name, value_start: reader.pos },
        Err(incomplete) if incomplete => Header::Incomplete,
        Err(_) => Header::Mismatch,
    }
}

/// A cursor over a call's opening. Errors are `true` when more text could
/// still make it match.
struct Reader<'a> {
    text: &'a str,
    pos: usize,
}

impl Reader<'_> {
    fn header(&mut self) -> Result<String, bool> {
        self.literal(&["{"])?;
        self.literal(&["\"name\""])?;
        self.literal(&[":"])?;
        let name = self.string()?;
        self.literal(&[","])?;
        self.literal(&ARGUMENT_KEYS)?;
        self.literal(&[":"])?;
        self.whitespace();
        if self.pos == self.text.len() { Err(true) } else { Ok(name) }
    }

    fn whitespace(&mut self) {
        let rest = &self.text[self.pos..];
        self.pos += rest.len() - rest.trim_start().len();
    }

    /// One of `options`, after whitespace.
    fn literal(&mut self, options: &[&str]) -> Result<(), bool> {
        self.whitespace();
        let rest = &self.text[self.pos..];
        if let Some(found) = options.iter().find(|o| rest.starts_with(**o)) {
            self.pos += found.len();
            return Ok(());
        }
        Err(options.iter().any(|o| o.starts_with(rest)))
    }

    /// A JSON string, after whitespace, decoded.
    fn string(&mut self) -> Result<String, bool> {
        self.whitespace();
        let rest = &self.text[self.pos..];
        if rest.is_empty() {
            return Err(true);
        }
        if !rest.starts_with('"') {
            return Err(false);
        }
        let mut escaped = false;
        for (i, c) in rest.char_indices().skip(1) {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    let decoded = serde_json::from_str(&rest[..=i]).map_err(|_| false)?;
                    self.pos += i + 1;
                    return Ok(decoded);
                }
                _ => {}
            }
        }
        Err(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tool_parser::testing::{call, cut, fold, parse_every_way, streamed};
    use crate::tool_parser::{MistralCalls, ToolCallParser, ToolFormat};

    /// Both ways of splitting, and no `<` or `{` in the content of a reply with calls.
    fn every_way(format: ToolFormat, text: &str) -> (String, Vec<(String, String)>) {
        parse_every_way(format, &[], text, &["<", "{", "[TOOL"])
    }

    #[test]
    fn hermes_calls_and_the_text_around_them() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \
                    \"note\": \"a } and \\\" inside\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": \
                    {}}\n</tool_call>";
        let (content, calls) = every_way(ToolFormat::Hermes, text);
        assert_eq!(content, "Let me check.");
        assert_eq!(
            calls,
            [call("get_weather", r#"{"city": "Zürich", "note": "a } and \" inside"}"#), call("now", "{}")]
        );
        // Only calls: no content at all.
        let (content, calls) =
            every_way(ToolFormat::Hermes, "<tool_call>\n{\"name\":\"f\",\"arguments\":{\"x\":[1,2]}}\n</tool_call>\n");
        assert_eq!((content.as_str(), calls), ("", vec![call("f", r#"{"x":[1,2]}"#)]));
        // Text after a call, its leading whitespace dropped.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": 7}</tool_call>\n\nDone.";
        assert_eq!(every_way(ToolFormat::Hermes, text), ("Done.".to_string(), vec![call("f", "7")]));
    }

    #[test]
    fn hermes_text_without_calls_passes_unchanged() {
        for text in ["  Hello\n\n", "a < b, <tool and <tool_cal", "{\"name\": \"not a call\"}", "x </tool_call> y", ""]
        {
            assert_eq!(every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]), "{text:?}");
        }
    }

    #[test]
    fn hermes_calls_in_other_shapes() {
        // Keys swapped: read whole, then parsed.
        let text = "<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"f\"}\n</tool_call>";
        assert_eq!(every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", r#"{"a":1}"#)]));
        // Not a call after all: the markup is the model's text.
        let text = "<tool_call>\n{\"oops\": 1}\n</tool_call> ok";
        assert_eq!(every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]));
        let text = "<tool_call>not json</tool_call>";
        assert_eq!(every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]));
        // Extra keys after the arguments are skipped.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}, \"id\": \"}\"}</tool_call>";
        assert_eq!(every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", "{}")]));
        // Arguments missing or null are an empty object.
        let text = "<tool_call>{\"name\": \"f\"}</tool_call>";
        assert_eq!(every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", "{}")]));
    }

    #[test]
    fn hermes_cut_short() {
        // Cut inside the arguments (max_tokens): the call as far as it got.
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Par";
        assert_eq!(every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", r#"{"city": "Par"#)]));
        // Cut inside the opening: that is text.
        let text = "Hi <tool_call>\n{\"name\": \"f";
        assert_eq!(every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]));
        // Cut inside the next call's tag: no markup shows.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool_";
        assert_eq!(every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", "{}")]));
    }

    #[test]
    fn arguments_stream_in_fragments() {
        let mut parser = ToolCallParser::new(ToolFormat::Hermes, &[]);
        assert_eq!(parser.push("<tool_call>\n{\"name\": \"get_"), vec![]);
        assert_eq!(parser.push("weather\", \"arguments\": "), vec![]);
        assert_eq!(
            parser.push("{\"city\""),
            vec![
                ToolEvent::CallStart { index: 0, name: "get_weather".into() },
                ToolEvent::Arguments { index: 0, fragment: "{\"city\"".into() }
            ]
        );
        assert_eq!(
            parser.push(": \"Paris\"}"),
            vec![ToolEvent::Arguments { index: 0, fragment: ": \"Paris\"}".into() }]
        );
        assert_eq!(parser.push("}\n</tool_"), vec![]);
        assert_eq!(parser.push("call>"), vec![]);
        assert_eq!(parser.finish(), vec![]);
        assert_eq!(parser.calls(), 1);
    }

    #[test]
    fn llama3_json_calls() {
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Zürich\"}}; {\"name\": \"now\", \"parameters\": {}}";
        let expected = vec![call("get_weather", r#"{"city": "Zürich"}"#), call("now", "{}")];
        assert_eq!(every_way(ToolFormat::Llama3Json, text), (String::new(), expected.clone()));
        let tagged = format!("<|python_tag|>{text}");
        assert_eq!(every_way(ToolFormat::Llama3Json, &tagged), (String::new(), expected));
        let text = "\n{\"parameters\": {\"a\": 1}, \"name\": \"f\"}";
        assert_eq!(every_way(ToolFormat::Llama3Json, text), (String::new(), vec![call("f", r#"{"a":1}"#)]));
        let text = "{\"name\": \"f\", \"arguments\": [true]}";
        assert_eq!(every_way(ToolFormat::Llama3Json, text), (String::new(), vec![call("f", "[true]")]));
    }

    /// Pieces of call markup and text, for random outputs.
    const PIECES: [&str; 28] = [
        "{\"name\": \"f\", \"arguments\": ",
        "{\"name\": \"g\", \"parameters\": ",
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[TOOL_",
        "[ARGS]",
        "[CALL_ID]",
        "get_x",
        "{",
        "}",
        "[",
        "]",
        "\"name\"",
        "\"arguments\"",
        "\"parameters\"",
        ": ",
        ", ",
        "\"f\"",
        "\"",
        "\\",
        "; ",
        "\n",
        " ",
        "ü2",
        ",",
    ];

    proptest::proptest! {
        /// Any output, cut anywhere: never a panic, and the same content and
        /// calls however it was split.
        #[test]
        fn any_split_gives_the_same_result(
            picks in proptest::collection::vec(0..PIECES.len(), 0..40),
            cuts in proptest::collection::vec(0..usize::MAX, 0..6),
            which in 0..3usize,
        ) {
            let text: String = picks.iter().map(|&i| PIECES[i]).collect();
            let format = [ToolFormat::Hermes, ToolFormat::Llama3Json, ToolFormat::Mistral(MistralCalls::List)][which];
            let pieces = cut(&text, &cuts);
            proptest::prop_assert_eq!(fold(&streamed(format, &[], &pieces)), fold(&ToolCallParser::parse(format, &[], &text)));
        }
    }

    const MISTRAL: ToolFormat = ToolFormat::Mistral(MistralCalls::List);

    #[test]
    fn mistral_lists_of_calls() {
        let text = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}, {\"name\": \
                    \"now\", \"arguments\": {}}]";
        let expected = vec![call("get_weather", r#"{"city": "Zürich"}"#), call("now", "{}")];
        assert_eq!(every_way(MISTRAL, text), (String::new(), expected));
        // Text before the calls, keys swapped, and a list cut short.
        let text = "Checking.[TOOL_CALLS][{\"arguments\": {\"a\": 1}, \"name\": \"f\"}]";
        assert_eq!(every_way(MISTRAL, text), ("Checking.".to_string(), vec![call("f", r#"{"a":1}"#)]));
        let text = "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": [1, 2";
        assert_eq!(every_way(MISTRAL, text), (String::new(), vec![call("f", r#"{"a": [1, 2"#)]));
    }

    #[test]
    fn mistral_calls_by_name() {
        // v11: NAME[ARGS]{...}, one marker per call; [CALL_ID] before [ARGS] in some.
        let text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}";
        let expected = vec![call("get_weather", r#"{"city": "Paris"}"#), call("now", "{}")];
        assert_eq!(every_way(MISTRAL, text), (String::new(), expected.clone()));
        let args = ToolFormat::Mistral(MistralCalls::Args);
        assert_eq!(every_way(args, text), (String::new(), expected));
        // Not a name: the marker is the model's text.
        let text = "[TOOL_CALLS]Hello there, no call.";
        assert_eq!(every_way(MISTRAL, text), (text.to_string(), vec![]));
        // Words after a call, and a cut inside the next marker.
        let text = "[TOOL_CALLS]f[ARGS]{\"x\": 1} done[TOOL_";
        assert_eq!(every_way(MISTRAL, text), ("done".to_string(), vec![call("f", r#"{"x": 1}"#)]));
        let text = "[TOOL_CALLS]f[ARGS]{\"x\": 1}[TOOL_";
        assert_eq!(every_way(MISTRAL, text), (String::new(), vec![call("f", r#"{"x": 1}"#)]));
        // Cut before [ARGS]: text.
        let text = "[TOOL_CALLS]get_wea";
        assert_eq!(every_way(MISTRAL, text), (text.to_string(), vec![]));
    }

    #[test]
    fn llama3_json_text() {
        for text in [" Hello {\"name\": 1}", "{\"answer\": 42} is JSON", "<|python", "{\"name\": \"f\", \"parameters\""]
        {
            assert_eq!(every_way(ToolFormat::Llama3Json, text), (text.to_string(), vec![]), "{text:?}");
        }
        let text = "{\"name\": \"f\", \"parameters\": {}} and then words";
        assert_eq!(every_way(ToolFormat::Llama3Json, text), ("and then words".to_string(), vec![call("f", "{}")]));
    }
}
