//! GGUF checkpoints (llama.cpp's format): `--model file.gguf` for Llama,
//! Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE (experts stacked, see
//! [`super::gguf_experts`]), and writing one (`tinyvllm-worker
//! export-gguf`), so llama.cpp and this engine can run the very same file.
//!
//! The config comes from the `{arch}.*` metadata, read by
//! `common::model::gguf` (the coordinator reads it too) and mapped onto the
//! same `config.json` fields (and the same checks) as a Hugging Face
//! directory. The tensors go through candle's GGUF parser; their names map
//! to HF names.
//! Q8_0, Q4_0, Q4_K and Q6_K linear weights stay in their blocks and run
//! on the int8 kernels (no dequantized copy); f32/f16/bf16 load as
//! tensors; any other GGML type is dequantized at load time (correct, but
//! not fast). `--type q4_k_m` writes llama.cpp's Q4_K_M mix ([`k_type`]).
//!
//! llama.cpp's HF converter permutes the rows of `attn_q`/`attn_k` for the
//! `llama` architecture, because its RoPE rotates adjacent pairs (2i, 2i+1)
//! where HF's `rotate_half` rotates (i, i + d/2). We undo that permutation
//! on load and apply it on export. Qwen2/Qwen3 use the NeoX (HF) layout.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
pub use common::model::gguf::{GgufInfo, read_info};
use common::model::{Architecture, ModelConfig};
use common::pipeline::LayerRange;
use half::f16;
use kernels::cpu::kquant::{BlockQ4K, BlockQ6K, KBlock, QK_K, quantize_matrix};
use kernels::cpu::quant::{BlockQ4_0, BlockQ8_0, QK};

use super::format::Quantization;
use super::gguf_experts::{self, ExpertTensor, Param, hf_expert};
pub(super) use super::gguf_file::GgufFile;
use super::gguf_file::{RawTensor, ggml_type, mxfp4_blocks};
use super::gguf_names::gguf_name;
pub(super) use super::gguf_names::hf_name;
use super::linear::{Prequantized, Weight};
use super::llama::CausalLm;
use crate::error::{Result, WorkerError};

pub(super) fn err(path: &Path, message: impl Into<String>) -> WorkerError {
    WorkerError::ModelFile { path: path.to_path_buf(), message: message.into() }
}

fn gguf_architecture(arch: Architecture) -> &'static str {
    match arch {
        // llama.cpp runs Mistral (no sliding window) as `llama`.
        Architecture::Llama | Architecture::Mistral => "llama",
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
        // llama.cpp's names; `write` refuses experts for now.
        Architecture::Mixtral => "llama",
        Architecture::Qwen3Moe => "qwen3moe",
        Architecture::Glm4Moe => "glm4moe",
        Architecture::Gemma3 => "gemma3",
        Architecture::GptOss => "gpt-oss",
    }
}

/// Row order llama.cpp's converter gives q/k of the `llama` architecture:
/// within each head, row (j * d/2 + i) of HF moves to row (2i + j).
/// `result[r] = hf[perm[r]]`.
pub(super) fn llama_qk_permutation(rows: usize, heads: usize) -> Vec<usize> {
    let hd = rows / heads;
    let half = hd / 2;
    let mut perm = vec![0; rows];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                perm[h * hd + 2 * i + j] = h * hd + j * half + i;
            }
        }
    }
    perm
}

pub(super) fn invert(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (r, &p) in perm.iter().enumerate() {
        inv[p] = r;
    }
    inv
}

/// Heads to permute by, for a tensor that needs llama's q/k permutation.
pub(super) fn qk_heads(cfg: &ModelConfig, hf: &str) -> Option<usize> {
    if gguf_architecture(cfg.architecture) != "llama" {
        return None;
    }
    if hf.ends_with("self_attn.q_proj.weight") || hf.ends_with("self_attn.q_proj.bias") {
        Some(cfg.num_heads)
    } else if hf.ends_with("self_attn.k_proj.weight") || hf.ends_with("self_attn.k_proj.bias") {
        Some(cfg.num_kv_heads)
    } else {
        None
    }
}

