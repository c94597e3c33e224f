//! A model's `config.json`, read into one normalised description of a
//! Llama-family decoder. Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2 and Qwen3
//! differ only in the flags below, so they share one implementation (as
//! vLLM's `qwen2.py` and `mistral` reuse `llama.py`). Also the configs of
//! the `random:<preset>` models: real models' shapes for benchmarks without
//! weight files (the worker makes seeded random weights for them).

use serde::Deserialize;

use super::{ModelError, Result};

/// The architectures we can run, from `config.json`'s `architectures[0]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Mistral's attention, a mixture of experts for every MLP.
    Mixtral,
    /// Qwen3's attention, mixtures of experts where `decoder_sparse_step`
    /// and `mlp_only_layers` say.
    Qwen3Moe,
}

impl Architecture {
    pub fn from_hf_name(name: &str) -> Result<Self> {
        match name {
            "LlamaForCausalLM" => Ok(Self::Llama),
            "MistralForCausalLM" => Ok(Self::Mistral),
            "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            "MixtralForCausalLM" => Ok(Self::Mixtral),
            "Qwen3MoeForCausalLM" => Ok(Self::Qwen3Moe),
            other => Err(ModelError::UnsupportedArchitecture(other.to_string())),
        }
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }
}

/// `rope_scaling` as Hugging Face writes it: `llama3`, `yarn` and `linear`
/// change the frequencies (YaRN scales cos and sin too); `default` (or
/// none) keeps them.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN's correction range, in rotations (32 and 1 by default).
    #[serde(default)]
    pub beta_fast: Option<f64>,
    #[serde(default)]
    pub beta_slow: Option<f64>,
    /// YaRN: whether the correction range is rounded to whole dims (true
    /// by default, as transformers reads a config without the key).
    #[serde(default)]
    pub truncate: Option<bool>,
    /// YaRN's scale of cos and sin; derived from the factor (and `mscale`,
    /// `mscale_all_dim`) when absent.
    #[serde(default)]
    pub attention_factor: Option<f64>,
    #[serde(default)]
    pub mscale: Option<f64>,
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
}

impl RopeScaling {
    /// YaRN's factor, as transformers takes it: the ratio of the context to
    /// the pretrained one when the config names the latter.
    fn yarn_factor(&self, max_position_embeddings: usize) -> f64 {
        match self.original_max_position_embeddings {
            Some(original) if original > 0 => max_position_embeddings as f64 / original as f64,
            _ => self.factor.unwrap_or(1.0),
        }
    }
}

/// The raw `config.json` fields we read (serde ignores the rest).
#[derive(Clone, Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    #[serde(default)]
    hidden_act: Option<String>,
    #[serde(default)]
    torch_dtype: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
    /// Mixtral's experts per MoE layer; Qwen3-MoE calls it `num_experts`.
    #[serde(default)]
    num_local_experts: Option<usize>,
    #[serde(default)]
    num_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    #[serde(default)]
    decoder_sparse_step: Option<usize>,
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_position_embeddings() -> usize {
    4096
}

/// Everything the model code needs, checked once here.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// Per-pair divisors of the inverse RoPE frequencies, as GGUF files
    /// carry Llama 3.1+ scaling (`rope_freqs.weight`, llama.cpp's
    /// `freq_factors`): set by the GGUF loader, never by `config.json`.
    pub rope_freq_factors: Option<Vec<f64>>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2, some Llama variants).
    pub qkv_bias: bool,
    /// Bias on the o projection (Llama `attention_bias`).
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Mistral v0.1-style sliding-window attention.
    pub sliding_window: Option<usize>,
    /// The dtype the checkpoint was saved in (`torch_dtype`), if given.
    pub weights_dtype: Option<String>,
    /// Mixture of experts (all 0 or empty for a dense model).
    pub moe: MoeConfig,
}

/// A mixture-of-experts MLP's shape and routing (Mixtral, Qwen3-MoE): a
/// softmax router over `num_experts`, the `experts_per_token` largest kept.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer; 0 for a dense model.
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Each expert's hidden width.
    pub expert_intermediate_size: usize,
    /// Renormalise the kept experts' weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Layers that keep a dense MLP, besides those `sparse_step` skips.
    pub dense_layers: Vec<usize>,
    /// Every `sparse_step`-th layer (counting from 1) is MoE.
    pub sparse_step: usize,
}

impl MoeConfig {
    /// Whether decoder layer `layer` is a mixture of experts (Qwen3-MoE's rule).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.num_experts > 0
            && !self.dense_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.sparse_step.max(1))
    }
}

