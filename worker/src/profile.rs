//! Where a step's time goes, for `tinyvllm-worker bench --profile`: a few
//! process-wide counters that the benchmark switches on. While off, a probe
//! costs one relaxed atomic load, so the probes stay in the serving path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The parts of a step we time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// Linear layers (weight streaming), including their input/output conversion.
    Matmul,
    /// The KV-cache write and paged attention.
    Attention,
    /// The whole forward pass (the rest of it is norms, RoPE, activations,
    /// residual adds, embedding lookup, tensor bookkeeping).
    Forward,
    /// Sampling and logprobs.
    Sampling,
    /// Scheduling, batch preparation and output processing.
    Scheduler,
}

const SECTIONS: usize = 5;
static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; SECTIONS] = [const { AtomicU64::new(0) }; SECTIONS];

pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Times the rest of the scope (until the guard drops) as `section`.
#[inline]
pub fn scope(section: Section) -> Guard {
    Guard(ENABLED.load(Ordering::Relaxed).then(|| (section, Instant::now())))
}

pub struct Guard(Option<(Section, Instant)>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some((section, start)) = self.0 {
            NANOS[section as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}

/// Accumulated time per section.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals([Duration; SECTIONS]);

impl Totals {
    pub fn now() -> Self {
        Self(std::array::from_fn(|i| Duration::from_nanos(NANOS[i].load(Ordering::Relaxed))))
    }

    pub fn get(&self, section: Section) -> Duration {
        self.0[section as usize]
    }

    pub fn since(&self, earlier: &Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i].saturating_sub(earlier.0[i])))
    }

    pub fn add(&mut self, other: &Self) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }
}

/// A decode-step breakdown: matmuls, attention, the rest of the forward
/// pass, sampling, scheduler, and whatever else the step spent.
#[derive(Clone, Debug, Default)]
pub struct StepProfile {
    pub steps: usize,
    pub wall: Duration,
    pub totals: Totals,
}

impl StepProfile {
    /// (label, time per step in ms, share of the step) rows.
    pub fn rows(&self) -> Vec<(&'static str, f64, f64)> {
        let t = &self.totals;
        let forward = t.get(Section::Forward);
        let (matmul, attention) = (t.get(Section::Matmul), t.get(Section::Attention));
        let model_other = forward.saturating_sub(matmul + attention);
        let other = self.wall.saturating_sub(forward + t.get(Section::Sampling) + t.get(Section::Scheduler));
        let per_step = |d: Duration| d.as_secs_f64() * 1e3 / self.steps.max(1) as f64;
        let share = |d: Duration| d.as_secs_f64() / self.wall.as_secs_f64().max(1e-12);
        [
            ("matmuls", matmul),
            ("attention", attention),
            ("norms, rope, activations, other model ops", model_other),
            ("sampling", t.get(Section::Sampling)),
            ("scheduler and batch preparation", t.get(Section::Scheduler)),
            ("other", other),
            ("step total", self.wall),
        ]
        .into_iter()
        .map(|(label, d)| (label, per_step(d), share(d)))
        .collect()
    }
}

impl std::fmt::Display for StepProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "decode step profile ({} pure decode steps):", self.steps)?;
        for (label, ms, share) in self.rows() {
            writeln!(f, "  {label:<42} {ms:9.3} ms  {:5.1}%", share * 100.0)?;
        }
        Ok(())
    }
}
