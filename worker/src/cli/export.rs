//! `tinyvllm-worker export-random` and `export-gguf`: write model files, a
//! Hugging Face directory of seeded random weights at a real model's shape,
//! or any model as one GGUF file for llama.cpp.

use anyhow::Context;
use candle_core::{DType, Device};
use clap::Args;
use worker::Quantization;
use worker::models::{ModelFiles, ModelSource, Need};

use super::engine_args::DTypeArg;

#[derive(Args)]
pub struct ExportGgufArgs {
    /// A Hugging Face model directory or random:<preset>.
    #[arg(long)]
    model: String,
    /// The .gguf file to write.
    #[arg(long)]
    out: std::path::PathBuf,
    /// Storage of the linear weights (norms stay f32, the embedding f16;
    /// q4_k_m is llama.cpp's Q4_K/Q6_K mix, the embedding included).
    #[arg(long, value_parser = super::weight_format(&Quantization::EXPORT_TYPES), default_value = "f16")]
    r#type: Quantization,
    /// Seed of random:<preset> weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
pub struct ExportRandomArgs {
    /// smollm-135m, tinyllama-1.1b, qwen3-0.6b, llama-3.2-1b, or the
    /// mixtures of experts and newer families at real shapes (with
    /// --num-layers to fit a machine): qwen3-30b-a3b, gpt-oss-20b, gemma3-4b,
    /// mixtral-8x7b.
    #[arg(long)]
    preset: String,
    /// A model directory whose tokenizer (and vocabulary size, BOS/EOS) to use.
    #[arg(long)]
    tokenizer_from: std::path::PathBuf,
    /// The directory to write (config.json, model.safetensors, tokenizer files).
    #[arg(long)]
    out: std::path::PathBuf,
    /// Precision of the written weights.
    #[arg(long, value_enum, default_value = "f16")]
    dtype: DTypeArg,
    /// Seed of the random weights (the same seed writes the same model).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep only the first N decoder layers. Weights are seeded per tensor in
    /// order, so this is the full model's first N layers with its embeddings
    /// and lm_head: a draft model for speculative decoding (--draft-model).
    #[arg(long)]
    num_layers: Option<usize>,
    /// Scale what layers FROM.. add to the residual stream (their o_proj and
    /// down_proj) by `--damp-scale`. The first FROM layers then decide most
    /// tokens, so a `--num-layers FROM` draft of the same seed agrees often:
    /// a target pair with a chosen acceptance rate, for measuring
    /// speculative decoding where no trained pair is at hand. The compute
    /// and the bytes read per token are the full model's.
    #[arg(long, requires = "damp_scale")]
    damp_from: Option<usize>,
    /// The factor for `--damp-from` (0 < S <= 1).
    #[arg(long, requires = "damp_from")]
    damp_scale: Option<f64>,
}

pub fn random(args: ExportRandomArgs) -> anyhow::Result<()> {
    use worker::models::loader::{random_preset_json, random_weights};
    let source: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(args.tokenizer_from.join("config.json"))
            .with_context(|| format!("reading {}/config.json", args.tokenizer_from.display()))?,
    )?;
    let mut config: serde_json::Value = serde_json::from_str(random_preset_json(&args.preset)?)?;
    for key in ["vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = source.get(key) {
            config[key] = v.clone();
        }
    }
    if let Some(n) = args.num_layers {
        let full = config["num_hidden_layers"].as_u64().unwrap_or(0);
        anyhow::ensure!((1..=full).contains(&(n as u64)), "--num-layers {n}: {} has {full} layers", args.preset);
        common::model::truncate_layers(&mut config, n);
    }
    let dtype = match args.dtype {
        DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F16 | DTypeArg::Auto => DType::F16,
    };
    config["torch_dtype"] = serde_json::json!(match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        _ => "float16",
    });
    let cfg = worker::models::ModelConfig::from_json(&config.to_string())?;
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    let mut weights = random_weights(&cfg, dtype, &Device::Cpu, args.seed)?;
    if let (Some(from), Some(scale)) = (args.damp_from, args.damp_scale) {
        anyhow::ensure!(scale > 0.0 && scale <= 1.0, "--damp-scale {scale}: must be in (0, 1]");
        anyhow::ensure!(from < cfg.num_layers, "--damp-from {from}: the model has {} layers", cfg.num_layers);
        for layer in from..cfg.num_layers {
            for name in ["self_attn.o_proj.weight", "mlp.down_proj.weight"] {
                let key = format!("model.layers.{layer}.{name}");
                let tensor = weights.get(&key).with_context(|| format!("{key} missing"))?;
                let damped = tensor.affine(scale, 0.0)?;
                weights.insert(key, damped);
            }
        }
    }
    candle_core::safetensors::save(&weights, args.out.join("model.safetensors"))?;
    for file in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "tokenizer.model"] {
        let from = args.tokenizer_from.join(file);
        if from.exists() {
            std::fs::copy(&from, args.out.join(file))?;
        }
    }
    let params: usize = weights.values().map(|t| t.elem_count()).sum();
    println!("wrote {} ({} parameters, {:?})", args.out.display(), params, dtype);
    Ok(())
}

pub fn gguf(args: ExportGgufArgs) -> anyhow::Result<()> {
    use worker::models::gguf::Vocab;
    let files = ModelFiles::resolve(&ModelSource::parse(&args.model)?, Need::Weights)?;
    let tensors = if files.random_weights {
        worker::models::loader::random_weights(&files.config, DType::F32, &Device::Cpu, args.seed)?
    } else {
        anyhow::ensure!(files.gguf.is_none(), "{} already is a GGUF file", files.name);
        let mut all = std::collections::HashMap::new();
        for path in &files.weights {
            all.extend(candle_core::safetensors::load(path, &Device::Cpu)?);
        }
        all
    };
    let vocab = Vocab::from_tokenizer_json(
        files.tokenizer_json.as_deref(),
        files.config.vocab_size,
        files.bos_token_id.unwrap_or(1),
        files.eos_token_ids.first().copied().unwrap_or(2),
    )?;
    let ty = args.r#type;
    worker::models::gguf::write(&args.out, &files.config, &tensors, ty, &vocab)?;
    eprintln!("wrote {} ({ty:?}) from {}", args.out.display(), files.name);
    Ok(())
}
