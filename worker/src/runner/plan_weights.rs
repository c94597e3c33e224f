//! The weights of a step plan, from a model's files to GPU buffers, each
//! uploaded once in the format it runs in: safetensors (f32, f16, bf16, or
//! quantized at load with `--quantize q8_0|q4_0|q4_k`), or a GGUF file's
//! blocks as stored (Q8_0, Q4_0, Q4_K, Q6_K stay quantized: a Q4_K_M file
//! takes about its size on the GPU). Linear layers that read the same input
//! are stacked when their formats allow (q/k/v, gate/up), as on the CPU; a
//! mixture of experts' experts are stacked expert-major, one buffer a
//! projection (gpt-oss's fused and MXFP4 checkpoints rearranged to it).

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use common::model::RouterScoring;
use common::pipeline::LayerRange;
use kernels::metal::model::quantize;
use kernels::metal::step::{
    Experts, FeedForward, Gpu, LayerWeights, Linear, Matrix, ModelWeights, OutputHead, Routing, WeightFormat,
    pad_columns, padded_head_dim,
};

use crate::error::{Result, WorkerError};
use crate::models::gguf_blocks::{self, HostTensor};
use crate::models::moe::{ExpertNames, MLP_PROJECTIONS};
use crate::models::{ModelConfig, ModelFiles, rope_tables};

/// Where the plan's tensors come from, by Hugging Face name.
pub(super) enum Source {
    /// Safetensors (or seeded random weights), read lazily; linear weights
    /// quantized to `quantize` where their rows are whole blocks.
    Files { vb: VarBuilder<'static>, quantize: Option<WeightFormat> },
    /// A GGUF file's tensors, block formats as stored.
    Gguf(HashMap<String, HostTensor>),
}

impl Source {
    /// The source of `files` with dense tensors in `dtype`; and the model's
    /// config (a GGUF file's carries its RoPE factors).
    pub(super) fn open(
        files: &ModelFiles,
        dtype: DType,
        quantize: Option<WeightFormat>,
    ) -> Result<(Self, ModelConfig)> {
        match &files.gguf {
            Some(path) => {
                if quantize.is_some() {
                    return Err(WorkerError::Unsupported("--quantize applies to safetensors, not GGUF".into()));
                }
                let (cfg, tensors) = gguf_blocks::host_tensors(path, dtype)?;
                Ok((Self::Gguf(tensors), cfg))
            }
            None => {
                let vb = crate::models::loader::host_weights(files, dtype)?;
                Ok((Self::Files { vb, quantize }, files.config.clone()))
            }
        }
    }

    fn tensor(&self, name: &str, dims: &[usize]) -> Result<HostTensor> {
        match self {
            Self::Files { vb, .. } => Ok(HostTensor::Dense(vb.get(dims, name)?)),
            Self::Gguf(map) => {
                let t = map.get(name).ok_or_else(|| missing(name))?;
                if t.dims() != dims {
                    return Err(WorkerError::Unsupported(format!(
                        "{name} is {:?}, the model needs {dims:?}",
                        t.dims()
                    )));
                }
                Ok(t.clone())
            }
        }
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Self::Files { vb, .. } => vb.contains_tensor(name),
            Self::Gguf(map) => map.contains_key(name),
        }
    }

    fn vector(&self, name: &str, n: usize) -> Result<Tensor> {
        match self.tensor(name, &[n])? {
            HostTensor::Dense(t) => Ok(t),
            HostTensor::Blocks { .. } => Err(WorkerError::Unsupported(format!("{name}: a quantized vector"))),
        }
    }

    /// A linear weight, quantized when asked and possible.
    fn linear_weight(&self, name: &str, rows: usize, cols: usize) -> Result<HostTensor> {
        self.quantized(self.tensor(name, &[rows, cols])?)
    }

    /// `t`, `[rows, cols]`, quantized when asked and its rows are whole blocks.
    fn quantized(&self, t: HostTensor) -> Result<HostTensor> {
        let [rows, cols] = t.dims()[..] else { return Ok(t) };
        match (self, &t) {
            (Self::Files { quantize: Some(format), .. }, HostTensor::Dense(dense))
                if cols.is_multiple_of(format.block().0) =>
            {
                let w = dense.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let (bytes, _) = quantize(*format, &w, rows, cols)?;
                Ok(HostTensor::Blocks { format: *format, bytes, rows, cols })
            }
            _ => Ok(t),
        }
    }
}

