//! GGUF checkpoints (llama.cpp's format): `--model file.gguf` for Llama,
//! Mistral, Qwen2 and Qwen3, and writing one (`tinyvllm-worker
//! export-gguf`), so llama.cpp and this engine can run the very same file.
//!
//! Reading goes through candle's GGUF parser. The config comes from the
//! `{arch}.*` metadata, mapped onto the same `config.json` fields (and the
//! same checks) as a Hugging Face directory. Tensor names map to HF names.
//! Q8_0 and Q4_0 linear weights stay in their blocks and run on the int8
//! kernels (no dequantized copy); f32/f16/bf16 load as tensors; any other
//! GGML type is dequantized at load time (correct, but not fast).
//!
//! llama.cpp's HF converter permutes the rows of `attn_q`/`attn_k` for the
//! `llama` architecture, because its RoPE rotates adjacent pairs (2i, 2i+1)
//! where HF's `rotate_half` rotates (i, i + d/2). We undo that permutation
//! on load and apply it on export. Qwen2/Qwen3 use the NeoX (HF) layout.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use half::f16;
use kernels::cpu::quant::{BlockQ4_0, BlockQ8_0, QK};

use super::config::{Architecture, ModelConfig};
use super::linear::Weight;
use super::llama::CausalLm;
use super::quant::{Prequantized, Quantization};
use crate::error::{Result, WorkerError};

/// What a GGUF file says about its model, besides the weights.
#[derive(Clone, Debug)]
pub struct GgufInfo {
    /// The equivalent `config.json` text (hashed to identify the model).
    pub config_json: String,
    pub config: ModelConfig,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn err(path: &Path, message: impl Into<String>) -> WorkerError {
    WorkerError::ModelFile { path: path.to_path_buf(), message: message.into() }
}

fn open(path: &Path) -> Result<(gguf_file::Content, BufReader<File>)> {
    let mut reader = BufReader::new(File::open(path).map_err(|e| err(path, e.to_string()))?);
    let content = gguf_file::Content::read(&mut reader).map_err(|e| err(path, format!("not a GGUF file: {e}")))?;
    Ok((content, reader))
}

/// The GGUF architecture name and ours.
fn architecture(name: &str) -> Option<Architecture> {
    match name {
        "llama" => Some(Architecture::Llama),
        "qwen2" => Some(Architecture::Qwen2),
        "qwen3" => Some(Architecture::Qwen3),
        _ => None,
    }
}

fn gguf_architecture(arch: Architecture) -> &'static str {
    match arch {
        // llama.cpp runs Mistral (no sliding window) as `llama`.
        Architecture::Llama | Architecture::Mistral => "llama",
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
    }
}

/// Reads the metadata of a GGUF file.
pub fn read_info(path: &Path) -> Result<GgufInfo> {
    let (content, _) = open(path)?;
    info_from(&content, path)
}

