//! A mixture-of-experts MLP (Mixtral, Qwen3-MoE, GLM-4.5), as transformers
//! computes it: a router scores the experts (a softmax, or DeepSeek-V3's
//! sigmoid with a correction bias for the choice and group limits), the
//! `experts_per_token` best are kept (their weights renormalised and scaled
//! where the model says), each token's kept experts run on it and their
//! outputs are added, weighted, in expert order; a shared expert, where
//! there is one, runs on every token and is added unweighted.
//!
//! Each expert runs over the rows routed to it (gathered, computed, scaled
//! and scattered back), so a step reads only the experts its tokens chose.
//! On the CPU that is the grouped kernels of `kernels::cpu::moe`: one
//! parallel call per projection over every active expert, in the experts'
//! own weight formats; elsewhere, candle ops per expert.

use std::cell::RefCell;

use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;
use common::model::{Architecture, MoeConfig, RouterScoring};
use kernels::cpu::moe::{ExpertGroups, ExpertLinear, combine, gather_rows, grouped_matmul};
use kernels::cpu::quant::{BlockMxfp4, QK_MXFP4, dequantize_row};

use super::config::ModelConfig;
use super::layers::Mlp;
use super::linear::{Linear, Prequantized, Weight, linear};
use super::workspace::Buffers;
use crate::error::{Result, WorkerError};

/// A decoder layer's MLP: dense, or a mixture of experts.
pub enum FeedForward {
    Dense(Mlp),
    Experts(SparseMoe),
}

/// Where a family's Hugging Face checkpoints keep a layer's experts: the
/// module under the layer (Mixtral's `block_sparse_moe`), an expert's
/// gate, up and down projections (Mixtral's w1, w3, w2) and the router
/// (gpt-oss's `router`, with a bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertNames {
    pub module: &'static str,
    pub projections: [&'static str; 3],
    pub router: &'static str,
}

impl ExpertNames {
    pub fn of(architecture: Architecture) -> Self {
        match architecture {
            Architecture::Mixtral => {
                Self { module: "block_sparse_moe", projections: ["w1", "w3", "w2"], router: "gate" }
            }
            Architecture::GptOss => Self { module: "mlp", projections: MLP_PROJECTIONS, router: "router" },
            _ => Self { module: "mlp", projections: MLP_PROJECTIONS, router: "gate" },
        }
    }
}

/// A dense MLP's projections in the HF checkpoints: gate, up, down.
pub const MLP_PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