fn missing(name: &str) -> WorkerError {
    WorkerError::Unsupported(format!("the model has no tensor {name}"))
}

/// A tensor's elements as little-endian bytes (f32, f16 or bf16).
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        other => return Err(WorkerError::Unsupported(format!("{other:?} weights on the Metal step plan"))),
    })
}

fn float_format(t: &Tensor) -> Result<WeightFormat> {
    WeightFormat::of_dtype(t.dtype())
        .ok_or_else(|| WorkerError::Unsupported(format!("{:?} weights on the Metal step plan", t.dtype())))
}

fn upload_matrix<G: Gpu>(gpu: &mut G, t: &HostTensor) -> Result<Matrix<G::Buffer>> {
    Ok(match t {
        HostTensor::Dense(t) => {
            let (rows, cols) = t.dims2()?;
            Matrix { buffer: gpu.upload(&tensor_bytes(t)?)?, format: float_format(t)?, rows, cols }
        }
        HostTensor::Blocks { format, bytes, rows, cols } => {
            Matrix { buffer: gpu.upload(bytes)?, format: *format, rows: *rows, cols: *cols }
        }
    })
}

fn upload_f32<G: Gpu>(gpu: &mut G, t: &Tensor) -> Result<G::Buffer> {
    Ok(gpu.upload(&tensor_bytes(&t.to_dtype(DType::F32)?)?)?)
}

/// Tensors with the same columns stacked by rows, when they share a format.
fn stack(parts: &[HostTensor]) -> Result<Option<HostTensor>> {
    match parts {
        [one] => Ok(Some(one.clone())),
        _ if parts.iter().all(|p| matches!(p, HostTensor::Dense(_))) => {
            let dense: Vec<Tensor> = parts
                .iter()
                .filter_map(|p| if let HostTensor::Dense(t) = p { Some(t.clone()) } else { None })
                .collect();
            let dtype = dense[0].dtype();
            let dense = dense.iter().map(|t| t.to_dtype(dtype)).collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Some(HostTensor::Dense(Tensor::cat(&dense, 0)?)))
        }
        [HostTensor::Blocks { format, cols, .. }, ..] => {
            let (mut bytes, mut rows) = (Vec::new(), 0);
            for p in parts {
                match p {
                    HostTensor::Blocks { format: f, bytes: b, rows: r, cols: c } if f == format && c == cols => {
                        bytes.extend_from_slice(b);
                        rows += r;
                    }
                    _ => return Ok(None),
                }
            }
            Ok(Some(HostTensor::Blocks { format: *format, bytes, rows, cols: *cols }))
        }
        _ => Ok(None),
    }
}

/// Linear layers reading the same input (`prefix.name`, `out` rows each),
/// stacked where their formats allow, else side by side; with their
/// biases when `bias`.
fn linears<G: Gpu>(
    gpu: &mut G,
    src: &Source,
    prefix: &str,
    names: &[(&str, usize)],
    inp: usize,
    bias: bool,
) -> Result<Vec<Linear<G::Buffer>>> {
    let weights = names
        .iter()
        .map(|(n, out)| src.linear_weight(&format!("{prefix}.{n}.weight"), *out, inp))
        .collect::<Result<Vec<_>>>()?;
    let biases = if bias {
        Some(names.iter().map(|(n, out)| src.vector(&format!("{prefix}.{n}.bias"), *out)).collect::<Result<Vec<_>>>()?)
    } else {
        None
    };
    if let Some(stacked) = stack(&weights)? {
        let bias = match &biases {
            Some(b) => Some(upload_f32(gpu, &Tensor::cat(b, 0)?)?),
            None => None,
        };
        return Ok(vec![Linear { weight: upload_matrix(gpu, &stacked)?, bias }]);
    }
    weights
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let bias = match &biases {
                Some(b) => Some(upload_f32(gpu, &b[i])?),
                None => None,
            };
            Ok(Linear { weight: upload_matrix(gpu, w)?, bias })
        })
        .collect()
}

