//! Downloads of a hub model into the standard Hugging Face cache (honouring
//! HF_HOME and HF_TOKEN), fetching only what the asking side reads: the
//! coordinator the config and tokenizer files, the worker those and the
//! safetensors weights (a pipeline stage only the shards holding its
//! layers). What to fetch is decided by [`plan`] and
//! `files::shards_for_layers`, pure functions; the network part needs the
//! `hub` feature. A download logs [`ProgressLines`] (a line per file at its
//! start, every tenth of it or few seconds, and at its end; a progress
//! bar's carriage returns make no lines under systemd or launchd), and
//! hands its [`DownloadProgress`] to the caller (a worker reports it to the
//! coordinator, which shows it in `/v1/workers`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::files::Need;
use super::{ModelError, Result};
use crate::pipeline::LayerRange;
use crate::protocol::DownloadProgress;

/// The one file a model cannot do without.
pub const CONFIG_FILE: &str = "config.json";

/// Files read beside `config.json` when present: the tokenizer pipeline, its
/// special tokens and chat template (`tokenizer_config.json`), and the EOS
/// ids (`generation_config.json`). These are what `coordinator/src/text`
/// and the worker's `generate` read.
pub const TOKENIZER_FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"];

/// Single-file safetensors weights.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// The index of sharded safetensors weights (`weight_map`: tensor -> shard).
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// What one side downloads of a hub repo, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HubPlan {
    /// Fetched first; the download fails without it.
    pub required: &'static str,
    /// Fetched when the repo has them.
    pub optional: &'static [&'static str],
    /// Then the weights: [`WEIGHTS_FILE`], or else [`WEIGHTS_INDEX`] and
    /// every shard it lists (of `layers` only, when set).
    pub weights: bool,
    pub layers: Option<LayerRange>,
}

/// The files `need` asks for.
pub fn plan(need: Need) -> HubPlan {
    let layers = match need {
        Need::Layers(range) => Some(range),
        Need::Tokenizer | Need::Weights => None,
    };
    HubPlan { required: CONFIG_FILE, optional: &TOKENIZER_FILES, weights: need != Need::Tokenizer, layers }
}

/// How often a download off a terminal logs at most, besides every tenth.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// A download's progress as log lines, for stderr that is not a terminal.
/// Pure (the caller passes the clock), so its lines and their pacing are
/// tested without a network.
#[derive(Debug)]
pub struct ProgressLines {
    label: String,
    total: u64,
    done: u64,
    /// The next tenth of `total` that earns a line.
    next_tenth: u64,
    last_line: Instant,
}

impl ProgressLines {
    /// A file of `total` bytes starts: its line.
    pub fn start(repo: &str, file: &str, total: u64, now: Instant) -> (Self, String) {
        let this = Self { label: format!("{repo}/{file}"), total, done: 0, next_tenth: 1, last_line: now };
        let line = format!("downloading {}: {}", this.label, megabytes(total));
        (this, line)
    }

    /// `bytes` more arrived: a line when another tenth is done or
    /// [`LINE_EVERY`] has passed since the last line.
    pub fn advance(&mut self, bytes: u64, now: Instant) -> Option<String> {
        self.done = self.done.saturating_add(bytes).min(self.total.max(self.done));
        let tenths = self.done.saturating_mul(10).checked_div(self.total).unwrap_or(10);
        let due = tenths >= self.next_tenth || now.saturating_duration_since(self.last_line) >= LINE_EVERY;
        if !due || self.done >= self.total {
            return None; // the end has its own line
        }
        self.next_tenth = tenths + 1;
        self.last_line = now;
        let percent = self.done.saturating_mul(100).checked_div(self.total).unwrap_or(100);
        Some(format!("downloading {}: {} of {} ({percent}%)", self.label, megabytes(self.done), megabytes(self.total)))
    }

    /// The file is complete.
    pub fn finish(&self) -> String {
        format!("downloaded {}: {}", self.label, megabytes(self.done.max(self.total)))
    }
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// A download's progress over all its files: kept as [`DownloadProgress`]
/// for the caller's hook (a worker reports it to the coordinator), and as
/// [`ProgressLines`] for the log.
#[cfg(feature = "hub")]
struct Tracker<'a> {
    repo: String,
    progress: DownloadProgress,
    lines: Option<ProgressLines>,
    hook: &'a mut dyn FnMut(&DownloadProgress),
}

