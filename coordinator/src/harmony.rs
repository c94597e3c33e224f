//! gpt-oss's Harmony format, read as it streams. The prompt ends in
//! `<|start|>assistant`; the output is one or more messages, each a
//! header and a body:
//!
//! ```text
//! <|channel|>analysis<|message|>thinking...<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
//! <|start|>assistant<|channel|>final<|message|>The answer.<|return|>
//! ```
//!
//! The `analysis` channel is reasoning; a message with a recipient
//! (`to=functions.NAME`, in the header's role or channel part) is a call
//! whose body is its arguments; `final` and `commentary` without a
//! recipient (a preamble) are the answer. Text outside any message (a
//! model that drifts off the format) is answer too. `<|call|>` and
//! `<|return|>` end generation, so the output may also just stop.
//!
//! [`HarmonyReader`] turns the text into [`Piece`]s; the `gpt_oss`
//! reasoning parser and the `harmony` tool-call parser
//! (`tool_parser::harmony_calls`) are both built on it. A marker's start at the end of a delta is held back, so the pieces
//! do not depend on how the text was split.

use crate::text::held_prefix;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";
/// What ends a body: its end markers, or the next message's header.
const BODY_ENDS: [&str; 5] = [END, CALL, RETURN, START, CHANNEL];
/// A header longer than this is no header: the text is the answer.
const MAX_HEADER: usize = 256;

/// A piece of the output, by where it belongs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Answer(String),
    /// A message to a recipient begins (`functions.get_weather`).
    CallStart(String),
    /// The next piece of the call's body (its arguments).
    Arguments(String),
    CallEnd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    Reasoning,
    Answer,
    Call,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Between messages.
    Outside,
    /// A header, read up to `<|message|>` (the buffer holds it whole).
    Header,
    Body(Body),
}

#[derive(Debug)]
pub struct HarmonyReader {
    state: State,
    /// Text not yet decided on (a header, or a possible marker's start).
    buf: String,
    /// The marker that opened the header being read.
    opened_by: &'static str,
    pieces: Vec<Piece>,
}

impl Default for HarmonyReader {
    fn default() -> Self {
        Self::new()
    }
}

impl HarmonyReader {
    pub fn new() -> Self {
        Self { state: State::Outside, buf: String::new(), opened_by: CHANNEL, pieces: Vec::new() }
    }

