//! How a KV cache stores one token's vector for one kv head (a "row" of
//! `head_dim` values): as floats (f32, f16, bf16: one element each), or as
//! q8_0: `head_dim` unsigned 8-bit codes, then the row's step and minimum
//! (bf16 each, little-endian), in a u8 tensor whose last dimension is
//! `head_dim + 4`. A value is `code * step + min`, the step
//! `(max - min) / 255` of the row: asymmetric, like llama.cpp's q8_1 or
//! KIVI, because the codes then span the row's range rather than
//! `±max |x|`, which cut the flips of greedy tokens against the f32 cache
//! from 27 to 11 over the golden cases (docs/kv-cache-dtype.md). One step
//! per head vector rather than per 32 values keeps a row one contiguous
//! read and costs 4 bytes: a TinyLlama row is 68 bytes against f32's 256
//! (3.76x the tokens).
//!
//! The step and minimum are rounded to bf16 (any f32 exponent, so tiny
//! rows keep their precision) before the codes are chosen, the minimum
//! down and the step up, so every value is within half a step of its code
//! and no code clamps.

use candle_core::DType;
use half::bf16;

/// Bytes after a q8_0 row's codes: its step and minimum, bf16 each.
pub const Q8_PARAM_BYTES: usize = 4;

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
            Self::Q8_0 => head_dim + Q8_PARAM_BYTES,
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

/// A q8_0 row's step and minimum (`row_len` bytes).
#[inline(always)]
pub fn q8_params(row: &[u8], head_dim: usize) -> (f32, f32) {
    let b = &row[head_dim..head_dim + Q8_PARAM_BYTES];
    (bf16::from_le_bytes([b[0], b[1]]).to_f32(), bf16::from_le_bytes([b[2], b[3]]).to_f32())
}

/// The step and minimum of a row whose values lie in `[lo, hi]`, exactly
/// representable in bf16: the minimum rounded down, the step up, so
/// `(hi - min) / step <= 255`. Zero step for a constant row.
pub fn q8_step_and_min(lo: f32, hi: f32) -> (f32, f32) {
    let min = bf16_toward(lo, false);
    (bf16_toward((hi - min) / 255.0, true), min)
}

/// Quantizes one head vector into a q8_0 row (`row_len` bytes).
#[inline(always)]
pub fn quantize_q8_row(x: &[f32], out: &mut [u8]) {
    let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let (step, min) = if x.is_empty() { (0.0, 0.0) } else { q8_step_and_min(lo, hi) };
    let inv = if step == 0.0 { 0.0 } else { 1.0 / step };
    let (codes, params) = out.split_at_mut(x.len());
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = ((v - min) * inv).round_ties_even().clamp(0.0, 255.0) as u8;
    }
    params[..2].copy_from_slice(&bf16::from_f32(step).to_le_bytes());
    params[2..Q8_PARAM_BYTES].copy_from_slice(&bf16::from_f32(min).to_le_bytes());
}

/// `x` rounded to a bf16 upwards (`up`) or downwards, as an f32. bf16 is
/// the top half of an f32, so this truncates the low half and steps one
/// bf16 away from zero when that moved the value the wrong way.
fn bf16_toward(x: f32, up: bool) -> f32 {
    let bits = x.to_bits();
    let truncated = bits & 0xffff_0000;
    // Truncation moves toward zero: wrong way for positive x rounded up and
    // negative x rounded down.
    let away = bits != truncated && (x > 0.0) == up;
    f32::from_bits(if away { truncated + 0x1_0000 } else { truncated })
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

    #[test]
    fn q8_params_are_bf16_and_cover_the_row() {
        for (lo, hi) in [(-1.3f32, 0.7), (0.001, 0.0017), (-3e-7, -1e-7), (2.5, 2.5), (-100.3, 100.1)] {
            let (step, min) = q8_step_and_min(lo, hi);
            assert_eq!(bf16::from_f32(step).to_f32(), step);
            assert_eq!(bf16::from_f32(min).to_f32(), min);
            assert!(min <= lo && (hi - min) / step.max(f32::MIN_POSITIVE) <= 255.0, "{lo} {hi}: {step} {min}");
            // One bf16 rounding above the exact (hi - min) / 255.
            assert!(step <= (hi - min) / 255.0 * 1.008, "{lo} {hi}: {step}");
        }
        assert_eq!(bf16_toward(-1.0 - 1e-3, false), -1.0078125);
        assert_eq!(bf16_toward(-1.0 - 1e-3, true), -1.0);
        assert_eq!(bf16_toward(1.0 + 1e-3, true), 1.0078125);
    }

    #[test]
    fn q8_rows_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..40).map(|i| ((i * 37 % 23) as f32 - 9.0) * 0.173).collect();
        let mut row = vec![0u8; KvCacheDtype::Q8_0.row_len(x.len())];
        quantize_q8_row(&x, &mut row);
        let (step, min) = q8_params(&row, x.len());
        for (&c, &v) in row.iter().zip(&x) {
            assert!((c as f32 * step + min - v).abs() <= 0.5 * step * 1.0001, "{v}");
        }
        let constant = [0.25f32; 8];
        let mut row = vec![0u8; KvCacheDtype::Q8_0.row_len(8)];
        quantize_q8_row(&constant, &mut row);
        assert_eq!(q8_params(&row, 8), (0.0, 0.25));
    }
}
