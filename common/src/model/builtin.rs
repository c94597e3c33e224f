//! The model every binary carries: `builtin:stories260K`, Andrej Karpathy's
//! TinyStories model (260K parameters, trained, MIT licence; provenance in
//! tests/models/README.md), 1 MB. It is the default `--model`, so a first
//! run serves a real model with no download and no network.
//!
//! Its files are embedded in the binary and written once to a cache
//! directory (`$XDG_CACHE_HOME/tinyvllm/builtin/`, else `~/.cache/...`, else
//! the temporary directory), named by their content's hash, so every
//! process of a version reads the same directory and an upgrade never
//! reads an old copy.

use std::path::{Path, PathBuf};

use super::ModelError;

/// The spec of the built-in model.
pub const DEFAULT_MODEL: &str = "builtin:stories260K";

const STORIES_260K: [(&str, &[u8]); 5] = [
    ("config.json", include_bytes!("../../../tests/models/stories260K/config.json")),
    ("generation_config.json", include_bytes!("../../../tests/models/stories260K/generation_config.json")),
    ("model.safetensors", include_bytes!("../../../tests/models/stories260K/model.safetensors")),
    ("tokenizer.json", include_bytes!("../../../tests/models/stories260K/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../../../tests/models/stories260K/tokenizer_config.json")),
];

/// The names `builtin:` takes.
pub const BUILTIN_MODELS: [&str; 1] = ["stories260K"];

/// The directory holding built-in model `name`, written on first use.
pub fn materialize(name: &str) -> Result<PathBuf, ModelError> {
    let files = match name {
        "stories260K" => &STORIES_260K,
        other => {
            return Err(ModelError::InvalidConfig(format!(
                "no built-in model {other:?}: built in are {}",
                BUILTIN_MODELS.join(", ")
            )));
        }
    };
    let dir = cache_root().join(format!("{name}-{:016x}", content_hash(files)));
    if files.iter().all(|(file, bytes)| std::fs::metadata(dir.join(file)).is_ok_and(|m| m.len() == bytes.len() as u64))
    {
        return Ok(dir);
    }
    write_all(&dir, files).map_err(|e| ModelError::file(&dir, format!("writing the built-in model: {e}")))?;
    Ok(dir)
}

/// Writes the files into a fresh directory beside `dir`, then renames it
/// into place: another process writing at once loses the race harmlessly.
fn write_all(dir: &Path, files: &[(&str, &[u8])]) -> std::io::Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let staging = parent.join(format!(".staging-{}-{}", std::process::id(), nanos()));
    std::fs::create_dir_all(&staging)?;
    for (file, bytes) in files {
        std::fs::write(staging.join(file), bytes)?;
    }
    match std::fs::rename(&staging, dir) {
        Ok(()) => Ok(()),
        // Someone else put it there first (or a partial copy is in the way).
        Err(_) if dir.join("config.json").is_file() => {
            let _ = std::fs::remove_dir_all(&staging);
            if files.iter().all(|(f, b)| std::fs::metadata(dir.join(f)).is_ok_and(|m| m.len() == b.len() as u64)) {
                Ok(())
            } else {
                std::fs::remove_dir_all(dir)?;
                write_all(dir, files)
            }
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            Err(e)
        }
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn cache_root() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tinyvllm").join("builtin")
}

/// FNV-1a over the files' names and bytes.
fn content_hash(files: &[(&str, &[u8])]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for (name, bytes) in files {
        for &b in name.as_bytes().iter().chain(bytes.iter()) {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_model_is_written_once_and_read_back() {
        let root = std::env::temp_dir().join(format!("tinyvllm-builtin-test-{}", std::process::id()));
        // SAFETY: this test is the only one in this crate that reads or sets XDG_CACHE_HOME.
        unsafe { std::env::set_var("XDG_CACHE_HOME", &root) };
        let dir = materialize("stories260K").expect("written");
        assert!(dir.starts_with(&root), "{}", dir.display());
        let weights = std::fs::read(dir.join("model.safetensors")).expect("weights");
        assert_eq!(weights.len(), STORIES_260K[2].1.len());
        assert_eq!(materialize("stories260K").expect("again"), dir);
        assert!(matches!(materialize("gpt-5"), Err(ModelError::InvalidConfig(m)) if m.contains("stories260K")));
        let _ = std::fs::remove_dir_all(&root);
    }
}
