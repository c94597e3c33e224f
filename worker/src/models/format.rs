//! Weight formats in GGML's names: what `--quantize`, `export-gguf --type`
//! and a GGUF file's tensors say about how weights are stored.

use std::str::FromStr;

/// How weights are stored, in GGML's type names: dense f32 or f16, or a
/// block format (integer codes with f16 scales), or llama.cpp's Q4_K_M
/// mix of Q4_K and Q6_K. `--quantize` takes [`Self::BLOCK_FORMATS`],
/// `export-gguf --type` [`Self::EXPORT_TYPES`]; Q4_K, Q6_K and MXFP4
/// weights come from GGUF files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantization {
    F32,
    F16,
    /// GGML's Q8_0: i8 weights with an f16 scale per 32 (8.5 bits per weight).
    Q8_0,
    /// GGML's Q4_0: 4-bit weights with an f16 scale per 32 (4.5 bits per weight).
    Q4_0,
    /// GGML's Q4_K: super-blocks of 256, 4-bit codes, 6-bit scales and mins per 32 (4.5 bits).
    Q4K,
    /// GGML's Q6_K: super-blocks of 256, 6-bit codes, an i8 scale per 16 (6.56 bits).
    Q6K,
    /// llama.cpp's Q4_K_M file type: Q4_K, with Q6_K for the output and
    /// half of the attn_v and ffn_down weights (an export type).
    Q4KM,
    /// MXFP4: 4-bit E2M1 floats with a power-of-two scale per 32 (4.25
    /// bits), gpt-oss's experts.
    Mxfp4,
}

impl Quantization {
    pub const ALL: [Self; 8] =
        [Self::F32, Self::F16, Self::Q8_0, Self::Q4_0, Self::Q4K, Self::Q6K, Self::Q4KM, Self::Mxfp4];
    /// The types `export-gguf --type` writes.
    pub const EXPORT_TYPES: [Self; 5] = [Self::F32, Self::F16, Self::Q8_0, Self::Q4_0, Self::Q4KM];
    /// The formats a loaded model can be quantized to (`--quantize`).
    pub const BLOCK_FORMATS: [Self; 2] = [Self::Q8_0, Self::Q4_0];

    /// The name on the command line (GGML's, lower case).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4K => "q4_k",
            Self::Q6K => "q6_k",
            Self::Q4KM => "q4_k_m",
            Self::Mxfp4 => "mxfp4",
        }
    }

    pub fn is_block_format(self) -> bool {
        Self::BLOCK_FORMATS.contains(&self)
    }
}

impl FromStr for Quantization {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|q| q.name() == s).ok_or_else(|| format!("unknown weight format {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for q in Quantization::ALL {
            assert_eq!(q.name().parse::<Quantization>(), Ok(q));
        }
        assert!("q5_k".parse::<Quantization>().is_err());
        assert!(Quantization::BLOCK_FORMATS.iter().all(|q| q.is_block_format()));
        assert_eq!("q4_k_m".parse::<Quantization>(), Ok(Quantization::Q4KM));
        assert!(!Quantization::F16.is_block_format());
    }
}
