//! The block formats' side of a linear weight: quantizing a dense matrix, taking blocks as a GGUF file stores
//! them, regrouping Q8_0 for the kernel in use, and reordering or stacking
//! rows of quantized weights.
//!
//! Q8_0 is kept regrouped for the kernel: in 16-row panels for `vpdpbusd`
//! where the CPU has AVX-512 VNNI ([`PanelQ8_0`]), else 4 rows' codes
//! together, scales apart ([`PackedQ8_0`]); the k-quants Q4_K and Q6_K
//! (from GGUF files) in 16-row panels ([`KPanels`]); Q4_0 stays in GGML's
//! row-major blocks.

use kernels::cpu::kquant::{BlockQ4K, BlockQ6K, KPanel, KPanels, QK_K};
use kernels::cpu::q8_panel::{PanelQ8_0, panels_pay};
use kernels::cpu::quant::{BlockMxfp4, BlockQ4_0, BlockQ8_0, PackedQ8_0, QK, QuantError, quantize_matrix};

use super::format::Quantization;
use super::linear::Weight;

fn kernel_err(e: QuantError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Q8_0 blocks (row-major, GGML's order) regrouped for this CPU's kernel.
fn pack_q8_0(blocks: &[BlockQ8_0], out: usize, inp: usize) -> candle_core::Result<Weight> {
    if panels_pay() {
        return Ok(Weight::Q8_0Panels(PanelQ8_0::pack(blocks, out, inp / QK).map_err(kernel_err)?));
    }
    Ok(Weight::Q8_0(PackedQ8_0::pack(blocks, out, inp / QK).map_err(kernel_err)?))
}

fn check_blocks(blocks: usize, out: usize, inp: usize) -> candle_core::Result<()> {
    if !inp.is_multiple_of(QK) || blocks != out * (inp / QK) {
        candle_core::bail!("{blocks} quantized blocks do not make a [{out}, {inp}] weight");
    }
    Ok(())
}

/// Row-major k-quant blocks in panels, checked against the shape.
fn k_panels<B: KPanel>(blocks: &[B], out: usize, inp: usize) -> candle_core::Result<KPanels<B>> {
    if !inp.is_multiple_of(QK_K) || blocks.len() != out * (inp / QK_K) {
        candle_core::bail!("{} k-quant blocks do not make a [{out}, {inp}] weight", blocks.len());
    }
    KPanels::pack(blocks, out, inp / QK_K).map_err(kernel_err)
}

impl Weight {
    /// Quantizes a row-major `[out, inp]` f32 matrix to a block format.
    pub fn quantize(format: Quantization, w: &[f32], out: usize, inp: usize) -> candle_core::Result<Self> {
        match format {
            Quantization::Q8_0 => pack_q8_0(&quantize_matrix::<BlockQ8_0>(w, out, inp).map_err(kernel_err)?, out, inp),
            Quantization::Q4_0 => {
                Ok(Self::Q4_0 { blocks: quantize_matrix(w, out, inp).map_err(kernel_err)?, out, inp })
            }
            _ => candle_core::bail!("{} is not a format --quantize writes", format.name()),
        }
    }

    /// Q8_0 blocks as stored in a file (GGUF), checked against the shape.
    pub fn from_q8_0(blocks: Vec<BlockQ8_0>, out: usize, inp: usize) -> candle_core::Result<Self> {
        check_blocks(blocks.len(), out, inp)?;
        pack_q8_0(&blocks, out, inp)
    }

    /// Q4_0 blocks as stored in a file (GGUF), checked against the shape.
    pub fn from_q4_0(blocks: Vec<BlockQ4_0>, out: usize, inp: usize) -> candle_core::Result<Self> {
        check_blocks(blocks.len(), out, inp)?;
        Ok(Self::Q4_0 { blocks, out, inp })
    }

    /// MXFP4 blocks as stored in a file (GGUF), checked against the shape.
    pub fn from_mxfp4(blocks: Vec<BlockMxfp4>, out: usize, inp: usize) -> candle_core::Result<Self> {
        check_blocks(blocks.len(), out, inp)?;
        Ok(Self::Mxfp4 { blocks, out, inp })
    }

    /// Q4_K blocks as stored in a file (GGUF), checked against the shape
    /// and repacked in panels.
    pub fn from_q4_k(blocks: Vec<BlockQ4K>, out: usize, inp: usize) -> candle_core::Result<Self> {
        Ok(Self::Q4K(k_panels(&blocks, out, inp)?))
    }

    /// Q6_K blocks as stored in a file (GGUF), checked against the shape
    /// and repacked in panels.
    pub fn from_q6_k(blocks: Vec<BlockQ6K>, out: usize, inp: usize) -> candle_core::Result<Self> {
        Ok(Self::Q6K(k_panels(&blocks, out, inp)?))
    }

    /// The block format, for quantized weights.
    pub fn block_format(&self) -> Option<Quantization> {
        match self {
            Self::Q8_0(_) | Self::Q8_0Panels(_) => Some(Quantization::Q8_0),
            Self::Q4_0 { .. } => Some(Quantization::Q4_0),
            Self::Mxfp4 { .. } => Some(Quantization::Mxfp4),
            Self::Q4K(_) => Some(Quantization::Q4K),
            Self::Q6K(_) => Some(Quantization::Q6K),
            Self::Dense(_) | Self::PackedF16(_) | Self::PackedBf16(_) => None,
        }
    }

    /// Q8_0 weights back in GGML's row-major blocks.
    fn q8_0_rows(&self) -> Option<Vec<BlockQ8_0>> {
        match self {
            Self::Q8_0(p) => Some(p.unpack()),
            Self::Q8_0Panels(p) => Some(p.unpack()),
            _ => None,
        }
    }

    /// Reorders whole output rows of a quantized weight: row `r` of the
    /// result is row `perm[r]` (dense weights are left as they are).
    pub fn permute_rows(&mut self, perm: &[usize]) -> candle_core::Result<()> {
        fn apply<B: Copy>(v: &mut Vec<B>, perm: &[usize], kb: usize) {
            *v = perm.iter().flat_map(|&r| v[r * kb..(r + 1) * kb].iter().copied()).collect();
        }
        let (out, inp) = self.dims()?;
        let kb = inp / QK;
        if let Some(mut rows) = self.q8_0_rows() {
            apply(&mut rows, perm, kb);
            *self = pack_q8_0(&rows, out, inp)?;
        }
        match self {
            Self::Q4_0 { blocks, .. } => apply(blocks, perm, kb),
            Self::Mxfp4 { blocks, .. } => apply(blocks, perm, kb),
            Self::Q4K(w) => {
                let mut rows = w.unpack();
                apply(&mut rows, perm, inp / QK_K);
                *w = k_panels(&rows, out, inp)?;
            }
            Self::Q6K(w) => {
                let mut rows = w.unpack();
                apply(&mut rows, perm, inp / QK_K);
                *w = k_panels(&rows, out, inp)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Quantized weights of one format and width, their rows one after
    /// another (`[out_a + out_b + …, inp]`); `None` for other weights.
    pub(super) fn stack_quantized(parts: &[&Weight]) -> candle_core::Result<Option<Weight>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let (Some(format), inp) = (first.block_format(), first.dims()?.1) else { return Ok(None) };
        let mut out = 0;
        for p in parts {
            let (rows, cols) = p.dims()?;
            if p.block_format() != Some(format) || cols != inp {
                return Ok(None);
            }
            out += rows;
        }
        // Row-major blocks: the rows of one after the other's.
        fn concat<B: Copy>(parts: &[&Weight], get: impl Fn(&Weight) -> Option<&[B]>) -> Vec<B> {
            parts.iter().filter_map(|p| get(p)).flatten().copied().collect()
        }
        match format {
            Quantization::Q4_0 => {
                let blocks = concat(parts, |p| if let Self::Q4_0 { blocks, .. } = p { Some(blocks) } else { None });
                return Ok(Some(Self::Q4_0 { blocks, out, inp }));
            }
            Quantization::Mxfp4 => {
                let blocks = concat(parts, |p| if let Self::Mxfp4 { blocks, .. } = p { Some(blocks) } else { None });
                return Ok(Some(Self::Mxfp4 { blocks, out, inp }));
            }
            Quantization::Q4K => {
                let rows: Vec<BlockQ4K> = parts
                    .iter()
                    .filter_map(|p| if let Self::Q4K(w) = p { Some(w.unpack()) } else { None })
                    .flatten()
                    .collect();
                return Ok(Some(Self::Q4K(k_panels(&rows, out, inp)?)));
            }
            Quantization::Q6K => {
                let rows: Vec<BlockQ6K> = parts
                    .iter()
                    .filter_map(|p| if let Self::Q6K(w) = p { Some(w.unpack()) } else { None })
                    .flatten()
                    .collect();
                return Ok(Some(Self::Q6K(k_panels(&rows, out, inp)?)));
            }
            _ => {}
        }
        let rows: Vec<BlockQ8_0> = parts.iter().filter_map(|p| p.q8_0_rows()).flatten().collect();
        pack_q8_0(&rows, out, inp).map(Some)
    }
}