fn info_from(content: &gguf_file::Content, path: &Path) -> Result<GgufInfo> {
    let md = &content.metadata;
    let get = |key: &str| md.get(key).ok_or_else(|| err(path, format!("metadata {key} is missing")));
    let arch_name = get("general.architecture")?.to_string().map_err(|e| err(path, e.to_string()))?.clone();
    let arch = architecture(&arch_name)
        .ok_or_else(|| err(path, format!("GGUF architecture {arch_name:?} is not supported (llama, qwen2, qwen3)")))?;
    let num = |key: &str| -> Result<u64> {
        let v = get(&format!("{arch_name}.{key}"))?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x as u64))
            .map_err(|e| err(path, format!("{arch_name}.{key}: {e}")))
    };
    let float = |key: &str, default: f64| -> f64 {
        md.get(&format!("{arch_name}.{key}")).and_then(|v| v.to_f32().ok()).map_or(default, f64::from)
    };
    let embd = content.tensor_infos.get("token_embd.weight").ok_or_else(|| err(path, "no token_embd.weight"))?;
    let vocab_size = embd.shape.dims().first().copied().unwrap_or(0);
    let heads = num("attention.head_count")?;
    let hidden = num("embedding_length")?;
    let mut json = serde_json::json!({
        "architectures": [arch.hf_name()],
        "hidden_size": hidden,
        "intermediate_size": num("feed_forward_length")?,
        "num_hidden_layers": num("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": num("attention.head_count_kv").unwrap_or(heads),
        "vocab_size": vocab_size,
        "rms_norm_eps": float("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float("rope.freq_base", 10_000.0),
        "max_position_embeddings": num("context_length").unwrap_or(4096),
        "tie_word_embeddings": !content.tensor_infos.contains_key("output.weight"),
        "hidden_act": "silu",
    });
    // Dense parts load in f16 when the file's matrices are f16 or quantized
    // (what `--dtype auto` then picks), else f32.
    let half = content.tensor_infos.values().any(|t| t.shape.rank() == 2 && t.ggml_dtype != GgmlDType::F32);
    json["torch_dtype"] = (if half { "float16" } else { "float32" }).into();
    if let Ok(head_dim) = num("attention.key_length") {
        json["head_dim"] = head_dim.into();
    }
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        return Err(err(path, "RoPE frequency factors (rope_freqs.weight, Llama 3.1+ scaling) are not supported"));
    }
    let config_json = json.to_string();
    let config = ModelConfig::from_json(&config_json).map_err(|e| err(path, e.to_string()))?;
    let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
    Ok(GgufInfo {
        config_json,
        config,
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
    })
}

/// (GGUF, HF) names of the tensors outside the decoder blocks.
const FIXED_NAMES: [[&str; 2]; 3] = [
    ["token_embd.weight", "model.embed_tokens.weight"],
    ["output_norm.weight", "model.norm.weight"],
    ["output.weight", "lm_head.weight"],
];

/// (GGUF, HF) prefixes of a decoder block's tensors, before the layer number.
const BLOCK_PREFIXES: [&str; 2] = ["blk.", "model.layers."];

/// (GGUF, HF) module names inside a decoder block.
const BLOCK_NAMES: [[&str; 2]; 11] = [
    ["attn_norm", "input_layernorm"],
    ["attn_q", "self_attn.q_proj"],
    ["attn_k", "self_attn.k_proj"],
    ["attn_v", "self_attn.v_proj"],
    ["attn_output", "self_attn.o_proj"],
    ["attn_q_norm", "self_attn.q_norm"],
    ["attn_k_norm", "self_attn.k_norm"],
    ["ffn_norm", "post_attention_layernorm"],
    ["ffn_gate", "mlp.gate_proj"],
    ["ffn_up", "mlp.up_proj"],
    ["ffn_down", "mlp.down_proj"],
];

/// A tensor's name in the other convention: column `from` of the tables
/// above (0 GGUF, 1 HF) to the other one. None for tensors we do not use.
fn rename(name: &str, from: usize) -> Option<String> {
    let to = 1 - from;
    if let Some(fixed) = FIXED_NAMES.iter().find(|n| n[from] == name) {
        return Some(fixed[to].to_string());
    }
    let rest = name.strip_prefix(BLOCK_PREFIXES[from])?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, param) = rest.rsplit_once('.')?;
    let module = BLOCK_NAMES.iter().find(|n| n[from] == module)?[to];
    Some(format!("{}{layer}.{module}.{param}", BLOCK_PREFIXES[to]))
}

/// HF tensor name for a GGUF one.
fn hf_name(gguf: &str) -> Option<String> {
    rename(gguf, 0)
}

/// GGUF tensor name for an HF one.
fn gguf_name(hf: &str) -> Option<String> {
    rename(hf, 1)
}

