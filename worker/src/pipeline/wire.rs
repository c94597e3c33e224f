//! The stage-to-stage wire format: bincode frames over `common::transport`
//! (length-prefixed, as on the coordinator link), with a step's hidden
//! states following its header as raw little-endian bytes, so a
//! megabyte of activations is not re-encoded element by element.
//!
//! Upstream (the stage before) dials and sends [`StageHello`], then steps;
//! downstream answers [`StageReply`], then one [`StepResult`] per step.
//! Everything a later stage needs travels in the [`StepHeader`]: it does no
//! scheduling and keeps no per-request state.

use std::borrow::Cow;

use candle_core::{DType, Device, Tensor};
use common::protocol::ModelIdentity;
use common::{SampledToken, SamplingParams};
use kernels::AttentionMetadata;
use serde::{Deserialize, Serialize};

use crate::error::{Result, WorkerError};

/// Bumped on any incompatible change of the messages below.
pub const STAGE_PROTOCOL_VERSION: u32 = 5;

/// Largest raw payload after a frame (hidden states, prompt-logprob
/// logits): 64k tokens of an 8192-wide f32 model. Frames themselves keep
/// the protocol's `MAX_FRAME_BYTES`.
pub const MAX_RAW_BYTES: u64 = 2 << 30;

/// The first frame on a link, from the stage before.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageHello {
    pub version: u32,
    /// The upstream stage's name, for the other side's log.
    pub name: String,
    pub model: ModelIdentity,
    pub block_size: u32,
    /// How the upstream stage's KV cache stores values: every stage must
    /// match, as they share the first stage's block ids and its budget.
    pub kv_cache_dtype: String,
    /// The first layer the stage dialled must hold: where upstream's end.
    pub next_layer: u32,
    /// Logprobs as the raw logits (`LogprobsMode::RawLogits`).
    pub raw_logits: bool,
    /// `transport::auth_tag` of the dialling side (`Role::Worker`).
    pub auth_tag: Vec<u8>,
}

pub use common::pipeline::StageInfo;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StageReply {
    Accepted {
        /// `transport::auth_tag` of the listening side (`Role::Coordinator`).
        auth_tag: Vec<u8>,
        /// The least number of KV blocks of this stage and every one after.
        num_blocks: u64,
        /// This stage and every one after it, in order.
        stages: Vec<StageInfo>,
    },
    Refused {
        reason: String,
    },
}

/// Element type of the hidden states on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireDType {
    F32,
    F16,
    Bf16,
}

/// What the last stage needs to sample one sequence's rows: one, or
/// `1 + proposed.len()` when it verifies proposals. The first stage's copy
/// borrows from its requests (nothing is cloned to send a step); the last
/// stage's owns what it read, and expands it into `SamplingRow`s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SequenceSampling<'a> {
    pub params: Cow<'a, SamplingParams>,
    pub seed: u64,
    /// Tokens generated so far (min_tokens, the seeded draw's position).
    pub num_output_tokens: u32,
    /// The prompt and output tokens, only when a penalty reads them
    /// (repetition: both; frequency and presence: the output).
    pub prompt_token_ids: Cow<'a, [u32]>,
    pub output_token_ids: Cow<'a, [u32]>,
    /// The speculative proposals this step verifies (the inputs after the
    /// sequence's last token), each with its row of logits.
    pub proposed: Cow<'a, [u32]>,
}

impl SequenceSampling<'_> {
    /// Rows of logits this sequence samples from.
    pub fn num_rows(&self) -> usize {
        1 + self.proposed.len()
    }
}

/// Whether a penalty reads the output tokens (the prompt's too, for repetition).
pub fn penalties_read_output(p: &SamplingParams) -> (bool, bool) {
    let repetition = p.repetition_penalty != 1.0;
    (repetition || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0, repetition)
}

/// What a stage checks a step's header against: its KV pool's block size,
/// its model's sliding window, hidden size and RoPE table length.
#[derive(Clone, Copy, Debug)]
pub struct StageShape {
    pub block_size: usize,
    pub sliding_window: Option<usize>,
    pub hidden_size: usize,
    pub max_positions: usize,
}

