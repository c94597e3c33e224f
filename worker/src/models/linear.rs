//! A linear layer (`y = x W^T + b`, weights `[out, in]` as Hugging Face
//! stores them) that streams its weight through our CPU kernel
//! (`kernels::cpu::matmul`): multi-threaded, SIMD, f16/bf16 widened in
//! registers. candle's own CPU matmul uses one core at m = 1, widens bf16
//! weights to a fresh f32 copy on every call, and is very slow for f16
//! with a transposed weight at m > 1. Activations go through the kernel in
//! f32. Other devices, and large f32 batches (where candle's GEMM is
//! good), use candle's matmul.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Module, Storage, Tensor};
use half::{bf16, f16};
use kernels::cpu::matmul::{WeightElem, matmul_xwt};
use kernels::cpu::quant::{BlockQ8_0, QK8_0, matmul_q8_0, quantize_matrix_q8_0};

/// Above this many rows f32 weights go to candle's blocked GEMM.
const F32_KERNEL_MAX_ROWS: usize = 16;

#[derive(Clone, Debug)]
pub struct Linear {
    /// [out, in]; after `quantize_q8_0` a 0-element placeholder (the
    /// quantized copy replaces it, so the memory goes).
    weight: Tensor,
    bias: Option<Tensor>,
    bias_f32: Option<Vec<f32>>,
    q8: Option<Arc<QuantWeight>>,
}

/// A Q8_0 weight: `out` rows of `in / 32` blocks.
#[derive(Debug)]
struct QuantWeight {
    blocks: Vec<BlockQ8_0>,
    out: usize,
    inp: usize,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> candle_core::Result<Self> {
        let weight = weight.contiguous()?;
        let bias_f32 = match &bias {
            Some(b) => Some(b.to_dtype(DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(Self { weight, bias, bias_f32, q8: None })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Replaces the weight by its Q8_0 quantization (GGML's format: i8 per
    /// weight, one f16 scale per 32), if it lives on the CPU and its input
    /// dimension is a multiple of 32. Returns whether it did.
    pub fn quantize_q8_0(&mut self) -> candle_core::Result<bool> {
        let (out, inp) = self.weight.dims2()?;
        if self.q8.is_some() || !self.weight.device().is_cpu() || inp % QK8_0 != 0 {
            return Ok(false);
        }
        let w = self.weight.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let blocks = quantize_matrix_q8_0(&w, out, inp).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        self.q8 = Some(Arc::new(QuantWeight { blocks, out, inp }));
        self.weight = Tensor::zeros(0, self.weight.dtype(), self.weight.device())?;
        Ok(true)
    }

    /// x: [m, in] -> [m, out] through the Q8_0 kernel.
    fn q8_forward(&self, q: &QuantWeight, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != q.inp {
            candle_core::bail!("linear: input has {k} features, the weight takes {}", q.inp);
        }
        let x32 = x.to_dtype(DType::F32)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mut y = vec![0f32; m * q.out];
        matmul_q8_0(&x32, m, k, &q.blocks, q.out, &mut y).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        if let Some(b) = &self.bias_f32 {
            for row in y.chunks_exact_mut(q.out) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        Tensor::from_vec(y, (m, q.out), x.device())?.to_dtype(x.dtype())
    }

    fn candle_forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.weight.t()?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// x: [m, in] -> [m, out] through our kernel.
    fn kernel_forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, k) = x.dims2()?;
        let n = self.weight.dim(0)?;
        let x32 = x.to_dtype(DType::F32)?.contiguous()?;
        let mut y = vec![0f32; m * n];
        {
            let (xs, xl) = x32.storage_and_layout();
            let (ws, wl) = self.weight.storage_and_layout();
            let (Storage::Cpu(CpuStorage::F32(xv)), Some((x0, x1))) = (&*xs, xl.contiguous_offsets()) else {
                candle_core::bail!("linear: activations must be contiguous f32 on the CPU");
            };
            let xv = &xv[x0..x1];
            let Some((w0, w1)) = wl.contiguous_offsets() else {
                candle_core::bail!("linear: weight must be contiguous")
            };
            let bias = self.bias_f32.as_deref();
            match &*ws {
                Storage::Cpu(CpuStorage::F32(w)) => run_chunked(xv, m, k, &w[w0..w1], n, bias, &mut y),
                Storage::Cpu(CpuStorage::F16(w)) => run_chunked::<f16>(xv, m, k, &w[w0..w1], n, bias, &mut y),
                Storage::Cpu(CpuStorage::BF16(w)) => run_chunked::<bf16>(xv, m, k, &w[w0..w1], n, bias, &mut y),
                _ => candle_core::bail!("linear: unsupported weight dtype {:?}", self.weight.dtype()),
            }
        }
        Tensor::from_vec(y, (m, n), x.device())?.to_dtype(x.dtype())
    }
}

/// Rows of x per kernel call. The kernel passes every x row over each
/// widened weight tile; a bounded chunk keeps those rows in L2 (a prompt of
/// 2,048 rows would stream them from memory for every 4 weight rows). The
/// price is one more read of the weight per chunk, small next to the FLOPs.
const ROW_CHUNK: usize = 64;

fn run_chunked<W: WeightElem>(x: &[f32], m: usize, k: usize, w: &[W], n: usize, bias: Option<&[f32]>, y: &mut [f32]) {
    let mut row = 0;
    while row < m {
        let rows = ROW_CHUNK.min(m - row);
        matmul_xwt(&x[row * k..(row + rows) * k], rows, k, w, n, bias, &mut y[row * n..(row + rows) * n]);
        row += rows;
    }
}

/// `[out, in]` weight (and `[out]` bias) under `vb`, as HF names them.
pub fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: candle_nn::VarBuilder) -> candle_core::Result<Linear> {
    let weight = vb.get((out_dim, in_dim), "weight")?;
    let bias = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
    Linear::new(weight, bias)
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(q) = &self.q8 {
            return self.q8_forward(q, x);
        }
        let rows = x.dims().iter().rev().skip(1).product::<usize>();
        let use_kernel = x.device().is_cpu()
            && x.rank() == 2
            && (self.weight.dtype() != DType::F32 || rows <= F32_KERNEL_MAX_ROWS)
            && matches!(self.weight.dtype(), DType::F32 | DType::F16 | DType::BF16);
        if use_kernel { self.kernel_forward(x) } else { self.candle_forward(x) }
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