fn one<B>(mut parts: Vec<Linear<B>>, what: &str) -> Result<Linear<B>> {
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Err(WorkerError::Unsupported(format!("{what} in two formats (the Metal step stacks them)"))),
    }
}

/// o_proj with each head's columns zero-padded to the attention kernels'
/// head dim ([`padded_head_dim`]; stories260K's heads of 8 run as 32). A
/// padded o_proj is uploaded as floats: zero columns do not fit into blocks.
fn o_proj<G: Gpu>(gpu: &mut G, src: &Source, prefix: &str, cfg: &ModelConfig) -> Result<Linear<G::Buffer>> {
    let (h, heads, d) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim);
    let padded = padded_head_dim(d).unwrap_or(d);
    let name = format!("{prefix}.o_proj.weight");
    let weight = if padded == d {
        upload_matrix(gpu, &src.linear_weight(&name, h, heads * d)?)?
    } else {
        let dense = src.tensor(&name, &[h, heads * d])?.to_dense(DType::F32)?;
        let elem = dense.dtype().size_in_bytes();
        let bytes = pad_columns(&tensor_bytes(&dense)?, h, heads, d, padded, elem);
        Matrix { buffer: gpu.upload(&bytes)?, format: float_format(&dense)?, rows: h, cols: heads * padded }
    };
    let bias =
        if cfg.o_bias { Some(upload_f32(gpu, &src.vector(&format!("{prefix}.o_proj.bias"), h)?)?) } else { None };
    Ok(Linear { weight, bias })
}

/// A gated MLP's gate/up (stacked) and down projections.
type GatedMlp<B> = (Linear<B>, Linear<B>);

/// A layer's RoPE tables, cos and sin.
type RopeTables<B> = (B, B);

/// A SwiGLU MLP of `width` under `prefix`: gate and up stacked, and down.
fn dense_mlp<G: Gpu>(
    gpu: &mut G,
    src: &Source,
    prefix: &str,
    cfg: &ModelConfig,
    width: usize,
    bias: bool,
    [gate, up, down]: [&str; 3],
) -> Result<GatedMlp<G::Buffer>> {
    let h = cfg.hidden_size;
    let gate_up = one(linears(gpu, src, prefix, &[(gate, width), (up, width)], h, bias)?, "gate/up")?;
    let down = one(linears(gpu, src, prefix, &[(down, h)], width, bias)?, "down_proj")?;
    Ok((gate_up, down))
}

