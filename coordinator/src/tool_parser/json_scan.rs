//! Finds where a JSON value ends in text that arrives in pieces, without
//! parsing it: strings (with escapes) and bracket depth are all it tracks.
//! The tool-call parser streams a call's arguments with it, fragment by
//! fragment, and skips the rest of the call's object.

/// The end of one JSON value, found incrementally.
#[derive(Clone, Debug, Default)]
pub struct JsonScan {
    /// Open `{`/`[` not yet closed.
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The value is a number, `true`, `false` or `null`: it ends before
    /// the first delimiter.
    bare: bool,
    started: bool,
    done: bool,
}

impl JsonScan {
    /// A scan of the value that starts at the next non-whitespace character.
    pub fn new() -> Self {
        Self::default()
    }

    /// A scan of the rest of an object already opened: done at its `}`.
    pub fn inside_object() -> Self {
        Self { depth: 1, started: true, ..Self::default() }
    }

    pub fn done(&self) -> bool {
        self.done
    }

    /// Reads `text` and returns how many of its bytes belong to the value:
    /// all of them while it goes on, fewer once it ended. A bare value's
    /// delimiter (and whitespace before a value) is not counted as the
    /// value's when it ends it, but leading whitespace is.
    pub fn feed(&mut self, text: &str) -> usize {
        for (i, c) in text.char_indices() {
            if self.done {
                return i;
            }
            if !self.started {
                if c.is_whitespace() {
                    continue;
                }
                self.started = true;
                match c {
                    '{' | '[' => self.depth = 1,
                    '"' => self.in_string = true,
                    _ => self.bare = true,
                }
                continue;
            }
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, '\\') => self.escaped = true,
                    (false, '"') => {
                        self.in_string = false;
                        self.done = self.depth == 0;
                    }
                    _ => {}
                }
                continue;
            }
            if self.bare {
                if c.is_whitespace() || matches!(c, ',' | '}' | ']' | ';') {
                    self.done = true;
                    return i;
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' => {
                    self.depth = self.depth.saturating_sub(1);
                    self.done = self.depth == 0;
                }
                _ => {}
            }
        }
        text.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value's length in `text`, fed one character at a time.
    fn end_in_pieces(text: &str) -> Option<usize> {
        let mut scan = JsonScan::new();
        let mut total = 0;
        for (i, c) in text.char_indices() {
            let piece = &text[i..i + c.len_utf8()];
            let used = scan.feed(piece);
            total += used;
            if scan.done() {
                return Some(total);
            }
        }
        None
    }

    #[test]
    fn values_end_where_json_says() {
        for (text, value) in [
            (r#"{"a": "}\"{", "b": [1, {"c": 2}]} tail"#, r#"{"a": "}\"{", "b": [1, {"c": 2}]}"#),
            (r#"  [1, 2]]"#, "  [1, 2]"),
            (r#""x\\" rest"#, r#""x\\""#),
            ("12.5e3, 4", "12.5e3"),
            ("true}", "true"),
            ("{\"ü\": \"é\"}x", "{\"ü\": \"é\"}"),
        ] {
            let mut whole = JsonScan::new();
            assert_eq!(whole.feed(text), value.len(), "{text}");
            assert!(whole.done(), "{text}");
            assert_eq!(end_in_pieces(text), Some(value.len()), "{text}");
        }
        let mut open = JsonScan::new();
        assert_eq!(open.feed(r#"{"a": [1, "]"#), 12);
        assert!(!open.done());
    }

    #[test]
    fn the_rest_of_an_open_object() {
        let mut scan = JsonScan::inside_object();
        let text = r#", "extra": {"x": "}"}}
</tool_call>"#;
        assert_eq!(scan.feed(text), text.find('\n').unwrap());
        assert!(scan.done());
    }
}
