//! `tinyvllm-worker generate`: one prompt's continuation, streamed to stdout
//! as it is decoded (or one JSON object at the end).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use clap::Args;
use common::{RequestId, SamplingParams};
use worker::models::ModelFiles;

use super::engine_args::{EngineArgs, build_engine};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt text (tokenized with the model's tokenizer.json, BOS added as configured).
    #[arg(long, conflicts_with = "prompt_token_ids", required_unless_present = "prompt_token_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,403,407.
    #[arg(long, value_delimiter = ',')]
    prompt_token_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy (argmax).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Nucleus sampling: keep the likeliest tokens up to this much probability; 1 disables it.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Drop tokens less likely than this fraction of the top token's probability; 0 disables it.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalize tokens already in the prompt or output (above 1 discourages repeats); 1 disables it.
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed of the sampler, for reproducible output at temperature > 0.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past the end-of-sequence token, up to --max-tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
}

fn load_tokenizer(files: &ModelFiles) -> anyhow::Result<tokenizers::Tokenizer> {
    let path = files.tokenizer_json.as_deref().with_context(|| format!("{} has no tokenizer.json", files.name))?;
    tokenizers::Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("{}: {e}", Path::new(path).display()))
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let (mut engine, files, _device) = build_engine(&args.engine)?;
    let tokenizer = if files.tokenizer_json.is_some() { Some(load_tokenizer(&files)?) } else { None };
    let prompt_ids = match (&args.prompt, &args.prompt_token_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = tokenizer.as_ref().context("--prompt needs a tokenizer.json; use --prompt-token-ids")?;
            tok.encode(text.as_str(), true)
                .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
                .get_ids()
                .to_vec()
        }
        (None, None) => bail!("give --prompt or --prompt-token-ids"),
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        ..SamplingParams::default()
    };
    engine.add_request(RequestId(0), prompt_ids, params, 0)?;
    let mut generated = Vec::new();
    let mut printed = 0; // bytes of decoded text already written
    let mut stdout = std::io::stdout();
    while engine.has_unfinished() {
        for out in engine.step()? {
            generated.extend_from_slice(&out.new_token_ids);
        }
        if let (Some(tok), false) = (&tokenizer, args.json) {
            // Re-decode and print what is new; hold back a trailing partial
            // UTF-8 character (shown as U+FFFD) until its last byte arrives.
            let text = tok.decode(&generated, false).map_err(|e| anyhow::anyhow!("{e}"))?;
            if text.len() > printed && !text.ends_with('\u{FFFD}') {
                if let Some(new) = text.get(printed..) {
                    write!(stdout, "{new}")?;
                    stdout.flush()?;
                }
                printed = text.len();
            }
        }
    }
    let text = match &tokenizer {
        Some(tok) => tok.decode(&generated, true).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => String::new(),
    };
    if args.json {
        println!("{}", serde_json::json!({ "token_ids": generated, "text": text }));
    } else if tokenizer.is_none() {
        println!("{generated:?}");
    } else {
        println!();
    }
    Ok(())
}
