//! Finds tool calls in a model's output as it streams, for the Hermes and
//! Llama 3 JSON formats (see `tools`), as vLLM's `hermes` and
//! `llama3_json` parsers do.
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
//! path ([`ToolCallParser::parse`]).

use serde_json::Value;

use super::ToolFormat;
use super::json_scan::JsonScan;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside calls.
    Content(String),
    /// Call number `index` (from 0) begins: its function's name.
    CallStart { index: usize, name: String },
    /// The next piece of call `index`'s arguments (JSON text).
    Arguments { index: usize, fragment: String },
}

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
/// The keys a call's arguments go under (Hermes writes the first, Llama the second).
const ARGUMENT_KEYS: [&str; 2] = ["\"arguments\"", "\"parameters\""];

enum State {
    /// Hermes: text outside calls. Llama 3: the start, before it is known
    /// whether the output is text or calls.
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
    /// `</tool_call>` (Hermes) or the object's end (Llama 3, `scanned`
    /// bytes of it seen).
    Whole {
        scan: JsonScan,
        scanned: usize,
    },
}

pub struct ToolCallParser {
    format: ToolFormat,
    state: State,
    /// Text received and not yet decided on.
    buf: String,
    calls: usize,
    /// Whitespace outside calls, held until text follows it.
    pending_ws: String,
    /// A call ended and no text came after it yet.
    after_call: bool,
    events: Vec<ToolEvent>,
}

