//! Stop strings with hold-back: text that could still be the start of a
//! stop string is kept until it is known not to be, so a stream never shows
//! any part of a stop string (OpenAI semantics: the stop string is cut).

pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

#[derive(Debug, Default, PartialEq)]
pub struct StopOutput {
    /// Text safe to emit now.
    pub text: String,
    /// The stop string that matched, if one did (then generation is over).
    pub stopped: Option<String>,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, held: String::new(), stopped: false }
    }

    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        self.held.push_str(text);
        // The earliest full match wins.
        let hit = self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = hit {
            let stop = stop.clone();
            let text = self.held[..at].to_string();
            self.held.clear();
            self.stopped = true;
            return StopOutput { text, stopped: Some(stop) };
        }
        // Hold back the longest suffix that is a proper prefix of a stop string.
        let mut keep = 0;
        for stop in &self.stops {
            for (i, _) in stop.char_indices().skip(1) {
                if self.held.ends_with(&stop[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutput { text, stopped: None }
    }

    /// At the end of generation the held-back text is plain text.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}
