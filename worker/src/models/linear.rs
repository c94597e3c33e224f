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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, DType, Module, Storage, Tensor};
use half::{bf16, f16};
use kernels::cpu::matmul::{WeightElem, matmul_xwt};
use kernels::cpu::packed::{PackedWeight, matmul_packed};
use kernels::cpu::quant::{BlockQ4_0, BlockQ8_0, PackedQ8_0, QK, matmul_packed_q8_0, matmul_quant, quantize_matrix};
use kernels::cpu::vnni::{VnniQ8_0, matmul_vnni_q8_0, vnni_available};
use kernels::cpu::{read_f32, write_f32};

use kernels::cpu::back_with_huge_pages;

/// GGML block formats a linear weight can be stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    Q8_0,
    Q4_0,
}

/// Above this many rows f32 weights go to candle's blocked GEMM.
const F32_KERNEL_MAX_ROWS: usize = 16;

#[derive(Clone, Debug)]
pub struct Linear {
    /// [out, in]; after `quantize_q8_0` a 0-element placeholder (the
    /// quantized copy replaces it, so the memory goes).
    weight: Tensor,
    bias: Option<Tensor>,
    bias_f32: Option<Vec<f32>>,
    quant: Option<Arc<QuantWeight>>,
    /// The weight packed in panels for the AVX2 kernels; `weight` is then
    /// a 0-element placeholder, as after quantization.
    packed: Option<Arc<Packed>>,
}

/// A dense weight in panels (`kernels::cpu::packed`), in its stored dtype.
#[derive(Debug)]
enum Packed {
    F16(PackedWeight<f16>),
    BF16(PackedWeight<bf16>),
}

impl Packed {
    fn dims(&self) -> (usize, usize) {
        match self {
            Self::F16(w) => w.dims(),
            Self::BF16(w) => w.dims(),
        }
    }

    fn size_in_bytes(&self) -> usize {
        match self {
            Self::F16(w) => w.size_in_bytes(),
            Self::BF16(w) => w.size_in_bytes(),
        }
    }

    /// The weight `[out, in]` back in f32.
    fn to_f32(&self) -> Vec<f32> {
        fn widen<W: WeightElem>(w: &PackedWeight<W>) -> Vec<f32> {
            w.unpack().into_iter().map(W::to_f32).collect()
        }
        match self {
            Self::F16(w) => widen(w),
            Self::BF16(w) => widen(w),
        }
    }

