//! A model's files, found from its [`ModelSource`] (`--model` of either
//! binary): a local Hugging Face directory, a hub id downloaded into the
//! standard HF cache, a GGUF file, or a `random:<preset>` (no files at
//! all). Also the few facts every side reads from them: the config, EOS/BOS
//! ids and the config hash that tells two checkpoints apart. Building the
//! model from the files is the worker's job (`worker::models::loader::load`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::config::ModelConfig;
use super::hub::{self, WEIGHTS_FILE, WEIGHTS_INDEX};
use super::{ModelError, Result, gguf};
use crate::pipeline::LayerRange;
use crate::protocol::{DownloadProgress, ModelIdentity, config_hash};

/// Where a model comes from, parsed from `--model`.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    Dir(PathBuf),
    /// A GGUF file (llama.cpp's format).
    Gguf(PathBuf),
    Hub(String),
    Random(String),
}

impl ModelSource {
    /// `random:<preset>`, `builtin:<name>` (a model embedded in the binary,
    /// see `builtin`), an existing directory, a `.gguf` file, or else a hub
    /// id `org/name`.
    pub fn parse(spec: &str) -> Result<Self> {
        if let Some(preset) = spec.strip_prefix("random:") {
            return Ok(Self::Random(preset.to_string()));
        }
        if let Some(name) = spec.strip_prefix("builtin:") {
            return Ok(Self::Dir(super::builtin::materialize(name)?));
        }
        let path = Path::new(spec);
        if path.is_dir() {
            return Ok(Self::Dir(path.to_path_buf()));
        }
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            if path.is_file() {
                return Ok(Self::Gguf(path.to_path_buf()));
            }
            return Err(ModelError::file(path, "no such GGUF file"));
        }
        let looks_like_hub_id = spec.split('/').count() == 2 && !spec.starts_with('.') && !spec.starts_with('/');
        if looks_like_hub_id {
            return Ok(Self::Hub(spec.to_string()));
        }
        Err(ModelError::file(path, "no such model directory"))
    }
}

/// The default `--served-model-name` of coordinator and worker alike (they
/// must agree): a directory's base name, else the model string (hub id,
/// file, preset) as given.
pub fn default_served_name(model: &str) -> String {
    if let Some(name) = model.strip_prefix("builtin:") {
        return name.to_string();
    }
    let path = Path::new(model);
    path.canonicalize()
        .ok()
        .filter(|p| p.is_dir())
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| model.to_string())
}

/// What a side reads of a model. Both read the config and tokenizer files;
/// only the worker runs the weights, so only it downloads and looks for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Config and tokenizer files (the coordinator, or a worker before it
    /// knows its layers).
    Tokenizer,
    /// Those and the weights (a worker holding every layer).
    Weights,
    /// Those and the weight files holding these layers' tensors (a
    /// pipeline stage): of sharded weights, only the shards it reads.
    Layers(LayerRange),
}

/// A model's files on disk (or, for a random preset, none).
#[derive(Clone, Debug)]
pub struct ModelFiles {
    /// What the user asked for, for logs and the served model name.
    pub name: String,
    pub config: ModelConfig,
    /// The safetensors files; empty unless [`Need::Weights`] or
    /// [`Need::Layers`] was asked for on a directory or hub id.
    pub weights: Vec<PathBuf>,
    /// Set when the weights are one GGUF file.
    pub gguf: Option<PathBuf>,
    pub tokenizer_json: Option<PathBuf>,
    pub tokenizer_config_json: Option<PathBuf>,
    /// EOS ids from generation_config.json (falling back to config.json).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// True for `random:` presets: outputs are meaningless.
    pub random_weights: bool,
    /// `common::protocol::config_hash` of config.json (of the preset name for random weights).
    pub config_hash: u64,
}

