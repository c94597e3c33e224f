//! Configs of real models' shapes, for `random:<preset>`: benchmarks
//! without weight files (the worker makes seeded random weights for them).

use super::config::ModelConfig;
use super::{ModelError, Result};

/// Every preset's name.
pub const PRESETS: [&str; 8] = [
    "smollm-135m",
    "tinyllama-1.1b",
    "qwen3-0.6b",
    "llama-3.2-1b",
    "qwen3-30b-a3b",
    "gpt-oss-20b",
    "gemma3-4b",
    "mixtral-8x7b",
];

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
        // Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, every layer sparse.
        "qwen3-30b-a3b" => {
            r#"{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":2048,"intermediate_size":6144,
            "moe_intermediate_size":768,"num_hidden_layers":48,"num_attention_heads":32,"num_key_value_heads":4,
            "head_dim":128,"num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,"decoder_sparse_step":1,
            "mlp_only_layers":[],"vocab_size":151936,"rms_norm_eps":1e-6,"rope_theta":1000000.0,
            "max_position_embeddings":40960,"tie_word_embeddings":false}"#
        }
        // openai/gpt-oss-20b, dequantized: 32 experts, 4 per token.
        "gpt-oss-20b" => {
            r#"{"architectures":["GptOssForCausalLM"],"hidden_size":2880,"intermediate_size":2880,
            "num_hidden_layers":24,"num_attention_heads":64,"num_key_value_heads":8,"head_dim":64,
            "num_local_experts":32,"num_experts_per_tok":4,"vocab_size":201088,"rms_norm_eps":1e-5,
            "rope_theta":150000.0,"rope_scaling":{"rope_type":"yarn","factor":32.0,"beta_fast":32.0,"beta_slow":1.0,
            "truncate":false,"original_max_position_embeddings":4096},"max_position_embeddings":131072,
            "sliding_window":128,"swiglu_limit":7.0,"attention_bias":true,"tie_word_embeddings":false,
            "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention","sliding_attention","full_attention"]}"#
        }
        // google/gemma-3-4b-it's text config: 5 local layers to 1 global.
        "gemma3-4b" => {
            r#"{"architectures":["Gemma3ForCausalLM"],"hidden_size":2560,"intermediate_size":10240,
            "num_hidden_layers":34,"num_attention_heads":8,"num_key_value_heads":4,"head_dim":256,
            "vocab_size":262208,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
            "rope_scaling":{"rope_type":"linear","factor":8.0},"query_pre_attn_scalar":256,"sliding_window":1024,
            "sliding_window_pattern":6,"hidden_activation":"gelu_pytorch_tanh","max_position_embeddings":131072,
            "tie_word_embeddings":true}"#
        }
        // mistralai/Mixtral-8x7B-v0.1
        "mixtral-8x7b" => {
            r#"{"architectures":["MixtralForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
            "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"num_local_experts":8,
            "num_experts_per_tok":2,"vocab_size":32000,"rms_norm_eps":1e-5,"rope_theta":1000000.0,
            "max_position_embeddings":32768,"tie_word_embeddings":false}"#
        }
        other => return Err(ModelError::UnknownPreset(other.to_string())),
    })
}
