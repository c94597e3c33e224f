//! The `harmony` tool-call parser (gpt-oss): the calls and the answer in the
//! pieces `crate::harmony`'s reader finds.

use super::{Events, ToolEvent};
use crate::harmony::{HarmonyReader, Piece};

/// The `harmony` tool-call parser: messages to `functions.NAME` are calls
/// (other recipients, gpt-oss's built-in tools, keep their whole name),
/// the answer is content, and reasoning (left here only without the
/// `gpt_oss` reasoning parser) is not the answer's.
pub struct HarmonyCalls {
    reader: HarmonyReader,
    out: Events,
}

impl Default for HarmonyCalls {
    fn default() -> Self {
        Self::new()
    }
}

impl HarmonyCalls {
    pub fn new() -> Self {
        Self { reader: HarmonyReader::new(), out: Events::default() }
    }

    pub fn calls(&self) -> usize {
        self.out.calls()
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let pieces = self.reader.push(text);
        self.take(pieces);
        self.out.take()
    }

    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let pieces = self.reader.finish();
        self.take(pieces);
        self.out.finish()
    }

    fn take(&mut self, pieces: Vec<Piece>) {
        for piece in pieces {
            match piece {
                Piece::Answer(text) => self.out.outside(&text),
                Piece::Reasoning(_) => {}
                Piece::CallStart(to) => {
                    let name = to.strip_prefix("functions.").unwrap_or(&to).to_string();
                    self.out.start_call(name);
                }
                Piece::Arguments(text) => self.out.arguments(text),
                Piece::CallEnd => self.out.end_call(),
            }
        }
    }
}
