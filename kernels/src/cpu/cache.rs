//! The KV write on the CPU: copies each new token's K (or V) row straight
//! into its slot of the pool, in place, one op per tensor per layer.

use candle_core::{CpuStorage, InplaceOp2, Layout};

use crate::{CacheWrite, Result};

struct WriteSlots<'a> {
    slots: &'a [u32],
    /// Elements per slot: kv_heads * head_dim.
    row: usize,
}

fn copy_rows<T: Copy>(
    dst: &mut [T],
    dst_layout: &Layout,
    src: &[T],
    src_layout: &Layout,
    op: &WriteSlots,
) -> candle_core::Result<()> {
    let (Some((d0, d1)), Some((s0, s1))) = (dst_layout.contiguous_offsets(), src_layout.contiguous_offsets()) else {
        candle_core::bail!("reshape_and_cache needs contiguous tensors");
    };
    let (dst, src) = (&mut dst[d0..d1], &src[s0..s1]);
    for (t, &slot) in op.slots.iter().enumerate() {
        dst[slot as usize * op.row..][..op.row].copy_from_slice(&src[t * op.row..][..op.row]);
    }
    Ok(())
}

impl InplaceOp2 for WriteSlots<'_> {
    fn name(&self) -> &'static str {
        "reshape-and-cache"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> candle_core::Result<()> {
        match (dst, src) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => copy_rows(d, dl, s, sl, self),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => copy_rows(d, dl, s, sl, self),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => copy_rows(d, dl, s, sl, self),
            _ => candle_core::bail!("reshape_and_cache: unsupported or mismatched dtypes"),
        }
    }
}

pub fn reshape_and_cache(w: &CacheWrite) -> Result<()> {
    let CacheWrite { k, v, k_cache, v_cache, slot_mapping } = *w;
    w.check()?;
    let (_, kvh, hd) = k.dims3()?;
    let op = WriteSlots { slots: slot_mapping, row: kvh * hd };
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
