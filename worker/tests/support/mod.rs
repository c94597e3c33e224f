//! Helpers shared by the worker's integration tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A draft model for speculative decoding made from a real one: its first
/// `layers` decoder layers, with its embeddings, final norm and lm_head (a
/// layer-skipping self-draft). Written to a new temporary directory: a
/// config.json with fewer layers beside links to the same weights and
/// tokenizer files (the loader reads only the tensors the config names).
pub fn truncated_model(dir: &Path, layers: usize) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let name = dir.file_name().unwrap().to_string_lossy();
    let n = N.fetch_add(1, Ordering::Relaxed);
    let out = std::env::temp_dir().join(format!("tinyvllm-draft-{name}-{layers}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert!(config["num_hidden_layers"].as_u64().unwrap() > layers as u64, "{name} has too few layers");
    config["num_hidden_layers"] = layers.into();
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap();
        if file != "config.json" && path.is_file() {
            let link = out.join(file);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(std::fs::canonicalize(&path).unwrap(), link).unwrap();
        }
    }
    out
}
