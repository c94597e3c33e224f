//! What a plan does at load: checks the weights against the model's shape
//! and allocates every buffer a step may use, at its bound.

use candle_core::DType;

use super::experts::{ExpertBuffers, ExpertKernels, MAX_EXPERTS, max_tiles};
use super::{
    Activations, Allocator, FeedForward, HEAD_DIMS, HeadBuffers, InputLayout, Kernel, Kernels, Linear, MATMUL_SIMDS,
    Matrix, ModelShape, ModelWeights, PARTITION_SIZE, PREFILL_ROWS, REGION_ALIGN, ROW_THREADS, Result, Routing,
    Sampler, Source, StepLimits, StepPlan, WeightFormat, invalid, model_kernel, padded_head_dim, to_u32,
};

/// Bytes of the attention metadata upload at most (see `AttentionPlan::new`).
fn meta_bound(shape: &ModelShape, limits: &StepLimits) -> usize {
    let region = |n: usize| (n.max(1) * 4).next_multiple_of(REGION_ALIGN);
    let seqs = limits.max_seqs;
    let max_blocks = limits.max_model_len.div_ceil(limits.block_size).max(1);
    let group = shape.heads / shape.kv_heads.max(1);
    let items = 2 * (limits.max_tokens * group / PREFILL_ROWS + seqs);
    region(seqs + 1) + region(seqs) + region(seqs * max_blocks) + region(seqs) + region(items)
}

/// Bytes of decode scratch at most: every sequence at the longest context.
fn scratch_bound(shape: &ModelShape, limits: &StepLimits) -> usize {
    if limits.max_model_len <= PARTITION_SIZE {
        return 0;
    }
    let rows = limits.max_seqs * shape.heads * limits.max_model_len.div_ceil(PARTITION_SIZE);
    let f32_bytes = |n: usize| (n * 4).next_multiple_of(REGION_ALIGN);
    let head_dim = padded_head_dim(shape.head_dim).unwrap_or(shape.head_dim);
    f32_bytes(rows * head_dim) + 2 * f32_bytes(rows)
}

