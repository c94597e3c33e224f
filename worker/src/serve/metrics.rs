//! The worker's Prometheus metrics, under vLLM's names and meanings
//! (`vllm:*`), so dashboards, alerts and routers written for vLLM work
//! unchanged. Every series carries `model_name` and `worker` labels.
//!
//! `EngineMetrics` holds the collectors; `RequestTimings` turns the engine
//! loop's observations (arrival, steps, outputs, finish) into the latency
//! histograms. `metrics_server` exposes the registry over HTTP.

use std::collections::HashMap;
use std::time::Instant;

use common::RequestId;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry, TextEncoder, core::Collector,
};

use engine_core::{RequestOutput, SchedulerStats};

/// vLLM's buckets for request-level latencies (seconds).
const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];
const TTFT_BUCKETS: [f64; 20] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
];
const ITL_BUCKETS: [f64; 18] =
    [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0];
const ITERATION_TOKEN_BUCKETS: [f64; 12] =
    [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0];

pub struct EngineMetrics {
    registry: Registry,
    num_requests_running: prometheus::Gauge,
    num_requests_waiting: prometheus::Gauge,
    kv_cache_usage_perc: prometheus::Gauge,
    prefix_cache_queries: IntCounter,
    prefix_cache_hits: IntCounter,
    num_preemptions: IntCounter,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    request_success: IntCounterVec,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    e2e_request_latency: Histogram,
    request_queue_time: Histogram,
    request_prefill_time: Histogram,
    request_decode_time: Histogram,
    iteration_tokens: Histogram,
    spec_decode_num_drafts: IntCounter,
    spec_decode_num_draft_tokens: IntCounter,
    spec_decode_num_accepted_tokens: IntCounter,
    spec_decode_num_accepted_tokens_per_pos: IntCounterVec,
    /// Last cumulative scheduler counters, to turn them into increments.
    last_stats: SchedulerStats,
    tier: super::tier_metrics::TierMetrics,
}