    /// The pieces `text` makes certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        while self.step() {}
        std::mem::take(&mut self.pieces)
    }

    /// The output ended: a header cut short is answer text, a body cut
    /// short ends where it stopped.
    pub fn finish(&mut self) -> Vec<Piece> {
        while self.step() {}
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Outside => self.emit(Piece::Answer(rest)),
            State::Header => self.emit(Piece::Answer(format!("{}{rest}", self.opened_by))),
            State::Body(body) => {
                self.body_text(body, rest);
                if body == Body::Call {
                    self.emit(Piece::CallEnd);
                }
            }
        }
        self.state = State::Outside;
        std::mem::take(&mut self.pieces)
    }

    fn step(&mut self) -> bool {
        match self.state {
            State::Outside => {
                if let Some((i, marker)) = earliest(&self.buf, &[START, CHANNEL]) {
                    let before = self.buf[..i].to_string();
                    self.buf.drain(..i + marker.len());
                    self.emit(Piece::Answer(before));
                    self.opened_by = marker;
                    self.state = State::Header;
                    return true;
                }
                let sure = self.buf.len() - held_prefix(&self.buf, START).max(held_prefix(&self.buf, CHANNEL));
                let text: String = self.buf.drain(..sure).collect();
                self.emit(Piece::Answer(text));
                false
            }
            State::Header => {
                let found = self.buf.find(MESSAGE);
                let header_len = found.unwrap_or(self.buf.len() - held_prefix(&self.buf, MESSAGE));
                if header_len > MAX_HEADER {
                    // No header: the marker is answer text, and what follows is read again.
                    self.emit(Piece::Answer(self.opened_by.to_string()));
                    self.state = State::Outside;
                    return true;
                }
                let Some(i) = found else { return false };
                let header = self.buf[..i].to_string();
                self.buf.drain(..i + MESSAGE.len());
                let body = match recipient(&header) {
                    Some(to) => {
                        self.emit(Piece::CallStart(to));
                        Body::Call
                    }
                    None if channel(self.opened_by, &header) == "analysis" => Body::Reasoning,
                    None => Body::Answer,
                };
                self.state = State::Body(body);
                true
            }
            State::Body(body) => {
                if let Some((i, marker)) = earliest(&self.buf, &BODY_ENDS) {
                    let text: String = self.buf.drain(..i).collect();
                    self.body_text(body, text);
                    if body == Body::Call {
                        self.emit(Piece::CallEnd);
                    }
                    // A header without an end before it starts the next message.
                    if marker == START || marker == CHANNEL {
                        self.opened_by = marker;
                        self.state = State::Header;
                    } else {
                        self.state = State::Outside;
                    }
                    self.buf.drain(..marker.len());
                    return true;
                }
                let held = BODY_ENDS.iter().map(|m| held_prefix(&self.buf, m)).max().unwrap_or(0);
                let text: String = self.buf.drain(..self.buf.len() - held).collect();
                self.body_text(body, text);
                false
            }
        }
    }

    fn body_text(&mut self, body: Body, text: String) {
        self.emit(match body {
            Body::Reasoning => Piece::Reasoning(text),
            Body::Answer => Piece::Answer(text),
            Body::Call => Piece::Arguments(text),
        });
    }

    /// Queues `piece`, merged into the last one when it continues it.
    fn emit(&mut self, piece: Piece) {
        match (self.pieces.last_mut(), piece) {
            (_, Piece::Reasoning(t) | Piece::Answer(t) | Piece::Arguments(t)) if t.is_empty() => {}
            (Some(Piece::Reasoning(last)), Piece::Reasoning(t))
            | (Some(Piece::Answer(last)), Piece::Answer(t))
            | (Some(Piece::Arguments(last)), Piece::Arguments(t)) => last.push_str(&t),
            (_, piece) => self.pieces.push(piece),
        }
    }
}

/// The first of `markers` in `text`, and where.
fn earliest(text: &str, markers: &[&'static str]) -> Option<(usize, &'static str)> {
    markers.iter().filter_map(|&m| Some((text.find(m)?, m))).min()
}

/// A header's recipient (`to=functions.get_weather`), wherever it stands.
fn recipient(header: &str) -> Option<String> {
    let at = header.find("to=")?;
    let to: String = header[at + 3..].chars().take_while(|c| !c.is_whitespace() && *c != '<').collect();
    (!to.is_empty()).then_some(to)
}

/// A header's channel: the word after `<|channel|>` (the header itself
/// when the message opened with it).
fn channel<'a>(opened_by: &str, header: &'a str) -> &'a str {
    let after =
        if opened_by == CHANNEL { header } else { header.find(CHANNEL).map_or("", |i| &header[i + CHANNEL.len()..]) };
    after.split(|c: char| c.is_whitespace() || c == '<').next().unwrap_or("")
}