/// Reorders the rows (dim 0) of a tensor.
pub(super) fn permute_tensor_rows(t: &Tensor, perm: &[usize]) -> candle_core::Result<Tensor> {
    let idx: Vec<u32> = perm.iter().map(|&p| p as u32).collect();
    t.index_select(&Tensor::from_vec(idx, perm.len(), t.device())?, 0)
}

/// Decodes raw GGML blocks (2-byte LE f16 scale, then the codes).
fn parse_blocks<B>(bytes: &[u8], block_bytes: usize, make: impl Fn(f16, &[u8]) -> B) -> Vec<B> {
    bytes.chunks_exact(block_bytes).map(|b| make(f16::from_le_bytes([b[0], b[1]]), &b[2..])).collect()
}

/// The weight `[out, in]` of GGML blocks `data` of type `ty`.
fn quant_weight_of(ty: u32, data: &[u8], (out, inp): (usize, usize), name: &str) -> candle_core::Result<Weight> {
    match ty {
        ggml_type::Q8_0 => Weight::from_q8_0(
            // -128 (never written by GGML's quantizer) is clamped: the int8 kernel negates codes.
            parse_blocks(data, 2 + QK, |d, c| BlockQ8_0 { d, qs: std::array::from_fn(|i| (c[i] as i8).max(-127)) }),
            out,
            inp,
        ),
        ggml_type::Q4_0 => Weight::from_q4_0(
            parse_blocks(data, 2 + QK / 2, |d, c| BlockQ4_0 { d, qs: std::array::from_fn(|i| c[i]) }),
            out,
            inp,
        ),
        ggml_type::MXFP4 => Weight::from_mxfp4(mxfp4_blocks(data), out, inp),
        ggml_type::Q4K => Weight::from_q4_k(
            data.chunks_exact(144)
                .map(|b| BlockQ4K {
                    d: f16::from_le_bytes([b[0], b[1]]),
                    dmin: f16::from_le_bytes([b[2], b[3]]),
                    scales: std::array::from_fn(|i| b[4 + i]),
                    qs: std::array::from_fn(|i| b[16 + i]),
                })
                .collect(),
            out,
            inp,
        ),
        ggml_type::Q6K => Weight::from_q6_k(
            data.chunks_exact(210)
                .map(|b| BlockQ6K {
                    ql: std::array::from_fn(|i| b[i]),
                    qh: std::array::from_fn(|i| b[128 + i]),
                    scales: std::array::from_fn(|i| b[192 + i] as i8),
                    d: f16::from_le_bytes([b[208], b[209]]),
                })
                .collect(),
            out,
            inp,
        ),
        other => candle_core::bail!("{name}: GGML type {other} is not a block format we run"),
    }
}

/// The GGML types kept in their blocks on the CPU.
const BLOCK_TYPES: [u32; 5] = [ggml_type::Q8_0, ggml_type::Q4_0, ggml_type::Q4K, ggml_type::Q6K, ggml_type::MXFP4];

