//! The first stage's step: schedule here, run the embeddings and this
//! stage's layers, send the hidden states and the step's metadata down the
//! pipeline, and wait for the last stage's sampled tokens before
//! `update_from_output` (the next step of those sequences needs them). One
//! step is in flight at a time.

use engine_core::{Request, SampledToken, Scheduler, SchedulerConfig, SchedulerOutput, TokenLogprobs};

use super::{Engine, sampling_requests};
use crate::error::{Result, WorkerError};
use crate::pipeline::link::Downstream;
use crate::pipeline::wire::{SamplingRow, StepHeader, StepResult, f32_from_bytes, hidden_to_bytes};
use crate::profile::{self, Section};
use crate::runner::model_runner::BatchInputs;
use engine_core::RequestOutput;

impl Engine {
    /// Makes this engine the first stage of a pipeline whose next stage is
    /// `next`. The pipeline has the least block count of its stages, so a
    /// larger cache here shrinks to it (before any request arrives).
    pub fn attach_next_stage(&mut self, next: Downstream) -> Result<()> {
        if self.runner.model().layer_range().is_last() {
            return Err(WorkerError::Unsupported("this engine holds every layer: there is no next stage".into()));
        }
        let chain = usize::try_from(next.num_blocks).unwrap_or(usize::MAX);
        if chain == 0 {
            return Err(WorkerError::KvCache("the next stage has no KV block".into()));
        }
        if chain < self.scheduler.config().num_blocks {
            if self.scheduler.has_unfinished() {
                return Err(WorkerError::Unsupported("attaching a next stage with requests running".into()));
            }
            self.scheduler = Scheduler::new(SchedulerConfig { num_blocks: chain, ..self.scheduler.config().clone() });
            self.runner.reallocate_kv(chain)?;
        }
        self.next_stage = Some(next);
        Ok(())
    }

    /// Whether this engine is the first stage of a pipeline.
    pub fn is_pipelined(&self) -> bool {
        self.next_stage.is_some()
    }

    pub(super) fn step_pipelined(&mut self, step: &SchedulerOutput, batch: &BatchInputs) -> Result<Vec<RequestOutput>> {
        let header_and_hidden = {
            let _t = profile::scope(Section::Forward);
            let hidden = self.runner.execute_first_stage(batch)?;
            let (dtype, bytes) = hidden_to_bytes(&hidden)?;
            self.steps_sent = self.steps_sent.wrapping_add(1);
            let header = StepHeader {
                step: self.steps_sent,
                dtype,
                hidden_bytes: bytes.len() as u64,
                positions: batch.positions.clone(),
                slot_mapping: batch.meta.slot_mapping.clone(),
                query_start_loc: batch.meta.query_start_loc.clone(),
                context_lens: batch.meta.context_lens.clone(),
                block_tables: batch.meta.block_tables.clone(),
                logits_indices: batch.logits_indices.clone(),
                prompt_logprob_rows: batch.prompt_logprob_rows.clone(),
                sampling: sampling_requests(&self.scheduler, step).map(sampling_row).collect(),
            };
            (header, bytes)
        };
        let next = self.next_stage.as_mut().ok_or_else(|| WorkerError::PipelineLost("no next stage".into()))?;
        let (result, raw) = next.round_trip(header_and_hidden)?;
        match result {
            StepResult::Sampled { sampled, .. } => {
                let sampled: Vec<SampledToken> = sampled
                    .into_iter()
                    .map(|s| SampledToken {
                        token_id: s.token_id,
                        logprobs: s.logprobs.map(|(logprob, top)| TokenLogprobs { logprob, top }),
                    })
                    .collect();
                Ok(self.finish_step(step, sampled, &f32_from_bytes(&raw)))
            }
            StepResult::Failed { message, .. } => Err(WorkerError::Unsupported(message)),
        }
    }
}

/// What the last stage needs to sample `req`'s next token: the token
/// history only when a penalty reads it.
fn sampling_row(req: &Request) -> SamplingRow {
    let p = &req.params;
    let repetition = p.repetition_penalty != 1.0;
    let output_read = repetition || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
    SamplingRow {
        params: p.clone(),
        seed: req.sampling_seed,
        num_output_tokens: req.output_token_ids().len() as u32,
        prompt_token_ids: if repetition { req.prompt_token_ids().to_vec() } else { Vec::new() },
        output_token_ids: if output_read { req.output_token_ids().to_vec() } else { Vec::new() },
    }
}
