//! A linear layer (`y = x W^T + b`, weights `[out, in]` as Hugging Face
//! stores them) that streams its weight through our CPU kernel
//! (`kernels::cpu::matmul`): multi-threaded, SIMD, f16/bf16 widened in
//! registers. candle's own CPU matmul uses one core at m = 1, widens bf16
//! weights to a fresh f32 copy on every call, and is very slow for f16
//! with a transposed weight at m > 1. Activations go through the kernel in
//! f32. Other devices, and large f32 batches (where candle's GEMM is
//! good), use candle's matmul. On x86 with AVX2, f16 and bf16 weights are
//! packed in panels at load time (`kernels::cpu::packed`; [`Linear::pack`]):
//! every batch size then streams them as one linear stream per task.
//! Weights in GGML's block formats (Q8_0, Q4_0, and from GGUF files the
//! k-quants Q4_K and Q6_K and MXFP4; see [`super::quant`]) run on the int8 kernels. [`Weight`] names every representation.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Module, Storage, Tensor};
use half::{bf16, f16};
use kernels::cpu::kquant::{BlockQ4K, BlockQ6K, KPanels, QK_K, matmul_kpanels};
use kernels::cpu::matmul::{WeightElem, matmul_xwt};
use kernels::cpu::packed::{PackError, PackedWeight, matmul_packed};
use kernels::cpu::q8_panel::{PanelQ8_0, matmul_panel_q8_0};
use kernels::cpu::quant::{BlockMxfp4, BlockQ4_0, PackedQ8_0, QK, matmul_packed_q8_0, matmul_quant};
use kernels::cpu::{back_with_huge_pages, read_f32, write_f32};

use super::format::Quantization;

/// Above this many rows f32 weights go to candle's blocked GEMM.
const F32_KERNEL_MAX_ROWS: usize = 16;

/// A linear layer's `[out, in]` weight, in exactly one representation:
/// packing or quantizing replaces the row-major tensor, so its memory goes.
#[derive(Debug)]
pub enum Weight {
    /// Row-major in the checkpoint's dtype, on any device: candle's matmul,
    /// or on the CPU our row-major kernel.
    Dense(Tensor),
    /// f16 in panels for the AVX2 kernels (`kernels::cpu::packed`).
    PackedF16(PackedWeight<f16>),
    /// bf16 in panels, widened exactly in registers.
    PackedBf16(PackedWeight<bf16>),
    /// GGML's Q8_0 with 4 rows' codes together, scales apart.
    Q8_0(PackedQ8_0),
    /// GGML's Q8_0 in 16-row panels for AVX-512 VNNI.
    Q8_0Panels(PanelQ8_0),
    /// GGML's Q4_0 in its row-major blocks: `out` rows of `inp / 32`.
    Q4_0 { blocks: Vec<BlockQ4_0>, out: usize, inp: usize },
    /// MXFP4 in GGML's row-major blocks: `out` rows of `inp / 32`.
    Mxfp4 { blocks: Vec<BlockMxfp4>, out: usize, inp: usize },
    /// GGML's Q4_K super-blocks in 16-row panels for the int8 kernels.
    Q4K(KPanels<BlockQ4K>),
    /// GGML's Q6_K super-blocks in 16-row panels.
    Q6K(KPanels<BlockQ6K>),
}

impl Weight {
    /// `[out, in]`.
    pub fn dims(&self) -> candle_core::Result<(usize, usize)> {
        Ok(match self {
            Self::Dense(w) => w.dims2()?,
            Self::PackedF16(w) => w.dims(),
            Self::PackedBf16(w) => w.dims(),
            Self::Q8_0(w) => (w.dims().0, w.dims().1 * QK),
            Self::Q8_0Panels(w) => (w.dims().0, w.dims().1 * QK),
            Self::Q4_0 { out, inp, .. } | Self::Mxfp4 { out, inp, .. } => (*out, *inp),
            Self::Q4K(w) => (w.dims().0, w.dims().1 * QK_K),
            Self::Q6K(w) => (w.dims().0, w.dims().1 * QK_K),
        })
    }

