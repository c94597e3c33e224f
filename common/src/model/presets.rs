//! Configs of real models' shapes, for `random:<preset>`: benchmarks
//! without weight files (the worker makes seeded random weights for them).

use super::config::ModelConfig;
use super::{ModelError, Result};

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
