//! Reading and writing f32 CPU tensors as slices, so kernels can fill
//! buffers that live across steps (a model's activation workspace) instead
//! of returning fresh tensors.
//!
//! The tensors must not share storage with each other: a write holds its
//! tensor's storage lock for the duration, and reading the same storage
//! meanwhile would deadlock. Workspace buffers are separate tensors.

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

/// `f` on the elements of `t`, a contiguous f32 tensor (or view) on the CPU.
pub fn read_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> candle_core::Result<R>) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        candle_core::bail!("expected an f32 CPU tensor, got {:?} on {:?}", t.dtype(), t.device().location())
    };
    let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("expected a contiguous tensor") };
    f(&data[a..b])
}

/// `f` on the elements of `out`, a contiguous f32 tensor (or view) on the
/// CPU, in place: every tensor viewing the same storage sees the change.
pub fn write_f32(out: &Tensor, f: &dyn Fn(&mut [f32]) -> candle_core::Result<()>) -> candle_core::Result<()> {
    out.inplace_op1(&Write(f))
}

struct Write<'a>(&'a dyn Fn(&mut [f32]) -> candle_core::Result<()>);

impl InplaceOp1 for Write<'_> {
    fn name(&self) -> &'static str {
        "write-f32"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else { candle_core::bail!("write_f32: f32 tensors only") };
        let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("write_f32: not contiguous") };
        (self.0)(&mut data[a..b])
    }
}

/// Copies columns `col0..col0 + width` of `src: [rows, n]` into `dst:
/// [rows, width]` (both f32 on the CPU).
pub fn copy_columns(src: &Tensor, col0: usize, dst: &Tensor) -> candle_core::Result<()> {
    let (rows, n) = src.dims2()?;
    let (dst_rows, width) = dst.dims2()?;
    if dst_rows != rows || col0 + width > n {
        candle_core::bail!("copy_columns: [{rows}, {n}] columns {col0}.. into [{dst_rows}, {width}]");
    }
    read_f32(src, |s| {
        write_f32(dst, &|d| {
            for (d, s) in d.chunks_exact_mut(width).zip(s.chunks_exact(n)) {
                d.copy_from_slice(&s[col0..col0 + width]);
            }
            Ok(())
        })
    })
}