/// A mixture of experts under `prefix`: the router in f32, every expert's
/// gate and up stacked expert after expert (one buffer, one format) and
/// their down projections likewise, the correction bias and the shared
/// expert where the model has them.
fn experts<G: Gpu>(gpu: &mut G, src: &Source, prefix: &str, cfg: &ModelConfig) -> Result<Experts<G::Buffer>> {
    let m = &cfg.moe;
    let (h, i) = (cfg.hidden_size, m.expert_intermediate_size);
    let expert_names = ExpertNames::of(cfg.architecture);
    let names = expert_names.projections;
    let [gate, up, down] = names;
    let router_name = format!("{prefix}.{}", expert_names.router);
    let router = src.tensor(&format!("{router_name}.weight"), &[m.num_experts, h])?.to_dense(DType::F32)?;
    let router_bias = match m.biases {
        true => Some(upload_f32(gpu, &src.vector(&format!("{router_name}.bias"), m.num_experts)?)?),
        false => None,
    };
    let router = Linear { weight: upload_matrix(gpu, &HostTensor::Dense(router))?, bias: router_bias };
    let stacked = |gpu: &mut G, parts: &[HostTensor], bias: Option<Tensor>, what: &str| -> Result<Linear<G::Buffer>> {
        let Some(all) = stack(parts)? else {
            return Err(WorkerError::Unsupported(format!(
                "{prefix}: experts' {what} in several formats (the Metal step stacks them)"
            )));
        };
        let bias = match bias {
            Some(b) => Some(upload_f32(gpu, &b)?),
            None => None,
        };
        Ok(Linear { weight: upload_matrix(gpu, &all)?, bias })
    };
    let (gate_up, down) = match gpt_oss_experts(src, prefix, cfg)? {
        Some((gate_up, gate_up_bias, down, down_bias)) => (
            stacked(gpu, &[gate_up], Some(gate_up_bias), "gate/up")?,
            stacked(gpu, &[down], Some(down_bias), "down_proj")?,
        ),
        None => {
            let expert = |e: usize, name: &str, rows: usize, cols: usize| {
                src.linear_weight(&format!("{prefix}.experts.{e}.{name}.weight"), rows, cols)
            };
            let bias = |e: usize, name: &str, n: usize| src.vector(&format!("{prefix}.experts.{e}.{name}.bias"), n);
            let (mut gate_up, mut downs) = (Vec::new(), Vec::new());
            let (mut gate_up_bias, mut down_bias) = (Vec::new(), Vec::new());
            for e in 0..m.num_experts {
                gate_up.extend([expert(e, gate, i, h)?, expert(e, up, i, h)?]);
                downs.push(expert(e, down, h, i)?);
                if m.biases {
                    gate_up_bias.extend([bias(e, gate, i)?, bias(e, up, i)?]);
                    down_bias.push(bias(e, down, h)?);
                }
            }
            let cat = |parts: Vec<Tensor>| -> Result<Option<Tensor>> {
                if parts.is_empty() {
                    return Ok(None);
                }
                let parts = parts.iter().map(|p| p.to_dtype(DType::F32)).collect::<candle_core::Result<Vec<_>>>()?;
                Ok(Some(Tensor::cat(&parts, 0)?))
            };
            (
                stacked(gpu, &gate_up, cat(gate_up_bias)?, "gate/up")?,
                stacked(gpu, &downs, cat(down_bias)?, "down_proj")?,
            )
        }
    };
    let correction = match m.scoring {
        RouterScoring::SigmoidWithCorrection => {
            Some(upload_f32(gpu, &src.vector(&format!("{prefix}.gate.e_score_correction_bias"), m.num_experts)?)?)
        }
        RouterScoring::Softmax => None,
    };
    let shared = match m.shared_intermediate_size {
        0 => None,
        width => Some(dense_mlp(gpu, src, &format!("{prefix}.shared_experts"), cfg, width, false, names)?),
    };
    Ok(Experts {
        router,
        correction,
        gate_up,
        down,
        shared,
        routing: Routing {
            experts: m.num_experts,
            top_k: m.experts_per_token,
            expert_intermediate: i,
            sigmoid: m.scoring == RouterScoring::SigmoidWithCorrection,
            norm_topk: m.norm_topk_prob,
            groups: m.num_groups.max(1),
            groups_kept: m.groups_per_token.max(1),
            scale: m.routed_scaling_factor as f32,
        },
    })
}

