//! Fuzz target: the incremental detokenizer and stop strings, composed as
//! `api::run` streams a choice (each step's tokens to text, the text
//! through the stop matcher, the held-back rest at the end).
//!
//! The input picks a test model, `skip_special_tokens`, up to four stop
//! strings (raw text, or the text of a run of the generated tokens, so that
//! stops really occur), a prompt and the generated tokens in steps; every
//! id is within the model's vocabulary, as a worker's are.
//!
//! Invariants: no panic; no delta but the last ends in U+FFFD (a split
//! character is held back); the deltas add up to `decode(prompt +
//! generated)` past `decode(prompt)` wherever the prompt's own text is a
//! prefix of that; with stop strings, the emitted text at every step
//! contains no stop string, and the whole stream equals the non-streamed
//! answer (`StopStrings::apply` on the text without stops).

use super::{Bytes, MODELS, fixtures};
use crate::text::{IncrementalDetokenizer, StopStrings, Tokenizer};

/// A stop string as the input describes it.
#[derive(Clone, Debug, PartialEq)]
pub enum StopSpec {
    /// At most 127 bytes, read as UTF-8 (lossily).
    Text(Vec<u8>),
    /// The decoded text of `len` (1..=4) generated tokens from `start`
    /// (modulo their count).
    Tokens { start: u8, len: u8 },
}

/// One fuzz case, decoded from (and encodable to) bytes:
/// `[model | skip<<7] [#stops] stops... [prompt len] ids...`, where a stop
/// is `[n < 128] n bytes` or `[128 + start] [len - 1]`, and each id is a
/// u16 (little-endian) whose top bit ends a step.
#[derive(Clone, Debug, PartialEq)]
pub struct DetokInput {
    pub model: usize,
    pub skip_special_tokens: bool,
    pub stops: Vec<StopSpec>,
    pub prompt: Vec<u32>,
    pub steps: Vec<Vec<u32>>,
}

impl DetokInput {
    pub fn parse(data: &[u8]) -> Self {
        let mut bytes = Bytes(data);
        let first = bytes.u8();
        let (model, skip_special_tokens) = ((first & 0x7f) as usize % MODELS.len(), first & 0x80 == 0);
        let stops = (0..bytes.u8() % 5)
            .map(|_| match bytes.u8() {
                b if b & 0x80 != 0 => StopSpec::Tokens { start: b & 0x7f, len: 1 + bytes.u8() % 4 },
                n => StopSpec::Text(bytes.take(n as usize).to_vec()),
            })
            .collect();
        let prompt_len = (bytes.u8() % 24) as usize;
        let vocab = fixtures().tokenizers[model].vocab_size().max(1) as u32;
        let (mut prompt, mut steps, mut step) = (Vec::new(), Vec::new(), Vec::new());
        while !bytes.is_empty() {
            let word = bytes.u16();
            let id = u32::from(word & 0x7fff) % vocab;
            if prompt.len() < prompt_len {
                prompt.push(id);
                continue;
            }
            step.push(id);
            if word & 0x8000 != 0 {
                steps.push(std::mem::take(&mut step));
            }
        }
        if !step.is_empty() {
            steps.push(step);
        }
        Self { model, skip_special_tokens, stops, prompt, steps }
    }

    /// The bytes [`Self::parse`] reads back as `self` (ids must be below 2^15).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![self.model as u8 | if self.skip_special_tokens { 0 } else { 0x80 }, self.stops.len() as u8];
        for stop in &self.stops {
            match stop {
                StopSpec::Text(text) => {
                    out.push(text.len().min(127) as u8);
                    out.extend_from_slice(&text[..text.len().min(127)]);
                }
                StopSpec::Tokens { start, len } => out.extend([0x80 | start, len.saturating_sub(1)]),
            }
        }
        out.push(self.prompt.len() as u8);
        out.extend(self.prompt.iter().flat_map(|&id| (id as u16 & 0x7fff).to_le_bytes()));
        for step in &self.steps {
            for (i, &id) in step.iter().enumerate() {
                let end = if i + 1 == step.len() { 0x8000 } else { 0 };
                out.extend((id as u16 & 0x7fff | end).to_le_bytes());
            }
        }
        out
    }
}

fn stop_text(tokenizer: &Tokenizer, spec: &StopSpec, generated: &[u32], skip: bool) -> Option<String> {
    match spec {
        StopSpec::Text(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        StopSpec::Tokens { .. } if generated.is_empty() => None,
        StopSpec::Tokens { start, len } => {
            let start = *start as usize % generated.len();
            let end = (start + *len as usize).min(generated.len());
            Some(tokenizer.decode(&generated[start..end], skip))
        }
    }
}

/// Streams one input and checks every invariant.
pub fn detokenizer(data: &[u8]) {
    let input = DetokInput::parse(data);
    let tokenizer = &fixtures().tokenizers[input.model];
    let skip = input.skip_special_tokens;
    let generated: Vec<u32> = input.steps.concat();
    // The API refuses empty stop strings.
    let stops: Vec<String> = input
        .stops
        .iter()
        .filter_map(|spec| stop_text(tokenizer, spec, &generated, skip))
        .filter(|s| !s.is_empty())
        .collect();

    let mut detok = IncrementalDetokenizer::new(tokenizer.clone(), &input.prompt, skip);
    let mut deltas: Vec<String> = input.steps.iter().map(|step| detok.push(step)).collect();
    for (i, delta) in deltas.iter().enumerate() {
        assert!(!delta.ends_with('\u{FFFD}'), "step {i} emitted a split character: {delta:?}");
    }
    deltas.push(detok.flush());
    assert_eq!(detok.flush(), "", "a second flush emitted text");
    let streamed = deltas.concat();

    let all: Vec<u32> = input.prompt.iter().chain(&generated).copied().collect();
    let (whole, before) = (tokenizer.decode(&all, skip), tokenizer.decode(&input.prompt, skip));
    // Where generation rewrites the prompt's text (a byte run or a character
    // spanning the two), there is no generated part to compare against.
    if let Some(expected) = whole.strip_prefix(before.as_str()) {
        assert_eq!(streamed, expected, "the stream differs from decode (deltas {deltas:?})");
    }

    let mut matcher = StopStrings::new(stops.clone());
    let (mut emitted, mut stopped) = (String::new(), None);
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    for delta in &deltas {
        let out = matcher.push(delta);
        // Only a stop ending in the new text can be new: search from there.
        let from = floor_char_boundary(&emitted, emitted.len().saturating_sub(longest));
        emitted.push_str(&out.text);
        if let Some(stop) = stops.iter().find(|s| emitted[from..].contains(s.as_str())) {
            panic!("emitted text {emitted:?} contains the stop string {stop:?}");
        }
        if out.stopped.is_some() {
            stopped = out.stopped;
            break;
        }
    }
    if stopped.is_none() {
        let from = floor_char_boundary(&emitted, emitted.len().saturating_sub(longest));
        emitted.push_str(&matcher.flush());
        if let Some(stop) = stops.iter().find(|s| emitted[from..].contains(s.as_str())) {
            panic!("emitted text {emitted:?} contains the stop string {stop:?} at the end");
        }
    }
    assert!(matcher.push("more").text.is_empty() || stopped.is_none(), "text after the stop");
    assert_eq!((emitted, stopped), StopStrings::apply(&stops, &streamed), "streamed and whole answers differ");
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
