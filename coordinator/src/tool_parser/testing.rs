//! What every tool-call parser's tests check: the same content and calls
//! however the output was split, and no markup in the content.

use super::{Function, ToolCallParser, ToolEvent, ToolFormat};

/// Content and (name, arguments) calls from events, checking that each
/// call starts before its arguments and calls come in order.
pub fn fold(events: &[ToolEvent]) -> (String, Vec<(String, String)>) {
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

/// The events of a text pushed in the given pieces.
pub fn streamed(format: ToolFormat, functions: &[Function], pieces: &[&str]) -> Vec<ToolEvent> {
    let mut parser = ToolCallParser::new(format, functions);
    let mut events: Vec<ToolEvent> = pieces.iter().flat_map(|p| parser.push(p)).collect();
    events.extend(parser.finish());
    events
}

/// `text` cut at the given byte offsets (taken modulo its length; those
/// inside a character are skipped).
pub fn cut<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut bounds: Vec<usize> =
        cuts.iter().map(|c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
    bounds.sort_unstable();
    let mut pieces = Vec::new();
    let mut start = 0;
    for end in bounds.into_iter().chain([text.len()]) {
        pieces.push(&text[start..end]);
        start = end;
    }
    pieces
}

/// Parses `text` whole, then split at every byte boundary that is a
/// character boundary (two pieces) and one character at a time: every way
/// gives the same content and calls, and when there are calls no content
/// shows any of `markup`.
pub fn parse_every_way(
    format: ToolFormat,
    functions: &[Function],
    text: &str,
    markup: &[&str],
) -> (String, Vec<(String, String)>) {
    let whole = fold(&ToolCallParser::parse(format, functions, text));
    for (i, _) in text.char_indices().skip(1) {
        let events = streamed(format, functions, &[&text[..i], &text[i..]]);
        assert_eq!(fold(&events), whole, "split at {i} of {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    let events = streamed(format, functions, &pieces);
    assert_eq!(fold(&events), whole, "char by char: {text:?}");
    if !whole.1.is_empty() {
        for event in &events {
            if let ToolEvent::Content(c) = event {
                assert!(!markup.iter().any(|m| c.contains(m)), "markup in content {c:?} of {text:?}");
            }
        }
    }
    whole
}

pub fn call(name: &str, arguments: &str) -> (String, String) {
    (name.to_string(), arguments.to_string())
}
