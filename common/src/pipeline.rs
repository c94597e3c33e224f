//! Pipeline parallelism's shared vocabulary: which decoder layers a stage
//! holds ([`LayerRange`]) and how a model's layers are split over stages in
//! proportion to their memory ([`split_layers`]). Pure functions; the data
//! path lives in the worker (`worker::pipeline`).

use serde::{Deserialize, Serialize};

/// Decoder layers `start..end` of a model with `total` layers. The stage
/// holding layer 0 also holds the embeddings; the one holding the last
/// layer also holds the final norm and lm_head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRange {
    pub start: usize,
    pub end: usize,
    pub total: usize,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayerRangeError {
    #[error("--layers {0:?}: expected FIRST-LAST (inclusive, e.g. 0-11)")]
    Syntax(String),
    #[error("--layers {given}: the model has {total} layers (0-{last})", last = .total.saturating_sub(1))]
    OutOfRange { given: String, total: usize },
    #[error("cannot split {layers} layers over {stages} stages: each stage needs at least one layer")]
    TooManyStages { layers: usize, stages: usize },
    #[error("cannot split layers over no stage, or over stages with no memory")]
    NoStages,
}

impl LayerRange {
    /// Every layer: a worker that is not part of a pipeline.
    pub fn full(total: usize) -> Self {
        Self { start: 0, end: total, total }
    }

    /// Parses `FIRST-LAST` (inclusive, as users write it) for a model of
    /// `total` layers.
    pub fn parse(text: &str, total: usize) -> Result<Self, LayerRangeError> {
        let syntax = || LayerRangeError::Syntax(text.to_string());
        let (first, last) = text.split_once('-').ok_or_else(syntax)?;
        let first: usize = first.trim().parse().map_err(|_| syntax())?;
        let last: usize = last.trim().parse().map_err(|_| syntax())?;
        if first > last || last >= total {
            return Err(LayerRangeError::OutOfRange { given: text.to_string(), total });
        }
        Ok(Self { start: first, end: last + 1, total })
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Holds the embeddings (and runs the scheduler).
    pub fn is_first(&self) -> bool {
        self.start == 0
    }

    /// Holds the final norm and lm_head (and samples).
    pub fn is_last(&self) -> bool {
        self.end == self.total
    }

    pub fn is_full(&self) -> bool {
        self.is_first() && self.is_last()
    }

    /// Whether the stage holding these decoder layers uses the tensor
    /// `name` (a Hugging Face name): its own layers', the embeddings on the
    /// first stage, the final norm and lm_head on the last (the embeddings
    /// too when they are tied to the lm_head).
    pub fn holds_tensor(&self, name: &str, tied_embeddings: bool) -> bool {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let layer = rest.split('.').next().and_then(|n| n.parse::<usize>().ok());
            return layer.is_some_and(|l| (self.start..self.end).contains(&l));
        }
        match name {
            "model.embed_tokens.weight" => self.is_first() || (self.is_last() && tied_embeddings),
            _ if name.starts_with("model.norm.") || name.starts_with("lm_head.") => self.is_last(),
            _ => true,
        }
    }
}

impl std::fmt::Display for LayerRange {
    /// Inclusive, as `--layers` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.start, self.end.saturating_sub(1))
    }
}

/// One stage of a worker's pipeline, as reported at registration and shown
/// in `/v1/workers`. A worker that is no pipeline reports itself as its
/// one stage, so every worker reports its resident memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageInfo {
    /// The worker process's name.
    pub name: String,
    /// Inclusive, as `--layers` takes it ("0-11").
    pub layers: String,
    /// Bytes of weights the stage holds.
    pub weight_bytes: u64,
    /// Bytes of its KV cache's block pools.
    pub kv_bytes: u64,
    /// Its Prometheus endpoint, HOST:PORT, if it serves one (a later
    /// stage's is listed at the coordinator's /v1/prometheus/targets through
    /// the first stage, as it never talks to the coordinator).
    pub metrics_address: Option<String>,
    /// How its KV cache stores values (`--kv-cache-dtype`): f32, f16, bf16, q8_0.
    pub kv_cache_dtype: String,
    /// Tokens its KV cache holds: blocks x block size.
    pub kv_capacity_tokens: u64,
}

