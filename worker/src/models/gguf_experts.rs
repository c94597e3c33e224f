//! Mixtures of experts in GGUF files, as llama.cpp stores them: each
//! layer's router as `blk.N.ffn_gate_inp.weight` `[experts, hidden]`, and
//! its experts' gate, up and down projections stacked into one tensor each,
//! `blk.N.ffn_{gate,up,down}_exps.weight` `[experts, out, in]` (the experts
//! slowest, so each expert's rows, quantized blocks included, are one
//! contiguous slice). Qwen3-MoE is llama.cpp's `qwen3moe`; Mixtral is
//! `llama` with `llama.expert_count`.

use std::collections::HashMap;

use candle_core::Tensor;
use common::model::{Architecture, ModelConfig};

/// The stacked projections in GGUF's order and their place in an HF expert.
const STACKED: [&str; 3] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];

/// A GGUF tensor of a mixture of experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ExpertTensor {
    /// `blk.N.ffn_gate_inp.weight`.
    Router { layer: usize },
    /// `blk.N.{ffn_gate_exps,ffn_up_exps,ffn_down_exps}.weight`: projection
    /// `which` (0 gate, 1 up, 2 down) of every expert.
    Stacked { layer: usize, which: usize },
}

impl ExpertTensor {
    /// Parses a GGUF tensor name; None for every other tensor.
    pub(super) fn parse(gguf: &str) -> Option<Self> {
        let rest = gguf.strip_prefix("blk.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer = layer.parse().ok()?;
        let module = rest.strip_suffix(".weight")?;
        if module == "ffn_gate_inp" {
            return Some(Self::Router { layer });
        }
        STACKED.iter().position(|&s| s == module).map(|which| Self::Stacked { layer, which })
    }

    /// The decoder layer it belongs to.
    pub(super) fn layer(self) -> usize {
        match self {
            Self::Router { layer } | Self::Stacked { layer, .. } => layer,
        }
    }

    pub(super) fn gguf_name(self) -> String {
        match self {
            Self::Router { layer } => format!("blk.{layer}.ffn_gate_inp.weight"),
            Self::Stacked { layer, which } => format!("blk.{layer}.{}.weight", STACKED[which]),
        }
    }
}

/// The HF module holding a layer's experts, and an expert's (gate, up,
/// down) names in it (Mixtral's w1, w3, w2).
fn hf_layout(cfg: &ModelConfig) -> (&'static str, [&'static str; 3]) {
    match cfg.architecture {
        Architecture::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    }
}

/// The HF name of the router of `layer`.
pub(super) fn hf_router(cfg: &ModelConfig, layer: usize) -> String {
    format!("model.layers.{layer}.{}.gate.weight", hf_layout(cfg).0)
}

/// The HF name of projection `which` of expert `expert` of `layer`.
pub(super) fn hf_expert(cfg: &ModelConfig, layer: usize, expert: usize, which: usize) -> String {
    let (module, names) = hf_layout(cfg);
    format!("model.layers.{layer}.{module}.experts.{expert}.{}.weight", names[which])
}

/// The families whose experts GGUF carries (llama.cpp's `qwen3moe`, and
/// `llama` with experts for Mixtral), with every layer sparse.
pub(super) fn check_exportable(cfg: &ModelConfig) -> Result<(), String> {
    let m = &cfg.moe;
    match cfg.architecture {
        Architecture::Mixtral => {}
        // llama.cpp's qwen3moe renormalises the kept weights, always.
        Architecture::Qwen3Moe if m.norm_topk_prob => {}
        _ => return Err(format!("{:?}'s experts are not exported to GGUF yet", cfg.architecture)),
    }
    if (0..cfg.num_layers).any(|l| !m.is_moe_layer(l)) {
        return Err("dense layers among the mixture-of-experts ones are not exported to GGUF".into());
    }
    Ok(())
}

/// Moves the experts of `tensors` (HF names) into llama.cpp's stacked
/// tensors: one `[experts, out, in]` tensor per layer and projection, and
/// the routers renamed. What is left in `tensors` is the dense part.
pub(super) fn stack(
    cfg: &ModelConfig,
    tensors: &mut HashMap<String, Tensor>,
) -> candle_core::Result<Vec<(ExpertTensor, Tensor)>> {
    let mut out = Vec::new();
    for layer in 0..cfg.num_layers {
        let router = tensors.remove(&hf_router(cfg, layer));
        let router = router.ok_or_else(|| candle_core::Error::Msg(format!("layer {layer}: no router")))?;
        out.push((ExpertTensor::Router { layer }, router));
        for which in 0..3 {
            let experts = (0..cfg.moe.num_experts)
                .map(|e| {
                    let name = hf_expert(cfg, layer, e, which);
                    tensors.remove(&name).ok_or_else(|| candle_core::Error::Msg(format!("{name} is missing")))
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            out.push((ExpertTensor::Stacked { layer, which }, Tensor::stack(&experts, 0)?));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for t in [ExpertTensor::Router { layer: 3 }, ExpertTensor::Stacked { layer: 12, which: 2 }] {
            assert_eq!(ExpertTensor::parse(&t.gguf_name()), Some(t));
        }
        assert_eq!(ExpertTensor::parse("blk.0.ffn_gate.weight"), None);
        assert_eq!(ExpertTensor::parse("blk.x.ffn_up_exps.weight"), None);
    }
}