/// One step, as the stage before computed it; `hidden_bytes` bytes of
/// `[T, hidden]` hidden states follow this frame. The first stage's header
/// borrows its batch and requests; a later stage's owns what it read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepHeader<'a> {
    pub step: u64,
    pub dtype: WireDType,
    pub hidden_bytes: u64,
    /// `[T]`: each row's position.
    pub positions: Cow<'a, [u32]>,
    /// Where each sequence's rows, context and new slots are, as the first
    /// stage's runner laid them out (checked by `AttentionMetadata::check`).
    pub meta: Cow<'a, AttentionMetadata>,
    /// Rows that sample, then rows whose logits give prompt logprobs.
    pub logits_indices: Cow<'a, [u32]>,
    pub prompt_logprob_rows: Cow<'a, [u32]>,
    /// One per sampling sequence, in order; their rows (`num_rows`) are
    /// the first rows of `logits_indices`.
    pub sampling: Vec<SequenceSampling<'a>>,
    /// The first stage had requests running since it sent the step before:
    /// a stage's wait for this step is a pipeline bubble, not idleness.
    pub continues: bool,
    /// Microseconds the stages after the first held the step so far, from
    /// its arrival to handing it on (queue and compute), to tell the wire's
    /// share of the round trip.
    pub stage_micros: u64,
}

/// The last stage's answer to one step, relayed back to stage 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StepResult {
    Sampled {
        step: u64,
        /// Per sampling sequence, in order: its token, or where it verified
        /// proposals the draws that confirmed them and the one after.
        sampled: Vec<Vec<SampledToken>>,
        /// Bytes of the prompt-logprob rows' logits (row-major f32, little
        /// endian) that follow this frame.
        prompt_logits_bytes: u64,
        /// `StepHeader::stage_micros` with the last stage's time added.
        stage_micros: u64,
    },
    /// A stage could not compute the step (its requests fail, not the pipeline).
    Failed { step: u64, message: String },
}

impl StepResult {
    /// Bytes that follow this frame.
    pub fn raw_bytes(&self) -> u64 {
        match self {
            Self::Sampled { prompt_logits_bytes, .. } => *prompt_logits_bytes,
            Self::Failed { .. } => 0,
        }
    }

    pub fn step(&self) -> u64 {
        match self {
            Self::Sampled { step, .. } | Self::Failed { step, .. } => *step,
        }
    }

    /// Adds `micros`, the time the stage sending it held the step.
    pub fn add_stage_micros(&mut self, micros: u64) {
        if let Self::Sampled { stage_micros, .. } = self {
            *stage_micros += micros;
        }
    }

    /// Microseconds the later stages held the step (0 for a failed one).
    pub fn stage_micros(&self) -> u64 {
        match self {
            Self::Sampled { stage_micros, .. } => *stage_micros,
            Self::Failed { .. } => 0,
        }
    }
}

impl StepHeader<'_> {
    /// Bytes that follow this frame.
    pub fn raw_bytes(&self) -> u64 {
        self.hidden_bytes
    }

    /// Checks that the header is self-consistent and names only blocks a
    /// pool of `num_blocks` has, so no kernel indexes out of bounds.
    pub fn check(&self, num_blocks: usize, stage: &StageShape, last_stage: bool) -> Result<()> {
        let t = self.positions.len();
        let fail =
            |what: &str| Err(WorkerError::Unsupported(format!("step {} from the stage before: {what}", self.step)));
        if t == 0 {
            return fail("no rows");
        }
        if (self.meta.block_size, self.meta.sliding_window) != (stage.block_size, stage.sliding_window) {
            return fail("attention metadata for another block size or sliding window");
        }
        // The kernels' own check, once for the whole step; the cache write
        // checks its slots itself.
        self.meta.check(t, num_blocks).map_err(|e| WorkerError::Unsupported(format!("step {}: {e}", self.step)))?;
        if self.positions.iter().any(|&p| p as usize >= stage.max_positions) {
            return fail("a position past the model's RoPE table");
        }
        if self.logits_indices.iter().chain(self.prompt_logprob_rows.iter()).any(|&r| r as usize >= t) {
            return fail("a logits row outside the step");
        }
        let sampled_rows = self.sampling.iter().map(SequenceSampling::num_rows).sum::<usize>();
        if last_stage && sampled_rows != self.logits_indices.len() {
            return fail("not one sampling row per sampled row");
        }
        let width = match self.dtype {
            WireDType::F32 => 4,
            WireDType::F16 | WireDType::Bf16 => 2,
        };
        if self.hidden_bytes != (t * stage.hidden_size * width) as u64 {
            return fail("hidden states of another size than [rows, hidden]");
        }
        Ok(())
    }
}

