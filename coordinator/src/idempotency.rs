//! Retrying a generation safely (issue 58, point 4): a client that lost
//! its answer (a cut connection, a coordinator restart) sends the request
//! again with the same `Idempotency-Key` header (or `X-Request-Id`), and
//! gets the result of the first one when that finished, instead of a
//! second generation. As Stripe's and OpenAI's keys behave:
//!
//! - a finished request's answer (status, type, body; a stream's events
//!   whole) is replayed for the same key and the same body;
//! - the same key with another body is a 422, and while the first is still
//!   running a 409 (retry once it finished);
//! - a failed request (4xx, 5xx, a stream that ended in an error or was
//!   cut) keeps nothing, so its retry runs again.
//!
//! Answers are kept for [`KEEP_FOR`], at most [`MAX_KEYS`] of them, in
//! memory and, with `--idempotency-file`, appended to a file read back at
//! start, so a retry after a restart still finds them.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// How long a finished answer is replayed.
pub const KEEP_FOR: Duration = Duration::from_secs(24 * 3600);
/// Most answers kept; the oldest go first.
pub const MAX_KEYS: usize = 10_000;
/// Longest key accepted.
pub const MAX_KEY_BYTES: usize = 255;

/// A finished request's answer, as replayed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: String,
}

/// What a key finds.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Nothing: run the request (the key is now held as running).
    Run,
    Replay(Answer),
    /// The key's request runs now.
    Running,
    /// The key was used for another request body.
    Mismatch,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    /// Endpoint and key.
    path: String,
    key: String,
    /// SHA-256 of the request body, hex.
    request: String,
    /// Seconds since the epoch when it finished.
    at: u64,
    answer: Answer,
}

enum Entry {
    Running { request: String },
    Done(Record),
}

pub struct IdempotencyStore {
    entries: Mutex<HashMap<(String, String), Entry>>,
    file: Option<PathBuf>,
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// SHA-256 of a request body, hex: what tells a retry from another request.
pub fn request_digest(body: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, body).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

impl IdempotencyStore {
    /// In memory only.
    pub fn in_memory() -> Self {
        Self { entries: Mutex::new(HashMap::new()), file: None }
    }

