//! Rotary position embeddings: the frequencies a model's `rope_scaling`
//! (llama3, YaRN, linear) or a GGUF file's frequency factors give, YaRN's
//! scale of cos and sin, partial rotary, and Gemma 3's per-layer bases.

use serde::Deserialize;

use super::config::{LayerAttention, ModelConfig};
use super::{ModelError, Result};

/// `rope_scaling` as Hugging Face writes it: `llama3`, `yarn` and `linear`
/// change the frequencies (YaRN scales cos and sin too); `default` (or
/// none) keeps them.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN's correction range, in rotations (32 and 1 by default).
    #[serde(default)]
    pub beta_fast: Option<f64>,
    #[serde(default)]
    pub beta_slow: Option<f64>,
    /// YaRN: whether the correction range is rounded to whole dims (true
    /// by default, as transformers reads a config without the key).
    #[serde(default)]
    pub truncate: Option<bool>,
    /// YaRN's scale of cos and sin; derived from the factor (and `mscale`,
    /// `mscale_all_dim`) when absent.
    #[serde(default)]
    pub attention_factor: Option<f64>,
    #[serde(default)]
    pub mscale: Option<f64>,
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
}

impl RopeScaling {
    /// YaRN's factor, as transformers takes it: the ratio of the context to
    /// the pretrained one when the config names the latter.
    fn yarn_factor(&self, max_position_embeddings: usize) -> f64 {
        match self.original_max_position_embeddings {
            Some(original) if original > 0 => max_position_embeddings as f64 / original as f64,
            _ => self.factor.unwrap_or(1.0),
        }
    }
}

impl ModelConfig {
    /// The config whose RoPE layer `layer` uses: Gemma 3's sliding layers
    /// rotate with their own base, unscaled; every other layer with the
    /// model's.
    pub fn layer_rope(&self, layer: usize) -> std::borrow::Cow<'_, ModelConfig> {
        match (self.local_rope_theta, self.layer_types.get(layer)) {
            (Some(theta), Some(LayerAttention::Sliding)) => std::borrow::Cow::Owned(ModelConfig {
                rope_theta: theta,
                rope_scaling: None,
                rope_freq_factors: None,
                ..self.clone()
            }),
            _ => std::borrow::Cow::Borrowed(self),
        }
    }

    /// Inverse RoPE frequencies, one per rotated pair, with `llama3` scaling
    /// applied as transformers' `_compute_llama3_parameters` does, or
    /// divided by a GGUF file's frequency factors as llama.cpp's `rope`
    /// divides them.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let base = self.unscaled_rope_inv_freq();
        if let Some(factors) = &self.rope_freq_factors {
            return base.iter().zip(factors).map(|(inv, factor)| inv / factor).collect();
        }
        let Some(scaling) = &self.rope_scaling else { return base };
        match scaling.rope_type.as_str() {
            "llama3" => {}
            "yarn" => return self.yarn_inv_freq(scaling, base),
            "linear" => return base.iter().map(|inv| inv / scaling.factor.unwrap_or(1.0)).collect(),
            _ => return base,
        }
        let factor = scaling.factor.unwrap_or(8.0);
        let low = scaling.low_freq_factor.unwrap_or(1.0);
        let high = scaling.high_freq_factor.unwrap_or(4.0);
        let old_len = scaling.original_max_position_embeddings.unwrap_or(8192) as f64;
        let low_freq_wavelen = old_len / low;
        let high_freq_wavelen = old_len / high;
        base.into_iter()
            .map(|inv| {
                let wavelen = 2.0 * std::f64::consts::PI / inv;
                if wavelen < high_freq_wavelen {
                    inv
                } else if wavelen > low_freq_wavelen {
                    inv / factor
                } else {
                    let smooth = (old_len / wavelen - low) / (high - low);
                    (1.0 - smooth) * inv / factor + smooth * inv
                }
            })
            .collect()
    }

    /// YaRN (transformers' `_compute_yarn_parameters`): pairs rotating more
    /// than `beta_fast` times over the pretrained context keep their
    /// frequency, those under `beta_slow` are divided by the factor, and a
    /// linear ramp blends the pairs between.
    fn yarn_inv_freq(&self, s: &RopeScaling, base: Vec<f64>) -> Vec<f64> {
        let dim = self.rotary_dim as f64;
        let original = s.original_max_position_embeddings.unwrap_or(self.max_position_embeddings) as f64;
        let factor = s.yarn_factor(self.max_position_embeddings);
        let correction_dim = |rotations: f64| {
            dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * self.rope_theta.ln())
        };
        let (mut low, mut high) =
            (correction_dim(s.beta_fast.unwrap_or(32.0)), correction_dim(s.beta_slow.unwrap_or(1.0)));
        if s.truncate.unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, high) = (low.max(0.0), high.min(dim - 1.0));
        let span = if low == high { 0.001 } else { high - low };
        base.iter()
            .enumerate()
            .map(|(i, &inv)| {
                let extrapolation = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
                inv / factor * (1.0 - extrapolation) + inv * extrapolation
            })
            .collect()
    }

    /// The factor cos and sin are scaled by: YaRN's attention factor, 1
    /// for every other scaling.
    pub fn rope_attention_factor(&self) -> f64 {
        let Some(s) = self.rope_scaling.as_ref().filter(|s| s.rope_type == "yarn") else { return 1.0 };
        if let Some(a) = s.attention_factor {
            return a;
        }
        let factor = s.yarn_factor(self.max_position_embeddings);
        let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
        match (s.mscale, s.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
            _ => mscale(factor, 1.0),
        }
    }

    /// Inverse RoPE frequencies without any scaling: `theta^(-2i/d)`.
    fn unscaled_rope_inv_freq(&self) -> Vec<f64> {
        let dim = self.rotary_dim;
        (0..dim / 2).map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / dim as f64)).collect()
    }

    /// The scaling as per-pair frequency factors (`unscaled / scaled`), the
    /// form GGUF's `rope_freqs.weight` stores; None where nothing is scaled.
    pub fn rope_freq_factors(&self) -> Option<Vec<f64>> {
        if self.rope_freq_factors.is_none() && self.rope_scaling.is_none() {
            return None;
        }
        Some(
            self.unscaled_rope_inv_freq()
                .iter()
                .zip(self.rope_inv_freq())
                .map(|(base, scaled)| base / scaled)
                .collect(),
        )
    }

    /// Checks GGUF frequency factors against this model's shape: one finite,
    /// positive factor per rotated pair.
    pub fn with_rope_freq_factors(self, factors: Vec<f64>) -> Result<Self> {
        if factors.len() != self.rotary_dim / 2 {
            return Err(ModelError::InvalidConfig(format!(
                "rope_freqs.weight has {} factors, expected one per rotated pair ({})",
                factors.len(),
                self.rotary_dim / 2
            )));
        }
        if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return Err(ModelError::InvalidConfig(format!("rope_freqs.weight holds {bad}, not a positive factor")));
        }
        Ok(Self { rope_freq_factors: Some(factors), ..self })
    }
}