/// Loads the model of a GGUF file. Linear weights in a block format stay
/// quantized (CPU only); everything else becomes `dtype` tensors.
/// Only the tensors of the stage holding decoder layers `range` are read.
pub fn load(path: &Path, dtype: DType, device: &Device, range: LayerRange) -> Result<CausalLm> {
    let info = read_info(path)?;
    let file = GgufFile::open(path)?;
    let cfg = &with_rope_freqs(info.config, &file, path)?;
    let mut dense = HashMap::new();
    let mut quantized = HashMap::new();
    for gguf in file.names() {
        if let Some(tensor) = ExpertTensor::parse(gguf) {
            // A stage reads the experts of its own layers.
            if range.holds_tensor(&tensor.hf_name(cfg), cfg.tie_word_embeddings) {
                let raw = file.read(gguf)?;
                load_expert_tensor(cfg, tensor, &raw, (dtype, device), (&mut dense, &mut quantized))
                    .map_err(|e| err(path, format!("{gguf}: {e}")))?;
            }
            continue;
        }
        let Some(hf) = hf_name(gguf, cfg.architecture) else { continue };
        if !range.holds_tensor(&hf, cfg.tie_word_embeddings) {
            continue;
        }
        let raw = file.read(gguf)?;
        let perm = qk_heads(cfg, &hf).map(|heads| invert(&llama_qk_permutation(raw.dims[0], heads)));
        let is_linear = hf.ends_with("_proj.weight") || hf == "lm_head.weight";
        if is_linear && BLOCK_TYPES.contains(&raw.ggml_type) && device.is_cpu() {
            let shape = match raw.dims[..] {
                [out, inp] => (out, inp),
                _ => return Err(err(path, format!("{gguf}: a matrix of {} dims", raw.dims.len()))),
            };
            let mut w =
                quant_weight_of(raw.ggml_type, &raw.bytes, shape, gguf).map_err(|e| err(path, e.to_string()))?;
            if let Some(p) = &perm {
                w.permute_rows(p).map_err(|e| err(path, format!("{gguf}: {e}")))?;
            }
            quantized.insert(hf, w);
            continue;
        }
        let t = raw.dequantize(dtype).map_err(|e| err(path, format!("{gguf}: {e}")))?;
        let t = match &perm {
            Some(p) => permute_tensor_rows(&t, p).map_err(|e| err(path, e.to_string()))?,
            None => t,
        };
        dense.insert(hf, t.to_device(device)?);
    }
    let pre = Prequantized::new(quantized);
    let vb = VarBuilder::from_tensors(dense, dtype, device);
    let model = CausalLm::stage(cfg, vb, &pre, range).map_err(|e| err(path, format!("building the model: {e}")))?;
    let unused = pre.remaining();
    if !unused.is_empty() {
        return Err(err(path, format!("quantized tensors the model did not use: {unused:?}")));
    }
    Ok(model)
}

/// A router, or a layer's stacked experts split into each expert's weights
/// under HF names: kept in their blocks on the CPU (each expert's blocks
/// are a contiguous slice), else dequantized.
fn load_expert_tensor(
    cfg: &ModelConfig,
    tensor: ExpertTensor,
    raw: &RawTensor,
    (dtype, device): (DType, &Device),
    (dense, quantized): (&mut HashMap<String, Tensor>, &mut HashMap<String, Weight>),
) -> candle_core::Result<()> {
    let (layer, which) = match tensor {
        ExpertTensor::Router { .. } | ExpertTensor::CorrectionBias { .. } => {
            // Routers stay unquantized (llama.cpp never quantizes them).
            dense.insert(tensor.hf_name(cfg), raw.dequantize(dtype)?.to_device(device)?);
            return Ok(());
        }
        ExpertTensor::Stacked { layer, which, param: Param::Bias } => {
            let all = raw.dequantize(dtype)?;
            let (experts, _) = all.dims2()?;
            check_experts(cfg, experts)?;
            for e in 0..experts {
                dense.insert(hf_expert(cfg, layer, e, which, Param::Bias), all.get(e)?.to_device(device)?);
            }
            return Ok(());
        }
        ExpertTensor::Stacked { layer, which, param: Param::Weight } => (layer, which),
    };
    let [experts, out, inp] = raw.dims[..] else { candle_core::bail!("stacked experts of {} dims", raw.dims.len()) };
    check_experts(cfg, experts)?;
    if BLOCK_TYPES.contains(&raw.ggml_type) && device.is_cpu() {
        for (e, bytes) in raw.bytes.chunks_exact(raw.bytes.len() / experts).enumerate() {
            let name = hf_expert(cfg, layer, e, which, Param::Weight);
            let w = quant_weight_of(raw.ggml_type, bytes, (out, inp), &name)?;
            quantized.insert(name, w);
        }
        return Ok(());
    }
    let all = raw.dequantize(dtype)?;
    for e in 0..experts {
        dense.insert(hf_expert(cfg, layer, e, which, Param::Weight), all.get(e)?.to_device(device)?);
    }
    Ok(())
}