#[cfg(feature = "hub")]
impl Tracker<'_> {
    fn file_done(&mut self) {
        self.progress.files_done += 1;
        self.progress.file.clear();
        self.progress.file_bytes_done = 0;
        self.progress.file_bytes_total = 0;
        (self.hook)(&self.progress);
    }
}

/// hf-hub's progress hook for one file, feeding the [`Tracker`].
#[cfg(feature = "hub")]
struct FileProgress<'t, 'a>(&'t mut Tracker<'a>);

#[cfg(feature = "hub")]
impl hf_hub::api::Progress for FileProgress<'_, '_> {
    fn init(&mut self, size: usize, filename: &str) {
        let tracker = &mut *self.0;
        // A retry calls `init` again: the file starts over only in the log.
        if tracker.progress.file != filename {
            let (lines, first) = ProgressLines::start(&tracker.repo, filename, size as u64, Instant::now());
            tracing::info!("{first}");
            tracker.lines = Some(lines);
            tracker.progress.file = filename.to_string();
            tracker.progress.file_bytes_done = 0;
        }
        tracker.progress.file_bytes_total = size as u64;
        (tracker.hook)(&tracker.progress);
    }

    fn update(&mut self, size: usize) {
        let tracker = &mut *self.0;
        tracker.progress.file_bytes_done += size as u64;
        tracker.progress.bytes_done += size as u64;
        if let Some(line) = tracker.lines.as_mut().and_then(|l| l.advance(size as u64, Instant::now())) {
            tracing::info!("{line}");
        }
        (tracker.hook)(&tracker.progress);
    }

    fn finish(&mut self) {
        if let Some(lines) = &self.0.lines {
            tracing::info!("{}", lines.finish());
        }
    }
}

/// Downloads what [`plan`] lists into the Hugging Face cache (files already
/// there are not fetched again), logging progress lines and calling `hook`
/// as it goes, and returns the snapshot directory the files are in. For
/// [`Need::Layers`] only the weight shards holding tensors of those layers
/// are fetched (by the index's `weight_map`).
#[cfg(feature = "hub")]
pub fn download(repo_id: &str, need: Need, hook: &mut dyn FnMut(&DownloadProgress)) -> Result<PathBuf> {
    use std::path::Path;

    let hub_err = |message: String| ModelError::Hub { repo: repo_id.to_string(), message };
    // Progress goes to the log as lines (a bar's carriage returns make none
    // under systemd or launchd) and to `hook`.
    let api =
        hf_hub::api::sync::ApiBuilder::from_env().with_progress(false).build().map_err(|e| hub_err(e.to_string()))?;
    let repo = api.model(repo_id.to_string());
    let cache = hf_hub::Cache::from_env().model(repo_id.to_string());
    let plan = plan(need);
    let mut tracker = Tracker {
        repo: repo_id.to_string(),
        progress: DownloadProgress {
            files_total: 1 + plan.optional.len() as u32 + u32::from(plan.weights),
            ..DownloadProgress::default()
        },
        lines: None,
        hook,
    };
    let get = |tracker: &mut Tracker<'_>, file: &str| {
        let got = match cache.get(file) {
            Some(path) => Ok(path),
            None => repo.download_with_progress(file, FileProgress(tracker)),
        };
        tracker.file_done();
        got
    };
    let config = get(&mut tracker, plan.required).map_err(|e| hub_err(format!("{}: {e}", plan.required)))?;
    for optional in plan.optional {
        // Absent files are normal (not every repo has a generation config).
        let _ = get(&mut tracker, optional);
    }
    if plan.weights && get(&mut tracker, WEIGHTS_FILE).is_err() {
        let index = get(&mut tracker, WEIGHTS_INDEX).map_err(|e| hub_err(format!("no safetensors weights: {e}")))?;
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::file(&index, e.to_string()))?;
        let shards = match plan.layers {
            Some(range) => super::files::shards_for_layers(&text, range, super::files::tied_embeddings(&config)?),
            None => super::files::shards_in_index(&text),
        }
        .map_err(hub_err)?;
        tracker.progress.files_total += 1 + shards.len() as u32;
        for shard in shards {
            get(&mut tracker, &shard).map_err(|e| hub_err(format!("{shard}: {e}")))?;
        }
    }
    config.parent().map(Path::to_path_buf).ok_or_else(|| hub_err("bad cache path".into()))
}