/// `generation_config.json`: only the fields the engine uses.
#[derive(Clone, Debug, Default, Deserialize)]
struct GenerationConfigJson {
    #[serde(default)]
    eos_token_id: Option<OneOrMany>,
    #[serde(default)]
    bos_token_id: Option<u32>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl ModelFiles {
    /// Name and config hash, so the coordinator can refuse a worker that
    /// serves another model.
    pub fn identity(&self) -> ModelIdentity {
        ModelIdentity { name: self.name.clone(), config_hash: self.config_hash }
    }

    /// Finds (or downloads) the files of `source` that `need` asks for.
    pub fn resolve(source: &ModelSource, need: Need) -> Result<Self> {
        Self::resolve_reporting(source, need, &mut |_| {})
    }

    /// As [`ModelFiles::resolve`], calling `progress` as a hub download goes.
    pub fn resolve_reporting(
        source: &ModelSource,
        need: Need,
        progress: &mut dyn FnMut(&DownloadProgress),
    ) -> Result<Self> {
        match source {
            ModelSource::Dir(dir) => Self::from_dir(dir, dir.display().to_string(), need),
            ModelSource::Hub(repo) => {
                let dir = hub::download(repo, need, progress)?;
                Self::from_dir(&dir, repo.clone(), need)
            }
            ModelSource::Gguf(path) => {
                let info = gguf::read_info(path)?;
                // A tokenizer.json beside the file serves text prompts.
                let tokenizer = path.with_file_name("tokenizer.json");
                Ok(Self {
                    name: path.display().to_string(),
                    config: info.config,
                    weights: Vec::new(),
                    gguf: Some(path.clone()),
                    tokenizer_json: tokenizer.is_file().then_some(tokenizer),
                    tokenizer_config_json: None,
                    eos_token_ids: info.eos_token_ids,
                    bos_token_id: info.bos_token_id,
                    random_weights: false,
                    config_hash: config_hash(info.config_json.as_bytes()),
                })
            }
            ModelSource::Random(preset) => {
                let config = super::presets::random_preset(preset)?;
                Ok(Self {
                    name: format!("random:{preset}"),
                    config,
                    weights: Vec::new(),
                    gguf: None,
                    tokenizer_json: None,
                    tokenizer_config_json: None,
                    eos_token_ids: vec![2],
                    bos_token_id: Some(1),
                    random_weights: true,
                    config_hash: config_hash(format!("random:{preset}").as_bytes()),
                })
            }
        }
    }

    fn from_dir(dir: &Path, name: String, need: Need) -> Result<Self> {
        let config_path = dir.join(hub::CONFIG_FILE);
        let config_text = read_file(&config_path)?;
        let config = ModelConfig::from_json(&config_text).map_err(|e| ModelError::file(&config_path, e.to_string()))?;
        let weights = match need {
            Need::Weights => find_weight_files(dir, None)?,
            Need::Layers(range) => find_weight_files(dir, Some((range, config.tie_word_embeddings)))?,
            Need::Tokenizer => Vec::new(),
        };
        let optional = |file: &str| Some(dir.join(file)).filter(|p| p.is_file());
        let generation: GenerationConfigJson = match optional("generation_config.json") {
            Some(path) => parse_json(&path)?,
            None => GenerationConfigJson::default(),
        };
        let from_config: GenerationConfigJson = parse_json(&config_path)?;
        let eos = generation.eos_token_id.or(from_config.eos_token_id);
        let eos_token_ids = match eos {
            Some(OneOrMany::One(id)) => vec![id],
            Some(OneOrMany::Many(ids)) => ids,
            None => Vec::new(),
        };
        Ok(Self {
            name,
            config,
            weights,
            gguf: None,
            tokenizer_json: optional("tokenizer.json"),
            tokenizer_config_json: optional("tokenizer_config.json"),
            eos_token_ids,
            bos_token_id: generation.bos_token_id.or(from_config.bos_token_id),
            random_weights: false,
            config_hash: config_hash(config_text.as_bytes()),
        })
    }
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| ModelError::file(path, e.to_string()))
}

fn parse_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    serde_json::from_str(&read_file(path)?).map_err(|e| ModelError::file(path, e.to_string()))
}

/// `model.safetensors.index.json`: which shard holds each tensor.
#[derive(Deserialize)]
struct WeightsIndex {
    weight_map: HashMap<String, String>,
}