impl FeedForward {
    /// Layer `layer`'s MLP under `vb` (the layer's prefix).
    pub fn new(cfg: &ModelConfig, layer: usize, vb: &VarBuilder, pre: &Prequantized) -> Result<Self> {
        Ok(match cfg.moe.is_moe_layer(layer) {
            true => Self::Experts(SparseMoe::new(cfg, vb.pp(ExpertNames::of(cfg.architecture).module), pre)?),
            false => Self::Dense(Mlp::new(cfg, vb.pp("mlp"), pre)?),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(mlp) => mlp.forward(x),
            Self::Experts(moe) => moe.forward(x),
        }
    }

    pub fn forward_cpu(&self, b: &Buffers) -> Result<()> {
        match self {
            Self::Dense(mlp) => mlp.forward_cpu(b),
            Self::Experts(moe) => moe.forward_cpu(b),
        }
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Self::Dense(mlp) => mlp.linears_mut(),
            Self::Experts(moe) => moe.linears_mut(),
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        match self {
            Self::Dense(mlp) => mlp.size_in_bytes(),
            Self::Experts(moe) => moe.size_in_bytes(),
        }
    }

    /// Bytes of weight it holds: every expert's, where a token reads a few.
    pub fn resident_bytes(&self) -> usize {
        match self {
            Self::Dense(mlp) => mlp.size_in_bytes(),
            Self::Experts(moe) => moe.resident_bytes(),
        }
    }
}

pub struct SparseMoe {
    /// `[experts, hidden]`, kept in f32: a quantized router could flip a
    /// choice of expert (`--quantize` leaves it alone).
    router: Linear,
    /// Added to the sigmoid scores for the choice only (GLM-4.5).
    correction_bias: Option<Vec<f32>>,
    experts: Vec<Mlp>,
    shared_expert: Option<Box<Mlp>>,
    routing: MoeConfig,
}

/// Each row's kept experts and their weights, row-major
/// (`experts_per_token` a row), best first.
struct Routes {
    experts: Vec<u32>,
    weights: Vec<f32>,
}

/// The grouped kernels' buffers, kept between calls (and layers): a
/// prefill chunk's are tens of MiB, too much to fault in afresh per layer.
#[derive(Default)]
struct Scratch {
    logits: Vec<f32>,
    gathered: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    down: Vec<f32>,
    out: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// `v` resized to `len` (its contents are overwritten by the caller).
fn sized(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    v.resize(len, 0.0);
    &mut v[..len]
}

impl SparseMoe {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        let m = &cfg.moe;
        let (h, i) = (cfg.hidden_size, m.expert_intermediate_size);
        let expert_names = ExpertNames::of(cfg.architecture);
        let names = expert_names.projections;
        // gpt-oss's HF checkpoints stack its experts; from GGUF each has
        // its own weights (perhaps in blocks) and biases, as the others.
        let experts = match cfg.architecture {
            Architecture::GptOss if vb.contains_tensor("experts.gate_up_proj") => fused_experts(cfg, vb.pp("experts"))?,
            Architecture::GptOss if vb.contains_tensor("experts.gate_up_proj_blocks") => {
                mxfp4_experts(cfg, vb.pp("experts"))?
            }
            _ => (0..m.num_experts)
                .map(|e| Mlp::with_names(cfg, (h, i, m.biases), vb.pp("experts").pp(e), pre, names))
                .collect::<Result<Vec<_>>>()?,
        };
        let correction_bias = match m.scoring {
            RouterScoring::SigmoidWithCorrection => Some(
                vb.pp("gate").get(m.num_experts, "e_score_correction_bias")?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            ),
            RouterScoring::Softmax => None,
        };
        let shared_expert = match m.shared_intermediate_size {
            0 => None,
            width => Some(Box::new(Mlp::with_names(cfg, (h, width, false), vb.pp("shared_experts"), pre, names)?)),
        };
        let router = linear(h, m.num_experts, m.biases, vb.pp(expert_names.router), pre)?;
        Ok(Self { router, correction_bias, experts, shared_expert, routing: m.clone() })
    }

    /// The experts' linear layers (the router's excluded: see `router`).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let shared = self.shared_expert.as_deref_mut();
        self.experts.iter_mut().chain(shared).flat_map(Mlp::linears_mut).collect()
    }

    /// Bytes of weight a token reads: the router, its kept experts and the
    /// shared one.
    pub fn size_in_bytes(&self) -> usize {
        let expert = self.experts.first().map_or(0, Mlp::size_in_bytes);
        let shared = self.shared_expert.as_deref().map_or(0, Mlp::size_in_bytes);
        self.router.size_in_bytes() + self.routing.experts_per_token * expert + shared
    }

    /// Bytes of weight it holds: the router, every expert, the shared one.
    pub fn resident_bytes(&self) -> usize {
        let shared = self.shared_expert.as_deref().map_or(0, Mlp::size_in_bytes);
        self.router.size_in_bytes() + self.experts.iter().map(Mlp::size_in_bytes).sum::<usize>() + shared
    }

    /// `x: [T, hidden]` -> `[T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let logits = self.router.forward(x)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let groups = self.groups(&route(&self.routing, self.correction_bias.as_deref(), &logits))?;
        let mut out = x.zeros_like()?;
        for (expert, rows) in groups.active() {
            let idx = Tensor::from_slice(&groups.tokens()[rows.clone()], rows.len(), x.device())?;
            let y = self.experts[expert].forward(&x.index_select(&idx, 0)?)?;
            let w = Tensor::from_slice(&groups.weights()[rows.clone()], (rows.len(), 1), x.device())?
                .to_dtype(y.dtype())?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        match &self.shared_expert {
            Some(shared) => Ok((out + shared.forward(x)?)?),
            None => Ok(out),
        }
    }