    fn matmul(&self, x: &[f32], m: usize, bias: Option<&[f32]>, y: &mut [f32]) -> candle_core::Result<()> {
        let r = match self {
            Self::F16(w) => matmul_packed(x, m, w, bias, y),
            Self::BF16(w) => matmul_packed(x, m, w, bias, y),
        };
        r.map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// A quantized weight: `out` rows of `inp / 32` blocks.
#[derive(Debug)]
pub struct QuantWeight {
    blocks: QuantBlocks,
    out: usize,
    inp: usize,
}

/// Q8_0 is kept regrouped for the kernel: in 16-row panels for
/// `vpdpbusd` where the CPU has AVX-512 VNNI ([`VnniQ8_0`]), else 4 rows'
/// codes together, scales apart ([`PackedQ8_0`]); Q4_0 in GGML's row-major
/// blocks.
#[derive(Clone, Debug)]
enum QuantBlocks {
    Q8_0(PackedQ8_0),
    Q8_0Vnni(VnniQ8_0),
    Q4_0(Vec<BlockQ4_0>),
}

fn pack_q8_0(blocks: &[BlockQ8_0], out: usize, inp: usize) -> candle_core::Result<QuantBlocks> {
    let err = |e: kernels::cpu::quant::QuantError| candle_core::Error::Msg(e.to_string());
    if vnni_available() {
        return Ok(QuantBlocks::Q8_0Vnni(VnniQ8_0::pack(blocks, out, inp / QK).map_err(err)?));
    }
    Ok(QuantBlocks::Q8_0(PackedQ8_0::pack(blocks, out, inp / QK).map_err(err)?))
}

impl QuantBlocks {
    /// Q8_0 weights back in GGML's row-major blocks.
    fn q8_0_rows(&self) -> Option<Vec<BlockQ8_0>> {
        match self {
            Self::Q8_0(p) => Some(p.unpack()),
            Self::Q8_0Vnni(p) => Some(p.unpack()),
            Self::Q4_0(_) => None,
        }
    }
}

impl QuantWeight {
    /// Quantizes a row-major `[out, inp]` f32 matrix.
    pub fn quantize(format: QuantFormat, w: &[f32], out: usize, inp: usize) -> candle_core::Result<Self> {
        let err = |e: kernels::cpu::quant::QuantError| candle_core::Error::Msg(e.to_string());
        let blocks = match format {
            QuantFormat::Q8_0 => pack_q8_0(&quantize_matrix::<BlockQ8_0>(w, out, inp).map_err(err)?, out, inp)?,
            QuantFormat::Q4_0 => QuantBlocks::Q4_0(quantize_matrix(w, out, inp).map_err(err)?),
        };
        Ok(Self { blocks, out, inp })
    }

    /// Blocks as stored in a file (GGUF), checked against the shape.
    pub fn from_q8_0(blocks: Vec<BlockQ8_0>, out: usize, inp: usize) -> candle_core::Result<Self> {
        Self::check(blocks.len(), out, inp)?;
        Ok(Self { blocks: pack_q8_0(&blocks, out, inp)?, out, inp })
    }

    pub fn from_q4_0(blocks: Vec<BlockQ4_0>, out: usize, inp: usize) -> candle_core::Result<Self> {
        Self::check(blocks.len(), out, inp)?;
        Ok(Self { blocks: QuantBlocks::Q4_0(blocks), out, inp })
    }

    fn check(blocks: usize, out: usize, inp: usize) -> candle_core::Result<()> {
        if !inp.is_multiple_of(QK) || blocks != out * (inp / QK) {
            candle_core::bail!("{blocks} quantized blocks do not make a [{out}, {inp}] weight");
        }
        Ok(())
    }

    pub fn format(&self) -> QuantFormat {
        match self.blocks {
            QuantBlocks::Q8_0(_) | QuantBlocks::Q8_0Vnni(_) => QuantFormat::Q8_0,
            QuantBlocks::Q4_0(_) => QuantFormat::Q4_0,
        }
    }

    /// `[out, inp]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    /// Reorders whole output rows: row `r` of the result is row `perm[r]`.
    pub fn permute_rows(&mut self, perm: &[usize]) {
        fn apply<B: Copy>(v: &mut Vec<B>, perm: &[usize], kb: usize) {
            *v = perm.iter().flat_map(|&r| v[r * kb..(r + 1) * kb].iter().copied()).collect();
        }
        let kb = self.inp / QK;
        if let Some(mut rows) = self.blocks.q8_0_rows() {
            apply(&mut rows, perm, kb);
            // Same shape as before, so packing cannot fail.
            if let Ok(repacked) = pack_q8_0(&rows, self.out, self.inp) {
                self.blocks = repacked;
            }
        } else if let QuantBlocks::Q4_0(v) = &mut self.blocks {
            apply(v, perm, kb);
        }
    }

    fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) -> candle_core::Result<()> {
        let err = |e: kernels::cpu::quant::QuantError| candle_core::Error::Msg(e.to_string());
        match &self.blocks {
            QuantBlocks::Q8_0(p) => matmul_packed_q8_0(x, m, p, y).map_err(err),
            QuantBlocks::Q8_0Vnni(p) => matmul_vnni_q8_0(x, m, p, y).map_err(err),
            QuantBlocks::Q4_0(b) => matmul_quant(x, m, self.inp, b, self.out, y).map_err(err),
        }
    }

    /// Bytes of weight streamed per token.
    pub fn size_in_bytes(&self) -> usize {
        match &self.blocks {
            QuantBlocks::Q8_0(p) => p.size_in_bytes(),
            QuantBlocks::Q8_0Vnni(p) => p.size_in_bytes(),
            QuantBlocks::Q4_0(b) => std::mem::size_of_val(b.as_slice()),
        }
    }
}

/// Weights that arrive already quantized (from a GGUF file), by HF tensor
/// name; [`linear`] takes its weight from here when present.
#[derive(Debug, Default)]
pub struct Prequantized(Mutex<HashMap<String, QuantWeight>>);

impl Prequantized {
    pub fn new(weights: HashMap<String, QuantWeight>) -> Self {
        Self(Mutex::new(weights))
    }

    fn take(&self, name: &str) -> Option<QuantWeight> {
        self.0.lock().ok()?.remove(name)
    }

