//! The first stage's step: schedule here, run the embeddings and this
//! stage's layers, send the hidden states and the step's metadata down the
//! pipeline, and take the last stage's sampled tokens when they come back
//! (`update_from_output`; the next step of those sequences needs them).
//!
//! Up to `micro_batches` steps are in flight (vLLM's virtual engines): the
//! scheduler gives each step its share of the requests and skips those
//! whose result is not back (`engine_core::scheduler::in_flight`), so while
//! the later stages compute one micro-batch this stage computes the next.
//! Every stage handles steps in order, so results come back in order.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use engine_core::{Request, SampledToken, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput, spec};

use super::{Engine, StepBackend};
use crate::error::{Result, WorkerError};
use crate::pipeline::link::{Arrived, Downstream};
use crate::pipeline::metrics::PipelineMetrics;
use crate::pipeline::wire::{
    SequenceSampling, StepHeader, StepResult, f32_from_bytes, hidden_to_bytes, penalties_read_output,
};
use crate::profile::{self, Section};
use engine_core::RequestOutput;

/// The first stage's side of its pipeline.
pub(super) struct FirstStage {
    next: Downstream,
    /// Steps sent whose results are not back, oldest first: (wire step
    /// number, when it was handed to the link, what was scheduled).
    in_flight: VecDeque<(u64, Instant, SchedulerOutput)>,
    micro_batches: usize,
    /// Wire step numbers. Random at start, so a result relayed late to a
    /// restarted first stage never matches one of its steps.
    steps_sent: u64,
    /// No request ran since the last step was sent (the next one starts a
    /// busy period, so the later stages' wait for it is no bubble).
    went_idle: bool,
    metrics: Option<PipelineMetrics>,
}

impl Engine {
    /// Makes this engine the first stage of a pipeline whose next stage is
    /// `next`, with up to `micro_batches` steps in flight (default: one per
    /// stage). The pipeline has the least block count of its stages, so a
    /// larger cache here shrinks to it (before any request arrives).
    pub fn attach_next_stage(&mut self, next: Downstream, micro_batches: Option<usize>) -> Result<()> {
        if self.runner.layer_range().is_last() {
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
            if let Some(draft) = &mut self.draft {
                draft.reallocate_kv(chain, self.runner.kv_cache_dtype())?;
            }
        }
        let micro_batches = micro_batches.unwrap_or(next.stages.len() + 1).max(1);
        self.scheduler.set_micro_batches(micro_batches);
        self.backend = StepBackend::Pipelined(Box::new(FirstStage {
            next,
            in_flight: VecDeque::new(),
            micro_batches,
            steps_sent: super::random_seed(),
            went_idle: true,
            metrics: None,
        }));
        Ok(())
    }

    /// Whether this engine is the first stage of a pipeline.
    pub fn is_pipelined(&self) -> bool {
        matches!(self.backend, StepBackend::Pipelined(_))
    }

    /// On a pipeline's first stage, `Err(PipelineLost)` once its next stage
    /// is gone. A busy stage learns it at its next step; an idle one (no
    /// request to step) is asked here, so it leaves the cluster rather than
    /// take requests its pipeline cannot serve.
    pub fn check_next_stage(&self) -> Result<()> {
        match &self.backend {
            StepBackend::Pipelined(p) if p.next.is_lost() => {
                Err(WorkerError::PipelineLost("the next stage went away".into()))
            }
            _ => Ok(()),
        }
    }

    /// Records this stage's pipeline metrics (on a pipeline's first stage).
    pub fn set_pipeline_metrics(&mut self, metrics: PipelineMetrics) {
        if let StepBackend::Pipelined(p) = &mut self.backend {
            p.metrics = Some(metrics);
        }
    }

    /// Sends the next micro-batch if one may go, then takes the results
    /// that are back: waiting for one when the pipeline is full or nothing
    /// else could be sent.
    pub(super) fn step_pipelined(&mut self) -> Result<Vec<RequestOutput>> {
        let started = Instant::now();
        let room = first_stage(&mut self.backend).is_ok_and(|p| p.in_flight.len() < p.micro_batches);
        let sent = room && self.send_step()?;
        if !sent {
            self.last_step.scheduled.clear();
            self.last_step.num_batched_tokens = 0;
        }
        let p = first_stage(&mut self.backend)?;
        let mut results = Vec::new();
        let mut waited = Duration::ZERO;
        if !p.in_flight.is_empty() && (!sent || p.in_flight.len() >= p.micro_batches) {
            let wait = Instant::now();
            results.push(p.next.recv_blocking()?);
            waited = wait.elapsed();
        }
        while let Some(result) = p.next.try_recv()? {
            results.push(result);
        }
        let mut outputs = Vec::new();
        for result in results {
            outputs.extend(self.take_result(result)?);
        }
        let p = first_stage(&mut self.backend)?;
        p.went_idle |= !self.scheduler.has_unfinished();
        if let Some(m) = &p.metrics {
            m.busy_period(started.elapsed(), waited);
        }
        Ok(outputs)
    }