impl ModelConfig {
    pub fn from_json(text: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(text).map_err(|e| ModelError::InvalidConfig(e.to_string()))?;
        let arch_name = hf
            .architectures
            .first()
            .ok_or_else(|| ModelError::InvalidConfig("`architectures` is missing or empty".into()))?;
        let architecture = Architecture::from_hf_name(arch_name)?;
        if let Some(act) = hf.hidden_act.as_ref().filter(|&act| act != "silu") {
            return Err(ModelError::InvalidConfig(format!("hidden_act {act:?} is not supported (only silu)")));
        }
        if hf.num_attention_heads == 0 || hf.num_hidden_layers == 0 || hf.hidden_size == 0 {
            return Err(ModelError::InvalidConfig("sizes must be positive".into()));
        }
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
        if num_kv_heads == 0 || !hf.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::InvalidConfig(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({num_kv_heads})",
                hf.num_attention_heads
            )));
        }
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads);
        if !head_dim.is_multiple_of(2) {
            return Err(ModelError::InvalidConfig(format!("head_dim must be even for RoPE, got {head_dim}")));
        }
        if let Some(scaling) = &hf.rope_scaling {
            let kind = scaling.rope_type.as_str();
            if !["default", "llama3", "yarn", "linear"].contains(&kind) {
                return Err(ModelError::InvalidConfig(format!("rope_scaling type {kind:?} is not supported")));
            }
        }
        // Qwen2 configs carry a sliding_window that only applies when
        // use_sliding_window is true; Mistral applies it whenever it is set.
        let num_experts = hf.num_local_experts.or(hf.num_experts).unwrap_or(0);
        let moe = match architecture {
            Architecture::Mixtral | Architecture::Qwen3Moe => {
                let experts_per_token = hf.num_experts_per_tok.unwrap_or(2);
                if num_experts == 0 || experts_per_token == 0 || experts_per_token > num_experts {
                    return Err(ModelError::InvalidConfig(format!(
                        "{arch_name}: {experts_per_token} experts per token of {num_experts}"
                    )));
                }
                MoeConfig {
                    num_experts,
                    experts_per_token,
                    expert_intermediate_size: hf.moe_intermediate_size.unwrap_or(hf.intermediate_size),
                    // Mixtral always renormalises; Qwen3-MoE as configured.
                    norm_topk_prob: architecture == Architecture::Mixtral || hf.norm_topk_prob.unwrap_or(false),
                    dense_layers: hf.mlp_only_layers.clone(),
                    sparse_step: hf.decoder_sparse_step.unwrap_or(1).max(1),
                }
            }
            _ => MoeConfig::default(),
        };
        let sliding_window = match architecture {
            Architecture::Mistral | Architecture::Mixtral => hf.sliding_window,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                if hf.use_sliding_window == Some(true) { hf.sliding_window } else { None }
            }
            Architecture::Llama => None,
        };
        Ok(Self {
            architecture,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: hf.vocab_size,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            rope_scaling: hf.rope_scaling.filter(|s| s.rope_type != "default"),
            rope_freq_factors: None,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            qkv_bias: architecture == Architecture::Qwen2 || hf.attention_bias,
            o_bias: architecture != Architecture::Qwen2 && hf.attention_bias,
            mlp_bias: hf.mlp_bias,
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Qwen3Moe),
            sliding_window,
            weights_dtype: hf.torch_dtype.or(hf.dtype),
            moe,
        })
    }

    /// Parameters of the whole model: embeddings, every decoder layer
    /// (projections, biases, norms) and the final norm and lm_head (none of
    /// its own when tied). Times the bytes per weight, it is what a worker
    /// holding every layer loads, before it has read a tensor (used to plan
    /// pipelines, issue 30).
    pub fn parameter_count(&self) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let (q, kv) = ((self.num_heads * self.head_dim) as u64, (self.num_kv_heads * self.head_dim) as u64);
        let bias = |on: bool, n: u64| if on { n } else { 0 };
        let attention = h * (q + 2 * kv) + bias(self.qkv_bias, q + 2 * kv) + q * h + bias(self.o_bias, h);
        let dense_mlp = 3 * h * i + bias(self.mlp_bias, 2 * i + h);
        let m = &self.moe;
        let moe_mlp = m.num_experts as u64 * (3 * h * m.expert_intermediate_size as u64 + h);
        let mlps: u64 = (0..self.num_layers).map(|l| if m.is_moe_layer(l) { moe_mlp } else { dense_mlp }).sum();
        let norms = 2 * h + bias(self.qk_norm, 2 * self.head_dim as u64);
        let embed = (self.vocab_size as u64) * h;
        let lm_head = if self.tie_word_embeddings { 0 } else { embed };
        embed + self.num_layers as u64 * (attention + norms) + mlps + h + lm_head
    }

    /// Bytes of K and V for one token across all layers, at `dtype_size` bytes per element.
    pub fn kv_bytes_per_token(&self, dtype_size: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size
    }

    /// Inverse RoPE frequencies, one per rotated pair, with `llama3` scaling
    /// applied as transformers' `_compute_llama3_parameters` does, or
    /// divided by a GGUF file's frequency factors as llama.cpp's `rope`
    /// divides them.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let base = self.unscaled_rope_inv_freq();
        if let Some(factors) = &self.rope_freq_factors {
            return base.iter().zip(factors).map(|(inv, factor)| inv / factor).collect();
        }
        let Some(scaling) = &self.rope_scaling else { return base };
        match scaling.rope_type.as_str() {
            "llama3" => {}
            "yarn" => return self.yarn_inv_freq(scaling, base),
            "linear" => return base.iter().map(|inv| inv / scaling.factor.unwrap_or(1.0)).collect(),
            _ => return base,
        }
        let factor = scaling.factor.unwrap_or(8.0);
        let low = scaling.low_freq_factor.unwrap_or(1.0);
        let high = scaling.high_freq_factor.unwrap_or(4.0);
        let old_len = scaling.original_max_position_embeddings.unwrap_or(8192) as f64;
        let low_freq_wavelen = old_len / low;
        let high_freq_wavelen = old_len / high;
        base.into_iter()
            .map(|inv| {
                let wavelen = 2.0 * std::f64::consts::PI / inv;
                if wavelen < high_freq_wavelen {
                    inv
                } else if wavelen > low_freq_wavelen {
                    inv / factor
                } else {
                    let smooth = (old_len / wavelen - low) / (high - low);
                    (1.0 - smooth) * inv / factor + smooth * inv
                }
            })
            .collect()
    }

    /// YaRN (transformers' `_compute_yarn_parameters`): pairs rotating more
    /// than `beta_fast` times over the pretrained context keep their
    /// frequency, those under `beta_slow` are divided by the factor, and a
    /// linear ramp blends the pairs between.
    fn yarn_inv_freq(&self, s: &RopeScaling, base: Vec<f64>) -> Vec<f64> {
        let dim = self.head_dim as f64;
        let original = s.original_max_position_embeddings.unwrap_or(self.max_position_embeddings) as f64;
        let factor = s.yarn_factor(self.max_position_embeddings);
        let correction_dim = |rotations: f64| {
            dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * self.rope_theta.ln())
        };
        let (mut low, mut high) =
            (correction_dim(s.beta_fast.unwrap_or(32.0)), correction_dim(s.beta_slow.unwrap_or(1.0)));
        if s.truncate.unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, high) = (low.max(0.0), high.min(dim - 1.0));
        let span = if low == high { 0.001 } else { high - low };
        base.iter()
            .enumerate()
            .map(|(i, &inv)| {
                let extrapolation = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
                inv / factor * (1.0 - extrapolation) + inv * extrapolation
            })
            .collect()
    }

    /// The factor cos and sin are scaled by: YaRN's attention factor, 1
    /// for every other scaling.
    pub fn rope_attention_factor(&self) -> f64 {
        let Some(s) = self.rope_scaling.as_ref().filter(|s| s.rope_type == "yarn") else { return 1.0 };
        if let Some(a) = s.attention_factor {
            return a;
        }
        let factor = s.yarn_factor(self.max_position_embeddings);
        let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
        match (s.mscale, s.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
            _ => mscale(factor, 1.0),
        }
    }

    /// Inverse RoPE frequencies without any scaling: `theta^(-2i/d)`.
    fn unscaled_rope_inv_freq(&self) -> Vec<f64> {
        let dim = self.head_dim;
        (0..dim / 2).map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / dim as f64)).collect()
    }

    /// The scaling as per-pair frequency factors (`unscaled / scaled`), the
    /// form GGUF's `rope_freqs.weight` stores; None where nothing is scaled.
    pub fn rope_freq_factors(&self) -> Option<Vec<f64>> {
        if self.rope_freq_factors.is_none() && self.rope_scaling.is_none() {
            return None;
        }
        Some(
            self.unscaled_rope_inv_freq()
                .iter()
                .zip(self.rope_inv_freq())
                .map(|(base, scaled)| base / scaled)
                .collect(),
        )
    }

    /// Checks GGUF frequency factors against this model's shape: one finite,
    /// positive factor per rotated pair.
    pub fn with_rope_freq_factors(self, factors: Vec<f64>) -> Result<Self> {
        if factors.len() != self.head_dim / 2 {
            return Err(ModelError::InvalidConfig(format!(
                "rope_freqs.weight has {} factors, expected head_dim / 2 = {}",
                factors.len(),
                self.head_dim / 2
            )));
        }
        if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return Err(ModelError::InvalidConfig(format!("rope_freqs.weight holds {bad}, not a positive factor")));
        }
        Ok(Self { rope_freq_factors: Some(factors), ..self })
    }
}

