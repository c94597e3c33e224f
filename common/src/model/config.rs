//! A model's `config.json`, read into one normalised description of a
//! decoder. Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2/3, the mixtures of
//! experts (Mixtral, Qwen3-MoE, GLM-4.5, gpt-oss) and Gemma 3 differ in the
//! flags and shapes below, so they share one implementation (as vLLM's
//! `qwen2.py` and `mistral` reuse `llama.py`). Their RoPE is in
//! [`super::rope`].

use serde::Deserialize;

use super::rope::RopeScaling;
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
    /// GLM-4.5: GQA with q/k/v biases and partial rotary; after the first
    /// `first_k_dense_replace` dense layers, DeepSeek-V3's routing (sigmoid
    /// scores, a correction bias for the choice, groups) plus shared experts.
    Glm4Moe,
    /// Gemma 3 (text): `(1 + w)` RMSNorms before and after each sublayer,
    /// GeGLU, scaled embeddings, q/k norms, `query_pre_attn_scalar`, and
    /// sliding and global layers with their own RoPE.
    Gemma3,
    /// gpt-oss: attention sinks, sliding and full layers alternating,
    /// biases everywhere, experts with a clamped SwiGLU, the router's
    /// softmax over its top-k.
    GptOss,
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
            "Glm4MoeForCausalLM" => Ok(Self::Glm4Moe),
            "Gemma3ForCausalLM" => Ok(Self::Gemma3),
            "GptOssForCausalLM" => Ok(Self::GptOss),
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
            Self::Glm4Moe => "Glm4MoeForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::GptOss => "GptOssForCausalLM",
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
    tie_word_embeddings: Option<bool>,
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
    /// Gemma's name for `hidden_act`.
    #[serde(default)]
    hidden_activation: Option<String>,
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
    /// GLM-4.5 (DeepSeek-V3's names): routed and shared experts, the
    /// dense layers in front, group-limited routing and its scale.
    #[serde(default)]
    n_routed_experts: Option<usize>,
    #[serde(default)]
    n_shared_experts: Option<usize>,
    #[serde(default)]
    first_k_dense_replace: Option<usize>,
    #[serde(default)]
    n_group: Option<usize>,
    #[serde(default)]
    topk_group: Option<usize>,
    #[serde(default)]
    routed_scaling_factor: Option<f64>,
    /// The share of each head's dims that rotate (GLM: 0.5).
    #[serde(default)]
    partial_rotary_factor: Option<f64>,
    #[serde(default)]
    use_qk_norm: Option<bool>,
    /// `sliding_attention` or `full_attention` per layer (Gemma 3, gpt-oss).
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    /// Gemma 3 without `layer_types`: every `sliding_window_pattern`-th
    /// layer is global.
    #[serde(default)]
    sliding_window_pattern: Option<usize>,
    /// Gemma 3: the sliding layers' RoPE base (unscaled).
    #[serde(default)]
    rope_local_base_freq: Option<f64>,
    #[serde(default)]
    query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
    /// gpt-oss: the experts' SwiGLU clamp.
    #[serde(default)]
    swiglu_limit: Option<f64>,
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
    /// The leading dims of each head that RoPE rotates (`head_dim` unless
    /// `partial_rotary_factor` says less); the rest pass through.
    pub rotary_dim: usize,
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
    /// The window of the layers that slide: a query at position p sees
    /// the keys at positions > p - window.
    pub sliding_window: Option<usize>,
    /// Which layers slide (all of Mistral's when it has a window; Gemma 3's
    /// and gpt-oss's as `layer_types` says), one entry per layer.
    pub layer_types: Vec<LayerAttention>,
    /// The MLP's (and experts') gate activation.
    pub activation: Activation,
    /// Gemma 3: the sliding layers' RoPE base, unscaled (the global layers
    /// use `rope_theta` and `rope_scaling`).
    pub local_rope_theta: Option<f64>,
    /// Attention scores are scaled by `1/sqrt(this)` (head_dim by default).
    pub query_pre_attn_scalar: f64,
    /// Gemma: embeddings times sqrt(hidden), `(1 + w)` RMSNorm weights and
    /// a norm after each sublayer's output, before the residual add.
    pub gemma_norms: bool,
    /// Gemma: the stored norm weights already hold the `1 +` (llama.cpp's
    /// converter adds it): set by the GGUF reader, never by `config.json`.
    pub norm_weights_include_one: bool,
    /// gpt-oss: one learned logit per head joins each softmax and takes
    /// its share of the attention mass.
    pub attention_sinks: bool,
    /// The dtype the checkpoint was saved in (`torch_dtype`), if given.
    pub weights_dtype: Option<String>,
    /// Mixture of experts (all 0 or empty for a dense model).
    pub moe: MoeConfig,
}