    fn groups(&self, routes: &Routes) -> Result<ExpertGroups> {
        let per = self.routing.experts_per_token;
        Ok(ExpertGroups::new(self.experts.len(), per, &routes.experts, &routes.weights)?)
    }

    /// The CPU step in the workspace: `b.normed` -> `b.proj`, through the
    /// grouped kernels: route, gather each token's row once per chosen
    /// expert, gate/up of every active expert in one call, the gate, down
    /// in one call, the weighted sum back per token (then the shared
    /// expert's output added).
    pub fn forward_cpu(&self, b: &Buffers) -> Result<()> {
        let Some(parts) = self.experts.iter().map(Mlp::fused_parts).collect::<Option<Vec<_>>>() else {
            return self.forward_cpu_composed(b);
        };
        let gate = parts.first().map_or(kernels::cpu::Gate::Silu, |p| p.2);
        let (gate_up, down): (Vec<_>, Vec<_>) = parts.iter().map(|&(gu, d, _)| (gu, d)).unzip();
        let (t, h) = b.normed.dims2()?;
        let inter = self.routing.expert_intermediate_size;
        let experts = self.experts.len();
        SCRATCH.with_borrow_mut(|s| -> Result<()> {
            {
                let _t = crate::profile::scope(crate::profile::Section::Matmul);
                kernels::cpu::read_f32(&b.normed, |x| {
                    self.router.matmul(x, t, sized(&mut s.logits, t * experts)).map_err(candle_core::Error::wrap)
                })?;
            }
            let groups = self.groups(&route(&self.routing, self.correction_bias.as_deref(), &s.logits))?;
            let pairs = groups.num_pairs();
            kernels::cpu::read_f32(&b.normed, |x| {
                gather_rows(x, h, &groups, sized(&mut s.gathered, pairs * h)).map_err(candle_core::Error::wrap)
            })?;
            {
                let _t = crate::profile::scope(crate::profile::Section::Matmul);
                grouped_matmul(&gate_up, &groups, &s.gathered, sized(&mut s.gate_up, pairs * 2 * inter))?;
            }
            kernels::cpu::gated_mul(&s.gate_up, inter, gate, sized(&mut s.act, pairs * inter))?;
            {
                let _t = crate::profile::scope(crate::profile::Section::Matmul);
                grouped_matmul(&down, &groups, &s.act, sized(&mut s.down, pairs * h))?;
            }
            let out = sized(&mut s.out, t * h);
            combine(&s.down, h, &groups, out)?;
            if let Some(shared) = &self.shared_expert {
                let y = shared.forward(&b.normed)?.to_dtype(DType::F32)?;
                kernels::cpu::read_f32(&y, |y| {
                    out.iter_mut().zip(y).for_each(|(o, &y)| *o += y);
                    Ok(())
                })?;
            }
            kernels::cpu::write_f32(&b.proj, &|o| {
                o.copy_from_slice(out);
                Ok(())
            })?;
            Ok(())
        })
    }

    /// [`Self::forward_cpu`] through candle ops, for experts the grouped
    /// kernels do not take (gate and up in different formats).
    fn forward_cpu_composed(&self, b: &Buffers) -> Result<()> {
        let out = self.forward(&b.normed)?.flatten_all()?.to_vec1::<f32>()?;
        kernels::cpu::write_f32(&b.proj, &|o| {
            o.copy_from_slice(&out);
            Ok(())
        })?;
        Ok(())
    }
}

