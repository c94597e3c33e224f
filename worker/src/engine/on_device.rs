//! The step of an engine that samples on its model's device (GPUs): only
//! token ids and the requested logprobs come back to the host.

use super::{Engine, grammar_rows, per_request, rows_of, sampling_rows};
use crate::error::Result;
use crate::profile::{self, Section};
use crate::runner::model_runner::BatchInputs;
use engine_core::{RequestOutput, SchedulerOutput};

impl Engine {
    /// A step whose tokens are drawn on the model's device: penalties,
    /// `min_tokens` bans, the draw and the requested logprobs are computed
    /// there, and only ids (plus those logprobs) come back. Each row's
    /// draw uses its own request's uniform, so seeded output does not
    /// depend on the batch.
    pub(super) fn step_sampling_on_device(
        &mut self,
        step: &SchedulerOutput,
        batch: &BatchInputs,
    ) -> Result<Vec<RequestOutput>> {
        let forward_timer = profile::scope(Section::Forward);
        let outputs = sampling_rows(&self.scheduler, step);
        let runner = &mut self.runner;
        let (logits, masks) =
            self.grammars.masks_beside(&grammar_rows(&outputs), || runner.forward_on_device(batch))?;
        let rows = rows_of(&outputs, &masks, &self.eos_token_ids);
        let (sampled, prompt_logits) = self.runner.sample_on_device(logits, batch, &rows, self.logprobs_mode)?;
        drop(forward_timer);
        drop(rows);
        drop(outputs);
        Ok(self.finish_step(step, per_request(step, sampled), &prompt_logits))
    }
}
