//! `--model` as given on the command line of either binary: a Hugging Face
//! directory, a GGUF file, a hub id or a `random:<preset>`; and the model
//! name both sides serve it under by default.

use std::path::{Path, PathBuf};

use super::{ModelError, Result};

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
    /// `random:<preset>`, an existing directory, a `.gguf` file, or else a
    /// hub id `org/name`.
    pub fn parse(spec: &str) -> Result<Self> {
        if let Some(preset) = spec.strip_prefix("random:") {
            return Ok(Self::Random(preset.to_string()));
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
    let path = Path::new(model);
    path.canonicalize()
        .ok()
        .filter(|p| p.is_dir())
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| model.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

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
