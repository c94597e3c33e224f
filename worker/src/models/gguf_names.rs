//! Tensor names between llama.cpp's GGUF convention (`blk.N.attn_q`) and
//! Hugging Face's (`model.layers.N.self_attn.q_proj`), per family where
//! they differ (Gemma 3's four norms, GLM-4.5's and gpt-oss's pre-MLP norm,
//! gpt-oss's sinks). Experts: [`super::gguf_experts`].

use common::model::Architecture;

/// (GGUF, HF) names of the tensors outside the decoder blocks.
const FIXED_NAMES: [[&str; 2]; 3] = [
    ["token_embd.weight", "model.embed_tokens.weight"],
    ["output_norm.weight", "model.norm.weight"],
    ["output.weight", "lm_head.weight"],
];

/// (GGUF, HF) prefixes of a decoder block's tensors, before the layer number.
const BLOCK_PREFIXES: [&str; 2] = ["blk.", "model.layers."];

/// (GGUF, HF) module names inside a decoder block. Where two GGUF names
/// map to one HF name, the first is what `write` uses.
const BLOCK_NAMES: [[&str; 2]; 15] = [
    ["attn_norm", "input_layernorm"],
    ["attn_q", "self_attn.q_proj"],
    ["attn_k", "self_attn.k_proj"],
    ["attn_v", "self_attn.v_proj"],
    ["attn_output", "self_attn.o_proj"],
    ["attn_q_norm", "self_attn.q_norm"],
    ["attn_k_norm", "self_attn.k_norm"],
    ["ffn_norm", "post_attention_layernorm"],
    // GLM-4.5's and gpt-oss's name for the norm before the MLP.
    ["post_attention_norm", "post_attention_layernorm"],
    ["ffn_gate", "mlp.gate_proj"],
    ["ffn_up", "mlp.up_proj"],
    ["ffn_down", "mlp.down_proj"],
    ["ffn_gate_shexp", "mlp.shared_experts.gate_proj"],
    ["ffn_up_shexp", "mlp.shared_experts.up_proj"],
    ["ffn_down_shexp", "mlp.shared_experts.down_proj"],
];

/// Gemma 3's norms around each sublayer, which take these names first.
const GEMMA_NORM_NAMES: [[&str; 2]; 3] = [
    ["post_attention_norm", "post_attention_layernorm"],
    ["ffn_norm", "pre_feedforward_layernorm"],
    ["post_ffw_norm", "post_feedforward_layernorm"],
];

/// gpt-oss's per-head attention sinks: a parameter of its own in HF.
const SINKS: [&str; 2] = ["attn_sinks.weight", "self_attn.sinks"];

/// A tensor's name in the other convention: column `from` of the tables
/// above (0 GGUF, 1 HF) to the other one. None for tensors we do not use.
fn rename(name: &str, from: usize, arch: Architecture) -> Option<String> {
    let to = 1 - from;
    if let Some(fixed) = FIXED_NAMES.iter().find(|n| n[from] == name) {
        return Some(fixed[to].to_string());
    }
    let rest = name.strip_prefix(BLOCK_PREFIXES[from])?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if rest == SINKS[from] {
        return Some(format!("{}{layer}.{}", BLOCK_PREFIXES[to], SINKS[to]));
    }
    let (module, param) = rest.rsplit_once('.')?;
    let gemma: &[[&str; 2]] = if arch == Architecture::Gemma3 { &GEMMA_NORM_NAMES } else { &[] };
    let module = gemma.iter().chain(&BLOCK_NAMES).find(|n| n[from] == module)?[to];
    Some(format!("{}{layer}.{module}.{param}", BLOCK_PREFIXES[to]))
}

/// HF tensor name for a GGUF one.
pub(super) fn hf_name(gguf: &str, arch: Architecture) -> Option<String> {
    rename(gguf, 0, arch)
}

/// GGUF tensor name for an HF one.
pub(super) fn gguf_name(hf: &str, arch: Architecture) -> Option<String> {
    rename(hf, 1, arch)
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
            let g = gguf_name(hf, Architecture::Llama).unwrap();
            assert_eq!(hf_name(&g, Architecture::Llama).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(
            gguf_name("model.layers.2.self_attn.o_proj.weight", Architecture::Qwen3).unwrap(),
            "blk.2.attn_output.weight"
        );
        assert_eq!(hf_name("rope_freqs.weight", Architecture::Llama), None);
    }

    /// The names llama.cpp's converter gives Gemma 3's four norms, GLM's
    /// and gpt-oss's pre-MLP norm, shared experts and gpt-oss's sinks.
    #[test]
    fn each_family_s_own_names_map_to_hf() {
        let cases = [
            (
                Architecture::Gemma3,
                "blk.1.post_attention_norm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ),
            (Architecture::Gemma3, "blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
            (Architecture::Gemma3, "blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
            (Architecture::Gemma3, "blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
            (
                Architecture::Glm4Moe,
                "blk.2.post_attention_norm.weight",
                "model.layers.2.post_attention_layernorm.weight",
            ),
            (Architecture::Glm4Moe, "blk.2.ffn_up_shexp.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"),
            (Architecture::GptOss, "blk.3.attn_sinks.weight", "model.layers.3.self_attn.sinks"),
            (Architecture::GptOss, "blk.3.attn_output.bias", "model.layers.3.self_attn.o_proj.bias"),
        ];
        for (arch, gguf, hf) in cases {
            assert_eq!(hf_name(gguf, arch).as_deref(), Some(hf), "{arch:?} {gguf}");
        }
        // Llama's pre-MLP norm is `ffn_norm` both ways.
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight", Architecture::Llama).unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight", Architecture::Qwen3).unwrap(),
            "blk.0.ffn_norm.weight"
        );
        assert_eq!(hf_name("blk.0.nextn.eh_proj.weight", Architecture::Glm4Moe), None);
    }
}