impl EngineMetrics {
    pub fn new(model_name: &str, worker: &str) -> Self {
        let registry = labelled_registry(model_name, worker);
        let gauge = |name: &str, help: &str| prometheus::Gauge::new(name, help).expect("valid metric");
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).expect("valid metric")
        };
        let m = Self {
            num_requests_running: gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
            num_requests_waiting: gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            kv_cache_usage_perc: gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            prefix_cache_queries: counter(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            prefix_cache_hits: counter(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
            ),
            num_preemptions: counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
            prompt_tokens: counter("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
            generation_tokens: counter("vllm:generation_tokens_total", "Number of generation tokens processed."),
            request_success: IntCounterVec::new(
                Opts::new("vllm:request_success_total", "Count of successfully processed requests."),
                &["finished_reason"],
            )
            .expect("valid metric"),
            time_to_first_token: histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &TTFT_BUCKETS,
            ),
            inter_token_latency: histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &ITL_BUCKETS,
            ),
            e2e_request_latency: histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                &REQUEST_LATENCY_BUCKETS,
            ),
            request_queue_time: histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                &REQUEST_LATENCY_BUCKETS,
            ),
            request_prefill_time: histogram(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                &REQUEST_LATENCY_BUCKETS,
            ),
            request_decode_time: histogram(
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                &REQUEST_LATENCY_BUCKETS,
            ),
            iteration_tokens: histogram(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                &ITERATION_TOKEN_BUCKETS,
            ),
            spec_decode_num_drafts: counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts."),
            spec_decode_num_draft_tokens: counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens."),
            spec_decode_num_accepted_tokens: counter(
                "vllm:spec_decode_num_accepted_tokens_total",
                "Number of accepted tokens.",
            ),
            spec_decode_num_accepted_tokens_per_pos: IntCounterVec::new(
                Opts::new("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position."),
                &["position"],
            )
            .expect("valid metric"),
            tier: super::tier_metrics::TierMetrics::new(&registry),
            registry,
            last_stats: SchedulerStats::default(),
        };
        let collectors: Vec<Box<dyn Collector>> = vec![
            Box::new(m.num_requests_running.clone()),
            Box::new(m.num_requests_waiting.clone()),
            Box::new(m.kv_cache_usage_perc.clone()),
            Box::new(m.prefix_cache_queries.clone()),
            Box::new(m.prefix_cache_hits.clone()),
            Box::new(m.num_preemptions.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.generation_tokens.clone()),
            Box::new(m.request_success.clone()),
            Box::new(m.time_to_first_token.clone()),
            Box::new(m.inter_token_latency.clone()),
            Box::new(m.e2e_request_latency.clone()),
            Box::new(m.request_queue_time.clone()),
            Box::new(m.request_prefill_time.clone()),
            Box::new(m.request_decode_time.clone()),
            Box::new(m.iteration_tokens.clone()),
            Box::new(m.spec_decode_num_drafts.clone()),
            Box::new(m.spec_decode_num_draft_tokens.clone()),
            Box::new(m.spec_decode_num_accepted_tokens.clone()),
            Box::new(m.spec_decode_num_accepted_tokens_per_pos.clone()),
        ];
        for c in collectors {
            m.registry.register(c).expect("unique metric names");
        }
        for reason in ["stop", "length", "abort"] {
            m.request_success.with_label_values(&[reason]);
        }
        m
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The KV cache's configuration, once at start: vLLM's
    /// `vllm:cache_config_info` (1, with the config as labels) and the
    /// tokens the cache holds, which its dtype multiplies.
    pub fn record_cache_config(&self, cache_dtype: &str, block_size: usize, num_blocks: usize) {
        let info = prometheus::GaugeVec::new(
            Opts::new("vllm:cache_config_info", "Information of the LLMEngine CacheConfig."),
            &["cache_dtype", "block_size", "num_gpu_blocks"],
        )
        .expect("valid metric");
        info.with_label_values(&[cache_dtype, &block_size.to_string(), &num_blocks.to_string()]).set(1.0);
        let tokens = prometheus::Gauge::new(
            "tinyvllm_kv_cache_capacity_tokens",
            "Tokens the KV cache holds: blocks x block size.",
        )
        .expect("valid metric");
        tokens.set((block_size * num_blocks) as f64);
        for c in [Box::new(info) as Box<dyn Collector>, Box::new(tokens)] {
            // Called once; a second call keeps the first values.
            let _ = self.registry.register(c);
        }
    }

    /// The scheduler's gauges, and its cumulative counters as increments
    /// (the second tier's with its store's, `store`).
    pub fn observe_stats(&mut self, s: &SchedulerStats, store: Option<crate::tier::StoreStats>) {
        self.tier.observe(&s.tier, store);
        self.num_requests_running.set(s.num_running as f64);
        self.num_requests_waiting.set(s.num_waiting as f64);
        let usage = if s.kv_blocks_total == 0 { 0.0 } else { s.kv_blocks_used as f64 / s.kv_blocks_total as f64 };
        self.kv_cache_usage_perc.set(usage);
        let last = &self.last_stats;
        self.prefix_cache_queries.inc_by(s.prefix_cache.queries.saturating_sub(last.prefix_cache.queries));
        self.prefix_cache_hits.inc_by(s.prefix_cache.hits.saturating_sub(last.prefix_cache.hits));
        self.num_preemptions.inc_by(s.num_preemptions.saturating_sub(last.num_preemptions));
        let (spec, last_spec) = (&s.spec_decoding, &last.spec_decoding);
        self.spec_decode_num_drafts.inc_by(spec.num_drafts.saturating_sub(last_spec.num_drafts));
        self.spec_decode_num_draft_tokens.inc_by(spec.num_draft_tokens.saturating_sub(last_spec.num_draft_tokens));
        self.spec_decode_num_accepted_tokens
            .inc_by(spec.num_accepted_tokens.saturating_sub(last_spec.num_accepted_tokens));
        for (pos, &n) in spec.accepted_per_pos.iter().enumerate() {
            let before = last_spec.accepted_per_pos.get(pos).copied().unwrap_or(0);
            self.spec_decode_num_accepted_tokens_per_pos.with_label_values(&[&pos.to_string()]).inc_by(n - before);
        }
        self.last_stats = s.clone();
    }

    /// Prometheus text exposition of everything.
    pub fn render(&self) -> String {
        render(&self.registry)
    }
}