/// Configs of real models, for `random:<preset>`.
pub fn random_preset(name: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(random_preset_json(name)?)
}

/// The config.json text of a preset (HF field names).
pub fn random_preset_json(name: &str) -> Result<&'static str> {
    Ok(match name {
        // HuggingFaceTB/SmolLM-135M
        "smollm-135m" => {
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
            "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,
            "rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":2048,"tie_word_embeddings":true}"#
        }
        // TinyLlama/TinyLlama-1.1B-Chat-v1.0
        "tinyllama-1.1b" => {
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":5632,
            "num_hidden_layers":22,"num_attention_heads":32,"num_key_value_heads":4,"vocab_size":32000,
            "rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":2048,"tie_word_embeddings":false}"#
        }
        // Qwen/Qwen3-0.6B
        "qwen3-0.6b" => {
            r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":1024,"intermediate_size":3072,
            "num_hidden_layers":28,"num_attention_heads":16,"num_key_value_heads":8,"head_dim":128,"vocab_size":151936,
            "rms_norm_eps":1e-6,"rope_theta":1000000.0,"max_position_embeddings":40960,"tie_word_embeddings":true}"#
        }
        // meta-llama/Llama-3.2-1B
        "llama-3.2-1b" => {
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":8192,
            "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":64,"vocab_size":128256,
            "rms_norm_eps":1e-5,"rope_theta":500000.0,"max_position_embeddings":131072,"tie_word_embeddings":true,
            "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192}}"#
        }
        other => return Err(ModelError::UnknownPreset(other.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss's YaRN (its `rope_scaling`, theta 150000, head dim 32): the
    /// figures ../shared/models/README.md derives for tiny-gpt-oss.
    #[test]
    fn yarn_ramps_the_frequencies_and_scales_cos_and_sin() {
        let cfg = ModelConfig::from_json(
            r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":64,"intermediate_size":64,"num_hidden_layers":1,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":8,"rms_norm_eps":1e-5,
            "rope_theta":150000.0,"max_position_embeddings":131072,"rope_scaling":{"rope_type":"yarn","factor":32.0,
            "beta_fast":32.0,"beta_slow":1.0,"original_max_position_embeddings":4096,"truncate":false}}"#,
        )
        .unwrap();
        let kept: Vec<f64> = cfg.rope_freq_factors().unwrap().iter().map(|f| 1.0 / f).collect();
        let want = [1.0, 1.0, 1.0, 1.0, 1.0, 0.801443, 0.593227, 0.385011, 0.176795];
        for (i, w) in want.iter().chain(&[1.0 / 32.0; 7]).enumerate() {
            assert!((kept[i] - w).abs() < 1e-6, "pair {i}: {} vs {w}", kept[i]);
        }
        assert!((cfg.rope_attention_factor() - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-12);
        // transformers' default rounds the correction range: pairs 4..9 ramp.
        let mut rounded = cfg.clone();
        if let Some(s) = &mut rounded.rope_scaling {
            s.truncate = None;
        }
        let kept: Vec<f64> = rounded.rope_freq_factors().unwrap().iter().map(|f| 1.0 / f).collect();
        assert_eq!(kept[4], 1.0);
        assert!((kept[5] - (0.2 / 32.0 + 0.8)).abs() < 1e-12);
        // Other scalings leave cos and sin alone.
        let plain = ModelConfig { rope_scaling: None, ..cfg };
        assert_eq!(plain.rope_attention_factor(), 1.0);
    }

    fn shared(path: &str) -> String {
        let p = format!("{}/../../shared/models/{path}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    #[test]
    fn reads_every_shared_model() {
        let qwen3 = ModelConfig::from_json(&shared("tiny-qwen3/config.json")).unwrap();
        assert!(qwen3.qk_norm && qwen3.tie_word_embeddings && !qwen3.qkv_bias);
        assert_eq!((qwen3.num_heads, qwen3.num_kv_heads, qwen3.head_dim), (4, 2, 32));
        let qwen2 = ModelConfig::from_json(&shared("tiny-qwen2/config.json")).unwrap();
        assert!(qwen2.qkv_bias && !qwen2.o_bias && !qwen2.tie_word_embeddings);
        let mistral = ModelConfig::from_json(&shared("tiny-mistral/config.json")).unwrap();
        assert_eq!((mistral.num_kv_heads, mistral.sliding_window), (1, None));
        let stories = ModelConfig::from_json(&shared("stories260K/config.json")).unwrap();
        assert_eq!((stories.hidden_size, stories.head_dim, stories.num_layers), (64, 8, 5));
    }

    #[test]
    fn parameter_counts_match_the_checkpoints() {
        // TinyLlama-1.1B's published count.
        assert_eq!(random_preset("tinyllama-1.1b").unwrap().parameter_count(), 1_100_048_384);
        // Each shared model's safetensors file is its f32 tensors plus a small header.
        for model in ["stories260K", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"] {
            let cfg = ModelConfig::from_json(&shared(&format!("{model}/config.json"))).unwrap();
            let dir = format!("{}/../../shared/models/{model}", env!("CARGO_MANIFEST_DIR"));
            let file: u64 = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .map(|p| std::fs::metadata(p).unwrap().len())
                .sum();
            let tensors = 4 * cfg.parameter_count();
            assert!(
                tensors <= file && file - tensors < 64 << 10,
                "{model}: {tensors} bytes of tensors, {file} on disk"
            );
        }
    }

    #[test]
    fn llama3_scaling_matches_the_documented_pairs() {
        // ../shared/models/README.md: pairs 0-7 unchanged, pair 8 scaled by
        // 0.3037, pairs 9-15 by 1/32.
        let cfg = ModelConfig::from_json(&shared("tiny-llama3/config.json")).unwrap();
        let unscaled = ModelConfig { rope_scaling: None, ..cfg.clone() }.rope_inv_freq();
        let scaled = cfg.rope_inv_freq();
        for i in 0..8 {
            assert_eq!(scaled[i], unscaled[i]);
        }
        assert!((scaled[8] / unscaled[8] - 0.3037).abs() < 1e-3, "{}", scaled[8] / unscaled[8]);
        for i in 9..16 {
            assert!((scaled[i] / unscaled[i] - 1.0 / 32.0).abs() < 1e-12);
        }
    }

    #[test]
    fn gguf_frequency_factors_reproduce_llama3_scaling() {
        // llama.cpp's converter stores llama3 scaling as `unscaled / scaled`
        // per pair; dividing by them gives the scaled frequencies back.
        let cfg = ModelConfig::from_json(&shared("tiny-llama3/config.json")).unwrap();
        let factors = cfg.rope_freq_factors().unwrap();
        assert_eq!((factors[0], factors[15]), (1.0, 32.0));
        let from_gguf = ModelConfig { rope_scaling: None, ..cfg.clone() }.with_rope_freq_factors(factors).unwrap();
        for (a, b) in from_gguf.rope_inv_freq().iter().zip(cfg.rope_inv_freq()) {
            assert!((a / b - 1.0).abs() < 1e-12, "{a} vs {b}");
        }
        let plain = ModelConfig { rope_scaling: None, ..cfg };
        assert_eq!(plain.rope_freq_factors(), None);
        assert!(plain.clone().with_rope_freq_factors(vec![1.0; 15]).is_err());
        assert!(plain.clone().with_rope_freq_factors(vec![0.0; 16]).is_err());
        assert!(plain.with_rope_freq_factors(vec![f64::NAN; 16]).is_err());
    }

    #[test]
    fn rejects_unknown_architectures_and_bad_shapes() {
        let bad = r#"{"architectures":["GPT2LMHeadModel"],"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"vocab_size":4}"#;
        assert!(matches!(ModelConfig::from_json(bad), Err(ModelError::UnsupportedArchitecture(_))));
        let bad = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":2,"vocab_size":4}"#;
        assert!(matches!(ModelConfig::from_json(bad), Err(ModelError::InvalidConfig(_))));
    }

    #[test]
    fn presets_have_the_real_shapes() {
        let tl = random_preset("tinyllama-1.1b").unwrap();
        assert_eq!((tl.num_layers, tl.num_kv_heads, tl.head_dim), (22, 4, 64));
        let q3 = random_preset("qwen3-0.6b").unwrap();
        assert!(q3.qk_norm && q3.tie_word_embeddings);
        assert!(matches!(random_preset("gpt-5"), Err(ModelError::UnknownPreset(_))));
    }
}