/// f32 values as raw little-endian bytes (prompt-logprob logits).
pub fn f32_to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f32_from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// `[T, hidden]` hidden states as raw little-endian bytes.
pub fn hidden_to_bytes(hidden: &Tensor) -> Result<(WireDType, Vec<u8>)> {
    let flat = hidden.flatten_all()?;
    Ok(match hidden.dtype() {
        DType::F16 => (WireDType::F16, flat.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
        DType::BF16 => (WireDType::Bf16, flat.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
        _ => (WireDType::F32, f32_to_bytes(&flat.to_dtype(DType::F32)?.to_vec1::<f32>()?)),
    })
}

/// The inverse of [`hidden_to_bytes`]: `[rows, hidden]` on `device`.
pub fn hidden_from_bytes(
    dtype: WireDType,
    bytes: &[u8],
    rows: usize,
    hidden: usize,
    device: &Device,
) -> Result<Tensor> {
    let shape = (rows, hidden);
    Ok(match dtype {
        WireDType::F32 => Tensor::from_vec(f32_from_bytes(bytes), shape, device)?,
        WireDType::F16 => {
            let v: Vec<half::f16> = bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]])).collect();
            Tensor::from_vec(v, shape, device)?
        }
        WireDType::Bf16 => {
            let v: Vec<half::bf16> = bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]])).collect();
            Tensor::from_vec(v, shape, device)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> StepHeader<'static> {
        StepHeader {
            step: 7,
            dtype: WireDType::F32,
            hidden_bytes: 3 * 4 * 4,
            positions: vec![0, 1, 5].into(),
            meta: Cow::Owned(AttentionMetadata {
                query_start_loc: vec![0, 2, 3],
                context_lens: vec![2, 6],
                block_tables: vec![vec![1], vec![2]],
                slot_mapping: vec![16, 17, 37],
                block_size: 16,
                sliding_window: None,
            }),
            logits_indices: vec![1, 2].into(),
            prompt_logprob_rows: vec![].into(),
            sampling: vec![],
            continues: false,
            stage_micros: 0,
        }
    }

    #[test]
    fn hidden_states_round_trip_bit_for_bit() {
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.1 - 0.37).collect();
        let t = Tensor::from_vec(values.clone(), (3, 4), &Device::Cpu).unwrap();
        let (dtype, bytes) = hidden_to_bytes(&t).unwrap();
        assert_eq!((dtype, bytes.len()), (WireDType::F32, 48));
        let back = hidden_from_bytes(dtype, &bytes, 3, 4, &Device::Cpu).unwrap();
        assert_eq!(back.flatten_all().unwrap().to_vec1::<f32>().unwrap(), values);
        let h = t.to_dtype(DType::BF16).unwrap();
        let (dtype, bytes) = hidden_to_bytes(&h).unwrap();
        let back = hidden_from_bytes(dtype, &bytes, 3, 4, &Device::Cpu).unwrap();
        assert_eq!(
            back.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
            h.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap()
        );
    }

    fn shape(hidden_size: usize) -> StageShape {
        StageShape { block_size: 16, sliding_window: None, hidden_size, max_positions: 64 }
    }

    #[test]
    fn a_header_naming_blocks_outside_the_pool_is_refused() {
        let h = header();
        h.check(3, &shape(4), false).unwrap();
        assert!(h.check(2, &shape(4), false).is_err(), "block 2 of a pool of 2");
        assert!(h.check(3, &shape(8), false).is_err(), "hidden bytes for another width");
        assert!(h.check(3, &shape(4), true).is_err(), "the last stage needs a sampling row per sampled row");
        // One sequence verifying one proposal samples from both rows.
        let mut verifying = header();
        verifying.sampling = vec![SequenceSampling {
            params: Cow::Owned(SamplingParams::greedy(8)),
            seed: 0,
            num_output_tokens: 1,
            prompt_token_ids: Cow::Borrowed(&[]),
            output_token_ids: Cow::Borrowed(&[]),
            proposed: vec![9].into(),
        }];
        verifying.check(3, &shape(4), true).unwrap();
        verifying.sampling[0].proposed.to_mut().push(10);
        assert!(verifying.check(3, &shape(4), true).is_err(), "3 rows to sample, 2 of logits");
        let mut bad = header();
        bad.meta.to_mut().query_start_loc = vec![0, 3, 2];
        assert!(bad.check(3, &shape(4), false).is_err());
        let mut bad = header();
        bad.meta.to_mut().context_lens = vec![2, 17];
        assert!(bad.check(3, &shape(4), false).is_err(), "context past its block table");
        let mut bad = header();
        bad.positions.to_mut()[2] = 64;
        assert!(bad.check(3, &shape(4), false).is_err(), "a position past the RoPE table");
        assert!(header().check(3, &StageShape { block_size: 8, ..shape(4) }, false).is_err(), "another block size");
        let window = StageShape { sliding_window: Some(4), ..shape(4) };
        assert!(header().check(3, &window, false).is_err(), "another sliding window");
    }
}