    /// Schedules a micro-batch and sends it; `false` if nothing could go.
    fn send_step(&mut self) -> Result<bool> {
        let sched_timer = profile::scope(Section::Scheduler);
        let step = self.schedule_step()?;
        if step.scheduled.is_empty() {
            return Ok(false);
        }
        let batch = self.runner.prepare(&step, |id| self.scheduler.request(id).expect("scheduled request exists"));
        drop(sched_timer);
        let computing = Instant::now();
        let (header, bytes) = {
            let _t = profile::scope(Section::Forward);
            let hidden = self.runner.execute_first_stage(&batch)?;
            let (dtype, bytes) = hidden_to_bytes(&hidden)?;
            let p = first_stage(&mut self.backend)?;
            p.steps_sent = p.steps_sent.wrapping_add(1);
            let header = StepHeader {
                step: p.steps_sent,
                dtype,
                hidden_bytes: bytes.len() as u64,
                positions: Cow::Borrowed(&batch.positions),
                meta: Cow::Borrowed(&batch.meta),
                logits_indices: Cow::Borrowed(&batch.logits_indices),
                prompt_logprob_rows: Cow::Borrowed(&batch.prompt_logprob_rows),
                sampling: step
                    .scheduled
                    .iter()
                    .filter(|s| s.samples)
                    .map(|s| sampling_row(self.scheduler.request(s.id).expect("scheduled request exists"), s))
                    .collect(),
                continues: !std::mem::replace(&mut p.went_idle, false),
                stage_micros: 0,
            };
            (header, bytes)
        };
        let computed = computing.elapsed();
        let p = first_stage(&mut self.backend)?;
        let wire_bytes = p.next.send(&header, bytes)?;
        if let Some(m) = &p.metrics {
            m.computed(computed);
            m.sent(wire_bytes);
        }
        let step_no = header.step;
        drop(header); // it borrows `step`'s proposals
        p.in_flight.push_back((step_no, Instant::now(), step));
        Ok(true)
    }

    /// Applies a result to the oldest step in flight (the one it answers;
    /// a result for no step in flight is a stale one, dropped).
    fn take_result(&mut self, result: Arrived<StepResult>) -> Result<Vec<RequestOutput>> {
        let p = first_stage(&mut self.backend)?;
        let step_no = result.frame.step();
        if p.in_flight.front().is_none_or(|(expected, ..)| *expected != step_no) {
            tracing::warn!("pipeline: dropped the result of step {step_no}, which is not the oldest in flight");
            return Ok(Vec::new());
        }
        let (_, sent_at, step) = p.in_flight.pop_front().expect("checked above");
        if let Some(m) = &p.metrics {
            m.received(result.bytes);
            let held = Duration::from_micros(result.frame.stage_micros());
            m.transfer(result.at.saturating_duration_since(sent_at).saturating_sub(held));
        }
        match result.frame {
            StepResult::Sampled { sampled, .. } => {
                check_verified(&step, &sampled, step_no)?;
                Ok(self.finish_step(&step, sampled, &f32_from_bytes(&result.raw)))
            }
            StepResult::Failed { message, .. } => Err(WorkerError::Unsupported(message)),
        }
    }
}

/// The first stage's pipeline state; an error if the backend is local
/// (only a pipelined engine's steps call this).
fn first_stage(backend: &mut StepBackend) -> Result<&mut FirstStage> {
    match backend {
        StepBackend::Pipelined(p) => Ok(p),
        StepBackend::Host | StepBackend::Device => Err(WorkerError::PipelineLost("no next stage".into())),
    }
}

/// What the last stage needs to sample `req`'s next token, or to verify
/// its proposals: the token history only when a penalty reads it.
fn sampling_row<'a>(req: &'a Request, scheduled: &'a ScheduledRequest) -> SequenceSampling<'a> {
    let p = &req.params;
    let (output_read, repetition) = penalties_read_output(p);
    let none: &[u32] = &[];
    SequenceSampling {
        params: Cow::Borrowed(p),
        seed: req.sampling_seed,
        num_output_tokens: req.output_token_ids().len() as u32,
        prompt_token_ids: Cow::Borrowed(if repetition { req.prompt_token_ids() } else { none }),
        output_token_ids: Cow::Borrowed(if output_read { req.output_token_ids() } else { none }),
        proposed: Cow::Borrowed(&scheduled.spec_token_ids),
    }
}

/// Checks that a result answers `step`: per sampling request, in order, a
/// verified run of its proposals (`spec::is_verified_run`). Anything else
/// would leave a request with no token to go on from.
fn check_verified(step: &SchedulerOutput, sampled: &[Vec<SampledToken>], step_no: u64) -> Result<()> {
    let sampling: Vec<_> = step.scheduled.iter().filter(|s| s.samples).collect();
    let fits = sampling.len() == sampled.len()
        && sampling.iter().zip(sampled).all(|(s, kept)| {
            let tokens: Vec<u32> = kept.iter().map(|t| t.token_id).collect();
            spec::is_verified_run(&s.spec_token_ids, &tokens)
        });
    if fits {
        Ok(())
    } else {
        Err(WorkerError::Unsupported(format!("the last stage's result of step {step_no} does not answer it")))
    }
}