/// The stages' memory together, once they can split `total` layers: at
/// least one stage, some memory, no more stages than layers.
fn memory_sum(total: usize, memory: &[u64]) -> Result<u128, LayerRangeError> {
    let sum: u128 = memory.iter().map(|&m| u128::from(m)).sum();
    if memory.is_empty() || sum == 0 {
        return Err(LayerRangeError::NoStages);
    }
    if memory.len() > total {
        return Err(LayerRangeError::TooManyStages { layers: total, stages: memory.len() });
    }
    Ok(sum)
}

/// Splits `total` layers over stages in proportion to `memory` (bytes each
/// stage can give to the model), in order, each stage at least one layer
/// (vLLM likewise refuses more stages than layers). The shares are rounded
/// by largest remainder, ties to the earlier stage, so the result is exact
/// and deterministic.
pub fn split_layers(total: usize, memory: &[u64]) -> Result<Vec<LayerRange>, LayerRangeError> {
    let stages = memory.len();
    let sum = memory_sum(total, memory)?;
    // Shares of `total` by memory, rounded down, the rest by largest remainder.
    let total_wide = total as u128;
    let mut counts: Vec<usize> = memory.iter().map(|&m| (total_wide * u128::from(m) / sum) as usize).collect();
    let mut remainders: Vec<(u128, usize)> =
        memory.iter().enumerate().map(|(i, &m)| (total_wide * u128::from(m) % sum, i)).collect();
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let missing = total - counts.iter().sum::<usize>();
    for &(_, i) in remainders.iter().take(missing) {
        counts[i] += 1;
    }
    // A stage with no layer takes one from the stage with the most (the
    // earliest on a tie); there are at least as many layers as stages.
    while let Some(empty) = counts.iter().position(|&n| n == 0) {
        let most = (0..stages).max_by_key(|&i| (counts[i], std::cmp::Reverse(i))).expect("stages > 0");
        counts[most] -= 1;
        counts[empty] += 1;
    }
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|n| {
            let range = LayerRange { start, end: start + n, total };
            start += n;
            range
        })
        .collect())
}