    /// Bytes of weight streamed by one pass.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Self::PackedF16(w) => w.size_in_bytes(),
            Self::PackedBf16(w) => w.size_in_bytes(),
            Self::Q8_0(w) => w.size_in_bytes(),
            Self::Q8_0Panels(w) => w.size_in_bytes(),
            Self::Q4_0 { blocks, .. } => std::mem::size_of_val(blocks.as_slice()),
            Self::Mxfp4 { blocks, .. } => std::mem::size_of_val(blocks.as_slice()),
            Self::Q4K(w) => w.size_in_bytes(),
            Self::Q6K(w) => w.size_in_bytes(),
        }
    }

    /// The weight `[out, in]` in f32, row-major (to quantize it).
    fn to_f32(&self) -> candle_core::Result<Vec<f32>> {
        fn widen<W: WeightElem>(w: &PackedWeight<W>) -> Vec<f32> {
            w.unpack().into_iter().map(W::to_f32).collect()
        }
        match self {
            Self::Dense(w) => w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>(),
            Self::PackedF16(w) => Ok(widen(w)),
            Self::PackedBf16(w) => Ok(widen(w)),
            _ => candle_core::bail!("linear: the weight is quantized already"),
        }
    }

    /// `y = x W^T (+ bias)` through our CPU kernels, `x: [m, in]`, `y: [m, out]`.
    fn matmul(&self, x: &[f32], m: usize, bias: Option<&[f32]>, y: &mut [f32]) -> candle_core::Result<()> {
        let pack_err = |e: PackError| candle_core::Error::Msg(e.to_string());
        let quant_err = |e: kernels::cpu::quant::QuantError| candle_core::Error::Msg(e.to_string());
        let out = match self {
            Self::Dense(w) => return dense_matmul(w, x, m, bias, y),
            Self::PackedF16(w) => return matmul_packed(x, m, w, bias, y).map_err(pack_err),
            Self::PackedBf16(w) => return matmul_packed(x, m, w, bias, y).map_err(pack_err),
            Self::Q8_0(w) => matmul_packed_q8_0(x, m, w, y).map(|()| w.dims().0),
            Self::Q8_0Panels(w) => matmul_panel_q8_0(x, m, w, y).map(|()| w.dims().0),
            Self::Q4_0 { blocks, out, inp } => matmul_quant(x, m, *inp, blocks, *out, y).map(|()| *out),
            Self::Mxfp4 { blocks, out, inp } => matmul_quant(x, m, *inp, blocks, *out, y).map(|()| *out),
            Self::Q4K(w) => matmul_kpanels(x, m, w, y).map(|()| w.dims().0),
            Self::Q6K(w) => matmul_kpanels(x, m, w, y).map(|()| w.dims().0),
        }
        .map_err(quant_err)?;
        // The block kernels take no bias.
        if let Some(b) = bias {
            y.chunks_exact_mut(out).for_each(|row| row.iter_mut().zip(b).for_each(|(v, b)| *v += b));
        }
        Ok(())
    }

    /// Backs the weight with huge pages (CPU only; see
    /// `kernels::cpu::back_with_huge_pages`): streaming it then costs fewer page walks.
    fn place_in_huge_pages(&self) {
        match self {
            Self::Dense(w) => {
                let (storage, layout) = w.storage_and_layout();
                let Some((a, b)) = layout.contiguous_offsets() else { return };
                match &*storage {
                    Storage::Cpu(CpuStorage::F32(w)) => back_with_huge_pages(&w[a..b]),
                    Storage::Cpu(CpuStorage::F16(w)) => back_with_huge_pages(&w[a..b]),
                    Storage::Cpu(CpuStorage::BF16(w)) => back_with_huge_pages(&w[a..b]),
                    _ => {}
                }
            }
            Self::PackedF16(w) => back_with_huge_pages(w.allocation()),
            Self::PackedBf16(w) => back_with_huge_pages(w.allocation()),
            Self::Q8_0(w) => {
                let (codes, scales) = w.arrays();
                back_with_huge_pages(codes);
                back_with_huge_pages(scales);
            }
            Self::Q8_0Panels(w) => {
                // Padding included: allocated whole 2 MiB pages.
                let (codes, scales) = w.allocations();
                back_with_huge_pages(codes);
                back_with_huge_pages(scales);
            }
            Self::Q4_0 { blocks, .. } => back_with_huge_pages(blocks),
            Self::Mxfp4 { blocks, .. } => back_with_huge_pages(blocks),
            Self::Q4K(w) => back_with_huge_pages(w.allocation()),
            Self::Q6K(w) => back_with_huge_pages(w.allocation()),
        }
    }
}

