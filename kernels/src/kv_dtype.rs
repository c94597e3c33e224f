//! How a KV cache stores one token's vector for one kv head (a "row" of
//! `head_dim` values): as floats (f32, f16, bf16: one element each), or as
//! q8_0, llama.cpp's 8-bit format with one scale per row: `head_dim` int8
//! values then the row's f32 scale, little-endian, in a u8 tensor whose
//! last dimension is `head_dim + 4`. A value is `int8 * scale`, the scale
//! `max |x| / 127` of the row. One scale per head vector (64 or 128 values)
//! rather than per 32 keeps a row one contiguous read and costs 4 bytes:
//! a TinyLlama row is 68 bytes against f32's 256 (3.76x the tokens).

use candle_core::DType;

/// Bytes after a q8_0 row's values: its f32 scale.
pub const Q8_SCALE_BYTES: usize = 4;

/// The storage format of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvCacheDtype {
    F32,
    F16,
    BF16,
    Q8_0,
}

impl KvCacheDtype {
    /// The format of a cache tensor of `dtype` (u8 is q8_0).
    pub fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::F16 => Some(Self::F16),
            DType::BF16 => Some(Self::BF16),
            DType::U8 => Some(Self::Q8_0),
            _ => None,
        }
    }

    /// The float format of activations in `dtype` (what `auto` picks).
    pub fn float(dtype: DType) -> Option<Self> {
        Self::of(dtype).filter(|d| *d != Self::Q8_0)
    }

    /// The dtype of the cache tensors.
    pub fn storage_dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
            Self::Q8_0 => DType::U8,
        }
    }

    /// Elements of the cache tensor's last dimension for `head_dim` values.
    pub fn row_len(self, head_dim: usize) -> usize {
        match self {
            Self::Q8_0 => head_dim + Q8_SCALE_BYTES,
            _ => head_dim,
        }
    }

    /// Bytes of one row of `head_dim` values.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        self.row_len(head_dim) * self.storage_dtype().size_in_bytes()
    }

    /// The name users type (`--kv-cache-dtype`) and metrics show.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::Q8_0 => "q8_0",
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The scale of a q8_0 row (`row_len` bytes).
#[inline(always)]
pub fn q8_scale(row: &[u8], head_dim: usize) -> f32 {
    let b = &row[head_dim..head_dim + Q8_SCALE_BYTES];
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_sizes_follow_the_format() {
        assert_eq!(KvCacheDtype::F32.row_bytes(64), 256);
        assert_eq!(KvCacheDtype::F16.row_bytes(64), 128);
        assert_eq!(KvCacheDtype::Q8_0.row_bytes(64), 68);
        assert_eq!(KvCacheDtype::Q8_0.row_len(128), 132);
        for d in [KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::BF16, KvCacheDtype::Q8_0] {
            assert_eq!(KvCacheDtype::of(d.storage_dtype()), Some(d));
        }
        assert_eq!(KvCacheDtype::float(DType::U8), None);
    }
}
