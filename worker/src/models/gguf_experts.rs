//! Mixtures of experts in GGUF files, as llama.cpp stores them: each
//! layer's router as `blk.N.ffn_gate_inp.weight` `[experts, hidden]`, and
//! its experts' gate, up and down projections stacked into one tensor each,
//! `blk.N.ffn_{gate,up,down}_exps.weight` `[experts, out, in]` (the experts
//! slowest, so each expert's rows, quantized blocks included, are one
//! contiguous slice). Qwen3-MoE is llama.cpp's `qwen3moe`; Mixtral is
//! `llama` with `llama.expert_count`; GLM-4.5 (`glm4moe`) adds the router's
//! score correction (`exp_probs_b`) and shared experts (`ffn_*_shexp`, plain
//! layers); gpt-oss (`gpt-oss`) biases on the router and every expert.

use std::collections::HashMap;

use candle_core::Tensor;
use common::model::{Architecture, ModelConfig};

use super::moe::ExpertNames;

/// The stacked projections in GGUF's order and their place in an HF expert.
const STACKED: [&str; 3] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];

/// Whether a GGUF tensor is a weight or a bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Param {
    Weight,
    Bias,
}

impl Param {
    fn name(self) -> &'static str {
        match self {
            Self::Weight => "weight",
            Self::Bias => "bias",
        }
    }
}

/// A GGUF tensor of a mixture of experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ExpertTensor {
    /// `blk.N.ffn_gate_inp.{weight,bias}` (gpt-oss's router has a bias).
    Router { layer: usize, param: Param },
    /// `blk.N.exp_probs_b.bias`: GLM-4.5's correction of the router's
    /// scores, for the choice only (`e_score_correction_bias`).
    CorrectionBias { layer: usize },
    /// `blk.N.{ffn_gate_exps,ffn_up_exps,ffn_down_exps}.{weight,bias}`:
    /// projection `which` (0 gate, 1 up, 2 down) of every expert; weights
    /// `[experts, out, in]`, biases `[experts, out]`.
    Stacked { layer: usize, which: usize, param: Param },
}

impl ExpertTensor {
    /// Parses a GGUF tensor name; None for every other tensor.
    pub(super) fn parse(gguf: &str) -> Option<Self> {
        let rest = gguf.strip_prefix("blk.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer = layer.parse().ok()?;
        if rest == "exp_probs_b.bias" {
            return Some(Self::CorrectionBias { layer });
        }
        let (module, param) = rest.rsplit_once('.')?;
        let param = match param {
            "weight" => Param::Weight,
            "bias" => Param::Bias,
            _ => return None,
        };
        if module == "ffn_gate_inp" {
            return Some(Self::Router { layer, param });
        }
        STACKED.iter().position(|&s| s == module).map(|which| Self::Stacked { layer, which, param })
    }

    pub(super) fn gguf_name(self) -> String {
        match self {
            Self::Router { layer, param } => format!("blk.{layer}.ffn_gate_inp.{}", param.name()),
            Self::CorrectionBias { layer } => format!("blk.{layer}.exp_probs_b.bias"),
            Self::Stacked { layer, which, param } => format!("blk.{layer}.{}.{}", STACKED[which], param.name()),
        }
    }

    /// Its HF name: for stacked experts, that of expert 0's part (see [`hf_expert`]).
    pub(super) fn hf_name(self, cfg: &ModelConfig) -> String {
        match self {
            Self::Router { layer, param } => hf_router(cfg, layer, param),
            Self::CorrectionBias { layer } => {
                let module = ExpertNames::of(cfg.architecture).module;
                format!("model.layers.{layer}.{module}.gate.e_score_correction_bias")
            }
            Self::Stacked { layer, which, param } => hf_expert(cfg, layer, 0, which, param),
        }
    }
}

/// The HF name of the router of `layer` (gpt-oss calls it `router`).
pub(super) fn hf_router(cfg: &ModelConfig, layer: usize, param: Param) -> String {
    let names = ExpertNames::of(cfg.architecture);
    format!("model.layers.{layer}.{}.{}.{}", names.module, names.router, param.name())
}

/// The HF name of projection `which` of expert `expert` of `layer` (one
/// expert's own tensors, as Mixtral and Qwen3-MoE store them; gpt-oss's
/// experts from GGUF take these names too).
pub(super) fn hf_expert(cfg: &ModelConfig, layer: usize, expert: usize, which: usize, param: Param) -> String {
    let ExpertNames { module, projections: names, .. } = ExpertNames::of(cfg.architecture);
    format!("model.layers.{layer}.{module}.experts.{expert}.{}.{}", names[which], param.name())
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
        let router = tensors.remove(&hf_router(cfg, layer, Param::Weight));
        let router = router.ok_or_else(|| candle_core::Error::Msg(format!("layer {layer}: no router")))?;
        out.push((ExpertTensor::Router { layer, param: Param::Weight }, router));
        for which in 0..3 {
            let experts = (0..cfg.moe.num_experts)
                .map(|e| {
                    let name = hf_expert(cfg, layer, e, which, Param::Weight);
                    tensors.remove(&name).ok_or_else(|| candle_core::Error::Msg(format!("{name} is missing")))
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            out.push((ExpertTensor::Stacked { layer, which, param: Param::Weight }, Tensor::stack(&experts, 0)?));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for t in [
            ExpertTensor::Router { layer: 3, param: Param::Weight },
            ExpertTensor::Router { layer: 3, param: Param::Bias },
            ExpertTensor::CorrectionBias { layer: 1 },
            ExpertTensor::Stacked { layer: 12, which: 2, param: Param::Weight },
            ExpertTensor::Stacked { layer: 0, which: 1, param: Param::Bias },
        ] {
            assert_eq!(ExpertTensor::parse(&t.gguf_name()), Some(t));
        }
        assert_eq!(ExpertTensor::parse("blk.1.ffn_gate_shexp.weight"), None);
        assert_eq!(ExpertTensor::parse("blk.0.ffn_gate.weight"), None);
        assert_eq!(ExpertTensor::parse("blk.x.ffn_up_exps.weight"), None);
    }
}
