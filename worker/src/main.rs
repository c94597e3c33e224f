//! `tinyvllm-worker`: run a model locally (`generate`), measure it
//! (`bench`), join a cluster (`serve`), or write model files
//! (`export-random`, `export-gguf`). Each subcommand lives in `cli/`.

mod cli;

use std::path::Path;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    cli::Cli::parse().run()
}

/// The coordinator's default `--served-model-name`: a directory's base name,
/// else the model string (hub id) as given.
fn default_served_name(model: &str) -> String {
    let path = Path::new(model);
    path.canonicalize()
        .ok()
        .filter(|p| p.is_dir())
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| model.to_string())
}
