//! The engine's view of a step plan (`--device metal`, `metal-emulated`):
//! whether one runs the step, and the device-memory traffic it measures for
//! `bench --profile`.

use std::borrow::Cow;

use common::SampledToken;
use engine_core::Request;
use kernels::metal::step::{SampleRow, TokenEdit};

use super::{Engine, grammar_rows, rows_of};
use crate::error::Result;
use crate::profile::{self, Section};
use crate::runner::grammar::Grammars;
use crate::runner::logprobs::LogprobsMode;
use crate::runner::model_runner::{BatchInputs, ModelRunner};
use crate::runner::plan::Traffic;
use crate::runner::plan_sampling;

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

/// A step whose sampled rows the plan's GPU sampler takes (any sampling
/// parameters, logprobs and grammar masks; not prompt logprobs, which need
/// their rows' logits), run on the plan with the draws on the GPU: only
/// the tokens, and what their logprobs need, come back. None when the step
/// needs the host sampler. A constrained step computes its masks before the
/// step (the host path computes them beside it).
pub(super) fn sample_on_plan(
    runner: &mut ModelRunner,
    grammars: &mut Grammars,
    batch: &BatchInputs,
    outputs: &[(&Request, Cow<'_, [u32]>)],
    (eos_token_ids, mode): (&[u32], LogprobsMode),
) -> Result<Option<Vec<SampledToken>>> {
    if outputs.is_empty() || !batch.prompt_logprob_rows.is_empty() || runner.plan_mut().is_none() {
        return Ok(None);
    }
    let unmasked = vec![None; outputs.len()];
    let rows = rows_of(outputs, &unmasked, eos_token_ids);
    let edits: Vec<Vec<TokenEdit>> = rows.iter().map(plan_sampling::edits_of).collect();
    let params: Vec<SampleRow> = plan_sampling::sample_rows(&rows, &edits);
    if !runner.samples_on_plan(&params) {
        return Ok(None);
    }
    let masks = grammars.masks_beside(&grammar_rows(outputs), || Ok(()))?.1;
    let rows = rows_of(outputs, &masks, eos_token_ids);
    let params: Vec<SampleRow> = plan_sampling::sample_rows(&rows, &edits);
    let _t = profile::scope(Section::Forward);
    let Some(sampled) = runner.execute_sampled(batch, &params) else { return Ok(None) };
    Ok(Some(sampled?.into_iter().map(|s| plan_sampling::sampled_token(s, mode)).collect()))
}