/// Without the `hub` feature a hub id is an error, not a download.
#[cfg(not(feature = "hub"))]
pub fn download(repo_id: &str, _need: Need, _hook: &mut dyn FnMut(&DownloadProgress)) -> Result<PathBuf> {
    Err(ModelError::Hub {
        repo: repo_id.to_string(),
        message: "this build cannot download (tinyvllm-common's `hub` feature is off)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coordinator_fetches_no_weights() {
        let tokenizer = plan(Need::Tokenizer);
        assert!(!tokenizer.weights);
        let names: Vec<&str> = std::iter::once(tokenizer.required).chain(tokenizer.optional.iter().copied()).collect();
        assert_eq!(names, ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]);
        assert!(names.iter().all(|n| !n.contains("safetensors")));
    }

    #[test]
    fn the_worker_fetches_the_same_files_and_the_weights() {
        let weights = plan(Need::Weights);
        assert!(weights.weights);
        let tokenizer = plan(Need::Tokenizer);
        assert_eq!((weights.required, weights.optional), (tokenizer.required, tokenizer.optional));
    }

    /// Off a terminal: a line at the start, one per tenth (not per chunk),
    /// one after a quiet [`LINE_EVERY`], and one at the end, each naming
    /// the file with bytes done and total.
    #[test]
    fn progress_lines_come_every_tenth_or_few_seconds() {
        let t0 = Instant::now();
        let (mut p, first) = ProgressLines::start("org/name", "model.safetensors", 1_000_000_000, t0);
        assert_eq!(first, "downloading org/name/model.safetensors: 1000.0 MB");
        let mut lines = Vec::new();
        // 1000 chunks of 1 MB, 1 ms apart: ten tenths, the last of which is the end.
        for i in 1..=1000u64 {
            lines.extend(p.advance(1_000_000, t0 + Duration::from_millis(i)));
        }
        assert_eq!(lines.len(), 9, "{lines:#?}");
        assert_eq!(lines[0], "downloading org/name/model.safetensors: 100.0 MB of 1000.0 MB (10%)");
        assert_eq!(lines[8], "downloading org/name/model.safetensors: 900.0 MB of 1000.0 MB (90%)");
        assert_eq!(p.finish(), "downloaded org/name/model.safetensors: 1000.0 MB");

        // A slow link: nothing within a tenth until LINE_EVERY has passed.
        let (mut p, _) = ProgressLines::start("org/name", "model.safetensors", 1_000_000_000, t0);
        assert_eq!(p.advance(1_000_000, t0 + Duration::from_secs(1)), None);
        let line = p.advance(1_000_000, t0 + LINE_EVERY).expect("a line after LINE_EVERY");
        assert!(line.ends_with("2.0 MB of 1000.0 MB (0%)"), "{line}");
        assert_eq!(p.advance(1_000_000, t0 + LINE_EVERY + Duration::from_secs(1)), None);
    }

    /// A size hf-hub could not learn (0) or bytes past it make no panic
    /// and no lines beyond the end's.
    #[test]
    fn progress_lines_survive_odd_sizes() {
        let t0 = Instant::now();
        let (mut p, _) = ProgressLines::start("org/name", "tokenizer.json", 0, t0);
        assert_eq!(p.advance(500, t0 + LINE_EVERY), None);
        let (mut p, _) = ProgressLines::start("org/name", "config.json", 10, t0);
        assert_eq!(p.advance(25, t0), None);
        assert_eq!(p.finish(), "downloaded org/name/config.json: 0.0 MB");
    }

    #[cfg(not(feature = "hub"))]
    #[test]
    fn without_the_feature_a_hub_id_is_a_clear_error() {
        let err = download("org/name", Need::Tokenizer, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("org/name") && err.contains("`hub` feature"), "{err}");
    }
}