    /// Names nobody took (a mapping bug, or tensors the model does not use).
    pub fn remaining(&self) -> Vec<String> {
        self.0.lock().map(|m| m.keys().cloned().collect()).unwrap_or_default()
    }
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> candle_core::Result<Self> {
        let weight = weight.contiguous()?;
        let bias_f32 = match &bias {
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(Self { weight, bias, bias_f32, quant: None, packed: None })
    }

    /// Packs an f16 or bf16 weight on the CPU in panels for the AVX2
    /// kernels, where they pay (`kernels::cpu::packed::packing_pays`), in
    /// place of the row-major one. Returns whether it did.
    pub fn pack(&mut self) -> candle_core::Result<bool> {
        if self.quant.is_some() || self.packed.is_some() || !kernels::cpu::packed::packing_pays() {
            return Ok(false);
        }
        if !self.weight.device().is_cpu() || !matches!(self.weight.dtype(), DType::F16 | DType::BF16) {
            return Ok(false);
        }
        let (n, k) = self.weight.dims2()?;
        let packed = {
            let (storage, layout) = self.weight.storage_and_layout();
            let Some((a, b)) = layout.contiguous_offsets() else { return Ok(false) };
            let err = |e: kernels::cpu::packed::PackError| candle_core::Error::Msg(e.to_string());
            match &*storage {
                Storage::Cpu(CpuStorage::F16(w)) => Packed::F16(PackedWeight::pack(&w[a..b], n, k).map_err(err)?),
                Storage::Cpu(CpuStorage::BF16(w)) => Packed::BF16(PackedWeight::pack(&w[a..b], n, k).map_err(err)?),
                _ => return Ok(false),
            }
        };
        self.packed = Some(Arc::new(packed));
        self.weight = Tensor::zeros(0, self.weight.dtype(), self.weight.device())?;
        Ok(true)
    }

    /// Backs the weight with huge pages (CPU only; see `kernels::cpu::back_with_huge_pages`):
    /// streaming it then costs fewer page walks.
    pub fn place_in_huge_pages(&self) {
        if let Some(q) = &self.quant {
            match &q.blocks {
                QuantBlocks::Q8_0(p) => {
                    let (codes, scales) = p.arrays();
                    back_with_huge_pages(codes);
                    back_with_huge_pages(scales);
                }
                QuantBlocks::Q8_0Vnni(p) => {
                    // Padding included: allocated whole 2 MiB pages.
                    let (codes, scales) = p.allocations();
                    back_with_huge_pages(codes);
                    back_with_huge_pages(scales);
                }
                QuantBlocks::Q4_0(b) => back_with_huge_pages(b),
            }
            return;
        }
        match self.packed.as_deref() {
            Some(Packed::F16(w)) => return back_with_huge_pages(w.allocation()),
            Some(Packed::BF16(w)) => return back_with_huge_pages(w.allocation()),
            None => {}
        }
        let (storage, layout) = self.weight.storage_and_layout();
        let Some((a, b)) = layout.contiguous_offsets() else { return };
        match &*storage {
            Storage::Cpu(CpuStorage::F32(w)) => back_with_huge_pages(&w[a..b]),
            Storage::Cpu(CpuStorage::F16(w)) => back_with_huge_pages(&w[a..b]),
            Storage::Cpu(CpuStorage::BF16(w)) => back_with_huge_pages(&w[a..b]),
            _ => {}
        }
    }

    /// Stacks layers that read the same input into one whose rows are
    /// theirs in order (`[out_a + out_b + …, in]`): one kernel call and one
    /// pass over (and one quantization of) the activations instead of
    /// several. Gives the parts back when their weights cannot be stacked
    /// (different formats or dtypes).
    pub fn stack(parts: Vec<Linear>) -> candle_core::Result<std::result::Result<Linear, Vec<Linear>>> {
        let Some(first) = parts.first() else { candle_core::bail!("stack: no layers") };
        // Layers stack as they load, before any is packed.
        if parts.iter().any(|p| p.packed.is_some()) {
            return Ok(Err(parts));
        }
        let same_kind = parts.iter().all(|p| match (&p.quant, &first.quant) {
            (Some(a), Some(b)) => a.format() == b.format() && a.inp == b.inp,
            (None, None) => {
                p.weight.dtype() == first.weight.dtype()
                    && p.weight.device().same_device(first.weight.device())
                    && p.weight.dims2().ok().map(|d| d.1) == first.weight.dims2().ok().map(|d| d.1)
            }
            _ => false,
        });
        if !same_kind || parts.len() == 1 {
            return Ok(Err(parts));
        }
        let outs: Vec<usize> = parts.iter().map(|p| p.out_features()).collect::<candle_core::Result<_>>()?;
        // A part without a bias gets zeros, so the stacked bias lines up.
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            let like = parts.iter().find_map(|p| p.bias.as_ref()).map(|b| (b.dtype(), b.device().clone()));
            let (dtype, device) = like.unwrap_or((DType::F32, candle_core::Device::Cpu));
            let pieces = parts
                .iter()
                .zip(&outs)
                .map(|(p, &n)| match &p.bias {
                    Some(b) => Ok(b.clone()),
                    None => Tensor::zeros(n, dtype, &device),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&pieces, 0)?)
        } else {
            None
        };
        if first.quant.is_some() {
            let inp = first.quant.as_ref().map_or(0, |q| q.inp);
            let out = outs.iter().sum();
            let quants: Vec<Arc<QuantWeight>> = parts.into_iter().filter_map(|p| p.quant).collect();
            let mixed = || candle_core::Error::Msg("stack: mixed quantization formats".into());
            // The parts' rows in GGML's row-major blocks, one after another.
            let blocks = match quants[0].blocks {
                QuantBlocks::Q8_0(_) | QuantBlocks::Q8_0Vnni(_) => {
                    let mut rows = Vec::new();
                    for q in &quants {
                        rows.extend(q.blocks.q8_0_rows().ok_or_else(mixed)?);
                    }
                    pack_q8_0(&rows, out, inp)?
                }
                QuantBlocks::Q4_0(_) => {
                    let mut rows = Vec::new();
                    for q in &quants {
                        let QuantBlocks::Q4_0(b) = &q.blocks else { return Err(mixed()) };
                        rows.extend_from_slice(b);
                    }
                    QuantBlocks::Q4_0(rows)
                }
            };
            return Ok(Ok(Linear::from_quant(QuantWeight { blocks, out, inp }, bias)?));
        }
        let weights: Vec<Tensor> = parts.iter().map(|p| p.weight.clone()).collect();
        Ok(Ok(Linear::new(Tensor::cat(&weights, 0)?, bias)?))
    }