/// `y = x W^T + b` for a row-major weight on the CPU.
fn dense_matmul(w: &Tensor, x: &[f32], m: usize, bias: Option<&[f32]>, y: &mut [f32]) -> candle_core::Result<()> {
    let (n, k) = w.dims2()?;
    let (ws, wl) = w.storage_and_layout();
    let Some((w0, w1)) = wl.contiguous_offsets() else { candle_core::bail!("linear: weight must be contiguous") };
    match &*ws {
        Storage::Cpu(CpuStorage::F32(w)) => matmul_xwt(x, m, k, &w[w0..w1], n, bias, y),
        Storage::Cpu(CpuStorage::F16(w)) => matmul_xwt::<f16>(x, m, k, &w[w0..w1], n, bias, y),
        Storage::Cpu(CpuStorage::BF16(w)) => matmul_xwt::<bf16>(x, m, k, &w[w0..w1], n, bias, y),
        _ => candle_core::bail!("linear: unsupported weight dtype {:?}", w.dtype()),
    }
    Ok(())
}

#[derive(Debug)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>, // [out]
    /// The bias in f32 on the host, for our kernels.
    bias_f32: Option<Vec<f32>>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> candle_core::Result<Self> {
        Self::from_weight(Weight::Dense(weight.contiguous()?), bias)
    }

    /// `[out, in]` of its weight.
    pub fn dims(&self) -> candle_core::Result<(usize, usize)> {
        self.weight.dims()
    }

    /// A linear layer over a weight in any representation (quantized ones
    /// come from GGUF files).
    pub fn from_weight(weight: Weight, bias: Option<Tensor>) -> candle_core::Result<Self> {
        let bias_f32 = match &bias {
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(Self { weight, bias, bias_f32 })
    }

    /// The row-major weight, unless it was packed or quantized.
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match &self.weight {
            Weight::Dense(w) => Some(w),
            _ => None,
        }
    }

    /// Packs an f16 or bf16 weight on the CPU in panels for the AVX2
    /// kernels, where they pay (`kernels::cpu::packed::packing_pays`), in
    /// place of the row-major one. Returns whether it did.
    pub fn pack(&mut self) -> candle_core::Result<bool> {
        let Weight::Dense(w) = &self.weight else { return Ok(false) };
        if !kernels::cpu::packed::packing_pays() || !w.device().is_cpu() {
            return Ok(false);
        }
        let (n, k) = w.dims2()?;
        let packed = {
            let (storage, layout) = w.storage_and_layout();
            let Some((a, b)) = layout.contiguous_offsets() else { return Ok(false) };
            let err = |e: PackError| candle_core::Error::Msg(e.to_string());
            match &*storage {
                Storage::Cpu(CpuStorage::F16(w)) => Weight::PackedF16(PackedWeight::pack(&w[a..b], n, k).map_err(err)?),
                Storage::Cpu(CpuStorage::BF16(w)) => {
                    Weight::PackedBf16(PackedWeight::pack(&w[a..b], n, k).map_err(err)?)
                }
                _ => return Ok(false),
            }
        };
        self.weight = packed;
        Ok(true)
    }

    /// Backs the weight with huge pages (see [`Weight`]'s `place_in_huge_pages`).
    pub fn place_in_huge_pages(&self) {
        self.weight.place_in_huge_pages();
    }

    /// Stacks layers that read the same input into one whose rows are
    /// theirs in order (`[out_a + out_b + …, in]`): one kernel call and one
    /// pass over (and one quantization of) the activations instead of
    /// several. Gives the parts back when their weights cannot be stacked
    /// (different formats or dtypes).
    pub fn stack(parts: Vec<Linear>) -> candle_core::Result<std::result::Result<Linear, Vec<Linear>>> {
        if parts.len() < 2 {
            return Ok(Err(parts));
        }
        let weights: Vec<&Weight> = parts.iter().map(|p| &p.weight).collect();
        // Layers stack as they load: row-major or quantized, never packed yet.
        let stacked = match Weight::stack_quantized(&weights)? {
            Some(q) => q,
            None => match stack_dense(&weights)? {
                Some(w) => Weight::Dense(w),
                None => return Ok(Err(parts)),
            },
        };
        // A part without a bias gets zeros, so the stacked bias lines up.
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            let like = parts.iter().find_map(|p| p.bias.as_ref()).map(|b| (b.dtype(), b.device().clone()));
            let (dtype, device) = like.unwrap_or((DType::F32, candle_core::Device::Cpu));
            let pieces = parts
                .iter()
                .map(|p| match &p.bias {
                    Some(b) => Ok(b.clone()),
                    None => Tensor::zeros(p.out_features()?, dtype, &device),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&pieces, 0)?)
        } else {
            None
        };
        Ok(Ok(Linear::from_weight(stacked, bias)?))
    }

    /// Bytes of weight (and bias) read by one pass over the layer.
    pub fn size_in_bytes(&self) -> usize {
        self.weight.size_in_bytes() + self.bias.as_ref().map_or(0, |b| b.elem_count() * b.dtype().size_in_bytes())
    }

    /// Columns of the weight: the width of the input.
    fn in_features(&self) -> candle_core::Result<usize> {
        Ok(self.weight.dims()?.1)
    }

    /// Rows of the weight: the width of the output.
    pub fn out_features(&self) -> candle_core::Result<usize> {
        Ok(self.weight.dims()?.0)
    }

    fn check_input(&self, k: usize) -> candle_core::Result<()> {
        let inp = self.in_features()?;
        if k != inp {
            candle_core::bail!("linear: input has {k} features, the weight takes {inp}");
        }
        Ok(())
    }

    /// Replaces the weight by its quantization in a block format (GGML's:
    /// i8 or 4-bit codes, one f16 scale per 32), if it lives on the CPU and
    /// its input dimension is a multiple of 32. Returns whether it did.
    pub fn quantize(&mut self, format: Quantization) -> candle_core::Result<bool> {
        if self.weight.block_format().is_some() {
            return Ok(false);
        }
        let (out, inp) = self.weight.dims()?;
        let on_cpu = match &self.weight {
            Weight::Dense(w) => w.device().is_cpu(),
            _ => true,
        };
        if !on_cpu || !inp.is_multiple_of(QK) {
            return Ok(false);
        }
        self.weight = Weight::quantize(format, &self.weight.to_f32()?, out, inp)?;
        Ok(true)
    }

    fn candle_forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let Weight::Dense(w) = &self.weight else {
            candle_core::bail!("linear: only a row-major weight runs in candle")
        };
        let y = x.matmul(&w.t()?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// x: [m, in] -> [m, out] through our kernels.
    fn kernel_forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, k) = x.dims2()?;
        self.check_input(k)?;
        let n = self.out_features()?;
        let x32 = x.to_dtype(DType::F32)?.contiguous()?;
        let mut y = vec![0f32; m * n];
        read_f32(&x32, |xv| self.weight.matmul(xv, m, self.bias_f32.as_deref(), &mut y))?;
        Tensor::from_vec(y, (m, n), x.device())?.to_dtype(x.dtype())
    }

    /// `out = x W^T + b` for f32 CPU tensors `x: [m, in]` and `out: [m,
    /// out]` (a view of a reused buffer, not sharing storage with `x`):
    /// the kernels write straight into it. Large f32 batches, which go to
    /// candle's GEMM, are computed apart and copied in.
    pub fn forward_into(&self, x: &Tensor, out: &Tensor) -> candle_core::Result<()> {
        let _t = crate::profile::scope(crate::profile::Section::Matmul);
        let (m, k) = x.dims2()?;
        let n = self.out_features()?;
        if out.dims2()? != (m, n) {
            candle_core::bail!("linear: [{m}, {k}] input into a {:?} output, weight has {n} rows", out.dims());
        }
        self.check_input(k)?;
        if self.uses_kernel(x) {
            let bias = self.bias_f32.as_deref();
            return read_f32(x, |xv| write_f32(out, &|y| self.weight.matmul(xv, m, bias, y)));
        }
        kernels::cpu::copy_columns(&self.candle_forward(x)?.to_dtype(DType::F32)?.contiguous()?, 0, out)
    }

    /// Whether `x` goes through our kernels: packed and quantized weights
    /// always (they have no other path), row-major ones on the CPU for 2-D x.
    fn uses_kernel(&self, x: &Tensor) -> bool {
        let Weight::Dense(w) = &self.weight else { return true };
        let rows = x.dims().iter().rev().skip(1).product::<usize>();
        x.device().is_cpu()
            && x.rank() == 2
            && (w.dtype() != DType::F32 || rows <= F32_KERNEL_MAX_ROWS)
            && matches!(w.dtype(), DType::F32 | DType::F16 | DType::BF16)
    }
}

