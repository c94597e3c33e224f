//! `tinyvllm-worker bench`: the offline throughput benchmark
//! (`worker::bench`), reported as text or JSON.

use anyhow::Context;
use clap::{Args, ValueEnum};

use super::engine_args::{EngineArgs, build_engine, on_the_kernel_pool};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Requests, all submitted at once.
    #[arg(long, default_value_t = 16)]
    num_prompts: usize,
    /// Tokens in each (random) prompt.
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    /// Tokens generated for each request (EOS ignored).
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also print where a decode step's time goes (matmuls, attention,
    /// other model ops, sampling, scheduler, other).
    #[arg(long)]
    profile: bool,
    /// Score each prompt as well: the logprob of every prompt token and of
    /// this many top tokens at each position (vLLM's `prompt_logprobs`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=20))]
    prompt_logprobs: Option<u32>,
    /// Constrain every output to the JSON schema in this file (structured
    /// outputs; needs the model's vocabulary, see --tokenizer). Requests
    /// then end when the schema is complete, EOS included, and TPOT counts
    /// the tokens each made.
    #[arg(long)]
    json_schema: Option<std::path::PathBuf>,
    /// random: random prompts; copy: prompts P C P where C is the model's
    /// own greedy continuation of a random P (input-len tokens), so the
    /// output repeats a span of the prompt (n-gram speculation's case).
    ///
    /// continue: prompts P C where C is the model's own greedy continuation
    /// of P, --continue-len tokens long, so the timed output goes on with its
    /// own text and repeats spans of it once it repeats itself.
    #[arg(long, value_enum, default_value = "random")]
    workload: WorkloadArg,
    /// Tokens of the model's own text each prompt of --workload continue holds.
    #[arg(long, default_value_t = 384)]
    continue_len: usize,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum WorkloadArg {
    Random,
    Copy,
    Continue,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let structured_output = match &args.json_schema {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            Some(common::StructuredOutput::JsonSchema(text))
        }
        None => None,
    };
    let (mut engine, files, _device) = build_engine(&args.engine)?;
    let bench_args = worker::bench::BenchArgs {
        num_prompts: args.num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        seed: args.seed,
        profile: args.profile,
        prompt_logprobs: args.prompt_logprobs,
        workload: match args.workload {
            WorkloadArg::Random => worker::bench::Workload::Random,
            WorkloadArg::Copy => worker::bench::Workload::Copy,
            WorkloadArg::Continue => worker::bench::Workload::Continue(args.continue_len),
        },
        structured_output,
    };
    let report = on_the_kernel_pool(|| worker::bench::run(&mut engine, &bench_args))?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": files.name, "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                "elapsed_s": report.elapsed.as_secs_f64(), "requests_per_s": report.requests_per_s,
                "output_tokens": report.output_tokens, "output_tok_per_s": report.output_tok_per_s, "total_tok_per_s": report.total_tok_per_s,
                "ttft_ms": {"mean": report.ttft.mean_ms, "p50": report.ttft.p50_ms, "p99": report.ttft.p99_ms},
                "tpot_ms": {"mean": report.tpot.mean_ms, "p50": report.tpot.p50_ms, "p99": report.tpot.p99_ms},
                "peak_kv_blocks_used": report.peak_kv_blocks_used, "kv_blocks_total": report.kv_blocks_total,
                "kv_cache_dtype": report.kv_cache_dtype.name(),
                "spec_decode": {
                    "num_drafts": report.spec_decoding.num_drafts,
                    "num_draft_tokens": report.spec_decoding.num_draft_tokens,
                    "num_accepted_tokens": report.spec_decoding.num_accepted_tokens,
                    "acceptance_rate": report.spec_decoding.acceptance_rate(),
                },
            })
        );
    } else {
        println!("model: {}{}", files.name, if files.random_weights { " (random weights)" } else { "" });
        println!("{report}");
    }
    Ok(())
}