/// Whether a layer attends to every earlier position or to a window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerAttention {
    Full,
    Sliding,
}

/// The gated MLP's activation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up`.
    #[default]
    Silu,
    /// GeGLU with GELU's tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// gpt-oss: gate clamped to at most `limit`, up to ±`limit`, then
    /// `(up + 1) * gate * sigmoid(1.702 * gate)`; gate and up interleaved.
    ClampedSwiglu { limit: f32 },
}

/// How a router turns its logits into expert scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RouterScoring {
    /// Softmax over all experts (Mixtral, Qwen3-MoE).
    #[default]
    Softmax,
    /// An independent sigmoid per expert, the choice made on the scores
    /// plus a learned correction bias (DeepSeek-V3, GLM-4.5).
    SigmoidWithCorrection,
}

/// A mixture-of-experts MLP's shape and routing: scores over `num_experts`
/// (optionally limited to the best `topk_group` of `num_groups` groups),
/// the `experts_per_token` largest kept, weighted, plus shared experts.
#[derive(Clone, Debug, PartialEq)]
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
    pub scoring: RouterScoring,
    /// Experts fall in `num_groups` equal groups; a token's experts come
    /// from its best `groups_per_token` (1 and 1: no limit).
    pub num_groups: usize,
    pub groups_per_token: usize,
    /// The kept weights' scale, after any renormalisation.
    pub routed_scaling_factor: f64,
    /// Hidden width of the shared expert every token also runs (0: none).
    pub shared_intermediate_size: usize,
    /// gpt-oss: the router and the experts' projections have biases.
    pub biases: bool,
}