fn check_experts(cfg: &ModelConfig, experts: usize) -> candle_core::Result<()> {
    if experts != cfg.moe.num_experts {
        candle_core::bail!("{experts} experts, the config says {}", cfg.moe.num_experts);
    }
    Ok(())
}

/// GGUF's name for the per-pair RoPE frequency factors (Llama 3.1+ scaling).
const ROPE_FREQS: &str = "rope_freqs.weight";

/// The config with the file's `rope_freqs.weight` applied, as llama.cpp
/// applies it: each pair's inverse frequency divided by its factor.
pub(super) fn with_rope_freqs(cfg: ModelConfig, file: &GgufFile, path: &Path) -> Result<ModelConfig> {
    if !file.contains(ROPE_FREQS) {
        return Ok(cfg);
    }
    let factors = file
        .read(ROPE_FREQS)?
        .dequantize(DType::F64)
        .and_then(|t| t.flatten_all()?.to_vec1::<f64>())
        .map_err(|e| err(path, format!("{ROPE_FREQS}: {e}")))?;
    cfg.with_rope_freq_factors(factors).map_err(|e| err(path, e.to_string()))
}

/// The vocabulary written into a GGUF (llama.cpp refuses a file without one).
#[derive(Clone, Debug)]
pub struct Vocab {
    pub tokens: Vec<String>,
    pub bos: u32,
    pub eos: u32,
    /// Byte-level BPE (GPT-2's, Qwen's) with its merges ("a b"), written as
    /// llama.cpp's `gpt2` model; empty for SentencePiece-style vocabularies
    /// (byte fallback: Llama's, the test models'), its `llama` model.
    pub merges: Vec<String>,
}

impl Vocab {
    /// The tokens of a tokenizer.json (by id), or placeholders `<tok_N>`
    /// (with `<unk>`, `<s>`, `</s>` first) for models without one.
    pub fn from_tokenizer_json(path: Option<&Path>, vocab_size: usize, bos: u32, eos: u32) -> Result<Self> {
        let mut tokens: Vec<String> = (0..vocab_size).map(|i| format!("<tok_{i}>")).collect();
        for (i, special) in ["<unk>", "<s>", "</s>"].iter().enumerate().take(vocab_size) {
            tokens[i] = special.to_string();
        }
        let mut merges = Vec::new();
        if let Some(path) = path {
            let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| err(path, e.to_string()))?;
            for (text, id) in tok.get_vocab(true) {
                if let Some(slot) = tokens.get_mut(id as usize) {
                    *slot = text;
                }
            }
            merges = byte_level_merges(path)?;
        }
        Ok(Self { tokens, bos, eos, merges })
    }
}

/// The merges of a byte-level BPE tokenizer.json ("a b", either of its
/// two spellings), or none for any other model (byte-fallback BPE is
/// SentencePiece's and goes to llama.cpp as `llama`).
fn byte_level_merges(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| err(path, e.to_string()))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(path, e.to_string()))?;
    let model = &json["model"];
    if model["type"] != "BPE" || model["byte_fallback"] == true {
        return Ok(Vec::new());
    }
    let merges = model["merges"].as_array().map(Vec::as_slice).unwrap_or_default();
    merges
        .iter()
        .map(|m| match m {
            serde_json::Value::String(pair) => Ok(pair.clone()),
            serde_json::Value::Array(pair) if pair.len() == 2 => {
                Ok(format!("{} {}", pair[0].as_str().unwrap_or_default(), pair[1].as_str().unwrap_or_default()))
            }
            other => Err(err(path, format!("a BPE merge that is not a pair: {other}"))),
        })
        .collect()
}

