//! A GGUF file's tensors as the GPU step plan takes them: GGML blocks as
//! stored (Q8_0, Q4_0, Q4_K, Q6_K; rows still un-permuted for the llama
//! architecture as `gguf::load` does), everything else as tensors.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use common::model::ModelConfig;
use kernels::metal::step::WeightFormat;

use super::gguf::{
    GgufFile, err, hf_name, invert, llama_qk_permutation, permute_tensor_rows, qk_heads, read_info, with_rope_freqs,
};
use super::gguf_experts::{ExpertTensor, Param, hf_expert};
use super::gguf_file::ggml_type;
use crate::error::Result;

/// A weight on the host, as the plan will upload it.
#[derive(Clone, Debug)]
pub enum HostTensor {
    /// A float tensor (f32, f16 or bf16).
    Dense(Tensor),
    /// `[rows, cols]` in a block format, GGML's bytes.
    Blocks { format: WeightFormat, bytes: Vec<u8>, rows: usize, cols: usize },
}

impl HostTensor {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Self::Dense(t) => t.dims().to_vec(),
            Self::Blocks { rows, cols, .. } => vec![*rows, *cols],
        }
    }

    /// As a float tensor of `dtype` (blocks dequantized).
    pub fn to_dense(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Self::Dense(t) => Ok(t.to_dtype(dtype)?),
            Self::Blocks { format: WeightFormat::Mxfp4, bytes, rows, cols } => {
                let mut values = vec![0f32; rows * cols];
                kernels::cpu::quant::dequantize_row(&super::gguf_file::mxfp4_blocks(bytes), &mut values);
                Ok(Tensor::from_vec(values, (*rows, *cols), &Device::Cpu)?.to_dtype(dtype)?)
            }
            Self::Blocks { format, bytes, rows, cols } => {
                let q = candle_core::quantized::QTensor::new(
                    candle_core::quantized::QStorage::from_data(
                        std::borrow::Cow::Borrowed(bytes),
                        &Device::Cpu,
                        ggml_type(*format),
                    )?,
                    (*rows, *cols),
                )?;
                Ok(q.dequantize(&Device::Cpu)?.to_dtype(dtype)?)
            }
        }
    }
}

fn ggml_type(format: WeightFormat) -> GgmlDType {
    match format {
        WeightFormat::Q8_0 => GgmlDType::Q8_0,
        WeightFormat::Q4_0 => GgmlDType::Q4_0,
        WeightFormat::Q4K => GgmlDType::Q4K,
        WeightFormat::Q6K => GgmlDType::Q6K,
        WeightFormat::F16 => GgmlDType::F16,
        WeightFormat::BF16 => GgmlDType::BF16,
        WeightFormat::F32 => GgmlDType::F32,
        WeightFormat::Mxfp4 => unreachable!("MXFP4 is dequantized by our own code"),
    }
}

/// The plan's block format of a GGML type.
fn block_format(ggml: u32) -> Option<WeightFormat> {
    match ggml {
        ggml_type::MXFP4 => Some(WeightFormat::Mxfp4),
        ggml_type::Q8_0 => Some(WeightFormat::Q8_0),
        ggml_type::Q4_0 => Some(WeightFormat::Q4_0),
        ggml_type::Q4K => Some(WeightFormat::Q4K),
        ggml_type::Q6K => Some(WeightFormat::Q6K),
        _ => None,
    }
}

