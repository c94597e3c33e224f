//! A GGUF file's tensors as stored: GGML's type, the shape and the bytes,
//! read through our own header parser (`common::model::gguf`). candle's
//! GGUF reader refuses a whole file as soon as one tensor has a type it
//! does not know, and it knows no MXFP4 (GGML type 39), the format gpt-oss
//! ships its experts in; here every tensor is read as bytes, and only the
//! consumer decides what to do with its type.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::model::gguf::GgufHeader;
use kernels::cpu::quant::{BlockMxfp4, QK_MXFP4, dequantize_row};

use crate::error::Result;

/// GGML's type ids of the types read here.
pub(super) mod ggml_type {
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q8_0: u32 = 8;
    pub const Q4K: u32 = 12;
    pub const Q6K: u32 = 14;
    pub const MXFP4: u32 = 39;
}

/// Bytes per MXFP4 block: the exponent, then 16 bytes of codes.
const MXFP4_BLOCK_BYTES: usize = 1 + QK_MXFP4 / 2;

/// candle's type for a GGML id (the types candle can hold and dequantize).
fn candle_type(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// (weights per block, bytes per block) of a GGML type we can read.
fn block_layout(id: u32) -> Option<(usize, usize)> {
    match id {
        ggml_type::MXFP4 => Some((QK_MXFP4, MXFP4_BLOCK_BYTES)),
        id => candle_type(id).map(|t| (t.block_size(), t.type_size())),
    }
}

/// An open GGUF file.
pub(super) struct GgufFile {
    path: PathBuf,
    file: File,
    pub header: GgufHeader,
}

/// One tensor as stored.
pub(super) struct RawTensor {
    /// GGML's type id.
    pub ggml_type: u32,
    /// PyTorch's order: the slowest-varying dimension first.
    pub dims: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let header = GgufHeader::open(path)?;
        let file = File::open(path).map_err(|e| super::gguf::err(path, e.to_string()))?;
        Ok(Self { path: path.to_path_buf(), file, header })
    }

    /// The tensor names, sorted.
    pub fn names(&self) -> Vec<&String> {
        let mut names: Vec<&String> = self.header.tensors.keys().collect();
        names.sort();
        names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// Reads tensor `name`; its extent is checked against the file.
    pub fn read(&self, name: &str) -> Result<RawTensor> {
        let err = |message: String| super::gguf::err(&self.path, format!("{name}: {message}"));
        let info = self.header.tensors.get(name).ok_or_else(|| err("no such tensor".into()))?;
        let (per_block, block_bytes) = block_layout(info.ggml_type)
            .ok_or_else(|| err(format!("GGML type {} is not supported", info.ggml_type)))?;
        let dims: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        let elems = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| err("too large".into()))?;
        if !elems.is_multiple_of(per_block) {
            return Err(err(format!("{elems} values are not whole blocks of {per_block}")));
        }
        let len = elems / per_block * block_bytes;
        let start = self.header.data_offset.checked_add(info.offset).ok_or_else(|| err("bad offset".into()))?;
        let file_len = self.file.metadata().map_err(|e| err(e.to_string()))?.len();
        if start.saturating_add(len as u64) > file_len {
            return Err(err(format!("{len} bytes at offset {start} run past the end of the file ({file_len})")));
        }
        let mut bytes = vec![0u8; len];
        self.file.read_exact_at(&mut bytes, start).map_err(|e| err(e.to_string()))?;
        Ok(RawTensor { ggml_type: info.ggml_type, dims, bytes })
    }
}

impl RawTensor {
    /// As candle's quantized tensor (every type but MXFP4).
    pub fn to_qtensor(&self) -> candle_core::Result<QTensor> {
        let Some(ty) = candle_type(self.ggml_type) else {
            candle_core::bail!("GGML type {} has no candle tensor", self.ggml_type)
        };
        candle_core::quantized::ggml_file::qtensor_from_ggml(ty, &self.bytes, self.dims.clone(), &Device::Cpu)
    }

    /// The values as a `dtype` tensor on the CPU (blocks dequantized).
    pub fn dequantize(&self, dtype: DType) -> candle_core::Result<Tensor> {
        match self.ggml_type {
            ggml_type::F16 if dtype == DType::F16 => self.to_qtensor()?.dequantize_f16(&Device::Cpu),
            ggml_type::MXFP4 => {
                let blocks = self.mxfp4_blocks();
                let mut values = vec![0f32; blocks.len() * QK_MXFP4];
                dequantize_row(&blocks, &mut values);
                Tensor::from_vec(values, self.dims.as_slice(), &Device::Cpu)?.to_dtype(dtype)
            }
            _ => self.to_qtensor()?.dequantize(&Device::Cpu)?.to_dtype(dtype),
        }
    }

    /// The MXFP4 blocks of `bytes` (a whole number of them).
    pub fn mxfp4_blocks(&self) -> Vec<BlockMxfp4> {
        mxfp4_blocks(&self.bytes)
    }
}

/// GGML's `block_mxfp4` bytes as blocks.
pub(super) fn mxfp4_blocks(bytes: &[u8]) -> Vec<BlockMxfp4> {
    bytes
        .chunks_exact(MXFP4_BLOCK_BYTES)
        .map(|b| BlockMxfp4 { e: b[0], qs: std::array::from_fn(|i| b[1 + i]) })
        .collect()
}