/// Writes `tensors` (HF names, any dtype) as a GGUF llama.cpp can load.
pub fn write(
    path: &Path,
    cfg: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    ty: Quantization,
    vocab: &Vocab,
) -> Result<()> {
    let mut tensors = tensors.clone();
    let experts = match cfg.moe.num_experts {
        0 => Vec::new(),
        _ => {
            gguf_experts::check_exportable(cfg).map_err(|e| err(path, e))?;
            gguf_experts::stack(cfg, &mut tensors)?
        }
    };
    if cfg.architecture == Architecture::Gemma3 {
        return Err(err(path, "Gemma 3 is not exported to GGUF yet"));
    }
    // Frequency factors cannot carry YaRN's scale of cos and sin.
    if cfg.rope_attention_factor() != 1.0 {
        return Err(err(path, "YaRN RoPE scaling is not exported to GGUF yet"));
    }
    let arch = gguf_architecture(cfg.architecture);
    let key = |k: &str| format!("{arch}.{k}");
    let u32v = |v: usize| Value::U32(v as u32);
    let token_types: Vec<Value> = vocab
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            // llama.cpp's types: 1 normal, 2 unknown, 3 control, 6 byte.
            let ty = if i == 0 && t == "<unk>" {
                2
            } else if t == "<s>" || t == "</s>" {
                3
            } else if t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') {
                6
            } else {
                1
            };
            Value::I32(ty)
        })
        .collect();
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String("tinyvllm export".into())),
        (key("context_length"), u32v(cfg.max_position_embeddings)),
        (key("embedding_length"), u32v(cfg.hidden_size)),
        (key("block_count"), u32v(cfg.num_layers)),
        (key("feed_forward_length"), u32v(cfg.intermediate_size)),
        (key("attention.head_count"), u32v(cfg.num_heads)),
        (key("attention.head_count_kv"), u32v(cfg.num_kv_heads)),
        (key("attention.key_length"), u32v(cfg.head_dim)),
        (key("attention.value_length"), u32v(cfg.head_dim)),
        (key("attention.layer_norm_rms_epsilon"), Value::F32(cfg.rms_norm_eps as f32)),
        (key("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (key("rope.dimension_count"), u32v(cfg.head_dim)),
        (
            "general.file_type".into(),
            u32v(match ty {
                Quantization::F32 => 0,
                Quantization::F16 => 1,
                Quantization::Q4_0 => 2,
                Quantization::Q8_0 => 7,
                Quantization::Q4KM => 15,
                // Not export types (EXPORT_TYPES): llama.cpp's pure Q4_K_S and Q6_K.
                Quantization::Q4K => 14,
                Quantization::Q6K => 18,
                Quantization::Mxfp4 => 38,
            }),
        ),
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(vocab.tokens.iter().map(|t| Value::String(t.clone())).collect())),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array((0..vocab.tokens.len()).map(|i| Value::F32(-(i as f32))).collect()),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(token_types)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(vocab.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(vocab.eos)),
    ];
    if cfg.moe.num_experts > 0 {
        metadata.push((key("expert_count"), u32v(cfg.moe.num_experts)));
        metadata.push((key("expert_used_count"), u32v(cfg.moe.experts_per_token)));
        metadata.push((key("expert_feed_forward_length"), u32v(cfg.moe.expert_intermediate_size)));
    }
    if !vocab.merges.is_empty() {
        // Byte-level BPE: llama.cpp's `gpt2` model with the merges (an
        // empty merges array has no element type llama.cpp accepts).
        metadata.retain(|(k, _)| k != "tokenizer.ggml.model");
        metadata.push(("tokenizer.ggml.model".into(), Value::String("gpt2".into())));
        let merges = vocab.merges.iter().map(|m| Value::String(m.clone())).collect();
        metadata.push(("tokenizer.ggml.merges".into(), Value::Array(merges)));
    }
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut qtensors = Vec::with_capacity(names.len());
    for hf in names {
        let gguf = gguf_name(hf, cfg.architecture).ok_or_else(|| err(path, format!("no GGUF name for {hf}")))?;
        let mut t = tensors[hf].to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        if let Some(heads) = qk_heads(cfg, hf) {
            t = permute_tensor_rows(&t, &llama_qk_permutation(t.dims()[0], heads))?;
        }
        // Like llama.cpp: 1-D tensors (norms, biases) stay f32.
        let ggml = match t.rank() {
            2 => matrix_type(cfg, ty, hf, t.dims()[1])?,
            _ => GgmlDType::F32,
        };
        qtensors.push((gguf, quantize_k(&t, ggml)?));
    }
    for (which, t) in experts {
        qtensors.push((which.gguf_name(), expert_qtensor(cfg, which, &t.to_dtype(DType::F32)?, ty)?));
    }
    // RoPE scaling travels as llama.cpp's converter writes it: per-pair
    // frequency factors, f32.
    if let Some(factors) = cfg.rope_freq_factors() {
        let factors: Vec<f32> = factors.iter().map(|&f| f as f32).collect();
        let t = Tensor::from_vec(factors, cfg.rotary_dim / 2, &Device::Cpu)?;
        qtensors.push((ROPE_FREQS.to_string(), QTensor::quantize(&t, GgmlDType::F32)?));
    }
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = BufWriter::new(File::create(path).map_err(|e| err(path, e.to_string()))?);
    gguf_file::write(&mut out, &md, &ts).map_err(|e| err(path, e.to_string()))?;
    Ok(())
}

