//! The KV write on the CPU: each new token's K (or V) row goes straight
//! into its slot of the pool, in place, one op per tensor per layer: copied
//! into a cache of its own dtype, narrowed into an f16 one, or quantized
//! per head vector into a q8_0 one ([`crate::kv_dtype::quantize_q8_row`]).

use candle_core::{CpuStorage, InplaceOp2, Layout};

use crate::kv_dtype::{Q8_PARAM_BYTES, quantize_q8_row};
use crate::{CacheWrite, Result};

struct WriteSlots<'a> {
    slots: &'a [u32],
    /// Values per slot: kv_heads * head_dim.
    row: usize,
    head_dim: usize,
}

fn contiguous<'a, T>(data: &'a [T], layout: &Layout) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("reshape_and_cache needs contiguous tensors"),
    }
}

/// Writes row t of `src` (`op.row` values) into slot `slots[t]` of `dst`
/// (`dst_row` units per slot) with `put`.
fn write_rows<S, D>(
    dst: &mut [D],
    dst_layout: &Layout,
    src: &[S],
    src_layout: &Layout,
    op: &WriteSlots,
    dst_row: usize,
    put: impl Fn(&[S], &mut [D]),
) -> candle_core::Result<()> {
    let src = contiguous(src, src_layout)?;
    let Some((d0, d1)) = dst_layout.contiguous_offsets() else {
        candle_core::bail!("reshape_and_cache needs contiguous tensors");
    };
    let dst = &mut dst[d0..d1];
    for (t, &slot) in op.slots.iter().enumerate() {
        put(&src[t * op.row..][..op.row], &mut dst[slot as usize * dst_row..][..dst_row]);
    }
    Ok(())
}

fn copy<T: Copy>(s: &[T], d: &mut [T]) {
    d.copy_from_slice(s);
}

impl InplaceOp2 for WriteSlots<'_> {
    fn name(&self) -> &'static str {
        "reshape-and-cache"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> candle_core::Result<()> {
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => write_rows(d, dl, s, sl, self, self.row, copy),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => write_rows(d, dl, s, sl, self, self.row, copy),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => write_rows(d, dl, s, sl, self, self.row, copy),
            (CpuStorage::F16(d), CpuStorage::F32(s)) => write_rows(d, dl, s, sl, self, self.row, |s, d| {
                use half::slice::HalfFloatSliceExt;
                d.convert_from_f32_slice(s)
            }),
            (CpuStorage::U8(d), CpuStorage::F32(s)) => {
                let (hd, q_row) = (self.head_dim, self.head_dim + Q8_PARAM_BYTES);
                let dst_row = self.row / hd * q_row;
                write_rows(d, dl, s, sl, self, dst_row, |s, d| {
                    for (x, out) in s.chunks_exact(hd).zip(d.chunks_exact_mut(q_row)) {
                        quantize_q8_row(x, out);
                    }
                })
            }
            _ => candle_core::bail!("reshape_and_cache: unsupported or mismatched dtypes"),
        }
    }
}

pub fn reshape_and_cache(w: &CacheWrite) -> Result<()> {
    let CacheWrite { k, v, k_cache, v_cache, slot_mapping } = *w;
    w.check()?;
    let (_, kvh, hd) = k.dims3()?;
    let op = WriteSlots { slots: slot_mapping, row: kvh * hd, head_dim: hd };
    k_cache.inplace_op2(&k.contiguous()?, &op)?;
    v_cache.inplace_op2(&v.contiguous()?, &op)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;

    /// The pool may start partway into its storage; writes must honour that
    /// offset and touch nothing else.
    #[test]
    fn writes_at_the_layout_offset() -> Result<()> {
        let storage = Tensor::zeros((3, 2, 1, 2), DType::F32, &Device::Cpu)?; // 3 blocks of 2 slots
        let pool = storage.narrow(0, 1, 2)?; // blocks 1 and 2 of the storage
        let k = Tensor::new(&[[[1f32, 2.]], [[3., 4.]]], &Device::Cpu)?; // [2 tokens, 1 kv head, 2]
        reshape_and_cache(&CacheWrite { k: &k, v: &k, k_cache: &pool, v_cache: &pool.copy()?, slot_mapping: &[3, 0] })?;
        let all: Vec<f32> = storage.flatten_all()?.to_vec1()?;
        // Slot 0 of the pool is storage slot 2, slot 3 is storage slot 5.
        assert_eq!(all, [0., 0., 0., 0., 3., 4., 0., 0., 0., 0., 1., 2.]);
        Ok(())
    }
}
