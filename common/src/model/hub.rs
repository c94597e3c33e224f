//! Downloads of a hub model into the standard Hugging Face cache (honouring
//! HF_HOME and HF_TOKEN), fetching only what the asking side reads: the
//! coordinator the config and tokenizer files, the worker those and the
//! safetensors weights. What to fetch is decided by [`plan`], a pure
//! function; the network part needs the `hub` feature.

use std::path::PathBuf;

use super::files::Need;
use super::{ModelError, Result};

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
    /// every shard it lists.
    pub weights: bool,
}

/// The files `need` asks for.
pub fn plan(need: Need) -> HubPlan {
    HubPlan { required: CONFIG_FILE, optional: &TOKENIZER_FILES, weights: need == Need::Weights }
}

/// Downloads what [`plan`] lists, with a progress bar, and returns the
/// snapshot directory the files are in.
#[cfg(feature = "hub")]
pub fn download(repo_id: &str, need: Need) -> Result<PathBuf> {
    use std::path::Path;

    let hub_err = |message: String| ModelError::Hub { repo: repo_id.to_string(), message };
    let api =
        hf_hub::api::sync::ApiBuilder::from_env().with_progress(true).build().map_err(|e| hub_err(e.to_string()))?;
    let repo = api.model(repo_id.to_string());
    let plan = plan(need);
    let config = repo.get(plan.required).map_err(|e| hub_err(format!("{}: {e}", plan.required)))?;
    for optional in plan.optional {
        // Absent files are normal (not every repo has a generation config).
        let _ = repo.get(optional);
    }
    if plan.weights && repo.get(WEIGHTS_FILE).is_err() {
        let index = repo.get(WEIGHTS_INDEX).map_err(|e| hub_err(format!("no safetensors weights: {e}")))?;
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::file(&index, e.to_string()))?;
        for shard in super::files::shards_in_index(&text).map_err(hub_err)? {
            repo.get(&shard).map_err(|e| hub_err(format!("{shard}: {e}")))?;
        }
    }
    config.parent().map(Path::to_path_buf).ok_or_else(|| hub_err("bad cache path".into()))
}

/// Without the `hub` feature a hub id is an error, not a download.
#[cfg(not(feature = "hub"))]
pub fn download(repo_id: &str, _need: Need) -> Result<PathBuf> {
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

    #[cfg(not(feature = "hub"))]
    #[test]
    fn without_the_feature_a_hub_id_is_a_clear_error() {
        let err = download("org/name", Need::Tokenizer).unwrap_err().to_string();
        assert!(err.contains("org/name") && err.contains("`hub` feature"), "{err}");
    }
}