/// The shard files a `model.safetensors.index.json` lists, sorted, each once.
pub fn shards_in_index(index_json: &str) -> std::result::Result<Vec<String>, String> {
    let index: WeightsIndex = serde_json::from_str(index_json).map_err(|e| e.to_string())?;
    let mut shards: Vec<String> = index.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// The shards of a `model.safetensors.index.json` that hold a tensor the
/// pipeline stage of `layers` reads (`LayerRange::holds_tensor`), sorted,
/// each once: all a stage downloads of sharded weights.
pub fn shards_for_layers(
    index_json: &str,
    layers: LayerRange,
    tied_embeddings: bool,
) -> std::result::Result<Vec<String>, String> {
    let index: WeightsIndex = serde_json::from_str(index_json).map_err(|e| e.to_string())?;
    let mut shards: Vec<String> = index
        .weight_map
        .into_iter()
        .filter(|(tensor, _)| layers.holds_tensor(tensor, tied_embeddings))
        .map(|(_, shard)| shard)
        .collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// Whether the config at `path` ties the lm_head to the embeddings (the
/// last stage then reads the embeddings too).
#[cfg(feature = "hub")]
pub(super) fn tied_embeddings(config_path: &Path) -> Result<bool> {
    let text = read_file(config_path)?;
    let config = ModelConfig::from_json(&text).map_err(|e| ModelError::file(config_path, e.to_string()))?;
    Ok(config.tie_word_embeddings)
}

/// `model.safetensors`, or the shards listed in `model.safetensors.index.json`
/// (of a stage, only those holding its tensors: `(layers, tied embeddings)`).
fn find_weight_files(dir: &Path, stage: Option<(LayerRange, bool)>) -> Result<Vec<PathBuf>> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index_path = dir.join(WEIGHTS_INDEX);
    if !index_path.is_file() {
        return Err(ModelError::file(dir, format!("neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX} found")));
    }
    let index = read_file(&index_path)?;
    let shards = match stage {
        Some((layers, tied)) => shards_for_layers(&index, layers, tied),
        None => shards_in_index(&index),
    }
    .map_err(|e| ModelError::file(&index_path, e))?;
    shards
        .into_iter()
        .map(|shard| {
            let path = dir.join(&shard);
            if path.is_file() {
                Ok(path)
            } else {
                Err(ModelError::file(path, format!("shard listed in {} is missing", index_path.display())))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared_model(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models").join(name)
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tinyvllm-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn missing_files_are_named() {
        let dir = temp_dir("missing");
        let err = ModelFiles::resolve(&ModelSource::Dir(dir.clone()), Need::Weights).unwrap_err().to_string();
        assert!(err.contains("config.json"), "{err}");
        std::fs::copy(shared_model("stories260K/config.json"), dir.join("config.json")).unwrap();
        let err = ModelFiles::resolve(&ModelSource::Dir(dir.clone()), Need::Weights).unwrap_err().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
        // The coordinator reads no weights, so it does not ask for them.
        let files = ModelFiles::resolve(&ModelSource::Dir(dir.clone()), Need::Tokenizer).unwrap();
        assert!(files.weights.is_empty() && files.tokenizer_json.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn both_needs_agree_on_everything_but_the_weights() {
        let source = ModelSource::Dir(shared_model("tiny-qwen3"));
        let worker = ModelFiles::resolve(&source, Need::Weights).unwrap();
        let coordinator = ModelFiles::resolve(&source, Need::Tokenizer).unwrap();
        assert_eq!(worker.weights, [shared_model("tiny-qwen3/model.safetensors")]);
        assert!(coordinator.weights.is_empty());
        assert_eq!(worker.identity(), coordinator.identity());
        assert_eq!(worker.config, coordinator.config);
        assert_eq!(worker.tokenizer_json, coordinator.tokenizer_json);
        assert_eq!(worker.eos_token_ids, coordinator.eos_token_ids);
        assert!(worker.tokenizer_json.is_some());
    }

    #[test]
    fn sharded_weights_come_from_the_index() {
        let dir = temp_dir("shards");
        std::fs::copy(shared_model("stories260K/config.json"), dir.join("config.json")).unwrap();
        let index = r#"{"metadata":{},"weight_map":{"a":"b.safetensors","b":"a.safetensors","c":"b.safetensors"}}"#;
        assert_eq!(shards_in_index(index).unwrap(), ["a.safetensors", "b.safetensors"]);
        std::fs::write(dir.join(WEIGHTS_INDEX), index).unwrap();
        std::fs::write(dir.join("a.safetensors"), b"").unwrap();
        let err = ModelFiles::resolve(&ModelSource::Dir(dir.clone()), Need::Weights).unwrap_err().to_string();
        assert!(err.contains("b.safetensors") && err.contains("is missing"), "{err}");
        std::fs::write(dir.join("b.safetensors"), b"").unwrap();
        let files = ModelFiles::resolve(&ModelSource::Dir(dir.clone()), Need::Weights).unwrap();
        assert_eq!(files.weights, [dir.join("a.safetensors"), dir.join("b.safetensors")]);
        assert!(shards_in_index("{}").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A stage fetches and maps only the shards holding its tensors: its
    /// layers', the embeddings on the first stage (and on the last when
    /// they are tied), the final norm and lm_head on the last.
    #[test]
    fn a_stage_reads_only_its_shards() {
        let index = r#"{"metadata":{"total_size":1},"weight_map":{
            "model.embed_tokens.weight":"s1.safetensors",
            "model.layers.0.self_attn.q_proj.weight":"s1.safetensors",
            "model.layers.1.mlp.up_proj.weight":"s2.safetensors",
            "model.layers.2.mlp.experts.7.down_proj.weight":"s3.safetensors",
            "model.layers.3.input_layernorm.weight":"s4.safetensors",
            "model.norm.weight":"s4.safetensors",
            "lm_head.weight":"s5.safetensors"}}"#;
        let stage = |start, end, tied| shards_for_layers(index, LayerRange { start, end, total: 4 }, tied).unwrap();
        assert_eq!(
            stage(0, 4, false),
            ["s1.safetensors", "s2.safetensors", "s3.safetensors", "s4.safetensors", "s5.safetensors"]
        );
        assert_eq!(stage(0, 2, false), ["s1.safetensors", "s2.safetensors"]);
        assert_eq!(stage(1, 3, false), ["s2.safetensors", "s3.safetensors"]);
        assert_eq!(stage(2, 4, false), ["s3.safetensors", "s4.safetensors", "s5.safetensors"]);
        assert_eq!(stage(3, 4, true), ["s1.safetensors", "s4.safetensors", "s5.safetensors"]);
        assert!(shards_for_layers("{}", LayerRange::full(4), false).is_err());

        // From a directory holding only a middle stage's shards.
        let dir = temp_dir("stage-shards");
        std::fs::copy(shared_model("tiny-qwen3/config.json"), dir.join("config.json")).unwrap();
        std::fs::write(dir.join(WEIGHTS_INDEX), index).unwrap();
        for shard in ["s2.safetensors", "s3.safetensors"] {
            std::fs::write(dir.join(shard), b"").unwrap();
        }
        let source = ModelSource::Dir(dir.clone());
        let files = ModelFiles::resolve(&source, Need::Layers(LayerRange { start: 1, end: 3, total: 4 })).unwrap();
        assert_eq!(files.weights, [dir.join("s2.safetensors"), dir.join("s3.safetensors")]);
        let err = ModelFiles::resolve(&source, Need::Weights).unwrap_err().to_string();
        assert!(err.contains("s1.safetensors") && err.contains("is missing"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn random_presets_have_no_files() {
        let files = ModelFiles::resolve(&ModelSource::Random("smollm-135m".into()), Need::Weights).unwrap();
        assert!(files.random_weights && files.weights.is_empty() && files.gguf.is_none());
        assert_eq!(files.config_hash, config_hash(b"random:smollm-135m"));
    }

    #[test]
    fn specs_parse_by_shape() {
        assert_eq!(ModelSource::parse("random:smollm-135m").unwrap(), ModelSource::Random("smollm-135m".into()));
        assert_eq!(ModelSource::parse("Qwen/Qwen3-0.6B").unwrap(), ModelSource::Hub("Qwen/Qwen3-0.6B".into()));
        let dir = env!("CARGO_MANIFEST_DIR");
        assert_eq!(ModelSource::parse(dir).unwrap(), ModelSource::Dir(dir.into()));
        for missing in ["./nowhere/model", "/nowhere", "nowhere.gguf", "a/b/c"] {
            assert!(matches!(ModelSource::parse(missing), Err(ModelError::ModelFile { .. })), "{missing}");
        }
    }

    #[test]
    fn served_name_is_the_directory_or_the_spec() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/../src");
        assert_eq!(default_served_name(dir), "src");
        assert_eq!(default_served_name("Qwen/Qwen3-0.6B"), "Qwen/Qwen3-0.6B");
        assert_eq!(default_served_name("random:qwen3-0.6b"), "random:qwen3-0.6b");
    }
}