    /// Bytes of weight (and bias) read by one pass over the layer.
    pub fn size_in_bytes(&self) -> usize {
        let weight = match (&self.quant, &self.packed) {
            (Some(q), _) => q.size_in_bytes(),
            (None, Some(p)) => p.size_in_bytes(),
            (None, None) => self.weight.elem_count() * self.weight.dtype().size_in_bytes(),
        };
        weight + self.bias.as_ref().map_or(0, |b| b.elem_count() * b.dtype().size_in_bytes())
    }

    /// Columns of the weight: the width of the input.
    fn in_features(&self) -> candle_core::Result<usize> {
        match (&self.quant, &self.packed) {
            (Some(q), _) => Ok(q.inp),
            (None, Some(p)) => Ok(p.dims().1),
            (None, None) => self.weight.dim(1),
        }
    }

    fn check_input(&self, k: usize) -> candle_core::Result<()> {
        let inp = self.in_features()?;
        if k != inp {
            candle_core::bail!("linear: input has {k} features, the weight takes {inp}");
        }
        Ok(())
    }

    /// Rows of the weight: the width of the output.
    pub fn out_features(&self) -> candle_core::Result<usize> {
        match (&self.quant, &self.packed) {
            (Some(q), _) => Ok(q.out),
            (None, Some(p)) => Ok(p.dims().0),
            (None, None) => self.weight.dim(0),
        }
    }

