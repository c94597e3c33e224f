//! The coordinator's own Prometheus metrics (`tinyvllm_` prefix), served
//! at `/metrics`. Worker engine metrics are the workers' own.

use std::time::Duration;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use hyper::StatusCode;

use crate::cluster::{Cluster, RoutingMetrics, WorkerState};

/// Latency buckets in seconds (vLLM's TTFT buckets, extended for CPU workers).
const LATENCY_BUCKETS: [f64; 17] =
    [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0];

pub struct Metrics {
    registry: Registry,
    http_requests: IntCounterVec,
    http_latency: HistogramVec,
    ttft: HistogramVec,
    e2e: HistogramVec,
    rejected: IntCounterVec,
    connections_refused: IntCounterVec,
    workers: IntGaugeVec,
    in_flight: IntGauge,
    queue_depth: IntGauge,
    generated_tokens: IntCounter,
}

impl Metrics {
    pub fn new(routing: &RoutingMetrics) -> Self {
        let registry = Registry::new();
        let http_requests = IntCounterVec::new(
            Opts::new("tinyvllm_http_requests_total", "HTTP requests by endpoint and status"),
            &["endpoint", "status"],
        )
        .expect("valid metric");
        let http_latency = HistogramVec::new(
            HistogramOpts::new(
                "tinyvllm_http_request_duration_seconds",
                "Time to the response head (streams: to the first byte)",
            )
            .buckets(vec![0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]),
            &["endpoint"],
        )
        .expect("valid metric");
        let rejected = IntCounterVec::new(
            Opts::new("tinyvllm_rejected_requests_total", "Requests refused, by reason"),
            &["reason"],
        )
        .expect("valid metric");
        let connections_refused = IntCounterVec::new(
            Opts::new(
                "tinyvllm_http_connections_refused_total",
                "HTTP connections refused or closed by the connection cap, and accept errors, by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let workers =
            IntGaugeVec::new(Opts::new("tinyvllm_workers", "Workers by state"), &["state"]).expect("valid metric");
        let in_flight =
            IntGauge::new("tinyvllm_requests_in_flight", "Requests dispatched and not finished").expect("valid metric");
        let queue_depth =
            IntGauge::new("tinyvllm_queue_depth", "Requests dispatched that have not produced their first token")
                .expect("valid metric");
        let ttft = HistogramVec::new(
            HistogramOpts::new("tinyvllm_time_to_first_token_seconds", "Client-seen time to the first token")
                .buckets(LATENCY_BUCKETS.to_vec()),
            &["endpoint"],
        )
        .expect("valid metric");
        let e2e = HistogramVec::new(
            HistogramOpts::new(
                "tinyvllm_e2e_request_latency_seconds",
                "Client-seen time from arrival to the last token",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["endpoint"],
        )
        .expect("valid metric");
        let generated_tokens =
            IntCounter::new("tinyvllm_generation_tokens_total", "Tokens generated for clients, all endpoints")
                .expect("valid metric");
        for c in [
            Box::new(http_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(generated_tokens.clone()),
            Box::new(http_latency.clone()),
            Box::new(ttft.clone()),
            Box::new(e2e.clone()),
            Box::new(rejected.clone()),
            Box::new(connections_refused.clone()),
            Box::new(workers.clone()),
            Box::new(in_flight.clone()),
            Box::new(queue_depth.clone()),
            Box::new(routing.decisions.clone()),
            Box::new(routing.predicted_cached_tokens.clone()),
            Box::new(routing.actual_cached_tokens.clone()),
            Box::new(routing.redispatches.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        // Series that exist from the start, so dashboards show 0, not "no data".
        for reason in
            ["invalid_request", "unauthorized", "not_found", "too_large", "timeout", "overloaded", "unavailable"]
        {
            rejected.with_label_values(&[reason]);
        }
        for reason in ["full", "evicted_idle", "accept_error"] {
            connections_refused.with_label_values(&[reason]);
        }
        Self {
            registry,
            http_requests,
            http_latency,
            ttft,
            e2e,
            rejected,
            connections_refused,
            workers,
            in_flight,
            queue_depth,
            generated_tokens,
        }
    }

    /// Tokens a step sent to a client.
    pub fn tokens_generated(&self, n: usize) {
        self.generated_tokens.inc_by(n as u64);
    }

    pub fn first_token(&self, endpoint: &str, elapsed: Duration) {
        self.ttft.with_label_values(&[endpoint]).observe(elapsed.as_secs_f64());
    }

    pub fn request_finished(&self, endpoint: &str, elapsed: Duration) {
        self.e2e.with_label_values(&[endpoint]).observe(elapsed.as_secs_f64());
    }

    /// Known endpoints by name; anything else is "other" (bounded label values).
    fn endpoint(path: &str) -> &'static str {
        match path {
            "/generate" => "/generate",
            "/v1/completions" => "/v1/completions",
            "/v1/chat/completions" => "/v1/chat/completions",
            "/v1/messages" => "/v1/messages",
            "/v1/messages/count_tokens" => "/v1/messages/count_tokens",
            "/v1/responses" => "/v1/responses",
            "/v1/models" => "/v1/models",
            "/v1/workers" => "/v1/workers",
            "/tokenize" => "/tokenize",
            "/detokenize" => "/detokenize",
            "/v1/prometheus/targets" => "/v1/prometheus/targets",
            "/health" => "/health",
            "/metrics" => "/metrics",
            _ => "other",
        }
    }

    pub fn http_request(&self, path: &str, status: u16, elapsed: Duration) {
        let endpoint = Self::endpoint(path);
        self.http_requests.with_label_values(&[endpoint, &status.to_string()]).inc();
        self.http_latency.with_label_values(&[endpoint]).observe(elapsed.as_secs_f64());
    }

    /// A request refused with `status`, counted by reason.
    pub fn rejected(&self, status: StatusCode) {
        let reason = match status.as_u16() {
            400 => "invalid_request",
            401 => "unauthorized",
            404 => "not_found",
            408 => "timeout",
            413 | 414 | 431 => "too_large",
            415 => "invalid_request",
            429 => "overloaded",
            503 => "unavailable",
            _ => "other",
        };
        self.rejected.with_label_values(&[reason]).inc();
    }

    /// A connection the cap refused (`full`), an idle one it closed to make
    /// room (`evicted_idle`), or a failed accept (`accept_error`).
    pub fn connection_refused(&self, reason: &str) {
        self.connections_refused.with_label_values(&[reason]).inc();
    }

    pub fn render(&self, cluster: &Cluster) -> String {
        let workers = cluster.workers();
        for state in [WorkerState::Ready, WorkerState::Draining] {
            let n = workers.iter().filter(|w| w.state == state).count();
            self.workers.with_label_values(&[state.as_str()]).set(n as i64);
        }
        self.in_flight.set(cluster.in_flight() as i64);
        self.queue_depth.set(cluster.queued() as i64);
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}