/// gpt-oss's experts, stored stacked for `x @ W + b`: `gate_up_proj`
/// `[E, H, 2I]` with gate and up interleaved in its columns (gate the even
/// ones), `down_proj` `[E, I, H]`, and their biases `[E, 2I]`, `[E, H]`.
/// Each becomes an [`Mlp`] over `[out, in]` weights.
fn fused_experts(cfg: &ModelConfig, vb: VarBuilder) -> Result<Vec<Mlp>> {
    let (e, h, i) = (cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_intermediate_size);
    let gate_up = vb.get((e, h, 2 * i), "gate_up_proj")?;
    let gate_up_bias = vb.get((e, 2 * i), "gate_up_proj_bias")?;
    let down = vb.get((e, i, h), "down_proj")?;
    let down_bias = vb.get((e, h), "down_proj_bias")?;
    (0..e)
        .map(|x| {
            // [H, 2I] -> [2I, H] -> [I, 2, H]: row pairs (gate, up).
            let w = gate_up.get(x)?.t()?.reshape((i, 2, h))?;
            let b = gate_up_bias.get(x)?.reshape((i, 2))?;
            let half = |k: usize| -> Result<Linear> {
                let weight = w.narrow(1, k, 1)?.squeeze(1)?.contiguous()?;
                Ok(Linear::new(weight, Some(b.narrow(1, k, 1)?.squeeze(1)?.contiguous()?))?)
            };
            let down = Linear::new(down.get(x)?.t()?.contiguous()?, Some(down_bias.get(x)?.contiguous()?))?;
            Mlp::from_linears(cfg.activation, [half(0)?, half(1)?], down)
        })
        .collect()
}

/// gpt-oss's experts as its published checkpoints store them: MXFP4
/// (`{gate_up,down}_proj_blocks` `[E, out, in/32, 16]` in Hugging Face's
/// nibble order, `_scales` `[E, out, in/32]`, gate and up interleaved in
/// the rows) with their biases. On the CPU each matrix becomes GGML's blocks
/// for the int8 kernel, 4.25 bits a weight; elsewhere it is dequantized.
fn mxfp4_experts(cfg: &ModelConfig, vb: VarBuilder) -> Result<Vec<Mlp>> {
    let (e, h, i) = (cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_intermediate_size);
    if !h.is_multiple_of(QK_MXFP4) || !i.is_multiple_of(QK_MXFP4) {
        return Err(WorkerError::Unsupported(format!("MXFP4 experts of {h} x {i}: not whole blocks of 32")));
    }
    // All the experts' blocks of a projection, row after row.
    let blocks = |name: &str, rows: usize, inp: usize| hf_mxfp4_blocks(&vb, name, (e, rows, inp));
    let (gate_up, down) = (blocks("gate_up_proj", 2 * i, h)?, blocks("down_proj", h, i)?);
    let gate_up_bias = vb.get((e, 2 * i), "gate_up_proj_bias")?;
    let down_bias = vb.get((e, h), "down_proj_bias")?;
    let linear = |blocks: Vec<BlockMxfp4>, (out, inp): (usize, usize), bias: Tensor| -> Result<Linear> {
        let weight = match vb.device().is_cpu() {
            true => Weight::from_mxfp4(blocks, out, inp)?,
            false => {
                let mut values = vec![0f32; out * inp];
                dequantize_row(&blocks, &mut values);
                Weight::Dense(Tensor::from_vec(values, (out, inp), vb.device())?.to_dtype(vb.dtype())?)
            }
        };
        Ok(Linear::from_weight(weight, Some(bias.contiguous()?))?)
    };
    let (kh, ki) = (h / QK_MXFP4, i / QK_MXFP4);
    (0..e)
        .map(|x| {
            let rows = &gate_up[x * 2 * i * kh..(x + 1) * 2 * i * kh];
            // Even rows gate, odd rows up.
            let half = |k: usize| -> Vec<BlockMxfp4> {
                (0..i).flat_map(|r| rows[(2 * r + k) * kh..(2 * r + k + 1) * kh].iter().copied()).collect()
            };
            let b = gate_up_bias.get(x)?.reshape((i, 2))?;
            let bias = |k: usize| -> Result<Tensor> { Ok(b.narrow(1, k, 1)?.squeeze(1)?) };
            let gate = linear(half(0), (i, h), bias(0)?)?;
            let up = linear(half(1), (i, h), bias(1)?)?;
            let down = linear(down[x * h * ki..(x + 1) * h * ki].to_vec(), (h, i), down_bias.get(x)?)?;
            Mlp::from_linears(cfg.activation, [gate, up], down)
        })
        .collect()
}

