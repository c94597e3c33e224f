//! Stop strings with hold-back, OpenAI semantics: the output ends just
//! before the first stop string and never shows any part of it, streamed or
//! not.
//!
//! "First" means the first to be completed while generating (smallest end;
//! at equal ends the longest, then the earliest listed): that is the only
//! rule a stream can follow without taking text back, so the non-streamed
//! result uses it too. Text is held while a suffix of it could still grow into
//! a stop string; with no stop strings nothing is held.

pub struct StopStrings {
    /// Non-empty and deduplicated, in the order given.
    stops: Vec<String>,
    /// Text not yet emitted: a suffix that may begin a stop string.
    held: String,
    stopped: bool,
}

#[derive(Debug, Default, PartialEq)]
pub struct StopOutput {
    /// Text safe to emit now.
    pub text: String,
    /// The stop string that matched, if one did: generation is over and the
    /// caller should abort the request on its worker.
    pub stopped: Option<String>,
}

impl StopOutput {
    pub fn is_finished(&self) -> bool {
        self.stopped.is_some()
    }
}

impl StopStrings {
    /// Empty strings are ignored (they would match before any text).
    pub fn new(stops: Vec<String>) -> Self {
        let mut unique: Vec<String> = Vec::with_capacity(stops.len());
        for stop in stops {
            if !stop.is_empty() && !unique.contains(&stop) {
                unique.push(stop);
            }
        }
        Self { stops: unique, held: String::new(), stopped: false }
    }

    /// Whether a stop string has matched (later pushes return nothing).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a delta of generated text.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        if self.stops.is_empty() {
            return StopOutput { text: text.to_string(), stopped: None };
        }
        // Matches that end inside the already-held text were ruled out by the
        // previous push, so only ones ending in the new text are searched.
        let old_len = self.held.len();
        self.held.push_str(text);
        if let Some((start, stop)) = self.first_match(old_len) {
            let stop = stop.to_string();
            self.held.truncate(start);
            self.stopped = true;
            return StopOutput { text: std::mem::take(&mut self.held), stopped: Some(stop) };
        }
        let keep = self.partial_suffix_len();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopOutput { text, stopped: None }
    }

    /// At the end of generation (EOS, length) the held-back text is plain
    /// text.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The non-streamed result: `text` cut before its first stop string.
    pub fn apply(stops: &[String], text: &str) -> (String, Option<String>) {
        let mut matcher = Self::new(stops.to_vec());
        let out = matcher.push(text);
        let rest = matcher.flush();
        (out.text + &rest, out.stopped)
    }

    /// The earliest-ending match that ends after byte `after` of `held`:
    /// `(start, stop)`.
    fn first_match(&self, after: usize) -> Option<(usize, &str)> {
        let mut best: Option<(usize, usize, &str)> = None; // (end, start, stop)
        for stop in &self.stops {
            // Earlier occurrences end in the old text; start the search where
            // one could still end past `after`.
            let from = floor_char_boundary(&self.held, (after + 1).saturating_sub(stop.len()));
            if let Some(pos) = self.held[from..].find(stop.as_str()) {
                let (start, end) = (from + pos, from + pos + stop.len());
                let better = best.is_none_or(|(e, s, _)| end < e || (end == e && start < s));
                if better {
                    best = Some((end, start, stop));
                }
            }
        }
        best.map(|(_, start, stop)| (start, stop))
    }

    /// The longest suffix of `held` that is a proper prefix of a stop string.
    fn partial_suffix_len(&self) -> usize {
        self.stops.iter().map(|stop| held_prefix(&self.held, stop)).max().unwrap_or(0)
    }
}

