//! Incremental detokenization in the style of TGI/vLLM (`prefix_offset` /
//! `read_offset`): each step decodes a small window of recent tokens twice,
//! without and with the new ones, and emits the difference. The window keeps
//! SentencePiece's `▁` space on a mid-text token (decoders strip one leading
//! space from the first piece they see, and that piece is in the window's
//! already-emitted part).
//!
//! Two holds make the concatenated deltas equal `decode(all_ids)` exactly:
//! * while the decoded tail ends in U+FFFD (a UTF-8 character split over
//!   tokens, as byte-level BPE does), and
//! * while the last token is a `<0xHH>` byte-fallback piece: the ByteFallback
//!   decoder turns a whole run of them into text at once, all-or-nothing (a
//!   valid "é" becomes "���" if a stray byte follows), so a run's text is only
//!   final once a non-byte token ends it. For the same reason a window never
//!   starts inside a run.

use std::sync::Arc;

use super::tokenizer::Tokenizer;

/// Prompt tokens decoded as context before the first generated one (vLLM: 5).
const INITIAL_WINDOW: usize = 5;

pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    /// The window: tokens from `prefix_offset` on (older ones are dropped).
    ids: Vec<u32>,
    /// `ids[..read_offset]` is text already emitted (the window's context).
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// `prompt_ids` give the context of the first generated token; their own
    /// text is never emitted. Pass `&[]` to stream a whole sequence.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let mut this = Self { tokenizer, ids: Vec::new(), read_offset: 0, skip_special_tokens };
        let mut start = prompt_ids.len().saturating_sub(INITIAL_WINDOW);
        // Widen the window to a run boundary, and until it holds a token with
        // text of its own (else the first new piece would lose its space).
        while start > 0 {
            let before = prompt_ids[start - 1];
            let in_run = this.is_invisible(before) || this.tokenizer.is_byte_token(before);
            if !in_run && prompt_ids[start..].iter().any(|&id| !this.is_invisible(id)) {
                break;
            }
            start -= 1;
        }
        this.ids.extend_from_slice(&prompt_ids[start..]);
        this.read_offset = this.ids.len();
        this
    }

    /// Adds one step's tokens; returns the text they completed (maybe "").
    pub fn push(&mut self, new_ids: &[u32]) -> String {
        self.ids.extend_from_slice(new_ids);
        if new_ids.is_empty() || self.ends_in_byte_run() {
            return String::new();
        }
        let prefix = self.tokenizer.decode(&self.ids[..self.read_offset], self.skip_special_tokens);
        let full = self.tokenizer.decode(&self.ids, self.skip_special_tokens);
        // A decoder that rewrites earlier text is held back until flush().
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') || !full.starts_with(&prefix) {
            return String::new();
        }
        self.advance();
        full[prefix.len()..].to_string()
    }

    /// At the end of generation: the held-back text (an unfinished byte run
    /// or character decodes as U+FFFD, as `decode` does).
    pub fn flush(&mut self) -> String {
        let prefix = self.tokenizer.decode(&self.ids[..self.read_offset], self.skip_special_tokens);
        let full = self.tokenizer.decode(&self.ids, self.skip_special_tokens);
        self.advance();
        match full.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_string(),
            // Only for decoders that rewrite earlier text: emit what differs.
            None => {
                let common = full.char_indices().zip(prefix.chars()).take_while(|((_, a), b)| a == b).count();
                full.chars().skip(common).collect()
            }
        }
    }

    /// The emitted tokens become the next step's context.
    fn advance(&mut self) {
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
    }

    /// Tokens that decode to nothing here (skipped specials).
    fn is_invisible(&self, id: u32) -> bool {
        self.skip_special_tokens && self.tokenizer.is_special(id)
    }

    fn ends_in_byte_run(&self) -> bool {
        self.ids.iter().rev().find(|&&id| !self.is_invisible(id)).is_some_and(|&id| self.tokenizer.is_byte_token(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use std::path::Path;

    const TEST_DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests");

    fn tokenizer(model: &str) -> Arc<Tokenizer> {
        Arc::new(Tokenizer::from_dir(&Path::new(TEST_DATA).join("models").join(model)).expect("load tokenizer"))
    }

    /// Streams `ids` in steps of the given sizes (cycled); returns every delta.
    fn stream(tok: &Arc<Tokenizer>, prompt: &[u32], ids: &[u32], steps: &[usize], skip: bool) -> Vec<String> {
        let mut detok = IncrementalDetokenizer::new(tok.clone(), prompt, skip);
        let mut deltas = Vec::new();
        let mut rest = ids;
        for &n in steps.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (now, later) = rest.split_at(n.clamp(1, rest.len()));
            deltas.push(detok.push(now));
            rest = later;
        }
        deltas.push(detok.flush());
        deltas
    }

    fn assert_streams_like_decode(tok: &Arc<Tokenizer>, ids: &[u32], steps: &[usize], what: &str) {
        for skip in [false, true] {
            let streamed: String = stream(tok, &[], ids, steps, skip).concat();
            assert_eq!(streamed, tok.decode(ids, skip), "{what} (skip_special_tokens={skip}, ids {ids:?})");
        }
    }

    /// A small deterministic generator (tests assert exact outcomes).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// Ids biased towards the hard cases: byte pieces (ids 3..=258 in both
    /// vocabularies), BOS/EOS, a bare "▁", and ordinary pieces.
    fn random_ids(rng: &mut Lcg, vocab: u64, len: usize) -> Vec<u32> {
        let bare_space = 29871.min(vocab - 1);
        (0..len)
            .map(|_| match rng.next(10) {
                0..=3 => 3 + rng.next(256),
                4 => rng.next(3),
                5 => bare_space,
                _ => rng.next(vocab),
            } as u32)
            .collect()
    }

    #[test]
    fn golden_sequences_stream_like_decode() {
        let dir = Path::new(TEST_DATA).join("golden");
        let mut files: Vec<_> =
            std::fs::read_dir(&dir).expect("golden dir").filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.retain(|p| p.extension().is_some_and(|e| e == "json"));
        files.sort();
        assert!(files.len() >= 6, "golden files: {files:?}");
        let (mut cases, mut served) = (0, 0);
        for file in files {
            let golden: Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("read")).expect("json");
            let tok = tokenizer(golden["model"].as_str().expect("model"));
            let file_cases = golden["cases"].as_array().expect("cases");
            assert!(!file_cases.is_empty(), "{}: no cases", file.display());
            for case in file_cases {
                let ids: Vec<u32> = ["prompt_ids", "generated_ids"]
                    .iter()
                    .flat_map(|k| case[*k].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32))
                    .collect();
                let what = format!("{} {}", file.display(), case["id"]);
                cases += 1;
                assert_streams_like_decode(&tok, &ids, &[1], &what);
                assert_streams_like_decode(&tok, &ids, &[3, 1, 2], &what);
                // As served: the prompt is context and only generated text is
                // emitted. (Not comparable where random bytes continue a byte
                // run that ends the prompt, which rewrites the prompt's text.)
                let prompt = &ids[..case["prompt_ids"].as_array().expect("ids").len()];
                let (all, before) = (tok.decode(&ids, true), tok.decode(prompt, true));
                match all.strip_prefix(before.as_str()) {
                    Some(expected) => {
                        let streamed: String = stream(&tok, prompt, &ids[prompt.len()..], &[1], true).concat();
                        assert_eq!(streamed, expected, "{what}");
                        served += 1;
                    }
                    // Only where the prompt ends in a byte-fallback token
                    // and the output goes on with one may the prompt's text
                    // be rewritten: the decoder joins the byte run across.
                    None => {
                        let is_byte = |id: u32| tok.token_piece(id).starts_with("<0x");
                        let across = is_byte(prompt[prompt.len() - 1]) && is_byte(ids[prompt.len()]);
                        assert!(across, "{what}: {before:?} is not a prefix of {all:?}");
                    }
                }
            }
        }
        // Every case of every golden file was compared, however many the shared
        // directory holds (each file's non-emptiness is asserted above).
        assert!(served > cases / 2, "only {served} of {cases} comparable as served");
    }

    #[test]
    fn random_sequences_stream_like_decode() {
        for (model, vocab) in [("stories260K", 512), ("tiny-qwen3", 32000)] {
            let tok = tokenizer(model);
            let mut rng = Lcg(7);
            for round in 0..300 {
                let len = 1 + rng.next(40) as usize;
                let ids = random_ids(&mut rng, vocab, len);
                let steps: Vec<usize> = (0..3).map(|_| 1 + rng.next(3) as usize).collect();
                assert_streams_like_decode(&tok, &ids, &steps, &format!("{model} round {round}"));
                // Every prefix of the sequence, streamed one token at a time.
                if round % 10 == 0 {
                    for end in 0..ids.len() {
                        assert_streams_like_decode(
                            &tok,
                            &ids[..end],
                            &[1],
                            &format!("{model} round {round} prefix {end}"),
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn random_splits_with_prompt_context() {
        let tok = tokenizer("tiny-qwen3");
        let mut rng = Lcg(11);
        let mut checked = 0;
        for _ in 0..300 {
            let len = 2 + rng.next(30) as usize;
            let ids = random_ids(&mut rng, 32000, len);
            let split = rng.next(ids.len() as u64) as usize;
            for skip in [false, true] {
                let (all, before) = (tok.decode(&ids, skip), tok.decode(&ids[..split], skip));
                // Where generation rewrites the prompt's text (a byte run spanning
                // the split), there is no "generated part" to compare against.
                if let Some(expected) = all.strip_prefix(before.as_str()) {
                    let streamed: String = stream(&tok, &ids[..split], &ids[split..], &[1, 2], skip).concat();
                    assert_eq!(streamed, expected, "split {split} skip {skip} ids {ids:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 400, "only {checked} comparable cases");
    }

    #[test]
    fn multibyte_character_over_byte_fallback_is_held_until_complete() {
        // tok512 has no CJK pieces: "猫" is <0xE7><0x8C><0xAB>.
        let tok = tokenizer("stories260K");
        let ids = tok.encode("a 猫 b", false).expect("encode");
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &[], true);
        let deltas: Vec<String> = ids.iter().map(|&id| detok.push(&[id])).collect();
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
        assert_eq!(deltas.concat() + &detok.flush(), "a 猫 b");
        assert!(deltas.iter().any(|d| d.contains('猫')));
    }

    #[test]
    fn mid_text_pieces_keep_their_space() {
        let tok = tokenizer("tiny-qwen3");
        let prompt = tok.encode("Once upon", true).expect("encode");
        let next = tok.encode("Once upon a time", true).expect("encode");
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &prompt, true);
        let deltas: Vec<String> = next[prompt.len()..].iter().map(|&id| detok.push(&[id])).collect();
        assert_eq!(deltas, [" a", " time"]);
        assert_eq!(detok.flush(), "");
    }

    #[test]
    fn prompt_window_widens_to_a_clean_start() {
        let tok = tokenizer("stories260K");
        // A byte run longer than the initial window, continued by generation.
        let cats = tok.encode("猫猫", false).expect("encode");
        let more = &tok.encode("猫", false).expect("encode")[1..]; // without the "▁"
        assert_eq!(cats.len(), 7, "{cats:?}");
        assert_eq!(stream(&tok, &cats, more, &[1], true).concat(), "猫");
        // Skipped specials at the end of the prompt: " world" keeps its space.
        let hello = tok.encode("Hello", false).expect("encode");
        let hello_world = tok.encode("Hello world", false).expect("encode");
        let prompt: Vec<u32> = hello.iter().copied().chain([2; INITIAL_WINDOW + 1]).collect();
        assert_eq!(stream(&tok, &prompt, &hello_world[hello.len()..], &[1], true).concat(), " world");
    }

    #[test]
    fn special_tokens_are_kept_or_skipped() {
        let tok = tokenizer("tiny-qwen3");
        let ids = tok.encode("<s>user\nHi</s>", false).expect("encode");
        let run = |skip| stream(&tok, &[], &ids, &[1], skip).concat();
        assert_eq!(run(false), tok.decode(&ids, false));
        assert!(run(false).contains("</s>"));
        assert_eq!(run(true), "user\nHi");
    }

    #[test]
    fn an_unfinished_character_is_flushed_as_replacement() {
        let tok = tokenizer("stories260K");
        let ids = tok.encode("猫", false).expect("encode");
        let mut detok = IncrementalDetokenizer::new(tok.clone(), &[], false);
        let streamed = detok.push(&ids[..ids.len() - 1]);
        assert_eq!(streamed, "");
        assert_eq!(detok.flush(), tok.decode(&ids[..ids.len() - 1], false));
        assert!(detok.push(&[]).is_empty());
    }
}