    /// A linear layer over an already-quantized weight.
    pub fn from_quant(weight: QuantWeight, bias: Option<Tensor>) -> candle_core::Result<Self> {
        let bias_f32 = match &bias {
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        let placeholder = Tensor::zeros(0, DType::F32, &candle_core::Device::Cpu)?;
        Ok(Self { weight: placeholder, bias, bias_f32, quant: Some(Arc::new(weight)), packed: None })
    }

    pub fn quant_format(&self) -> Option<QuantFormat> {
        self.quant.as_ref().map(|q| q.format())
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Replaces the weight by its quantization (GGML's block formats: i8 or
    /// 4-bit codes, one f16 scale per 32), if it lives on the CPU and its
    /// input dimension is a multiple of 32. Returns whether it did.
    pub fn quantize(&mut self, format: QuantFormat) -> candle_core::Result<bool> {
        if self.quant.is_some() {
            return Ok(false);
        }
        let (out, inp) = (self.out_features()?, self.in_features()?);
        if !self.weight.device().is_cpu() || !inp.is_multiple_of(QK) {
            return Ok(false);
        }
        let w = match self.packed.take() {
            Some(p) => p.to_f32(),
            None => self.weight.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        };
        self.quant = Some(Arc::new(QuantWeight::quantize(format, &w, out, inp)?));
        self.weight = Tensor::zeros(0, self.weight.dtype(), self.weight.device())?;
        Ok(true)
    }

    pub fn quantize_q8_0(&mut self) -> candle_core::Result<bool> {
        self.quantize(QuantFormat::Q8_0)
    }

    /// `y = x W^T + b` through the quantized kernel, `x: [m, in]`, `y: [m, out]`.
    fn quant_into(&self, q: &QuantWeight, xv: &[f32], m: usize, y: &mut [f32]) -> candle_core::Result<()> {
        q.matmul(xv, m, y)?;
        if let Some(b) = &self.bias_f32 {
            y.chunks_exact_mut(q.out).for_each(|row| row.iter_mut().zip(b).for_each(|(v, b)| *v += b));
        }
        Ok(())
    }

    fn candle_forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.weight.t()?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// x: [m, in] -> [m, out] through our kernel.
    /// x: [m, in] -> [m, out] through our kernels.
    fn kernel_forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, k) = x.dims2()?;
        self.check_input(k)?;
        let n = self.out_features()?;
        let x32 = x.to_dtype(DType::F32)?.contiguous()?;
        let mut y = vec![0f32; m * n];
        read_f32(&x32, |xv| self.kernel_into(xv, m, &mut y))?;
        Tensor::from_vec(y, (m, n), x.device())?.to_dtype(x.dtype())
    }

    /// `y = x W^T + b` through our kernels (quantized, packed or row-major),
    /// `x: [m, in]`, `y: [m, out]`.
    fn kernel_into(&self, xv: &[f32], m: usize, y: &mut [f32]) -> candle_core::Result<()> {
        if let Some(q) = &self.quant {
            return self.quant_into(q, xv, m, y);
        }
        if let Some(p) = &self.packed {
            return p.matmul(xv, m, self.bias_f32.as_deref(), y);
        }
        let (n, k) = self.weight.dims2()?;
        let (ws, wl) = self.weight.storage_and_layout();
        let Some((w0, w1)) = wl.contiguous_offsets() else { candle_core::bail!("linear: weight must be contiguous") };
        let bias = self.bias_f32.as_deref();
        match &*ws {
            Storage::Cpu(CpuStorage::F32(w)) => matmul_xwt(xv, m, k, &w[w0..w1], n, bias, y),
            Storage::Cpu(CpuStorage::F16(w)) => matmul_xwt::<f16>(xv, m, k, &w[w0..w1], n, bias, y),
            Storage::Cpu(CpuStorage::BF16(w)) => matmul_xwt::<bf16>(xv, m, k, &w[w0..w1], n, bias, y),
            _ => candle_core::bail!("linear: unsupported weight dtype {:?}", self.weight.dtype()),
        }
        Ok(())
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
            return read_f32(x, |xv| write_f32(out, &|y| self.kernel_into(xv, m, y)));
        }
        kernels::cpu::copy_columns(&self.candle_forward(x)?.to_dtype(DType::F32)?.contiguous()?, 0, out)
    }

    /// Whether `x` goes through our kernels: quantized and packed weights
    /// always (they have no other path), the others on the CPU for 2-D x.
    fn uses_kernel(&self, x: &Tensor) -> bool {
        if self.quant.is_some() || self.packed.is_some() {
            return true;
        }
        let rows = x.dims().iter().rev().skip(1).product::<usize>();
        x.device().is_cpu()
            && x.rank() == 2
            && (self.weight.dtype() != DType::F32 || rows <= F32_KERNEL_MAX_ROWS)
            && matches!(self.weight.dtype(), DType::F32 | DType::F16 | DType::BF16)
    }
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
        if q.dims() != (out_dim, in_dim) {
            candle_core::bail!("{name}: quantized weight is {:?}, expected [{out_dim}, {in_dim}]", q.dims());
        }
        return Linear::from_quant(q, bias);
    }
    Linear::new(vb.get((out_dim, in_dim), "weight")?, bias)
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let _t = crate::profile::scope(crate::profile::Section::Matmul);
        if self.uses_kernel(x) { self.kernel_forward(x) } else { self.candle_forward(x) }
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
        assert!(q.quantize_q8_0().unwrap());
        assert_eq!(q.weight().elem_count(), 0, "the f32 weight is dropped");
        let got = q.forward(&x).unwrap();
        let diff: f32 = (got - &exact).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        let scale: f32 = exact.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        assert!(diff < 0.02 * scale, "{diff} vs {scale}");
        // In-features not a multiple of 32 stay unquantized.
        let mut odd = Linear::new(Tensor::zeros((3, 29), DType::F32, &dev).unwrap(), None).unwrap();
        assert!(!odd.quantize_q8_0().unwrap());
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
            assert!(packed.quantize_q8_0().unwrap());
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
                    .matmul(&f32(lin.weight()).t().unwrap())
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