impl ToolCallParser {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            state: State::Text,
            buf: String::new(),
            calls: 0,
            pending_ws: String::new(),
            after_call: false,
            events: Vec::new(),
        }
    }

    /// Everything in a whole output, as the events of a stream.
    pub fn parse(format: ToolFormat, text: &str) -> Vec<ToolEvent> {
        let mut parser = Self::new(format);
        let mut events = parser.push(text);
        events.extend(parser.finish());
        events
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The events `text` makes certain.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        while self.step() {}
        std::mem::take(&mut self.events)
    }

    /// The output ended: what was held back is decided (an unfinished call
    /// opening is text; an unfinished call stays as far as it got).
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        while self.step() {}
        let rest = std::mem::take(&mut self.buf);
        match (&self.state, self.format) {
            // After calls, an unfinished `<tool_call>` is the next call cut short, not text.
            (State::Text, ToolFormat::Hermes) if self.calls > 0 && CALL_OPEN.starts_with(rest.as_str()) => {}
            (State::Text | State::PlainText | State::BetweenCalls, _) => self.outside(&rest),
            (State::Header | State::Whole { .. }, ToolFormat::Hermes) => {
                self.whole_call(&rest, &format!("{CALL_OPEN}{rest}"))
            }
            (State::Header | State::Whole { .. }, ToolFormat::Llama3Json) => self.whole_call(&rest, &rest),
            (State::Arguments(_) | State::ObjectEnd(_) | State::CloseTag, _) => {}
        }
        if self.calls == 0 {
            let ws = std::mem::take(&mut self.pending_ws);
            self.emit(ToolEvent::Content(ws));
        }
        self.state = State::PlainText;
        std::mem::take(&mut self.events)
    }

    /// Decides on some of `buf`; false when it needs more text.
    fn step(&mut self) -> bool {
        match &mut self.state {
            State::Text if self.format == ToolFormat::Hermes => {
                if let Some(i) = self.buf.find(CALL_OPEN) {
                    let before = self.buf[..i].to_string();
                    self.buf.drain(..i + CALL_OPEN.len());
                    self.outside(&before);
                    self.state = State::Header;
                    return true;
                }
                let sure = self.buf.len() - held_prefix(&self.buf, CALL_OPEN);
                let text: String = self.buf.drain(..sure).collect();
                self.outside(&text);
                sure > 0
            }
            State::Text => {
                let trimmed = self.buf.trim_start();
                if trimmed.starts_with(PYTHON_TAG) {
                    let end = self.buf.len() - trimmed.len() + PYTHON_TAG.len();
                    self.buf.drain(..end);
                    self.state = State::BetweenCalls;
                } else if trimmed.starts_with('{') {
                    let ws: String = self.buf.drain(..self.buf.len() - trimmed.len()).collect();
                    self.outside(&ws);
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
                self.outside(&text);
                !text.is_empty()
            }
            State::BetweenCalls => {
                let trimmed = self.buf.trim_start();
                let ws = self.buf.len() - trimmed.len();
                if trimmed.starts_with(';') && self.after_call {
                    self.buf.drain(..ws + 1);
                } else if trimmed.starts_with('{') {
                    let ws: String = self.buf.drain(..ws).collect();
                    self.outside(&ws);
                    self.state = State::Header;
                } else if trimmed.is_empty() {
                    return false;
                } else {
                    self.state = State::PlainText;
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
                    let index = self.calls;
                    self.calls += 1;
                    self.pending_ws.clear();
                    self.emit(ToolEvent::CallStart { index, name });
                    self.buf.drain(..value_start);
                    self.state = State::Arguments(JsonScan::new());
                    true
                }
            },
            State::Arguments(scan) => {
                let used = scan.feed(&self.buf);
                let done = scan.done();
                let fragment: String = self.buf.drain(..used).collect();
                let index = self.calls - 1;
                self.emit(ToolEvent::Arguments { index, fragment });
                if done {
                    self.state = State::ObjectEnd(JsonScan::inside_object());
                }
                used > 0 || done
            }
            State::ObjectEnd(scan) => {
                let used = scan.feed(&self.buf);
                let done = scan.done();
                self.buf.drain(..used);
                if done {
                    self.after_call = true;
                    self.state = match self.format {
                        ToolFormat::Hermes => State::CloseTag,
                        ToolFormat::Llama3Json => State::BetweenCalls,
                    };
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
            State::Whole { scan, scanned } => match self.format {
                ToolFormat::Hermes => {
                    let Some(i) = self.buf.find(CALL_CLOSE) else { return false };
                    let body = self.buf[..i].to_string();
                    self.buf.drain(..i + CALL_CLOSE.len());
                    self.state = State::Text;
                    self.whole_call(&body, &format!("{CALL_OPEN}{body}{CALL_CLOSE}"));
                    true
                }
                ToolFormat::Llama3Json => {
                    let used = scan.feed(&self.buf[*scanned..]);
                    *scanned += used;
                    if !scan.done() {
                        return false;
                    }
                    let end = *scanned;
                    let body: String = self.buf.drain(..end).collect();
                    self.state = State::BetweenCalls;
                    self.whole_call(&body, &body);
                    true
                }
            },
        }
    }

    /// A call read whole: sent as one if it is one, else `raw` is text.
    fn whole_call(&mut self, body: &str, raw: &str) {
        match parse_call(body.trim()) {
            Some((name, arguments)) => {
                let index = self.calls;
                self.calls += 1;
                self.pending_ws.clear();
                self.after_call = true;
                self.emit(ToolEvent::CallStart { index, name });
                self.emit(ToolEvent::Arguments { index, fragment: arguments });
            }
            None => self.outside(raw),
        }
    }

    /// Text outside calls: sent up to its last non-whitespace character;
    /// whitespace right after a call is dropped.
    fn outside(&mut self, text: &str) {
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

/// The length of the longest end of `text` that `marker` starts with:
/// what may still become the marker.
fn held_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
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

    /// Content and (name, arguments) calls from events, checking that each
    /// call starts before its arguments and calls come in order.
    fn fold(events: &[ToolEvent]) -> (String, Vec<(String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for event in events {
            match event {
                ToolEvent::Content(text) => content.push_str(text),
                ToolEvent::CallStart { index, name } => {
                    assert_eq!(*index, calls.len(), "{events:?}");
                    calls.push((name.clone(), String::new()));
                }
                ToolEvent::Arguments { index, fragment } => {
                    assert_eq!(*index + 1, calls.len(), "{events:?}");
                    calls[*index].1.push_str(fragment);
                }
            }
        }
        (content, calls)
    }

    /// The events of `text` pushed in the given pieces.
    fn streamed(format: ToolFormat, pieces: &[&str]) -> Vec<ToolEvent> {
        let mut parser = ToolCallParser::new(format);
        let mut events: Vec<ToolEvent> = pieces.iter().flat_map(|p| parser.push(p)).collect();
        events.extend(parser.finish());
        events
    }

    /// Parses `text` whole, then split at every character boundary (two
    /// pieces) and one character at a time: every way gives the same
    /// content and calls, and no content shows a piece of call markup.
    fn parse_every_way(format: ToolFormat, text: &str) -> (String, Vec<(String, String)>) {
        let whole = fold(&ToolCallParser::parse(format, text));
        for (i, _) in text.char_indices().skip(1) {
            let events = streamed(format, &[&text[..i], &text[i..]]);
            assert_eq!(fold(&events), whole, "split at {i} of {text:?}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        let events = streamed(format, &pieces);
        assert_eq!(fold(&events), whole, "char by char: {text:?}");
        if !whole.1.is_empty() {
            for event in &events {
                if let ToolEvent::Content(c) = event {
                    assert!(!c.contains('<') && !c.contains('{'), "markup in content {c:?} of {text:?}");
                }
            }
        }
        whole
    }

    fn call(name: &str, arguments: &str) -> (String, String) {
        (name.to_string(), arguments.to_string())
    }

    #[test]
    fn hermes_calls_and_the_text_around_them() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \
                    \"note\": \"a } and \\\" inside\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": \
                    {}}\n</tool_call>";
        let (content, calls) = parse_every_way(ToolFormat::Hermes, text);
        assert_eq!(content, "Let me check.");
        assert_eq!(
            calls,
            [call("get_weather", r#"{"city": "Zürich", "note": "a } and \" inside"}"#), call("now", "{}")]
        );
        // Only calls: no content at all.
        let (content, calls) = parse_every_way(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\":\"f\",\"arguments\":{\"x\":[1,2]}}\n</tool_call>\n",
        );
        assert_eq!((content.as_str(), calls), ("", vec![call("f", r#"{"x":[1,2]}"#)]));
        // Text after a call, its leading whitespace dropped.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": 7}</tool_call>\n\nDone.";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), ("Done.".to_string(), vec![call("f", "7")]));
    }

    #[test]
    fn hermes_text_without_calls_passes_unchanged() {
        for text in ["  Hello\n\n", "a < b, <tool and <tool_cal", "{\"name\": \"not a call\"}", "x </tool_call> y", ""]
        {
            assert_eq!(parse_every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]), "{text:?}");
        }
    }

    #[test]
    fn hermes_calls_in_other_shapes() {
        // Keys swapped: read whole, then parsed.
        let text = "<tool_call>\n{\"arguments\": {\"a\": 1}, \"name\": \"f\"}\n</tool_call>";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", r#"{"a":1}"#)]));
        // Not a call after all: the markup is the model's text.
        let text = "<tool_call>\n{\"oops\": 1}\n</tool_call> ok";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]));
        let text = "<tool_call>not json</tool_call>";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]));
        // Extra keys after the arguments are skipped.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}, \"id\": \"}\"}</tool_call>";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", "{}")]));
        // Arguments missing or null are an empty object.
        let text = "<tool_call>{\"name\": \"f\"}</tool_call>";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", "{}")]));
    }

    #[test]
    fn hermes_cut_short() {
        // Cut inside the arguments (max_tokens): the call as far as it got.
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Par";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", r#"{"city": "Par"#)]));
        // Cut inside the opening: that is text.
        let text = "Hi <tool_call>\n{\"name\": \"f";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (text.to_string(), vec![]));
        // Cut inside the next call's tag: no markup shows.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool_";
        assert_eq!(parse_every_way(ToolFormat::Hermes, text), (String::new(), vec![call("f", "{}")]));
    }

    #[test]
    fn arguments_stream_in_fragments() {
        let mut parser = ToolCallParser::new(ToolFormat::Hermes);
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
        assert_eq!(parse_every_way(ToolFormat::Llama3Json, text), (String::new(), expected.clone()));
        let tagged = format!("<|python_tag|>{text}");
        assert_eq!(parse_every_way(ToolFormat::Llama3Json, &tagged), (String::new(), expected));
        let text = "\n{\"parameters\": {\"a\": 1}, \"name\": \"f\"}";
        assert_eq!(parse_every_way(ToolFormat::Llama3Json, text), (String::new(), vec![call("f", r#"{"a":1}"#)]));
        let text = "{\"name\": \"f\", \"arguments\": [true]}";
        assert_eq!(parse_every_way(ToolFormat::Llama3Json, text), (String::new(), vec![call("f", "[true]")]));
    }

    /// Pieces of call markup and text, for random outputs.
    const PIECES: [&str; 22] = [
        "{\"name\": \"f\", \"arguments\": ",
        "{\"name\": \"g\", \"parameters\": ",
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "<|python_tag|>",
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
    ];

    proptest::proptest! {
        /// Any output, cut anywhere: never a panic, and the same content and
        /// calls however it was split.
        #[test]
        fn any_split_gives_the_same_result(
            picks in proptest::collection::vec(0..PIECES.len(), 0..40),
            cuts in proptest::collection::vec(0..usize::MAX, 0..6),
            llama in proptest::prelude::any::<bool>(),
        ) {
            let text: String = picks.iter().map(|&i| PIECES[i]).collect();
            let format = if llama { ToolFormat::Llama3Json } else { ToolFormat::Hermes };
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
            bounds.sort_unstable();
            let mut pieces = Vec::new();
            let mut start = 0;
            for end in bounds.into_iter().chain([text.len()]) {
                pieces.push(&text[start..end]);
                start = end;
            }
            proptest::prop_assert_eq!(fold(&streamed(format, &pieces)), fold(&ToolCallParser::parse(format, &text)));
        }
    }

    #[test]
    fn llama3_json_text() {
        for text in [" Hello {\"name\": 1}", "{\"answer\": 42} is JSON", "<|python", "{\"name\": \"f\", \"parameters\""]
        {
            assert_eq!(parse_every_way(ToolFormat::Llama3Json, text), (text.to_string(), vec![]), "{text:?}");
        }
        let text = "{\"name\": \"f\", \"parameters\": {}} and then words";
        assert_eq!(
            parse_every_way(ToolFormat::Llama3Json, text),
            ("and then words".to_string(), vec![call("f", "{}")])
        );
    }
}