/// No experts (a dense model); a router's scale of 1 and one group, so a
/// config built from it routes plainly.
impl Default for MoeConfig {
    fn default() -> Self {
        Self {
            num_experts: 0,
            experts_per_token: 0,
            expert_intermediate_size: 0,
            norm_topk_prob: false,
            dense_layers: Vec::new(),
            sparse_step: 1,
            scoring: RouterScoring::Softmax,
            num_groups: 1,
            groups_per_token: 1,
            routed_scaling_factor: 1.0,
            shared_intermediate_size: 0,
            biases: false,
        }
    }
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
        let activation = match hf.hidden_activation.as_ref().or(hf.hidden_act.as_ref()).map(String::as_str) {
            _ if architecture == Architecture::GptOss => {
                Activation::ClampedSwiglu { limit: hf.swiglu_limit.unwrap_or(7.0) as f32 }
            }
            None | Some("silu") => Activation::Silu,
            Some("gelu_pytorch_tanh") => Activation::GeluTanh,
            Some(act) => {
                return Err(ModelError::InvalidConfig(format!(
                    "hidden_act {act:?} is not supported (silu, gelu_pytorch_tanh)"
                )));
            }
        };
        if let Some(cap) = hf.attn_logit_softcapping.or(hf.final_logit_softcapping) {
            return Err(ModelError::InvalidConfig(format!("logit soft-capping ({cap}) is not supported")));
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
        let rotary_factor = hf.partial_rotary_factor.unwrap_or(1.0);
        // transformers: `int(head_dim * partial_rotary_factor)`.
        let rotary_dim = (head_dim as f64 * rotary_factor) as usize;
        if !(rotary_factor > 0.0 && rotary_factor <= 1.0) || rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(ModelError::InvalidConfig(format!(
                "RoPE needs an even number of rotated dims, got {rotary_dim} of head_dim {head_dim} \
                 (partial_rotary_factor {rotary_factor})"
            )));
        }
        if let Some(scaling) = &hf.rope_scaling {
            let kind = scaling.rope_type.as_str();
            if !["default", "llama3", "yarn", "linear"].contains(&kind) {
                return Err(ModelError::InvalidConfig(format!("rope_scaling type {kind:?} is not supported")));
            }
        }
        // Qwen2 configs carry a sliding_window that only applies when
        // use_sliding_window is true; Mistral applies it whenever it is set.
        let moe = moe_config(&hf, architecture, arch_name)?;
        let sliding_window = match architecture {
            Architecture::Mistral | Architecture::Mixtral | Architecture::Gemma3 | Architecture::GptOss => {
                hf.sliding_window
            }
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                if hf.use_sliding_window == Some(true) { hf.sliding_window } else { None }
            }
            Architecture::Llama | Architecture::Glm4Moe => None,
        };
        if sliding_window == Some(0) {
            return Err(ModelError::InvalidConfig("a sliding_window of 0 hides every key".into()));
        }
        let layer_types = layer_types(&hf, architecture, sliding_window)?;
        let gemma = architecture == Architecture::Gemma3;
        Ok(Self {
            architecture,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            vocab_size: hf.vocab_size,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            rope_scaling: hf.rope_scaling.filter(|s| s.rope_type != "default"),
            rope_freq_factors: None,
            max_position_embeddings: hf.max_position_embeddings,
            // Gemma ties unless told otherwise.
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(gemma),
            qkv_bias: architecture == Architecture::Qwen2 || hf.attention_bias,
            // (gpt-oss's `attention_bias` covers o_proj too.)
            // GLM's `attention_bias` is on q/k/v only, as Qwen2's.
            o_bias: !matches!(architecture, Architecture::Qwen2 | Architecture::Glm4Moe) && hf.attention_bias,
            mlp_bias: hf.mlp_bias,
            qk_norm: match architecture {
                Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3 => true,
                Architecture::Glm4Moe => hf.use_qk_norm.unwrap_or(false),
                _ => false,
            },
            sliding_window,
            layer_types,
            activation,
            local_rope_theta: if gemma { Some(hf.rope_local_base_freq.unwrap_or(10_000.0)) } else { None },
            query_pre_attn_scalar: hf.query_pre_attn_scalar.unwrap_or(head_dim as f64),
            gemma_norms: gemma,
            norm_weights_include_one: false,
            attention_sinks: architecture == Architecture::GptOss,
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
        let h = self.hidden_size as u64;
        let embed = (self.vocab_size as u64) * h;
        let lm_head = if self.tie_word_embeddings { 0 } else { embed };
        embed + self.layer_parameter_counts().iter().sum::<u64>() + h + lm_head
    }

    /// Each decoder layer's parameters (projections, experts, biases,
    /// norms): what splits a model's layers over pipeline stages by their
    /// bytes (`common::pipeline::split_layers_by_weight`).
    pub fn layer_parameter_counts(&self) -> Vec<u64> {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let (q, kv) = ((self.num_heads * self.head_dim) as u64, (self.num_kv_heads * self.head_dim) as u64);
        let bias = |on: bool, n: u64| if on { n } else { 0 };
        let attention = h * (q + 2 * kv) + bias(self.qkv_bias, q + 2 * kv) + q * h + bias(self.o_bias, h);
        let dense_mlp = 3 * h * i + bias(self.mlp_bias, 2 * i + h);
        let m = &self.moe;
        let correction = if m.scoring == RouterScoring::SigmoidWithCorrection { m.num_experts as u64 } else { 0 };
        let ei = m.expert_intermediate_size as u64;
        let moe_mlp = m.num_experts as u64 * (3 * h * ei + h + bias(m.biases, 1 + 2 * ei + h))
            + correction
            + 3 * h * m.shared_intermediate_size as u64;
        let norms = if self.gemma_norms { 4 * h } else { 2 * h } + bias(self.qk_norm, 2 * self.head_dim as u64);
        let sinks = bias(self.attention_sinks, self.num_heads as u64);
        (0..self.num_layers)
            .map(|l| attention + norms + sinks + if m.is_moe_layer(l) { moe_mlp } else { dense_mlp })
            .collect()
    }

    /// The window of layer `layer` (None: it sees every earlier position).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match self.layer_types.get(layer) {
            Some(LayerAttention::Sliding) => self.sliding_window,
            _ => None,
        }
    }

    /// The window every layer shares, if they all slide: what a step's
    /// attention metadata carries (a layer of another kind overrides it).
    pub fn uniform_window(&self) -> Option<usize> {
        self.layer_types.iter().all(|t| *t == LayerAttention::Sliding).then_some(self.sliding_window).flatten()
    }

    /// Bytes of K and V for one token across all layers, at `dtype_size` bytes per element.
    pub fn kv_bytes_per_token(&self, dtype_size: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size
    }
}

