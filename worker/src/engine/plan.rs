//! The engine's view of a step plan (`--device metal`, `metal-emulated`):
//! whether one runs the step, and the device-memory traffic it measures for
//! `bench --profile`.

use std::borrow::Cow;

use common::SampledToken;
use engine_core::Request;

use super::Engine;
use crate::error::Result;
use crate::profile::{self, Section};
use crate::runner::grammar::Grammars;
use crate::runner::model_runner::{BatchInputs, ModelRunner};
use crate::runner::plan::Traffic;
use crate::runner::sampler::is_plain_argmax;

impl Engine {
    /// Whether a plan of our GPU kernels runs the step (`--device metal`,
    /// `metal-emulated`) rather than candle's ops.
    pub fn runs_plan(&mut self) -> bool {
        self.runner.plan_mut().is_some()
    }

    /// Starts or stops measuring the step plan's device-memory traffic
    /// (`bench --profile`); false without a plan that can count.
    pub fn count_plan_traffic(&mut self, on: bool) -> bool {
        self.runner.plan_mut().is_some_and(|p| p.count_traffic(on))
    }

    /// The last step's device-memory traffic, while counting.
    pub fn last_plan_traffic(&mut self) -> Option<Traffic> {
        self.runner.plan_mut().and_then(|p| p.last_traffic())
    }
}

/// A step whose every sampled row is a plain argmax (greedy, no
/// logprobs, penalty, bias, ban or grammar) and that wants no prompt
/// logprobs, run on the plan with the argmax on the GPU: only token ids
/// come back. None when the step needs the host sampler.
pub(super) fn greedy_on_plan(
    runner: &mut ModelRunner,
    grammars: &Grammars,
    batch: &BatchInputs,
    outputs: &[(&Request, Cow<'_, [u32]>)],
) -> Result<Option<Vec<SampledToken>>> {
    let plain = |(req, output): &(&Request, Cow<'_, [u32]>)| {
        req.params.logprobs.is_none() && is_plain_argmax(&req.params, output.len(), false)
    };
    if outputs.is_empty()
        || !batch.prompt_logprob_rows.is_empty()
        || grammars.any_constrained(outputs.iter().map(|(req, _)| req.id))
        || !outputs.iter().all(plain)
    {
        return Ok(None);
    }
    let _t = profile::scope(Section::Forward);
    let Some(tokens) = runner.execute_greedy(batch) else { return Ok(None) };
    Ok(Some(tokens?.into_iter().map(|token_id| SampledToken { token_id, logprobs: None }).collect()))
}
