//! A mixture-of-experts MLP (Mixtral, Qwen3-MoE), as transformers computes
//! it: a softmax router over the experts, the `experts_per_token` most
//! likely kept (their weights renormalised where the model says), each
//! token's kept experts run on it and their outputs added, weighted, in
//! expert order.
//!
//! Each expert runs over the rows routed to it (gathered, computed, scaled
//! and scattered back), so a step reads only the experts its tokens chose.

use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;
use common::model::Architecture;

use super::config::ModelConfig;
use super::layers::Mlp;
use super::linear::{Linear, Prequantized, linear};
use super::workspace::Buffers;
use crate::error::Result;

/// A decoder layer's MLP: dense, or a mixture of experts.
pub enum FeedForward {
    Dense(Mlp),
    Experts(SparseMoe),
}

impl FeedForward {
    /// Layer `layer`'s MLP under `vb` (the layer's prefix).
    pub fn new(cfg: &ModelConfig, layer: usize, vb: &VarBuilder, pre: &Prequantized) -> Result<Self> {
        Ok(match cfg.moe.is_moe_layer(layer) {
            // Mixtral keeps its experts under `block_sparse_moe`.
            true if cfg.architecture == Architecture::Mixtral => {
                Self::Experts(SparseMoe::new(cfg, vb.pp("block_sparse_moe"), pre)?)
            }
            true => Self::Experts(SparseMoe::new(cfg, vb.pp("mlp"), pre)?),
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
}

pub struct SparseMoe {
    /// `[experts, hidden]`, kept in f32: a quantized router could flip a
    /// choice of expert (`--quantize` leaves it alone).
    router: Linear,
    experts: Vec<Mlp>,
    experts_per_token: usize,
    normalize: bool,
}

/// Each row's kept experts and their weights: `(expert, row, weight)` lists
/// per expert, rows ascending.
type Routes = Vec<(Vec<u32>, Vec<f32>)>;

impl SparseMoe {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        let m = &cfg.moe;
        let (h, i) = (cfg.hidden_size, m.expert_intermediate_size);
        // Mixtral names an expert's projections w1 (gate), w3 (up), w2 (down).
        let names = match cfg.architecture {
            Architecture::Mixtral => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        };
        let experts = (0..m.num_experts)
            .map(|e| Mlp::with_names((h, i, false), vb.pp("experts").pp(e), pre, names))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            router: linear(h, m.num_experts, false, vb.pp("gate"), pre)?,
            experts,
            experts_per_token: m.experts_per_token,
            normalize: m.norm_topk_prob,
        })
    }

    /// The experts' linear layers (the router's excluded: see `router`).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        self.experts.iter_mut().flat_map(Mlp::linears_mut).collect()
    }

    /// Bytes of weight a token reads: the router and its kept experts.
    pub fn size_in_bytes(&self) -> usize {
        let expert = self.experts.first().map_or(0, Mlp::size_in_bytes);
        self.router.size_in_bytes() + self.experts_per_token * expert
    }

    /// `x: [T, hidden]` -> `[T, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let logits = self.router.forward(x)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let routes = self.route(&logits);
        let mut out = x.zeros_like()?;
        for (expert, (rows, weights)) in self.experts.iter().zip(&routes) {
            if rows.is_empty() {
                continue;
            }
            let idx = Tensor::from_slice(rows, rows.len(), x.device())?;
            let y = expert.forward(&x.index_select(&idx, 0)?)?;
            let w = Tensor::from_slice(weights, (rows.len(), 1), x.device())?.to_dtype(y.dtype())?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        Ok(out)
    }

    /// The CPU step in the workspace: `b.normed` -> `b.proj`.
    pub fn forward_cpu(&self, b: &Buffers) -> Result<()> {
        let out = self.forward(&b.normed)?.flatten_all()?.to_vec1::<f32>()?;
        kernels::cpu::write_f32(&b.proj, &|o| {
            o.copy_from_slice(&out);
            Ok(())
        })?;
        Ok(())
    }

    /// Softmax over each row's router logits (f32, as transformers takes
    /// it), the largest `experts_per_token` kept (lower expert first on a
    /// tie) and, where the model says, renormalised to sum to 1.
    fn route(&self, logits: &[Vec<f32>]) -> Routes {
        let mut routes: Routes = vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (row, l) in logits.iter().enumerate() {
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = l.iter().map(|&v| (v - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            let probs: Vec<f32> = exp.iter().map(|e| e / sum).collect();
            let mut kept: Vec<usize> = (0..probs.len()).collect();
            kept.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            kept.truncate(self.experts_per_token);
            let total: f32 = kept.iter().map(|&e| probs[e]).sum();
            for &e in &kept {
                let w = if self.normalize { probs[e] / total } else { probs[e] };
                routes[e].0.push(row as u32);
                routes[e].1.push(w);
            }
        }
        routes
    }
}