    /// Kept in `file` too: the answers still fresh in it are read back now,
    /// and the file is rewritten with only those.
    pub fn with_file(file: PathBuf) -> std::io::Result<Self> {
        let store = Self { entries: Mutex::new(HashMap::new()), file: Some(file.clone()) };
        let text = match std::fs::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let fresh_after = now_secs().saturating_sub(KEEP_FOR.as_secs());
        let mut records: Vec<Record> = text
            .lines()
            .filter_map(|line| serde_json::from_str::<Record>(line).ok())
            .filter(|r| r.at >= fresh_after)
            .collect();
        records.sort_by_key(|r| r.at);
        let skip = records.len().saturating_sub(MAX_KEYS);
        let records = &records[skip..];
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let mut compacted = String::new();
        for record in records {
            compacted.push_str(&serde_json::to_string(record).map_err(std::io::Error::other)?);
            compacted.push('\n');
        }
        std::fs::write(&file, compacted)?;
        let mut entries = store.lock();
        for record in records {
            entries.insert((record.path.clone(), record.key.clone()), Entry::Done(record.clone()));
        }
        drop(entries);
        Ok(store)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `key` on `path` finds for a request whose body digests to `request`.
    pub fn begin(&self, path: &str, key: &str, request: &str) -> Lookup {
        let mut entries = self.lock();
        let slot = (path.to_string(), key.to_string());
        let fresh_after = now_secs().saturating_sub(KEEP_FOR.as_secs());
        match entries.get(&slot) {
            Some(Entry::Done(record)) if record.at >= fresh_after => {
                if record.request == request {
                    Lookup::Replay(record.answer.clone())
                } else {
                    Lookup::Mismatch
                }
            }
            Some(Entry::Running { request: running }) => {
                if running == request {
                    Lookup::Running
                } else {
                    Lookup::Mismatch
                }
            }
            _ => {
                entries.insert(slot, Entry::Running { request: request.to_string() });
                Lookup::Run
            }
        }
    }

    /// The key's request finished: its answer is kept (`Some`), or, when it
    /// failed, the key is free again (`None`).
    pub fn finish(&self, path: &str, key: &str, answer: Option<Answer>) {
        let mut entries = self.lock();
        let slot = (path.to_string(), key.to_string());
        let Some(Entry::Running { request }) = entries.remove(&slot) else { return };
        let Some(answer) = answer else { return };
        let record = Record { path: slot.0.clone(), key: slot.1.clone(), request, at: now_secs(), answer };
        if let Some(file) = &self.file {
            let line = serde_json::to_string(&record).map(|mut l| {
                l.push('\n');
                l
            });
            let appended = line.map_err(std::io::Error::other).and_then(|line| {
                std::fs::OpenOptions::new().create(true).append(true).open(file)?.write_all(line.as_bytes())
            });
            if let Err(e) = appended {
                tracing::warn!("cannot keep an answer in {}: {e}", file.display());
            }
        }
        entries.insert(slot, Entry::Done(record));
        if entries.len() > MAX_KEYS {
            let oldest = entries
                .iter()
                .filter_map(|(k, e)| match e {
                    Entry::Done(r) => Some((r.at, k.clone())),
                    Entry::Running { .. } => None,
                })
                .min();
            if let Some((_, k)) = oldest {
                entries.remove(&k);
            }
        }
    }
}

/// Whether a stream's events end as a success: no error event in them.
pub fn stream_succeeded(events: &str) -> bool {
    !events.contains("event: error") && !events.contains("data: {\"error\"") && !events.is_empty()
}

/// An answer's bytes as text (our bodies are UTF-8 JSON or SSE).
pub fn answer(status: u16, content_type: &str, body: &Bytes) -> Option<Answer> {
    let body = String::from_utf8(body.to_vec()).ok()?;
    Some(Answer { status, content_type: content_type.to_string(), body })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(body: &str) -> Answer {
        Answer { status: 200, content_type: "application/json".into(), body: body.into() }
    }

    #[test]
    fn a_finished_request_is_replayed_for_its_key_and_body_only() {
        let store = IdempotencyStore::in_memory();
        assert_eq!(store.begin("/v1/completions", "k1", "a"), Lookup::Run);
        assert_eq!(store.begin("/v1/completions", "k1", "a"), Lookup::Running);
        assert_eq!(store.begin("/v1/completions", "k1", "b"), Lookup::Mismatch);
        store.finish("/v1/completions", "k1", Some(answer("{\"x\":1}")));
        assert_eq!(store.begin("/v1/completions", "k1", "a"), Lookup::Replay(answer("{\"x\":1}")));
        assert_eq!(store.begin("/v1/completions", "k1", "b"), Lookup::Mismatch);
        // Another endpoint, another key space.
        assert_eq!(store.begin("/v1/chat/completions", "k1", "a"), Lookup::Run);
        // A failure frees the key.
        assert_eq!(store.begin("/generate", "k2", "a"), Lookup::Run);
        store.finish("/generate", "k2", None);
        assert_eq!(store.begin("/generate", "k2", "a"), Lookup::Run);
    }

    #[test]
    fn answers_survive_a_restart_through_the_file() {
        let dir = std::env::temp_dir().join(format!("tinyvllm-idem-{}", std::process::id()));
        let file = dir.join("answers.jsonl");
        let _ = std::fs::remove_dir_all(&dir);
        let store = IdempotencyStore::with_file(file.clone()).unwrap();
        assert_eq!(store.begin("/v1/completions", "k", "a"), Lookup::Run);
        store.finish("/v1/completions", "k", Some(answer("kept")));
        assert_eq!(store.begin("/v1/completions", "running", "a"), Lookup::Run);
        drop(store);
        let again = IdempotencyStore::with_file(file.clone()).unwrap();
        assert_eq!(again.begin("/v1/completions", "k", "a"), Lookup::Replay(answer("kept")));
        // One running at the restart never finished: it runs again.
        assert_eq!(again.begin("/v1/completions", "running", "a"), Lookup::Run);
        // A damaged line is skipped.
        std::fs::write(&file, format!("{}\nnot json\n", std::fs::read_to_string(&file).unwrap())).unwrap();
        let third = IdempotencyStore::with_file(file).unwrap();
        assert_eq!(third.begin("/v1/completions", "k", "a"), Lookup::Replay(answer("kept")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_streams_without_an_error_event_are_kept() {
        assert!(stream_succeeded("data: {\"choices\":[]}\n\ndata: [DONE]\n\n"));
        assert!(!stream_succeeded(
            "data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n"
        ));
        assert!(!stream_succeeded("event: error\ndata: {}\n\n"));
        assert!(!stream_succeeded(""));
    }
}