impl<B: Clone> StepPlan<B> {
    /// Checks the weights against `shape` and allocates the KV pools and
    /// every per-step buffer, at their bounds under `limits`.
    pub fn new<A: Allocator<Buffer = B>>(
        alloc: &mut A,
        shape: ModelShape,
        weights: ModelWeights<B>,
        limits: StepLimits,
        cache_dtype: DType,
    ) -> Result<Self> {
        let ModelShape { hidden, intermediate, heads, kv_heads, head_dim, vocab, .. } = shape;
        let Some(padded) = padded_head_dim(head_dim) else {
            return invalid(format!(
                "the Metal step has no attention kernel for head_dim {head_dim} (it takes even head dims up to {})",
                HEAD_DIMS[HEAD_DIMS.len() - 1]
            ));
        };
        if shape.rotary_dim == 0 || !shape.rotary_dim.is_multiple_of(2) || shape.rotary_dim > head_dim {
            return invalid(format!("a rotary dim of {} in heads of {head_dim}", shape.rotary_dim));
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            return invalid(format!("{heads} query heads are not a multiple of {kv_heads} kv heads"));
        }
        let cache_name = match cache_dtype {
            DType::F32 => "f32",
            DType::F16 => "f16",
            other => return invalid(format!("the Metal step's KV cache is f32 or f16, not {other:?}")),
        };
        let qkv_rows = (heads + 2 * kv_heads) * head_dim;
        let check = |m: &Matrix<B>, rows: usize, cols: usize, what: &str| -> Result<()> {
            if (m.rows, m.cols) != (rows, cols) {
                return invalid(format!("{what} is [{}, {}], the model needs [{rows}, {cols}]", m.rows, m.cols));
            }
            // Block rows are read by 32-weight chunks.
            if m.format.row_bytes(cols).is_none() || (!m.format.is_float() && !cols.is_multiple_of(32)) {
                return invalid(format!("{what}: rows of {cols} weights are not whole {:?} blocks", m.format));
            }
            to_u32(rows * cols, what).map(|_| ())
        };
        if let Some(embed) = &weights.embed {
            if !embed.format.is_float() {
                return invalid(format!("the embedding is {:?}; the Metal step reads f32, f16 or bf16", embed.format));
            }
            check(embed, vocab, hidden, "the embedding")?;
        }
        if let Some(head) = &weights.head {
            check(&head.lm_head, vocab, hidden, "lm_head")?;
        }
        for (l, layer) in weights.layers.iter().enumerate() {
            for part in &layer.qkv {
                check(&part.weight, part.weight.rows, hidden, &format!("layer {l}'s qkv projection"))?;
            }
            let rows: usize = layer.qkv.iter().map(|p| p.weight.rows).sum();
            if rows != qkv_rows {
                return invalid(format!("layer {l}'s q, k and v have {rows} rows, the model needs {qkv_rows}"));
            }
            check(&layer.o_proj.weight, hidden, heads * padded, &format!("layer {l}'s o_proj (padded heads)"))?;
            if layer.window == Some(0) {
                return invalid(format!("layer {l}: a sliding window of 0 hides every key"));
            }
            if layer.mlp_out_norm.is_some() && matches!(layer.mlp, FeedForward::Experts(_)) {
                return invalid(format!("layer {l}: a norm of the experts' output (no model has one)"));
            }
            let mlp = |gate_up: &Linear<B>, down: &Linear<B>, width: usize, what: &str| -> Result<()> {
                check(&gate_up.weight, 2 * width, hidden, &format!("layer {l}'s {what}gate/up projection"))?;
                check(&down.weight, hidden, width, &format!("layer {l}'s {what}down_proj"))
            };
            match &layer.mlp {
                FeedForward::Dense { gate_up, down } => mlp(gate_up, down, intermediate, "")?,
                FeedForward::Experts(x) => {
                    let Routing { experts, top_k, expert_intermediate: width, groups, groups_kept, .. } = x.routing;
                    if top_k == 0 || top_k > experts || experts > MAX_EXPERTS {
                        return invalid(format!(
                            "layer {l}: {top_k} of {experts} experts a token (the Metal step routes 1 to at most \
                             {MAX_EXPERTS})"
                        ));
                    }
                    if groups == 0 || !experts.is_multiple_of(groups) || groups_kept == 0 || groups_kept > groups {
                        return invalid(format!("layer {l}: {experts} experts in {groups} groups, {groups_kept} kept"));
                    }
                    if x.router.weight.format != WeightFormat::F32 {
                        return invalid(format!(
                            "layer {l}'s router is {:?}; the Metal step reads f32",
                            x.router.weight.format
                        ));
                    }
                    check(&x.router.weight, experts, hidden, &format!("layer {l}'s router"))?;
                    check(&x.gate_up.weight, experts * 2 * width, hidden, &format!("layer {l}'s experts' gate/up"))?;
                    check(&x.down.weight, experts * hidden, width, &format!("layer {l}'s experts' down_proj"))?;
                    if let Some((gate_up, down)) = &x.shared {
                        mlp(gate_up, down, down.weight.cols, "shared expert's ")?;
                    }
                }
            }
        }
        let StepLimits { max_tokens, max_logit_rows, num_blocks, block_size, .. } = limits;
        if max_tokens == 0 || (weights.head.is_some() && max_logit_rows == 0) || limits.max_seqs == 0 || block_size == 0
        {
            return invalid(format!("a step plan needs room for a token, a row and a sequence: {limits:?}"));
        }
        let f32s = |alloc: &mut A, n: usize| alloc.scratch(n.max(1) * 4);
        let row = kv_heads * padded;
        // The widest dense MLP (a shared expert's included) and the largest
        // router, top-k and expert of the mixtures of experts.
        let mut dense_width = 0;
        let (mut max_experts, mut max_top_k, mut max_expert_width) = (0, 0, 0);
        for layer in &weights.layers {
            match &layer.mlp {
                FeedForward::Dense { down, .. } => dense_width = dense_width.max(down.weight.cols),
                FeedForward::Experts(x) => {
                    let r = x.routing;
                    max_experts = max_experts.max(r.experts);
                    max_top_k = max_top_k.max(r.top_k);
                    max_expert_width = max_expert_width.max(r.expert_intermediate);
                    dense_width = dense_width.max(x.shared.as_ref().map_or(0, |(_, d)| d.weight.cols));
                    to_u32(x.gate_up.weight.rows * x.gate_up.weight.cols, "the experts' gate/up elements")?;
                }
            }
        }
        let pairs = max_tokens * max_top_k;
        to_u32(num_blocks * block_size * row, "KV cache elements")?;
        to_u32(max_tokens * qkv_rows.max(2 * dense_width), "activation elements")?;
        to_u32(pairs * hidden.max(max_expert_width) + max_tokens * max_experts, "expert activation elements")?;
        if weights.head.is_some() {
            to_u32(max_logit_rows * vocab, "logits")?;
        }
        let kv = (0..weights.layers.len())
            .map(|_| {
                let bytes = num_blocks * block_size * row * cache_dtype.size_in_bytes();
                Ok((alloc.scratch(bytes.max(1))?, alloc.scratch(bytes.max(1))?))
            })
            .collect::<Result<Vec<_>>>()?;
        let acts = Activations {
            hidden: f32s(alloc, max_tokens * hidden)?,
            normed: f32s(alloc, max_tokens * hidden)?,
            qkv: f32s(alloc, max_tokens * qkv_rows)?,
            q: f32s(alloc, max_tokens * heads * padded)?,
            attn: f32s(alloc, max_tokens * heads * padded)?,
            act: f32s(alloc, max_tokens * dense_width)?,
            experts: match max_top_k {
                0 => None,
                _ => Some(ExpertBuffers {
                    logits: f32s(alloc, max_tokens * max_experts)?,
                    ids: f32s(alloc, pairs)?,
                    weights: f32s(alloc, pairs)?,
                    order: f32s(alloc, pairs)?,
                    tiles: f32s(alloc, 3 * max_tiles(pairs, max_experts))?,
                    act: f32s(alloc, pairs * max_expert_width)?,
                    out: f32s(alloc, pairs * hidden)?,
                }),
            },
        };
        let head = match weights.head {
            Some(_) => Some(HeadBuffers {
                head_in: f32s(alloc, max_logit_rows * hidden)?,
                logits: f32s(alloc, max_logit_rows * vocab)?,
                sampler: Sampler::new(alloc, vocab, limits.max_sampled_rows.clamp(1, max_logit_rows))?,
            }),
            None => None,
        };
        let layout = InputLayout::new(&limits);
        let inputs = alloc.scratch(layout.len)?;
        let meta_capacity = meta_bound(&shape, &limits);
        let meta = alloc.scratch(meta_capacity)?;
        let scratch_capacity = scratch_bound(&shape, &limits);
        let scratch = if scratch_capacity == 0 { None } else { Some(alloc.scratch(scratch_capacity)?) };

        // The formats of the plain matmuls, and of the experts' (matmul_id).
        let (mut formats, mut expert_formats) = (Vec::new(), Vec::new());
        let add = |list: &mut Vec<WeightFormat>, f: WeightFormat| {
            if !list.contains(&f) {
                list.push(f);
            }
        };
        if let Some(head) = &weights.head {
            add(&mut formats, head.lm_head.format);
        }
        for layer in &weights.layers {
            for part in layer.qkv.iter().chain([&layer.o_proj]) {
                add(&mut formats, part.weight.format);
            }
            match &layer.mlp {
                FeedForward::Dense { gate_up, down } => {
                    add(&mut formats, gate_up.weight.format);
                    add(&mut formats, down.weight.format);
                }
                FeedForward::Experts(x) => {
                    add(&mut formats, x.router.weight.format);
                    if let Some((gate_up, down)) = &x.shared {
                        add(&mut formats, gate_up.weight.format);
                        add(&mut formats, down.weight.format);
                    }
                    add(&mut expert_formats, x.gate_up.weight.format);
                    add(&mut expert_formats, x.down.weight.format);
                }
            }
        }
        let matmuls_named = |prefix: &str, formats: &[WeightFormat]| -> Vec<(WeightFormat, Kernel)> {
            let kernel = |f: WeightFormat| model_kernel(format!("{prefix}_{}", f.name()), MATMUL_SIMDS * 32);
            formats.iter().map(|&f| (f, kernel(f))).collect()
        };
        let matmuls = matmuls_named("matmul", &formats);
        let experts = (!expert_formats.is_empty()).then(|| ExpertKernels {
            route: model_kernel("moe_route".into(), 32),
            group: model_kernel("moe_group".into(), ROW_THREADS),
            combine: model_kernel("moe_combine".into(), ROW_THREADS),
            matmuls: matmuls_named("matmul_id", &expert_formats),
        });
        let attention_kernel = |source, name: &str, dtypes: &str| Kernel {
            source,
            name: format!("{name}_{dtypes}_hd{padded}"),
            threads: super::super::plan::ATTENTION_THREADS,
        };
        let kv_name = if cache_dtype == DType::F16 { "f32_kvf16" } else { "f32" };
        let kernels = Kernels {
            attention: vec![
                attention_kernel(Source::Decode, "paged_attention_decode", kv_name),
                attention_kernel(Source::Decode, "paged_attention_reduce", "f32"),
                attention_kernel(Source::Prefill, "paged_attention_prefill", kv_name),
            ],
            embed: weights.embed.as_ref().map(|e| model_kernel(format!("embed_rows_{}", e.format.name()), ROW_THREADS)),
            norm: model_kernel("rms_norm".into(), ROW_THREADS),
            matmuls,
            rope: model_kernel(format!("rope_qkv_cache_{cache_name}"), 32),
            experts,
        };
        Ok(Self {
            shape,
            limits,
            weights,
            kv,
            cache_dtype,
            inputs,
            layout,
            acts,
            meta,
            meta_capacity,
            scratch,
            scratch_capacity,
            head,
            kernels,
        })
    }
}