/// A registry whose series all carry `model_name` and `worker`, with the
/// process's own metrics (resident memory, CPU) on Linux.
pub fn labelled_registry(model_name: &str, worker: &str) -> Registry {
    let labels = HashMap::from([("model_name".to_string(), model_name.into()), ("worker".to_string(), worker.into())]);
    let registry = Registry::new_custom(None, Some(labels)).expect("valid labels");
    #[cfg(target_os = "linux")]
    registry
        .register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))
        .expect("unique metric names");
    registry
}

pub fn render(registry: &Registry) -> String {
    let mut out = Vec::new();
    let _ = TextEncoder::new().encode(&registry.gather(), &mut out);
    String::from_utf8(out).unwrap_or_default()
}

/// When each phase of a request began.
struct Timing {
    arrived: Instant,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

/// Per-request clocks, fed by the engine loop.
#[derive(Default)]
pub struct RequestTimings {
    requests: HashMap<RequestId, Timing>,
}

impl RequestTimings {
    pub fn arrived(&mut self, id: RequestId, now: Instant) {
        self.requests.insert(id, Timing { arrived: now, scheduled: None, first_token: None, last_token: None });
    }

    /// A step ran with these requests and this many tokens.
    pub fn stepped(&mut self, m: &EngineMetrics, scheduled: &[RequestId], num_batched_tokens: usize, now: Instant) {
        if num_batched_tokens > 0 {
            m.iteration_tokens.observe(num_batched_tokens as f64);
        }
        for id in scheduled {
            if let Some(t) = self.requests.get_mut(id).filter(|t| t.scheduled.is_none()) {
                t.scheduled = Some(now);
                m.request_queue_time.observe((now - t.arrived).as_secs_f64());
            }
        }
    }

    pub fn output(&mut self, m: &EngineMetrics, o: &RequestOutput, now: Instant) {
        let Some(t) = self.requests.get_mut(&o.id) else { return };
        let n = o.new_token_ids.len();
        if n > 0 {
            m.generation_tokens.inc_by(n as u64);
            match t.last_token {
                None => {
                    m.time_to_first_token.observe((now - t.arrived).as_secs_f64());
                    m.request_prefill_time.observe((now - t.scheduled.unwrap_or(t.arrived)).as_secs_f64());
                    m.prompt_tokens.inc_by(o.num_prompt_tokens as u64);
                    t.first_token = Some(now);
                }
                Some(last) => {
                    // Tokens coalesced into one delta share the gap.
                    let gap = (now - last).as_secs_f64() / n as f64;
                    for _ in 0..n {
                        m.inter_token_latency.observe(gap);
                    }
                }
            }
            t.last_token = Some(now);
        }
        if let Some(reason) = o.finish_reason {
            let Some(t) = self.requests.remove(&o.id) else { return };
            m.request_success.with_label_values(&[reason.as_str()]).inc();
            m.e2e_request_latency.observe((now - t.arrived).as_secs_f64());
            if let Some(first) = t.first_token {
                m.request_decode_time.observe((now - first).as_secs_f64());
            }
        }
    }

    /// The request ended without an output (aborted by the coordinator).
    pub fn aborted(&mut self, m: &EngineMetrics, id: RequestId, now: Instant) {
        if let Some(t) = self.requests.remove(&id) {
            m.request_success.with_label_values(&["abort"]).inc();
            m.e2e_request_latency.observe((now - t.arrived).as_secs_f64());
        }
    }
}