/// gpt-oss's experts as its Hugging Face checkpoints store them, stacked as
/// the plan reads them: `gate_up_proj` `[E, H, 2I]` (for `x @ W`, gate and
/// up interleaved in the columns, gate the even ones) becomes each expert's
/// `[gate; up]` rows, `down_proj` `[E, I, H]` each expert's `[H, I]`, their
/// biases likewise; MXFP4 checkpoints (`*_blocks`, `*_scales`, rows
/// interleaved the same way) become GGML's MXFP4 blocks.
fn gpt_oss_experts(
    src: &Source,
    prefix: &str,
    cfg: &ModelConfig,
) -> Result<Option<(HostTensor, Tensor, HostTensor, Tensor)>> {
    let Source::Files { vb, .. } = src else { return Ok(None) };
    let (e, h, i) = (cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_intermediate_size);
    let vb = vb.pp(format!("{prefix}.experts"));
    let gate_up_bias = |vb: &VarBuilder| -> Result<Tensor> {
        // [E, 2I] interleaved -> each expert's [gate biases; up biases].
        let b = vb.get((e, 2 * i), "gate_up_proj_bias")?.to_dtype(DType::F32)?.reshape((e, i, 2))?;
        Ok(Tensor::cat(&[b.narrow(2, 0, 1)?.squeeze(2)?, b.narrow(2, 1, 1)?.squeeze(2)?], 1)?.flatten_all()?)
    };
    let down_bias = |vb: &VarBuilder| -> Result<Tensor> { Ok(vb.get((e, h), "down_proj_bias")?.flatten_all()?) };
    if vb.contains_tensor("gate_up_proj") {
        // [E, H, 2I] -> [E, 2I, H] -> [E, I, 2, H]: row pairs (gate, up).
        let w = vb.get((e, h, 2 * i), "gate_up_proj")?.transpose(1, 2)?.reshape((e, i, 2, h))?;
        let gate_up = Tensor::cat(&[w.narrow(2, 0, 1)?.squeeze(2)?, w.narrow(2, 1, 1)?.squeeze(2)?], 1)?
            .reshape((e * 2 * i, h))?
            .contiguous()?;
        let down = vb.get((e, i, h), "down_proj")?.transpose(1, 2)?.reshape((e * h, i))?.contiguous()?;
        let (gate_up, down) = (src.quantized(HostTensor::Dense(gate_up))?, src.quantized(HostTensor::Dense(down))?);
        return Ok(Some((gate_up, gate_up_bias(&vb)?, down, down_bias(&vb)?)));
    }
    if !vb.contains_tensor("gate_up_proj_blocks") {
        return Ok(None);
    }
    use kernels::cpu::quant::QK_MXFP4;
    if !h.is_multiple_of(QK_MXFP4) || !i.is_multiple_of(QK_MXFP4) {
        return Err(WorkerError::Unsupported(format!("MXFP4 experts of {h} x {i}: not whole blocks of 32")));
    }
    // Each row's GGML blocks (the exponent, then the codes), rows in `order`.
    let blocks = |name: &str, rows: usize, cols: usize, order: &dyn Fn(usize) -> usize| -> Result<Vec<u8>> {
        let all = crate::models::moe::hf_mxfp4_blocks(&vb, name, (e, rows, cols))?;
        let kb = cols / QK_MXFP4;
        let mut out = Vec::with_capacity(all.len() * 17);
        for x in 0..e {
            for r in 0..rows {
                for block in &all[(x * rows + order(r)) * kb..][..kb] {
                    out.push(block.e);
                    out.extend(block.qs);
                }
            }
        }
        Ok(out)
    };
    // Gate rows are the even ones, up rows the odd ones.
    let gate_then_up = |r: usize| if r < i { 2 * r } else { 2 * (r - i) + 1 };
    let gate_up = blocks("gate_up_proj", 2 * i, h, &gate_then_up)?;
    let down = blocks("down_proj", h, i, &|r| r)?;
    let mxfp4 = |bytes, rows, cols| HostTensor::Blocks { format: WeightFormat::Mxfp4, bytes, rows, cols };
    Ok(Some((mxfp4(gate_up, e * 2 * i, h), gate_up_bias(&vb)?, mxfp4(down, e * h, i), down_bias(&vb)?)))
}