/// Keeps the first `layers` decoder layers of a `config.json`: its layer
/// count, and the per-layer lists that must match it (`layer_types`).
/// A truncated model's tensors are the full one's first layers.
pub fn truncate_layers(config: &mut serde_json::Value, layers: usize) {
    config["num_hidden_layers"] = layers.into();
    if let Some(types) = config.get_mut("layer_types").and_then(serde_json::Value::as_array_mut) {
        types.truncate(layers);
    }
}

/// Each layer's attention kind: `layer_types` where given (Gemma 3 falls
/// back to its `sliding_window_pattern`); otherwise every layer slides
/// when the model has a window.
fn layer_types(hf: &HfConfig, architecture: Architecture, window: Option<usize>) -> Result<Vec<LayerAttention>> {
    let n = hf.num_hidden_layers;
    let types = match (&hf.layer_types, architecture) {
        (Some(names), _) => names
            .iter()
            .map(|name| match name.as_str() {
                "full_attention" => Ok(LayerAttention::Full),
                "sliding_attention" => Ok(LayerAttention::Sliding),
                other => Err(ModelError::InvalidConfig(format!("layer type {other:?} is not supported"))),
            })
            .collect::<Result<Vec<_>>>()?,
        (None, Architecture::Gemma3) => {
            let pattern = hf.sliding_window_pattern.unwrap_or(6).max(1);
            let kind =
                |i: usize| if (i + 1).is_multiple_of(pattern) { LayerAttention::Full } else { LayerAttention::Sliding };
            (0..n).map(kind).collect()
        }
        (None, _) => vec![if window.is_some() { LayerAttention::Sliding } else { LayerAttention::Full }; n],
    };
    if types.len() != n {
        return Err(ModelError::InvalidConfig(format!("{} layer_types for {n} layers", types.len())));
    }
    if window.is_none() && types.contains(&LayerAttention::Sliding) {
        return Err(ModelError::InvalidConfig("sliding layers without a sliding_window".into()));
    }
    Ok(types)
}

