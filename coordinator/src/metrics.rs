//! The coordinator's own Prometheus metrics (`tinyvllm_` prefix), served
//! at `/metrics`. Worker engine metrics are the workers' own.

use std::time::Duration;

use prometheus::{Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::api::ApiError;
use crate::app::AppState;

pub struct Metrics {
    registry: Registry,
    http_requests: IntCounterVec,
    http_latency: HistogramVec,
    rejected: IntCounterVec,
    workers: IntGaugeVec,
    in_flight: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Self {
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
        let workers =
            IntGaugeVec::new(Opts::new("tinyvllm_workers", "Workers by state"), &["state"]).expect("valid metric");
        let in_flight =
            IntGaugeVec::new(Opts::new("tinyvllm_requests_in_flight", "Requests dispatched and not finished"), &[])
                .expect("valid metric");
        for c in [
            Box::new(http_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(http_latency.clone()),
            Box::new(rejected.clone()),
            Box::new(workers.clone()),
            Box::new(in_flight.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        Self { registry, http_requests, http_latency, rejected, workers, in_flight }
    }

    /// Known endpoints by name; anything else is "other" (bounded label values).
    fn endpoint(path: &str) -> &'static str {
        match path {
            "/generate" => "/generate",
            "/v1/completions" => "/v1/completions",
            "/v1/chat/completions" => "/v1/chat/completions",
            "/v1/models" => "/v1/models",
            "/v1/workers" => "/v1/workers",
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

    pub fn rejected(&self, e: &ApiError) {
        let reason = match e.status.as_u16() {
            400 => "invalid_request",
            401 => "unauthorized",
            404 => "not_found",
            413 => "too_large",
            429 => "overloaded",
            503 => "unavailable",
            _ => "other",
        };
        self.rejected.with_label_values(&[reason]).inc();
    }

    pub fn render(&self, app: &AppState) -> String {
        let workers = app.cluster.workers();
        for state in ["ready", "draining"] {
            let n = workers.iter().filter(|w| format!("{:?}", w.state).to_lowercase() == state).count();
            self.workers.with_label_values(&[state]).set(n as i64);
        }
        self.in_flight.with_label_values::<&str>(&[]).set(app.cluster.in_flight() as i64);
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