/// The weights of `layers` of the model of `cfg` from `src` (with the
/// embedding if they start at layer 0 and the head if they end at the
/// last), and the RoPE tables for `max_positions`, uploaded to `gpu`.
pub(super) fn upload<G: Gpu>(
    gpu: &mut G,
    cfg: &ModelConfig,
    src: &Source,
    max_positions: usize,
    layers: LayerRange,
) -> Result<ModelWeights<G::Buffer>> {
    let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
    let tied = cfg.tie_word_embeddings || !src.has("lm_head.weight");
    let embed = if layers.is_first() || (layers.is_last() && tied) {
        // Gathered by row on the GPU in a float type: blocks are widened to
        // f32 at load (exactly what they dequantize to).
        let embed_t = match src.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])? {
            dense @ HostTensor::Dense(_) => dense,
            blocks => HostTensor::Dense(blocks.to_dense(DType::F32)?),
        };
        Some(upload_matrix(gpu, &embed_t)?)
    } else {
        None
    };
    // Gemma's norms multiply by `1 + w` (unless the file's weights hold the 1).
    let offset = if cfg.gemma_norms && !cfg.norm_weights_include_one { 1.0 } else { 0.0 };
    let norm = |gpu: &mut G, name: String, dim: usize| {
        upload_f32(gpu, &(src.vector(&name, dim)?.to_dtype(DType::F32)? + offset)?)
    };
    let head = match (layers.is_last(), &embed) {
        (false, _) => None,
        (true, Some(embed)) if tied => Some((embed.clone(), norm(gpu, "model.norm.weight".into(), h)?)),
        (true, _) => {
            let lm_head = upload_matrix(gpu, &src.linear_weight("lm_head.weight", cfg.vocab_size, h)?)?;
            Some((lm_head, norm(gpu, "model.norm.weight".into(), h)?))
        }
    };
    let head = head.map(|(lm_head, final_norm)| OutputHead { final_norm, lm_head });
    let embed = if layers.is_first() { embed } else { None };
    let mut layer_weights = Vec::with_capacity(layers.len());
    // RoPE tables of layers rotating other than the model (Gemma's local
    // layers), uploaded once per distinct rotation.
    let mut own_ropes: Vec<(ModelConfig, RopeTables<G::Buffer>)> = Vec::new();
    for l in layers.start..layers.end {
        let p = format!("model.layers.{l}");
        let attn = format!("{p}.self_attn");
        let mlp = format!("{p}.mlp");
        let head_norm = if cfg.qk_norm {
            Some((norm(gpu, format!("{attn}.q_norm.weight"), d)?, norm(gpu, format!("{attn}.k_norm.weight"), d)?))
        } else {
            None
        };
        let qkv = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)];
        let mlp = match cfg.moe.is_moe_layer(l) {
            true => {
                let module = ExpertNames::of(cfg.architecture).module;
                FeedForward::Experts(experts(gpu, src, &format!("{p}.{module}"), cfg)?)
            }
            false => {
                let (gate_up, down) = dense_mlp(gpu, src, &mlp, cfg, i, cfg.mlp_bias, MLP_PROJECTIONS)?;
                FeedForward::Dense { gate_up, down }
            }
        };
        // Gemma normalises each sublayer's output; its MLP's input norm is
        // `pre_feedforward_layernorm`.
        let (post_norm, attn_out_norm, mlp_out_norm) = match cfg.gemma_norms {
            true => (
                norm(gpu, format!("{p}.pre_feedforward_layernorm.weight"), h)?,
                Some(norm(gpu, format!("{p}.post_attention_layernorm.weight"), h)?),
                Some(norm(gpu, format!("{p}.post_feedforward_layernorm.weight"), h)?),
            ),
            false => (norm(gpu, format!("{p}.post_attention_layernorm.weight"), h)?, None, None),
        };
        let rope = match cfg.layer_rope(l) {
            std::borrow::Cow::Borrowed(_) => None,
            std::borrow::Cow::Owned(own) => match own_ropes.iter().find(|(c, _)| *c == own) {
                Some((_, tables)) => Some(tables.clone()),
                None => {
                    let tables = rope_buffers(gpu, &own, max_positions)?;
                    own_ropes.push((own, tables.clone()));
                    Some(tables)
                }
            },
        };
        let sinks = match cfg.attention_sinks {
            true => Some(upload_f32(gpu, &src.vector(&format!("{attn}.sinks"), cfg.num_heads)?)?),
            false => None,
        };
        layer_weights.push(LayerWeights {
            input_norm: norm(gpu, format!("{p}.input_layernorm.weight"), h)?,
            qkv: linears(gpu, src, &attn, &qkv, h, cfg.qkv_bias)?,
            head_norm,
            o_proj: o_proj(gpu, src, &attn, cfg)?,
            post_norm,
            mlp,
            window: cfg.layer_window(l),
            sinks,
            rope,
            attn_out_norm,
            mlp_out_norm,
        });
    }
    let (rope_cos, rope_sin) = rope_buffers(gpu, cfg, max_positions)?;
    Ok(ModelWeights { embed, layers: layer_weights, head, rope_cos, rope_sin })
}

/// The CPU path's RoPE tables of `cfg`, uploaded.
fn rope_buffers<G: Gpu>(gpu: &mut G, cfg: &ModelConfig, max_positions: usize) -> Result<RopeTables<G::Buffer>> {
    let (cos, sin) = rope_tables(cfg, max_positions);
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    Ok((gpu.upload(&bytes(&cos))?, gpu.upload(&bytes(&sin))?))
}