/// A projection of gpt-oss's published MXFP4 experts as GGML's blocks:
/// `{name}_blocks` `[experts, rows, cols / 32, 16]` (Hugging Face's nibble
/// order) and `{name}_scales` `[experts, rows, cols / 32]`, every expert's
/// rows in order, each row's blocks in order.
pub fn hf_mxfp4_blocks(
    vb: &VarBuilder,
    name: &str,
    (experts, rows, cols): (usize, usize, usize),
) -> Result<Vec<BlockMxfp4>> {
    let kb = cols / QK_MXFP4;
    let bytes = |suffix: &str, shape: &[usize]| -> Result<Vec<u8>> {
        let t = vb.get_with_hints_dtype(shape, &format!("{name}_{suffix}"), Default::default(), DType::U8)?;
        Ok(t.flatten_all()?.to_vec1::<u8>()?)
    };
    let (codes, scales) = (bytes("blocks", &[experts, rows, kb, 16])?, bytes("scales", &[experts, rows, kb])?);
    Ok(scales
        .iter()
        .zip(codes.chunks_exact(QK_MXFP4 / 2))
        .map(|(&s, c)| BlockMxfp4::from_hf(s, c.try_into().expect("chunks of 16")))
        .collect())
}

/// Each row's kept experts and weights from its router logits, as
/// transformers routes: a softmax (Mixtral, Qwen3-MoE) or sigmoid scores
/// whose choice adds `correction_bias` and keeps to the best groups (groups
/// ranked by the sum of their two best biased scores; DeepSeek-V3,
/// GLM-4.5). The `experts_per_token` largest are kept, the lower expert
/// first on a tie; their unbiased scores, renormalised to sum to 1 where
/// the model says, times `routed_scaling_factor`, are the weights.
fn route(m: &MoeConfig, correction_bias: Option<&[f32]>, logits: &[f32]) -> Routes {
    let e = m.num_experts;
    let mut routes = Routes { experts: Vec::new(), weights: Vec::new() };
    let scale = m.routed_scaling_factor as f32;
    for l in logits.chunks_exact(e) {
        let scores: Vec<f32> = match m.scoring {
            RouterScoring::Softmax => {
                let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exp: Vec<f32> = l.iter().map(|&v| (v - max).exp()).collect();
                let sum: f32 = exp.iter().sum();
                exp.iter().map(|e| e / sum).collect()
            }
            RouterScoring::SigmoidWithCorrection => l.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
        };
        let mut choice: Vec<f32> = match correction_bias {
            Some(bias) => scores.iter().zip(bias).map(|(s, b)| s + b).collect(),
            None => scores.clone(),
        };
        if m.num_groups > 1 && m.groups_per_token < m.num_groups {
            keep_best_groups(&mut choice, m.num_groups, m.groups_per_token);
        }
        let mut kept: Vec<usize> = (0..scores.len()).collect();
        kept.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        kept.truncate(m.experts_per_token);
        let total: f32 = kept.iter().map(|&e| scores[e]).sum();
        for &e in &kept {
            let w = if m.norm_topk_prob { scores[e] / total } else { scores[e] };
            routes.experts.push(e as u32);
            routes.weights.push(w * scale);
        }
    }
    routes
}