/// The config and every tensor of the GGUF file at `path` under Hugging
/// Face names: linear weights in a block format as blocks, the rest as
/// `dtype` tensors.
pub fn host_tensors(path: &Path, dtype: DType) -> Result<(ModelConfig, HashMap<String, HostTensor>)> {
    let info = read_info(path)?;
    let file = GgufFile::open(path)?;
    let cfg = with_rope_freqs(info.config, &file, path)?;
    let mut out = HashMap::new();
    for gguf in file.names() {
        if let Some(tensor) = ExpertTensor::parse(gguf) {
            let raw = file.read(gguf)?;
            expert_tensors(&cfg, tensor, raw, dtype, &mut out).map_err(|e| err(path, format!("{gguf}: {e}")))?;
            continue;
        }
        let Some(hf) = hf_name(gguf, cfg.architecture) else { continue };
        let raw = file.read(gguf)?;
        let perm = qk_heads(&cfg, &hf).map(|heads| invert(&llama_qk_permutation(raw.dims[0], heads)));
        let is_linear = hf.ends_with("_proj.weight") || hf == "lm_head.weight";
        let tensor = match block_format(raw.ggml_type).filter(|_| is_linear) {
            Some(format) => {
                let [rows, cols] = raw.dims[..] else {
                    return Err(err(path, format!("{gguf}: a matrix of {} dims", raw.dims.len())));
                };
                let row_bytes = raw.bytes.len() / rows.max(1);
                let bytes = match &perm {
                    Some(p) => {
                        p.iter().flat_map(|&r| raw.bytes[r * row_bytes..][..row_bytes].iter().copied()).collect()
                    }
                    None => raw.bytes,
                };
                HostTensor::Blocks { format, bytes, rows, cols }
            }
            None => {
                let t = raw.dequantize(dtype).map_err(|e| err(path, format!("{gguf}: {e}")))?;
                let t = match &perm {
                    Some(p) => permute_tensor_rows(&t, p).map_err(|e| err(path, e.to_string()))?,
                    None => t,
                };
                HostTensor::Dense(t)
            }
        };
        out.insert(hf, tensor);
    }
    Ok((cfg, out))
}

/// A router (or its score correction) as a tensor, or a layer's stacked
/// experts split into each expert's weights under HF names: each expert's
/// blocks are a contiguous slice of the stacked tensor, kept as stored.
fn expert_tensors(
    cfg: &ModelConfig,
    tensor: ExpertTensor,
    raw: super::gguf_file::RawTensor,
    dtype: DType,
    out: &mut HashMap<String, HostTensor>,
) -> Result<()> {
    let check = |experts: usize| -> Result<()> {
        if experts == 0 || experts != cfg.moe.num_experts {
            return Err(crate::error::WorkerError::Unsupported(format!(
                "{experts} experts, the config says {}",
                cfg.moe.num_experts
            )));
        }
        Ok(())
    };
    match tensor {
        ExpertTensor::Router { .. } | ExpertTensor::CorrectionBias { .. } => {
            out.insert(tensor.hf_name(cfg), HostTensor::Dense(raw.dequantize(dtype)?));
        }
        ExpertTensor::Stacked { layer, which, param: Param::Bias } => {
            let all = raw.dequantize(dtype)?;
            check(all.dims2()?.0)?;
            for e in 0..cfg.moe.num_experts {
                out.insert(hf_expert(cfg, layer, e, which, Param::Bias), HostTensor::Dense(all.get(e)?));
            }
        }
        ExpertTensor::Stacked { layer, which, param: Param::Weight } => {
            let [experts, rows, cols] = raw.dims[..] else {
                return Err(crate::error::WorkerError::Unsupported(format!(
                    "stacked experts of {} dims",
                    raw.dims.len()
                )));
            };
            check(experts)?;
            let name = |e: usize| hf_expert(cfg, layer, e, which, Param::Weight);
            match block_format(raw.ggml_type) {
                Some(format) => {
                    for (e, bytes) in raw.bytes.chunks_exact(raw.bytes.len() / experts).enumerate() {
                        out.insert(name(e), HostTensor::Blocks { format, bytes: bytes.to_vec(), rows, cols });
                    }
                }
                None => {
                    let all = raw.dequantize(dtype)?;
                    for e in 0..experts {
                        out.insert(name(e), HostTensor::Dense(all.get(e)?));
                    }
                }
            }
        }
    }
    Ok(())
}