/// The GGML type of weight matrix `hf` (rows of `inp`) in a file of type
/// `ty`: Q4_K_M's per-tensor mix ([`k_type`]); the embedding table f16
/// unless everything is f32; rows that are not whole blocks f16.
fn matrix_type(cfg: &ModelConfig, ty: Quantization, hf: &str, inp: usize) -> Result<GgmlDType> {
    Ok(match ty {
        Quantization::Q4KM => k_type(cfg, hf, inp),
        Quantization::F32 => GgmlDType::F32,
        Quantization::F16 => GgmlDType::F16,
        _ if hf == "model.embed_tokens.weight" || !inp.is_multiple_of(QK) => GgmlDType::F16,
        Quantization::Q8_0 => GgmlDType::Q8_0,
        Quantization::Q4_0 => GgmlDType::Q4_0,
        Quantization::Q4K | Quantization::Q6K | Quantization::Mxfp4 => {
            return Err(WorkerError::Unsupported(format!("{} is not an export type", ty.name())));
        }
    })
}

/// A router (f32, as llama.cpp never quantizes it) or a layer's stacked
/// experts `[experts, out, in]` in the file's type, each expert's matrix
/// typed as its dense counterpart (Q4_K_M: down as `ffn_down`).
fn expert_qtensor(cfg: &ModelConfig, which: ExpertTensor, t: &Tensor, ty: Quantization) -> Result<QTensor> {
    let ExpertTensor::Stacked { layer, which, .. } = which else { return Ok(QTensor::quantize(t, GgmlDType::F32)?) };
    let (experts, out, inp) = t.dims3()?;
    let like = ["gate_proj", "up_proj", "down_proj"][which];
    let ggml = matrix_type(cfg, ty, &format!("model.layers.{layer}.mlp.{like}.weight"), inp)?;
    // Quantized as one [experts * out, in] matrix: rows never share a block.
    let flat = quantize_k(&t.reshape((experts * out, inp))?, ggml)?;
    let bytes = flat.data()?;
    Ok(candle_core::quantized::ggml_file::qtensor_from_ggml(ggml, &bytes, vec![experts, out, inp], &Device::Cpu)?)
}