/// The length of the longest end of `text` that `marker` starts with, short
/// of the whole marker: what may still become the marker once more text
/// comes (a stop string, a tool call's or a thinking block's tag).
pub fn held_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// `str::floor_char_boundary`, which is not stable yet.
fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// Streams `deltas`; returns (all emitted text, the stop, emitted per push).
    fn stream(list: &[&str], deltas: &[&str]) -> (String, Option<String>, Vec<String>) {
        let mut matcher = StopStrings::new(stops(list));
        let mut pieces = Vec::new();
        let mut stopped = None;
        for delta in deltas {
            let out = matcher.push(delta);
            pieces.push(out.text);
            if out.stopped.is_some() {
                stopped = out.stopped;
                break;
            }
        }
        if stopped.is_none() {
            pieces.push(matcher.flush());
        }
        (pieces.concat(), stopped, pieces)
    }

    /// Every way of cutting `text` into deltas at char boundaries (up to 2
    /// cuts, plus one char at a time) streams to the non-streamed result.
    fn assert_split_invariant(list: &[&str], text: &str) {
        let expected = StopStrings::apply(&stops(list), text);
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        for &a in &bounds {
            for &b in bounds.iter().filter(|&&b| b >= a) {
                let (got, stop, _) = stream(list, &[&text[..a], &text[a..b], &text[b..]]);
                assert_eq!((got, stop), expected, "stops {list:?} text {text:?} cuts {a},{b}");
            }
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let deltas: Vec<&str> = chars.iter().map(String::as_str).collect();
        let (got, stop, pieces) = stream(list, &deltas);
        assert_eq!((got, stop), expected, "stops {list:?} text {text:?} char by char");
        // Nothing emitted ever starts a stop string that then completed.
        if let Some(stop) = &expected.1 {
            assert!(!pieces.concat().contains(stop.as_str()));
        }
    }

    #[test]
    fn cuts_before_the_stop_string() {
        assert_eq!(StopStrings::apply(&stops(&["\n\n"]), "Hello.\n\nBye"), ("Hello.".into(), Some("\n\n".into())));
        assert_eq!(StopStrings::apply(&stops(&["x"]), "no match"), ("no match".into(), None));
        assert_eq!(StopStrings::apply(&stops(&["abc"]), "abc"), (String::new(), Some("abc".into())));
    }

    #[test]
    fn holds_back_only_possible_starts() {
        let mut m = StopStrings::new(stops(&["</end>"]));
        assert_eq!(m.push("Hi </"), StopOutput { text: "Hi ".into(), stopped: None });
        assert_eq!(m.push("div> more <"), StopOutput { text: "</div> more ".into(), stopped: None });
        let out = m.push("/end> tail");
        assert_eq!(out, StopOutput { text: String::new(), stopped: Some("</end>".into()) });
        assert!(out.is_finished() && m.is_stopped());
        assert_eq!(m.push("after"), StopOutput::default());
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn flush_releases_held_text_at_eos() {
        let mut m = StopStrings::new(stops(&["STOP"]));
        assert_eq!(m.push("the end ST").text, "the end ");
        assert_eq!(m.flush(), "ST");
        assert!(!m.is_stopped());
    }

    #[test]
    fn empty_stop_list_passes_everything() {
        let mut m = StopStrings::new(Vec::new());
        assert_eq!(m.push("abc").text, "abc");
        assert_eq!(m.flush(), "");
        let mut m = StopStrings::new(stops(&["", ""]));
        assert_eq!(m.push("abc"), StopOutput { text: "abc".into(), stopped: None });
        assert_split_invariant(&[], "anything at all");
    }

    #[test]
    fn first_completed_stop_wins() {
        // "bc" completes before "abcd" does.
        assert_eq!(StopStrings::apply(&stops(&["abcd", "bc"]), "xabcd"), ("xa".into(), Some("bc".into())));
        // Same end: the longer (earlier-starting) one.
        assert_eq!(StopStrings::apply(&stops(&["c", "abc"]), "xabc"), ("x".into(), Some("abc".into())));
        // A prefix of another completes first.
        assert_eq!(StopStrings::apply(&stops(&["abc", "ab"]), "xabc"), ("x".into(), Some("ab".into())));
        assert_eq!(StopStrings::apply(&stops(&["b", "a"]), "xab"), ("x".into(), Some("a".into())));
    }

    #[test]
    fn split_invariants() {
        let cases: &[(&[&str], &str)] = &[
            (&["stop"], "a stop here"),
            (&["stop"], "ststostop"),
            (&["aab"], "aaaab tail"),
            (&["abab", "bab"], "ababab"),
            (&["abcd", "bc"], "xabcd"),
            (&["ab", "abc", "c"], "xxabcab"),
            (&["\n\n", "User:"], "Sure.\nUser said\n\nok"),
            (&["END"], "no stop in this text, just EN"),
            (&["x", "y"], ""),
            (&["猫"], "日本の猫です"),
            (&["の猫", "本"], "日本の猫です"),
            (&["🦀!"], "crab 🦀 then 🦀!"),
            (&["é"], "cafe\u{301} café"),
        ];
        for (list, text) in cases {
            assert_split_invariant(list, text);
        }
    }

    #[test]
    fn multibyte_hold_back_keeps_char_boundaries() {
        let mut m = StopStrings::new(stops(&["🦀🦀"]));
        assert_eq!(m.push("a🦀").text, "a");
        assert_eq!(m.push("b").text, "🦀b");
        assert_eq!(m.push("🦀🦀c"), StopOutput { text: String::new(), stopped: Some("🦀🦀".into()) });
    }

    #[test]
    fn random_texts_stream_like_apply() {
        // Small alphabet so stop strings occur, overlap and split often.
        let alphabet: Vec<char> = "ab猫 \n".chars().collect();
        let mut state = 42u64;
        let mut next = |n: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
        for _ in 0..400 {
            let mut word = |len: usize| (0..len).map(|_| alphabet[next(alphabet.len())]).collect::<String>();
            let list: Vec<String> = (0..3).map(|i| word(1 + i)).collect();
            let text = word(12);
            let refs: Vec<&str> = list.iter().map(String::as_str).collect();
            assert_split_invariant(&refs, &text);
        }
    }
}