/// Splits layers of the given weights (bytes or parameters, each layer's)
/// over stages so that each stage's share of the weight follows `memory`,
/// in order, each stage at least one layer. Layers of one weight split as
/// [`split_layers`] splits a count; layers that differ (GLM-4.5's dense
/// first layer among mixture-of-experts layers, Qwen3-MoE's
/// `mlp_only_layers`) are cut where each stage's running total comes
/// closest to its share of the whole, so a stage of dense layers takes
/// more of them.
pub fn split_layers_by_weight(weights: &[u64], memory: &[u64]) -> Result<Vec<LayerRange>, LayerRangeError> {
    let total = weights.len();
    if weights.windows(2).all(|w| w[0] == w[1]) {
        return split_layers(total, memory);
    }
    let stages = memory.len();
    let memory_sum = memory_sum(total, memory)?;
    let weight_sum: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    let mut ranges = Vec::with_capacity(stages);
    let (mut start, mut done, mut memory_before) = (0usize, 0u128, 0u128);
    for (s, &m) in memory.iter().enumerate() {
        memory_before += u128::from(m);
        // Where this stage's running total should end, scaled by the
        // memory sum so that it stays an integer.
        let target = weight_sum * memory_before;
        let last_end = total - (stages - s - 1); // leave a layer per later stage
        let mut end = start + 1;
        done += u128::from(weights[start]);
        while end < last_end && s + 1 < stages {
            let next = done + u128::from(weights[end]);
            // Take the next layer while that brings the total closer to the target.
            if (next * memory_sum).abs_diff(target) >= (done * memory_sum).abs_diff(target) {
                break;
            }
            done = next;
            end += 1;
        }
        if s + 1 == stages {
            end = total;
        }
        ranges.push(LayerRange { start, end, total });
        start = end;
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_holds_its_layers_and_its_end_of_the_model() {
        let (first, last) = (LayerRange { start: 0, end: 2, total: 5 }, LayerRange { start: 2, end: 5, total: 5 });
        let middle = LayerRange { start: 2, end: 3, total: 5 };
        let holds = |name: &str, range: LayerRange, tied: bool| range.holds_tensor(name, tied);
        assert!(holds("model.layers.1.mlp.up_proj.weight", first, false));
        assert!(!holds("model.layers.2.mlp.up_proj.weight", first, false));
        assert!(!holds("model.layers.12.mlp.up_proj.weight", last, false));
        assert!(holds("model.embed_tokens.weight", first, false));
        assert!(!holds("model.embed_tokens.weight", last, false));
        assert!(holds("model.embed_tokens.weight", last, true), "tied: the lm_head");
        assert!(!holds("model.embed_tokens.weight", middle, true));
        assert!(holds("lm_head.weight", last, false) && !holds("lm_head.weight", middle, false));
        assert!(holds("model.norm.weight", last, false) && !holds("model.norm.weight", first, false));
    }

    #[test]
    fn parses_inclusive_ranges_and_refuses_bad_ones() {
        assert_eq!(LayerRange::parse("0-11", 22).unwrap(), LayerRange { start: 0, end: 12, total: 22 });
        assert_eq!(LayerRange::parse("12-21", 22).unwrap().to_string(), "12-21");
        assert!(LayerRange::parse("12-21", 22).unwrap().is_last());
        assert!(matches!(LayerRange::parse("3", 22), Err(LayerRangeError::Syntax(_))));
        assert!(matches!(LayerRange::parse("5-4", 22), Err(LayerRangeError::OutOfRange { .. })));
        assert!(matches!(LayerRange::parse("0-22", 22), Err(LayerRangeError::OutOfRange { .. })));
    }

    #[test]
    fn splits_in_proportion_to_memory() {
        let ranges = |total, mem: &[u64]| -> Vec<String> {
            split_layers(total, mem).unwrap().iter().map(ToString::to_string).collect()
        };
        assert_eq!(ranges(22, &[8, 8]), ["0-10", "11-21"]);
        assert_eq!(ranges(22, &[16, 8]), ["0-14", "15-21"]);
        assert_eq!(ranges(5, &[1, 1, 1]), ["0-1", "2-3", "4-4"]);
        assert_eq!(ranges(2, &[100, 1]), ["0-0", "1-1"], "every stage gets a layer");
        assert_eq!(split_layers(2, &[1, 1, 1]), Err(LayerRangeError::TooManyStages { layers: 2, stages: 3 }));
        assert_eq!(split_layers(4, &[]), Err(LayerRangeError::NoStages));
    }

    #[test]
    fn layers_of_different_weights_split_by_weight() {
        let ranges = |weights: &[u64], mem: &[u64]| -> Vec<String> {
            split_layers_by_weight(weights, mem).unwrap().iter().map(ToString::to_string).collect()
        };
        // One dense layer of weight 1, then mixture layers of 10 (GLM-4.5):
        // 1 + 10 + 10 against 10 + 10 + 10 for two equal stages.
        assert_eq!(ranges(&[1, 10, 10, 10, 10, 10], &[1, 1]), ["0-2", "3-5"]);
        // Equal weights split as a count does.
        assert_eq!(ranges(&[7; 22], &[16, 8]), ["0-14", "15-21"]);
        // A heavy middle layer; the larger stage first.
        assert_eq!(ranges(&[1, 1, 1, 1, 12, 1, 1, 1], &[3, 1]), ["0-4", "5-7"]);
        assert_eq!(ranges(&[1, 1, 100], &[1, 1, 1]), ["0-0", "1-1", "2-2"], "every stage gets a layer");
        assert_eq!(
            split_layers_by_weight(&[1, 2], &[1, 1, 1]),
            Err(LayerRangeError::TooManyStages { layers: 2, stages: 3 })
        );
        assert_eq!(split_layers_by_weight(&[1, 2], &[]), Err(LayerRangeError::NoStages));
    }

    #[test]
    fn a_split_covers_every_layer_once() {
        for total in 1..40 {
            for mem in [vec![3u64, 5, 7], vec![1, 1], vec![10, 1, 1, 1]] {
                let weights: Vec<u64> = (0..total as u64).map(|l| 1 + (l * 7919) % 13).collect();
                for split in [split_layers(total, &mem), split_layers_by_weight(&weights, &mem)] {
                    let Ok(split) = split else { continue };
                    assert_eq!(split.first().unwrap().start, 0);
                    assert_eq!(split.last().unwrap().end, total);
                    assert!(split.iter().all(|r| !r.is_empty()), "{split:?}");
                    assert!(split.windows(2).all(|w| w[0].end == w[1].start));
                }
            }
        }
    }
}
