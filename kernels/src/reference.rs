//! Naive paged attention and KV write: host loops in f64 with a two-pass
//! softmax (a head's sink logit, where given, joining its sum), q8_0 rows (de)quantized one value at a time. Slow and
//! obviously right; the other paths are tested against it.

use candle_core::{DType, Tensor};

use crate::kv_dtype::{Q8_PARAM_BYTES, q8_step_and_min};
use crate::{Attention, CacheWrite, Result};

pub fn paged_attention(a: &Attention) -> Result<Tensor> {
    let Attention { q, k_cache, v_cache, meta, scale, sinks } = *a;
    let d = a.check()?;
    let hd = d.head_dim;
    let (qv, kv, vv) = (host(q)?, cache_values(k_cache, hd)?, cache_values(v_cache, hd)?);
    let group = d.group();
    // Element offset of (slot, kv_head) in a cache.
    let at = |slot: usize, kvh: usize| (slot * d.num_kv_heads + kvh) * hd;
    let mut out = vec![0f32; d.num_tokens * d.num_heads * hd];
    for s in 0..meta.num_seqs() {
        let rows = meta.query_range(s);
        let ctx = meta.context_lens[s] as usize;
        let first_pos = ctx - rows.len();
        for (i, row) in rows.enumerate() {
            let q_pos = first_pos + i;
            for h in 0..d.num_heads {
                let kvh = h / group;
                let qh = &qv[(row * d.num_heads + h) * hd..][..hd];
                let keys: Vec<usize> = (0..ctx).filter(|&p| meta.visible(q_pos, p)).collect();
                let slot = |p: usize| meta.block_tables[s][p / d.block_size] as usize * d.block_size + p % d.block_size;
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&p| {
                        let k = &kv[at(slot(p), kvh)..][..hd];
                        qh.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale as f64
                    })
                    .collect();
                let sink = sinks.map(|s| s[h] as f64);
                let max = scores.iter().chain(&sink).cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                let o = &mut out[(row * d.num_heads + h) * hd..][..hd];
                for (j, value) in o.iter_mut().enumerate() {
                    let acc: f64 = keys.iter().zip(&weights).map(|(&p, w)| w * vv[at(slot(p), kvh) + j] as f64).sum();
                    *value = (acc / total) as f32;
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, (d.num_tokens, d.num_heads, hd), q.device())?.to_dtype(q.dtype())?)
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// A cache's values on the host, `head_dim` per (slot, kv head): floats
/// widened, q8_0 rows dequantized (code times the row's step plus its
/// minimum).
pub fn cache_values(cache: &Tensor, head_dim: usize) -> Result<Vec<f32>> {
    if cache.dtype() != DType::U8 {
        return host(cache);
    }
    let bytes = cache.flatten_all()?.to_vec1::<u8>()?;
    let row = head_dim + Q8_PARAM_BYTES;
    Ok(bytes
        .chunks_exact(row)
        .flat_map(|r| {
            let bf16 = |at: usize| half::bf16::from_le_bytes([r[at], r[at + 1]]).to_f64();
            let (step, min) = (bf16(head_dim), bf16(head_dim + 2));
            r[..head_dim].iter().map(move |&b| (b as f64 * step + min) as f32)
        })
        .collect())
}

/// One q8_0 row: the step and minimum of the format (bf16 roundings of
/// `(max - min) / 255` and the row's minimum), values `(x - min) / step`
/// rounded.
pub fn quantize_q8_row(x: &[f32]) -> Vec<u8> {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (step, min) = q8_step_and_min(lo, hi);
    let mut row: Vec<u8> = x
        .iter()
        .map(|&v| if step == 0.0 { 0 } else { ((v as f64 - min as f64) / step as f64).round().clamp(0.0, 255.0) as u8 })
        .collect();
    row.extend_from_slice(&half::bf16::from_f32(step).to_le_bytes());
    row.extend_from_slice(&half::bf16::from_f32(min).to_le_bytes());
    row
}

/// Rebuilds each cache on the host with the new rows and writes it back in place.
pub fn reshape_and_cache(w: &CacheWrite) -> Result<()> {
    let CacheWrite { k, v, k_cache, v_cache, slot_mapping } = *w;
    w.check()?;
    let (_, kvh, hd) = k.dims3()?;
    for (new, cache) in [(k, k_cache), (v, v_cache)] {
        let dims = cache.dims().to_vec();
        let rows = host(new)?;
        let updated = if cache.dtype() == DType::U8 {
            let row = kvh * (hd + Q8_PARAM_BYTES);
            let mut bytes = cache.flatten_all()?.to_vec1::<u8>()?;
            for (t, &slot) in slot_mapping.iter().enumerate() {
                let quantized: Vec<u8> =
                    rows[t * kvh * hd..][..kvh * hd].chunks_exact(hd).flat_map(quantize_q8_row).collect();
                bytes[slot as usize * row..][..row].copy_from_slice(&quantized);
            }
            Tensor::from_vec(bytes, dims.as_slice(), cache.device())?
        } else {
            let row = kvh * hd;
            let mut values = host(cache)?;
            for (t, &slot) in slot_mapping.iter().enumerate() {
                values[slot as usize * row..][..row].copy_from_slice(&rows[t * row..][..row]);
            }
            Tensor::from_vec(values, dims.as_slice(), cache.device())?.to_dtype(cache.dtype())?
        };
        cache.slice_set(&updated, 0, 0)?;
    }
    Ok(())
}

/// RMSNorm of each row of `x: [rows, weight.len()]`, in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    x.chunks(weight.len())
        .flat_map(|row| {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / row.len() as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            row.iter().zip(weight).map(move |(&v, &w)| (v as f64 * inv * w as f64) as f32)
        })
        .collect()
}

/// SwiGLU from a fused `[rows, 2 * inter]` gate/up output, in f64.
pub fn silu_mul(gate_up: &[f32], inter: usize) -> Vec<f32> {
    gate_up
        .chunks_exact(2 * inter)
        .flat_map(|row| {
            (0..inter).map(move |i| {
                let (g, u) = (row[i] as f64, row[inter + i] as f64);
                (g / (1.0 + (-g).exp()) * u) as f32
            })
        })
        .collect()
}

/// GeGLU (GELU's tanh form, as PyTorch's `gelu(approximate="tanh")`)
/// from a fused `[rows, 2 * inter]` gate/up output, in f64.
pub fn gelu_tanh_mul(gate_up: &[f32], inter: usize) -> Vec<f32> {
    gate_up
        .chunks_exact(2 * inter)
        .flat_map(|row| {
            (0..inter).map(move |i| {
                let (g, u) = (row[i] as f64, row[inter + i] as f64);
                let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                (0.5 * g * (1.0 + inner.tanh()) * u) as f32
            })
        })
        .collect()
}

/// gpt-oss's clamped SwiGLU from a fused `[rows, 2 * inter]` gate/up
/// output, in f64: `(clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g)`,
/// `g = min(gate, limit)`.
pub fn clamped_swiglu_mul(gate_up: &[f32], inter: usize, limit: f32) -> Vec<f32> {
    let limit = limit as f64;
    gate_up
        .chunks_exact(2 * inter)
        .flat_map(|row| {
            (0..inter).map(move |i| {
                let (g, u) = ((row[i] as f64).min(limit), (row[inter + i] as f64).clamp(-limit, limit));
                ((u + 1.0) * g / (1.0 + (-1.702 * g).exp())) as f32
            })
        })
        .collect()
}

/// Rotary embedding of heads `0..heads` of each `row_len` row, HF's
/// `rotate_half` form over each head's first `2 * inv_freq.len()` dims (the
/// rest pass through), angles computed from `inv_freq` (not from tables), in
/// f64; with `head_norm = Some((q_heads, q_weight, k_weight, eps))` each head
/// is RMS-normalised first.
pub fn rope(
    x: &[f32],
    row_len: usize,
    heads: usize,
    head_dim: usize,
    positions: &[u32],
    inv_freq: &[f64],
    head_norm: Option<(usize, &[f32], &[f32], f64)>,
) -> Vec<f32> {
    let half = inv_freq.len();
    let mut out = x.to_vec();
    for (row, &pos) in out.chunks_exact_mut(row_len).zip(positions) {
        for h in 0..heads {
            let head: Vec<f64> = row[h * head_dim..][..head_dim].iter().map(|&v| v as f64).collect();
            let head: Vec<f64> = match head_norm {
                Some((q_heads, qw, kw, eps)) => {
                    let w = if h < q_heads { qw } else { kw };
                    let ms = head.iter().map(|v| v * v).sum::<f64>() / head_dim as f64;
                    head.iter().zip(w).map(|(v, &w)| v / (ms + eps).sqrt() * w as f64).collect()
                }
                None => head,
            };
            for (i, v) in head.iter().enumerate().skip(2 * half) {
                row[h * head_dim + i] = *v as f32;
            }
            for i in 0..half {
                let angle = pos as f64 * inv_freq[i];
                let (c, s) = (angle.cos(), angle.sin());
                row[h * head_dim + i] = (head[i] * c - head[half + i] * s) as f32;
                row[h * head_dim + half + i] = (head[half + i] * c + head[i] * s) as f32;
            }
        }
    }
    out
}

/// A mixture of experts' linear half, one token and one expert at a time
/// in f64: `out[t] = sum over t's chosen experts e, ascending, of
/// w(t, e) * (W_e x_t)`, with `experts[e]: [out, in]` row-major,
/// `choices`/`weights` token-major, `per_token` each.
pub fn moe_linear(
    x: &[f32],
    (out, inp): (usize, usize),
    experts: &[Vec<f32>],
    per_token: usize,
    choices: &[u32],
    weights: &[f32],
) -> Vec<f32> {
    let mut y = vec![0f64; choices.len() / per_token * out];
    for (t, (chosen, w)) in choices.chunks_exact(per_token).zip(weights.chunks_exact(per_token)).enumerate() {
        let xt = &x[t * inp..][..inp];
        let mut order: Vec<usize> = (0..per_token).collect();
        order.sort_by_key(|&i| chosen[i]);
        for i in order {
            let we = &experts[chosen[i] as usize];
            for (o, yo) in y[t * out..][..out].iter_mut().enumerate() {
                let dot: f64 = we[o * inp..][..inp].iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                *yo += w[i] as f64 * dot;
            }
        }
    }
    y.into_iter().map(|v| v as f32).collect()
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::AttentionMetadata;

    /// One head, head_dim 1, worked by hand: the second query (position 1)
    /// sees keys 1 and 2 with weights e^1 and e^2 (scale 1, q = 1).
    #[test]
    fn tiny_case_by_hand() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::new(&[[[1f32]], [[1.]]], &dev)?; // [2, 1, 1]
        // Two blocks of 2 slots, the sequence uses block 1 then block 0.
        let k = Tensor::new(&[[[[5f32]], [[9.]]], [[[1.]], [[2.]]]], &dev)?;
        let v = Tensor::new(&[[[[7f32]], [[9.]]], [[[10.]], [[20.]]]], &dev)?;
        let meta = AttentionMetadata {
            query_start_loc: vec![0, 2],
            context_lens: vec![2],
            block_tables: vec![vec![1]],
            slot_mapping: vec![2, 3],
            block_size: 2,
            sliding_window: None,
        };
        let mut a = Attention { q: &q, k_cache: &k, v_cache: &v, meta: &meta, scale: 1.0, sinks: None };
        let out: Vec<f32> = paged_attention(&a)?.flatten_all()?.to_vec1()?;
        let (e1, e2) = (1f32.exp(), 2f32.exp());
        let want = [10., (e1 * 10. + e2 * 20.) / (e1 + e2)];
        assert!(out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-5), "{out:?}");
        // A window of 1 leaves each query only itself.
        let windowed = AttentionMetadata { sliding_window: Some(1), ..meta.clone() };
        a.meta = &windowed;
        let out: Vec<f32> = paged_attention(&a)?.flatten_all()?.to_vec1()?;
        assert_eq!(out, [10., 20.]);
        Ok(())
    }
}