/// The mixture of experts `config.json` describes (the default, no experts,
/// for a dense architecture), checked.
fn moe_config(hf: &HfConfig, architecture: Architecture, arch_name: &str) -> Result<MoeConfig> {
    let num_experts = hf.num_local_experts.or(hf.num_experts).or(hf.n_routed_experts).unwrap_or(0);
    let (scoring, dense_layers) = match architecture {
        Architecture::Mixtral | Architecture::Qwen3Moe => (RouterScoring::Softmax, hf.mlp_only_layers.clone()),
        Architecture::Glm4Moe => {
            (RouterScoring::SigmoidWithCorrection, (0..hf.first_k_dense_replace.unwrap_or(0)).collect())
        }
        Architecture::GptOss => (RouterScoring::Softmax, Vec::new()),
        _ => return Ok(MoeConfig::default()),
    };
    let experts_per_token = hf.num_experts_per_tok.unwrap_or(2);
    if num_experts == 0 || experts_per_token == 0 || experts_per_token > num_experts {
        return Err(ModelError::InvalidConfig(format!(
            "{arch_name}: {experts_per_token} experts per token of {num_experts}"
        )));
    }
    let (num_groups, groups_per_token) = (hf.n_group.unwrap_or(1), hf.topk_group.unwrap_or(1));
    let group_size = num_experts / num_groups.max(1);
    // Each group's score is the sum of its two best experts (DeepSeek-V3),
    // and the kept groups must hold enough experts.
    let groups_fit = num_groups > 0
        && num_experts.is_multiple_of(num_groups)
        && (1..=num_groups).contains(&groups_per_token)
        && (num_groups == 1 || group_size >= 2)
        && groups_per_token * group_size >= experts_per_token;
    if !groups_fit {
        return Err(ModelError::InvalidConfig(format!(
            "{arch_name}: {num_experts} experts in {num_groups} groups, {groups_per_token} groups per token, \
             {experts_per_token} experts per token"
        )));
    }
    let expert_intermediate_size = hf.moe_intermediate_size.unwrap_or(hf.intermediate_size);
    Ok(MoeConfig {
        num_experts,
        experts_per_token,
        expert_intermediate_size,
        // Mixtral always renormalises, and gpt-oss's softmax over its top-k
        // is the same; the others as configured.
        norm_topk_prob: matches!(architecture, Architecture::Mixtral | Architecture::GptOss)
            || hf.norm_topk_prob.unwrap_or(false),
        dense_layers,
        sparse_step: hf.decoder_sparse_step.unwrap_or(1).max(1),
        scoring,
        num_groups,
        groups_per_token,
        routed_scaling_factor: hf.routed_scaling_factor.unwrap_or(1.0),
        shared_intermediate_size: hf.n_shared_experts.unwrap_or(0) * expert_intermediate_size,
        biases: architecture == Architecture::GptOss,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::random_preset;

    /// gpt-oss's YaRN (its `rope_scaling`, theta 150000, head dim 32): the
    /// figures tests/models/README.md derives for tiny-gpt-oss.
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
        let p = format!("{}/../tests/models/{path}", env!("CARGO_MANIFEST_DIR"));
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
        let glm = ModelConfig::from_json(&shared("tiny-glm4-moe/config.json")).unwrap();
        assert_eq!((glm.head_dim, glm.rotary_dim, glm.rope_inv_freq().len()), (32, 16, 8));
        assert!(glm.qkv_bias && !glm.o_bias && !glm.qk_norm);
        let m = &glm.moe;
        assert_eq!((m.num_experts, m.experts_per_token, m.shared_intermediate_size), (8, 2, 64));
        assert_eq!((m.scoring, m.routed_scaling_factor), (RouterScoring::SigmoidWithCorrection, 2.5));
        assert!(!m.is_moe_layer(0) && m.is_moe_layer(1) && m.is_moe_layer(2));
        let stories = ModelConfig::from_json(&shared("stories260K/config.json")).unwrap();
        assert_eq!((stories.hidden_size, stories.head_dim, stories.num_layers), (64, 8, 5));
    }

    #[test]
    fn parameter_counts_match_the_checkpoints() {
        // TinyLlama-1.1B's published count.
        assert_eq!(random_preset("tinyllama-1.1b").unwrap().parameter_count(), 1_100_048_384);
        // Each shared model's safetensors file is its f32 tensors plus a small header.
        let models = ["stories260K", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-yarn"];
        for model in models.into_iter().chain(["tiny-mixtral", "tiny-qwen3-moe", "tiny-glm4-moe"]) {
            let cfg = ModelConfig::from_json(&shared(&format!("{model}/config.json"))).unwrap();
            let dir = format!("{}/../tests/models/{model}", env!("CARGO_MANIFEST_DIR"));
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
        // tests/models/README.md: pairs 0-7 unchanged, pair 8 scaled by
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
        let glm = |extra: &str| {
            let text = format!(
                r#"{{"architectures":["Glm4MoeForCausalLM"],"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
                "num_attention_heads":2,"vocab_size":4,"n_routed_experts":8,"num_experts_per_tok":2{extra}}}"#
            );
            ModelConfig::from_json(&text)
        };
        assert!(glm("").is_ok() && glm(r#","n_group":4,"topk_group":2"#).is_ok());
        for bad in [r#","n_group":3"#, r#","n_group":4,"topk_group":5"#, r#","n_group":8,"topk_group":1"#] {
            assert!(matches!(glm(bad), Err(ModelError::InvalidConfig(_))), "{bad}");
        }
        assert!(matches!(glm(r#","partial_rotary_factor":0.3"#), Err(ModelError::InvalidConfig(_))), "odd rotary dims");
    }

    #[test]
    fn presets_have_the_real_shapes() {
        let tl = random_preset("tinyllama-1.1b").unwrap();
        assert_eq!((tl.num_layers, tl.num_kv_heads, tl.head_dim), (22, 4, 64));
        let q3 = random_preset("qwen3-0.6b").unwrap();
        assert!(q3.qk_norm && q3.tie_word_embeddings);
        assert!(matches!(random_preset("gpt-5"), Err(ModelError::UnknownPreset(_))));
        for name in crate::model::presets::PRESETS {
            let cfg = random_preset(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(cfg.layer_types.len(), cfg.num_layers, "{name}");
        }
        let moe = random_preset("qwen3-30b-a3b").unwrap();
        assert_eq!((moe.moe.num_experts, moe.moe.experts_per_token, moe.moe.expert_intermediate_size), (128, 8, 768));
        // About 30.5B parameters, as its name says.
        assert!((30_000_000_000..31_000_000_000).contains(&moe.parameter_count()), "{}", moe.parameter_count());
        let gemma = random_preset("gemma3-4b").unwrap();
        assert_eq!(gemma.layer_window(5), None, "every 6th layer is global");
        assert_eq!(gemma.layer_window(4), Some(1024));
    }
}