/// A call as the reasoning parser passes it on to the tool-call parser,
/// once the reasoning is taken out: its header, its body, its end.
pub fn call_text(piece: &Piece) -> Option<String> {
    match piece {
        Piece::CallStart(to) => Some(format!("{CHANNEL}commentary to={to}{MESSAGE}")),
        Piece::Arguments(text) => Some(text.clone()),
        Piece::CallEnd => Some(CALL.to_string()),
        Piece::Reasoning(_) | Piece::Answer(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_parser::ToolFormat;
    use crate::tool_parser::testing::{call, cut, fold, parse_every_way, streamed};

    /// Reasoning, answer and calls (name, arguments) of a whole text.
    fn read(text: &str) -> (String, String, Vec<(String, String)>) {
        let mut reader = HarmonyReader::new();
        let mut pieces = reader.push(text);
        pieces.extend(reader.finish());
        let (mut reasoning, mut answer, mut calls) = (String::new(), String::new(), Vec::new());
        for piece in pieces {
            match piece {
                Piece::Reasoning(t) => reasoning.push_str(&t),
                Piece::Answer(t) => answer.push_str(&t),
                Piece::CallStart(to) => calls.push((to, String::new())),
                Piece::Arguments(t) => calls.last_mut().expect("a call").1.push_str(&t),
                Piece::CallEnd => {}
            }
        }
        (reasoning, answer, calls)
    }

    #[test]
    fn channels_split_reasoning_answer_and_calls() {
        let text = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary \
                    to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
        let (reasoning, answer, calls) = read(text);
        assert_eq!((reasoning.as_str(), answer.as_str()), ("Need weather.", ""));
        assert_eq!(calls, [call("functions.get_weather", "{\"city\": \"Paris\"}")]);
        let text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!";
        assert_eq!(read(text), ("Think.".into(), "Hi!".into(), vec![]));
        // The recipient in the role part, as the chat template writes history.
        let text = "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>";
        assert_eq!(read(text).2, [call("functions.now", "{}")]);
        // A preamble on commentary is the answer; text off the format too.
        assert_eq!(read("<|channel|>commentary<|message|>Checking.<|end|>").1, "Checking.");
        assert_eq!(read("plain words"), (String::new(), "plain words".into(), vec![]));
        // Cut inside a header: its text is the answer.
        assert_eq!(read("<|channel|>fin").1, "<|channel|>fin");
    }

    fn every_way(text: &str) -> (String, Vec<(String, String)>) {
        parse_every_way(ToolFormat::Harmony, &[], text, &["<|"])
    }

    #[test]
    fn the_tool_parser_reads_calls_and_the_answer() {
        let text = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary \
                    to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Zürich\"}<|call|>";
        assert_eq!(every_way(text), (String::new(), vec![call("get_weather", "{\"city\": \"Zürich\"}")]));
        // As the gpt_oss reasoning parser passes calls on.
        let passed: String = [
            Piece::Answer("Let me look.".into()),
            Piece::CallStart("functions.f".into()),
            Piece::Arguments("{}".into()),
            Piece::CallEnd,
        ]
        .iter()
        .map(|p| match p {
            Piece::Answer(t) => t.clone(),
            other => call_text(other).expect("call text"),
        })
        .collect();
        assert_eq!(every_way(&passed), ("Let me look.".into(), vec![call("f", "{}")]));
        let text = "<|channel|>final<|message|>No call.";
        assert_eq!(every_way(text), ("No call.".into(), vec![]));
    }

    const PIECES: [&str; 14] = [
        "<|channel|>",
        "<|message|>",
        "<|start|>",
        "assistant",
        "<|end|>",
        "<|call|>",
        "analysis",
        "final",
        "commentary to=functions.f ",
        "<|constrain|>json",
        "{\"a\": 1}",
        "<|",
        "ü x",
        "\n",
    ];

    proptest::proptest! {
        #[test]
        fn any_split_gives_the_same_result(
            picks in proptest::collection::vec(0..PIECES.len(), 0..40),
            cuts in proptest::collection::vec(0..usize::MAX, 0..6),
        ) {
            let text: String = picks.iter().map(|&i| PIECES[i]).collect();
            let whole = fold(&crate::tool_parser::ToolCallParser::parse(ToolFormat::Harmony, &[], &text));
            proptest::prop_assert_eq!(fold(&streamed(ToolFormat::Harmony, &[], &cut(&text, &cuts))), whole);
            let mut reader = HarmonyReader::new();
            let mut pieces: Vec<Piece> = cut(&text, &cuts).iter().flat_map(|p| reader.push(p)).collect();
            pieces.extend(reader.finish());
            let mut merged = HarmonyReader::new();
            for piece in pieces {
                merged.emit(piece);
            }
            let mut once = HarmonyReader::new();
            let mut want = HarmonyReader::new();
            for piece in once.push(&text).into_iter().chain(once.finish()) {
                want.emit(piece);
            }
            proptest::prop_assert_eq!(merged.pieces, want.pieces);
        }
    }
}
