//! `tinyvllm-worker`: run a model locally (`generate`), measure it
//! (`bench`), join a cluster (`serve`), or write model files
//! (`export-random`, `export-gguf`). Each subcommand lives in `cli/`.

mod cli;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    cli::Cli::parse().run()
}
