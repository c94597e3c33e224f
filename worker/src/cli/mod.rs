//! The command line of `tinyvllm-worker`: one module per subcommand, and
//! the engine options they share (`engine_args`).

mod bench;
mod engine_args;
mod export;
mod generate;
mod identity;
mod offer;
mod serve;
mod stage;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use worker::Quantization;

#[derive(Parser)]
#[command(name = "tinyvllm-worker", version, about = "tinyvllm worker: a vLLM-style engine on candle")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as human text or JSON objects (one a line, for log
    /// shippers); RUST_LOG filters them (default info).
    #[arg(long, global = true, env = common::log::FORMAT_ENV, default_value = "human")]
    log_format: common::log::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of one prompt, streamed to stdout.
    Generate(generate::GenerateArgs),
    /// Offline throughput benchmark (vLLM's benchmark_throughput style).
    Bench(bench::BenchArgs),
    /// Join a cluster: dial the coordinator over QUIC and serve its requests.
    Serve(Box<serve::ServeArgs>),
    /// Write a Hugging Face directory with seeded random weights at a real
    /// model's shape and another model's tokenizer (for cluster benchmarks
    /// that need realistic compute without downloading a model).
    ExportRandom(export::ExportRandomArgs),
    /// Write a model (a HF directory or random:<preset>) as one GGUF file,
    /// so llama.cpp and this engine can run the same weights.
    ExportGguf(export::ExportGgufArgs),
}

impl Cli {
    pub fn run(self) -> anyhow::Result<()> {
        common::log::init(self.log_format);
        match self.command {
            Command::Generate(args) => generate::run(args),
            Command::Bench(args) => bench::run(args),
            Command::Serve(args) => serve::run(*args),
            Command::ExportRandom(args) => export::random(args),
            Command::ExportGguf(args) => export::gguf(args),
        }
    }
}

/// Parses a weight format by its GGML name, accepting only `formats`
/// (`--quantize` takes the block formats, `export-gguf --type` all).
fn weight_format(formats: &'static [Quantization]) -> impl TypedValueParser<Value = Quantization> {
    PossibleValuesParser::new(formats.iter().map(|q| q.name())).try_map(|name| name.parse::<Quantization>())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--help` explains every flag of every subcommand (issue 32: a new
    /// user found some bare).
    #[test]
    fn every_flag_has_help_text() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let bare: Vec<String> = cli
            .get_subcommands()
            .flat_map(|sub| sub.get_arguments().map(move |a| (sub.get_name(), a)))
            .filter(|(_, a)| a.get_help().is_none())
            .map(|(sub, a)| format!("{sub} --{}", a.get_id()))
            .collect();
        assert!(bare.is_empty(), "flags without help text: {bare:?}");
    }
}
