//! What a GGUF file's metadata says about its model: the `{arch}.*` keys
//! mapped onto the `config.json` fields (and the same checks) a Hugging
//! Face directory has, with llama.cpp's own rules where a key is absent
//! (which layers slide, Gemma 3's query scale, YaRN's defaults).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::{GGML_TYPE_F32, GgufHeader, GgufValue};
use crate::model::config::{Architecture, ModelConfig};
use crate::model::{ModelError, Result};

/// What a GGUF file says about its model, besides the weights.
#[derive(Clone, Debug)]
pub struct GgufInfo {
    /// The equivalent `config.json` text (hashed to identify the model).
    pub config_json: String,
    pub config: ModelConfig,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The GGUF architecture name and ours.
fn architecture(name: &str) -> Option<Architecture> {
    match name {
        "llama" => Some(Architecture::Llama),
        "qwen2" => Some(Architecture::Qwen2),
        "qwen3" => Some(Architecture::Qwen3),
        "qwen3moe" => Some(Architecture::Qwen3Moe),
        "glm4moe" => Some(Architecture::Glm4Moe),
        "gemma3" => Some(Architecture::Gemma3),
        "gpt-oss" => Some(Architecture::GptOss),
        _ => None,
    }
}

/// Reads the metadata of a GGUF file.
pub fn read_info(path: &Path) -> Result<GgufInfo> {
    info_from(&GgufHeader::open(path)?, path)
}

/// The config of a GGUF model: the `{arch}.*` metadata mapped onto the same
/// `config.json` fields (and the same checks) as a Hugging Face directory.
pub fn info_from(header: &GgufHeader, path: &Path) -> Result<GgufInfo> {
    let err = |message: String| ModelError::file(path, message);
    let md = &header.metadata;
    let get = |key: &str| md.get(key).ok_or_else(|| err(format!("metadata {key} is missing")));
    let arch_name = match get("general.architecture")? {
        GgufValue::String(name) => name.clone(),
        other => return Err(err(format!("general.architecture is not a string: {other:?}"))),
    };
    let arch = architecture(&arch_name).ok_or_else(|| {
        err(format!(
            "GGUF architecture {arch_name:?} is not supported (llama, qwen2, qwen3, qwen3moe, glm4moe, gemma3, gpt-oss)"
        ))
    })?;
    // Unsigned integers of any width; i32 as well, as candle's reader took it.
    let num = |key: &str| -> Result<u64> {
        let key = format!("{arch_name}.{key}");
        match *get(&key)? {
            GgufValue::U8(v) => Ok(v.into()),
            GgufValue::U16(v) => Ok(v.into()),
            GgufValue::U32(v) => Ok(v.into()),
            GgufValue::U64(v) => Ok(v),
            GgufValue::Bool(v) => Ok(v.into()),
            GgufValue::I32(v) => Ok(v as u64),
            ref other => Err(err(format!("{key}: not an unsigned integer: {other:?}"))),
        }
    };
    let float = |key: &str, default: f64| -> f64 {
        match md.get(&format!("{arch_name}.{key}")) {
            Some(GgufValue::F32(v)) => f64::from(*v),
            _ => default,
        }
    };
    let embd = header.tensors.get("token_embd.weight").ok_or_else(|| err("no token_embd.weight".into()))?;
    // The vocabulary is the slowest-varying dimension (the rows).
    let vocab_size = embd.dims.last().copied().unwrap_or(0);
    let heads = num("attention.head_count")?;
    let hidden = num("embedding_length")?;
    // A BTreeMap writes the keys sorted whatever serde_json's features, so
    // the text (and the config hash) is the same in every binary.
    let mut json: BTreeMap<&str, serde_json::Value> = BTreeMap::from([
        ("architectures", serde_json::json!([arch.hf_name()])),
        ("hidden_size", hidden.into()),
        ("intermediate_size", num("feed_forward_length")?.into()),
        ("num_hidden_layers", num("block_count")?.into()),
        ("num_attention_heads", heads.into()),
        ("num_key_value_heads", num("attention.head_count_kv").unwrap_or(heads).into()),
        ("vocab_size", vocab_size.into()),
        ("rms_norm_eps", float("attention.layer_norm_rms_epsilon", 1e-6).into()),
        ("rope_theta", float("rope.freq_base", 10_000.0).into()),
        ("max_position_embeddings", num("context_length").unwrap_or(4096).into()),
        ("tie_word_embeddings", (!header.tensors.contains_key("output.weight")).into()),
        ("hidden_act", "silu".into()),
    ]);
    // Dense parts load in f16 when the file's matrices are f16 or quantized
    // (what `--dtype auto` then picks), else f32.
    let half = header.tensors.values().any(|t| t.dims.len() == 2 && t.ggml_type != GGML_TYPE_F32);
    json.insert("torch_dtype", (if half { "float16" } else { "float32" }).into());
    if let Ok(head_dim) = num("attention.key_length") {
        json.insert("head_dim", head_dim.into());
    }
    // Experts: Mixtral is `llama` with an expert count; llama.cpp's
    // qwen3moe always renormalises the kept experts' weights.
    if let Ok(experts) = num("expert_count").map(|n| n as usize).and_then(|n| match n {
        0 => Err(err("expert_count 0".into())),
        n => Ok(n),
    }) {
        let arch = if arch == Architecture::Llama { Architecture::Mixtral } else { arch };
        json.insert("architectures", serde_json::json!([arch.hf_name()]));
        json.insert("num_local_experts", experts.into());
        json.insert("num_experts_per_tok", num("expert_used_count")?.into());
        if let Ok(width) = num("expert_feed_forward_length") {
            json.insert("moe_intermediate_size", width.into());
        }
        json.insert("norm_topk_prob", (arch == Architecture::Qwen3Moe).into());
    }
    // Partial rotary (GLM-4.5): RoPE turns the first `rope.dimension_count`
    // dims of each head.
    if let (Ok(rotated), Ok(head_dim)) = (num("rope.dimension_count"), num("attention.key_length"))
        && rotated != head_dim
        && head_dim > 0
    {
        json.insert("partial_rotary_factor", (rotated as f64 / head_dim as f64).into());
    }
    if let Some(scaling) = rope_scaling(md, &arch_name, arch).map_err(err)? {
        json.insert("rope_scaling", scaling);
    }
    let block = |name: &str| header.tensors.contains_key(&format!("blk.0.{name}"));
    let float_of = |key: &str| match md.get(&format!("{arch_name}.{key}")) {
        Some(GgufValue::F32(v)) => Some(f64::from(*v)),
        _ => None,
    };
    match arch {
        Architecture::Glm4Moe => {
            glm4moe_fields(&mut json, &num, &float_of, block("attn_q.bias"), block("attn_q_norm.weight"))?
        }
        Architecture::Gemma3 => gemma3_fields(&mut json, md, &arch_name, &num, heads, hidden)?,
        Architecture::GptOss => {
            json.insert("attention_bias", true.into());
            // llama.cpp's default: every other layer slides, the first one too.
            let layers = num("block_count")? as usize;
            let window = num("attention.sliding_window")?;
            json.insert("sliding_window", window.into());
            json.insert("layer_types", layer_types(md, &arch_name, layers, 2, &num).map_err(err)?);
            // llama.cpp's `swiglu_oai` limit, as every gpt-oss config has it.
            json.insert("swiglu_limit", 7.0.into());
        }
        _ => {}
    }
    // `rope_freqs.weight` (Llama 3.1+ scaling) is tensor data: the worker's
    // loader reads it into `ModelConfig::rope_freq_factors`.
    let config_json = serde_json::to_string(&json).map_err(|e| err(e.to_string()))?;
    let mut config = ModelConfig::from_json(&config_json).map_err(|e| err(e.to_string()))?;
    // llama.cpp's converter stores Gemma's norm weights with the 1 added.
    config.norm_weights_include_one = arch == Architecture::Gemma3;
    let id = |key: &str| match md.get(key) {
        Some(GgufValue::U32(v)) => Some(*v),
        _ => None,
    };
    Ok(GgufInfo {
        config_json,
        config,
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
    })
}

/// `rope_scaling` as `config.json` spells it, from `{arch}.rope.scaling.*`.
pub(super) fn rope_scaling(
    md: &HashMap<String, GgufValue>,
    arch_name: &str,
    arch: Architecture,
) -> std::result::Result<Option<serde_json::Value>, String> {
    let get = |key: &str| md.get(&format!("{arch_name}.rope.scaling.{key}"));
    let float = |key: &str| match get(key) {
        Some(GgufValue::F32(v)) => Some(f64::from(*v)),
        _ => None,
    };
    let kind = match get("type") {
        None => return Ok(None),
        Some(GgufValue::String(kind)) => kind.as_str(),
        Some(other) => return Err(format!("rope.scaling.type is not a string: {other:?}")),
    };
    let factor = float("factor");
    let mut scaling = serde_json::Map::new();
    match kind {
        "none" => return Ok(None),
        "linear" => {}
        "yarn" => {
            let original = match get("original_context_length") {
                Some(GgufValue::U32(v)) => u64::from(*v),
                Some(GgufValue::U64(v)) => *v,
                _ => return Err("YaRN scaling without rope.scaling.original_context_length".into()),
            };
            scaling.insert("original_max_position_embeddings".into(), original.into());
            for (gguf, hf) in [
                ("yarn_beta_fast", "beta_fast"),
                ("yarn_beta_slow", "beta_slow"),
                ("yarn_attn_factor", "attention_factor"),
            ] {
                if let Some(v) = float(gguf) {
                    scaling.insert(hf.into(), v.into());
                }
            }
            if float("yarn_ext_factor").is_some_and(|v| v != 1.0) {
                return Err("YaRN with an extrapolation factor other than 1 is not supported".into());
            }
            // gpt-oss was trained with an unrounded correction range
            // (`truncate: false` in every gpt-oss config; llama.cpp rounds).
            if arch == Architecture::GptOss {
                scaling.insert("truncate".into(), false.into());
            }
        }
        other => return Err(format!("rope.scaling.type {other:?} is not supported (linear, yarn)")),
    }
    scaling.insert("rope_type".into(), kind.into());
    scaling.insert("factor".into(), factor.ok_or("rope scaling without rope.scaling.factor")?.into());
    Ok(Some(serde_json::Value::Object(scaling)))
}

/// Which layers slide, as llama.cpp reads `attention.sliding_window_pattern`:
/// a flag per layer, or every `n`-th layer full (`pattern` when absent).
pub(super) fn layer_types(
    md: &HashMap<String, GgufValue>,
    arch_name: &str,
    layers: usize,
    pattern: u64,
    num: &dyn Fn(&str) -> Result<u64>,
) -> std::result::Result<serde_json::Value, String> {
    let sliding: Vec<bool> = match md.get(&format!("{arch_name}.attention.sliding_window_pattern")) {
        Some(GgufValue::Bools(flags)) if flags.len() == layers => flags.clone(),
        Some(GgufValue::Bools(flags)) => {
            return Err(format!("a sliding-window flag for {} layers of {layers}", flags.len()));
        }
        _ => {
            let n = num("attention.sliding_window_pattern").unwrap_or(pattern);
            // llama_hparams::set_swa_pattern: n == 0, every layer slides.
            (0..layers as u64).map(|l| n == 0 || l % n < n - 1).collect()
        }
    };
    let name = |s: &bool| if *s { "sliding_attention" } else { "full_attention" };
    Ok(sliding.iter().map(name).collect::<Vec<_>>().into())
}

/// GLM-4.5's routing and attention, under its `config.json` names.
fn glm4moe_fields(
    json: &mut BTreeMap<&str, serde_json::Value>,
    num: &dyn Fn(&str) -> Result<u64>,
    float: &dyn Fn(&str) -> Option<f64>,
    qkv_bias: bool,
    qk_norm: bool,
) -> Result<()> {
    let layers = num("block_count")?;
    // Multi-token-prediction layers come after the model's own and are
    // not run here.
    let nextn = num("nextn_predict_layers").unwrap_or(0);
    json.insert("num_hidden_layers", layers.saturating_sub(nextn).into());
    json.insert("n_shared_experts", num("expert_shared_count").unwrap_or(0).into());
    json.insert("first_k_dense_replace", num("leading_dense_block_count").unwrap_or(0).into());
    json.insert("n_group", num("expert_group_count").unwrap_or(1).max(1).into());
    json.insert("topk_group", num("expert_group_used_count").unwrap_or(1).max(1).into());
    json.insert("norm_topk_prob", (num("expert_weights_norm").unwrap_or(0) != 0).into());
    json.insert("routed_scaling_factor", float("expert_weights_scale").unwrap_or(1.0).into());
    // llama.cpp's gating functions: 2 (or unset) sigmoid, GLM-4.5's.
    match num("expert_gating_func").unwrap_or(2) {
        2 => {}
        other => {
            return Err(ModelError::InvalidConfig(format!("glm4moe: expert gating function {other} (sigmoid only)")));
        }
    }
    json.insert("attention_bias", qkv_bias.into());
    json.insert("use_qk_norm", qk_norm.into());
    Ok(())
}

/// Gemma 3's attention as llama.cpp runs a `gemma3` file: every 6th layer
/// global unless the pattern says otherwise, the local layers' RoPE base
/// 10000 unless given, and queries scaled by `1/sqrt(head_dim)` (the 27B,
/// 62 layers: `1/sqrt(hidden/heads)`) unless `attention.scale` says.
fn gemma3_fields(
    json: &mut BTreeMap<&str, serde_json::Value>,
    md: &HashMap<String, GgufValue>,
    arch_name: &str,
    num: &dyn Fn(&str) -> Result<u64>,
    heads: u64,
    hidden: u64,
) -> Result<()> {
    let float = |key: &str| match md.get(&format!("{arch_name}.{key}")) {
        Some(GgufValue::F32(v)) => Some(f64::from(*v)),
        _ => None,
    };
    if float("final_logit_softcapping").is_some_and(|cap| cap != 0.0) {
        json.insert("final_logit_softcapping", float("final_logit_softcapping").into());
    }
    json.insert("hidden_activation", "gelu_pytorch_tanh".into());
    json.insert("rope_local_base_freq", float("rope.freq_base_swa").unwrap_or(10_000.0).into());
    let layers = num("block_count")?;
    let head_dim = num("attention.key_length").unwrap_or(hidden / heads.max(1));
    let scalar = match float("attention.scale") {
        Some(scale) if scale > 0.0 => 1.0 / (scale * scale),
        _ if layers == 62 => (hidden / heads.max(1)) as f64,
        _ => head_dim as f64,
    };
    json.insert("query_pre_attn_scalar", scalar.into());
    if let Ok(window) = num("attention.sliding_window")
        && window > 0
    {
        json.insert("sliding_window", window.into());
        let types = layer_types(md, arch_name, layers as usize, 6, num).map_err(ModelError::InvalidConfig)?;
        json.insert("layer_types", types);
    }
    Ok(())
}