/// Zeroes the choice scores of every expert outside the `keep` best of
/// `groups` equal groups, a group's rank being the sum of its two best
/// scores (transformers' `masked_fill(…, 0.0)`, ties to the lower group).
fn keep_best_groups(choice: &mut [f32], groups: usize, keep: usize) {
    let size = choice.len() / groups;
    let group_score = |g: &[f32]| {
        let mut best = g.to_vec();
        best.sort_by(|a, b| b.total_cmp(a));
        best.iter().take(2).sum::<f32>()
    };
    let scores: Vec<f32> = choice.chunks(size).map(group_score).collect();
    let mut order: Vec<usize> = (0..groups).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    for &g in &order[keep..] {
        choice[g * size..][..size].fill(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(scoring: RouterScoring, experts: usize, top: usize) -> MoeConfig {
        MoeConfig { num_experts: experts, experts_per_token: top, scoring, ..MoeConfig::default() }
    }

    /// One row's kept experts, ascending, with their weights.
    fn kept(routes: &Routes) -> Vec<(usize, f32)> {
        let mut kept: Vec<(usize, f32)> =
            routes.experts.iter().zip(&routes.weights).map(|(&e, &w)| (e as usize, w)).collect();
        kept.sort_by_key(|k| k.0);
        kept
    }

    #[test]
    fn softmax_routing_keeps_the_most_likely_and_renormalises() {
        let logits = vec![0.0, 2f32.ln(), 0.0, 3f32.ln()]; // probabilities 1:2:1:3
        let plain = kept(&route(&moe(RouterScoring::Softmax, 4, 2), None, &logits));
        assert_eq!(plain.iter().map(|k| k.0).collect::<Vec<_>>(), [1, 3]);
        assert!((plain[0].1 - 2.0 / 7.0).abs() < 1e-6 && (plain[1].1 - 3.0 / 7.0).abs() < 1e-6);
        let renorm = MoeConfig { norm_topk_prob: true, ..moe(RouterScoring::Softmax, 4, 2) };
        let renorm = kept(&route(&renorm, None, &logits));
        assert!((renorm[0].1 - 0.4).abs() < 1e-6 && (renorm[1].1 - 0.6).abs() < 1e-6);
    }

    /// The bias picks the experts; the weights are the unbiased sigmoids,
    /// renormalised and scaled.
    #[test]
    fn sigmoid_routing_chooses_with_the_bias_and_weighs_without_it() {
        let logit = |p: f32| (p / (1.0 - p)).ln();
        let logits = vec![logit(0.9), logit(0.5), logit(0.2), logit(0.6)];
        let bias = [0.0, 0.0, 0.5, 0.0];
        let m = MoeConfig {
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            ..moe(RouterScoring::SigmoidWithCorrection, 4, 2)
        };
        let got = kept(&route(&m, Some(&bias), &logits));
        assert_eq!(got.iter().map(|k| k.0).collect::<Vec<_>>(), [0, 2], "0.9 and 0.2 + 0.5 beat 0.6");
        assert!((got[0].1 - 2.5 * 0.9 / 1.1).abs() < 1e-5 && (got[1].1 - 2.5 * 0.2 / 1.1).abs() < 1e-5, "{got:?}");
    }

    /// Groups rank by their two best scores; experts outside the kept
    /// groups cannot be chosen even when they score higher.
    #[test]
    fn group_limited_routing_keeps_to_the_best_groups() {
        let logit = |p: f32| (p / (1.0 - p)).ln();
        // Group 0: 0.95 + 0.1; group 1: 0.7 + 0.6 (the better pair).
        let logits = vec![logit(0.95), logit(0.1), logit(0.7), logit(0.6)];
        let m = MoeConfig { num_groups: 2, groups_per_token: 1, ..moe(RouterScoring::SigmoidWithCorrection, 4, 2) };
        let got = kept(&route(&m, Some(&[0.0; 4]), &logits));
        assert_eq!(got.iter().map(|k| k.0).collect::<Vec<_>>(), [2, 3]);
        let all = MoeConfig { groups_per_token: 2, ..m };
        let got = kept(&route(&all, Some(&[0.0; 4]), &logits));
        assert_eq!(got.iter().map(|k| k.0).collect::<Vec<_>>(), [0, 2]);
    }
}