/// Row-major weights of one dtype, device and width, their rows one after
/// another; `None` for other weights.
fn stack_dense(parts: &[&Weight]) -> candle_core::Result<Option<Tensor>> {
    let mut tensors = Vec::with_capacity(parts.len());
    for p in parts {
        let Weight::Dense(w) = p else { return Ok(None) };
        if let Some(first) = tensors.first().copied() {
            let same = |t: &Tensor| (t.dtype(), t.dims2().ok().map(|d| d.1));
            if same(w) != same(first) || !w.device().same_device(first.device()) {
                return Ok(None);
            }
        }
        tensors.push(w);
    }
    Ok(Some(Tensor::cat(&tensors, 0)?))
}

/// `[out, in]` weight (and `[out]` bias) under `vb`, as HF names them; a
/// weight in `pre` (already quantized) is taken from there.
pub fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: candle_nn::VarBuilder,
    pre: &Prequantized,
) -> candle_core::Result<Linear> {
    let bias = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
    let name = format!("{}.weight", vb.prefix());
    if let Some(q) = pre.take(&name) {
        if q.dims()? != (out_dim, in_dim) {
            candle_core::bail!("{name}: quantized weight is {:?}, expected [{out_dim}, {in_dim}]", q.dims()?);
        }
        return Linear::from_weight(q, bias);
    }
    Linear::new(vb.get((out_dim, in_dim), "weight")?, bias)
}

