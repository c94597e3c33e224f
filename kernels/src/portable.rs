//! Paged attention from candle ops only, so it runs on any candle device
//! (Metal included): per sequence, gather its K/V rows through the block
//! table, then masked softmax(q k^T) v with batched matmuls (a head's sink
//! logit, where given, joining the softmax). Computes in f32.
//! A float cache may be narrower than the queries (f16: widened as it is
//! gathered, narrowed as it is written); q8_0 caches are CPU-only.

use candle_core::{D, DType, Tensor};

use crate::{Attention, CacheWrite, KernelError, Result};

pub fn paged_attention(a: &Attention) -> Result<Tensor> {
    let Attention { q, k_cache, v_cache, meta, scale, sinks } = *a;
    let d = a.check()?;
    refuse_q8(k_cache)?;
    let device = q.device();
    let group = d.group();
    let slots = d.num_blocks * d.block_size;
    // The pools as rows of slots: [num_slots, kv_heads, head_dim].
    let k_rows = k_cache.reshape((slots, d.num_kv_heads, d.head_dim))?;
    let v_rows = v_cache.reshape((slots, d.num_kv_heads, d.head_dim))?;
    let mut outs = Vec::with_capacity(meta.num_seqs());
    for s in 0..meta.num_seqs() {
        let rows = meta.query_range(s);
        let (q_len, ctx) = (rows.len(), meta.context_lens[s] as usize);
        if q_len == 0 {
            continue;
        }
        let table = &meta.block_tables[s];
        let slot_ids: Vec<u32> =
            (0..ctx).map(|p| table[p / d.block_size] * d.block_size as u32 + (p % d.block_size) as u32).collect();
        let index = Tensor::from_vec(slot_ids, ctx, device)?;
        // [kv_heads, ctx, head_dim]
        let k = k_rows.index_select(&index, 0)?.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?;
        let v = v_rows.index_select(&index, 0)?.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?;
        // q: [q_len, heads, hd] -> [kv_heads, group * q_len, hd]; row r = j * q_len + i.
        let qs = q.narrow(0, rows.start, q_len)?.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?;
        let qs = qs.reshape((d.num_kv_heads, group * q_len, d.head_dim))?;
        let scores = (qs.matmul(&k.t()?)? * scale as f64)?; // [kv_heads, group * q_len, ctx]
        // Causal (and window) mask, the same for every head.
        let first_pos = ctx - q_len;
        let mut mask = Vec::with_capacity(group * q_len * ctx);
        for _ in 0..group {
            for i in 0..q_len {
                mask.extend((0..ctx).map(|p| if meta.visible(first_pos + i, p) { 0f32 } else { f32::NEG_INFINITY }));
            }
        }
        let mask = Tensor::from_vec(mask, (1, group * q_len, ctx), device)?;
        let scores = scores.broadcast_add(&mask)?;
        let max = scores.max_keepdim(D::Minus1)?; // [kv_heads, group * q_len, 1]
        let probs = match sinks {
            None => {
                let exp = scores.broadcast_sub(&max)?.exp()?;
                exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?
            }
            // Each row's head's sink joins the softmax; its share is dropped.
            Some(sinks) => {
                let column: Vec<f32> =
                    (0..d.num_kv_heads * group).flat_map(|head| std::iter::repeat_n(sinks[head], q_len)).collect();
                let sink = Tensor::from_vec(column, (d.num_kv_heads, group * q_len, 1), device)?;
                let max = max.maximum(&sink)?;
                let exp = scores.broadcast_sub(&max)?.exp()?;
                let total = (exp.sum_keepdim(D::Minus1)? + (sink - &max)?.exp()?)?;
                exp.broadcast_div(&total)?
            }
        };
        let out = probs.matmul(&v)?; // [kv_heads, group * q_len, hd]
        let out = out.reshape((d.num_heads, q_len, d.head_dim))?.transpose(0, 1)?; // [q_len, heads, hd]
        outs.push(out);
    }
    if outs.is_empty() {
        return Ok(Tensor::zeros((0, d.num_heads, d.head_dim), q.dtype(), device)?);
    }
    Ok(Tensor::cat(&outs, 0)?.to_dtype(q.dtype())?.contiguous()?)
}

/// One in-place scatter per cache: rows of `[num_slots, kv_heads * head_dim]`.
pub fn reshape_and_cache(w: &CacheWrite) -> Result<()> {
    let CacheWrite { k, v, k_cache, v_cache, slot_mapping } = *w;
    let num_slots = w.check()?;
    refuse_q8(k_cache)?;
    let (t, kvh, hd) = k.dims3()?;
    if t == 0 {
        return Ok(());
    }
    let width = kvh * hd;
    let index = Tensor::from_slice(slot_mapping, (t, 1), k.device())?.broadcast_as((t, width))?.contiguous()?;
    for (new, cache) in [(k, k_cache), (v, v_cache)] {
        // A reshape of the contiguous pool shares its storage, so the
        // scatter lands in the pool itself.
        let rows = cache.reshape((num_slots, width))?;
        rows.scatter_set(&index, &new.reshape((t, width))?.to_dtype(cache.dtype())?.contiguous()?, 0)?;
    }
    Ok(())
}

fn refuse_q8(cache: &Tensor) -> Result<()> {
    if cache.dtype() == DType::U8 {
        return Err(KernelError::Invalid(format!(
            "a q8_0 KV cache runs on the CPU only, not on {:?}",
            cache.device().location()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The in-place write relies on a reshape of a contiguous tensor sharing
    /// its storage; if candle ever copied there, the write would be lost.
    #[test]
    fn scatter_through_a_reshaped_view_lands_in_the_pool() -> Result<()> {
        let pool = Tensor::zeros((2, 2, 1, 3), DType::F32, &Device::Cpu)?; // 4 slots of 3
        let k = Tensor::new(&[[[1f32, 2., 3.]]], &Device::Cpu)?;
        reshape_and_cache(&CacheWrite { k: &k, v: &k, k_cache: &pool, v_cache: &pool.copy()?, slot_mapping: &[2] })?;
        let all: Vec<f32> = pool.flatten_all()?.to_vec1()?;
        assert_eq!(all, [0., 0., 0., 0., 0., 0., 1., 2., 3., 0., 0., 0.]);
        Ok(())
    }
}