/// The type llama.cpp's Q4_K_M gives a weight matrix (`llama_tensor_get_type`
/// without its MoE and 70B cases): Q6_K for the output (or the embedding
/// when it doubles as the output), and for attn_v and ffn_down in the first
/// and last eighth of the layers and every third layer between; Q4_K for
/// the rest. Rows whose length is not a multiple of 256 cannot be k-quants:
/// llama.cpp falls back to Q5_0 (for Q4_K) and Q8_0 (for Q6_K); we have no
/// Q5_0 kernel, so both fall back to Q8_0 (f16 where rows are not even
/// whole Q8_0 blocks, as for the other types).
pub fn k_type(cfg: &ModelConfig, hf: &str, in_features: usize) -> GgmlDType {
    let more_bits = |i: usize, n: usize| i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
    let layer = || hf.strip_prefix("model.layers.")?.split_once('.')?.0.parse::<usize>().ok();
    let is_output = hf == "lm_head.weight" || (hf == "model.embed_tokens.weight" && cfg.tie_word_embeddings);
    let wide = (hf.ends_with("self_attn.v_proj.weight") || hf.ends_with("mlp.down_proj.weight"))
        && layer().is_some_and(|i| more_bits(i, cfg.num_layers));
    let ty = if is_output || wide { GgmlDType::Q6K } else { GgmlDType::Q4K };
    if in_features.is_multiple_of(QK_K) {
        ty
    } else if in_features.is_multiple_of(QK) {
        GgmlDType::Q8_0
    } else {
        GgmlDType::F16
    }
}