/// An expert of a mixture, for the grouped kernels (`kernels::cpu::moe`):
/// the same kernels as [`Linear::forward_into`], on slices.
impl kernels::cpu::moe::ExpertLinear for Linear {
    fn dims(&self) -> (usize, usize) {
        self.weight.dims().unwrap_or((0, 0))
    }

    fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) -> kernels::Result<()> {
        Ok(self.weight.matmul(x, m, self.bias_f32.as_deref(), y)?)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let _t = crate::profile::scope(crate::profile::Section::Matmul);
        if self.uses_kernel(x) { self.kernel_forward(x) } else { self.candle_forward(x) }
    }
}

/// Weights that arrive already quantized (from a GGUF file), by HF tensor
/// name; [`linear`] takes its weight from here when present.
#[derive(Debug, Default)]
pub struct Prequantized(Mutex<HashMap<String, Weight>>);

impl Prequantized {
    pub fn new(weights: HashMap<String, Weight>) -> Self {
        Self(Mutex::new(weights))
    }

    pub(super) fn take(&self, name: &str) -> Option<Weight> {
        self.0.lock().ok()?.remove(name)
    }

    /// Names nobody took (a mapping bug, or tensors the model does not use).
    pub fn remaining(&self) -> Vec<String> {
        self.0.lock().map(|m| m.keys().cloned().collect()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn q8_0_linear_is_close_to_f32() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.2, (37, 64), &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, 37, &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (5, 64), &dev).unwrap();
        let exact = Linear::new(w.clone(), Some(b.clone())).unwrap().forward(&x).unwrap();
        let mut q = Linear::new(w, Some(b)).unwrap();
        assert!(q.quantize(Quantization::Q8_0).unwrap());
        assert!(q.dense_weight().is_none(), "the f32 weight is dropped");
        let got = q.forward(&x).unwrap();
        let diff: f32 = (got - &exact).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        let scale: f32 = exact.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        assert!(diff < 0.02 * scale, "{diff} vs {scale}");
        // In-features not a multiple of 32 stay unquantized.
        let mut odd = Linear::new(Tensor::zeros((3, 29), DType::F32, &dev).unwrap(), None).unwrap();
        assert!(!odd.quantize(Quantization::Q8_0).unwrap());
    }

