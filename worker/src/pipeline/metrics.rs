//! Per-stage pipeline metrics, on each stage's own Prometheus endpoint
//! (`tinyvllm:pipeline_*`, beside vLLM's names; every series also carries
//! the stage's `layers`):
//!
//! - `step_seconds`: this stage's compute of one step (its layers; on the
//!   first stage also the embeddings, on the last the sampling);
//! - `step_sent_bytes` / `step_received_bytes`: what one step put on and
//!   took off this stage's links (frames and raw activations or logits);
//! - `wait_seconds{for}`: a wait while requests were running, for the
//!   previous stage's next step (`previous_stage`, later stages) or for a
//!   result (`results`, the first stage, when its steps in flight are all
//!   it may have);
//! - `transfer_seconds` (first stage): a step's round trip less the time
//!   the later stages held it: the wire and hand-offs of all its hops;
//! - `active_seconds_total` / `idle_seconds_total` and `bubble_fraction`:
//!   wall time with requests running, the part of it this stage spent
//!   waiting, and their ratio since start (a dashboard takes the ratio of
//!   the two counters' rates instead).
//!
//! The handles are cheap clones of shared counters: the engine thread, the
//! stage's compute thread and its link task record into the same series.

use std::collections::HashMap;
use std::time::Duration;

use prometheus::{Counter, Gauge, Histogram, HistogramOpts, Opts, Registry};

/// Seconds: from 0.1 ms (a small stage's decode step) to 10 s (a long prefill).
const SECONDS_BUCKETS: [f64; 16] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Bytes: from a decode step of a small model to a long prefill of a large one.
const BYTES_BUCKETS: [f64; 12] = [
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
    268435456.0,
    1073741824.0,
];

#[derive(Clone)]
pub struct PipelineMetrics {
    step_seconds: Histogram,
    sent_bytes: Histogram,
    received_bytes: Histogram,
    wait_seconds: Histogram,
    transfer_seconds: Histogram,
    active_seconds: Counter,
    idle_seconds: Counter,
    bubble_fraction: Gauge,
}

impl PipelineMetrics {
    /// Registers the series of the stage holding `layers` ("0-11") in
    /// `registry`; `first` says whether it is the first stage (it waits for
    /// results rather than for a previous stage).
    pub fn new(registry: &Registry, layers: &str, first: bool) -> prometheus::Result<Self> {
        let labels = HashMap::from([("layers".to_string(), layers.to_string())]);
        let opts = |name: &str, help: &str| Opts::new(name, help).const_labels(labels.clone());
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(HistogramOpts::from(opts(name, help)).buckets(buckets.to_vec()))
        };
        let waits_for = if first { "results" } else { "previous_stage" };
        let wait_opts = opts(
            "tinyvllm:pipeline_wait_seconds",
            "Waits while requests were running, for the previous stage or (first stage) for results.",
        )
        .const_label("for", waits_for);
        let m = Self {
            step_seconds: histogram(
                "tinyvllm:pipeline_step_seconds",
                "This stage's compute of one step.",
                &SECONDS_BUCKETS,
            )?,
            sent_bytes: histogram("tinyvllm:pipeline_step_sent_bytes", "Bytes one step sent.", &BYTES_BUCKETS)?,
            received_bytes: histogram(
                "tinyvllm:pipeline_step_received_bytes",
                "Bytes one step received.",
                &BYTES_BUCKETS,
            )?,
            wait_seconds: Histogram::with_opts(HistogramOpts::from(wait_opts).buckets(SECONDS_BUCKETS.to_vec()))?,
            transfer_seconds: histogram(
                "tinyvllm:pipeline_transfer_seconds",
                "A step's round trip less the later stages' time with it (first stage): wire and hand-offs.",
                &SECONDS_BUCKETS,
            )?,
            active_seconds: Counter::with_opts(opts(
                "tinyvllm:pipeline_active_seconds_total",
                "Wall time with requests running.",
            ))?,
            idle_seconds: Counter::with_opts(opts(
                "tinyvllm:pipeline_idle_seconds_total",
                "Wall time with requests running that this stage spent waiting.",
            ))?,
            bubble_fraction: Gauge::with_opts(opts(
                "tinyvllm:pipeline_bubble_fraction",
                "Share of the wall time with requests running that this stage was idle, since start.",
            ))?,
        };
        registry.register(Box::new(m.step_seconds.clone()))?;
        registry.register(Box::new(m.sent_bytes.clone()))?;
        registry.register(Box::new(m.received_bytes.clone()))?;
        registry.register(Box::new(m.wait_seconds.clone()))?;
        if first {
            registry.register(Box::new(m.transfer_seconds.clone()))?;
        }
        registry.register(Box::new(m.active_seconds.clone()))?;
        registry.register(Box::new(m.idle_seconds.clone()))?;
        registry.register(Box::new(m.bubble_fraction.clone()))?;
        Ok(m)
    }

    pub fn computed(&self, d: Duration) {
        self.step_seconds.observe(d.as_secs_f64());
    }

    pub fn sent(&self, bytes: usize) {
        self.sent_bytes.observe(bytes as f64);
    }

    pub fn received(&self, bytes: usize) {
        self.received_bytes.observe(bytes as f64);
    }

    pub fn transfer(&self, d: Duration) {
        self.transfer_seconds.observe(d.as_secs_f64());
    }

    /// `active` of wall time with requests running, `idle` of it waiting.
    pub fn busy_period(&self, active: Duration, idle: Duration) {
        if !idle.is_zero() {
            self.wait_seconds.observe(idle.as_secs_f64());
        }
        self.active_seconds.inc_by(active.as_secs_f64());
        self.idle_seconds.inc_by(idle.as_secs_f64());
        let total = self.active_seconds.get();
        if total > 0.0 {
            self.bubble_fraction.set(self.idle_seconds.get() / total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bubble_fraction_is_idle_over_active_time() {
        let registry = Registry::new();
        let m = PipelineMetrics::new(&registry, "0-3", true).unwrap();
        m.busy_period(Duration::from_millis(300), Duration::from_millis(100));
        m.busy_period(Duration::from_millis(100), Duration::ZERO);
        m.computed(Duration::from_millis(2));
        let text = crate::serve::metrics::render(&registry);
        assert!(text.contains("tinyvllm:pipeline_bubble_fraction{layers=\"0-3\"} 0.25"), "{text}");
        assert!(text.contains("tinyvllm:pipeline_wait_seconds_count{for=\"results\",layers=\"0-3\"} 1"), "{text}");
        assert!(text.contains("tinyvllm:pipeline_step_seconds_count{layers=\"0-3\"} 1"), "{text}");
    }
}