/// Row order llama.cpp's converter gives q/k of the `llama` architecture:
/// within each head, row (j * d/2 + i) of HF moves to row (2i + j).
/// `result[r] = hf[perm[r]]`.
fn llama_qk_permutation(rows: usize, heads: usize) -> Vec<usize> {
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

fn invert(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (r, &p) in perm.iter().enumerate() {
        inv[p] = r;
    }
    inv
}

/// Heads to permute by, for a tensor that needs llama's q/k permutation.
fn qk_heads(cfg: &ModelConfig, hf: &str) -> Option<usize> {
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
fn permute_tensor_rows(t: &Tensor, perm: &[usize]) -> candle_core::Result<Tensor> {
    let idx: Vec<u32> = perm.iter().map(|&p| p as u32).collect();
    t.index_select(&Tensor::from_vec(idx, perm.len(), t.device())?, 0)
}

/// Decodes raw GGML blocks (2-byte LE f16 scale, then the codes).
fn parse_blocks<B>(bytes: &[u8], block_bytes: usize, make: impl Fn(f16, &[u8]) -> B) -> Vec<B> {
    bytes.chunks_exact(block_bytes).map(|b| make(f16::from_le_bytes([b[0], b[1]]), &b[2..])).collect()
}

fn quant_weight(q: &QTensor, name: &str) -> candle_core::Result<Weight> {
    let (out, inp) = q.shape().dims2()?;
    let data = q.data()?;
    match q.dtype() {
        GgmlDType::Q8_0 => Weight::from_q8_0(
            // -128 (never written by GGML's quantizer) is clamped: the int8 kernel negates codes.
            parse_blocks(&data, 2 + QK, |d, c| BlockQ8_0 { d, qs: std::array::from_fn(|i| (c[i] as i8).max(-127)) }),
            out,
            inp,
        ),
        GgmlDType::Q4_0 => Weight::from_q4_0(
            parse_blocks(&data, 2 + QK / 2, |d, c| BlockQ4_0 { d, qs: std::array::from_fn(|i| c[i]) }),
            out,
            inp,
        ),
        other => candle_core::bail!("{name}: {other:?} is not a block format we run"),
    }
}

/// Loads the model of a GGUF file. Linear weights in Q8_0/Q4_0 stay
/// quantized (CPU only); everything else becomes `dtype` tensors.
pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<CausalLm> {
    let (content, mut reader) = open(path)?;
    let info = info_from(&content, path)?;
    let cfg = &info.config;
    let mut dense = HashMap::new();
    let mut quantized = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for gguf in names {
        let Some(hf) = hf_name(gguf) else { continue };
        let q = content.tensor(&mut reader, gguf, &Device::Cpu).map_err(|e| err(path, format!("{gguf}: {e}")))?;
        let perm = qk_heads(cfg, &hf).map(|heads| invert(&llama_qk_permutation(q.shape().dims()[0], heads)));
        let is_linear = hf.ends_with("_proj.weight") || hf == "lm_head.weight";
        if is_linear && matches!(q.dtype(), GgmlDType::Q8_0 | GgmlDType::Q4_0) && device.is_cpu() {
            let mut w = quant_weight(&q, gguf).map_err(|e| err(path, e.to_string()))?;
            if let Some(p) = &perm {
                w.permute_rows(p).map_err(|e| err(path, format!("{gguf}: {e}")))?;
            }
            quantized.insert(hf, w);
            continue;
        }
        let t = match (q.dtype(), dtype) {
            (GgmlDType::F16, DType::F16) => q.dequantize_f16(&Device::Cpu),
            _ => q.dequantize(&Device::Cpu).and_then(|t| t.to_dtype(dtype)),
        }
        .map_err(|e| err(path, format!("{gguf}: {e}")))?;
        let t = match &perm {
            Some(p) => permute_tensor_rows(&t, p).map_err(|e| err(path, e.to_string()))?,
            None => t,
        };
        dense.insert(hf, t.to_device(device)?);
    }
    let pre = Prequantized::new(quantized);
    let vb = VarBuilder::from_tensors(dense, dtype, device);
    let model =
        CausalLm::with_prequantized(cfg, vb, &pre).map_err(|e| err(path, format!("building the model: {e}")))?;
    let unused = pre.remaining();
    if !unused.is_empty() {
        return Err(err(path, format!("quantized tensors the model did not use: {unused:?}")));
    }
    Ok(model)
}

/// The vocabulary written into a GGUF (llama.cpp refuses a file without one).
#[derive(Clone, Debug)]
pub struct Vocab {
    pub tokens: Vec<String>,
    pub bos: u32,
    pub eos: u32,
}

impl Vocab {
    /// The tokens of a tokenizer.json (by id), or placeholders `<tok_N>`
    /// (with `<unk>`, `<s>`, `</s>` first) for models without one.
    pub fn from_tokenizer_json(path: Option<&Path>, vocab_size: usize, bos: u32, eos: u32) -> Result<Self> {
        let mut tokens: Vec<String> = (0..vocab_size).map(|i| format!("<tok_{i}>")).collect();
        for (i, special) in ["<unk>", "<s>", "</s>"].iter().enumerate().take(vocab_size) {
            tokens[i] = special.to_string();
        }
        if let Some(path) = path {
            let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| err(path, e.to_string()))?;
            for (text, id) in tok.get_vocab(true) {
                if let Some(slot) = tokens.get_mut(id as usize) {
                    *slot = text;
                }
            }
        }
        Ok(Self { tokens, bos, eos })
    }
}

/// Writes `tensors` (HF names, any dtype) as a GGUF llama.cpp can load.
pub fn write(
    path: &Path,
    cfg: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    ty: Quantization,
    vocab: &Vocab,
) -> Result<()> {
    if cfg.rope_scaling.is_some() {
        return Err(err(path, "exporting RoPE scaling (rope_freqs) is not supported"));
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
    if cfg.architecture != Architecture::Llama && cfg.architecture != Architecture::Mistral {
        // llama.cpp tokenizes Qwen with its BPE ("gpt2") model, which needs
        // merges we do not export; prompts must then be given as ids.
        metadata.retain(|(k, _)| k != "tokenizer.ggml.model");
        metadata.push(("tokenizer.ggml.model".into(), Value::String("gpt2".into())));
        metadata.push(("tokenizer.ggml.merges".into(), Value::Array(Vec::new())));
    }
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut qtensors = Vec::with_capacity(names.len());
    for hf in names {
        let gguf = gguf_name(hf).ok_or_else(|| err(path, format!("no GGUF name for {hf}")))?;
        let mut t = tensors[hf].to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
        if let Some(heads) = qk_heads(cfg, hf) {
            t = permute_tensor_rows(&t, &llama_qk_permutation(t.dims()[0], heads))?;
        }
        // Like llama.cpp: 1-D tensors (norms, biases) stay f32; the
        // embedding table stays f16 unless everything is f32.
        let is_matrix = t.rank() == 2;
        let ggml = match ty {
            _ if !is_matrix => GgmlDType::F32,
            Quantization::F32 => GgmlDType::F32,
            Quantization::F16 => GgmlDType::F16,
            _ if hf == "model.embed_tokens.weight" => GgmlDType::F16,
            _ if t.dims()[1] % QK != 0 => GgmlDType::F16,
            Quantization::Q8_0 => GgmlDType::Q8_0,
            Quantization::Q4_0 => GgmlDType::Q4_0,
        };
        qtensors.push((gguf, QTensor::quantize(&t, ggml)?));
    }
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = BufWriter::new(File::create(path).map_err(|e| err(path, e.to_string()))?);
    gguf_file::write(&mut out, &md, &ts).map_err(|e| err(path, e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for hf in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.3.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_norm.weight",
            "model.layers.12.mlp.down_proj.weight",
            "model.layers.1.post_attention_layernorm.weight",
        ] {
            let g = gguf_name(hf).unwrap();
            assert_eq!(hf_name(&g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(gguf_name("model.layers.2.self_attn.o_proj.weight").unwrap(), "blk.2.attn_output.weight");
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }

    #[test]
    fn llama_permutation_interleaves_halves() {
        // One head of dim 4: HF rows [a0 a1 b0 b1] (halves) -> [a0 b0 a1 b1].
        assert_eq!(llama_qk_permutation(4, 1), vec![0, 2, 1, 3]);
        let p = llama_qk_permutation(16, 2);
        assert_eq!(invert(&invert(&p)), p);
    }
}