/// Quantizes a 2-D f32 tensor to `ggml` with our quantizers for the
/// k-quants (fitted per group), candle's for the others.
fn quantize_k(t: &Tensor, ggml: GgmlDType) -> candle_core::Result<QTensor> {
    fn blocks<B: KBlock>(t: &Tensor, ggml: GgmlDType) -> candle_core::Result<QTensor> {
        let (rows, k) = t.dims2()?;
        let q = quantize_matrix::<B>(&t.flatten_all()?.to_vec1::<f32>()?, rows, k)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        // SAFETY: the blocks are GGML's repr(C) layouts without padding.
        let bytes = unsafe { std::slice::from_raw_parts(q.as_ptr().cast::<u8>(), std::mem::size_of_val(q.as_slice())) };
        candle_core::quantized::ggml_file::qtensor_from_ggml(ggml, bytes, vec![rows, k], &Device::Cpu)
    }
    match ggml {
        GgmlDType::Q4K => blocks::<BlockQ4K>(t, ggml),
        GgmlDType::Q6K => blocks::<BlockQ6K>(t, ggml),
        _ => QTensor::quantize(t, ggml),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_permutation_interleaves_halves() {
        // One head of dim 4: HF rows [a0 a1 b0 b1] (halves) -> [a0 b0 a1 b1].
        assert_eq!(llama_qk_permutation(4, 1), vec![0, 2, 1, 3]);
        let p = llama_qk_permutation(16, 2);
        assert_eq!(invert(&invert(&p)), p);
    }

    /// llama.cpp's Q4_K_M mix on TinyLlama's shape: Q6_K for the output and
    /// for v/down in layers 0-1, 19-21 and every third between (10 of 22).
    #[test]
    fn q4_k_m_mix_follows_llama_cpp() {
        let cfg = common::model::random_preset("tinyllama-1.1b").unwrap();
        let ty = |name: &str, inp: usize| k_type(&cfg, name, inp);
        assert_eq!(ty("lm_head.weight", 2048), GgmlDType::Q6K);
        assert_eq!(ty("model.embed_tokens.weight", 2048), GgmlDType::Q4K);
        let wide: Vec<usize> = (0..22)
            .filter(|l| ty(&format!("model.layers.{l}.self_attn.v_proj.weight"), 2048) == GgmlDType::Q6K)
            .collect();
        assert_eq!(wide, [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]);
        for l in 0..22 {
            let down = ty(&format!("model.layers.{l}.mlp.down_proj.weight"), 5632);
            assert_eq!(down == GgmlDType::Q6K, wide.contains(&l));
            assert_eq!(ty(&format!("model.layers.{l}.self_attn.q_proj.weight"), 2048), GgmlDType::Q4K);
            assert_eq!(ty(&format!("model.layers.{l}.mlp.gate_proj.weight"), 2048), GgmlDType::Q4K);
        }
        // Rows that are not whole super-blocks fall back to Q8_0.
        assert_eq!(ty("model.layers.0.self_attn.q_proj.weight", 128), GgmlDType::Q8_0);
        assert_eq!(ty("lm_head.weight", 64), GgmlDType::Q8_0);
    }

    /// Our reader (`common::model::gguf`'s header, `gguf_file`'s tensors)
    /// and candle's see the same file: metadata, shapes, offsets, bytes.
    #[test]
    fn common_reader_agrees_with_candle() {
        use common::model::gguf::{GgufHeader, GgufValue};
        use common::model::{ModelFiles, ModelSource, Need};
        let dir = std::env::temp_dir().join(format!("tinyvllm-gguf-reader-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for model in ["stories260K", "tiny-qwen3"] {
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models").join(model);
            let files = ModelFiles::resolve(&ModelSource::Dir(src), Need::Weights).unwrap();
            let tensors = candle_core::safetensors::load(&files.weights[0], &Device::Cpu).unwrap();
            let vocab =
                Vocab::from_tokenizer_json(files.tokenizer_json.as_deref(), files.config.vocab_size, 1, 2).unwrap();
            for ty in [Quantization::F32, Quantization::Q8_0] {
                let path = dir.join(format!("{model}-{ty:?}.gguf"));
                write(&path, &files.config, &tensors, ty, &vocab).unwrap();
                let mut reader = std::io::BufReader::new(File::open(&path).unwrap());
                let content = gguf_file::Content::read(&mut reader).unwrap();
                let header = GgufHeader::open(&path).unwrap();
                let ours_file = GgufFile::open(&path).unwrap();
                assert_eq!(content.tensor_data_offset, header.data_offset);
                assert_eq!(content.tensor_infos.len(), header.tensors.len());
                for (name, t) in &content.tensor_infos {
                    let ours = &header.tensors[name];
                    // candle lists the dimensions slowest-varying first.
                    let dims: Vec<usize> = ours.dims.iter().rev().map(|&d| d as usize).collect();
                    assert_eq!((t.shape.dims(), t.offset), (dims.as_slice(), ours.offset), "{name}");
                    let id = match t.ggml_dtype {
                        GgmlDType::F32 => 0,
                        GgmlDType::F16 => 1,
                        GgmlDType::Q4_0 => 2,
                        GgmlDType::Q8_0 => 8,
                        other => panic!("{name}: {other:?} is not a type export writes"),
                    };
                    assert_eq!(id, ours.ggml_type, "{name}");
                    let bytes = content.tensor(&mut reader, name, &Device::Cpu).unwrap().data().unwrap().to_vec();
                    assert_eq!(bytes, ours_file.read(name).unwrap().bytes, "{name}");
                }
                assert_eq!(content.metadata.len(), header.metadata.len());
                for (key, value) in &content.metadata {
                    let same = match (value, &header.metadata[key]) {
                        (Value::U32(a), GgufValue::U32(b)) => a == b,
                        (Value::I32(a), GgufValue::I32(b)) => a == b,
                        (Value::F32(a), GgufValue::F32(b)) => a.to_bits() == b.to_bits(),
                        (Value::String(a), GgufValue::String(b)) => a == b,
                        (Value::Array(a), GgufValue::Array { len, .. }) => a.len() as u64 == *len,
                        _ => false,
                    };
                    assert!(same, "{key}: {value:?} vs {:?}", header.metadata[key]);
                }
                let info = read_info(&path).unwrap();
                assert_eq!(
                    (info.config.vocab_size, info.config.num_layers),
                    (files.config.vocab_size, files.config.num_layers)
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