    #[test]
    fn packed_weights_give_the_row_major_results() {
        let dev = Device::Cpu;
        for dtype in [DType::F16, DType::BF16] {
            let w = Tensor::randn(0f32, 0.2, (37, 64), &dev).unwrap().to_dtype(dtype).unwrap();
            let b = Tensor::randn(0f32, 0.2, 37, &dev).unwrap();
            let plain = Linear::new(w.clone(), Some(b.clone())).unwrap();
            let mut packed = Linear::new(w, Some(b)).unwrap();
            assert_eq!(packed.pack().unwrap(), kernels::cpu::packed::packing_pays(), "{dtype:?}");
            assert!(!packed.pack().unwrap(), "packs once");
            assert_eq!(packed.out_features().unwrap(), 37);
            for m in [1, 5, 16] {
                let x = Tensor::randn(0f32, 1.0, (m, 64), &dev).unwrap();
                let want = plain.forward(&x).unwrap();
                let got = packed.forward(&x).unwrap();
                let out = Tensor::zeros((m, 37), DType::F32, &dev).unwrap();
                packed.forward_into(&x, &out).unwrap();
                for got in [got, out] {
                    let diff: f32 = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
                    assert!(diff < 1e-4, "{dtype:?} m={m}: {diff}");
                }
            }
            // A packed weight still quantizes (from its unpacked values).
            assert!(packed.quantize(Quantization::Q8_0).unwrap());
            let x = Tensor::randn(0f32, 1.0, (3, 64), &dev).unwrap();
            let exact = plain.forward(&x).unwrap();
            let diff: f32 =
                (packed.forward(&x).unwrap() - &exact).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
            // Q8_0 rounding of x and w, relative to the outputs' scale (as in
            // `q8_0_linear_is_close_to_f32`): the draws are unseeded.
            let scale: f32 = exact.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
            assert!(diff < 0.02 * scale, "{dtype:?} q8_0 after packing: {diff} vs {scale}");
        }
    }

    #[test]
    fn kernel_and_candle_paths_agree() {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for m in [1, 3, 17, 40] {
                let w = Tensor::randn(0f32, 0.2, (37, 29), &dev).unwrap().to_dtype(dtype).unwrap();
                let b = Tensor::randn(0f32, 0.2, 37, &dev).unwrap().to_dtype(dtype).unwrap();
                let x = Tensor::randn(0f32, 1.0, (m, 29), &dev).unwrap().to_dtype(dtype).unwrap();
                let lin = Linear::new(w, Some(b)).unwrap();
                let ours = lin.kernel_forward(&x).unwrap().to_dtype(DType::F32).unwrap();
                let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let want = f32(&x)
                    .matmul(&f32(lin.dense_weight().unwrap()).t().unwrap())
                    .unwrap()
                    .broadcast_add(&f32(lin.bias.as_ref().unwrap()))
                    .unwrap();
                let diff: f32 = (ours - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
                let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
                assert!(diff < tol, "{dtype:?} m={m}: {diff}");
            }
        }
    }
}
